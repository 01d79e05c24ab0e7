"""The package's shape stays as designed: a small core, small modules, no backend
branches in the update path."""

import ast
import inspect
import pathlib

import pytest

import jaxscale as jxs

pytestmark = pytest.mark.integration

PACKAGE = pathlib.Path(jxs.__file__).resolve().parent


def code_lines(path: pathlib.Path) -> int:
    """Lines of code, not counting blank lines, comments and docstrings."""
    src = path.read_text()
    docstrings = set()
    for node in ast.walk(ast.parse(src)):
        body = getattr(node, "body", None)
        if (
            isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef)
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            docstrings.update(range(body[0].lineno, body[0].end_lineno + 1))
    return sum(
        1
        for i, line in enumerate(src.splitlines(), 1)
        if line.strip() and not line.strip().startswith("#") and i not in docstrings
    )


def test_no_module_exceeds_400_lines_of_code():
    sizes = {
        p.relative_to(PACKAGE).as_posix(): code_lines(p) for p in PACKAGE.rglob("*.py")
    }
    assert max(sizes.values()) <= 400, sizes


def test_the_core_takes_three_parameters():
    assert list(inspect.signature(jxs.dynamic_scaling).parameters) == [
        "inner",
        "loss_scale",
        "axis_name",
    ]


# Modules that report on a compiled program and put nothing in one: the float8
# GEMM check counts cuBLASLt float8 calls only where the program was compiled
# for a GPU.
REPORTS_ON_BACKEND = {"_check.py"}  # jaxscale/float8/_check.py


def test_no_backend_branches_in_the_package():
    """The update path compiles the same program on every backend."""
    offenders = [
        p.name
        for p in PACKAGE.rglob("*.py")
        if "default_backend" in p.read_text() and p.name not in REPORTS_ON_BACKEND
    ]
    assert not offenders, offenders


def _imports() -> dict[str, list[tuple[str, list[str], bool]]]:
    """For each module of the package: ``(imported module, names, at top level)``
    for every import of a jaxscale module."""
    graph: dict[str, list[tuple[str, list[str], bool]]] = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        tree = ast.parse(path.read_text())
        top = {id(n) for n in tree.body}
        edges = []
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [a.name for a in node.names]
                if node.module == "jaxscale":  # ``from jaxscale import _nnx``
                    for name in names:
                        edges.append((f"jaxscale.{name}", [], id(node) in top))
                elif node.module.startswith("jaxscale"):
                    edges.append((node.module, names, id(node) in top))
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith("jaxscale"):
                        edges.append((a.name, [], id(node) in top))
        graph[module] = edges
    return graph


def test_no_function_local_imports_of_jaxscale_modules():
    """Every import of a jaxscale module is at the top of its module: the
    order of the floors is visible, and nothing calls back up late."""
    late = {
        m: [target for target, _, top in edges if not top]
        for m, edges in _imports().items()
    }
    assert not {m: t for m, t in late.items() if t}, late


def test_import_graph_has_no_cycle():
    graph = {
        m: {t for t, _, _ in edges if t != m and not m.startswith(t + ".")}
        for m, edges in _imports().items()
    }
    # A package's __init__ re-exports from below; its modules never import it.
    done: dict[str, int] = {}
    path: list[str] = []

    def visit(m: str) -> None:
        if done.get(m) == 2:
            return
        assert done.get(m) != 1, f"import cycle: {' -> '.join([*path, m])}"
        done[m] = 1
        path.append(m)
        for t in sorted(graph.get(m, ())):
            if t in graph:
                visit(t)
        path.pop()
        done[m] = 2

    for m in sorted(graph):
        visit(m)
    inward = [
        (m, t)
        for m, ts in graph.items()
        for t in ts
        if t in ("jaxscale", "jaxscale.diagnostics", "jaxscale.testing")
        and not m.startswith(t)
        and m != "jaxscale"
    ]
    assert not inward, f"private modules import a public namespace: {inward}"


def test_no_private_name_is_imported_across_modules():
    """A name another module needs is that module's internal API: no leading
    underscore (the modules themselves are private)."""
    private = {
        m: [(t, n) for t, names, _ in edges for n in names if n.startswith("_")]
        for m, edges in _imports().items()
    }
    assert not {m: v for m, v in private.items() if v}, private


def test_the_nnx_module_is_on_the_ground_floor():
    assert [t for t, _, _ in _imports()["jaxscale._nnx"]] == []


def test_no_private_jax_outside_the_adapter():
    offenders = [
        p.name
        for p in PACKAGE.rglob("*.py")
        if "jax._src" in p.read_text() and p.name != "_jax_private.py"
    ]
    assert not offenders, offenders


# The package's shape: the core at the top, and each wing in its folder.
WINGS = {"_autocast", "diagnostics", "float8", "precision", "testing"}


def test_the_wings_have_their_folders():
    """``ls jaxscale/`` shows the core and the wings: no autocast, diagnostics,
    float8 or precision module lies at the top."""
    folders = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert folders == WINGS, folders
    top = sorted(p.stem for p in PACKAGE.glob("*.py"))
    stray = [
        m
        for m in top
        if m.startswith(("_autocast", "_float8"))
        or m in {"_diagnostics", "_underflow", "_cotangents", "_monitor"}
        or m in {"_plan", "_solve", "_measure", "_sensor", "_precision"}
    ]
    assert not stray, stray
    for wing in ("_autocast", "diagnostics", "float8", "precision"):
        assert len(list((PACKAGE / wing).glob("*.py"))) >= 4, wing


@pytest.mark.parametrize("wing", ["_autocast", "float8", "diagnostics", "precision"])
def test_no_mutable_module_globals_in_the_wings(wing):
    """The wings' tables are read-only (``MappingProxyType``, tuples): state
    lives in interpreters and contexts, and what a trace puts in scope lives in a
    thread-local ``jaxscale._scope.Scope``, not in a module's list."""
    mutable = (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp)
    found = []
    for path in sorted((PACKAGE / wing).glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            value = getattr(node, "value", None)
            targets = getattr(node, "targets", None) or [getattr(node, "target", None)]
            if isinstance(node, ast.Assign | ast.AnnAssign) and isinstance(
                value, mutable
            ):
                names = [ast.unparse(t) for t in targets if t is not None]
                if names != ["__all__"]:
                    found.append(f"{path.name}: {', '.join(names)}")
    assert not found, found
