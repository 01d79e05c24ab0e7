"""``.ci/gpu``, the one command for a GPU, in its CPU smoke mode: the four parts
run, each writes its file into one folder, and the summary has one line per part;
the suite's part says which collected tests never ran, a suite cut off by its
limit included.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.pinned]

ROOT = Path(__file__).resolve().parents[1]


def gpu_command(
    out: Path, env: dict, timeout: int, smoke: bool = True
) -> subprocess.CompletedProcess:
    """``.ci/gpu [--smoke] OUT`` run with ``env``."""
    return subprocess.run(
        ["bash", str(ROOT / ".ci" / "gpu"), *(["--smoke"] if smoke else []), str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_the_gpu_command_smoke_mode(tmp_path):
    out = tmp_path / "run"
    env = {**os.environ, "PYTHON": sys.executable, "MPLBACKEND": "Agg"}
    done = gpu_command(out, env, 900)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = (out / "summary.txt").read_text().splitlines()
    assert [line.split(":")[0] for line in lines] == [
        "suite",
        "gpu.py",
        "account",
        "float8",
    ]
    assert all(": ok in " in line for line in lines), lines
    assert "passed" in lines[0] and "never ran 0 of " in lines[0]
    collected = (out / "collected.txt").read_text().splitlines()
    ran = [line.split("\t")[0] for line in (out / "ran.txt").read_text().splitlines()]
    assert collected and sorted(ran) == sorted(collected)
    assert (out / "never_ran.txt").read_text() == ""
    assert (out / "slowest.txt").stat().st_size > 0
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
    env = {**os.environ, "PYTHON": sys.executable}
    done = gpu_command(tmp_path / "run", env, 300, smoke=False)
    assert done.returncode == 2
    assert "no GPU backend" in done.stderr and "--smoke" in done.stderr


def test_a_spent_budget_skips_the_parts_and_says_so(tmp_path):
    out = tmp_path / "run"
    done = gpu_command(
        out, {**os.environ, "PYTHON": sys.executable, "BUDGET": "0"}, 300
    )
    assert done.returncode == 1
    lines = (out / "summary.txt").read_text().splitlines()
    assert [line.split(":")[0] for line in lines] == [
        "suite",
        "gpu.py",
        "account",
        "float8",
    ]
    assert all("SKIPPED" in line for line in lines), lines
    assert "(PARTS=suite .ci/gpu)" in lines[0]
    assert all("(.ci/gpu --rest)" in line for line in lines[1:]), lines
    assert not (out / "suite.txt").exists()


def test_a_suite_cut_off_by_its_limit_says_which_tests_never_ran(tmp_path):
    """``PARTS=suite``, ``SUITE`` and ``SUITE_LIMIT``: the suite's part alone, on
    a file whose second test outlasts the limit; the summary and never_ran.txt
    name it and the one after it, from what was written as it happened."""
    test = tmp_path / "test_stuck.py"
    test.write_text(
        "import time\n\nimport pytest\n\npytestmark = pytest.mark.unit\n\n\n"
        "def test_quick():\n    pass\n\n\n"
        "def test_stuck():\n    time.sleep(600)\n\n\n"
        "def test_after():\n    pass\n"
    )
    out = tmp_path / "run"
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "PARTS": "suite",
        "SUITE": f"-p conftest {test}",
        "SUITE_LIMIT": "45",
        "PYTHONPATH": str(ROOT / "tests"),
    }
    done = gpu_command(out, env, 300)
    assert done.returncode == 1, done.stdout + done.stderr
    (line,) = (out / "summary.txt").read_text().splitlines()
    assert line.startswith("suite: TIMED OUT after 45 s"), line
    assert line.endswith("never ran 2 of 3 (never_ran.txt)"), line

    # Node ids are relative to pytest's rootdir, which depends on where the
    # checkout and the temporary folder are: compare from the file's name on.
    def ids(lines):
        return [line[line.index("test_stuck.py") :] for line in lines]

    never = ["test_stuck.py::test_stuck", "test_stuck.py::test_after"]
    assert ids((out / "never_ran.txt").read_text().splitlines()) == never
    shown = done.stdout.splitlines()[:2]
    assert all(line.startswith("never ran: ") for line in shown), shown
    assert ids(shown) == never
    ran = (out / "ran.txt").read_text().splitlines()
    assert ids(ran)[0].startswith("test_stuck.py::test_quick\t"), ran


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
