"""Per-site selectors: which matmuls a float8 recipe runs in float8.

A *selector* is a callable ``select(site, shape)`` of a candidate's name stack
(``site``: a Flax module path, ``jax.named_scope`` names, ``""`` at the top
level) and its sizes ``shape = (m, k, n)`` that returns a
:class:`~jaxscale._speed.Format` (or a bool: ``True`` float8, ``False`` 16
bits), or ``None``: no opinion, ask the next selector. It is the one form of
every per-site choice (Transformer Engine's ``CustomRecipe(qfactory)`` and
torchao's ``module_filter_fn(module, fqn)`` are the same idea): a recipe's
``sites`` patterns (:class:`Patterns`), its ``min_dim`` (:class:`MinDim`), the
cost model (:class:`~jaxscale.float8._choice.SpeedModel`), a precision plan
(``jxs.precision.Plan.select``) and any function passed as a recipe's
``select=`` (:class:`UserSelect`). A recipe asks its selectors in order
(:func:`first`); each built-in one also says why (:meth:`Patterns.explain`), in
the words the float8 report prints.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from jaxscale._speed import Format

__all__ = [
    "Choice",
    "MinDim",
    "Patterns",
    "UserSelect",
    "check_select",
    "first",
]

Shape = tuple[int, int, int]


class Choice(NamedTuple):
    """What a recipe decided for one candidate: ``float8``, and ``why`` in
    words; ``by`` is ``"pattern"``, ``"select"``, ``"min_dim"`` or ``"model"``."""

    float8: bool
    why: str
    by: str


def _choice(float8: bool, reason: str, by: str) -> Choice:
    return Choice(float8, f"{'float8' if float8 else '16 bits'}: {reason}", by)


class _Selector:
    """The built-in selectors' call: the format of :meth:`explain`'s choice."""

    fmt: Format

    def explain(self, site: str, shape: Shape) -> Choice | None:
        raise NotImplementedError

    def __call__(self, site: str, shape: Shape) -> Format | None:
        c = self.explain(site, shape)
        return None if c is None else (self.fmt if c.float8 else Format.HALF)


@dataclasses.dataclass(frozen=True)
class Patterns(_Selector):
    """A recipe's ``sites``: the first ``(pattern, flag)`` whose regular
    expression is found (``re.search``) in the site's name stack decides."""

    sites: tuple[tuple[str, bool], ...]
    fmt: Format = Format.FLOAT8

    def explain(self, site: str, shape: Shape) -> Choice | None:
        for pattern, flag in self.sites:
            if re.search(pattern, site):
                return _choice(flag, f"pattern '{pattern}' says so", "pattern")
        return None


@dataclasses.dataclass(frozen=True)
class MinDim(_Selector):
    """A recipe's integer ``min_dim``: float8 where M, K and N all reach it (at
    least 1); decides every site."""

    min_dim: int
    fmt: Format = Format.FLOAT8

    def explain(self, site: str, shape: Shape) -> Choice:
        m, k, n = shape
        if min(shape) >= max(self.min_dim, 1):
            return _choice(True, f"M, K, N >= min_dim {self.min_dim}", "min_dim")
        why = f"below min_dim {self.min_dim} (M={m}, K={k}, N={n})"
        return _choice(False, why, "min_dim")


@dataclasses.dataclass(frozen=True)
class UserSelect(_Selector):
    """A recipe's ``select``: the user's function, its answer checked."""

    fn: Callable[[str, Shape], Any]
    fmt: Format = Format.FLOAT8

    def explain(self, site: str, shape: Shape) -> Choice | None:
        got = self.fn(site, tuple(shape))
        if got is None:
            return None
        name = getattr(self.fn, "__qualname__", type(self.fn).__name__)
        if isinstance(got, bool | np.bool_):
            return _choice(bool(got), f"`select` ({name}) says so", "select")
        if got is self.fmt or got is Format.HALF:
            return _choice(got is self.fmt, f"`select` ({name}) says so", "select")
        if isinstance(got, Format):
            other = (
                "jxs.float8.RowwiseScaling"
                if got is Format.FLOAT8_ROWWISE
                else "jxs.float8.CurrentScaling"
                if got is Format.FLOAT8
                else "`jxs.autocast(f, dtype, plan=plan)`, which runs every format,"
            )
            raise ValueError(
                f"`select` ({name}) returned {got} for the site {site!r} "
                f"(m, k, n = {tuple(shape)}), but this recipe runs a matmul in "
                f"{self.fmt.value} or in 16 bits only (True, False, "
                f"{self.fmt}, {Format.HALF} or None). Use {other} for that site."
            )
        raise TypeError(
            f"`select` ({name}) must return True (float8), False (16 bits), a "
            f"Format ({self.fmt} or {Format.HALF}) or None (no opinion), got "
            f"{type(got).__name__} {got!r} for the site {site!r}."
        )


def check_select(value: Any) -> Any:
    """A recipe's ``select``: ``None`` or a callable, else a ``TypeError``."""
    if value is not None and not callable(value):
        raise TypeError(
            "`select` must be None or a callable `(site, shape) -> bool | Format | "
            "None` of a matmul's name stack and its (m, k, n) (e.g. "
            "`plan.select`, or a torchao-style filter `lambda site, shape: "
            f"'head' not in site`), got {type(value).__name__} {value!r}."
        )
    return value


def first(selectors: Sequence[Any], site: str, shape: Shape) -> Choice | None:
    """The choice of the first of ``selectors`` (built-in ones, with
    ``explain``) that has an opinion on ``site``; ``None`` if none has."""
    for s in selectors:
        c = s.explain(site, shape)
        if c is not None:
            return c
    return None
