"""The real-data examples at their default size reach docs/measurements.md's numbers.

These run ``examples/digits_cnn.py`` and ``examples/char_transformer.py`` with
their default ``--steps`` (about a minute each on a free 2-core CPU), so they
are marked ``slow``: run them with ``pytest --runslow`` or ``JAXSCALE_SLOW=1``.
``tests/test_examples.py`` runs both with ``--steps 30`` in every test run and
checks their output's shape.
"""

import re
from pathlib import Path

import pytest
from helpers import run_script

pytestmark = pytest.mark.integration

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _run(script: str, tmp_path: Path) -> str:
    proc = run_script(
        EXAMPLES / script, "--out", str(tmp_path), cwd=tmp_path, timeout=900
    )
    assert proc.returncode == 0, f"{script} failed:\n{proc.stdout}{proc.stderr}"
    assert (tmp_path / script.replace(".py", ".png")).is_file()
    return proc.stdout


def _number(pattern: str, out: str) -> float:
    match = re.search(pattern, out, re.M)
    assert match, f"{pattern!r} not in:\n{out}"
    return float(match.group(1))


@pytest.mark.slow
def test_digits_cnn_fp16_with_scaling_matches_fp32(tmp_path):
    out = _run("digits_cnn.py", tmp_path)
    gap = _number(r"fp16\+jaxscale vs fp32 test accuracy: ([-+\d.]+) points", out)
    assert abs(gap) <= 1.0, out
    assert _number(r"^fp16\+jaxscale +[\d.]+% +([\d.]+)%", out) >= 95.0, out
    # The float32 model under jxs.autocast reaches the hand-cast float16 run.
    auto = r"fp16\+autocast vs fp16\+jaxscale test accuracy: ([-+\d.]+) points"
    assert abs(_number(auto, out)) <= 0.5, out
    # At the trained parameters float16 flushes gradient elements to zero, and
    # the final loss scale keeps most of them.
    unscaled = _number(r"^trained +2\*\*0 +([\d.]+)%", out)
    scaled = _number(r"^trained +2\*\*[1-9]\d* +([\d.]+)%", out)
    assert unscaled > 1.0 and scaled < unscaled / 4, out


@pytest.mark.slow
def test_char_transformer_fp16_with_scaling_matches_fp32(tmp_path):
    out = _run("char_transformer.py", tmp_path)
    gap = _number(r"fp16\+jaxscale vs fp32 validation loss: ([-+\d.]+) nats", out)
    assert abs(gap) <= 0.02, out
    assert _number(r"^fp16\+jaxscale +([\d.]+) ", out) < 2.2, out
    # The float32 model under jxs.autocast: within 1% of the hand-cast run.
    auto = r"fp16\+autocast vs fp16\+jaxscale validation loss: \S+ nats/char \((\S+)%\)"
    assert abs(_number(auto, out)) <= 1.0, out
