"""What the precision sensor and monitor cost next to a training step (issue 49 item 8).

For each model (an MLP of ``--blocks`` tanh layers; ``benchmarks/gpu.py``'s
GPT-like decoder) it builds, from the same parameters and batch, and times side
by side in interleaved rounds (the order rotating; median of the per-round
ratios, with the quartiles):

* ``float32``: the plain training step, ``jax.value_and_grad`` and an
  ``optax.adamw`` update, jitted, parameters and optimizer state donated;
* ``bfloat16``: the same step of ``jxs.autocast(loss, jnp.bfloat16)``;
* ``sensor``: ``jxs.precision.Sensor(loss, jnp.bfloat16).update(params,
  batch)`` after its first call (the calibration step: a forward and backward
  pass that measures every site in every format, its sums read back to the
  host), with the sensor's default ``rows``, and with ``rows=None`` (exact
  sums over every row);
* ``monitor``: the ``bfloat16`` step of an every-site-16-bit plan under a
  ``jxs.precision.Monitor`` (``monitor.value_and_grad`` and ``monitor.update``
  in the jitted step).

It prints each one's step time over the float32 step's and the bfloat16
step's, and the first call's time (trace, compile and one run) less a step's:
the trace and compile time. ``--gpu`` instead compiles the training steps for
one NVIDIA H200 without a GPU (``benchmarks/hlo_account.py``'s deviceless
``gpu_mesh``; needs jax-cuda12-plugin) and prints the kernels and bytes
(``jaxscale._hlo.kernels``: the executed path, operands read and results
written) of the bfloat16 step with and without the monitor, and of the
sensor's step.

    python benchmarks/sensor_cost.py                 # small sizes, ~2 min
    python benchmarks/sensor_cost.py --size large    # larger, ~10 min
    python benchmarks/sensor_cost.py --quick         # tiny, a few rounds (tests)
    JAX_PLATFORMS=cpu python benchmarks/sensor_cost.py --gpu   # deviceless H200
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu import GPT, Size, cross_entropy, paired, time_rounds  # noqa: E402

import jaxscale as jxs  # noqa: E402
import jaxscale.precision as jxp  # noqa: E402

F = jxp.Format
BF16 = jnp.bfloat16
# Per size: (MLP batch, width), the GPT's size, (rounds, steps per round).
SIZES = {
    "quick": ((32, 64), Size(1, 32, 2, 128, 128, 16, 2), (3, 2)),
    "small": ((256, 512), Size(2, 128, 4, 512, 1024, 128, 8), (7, 5)),
    "large": ((1024, 1024), Size(4, 256, 4, 1024, 4096, 256, 8), (7, 3)),
}
MODELS = ("mlp", "gpt")


def mlp_problem(batch: int, width: int, blocks: int) -> tuple[Any, Any, Any]:
    """``(loss, params, batch)``: ``blocks`` tanh layers of ``width`` and a
    linear head of 16 outputs, mean squared error against a random target."""
    keys = jax.random.split(jax.random.key(0), blocks + 3)
    params = [
        jax.random.normal(k, (width, width)) / np.sqrt(width) for k in keys[:blocks]
    ]
    params.append(jax.random.normal(keys[blocks], (width, 16)) / np.sqrt(width))
    x = jax.random.normal(keys[-2], (batch, width))
    t = jax.random.normal(keys[-1], (batch, 16))

    def loss(params, data):
        h, target = data
        for w in params[:-1]:
            h = jnp.tanh(h @ w)
        return jnp.mean((h @ params[-1] - target) ** 2)

    return loss, params, (x, t)


def gpt_problem(size: Size) -> tuple[Any, Any, Any]:
    """``(loss, params, batch)``: ``benchmarks/gpu.py``'s decoder on random
    tokens (its tied head is a site too)."""
    net = GPT(size)
    t = jax.random.randint(jax.random.key(1), (size.batch, size.seq + 1), 0, size.vocab)
    batch = (t[:, :-1], t[:, 1:])
    params = jax.jit(net.init)(jax.random.key(0), batch[0])

    def loss(params, data):
        tokens, labels = data
        return cross_entropy(net.apply(params, tokens), labels)

    return loss, params, batch


def problem(model: str, size: str, blocks: int) -> tuple[Any, Any, Any]:
    (b, d), gpt, _ = SIZES[size]
    return mlp_problem(b, d, blocks) if model == "mlp" else gpt_problem(gpt)


def half_plan(loss: Any, params: Any, batch: Any) -> Any:
    """A plan of every site in 16 bits (the monitor's starting point)."""
    plan = jxp.plan_precision(loss, BF16, cost="H100", budget="16-bit")(params, batch)
    for site in plan.formats():
        plan = plan.replace(site, F.HALF)
    return plan


def train_step(loss: Any, tx: Any, monitor: Any = None) -> Any:
    """The jitted step ``(params, opt_state[, mon_state]), batch -> ...``."""
    if monitor is None:

        def step(p, s, b):
            v, g = jax.value_and_grad(loss)(p, b)
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s, v

        return jax.jit(step, donate_argnums=(0, 1))

    def mstep(p, s, m, b):
        (v, g), seen = monitor.value_and_grad(loss)(p, b)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, monitor.update(m, seen), v

    return jax.jit(mstep, donate_argnums=(0, 1, 2))


def measure(model: str, size: str, blocks: int, rounds: int, n: int) -> dict:
    """Times of one model's steps (see the module's docstring)."""
    loss, params, batch = problem(model, size, blocks)
    tx = optax.adamw(1e-4)
    mon = jxp.Monitor(half_plan(loss, params, batch), BF16)
    steps, carry, first = {}, {}, {}
    for name, fn, monitor in (
        ("float32", loss, None),
        ("bfloat16", jxs.autocast(loss, BF16), None),
        ("monitor", loss, mon),
    ):
        jitted = train_step(fn, tx, monitor)
        p = jax.tree.map(jnp.copy, params)
        state = (p, tx.init(p)) + ((mon.init(),) if monitor else ())

        def run(state, b, jitted=jitted):
            *state, v = jitted(*state, b)
            return tuple(state), v

        t0 = time.perf_counter()
        state, v = run(state, batch)
        jax.block_until_ready(v)
        first[name] = time.perf_counter() - t0
        steps[name], carry[name] = run, state
    sensors = {"sensor": jxp.Sensor(loss, BF16)}
    sensors["sensor, rows=None"] = jxp.Sensor(loss, BF16, rows=None)
    for name, sensor in sensors.items():

        def sense(state, b, sensor=sensor):
            sensor.update(state, b)  # reads its sums back: synchronous
            return state, None

        t0 = time.perf_counter()
        sense(params, batch)
        first[name] = time.perf_counter() - t0
        steps[name], carry[name] = sense, params
    for name in steps:  # warm
        carry[name], v = steps[name](carry[name], batch)
    times = time_rounds(steps, carry, batch, rounds, n, jax.block_until_ready)
    sites = len(sensors["sensor"].measures())
    return {"times": times, "first": first, "sites": sites}


HEADER = (
    "| model | step | ms | / float32 step (quartiles) | / bfloat16 step | "
    "trace + compile s | / float32's |\n" + "|---" * 7 + "|"
)


def table(model: str, out: dict) -> list[str]:
    times, first = out["times"], out["first"]
    ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    compile_s = {k: first[k] - ms[k] / 1e3 for k in times}
    lines = []
    for name in times:
        med, lo, hi = paired(times, name, "float32")
        half, _, _ = paired(times, name, "bfloat16")
        lines.append(
            f"| {model} | {name} | {ms[name]:.2f} | **{med:.2f}** ({lo:.2f}-{hi:.2f})"
            f" | {half:.2f} | {compile_s[name]:.2f} | "
            f"{compile_s[name] / compile_s['float32']:.1f} |"
        )
    return lines


# --------------------------------------------------------------------------- #
# Deviceless: XLA:GPU's compile for one H200.
# --------------------------------------------------------------------------- #


def gpu_rows(model: str, size: str, blocks: int) -> list[str]:
    """Kernels and bytes of the bfloat16 step with and without the monitor,
    and of the sensor's step, compiled for one deviceless H200."""
    from hlo_account import gpu_mesh

    from jaxscale._hlo import kernels

    loss, params, batch = problem(model, size, blocks)
    tx = optax.adamw(1e-4)
    mon = jxp.Monitor(half_plan(loss, params, batch), BF16)
    mesh = gpu_mesh("h200")
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

    def abstract(tree):
        return jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rep), tree
        )

    opt = jax.eval_shape(tx.init, params)
    p, s, b = abstract(params), abstract(opt), abstract(batch)
    m = abstract(jax.eval_shape(mon.init))
    compiled = {
        "bfloat16": train_step(jxs.autocast(loss, BF16), tx).lower(p, s, b),
        "plan, 16-bit": train_step(jxs.autocast(loss, BF16, plan=mon.plan), tx).lower(
            p, s, b
        ),
        "monitor": train_step(loss, tx, mon).lower(p, s, m, b),
    }
    for name, rows in (("sensor", "default"), ("sensor, rows=None", None)):
        sensor = (
            jxp.Sensor(loss, BF16)
            if rows == "default"
            else jxp.Sensor(loss, BF16, rows=None)
        )
        sensor._count((p, b), {})
        probes = abstract(tuple(jxp._tap.TapStats.zeros() for _ in sensor._order))
        compiled[name] = sensor._step.lower(probes, (p, b), {})
    lines, base = [], None
    for name, lowered in compiled.items():
        ks = kernels(lowered.compile().as_text())
        nbytes = sum(k.bytes for k in ks)
        base = base or (len(ks), nbytes)
        lines.append(
            f"| {model} | {name} | {len(ks)} | {len(ks) - base[0]:+d} | "
            f"{nbytes / 1e6:,.2f} | **{nbytes / base[1]:.3f}** |"
        )
    return lines


GPU_HEADER = (
    "| model | step | kernels | vs bfloat16 | MB read + written | / bfloat16 |\n"
    + "|---" * 6
    + "|"
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=tuple(SIZES), default="small")
    parser.add_argument("--quick", action="store_true", help="--size quick")
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--blocks", type=int, default=4, help="the MLP's layers")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--steps-per-round", type=int, default=None)
    parser.add_argument(
        "--gpu", action="store_true", help="kernels and bytes, deviceless H200"
    )
    cfg = parser.parse_args(argv)
    size = "quick" if cfg.quick else cfg.size
    (b, d), gpt, (rounds, n) = SIZES[size]
    rounds, n = cfg.rounds or rounds, cfg.steps_per_round or n
    print(
        f"env: jax {jax.__version__}, {jax.default_backend()} "
        f"({jax.devices()[0].device_kind}), {os.cpu_count()} CPUs, "
        f"python {platform.python_version()}, jaxscale {jxs.__version__}"
    )
    print(
        f"size {size}: mlp {cfg.blocks} blocks, width {d}, batch {b}; "
        f"gpt {gpt.describe()}"
    )
    if cfg.gpu:
        print(f"\ndeviceless XLA:GPU compile, one H200\n{GPU_HEADER}")
        for model in cfg.models:
            print("\n".join(gpu_rows(model, size, cfg.blocks)), flush=True)
        return 0
    print(f"\n{rounds} rounds of {n} steps, interleaved\n{HEADER}")
    for model in cfg.models:
        out = measure(model, size, cfg.blocks, rounds, n)
        print("\n".join(table(f"{model} ({out['sites']} sites)", out)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
