"""Cost of ``jxs.autocast`` against the same train step with the casts written by hand.

For three models the same float16 train step is built twice and run in one
process:

* ``hand``: the model computes in float16 because the loss function casts by
  hand (parameters and inputs to float16 at the top, float32 where torch's
  autocast would use it: the loss, and in the transformer the layer norms, the
  softmax, the GELU and the residual stream);
* ``autocast``: the model written in plain float32 (no cast anywhere), its loss
  wrapped in ``jxs.autocast``.

Each step is a full jitted train step: ``jxs.value_and_grad`` (scaled loss),
``jxs.dynamic_scaling(optax.adam)`` and ``optax.apply_updates``, with
``donate_argnums`` on params and optimizer state. The transformer has a third
variant, ``hand_f16`` (Flax ``dtype=float16`` style: a float16 residual stream
and float16 layer-norm outputs), to show what the choice of residual dtype
costs; it is not the reference. Every model also has ``hand_again``, the
``hand`` step compiled a second time: the noise floor of the clock. (``--quick``
leaves both out.)

Models: the MLP of the README's quickstart, made big enough to measure
(4×Dense(1024) with ReLU, a 10-way head, batch 128, Flax linen); a CNN like
``examples/digits_cnn.py`` (three 3×3 convolutions of 32, 64, 64 channels on
32×32×3 images, two dense layers, batch 64, Flax linen); a decoder-only
transformer in plain JAX with its layers stacked and run by ``lax.scan`` (4
layers, d 256, 4 heads, MLP 1024, vocabulary 512, batch 8 × 64 tokens).

Reported per model, for each variant against ``hand``:

* step time: interleaved rounds (the order rotates every round), the median and
  quartiles of the per-round paired ratios (target ``autocast/hand <= 1.02``);
* compile time: trace + lower (where autocast's interpreter runs) and XLA
  compile, medians of fresh compiles, and their sum (target ratio ``<= 1.3``);
* ``convert`` ops: in the StableHLO before optimisation and in the compiled
  (optimised) HLO, fused computations included, by result dtype;
* memory: ``compiled.memory_analysis()``, temporary bytes of the whole step;
* the compiled programs side by side: their instructions as a multiset of
  (opcode, result type), fused computations included, names and layouts
  dropped; how many are only in one of them, and the largest such tensor.

Run::

    python benchmarks/autocast.py                  # ~5 minutes on a 2-core CPU
    python benchmarks/autocast.py --model transformer --rounds 21
    python benchmarks/autocast.py --quick          # tiny sizes, a few seconds

On a shared machine, single-threaded XLA pinned to one core is steadier::

    XLA_FLAGS="--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1" \\
        taskset -c 1 python benchmarks/autocast.py
"""

from __future__ import annotations

import argparse
import collections
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

F16, F32 = jnp.float16, jnp.float32
LR = 1e-4
# A scale at which these models' float16 backward passes stay finite, so every
# timed step takes the same (applied) path; growth is off for the run.
INIT_SCALE = 2.0**10
STEP_TARGET, COMPILE_TARGET = 1.02, 1.3

# Sizes: full, and --quick (tiny, for the test suite).
SIZES = {
    "mlp": {"full": dict(width=1024, depth=4, batch=128),
            "quick": dict(width=64, depth=2, batch=8)},
    "cnn": {"full": dict(channels=(32, 64, 64), hidden=256, image=32, batch=64),
            "quick": dict(channels=(4, 8, 8), hidden=16, image=12, batch=4)},
    "transformer": {
        "full": dict(vocab=512, seq=64, d=256, layers=4, heads=4, batch=8),
        "quick": dict(vocab=32, seq=8, d=16, layers=2, heads=2, batch=2)},
}  # fmt: skip


def _cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def _to(tree: Any, dtype: Any) -> Any:
    return jax.tree.map(lambda p: p.astype(dtype), tree)


# --------------------------------------------------------------------------- #
# Models. Each returns {variant: loss_fn}, params and a batch.
# --------------------------------------------------------------------------- #


class MLP(nn.Module):
    """The quickstart MLP, wider: ``depth`` ReLU layers of ``width``, 10 classes."""

    width: int
    depth: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        for _ in range(self.depth):
            x = nn.relu(nn.Dense(self.width)(x))
        return nn.Dense(10)(x)


class CNN(nn.Module):
    """3×3 convolutions (the last two with stride 2), then two dense layers."""

    channels: tuple[int, ...]
    hidden: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        for i, c in enumerate(self.channels):
            x = nn.relu(nn.Conv(c, (3, 3), strides=1 if i == 0 else 2)(x))
        x = x.reshape(x.shape[0], -1)
        x = nn.relu(nn.Dense(self.hidden)(x))
        return nn.Dense(10)(x)


def _linen_problem(net: nn.Module, x: np.ndarray, seed: int):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(x, F32)
    y = jnp.asarray(rng.integers(0, 10, x.shape[0]), jnp.int32)
    params = net.init(jax.random.key(seed), x)

    def hand(params, batch):
        x, y = batch
        logits = net.apply(_to(params, F16), x.astype(F16))
        return _cross_entropy(logits.astype(F32), y)

    def plain(params, batch):  # float32, no cast: autocast decides
        x, y = batch
        return _cross_entropy(net.apply(params, x), y)

    return {"hand": hand, "autocast": jxs.autocast(plain)}, params, (x, y)


def _layer_norm(x, g, b, stream):
    """Statistics and output in float32, output cast to ``stream``."""
    x = x.astype(F32)
    mean = x.mean(-1, keepdims=True)
    var = jnp.square(x - mean).mean(-1, keepdims=True)
    return ((x - mean) * jax.lax.rsqrt(var + 1e-5) * g + b).astype(stream)


def _dense(x, w, b, cdt):
    return x.astype(cdt) @ w.astype(cdt) + b.astype(cdt)


def transformer_loss(params, batch, cdt=F32, stream=F32, heads=4):
    """A pre-norm decoder, layers under ``lax.scan``; the loss in float32.

    ``cdt`` is the dtype of the matmuls (with their biases), ``stream`` the
    residual stream's. With both float32 every cast is a no-op: the plain float32
    model that autocast is given.
    """
    tokens, labels = batch
    x = params["embed"][tokens].astype(stream) + params["pos"].astype(stream)
    b, t, d = x.shape
    causal = jnp.tril(jnp.ones((t, t), jnp.bool_))

    def block(x, p):
        h = _layer_norm(x, p["ln1_g"], p["ln1_b"], stream)
        qkv = _dense(h, p["qkv_w"], p["qkv_b"], cdt).reshape(b, t, 3, heads, -1)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d // heads)
        s = jnp.where(causal, s.astype(F32), -jnp.inf)
        att = jax.nn.softmax(s, axis=-1).astype(cdt)
        y = jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, t, d)
        x = x + _dense(y, p["proj_w"], p["proj_b"], cdt).astype(stream)
        h = _layer_norm(x, p["ln2_g"], p["ln2_b"], stream)
        h = jax.nn.gelu(_dense(h, p["fc_w"], p["fc_b"], cdt).astype(F32))
        return x + _dense(h, p["out_w"], p["out_b"], cdt).astype(stream), None

    x, _ = jax.lax.scan(block, x, params["layers"])
    x = _layer_norm(x, params["ln_g"], params["ln_b"], stream)
    logits = _dense(x, params["head_w"], params["head_b"], cdt)
    return _cross_entropy(logits.astype(F32), labels)


def _transformer_problem(vocab, seq, d, layers, heads, batch, seed, hand_f16):
    rng = np.random.default_rng(seed)

    def normal(*shape, std=0.02):
        return jnp.asarray(std * rng.standard_normal(shape), F32)

    def zeros(*shape):
        return jnp.zeros(shape, F32)

    n, f = layers, 4 * d
    params = {
        "embed": normal(vocab, d),
        "pos": normal(seq, d),
        "layers": {
            "ln1_g": jnp.ones((n, d)), "ln1_b": zeros(n, d),
            "qkv_w": normal(n, d, 3 * d), "qkv_b": zeros(n, 3 * d),
            "proj_w": normal(n, d, d), "proj_b": zeros(n, d),
            "ln2_g": jnp.ones((n, d)), "ln2_b": zeros(n, d),
            "fc_w": normal(n, d, f), "fc_b": zeros(n, f),
            "out_w": normal(n, f, d), "out_b": zeros(n, d),
        },
        "ln_g": jnp.ones(d), "ln_b": zeros(d),
        "head_w": normal(d, vocab), "head_b": zeros(vocab),
    }  # fmt: skip
    tokens = rng.integers(0, vocab, (batch, seq + 1))
    data = (jnp.asarray(tokens[:, :-1], jnp.int32), jnp.asarray(tokens[:, 1:]))

    def loss(cdt, stream):
        return lambda p, b: transformer_loss(p, b, cdt, stream, heads)

    variants = {"hand": loss(F16, F32), "autocast": jxs.autocast(loss(F32, F32))}
    if hand_f16:
        variants["hand_f16"] = loss(F16, F16)
    return variants, params, data


def make_problem(model: str, quick: bool, seed: int = 0):
    """``({variant: loss_fn}, params, batch)`` for one model.

    Beyond ``--quick``, ``hand_again`` is the hand-cast step compiled a second
    time: its ratio to ``hand`` is the noise floor of the clock (same program,
    other buffers, other moments).
    """
    size = SIZES[model]["quick" if quick else "full"]
    rng = np.random.default_rng(seed)
    if model == "mlp":
        net = MLP(size["width"], size["depth"])
        x = rng.standard_normal((size["batch"], size["width"]))
        variants, params, batch = _linen_problem(net, x, seed)
    elif model == "cnn":
        net = CNN(size["channels"], size["hidden"])
        s = size["image"]
        x = rng.random((size["batch"], s, s, 3))
        variants, params, batch = _linen_problem(net, x, seed)
    else:
        variants, params, batch = _transformer_problem(
            **size, seed=seed, hand_f16=not quick
        )
    if not quick:
        variants["hand_again"] = variants["hand"]
    return variants, params, batch


# --------------------------------------------------------------------------- #
# Steps, timing, compiled programs.
# --------------------------------------------------------------------------- #


def make_step(loss_fn: Callable[..., jax.Array]) -> tuple[Callable, Any]:
    """A fresh jitted train step (new function object: no cached trace) and tx."""
    tx = jxs.dynamic_scaling(
        optax.adam(LR),
        jxs.DynamicLossScale.create(init_scale=INIT_SCALE, growth_interval=10**9),
    )

    def step(params, opt_state, batch):
        loss, grads = jxs.value_and_grad(loss_fn, opt_state)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return jax.jit(step, donate_argnums=(0, 1)), tx


def time_interleaved(compiled, params, batch, rounds, steps, warmup=2):
    """Per-round mean step times (seconds) of every compiled step, interleaved.

    Each round runs ``steps`` steps of every variant back to back, in an order
    that rotates from round to round, so slow drifts of the machine (other
    processes on a shared CPU) hit every variant alike.
    """
    host = jax.tree.map(np.asarray, params)
    names, carry = list(compiled), {}
    for name, (step, tx) in compiled.items():
        p = jax.tree.map(jnp.array, host)
        s = tx.init(p)
        for _ in range(warmup):
            p, s, out = step(p, s, batch)
        jax.block_until_ready((p, s, out))
        carry[name] = (p, s)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            step = compiled[name][0]
            p, s = carry[name]
            t0 = time.perf_counter()
            for _ in range(steps):
                p, s, out = step(p, s, batch)
            jax.block_until_ready((p, s, out))
            times[name].append((time.perf_counter() - t0) / steps)
            carry[name] = (p, s)
    skipped = {n: int(s.skipped_steps) for n, (_, s) in carry.items()}
    return times, skipped


def compiled_converts(hlo: str) -> dict[str, int]:
    """``convert`` ops of a compiled program (fused computations included), by
    result element type."""
    return dict(
        collections.Counter(
            _hlo.shapes(i.type)[0][0]
            for i in _hlo.instructions(hlo)
            if i.opcode == "convert" and not i.type.startswith("(")
        )
    )


def instructions(hlo: str) -> collections.Counter:
    """The compiled HLO's instructions (fused computations included) as a
    multiset of ``(opcode, result type)``, layouts and names dropped."""
    return collections.Counter(
        (i.opcode, _hlo.strip_layouts(i.type)) for i in _hlo.instructions(hlo)
    )


def _elements(result_type: str) -> int:
    if result_type.startswith("("):  # a tuple (a loop's state): not one tensor
        return 0
    return max((int(np.prod(d)) for _, d in _hlo.shapes(result_type)), default=0)


def hlo_difference(hand: collections.Counter, other: collections.Counter) -> str:
    """How two compiled programs differ: instructions only in one of them, and
    the largest tensor among those."""
    only_h, only_o = hand - other, other - hand
    if not only_h and not only_o:
        return "identical up to names"
    largest = max(
        (k for k in (only_h + only_o)), key=lambda k: _elements(k[1]), default=None
    )
    return (
        f"{sum(only_h.values())} only in hand, {sum(only_o.values())} only here, "
        f"largest {largest[0]} {largest[1]}"
    )


def programs(variants, params, batch, repeats):
    """Trace+lower and compile times (medians), converts and temp memory.

    Returns ``(numbers, steps)``: the numbers by variant, and each variant's last
    compiled step with its optimizer (for the timing, which reuses them).
    """
    out, steps = {}, {}
    for name, loss_fn in variants.items():
        lower_t, compile_t = [], []
        for _ in range(repeats):
            step, tx = make_step(loss_fn)  # fresh: the trace is not cached
            state = tx.init(params)
            t0 = time.perf_counter()
            lowered = step.lower(params, state, batch)
            t1 = time.perf_counter()
            compiled = lowered.compile()
            t2 = time.perf_counter()
            lower_t.append(t1 - t0)
            compile_t.append(t2 - t1)
        mem = compiled.memory_analysis()
        out[name] = {
            "lower": statistics.median(lower_t),
            "compile": statistics.median(compile_t),
            "converts_pre": dict(_hlo.stablehlo_converts(lowered.as_text())),
            "converts_opt": compiled_converts(compiled.as_text()),
            "temp": getattr(mem, "temp_size_in_bytes", 0) if mem else 0,
            "instructions": instructions(compiled.as_text()),
        }
        steps[name] = (compiled, tx)
    return out, steps


def _paired(times, name, ref="hand") -> tuple[float, float, float]:
    r = [a / b for a, b in zip(times[name], times[ref], strict=True)]
    q = statistics.quantiles(r, n=4) if len(r) > 1 else r * 3
    return statistics.median(r), q[0], q[2]


def _fmt_converts(c: dict[str, int]) -> str:
    return (
        f"{sum(c.values())} ("
        + ", ".join(f"{k} {v}" for k, v in sorted(c.items()))
        + ")"
    )


def report(model, n_params, times, skipped, prog) -> tuple[str, bool]:
    """Prints one model's numbers; returns its Markdown row and the verdict."""
    print(f"\n== {model}: {n_params:,} params ==")
    for name, t in times.items():
        p = prog[name]
        print(
            f"  {name:<9} step median {statistics.median(t) * 1e3:8.3f} ms "
            f"(min {min(t) * 1e3:.3f}, max {max(t) * 1e3:.3f}, {len(t)} rounds, "
            f"{skipped[name]} skipped); trace+lower {p['lower']:.3f} s, "
            f"compile {p['compile']:.3f} s; temp {p['temp'] / 2**20:.2f} MiB"
        )
        pad = " " * 12
        print(f"{pad}converts before optimisation {_fmt_converts(p['converts_pre'])}")
        print(f"{pad}converts compiled            {_fmt_converts(p['converts_opt'])}")
    hand = prog["hand"]
    rows, ok = [], True
    for name in [n for n in times if n != "hand"]:
        med, q1, q3 = _paired(times, name)
        p = prog[name]
        total = (p["lower"] + p["compile"]) / (hand["lower"] + hand["compile"])
        xla = p["compile"] / hand["compile"]
        print(
            f"  {name}/hand: step {med:.4f} [quartiles {q1:.4f}, {q3:.4f}], "
            f"compile (trace+lower+XLA) {total:.3f}, XLA compile alone {xla:.3f}, "
            f"temp memory {p['temp'] / max(hand['temp'], 1):.3f}"
        )
        diff = hlo_difference(hand["instructions"], p["instructions"])
        print(f"  compiled HLO vs hand: {diff}")
        if name == "autocast":
            ok_step, ok_compile = med <= STEP_TARGET, total <= COMPILE_TARGET
            ok = ok_step and ok_compile
            print(
                f"  targets: step <= {STEP_TARGET}: {'MET' if ok_step else 'NOT MET'};"
                f" compile <= {COMPILE_TARGET}: {'MET' if ok_compile else 'NOT MET'}"
            )
        pre = sum(p["converts_pre"].values()), sum(hand["converts_pre"].values())
        opt = sum(p["converts_opt"].values()), sum(hand["converts_opt"].values())
        rows.append(
            f"| {model} | {name} | {med:.3f} [{q1:.3f}, {q3:.3f}] | {total:.2f} "
            f"({xla:.2f}) | {pre[1]} → {pre[0]} | {opt[1]} → {opt[0]} | "
            f"{hand['temp'] / 2**20:.2f} → {p['temp'] / 2**20:.2f} MiB | {diff} |"
        )
    return "\n".join(rows), ok


TABLE_HEADER = (
    "| model | variant | step / hand [q25, q75] | compile / hand (XLA alone) | "
    "converts before optimisation, hand → variant | converts compiled | "
    "temp memory, hand → variant | compiled instructions that differ |\n"
    "|---|---|---|---|---|---|---|---|"
)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=[*SIZES, "all"], default="all")
    parser.add_argument("--rounds", type=int, default=15, help="timed rounds")
    parser.add_argument(
        "--steps-per-round", type=int, default=5, help="steps per variant per round"
    )
    parser.add_argument(
        "--compile-repeats", type=int, default=3, help="fresh compiles per variant"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="tiny models, 3 rounds of 2 steps, one compile (a smoke test)",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.steps_per_round, args.compile_repeats = 3, 2, 1
    for name in ("rounds", "steps_per_round", "compile_repeats"):
        if getattr(args, name) < 1:
            parser.error(f"`--{name.replace('_', '-')}` must be >= 1.")

    device = jax.devices()[0]
    print(
        f"jax {jax.__version__}, flax {__import__('flax').__version__}, optax "
        f"{optax.__version__}, jaxscale {jxs.__version__}; device "
        f"{device.device_kind}, backend {jax.default_backend()}"
    )
    print(
        f"{'quick sizes, ' if args.quick else ''}{args.rounds} rounds x "
        f"{args.steps_per_round} steps per variant, {args.compile_repeats} compiles"
    )
    rows, verdicts = [], {}
    for model in list(SIZES) if args.model == "all" else [args.model]:
        variants, params, batch = make_problem(model, args.quick)
        n_params = sum(x.size for x in jax.tree.leaves(params))
        prog, compiled = programs(variants, params, batch, args.compile_repeats)
        times, skipped = time_interleaved(
            compiled, params, batch, args.rounds, args.steps_per_round
        )
        row, verdicts[model] = report(model, n_params, times, skipped, prog)
        rows.append(row)
    print("\n" + TABLE_HEADER)
    print("\n".join(rows))
    print(
        "\nautocast targets "
        + ", ".join(f"{m}: {'MET' if v else 'NOT MET'}" for m, v in verdicts.items())
    )


if __name__ == "__main__":
    main()
