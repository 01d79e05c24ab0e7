"""Kernels and bytes of a compiled program, read from its optimized HLO text.

The accounting that ``benchmarks/step_account.py`` (a step with and without
``dynamic_scaling``), ``benchmarks/gpu.py`` (the same account of its steps on a
GPU) and ``benchmarks/float8_passes.py`` share: each kernel on the executed path
(fusions, GEMMs, copies, sorts; the callees of calls, conditionals and loops in
their place) with the bytes it reads (its operands) and writes (its result),
XLA's own convention; the difference of two programs; and, with ``--target``,
the deviceless XLA:GPU compilation that makes such a program without a GPU
(for one GPU or several: ``gpu_mesh(target, (8,), ("data",))``, the topology
``1x1x8``). The parser itself is ``jaxscale._hlo``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run from anywhere, jaxscale from this checkout
    sys.path.insert(0, str(ROOT))
# The parser lives in the package (jxs.diagnostics.collective_report reads
# collectives with it); the benchmarks import it from there.
from jaxscale._hlo import (  # noqa: E402 (after the path)
    Account,
    Kernel,
    categories,
    difference,
    kernels,
)

__all__ = [
    "TABLE_HEADER",
    "Account",
    "Kernel",
    "abstract_for",
    "categories",
    "difference",
    "gpu_mesh",
    "kernels",
    "row",
]


def row(acc: Account) -> str:
    """One Markdown row of the summary table."""
    return (
        f"| {acc.model} | {acc.n_params:,} | {acc.leaves} | {len(acc.bare)} -> "
        f"{len(acc.ours)} ({acc.extra_kernels:+d}) | {acc.bytes_per_param:+.2f} |"
    )


TABLE_HEADER = (
    "| model | params | leaves | kernels, bare -> dynamic_scaling | "
    "extra bytes per parameter |\n|---|---|---|---|---|"
)


# --------------------------------------------------------------------------- #
# The steps, compiled on the default backend or for a GPU without one.
# --------------------------------------------------------------------------- #

# Deviceless targets: XLA:GPU's device description of each GPU (the fields
# its fusion and cost model passes read), for ``--target``.
_GPU_TARGETS = {
    "h100": ("NVIDIA H100 80GB HBM3", 132, 3352320000000, 52428800, 84929347584),
    "h200": ("NVIDIA H200", 132, 4800000000000, 62914560, 150754820096),
}


def _target_config(target: str) -> str:
    name, cores, bandwidth, l2, memory = _GPU_TARGETS[target]
    return f"""gpu_device_info {{
  threads_per_block_limit: 1024 threads_per_warp: 32
  shared_memory_per_block: 49152 shared_memory_per_core: 233472
  threads_per_core_limit: 2048 core_count: {cores} fpus_per_core: 128
  block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535
  memory_bandwidth: {bandwidth} l2_cache_size: {l2} clock_rate_ghz: 1.98
  device_memory_size: {memory} shared_memory_per_block_optin: 232448
  cuda_compute_capability {{ major: 9 }}
  registers_per_core_limit: 65536 registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 7 }}
runtime_version {{ major: 12 minor: 8 }}
device_description_str: "{name}"
"""


def gpu_mesh(
    target: str, shape: tuple[int, ...] = (1,), axis_names: tuple[str, ...] = ("x",)
) -> Any:
    """A mesh of deviceless GPUs of ``target`` (``"h100"``, ``"h200"``): the
    topology ``1x1xN`` for ``N = prod(shape)`` GPUs (``1x1x8``: one host of 8),
    shaped ``shape`` with ``axis_names``; no GPU needed (jax-cuda12-plugin is)."""
    import math

    # A machine without CUDA: the plugin's version check would fail before the
    # deviceless compiler is reached (it needs no CUDA library).
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    from jax.experimental import topologies

    topo = topologies.get_topology_desc(
        platform="cuda",
        target_config=_target_config(target),
        topology=f"1x1x{math.prod(shape)}",
    )
    return topologies.make_mesh(topo=topo, mesh_shape=shape, axis_names=axis_names)


def abstract_for(target: str | None, devices: int = 1) -> Callable[[Any], Any]:
    """A function that turns a pytree of arrays into what ``lower`` compiles
    for ``target``: the arrays themselves on the default backend, or
    ``ShapeDtypeStruct``s replicated on a deviceless topology of ``devices``
    GPUs (``gpu_mesh``; shard them with its mesh for more)."""
    import jax

    if target is None:
        return lambda tree: tree
    mesh = gpu_mesh(target, (devices,), ("x",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    return lambda tree: jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), tree
    )
