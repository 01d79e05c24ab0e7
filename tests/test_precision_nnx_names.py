"""Flax NNX models' matmul sites are named by their module paths, in the sensor,
under a plan and in the monitor alike; the names change nothing else."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxscale as jxs
import jaxscale.precision as jxp
from jaxscale._autocast import entry

pytestmark = [pytest.mark.integration, pytest.mark.libraries]

nnx = pytest.importorskip("flax.nnx")

D = 8


class Attention(nnx.Module):
    def __init__(self, rngs):
        self.qkv = nnx.Linear(D, 3 * D, rngs=rngs)
        self.out = nnx.Linear(D, D, rngs=rngs)

    def __call__(self, x):
        q, k, v = jnp.split(self.qkv(x), 3, axis=-1)
        return self.out(q * k + v)


class Block(nnx.Module):
    def __init__(self, rngs):
        self.attn = Attention(rngs)
        self.up = nnx.Linear(D, 2 * D, rngs=rngs)
        self.down = nnx.Linear(2 * D, D, rngs=rngs)

    def __call__(self, x):
        x = x + self.attn(x)
        return x + self.down(jax.nn.relu(self.up(x)))


class GPT(nnx.Module):
    def __init__(self, rngs, layers=1):
        self.blocks = nnx.List([Block(rngs) for _ in range(layers)])
        self.head = nnx.Linear(D, 4, rngs=rngs)

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(self.blocks[0].up(x)[:, :D])  # `up` called twice


NAMES = [
    *(f"blocks/0/{n}" for n in ("attn/qkv", "attn/out", "up", "down")),
    "blocks/0/up#1",
    "head",
]


def model_and_batch():
    model = GPT(nnx.Rngs(0))
    return model, jax.random.normal(jax.random.key(1), (16, D))


def loss(model, x):
    return jnp.mean(model(x) ** 2)


def split(model):
    """``(params, loss of params)``: the model merged inside the loss."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def f(params, x):
        return loss(nnx.merge(graphdef, params, rest), x)

    return params, f


def site_names(fun, *args):
    """The sites as the sensor's first trace finds them (no step compiled)."""
    sensor = jxp.Sensor(fun)
    sensor._count(args, {})
    return list(sensor._order)


@pytest.fixture(scope="module")
def measured():
    model, x = model_and_batch()
    params, f = split(model)
    formats = (jxp.Format.HALF, jxp.Format.FLOAT32)
    return params, f, x, jxp.Sensor(f, formats=formats).update(params, x)


def test_sensor_names_nnx_sites_by_module_path(measured):
    params, f, x, sensor = measured
    assert [m.site for m in sensor.measures()] == NAMES  # merged inside `f`
    model, x = model_and_batch()
    assert site_names(loss, model, x) == NAMES  # the model as an argument
    assert site_names(lambda x: loss(model, x), x) == NAMES  # in a closure
    # Outside jaxscale's traces the classes are as they were.
    for cls in (nnx.Linear, GPT, Block, Attention):
        assert not hasattr(cls.__call__, "_jaxscale_named")


def dots(jaxpr):
    """The dtypes of the operands of every ``dot_general``, by name stack."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            found.append(
                (str(eqn.source_info.name_stack), {v.aval.dtype for v in eqn.invars})
            )
        for value in eqn.params.values():
            for sub in value if isinstance(value, tuple | list) else (value,):
                sub = getattr(sub, "jaxpr", sub)
                found += dots(sub) if hasattr(sub, "eqns") else []
    return found


def test_a_plan_edited_by_layer_name_applies_to_the_same_model(measured):
    params, f, x, sensor = measured
    half = {m.site: jxp.Format.HALF for m in sensor.measures()}

    def wide(formats):
        """The name stacks of the float32 products of ``f``'s gradient."""
        plan = jxp.Plan.from_formats(formats, sensor.measures(), cost="H100")
        run = jxs.autocast(f, jnp.bfloat16, plan=plan)
        found = dots(jax.make_jaxpr(jax.grad(run))(params, x).jaxpr)
        return plan, {w for w, d in found if d == {np.dtype(jnp.float32)}}

    plan, edited = wide({**half, "blocks/0/up": jxp.Format.FLOAT32})
    # That layer's forward and backward products, and only those.
    added = edited - wide(half)[1]
    assert len(added) == 2 and all(w.endswith(")/blocks/0/up") for w in added)
    # The monitor runs the plan by the same names.
    monitor = jxp.Monitor(plan, jnp.bfloat16)
    state = monitor.init()
    assert state.sites == tuple(NAMES)
    # (Traced only: a site the plan does not name would raise.)
    _, seen = jax.eval_shape(monitor.value_and_grad(f), params, x)
    assert seen.shape[0] == len(NAMES)


def test_names_change_no_value(measured, monkeypatch):
    """The same program, compiled the same way, with and without names."""
    params, f, x, _ = measured
    run = jxs.autocast(f, jnp.bfloat16)
    grad = jax.jit(jax.value_and_grad(run))
    named_text = str(jax.make_jaxpr(jax.value_and_grad(run))(params, x))
    named = grad(params, x)

    class Unnamed:
        def __enter__(self):
            return lambda args: None

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(entry, "named_modules", Unnamed)
    assert site_names(f, params, x) == [
        "(top level)",
        *(f"(top level)#{k}" for k in range(1, len(NAMES))),
    ]
    assert str(jax.make_jaxpr(jax.value_and_grad(run))(params, x)) == named_text
    plain = jax.jit(jax.value_and_grad(run))(params, x)
    for a, b in zip(jax.tree.leaves(named), jax.tree.leaves(plain), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


class ScannedGPT(nnx.Module):
    def __init__(self, rngs, layers=2):
        # A stack of `layers` blocks, as `nnx.vmap` makes it (cheaper here).
        graphdef, state = nnx.split(Block(rngs))
        stacked = jax.tree.map(lambda a: jnp.stack([a] * layers), state)
        self.blocks = nnx.merge(graphdef, stacked)
        self.head = nnx.Linear(D, 4, rngs=rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def body(x, block):
            return block(x)

        return self.head(body(x, self.blocks))


def test_a_scanned_stack_is_named_once():
    """By the paths inside one layer (``nnx.scan`` runs a copy of it)."""
    model = ScannedGPT(nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (16, D))
    assert site_names(loss, model, x) == [
        *("attn/qkv", "attn/out", "up", "down"),
        "head",
    ]


def test_linen_names_are_unchanged():
    class Linen(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(4, name="head")(nn.Dense(D, name="up")(x))

    m = Linen()
    x = jnp.ones((4, D))
    p = m.init(jax.random.key(0), x)
    sites = site_names(lambda p, x: jnp.mean(m.apply(p, x) ** 2), p, x)
    assert sites == ["Linen/up", "Linen/head"]


def test_a_method_that_calls_its_parents_is_named_once():
    class Scaled(nnx.Linear):
        def __call__(self, x):
            return 2.0 * super().__call__(x)

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.head = Scaled(D, 4, rngs=rngs)

        def __call__(self, x):
            return self.head(x)

    x = jnp.ones((4, D))
    assert site_names(loss, Net(nnx.Rngs(0)), x) == ["head"]
    assert not hasattr(Scaled.__call__, "_jaxscale_named")
