"""Several processes, one overflow decision: dynamic scaling with jax.distributed.

Run plainly, this script is a launcher: it starts ``--processes`` copies of
itself on this machine (loopback only), each of which calls
``jax.distributed.initialize`` with a coordinator on ``127.0.0.1`` and brings
``--devices-per-process`` CPU devices to one global mesh. They train a float16
linear regression data-parallel (replicated parameters, the batch split over
every device of every process) with ``jxs.dynamic_scaling``; nothing in the
train step is specific to several processes.

At step ``--overflow-at`` only the *last* process puts an ``inf`` in its own
share of the batch. The gradients are reduced over the whole mesh, so every
process sees the overflow and skips that step, and the loss scale, the skip
count and the parameters stay identical in every process. Each worker prints a
``RESULT`` line (its scale, skipped steps and a checksum of the parameters);
the launcher checks that they agree and exits non-zero otherwise.

CPU collectives across processes go through Gloo
(``jax_cpu_collectives_implementation="gloo"``, the default in recent jax).

Run it (a few seconds)::

    python examples/multiprocess.py --steps 30
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import subprocess
import sys
import time


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="training steps")
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--devices-per-process", type=int, default=2)
    parser.add_argument(
        "--overflow-at",
        type=int,
        default=None,
        help="step (1-based) whose "
        "batch overflows in the last process only; default: the middle step",
    )
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds")
    # Internal: set by the launcher for each worker.
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}.")
    if args.processes < 1 or args.devices_per_process < 1:
        parser.error("--processes and --devices-per-process must be >= 1.")
    if args.overflow_at is None:
        args.overflow_at = (args.steps + 1) // 2
    if not 1 <= args.overflow_at <= args.steps:
        parser.error(f"--overflow-at must be in [1, --steps], got {args.overflow_at}.")
    return args


# --------------------------------------------------------------------------- #
# Worker: one process of the job.
# --------------------------------------------------------------------------- #


def worker(args: argparse.Namespace) -> None:
    import jax

    # Both before any computation: the local devices and the CPU collectives.
    jax.config.update("jax_num_cpu_devices", args.devices_per_process)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{args.port}",
        num_processes=args.processes,
        process_id=args.worker,
        initialization_timeout=int(args.timeout),
    )

    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxscale as jxs

    me, last = jax.process_index(), jax.process_count() - 1
    mesh = Mesh(np.array(jax.devices()), ("data",))  # every device of every process
    replicated, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))

    dim, rows_per_device = 16, 8
    local_rows = rows_per_device * jax.local_device_count()
    true_w = np.linspace(-1.0, 1.0, dim, dtype=np.float32)[:, None]

    def global_array(host: np.ndarray) -> jax.Array:
        """The same host value in every process -> one replicated global array."""
        return jax.make_array_from_callback(host.shape, replicated, lambda i: host[i])

    params = {"w": global_array(np.zeros((dim, 1), np.float32))}
    tx = jxs.dynamic_scaling(
        optax.adam(0.05),
        jxs.DynamicLossScale.create(init_scale=2.0**12, growth_interval=5),
    )
    opt_state = tx.init(params)  # scale and counters: replicated over the mesh

    def loss_fn(params, x, y):
        pred = x.astype(jnp.float16) @ params["w"].astype(jnp.float16)
        return jnp.mean((pred.astype(jnp.float32) - y) ** 2)

    @jax.jit
    def train_step(params, opt_state, x, y):
        loss, grads = jxs.value_and_grad(loss_fn, opt_state)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    rng = np.random.default_rng(1000 + me)  # every process has its own data
    skipped_at = []
    for step in range(1, args.steps + 1):
        x = rng.normal(size=(local_rows, dim)).astype(np.float32)
        y = x @ true_w
        if step == args.overflow_at and me == last:
            x[1, 3] = np.inf  # this process's data only
        gx = jax.make_array_from_process_local_data(split, x)
        gy = jax.make_array_from_process_local_data(split, y)
        params, opt_state, loss = train_step(params, opt_state, gx, gy)
        if not bool(opt_state.last_step_finite):  # replicated: readable anywhere
            skipped_at.append(step)
        if me == 0 and (step == 1 or step % 10 == 0 or step == args.steps):
            print(
                f"step {step:4d}  loss {float(loss):9.5f}  loss scale "
                f"{float(opt_state.loss_scale.loss_scale):g}  skipped "
                f"{int(opt_state.skipped_steps)}",
                flush=True,
            )
    w = np.asarray(params["w"])  # replicated, so every process can read it
    result = {
        "process": me,
        "devices": jax.device_count(),
        "loss_scale": float(opt_state.loss_scale.loss_scale),
        "skipped_steps": int(opt_state.skipped_steps),
        "skipped_at": skipped_at,
        "params_sha256": hashlib.sha256(w.tobytes()).hexdigest()[:16],
        "params_sum": float(np.sum(w, dtype=np.float64)),
    }
    print("RESULT " + json.dumps(result), flush=True)
    jax.distributed.shutdown()


# --------------------------------------------------------------------------- #
# Launcher.
# --------------------------------------------------------------------------- #


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args: argparse.Namespace) -> int:
    port = free_port()
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)  # the workers set their own device count
    base = [
        sys.executable,
        os.path.abspath(__file__),
        "--steps", str(args.steps),
        "--processes", str(args.processes),
        "--devices-per-process", str(args.devices_per_process),
        "--overflow-at", str(args.overflow_at),
        "--timeout", str(args.timeout),
        "--port", str(port),
    ]  # fmt: skip
    print(
        f"launching {args.processes} processes x {args.devices_per_process} CPU "
        f"devices on 127.0.0.1:{port}; step {args.overflow_at} overflows in "
        f"process {args.processes - 1} only"
    )
    start = time.perf_counter()
    procs = [
        subprocess.Popen(
            [*base, "--worker", str(i)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for i in range(args.processes)
    ]
    outputs = []
    try:
        for proc in procs:
            remaining = max(1.0, args.timeout - (time.perf_counter() - start))
            outputs.append(proc.communicate(timeout=remaining))
    except subprocess.TimeoutExpired:
        for proc in procs:
            proc.kill()
        print(f"error: the workers did not finish within {args.timeout:g} s")
        return 1
    results = []
    for i, (proc, (out, err)) in enumerate(zip(procs, outputs, strict=True)):
        lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            print(f"error: worker {i} failed (exit {proc.returncode}):\n{out}{err}")
            return 1
        log = [ln for ln in out.splitlines() if not ln.startswith(("RESULT", "[Gloo]"))]
        print("\n".join(log))
        results.append(json.loads(lines[-1][len("RESULT ") :]))
    for r in results:
        print(
            f"process {r['process']}: loss scale {r['loss_scale']:g}, "
            f"{r['skipped_steps']} skipped (steps {r['skipped_at']}), "
            f"params sha256 {r['params_sha256']}"
        )
    keys = ("loss_scale", "skipped_steps", "skipped_at", "params_sha256")
    agree = all(r[k] == results[0][k] for r in results for k in keys)
    if not agree or results[0]["skipped_at"] != [args.overflow_at]:
        print("error: the processes disagree, or the overflow was not skipped")
        return 1
    print(
        f"all {len(results)} processes agree: step {args.overflow_at} skipped "
        f"everywhere, {time.perf_counter() - start:.1f} s"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        worker(args)
        return 0
    return launch(args)


if __name__ == "__main__":
    sys.exit(main())
