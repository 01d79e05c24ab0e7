"""Equinox as equinox writes it: ``jaxscale.equinox`` with ``eqx.filter_jit``,
``eqx.nn.State`` threaded through the loss, optax on the filtered parameters.

Two small models train in float16 (``jxs.autocast`` + ``jxs.dynamic_scaling``)
to their float32 results on synthetic tasks: a CNN with BatchNorm (over a
``vmap`` axis) and SpectralNorm, and a transformer with padded attention and
Dropout. Then: a step that overflows in the forward pass leaves model, state and
optimizer state bit-identical; a checkpoint written with
``eqx.tree_serialise_leaves`` resumes bit for bit; Dropout keys; bad arguments;
and the train loop of docs/equinox.md.
"""

import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import all_eqns, relaxed

import jaxscale as jxs
import jaxscale.testing as jxt

pytestmark = pytest.mark.integration

eqx = pytest.importorskip("equinox")
jxe = pytest.importorskip("jaxscale.equinox")

DOC = Path(__file__).resolve().parents[1] / "docs" / "equinox.md"
SEEDS = (0, 1, 2)
STEPS = 120
BATCH = 32


def tx():
    """adam promotes implicitly in its own code (see helpers.relaxed)."""
    return jxs.dynamic_scaling(relaxed(optax.adam(3e-3)))


# --- a CNN with BatchNorm (vmap axis) and SpectralNorm ---------------------------


class CNN(eqx.Module):
    conv1: eqx.nn.Conv2d
    bn: eqx.nn.BatchNorm
    conv2: eqx.nn.Conv2d
    head: eqx.nn.SpectralNorm

    def __init__(self, key):
        k1, k2, k3, k4 = jax.random.split(key, 4)
        self.conv1 = eqx.nn.Conv2d(1, 8, 3, padding=1, key=k1)
        self.bn = eqx.nn.BatchNorm(8, axis_name="batch", mode="batch")
        self.conv2 = eqx.nn.Conv2d(8, 8, 3, stride=2, padding=1, key=k2)
        linear = eqx.nn.Linear(128, 4, key=k3)
        self.head = eqx.nn.SpectralNorm(linear, "weight", key=k4)

    def __call__(self, x, state):  # one example: x is f32[1, 8, 8]
        h, state = self.bn(self.conv1(x), state)
        h = jax.nn.relu(self.conv2(jax.nn.relu(h)))
        return self.head(h.reshape(-1), state)


def cnn_loss(model, state, x, y):  # float32 code, as equinox writes it
    batched = jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))
    logits, state = batched(x, state)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    return loss, state


def quadrants(n, seed):
    """Which quadrant of a noisy 8x8 image holds a bright 2x2 blob (4 classes).

    NumPy arrays: batches are sliced on the host, as a data loader would.
    """
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 4, n)
    x = 0.5 * rng.standard_normal((n, 1, 8, 8))
    for i, label in enumerate(y):
        r, c = 4 * (label // 2) + 1, 4 * (label % 2) + 1
        x[i, 0, r : r + 2, c : c + 2] += 1.0
    return x.astype(np.float32), y.astype(np.int32)


def make_cnn_step(loss_fn, optimizer, traces):
    """The train step of docs/equinox.md; also returns the unguarded new state."""

    @eqx.filter_jit
    def step(model, state, opt_state, x, y):
        traces.append(1)
        grad_fn = jxe.filter_value_and_grad(loss_fn, opt_state, has_aux=True)
        (loss, new_state), grads = grad_fn(model, state, x, y)
        params = eqx.filter(model, eqx.is_inexact_array)
        updates, new_opt_state = optimizer.update(grads, opt_state, params)
        model = eqx.apply_updates(model, updates)
        kept = jxe.keep_on_skip(state, new_state, opt_state, new_opt_state)
        return model, kept, new_opt_state, loss, new_state

    return step


CNN_TX = tx()
CNN_TRACES = {"float32": [], "float16": []}
CNN_STEPS = {
    "float32": make_cnn_step(cnn_loss, CNN_TX, CNN_TRACES["float32"]),
    "float16": make_cnn_step(jxs.autocast(cnn_loss), CNN_TX, CNN_TRACES["float16"]),
}
CNN_DATA = quadrants(1024, seed=100)


@eqx.filter_jit
def cnn_init(key):
    model, state = eqx.nn.make_with_state(CNN)(key)
    return model, state, CNN_TX.init(eqx.filter(model, eqx.is_inexact_array))


@eqx.filter_jit
def cnn_accuracy(model, state, x, y):
    model = eqx.nn.inference_mode(model)  # BatchNorm reads its running statistics
    batched = jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))
    logits, _ = batched(x, state)
    return jnp.mean(jnp.argmax(logits, axis=-1) == y)


def cnn_batch(i, seed):
    x, y = CNN_DATA
    order = np.random.default_rng(seed).permutation(len(y))
    idx = order[(i * BATCH) % len(y) :][:BATCH]
    return x[idx], y[idx]


def train_cnn(dtype, seed, steps=STEPS):
    model, state, opt_state = cnn_init(jax.random.key(seed))
    losses = []
    for i in range(steps):
        model, state, opt_state, loss, _ = CNN_STEPS[dtype](
            model, state, opt_state, *cnn_batch(i, seed)
        )
        losses.append(loss)
    accuracy = cnn_accuracy(model, state, *quadrants(512, seed=101))
    return np.asarray(jax.device_get(losses)), float(accuracy), opt_state


# --- a transformer with padded attention and Dropout ----------------------------

LENGTH, VOCAB, DIM = 8, 4, 16


class Transformer(eqx.Module):
    embed: eqx.nn.Embedding
    position: jax.Array
    attention: eqx.nn.MultiheadAttention
    dropout: eqx.nn.Dropout
    norm: eqx.nn.LayerNorm
    head: eqx.nn.Linear

    def __init__(self, key, dropout=0.1):
        k1, k2, k3, k4 = jax.random.split(key, 4)
        self.embed = eqx.nn.Embedding(VOCAB, DIM, key=k1)
        self.position = 0.1 * jax.random.normal(k2, (LENGTH, DIM))
        self.attention = eqx.nn.MultiheadAttention(2, DIM, key=k3)
        self.dropout = eqx.nn.Dropout(dropout)
        self.norm = eqx.nn.LayerNorm(DIM)
        self.head = eqx.nn.Linear(DIM, 2, key=k4)

    def __call__(self, tokens, valid, key):  # one sequence: i32[L], bool[L]
        h = jax.vmap(self.embed)(tokens) + self.position
        # Padded queries see nothing: their rows are masked everywhere.
        mask = valid[:, None] & valid[None, :]
        a = self.attention(h, h, h, mask=mask)
        h = jax.vmap(self.norm)(h + self.dropout(a, key=key))
        # 0 * NaN is NaN: a NaN in a padded row would poison the pooled vector.
        weights = valid.astype(h.dtype)
        return self.head(weights @ h / jnp.sum(weights))


def lm_loss(model, tokens, valid, y, key):
    keys = jax.random.split(key, tokens.shape[0])
    logits = jax.vmap(model)(tokens, valid, keys)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def counting(n, seed):
    """Whether the valid part of a padded sequence holds more 1s than 2s.

    The padding holds random tokens too, so a model that attends to (or pools
    over) padding is wrong.
    """
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, VOCAB, (n, LENGTH))
    valid = np.arange(LENGTH) < rng.integers(3, LENGTH + 1, (n, 1))
    y = ((tokens == 1) & valid).sum(1) > ((tokens == 2) & valid).sum(1)
    return tokens.astype(np.int32), valid, y.astype(np.int32)


def make_lm_step(loss_fn, optimizer):
    @eqx.filter_jit
    def step(model, opt_state, tokens, valid, y, key):
        grad_fn = jxe.filter_value_and_grad(loss_fn, opt_state)
        loss, grads = grad_fn(model, tokens, valid, y, key)
        params = eqx.filter(model, eqx.is_inexact_array)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return eqx.apply_updates(model, updates), opt_state, loss

    return step


LM_TX = tx()
LM_STEPS = {
    "float32": make_lm_step(lm_loss, LM_TX),
    "float16": make_lm_step(jxs.autocast(lm_loss), LM_TX),
}
LM_DATA = counting(1024, seed=200)


@eqx.filter_jit
def lm_init(key):
    model = Transformer(key)
    return model, LM_TX.init(eqx.filter(model, eqx.is_inexact_array))


@eqx.filter_jit
def lm_accuracy(model, tokens, valid, y):
    model = eqx.nn.inference_mode(model)  # no dropout
    logits = jax.vmap(model, in_axes=(0, 0, None))(tokens, valid, None)
    return jnp.mean(jnp.argmax(logits, axis=-1) == y)


def train_lm(dtype, seed, steps=STEPS):
    model, opt_state = lm_init(jax.random.key(seed))
    tokens, valid, y = LM_DATA
    order = np.random.default_rng(seed).permutation(len(y))
    dropout_key = jax.random.key(1000 + seed)
    losses = []
    for i in range(steps):
        idx = order[(i * BATCH) % len(y) :][:BATCH]
        key = jax.random.fold_in(dropout_key, i)  # a fresh mask on every step
        model, opt_state, loss = LM_STEPS[dtype](
            model, opt_state, tokens[idx], valid[idx], y[idx], key
        )
        losses.append(loss)
    accuracy = lm_accuracy(model, *counting(512, seed=201))
    return np.asarray(jax.device_get(losses)), float(accuracy), opt_state


# --- (a), (b) float16 trains to the float32 result --------------------------------


def runs_in_float16(loss_fn, *args):
    """Whether autocast put every matmul / convolution of the step in float16."""
    jaxpr, _, _ = eqx.filter_make_jaxpr(jxs.autocast(loss_fn))(*args)
    ops = [
        e
        for e in all_eqns(jaxpr)
        if e.primitive.name in ("dot_general", "conv_general_dilated")
    ]
    return bool(ops) and all(v.aval.dtype == jnp.float16 for e in ops for v in e.invars)


def final(losses):
    return float(np.mean(losses[-10:]))


def assert_float16_matches_float32(results):
    """Per seed, float16 ends within the spread of float32 across seeds."""
    f32 = np.array([final(results["float32", s][0]) for s in SEEDS])
    f16 = np.array([final(results["float16", s][0]) for s in SEEDS])
    spread = f32.max() - f32.min()
    assert np.all(np.abs(f16 - f32) <= spread), (f32, f16)
    assert abs(f16.mean() - f32.mean()) <= spread / 2, (f32, f16)
    for dtype in ("float32", "float16"):
        for s in SEEDS:
            losses, accuracy, opt_state = results[dtype, s]
            assert np.isfinite(losses).all(), (dtype, s)
            assert final(losses) < 0.25 * losses[0], (dtype, s, losses[::10])
            assert int(opt_state.skipped_steps) <= 5, (dtype, s)
    f32_acc = [results["float32", s][1] for s in SEEDS]
    f16_acc = [results["float16", s][1] for s in SEEDS]
    assert min(f16_acc) >= min(f32_acc) - 0.03, (f32_acc, f16_acc)
    return f32, f16, f32_acc, f16_acc


def test_cnn_with_batchnorm_and_spectralnorm_trains_in_float16_like_float32():
    model, state, _ = cnn_init(jax.random.key(0))
    assert runs_in_float16(cnn_loss, model, state, *cnn_batch(0, 0))
    traced = {d: len(t) for d, t in CNN_TRACES.items()}
    results = {(d, s): train_cnn(d, s) for d in CNN_STEPS for s in SEEDS}
    # The state comes back in its own types (the weakly typed BatchNorm counter
    # included): one trace per dtype for every step of every seed.
    assert all(len(t) - traced[d] <= 1 for d, t in CNN_TRACES.items())
    f32, f16, f32_acc, f16_acc = assert_float16_matches_float32(results)
    print(f"\nCNN final loss f32 {f32} f16 {f16}; accuracy {f32_acc} {f16_acc}")
    assert min(f16_acc) > 0.9  # BatchNorm's running statistics are sound


def test_transformer_with_padded_attention_trains_in_float16_like_float32():
    model, _ = lm_init(jax.random.key(0))
    tokens, valid, y = LM_DATA
    key = jax.random.key(0)
    assert runs_in_float16(lm_loss, model, tokens[:4], valid[:4], y[:4], key)
    results = {(d, s): train_lm(d, s) for d in LM_STEPS for s in SEEDS}
    f32, f16, f32_acc, f16_acc = assert_float16_matches_float32(results)
    print(f"\nTransformer final loss f32 {f32} f16 {f16}; acc {f32_acc} {f16_acc}")
    assert min(f16_acc) > 0.9


# --- (c) a skipped step changes nothing but the scale and the counters ------------


def test_forward_overflow_leaves_model_state_and_optimizer_bit_identical():
    step = CNN_STEPS["float16"]
    model, state, opt_state = cnn_init(jax.random.key(0))
    for i in range(3):
        model, state, opt_state, _, _ = step(model, state, opt_state, *cnn_batch(i, 0))
    x, y = cnn_batch(3, 0)
    big = x.copy()
    big[0] = 1e5  # finite in float32, inf in float16 (max 65504)
    new_model, new_state, new_opt_state, loss, unguarded = step(
        model, state, opt_state, big, y
    )
    assert not np.isfinite(float(loss))
    # Without the guard, BatchNorm's running statistics would now be NaN.
    assert not bool(jxs.all_finite(unguarded))
    params = eqx.filter(model, eqx.is_array)
    new_params = eqx.filter(new_model, eqx.is_array)
    jxt.assert_skipped(params, opt_state, new_params, new_opt_state)
    jxt.assert_bit_identical(state, new_state, names=("state", "new_state"))
    scale = jxs.loss_scale_of(opt_state).loss_scale
    assert float(jxs.loss_scale_of(new_opt_state).loss_scale) == float(scale) / 2
    # The next finite batch trains as if the overflow had not happened.
    model, state, opt_state, loss, _ = step(
        new_model, new_state, new_opt_state, *cnn_batch(4, 0)
    )
    assert np.isfinite(float(loss)) and bool(jxs.all_finite((model, state)))
    assert bool(opt_state.last_step_finite)


def test_keep_on_skip_under_accumulate_keeps_finite_micro_batch_statistics():
    tx = jxs.accumulate(jxs.dynamic_scaling(optax.sgd(0.1)), every_k=2)
    params = {"w": jnp.ones(2)}
    update, keep = jax.jit(tx.update), jax.jit(jxe.keep_on_skip)
    s0 = tx.init(params)
    state, finite, bad = jnp.zeros(2), jnp.ones(2), jnp.full(2, jnp.nan)
    _, s1 = update({"w": jnp.ones(2)}, s0, params)  # accumulates
    jxt.assert_bit_identical(finite, keep(state, finite, s0, s1))
    jxt.assert_bit_identical(state, keep(state, bad, s0, s1))
    _, s2 = update({"w": jnp.full(2, jnp.inf)}, s1, params)  # window skipped
    jxt.assert_bit_identical(state, keep(state, finite, s1, s2))
    _, s3 = update({"w": jnp.ones(2)}, s2, params)  # accumulates
    _, s4 = update({"w": jnp.ones(2)}, s3, params)  # window applied
    jxt.assert_bit_identical(finite, keep(state, finite, s3, s4))


# --- (d) a checkpoint resumes bit for bit ------------------------------------------


@pytest.mark.isa  # two compiled programs (the restore retraces) compared bit for bit
def test_tree_serialise_leaves_checkpoint_resumes_bit_identically(tmp_path):
    step = CNN_STEPS["float16"]

    def batch(i):  # step 4 overflows: the checkpoint holds a backed-off scale
        x, y = cnn_batch(i, 0)
        if i == 4:
            x = x.copy()
            x[0] = 1e5
        return x, y

    def run(model, state, opt_state, steps):
        for i in steps:
            model, state, opt_state, _, _ = step(model, state, opt_state, *batch(i))
        return model, state, opt_state

    straight = run(*cnn_init(jax.random.key(0)), range(8))
    saved = run(*cnn_init(jax.random.key(0)), range(5))
    path = tmp_path / "ckpt.eqx"
    eqx.tree_serialise_leaves(path, saved)
    like = cnn_init(jax.random.key(1))  # any model of the same shape
    restored = eqx.tree_deserialise_leaves(path, like)
    jxs.validate_state(restored[2])
    resumed = run(*restored, range(5, 8))
    assert int(resumed[2].skipped_steps) == 1
    jxt.assert_bit_identical(
        eqx.filter(straight, eqx.is_array),
        eqx.filter(resumed, eqx.is_array),
        names=("straight", "resumed"),
    )


# --- (e) Dropout keys --------------------------------------------------------------


class Dropper(eqx.Module):
    linear: eqx.nn.Linear
    dropout: eqx.nn.Dropout

    def __call__(self, x, key):
        return self.linear(self.dropout(x, key=key))


def dropper_loss(model, x, key):
    keys = jax.random.split(key, x.shape[0])
    return jnp.mean(jax.vmap(model)(x, keys) ** 2)


def test_dropout_key_is_an_argument_not_a_gradient():
    model = Dropper(eqx.nn.Linear(16, 1, key=jax.random.key(0)), eqx.nn.Dropout(0.5))
    opt_state = tx().init(eqx.filter(model, eqx.is_inexact_array))
    x = jnp.asarray(np.random.default_rng(0).standard_normal((8, 16)), jnp.float32)

    @eqx.filter_jit
    def grads(model, opt_state, key):
        ours = jxe.filter_value_and_grad(dropper_loss, opt_state)(model, x, key)
        return ours, eqx.filter_grad(dropper_loss)(model, x, key)

    (loss1, grads1), ref = grads(model, opt_state, jax.random.key(1))
    (again, grads_again), _ = grads(model, opt_state, jax.random.key(1))
    (loss2, _), _ = grads(model, opt_state, jax.random.key(2))
    assert float(loss1) == float(again)  # one key, one mask
    jxt.assert_bit_identical(grads1, grads_again)
    assert float(loss1) != float(loss2)  # another key, another mask
    # Dropout's rate and flag are static: no gradient, as in equinox.
    assert grads1.dropout.p is None and grads1.dropout.inference is None
    scale = float(jxs.loss_scale_of(opt_state).loss_scale)
    for g, r in zip(jax.tree.leaves(grads1), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(g, scale * r, rtol=1e-6)


# --- (f) wrong arguments -----------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        (("not a function", "OPT"), TypeError, r"`fun` must be callable"),
        (("OPT", cnn_loss), TypeError, r"`fun` must be callable.*order"),
        ((cnn_loss, {"w": jnp.ones(2)}), ValueError, r"`loss_scale`"),
        ((cnn_loss, 1024.0), TypeError, r"`loss_scale`.*StaticLossScale"),
    ],
)
def test_filter_value_and_grad_rejects_bad_arguments(args, error, match):
    opt_state = jxs.dynamic_scaling(optax.sgd(0.1)).init(jnp.zeros(2))
    args = tuple(opt_state if a == "OPT" else a for a in args)
    with pytest.raises(error, match=match):
        jxe.filter_value_and_grad(*args)


def test_filter_value_and_grad_rejects_has_aux_and_models_without_arrays():
    ls = jxs.StaticLossScale.create(8.0)
    with pytest.raises(TypeError, match=r"`has_aux` must be a bool"):
        jxe.filter_value_and_grad(cnn_loss, ls, has_aux="yes")
    grad_fn = jxe.filter_value_and_grad(lambda m, x: jnp.sum(m(x)), ls)
    with pytest.raises(TypeError, match=r"first positional argument"):
        grad_fn(model=eqx.nn.Identity(), x=jnp.ones(2))
    with pytest.raises(TypeError, match=r"must hold floating arrays.*model first"):
        grad_fn(jnp.arange(2), eqx.nn.Linear(2, 2, key=jax.random.key(0)))


def test_a_forgotten_has_aux_is_named_before_the_loss_is_scaled():
    """The checks of what the loss returns are jxs.value_and_grad's, which
    does the scaling."""
    model, state, opt_state = cnn_init(jax.random.key(0))
    grad_fn = jxe.filter_value_and_grad(cnn_loss, opt_state)  # returns (loss, state)
    with pytest.raises(TypeError, match=r"pass `has_aux=True`.*not scaled"):
        eqx.filter_eval_shape(grad_fn, model, state, *cnn_batch(0, 0))


def test_keep_on_skip_rejects_mismatched_states():
    tx = jxs.dynamic_scaling(optax.sgd(0.1))
    s0 = tx.init(jnp.zeros(2))
    _, s1 = tx.update(jnp.ones(2), s0)
    with pytest.raises(ValueError, match=r"`new_state` must have the tree structure"):
        jxe.keep_on_skip({"a": jnp.zeros(2)}, (jnp.zeros(2),), s0, s1)
    with pytest.raises(ValueError, match=r"of `new_state` is float16\[2\]"):
        jxe.keep_on_skip(jnp.zeros(2), jnp.zeros(2, jnp.float16), s0, s1)
    with pytest.raises(ValueError, match=r"`new_opt_state`"):
        jxe.keep_on_skip(jnp.zeros(2), jnp.zeros(2), s0, jnp.zeros(2))


def test_plain_value_and_grad_on_an_equinox_module_names_the_string_leaf():
    """`jxs.value_and_grad` does not filter: a module with a string leaf
    (BatchNorm's `axis_name`) is refused, naming the leaf and
    `jaxscale.equinox.filter_value_and_grad` (0.2.0: JAX's "Argument 'batch'
    of type <class 'str'> is not a valid JAX type")."""
    model, state, opt_state = cnn_init(jax.random.key(0))
    x, y = cnn_batch(0, 0)
    with pytest.raises(TypeError, match=r"str 'batch' at .*filter_value_and_grad"):
        jxs.value_and_grad(cnn_loss, opt_state, has_aux=True)(model, state, x, y)


def test_import_jaxscale_does_not_import_equinox():
    import subprocess

    code = "import sys, jaxscale; print('equinox' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "False", out.stderr


# --- docs/equinox.md ---------------------------------------------------------------


def doc_blocks(heading):
    """The python blocks under a ``## heading`` of docs/equinox.md."""
    text = DOC.read_text()
    section = re.search(
        rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, re.M | re.S
    )
    assert section, f"docs/equinox.md has no '## {heading}' section."
    return re.findall(r"^```python\n(.*?)^```", section.group(1), re.M | re.S)


def test_the_guide_train_loop_runs():
    """The guide's loop, as written (``optax.adam`` promotes implicitly in its
    own code, so this one runs under standard promotion)."""
    namespace = {}
    with jax.numpy_dtype_promotion("standard"):
        for block in doc_blocks("The train loop"):
            exec(compile(block, str(DOC), "exec"), namespace)
    losses = np.asarray(jax.device_get(namespace["losses"]))
    assert np.isfinite(losses).all() and losses[-1] < 0.5 * losses[0], losses[::10]
    assert bool(jxs.all_finite(namespace["state"]))
