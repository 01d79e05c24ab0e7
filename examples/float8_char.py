"""Float8 matmuls: the char transformer in float32, bfloat16 and float8.

The model, data and loss of ``char_transformer.py`` (imported from it, not
copied): a small decoder-only transformer learns to predict the next
character of the standard library's own ``.py`` files; the last 10% of the
text is held out for validation. The model is written once, in float32, and
trained five times from the same parameters on the same batches (``--runs``
picks some):

1. ``fp32``: the model as written;
2. ``bf16``: its loss under ``jxs.autocast(loss, jnp.bfloat16)``;
3. ``fp8-current``: the same with
   ``float8=jxs.float8.CurrentScaling(min_dim=0)``: every matmul without batch
   dimensions (the attention and MLP projections and the head, 9 at the
   default size) multiplies float8_e4m3fn operands scaled per tensor by their
   amax in this step, and both backward products take the gradient in
   float8_e5m2; the attention score products (batched) stay bfloat16;
4. ``fp8-rowwise``: ``float8=jxs.float8.RowwiseScaling(min_dim=0)``, the same
   products with one scale per row of each operand along its contraction;
5. ``fp8-delayed`` (deprecated, kept to measure why):
   ``float8=jxs.float8.DelayedScaling(history_len=16, min_dim=0)``, the scales
   taken from the last 16 steps' amaxes; the state
   (``jxs.float8.init``) goes through the jitted step with
   ``jxs.float8.value_and_grad`` and into the evaluation with
   ``jxs.float8.apply``.

``min_dim=0``: the recipes' default (4096) keeps matmuls smaller than that in
bfloat16, because on a GPU they gain no speed from float8. This model is 64
wide, so at the default no matmul would run in float8; ``min_dim=0`` puts every
eligible one in float8, to measure what float8 does to the loss. (On a CPU
float8 is emulated: this is about the numbers, not the speed.)

The optimizer is ``char_transformer.py``'s: AdamW with warm-up and cosine
decay, clipping by global norm (``jxs.clip_by_global_norm``). No loss scaling:
bfloat16 has float32's range. One batch of ``--batch`` sequences per step
(``char_transformer.py`` accumulates 4 micro-batches of 8; here the 32
sequences go in one batch: with delayed scaling, accumulating would take
``jxs.float8.accumulate_value_and_grad``). Every run is validated on the
same fixed windows in its own compute (the float8 runs with float8 matmuls);
its final parameters also in float32, which separates what float8 did to
training from the rounding of a float8 evaluation.

It prints each run's final validation loss, then a table over the seeds with
the mean gap to ``bf16`` on the same seed, and whether each float8 run is
within the bf16 seeds' spread, which here means: the paired mean difference
(float8 minus bf16, same seed) is at most twice the standard deviation of the bf16
runs over the seeds, in absolute value. It also counts the float8 matmuls in
the jaxpr of each run's loss, to show float8 was on. ``--json PATH`` writes
every number; a plot of the validation losses goes to ``--out``.

Run it (about 7 minutes on a 2-core CPU)::

    python examples/float8_char.py --seeds 0 1 2 --json float8_char.json
"""

from __future__ import annotations

import argparse
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from char_transformer import GPT, cross_entropy, load_data, make_batches  # noqa: E402

try:  # The progress bar is optional.
    from tqdm import tqdm
except ImportError:  # pragma: no cover - depends on the environment
    tqdm = None

RUNS = ("fp32", "bf16", "fp8-current", "fp8-rowwise", "fp8-delayed")
# Options that say where results go, not how to train: not part of the config.
OUTPUT_OPTIONS = ("json", "out")
# run name -> the autocast's float8 recipe (fp32: no autocast at all)
FLOAT8 = {
    "bf16": None,
    "fp8-current": jxs.float8.CurrentScaling(min_dim=0),
    "fp8-rowwise": jxs.float8.RowwiseScaling(min_dim=0),
    "fp8-delayed": None,  # below: deprecated, kept as the evidence
}
with warnings.catch_warnings():  # its DeprecationWarning is the point made here
    warnings.simplefilter("ignore", DeprecationWarning)
    FLOAT8["fp8-delayed"] = jxs.float8.DelayedScaling(history_len=16, min_dim=0)
REFERENCE = "bf16"
# A float8 run is on a par with bf16 when its paired mean difference to bf16 is
# at most this many standard deviations of the bf16 runs over the seeds.
SPREAD = 2


def objective(name: str, graphdef: Any, rest: Any):
    """The run's loss of ``(params, x, y)``: float32, or it under autocast."""

    def loss_fn(params, x, y):
        return cross_entropy(nnx.merge(graphdef, params, rest), x, y)

    if name == "fp32":
        return loss_fn
    return jxs.autocast(loss_fn, jnp.bfloat16, float8=FLOAT8[name])


def make_tx(cfg: argparse.Namespace) -> optax.GradientTransformation:
    """char_transformer.py's recipe: warm-up, cosine decay, clipping, AdamW."""
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, cfg.lr, min(100, cfg.steps // 10 + 1), cfg.steps, cfg.lr / 10
    )
    return optax.chain(
        jxs.clip_by_global_norm(cfg.clip),
        optax.adamw(schedule, b2=0.99, weight_decay=0.1),
    )


def float8_sites(fun, *args) -> int:
    """How many float8 matmuls (``custom_vjp`` calls of ``_f8_matmul``) the
    jaxpr of ``fun(*args)`` holds, sub-jaxprs included."""

    def count(jaxpr) -> int:
        n = 0
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "custom_vjp_call":
                info = eqn.params["call_jaxpr"].jaxpr.debug_info
                n += getattr(info, "func_name", None) == "_f8_matmul"
            for value in eqn.params.values():
                for sub in value if isinstance(value, tuple | list) else (value,):
                    sub = getattr(sub, "jaxpr", sub)  # ClosedJaxpr -> Jaxpr
                    if hasattr(sub, "eqns"):
                        n += count(sub)
        return n

    return count(jax.make_jaxpr(fun)(*args).jaxpr)


def compiled(name: str, graphdef: Any, rest: Any, cfg: argparse.Namespace):
    """``(loss, tx, step, evaluate)`` of a run, jitted once for all seeds.

    ``step(params, opt_state, f8, data, key, i)`` and ``evaluate(params, f8,
    x, y)`` take the delayed-scaling state ``f8`` (``None`` in the other runs).
    """
    loss = objective(name, graphdef, rest)
    tx = make_tx(cfg)
    delayed = name == "fp8-delayed"

    @functools.partial(jax.jit, donate_argnums=(0, 1, 2))
    def step(params, opt_state, f8, data, key, i):
        # The same batches in every run: they depend on the seed and step only.
        x, y = make_batches(data, cfg.context, cfg.batch, jax.random.fold_in(key, i))
        if delayed:  # the new amax histories and scales come back with the grads
            value, grads, f8 = jxs.float8.value_and_grad(loss, f8)(params, x, y)
        else:
            value, grads = jax.value_and_grad(loss)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, f8, value

    @jax.jit
    def evaluate(params, f8, x, y):  # in the run's own compute
        fun = jxs.float8.apply(loss, f8) if delayed else loss
        return jax.lax.map(lambda b: fun(params, *b), (x, y)).mean()

    return loss, tx, step, evaluate


def train(
    name: str, seed: int, fns: tuple, eval32, data, val, cfg: argparse.Namespace
) -> dict[str, Any]:
    """One run: its training losses, validation losses and float8 site count.

    ``eval32`` evaluates the final parameters in float32 as well (how much of a
    gap is the float8 evaluation's own rounding).
    """
    train_data, _, vocab = data
    loss, tx, step, evaluate = fns
    model = GPT(
        vocab,
        cfg.context,
        cfg.dim,
        cfg.layers,
        cfg.heads,
        dtype=jnp.float32,
        rngs=nnx.Rngs(seed),
    )
    params = nnx.state(model, nnx.Param)
    opt_state = tx.init(params)
    key = jax.random.key(seed)  # char_transformer.py's batches for this seed
    x0, y0 = make_batches(train_data, cfg.context, cfg.batch, key)
    f8 = None
    if name == "fp8-delayed":
        f8 = jxs.float8.init(loss, params, x0, y0)
        sites = float8_sites(jxs.float8.apply(loss, f8), params, x0, y0)
    else:
        sites = float8_sites(loss, params, x0, y0)

    steps = range(cfg.steps)
    log = print
    label = f"{name} seed {seed}"
    if tqdm is not None:  # disable=None: a bar on a terminal only.
        steps = tqdm(steps, desc=f"{label:>18}", unit="step", disable=None, leave=False)
        log = tqdm.write
    history, curve = [], []
    start = time.perf_counter()
    for i in steps:
        params, opt_state, f8, value = step(params, opt_state, f8, train_data, key, i)
        history.append(value)
        if (i + 1) % cfg.eval_every == 0 or i + 1 == cfg.steps:
            v = float(evaluate(params, f8, *val))  # the only host syncs
            curve.append((i + 1, v))
            log(f"{label:>18}  step {i + 1:5d}  val loss {v:.4f}")
    seconds = time.perf_counter() - start
    losses = np.asarray(jnp.stack(history))
    final32 = float(eval32(params, None, *val))
    return {
        "name": name,
        "seed": seed,
        "float8_sites": sites,
        "val": curve,
        "final_val": curve[-1][1],
        "final_val_fp32_eval": final32,
        "train_loss_last20": float(losses[-20:].mean()),
        "seconds": seconds,
    }


def summarise(runs: list[dict], names: list[str]) -> dict[str, dict]:
    """Per run name: final validation loss per seed, mean, sd (over the seeds,
    ``ddof=1``), the paired difference to bf16 on each seed and its mean, and
    whether that mean is within the bf16 seeds' spread (``|mean| <= SPREAD *
    sd``)."""
    final = {
        n: {r["seed"]: r["final_val"] for r in runs if r["name"] == n} for n in names
    }
    ref = final.get(REFERENCE, {})
    ref_sd = float(np.std(list(ref.values()), ddof=1)) if len(ref) > 1 else 0.0
    out = {}
    for n in names:
        v = np.array(list(final[n].values()))
        row = {
            "final_val": final[n],
            "mean": float(v.mean()),
            "std": float(v.std(ddof=1)) if len(v) > 1 else 0.0,
            "min": float(v.min()),
            "max": float(v.max()),
            "float8_sites": next(r["float8_sites"] for r in runs if r["name"] == n),
        }
        paired = [final[n][s] - ref[s] for s in final[n] if s in ref]
        if paired:
            row["vs_bf16_per_seed"] = [float(d) for d in paired]
            row["vs_bf16_mean"] = float(np.mean(paired))
            # One seed has no spread: no verdict.
            within = abs(row["vs_bf16_mean"]) <= SPREAD * ref_sd
            within = within if len(ref) > 1 else None
            row["within_bf16_spread"] = within
        out[n] = row
    return out


def markdown_table(summary: dict) -> str:
    """The table of docs/examples.md, from the summary."""
    seeds = sorted(next(iter(summary.values()))["final_val"])
    head = " | ".join(f"seed {s}" for s in seeds)
    lines = [
        f"| run | {head} | mean ± sd | vs bf16, paired mean |",
        "|---|" + "---|" * (len(seeds) + 2),
    ]
    for n, row in summary.items():
        per = " | ".join(f"{row['final_val'][s]:.4f}" for s in seeds)
        gap = f"{row['vs_bf16_mean']:+.4f}" if "vs_bf16_mean" in row else "-"
        lines.append(f"| {n} | {per} | {row['mean']:.4f} ± {row['std']:.4f} | {gap} |")
    return "\n".join(lines)


def verdicts(summary: dict) -> list[str]:
    """One line per float8 run: within the bf16 seeds' spread or not."""
    if REFERENCE not in summary:
        return []
    sd = summary[REFERENCE]["std"]
    lines = []
    for n, row in summary.items():
        if not n.startswith("fp8") or "vs_bf16_mean" not in row:
            continue
        gap = row["vs_bf16_mean"]
        if row["within_bf16_spread"] is None:
            verdict = "one seed, no spread to compare with (pass --seeds 0 1 2)"
        elif row["within_bf16_spread"]:
            verdict = f"|{gap:+.4f}| <= {SPREAD} x {sd:.4f}: within the bf16 spread"
        else:
            verdict = f"|{gap:+.4f}| > {SPREAD} x {sd:.4f}: outside the bf16 spread"
        lines.append(
            f"{n}: paired mean difference to bf16 {gap:+.4f}, sd of the bf16 "
            f"seeds {sd:.4f}; {verdict}"
        )
    return lines


def plot(runs: list[dict], path: str) -> bool:
    """Validation loss of every run and seed; False without matplotlib."""
    try:
        import matplotlib
    except ImportError:  # pragma: no cover - depends on the environment
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    colors = dict(zip(RUNS, ("C0", "C1", "C2", "C4", "C3"), strict=True))
    first = min(r["seed"] for r in runs)
    for r in runs:
        steps, values = zip(*r["val"], strict=True)
        label = r["name"] if r["seed"] == first else None
        ax.plot(
            steps, values, "o-", color=colors[r["name"]], alpha=0.7, ms=3, label=label
        )
    ax.set(xlabel="step", ylabel="validation cross-entropy (nats/char)")
    ax.set_title("char transformer: float32, bfloat16, float8 (each seed a line)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; ``parse_args([])`` gives the defaults."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=500, help="optimizer steps")
    parser.add_argument(
        "--seeds", type=int, nargs="+", default=[0, 1, 2], help="e.g. --seeds 0 1 2"
    )
    parser.add_argument("--context", type=int, default=64, help="characters")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32, help="sequences per step")
    parser.add_argument("--lr", type=float, default=1e-2, help="peak AdamW rate")
    parser.add_argument("--clip", type=float, default=1.0, help="max global norm")
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--eval-batches", type=int, default=8)
    parser.add_argument(
        "--runs", nargs="+", choices=RUNS, default=list(RUNS), help="which runs"
    )
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--out", default="examples/out", help="folder for the plot")
    cfg = parser.parse_args(argv)
    if cfg.steps < 1:
        parser.error(f"--steps must be >= 1, got {cfg.steps}.")
    if len(set(cfg.runs)) != len(cfg.runs):
        parser.error(f"--runs must be distinct, got {cfg.runs}.")
    cfg.runs = [n for n in RUNS if n in cfg.runs]  # in the table's order
    if len(set(cfg.seeds)) != len(cfg.seeds):
        parser.error(f"--seeds must be distinct, got {cfg.seeds}.")
    return cfg


def main(argv: list[str] | None = None) -> None:
    cfg = parse_args(argv)
    data, text, files = load_data()
    chars = range(data[2])
    print(
        f"jaxscale {jxs.__version__}: {len(text):,} characters of Python source "
        f"from {len(files)} standard-library files, vocabulary {len(chars)}; "
        f"{cfg.layers} layers of width {cfg.dim}; {cfg.steps} steps of "
        f"{cfg.batch} sequences of {cfg.context} per run on "
        f"{jax.default_backend()}; seeds {', '.join(map(str, cfg.seeds))}",
        flush=True,
    )
    # A fixed validation set: the same windows for every evaluation and run.
    val_x, val_y = make_batches(
        data[1], cfg.context, cfg.eval_batches * cfg.batch, jax.random.key(1234)
    )
    shape = (cfg.eval_batches, cfg.batch, cfg.context)
    val = (val_x.reshape(shape), val_y.reshape(shape))
    # The model's structure (the same for every seed); its parameters per run.
    model = GPT(
        len(chars),
        cfg.context,
        cfg.dim,
        cfg.layers,
        cfg.heads,
        jnp.float32,
        nnx.Rngs(0),
    )
    graphdef, _, rest = nnx.split(model, nnx.Param, ...)
    fns = {n: compiled(n, graphdef, rest, cfg) for n in {*cfg.runs, "fp32"}}

    start = time.perf_counter()
    runs = []
    for seed in cfg.seeds:
        for name in cfg.runs:
            r = train(name, seed, fns[name], fns["fp32"][3], data, val, cfg)
            runs.append(r)
            print(
                f"seed {seed}  {name:<12} val {r['final_val']:.4f} "
                f"(float32 eval {r['final_val_fp32_eval']:.4f})  "
                f"train {r['train_loss_last20']:.4f}  float8 sites "
                f"{r['float8_sites']}  {r['seconds']:.1f}s",
                flush=True,
            )
    seconds = time.perf_counter() - start
    summary = summarise(runs, cfg.runs)

    seeds = " ".join(f"{'seed ' + str(s):>7}" for s in cfg.seeds)
    print(f"\n{'run':<12} {seeds} {'mean ± sd':>16} {'vs bf16 (paired)':>17}")
    for n, row in summary.items():
        per = " ".join(f"{row['final_val'][s]:>7.4f}" for s in cfg.seeds)
        gap = f"{row['vs_bf16_mean']:+.4f}" if "vs_bf16_mean" in row else "-"
        spread = f"{row['mean']:.4f} ± {row['std']:.4f}"
        print(f"{n:<12} {per} {spread:>16} {gap:>17}")
    print(
        "float8 sites in each loss's jaxpr: "
        + ", ".join(f"{n} {row['float8_sites']}" for n, row in summary.items())
    )
    for line in verdicts(summary):
        print(line)
    print("\nas markdown:\n" + markdown_table(summary))
    print(f"\n{seconds:.0f} s of training in all")

    if cfg.json:
        doc = {
            "config": {k: v for k, v in vars(cfg).items() if k not in OUTPUT_OPTIONS},
            "versions": {"jax": jax.__version__, "jaxscale": jxs.__version__},
            "backend": jax.default_backend(),
            "criterion": (
                f"|paired mean difference to bf16| <= {SPREAD} sd of the bf16 seeds"
            ),
            "seconds": seconds,
            "runs": [{**r, "val": [list(v) for v in r["val"]]} for r in runs],
            "summary": summary,
        }
        with open(cfg.json, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"results written to {os.path.abspath(cfg.json)}")
    os.makedirs(cfg.out, exist_ok=True)
    path = os.path.join(cfg.out, "float8_char.png")
    if plot(runs, path):
        print(f"plot saved to {os.path.abspath(path)}")
    else:
        print("no plot: matplotlib is not installed (pip install matplotlib)")


if __name__ == "__main__":
    main()
