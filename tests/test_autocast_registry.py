"""The autocast wing's structure: one behaviour object per rule class, the
higher-order primitives listed once, and JAX's private API behind one module."""

import ast
import contextlib
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jaxscale as jxs
from jaxscale._autocast import classes, interp
from jaxscale._autocast.hop import HANDLERS
from jaxscale._autocast.rules import HIGHER_ORDER, AutocastRule, resolve_rules
from jaxscale.diagnostics._census import INLINE_HANDLERS

pytestmark = pytest.mark.unit

PACKAGE = pathlib.Path(jxs.__file__).resolve().parent
# The autocast wing (its folder) and the report that observes it (diagnostics).
WING = sorted(
    [
        *(PACKAGE / "_autocast").glob("*.py"),
        *(PACKAGE / "diagnostics").glob("_autocast_report.py"),
        *(PACKAGE / "diagnostics").glob("_census.py"),
        *(PACKAGE / "diagnostics").glob("_islands.py"),
        *(PACKAGE / "diagnostics").glob("_report_text.py"),
    ]
)


def test_every_rule_class_has_one_behaviour():
    assert set(classes.RULE_CLASSES) == set(AutocastRule)
    for rule, behaviour in classes.RULE_CLASSES.items():
        assert isinstance(behaviour, classes.RuleClass), rule
        with pytest.raises(AttributeError):  # stateless: no attributes at all
            behaviour.state = 1


def test_the_table_uses_only_registered_classes():
    assert set(resolve_rules(None).values()) <= set(classes.RULE_CLASSES)


def test_the_interpreter_names_no_rule_class_in_its_loop():
    """Behaviour is dispatched through the registry: ``eval_eqn`` mentions only
    TRACED (owned regions, unknown higher-order primitives), PROMOTE (unknown
    first-order ones) by name."""
    tree = ast.parse(pathlib.Path(interp.__file__).read_text())
    loop = next(
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.FunctionDef) and n.name == "eval_eqn"
    )
    named = {
        n.attr
        for n in ast.walk(loop)
        if isinstance(n, ast.Attribute)
        and isinstance(n.value, ast.Name)
        and n.value.id in ("Rule", "AutocastRule")
    }
    assert named <= {"TRACED", "PROMOTE"}, named
    compares = [
        n
        for n in ast.walk(loop)
        if isinstance(n, ast.Compare)
        and any(isinstance(op, ast.Is | ast.IsNot) for op in n.ops)
        and any(
            isinstance(c, ast.Attribute) and getattr(c.value, "id", "") == "Rule"
            for c in n.comparators
        )
    ]
    assert not compares, [ast.unparse(c) for c in compares]


def test_a_new_rule_class_is_one_object():
    """A class added through the registry alone runs, with its own emission:
    here every ``exp`` replaced by ``exp2(x * log2(e))`` in float32."""

    class Exp2(classes.RuleClass):
        __slots__ = ()

        def cast_operands(self, it, eqn, vals, infos, traced):
            return [it.cast(v, np.dtype("float32")) for v in vals], None

        def emit(self, it, eqn, params, vals):
            return [jax.lax.exp2(vals[0] * np.float32(np.log2(np.e)))]

    registry = dict(classes.RULE_CLASSES, **{AutocastRule.FLOAT32: Exp2()})
    table = resolve_rules({"exp": "float32"})
    it = interp.Interpreter(np.dtype("float16"), table, HANDLERS, registry)
    closed = jax.make_jaxpr(jnp.exp)(jnp.ones(3, jnp.float16))
    outs, _ = it.eval_closed(closed, [jnp.ones(3, jnp.float16)])
    assert outs[0].dtype == jnp.float32
    np.testing.assert_allclose(outs[0], np.e, rtol=1e-6)
    assert "exp2" in str(
        jax.make_jaxpr(lambda x: it.eval_closed(closed, [x])[0])(
            jnp.ones(3, jnp.float16)
        )
    )


def test_higher_order_names_are_listed_once():
    """Every higher-order name maps to a construct that has a handler (the
    interpreter and the report's comparison alike), and the schema-free rewrite
    is there for the rest; none of them is in the first-order table."""
    assert set(HANDLERS) == {*HIGHER_ORDER.values(), "generic"}
    assert set(INLINE_HANDLERS) == set(HANDLERS)
    assert not set(HIGHER_ORDER) & set(resolve_rules(None))


def test_higher_order_primitives_accept_only_traced():
    for name in HIGHER_ORDER:
        assert jxs.autocast_rules({name: "traced"})[name] is AutocastRule.TRACED
        with pytest.raises(ValueError, match="higher-order primitive"):
            jxs.autocast_rules({name: "keep"})


def test_private_jax_only_in_the_adapter():
    offenders = [
        p.relative_to(PACKAGE).as_posix()
        for p in PACKAGE.rglob("*.py")
        if "jax._src" in p.read_text() and p.name != "_jax_private.py"
    ]
    assert not offenders, offenders


# An equation's parameters read by key (``eqn.params[...]``, ``.params.get(``,
# or a ``params`` mapping subscripted or asked with ``.get``): version facts.
_PARAM_READ = re.compile(r"\bparams\s*\[|\bparams\.get\(|\.params\.get\(")


def test_equation_parameters_are_read_only_in_the_adapter():
    """Which parameters a primitive has is what changes between JAX versions:
    only the adapter reads them (the rest asks it for structural facts)."""
    offenders = {
        p.relative_to(PACKAGE).as_posix(): [
            line.strip()
            for line in p.read_text().splitlines()
            if _PARAM_READ.search(line)
            and not line.lstrip().startswith(">>>")
            and not line.lstrip().startswith("...")
        ]
        for p in PACKAGE.rglob("*.py")
        if p.name != "_jax_private.py"
    }
    assert not {k: v for k, v in offenders.items() if v}, offenders


def test_the_parameter_check_catches_each_form():
    for line in (
        'eqn.params["y"]',
        "p = params[k]",
        'eqn.params.get("x")',
        'params.get("jaxpr")',
    ):
        assert _PARAM_READ.search(line), line
    assert not _PARAM_READ.search("rebind(eqn, vals, jaxpr=new)")


def test_the_adapter_is_the_ground_floor():
    tree = ast.parse((PACKAGE / "_jax_private.py").read_text())
    imported = {
        (n.module if isinstance(n, ast.ImportFrom) else a.name).split(".")[0]
        for n in ast.walk(tree)
        if isinstance(n, ast.Import | ast.ImportFrom)
        for a in n.names
    }
    assert imported <= {"__future__", "collections", "contextlib", "typing", "jax"}


def _imports(path):
    tree = ast.parse(path.read_text())
    return [
        (n, a.name)
        for n in ast.walk(tree)
        if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("jaxscale")
        for a in n.names
    ], tree


@pytest.mark.parametrize("path", WING, ids=lambda p: _name(p))
def test_no_private_name_crosses_modules(path):
    found, _ = _imports(path)
    private = [f"{n.module}.{name}" for n, name in found if name.startswith("_")]
    assert not private, private


@pytest.mark.parametrize("path", WING, ids=lambda p: _name(p))
def test_no_function_local_imports_of_jaxscale(path):
    _, tree = _imports(path)
    local = [
        n.module
        for f in ast.walk(tree)
        if isinstance(f, ast.FunctionDef)
        for n in ast.walk(f)
        if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("jaxscale")
    ]
    assert not local, local


def _name(path):
    """A module's dotted name below ``jaxscale`` (``_autocast.hop``)."""
    return ".".join(path.relative_to(PACKAGE).with_suffix("").parts).removesuffix(
        ".__init__"
    )


# The floors of the wing, bottom first: a module imports only lower floors (the
# modules outside the wing that it uses are on the ground floor).
OUTSIDE = {
    "diagnostics._cotangents",
    "_nnx",
    "_nnx_names",  # NNX module paths as name scopes while autocast traces
    "_policy",
}
FLOORS = [
    {"_jax_private"},
    {"_autocast", "_autocast.rules", "diagnostics._report_text", *OUTSIDE},
    {"_autocast.values", "_autocast.lookahead"},
    {"_autocast.fusion"},
    {"_autocast.attention"},
    {"_autocast.gradients"},
    {"_autocast.classes", "diagnostics._islands"},
    {"_autocast.interp"},
    {"_autocast.hop"},
    {"_autocast.entry"},
    {"diagnostics._census"},
    {"diagnostics._autocast_report"},
]


@pytest.mark.parametrize("path", WING, ids=lambda p: _name(p))
def test_imports_flow_one_way(path):
    floor = next(i for i, f in enumerate(FLOORS) if _name(path) in f)
    below = set().union(*FLOORS[:floor])
    found, _ = _imports(path)
    modules = {n.module.removeprefix("jaxscale.") for n, _ in found}
    assert modules <= below, modules - below


@pytest.mark.parametrize(
    "path", sorted((PACKAGE / "_autocast").glob("*.py")), ids=lambda p: _name(p)
)
def test_the_autocast_wing_knows_no_float8(path):
    """float8 plugs in (its recipes are rule classes passed to autocast, their
    context an extension): nothing in ``_autocast/`` imports float8 or reads
    an interpreter's float8 attribute."""
    source = path.read_text()
    found, _ = _imports(path)
    assert not [n.module for n, _ in found if "float8" in n.module]
    assert "it.float8" not in source and ".float8 =" not in source


def test_an_extension_defined_here_plugs_into_the_hooks():
    """A toy extension, defined in this file alone, sees every hook: custom
    rules run suspended, shard_map-like sub-computations opaque, and a scan
    gets its extra per-iteration input in each trace of its body."""
    events = []

    class Counting(interp.Extension):
        @contextlib.contextmanager
        def suspended(self):
            events.append("suspended")
            yield

        def loop(self, length):
            class Steps(interp.Loop):
                xs = (jnp.arange(length, dtype=jnp.float32),)

                @contextlib.contextmanager
                def body(self, extra):
                    events.append(("body", tuple(e.shape for e in extra)))
                    yield

            events.append(("loop", length))
            return Steps()

    def fn(x):
        y = jax.nn.relu(x @ x)  # relu is a custom_jvp
        return lax.scan(lambda c, _: (jnp.tanh(c @ x), None), y, None, length=3)[0]

    closed = jax.make_jaxpr(fn)(jnp.ones((4, 4)))
    it = interp.Interpreter(
        np.dtype("float16"),
        resolve_rules(None),
        HANDLERS,
        extension=Counting(),
    )
    out = jax.jit(lambda x: it.eval_closed(closed, [x])[0][0])(jnp.ones((4, 4)))
    np.testing.assert_allclose(out, fn(jnp.ones((4, 4))), rtol=1e-2)
    assert "suspended" in events
    assert ("loop", 3) in events and ("body", ((),)) in events
