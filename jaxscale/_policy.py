"""Mixed-precision policies: which dtype parameters, computation and outputs use.

A :class:`Policy` is static configuration (hashable, usable as a ``jit`` static
argument), in the manner of jmp's ``Policy`` and Keras' ``DTypePolicy``; its
methods and :func:`cast_floating` cast only the floating leaves of a pytree.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["Policy", "cast_floating", "parse_float_dtype"]

# Short names and aliases; any other name must be a floating dtype's own name.
_ALIASES = {
    "f16": "float16",
    "fp16": "float16",
    "half": "float16",
    "bf16": "bfloat16",
    "f32": "float32",
    "fp32": "float32",
    "full": "float32",
    "single": "float32",
    "f64": "float64",
    "double": "float64",
}
_ACCEPTED = (
    "float16 (f16, fp16, half), bfloat16 (bf16), float32 (f32, fp32, full, "
    "single), "
    "float64 (f64, double), or another floating dtype's name such as float8_e4m3fn"
)
# Keys of `Policy.from_string`, with jmp's short forms.
_KEYS = {
    "params": "param_dtype",
    "param": "param_dtype",
    "p": "param_dtype",
    "compute": "compute_dtype",
    "c": "compute_dtype",
    "output": "output_dtype",
    "out": "output_dtype",
    "o": "output_dtype",
}
_ACCEPTED_KEYS = "params (param, p), compute (c), output (out, o)"
_SHORT = {"param_dtype": "params", "compute_dtype": "compute", "output_dtype": "output"}


def parse_float_dtype(value: Any, name: str = "dtype") -> np.dtype:
    """``value`` (a dtype, a scalar type or a name) as a floating NumPy dtype.

    Raises a ``ValueError`` naming ``name``, the accepted values and ``value``
    for an unknown name or a non-floating dtype.
    """
    dt = None
    if isinstance(value, str):
        key = value.strip().lower()
        key = _ALIASES.get(key, key)
        try:
            dt = jnp.dtype(key)
        except TypeError:
            dt = None
        # Only a dtype's own name: not NumPy's "float" (float64) or codes ("e").
        if dt is not None and dt.name != key:
            dt = None
    elif value is not None and not isinstance(value, bool | int | float):
        try:
            dt = jnp.dtype(value)
        except TypeError:
            dt = None
    if dt is None or not jnp.issubdtype(dt, jnp.floating):
        raise ValueError(
            f"`{name}` must be a floating dtype: {_ACCEPTED}; got {value!r}."
        )
    return dt


def _cast_leaf(x: Any, dtype: np.dtype) -> Any:
    if isinstance(x, float) or getattr(x, "dtype", None) is None:
        return x  # Python scalars are configuration more often than data
    if not jnp.issubdtype(x.dtype, jnp.floating) or x.dtype == dtype:
        return x
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(
            x.shape, dtype, sharding=x.sharding, weak_type=False
        )
    return x.astype(dtype)


def cast_floating(tree: Any, dtype: Any) -> Any:
    """Casts the floating leaves of a pytree to ``dtype``; leaves the rest alone.

    Arrays (``jax.Array``, tracers, NumPy arrays) whose dtype is floating
    (float16, bfloat16, float32, float64, fp8) are cast with ``astype``; a
    leaf already in ``dtype`` is returned as it is (nothing traced). Integer,
    boolean, complex and PRNG-key leaves, Python scalars and ``None`` are
    returned unchanged, so step counters, masks, token ids and RNG state survive.
    ``jax.ShapeDtypeStruct`` leaves get the new dtype (for ``jax.eval_shape``).
    Works on anything JAX treats as a pytree, including Flax NNX ``State``
    objects, ``Variable`` objects and modules.

    Args:
      tree: a pytree.
      dtype: the target floating dtype: a dtype (``jnp.bfloat16``) or a name
        (``"float16"``, or a short name ``"f16"``, ``"bf16"``, ``"f32"``; the
        names :meth:`Policy.from_string` accepts).

    Returns:
      A pytree of the same structure.

    Raises:
      ValueError: if ``dtype`` is not a floating dtype or a known name.

    Examples:
      >>> import jaxscale as jxs
      >>> import jax, jax.numpy as jnp
      >>> tree = {"w": jnp.ones(2), "step": jnp.int32(3), "key": jax.random.key(0)}
      >>> out = jxs.cast_floating(tree, jnp.float16)
      >>> out["w"].dtype, out["step"].dtype, out["key"] is tree["key"]
      (dtype('float16'), dtype('int32'), True)
      >>> jxs.cast_floating({"w": jnp.ones(2), "mask": None}, "bf16")["w"].dtype
      dtype(bfloat16)
    """
    dt = parse_float_dtype(dtype, "dtype")
    return jax.tree.map(lambda x: _cast_leaf(x, dt), tree)


@dataclasses.dataclass(frozen=True, repr=False)
class Policy:
    """The dtypes of parameters, computation and outputs of a model.

    The vocabulary of jmp's ``Policy`` and Keras' ``DTypePolicy``: keep the
    parameters (and the optimizer's copy of them) in ``param_dtype``, cast them
    and the inputs to ``compute_dtype`` for the forward and backward passes, and
    cast what the model returns to ``output_dtype`` (float32, so the loss is
    reduced in float32). Every method casts floating leaves only (see
    :func:`cast_floating`).

    A policy is static configuration: frozen, hashable, comparable, fine as a
    ``jit`` static argument or a closure constant. Fields hold NumPy dtypes; the
    constructor also takes names (``Policy(compute_dtype="f16")``), and
    :meth:`from_string` parses ``"params=float32,compute=float16,output=float32"``.
    ``str(policy)`` gives that form back.

    With :func:`jaxscale.autocast`, the policy casts at the boundary and autocast
    chooses per operation (see the policy guide)::

        loss = policy.cast_to_output(
            jxs.autocast(f, dtype=policy.compute_dtype)(
                policy.cast_to_param(params), x))

    Attributes:
      param_dtype: the dtype parameters are stored and updated in.
      compute_dtype: the dtype of the forward (and so the backward) computation.
      output_dtype: the dtype of the model's outputs.

    Raises:
      ValueError: if a dtype is not floating or not a known name.

    Examples:
      >>> import jaxscale as jxs
      >>> import jax.numpy as jnp
      >>> spec = "params=float32,compute=float16,output=float32"
      >>> policy = jxs.Policy.from_string(spec)
      >>> policy
      Policy(param_dtype=float32, compute_dtype=float16, output_dtype=float32)
      >>> policy == jxs.Policy(compute_dtype=jnp.float16)
      True
      >>> params = {"w": jnp.ones(3), "step": jnp.int32(0)}
      >>> policy.cast_to_compute(params)["w"].dtype
      dtype('float16')
      >>> str(policy)
      'params=float32,compute=float16,output=float32'
    """

    param_dtype: Any = jnp.float32
    compute_dtype: Any = jnp.float32
    output_dtype: Any = jnp.float32

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            object.__setattr__(self, field.name, parse_float_dtype(value, field.name))

    def __repr__(self) -> str:
        return (
            f"Policy(param_dtype={self.param_dtype.name}, "
            f"compute_dtype={self.compute_dtype.name}, "
            f"output_dtype={self.output_dtype.name})"
        )

    def __str__(self) -> str:
        return ",".join(
            f"{_SHORT[f.name]}={getattr(self, f.name).name}"
            for f in dataclasses.fields(self)
        )

    @classmethod
    def from_string(cls, spec: str) -> Policy:
        """Parses a policy such as ``"params=float32,compute=float16,output=float32"``.

        The string is comma-separated ``key=dtype`` entries, or a single dtype
        name for all three. Keys: ``params`` (``param``, ``p``), ``compute``
        (``c``), ``output`` (``out``, ``o``), as jmp accepts them; a key left out
        means float32. Dtypes: ``float16`` (``f16``, ``half``), ``bfloat16``
        (``bf16``), ``float32`` (``f32``, ``full``, ``single``), ``float64``
        (``f64``, ``double``), or another floating dtype's name. Unlike jmp,
        ``half`` is always float16 (as in NumPy and torch), never bfloat16 on
        some backends. Case and spaces are ignored.

        Args:
          spec: the policy string.

        Returns:
          A :class:`Policy`.

        Raises:
          TypeError: if ``spec`` is not a string.
          ValueError: naming the entry, the accepted keys or dtypes and the value
            given, for an unknown key or dtype, a repeated key, an entry that is
            not ``key=dtype``, or an empty string.

        Examples:
          >>> import jaxscale as jxs
          >>> jxs.Policy.from_string("p=f32,c=bf16,o=f32")
          Policy(param_dtype=float32, compute_dtype=bfloat16, output_dtype=float32)
          >>> jxs.Policy.from_string("compute=half")
          Policy(param_dtype=float32, compute_dtype=float16, output_dtype=float32)
          >>> jxs.Policy.from_string("bfloat16")
          Policy(param_dtype=bfloat16, compute_dtype=bfloat16, output_dtype=bfloat16)
        """
        if not isinstance(spec, str):
            raise TypeError(
                "`spec` must be a string such as "
                f"'params=float32,compute=float16,output=float32', got {spec!r}."
            )
        entries = [e.strip() for e in spec.split(",")]
        if not any(entries):
            raise ValueError(
                "`spec` must name at least one dtype, e.g. "
                f"'params=float32,compute=float16,output=float32'; got {spec!r}."
            )
        if len(entries) == 1 and "=" not in entries[0]:
            if entries[0].lower().startswith("mixed_"):  # Keras' policy names
                half = entries[0].lower().removeprefix("mixed_")
                raise ValueError(
                    f"`spec` {spec!r} is a Keras policy name; write it as "
                    f"'params=float32,compute={half},output=float32'."
                )
            dt = parse_float_dtype(entries[0], "spec")
            return cls(dt, dt, dt)
        found: dict[str, np.dtype] = {}
        for entry in entries:
            key, sep, value = (s.strip() for s in entry.partition("="))
            if not sep:
                raise ValueError(
                    f"Each entry of `spec` must be `key=dtype` with key one of "
                    f"{_ACCEPTED_KEYS}; got the entry {entry!r} in {spec!r}."
                )
            field = _KEYS.get(key.lower())
            if field is None:
                raise ValueError(
                    f"Unknown key {key!r} in `spec` {spec!r}: accepted keys are "
                    f"{_ACCEPTED_KEYS}."
                )
            if field in found:
                raise ValueError(
                    f"`spec` {spec!r} sets {_SHORT[field]} twice (key {key!r}); "
                    "give each of params, compute, output at most once."
                )
            found[field] = parse_float_dtype(value, f"{key}")
        return cls(**found)

    def cast_to_param(self, tree: Any) -> Any:
        """Casts the floating leaves of ``tree`` to ``param_dtype``.

        Examples:
          >>> import jaxscale as jxs
          >>> import jax.numpy as jnp
          >>> jxs.Policy(param_dtype="f32").cast_to_param(jnp.ones(2, "f2")).dtype
          dtype('float32')
        """
        return cast_floating(tree, self.param_dtype)

    def cast_to_compute(self, tree: Any) -> Any:
        """Casts the floating leaves of ``tree`` to ``compute_dtype``.

        Examples:
          >>> import jaxscale as jxs
          >>> import jax.numpy as jnp
          >>> jxs.Policy(compute_dtype="bf16").cast_to_compute(jnp.ones(2)).dtype
          dtype(bfloat16)
        """
        return cast_floating(tree, self.compute_dtype)

    def cast_to_output(self, tree: Any) -> Any:
        """Casts the floating leaves of ``tree`` to ``output_dtype``.

        Examples:
          >>> import jaxscale as jxs
          >>> import jax.numpy as jnp
          >>> jxs.Policy(output_dtype="f32").cast_to_output(jnp.ones(2, "f2")).dtype
          dtype('float32')
        """
        return cast_floating(tree, self.output_dtype)
