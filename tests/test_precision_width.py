"""benchmarks/precision_width.py (issue 49 item 6): the default plan of a GPT at
width, priced for an H200, against the usual float8 rules on the same measures.
The rules pick the sites they say; the quick run prints both tables."""

import importlib.util
import json
import sys
from pathlib import Path

import jax
import pytest

import jaxscale as jxs
import jaxscale.precision

pytestmark = pytest.mark.integration

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "precision_width.py"
_SPEC = importlib.util.spec_from_file_location("precision_width", _PATH)
bench = sys.modules.setdefault(
    "precision_width", importlib.util.module_from_spec(_SPEC)
)
_SPEC.loader.exec_module(bench)
F = jxs.precision.Format


def _plan():
    """A plan of three dense sites at d 4096 (the first, a narrow one, the
    head) and one batched site, with noise figures."""

    def site(name, shape, kind="dense"):
        formats = (F.HALF, F.FLOAT8) if kind == "dense" else (F.HALF,)
        return jxs.precision.SiteMeasure(
            name,
            shape,
            (4, 4),
            {f: 1e-4 * (1 + 100 * (f is F.FLOAT8)) for f in formats},
            noise={f: 1e-4 * (1 + 100 * (f is F.FLOAT8)) for f in formats},
            kind=kind,
        )

    measures = [
        site("qkv", (32768, 4096, 12288)),
        site("scores", (32768, 128, 256), "batched"),
        site("out", (32768, 4096, 1024)),
        site("head", (32768, 4096, 50304)),
    ]
    return jxs.precision.solve(measures, cost="H200")


def test_the_rules_pick_their_sites():
    plan = _plan()
    fmt = {n: bench.rule_formats(n, plan) for n in bench.RULES}
    assert set(fmt["bf16"].values()) == {F.HALF}
    assert fmt["fp8"] == {
        "qkv": F.FLOAT8,
        "scores": F.HALF,
        "out": F.FLOAT8,
        "head": F.FLOAT8,
    }
    # torchao: K <= 4096 and N <= 1024 stays 16-bit (out), the rest float8.
    assert [s for s, f in fmt["torchao"].items() if f is F.FLOAT8] == ["qkv", "head"]
    # The first and last dense sites (not the batched one) in 16 bits.
    assert [s for s, f in fmt["fp8-ends"].items() if f is F.FLOAT8] == ["out"]
    assert fmt["plan"] == plan.formats()
    rows = {n: bench.row(n, plan, 2) for n in bench.RULES}
    assert rows["bf16"]["ratio"] == pytest.approx(1.0)
    assert rows["fp8"]["ratio"] < 1.0 and rows["fp8"]["float8"] == 3
    assert rows["fp8"]["noise"] == pytest.approx(3 * 1.01e-2 + 1e-4)
    # The plan spends at most its budget and is no slower than any rule within it.
    assert rows["plan"]["noise"] <= plan.budget
    assert rows["plan"]["ratio"] <= min(r["ratio"] for r in rows.values()) + 1e-9


def test_quick_run_prints_the_tables(tmp_path, capsys):
    out = tmp_path / "width.json"
    with jax.numpy_rank_promotion("allow"):  # gpu.py's GPT adds positions
        bench.main(["--quick", "--json", str(out)])
    text = capsys.readouterr().out
    assert "precision plan:" in text and "H200" in text
    assert "| d | rule | float8 sites | noise spent | H200 time |" in text
    doc = json.loads(out.read_text())
    (res,) = doc["results"].values()
    assert list(res["rows"]) == list(bench.RULES)
    assert res["rows"]["bf16"]["ratio"] == pytest.approx(1.0)
    assert res["spent"] <= res["budget"]
    assert {s["kind"] for s in res["sites"]} == {"dense", "batched"}


def test_the_measurements_tables_are_the_recorded_runs():
    """docs/measurements.md ("Precision at width") quotes the tables that the
    recorded JSON files give."""
    root = Path(__file__).resolve().parents[1]
    docs = (root / "docs" / "measurements.md").read_text()
    static = root / "docs" / "_static"
    results = {}
    for d in (1024, 4096):
        doc = json.loads((static / f"precision_width_{d}.json").read_text())
        results.update(doc["results"])
    tables = [bench.rows_table(results, 64), bench.sites_table(results["4096"], 64)]
    spec = importlib.util.spec_from_file_location(
        "precision_char", root / "examples" / "precision_char.py"
    )
    char = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(char)
    run = json.loads((static / "precision_char_1024.json").read_text())
    tables.append(char.markdown_table(run["summary"]))
    for table in tables:
        for line in table.splitlines():
            assert line in docs, line
