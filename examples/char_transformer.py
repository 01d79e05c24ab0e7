"""A character-level GPT in Flax NNX: fp16 + dynamic loss scaling vs fp32.

A small decoder-only transformer learns to predict the next character of Python
source code: the standard library's own ``.py`` files (a fixed list, found next
to the ``os`` module, so every Python install has them and nothing is
downloaded). The last 10% of the text is held out for validation.

The same model, seed and batches are trained three times:

1. ``fp32``: float32 compute, the reference;
2. ``fp16+jaxscale``: float16 compute (``dtype=jnp.float16`` in every layer,
   float32 parameters), ``jxs.dynamic_scaling`` around the optimizer (the
   scale grows after 50 finite steps instead of torch's 2000, so that a short
   run shows it move);
3. ``fp16+autocast``: the float32 model of run 1 (no ``dtype``, no cast), its
   loss wrapped in ``jxs.autocast``, with the loss scaling of run 2: the
   matmuls run in float16; the layer norms, the softmax, the loss and (as in
   torch, where the embedding and the residual adds stay float32) the residual
   stream in float32.

Both use the nanoGPT recipe: AdamW with warm-up and cosine decay, gradient
clipping by global norm and gradient accumulation over micro-batches. Clipping
(``jxs.clip_by_global_norm``) sits *inside* ``jxs.dynamic_scaling``, so it sees
the unscaled gradients and computes their norm in float32. Accumulation is
``jxs.accumulate_value_and_grad``: a ``lax.scan`` over the micro-batches, one loss
scale for the whole effective batch, one finiteness check, one optimizer update
(the fp32 run uses the same code with ``jxs.NoOpLossScale()``). The optimizer is an
``nnx.Optimizer(model, tx, wrt=nnx.Param)`` updated in an ``nnx.jit`` step.

It prints the validation loss of both runs as training goes, then how many
gradient elements the float16 backward pass flushes to zero without a loss scale
and with the final one, and saves a plot (training and validation loss; loss
scale with the skipped steps marked).

Run it (about a minute on a CPU)::

    python examples/char_transformer.py --steps 300 --seed 0
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jaxscale as jxs

try:  # The progress bar is optional.
    from tqdm import tqdm
except ImportError:  # pragma: no cover - depends on the environment
    tqdm = None

# Standard-library modules present in every CPython 3.11+ install, in this order.
STDLIB_FILES = (
    "abc.py",
    "argparse.py",
    "ast.py",
    "collections/__init__.py",
    "contextlib.py",
    "dataclasses.py",
    "enum.py",
    "functools.py",
    "inspect.py",
    "json/decoder.py",
    "json/encoder.py",
    "string.py",
    "textwrap.py",
    "typing.py",
)


def load_data() -> tuple[tuple[jax.Array, jax.Array, int], str, list[str]]:
    """``((train tokens, validation tokens, vocabulary size), text, paths)``: the
    text of :func:`load_text` as character ids, the last 10% held out."""
    text, files = load_text()
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    tokens = np.array([index[c] for c in text], np.int32)
    split = int(0.9 * len(tokens))
    data = (jnp.asarray(tokens[:split]), jnp.asarray(tokens[split:]), len(chars))
    return data, text, files


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


class Block(nnx.Module):
    """Pre-LayerNorm transformer block: causal self-attention, then an MLP."""

    def __init__(self, dim: int, heads: int, dtype: Any, rngs: nnx.Rngs):
        kw = {"dtype": dtype, "param_dtype": jnp.float32, "rngs": rngs}
        self.heads = heads
        self.ln1 = nnx.LayerNorm(dim, **kw)
        self.qkv = nnx.Linear(dim, 3 * dim, **kw)
        self.proj = nnx.Linear(dim, dim, **kw)
        self.ln2 = nnx.LayerNorm(dim, **kw)
        self.fc = nnx.Linear(dim, 4 * dim, **kw)
        self.out = nnx.Linear(4 * dim, dim, **kw)

    def __call__(self, x: jax.Array) -> jax.Array:
        b, t, d = x.shape
        q, k, v = jnp.split(self.qkv(self.ln1(x)), 3, axis=-1)
        q, k, v = (a.reshape(b, t, self.heads, d // self.heads) for a in (q, k, v))
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d // self.heads)
        causal = jnp.tril(jnp.ones((t, t), jnp.bool_))
        # The softmax in float32, as torch's autocast does; then back to dtype.
        scores = jnp.where(causal, scores.astype(jnp.float32), -jnp.inf)
        att = jax.nn.softmax(scores, axis=-1).astype(x.dtype)
        y = jnp.einsum("bhqk,bkhd->bqhd", att, v)
        x = x + self.proj(y.reshape(b, t, d))
        return x + self.out(nnx.gelu(self.fc(self.ln2(x))))


class GPT(nnx.Module):
    """Token and position embeddings, ``layers`` blocks, a final norm and head.

    Parameters are float32; every layer computes in ``dtype``.
    """

    def __init__(
        self,
        vocab: int,
        context: int,
        dim: int,
        layers: int,
        heads: int,
        dtype: Any,
        rngs: nnx.Rngs,
    ):
        kw = {"dtype": dtype, "param_dtype": jnp.float32, "rngs": rngs}
        self.embed = nnx.Embed(vocab, dim, **kw)
        self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(), (context, dim)))
        self.blocks = nnx.List([Block(dim, heads, dtype, rngs) for _ in range(layers)])
        self.ln = nnx.LayerNorm(dim, **kw)
        self.head = nnx.Linear(dim, vocab, **kw)
        self.dtype = dtype

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]].astype(self.dtype)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def cross_entropy(model: GPT, x: jax.Array, y: jax.Array) -> jax.Array:
    """Mean next-character loss, reduced in float32 whatever the compute dtype."""
    logits = model(x).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def make_batches(data: jax.Array, context: int, size: int, key: jax.Array):
    """``size`` random windows of ``data``: inputs and next-character targets."""
    starts = jax.random.randint(key, (size,), 0, data.shape[0] - context - 1)
    window = jax.vmap(lambda s: jax.lax.dynamic_slice(data, (s,), (context + 1,)))
    w = window(starts)
    return w[:, :-1], w[:, 1:]


def train(
    name: str, dtype: Any, scaling: bool, data, args, autocast: bool = False
) -> dict[str, Any]:
    """Trains one run; returns its history and final model.

    With ``autocast``, the model is float32 (``dtype`` is ignored for it) and its
    loss runs under ``jxs.autocast(..., dtype)``.
    """
    train_data, val_data, vocab = data
    objective = jxs.autocast(cross_entropy, dtype) if autocast else cross_entropy
    if autocast:
        dtype = jnp.float32
    shape = (vocab, args.context, args.dim, args.layers, args.heads)
    model = GPT(*shape, dtype=dtype, rngs=nnx.Rngs(args.seed))
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, args.lr, min(100, args.steps // 10 + 1), args.steps, args.lr / 10
    )
    inner = optax.chain(
        jxs.clip_by_global_norm(args.clip),  # sees the unscaled gradients
        optax.adamw(schedule, b2=0.99, weight_decay=0.1),
    )
    if scaling:
        loss_scale = jxs.DynamicLossScale.create(growth_interval=args.growth_interval)
    else:
        loss_scale = jxs.NoOpLossScale()
    optimizer = nnx.Optimizer(
        model, jxs.dynamic_scaling(inner, loss_scale), wrt=nnx.Param
    )
    key = jax.random.key(args.seed)
    batch = args.micro_batch * args.accumulate

    @nnx.jit
    def train_step(model, optimizer, step):
        # The same batches in every run: they depend on the seed and step only.
        x, y = make_batches(
            train_data, args.context, batch, jax.random.fold_in(key, step)
        )
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)

        def loss_fn(params, x, y):
            return objective(nnx.merge(graphdef, params, rest), x, y)

        # lax.scan over the micro-batches, at one loss scale; mean scaled grads.
        grad_fn = jxs.accumulate_value_and_grad(
            loss_fn, optimizer, num_microbatches=args.accumulate
        )
        loss, grads = grad_fn(params, x, y)
        optimizer.update(model, grads)  # unscale, check, clip, AdamW (or skip)
        s = jxs.diagnostics.summary(optimizer)
        return loss, s["loss_scale"], s["last_step_finite"]

    @nnx.jit
    def evaluate(model, x, y):
        return jax.lax.map(lambda b: objective(model, *b), (x, y)).mean()

    # A fixed validation set: the same windows for every evaluation and run.
    val_x, val_y = make_batches(
        val_data, args.context, args.eval_batches * batch, jax.random.key(1234)
    )
    val_x = val_x.reshape(args.eval_batches, batch, args.context)
    val_y = val_y.reshape(args.eval_batches, batch, args.context)

    history, val = [], []
    steps = range(args.steps)
    log = print
    if tqdm is not None:  # disable=None: a bar on a terminal only.
        steps = tqdm(steps, desc=f"{name:>13}", unit="step", disable=None, leave=False)
        log = tqdm.write
    start = time.perf_counter()
    for step in steps:
        history.append(train_step(model, optimizer, step))
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            v = float(evaluate(model, val_x, val_y))  # the only host syncs
            val.append((step + 1, v))
            log(f"{name:>13}  step {step + 1:5d}  val loss {v:.4f}")
    seconds = time.perf_counter() - start
    losses, scales, finite = (
        np.asarray(jnp.stack(h)) for h in zip(*history, strict=True)
    )
    return {
        "name": name,
        "model": model,
        "optimizer": optimizer,
        "scaling": scaling,
        "loss": losses,
        "scale": scales,
        "finite": finite,
        "val": val,
        "seconds": seconds,
    }


def gradient_underflow(model32: GPT, model16: GPT, x, y, scale: float) -> dict:
    """Gradient elements the float16 backward pass loses, unscaled vs scaled.

    Takes the parameters of ``model32``. Among the elements of their float32
    gradient (``model32``'s float32 compute) on the batch ``x, y`` that are
    non-zero, counts those that the float16 backward pass (``model16``'s
    compute, same parameters) of ``s * loss`` returns as zero (flushed) or as a
    float16 subnormal (below ``2**-14`` before unscaling: a few bits left), for
    ``s`` = 1 and ``s = scale``.
    """
    params = nnx.state(model32, nnx.Param)

    def grads(model, s):
        graphdef, _, rest = nnx.split(model, nnx.Param, ...)

        def loss(p):
            return cross_entropy(nnx.merge(graphdef, p, rest), x, y) * s

        g = jax.jit(jax.grad(loss))(params)
        return jnp.concatenate([a.ravel() for a in jax.tree.leaves(g)])

    live = grads(model32, 1.0) != 0
    n = jnp.sum(live)
    tiny = float(jnp.finfo(jnp.float16).smallest_normal)
    out = {}
    for label, s in (("unscaled", 1.0), ("scaled", scale)):
        g = grads(model16, s)
        flushed = jnp.sum(live & (g == 0)) / n
        subnormal = jnp.sum(live & (g != 0) & (jnp.abs(g) < tiny)) / n
        out[label] = (float(flushed), float(subnormal))
    return out


def plot(runs, path: str) -> bool:
    """Saves loss curves and the loss scale to ``path``; False without matplotlib."""
    try:
        import matplotlib
    except ImportError:  # pragma: no cover - depends on the environment
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_scale) = plt.subplots(1, 2, figsize=(11, 4))
    window = 10
    for run in runs:
        loss = run["loss"]
        if len(loss) >= window:  # A running mean: per-batch losses are noisy.
            smooth = np.convolve(loss, np.ones(window) / window, mode="valid")
            (line,) = ax_loss.plot(
                np.arange(window, len(loss) + 1), smooth, label=f"{run['name']} train"
            )
        else:
            (line,) = ax_loss.plot(
                np.arange(1, len(loss) + 1), loss, label=f"{run['name']} train"
            )
        steps, values = zip(*run["val"], strict=True)
        ax_loss.plot(
            steps, values, "o--", color=line.get_color(), label=f"{run['name']} val"
        )
    ax_loss.set(xlabel="step", ylabel="cross-entropy (nats/char)")
    ax_loss.set_title("char transformer: loss")
    ax_loss.legend()

    for marker, scaled in zip("xo", [r for r in runs if r["scaling"]], strict=False):
        steps = np.arange(1, len(scaled["scale"]) + 1)
        # The scale used on each step: the initial scale, then the state after it.
        used = np.concatenate([[2.0**16], scaled["scale"][:-1]])
        (line,) = ax_scale.step(steps, used, where="post", label=scaled["name"])
        skipped = ~scaled["finite"]
        ax_scale.plot(
            steps[skipped],
            used[skipped],
            marker,
            color=line.get_color(),
            fillstyle="none",
            label=f"{scaled['name']} skipped ({skipped.sum()})",
        )
    ax_scale.set_yscale("log", base=2)
    ax_scale.set(xlabel="step", ylabel="loss scale")
    ax_scale.set_title("loss scale")
    ax_scale.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps")
    parser.add_argument("--seed", type=int, default=0, help="random seed")
    parser.add_argument("--out", default="examples/out", help="folder for plots")
    parser.add_argument("--context", type=int, default=64, help="characters")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--micro-batch", type=int, default=8, help="sequences")
    parser.add_argument("--accumulate", type=int, default=4, help="micro-batches")
    parser.add_argument("--lr", type=float, default=1e-2, help="peak AdamW rate")
    parser.add_argument("--clip", type=float, default=1.0, help="max global norm")
    parser.add_argument(
        "--growth-interval",
        type=int,
        default=50,
        help="finite steps before the scale doubles (torch: 2000; short here so "
        "that a short run shows the scale moving)",
    )
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--eval-batches", type=int, default=8)
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}.")

    data, text, files = load_data()
    chars = range(data[2])
    print(
        f"jaxscale {jxs.__version__}: {len(text):,} characters of Python source "
        f"from {len(files)} standard-library files, vocabulary {len(chars)}; "
        f"{args.steps} steps of {args.accumulate} x {args.micro_batch} sequences "
        f"of {args.context} per run on {jax.default_backend()}"
    )

    runs = [
        train("fp32", jnp.float32, False, data, args),
        train("fp16+jaxscale", jnp.float16, True, data, args),
        train("fp16+autocast", jnp.float16, True, data, args, autocast=True),
    ]

    print(
        f"\n{'run':<14} {'val loss':>8} {'train loss':>10} {'skipped':>8} "
        f"{'final scale':>11} {'time':>6}"
    )
    for run in runs:
        train_loss = float(np.mean(run["loss"][-10:]))
        if run["scaling"]:
            s = jxs.diagnostics.summary(run["optimizer"])
            skipped = f"{int(s['skipped_steps'])}"
            scale = f"2**{np.log2(float(s['loss_scale'])):g}"
        else:
            skipped = scale = "-"
        print(
            f"{run['name']:<14} {run['val'][-1][1]:>8.4f} {train_loss:>10.4f} "
            f"{skipped:>8} {scale:>11} {run['seconds']:>5.1f}s"
        )
    gap = runs[1]["val"][-1][1] - runs[0]["val"][-1][1]
    print(f"fp16+jaxscale vs fp32 validation loss: {gap:+.4f} nats/char")
    auto, hand = runs[2]["val"][-1][1], runs[1]["val"][-1][1]
    print(
        f"fp16+autocast vs fp16+jaxscale validation loss: {auto - hand:+.4f} "
        f"nats/char ({100 * (auto / hand - 1):+.2f}%)"
    )

    # Underflow on one micro-batch, at the fp32 run's final parameters.
    x, y = make_batches(
        data[0], args.context, args.micro_batch, jax.random.key(args.seed + 1)
    )
    final_scale = float(runs[1]["scale"][-1])
    lost = gradient_underflow(runs[0]["model"], runs[1]["model"], x, y, final_scale)
    print(
        "fp16 gradients vs fp32 on one micro-batch (% of the elements that are "
        "non-zero in fp32):"
    )
    for label, s in (("unscaled", 1.0), ("scaled", final_scale)):
        flushed, subnormal = lost[label]
        print(
            f"  loss scale 2**{np.log2(s):<4g} {100 * flushed:6.2f}% flushed to "
            f"zero, {100 * subnormal:6.2f}% subnormal"
        )

    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "char_transformer.png")
    if plot(runs, path):
        print(f"plot saved to {os.path.abspath(path)}")
    else:
        print("no plot: matplotlib is not installed (pip install matplotlib)")


if __name__ == "__main__":
    main()
