"""``jxs.reduce_gradients(..., warmup_steps=N)``: the first ``N`` finite steps
send the gradients in ``warmup_dtype`` (bfloat16), later ones in ``wire_dtype``
(issue 49 item 7: a float8 wire with error feedback trailed a float32 mean
mid-training). One compiled step switches by a count in the state."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import set_mesh
from helpers import relaxed
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jaxscale as jxs

N = 8
BF16, E4M3 = jnp.bfloat16, jnp.float8_e4m3fn


@pytest.fixture(autouse=True)
def _cpu(on_cpu):
    """Every test on the suite's CPU devices, a GPU host's too."""


def mesh_of():
    return Mesh(np.array(jax.devices("cpu")[:N]), ("data",))


def rows(seed=0):
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.normal(size=(N, 256)) * np.exp(rng.normal(size=(N, 256))))


def scanned(tx, x, steps):
    """What ``tx`` sends on each of ``steps`` steps of the same rows ``x``, and
    its last state, under one jitted shard_map."""
    with set_mesh(mesh_of()):
        state = tx.init(x[0])
    specs = jxs.reduce_state_specs(state, "data")

    def run(state, x):
        def body(s, _):
            g, s = tx.update(x[0], s)
            return s, g

        state, sent = lax.scan(body, state, None, length=steps)
        return sent, state

    f = jax.jit(
        jax.shard_map(
            run, mesh=mesh_of(), in_specs=(specs, P("data")), out_specs=(P(), specs)
        )
    )
    return f(state, x), f.lower(state, x).as_text()


def sent_by(wire, x):
    tx = jxs.reduce_gradients("data", wire_dtype=wire, block_size=32)
    return np.asarray(scanned(tx, x, 1)[0][0][0])


@pytest.mark.core
@pytest.mark.parametrize("feedback", [False, True], ids=["plain", "error_feedback"])
def test_the_warmup_sends_16_bits_then_the_wire(feedback):
    x = rows()
    tx = jxs.reduce_gradients(
        "data",
        wire_dtype=E4M3,
        block_size=32,
        error_feedback=feedback,
        warmup_steps=2,
    )
    (sent, state), lowered = scanned(tx, x, 4)
    assert state.warmup_count.dtype == jnp.int32 and int(state.warmup_count) == 2
    # Both wires are in the one program, chosen at run time.
    assert "f8E4M3FN" in lowered and "bf16" in lowered and "case" in lowered
    sent = np.asarray(sent)
    bf16, f8 = sent_by(BF16, x), sent_by(E4M3, x)
    assert not np.array_equal(bf16, f8)
    np.testing.assert_array_equal(sent[0], bf16)  # the first step: bfloat16
    if not feedback:  # the same rows every step: the same means
        np.testing.assert_array_equal(sent[1], bf16)
        np.testing.assert_array_equal(sent[2], f8)
        np.testing.assert_array_equal(sent[3], f8)
    exact = np.asarray(x, np.float64).mean(0)
    error = [np.abs(s - exact).max() for s in sent]
    assert max(error[:2]) < 0.1 * max(error[2:]), error  # 8 bits vs 3


@pytest.mark.core
def test_without_warmup_the_state_has_no_count_and_the_step_is_unchanged():
    x = rows(1)
    plain = jxs.reduce_gradients("data", wire_dtype=E4M3, block_size=32)
    zero = jxs.reduce_gradients("data", wire_dtype=E4M3, block_size=32, warmup_steps=0)
    (a, sa), text_a = scanned(plain, x, 2)
    (b, sb), text_b = scanned(zero, x, 2)
    assert sa.warmup_count is None and sb.warmup_count is None
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert "case" not in text_a and text_a == text_b


@pytest.mark.core
def test_a_skipped_step_does_not_count_and_one_compile_serves_every_step():
    tx = jxs.dynamic_scaling(
        optax.chain(
            jxs.reduce_gradients(
                "data", wire_dtype=E4M3, error_feedback=True, warmup_steps=3
            ),
            relaxed(optax.adam(1e-2)),
        ),
        jxs.StaticLossScale.create(4.0),
        axis_name="data",
    )
    mesh = mesh_of()
    params = {"w": jnp.zeros((5, 7))}
    with set_mesh(mesh):
        state = tx.init(params)
    specs = jxs.reduce_state_specs(state, "data")
    assert optax.tree.get(specs, "warmup_count") == P()
    assert optax.tree.get(specs, "residual") == P("data")

    def step(params, state, grads):
        grads = jax.tree.map(lambda g: g[0], grads)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    step = jax.jit(
        jax.shard_map(
            step,
            mesh=mesh,
            in_specs=(P(), specs, P("data")),
            out_specs=(P(), specs),
        )
    )
    good = {"w": jnp.asarray(rows(2)[:, :35].reshape(N, 5, 7))}
    bad = {"w": good["w"].at[3, 1, 1].set(jnp.inf)}
    count = lambda s: int(optax.tree.get(s, "warmup_count"))  # noqa: E731
    params, state = step(params, state, good)
    assert count(state) == 1
    before = jax.tree.map(np.asarray, state)
    params, state = step(params, state, bad)
    assert int(optax.tree.get(state, "skipped_steps")) == 1
    assert count(state) == 1
    for key in ("warmup_count", "residual", "mean_residual"):
        np.testing.assert_array_equal(
            np.asarray(optax.tree.get(state, key)), optax.tree.get(before, key)
        )
    compiled = step._cache_size()
    for _ in range(4):  # past the warm-up: the count stops at its length
        params, state = step(params, state, good)
    assert count(state) == 3
    assert step._cache_size() == compiled  # the switch retraced nothing


@pytest.mark.unit
@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"warmup_steps": -1}, ValueError, r"`warmup_steps` must be >= 0, got -1"),
        ({"warmup_steps": 1.5}, TypeError, r"`warmup_steps` must be an int, got 1.5"),
        ({"warmup_steps": True}, TypeError, r"`warmup_steps` must be an int, got True"),
        (
            {"warmup_steps": 5, "warmup_dtype": E4M3},
            ValueError,
            r"`warmup_dtype` must be a wire wider than `wire_dtype` float8_e4m3fn "
            r"\(float32, bfloat16, float16\), got float8_e4m3fn",
        ),
        (
            {"warmup_steps": 5, "warmup_dtype": jnp.int32},
            ValueError,
            r"`warmup_dtype` must be a wire wider.*got int32",
        ),
        (
            {"warmup_steps": 5, "warmup_dtype": "nonsense"},
            TypeError,
            r"`warmup_dtype` must be a dtype, got 'nonsense'",
        ),
    ],
)
def test_bad_warmup_arguments_raise(kwargs, error, match):
    with pytest.raises(error, match=match):
        jxs.reduce_gradients("data", wire_dtype=E4M3, **kwargs)


@pytest.mark.unit
def test_a_float32_wire_has_no_wider_warmup():
    with pytest.raises(ValueError, match=r"wider than `wire_dtype` float32 \(none\)"):
        jxs.reduce_gradients("data", warmup_steps=1, warmup_dtype=jnp.float32)


@pytest.mark.core
def test_a_state_without_a_count_is_refused():
    x = rows(3)
    old = jxs.reduce_gradients("data", wire_dtype=E4M3, block_size=32)
    new = jxs.reduce_gradients("data", wire_dtype=E4M3, block_size=32, warmup_steps=2)
    with set_mesh(mesh_of()):
        state = old.init(x[0])
    f = jax.shard_map(
        lambda s, x: new.update(x[0], s)[0],
        mesh=mesh_of(),
        in_specs=(P(), P("data")),
        out_specs=P(),
    )
    with pytest.raises(ValueError, match=r"no `warmup_count`.*warms up for 2 steps"):
        jax.jit(f)(state, x)
