"""Handwritten digits: fp32 vs fp16 vs fp16 + loss scaling (hand-cast or autocast).

A small Flax (linen) CNN learns the 8x8 handwritten digits that ship with
scikit-learn (``sklearn.datasets.load_digits``: 1797 images, no download). The
same model, initial parameters, seed, batches and optimizer are trained four
times:

1. ``fp32``: float32 compute, the reference;
2. ``fp16``: float16 compute, no loss scaling;
3. ``fp16+jaxscale``: float16 compute, ``jxs.dynamic_scaling`` around the same
   optimizer, in the stock ``flax.training.train_state.TrainState``;
4. ``fp16+autocast``: as 3, but the loss function is the plain float32 one of
   run 1 (no cast written anywhere) wrapped in ``jxs.autocast``, which runs the
   convolutions and matmuls in float16 and the cross-entropy in float32.

The master parameters stay in float32 in every run. In runs 1 to 3 the loss
function casts the parameters and the images to the compute dtype, so the
forward and backward passes run in it, and reduces the cross-entropy (a mean
over the batch) in float32. The setting favours underflow: a mean over the
batch divides every per-example gradient by the batch size, the kernels start at
0.3 times the usual (LeCun) scale, and the optimizer is SGD with momentum, which
(unlike Adam) does not rescale small gradients, so what float16 flushes to zero
is simply lost.

The script prints an accuracy table, then measures on one batch which fraction
of the gradient elements that are non-zero in float32 come out of the float16
backward pass as zero (or subnormal), without a loss scale and with one, and
saves a plot (loss curves; the loss scale with the skipped steps marked).

Run it (under a minute on a 2-core CPU)::

    python examples/digits_cnn.py --steps 1500 --seed 0
"""

from __future__ import annotations

import argparse
import functools
import os
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from flax.training import train_state

import jaxscale as jxs

try:  # The progress bar is optional.
    from tqdm import tqdm
except ImportError:  # pragma: no cover - depends on the environment
    tqdm = None


INIT_SCALE = 2.0**16  # torch's default


class CNN(nn.Module):
    """Two 3x3 convolutions (8x8 -> 6x6 -> 4x4) and two dense layers.

    Its dtype follows its inputs: given float16 parameters and images it
    computes in float16. ``init_std`` scales the (truncated normal) fan-in
    initialiser of every kernel: a small initialisation makes small gradients.
    """

    init_std: float = 1.0

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        init = nn.initializers.variance_scaling(
            self.init_std**2, "fan_in", "truncated_normal"
        )
        x = nn.relu(nn.Conv(16, (3, 3), padding="VALID", kernel_init=init)(x))
        x = nn.relu(nn.Conv(32, (3, 3), padding="VALID", kernel_init=init)(x))
        x = x.reshape(x.shape[0], -1)
        x = nn.relu(nn.Dense(64, kernel_init=init)(x))
        return nn.Dense(10, kernel_init=init)(x)


def load_data(seed: int, test_fraction: float = 0.25):
    """The digits as ``f32[n, 8, 8, 1]`` in [0, 1] and ``i32[n]`` labels, split."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:  # pragma: no cover - depends on the environment
        raise SystemExit(
            "This example needs scikit-learn for its bundled digits dataset: "
            "pip install scikit-learn"
        ) from None

    digits = load_digits()
    x = (digits.images / 16.0).astype(np.float32)[..., None]
    y = digits.target.astype(np.int32)
    perm = np.random.default_rng(seed).permutation(len(y))
    n_test = int(round(test_fraction * len(y)))
    test, train = perm[:n_test], perm[n_test:]
    return (x[train], y[train]), (x[test], y[test])


def make_loss_fn(model: CNN, compute_dtype: Any, autocast: bool = False) -> Callable:
    """Cross-entropy, a mean over the batch: ``compute_dtype`` compute, f32 loss.

    With ``autocast``, the float32 loss (no cast) under ``jxs.autocast``.
    """
    if autocast:

        def plain(params, x, y):
            logits = model.apply({"params": params}, x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        return jxs.autocast(plain, compute_dtype)

    def loss_fn(params, x, y):
        cast = jax.tree.map(lambda p: p.astype(compute_dtype), params)
        logits = model.apply({"params": cast}, x.astype(compute_dtype))
        logits = logits.astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    return loss_fn


def train(
    name: str,
    model: CNN,
    params: Any,
    data: tuple[np.ndarray, np.ndarray],
    args: argparse.Namespace,
    *,
    compute_dtype: Any,
    scaling: bool,
    autocast: bool = False,
) -> dict[str, Any]:
    """Trains one run; returns its final state and per-step history."""
    loss_fn = make_loss_fn(model, compute_dtype, autocast)
    # Constant, then a cosine decay to 0 over the last 30% of the steps: the runs
    # end calm, so their final accuracies can be compared.
    hold = int(0.7 * args.steps)
    schedule = optax.join_schedules(
        [
            optax.constant_schedule(args.lr),
            optax.cosine_decay_schedule(args.lr, max(args.steps - hold, 1)),
        ],
        [hold],
    )
    tx = optax.sgd(schedule, momentum=0.9)
    if scaling:
        tx = jxs.dynamic_scaling(
            tx,
            jxs.DynamicLossScale.create(
                init_scale=INIT_SCALE, growth_interval=args.growth_interval
            ),
        )
    # A copy: the step donates its state, and every run starts from `params`.
    params = jax.tree.map(jnp.copy, params)
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)
    x_train, y_train = (jnp.asarray(a) for a in data)
    key = jax.random.key(args.seed)

    @functools.partial(jax.jit, donate_argnums=0)
    def train_step(state, step):
        # The same batches in every run: they depend on the seed and step only.
        idx = jax.random.randint(
            jax.random.fold_in(key, step), (args.batch_size,), 0, x_train.shape[0]
        )
        x, y = x_train[idx], y_train[idx]
        if scaling:
            # Gradients of the scaled loss; dynamic_scaling unscales them.
            loss, grads = jxs.value_and_grad(loss_fn, state)(state.params, x, y)
        else:
            loss, grads = jax.value_and_grad(loss_fn)(state.params, x, y)
        state = state.apply_gradients(grads=grads)
        if scaling:
            s = jxs.diagnostics.summary(state.opt_state)
            scale, finite = s["loss_scale"], s["last_step_finite"]
        else:
            scale, finite = jnp.ones((), jnp.float32), jnp.ones((), jnp.bool_)
        return state, (loss, scale, finite)

    history = []
    steps = range(args.steps)
    if tqdm is not None:  # disable=None: a bar on a terminal only.
        steps = tqdm(steps, desc=f"{name:>14}", unit="step", disable=None, leave=False)
    start = time.perf_counter()
    for step in steps:
        # No host sync in the loop: the history stays on the device until the end.
        state, record = train_step(state, step)
        history.append(record)
    losses, scales, finite = (
        np.asarray(jnp.stack(h)) for h in zip(*history, strict=True)
    )
    seconds = time.perf_counter() - start
    return {
        "name": name,
        "state": state,
        "compute_dtype": compute_dtype,
        "scaling": scaling,
        "autocast": autocast,
        "loss": losses,
        "scale": scales,
        "finite": finite,
        "seconds": seconds,
    }


def accuracy(model, params, compute_dtype, x, y, autocast=False) -> float:
    """Top-1 accuracy of ``params`` with the run's compute dtype (and autocast)."""
    if autocast:
        apply = jxs.autocast(lambda p, x: model.apply({"params": p}, x), compute_dtype)
        logits = jax.jit(apply)(params, jnp.asarray(x))
    else:
        cast = jax.tree.map(lambda p: p.astype(compute_dtype), params)
        logits = model.apply({"params": cast}, jnp.asarray(x, compute_dtype))
    return float(jnp.mean(jnp.argmax(logits, axis=-1) == y))


def gradient_underflow(model, params, x, y, scale: float) -> dict[str, Any]:
    """Which gradient elements the float16 backward pass loses at loss scale ``scale``.

    The reference is the float32 gradient (float32 compute) of the same
    parameters and batch. Among its non-zero elements, counts those that the
    float16 backward pass of ``scale * loss`` returns as exactly zero (flushed),
    and those it returns as float16 subnormals (magnitude below ``2**-14``
    before unscaling: a few bits of precision left), overall and per layer. Also
    returns the relative L2 error of the unscaled float16 gradient.
    """
    ref = jax.grad(make_loss_fn(model, jnp.float32))(params, x, y)
    grads = jax.grad(lambda p: make_loss_fn(model, jnp.float16)(p, x, y) * scale)(
        params
    )  # float32 leaves holding float16 values: the scaled gradients.
    tiny = float(jnp.finfo(jnp.float16).smallest_normal)

    def fractions(g, r):
        g = jnp.concatenate([a.ravel() for a in jax.tree.leaves(g)])
        r = jnp.concatenate([a.ravel() for a in jax.tree.leaves(r)])
        live = r != 0
        n = jnp.sum(live)
        flushed = float(jnp.sum(live & (g == 0)) / n)
        subnormal = float(jnp.sum(live & (g != 0) & (jnp.abs(g) < tiny)) / n)
        error = float(jnp.linalg.norm(g / scale - r) / jnp.linalg.norm(r))
        return flushed, subnormal, error

    flushed, subnormal, error = fractions(grads, ref)
    layers = {k: fractions(grads[k], ref[k])[0] for k in ref}
    return {
        "flushed": flushed,
        "subnormal": subnormal,
        "rel_error": error,
        "layers": layers,
        "ref": ref,
    }


def plot(runs, path: str) -> bool:
    """Saves loss curves and the loss scale to ``path``; False without matplotlib."""
    try:
        import matplotlib
    except ImportError:  # pragma: no cover - depends on the environment
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_scale) = plt.subplots(1, 2, figsize=(11, 4))
    window = 20
    for run in runs:
        loss = run["loss"]
        if len(loss) >= window:  # A running mean: per-batch losses are noisy.
            smooth = np.convolve(loss, np.ones(window) / window, mode="valid")
            ax_loss.plot(np.arange(window, len(loss) + 1), smooth, label=run["name"])
        else:
            ax_loss.plot(np.arange(1, len(loss) + 1), loss, label=run["name"])
    ax_loss.set(xlabel="step", ylabel=f"train loss (mean of {window})", yscale="log")
    ax_loss.set_title("training loss")
    ax_loss.legend()

    for marker, scaled in zip("xo", [r for r in runs if r["scaling"]], strict=False):
        steps = np.arange(1, len(scaled["scale"]) + 1)
        # The scale used on each step: the initial scale, then the state after it.
        used = np.concatenate([[INIT_SCALE], scaled["scale"][:-1]])
        (line,) = ax_scale.step(steps, used, where="post", label=scaled["name"])
        skipped = ~scaled["finite"]
        ax_scale.plot(
            steps[skipped],
            used[skipped],
            marker,
            color=line.get_color(),
            fillstyle="none",
            label=f"{scaled['name']} skipped ({skipped.sum()})",
        )
    ax_scale.set(xlabel="step", ylabel="loss scale", yscale="log")
    ax_scale.set_yscale("log", base=2)
    ax_scale.set_title("loss scale")
    ax_scale.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1500, help="training steps")
    parser.add_argument("--seed", type=int, default=0, help="random seed")
    parser.add_argument("--out", default="examples/out", help="folder for plots")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=0.1, help="SGD learning rate")
    parser.add_argument(
        "--init-std",
        type=float,
        default=0.3,
        help="multiplier of the std of the (LeCun) init of every kernel",
    )
    parser.add_argument("--growth-interval", type=int, default=200)
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}.")

    train_data, test_data = load_data(args.seed)
    model = CNN(init_std=args.init_std)
    params = model.init(jax.random.key(args.seed), jnp.zeros((1, 8, 8, 1)))["params"]
    print(
        f"jaxscale {jxs.__version__}: digits, {len(train_data[1])} train / "
        f"{len(test_data[1])} test images, {args.steps} steps of SGD "
        f"(batch {args.batch_size}) per run on {jax.default_backend()}"
    )

    settings = [  # name, compute dtype, loss scaling, autocast
        ("fp32", jnp.float32, False, False),
        ("fp16", jnp.float16, False, False),
        ("fp16+jaxscale", jnp.float16, True, False),
        ("fp16+autocast", jnp.float16, True, True),
    ]
    runs = [
        train(
            name,
            model,
            params,
            train_data,
            args,
            compute_dtype=dt,
            scaling=s,
            autocast=a,
        )
        for name, dt, s, a in settings
    ]

    print(
        f"\n{'run':<14} {'train acc':>9} {'test acc':>9} {'final loss':>10} "
        f"{'skipped':>8} {'final scale':>11} {'time':>6}"
    )
    for run in runs:
        p = run["state"].params
        dt = run["compute_dtype"]
        train_acc = accuracy(model, p, dt, *train_data, run["autocast"])
        test_acc = accuracy(model, p, dt, *test_data, run["autocast"])
        run["test_acc"] = test_acc
        # The mean loss of the last 20 steps: per-batch losses are noisy.
        final_loss = float(np.mean(run["loss"][-20:]))
        if run["scaling"]:
            skipped = f"{int(run['state'].opt_state.skipped_steps)}"
            scale = f"2**{np.log2(run['scale'][-1]):g}"
        else:
            skipped = scale = "-"
        print(
            f"{run['name']:<14} {100 * train_acc:>8.2f}% {100 * test_acc:>8.2f}% "
            f"{final_loss:>10.4f} {skipped:>8} {scale:>11} {run['seconds']:>5.1f}s"
        )
    gap = 100 * (runs[2]["test_acc"] - runs[0]["test_acc"])
    print(f"fp16+jaxscale vs fp32 test accuracy: {gap:+.2f} points")
    gap = 100 * (runs[3]["test_acc"] - runs[2]["test_acc"])
    print(f"fp16+autocast vs fp16+jaxscale test accuracy: {gap:+.2f} points")

    # Underflow, on one batch: at the initial parameters with the initial scale,
    # and at the trained fp32 parameters with the final scale of fp16+jaxscale.
    x = jnp.asarray(train_data[0][: args.batch_size])
    y = jnp.asarray(train_data[1][: args.batch_size])
    final_scale = float(runs[2]["scale"][-1])
    names = list(params)
    print(
        f"\nfloat16 gradients vs float32 on one batch of {args.batch_size} (% of the "
        "elements that are non-zero in float32)"
    )
    print(
        f"{'params':<8} {'loss scale':>10} {'flushed':>8} {'subnormal':>9} "
        f"{'rel.err':>8}   flushed by layer: {' '.join(names)}"
    )
    trained = runs[0]["state"].params
    cases = [("initial", params, INIT_SCALE), ("trained", trained, final_scale)]
    for label, p, scale in cases:
        for s in (1.0, scale):
            m = gradient_underflow(model, p, x, y, s)
            per_layer = " ".join(f"{100 * m['layers'][k]:.1f}%" for k in names)
            print(
                f"{label:<8} {f'2**{np.log2(s):g}':>10} {100 * m['flushed']:>7.2f}% "
                f"{100 * m['subnormal']:>8.2f}% {m['rel_error']:>8.1e}   {per_layer}"
            )
        # jxs.diagnostics.underflow_report asks the same of the float32 parameter
        # gradients
        # (cast to float16), without running a float16 backward pass.
        r = jxs.diagnostics.underflow_report(m["ref"], jnp.float16, scale)
        print(
            f"{'':<8} underflow_report(fp32 grads): "
            f"{100 * float(r.zero_fraction_unscaled):.2f}% zero unscaled, "
            f"{100 * float(r.zero_fraction):.2f}% at 2**{np.log2(scale):g}; "
            f"suggested init_scale 2**{np.log2(float(r.init_scale_low)):g}"
            f"..2**{np.log2(float(r.init_scale_high)):g}"
        )

    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "digits_cnn.png")
    if plot(runs, path):
        print(f"\nplot saved to {os.path.abspath(path)}")
    else:
        print("\nno plot: matplotlib is not installed (pip install matplotlib)")


if __name__ == "__main__":
    main()
