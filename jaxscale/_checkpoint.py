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
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxscale._loss_scale import DynamicLossScale, NoOpLossScale, StaticLossScale
from jaxscale._state import DynamicScalingState, LeafFlags, no_flags_named
from jaxscale._tree import ROOT_NAME, leaf_names
from jaxscale.float8._api import Float8State

__all__ = ["register_flax_serialization", "upgrade_checkpoint"]

_CLASSES = (DynamicLossScale, StaticLossScale, NoOpLossScale, LeafFlags, Float8State)


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
    :class:`NoOpLossScale`; ``history`` and ``scale`` of a
    :class:`jaxscale.float8.Float8State`, one entry per site, the site count
    checked against the target's). The static configuration (``growth_interval``,
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


class _Before030(NamedTuple):
    """``DynamicScalingState`` as jaxscale 0.1.0 and 0.2.0 stored it."""

    loss_scale: Any
    inner_state: Any
    steps: Any
    skipped_steps: Any
    consecutive_skips: Any
    last_step_finite: Any
    steps_at_floor: Any
    nonfinite_leaves: Any = None


def _flag_tree(names: tuple[str, ...]) -> Any:
    """0.1.0's ``track_nonfinite=True`` flags: a ``bool[]`` per gradient leaf in
    the structure of the params, rebuilt from the leaves' names (nested dicts)."""
    if names == (ROOT_NAME,):
        return jnp.zeros((), jnp.bool_)
    tree: dict[str, Any] = {}
    for name in names:
        *parents, leaf = name.split("/")
        node = tree
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = jnp.zeros((), jnp.bool_)
    return tree


def _legacy(state: DynamicScalingState, layout: str) -> Any:
    if layout == "0.3":
        return state
    flags = state.nonfinite_leaves
    stored = {"0.2.0": flags, "0.1.0": None, "0.1.0 (track_nonfinite=True)": None}
    if layout == "0.1.0 (track_nonfinite=True)":
        stored[layout] = _flag_tree(flags.names)
    return _Before030(
        loss_scale=state.loss_scale,
        inner_state=state.inner_state,
        steps=state.steps,
        skipped_steps=state.skipped_steps,
        consecutive_skips=state.consecutive_skips,
        last_step_finite=jnp.ones((), jnp.bool_),
        steps_at_floor=jnp.zeros((), jnp.int32),
        nonfinite_leaves=stored[layout],
    )


def _current(old: Any, target: DynamicScalingState, layout: str) -> Any:
    if layout == "0.3":
        return old
    names = target.nonfinite_leaves.names
    if layout == "0.2.0":
        flags = old.nonfinite_leaves
    elif layout == "0.1.0":
        flags = no_flags_named(names)
    else:
        got = dict(
            zip(
                leaf_names(old.nonfinite_leaves),
                jax.tree.leaves(old.nonfinite_leaves),
                strict=True,
            )
        )
        flags = LeafFlags(
            jnp.stack([jnp.asarray(got[n], jnp.bool_) for n in names]), names
        )
    return DynamicScalingState(
        loss_scale=old.loss_scale,
        inner_state=old.inner_state,
        steps=old.steps,
        skipped_steps=old.skipped_steps,
        consecutive_skips=old.consecutive_skips,
        nonfinite_leaves=flags,
    )


_LAYOUTS = ("0.3", "0.2.0", "0.1.0", "0.1.0 (track_nonfinite=True)")


def upgrade_checkpoint(restore: Callable[[Any], Any], target: Any) -> Any:
    """Restores a checkpoint of any jaxscale version into this version's layout.

    The state of :func:`dynamic_scaling` changed twice. jaxscale 0.1.0 and 0.2.0
    stored ``last_step_finite`` (now derived from ``consecutive_skips``) and the
    monitor's ``steps_at_floor`` (now in ``jxs.diagnostics.MonitorState``);
    0.1.0 stored the per-leaf flags as ``None`` (by default) or as a ``bool[]``
    per leaf (``track_nonfinite=True``), 0.2.0 and later as one ``bool[n]``
    array. Restoring an old checkpoint straight into ``tx.init(params)`` fails
    on the structure. This function calls your ``restore`` with ``target`` in
    each layout in turn, newest first, and converts the first that restores:
    counters, loss scale and inner state as stored, the flags as stored (all
    ``False`` where 0.1.0 kept none). A checkpoint of this version comes back
    as ``restore(target)`` would return it.

    Args:
      restore: a function from a target pytree to the restored pytree, e.g.
        ``lambda like: checkpointer.restore(path, like)`` (orbax; pass abstract
        or concrete targets as orbax expects) or
        ``lambda like: flax.serialization.from_bytes(like, data)``. It is
        called once per layout tried, so it must not consume its input.
      target: what you would restore into today: ``tx.init(params)``, a
        ``TrainState``, or their abstract (``ShapeDtypeStruct``) version.

    Returns:
      The restored pytree in this version's layout. Run
      :func:`validate_state` on it, as after any restore.

    Raises:
      TypeError: if ``restore`` is not callable.
      ValueError: if ``target`` holds no :class:`DynamicScalingState`, or no
        layout restores (the message gives each layout's error).

    Examples:
      >>> import jaxscale as jxs
      >>> import jax.numpy as jnp, optax
      >>> import jaxscale.flax  # registers the loss scales with flax
      >>> from flax import serialization
      >>> tx = jxs.dynamic_scaling(optax.sgd(0.1))
      >>> target = tx.init({"w": jnp.zeros(2)})
      >>> old = serialization.to_state_dict(target)  # as jaxscale 0.2.0 wrote it:
      >>> old.update(last_step_finite=jnp.bool_(True), steps_at_floor=jnp.int32(0))
      >>> data = serialization.msgpack_serialize(old)
      >>> state = jxs.upgrade_checkpoint(
      ...     lambda like: serialization.from_bytes(like, data), target)
      >>> int(state.steps), state.nonfinite_leaves.names
      (0, ('w',))
    """
    if not callable(restore):
        raise TypeError(
            "`restore` must be a function from a target pytree to the restored "
            f"pytree (e.g. `lambda like: checkpointer.restore(path, like)`), got "
            f"{type(restore).__name__}."
        )

    def is_state(x: Any) -> bool:
        return isinstance(x, DynamicScalingState)

    found = [x for x in jax.tree.leaves(target, is_leaf=is_state) if is_state(x)]
    if not found:
        raise ValueError(
            "`target` contains no jxs.DynamicScalingState: pass what you would "
            f"restore into, e.g. `tx.init(params)`; got {type(target).__name__}."
        )
    errors = []
    for layout in _LAYOUTS:
        legacy = jax.tree.map(
            lambda x, layout=layout: _legacy(x, layout) if is_state(x) else x,
            target,
            is_leaf=is_state,
        )
        try:
            restored = restore(legacy)
        except Exception as e:  # noqa: BLE001 - the next layout may fit
            errors.append(f"{layout}: {type(e).__name__}: {str(e)[:300]}")
            continue
        targets = iter(found)
        return jax.tree.map(
            lambda x, layout=layout, targets=targets: (
                _current(x, next(targets), layout)
                if isinstance(x, _Before030 | DynamicScalingState)
                else x
            ),
            restored,
            is_leaf=lambda x: isinstance(x, _Before030 | DynamicScalingState),
        )
    raise ValueError(
        "The checkpoint restores into no known layout of jaxscale's state "
        "(this version's, 0.2.0's, 0.1.0's with or without track_nonfinite). "
        "Check that `target` is built like the checkpointed state (same params, "
        "inner optimizer, loss-scale kind). Errors: " + " | ".join(errors)
    )
