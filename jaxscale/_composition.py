"""Whether the loss-scale state sits in the right place of an optimizer state.

``jxs.dynamic_scaling`` must see the gradients of the scaled loss first and own
the whole optimizer: a transformation in front of it sees *scaled* gradients
(a clip then clips at ``scale`` times the wrong norm; ``optax.clip`` turns an
``inf`` into a finite value, so overflows go unnoticed), and a wrapper around it
runs on skipped steps, moves the parameters there, or hides the overflow. The
nesting is visible in the optimizer state: :mod:`jaxscale._find` finds the one
:class:`~jaxscale.DynamicScalingState` with its key path, and
:func:`check_composition` judges every node on that path by its kind (an ordered
container, a wrapper known to be wrong, doubtful or safe, or one it does not
know), at trace time, at no cost in the compiled step. :func:`check_inner` judges
what ``dynamic_scaling`` wraps.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import jax
import optax

from jaxscale import _nnx
from jaxscale._find import opt_state_of

__all__ = ["CompositionWarning", "check_composition", "check_inner"]


class CompositionWarning(UserWarning):
    """Warned when ``jxs.dynamic_scaling`` is composed in a suspicious order.

    Orders that are certainly wrong (another transformation in front of the
    wrapper in an ``optax.chain`` or ``optax.named_chain``, the wrapper inside
    ``optax.MultiSteps``, ``optax.apply_if_finite``,
    ``optax.contrib.schedule_free`` or one group of ``optax.multi_transform``,
    ...) raise a ``ValueError`` instead. This warning is for orders whose effect
    is subtle: ``optax.inject_hyperparams``, ``optax.conditionally_mask`` or
    ``optax.lookahead`` around the wrapper (their counters also count skipped
    steps), transformations with state chained after it (they also run on
    skipped steps), and wrappers jaxscale does not know (it cannot tell whether
    they keep a skipped step bit-identical). The message says how to nest them
    instead. Filter it with :mod:`warnings` once you have checked.

    Examples:
      >>> import jaxscale as jxs
      >>> issubclass(jxs.CompositionWarning, UserWarning)
      True
    """


# Wrappers jaxscale knows, by the type of their state, which holds
# ``dynamic_scaling``'s (keyed ``"<top-level package>.<type name>"``: optax's
# ``MonitorState`` is not jaxscale's, and a type that moves between optax
# modules is still known).
# Refused: they read or change gradients or parameters outside the wrapper, or
# move parameters on a skipped step. The text says what happens and the fix.
_REFUSED = {
    "optax.MultiStepsState": (
        "`optax.MultiSteps` around `jxs.dynamic_scaling` runs the inner update on "
        "every micro-step and keeps an `inf` of one micro-batch in its accumulator "
        "(0 * inf = NaN), so every later window is skipped. Accumulate with "
        "`jxs.accumulate(jxs.dynamic_scaling(inner), every_k)` instead."
    ),
    "optax.PartitionState": (
        "`jxs.dynamic_scaling` on one group of `optax.multi_transform` (or "
        "`optax.partition`, `optax.selective_transform`) unscales only that group "
        "and skips only its steps: the other groups receive gradients multiplied "
        "by the loss scale. Wrap the whole multi_transform instead: "
        "`jxs.dynamic_scaling(optax.multi_transform(...))`."
    ),
    "optax.MaskedState": (
        "`optax.masked` around `jxs.dynamic_scaling` leaves the masked-out leaves "
        "scaled. Put the mask inside: `jxs.dynamic_scaling(optax.masked(...))`."
    ),
    "optax.ApplyIfFiniteState": (
        "`optax.apply_if_finite` around `jxs.dynamic_scaling` hides up to "
        "`max_consecutive_errors` overflows in a row from it: the scale does not "
        "back off on them and they are not counted as skipped. "
        "`jxs.dynamic_scaling` skips every non-finite step itself: drop "
        "`optax.apply_if_finite`."
    ),
    "optax.ScheduleFreeState": (
        "`optax.contrib.schedule_free` moves the parameters outside its base "
        "optimizer (towards its average `z`), so a skipped step still changes them. "
        "Put it inside: `jxs.dynamic_scaling(optax.contrib.schedule_free(inner, "
        "learning_rate))` (or `schedule_free_adamw(...)`, `schedule_free_sgd(...)`)."
    ),
    "optax.ConditionallyTransformState": (
        "`optax.conditionally_transform` passes the *scaled* gradients through as "
        "updates on the steps where it does not call `jxs.dynamic_scaling`. Put it "
        "inside: `jxs.dynamic_scaling(optax.conditionally_transform(inner, fn))`."
    ),
    "optax.SAMState": (
        "`optax.contrib.sam` gives the gradients to both of its optimizers and "
        "moves the parameters to and from the adversarial point itself: the other "
        "optimizer sees scaled gradients, and a skipped step still moves the "
        "parameters. Wrap all of it: "
        "`jxs.dynamic_scaling(optax.contrib.sam(optimizer, adv_optimizer))`."
    ),
    "optax.MechanicState": (
        "`optax.contrib.mechanize` reads the gradients (their norm and their dot "
        "product with the parameters' change) and moves the parameters itself: it "
        "sees scaled gradients and changes the parameters on a skipped step. Put "
        "it inside: `jxs.dynamic_scaling(optax.contrib.mechanize(inner))`."
    ),
    "optax.GaLoreState": (
        "`optax.contrib.galore` projects the gradients before its base optimizer, "
        "with a projector computed from the *scaled* gradients: an overflow on a "
        "projector step makes it NaN, and every later update with it. Wrap all of "
        "it: `jxs.dynamic_scaling(optax.contrib.galore(...))`."
    ),
}
_REFUSED["optax.MultiTransformState"] = _REFUSED["optax.PartitionState"]  # old optax
_COUNTS = (
    "`{}` wraps `jxs.dynamic_scaling` (at `{{where}}`): its {} advance on skipped "
    "steps too. {} inside the wrapper so they count applied steps only: `{}`."
)
# Warned: a counter of theirs also counts skipped steps (and lookahead, which
# has no right nesting, syncs on them).
_WARNED = {
    "optax.InjectHyperparamsState": _COUNTS.format(
        "optax.inject_hyperparams",
        "schedules",
        "Inject",
        "jxs.dynamic_scaling(optax.inject_hyperparams(optax.adam)("
        "learning_rate=schedule))",
    ),
    "optax.ConditionallyMaskState": _COUNTS.format(
        "optax.conditionally_mask",
        "step count and condition",
        "Put it",
        "jxs.dynamic_scaling(optax.conditionally_mask(inner, fn))",
    ),
    "optax.LookaheadState": (
        "`optax.lookahead` wraps `jxs.dynamic_scaling` (at `{where}`): skipped "
        "steps count towards `sync_period`, and a synchronisation that falls on a "
        "skipped step still moves the parameters (with one fast step fewer). No "
        "other nesting exists (inside the wrapper, its `LookaheadParams` do not "
        "match the gradients); filter this warning if that is acceptable."
    ),
}
_WARNED["optax.InjectStatefulHyperparamsState"] = _WARNED[
    "optax.InjectHyperparamsState"
]
# Around the wrapper on purpose (they leave a skipped step bit-identical).
_SAFE = {
    "jaxscale.AccumulateState",
    "jaxscale.MonitorState",
    "optax.SplitRealAndImaginaryState",
}
# Put in front on purpose: test-time fault injection (jaxscale.testing), and the
# data-parallel mean of the scaled gradients (an overflow reaches every device as
# an inf, so one skip decision follows).
_ALLOWED_BEFORE = {"jaxscale.NonfiniteAtState", "jaxscale.ReduceGradientsState"}
_CHAINS = {
    tuple: "an `optax.chain`",
    OrderedDict: "an `optax.named_chain`",
    list: "a list",
}


def _kind(node: Any) -> str:
    """``"<top-level package>.<type name>"`` of a state node."""
    kind = type(node)
    return f"{kind.__module__.partition('.')[0]}.{kind.__name__}"


def _children(node: Any) -> list[tuple[Any, Any]]:
    """``(key, child)`` for each direct child of the pytree node ``node``."""
    flat, _ = jax.tree_util.tree_flatten_with_path(
        node, is_leaf=lambda x: x is not node
    )
    return [(path[0], child) for path, child in flat]


def _a(word: str) -> str:
    return "an" if word[0] in "AEIOU" else "a"


def _name(key: Any) -> Any:
    """The field name, dict key or index of one step of a key path."""
    return getattr(key, "name", getattr(key, "key", getattr(key, "idx", key)))


def _states(children: list[tuple[Any, Any]]) -> str:
    return ", ".join(f"{_name(k)!r}: {type(s).__name__}" for k, s in children)


def _findings(opt_state: Any, path: tuple[Any, ...]) -> list[tuple[bool, str]]:
    """``(refused, message)`` for each node on ``path`` (from the root of
    ``opt_state``) that wraps the scaling state wrongly or doubtfully."""
    found, node = [], _nnx.unwrap(opt_state_of(opt_state))
    for depth, key in enumerate(path):
        kind, where = _kind(node), jax.tree_util.keystr(path[: depth + 1])
        children = _children(node)
        index = next(i for i, (k, _) in enumerate(children) if k == key)
        chain = next((c for t, c in _CHAINS.items() if type(node) is t), None)
        if kind in _REFUSED:
            state = kind.split(".")[1]
            text = f"the jxs.DynamicScalingState sits inside {_a(state)} {state} "
            found.append((True, f"{text}(at `{where}`). {_REFUSED[kind]}"))
        elif kind in _WARNED:
            found.append((False, _WARNED[kind].format(where=where)))
        elif kind in _SAFE or _name(key) == "opt_state":  # a train state
            pass
        elif chain is not None:
            found += _in_chain(chain, children, index, key)
        elif isinstance(node, Mapping):
            others = [(k, s) for k, s in children if k != key]
            if others:
                found.append((False, _UNORDERED.format(where, _states(others))))
        else:
            found.append((False, _UNKNOWN.format(type(node).__name__, where)))
        node = _nnx.unwrap(children[index][1])
    return found


def _in_chain(
    chain: str, children: list[tuple[Any, Any]], index: int, key: Any
) -> list[tuple[bool, str]]:
    """What is wrong with ``dynamic_scaling`` at ``index`` of an ordered
    container (``optax.chain``'s tuple, ``optax.named_chain``'s OrderedDict)."""
    at = "entry" if isinstance(_name(key), str) else "element"
    at = f"{at} {_name(key)!r}"
    before = [(k, s) for k, s in children[:index] if _kind(s) not in _ALLOWED_BEFORE]
    after = [(k, s) for k, s in children[index + 1 :] if jax.tree.leaves(s)]
    found = []
    if before:
        found.append((True, _BEFORE.format(at, chain, len(before), _states(before))))
    if after:
        found.append((False, _AFTER.format(at, chain, len(children), _states(after))))
    return found


_BEFORE = (
    "`jxs.dynamic_scaling` is {} of {}, after {} other transformation(s) "
    "(states {}): they receive the gradients of the *scaled* loss (a clip clips at "
    "the wrong norm, `optax.clip` turns an inf into a finite value so overflows go "
    "undetected, weight decay is divided by the scale). Move them inside the "
    "wrapper: `jxs.dynamic_scaling(optax.chain(clip, ..., optimizer))`."
)
_AFTER = (
    "transformations are chained after `jxs.dynamic_scaling` ({} of {} of {}), "
    "with state ({}): they also run on skipped steps, on the -0.0 updates, and "
    "advance their state there. Put them inside: "
    "`jxs.dynamic_scaling(optax.chain(..., them))`."
)
_UNORDERED = (
    "the jxs.DynamicScalingState is one entry of a dict (at `{}`), next to "
    "others (states {}); a "
    "plain dict does not keep the order its entries run in, so jaxscale cannot "
    "tell whether they run before `jxs.dynamic_scaling` (and see scaled "
    "gradients) or after it (and also run on skipped steps). Put them inside: "
    "`jxs.dynamic_scaling(optax.chain(..., optimizer))`; chain with "
    "`optax.named_chain` (an OrderedDict) to have the order checked."
)
_UNKNOWN = (
    "`jxs.dynamic_scaling` is wrapped by a transformation jaxscale does not know "
    "(state {}, at `{}`): jaxscale cannot tell whether it reads the gradients "
    "before they are unscaled, or whether it keeps a skipped step bit-identical "
    "(parameters and its own state unchanged). Put it inside, "
    "`jxs.dynamic_scaling(wrapper(inner))`, where it sees unscaled gradients and "
    "a skipped step leaves it untouched; only accumulation (`jxs.accumulate`) "
    "goes around. (A train state should hold the optimizer state as `opt_state`.) "
    "Filter this warning once you have checked it."
)


def check_composition(
    opt_state: Any, path: tuple[Any, ...] | None, name: str = "opt_state"
) -> None:
    """Raises or warns if ``dynamic_scaling`` is nested wrongly in ``opt_state``.

    ``path`` is the key path of the scaling state that
    :func:`jaxscale._find.locate` found (``None`` for a bare loss scale: nothing
    to judge). Reads only the static structure of the nodes on that path: no
    second walk of the tree, and nothing added to the compiled step.

    Each node on the path from the root to the scaling state is judged by what
    it is, not by which function built it:

    * a wrapper jaxscale knows to read or change gradients or parameters
      outside the scaling, or to move parameters on a skipped step
      (``MultiSteps``, ``masked``, ``multi_transform``, ``apply_if_finite``,
      ``schedule_free``, ``conditionally_transform``, ``sam``, ``mechanize``,
      ``galore``): ``ValueError`` naming the right nesting;
    * a wrapper whose counters also count skipped steps
      (``inject_hyperparams``, ``conditionally_mask``, ``lookahead``):
      :class:`CompositionWarning`;
    * jaxscale's ``accumulate`` and ``monitor``, ``split_real_and_imaginary``,
      and a train state holding it as ``opt_state``: accepted;
    * an ordered container (``optax.chain``'s tuple, ``optax.named_chain``'s
      ``OrderedDict``, a list): anything before the scaling state is refused
      (it sees scaled gradients; ``jaxscale.testing.nonfinite_at`` excepted),
      anything with state after it warns (it runs on skipped steps);
    * a plain dict with other entries (their order is unknown), or any other
      node (a wrapper jaxscale does not know): :class:`CompositionWarning`.

    Raises:
      ValueError: for the first refused node; nothing is warned then.
    """
    if path is None:
        return
    found = _findings(opt_state, path)
    for refused, message in found:
        if refused:
            raise ValueError(f"`{name}`: {message}")
    for _, message in found:
        warnings.warn(f"`{name}`: {message}", CompositionWarning, stacklevel=4)


def check_inner(inner: Any, inner_state: Any) -> None:
    """Raises if ``inner`` (of ``dynamic_scaling``) holds what belongs outside."""
    if isinstance(inner, optax.MultiSteps):
        raise TypeError(
            "`inner` must be an optax.GradientTransformation, got optax.MultiSteps; "
            "and accumulation belongs outside the wrapper anyway: use "
            "`jxs.accumulate(jxs.dynamic_scaling(inner), every_k)`."
        )
    nodes = jax.tree.leaves(
        inner_state,
        is_leaf=lambda x: type(x).__name__ in _INSIDE_WRONG,
    )
    for node in nodes:
        kind = type(node).__name__
        if kind == "SAMState" and node.cache is not None:
            continue  # sam's default (transparent) mode belongs inside
        if kind in _INSIDE_WRONG:
            raise ValueError(f"`inner`'s state holds a {kind}: {_INSIDE_WRONG[kind]}")


_INSIDE_WRONG = {
    "AccumulateState": (
        "`jxs.dynamic_scaling(jxs.accumulate(inner, k))` checks and adjusts the "
        "scale on every micro-batch while the window mixes scales. Nest it the "
        "other way round: `jxs.accumulate(jxs.dynamic_scaling(inner), k)`."
    ),
    "MultiStepsState": (
        "use `jxs.accumulate(jxs.dynamic_scaling(inner), every_k)` instead of "
        "`optax.MultiSteps` inside the wrapper."
    ),
    "DynamicScalingState": (
        "`jxs.dynamic_scaling` is nested inside another `jxs.dynamic_scaling`; "
        "wrap the optimizer once."
    ),
    "SAMState": (
        "`optax.contrib.sam(..., opaque_mode=True)` updates with the gradients of "
        "its own `grad_fn`, which `jxs.dynamic_scaling` never unscales or checks "
        "(they reach the optimizer scaled, or overflow unseen). Use "
        "`opaque_mode=False` (the default) inside the wrapper."
    ),
}
