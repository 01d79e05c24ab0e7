"""The benchmarks run: ``--quick`` (tiny sizes, a few rounds) so they cannot rot.

``pinned``: what they print (kernels and bytes of float8 against bfloat16, of the
scaled step against the bare one, memory against the hand-cast model) are one
XLA's figures on one machine, so they run in the default environment only."""

import re
from pathlib import Path

import jax
import pytest
from helpers import run_script

pytestmark = [pytest.mark.integration, pytest.mark.pinned]

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def test_autocast_benchmark_quick(tmp_path):
    proc = run_script(BENCHMARKS / "autocast.py", "--quick", cwd=tmp_path)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    rows = re.findall(r"^\| (\w+) \| autocast \| ([\d.]+) \[", out, re.M)
    assert [model for model, _ in rows] == ["mlp", "cnn", "transformer"], out
    for model in ("mlp", "cnn", "transformer"):
        # Every model reports converts before and after optimisation, compile
        # times, temporary memory and a comparison of the compiled programs.
        section = out.split(f"== {model}:")[1].split("\n== ")[0].split("\n| ")[0]
        assert section.count("converts before optimisation") == 2, section
        assert section.count("converts compiled") == 2, section
        assert "compiled HLO vs hand:" in section, section
        assert re.search(r"autocast/hand: step [\d.]+ .* temp memory [\d.]+", section)
    # A loss scale of 2**10 keeps these steps finite: every timed step applied.
    skipped = re.findall(r"rounds, (\d+) skipped\)", out)
    assert len(skipped) == 6 and set(skipped) == {"0"}, out


def test_masked_attention_benchmark(tmp_path):
    pytest.importorskip("equinox")  # one of its attentions is equinox's
    proc = run_script(BENCHMARKS / "masked_attention.py", cwd=tmp_path)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    rows = re.findall(
        r"^\| (.+?) \| ([\d.]+), ([\d.]+) \| ([\d.]+), ([\d.]+) \|$", out, re.M
    )
    assert len(rows) == 6, out
    for _, nan16, dev16, nanbf, devbf in rows:
        assert float(nan16) == float(nanbf) == 0.0, out  # no NaN anywhere
        assert float(dev16) < 0.01 and float(devbf) < 0.05, out


def test_float8_benchmark_tiny(tmp_path):
    # benchmarks/float8.py --tiny: the size sweep and the train step, each of
    # bfloat16, the cost model's choice, float8 current and rowwise; every
    # float8 program has its float8 dots in the form XLA:GPU's GEMM rewriter
    # takes (three per site); the targets it can judge are printed.
    proc = run_script(BENCHMARKS / "float8.py", "--tiny", cwd=tmp_path)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    variants = ["bfloat16", "float8 chosen", "float8 current", "float8 rowwise"]
    sweep = re.findall(
        r"^\| (\d+) \| ([\w ]+?) \| [\d.]+ \|.*\| (\d+) / (\d+) / (None|\d+) \|$",
        out,
        re.M,
    )
    assert [(d, v) for d, v, *_ in sweep] == [
        (d, v) for d in ("32", "64") for v in variants
    ], out
    for _, variant, dots, rewritable, gemms in sweep:
        # The cost model leaves these tiny products in bfloat16.
        expected = "0" if variant in ("bfloat16", "float8 chosen") else "3"
        assert (dots, rewritable) == (expected, expected), out
        # Compiled float8 GEMMs: counted on a GPU only.
        assert gemms == ("None" if jax.default_backend() == "cpu" else expected), out
    models = re.findall(
        r"^\| realistic \| ([\w ]+?) \| .* \| (\d+) / (\d+) / (?:None|\d+) \| "
        r"([\d.]+) \|$",
        out,
        re.M,
    )
    assert [m[0] for m in models] == variants
    # One layer: qkv, proj, two MLP matrices and the tied head are float8 sites.
    assert [m[1:3] for m in models] == [("0", "0")] * 2 + [("15", "15")] * 2, out
    losses = [float(m[3]) for m in models]
    assert all(abs(v - losses[0]) < 0.05 for v in losses), losses
    # GPT-2-small's target judged (the tiny model stands in for it here), and
    # the compile-time one.
    assert re.search(
        r"^targets: GPT-2-small, default choice \(float8 chosen\): [\d.]+ of "
        r"bfloat16, target <= 1\.00: (met|MISSED)$",
        out,
        re.M,
    ), out
    assert re.search(r"^targets: compile time, worst .* target <= 1\.50: ", out, re.M)


def test_float8_passes_benchmark_tiny(tmp_path):
    # benchmarks/float8_passes.py --tiny: the compiled steps' kernels and bytes,
    # float8 against bfloat16, with nothing run.
    proc = run_script(BENCHMARKS / "float8_passes.py", "--tiny", cwd=tmp_path)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    rows = re.findall(
        r"^\| (\w+) \| ([\w0-9 ]+?) \| (\d+) \| (\d+) \((\d+)\) \| ([\d.,]+) \| "
        r"([\d.,]+) \| [\d.]+ \([\d.]+\) \| (.+?) \| (.+?) \| (.+?) \|$",
        out,
        re.M,
    )
    variants = [
        "bfloat16",
        "float8 current",
        "float8 rowwise",
        "float8 delayed",
        "float8 chosen",
    ]
    assert [r[:2] for r in rows] == [
        (m, v) for m in ("site", "realistic") for v in variants
    ], out
    for model, sites in (("site", "1"), ("realistic", "5")):
        got = {r[1]: r for r in rows if r[0] == model}
        base = got["bfloat16"]
        assert base[2] == "0" and base[7:] == ("-", "-", "-"), out
        # The cost model leaves these tiny products in 16 bits: the bf16 program.
        assert got["float8 chosen"][2:7] == base[2:7], out
        for name in ("float8 current", "float8 rowwise", "float8 delayed"):
            row = got[name]
            assert row[2] == sites, out
            assert int(row[3]) > int(base[3]) and float(row[7]) > 0, out
            if jax.default_backend() == "cpu":
                # More bytes, the quantisation passes: a fact of XLA:CPU, which
                # the script compiled for (it compiles for the default backend;
                # XLA:GPU fuses the passes into their neighbours, -0.5 MiB on an
                # H200 for the realistic model's current scaling).
                assert float(row[9]) > 0, out
        # Our kernel bytes and XLA's estimate agree to 1%.
        for row in got.values():
            ours, xla = (float(c.replace(",", "")) for c in row[5:7])
            assert abs(ours - xla) <= 0.01 * xla + 0.1, row


def test_step_account_tiny(tmp_path):
    # benchmarks/step_account.py --tiny: the MLP and a one-layer GPT, each
    # compiled bare and with dynamic_scaling; a totals line and a table row
    # each, and the optimized HLO written where --dump says.
    proc = run_script(
        BENCHMARKS / "step_account.py", "--tiny", "--dump", "hlo", cwd=tmp_path
    )
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    for model in ("mlp", "gpt-tiny"):
        totals = re.search(
            rf"^account: {model} \| [\d,]+ params in \d+ leaves \| kernels (\d+) -> "
            rf"(\d+) \([+-]\d+\) \| bytes .*, ([+-][\d.]+) B/param\)$",
            out,
            re.M,
        )
        assert totals, out
        assert int(totals.group(1)) > 0 and int(totals.group(2)) > 0
        # One read of the float32 gradients is 4 bytes a parameter; a CPU
        # also writes and reads a one-byte mask per element and stacks it.
        assert float(totals.group(3)) <= 12.0, totals.group(0)
        assert re.search(rf"^\| {model} \| [\d,]+ \| \d+ \| \d+ -> \d+", out, re.M)
        for name in ("bare", "scaled"):
            assert (tmp_path / "hlo" / f"{model}_{name}.hlo.txt").stat().st_size > 0


def test_compiled_memory_benchmark(tmp_path):
    # benchmarks/compiled_memory.py: the ratios the pinned memory tests assert,
    # for this jax and CPU; one row per model.
    proc = run_script(BENCHMARKS / "compiled_memory.py", cwd=tmp_path)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert re.search(r"^env: jax [\d.]+ \| .*avx512_fp16 (True|False)$", out, re.M)
    rows = re.findall(
        r"^\| (.+?) \| ([\d,]+) \| ([\d,]+) \| ([\d,]+) \| ([\d.]+) \| ([\d.]+) \| "
        r"(.+) ([\d.]+) \|$",
        out,
        re.M,
    )
    assert [r[0] for r in rows] == ["sync BatchNorm block", "Dense stack"], out
    sync = rows[0]
    assert sync[6] == "autocast / no axis_name" and float(sync[7]) <= 1.02, out


def test_wire_benchmark_small(tmp_path):
    """Two device counts, a small gradient: the all-to-all's error does not grow,
    a float16 wire halves the bytes of a float32 pmean."""
    proc = run_script(
        BENCHMARKS / "wire.py",
        *("--devices", "8,16", "--size", "4096", "--small-only"),
        cwd=tmp_path,
    )
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    a2a = re.search(r"^\| all-to-all f16 \+ f32 sum \| .*\(([\d.]+)x\) \|$", out, re.M)
    assert a2a and float(a2a.group(1)) < 1.15, out
    f16 = re.search(r"reduce_mean float16 \| [\d.]+ MB \(([\d.]+)\)", out)
    assert f16 and 0.49 < float(f16.group(1)) < 0.52, out


def test_gradient_wire_benchmark_small(tmp_path):
    """On 8 CPU devices: float16 autocast's weight gradients reduced in float32
    by default (the float32 program's bytes), in float16 at half of them."""
    proc = run_script(
        BENCHMARKS / "gradient_wire.py", "--dim", "64", "--batch", "64", cwd=tmp_path
    )
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    rows = {
        tuple(line.split()[:3]): float(line.split()[4])
        for line in out.splitlines()
        if line.startswith(("DP ", "FSDP "))
    }
    assert rows[("DP", "float16", "float32")] == pytest.approx(1.0, abs=0.02), out
    assert rows[("DP", "float16", "float16")] == pytest.approx(0.5, abs=0.02), out


def test_wire_training_benchmark_small(tmp_path):
    """Two seeds of a tiny char transformer over 8 CPU devices: float8 all-to-all
    with error feedback ends within twice float32 pmean's seed spread."""
    proc = run_script(
        BENCHMARKS / "wire_training.py",
        *("--steps", "30", "--seeds", "2", "--dim", "32", "--runs", "f32,f8"),
        cwd=tmp_path,
    )
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert re.search(
        r"^\| float32 pmean \| [\d.]+ ± [\d.]+ \| \d+ \| reference", out, re.M
    )
    f8 = re.search(r"^\| float8 e4m3 \+ error feedback \| .*\|$", out, re.M)
    assert f8 and "within twice the seed spread" in f8.group(0), out


def test_param_values_benchmark_quick(tmp_path):
    # benchmarks/param_values.py --quick: Gemma- and Griffin-style blocks, each
    # scale form and the in-function mask at the plain form's temporary memory
    # (issue 40), with no float32 island the plain form lacks.
    proc = run_script(BENCHMARKS / "param_values.py", "--quick", cwd=tmp_path)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    rows = re.findall(
        r"^\| (gemma|griffin) \| ([\w ,]+?) \| [\d.]+ \| [\d.]+ "
        r"\| ([\d.]+) \| (\d+) \|$",
        out,
        re.M,
    )
    assert [(m, f) for m, f, *_ in rows] == [
        ("gemma", "plain"),
        ("gemma", "one plus"),
        ("gemma", "softplus"),
        ("gemma", "exp"),
        ("griffin", "plain"),
        ("griffin", "softplus"),
        ("griffin", "exp"),
    ], out
    plain = {m: islands for m, f, _, islands in rows if f == "plain"}
    for model, _, ratio, islands in rows:
        assert float(ratio) <= 1.05 and int(islands) == int(plain[model]), out


def test_sensor_cost_benchmark_quick(tmp_path):
    # benchmarks/sensor_cost.py --quick: the MLP's steps timed side by side, a
    # row each, ratios to the float32 step and trace + compile times.
    proc = run_script(
        BENCHMARKS / "sensor_cost.py",
        "--quick",
        "--models",
        "mlp",
        "--blocks",
        "1",
        "--rounds",
        "2",
        "--steps-per-round",
        "1",
        cwd=tmp_path,
    )
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert out.startswith("env: jax "), out
    rows = re.findall(
        r"^\| mlp \(2 sites\) \| ([\w ,=]+) \| [\d.]+ \| \*\*([\d.]+)\*\* "
        r"\([\d.]+-[\d.]+\) \| [\d.]+ \| -?[\d.]+ \| -?[\d.]+ \|$",
        out,
        re.M,
    )
    steps = ["float32", "bfloat16", "monitor", "sensor", "sensor, rows=None"]
    assert [name for name, _ in rows] == steps, out
    assert float(rows[0][1]) == 1.0, out
