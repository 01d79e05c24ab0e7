"""``jxs.diagnostics.collective_report``: the collectives of a compiled step, read
from its optimized HLO on the suite's 8 CPU devices (``tests/conftest.py``).

The wire dtypes asserted are float16 and float32 only: XLA:CPU widens bfloat16 and
float8 collectives (docs/multidevice.md), XLA:GPU keeps them.
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxscale as jxs
from jaxscale import _hlo

N = 8
ROOT = Path(__file__).resolve().parents[1]
REPORT = jxs.diagnostics.CollectiveReport


@pytest.fixture(scope="module")
def mesh():
    return jax.sharding.Mesh(np.array(jax.devices("cpu")[:N]), ("data",))


def init_params(dtype=jnp.float32):
    k1, k2 = jax.random.split(jax.random.key(0))
    return {
        "dense1": {
            "kernel": jax.random.normal(k1, (16, 32), dtype) / 4,
            "bias": jnp.zeros(32, dtype),
        },
        "dense2": {"kernel": jax.random.normal(k2, (32, 8), dtype) / 4},
    }


def loss(params, x):
    h = jnp.tanh(x @ params["dense1"]["kernel"] + params["dense1"]["bias"][None])
    return jnp.mean(jnp.square(h @ params["dense2"]["kernel"]))


def sgd_step(loss_fn, tx):
    def step(params, opt_state, x):
        grads = jax.grad(loss_fn)(params, x)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return step


def place(mesh, params, tx, x, param_spec=None):
    params = jax.device_put(params, NamedSharding(mesh, param_spec or P()))
    x = jax.device_put(x, NamedSharding(mesh, P("data")))
    return params, tx.init(params), x


def tree_bytes(tree):
    return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(tree))


# --------------------------------------------------------------------------- #
# Data parallel under jit: GSPMD's all-reduces of the gradients
# --------------------------------------------------------------------------- #


@pytest.mark.core
def test_float32_data_parallel_step_all_reduces_its_gradients(mesh):
    tx = optax.sgd(0.1)
    args = place(mesh, init_params(), tx, jnp.ones((64, 16)))
    report = jxs.diagnostics.collective_report(sgd_step(loss, tx))(*args)
    grads = report.select(carries="gradient")
    assert grads and {c.kind for c in grads} == {"all-reduce"}, report
    assert report.dtypes(carries="gradient") == ("float32",)
    assert report.bytes(carries="gradient") == tree_bytes(args[0])
    assert sorted(math.prod(c.shape) for c in grads) == [32, 256, 512]
    assert {c.group_size for c in grads} == {N}
    for c in grads:  # a ring all-reduce sends 2 (n - 1) / n of the array
        assert c.wire_bytes == round(2 * (N - 1) * c.bytes / N)
        assert "transpose(" in c.op_name and c.groups == (tuple(range(N)),)
    report.check(allow_dtypes=[jnp.float32], carries="gradient")
    with pytest.raises(AssertionError, match="break the rule"):
        report.check(allow_dtypes=["float16"], carries="gradient")
    with pytest.raises(AssertionError, match="at most 100 bytes"):
        report.check(max_bytes=100)


@pytest.mark.core
def test_float16_gradients_are_all_reduced_in_float16(mesh):
    # Parameters stored in float16: their gradients cross devices in float16,
    # at half the bytes of float32 ones.
    tx = optax.sgd(0.1)
    params = init_params(jnp.float16)
    args = place(mesh, params, tx, jnp.ones((64, 16), jnp.float16))
    report = jxs.diagnostics.collective_report(sgd_step(loss, tx))(*args)
    assert report.dtypes(carries="gradient") == ("float16",)
    assert report.bytes(carries="gradient") == tree_bytes(params)
    assert report.bytes(carries="gradient") == tree_bytes(init_params()) // 2


@pytest.mark.core
def test_autocast_step_reports_what_its_hlo_reduces(mesh):
    # Whatever dtype autocast gives the gradients, the report reads it from the
    # program: each gradient all-reduce moves one parameter's elements, in its
    # dtype's bytes, and the text holds an all-reduce of that type.
    tx = jxs.dynamic_scaling(optax.sgd(0.1))

    def step(params, opt_state, x):
        scaled = jxs.autocast(
            lambda p, x: loss(p, x) * opt_state.loss_scale.loss_scale, jnp.float16
        )
        grads = jax.grad(scaled)(params, x)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    args = place(mesh, init_params(), tx, jnp.ones((64, 16)))
    compiled = jax.jit(step).lower(*args).compile()
    text = compiled.as_text()
    report = REPORT.from_hlo(compiled)
    grads = report.select(carries="gradient")
    assert set(report.dtypes(carries="gradient")) <= {"float16", "float32"}
    assert sum(math.prod(c.shape) for c in grads) == 32 + 16 * 32 + 32 * 8
    for c in grads:
        assert c.bytes == math.prod(c.shape) * np.dtype(c.dtype).itemsize
        short = {"float16": "f16", "float32": "f32"}[c.dtype]
        typed = f"{short}[{','.join(map(str, c.shape))}]"
        assert any(typed in line and "all-reduce" in line for line in text.split("\n"))


@pytest.mark.core
def test_fully_sharded_step_gathers_its_weights(mesh):
    tx = optax.sgd(0.1)
    args = place(mesh, init_params(), tx, jnp.ones((64, 16)), P("data"))
    report = jxs.diagnostics.collective_report(sgd_step(loss, tx))(*args)
    gathers = report.select(kind="all-gather", carries="argument gather")
    # Each weight gathered whole: f32[16,32], f32[32], f32[32,8].
    assert sorted(c.shape for c in gathers) == [(16, 32), (32,), (32, 8)], report
    assert report.dtypes(kind="all-gather") == ("float32",)
    for c in gathers:
        assert c.wire_bytes == (N - 1) * c.bytes // N
    # The gradients are reduced (XLA:CPU: all-reduce and a slice; a GPU's
    # pipeline makes a reduce-scatter of them).
    kinds = {c.kind for c in report.select(carries="gradient")}
    assert kinds and kinds <= {"all-reduce", "reduce-scatter"}, report


# --------------------------------------------------------------------------- #
# shard_map: each collective of the body
# --------------------------------------------------------------------------- #


def shard_map(fun, mesh, in_specs, out_specs):
    return jax.jit(
        jax.shard_map(
            fun, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False
        )
    )


@pytest.mark.core
def test_shard_map_collectives_each_have_their_kind_dtype_and_bytes(mesh):
    def body(x):  # x: f16[8,4] on each device
        return (
            lax.psum(x, "data"),
            lax.all_gather(x, "data", tiled=True),
            lax.ppermute(x, "data", [(i, (i + 1) % N) for i in range(N)]),
            lax.all_to_all(x, "data", 0, 0, tiled=True),
            lax.psum_scatter(jnp.tile(x, (N, 1)) * 2, "data", tiled=True),
        )

    specs = (P(), P(), P("data"), P("data"), P("data"))
    x = jax.device_put(jnp.ones((64, 4), jnp.float16), NamedSharding(mesh, P("data")))
    report = jxs.diagnostics.collective_report(shard_map(body, mesh, P("data"), specs))(
        x
    )
    block = 8 * 4 * 2  # f16[8,4]
    expected = {  # kind: (result bytes, bytes sent)
        "all-reduce": (block, 2 * (N - 1) * block // N),
        "all-gather": (N * block, (N - 1) * block),
        "collective-permute": (block, block),
        "all-to-all": (block, (N - 1) * block // N),
        "reduce-scatter": (block, (N - 1) * block),
    }
    for kind, (nbytes, sent) in expected.items():
        (c,) = report.select(kind=kind)
        assert (c.dtype, c.bytes, c.wire_bytes, c.group_size) == (
            "float16",
            nbytes,
            sent,
            N,
        ), c
    assert report.select(kind="all-reduce")[0].shape == (8, 4)
    assert report.select(kind="all-gather")[0].shape == (64, 4)
    assert report.select(kind="reduce-scatter")[0].shape == (8, 4)
    permute = report.select(kind="collective-permute")[0]
    assert set(permute.groups) == {(i, (i + 1) % N) for i in range(N)}
    assert report.select(kind="all-gather")[0].carries == "argument gather"
    assert report.bytes(dtype=jnp.float16) == report.bytes()
    text = str(report)
    assert text.startswith(f"collective report: 5 collectives on {N} devices")
    for kind in expected:
        assert kind in text


@pytest.mark.core
def test_finite_flags_of_dynamic_scaling_inside_shard_map(mesh):
    tx = jxs.dynamic_scaling(optax.sgd(0.1), axis_name="data")

    def step(params, opt_state, x):
        grads = lax.pmean(jax.grad(loss)(params, x), "data")
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    params = init_params()
    args = place(mesh, params, tx, jnp.ones((64, 16)))
    fun = shard_map(step, mesh, (P(), P(), P("data")), (P(), P()))
    report = jxs.diagnostics.collective_report(fun)(*args)
    flags = report.select(carries="finite flags")
    assert flags, report
    assert {c.kind for c in flags} == {"all-reduce"}
    # One flag per leaf, or-ed over the devices as int32.
    assert report.dtypes(carries="finite flags") == ("int32",)
    assert sum(math.prod(c.shape) for c in flags) == len(jax.tree.leaves(params))
    assert "jaxscale_finite_check" in flags[0].source
    assert "finite flags" in str(report)


# --------------------------------------------------------------------------- #
# HLO text: the same report; XLA's forms of device groups
# --------------------------------------------------------------------------- #


@pytest.mark.core
def test_the_compiled_programs_text_gives_the_same_report(mesh):
    tx = optax.sgd(0.1)
    args = place(mesh, init_params(), tx, jnp.ones((64, 16)))
    jitted = jax.jit(sgd_step(loss, tx))
    compiled = jitted.lower(*args).compile()
    from_fun = jxs.diagnostics.collective_report(jitted)(*args)
    assert REPORT.from_hlo(compiled.as_text()) == from_fun
    assert REPORT.from_hlo(compiled) == from_fun
    data = json.loads(from_fun.to_json())
    assert data["devices"] == N
    assert [d["kind"] for d in data["collectives"]] == [
        c.kind for c in from_fun.collectives
    ]


def module(instruction: str, partitions: int = 8) -> str:
    return (
        f"HloModule m, num_partitions={partitions}\n"
        "ENTRY %main (p: f32[4]) -> f32[4] {\n"
        "  %p = f32[4]{0} parameter(0)\n"
        f"  {instruction}\n"
        "}\n"
    )


@pytest.mark.unit
@pytest.mark.parametrize(
    "groups, expected",
    [
        ("replica_groups={{0,2},{1,3}}", ((0, 2), (1, 3))),
        ("replica_groups={}", ((0, 1, 2, 3),)),
        ("replica_groups=[2,2]<=[4]", ((0, 1), (2, 3))),
        ("replica_groups=[2,2]<=[2,2]T(1,0)", ((0, 2), (1, 3))),
        ("replica_groups=mesh['a'=2,'b'=2] {'a'}", ((0, 2), (1, 3))),
        ("replica_groups=mesh['a'=2,'b'=2] {'b'}", ((0, 1), (2, 3))),
    ],
)
def test_every_form_of_device_groups(groups, expected):
    hlo = module(f"ROOT %r = f32[4]{{0}} all-reduce(%p), {groups}, to_apply=%add", 4)
    (c,) = REPORT.from_hlo(hlo).collectives
    assert c.groups == expected
    assert c.group_size == len(expected[0])
    assert c.wire_bytes == round(2 * (c.group_size - 1) * 16 / c.group_size)


@pytest.mark.unit
def test_async_pairs_count_once_and_combined_ones_per_array():
    hlo = module(
        "%s = (f32[4]{0}, f32[32]{0}) all-gather-start(%p), replica_groups={}, "
        'dimensions={0}, metadata={op_name="jit(f)/MLP/all_gather"}\n'
        "  %d = f32[32]{0} all-gather-done(%s)\n"
        "  %c = (f32[4]{0}, f16[2]{0}) all-reduce(%p, %p), replica_groups={}, "
        'to_apply=%add, metadata={op_name="jit(f)/transpose(jvp(MLP))/(a:b)"}\n'
        "  %g = f16[2]{0} get-tuple-element(%c), index=1, "
        'metadata={op_name="jit(f)/transpose(jvp(MLP))/Dense_0/dot_general"}'
    )
    report = REPORT.from_hlo(hlo)
    gather, *reduced = report.collectives
    assert (gather.kind, gather.shape, gather.name) == ("all-gather", (32,), "d")
    assert (gather.carries, gather.source) == ("argument gather", "MLP")
    assert [(c.name, c.dtype, c.shape) for c in reduced] == [
        ("c[0]", "float32", (4,)),
        ("c[1]", "float16", (2,)),
    ]
    assert reduced[1].source == "MLP/Dense_0"
    assert report.bytes(kind="all-reduce") == 16 + 4
    assert report.dtypes(kind="all-reduce", carries="gradient") == (
        "float16",
        "float32",
    )


# XLA:GPU's combiner: one flat all-reduce of a concatenation (inside a fusion)
# of flattened arrays; each array keeps the op_name of what made it.
FLAT = """HloModule m, num_partitions=8

%concat (p0: f16[8], p1: f16[72], p2: f16[8]) -> f16[88] {
  %p0 = f16[8]{0} parameter(0)
  %p1 = f16[72]{0} parameter(1)
  %b2 = f16[8]{0} bitcast(f16[8]{0} %p2)
  %p2 = f16[8]{0} parameter(2)
  ROOT %c = f16[88]{0} concatenate(%p0, %p1, %b2), dimensions={0}
}

ENTRY %main (x: f16[8,9], y: f16[8]) -> f16[88] {
  %x = f16[8,9]{1,0} parameter(0)
  %y = f16[8]{0} parameter(1)
  %conv = (f16[8,3,3]{2,1,0}, u8[0]{0}) custom-call(%x), custom_call_target="c", \
metadata={op_name="jit(step)/transpose(jvp(jxs_autocast_float16))/Net/conv1/cond/branch_1_fun/conv"}
  %k = f16[8,3,3]{2,1,0} get-tuple-element(%conv), index=0
  %kf = f16[72]{0} bitcast(%k)
  %r = f16[8]{0} fusion(%x), kind=kInput, calls=%sum, metadata={op_name=\
"jit(step)/transpose(jvp(jxs_autocast_float16))/Net/bn0/jvp(jxs_autocast_float16)\
/Net/bn0/reduce_sum"}
  %l = f16[8]{0} negate(%y), metadata={op_name="jit(step)/jvp(Net)/bn0/reduce_sum"}
  %w = f16[88]{0} fusion(%r, %kf, %l), kind=kLoop, calls=%concat
  %s = f16[88]{0} all-reduce-start(%w), replica_groups={}, to_apply=%add
  %d = f16[88]{0} all-reduce-done(%s)
  %u = f16[16]{0} concatenate(%y, %y), dimensions={0}, metadata={op_name="jit(f)/c"}
  ROOT %v = f16[16]{0} all-reduce(%u), replica_groups={}, to_apply=%add
}
"""


@pytest.mark.unit
def test_flat_combined_all_reduce_is_split_into_the_arrays_it_concatenates():
    report = REPORT.from_hlo(FLAT)
    *parts, own = report.collectives
    assert [(c.name, c.shape, c.dtype, c.bytes) for c in parts] == [
        ("d[0]", (8,), "float16", 16),
        ("d[1]", (8, 3, 3), "float16", 144),  # its shape before flattening
        ("d[2]", (8,), "float16", 16),
    ]
    assert [(c.carries, c.source, c.operation) for c in parts] == [
        ("gradient", "Net/bn0", "reduce_sum"),
        ("gradient", "Net/conv1", "conv"),
        ("forward", "Net/bn0", "reduce_sum"),
    ]
    assert {(c.instruction, c.parts) for c in parts} == {("d", 3)}
    assert sum(c.wire_bytes for c in parts) == round(2 * 7 * 176 / 8)
    # A concatenation of the program's own (it has an op_name) stays whole.
    assert (own.name, own.shape, own.parts, own.carries) == ("v", (16,), 1, "unknown")
    assert report.dtypes(carries="gradient") == ("float16",)
    assert str(report).startswith("collective report: 4 collectives in 2 instructions")


@pytest.mark.integration
@pytest.mark.pinned
def test_a_combined_all_reduce_of_a_flax_step_labels_each_gradient(mesh):
    # Several small parameters: XLA:CPU combines their gradients, and the
    # forward loss sum, into one all-reduce of a tuple; each array is a record
    # that says which module's parameter it is the gradient of. Whether XLA
    # combines is one compiler's choice (jax 0.7.1's XLA:CPU does not): pinned.
    flax_linen = pytest.importorskip("flax.linen")

    class MLP(flax_linen.Module):
        @flax_linen.compact
        def __call__(self, x):
            for i in range(4):
                x = jnp.tanh(flax_linen.Dense(8, name=f"d{i}")(x))
            return x

    model = MLP()
    params = model.init(jax.random.key(0), jnp.ones((1, 8)))["params"]
    tx = jxs.dynamic_scaling(optax.sgd(0.1))

    def step(params, opt_state, x):
        value = lambda p: jnp.mean(model.apply({"params": p}, x) ** 2)  # noqa: E731
        loss, grads = jax.value_and_grad(value)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    args = place(mesh, params, tx, jnp.ones((64, 8)))
    report = jxs.diagnostics.collective_report(step)(*args)
    grads = report.select(carries="gradient")
    assert any(c.parts > 1 for c in grads), report  # combined
    assert len({c.instruction for c in grads}) < len(grads)
    assert sorted((c.source, c.operation, c.shape) for c in grads) == sorted(
        [(f"MLP/d{i}", "dot_general", (8, 8)) for i in range(4)]
        + [(f"MLP/d{i}", "reduce_sum", (8,)) for i in range(4)]
    )
    assert report.bytes(carries="gradient") == tree_bytes(params)
    assert not report.select(carries="unknown"), report
    # The loss's sum over the batch, in the forward pass.
    assert [(c.shape, c.dtype) for c in report.select(carries="forward")] == [
        ((), "float32")
    ]


@pytest.mark.core
def test_reduce_mean_and_its_block_scales_are_labelled(mesh):
    def body(grads):
        return jxs.reduce_mean(grads, "data", wire_dtype=jnp.float16)

    fun = shard_map(body, mesh, P("data"), P())
    grads = {"a": jnp.ones((N * 8, 64)), "b": jnp.ones((N * 4,))}
    report = jxs.diagnostics.collective_report(fun)(grads)
    assert {(c.kind, c.dtype) for c in report.select(carries="reduce_mean")} == {
        ("all-to-all", "float16"),
        ("all-gather", "float16"),
    }, report
    scales = report.select(carries="reduce_mean scales")
    assert {(c.kind, c.dtype) for c in scales} == {
        ("all-to-all", "float32"),
        ("all-gather", "float32"),
    }
    assert report.dtypes(carries="reduce_mean") == ("float16",)
    assert not report.select(carries="gradient")
    assert not report.select(carries="unknown")


@pytest.mark.core
@pytest.mark.usefixtures("on_cpu")
def test_the_float8_gather_is_labelled():
    from test_float8_gather import LAYERS, float8, fsdp_step, mesh_of, sharded

    report = jxs.diagnostics.collective_report(fsdp_step(float8))(*sharded(mesh_of()))
    gathers = report.select(carries="float8 gather")
    assert len(gathers) == LAYERS, report
    assert {(c.kind, c.dtype) for c in gathers} == {("all-gather", "uint8")}
    assert report.select("all-gather") == gathers
    # Its backward, the reduce-scatter of each weight's gradient; the amaxes.
    assert len(report.select("reduce-scatter", "gradient")) == LAYERS
    assert report.select(carries="amax")


@pytest.mark.unit
def test_bad_input_names_the_argument():
    with pytest.raises(TypeError, match="`fun` must be callable"):
        jxs.diagnostics.collective_report(3)
    with pytest.raises(TypeError, match="from_hlo"):
        jxs.diagnostics.collective_report("HloModule m")
    with pytest.raises(TypeError, match=r"`hlo` must be .*`\.compile\(\)` first"):
        REPORT.from_hlo(jax.jit(jnp.sin).lower(1.0))
    with pytest.raises(ValueError, match="`hlo` must be optimized HLO text"):
        REPORT.from_hlo(jax.jit(jnp.sin).lower(1.0).as_text())
    report = REPORT.from_hlo(module("ROOT %n = f32[4]{0} negate(%p)"))
    assert report.collectives == () and "none" in str(report)
    with pytest.raises(ValueError, match="`kind` must be one of 'all-reduce'"):
        report.select(kind="psum")
    with pytest.raises(ValueError, match="`carries` must be one of 'gradient'"):
        report.bytes(carries="grads")


# --------------------------------------------------------------------------- #
# A GPU target without a GPU
# --------------------------------------------------------------------------- #


@pytest.mark.integration
@pytest.mark.skipif(
    importlib.util.find_spec("jax_cuda12_plugin") is None,
    reason="the deviceless GPU compile needs jax-cuda12-plugin",
)
def test_a_deviceless_compile_for_eight_gpus():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import hlo_account

    gpus = hlo_account.gpu_mesh("h100", (N,), ("data",))
    tx = optax.sgd(0.1)
    params = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(
            a.shape, a.dtype, sharding=NamedSharding(gpus, P())
        ),
        init_params(),
    )
    x = jax.ShapeDtypeStruct(
        (64, 16), jnp.float32, sharding=NamedSharding(gpus, P("data"))
    )
    opt_state = jax.eval_shape(tx.init, params)
    compiled = jax.jit(sgd_step(loss, tx)).lower(params, opt_state, x).compile()
    report = REPORT.from_hlo(compiled)
    assert report.devices == N
    assert report.dtypes(carries="gradient") == ("float32",)
    assert sum(math.prod(c.shape) for c in report.select(carries="gradient")) == (
        32 + 16 * 32 + 32 * 8
    )


@pytest.mark.integration
@pytest.mark.pinned
@pytest.mark.skipif(
    importlib.util.find_spec("jax_cuda12_plugin") is None,
    reason="the deviceless GPU compile needs jax-cuda12-plugin",
)
def test_a_conv_nets_flat_combined_all_reduces_on_eight_h200s():
    # XLA:GPU (jax 0.10.2) combines the small gradients of a conv net into flat
    # all-reduces of concatenated arrays (f16[3472]: two conv kernels and a
    # BatchNorm's backward sums): each array is a record, so every conv
    # kernel's gradient is seen, with its module.
    nn = pytest.importorskip("flax.linen")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import hlo_account

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            for i, features in enumerate((8, 16, 16)):
                x = nn.Conv(features, (3, 3), name=f"conv{i}")(x)
                x = nn.relu(nn.BatchNorm(use_running_average=False, name=f"bn{i}")(x))
            return nn.Dense(10, name="head")(jnp.mean(x, axis=(1, 2)))

    net = Net()
    try:
        gpus = hlo_account.gpu_mesh("h200", (N,), ("data",))
    except NotImplementedError:  # the CUDA plugin did not register its topology
        pytest.skip(
            "no deviceless CUDA topology: without a GPU, set "
            "JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 before jax starts"
        )
    tx = jxs.dynamic_scaling(optax.sgd(0.1))
    variables = jax.eval_shape(
        lambda: net.init(jax.random.key(0), jnp.ones((1, 16, 16, 3)))
    )

    def step(params, stats, opt_state, x, y):
        def loss(p):
            apply = lambda p, x: net.apply(  # noqa: E731
                {"params": p, "batch_stats": stats}, x, mutable=["batch_stats"]
            )
            logits, new = jxs.autocast(apply, jnp.float16)(p, x)
            value = optax.softmax_cross_entropy_with_integer_labels(
                logits.astype(jnp.float32), y
            ).mean()
            return value * opt_state.loss_scale.loss_scale, new["batch_stats"]

        grads, stats = jax.grad(loss, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), stats, opt_state

    def on(tree, spec=None):
        sharding = NamedSharding(gpus, spec or P())
        return jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), tree
        )

    args = (
        on(variables["params"]),
        on(variables["batch_stats"]),
        on(jax.eval_shape(tx.init, variables["params"])),
        on(jax.ShapeDtypeStruct((64 * N, 16, 16, 3), jnp.float32), P("data")),
        on(jax.ShapeDtypeStruct((64 * N,), jnp.int32), P("data")),
    )
    compiled = jax.jit(step).lower(*args).compile()
    report = REPORT.from_hlo(compiled)
    text = compiled.as_text()
    # A flat all-reduce of a concatenation, split into arrays of other shapes
    # whose elements add up to the flat array's.
    flat = {c.instruction for c in report.collectives if c.parts > 1}
    by_name = {i.name: i for i in _hlo.instructions(text)}
    assert flat, report
    for name in flat:
        ((_, (size,)),) = _hlo.shapes(by_name[name].type)
        parts = [c for c in report.collectives if c.instruction == name]
        assert sum(math.prod(c.shape) for c in parts) == int(size)
    grads = report.select(carries="gradient")
    kernels = {
        c.source: c.shape for c in grads if c.operation == "conv_general_dilated"
    }
    assert sorted(kernels) == ["Net/conv0", "Net/conv1", "Net/conv2"], report
    assert {math.prod(s) for s in kernels.values()} == {
        3 * 3 * 3 * 8,
        3 * 3 * 8 * 16,
        3 * 3 * 16 * 16,
    }
    assert {c.source for c in grads} >= {f"Net/bn{i}" for i in range(3)} | {"Net/head"}
    # BatchNorm's batch statistics, summed over the devices in the forward pass.
    assert {c.source for c in report.select(carries="forward")} == {
        f"Net/bn{i}" for i in range(3)
    }
    assert not report.select(carries="unknown"), report


@pytest.mark.integration
@pytest.mark.skipif(
    len(jax.devices()) < N, reason="the guide's step runs on 8 default devices"
)
def test_the_guide_section_runs():
    text = (ROOT / "docs" / "diagnostics.md").read_text()
    section = text[text.index("## What crosses devices") :]
    section = section[: section.index("\n## ")]
    blocks = re.findall(r"^```python\n(.*?)^```", section, re.MULTILINE | re.DOTALL)
    assert len(blocks) == 2
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, "docs/diagnostics.md", "exec"), namespace)
    table = section[section.index("```text\n") + 8 :]
    rows = table[: table.index("```")].strip().split("\n")[3:]
    printed = str(namespace["report"]).split("\n")[3:]
    assert sorted(rows) == sorted(printed)


@pytest.mark.core
def test_float8_amaxes_inside_shard_map_are_classified():
    from test_float8_devices import batch, params, put, shard_map_step

    step, mesh = shard_map_step(True, "inside")
    p, x = put(params(), mesh, P()), put(batch(), mesh, P("data"))
    report = jxs.diagnostics.collective_report(step)(p, x)
    amaxes = report.select(carries="amax")
    assert amaxes, report
    # One scalar per tensor (its amax as an int32 key), all-reduced over the mesh.
    assert {(c.kind, c.shape, c.dtype) for c in amaxes} == {("all-reduce", (), "int32")}
    assert all("jaxscale_amax" in c.source for c in amaxes)
