"""A padded language model in Flax linen: fp32, fp16 by hand, fp16 and bf16 autocast.

Real batches are padded: sequences end early and their tail is a padding token
that the attention masks out and the loss weights by zero. This example trains a
decoder-only transformer written the way flax's ``lm1b`` example writes it
(pre-LayerNorm blocks, ``nn.MultiHeadDotProductAttention``, learned position
embeddings, inputs shifted right, token 0 = padding, the causal mask combined
with ``nn.make_attention_mask(inputs > 0, inputs > 0)`` by ``nn.combine_masks``,
and the loss ``sum(weights * ce) / sum(weights)`` with weight 0 on padding). The
data is character-level Python source, the standard library's own ``.py`` files
(a fixed list next to the ``os`` module; nothing is downloaded). In every batch
the first ``--pad`` fraction of the sequences (30% by default) stop at a random
length and are padded with 0 to the end; the last 10% of the text is held out
for validation, padded the same way.

The same initial parameters and batches are trained four ways:

1. ``fp32``: the model as written, float32 (no ``dtype`` anywhere);
2. ``fp16-hand``: the same class built with ``dtype=jnp.float16`` (flax's own
   mixed precision: every layer computes in float16, parameters float32), with
   ``jxs.dynamic_scaling``;
3. ``fp16-autocast``: the float32 model of run 1, its loss wrapped in
   ``jxs.autocast``, with ``jxs.dynamic_scaling``;
4. ``bf16-autocast``: the same under ``jxs.autocast(..., jnp.bfloat16)``,
   without a loss scale (``jxs.NoOpLossScale``).

Every run uses the same step: ``jxs.value_and_grad``, then
``jxs.dynamic_scaling(optax.chain(jxs.clip_by_global_norm(...), optax.adamw(...)))``
(fp32 and bf16 with ``jxs.NoOpLossScale()``, which still skips non-finite steps),
so all four report skipped steps. Per run it prints the final training loss, the
validation loss on fixed held-out padded batches (computed the run's way, and
with the float32 model at the run's final parameters), the skipped steps, the
final loss scale and whether anything was NaN; ``--json`` writes the same.

The padding mask is where mixed precision can go wrong: flax masks the attention
scores with ``jnp.finfo(dtype).min`` of the dtype the model was *written* in.
Whatever happens (a NaN loss, every step skipped) is reported, not hidden.

Run it (about 4 minutes on 2 CPU cores)::

    python examples/padded_lm.py
    python examples/padded_lm.py --steps 50 --runs fp32,fp16-autocast --json out.json
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import time
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxscale as jxs

try:  # The progress bar is optional.
    from tqdm import tqdm
except ImportError:  # pragma: no cover - depends on the environment
    tqdm = None

RUNS = ("fp32", "fp16-hand", "fp16-autocast", "bf16-autocast")

# Standard-library modules present in every CPython 3.11+ install, in this order.
STDLIB_FILES = (
    "argparse.py",
    "ast.py",
    "dataclasses.py",
    "enum.py",
    "functools.py",
    "inspect.py",
    "textwrap.py",
    "typing.py",
)


def load_text() -> tuple[str, list[str]]:
    """The concatenated source of :data:`STDLIB_FILES` and the paths read."""
    lib = os.path.dirname(os.path.abspath(os.__file__))
    parts, used = [], []
    for name in STDLIB_FILES:
        path = os.path.join(lib, name)
        if os.path.isfile(path):  # Some distributions strip a few .py files.
            with open(path, encoding="utf-8", errors="replace") as f:
                parts.append(f.read())
            used.append(path)
    text = "\n".join(parts)
    if len(text) < 100_000:
        raise SystemExit(
            f"Found only {len(text)} characters of standard-library source in "
            f"{lib}; this example needs the .py files of the standard library."
        )
    return text, used


# --------------------------------------------------------------------------- #
# The model: flax's lm1b decoder, without dropout.
# --------------------------------------------------------------------------- #

_kernel_init = nn.initializers.xavier_uniform()
_bias_init = nn.initializers.normal(stddev=1e-6)


def shift_right(x: jax.Array) -> jax.Array:
    """Shifts ``x`` one position right along axis 1, with 0 (padding) in front."""
    return jnp.pad(x, ((0, 0), (1, 0)))[:, :-1]


class MlpBlock(nn.Module):
    """Dense, ReLU, Dense back to the input width."""

    mlp_dim: int
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kw = {"dtype": self.dtype, "kernel_init": _kernel_init, "bias_init": _bias_init}
        h = nn.relu(nn.Dense(self.mlp_dim, **kw)(x))
        return nn.Dense(x.shape[-1], **kw)(h)


class DecoderBlock(nn.Module):
    """Pre-LayerNorm block: masked self-attention, then the MLP, each residual."""

    heads: int
    mlp_dim: int
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        h = nn.LayerNorm(dtype=self.dtype)(x)
        h = nn.MultiHeadDotProductAttention(
            num_heads=self.heads,
            dtype=self.dtype,
            kernel_init=_kernel_init,
            bias_init=_bias_init,
            use_bias=False,
            deterministic=True,
        )(h, mask=mask)
        x = x + h
        h = nn.LayerNorm(dtype=self.dtype)(x)
        return x + MlpBlock(self.mlp_dim, self.dtype)(h)


class PaddedLM(nn.Module):
    """Decoder-only transformer over tokens ``1..vocab-1``; token 0 is padding.

    ``dtype`` is the compute dtype of every layer (parameters stay float32), as in
    flax's examples. Position ``i`` predicts ``inputs[:, i]`` from
    ``inputs[:, :i]`` (the inputs are shifted right inside).
    """

    vocab: int
    context: int
    dim: int
    heads: int
    layers: int
    mlp_dim: int
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, inputs: jax.Array) -> jax.Array:
        mask = nn.combine_masks(
            nn.make_attention_mask(inputs > 0, inputs > 0, dtype=self.dtype),
            nn.make_causal_mask(inputs, dtype=self.dtype),
        )
        y = nn.Embed(
            self.vocab,
            self.dim,
            embedding_init=nn.initializers.normal(stddev=1.0),
            dtype=self.dtype,
        )(shift_right(inputs))
        pos = self.param(
            "pos_embedding",
            nn.initializers.normal(stddev=0.02),
            (1, self.context, self.dim),
        )
        y = y + pos[:, : inputs.shape[1]].astype(self.dtype)
        for _ in range(self.layers):
            y = DecoderBlock(self.heads, self.mlp_dim, self.dtype)(y, mask)
        y = nn.LayerNorm(dtype=self.dtype)(y)
        kw = {"kernel_init": _kernel_init, "bias_init": _bias_init}
        return nn.Dense(self.vocab, dtype=self.dtype, **kw)(y)


def loss_terms(model: PaddedLM, params, inputs: jax.Array):
    """``(sum(weights * ce), sum(weights))`` over the batch, in float32.

    ``weights`` is 0 on padding and 1 elsewhere; the loss is their ratio (a sum
    of both over several batches gives the loss over all their tokens).
    """
    logits = model.apply({"params": params}, inputs).astype(jnp.float32)
    weights = (inputs > 0).astype(jnp.float32)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, inputs)
    return jnp.sum(ce * weights), jnp.sum(weights)


# --------------------------------------------------------------------------- #
# Data.
# --------------------------------------------------------------------------- #


def make_batch(
    data: jax.Array, context: int, size: int, n_pad: int, key: jax.Array
) -> jax.Array:
    """``size`` random windows of ``data``; the first ``n_pad`` are padded.

    A padded sequence keeps a random length in ``[1, context)`` and is 0 after it.
    """
    k_start, k_len = jax.random.split(key)
    starts = jax.random.randint(k_start, (size,), 0, data.shape[0] - context)
    seqs = jax.vmap(lambda s: jax.lax.dynamic_slice(data, (s,), (context,)))(starts)
    lengths = jax.random.randint(k_len, (size,), 1, context)
    lengths = jnp.where(jnp.arange(size) < n_pad, lengths, context)
    keep = jnp.arange(context)[None, :] < lengths[:, None]
    return jnp.where(keep, seqs, 0)


# --------------------------------------------------------------------------- #
# Training.
# --------------------------------------------------------------------------- #


def build_run(name: str, args, vocab: int) -> tuple[Callable, Any, bool]:
    """The run's objective ``(params, inputs) -> (sum, count)``, its loss scale
    and whether it scales."""
    shape = (vocab, args.context, args.dim, args.heads, args.layers, args.mlp_dim)
    model32 = PaddedLM(*shape)
    if name == "fp32":
        return functools.partial(loss_terms, model32), jxs.NoOpLossScale(), False
    if name == "fp16-hand":
        model16 = PaddedLM(*shape, dtype=jnp.float16)
        objective = functools.partial(loss_terms, model16)
    elif name == "fp16-autocast":
        objective = jxs.autocast(functools.partial(loss_terms, model32))
    elif name == "bf16-autocast":
        objective = jxs.autocast(functools.partial(loss_terms, model32), jnp.bfloat16)
        return objective, jxs.NoOpLossScale(), False
    else:  # main() checks the names.
        raise ValueError(f"unknown run {name!r}")
    scale = jxs.DynamicLossScale.create(growth_interval=args.growth_interval)
    return objective, scale, True


def evaluator(objective: Callable) -> Callable:
    """A jitted ``(params, val_batches) -> loss`` over all the batches' tokens."""

    @jax.jit
    def evaluate(params, val_batches: jax.Array) -> jax.Array:
        total, count = jax.lax.map(lambda b: objective(params, b), val_batches)
        return jnp.sum(total) / jnp.sum(count)

    return evaluate


def train(name: str, init_params, data, val_batches, evaluate32, args) -> dict:
    """Trains one run from ``init_params``; returns its numbers.

    The steps run in jitted chunks of ``--eval-every`` steps (a ``lax.scan``,
    one compiled program per run), each followed by the validation loss.
    ``evaluate32`` is the float32 model's evaluation, shared by all runs.
    """
    train_data, _, vocab = data
    objective, loss_scale, scaling = build_run(name, args, vocab)
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, args.lr, min(100, args.steps // 10 + 1), args.steps, args.lr / 10
    )
    tx = jxs.dynamic_scaling(
        optax.chain(
            jxs.clip_by_global_norm(args.clip),  # sees the unscaled gradients
            optax.adamw(schedule, b2=0.98, weight_decay=0.1),
        ),
        loss_scale,
    )
    params = jax.tree.map(jnp.copy, init_params)  # the steps donate their inputs
    opt_state = tx.init(params)
    key = jax.random.key(args.seed)
    n_pad = round(args.pad * args.batch)
    evaluate = evaluate32 if name == "fp32" else evaluator(objective)

    def loss_fn(params, inputs):
        total, count = objective(params, inputs)
        return total / count

    def train_step(carry, step):
        params, opt_state = carry
        # The same batches in every run: they depend on the seed and step only.
        inputs = make_batch(
            train_data, args.context, args.batch, n_pad, jax.random.fold_in(key, step)
        )
        loss, grads = jxs.value_and_grad(loss_fn, opt_state)(params, inputs)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        s = jxs.diagnostics.summary(opt_state)
        return (params, opt_state), (loss, s["loss_scale"], s["last_step_finite"])

    @functools.partial(jax.jit, static_argnums=3, donate_argnums=(0, 1))
    def train_chunk(params, opt_state, first, length, val_batches):
        steps = first + jnp.arange(length)
        (params, opt_state), out = jax.lax.scan(train_step, (params, opt_state), steps)
        return params, opt_state, out, evaluate(params, val_batches)

    history, val = [], []
    bar = None
    log = print
    if tqdm is not None:  # disable=None: a bar on a terminal only.
        bar = tqdm(
            total=args.steps, desc=f"{name:>13}", unit="step", disable=None, leave=False
        )
        log = tqdm.write
    start = time.perf_counter()
    for first in range(0, args.steps, args.eval_every):
        length = min(args.eval_every, args.steps - first)
        params, opt_state, out, v = train_chunk(
            params, opt_state, first, length, val_batches
        )
        history.append(out)
        v = float(v)  # the only host sync of the chunk
        val.append((first + length, v))
        log(f"{name:>13}  step {first + length:5d}  val loss {v:.4f}")
        if bar is not None:
            bar.update(length)
    seconds = time.perf_counter() - start
    if bar is not None:
        bar.close()
    losses, scales, finite = (
        np.concatenate([np.asarray(h[i]) for h in history]) for i in range(3)
    )
    s = jxs.diagnostics.summary(opt_state)
    host = jax.tree.leaves(jax.device_get(params))
    params_finite = bool(all(np.isfinite(p).all() for p in host))
    val_fp32 = float(evaluate32(params, val_batches))
    final_train = float(np.mean(losses[-min(10, len(losses)) :]))
    nonfinite_losses = int(np.sum(~np.isfinite(losses)))
    return {
        "name": name,
        "scaling": scaling,
        "train_loss": final_train,
        "val_loss": val[-1][1],
        "val_loss_fp32_eval": val_fp32,
        "steps": int(s["steps"]),
        "skipped_steps": int(s["skipped_steps"]),
        "final_loss_scale": float(s["loss_scale"]),
        "nonfinite_train_losses": nonfinite_losses,
        "params_finite": params_finite,
        "any_nan": bool(
            nonfinite_losses
            or not params_finite
            or not all(math.isfinite(v) for _, v in val)
            or not math.isfinite(val_fp32)
        ),
        "val": val,
        "loss": losses,
        "scale": scales,
        "finite": finite,
        "seconds": seconds,
    }


def _json_number(x: float) -> float | None:
    """``x``, or None where it is not finite (JSON has no NaN)."""
    return x if math.isfinite(x) else None


def to_json(runs: list[dict], args, files: list[str], vocab: int) -> dict:
    """The ``--json`` document: the settings, and per run its numbers; a
    non-finite loss is written as null."""
    out = []
    for r in runs:
        out.append(
            {
                "name": r["name"],
                "train_loss": _json_number(r["train_loss"]),
                "val_loss": _json_number(r["val_loss"]),
                "val_loss_fp32_eval": _json_number(r["val_loss_fp32_eval"]),
                "steps": r["steps"],
                "skipped_steps": r["skipped_steps"],
                "final_loss_scale": r["final_loss_scale"],
                "nonfinite_train_losses": r["nonfinite_train_losses"],
                "params_finite": r["params_finite"],
                "any_nan": r["any_nan"],
                "val": [[s, _json_number(v)] for s, v in r["val"]],
                "seconds": r["seconds"],
            }
        )
    config = {k: v for k, v in vars(args).items() if k != "json"}
    return {
        "config": config,
        "vocab": vocab,
        "files": [os.path.basename(f) for f in files],
        "jax": jax.__version__,
        "jaxscale": jxs.__version__,
        "backend": jax.default_backend(),
        "runs": out,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps")
    parser.add_argument(
        "--runs",
        default=",".join(RUNS),
        help=f"comma-separated runs, from {', '.join(RUNS)} (default: all)",
    )
    parser.add_argument("--seed", type=int, default=0, help="random seed")
    parser.add_argument("--context", type=int, default=64, help="tokens per sequence")
    parser.add_argument("--dim", type=int, default=64, help="model width")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--mlp-dim", type=int, default=256)
    parser.add_argument("--batch", type=int, default=32, help="sequences per batch")
    parser.add_argument(
        "--pad", type=float, default=0.3, help="fraction of padded sequences"
    )
    parser.add_argument("--lr", type=float, default=3e-3, help="peak AdamW rate")
    parser.add_argument("--clip", type=float, default=1.0, help="max global norm")
    parser.add_argument(
        "--growth-interval",
        type=int,
        default=50,
        help="finite steps before the scale doubles (torch: 2000)",
    )
    parser.add_argument(
        "--eval-every", type=int, default=50, help="steps between validations"
    )
    parser.add_argument(
        "--eval-batches", type=int, default=8, help="validation batches"
    )
    parser.add_argument("--json", metavar="PATH", help="write the numbers here")
    args = parser.parse_args(argv)
    for name in ("steps", "context", "dim", "layers", "heads", "mlp_dim", "batch"):
        if getattr(args, name) < 1:
            parser.error(f"`--{name.replace('_', '-')}` must be >= 1.")
    if args.context < 2:
        parser.error(f"`--context` must be >= 2, got {args.context}.")
    if args.dim % args.heads:
        parser.error(
            f"`--dim` must be a multiple of `--heads`, got {args.dim} and {args.heads}."
        )
    if not 0.0 <= args.pad <= 1.0:
        parser.error(f"`--pad` must be in [0, 1], got {args.pad}.")
    if args.eval_every < 1 or args.eval_batches < 1:
        parser.error("`--eval-every` and `--eval-batches` must be >= 1.")
    runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    unknown = [r for r in runs if r not in RUNS]
    if not runs or unknown or len(set(runs)) != len(runs):
        parser.error(
            f"`--runs` must name distinct runs from {', '.join(RUNS)}, got "
            f"{args.runs!r}."
        )
    args.runs = ",".join(runs)
    return args


def main(argv: list[str] | None = None) -> dict:
    """Runs the example; returns the ``--json`` document."""
    args = parse_args(argv)
    text, files = load_text()
    chars = sorted(set(text))
    index = {c: i + 1 for i, c in enumerate(chars)}  # 0 is padding
    tokens = np.array([index[c] for c in text], np.int32)
    split = int(0.9 * len(tokens))
    vocab = len(chars) + 1
    data = (jnp.asarray(tokens[:split]), jnp.asarray(tokens[split:]), vocab)
    n_pad = round(args.pad * args.batch)
    print(
        f"jaxscale {jxs.__version__}: {len(text):,} characters of Python source "
        f"from {len(files)} standard-library files, vocabulary {vocab} (0 = "
        f"padding); {args.steps} steps of {args.batch} sequences of "
        f"{args.context}, {n_pad} of them padded, per run on "
        f"{jax.default_backend()}"
    )

    model = PaddedLM(
        vocab, args.context, args.dim, args.heads, args.layers, args.mlp_dim
    )
    dummy = jnp.ones((1, args.context), jnp.int32)
    init_params = jax.jit(model.init)(jax.random.key(args.seed), dummy)["params"]
    n_params = sum(p.size for p in jax.tree.leaves(init_params))
    print(f"{n_params:,} parameters, the same initial values in every run")

    # A fixed validation set: the same padded windows for every run.
    val_batches = jax.vmap(
        lambda k: make_batch(data[1], args.context, args.batch, n_pad, k)
    )(jax.random.split(jax.random.key(1234), args.eval_batches))
    evaluate32 = evaluator(functools.partial(loss_terms, model))
    runs = [
        train(name, init_params, data, val_batches, evaluate32, args)
        for name in args.runs.split(",")
    ]

    print(
        f"\n{'run':<14} {'train loss':>10} {'val loss':>8} {'val (fp32 eval)':>15} "
        f"{'skipped':>9} {'final scale':>11} {'NaN':>4} {'time':>6}"
    )
    for r in runs:
        scale = r["final_loss_scale"]
        scale = f"2**{np.log2(scale):g}" if scale > 0 else f"{scale:g}"
        skipped = f"{r['skipped_steps']}/{r['steps']}"
        print(
            f"{r['name']:<14} {r['train_loss']:>10.4f} {r['val_loss']:>8.4f} "
            f"{r['val_loss_fp32_eval']:>15.4f} {skipped:>9} {scale:>11} "
            f"{'yes' if r['any_nan'] else 'no':>4} {r['seconds']:>5.1f}s"
        )
    for r in runs:
        if r["any_nan"]:
            print(
                f"{r['name']}: non-finite training loss on "
                f"{r['nonfinite_train_losses']} of {r['steps']} steps, "
                f"{r['skipped_steps']} steps skipped, parameters "
                f"{'finite' if r['params_finite'] else 'NOT finite'}"
            )
    doc = to_json(runs, args, files, vocab)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1)
        print(f"metrics written to {os.path.abspath(args.json)}")
    return doc


if __name__ == "__main__":
    main()
