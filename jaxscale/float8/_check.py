"""Does a compiled step hold float8 GEMMs? :func:`gemm_report`.

XLA:GPU's GEMM rewriter (``xla/service/gpu/transforms/gemm_rewriter.cc``) turns a
``dot`` of float8 operands into a cuBLASLt float8 call (custom call
``__cublas$lt$matmul$f8``) only in a narrow form, and otherwise falls back to a
16-bit or float32 product without a word: two matrices with one contracting and
one free dimension each and no batch dimension, not both operands
``float8_e5m2``, the output ``bfloat16``, ``float16`` or ``float32``, scales that
are scalars. :func:`gemm_report` reads the lowered program (any backend: the
form is checked where the rewriter would see it) and, on a GPU, the compiled
one (the GEMMs really emitted): cuBLASLt float8 calls, and the Triton GEMM
fusions (``__triton_gemm``, ``__triton_nested_gemm_fusion``) whose dot multiplies
float8 operands, which XLA:GPU picks for small products (for an H200 with jax
0.10: a 32x64 by 64x32 product) or where its autotuner finds them faster.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax

from jaxscale import _hlo as hlo

__all__ = ["Float8GemmReport", "float8_gemms", "gemm_report", "summarize"]

_F8 = ("f8E4M3FN", "f8E5M2")
_OUT_OK = ("bf16", "f16", "f32")
_CUBLAS_F8 = "__cublas$lt$matmul$f8"
# A Triton GEMM fusion's kind: "__triton_gemm", or "__triton_nested_gemm_fusion"
# (jax 0.10's XLA, before autotuning picks a configuration).
_TRITON_GEMM = ("__triton_gemm", "__triton_nested_gemm")
_NONE = (
    "  - no float8 matmul at all: the function runs nothing in float8. A "
    "`dot_general` is a float8 site only if it has no batch dimensions and the "
    "recipe chooses it: by default where the cost model predicts float8 faster on "
    "this device kind (`jxs.diagnostics.autocast_report(fun, dtype, "
    "float8=recipe)` says why for each matmul), or, with a `min_dim`, where M, K "
    "and N all reach it. To use float8 anyway, set `min_dim` and lower it "
    "(`float8=jxs.float8.CurrentScaling(min_dim=0)` takes every eligible matmul) "
    "or name the sites (`CurrentScaling(sites={'mlp': True})`), and check that "
    "`fun` calls the `jxs.autocast(..., float8=...)` function."
)


class Float8GemmReport(NamedTuple):
    """What :func:`gemm_report` found.

    Attributes:
      platform: the backend the function was lowered and compiled for.
      float8_dots: ``dot_general`` operations with float8 operands in the lowered
        program.
      rewritable: how many of them are in the form XLA:GPU's GEMM rewriter turns
        into a cuBLASLt float8 GEMM.
      float8_gemms: float8 GEMMs in the compiled program: cuBLASLt float8 calls
        and Triton GEMM fusions of float8 operands (on a GPU; ``None``
        elsewhere: XLA:CPU computes float8 products in float32).
      problems: for each float8 dot not in that form, why not.

    Examples:
      >>> import jaxscale as jxs
      >>> r = jxs.float8.Float8GemmReport("gpu", 3, 3, 3, ())
      >>> r.ok
      True
      >>> jxs.float8.Float8GemmReport("cpu", 0, 0, None, ()).ok  # no float8 at all
      False
    """

    platform: str
    float8_dots: int
    rewritable: int
    float8_gemms: int | None
    problems: tuple[str, ...]

    @property
    def ok(self) -> bool:
        """There is a float8 dot, every float8 dot is rewritable and, on a GPU,
        became a float8 GEMM. ``False`` with no float8 dot at all: float8 was
        asked for and nothing runs in it (most often every matmul is too small
        to gain from float8, as the recipe judges)."""
        if self.float8_dots == 0 or self.rewritable != self.float8_dots:
            return False
        return self.float8_gemms is None or self.float8_gemms >= self.float8_dots

    def __str__(self) -> str:
        gemms = (
            "not compiled for a GPU"
            if self.float8_gemms is None
            else f"{self.float8_gemms} float8 GEMM(s) compiled"
        )
        lines = [
            f"float8 GEMM check ({self.platform}): {self.float8_dots} float8 dot(s), "
            f"{self.rewritable} in the form XLA:GPU rewrites, {gemms}: "
            f"{'ok' if self.ok else 'NOT ok'}"
        ]
        lines += [f"  - {p}" for p in self.problems]
        if self.float8_dots == 0:
            lines.append(_NONE)
        return "\n".join(lines)


def _problem(dot: hlo.Dot) -> str | None:
    """What keeps a float8 dot from XLA:GPU's float8 GEMM (None: nothing)."""
    (ld, ls), (rd, rs) = dot.operands
    od = dot.result[0]
    why = []
    if ld not in _F8 or rd not in _F8:
        why.append(f"one operand is not float8 ({ld} x {rd})")
    if ld == rd == "f8E5M2":
        why.append("both operands are float8_e5m2")
    if dot.batching is not None:
        why.append("it has batch dimensions")
    if len(ls) != 2 or len(rs) != 2:
        why.append(f"operands of rank {len(ls)} and {len(rs)}, not matrices")
    c = dot.contracting
    if c is None or len(c[0]) != 1 or len(c[1]) != 1:
        why.append("not exactly one contracting dimension per operand")
    if od not in _OUT_OK:
        why.append(f"output {od}")
    if not why:
        return None
    dims = lambda s: "x".join(str(d) if d >= 0 else "?" for d in s)  # noqa: E731
    return f"{dims(ls)}x{ld} . {dims(rs)}x{rd} -> {od}: " + "; ".join(why)


def float8_gemms(compiled: str) -> int:
    """The float8 GEMMs of an XLA:GPU-compiled module's text: cuBLASLt float8
    calls, and Triton GEMM fusions whose ``dot`` takes two float8 operands
    (parameters of the fusion or converts inside it)."""
    found = hlo.instructions(compiled)
    count = 0
    for i in found:
        if i.opcode == "custom-call":
            count += hlo.attribute(i.attrs, "custom_call_target") == _CUBLAS_F8
        elif (
            i.opcode == "fusion"
            and hlo.attribute(i.attrs, "kind") == "kCustom"
            and hlo.backend_kind(i.attrs).startswith(_TRITON_GEMM)
        ):
            called = hlo.attribute(i.attrs, "calls")
            count += _dot_of_float8([j for j in found if j.computation == called])
    return count


def _dot_of_float8(fused: list[hlo.Instruction]) -> bool:
    """Whether a fused computation's ``dot`` multiplies two float8 values."""
    types = {}
    for i in fused:
        types[i.name] = i.type
        if i.opcode == "dot" and len(i.operands) == 2:
            return all(types.get(n, "").startswith("f8") for n in i.operands)
    return False


def gemm_report(fun: Callable[..., Any], *args: Any, **kwargs: Any) -> Float8GemmReport:
    """Checks that ``fun``'s float8 matmuls become float8 GEMMs when compiled.

    ``fun`` (jitted or not: a train step, a loss) is lowered on ``args`` for the
    default backend. Every ``dot_general`` with float8 operands is checked
    against the form XLA:GPU's GEMM rewriter needs; on a GPU the program is also
    compiled and its float8 GEMMs (cuBLASLt calls, Triton GEMM fusions of float8
    operands) are counted, so a silent
    fallback to a 16-bit product shows. ``jxs.autocast(..., float8=...)`` emits
    every site in that form; a float8 dot written by hand may not be.

    Args:
      fun: the function.
      *args: its arguments (arrays or ``jax.ShapeDtypeStruct``).
      **kwargs: its keyword arguments.

    Returns:
      A :class:`Float8GemmReport` (``print`` it; ``.ok`` for a check: false
      too when nothing runs in float8).

    Examples:
      >>> import jaxscale as jxs, jax, jax.numpy as jnp
      >>> f = jxs.autocast(lambda w, x: jnp.sum(x @ w), jnp.bfloat16,
      ...                  float8=jxs.float8.CurrentScaling(min_dim=0))
      >>> w, x = jnp.ones((32, 16)), jnp.ones((16, 32))
      >>> r = jxs.float8.gemm_report(jax.value_and_grad(f, (0, 1)), w, x)
      >>> r.float8_dots, r.rewritable  # the forward and both backward products
      (3, 3)
    """
    if not callable(fun):
        raise TypeError(f"`fun` must be callable, got {type(fun).__name__}.")
    jitted = fun if hasattr(fun, "lower") else jax.jit(fun)
    lowered = jitted.lower(*args, **kwargs)
    platform = jax.default_backend()
    compiled = lowered.compile().as_text() if platform == "gpu" else None
    return summarize(lowered.as_text(), compiled, platform)


def summarize(lowered: str, compiled: str | None, platform: str) -> Float8GemmReport:
    """The report from the text of a lowered program and (on a GPU) of its
    compiled form."""
    found, problems = 0, []
    for dot in hlo.stablehlo_dots(lowered):
        if len(dot.operands) != 2 or not any(t in _F8 for t, _ in dot.operands):
            continue
        found += 1
        why = _problem(dot)
        if why is not None:
            problems.append(why)
    gemms = None if compiled is None else float8_gemms(compiled)
    return Float8GemmReport(
        platform, found, found - len(problems), gemms, tuple(problems)
    )
