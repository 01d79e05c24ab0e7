"""A float32 input's gradient leaves its matmuls in float32 under autocast
(``gradient_dtype``), so the reduction XLA's partitioner inserts across devices
is float32 (data parallel, FSDP, ``shard_map``), as torch DDP's of an fp32
parameter's gradient; ``gradient_dtype=float16`` (or a function of the input's
path) keeps the 16-bit product and halves those bytes."""

from __future__ import annotations

import re
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import all_eqns
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxscale as jxs
import jaxscale.precision as jxp
from jaxscale import _hlo

with warnings.catch_warnings():  # equinox 0.13 on jax 0.7.1 reads a deprecated name
    warnings.simplefilter("ignore", DeprecationWarning)
    eqx = pytest.importorskip("equinox")

pytestmark = pytest.mark.core

F16, BF16, F32 = np.dtype("float16"), np.dtype(jnp.bfloat16), np.dtype("float32")
D, H, C, B = 32, 64, 8, 128  # widths, classes, batch (16 rows per device)


def mesh():
    return jax.make_mesh((8,), ("data",), devices=jax.devices("cpu")[:8])


def params(seed=0):
    k1, k2 = jax.random.split(jax.random.key(seed))
    return {
        "w1": jax.random.normal(k1, (D, H)) / 4,
        "b1": jnp.zeros(H),
        "w2": jax.random.normal(k2, (H, C)) / 6,
    }


def batch(seed=1):
    kx, ky = jax.random.split(jax.random.key(seed))
    return jax.random.normal(kx, (B, D)), jax.random.randint(ky, (B,), 0, C)


def xent(logits, y):
    # One-hot labels: on jax 0.12 the integer-label loss's gather cannot be
    # differentiated on a batch-sharded array (a sharding-in-types error).
    return optax.softmax_cross_entropy(logits, jax.nn.one_hot(y, C)).mean()


def mlp_loss(p, x, y):
    h = jax.nn.relu(x @ p["w1"] + p["b1"][None])
    return xent(h @ p["w2"], y)


def gradient_collectives(text, min_size):
    """(kind, dtype) of every all-reduce / reduce-scatter of the compiled step
    whose array has at least ``min_size`` elements (the gradients, not the
    loss), read by ``jxs.diagnostics.collective_report``."""
    report = jxs.diagnostics.CollectiveReport.from_hlo(text)
    short = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}
    return {
        (c.kind, short.get(c.dtype, c.dtype))
        for c in report.collectives
        if c.kind in ("all-reduce", "reduce-scatter")
        and np.prod(c.shape, dtype=int) >= min_size
    }


def data_parallel_grad(loss, p, x, y, param_spec=None):
    """``jax.grad(loss)`` jitted on arrays placed on 8 devices (the batch split
    over ``data``, the parameters by ``param_spec``), its compiled text."""
    m = mesh()
    param_spec = P() if param_spec is None else param_spec
    if isinstance(param_spec, dict):
        p = {
            k: jax.device_put(v, NamedSharding(m, param_spec[k])) for k, v in p.items()
        }
    else:
        p = jax.device_put(p, NamedSharding(m, param_spec))
    x, y = jax.device_put((x, y), NamedSharding(m, P("data")))
    grad = jax.jit(jax.grad(loss))
    return grad(p, x, y), grad.lower(p, x, y).compile().as_text()


@pytest.mark.parametrize(
    ("gradient_dtype", "wire"), [(None, "f32"), (jnp.float32, "f32"), ("f16", "f16")]
)
def test_data_parallel_gradients_are_reduced_in_the_chosen_dtype(gradient_dtype, wire):
    p, (x, y) = params(), batch()
    loss = jxs.autocast(mlp_loss, jnp.float16, gradient_dtype=gradient_dtype)
    g, text = data_parallel_grad(loss, p, x, y)
    assert gradient_collectives(text, D * H // 2) == {("all-reduce", wire)}
    # The bias's gradient too (summed over the batch, then across devices).
    assert gradient_collectives(text, H) == {("all-reduce", wire)}
    g_ref = jax.grad(mlp_loss)(p, x, y)
    for k in p:
        assert g[k].dtype == F32
        np.testing.assert_allclose(g[k], g_ref[k], rtol=2e-2, atol=2e-3)


def planned(fmt):
    """A plan that runs both matmul sites of ``mlp_loss`` in ``fmt``."""
    sites = [("(top level)", (B, D, H)), ("(top level)#1", (B, H, C))]
    measures = [jxp.SiteMeasure(s, mkn, (2, 4), {fmt: 0.0}) for s, mkn in sites]
    return jxp.solve(measures, cost="H100", budget=1.0, allowed={fmt})


@pytest.mark.parametrize(("gradient_dtype", "wire"), [(None, "f32"), ("f16", "f16")])
def test_a_half_wide_sites_gradient_is_reduced_in_the_chosen_dtype(
    gradient_dtype, wire
):
    """A plan's ``HALF_WIDE`` site (16-bit operands, float32 result) is
    autocast's one widened product: its weight gradient crosses the devices
    as ``gradient_dtype`` says, as a ``HALF`` site's does."""
    p, (x, y) = params(), batch()
    loss = jxs.autocast(
        mlp_loss,
        jnp.float16,
        plan=planned(jxp.Format.HALF_WIDE),
        gradient_dtype=gradient_dtype,
    )
    products = [
        (*(v.aval.dtype for v in e.invars), e.outvars[0].aval.dtype)
        for e in all_eqns(jax.make_jaxpr(loss)(p, x, y))
        if e.primitive.name == "dot_general"
    ]
    assert products == [(F16, F16, F32)] * 2  # 16-bit operands, float32 results
    g, text = data_parallel_grad(loss, p, x, y)
    assert gradient_collectives(text, H * C) == {("all-reduce", wire)}
    g_ref = jax.grad(mlp_loss)(p, x, y)
    for k in p:
        assert g[k].dtype == F32
        np.testing.assert_allclose(g[k], g_ref[k], rtol=2e-2, atol=2e-3)


def test_float32_products_are_closer_to_the_exact_gradient():
    """Accumulated and returned in float32, a weight gradient skips one float16
    rounding (of each device's partial sum, and of the reduced sum)."""
    p, (x, y) = params(), batch()
    with jax.default_matmul_precision("highest"):
        exact = jax.grad(mlp_loss)(p, x, y)
    errs = {}
    for gd in (None, jnp.float16):
        loss = jxs.autocast(mlp_loss, jnp.float16, gradient_dtype=gd)
        g = jax.jit(jax.grad(loss))(p, x, y)
        errs[gd] = float(jnp.linalg.norm(g["w2"] - exact["w2"]))
    assert errs[None] < errs[jnp.float16]


def test_fsdp_reduces_gradient_shards_in_float32():
    """Weight matrices sharded over the data axis: gathered in float16 for the
    products, their gradients reduced in float32."""
    p, (x, y) = params(), batch()
    specs = {"w1": P("data"), "b1": P(), "w2": P("data")}
    for gd, wire in ((None, "f32"), (jnp.float16, "f16")):
        loss = jxs.autocast(mlp_loss, jnp.float16, gradient_dtype=gd)
        g, text = data_parallel_grad(loss, p, x, y, specs)
        assert {d for _, d in gradient_collectives(text, H * C // 8)} == {wire}
        report = jxs.diagnostics.CollectiveReport.from_hlo(text)
        assert "float16" in report.dtypes(kind="all-gather")
    g_ref = jax.grad(mlp_loss)(p, x, y)
    for k in p:
        np.testing.assert_allclose(g[k], g_ref[k], rtol=2e-2, atol=2e-3)


def test_a_function_of_the_path_picks_per_parameter():
    p, (x, y) = params(), batch()

    def choose(path):
        return jnp.float16 if "'w2'" in path else None

    loss = jxs.autocast(mlp_loss, jnp.float16, gradient_dtype=choose)
    _, text = data_parallel_grad(loss, p, x, y)
    wires = gradient_collectives(text, H * C)
    assert {d for _, d in wires} == {"f32", "f16"}, wires
    seen = []
    jxs.autocast(mlp_loss, gradient_dtype=lambda path: seen.append(path))(p, x, y)
    assert seen == ["[0]['b1']", "[0]['w1']", "[0]['w2']", "[1]", "[2]"]


def test_shard_map_gradients_cross_in_float32():
    """Explicit data parallelism: the cotangent of a replicated parameter is
    summed over the axis by shard_map's own transpose, of the float32 parameter
    marked varying before autocast casts it: float32 with either setting."""
    p, (x, y) = params(), batch()
    m = mesh()
    for gd, wire in ((None, "f32"), (jnp.float16, "f32")):
        loss = jxs.autocast(mlp_loss, jnp.float16, gradient_dtype=gd)

        def step(p, x, y, loss=loss):
            return jax.lax.pmean(jax.grad(loss)(p, x, y), "data")

        sharded = jax.jit(
            jax.shard_map(
                step, mesh=m, in_specs=(P(), P("data"), P("data")), out_specs=P()
            )
        )
        bs = NamedSharding(m, P("data"))
        x, y = jax.device_put(x, bs), jax.device_put(y, bs)
        g = sharded(p, x, y)
        assert all(v.dtype == F32 for v in jax.tree.leaves(g))
        text = sharded.lower(p, x, y).compile().as_text()
        assert {d for _, d in gradient_collectives(text, H * C)} == {wire}


def test_layers_under_scan_get_float32_gradients():
    k = jax.random.split(jax.random.key(3), 3)
    stack = jax.random.normal(k[0], (3, D, D)) / 4
    x = jax.random.normal(k[1], (B, D))

    def loss(stack, x):
        h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, stack)
        return jnp.mean(h**2)

    wrapped = jxs.autocast(loss, jnp.float16)
    g = jax.jit(jax.grad(wrapped))(stack, x)
    assert g.dtype == F32
    np.testing.assert_allclose(g, jax.grad(loss)(stack, x), rtol=3e-2, atol=3e-3)
    m = mesh()
    sharded = jax.jit(
        jax.grad(wrapped),
        in_shardings=(NamedSharding(m, P()), NamedSharding(m, P("data"))),
        out_shardings=NamedSharding(m, P()),
    )
    text = sharded.lower(stack, x).compile().as_text()
    assert {d for _, d in gradient_collectives(text, D * D)} == {"f32"}


class _Linen(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(C)(nn.LayerNorm()(nn.relu(nn.Dense(H)(x))))


class _Nnx(nnx.Module):
    def __init__(self, rngs):
        self.l1, self.l2 = nnx.Linear(D, H, rngs=rngs), nnx.Linear(H, C, rngs=rngs)

    def __call__(self, x):
        return self.l2(jax.nn.relu(self.l1(x)))


def _models():
    x = jnp.zeros((1, D))
    linen = _Linen()
    variables = linen.init(jax.random.key(0), x)

    def linen_loss(v, x, y):
        logits = linen.apply(v, x)
        return xent(logits, y)

    graph, state = nnx.split(_Nnx(nnx.Rngs(0)))

    def nnx_loss(state, x, y):
        logits = nnx.merge(graph, state)(x)
        return xent(logits, y)

    mlp = eqx.nn.MLP(D, C, H, 1, key=jax.random.key(0))
    arrays, static = eqx.partition(mlp, eqx.is_array)

    def eqx_loss(arrays, x, y):
        logits = jax.vmap(eqx.combine(arrays, static))(x)
        return xent(logits, y)

    return {
        "linen": (linen_loss, variables),
        "nnx": (nnx_loss, state),
        "equinox": (eqx_loss, arrays),
    }


@pytest.mark.parametrize("library", ["linen", "nnx", "equinox"])
def test_library_models_reduce_gradients_in_float32(library):
    loss, p = _models()[library]
    x, y = batch()
    g, text = data_parallel_grad(jxs.autocast(loss, jnp.float16), p, x, y)
    assert all(v.dtype == F32 for v in jax.tree.leaves(g))
    # Every parameter's: matrices, biases, a LayerNorm's scale and offset.
    assert {d for _, d in gradient_collectives(text, C)} == {"f32"}
    g_ref = jax.grad(loss)(p, x, y)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref), strict=True):
        np.testing.assert_allclose(a, b, rtol=3e-2, atol=3e-3)


def test_a_dynamic_scaling_step_is_unchanged_in_semantics():
    """The loss scale still guards the activation gradients (float16): an
    overflow there skips the step, params and state bit-identical."""
    p, (x, y) = params(), batch()
    scale = jxs.DynamicLossScale.create(init_scale=2.0**15)
    tx = jxs.dynamic_scaling(optax.sgd(1e-3, momentum=0.9), scale)
    state = tx.init(p)
    loss = jxs.autocast(lambda p, x, y: mlp_loss(p, x, y) * 1e3, jnp.float16)

    @jax.jit
    def step(p, state):
        _, g = jxs.value_and_grad(loss, state)(p, x, y)
        updates, state = tx.update(g, state, p)
        return optax.apply_updates(p, updates), state

    new_p, new_state = step(p, state)
    assert float(jxs.loss_scale_of(new_state).loss_scale) < 2.0**15  # skipped
    for a, b in zip(jax.tree.leaves(new_p), jax.tree.leaves(p), strict=True):
        np.testing.assert_array_equal(a, b)


def test_forward_mode_through_the_wide_products():
    p, (x, y) = params(), batch()
    loss = jxs.autocast(mlp_loss, jnp.float16)
    tangent = jax.tree.map(jnp.ones_like, p)
    _, t = jax.jvp(lambda p: loss(p, x, y), (p,), (tangent,))
    _, t_ref = jax.jvp(lambda p: mlp_loss(p, x, y), (p,), (tangent,))
    assert t.dtype == F32
    np.testing.assert_allclose(t, t_ref, rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize(("dtype", "name"), [(F16, "f16"), (BF16, "bf16")])
def test_a_gpu_runs_the_weight_gradient_on_16_bit_operands(dtype, name):
    """Lowered for CUDA (no GPU needed): the weight-gradient products carry the
    16-bit dot algorithm with a float32 accumulator and result."""
    p, (x, y) = params(), batch()
    grad = jax.jit(jax.grad(jxs.autocast(mlp_loss, dtype)))
    text = grad.trace(p, x, y).lower(lowering_platforms=("cuda",)).as_text()
    dots = _hlo.stablehlo_dots(text)
    wide = [d for d in dots if f"lhs_precision_type = {name}" in d.attrs]
    assert len(wide) == 2, dots  # dW1 and dW2
    for d in wide:
        assert "accumulation_type = f32" in d.attrs and d.result[0] == "f32", d
    cpu = grad.trace(p, x, y).lower(lowering_platforms=("cpu",)).as_text()
    assert "precision_type" not in cpu  # XLA:CPU has no dot algorithms


@pytest.mark.parametrize(
    ("x_shape", "w_shape", "algorithms"),
    [
        ((B, D), (D, 1), 0),
        ((B, 1), (1, H), 0),
        ((1, D), (D, H), 0),
        ((B, D), (D, H), 1),
    ],
    ids=["width-1 output", "one input feature", "batch of one", "matrix-matrix"],
)
def test_a_matrix_vector_weight_gradient_carries_no_gpu_algorithm(
    x_shape, w_shape, algorithms
):
    """XLA:GPU runs a matrix-vector product as a reduction and refuses a dot
    algorithm there (a regression head's weight gradient failed to compile on
    an H200): such products take mixed operands, as on the CPU, and compute
    the same gradient."""
    w = jax.random.normal(jax.random.key(0), w_shape) / 4
    x = jax.random.normal(jax.random.key(1), x_shape)

    def loss(w, x):
        return jnp.mean(jnp.tanh(x @ w) ** 2)

    grad = jax.jit(jax.grad(jxs.autocast(loss, jnp.float16)))
    text = grad.trace(w, x).lower(lowering_platforms=("cuda",)).as_text()
    dots = _hlo.stablehlo_dots(text)
    assert sum("lhs_precision_type = f16" in d.attrs for d in dots) == algorithms, dots
    g = grad(w, x)
    assert g.dtype == F32
    np.testing.assert_allclose(g, jax.grad(loss)(w, x), rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize(
    "bad", ["int8", jnp.float64, "float8_e4m3fn", jnp.bfloat16, object()]
)
def test_bad_gradient_dtype_raises(bad):
    with pytest.raises(ValueError, match="`gradient_dtype` must be float32"):
        jxs.autocast(mlp_loss, jnp.float16, gradient_dtype=bad)


def test_a_path_function_returning_a_bad_dtype_raises_naming_the_input():
    p, (x, y) = params(), batch()
    loss = jxs.autocast(mlp_loss, gradient_dtype=lambda path: jnp.int32)
    with pytest.raises(ValueError, match=r"for the input at \[0\]\['b1'\]"):
        loss(p, x, y)


def test_the_guide_snippet_runs_as_written():
    """docs/multidevice.md's `gradient_dtype` snippet, on a model with an
    embedding: the table's gradient bf16, the rest float32."""
    import pathlib

    guide = pathlib.Path(__file__).resolve().parents[1] / "docs" / "multidevice.md"
    blocks = re.findall(r"```python\n(.*?)```", guide.read_text(), re.S)
    (snippet,) = [b for b in blocks if "gradient_dtype=lambda path" in b]

    def loss(p, ids):
        return jnp.mean((p["embed"][ids] @ p["w"]) ** 2)

    scope = {"jxs": jxs, "jnp": jnp, "loss": loss}
    exec(snippet, scope)  # noqa: S102 - our own documentation
    p = {"embed": jnp.ones((10, D)), "w": jnp.ones((D, C))}
    ids = jnp.arange(4)
    for name in ("loss16", "embed16"):
        g = jax.grad(scope[name])(p, ids)
        assert {v.dtype for v in jax.tree.leaves(g)} == {F32}


def test_tensor_parallel_gradients_are_reduced_over_data_in_float32():
    """A 2 x 4 mesh: the batch over ``data``, w1's columns and w2's rows over
    ``model`` (Megatron's MLP split): each weight shard's gradient is summed over
    the data axis, in float32 by default."""
    auto = (jax.sharding.AxisType.Auto,) * 2  # the partitioner places the sums
    m = jax.make_mesh(
        (2, 4), ("data", "model"), axis_types=auto, devices=jax.devices("cpu")[:8]
    )
    p, (x, y) = params(), batch()
    specs = {"w1": P(None, "model"), "b1": P("model"), "w2": P("model", None)}
    placed = {k: jax.device_put(v, NamedSharding(m, specs[k])) for k, v in p.items()}
    x, y = jax.device_put((x, y), NamedSharding(m, P("data")))
    for gd, wire in ((None, "f32"), (jnp.float16, "f16")):
        loss = jxs.autocast(mlp_loss, jnp.float16, gradient_dtype=gd)
        grad = jax.jit(jax.grad(loss))
        text = grad.lower(placed, x, y).compile().as_text()
        # The weight shards' sums over data (an activation gradient's sum over
        # model, of the column-parallel layer's input, stays float16 as torch's).
        shards = {(D, H // 4), (H // 4, D), (H // 4, C), (C, H // 4)}
        report = jxs.diagnostics.CollectiveReport.from_hlo(text)
        found = {c.dtype for c in report.collectives if tuple(c.shape) in shards}
        assert found == {"float32" if wire == "f32" else "float16"}, report
    g = grad(placed, x, y)
    g_ref = jax.grad(mlp_loss)(p, x, y)
    for k in p:
        np.testing.assert_allclose(g[k], g_ref[k], rtol=2e-2, atol=2e-3)
