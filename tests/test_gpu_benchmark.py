"""``benchmarks/gpu.py --tiny`` runs on the CPU and prints every row and line."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import jax
import pytest
from helpers import run_script

pytestmark = [pytest.mark.integration, pytest.mark.pinned]

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu.py"
MODELS = ("realistic", "small")
JAX_VARIANTS = (
    "float32",
    "bfloat16",
    "float16 hand bare",
    "float16 hand + dynamic_scaling",
    "float16 autocast bare",
    "float16 autocast + dynamic_scaling",
)
# On the CPU torch's autocast runs in bfloat16. torch is an extra (`parity`):
# without it the benchmark runs with --no-torch and prints no torch rows.
HAVE_TORCH = importlib.util.find_spec("torch") is not None
TORCH_VARIANTS = (
    ("torch bfloat16 autocast bare", "torch bfloat16 autocast + GradScaler")
    if HAVE_TORCH
    else ()
)
NUMBER = r"(\d+(?:\.\d+)?)"


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> str:
    no_torch = () if HAVE_TORCH else ("--no-torch",)
    proc = run_script(SCRIPT, "--tiny", *no_torch, cwd=tmp_path_factory.mktemp("gpu"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def table_rows(out: str) -> dict[tuple[str, str], list[str]]:
    """``{(model, variant): the other cells}`` of the Markdown table."""
    rows = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and cells[0] in MODELS:
            rows[cells[0], cells[1]] = cells[2:]
    return rows


def test_every_row_with_positive_numbers(tiny_run):
    rows = table_rows(tiny_run)
    expected = [(m, v) for m in MODELS for v in JAX_VARIANTS]
    expected += [("realistic", v) for v in TORCH_VARIANTS]
    assert sorted(rows) == sorted(expected), tiny_run
    for (model, variant), (step, tokens, ratio, compile_s) in rows.items():
        assert float(step) > 0 and int(tokens) > 0, (model, variant)
        median, q25, q75 = map(
            float, re.fullmatch(rf"{NUMBER} \[{NUMBER}, {NUMBER}\]", ratio).groups()
        )
        assert 0 < q25 <= median <= q75, (model, variant, ratio)
        if variant.startswith("torch"):
            assert compile_s == "-"
        else:
            total, lower, xla = map(
                float,
                re.fullmatch(rf"{NUMBER} \({NUMBER} \+ {NUMBER}\)", compile_s).groups(),
            )
            assert total > 0 and lower > 0 and xla > 0, (model, variant)
            assert total == pytest.approx(lower + xla, abs=0.02)
    # The bare float16 step of each framework is its own reference.
    for model in MODELS:
        assert rows[model, "float16 hand bare"][2] == "1.000 [1.000, 1.000]"
    if HAVE_TORCH:
        assert rows["realistic", TORCH_VARIANTS[0]][2] == "1.000 [1.000, 1.000]"


def test_anchor_lines(tiny_run):
    anchors = dict(re.findall(r"^anchor: (\w+) \| (.*)$", tiny_run, re.M))
    assert sorted(anchors) == sorted(MODELS), tiny_run
    for line in anchors.values():
        for part in ("jax float16 hand", "jax float16 autocast"):
            assert re.search(rf"{part}: dynamic_scaling/bare {NUMBER} \[", line)
    torch_anchor = re.search(
        rf"torch: GradScaler/bare {NUMBER} \[", anchors["realistic"]
    )
    assert bool(torch_anchor) == HAVE_TORCH, anchors["realistic"]


def test_host_blocking_lines(tiny_run):
    pattern = (
        rf"^host blocking: (\w+) \| (.+?) \| enqueue (\d+) steps {NUMBER} ms \| "
        rf"run (\d+) steps {NUMBER} ms \| enqueue/run {NUMBER} \((.+)\)$"
    )
    found = {}
    for model, variant, n, enq, n_run, run, ratio, verdict in re.findall(
        pattern, tiny_run, re.M
    ):
        assert n == n_run and int(n) > 0
        assert 0 < float(enq) <= float(run), (model, variant)
        assert float(ratio) == pytest.approx(float(enq) / float(run), abs=2e-3)
        assert verdict in ("asynchronous", "partly blocked", "blocked every step")
        found[model, variant] = float(ratio)
    for model in MODELS:
        for variant in ("float16 hand bare", "float16 hand + dynamic_scaling"):
            assert (model, variant) in found, tiny_run
    for variant in TORCH_VARIANTS:
        assert ("realistic", variant) in found, tiny_run


def test_hlo_lines(tiny_run):
    pattern = (
        r"^hlo: (\w+) \| (.+?) \| conditionals (\d+) \(in command buffers (\d+)\) "
        r"\| whiles (\d+) \(in command buffers (\d+)\) \| command buffers (\d+) "
        rf"\| temp MiB {NUMBER}$"
    )
    found = {}
    for model, variant, cond, cond_cb, whiles, whiles_cb, cbs, _ in re.findall(
        pattern, tiny_run, re.M
    ):
        cond, cond_cb, whiles, whiles_cb = map(int, (cond, cond_cb, whiles, whiles_cb))
        assert 0 <= cond_cb <= cond and 0 <= whiles_cb <= whiles
        if jax.default_backend() == "cpu":
            assert int(cbs) == 0  # XLA:CPU has no command buffers
        # One detail line per conditional and per while.
        details = re.findall(
            rf"^hlo (conditional|while): {model} \| {re.escape(variant)} \| "
            r"%\S+ in %\S+ \| in a command buffer: (yes|no)$",
            tiny_run,
            re.M,
        )
        assert sum(op == "conditional" for op, _ in details) == cond
        assert sum(op == "while" for op, _ in details) == whiles
        found[model, variant] = cond
    assert sorted(found) == sorted((m, v) for m in MODELS for v in JAX_VARIANTS)


def test_env_and_scaling_lines(tiny_run):
    env = "\n".join(re.findall(r"^env: .*$", tiny_run, re.M))
    for name in ("jax", "jaxlib", "flax", "optax", "torch")[: 4 + HAVE_TORCH]:
        assert re.search(rf"\b{name} \d+\.\d+", env), env
    platform = jax.default_backend()
    assert re.search(rf"jax device .+ \(platform {platform}, \d+ device", env), env
    assert "backend platform_version:" in env and "XLA_FLAGS=" in env
    if HAVE_TORCH:
        # --tiny runs torch on the CPU; its build may still be a CUDA one (a GPU
        # image's torch 2.11.0+cu130 says 13.0).
        cuda = r"(None|\d+(\.\d+)*)"
        assert re.search(rf"torch device .*, torch.version.cuda {cuda},", env), env
    assert re.search(rf"total wall time {NUMBER} s", env), env
    # Every timed step of the scaled variants was finite and applied.
    skipped = re.findall(
        r"^scaling: (\w+) \| .+ \| skipped (\d+) of (\d+)", tiny_run, re.M
    )
    assert len(skipped) == 4 and all(s == "0" and int(n) > 0 for _, s, n in skipped)
    assert "FAILED" not in tiny_run


def test_full_configuration_refuses_without_a_gpu(tmp_path):
    if jax.default_backend() == "gpu":
        pytest.skip("a GPU is present: the full configuration would run")
    proc = run_script(SCRIPT, "--no-torch", cwd=tmp_path, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "No GPU" in proc.stderr and "--tiny" in proc.stderr
    assert proc.stdout == ""


def test_account_lines(tiny_run):
    # Per model, cast by hand and through autocast: the kernels and bytes of
    # the dynamic_scaling step against the bare one (benchmarks/step_account.py).
    totals = re.findall(
        r"^account: (\w+) (hand|autocast) \| [\d,]+ params in \d+ leaves \| "
        r"kernels (\d+) -> (\d+) \([+-]\d+\) \| bytes .* B/param\)$",
        tiny_run,
        re.M,
    )
    assert sorted((m, k) for m, k, *_ in totals) == sorted(
        (m, k) for m in MODELS for k in ("hand", "autocast")
    ), tiny_run
    assert all(int(bare) > 0 and int(ours) > 0 for *_, bare, ours in totals)
