"""jxs.diagnostics.cotangent_probe / cotangent_report / cotangent_table: per-site
statistics of activation gradients agree with NumPy on the same cotangents
obtained by jax.grad."""

import re
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

import jaxscale as jxs

pytestmark = pytest.mark.integration

DOCS = Path(__file__).resolve().parents[1] / "docs"
F16, BF16 = np.dtype("float16"), np.dtype(ml_dtypes.bfloat16)

# A model whose cotangent at "logits" spans 1e-12 .. 1 by construction: the loss
# weights each logit by `C`, so d loss / d logits = C * (1 - tanh^2) / N.
C = jnp.asarray(np.logspace(-12, 0, 6, dtype=np.float32))
KEYS = jax.random.split(jax.random.key(0), 3)
W1 = jax.random.normal(KEYS[0], (4, 8)) / 2
W2 = jax.random.normal(KEYS[1], (8, 6)) / 3
X = jax.random.normal(KEYS[2], (5, 4))


def hidden(w1, x):
    return jnp.tanh(x @ w1)


def head(h, w2):
    return jnp.mean(jnp.tanh(h @ w2) * C[None, :])


def loss_fn(w1, w2, x):
    h = jxs.diagnostics.cotangent_probe(hidden(w1, x), "hidden")
    logits = jxs.diagnostics.cotangent_probe(h @ w2, "logits")
    return jnp.mean(jnp.tanh(logits) * C[None, :])


def reference_cotangents(scale, w1=W1, w2=W2, x=X):
    """The cotangents at both sites, by jax.grad of the scaled loss (no probes)."""
    h = hidden(w1, x)
    logits = h @ w2
    g_logits = jax.grad(lambda z: jnp.mean(jnp.tanh(z) * C[None, :]) * scale)(logits)
    g_hidden = jax.grad(lambda h: head(h, w2) * scale)(h)
    return {"hidden": [g_hidden], "logits": [g_logits]}


@np.errstate(over="ignore")  # casting to float16 overflows on purpose
def numpy_stats(cotangents, dtype):
    g = np.concatenate([np.asarray(c, np.float32).ravel() for c in cotangents])
    finite = np.isfinite(g)
    y = g.astype(dtype).astype(np.float32)
    candidate = (g != 0) & finite
    info = ml_dtypes.finfo(dtype)
    mx = np.abs(g[finite]).max() if finite.any() else np.float32(0)
    return {
        "size": g.size,
        "zero_fraction": (g == 0).mean(),
        "flush_fraction": (candidate & (y == 0)).mean(),
        "subnormal_fraction": ((y != 0) & (np.abs(y) < info.smallest_normal)).mean(),
        "overflow_fraction": (candidate & ~np.isfinite(y)).mean(),
        "nonfinite_fraction": (~finite).mean(),
        "max_abs": mx,
        "headroom_log2": np.log2(np.float64(info.max)) - np.log2(np.float64(mx)),
    }


def assert_matches(stats, expected, *, max_exact=True):
    for field, value in expected.items():
        got = float(getattr(stats, field))
        if field == "max_abs" and not max_exact:
            assert value <= got <= value * (1 + 1 / 16), (field, got, value)
        elif field == "headroom_log2" and not max_exact:
            assert value - np.log2(1 + 1 / 16) <= got <= value, (field, got, value)
        else:
            np.testing.assert_allclose(got, value, rtol=1e-6, err_msg=field)


# --------------------------------------------------------------------------- #
# Agreement with NumPy
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("dtype", [F16, BF16])
@pytest.mark.parametrize("scale", [1.0, 2.0**10, 2.0**24])
def test_fractions_match_numpy_on_the_same_cotangents(dtype, scale):
    report = jxs.diagnostics.cotangent_report(loss_fn, scale, dtype)(W1, W2, X)
    assert list(report) == ["hidden", "logits"]
    expected = reference_cotangents(scale)
    for name, stats in report.items():
        assert isinstance(stats, jxs.diagnostics.CotangentStats)
        assert all(v.dtype == jnp.float32 and v.shape == () for v in stats)
        assert float(stats.calls) == 1 and float(stats.loss_scale) == scale
        assert_matches(stats, numpy_stats(expected[name], dtype))


def test_the_tiny_site_underflows_and_a_scale_recovers_it():
    """The known case: at scale 1 float16 flushes the 1e-12.. weights of `C`."""
    at_1 = jxs.diagnostics.cotangent_report(loss_fn, 1.0)(W1, W2, X)["logits"]
    at_2_16 = jxs.diagnostics.cotangent_report(loss_fn, 2.0**16)(W1, W2, X)["logits"]
    at_2_40 = jxs.diagnostics.cotangent_report(loss_fn, 2.0**40)(W1, W2, X)["logits"]
    # Columns 1e-12, 1e-9.6, 1e-7.2 of C (about 1e-14 .. 1e-9 after the mean)
    # flush at scale 1: half of the elements.
    assert float(at_1.flush_fraction) == pytest.approx(0.5)
    assert float(at_2_16.flush_fraction) < float(at_1.flush_fraction)
    assert float(at_1.overflow_fraction) == 0 and float(at_1.headroom_log2) > 16
    # 2**40 overflows the largest column: negative headroom.
    assert float(at_2_40.overflow_fraction) > 0 > float(at_2_40.headroom_log2)


def test_under_jit_and_no_retrace():
    traces = []

    def counted(*args):
        traces.append(1)
        return loss_fn(*args)

    report_fn = jax.jit(jxs.diagnostics.cotangent_report(counted, 2.0**10))
    eager = jxs.diagnostics.cotangent_report(loss_fn, 2.0**10)(W1, W2, X)
    jitted = report_fn(W1, W2, X)
    report_fn(W1 * 2, W2, X)
    assert len(traces) == 2  # eval_shape + grad, once
    expected = jax.jit(reference_cotangents)(2.0**10)
    for name in eager:
        assert_matches(jitted[name], numpy_stats(expected[name], F16))
        for a, b in zip(eager[name], jitted[name], strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-6)


def test_loss_scale_forms_agree():
    ls = jxs.DynamicLossScale.create(init_scale=2.0**12)
    tx = jxs.dynamic_scaling(optax.sgd(0.1), ls)
    state = tx.init((W1, W2))
    forms = [2.0**12, ls, state]
    reports = [jxs.diagnostics.cotangent_report(loss_fn, s)(W1, W2, X) for s in forms]
    for r in reports[1:]:
        for name in r:
            for a, b in zip(r[name], reports[0][name], strict=True):
                np.testing.assert_array_equal(a, b)


def test_float16_model_zero_fraction_is_what_float16_flushed():
    """Run on the float16 model itself: the flush already happened upstream."""
    w1, w2, x = (a.astype(jnp.float16) for a in (W1, W2, X))

    def loss16(w1, w2, x):
        h = jxs.diagnostics.cotangent_probe(hidden(w1, x), "hidden")
        logits = jxs.diagnostics.cotangent_probe(h @ w2, "logits")
        return jnp.mean(jnp.tanh(logits) * C[None, :].astype(jnp.float16))

    report = jxs.diagnostics.cotangent_report(loss16, 1.0)(w1, w2, x)["logits"]
    h = hidden(w1, x)
    ct = jax.grad(lambda z: jnp.mean(jnp.tanh(z) * C[None, :].astype(jnp.float16)))(
        h @ w2
    )
    assert ct.dtype == F16
    assert_matches(report, numpy_stats([ct], F16))
    assert float(report.flush_fraction) == 0 < float(report.zero_fraction)


def test_pytree_activation_and_has_aux():
    def fun(w1, w2, x):
        h = hidden(w1, x)
        pair = jxs.diagnostics.cotangent_probe(
            {"a": h, "b": h @ w2, "n": jnp.int32(3), "none": None}, "pair"
        )
        loss = jnp.mean(pair["a"]) + jnp.mean(jnp.tanh(pair["b"]) * C[None, :])
        return loss, {"n": pair["n"]}

    stats = jxs.diagnostics.cotangent_report(fun, 8.0, has_aux=True)(W1, W2, X)["pair"]
    h = hidden(W1, X)
    ga, gb = jax.grad(
        lambda a, b: 8.0 * (jnp.mean(a) + jnp.mean(jnp.tanh(b) * C[None, :])),
        argnums=(0, 1),
    )(h, h @ W2)
    assert_matches(stats, numpy_stats([ga, gb], F16))
    assert float(stats.size) == h.size + h.shape[0] * 6


def test_site_that_does_not_reach_the_loss():
    def fun(x):
        jxs.diagnostics.cotangent_probe(x * 2, "unused")
        return jnp.sum(jxs.diagnostics.cotangent_probe(x, "used"))

    report = jxs.diagnostics.cotangent_report(fun)(jnp.ones(3))
    assert float(report["used"].calls) == 1 and float(report["used"].size) == 3
    unused = report["unused"]
    assert float(unused.calls) == 0 and float(unused.size) == 0
    assert float(unused.zero_fraction) == 0 and float(unused.headroom_log2) == np.inf


# --------------------------------------------------------------------------- #
# Repeated sites: loops, scan, vmap
# --------------------------------------------------------------------------- #

LAYERS = 4
WS = jax.random.normal(jax.random.key(3), (LAYERS, 8, 8)) / np.sqrt(8)
XS = jax.random.normal(jax.random.key(4), (5, 8)) * 1e-3


def loop_loss(ws, x):
    h = x
    for i in range(LAYERS):
        h = jxs.diagnostics.cotangent_probe(jnp.tanh(h @ ws[i]), f"layer{i}")
    return jnp.mean(h**2)


def _scan_body(h, inputs):  # module level: lax.scan caches its trace
    w, i = inputs
    h = jxs.diagnostics.cotangent_probe(jnp.tanh(h @ w), "layer", index=i, size=LAYERS)
    return h, None


def scan_loss(ws, x):
    h, _ = jax.lax.scan(_scan_body, x, (ws, jnp.arange(LAYERS)))
    return jnp.mean(h**2)


def test_python_loop_against_numpy():
    scale = 2.0**8
    report = jxs.diagnostics.cotangent_report(loop_loss, scale)(WS, XS)
    hs, h = [], XS
    for i in range(LAYERS):
        h = jnp.tanh(h @ WS[i])
        hs.append(h)

    def rest(i, h):
        for j in range(i + 1, LAYERS):
            h = jnp.tanh(h @ WS[j])
        return jnp.mean(h**2) * scale

    for i in range(LAYERS):
        g = jax.grad(lambda h, i=i: rest(i, h))(hs[i])
        assert_matches(report[f"layer{i}"], numpy_stats([g], F16))


@pytest.mark.parametrize("jit", [False, True])
def test_scan_with_index_gives_one_row_per_layer(jit):
    scale = 2.0**8
    fn = jxs.diagnostics.cotangent_report(scan_loss, scale)
    report = (jax.jit(fn) if jit else fn)(WS, XS)
    loop = jxs.diagnostics.cotangent_report(loop_loss, scale)(WS, XS)
    assert list(report) == [f"layer[{i}]" for i in range(LAYERS)]
    for i in range(LAYERS):
        for a, b in zip(report[f"layer[{i}]"], loop[f"layer{i}"], strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5)


def test_scan_without_index_aggregates():
    def body(h, w):
        return jxs.diagnostics.cotangent_probe(jnp.tanh(h @ w), "layer"), None

    def fun(ws, x):
        return jnp.mean(jax.lax.scan(body, x, ws)[0] ** 2)

    scale = 2.0**8
    agg = jxs.diagnostics.cotangent_report(fun, scale)(WS, XS)["layer"]
    per = jxs.diagnostics.cotangent_report(loop_loss, scale)(WS, XS)
    rows = [per[f"layer{i}"] for i in range(LAYERS)]
    assert float(agg.calls) == LAYERS
    assert float(agg.size) == sum(float(r.size) for r in rows)
    np.testing.assert_allclose(
        agg.flush_fraction, np.mean([float(r.flush_fraction) for r in rows]), 1e-6
    )
    true_max = max(float(r.max_abs) for r in rows)
    assert true_max <= float(agg.max_abs) <= true_max * (1 + 1 / 16)

    # A Python loop with one repeated name aggregates too, with an exact max.
    def loop_same(ws, x):
        h = x
        for i in range(LAYERS):
            h = jxs.diagnostics.cotangent_probe(jnp.tanh(h @ ws[i]), "layer")
        return jnp.mean(h**2)

    same = jxs.diagnostics.cotangent_report(loop_same, scale)(WS, XS)["layer"]
    assert float(same.max_abs) == true_max
    np.testing.assert_allclose(same.flush_fraction, agg.flush_fraction, 1e-6)


def test_vmap_per_example():
    def per_example(ws, x):
        return loop_loss(ws, x[None])

    def fun(ws, xs):
        return jnp.mean(jax.vmap(per_example, in_axes=(None, 0))(ws, xs))

    scale = 2.0**8
    report = jxs.diagnostics.cotangent_report(fun, scale)(WS, XS)
    batch = jxs.diagnostics.cotangent_report(loop_loss, scale)(WS, XS)
    for i in range(LAYERS):
        v, b = report[f"layer{i}"], batch[f"layer{i}"]
        assert float(v.calls) == XS.shape[0] and float(v.size) == float(b.size)
        # The mean of per-example means is the batch mean: the same cotangents.
        np.testing.assert_allclose(v.zero_fraction, b.zero_fraction)
        true_max = float(b.max_abs)
        assert true_max * (1 - 1e-6) <= float(v.max_abs) <= true_max * (1 + 1 / 16)


def test_out_of_range_index_is_nan():
    def fun(ws, x):
        def body(h, inputs):
            w, i = inputs
            h = jxs.diagnostics.cotangent_probe(
                jnp.tanh(h @ w), "layer", index=i + 1, size=LAYERS
            )
            return h, None

        return jnp.mean(jax.lax.scan(body, x, (ws, jnp.arange(LAYERS)))[0] ** 2)

    report = jxs.diagnostics.cotangent_report(fun, 2.0**8)(WS, XS)
    assert all(np.isnan(float(s.zero_fraction)) for s in report.values())
    assert all(float(s.loss_scale) == 2.0**8 for s in report.values())


# --------------------------------------------------------------------------- #
# Cached traces, checkpoint, Flax
# --------------------------------------------------------------------------- #


def test_cached_traces_are_not_reused():
    """jit, checkpoint and a module-level scan body were traced without probes
    first; the report traces them afresh, on every call."""
    expected = jxs.diagnostics.cotangent_report(scan_loss, 2.0**8)(WS, XS)
    jitted = jax.jit(scan_loss)
    jitted(WS, XS)
    remat = jax.checkpoint(scan_loss)
    jax.eval_shape(jax.grad(remat), WS, XS)
    for fun in (jitted, remat, scan_loss):  # scan_loss again: no stale taps
        got = jxs.diagnostics.cotangent_report(fun, 2.0**8)(WS, XS)
        for name in expected:
            for a, b in zip(got[name], expected[name], strict=True):
                np.testing.assert_allclose(a, b, rtol=1e-5)


def test_probe_outside_a_report_is_the_identity():
    plain = jax.make_jaxpr(lambda w1, w2, x: head(hidden(w1, x), w2))(W1, W2, X)
    probed = jax.make_jaxpr(loss_fn)(W1, W2, X)
    assert str(plain) == str(probed)
    g = jax.grad(loss_fn, argnums=(0, 1))(W1, W2, X)
    g_ref = jax.grad(lambda a, b: head(hidden(a, X), b), argnums=(0, 1))(W1, W2)
    for a, b in zip(g, g_ref, strict=True):
        np.testing.assert_array_equal(a, b)


def _host(v):
    if jnp.issubdtype(v.dtype, jax.dtypes.prng_key):
        v = jax.random.key_data(v)
    return np.asarray(v)


def test_nnx_module_is_not_mutated():
    nnx = pytest.importorskip("flax.nnx")

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.dense = nnx.Linear(4, 8, rngs=rngs)
            self.norm = nnx.BatchNorm(8, rngs=rngs)
            self.drop = nnx.Dropout(0.5, rngs=rngs)
            self.out = nnx.Linear(8, 6, rngs=rngs)

        def __call__(self, x):
            h = jxs.diagnostics.cotangent_probe(
                self.drop(self.norm(self.dense(x))), "hidden"
            )
            return jxs.diagnostics.cotangent_probe(self.out(jnp.tanh(h)), "logits")

    model = Net(nnx.Rngs(0, dropout=1))
    before = jax.tree.map(_host, nnx.state(model))

    def nnx_loss(model, x):
        return jnp.mean(jnp.tanh(model(x)) * C[None, :])

    report = jxs.diagnostics.cotangent_report(nnx_loss, 2.0**10)(model, X)
    assert list(report) == ["hidden", "logits"]
    after = jax.tree.map(_host, nnx.state(model))
    jax.tree.map(np.testing.assert_array_equal, before, after)

    # Reference: the same computation on a copy, logits' cotangent by jax.grad.
    graphdef, state = nnx.split(model)
    logits = jax.jit(lambda state: nnx.merge(graphdef, state)(X))(state)
    ct = jax.grad(lambda z: jnp.mean(jnp.tanh(z) * C[None, :]) * 2.0**10)(logits)
    assert_matches(report["logits"], numpy_stats([ct], F16))
    # Keyword arguments work too.
    kw = jxs.diagnostics.cotangent_report(nnx_loss, 2.0**10)(model=model, x=X)
    assert float(kw["hidden"].size) == float(report["hidden"].size)


def test_linen_module():
    nn = pytest.importorskip("flax.linen")

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = jxs.diagnostics.cotangent_probe(jnp.tanh(nn.Dense(8)(x)), "hidden")
            return jxs.diagnostics.cotangent_probe(nn.Dense(6)(h), "logits")

    model = Net()
    params = model.init(jax.random.key(0), X)

    def linen_loss(params, x):
        return jnp.mean(jnp.tanh(model.apply(params, x)) * C[None, :])

    report = jxs.diagnostics.cotangent_report(linen_loss, 2.0**10)(params, X)
    logits = model.apply(params, X)
    ct = jax.grad(lambda z: jnp.mean(jnp.tanh(z) * C[None, :]) * 2.0**10)(logits)
    assert_matches(report["logits"], numpy_stats([ct], F16))


# --------------------------------------------------------------------------- #
# Table
# --------------------------------------------------------------------------- #


def test_table():
    report = jxs.diagnostics.cotangent_report(scan_loss, 2.0**8)(WS, XS)
    lines = jxs.diagnostics.cotangent_table(report).splitlines()
    assert lines[0].split() == [
        "site",
        "size",
        "calls",
        "zero%",
        "flush%",
        "subnorm%",
        "over%",
        "nonfin%",
        "max|g|",
        "headroom",
    ]
    assert [line.split()[0] for line in lines[1:]] == list(report)
    row = lines[1].split()
    s = report["layer[0]"]
    assert row[1] == f"{float(s.size):.0f}"
    assert row[4] == f"{100 * float(s.flush_fraction):.2f}"
    assert row[-1] == f"{float(s.headroom_log2):.2f}"
    with pytest.raises(TypeError, match=r"`report` must be the dict"):
        jxs.diagnostics.cotangent_table([1, 2])


# --------------------------------------------------------------------------- #
# Bad input
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"name": ""}, TypeError, r"`name` must be a non-empty string, got ''"),
        ({"name": 3}, TypeError, r"`name` must be a non-empty string, got 3"),
        ({"index": 0}, TypeError, r"`index` and `size` go together.*size=None"),
        ({"size": 2}, TypeError, r"`index` and `size` go together.*index=None"),
        ({"index": 0, "size": 0}, ValueError, r"`size` must be a positive.*got 0"),
        ({"index": 0, "size": 2.0}, ValueError, r"`size` must be a positive"),
        ({"index": 1.0, "size": 2}, TypeError, r"`index` must be an integer scalar"),
        (
            {"index": jnp.arange(2), "size": 2},
            TypeError,
            r"`index` must be an integer scalar",
        ),
        ({"index": 2, "size": 2}, ValueError, r"`index` must be in \[0, 2\), got 2"),
    ],
)
def test_probe_rejects(kwargs, error, match):
    kwargs = {"name": "site", **kwargs}
    with pytest.raises(error, match=match):
        jxs.diagnostics.cotangent_probe(jnp.ones(2), **kwargs)


def test_probe_needs_a_floating_leaf():
    def fun(x):
        jxs.diagnostics.cotangent_probe(jnp.int32(1), "ints")
        return jnp.sum(x)

    with pytest.raises(TypeError, match=r"`x` of `cotangent_probe\(x, 'ints'\)`"):
        jxs.diagnostics.cotangent_report(fun)(jnp.ones(2))


@pytest.mark.parametrize(
    "args, error, match",
    [
        ((loss_fn, 1.0, jnp.int32), TypeError, r"`dtype` must be a floating dtype"),
        ((loss_fn, "big"), ValueError, r"contains no jxs.LossScale.*got str"),
        ((loss_fn, jnp.ones(2)), TypeError, r"`loss_scale` must be a real scalar"),
        ((3,), TypeError, r"`fun` must be callable, got 3"),
    ],
)
def test_report_rejects_at_construction(args, error, match):
    with pytest.raises(error, match=match):
        jxs.diagnostics.cotangent_report(*args)


def test_report_rejects_bad_functions():
    with pytest.raises(ValueError, match=r"calls no `jxs.diagnostics.cotangent_probe`"):
        jxs.diagnostics.cotangent_report(lambda x: jnp.sum(x))(jnp.ones(2))
    with pytest.raises(TypeError, match=r"must return a floating scalar loss"):
        jxs.diagnostics.cotangent_report(
            lambda x: jxs.diagnostics.cotangent_probe(x, "x")
        )(jnp.ones(2))
    with pytest.raises(TypeError, match=r"as the first element of `\(loss, aux\)`"):
        jxs.diagnostics.cotangent_report(
            lambda x: (jxs.diagnostics.cotangent_probe(x, "x"), 0), has_aux=True
        )(jnp.ones(2))

    def sizes(x):
        x = jxs.diagnostics.cotangent_probe(x, "a", index=0, size=2)
        return jnp.sum(jxs.diagnostics.cotangent_probe(x, "a", index=0, size=3))

    with pytest.raises(ValueError, match=r"site 'a' is called with size=2 and"):
        jxs.diagnostics.cotangent_report(sizes)(jnp.ones(2))

    def collide(x):
        x = jxs.diagnostics.cotangent_probe(x, "a", index=0, size=2)
        return jnp.sum(jxs.diagnostics.cotangent_probe(x, "a[1]"))

    with pytest.raises(ValueError, match=r"names collide on \['a\[1\]'\]"):
        jxs.diagnostics.cotangent_report(collide)(jnp.ones(2))


def test_value_dependent_probes_are_loud():
    calls = []

    def counted(x):  # a different number of probes on each trace
        calls.append(1)
        for i in range(len(calls)):
            x = jxs.diagnostics.cotangent_probe(x, f"p{i}")
        return jnp.sum(x)

    with pytest.raises(RuntimeError, match=r"differently in the two traces"):
        jxs.diagnostics.cotangent_report(counted)(jnp.ones(2))


# --------------------------------------------------------------------------- #
# Guide
# --------------------------------------------------------------------------- #


def test_guide_section_runs():
    text = (DOCS / "diagnostics.md").read_text()
    section = text[text.index("## Where activation gradients underflow") :]
    section = section[: section.index("\n## ")]
    blocks = re.findall(r"^```python\n(.*?)^```", section, re.MULTILINE | re.DOTALL)
    assert blocks
    namespace: dict = {}
    with jax.numpy_rank_promotion("allow"):
        for block in blocks:
            exec(compile(block, "docs/diagnostics.md", "exec"), namespace)
