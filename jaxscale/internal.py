"""Semi-public internals: what a rule that plugs into :func:`jaxscale.autocast`
needs from the autocast and float8 wings.

``jaxscale.precision`` is built on these names and nothing else of the two
wings; a rule of your own (a :class:`PluginRule` passed as ``float8=`` or
``plan=``) may use them too. They are internal all the same: no stability
promise, they change with the wings (as ``equinox.internal``). Everything a user
needs is in ``jaxscale``, ``jaxscale.float8``, ``jaxscale.precision`` and
``jaxscale.diagnostics``.

- the interpreter's plug-in hooks: :class:`PluginRule` (a rule class passed
  in), :class:`Extension` and :class:`Loop` (its trace-time state, per
  evaluation and per ``scan``), ``RULE_CLASSES`` (the built-in rule classes,
  by :class:`AutocastRule`), :func:`scaled_in_float32`, :func:`wide_product`,
  :func:`dtype_of`, :func:`is_castable`, :func:`check_dtype`, :func:`autocast`;
- float8's matmul: :func:`float8_dot` (one site's float8 product),
  :func:`dot_sizes` (``(m, k, n)`` of a ``dot_general`` without batch
  dimensions); its choice: :func:`float8_choice` (whether a recipe puts a site
  in float8, and why: its ``sites`` patterns, ``min_dim``, the cost model);
  :func:`gemm_summary` (:func:`jaxscale.float8.gemm_report` from the text of
  a lowered and a compiled program);
- the cost model's figures: :func:`device_cost` (a device kind's
  ``DeviceCost``), :func:`current_device` (those of the device JAX runs on).

Examples:
    >>> import jaxscale as jxs
    >>> import jaxscale.internal as jxi
    >>> jxi.dot_sizes(
    ...     {"dimension_numbers": (((1,), (0,)), ((), ()))}, (8, 16), (16, 4))
    (8, 16, 4)
"""

from jaxscale._autocast.classes import RULE_CLASSES as RULE_CLASSES
from jaxscale._autocast.classes import PluginRule as PluginRule
from jaxscale._autocast.classes import scaled_in_float32 as scaled_in_float32
from jaxscale._autocast.classes import wide_product as wide_product
from jaxscale._autocast.entry import autocast as autocast
from jaxscale._autocast.entry import check_dtype as check_dtype
from jaxscale._autocast.interp import Extension as Extension
from jaxscale._autocast.interp import Loop as Loop
from jaxscale._autocast.rules import AutocastRule as AutocastRule
from jaxscale._autocast.values import dtype_of as dtype_of
from jaxscale._autocast.values import is_castable as is_castable
from jaxscale._cost import current_device as current_device
from jaxscale._cost import device_cost as device_cost
from jaxscale.float8._check import summarize as gemm_summary
from jaxscale.float8._choice import choose as float8_choice
from jaxscale.float8._site import float8_dot as float8_dot
from jaxscale.float8._site import sizes as dot_sizes
from jaxscale.float8._site import weight_grad_operands as weight_grad_operands

__all__ = [
    "AutocastRule",
    "Extension",
    "Loop",
    "PluginRule",
    "RULE_CLASSES",
    "autocast",
    "check_dtype",
    "current_device",
    "device_cost",
    "dot_sizes",
    "dtype_of",
    "float8_choice",
    "float8_dot",
    "gemm_summary",
    "is_castable",
    "scaled_in_float32",
    "weight_grad_operands",
    "wide_product",
]
