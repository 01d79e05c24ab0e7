"""Wrong nestings of ``dynamic_scaling`` are loud at trace time; right ones are not.

Each wrong order below trains silently wrong without the check (measured in the
0.1.0 new-user trial): a clip in front sees scaled gradients, ``optax.clip``
turns ``inf`` into a finite value, ``MultiSteps`` replays one overflow in every
later window, one ``multi_transform`` group leaves the others scaled.
"""

import warnings

import jax
import jax.numpy as jnp
import optax
import pytest

import jaxscale as jxs
import jaxscale.testing as jxt


def params():
    return {"w": jnp.arange(3.0), "b": jnp.ones(2)}


def loss_fn(p):
    return jnp.sum(p["w"] ** 2) + jnp.sum(p["b"])


def scaled_grads(tx):
    """Traces the documented step under ``jit``: init, value_and_grad, update."""
    p = params()
    state = tx.init(p)

    @jax.jit
    def step(p, state):
        _, grads = jxs.value_and_grad(loss_fn, state)(p)
        updates, state = tx.update(grads, state, p)
        return optax.apply_updates(p, updates), state

    return step(p, state)


def ds(inner=None):
    return jxs.dynamic_scaling(inner or optax.sgd(0.1))


RIGHT = {
    "plain": lambda: ds(),
    "clip_inside": lambda: ds(
        optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1))
    ),
    "accumulate_around": lambda: jxs.accumulate(ds(), every_k=2),
    "inject_inside": lambda: ds(optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)),
    "stateless_after": lambda: optax.chain(ds(), optax.clip(1.0)),
    "fault_injection_before": lambda: optax.chain(jxt.nonfinite_at(at_steps=[5]), ds()),
}

WRONG = {
    "clip_before": (
        lambda: optax.chain(optax.clip_by_global_norm(1.0), ds()),
        "element 1 of an `optax.chain`.*Move them inside the wrapper",
    ),
    "elementwise_clip_before": (
        lambda: optax.chain(optax.clip(1.0), ds(optax.adam(1e-3))),
        "turns an inf into a finite value",
    ),
    "decay_before": (
        lambda: optax.chain(optax.add_decayed_weights(0.1), ds()),
        "weight decay is divided by the scale",
    ),
    "multisteps_around": (
        lambda: optax.MultiSteps(ds(), every_k_schedule=2),
        r"inside a MultiStepsState.*jxs.accumulate\(jxs.dynamic_scaling",
    ),
    "one_multi_transform_group": (
        lambda: optax.multi_transform(
            {"scaled": ds(), "plain": optax.sgd(0.1)}, {"w": "scaled", "b": "plain"}
        ),
        r"one group of `optax.multi_transform`.*dynamic_scaling\(optax.multi_transform",
    ),
    "masked_around": (
        lambda: optax.masked(ds(), {"w": True, "b": False}),
        "optax.masked",
    ),
}


@pytest.mark.parametrize("name", sorted(RIGHT))
@pytest.mark.unit
def test_right_nestings_are_silent(name):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        new_params, state = scaled_grads(RIGHT[name]())
    assert bool(jxs.all_finite(new_params))
    assert float(jxs.loss_scale_of(state).loss_scale) == 2.0**16


@pytest.mark.parametrize("name", sorted(WRONG))
@pytest.mark.unit
def test_wrong_nestings_raise_with_the_right_nesting(name):
    make, match = WRONG[name]
    with pytest.raises(ValueError, match=match):
        scaled_grads(make())
    # The same check runs when the scale is read for logging or a manual step.
    with pytest.raises(ValueError, match=match):
        jxs.loss_scale_of(make().init(params()))


@pytest.mark.unit
def test_inject_hyperparams_around_warns_and_says_inside():
    tx = optax.inject_hyperparams(lambda learning_rate: ds(optax.sgd(learning_rate)))(
        learning_rate=0.1
    )
    with pytest.warns(jxs.CompositionWarning, match="schedules advance on skipped"):
        scaled_grads(tx)


@pytest.mark.unit
def test_stateful_transformation_after_warns():
    tx = optax.chain(ds(), optax.trace(decay=0.9))
    with pytest.warns(jxs.CompositionWarning, match="also run on skipped steps"):
        scaled_grads(tx)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: ds(jxs.accumulate(optax.sgd(0.1), 2)), "other way round"),
        (lambda: ds(ds()), "nested inside another"),
    ],
)
@pytest.mark.unit
def test_wrong_inner_raises_at_init(make, match):
    with pytest.raises(ValueError, match=match):
        make().init(params())


@pytest.mark.unit
def test_multisteps_as_inner_says_use_accumulate():
    with pytest.raises(TypeError, match=r"jxs.accumulate\(jxs.dynamic_scaling"):
        jxs.dynamic_scaling(optax.MultiSteps(optax.sgd(0.1), 2))


@pytest.mark.unit
def test_number_as_loss_scale_suggests_static_loss_scale():
    with pytest.raises(
        TypeError, match=r"`loss_scale`.*StaticLossScale.create\(1024.0\)"
    ):
        jxs.value_and_grad(loss_fn, 1024.0)


@pytest.mark.core
def test_clip_before_would_have_trained_wrong():
    """What the check prevents: clipping scaled gradients stalls training."""
    tx = optax.chain(optax.clip_by_global_norm(1.0), ds(optax.sgd(0.1)))
    state = tx.init(params())
    # The state's own update still runs (the check is in value_and_grad and
    # loss_scale_of): with gradients of a loss scaled by 2**16, clipping leaves
    # 1/2**16 of the intended step.
    grads = jax.tree.map(lambda g: g * 2.0**16, jax.grad(loss_fn)(params()))
    updates, _ = tx.update(grads, state, params())
    assert float(optax.tree.norm(updates)) < 1e-5


@pytest.mark.core
def test_the_guide_nesting_runs_silently_and_schedules_count_applied_steps():
    """docs/composition.md's recommended nesting, executed as written."""
    import pathlib
    import re

    guide = pathlib.Path(__file__).resolve().parents[1] / "docs" / "composition.md"
    (block,) = re.findall(r"```python\n(.*?)```", guide.read_text(), re.S)
    scope = {}
    exec(block, scope)  # noqa: S102 - our own documentation
    tx = scope["tx"]
    p = params()
    with warnings.catch_warnings(), jax.numpy_dtype_promotion("standard"):
        warnings.simplefilter("error")
        state = tx.init(p)
        step = jax.jit(lambda p, s, g: tx.update(g, s, p)[1])
        _, grads = jxs.value_and_grad(loss_fn, state)(p)
        bad = jax.tree.map(lambda g: g * jnp.inf, grads)
        for g in [grads] * 4 + [bad] * 4:  # one applied window, one skipped
            state = step(p, state, g)
    inner = state.inner_state  # accumulate -> dynamic_scaling
    assert int(inner.steps) == 2 and int(inner.skipped_steps) == 1
    injected = inner.inner_state[1]
    assert int(injected.count) == 1  # the skipped window did not advance it
