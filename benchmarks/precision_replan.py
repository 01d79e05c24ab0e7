"""A re-plan while it trains: activations that grow past float16's range.

A two-layer linear regression whose inputs grow by 3% a step (the data
drifts: the target grows with them, so the model itself is fine in float32)
trains under float16 autocast with dynamic loss scaling, three ways, from the
same parameters on the same batches:

1. ``float32``: no autocast;
2. ``fixed plan``: the plan :func:`jxs.plan_precision` made on the first batch
   (both sites in 16 bits), never changed;
3. ``monitored``: the same plan run by a :class:`jxs.precision.Monitor`, whose
   ``replan`` is called on the host every ``--every`` steps: a site whose
   float16 operands or output come within 4x of 65504 for ``--patience`` steps
   in a row is raised one format (16-bit -> 16-bit with a float32 result ->
   float32), and lowered back after ``--window`` calm steps.

It prints, per run, the final loss (relative squared error), the skipped
steps (non-finite gradients: the loss scale's doing), and for the monitored
run each change with its step and the time to compile the new step.

Run it (about a minute on a 2-core CPU)::

    python benchmarks/precision_replan.py
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxscale as jxs
import jaxscale.precision as jxp

F = jxp.Format


def loss(p, x, t):
    out = (x @ p["w1"]) @ p["w2"]
    return jnp.mean((out - t) ** 2) / jnp.mean(t**2)


def setup(seed: int):
    k = jax.random.split(jax.random.key(seed), 4)
    p = {
        "w1": jax.random.normal(k[0], (32, 64)) / 6,
        "w2": jax.random.normal(k[1], (64, 8)) / 8,
    }
    x = jax.random.normal(k[2], (64, 32))
    teacher = jax.random.normal(k[3], (32, 8))
    return p, x, teacher


def run(name, p, x, teacher, cfg, mon=None):
    tx = jxs.dynamic_scaling(optax.adam(cfg.lr))
    opt = tx.init(p)
    state = mon.init() if mon is not None else None
    plan_loss = None if mon is None else jxs.autocast(loss, jnp.float16, plan=mon.plan)

    def make(mon):
        @jax.jit
        def step(p, opt, state, xi, t):
            if mon is None:
                fun = loss if name == "float32" else plan_loss
                v, g = jxs.value_and_grad(fun, opt)(p, xi, t)
                seen = None
            else:
                (v, g), seen = mon.value_and_grad(loss, opt)(p, xi, t)
            upd, opt = tx.update(g, opt, p)
            state = state if seen is None else mon.update(state, seen)
            return optax.apply_updates(p, upd), opt, state, v

        return step

    step = make(mon if name == "monitored" else None)
    changes, values = [], []
    for i in range(cfg.steps):
        grow = cfg.growth**i
        p, opt, state, v = step(p, opt, state, x * grow, (x @ teacher) * grow)
        values.append(v)
        if name == "monitored" and (i + 1) % cfg.every == 0:
            new, state, changed = mon.replan(state)
            if changed:
                mon, step = new, make(new)
                t0 = time.perf_counter()
                step.lower(p, opt, state, x * grow, (x @ teacher) * grow).compile()
                seconds = time.perf_counter() - t0
                changes += [
                    {"step": i + 1, "change": c, "compile_s": seconds} for c in changed
                ]
    values = np.asarray(jnp.stack(values))
    finite = values[np.isfinite(values)]
    return {
        "name": name,
        "final_loss": float(values[-1]),
        "last_finite_loss": float(finite[-1]) if finite.size else None,
        "nonfinite_losses": int((~np.isfinite(values)).sum()),
        "skipped_steps": int(opt.skipped_steps),
        "changes": changes,
        "final_plan": None if mon is None else str(mon.plan),
        "max_input": float(jnp.max(jnp.abs(x)) * cfg.growth ** (cfg.steps - 1)),
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=450)
    parser.add_argument("--growth", type=float, default=1.03)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--patience", type=int, default=2)
    parser.add_argument("--window", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    cfg = parser.parse_args(argv)
    p, x, teacher = setup(cfg.seed)
    allowed = {F.HALF, F.HALF_WIDE, F.FLOAT32}
    plan = jxs.plan_precision(loss, jnp.float16, cost="H100", allowed=allowed)(
        p, x, x @ teacher
    )
    for s in plan.sites:  # the all-16-bit plan: what the monitor starts from
        plan = plan.replace(s.site, F.HALF, why="the starting point")
    mon = jxp.Monitor(plan, jnp.float16, patience=cfg.patience, window=cfg.window)
    print(plan, "\n")
    rows = [
        run(n, p, x, teacher, cfg, mon if n != "float32" else None)
        for n in ("float32", "fixed plan", "monitored")
    ]
    print("| run | final loss | last finite loss | non-finite losses | skipped steps |")
    print("|---|---|---|---|---|")
    for r in rows:
        last = r["last_finite_loss"]
        print(
            f"| {r['name']} | {r['final_loss']:.3g} | "
            f"{'-' if last is None else f'{last:.3g}'} | {r['nonfinite_losses']} | "
            f"{r['skipped_steps']} |"
        )
    print()
    for c in rows[-1]["changes"]:
        print(
            f"step {c['step']:4d}: {c['change']} (compiled in {c['compile_s']:.2f} s)"
        )
    print()
    print(rows[-1]["final_plan"])
    if cfg.json:
        with open(cfg.json, "w") as f:
            json.dump({"config": vars(cfg), "runs": rows}, f, indent=1)


if __name__ == "__main__":
    main()
