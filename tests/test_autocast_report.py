"""jxs.diagnostics.autocast_report: the census of what autocast did (per primitive, per
source, bytes per dtype), the float32 islands, the constants and norm-rule
decisions with their sources, the comparison with float32, and bad input.

Models are tiny: the census runs under ``jax.eval_shape`` and the comparison
eagerly, operation by operation.
"""

import re
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from helpers import jaxprs_in_params
from jax import lax

from jaxscale._autocast.entry import autocast as jxs_autocast
from jaxscale.diagnostics._autocast_report import (
    AutocastReport,
    AutocastSite,
    autocast_report,
)

pytestmark = pytest.mark.integration

nn = pytest.importorskip("flax.linen")
nnx = pytest.importorskip("flax.nnx")

# The table before the norm rule covered mul and div (and without the bias rule).
OLD = {"add": "promote", "sub": "promote", "mul": "promote", "div": "promote"}
HERE = Path(__file__).name


def first_order_eqns(jaxpr):
    """The first-order equations of a jaxpr and of its sub-jaxprs."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    out = []
    for eqn in jaxpr.eqns:
        subs = list(jaxprs_in_params(eqn.params))
        if subs:
            for sub in subs:
                out += first_order_eqns(sub)
        else:
            out.append(eqn)
    return out


def total(counts):
    return sum(n for row in counts.values() for n in row.values())


# --------------------------------------------------------------------------- #
# Islands: a BatchNorm CNN
# --------------------------------------------------------------------------- #


class CNN(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Conv(8, (3, 3))(x)
        x = nn.BatchNorm(use_running_average=False)(x)
        x = nn.max_pool(nn.relu(x), (2, 2), (2, 2))
        return nn.Dense(10)(x.reshape(x.shape[0], -1))


@pytest.fixture(scope="module")
def cnn():
    model = CNN()
    x = jax.random.normal(jax.random.key(0), (2, 8, 8, 3))
    variables = jax.eval_shape(model.init, jax.random.key(1), x)  # shapes will do

    def loss(variables, x):
        logits, _ = model.apply(variables, x, mutable=["batch_stats"])
        return jnp.mean(jax.nn.logsumexp(logits, axis=-1))

    return loss, variables, x


def test_batchnorm_islands_with_old_rules_and_none_by_default(cnn):
    loss, variables, x = cnn
    old = autocast_report(loss, rules=OLD)(variables, x)
    assert old.min_size == 2 * 8 * 8 * 8 // 16  # the conv's output / 16
    bn = [s for s in old.islands if s.source == "CNN/BatchNorm_0"]
    assert bn, old
    assert {s.primitive for s in bn} >= {"mul", "add"}
    for s in bn:
        assert s.location.startswith("flax/linen/normalization.py:"), s
        assert (s.shape, s.dtype) == ((2, 8, 8, 8), "float32")
    # The island goes on through ReLU and pooling, up to the Dense layer.
    assert {"max", "reduce_window_max"} <= {s.primitive for s in old.islands}
    assert all(s.source != "CNN/Dense_0" for s in old.islands)
    first = old.islands[0]
    assert first.note.startswith("float16 widened by f32[1,1,1,8]"), first
    assert all(s.dtype == "float32" for s in old.islands)
    assert not old.norms

    new = autocast_report(loss)(variables, x)
    assert new.islands == ()
    norms = [s for s in new.norms if s.source == "CNN/BatchNorm_0"]
    assert {s.primitive for s in norms} >= {"sub", "mul", "add"}
    assert all(s.dtype == "float16" for s in norms)
    assert all(s.location.startswith("flax/linen/normalization.py:") for s in norms)
    note = (
        "float32 statistic or parameter applied to a float16 activation: "
        "cast to float16, saturating"
    )
    assert all(s.note == note for s in norms), norms
    # The norm rule casts the statistics and parameters to float16: the three
    # operations on the activation ran in float16, the statistics in float32.
    assert new.by_source["CNN/BatchNorm_0"]["float16"] == len(norms) == 3
    assert new.by_source["CNN/BatchNorm_0"]["float32"] > 0
    assert new.bytes_by_dtype["float16"] > old.bytes_by_dtype["float16"]
    assert new.bytes_by_dtype["float32"] < old.bytes_by_dtype["float32"]
    text = str(new)
    assert "float32 islands (outputs of >= 64 elements):\n  none" in text
    assert "norm rule (float32 statistic or parameter cast to float16):" in text
    assert "CNN/BatchNorm_0" in str(old).split("float32 islands")[1]


def test_min_size_filters_islands(cnn):
    loss, variables, x = cnn
    everything = autocast_report(loss, rules=OLD, min_size=1)(variables, x)
    nothing = autocast_report(loss, rules=OLD, min_size=10**6)(variables, x)
    assert len(everything.islands) > len(
        autocast_report(loss, rules=OLD)(variables, x).islands
    )
    assert nothing.islands == () and nothing.min_size == 10**6


def test_island_through_a_loop_carry():
    def f(w, x):
        def body(h, _):
            return jnp.tanh(h @ w), None

        h, _ = lax.scan(body, x, None, length=3)  # carried at its float32
        return jnp.sum(jnp.sin(h))

    w, x = jnp.eye(4), jnp.ones((8, 4))
    report = autocast_report(f)(w, x)
    assert [(s.primitive, s.note) for s in report.islands] == [
        ("scan", "float16 loop carry kept in float32"),
        ("sin", "from an island"),
    ]


# --------------------------------------------------------------------------- #
# Constants
# --------------------------------------------------------------------------- #


class Attention(nn.Module):
    @nn.compact
    def __call__(self, x, tok):
        mask = nn.make_attention_mask(tok > 0, tok > 0)
        return nn.MultiHeadDotProductAttention(num_heads=2)(x, x, mask=mask)


def test_flax_attention_masks_16_bit_scores_with_a_saturated_constant():
    """Flax's attention scores (its query scaled before the product) reach the
    mask in float16, as a hand-cast step's do: its ``finfo(float32).min`` is
    saturated to float16's finite range and the mask applies in float16. With
    ``"wide"`` (float32 scores) the mask applies in float32 and no constant
    needs saturating."""
    tok = jnp.array([[3, 1, 4, 0, 0], [5, 9, 2, 6, 0]], jnp.int32)
    x = jax.random.normal(jax.random.key(0), (2, 5, 16))
    model = Attention()
    variables = jax.eval_shape(model.init, jax.random.key(1), x, tok)
    report = autocast_report(model.apply)(variables, x, tok)
    (site,) = report.constants
    assert site.primitive == "select_n" and "saturated" in site.note
    assert report.islands == ()
    assert dict(report.by_primitive["select_n"]) == {"float16": 1}
    wide = autocast_report(model.apply, rules={"dot_general": "wide"})
    report = wide(variables, x, tok)
    assert report.constants == ()
    assert report.islands == ()
    assert dict(report.by_primitive["select_n"]) == {"float32": 1}


class MaskedPool(nn.Module):
    @nn.compact
    def __call__(self, x, tok):
        h = nn.Dense(16)(x)
        h = jnp.where((tok > 0)[..., None], h, jnp.finfo(jnp.float32).min)
        return nn.Dense(4)(h.max(axis=1))


def test_a_mask_on_a_float16_activation_is_saturated():
    tok = jnp.array([[3, 1, 4, 0, 0], [5, 9, 2, 6, 0]], jnp.int32)
    x = jax.random.normal(jax.random.key(0), (2, 5, 16))
    model = MaskedPool()
    variables = jax.eval_shape(model.init, jax.random.key(1), x, tok)
    report = autocast_report(model.apply)(variables, x, tok)
    (site,) = report.constants
    assert site.note == (
        "constant -3.40282e+38 overflows to inf in float16: saturated to the "
        "finite range"
    )
    assert site.primitive == "select_n"
    assert site.source == "MaskedPool"
    assert re.fullmatch(rf".*{HERE}:\d+", site.location), site
    assert (site.shape, site.dtype) == ((2, 5, 16), "float16")
    assert "saturated to the finite range" in str(report)
    # finfo(float32).min is beyond bfloat16's range too (by 0.4%).
    (site,) = autocast_report(model.apply, "bf16")(variables, x, tok).constants
    assert site.note.startswith("constant -3.40282e+38 overflows to inf in bfloat16")


def test_epsilon_that_rounds_to_zero_runs_in_float32():
    def loss(w, x):
        p = jax.nn.sigmoid(x @ w)
        return -jnp.mean(jnp.log(p + 1e-8))

    report = autocast_report(loss)(jnp.ones((3, 2)), jnp.ones((4, 3)))
    (site,) = report.constants
    assert site.note == "constant 1e-08 rounds to 0 in float16: runs in float32"
    assert (site.primitive, site.shape, site.dtype) == ("add", (4, 2), "float32")
    assert re.fullmatch(rf".*{HERE}:\d+", site.location), site
    assert site.source == site.location  # no module path: file:line


# --------------------------------------------------------------------------- #
# The census
# --------------------------------------------------------------------------- #


def mlp(params, x):
    h = jax.nn.relu(x @ params["w1"] + params["b1"][None])
    return jax.nn.softmax(h @ params["w2"] + params["b2"][None])


MLP_PARAMS = {
    "w1": jnp.ones((4, 8)),
    "b1": jnp.zeros(8),
    "w2": jnp.ones((8, 3)),
    "b2": jnp.zeros(3),
}


def test_mlp_softmax_counts_every_equation_once():
    x = jnp.ones((2, 4))
    report = autocast_report(mlp)(MLP_PARAMS, x)
    assert dict(report.by_primitive["dot_general"]) == {"float16": 2}
    assert dict(report.by_primitive["reduce_sum"]) == {"float32": 1}
    assert dict(report.by_primitive["exp"]) == {"float32": 1}
    eqns = first_order_eqns(jax.make_jaxpr(mlp)(MLP_PARAMS, x))
    assert report.operations == len(eqns) == total(report.by_primitive)
    assert total(report.by_source) == len(eqns)
    names = sorted(e.primitive.name for e in eqns)
    assert (
        sorted(
            name
            for name, row in report.by_primitive.items()
            for _ in range(sum(row.values()))
        )
        == names
    )
    assert isinstance(report, AutocastReport)
    assert repr(report).startswith(f"AutocastReport(float16: {len(eqns)} operations")


def test_bytes_by_dtype_exact():
    def f(w, x):
        return jnp.sum(jnp.tanh(x @ w))  # f16[4,2] (dot), f16[4,2] (tanh), f32[]

    report = autocast_report(f)(jnp.ones((3, 2)), jnp.ones((4, 3)))
    assert dict(report.bytes_by_dtype) == {"float16": 2 * 16, "float32": 4}
    assert dict(report.by_primitive) == {
        "dot_general": {"float16": 1},
        "reduce_sum": {"float32": 1},
        "tanh": {"float16": 1},
    }
    bf16 = autocast_report(f, "bf16")(jnp.ones((3, 2)), jnp.ones((4, 3)))
    assert dict(bf16.bytes_by_dtype) == {"bfloat16": 32, "float32": 4}
    off = autocast_report(f, jnp.float32)(jnp.ones((3, 2)), jnp.ones((4, 3)))
    assert dict(off.bytes_by_dtype) == {"float32": 2 * 32 + 4}
    assert off.islands == () and off.dtype == "float32"


def test_nested_constructs_are_counted_per_equation():
    @jax.jit
    def block(h, w):
        return jnp.tanh(h @ w) + h

    def f(w, x):
        h = block(block(x, w), w)  # one jaxpr, two call sites: counted twice
        h, ys = lax.scan(lambda c, _: (jax.nn.relu(c @ w), c.sum()), h, None, 3)
        h = lax.cond(ys[0] > 0, lambda h: h * 3.0, jnp.sin, h)
        h = jax.checkpoint(lambda h: jnp.cos(h @ w))(h)
        _, h = lax.while_loop(
            lambda c: c[0] < 2, lambda c: (c[0] + 1, jnp.cos(c[1] @ w)), (0, h)
        )
        return jax.nn.log_softmax(h).sum()

    w, x = jnp.eye(4) * 0.5, jnp.ones((2, 4))
    report = autocast_report(f)(w, x)
    eqns = first_order_eqns(jax.make_jaxpr(f)(w, x))
    assert report.operations == len(eqns) == total(report.by_primitive)
    assert dict(report.by_primitive["dot_general"]) == {"float16": 5}
    assert dict(report.by_primitive["tanh"]) == {"float16": 2}


def test_abstract_arguments_and_nnx_modules_untouched():
    f = lambda w, x: jnp.sum(jnp.tanh(x @ w))  # noqa: E731
    big = [jax.ShapeDtypeStruct((8192, 8192), jnp.float32)] * 2
    report = autocast_report(f)(*big)  # nothing allocated: 256 MiB per array
    assert report.bytes_by_dtype["float16"] == 2 * 2 * 8192 * 8192

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(4, 8, rngs=rngs)
            self.bn = nnx.BatchNorm(8, rngs=rngs)

        def __call__(self, x):
            return nnx.relu(self.bn(self.lin(x)))

    net = nnx.eval_shape(lambda: Net(nnx.Rngs(0)))  # an abstract module
    x = jax.ShapeDtypeStruct((16, 4), jnp.float32)
    report = autocast_report(lambda n, x: jnp.mean(n(x)))(net, x)
    assert dict(report.by_primitive["dot_general"]) == {"float16": 1}
    assert report.islands == ()
    # NNX modules run under their paths while traced (jaxscale._nnx_names).
    assert {"lin", "bn"} <= set(report.by_source)

    # The eager comparison runs a copy: the module keeps its statistics.
    bn = nnx.BatchNorm(4, rngs=nnx.Rngs(0))
    stats = jax.tree.leaves(nnx.state(bn, nnx.BatchStat))
    x = jnp.linspace(0.0, 1.0, 32).reshape(8, 4)
    report = autocast_report(lambda n, x: jnp.mean(n(x)), compare=True)(bn, x)
    assert report.deviation
    after = jax.tree.leaves(nnx.state(bn, nnx.BatchStat))
    assert all(a is b for a, b in zip(stats, after, strict=True))


# --------------------------------------------------------------------------- #
# Comparison with float32
# --------------------------------------------------------------------------- #


def test_compare_ranks_an_overflowing_matmul_first():
    def f(w, x):
        y = x @ w  # also used by a matmul: not widened, so float16
        return jnp.mean(jnp.exp(1e-4 * y)), y @ w

    w, x = jnp.full((4, 4), 200.0), jnp.full((2, 4), 100.0)  # x @ w = 80000
    report = autocast_report(f, compare=True)(w, x)
    worst = report.deviation[0]
    assert isinstance(worst, AutocastSite)
    assert (worst.primitive, worst.nonfinite, worst.local_error) == (
        "dot_general",
        8,
        float("inf"),
    )
    assert re.fullmatch(rf".*{HERE}:\d+", worst.location)
    # What follows inherits the inf, but loses nothing itself.
    rest = {s.primitive: s for s in report.deviation[1:]}
    assert rest["exp"].nonfinite == 8 and rest["exp"].local_error == 0.0
    assert "deviation from float32" in str(report)


@pytest.mark.usefixtures("on_cpu")  # XLA:GPU sums float16 in float32 (excess precision)
def test_compare_ranks_a_float16_sum_first():
    def f(w, x):
        return jnp.tanh(jnp.sum(x @ w, axis=1) / 1024.0)

    x = jax.random.uniform(jax.random.key(0), (8, 16))
    w = jax.random.uniform(jax.random.key(1), (16, 1024))
    report = autocast_report(f, rules={"reduce_sum": "keep"}, compare=True)(w, x)
    assert dict(report.by_primitive["reduce_sum"]) == {"float16": 1}
    worst = report.deviation[0]
    assert worst.primitive == "reduce_sum", report
    # By how much depends on XLA's summation order (1.9x the next site's error
    # on jax 0.7.0, 4.1x on 0.10.2 and 0.12.0.1).
    assert worst.local_error > 1.5 * report.deviation[1].local_error
    # Under the default rules the sum is float32 and adds (almost) nothing.
    default = autocast_report(f, compare=True)(w, x)
    (site,) = [s for s in default.deviation if s.primitive == "reduce_sum"]
    assert site.local_error < 1e-6
    assert default.deviation[0].primitive != "reduce_sum"


def test_compare_inside_jit_and_custom_jvp_but_not_inside_loops():
    @jax.jit
    def inner(h, w):
        return jax.nn.relu(h @ w)

    def f(w, x):
        h = inner(x, w)
        h, _ = lax.scan(lambda c, _: (jnp.tanh(c @ w), None), h, None, 2)
        return jnp.sum(h)

    w, x = jnp.eye(4), jnp.linspace(-1, 1, 8).reshape(2, 4)
    report = autocast_report(f, compare=True)(w, x)
    compared = sorted(s.primitive for s in report.deviation)
    assert compared == ["dot_general", "max", "reduce_sum"]  # not the scan body
    assert all(s.rel_error < 1e-2 for s in report.deviation)


def test_compare_does_not_count_a_saturated_mask_as_an_error():
    def f(s, m):
        return jax.nn.softmax(jnp.where(m, s @ s.T, jnp.finfo(jnp.float32).min))

    s = jax.random.normal(jax.random.key(0), (4, 4))
    report = autocast_report(f, compare=True)(s, jnp.tri(4, dtype=bool))
    (select,) = [d for d in report.deviation if d.primitive == "select_n"]
    assert select.rel_error < 1e-2 and select.local_error < 1e-2
    assert select.nonfinite == 0


# --------------------------------------------------------------------------- #
# Bad input
# --------------------------------------------------------------------------- #


def test_bad_input():
    with pytest.raises(TypeError, match="`fun` must be callable"):
        autocast_report(3)
    with pytest.raises(ValueError, match="`dtype` must be"):
        autocast_report(jnp.sin, jnp.int8)
    with pytest.raises(ValueError, match="float8"):
        autocast_report(jnp.sin, jnp.float8_e4m3fn)
    with pytest.raises(ValueError, match="rules"):
        autocast_report(jnp.sin, rules={"sin": "fast"})
    with pytest.raises(TypeError, match="`compare` must be a Python bool"):
        autocast_report(jnp.sin, compare="yes")
    with pytest.raises(TypeError, match="`min_size` must be an int"):
        autocast_report(jnp.sin, min_size=1.5)
    with pytest.raises(ValueError, match="`min_size` must be >= 1, got 0"):
        autocast_report(jnp.sin, min_size=0)
    fn = autocast_report(jnp.sin, compare=True)
    with pytest.raises(TypeError, match="outside `jax.jit`"):
        jax.jit(fn)(jnp.ones(2))
    with pytest.raises(TypeError, match="ShapeDtypeStruct"):
        fn(jax.ShapeDtypeStruct((2,), jnp.float32))


# --------------------------------------------------------------------------- #
# The guide
# --------------------------------------------------------------------------- #


def test_the_guide_runs_as_written(capsys):
    """docs/autocast_report.md: its ``python`` blocks run in order as one file,
    ``example.py`` (a blank line between blocks), print what its ``text`` blocks
    show, up to Flax's line numbers and the column widths they change."""
    text = (
        Path(__file__).resolve().parents[1] / "docs" / "autocast_report.md"
    ).read_text()
    blocks = re.findall(r"^```python\n(.*?)^```", text, re.M | re.S)
    shown = re.findall(r"^```text\n(.*?)^```", text, re.M | re.S)
    assert len(blocks) == len(shown) == 5
    scope, offset = {}, 0
    with jax.numpy_dtype_promotion("standard"):  # as users run it
        for block in blocks:
            exec(compile("\n" * offset + block, "example.py", "exec"), scope)
            offset += block.count("\n") + 1
    printed = capsys.readouterr().out

    def normal(s):
        s = re.sub(r"(flax/\S+\.py):[\d,]+", r"\1:N", s)
        return [" ".join(line.split()) for line in s.splitlines()]

    assert normal(printed) == normal("".join(shown))


def test_report_of_a_gradient_names_forward_and_backward():
    def loss(params, x):
        with jax.named_scope("mlp"):
            return jnp.mean(mlp(params, x))

    grad = jax.grad(jxs_autocast(loss, gradient_dtype=jnp.float16))
    report = autocast_report(grad)(MLP_PARAMS, jnp.ones((2, 4)))
    # Two forward products, three backward (two weights, one activation). The
    # last layer's product feeds the softmax: it comes out in float32 from a
    # custom_jvp whose backward is float16 (the widening rule); the report
    # counts the product inside it.
    assert dict(report.by_primitive["dot_general"]) == {"float16": 2 + 3}
    assert "custom_jvp_call" not in report.by_primitive
    assert {"jvp(mlp)", "transpose(jvp(mlp))"} <= set(report.by_source)
    assert report.islands == report.constants == report.norms == ()


def test_island_notes_say_what_widened_the_activation():
    """The first operation of an island names its float32 operand by what it
    is: a table computed in float32 and broadcast (RoPE's cos), a loop carry
    kept at its traced float32, a float32 input."""

    def rope(w, x):
        h = x @ w
        t = jnp.arange(8.0)[:, None] * jnp.arange(16.0)[None, :]
        return (h * jnp.cos(t)[None]) @ w

    (first, *_) = autocast_report(rope)(
        jnp.ones((16, 16)), jnp.ones((4, 8, 16))
    ).islands
    assert first.primitive == "mul"
    assert first.note == (
        "float16 widened by f32[1,8,16], a float32 value made by `cos` broadcast "
        "to its shape, computed from more than parameters and constants (from "
        "positions, as a RoPE table, or from an activation); passed in as an "
        "argument it would be cast"
    )

    def scanned(w, x):
        def body(c, _):
            return c + jnp.tanh(c @ w), None

        return lax.scan(body, x, None, length=3)[0]

    (first, *_) = autocast_report(scanned)(
        jnp.ones((16, 16)), jnp.ones((4, 16))
    ).islands
    assert first.primitive == "add"
    assert first.note.endswith("a loop carry kept at its traced float32"), first

    def residual(w, x, r):
        return jax.nn.relu(x @ w + r) @ w

    args = jnp.ones((16, 16)), jnp.ones((4, 16)), jnp.ones((4, 16))
    (first, *_) = autocast_report(residual)(*args).islands
    assert first.note == "float16 widened by f32[4,16], a float32 parameter or input"
