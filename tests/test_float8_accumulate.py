"""Delayed float8 with gradient accumulation: ``jxs.float8.accumulate_value_and_grad``
(one history update per window, from the largest amaxes of its micro-batches),
the plain ``jxs.accumulate_value_and_grad`` refusing a delayed function with the
way that works, and ``jxs.float8.apply`` refusing to be differentiated."""

from __future__ import annotations

import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxscale as jxs

# Each test has its tier; all run on the floor and ceiling legs too.
pytestmark = pytest.mark.construct

FMAX = np.array([448.0, 448.0, 57344.0], np.float32)  # e4m3, e4m3, e5m2
K = 4  # micro-batches


def _normal(seed, shape, scale=1.0):
    x = np.random.default_rng(seed).standard_normal(shape) * scale
    return jnp.asarray(x, jnp.float32)


def mlp(params, x, y):
    """Plain jax: two dense layers, a mean squared error."""
    h = jnp.tanh(x @ params["w1"])
    return jnp.mean((h @ params["w2"] - y) ** 2)


def _setup(history_len=4):
    recipe = jxs.float8.DelayedScaling(history_len, min_dim=8)
    loss = jxs.autocast(mlp, jnp.bfloat16, float8=recipe)
    params = {"w1": _normal(0, (32, 32), 0.3), "w2": _normal(1, (32, 16), 0.3)}
    # Micro-batches of 8 rows whose amaxes differ: the largest input in the
    # second, the largest error in the third (neither the first nor the last).
    x = _normal(2, (K, 8, 32)) * jnp.array([1.0, 4.0, 2.0, 0.5])[:, None, None]
    y = _normal(3, (K, 8, 16)) * jnp.array([1.0, 1.0, 8.0, 2.0])[:, None, None]
    state = jxs.float8.init(loss, params, x[0], y[0])
    return loss, params, x.reshape(K * 8, 32), y.reshape(K * 8, 16), state


def _scale_of(history):
    """The scales of a history: its finite max over e4m3's / e5m2's range."""
    h = np.asarray(history)
    return np.where(np.isfinite(h), h, 0).max(axis=1) / FMAX


@pytest.mark.core
def test_one_history_update_per_window_from_the_max_of_the_micro_batches():
    loss, params, x, y, state = _setup()
    grad_fn = jax.jit(
        lambda p, s, x, y: jxs.float8.accumulate_value_and_grad(
            loss, s, num_microbatches=K
        )(p, x, y)
    )
    one = jax.jit(lambda p, s, x, y: jxs.float8.value_and_grad(loss, s)(p, x, y))
    for _ in range(2):  # two windows
        # The reference: each micro-batch alone, all with the window's state.
        parts = [
            one(params, state, x[i * 8 : (i + 1) * 8], y[i * 8 : (i + 1) * 8])
            for i in range(K)
        ]
        value, grads, new = grad_fn(params, state, x, y)
        assert value.dtype == jnp.float32
        np.testing.assert_allclose(value, np.mean([p[0] for p in parts]), rtol=1e-5)
        for name in params:
            want = np.mean([np.asarray(p[1][name]) for p in parts], axis=0)
            err = np.abs(np.asarray(grads[name]) - want).max() / np.abs(want).max()
            assert grads[name].dtype == jnp.float32 and err < 1e-5, (name, err)
        for site in range(2):
            newest = np.max([np.asarray(p[2].history[site][:, 0]) for p in parts], 0)
            hist = np.asarray(new.history[site])
            np.testing.assert_allclose(hist[:, 0], newest, rtol=1e-6)
            # Rolled by one entry for the whole window, not by K.
            np.testing.assert_array_equal(
                hist[:, 1:], np.asarray(state.history[site])[:, :-1]
            )
            np.testing.assert_allclose(new.scale[site], _scale_of(hist), rtol=1e-6)
        # The max, not the last micro-batch's, nor the mean: site 0's input
        # amax is the second micro-batch's.
        assert new.history[0][0, 0] == jnp.max(jnp.abs(x[8:16]))
        state = new
        params = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
    assert (np.asarray(state.history[0])[:, :2] > 0).all()
    assert (np.asarray(state.history[0])[:, 2:] == 0).all()
    assert grad_fn._cache_size() == 1


@pytest.mark.core
def test_linen_model_trains_with_accumulation_and_a_loss_scale_under_jit():
    nn = pytest.importorskip("flax.linen")

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(1)(jnp.tanh(nn.Dense(32)(jnp.tanh(nn.Dense(32)(x)))))

    model = MLP()
    x = _normal(0, (64, 32))
    y = jnp.sin(x[:, :1]) + 0.5 * x[:, 1:2]
    params = jax.jit(model.init)(jax.random.key(0), x)
    recipe = jxs.float8.DelayedScaling(4, min_dim=16)

    def loss(params, x, y):
        out = jxs.autocast(model.apply, jnp.bfloat16, float8=recipe)(params, x)
        return jnp.mean((out - y) ** 2), out

    state = jxs.float8.init(loss, params, x[:16], y[:16])
    assert len(state.sites) == 2  # the 1-wide head is below min_dim
    tx = jxs.dynamic_scaling(
        optax.sgd(0.05), loss_scale=jxs.StaticLossScale.create(8.0)
    )
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, state, x, y):
        grad_fn = jxs.float8.accumulate_value_and_grad(
            loss, state, opt_state, num_microbatches=4, has_aux=True
        )
        (value, out), grads, state = grad_fn(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, state, value, out

    losses = []
    for i in range(12):
        params, opt_state, state, value, out = step(params, opt_state, state, x, y)
        assert out.shape == (4, 16, 1)  # aux stacked over the micro-batches
        losses.append(float(value))
        filled = min(i + 1, 4)  # one entry per window
        for h in state.history:
            assert (np.asarray(h)[:, :filled] > 0).all()
            assert (np.asarray(h)[:, filled:] == 0).all()
    assert losses[-1] < 0.5 * losses[0], losses
    assert step._cache_size() == 1
    assert int(opt_state.skipped_steps) == 0
    # The gradient row holds the amax of the *scaled* gradient (8x).
    _, _, plain = jxs.float8.accumulate_value_and_grad(
        loss, state, num_microbatches=4, has_aux=True
    )(params, x, y)
    _, _, scaled = jxs.float8.accumulate_value_and_grad(
        loss, state, opt_state, num_microbatches=4, has_aux=True
    )(params, x, y)
    np.testing.assert_allclose(
        scaled.history[1][2, 0], 8 * plain.history[1][2, 0], rtol=2**-6
    )


@pytest.mark.unit
def test_plain_accumulation_of_a_delayed_function_names_the_float8_one():
    loss, params, x, y, _ = _setup()
    grad_fn = jxs.accumulate_value_and_grad(
        loss, jxs.NoOpLossScale(), num_microbatches=K
    )
    first = r"through `jxs\.float8\.accumulate_value_and_grad\(f, state, num_micro"
    with pytest.raises(ValueError, match=first):
        jax.eval_shape(grad_fn, params, x, y)
    # Outside accumulation the first suggestion stays value_and_grad.
    with pytest.raises(
        ValueError, match=r"through `jxs\.float8\.value_and_grad\(f, state\)"
    ):
        jax.eval_shape(jax.grad(loss), params, x, y)


@pytest.mark.core
def test_apply_refuses_to_be_differentiated_and_names_the_way_that_works():
    loss, params, x, y, state = _setup()
    applied = jxs.float8.apply(loss, state)
    assert np.isfinite(float(jax.jit(applied)(params, x, y)))  # evaluation runs
    grad_fn = jxs.accumulate_value_and_grad(
        applied, jxs.NoOpLossScale(), num_microbatches=K
    )
    with pytest.raises(
        ValueError,
        match=r"is for evaluation.*dropped silently\. Train through "
        r"`jxs\.float8\.accumulate_value_and_grad",
    ):
        jax.jit(grad_fn)(params, x, y)
    with pytest.raises(
        ValueError,
        match=r"dropped silently\. Train through `jxs\.float8\.value_and_grad",
    ):
        jax.jit(jax.grad(applied))(params, x, y)
    # The suggested way runs.
    jxs.float8.accumulate_value_and_grad(loss, state, num_microbatches=K)(params, x, y)


@pytest.mark.unit
def test_accumulate_value_and_grad_arguments_are_checked():
    loss, params, x, y, state = _setup()
    with pytest.raises(TypeError, match="`state` must be a `jxs.float8.Float8State`"):
        jxs.float8.accumulate_value_and_grad(loss, None)
    with pytest.raises(TypeError, match="`has_aux` must be a bool"):
        jxs.float8.accumulate_value_and_grad(loss, state, has_aux="yes")
    with pytest.raises(TypeError, match="needs the parameters as its first"):
        jxs.float8.accumulate_value_and_grad(loss, state)()
    with pytest.raises(ValueError, match="`num_microbatches` must divide"):
        jxs.float8.accumulate_value_and_grad(loss, state, num_microbatches=3)(
            params, x, y
        )
    # batch_argnums: the targets are shared by every micro-batch here.
    grad_fn = jxs.float8.accumulate_value_and_grad(
        loss, state, num_microbatches=K, batch_argnums=1
    )
    _, _, new = jax.eval_shape(grad_fn, params, x, y[:8])
    assert jax.tree.structure(new) == jax.tree.structure(state)


def _block(doc, heading, contains):
    text = (pathlib.Path(__file__).parent.parent / "docs" / doc).read_text()
    section = text.split(heading, 1)[1].split("\n## ", 1)[0]
    blocks = [
        b for b in re.findall(r"```python\n(.*?)```", section, re.S) if contains in b
    ]
    assert len(blocks) == 1, section
    return blocks[0]


@pytest.mark.core
def test_the_guides_accumulation_snippets_run_as_written():
    loss, params, x, y, fp8_state = _setup()
    tx = jxs.dynamic_scaling(optax.sgd(0.1))
    opt_state = tx.init(params)
    namespace = {
        "jax": jax,
        "jnp": jnp,
        "jxs": jxs,
        "optax": optax,
        "fp8_loss": loss,
        "tx": tx,
    }
    # docs/float8.md: a jitted train step.
    code = _block("float8.md", "## Gradient accumulation with delayed scaling", "def")
    exec(compile(code, "float8.md", "exec"), namespace)
    params2, opt_state2, state2, value = namespace["train_step"](
        params, opt_state, fp8_state, x, y
    )
    assert np.isfinite(float(value))
    assert (np.asarray(state2.history[0])[:, 0] > 0).all()
    # docs/accumulation.md: the call, with the loss scale.
    namespace.update(fp8_state=fp8_state, opt_state=opt_state, params=params, batch=x)
    namespace["fp8_loss"] = lambda params, batch: loss(params, batch, y[:8])
    code = _block("accumulation.md", "## In one step", "jxs.float8")
    exec(compile(code, "accumulation.md", "exec"), namespace)
    assert (np.asarray(namespace["fp8_state"].history[0])[:, 0] > 0).all()
    assert jax.tree.structure(namespace["grads"]) == jax.tree.structure(params)


# --------------------------------------------------------------------------- #
# Stateless recipes: a weight is quantised once per accumulation window.
# --------------------------------------------------------------------------- #


def _float8_casts(jaxpr, shape):
    """Casts to float8 of ``shape`` at the top of ``jaxpr`` and inside its
    ``scan`` bodies."""
    top = inner = 0
    for e in jaxpr.eqns:
        if e.primitive.name == "scan":
            sub = _float8_casts(e.params["jaxpr"].jaxpr, shape)
            inner += sub[0] + sub[1]
            continue
        out = e.outvars[0].aval if e.outvars else None
        if (
            e.primitive.name == "convert_element_type"
            and "float8" in str(out.dtype)
            and tuple(out.shape) == shape
        ):
            top += 1
    return top, inner


@pytest.mark.core
@pytest.mark.parametrize(
    "recipe",
    [jxs.float8.CurrentScaling(min_dim=8), jxs.float8.RowwiseScaling(min_dim=8)],
    ids=["current", "rowwise"],
)
def test_a_weight_is_quantised_once_per_window_outside_the_loop(recipe):
    loss = jxs.autocast(mlp, jnp.bfloat16, float8=recipe)
    params = {"w1": _normal(0, (32, 32), 0.3), "w2": _normal(1, (32, 16), 0.3)}
    x, y = _normal(2, (K * 8, 32)), _normal(3, (K * 8, 16))
    acc = jxs.accumulate_value_and_grad(loss, jxs.NoOpLossScale(), num_microbatches=K)
    jaxpr = jax.make_jaxpr(acc)(params, x, y).jaxpr
    # The casts of w1 and w2 are computed before the scan (XLA:GPU does not
    # hoist them out of the loop itself); none is left inside. (The abstract
    # evaluation that sizes the sums leaves an unused copy: XLA drops it.)
    for shape in ((32, 32), (32, 16)):
        top, inside = _float8_casts(jaxpr, shape)
        assert top >= 1 and inside == 0, (shape, top, inside)
    # The same numbers as each micro-batch on its own.
    value, grads = jax.jit(acc)(params, x, y)
    parts = [
        jax.jit(jax.value_and_grad(loss))(
            params, x[8 * i : 8 * i + 8], y[8 * i : 8 * i + 8]
        )
        for i in range(K)
    ]
    np.testing.assert_allclose(value, np.mean([float(v) for v, _ in parts]), rtol=1e-5)
    for name in params:
        want = np.mean([np.asarray(g[name]) for _, g in parts], axis=0)
        np.testing.assert_allclose(grads[name], want, rtol=1e-4, atol=1e-6)
