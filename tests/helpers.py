"""Helpers shared by the test files, as equinox's ``tests/helpers.py``.

Fixtures and the strict modes stay in ``conftest.py``; plain functions that
several test files use live here (``from helpers import relaxed``).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import optax
from jax.extend import core as jcore


def with_promotion(
    inner: optax.GradientTransformation, mode: str
) -> optax.GradientTransformation:
    """``inner`` traced under dtype promotion ``mode`` ("standard", "strict")."""
    inner = optax.with_extra_args_support(inner)

    def init(params):
        with jax.numpy_dtype_promotion(mode):
            return inner.init(params)

    def update(updates, state, params=None, **extra):
        with jax.numpy_dtype_promotion(mode):
            return inner.update(updates, state, params, **extra)

    return optax.GradientTransformationExtraArgs(init, update)


def relaxed(inner: optax.GradientTransformation) -> optax.GradientTransformation:
    """``inner`` traced under standard dtype promotion (optax's own code needs it).

    The suite runs with ``jax_numpy_dtype_promotion="strict"`` (see conftest.py);
    some optax optimizers (adam, adafactor) promote implicitly themselves, so
    tests wrap them in this, which relaxes promotion *only* while tracing the
    inner optimizer, never jaxscale's own code.
    """
    return with_promotion(inner, "standard")


def jaxprs_in_params(params) -> Iterator[jcore.Jaxpr]:
    """``jax.extend.core.jaxprs_in_params`` (absent from jax 0.7.1, the floor)."""
    for value in params.values():
        for v in value if isinstance(value, tuple | list) else (value,):
            if isinstance(v, jcore.ClosedJaxpr):
                yield v.jaxpr
            elif isinstance(v, jcore.Jaxpr):
                yield v


def all_eqns(jaxpr) -> Iterator[jcore.JaxprEqn]:
    """Every equation of a jaxpr (closed or not) and of its sub-jaxprs."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in jaxprs_in_params(eqn.params):
            yield from all_eqns(sub)


def run_script(
    script: Path, *args: str, cwd: Path, timeout: float = 600
) -> subprocess.CompletedProcess:
    """``python script *args`` in ``cwd``, output captured, with a headless
    matplotlib backend in case the script draws a plot."""
    return subprocess.run(
        [sys.executable, str(script), *args],
        cwd=cwd,
        env={**os.environ, "MPLBACKEND": "Agg"},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def unpriced_kind_warns() -> Any:
    """What a float8 choice made by the cost model without `device_kind` gives
    on this host: the warning that the default device's kind has no figures
    (the CPU: the H100 SXM's are used), or nothing (a GPU the model knows)."""
    import pytest

    import jaxscale as jxs
    from jaxscale._cost import is_known

    if is_known(jax.devices()[0].device_kind):
        return contextlib.nullcontext()
    return pytest.warns(jxs.AutocastWarning, match="has no figures for the device")


# --------------------------------------------------------------------------- #
# Several jax.distributed processes on this machine (tests/test_*multiprocess.py).
# --------------------------------------------------------------------------- #

_NO_COLLECTIVES = (
    r"(gloo|cpu[_ ]collectives).*(not (available|supported|built|implemented)|"
    r"unimplemented|unavailable)"
)


def join_processes(
    process_id: int, port: int, processes: int, devices: int, timeout: int
):
    """In a worker process: ``devices`` CPU devices, Gloo collectives, and
    ``jax.distributed`` joined as process ``process_id`` of ``processes``."""
    jax.config.update("jax_num_cpu_devices", devices)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=processes,
        process_id=process_id,
        initialization_timeout=timeout,
    )
    jax.config.update("jax_numpy_dtype_promotion", "strict")


def run_processes(script: Path | str, processes: int, timeout: int) -> list[dict]:
    """Run ``python script <process id> <port>`` ``processes`` times at once
    (CPU only, a free port on localhost) and return each one's last ``RESULT
    <json>`` line, parsed; skip where the platform has no CPU collectives across
    processes, fail on a worker's error or after ``timeout`` seconds."""
    import json
    import re
    import socket

    import pytest

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(root), *filter(None, [env.get("PYTHONPATH")])]
    )
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(i), str(port)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=root,
        )
        for i in range(processes)
    ]
    try:
        outputs = [proc.communicate(timeout=timeout) for proc in procs]
    except subprocess.TimeoutExpired:
        for proc in procs:
            proc.kill()
            proc.communicate()
        pytest.fail(f"the {processes} workers did not finish within {timeout} s")
    results = []
    for i, (proc, (out, err)) in enumerate(zip(procs, outputs, strict=True)):
        if proc.returncode != 0 and re.search(_NO_COLLECTIVES, err, re.IGNORECASE):
            pytest.skip(f"this platform has no CPU collectives across processes: {err}")
        lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
        assert proc.returncode == 0 and lines, f"worker {i} failed:\n{out}\n{err}"
        results.append(json.loads(lines[-1][len("RESULT ") :]))
    return results
