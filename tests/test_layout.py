"""The package's shape stays as designed: a small core, small modules, no backend
branches in the update path."""

import ast
import inspect
import pathlib

import jaxscale as jxs

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


def test_no_backend_branches_in_the_package():
    """The update path compiles the same program on every backend."""
    offenders = [
        p.name for p in PACKAGE.rglob("*.py") if "default_backend" in p.read_text()
    ]
    assert not offenders, offenders
