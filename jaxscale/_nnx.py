"""Flax NNX objects as arguments of :func:`jaxscale.value_and_grad`.

An ``nnx.Module`` is a mutable object, not a pytree of parameters: handed to
``jax.value_and_grad`` as it is, its BatchNorm statistics would be
"differentiated" and their updates dropped, and Dropout's integer RNG counts
would make JAX refuse the gradient. Here every NNX object among the arguments
(a module, an ``nnx.Rngs`` passed to the loss, in any position or keyword) is
split once, all together (``nnx.split``, so variables they share stay one),
into the parameters to differentiate (``wrt``, by default ``nnx.Param``, of the
objects in differentiated positions) and the rest (batch statistics, RNG keys
and counts, caches, the other objects whole). The loss runs on merged copies,
the rest comes out as an auxiliary value, and the objects are updated with it
afterwards, as ``nnx.value_and_grad`` does. The functional form lets
:func:`jaxscale.accumulate_value_and_grad` carry the rest through its
``lax.scan`` over micro-batches.

This module is the one home of every NNX question (is this a module, a
variable, an ``nnx.State``; unwrap; split, merge and write back), on the ground
floor: it imports nothing of jaxscale. Differentiation is handed in by the
caller (:meth:`NnxArgs.grad_call` takes the ``value_and_grad`` to use), as the
autocast interpreter is handed its higher-order handlers.

Nothing here imports Flax unless an argument is an NNX object.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax

__all__ = [
    "NnxArgs",
    "argnum_tuple",
    "default_wrt",
    "explain_trace_errors",
    "has_objects",
    "is_object",
    "is_state",
    "is_variable",
    "unwrap",
    "write_back",
]


def _nnx() -> Any:
    """``flax.nnx`` if the user has imported it, else ``None`` (an NNX object
    can only exist if they have).

    Raises:
      ImportError: if it is older than flax 0.12.0, the declared floor (no
        ``nnx.Pytree``).
    """
    nnx = sys.modules.get("flax.nnx")
    if nnx is not None and not hasattr(nnx, "Pytree"):
        version = getattr(sys.modules.get("flax"), "__version__", "< 0.12")
        raise ImportError(
            f"jaxscale's Flax NNX support needs flax >= 0.12.0, found flax "
            f"{version}. Upgrade with `pip install -U 'flax>=0.12'`: under flax "
            "0.11 a loss that closes over a split module loses its BatchNorm and "
            "RNG updates without an error."
        )
    return nnx


def is_object(x: Any) -> bool:
    """Whether ``x`` is a Flax NNX object (a module, ``nnx.Rngs``, an
    ``nnx.Optimizer``...): ``nnx.Pytree``."""
    nnx = _nnx()
    if nnx is None:
        return False
    return isinstance(x, nnx.Pytree)


def is_state(x: Any) -> bool:
    """Whether ``x`` is an ``nnx.State`` (what ``nnx.split`` returns)."""
    nnx = _nnx()
    return nnx is not None and isinstance(x, nnx.State)


def is_variable(x: Any) -> bool:
    """Whether ``x`` is a Flax NNX variable (``nnx.Param``, ``nnx.OptArray``...):
    a leaf that wraps one array."""
    nnx = _nnx()
    return nnx is not None and isinstance(x, nnx.Variable)


def unwrap(x: Any) -> Any:
    """The array inside an NNX variable; anything else unchanged."""
    if not is_variable(x):
        return x
    return x.get_value() if hasattr(x, "get_value") else x.value  # flax 0.12.0


def has_objects(args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    """Whether any positional or keyword argument is an NNX object.

    Raises:
      TypeError: if an argument holds an NNX object inside a container (it
        would go through ``jax.value_and_grad`` as a pytree).
    """
    if _nnx() is None:
        return False
    named = [*((f"args[{i}]", x) for i, x in enumerate(args)), *kwargs.items()]
    for name, x in named:
        if not is_object(x) and any(
            map(is_object, jax.tree.leaves(x, is_leaf=is_object))
        ):
            raise TypeError(
                f"`{name}` holds a Flax NNX object inside a "
                f"{type(x).__name__}: pass modules and `nnx.Rngs` as arguments of "
                "the loss themselves, so that their parameters are differentiated "
                "and their other state (BatchNorm statistics, RNG counts) is "
                "updated."
            )
    return any(map(is_object, args)) or any(map(is_object, kwargs.values()))


@contextlib.contextmanager
def explain_trace_errors() -> Iterator[None]:
    """Re-raises Flax's ``TraceContextError`` from inside the micro-batch scan
    with the fix (0.1.0's documented recipe closed over a split module)."""
    try:
        yield
    except Exception as e:
        if type(e).__name__ != "TraceContextError":
            raise
        raise TypeError(
            "A Flax NNX variable was updated inside the micro-batches of "
            "`jxs.accumulate_value_and_grad` on an object that the loss reaches "
            "through a closure (e.g. `nnx.merge(graphdef, params, rest)` with "
            "`rest` split outside). Pass the module, and any `nnx.Rngs`, to the "
            "returned function as arguments instead, e.g. "
            "`jxs.accumulate_value_and_grad(loss_fn, optimizer, "
            "num_microbatches=k)(model, x, y)`: their state (BatchNorm "
            "statistics, RNG counts) is then carried through the micro-batches."
        ) from e


def default_wrt(holder: Any) -> Any:
    """The optimizer's ``wrt`` filter if it has one, else ``nnx.Param``."""
    from flax import nnx

    wrt = getattr(holder, "wrt", None) if is_object(holder) else None
    return wrt if wrt is not None else nnx.Param


def argnum_tuple(argnums: int | Sequence[int]) -> tuple[int, ...]:
    """``argnums`` as a tuple, as JAX accepts it (an int or a sequence)."""
    return (argnums,) if isinstance(argnums, int) else tuple(argnums)


class NnxArgs:
    """The NNX objects among ``args`` and ``kwargs``, split into the parameters
    to differentiate and the rest.

    Either every differentiated position holds an NNX object (their ``wrt``
    variables are differentiated; the gradients are ``nnx.State``\\ s), or none
    does (the arrays there are differentiated as by ``jax.value_and_grad``, and
    the NNX objects elsewhere, e.g. an ``nnx.Rngs``, are carried).
    """

    def __init__(
        self,
        args: Sequence[Any],
        kwargs: dict[str, Any],
        argnums: int | Sequence[int],
        wrt: Any,
    ):
        from flax import nnx

        self.argnums = argnums
        diff = argnum_tuple(argnums)
        self.positions = tuple(i for i, x in enumerate(args) if is_object(x))
        self.names = tuple(sorted(k for k, v in kwargs.items() if is_object(v)))
        diff_objects = tuple(i for i in diff if i in self.positions)
        if diff_objects and diff_objects != diff:
            raise TypeError(
                f"`argnums` {diff} mixes Flax NNX objects (at {diff_objects}) with "
                "other arguments: differentiate either modules (their "
                "`nnx.Param`s) or pytrees of arrays. Put the arrays in an "
                "`nnx.Param` of a module, or call `jxs.value_and_grad` on "
                "`nnx.split` states."
            )
        self.diff_objects = diff_objects
        self.objects = (
            {i: args[i] for i in self.positions},
            {k: kwargs[k] for k in self.names},
        )
        wanted = nnx.filterlib.to_predicate(wrt)

        def is_param(path: tuple[Any, ...], value: Any) -> bool:
            return (
                len(path) > 1
                and path[0] == 0
                and path[1] in diff_objects
                and wanted(path, value)
            )

        self.is_param = is_param
        self.graphdef, self.params, self.rest = nnx.split(self.objects, is_param, ...)

    def pure(self, fun: Callable[..., Any]) -> Callable[..., Any]:
        """``fun`` as ``f(params, rest, *args, **kwargs) -> (out, new_rest)``;
        the NNX objects in ``args`` and ``kwargs`` are ignored (rebuilt from
        the states)."""
        from flax import nnx

        def f(params, rest, *args, **kwargs):
            # Fresh variable objects, created at this trace level, so that the
            # loss may update statistics and RNG counts here.
            params, rest = jax.tree.map(lambda x: x, (params, rest))
            objects = nnx.merge(self.graphdef, params, rest)
            args, kwargs = list(args), dict(kwargs)
            for i in self.positions:
                args[i] = objects[0][i]
            for k in self.names:
                kwargs[k] = objects[1][k]
            out = fun(*args, **kwargs)
            return out, nnx.split(objects, self.is_param, ...)[2]

        return f

    def grad_call(
        self,
        value_and_grad: Callable[..., Callable[..., Any]],
        fun: Callable[..., Any],
        has_aux: bool,
    ) -> tuple[Callable[..., Any], Any, Callable[..., Any]]:
        """``(call, rest, finish)`` for the loss ``fun``, differentiated by
        ``value_and_grad(f, argnums=..., has_aux=True)`` (the caller's: e.g.
        the scaled-loss gradient of ``jxs.value_and_grad``).

        ``call(args, kwargs, rest) -> (out, grads, new_rest)`` differentiates
        the scaled loss with the objects' other state given as ``rest`` (so a
        loop can carry it, starting from the ``rest`` returned here);
        ``finish(grads, rest)`` writes the final ``rest`` back into the
        objects and shapes the gradients as ``argnums`` asks.
        """
        pure = self.pure(fun)

        def pure_aux(params, rest, *a, **kw):
            out, new_rest = pure(params, rest, *a, **kw)
            loss, aux = out if has_aux else (out, None)
            return loss, (aux, new_rest)

        if self.diff_objects:
            argnums: Any = 0
        elif isinstance(self.argnums, int):
            argnums = self.argnums + 2
        else:
            argnums = tuple(i + 2 for i in self.argnums)
        vg = value_and_grad(pure_aux, argnums=argnums, has_aux=True)

        def call(args, kwargs, rest):
            args = [None if i in self.positions else x for i, x in enumerate(args)]
            kwargs = {k: None if k in self.names else v for k, v in kwargs.items()}
            (loss, (aux, new_rest)), grads = vg(self.params, rest, *args, **kwargs)
            return ((loss, aux) if has_aux else loss), grads, new_rest

        def finish(grads, rest):
            from flax import nnx

            nnx.update(self.objects, rest)
            if not self.diff_objects:
                return grads
            if isinstance(self.argnums, int):
                return grads[0][self.argnums]
            return tuple(grads[0][i] for i in self.argnums)

        return call, self.rest, finish


def write_back(variables: Any, old: Any, new: Any) -> None:
    """Sets each NNX variable of ``variables`` whose unwrapped value ``old``
    became another array in ``new`` (trees of the same structure)."""
    flat_vars = jax.tree.leaves(variables, is_leaf=is_variable)
    for var, a, b in zip(
        flat_vars, jax.tree.leaves(old), jax.tree.leaves(new), strict=True
    ):
        if a is b:
            continue
        if not is_variable(var):
            raise TypeError(
                "`state` must hold its jaxscale arrays in NNX variables to be "
                f"repaired in place, got a {type(var).__name__} leaf."
            )
        if hasattr(var, "set_value"):
            var.set_value(b)
        else:  # flax 0.12.0
            var.value = b
