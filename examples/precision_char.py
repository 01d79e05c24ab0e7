"""Adaptive precision: the char transformer in each format, and the plan.

The model, data, optimizer and training loop of ``float8_char.py`` (imported
from it and from ``char_transformer.py``, not copied), trained from the same
parameters on the same batches per seed in each of these rows (``--rows``
picks some):

1. ``fp32``: the model as written;
2. ``bf16``: its loss under ``jxs.autocast(loss, jnp.bfloat16)``;
3. ``fp16``: under ``jxs.autocast(loss, jnp.float16)``, with dynamic loss
   scaling (``jxs.dynamic_scaling`` around the optimizer,
   ``jxs.value_and_grad``);
4. ``fp8``: every matmul site in float8,
   ``float8=jxs.float8.CurrentScaling(min_dim=0)``;
5. ``torchao``: torchao's shape rule for tensorwise float8: a site stays
   bfloat16 where K <= 4096 and N <= 1024, float8 elsewhere (a plan,
   ``jxs.precision.Plan.from_formats``, of the site shapes the sensor
   reports);
6. ``fp8-ends``: the first and the last matmul site in bfloat16, float8
   elsewhere;
7. ``fp8-auto``: ``float8=True``, jaxscale's speed-only default
   (``CurrentScaling()``: the cost model decides per site, on the figures of
   the device JAX runs on, the H100 SXM's on a CPU);
8. ``plan``: ``jxs.precision.Sensor(loss, jnp.bfloat16)`` on ``--calibration``
   batches at the seed's initial parameters, then ``.plan(cost="H100",
   budget="16-bit")`` (the budget the recorded runs used; the default is now
   the noise budget: ``--plan-budget noise --plan-cost H200``), run with
   ``jxs.autocast(loss, jnp.bfloat16, plan=plan)``;
9. a check of the sensor that does not use the speed model: float8 everywhere
   except the ``k`` sites with the highest float8 score, kept bfloat16
   (``keep-top1``, ``keep-top2``), against keeping the ``k`` lowest-ranked
   sites (``keep-low1``, ``keep-low2``) or ``k`` random ones (``keep-rand2``).
   If the sensor's ranking says where float8's loss comes from, keeping the
   top sites should close more of float8's gap than keeping the others.

The sensor and its ranking are per seed (its initial parameters); so are the
rows built from them. Each row prints its final validation loss per seed, the
mean, the paired gaps to fp32 and to bf16 (same seed), whether it is within
twice the bf16 seeds' spread of fp32 (``|paired mean gap to fp32| <= 2 sd``,
the sd of the bf16 runs over the seeds, as ``float8_char.py``'s ``SPREAD``),
and the speed model's predicted time of a step's matmuls in the row's formats
over the same in 16 bits, for an H100 and an H200 (the speed model,
``SiteMeasure.seconds``, at the model's own shapes, or with ``--price-tokens
T`` at a step of ``T`` tokens, where the plan is also solved). On a CPU float8 is
emulated: the losses are the point, not the wall clock. ``--json PATH``
writes every number.

Run it (width 64, about 25 minutes on a 2-core CPU)::

    python examples/precision_char.py --seeds 0 1 2 --json precision_char_64.json
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
import time
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jaxscale as jxs
import jaxscale.internal as jxi
import jaxscale.precision

Format = jxs.precision.Format

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import float8_char as f8  # noqa: E402
from char_transformer import GPT, load_data, make_batches  # noqa: E402

ROWS = (
    "fp32",
    "bf16",
    "fp16",
    "fp8",
    "torchao",
    "fp8-ends",
    "fp8-auto",
    "plan",
    "keep-top1",
    "keep-top2",
    "keep-low1",
    "keep-low2",
    "keep-rand2",
)
# Rows that run through a plan built per seed from the sensor's sites.
PLANNED = ("torchao", "fp8-ends", "plan", *(r for r in ROWS if r.startswith("keep")))
OUTPUT_OPTIONS = ("json",)
DEVICES = ("H100", "H200")
SPREAD = f8.SPREAD
# torchao's rule for tensorwise float8: a linear with K <= 4096 and N <= 1024
# gains nothing from float8 and stays 16-bit.
TORCHAO_K, TORCHAO_N = 4096, 1024


def site_labels(sites: list[str], layers: int) -> dict[str, str]:
    """Short labels of the sensor's sites (their module paths): in the
    model's order, each block's qkv, proj, fc and out projections, then the
    head."""
    names = [f"b{i}.{p}" for i in range(layers) for p in ("qkv", "proj", "fc", "out")]
    names.append("head")
    if len(names) != len(sites):  # not this model's layout: keep the sensor's
        return {s: s for s in sites}
    return dict(zip(sites, names, strict=True))


def calibrate(loss, params, train_data, seed: int, cfg) -> jxs.precision.Sensor:
    """The sensor on ``cfg.calibration`` batches at ``params``: windows of the
    training text drawn with keys just past the run's own (not its batches)."""
    sensor = jxs.precision.Sensor(loss, jnp.bfloat16)
    key = jax.random.key(seed)
    for j in range(cfg.calibration):
        k = jax.random.fold_in(key, cfg.steps + j)
        sensor.update(params, *make_batches(train_data, cfg.context, cfg.batch, k))
    return sensor


def auto_formats(measures) -> dict[str, Format]:
    """The sites ``float8=True`` (``CurrentScaling()``) puts in float8: its cost
    model's choice on the device JAX runs on (the H100 SXM's figures on a CPU)."""
    recipe = jxs.float8.CurrentScaling()
    out = {}
    for m in measures:
        c = jxi.float8_choice(
            recipe,
            m.site,
            m.shape,
            m.operand_bytes,
            lambda: jxi.current_device(None),
            "",
        )
        out[m.site] = Format.FLOAT8 if c.float8 else Format.HALF
    return out


def row_formats(name: str, measures, plan, seed: int) -> dict[str, Format]:
    """``{site: Format}`` of row ``name`` (what the speed model is asked about;
    the ``PLANNED`` rows also run it)."""
    sites = [m.site for m in measures]
    every = {
        "fp32": Format.FLOAT32,
        "bf16": Format.HALF,
        "fp16": Format.HALF,
        "fp8": Format.FLOAT8,
    }
    if name in every:
        return dict.fromkeys(sites, every[name])
    if name == "fp8-auto":
        return auto_formats(measures)
    if name == "plan":  # its dense sites (the rows compare matmul formats)
        return {s: f for s, f in plan.formats().items() if s in sites}
    if name == "torchao":
        return {
            m.site: Format.HALF
            if m.shape[1] <= TORCHAO_K and m.shape[2] <= TORCHAO_N
            else Format.FLOAT8
            for m in measures
        }
    if name == "fp8-ends":
        keep = {sites[0], sites[-1]}
    else:  # keep-top<k>, keep-low<k>, keep-rand<k>
        k = int(name[-1])
        # Highest float8 score first; ties (none expected) by site order.
        ranked = sorted(sites, key=lambda s: -dict(ranking(measures))[s])
        if name.startswith("keep-top"):
            keep = set(ranked[:k])
        elif name.startswith("keep-low"):
            keep = set(ranked[-k:])
        else:
            rng = np.random.default_rng(seed)
            keep = {sites[i] for i in rng.choice(len(sites), k, replace=False)}
    return {s: Format.HALF if s in keep else Format.FLOAT8 for s in sites}


def ranking(measures) -> list[tuple[str, float]]:
    """``(site, float8 score)``, highest score first."""
    scores = [(m.site, m.errors[Format.FLOAT8]) for m in measures]
    return sorted(scores, key=lambda p: -p[1])


def speed_ratio(formats: dict[str, Format], measures, kind: str) -> float:
    """The speed model's time of the sites in ``formats`` over all in 16 bits."""
    cost = jxi.device_cost(kind)[0]
    t = h = 0.0
    for m in measures:  # one run of each site (a step's runs not counted)
        t += m.seconds(formats[m.site], cost) / m.runs
        h += m.seconds(Format.HALF, cost) / m.runs
    return t / h


def at_tokens(measures, tokens: int | None) -> list:
    """``measures`` priced at a step of ``tokens`` rows (each site's ``m``; its
    scores stay the calibration batch's); ``None``: as measured."""
    if tokens is None:
        return list(measures)
    return [dataclasses.replace(m, shape=(tokens, *m.shape[1:])) for m in measures]


def objective(name: str, loss_fn, formats: dict[str, Format] | None, measures=()):
    """Row ``name``'s loss of ``(params, x, y)``."""
    if name == "fp32":
        return loss_fn
    if name == "fp16":
        return jxs.autocast(loss_fn, jnp.float16)
    if name in PLANNED:
        plan = jxs.precision.Plan.from_formats(
            formats, measures, cost="H100", why=f"row {name}"
        )
        return jxs.autocast(loss_fn, jnp.bfloat16, plan=plan)
    recipe = {
        "bf16": None,
        "fp8": jxs.float8.CurrentScaling(min_dim=0),
        "fp8-auto": True,
    }[name]
    return jxs.autocast(loss_fn, jnp.bfloat16, float8=recipe)


def compiled(loss, cfg, scaled: bool):
    """``(loss, tx, step, evaluate)`` in ``float8_char.train``'s signature
    (``f8`` is unused: ``None``); ``scaled``: dynamic loss scaling."""
    tx = f8.make_tx(cfg)
    if scaled:
        tx = jxs.dynamic_scaling(tx)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, opt_state, f8_state, data, key, i):
        x, y = make_batches(data, cfg.context, cfg.batch, jax.random.fold_in(key, i))
        if scaled:  # the scaled loss's gradients; tx unscales, checks, skips
            value, grads = jxs.value_and_grad(loss, opt_state)(params, x, y)
        else:
            value, grads = jax.value_and_grad(loss)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, f8_state, value

    @jax.jit
    def evaluate(params, f8_state, x, y):
        return jax.lax.map(lambda b: loss(params, *b), (x, y)).mean()

    return loss, tx, step, evaluate


def summarise(runs: list[dict], names: list[str], ratios: dict) -> dict[str, dict]:
    """Per row: final validation loss per seed, mean, sd (``ddof=1``), paired
    gaps to fp32 and bf16 (per seed, mean), whether the gap to fp32 is within
    ``SPREAD`` sd of the bf16 seeds, the float8 sites, the predicted ratios."""
    final = {
        n: {r["seed"]: r["final_val"] for r in runs if r["name"] == n} for n in names
    }
    bf16 = list(final.get("bf16", {}).values())
    sd = float(np.std(bf16, ddof=1)) if len(bf16) > 1 else None
    out = {}
    for n in names:
        v = np.array(list(final[n].values()))
        row: dict[str, Any] = {
            "final_val": final[n],
            "mean": float(v.mean()),
            "std": float(v.std(ddof=1)) if len(v) > 1 else 0.0,
            "float8_sites": {
                r["seed"]: r["float8_sites"] for r in runs if r["name"] == n
            },
        }
        for ref in ("fp32", "bf16"):
            paired = [
                final[n][s] - final[ref][s] for s in final[n] if s in final.get(ref, {})
            ]
            if paired:
                row[f"vs_{ref}_per_seed"] = [float(d) for d in paired]
                row[f"vs_{ref}_mean"] = float(np.mean(paired))
        if "vs_fp32_mean" in row:
            row["within_bf16_spread_of_fp32"] = (
                None if sd is None else bool(abs(row["vs_fp32_mean"]) <= SPREAD * sd)
            )
        for kind in DEVICES:
            per_seed = [ratios[n, s][kind] for s in final[n]]
            row[f"ratio_{kind}"] = per_seed
        out[n] = row
    return out


def _ratio(values: list[float]) -> str:
    lo, hi = min(values), max(values)
    return f"{lo:.2f}" if f"{lo:.2f}" == f"{hi:.2f}" else f"{lo:.2f}-{hi:.2f}"


def markdown_table(summary: dict) -> str:
    """The table of docs/examples.md, from the summary."""
    seeds = sorted(next(iter(summary.values()))["final_val"])
    head = " | ".join(f"seed {s}" for s in seeds)
    lines = [
        f"| row | {head} | mean ± sd | vs fp32 | vs bf16 | within {SPREAD} sd "
        "of fp32 | H100 time | H200 time |",
        "|---|" + "---|" * (len(seeds) + 7),
    ]
    for n, row in summary.items():
        per = " | ".join(f"{row['final_val'][s]:.4f}" for s in seeds)
        g32 = f"{row['vs_fp32_mean']:+.4f}" if "vs_fp32_mean" in row else "-"
        g16 = f"{row['vs_bf16_mean']:+.4f}" if "vs_bf16_mean" in row else "-"
        w = row.get("within_bf16_spread_of_fp32")
        within = "-" if w is None else ("yes" if w else "no")
        lines.append(
            f"| {n} | {per} | {row['mean']:.4f} ± {row['std']:.4f} | {g32} | {g16} "
            f"| {within} | {_ratio(row['ratio_H100'])} | {_ratio(row['ratio_H200'])} |"
        )
    return "\n".join(lines)


def describe(formats: dict[str, Format], labels: dict[str, str]) -> str:
    """``b0.qkv bf16, ... `` compactly: the sites not in float8, or all one."""
    kinds = set(formats.values())
    if len(kinds) == 1:
        return f"all {next(iter(kinds)).value}"
    rest = [
        f"{labels[s]} {f.value}" for s, f in formats.items() if f is not Format.FLOAT8
    ]
    return "float8 except " + ", ".join(rest)


def _budget(text: str) -> str | float:
    """``--plan-budget``: ``16-bit``, ``noise`` or a number."""
    if text in ("16-bit", "noise"):
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be 16-bit, noise or a number, got {text!r}"
        ) from None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """float8_char.py's command line, with ``--rows`` and ``--calibration``."""
    base = f8.parse_args([])  # its defaults are ours
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=base.steps, help="optimizer steps")
    parser.add_argument("--seeds", type=int, nargs="+", default=base.seeds)
    parser.add_argument("--context", type=int, default=base.context, help="characters")
    parser.add_argument("--dim", type=int, default=base.dim)
    parser.add_argument("--layers", type=int, default=base.layers)
    parser.add_argument("--heads", type=int, default=base.heads)
    parser.add_argument(
        "--batch", type=int, default=base.batch, help="sequences per step"
    )
    parser.add_argument("--lr", type=float, default=base.lr, help="peak AdamW rate")
    parser.add_argument("--clip", type=float, default=base.clip, help="max global norm")
    parser.add_argument("--eval-every", type=int, default=base.eval_every)
    parser.add_argument("--eval-batches", type=int, default=base.eval_batches)
    parser.add_argument(
        "--calibration", type=int, default=4, help="sensor batches per seed"
    )
    parser.add_argument(
        "--plan-budget",
        type=_budget,
        default="16-bit",
        help="the plan row's budget: 16-bit (the recorded runs'), noise, or a number",
    )
    parser.add_argument(
        "--plan-cost", default="H100", choices=DEVICES, help="the plan row's device"
    )
    parser.add_argument(
        "--price-tokens",
        type=int,
        default=None,
        help="plan and price each site at a step of this many tokens",
    )
    parser.add_argument(
        "--rows", nargs="+", choices=ROWS, default=list(ROWS), help="which rows"
    )
    parser.add_argument("--json", default=None, help="write the results here")
    cfg = parser.parse_args(argv)
    if cfg.steps < 1:
        parser.error(f"--steps must be >= 1, got {cfg.steps}.")
    if cfg.calibration < 1:
        parser.error(f"--calibration must be >= 1, got {cfg.calibration}.")
    if len(set(cfg.seeds)) != len(cfg.seeds):
        parser.error(f"--seeds must be distinct, got {cfg.seeds}.")
    # fp32 and bf16 are the references of every gap: always run.
    cfg.rows = [n for n in ROWS if n in {*cfg.rows, "fp32", "bf16"}]
    return cfg


def write(cfg, seconds: float, per_seed: dict, runs: list, summary: dict) -> None:
    """Every number to ``cfg.json`` (also after each seed: a long run that is
    stopped keeps the seeds it finished, with ``"complete": false``)."""
    doc = {
        "config": {k: v for k, v in vars(cfg).items() if k not in OUTPUT_OPTIONS},
        "versions": {"jax": jax.__version__, "jaxscale": jxs.__version__},
        "backend": jax.default_backend(),
        "criterion": (
            f"|paired mean difference to fp32| <= {SPREAD} sd of the bf16 seeds"
        ),
        "complete": len(per_seed) == len(cfg.seeds),
        "seconds": seconds,
        "seeds": {str(s): v for s, v in per_seed.items()},
        "runs": [{**r, "val": [list(v) for v in r["val"]]} for r in runs],
        "summary": summary,
    }
    with open(cfg.json, "w") as f:
        json.dump(doc, f, indent=1)


def main(argv: list[str] | None = None) -> None:
    cfg = parse_args(argv)
    # fp8-auto's "nothing runs in float8" is a result here: say it once.
    warnings.filterwarnings("once", category=jxs.AutocastWarning)
    data, text, files = load_data()
    train_data, _, vocab = data
    print(
        f"jaxscale {jxs.__version__}, jax {jax.__version__}: {len(text):,} "
        f"characters, vocabulary {vocab}; {cfg.layers} layers of width {cfg.dim}, "
        f"{cfg.heads} heads; {cfg.steps} steps of {cfg.batch} x {cfg.context} per "
        f"run on {jax.default_backend()}; seeds {', '.join(map(str, cfg.seeds))}",
        flush=True,
    )
    val_x, val_y = make_batches(
        data[1], cfg.context, cfg.eval_batches * cfg.batch, jax.random.key(1234)
    )
    shape = (cfg.eval_batches, cfg.batch, cfg.context)
    val = (val_x.reshape(shape), val_y.reshape(shape))
    model = GPT(
        vocab, cfg.context, cfg.dim, cfg.layers, cfg.heads, jnp.float32, nnx.Rngs(0)
    )
    graphdef, _, rest = nnx.split(model, nnx.Param, ...)
    loss32 = f8.objective("fp32", graphdef, rest)

    cache: dict[Any, tuple] = {}  # one compilation per row and formats

    def fns_of(name: str, formats: dict[str, Format], measures=()) -> tuple:
        # PLANNED rows with the same formats are one program.
        key = ("planned", tuple(formats.items())) if name in PLANNED else name
        if key not in cache:
            loss = objective(name, loss32, formats, measures)
            cache[key] = compiled(loss, cfg, name == "fp16")
        return cache[key]

    eval32 = fns_of("fp32", {})[3]
    start = time.perf_counter()
    runs, ratios, per_seed = [], {}, {}
    labels: dict[str, str] = {}
    for seed in cfg.seeds:
        model = GPT(
            vocab,
            cfg.context,
            cfg.dim,
            cfg.layers,
            cfg.heads,
            jnp.float32,
            nnx.Rngs(seed),
        )
        t0 = time.perf_counter()
        sensor = calibrate(loss32, nnx.state(model, nnx.Param), train_data, seed, cfg)
        # The dense sites: attention's batched products run as autocast runs
        # them (a plan that names no batched site leaves them so).
        measures = [m for m in sensor.measures() if m.kind == "dense"]
        priced = at_tokens(measures, cfg.price_tokens)
        plan = jxs.precision.solve(priced, cost=cfg.plan_cost, budget=cfg.plan_budget)
        plan = plan.with_dtype(sensor.dtype, sensor.loss_scale)
        calib_s = time.perf_counter() - t0
        labels = site_labels([m.site for m in measures], cfg.layers)
        print(
            f"\nseed {seed}: the sensor on {cfg.calibration} batches "
            f"({calib_s:.1f} s); float8 score per site, highest first:"
        )
        print("  " + ", ".join(f"{labels[s]} {v:.3g}" for s, v in ranking(measures)))
        print(f"seed {seed}: the plan (cost={cfg.plan_cost!r}):\n{plan}", flush=True)
        formats = {n: row_formats(n, measures, plan, seed) for n in cfg.rows}
        per_seed[seed] = {
            "calibration_seconds": calib_s,
            "sites": [
                {
                    "site": m.site,
                    "label": labels[m.site],
                    "shape": list(m.shape),
                    "operand_bytes": list(m.operand_bytes),
                    "errors": {f.name: v for f, v in m.errors.items()},
                    "notes": {f.name: v for f, v in m.notes.items()},
                }
                for m in measures
            ],
            "plan": json.loads(plan.to_json()),
            "plan_H200": {
                s: f.name
                for s, f in sensor.plan(cost="H200", budget="16-bit").formats().items()
            },
            "formats": {
                n: {s: f.name for s, f in fm.items()} for n, fm in formats.items()
            },
        }
        for name in cfg.rows:
            fm = formats[name]
            ratios[name, seed] = {k: speed_ratio(fm, priced, k) for k in DEVICES}
            r = f8.train(name, seed, fns_of(name, fm, measures), eval32, data, val, cfg)
            expected = sum(f is Format.FLOAT8 for f in fm.values())
            if name != "fp32" and r["float8_sites"] != expected:
                print(
                    f"WARNING: {name} ran {r['float8_sites']} float8 sites, its "
                    f"formats say {expected}"
                )
            r["formats"] = describe(fm, labels)
            runs.append(r)
            print(
                f"seed {seed}  {name:<10} val {r['final_val']:.4f} (float32 eval "
                f"{r['final_val_fp32_eval']:.4f})  float8 sites {r['float8_sites']}"
                f"  H100 {ratios[name, seed]['H100']:.2f}x  {r['seconds']:.1f}s  "
                f"[{r['formats']}]",
                flush=True,
            )
        if cfg.json and seed != cfg.seeds[-1]:
            partial = summarise(runs, cfg.rows, ratios)
            write(cfg, time.perf_counter() - start, per_seed, runs, partial)
    seconds = time.perf_counter() - start
    summary = summarise(runs, cfg.rows, ratios)
    sd = summary["bf16"]["std"] if len(cfg.seeds) > 1 else None

    print("\n" + markdown_table(summary))
    if sd is None:
        print("one seed: no spread to judge with (pass --seeds 0 1 2)")
    else:
        print(
            f"within: |paired mean gap to fp32| <= {SPREAD} x {sd:.4f} (the sd of "
            "the bf16 seeds); times: the speed model's, over all 16-bit"
        )
    for name in cfg.rows:
        if name in PLANNED or name == "fp8-auto":
            seen = sorted({r["formats"] for r in runs if r["name"] == name})
            print(f"{name}: {' | '.join(seen)}")
    if "fp8" in summary:
        gap = summary["fp8"].get("vs_bf16_mean")
        for name in cfg.rows:
            if name.startswith("keep") and gap and gap > 0:
                left = summary[name]["vs_bf16_mean"]
                print(
                    f"{name}: {left:+.4f} vs bf16, {1 - left / gap:.0%} of fp8's "
                    f"{gap:+.4f} closed"
                )
    print(f"\n{seconds:.0f} s in all")

    if cfg.json:
        write(cfg, seconds, per_seed, runs, summary)
        print(f"results written to {os.path.abspath(cfg.json)}")


if __name__ == "__main__":
    main()
