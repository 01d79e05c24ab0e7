"""Step time with and without dynamic loss scaling on an 8-device CPU mesh.

Three multi-device set-ups of one float16 MLP training step, each timed bare
(``optax.adam``) and scaled (``jxs.dynamic_scaling(optax.adam(...))`` with
``jxs.value_and_grad``), all six variants interleaved in one process (the order
rotates every round) and reported as medians over rounds:

* ``dp``: ``jit``, replicated parameters, the batch split over the 8 devices;
  XLA all-reduces the gradients, the finite check then runs on replicated
  gradients.
* ``fsdp``: ``jit``, every kernel split over the 8 devices (and the batch):
  each device checks its own block, XLA adds one scalar all-reduce.
* ``shard_map``: ``jax.shard_map`` with ``check_vma=False``; the bare step
  averages the gradients itself (``lax.pmean``), and so does the scaled one,
  built with ``axis_name="data"`` (the same ``pmean`` plus one scalar ``pmin``).

It also prints, per set-up, the collectives of the compiled bare and scaled
steps (kind and number of elements), so the extra communication is visible.

The 8 CPU devices are requested before jax starts a backend, so run it as a
script::

    python benchmarks/multidevice.py                     # quick defaults
    python benchmarks/multidevice.py --rounds 15 --steps-per-round 10
"""

from __future__ import annotations

import jax

jax.config.update("jax_num_cpu_devices", 8)  # before any backend starts

import argparse  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from collections import Counter  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxscale as jxs  # noqa: E402

F16 = jnp.float16
LR = 1e-4
# Finite float16 backward passes at this scale: every timed step is applied.
INIT_SCALE = 2.0**10
SETUPS = ("dp", "fsdp", "shard_map")


# --------------------------------------------------------------------------- #
# Model: float32 master weights, float16 compute, float32 loss.
# --------------------------------------------------------------------------- #


def init_params(width: int, depth: int, classes: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    sizes = [width] * (depth + 1) + [classes]
    return [
        {
            "w": (rng.standard_normal((a, b)) * np.sqrt(2.0 / a)).astype(np.float32),
            "b": np.zeros((b,), np.float32),
        }
        for a, b in zip(sizes[:-1], sizes[1:], strict=True)
    ]


def loss_fn(params: list[dict], batch: tuple[jax.Array, jax.Array]) -> jax.Array:
    x, y = batch
    h = x.astype(F16)
    for i, layer in enumerate(params):
        h = h @ layer["w"].astype(F16) + layer["b"].astype(F16)[None]
        if i < len(params) - 1:
            h = jax.nn.relu(h)
    logits = h.astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


# --------------------------------------------------------------------------- #
# The variants.
# --------------------------------------------------------------------------- #


def param_specs(params: list[dict], setup: str) -> list[dict]:
    if setup != "fsdp":
        return jax.tree.map(lambda _: P(), params)

    # Kernels split on their input dimension, biases and the (small) head's
    # kernel on their last one when it divides evenly.
    def spec(x):
        for axis, n in enumerate(x.shape):
            if n % 8 == 0:
                return P(*([None] * axis), "data")
        return P()

    return jax.tree.map(spec, params)


def make_variants(
    setup: str, mesh: jax.sharding.Mesh, host_params: list[dict]
) -> dict[str, tuple[Callable[..., Any], Callable[[], Any]]]:
    """``{"bare"|"scaled": (jitted step, fresh (params, opt_state) factory)}``."""
    specs = param_specs(host_params, setup)
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
    adam = optax.adam(LR)
    scale = jxs.DynamicLossScale.create(init_scale=INIT_SCALE, growth_interval=10**9)
    if setup == "shard_map":
        scaled_tx = jxs.dynamic_scaling(optax.adam(LR), scale, axis_name="data")
    else:
        scaled_tx = jxs.dynamic_scaling(optax.adam(LR), scale)

    def bare(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        if setup == "shard_map":
            grads = lax.pmean(grads, "data")
        updates, opt_state = adam.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    def scaled(params, opt_state, batch):
        loss, grads = jxs.value_and_grad(loss_fn, opt_state)(params, batch)
        if setup == "shard_map":
            grads = lax.pmean(grads, "data")
        updates, opt_state = scaled_tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    def wrap(fn):
        step = fn
        if setup == "shard_map":

            def per_device(params, opt_state, batch):
                params, opt_state, loss = fn(params, opt_state, batch)
                return params, opt_state, loss[None]  # one loss per device

            step = jax.shard_map(
                per_device,
                mesh=mesh,
                in_specs=(P(), P(), P("data")),
                out_specs=(P(), P(), P("data")),
                check_vma=False,
            )
        return jax.jit(step, donate_argnums=(0, 1))

    def fresh(tx):
        def factory():
            params = jax.tree.map(jax.device_put, host_params, shardings)
            return params, tx.init(params)

        return factory

    return {
        "bare": (wrap(bare), fresh(adam)),
        "scaled": (wrap(scaled), fresh(scaled_tx)),
    }


def make_batch(mesh, batch_size: int, width: int, classes: int, seed: int = 1):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch_size, width)).astype(np.float32)
    y = rng.integers(0, classes, batch_size).astype(np.int32)
    split = NamedSharding(mesh, P("data"))
    return jax.device_put(x, split), jax.device_put(y, split)


# --------------------------------------------------------------------------- #
# Collectives in the compiled step.
# --------------------------------------------------------------------------- #


def collectives(step, params, opt_state, batch) -> Counter:
    """``Counter`` of ``(kind, elements)`` over the collectives of the step, read
    by ``jxs.diagnostics.CollectiveReport``: a combined all-reduce counts once,
    with the elements of all its arrays."""
    compiled = step.lower(params, opt_state, batch).compile()
    report = jxs.diagnostics.CollectiveReport.from_hlo(compiled)
    per_instruction: dict[tuple[str, str, str], int] = {}
    for c in report.collectives:
        key = (c.computation, c.name.split("[")[0], c.kind)
        per_instruction[key] = per_instruction.get(key, 0) + math.prod(c.shape)
    return Counter((kind, n) for (_, _, kind), n in per_instruction.items())


def describe(found: Counter) -> str:
    if not found:
        return "none"
    return ", ".join(
        f"{n}x {kind}[{elems}]" for (kind, elems), n in sorted(found.items())
    )


# --------------------------------------------------------------------------- #
# Interleaved timing.
# --------------------------------------------------------------------------- #


def time_interleaved(variants: dict, batch, rounds: int, steps: int, warmup: int = 3):
    """Per-round mean step times of every variant; the order rotates.

    Returns ``({"wall"|"cpu": {variant: [seconds per step, one per round]}},
    skipped steps per scaled variant)``. ``cpu`` is the CPU time of this process
    (every device thread), which other processes on a shared machine disturb
    less than the wall time.
    """
    names = list(variants)
    carry = {}
    for name, (step, fresh) in variants.items():
        p, s = fresh()
        for _ in range(warmup):
            p, s, out = step(p, s, batch)
        jax.block_until_ready((p, s, out))
        carry[name] = (p, s)
    times = {"wall": {n: [] for n in names}, "cpu": {n: [] for n in names}}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            step, _ = variants[name]
            p, s = carry[name]
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(steps):
                p, s, out = step(p, s, batch)
            jax.block_until_ready((p, s, out))
            times["wall"][name].append((time.perf_counter() - t0) / steps)
            times["cpu"][name].append((time.process_time() - c0) / steps)
            carry[name] = (p, s)
    skipped = {
        name: int(carry[name][1].skipped_steps)
        for name in names
        if name.endswith("/scaled")
    }
    return times, skipped


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=9, help="timed rounds")
    parser.add_argument(
        "--steps-per-round", type=int, default=5, help="steps per variant per round"
    )
    parser.add_argument("--setup", choices=[*SETUPS, "all"], default="all")
    parser.add_argument("--width", type=int, default=512, help="MLP width")
    parser.add_argument("--depth", type=int, default=4, help="hidden layers")
    parser.add_argument("--batch-size", type=int, default=256, help="global batch")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.steps_per_round < 1:
        parser.error("`--rounds` and `--steps-per-round` must be >= 1.")
    if args.batch_size % 8 or args.width % 8:
        parser.error("`--batch-size` and `--width` must be multiples of 8.")

    devices = jax.devices()
    mesh = jax.make_mesh((len(devices),), ("data",), axis_types=(AxisType.Auto,))
    classes = 16
    host_params = init_params(args.width, args.depth, classes)
    n_params = sum(x.size for x in jax.tree.leaves(host_params))
    batch = make_batch(mesh, args.batch_size, args.width, classes)
    print(
        f"jax {jax.__version__}, optax {optax.__version__}, jaxscale "
        f"{jxs.__version__}; {len(devices)} x {devices[0].device_kind} devices "
        f"(backend {jax.default_backend()})"
    )
    print(
        f"MLP {args.depth}x{args.width}, {n_params:,} params, float16 compute; "
        f"global batch {args.batch_size}; {args.rounds} rounds x "
        f"{args.steps_per_round} steps per variant, interleaved"
    )

    setups = SETUPS if args.setup == "all" else (args.setup,)
    variants = {}
    for setup in setups:
        for kind, (step, fresh) in make_variants(setup, mesh, host_params).items():
            variants[f"{setup}/{kind}"] = (step, fresh)
    comms = {}
    for name, (step, fresh) in variants.items():
        p, s = fresh()
        comms[name] = collectives(step, p, s, batch)
    times, skipped = time_interleaved(
        variants, batch, args.rounds, args.steps_per_round
    )

    print()
    print("collectives of each compiled step (count x kind[elements]):")
    for name in variants:
        print(f"  {name:<18}{describe(comms[name])}")
    for clock in ("wall", "cpu"):
        report(clock, times[clock], setups, skipped)


def report(clock: str, times: dict, setups, skipped: dict) -> None:
    print(f"\n{clock} time per step, ms: median (min, max) over rounds")
    for name, t in times.items():
        print(
            f"  {name:<18}{statistics.median(t) * 1e3:9.2f}  "
            f"({min(t) * 1e3:.2f}, {max(t) * 1e3:.2f})"
        )
    print(f"{clock} scaled/bare: ratio of the medians; median [quartiles] of the")
    print("  per-round ratios (a set-up's bare and scaled run in the same round)")
    for setup in setups:
        bare, scaled = times[f"{setup}/bare"], times[f"{setup}/scaled"]
        ratio = statistics.median(scaled) / statistics.median(bare)
        paired = [s / b for s, b in zip(scaled, bare, strict=True)]
        q1, q2, q3 = (
            statistics.quantiles(paired, n=4) if len(paired) > 1 else paired * 3
        )
        print(
            f"  {setup:<10} {ratio:.3f} ({100 * (ratio - 1):+.1f}%); per round "
            f"{q2:.3f} [{q1:.3f}, {q3:.3f}]; {skipped[f'{setup}/scaled']} skipped"
        )


if __name__ == "__main__":
    main()
