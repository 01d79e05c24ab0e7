"""Two processes on localhost, one global mesh, one overflow decision.

The test starts this file twice as a worker (``python test_multiprocess.py
WORKER_ID PORT``). Each worker calls ``jax.distributed.initialize`` with a
coordinator on ``127.0.0.1`` and brings 2 CPU devices (CPU collectives through
Gloo) to a 4-device global mesh. An overflow is placed in the data of process 1
only, in three set-ups:

* ``dp``: ``jit``, replicated params, the batch split over every device;
* ``fsdp``: ``jit``, params and gradients split over every device; the ``inf``
  is in a gradient block that only process 1 holds;
* ``shard_map``: ``axis_name`` and a ``lax.pmean`` over the global mesh axis.

Each worker prints one JSON line; the test checks that both processes skipped
the same steps and hold the same scale and parameters. Loopback only, bounded
by a timeout; skipped only where the platform has no CPU collectives.
"""

from __future__ import annotations

import hashlib
import json
import sys

import pytest
from helpers import join_processes, run_processes

pytestmark = pytest.mark.integration

PROCESSES = 2
DEVICES_PER_PROCESS = 2
TIMEOUT = 300  # seconds, for the whole job
# Steps (0-based) of each set-up: the overflow is in process 1's data at BAD.
STEPS, BAD = 4, 2
INIT = 2.0**10


# --------------------------------------------------------------------------- #
# Worker (runs in a fresh process; no conftest, so it sets its own config).
# --------------------------------------------------------------------------- #


def worker(process_id: int, port: int) -> dict:
    import jax

    join_processes(process_id, port, PROCESSES, DEVICES_PER_PROCESS, TIMEOUT)
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxscale as jxs

    me = jax.process_index()
    mesh = Mesh(np.array(jax.devices()), ("data",))
    n = mesh.size
    replicated, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))

    def global_replicated(host):
        return jax.make_array_from_callback(host.shape, replicated, lambda i: host[i])

    def local_digest(tree):
        """Hash of this process's blocks of every leaf (its own view)."""
        h = hashlib.sha256()
        for leaf in jax.tree.leaves(tree):
            for shard in sorted(leaf.addressable_shards, key=lambda s: s.device.id):
                h.update(np.asarray(shard.data).tobytes())
        return h.hexdigest()[:16]

    def replicated_value(x):
        return np.asarray(x).item()  # fully replicated: readable in every process

    def report(state, params_digest, skipped_at):
        return {
            "loss_scale": replicated_value(state.loss_scale.loss_scale),
            "skipped_steps": replicated_value(state.skipped_steps),
            "skipped_at": skipped_at,
            "params": params_digest,
            "scale_replicated": (
                state.loss_scale.loss_scale.sharding.is_fully_replicated
            ),
        }

    results = {"process": me, "devices": jax.device_count()}
    scale = jxs.DynamicLossScale.create(init_scale=INIT)

    # -- dp: jit, replicated params, batch split over both processes ------------
    dim = 8
    params = {"w": global_replicated(np.full((dim, 1), 0.1, np.float32))}
    tx = jxs.dynamic_scaling(optax.sgd(0.05, momentum=0.9), scale)
    state = tx.init(params)

    def loss_fn(params, x, y):
        pred = x.astype(jnp.float16) @ params["w"].astype(jnp.float16)
        return jnp.mean((pred.astype(jnp.float32) - y) ** 2)

    @jax.jit
    def dp_step(params, state, x, y):
        _, grads = jxs.value_and_grad(loss_fn, state)(params, x, y)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    rng = np.random.default_rng(me)  # different data in each process
    skipped_at = []
    for step in range(STEPS):
        x = rng.normal(size=(4 * DEVICES_PER_PROCESS, dim)).astype(np.float32)
        if step == BAD and me == 1:
            x[0, 0] = np.inf
        y = x.sum(axis=1, keepdims=True)
        gx = jax.make_array_from_process_local_data(split, x)
        gy = jax.make_array_from_process_local_data(split, y)
        params, state = dp_step(params, state, gx, gy)
        if not replicated_value(state.last_step_finite):
            skipped_at.append(step)
    results["dp"] = report(state, local_digest(params), skipped_at)
    results["dp"]["params_replicated"] = hashlib.sha256(
        np.asarray(params["w"]).tobytes()
    ).hexdigest()[:16]

    # -- fsdp: params and gradients split over both processes -------------------
    params = jax.make_array_from_process_local_data(
        split, np.full((2 * DEVICES_PER_PROCESS, 3), 1.0 + me, np.float32)
    )
    tx = jxs.dynamic_scaling(optax.sgd(0.1, momentum=0.9), scale)
    state = tx.init(params)

    @jax.jit
    def fsdp_step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    skipped_at, before_bad = [], None
    for step in range(STEPS):
        g = np.full((2 * DEVICES_PER_PROCESS, 3), INIT, np.float32)
        if step == BAD and me == 1:
            g[-1, 1] = np.inf  # a block only process 1 holds
            before_bad = local_digest((params, state.inner_state))
        grads = jax.make_array_from_process_local_data(split, g)
        params, state = fsdp_step(params, state, grads)
        if step == BAD and me == 1:
            assert local_digest((params, state.inner_state)) == before_bad
        if not replicated_value(state.last_step_finite):
            skipped_at.append(step)
    results["fsdp"] = report(state, local_digest(params), skipped_at)

    # -- shard_map: axis_name and a pmean over the global axis -----------------
    tx = jxs.dynamic_scaling(optax.sgd(0.1), scale, axis_name="data")
    params = global_replicated(np.zeros(3, np.float32))
    state = tx.init(params)

    @jax.jit
    @jax.shard_map(mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=(P(), P()))
    def sm_step(params, state, grads):
        grads = jax.lax.pmean(grads[0], "data")  # data-parallel mean
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    skipped_at = []
    for step in range(STEPS):
        rows = np.arange(DEVICES_PER_PROCESS * me, DEVICES_PER_PROCESS * (me + 1))
        g = np.repeat((1.0 + rows[:, None]).astype(np.float32), 3, axis=1)
        if step == BAD and me == 1:
            g[0, 2] = np.inf
        grads = jax.make_array_from_process_local_data(split, g)
        params, state = sm_step(params, state, grads)
        if not replicated_value(state.last_step_finite):
            skipped_at.append(step)
    results["shard_map"] = report(state, local_digest(params), skipped_at)
    # Each applied step moves by lr * mean gradient / scale; the scale halved
    # at the skipped step.
    mean = np.mean(1.0 + np.arange(n))
    inverse_scales = BAD / INIT + (STEPS - BAD - 1) * 2 / INIT
    results["shard_map"]["params_ok"] = bool(
        np.allclose(np.asarray(params), -0.1 * mean * inverse_scales, rtol=1e-5)
    )
    jax.distributed.shutdown()
    return results


# --------------------------------------------------------------------------- #
# The test (parent process).
# --------------------------------------------------------------------------- #


@pytest.fixture(scope="module")
def results():
    return run_processes(__file__, PROCESSES, TIMEOUT)


def test_two_processes_form_one_mesh(results):
    assert [r["process"] for r in results] == list(range(PROCESSES))
    assert {r["devices"] for r in results} == {PROCESSES * DEVICES_PER_PROCESS}


@pytest.mark.parametrize("setup", ["dp", "fsdp", "shard_map"])
def test_overflow_in_one_process_skips_the_step_in_both(results, setup):
    first = results[0][setup]
    for r in results:
        got = r[setup]
        assert got["skipped_at"] == [BAD], (setup, r["process"], got)
        assert got["skipped_steps"] == 1
        assert got["loss_scale"] == INIT / 2
        assert got["scale_replicated"]
        assert got["loss_scale"] == first["loss_scale"]
    if setup == "dp":  # replicated params: the same bits in both processes
        assert len({r["dp"]["params_replicated"] for r in results}) == 1
        assert len({r["dp"]["params"] for r in results}) == 1
    if setup == "shard_map":
        assert all(r["shard_map"]["params_ok"] for r in results)
        assert len({r["shard_map"]["params"] for r in results}) == 1


if __name__ == "__main__":
    out = worker(int(sys.argv[1]), int(sys.argv[2]))
    print("RESULT " + json.dumps(out), flush=True)
