"""jxs.Policy and jxs.cast_floating: parsing, casting only floating leaves, NNX,
composition with loss scaling (and with jxs.autocast once it exists)."""

import functools
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import jaxprs_in_params

import jaxscale as jxs

DOCS = Path(__file__).resolve().parents[1] / "docs"
F16, BF16, F32 = np.dtype("float16"), np.dtype(jnp.bfloat16), np.dtype("float32")


# --------------------------------------------------------------------------- #
# Parsing
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("params=float32,compute=float16,output=float32", (F32, F16, F32)),
        ("p=f32,c=bf16,o=f32", (F32, BF16, F32)),
        ("param=full,compute=half,out=single", (F32, F16, F32)),
        (" Params = F32 , Compute=BF16 ", (F32, BF16, F32)),
        ("compute=f16", (F32, F16, F32)),  # missing keys: float32
        ("params=fp32,compute=fp16", (F32, F16, F32)),  # torch-style aliases
        ("o=f16", (F32, F32, F16)),
        ("bfloat16", (BF16, BF16, BF16)),  # one dtype: all three
        ("f16", (F16, F16, F16)),
        ("compute=float8_e4m3fn", (F32, np.dtype(jnp.float8_e4m3fn), F32)),
    ],
)
@pytest.mark.unit
def test_from_string(spec, expected):
    policy = jxs.Policy.from_string(spec)
    got = (policy.param_dtype, policy.compute_dtype, policy.output_dtype)
    assert got == expected
    assert all(isinstance(d, np.dtype) for d in got)


@pytest.mark.parametrize(
    "policy",
    [
        jxs.Policy(),
        jxs.Policy(compute_dtype=jnp.float16),
        jxs.Policy(jnp.bfloat16, "f16", np.float32),
    ],
)
@pytest.mark.unit
def test_str_round_trips(policy):
    assert jxs.Policy.from_string(str(policy)) == policy
    assert re.fullmatch(r"params=\w+,compute=\w+,output=\w+", str(policy))


@pytest.mark.unit
def test_constructor_takes_dtypes_and_names():
    a = jxs.Policy(compute_dtype=jnp.float16)
    b = jxs.Policy(param_dtype="float32", compute_dtype="f16", output_dtype=F32)
    c = jxs.Policy(np.float32, np.dtype("float16"), jnp.dtype("float32"))
    assert a == b == c
    assert hash(a) == hash(b) == hash(c)
    assert repr(a) == (
        "Policy(param_dtype=float32, compute_dtype=float16, output_dtype=float32)"
    )
    assert jxs.Policy() == jxs.Policy.from_string("float32")


@pytest.mark.parametrize(
    "spec, match",
    [
        ("params=float32,compute=fp8", r"`compute` must be a floating dtype.*'fp8'"),
        (
            "c=int8",
            r"`c` must be a floating dtype: float16 \(f16, fp16, half\).*'int8'",
        ),
        ("compute=float", r"`compute` must be a floating dtype.*'float'"),
        ("weights=f32", r"Unknown key 'weights'.*params \(param, p\), compute \(c\)"),
        ("p=f32,params=f16", r"sets params twice \(key 'params'\)"),
        ("f16,c=f32", r"`key=dtype`.*the entry 'f16'"),
        ("", r"must name at least one dtype"),
        (" , ", r"must name at least one dtype"),
        ("c=", r"`c` must be a floating dtype.*got ''"),
        ("half-precision", r"`spec` must be a floating dtype.*'half-precision'"),
        ("mixed_float16", r"Keras policy name.*compute=float16,output=float32"),
    ],
)
@pytest.mark.unit
def test_from_string_rejects(spec, match):
    with pytest.raises(ValueError, match=match):
        jxs.Policy.from_string(spec)


@pytest.mark.unit
def test_from_string_rejects_non_strings():
    with pytest.raises(TypeError, match=r"`spec` must be a string.*got 16"):
        jxs.Policy.from_string(16)


@pytest.mark.parametrize("bad", [jnp.int32, "int8", "e", None, 16, True, "complex64"])
@pytest.mark.unit
def test_constructor_rejects_non_floating(bad):
    with pytest.raises(ValueError, match=r"`compute_dtype` must be a floating dtype"):
        jxs.Policy(compute_dtype=bad)
    with pytest.raises(ValueError, match=r"`dtype` must be a floating dtype"):
        jxs.cast_floating(jnp.ones(2), bad)


@pytest.mark.unit
def test_policy_is_a_static_argument():
    traces = []

    @functools.partial(jax.jit, static_argnums=1)
    def step(x, policy):
        traces.append(1)
        return policy.cast_to_output(policy.cast_to_compute(x) * 2)

    out = step(jnp.ones(2), jxs.Policy(compute_dtype="f16", output_dtype="f32"))
    step(jnp.ones(2), jxs.Policy.from_string("c=f16"))  # equal: no retrace
    assert out.dtype == F32 and len(traces) == 1
    step(jnp.ones(2), jxs.Policy.from_string("c=bf16"))
    assert len(traces) == 2


# --------------------------------------------------------------------------- #
# Casting
# --------------------------------------------------------------------------- #


def _mixed_tree():
    return {
        "w32": jnp.linspace(-2.0, 2.0, 5),
        "w16": jnp.array([0.5, -1.5], jnp.float16),
        "wbf": jnp.array([3.0], jnp.bfloat16),
        "step": jnp.int32(7),
        "mask": jnp.array([True, False]),
        "key": jax.random.key(0),
        "raw_key": jax.random.PRNGKey(1),
        "complex": jnp.array([1 + 2j], jnp.complex64),
        "none": None,
        "lr": 0.5,
        "np": np.array([1.0, 2.0], np.float32),
    }


@pytest.mark.parametrize("dtype", [F16, BF16, F32])
@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.unit
def test_cast_floating_casts_only_floating_leaves(dtype, jit):
    tree = _mixed_tree()
    untouched = ("step", "mask", "raw_key", "complex")
    if jit:
        static = {k: tree.pop(k) for k in ("lr", "np", "none")}
        out = jax.jit(lambda t: jxs.cast_floating(t, dtype))(tree)
        tree.update(static)
        out.update(jxs.cast_floating(static, dtype))
    else:
        out = jxs.cast_floating(tree, dtype)
    assert jax.tree.structure(out) == jax.tree.structure(tree)
    for k in ("w32", "w16", "wbf"):
        assert out[k].dtype == dtype
        np.testing.assert_array_equal(
            np.asarray(out[k], np.float32),
            np.asarray(tree[k].astype(dtype), np.float32),
        )
    for k in untouched:
        assert out[k].dtype == tree[k].dtype
        np.testing.assert_array_equal(out[k], tree[k])
    assert out["key"].dtype == tree["key"].dtype
    np.testing.assert_array_equal(
        jax.random.key_data(out["key"]), jax.random.key_data(tree["key"])
    )
    assert out["none"] is None and out["lr"] == 0.5 and isinstance(out["lr"], float)
    assert isinstance(out["np"], np.ndarray) and out["np"].dtype == dtype


@pytest.mark.unit
def test_cast_floating_returns_leaves_already_in_dtype_as_they_are():
    tree = {"a": jnp.ones(2, jnp.float16), "b": jnp.ones(2)}
    out = jxs.cast_floating(tree, "f16")
    assert out["a"] is tree["a"] and out["b"].dtype == F16
    jaxpr = jax.make_jaxpr(lambda t: jxs.cast_floating(t, "f16"))(tree)
    converts = [e for e in jaxpr.eqns if e.primitive.name == "convert_element_type"]
    assert len(converts) == 1  # only "b"


@pytest.mark.unit
def test_cast_floating_on_abstract_shapes():
    shapes = jax.eval_shape(lambda: {"w": jnp.ones((2, 3)), "n": jnp.int32(0)})
    out = jxs.cast_floating(shapes, jnp.bfloat16)
    assert out["w"] == jax.ShapeDtypeStruct((2, 3), jnp.bfloat16)
    assert out["n"] is shapes["n"]


@pytest.mark.parametrize(
    "method, field",
    [
        ("cast_to_param", "param_dtype"),
        ("cast_to_compute", "compute_dtype"),
        ("cast_to_output", "output_dtype"),
    ],
)
@pytest.mark.unit
def test_policy_methods_cast_to_their_field(method, field):
    policy = jxs.Policy("bf16", "f16", "f32")
    tree = _mixed_tree()
    out = getattr(policy, method)(tree)
    expected = jxs.cast_floating(tree, getattr(policy, field))

    def dtypes(t):
        return jax.tree.map(lambda x: getattr(x, "dtype", type(x)), t)

    assert dtypes(out) == dtypes(expected)
    assert out["w32"].dtype == getattr(policy, field)
    assert out["step"] is tree["step"] and out["key"] is tree["key"]


# --------------------------------------------------------------------------- #
# Flax
# --------------------------------------------------------------------------- #


@pytest.mark.integration
def test_nnx_state_variables_and_modules():
    nnx = pytest.importorskip("flax.nnx")
    model = nnx.Sequential(
        nnx.Linear(3, 4, rngs=nnx.Rngs(0)),
        nnx.BatchNorm(4, rngs=nnx.Rngs(0)),
        nnx.Dropout(0.5, rngs=nnx.Rngs(1)),
    )
    state = nnx.state(model)
    cast = jxs.cast_floating(state, jnp.float16)
    assert type(cast) is type(state)
    kinds = {}
    for _, var in nnx.to_flat_state(cast):
        kind = type(var).__name__
        kinds[kind] = kinds.get(kind, set()) | {str(var[...].dtype)}
    assert kinds["Param"] == {"float16"} and kinds["BatchStat"] == {"float16"}
    assert kinds["RngCount"] == {"uint32"} and kinds["RngKey"] == {"key<fry>"}

    # Parameters only, through the policy: BatchNorm statistics stay float32.
    policy = jxs.Policy(compute_dtype=jnp.float16)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    half = nnx.merge(graphdef, policy.cast_to_compute(params), rest)
    assert half.layers[0].kernel[...].dtype == F16
    assert half.layers[1].mean[...].dtype == F32
    assert model.layers[0].kernel[...].dtype == F32  # original untouched

    # A Variable and a whole module are pytrees too.
    kernel = jxs.cast_floating(model.layers[0].kernel, jnp.bfloat16)
    assert isinstance(kernel, nnx.Param) and kernel[...].dtype == BF16
    module = jxs.cast_floating(model, jnp.bfloat16)
    assert module.layers[0].kernel[...].dtype == BF16
    assert module.layers[2].rngs.count[...].dtype == np.uint32


@pytest.mark.core
def test_linen_params():
    nn = pytest.importorskip("flax.linen")
    model = nn.Sequential([nn.Dense(4), nn.relu, nn.Dense(2)])
    params = model.init(jax.random.key(0), jnp.ones((1, 3)))
    policy = jxs.Policy.from_string("p=f32,c=bf16,o=f32")
    y = policy.cast_to_output(
        model.apply(policy.cast_to_compute(params), policy.cast_to_compute(jnp.ones(3)))
    )
    assert y.dtype == F32
    dtypes = {x.dtype for x in jax.tree.leaves(policy.cast_to_compute(params))}
    assert dtypes == {BF16}


# --------------------------------------------------------------------------- #
# Composition
# --------------------------------------------------------------------------- #


def _mlp(params, x):
    h = jax.nn.relu(x @ params["w1"] + params["b1"][None])
    return jnp.mean((h @ params["w2"]) ** 2)


@pytest.mark.core
def test_policy_with_loss_scaling_gives_param_dtype_gradients():
    policy = jxs.Policy.from_string("params=float32,compute=float16,output=float32")
    keys = jax.random.split(jax.random.key(0), 2)
    params = {
        "w1": jax.random.normal(keys[0], (3, 8)),
        "b1": jnp.zeros(8),
        "w2": jax.random.normal(keys[1], (8, 1)),
    }
    x = jnp.ones((4, 3))

    def loss_fn(p, x):
        out = _mlp(policy.cast_to_compute(p), policy.cast_to_compute(x))
        assert out.dtype == F16
        return policy.cast_to_output(out)

    tx = jxs.dynamic_scaling(optax.sgd(0.1), jxs.DynamicLossScale.create(2.0**8))
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state):
        loss, grads = jxs.value_and_grad(loss_fn, opt_state)(params, x)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, grads

    new, new_state, loss, grads = step(params, opt_state)
    assert bool(jxs.diagnostics.summary(new_state)["last_step_finite"])
    assert loss.dtype == F32
    assert {k: v.dtype for k, v in grads.items()} == {
        "w1": F32,
        "b1": F32,
        "w2": F32,
    }
    ref = jax.grad(_mlp)(params, x)
    scale = float(jxs.loss_scale_of(opt_state).loss_scale)
    np.testing.assert_allclose(grads["w2"] / scale, ref["w2"], rtol=2e-2, atol=1e-3)
    assert new["w1"].dtype == F32


def _dot_dtypes(jaxpr):
    """Operand dtypes of every dot_general in a jaxpr, nested jaxprs included."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            found.append(tuple(str(v.aval.dtype) for v in eqn.invars))
        for sub in jaxprs_in_params(eqn.params):
            found += _dot_dtypes(sub)
    return found


@pytest.mark.integration
def test_policy_composes_with_autocast():
    """Policy at the boundary (f32 params and output), autocast per op (f16 dots)."""
    policy = jxs.Policy.from_string("params=float32,compute=float16,output=float32")
    params = {"w1": jnp.ones((3, 8)) / 3, "b1": jnp.zeros(8), "w2": jnp.ones((8, 1))}
    x = jnp.ones((4, 3))

    def loss_fn(params, x):
        f = jxs.autocast(_mlp, dtype=policy.compute_dtype)
        return policy.cast_to_output(f(policy.cast_to_param(params), x))

    loss, grads = jax.jit(jax.value_and_grad(loss_fn))(params, x)
    dots = _dot_dtypes(jax.make_jaxpr(loss_fn)(params, x).jaxpr)
    assert dots and set(dots) == {("float16", "float16")}
    assert loss.dtype == F32
    assert {g.dtype for g in jax.tree.leaves(grads)} == {F32}
    np.testing.assert_allclose(loss, _mlp(params, x), rtol=1e-2)
    ref = jax.grad(_mlp)(params, x)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-2, atol=1e-3)


@pytest.mark.integration
def test_guide_snippets_run():
    text = (DOCS / "policy.md").read_text()
    blocks = re.findall(r"^```python\n(.*?)^```", text, re.MULTILINE | re.DOTALL)
    assert blocks
    for block in blocks:
        with jax.numpy_rank_promotion("allow"):  # the guide's `x @ w + b`
            exec(compile(block, "docs/policy.md", "exec"), {})
