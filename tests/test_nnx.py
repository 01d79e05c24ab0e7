"""Flax NNX models with state beyond parameters (BatchNorm, Dropout) through the
scaled gradient, accumulation and the forward-overflow guard."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxscale as jxs

pytestmark = [pytest.mark.integration, pytest.mark.libraries]

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

    with pytest.raises(TypeError, match="mixes Flax NNX objects"):
        jxs.value_and_grad(two, optimizer, argnums=(0, 1))(model, jnp.ones(2))


def test_an_nnx_object_inside_a_container_is_refused():
    """It would go through ``jax.value_and_grad`` as a pytree (0.1.0's silent
    failure); the message says to pass it as an argument itself."""
    model, optimizer = make()
    x, y = data()

    def in_list(models, x, y):
        return loss_fn(models[0], x, y)

    with pytest.raises(TypeError, match=r"`args\[0\]` holds a Flax NNX object"):
        jxs.value_and_grad(in_list, optimizer)([model], x, y)
    with pytest.raises(TypeError, match=r"`rngs` holds a Flax NNX object inside"):
        jxs.value_and_grad(loss_fn, optimizer)(model, x, y, rngs={"r": nnx.Rngs(0)})


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
    assert jxs.diagnostics.summary(optimizer)["skipped_steps"] == 1
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
    restore into a fresh split, validate the nnx.State, and continue exactly as
    without the interruption (dropout keys and counts, BatchNorm statistics,
    loss scale)."""
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

    def run(block_text, model, optimizer, **more):
        scope = {
            "jax": jax, "jnp": jnp, "nnx": nnx, "jxs": jxs, "ocp": ocp,
            "loss_fn": loss_fn, "x": x, "y": y, "path": tmp_path / "ckpt",
            "model": model, "optimizer": optimizer, **more,
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
    scope = run(restore_part, fresh_model, fresh_opt, train_step=step)
    resumed = scope["state"]

    def host(tree):
        def leaf(v):
            if jnp.issubdtype(v.dtype, jax.dtypes.prng_key):
                v = jax.random.key_data(v)
            return np.asarray(v)

        return jax.tree.map(leaf, nnx.to_pure_dict(tree))

    assert_bit_identical(host(resumed), host(reference))


# --------------------------------------------------------------------------- #
# NNX objects passed to the loss besides the model (nnx.Rngs)
# --------------------------------------------------------------------------- #


class RngsNet(nnx.Module):
    """Dropout without its own Rngs: the loss passes an ``nnx.Rngs``."""

    def __init__(self):
        self.l1 = nnx.Linear(8, 16, rngs=nnx.Rngs(0))
        self.drop = nnx.Dropout(0.5)
        self.l2 = nnx.Linear(16, 1, rngs=nnx.Rngs(1))

    def __call__(self, x, rngs):
        return self.l2(self.drop(jax.nn.relu(self.l1(x)), rngs=rngs))


def rngs_loss(model, x, y, rngs):
    return jnp.mean((model(x, rngs) - y) ** 2)


def rngs_loss_kw(model, x, y, *, rngs):
    return rngs_loss(model, x, y, rngs)


@pytest.mark.parametrize("keyword", [False, True])
def test_an_rngs_argument_advances_like_nnx_value_and_grad(keyword):
    """0.2.0 before this: TraceContextError (the Rngs went through
    ``jax.value_and_grad`` as a pytree)."""
    x, y = data()
    model, ref_model = RngsNet(), RngsNet()
    opt = nnx.Optimizer(
        model, jxs.dynamic_scaling(optax.sgd(0.0), jxs.StaticLossScale.create(SCALE)),
        wrt=nnx.Param,
    )  # fmt: skip
    rngs, ref_rngs = nnx.Rngs(dropout=3), nnx.Rngs(dropout=3)

    @nnx.jit
    def ours(model, opt, rngs):
        if keyword:
            return jxs.value_and_grad(rngs_loss_kw, opt)(model, x, y, rngs=rngs)
        return jxs.value_and_grad(rngs_loss, opt)(model, x, y, rngs)

    @nnx.jit
    def ref(model, rngs):
        return nnx.value_and_grad(rngs_loss)(model, x, y, rngs)

    losses = []
    for _ in range(3):
        loss, grads = ours(model, opt, rngs)
        ref_loss, ref_grads = ref(ref_model, ref_rngs)
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)  # same mask
        jax.tree.map(
            lambda a, b: np.testing.assert_allclose(a, b * SCALE, rtol=1e-5),
            grads,
            ref_grads,
        )
        losses.append(float(loss))
    assert len(set(losses)) == 3  # a new dropout mask every step
    assert int(rngs.dropout.count[...]) == int(ref_rngs.dropout.count[...]) == 3


def test_arrays_differentiated_with_an_rngs_argument_carried():
    """Plain pytree parameters at ``argnums``, an ``nnx.Rngs`` elsewhere."""
    x, y = data()
    ls = jxs.StaticLossScale.create(SCALE)
    w = {"w": jnp.ones((8, 1))}

    def loss(params, x, y, rngs):
        keep = jax.random.bernoulli(rngs.dropout(), 0.5, x.shape)
        return jnp.mean((jnp.where(keep, x, 0.0) @ params["w"] - y) ** 2)

    rngs, ref_rngs = nnx.Rngs(dropout=5), nnx.Rngs(dropout=5)
    ours = nnx.jit(lambda w, r: jxs.value_and_grad(loss, ls)(w, x, y, r))
    ref = nnx.jit(lambda w, r: nnx.value_and_grad(loss)(w, x, y, r))
    for _ in range(2):
        (loss_a, g_a), (loss_b, g_b) = ours(w, rngs), ref(w, ref_rngs)
        np.testing.assert_allclose(loss_a, loss_b, rtol=1e-6)
        np.testing.assert_allclose(g_a["w"], g_b["w"] * SCALE, rtol=1e-5)
    assert int(rngs.dropout.count[...]) == 2


def test_accumulation_with_an_rngs_argument_draws_per_micro_batch():
    x, y = data(n=32)
    model = RngsNet()
    opt = nnx.Optimizer(model, jxs.dynamic_scaling(optax.sgd(0.0)), wrt=nnx.Param)
    rngs = nnx.Rngs(dropout=3)

    @nnx.jit
    def step(model, opt, rngs):
        fn = jxs.accumulate_value_and_grad(rngs_loss, opt, num_microbatches=4)
        return fn(model, x, y, rngs)[0]  # the Rngs is not part of the batch

    losses = [float(step(model, opt, rngs)) for _ in range(2)]
    assert losses[0] != losses[1]
    assert int(rngs.dropout.count[...]) == 8
    with pytest.raises(ValueError, match="names a Flax NNX object"):
        jxs.accumulate_value_and_grad(
            rngs_loss, opt, num_microbatches=4, batch_argnums=(1, 2, 3)
        )(model, x, y, rngs)


# --------------------------------------------------------------------------- #
# Training end to end: BatchNorm and Dropout, evaluated in eval mode
# --------------------------------------------------------------------------- #


class Classifier(nnx.Module):
    def __init__(self, rngs):
        kw = dict(dtype=jnp.float16, param_dtype=jnp.float32)
        self.l1 = nnx.Linear(8, 32, rngs=rngs, **kw)
        self.bn = nnx.BatchNorm(32, momentum=0.9, rngs=rngs, **kw)
        self.drop = nnx.Dropout(0.2, rngs=rngs)
        self.l2 = nnx.Linear(32, 2, rngs=rngs, **kw)

    def __call__(self, x):
        h = self.drop(jax.nn.relu(self.bn(self.l1(x.astype(jnp.float16)))))
        return self.l2(h).astype(jnp.float32)


def xent(model, x, labels):
    return optax.softmax_cross_entropy_with_integer_labels(model(x), labels).mean()


def classes(seed, n):
    # Shifted inputs: without running statistics, eval mode is far off.
    x = 3.0 + 2.0 * jax.random.normal(jax.random.key(seed), (n, 8))
    return x, (jnp.sum(x[:, :4] - 3.0, axis=1) > 0).astype(jnp.int32)


def test_short_form_trains_a_batchnorm_dropout_model_like_nnx_value_and_grad():
    """0.1.0: the running statistics never moved, so eval mode was far off
    (eval loss 138 against 1.65 in the trial's t1d)."""
    x, labels = classes(0, 256)
    x_eval, labels_eval = classes(1, 512)

    def make(scaled):
        model = Classifier(nnx.Rngs(0, dropout=1))
        tx = optax.sgd(0.1, momentum=0.9)
        tx = jxs.dynamic_scaling(tx) if scaled else tx
        return model, nnx.Optimizer(model, tx, wrt=nnx.Param)

    (model, opt), (ref_model, ref_opt) = make(True), make(False)

    @nnx.jit
    def ours(model, opt, x, labels):
        loss, grads = jxs.value_and_grad(xent, opt)(model, x, labels)
        opt.update(model, grads)
        return loss

    @nnx.jit
    def ref(model, opt, x, labels):
        loss, grads = nnx.value_and_grad(xent)(model, x, labels)
        opt.update(model, grads)
        return loss

    for i in range(40):
        sl = slice((i % 4) * 64, (i % 4 + 1) * 64)
        ours(model, opt, x[sl], labels[sl])
        ref(ref_model, ref_opt, x[sl], labels[sl])
    assert int(jxs.diagnostics.summary(opt)["skipped_steps"]) == 0

    def evaluate(model):
        model.eval()
        logits = nnx.jit(lambda m, x: m(x))(model, x_eval)
        acc = float(jnp.mean(jnp.argmax(logits, -1) == labels_eval))
        return acc, float(xent(model, x_eval, labels_eval))

    (acc, loss), (ref_acc, ref_loss) = evaluate(model), evaluate(ref_model)
    assert acc > 0.85 and abs(acc - ref_acc) <= 0.03, (acc, ref_acc)  # 0.918, 0.922
    assert loss == pytest.approx(ref_loss, rel=0.1), (loss, ref_loss)
    np.testing.assert_allclose(model.bn.mean[...], ref_model.bn.mean[...], rtol=0.05)
    assert float(jnp.min(model.bn.mean[...])) != 0.0  # the statistics moved


# --------------------------------------------------------------------------- #
# The forward-overflow guard under jxs.accumulate (one update per micro-batch)
# --------------------------------------------------------------------------- #


def test_keep_on_skip_under_accumulate_keeps_micro_batch_statistics_unless_nan():
    x, y = data()
    model = Net(nnx.Rngs(0), dropout=0.0)
    tx = jxs.accumulate(jxs.dynamic_scaling(optax.sgd(0.0)), every_k=3)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, x):
        with jxf.keep_on_skip(model, optimizer):
            loss, grads = jxs.value_and_grad(loss_fn, optimizer)(model, x, y)
            optimizer.update(model, grads)

    def mean():
        return np.asarray(model.bn.mean[...])

    means = [mean()]
    bad = x.at[0, 0].set(1e6)  # inf in float16
    for batch in (x, bad, x, x):
        step(model, optimizer, batch)
        means.append(mean())
    # 1: accumulating, finite: the statistics move (as without accumulation).
    assert not np.array_equal(means[1], means[0])
    # 2: accumulating, overflowing forward: NaN statistics are not kept.
    np.testing.assert_array_equal(means[2], means[1])
    # 3: the window's update is skipped: this call's statistics are dropped.
    assert int(jxs.diagnostics.summary(optimizer)["skipped_steps"]) == 1
    np.testing.assert_array_equal(means[3], means[2])
    # 4: the next window accumulates again.
    assert not np.array_equal(means[4], means[3])
    assert np.isfinite(means[4]).all()


def test_linen_train_state_under_accumulate_keeps_micro_batch_statistics():
    import flax.linen as nn

    class M(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.Dense(4, dtype=jnp.float16)(x.astype(jnp.float16))
            x = nn.BatchNorm(use_running_average=False, dtype=jnp.float16)(x)
            return jnp.sum(x.astype(jnp.float32))

    class State(jxf.TrainState):
        batch_stats: dict

    m, (x, _) = M(), data()
    variables = m.init(jax.random.key(0), x)
    tx = jxs.accumulate(
        jxs.dynamic_scaling(optax.sgd(0.1), jxs.StaticLossScale.create(8.0)), 3
    )
    state = State.create(
        apply_fn=m.apply, params=variables["params"], tx=tx,
        batch_stats=variables["batch_stats"],
    )  # fmt: skip

    @jax.jit
    def step(state, x):
        def f(params):
            variables = {"params": params, "batch_stats": state.batch_stats}
            return state.apply_fn(variables, x, mutable=["batch_stats"])

        (_, upd), grads = jxs.value_and_grad(f, state, has_aux=True)(state.params)
        return state.apply_gradients(grads=grads, batch_stats=upd["batch_stats"])

    def mean(state):
        return np.asarray(state.batch_stats["BatchNorm_0"]["mean"])

    means = [mean(state)]
    for batch in (x, x.at[0, 0].set(1e6), x, x):
        state = step(state, batch)
        means.append(mean(state))
    assert not np.array_equal(means[1], means[0])  # accumulating: updated
    np.testing.assert_array_equal(means[2], means[1])  # NaN: kept
    assert int(state.opt_state.inner_state.skipped_steps) == 1
    np.testing.assert_array_equal(means[3], means[2])  # skipped window end
    assert not np.array_equal(means[4], means[3]) and np.isfinite(means[4]).all()
    assert int(state.step) == 0  # the only window so far was skipped


# --------------------------------------------------------------------------- #
# The helpers on an nnx.State (functional loops) and in-place repair
# --------------------------------------------------------------------------- #


def split_state(growth_interval=10):
    """A model and optimizer after one applied step, and their split."""
    model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    ls = jxs.DynamicLossScale.create(growth_interval=growth_interval)
    tx = jxs.dynamic_scaling(optax.adam(1e-3), ls)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    optimizer.update(model, jax.tree.map(jnp.ones_like, nnx.state(model, nnx.Param)))
    return model, optimizer, *nnx.split((model, optimizer))


def test_summary_reads_an_nnx_state():
    """0.1.0: ``contains no jaxscale state ... got State``."""
    _, optimizer, _, state = split_state()
    ours = jxs.diagnostics.summary(state)
    merged = jxs.diagnostics.summary(optimizer)
    # The growth interval lives in the GraphDef, so does this key.
    assert set(ours) == set(merged) - {"growths_without_overflow"}
    for k, v in ours.items():
        assert v.dtype == merged[k].dtype and v == merged[k], k
    assert int(ours["steps"]) == 1
    with pytest.raises(ValueError, match=r"got 0 in this nnx.State.*nnx.split"):
        jxs.diagnostics.summary(nnx.split(nnx.Linear(2, 3, rngs=nnx.Rngs(0)))[1])


def test_loss_scale_of_an_nnx_state_says_merge_first():
    """The loss scale's configuration is in the GraphDef, not in the State:
    a LossScale rebuilt from the State alone would be wrong, so it is refused."""
    _, _, graphdef, state = split_state()
    with pytest.raises(ValueError, match=r"nnx.merge\(graphdef, state\).*summary"):
        jxs.loss_scale_of(state)
    _, optimizer = nnx.merge(graphdef, state)
    assert jxs.loss_scale_of(optimizer).growth_interval == 10


def test_validate_state_checks_and_repairs_an_nnx_state_in_place():
    _, _, graphdef, state = split_state()
    assert jxs.validate_state(state) is state
    ls = state[1]["opt_state"]["loss_scale"]
    ls["growth_tracker"][...] = jnp.int32(-4)
    ls["loss_scale"][...] = jnp.float32(0.0)
    with pytest.raises(ValueError, match=r"loss_scale.*must be finite and > 0"):
        jxs.validate_state(state)
    ls["loss_scale"][...] = jnp.float32(jnp.inf)
    with pytest.raises(
        ValueError, match=r"loss_scale` must be finite and in .*widest one allowed"
    ):
        jxs.validate_state(state)
    with pytest.warns(UserWarning, match="inf -> .*growth_tracker` -4 -> 0"):
        assert jxs.validate_state(state, repair=True) is state
    assert int(ls["growth_tracker"][...]) == 0
    assert float(ls["loss_scale"][...]) == np.finfo(np.float32).max
    _, optimizer = nnx.merge(graphdef, state)  # the repaired values are merged
    assert int(optimizer.opt_state.loss_scale.growth_tracker[...]) == 0
    # The configuration-dependent bound needs the merged optimizer:
    optimizer.opt_state.loss_scale.growth_tracker[...] = jnp.int32(50)
    assert jxs.validate_state(nnx.split((optimizer,))[1]) is not None
    with pytest.raises(ValueError, match=r"\[0, growth_interval\) = \[0, 10\)"):
        jxs.validate_state(optimizer)


def test_validate_state_repairs_an_nnx_optimizer_in_place():
    """0.1.0 returned a copy of the nnx.Optimizer (with a plain array where the
    OptArray was); NNX objects are mutated in place instead."""
    model, optimizer, _, _ = split_state()
    assert jxs.validate_state(optimizer) is optimizer
    optimizer.opt_state.loss_scale.growth_tracker[...] = jnp.int32(50)
    with pytest.warns(UserWarning, match=r"opt_state.loss_scale.growth_tracker` 50"):
        assert jxs.validate_state(optimizer, repair=True) is optimizer
    tracker = optimizer.opt_state.loss_scale.growth_tracker
    assert isinstance(tracker, nnx.OptArray) and int(tracker[...]) == 9
    optimizer.opt_state.steps[...] = jnp.int32(-1)
    with pytest.warns(UserWarning, match=r"steps` -1 -> 0"):
        assert jxs.validate_state(optimizer.opt_state, repair=True) is not None
    assert int(optimizer.opt_state.steps[...]) == 0  # in place there too


# --------------------------------------------------------------------------- #
# docs/flax.md: every snippet runs as written
# --------------------------------------------------------------------------- #


def guide_block(containing):
    import pathlib
    import re

    guide = pathlib.Path(__file__).resolve().parents[1] / "docs" / "flax.md"
    blocks = re.findall(r"```python\n(.*?)```", guide.read_text(), re.S)
    (block,) = [b for b in blocks if containing in b]
    return block


def test_the_guide_nnx_snippets_run():
    scope = {"jax": jax, "jnp": jnp, "optax": optax, "jxs": jxs}
    exec(guide_block("class Net(nnx.Module)"), scope)  # noqa: S102 - our docs
    model, optimizer = scope["model"], scope["optimizer"]
    x = jax.random.normal(jax.random.key(0), (8, 784))
    y = jnp.arange(8) % 10
    losses = [float(scope["train_step"](model, optimizer, x, y)) for _ in range(2)]
    assert all(np.isfinite(losses))
    assert float(jnp.abs(model.bn.mean[...]).sum()) > 0  # the statistics move
    assert int(model.drop.rngs.count[...]) == 2  # a dropout mask per step

    exec(guide_block("with jxf.keep_on_skip(model, optimizer)"), scope)  # noqa: S102
    good = np.asarray(model.bn.mean[...])
    scope["train_step"](model, optimizer, x.at[0, 0].set(1e6), y)  # f16 inf
    assert int(jxs.diagnostics.summary(optimizer)["skipped_steps"]) == 1
    np.testing.assert_array_equal(model.bn.mean[...], good)

    exec(guide_block("grad_fn = jxs.accumulate_value_and_grad("), scope)  # noqa: S102
    assert np.isfinite(float(scope["train_step"](model, optimizer, x, y)))
    assert int(model.drop.rngs.count[...]) == 3 + 4  # one per micro-batch
    assert not np.array_equal(np.asarray(model.bn.mean[...]), good)


def test_the_guide_linen_batch_stats_snippets_run():
    import flax.linen as nn
    from flax.training import train_state

    class M(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.Dense(4, dtype=jnp.float16)(x.astype(jnp.float16))
            return nn.BatchNorm(use_running_average=False, dtype=jnp.float16)(x)

    scope = {"jax": jax, "jnp": jnp, "optax": optax, "jxs": jxs, "jxf": jxf}
    exec(guide_block("class TrainState(jxf.TrainState)"), scope)  # noqa: S102
    x, y = data()
    y = (y[:, 0] > 0).astype(jnp.int32)
    variables = M().init(jax.random.key(0), x)
    state = scope["TrainState"].create(
        apply_fn=M().apply, params=variables["params"],
        tx=jxs.dynamic_scaling(optax.sgd(0.1)), batch_stats=variables["batch_stats"],
    )  # fmt: skip
    state, _ = scope["train_step"](state, x, y)
    good = jax.tree.map(np.asarray, state.batch_stats)
    state, _ = scope["train_step"](state, x.at[0, 0].set(1e6), y)
    assert int(state.opt_state.skipped_steps) == 1
    jax.tree.map(np.testing.assert_array_equal, state.batch_stats, good)

    # The stock TrainState with the two-line guard.
    class Stock(train_state.TrainState):
        batch_stats: dict

    stock = Stock.create(
        apply_fn=None, params={"w": jnp.zeros(2)},
        tx=jxs.dynamic_scaling(optax.sgd(1.0)), batch_stats={"mean": jnp.zeros(2)},
    )  # fmt: skip
    scope.update(
        state=stock,
        grads={"w": jnp.array([jnp.inf, 0.0])},
        updates={"batch_stats": {"mean": jnp.full(2, jnp.nan)}},
    )
    exec(guide_block("applied = jxf.update_applied"), scope)  # noqa: S102
    np.testing.assert_array_equal(scope["new"].batch_stats["mean"], np.zeros(2))


def test_accumulation_over_a_closed_over_split_module_says_what_to_do():
    """0.1.0's documented recipe (split the model, close over the rest) failed
    with Flax's TraceContextError for any model with Dropout or BatchNorm."""
    x, y = data()
    model, optimizer = make()

    @nnx.jit
    def step(model, optimizer):
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)

        def loss(params, x, y):
            return loss_fn(nnx.merge(graphdef, params, rest), x, y)

        fn = jxs.accumulate_value_and_grad(loss, optimizer, num_microbatches=4)
        return fn(params, x, y)

    with pytest.raises(TypeError, match=r"Pass the module, and any `nnx.Rngs`"):
        step(model, optimizer)


def test_an_nnx_older_than_the_floor_is_refused_with_the_fix(monkeypatch):
    """flax 0.11's NNX (no ``nnx.Pytree``) is below the declared floor: there a
    loss closing over a split module drops its updates silently, so jaxscale
    refuses it by name rather than guess (``flax.nnx`` stands in for it here)."""
    import sys
    import types

    monkeypatch.setitem(sys.modules, "flax.nnx", types.ModuleType("flax.nnx"))
    tx = jxs.dynamic_scaling(optax.sgd(0.1))
    params = {"w": jnp.ones(3)}
    with pytest.raises(ImportError, match=r"needs flax >= 0\.12\.0, found flax "):
        jxs.value_and_grad(lambda p: jnp.sum(p["w"]), tx.init(params))(params)
