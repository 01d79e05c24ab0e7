"""Convolutions are sites (issue 49, item 3): each ``conv_general_dilated``
is named by its module path, measured by the sensor in 16 bits and float32
(no float8 convolution), priced as its equivalent GEMM, and run by
``jxs.autocast(f, dtype, plan=plan)`` in its format."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxscale as jxs
import jaxscale.precision as jxp
from jaxscale._jax_private import subjaxprs

pytestmark = pytest.mark.integration

nn = pytest.importorskip("flax.linen")
eqx = pytest.importorskip("equinox")

F = jxp.Format
N, S, C = 4, 8, 3


class _CNN(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Conv(8, (3, 3), name="conv1")(x)
        x = nn.BatchNorm(use_running_average=False, name="bn")(x)
        x = nn.Conv(8, (3, 3), strides=2, name="conv2")(nn.relu(x))
        return nn.Dense(2, name="head")(x.reshape(x.shape[0], -1))


_CNN_MODEL = _CNN()
_X = jax.random.normal(jax.random.key(1), (N, S, S, C))
_CNN_VARS = _CNN_MODEL.init(jax.random.key(0), _X)


def cnn_loss(params, x):
    out, _ = _CNN_MODEL.apply(
        {"params": params, "batch_stats": _CNN_VARS["batch_stats"]},
        x,
        mutable=["batch_stats"],
    )
    return jnp.mean(out**2)


class _Eqx(eqx.Module):
    conv: eqx.nn.Conv2d
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.conv = eqx.nn.Conv2d(C, 4, 3, key=k1)
        self.head = eqx.nn.Linear(4 * (S - 2) ** 2, 1, key=k2)

    def __call__(self, x):
        return self.head(jax.nn.relu(self.conv(x)).reshape(-1))


_EQX_PARAMS, _EQX_STATIC = eqx.partition(_Eqx(jax.random.key(2)), eqx.is_array)
_XC = jnp.transpose(_X, (0, 3, 1, 2))  # channels first, as equinox takes it


def eqx_loss(params, x):
    return jnp.mean(jax.vmap(eqx.combine(params, _EQX_STATIC))(x) ** 2)


@pytest.fixture(scope="module")
def cnn_plan():
    with jax.numpy_rank_promotion("allow"):
        return jxs.plan_precision(cnn_loss, jnp.float16, cost="H100", budget="16-bit")(
            _CNN_VARS["params"], _X
        )


def test_flax_convs_are_sites_named_by_module_path(cnn_plan):
    kinds = {m.site: m.kind for m in cnn_plan.measures}
    assert kinds == {"_CNN/conv1": "conv", "_CNN/conv2": "conv", "_CNN/head": "dense"}
    conv1 = cnn_plan.measures[0]
    # The equivalent GEMM: batch x output pixels, in-channels x kernel, out-channels.
    assert conv1.shape == (N * S * S, C * 9, 8)
    assert cnn_plan.measures[1].shape == (N * 4 * 4, 8 * 9, 8)
    for m in cnn_plan.measures[:2]:
        assert set(m.errors) == {F.FLOAT32, F.HALF}
        assert m.errors[F.HALF] > 0 and m.errors[F.FLOAT32] < 1e-3 * m.errors[F.HALF]
        assert m.noise is not None and m.noise[F.HALF] > 0  # the batch in halves
        assert m.seconds(F.HALF, cnn_plan.cost) > 0


def _conv_dtypes(fn, *args):
    """The operand dtypes of each ``conv_general_dilated`` in ``fn``'s jaxpr,
    the forward's first (as traced)."""
    out = []

    def walk(jaxpr):
        for e in jaxpr.eqns:
            if e.primitive.name == "conv_general_dilated":
                out.append(tuple(str(v.aval.dtype) for v in e.invars))
            for _, _, sub in subjaxprs(e):
                walk(sub.jaxpr)

    with jax.numpy_rank_promotion("allow"):
        walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return out


def test_a_plan_runs_each_conv_in_its_format(cnn_plan):
    mixed = cnn_plan.replace("_CNN/conv1", F.FLOAT32).replace("_CNN/conv2", F.HALF)
    dtypes = _conv_dtypes(
        jxs.autocast(cnn_loss, jnp.float16, plan=mixed), _CNN_VARS["params"], _X
    )
    assert dtypes[:2] == [("float32", "float32"), ("float16", "float16")]
    step = jax.jit(jax.value_and_grad(jxs.autocast(cnn_loss, jnp.float16, plan=mixed)))
    with jax.numpy_dtype_promotion("strict"), jax.numpy_rank_promotion("allow"):
        value, grads = step(_CNN_VARS["params"], _X)
    assert np.isfinite(value)
    assert grads["conv1"]["kernel"].dtype == jnp.float32


def test_a_float8_conv_is_refused_naming_the_site(cnn_plan):
    with pytest.raises(
        ValueError,
        match=r"a conv site runs in \(Format.FLOAT32, Format.HALF\) at site "
        r"'_CNN/conv1', got Format.FLOAT8",
    ):
        cnn_plan.replace("_CNN/conv1", F.FLOAT8)
    rule = jxp.Plan.autocast_rule(cnn_plan)
    bad = type(rule)(
        tuple((s, F.FLOAT8 if s == "_CNN/conv2" else f) for s, f in rule.formats),
        kinds=rule.kinds,
    )
    with pytest.raises(
        ValueError,
        match=r"site '_CNN/conv2' is a conv site .* runs in Format.FLOAT32, "
        r"Format.HALF; the plan gives it Format.FLOAT8",
    ):
        jax.make_jaxpr(jxs.autocast(cnn_loss, jnp.float16, plan=bad))(
            _CNN_VARS["params"], _X
        )


def test_equinox_conv_is_a_measured_site():
    with jax.numpy_rank_promotion("allow"):
        plan = jxs.plan_precision(eqx_loss, jnp.float16, cost="H100", budget="16-bit")(
            _EQX_PARAMS, _XC
        )
    conv = plan.measures[0]
    # Equinox pushes no module path: the name stack jax gives the vmapped call.
    assert conv.kind == "conv" and conv.site == "vmap(eqx.nn.Conv)"
    assert conv.errors[F.HALF] > 0 and conv.errors[F.FLOAT32] < conv.errors[F.HALF]
    wide = plan.replace(conv.site, F.FLOAT32)
    dtypes = _conv_dtypes(
        jxs.autocast(eqx_loss, jnp.float16, plan=wide), _EQX_PARAMS, _XC
    )
    assert dtypes[0] == ("float32", "float32")
