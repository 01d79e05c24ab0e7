"""Pure pytree helpers: finiteness checks and branch-free selection.

Nothing here knows about loss scales; the other modules build on these.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = [
    "ROOT_NAME",
    "all_finite",
    "compute_dtype",
    "first_non_array",
    "is_complex_leaf",
    "is_float_leaf",
    "is_inexact_leaf",
    "leaf_names",
    "map_parts",
    "path_name",
    "real_parts",
    "select_tree",
    "widen",
]

_INT32_MAX = jnp.iinfo(jnp.int32).max

#: Name of the single leaf of a tree that is just one array.
ROOT_NAME = "<root>"


def path_name(path: Any) -> str:
    """A readable name for a key path: ``"dense/kernel"``, ``"layers/0/w"``."""
    return jax.tree_util.keystr(tuple(path), simple=True, separator="/") or ROOT_NAME


def leaf_names(tree: Any) -> list[str]:
    """The :func:`path_name` of every leaf of ``tree``, in flattening order."""
    return [path_name(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def is_float_leaf(x: Any) -> bool:
    """Whether ``x`` is an array (or Python float) of a floating dtype."""
    if isinstance(x, bool | int):
        return False
    if isinstance(x, float):
        return True
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jnp.floating)


def is_complex_leaf(x: Any) -> bool:
    """Whether ``x`` is an array (or Python complex) of a complex dtype."""
    if isinstance(x, complex):
        return True
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jnp.complexfloating)


def is_inexact_leaf(x: Any) -> bool:
    """Whether ``x`` is a floating or a complex leaf: one that can overflow."""
    return is_float_leaf(x) or is_complex_leaf(x)


def real_parts(x: Any) -> list[jax.Array]:
    """The real arrays that hold an inexact leaf's values: ``[x]`` for a floating
    leaf, ``[real(x), imag(x)]`` (float32 for complex64, float64 for
    complex128) for a complex one. Norms and finite checks of a complex leaf
    run over these: ``|z|**2 = real(z)**2 + imag(z)**2``."""
    x = jnp.asarray(x)
    if is_complex_leaf(x):
        return [jnp.real(x), jnp.imag(x)]
    return [x]


def map_parts(f: Callable[[jax.Array], jax.Array], x: Any) -> Any:
    """``f(x)`` for a floating leaf; for a complex one ``f`` on its real and its
    imaginary part, recombined (``lax.complex``): multiplying by a real factor
    this way is exact per part, where a complex product with ``factor + 0j``
    can turn a signed zero or an ``inf`` part into another value."""
    if not is_complex_leaf(x):
        return f(x)
    re, im = real_parts(x)
    return lax.complex(f(re), f(im))


def all_finite(tree: Any) -> jax.Array:
    """Returns whether every floating-point element of a pytree is finite.

    Complex leaves count too: an element is finite where both its real and its
    imaginary part are. Integer, boolean and ``None`` leaves are ignored, so are
    leaves of other non-inexact dtypes; an empty tree is finite. The result is a
    ``bool[]`` array computed on device (no host synchronisation), usable under
    ``jit``, ``vmap`` and ``lax.scan``.

    Args:
      tree: a pytree of arrays.

    Returns:
      ``bool[]``: ``True`` iff no floating or complex leaf holds ``inf``, ``-inf`` or
      ``NaN``.

    Examples:
      >>> import jaxscale as jxs
      >>> import jax.numpy as jnp
      >>> jxs.all_finite({"w": jnp.ones(3), "step": jnp.int32(4)})
      Array(True, dtype=bool)
      >>> jxs.all_finite([jnp.ones(3), jnp.array([1.0, jnp.nan])])
      Array(False, dtype=bool)
      >>> jxs.all_finite({"z": jnp.array([1 + 2j, complex(1.0, jnp.inf)])})
      Array(False, dtype=bool)
    """
    flags = [
        jnp.all(jnp.isfinite(jnp.asarray(x)))
        for x in jax.tree.leaves(tree)
        if is_inexact_leaf(x)
    ]
    if not flags:
        return jnp.ones((), jnp.bool_)
    return functools.reduce(jnp.logical_and, flags)


def select_tree(pred: jax.typing.ArrayLike, on_true: Any, on_false: Any) -> Any:
    """Selects between two pytrees of identical structure with one scalar predicate.

    Branch-free (``lax.select`` leaf by leaf), so both trees are computed and the
    choice is made on device. Leaves must agree in shape and dtype.

    Args:
      pred: a ``bool[]`` scalar (array or Python bool).
      on_true: the pytree returned where ``pred`` is true.
      on_false: a pytree with the same structure, shapes and dtypes.

    Returns:
      A pytree with the structure of ``on_true``.

    Raises:
      TypeError: if ``pred`` is not a boolean scalar.
      ValueError: if the two trees differ in structure, shape or dtype.

    Examples:
      >>> import jaxscale as jxs
      >>> import jax.numpy as jnp
      >>> jxs.select_tree(jnp.bool_(False), {"w": jnp.ones(2)}, {"w": jnp.zeros(2)})
      {'w': Array([0., 0.], dtype=float32)}
    """
    pred = jnp.asarray(pred)
    if pred.dtype != jnp.bool_ or pred.shape != ():
        raise TypeError(
            "`pred` must be a boolean scalar (bool[]), got "
            f"{pred.dtype}{list(pred.shape)}."
        )
    ta, tb = jax.tree.structure(on_true), jax.tree.structure(on_false)
    if ta != tb:
        raise ValueError(
            "`on_true` and `on_false` must have the same tree structure, got "
            f"{ta} and {tb}."
        )

    def select(path, a, b):
        a, b = jnp.asarray(a), jnp.asarray(b)
        if a.shape != b.shape or a.dtype != b.dtype:
            raise ValueError(
                f"Leaves at {jax.tree_util.keystr(path)} differ: "
                f"{a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}; "
                "`select_tree` needs equal shapes and dtypes."
            )
        return lax.select(pred, a, b)

    return jax.tree_util.tree_map_with_path(select, on_true, on_false)


def saturating_increment(x: jax.Array) -> jax.Array:
    """``x + 1`` for an ``int32`` counter, stopping at the largest int32."""
    return jnp.where(x < _INT32_MAX, x + 1, x)


def compute_dtype(dtype: Any) -> Any:
    """float64 for float64 leaves, float32 for every other float dtype.

    Also for several leaves at once: ``compute_dtype([x.dtype for x in leaves])``
    is float64 if any of them is (float32 for none).
    """
    if isinstance(dtype, list | tuple):
        return jnp.float64 if any(d == jnp.float64 for d in dtype) else jnp.float32
    return jnp.float64 if dtype == jnp.float64 else jnp.float32


def widen(x: Any) -> Any:
    """A floating leaf narrower than float32 (f16, bf16, fp8) as float32.

    float32 and float64 leaves, non-float leaves and ``None`` are returned
    unchanged (no copy, nothing traced).
    """
    if not is_float_leaf(x) or isinstance(x, float):
        return x
    dtype = jnp.result_type(x)
    wide = compute_dtype(dtype)
    return x if dtype == wide else jnp.asarray(x).astype(wide)


def first_non_array(tree: Any) -> tuple[str, Any] | None:
    """``(path, leaf)`` of the first leaf of ``tree`` that is neither an array
    nor a Python number (an equinox module's strings and functions), or
    ``None``."""
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if not isinstance(
            x, jax.Array | np.ndarray | np.generic | int | float | complex
        ):
            return jax.tree_util.keystr(path) or ROOT_NAME, x
    return None
