"""``jxs.autocast``: torch-style automatic mixed precision for any JAX function.

The function is traced once to a jaxpr at the dtypes it was written for, then
evaluated by an interpreter that decides each primitive's dtype from a table
(:mod:`jaxscale._autocast.rules`, :mod:`jaxscale._autocast.interp`,
:mod:`jaxscale._autocast.hop`). The decisions are made at trace time; the compiled
program holds only the casts, as if they were written by hand.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxscale._autocast import attention
from jaxscale._autocast.classes import (
    RULE_CLASSES,
    PluginRule,
    RuleClass,
    plugin_classes,
    plugin_names,
)
from jaxscale._autocast.gradients import gradient_policy
from jaxscale._autocast.hop import HANDLERS
from jaxscale._autocast.interp import REGION_PREFIX, Interpreter
from jaxscale._autocast.rules import AutocastRule, Slot, resolve_rules
from jaxscale._autocast.values import (
    cast,
    dtype_of,
    floating,
    input_info,
    is_castable,
)
from jaxscale._jax_private import convert_weak
from jaxscale._nnx import is_object
from jaxscale._nnx_names import named_modules
from jaxscale._policy import parse_float_dtype

__all__ = [
    "autocast",
    "check_dtype",
    "check_plan_dtype",
    "interpret",
    "names_dot",
    "resolve",
    "with_plan",
]

_DISABLED = f"{REGION_PREFIX}_disabled"
_F16, _BF16, _F32 = (np.dtype(jnp.dtype(d)) for d in ("float16", "bfloat16", "float32"))


_SUPPORTED = "float16 ('float16', 'fp16', 'f16', 'half'), bfloat16 ('bf16')"


def check_dtype(dtype: Any) -> np.dtype:
    """The autocast dtype: float16 or bfloat16, or float32 (autocast off)."""
    try:
        dt = parse_float_dtype(dtype, "dtype")
    except ValueError:
        raise ValueError(
            f"`dtype` must be {_SUPPORTED}, or float32 ('fp32': autocast off), "
            f"got {dtype!r}."
        ) from None
    if dt.name.startswith("float8"):
        raise ValueError(
            f"`dtype` is the compute dtype and cannot be float8 ({dt.name}): "
            "float8 holds only the operands of matmuls, with a scale per "
            "tensor. Pass `float8=True` (or a `jxs.float8` recipe) with "
            f"`dtype=jnp.bfloat16` or float16; got {dtype!r}."
        )
    if dt not in (_F16, _BF16, _F32):
        raise ValueError(
            f"`dtype` must be {_SUPPORTED}, or float32 ('fp32': autocast off), "
            f"got {dtype!r} ({dt.name})."
        )
    return dt


def _is_array(x: Any) -> bool:
    return isinstance(x, jax.Array | np.ndarray | np.generic)


def autocast(
    fun: Callable[..., Any] | None = None,
    dtype: Any = jnp.float16,
    *,
    rules: Mapping[Any, Any] | None = None,
    enabled: bool = True,
    cast_outputs: bool = True,
    float8: Any = None,
    gradient_dtype: Any = None,
    plan: Any = None,
    fuse_attention: bool = True,
) -> Callable[..., Any]:
    """Runs ``fun`` in mixed precision with per-operation dtypes, as torch.autocast.

    Write the model and the loss once, in float32. ``jxs.autocast(fun)`` returns a
    function with ``fun``'s signature that runs matrix multiplications and
    convolutions in ``dtype`` (output in ``dtype``, as torch does), and numerically
    sensitive operations in float32: ``exp``, ``log``, powers, ``rsqrt``, special
    functions, and every sum or product, so softmax, log-softmax, norms' statistics
    and losses are computed in float32. Everything else runs in its inputs' dtype;
    an operation that needs equal dtypes (``add``, ``concatenate``, ``select_n``...)
    promotes to the widest of them, with three exceptions that keep activations in
    ``dtype``: a scalar (``x * 2.0``) never widens an array; a float32 bias added to
    a matmul's output is cast to ``dtype`` (torch's ``linear`` includes its bias);
    and an activation in ``dtype`` combined (``+ - * /``) with a float32 value
    broadcast from fewer elements that is a parameter or a statistic (a norm's
    mean, variance, scale and offset, computed in float32) is cast to ``dtype``,
    saturating at its finite range, and applied in ``dtype``, so BatchNorm,
    LayerNorm and what follows them (ReLU, pooling, residual adds) stay in
    ``dtype``, as with torch's ``batch_norm`` and Flax's ``dtype=float16``.
    Integers, booleans, PRNG keys and float64 values are never cast.
    :func:`autocast_rules` returns the table; ``docs/autocast.md`` compares it
    with torch's lists op by op.

    Constants keep their meaning: a constant of ``fun`` (a literal such as
    ``-1e9`` or ``jnp.finfo(jnp.float32).min``, a closed-over array, or a
    broadcast of one) that is finite in float32 never becomes ``inf`` because
    autocast narrowed it, and a non-zero scalar constant never becomes 0. In a
    selection (``jnp.where``, ``maximum``, ``minimum``, ``clip``, ``pad``,
    ``concatenate``) a constant beyond ``dtype``'s range saturates to its finite
    extreme (a mask's ``finfo(float32).min`` becomes ``finfo(float16).min``, as
    torch's ``finfo(scores.dtype).min`` idiom gives); anywhere else (``x * 1e5``,
    ``p + 1e-8``) the operation runs in float32 instead.

    It works on any function that JAX can trace (plain functions, Flax linen and
    NNX models, equinox modules, optax losses): ``fun`` is traced with
    :func:`jax.make_jaxpr` and the jaxpr is evaluated with a cast before each
    primitive as its rule says, at trace time, so under ``jit`` the compiled program
    is the one you would write by hand. ``jit``, ``lax.scan``, ``while_loop``,
    ``cond``/``switch``, ``jax.checkpoint``, ``custom_jvp``/``custom_vjp`` functions
    (their custom derivatives are kept), ``shard_map`` and ``vmap`` (inside or
    outside) are all handled. A loop carry keeps its dtype from one iteration to
    the next (the traced one, or the incoming value's if wider), and ``cond``
    branches agree on the widest. A first-order primitive autocast does not know
    runs at its inputs' dtypes. Array arguments (``jax.Array``, NumPy) are traced;
    every other leaf of the arguments (Python numbers, strings, callables) is
    passed as a constant. NNX modules passed as arguments get their updated state
    back (BatchNorm statistics, RNG counts), in their own dtypes.

    The output contract: ``jax.eval_shape(jxs.autocast(fun), *args)`` equals
    ``jax.eval_shape(fun, *args)``. Every output comes back in the dtype ``fun``
    gives it, so state that ``fun`` threads through (Flax linen ``mutable=``
    collections, an equinox ``State``, a carry) keeps its dtype from one call to
    the next; a float16 result is cast back where ``fun`` returned float32 (under
    ``jit`` XLA fuses that cast into its consumer). ``cast_outputs=False`` returns
    outputs in the dtypes their last operation gave them (logits in ``dtype``, as
    torch's autocast does), for code that wants them so.

    Differentiate the autocast function, not the other way round: in
    ``jax.grad(jxs.autocast(loss))`` the casts are ordinary ``convert_element_type``
    operations, so gradients come out in the dtypes of the inputs and the backward
    of every operation runs in the dtype of its forward. With float16, scale the
    loss (``jxs.value_and_grad`` with ``jxs.dynamic_scaling``).

    ``enabled=False`` runs ``fun`` exactly as traced (every operation in the dtype
    it was written for, its inputs cast back to them) even inside another
    ``autocast``, like torch's nested ``autocast(enabled=False)``; outside any
    autocast it changes nothing. ``dtype=jnp.float32`` means the same, so a
    configuration can switch autocast off through its dtype. An ``autocast``
    inside another uses its own ``dtype`` and ``rules`` for its region.

    Args:
      fun: the function. Without it, ``autocast`` returns a decorator:
        ``@jxs.autocast(dtype=jnp.bfloat16)``.
      dtype: the low-precision dtype: float16 (default, as torch's CUDA
        autocast; also ``"float16"``, ``"fp16"``, ``"f16"``, ``"half"``) or
        bfloat16 (``"bfloat16"``, ``"bf16"``); float32 (``"float32"``,
        ``"fp32"``) switches autocast off.
      rules: overrides of the table, from primitive names (``"exp"``, as in
        :func:`jax.make_jaxpr` output) or primitives (``jax.lax.exp_p``) to rule
        names (``"lower"``, ``"float32"``, ``"promote"``, ``"bias"``, ``"keep"``,
        ``"traced"``) or :class:`AutocastRule` members.
      enabled: a Python bool; ``False`` runs ``fun`` at its traced dtypes.
      cast_outputs: a Python bool; ``True`` (default) returns every output in
        the dtype ``fun`` gives it, ``False`` in the dtype it was computed in.
      float8: float8 matmuls (``docs/float8.md``): ``None`` (default, off);
        ``True`` or ``"current"`` for :class:`jaxscale.float8.CurrentScaling`
        (stateless); ``"delayed"`` for :class:`jaxscale.float8.DelayedScaling`
        (its state threaded by :func:`jaxscale.float8.value_and_grad`); or a
        recipe (:class:`jaxscale.float8.Recipe`, yours included). Every
        ``dot_general`` without batch dimensions whose sizes reach the recipe's
        ``min_dim`` runs with float8 operands and per-tensor scales, its output
        in ``dtype``; everything else follows the rules above. ``float8=r`` is
        shorthand for ``rules={"dot_general": r}``.
      gradient_dtype: the dtype in which the gradient of a float32 input of
        ``fun`` (a parameter) leaves a matmul, and so crosses devices when
        XLA's partitioner reduces it: ``None`` or float32 (default: accumulated
        and returned in float32, from 16-bit operands on a GPU, as torch DDP
        reduces an fp32 parameter's gradient), ``dtype`` (rounded to 16 bits
        per product and summed across devices in 16 bits: half the bytes), or
        a function of the input's path (``"[0]['params']['w']"``; keyword
        arguments ``"['name']..."``) returning one of these, called at trace
        time. The same goes for a float32 parameter broadcast into an
        ``add``, ``sub`` or ``mul`` (a bias, a norm's scale): its gradient is
        summed in float32, and so is a convolution's kernel gradient and a
        normalisation's statistic broadcast into a 16-bit activation (a batch
        norm's backward sums; unless every float input is narrowed). Forward
        and activation gradients are the same either way.
      plan: a :class:`jaxscale.precision.Plan` (``docs/precision.md``): each
        matmul site (a ``dot_general`` without batch dimensions) runs in the
        plan's format for it: float32, ``dtype``, ``dtype`` with a float32
        result, or float8 with current scaling per tensor or per row. Sites
        are named by name stack (``#1``, ``#2`` for repeats); a site the plan
        does not name, or a name the function never meets, raises. Not with
        ``float8``. ``None`` (default): no plan.
      fuse_attention: run attention as cuDNN's fused kernel on 16-bit q, k, v
        where the step is lowered for CUDA (default ``True``): every
        ``jax.nn.dot_product_attention`` call, and written-out attention
        (``softmax(q @ k * scale, masked causally or not) @ v``, as Flax's and
        most models' code writes it); other platforms run the rules.
        ``False``: attention by the rules everywhere (``docs/autocast.md``).

    Returns:
      A function with ``fun``'s signature and output structure.

    Raises:
      ValueError: if ``dtype`` is not float16, bfloat16 or float32 (float8 is
        not supported yet), a rule is unknown (see :func:`autocast_rules`),
        ``gradient_dtype`` is neither float32 nor ``dtype``, or both ``plan``
        and ``float8`` are given.
      TypeError: if ``fun`` is not callable, ``enabled`` or ``cast_outputs`` is
        not a bool, or ``rules`` is not a mapping.

    Warns:
      AutocastWarning: at trace time, for a higher-order primitive it cannot
        rewrite (run as traced).

    Examples:
      >>> import jaxscale as jxs
      >>> import jax, jax.numpy as jnp
      >>> def mlp(params, x):
      ...     h = jax.nn.relu(x @ params["w1"] + params["b1"][None])
      ...     return jax.nn.log_softmax(h @ params["w2"])
      >>> params = {"w1": jnp.ones((4, 8)), "b1": jnp.zeros(8), "w2": jnp.ones((8, 3))}
      >>> x = jnp.ones((2, 4))
      >>> jxs.autocast(mlp)(params, x).dtype  # the output contract: as mlp's
      dtype('float32')
      >>> h = lambda p, x: jax.nn.relu(x @ p["w1"] + p["b1"][None])
      >>> jxs.autocast(h, cast_outputs=False)(params, x).dtype  # computed in
      dtype('float16')
      >>> grads = jax.grad(lambda p: jxs.autocast(mlp)(p, x).sum())(params)
      >>> grads["w1"].dtype  # gradients in the parameters' dtype
      dtype('float32')
      >>> narrow = jxs.autocast(mlp, gradient_dtype=jnp.float16)  # 16-bit dW
      >>> jax.grad(lambda p: narrow(p, x).sum())(params)["w2"].dtype
      dtype('float32')

      Other dtypes and overrides:

      >>> mm = lambda a, b: a @ b
      >>> jxs.autocast(mm, "bf16", cast_outputs=False)(x, params["w1"]).dtype
      dtype(bfloat16)
      >>> jxs.autocast(jnp.exp, rules={"exp": "lower"}, cast_outputs=False)(x).dtype
      dtype('float16')

      Constants keep their meaning (float16's range ends at 65504):

      >>> masked = lambda s, m: jnp.where(m, s @ s.T, jnp.finfo(jnp.float32).min)
      >>> out = jxs.autocast(masked, cast_outputs=False)(x, jnp.eye(2, dtype=bool))
      >>> out.dtype, float(out.min())
      (dtype('float16'), -65504.0)

      A region at the traced dtypes:

      >>> @jxs.autocast(cast_outputs=False)
      ... def scores(q, k):
      ...     exact = jxs.autocast(lambda q, k: q @ k.T, enabled=False)
      ...     return exact(q, k), q @ k.T
      >>> [s.dtype for s in scores(x, x)]
      [dtype('float32'), dtype('float16')]
    """
    float8 = with_plan(plan, float8)
    dt, table, classes, plugin = resolve(dtype, rules, float8)
    check_plan_dtype(plan, dt)
    wide = gradient_policy(gradient_dtype, dt)
    for name, flag in (
        ("enabled", enabled),
        ("cast_outputs", cast_outputs),
        ("fuse_attention", fuse_attention),
    ):
        if not isinstance(flag, bool | np.bool_):
            raise TypeError(
                f"`{name}` must be a Python bool, got {type(flag).__name__}: "
                "autocast decides at trace time, so it cannot depend on a traced "
                "value."
            )
    if fun is None:
        return functools.partial(
            autocast,
            dtype=dt,
            rules=rules,
            enabled=enabled,
            cast_outputs=cast_outputs,
            float8=plugin,
            gradient_dtype=gradient_dtype,
            fuse_attention=fuse_attention,
        )
    if not callable(fun):
        raise TypeError(
            f"`fun` must be callable, got {type(fun).__name__}; use "
            "`jxs.autocast(fun)`, `@jxs.autocast` or "
            "`functools.partial(jxs.autocast, dtype=...)`."
        )

    @functools.wraps(fun)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not enabled or dt == _F32:
            with jax.named_scope(_DISABLED):
                return fun(*args, **kwargs)

        def run(rule: Any) -> Any:
            ext = rule.begin() if rule is not None else None
            ruled = classes if rule is None else {**classes, Slot.PLUGIN: rule}
            it = Interpreter(dt, table, HANDLERS, classes=ruled, extension=ext)
            it.fuse_attention = fuse_attention
            out = interpret(
                fun, it, args, kwargs, cast_outputs=bool(cast_outputs), wide=wide
            )
            if rule is not None:
                rule.end(ext)
            return out

        # A rule that depends on the traced shapes (a plan re-solved at the
        # step's) finds them in an abstract evaluation first.
        prepare = getattr(plugin, "prepare", None)
        rule = (
            plugin
            if prepare is None
            else prepare(lambda r: jax.eval_shape(lambda: run(r)))
        )
        return run(rule)

    return wrapper


def with_plan(plan: Any, float8: Any) -> Any:
    """``float8=``, or the rule of ``plan=`` (a :class:`PluginRule`, or an
    object whose ``autocast_rule()`` gives one: a
    :class:`jaxscale.precision.Plan`)."""
    if plan is None:
        return float8
    if float8 is not None and float8 is not False:
        raise ValueError(
            "`plan` and `float8`: a plan sets each matmul site's format, float8 "
            f"included; pass one of them, got plan={plan!r} and float8={float8!r}."
        )
    make = getattr(plan, "autocast_rule", None)
    rule = make() if callable(make) and not isinstance(plan, type) else plan
    if not isinstance(rule, PluginRule):
        raise TypeError(
            "`plan` must be a `jxs.precision.Plan` (from `jxs.plan_precision` or "
            f"`jxs.precision.solve`), got {type(plan).__name__}."
        )
    return rule


def check_plan_dtype(plan: Any, dtype: np.dtype) -> None:
    """Raises if ``plan`` records a 16-bit dtype (``plan.dtype``) other than
    the autocast ``dtype``: its errors were measured in that one."""
    planned = getattr(plan, "dtype", None)
    if planned is None or dtype == _F32 or np.dtype(planned) == dtype:
        return
    raise ValueError(
        f"`plan` was measured in {np.dtype(planned).name}, but autocast `dtype` is "
        f"{dtype.name}: its errors say nothing of {dtype.name} (float16's range "
        "and bfloat16's precision differ). Pass `dtype="
        f"jnp.{np.dtype(planned).name}`, measure a plan in {dtype.name} "
        f"(`jxs.plan_precision(loss, jnp.{dtype.name})`), or override it knowingly "
        f"with `plan.with_dtype(jnp.{dtype.name})`."
    )


def resolve(
    dtype: Any, rules: Mapping[Any, Any] | None, float8: Any
) -> tuple[np.dtype, dict[str, AutocastRule], Mapping[AutocastRule, RuleClass], Any]:
    """``autocast``'s arguments checked and resolved: the dtype, the table, the
    rule classes (with the rule object passed in, if any, in the plug-in slot,
    :attr:`Slot.PLUGIN`) and that rule object (a :class:`PluginRule`, or
    ``None``). ``dot_general`` (and the plug-in's other ``primitives``, a
    plan's ``conv_general_dilated``) takes the plug-in unless ``rules`` names it, and
    so does every primitive ``rules`` gives the ``"float8"`` rule (the name
    users write for the rule object passed in)."""
    dt = check_dtype(dtype)
    plugin, rules = _plugin_of(float8, rules)
    table = resolve_rules(rules)
    if plugin is None:
        if AutocastRule.FLOAT8 in table.values():
            raise ValueError(
                "`rules`: the 'float8' rule needs a float8 recipe: pass "
                "`float8=True` (current scaling), `float8='delayed'` or a "
                "`jxs.float8` recipe as well."
            )
        return dt, table, RULE_CLASSES, None
    plugin.check(dt)
    for name in getattr(plugin, "primitives", ("dot_general",)):
        if not (rules and names_primitive(rules, name)):
            table[name] = Slot.PLUGIN
    table = {
        k: Slot.PLUGIN if v is AutocastRule.FLOAT8 else v for k, v in table.items()
    }
    return dt, table, {**RULE_CLASSES, Slot.PLUGIN: plugin}, plugin


def _plugin_of(
    float8: Any, rules: Mapping[Any, Any] | None
) -> tuple[Any, Mapping[Any, Any] | None]:
    """The rule object of ``float8=`` or among the values of ``rules`` (where it
    is replaced by the ``"float8"`` rule, the plug-in's name in ``rules``), or
    ``None``."""
    plugin = _named(float8)
    if not isinstance(rules, Mapping):
        return plugin, rules
    given = [v for v in rules.values() if isinstance(v, PluginRule)]
    if not given:
        return plugin, rules
    distinct = [g for i, g in enumerate(given) if g not in given[:i]]
    if len(distinct) > 1 or (plugin is not None and plugin != distinct[0]):
        both = [*([plugin] if plugin is not None else []), *distinct]
        raise ValueError(
            "`rules` and `float8`: one autocast runs one rule object (a float8 "
            f"recipe), got {len(both)} different: "
            f"{', '.join(repr(b) for b in both)}. Pass one, as `float8=` or as "
            "the value of `rules`."
        )
    slot = AutocastRule.FLOAT8
    return distinct[0], {
        k: (slot if isinstance(v, PluginRule) else v) for k, v in rules.items()
    }


def _named(value: Any) -> Any:
    """``float8=``: ``None``/``False`` (off), a rule object, or a name a rule
    class answers to (``True``, ``"current"``, ``"delayed"``): its defaults."""
    if value is None or value is False:
        return None
    if isinstance(value, PluginRule):
        return value
    found = plugin_names(value)
    if len(found) == 1:
        return found[0]()
    if len(found) > 1:
        raise ValueError(
            f"`float8`: {value!r} names {len(found)} rule classes "
            f"({', '.join(c.__qualname__ for c in found)}); pass a rule object."
        )
    named = ", ".join(
        f"{' or '.join(repr(n) for n in c.names)} ({c.__name__})"
        for c in plugin_classes()
    )
    raise TypeError(
        f"`float8` must be None, {named}, or a rule object (a `jxs.float8` "
        "recipe such as `jxs.float8.CurrentScaling(min_dim=0)`), got "
        f"{type(value).__name__} {value!r}."
    )


def names_dot(rules: Mapping[Any, Any]) -> bool:
    return names_primitive(rules, "dot_general")


def names_primitive(rules: Mapping[Any, Any], name: str) -> bool:
    """Whether ``rules`` gives primitive ``name`` a rule of its own."""
    return any(
        (k if isinstance(k, str) else getattr(k, "name", None)) == name for k in rules
    )


def interpret(
    fun: Callable[..., Any],
    it: Interpreter,
    args: tuple,
    kwargs: dict,
    cast_outputs: bool = True,
    wide: Callable[[str], bool] | None = None,
) -> Any:
    """``fun(*args, **kwargs)`` traced once and evaluated by ``it`` (an
    :class:`~jaxscale._autocast.interp.Interpreter`, or an observing subclass for
    the report); NNX modules among the arguments get their new state back, and
    NNX modules called run under their module paths as name scopes
    (:func:`jaxscale._nnx_names.named_modules`: the sites' names).
    ``wide(path)`` says whether the input at ``path`` (``"[0]['w']"``) has its
    gradient leave matmuls in float32 (every input if ``None``)."""
    with_paths, treedef = jax.tree_util.tree_flatten_with_path((args, kwargs))
    leaves = [leaf for _, leaf in with_paths]
    dynamic = [i for i, x in enumerate(leaves) if _is_array(x)]
    modules = [("a", i) for i, a in enumerate(args) if is_object(a)]
    modules += [("k", k) for k, v in kwargs.items() if is_object(v)]
    shapes: dict[str, Any] = {}

    def flat(*dyn: Any) -> list[Any]:
        full = list(leaves)
        for i, x in zip(dynamic, dyn, strict=True):
            full[i] = x
        a, kw = jax.tree.unflatten(treedef, full)
        name_modules((a, kw))
        out_leaves, shapes["out"] = jax.tree.flatten(fun(*a, **kw))
        shapes["states"] = []
        for where, key in modules:  # their state after `fun` (it may mutate them)
            state_leaves, tree = jax.tree.flatten(
                _nnx_state((a if where == "a" else kw)[key])
            )
            shapes["states"].append((tree, len(state_leaves)))
            out_leaves += state_leaves
        return out_leaves

    flat.__name__ = getattr(fun, "__name__", "fun")
    dyn = [leaves[i] for i in dynamic]
    fuse = getattr(it, "fuse_attention", False)
    with (
        attention.intercepting() if fuse else contextlib.nullcontext(),
        named_modules() as name_modules,
    ):
        closed = jax.make_jaxpr(flat)(*dyn)
    with jax.named_scope(f"{REGION_PREFIX}_{it.dtype.name}"):
        infos = [
            input_info(leaves[i], wide is None or wide(_path(with_paths[i][0])))
            for i in dynamic
        ]
        # Statistics' cotangents in float32 unless every float input is narrow.
        it.wide_statistics = any(
            info.wide for info, x in zip(infos, dyn, strict=True) if floating(x.dtype)
        )
        outs, _ = it.eval_closed(closed, dyn, infos)
    n_out = shapes["out"].num_leaves
    # The output contract: every output in the dtype ``fun`` gives it.
    if cast_outputs:
        outs[:n_out] = [
            _as_traced(o, a)
            for o, a in zip(outs[:n_out], closed.out_avals[:n_out], strict=True)
        ]
    result = jax.tree.unflatten(shapes["out"], outs[:n_out])
    start = n_out
    for (where, key), (tree, n) in zip(modules, shapes["states"], strict=True):
        traced = closed.out_avals[start : start + n]
        new = outs[start : start + n]
        start += n
        module = (args if where == "a" else kwargs)[key]
        _write_back(module, tree, new, traced)
    return result


def _path(keys: tuple) -> str:
    """An argument leaf's path, ``(args, kwargs)``'s own key left out:
    ``"[0]['params']['w']"`` for a positional argument, ``"['x']"`` for ``x=``."""
    return jax.tree_util.keystr(tuple(keys[1:]))


def _as_traced(x: Any, aval: Any) -> Any:
    """``x`` in the dtype, and weak type, ``fun`` gave it when traced (an
    equinox counter ``jnp.array(0) + 1`` stays weakly typed, so a jitted step
    that threads it back does not retrace)."""
    if is_castable(dtype_of(x)):
        x = cast(x, np.dtype(aval.dtype))
    weak = getattr(aval, "weak_type", False)
    if weak and dtype_of(x) == aval.dtype and not jax.typeof(x).weak_type:
        x = convert_weak(x, aval.dtype)
    return x


# ``flax.nnx`` is imported only below, for NNX modules passed as arguments (so
# the user has imported it): ``nnx.state`` and ``nnx.update`` have no home in
# ``jaxscale._nnx``, which splits and merges modules for differentiation.


def _nnx_state(module: Any) -> Any:
    from flax import nnx

    return nnx.state(module)


def _write_back(module: Any, tree: Any, new: list[Any], traced: list[Any]) -> None:
    """Update ``module`` with the state ``fun`` left in its traced copy, each leaf in
    its traced dtype; untouched if nothing changed (no trace-level mutation)."""
    from flax import nnx

    old = jax.tree.leaves(nnx.state(module))
    if all(n is o for n, o in zip(new, old, strict=True)):
        return
    fixed = [
        cast(n, np.dtype(a.dtype)) if is_castable(dtype_of(n)) else n
        for n, a in zip(new, traced, strict=True)
    ]
    nnx.update(module, jax.tree.unflatten(tree, fixed))
