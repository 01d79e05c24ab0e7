"""A precision plan's measured step time next to its prediction (issue 41).

The GPT of ``benchmarks/gpu.py`` (GPT-2-small with ``realistic``; its tied head
is a matmul site too) is measured by a :class:`jxs.precision.Sensor` on two
batches of random tokens, and planned for the device JAX runs on (the H100
SXM's figures on a CPU). Jitted train steps (``jax.value_and_grad`` and
``optax.adamw``, parameters and optimizer state donated) are then built and
timed side by side, in interleaved rounds:

* ``bfloat16``: ``jxs.autocast(loss, jnp.bfloat16)``, the reference;
* ``plan``: ``jxs.autocast(loss, jnp.bfloat16, plan=plan)``, the plan with
  every format allowed (budget: the model in 16 bits);
* ``plan, 16-bit or float8``: the plan with ``allowed={HALF, FLOAT8,
  FLOAT8_ROWWISE}``: float8 where it pays and the error allows;
* ``float8 everywhere``: ``float8=jxs.float8.CurrentScaling(min_dim=0)``.

For each it prints the speed model's predicted time of the matmul sites (their
three products and the passes each format adds) over the same sites in 16 bits,
next to the measured step time over the bfloat16 step (median of the per-round
ratios, with the quartiles). The prediction covers the sites only, the step
everything: on a GPU the two ratios should move together; on a CPU (float8
emulated) they say nothing about speed. ``.ci/gpu --precision`` runs it.

    python benchmarks/precision_gpu.py            # GPT-2-small
    python benchmarks/precision_gpu.py --tiny     # any machine, seconds
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import optax

import jaxscale as jxs
import jaxscale.precision as jxp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu import GPT, SIZES, cross_entropy, paired, time_rounds  # noqa: E402

F = jxp.Format
BF16 = jnp.bfloat16


def batches(size, n, seed=1):
    out = []
    for k in jax.random.split(jax.random.key(seed), n):
        t = jax.random.randint(k, (size.batch, size.seq + 1), 0, size.vocab)
        out.append((t[:, :-1], t[:, 1:]))
    return out


def predicted(plan, fmt=None):
    """The plan's predicted site time over 16 bits (every site in ``fmt``)."""
    if fmt is None:
        return plan.seconds / plan.half_seconds
    t = sum(m.seconds(fmt, plan.cost) for m in plan.measures)
    return t / plan.half_seconds


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--steps-per-round", type=int, default=None)
    cfg = parser.parse_args(argv)
    size = SIZES["tiny" if cfg.tiny else "full"]["realistic"]
    rounds = cfg.rounds or (2 if cfg.tiny else 7)
    n = cfg.steps_per_round or (2 if cfg.tiny else 10)
    print(f"device: {jax.devices()[0].device_kind}; model: {size.describe()}")
    net = GPT(size)
    cal = batches(size, 2)
    params = jax.jit(net.init)(jax.random.key(0), cal[0][0])

    def loss(params, batch):
        tokens, labels = batch
        return cross_entropy(net.apply(params, tokens), labels)

    t0 = time.perf_counter()
    sensor = jxp.Sensor(loss, BF16)
    for b in cal:
        sensor.update(params, b)
    sensed = time.perf_counter() - t0
    plan = sensor.plan(budget="16-bit")  # the budget of the recorded runs
    eight = sensor.plan(budget="16-bit", allowed={F.HALF, F.FLOAT8, F.FLOAT8_ROWWISE})
    print(f"sensor: {len(plan.sites)} sites, 2 batches in {sensed:.1f} s")
    print(plan, "\n")
    print(eight, "\n")
    variants = {
        "bfloat16": (jxs.autocast(loss, BF16), 1.0),
        "plan": (jxs.autocast(loss, BF16, plan=plan), predicted(plan)),
        "plan, 16-bit or float8": (
            jxs.autocast(loss, BF16, plan=eight),
            predicted(eight),
        ),
        "float8 everywhere": (
            jxs.autocast(loss, BF16, float8=jxs.float8.CurrentScaling(min_dim=0)),
            predicted(plan, F.FLOAT8),
        ),
    }
    tx = optax.adamw(1e-4)
    steps, carry, compile_s = {}, {}, {}
    batch = cal[0]
    for name, (fn, _) in variants.items():

        def step(p, s, b, fn=fn):
            v, g = jax.value_and_grad(fn)(p, b)
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s, v

        p = jax.tree.map(jnp.copy, params)
        s = tx.init(p)
        t0 = time.perf_counter()
        compiled = jax.jit(step, donate_argnums=(0, 1)).lower(p, s, batch).compile()
        compile_s[name] = time.perf_counter() - t0

        def run(state, b, compiled=compiled):
            p, s, v = compiled(*state, b)
            return (p, s), v

        steps[name], carry[name] = run, (p, s)
        for _ in range(2):
            carry[name], v = run(carry[name], batch)
        jax.block_until_ready(v)
    times = time_rounds(steps, carry, batch, rounds, n, jax.block_until_ready)
    print(
        "| variant | predicted site time / 16-bit | measured step / bfloat16 "
        "(quartiles) | step ms | compile s |"
    )
    print("|---|---|---|---|---|")
    for name, (_, pred) in variants.items():
        med, lo, hi = paired(times, name, "bfloat16")
        ms = statistics.median(times[name]) * 1e3
        print(
            f"| {name} | {pred:.3f} | {med:.3f} ({lo:.3f}-{hi:.3f}) | "
            f"{ms:.2f} | {compile_s[name]:.1f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
