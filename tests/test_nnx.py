"""Flax NNX models with state beyond parameters (BatchNorm, Dropout) through the
scaled gradient, accumulation and the forward-overflow guard."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxscale as jxs

nnx = pytest.importorskip("flax.nnx")
jxf = pytest.importorskip("jaxscale.flax")

SCALE = 2.0**10


@pytest.fixture(autouse=True)
def _flax_needs_standard_promotion():
    """Flax's BatchNorm promotes float16 to float32 itself."""
    with jax.numpy_dtype_promotion("standard"):
        yield


class Net(nnx.Module):
    def __init__(self, rngs, dropout=0.5):
        kw = dict(dtype=jnp.float16, param_dtype=jnp.float32)
        self.l1 = nnx.Linear(8, 16, rngs=rngs, **kw)
        self.bn = nnx.BatchNorm(16, rngs=rngs, **kw)
        self.drop = nnx.Dropout(dropout, rngs=rngs)
        self.l2 = nnx.Linear(16, 1, rngs=rngs, **kw)

    def __call__(self, x):
        h = self.drop(jax.nn.relu(self.bn(self.l1(x.astype(jnp.float16)))))
        return self.l2(h).astype(jnp.float32)


def loss_fn(model, x, y):
    return jnp.mean((model(x) - y) ** 2)


def data(seed=0, n=32):
    x = jax.random.normal(jax.random.key(seed), (n, 8))
    return x, jnp.sum(x, axis=1, keepdims=True)


def make(dropout=0.5):
    model = Net(nnx.Rngs(0, dropout=1), dropout)
    ls = jxs.StaticLossScale.create(SCALE)
    return model, nnx.Optimizer(
        model, jxs.dynamic_scaling(optax.sgd(0.0), ls), wrt=nnx.Param
    )


def test_short_form_updates_batch_stats_and_dropout_like_nnx_value_and_grad():
    """0.1.0: BatchNorm statistics never updated (eval loss 129.75 vs 1.70) and
    Dropout crashed with JAX's uint32 message."""
    x, y = data()
    ours_model, ours_opt = make()
    ref_model, _ = make()

    @nnx.jit
    def ours(model, optimizer):
        return jxs.value_and_grad(loss_fn, optimizer)(model, x, y)

    @nnx.jit
    def ref(model):
        return nnx.value_and_grad(loss_fn)(model, x, y)

    for _ in range(3):
        loss, grads = ours(ours_model, ours_opt)
        ref_loss, ref_grads = ref(ref_model)
        assert float(loss) == float(ref_loss)
        scaled = jax.tree.map(lambda g: g * SCALE, ref_grads)
        chex_close = jax.tree.map(
            lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-2, atol=1e-3),
            grads,
            scaled,
        )
        del chex_close
    np.testing.assert_array_equal(ours_model.bn.mean[...], ref_model.bn.mean[...])
    np.testing.assert_array_equal(ours_model.bn.var[...], ref_model.bn.var[...])
    assert float(jnp.abs(ours_model.bn.mean[...]).sum()) > 0
    assert (
        int(ours_model.drop.rngs.count[...]) == int(ref_model.drop.rngs.count[...]) == 3
    )
    # Only parameters are differentiated.
    assert {
        type(v)
        for v in jax.tree.leaves(grads, is_leaf=lambda v: isinstance(v, nnx.Variable))
    } <= {nnx.Param}


def test_dropout_masks_differ_between_steps():
    x, y = data()
    model, optimizer = make()
    step = nnx.jit(lambda m, o: jxs.value_and_grad(loss_fn, o)(m, x, y)[0])
    losses = {float(step(model, optimizer)) for _ in range(3)}
    assert len(losses) == 3  # lr 0: only the dropout mask changes


def test_accumulation_carries_batch_stats_and_rng_counts_through_micro_batches():
    k = 4
    x, y = data(n=32)
    model, optimizer = make(dropout=0.0)
    ref_model, _ = make(dropout=0.0)

    @nnx.jit
    def ours(model, optimizer):
        fn = jxs.accumulate_value_and_grad(loss_fn, optimizer, num_microbatches=k)
        return fn(model, x, y)

    @nnx.jit
    def ref(model):  # the micro-batches one after the other
        losses, total = [], None
        for i in range(k):
            sl = slice(i * 8, (i + 1) * 8)
            loss, g = nnx.value_and_grad(loss_fn)(model, x[sl], y[sl])
            losses.append(loss)
            total = g if total is None else jax.tree.map(jnp.add, total, g)
        return jnp.mean(jnp.stack(losses)), jax.tree.map(lambda t: t / k, total)

    loss, grads = ours(model, optimizer)
    ref_loss, ref_grads = ref(ref_model)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b * SCALE, rtol=2e-2, atol=1e-3),
        grads,
        ref_grads,
    )
    np.testing.assert_allclose(model.bn.mean[...], ref_model.bn.mean[...], rtol=1e-5)
    np.testing.assert_allclose(model.bn.var[...], ref_model.bn.var[...], rtol=1e-5)


def test_accumulation_with_dropout_advances_the_rng_per_micro_batch():
    x, y = data(n=32)
    model, optimizer = make()
    step = nnx.jit(
        lambda m, o: jxs.accumulate_value_and_grad(loss_fn, o, num_microbatches=4)(
            m, x, y
        )[0]
    )
    losses = [float(step(model, optimizer)) for _ in range(2)]
    assert losses[0] != losses[1]
    assert int(model.drop.rngs.count[...]) == 8


def test_mixing_modules_and_arrays_in_argnums_is_refused():
    model, optimizer = make()

    def two(model, w):
        return loss_fn(model, *data()) * jnp.sum(w)

    with pytest.raises(TypeError, match="mixes Flax NNX modules"):
        jxs.value_and_grad(two, optimizer, argnums=(0, 1))(model, jnp.ones(2))


def test_keep_on_skip_restores_batch_stats_after_an_overflowing_forward():
    x, y = data()
    model, optimizer = make(dropout=0.0)

    @nnx.jit
    def step(model, optimizer, x):
        with jxf.keep_on_skip(model, optimizer, nnx.BatchStat):
            loss, grads = jxs.value_and_grad(loss_fn, optimizer)(model, x, y)
            optimizer.update(model, grads)
        return loss

    step(model, optimizer, x)
    good_mean = np.asarray(model.bn.mean[...])
    step(model, optimizer, x.at[0, 0].set(1e6))  # inf in float16: skipped
    assert jxs.summary(optimizer)["skipped_steps"] == 1
    np.testing.assert_array_equal(model.bn.mean[...], good_mean)
    assert bool(jxs.all_finite(nnx.state(model, nnx.BatchStat)))
    step(model, optimizer, x)  # applied again: the statistics move on
    assert not np.array_equal(np.asarray(model.bn.mean[...]), good_mean)


def test_linen_train_state_keeps_batch_stats_on_a_skipped_step():
    """One overflowing forward pass used to leave ``batch_stats`` NaN for ever
    (0.1.0 and torch; eval accuracy 0.25 instead of 0.62 in the trial)."""
    import flax.linen as nn

    class M(nn.Module):
        @nn.compact
        def __call__(self, x, train):
            x = nn.Dense(4, dtype=jnp.float16)(x.astype(jnp.float16))
            x = nn.BatchNorm(use_running_average=not train, dtype=jnp.float16)(x)
            return jnp.sum(x.astype(jnp.float32))

    class State(jxf.TrainState):
        batch_stats: dict

    m = M()
    x, _ = data()
    variables = m.init(jax.random.key(0), x, True)
    state = State.create(
        apply_fn=m.apply,
        params=variables["params"],
        tx=jxs.dynamic_scaling(optax.sgd(0.1), jxs.StaticLossScale.create(8.0)),
        batch_stats=variables["batch_stats"],
    )

    @jax.jit
    def step(state, x):
        def f(params):
            out, upd = state.apply_fn(
                {"params": params, "batch_stats": state.batch_stats},
                x,
                True,
                mutable=["batch_stats"],
            )
            return out, upd

        (_, upd), grads = jxs.value_and_grad(f, state, has_aux=True)(state.params)
        return state.apply_gradients(grads=grads, batch_stats=upd["batch_stats"])

    state = step(state, x)
    assert int(state.opt_state.skipped_steps) == 0
    good = jax.tree.map(np.asarray, state.batch_stats)
    state = step(state, x.at[0, 0].set(1e6))
    assert int(state.opt_state.skipped_steps) == 1
    jax.tree.map(np.testing.assert_array_equal, state.batch_stats, good)
    state = step(state, x)
    assert bool(jxs.all_finite(state.batch_stats))


def test_the_guide_nnx_checkpoint_recipe_resumes_bit_identically(tmp_path):
    """docs/checkpointing.md's functional NNX loop: save mid-run with orbax,
    restore into a fresh split, merge, and continue exactly as without the
    interruption (dropout keys and counts, BatchNorm statistics, loss scale)."""
    import pathlib
    import re

    ocp = pytest.importorskip("orbax.checkpoint")
    from jaxscale.testing import assert_bit_identical

    guide = pathlib.Path(__file__).resolve().parents[1] / "docs" / "checkpointing.md"
    (block,) = [
        b
        for b in re.findall(r"```python\n(.*?)```", guide.read_text(), re.S)
        if "nnx.split((model, optimizer))" in b
    ]
    x, y = data()

    def run(block_text, model, optimizer):
        scope = {
            "jax": jax, "jnp": jnp, "nnx": nnx, "jxs": jxs, "ocp": ocp,
            "loss_fn": loss_fn, "x": x, "y": y, "path": tmp_path / "ckpt",
            "model": model, "optimizer": optimizer,
        }  # fmt: skip
        exec(block_text, scope)  # noqa: S102 - our own documentation
        return scope

    model, optimizer = make()
    cut = block.index("# ... later")
    save_part, restore_part = block[:cut], block[cut:]
    scope = run(save_part, model, optimizer)
    step, state = scope["train_step"], scope["state"]
    reference, _ = step(state, x, y)  # the uninterrupted run's next step
    fresh_model, fresh_opt = make()
    scope = run(restore_part, fresh_model, fresh_opt)
    graphdef, restored = nnx.split((scope["model"], scope["optimizer"]))
    resumed, _ = step(restored, x, y)

    def host(tree):
        def leaf(v):
            if jnp.issubdtype(v.dtype, jax.dtypes.prng_key):
                v = jax.random.key_data(v)
            return np.asarray(v)

        return jax.tree.map(leaf, nnx.to_pure_dict(tree))

    assert_bit_identical(host(resumed), host(reference))
