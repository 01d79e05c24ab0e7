"""The sensor's row sample (issue 49 item 8): each format measured on ``rows``
rows of a site, its sums scaled up to the batch's (``Sensor(rows=)``; ``None``:
every row). The estimate is close to the exact sums, the reference's own sums
(the noise) and the range checks read every row, and the option is checked."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxscale.precision as jxp

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
            # Every row in both, by two programs compiled apart: equal to
            # rounding (a sampled sum would be tens of percent off).
            got, want = sampled[site][f]["dw"], exact[site][f]["dw"]
            assert got == pytest.approx(want, rel=1e-5), (site, f)
            for k in ("overflow", "range", "grad_overflow", "flush"):
                assert sampled[site][f][k] == exact[site][f][k], (site, f, k)
        assert all(v == 0 for v in sampled[site][F.FLOAT32].values())


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
