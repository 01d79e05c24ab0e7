"""The sensor's row sample (issue 49 item 8): each format measured on ``rows``
rows of a site, its sums scaled up to the batch's (``Sensor(rows=)``; ``None``:
every row). The estimate is close to the exact sums, the weight gradient's
included (rows alike, whose roundings add up coherently, too), the reference's
own sums (the noise) and the range checks read every row, attention's and
convolutions' products are measured on a sample of slices or examples, and the
option is checked. The weight gradient measured is the one the plan computes
(a parameter's in float32)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jaxscale as jxs
import jaxscale.precision as jxp
from jaxscale.precision._stats import subset

pytestmark = [pytest.mark.core]

F = jxp.Format


def normal(i, shape, scale=1.0):
    return scale * jax.random.normal(jax.random.key(i), shape, jnp.float32)


def mlp(p, x):
    h = jnp.tanh(x @ p["w1"])
    return jnp.mean((h @ p["w2"]) ** 2)


def params():
    return {"w1": normal(1, (32, 48), 0.2), "w2": normal(2, (48, 16), 0.2)}


def test_the_row_sample_estimates_the_exact_sums():
    # 1024 rows, 64 measured: the output's and the input gradient's squared
    # errors are sums over independent rows, scaled up; the weight gradient
    # (a sum over the rows) and the counts are measured on every row.
    p, x = params(), normal(3, (1024, 32))
    sampled = jxp.Sensor(mlp, jnp.bfloat16).update(p, x).stats()
    exact = jxp.Sensor(mlp, jnp.bfloat16, rows=None).update(p, x).stats()
    assert jxp.Sensor(mlp).rows == 64
    for site in exact:
        assert sampled[site]["reference"] == exact[site]["reference"]  # every row
        for f in (F.HALF, F.HALF_WIDE, F.FLOAT8_ROWWISE, F.FLOAT8):
            for k in ("fisher", "dx"):
                got, want = sampled[site][f][k], exact[site][f][k]
                assert want > 0 and got == pytest.approx(want, rel=0.5), (site, f, k)
            # A sum over the rows too, estimated from the sample's two parts.
            got, want = sampled[site][f]["dw"], exact[site][f]["dw"]
            assert want > 0 and got == pytest.approx(want, rel=0.5), (site, f)
            for k in ("overflow", "range", "grad_overflow", "flush"):
                assert sampled[site][f][k] == exact[site][f][k], (site, f, k)
        # float32 is the reference's product on the sample's rows: equal up to
        # the rounding of a GEMM of other shapes (XLA:CPU blocks it otherwise).
        for k, v in sampled[site][F.FLOAT32].items():
            assert abs(v) <= 1e-4 * abs(sampled[site][F.HALF][k]) + 1e-12, (site, k)


def test_a_row_outside_the_sample_still_fails_the_range():
    # float16: row 1 (not among the 64 of 256 measured: 0, 4, 8, ...) makes
    # outputs beyond 65504. The range is read on every row: 16 bits fail.
    p = params()
    x = normal(3, (256, 32)).at[1].mul(3e4)
    for rows in (64, None):
        sensor = jxp.Sensor(mlp, jnp.float16, rows=rows).update(p, x)
        first = sensor.measures()[0]
        assert math.isinf(first.errors[F.HALF]), rows
        assert "of outputs overflow float16" in first.notes[F.HALF], rows
        assert math.isfinite(first.errors[F.FLOAT32]), rows


def test_every_row_when_the_batch_has_fewer():
    p, x = params(), normal(3, (48, 32))
    a = jxp.Sensor(mlp, jnp.bfloat16, rows=64).update(p, x).stats()
    b = jxp.Sensor(mlp, jnp.bfloat16, rows=None).update(p, x).stats()
    assert a == b


def test_rows_is_checked():
    with pytest.raises(ValueError, match=r"`rows` must be >= 1 .* got 0"):
        jxp.Sensor(mlp, rows=0)
    for bad in (True, 8.0, "64"):
        with pytest.raises(TypeError, match=r"`rows` must be an int .* or None"):
            jxp.Sensor(mlp, rows=bad)
    assert jxp.Sensor(mlp, rows=np.int32(8)).rows == 8


def test_rows_alike_are_not_scaled_as_independent():
    # 1024 rows that are nearly one row: their roundings are nearly the same,
    # so the weight gradient's error grows as the rows squared, not as the
    # rows. Scaled as independent, the sample's would be ~16x low; the two
    # parts' shared error keeps the estimate near the exact sum.
    p = params()
    x = normal(5, (1, 32)) + normal(3, (1024, 32), 0.01)
    sampled = jxp.Sensor(mlp, jnp.bfloat16).update(p, x).stats()
    exact = jxp.Sensor(mlp, jnp.bfloat16, rows=None).update(p, x).stats()
    for site in exact:
        for f in (F.HALF, F.FLOAT8):
            got, want = sampled[site][f]["dw"], exact[site][f]["dw"]
            assert want > 0 and got == pytest.approx(want, rel=0.5), (site, f)


def test_the_sample_does_not_alias_with_a_sequence():
    # 8 sequences of 128 positions, 64 rows: one row in each stratum of 16,
    # at a place that moves, so position 0 (causal attention's largest
    # gradients) is not taken once per sequence as a stride of 16 would.
    picked = subset(1024, 64)
    assert len(set(picked.tolist())) == 64 and np.all(np.diff(picked) > 0)
    assert np.all(picked // 16 == np.arange(64))
    assert np.sum(picked % 128 == 0) <= 1
    assert len(set((picked % 16).tolist())) > 8
    assert subset(64, 64) is None and subset(10, None) is None


def test_the_weight_gradient_measured_is_the_plans():
    # A 16-bit site's parameter gradient leaves autocast's product in float32
    # (gradient_dtype): the sensor's ``dw`` (every row) is the squared error of
    # the gradient the plan's program computes, against float32's.
    w, x, c = normal(1, (32, 48), 0.2), normal(3, (256, 32)), normal(4, (256, 48))

    def f(w, x):  # the site's gradient is c (in 16 bits), whatever its output
        return jnp.sum((x @ w) * c)

    sensor = jxp.Sensor(f, jnp.bfloat16, rows=None).update(w, x)
    stats = sensor.stats()
    (site,) = stats
    plan = sensor.plan(cost="H100", budget="16-bit").replace(site, F.HALF)
    with jax.default_matmul_precision("highest"):  # a GPU's float32 is TF32-like
        ref = jax.jit(jax.grad(f))(w, x)
        half = jax.jit(jax.grad(jxs.autocast(f, jnp.bfloat16, plan=plan)))(w, x)
    want = float(jnp.sum((half.astype(jnp.float32) - ref) ** 2))
    assert want > 0
    assert stats[site][F.HALF]["dw"] == pytest.approx(want, rel=0.05)


def test_a_weight_that_is_no_parameter_keeps_its_16_bit_rounding():
    # x @ h with h computed (no parameter): the 16-bit product's gradient of h
    # is rounded to 16 bits; the sample adds that rounding from every row.
    def f(p, x):
        h = jnp.tanh(p["a"] * 3.0)
        return jnp.sum(jnp.sin(jnp.tanh(x @ p["w"]) @ h))

    p = {"w": normal(1, (32, 48), 0.2), "a": normal(2, (48, 16))}
    x = normal(3, (1024, 32))
    sampled = jxp.Sensor(f, jnp.bfloat16).update(p, x).stats()
    exact = jxp.Sensor(f, jnp.bfloat16, rows=None).update(p, x).stats()
    site = list(exact)[1]
    for fmt in (F.HALF, F.FLOAT8):
        got, want = sampled[site][fmt]["dw"], exact[site][fmt]["dw"]
        assert want > 0 and got == pytest.approx(want, rel=0.5), fmt


def attention(p, x):
    b, t, d = x.shape
    q, k, v = (jnp.tanh(x @ p[n]).reshape(b, t, 4, d // 4) for n in "qkv")
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d // 4)
    causal = jnp.tril(jnp.ones((t, t), bool))
    a = jax.nn.softmax(jnp.where(causal, s, -1e9), axis=-1)
    return jnp.mean(jnp.einsum("bhqk,bkhd->bqhd", a, v) ** 2)


def conv(p, x):
    dn = ("NHWC", "HWIO", "NHWC")
    h = jnp.tanh(
        lax.conv_general_dilated(x, p["k1"], (1, 1), "SAME", dimension_numbers=dn)
    )
    h = lax.conv_general_dilated(h, p["k2"], (1, 1), "SAME", dimension_numbers=dn)
    return jnp.mean(h**2)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_attention_slices_and_conv_examples_are_sampled(dtype):
    # 16 x 4 = 64 score slices of 32 rows: 8 measured; 64 examples of a
    # convolution: a sample of them. Every sum within a factor 2.5 of the
    # exact one (a few slices: a float16 score's error is concentrated, up to
    # 1.9x over here); the reference's sums read every element.
    ks = {n: normal(i, (32, 32), 0.3) for i, n in enumerate("qkv")}
    x = normal(7, (16, 32, 32))
    cp = {"k1": normal(8, (3, 3, 3, 8), 0.3), "k2": normal(9, (3, 3, 8, 8), 0.3)}
    cx = normal(10, (64, 8, 8, 3))
    for fn, p, batch, kind in ((attention, ks, x, "batched"), (conv, cp, cx, "conv")):
        sampled = jxp.Sensor(fn, dtype).update(p, batch)
        exact = jxp.Sensor(fn, dtype, rows=None).update(p, batch)
        a, e = sampled.stats(), exact.stats()
        sites = [m.site for m in exact.measures() if m.kind == kind]
        assert sites
        for site in sites:
            ref_a, ref_e = a[site]["reference"], e[site]["reference"]
            for k in ref_e:  # every element
                assert float(ref_a[k]) == pytest.approx(float(ref_e[k])), (site, k)
            for k in ("fisher", "dx", "dw"):
                got, want = a[site][F.HALF][k], e[site][F.HALF][k]
                assert want > 0 and 0.4 < got / want < 2.5, (site, k, got / want)
