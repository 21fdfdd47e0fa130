"""The layout's rules, read from the source: the three packages import downward only, no module circle, and no
kernel of one kvbuffer_fast module is launched from another module's code."""

import ast
import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _import_graph():
    spec = importlib.util.spec_from_file_location("import_graph", ROOT / "scripts" / "import_graph.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_packages_import_downward_and_no_module_circle(capsys):
    assert _import_graph().main([]) == 0, capsys.readouterr().out


def test_the_checker_sees_a_circle_and_an_upward_import():
    ig = _import_graph()
    assert ig.cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    top, inner = ig.edges(ig.modules())
    assert "kvbuffer_ref.recurrent" in top["kvbuffer_ref.pool"]  # edges are read, not assumed
    assert all(t.split(".")[0] == "kvbuffer_ref" for m in top if m.startswith("kvbuffer_ref") for t in top[m])


def test_no_kernel_is_launched_outside_its_module():
    """A Triton kernel (``@triton.jit`` def named ``*_kernel``) is launched (``name[grid](...)``) only in the
    module that defines it."""
    defined = {}
    for p in sorted((ROOT / "kvbuffer_fast").glob("*.py")):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name.endswith("_kernel"):
                defined[node.name] = p.name
    assert len(defined) > 10
    offenders = []
    for p in sorted((ROOT / "kvbuffer_fast").glob("*.py")):
        for name in re.findall(r"\b(\w+_kernel)\[", p.read_text()):
            if defined.get(name, p.name) != p.name:
                offenders.append(f"{p.name} launches {name} of {defined[name]}")
    assert not offenders, offenders
