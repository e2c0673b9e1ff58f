"""No import cycle among the modules of kvmem/, nor among those of the sglang adapter
(kvmem_sglang), typing-only ones included; kvmem never imports the adapter.

Each module of the package (a package's ``__init__`` is a module of its own) is read with
``ast``, not imported, and every import of another kvmem module counts: at the top,
inside a function, and under ``if TYPE_CHECKING:`` alike (not under ``if __name__ ==
"__main__":``, which runs as another module).  ``from kvmem.x import y`` is
an import of module ``kvmem.x.y`` when that is a module, else of ``kvmem.x``; relative
imports are resolved against the importing module's package.  The test fails naming
each cycle of the graph it finds.

No module of either over 500 lines.

And what an sglang process pays for the adapter at start: its modules (those that do not
import sglang at the top) load neither side of kvmem's PD nor a transfer engine.  And no
module of the adapter uses a private name (a leading underscore) of another one.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

import kvmem

ROOTS = {
    "kvmem": Path(kvmem.__file__).resolve().parent,
    "kvmem_sglang": Path(__file__).resolve().parents[1] / "integration/sglang/kvmem_sglang",
}

# cycles kept on purpose, each as its modules in cycle order from the smallest name, with
# one line saying why it cannot go
KNOWN: dict[tuple[str, ...], str] = {}


def modules(package: str = "kvmem") -> dict[str, Path]:
    """Every module of ``package``: dotted name -> its file."""
    root = ROOTS[package]
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imports_of(name: str, path: Path, known: dict[str, Path], pkg: str = "kvmem") -> set[str]:
    """The modules of ``pkg`` that module ``name`` (file ``path``) imports, anywhere
    in it."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in _walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                out.add(_owner(alias.name, known))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                out.add(sub if sub in known else _owner(target, known))
    out.discard("")
    out.discard(name)
    return {m for m in out if m == pkg or m.startswith(pkg + ".")}


def _walk(tree: ast.AST):
    """``ast.walk`` without the body of ``if __name__ == "__main__":``: what it imports is
    imported by the module run as a script, which is ``__main__``, another module."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        if isinstance(node, ast.If) and ast.unparse(node.test) in (
            "__name__ == '__main__'",
            "'__main__' == __name__",
        ):
            todo.extend(node.orelse)
            continue
        todo.extend(ast.iter_child_nodes(node))


def _owner(dotted: str, known: dict[str, Path]) -> str:
    """The module ``dotted`` names, or the nearest package above it that is one."""
    while dotted and dotted not in known:
        dotted = dotted.rpartition(".")[0]
    return dotted


def graph(package: str = "kvmem") -> dict[str, set[str]]:
    known = modules(package)
    return {name: imports_of(name, path, known, package) for name, path in known.items()}


def cycles(edges: dict[str, set[str]]) -> list[tuple[str, ...]]:
    """One cycle through each strongly connected component of more than one module
    (Tarjan's algorithm, then a shortest way back to the component's smallest module)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    comps: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(comp)

    for v in sorted(edges):
        if v not in index:
            visit(v)
    found = []
    for comp in comps:
        start = min(comp)
        # breadth first from start's successors back to start, inside the component
        prev: dict[str, str] = {}
        todo = [start]
        while todo and start not in prev:
            nxt = []
            for v in todo:
                for w in sorted(edges[v] & comp):
                    if w not in prev:
                        prev[w] = v
                        nxt.append(w)
            todo = nxt
        path = [start]
        v = prev[start]
        while v != start:
            path.append(v)
            v = prev[v]
        found.append((start, *reversed(path[1:])))
    return sorted(found)


def test_the_graph_sees_every_kind_of_import():
    g = graph()
    assert "kvmem.disagg.prefill" in g["kvmem.disagg"]  # a package's __init__ imports
    assert "kvmem.disagg.states" in g["kvmem.disagg.prefill"]  # from kvmem.x import y


def test_a_script_block_is_not_an_import_of_the_module():
    tree = ast.parse("import a\nif __name__ == '__main__':\n    import b\nelse:\n    import c\n")
    names = {n.names[0].name for n in _walk(tree) if isinstance(n, ast.Import)}
    assert names == {"a", "c"}


def test_the_cycle_finder_names_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [("a", "b", "c")]
    assert cycles({"a": {"b"}, "b": set()}) == []


@pytest.mark.parametrize("package", sorted(ROOTS))
def test_no_import_cycle(package):
    found = [c for c in cycles(graph(package)) if c not in KNOWN]
    assert not found, "import cycles (each from its smallest module): " + "; ".join(
        " -> ".join((*c, c[0])) for c in found
    )


# A module of the library or the adapter is read whole by whoever changes it: one job, and
# at most this many lines.
MAX_LINES = 500


@pytest.mark.parametrize("package", sorted(ROOTS))
def test_no_module_over_the_line_limit(package):
    long = {
        name: n
        for name, path in modules(package).items()
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"modules over {MAX_LINES} lines (split them by job): {long}"


def test_kvmem_never_imports_the_adapter():
    known = modules()
    for name, path in known.items():
        assert not imports_of(name, path, modules("kvmem_sglang"), "kvmem_sglang"), name


# kvmem's PD sides and transfer engines: what the adapter's modules must not load when
# sglang imports them (the adapter needs kvmem.disagg.outcome and kvmem.transfer.runs;
# the packages' __init__s import the rest only when a name of theirs is asked for)
HEAVY = (
    "kvmem.disagg.prefill",
    "kvmem.disagg.decode",
    "kvmem.transfer.nixl",
    "kvmem.transfer.engine",
)


def _imports_sglang_at_top(path: Path) -> bool:
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, ast.Import) and any(
            a.name.split(".")[0] == "sglang" for a in node.names
        ):
            return True
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "sglang":
            return True
    return False


def _loaded_after(names: list[str]) -> set[str]:
    """The modules of HEAVY that a fresh interpreter has loaded after importing ``names``."""
    code = "import sys\n" + "".join(f"import {n}\n" for n in names)
    code += f"print(' '.join(m for m in {HEAVY!r} if m in sys.modules))"
    path = os.pathsep.join(str(r.parent) for r in ROOTS.values())
    env = {**os.environ, "PYTHONPATH": path + os.pathsep + os.environ.get("PYTHONPATH", "")}
    p = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert p.returncode == 0, p.stderr
    return set(p.stdout.split())


@pytest.mark.subprocess
def test_the_adapter_loads_no_pd_side_nor_engine():
    adapter = [n for n, path in modules("kvmem_sglang").items() if not _imports_sglang_at_top(path)]
    assert {"kvmem_sglang.reasons", "kvmem_sglang.transfer", "kvmem_sglang.prefill"} <= set(adapter)
    assert _loaded_after(["kvmem.disagg.outcome", "kvmem.transfer.runs", *adapter]) == set()


@pytest.mark.subprocess
def test_the_packages_still_give_every_name():
    """``from kvmem.disagg import PrefillSide`` etc. still work, each name the one its module
    defines, and loads what it needs."""
    import kvmem.disagg
    import kvmem.transfer

    for pkg in (kvmem.disagg, kvmem.transfer):
        for name in pkg.__all__:
            value = getattr(pkg, name)
            assert getattr(sys.modules[pkg._HOME[name]], name) is value, name
        assert set(pkg.__all__) == set(pkg._HOME)
        assert set(pkg.__all__) <= set(dir(pkg))
        with pytest.raises(AttributeError):
            pkg.NotAName  # noqa: B018
    assert _loaded_after(["kvmem.disagg"]) == set()
    assert _loaded_after(["kvmem.transfer"]) == set()


def private_uses(package: str = "kvmem_sglang") -> list[str]:
    """Each use, in a module of ``package``, of another module's private name (a leading
    underscore): ``from kvmem_sglang.x import _y``, or ``x._y`` on a module imported as
    ``x``.  A name another module uses is part of its module's interface."""
    known = modules(package)
    found = []
    for name, path in known.items():
        tree = ast.parse(path.read_text(), str(path))
        aliases: dict[str, str] = {}  # local name -> the module of the package it is
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "") in known:
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    if sub in known:
                        aliases[alias.asname or alias.name] = sub
                    elif alias.name.startswith("_") and node.module != name:
                        found.append(f"{name}: from {node.module} import {alias.name}")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in known and alias.asname:
                        aliases[alias.asname] = alias.name
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
            ):
                owner = aliases.get(ast.unparse(node.value), ast.unparse(node.value))
                if owner in known and owner != name:
                    found.append(f"{name}: {owner}.{node.attr}")
    return found


def test_the_private_use_finder_sees_both_kinds(tmp_path, monkeypatch):
    pkg = tmp_path / "kvmem_sglang"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("_x = 1\n_y = 2\n")
    (pkg / "b.py").write_text(
        "from kvmem_sglang import a\nfrom kvmem_sglang.a import _x\nprint(a._y, a.__name__)\n"
    )
    monkeypatch.setitem(ROOTS, "kvmem_sglang", pkg)
    assert private_uses() == [
        "kvmem_sglang.b: from kvmem_sglang.a import _x",
        "kvmem_sglang.b: kvmem_sglang.a._y",
    ]


def test_no_adapter_module_uses_another_ones_private_name():
    found = private_uses()
    assert not found, "private names used by another module: " + "; ".join(found)


def test_no_docstring_or_comment_cites_an_issue_number():
    """What the code does is said in its own words: an issue's number means nothing to a
    reader of the repository (kvmem, the adapter, the test kit, the benchmarks, the tests)."""
    import re

    root = Path(__file__).resolve().parents[1]
    cite = re.compile(r"\b[Ii]ssue \d+\b(?!-)|\(issue\b")  # not "issue 16-byte loads"
    found = []
    for top in ("kvmem", "integration/sglang/kvmem_sglang", "testkit", "bench", "tests"):
        for path in sorted((root / top).rglob("*.py")):
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if cite.search(line) and "cite.search" not in line and "re.compile" not in line:
                    found.append(f"{path.relative_to(root)}:{n}: {line.strip()}")
    assert not found, "\n".join(found)
