"""Strict modes and test tiers for the whole suite, as equinox's tests do.

* ``jax_numpy_dtype_promotion="strict"``: jaxscale must never rely on implicit
  promotion (e.g. turning f16 leaves into f32). Some optax optimizers (adam,
  adafactor) promote implicitly themselves; tests wrap those in
  ``helpers.relaxed``, which relaxes promotion *only* while tracing the inner
  optimizer.
* ``jax_numpy_rank_promotion="raise"``.
* 8 CPU devices, so multi-device code is tested on one machine.
* Every test has exactly one tier marker (``unit``, ``core`` or ``integration``,
  see ``[tool.pytest.ini_options]`` in pyproject.toml); collection fails
  otherwise. Doctests of ``jaxscale/`` are ``unit``. ``pytest -m unit`` is the
  edit-test loop; ``.ci/floors`` and ``.ci/ceiling`` run
  ``-m "unit or core or construct or libraries"``. A ``pinned`` test must be
  ``integration``, not ``construct`` nor ``libraries`` (collection fails otherwise).

Shared helper functions live in ``helpers.py``; fixtures live here.
"""

from __future__ import annotations

import itertools
import os
import re

import jax
import pytest
from _pytest.doctest import DoctestItem
from _pytest.mark.expression import Expression
from helpers import relaxed

# ``JAXSCALE_TEST_COMPILE=fast`` (the README's second pass, .ci/floors and
# .ci/ceiling): XLA:CPU compiles with less optimisation, for the tests that assert
# no compiler figure (the `pinned` and `isa` tests run at the default). Added to
# XLA_FLAGS before any backend starts, each flag only where this jaxlib knows it
# (an unknown flag aborts XLA): LLVM's optimisation off, its expensive passes off,
# and the fusion emitters off (jaxlib <= 0.10; XLA:CPU then emits each fusion as
# its elemental emitter does, about half the compile time of a whole test file).
# Each is a code-generation choice: the programs compute the same operations, and
# a comparison within one run compares programs compiled alike.
FAST_COMPILE = (
    "--xla_backend_optimization_level=0",
    "--xla_llvm_disable_expensive_passes=true",
    "--xla_cpu_use_fusion_emitters=false",
)


def _known_xla_flags(flags: tuple[str, ...]) -> list[str]:
    """Those of ``flags`` that this jaxlib's XLA parses, tried in a child process
    (all at once, then one at a time if that fails; once per run: pytest-xdist's
    workers inherit the result)."""
    import subprocess
    import sys

    def parses(tried: tuple[str, ...]) -> bool:
        probe = "import jax.numpy as jnp; jnp.zeros(1).block_until_ready()"
        env = {**os.environ, "XLA_FLAGS": " ".join(tried), "JAX_PLATFORMS": "cpu"}
        done = subprocess.run(
            [sys.executable, "-c", probe], env=env, capture_output=True, check=False
        )
        return done.returncode == 0

    if parses(flags):
        return list(flags)
    return [flag for flag in flags if parses((flag,))]


def _fast_compile() -> None:
    mode = os.environ.get("JAXSCALE_TEST_COMPILE", "")
    if mode not in ("", "fast"):
        raise ValueError(
            f"JAXSCALE_TEST_COMPILE must be 'fast' or unset, got {mode!r}."
        )
    if mode != "fast" or os.environ.get("JAXSCALE_TEST_COMPILE_FLAGS") is not None:
        return  # not asked, or a pytest-xdist worker: the parent set XLA_FLAGS
    flags = _known_xla_flags(FAST_COMPILE)
    os.environ["JAXSCALE_TEST_COMPILE_FLAGS"] = " ".join(flags)
    os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), *flags])


_fast_compile()
jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")

TIERS = ("unit", "core", "integration")
# A whole file in one tier says so on one line (the tier first where the file has
# more markers), which pytest_ignore_collect reads without importing the file.
_FILE_TIER = re.compile(r"^pytestmark = \[?pytest\.mark\.(\w+)[,\]]?", re.M)
_MARK = re.compile(r"pytest\.mark\.(\w+)")


def pytest_report_header(config):
    flags = os.environ.get("JAXSCALE_TEST_COMPILE_FLAGS")
    if flags is not None:
        return f"JAXSCALE_TEST_COMPILE=fast: XLA_FLAGS += {flags or '(none known)'}"
    return None


def pytest_addoption(parser):
    parser.addoption(
        "--runslow", action="store_true", help="run tests marked slow (full size)"
    )


def _may_select(markexpr: str, source: str) -> bool:
    """Whether ``-m markexpr`` can select a test of a file with this source.

    Its markers can only be those the source names (``pytest.mark.<name>``), and
    its tier is the module-level ``pytestmark`` if the file has one. Doctests
    (any ``.py`` file that is not a ``test_*.py``) are ``unit``. Every other
    combination of the named markers is tried, so this errs on the side of
    collecting.
    """
    named = set(_MARK.findall(source))
    whole = _FILE_TIER.search(source)
    if whole and whole.group(1) in TIERS:
        fixed = {t: t == whole.group(1) for t in TIERS}
    else:
        fixed = {}
    idents = set(re.split(r"[\s()]+", markexpr)) - {"", "and", "or", "not"}
    names = sorted(n for n in idents if n in named and n not in fixed)
    if len(names) > 10:
        return True
    expr = Expression.compile(markexpr)
    for values in itertools.product((False, True), repeat=len(names)):
        matcher = _Marks({**fixed, **dict(zip(names, values, strict=True))})
        if expr.evaluate(matcher):
            return True
    return False


class _Marks:
    """A ``-m`` matcher: markers not in ``marks`` are absent."""

    def __init__(self, marks: dict[str, bool]):
        self.marks = marks

    def __call__(self, name: str, /, **kwargs) -> bool:
        return self.marks.get(name, False) and not (kwargs and name in TIERS)


def pytest_ignore_collect(collection_path, config):
    """Under ``-m``, skip importing a file that cannot hold a selected test
    (``pytest -m unit`` imports neither torch nor hypothesis)."""
    markexpr = config.getoption("markexpr", "")
    if not markexpr or collection_path.suffix != ".py":
        return None
    if collection_path.name.startswith("test_"):
        source = collection_path.read_text()
    else:  # helpers, data scripts: doctests only
        source = "pytestmark = pytest.mark.unit\n"
    return None if _may_select(markexpr, source) else True


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    """A file under tests/ whose tests do not have exactly one tier each fails to
    collect (doctests are ``unit``)."""
    report = yield
    wrong = []
    for item in report.result if report.passed else []:
        if isinstance(item, DoctestItem):
            item.add_marker(pytest.mark.unit)
        if isinstance(item, pytest.Item):
            names = {m.name for m in item.iter_markers()}
            tiers = sorted(names & set(TIERS))
            if len(tiers) != 1:
                wrong.append(f"  {item.nodeid}: {', '.join(tiers) or 'no tier'}")
            elif "pinned" in names and (
                tiers[0] != "integration" or names & {"construct", "libraries"}
            ):
                wrong.append(
                    f"  {item.nodeid}: pinned, but {tiers[0]}, construct or libraries"
                )
    if wrong:
        report.outcome, report.result = "failed", []
        report.longrepr = (
            f"{len(wrong)} test(s) without exactly one tier marker (or pinned "
            "outside the integration tier):\n"
            + "\n".join(wrong)
            + "\nMark each test (or the file, with a module-level `pytestmark = "
            "pytest.mark.unit`) with exactly one of "
            + ", ".join(f"`{t}`" for t in TIERS)
            + "; pyproject.toml [tool.pytest.ini_options] says which is which. A "
            "`pinned` test (one XLA's figures) is `integration`, not `construct` and "
            "not `libraries`, "
            "so that the floors and the ceiling leave it out."
        )
    return report


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects
def pytest_collection_modifyitems(config, items):
    for item in items:  # jaxscale/'s doctests, which the hook above does not see
        if isinstance(item, DoctestItem) and not item.get_closest_marker("unit"):
            item.add_marker(pytest.mark.unit)
    if config.getoption("--runslow") or os.environ.get("JAXSCALE_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="slow: pass --runslow or set JAXSCALE_SLOW=1")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def relax():
    return relaxed


@pytest.fixture
def on_cpu():
    """The test's uncommitted arrays and jitted programs on the first CPU device,
    on any host: for results compared with torch on the CPU or with a program
    on the suite's 8 CPU devices (close to the bit only when XLA:CPU compiled
    both; on a GPU host the default device is the GPU)."""
    with jax.default_device(jax.devices("cpu")[0]):
        yield


def pytest_runtest_logreport(report):
    """With ``JAXSCALE_FAILURES=<file>``, each failure's traceback is appended to
    that file as it happens (``.ci/gpu``: a suite cut off by its time limit
    still says what failed and why). With ``JAXSCALE_RAN=<file>``, each test
    that finished appends a line ``nodeid<TAB>outcome<TAB>seconds`` (``.ci/gpu``
    lists the collected tests that never ran, and the slowest). Under xdist the
    worker writes; the controller's copy of the report (``report.node``) is
    left out, so each line is written once."""
    if getattr(report, "node", None) is not None:
        return
    path = os.environ.get("JAXSCALE_FAILURES")
    if path and report.failed:
        with open(path, "a", encoding="utf-8") as out:
            out.write(f"=== {report.nodeid} ({report.when})\n{report.longreprtext}\n")
    path = os.environ.get("JAXSCALE_RAN")
    if path and report.when == "teardown":
        _RUN_TIME[report.nodeid] = _RUN_TIME.get(report.nodeid, 0.0) + report.duration
        outcome = _OUTCOME.pop(report.nodeid, "passed")
        if report.failed:
            outcome = "error"
        with open(path, "a", encoding="utf-8") as out:
            seconds = _RUN_TIME.pop(report.nodeid)
            out.write(f"{report.nodeid}\t{outcome}\t{seconds:.2f}\n")
    elif path:
        _RUN_TIME[report.nodeid] = _RUN_TIME.get(report.nodeid, 0.0) + report.duration
        if report.failed:
            _OUTCOME[report.nodeid] = "failed" if report.when == "call" else "error"
        elif report.skipped:
            _OUTCOME.setdefault(report.nodeid, "skipped")


def pytest_collection_finish(session):
    """With ``JAXSCALE_COLLECTED=<file>``, the selected tests' node ids, one a
    line, written once (by xdist's first worker: each collects the same)."""
    path = os.environ.get("JAXSCALE_COLLECTED")
    worker = getattr(session.config, "workerinput", {}).get("workerid", "gw0")
    if path and worker == "gw0":
        with open(path, "w", encoding="utf-8") as out:
            out.writelines(f"{item.nodeid}\n" for item in session.items)


_RUN_TIME: dict[str, float] = {}  # per test: setup and call seconds so far
_OUTCOME: dict[str, str] = {}  # per test: "failed", "error" or "skipped" so far


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
