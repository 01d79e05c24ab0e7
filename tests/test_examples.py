"""Every script in examples/ runs to completion with a small ``--steps``."""

import importlib.util
import json
import re
from pathlib import Path

import pytest
from helpers import run_script

pytestmark = pytest.mark.integration

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
SCRIPTS = sorted(EXAMPLES.glob("*.py"))


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


def _check_padded_lm(out: str) -> None:
    # Padded attention under autocast: finite, no step skipped (the mask constant
    # saturates instead of becoming -inf).
    for run in ("fp32", "fp16-autocast"):
        row = re.search(
            rf"^{re.escape(run)} +(\S+) +(\S+) +(\S+) +(\d+)/30 ", out, re.M
        )
        assert row, out
        assert all(0 < float(v) < 10 for v in row.groups()[:3]), row.group(0)
        assert row.group(4) == "0", row.group(0)


def _check_why_scaling(out: str) -> None:
    # The summary table: every run with its mean and spread over the seeds.
    for run in ("fp32", "fp16", "fp16+jaxscale", "bf16"):
        assert re.search(rf"^{re.escape(run)} +[\d.]+ ± [\d.]+ \(", out, re.M), out
    assert "activation gradients: fp16 backward, loss scale 1" in out
    assert re.search(r"^L1\.scores +\d+ +1 ", out, re.M), out
    assert re.search(r"^logits +\d+ +1 ", out, re.M), out
    _check_png(out)
    _check_why_scaling_json(out)


# Extra checks of an example's output, by file name.
CHECKS = {
    "why_scaling.py": _check_why_scaling,
    "quickstart.py": _check_quickstart,
    "diagnostics.py": _check_diagnostics,
    "digits_cnn.py": _check_digits_cnn,
    "char_transformer.py": _check_char_transformer,
    "padded_lm.py": _check_padded_lm,
}


def test_there_are_examples():
    assert EXAMPLES / "quickstart.py" in SCRIPTS


# Arguments beyond --steps 30, by file name (a smaller model where the default
# would take minutes).
ARGS = {
    "char_transformer.py": [
        *("--layers", "1", "--context", "32", "--dim", "32", "--heads", "2"),
        *("--accumulate", "2", "--eval-every", "30", "--eval-batches", "2"),
    ],
    "padded_lm.py": [
        *("--runs", "fp32,fp16-autocast", "--context", "16", "--dim", "16"),
        *("--layers", "1", "--heads", "2", "--mlp-dim", "32", "--batch", "4"),
        *("--eval-batches", "1", "--eval-every", "30"),
    ],
    "why_scaling.py": [
        *("--seeds", "2", "--context", "32", "--batch", "8", "--layers", "2"),
        *("--eval-every", "10", "--eval-batches", "2", "--json", "metrics.json"),
    ],
}


# Examples with a test file of their own, which runs every row of them: each
# example runs once per pass.
OWN_TESTS = {
    "float8_char.py": "test_float8_example.py",
    "precision_char.py": "test_precision_example.py",
}
HERE = [s for s in SCRIPTS if s.name not in OWN_TESTS]


def test_examples_with_their_own_test_have_one():
    tests = Path(__file__).resolve().parent
    for script, test in OWN_TESTS.items():
        assert (EXAMPLES / script).is_file(), script
        assert script in (tests / test).read_text(), (script, test)


@pytest.mark.parametrize("script", HERE, ids=[s.name for s in HERE])
def test_example_runs(script, tmp_path):
    proc = run_script(script, "--steps", "30", *ARGS.get(script.name, []), cwd=tmp_path)
    assert proc.returncode == 0, f"{script.name} failed:\n{proc.stdout}{proc.stderr}"
    if script.name in CHECKS:
        CHECKS[script.name](proc.stdout)


def _check_why_scaling_json(out: str) -> None:
    """``--json`` holds every run and seed, the summary and the per-site
    cotangent statistics; the scale leaves fewer small cotangents than none."""
    path = Path(re.search(r"^metrics written to (.+\.json)$", out, re.M).group(1))
    doc = json.loads(path.read_text())
    runs = {(r["name"], r["seed"]) for r in doc["runs"]}
    names = ("fp32", "fp16", "fp16+jaxscale", "bf16")
    assert runs == {(n, s) for n in names for s in (0, 1)}
    for r in doc["runs"]:
        assert [v[0] for v in r["val"]] == [10, 20, 30]
        assert r["final_val"] == r["val"][-1][1]
        assert (r["final_scale"] == 1.0) == (r["name"] != "fp16+jaxscale")
    assert set(doc["summary"]) == set(names)
    assert doc["summary"]["fp32"]["gap_to_fp32_mean"] == 0.0
    cot = doc["cotangents"]
    assert cot["scale"] == doc["runs"][2]["final_scale"]
    layer = ["attn", "mlp", "out", "scores"]  # sorted, as jit returns a dict
    sites = [f"L{i}.{s}" for i in range(2) for s in layer] + ["logits"]
    assert list(cot["fp32"]) == list(cot["unscaled"]) == list(cot["scaled"]) == sites
    for site in sites:
        exact, unscaled, scaled = (
            cot["fp32"][site],
            cot["unscaled"][site],
            cot["scaled"][site],
        )
        for stats in (exact, unscaled, scaled):
            assert stats["size"] > 0 and stats["calls"] == 1
            for k in ("zero_fraction", "flush_fraction", "subnormal_fraction"):
                assert 0.0 <= stats[k] <= 1.0
        # float16 zeros include the exact ones (the causal mask of the scores).
        assert unscaled["zero_fraction"] >= exact["zero_fraction"]
        assert scaled["max_abs"] > unscaled["max_abs"]
        assert scaled["subnormal_fraction"] <= unscaled["subnormal_fraction"]
    # The mask: (t*t - t*(t+1)/2) / t*t of the scores' cotangent is exactly zero.
    assert cot["fp32"]["L0.scores"]["zero_fraction"] == pytest.approx(31 / 64, abs=1e-3)


def _why_scaling_module():
    spec = importlib.util.spec_from_file_location(
        "why_scaling", EXAMPLES / "why_scaling.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _why_scaling_tables(why, doc: dict) -> tuple[list[str], list[str]]:
    """The lines of the run table and the per-site table made from ``doc``,
    after checking that its summary is its runs' final validation losses."""
    names = ("fp32", "fp16", "fp16+jaxscale", "bf16")
    assert sorted((r["name"], r["seed"]) for r in doc["runs"]) == sorted(
        (n, s) for n in names for s in range(3)
    )
    summary = {
        n: {**row, "final_val": {int(k): v for k, v in row["final_val"].items()}}
        for n, row in doc["summary"].items()
    }
    for n in names:
        finals = [r["final_val"] for r in doc["runs"] if r["name"] == n]
        assert sorted(summary[n]["final_val"].values()) == sorted(finals)
    runs, sites = why.markdown_tables(summary, doc["cotangents"]).split("\n\n")
    return runs.splitlines(), sites.splitlines()


def test_why_scaling_docs_show_the_committed_runs():
    """docs/_static/why_scaling.json is a run at the script's defaults and
    why_scaling_32x256.json one at 32 x 256 tokens for 300 steps (four runs,
    three seeds each); the docs/measurements.md tables (the per-site one of the
    32 x 256 run only), and the README's table of the 32 x 256 run, are made
    from them."""
    why = _why_scaling_module()
    root = EXAMPLES.parent
    static = root / "docs" / "_static"
    readme = (root / "README.md").read_text()
    measurements = (root / "docs" / "measurements.md").read_text()
    defaults = {
        k: v for k, v in vars(why.parse_args([])).items() if k not in why.OUTPUT_OPTIONS
    }
    large = {**defaults, "batch": 32, "context": 256, "steps": 300}
    # Where each run's table is shown: the README keeps only the 32 x 256 one.
    pages = {
        "why_scaling": (measurements,),
        "why_scaling_32x256": (readme, measurements),
    }
    for name, config in (("why_scaling", defaults), ("why_scaling_32x256", large)):
        doc = json.loads((static / f"{name}.json").read_text())
        assert doc["config"] == config, name
        assert (static / f"{name}.png").stat().st_size > 10_000
        runs, sites = _why_scaling_tables(why, doc)
        for line in runs:
            assert all(line in page for page in pages[name]), (name, line)
        if name == "why_scaling_32x256":  # the per-site table of the larger run
            for line in sites:
                assert line in measurements, (name, line)


def _split_by_run(doc: dict, tmp_path: Path) -> list[str]:
    """``doc`` as two --json files, as two partial runs of the script write them."""
    paths = []
    for i, names in enumerate((("fp32", "fp16+jaxscale"), ("fp16", "bf16"))):
        part = {
            **doc,
            "config": {**doc["config"], "runs": ",".join(names)},
            "runs": [r for r in doc["runs"] if r["name"] in names],
            "cotangents": doc["cotangents"] if i == 0 else {},
            "seconds": doc["seconds"] / 2,
        }
        paths.append(str(tmp_path / f"part{i}.json"))
        Path(paths[-1]).write_text(json.dumps(part))
    return paths


def test_why_scaling_from_json_merges_partial_runs(tmp_path, capsys):
    """--from-json on the committed run split in two gives back its summary,
    tables and cotangents without training, and a plot."""
    why = _why_scaling_module()
    committed = EXAMPLES.parent / "docs" / "_static" / "why_scaling.json"
    doc = json.loads(committed.read_text())
    merged = tmp_path / "merged.json"
    paths = _split_by_run(doc, tmp_path)
    why.main(["--from-json", *paths, "--json", str(merged), "--out", str(tmp_path)])
    out = capsys.readouterr().out
    back = json.loads(merged.read_text())
    assert back["config"] == doc["config"]
    assert back["summary"] == doc["summary"]
    assert back["cotangents"] == doc["cotangents"]
    assert back["seconds"] == pytest.approx(doc["seconds"])
    key = lambda r: (r["seed"], r["name"])  # noqa: E731
    assert sorted(back["runs"], key=key) == sorted(doc["runs"], key=key)
    runs, sites = _why_scaling_tables(why, doc)
    for line in runs + sites:
        assert line in out, line
    assert (tmp_path / "why_scaling.png").stat().st_size > 10_000


def test_why_scaling_from_json_refuses_to_mix_experiments(tmp_path):
    why = _why_scaling_module()
    committed = EXAMPLES.parent / "docs" / "_static" / "why_scaling.json"
    doc = json.loads(committed.read_text())
    a, b = _split_by_run(doc, tmp_path)
    other = json.loads(Path(b).read_text())
    other["config"]["context"] = 256
    Path(b).write_text(json.dumps(other))
    with pytest.raises(SystemExit, match=r"other settings .*\(context\)"):
        why.main(["--from-json", a, b, "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="repeats run 'fp32' seed 0"):
        why.main(["--from-json", a, a, "--out", str(tmp_path)])


def test_why_scaling_from_json_refuses_training_options(tmp_path, capsys):
    why = _why_scaling_module()
    with pytest.raises(SystemExit):
        why.parse_args(["--from-json", "a.json", "--steps", "5", "--lr", "0.1"])
    err = capsys.readouterr().err
    assert "settings from the files; drop --lr, --steps" in err, err
