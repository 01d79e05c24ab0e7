"""Float8 matmuls on one GPU: ``jxs.autocast(..., float8=...)`` against bfloat16.

Two measurements, each variant timed side by side in one process in interleaved
rounds (the order rotating every round), ratios paired per round against the
bfloat16 autocast step:

* ``sweep``: one matmul site, ``loss = sum((x @ w) * r)`` with gradients for
  ``w`` and ``x`` (the forward product and both backward products), at
  ``M = 8192`` tokens and ``K = N = d`` for several ``d``: bfloat16 autocast,
  float8 current scaling, float8 delayed scaling (the state threaded through the
  step), float8 rowwise. The cost model that chooses the float8 products is fitted to it
  (``jaxscale/float8/_choice.py``): below some size the
  quantisation passes (an amax reduction and a cast per operand) cost more than
  the faster GEMM saves.
* ``models``: whole train steps (loss, gradients, AdamW) of the decoder of
  ``benchmarks/gpu.py`` (Flax linen, float32 parameters, attention written out)
  under ``jxs.autocast(..., jnp.bfloat16)``, without and with float8 (every
  dense layer and the tied output head; the attention's batched products stay
  bfloat16), and with the cost model's choice (``float8 chosen``, the default
  ``float8=True``): GPT-2-small (``realistic``), ``mid`` (d 2048, MLP 8192, 4
  layers) and ``wide`` (d 4096, MLP 16384, 4 layers).

At the end it prints issue 32's targets, each with the measured value and
whether it is met (``targets:`` lines): the wide model at most 0.80 of the
bfloat16 step, one site 0.75 at d 4096 and 0.65 at 8192, GPT-2-small with the
default choice at most 1.00, the d 2048 model faster than bfloat16, and every
float8 step's compile time at most 1.5 times bfloat16's.

For every compiled program it prints :func:`jaxscale.float8.gemm_report`: the
float8 dots of the lowered program, how many are in the form XLA:GPU's GEMM
rewriter takes, and (on a GPU) how many cuBLASLt float8 GEMMs were compiled.

Run it from the repository root on a machine with one NVIDIA GPU (Hopper or
later for float8 GEMMs) and paste back all of stdout::

    python benchmarks/float8.py          # everything (about 8 minutes on an H200)
    python benchmarks/float8.py --parts models --models realistic \
        --variants bfloat16 "float8 chosen" "float8 current"   # a quick look

``--tiny`` runs small sizes on whatever JAX finds (the test suite runs it on the
CPU, where float8 products are computed in float32: the timings there say
nothing about a GPU).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import optax

HERE = Path(__file__).resolve().parent
for path in (HERE.parent, HERE):  # jaxscale from this checkout; gpu.py beside
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import gpu  # noqa: E402 (after the path)

import jaxscale as jxs  # noqa: E402
import jaxscale.internal as jxi  # noqa: E402

BF16 = jnp.bfloat16
VARIANTS = ("bfloat16", "float8 chosen", "float8 current", "float8 rowwise")
ALL_VARIANTS = (*VARIANTS, "float8 delayed")  # delayed: deprecated, on request
HISTORY = 16  # amax history of the delayed recipe in these runs

SWEEP = {
    "full": (8192, [256, 512, 768, 1024, 2048, 4096, 8192]),
    "tiny": (64, [32, 64]),
}
MODELS = {
    "full": {
        "realistic": gpu.Size(12, 768, 12, 3072, 50304, 1024, 8),
        "mid": gpu.Size(4, 2048, 16, 8192, 32768, 1024, 8),
        "wide": gpu.Size(4, 4096, 32, 16384, 32768, 1024, 4),
    },
    "tiny": {"realistic": gpu.Size(1, 64, 4, 256, 512, 64, 2)},
}
ROUNDS = {
    "full": {"sweep": (7, 20), "models": (5, 5)},
    "tiny": {"sweep": (2, 2), "models": (2, 2)},
}


def delayed(history_len: int) -> Any:
    """Delayed scaling, deprecated: measured here as the evidence for that."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return jxs.float8.DelayedScaling(history_len, min_dim=0)


def recipes() -> dict[str, Any]:
    """The variants chosen (``--variants``), each with its recipe."""
    every = {
        "bfloat16": None,
        "float8 chosen": jxs.float8.CurrentScaling(),  # the cost model's choice
        "float8 current": jxs.float8.CurrentScaling(min_dim=0),
        "float8 rowwise": jxs.float8.RowwiseScaling(min_dim=0),
        "float8 delayed": None,
    }
    if "float8 delayed" in VARIANTS:
        every["float8 delayed"] = delayed(HISTORY)
    return {k: v for k, v in every.items() if k in VARIANTS}


# (part, model or d, variant) -> (ratio to bf16, compile s, bf16 compile s)
RESULTS: dict[tuple[str, str, str], tuple[float, float, float]] = {}


def grad_step(
    loss_fn: Callable[..., Any], recipe: Any, args: tuple, tx: Any = None
) -> tuple[Callable[..., Any], tuple]:
    """A jitted step ``carry -> (carry, loss)`` and its first carry.

    Without ``tx``: gradients of every argument (the sweep). With ``tx``: a
    train step of the first argument (params), the rest being the batch.
    """
    f = jxs.autocast(loss_fn, BF16, float8=recipe)
    delayed = isinstance(recipe, jxs.float8.DelayedScaling)
    state = jxs.float8.init(f, *args) if delayed else None
    if tx is None:
        argnums = tuple(range(len(args)))

        def step(carry):
            args, st = carry
            if delayed:
                loss, grads, st = jxs.float8.value_and_grad(
                    lambda a, *r: f(*a, *r), st
                )(args)
            else:
                loss, grads = jax.value_and_grad(f, argnums)(*args)
            # Feed the gradients back (scaled down) so no step is dead code.
            args = tuple(
                a - 1e-6 * g.astype(a.dtype) for a, g in zip(args, grads, strict=True)
            )
            return (args, st), loss

        return jax.jit(step, donate_argnums=0), (args, state)

    params, batch = args[0], args[1:]

    def train(carry):
        params, opt_state, st = carry
        if delayed:
            loss, grads, st = jxs.float8.value_and_grad(f, st)(params, *batch)
        else:
            loss, grads = jax.value_and_grad(f)(params, *batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state, st), loss

    return jax.jit(train, donate_argnums=0), (params, tx.init(params), state)


def time_variants(steps: dict, carry: dict, rounds: int, n: int) -> dict[str, list]:
    # gpu.time_rounds calls step(state, batch) -> (state, out).
    wrapped = {k: (lambda c, _b, s=s: s(c)) for k, s in steps.items()}
    return gpu.time_rounds(wrapped, carry, None, rounds, n, jax.block_until_ready)


def compile_all(
    steps: dict, carry: dict, label: str
) -> tuple[dict, dict[str, float], dict[str, Any]]:
    """Compiled steps, compile seconds and gemm reports per variant."""
    compiled, secs, reports = {}, {}, {}
    for name, step in steps.items():
        t0 = time.perf_counter()
        lowered = step.lower(carry[name])
        compiled[name] = lowered.compile()
        secs[name] = time.perf_counter() - t0
        hlo = compiled[name].as_text() if jax.default_backend() == "gpu" else None
        reports[name] = jxi.gemm_summary(lowered.as_text(), hlo, jax.default_backend())
        check = f"; {reports[name]}" if name != "bfloat16" else ""  # no float8
        gpu.log(f"{label}: {name}: compiled in {secs[name]:.1f}s{check}")
    return compiled, secs, reports


def _cells(times: dict, reports: dict, name: str) -> tuple[float, str, str]:
    """A variant's median step (s), its paired ratio to bfloat16 with quartiles,
    and its float8 dots / rewritable / GEMMs."""
    r = gpu.paired(times, name, "bfloat16")
    rep = reports[name]
    return (
        statistics.median(times[name]),
        f"{r[0]:.3f} [{r[1]:.3f}, {r[2]:.3f}]",
        f"{rep.float8_dots} / {rep.rewritable} / {rep.float8_gemms}",
    )


def run_sweep(mode: str) -> list[str]:
    m, dims = SWEEP[mode]
    rounds, n = ROUNDS[mode]["sweep"]
    lines = [
        f"| d (M = {m}, K = N = d) | variant | ms (median) | TFLOP/s | ratio vs "
        "bf16 [q25, q75] | float8 dots / rewritable / GEMMs |",
        "|---|---|---|---|---|---|",
    ]

    def loss(w, x, r):
        return jnp.sum((x @ w) * r)

    for d in dims:
        k = jax.random.split(jax.random.key(d), 3)
        w = jax.random.normal(k[0], (d, d), jnp.float32) * d**-0.5
        x = jax.random.normal(k[1], (m, d), jnp.float32)
        r = jax.random.normal(k[2], (m, d), jnp.float32) / m
        steps, carry = {}, {}
        for name, recipe in recipes().items():
            fresh = jax.tree.map(jnp.copy, (w, x, r))  # each variant donates its own
            steps[name], carry[name] = grad_step(loss, recipe, fresh)
        with warnings.catch_warnings():  # a size the cost model declines
            warnings.simplefilter("ignore", jxs.AutocastWarning)
            compiled, _, reports = compile_all(steps, carry, f"sweep d={d}")
        fns = {k: (lambda c, s=c_: s(c)) for k, c_ in compiled.items()}
        for name in fns:  # warm-up
            carry[name], out = fns[name](carry[name])
        jax.block_until_ready(carry)
        times = time_variants(fns, carry, rounds, n)
        flops = 3 * 2 * m * d * d
        for name in VARIANTS:
            med, ratio, gemms = _cells(times, reports, name)
            lines.append(
                f"| {d} | {name} | {med * 1e3:.3f} | {flops / med / 1e12:.1f} | "
                f"{ratio} | {gemms} |"
            )
            RESULTS["sweep", str(d), name] = (float(ratio.split()[0]), 0.0, 0.0)
    return lines


def run_models(mode: str) -> list[str]:
    rounds, n = ROUNDS[mode]["models"]
    lines = [
        "| model | variant | step ms (median) | tokens/s | ratio vs bf16 [q25, q75] "
        "| compile s | float8 dots / rewritable / GEMMs | loss after timing |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for model, size in MODELS[mode].items():
        key_p, key_d = jax.random.split(jax.random.key(0))
        tokens = jax.random.randint(key_d, (size.batch, size.seq + 1), 0, size.vocab)
        x, y = tokens[:, :-1], tokens[:, 1:]
        params = jax.jit(gpu.GPT(size).init)(key_p, x)
        net = gpu.GPT(size)

        def loss_fn(params, x, y, net=net):
            return gpu.cross_entropy(net.apply(params, x), y)

        tx = optax.adamw(gpu.LR, weight_decay=gpu.WEIGHT_DECAY)
        steps, carry = {}, {}
        for name, recipe in recipes().items():
            p = jax.tree.map(jnp.copy, params)
            steps[name], carry[name] = grad_step(loss_fn, recipe, (p, x, y), tx)
            # x and y are the batch: only the params and states are donated.
        del params
        with warnings.catch_warnings():  # GPT-2-small: no float8 chosen
            warnings.simplefilter("ignore", jxs.AutocastWarning)
            compiled, secs, reports = compile_all(steps, carry, model)
        fns = {k: (lambda c, s=c_: s(c)) for k, c_ in compiled.items()}
        losses = {}
        for name in fns:
            for _ in range(2):
                carry[name], losses[name] = fns[name](carry[name])
        jax.block_until_ready(carry)
        times = time_variants(fns, carry, rounds, n)
        for name in fns:
            carry[name], losses[name] = fns[name](carry[name])
        tokens_per_step = size.batch * size.seq
        for name in VARIANTS:
            med, ratio, gemms = _cells(times, reports, name)
            lines.append(
                f"| {model} | {name} | {med * 1e3:.3f} | {tokens_per_step / med:,.0f} "
                f"| {ratio} | {secs[name]:.1f} | {gemms} | {float(losses[name]):.4f} |"
            )
            RESULTS["models", model, name] = (
                float(ratio.split()[0]),
                secs[name],
                secs["bfloat16"],
            )
        del carry, compiled, fns, steps
    return lines


# Issue 32's targets: (part, model or d, variants tried in order, bound, what).
TARGETS = (
    ("models", "wide", ("float8 chosen", "float8 current"), 0.80, "wide model"),
    ("sweep", "4096", ("float8 current",), 0.75, "one site, d 4096"),
    ("sweep", "8192", ("float8 current",), 0.65, "one site, d 8192"),
    ("models", "realistic", ("float8 chosen",), 1.00, "GPT-2-small, default choice"),
    ("models", "mid", ("float8 chosen",), 0.999, "d 2048 model, default choice"),
)


def targets() -> list[str]:
    """One line per target measured: the value, the bound, met or not."""
    lines = []
    for part, where, names, bound, what in TARGETS:
        name = next((n for n in names if (part, where, n) in RESULTS), None)
        if name is None:
            continue
        ratio = RESULTS[part, where, name][0]
        verdict = "met" if ratio <= bound else "MISSED"
        lines.append(
            f"targets: {what} ({name}): {ratio:.3f} of bfloat16, target <= "
            f"{bound:.2f}: {verdict}"
        )
    compiles = [
        (k[1], k[2], c / b)
        for k, (_, c, b) in RESULTS.items()
        if k[0] == "models" and k[2] != "bfloat16" and b > 0
    ]
    if compiles:
        model, name, worst = max(compiles, key=lambda c: c[2])
        verdict = "met" if worst <= 1.5 else "MISSED"
        lines.append(
            f"targets: compile time, worst {model} {name}: {worst:.2f} times "
            f"bfloat16's, target <= 1.50: {verdict}"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="small sizes (CPU)")
    parser.add_argument(
        "--parts", nargs="+", choices=["sweep", "models"], default=["sweep", "models"]
    )
    parser.add_argument(
        "--models", nargs="+", choices=["realistic", "mid", "wide"], help="default: all"
    )
    parser.add_argument(
        "--dims", nargs="+", type=int, help="the sweep's d (default: all)"
    )
    parser.add_argument(
        "--variants",
        nargs="+",
        choices=ALL_VARIANTS,
        help="default: all but float8 delayed (deprecated); bfloat16 always runs",
    )
    parser.add_argument("--rounds", type=int, help="timed rounds of each part")
    parser.add_argument("--steps-per-round", type=int, help="steps per round")
    args = parser.parse_args(argv)
    mode = "tiny" if args.tiny else "full"
    if args.models:
        for name in list(MODELS[mode]):
            if name not in args.models:
                del MODELS[mode][name]
    if args.dims:
        SWEEP[mode][1][:] = args.dims
    if args.variants:
        global VARIANTS
        VARIANTS = tuple(v for v in ALL_VARIANTS if v in {"bfloat16", *args.variants})
    for part, (r, n) in ROUNDS[mode].items():
        ROUNDS[mode][part] = (args.rounds or r, args.steps_per_round or n)
    if mode == "full" and jax.default_backend() != "gpu":
        print(
            "No GPU: run `python benchmarks/float8.py --tiny` to check the script "
            "on a CPU.",
            file=sys.stderr,
        )
        return 2
    dev = jax.devices()[0]
    print(
        f"env: jax {jax.__version__}, jaxlib {importlib.metadata.version('jaxlib')}, "
        f"jaxscale {jxs.__version__}, device {dev.device_kind} ({dev.platform})"
    )
    for part in args.parts:
        lines = run_sweep(mode) if part == "sweep" else run_models(mode)
        print(f"\n{part}:")
        print("\n".join(lines), flush=True)
    lines = targets()
    if lines:
        print("\n" + "\n".join(lines))
    print(f"env: total wall time {time.time() - gpu.START['time']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
