"""``.ci/gpu``, the one command for a GPU, in its CPU smoke mode: the four parts
run, each writes its file into one folder, and the summary has one line per part.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.pinned]

ROOT = Path(__file__).resolve().parents[1]


def test_the_gpu_command_smoke_mode(tmp_path):
    out = tmp_path / "run"
    env = {**os.environ, "PYTHON": sys.executable, "MPLBACKEND": "Agg"}
    done = subprocess.run(
        ["bash", str(ROOT / ".ci" / "gpu"), "--smoke", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = (out / "summary.txt").read_text().splitlines()
    assert [line.split(":")[0] for line in lines] == [
        "suite",
        "gpu.py",
        "account",
        "float8",
    ]
    assert all(": ok in " in line for line in lines), lines
    assert "passed" in lines[0]
    for name in ("env.txt", "suite.txt", "gpu_py.txt", "account.txt"):
        assert (out / name).stat().st_size > 0, name
    assert (out / "float8_models.txt").stat().st_size > 0
    # The account of each model: its totals line and its Markdown row.
    account = (out / "account.txt").read_text()
    for model in ("mlp", "gpt-tiny"):
        assert f"account: {model} | " in account, account
        assert f"| {model} | " in account, account
    assert "backend cpu" in (out / "env.txt").read_text()
    assert done.stdout.splitlines()[-4:] == lines


def test_the_full_mode_refuses_without_a_gpu(tmp_path):
    if (
        "gpu"
        in subprocess.run(
            [sys.executable, "-c", "import jax; print(jax.default_backend())"],
            capture_output=True,
            text=True,
        ).stdout
    ):
        pytest.skip("a GPU is here: the full mode would run")
    done = subprocess.run(
        ["bash", str(ROOT / ".ci" / "gpu"), str(tmp_path / "run")],
        cwd=ROOT,
        env={**os.environ, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2
    assert "no GPU backend" in done.stderr and "--smoke" in done.stderr


def test_a_spent_budget_skips_the_parts_and_says_so(tmp_path):
    out = tmp_path / "run"
    done = subprocess.run(
        ["bash", str(ROOT / ".ci" / "gpu"), "--smoke", str(out)],
        cwd=ROOT,
        env={**os.environ, "PYTHON": sys.executable, "BUDGET": "0"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 1
    lines = (out / "summary.txt").read_text().splitlines()
    assert [line.split(":")[0] for line in lines] == [
        "suite",
        "gpu.py",
        "account",
        "float8",
    ]
    assert all("SKIPPED" in line and "--rest" in line for line in lines), lines
    assert not (out / "suite.txt").exists()


def test_failures_are_written_as_they_happen(tmp_path):
    """``JAXSCALE_FAILURES``: tests/conftest.py appends each failure's traceback
    to the file when the test fails, not when the session ends (a run cut off
    by its time limit keeps them)."""
    test = tmp_path / "test_fails.py"
    test.write_text(
        "import pytest\n\npytestmark = pytest.mark.unit\n\n\n"
        "def test_ok():\n    assert True\n\n\n"
        "def test_wrong():\n    assert 1 + 1 == 3, 'arithmetic'\n"
    )
    log = tmp_path / "failures.txt"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "conftest",
            "-p",
            "no:cacheprovider",
            str(test),
        ],
        cwd=tmp_path,
        env={
            **os.environ,
            "JAXSCALE_FAILURES": str(log),
            "PYTHONPATH": str(ROOT / "tests"),
        },
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    text = log.read_text()
    assert "=== test_fails.py::test_wrong (call)" in text
    assert "arithmetic" in text and "test_ok" not in text
