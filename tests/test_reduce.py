"""The compressed data-parallel mean: ``jxs.reduce_mean`` and ``jxs.reduce_gradients``.

Each device sends its gradients in the wire dtype through an all-to-all, sums the
copies of its chunk in float32 and all-gathers the mean back: two roundings to the
wire dtype per value, however many devices (``jaxscale/_reduce.py``). The suite runs
with 8 CPU devices (``tests/conftest.py``), on any host; sub-meshes take the first
2 or 4.
"""

from __future__ import annotations

import re

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
from jaxscale import _hlo

N = 8
F16, BF16, E4M3, E5M2 = jnp.float16, jnp.bfloat16, jnp.float8_e4m3fn, jnp.float8_e5m2


@pytest.fixture(autouse=True)
def _cpu(on_cpu):
    """Every test on the suite's CPU devices, a GPU host's too."""


def mesh_of(n=N):
    return Mesh(np.array(jax.devices("cpu")[:n]), ("data",))


def reduced(rows, n=N, check_vma=True, **kwargs):
    """``jxs.reduce_mean`` inside a jitted shard_map: ``rows`` (a pytree of
    ``[n, ...]`` arrays) has device ``i``'s leaves in row ``i``."""

    def body(tree):
        return jxs.reduce_mean(jax.tree.map(lambda x: x[0], tree), "data", **kwargs)

    return jax.jit(
        jax.shard_map(
            body,
            mesh=mesh_of(n),
            in_specs=P("data"),
            out_specs=P(),
            check_vma=check_vma,
        )
    )(rows)


def spread(shape, seed=0, sigma=2.0):
    """Gradients with a realistic spread: log-normal magnitudes, random signs."""
    rng = np.random.default_rng(seed)
    mag = np.exp(rng.normal(-6.0, sigma, shape))
    return (mag * rng.choice([-1.0, 1.0], shape)).astype(np.float32)


def unit_roundoff(dtype):
    return float(jnp.finfo(dtype).eps) / 2


@pytest.mark.core
@pytest.mark.parametrize("check_vma", [True, False])
def test_float32_wire_equals_pmean(check_vma):
    rows = {
        "w": jnp.asarray(spread((N, 37, 5))),
        "b": jnp.asarray(spread((N, 3), seed=1)).astype(F16),
        "s": jnp.asarray(spread((N,), seed=2)).astype(BF16),
    }
    out = reduced(rows, check_vma=check_vma)
    pmean = jax.jit(
        jax.shard_map(
            lambda t: lax.pmean(jax.tree.map(lambda x: x[0], t), "data"),
            mesh=mesh_of(),
            in_specs=P("data"),
            out_specs=P(),
        )
    )(rows)
    assert jax.tree.map(lambda x: x.dtype, out) == jax.tree.map(
        lambda x: x.dtype, pmean
    )
    np.testing.assert_allclose(out["w"], pmean["w"], rtol=4e-7, atol=1e-12)
    for key in ("b", "s"):  # the sum in float32, one rounding to the leaf dtype
        exact = np.mean(np.asarray(rows[key], np.float64), axis=0)
        u = unit_roundoff(rows[key].dtype)
        np.testing.assert_allclose(np.asarray(out[key], np.float64), exact, rtol=u)


@pytest.mark.parametrize(
    ("wire", "block"),
    [(F16, 256), (F16, 32), (BF16, 256), (BF16, None), (E4M3, 256), (E5M2, 64)],
)
@pytest.mark.core
def test_blocks_stay_within_two_roundings_of_the_exact_mean(wire, block):
    x = spread((N, 3000), sigma=1.0)
    out = np.asarray(reduced(jnp.asarray(x), wire_dtype=wire, block_size=block))
    x64 = x.astype(np.float64)
    exact = x64.mean(axis=0)
    u = unit_roundoff(wire)
    # One rounding of each input, one of the mean; the f32 sum adds ~N * 2**-24,
    # and a value below the wire's normal range (after the block's scale) loses
    # at most half its smallest subnormal spacing times the largest scale.
    fmax = float(jnp.finfo(wire).max)
    floor = 2 * np.abs(x).max() / fmax * float(jnp.finfo(wire).smallest_subnormal)
    bound = (u * 1.001 + N * 2.0**-24) * (np.abs(x64).mean(0) + np.abs(exact)) + floor
    err = np.abs(out - exact)
    assert np.all(err <= bound), (np.max(err / bound), wire, block)


def ring_f16_mean(x):
    """A ring reduction in float16: the partial sum rounded at every hop."""
    acc = x[0].astype(np.float16)
    for row in x[1:]:
        acc = (acc.astype(np.float32) + row.astype(np.float16)).astype(np.float16)
    return acc.astype(np.float64) / len(x)


@pytest.mark.core
def test_error_does_not_grow_with_the_device_count():
    """The all-to-all's error at 8 devices is that at 2; a 16-bit ring's grows."""
    rng = np.random.default_rng(3)
    common = spread((4096,), seed=4, sigma=1.0)
    ours, ring = {}, {}
    for n in (2, 4, 8):
        x = common * (1 + 0.3 * rng.standard_normal((n, 4096))).astype(np.float32)
        exact = x.astype(np.float64).mean(0)
        out = np.asarray(reduced(jnp.asarray(x), n=n, wire_dtype=F16), np.float64)
        ours[n] = np.median(np.abs(out - exact) / np.abs(exact))
        ring[n] = np.median(np.abs(ring_f16_mean(x) - exact) / np.abs(exact))
    assert ours[8] < 1.15 * ours[2], (ours, ring)
    assert ring[8] > 1.2 * ring[2], (ours, ring)
    assert ring[8] > ours[8], (ours, ring)


@pytest.mark.parametrize(
    ("wire", "block"), [(F16, None), (F16, 16), (E4M3, 16), (E5M2, 16), (BF16, 16)]
)
@pytest.mark.core
@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_nonfinite_values_are_never_finite(wire, block, bad):
    x = np.ones((N, 64), np.float32)
    x[5, 20] = bad
    out = np.asarray(reduced(jnp.asarray(x), wire_dtype=wire, block_size=block))
    if block is None:  # travels as it is: the inf itself
        np.testing.assert_array_equal(out[20], np.float32(bad))
        finite = np.arange(64) != 20
    else:  # the block holding it arrives as NaN
        assert np.all(np.isnan(out[16:32]))
        finite = (np.arange(64) < 16) | (np.arange(64) >= 32)
    np.testing.assert_array_equal(out[finite], 1.0)


@pytest.mark.core
def test_scaled_float16_overflow_is_an_inf_on_every_device():
    """A finite float32 value beyond float16's range overflows on the wire."""
    x = np.ones((N, 8), np.float32)
    x[2, 3] = 7e4
    out = np.asarray(reduced(jnp.asarray(x), wire_dtype=F16, block_size=None))
    assert out[3] == np.inf
    assert np.all(np.isfinite(np.delete(out, 3)))


# --------------------------------------------------------------------------- #
# reduce_gradients in a shard_map train step
# --------------------------------------------------------------------------- #


def bits(x):
    x = np.asarray(x)
    return x.view(f"u{x.dtype.itemsize}") if x.dtype.kind == "f" else x


def assert_bit_identical(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(bits(x), bits(y))


def grads_step(tx, opt_state, mesh):
    """A jitted, donating shard_map step taking one gradient row per device."""
    specs = jxs.reduce_state_specs(opt_state, "data")

    def step(params, state, grads):
        grads = jax.tree.map(lambda g: g[0], grads)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return jax.jit(
        jax.shard_map(
            step,
            mesh=mesh,
            in_specs=(P(), specs, P("data")),
            out_specs=(P(), specs),
        ),
        donate_argnums=(0, 1),
    )


PLACEMENTS = {
    "before dynamic_scaling": lambda: optax.chain(
        jxs.reduce_gradients(
            "data", wire_dtype=F16, block_size=None, error_feedback=True
        ),
        jxs.dynamic_scaling(relaxed(optax.adam(1e-2)), jxs.StaticLossScale.create(4.0)),
    ),
    "inside dynamic_scaling": lambda: jxs.dynamic_scaling(
        optax.chain(
            jxs.reduce_gradients("data", wire_dtype=E4M3, error_feedback=True),
            relaxed(optax.adam(1e-2)),
        ),
        jxs.StaticLossScale.create(4.0),
        axis_name="data",
    ),
}


def residual_of(state):
    return optax.tree.get(state, "residual")


@pytest.mark.core
@pytest.mark.parametrize("placement", sorted(PLACEMENTS))
def test_an_overflow_skips_once_everywhere_and_keeps_the_residual(placement):
    tx = PLACEMENTS[placement]()
    mesh = mesh_of()
    params = {"w": jnp.zeros((5, 7)), "b": jnp.zeros(3, F16)}
    with set_mesh(mesh):
        state = tx.init(params)
    assert residual_of(state).shape[0] == N
    step = grads_step(tx, state, mesh)
    grads = {"w": jnp.asarray(spread((N, 5, 7))), "b": jnp.ones((N, 3), F16)}
    params, state = step(params, state, grads)
    assert np.any(np.asarray(residual_of(state)) != 0)
    copy = jax.tree.map(jnp.copy, (params, state))
    bad = {"w": grads["w"].at[3, 1, 1].set(jnp.inf), "b": grads["b"]}
    params, state = step(params, state, bad)
    skipped = optax.tree.get(state, "skipped_steps")
    assert int(skipped) == 1
    keep = lambda s: (  # noqa: E731
        s[0],
        residual_of(s[1]),
        optax.tree.get(s[1], "mean_residual"),
        optax.tree.get(s[1], "mu"),
    )
    assert_bit_identical(keep((params, state)), keep(copy))
    assert np.all(np.isfinite(np.asarray(residual_of(state))))


@pytest.mark.core
def test_error_feedback_makes_the_running_mean_converge():
    """On a fixed gradient the average of what arrives approaches the true mean
    with error feedback, and stays one rounding away without it."""
    x = jnp.asarray(spread((N, 512), seed=5, sigma=1.0))
    exact = np.asarray(x, np.float64).mean(0)
    errors = {}
    for feedback in (False, True):
        tx = jxs.reduce_gradients(
            "data", wire_dtype=E4M3, block_size=32, error_feedback=feedback
        )
        with set_mesh(mesh_of()):
            state = tx.init(x[0])
        specs = jxs.reduce_state_specs(state, "data")

        def run(state, rows, tx=tx):
            def body(s, _):
                g, s = tx.update(rows[0], s)
                return s, g

            return lax.scan(body, state, None, length=16)[1]

        sent = jax.jit(
            jax.shard_map(
                run, mesh=mesh_of(), in_specs=(specs, P("data")), out_specs=P()
            )
        )(state, x)
        average = np.asarray(sent, np.float64).mean(0)
        errors[feedback] = np.abs(average - exact).sum() / np.abs(exact).sum()
    assert errors[True] < 0.2 * errors[False], errors


@pytest.mark.integration
@pytest.mark.pinned
def test_the_step_sends_float16_through_an_all_to_all():
    """XLA:CPU keeps float16 collectives (it widens bf16 and float8 ones)."""
    tx = PLACEMENTS["before dynamic_scaling"]()
    params = {"w": jnp.zeros((64, 64))}
    with set_mesh(mesh_of()):
        state = tx.init(params)
    step = grads_step(tx, state, mesh_of())
    grads = {"w": jnp.zeros((N, 64, 64))}
    hlo = step.lower(params, state, grads).compile().as_text()
    found = collectives(hlo)
    assert ("all-to-all", "f16") in {(kind, dtype) for kind, dtype, _ in found}
    # All of the gradient goes through the all-to-all: 7/8 of it leaves.
    sent = sum(n for kind, dtype, n in found if kind == "all-to-all")
    assert sent == 64 * 64, found
    reduced_f32 = [f for f in found if f[0] == "all-reduce" and f[2] >= 64]
    assert not reduced_f32, found


def collectives(hlo):
    """``(kind, dtype, elements)`` for each collective of an optimized HLO text
    (a tuple-shaped one counts each of its dtypes)."""
    out = []
    for i in _hlo.instructions(hlo):
        kind = i.opcode.removesuffix("-start")
        if kind in ("all-to-all", "all-reduce", "all-gather"):
            sizes = {}
            for dtype, dims in _hlo.shapes(i.type):
                sizes[dtype] = sizes.get(dtype, 0) + int(np.prod(dims))
            out += [(kind, dtype, count) for dtype, count in sizes.items()]
    return out


def mlp_loss(params, batch):
    x, y = batch
    h = jnp.tanh(x @ params["w1"] + params["b1"][None])
    return jnp.mean((h @ params["w2"] - y) ** 2)


def train(reduce, steps=10):
    """A small MLP trained data-parallel with adam under dynamic scaling,
    gradients reduced by ``reduce``; returns the loss of each step."""
    mesh = mesh_of()
    rng = np.random.default_rng(6)
    params = {
        "w1": jnp.asarray(rng.normal(0, 0.5, (4, 16)), jnp.float32),
        "b1": jnp.zeros(16),
        "w2": jnp.asarray(rng.normal(0, 0.5, (16, 1)), jnp.float32),
    }
    x = rng.normal(size=(N * 8, 4)).astype(np.float32)
    batch = (jnp.asarray(x), jnp.asarray(np.sin(x.sum(1, keepdims=True))))
    # A scale the float16 wire carries from the start (the default 2**16 backs
    # off twice first: an overflow of scaled gradients, as a float16 pmean has).
    scale = jxs.DynamicLossScale.create(init_scale=2.0**8)
    tx = jxs.dynamic_scaling(relaxed(optax.adam(3e-2)), scale)
    state = tx.init(params)

    @jax.jit
    @jax.shard_map(
        mesh=mesh,
        in_specs=(P(), P(), P("data")),
        out_specs=(P(), P(), P()),
        check_vma=False,
    )
    def step(params, state, batch):
        loss, grads = jxs.value_and_grad(mlp_loss, state)(params, batch)
        updates, state = tx.update(reduce(grads), state, params)
        return optax.apply_updates(params, updates), state, lax.pmean(loss, "data")

    losses = []
    for _ in range(steps):
        params, state, loss = step(params, state, batch)
        losses.append(float(loss))
    return losses


@pytest.mark.core
def test_a_float16_wire_trains_like_a_float32_pmean():
    pmean = train(lambda g: lax.pmean(g, "data"))
    wire = train(lambda g: jxs.reduce_mean(g, "data", wire_dtype=F16, block_size=None))
    assert pmean[-1] < 0.5 * pmean[0]
    np.testing.assert_allclose(wire, pmean, rtol=1e-2)


@pytest.mark.core
def test_composes_with_accumulate_and_clipping():
    """The mean in front of ``jxs.accumulate`` (its accumulator then holds the
    common gradient), a clip inside ``dynamic_scaling``: the updates of the
    exact mean, to float16 rounding."""

    def inner():
        return jxs.dynamic_scaling(
            optax.chain(optax.clip_by_global_norm(0.5), optax.sgd(0.1))
        )

    tx = optax.chain(
        jxs.reduce_gradients("data", wire_dtype=F16),
        jxs.accumulate(inner(), 2),
    )
    reference = jxs.accumulate(inner(), 2)
    params, ref_params = {"w": jnp.zeros(40)}, {"w": jnp.zeros(40)}
    state, ref_state = tx.init(params), reference.init(params)
    step = grads_step(tx, state, mesh_of())
    ref_step = jax.jit(
        lambda p, s, g: (lambda u, s: (optax.apply_updates(p, u), s))(
            *reference.update(g, s, p)
        )
    )
    for seed in range(4):
        rows = spread((N, 40), seed=seed, sigma=0.5) * 100
        params, state = step(params, state, {"w": jnp.asarray(rows)})
        ref_params, ref_state = ref_step(
            ref_params, ref_state, {"w": jnp.asarray(rows.mean(0))}
        )
    assert np.any(np.asarray(ref_params["w"]) != 0)
    np.testing.assert_allclose(params["w"], ref_params["w"], rtol=2e-3, atol=1e-6)


@pytest.mark.core
def test_pmap():
    x = jnp.asarray(spread((N, 10)))
    out = jax.pmap(  # over the 8 CPU devices by name: a GPU host has one GPU
        lambda g: jxs.reduce_mean(g, "data", wire_dtype=E4M3, block_size=8),
        axis_name="data",
        devices=jax.devices("cpu")[:N],
    )(x)
    np.testing.assert_allclose(out[0], np.asarray(x).mean(0), rtol=0.13)
    assert_bit_identical(out[0], out[7])


# --------------------------------------------------------------------------- #
# Misuse: right or loud
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"wire_dtype": jnp.int8}, ValueError, "`wire_dtype` must be one of .* int8"),
        ({"wire_dtype": "nope"}, TypeError, "`wire_dtype` must be a dtype"),
        (
            {"wire_dtype": E4M3, "block_size": None},
            ValueError,
            "`block_size` must be an int",
        ),
        (
            {"wire_dtype": F16, "block_size": 0},
            ValueError,
            r"`block_size` must be >= 1.*0",
        ),
        (
            {"wire_dtype": F16, "block_size": 2.5},
            TypeError,
            "`block_size` must be an int or None, got 2.5",
        ),
        ({"error_feedback": True}, ValueError, "`error_feedback` needs a `wire_dtype`"),
        ({"error_feedback": 1}, TypeError, "`error_feedback` must be a bool"),
    ],
)
@pytest.mark.core
def test_bad_arguments_raise(kwargs, error, match):
    with pytest.raises(error, match=match):
        jxs.reduce_gradients("data", **kwargs)


@pytest.mark.core
def test_bad_axis_names_raise():
    with pytest.raises(TypeError, match="`axis_name` must be the name of one"):
        jxs.reduce_gradients(("data", "model"))
    with pytest.raises(NameError, match="`axis_name` 'data' is not bound here"):
        jxs.reduce_mean(jnp.ones(3), "data")


@pytest.mark.core
def test_integer_leaves_raise():
    with pytest.raises(TypeError, match=r"`\['n'\]` is int32"):
        reduced({"n": jnp.ones((N, 2), jnp.int32)})


@pytest.mark.core
def test_reducing_twice_raises():
    def twice(g):
        return jxs.reduce_mean(lax.pmean(g[0], "data"), "data")

    f = jax.shard_map(twice, mesh=mesh_of(), in_specs=P("data"), out_specs=P())
    with pytest.raises(ValueError, match="already the same on every device"):
        jax.jit(f)(jnp.ones((N, 3)))


@pytest.mark.core
def test_error_feedback_init_needs_the_axis_size():
    tx = jxs.reduce_gradients("data", wire_dtype=F16, error_feedback=True)
    with pytest.raises(ValueError, match="call `init` inside `with jax.set_mesh"):
        tx.init(jnp.ones(3))


@pytest.mark.core
def test_the_guide_snippet_runs_as_written():
    """docs/multidevice.md's compressed-reduction step, executed as written."""
    import pathlib

    guide = pathlib.Path(__file__).resolve().parents[1] / "docs" / "multidevice.md"
    blocks = re.findall(r"```python\n(.*?)```", guide.read_text(), re.S)
    (snippet,) = [b for b in blocks if "jxs.reduce_gradients(" in b]
    scope = {}
    with jax.numpy_dtype_promotion("standard"):  # optax.adam promotes itself
        exec(snippet, scope)  # noqa: S102 - our own documentation
    assert np.isfinite(float(scope["loss"]))
    assert int(optax.tree.get(scope["opt_state"], "steps")) == 1
