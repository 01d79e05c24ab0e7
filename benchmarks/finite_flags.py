"""How many collectives carry ``dynamic_scaling``'s finite flags per step.

A small transformer-shaped model (an embedding, two blocks of LayerNorm and a
two-layer MLP, a vocabulary projection) written with flax linen, flax NNX and
equinox, trained by ``jxs.dynamic_scaling(optax.adamw)`` under ``jit`` in three
layouts: data parallel (the batch split over ``data``, parameters replicated),
FSDP (each parameter split over ``data`` on its first dimension divisible by
the mesh) and tensor parallel (mesh ``data`` x ``model`` = 2 x 4; each MLP's
first kernel split by columns over ``model``, its second by rows). Each step is
compiled, not run, for 8 CPU devices or (``--target h200``) for 8 deviceless
H200s, and ``jxs.diagnostics.collective_report`` counts the collectives that
carry finite flags (named by jaxscale's ``FINITE_SCOPE``), with the number of
arrays they carry.

    python benchmarks/finite_flags.py               # 8 CPU devices
    python benchmarks/finite_flags.py --target h200 # 8 H200s, deviceless
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

LIBRARIES = ("linen", "nnx", "equinox")
LAYOUTS = ("data parallel", "fsdp", "tensor parallel", "fsdp+tp")
VOCAB, D, HIDDEN, BLOCKS, BATCH, SEQ = 64, 32, 128, 2, 16, 8


def _linen():
    import flax.linen as nn

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.LayerNorm(name="ln")(x)
            h = nn.Dense(HIDDEN, name="fc_in")(h)
            return x + nn.Dense(D, name="fc_out")(nn.gelu(h))

    class Model(nn.Module):
        @nn.compact
        def __call__(self, tokens):
            x = nn.Embed(VOCAB, D, name="embed")(tokens)
            for i in range(BLOCKS):
                x = Block(name=f"block_{i}")(x)
            return nn.Dense(VOCAB, name="head")(nn.LayerNorm(name="ln_f")(x))

    import jax
    import jax.numpy as jnp

    model = Model()
    params = model.init(jax.random.key(0), jnp.zeros((1, SEQ), jnp.int32))

    def logits(params, tokens):
        return model.apply(params, tokens)

    return params, logits


def _nnx():
    import jax.numpy as jnp
    from flax import nnx

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.ln = nnx.LayerNorm(D, rngs=rngs)
            self.fc_in = nnx.Linear(D, HIDDEN, rngs=rngs)
            self.fc_out = nnx.Linear(HIDDEN, D, rngs=rngs)

        def __call__(self, x):
            return x + self.fc_out(nnx.gelu(self.fc_in(self.ln(x))))

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
            self.blocks = nnx.List([Block(rngs) for _ in range(BLOCKS)])
            self.ln_f = nnx.LayerNorm(D, rngs=rngs)
            self.head = nnx.Linear(D, VOCAB, rngs=rngs)

        def __call__(self, tokens):
            x = self.embed(tokens)
            for block in self.blocks:
                x = block(x)
            return self.head(self.ln_f(x))

    graphdef, params = nnx.split(Model(nnx.Rngs(0)), nnx.Param)
    params = nnx.to_pure_dict(params)

    def logits(params, tokens):
        state = nnx.State(params)
        return nnx.merge(graphdef, state)(tokens)

    del jnp
    return params, logits


def _equinox():
    import equinox as eqx
    import jax

    class Block(eqx.Module):
        ln: eqx.nn.LayerNorm
        fc_in: eqx.nn.Linear
        fc_out: eqx.nn.Linear

        def __init__(self, key):
            k1, k2 = jax.random.split(key)
            self.ln = eqx.nn.LayerNorm(D)
            self.fc_in = eqx.nn.Linear(D, HIDDEN, key=k1)
            self.fc_out = eqx.nn.Linear(HIDDEN, D, key=k2)

        def __call__(self, x):
            return x + self.fc_out(jax.nn.gelu(self.fc_in(self.ln(x))))

    class Model(eqx.Module):
        embed: eqx.nn.Embedding
        blocks: list
        ln_f: eqx.nn.LayerNorm
        head: eqx.nn.Linear

        def __init__(self, key):
            keys = jax.random.split(key, BLOCKS + 2)
            self.embed = eqx.nn.Embedding(VOCAB, D, key=keys[0])
            self.blocks = [Block(k) for k in keys[1:-1]]
            self.ln_f = eqx.nn.LayerNorm(D)
            self.head = eqx.nn.Linear(D, VOCAB, key=keys[-1])

        def __call__(self, tokens):
            def one(t):
                x = self.embed(t)
                for block in self.blocks:
                    x = block(x)
                return self.head(self.ln_f(x))

            return jax.vmap(jax.vmap(one))(tokens)

    params, static = eqx.partition(Model(jax.random.key(0)), eqx.is_inexact_array)

    def logits(params, tokens):
        return eqx.combine(params, static)(tokens)

    return params, logits


MODELS = {"linen": _linen, "nnx": _nnx, "equinox": _equinox}


def _specs(params, layout, n):
    """The ``PartitionSpec`` of each parameter for ``layout``."""
    import jax
    from jax.sharding import PartitionSpec as P

    def fsdp(x):
        for i, d in enumerate(x.shape):
            if d % n == 0:
                return P(*([None] * i), "data")
        return P()

    def tensor(path, x):
        # Column-parallel first MLP kernel (and its bias), row-parallel second:
        # Megatron's split. Linen and NNX keep kernels (in, out), equinox
        # (out, in).
        name = jax.tree_util.keystr(path)
        eqx_layout = "weight" in name
        if "fc_in" in name:
            if x.ndim == 1:
                return P("model")
            return P("model", None) if eqx_layout else P(None, "model")
        if "fc_out" in name and x.ndim == 2:
            return P(None, "model") if eqx_layout else P("model", None)
        return P()

    if layout == "data parallel":
        return jax.tree.map(lambda _: P(), params)
    if layout == "fsdp":
        return jax.tree.map(fsdp, params)
    tp = jax.tree_util.tree_map_with_path(tensor, params)
    if layout == "tensor parallel":
        return tp

    def both(x, spec):
        # FSDP over ``data`` on the first free dimension divisible by it.
        spec = tuple(spec) + (None,) * (x.ndim - len(spec))
        for i, d in enumerate(x.shape):
            if spec[i] is None and d % n == 0:
                return P(*spec[:i], "data", *spec[i + 1 :])
        return P(*spec)

    return jax.tree.map(both, params, tp)


def finite_flag_collectives(library, layout, mesh, dtype=None):
    """The collectives carrying finite flags in the compiled step, and the
    whole report."""
    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxscale as jxs

    params, logits = MODELS[library]()
    n = mesh.shape["data"]
    specs = _specs(params, layout, n)
    tx = jxs.dynamic_scaling(optax.adamw(1e-3))
    state = jax.eval_shape(tx.init, params)

    def abstract(x, spec):
        return jax.ShapeDtypeStruct(
            x.shape, x.dtype, sharding=NamedSharding(mesh, spec)
        )

    a_params = jax.tree.map(abstract, params, specs)
    a_state = jax.tree.map(lambda x: abstract(x, P()), state)
    a_state = a_state._replace(
        inner_state=jax.tree.map(lambda x: abstract(x, P()), state.inner_state)
    )
    tokens = jax.ShapeDtypeStruct(
        (BATCH, SEQ), jnp.int32, sharding=NamedSharding(mesh, P("data"))
    )

    def loss_fn(params, tokens):
        out = logits(params, tokens).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(out, tokens).mean()

    def step(params, state, tokens):
        with jax.numpy_dtype_promotion("standard"):
            loss, grads = jxs.value_and_grad(loss_fn, state)(params, tokens)
            updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    report = jxs.diagnostics.collective_report(step)(a_params, a_state, tokens)
    return report.select(carries="finite flags"), report


def _mesh(target, layout):
    import jax

    shape, names = (
        ((2, 4), ("data", "model")) if "t" in layout.split()[0] else ((8,), ("data",))
    )
    if target is None:
        from jax.sharding import AxisType

        return jax.make_mesh(
            shape,
            names,
            axis_types=(AxisType.Auto,) * len(shape),
            devices=jax.devices("cpu")[:8],
        )
    from benchmarks.hlo_account import gpu_mesh

    return gpu_mesh(target, shape, names)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", choices=("h100", "h200"), default=None)
    parser.add_argument("--library", choices=LIBRARIES, action="append")
    parser.add_argument("--layout", choices=LAYOUTS, action="append")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    if args.target is None:
        os.environ.setdefault("XLA_FLAGS", "")
        import jax

        jax.config.update("jax_num_cpu_devices", 8)
    where = "8 CPU devices" if args.target is None else f"8 {args.target} (deviceless)"
    print(f"finite-flag collectives per step, {where}")
    print("| model | layout | collectives | arrays |")
    print("|---|---|---|---|")
    for library in args.library or LIBRARIES:
        for layout in args.layout or LAYOUTS:
            flags, report = finite_flag_collectives(
                library, layout, _mesh(args.target, layout)
            )
            arrays = ", ".join(f"{c.dtype}{list(c.shape)}" for c in flags)
            count = len({c.instruction or c.name for c in flags})
            print(f"| {library} | {layout} | {count} | {arrays} |")
            if args.verbose:
                print(report)


if __name__ == "__main__":
    main()
