"""Per-site cotangent scales within a pass against one global loss scale (issue 49.4).

A loss scale multiplies every cotangent of the backward pass by one number. Where
the cotangents of different layers differ by more than float16's range allows,
one scale cannot serve them all: the scale that keeps the largest ones finite
lets the smallest ones flush to zero. Per-site scales (Zhao et al. 2019, "Adaptive
loss scaling") give each layer's cotangent its own power-of-two scale.

Two models, each a stack of ``depth`` layers with a boundary on the activation
between layer ``i`` and ``i + 1`` (a cut of the graph: every path from the loss to
the layers below passes through it):

- ``deep``: an unnormalised tanh stack, ``h = tanh(h @ w + x @ u + b)``, with
  ``w`` at a small gain (``--gain``): the cotangents shrink by about
  ``gain * E[tanh']`` per layer going down. (The input ``x`` enters every layer,
  else such a stack forgets it and learns nothing, in float32 too);
- ``residual``: a pre-LayerNorm residual MLP (``h = h + W2 gelu(W1 norm(h))``)
  whose cotangents stay within a factor of a few across the stack.

Three runs per seed, same initial parameters and batches (adam, cosine decay):

- ``float32``: the float32 loss at ``Precision.HIGHEST``;
- ``global``: ``jxs.autocast(loss, float16)`` with ``jxs.dynamic_scaling`` (one
  scale; steps with a non-finite gradient skipped);
- ``per-site``: the same, and at each boundary the float16 cotangent is
  re-expressed at that layer's own power-of-two scale ``S_i`` (a ``custom_vjp``
  that multiplies the incoming cotangent by ``S_i / S_{i+1}``; the layer's
  weight gradients come out at ``S_i`` and are brought to the global scale in
  float32). ``S_i`` is delayed, as float8's scales are: chosen from the previous
  step's amax of the cotangent arriving there so that ``amax * S_i`` is in
  ``[2**(t-1), 2**t)`` (``--target``), divided by 16 after a step whose layer
  gradients overflowed, kept after one whose cotangent was all zero.

Residual connections: the boundaries sit on the residual stream between blocks,
so both branches of a block (skip and MLP) are in one region and their
cotangents meet at one scale.

Per run: the final training loss (mean of the last 10% of steps), the held-out
loss in float32, the skipped steps. Per layer, at each run's final parameters
(four held-out batches): the float32 cotangent's amax, and the **underflow
share**: of the cotangent's nonzero float32 values (float32 backward at the same
parameters), the share that are zero in the float16 backward at the run's final
scale(s).

Run::

    python benchmarks/site_scales.py                      # ~7 minutes, 2 CPU cores
    python benchmarks/site_scales.py --json site_scales.json
    python benchmarks/site_scales.py --quick              # seconds: the tests' size
"""

from __future__ import annotations

import argparse
import functools
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

RUNS = ("float32", "global", "per-site")
MODELS = ("deep", "residual")
SIZES = {
    "full": dict(features=16, width=64, depth=20, batch=128, steps=1500, lr=3e-3),
    "quick": dict(features=8, width=16, depth=4, batch=16, steps=6, lr=3e-3),
}
INIT_SCALE = 2.0**15
GROWTH_INTERVAL = 100
MIN_SCALE, MAX_SCALE = 2.0**-20, 2.0**60  # the per-site scales' clip


# --------------------------------------------------------------------------- #
# The boundary: a custom_vjp identity that re-expresses the cotangent.
# --------------------------------------------------------------------------- #


def _rescale(g, scale, above, dtype):
    # The product in float32 (a ratio up to 2**80 is no float16), then the one
    # rounding to the dtype the backward flows in.
    g = g.astype(jnp.float32)
    out = (g * (scale / above)).astype(dtype)
    return out, out.astype(jnp.float32) / scale, jnp.max(jnp.abs(g)) / above


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def boundary(h, scale, above, probe, stat, dtype):
    """Identity on ``h``. Backward: the cotangent arrives at scale ``above``
    (``f32[]``, the region above's), leaves at ``scale`` (``f32[]``), rounded
    to ``dtype`` (static; the dtype the backward flows in). ``probe``'s
    cotangent is that rounded cotangent in true units (divided by ``scale``),
    in float32; ``stat``'s (``f32[]``) the incoming cotangent's amax in true
    units (the delayed rule's input: it is there even where ``scale`` is
    too small for anything to survive the rounding)."""
    del scale, above, probe, stat, dtype
    return h


def _boundary_fwd(h, scale, above, probe, stat, dtype):
    del probe, stat, dtype
    return h, (scale, above)


def _boundary_bwd(dtype, res, g):
    scale, above = res
    # Autocast traces this rule at the forward's traced dtypes (float32) and runs
    # it on the float16 cotangent: enabled=False keeps the product in float32
    # (autocast's scalar rule would take it to float16, where 2**20 is inf).
    out, true, amax = jxs.autocast(_rescale, enabled=False)(g, scale, above, dtype)
    return out, jnp.zeros_like(scale), jnp.zeros_like(above), true, amax


boundary.defvjp(_boundary_fwd, _boundary_bwd)


# --------------------------------------------------------------------------- #
# Models: a list of layers, a boundary after each.
# --------------------------------------------------------------------------- #


def init_params(key: jax.Array, model: str, size: dict, gain: float) -> dict:
    f, w, depth = size["features"], size["width"], size["depth"]
    keys = jax.random.split(key, 2 * depth + 2)

    def dense(k, n_in, n_out, g=1.0, bias=0.0, kb=None):
        p = {"w": g * jax.random.normal(k, (n_in, n_out)) / math.sqrt(n_in)}
        p["b"] = bias * jax.random.normal(kb, (n_out,)) if bias else jnp.zeros(n_out)
        return p

    layers = []
    for i in range(depth):
        n_in = f if i == 0 else w
        if model == "deep":
            g = 1.0 if i == 0 else gain
            layer = dense(keys[2 * i], n_in, w, g, 0.5, keys[2 * i + 1])
            if i > 0:  # the input, injected into every layer
                k = jax.random.fold_in(keys[2 * i], 1)
                layer["u"] = jax.random.normal(k, (f, w)) / math.sqrt(f)
            layers.append(layer)
        elif i == 0:
            layers.append(dense(keys[0], n_in, w))
        else:
            layers.append(
                {
                    "scale": jnp.ones(w),
                    "up": dense(keys[2 * i], w, 2 * w),
                    "down": dense(keys[2 * i + 1], 2 * w, w, 0.5),
                }
            )
    head = dense(keys[-1], w, 1)
    return {"layers": layers, "head": head}


def _dense(p, h):
    return h @ p["w"] + p["b"][None]  # explicit broadcast: strict rank promotion


def _norm(scale, h):
    mu = jnp.mean(h, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(h - mu), axis=-1, keepdims=True)
    return (h - mu) * jax.lax.rsqrt(var + 1e-5) * scale[None]


def forward(params, x, scales, above, probes, dtype=jnp.float32):
    """The model's output; boundary ``i`` after layer ``i``, rounding its
    cotangent to ``dtype``."""
    residual = any("scale" in p for p in params["layers"])
    h = x
    for i, p in enumerate(params["layers"]):
        if "scale" in p:  # a residual block
            u = jax.nn.gelu(_dense(p["up"], _norm(p["scale"], h)))
            h = h + _dense(p["down"], u)
        elif residual:  # the residual model's first layer
            h = _dense(p, h)
        elif "u" in p:  # deep, layers 1..
            h = jnp.tanh(_dense(p, h) + x @ p["u"])
        else:
            h = jnp.tanh(_dense(p, h))
        h = boundary(
            h, scales[i], above[i], probes["probe"][i], probes["stat"][i], dtype
        )
    if residual:
        h = _norm(jnp.ones(h.shape[-1]), h)
    return _dense(params["head"], h)


def loss_fn(params, probes, scales, above, x, y, dtype=jnp.float32):
    out = forward(params, x, scales, above, probes, dtype)
    return jnp.mean(jnp.square(out - y))


def half_loss(params, probes, scales, above, x, y):
    """``loss_fn`` under float16 autocast, boundaries rounding to float16."""
    return jxs.autocast(loss_fn, jnp.float16)(
        params, probes, scales, above, x, y, jnp.float16
    )


def highest(fun):
    def run(*args):
        with jax.default_matmul_precision("highest"):
            return fun(*args)

    return run


# --------------------------------------------------------------------------- #
# Data: a random teacher of the inputs, unit variance.
# --------------------------------------------------------------------------- #


def make_data(seed: int, size: dict) -> tuple[np.ndarray, np.ndarray, tuple]:
    rng = np.random.default_rng(seed)
    f = size["features"]
    w1 = rng.normal(size=(f, 64)) / math.sqrt(f)
    w2 = rng.normal(size=(64,)) / 8.0

    def sample(n):
        x = rng.normal(size=(n, f))
        return x, np.sin(2.0 * np.tanh(x @ w1) @ w2)

    x, y = sample(size["steps"] * size["batch"] + 4 * size["batch"])
    y = (y - y.mean()) / y.std()
    x, y = x.astype(np.float32), y[:, None].astype(np.float32)
    n = size["steps"] * size["batch"]
    shape = (size["steps"], size["batch"])
    train = (x[:n].reshape(*shape, f), y[:n].reshape(*shape, 1))
    held = (x[n:].reshape(4, size["batch"], f), y[n:].reshape(4, size["batch"], 1))
    return train[0], train[1], held


# --------------------------------------------------------------------------- #
# Training.
# --------------------------------------------------------------------------- #


def make_probes(batch: int, width: int, depth: int) -> dict:
    """Zeros whose cotangents are each boundary's rounded cotangent (``probe``,
    true units) and incoming amax (``stat``, ``f32[depth]``)."""
    return {"probe": [jnp.zeros((batch, width))] * depth, "stat": jnp.zeros(depth)}


def _above(scales: jax.Array, top: jax.Array) -> jax.Array:
    """Each boundary's incoming scale: the next boundary's, the loss scale's for
    the last."""
    return jnp.concatenate([scales[1:], top[None]])


def next_scales(
    scales: jax.Array, amax: jax.Array, finite: jax.Array, target: int
) -> jax.Array:
    """The delayed per-site rule: ``amax * S`` in ``[2**(target-1), 2**target)``;
    / 16 after an overflow in the layer; kept after an all-zero cotangent."""
    e = jnp.floor(jnp.log2(2.0**target / jnp.maximum(amax, 1e-38)))
    chosen = jnp.exp2(e)
    # An all-zero cotangent keeps its scale: it can come from the region above
    # (what arrives is already zero), where growing this one only overflows.
    new = jnp.where(amax > 0, chosen, scales)
    new = jnp.where(finite & jnp.isfinite(amax), new, scales / 16.0)
    return jnp.clip(new, MIN_SCALE, MAX_SCALE)


def train(run: str, params: dict, xs, ys, size: dict, target: int) -> dict:
    loop, tx = _loop(run, tuple(sorted(size.items())), target)
    (params, state, scales), (losses, zeros) = loop(params, xs, ys)
    losses, zeros = np.asarray(losses), np.asarray(zeros)
    scaled = run != "float32"
    top = float(jxs.loss_scale_of(state).loss_scale) if scaled else 1.0
    depth = size["depth"]
    return dict(
        params=params,
        losses=losses,
        zeros=zeros,
        skipped=int(state.skipped_steps) if scaled else 0,
        top=top,
        scales=np.asarray(scales) if run == "per-site" else np.full(depth, top),
    )


@functools.cache
def _loop(run: str, size_items: tuple, target: int) -> tuple[Any, Any]:
    """The jitted training loop of one run (compiled once for every seed)."""
    size = dict(size_items)
    depth = size["depth"]
    inner = optax.adam(optax.cosine_decay_schedule(size["lr"], size["steps"]))
    probes = make_probes(size["batch"], size["width"], depth)
    ones = jnp.ones(depth)
    if run == "float32":
        tx, loss = inner, highest(loss_fn)
    else:
        tx = jxs.dynamic_scaling(
            inner,
            jxs.DynamicLossScale.create(
                init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL
            ),
        )
        loss = half_loss

    def step(carry, batch):
        params, state, scales = carry
        x, y = batch
        if run == "float32":
            value, grads = jax.value_and_grad(loss)(params, probes, ones, ones, x, y)
            updates, state = tx.update(grads, state, params)
            zeros = jnp.zeros(depth)
            return (optax.apply_updates(params, updates), state, scales), (value, zeros)
        top = jxs.loss_scale_of(state).loss_scale
        use = scales if run == "per-site" else jnp.full(depth, top)
        value, (grads, cts) = jxs.value_and_grad(loss, state, argnums=(0, 1))(
            params, probes, use, _above(use, top), x, y
        )
        # Layer i's gradient came out at use[i]: to the loss scale, in float32.
        layers = [
            jax.tree.map(lambda g, f=top / use[i]: g * f, grads["layers"][i])
            for i in range(depth)
        ]
        grads = {"layers": layers, "head": grads["head"]}
        finite = jnp.stack(
            [
                jnp.all(
                    jnp.stack([jnp.all(jnp.isfinite(t)) for t in jax.tree.leaves(g)])
                )
                for g in layers
            ]
        )
        amax = cts["stat"]  # incoming, true units
        zeros = jnp.stack(
            [jnp.mean((c == 0).astype(jnp.float32)) for c in cts["probe"]]
        )
        updates, state = tx.update(grads, state, params)
        scales = next_scales(scales, amax, finite, target)
        return (optax.apply_updates(params, updates), state, scales), (value, zeros)

    @jax.jit
    def loop(params, xs, ys):
        init = (params, tx.init(params), jnp.full(depth, INIT_SCALE))
        return jax.lax.scan(step, init, (xs, ys))

    return loop, tx


@jax.jit
def _ref_cotangents(params, probes, x, y):
    ones = jnp.ones(len(probes["stat"]))
    return jax.grad(highest(loss_fn), argnums=1)(params, probes, ones, ones, x, y)


@jax.jit
def _half_cotangents(params, probes, s, top, x, y):
    def scaled(p, q):
        return half_loss(p, q, s, _above(s, top), x, y) * top

    return jax.grad(scaled, argnums=1)(params, probes)


evaluate = jax.jit(highest(loss_fn))


def underflow(params, held, scales: np.ndarray, top: float, depth: int) -> dict:
    """Per layer: the float32 cotangent's amax and the share of its nonzero
    values that are zero in the float16 backward at ``scales`` (``top`` at the
    loss)."""
    probes = make_probes(held[0].shape[1], params["head"]["w"].shape[0], depth)
    s, t = jnp.asarray(scales, jnp.float32), jnp.float32(top)
    shares = np.zeros(depth)
    amax = np.zeros(depth)
    for x, y in zip(*held, strict=True):
        ref = _ref_cotangents(params, probes, x, y)
        got = _half_cotangents(params, probes, s, t, x, y)
        for i in range(depth):
            r, g = np.asarray(ref["probe"][i]), np.asarray(got["probe"][i])
            nz = r != 0
            shares[i] += np.sum(nz & (g == 0)) / max(1, np.sum(nz)) / len(held[0])
            amax[i] = max(amax[i], float(np.max(np.abs(r))))
    return dict(share=shares.tolist(), amax=amax.tolist())


def one_seed(model: str, seed: int, size: dict, gain: float, target: int) -> dict:
    xs, ys, held = make_data(seed, size)
    params0 = init_params(jax.random.key(seed), model, size, gain)
    ones = jnp.ones(size["depth"])
    probes = make_probes(size["batch"], size["width"], size["depth"])
    init_amax = underflow(
        params0, held, np.full(size["depth"], INIT_SCALE), INIT_SCALE, size["depth"]
    )["amax"]
    out: dict[str, Any] = dict(seed=seed, init_amax=init_amax, runs={})
    tail = max(1, size["steps"] // 10)
    for run in RUNS:
        t0 = time.perf_counter()
        r = train(run, params0, xs, ys, size, target)
        seconds = time.perf_counter() - t0
        ev = [
            float(evaluate(r["params"], probes, ones, ones, x, y))
            for x, y in zip(*held, strict=True)
        ]
        row = dict(
            final_train=float(np.mean(r["losses"][-tail:])),
            eval=float(np.mean(ev)),
            skipped=r["skipped"],
            nonfinite=int(np.sum(~np.isfinite(r["losses"]))),
            loss_scale=r["top"],
            seconds=seconds,
        )
        if run != "float32":
            u = underflow(r["params"], held, r["scales"], r["top"], size["depth"])
            row.update(share=u["share"], amax=u["amax"])
            row["log2_scales"] = np.log2(r["scales"]).tolist()
            row["zeros_early"] = r["zeros"][:tail].mean(axis=0).tolist()
            row["zeros_all"] = r["zeros"].mean(axis=0).tolist()
        out["runs"][run] = row
    return out


# --------------------------------------------------------------------------- #
# Tables.
# --------------------------------------------------------------------------- #


def _spread(xs: list[float], spec: str = ".4g") -> str:
    if not all(math.isfinite(x) for x in xs):
        return " / ".join(format(x, spec) for x in xs)
    m = statistics.mean(xs)
    half = (max(xs) - min(xs)) / 2
    return f"{m:{spec}} ± {half:.1g}"


def loss_table(results: list[dict], steps: int) -> str:
    lines = [
        f"| run | final train loss | held-out loss (float32) | skipped / {steps} "
        "| final loss scale |",
        "|---|---|---|---|---|",
    ]
    for run in RUNS:
        rows = [r["runs"][run] for r in results]
        scale = " / ".join(
            f"2**{math.log2(x['loss_scale']):g}" if run != "float32" else "-"
            for x in rows
        )
        lines.append(
            f"| {run} | {_spread([x['final_train'] for x in rows])} | "
            f"{_spread([x['eval'] for x in rows])} | "
            f"{' / '.join(str(x['skipped']) for x in rows)} | {scale} |"
        )
    return "\n".join(lines)


def _cells(xs: list[float], spec: str) -> str:
    return " / ".join(format(x, spec) for x in xs)


def _log2(xs: list[float]) -> str:
    return " / ".join(f"{math.log2(a):.0f}" if a > 0 else "-inf" for a in xs)


def site_table(results: list[dict]) -> str:
    """Per layer: amaxes, zero shares in training, underflow at the end."""
    lines = [
        "| layer | log2 amax, init | log2 amax, final | global: zero share, "
        "first 10% / all steps | per-site: zero share, first 10% / all steps "
        "| global: underflow, final | per-site: underflow, final "
        "| per-site: log2 S_i, final |",
        "|---|---|---|---|---|---|---|---|",
    ]
    depth = len(results[0]["runs"]["global"]["share"])
    for i in range(depth):
        g = [r["runs"]["global"] for r in results]
        p = [r["runs"]["per-site"] for r in results]
        zg = [f"{x['zeros_early'][i]:.2f} / {x['zeros_all'][i]:.2f}" for x in g]
        zp = [f"{x['zeros_early'][i]:.2f} / {x['zeros_all'][i]:.2f}" for x in p]
        lines.append(
            f"| {i} | {_log2([r['init_amax'][i] for r in results])} "
            f"| {_log2([x['amax'][i] for x in g])} "
            f"| {' ; '.join(zg)} | {' ; '.join(zp)} "
            f"| {_cells([x['share'][i] for x in g], '.3f')} "
            f"| {_cells([x['share'][i] for x in p], '.3f')} "
            f"| {_cells([x['log2_scales'][i] for x in p], 'g')} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, help="training steps per run")
    parser.add_argument("--depth", type=int, help="layers (boundaries)")
    parser.add_argument(
        "--gain", type=float, default=0.25, help="deep: weight gain of layers 1.."
    )
    parser.add_argument(
        "--target", type=int, default=8, help="per-site: amax * S_i below 2**target"
    )
    parser.add_argument("--quick", action="store_true", help="tiny: the tests' size")
    parser.add_argument("--json", metavar="PATH", help="write the numbers here")
    args = parser.parse_args(argv)
    size = dict(SIZES["quick" if args.quick else "full"])
    if args.steps:
        size["steps"] = args.steps
    if args.depth:
        size["depth"] = args.depth

    print(
        f"env: jax {jax.__version__}, jaxscale {jxs.__version__}, "
        f"{platform.machine()} {jax.devices()[0].device_kind}, "
        f"Python {platform.python_version()}"
    )
    t0 = time.perf_counter()
    doc: dict[str, Any] = dict(
        benchmark="site_scales",
        command="python benchmarks/site_scales.py " + " ".join(argv or []),
        jax=jax.__version__,
        jaxscale=jxs.__version__,
        machine=f"{platform.machine()}, {jax.devices()[0].device_kind}",
        size=size,
        gain=args.gain,
        target=args.target,
        models={},
    )
    for model in args.models:
        results = [
            one_seed(model, seed, size, args.gain, args.target) for seed in args.seeds
        ]
        doc["models"][model] = results
        print()
        print(
            f"## {model}: depth {size['depth']}, width {size['width']}, "
            f"{size['steps']} steps of batch {size['batch']}, seeds "
            f"{' / '.join(map(str, args.seeds))} (mean ± half the range)"
        )
        print()
        print(loss_table(results, size["steps"]))
        print()
        print(
            "Per layer (0 = first; cells are seeds): the float32 cotangent's "
            "amax at the initial parameters and at global's final ones; the "
            "share of the float16 cotangent that is zero during training (mean "
            "over the first 10% of steps and over all); at each run's final "
            "parameters, the share of the float32 cotangent's nonzero values "
            "that are zero in float16 (underflow), and per-site's final scales."
        )
        print()
        print(site_table(results))
    doc["seconds"] = time.perf_counter() - t0
    print(f"\ntotal {doc['seconds']:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
        print(f"numbers written to {Path(args.json).resolve()}")
    return doc


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
