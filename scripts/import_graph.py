"""The import structure of the checkout: which of this project's modules import which, checked.

    python3 scripts/import_graph.py            # the checks, a line per package; exit 1 on any violation
    python3 scripts/import_graph.py --edges    # also every edge, module -> module

Read from the source (``ast``), nothing is imported.  Checked:

* the packages import downward only: ``kvbuffer_ref`` (the oracle) imports nothing of this project but
  itself; ``kvbuffer_fast`` (the kernels) imports ``kvbuffer_ref`` and itself; ``kvbuffer`` (the tool)
  imports both and itself, never ``bench``; ``bench`` may import all three;
* no import circle among the modules, counting imports inside functions as well (an import moved into a
  function still closes a circle);
* the imports inside functions that reach this project's modules are listed, so each can be read for its
  reason (an optional dependency behind it, or the Triton interpreter that must be chosen first).
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kvbuffer_ref", "kvbuffer_fast", "kvbuffer", "bench")
#: what each package may import (besides itself)
ALLOWED = {"kvbuffer_ref": set(), "kvbuffer_fast": {"kvbuffer_ref"}, "kvbuffer": {"kvbuffer_ref", "kvbuffer_fast"},
           "bench": {"kvbuffer_ref", "kvbuffer_fast", "kvbuffer"}}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for p in sorted((ROOT / pkg).rglob("*.py")):
            out[module_name(p)] = p
    return out


def _targets(node, mod: str, is_pkg: bool, known: set) -> list[str]:
    """The project modules an import statement loads (the longest known prefix of each name)."""
    if isinstance(node, ast.ImportFrom):
        if node.level:
            base = mod.split(".") if is_pkg else mod.split(".")[:-1]
            base = base[: len(base) - (node.level - 1)]
            root = ".".join(base + ([node.module] if node.module else []))
        else:
            root = node.module or ""
        names = [f"{root}.{a.name}" for a in node.names] + [root]
    else:
        names = [a.name for a in node.names]
    out = []
    for n in names:
        parts = n.split(".")
        for i in range(len(parts), 0, -1):
            cand = ".".join(parts[:i])
            if cand in known:
                out.append(cand)
                break
    return sorted(set(out))


def edges(mods: dict[str, Path]) -> tuple[dict, dict]:
    """(module-level edges, edges from inside functions): {module: {imported module}}."""
    known = set(mods)
    top, inner = defaultdict(set), defaultdict(set)
    for mod, path in mods.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        in_func = set()
        for f in ast.walk(tree):
            if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)):
                in_func.update(id(n) for n in ast.walk(f) if isinstance(n, (ast.Import, ast.ImportFrom)))
        for n in ast.walk(tree):
            if isinstance(n, (ast.Import, ast.ImportFrom)):
                for t in _targets(n, mod, path.name == "__init__.py", known):
                    if t != mod and not mod.startswith(t + "."):  # a package's own __init__ is not a circle
                        (inner if id(n) in in_func else top)[mod].add(t)
    return top, inner


def cycles(graph: dict) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--edges", action="store_true", help="print every edge")
    args = ap.parse_args(argv)
    mods = modules()
    top, inner = edges(mods)
    both = {m: top.get(m, set()) | inner.get(m, set()) for m in mods}
    bad = []
    for m, ts in sorted(both.items()):
        pkg = m.split(".")[0]
        for t in sorted(ts):
            tp = t.split(".")[0]
            if tp != pkg and tp not in ALLOWED[pkg]:
                bad.append(f"upward import: {m} -> {t} ({pkg} may import {sorted(ALLOWED[pkg]) or 'nothing else'})")
    circles = cycles(both)
    bad += [f"import circle: {' <-> '.join(c)}" for c in circles]
    for pkg in PACKAGES:
        ms = [m for m in mods if m.split(".")[0] == pkg]
        deps = sorted({t.split(".")[0] for m in ms for t in both[m]} - {pkg})
        n_inner = sum(len(inner.get(m, ())) for m in ms)
        print(f"{pkg:14s} {len(ms):3d} modules; imports {', '.join(deps) or 'only itself'}; "
              f"{n_inner} project imports inside functions")
    print("imports inside functions (each has a reason: an optional dependency, or triton not imported before "
          "the interpreter is chosen):")
    for m in sorted(inner):
        print(f"  {m} -> {', '.join(sorted(inner[m]))}")
    if args.edges:
        for m in sorted(top):
            print(f"{m} -> {', '.join(sorted(top[m]))}")
    for b in bad:
        print(b)
    print("OK: no upward import, no circle" if not bad else f"{len(bad)} violation(s)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
