"""Every script in examples/ runs to completion with a small ``--steps``."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
SCRIPTS = sorted(EXAMPLES.glob("*.py"))


def _run(script: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    # A headless matplotlib backend, in case an example draws a plot.
    env = {**os.environ, "MPLBACKEND": "Agg"}
    return subprocess.run(
        [sys.executable, str(script), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def _check_quickstart(out: str) -> None:
    assert "loss scale" in out
    # The scale starts at 2**24 and visibly backs off on the first steps.
    assert "step     1" in out
    summary = out.strip().splitlines()[-1]
    match = re.search(r"final loss scale (\S+) .* (\d+) of 30 steps skipped", summary)
    assert match, summary
    assert float(match.group(1)) < 2.0**24
    assert int(match.group(2)) >= 1


def _check_diagnostics(out: str) -> None:
    # The injected overflow (step 20 of the default --inject-at) is found by name.
    assert "injected at step 20: found in layer2/w" in out, out
    assert "recommended init_scale: 2**" in out
    png = Path(re.search(r"^wrote (.+\.png)$", out, re.M).group(1))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _check_png(out: str) -> None:
    png = Path(re.search(r"^plot saved to (.+\.png)$", out, re.M).group(1))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _check_digits_cnn(out: str) -> None:
    # The accuracy table: one row per run, train and test accuracy in percent.
    for run in ("fp32", "fp16", "fp16+jaxscale", "fp16+autocast"):
        assert re.search(rf"^{re.escape(run)} +[\d.]+% +[\d.]+% ", out, re.M), out
    assert "fp16+jaxscale vs fp32 test accuracy:" in out
    assert "fp16+autocast vs fp16+jaxscale test accuracy:" in out
    # Underflow at the initial parameters: the scale keeps what fp16 flushes.
    rows = re.findall(r"^initial +2\*\*(\d+) +([\d.]+)%", out, re.M)
    assert [r[0] for r in rows] == ["0", "16"], out
    assert float(rows[1][1]) < float(rows[0][1])
    _check_png(out)


def _check_char_transformer(out: str) -> None:
    for run in ("fp32", "fp16+jaxscale", "fp16+autocast"):
        assert re.search(rf"^{re.escape(run)} +[\d.]+ +[\d.]+ ", out, re.M), out
    assert "fp16+jaxscale vs fp32 validation loss:" in out
    assert "fp16+autocast vs fp16+jaxscale validation loss:" in out
    assert re.search(r"loss scale 2\*\*0 .*% flushed to zero", out), out
    _check_png(out)


# Extra checks of an example's output, by file name.
CHECKS = {
    "quickstart.py": _check_quickstart,
    "diagnostics.py": _check_diagnostics,
    "digits_cnn.py": _check_digits_cnn,
    "char_transformer.py": _check_char_transformer,
}


def test_there_are_examples():
    assert EXAMPLES / "quickstart.py" in SCRIPTS


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.name for s in SCRIPTS])
def test_example_runs(script, tmp_path):
    proc = _run(script, "--steps", "30", cwd=tmp_path)
    assert proc.returncode == 0, f"{script.name} failed:\n{proc.stdout}{proc.stderr}"
    if script.name in CHECKS:
        CHECKS[script.name](proc.stdout)
