"""Diagnostics: see every skipped step, find the overflowing layer, choose the scale.

The workflow of docs/diagnostics.md on a small float16 MLP regression:

1. **Choose the scale.** Gradients of a float32 reference run go through
   ``jxs.diagnostics.underflow_report``: how much of them float16 flushes to zero
   without a scale, and which power-of-two ``init_scale`` range keeps them
   representable.
2. **Watch the run.** The float16 model trains with ``jxs.dynamic_scaling``
   (which keeps per-leaf overflow flags) wrapped in ``jxs.diagnostics.monitor``
   with an ``on_overflow`` hook; every step returns ``jxs.diagnostics.summary``
   counters and ``jxs.diagnostics.layer_norms`` of the unscaled gradients as
   device arrays, fetched once at the end (no per-step sync).
3. **Find the layer.** ``jaxscale.testing.nonfinite_at`` makes one layer's
   gradients overflow at the steps given by ``--inject-at``; the hook names it.
4. **Compare to float32.** The same model trains in float32 alongside; the plot
   puts both losses, the scale (with skipped steps marked) and the per-layer
   gradient norms on one page.

Run it (a few seconds on a CPU)::

    python examples/diagnostics.py --steps 300 --out examples/out
"""

from __future__ import annotations

import argparse
import functools
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxscale as jxs
import jaxscale.testing as jxt

try:  # The progress bar is optional.
    from tqdm import tqdm
except ImportError:  # pragma: no cover - depends on the environment
    tqdm = None

SIZES = [16, 128, 128, 128, 1]


def init_mlp(key: jax.Array) -> dict[str, dict[str, jax.Array]]:
    """float32 master parameters, one ``layer{i}`` entry per dense layer."""
    params = {}
    keys = jax.random.split(key, len(SIZES) - 1)
    for i, (k, n_in, n_out) in enumerate(zip(keys, SIZES[:-1], SIZES[1:], strict=True)):
        w = jax.random.normal(k, (n_in, n_out), jnp.float32) * np.sqrt(2.0 / n_in)
        if i == len(SIZES) - 2:  # a small head: small outputs, small gradients
            w = w * 1e-2
        params[f"layer{i}"] = {"w": w, "b": jnp.zeros((n_out,), jnp.float32)}
    return params


def mlp(params: dict, x: jax.Array) -> jax.Array:
    layers = [params[f"layer{i}"] for i in range(len(params))]
    for layer in layers[:-1]:
        x = jax.nn.gelu(x @ layer["w"] + layer["b"])
    return x @ layers[-1]["w"] + layers[-1]["b"]


def loss_fn(params: dict, batch: tuple, dtype: jnp.dtype) -> jax.Array:
    """Mean squared error computed in ``dtype``, reduced in float32."""
    x, y = batch
    cast = jax.tree.map(lambda p: p.astype(dtype), params)
    pred = mlp(cast, x.astype(dtype))
    return jnp.mean((pred.astype(jnp.float32) - y) ** 2)


def make_data(key: jax.Array, n: int, dim: int) -> tuple[jax.Array, jax.Array]:
    kx, kw = jax.random.split(key)
    x = jax.random.normal(kx, (n, dim), jnp.float32)
    w = jax.random.normal(kw, (dim, 1), jnp.float32) / np.sqrt(dim)
    # Small targets: small gradients, which float16 flushes to zero unscaled.
    y = 1e-3 * jnp.sin(2.0 * x @ w)
    return x, y


def pow2(x: float) -> str:
    return f"2**{np.log2(x):g}" if x > 0 else "0"


def report_underflow(grads: dict, init_scale: float) -> None:
    r = jax.device_get(jxs.diagnostics.underflow_report(grads, jnp.float16, init_scale))
    print("float32 reference gradients, cast to float16:")
    print(
        f"  without a scale: {r.zero_fraction_unscaled:.1%} flush to zero, "
        f"{r.subnormal_fraction_unscaled:.1%} subnormal"
    )
    print(
        f"  at init_scale {pow2(init_scale)}: {r.zero_fraction:.1%} zero, "
        f"{r.subnormal_fraction:.1%} subnormal, {r.overflow_fraction:.1%} overflow, "
        f"headroom {r.headroom_log2:+.1f} doublings"
    )
    print(
        f"  recommended init_scale: {pow2(r.init_scale_low)} .. "
        f"{pow2(r.init_scale_high)}"
    )


def plot(path: Path, history: dict, inject_at: list[int]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = np.arange(len(history["loss_scale"]))
    skipped = ~history["last_step_finite"]
    fig, axes = plt.subplots(3, 1, figsize=(8, 9), sharex=True)
    ax = axes[0]
    ax.step(steps, np.log2(history["loss_scale"]), where="post", label="loss scale")
    ax.plot(
        steps[skipped],
        np.log2(history["scale_used"][skipped]),
        "rx",
        label="skipped step",
    )
    for s in inject_at:
        ax.axvline(s, color="0.8", lw=0.8, zorder=0)
    ax.set_ylabel("log2(loss scale)")
    ax.legend(loc="upper right")
    ax = axes[1]
    for name, norms in history["norms"].items():
        norms = np.where(np.isfinite(norms), norms, np.nan)
        ax.semilogy(steps, norms, label=name, lw=1)
    ax.set_ylabel("gradient norm (unscaled)")
    ax.legend(loc="upper right", ncol=2, fontsize="small")
    ax = axes[2]
    ax.semilogy(steps, history["loss"], label="float16 + jaxscale", lw=1)
    ax.semilogy(steps, history["loss_f32"], label="float32 reference", lw=1, ls="--")
    ax.set_ylabel("loss")
    ax.set_xlabel("step")
    ax.legend(loc="upper right")
    fig.suptitle("jaxscale diagnostics")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="training steps")
    parser.add_argument("--seed", type=int, default=0, help="random seed")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate")
    parser.add_argument("--init-scale", type=float, default=2.0**24)
    parser.add_argument("--growth-interval", type=int, default=50)
    parser.add_argument(
        "--inject-at",
        default="20,150",
        help="comma-separated steps at which layer2's gradients are made inf",
    )
    parser.add_argument(
        "--out", type=Path, default=Path("examples/out"), help="folder for the plot"
    )
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}.")
    inject_at = [int(s) for s in args.inject_at.split(",") if s.strip()]

    key_data, key_params = jax.random.split(jax.random.key(args.seed))
    x_all, y_all = make_data(key_data, n=8192, dim=SIZES[0])
    params = init_mlp(key_params)

    @jax.jit
    def get_batch(step):
        idx = jax.random.randint(
            jax.random.fold_in(key_data, step), (args.batch_size,), 0, x_all.shape[0]
        )
        return x_all[idx], y_all[idx]

    # 1. Choose the scale from float32 gradients.
    grads32 = jax.grad(loss_fn)(params, get_batch(0), jnp.float32)
    report_underflow(grads32, args.init_scale)

    # 2./3. The float16 run, with every diagnostic on.
    events: list[jxs.diagnostics.OverflowEvent] = []
    ls = jxs.DynamicLossScale.create(
        init_scale=args.init_scale, growth_interval=args.growth_interval
    )
    tx = optax.chain(
        jxt.nonfinite_at(inject_at, paths="layer2/w"),  # the fault to find
        jxs.diagnostics.monitor(
            jxs.dynamic_scaling(optax.adam(args.lr), ls),
            on_overflow=events.append,
            warn_at_floor_after=100,
        ),
    )
    opt_state = tx.init(params)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def train_step(params, opt_state, batch):
        loss, grads = jxs.value_and_grad(loss_fn, opt_state)(params, batch, jnp.float16)
        used = jxs.loss_scale_of(opt_state)
        norms = jxs.diagnostics.layer_norms(used.unscale(grads), depth=1)
        updates, opt_state = tx.update(grads, opt_state, params)
        logs = {"loss": loss, "norms": norms, "scale_used": used.loss_scale}
        logs.update(jxs.diagnostics.summary(opt_state))
        return optax.apply_updates(params, updates), opt_state, logs

    # 4. The float32 reference run.
    tx32 = optax.adam(args.lr)
    params32 = jax.tree.map(jnp.copy, params)  # params are donated below
    state32 = tx32.init(params32)

    @jax.jit
    def train_step_f32(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch, jnp.float32)
        updates, opt_state = tx32.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    print(
        f"{args.steps} steps of float16 Adam on {jax.default_backend()}, init loss "
        f"scale {pow2(args.init_scale)}, inf injected into layer2/w at {inject_at}"
    )
    steps = range(args.steps)
    if tqdm is not None:  # disable=None: a bar on a terminal only.
        steps = tqdm(steps, desc="train", unit="step", disable=None, leave=False)
    logs, losses32 = [], []
    start = time.perf_counter()
    for step in steps:
        batch = get_batch(step)
        params, opt_state, log = train_step(params, opt_state, batch)
        params32, state32, loss32 = train_step_f32(params32, state32, batch)
        logs.append(log)  # device arrays: no sync here
        losses32.append(loss32)
    logs, losses32 = jax.device_get((logs, losses32))  # the one transfer
    jax.effects_barrier()  # every on_overflow call has run
    seconds = time.perf_counter() - start

    history = {
        key: np.array([log[key] for log in logs])
        for key in ("loss", "loss_scale", "scale_used", "last_step_finite")
    }
    history["norms"] = {
        name: np.array([log["norms"][name] for log in logs])
        for name in logs[0]["norms"]
    }
    history["loss_f32"] = np.array(losses32)

    print(f"overflow events: {len(events)}")
    for e in events[:8]:
        print(
            f"  step {e.step:4d}  scale {pow2(e.loss_scale)} -> "
            f"{pow2(e.next_loss_scale)}  {len(e.paths)} leaves: "
            f"{', '.join(e.paths[:4])}{' ...' if len(e.paths) > 4 else ''}"
        )
    injected = [e for e in events if e.step in inject_at]
    for e in injected:
        print(f"  injected at step {e.step}: found in {', '.join(e.paths)}")
    final = jax.device_get(jxs.diagnostics.summary(opt_state))
    print(
        f"done: {final['skipped_steps']} of {final['steps']} steps skipped, final "
        f"loss scale {pow2(final['loss_scale'])}, loss {history['loss'][-1]:.3g} "
        f"(float32: {history['loss_f32'][-1]:.3g}), {seconds:.1f} s"
    )
    if not args.no_plot:
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / "diagnostics.png"
        plot(path, history, [s for s in inject_at if s < args.steps])
        print(f"wrote {path.resolve()}")


if __name__ == "__main__":
    main()
