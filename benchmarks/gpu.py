"""Mixed precision on one GPU: jaxscale's float16 steps, float32, bfloat16 and torch.

One command, one table. For two models, six jitted JAX train steps are built and
timed side by side in one process, in interleaved rounds (the order rotates every
round, so slow drifts of the machine hit every variant alike):

* ``float32``: everything in float32;
* ``bfloat16``: computed in bfloat16, cast by hand (parameters cast inside the
  loss, float32 master weights), no loss scaling;
* ``float16 hand bare``: computed in float16, cast by hand, plain
  ``jax.value_and_grad``, no loss scaling: the bare float16 step, the reference
  of every ratio;
* ``float16 hand + dynamic_scaling``: the same loss through
  ``jxs.value_and_grad(loss_fn, opt_state)`` and
  ``jxs.dynamic_scaling(optax.adamw(...))``;
* ``float16 autocast bare``: the float32 loss wrapped as
  ``jxs.autocast(loss_fn, dtype=jnp.float16)``, plain ``jax.value_and_grad``;
* ``float16 autocast + dynamic_scaling``.

Each step is loss, gradients, ``optax.adamw`` update and ``optax.apply_updates``,
jitted with ``donate_argnums`` on parameters and optimizer state. The loss (log
softmax and cross-entropy) is computed in float32 in every variant. Hand-cast
steps follow Flax's ``dtype=`` style: the residual stream and every matmul in the
compute dtype, layer-norm statistics, the attention softmax and the loss in
float32. Autocast decides per operation as torch's autocast does (matmuls in
float16, residual adds promoted to float32). ``float32`` matmuls run at JAX's
default precision (which lets XLA:GPU use TF32 on recent NVIDIA GPUs).

Each step is compiled once, fresh (``jitted.lower(...).compile()``: the compile
column, trace + lower then XLA, autotuning included on a GPU), and then run
through that compiled object (the same executable and C++ dispatch path as
calling the jitted function). Every variant gets two warm-up steps before the
timed rounds. The data are random tokens (fixed seed), generated on the device
once; every step sees the same batch.

Models (Flax linen, float32 parameters):

* ``realistic``: a GPT-2-small-sized decoder: 12 layers, d_model 768, 12 heads,
  MLP 3072 (tanh GELU), vocabulary 50304 (50257 padded to a multiple of 64),
  sequence 1024, learned positional embeddings, pre-LayerNorm, biases, output
  head **tied** to the token embedding: 124,475,904 parameters. Batch 8 x 1024
  tokens by default (``--batch``). Attention is written out (scores, causal mask,
  float32 softmax, weighted sum), so XLA compiles it like any other op; its
  float32 scores make it memory-hungry: XLA:CPU's buffer assignment gives one
  step about 27 GB of temporaries at batch 8 and 53 GB at batch 16 (the ``hlo:``
  lines print XLA:GPU's figure, ``temp MiB``; raise ``--batch`` if it leaves
  room).
* ``small``: the same code, dispatch-bound: 2 layers, d 128, 4 heads, MLP 512,
  vocabulary 1024, sequence 128, batch 8.

Rounds: realistic 7 rounds of 10 steps per variant, small 11 rounds of 50
(``--rounds``, ``--steps-per-round`` set both).

Torch: the realistic model again in plain ``torch.nn`` (same sizes, same tied
head, same written-out attention, so both frameworks do the same work),
``torch.autocast("cuda", dtype=torch.float16)``, ``torch.optim.AdamW`` (fused
where available) and ``torch.amp.GradScaler``, timed in interleaved rounds
against its bare float16 autocast step (no GradScaler), ratios paired per round
as for JAX (torch has no compile column). The ratio "GradScaler
step / bare autocast step" is the anchor to hold jaxscale's "dynamic_scaling /
bare" against. Torch runs in a child process, before JAX touches the GPU: two
frameworks in one process would share neither their memory pools nor,
necessarily, their CUDA libraries. With ``--tiny`` it runs on the CPU in bfloat16
(``torch.autocast("cpu")``, ``torch.amp.GradScaler("cpu")``). Both frameworks
start at a loss scale of 2**10 with torch's default growth interval (2000), so
every timed step is finite and applied (the "scaling:" lines say so).

Printed (stdout; progress goes to stderr):

* ``env:`` lines: versions, the device, CUDA versions, ``XLA_FLAGS``;
* the table: per model and variant, the median step time, tokens/s, the ratio to
  the bare float16 step of the same framework (median and quartiles of the
  per-round paired ratios) and the compile time (trace + lower, then XLA);
* ``anchor:`` lines: dynamic_scaling/bare (jax, hand and autocast) against
  GradScaler/bare (torch);
* ``host blocking:`` lines: the time to *enqueue* N steps (the loop of calls,
  without blocking) against the time until they have all *run*. An enqueue/run
  ratio near 1 means the host waited for the device on every step (a host round
  trip per step, as a ``conditional`` outside a CUDA graph costs on XLA:GPU);
  well below 1 means dispatch is asynchronous. Measured after the timed rounds
  for the four float16 variants (N = 16, medians of 3 repeats); N stays below
  the 32 executions that a PJRT GPU client keeps in flight. The torch lines are
  for reference: torch launches every kernel from the host, so a full CUDA
  launch queue also makes it wait;
* ``hlo:`` lines: for each compiled JAX step, the ``conditional`` and ``while``
  instructions of its optimized HLO and how many sit inside a CUDA-graph command
  buffer (a computation whose name contains ``command_buffer``, or one called
  from it), the number of command buffers, and the temporary memory;
* ``account:`` lines: for each model, float16 cast by hand and through
  autocast, the kernels of the compiled step with ``dynamic_scaling`` against
  the bare one, from their optimized HLO (``benchmarks/step_account.py``: the
  totals, the kinds of kernel that changed, the kernels added and removed,
  with the bytes each reads and writes);
* ``scaling:`` lines: skipped steps and the final loss scale;
* ``FAILED:`` lines, if a model or the torch child failed (the rest is still
  printed; the exit code is then 1).

Run it from the repository root (it imports jaxscale from this checkout) on a
machine with one NVIDIA GPU, and paste back **all of stdout** (and the end of
stderr if a ``FAILED:`` line shows up)::

    python benchmarks/gpu.py

An estimate, not yet measured: 5 to 7 minutes on an H100, most of it in the
twelve XLA compiles (the six realistic ones, 30 to 60 s each), well under the
10-minute budget. ``XLA_PYTHON_CLIENT_PREALLOCATE`` defaults to ``false`` here
so that JAX holds only the memory it uses. Other runs::

    python benchmarks/gpu.py --batch 16        # if the temp MiB leave room
    python benchmarks/gpu.py --models small --no-torch --rounds 21

Without a GPU the full configuration refuses to start (exit code 2: a
124M-parameter model on a CPU would take hours). ``--tiny`` runs tiny models (1
layer each) on whatever JAX finds and torch on the CPU, 2 rounds of 2 steps,
and compiles the steps with ``xla_cpu_use_fusion_emitters=False`` and
``xla_backend_optimization_level=0`` (four times faster on a CPU; its ``hlo:``
lines describe those programs: XLA:CPU's older emitters turn scatters into
``while`` loops); the test suite runs it (``tests/test_gpu_benchmark.py``)::

    python benchmarks/gpu.py --tiny
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run from anywhere, jaxscale from this checkout
    sys.path.insert(0, str(ROOT))

import jaxscale as jxs  # noqa: E402 (after the path)
from jaxscale import _hlo  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))  # the sibling hlo_account.py
import hlo_account  # noqa: E402 (after the path)

F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16
LR, WEIGHT_DECAY = 1e-4, 0.01
# Finite float16 backward passes at this scale for both models: every timed
# step is applied. torch's GradScaler starts at the same scale.
INIT_SCALE = 2.0**10
BARE = "float16 hand bare"
VARIANTS = (
    "float32",
    "bfloat16",
    BARE,
    "float16 hand + dynamic_scaling",
    "float16 autocast bare",
    "float16 autocast + dynamic_scaling",
)
# Host blocking is measured for the float16 steps.
ENQUEUE_VARIANTS = VARIANTS[2:]
# The start of the run (the torch child takes its parent's): the progress log's
# clock and the total wall time.
START = {"time": time.time()}


def log(msg: str) -> None:
    """Progress, with the elapsed wall time, to stderr."""
    elapsed = time.time() - START["time"]
    print(f"[{elapsed:6.1f}s] {msg}", file=sys.stderr, flush=True)


@dataclasses.dataclass(frozen=True)
class Size:
    """A decoder's sizes and its batch."""

    layers: int
    d_model: int
    heads: int
    mlp: int
    vocab: int
    seq: int
    batch: int

    def describe(self) -> str:
        return (
            f"{self.layers} layers, d {self.d_model}, {self.heads} heads, "
            f"MLP {self.mlp}, vocab {self.vocab}, seq {self.seq}, batch {self.batch}"
        )


SIZES = {
    "full": {
        "realistic": Size(12, 768, 12, 3072, 50304, 1024, 8),
        "small": Size(2, 128, 4, 512, 1024, 128, 8),
    },
    "tiny": {
        "realistic": Size(1, 64, 4, 256, 512, 64, 2),
        "small": Size(1, 32, 2, 128, 128, 16, 2),
    },
}
# Tokens per step of each model, set by main() from the sizes in use.
TOKENS: dict[str, int] = {}
# (rounds, steps per round) per model; --rounds / --steps-per-round override.
ROUNDS = {
    "full": {"realistic": (7, 10), "small": (11, 50)},
    "tiny": {"realistic": (2, 2), "small": (2, 2)},
}
# (steps enqueued, repeats) for the host-blocking measurement.
ENQUEUE = {"full": (16, 3), "tiny": (2, 1)}
# Compiler options: with --tiny, XLA:CPU's older fusion emitters and LLVM at
# -O0 compile a tiny step about four times faster (options this XLA does not
# know are dropped).
FAST = {
    "full": {},
    "tiny": {"xla_backend_optimization_level": 0, "xla_cpu_use_fusion_emitters": False},
}


# --------------------------------------------------------------------------- #
# The JAX model: Flax linen, float32 parameters, compute in `dtype`.
# --------------------------------------------------------------------------- #


class LayerNorm(nn.Module):
    """Layer norm with its statistics in float32 and its output in ``dtype``."""

    dtype: Any = F32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        d = x.shape[-1]
        scale = self.param("scale", nn.initializers.ones, (d,))
        bias = self.param("bias", nn.initializers.zeros, (d,))
        x = x.astype(F32)
        mean = jnp.mean(x, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
        y = (x - mean) * jax.lax.rsqrt(var + 1e-5)
        return (y * scale.astype(F32) + bias.astype(F32)).astype(self.dtype)


class Attention(nn.Module):
    """Causal multi-head self-attention, written out; softmax in float32."""

    heads: int
    dtype: Any = F32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        b, t, d = x.shape
        hd = d // self.heads
        qkv = nn.Dense(3 * d, dtype=self.dtype, name="qkv")(x)
        qkv = qkv.reshape(b, t, 3, self.heads, hd)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * (1.0 / math.sqrt(hd))
        causal = jnp.tril(jnp.ones((t, t), jnp.bool_))
        s = jnp.where(causal, s.astype(F32), jnp.finfo(F32).min)
        p = jax.nn.softmax(s, axis=-1).astype(self.dtype)
        y = jnp.einsum("bhqk,bkhd->bqhd", p, v).reshape(b, t, d)
        return nn.Dense(d, dtype=self.dtype, name="proj")(y)


class Block(nn.Module):
    """Pre-LayerNorm block: attention, then a tanh-GELU MLP."""

    heads: int
    mlp: int
    dtype: Any = F32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        d = x.shape[-1]
        x = x + Attention(self.heads, self.dtype)(LayerNorm(self.dtype)(x))
        h = nn.Dense(self.mlp, dtype=self.dtype)(LayerNorm(self.dtype)(x))
        return x + nn.Dense(d, dtype=self.dtype)(nn.gelu(h, approximate=True))


class GPT(nn.Module):
    """A GPT-2-style decoder with learned positions and a tied output head.

    ``dtype`` is the compute dtype of a hand-cast step (Flax's ``dtype=``
    style); the parameters are float32 and the caller casts them to ``dtype``.
    Returns logits in ``dtype``.
    """

    size: Size
    dtype: Any = F32

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        c = self.size
        init = nn.initializers.normal(0.02)
        embed = nn.Embed(c.vocab, c.d_model, dtype=self.dtype, embedding_init=init)
        pos = self.param("pos", init, (c.seq, c.d_model))
        x = embed(tokens) + pos[: tokens.shape[1]].astype(self.dtype)
        for _ in range(c.layers):
            x = Block(c.heads, c.mlp, self.dtype)(x)
        return embed.attend(LayerNorm(self.dtype)(x))


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy, computed in float32."""
    logp = jax.nn.log_softmax(logits.astype(F32), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, labels[..., None], axis=-1))


def loss_fns(size: Size) -> dict[str, Callable[..., jax.Array]]:
    """``{variant: loss_fn(params, batch)}``; params are float32 in every one."""

    def hand(dtype: Any) -> Callable[..., jax.Array]:
        net = GPT(size, dtype)

        def loss_fn(params, batch):
            tokens, labels = batch
            cast = jax.tree.map(lambda p: p.astype(dtype), params)
            return cross_entropy(net.apply(cast, tokens), labels)

        return loss_fn

    float32 = hand(F32)  # every cast a no-op: the plain float32 model
    autocast = jxs.autocast(float32, dtype=F16)
    return {
        "float32": float32,
        "bfloat16": hand(BF16),
        BARE: hand(F16),
        "float16 hand + dynamic_scaling": hand(F16),
        "float16 autocast bare": autocast,
        "float16 autocast + dynamic_scaling": autocast,
    }


def make_step(
    loss_fn: Callable[..., jax.Array], scaled: bool
) -> tuple[Callable[..., Any], optax.GradientTransformation]:
    """A jitted train step (donating params and opt state) and its optimizer.

    ``scaled``: ``jxs.value_and_grad`` and ``jxs.dynamic_scaling(adamw)``;
    otherwise ``jax.value_and_grad`` and ``adamw``.
    """
    tx = optax.adamw(LR, weight_decay=WEIGHT_DECAY)
    if scaled:
        scale = jxs.DynamicLossScale.create(init_scale=INIT_SCALE)
        tx = jxs.dynamic_scaling(tx, scale)

    def step(params, opt_state, batch):
        if scaled:
            grad_fn = jxs.value_and_grad(loss_fn, opt_state)
        else:
            grad_fn = jax.value_and_grad(loss_fn)
        loss, grads = grad_fn(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return jax.jit(step, donate_argnums=(0, 1)), tx


# --------------------------------------------------------------------------- #
# The compiled HLO: conditionals, whiles and CUDA-graph command buffers.
# --------------------------------------------------------------------------- #


def hlo_census(hlo: str) -> dict[str, Any]:
    """The ``conditional`` and ``while`` instructions of an optimized module.

    XLA:GPU's command-buffer scheduling outlines instructions into computations
    named ``command_buffer...`` (run as one CUDA graph); an instruction is inside
    one if its computation is such a computation or is called (transitively)
    from one.

    Returns:
      ``{"conditional": [(instruction, computation, inside a command buffer)],
      "while": [...], "command_buffers": number of command-buffer
      computations}``.
    """
    found = _hlo.instructions(hlo)
    comps = list(dict.fromkeys(i.computation for i in found))
    calls: dict[str, set[str]] = {name: set() for name in comps}
    for i in found:
        calls[i.computation].update(_hlo.called(i.attrs))
    inside = {n for n in comps if "command_buffer" in n}
    todo = list(inside)
    while todo:
        for callee in calls.get(todo.pop(), ()):
            if callee in calls and callee not in inside:
                inside.add(callee)
                todo.append(callee)
    out: dict[str, Any] = {"conditional": [], "while": []}
    for i in found:
        if i.opcode in out:
            out[i.opcode].append((i.name, i.computation, i.computation in inside))
    out["command_buffers"] = sum("command_buffer" in n for n in comps)
    return out


# --------------------------------------------------------------------------- #
# Timing, interleaved (JAX and the torch child alike).
# --------------------------------------------------------------------------- #


def paired(times: dict[str, list[float]], name: str, ref: str) -> tuple[float, ...]:
    """Median and quartiles of the per-round ratios ``times[name] / times[ref]``."""
    r = [a / b for a, b in zip(times[name], times[ref], strict=True)]
    q = statistics.quantiles(r, n=4, method="inclusive") if len(r) > 1 else r * 3
    return statistics.median(r), q[0], q[2]


def time_rounds(
    steps: dict[str, Callable[..., Any]],
    carry: dict[str, tuple[Any, Any]],
    batch: Any,
    rounds: int,
    n: int,
    block: Callable[[Any], Any],
) -> dict[str, list[float]]:
    """Per-round mean step times (s), interleaved, the order rotating each round.

    ``carry`` (each variant's params and state) is updated in place.
    """
    names = list(steps)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            step, state = steps[name], carry[name]
            t0 = time.perf_counter()
            for _ in range(n):
                state, out = step(state, batch)
            block((state, out))
            times[name].append((time.perf_counter() - t0) / n)
            carry[name] = state
    return times


def _medians(times: dict[str, list[float]]) -> str:
    """``name median, ...`` in ms, for the progress log (a run cut short keeps it)."""
    return ", ".join(f"{k} {statistics.median(t) * 1e3:.3f}" for k, t in times.items())


def host_blocking(
    step: Callable[..., Any],
    state: Any,
    batch: Any,
    n: int,
    repeats: int,
    block: Callable[[Any], Any],
) -> tuple[Any, float, float]:
    """``(state, enqueue, run)``: medians over ``repeats`` of the seconds until a
    loop of ``n`` step calls returns, and until their results are ready."""
    block(state)
    enqueue, run = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            state, out = step(state, batch)
        t1 = time.perf_counter()
        block((state, out))
        t2 = time.perf_counter()
        enqueue.append(t1 - t0)
        run.append(t2 - t0)
    return state, statistics.median(enqueue), statistics.median(run)


def compile_with(lowered: Any, options: dict[str, Any]) -> Any:
    """``lowered.compile`` with these XLA options, or without them if unknown."""
    if options:
        try:
            return lowered.compile(compiler_options=options)
        except jax.errors.JaxRuntimeError as e:
            if "No such compile option" not in str(e):
                raise
    return lowered.compile()


def run_jax_model(
    model: str,
    size: Size,
    rounds: int,
    n: int,
    enq: tuple[int, int],
    options: dict[str, Any],
) -> dict[str, Any]:
    """Compiles, warms up and times the six JAX variants of one model."""
    key_p, key_d = jax.random.split(jax.random.key(0))
    tokens = jax.random.randint(key_d, (size.batch, size.seq + 1), 0, size.vocab)
    batch = (tokens[:, :-1], tokens[:, 1:])
    params0 = jax.jit(GPT(size).init)(key_p, batch[0])
    n_leaves = len(jax.tree.leaves(params0))
    n_params = sum(x.size for x in jax.tree.leaves(params0))
    log(f"{model}: {n_params:,} parameters; {size.describe()}")

    fns = loss_fns(size)
    steps, carry, compile_s, census, memory, kernels = {}, {}, {}, {}, {}, {}
    for name in VARIANTS:
        jitted, tx = make_step(fns[name], "dynamic_scaling" in name)
        params = jax.tree.map(jnp.copy, params0)
        opt_state = tx.init(params)
        t0 = time.perf_counter()
        lowered = jitted.lower(params, opt_state, batch)
        t1 = time.perf_counter()
        compiled = compile_with(lowered, options)
        t2 = time.perf_counter()
        compile_s[name] = (t1 - t0, t2 - t1)
        text = compiled.as_text()
        census[name] = hlo_census(text)
        kernels[name] = hlo_account.kernels(text)
        mem = compiled.memory_analysis()
        memory[name] = getattr(mem, "temp_size_in_bytes", None)

        def step(state, batch, compiled=compiled):
            p, s, loss = compiled(*state, batch)
            return (p, s), loss

        steps[name], carry[name] = step, (params, opt_state)
        log(f"{model}: {name}: trace+lower {t1 - t0:.1f}s, compile {t2 - t1:.1f}s")
    del params0
    for name in VARIANTS:  # warm-up: two steps each
        for _ in range(2):
            carry[name], loss = steps[name](carry[name], batch)
        jax.block_until_ready((carry[name], loss))
        if not bool(jnp.isfinite(loss)):
            log(f"{model}: {name}: warm-up loss is {float(loss)}")
    log(f"{model}: timing {rounds} rounds x {n} steps per variant")
    times = time_rounds(steps, carry, batch, rounds, n, jax.block_until_ready)
    log(f"{model}: median ms: " + _medians(times))
    blocking = {}
    for name in ENQUEUE_VARIANTS:
        carry[name], e, r = host_blocking(
            steps[name], carry[name], batch, *enq, jax.block_until_ready
        )
        blocking[name] = (e, r)
    scaling = {}
    for name in VARIANTS:
        state = carry[name][1]
        if isinstance(state, jxs.DynamicScalingState):
            scaling[name] = (
                int(state.skipped_steps),
                int(state.steps),
                float(state.loss_scale.loss_scale),
            )
    return {
        "times": times,
        "compile": compile_s,
        "census": census,
        "memory": memory,
        "kernels": kernels,
        "n_params": n_params,
        "leaves": n_leaves,
        "blocking": blocking,
        "scaling": scaling,
    }


# --------------------------------------------------------------------------- #
# Torch: the realistic model in plain torch.nn, run in a child process.
# --------------------------------------------------------------------------- #


def torch_gpt(size: Size) -> Any:
    """The same decoder in plain ``torch.nn`` (float32 parameters, tied head)."""
    import torch
    from torch import nn as tnn
    from torch.nn import functional as F  # noqa: N812

    class TorchBlock(tnn.Module):
        def __init__(self) -> None:
            super().__init__()
            d = size.d_model
            self.ln1, self.ln2 = tnn.LayerNorm(d), tnn.LayerNorm(d)
            self.qkv, self.proj = tnn.Linear(d, 3 * d), tnn.Linear(d, d)
            self.fc, self.out = tnn.Linear(d, size.mlp), tnn.Linear(size.mlp, d)
            mask = torch.tril(torch.ones(size.seq, size.seq, dtype=torch.bool))
            self.register_buffer("mask", mask, persistent=False)

        def forward(self, x):
            b, t, d = x.shape
            h = self.qkv(self.ln1(x)).view(b, t, 3, size.heads, d // size.heads)
            q, k, v = h.permute(2, 0, 3, 1, 4)
            s = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(d // size.heads))
            s = s.float().masked_fill(
                ~self.mask[:t, :t], torch.finfo(torch.float32).min
            )
            p = torch.softmax(s, dim=-1).to(v.dtype)
            y = (p @ v).transpose(1, 2).reshape(b, t, d)
            x = x + self.proj(y)
            return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))

    class TorchGPT(tnn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte = tnn.Embedding(size.vocab, size.d_model)
            self.wpe = tnn.Parameter(torch.zeros(size.seq, size.d_model))
            self.blocks = tnn.ModuleList(TorchBlock() for _ in range(size.layers))
            self.ln_f = tnn.LayerNorm(size.d_model)
            for p in self.parameters():
                if p.dim() == 2:
                    tnn.init.normal_(p, std=0.02)

        def forward(self, tokens, labels):
            x = self.wte(tokens) + self.wpe[: tokens.shape[1]]
            for block in self.blocks:
                x = block(x)
            logits = self.ln_f(x) @ self.wte.weight.T  # tied head
            return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())

    return TorchGPT()


def torch_worker(config: dict) -> dict:
    """Times torch's bare autocast step and its GradScaler step; a JSON-able dict."""
    try:
        import torch
    except ImportError as e:
        return {"error": f"torch is not installed ({e})"}
    START["time"] = config["start"]
    size = Size(**config["size"])
    cuda = torch.cuda.is_available() and not config["cpu"]
    if not cuda:  # on a shared CPU, more threads than free cores crawl
        torch.set_num_threads(1)
    device = "cuda" if cuda else "cpu"
    dtype = torch.float16 if cuda else torch.bfloat16
    dtype_name = "float16" if cuda else "bfloat16"
    torch.manual_seed(0)
    gen = torch.Generator(device).manual_seed(0)
    tokens = torch.randint(
        0, size.vocab, (size.batch, size.seq + 1), device=device, generator=gen
    )
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    base = torch_gpt(size).to(device)

    def adamw(model):
        kw = dict(lr=LR, weight_decay=WEIGHT_DECAY)
        try:
            return torch.optim.AdamW(model.parameters(), fused=True, **kw), True
        except (RuntimeError, TypeError, ValueError):
            return torch.optim.AdamW(model.parameters(), **kw), False

    def make(scaled):
        model = torch_gpt(size).to(device)
        model.load_state_dict(base.state_dict())
        opt, fused = adamw(model)
        scaler = torch.amp.GradScaler(device, init_scale=INIT_SCALE)

        def step():
            with torch.autocast(device, dtype=dtype):
                loss = model(x, y)
            if scaled:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            else:
                loss.backward()
                opt.step()
            opt.zero_grad(set_to_none=True)
            return loss

        return step, scaler, fused

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    names = {
        f"torch {dtype_name} autocast bare": False,
        f"torch {dtype_name} autocast + GradScaler": True,
    }
    steps, scalers, first = {}, {}, {}
    for name, scaled in names.items():
        step, scalers[name], fused = make(scaled)
        sync()
        t0 = time.perf_counter()
        step()
        sync()
        first[name] = time.perf_counter() - t0
        step()
        sync()
        steps[name] = step
        log(f"torch: {name}: first step {first[name]:.2f}s")
    log(f"torch: timing {config['rounds']} rounds x {config['n']} steps per variant")
    times = time_rounds(
        {k: (lambda s, b, f=f: (s, f())) for k, f in steps.items()},
        dict.fromkeys(steps),
        None,
        config["rounds"],
        config["n"],
        lambda _: sync(),
    )
    log("torch: median ms: " + _medians(times))
    blocking = {}
    for name, step in steps.items():
        _, e, r = host_blocking(
            lambda s, b, f=step: (s, f()),
            None,
            None,
            *config["enqueue"],
            lambda _: sync(),
        )
        blocking[name] = (e, r)
    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "device": torch.cuda.get_device_name()
        if cuda
        else platform.processor() or "cpu",
        "fused": fused,
        "dtype": dtype_name,
        "times": times,
        "first": first,
        "blocking": blocking,
        "scale": {k: float(s.get_scale()) for k, s in scalers.items() if names[k]},
        "bare": next(iter(names)),
    }


def start_torch(config: dict) -> subprocess.Popen:
    """Starts :func:`torch_worker` in a child process (its stderr passes through)."""
    return subprocess.Popen(
        [sys.executable, __file__, "--torch-worker", json.dumps(config)],
        stdout=subprocess.PIPE,
        text=True,
    )


def finish_torch(proc: subprocess.Popen) -> dict:
    """Waits for the torch child; its result, or why there is none."""
    stdout, _ = proc.communicate()
    lines = stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        return {"failed": f"the torch child exited with code {proc.returncode}"}
    return json.loads(lines[-1])


# --------------------------------------------------------------------------- #
# Report.
# --------------------------------------------------------------------------- #

HEADER = (
    "| model | variant | step ms (median) | tokens/s | ratio vs bare float16 "
    "(median [q25, q75]) | compile s (trace+lower + XLA) |\n"
    "|---|---|---|---|---|---|"
)


def rows(model: str, times: dict, bare: str, compile_s: dict) -> list[str]:
    """Table rows of one framework's variants of one model."""
    tokens = TOKENS[model]
    out = []
    for name, t in times.items():
        med = statistics.median(t)
        r, q1, q3 = paired(times, name, bare)
        if name in compile_s:
            lo, xla = compile_s[name]
            comp = f"{lo + xla:.2f} ({lo:.2f} + {xla:.2f})"
        else:
            comp = "-"
        out.append(
            f"| {model} | {name} | {med * 1e3:.3f} | {tokens / med:.0f} | "
            f"{r:.3f} [{q1:.3f}, {q3:.3f}] | {comp} |"
        )
    return out


def blocking_line(model: str, name: str, n: int, enqueue: float, run: float) -> str:
    ratio = enqueue / run
    verdict = (
        "blocked every step"
        if ratio > 0.8
        else "asynchronous"
        if ratio < 0.5
        else "partly blocked"
    )
    return (
        f"host blocking: {model} | {name} | enqueue {n} steps {enqueue * 1e3:.3f} ms"
        f" | run {n} steps {run * 1e3:.3f} ms | enqueue/run {ratio:.3f} ({verdict})"
    )


def env_lines(torch_info: dict | None) -> list[str]:
    import jaxlib

    dev = jax.devices()[0]
    try:
        import jax.extend.backend as jeb

        platform_version = " ".join(jeb.get_backend().platform_version.split())
    except Exception as e:  # noqa: BLE001 - reported, not fatal
        platform_version = f"unknown ({type(e).__name__})"
    torch_version = "not run"
    if torch_info and "torch" in torch_info:
        torch_version = torch_info["torch"]
    elif torch_info:
        torch_version = torch_info.get("error") or torch_info.get("failed", "?")
    lines = [
        f"env: jax {jax.__version__}, jaxlib {jaxlib.__version__}, "
        f"flax {flax.__version__}, optax {optax.__version__}, "
        f"torch {torch_version}, jaxscale {jxs.__version__}, "
        f"python {platform.python_version()}",
        f"env: jax device {dev.device_kind} (platform {dev.platform}, "
        f"{jax.device_count()} device(s)); backend platform_version: "
        f"{platform_version}",
        f"env: XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}, "
        "XLA_PYTHON_CLIENT_PREALLOCATE="
        f"{os.environ.get('XLA_PYTHON_CLIENT_PREALLOCATE')!r}",
    ]
    if torch_info and "torch" in torch_info:
        lines.append(
            f"env: torch device {torch_info['device']}, torch.version.cuda "
            f"{torch_info['cuda']}, cudnn {torch_info['cudnn']}, autocast "
            f"{torch_info['dtype']}, fused AdamW {torch_info['fused']}, first steps "
            + ", ".join(f"{k} {v:.2f}s" for k, v in torch_info["first"].items())
        )
    return lines


def report(
    results: dict[str, dict],
    torch_info: dict | None,
    enqueue: tuple[int, int],
) -> None:
    """Prints the table and the anchor, host-blocking, hlo and scaling lines."""
    torch_ok = bool(torch_info and "times" in torch_info)
    print(HEADER)
    table = []
    for model, res in results.items():
        table += rows(model, res["times"], BARE, res["compile"])
        if model == "realistic" and torch_ok:
            table += rows(model, torch_info["times"], torch_info["bare"], {})
    if "realistic" not in results and torch_ok:
        table += rows("realistic", torch_info["times"], torch_info["bare"], {})
    print("\n".join(table) + "\n")

    anchors: dict[str, list[str]] = {model: [] for model in results}
    for model, res in results.items():
        for kind in ("hand", "autocast"):
            ratio = paired(
                res["times"],
                f"float16 {kind} + dynamic_scaling",
                f"float16 {kind} bare",
            )
            anchors[model].append(
                "jax float16 {}: dynamic_scaling/bare {:.3f} [{:.3f}, {:.3f}]".format(
                    kind, *ratio
                )
            )
    if torch_ok:
        times, bare = torch_info["times"], torch_info["bare"]
        scaled = next(name for name in times if name != bare)
        anchors.setdefault("realistic", []).append(
            "torch: GradScaler/bare {:.3f} [{:.3f}, {:.3f}]".format(
                *paired(times, scaled, bare)
            )
        )
    for model, parts in anchors.items():
        print(f"anchor: {model} | " + " | ".join(parts))

    blocking = [(m, res["blocking"]) for m, res in results.items()]
    if torch_ok:
        blocking.append(("realistic", torch_info["blocking"]))
    for model, found in blocking:
        for name, (e, r) in found.items():
            print(blocking_line(model, name, enqueue[0], e, r))

    for model, res in results.items():
        for name, c in res["census"].items():
            mem = res["memory"][name]
            mem_s = "?" if mem is None else f"{mem / 2**20:.1f}"
            conds, whiles = c["conditional"], c["while"]
            print(
                f"hlo: {model} | {name} | conditionals {len(conds)} (in command "
                f"buffers {sum(cb for *_, cb in conds)}) | whiles {len(whiles)} "
                f"(in command buffers {sum(cb for *_, cb in whiles)}) | command "
                f"buffers {c['command_buffers']} | temp MiB {mem_s}"
            )
            for op, found in (("conditional", conds), ("while", whiles)):
                for var, comp, cb in found:
                    print(
                        f"hlo {op}: {model} | {name} | %{var} in %{comp} | "
                        f"in a command buffer: {'yes' if cb else 'no'}"
                    )

    for model, res in results.items():
        for kind in ("hand", "autocast"):
            found = res["kernels"]
            acc = hlo_account.Account(
                model=f"{model} {kind}",
                n_params=res["n_params"],
                leaves=res["leaves"],
                bare=found[f"float16 {kind} bare"],
                ours=found[f"float16 {kind} + dynamic_scaling"],
            )
            print("\n".join(acc.lines(top=6)))

    for model, res in results.items():
        for name, (skipped, steps, scale) in res["scaling"].items():
            print(
                f"scaling: {model} | {name} | skipped {skipped} of {steps} steps"
                f" | final scale {scale:g}"
            )
    if torch_ok:
        for name, scale in torch_info["scale"].items():
            print(f"scaling: realistic | {name} | final scale {scale:g}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--tiny", action="store_true", help="tiny models, 2 rounds of 2 steps (CPU)"
    )
    parser.add_argument(
        "--rounds", type=int, help="timed rounds (default: realistic 7, small 11)"
    )
    parser.add_argument(
        "--steps-per-round",
        type=int,
        help="steps per variant per round (default: realistic 10, small 50)",
    )
    parser.add_argument(
        "--batch", type=int, help="batch of the realistic model (default 8)"
    )
    parser.add_argument(
        "--models",
        nargs="+",
        choices=["realistic", "small"],
        default=["realistic", "small"],
    )
    parser.add_argument(
        "--no-torch", action="store_true", help="leave out the torch rows"
    )
    parser.add_argument("--torch-worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name in ("rounds", "steps_per_round", "batch"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"`--{name.replace('_', '-')}` must be >= 1, got {value}.")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.torch_worker:
        print(json.dumps(torch_worker(json.loads(args.torch_worker))))
        return 0
    mode = "tiny" if args.tiny else "full"
    # Read when JAX starts its backend (the first device query below): JAX
    # holds only the GPU memory it uses, so the torch child (run first) and the
    # JAX variants each find what they need.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    gpu = mode == "full" and jax.default_backend() == "gpu"
    if mode == "full" and not gpu:
        print(
            f"No GPU: JAX's backend is {jax.default_backend()!r}. The full "
            "configuration (a 124M-parameter model) needs one; run "
            "`python benchmarks/gpu.py --tiny` to check the script on a CPU.",
            file=sys.stderr,
        )
        return 2
    sizes = dict(SIZES[mode])
    if args.batch:
        sizes["realistic"] = dataclasses.replace(sizes["realistic"], batch=args.batch)
    TOKENS.update({m: c.batch * c.seq for m, c in sizes.items()})
    schedule = {
        m: (args.rounds or r, args.steps_per_round or n)
        for m, (r, n) in ROUNDS[mode].items()
    }
    enqueue = ENQUEUE[mode]

    torch_proc = torch_info = None
    if not args.no_torch and "realistic" in args.models:
        log("torch: starting the child process")
        rounds, n = schedule["realistic"]
        torch_proc = start_torch(
            {
                "size": dataclasses.asdict(sizes["realistic"]),
                "rounds": rounds,
                "n": n,
                "enqueue": enqueue,
                "cpu": not gpu,
                "start": START["time"],
            }
        )
        if gpu:  # alone on the GPU, before JAX allocates anything
            torch_info = finish_torch(torch_proc)
    results, failures = {}, []
    for model in args.models:
        try:
            results[model] = run_jax_model(
                model, sizes[model], *schedule[model], enqueue, FAST[mode]
            )
        except Exception as e:  # noqa: BLE001 - reported below, exit code 1
            traceback.print_exc()
            failures.append(f"FAILED: {model}: {type(e).__name__}: {e}")
    if torch_proc is not None and torch_info is None:  # --tiny: ran alongside
        torch_info = finish_torch(torch_proc)

    print("\n".join(env_lines(torch_info)))
    for model in args.models:
        rounds, n = schedule[model]
        print(
            f"config: {model}: {sizes[model].describe()}; {rounds} rounds x {n} "
            f"steps; host blocking: {enqueue[0]} steps x {enqueue[1]} repeats"
        )
    print()
    report(results, torch_info, enqueue)
    if torch_info and ("failed" in torch_info or "error" in torch_info):
        why = torch_info.get("failed") or torch_info.get("error")
        print(f"torch: not measured: {why}")
        if "failed" in torch_info:
            failures.append(f"FAILED: torch: {why}")
    for line in failures:
        print(line)
    print(f"env: total wall time {time.time() - START['time']:.1f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
