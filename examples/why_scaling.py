"""Why loss scaling matters: a character-level GPT in float32, float16, float16 +
jaxscale and bfloat16.

A decoder-only transformer (GPT-2 layout: pre-LayerNorm blocks, weights tied
between the embedding and the head, initial weights of standard deviation 0.02
with the residual projections scaled by ``1/sqrt(2 * layers)``) learns to
predict the next character of Python source code (the standard library's own
``.py`` files, as in ``char_transformer.py``). The loss is the mean
cross-entropy over every token of the batch, as in nanoGPT, and the optimizer
is AdamW with warm-up, cosine decay and clipping by global norm.

The model is written once, in float32. Four runs start from the same
parameters and see the same batches:

1. ``fp32``: the model as written;
2. ``fp16``: its loss under ``jxs.autocast(loss, jnp.float16)`` (matmuls in
   float16, norms, softmax and the loss in float32), no loss scaling;
3. ``fp16+jaxscale``: the same, with ``jxs.dynamic_scaling`` at torch's
   defaults (initial scale ``2**16``, growth every 2000 finite steps);
4. ``bf16``: ``jxs.autocast(loss, jnp.bfloat16)``, no loss scaling.

It runs the four for each seed (3 by default), prints the final validation
loss of every run with the mean and spread over the seeds, and measures with
``jxs.diagnostics.cotangent_report`` where in the network float16 loses the gradient:
per layer, the fraction of the activation gradients (the cotangents of the
backward pass) that float16 flushes to zero or leaves subnormal, without a
scale and at the scale ``dynamic_scaling`` settled on. ``--json PATH`` writes
every metric; a plot goes to ``--out``.

Run it (about 5 minutes on a 2-core CPU)::

    python examples/why_scaling.py

At this size float16 without a scale ends where float32 does. With the loss a
mean over 32 x 256 tokens for 300 steps (about 3.5 minutes per run, 40 in all)
it ends clearly worse; the runs can be split over several processes and
merged afterwards without training again::

    python examples/why_scaling.py --batch 32 --context 256 --steps 300 \
        --runs fp32,fp16,fp16+jaxscale --json a.json
    python examples/why_scaling.py --batch 32 --context 256 --steps 300 \
        --runs bf16 --json b.json
    python examples/why_scaling.py --from-json a.json b.json --json all.json
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxscale as jxs

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from char_transformer import load_text, make_batches  # noqa: E402

RUNS = ("fp32", "fp16", "fp16+jaxscale", "bf16")
# Options that say where results go, not how to train: not part of a run's config.
OUTPUT_OPTIONS = ("json", "out", "from_json")
# run name -> (autocast dtype or None, dynamic loss scaling)
SETTINGS = {
    "fp32": (None, False),
    "fp16": (jnp.float16, False),
    "fp16+jaxscale": (jnp.float16, True),
    "bf16": (jnp.bfloat16, False),
}


def tokenize(text: str, kind: str, vocab: int) -> tuple[np.ndarray, int]:
    """Characters, or words (identifiers, numbers, runs of spaces, single other
    characters; the ``vocab - 1`` most frequent, the rest one unknown token)."""
    if kind == "char":
        chars = sorted(set(text))
        index = {c: i for i, c in enumerate(chars)}
        return np.array([index[c] for c in text], np.int32), len(chars)
    import collections
    import re

    words = re.findall(r"\w+| +|\n|[^\w ]", text)
    common = [w for w, _ in collections.Counter(words).most_common(vocab - 1)]
    index = {w: i + 1 for i, w in enumerate(common)}
    return np.array([index.get(w, 0) for w in words], np.int32), vocab


# --------------------------------------------------------------------------- #
# The model: plain float32 JAX, probes at every layer
# --------------------------------------------------------------------------- #


def init_params(key: jax.Array, vocab: int, cfg: argparse.Namespace) -> dict:
    """GPT-2 initialisation: normal(0.02), residual projections / sqrt(2L)."""
    d, std = cfg.dim, cfg.init_std
    resid = std / np.sqrt(2 * cfg.layers)
    keys = iter(jax.random.split(key, 2 + 4 * cfg.layers))

    def normal(shape, s):
        return s * jax.random.normal(next(keys), shape, jnp.float32)

    def norm():
        return {"scale": jnp.ones(d), "bias": jnp.zeros(d)}

    blocks = [
        {
            "ln1": norm(),
            "qkv": {"w": normal((d, 3 * d), std), "b": jnp.zeros(3 * d)},
            "proj": {"w": normal((d, d), resid), "b": jnp.zeros(d)},
            "ln2": norm(),
            "fc": {"w": normal((d, 4 * d), std), "b": jnp.zeros(4 * d)},
            "out": {"w": normal((4 * d, d), resid), "b": jnp.zeros(d)},
        }
        for _ in range(cfg.layers)
    ]
    return {
        "embed": normal((vocab, d), std),
        "pos": normal((cfg.context, d), std),
        "blocks": blocks,
        "ln": norm(),
    }


def layer_norm(x: jax.Array, p: dict) -> jax.Array:
    mean = x.mean(-1, keepdims=True)
    var = jnp.square(x - mean).mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + 1e-5) * p["scale"] + p["bias"]


def dense(x: jax.Array, p: dict) -> jax.Array:
    return x @ p["w"] + p["b"]


def gpt(params: dict, tokens: jax.Array, heads: int) -> jax.Array:
    """Logits of the next character. Float32 as written; probes mark the sites."""
    probe = (
        jxs.diagnostics.cotangent_probe
    )  # the identity outside jxs.diagnostics.cotangent_report
    b, t = tokens.shape
    x = params["embed"][tokens] + params["pos"][:t]
    causal = jnp.tril(jnp.ones((t, t), jnp.bool_))
    for i, blk in enumerate(params["blocks"]):
        d = x.shape[-1]
        q, k, v = jnp.split(dense(layer_norm(x, blk["ln1"]), blk["qkv"]), 3, -1)
        q, k, v = (a.reshape(b, t, heads, d // heads) for a in (q, k, v))
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d // heads)
        scores = probe(scores, f"L{i}.scores")
        att = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)
        y = probe(jnp.einsum("bhqk,bkhd->bqhd", att, v), f"L{i}.attn")
        x = x + dense(y.reshape(b, t, d), blk["proj"])
        h = probe(dense(layer_norm(x, blk["ln2"]), blk["fc"]), f"L{i}.mlp")
        x = probe(x + dense(jax.nn.gelu(h), blk["out"]), f"L{i}.out")
    h = layer_norm(x, params["ln"])
    return probe(h @ params["embed"].T, "logits")  # tied head


def loss_fn(params: dict, x: jax.Array, y: jax.Array, heads: int) -> jax.Array:
    """Mean cross-entropy over every token of the batch."""
    logits = gpt(params, x, heads)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


# --------------------------------------------------------------------------- #
# Training
# --------------------------------------------------------------------------- #


def make_tx(cfg: argparse.Namespace, scaling: bool) -> optax.GradientTransformation:
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, cfg.lr, min(cfg.warmup, cfg.steps // 10 + 1), cfg.steps + 1, cfg.lr / 10
    )
    decay = functools.partial(jax.tree.map, lambda p: p.ndim == 2)  # not norms, biases
    inner = optax.chain(
        jxs.clip_by_global_norm(cfg.clip),
        optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=0.1, mask=decay),
    )
    loss_scale = jxs.DynamicLossScale.create() if scaling else jxs.NoOpLossScale()
    return jxs.dynamic_scaling(inner, loss_scale)


def objective(name: str, heads: int):
    """The run's loss: the float32 one, or it under ``jxs.autocast``."""
    dtype, _ = SETTINGS[name]
    f = functools.partial(loss_fn, heads=heads)
    return f if dtype is None else jxs.autocast(f, dtype)


@functools.cache
def compiled(name: str, cfg_items: tuple) -> tuple[Any, Any, Any]:
    """``(tx, step, evaluate)`` of a run, jitted once for all seeds."""
    cfg = argparse.Namespace(**dict(cfg_items))
    obj = objective(name, cfg.heads)
    tx = make_tx(cfg, SETTINGS[name][1])

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, opt_state, data, key, i):
        x, y = make_batches(data, cfg.context, cfg.batch, jax.random.fold_in(key, i))
        loss, grads = jxs.value_and_grad(obj, opt_state)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        s = jxs.diagnostics.summary(opt_state)
        out = (loss, s["loss_scale"], s["last_step_finite"])
        return optax.apply_updates(params, updates), opt_state, out

    @jax.jit
    def evaluate(params, val_x, val_y):  # in the run's own compute dtypes
        return jax.lax.map(lambda b: obj(params, *b), (val_x, val_y)).mean()

    return tx, step, evaluate


def train(name: str, seed: int, data, cfg: argparse.Namespace) -> dict[str, Any]:
    """One run: its losses, scales and validation losses, and final state."""
    train_data, val_data, vocab = data
    tx, step, evaluate = compiled(name, tuple(sorted(vars(cfg).items())))
    params = init_params(jax.random.key(seed), vocab, cfg)
    opt_state = tx.init(params)
    key = jax.random.key(1000 + seed)  # the batches: the same in every run
    val_x, val_y = make_batches(
        val_data, cfg.context, cfg.eval_batches * cfg.batch, jax.random.key(1234)
    )
    val_x = val_x.reshape(cfg.eval_batches, cfg.batch, cfg.context)
    val_y = val_y.reshape(cfg.eval_batches, cfg.batch, cfg.context)

    history, val = [], []
    start = time.perf_counter()
    for i in range(cfg.steps):
        params, opt_state, out = step(params, opt_state, train_data, key, i)
        history.append(out)
        if (i + 1) % cfg.eval_every == 0 or i + 1 == cfg.steps:
            val.append((i + 1, float(evaluate(params, val_x, val_y))))
    seconds = time.perf_counter() - start
    loss, scale, finite = (np.asarray(jnp.stack(h)) for h in zip(*history, strict=True))
    return {
        "name": name,
        "seed": seed,
        "params": params,
        "opt_state": opt_state,
        "loss": loss,
        "scale": scale,
        "finite": finite,
        "val": val,
        "seconds": seconds,
    }


def underflow(params: dict, data, cfg: argparse.Namespace, scale: float) -> dict:
    """Per probe site, statistics of the activation gradients on one training
    batch at ``params``, as ``{label: {site: {field: value}}}``:

    * ``"fp32"``: the float32 model's backward pass (its exact zeros, e.g. the
      masked attention scores, are not underflow);
    * ``"unscaled"``: the float16 backward pass under ``jxs.autocast``, loss
      scale 1 (``zero_fraction`` holds what it flushed);
    * ``"scaled"``: the same at loss scale ``scale``.
    """
    x, y = make_batches(data[0], cfg.context, cfg.batch, jax.random.key(99))
    out = {}
    for label, name, s in (
        ("fp32", "fp32", 1.0),
        ("unscaled", "fp16", 1.0),
        ("scaled", "fp16", scale),
    ):
        report = jax.jit(
            jxs.diagnostics.cotangent_report(objective(name, cfg.heads), s)
        )
        stats = report(params, x, y)
        print(f"\nactivation gradients: {name} backward, loss scale {s:g}")
        print(jxs.diagnostics.cotangent_table(stats))
        out[label] = stats_dict(stats)
    out["scale"] = scale
    return out


def summarise(results: list[dict], names: list[str]) -> dict[str, dict]:
    """Per run name: final validation loss per seed, mean, spread, and the gap
    to fp32 on the same seed (same parameters and batches)."""
    final = {
        n: {r["seed"]: r["val"][-1][1] for r in results if r["name"] == n}
        for n in names
    }
    out = {}
    for n in names:
        v = np.array(list(final[n].values()))
        row = {
            "final_val": final[n],
            "mean": float(v.mean()),
            "std": float(v.std(ddof=1)) if len(v) > 1 else 0.0,
            "min": float(v.min()),
            "max": float(v.max()),
        }
        if "fp32" in final:
            gaps = [
                final[n][s] - final["fp32"][s] for s in final[n] if s in final["fp32"]
            ]
            row["gap_to_fp32_mean"] = float(np.mean(gaps))
            row["gap_to_fp32_per_seed"] = [float(g) for g in gaps]
        out[n] = row
    return out


def lost(stats: dict, exact_zeros: float) -> float:
    """Fraction flushed to zero in float16: zeros beyond the float32 backward's
    (a float16 site), or float32 values that a cast would flush (a float32 site,
    e.g. the residual stream under autocast)."""
    return stats["zero_fraction"] - exact_zeros + stats["flush_fraction"]


def markdown_tables(summary: dict, cot: dict) -> str:
    """The two tables of the README and docs/examples.md, from the metrics."""
    seeds = sorted(next(iter(summary.values()))["final_val"])
    head = " | ".join(f"seed {s}" for s in seeds)
    lines = [
        f"| run | {head} | mean ± sd | vs fp32, paired mean |",
        "|---|" + "---|" * (len(seeds) + 2),
    ]
    for n, row in summary.items():
        per = " | ".join(f"{row['final_val'][s]:.4f}" for s in seeds)
        gap = f"{row['gap_to_fp32_mean']:+.4f}" if "gap_to_fp32_mean" in row else "-"
        lines.append(f"| {n} | {per} | {row['mean']:.4f} ± {row['std']:.4f} | {gap} |")
    if cot:
        scale = f"2**{np.log2(cot['scale']):g}"
        lines += [
            "",
            "| site | exact zeros (fp32) | flushed, scale 1 | subnormal, scale 1 "
            f"| flushed, {scale} | subnormal, {scale} | headroom at {scale} |",
            "|---|---|---|---|---|---|---|",
        ]
        for site, f32 in cot["fp32"].items():
            u, v = cot["unscaled"][site], cot["scaled"][site]
            z = f32["zero_fraction"]
            lines.append(
                f"| {site} | {100 * z:.2f}% "
                f"| {100 * lost(u, z):.2f}% "
                f"| {100 * u['subnormal_fraction']:.2f}% "
                f"| {100 * lost(v, z):.2f}% "
                f"| {100 * v['subnormal_fraction']:.2f}% "
                f"| {v['headroom_log2']:.1f} |"
            )
    return "\n".join(lines)


def stats_dict(report: dict) -> dict[str, dict[str, float]]:
    return {
        site: {k: float(v) for k, v in s._asdict().items()}
        for site, s in report.items()
    }


def plot(results: list[dict], cot: dict, path: str) -> bool:
    """Validation loss of every run and seed; flushed + subnormal cotangents per
    site without a scale and at the final scale. False without matplotlib."""
    try:
        import matplotlib
    except ImportError:  # pragma: no cover - depends on the environment
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.2))
    colors = dict(zip(RUNS, ("C0", "C3", "C2", "C1"), strict=True))
    for r in results:
        steps, values = zip(*r["val"], strict=True)
        label = r["name"] if r["seed"] == 0 else None
        ax.plot(
            steps, values, "o-", color=colors[r["name"]], alpha=0.7, ms=3, label=label
        )
    ax.set(xlabel="step", ylabel="validation cross-entropy (nats/char)")
    ax.set_title("char GPT: validation loss (each seed a line)")
    ax.legend()
    if cot:
        sites = list(cot["fp32"])
        xs = np.arange(len(sites))
        scale = f"loss scale 2**{np.log2(cot['scale']):g}"
        pairs = (("unscaled", "loss scale 1", "C3"), ("scaled", scale, "C2"))
        for k, (key, label, color) in enumerate(pairs):
            flushed = [
                100 * lost(cot[key][s], cot["fp32"][s]["zero_fraction"]) for s in sites
            ]
            subnormal = [100 * cot[key][s]["subnormal_fraction"] for s in sites]
            at = xs + 0.4 * k - 0.2
            bx.bar(at, flushed, 0.4, color=color, label=f"{label}: flushed to zero")
            bx.bar(
                at,
                subnormal,
                0.4,
                bottom=flushed,
                color=color,
                alpha=0.35,
                label=f"{label}: subnormal",
            )
        bx.set_xticks(xs, sites, rotation=60, ha="right", fontsize=8)
        bx.set(ylabel="% of the elements", ylim=(0, 130))
        bx.set_title("float16 activation gradients per site (fp16+jaxscale, end)")
        bx.legend(ncol=2, fontsize=8, loc="upper center")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; ``parse_args([])`` gives the defaults."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps")
    parser.add_argument("--seeds", type=int, default=3, help="seeds 0 .. n-1")
    parser.add_argument("--runs", default=",".join(RUNS), help="comma-separated")
    parser.add_argument("--context", type=int, default=128, help="tokens")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16, help="sequences")
    parser.add_argument("--lr", type=float, default=1e-3, help="peak AdamW rate")
    parser.add_argument("--warmup", type=int, default=30, help="warm-up steps")
    parser.add_argument("--init-std", type=float, default=0.02)
    parser.add_argument("--clip", type=float, default=1.0, help="max global norm")
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--eval-batches", type=int, default=4)
    parser.add_argument("--tokens", choices=("char", "word"), default="char")
    parser.add_argument("--vocab", type=int, default=4096, help="with --tokens word")
    parser.add_argument("--json", default=None, help="write the metrics here")
    parser.add_argument("--out", default="examples/out", help="folder for the plot")
    parser.add_argument(
        "--from-json",
        nargs="+",
        default=None,
        metavar="PATH",
        help="no training: merge the runs of earlier --json files (the same "
        "settings, e.g. one file per run name), print the tables, write the plot "
        "and, with --json, the merged metrics",
    )
    cfg = parser.parse_args(argv)
    names = cfg.runs.split(",")
    if cfg.steps < 1 or cfg.seeds < 1:
        parser.error(f"--steps and --seeds must be >= 1, got {cfg.steps}, {cfg.seeds}.")
    if not names or not set(names) <= set(RUNS):
        parser.error(f"--runs must name some of {', '.join(RUNS)}, got {cfg.runs!r}.")
    if cfg.from_json:  # the settings come from the files: say so, do not ignore
        given = sorted(
            f"--{k.replace('_', '-')}"
            for k, v in vars(cfg).items()
            if k not in OUTPUT_OPTIONS and v != parser.get_default(k)
        )
        if given:
            parser.error(
                "--from-json takes its settings from the files; drop "
                f"{', '.join(given)} (only --json and --out go with it)."
            )
    return cfg


def merge(paths: list[str]) -> tuple[dict, list[dict], dict, float]:
    """The settings, runs, cotangent statistics and seconds of earlier ``--json``
    files, which must agree on every setting but ``runs`` and ``seeds``."""
    docs = []
    for path in paths:
        with open(path) as f:
            docs.append(json.load(f))
    first = docs[0]["config"]
    for path, doc in zip(paths[1:], docs[1:], strict=True):
        differ = sorted(
            k
            for k in first.keys() | doc["config"].keys()
            if k not in ("runs", "seeds") and first.get(k) != doc["config"].get(k)
        )
        if differ:
            raise SystemExit(
                f"--from-json: {path} was run with other settings than {paths[0]} "
                f"({', '.join(differ)}); merge only runs of the same experiment"
            )
    runs, seen = [], set()
    for path, doc in zip(paths, docs, strict=True):
        for r in doc["runs"]:
            if (r["name"], r["seed"]) in seen:
                raise SystemExit(
                    f"--from-json: {path} repeats run {r['name']!r} seed {r['seed']}"
                )
            seen.add((r["name"], r["seed"]))
            runs.append({**r, "val": [tuple(v) for v in r["val"]]})
    runs.sort(key=lambda r: (r["seed"], RUNS.index(r["name"])))
    cot = next((doc["cotangents"] for doc in docs if doc["cotangents"]), {})
    config = {**docs[0]["config"], "seeds": len({r["seed"] for r in runs})}
    config["runs"] = ",".join(n for n in RUNS if any(r["name"] == n for r in runs))
    return config, runs, cot, float(sum(doc["seconds"] for doc in docs))


def main(argv: list[str] | None = None) -> None:
    cfg = parse_args(argv)
    if cfg.from_json:
        config, runs, cot, seconds = merge(cfg.from_json)
        names = config["runs"].split(",")
        report(cfg, config, runs, summarise(runs, names), cot, seconds)
        return
    names = cfg.runs.split(",")
    text, _ = load_text()
    tokens, vocab = tokenize(text, cfg.tokens, cfg.vocab)
    split = int(0.9 * len(tokens))
    data = (jnp.asarray(tokens[:split]), jnp.asarray(tokens[split:]), vocab)
    print(
        f"jaxscale {jxs.__version__}: {len(tokens):,} {cfg.tokens} tokens "
        f"(vocabulary {vocab}); {cfg.layers} layers of width {cfg.dim}; "
        f"{cfg.steps} steps of {cfg.batch} x {cfg.context} tokens (the loss is "
        f"their mean); runs {', '.join(names)}; seeds 0..{cfg.seeds - 1}",
        flush=True,
    )
    start = time.perf_counter()
    results = []
    for seed in range(cfg.seeds):
        for name in names:
            r = train(name, seed, data, cfg)
            results.append(r)
            skipped = int((~r["finite"]).sum())
            print(
                f"seed {seed}  {name:<14} val {r['val'][-1][1]:.4f}  "
                f"train {r['loss'][-20:].mean():.4f}  skipped {skipped}"
                f"  scale {r['scale'][-1]:g}  {r['seconds']:.1f}s",
                flush=True,
            )

    summary = summarise(results, names)
    cot = {}
    scaled = [r for r in results if r["name"] == "fp16+jaxscale" and r["seed"] == 0]
    if scaled:  # where float16 loses gradient, at the end of training
        cot = underflow(scaled[0]["params"], data, cfg, float(scaled[0]["scale"][-1]))
    runs = [
        {
            "name": r["name"],
            "seed": r["seed"],
            "val": r["val"],
            "final_val": r["val"][-1][1],
            "train_loss_last20": float(r["loss"][-20:].mean()),
            "skipped": int((~r["finite"]).sum()),
            "final_scale": float(r["scale"][-1]),
            "seconds": r["seconds"],
        }
        for r in results
    ]
    config = {k: v for k, v in vars(cfg).items() if k not in OUTPUT_OPTIONS}
    report(cfg, config, runs, summary, cot, time.perf_counter() - start)


def report(
    cfg: argparse.Namespace,
    config: dict,
    runs: list[dict],
    summary: dict,
    cot: dict,
    seconds: float,
) -> None:
    """Prints the summary and the markdown tables, writes ``--json`` and the plot."""
    print(
        f"\n{'run':<14} {'val loss, mean ± sd over seeds':>31} {'vs fp32 (paired)':>17}"
    )
    for n, row in summary.items():
        gap = f"{row['gap_to_fp32_mean']:+.4f}" if "gap_to_fp32_mean" in row else "-"
        per = " ".join(f"{row['final_val'][s]:.4f}" for s in sorted(row["final_val"]))
        print(f"{n:<14} {row['mean']:.4f} ± {row['std']:.4f} ({per}) {gap:>9}")
    print("\nas markdown:\n" + markdown_tables(summary, cot))
    print(f"\n{seconds:.0f} s in all")

    if cfg.json:
        doc = {
            "config": config,
            "versions": {"jax": jax.__version__, "jaxscale": jxs.__version__},
            "backend": jax.default_backend(),
            "seconds": seconds,
            "runs": [{**r, "val": [list(v) for v in r["val"]]} for r in runs],
            "summary": summary,
            "cotangents": cot,
        }
        with open(cfg.json, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"metrics written to {os.path.abspath(cfg.json)}")
    os.makedirs(cfg.out, exist_ok=True)
    path = os.path.join(cfg.out, "why_scaling.png")
    if plot(runs, cot, path):
        print(f"plot saved to {os.path.abspath(path)}")
    else:
        print("no plot: matplotlib is not installed (pip install matplotlib)")


if __name__ == "__main__":
    main()
