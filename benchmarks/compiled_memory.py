"""The compiled-memory ratios the `pinned` tests assert, on this jax and this CPU.

What XLA:CPU allocates for a float16 program depends on its version and on the
CPU (AVX512-FP16 or not), so ``tests/test_compiled_memory.py`` asserts these
ratios on the default environment's jax only, and the floors and the ceiling
compare like with like (``tests/test_autocast_collectives.py``). This prints the
figures for whatever jax and CPU run it, one Markdown row per model, so that the
margins the tests take can be checked on another machine or version::

    python benchmarks/compiled_memory.py

The models are the tests' own: a flax block with ``BatchNorm(axis_name=...)``
under ``vmap`` (``SyncBlock``), and a Dense stack ``tanh(h @ w + b)``. Each
figure is the temporary memory of the gradient compiled for one CPU device.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

import jaxscale as jxs

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

jax.config.update("jax_num_cpu_devices", 8)

from test_autocast_collectives import sync_block_gradient_memory, temp_bytes  # noqa: E402
from test_autocast_constructs import bias_stack  # noqa: E402


def cpu_flags() -> str:
    """The CPU's model name and whether it computes float16 natively."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown CPU"
    name = re.search(r"^model name\s*:\s*(.+)$", text, re.M)
    fp16 = "avx512_fp16" in text
    return f"{name.group(1) if name else 'unknown CPU'}, avx512_fp16 {fp16}"


NO_AXIS = "autocast, no axis_name"


def sync_block() -> dict[str, int]:
    half = lambda f: jxs.autocast(f, jnp.float16)  # noqa: E731
    same = lambda f: f  # noqa: E731
    return {
        "autocast": sync_block_gradient_memory(jnp.float32, half, "batch"),
        NO_AXIS: sync_block_gradient_memory(jnp.float32, half, None),
        "hand": sync_block_gradient_memory(jnp.float16, same, "batch"),
        "float32": sync_block_gradient_memory(jnp.float32, same, "batch"),
    }


def dense_stack() -> dict[str, int]:
    net, params, x = bias_stack()

    def memory(loss):
        return temp_bytes(jax.grad(loss), params, x)

    return {
        "autocast": memory(jxs.autocast(net)),
        "hand": memory(lambda ps, x: net(ps, x, cast_by_hand=True)),
        "promoted": memory(jxs.autocast(net, rules={"add": "promote"})),
        "float32": memory(net),
    }


def main(argv: list[str] | None = None) -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    print(f"env: jax {jax.__version__} | {cpu_flags()}")
    print(
        "| model | autocast | hand | float32 | autocast/hand | autocast/float32 | "
        "also |\n|---|---|---|---|---|---|---|"
    )
    with jax.numpy_dtype_promotion("standard"):  # flax's float16 layers promote
        sync, dense = sync_block(), dense_stack()
    rows = [
        ("sync BatchNorm block", sync, "autocast / no axis_name", NO_AXIS),
        ("Dense stack", dense, "promoted / autocast", "promoted"),
    ]
    for name, m, like, other in rows:
        auto = m["autocast"]
        ratio = m[other] / auto if other == "promoted" else auto / m[other]
        print(
            f"| {name} | {auto:,} | {m['hand']:,} | {m['float32']:,} | "
            f"{auto / m['hand']:.3f} | {auto / m['float32']:.3f} | "
            f"{like} {ratio:.3f} |"
        )


if __name__ == "__main__":
    main()
