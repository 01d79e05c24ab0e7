"""``benchmarks/precision_gpu.py`` (``.ci/gpu --precision``) runs on any machine
at its tiny size and prints its table: a plan's predicted site time next to the
measured step ratio, for each variant."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.pinned]

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_the_precision_gpu_benchmark_runs_tiny():
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "precision_gpu.py"),
            "--tiny",
            "--rounds",
            "2",
            "--steps-per-round",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ")]
    cells = [[c.strip() for c in r.strip("|").split("|")] for r in rows]
    assert cells[0][0] == "variant"
    assert [c[0] for c in cells[1:]] == [
        "bfloat16",
        "plan",
        "plan, 16-bit or float8",
        "float8 everywhere",
    ]
    assert cells[1][1:3] == ["1.000", "1.000 (1.000-1.000)"]
    assert float(cells[4][1]) > 1  # float8 everywhere: predicted slower here
    assert "precision plan: 7 sites" in done.stdout


def test_the_replan_benchmark_raises_sites_and_skips_nothing(tmp_path):
    """``benchmarks/precision_replan.py``: activations grow past float16's
    range; the monitored plan is raised and skips no step, the fixed one does."""
    out = tmp_path / "replan.json"
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "precision_replan.py"),
            "--steps",
            "320",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    runs = {r["name"]: r for r in json.loads(out.read_text())["runs"]}
    assert runs["float32"]["skipped_steps"] == 0
    assert runs["monitored"]["skipped_steps"] == 0
    assert runs["fixed plan"]["skipped_steps"] > 0
    changes = [c["change"] for c in runs["monitored"]["changes"]]
    assert changes and all("raised by the monitor" in c for c in changes)
