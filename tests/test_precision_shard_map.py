"""Products in ``shard_map`` bodies are sites (issue 49 item 3): the sensor
measures them (its probes enter the body replicated; each device's sums are
added over the devices by the transpose), a plan runs them in its formats, and
the monitor reads them, on 8 CPU devices, with and without ``check_vma``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import all_eqns
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jaxscale as jxs
import jaxscale.precision as jxp

pytestmark = [pytest.mark.core, pytest.mark.construct]

F = jxp.Format
TOP = "(top level)"
shard_map = getattr(jax, "shard_map", None)
needs_shard_map = pytest.mark.skipif(shard_map is None, reason="jax.shard_map")


def mesh():
    return Mesh(np.array(jax.devices("cpu")[:8]), ("d",))


def mlp(p, x):
    h = jnp.tanh(x @ p["w1"])
    return jnp.mean((h @ p["w2"]) ** 2)


def data_parallel(check_vma=True):
    """``mlp`` on each device's rows, the loss averaged over the devices."""

    def body(p, x):
        return jax.lax.pmean(mlp(p, x), "d")

    def loss(p, x):
        return shard_map(
            body,
            mesh=mesh(),
            in_specs=(P(), P("d")),
            out_specs=P(),
            check_vma=check_vma,
        )(p, x)

    return loss


def params():
    k1, k2 = jax.random.split(jax.random.key(0))
    return {
        "w1": 0.2 * jax.random.normal(k1, (32, 48)),
        "w2": 0.2 * jax.random.normal(k2, (48, 16)),
    }


def batch(scale=1.0):
    return scale * jax.random.normal(jax.random.key(3), (256, 32))


def plan_of(formats):
    """A plan for ``mlp`` (its sites measured without a ``shard_map``) with
    ``formats`` set by hand."""
    plan = jxs.plan_precision(mlp, jnp.float16, cost="H100", budget="16-bit")(
        params(), batch()
    )
    for site, fmt in formats.items():
        plan = plan.replace(site, fmt)
    return plan


@pytest.fixture(scope="module")
def whole():
    """The sensor's sums for ``mlp`` without a ``shard_map``."""
    with jax.numpy_dtype_promotion("strict"):
        return jxp.Sensor(mlp, jnp.float16, rows=None).update(params(), batch()).stats()


@needs_shard_map
@pytest.mark.parametrize("check_vma", [True, False])
def test_the_sensor_measures_sites_in_a_shard_map_body(whole, check_vma):
    with jax.numpy_dtype_promotion("strict"):
        sensor = jxp.Sensor(data_parallel(check_vma), jnp.float16, rows=None)
        stats = sensor.update(params(), batch()).stats()
    assert list(stats) == [TOP, f"{TOP}#1"] == list(whole)
    for site in stats:
        for f in (F.HALF, F.FLOAT8):
            # Sums over the rows, split over 8 devices and added back.
            for k in ("fisher", "dx"):
                got, want = stats[site][f][k], whole[site][f][k]
                assert got == pytest.approx(want, rel=1e-3), (site, f, k)
            # Each device's weight gradient is its rows' partial product,
            # rounded on its own: an error of the same order, not the same.
            assert 0 < stats[site][f]["dw"] < 10 * whole[site][f]["dw"], (site, f)
        assert all(v == 0 for v in stats[site][F.FLOAT32].values()), site
        noise, want = (s[site]["reference"]["noise"] for s in (stats, whole))
        assert noise == pytest.approx(want, rel=0.3), site


@needs_shard_map
def test_a_plan_runs_each_site_in_the_body_in_its_format():
    p, x = params(), batch()
    loss = data_parallel()
    plan = plan_of({TOP: F.FLOAT32, f"{TOP}#1": F.HALF})
    run = jxs.autocast(loss, jnp.float16, plan=plan)
    with jax.numpy_dtype_promotion("strict"):
        traced = jax.make_jaxpr(run)(p, x)
        grads = jax.jit(jax.grad(run))(p, x)
        want = jax.grad(loss)(p, x)
    # In the body: the first site's product on float32 operands (each device's
    # 32 rows), the second's on float16.
    dots = [
        tuple(str(v.aval.dtype) for v in e.invars)
        for e in all_eqns(traced.jaxpr)
        if e.primitive.name == "dot_general"
    ]
    assert dots == [("float32", "float32"), ("float16", "float16")], dots
    for k in grads:
        assert grads[k].dtype == jnp.float32
        top = float(jnp.max(jnp.abs(want[k])))  # float16's rounding, at scale
        np.testing.assert_allclose(grads[k], want[k], rtol=2e-2, atol=2e-3 * top)


@needs_shard_map
def test_a_plan_made_without_the_shard_map_runs_the_sharded_function():
    """The sites keep their names through the ``shard_map``: a plan made on the
    function written for one device runs the data-parallel one."""
    p, x = params(), batch()
    plan = plan_of({})
    with jax.numpy_dtype_promotion("strict"):
        got = jax.jit(jxs.autocast(data_parallel(), jnp.float16, plan=plan))(p, x)
        want = jax.jit(jxs.autocast(mlp, jnp.float16, plan=plan))(p, x)
    np.testing.assert_allclose(got, want, rtol=1e-3)


@needs_shard_map
def test_the_monitor_reads_sites_in_a_shard_map_body():
    p = params()
    loss = data_parallel()
    plan = plan_of({TOP: F.HALF, f"{TOP}#1": F.HALF})
    mon = jxp.Monitor(plan, jnp.float16)

    @jax.jit
    def step(p, state, x):
        (value, grads), seen = mon.value_and_grad(loss)(p, x)
        return value, grads, mon.update(state, seen), seen

    with jax.numpy_dtype_promotion("strict"):
        state = mon.init()
        _, _, state, seen = step(p, state, batch())
        _, _, state, _ = step(p, state, batch(2e4))  # beyond 65504 / 4
    assert seen.shape[0] == 2
    assert int(state.steps) == 2
    assert state.troubled.tolist()[0] >= 1  # the first site's operands
