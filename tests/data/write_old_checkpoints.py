"""Writes the checkpoints that tests/test_upgrade.py restores, with an OLD jaxscale.

Run once per old release, from a checkout of that release on ``PYTHONPATH``:

    git worktree add /tmp/jx010 5330c19   # 0.1.0
    git worktree add /tmp/jx020 1399ebd   # 0.2.0
    PYTHONPATH=/tmp/jx010 python tests/data/write_old_checkpoints.py
    PYTHONPATH=/tmp/jx020 python tests/data/write_old_checkpoints.py

Each run writes ``checkpoint_<version>[_tracked].msgpack`` (flax.serialization of
``{"params": ..., "opt_state": ...}`` after the first half of a run) and
``resume_<version>[_tracked].json`` (what the old version computed over the second
half). Every value is a dyadic rational with few bits (power-of-two scales and
learning rates), so the arithmetic is exact on any CPU and the test can compare
bit for bit across versions.
"""

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import serialization

import jaxscale as jxs

HERE = pathlib.Path(__file__).resolve().parent


def register() -> None:
    if hasattr(jxs, "register_flax_serialization"):  # 0.1.0
        jxs.register_flax_serialization()
    else:  # 0.2.0 and later
        import jaxscale.flax  # noqa: F401


def setup():
    params = {
        "dense": {"bias": jnp.zeros(2, jnp.float32), "kernel": jnp.full((2, 2), 0.5)},
        "scale": jnp.ones((), jnp.float32),
    }
    ls = jxs.DynamicLossScale.create(init_scale=2.0**10, growth_interval=2)
    tx = jxs.dynamic_scaling(optax.sgd(0.5, momentum=0.5), ls)
    return params, tx


def gradients(step: int, params) -> dict:
    """Unscaled gradients of step ``step``: small dyadic numbers, inf on steps
    2 and 6."""
    g = jax.tree.map(
        lambda p: jnp.full(p.shape, ((step % 3) - 1) * 0.25, jnp.float32), params
    )
    if step in (2, 6):
        g["dense"]["kernel"] = g["dense"]["kernel"].at[0, 0].set(jnp.inf)
    return g


def run(tx, params, opt_state, steps):
    for step in steps:
        scale = jxs.loss_scale_of(opt_state).loss_scale
        grads = jax.tree.map(lambda g, s=scale: g * s, gradients(step, params))
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
    return params, opt_state


def record(params, opt_state) -> dict:
    ls = jxs.loss_scale_of(opt_state)
    return {
        "params": [np.asarray(x).tolist() for x in jax.tree.leaves(params)],
        "loss_scale": float(ls.loss_scale),
        "growth_tracker": int(ls.growth_tracker),
        "steps": int(opt_state.steps),
        "skipped_steps": int(opt_state.skipped_steps),
        "consecutive_skips": int(opt_state.consecutive_skips),
        "momentum": [
            np.asarray(x).tolist() for x in jax.tree.leaves(opt_state.inner_state)
        ],
    }


def main() -> None:
    register()
    for tracked in (False, True):
        params, tx = setup()
        if tracked:
            if jxs.__version__ != "0.1.0":
                continue
            tx = jxs.dynamic_scaling(
                optax.sgd(0.5, momentum=0.5),
                jxs.DynamicLossScale.create(init_scale=2.0**10, growth_interval=2),
                track_nonfinite=True,
            )
        opt_state = tx.init(params)
        params, opt_state = run(tx, params, opt_state, range(4))
        name = jxs.__version__ + ("_tracked" if tracked else "")
        data = serialization.to_bytes({"params": params, "opt_state": opt_state})
        (HERE / f"checkpoint_{name}.msgpack").write_bytes(data)
        at_save = record(params, opt_state)
        params, opt_state = run(tx, params, opt_state, range(4, 8))
        out = {"version": jxs.__version__, "at_save": at_save}
        out["resumed"] = record(params, opt_state)
        (HERE / f"resume_{name}.json").write_text(json.dumps(out, indent=1) + "\n")
        print("wrote", name, out["resumed"]["loss_scale"], out["resumed"]["steps"])


if __name__ == "__main__":
    main()
