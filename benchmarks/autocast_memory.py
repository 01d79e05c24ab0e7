"""Temporary memory of the compiled gradient: `jxs.autocast` vs hand-cast float16.

For four models the gradient of the loss is compiled three ways and XLA's
``compiled.memory_analysis().temp_size_in_bytes`` is read for each:

* ``fp32``: the model as written, float32 (for context);
* ``hand``: the same model class built with ``dtype=jnp.float16`` in its layers
  (flax's own mixed precision: parameters float32, every layer computing in
  float16), the loss reduced in float32;
* ``autocast``: the float32 model, its loss wrapped in ``jxs.autocast``.

The target is ``autocast / hand <= 1.00``: autocast should keep activations, and
so the memory of the backward pass, at the size of the hand-cast model.

Models:

* ``resnet``: a small ResNet in Flax linen with ``nn.BatchNorm`` (3×3
  conv-BN-ReLU stem, residual blocks of two conv-BN with a projection where the
  shape changes, residual adds, global average pool, dense head), batch 64 of
  32×32×3 images; the gradient's aux output is BatchNorm's updated
  ``batch_stats`` (``mutable=["batch_stats"]``);
* ``resnet_sync``: the same ResNet with synchronised BatchNorm
  (``axis_name="batch"``, as flax's ImageNet example), data-parallel over 4
  replicas by ``jax.vmap(..., axis_name="batch")``: its statistics pass through
  a cross-replica ``pmean``;
* ``padded_lm``: the transformer of ``examples/padded_lm.py`` (Flax linen: token
  and learned position embeddings, pre-LayerNorm blocks with
  ``nn.MultiHeadDotProductAttention`` under a causal and padding mask, ReLU MLP),
  30% of the sequences padded;
* ``char_transformer``: the NNX ``GPT`` and ``cross_entropy`` of
  ``examples/char_transformer.py``.

Each gradient is ``jax.jit(jax.grad(loss, has_aux=...))`` of the loss alone (no
optimizer), so the number is the gradient computation's memory.

It also counts *float32 islands* in the autocast loss's jaxpr
(``jax.make_jaxpr(jxs.autocast(loss))``, the jaxprs among an equation's
parameters included, higher-order equations themselves not
counted): equations whose output is float32 and has at least as many elements as
the largest float16 output. These are activation-sized tensors that autocast
keeps in float32; the same count for the hand-cast loss is shown next to it.

XLA:CPU computes float16 elementwise operations through float32, so compare the
``hand`` and ``autocast`` columns with each other rather than with ``fp32``.

Run::

    python benchmarks/autocast_memory.py                 # ~1-2 minutes on 2 cores
    python benchmarks/autocast_memory.py --quick         # tiny sizes
    python benchmarks/autocast_memory.py --models resnet --json memory.json
"""

from __future__ import annotations

import argparse
import collections
import functools
import importlib.util
import json
import math
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import nnx

import jaxscale as jxs

F16, F32 = jnp.float16, jnp.float32
TARGET = 1.00
MODELS = ("resnet", "resnet_sync", "padded_lm", "char_transformer")
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

# Sizes: full, and --quick (tiny, for the test suite).
SIZES = {
    "resnet": {
        "full": dict(stem=32, blocks=((32, 1), (32, 1), (64, 2), (128, 2)),
                     image=32, batch=64),
        "quick": dict(stem=4, blocks=((4, 1), (8, 2)), image=8, batch=4)},
    "resnet_sync": {
        "full": dict(stem=32, blocks=((32, 1), (32, 1), (64, 2), (128, 2)),
                     image=32, batch=64, replicas=4),
        "quick": dict(stem=4, blocks=((4, 1), (8, 2)), image=8, batch=4,
                      replicas=2)},
    "padded_lm": {
        "full": dict(vocab=128, context=128, dim=128, heads=4, layers=2,
                     mlp_dim=512, batch=32),
        "quick": dict(vocab=16, context=8, dim=8, heads=2, layers=1, mlp_dim=16,
                      batch=4)},
    "char_transformer": {
        "full": dict(vocab=96, context=128, dim=128, layers=2, heads=4, batch=32),
        "quick": dict(vocab=16, context=8, dim=8, layers=1, heads=2, batch=4)},
}  # fmt: skip


def _example(name: str):
    """The module ``examples/<name>.py``."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


# --------------------------------------------------------------------------- #
# Models. Each problem is {variant: loss}, has_aux and the loss's arguments as
# shapes (jax.ShapeDtypeStruct: the memory and the jaxpr depend on shapes only,
# so nothing is initialised); every loss differentiates its first argument.
# --------------------------------------------------------------------------- #


class ResBlock(nn.Module):
    """Two 3×3 conv-BN, a 1×1 conv-BN projection where the shape changes."""

    channels: int
    strides: int = 1
    dtype: Any = F32
    axis_name: str | None = None

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        conv = functools.partial(nn.Conv, use_bias=False, dtype=self.dtype)
        norm = functools.partial(
            nn.BatchNorm,
            use_running_average=False,
            momentum=0.9,
            dtype=self.dtype,
            axis_name=self.axis_name,
        )
        y = nn.relu(norm()(conv(self.channels, (3, 3), self.strides)(x)))
        y = norm()(conv(self.channels, (3, 3))(y))
        if x.shape != y.shape:
            x = norm()(conv(self.channels, (1, 1), self.strides)(x))
        return nn.relu(x + y)


class ResNet(nn.Module):
    """Conv-BN-ReLU stem, ``blocks`` (channels, stride), global pool, dense."""

    stem: int
    blocks: tuple[tuple[int, int], ...]
    classes: int = 10
    dtype: Any = F32
    axis_name: str | None = None  # BatchNorm's statistics over these devices

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = nn.Conv(self.stem, (3, 3), use_bias=False, dtype=self.dtype)(x)
        x = nn.BatchNorm(
            use_running_average=False,
            momentum=0.9,
            dtype=self.dtype,
            axis_name=self.axis_name,
        )(x)
        x = nn.relu(x)
        for channels, strides in self.blocks:
            x = ResBlock(channels, strides, self.dtype, self.axis_name)(x)
        x = jnp.mean(x, axis=(1, 2))
        return nn.Dense(self.classes, dtype=self.dtype)(x)


def resnet_problem(size: dict):
    s, batch = size["image"], size["batch"]
    x = jax.ShapeDtypeStruct((batch, s, s, 3), F32)
    y = jax.ShapeDtypeStruct((batch,), jnp.int32)
    nets = {dt: ResNet(size["stem"], size["blocks"], dtype=dt) for dt in (F32, F16)}
    variables = jax.eval_shape(nets[F32].init, jax.random.key(0), x)

    def loss(net, params, batch_stats, x, y):
        logits, updates = net.apply(
            {"params": params, "batch_stats": batch_stats},
            x,
            mutable=["batch_stats"],
        )
        return _cross_entropy(logits.astype(F32), y), updates["batch_stats"]

    plain = functools.partial(loss, nets[F32])
    variants = {
        "fp32": plain,
        "hand": functools.partial(loss, nets[F16]),
        "autocast": _autocast(plain),
    }
    args = (variables["params"], variables["batch_stats"], x, y)
    return variants, True, args


def resnet_sync_problem(size: dict):
    """The ResNet with synchronised BatchNorm (``axis_name="batch"``, flax's
    ImageNet example), data-parallel over ``replicas`` by ``jax.vmap`` with that
    axis name (as ``pmap`` or ``shard_map`` would run it)."""
    s, r = size["image"], size["replicas"]
    x = jax.ShapeDtypeStruct((r, size["batch"] // r, s, s, 3), F32)
    y = jax.ShapeDtypeStruct((r, size["batch"] // r), jnp.int32)
    nets = {
        dt: ResNet(size["stem"], size["blocks"], dtype=dt, axis_name="batch")
        for dt in (F32, F16)
    }
    local = ResNet(size["stem"], size["blocks"])
    one = jax.ShapeDtypeStruct(x.shape[1:], F32)
    variables = jax.eval_shape(local.init, jax.random.key(0), one)

    def loss(net, params, batch_stats, x, y):
        logits, updates = net.apply(
            {"params": params, "batch_stats": batch_stats},
            x,
            mutable=["batch_stats"],
        )
        return _cross_entropy(logits.astype(F32), y), updates["batch_stats"]

    def data_parallel(per_replica):
        def run(params, batch_stats, x, y):
            losses, stats = jax.vmap(
                per_replica, in_axes=(None, None, 0, 0), axis_name="batch"
            )(params, batch_stats, x, y)
            return jnp.mean(losses), jax.tree.map(lambda a: a[0], stats)

        return run

    plain = functools.partial(loss, nets[F32])
    variants = {
        "fp32": data_parallel(plain),
        "hand": data_parallel(functools.partial(loss, nets[F16])),
        "autocast": data_parallel(_autocast(plain)),
    }
    args = (variables["params"], variables["batch_stats"], x, y)
    return variants, True, args


def padded_lm_problem(size: dict):
    lm = _example("padded_lm")
    shape = {k: v for k, v in size.items() if k != "batch"}
    nets = {dt: lm.PaddedLM(**shape, dtype=dt) for dt in (F32, F16)}
    inputs = jax.ShapeDtypeStruct((size["batch"], size["context"]), jnp.int32)
    params = jax.eval_shape(nets[F32].init, jax.random.key(0), inputs)["params"]

    def loss(net, params, inputs):
        total, count = lm.loss_terms(net, params, inputs)
        return total / count

    plain = functools.partial(loss, nets[F32])
    variants = {
        "fp32": plain,
        "hand": functools.partial(loss, nets[F16]),
        "autocast": _autocast(plain),
    }
    return variants, False, (params, inputs)


def char_transformer_problem(size: dict):
    ct = _example("char_transformer")
    shape = (size["vocab"], size["context"], size["dim"], size["layers"])

    def gpt(dtype):
        return nnx.eval_shape(lambda: ct.GPT(*shape, size["heads"], dtype, nnx.Rngs(0)))

    models = {dt: gpt(dt) for dt in (F32, F16)}
    x = y = jax.ShapeDtypeStruct((size["batch"], size["context"]), jnp.int32)
    split = {dt: nnx.split(m, nnx.Param, ...) for dt, m in models.items()}
    params = split[F32][1]

    def loss(dtype, objective, params, x, y):
        graphdef, _, rest = split[dtype]
        return objective(nnx.merge(graphdef, params, rest), x, y)

    variants = {
        "fp32": functools.partial(loss, F32, ct.cross_entropy),
        "hand": functools.partial(loss, F16, ct.cross_entropy),
        "autocast": functools.partial(loss, F32, _autocast(ct.cross_entropy)),
    }
    return variants, False, (params, x, y)


PROBLEMS = {
    "resnet": resnet_problem,
    "resnet_sync": resnet_sync_problem,
    "padded_lm": padded_lm_problem,
    "char_transformer": char_transformer_problem,
}


# --------------------------------------------------------------------------- #
# Measurements.
# --------------------------------------------------------------------------- #


def temp_bytes(loss: Callable, has_aux: bool, args: tuple) -> int:
    """``temp_size_in_bytes`` of the compiled ``jax.grad(loss)`` at ``args``."""
    grad = jax.jit(jax.grad(loss, has_aux=has_aux))
    mem = grad.lower(*args).compile().memory_analysis()
    if mem is None:  # pragma: no cover - depends on the backend
        raise SystemExit(f"{jax.default_backend()} gives no memory analysis.")
    return int(mem.temp_size_in_bytes)


def _jaxprs_in_params(params) -> Iterator[Any]:
    """The jaxprs among an equation's parameters, directly or in a tuple or list
    (``jax.extend.core.jaxprs_in_params``, absent from jax 0.7.1)."""
    core = jax.extend.core
    for value in params.values():
        for v in value if isinstance(value, tuple | list) else (value,):
            if isinstance(v, core.ClosedJaxpr):
                yield v.jaxpr
            elif isinstance(v, core.Jaxpr):
                yield v


def _equations(jaxpr) -> Iterator[Any]:
    """The first-order equations of ``jaxpr`` and of every sub-jaxpr."""
    for eqn in jaxpr.eqns:
        subs = list(_jaxprs_in_params(eqn.params))
        if subs:
            for sub in subs:
                yield from _equations(sub)
        else:
            yield eqn


def f32_islands(loss: Callable, args: tuple) -> dict[str, Any]:
    """Float32 equations of ``loss``'s jaxpr at least as large as its largest
    float16 output.

    Returns the count, the count by primitive and that largest size (``None``
    and no count where nothing is float16).
    """
    jaxpr = jax.make_jaxpr(loss)(*args).jaxpr
    outs = [
        (eqn.primitive.name, v.aval)
        for eqn in _equations(jaxpr)
        for v in eqn.outvars
        if hasattr(v.aval, "dtype")
    ]
    largest = max((a.size for _, a in outs if a.dtype == F16), default=None)
    if largest is None:
        return {"count": None, "by_primitive": {}, "largest_f16_elements": None}
    found = collections.Counter(
        name for name, a in outs if a.dtype == F32 and a.size >= largest
    )
    return {
        "count": sum(found.values()),
        "by_primitive": dict(found.most_common()),
        "largest_f16_elements": largest,
    }


# autocast's ``gradient_dtype`` for the "autocast" variant (see ``measure``).
_GRADIENT_DTYPE: list[Any] = [None]


def _autocast(fun: Any) -> Any:
    return jxs.autocast(fun, gradient_dtype=_GRADIENT_DTYPE[0])


def measure(model: str, quick: bool, gradient_dtype: Any = None) -> dict[str, Any]:
    """One model's temporary memory per variant and its float32 islands; the
    autocast variant with ``gradient_dtype`` (float16: the hand-cast models'
    16-bit weight-gradient products, a like-with-like comparison)."""
    size = SIZES[model]["quick" if quick else "full"]
    _GRADIENT_DTYPE[0] = gradient_dtype
    variants, has_aux, args = PROBLEMS[model](size)
    n_params = sum(math.prod(x.shape) for x in jax.tree.leaves(args[0]))
    temp = {name: temp_bytes(loss, has_aux, args) for name, loss in variants.items()}
    ratio = temp["autocast"] / temp["hand"]
    return {
        "params": int(n_params),
        "size": size,
        "fp32_bytes": temp["fp32"],
        "hand_bytes": temp["hand"],
        "autocast_bytes": temp["autocast"],
        "ratio": ratio,
        "target_met": ratio <= TARGET,
        "f32_islands": f32_islands(variants["autocast"], args),
        "f32_islands_hand": f32_islands(variants["hand"], args),
    }


TABLE_HEADER = (
    "| model | fp32 MiB | hand MiB | autocast MiB | autocast/hand | target "
    "| f32 islands (autocast, hand) |\n|---|---|---|---|---|---|---|"
)


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f}"


def table_row(model: str, r: dict[str, Any]) -> str:
    isl, hand = r["f32_islands"]["count"], r["f32_islands_hand"]["count"]
    verdict = "MET" if r["target_met"] else "NOT MET"
    return (
        f"| {model} | {_mib(r['fp32_bytes'])} | {_mib(r['hand_bytes'])} | "
        f"{_mib(r['autocast_bytes'])} | {r['ratio']:.3f} | ratio <= {TARGET:.2f}: "
        f"{verdict} | {isl if isl is not None else '-'}, "
        f"{hand if hand is not None else '-'} |"
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes (tests)")
    parser.add_argument(
        "--models",
        default=",".join(MODELS),
        help=f"comma-separated, from {', '.join(MODELS)} (default: all)",
    )
    parser.add_argument("--json", metavar="PATH", help="write the numbers here")
    args = parser.parse_args(argv)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    if not models or any(m not in MODELS for m in models):
        parser.error(
            f"`--models` must name models from {', '.join(MODELS)}, got "
            f"{args.models!r}."
        )
    args.models = ",".join(dict.fromkeys(models))
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Runs the benchmark; returns the ``--json`` document."""
    args = parse_args(argv)
    print(
        f"jax {jax.__version__}, flax {__import__('flax').__version__}, jaxscale "
        f"{jxs.__version__}; device {jax.devices()[0].device_kind}, backend "
        f"{jax.default_backend()}; {'quick' if args.quick else 'full'} sizes"
    )
    results = {}
    for model in args.models.split(","):
        r = results[model] = measure(model, args.quick)
        isl = r["f32_islands"]
        top = ", ".join(f"{k} {v}" for k, v in list(isl["by_primitive"].items())[:8])
        print(
            f"\n== {model}: {r['params']:,} params; temp fp32 "
            f"{_mib(r['fp32_bytes'])} MiB, hand {_mib(r['hand_bytes'])} MiB, "
            f"autocast {_mib(r['autocast_bytes'])} MiB"
        )
        print(
            f"   f32 islands {isl['count']} (float32 outputs of >= "
            f"{isl['largest_f16_elements']} elements, the largest float16 one)"
            + (f": {top}" if top else "")
            + f"; hand-cast {r['f32_islands_hand']['count']}"
        )
    print("\n" + TABLE_HEADER)
    for model, r in results.items():
        print(table_row(model, r))
    doc = {
        "config": {"quick": args.quick, "models": args.models, "target": TARGET},
        "jax": jax.__version__,
        "jaxscale": jxs.__version__,
        "backend": jax.default_backend(),
        "models": results,
    }
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1)
        print(f"\nnumbers written to {Path(args.json).resolve()}")
    return doc


if __name__ == "__main__":
    main()
