"""Padded attention under ``jxs.autocast``: NaN fraction and deviation from float32.

Six ways JAX code masks attention, each with one sequence that is all padding (its
query rows are masked everywhere): Flax ``MultiHeadDotProductAttention``,
``jax.nn.dot_product_attention`` with a boolean mask and with sequence lengths,
equinox ``MultiheadAttention``, and hand-written ``jnp.where`` masks with ``-1e9``
and ``jnp.finfo(jnp.float32).min``. Each runs jitted in float32 and under
``jxs.autocast`` in float16 and bfloat16; the table gives the fraction of NaN in the
output and the largest absolute difference from float32 on the rows that are not
fully masked. (Before autocast kept its constants' meaning, 19 to 38% of these
outputs were NaN in float16, and in bfloat16 where the constant is float32's
minimum.)

Run::

    python benchmarks/masked_attention.py
"""

from __future__ import annotations

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import jaxscale as jxs

B, T, D, H = 2, 6, 16, 2


def cases() -> dict:
    tokens = jnp.array([[5, 3, 9, 2, 0, 0], [0, 0, 0, 0, 0, 0]])  # 0: padding
    valid = tokens > 0
    x = jax.random.normal(jax.random.key(0), (B, T, D))
    mask = valid[:, :, None] & valid[:, None, :]
    mha = nn.MultiHeadDotProductAttention(num_heads=H)
    variables = mha.init(jax.random.key(1), x, mask=mask[:, None])
    emha = eqx.nn.MultiheadAttention(H, D, key=jax.random.key(2))
    w = jax.random.normal(jax.random.key(3), (D, D)) / 4

    def heads(x):
        return x.reshape(B, T, H, D // H)

    def where(fill):
        def attend(x, m):
            scores = (x @ w) @ x.transpose(0, 2, 1)
            return jax.nn.softmax(jnp.where(m, scores, fill)) @ x

        return attend

    lengths = jnp.sum(valid, axis=1)
    fns = {
        "flax MultiHeadDotProductAttention": lambda x, m: mha.apply(
            variables, x, mask=m[:, None]
        ),
        "jax.nn.dot_product_attention, mask": lambda x, m: jax.nn.dot_product_attention(
            heads(x), heads(x), heads(x), mask=m[:, None]
        ),
        "jax.nn.dot_product_attention, lengths": lambda x, m: (
            jax.nn.dot_product_attention(
                heads(x),
                heads(x),
                heads(x),
                query_seq_lengths=lengths,
                key_value_seq_lengths=lengths,
            )
        ),
        "equinox MultiheadAttention": lambda x, m: jax.vmap(
            lambda xi, mi: emha(xi, xi, xi, mask=mi)
        )(x, m),
        "where(m, s, -1e9)": where(-1e9),
        "where(m, s, finfo(float32).min)": where(jnp.finfo(jnp.float32).min),
    }
    return fns, x, mask, np.asarray(valid)


def measure() -> dict[str, dict[str, tuple[float, float]]]:
    fns, x, mask, rows = cases()
    out: dict[str, dict[str, tuple[float, float]]] = {}
    for name, fn in fns.items():
        ref = np.asarray(jax.jit(fn)(x, mask)).reshape(B, T, -1)
        out[name] = {}
        for dtype in (jnp.float16, jnp.bfloat16):
            got = jax.jit(jxs.autocast(fn, dtype))(x, mask)
            got = np.asarray(got, np.float32).reshape(B, T, -1)
            nan = float(np.isnan(got).mean())
            dev = float(np.abs(got - ref)[rows].max())
            out[name][jnp.dtype(dtype).name] = (nan, dev)
    return out


def main() -> dict:
    platform = jax.devices()[0].platform
    print(f"jax {jax.__version__}, jaxscale {jxs.__version__}; {platform}")
    results = measure()
    print("| case | float16: NaN, max dev | bfloat16: NaN, max dev |")
    print("|---|---|---|")
    for name, r in results.items():
        cells = [f"{r[d][0]:.3f}, {r[d][1]:.4f}" for d in ("float16", "bfloat16")]
        print(f"| {name} | " + " | ".join(cells) + " |")
    return results


if __name__ == "__main__":
    with jax.numpy_dtype_promotion("standard"):
        main()
