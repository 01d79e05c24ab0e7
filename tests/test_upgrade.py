"""Checkpoints written by jaxscale 0.1.0 and 0.2.0 (tests/data, written by those
releases with tests/data/write_old_checkpoints.py) restore through
``jxs.upgrade_checkpoint`` and resume bit-identically: the second half of the run,
computed here, equals what the old release computed (exact dyadic arithmetic)."""

import json
import pathlib
import sys

import jax
import numpy as np
import pytest
from flax import serialization

import jaxscale as jxs
import jaxscale.flax  # noqa: F401  (registers the loss scales with flax)
import jaxscale.testing as jxt

pytestmark = pytest.mark.integration

DATA = pathlib.Path(__file__).resolve().parent / "data"
sys.path.insert(0, str(DATA))
import write_old_checkpoints as old  # noqa: E402

OLD = ["0.1.0", "0.1.0_tracked", "0.2.0"]


def _target():
    params, tx = old.setup()
    return tx, {"params": params, "opt_state": tx.init(params)}


def _restore(name):
    data = (DATA / f"checkpoint_{name}.msgpack").read_bytes()
    tx, target = _target()
    restored = jxs.upgrade_checkpoint(
        lambda like: serialization.from_bytes(like, data), target
    )
    return tx, jxs.validate_state(restored)


def _assert_record(got, want):
    for key in ("loss_scale", "growth_tracker", "steps", "skipped_steps"):
        assert got[key] == want[key], key
    assert got["consecutive_skips"] == want["consecutive_skips"]
    for kind in ("params", "momentum"):
        for a, b in zip(got[kind], want[kind], strict=True):
            a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
            np.testing.assert_array_equal(a.view(np.int32), b.view(np.int32))


@pytest.mark.parametrize("name", OLD)
def test_old_checkpoint_restores_as_saved(name):
    want = json.loads((DATA / f"resume_{name}.json").read_text())
    assert want["version"] == name.split("_")[0]
    _, state = _restore(name)
    opt_state = state["opt_state"]
    assert isinstance(opt_state, jxs.DynamicScalingState)
    assert opt_state.nonfinite_leaves.names == (
        "dense/bias",
        "dense/kernel",
        "scale",
    )
    assert opt_state.nonfinite_leaves.flags.dtype == np.bool_
    _assert_record(old.record(state["params"], opt_state), want["at_save"])


@pytest.mark.parametrize("name", OLD)
def test_old_checkpoint_resumes_bit_identically(name):
    want = json.loads((DATA / f"resume_{name}.json").read_text())
    tx, state = _restore(name)
    step = jax.jit(lambda p, s: old.run(tx, p, s, range(4, 8)))
    params, opt_state = step(state["params"], state["opt_state"])
    _assert_record(old.record(params, opt_state), want["resumed"])
    assert bool(opt_state.last_step_finite) == (
        want["resumed"]["consecutive_skips"] == 0
    )


def test_tracked_flags_keep_their_values():
    """0.1.0's per-leaf flags (``track_nonfinite=True``) come back in one array,
    in the order of the names; the saved run's last step was applied."""
    _, state = _restore("0.1.0_tracked")
    flags = state["opt_state"].nonfinite_leaves
    assert flags.flags.shape == (3,) and not np.asarray(flags.flags).any()


def test_old_checkpoint_without_upgrade_fails_loudly():
    data = (DATA / "checkpoint_0.2.0.msgpack").read_bytes()
    _, target = _target()
    with pytest.raises(ValueError, match="field names"):
        serialization.from_bytes(target, data)


def test_current_checkpoint_passes_through_unchanged():
    tx, target = _target()
    params, opt_state = old.run(tx, target["params"], target["opt_state"], range(3))
    data = serialization.to_bytes({"params": params, "opt_state": opt_state})
    got = jxs.upgrade_checkpoint(
        lambda like: serialization.from_bytes(like, data), target
    )
    jxt.assert_bit_identical(got["opt_state"], opt_state)


def test_a_checkpoint_of_another_model_names_every_layout_it_tried():
    data = (DATA / "checkpoint_0.2.0.msgpack").read_bytes()
    tx = jxs.dynamic_scaling(old.optax.sgd(0.5))  # no momentum: another inner state
    target = {"params": old.setup()[0], "opt_state": tx.init(old.setup()[0])}
    with pytest.raises(ValueError, match=r"no known layout.*0\.2\.0: .*0\.1\.0"):
        jxs.upgrade_checkpoint(
            lambda like: serialization.from_bytes(like, data), target
        )
