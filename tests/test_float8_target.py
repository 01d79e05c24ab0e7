"""float8's choice prices the device the step is for (issue 47, item 7): the
recipe's ``device_kind``, else the devices of the traced values' sharding, the
mesh in context or JAX's default device; a kind without figures (the CPU) takes
the H100 SXM's with a warning that says to pass ``device_kind``
(docs/float8.md, "Which device's figures").

The product is a d-4096 projection fed a bfloat16 activation, ``[8192, 4096] x
[4096, 4096]``: the H200's figures take it (predicted 0.90 of bfloat16), the
H100 SXM's decline it (1.04), so the two kinds trace different programs.
"""

from __future__ import annotations

import importlib.util
import sys
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import all_eqns
from jax.sharding import AbstractMesh, AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxscale as jxs
from jaxscale._cost import target_kind

ROOT = Path(__file__).resolve().parents[1]
H200 = "NVIDIA H200"
H100 = "NVIDIA H100 80GB HBM3"
NO_FIGURES = "has no figures for the device kind"
D, M = 4096, 8192


def loss(params, x):
    # The first product takes float32 x (float8 on both kinds: its cast pass
    # is saved), the second the first's bfloat16 output (float8 on the H200's
    # figures only).
    h = x @ params["w1"]
    return jnp.mean(h @ params["w2"])


def args(sharding=None):
    def sds(shape):
        return jax.ShapeDtypeStruct(shape, jnp.float32, sharding=sharding)

    return {"w1": sds((D, D)), "w2": sds((D, D))}, sds((M, D))


def step(float8):
    return jax.jit(jax.grad(jxs.autocast(loss, jnp.bfloat16, float8=float8)))


def kind(name):
    return jxs.float8.CurrentScaling(device_kind=name)


def float8_dots(fun, *a):
    return sum(
        e.primitive.name == "dot_general"
        and any(np.dtype(v.aval.dtype).itemsize == 1 for v in e.invars)
        for e in all_eqns(jax.make_jaxpr(fun)(*a))
    )


# jax >= 0.8 (not on the dependency floors): a mesh of abstract devices of a kind.
AbstractDevice = getattr(jax.sharding, "AbstractDevice", None)
abstract_devices = pytest.mark.skipif(
    AbstractDevice is None or not hasattr(jax.sharding, "use_abstract_mesh"),
    reason="this jax has no jax.sharding.AbstractDevice / use_abstract_mesh",
)


def h200_mesh():
    device = AbstractDevice(device_kind=H200, num_cores=None, platform="gpu")
    return AbstractMesh((1,), ("x",), (AxisType.Explicit,), abstract_device=device)


@pytest.mark.unit
def test_the_two_kinds_choose_differently():
    # Two sites on the H200 (three products each), one on the H100 SXM: what
    # lets the tests below tell the two apart.
    assert float8_dots(step(kind(H200)), *args()) == 6
    assert float8_dots(step(kind(H100)), *args()) == 3


@pytest.mark.unit
@abstract_devices
def test_a_mesh_of_h200s_in_context_prices_the_h200():
    # What a step traced on a CPU host for GPUs sees: no GPU here, but the mesh
    # says which device the step is for.
    with jax.sharding.use_abstract_mesh(h200_mesh()):
        assert target_kind() == (H200, "the mesh in context")
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            chosen = str(jax.make_jaxpr(step(True))(*args()))
        assert chosen == str(jax.make_jaxpr(step(kind(H200)))(*args()))
        assert float8_dots(step(True), *args()) == 6
        # The recipe's device_kind comes first.
        assert float8_dots(step(kind(H100)), *args()) == 3


@pytest.mark.unit
def test_the_kind_of_an_eight_cpu_device_mesh_is_the_cpu():
    mesh = jax.make_mesh((8,), ("data",), devices=jax.devices("cpu")[:8])
    placed = NamedSharding(mesh, P())
    seen = []

    @jax.jit
    def probe(x):
        seen.append(target_kind([x]))
        return x

    probe.trace(jax.ShapeDtypeStruct((8, 4), jnp.float32, sharding=placed))
    probe(jax.device_put(jnp.ones((16, 4)), placed))
    source = "the devices of the traced values' sharding"
    assert seen == [("cpu", source), ("cpu", source)]
    assert target_kind([jax.device_put(jnp.ones(3), placed)]) == ("cpu", source)
    with jax.set_mesh(mesh):
        assert target_kind() == ("cpu", "the mesh in context")
    assert target_kind([1.0]) == (
        jax.devices()[0].device_kind,
        f"JAX's default backend ({jax.devices()[0].platform})",
    )
    # A step on that mesh: the CPU has no figures, so the H100 SXM's choose,
    # and the warning says so.
    with pytest.warns(jxs.AutocastWarning, match=NO_FIGURES) as caught:
        chosen = str(jax.make_jaxpr(step(True))(*args(placed)))
    (w,) = caught  # once per trace, though two products were priced
    assert f"device kind 'cpu' (from {source})" in str(w.message)
    assert chosen == str(jax.make_jaxpr(step(kind(H100)))(*args(placed)))


@pytest.mark.unit
def test_the_warning_says_what_to_do():
    if jax.default_backend() != "cpu":
        pytest.skip("the warning is for a kind without figures (the CPU's)")
    with pytest.warns(jxs.AutocastWarning) as caught:
        jax.make_jaxpr(step(True))(*args())
    (w,) = caught
    text = str(w.message)
    for part in (
        "jxs.autocast(float8=...): the cost model that chooses which matmuls run "
        "in float8 has no figures for the device kind 'cpu' (from JAX's default "
        "backend (cpu)), so it chose with the NVIDIA H100 SXM's.",
        '`float8=jxs.float8.CurrentScaling(device_kind="NVIDIA H200")`',
        "'NVIDIA H200', 'NVIDIA H100 SXM'",
        "`min_dim=` or `sites=`",
    ):
        assert part in text, text
    # Choices that need no device kind never warn.
    for recipe in (
        jxs.float8.CurrentScaling(min_dim=0),
        jxs.float8.CurrentScaling(sites={"": True}),
        kind(H200),
    ):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            jax.make_jaxpr(step(recipe))(*args())


@pytest.mark.integration
@pytest.mark.skipif(
    importlib.util.find_spec("jax_cuda12_plugin") is None,
    reason="the deviceless GPU compile needs jax-cuda12-plugin",
)
def test_a_deviceless_h200_compile_chooses_as_the_h200():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import hlo_account

    from jaxscale.float8._check import float8_gemms

    try:
        gpus = hlo_account.gpu_mesh("h200")
    except NotImplementedError as err:  # the plugin did not start (no CUDA)
        pytest.skip(
            f"no deviceless CUDA topology ({err}): set "
            "JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 before JAX starts"
        )
    on_gpus = args(NamedSharding(gpus, P()))
    jaxprs, gemms = {}, {}
    for name, recipe in (("default", True), (H200, kind(H200)), (H100, kind(H100))):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the target is known: no warning
            traced = step(recipe).trace(*on_gpus)
        jaxprs[name] = str(traced.jaxpr)
        gemms[name] = float8_gemms(traced.lower().compile().as_text())
    assert jaxprs["default"] == jaxprs[H200] != jaxprs[H100]
    # XLA:GPU's float8 GEMMs: the H200's choice, more than the H100 SXM's.
    assert gemms["default"] == gemms[H200] > gemms[H100], gemms
