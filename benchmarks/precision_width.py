"""The default precision plan at realistic width (issue 49 item 6).

A GPT-2-style decoder (``benchmarks/gpu.py``'s: learned positions, a tied
output head, an MLP of 4 d) at each ``--dims`` width, at its initial
parameters on one batch of random tokens, planned by the default call
``jxs.precision.plan_precision(loss, jnp.bfloat16, cost="H200")`` (the noise
budget: the gradient error the formats add within a tenth of the batch's
minibatch gradient noise). It prints, per width:

1. the plan as it prints itself: each site's format, predicted time, noise
   spent and why;
2. the predicted H200 time of every matmul site (attention's batched
   products included) over all in bfloat16, and the noise spent, for the
   plan and the usual rules on the same measures: all float8 (dense sites),
   torchao's shape rule for tensorwise float8 (a site stays bfloat16 where
   K <= 4096 and N <= 1024) and the first and last dense sites in bfloat16;
   at the calibration batch's shapes and at ``--scale`` times as many
   sequences per step (the plan re-solved there, ``Plan.at``; the noise
   figures stay the calibration batch's). ``plan-large`` is the plan within
   a budget ``--scale`` times smaller: what the larger batch's smaller
   gradient noise would allow if that noise falls as one over the batch and
   the formats' errors do not (an estimate, not a measurement).

No GPU is needed or used: the times are the speed model's, the noise the
sensor's on the CPU. A small calibration batch has a large gradient noise,
so its noise budget admits more than a training batch's would.

Run it as recorded in docs/measurements.md (2 and 3 minutes on a 2-core CPU;
d 4096 at 2 layers and vocabulary 32768 took over 14 GB, so 1 layer, 8192)::

    python benchmarks/precision_width.py --dims 1024 --json precision_width_1024.json
    python benchmarks/precision_width.py --dims 4096 --layers 1 --vocab 8192 \
        --json precision_width_4096.json
    python benchmarks/precision_width.py --quick     # tiny (tests)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import warnings

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu import GPT, Size, cross_entropy  # noqa: E402

import jaxscale as jxs  # noqa: E402
import jaxscale.internal as jxi  # noqa: E402
import jaxscale.precision as jxp  # noqa: E402

F = jxp.Format
DEVICE = "H200"
# torchao's rule for tensorwise float8 (as examples/precision_char.py).
TORCHAO_K, TORCHAO_N = 4096, 1024
RULES = ("bf16", "fp8", "torchao", "fp8-ends", "plan", "plan-large")


def problem(size: Size, seed: int):
    """``(loss, params, batch)``: the decoder on random tokens."""
    net = GPT(size)
    k1, k2 = jax.random.split(jax.random.key(seed))
    t = jax.random.randint(k1, (size.batch, size.seq + 1), 0, size.vocab)
    batch = (t[:, :-1], t[:, 1:])
    params = jax.jit(net.init)(k2, batch[0])

    def loss(params, batch):
        tokens, labels = batch
        return cross_entropy(net.apply(params, tokens), labels)

    return loss, params, batch


def rule_formats(name: str, plan: jxp.Plan) -> dict[str, F]:
    """``{site: Format}`` of rule ``name`` on the plan's sites: the dense sites
    as the rule says, attention's batched products in 16 bits."""
    dense = [m for m in plan.measures if m.kind == "dense"]
    out = dict.fromkeys((m.site for m in plan.measures), F.HALF)
    if name in ("plan", "plan-large"):
        return plan.formats()
    if name == "fp8":
        out.update(dict.fromkeys((m.site for m in dense), F.FLOAT8))
    elif name == "torchao":
        for m in dense:
            if not (m.shape[1] <= TORCHAO_K and m.shape[2] <= TORCHAO_N):
                out[m.site] = F.FLOAT8
    elif name == "fp8-ends":
        out.update(dict.fromkeys((m.site for m in dense[1:-1]), F.FLOAT8))
    return out


def row(name: str, plan: jxp.Plan, scale: int) -> dict:
    """Rule ``name``'s float8 sites, noise spent and predicted time over all
    16-bit, at the calibration shapes and at ``scale`` times the sequences.
    ``plan-large``: the plan solved again within the budget over ``scale``
    (the noise of a batch ``scale`` times larger, if the minibatch noise
    falls as one over the batch and the formats' errors do not)."""
    if name == "plan-large":
        plan = jxp.solve(
            plan.measures, cost=DEVICE, budget=jxp.NoiseBudget(plan.budget / scale)
        )
    formats = rule_formats(name, plan)
    noise = sum(m.noise[formats[m.site]] for m in plan.measures)
    shapes = shapes_at(plan, scale)
    with warnings.catch_warnings():  # a rule over the budget: the table says so
        warnings.simplefilter("ignore", jxp.PlanBudgetWarning)
        fixed = jxp.Plan.from_formats(formats, plan.measures, cost=DEVICE)
    if name in ("plan", "plan-large"):
        big = plan.at(shapes)  # re-solved at those shapes
    else:
        big = fixed.at(shapes)  # its formats, pinned, priced there
    return {
        "float8": sum(f is F.FLOAT8 for f in formats.values()),
        "float8_scaled": sum(f is F.FLOAT8 for f in big.formats().values()),
        "float8_sites_scaled": [s for s, f in big.formats().items() if f is F.FLOAT8],
        "noise": noise,
        "budget": plan.budget if name.startswith("plan") else None,
        "ratio": fixed.seconds / fixed.half_seconds,
        "ratio_scaled": big.seconds / big.half_seconds,
    }


def shapes_at(plan: jxp.Plan, scale: int) -> dict[str, tuple[int, int, int]]:
    """Each site's ``(m, k, n)`` at ``scale`` times the calibration sequences."""
    return {m.site: (m.shape[0] * scale, *m.shape[1:]) for m in plan.measures}


def float8_speed(m: jxp.SiteMeasure, shape: tuple[int, int, int]) -> float | None:
    """The speed model's float8 time over 16-bit at site ``m`` of ``shape``
    (``None``: float8 not measured there, attention's batched products)."""
    if F.FLOAT8 not in m.errors:
        return None
    cost = jxi.device_cost(DEVICE)[0]
    m = dataclasses.replace(m, shape=shape)
    return m.seconds(F.FLOAT8, cost) / m.seconds(F.HALF, cost)


def measure(size: Size, cfg) -> dict:
    """The default plan of the decoder of ``size``, its rules' rows."""
    loss, params, batch = problem(size, cfg.seed)
    t0 = time.perf_counter()
    plan = jxp.plan_precision(loss, jnp.bfloat16, cost=DEVICE)(params, batch)
    seconds = time.perf_counter() - t0
    shapes = shapes_at(plan, cfg.scale)
    big = plan.at(shapes)
    rows = {n: row(n, plan, cfg.scale) for n in RULES}
    sites = [
        {
            "site": s.site,
            "kind": m.kind,
            "shape": list(s.shape),
            "format": s.format.value,
            "float8_speed": float8_speed(m, m.shape),
            "why": s.why,
            "format_scaled": b.format.value,
            "float8_speed_scaled": float8_speed(m, shapes[m.site]),
            "why_scaled": b.why,
            "noise_half": m.noise[F.HALF],
            "noise_float8": m.noise.get(F.FLOAT8),
        }
        for s, b, m in zip(plan.sites, big.sites, plan.measures, strict=True)
    ]
    return {
        "size": size.describe(),
        "seconds": seconds,
        "plan_text": str(plan),
        "plan_scaled_text": str(big),
        "budget": plan.budget,
        "spent": plan.spent,
        "sites": sites,
        "rows": rows,
    }


def _num(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def sites_table(result: dict, scale: int) -> str:
    """Per site: its format and float8's predicted time over 16-bit at the
    calibration shapes and at ``scale`` times the sequences; its noise."""
    lines = [
        "| site | m x k x n | format | float8 / 16-bit time | format at "
        f"{scale}x | float8 / 16-bit at {scale}x | noise 16-bit | noise float8 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for s in result["sites"]:
        shape = " x ".join(map(str, s["shape"]))
        lines.append(
            f"| {s['site']} | {shape} | {s['format']} "
            f"| {_num(s['float8_speed'], '.2f')} | {s['format_scaled']} "
            f"| {_num(s['float8_speed_scaled'], '.2f')} | {s['noise_half']:.2g} "
            f"| {_num(s['noise_float8'], '.2g')} |"
        )
    return "\n".join(lines)


def rows_table(results: dict, scale: int) -> str:
    lines = [
        "| d | rule | float8 sites | noise spent | H200 time | float8 sites "
        f"at {scale}x | H200 time at {scale}x |",
        "|---|---|---|---|---|---|---|",
    ]
    for d, res in results.items():
        for name, r in res["rows"].items():
            lines.append(
                f"| {d} | {name} | {r['float8']} | {r['noise']:.3g} "
                f"| {r['ratio']:.2f} | {r['float8_scaled']} | {r['ratio_scaled']:.2f} |"
            )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dims", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=128, help="d / heads")
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--batch", type=int, default=4, help="calibration sequences")
    parser.add_argument(
        "--scale", type=int, default=64, help="also price a step of this many x"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="tiny sizes (tests)")
    parser.add_argument("--json", default=None, help="write the results here")
    cfg = parser.parse_args(argv)
    if cfg.quick:
        cfg.dims, cfg.layers, cfg.head_dim = [64], 1, 32
        cfg.vocab, cfg.seq, cfg.batch = 128, 16, 4
    return cfg


def main(argv: list[str] | None = None) -> None:
    cfg = parse_args(argv)
    print(
        f"jaxscale {jxs.__version__}, jax {jax.__version__} on "
        f"{jax.default_backend()}: the default plan, priced for an {DEVICE}"
    )
    results = {}
    for d in cfg.dims:
        size = Size(
            cfg.layers,
            d,
            max(1, d // cfg.head_dim),
            4 * d,
            cfg.vocab,
            cfg.seq,
            cfg.batch,
        )
        res = measure(size, cfg)
        results[d] = res
        print(f"\n## d {d}: {res['size']} (planned in {res['seconds']:.0f} s)\n")
        print(res["plan_text"])
        print(f"\nre-solved at {cfg.scale}x the sequences (Plan.at):")
        print(res["plan_scaled_text"])
        print()
        print(sites_table(res, cfg.scale), flush=True)
    print(f"\n## Predicted {DEVICE} time over all bf16\n")
    print(rows_table(results, cfg.scale))
    for d, res in results.items():
        for name in ("plan", "plan-large"):
            on = res["rows"][name]["float8_sites_scaled"]
            print(f"d {d}, {name} at {cfg.scale}x: float8 at {', '.join(on) or '-'}")
    if cfg.json:
        doc = {
            "config": {k: v for k, v in vars(cfg).items() if k != "json"},
            "versions": {"jax": jax.__version__, "jaxscale": jxs.__version__},
            "results": {str(d): r for d, r in results.items()},
        }
        with open(cfg.json, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
