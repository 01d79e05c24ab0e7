"""benchmarks/precision_overflow.py's model (issue 41): one matmul site whose
outputs overflow float16 among ordinary ones. The sensor flags that site, the
plan keeps it out of float16 and the others in it, and the plan's loss and
gradient are finite where plain float16 autocast overflows."""

import importlib.util
import math
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxscale as jxs
import jaxscale.precision

pytestmark = pytest.mark.integration

F = jxs.precision.Format
_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "precision_overflow.py"
_SPEC = importlib.util.spec_from_file_location("precision_overflow", _PATH)
bench = sys.modules.setdefault(
    "precision_overflow", importlib.util.module_from_spec(_SPEC)
)
_SPEC.loader.exec_module(bench)


@pytest.fixture(scope="module")
def problem():
    size = dict(bench.SIZES["quick"], steps=2, loss_scale=bench.LOSS_SCALE)
    task = bench.make_task(0, size["features"])
    xs, ys = bench.batches(0, task, size)
    params = bench.init_params(
        jax.random.key(0), size["features"], size["width"], size["depth"]
    )
    sensor = jxs.precision.Sensor(
        bench.loss_fn, jnp.float16, loss_scale=size["loss_scale"]
    )
    for x, y in zip(xs, ys, strict=True):
        sensor.update(params, x, y)
    return params, (xs[0], ys[0]), sensor


def test_sensor_flags_the_overflowing_site(problem):
    params, (x, _), sensor = problem
    # The premise: embed's outputs leave float16's range, its operands do not.
    assert float(jnp.max(jnp.abs(x))) < 65504
    assert bench.embed_max(params, x) > 65504
    measures = {m.site: m for m in sensor.measures()}
    assert list(measures) == [
        "embed",
        "block_0/up",
        "block_0/down",
        "block_1/up",
        "block_1/down",
        "head",
    ]
    embed = measures.pop("embed")
    assert embed.errors[F.HALF] == math.inf
    assert "outputs overflow float16" in embed.notes[F.HALF]
    assert math.isfinite(embed.errors[F.HALF_WIDE])  # float32 out: in range
    for m in measures.values():
        assert math.isfinite(m.errors[F.HALF]), (m.site, m.notes)
        assert F.HALF not in m.notes


def test_plan_keeps_the_site_out_of_float16(problem):
    _, _, sensor = problem
    formats = sensor.plan(budget="16-bit", cost="H100").formats()
    assert formats["embed"] in (F.HALF_WIDE, F.FLOAT32)
    assert any(f is F.HALF for s, f in formats.items() if s != "embed"), formats


def test_plan_is_finite_where_float16_overflows(problem):
    params, (x, y), sensor = problem
    plan = sensor.plan(budget="16-bit", cost="H100")
    scale = bench.LOSS_SCALE

    def value_and_grad(loss):
        def scaled(p):
            return loss(p, x, y) * scale

        return jax.jit(jax.value_and_grad(scaled))(params)

    half, half_grads = value_and_grad(jxs.autocast(bench.loss_fn, jnp.float16))
    assert not np.isfinite(float(half))
    value, grads = value_and_grad(jxs.autocast(bench.loss_fn, jnp.float16, plan=plan))
    ref, ref_grads = value_and_grad(bench.highest(bench.loss_fn))
    assert np.isfinite(float(value))
    np.testing.assert_allclose(float(value), float(ref), rtol=1e-2)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        assert np.all(np.isfinite(np.asarray(g, np.float32)))
        err = np.linalg.norm(np.asarray(g, np.float64) - np.asarray(r, np.float64))
        assert err <= 0.05 * np.linalg.norm(np.asarray(r, np.float64))
