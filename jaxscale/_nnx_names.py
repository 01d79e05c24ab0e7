"""Flax NNX module paths as name scopes, so that NNX models' matmul sites
(:mod:`jaxscale.precision`), float8 sites and autocast report sources are
named by layer, as Flax linen's are.

NNX pushes no name scope, so without this every matmul site of an NNX model is
named ``(top level)#k``. While jaxscale traces a function
(:func:`named_modules`, around the ``jax.make_jaxpr`` of
:func:`jaxscale._autocast.entry.interpret`), the ``__call__`` of every
``nnx.Module`` class is wrapped: a module that the trace's ``_Naming`` knows runs
under ``jax.named_scope`` of its path (the part below the module it is called
from). Outside such a trace, and in other threads and contexts, the wrapper
calls the method as it is. Scopes set the equations' name stacks only: the
program and its values do not change.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import jax

from jaxscale._nnx import is_object

__all__ = ["named_modules"]

_NAMING: contextvars.ContextVar[_Naming | None] = contextvars.ContextVar(
    "jaxscale_nnx_naming", default=None
)
_PATCH_LOCK = threading.Lock()
_patched: dict[type, Any] = {}  # class -> its own `__call__`, while wrapped
_users = 0


class _Naming:
    """The module paths of one trace: ``paths`` (``id`` -> ``(module, path)``;
    the module is kept so that its ``id`` is not reused) and the modules whose
    ``__call__`` is running (``stack``, innermost last)."""

    def __init__(self) -> None:
        self.paths: dict[int, tuple[Any, str]] = {}
        self.stack: list[tuple[Any, str]] = []

    def add(self, root: Any, prefix: str = "") -> None:
        """Names ``root``'s modules by their graph paths below ``prefix``; a
        module already named keeps its name (its first path)."""
        from flax import nnx

        for path, node in nnx.graph.iter_graph(root):
            if isinstance(node, nnx.Module) and id(node) not in self.paths:
                name = "/".join([prefix, *map(str, path)] if prefix else map(str, path))
                self.paths[id(node)] = (node, name)

    def scope(self, module: Any) -> str | None:
        """The name scope to push for a call of ``module``: ``None`` for a
        nested call of the module running (``super().__call__``); ``""`` for
        none. A module called outside every named one that is not named yet
        is a root (a model merged inside the function): its modules are
        named from it. One met inside a named module (an ``nnx.scan`` or
        ``nnx.vmap`` body's copy) is named by the paths below it."""
        if self.stack and self.stack[-1][0] is module:
            return None
        if id(module) not in self.paths:
            self.add(module)
        path = self.paths[id(module)][1]
        outer = self.stack[-1][1] if self.stack else ""
        if outer and path.startswith(outer + "/"):
            return path[len(outer) + 1 :]
        return "" if path == outer else path


def _wrap(call: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(call)
    def __call__(self, *args, **kwargs):
        naming = _NAMING.get()
        scope = None if naming is None else naming.scope(self)
        if scope is None:
            return call(self, *args, **kwargs)
        naming.stack.append((self, naming.paths[id(self)][1]))
        try:
            with jax.named_scope(scope) if scope else contextlib.nullcontext():
                return call(self, *args, **kwargs)
        finally:
            naming.stack.pop()

    __call__._jaxscale_named = True  # type: ignore[attr-defined]
    return __call__


def _module_classes(nnx: Any) -> list[type]:
    """``nnx.Module`` and its subclasses that define ``__call__`` themselves."""
    found, todo = [], [nnx.Module]
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        own = cls.__dict__.get("__call__")
        if inspect.isfunction(own) and not hasattr(own, "_jaxscale_named"):
            found.append(cls)
    return found


@contextlib.contextmanager
def _wrapped(nnx: Any) -> Iterator[None]:
    """Every ``nnx.Module`` class's ``__call__`` wrapped while inside (shared
    by nested and concurrent traces; the last one out restores them)."""
    global _users
    with _PATCH_LOCK:
        for cls in _module_classes(nnx):  # and classes defined since
            _patched[cls] = cls.__dict__["__call__"]
            cls.__call__ = _wrap(_patched[cls])
        _users += 1
    try:
        yield
    finally:
        with _PATCH_LOCK:
            _users -= 1
            if _users == 0:
                for cls, call in _patched.items():
                    cls.__call__ = call
                _patched.clear()


@contextlib.contextmanager
def named_modules() -> Iterator[Callable[[Any], None]]:
    """While inside, calls of Flax NNX modules push their module paths as
    name scopes (``blocks/0/attn/qkv``), so that the equations traced carry
    them. Yields ``name(args)``: names the modules of the NNX objects among
    ``args`` (a tuple ``(args, kwargs)``) by their paths from each argument;
    a model the function merges or reaches through a closure is named from
    the first of its modules called. Does nothing if flax.nnx is not
    imported."""
    nnx = sys.modules.get("flax.nnx")
    if nnx is None:
        yield lambda args: None
        return
    naming = _Naming()

    def name(args: Any) -> None:
        for x in jax.tree.leaves(args, is_leaf=is_object):
            if is_object(x):
                naming.add(x)

    token = _NAMING.set(naming)
    try:
        with _wrapped(nnx):
            yield name
    finally:
        _NAMING.reset(token)
