"""jxs.diagnostics.autocast_report of a gradient (issue 40): the report of
``jax.grad(jxs.autocast(loss))`` enters the gradient's ``jit`` (``jax.jit``,
flax's ``nn.jit``, equinox's ``filter_jit``) and custom derivatives as the
forward report does, and counts a widened weight-gradient product as the
``dot_general`` it is, in 16 bits.

Before, each such construct counted as one operation and the matmuls inside it
not at all (a ``nn.jit`` model's gradient: no ``dot_general``)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jaxscale.precision as jxp
from jaxscale._autocast.entry import autocast
from jaxscale.diagnostics import autocast_report

pytestmark = [pytest.mark.core]

# Constructs the report enters: never an operation of its own.
ENTERED = {"jit", "pjit", "custom_jvp_call", "custom_vjp_call", "cond"}
W, X = jnp.ones((16, 32)), jnp.ones((8, 16))


def dots(report):
    return dict(report.by_primitive.get("dot_general", {}))


def entered(report):
    return ENTERED & set(report.by_primitive)


@pytest.mark.parametrize("inner_jit", [False, True])
def test_the_issue_repro_counts_forward_and_backward_products(inner_jit):
    def f(w, x):
        layer = lambda w, x: jnp.tanh(x @ w)  # noqa: E731
        return jnp.sum((jax.jit(layer) if inner_jit else layer)(w, x))

    assert dots(autocast_report(f)(W, X)) == {"float16": 1}
    report = autocast_report(jax.grad(autocast(f)))(W, X)
    assert dots(report) == {"float16": 1 + 1}  # the product, the weight gradient
    assert not entered(report)
    both = autocast_report(jax.grad(autocast(f), argnums=(0, 1)))(W, X)
    assert dots(both) == {"float16": 1 + 2}  # and the input's gradient


def _mlp(nn, jitted):
    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            for width in (32, 32, 16):
                x = jax.nn.relu(nn.Dense(width)(x))
            return nn.Dense(8)(x)

    class MethodJit(nn.Module):  # as gemma's Transformer.__call__
        @functools.partial(nn.jit, static_argnames=("train",))
        @nn.compact
        def __call__(self, x, train=False):
            return MLP()(x)

    return {"none": MLP, "module": nn.jit(MLP), "method": MethodJit}[jitted]()


@pytest.mark.parametrize("jitted", ["none", "module", "method"])
def test_flax_nn_jit_gradient_counts_every_product(jitted):
    nn = pytest.importorskip("flax.linen")
    model = _mlp(nn, jitted)
    x = jnp.ones((4, 16))
    params = jax.eval_shape(model.init, jax.random.key(0), x)  # shapes will do

    def loss(params, x):
        return jnp.mean(model.apply(params, x) ** 2)

    layers = 4
    forward = autocast_report(loss)(params, x)
    assert dots(forward) == {"float16": layers}
    report = autocast_report(jax.grad(autocast(loss)))(params, x)
    # Per Dense: its product, its kernel's gradient, and its input's gradient
    # (but the first layer's: x is not differentiated).
    assert dots(report) == {"float16": 3 * layers - 1}
    assert not entered(report)
    assert report.operations > forward.operations


def test_equinox_filter_jit_gradient_counts_every_product():
    eqx = pytest.importorskip("equinox")
    mlp = eqx.nn.MLP(16, 8, 32, depth=3, key=jax.random.key(0))  # 4 Linear

    @eqx.filter_jit
    def apply(model, x):
        return jax.vmap(model)(x)

    def loss(model, x):
        return jnp.mean(apply(model, x) ** 2)

    x = jnp.ones((4, 16))
    assert dots(autocast_report(loss)(mlp, x)) == {"float16": 4}
    report = autocast_report(eqx.filter_grad(autocast(loss)))(mlp, x)
    assert dots(report) == {"float16": 3 * 4 - 1}
    assert not entered(report)


def test_custom_vjp_forward_and_backward_products_are_counted():
    @jax.custom_vjp
    def layer(w, x):
        return jnp.tanh(x @ w)

    def fwd(w, x):
        y = jnp.tanh(x @ w)
        return y, (w, x, y)

    def bwd(res, g):
        w, x, y = res
        d = g * (1 - y * y)
        return x.T @ d, d @ w.T

    layer.defvjp(fwd, bwd)

    def loss(w, m, x):
        h = layer(m, x)  # not differentiated: a custom_vjp_call in the gradient
        return jnp.sum(layer(w, h))

    args = jnp.ones((32, 8)), jnp.ones((16, 32)), jnp.ones((4, 16))
    assert dots(autocast_report(loss)(*args)) == {"float16": 2}
    grad = jax.grad(autocast(loss))
    assert "custom_vjp_call" in {
        e.primitive.name for e in jax.make_jaxpr(grad)(*args).eqns
    }
    report = autocast_report(grad)(*args)
    assert dots(report) == {"float16": 2 + 2}  # both forward, bwd's two
    assert not entered(report)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_widened_products_count_as_16_bit_dot_generals(dtype):
    """``gradient_dtype=None`` (the default) wraps each product of a float32
    input in a custom_jvp, and its weight-gradient product is a
    ``lax.platform_dependent`` cond (the 16-bit dot algorithm on CUDA): the
    report counts each as one dot_general in ``dtype``, as the products of
    ``gradient_dtype=dtype``."""
    name = np.dtype(dtype).name
    f = lambda w, x: jnp.sum(jnp.tanh(x @ w))  # noqa: E731
    grads = {
        gd: jax.grad(autocast(f, dtype, gradient_dtype=gd), argnums=(0, 1))
        for gd in (None, dtype)
    }
    assert any(
        e.primitive.name in ("custom_jvp_call", "cond")
        for e in jax.make_jaxpr(grads[None])(W, X).eqns
    )
    wide = autocast_report(grads[None], dtype)(W, X)
    narrow = autocast_report(grads[dtype], dtype)(W, X)
    assert dots(wide) == dots(narrow) == {name: 3}
    assert not entered(wide)


def test_a_matrix_vector_weight_gradient_counts_in_float32():
    """A width-1 layer's widened weight gradient has no dot algorithm (XLA:GPU
    rejects one there): its float32 cotangent meets the 16-bit activation and
    the product runs in float32."""
    f = lambda w, x: jnp.sum(jnp.tanh(x @ w))  # noqa: E731
    report = autocast_report(jax.grad(autocast(f)))(jnp.ones((16, 1)), X)
    assert dots(report) == {"float16": 1, "float32": 1}


def test_a_platform_dependent_computation_counts_once():
    """The branches of ``lax.platform_dependent`` are alternatives (lowering
    keeps one): the report counts the first."""

    def f(w, x):
        return lax.platform_dependent(
            x,
            w,
            cpu=lambda x, w: jnp.tanh(x @ w),
            default=lambda x, w: jnp.sin(x @ w),
        )

    report = autocast_report(f)(W, X)
    assert dots(report) == {"float16": 1}
    assert "tanh" in report.by_primitive and "sin" not in report.by_primitive


# --------------------------------------------------------------------------- #
# What a planned or narrow step runs: ``plan=`` and ``gradient_dtype=``
# --------------------------------------------------------------------------- #

F = jxp.Format
SITES = ("(top level)", "(top level)#1")


def two_layers(w, x):
    return jnp.sum(jnp.tanh(jnp.tanh(x @ w) @ w.T))


def _plan(first):
    """A plan for ``two_layers``: its first site in ``first``, the other in 16 bits."""
    shape = (4096, 4096, 4096)  # large: 16 bits is the faster format
    measures = [
        jxp.SiteMeasure(
            s, shape, (4, 4), {F.FLOAT32: 0.0, F.HALF_WIDE: 0.4, F.HALF: 0.5}
        )
        for s in SITES
    ]
    plan = jxp.solve(measures, cost="H100", budget=1.0)
    assert list(plan.formats().values()) == [F.HALF, F.HALF]
    # Both chosen (pinned): the plan runs them so at these small shapes too,
    # where a re-solve would choose float32 (jxs.autocast re-solves the rest).
    return plan.replace(SITES[0], first).replace(SITES[1], F.HALF)


def test_the_report_runs_a_plan_as_autocast_does():
    plan = _plan(F.FLOAT32)
    report = autocast_report(two_layers, plan=plan)(W, X)
    assert dots(report) == {"float16": 1, "float32": 1}
    grad = jax.grad(autocast(two_layers, plan=plan))
    assert dots(autocast_report(grad)(W, X)) == {"float16": 3, "float32": 2}
    wide = autocast_report(two_layers, jnp.bfloat16, plan=_plan(F.HALF_WIDE))(W, X)
    assert dots(wide) == {"bfloat16": 2}  # the widened product is 16-bit too
    with pytest.raises(ValueError, match="`plan` and `float8`"):
        autocast_report(two_layers, plan=plan, float8=True)
    with pytest.raises(TypeError, match="`plan` must be"):
        autocast_report(two_layers, plan={"(top level)": F.HALF})


def test_the_report_takes_gradient_dtype_as_autocast_does():
    for gd in (None, jnp.float32, jnp.float16, lambda path: None):
        report = autocast_report(two_layers, gradient_dtype=gd)(W, X)
        assert dots(report) == {"float16": 2}
    with pytest.raises(ValueError, match="`gradient_dtype` must be"):
        autocast_report(two_layers, gradient_dtype=jnp.bfloat16)
