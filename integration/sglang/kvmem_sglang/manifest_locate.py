"""The machinery of :mod:`kvmem_sglang.manifest`, over its lists.

:func:`locate` finds a target in an sglang source tree without importing it (the
class and function definitions, ``self.NAME =`` for an instance attribute, a class's
bases through the module's imports), and gives its signature, a digest of its code
(``ast.dump``: blind to comments, formatting and line moves) and its ``file:line``.
:data:`kvmem_sglang.manifest_recorded.RECORDED` holds those of sglang 0.5.23, the
version the adapter pins: :func:`record` finds them again (``python -m kvmem_sglang.manifest
record`` writes them), :func:`drift` compares another sglang's tree with them, and
:func:`table` makes the adapter README's tables; :func:`main` is the command line of
``python -m kvmem_sglang.manifest``.

Imports nothing of sglang, and of the adapter's other modules only
:mod:`kvmem_sglang.manifest` (its lists), :mod:`kvmem_sglang.state` (standard library only)
for :func:`table` and :mod:`kvmem_sglang.manifest_recorded` for :func:`drift`.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path

from kvmem_sglang.manifest import HOOKS, PRIVATE, surface


@dataclass(frozen=True)
class Found:
    """Where :func:`locate` found a target: ``file:line`` (relative to the tree's root),
    its signature (a function's parameters; ``attribute`` for an instance attribute;
    ``class``) and a digest of its code."""

    where: str
    signature: str
    digest: str


def sglang_root() -> Path:
    """The directory that holds the installed ``sglang`` package (not imported)."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("sglang is not installed here")
    return Path(list(spec.submodule_search_locations)[0]).parent


class _Tree:
    """Module files of one source tree, parsed once each."""

    def __init__(self, root: Path):
        self.root = root
        self._files: dict[str, Path | None] = {}
        self._parsed: dict[str, ast.Module] = {}

    def path(self, name: str) -> Path | None:
        """The file of module ``name`` here, or None."""
        if name not in self._files:
            base = self.root.joinpath(*name.split("."))
            self._files[name] = next(
                (p for p in (base.with_suffix(".py"), base / "__init__.py") if p.is_file()), None
            )
        return self._files[name]

    def module(self, name: str) -> ast.Module:
        """Module ``name``, parsed; LookupError when it has no file here."""
        if name not in self._parsed:
            path = self.path(name)
            if path is None:
                raise LookupError(f"no module {name} in {self.root}")
            self._parsed[name] = ast.parse(path.read_text())
        return self._parsed[name]

    def split(self, target: str) -> tuple[str, list[str]]:
        """(the longest module prefix of ``target`` with a file here, the names after)."""
        parts = target.split(".")
        for i in range(len(parts), 0, -1):
            if self.path(".".join(parts[:i])) is not None:
                return ".".join(parts[:i]), parts[i:]
        raise LookupError(f"{target}: no module of it in {self.root}")


def _defined(body, name: str):
    for node in body:
        if (
            isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and node.name == name
        ):
            return node
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == name for t in node.targets
        ):
            return node
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and node.target.id == name
        ):
            return node
    return None


def _self_assigns(cls: ast.ClassDef, name: str) -> list:
    out = []
    for node in ast.walk(cls):
        targets = (
            node.targets
            if isinstance(node, ast.Assign)
            else [node.target]
            if isinstance(node, (ast.AnnAssign, ast.AugAssign))
            else []
        )
        if any(
            isinstance(t, ast.Attribute)
            and t.attr == name
            and isinstance(t.value, ast.Name)
            and t.value.id == "self"
            for t in targets
        ):
            out.append(node)
    return out


def _imported(tree: _Tree, module: str, mod: ast.Module, name: str) -> str | None:
    """The dotted path ``name`` of ``module`` was imported from, if it was."""
    for node in mod.body:
        if isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                if (alias.asname or alias.name) == name:
                    base = node.module
                    if node.level:
                        base = ".".join(module.split(".")[: -node.level] + [node.module])
                    return f"{base}.{alias.name}"
    return None


def _in_class(
    tree: _Tree, module: str, cls: ast.ClassDef, name: str, attribute: bool, seen: int = 0
):
    """(module, node) of ``name`` in ``cls`` or, failing that, in its bases."""
    node = None if attribute else _defined(cls.body, name)
    if attribute:
        found = _self_assigns(cls, name)
        node = found[0] if found else None
    if node is not None or seen > 16:
        return (module, node) if node is not None else None
    mod = tree.module(module)
    for base in cls.bases:
        if not isinstance(base, ast.Name):
            continue
        local = _defined(mod.body, base.id)
        where = (module, local) if isinstance(local, ast.ClassDef) else None
        if where is None:
            path = _imported(tree, module, mod, base.id)
            if path is None:
                continue
            try:
                bmod, rest = tree.split(path)
            except LookupError:
                continue
            bnode = _defined(tree.module(bmod).body, rest[0]) if len(rest) == 1 else None
            if not isinstance(bnode, ast.ClassDef):
                continue
            where = (bmod, bnode)
        hit = _in_class(tree, where[0], where[1], name, attribute, seen + 1)
        if hit is not None:
            return hit
    return None


def locate(
    target: str, what: str = "method", root: Path | None = None, tree: _Tree | None = None
) -> Found:
    """Find ``target`` in the sglang tree under ``root`` (default: the installed one);
    ``what`` is ``attribute`` for an instance attribute.  LookupError naming what is
    missing."""
    tree = tree or _Tree(root or sglang_root())
    module, names = tree.split(target)
    mod = tree.module(module)
    scope, node = mod, None
    for i, name in enumerate(names):
        last = i == len(names) - 1
        if isinstance(scope, ast.ClassDef):
            hit = _in_class(tree, module, scope, name, attribute=last and what == "attribute")
            if hit is None:
                raise LookupError(f"{target}: {name} is not in class {scope.name}")
            module, node = hit
        else:
            node = _defined(scope.body, name)
            if node is None:
                raise LookupError(f"{target}: {name} is not in {module}")
        scope = node
    path = tree.path(module)
    assert path is not None and node is not None  # tree.split found the file, names a node
    path = path.relative_to(tree.root)
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        signature = f"({ast.unparse(node.args)})"
    elif isinstance(node, ast.ClassDef):
        signature = "class"
    else:
        signature = "attribute"
    digest = hashlib.sha256(ast.dump(node).encode()).hexdigest()[:16]
    return Found(f"{path}:{node.lineno}", signature, digest)


def record(root: Path | None = None) -> dict[str, tuple[str, str, str]]:
    """``{target: (file:line, signature, digest)}`` of every target in the tree."""
    tree = _Tree(root or sglang_root())
    out = {}
    for target, what in surface().items():
        f = locate(target, what, tree=tree)
        out[target] = (f.where, f.signature, f.digest)
    return out


def drift(root: Path, recorded: dict | None = None) -> list[dict]:
    """Each target of the surface in the tree under ``root`` against ``recorded``
    (default: sglang 0.5.23's): ``status`` is ``same``, ``moved`` (only its line),
    ``body`` (its code changed), ``signature`` (its parameters changed) or
    ``missing``."""
    if recorded is None:
        from kvmem_sglang.manifest_recorded import RECORDED

        recorded = RECORDED
    tree = _Tree(root)
    rows = []
    for target, what in surface().items():
        was = recorded.get(target)
        try:
            f = locate(target, what, tree=tree)
        except LookupError as e:
            rows.append(dict(target=target, status="missing", was=was and was[0], why=str(e)))
            continue
        if was is None:
            status = "new"
        elif f.signature != was[1]:
            status = "signature"
        elif f.digest != was[2]:
            status = "body"
        else:
            status = "same" if f.where == was[0] else "moved"
        rows.append(dict(target=target, status=status, was=was and was[0], now=f.where))
    return rows


def table() -> str:
    """The adapter README's table of hooks (Markdown)."""
    lines = ["| sglang target | kind | adapter | when | what it does |", "|---|---|---|---|---|"]
    for h in HOOKS:
        short = ".".join(h.target.split(".")[-2:])
        lines.append(f"| `{short}` | {h.kind} | `{h.hook}` | {h.when or 'always'} | {h.does} |")
    lines += [
        "",
        "Private sglang names used other than through a hook:",
        "",
        "| sglang name | what | use | adapter |",
        "|---|---|---|---|",
    ]
    for p in PRIVATE:
        short = ".".join(p.target.split(".")[-2:])
        lines.append(f"| `{short}` | {p.what} | {p.use} | {p.where} |")
    from kvmem_sglang.state import TABLES

    lines += [
        "",
        "What the adapter keeps about sglang's objects, beside them (side tables "
        "of `kvmem_sglang.state`; no attribute is set on an sglang object):",
        "",
        "| about | table | adapter | holds |",
        "|---|---|---|---|",
    ]
    for name, t in TABLES.items():
        lines.append(f"| {t.owner} | `{name}` | {t.users} | {t.holds} |")
    return "\n".join(lines)


def _write_recorded(path: Path, rec: dict, version: str) -> None:
    body = "\n".join(f"    {t!r}: {v!r}," for t, v in sorted(rec.items()))
    path.write_text(
        f'"""What ``python -m kvmem_sglang.manifest record`` found in sglang {version}: '
        "for each\ntarget of the manifest, (file:line, signature, digest).  Generated; "
        'do not edit."""\n\n'
        f"VERSION = {version!r}\n\nRECORDED = {{\n{body}\n}}\n"
    )


def main(argv: list[str]) -> int:
    if argv[:1] == ["record"]:
        import importlib.metadata

        path = Path(__file__).with_name("manifest_recorded.py")
        _write_recorded(path, record(), importlib.metadata.version("sglang"))
        print(f"wrote {path}")
        return 0
    if argv[:1] == ["drift"] and len(argv) == 2:
        rows = drift(Path(argv[1]))
        counts: dict[str, int] = {}
        for r in rows:
            counts[r["status"]] = counts.get(r["status"], 0) + 1
        print(", ".join(f"{n} {s}" for s, n in sorted(counts.items())))
        for r in rows:
            if r["status"] != "same":
                print(
                    f"{r['status']:<9} {r['target']}  {r.get('was')} -> "
                    f"{r.get('now') or r.get('why')}"
                )
        return 0
    if argv[:1] == ["table"]:
        print(table())
        return 0
    print(
        "usage: python -m kvmem_sglang.manifest record | drift SITE_PACKAGES | table",
        file=sys.stderr,
    )
    return 2
