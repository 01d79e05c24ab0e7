"""Flax NNX modules as arguments of :func:`jaxscale.value_and_grad`.

An ``nnx.Module`` is a mutable object, not a pytree of parameters: handed to
``jax.value_and_grad`` as it is, its BatchNorm statistics would be
"differentiated" and their updates dropped, and Dropout's integer RNG counts
would make JAX refuse the gradient. Here a module in a differentiated position is
split (``nnx.split``) into the parameters to differentiate (``wrt``, by default
``nnx.Param``) and the rest (batch statistics, RNG counts, caches), the loss is
evaluated on a merged copy, the rest comes out as an auxiliary value, and the
module is updated with it afterwards, as ``nnx.value_and_grad`` does. The
functional form lets :func:`jaxscale.accumulate_value_and_grad` carry the rest
through its ``lax.scan`` over micro-batches.

Nothing here imports Flax unless an argument is an NNX object.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

import jax

__all__ = ["NnxArgs", "check_all_modules", "is_module", "module_positions"]


def is_module(x: Any) -> bool:
    """Whether ``x`` is a Flax NNX module (never imports Flax: a module can only
    exist if the user has imported it)."""
    nnx = sys.modules.get("flax.nnx")
    return nnx is not None and isinstance(x, nnx.Module)


def module_positions(args: Sequence[Any], argnums: Sequence[int]) -> tuple[int, ...]:
    """The differentiated positions that hold an NNX module."""
    return tuple(i for i in argnums if i < len(args) and is_module(args[i]))


def default_wrt(holder: Any) -> Any:
    """The optimizer's ``wrt`` filter if it has one, else ``nnx.Param``."""
    from flax import nnx

    return getattr(holder, "wrt", None) or nnx.Param


class NnxArgs:
    """The modules at ``positions`` of ``args``, split into params and the rest."""

    def __init__(self, args: Sequence[Any], positions: tuple[int, ...], wrt: Any):
        from flax import nnx

        self.positions = positions
        self.modules = {i: args[i] for i in positions}
        self.defs, self.params, self.rests = {}, {}, {}
        for i in positions:
            graphdef, params, rest = nnx.split(args[i], wrt, ...)
            self.defs[i], self.params[i], self.rests[i] = graphdef, params, rest
        self.wrt = wrt

    def pure(self, fun: Callable[..., Any]) -> Callable[..., Any]:
        """``fun`` as ``f(params, rests, *args, **kwargs) -> (out, new_rests)``.

        ``params`` and ``rests`` are dicts keyed by position; the modules in
        ``args`` at those positions are ignored (rebuilt from the states).
        """
        from flax import nnx

        def f(params, rests, *args, **kwargs):
            full = list(args)
            for i in self.positions:
                # Fresh variable objects, created at this trace level, so the
                # module may update its statistics here.
                p, r = jax.tree.map(lambda x: x, (params[i], rests[i]))
                full[i] = nnx.merge(self.defs[i], p, r)
            out = fun(*full, **kwargs)
            new = {i: nnx.split(full[i], self.wrt, ...)[2] for i in self.positions}
            return out, new

        return f

    def grad_call(
        self,
        fun: Callable[..., Any],
        loss_scale: Any,
        has_aux: bool,
        argnums: Any,
        kwargs: dict[str, Any],
    ) -> tuple[Callable[..., Any], Callable[..., Any]]:
        """``(call, finish)`` for the scaled loss of ``fun``.

        ``call(args, rests) -> (out, grads, new_rests)`` differentiates the
        scaled loss with respect to the modules' parameters, with the modules'
        other state given as ``rests`` (so a loop can carry it);
        ``finish(grads, rests)`` writes the final ``rests`` back into the
        modules and shapes the gradients as ``argnums`` asks.
        """
        from jaxscale._transform import value_and_grad

        pure = self.pure(fun)

        def pure_aux(params, rests, *a, **kw):
            out, new_rests = pure(params, rests, *a, **kw)
            loss, aux = out if has_aux else (out, None)
            return loss, (aux, new_rests)

        vg = value_and_grad(pure_aux, loss_scale, argnums=0, has_aux=True)

        def call(args, rests):
            stripped = [None if i in self.positions else x for i, x in enumerate(args)]
            (loss, (aux, new_rests)), grads = vg(
                self.params, rests, *stripped, **kwargs
            )
            return ((loss, aux) if has_aux else loss), grads, new_rests

        def finish(grads, rests):
            self.write_back(rests)
            return self.grads_out(grads, argnums)

        return call, finish

    def write_back(self, rests: dict[int, Any]) -> None:
        """Updates the caller's modules with the new non-differentiated state."""
        from flax import nnx

        for i in self.positions:
            nnx.update(self.modules[i], rests[i])

    def grads_out(self, grads: dict[int, Any], argnums: Any) -> Any:
        """Gradients in the shape ``argnums`` asks for (an int: one State)."""
        if isinstance(argnums, int):
            return grads[argnums]
        return tuple(grads[i] for i in argnums)


def check_all_modules(positions: tuple[int, ...], argnums: tuple[int, ...]) -> None:
    """Raises if NNX modules and plain arrays are differentiated together."""
    if set(positions) != set(argnums):
        raise TypeError(
            f"`argnums` {argnums} mixes Flax NNX modules (at {positions}) with other "
            "arguments: differentiate either modules (their `nnx.Param`s) or "
            "pytrees of arrays. Put the arrays in an `nnx.Param` of a module, or "
            "call `jxs.value_and_grad` on `nnx.split` states."
        )
