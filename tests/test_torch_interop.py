"""Moving a run between torch.amp.GradScaler and jaxscale, against real torch."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxscale as jxs

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("on_cpu")]

torch = pytest.importorskip("torch")

# Overflow schedule (True = finite): streaks, isolated overflows, and finite runs
# longer than the growth interval so the scale both grows and backs off.
SCHEDULE = [bool(c == ".") for c in "...x..x.....xx..........x...x.xxx........x......."]


class TorchRun:
    """A real GradScaler on the CPU driving SGD on one tensor."""

    def __init__(self, **scaler_kwargs):
        self.param = torch.nn.Parameter(torch.ones(4))
        self.opt = torch.optim.SGD([self.param], lr=1e-3)
        self.scaler = torch.amp.GradScaler("cpu", **scaler_kwargs)

    def step(self, finite: bool) -> tuple[float, int]:
        self.opt.zero_grad()
        self.scaler.scale((self.param**2).sum()).backward()
        if not finite:
            self.param.grad[1] = float("inf")
        self.scaler.step(self.opt)
        self.scaler.update()
        return self.scaler.get_scale(), self.scaler._get_growth_tracker()


def jax_run(loss_scale, schedule):
    """The same steps through jxs.dynamic_scaling; the trajectory and final state."""
    tx = jxs.dynamic_scaling(optax.sgd(1e-3), loss_scale)
    params = jnp.ones(4)
    state = tx.init(params)
    step = jax.jit(tx.update)
    out = []
    for finite in schedule:
        grads = jnp.full(4, 2.0) * state.loss_scale.loss_scale
        if not finite:
            grads = grads.at[1].set(jnp.inf)
        updates, state = step(grads, state, params)
        params = optax.apply_updates(params, updates)
        ls = state.loss_scale
        out.append((float(ls.loss_scale), int(ls.growth_tracker)))
    return out, state


KWARGS = [
    {"init_scale": 2.0**10, "growth_interval": 5},
    {
        "init_scale": 3.0,
        "growth_factor": 4.0,
        "backoff_factor": 0.25,
        "growth_interval": 3,
    },
    {"init_scale": 2.0**16, "growth_interval": 1},
]


@pytest.mark.parametrize("kwargs", KWARGS)
@pytest.mark.parametrize("split", [(7, 30), (14, 15), (3, 45)])
def test_torch_to_jaxscale_to_torch_continues_the_same_trajectory(kwargs, split):
    a, b = split
    reference = TorchRun(**kwargs)
    expected = [reference.step(f) for f in SCHEDULE]

    first = TorchRun(**kwargs)
    got = [first.step(f) for f in SCHEDULE[:a]]
    ls = jxs.from_torch_state_dict(first.scaler.state_dict())
    middle, state = jax_run(ls, SCHEDULE[a:b])
    got += middle
    second = TorchRun()  # other defaults: everything comes from the state dict
    second.scaler.load_state_dict(jxs.to_torch_state_dict(state))
    got += [second.step(f) for f in SCHEDULE[b:]]

    assert got == expected
    assert len({s for s, _ in expected}) > 2  # the scale really moved
    assert second.scaler.state_dict() == reference.scaler.state_dict()


def test_state_dict_types_and_keys_are_torch_s():
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=7)
    ours = jxs.to_torch_state_dict(
        jxs.DynamicLossScale.create(init_scale=1024.0, growth_interval=7)
    )
    theirs = scaler.state_dict()
    assert list(ours) == list(theirs)
    assert {k: type(v) for k, v in ours.items()} == {
        k: type(v) for k, v in theirs.items()
    }
    assert ours == theirs


def test_load_state_dict_into_a_real_grad_scaler():
    ls = jxs.DynamicLossScale.create(
        init_scale=2.0**12, growth_factor=4.0, backoff_factor=0.25, growth_interval=9
    )
    for finite in [True, True, False, True, True, True]:
        ls = ls.adjust(finite)
    sd = jxs.to_torch_state_dict(ls)
    assert sd == {
        "scale": 2.0**10,
        "growth_factor": 4.0,
        "backoff_factor": 0.25,
        "growth_interval": 9,
        "_growth_tracker": 3,
    }
    run = TorchRun()
    run.scaler.load_state_dict(sd)
    assert run.scaler.state_dict() == sd
    # A scaler that has already run (lazily created tensors) accepts it too.
    run.step(True)
    run.scaler.load_state_dict(sd)
    assert run.step(True) == (2.0**10, 4)


def test_from_torch_accepts_tensors_and_keeps_the_tracker():
    sd = {
        "scale": torch.tensor(512.0),
        "growth_factor": 2.0,
        "backoff_factor": torch.tensor(0.5, dtype=torch.float64),
        "growth_interval": torch.tensor(100),
        "_growth_tracker": torch.tensor(42, dtype=torch.int32),
    }
    ls = jxs.from_torch_state_dict(sd)
    assert float(ls.loss_scale) == 512.0
    assert int(ls.growth_tracker) == 42
    assert ls.growth_interval == 100 and ls.backoff_factor == 0.5
    assert ls.hysteresis == 1
    assert ls.loss_scale.dtype == jnp.float32 and ls.growth_tracker.dtype == jnp.int32


def test_from_torch_overrides():
    sd = TorchRun(init_scale=256.0, growth_interval=10).scaler.state_dict()
    ls = jxs.from_torch_state_dict(sd, hysteresis=3, min_scale=1.0, growth_interval=20)
    assert (ls.hysteresis, int(ls.hysteresis_tracker), ls.min_scale) == (3, 3, 1.0)
    assert ls.growth_interval == 20
    assert float(jxs.from_torch_state_dict(sd, init_scale=8.0).loss_scale) == 8.0
    with pytest.raises(TypeError, match=r"Unknown override\(s\) \['scale'\]"):
        jxs.from_torch_state_dict(sd, scale=8.0)


def test_disabled_torch_scaler_gives_a_clear_error():
    sd = torch.amp.GradScaler("cpu", enabled=False).state_dict()
    assert sd == {}
    with pytest.raises(ValueError, match=r"empty.*enabled=False.*NoOpLossScale"):
        jxs.from_torch_state_dict(sd)


def test_collapsed_torch_scale_is_rejected_with_a_way_out():
    # torch has no floor: 150 overflows in a row take its scale to 0.
    run = TorchRun(init_scale=1.0)
    for _ in range(150):
        run.step(False)
    sd = run.scaler.state_dict()
    assert sd["scale"] == 0.0
    with pytest.raises(
        ValueError, match=r"`init_scale` must be > 0.*init_scale=\.\.\."
    ):
        jxs.from_torch_state_dict(sd)
    assert float(jxs.from_torch_state_dict(sd, init_scale=1.0).loss_scale) == 1.0


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        (
            {"_growth_tracker": 2000},
            ValueError,
            r"_growth_tracker'\]` must be in \[0, ",
        ),
        ({"_growth_tracker": -1}, ValueError, r"got -1"),
        ({"growth_interval": 2.5}, ValueError, r"must be an integer, got 2\.5"),
        ({"scale": "big"}, TypeError, r"`state_dict\['scale'\]` must be a float"),
        ({"scale": None}, TypeError, r"must be a float"),
        ({"scale": float("inf")}, ValueError, r"`init_scale` must be finite"),
        ({"growth_factor": 0.5}, ValueError, r"`growth_factor` must be > 1"),
    ],
)
def test_from_torch_rejects_bad_values(change, error, match):
    sd = {**TorchRun().scaler.state_dict(), **change}
    with pytest.raises(error, match=match):
        jxs.from_torch_state_dict(sd)


def test_from_torch_rejects_missing_keys_and_non_dicts():
    sd = TorchRun().scaler.state_dict()
    del sd["_growth_tracker"]
    with pytest.raises(ValueError, match=r"lacks the key\(s\) \['_growth_tracker'\]"):
        jxs.from_torch_state_dict(sd)
    with pytest.raises(TypeError, match="must be the dict returned"):
        jxs.from_torch_state_dict([("scale", 1.0)])


def test_to_torch_refuses_what_torch_cannot_represent():
    hyst = jxs.DynamicLossScale.create(hysteresis=2)
    with pytest.raises(ValueError, match=r"`hysteresis` must be 1 .* got 2.*strict"):
        jxs.to_torch_state_dict(hyst)
    assert jxs.to_torch_state_dict(hyst, strict=False)["scale"] == 2.0**16
    floored = jxs.DynamicLossScale.create(min_scale=1.0)
    with pytest.raises(ValueError, match=r"`min_scale` and `max_scale`.*\[1\.0, "):
        jxs.to_torch_state_dict(floored)
    assert jxs.to_torch_state_dict(floored, strict=False)["growth_interval"] == 2000
    for kind in [jxs.StaticLossScale.create(8.0), jxs.NoOpLossScale()]:
        with pytest.raises(TypeError, match="must be a jxs.DynamicLossScale"):
            jxs.to_torch_state_dict(kind)


def test_to_torch_finds_the_loss_scale_in_any_state():
    tx = jxs.accumulate(jxs.dynamic_scaling(optax.sgd(0.1)), every_k=2)
    state = tx.init({"w": jnp.ones(2)})
    assert jxs.to_torch_state_dict(state)["scale"] == 2.0**16


def test_round_trip_through_a_torch_checkpoint_file(tmp_path):
    ls = jxs.DynamicLossScale.create(init_scale=2.0**7, growth_interval=4)
    ls = ls.adjust(True).adjust(True).adjust(False).adjust(True)
    torch.save({"scaler": jxs.to_torch_state_dict(ls)}, tmp_path / "ckpt.pt")
    loaded = torch.load(tmp_path / "ckpt.pt")["scaler"]
    back = jxs.from_torch_state_dict(loaded)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(ls), strict=True):
        np.testing.assert_array_equal(a, b)
    assert jax.tree.structure(back) == jax.tree.structure(ls)


def test_the_migration_guide_loop_runs_and_clips_with_jxs_clip_by_global_norm():
    """docs/migrating.md's jaxscale loop, executed as written on a small problem.

    0.1.0's guide clipped with ``optax.clip_by_global_norm`` in the loop while
    README and docs/clipping.md recommend ``jxs.clip_by_global_norm``.
    """
    import pathlib
    import re

    guide = pathlib.Path(__file__).resolve().parents[1] / "docs" / "migrating.md"
    blocks = re.findall(r"```python\n(.*?)```", guide.read_text(), re.S)
    (snippet,) = [b for b in blocks if "jxs.dynamic_scaling(" in b and "for " in b]
    assert "jxs.clip_by_global_norm(" in snippet
    assert "optax.clip_by_global_norm(" not in snippet
    rng = np.random.default_rng(0)
    target = jnp.asarray(rng.standard_normal((3, 1)), jnp.float32)
    loader = []
    for _ in range(5):
        x = jnp.asarray(rng.standard_normal((8, 3)), jnp.float32)
        loader.append((x, x @ target))

    def loss_fn(params, batch):
        x, y = batch
        pred = x.astype(jnp.float16) @ params["w"].astype(jnp.float16)
        return jnp.mean((pred.astype(jnp.float32) - y) ** 2)

    params = {"w": jnp.zeros((3, 1), jnp.float32)}
    scope = {"jax": jax, "jnp": jnp, "optax": optax, "jxs": jxs}
    scope.update(loss_fn=loss_fn, params=params, loader=loader)
    with jax.numpy_dtype_promotion("standard"):  # optax.adam promotes itself
        exec(snippet, scope)  # noqa: S102 - our own documentation
    state = scope["opt_state"]
    # At 2**16 the second batch overflows float16 (by ~30%); the scale backs off.
    assert int(state.steps) == 5 and int(state.skipped_steps) == 1
    assert float(loss_fn(scope["params"], loader[0])) < float(
        loss_fn(params, loader[0])
    )


def test_integer_entries_are_read_exactly_never_through_a_float():
    """Integer tensors are read with ``__index__``; integral floats still count."""
    sd = {
        "scale": torch.tensor(1024.0),
        "growth_factor": 2.0,
        "backoff_factor": 0.5,
        "growth_interval": torch.tensor(2**24 + 3),
        "_growth_tracker": np.int64(2**24 + 1),
    }
    ls = jxs.from_torch_state_dict(sd)
    assert ls.growth_interval == 2**24 + 3 and int(ls.growth_tracker) == 2**24 + 1
    ls = jxs.from_torch_state_dict({**sd, "_growth_tracker": torch.tensor(5.0)})
    assert int(ls.growth_tracker) == 5
    # 0.1.0 went through float(): the message showed 9007199254740992.
    with pytest.raises(ValueError, match=r"\[0, 16777219\), got 9007199254740993\."):
        jxs.from_torch_state_dict({**sd, "_growth_tracker": torch.tensor(2**53 + 1)})
    with pytest.raises(ValueError, match=r"`state_dict\['_growth_tracker'\]` must be"):
        jxs.from_torch_state_dict({**sd, "_growth_tracker": torch.tensor(2.5)})
    with pytest.raises(TypeError, match=r"must be an int \(or a one-element tensor\)"):
        jxs.from_torch_state_dict({**sd, "growth_interval": "2000"})


def test_max_scale_inf_override_means_no_ceiling():
    """torch users' spelling of "no ceiling" works as an override too."""
    sd = jxs.to_torch_state_dict(jxs.DynamicLossScale.create())
    ls = jxs.from_torch_state_dict(sd, max_scale=float("inf"))
    assert ls.max_scale == float(np.finfo(np.float32).max)
    assert jxs.to_torch_state_dict(ls) == sd  # the default bounds: strict is happy
