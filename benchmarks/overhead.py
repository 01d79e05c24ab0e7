"""Cost of ``jxs.dynamic_scaling`` over a bare float16 optax step: time and mechanism.

Four variants of one training step run in the same process, in interleaved
rounds (the order rotates every round); each round's times are divided by the
bare step's of the same round, and the median and quartiles of those paired
ratios are reported:

* ``bare``: ``jax.value_and_grad`` of the float16 loss, ``optax.adam`` update,
  ``optax.apply_updates``;
* ``extraread``: ``bare`` plus one extra read of the gradients (a float32 sum
  over every gradient leaf, returned so it is not dead code): the reference
  cost of looking at the gradients once;
* ``scaled``: ``jxs.value_and_grad`` (scaled loss) and
  ``jxs.dynamic_scaling(optax.adam(...))`` (unscale, finite check, skip,
  adjust the scale);
* ``apply_if_finite``: optax's ``apply_if_finite(adam)`` with a static scale
  applied by hand, for comparison.

Beyond the clock, the compiled programs are measured: compile time (median of
fresh compiles) and, walking the compiled HLO from its entry along the path a
*finite* step executes (the taken branch of each ``lax.cond`` only), the number
of fusions and the bytes they access (output plus operands), as extra passes
over the gradients.

Models: the MLP (4×Dense(1024), batch 128, 4.2M params in 10 leaves), the
transformer (5 layers, d 384, 6 heads, MLP 1536, vocabulary 2048, batch 4×32
tokens, 10.5M params in 86 leaves), and a leaf-count sweep (about 4M params in
10, 100 or 1000 square matrices, each fed by an f16 matmul of a batch of 32).
Parameters are float32 master weights; the losses compute in float16 and reduce
in float32. Every step is jitted with ``donate_argnums`` on params and state.

Targets on XLA:CPU (issue "GPU first"): step ratio <= 1.05 (MLP, transformer)
and <= 1.15 (leaf sweep); compile ratio <= 1.3; extra bytes on the finite path
<= 1.5 gradient passes. The kernel-by-kernel account of the same steps (every
kernel the scaled step adds, with the bytes it reads and writes, on any backend
or for a GPU without one) is ``benchmarks/step_account.py``. XLA:CPU is where
the results are checked, not where the design is chosen (jaxscale's step has no
branch, for GPUs): docs/performance.md has a run and the discussion, and
``benchmarks/gpu.py`` measures a GPU.

Run::

    python benchmarks/overhead.py                  # everything, ~10 minutes
    python benchmarks/overhead.py --model mlp --rounds 15 --steps-per-round 10
    python benchmarks/overhead.py --model sweep

On a shared machine, single-threaded XLA pinned to one core is steadier::

    XLA_FLAGS="--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1" \
        taskset -c 1 python benchmarks/overhead.py --model mlp --rounds 41
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxscale as jxs
from jaxscale import _hlo

F16 = jnp.float16
LR = 1e-4
# A scale at which these models' float16 backward passes stay finite, so every
# timed step takes the common (applied) path; growth is off for the run.
INIT_SCALE = 2.0**10
TARGETS = {"mlp": 1.05, "transformer": 1.05}  # the leaf sweep: 1.15


# --------------------------------------------------------------------------- #
# Models: float32 parameters, float16 compute, float32 loss.
# --------------------------------------------------------------------------- #


class MLP(nn.Module):
    """Four 1024-wide ReLU layers and a 10-way head: 4,208,650 parameters."""

    width: int = 1024
    depth: int = 4
    classes: int = 10

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        for _ in range(self.depth):
            x = nn.relu(nn.Dense(self.width)(x))
        return nn.Dense(self.classes)(x)


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and a GELU MLP."""

    d_model: int
    heads: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32))
        h = nn.LayerNorm()(x)
        x = x + nn.MultiHeadDotProductAttention(num_heads=self.heads)(h, h, mask=mask)
        h = nn.LayerNorm()(x)
        h = nn.Dense(4 * self.d_model)(h)
        return x + nn.Dense(self.d_model)(nn.gelu(h))


class Transformer(nn.Module):
    """A small decoder-only language model: 5 layers, d 384, 6 heads, MLP 1536,
    vocabulary 2048, 32 tokens; 10.5M parameters in 86 leaves."""

    vocab: int = 2048
    seq_len: int = 32
    d_model: int = 384
    layers: int = 5
    heads: int = 6

    @nn.compact
    def __call__(self, tokens: jax.Array, dtype: Any = jnp.float32) -> jax.Array:
        x = nn.Embed(self.vocab, self.d_model)(tokens).astype(dtype)
        pos = self.param(
            "pos", nn.initializers.normal(0.02), (self.seq_len, self.d_model)
        )
        x = x + pos.astype(dtype)
        for _ in range(self.layers):
            x = Block(self.d_model, self.heads)(x)
        x = nn.LayerNorm()(x)
        return nn.Dense(self.vocab)(x)


def _to_f16(tree: Any) -> Any:
    return jax.tree.map(lambda p: p.astype(F16), tree)


def _cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    logits = logits.astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def make_problem(
    model: str, batch_size: int, seed: int = 0
) -> tuple[Callable[..., jax.Array], Any, Any]:
    """Returns ``(loss_fn, params, batch)`` for ``"mlp"`` or ``"transformer"``."""
    rng = np.random.default_rng(seed)
    key = jax.random.key(seed)
    if model == "mlp":
        net = MLP()
        b = batch_size
        x = jnp.asarray(rng.standard_normal((b, 1024)), jnp.float32)
        y = jnp.asarray(rng.integers(0, net.classes, b), jnp.int32)
        params = net.init(key, x)

        def loss_fn(params, batch):
            x, y = batch
            return _cross_entropy(net.apply(_to_f16(params), x.astype(F16)), y)

    elif model == "transformer":
        net = Transformer()
        b = batch_size
        tokens = rng.integers(0, net.vocab, (b, net.seq_len + 1))
        x = jnp.asarray(tokens[:, :-1], jnp.int32)
        y = jnp.asarray(tokens[:, 1:], jnp.int32)
        params = net.init(key, x)

        def loss_fn(params, batch):
            x, y = batch
            logits = net.apply(_to_f16(params), x, dtype=F16)
            return _cross_entropy(logits, y)

    elif model.startswith("sweep"):
        # About 4M parameters in n square matrices, each fed by an f16 matmul of
        # a batch of 32: a step dominated by the optimizer.
        n = int(model[len("sweep") :])
        d = int(round((4_000_000 / n) ** 0.5))
        keys = jax.random.split(key, n)
        params = {
            f"w{i:04d}": jax.random.normal(k, (d, d)) / d**0.5
            for i, k in enumerate(keys)
        }
        x = jnp.asarray(rng.standard_normal((n, batch_size, d)), jnp.float32)
        y = jnp.zeros((), jnp.int32)

        def loss_fn(params, batch):
            x, _ = batch
            total = jnp.zeros((), jnp.float32)
            for i, w in enumerate(params.values()):
                h = x[i].astype(F16) @ w.astype(F16)
                total = total + jnp.mean(jnp.square(h.astype(jnp.float32)))
            return total

    else:
        raise ValueError(
            f"`model` must be 'mlp', 'transformer' or 'sweepN', got {model!r}."
        )
    return loss_fn, params, (x, y)


# --------------------------------------------------------------------------- #
# The three step variants.
# --------------------------------------------------------------------------- #


def _grad_read(grads: Any) -> jax.Array:
    """One read of every gradient leaf: a float32 sum over all of them."""
    return sum(jnp.sum(g, dtype=jnp.float32) for g in jax.tree.leaves(grads))


def make_variants(
    loss_fn: Callable[..., jax.Array], params: Any
) -> dict[str, tuple[Callable[..., Any], Callable[[], Any]]]:
    """Returns ``{name: (jitted step, fresh (params, opt_state) factory)}``.

    Every step has the signature ``step(params, opt_state, batch) -> (params,
    opt_state, out)`` and donates its first two arguments.
    """
    host_params = jax.tree.map(np.asarray, params)
    adam = optax.adam(LR)
    scaled_tx = jxs.dynamic_scaling(
        optax.adam(LR),
        jxs.DynamicLossScale.create(init_scale=INIT_SCALE, growth_interval=10**9),
    )

    def bare(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = adam.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    def extraread(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = adam.update(grads, opt_state, params)
        out = (loss, _grad_read(grads))
        return optax.apply_updates(params, updates), opt_state, out

    def scaled(params, opt_state, batch):
        loss, grads = jxs.value_and_grad(loss_fn, opt_state)(params, batch)
        updates, opt_state = scaled_tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    def fresh(tx):
        def factory():
            p = jax.tree.map(jnp.array, host_params)
            return p, tx.init(p)

        return factory

    static = optax.apply_if_finite(optax.adam(LR), max_consecutive_errors=10**6)

    def apply_if_finite(params, opt_state, batch):
        # optax's own skip with a static scale: scale, differentiate, unscale.
        scaled_loss = lambda p, b: loss_fn(p, b) * INIT_SCALE  # noqa: E731
        loss, grads = jax.value_and_grad(scaled_loss)(params, batch)
        grads = jax.tree.map(lambda g: g / INIT_SCALE, grads)
        updates, opt_state = static.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    jit = lambda f: jax.jit(f, donate_argnums=(0, 1))  # noqa: E731
    return {
        "bare": (jit(bare), fresh(adam)),
        "extraread": (jit(extraread), fresh(adam)),
        "scaled": (jit(scaled), fresh(scaled_tx)),
        "apply_if_finite": (jit(apply_if_finite), fresh(static)),
    }


# --------------------------------------------------------------------------- #
# Interleaved timing.
# --------------------------------------------------------------------------- #


def time_interleaved(
    variants: dict[str, tuple[Callable[..., Any], Callable[[], Any]]],
    batch: Any,
    rounds: int,
    steps: int,
    warmup: int = 3,
) -> tuple[dict[str, list[float]], dict[str, Any]]:
    """Per-round mean step times (seconds) of every variant, interleaved.

    Each round runs ``steps`` steps of every variant back to back, in an order
    that rotates from round to round, so slow drifts of the machine (other
    processes on a shared CPU) hit every variant alike.

    Returns:
      ``(times, opt_states)``: the times by variant, and each variant's final
      optimizer state.
    """
    names = list(variants)
    carry = {}
    for name, (step, fresh) in variants.items():
        p, s = fresh()
        for _ in range(warmup):
            p, s, out = step(p, s, batch)
        jax.block_until_ready((p, s, out))
        carry[name] = (p, s)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            step, _ = variants[name]
            p, s = carry[name]
            t0 = time.perf_counter()
            for _ in range(steps):
                p, s, out = step(p, s, batch)
            jax.block_until_ready((p, s, out))
            times[name].append((time.perf_counter() - t0) / steps)
            carry[name] = (p, s)
    return times, {name: s for name, (_, s) in carry.items()}


def report(
    model: str,
    n_params: int,
    times: dict[str, list[float]],
    state: jxs.DynamicScalingState,
) -> bool:
    """Prints medians, ratios and the verdict; returns whether the target is met."""
    med = {n: statistics.median(t) for n, t in times.items()}
    bare = med["bare"]
    print(f"\n== {model}: {n_params:,} params ==")
    for name, m in med.items():
        t = times[name]
        print(
            f"  {name:<10} median {m * 1e3:8.3f} ms   "
            f"(min {min(t) * 1e3:.3f}, max {max(t) * 1e3:.3f}, {len(t)} rounds)"
        )
    r_scaled = med["scaled"] / bare
    r_read = med["extraread"] / bare
    target = TARGETS.get(model, 1.15)
    bound = 1.0 + 1.5 * max(r_read - 1.0, 0.0)
    print(f"  scaled/bare    = {r_scaled:.4f}  (overhead {100 * (r_scaled - 1):+.2f}%)")
    print(f"  extraread/bare = {r_read:.4f}  (overhead {100 * (r_read - 1):+.2f}%)")
    # Paired per round: the variants of one round ran back to back, so their
    # ratio cancels most of the machine's drift; its median is the robust figure.
    for name in ("scaled", "extraread"):
        paired = [a / b for a, b in zip(times[name], times["bare"], strict=True)]
        q = statistics.quantiles(paired, n=4) if len(paired) > 1 else paired * 3
        print(
            f"  {name}/bare per round: median {statistics.median(paired):.4f} "
            f"[quartiles {q[0]:.4f}, {q[2]:.4f}]"
        )
    print(
        f"  scaled steps skipped: {int(state.skipped_steps)} of {int(state.steps)}"
        f" (final scale {float(state.loss_scale.loss_scale):g})"
    )
    ok_abs = r_scaled <= target
    ok_rel = r_scaled <= bound
    print(
        f"  target overhead <= {100 * (target - 1):.1f}%: "
        f"{'MET' if ok_abs else 'NOT MET'}; within 1.5x of the extra read "
        f"(<= {100 * (bound - 1):.2f}%): {'MET' if ok_rel else 'NOT MET'}"
    )
    return ok_abs


# --------------------------------------------------------------------------- #
# The mechanism: fusions and bytes on the executed path of a finite step.
# --------------------------------------------------------------------------- #

_MOVES = ("fusion", "copy", "transpose")


def executed_path(hlo: str) -> tuple[int, int]:
    """``(fusions, bytes)`` on the path a *finite* step executes.

    The kernels ``jaxscale._hlo.kernels`` finds on that path (from the entry
    computation, following ``call`` targets and only the finite branch of
    every ``conditional``: the exact check's fallback and the skip branch are
    not run) that are fusions, or copies and transposes outside fusions
    (copy insertion's copies of donated buffers, layout changes: they move
    memory too). Bytes are XLA's convention for a fusion: its output plus its
    operands, from the shapes in the HLO text.
    """
    moves = [k for k in _hlo.kernels(hlo) if k.opcode in _MOVES]
    return sum(k.opcode == "fusion" for k in moves), sum(k.bytes for k in moves)


def mechanism(
    variants: dict[str, tuple[Callable[..., Any], Callable[[], Any]]],
    batch: Any,
    repeats: int = 3,
) -> dict[str, dict[str, float]]:
    """Compile time (median of fresh compiles), fusions and bytes per variant."""
    out = {}
    for name, (step, fresh) in variants.items():
        p, s = fresh()
        lowered = step.lower(p, s, batch)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            compiled = lowered.compile()
            times.append(time.perf_counter() - t0)
        fusions, nbytes = executed_path(compiled.as_text())
        out[name] = {
            "compile": statistics.median(times),
            "fusions": fusions,
            "bytes": nbytes,
        }
    return out


def table_row(
    model: str,
    params: Any,
    times: dict[str, list[float]],
    mech: dict[str, dict[str, float]],
) -> str:
    """One Markdown row: step, compile, fusions and bytes against the bare step."""
    grad_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))

    def paired(name: str) -> str:
        r = [a / b for a, b in zip(times[name], times["bare"], strict=True)]
        q = statistics.quantiles(r, n=4) if len(r) > 1 else r * 3
        return f"{statistics.median(r):.3f} [{q[0]:.3f}, {q[2]:.3f}]"

    bare, ours = mech["bare"], mech["scaled"]
    passes = (ours["bytes"] - bare["bytes"]) / grad_bytes
    read_passes = (mech["extraread"]["bytes"] - bare["bytes"]) / grad_bytes
    return (
        f"| {model} | {len(jax.tree.leaves(params))} | {paired('scaled')} | "
        f"{paired('extraread')} | {paired('apply_if_finite')} | "
        f"{ours['compile'] / bare['compile']:.2f} | "
        f"{bare['fusions']} -> {ours['fusions']} | {passes:+.2f} ({read_passes:+.2f}) |"
    )


TABLE_HEADER = (
    "| model | leaves | jaxscale/bare step [q25, q75] | extra read/bare | "
    "apply_if_finite/bare | compile ratio | fusions on the finite path, "
    "bare -> jaxscale | extra bytes in gradient passes (extra read) |\n"
    "|---|---|---|---|---|---|---|---|"
)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=9, help="timed rounds")
    parser.add_argument(
        "--steps-per-round", type=int, default=3, help="steps per variant per round"
    )
    parser.add_argument(
        "--model",
        choices=["mlp", "transformer", "sweep", "all"],
        default="all",
        help="sweep: ~4M params in 10, 100 and 1000 square matrices",
    )
    parser.add_argument("--mlp-batch", type=int, default=128, help="MLP batch size")
    parser.add_argument(
        "--transformer-batch",
        type=int,
        default=4,
        help="transformer batch size (sequences of 32 tokens)",
    )
    args = parser.parse_args(argv)
    for name in ("rounds", "steps_per_round", "mlp_batch", "transformer_batch"):
        if getattr(args, name) < 1:
            parser.error(f"`--{name.replace('_', '-')}` must be >= 1.")

    device = jax.devices()[0]
    print(
        f"jax {jax.__version__}, optax {optax.__version__}, jaxscale {jxs.__version__}"
    )
    print(f"device: {device.device_kind} ({device}), backend {jax.default_backend()}")
    print(f"{args.rounds} rounds x {args.steps_per_round} steps per variant")
    models = {
        "mlp": ["mlp"],
        "transformer": ["transformer"],
        "sweep": ["sweep10", "sweep100", "sweep1000"],
        "all": ["mlp", "transformer", "sweep10", "sweep100", "sweep1000"],
    }[args.model]
    rows = []
    for model in models:
        batch_size = {"mlp": args.mlp_batch, "transformer": args.transformer_batch}.get(
            model, 32
        )
        loss_fn, params, batch = make_problem(model, batch_size)
        n_params = sum(x.size for x in jax.tree.leaves(params))
        variants = make_variants(loss_fn, params)
        mech = mechanism(variants, batch, repeats=1 if model == "sweep1000" else 3)
        times, states = time_interleaved(
            variants, batch, args.rounds, args.steps_per_round
        )
        print(f"\nbatch size {batch_size}")
        report(model, n_params, times, states["scaled"])
        rows.append(table_row(model, params, times, mech))
    print("\n" + TABLE_HEADER)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
