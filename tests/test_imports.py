"""Examples and benchmarks use jaxscale through its faces: the public modules
and ``jaxscale.internal``, never a private module (``jaxscale._x``,
``jaxscale.wing._x``), so that a private module can change without them."""

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
# The benchmarks that read compiled programs import the HLO reader itself:
# ``_hlo`` (kernels, bytes, dots) and ``_hlo_collectives`` (the collectives).
ALLOWED = {
    "benchmarks": {"jaxscale._hlo", "jaxscale._hlo_collectives"},
    "examples": set(),
}


def _imports(path: Path) -> list[tuple[int, str]]:
    """``(line, module)`` of each jaxscale module ``path`` imports."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.append((node.lineno, node.module))
            # `from jaxscale import _hlo` imports the module `jaxscale._hlo`
            out += [
                (node.lineno, f"{node.module}.{a.name}")
                for a in node.names
                if a.name.startswith("_")
            ]
    return [(n, m) for n, m in out if m.split(".")[0] == "jaxscale"]


def _private(module: str) -> bool:
    return any(part.startswith("_") for part in module.split(".")[1:])


@pytest.mark.parametrize("folder", sorted(ALLOWED))
def test_no_private_jaxscale_module_is_imported(folder):
    bad = []
    for path in sorted((ROOT / folder).glob("*.py")):
        for line, module in _imports(path):
            if _private(module) and module not in ALLOWED[folder]:
                bad.append(f"{path.relative_to(ROOT)}:{line}: {module}")
    assert not bad, (
        "import these through `jaxscale`, its wings or `jaxscale.internal`:\n"
        + "\n".join(bad)
    )


def test_the_check_sees_a_private_import():
    assert _private("jaxscale.float8._choice") and _private("jaxscale._speed")
    assert not _private("jaxscale.internal") and not _private("jaxscale.precision")
