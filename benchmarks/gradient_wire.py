"""What a jitted autocast step sends across devices for its gradients, by
``gradient_dtype``: read from the compiled program with
``jxs.diagnostics.collective_report`` (nothing runs).

A two-matmul MLP (``--dim``, hidden ``4 * dim``, biases), the batch split over a
``data`` axis of 8 devices, the weights replicated (data parallel) or split by
rows (FSDP), ``jax.grad`` of ``jxs.autocast(loss, dtype, gradient_dtype=...)``
with the gradients laid out as the weights. Rows: the collectives that reduce
gradients (all-reduce, reduce-scatter) with their dtypes and bytes per device,
and the ratio of those bytes to the float32 program's.

    python benchmarks/gradient_wire.py                 # 8 CPU devices
    python benchmarks/gradient_wire.py --target h200   # 8 H200s, no GPU needed
                                                       # (pip install jax-cuda12-plugin)
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling hlo_account


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", choices=("h100", "h200"), default=None)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=512)
    args = parser.parse_args(argv)
    if args.target is None:
        os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxscale as jxs

    if args.target is None:
        mesh = jax.make_mesh((8,), ("data",), devices=jax.devices("cpu")[:8])
        where = f"XLA:CPU, 8 devices, jax {jax.__version__}"
    else:
        import hlo_account

        mesh = hlo_account.gpu_mesh(args.target, (8,), ("data",))
        where = f"XLA:GPU deviceless, 8x {args.target.upper()}, jax {jax.__version__}"

    d, h = args.dim, 4 * args.dim

    def loss(p, x):
        hidden = jax.nn.relu(x @ p["w1"] + p["b1"][None])
        return jnp.mean((hidden @ p["w2"]).astype(jnp.float32) ** 2)

    def account(fun, weights):
        spec = {"w1": weights, "b1": P(), "w2": weights}
        shard = {k: NamedSharding(mesh, s) for k, s in spec.items()}
        shapes = {"w1": (d, h), "b1": (h,), "w2": (h, d)}
        p = {
            k: jax.ShapeDtypeStruct(s, jnp.float32, sharding=shard[k])
            for k, s in shapes.items()
        }
        x = jax.ShapeDtypeStruct(
            (args.batch, d), jnp.float32, sharding=NamedSharding(mesh, P("data"))
        )
        step = jax.jit(jax.grad(fun), out_shardings=shard)
        report = jxs.diagnostics.collective_report(step)(p, x)
        grads = [
            c
            for c in report.collectives
            if c.kind in ("all-reduce", "reduce-scatter") and c.bytes > 64
        ]
        return grads

    print(f"gradient collectives of one step ({where}; MLP {d}-{h}-{d})\n")
    print(f"{'layout':6} {'autocast':9} {'gradient_dtype':15} {'bytes':>10} "
          f"{'vs f32':>7}  collectives")  # fmt: skip
    for layout, weights in (("DP", P()), ("FSDP", P("data"))):
        base = sum(c.bytes for c in account(loss, weights))
        runs = [("float32", None, loss)]
        for dt in (jnp.float16, jnp.bfloat16):
            name = np.dtype(dt).name
            for gd in (None, dt):
                label = "float32" if gd is None else name
                runs.append((name, label, jxs.autocast(loss, dt, gradient_dtype=gd)))
        for name, label, fun in runs:
            found = account(fun, weights)
            total = sum(c.bytes for c in found)
            kinds = ", ".join(
                f"{c.kind} {c.dtype}[{','.join(map(str, c.shape))}]" for c in found
            )
            print(
                f"{layout:6} {name:9} {label or '-':15} {total / 2**20:8.2f}MB "
                f"{total / base:7.2f}  {kinds}"
            )


if __name__ == "__main__":
    main()
