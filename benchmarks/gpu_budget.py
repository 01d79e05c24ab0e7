"""The GPU budget, checked without a GPU: autocast's step against the hand-cast one.

XLA:GPU compiles each step for one NVIDIA H200 (or eight, ``--devices 8``)
without a GPU (``jax-cuda12-plugin``, a deviceless topology:
``hlo_account.gpu_mesh``), and this prints, side by side, what the compiled
programs need: temporary memory (``memory_analysis``), the bytes their kernels
read and write and the kernel count (``jaxscale._hlo.kernels``). The model is
``benchmarks/gpu.py``'s GPT-2-small-shaped decoder (d 768, 12 heads, MLP 3072,
vocabulary 50304, sequence 1024, batch 8; ``--layers`` blocks, 2 by default)
with its bare AdamW step (``jax.value_and_grad``, donated buffers):

- *hand*: the model written with ``dtype=`` 16-bit (scores ``q.k`` in 16 bits,
  cast to float32 for the mask and the softmax: torch's recipe);
- *autocast*: the float32 model under ``jxs.autocast``;
- *autocast* rules: ``fuse_attention=False``, attention by autocast's rules
  (the float16 scale rule); *fused*: the default, the written-out causal
  attention recognised and run as cuDNN's fused attention on the CUDA lowering;
- *jnn* rows: the same model with its attention through
  ``jax.nn.dot_product_attention(..., is_causal=True)``: hand-cast (16-bit q, k,
  v: jax's XLA form, as jax picks it) against autocast (cuDNN's fused
  attention on the CUDA lowering).

The budget (one place, :data:`BUDGET`): autocast's temporary memory at most
1.02x and its kernel bytes at most 1.03x the hand-cast step's, in float16 and
bfloat16. ``--devices 8`` compiles the data-parallel step (batch split over 8
H200s) and lists the dtypes of the gradient all-reduces: none may be 16-bit.
``tests/test_gpu_budget.py`` runs it and asserts the budget (a `pinned` test:
one XLA's figures).

    python benchmarks/gpu_budget.py                 # GPT-2-small, 2 blocks
    python benchmarks/gpu_budget.py --devices 8     # + gradients across 8 H200s
    python benchmarks/gpu_budget.py --tiny          # small shapes, seconds
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import flax.linen as nn  # noqa: E402
import gpu as G  # noqa: E402 (benchmarks/gpu.py: the model)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from hlo_account import gpu_mesh  # noqa: E402

import jaxscale as jxs  # noqa: E402
from jaxscale._hlo import collectives, kernels  # noqa: E402

# The budget: autocast / hand-cast, per compiled step.
BUDGET = {"temp": 1.02, "bytes": 1.03}
F16, BF16, F32 = jnp.float16, jnp.bfloat16, jnp.float32


def _fused_call(self: Any, x: jax.Array) -> jax.Array:
    """``gpu.Attention`` with ``jax.nn.dot_product_attention`` (causal)."""
    b, t, d = x.shape
    hd = d // self.heads
    qkv = nn.Dense(3 * d, dtype=self.dtype, name="qkv")(x)
    qkv = qkv.reshape(b, t, 3, self.heads, hd)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    y = jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(b, t, d)
    return nn.Dense(d, dtype=self.dtype, name="proj")(y)


@contextlib.contextmanager
def attention(kind: str) -> Any:
    """``gpu.Attention`` written out (``"written"``) or through jax.nn."""
    saved = G.Attention.__call__
    if kind == "jnn":
        G.Attention.__call__ = nn.compact(_fused_call)
    try:
        yield
    finally:
        G.Attention.__call__ = saved


def loss_of(size: G.Size, dtype: Any, variant: str, fuse: bool = True) -> Any:
    if variant == "hand":
        net = G.GPT(size, dtype)

        def loss(params, batch):
            tokens, labels = batch
            cast = jax.tree.map(lambda p: p.astype(dtype), params)
            return G.cross_entropy(net.apply(cast, tokens), labels)

        return net, loss
    net = G.GPT(size, F32)

    def loss32(params, batch):
        tokens, labels = batch
        return G.cross_entropy(net.apply(params, tokens), labels)

    return net, jxs.autocast(loss32, dtype, fuse_attention=fuse)


@dataclasses.dataclass
class Compiled:
    temp: int
    bytes: int
    kernels: int
    cudnn: int
    hlo: str


def compile_step(
    size: G.Size, dtype: Any, variant: str, devices: int, fuse: bool = True
) -> Compiled:
    """The bare AdamW step, compiled for ``devices`` deviceless H200s (the batch
    split over them)."""
    net, loss = loss_of(size, dtype, variant, fuse)
    tokens = jnp.zeros((size.batch, size.seq), jnp.int32)
    params = jax.eval_shape(lambda: net.init(jax.random.key(0), tokens[:1]))
    tx = optax.adamw(1e-4)
    opt = jax.eval_shape(tx.init, params)

    def step(p, s, batch):
        value, grads = jax.value_and_grad(loss)(p, batch)
        updates, s = tx.update(grads, s, p)
        return optax.apply_updates(p, updates), s, value

    mesh = gpu_mesh("h200", (devices,), ("data",))
    P = jax.sharding.PartitionSpec
    rep = jax.sharding.NamedSharding(mesh, P())
    split = jax.sharding.NamedSharding(mesh, P("data"))

    def spec(tree: Any, sharding: Any) -> Any:
        return jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), tree
        )

    batch = spec((tokens, tokens), split)
    lowered = jax.jit(step, donate_argnums=(0, 1)).lower(
        spec(params, rep), spec(opt, rep), batch
    )
    compiled = lowered.compile()
    hlo = compiled.as_text()
    ks = kernels(hlo)
    return Compiled(
        compiled.memory_analysis().temp_size_in_bytes,
        sum(k.bytes for k in ks),
        len(ks),
        hlo.count("__cudnn$fmha"),
        hlo,
    )


def sixteen_bit_gradient_reductions(hlo: str) -> list[str]:
    """The 16-bit all-reduces and reduce-scatters of a compiled step."""
    return [
        f"{op.kind} {op.dtype}{list(op.shape)}"
        for op in collectives(hlo)
        if op.kind in ("all-reduce", "reduce-scatter") and op.dtype in ("f16", "bf16")
    ]


# (dtype, attention, fuse_attention) of each row.
VARIANTS = (
    (F16, "written", False),
    (BF16, "written", False),
    (F16, "written", True),
    (BF16, "written", True),
    (F16, "jnn", True),
)


def rows(
    size: G.Size, devices: int, variants: Any = VARIANTS, log: Any = print
) -> list[dict[str, Any]]:
    """Each variant: hand-cast and autocast compiled, ratios."""
    out, hands = [], {}
    for dtype, attn, fuse in variants:
        name = jnp.dtype(dtype).name
        t0 = time.time()
        with attention(attn):
            if (name, attn) not in hands:
                hands[name, attn] = compile_step(size, dtype, "hand", devices)
            hand = hands[name, attn]
            auto = compile_step(size, dtype, "autocast", devices, fuse)
        row = {
            "dtype": name,
            "attention": attn,
            "fused": fuse,
            "hand": hand,
            "autocast": auto,
            "temp": auto.temp / hand.temp,
            "bytes": auto.bytes / hand.bytes,
            "sixteen_bit": sixteen_bit_gradient_reductions(auto.hlo),
            "seconds": time.time() - t0,
        }
        log(
            f"| {name} | {attn} | {'fused' if fuse else 'rules'} | "
            f"{hand.temp / 2**20:,.1f} | {auto.temp / 2**20:,.1f}"
            f" | **{row['temp']:.3f}** | {hand.bytes / 1e9:.2f} | "
            f"{auto.bytes / 1e9:.2f} | **{row['bytes']:.3f}** | {hand.kernels} | "
            f"{auto.kernels} | {hand.cudnn} / {auto.cudnn} | "
            f"{len(row['sixteen_bit'])} |"
        )
        out.append(row)
    return out


HEADER = (
    "| dtype | attention | autocast | hand temp MiB | autocast temp MiB | temp ratio | "
    "hand GB | autocast GB | bytes ratio | hand kernels | autocast kernels | "
    "cuDNN calls hand / autocast | 16-bit gradient reductions |\n" + "|---" * 13 + "|"
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--tiny", action="store_true", help="small shapes")
    args = parser.parse_args(argv)
    size = G.Size(args.layers, 768, 12, 3072, 50304, 1024, args.batch)
    if args.tiny:
        size = G.Size(1, 128, 2, 256, 512, 128, max(2, args.devices))
    print(
        f"GPU budget: {size.describe()}, {args.devices} deviceless H200(s); "
        f"jax {jax.__version__}; budget: temp <= {BUDGET['temp']}x, kernel "
        f"bytes <= {BUDGET['bytes']}x the hand-cast step"
    )
    print(HEADER)
    results = rows(size, args.devices)
    failed = [
        f"{r['dtype']} {r['attention']} fused={r['fused']}: "
        f"{k} {r[k]:.3f} > {BUDGET[k]}"
        for r in results
        for k in ("temp", "bytes")
        if r[k] > BUDGET[k]
    ]
    failed += [
        f"{r['dtype']} {r['attention']}: 16-bit gradient reductions {r['sixteen_bit']}"
        for r in results
        if r["sixteen_bit"]
    ]
    print("\n".join(f"OVER BUDGET: {f}" for f in failed) or "budget: ok")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
