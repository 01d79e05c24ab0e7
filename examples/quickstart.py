"""Quickstart: float16 training with dynamic loss scaling, as torch's GradScaler does.

A two-layer MLP learns a smooth 1-D-per-feature regression target on synthetic
data. The master parameters stay in float32; the loss function casts parameters
and inputs to float16, runs the forward (and so the backward) pass in float16 and
reduces the loss in float32. The optimizer is ``optax.adam`` wrapped in
``jxs.dynamic_scaling``, which unscales the gradients, skips steps whose
gradients overflowed and adjusts the scale.

The scale starts far too high (``2**24``), so the first steps overflow and are
skipped while the scale backs off; after every ``--growth-interval`` finite steps
in a row it doubles again. The log shows both.

Run it (a few seconds on a CPU)::

    python examples/quickstart.py --steps 300 --seed 0
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxscale as jxs

try:  # The progress bar is optional.
    from tqdm import tqdm
except ImportError:  # pragma: no cover - depends on the environment
    tqdm = None


def init_mlp(key: jax.Array, sizes: list[int]) -> list[dict[str, jax.Array]]:
    """float32 master parameters of an MLP with layer widths ``sizes``."""
    params = []
    keys = jax.random.split(key, len(sizes) - 1)
    for k, n_in, n_out in zip(keys, sizes[:-1], sizes[1:], strict=True):
        w = jax.random.normal(k, (n_in, n_out), jnp.float32) * np.sqrt(2.0 / n_in)
        params.append({"w": w, "b": jnp.zeros((n_out,), jnp.float32)})
    return params


def mlp(params: list[dict[str, jax.Array]], x: jax.Array) -> jax.Array:
    for layer in params[:-1]:
        x = jax.nn.gelu(x @ layer["w"] + layer["b"])
    return x @ params[-1]["w"] + params[-1]["b"]


def loss_fn(params, batch):
    """Mean squared error: float16 compute, float32 reduction."""
    x, y = batch
    half = jax.tree.map(lambda p: p.astype(jnp.float16), params)
    pred = mlp(half, x.astype(jnp.float16))
    return jnp.mean((pred.astype(jnp.float32) - y) ** 2)


def make_data(key: jax.Array, n: int, dim: int) -> tuple[jax.Array, jax.Array]:
    kx, kw = jax.random.split(key)
    x = jax.random.normal(kx, (n, dim), jnp.float32)
    w = jax.random.normal(kw, (dim, 1), jnp.float32) / np.sqrt(dim)
    y = jnp.sin(2.0 * x @ w) + 0.1 * jnp.sum(x**2, axis=1, keepdims=True) / dim
    return x, y


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="training steps")
    parser.add_argument("--seed", type=int, default=0, help="random seed")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--lr", type=float, default=3e-3, help="Adam learning rate")
    parser.add_argument("--init-scale", type=float, default=2.0**24)
    parser.add_argument("--growth-interval", type=int, default=100)
    parser.add_argument(
        "--log-every", type=int, default=25, help="print every this many steps"
    )
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}.")

    key_data, key_params = jax.random.split(jax.random.key(args.seed))
    x_all, y_all = make_data(key_data, n=8192, dim=16)
    params = init_mlp(key_params, [16, 128, 128, 1])

    tx = jxs.dynamic_scaling(
        optax.adam(args.lr),
        jxs.DynamicLossScale.create(
            init_scale=args.init_scale, growth_interval=args.growth_interval
        ),
    )
    opt_state = tx.init(params)

    @jax.jit
    def get_batch(step):
        idx = jax.random.randint(
            jax.random.fold_in(key_data, step), (args.batch_size,), 0, x_all.shape[0]
        )
        return x_all[idx], y_all[idx]

    # The whole training step, as short as torch's GradScaler loop.
    # donate_argnums: params and opt_state are updated in place, no copies.
    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def train_step(params, opt_state, batch):
        loss, grads = jxs.value_and_grad(loss_fn, opt_state)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, loss

    print(
        f"jaxscale {jxs.__version__}: {args.steps} steps of float16 Adam on "
        f"{jax.default_backend()}, init loss scale 2**{np.log2(args.init_scale):g}, "
        f"growth interval {args.growth_interval}"
    )
    steps = range(1, args.steps + 1)
    log = print
    if tqdm is not None:  # disable=None: a bar on a terminal only.
        steps = tqdm(steps, desc="train", unit="step", disable=None, leave=False)
        log = tqdm.write
    start = time.perf_counter()
    for step in steps:
        params, opt_state, loss = train_step(params, opt_state, get_batch(step))
        if step % args.log_every == 0 or step == 1 or step == args.steps:
            # Nothing above waited for the device; these reads are the only syncs.
            scale = float(jxs.loss_scale_of(opt_state).loss_scale)
            log(
                f"step {step:5d}  loss {float(loss):.5f}  "
                f"loss scale 2**{np.log2(scale):g}  "
                f"skipped {int(opt_state.skipped_steps)}"
            )
    seconds = time.perf_counter() - start
    scale = float(jxs.loss_scale_of(opt_state).loss_scale)
    applied = int(opt_state.steps) - int(opt_state.skipped_steps)
    print(
        f"done: final loss {float(loss):.5f}, final loss scale {scale:g} "
        f"(2**{np.log2(scale):g}), {int(opt_state.skipped_steps)} of "
        f"{int(opt_state.steps)} steps skipped, {applied} applied, "
        f"{seconds:.1f} s including compilation"
    )


if __name__ == "__main__":
    main()
