"""The test tiers hold: every test has exactly one of ``unit``, ``core`` and
``integration`` (conftest.py fails collection otherwise, tested here on a scratch
suite), ``-m`` skips files of other tiers without importing them, and CI selects
by marker, not by file list."""

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from conftest import TIERS, _may_select

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"


def _pytest(
    where: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """pytest in a scratch suite under ``where`` with this suite's conftest.py,
    helpers.py and pytest settings (``env``: added to the environment)."""
    for name in ("conftest.py", "helpers.py"):
        shutil.copy(TESTS / name, where / name)
    ini = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]
    markers = "".join(f"\n  {m}" for m in ini["ini_options"]["markers"])
    (where / "pytest.ini").write_text(f"[pytest]\nmarkers ={markers}\n")
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args],
        cwd=where,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_a_test_without_a_tier_or_with_two_fails_collection(tmp_path):
    (tmp_path / "test_none.py").write_text("def test_untiered():\n    pass\n")
    (tmp_path / "test_two.py").write_text(
        "import pytest\n\npytestmark = pytest.mark.unit\n\n\n"
        "@pytest.mark.core\ndef test_twice():\n    pass\n"
    )
    (tmp_path / "test_one.py").write_text(
        "import pytest\n\n\n@pytest.mark.integration\ndef test_once():\n    pass\n"
    )
    proc = _pytest(tmp_path, "--collect-only", "-q")
    out = proc.stdout + proc.stderr
    assert proc.returncode == pytest.ExitCode.INTERRUPTED, out
    assert "ERROR collecting test_none.py" in out, out
    assert "test_none.py::test_untiered: no tier" in out, out
    assert "ERROR collecting test_two.py" in out, out
    assert "test_two.py::test_twice: core, unit" in out, out
    assert "test_one.py" not in out.split("= ERRORS =")[-1], out


def test_doctests_are_unit_and_minus_m_does_not_import_other_tiers(tmp_path):
    (tmp_path / "module.py").write_text(
        'def f():\n    """\n    >>> 1 + 1\n    2\n    """\n'
    )
    (tmp_path / "test_unit.py").write_text(
        "import pytest\n\npytestmark = pytest.mark.unit\n\n\n"
        "def test_fast():\n    pass\n"
    )
    (tmp_path / "test_slow_tier.py").write_text(
        "import pytest\n\npytestmark = pytest.mark.integration\n\n"
        "raise RuntimeError('imported under -m unit')\n"
    )
    proc = _pytest(tmp_path, "--doctest-modules", "-m", "unit", "-v")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "module.py::module.f PASSED" in out, out
    assert "test_unit.py::test_fast PASSED" in out, out
    assert "2 passed" in out, out
    # Without -m the file is imported (and here fails to): nothing is hidden.
    proc = _pytest(tmp_path, "--doctest-modules", "--collect-only", "-q")
    assert "imported under -m unit" in proc.stdout + proc.stderr


UNIT, CORE, INTEGRATION = (f"pytestmark = pytest.mark.{t}\n" for t in TIERS)
SLOW, ISA = "@pytest.mark.slow\n", "@pytest.mark.isa\n"
PER_TEST = "@pytest.mark.core\ndef test_a(): ...\n@pytest.mark.unit\n"


@pytest.mark.parametrize(
    ("markexpr", "source", "selectable"),
    [
        ("unit", UNIT, True),
        ("unit", CORE, False),
        ("unit or core", INTEGRATION + SLOW, False),
        ("core or slow", INTEGRATION + SLOW, True),
        ("not integration", CORE, True),
        ("unit and not slow", UNIT + SLOW, True),
        ("isa", CORE, False),
        ("isa", CORE + ISA, True),
        ("isa and not core", CORE + ISA, False),
        ("unit", PER_TEST, True),
        ("integration", PER_TEST, False),
        ("not unit", PER_TEST, True),
    ],
)
def test_minus_m_skips_a_file_only_when_no_test_in_it_can_match(
    markexpr, source, selectable
):
    assert _may_select(markexpr, source) is selectable


def test_the_tiers_are_registered_markers():
    ini = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]
    registered = {m.split(":")[0] for m in ini["ini_options"]["markers"]}
    assert (
        set(TIERS) | {"isa", "slow", "pinned", "construct", "libraries"} <= registered
    )
    assert "--strict-markers" in ini["ini_options"]["addopts"]


@pytest.mark.parametrize(
    "leg, selection",
    [
        ("floors", '-m "unit or core or construct or libraries"'),
        ("ceiling", '-m "unit or core or construct or libraries"'),
    ],
)
def test_floors_select_by_marker_not_by_file_or_test_name(leg, selection):
    script = (ROOT / ".ci" / leg).read_text()
    assert not re.search(r"tests/test_\w+\.py", script), script
    assert not re.search(r"pytest .* -k ", script), script  # a test left out by name
    assert selection in script, script


def test_the_avx2_pass_selects_by_marker():
    ci = (ROOT / ".ci" / "run").read_text()
    avx2 = re.findall(r"XLA_FLAGS=--xla_cpu_max_isa=AVX2 [^\n&]*", ci)
    assert avx2 and all("-m isa" in line for line in avx2), avx2
    assert not any(re.search(r"tests/test_\w+\.py", line) for line in avx2), avx2


def test_shared_helpers_come_from_helpers_not_conftest():
    """conftest.py holds fixtures, hooks and the jax version shims; plain helper
    functions are imported from helpers.py."""
    shims = {"enable_x64", "set_mesh"}
    for path in sorted(TESTS.glob("test_*.py")):
        for names in re.findall(r"^from conftest import (.+)$", path.read_text(), re.M):
            imported = {n.strip() for n in names.split(",")}
            if path.name != "test_tiers.py":
                assert imported <= shims, f"{path.name}: from helpers import {names}"


def test_fast_compile_mode_reaches_every_worker_and_refuses_other_values(tmp_path):
    """``JAXSCALE_TEST_COMPILE=fast`` (the README's second pass, the floors and
    the ceiling) adds to XLA_FLAGS only flags this jaxlib parses, in the parent
    and in each pytest-xdist worker; another value stops the run, naming it."""
    (tmp_path / "test_flags.py").write_text(
        "import os\n\nimport jax.numpy as jnp\nimport pytest\n\n"
        "pytestmark = pytest.mark.unit\n\n\n"
        "@pytest.mark.parametrize('k', range(2))\n"
        "def test_flags(k):\n"
        "    assert '--xla_backend_optimization_level=0' in os.environ['XLA_FLAGS']\n"
        "    assert float(jnp.ones(2).sum()) == 2.0  # XLA took every flag\n"
    )
    env_run = _pytest(tmp_path, "-n", "2", env={"JAXSCALE_TEST_COMPILE": "fast"})
    out = env_run.stdout + env_run.stderr
    assert env_run.returncode == 0, out
    assert "JAXSCALE_TEST_COMPILE=fast: XLA_FLAGS += " in out, out
    assert "2 passed" in out, out
    bad = _pytest(tmp_path, "-q", env={"JAXSCALE_TEST_COMPILE": "fastest"})
    assert bad.returncode != 0
    assert "JAXSCALE_TEST_COMPILE must be 'fast' or unset, got 'fastest'" in (
        bad.stdout + bad.stderr
    )
