"""The passes float8 adds to a train step, counted on the compiled program.

Issue 32, item 1: each change to how float8 quantises (fusing the amax and the
cast into the producer, quantising a weight once per step, transposes) should
be measured without a GPU. This script compiles, without running them, the
train steps of ``benchmarks/float8.py`` (the one-site sweep's step, and whole
Flax decoders from ``benchmarks/gpu.py`` with AdamW) under bfloat16 autocast
and under float8, and counts in each compiled program, as
``benchmarks/overhead.py`` does for loss scaling:

* **kernels**: the instructions the entry computation (and the computations it
  calls) executes that touch memory: fusions, and copies, transposes, dots,
  reductions, converts outside a fusion (parameters, constants, tuples and
  bitcasts are free); **fusions** among them;
* **bytes**: per kernel, its output plus its operands (XLA's convention for a
  fusion), summed: what the step moves if every kernel reads its operands and
  writes its output once; and XLA's own estimate, ``cost_analysis()["bytes
  accessed"]``.

Each float8 variant's row gives what it adds to the bfloat16 step: kernels and
bytes per float8 site, and the added bytes in *16-bit passes over the sites'
matrices* (``2 * (MK + KN + MN)`` bytes per site: 1.0 means the step moves each
site's activation, weight and output once more at 16 bits). The compile time of
each step is printed too (the issue's target: 1.5 times bfloat16's at most).

XLA:CPU is not XLA:GPU: it computes float8 products in float32 (a convert
fused into the dot) and fuses differently, so the counts are the mechanism on
this compiler, not a GPU's kernel count. They are stable from run to run (no
timing), which is what measuring a change needs.

Variants: ``bfloat16`` (autocast), ``float8 current``, ``float8 rowwise`` and
``float8 delayed`` (deprecated) with every matmul without batch dimensions in
float8 (``min_dim=0``), and ``float8 chosen`` (current scaling, the default
choice of the cost model for an H200: only the products it predicts faster).

Run::

    python benchmarks/float8_passes.py            # full sizes, compile only
    python benchmarks/float8_passes.py --tiny     # small sizes (the tests)
    python benchmarks/float8_passes.py --target h200   # XLA:GPU, no GPU needed
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

HERE = Path(__file__).resolve().parent
for path in (HERE.parent, HERE):  # jaxscale from this checkout; gpu.py beside
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import gpu  # noqa: E402 (after the path)
import hlo_account  # noqa: E402

import jaxscale as jxs  # noqa: E402
from jaxscale import _hlo  # noqa: E402

BF16 = jnp.bfloat16
SDS = jax.ShapeDtypeStruct
VARIANTS = (
    "bfloat16",
    "float8 current",
    "float8 rowwise",
    "float8 delayed",
    "float8 chosen",
)
MODELS = {
    "full": {
        "site": (8192, 4096),  # M, d of the sweep's step: K = N = d
        "realistic": gpu.Size(1, 768, 12, 3072, 50304, 1024, 8),  # 1 of 12 layers
        "wide": gpu.Size(1, 4096, 32, 16384, 32768, 1024, 4),  # 1 of 4 layers
    },
    "tiny": {
        "site": (64, 64),
        "realistic": gpu.Size(1, 64, 4, 256, 512, 64, 2),
    },
}


def delayed(history_len: int) -> Any:
    """Delayed scaling, deprecated: measured here as the evidence for that."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return jxs.float8.DelayedScaling(history_len, min_dim=0)


def recipes() -> dict[str, Any]:
    return {
        "bfloat16": None,
        "float8 current": jxs.float8.CurrentScaling(min_dim=0),
        "float8 rowwise": jxs.float8.RowwiseScaling(min_dim=0),
        "float8 delayed": delayed(16),
        "float8 chosen": jxs.float8.CurrentScaling(device_kind="NVIDIA H200"),
    }


# --------------------------------------------------------------------------- #
# The steps, on abstract arguments (nothing is allocated or run)
# --------------------------------------------------------------------------- #


def site_problem(m: int, d: int) -> tuple[Callable[..., Any], tuple, bool]:
    """The sweep's step: ``sum((x @ w) * r)``, gradients of ``(w, x)``."""

    def loss(wx, r):
        w, x = wx
        return jnp.sum((x @ w) * r)

    f32 = jnp.float32
    return loss, ((SDS((d, d), f32), SDS((m, d), f32)), SDS((m, d), f32)), False


def model_problem(size: gpu.Size) -> tuple[Callable[..., Any], tuple, bool]:
    """A decoder's loss of ``(params, x, y)``, trained with AdamW."""
    net = gpu.GPT(size)
    tokens = SDS((size.batch, size.seq), jnp.int32)
    params = jax.eval_shape(net.init, jax.random.key(0), tokens)

    def loss(params, x, y):
        return gpu.cross_entropy(net.apply(params, x), y)

    return loss, (params, tokens, tokens), True


def step_of(
    loss: Callable[..., Any],
    recipe: Any,
    args: tuple,
    train: bool,
    place: Callable[[Any], Any] = lambda tree: tree,
) -> tuple[Any, tuple]:
    """The jitted step of a variant (``train``: AdamW; else the sweep's, the
    gradients fed back scaled down) and its abstract arguments."""
    f = jxs.autocast(loss, BF16, float8=recipe)
    delayed = isinstance(recipe, jxs.float8.DelayedScaling)
    state = jxs.float8.init(f, *args) if delayed else None
    tx = optax.adamw(gpu.LR, weight_decay=gpu.WEIGHT_DECAY)

    def step(params, opt_state, st, *batch):
        if delayed:
            loss_, grads, st = jxs.float8.value_and_grad(f, st)(params, *batch)
        else:
            loss_, grads = jax.value_and_grad(f)(params, *batch)
        if not train:
            new = jax.tree.map(lambda a, g: a - 1e-6 * g.astype(a.dtype), params, grads)
            return new, opt_state, st, loss_
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, st, loss_

    opt_state = jax.eval_shape(tx.init, args[0]) if train else ()
    jitted = jax.jit(step, donate_argnums=(0, 1, 2))
    return jitted, place((args[0], opt_state, state, *args[1:]))


# --------------------------------------------------------------------------- #
# The accounting
# --------------------------------------------------------------------------- #

_F8 = ("f8E4M3FN", "f8E5M2")  # StableHLO's float8 element types


def kernels(hlo: str) -> tuple[collections.Counter, int]:
    """The kernels on the executed path of a compiled module, by opcode, and
    the bytes they move (each: output plus operands), as ``jaxscale._hlo``
    reads them."""
    found = _hlo.kernels(hlo)
    return collections.Counter(k.opcode for k in found), sum(k.bytes for k in found)


def site_elements(lowered: str) -> tuple[int, int]:
    """Float8 sites of a lowered program and the elements of their matrices
    (``MK + KN + MN`` each), from its float8 ``dot_general``s (three per site,
    each touching the three matrices once)."""
    dots, elements = 0, 0
    for dot in _hlo.stablehlo_dots(lowered):
        types = (*dot.operands, dot.result)
        if len(dot.operands) == 2 and any(t.startswith(_F8) for t, _ in types):
            dots += 1
            elements += sum(int(np.prod(dims)) for _, dims in types)
    return round(dots / 3), elements // 3


def measure(step: Any, args: tuple) -> dict[str, Any]:
    t0 = time.perf_counter()
    lowered = step.lower(*args)
    compiled = lowered.compile()
    secs = time.perf_counter() - t0
    ops, nbytes = kernels(compiled.as_text())
    cost = compiled.cost_analysis()
    cost = (cost[0] if isinstance(cost, list | tuple) else cost) or {}  # None: no GPU
    sites, elements = site_elements(lowered.as_text())
    return {
        "kernels": sum(ops.values()),
        "fusions": ops["fusion"],
        "bytes": nbytes,
        "xla_bytes": float(cost.get("bytes accessed", 0.0)),
        "compile": secs,
        "sites": sites,
        "elements": elements,
    }


HEADER = (
    "| model | variant | float8 sites | kernels (fusions) | kernel MiB | XLA bytes "
    "accessed MiB | compile s (vs bf16) | extra kernels per site | extra MiB per "
    "site | extra bytes, 16-bit passes over the sites' matrices |\n"
    "|---|---|---|---|---|---|---|---|---|---|"
)


def rows(model: str, got: dict[str, dict[str, Any]]) -> list[str]:
    mib = 2.0**20
    base = got["bfloat16"]
    out = []
    for name in VARIANTS:
        r = got[name]
        cells = [
            model,
            name,
            str(r["sites"]),
            f"{r['kernels']} ({r['fusions']})",
            f"{r['bytes'] / mib:,.1f}",
            f"{r['xla_bytes'] / mib:,.1f}",
            f"{r['compile']:.1f} ({r['compile'] / base['compile']:.2f})",
        ]
        if name == "bfloat16" or not r["sites"]:
            cells += ["-", "-", "-"]
        else:
            extra = r["bytes"] - base["bytes"]
            cells += [
                f"{(r['kernels'] - base['kernels']) / r['sites']:+.1f}",
                f"{extra / r['sites'] / mib:+,.1f}",
                f"{extra / (2 * r['elements']):+.2f}",
            ]
        out.append("| " + " | ".join(cells) + " |")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="small sizes")
    parser.add_argument(
        "--models",
        nargs="+",
        choices=["site", "realistic", "wide"],
        help="default: all",
    )
    parser.add_argument(
        "--target",
        choices=["h100", "h200"],
        help="compile for this GPU without one (needs jax-cuda12-plugin)",
    )
    args = parser.parse_args(argv)
    mode = "tiny" if args.tiny else "full"
    place = hlo_account.abstract_for(args.target)  # before jax picks a backend
    if args.target:
        device = f"{args.target.upper()} (XLA:GPU, deviceless: no autotuning)"
    else:
        dev = jax.devices()[0]
        device = f"{dev.device_kind} ({dev.platform})"
    print(
        f"env: jax {jax.__version__}, jaxscale {jxs.__version__}, device "
        f"{device}; compiled, not run"
    )
    lines = [HEADER]
    for model, size in MODELS[mode].items():
        if args.models and model not in args.models:
            continue
        loss, problem, train = (
            site_problem(*size) if model == "site" else model_problem(size)
        )
        got = {}
        for name, recipe in recipes().items():
            step, step_args = step_of(loss, recipe, problem, train, place)
            with warnings.catch_warnings():  # "nothing runs in float8": a row says so
                warnings.simplefilter("ignore", jxs.AutocastWarning)
                got[name] = measure(step, step_args)
            gpu.log(f"{model}: {name}: {got[name]}")
        lines += rows(model, got)
    print("\n".join(lines), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
