"""Compressed gradient reduction: error against the device count, bytes on the wire.

(a) The error of the averaged gradient against an exact float64 mean, for 8, 16,
32 and 64 CPU devices (each count in its own process, started with
``XLA_FLAGS=--xla_force_host_platform_device_count=N``), for ``lax.pmean`` in
float32, a 16-bit ``lax.psum`` (whatever XLA:CPU sums it in), a float16 ring
emulated in NumPy (the partial sum rounded at every hop), and ``jxs.reduce_mean``
with an all-to-all in float16 (no scales), bfloat16 blocks and float8_e4m3fn
blocks. Gradients with a realistic spread: log-normal magnitudes, each device's
copy differing by heavy-tailed (Student-t) noise. Error: ``|out - exact|_2 /
|exact|_2``.

(b) Bytes each device sends per step, read from the compiled HLO of a lowered
(never run) step: a GPT-2-small-sized gradient (124,439,808 float32 values) and a
small one, per wire dtype. Each collective counts as sent: all-to-all and
all-gather ``(n - 1) / n`` of their buffer, all-reduce ``2 (n - 1) / n`` (a
ring). XLA:CPU widens bfloat16 and float8 collectives (to float32 and float16),
so bytes are given both as compiled here and at the wire dtype (what XLA:GPU
sends).

    python benchmarks/wire.py                       # 8, 16, 32, 64 devices
    python benchmarks/wire.py --devices 8 --size 4096 --small-only   # quick
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import numpy as np

ROWS = (
    "psum f32",
    "psum f16 (16-bit psum, as XLA:CPU sums it)",
    "ring f16 (emulated, rounded per hop)",
    "all-to-all f16 + f32 sum",
    "all-to-all bf16 blocks",
    "all-to-all float8 e4m3 blocks",
)
GPT2_SMALL = 124_439_808
SMALL = 1_000_000
WIRES = ("float32", "bfloat16", "float16", "float8_e4m3fn")


def gradients(n: int, size: int, seed: int = 0) -> np.ndarray:
    """``f32[n, size]``: a common log-normal gradient, each device's copy
    perturbed by heavy-tailed noise."""
    rng = np.random.default_rng(seed)
    common = np.exp(rng.normal(-8.0, 2.0, size)) * rng.choice([-1.0, 1.0], size)
    noise = 0.5 * rng.standard_t(3, (n, size))
    return (common * (1.0 + noise)).astype(np.float32)


def ring_f16(x: np.ndarray) -> np.ndarray:
    acc = x[0].astype(np.float16)
    for row in x[1:]:
        acc = (acc.astype(np.float32) + row.astype(np.float16)).astype(np.float16)
    return acc.astype(np.float64) / len(x)


def _mapped(fn, n):
    import jax
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:n]), ("data",))
    return jax.jit(
        jax.shard_map(
            lambda g: fn(g[0]),
            mesh=mesh,
            in_specs=P("data"),
            out_specs=P(),
            check_vma=False,
        )
    )


def _reductions(n):
    import jax.numpy as jnp
    from jax import lax

    import jaxscale as jxs

    return {
        ROWS[0]: lambda g: lax.pmean(g, "data"),
        ROWS[1]: lambda g: (
            lax.psum(g.astype(jnp.float16), "data").astype(jnp.float32) / np.float32(n)
        ),
        ROWS[3]: lambda g: jxs.reduce_mean(
            g, "data", wire_dtype=jnp.float16, block_size=None
        ),
        ROWS[4]: lambda g: jxs.reduce_mean(g, "data", wire_dtype=jnp.bfloat16),
        ROWS[5]: lambda g: jxs.reduce_mean(g, "data", wire_dtype=jnp.float8_e4m3fn),
    }


def worker_error(n: int, size: int) -> dict[str, float]:
    import jax.numpy as jnp

    x = gradients(n, size)
    exact = x.astype(np.float64).mean(0)
    norm = np.linalg.norm(exact)
    out = {}
    for row, fn in _reductions(n).items():
        got = np.asarray(_mapped(fn, n)(jnp.asarray(x)), np.float64)
        out[row] = float(np.linalg.norm(got - exact) / norm)
    out[ROWS[2]] = float(np.linalg.norm(ring_f16(x) - exact) / norm)
    return out


WIRE_KINDS = ("all-to-all", "all-reduce", "all-gather")


def sent_bytes(hlo: str, n: int, wire_itemsize: int | None) -> float:
    """Bytes a device sends per step for the collectives of ``hlo``: at the
    dtypes compiled, or with the gradient-sized buffers (the largest; the block
    scales are ``block_size`` times smaller and stay float32) at
    ``wire_itemsize`` bytes per value."""
    from jaxscale._hlo import DTYPE_BYTES
    from jaxscale._hlo_collectives import collectives

    counts: dict[tuple[str, str, str], int] = {}  # a combined collective: one
    for c in collectives(hlo):  # buffer per dtype
        if c.kind in WIRE_KINDS:
            key = (c.instruction, c.kind, c.dtype)
            counts[key] = counts.get(key, 0) + int(np.prod(c.shape))
    largest = max(counts.values(), default=0)
    total = 0.0
    for (_, kind, dtype), count in counts.items():
        share = 2 * (n - 1) / n if kind == "all-reduce" else (n - 1) / n
        size = DTYPE_BYTES[dtype]
        if wire_itemsize is not None and count * 2 > largest:
            size = wire_itemsize
        total += share * count * size
    return total


def worker_bytes(n: int, sizes: list[int]) -> dict[str, list[float]]:
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxscale as jxs

    mesh = Mesh(np.array(jax.devices()[:n]), ("data",))
    out = {}
    for size in sizes:
        g = jax.ShapeDtypeStruct(
            (n, size), jnp.float32, sharding=NamedSharding(mesh, P("data"))
        )
        for wire in WIRES:
            dtype = jnp.dtype(wire)
            if wire == "float32":
                fn = lambda x: jax.lax.pmean(x, "data")  # noqa: E731
            else:
                fn = lambda x, d=dtype: jxs.reduce_mean(x, "data", wire_dtype=d)  # noqa: E731
            hlo = _mapped(fn, n).lower(g).compile().as_text()
            out[f"{size}/{wire}"] = [
                sent_bytes(hlo, n, None),
                sent_bytes(hlo, n, dtype.itemsize),
            ]
    return out


def spawn(args: list[str], n: int) -> dict:
    env = dict(os.environ)
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={n}"
    ).strip()
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run(
        [sys.executable, __file__, *args], env=env, capture_output=True, text=True
    )
    if proc.returncode:
        raise RuntimeError(proc.stdout + proc.stderr)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", default="8,16,32,64", help="device counts")
    parser.add_argument("--size", type=int, default=1 << 16, help="values per device")
    parser.add_argument("--bytes-devices", type=int, default=8)
    parser.add_argument("--small-only", action="store_true", help="skip GPT-2 size")
    parser.add_argument("--worker", choices=["error", "bytes"], help=argparse.SUPPRESS)
    parser.add_argument("--n", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    sizes = [SMALL] if args.small_only else [SMALL, GPT2_SMALL]
    if args.worker == "error":
        print(json.dumps(worker_error(args.n, args.size)))
        return
    if args.worker == "bytes":
        print(json.dumps(worker_bytes(args.n, sizes)))
        return

    import jax

    counts = [int(c) for c in args.devices.split(",")]
    errors = {
        n: spawn(["--worker", "error", "--n", str(n), "--size", str(args.size)], n)
        for n in counts
    }
    print(f"jax {jax.__version__}, {args.size} values per device, relative L2 error")
    print("against the exact float64 mean (ratio: to the 8-or-fewest-device error)\n")
    print("| reduction | " + " | ".join(f"{n} devices" for n in counts) + " |")
    print("|---|" + "---|" * len(counts))
    for row in ROWS:
        cells = [errors[n][row] for n in counts]
        print(
            f"| {row} | "
            + " | ".join(f"{c:.2e} ({c / cells[0]:.2f}x)" for c in cells)
            + " |"
        )

    n = args.bytes_devices
    extra = [] if args.small_only else ["--size", str(args.size)]
    found = spawn(
        [
            "--worker",
            "bytes",
            "--n",
            str(n),
            *(["--small-only"] if args.small_only else []),
            *extra,
        ],
        n,
    )
    print(f"\nbytes sent per device per step, {n} devices (ratio to float32 pmean)\n")
    print("| gradient | wire | compiled on XLA:CPU | at the wire dtype |")
    print("|---|---|---|---|")
    for size in sizes:
        base = found[f"{size}/float32"][0]
        for wire in WIRES:
            cpu, at_wire = found[f"{size}/{wire}"]
            label = "pmean float32" if wire == "float32" else f"reduce_mean {wire}"
            print(
                f"| {size:,} f32 | {label} | {cpu / 1e6:.1f} MB ({cpu / base:.3f}) | "
                f"{at_wire / 1e6:.1f} MB ({at_wire / base:.3f}) |"
            )


if __name__ == "__main__":
    main()
