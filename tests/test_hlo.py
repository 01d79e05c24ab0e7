"""One HLO reader: ``jaxscale/_hlo.py`` (and ``_hlo_collectives.py``, which
builds on it) reads XLA's HLO and StableHLO text; no other module of the package
or of ``benchmarks/`` keeps a regular expression over it, string-matches its
syntax or keeps a table of bytes per element type. And the reader's own
helpers, on small modules written out."""

import ast
import pathlib
import re

import pytest

from jaxscale import _hlo

pytestmark = pytest.mark.unit

ROOT = pathlib.Path(__file__).resolve().parents[1]
READERS = ("jaxscale/_hlo.py", "jaxscale/_hlo_collectives.py")

# HLO and StableHLO element types (a byte table is keyed by them).
DTYPES = frozenset(_hlo.DTYPE_BYTES) | {
    "i1", "i8", "i16", "i32", "i64", "ui8", "ui16", "ui32", "ui64",
    "f8E4M3FN", "f8E5M2", "f8E4M3", "f8E4M3FNUZ", "f8E5M2FNUZ", "f8E3M4",
}  # fmt: skip
# Text that only HLO or StableHLO syntax has: in a regular expression, or in a
# string a module looks for in text (``"kind=kCustom" in line``).
SYNTAX = (
    "stablehlo", "tensor<", "custom-call", "custom_call", "fusion(", "kind=k",
    '"kind":', "to_apply", "calls=", "branch_computations", "replica_groups",
    "true_computation", "__cublas", "__cudnn", "__triton", "op_name=",
    "convert(", "convert\\(", "ENTRY", "ROOT ",
)  # fmt: skip
# The str methods that look for a string in text.
_SEARCHES = {"count", "find", "rfind", "index", "rindex", "split", "rsplit",
             "partition", "rpartition", "replace"}  # fmt: skip
# A regular expression's shape or operand syntax: `f32\[`, `\w+)\[([\d,]*)\]`,
# `%([\w.\-]+)`, an alternation of element types, an HLO opcode before `\(`.
_REGEX_SYNTAX = re.compile(
    r"\\\[\(?\[(\\d|0-9),|(^|[^\w])(" + "|".join(sorted(DTYPES, key=len)[::-1]) + r")"
    r"(\\\[|\|)|%\(?\[|(all-reduce|all-gather|all-to-all|reduce-scatter|"
    r"collective-permute|fusion|convert|custom-call|parameter)"
)
_RE_FUNCTIONS = {"compile", "search", "match", "fullmatch", "findall", "finditer",
                 "sub", "subn", "split"}  # fmt: skip


def _text(node: ast.AST) -> str | None:
    """A string literal's text (an f-string's literal parts), else None."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(_text(v) or "" for v in node.values)
    if isinstance(node, ast.BinOp):  # "a" + "b"
        parts = [_text(node.left), _text(node.right)]
        return "".join(p or "" for p in parts)
    return None


def hlo_readings(source: str) -> list[str]:
    """Where ``source`` reads HLO text on its own, as ``"line N: what"``:

    * a regular expression (a call of ``re.compile``, ``re.search``, ... whose
      pattern is a literal, an f-string or a sum of them) with HLO syntax: a
      shape (``f32\\[``, ``\\[([\\d,]*)\\]``), an alternation of element types, an
      operand (``%(``), an opcode, or any text of :data:`SYNTAX`;
    * a string literal with text of :data:`SYNTAX` looked for in text: the
      left operand of ``in`` or ``not in``, or the argument of a search
      (``.count``, ``.find``, ``.split``...: :data:`_SEARCHES`);
    * a table of bytes per element type: a dict (literal or ``dict(...)``)
      with two or more element types as keys and int values.
    """
    tree = ast.parse(source)
    found = []
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "re"
            and node.func.attr in _RE_FUNCTIONS
            and node.args
        ):
            pattern = _text(node.args[0])
            if pattern and (
                _REGEX_SYNTAX.search(pattern) or any(s in pattern for s in SYNTAX)
            ):
                found.append(f"line {line}: an HLO regex {pattern!r}")
        looked_for = []
        if isinstance(node, ast.Compare) and isinstance(
            node.ops[0], ast.In | ast.NotIn
        ):
            looked_for = [node.left]
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in _SEARCHES
        ):
            looked_for = node.args[:1]
        for arg in looked_for:
            text = _text(arg)
            if text and any(s in text for s in SYNTAX):
                found.append(f"line {line}: looks for HLO syntax {text!r}")
        if isinstance(node, ast.Dict):
            pairs = [
                (_text(k), v) for k, v in zip(node.keys, node.values, strict=True) if k
            ]
        elif isinstance(node, ast.Call) and getattr(node.func, "id", "") == "dict":
            pairs = [(k.arg, k.value) for k in node.keywords]
        else:
            continue
        typed = [
            k
            for k, v in pairs
            if k in DTYPES and isinstance(v, ast.Constant) and type(v.value) is int
        ]
        if len(typed) >= 2:
            found.append(f"line {line}: a dtype-byte table {typed}")
    return sorted(set(found), key=lambda s: int(s.split(":")[0].split()[1]))


def _modules() -> list[str]:
    paths = [*ROOT.glob("jaxscale/**/*.py"), *ROOT.glob("benchmarks/*.py")]
    return sorted(p.relative_to(ROOT).as_posix() for p in paths)


PLANTED = {
    "shape regex": 'import re\n_S = re.compile(r"\\b(f32|bf16|f16)\\[([0-9,]*)\\]")\n',
    "dims regex": 'import re\ndims = re.findall(r"\\[([\\d,]*)\\]", t)\n',
    "operand regex": 'import re\nargs = re.findall(r"%([\\w.\\-]+)", rest)\n',
    "opcode regex": 'import re\nm = re.search(rf"= (\\S+) {k}all-reduce\\(", l)\n',
    "stablehlo regex": 'import re\nre.findall(r"stablehlo.dot_general.*", t)\n',
    "byte table": 'ITEMSIZE = {"f32": 4, "f16": 2, "bf16": 2}\n',
    "byte table by dict()": "B = dict(f32=4, s8=1)\n",
    "counted target": 'n = hlo.count("__cudnn$fmha")\n',
    "matched attribute": 'ok = "kind=kCustom" in line\n',
    "split on syntax": 'args = rhs.split("calls=")[1]\n',
}
CLEAN = (
    'import re\nn = re.compile(r"\\d+")\n',  # not HLO
    'NAMES = {"f16": "float16 pmean", "bf16": "bfloat16"}\n',  # not bytes
    'def f():\n    """Reads custom_call_target="x" and f32[4]."""\n',  # a docstring
    'ok = i.opcode == "custom-call" and target.startswith("__cudnn")\n',  # parsed
    "import re\nre.search(pattern, where)\n",  # a pattern the caller passes
)


@pytest.mark.parametrize("name", sorted(PLANTED))
def test_the_check_catches_a_planted_reader(name):
    assert hlo_readings(PLANTED[name]), name


@pytest.mark.parametrize("source", CLEAN)
def test_the_check_leaves_other_text_alone(source):
    assert hlo_readings(source) == []


def test_the_check_catches_the_readers_themselves():
    """Not vacuous on real code: the reader modules, unexempted, are caught."""
    for path in READERS:
        found = hlo_readings((ROOT / path).read_text())
        assert len(found) >= 3, (path, found)
    assert any("dtype-byte table" in f for f in hlo_readings(
        (ROOT / READERS[0]).read_text()
    ))  # fmt: skip


def test_only_the_hlo_readers_read_hlo():
    modules = _modules()
    assert set(READERS) <= set(modules)
    assert {"benchmarks/overhead.py", "jaxscale/float8/_check.py"} <= set(modules)
    found = {
        path: hlo_readings((ROOT / path).read_text())
        for path in modules
        if path not in READERS
    }
    assert not {p: f for p, f in found.items() if f}, found


# --------------------------------------------------------------------------- #
# The reader's helpers
# --------------------------------------------------------------------------- #

MODULE = """HloModule m, entry_computation_layout={(f32[4]{0})->f32[4]{0}}

%fused (p: f32[4]) -> bf16[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %c = bf16[4]{0} convert(%p)
}

ENTRY %main (a: f32[4]) -> f32[4] {
  %a = f32[4]{0} parameter(0)
  %f = bf16[4]{0} fusion(%a), kind=kCustom, calls=%fused, backend_config={"fusion_backend_config":{"kind":"__triton_gemm"}}
  %cc = (f32[4]{0}, s8[64]{0}) custom-call(%f), custom_call_target="__cublas$gemm"
  ROOT %t = f32[4]{0} get-tuple-element(%cc), index=0
}
"""  # noqa: E501


def test_instructions_of_every_computation_in_text_order():
    found = _hlo.instructions(MODULE)
    assert [(i.computation, i.name, i.opcode) for i in found] == [
        ("fused", "p", "parameter"),
        ("fused", "c", "convert"),
        ("main", "a", "parameter"),
        ("main", "f", "fusion"),
        ("main", "cc", "custom-call"),
        ("main", "t", "get-tuple-element"),
    ]
    f, cc = found[3], found[4]
    assert f.type == "bf16[4]{0}" and f.operands == ("a",)
    assert _hlo.strip_layouts(cc.type) == "(f32[4], s8[64])"
    assert _hlo.attribute(f.attrs, "kind") == "kCustom"
    assert _hlo.attribute(f.attrs, "calls") == "fused"
    assert _hlo.attribute(f.attrs, "index") == ""
    assert _hlo.backend_kind(f.attrs) == "__triton_gemm"
    assert _hlo.attribute(cc.attrs, "custom_call_target") == "__cublas$gemm"
    assert _hlo.attribute(found[5].attrs, "index") == "0"
    assert _hlo.called(f.attrs) == ["fused"]
    assert _hlo.called("condition=%c, body=%b, branch_computations={%x, %y}") == [
        "c", "b", "x", "y"
    ]  # fmt: skip


def test_kernels_carry_their_opcode():
    ks = _hlo.kernels(MODULE)
    assert [(k.opcode, k.kind) for k in ks] == [
        ("fusion", "fusion:kCustom"),
        ("custom-call", "custom-call:__cublas$gemm"),
    ]
    assert ks[1].writes == 16  # the result, not the workspace


LOWERED = """
    %0 = stablehlo.convert %arg0 : (tensor<32x16xf32>) -> tensor<32x16xf8E4M3FN>
    %1 = stablehlo.dot_general %0, %arg1, batching_dims = [0] x [0], contracting_dims = [2] x [1] : (tensor<2x32x16xf8E4M3FN>, tensor<2x16x8xbf16>) -> tensor<2x32x8xf32>
    %2 = stablehlo.dot_general %0, %arg2, contracting_dims = [1] x [0], algorithm = <lhs_precision_type = f16, rhs_precision_type = f16, accumulation_type = f32, lhs_component_count = 1, rhs_component_count = 1, num_primitive_operations = 1, allow_imprecise_accumulation = false> : (tensor<32x16xf16>, tensor<16x?xf16>) -> tensor<32x?xf32>
    %3 = "stablehlo.case"(%i) ({
"""  # noqa: E501


def test_stablehlo_dots_converts_and_ops():
    batched, plain = _hlo.stablehlo_dots(LOWERED)
    assert batched.operands == (("f8E4M3FN", (2, 32, 16)), ("bf16", (2, 16, 8)))
    assert batched.result == ("f32", (2, 32, 8))
    assert batched.batching == ((0,), (0,)) and batched.contracting == ((2,), (1,))
    assert plain.batching is None and plain.contracting == ((1,), (0,))
    assert plain.operands[1] == ("f16", (16, -1))
    assert "lhs_precision_type = f16" in plain.attrs
    assert _hlo.stablehlo_converts(LOWERED) == {"f8E4M3FN": 1}
    assert _hlo.stablehlo_ops(LOWERED) == [
        "convert", "dot_general", "dot_general", "case"
    ]  # fmt: skip
