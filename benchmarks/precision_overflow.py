"""Adaptive precision where no single 16-bit dtype works (issue 41).

A small residual MLP regresses a noise-free teacher from unnormalised readings in
the tens of thousands (think prices or counts that nobody standardised). Its first
layer, ``embed``, projects them as they are and a LayerNorm follows, so float32
does not care about their scale; but ``embed``'s outputs reach 1e5, beyond
float16's 65504, in every batch. Every other matmul site is ordinary, and there
float16 (11-bit significand) is more accurate than bfloat16 (8 bits).

Four runs from the same initial parameters on the same batches:

- ``float32``;
- ``float16``: ``jxs.autocast(loss, float16)`` with dynamic loss scaling (every
  step whose loss or gradient is not finite is skipped);
- ``bfloat16``: ``jxs.autocast(loss, bfloat16)``, no loss scaling;
- ``plan``: ``jxs.plan_precision(loss, float16, loss_scale=S)`` on calibration
  batches, then ``jxs.autocast(loss, float16, plan=plan)`` with dynamic loss
  scaling from the same initial scale ``S``.

Per run: the final training loss (mean of the last 50 steps), the held-out loss
of the final parameters evaluated in float32 (the targets have unit variance, so
it is the fraction of variance unexplained), its gap to float32's, the steps
skipped and the steps whose loss was not finite. The gradient error: on the
same parameters (the initial ones and float32's final ones) and batches, each
policy's gradient (of the loss times the loss scale, divided by it, as training
sees it) against float32's at ``Precision.HIGHEST``; per parameter leaf the
relative L2 error ``|g - g32| / |g32|``; the median and the largest over the
leaves and batches (``inf`` if a gradient is not finite).

Run::

    python benchmarks/precision_overflow.py --json precision_overflow.json
    python benchmarks/precision_overflow.py --quick     # seconds: the test suite's size
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxscale as jxs
import jaxscale.precision

F = jxs.precision.Format
RUNS = ("float32", "float16", "bfloat16", "plan")
LOSS_SCALE = 2.0**10  # default initial loss scale of the float16 and plan runs

# full size, and --quick (the test suite's)
SIZES = {
    "full": dict(features=32, width=128, depth=2, batch=256, steps=1500, lr=2e-3),
    "quick": dict(features=32, width=128, depth=2, batch=256, steps=30, lr=2e-3),
}


# --------------------------------------------------------------------------- #
# Data: unnormalised readings, a teacher on their standardised values.
# --------------------------------------------------------------------------- #


def make_task(seed: int, features: int) -> dict[str, Any]:
    """The task of one seed: feature means and spreads, and a teacher.

    Feature ``j`` is ``mean_j * (1 + 0.1 z)``, ``z`` standard normal, with
    ``mean_j`` log-uniform in [2e4, 5e4]; values are clipped to [0, 65000]
    (float16 holds every input). The target is a random two-layer tanh MLP of
    the standardised features, scaled to unit variance: noise-free, so a
    model's precision shows in how close it gets.
    """
    rng = np.random.default_rng(seed)
    mean = np.exp(rng.uniform(np.log(2e4), np.log(5e4), features))
    w1 = rng.normal(size=(features, 64)) / np.sqrt(features)
    w2 = rng.normal(size=(64,)) / np.sqrt(64)
    task = dict(mean=mean, w1=w1, w2=w2, out_scale=1.0)
    x = sample(task, rng, 8192)[0]
    task["out_scale"] = 1.0 / float(np.std(_teacher(task, x)))
    return task


def _teacher(task: dict, x: np.ndarray) -> np.ndarray:
    u = (x / task["mean"] - 1.0) / 0.1
    return np.tanh(u @ task["w1"]) @ task["w2"] * task["out_scale"]


def sample(task: dict, rng: np.random.Generator, n: int) -> tuple:
    z = rng.normal(size=(n, len(task["mean"])))
    x = np.clip(task["mean"] * (1.0 + 0.1 * z), 0.0, 65000.0)
    y = _teacher(task, x)
    return x.astype(np.float32), y[:, None].astype(np.float32)


# --------------------------------------------------------------------------- #
# Model: embed -> LayerNorm -> residual MLP blocks -> LayerNorm -> head.
# --------------------------------------------------------------------------- #


def init_params(key: jax.Array, features: int, width: int, depth: int) -> dict:
    """LeCun-normal weights, zero biases, unit LayerNorm scales."""
    keys = jax.random.split(key, 2 * depth + 2)

    def dense(k, n_in, n_out):
        w = jax.random.normal(k, (n_in, n_out)) / math.sqrt(n_in)
        return {"w": w, "b": jnp.zeros((n_out,))}

    def norm(n):
        return {"scale": jnp.ones((n,)), "bias": jnp.zeros((n,))}

    params = {"embed": dense(keys[0], features, width), "embed_norm": norm(width)}
    for i in range(depth):
        params[f"block_{i}"] = {
            "norm": norm(width),
            "up": dense(keys[2 * i + 1], width, 4 * width),
            "down": dense(keys[2 * i + 2], 4 * width, width),
        }
    params["head_norm"] = norm(width)
    params["head"] = dense(keys[-1], width, 1)
    return params


def layer_norm(p: dict, h: jax.Array) -> jax.Array:
    mu = jnp.mean(h, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(h - mu), axis=-1, keepdims=True)
    return (h - mu) * jax.lax.rsqrt(var + 1e-5) * p["scale"][None] + p["bias"][None]


def dense(p: dict, h: jax.Array) -> jax.Array:
    return h @ p["w"] + p["b"][None]  # explicit broadcasts: strict rank promotion


def model(params: dict, x: jax.Array) -> jax.Array:
    """The matmul sites are ``embed``, ``block_i/up``, ``block_i/down`` and
    ``head`` (their ``jax.named_scope``)."""
    with jax.named_scope("embed"):
        h = dense(params["embed"], x)  # |h| up to ~1e5: float16 overflows here
    h = layer_norm(params["embed_norm"], h)
    depth = sum(1 for k in params if k.startswith("block_"))
    for i in range(depth):
        p = params[f"block_{i}"]
        with jax.named_scope(f"block_{i}"):
            u = layer_norm(p["norm"], h)
            with jax.named_scope("up"):
                u = jax.nn.gelu(dense(p["up"], u))
            with jax.named_scope("down"):
                h = h + dense(p["down"], u)
    with jax.named_scope("head"):
        return dense(params["head"], layer_norm(params["head_norm"], h))


def loss_fn(params: dict, x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean(jnp.square(model(params, x) - y))


def highest(fun):
    """``fun`` with float32 matmuls at ``Precision.HIGHEST`` (the reference)."""

    def run(*args):
        with jax.default_matmul_precision("highest"):
            return fun(*args)

    return run


def policies(plan: Any) -> dict[str, Any]:
    """The loss of each run."""
    return {
        "float32": highest(loss_fn),
        "float16": jxs.autocast(loss_fn, jnp.float16),
        "bfloat16": jxs.autocast(loss_fn, jnp.bfloat16),
        "plan": jxs.autocast(loss_fn, jnp.float16, plan=plan),
    }


SCALED = ("float16", "plan")  # the runs with dynamic loss scaling


# --------------------------------------------------------------------------- #
# Training.
# --------------------------------------------------------------------------- #


def batches(seed: int, task: dict, size: dict) -> tuple[np.ndarray, np.ndarray]:
    """Every step's batch, stacked: the same for every run of a seed."""
    rng = np.random.default_rng(1000 + seed)
    x, y = sample(task, rng, size["steps"] * size["batch"])
    shape = (size["steps"], size["batch"])
    return x.reshape(*shape, -1), y.reshape(*shape, 1)


def train(run: str, loss: Any, params: dict, data: tuple, size: dict) -> dict:
    """Trains with adam (cosine decay) under one policy; the whole loop is one
    ``lax.scan``. Returns the final parameters, the losses, the skipped steps."""
    inner = optax.adam(optax.cosine_decay_schedule(size["lr"], size["steps"]))
    scaled = run in SCALED
    if scaled:
        tx = jxs.dynamic_scaling(
            inner, jxs.DynamicLossScale.create(init_scale=size["loss_scale"])
        )
    else:
        tx = inner

    def step(carry, batch):
        params, state = carry
        if scaled:
            value, grads = jxs.value_and_grad(loss, state)(params, *batch)
        else:
            value, grads = jax.value_and_grad(loss)(params, *batch)
        updates, state = tx.update(grads, state, params)
        return (optax.apply_updates(params, updates), state), value

    @jax.jit
    def loop(params, data):
        (params, state), losses = jax.lax.scan(step, (params, tx.init(params)), data)
        return params, state, losses

    params, state, losses = loop(params, data)
    losses = np.asarray(losses)
    return dict(
        params=params,
        losses=losses,
        skipped=int(state.skipped_steps) if scaled else 0,
        nonfinite=int(np.sum(~np.isfinite(losses))),
        final_scale=float(jxs.loss_scale_of(state).loss_scale) if scaled else None,
    )


def grad_errors(
    losses: dict, params: dict, data: tuple, loss_scale: float
) -> dict[str, list[float]]:
    """Per policy, the relative L2 error of each leaf's gradient against
    float32's, over the batches ``data``."""
    ref_grad = jax.jit(jax.grad(losses["float32"]))

    def grad_of(run):
        scale = loss_scale if run in SCALED else 1.0

        @jax.jit
        def g(params, x, y):
            grads = jax.grad(lambda p: losses[run](p, x, y) * scale)(params)
            return jax.tree.map(lambda t: t.astype(jnp.float32) / scale, grads)

        return g

    out = {}
    for run in RUNS[1:]:
        g = grad_of(run)
        errs = []
        for x, y in zip(*data, strict=True):
            ref = jax.tree.leaves(ref_grad(params, x, y))
            got = jax.tree.leaves(g(params, x, y))
            for a, b in zip(got, ref, strict=True):
                a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
                if not np.all(np.isfinite(a)):
                    errs.append(math.inf)
                elif np.linalg.norm(b) > 0:
                    errs.append(float(np.linalg.norm(a - b) / np.linalg.norm(b)))
        out[run] = errs
    return out


def site_errors(f16: dict, bf16: dict) -> dict[str, dict[str, float]]:
    """Per site, from two sensors' raw sums (averaged over the batches), its
    16-bit product in float16 and in bfloat16: the outputs that overflow, the
    Fisher sum ``sum((g * dy)**2)`` (``g``: the loss gradient at the output,
    ``dy``: the output's error; overflowed outputs left out) and the relative
    L2 errors of the backward products ``g w^T`` (``dx``) and ``x^T g``
    (``dw``)."""
    out = {}
    for site in f16:
        row = {}
        for name, stats in (("float16", f16), ("bfloat16", bf16)):
            s, ref = stats[site][F.HALF], stats[site]["reference"]
            row[f"{name}_overflow"] = float(s["overflow"])
            row[f"{name}_fisher"] = float(s["fisher"])
            for k in ("dx", "dw"):
                r = ref[k + "_ref"]
                row[f"{name}_{k}"] = math.sqrt(s[k] / r) if r > 0 else 0.0
        out[site] = row
    return out


def site_table(sites: dict, calibration: int) -> str:
    lines = [
        f"Each site's 16-bit product on the {calibration} calibration batches "
        "(sensor sums; float16 at loss scale S, bfloat16 at 1): outputs that "
        "overflow, sqrt(sum((g * dy)**2)) (g: the loss gradient at the output, "
        "dy: the output's error), relative L2 error of the weight gradient x^T g.",
        "",
        "| site | float16 overflows | float16 sqrt(fisher) | bfloat16 sqrt(fisher) "
        "| float16 dW error | bfloat16 dW error |",
        "|---|---|---|---|---|---|",
    ]
    for site, r in sites.items():
        lines.append(
            f"| {site} | {r['float16_overflow']:.4g} | "
            f"{math.sqrt(r['float16_fisher']):.2e} | "
            f"{math.sqrt(r['bfloat16_fisher']):.2e} | {r['float16_dw']:.2e} | "
            f"{r['bfloat16_dw']:.2e} |"
        )
    return "\n".join(lines)


def embed_max(params: dict, x: np.ndarray) -> float:
    """The largest ``|x @ w + b|`` of the embed site, in float32."""
    return float(jnp.max(jnp.abs(dense(params["embed"], jnp.asarray(x)))))


# --------------------------------------------------------------------------- #
# One seed, all runs.
# --------------------------------------------------------------------------- #


def one_seed(seed: int, size: dict, calibration: int, show_plan: bool) -> dict:
    task = make_task(seed, size["features"])
    data = batches(seed, task, size)
    held_out = sample(task, np.random.default_rng(2000 + seed), 4096)
    params0 = init_params(
        jax.random.key(seed), size["features"], size["width"], size["depth"]
    )

    t0 = time.perf_counter()
    sensor = jxs.precision.Sensor(loss_fn, jnp.float16, loss_scale=size["loss_scale"])
    for i in range(calibration):
        sensor.update(params0, data[0][i], data[1][i])
    plan = sensor.plan(budget="16-bit", cost="H100")
    plan_seconds = time.perf_counter() - t0
    half = [m for m in sensor.measures() if math.isinf(m.errors[F.HALF])]
    notes = {m.site: m.notes.get(F.HALF, "") for m in half}
    # The same batches through a bfloat16 sensor: each site's own 16-bit error
    # in either dtype (raw sums, comparable between the two sensors).
    bf16 = jxs.precision.Sensor(loss_fn, jnp.bfloat16)
    for i in range(calibration):
        bf16.update(params0, data[0][i], data[1][i])
    sites = site_errors(sensor.stats(), bf16.stats())
    if show_plan:
        print(plan)
        print()
        for site, note in notes.items():
            print(f"sensor, float16 at {site}: {note}")
        print()
        print(site_table(sites, calibration))
        print()

    losses = policies(plan)
    evaluate = jax.jit(losses["float32"])
    result: dict[str, Any] = dict(
        seed=seed,
        plan=plan.to_json(),
        formats={s: f.value for s, f in plan.formats().items()},
        float16_fails=notes,
        sites=sites,
        plan_seconds=plan_seconds,
        embed_max_init=embed_max(params0, data[0][0]),
        runs={},
    )
    finals = {}
    for run in RUNS:
        t0 = time.perf_counter()
        out = train(run, losses[run], params0, data, size)
        seconds = time.perf_counter() - t0
        finals[run] = out["params"]
        tail = out["losses"][-50:]
        result["runs"][run] = dict(
            final_train=float(np.mean(tail)),
            eval=float(evaluate(out["params"], *held_out)),
            skipped=out["skipped"],
            nonfinite_losses=out["nonfinite"],
            final_scale=out["final_scale"],
            seconds=seconds,
            embed_max_final=embed_max(out["params"], data[0][-1]),
        )
    # Gradient errors on the initial and float32's final parameters, over
    # four batches (the last four of training).
    probe = (data[0][-4:], data[1][-4:])
    for where, p in (("init", params0), ("trained", finals["float32"])):
        errs = grad_errors(losses, p, probe, size["loss_scale"])
        errs["float32"] = [0.0]
        for r, e in errs.items():
            result["runs"][r][f"grad_error_{where}"] = dict(
                median=float(np.median(e)), max=float(np.max(e))
            )
    return result


def _fmt(x: float, spec: str = ".4g") -> str:
    if x is None:
        return "-"
    if not math.isfinite(x):
        return "nan" if math.isnan(x) else "inf"
    return format(x, spec)


def table(results: list[dict], steps: int) -> str:
    lines = [
        "| run | final train loss | held-out loss (float32 eval) | vs float32 "
        f"| skipped / {steps} steps | non-finite losses | grad error at init "
        "| grad error, trained |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for run in RUNS:
        rows = [r["runs"][run] for r in results]
        ref = [r["runs"]["float32"]["eval"] for r in results]
        train_ = " / ".join(_fmt(x["final_train"]) for x in rows)
        ev = " / ".join(_fmt(x["eval"]) for x in rows)
        gap = " / ".join(
            _fmt(x["eval"] - e, "+.2e") if run != "float32" else "0"
            for x, e in zip(rows, ref, strict=True)
        )
        skipped = " / ".join(str(x["skipped"]) for x in rows)
        nonfinite = " / ".join(str(x["nonfinite_losses"]) for x in rows)
        grads = []
        for where in ("init", "trained"):
            e = [x[f"grad_error_{where}"] for x in rows]
            med = statistics.median(x["median"] for x in e)
            mx = max(x["max"] for x in e)
            grads.append(f"{_fmt(med, '.2e')} ({_fmt(mx, '.2e')})")
        lines.append(
            f"| {run} | {train_} | {ev} | {gap} | {skipped} | {nonfinite} | "
            f"{grads[0]} | {grads[1]} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, help="training steps per run")
    parser.add_argument(
        "--calibration", type=int, default=4, help="calibration batches"
    )
    parser.add_argument(
        "--loss-scale",
        type=float,
        default=LOSS_SCALE,
        help="initial loss scale of the float16 and plan runs, and the sensor's",
    )
    parser.add_argument("--quick", action="store_true", help="tiny: the tests' size")
    parser.add_argument("--json", metavar="PATH", help="write the numbers here")
    args = parser.parse_args(argv)
    size = dict(SIZES["quick" if args.quick else "full"])
    if args.steps:
        size["steps"] = args.steps
    size["loss_scale"] = args.loss_scale

    t0 = time.perf_counter()
    results = []
    for i, seed in enumerate(args.seeds):
        r = one_seed(seed, size, args.calibration, show_plan=i == 0)
        results.append(r)
        print(
            f"seed {seed}: plan {r['formats']}; embed max |x @ w| "
            f"{r['embed_max_init']:.3g} at init; "
            + ", ".join(f"{k} {v['seconds']:.1f} s" for k, v in r["runs"].items()),
            flush=True,
        )
    total = time.perf_counter() - t0
    print()
    print(
        f"{size['steps']} steps of batch {size['batch']}, seeds "
        f"{' / '.join(map(str, args.seeds))}, initial loss scale "
        f"{size['loss_scale']:g} (each cell: one value per seed; grad error, at "
        "the initial parameters and at float32's final ones: median over the "
        "seeds of the median over leaves and batches, and the largest)"
    )
    print()
    print(table(results, size["steps"]))
    print(f"\ntotal {total:.0f} s")
    doc = dict(
        benchmark="precision_overflow",
        command="python benchmarks/precision_overflow.py " + " ".join(argv or []),
        jax=jax.__version__,
        jaxscale=jxs.__version__,
        machine=f"{platform.machine()}, {jax.devices()[0].device_kind}",
        size=size,
        calibration_batches=args.calibration,
        seconds=total,
        seeds=results,
    )
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
        print(f"numbers written to {Path(args.json).resolve()}")
    return doc


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
