"""Norms scaled by parameter expressions and masks made in the function, under autocast.

Gemma's and Griffin's RMSNorm multiply by ``1 + scale`` (``scale`` a float32
parameter); SSMs and normalisation variants scale by ``softplus(raw)`` or
``exp(log_scale)``; Griffin's Conv1D multiplies by a document mask built inside
the function with ``.astype(h.dtype)`` (float32 when the function is traced).
Each is compiled as ``jax.jit(jax.grad(jxs.autocast(loss, float16)))`` next to
the same model written the plain way (``normed * scale``, the scale a parameter
itself; the mask passed in as a boolean and applied with ``jnp.where``), and
next to the float32 model:

* the temporary memory of the compiled gradient (XLA's
  ``memory_analysis().temp_size_in_bytes``), and its ratio to the plain form's;
* the float32 islands of ``jxs.diagnostics.autocast_report`` (float32
  operations descended from a widened activation, at least a tenth of the
  largest matmul output).

Target (issue 40): each form within a few percent of the plain form's memory,
with the plain form's islands.

Models (plain jax, float32 parameters, written here):

* ``gemma``: token embeddings scaled by ``sqrt(d)``, 4 pre-norm blocks
  (RMSNorm, a GeGLU MLP of width 4d), a final RMSNorm and an output
  projection; ``1 + scale`` against ``normed * scale``;
* ``griffin``: token embeddings, 4 recurrence-style blocks (RMSNorm, an input
  projection, a document-masked width-4 temporal convolution, a gate and a decay
  ``softplus(raw)`` or ``exp(log_scale)`` multiplied in elementwise, an output
  projection); the in-function mask against a boolean argument and a plain
  decay parameter.

Run::

    python benchmarks/param_values.py            # d 256, seq 256, batch 8
    python benchmarks/param_values.py --quick    # seconds: tests
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from autocast_memory import temp_bytes  # noqa: E402

import jaxscale as jxs  # noqa: E402
from jaxscale.diagnostics import autocast_report  # noqa: E402

F16, F32 = jnp.float16, jnp.float32
LAYERS = 4
SIZES = {"full": (256, 256, 8), "quick": (32, 16, 2)}  # (d, seq, batch)
VOCAB = 512


def _rms(x: jax.Array, scale: jax.Array, form: str) -> jax.Array:
    var = jnp.mean(jnp.square(x.astype(F32)), axis=-1, keepdims=True)
    normed = x * jax.lax.rsqrt(var + 1e-6)
    if form == "plain":
        return normed * scale
    if form == "one plus":
        return normed * (1 + scale)
    if form == "softplus":
        return normed * jax.nn.softplus(scale)
    if form == "exp":
        return normed * jnp.exp(scale)
    raise ValueError(form)


def gemma_params(d: int, key: jax.Array) -> dict[str, Any]:
    keys = jax.random.split(key, 3 * LAYERS + 1)
    blocks = [
        {
            "norm": jnp.zeros((d,)),
            "gate": jax.random.normal(keys[3 * i], (d, 4 * d)) / d**0.5,
            "up": jax.random.normal(keys[3 * i + 1], (d, 4 * d)) / d**0.5,
            "down": jax.random.normal(keys[3 * i + 2], (4 * d, d)) / (4 * d) ** 0.5,
        }
        for i in range(LAYERS)
    ]
    head = jax.random.normal(keys[-1], (d, d)) / d**0.5
    embed = jax.random.normal(jax.random.key(2), (VOCAB, d))
    return {"embed": embed, "blocks": blocks, "final": jnp.zeros((d,)), "head": head}


def gemma_loss(form: str) -> Callable[..., jax.Array]:
    def loss(params: dict[str, Any], tokens: jax.Array) -> jax.Array:
        x = params["embed"][tokens] * params["embed"].shape[1] ** 0.5
        for p in params["blocks"]:
            h = _rms(x, p["norm"], form)
            h = jax.nn.gelu(h @ p["gate"]) * (h @ p["up"])
            x = x + h @ p["down"]
        y = _rms(x, params["final"], form) @ params["head"]
        return jnp.mean(jnp.square(y.astype(F32)))

    return loss


def griffin_params(d: int, key: jax.Array) -> dict[str, Any]:
    keys = jax.random.split(key, 4 * LAYERS)
    return {
        "embed": jax.random.normal(jax.random.key(2), (VOCAB, d)),
        "blocks": [
            {
                "norm": jnp.ones((d,)),
                "inp": jax.random.normal(keys[4 * i], (d, d)) / d**0.5,
                "gate": jax.random.normal(keys[4 * i + 1], (d, d)) / d**0.5,
                "conv": jax.random.normal(keys[4 * i + 2], (4, d)) / 2,
                "decay": jnp.full((d,), 0.5),
                "out": jax.random.normal(keys[4 * i + 3], (d, d)) / d**0.5,
            }
            for i in range(LAYERS)
        ],
    }


def griffin_loss(form: str) -> Callable[..., jax.Array]:
    """``form``: ``"plain"`` (the decay a parameter, the mask a boolean argument
    applied with ``where``), ``"softplus"`` or ``"exp"`` (the decay computed
    from a parameter, the mask converted inside the function)."""

    def loss(params: dict[str, Any], tokens: jax.Array, pos: jax.Array) -> jax.Array:
        x = params["embed"][tokens]
        for p in params["blocks"]:
            h = _rms(x, p["norm"], "plain") @ p["inp"]
            # A width-4 causal convolution that does not cross a document start.
            out = h * p["conv"][0]
            for k in range(1, 4):
                shifted = jnp.pad(h, ((0, 0), (k, 0), (0, 0)))[:, : h.shape[1]]
                if form == "plain":
                    keep = (pos >= k)[..., None]
                    out = out + jnp.where(keep, shifted, 0) * p["conv"][k]
                else:
                    mask = (pos >= k).astype(h.dtype)[..., None]
                    out = out + shifted * mask * p["conv"][k]
            if form == "plain":
                decay = p["decay"]
            elif form == "softplus":
                decay = jax.nn.softplus(p["decay"])
            else:
                decay = jnp.exp(p["decay"])
            gated = jax.nn.gelu(x @ p["gate"]) * out * decay
            x = x + gated @ p["out"]
        return jnp.mean(jnp.square(x.astype(F32)))

    return loss


def problem(model: str, quick: bool) -> tuple[dict[str, Callable], tuple]:
    d, seq, batch = SIZES["quick" if quick else "full"]
    key = jax.random.key(0)
    x = jax.random.randint(jax.random.key(1), (batch, seq), 0, VOCAB)
    if model == "gemma":
        forms = ("plain", "one plus", "softplus", "exp")
        return {f: gemma_loss(f) for f in forms}, (gemma_params(d, key), x)
    starts = jnp.arange(seq) % (seq // 2)  # two documents per row
    pos = jnp.broadcast_to(starts, (batch, seq))
    forms = ("plain", "softplus", "exp")
    return {f: griffin_loss(f) for f in forms}, (griffin_params(d, key), x, pos)


def measure(model: str, quick: bool) -> list[dict[str, Any]]:
    losses, args = problem(model, quick)
    rows = []
    for form, loss in losses.items():
        half = jxs.autocast(loss, F16)
        rows.append(
            {
                "model": model,
                "form": form,
                "fp32": temp_bytes(loss, False, args),
                "autocast": temp_bytes(half, False, args),
                "islands": len(autocast_report(loss, F16)(*args).islands),
            }
        )
    plain = rows[0]["autocast"]
    for row in rows:
        row["ratio"] = row["autocast"] / plain
    return rows


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes")
    parser.add_argument("--models", nargs="+", default=["gemma", "griffin"])
    args = parser.parse_args(argv)
    print(f"jax {jax.__version__}, backend {jax.default_backend()}")
    print(
        "| model | form | fp32 MiB | autocast MiB | autocast / plain form "
        "| f32 islands |\n|---|---|---|---|---|---|"
    )
    rows = []
    for model in args.models:
        for r in measure(model, args.quick):
            rows.append(r)
            print(
                f"| {r['model']} | {r['form']} | {r['fp32'] / 2**20:.2f} "
                f"| {r['autocast'] / 2**20:.2f} | {r['ratio']:.3f} | {r['islands']} |",
                flush=True,
            )
    return rows


if __name__ == "__main__":
    main()
