"""``examples/precision_char.py`` runs every row, and its plan row names a format
for every site the sensor found."""

import importlib.util
import json
import math
import re
import shlex
from pathlib import Path

import pytest
from helpers import run_script

import jaxscale as jxs
import jaxscale.precision

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "precision_char.py"
F = jxs.precision.Format


def _module():
    spec = importlib.util.spec_from_file_location("precision_char", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_example_runs_every_row(tmp_path):
    pc = _module()
    proc = run_script(
        SCRIPT,
        *("--steps", "2", "--seeds", "0", "--eval-every", "2", "--eval-batches", "1"),
        *("--dim", "16", "--heads", "2", "--layers", "1", "--calibration", "1"),
        *("--json", "out.json"),
        cwd=tmp_path,
    )
    assert proc.returncode == 0, (
        f"precision_char.py failed:\n{proc.stdout}{proc.stderr}"
    )
    assert "one seed: no spread to judge with" in proc.stdout
    assert "WARNING" not in proc.stdout, proc.stdout

    doc = json.loads((tmp_path / "out.json").read_text())
    assert [(r["name"], r["seed"]) for r in doc["runs"]] == [(n, 0) for n in pc.ROWS]
    assert list(doc["summary"]) == list(pc.ROWS)
    for r in doc["runs"]:
        assert math.isfinite(r["final_val"]), r["name"]
    seed = doc["seeds"]["0"]
    sites = [s["site"] for s in seed["sites"]]
    assert len(sites) == 5  # one block's 4 projections and the head
    # The plan names a format for every site, and so does every row.
    plan = {s["site"]: s["format"] for s in seed["plan"]["sites"]}
    assert sorted(plan) == sorted(sites)
    for name in pc.ROWS:
        assert sorted(seed["formats"][name]) == sorted(sites), name
    assert set(seed["formats"]["fp8"].values()) == {"FLOAT8"}
    # A float8 site per FLOAT8 format: the rows ran the formats they report.
    for r in doc["runs"]:
        f8 = sum(f == "FLOAT8" for f in seed["formats"][r["name"]].values())
        assert r["float8_sites"] == (0 if r["name"] == "fp32" else f8), r["name"]
    for row in doc["summary"].values():
        for kind in ("H100", "H200"):
            assert all(v > 0 for v in row[f"ratio_{kind}"])
    assert doc["summary"]["bf16"]["ratio_H100"] == [1.0]


def _measure(site, shape, f8):
    return jxs.precision.SiteMeasure(site, shape, (2, 4), {F.HALF: 0.1, F.FLOAT8: f8})


def test_rows_from_the_sensor():
    """The torchao rule by shape; keep-top/low by the float8 score."""
    pc = _module()
    measures = [
        _measure("a", (8192, 8192, 8192), 3.0),  # K > 4096: float8 for torchao
        _measure("b", (8192, 4096, 1024), 1.0),  # K <= 4096, N <= 1024: 16 bits
        _measure("c", (8192, 1024, 2048), 2.0),  # N > 1024: float8
    ]
    fm = pc.row_formats("torchao", measures, None, 0)
    assert fm == {"a": F.FLOAT8, "b": F.HALF, "c": F.FLOAT8}
    assert pc.row_formats("keep-top1", measures, None, 0)["a"] is F.HALF
    top2 = pc.row_formats("keep-top2", measures, None, 0)
    assert top2 == {"a": F.HALF, "b": F.FLOAT8, "c": F.HALF}
    low1 = pc.row_formats("keep-low1", measures, None, 0)
    assert low1 == {"a": F.FLOAT8, "b": F.HALF, "c": F.FLOAT8}
    ends = pc.row_formats("fp8-ends", measures, None, 0)
    assert ends == {"a": F.HALF, "b": F.FLOAT8, "c": F.HALF}
    assert pc.speed_ratio(dict.fromkeys("abc", F.HALF), measures, "H100") == 1.0
    # Large products: float8 predicted faster on both kinds.
    for kind in pc.DEVICES:
        assert pc.speed_ratio(dict.fromkeys("abc", F.FLOAT8), measures, kind) < 1


@pytest.mark.parametrize("name", ["64", "256", "256_300"])
def test_docs_tables_are_the_committed_runs(name):
    """docs/examples.md shows the committed runs' tables (from their JSON, by
    the script's own ``markdown_table``) and the commands that made them."""
    pc = _module()
    path = ROOT / "docs" / "_static" / f"precision_char_{name}.json"
    doc = json.loads(path.read_text())
    text = (ROOT / "docs" / "examples.md").read_text()
    heading = "## Adaptive precision: `precision_char.py`"
    assert heading in text
    section = text[text.index(heading) :]
    section = section[: section.index("\n## ", 1)]
    for line in pc.markdown_table(doc["summary"]).splitlines():
        assert line in section, line
    commands = [
        vars(pc.parse_args(shlex.split(c)))
        for c in re.findall(r"^python examples/precision_char\.py(.*)$", section, re.M)
    ]
    config = doc["config"]
    assert any(
        {k: v for k, v in c.items() if k in config} == config for c in commands
    ), (config, commands)
