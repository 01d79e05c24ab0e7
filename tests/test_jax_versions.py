"""Autocast on every JAX from the declared floor to the newest: the constructs
whose parameters change between versions, and the adapter that reads them.

CI runs this file on three legs (README, "Two commands"): the floor (jax 0.7.1),
the default (Python 3.11: jax <= 0.10.2) and the ceiling (Python >= 3.12: the
newest jax). Each test says what it guards against: a construct that ran "as
traced" (nothing inside it in low precision) or crashed on one version.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import all_eqns
from jax import lax
from jax.extend import core as jcore
from jax.sharding import PartitionSpec as P

import jaxscale as jxs
from jaxscale import _jax_private as adapter
from jaxscale._autocast.rules import HIGHER_ORDER, UNLISTED, resolve_rules

pytestmark = pytest.mark.core

F16, F32 = jnp.dtype("float16"), jnp.dtype("float32")
X = jax.random.normal(jax.random.key(0), (4, 16))
W = jax.random.normal(jax.random.key(1), (16, 16)) / 4


def _dots(closed):
    return [e for e in all_eqns(closed) if e.primitive.name == "dot_general"]


def _low(fn, *args):
    """The dtypes of every dot of ``fn``'s jaxpr (sub-jaxprs included), traced
    with AutocastWarning as an error."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", jxs.AutocastWarning)
        jaxpr = jax.make_jaxpr(fn)(*args)
    dots = _dots(jaxpr)
    assert dots, "no dot_general at all"
    return {e.invars[0].aval.dtype.name for e in dots}


# --------------------------------------------------------------------------- #
# The constructs, forward and gradient
# --------------------------------------------------------------------------- #


def test_a_remat_scanned_flax_transformer_has_every_dot_in_float16():
    """MaxText's and levanter's shape: layers under ``nn.remat`` in ``nn.scan``,
    masked attention; the forward and the gradient."""
    nn = pytest.importorskip("flax.linen")

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, mask):
            h = nn.LayerNorm()(x)
            h = nn.MultiHeadDotProductAttention(num_heads=2)(h, h, mask=mask)
            x = x + h
            h = nn.Dense(32)(nn.LayerNorm()(x))
            return x + nn.Dense(16)(jax.nn.gelu(h)), None

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x, mask):
            layers = nn.scan(
                nn.remat(Block),
                variable_axes={"params": 0},
                split_rngs={"params": True},
                in_axes=nn.broadcast,
                length=3,
            )
            x, _ = layers()(x, mask)
            return nn.Dense(1)(x)

    x = jax.random.normal(jax.random.key(2), (2, 8, 16))
    mask = nn.make_causal_mask(jnp.ones((2, 8)))
    model = Model()
    params = model.init(jax.random.key(3), x, mask)

    def loss(params, x):
        return jnp.mean(model.apply(params, x, mask) ** 2)

    assert _low(jxs.autocast(loss), params, x) == {"float16"}
    grad = jax.grad(jxs.autocast(loss, gradient_dtype=jnp.float16))  # 16-bit dW
    assert _low(grad, params, x) == {"float16"}
    with jax.default_matmul_precision("highest"):
        ref = jax.grad(loss)(params, x)
        got = jax.jit(grad)(params, x)
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True):
        assert g.dtype == F32
        np.testing.assert_allclose(g, r, rtol=0.1, atol=2e-3)


def test_checkpointed_scan_under_grad_in_the_region():
    """``jax.grad`` inside the autocast region stages the checkpointed scan's
    forward as a call primitive (``closed_call``, ``eval_jaxpr`` from jax
    0.11.1): recognised by primitive object, so the loop runs in float16."""

    def loss(w, x):
        def body(c, _):
            return jnp.tanh(c @ w), None

        f = jax.checkpoint(lambda x: lax.scan(body, x, None, length=3)[0])
        return jnp.sum(f(x))

    region = jxs.autocast(jax.grad(loss))
    assert _low(region, W, X) == {"float16"}
    np.testing.assert_allclose(region(W, X), jax.grad(loss)(W, X), atol=5e-2)


def _closing_custom_rules():
    """A custom_vjp and a custom_jvp whose rules close over an array (jax
    0.11.1 puts such constants first among an open jaxpr's inputs)."""
    scale = jnp.linspace(0.5, 1.5, 16)[None]

    @jax.custom_vjp
    def mm(x, w):
        return (x @ w) * scale

    def fwd(x, w):
        return (x @ w) * scale, (x, w)

    def bwd(res, ct):
        x, w = res
        ct = ct * scale
        return ct @ w.T, x.T @ ct

    mm.defvjp(fwd, bwd)

    @jax.custom_jvp
    def act(x):
        return jnp.tanh(x) * scale

    @act.defjvp
    def act_jvp(primals, tangents):
        (x,), (t,) = primals, tangents
        y = jnp.tanh(x)
        return y * scale, (1 - y * y) * scale * t

    return lambda w, x: jnp.sum(act(mm(x, w)) @ w)


def test_user_custom_rules_closing_over_arrays_run_and_differentiate():
    loss = _closing_custom_rules()
    assert _low(jxs.autocast(loss), W, X) == {"float16"}
    # 16-bit weight gradients: every product of the gradient is then float16
    # (with float32 ones, `w`'s gradient products take float32 operands).
    low = jxs.autocast(loss, gradient_dtype=jnp.float16)
    assert _low(jax.grad(low, argnums=(0, 1)), W, X) == {"float16"}
    grad = jax.grad(jxs.autocast(loss), argnums=(0, 1))
    got, ref = jax.jit(grad)(W, X), jax.grad(loss, argnums=(0, 1))(W, X)
    for g, r in zip(got, ref, strict=True):
        assert g.dtype == F32
        np.testing.assert_allclose(g, r, rtol=5e-2, atol=5e-2)


def test_shard_map_bodies_autocast():
    """shard_map's manual axes are ``manual_axes`` before jax 0.10.2."""
    devices = np.array(jax.devices("cpu")[:2])
    mesh = jax.sharding.Mesh(devices, ("d",))

    def fn(x, w):
        body = lambda a, w: lax.psum(jnp.sum(jnp.tanh(a @ w)), "d")  # noqa: E731
        sm = jax.shard_map(body, mesh=mesh, in_specs=(P("d"), P()), out_specs=P())
        return sm(x, w)

    x = jax.device_put(X, jax.sharding.NamedSharding(mesh, P("d")))
    assert _low(jxs.autocast(fn), x, W) == {"float16"}
    narrow = jxs.autocast(fn, gradient_dtype=jnp.float16)  # 16-bit weight gradients
    assert _low(jax.grad(narrow, argnums=1), x, W) == {"float16"}
    np.testing.assert_allclose(jxs.autocast(fn)(x, W), fn(x, W), rtol=1e-2)


def test_while_and_cond_bodies_autocast():
    def fn(w, x):
        x = lax.while_loop(lambda c: c[0] < 2, lambda c: (c[0] + 1, c[1] @ w), (0, x))[
            1
        ]
        return lax.cond(jnp.sum(x) > 0, lambda a: a @ w, lambda a: -(a @ w), x)

    assert _low(jxs.autocast(fn), W, X) == {"float16"}


def test_cond_is_rebound_with_its_other_parameters():
    """Re-bound, not re-expressed through ``lax.switch``: a platform-dependent
    cond keeps ``branches_platforms`` (where this jax has it)."""

    def fn(w, x):
        y = x @ w
        return lax.platform_dependent(y, cpu=jnp.tanh, default=jnp.sin)

    (before,) = [
        e for e in all_eqns(jax.make_jaxpr(fn)(W, X)) if e.primitive.name == "cond"
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error", jxs.AutocastWarning)
        after_jaxpr = jax.make_jaxpr(jxs.autocast(fn))(W, X)
    (after,) = [e for e in all_eqns(after_jaxpr) if e.primitive.name == "cond"]
    assert set(after.params) == set(before.params)
    for key in set(before.params) - {"branches"}:
        assert after.params[key] == before.params[key], key
    np.testing.assert_allclose(jxs.autocast(fn)(W, X), fn(W, X), atol=2e-2)


# --------------------------------------------------------------------------- #
# The adapter's structural facts
# --------------------------------------------------------------------------- #


def _scan_eqn():
    c = jnp.arange(3.0)

    def f(init, xs, w):
        def body(carry, x):
            a, b = carry
            return (jnp.tanh(a @ w) + c[None], b + 1), x * a

        return lax.scan(body, init, xs)

    init = (jnp.ones((2, 3)), jnp.int32(0))
    jaxpr = jax.make_jaxpr(f)(init, jnp.ones((5, 2, 3)), jnp.ones((3, 3)))
    (eqn,) = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "scan"]
    return eqn


def test_scan_split_from_the_parameters_and_from_the_types_agree():
    eqn = _scan_eqn()
    parts = adapter.scan_parts(eqn)
    n_consts = len(eqn.invars) - 3  # the carry (2) and xs (1) follow the consts
    assert (parts.num_consts, parts.num_carry) == (n_consts, 2)
    assert (parts.length, parts.reverse) == (5, False)
    body = adapter.close(parts.body)
    assert adapter._scan_split_from_types(eqn, body, 5) == (n_consts, 2)


def test_construct_of_goes_by_primitive_object():
    from jax.extend.core import primitives

    assert adapter.construct_of(primitives.closed_call_p) == "call"
    assert adapter.construct_of(primitives.scan_p) == "scan"
    assert adapter.construct_of(primitives.add_p) is None
    assert adapter.construct_of(primitives.jit_p) == "jit"
    # A user's first-order primitive named like a construct is not one.
    assert adapter.construct_of(jcore.Primitive("scan")) is None
    assert primitives.closed_call_p.name in HIGHER_ORDER  # eval_jaxpr on 0.11.1+


def test_custom_vjp_parts_give_lists_on_every_version():
    w = jnp.arange(3.0)

    @jax.custom_vjp
    def g(x):
        return x * w

    g.defvjp(lambda x: (x * w, (x,)), lambda r, ct: (ct * w,))
    (eqn,) = [
        e
        for e in jax.make_jaxpr(g)(jnp.ones(3)).jaxpr.eqns
        if "vjp" in e.primitive.name
    ]
    parts = adapter.custom_vjp_parts(eqn)
    fwd = parts.forward(1)
    assert len(fwd.in_avals) == 1  # the closed-over array is attached, not an input
    outs = jcore.jaxpr_as_fun(fwd)(jnp.ones(3))
    np.testing.assert_array_equal(outs[-1], w)
    n_out, forwards = parts.residuals()
    assert n_out == 1 and len(forwards) == 1
    cts = parts.backward([jnp.ones(3), jnp.ones(3)])
    assert isinstance(cts, list) and len(cts) == 1
    np.testing.assert_array_equal(cts[0], w)


def test_shard_map_parts_name_the_manual_axes():
    devices = np.array(jax.devices("cpu")[:2])
    mesh = jax.sharding.Mesh(devices, ("d",))
    sm = jax.shard_map(lambda a: a * 2, mesh=mesh, in_specs=P("d"), out_specs=P("d"))
    x = jax.device_put(X, jax.sharding.NamedSharding(mesh, P("d")))
    (eqn,) = jax.make_jaxpr(sm)(x).jaxpr.eqns
    assert set(adapter.shard_map_parts(eqn).axes) == {"d"}


# --------------------------------------------------------------------------- #
# The rule table knows every first-order primitive of this jax
# --------------------------------------------------------------------------- #


def _jax_primitives():
    """Every primitive object JAX's modules define (jax.extend's list and the
    ``*_p`` attributes of jax's lax, random, nn and numpy implementation)."""
    import importlib
    import pkgutil
    import sys

    import jax._src as src

    for info in pkgutil.walk_packages(src.__path__, "jax._src."):
        name = info.name
        if any(
            part in name
            for part in ("pallas", "mosaic", "triton", "cudnn", "mlir", "tpu", "gpu")
        ):
            continue
        if name.startswith(("jax._src.lax", "jax._src.numpy", "jax._src.nn")) or (
            name in ("jax._src.random", "jax._src.prng", "jax._src.ad_util")
        ):
            try:
                importlib.import_module(name)
            except Exception:  # an optional backend module
                continue
    found = {}
    for name, module in list(sys.modules.items()):
        if (
            not name.startswith(("jax._src.lax", "jax._src.numpy", "jax._src.nn"))
            and (name not in ("jax._src.random", "jax._src.prng", "jax._src.ad_util"))
            and name != "jax.extend.core.primitives"
        ):
            continue
        for attr in dir(module):
            value = getattr(module, attr, None)
            if isinstance(value, jcore.Primitive):
                found[value.name] = value
    return found


def test_every_first_order_primitive_is_listed_or_classified():
    """A primitive a new jax adds (``polynomial`` in 0.12) is a red test here,
    not a silent default: put it in the table or in ``UNLISTED`` with why."""
    table = resolve_rules(None)
    unknown = sorted(
        name
        for name, prim in _jax_primitives().items()
        if name not in table
        and name not in UNLISTED
        and adapter.construct_of(prim) is None
    )
    assert not unknown, (
        f"jax {jax.__version__} has first-order primitives the autocast table "
        f"neither lists nor classifies: {unknown}"
    )


def test_polynomial_runs_in_float32():
    fn = lambda x: jnp.polyval(jnp.arange(1.0, 4.0), x @ W)  # noqa: E731
    out = jxs.autocast(fn)(X)
    assert out.dtype == F32
    if "polynomial" in str(jax.make_jaxpr(fn)(X)):
        polys = [
            e
            for e in all_eqns(jax.make_jaxpr(jxs.autocast(fn))(X))
            if e.primitive.name == "polynomial"
        ]
        assert all(v.aval.dtype == F32 for e in polys for v in e.invars)
