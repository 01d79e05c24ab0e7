"""examples/padded_lm.py and benchmarks/autocast_memory.py run at tiny sizes.

Both run in this process through their ``main(argv)``, under standard dtype
promotion: ``optax.adamw`` and flax's float16 normalization layers promote
implicitly (the example keeps rank promotion strict; the benchmark's char
transformer, from examples/char_transformer.py, needs it). The example runs once
per run (each compiles its own train step) to keep each test short.
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]


def _load(path: Path):
    """The module at ``path``, registered under its file name (the benchmark
    imports the examples by that name)."""
    if path.stem in sys.modules:
        return sys.modules[path.stem]
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module


padded_lm = _load(ROOT / "examples" / "padded_lm.py")
autocast_memory = _load(ROOT / "benchmarks" / "autocast_memory.py")

TINY = [
    *("--steps", "3", "--context", "16", "--dim", "16", "--layers", "1"),
    *("--heads", "2", "--mlp-dim", "32", "--batch", "4", "--eval-batches", "1"),
]
FIELDS = {
    "name",
    "train_loss",
    "val_loss",
    "val_loss_fp32_eval",
    "steps",
    "skipped_steps",
    "final_loss_scale",
    "nonfinite_train_losses",
    "params_finite",
    "any_nan",
    "val",
    "seconds",
}
LOSSES = ("train_loss", "val_loss", "val_loss_fp32_eval")


def _finite_loss(x) -> bool:
    return x is not None and math.isfinite(x) and 0.0 < x < 10.0


# fp32 and fp16-autocast run through the command line in tests/test_examples.py.
@pytest.mark.parametrize("run", ["fp16-hand", "bf16-autocast"])
def test_padded_lm_runs(run, tmp_path, capsys):
    path = tmp_path / "padded_lm.json"
    with jax.numpy_dtype_promotion("standard"):
        doc = padded_lm.main([*TINY, "--runs", run, "--json", str(path)])
    out = capsys.readouterr().out
    assert json.loads(path.read_text()) == json.loads(json.dumps(doc))
    assert doc["config"]["pad"] == 0.3 and doc["config"]["runs"] == run
    assert doc["vocab"] > 50 and doc["files"]
    (r,) = doc["runs"]
    assert r["name"] == run and set(r) == FIELDS, r
    assert r["steps"] == 3 and 0 <= r["skipped_steps"] <= 3
    assert 0 <= r["nonfinite_train_losses"] <= 3
    assert [v[0] for v in r["val"]] == [3] and r["val"][-1][1] == r["val_loss"]
    assert r["any_nan"] == (
        r["nonfinite_train_losses"] > 0
        or not r["params_finite"]
        or any(r[k] is None for k in ("val_loss", "val_loss_fp32_eval"))
    )
    # The loss scale: 1 without scaling, a power of two with it.
    scale = r["final_loss_scale"]
    if run in ("fp32", "bf16-autocast"):
        assert scale == 1.0
    else:
        assert scale > 0 and math.log2(scale) == int(math.log2(scale))
    assert re.search(rf"^{re.escape(run)} +(\S+ +){{5}}(yes|no) ", out, re.M), out
    if run in ("fp32", "fp16-hand"):
        # Flax's own float16 masks with finfo(float16).min: finite, as float32.
        assert all(_finite_loss(r[k]) for k in LOSSES), r
        assert not r["any_nan"] and r["params_finite"]
    if run == "fp32":
        assert r["skipped_steps"] == 0
    # Before autocast's constants kept their meaning, finfo(float32).min became
    # -inf in float16 and in bfloat16, the fully masked rows of the padded
    # sequences were NaN and every autocast step was skipped.
    if run in ("fp16-autocast", "bf16-autocast"):
        assert all(_finite_loss(r[k]) for k in LOSSES), r
        assert not r["any_nan"] and r["skipped_steps"] == 0, r


def test_padded_lm_refuses_bad_options(capsys):
    with pytest.raises(SystemExit):
        padded_lm.parse_args(["--runs", "fp32,fp8"])
    assert "`--runs` must name distinct runs from fp32" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        padded_lm.parse_args(["--pad", "1.5"])
    assert "`--pad` must be in [0, 1], got 1.5." in capsys.readouterr().err


QUICK = ("resnet_sync", "padded_lm")


@pytest.mark.pinned  # benchmarks/autocast_memory.py: one XLA's figures
def test_autocast_memory_quick(tmp_path, capsys):
    path = tmp_path / "memory.json"
    # Flax's hand-cast BatchNorm and LayerNorm promote float16 statistics to
    # float32 implicitly (flax/linen/normalization.py), and char_transformer's
    # GPT adds its [t, d] positions to [b, t, d] embeddings.
    with jax.numpy_dtype_promotion("standard"), jax.numpy_rank_promotion("allow"):
        # The two models test_autocast_memory_at_most_hand_cast does not
        # compile at full size: each row's format is the same for every model.
        doc = autocast_memory.main(
            ["--quick", "--models", ",".join(QUICK), "--json", str(path)]
        )
    out = capsys.readouterr().out
    assert json.loads(path.read_text()) == json.loads(json.dumps(doc))
    assert list(doc["models"]) == list(QUICK)
    mib = r"(\d+\.\d+)"
    rows = re.findall(
        rf"^\| (\w+) \| {mib} \| {mib} \| {mib} \| {mib} \| "
        r"ratio <= 1\.00: (MET|NOT MET) \| (\d+|-), (\d+|-) \|$",
        out,
        re.M,
    )
    assert [row[0] for row in rows] == list(QUICK), out
    for model, fp32, hand, auto, ratio, verdict, islands, islands_hand in rows:
        assert float(fp32) > 0 and float(hand) > 0 and float(auto) > 0, out
        r = doc["models"][model]
        for k in ("fp32_bytes", "hand_bytes", "autocast_bytes"):
            assert isinstance(r[k], int) and r[k] > 0, k
        assert r["ratio"] == pytest.approx(r["autocast_bytes"] / r["hand_bytes"])
        assert float(ratio) == pytest.approx(r["ratio"], abs=5e-4)
        assert (verdict == "MET") == r["target_met"]
        counted = r["f32_islands"]
        assert counted["largest_f16_elements"] > 0, counted
        assert int(islands) == counted["count"] == sum(counted["by_primitive"].values())
        assert int(islands_hand) == r["f32_islands_hand"]["count"]


@pytest.mark.pinned
@pytest.mark.parametrize("model", ["resnet", "char_transformer"])
def test_autocast_memory_at_most_hand_cast(model):
    """The normalisation rule keeps BatchNorm's and LayerNorm's outputs (and what
    follows them) in float16: the compiled gradient's temporary memory at the
    benchmark's full size is at most the hand-cast model's (before the rule:
    ResNet 1.011, char transformer 1.130). The Flax attention LM is not pinned:
    its float32 softmax probabilities (torch's rule) are where it differs from
    Flax's float16 softmax (docs/autocast.md)."""
    with (
        jax.numpy_dtype_promotion("standard"),
        jax.numpy_rank_promotion("allow"),
        jax.default_device(jax.devices("cpu")[0]),  # XLA:CPU's figure, on a GPU too
    ):
        # Like with like: 16-bit weight-gradient products, as the hand-cast
        # model has (the default's float32 ones cost 1.6% more on the char
        # transformer: docs/multidevice.md).
        r = autocast_memory.measure(model, quick=False, gradient_dtype=jnp.float16)
    assert r["autocast_bytes"] <= r["hand_bytes"], r
