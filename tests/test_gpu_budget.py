"""The GPU budget (issue 47), checked without a GPU: ``benchmarks/gpu_budget.py``
compiles steps with XLA:GPU's own passes for deviceless H200s and this asserts
the figures of ``gpu_budget.BUDGET`` (the one place they live):

- GPT-2-small-shaped steps (2 blocks, sequence 1024, batch 8; one H200):
  autocast's temporary memory and kernel bytes against the hand-cast step's, and
  ``jax.nn.dot_product_attention`` under autocast compiled to cuDNN's fused
  attention;
- what ``jxs.dynamic_scaling`` adds to the bare float16 step of GPT-2-small (12
  blocks; one H200): kernels and bytes per parameter, as
  ``benchmarks/step_account.py`` accounts them;
- no 16-bit gradient all-reduce or reduce-scatter across 8 H200s under autocast
  by default: a dense GPT, a conv net, a ResNet (Conv + BatchNorm), an
  embedding; float16 and bfloat16; data parallel and FSDP.

Each compile is made once, in a module fixture. Needs ``jax-cuda12-plugin``
(``.ci/gpu-budget`` builds an environment with it; skipped elsewhere).
`pinned`: the figures of one XLA.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.pinned]

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
if importlib.util.find_spec("jax_cuda12_plugin") is None:
    pytest.skip(
        "jax-cuda12-plugin is not installed (.ci/gpu-budget installs it)",
        allow_module_level=True,
    )
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
sys.path.insert(0, str(BENCHMARKS))

import gpu_budget  # noqa: E402
import jax  # noqa: E402

BUDGET = gpu_budget.BUDGET


@contextlib.contextmanager
def as_users_run_it():
    """The benchmark's models (benchmarks/gpu.py's GPT, flax's) under JAX's
    default promotion rules, not the suite's strict ones (the GPT adds a
    [T, d] position table to a [B, T, d] batch, as GPT-2 code does)."""
    with jax.numpy_rank_promotion("allow"), jax.numpy_dtype_promotion("standard"):
        yield


@pytest.fixture(scope="module")
def results():
    size = gpu_budget.G.Size(2, 768, 12, 3072, 50304, 1024, 8)
    with as_users_run_it():
        rows = gpu_budget.rows(size, 1)
    return {(r["dtype"], r["attention"], r["fused"]): r for r in rows}


@pytest.mark.parametrize("fused", [False, True], ids=["rules", "fused"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_written_out_attention_within_the_budget(results, dtype, fused):
    """By the rules (the float16 scale rule) and fused (the default)."""
    row = results[(dtype, "written", fused)]
    assert row["temp"] <= BUDGET["temp"], row["temp"]
    assert row["bytes"] <= BUDGET["bytes"], row["bytes"]
    assert (row["autocast"].cudnn >= 4) == fused  # 2 blocks, forward + backward
    assert row["hand"].cudnn == 0


def test_jax_nn_attention_runs_cudnn_under_autocast(results):
    row = results[("float16", "jnn", True)]
    assert row["hand"].cudnn == 0  # 16-bit hand-cast code: jax picks XLA
    assert row["autocast"].cudnn >= 4  # forward and backward, per block
    assert row["temp"] <= BUDGET["temp"]
    assert row["bytes"] <= BUDGET["bytes"]


# --------------------------------------------------------------------------- #
# dynamic_scaling on GPT-2-small (12 blocks).
# --------------------------------------------------------------------------- #


@pytest.fixture(scope="module")
def scaling():
    with as_users_run_it():
        return {
            v: gpu_budget.scaling_row(gpu_budget.SCALING_SIZE, gpu_budget.F16, v)
            for v in gpu_budget.SCALING
        }


@pytest.mark.parametrize("variant", gpu_budget.SCALING)
def test_dynamic_scaling_adds_no_more_kernels_than_the_budget(scaling, variant):
    row = scaling[variant]
    assert row["kernels"] <= BUDGET["scaling_kernels"], row["account"].lines()


def test_dynamic_scaling_adds_no_more_bytes_than_the_budget_hand_cast(scaling):
    """benchmarks/step_account.py's own step: the figure the budget is set by."""
    row = scaling["hand"]
    assert row["bytes_per_param"] <= BUDGET["scaling_bytes_per_param"], row[
        "account"
    ].lines()


@pytest.mark.xfail(
    strict=True,
    reason="over the budget today: +5.20 B/param (1.30 float32 passes) against "
    "step_account.py's +3.61. Autocast's weight gradients leave their products "
    "in float32, so dynamic_scaling's finite check reads them at 4 bytes an "
    "element where the hand-cast step's reads the float16 products before "
    "their widening (its largest checks read 2x the bytes).",
)
def test_dynamic_scaling_adds_no_more_bytes_than_the_budget_autocast(scaling):
    row = scaling["autocast"]
    assert row["bytes_per_param"] <= BUDGET["scaling_bytes_per_param"], row[
        "account"
    ].lines()


def test_dynamic_scaling_bytes_under_autocast_get_no_worse(scaling):
    """The guard while autocast's step is over the hand-cast budget above."""
    row = scaling["autocast"]
    limit = BUDGET["scaling_bytes_per_param_autocast"]
    assert row["bytes_per_param"] <= limit, row["account"].lines()


# --------------------------------------------------------------------------- #
# Gradients across 8 H200s.
# --------------------------------------------------------------------------- #


def _case_id(case) -> str:
    model, dtype, fsdp, gradient_dtype = case
    name = f"{model}-{gpu_budget.jnp.dtype(dtype).name}-{'fsdp' if fsdp else 'dp'}"
    if gradient_dtype is not None:
        name += f"-gradient_dtype={gpu_budget.jnp.dtype(gradient_dtype).name}"
    return name


@pytest.fixture(scope="module")
def sharded():
    with as_users_run_it():
        rows = gpu_budget.sharded_rows(gpu_budget.SHARDED, 8)
    return dict(zip(map(_case_id, gpu_budget.SHARDED), rows, strict=True))


DEFAULT_CASES = [c for c in gpu_budget.SHARDED if c[3] is None]
OPT_OUT_CASES = [c for c in gpu_budget.SHARDED if c[3] is not None]


@pytest.mark.parametrize("case", DEFAULT_CASES, ids=_case_id)
def test_no_16_bit_gradient_reduction_across_8_h200s(sharded, case):
    row = sharded[_case_id(case)]
    assert row["reductions"] > 1  # the gradients cross devices...
    assert len(row["sixteen_bit"]) <= BUDGET["sixteen_bit_reductions"], row[
        "sixteen_bit"
    ]  # ...in float32


@pytest.mark.parametrize("case", OPT_OUT_CASES, ids=_case_id)
def test_the_check_sees_16_bit_reductions(sharded, case):
    """``gradient_dtype=float16`` (the opt-out) reduces the conv kernels'
    gradients in 16 bits: the check above is not vacuous."""
    assert sharded[_case_id(case)]["sixteen_bit"]
