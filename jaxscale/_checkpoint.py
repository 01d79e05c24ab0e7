"""Checkpointing with ``flax.serialization``: state dicts for the loss scales.

orbax-checkpoint needs nothing from jaxscale: the loss scales are registered
pytrees, so orbax saves their array leaves and rebuilds the static configuration
from the abstract target. ``flax.serialization`` instead walks objects through its
own registry, which jaxscale fills on ``import jaxscale.flax`` (or an explicit
:func:`register_flax_serialization`), so that ``import jaxscale`` never imports
Flax.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxscale._hooks import LeafFlags
from jaxscale._loss_scale import DynamicLossScale, NoOpLossScale, StaticLossScale

__all__ = ["register_flax_serialization", "upgrade_checkpoint"]

_CLASSES = (DynamicLossScale, StaticLossScale, NoOpLossScale, LeafFlags)


def _data_fields(cls: type) -> tuple[str, ...]:
    """The array (non-static) fields of a registered loss-scale dataclass."""
    return tuple(
        f.name for f in dataclasses.fields(cls) if not f.metadata.get("static", False)
    )


def _to_state_dict(loss_scale: Any) -> dict[str, Any]:
    from flax import serialization

    return {
        name: serialization.to_state_dict(getattr(loss_scale, name))
        for name in _data_fields(type(loss_scale))
    }


def _from_state_dict(target: Any, state: Any) -> Any:
    from flax import serialization

    cls = type(target)
    expected = _data_fields(cls)
    if not isinstance(state, dict):
        raise ValueError(
            f"The state of a jxs.{cls.__name__} at {serialization.current_path()} "
            f"must be a dict with keys {sorted(expected)}, got "
            f"{type(state).__name__}."
        )
    missing = sorted(set(expected) - set(state))
    unknown = sorted(set(state) - set(expected))
    if missing or unknown:
        # Never fill a missing counter with a default (NeMo's misspelled key reset
        # its hysteresis tracker silently): a checkpoint either matches or fails.
        raise ValueError(
            f"The state of a jxs.{cls.__name__} at {serialization.current_path()} "
            f"must have exactly the keys {sorted(expected)}; missing {missing}, "
            f"unexpected {unknown}. Restore against a target built by the same "
            "kind of loss scale (e.g. `tx.init(params)`)."
        )
    values = {
        name: serialization.from_state_dict(
            getattr(target, name), state[name], name=name
        )
        for name in expected
    }
    return dataclasses.replace(target, **values)


def register_flax_serialization() -> None:
    """Teaches ``flax.serialization`` to save and restore jaxscale's loss scales.

    ``flax.serialization`` (``to_state_dict``, ``from_state_dict``,
    ``to_bytes``, ``from_bytes``, ``msgpack_serialize``) only walks types in its
    own registry; without this registration ``to_bytes`` of a state holding a
    :class:`DynamicLossScale` raises ``TypeError: can not serialize``.
    ``import jaxscale`` does not import Flax; ``import jaxscale.flax`` calls this
    function, and calling it again is harmless (it is idempotent).

    What is saved: the array fields only, by name (``loss_scale``,
    ``growth_tracker``, ``hysteresis_tracker`` for :class:`DynamicLossScale`;
    ``loss_scale`` for :class:`StaticLossScale`; nothing for
    :class:`NoOpLossScale`). The static configuration (``growth_interval``,
    ``hysteresis``, bounds...) is code, not state: ``from_state_dict`` and
    ``from_bytes`` take it from the *target* (e.g. ``tx.init(params)``), exactly
    as orbax does with an abstract target. A state dict with a missing or an
    unexpected key is rejected with a ``ValueError``, never filled with defaults.
    Restored leaves are the stored arrays as they come out of msgpack (NumPy);
    run :func:`validate_state` on the result to check them against the
    configuration (e.g. a tracker from a run with a longer ``growth_interval``).

    orbax-checkpoint needs no registration.

    Raises:
      ImportError: if Flax is not installed.

    Examples:
      >>> import jaxscale as jxs
      >>> import jax.numpy as jnp, optax
      >>> import jaxscale.flax as jxf
      >>> from flax import serialization
      >>> jxf.register_flax_serialization()  # done by the import too
      >>> tx = jxs.dynamic_scaling(optax.sgd(0.1))
      >>> state = tx.init({"w": jnp.zeros(2)})
      >>> state = tx.update({"w": jnp.array([jnp.inf, 0.0])}, state)[1]
      >>> data = serialization.to_bytes(state)
      >>> restored = serialization.from_bytes(tx.init({"w": jnp.zeros(2)}), data)
      >>> restored = jxs.validate_state(restored)
      >>> float(restored.loss_scale.loss_scale), int(restored.skipped_steps)
      (32768.0, 1)
    """
    try:
        from flax import serialization
    except ImportError as e:  # pragma: no cover - flax is a test dependency
        raise ImportError(
            "`jaxscale.flax.register_flax_serialization()` needs Flax: "
            "pip install flax. "
            "(orbax-checkpoint works without it.)"
        ) from e
    for cls in _CLASSES:
        serialization.register_serialization_state(
            cls, _to_state_dict, _from_state_dict, override=True
        )


def upgrade_checkpoint(restore: Callable[[Any], Any], target: Any) -> Any:
    """Restores a checkpoint written by jaxscale 0.1.0 into a state of this version.

    jaxscale 0.1.0 stored ``DynamicScalingState.nonfinite_leaves`` as ``None``
    unless built with ``track_nonfinite=True``; since 0.2.0 the per-leaf flags
    are always part of the state, so restoring such a checkpoint straight into
    ``tx.init(params)`` fails on the structure (orbax: a tree mismatch;
    ``flax.serialization``: ``'NoneType' object has no attribute 'keys'``).
    This function calls your ``restore`` with the 0.1.0 layout of ``target``
    (every flags subtree replaced by ``None``) and puts fresh all-``False``
    flags back into the result. Checkpoints that already hold flags (0.1.0 with
    ``track_nonfinite=True``, or this version) restore directly, without it.

    Args:
      restore: a function from a target pytree to the restored pytree, e.g.
        ``lambda like: checkpointer.restore(path, like)`` (orbax; pass abstract
        or concrete targets as orbax expects) or
        ``lambda like: flax.serialization.from_bytes(like, data)``.
      target: what you would restore into today: ``tx.init(params)``, a
        ``TrainState``, or their abstract (``ShapeDtypeStruct``) version.

    Returns:
      The restored pytree in this version's layout. Run
      :func:`validate_state` on it, as after any restore.

    Examples:
      >>> import jaxscale as jxs
      >>> import jax.numpy as jnp, optax
      >>> import jaxscale.flax  # registers the loss scales with flax
      >>> from flax import serialization
      >>> tx = jxs.dynamic_scaling(optax.sgd(0.1))
      >>> target = tx.init({"w": jnp.zeros(2)})
      >>> old = target._replace(nonfinite_leaves=None)  # what 0.1.0 wrote
      >>> data = serialization.to_bytes(old)
      >>> state = jxs.upgrade_checkpoint(
      ...     lambda like: serialization.from_bytes(like, data), target)
      >>> state.nonfinite_leaves
      LeafFlags(flags=Array([False], dtype=bool), names=('w',))
    """
    from jaxscale._transform import DynamicScalingState

    def is_state(x: Any) -> bool:
        return isinstance(x, DynamicScalingState)

    if not callable(restore):
        raise TypeError(
            "`restore` must be a function from a target pytree to the restored "
            f"pytree (e.g. `lambda like: checkpointer.restore(path, like)`), got "
            f"{type(restore).__name__}."
        )
    found = [x for x in jax.tree.leaves(target, is_leaf=is_state) if is_state(x)]
    if not found:
        raise ValueError(
            "`target` contains no jxs.DynamicScalingState: pass what you would "
            f"restore into, e.g. `tx.init(params)`; got {type(target).__name__}."
        )
    legacy = jax.tree.map(
        lambda x: x._replace(nonfinite_leaves=None) if is_state(x) else x,
        target,
        is_leaf=is_state,
    )
    restored = restore(legacy)
    flags = iter(
        jax.tree.map(lambda f: jnp.zeros(jnp.shape(f), jnp.bool_), x.nonfinite_leaves)
        for x in found
    )
    return jax.tree.map(
        lambda x: x._replace(nonfinite_leaves=next(flags)) if is_state(x) else x,
        restored,
        is_leaf=is_state,
    )
