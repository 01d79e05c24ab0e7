"""Where the bytes of ``jxs.dynamic_scaling`` go: a per-kernel account of a step.

A train step is compiled twice, bare (``jax.value_and_grad`` and the optimizer)
and with ``jxs.dynamic_scaling`` around the same optimizer, and both optimized
HLO modules are read kernel by kernel: every fusion, custom call (a cuBLAS GEMM),
copy, sort or other instruction that runs on the device, on the path a finite
step executes, with the bytes it reads (its operands) and writes (its result),
from the shapes in the HLO text. This is XLA's own convention for a fusion's
memory traffic (``HloCostAnalysis``: operands plus output, each buffer once);
an operand that a fusion reads only in part counts whole, the same in both steps.

The two lists are matched by each kernel's signature (its kind and the shapes of
its result and of its non-scalar operands): what is left over is what
``dynamic_scaling`` added (and removed). Printed per model: kernels and bytes of
both steps, the extra bytes per parameter, and the added and removed kernels,
largest first. One float32 read of the gradients is 4 bytes per parameter; a
whole AdamW pass over g, m, v and p (read g, m, v, p, write m, v, p) is 28.

Where it compiles: on the default backend (XLA:CPU here, XLA:GPU on a GPU
host: ``.ci/gpu`` runs it there), or, with ``--target h100`` or ``h200``,
for that GPU *without one*: JAX's deviceless ahead-of-time compilation
(``jax.experimental.topologies``) needs only the CUDA plugin installed
(``pip install jax-cuda12-plugin==<jax's version>``; no driver, no GPU), and
gives XLA:GPU's optimized HLO for that device, the same fusion passes a real
one runs (autotuning aside: without a device XLA picks its default GEMM
configurations). ``jax.jit(f).trace(...).lower(lowering_platforms=("cuda",))``
gives only StableHLO, before any fusion: not an account.

Models: the MLP, the transformer and the leaf sweeps of
``benchmarks/overhead.py`` (float16 compute, ``optax.adam``), and the GPT
decoders of ``benchmarks/gpu.py`` (``gpt2``: GPT-2-small, 124M parameters;
``gpt-small``: its dispatch-bound small model; ``gpt-tiny``: one layer, d 64),
float16 cast by hand, ``optax.adamw``.

Run::

    python benchmarks/step_account.py                     # mlp transformer sweeps
    python benchmarks/step_account.py --models gpt-tiny --target h100
    python benchmarks/step_account.py --models gpt2 gpt-small   # on a GPU host
    python benchmarks/step_account.py --tiny              # seconds: tests
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for _p in (ROOT, ROOT / "benchmarks"):  # jaxscale and the sibling benchmarks
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

# The accounting itself (shared with gpu.py and float8_passes.py).
from hlo_account import (  # noqa: E402 (after the path)
    _GPU_TARGETS,
    TABLE_HEADER,
    Account,
    Kernel,
    abstract_for,
    categories,
    difference,
    kernels,
    row,
)

__all__ = [
    "Account",
    "Kernel",
    "abstract_for",
    "account",
    "categories",
    "difference",
    "kernels",
    "row",
]


def _gpt_steps(size: Any) -> tuple[dict[str, Any], Any, Any]:
    """``benchmarks/gpu.py``'s hand-cast float16 GPT steps, bare and scaled."""
    import gpu
    import jax

    key = jax.random.key(0)
    tokens = jax.random.randint(key, (size.batch, size.seq + 1), 0, size.vocab)
    batch = (tokens[:, :-1], tokens[:, 1:])
    params = jax.eval_shape(gpu.GPT(size).init, key, batch[0])
    loss_fn = gpu.loss_fns(size)[gpu.BARE]
    steps = {}
    for name, scaled in (("bare", False), ("scaled", True)):
        jitted, tx = gpu.make_step(loss_fn, scaled)
        steps[name] = (jitted, jax.eval_shape(tx.init, params))
    return steps, params, batch


def _overhead_steps(model: str, batch_size: int) -> tuple[dict, Any, Any]:
    """``benchmarks/overhead.py``'s float16 steps (adam), bare and scaled."""
    import jax
    import overhead

    loss_fn, params, batch = overhead.make_problem(model, batch_size)
    variants = overhead.make_variants(loss_fn, params)
    steps = {}
    for name in ("bare", "scaled"):
        jitted, fresh = variants[name]
        _, state = jax.eval_shape(fresh)
        steps[name] = (jitted, state)
    return steps, jax.eval_shape(lambda: params), batch


def build(model: str, tiny: bool) -> tuple[dict, Any, Any]:
    """``(steps, params, batch)``; ``steps`` maps ``bare`` and ``scaled`` to
    ``(jitted step, abstract optimizer state)``; ``params`` are abstract."""
    if model.startswith("gpt"):
        import gpu

        mode = "tiny" if tiny else "full"
        size = {
            "gpt2": gpu.SIZES[mode]["realistic"],
            "gpt-small": gpu.SIZES[mode]["small"],
            "gpt-tiny": gpu.SIZES["tiny"]["realistic"],
        }[model]
        return _gpt_steps(size)
    batch = {"mlp": 128, "transformer": 4}.get(model, 32)
    return _overhead_steps(model, batch)


def account(
    model: str, target: str | None = None, tiny: bool = False, dump: Path | None = None
) -> Account:
    """Compiles ``model``'s bare and ``dynamic_scaling`` steps and compares them
    (and writes both optimized HLO modules into ``dump``)."""
    import jax

    steps, params, batch = build(model, tiny)
    place = abstract_for(target)
    lists = {}
    for name, (jitted, state) in steps.items():
        args = place((params, state, batch))
        text = jitted.lower(*args).compile().as_text()
        if dump is not None:
            dump.mkdir(parents=True, exist_ok=True)
            (dump / f"{model}_{name}.hlo.txt").write_text(text)
        lists[name] = kernels(text)
    leaves = jax.tree.leaves(params)
    return Account(
        model=model,
        n_params=sum(x.size for x in leaves),
        leaves=len(leaves),
        bare=lists["bare"],
        ours=lists["scaled"],
    )


MODELS = ["mlp", "transformer", "sweep10", "sweep100", "sweep1000"]
GPT_MODELS = ["gpt2", "gpt-small", "gpt-tiny"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--models",
        nargs="+",
        choices=MODELS + GPT_MODELS,
        default=None,
        help=f"of {MODELS + GPT_MODELS} (default: the first five; --tiny: mlp, "
        "gpt-tiny)",
    )
    parser.add_argument(
        "--target",
        choices=sorted(_GPU_TARGETS),
        help="compile for this GPU without one (needs jax's CUDA plugin)",
    )
    parser.add_argument(
        "--dump", type=Path, help="write the optimized HLO modules into this folder"
    )
    parser.add_argument("--top", type=int, default=12, help="kernels listed per side")
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="the MLP and a one-layer GPT; GPTs at benchmarks/gpu.py's --tiny sizes",
    )
    args = parser.parse_args(argv)
    models = args.models or (["mlp", "gpt-tiny"] if args.tiny else MODELS)
    import jax

    if args.target:
        backend = f"{_GPU_TARGETS[args.target][0]}, deviceless (no autotuning)"
        try:
            abstract_for(args.target)
        except Exception as e:  # noqa: BLE001 - explained, exit code 2
            print(
                f"--target {args.target} needs JAX's CUDA plugin (pip install "
                f'"jax-cuda12-plugin=={jax.__version__}"; no GPU needed): '
                f"{type(e).__name__}: {e}",
                file=sys.stderr,
            )
            return 2
    else:
        dev = jax.devices()[0]
        backend = f"{dev.device_kind} ({jax.default_backend()})"
    print(f"jax {jax.__version__}; compiled for {backend}")
    rows = []
    for model in models:
        t0 = time.perf_counter()
        acc = account(model, args.target, args.tiny, args.dump)
        print("\n".join(acc.lines(args.top)))
        print(f"account: {model} | compiled in {time.perf_counter() - t0:.1f} s\n")
        rows.append(row(acc))
    print(TABLE_HEADER)
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
