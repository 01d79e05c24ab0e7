"""The GPU budget (issue 47), checked without a GPU: ``benchmarks/gpu_budget.py``
compiles GPT-2-small-shaped steps (2 blocks, sequence 1024, batch 8) for one
deviceless H200 with XLA:GPU's own passes and asserts autocast's temporary
memory and kernel bytes against the hand-cast step's (the budget lives in
``gpu_budget.BUDGET``); and that ``jax.nn.dot_product_attention`` under autocast
compiles to cuDNN's fused attention.

Needs ``jax-cuda12-plugin`` (``.ci/gpu-budget`` builds an environment with it;
skipped elsewhere). `pinned`: the figures of one XLA.
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


@contextlib.contextmanager
def as_users_run_it():
    """The benchmark's model (benchmarks/gpu.py) under JAX's default promotion
    rules, not the suite's strict ones (it adds a [T, d] position table to a
    [B, T, d] batch, as GPT-2 code does)."""
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
    assert row["temp"] <= gpu_budget.BUDGET["temp"], row["temp"]
    assert row["bytes"] <= gpu_budget.BUDGET["bytes"], row["bytes"]
    assert (row["autocast"].cudnn >= 4) == fused  # 2 blocks, forward + backward
    assert row["hand"].cudnn == 0


def test_jax_nn_attention_runs_cudnn_under_autocast(results):
    row = results[("float16", "jnn", True)]
    assert row["hand"].cudnn == 0  # 16-bit hand-cast code: jax picks XLA
    assert row["autocast"].cudnn >= 4  # forward and backward, per block
    assert row["temp"] <= gpu_budget.BUDGET["temp"]
    assert row["bytes"] <= gpu_budget.BUDGET["bytes"]


def test_no_16_bit_gradient_reduction_across_8_h200s():
    size = gpu_budget.G.Size(1, 128, 2, 256, 512, 128, 16)
    for dtype in (gpu_budget.F16, gpu_budget.BF16):
        with as_users_run_it():
            step = gpu_budget.compile_step(size, dtype, "autocast", 8)
        assert gpu_budget.sixteen_bit_gradient_reductions(step.hlo) == []
