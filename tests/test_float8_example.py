"""``examples/float8_char.py`` runs with float8 on, and docs/measurements.md
shows the committed run (``docs/_static/float8_char.json``)."""

import importlib.util
import json
import math
import re
import shlex
from pathlib import Path

import pytest
from helpers import run_script

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "float8_char.py"
COMMITTED = ROOT / "docs" / "_static" / "float8_char.json"
HEADING = "## Float8 matmuls: the char transformer"
RUNS = ("fp32", "bf16", "fp8-current", "fp8-rowwise", "fp8-delayed")
WIDE = ROOT / "docs" / "_static" / "float8_char_d256.json"


def _module():
    spec = importlib.util.spec_from_file_location("float8_char", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _section() -> str:
    """The float8 section of docs/measurements.md (the file's last)."""
    text = (ROOT / "docs" / "measurements.md").read_text()
    assert HEADING in text, f"docs/measurements.md has no '{HEADING}' section."
    section = text[text.index(HEADING) :]
    assert not re.search(r"^## ", section[len(HEADING) :], re.M), (
        "the float8 section should be the last of docs/measurements.md"
    )
    return section


def test_example_runs_with_float8_on(tmp_path):
    proc = run_script(
        SCRIPT,
        *("--steps", "3", "--seeds", "0", "--eval-every", "3"),
        *("--eval-batches", "1", "--json", "out.json", "--out", str(tmp_path)),
        cwd=tmp_path,
    )
    assert proc.returncode == 0, f"float8_char.py failed:\n{proc.stdout}{proc.stderr}"
    out = proc.stdout
    for name in RUNS:
        row = re.search(
            rf"^seed 0  {re.escape(name)} +val (\S+) \(float32 eval (\S+)\) .* "
            r"float8 sites (\d+) ",
            out,
            re.M,
        )
        assert row, f"no result line for {name}:\n{out}"
        assert math.isfinite(float(row.group(1))), row.group(0)
        assert math.isfinite(float(row.group(2))), row.group(0)
        sites = int(row.group(3))
        assert (sites > 0) == name.startswith("fp8"), row.group(0)
        # The table: one row per run.
        assert re.search(rf"^{re.escape(name)} +[\d.]+ +[\d.]+ ± [\d.]+ ", out, re.M)
    # One seed: no spread, and the script says so rather than judging.
    assert out.count("one seed, no spread to compare with") == 3, out
    assert (tmp_path / "float8_char.png").is_file()

    doc = json.loads((tmp_path / "out.json").read_text())
    assert [(r["name"], r["seed"]) for r in doc["runs"]] == [(n, 0) for n in RUNS]
    for r in doc["runs"]:
        assert r["val"] == [[3, r["final_val"]]]
        assert math.isfinite(r["final_val"]) and math.isfinite(r["train_loss_last20"])
        assert (r["float8_sites"] > 0) == r["name"].startswith("fp8")
    # 2 layers x 4 projections + the head; the score products stay bfloat16.
    for name in ("fp8-current", "fp8-rowwise", "fp8-delayed"):
        assert doc["summary"][name]["float8_sites"] == 9


def test_docs_table_is_the_committed_run():
    """docs/_static/float8_char.json is a run at the script's defaults (three
    seeds); its summary is its runs' numbers, and the section of
    docs/measurements.md has its table, its verdicts and the command that made
    it."""
    f8 = _module()
    doc = json.loads(COMMITTED.read_text())
    defaults = {
        k: v for k, v in vars(f8.parse_args([])).items() if k not in f8.OUTPUT_OPTIONS
    }
    assert doc["config"] == defaults
    assert sorted((r["name"], r["seed"]) for r in doc["runs"]) == sorted(
        (n, s) for n in RUNS for s in (0, 1, 2)
    )
    for r in doc["runs"]:
        assert r["final_val"] == r["val"][-1][1]
        assert r["val"][-1][0] == defaults["steps"]
    summary = f8.summarise(doc["runs"], list(RUNS))
    assert json.loads(json.dumps(summary)) == doc["summary"]

    section = _section()
    for line in f8.markdown_table(summary).splitlines():
        assert line in section, line
    for line in f8.verdicts(summary):
        assert line in section, line
    for name in ("fp8-current", "fp8-rowwise", "fp8-delayed"):
        assert summary[name]["float8_sites"] == 9
    # The command shown reproduces the committed config.
    commands = re.findall(r"^python examples/float8_char\.py(.*)$", section, re.M)
    assert commands, "the section shows no command"
    cfg = vars(f8.parse_args(shlex.split(commands[0])))
    assert {k: v for k, v in cfg.items() if k in defaults} == doc["config"]


def test_docs_table_of_the_wide_model_is_its_committed_runs():
    """docs/_static/float8_char_d256.json: width 256, the runs of the two
    commands the section shows (their bf16 runs are the same), summarised by
    the script; the section has its table and verdicts, and every float8
    recipe is on a par with bf16 there (issue 32, item 5)."""
    f8 = _module()
    doc = json.loads(WIDE.read_text())
    section = _section()
    wide = section[section.index("### Width 256") :]
    blocks = re.findall(
        r"^python examples/float8_char\.py(.*?)(?<!\\)$",
        wide.replace("\\\n", " "),
        re.M,
    )
    assert len(blocks) == 2, blocks
    cfgs = [vars(f8.parse_args(shlex.split(b.replace("\\", " ")))) for b in blocks]
    for cfg in cfgs:
        got = {k: v for k, v in cfg.items() if k in doc["config"] and k != "runs"}
        assert got == {k: v for k, v in doc["config"].items() if k != "runs"}
    assert (
        {n for c in cfgs for n in c["runs"]} == set(doc["config"]["runs"]) == set(RUNS)
    )
    assert doc["config"]["dim"] >= 256
    assert sorted((r["name"], r["seed"]) for r in doc["runs"]) == sorted(
        (n, s) for n in RUNS for s in (0, 1, 2)
    )
    summary = f8.summarise(doc["runs"], list(RUNS))
    assert json.loads(json.dumps(summary)) == doc["summary"]
    for line in f8.markdown_table(summary).splitlines():
        assert line in wide, line
    for line in f8.verdicts(summary):
        assert line in wide, line
    for name in ("fp8-current", "fp8-rowwise", "fp8-delayed"):
        assert summary[name]["within_bf16_spread"] is True, name
