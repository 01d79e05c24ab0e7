"""The precision guide, ``docs/precision.md``, runs as written (integration
tier: it measures a model and solves its plan; a unit test runs no guide)."""

import contextlib
import io
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

DOCS = Path(__file__).resolve().parents[1] / "docs"


def test_the_guide_runs_and_prints_its_plan():
    """docs/precision.md: its ``python`` blocks run in order as one file, and
    print what its ``text`` blocks show."""
    text = (DOCS / "precision.md").read_text()
    blocks = re.findall(r"^```python\n(.*?)^```", text, re.M | re.S)
    shown = re.findall(r"^```text\n(.*?)^```", text, re.M | re.S)
    assert blocks and shown
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile("\n".join(blocks), "docs/precision.md", "exec"), {})
    assert out.getvalue() == "".join(shown)
