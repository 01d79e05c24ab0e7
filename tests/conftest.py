"""Strict modes for the whole suite, as equinox's tests do.

* ``jax_numpy_dtype_promotion="strict"``: jaxscale must never rely on implicit
  promotion (e.g. turning f16 leaves into f32). Some optax optimizers (adam,
  adafactor) promote implicitly themselves; tests wrap those in :func:`relaxed`,
  which relaxes promotion *only* while tracing the inner optimizer.
* ``jax_numpy_rank_promotion="raise"``.
* 8 CPU devices, so multi-device code is tested on one machine.
"""

from __future__ import annotations

import os

import jax
import optax
import pytest

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")


def pytest_addoption(parser):
    parser.addoption(
        "--runslow", action="store_true", help="run tests marked slow (full size)"
    )


def pytest_collection_modifyitems(config, items):
    if config.getoption("--runslow") or os.environ.get("JAXSCALE_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="slow: pass --runslow or set JAXSCALE_SLOW=1")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


def relaxed(inner: optax.GradientTransformation) -> optax.GradientTransformation:
    """``inner`` traced under standard dtype promotion (optax's own code needs it)."""
    inner = optax.with_extra_args_support(inner)

    def init(params):
        with jax.numpy_dtype_promotion("standard"):
            return inner.init(params)

    def update(updates, state, params=None, **extra):
        with jax.numpy_dtype_promotion("standard"):
            return inner.update(updates, state, params, **extra)

    return optax.GradientTransformationExtraArgs(init, update)


@pytest.fixture
def relax():
    return relaxed


def enable_x64():
    """``jax.enable_x64(True)`` (jax >= 0.8), or its older experimental form."""
    if hasattr(jax, "enable_x64"):
        return jax.enable_x64(True)
    from jax.experimental import enable_x64 as legacy

    return legacy(True)


def set_mesh(mesh):
    """``jax.set_mesh(mesh)`` (jax >= 0.7.1), or ``jax.sharding.use_mesh``."""
    if hasattr(jax, "set_mesh"):
        return jax.set_mesh(mesh)
    return jax.sharding.use_mesh(mesh)
