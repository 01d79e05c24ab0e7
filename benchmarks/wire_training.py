"""Gradient transport in training: does a compressed reduction change the loss?

A one-block character-level transformer (the text and vocabulary of
``examples/char_transformer.py``: the standard library's own source) trained
data parallel over 8 CPU devices inside ``jax.shard_map``, its loss under
``jxs.autocast(..., jnp.float16)`` with ``jxs.dynamic_scaling`` around Adam, each
device differentiating its own quarter of the batch. Four ways to average the
per-device gradients, three seeds each (the seed picks the initial weights and the
batches; the four runs of a seed see the same ones):

1. ``float32 pmean``: ``lax.pmean`` of the float32 gradients, the reference;
2. ``float16 pmean``: ``lax.pmean`` of the *scaled* gradients cast to float16, a
   16-bit sum, as XLA's partitioner reduced float16 autocast's gradients before
   ``gradient_dtype`` (a sum that overflows is a skipped step);
3. ``bfloat16 all-to-all``: ``jxs.reduce_gradients(wire_dtype=jnp.bfloat16)``
   (block scales, float32 sum) inside ``dynamic_scaling``;
4. ``float8 e4m3 + error feedback``: the same with ``jnp.float8_e4m3fn`` and
   ``error_feedback=True``;
5. ``float8 e4m3 + error feedback, 16-bit warm-up``: the same with
   ``warmup_steps=--warmup`` (bfloat16 on the wire for the first steps).

Rows 1 and 2 reduce the scaled gradients in the step, before ``tx.update``
(``dynamic_scaling`` then sees the mean), rows 3 and 4 inside
``dynamic_scaling`` (unscaled, ``axis_name="data"``), as docs/multidevice.md
places them. Printed: the validation loss (a fixed held-out set, evaluated in
float32) at the end, and mid-training at each step of ``--eval`` (one table
each), per run as mean and spread (max - min) over the seeds, the steps
skipped, and the gap of the mean to float32's in units of float32's spread:
within twice the spread, or the gap stated. XLA:CPU widens bfloat16 and float8
collectives on the wire; the values sent are rounded to the wire dtype first,
so the numerics are the wire dtype's.

    python benchmarks/wire_training.py               # 300 steps, 3 seeds
    python benchmarks/wire_training.py --runs f32,f8,f8w --eval 150
    python benchmarks/wire_training.py --steps 40 --seeds 2   # quick
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from types import MappingProxyType

import jax

jax.config.update("jax_num_cpu_devices", 8)  # before any backend starts

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxscale as jxs  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from char_transformer import load_text  # noqa: E402

RUNS = MappingProxyType(  # --runs key: the row's name
    {
        "f32": "float32 pmean",
        "f16": "float16 pmean",
        "bf16": "bfloat16 all-to-all",
        "f8": "float8 e4m3 + error feedback",
        "f8w": "float8 e4m3 + error feedback, 16-bit warm-up",
    }
)
DEVICES = 8
PMEAN = {"float32 pmean": jnp.float32, "float16 pmean": jnp.float16}


def tokens() -> tuple[np.ndarray, np.ndarray, int]:
    text, _ = load_text()
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    ids = np.array([index[c] for c in text], np.int32)
    split = int(0.9 * len(ids))
    return ids[:split], ids[split:], len(chars)


def init(key: jax.Array, vocab: int, context: int, dim: int) -> dict:
    keys = iter(jax.random.split(key, 8))

    def dense(m, n):
        return jax.random.normal(next(keys), (m, n), jnp.float32) / np.sqrt(m)

    def norm():  # fresh arrays: donated buffers must not be shared
        return jnp.ones((dim,), jnp.float32), jnp.zeros((dim,), jnp.float32)

    return {
        "embed": 0.02 * jax.random.normal(next(keys), (vocab, dim), jnp.float32),
        "pos": 0.02 * jax.random.normal(next(keys), (context, dim), jnp.float32),
        "ln1": norm(),
        "qkv": dense(dim, 3 * dim),
        "proj": dense(dim, dim),
        "ln2": norm(),
        "fc": dense(dim, 4 * dim),
        "out": dense(4 * dim, dim),
        "ln": norm(),
        "head": dense(dim, vocab),
    }


def layer_norm(x, scale_bias):
    scale, bias = scale_bias
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) * lax.rsqrt(var + np.float32(1e-5)) * scale + bias


def loss_fn(params, x, y, heads=4):
    b, t = x.shape
    h = params["embed"][x] + params["pos"][:t]
    d = h.shape[-1]
    q, k, v = jnp.split(layer_norm(h, params["ln1"]) @ params["qkv"], 3, axis=-1)
    q, k, v = (a.reshape(b, t, heads, d // heads) for a in (q, k, v))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.float32(np.sqrt(d // heads))
    causal = jnp.tril(jnp.ones((t, t), jnp.bool_))
    att = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)
    h = h + jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, t, d) @ params["proj"]
    h = h + jax.nn.gelu(layer_norm(h, params["ln2"]) @ params["fc"]) @ params["out"]
    logits = (layer_norm(h, params["ln"]) @ params["head"]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def pmean_in(grads, dtype):
    """``lax.pmean`` over ``data`` of the gradients cast to ``dtype``."""
    return jax.tree.map(
        lambda g: lax.pmean(g.astype(dtype), "data").astype(g.dtype), grads
    )


def optimizer(run: str, lr: float, warmup: int) -> optax.GradientTransformation:
    adam = optax.adam(lr)
    if run in PMEAN:
        return jxs.dynamic_scaling(adam)  # the step reduces the scaled gradients
    if run == "bfloat16 all-to-all":
        reduce = jxs.reduce_gradients("data", wire_dtype=jnp.bfloat16)
    else:
        reduce = jxs.reduce_gradients(
            "data",
            wire_dtype=jnp.float8_e4m3fn,
            error_feedback=True,
            warmup_steps=warmup if run == RUNS["f8w"] else 0,
        )
    return jxs.dynamic_scaling(optax.chain(reduce, adam), axis_name="data")


_STEPS: dict = {}
_evaluate = jax.jit(loss_fn)


def validate(params, val_ids, context: int) -> float:
    val_rng = np.random.default_rng(1234)  # the same held-out windows everywhere
    starts = val_rng.integers(0, len(val_ids) - context - 1, 512)
    w = val_ids[starts[:, None] + np.arange(context + 1)]
    return float(_evaluate(params, w[:, :-1], w[:, 1:]))


def train(run: str, seed: int, data, args) -> tuple[list[float], int]:
    """Trains one run; returns its validation losses (at each ``--eval``
    step, then at the end) and its skipped steps."""
    train_ids, val_ids, vocab = data
    mesh = jax.make_mesh((DEVICES,), ("data",))
    params = init(jax.random.key(seed), vocab, args.context, args.dim)
    tx = optimizer(run, args.lr, args.warmup)
    with jax.set_mesh(mesh):  # error feedback's init needs the axis size
        opt_state = tx.init(params)
    specs = jxs.reduce_state_specs(opt_state, "data")
    opt_state = jax.device_put(
        opt_state, jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
    )
    objective = jxs.autocast(loss_fn, jnp.float16)

    def step(params, opt_state, x, y):
        with jax.numpy_dtype_promotion("standard"):  # optax.adam promotes
            _, grads = jxs.value_and_grad(objective, opt_state)(params, x, y)
            if run in PMEAN:
                grads = pmean_in(grads, PMEAN[run])
            updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    if run not in _STEPS:  # one compile per run, reused by every seed
        _STEPS[run] = jax.jit(
            jax.shard_map(
                step,
                mesh=mesh,
                in_specs=(P(), specs, P("data"), P("data")),
                out_specs=(P(), specs),
                check_vma=False,  # per-device gradients, reduced by the run's choice
            ),
            donate_argnums=(0, 1),
        )
    step = _STEPS[run]
    rng = np.random.default_rng(seed)
    batch = DEVICES * args.batch
    sharding = NamedSharding(mesh, P("data"))
    skipped = 0
    vals = []
    for i in range(args.steps):
        if i in args.eval:
            vals.append(validate(params, val_ids, args.context))
        starts = rng.integers(0, len(train_ids) - args.context - 1, batch)
        w = train_ids[starts[:, None] + np.arange(args.context + 1)]
        x, y = jax.device_put((w[:, :-1], w[:, 1:]), sharding)
        params, opt_state = step(params, opt_state, x, y)
        # One step in flight: XLA:CPU's collectives on few cores can deadlock
        # when the next step's threads take the pool the current one waits for.
        jax.block_until_ready(params)
    skipped = int(jxs.diagnostics.summary(opt_state)["skipped_steps"])
    return [*vals, validate(params, val_ids, args.context)], skipped


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4, help="sequences per device")
    parser.add_argument("--context", type=int, default=32)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument(
        "--warmup", type=int, default=100, help="f8w's warm-up steps in bfloat16"
    )
    parser.add_argument(
        "--eval",
        default="",
        help="comma-separated steps at which to evaluate mid-training too",
    )
    parser.add_argument(
        "--runs",
        default=",".join(RUNS),
        help="comma-separated, from: f32,f16,bf16,f8,f8w",
    )
    args = parser.parse_args(argv)
    args.eval = sorted({int(s) for s in args.eval.split(",") if s})
    if not all(0 < s < args.steps for s in args.eval):
        parser.error(f"--eval steps must lie in 1..{args.steps - 1}, got {args.eval}")
    keys = args.runs.split(",")
    if keys[0] != "f32" or not set(keys) <= set(RUNS):
        parser.error(f"--runs must start with f32 and name runs of {list(RUNS)}")
    runs = [RUNS[k] for k in keys]
    data = tokens()
    print(
        f"char transformer (1 block, dim {args.dim}, context {args.context}), "
        f"{DEVICES} CPU devices x {args.batch} sequences, {args.steps} steps, "
        f"seeds 0..{args.seeds - 1}; float16 autocast + dynamic_scaling(adam); "
        f"f8w warm-up {args.warmup} steps; jax {jax.__version__}"
    )
    results: dict[str, list[tuple[list[float], int]]] = {}
    start = time.perf_counter()
    for run in runs:
        t = time.perf_counter()
        results[run] = [train(run, seed, data, args) for seed in range(args.seeds)]
        print(f"  {run}: {time.perf_counter() - t:.0f} s", flush=True)
    seconds = time.perf_counter() - start
    for at, step in enumerate([*args.eval, args.steps]):
        table(runs, results, at, step, args.steps)
    print(f"\n({len(runs) * args.seeds} runs in {seconds:.0f} s)")


def table(runs: list[str], results: dict, at: int, step: int, steps: int) -> None:
    """The table of validation losses after ``step`` steps (``at``: its index
    among the evaluations)."""
    ref = np.array([v[at] for v, _ in results[runs[0]]])
    ref_spread = float(ref.max() - ref.min())
    what = "final val loss" if step == steps else f"val loss at step {step}"
    skips = "skipped" if step == steps else "skipped (whole run)"
    print()
    print(f"| reduction | {what} (mean ± spread/2) | {skips} | gap to float32 |")
    print("|---|---|---|---|")
    for run in runs:
        vals = np.array([v[at] for v, _ in results[run]])
        skipped = sum(s for _, s in results[run])
        gap = float(vals.mean() - ref.mean())
        spread = float(vals.max() - vals.min())
        if run == runs[0]:
            verdict = f"reference (spread {ref_spread:.4f})"
        elif abs(gap) <= 2 * ref_spread:
            verdict = f"{gap:+.4f}: within twice the seed spread"
        else:
            units = abs(gap) / ref_spread if ref_spread > 0 else float("inf")
            verdict = f"{gap:+.4f}: {units:.1f}x float32's seed spread"
        print(
            f"| {run} | {vals.mean():.4f} ± {spread / 2:.4f} | {skipped} | {verdict} |"
        )


if __name__ == "__main__":
    main()
