"""While it trains: a per-site monitor inside the jitted step, and a re-plan on
the host between steps (:class:`Monitor`).

Each site of the plan runs in its format, as under ``jxs.autocast(f, dtype,
plan=plan)``, and its output passes through a *watch*: an identity whose
forward measures the site's operands and output and whose backward measures
the incoming gradient, and which returns both as the cotangent of a zero probe,
a :class:`Watch` (:mod:`jaxscale._probe`; in a ``scan``, every field the
maximum over the iterations). The step gets them with its gradients, as arrays: no
host synchronisation. :meth:`Monitor.update` folds them into a
:class:`MonitorState` (counters per site); :meth:`Monitor.replan`, on the host
at the user's cadence, raises a site one format after ``patience`` troubled
steps in a row and lowers it back toward the plan's format after ``window``
quiet ones. A new plan is a new program: the step is traced and compiled again.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxscale._distributed import differing_processes, from_every_process
from jaxscale._grad import value_and_grad as scaled
from jaxscale._probe import zeros
from jaxscale._speed import Format
from jaxscale.internal import autocast, check_dtype
from jaxscale.precision._apply import PlanRule
from jaxscale.precision._measure import PRECISION
from jaxscale.precision._plan import Plan
from jaxscale.precision._sites import ProbeContext, SiteContext
from jaxscale.precision._tap import SESSION, Session

__all__ = ["FIELDS", "Monitor", "MonitorState", "Watch"]

_F32 = np.dtype("float32")


class Watch(NamedTuple):
    """What the watch measures per site and step, ``f32[]`` each (the
    maximum over a loop's iterations); a step's measurements ``seen`` and
    :class:`MonitorState`'s ``last`` and ``peak`` hold them as columns, in
    this order (:data:`FIELDS`).

    Attributes:
      overflow: the output's non-finite elements where its operands are finite.
      x_amax: the first operand's largest magnitude.
      w_amax: the second operand's largest magnitude.
      y_amax: the output's largest magnitude.
      float8_flush: float8's share of the operands' nonzero elements that
        flush to zero when scaled per tensor (an upper bound for rowwise).
      grad_nonfinite: the incoming gradient's non-finite elements.
      grad_zeros: its share of zeros.
      grad_amax: its largest magnitude.
    """

    overflow: Any
    x_amax: Any
    w_amax: Any
    y_amax: Any
    float8_flush: Any
    grad_nonfinite: Any
    grad_zeros: Any
    grad_amax: Any

    @classmethod
    def columns(cls, rows: Any) -> Watch:
        """The named columns of ``rows`` (``f32[n, len(FIELDS)]``)."""
        return cls(*(rows[:, i] for i in range(len(cls._fields))))


Watch.COMBINE = dict.fromkeys(Watch._fields, "max")
FIELDS = Watch._fields
_K = len(FIELDS)
_AMAX = tuple(FIELDS.index(f) for f in ("x_amax", "w_amax", "y_amax"))  # drift
_E4M3 = np.dtype(jnp.float8_e4m3fn)
_TINY_E4M3 = 2.0**-10  # half e4m3fn's smallest subnormal: rounds to zero


def _static(**kwargs: Any) -> Any:
    return dataclasses.field(metadata={"static": True}, **kwargs)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MonitorState:
    """The monitor's counters, per site in plan order (device arrays: carry
    them through the jitted step with the rest of the train state).

    Attributes:
      steps: ``int32[]``, steps monitored.
      troubled: ``int32[n]``, consecutive troubled steps per site (0 after a
        quiet one).
      quiet: ``int32[n]``, consecutive quiet steps per site.
      events: ``int32[n]``, troubled steps per site in all.
      last: ``f32[n, len(FIELDS)]``, the last step's measurements.
      peak: ``f32[n, len(FIELDS)]``, their maxima over the steps.
      calibration: ``f32[n, 3]``: the operands' and output's largest magnitude
        at the first step, what ``drift`` compares with.
      sites: the sites' names (static).
      formats: the format of each site in the plan the counters are for
        (static): a state from before a re-plan is refused by the new plan's
        monitor, and the new state by a step traced from the old monitor.

    Examples:
      >>> import jaxscale as jxs
      >>> import jax.numpy as jnp
      >>> F = jxs.precision.Format
      >>> m = jxs.precision.SiteMeasure("mlp", (64, 32, 32), (2, 4),
      ...                               {F.HALF: 1.0, F.FLOAT32: 0.0})
      >>> plan = jxs.precision.solve([m], cost="H100", budget=1.0)
      >>> state = jxs.precision.Monitor(plan, jnp.float16).init()
      >>> state.sites, state.troubled.tolist(), state.last.shape
      (('mlp',), [0], (1, 8))
    """

    steps: jax.Array
    troubled: jax.Array
    quiet: jax.Array
    events: jax.Array
    last: jax.Array
    peak: jax.Array
    calibration: jax.Array
    sites: tuple[str, ...] = _static()
    formats: tuple[str, ...] = _static(default=())

    def drift(self) -> jax.Array:
        """``f32[n, 3]``: the last step's largest magnitudes of the operands
        and output over the first step's (1 until measured)."""
        now = self.last[:, list(_AMAX)]
        return jnp.where(self.calibration > 0, now / self.calibration, 1.0)


def _count(mask: Any) -> Any:
    return jnp.sum(mask.astype(_F32))


def _amax(x: Any) -> Any:
    x = x.astype(_F32)
    return jnp.max(jnp.where(jnp.isfinite(x), jnp.abs(x), 0.0), initial=0.0)


def _float8_flush(t: Any) -> Any:
    """The share of ``t``'s nonzero elements that per-tensor scaling to
    e4m3fn's largest value flushes to zero."""
    t = jnp.abs(t.astype(_F32))
    a = _amax(t)
    top = float(jnp.finfo(_E4M3).max)
    nonzero = (t > 0) & jnp.isfinite(t)
    lost = nonzero & (t * (top / jnp.maximum(a, 1e-30)) < _TINY_E4M3)
    return _count(lost) / jnp.maximum(_count(nonzero), 1.0)


def _watch():
    """The identity on a site's output that measures it (see :data:`FIELDS`)."""

    def forward(y, x, w):
        finite_in = jnp.all(jnp.isfinite(x)) & jnp.all(jnp.isfinite(w))
        return dict(
            overflow=jnp.where(finite_in, _count(~jnp.isfinite(y)), 0.0),
            x_amax=_amax(x),
            w_amax=_amax(w),
            y_amax=_amax(y),
            float8_flush=jnp.maximum(_float8_flush(x), _float8_flush(w)),
        )

    @jax.custom_vjp
    def watch(y, x, w, probe):
        return y

    def fwd(y, x, w, probe):
        x, w = jax.lax.stop_gradient(x), jax.lax.stop_gradient(w)
        return y, forward(y, x, w)

    def bwd(res, g):
        # No cotangent for the operands (``None``: a zero of the operand's own
        # type, varying axes included in a ``shard_map`` body).
        g32 = g.astype(_F32)
        n = max(g.size, 1)
        stats = Watch(
            **res,
            grad_nonfinite=_count(~jnp.isfinite(g32)),
            grad_zeros=_count(g32 == 0) / n,
            grad_amax=_amax(g32),
        )
        return g, None, None, jax.tree.map(lambda s: jnp.asarray(s, _F32), stats)

    watch.defvjp(fwd, bwd)
    return watch


@dataclasses.dataclass(frozen=True)
class _MonitorRule(PlanRule):
    """A plan's rule whose sites pass through a watch when probes are in scope."""

    def begin(self) -> SiteContext:
        session = SESSION.current()
        return ProbeContext(session if session is not None else Session(), self.kinds)

    def emit_site(self, it, eqn, params, vals, name, fmt):
        outs = super().emit_site(it, eqn, params, vals, name, fmt)
        ctx = it.extension
        probe = ctx.probe() if isinstance(ctx, ProbeContext) else None
        if probe is None:
            return outs
        x, w = vals
        watch = _watch()
        return [watch(outs[0], x, w, probe)]


def _host(x: Any) -> np.ndarray:
    """``x`` on the host: a global array's whole value (the same on every
    process), otherwise this process's own."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def _agree_counters(plan: Plan, state: MonitorState) -> tuple[np.ndarray, ...]:
    """``(troubled, quiet)`` agreed over every ``jax.distributed`` process,
    the same on each, so that every process re-plans alike: a site's troubled
    steps in a row are the most any process counts, its quiet ones the fewest
    (a site is raised if any process needs it, lowered only if every process
    is quiet). A global state (the step ran on global arrays) is already the
    same everywhere; with one process, the state's own counters.

    Raises:
      ValueError: if the processes' monitors run different plans.
    """
    troubled, quiet = _host(state.troubled), _host(state.quiet)
    if jax.process_count() == 1:
        return troubled, quiet
    if differing_processes([(s.site, s.format.value) for s in plan.sites]):
        raise ValueError(
            "`Monitor.replan`: the processes' monitors run different plans (so "
            "they compile different programs): make the plan with a `Sensor` "
            "(it agrees across processes) and re-plan on every process, each "
            "time with the same `replan` calls."
        )
    every = from_every_process(np.stack([troubled, quiet]).astype(np.int32))
    return every[:, 0].max(axis=0), every[:, 1].min(axis=0)


def _formats(plan: Plan) -> tuple[str, ...]:
    """The plan's format per site, in site order: a state's plan identity."""
    return tuple(s.format.value for s in plan.sites)


def _monitor_dtype(plan: Plan, dtype: Any) -> np.dtype:
    """The monitor's dtype: ``dtype``, or the plan's; they must agree."""
    if dtype is None and plan.dtype is None:
        raise ValueError(
            "`dtype` must be given (bfloat16 or float16): the plan records no "
            "dtype (made by `solve` from bare measures, or loaded from a version-1 "
            "file). Pass the dtype the plan's errors were measured in."
        )
    dt = plan.dtype if dtype is None else check_dtype(dtype)
    if plan.dtype is not None and dt != plan.dtype:
        raise ValueError(
            f"`dtype` is {dt.name}, but the plan was measured in {plan.dtype.name}: "
            f"pass dtype=jnp.{plan.dtype.name} (or leave it out), measure a plan in "
            f"{dt.name}, or override it knowingly with "
            f"`plan.with_dtype(jnp.{dt.name})`."
        )
    return dt


def _order(plan: Plan) -> list[Format]:
    return [s.format for s in plan.sites]


@dataclasses.dataclass(frozen=True)
class Monitor:
    """Runs a plan and watches each site while the model trains.

    ``monitor.value_and_grad(loss)`` is ``jax.value_and_grad`` of ``loss``
    under ``jxs.autocast(loss, dtype, plan=monitor.plan)`` (or
    ``jxs.value_and_grad`` with a loss scale) that also returns the step's
    per-site measurements; :meth:`update` folds them into a
    :class:`MonitorState`, inside the jitted step. A site is *troubled* at a
    step if its output overflows while its operands are finite, if in float16
    its output comes within ``headroom`` of float16's largest value, or if in
    float8 more than ``max_flush`` of an operand's nonzero elements flush to
    zero. :meth:`replan` (on the host) raises a site one format (float8 ->
    float8 rowwise -> 16-bit -> 16-bit with a float32 result -> float32,
    skipping formats the plan's measures say fail there) after ``patience``
    troubled steps in a row, and moves it back toward the plan's own format
    after ``window`` quiet steps in a row. Gradients' overflows are the loss
    scale's business (it skips the step): they are counted, not acted on.

    Args:
      plan: the :class:`~jaxscale.precision.Plan` to run (its sites in the
        order the function meets them, as the sensor made it).
      dtype: the 16-bit autocast dtype (default: the plan's ``dtype``; a
        plan that records none needs it given). Another dtype than the plan's
        raises.
      patience: troubled steps in a row that raise a site.
      window: quiet steps in a row that lower a raised site.
      headroom: a float16 output whose largest magnitude exceeds
        ``65504 / headroom`` is trouble.
      max_flush: the share of float8 flushes that is trouble.
      base: the plan's formats a raised site returns to (default: ``plan``'s
        own; :meth:`replan` carries it over).

    Examples:
      >>> import jaxscale as jxs
      >>> import jax, jax.numpy as jnp
      >>> def loss(p, x):
      ...     return jnp.mean(jnp.tanh(x @ p["w1"]) @ p["w2"])
      >>> p = {"w1": jnp.ones((16, 32)) / 16, "w2": jnp.ones((32, 4))}
      >>> x = jax.random.normal(jax.random.key(0), (8, 16))
      >>> plan = jxs.plan_precision(loss, jnp.float16, cost="H100")(p, x)
      >>> mon = jxs.precision.Monitor(plan, jnp.float16, patience=1)
      >>> state = mon.init()
      >>> (value, grads), seen = mon.value_and_grad(loss)(p, x)
      >>> state = mon.update(state, seen)
      >>> int(state.steps), state.troubled.tolist()
      (1, [0, 0])
      >>> mon2, state2, changes = mon.replan(state)
      >>> changes
      ()
    """

    plan: Plan
    dtype: Any = None
    patience: int = 3
    window: int = 1000
    headroom: float = 4.0
    max_flush: float = 0.01
    base: tuple[Format, ...] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.plan, Plan):
            raise TypeError(
                "`plan` must be a `jxs.precision.Plan` (from `jxs.plan_precision`), "
                f"got {type(self.plan).__name__}."
            )
        object.__setattr__(self, "dtype", _monitor_dtype(self.plan, self.dtype))
        for name in ("patience", "window"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"`{name}` must be an int >= 1, got {v!r}.")
        if not (math.isfinite(self.headroom) and self.headroom >= 1):
            raise ValueError(
                f"`headroom` must be a number >= 1, got {self.headroom!r}."
            )
        if not 0 <= self.max_flush < 1:
            raise ValueError(f"`max_flush` must be in [0, 1), got {self.max_flush!r}.")
        base = tuple(self.base) if self.base is not None else tuple(_order(self.plan))
        if len(base) != len(self.plan.sites):
            raise ValueError("`base` must give one format per site of the plan.")
        object.__setattr__(self, "base", base)

    # ------------------------------------------------------------- in the step

    def init(self) -> MonitorState:
        """Counters at zero for the plan's sites."""
        n = len(self.plan.sites)
        # A fresh array per field: a step that donates the state donates each.
        return MonitorState(
            jnp.zeros((), jnp.int32),
            jnp.zeros(n, jnp.int32),
            jnp.zeros(n, jnp.int32),
            jnp.zeros(n, jnp.int32),
            jnp.zeros((n, _K), _F32),
            jnp.zeros((n, _K), _F32),
            jnp.zeros((n, 3), _F32),
            tuple(s.site for s in self.plan.sites),
            _formats(self.plan),
        )

    def _check(self, state: MonitorState, where: str) -> None:
        if state.sites != tuple(s.site for s in self.plan.sites):
            raise ValueError(
                f"`{where}`: `state` is for other sites than this monitor's plan: "
                "make it with this monitor's `init` (or the `replan` that made it)."
            )
        if state.formats != _formats(self.plan):
            raise ValueError(
                f"`{where}`: `state` counts for another plan of these sites "
                f"(formats {list(state.formats)}, this monitor's "
                f"{list(_formats(self.plan))}): after `replan`, carry the state "
                "and run the step of the monitor it returned (a step traced from "
                "the old monitor still runs the old plan)."
            )

    def value_and_grad(
        self,
        fun: Callable[..., Any],
        loss_scale: Any = None,
        *,
        argnums: int | Sequence[int] = 0,
        has_aux: bool = False,
    ) -> Callable[..., Any]:
        """``fun`` run with the plan, differentiated: the returned function
        gives ``((value, grads), seen)``, ``seen`` the step's measurements
        (``f32[n, len(FIELDS)]``) for :meth:`update`. With ``loss_scale`` (a
        loss scale or a state holding one), as :func:`jaxscale.value_and_grad`:
        the loss is scaled and the gradients come back scaled."""
        rule = _MonitorRule(
            tuple((s.site, s.format) for s in self.plan.sites),
            "the monitor's plan",
            kinds=frozenset(m.kind for m in self.plan.measures),
        )
        run = autocast(fun, self.dtype, plan=rule)
        single = isinstance(argnums, int)
        nums = (argnums,) if single else tuple(argnums)
        n = len(self.plan.sites)

        def with_probes(*args: Any) -> Any:
            *args, probes = args
            with SESSION.push(Session(list(probes))):
                return run(*args)

        def step(*args: Any) -> Any:
            probes = tuple(zeros(Watch) for _ in range(n))
            where = (*nums, len(args))
            if loss_scale is None:
                vg = jax.value_and_grad(with_probes, argnums=where, has_aux=has_aux)
            else:
                vg = scaled(with_probes, loss_scale, argnums=where, has_aux=has_aux)
            value, grads = vg(*args, probes)
            rows = [jnp.stack(list(w)) for w in grads[-1]]  # in FIELDS order
            seen = jnp.stack(rows) if n else jnp.zeros((0, _K), _F32)
            grads = grads[0] if single else tuple(grads[:-1])
            return (value, grads), seen

        return step

    def troubled(self, seen: jax.Array) -> tuple[jax.Array, jax.Array]:
        """``(bad, calm)``, ``bool[n]`` each: the sites the step's measurements
        call troubled in their format, and those that would be quiet in any
        format (no overflow, operands and output within float16's range with
        ``headroom``, float8 flushes within ``max_flush``): only calm steps
        count toward lowering a site."""
        formats = list(self.plan.formats().values())
        top = float(jnp.finfo(self.dtype).max) / self.headroom
        half = self.dtype == np.float16

        def mask(which: tuple[Format, ...]) -> jax.Array:
            return jnp.asarray(np.array([f in which for f in formats], bool))

        eight = (Format.FLOAT8, Format.FLOAT8_ROWWISE)
        col = Watch.columns(seen)
        big_out = col.y_amax > top if half else jnp.zeros(len(formats), bool)
        big_in = jnp.maximum(col.x_amax, col.w_amax) > top
        big_in = big_in if half else jnp.zeros(len(formats), bool)
        flush = col.float8_flush > self.max_flush
        overflow = col.overflow > 0
        bad = (
            overflow
            | (mask((Format.HALF, *eight)) & big_out)
            | (mask((Format.HALF, Format.HALF_WIDE)) & big_in)
            | (mask(eight) & flush)
        )
        calm = ~(overflow | big_out | big_in | flush)
        return bad, calm

    def update(self, state: MonitorState, seen: jax.Array) -> MonitorState:
        """The counters after one step's measurements (jit-friendly).

        Raises:
          ValueError: if ``state`` is for another plan (from before a
            :meth:`replan`, or for a monitor that re-planned since).
        """
        self._check(state, "Monitor.update")
        bad, calm = self.troubled(seen)
        first = state.steps == 0
        return dataclasses.replace(
            state,
            steps=state.steps + 1,
            troubled=jnp.where(bad, state.troubled + 1, 0),
            quiet=jnp.where(calm, state.quiet + 1, 0),
            events=state.events + bad.astype(jnp.int32),
            last=seen,
            peak=jnp.maximum(state.peak, seen),
            calibration=jnp.where(first, seen[:, list(_AMAX)], state.calibration),
        )

    # ------------------------------------------------------------ on the host

    def replan(
        self, state: MonitorState
    ) -> tuple[Monitor, MonitorState, tuple[str, ...]]:
        """A new monitor (with its plan), its state and the changes, in words:
        sites raised after ``patience`` troubled steps, sites lowered toward
        the plan's format after ``window`` quiet steps. Reads ``state`` on the
        host (one transfer); the changed sites' counters restart. Unchanged:
        the same monitor and state, and ``()``."""
        self._check(state, "Monitor.replan")
        troubled, quiet = _agree_counters(self.plan, state)
        plan, changes, reset = self.plan, [], []
        for i, s in enumerate(self.plan.sites):
            m = self.plan.measures[i]
            usable = [f for f in PRECISION if math.isfinite(m.errors.get(f, math.inf))]
            rank = PRECISION.index
            new = None
            if troubled[i] >= self.patience:
                up = [f for f in usable if rank(f) < rank(s.format)]
                new = up[-1] if up else None
                why = f"raised by the monitor after {troubled[i]} troubled steps"
            elif quiet[i] >= self.window and rank(s.format) < rank(self.base[i]):
                down = [
                    f for f in usable if rank(s.format) < rank(f) <= rank(self.base[i])
                ]
                new = down[0] if down else None
                why = f"lowered by the monitor after {quiet[i]} quiet steps"
            if new is not None:
                plan = plan.replace(s.site, new, why=why)
                changes.append(f"{s.site}: {s.format.value} -> {new.value} ({why})")
                reset.append(i)
        if not changes:
            return self, state, ()
        keep = np.ones(len(self.plan.sites), bool)
        keep[reset] = False
        k = jnp.asarray(keep)
        state = dataclasses.replace(
            state,
            troubled=jnp.where(k, state.troubled, 0),
            quiet=jnp.where(k, state.quiet, 0),
            formats=_formats(plan),
        )
        return dataclasses.replace(self, plan=plan), state, tuple(changes)
