"""What the adapter keeps (kvmem_sglang/state.py): about sglang's objects, side tables
keyed by identity that never keep an object alive, and no attribute of the adapter's on
any sglang object; for the process, the one registry ``state.PROCESS``, and no mutable
module global but the registries ``state.REGISTRIES`` lists (both read from the
adapter's source)."""

from __future__ import annotations

import ast
import gc
import threading
from pathlib import Path

import pytest

from kvmem_sglang import state
from kvmem_sglang.state import SideTable

ADAPTER = Path(state.__file__).resolve().parent


class Unhashable:
    """Like an sglang object with ``__eq__`` and no ``__hash__``."""

    def __eq__(self, other):
        return True

    __hash__ = None  # type: ignore[assignment]


def test_values_are_kept_by_identity_even_for_unhashable_objects():
    t: SideTable[int] = SideTable("X", "test", "a number")
    a, b = Unhashable(), Unhashable()
    assert a == b
    t.set(a, 1)
    assert t.get(a) == 1 and t.get(b) is None and a in t and b not in t
    assert t.get(b, 7) == 7
    t.set(b, 2)
    assert (t.get(a), t.get(b), len(t)) == (1, 2, 2)
    assert t.pop(a) == 1 and t.pop(a, "gone") == "gone" and len(t) == 1
    assert t.objects() == [b]


def test_an_entry_goes_with_its_object_and_never_passes_to_a_new_one():
    t: SideTable[str] = SideTable("X", "test", "a word")
    held = []
    for i in range(200):
        o = Unhashable()
        t.set(o, f"v{i}")
        if i % 2:
            held.append(o)
        del o
    gc.collect()
    assert len(t) == 100 and len(t.objects()) == 100
    assert [t.get(o) for o in held] == [f"v{i}" for i in range(1, 200, 2)]
    # objects made now reuse the ids of collected ones: none sees an old value
    fresh = [Unhashable() for _ in range(200)]
    assert all(t.get(o) is None for o in fresh)
    assert len(t._entries) == 100  # the collected ones were purged, not only hidden


def test_setdefault_gives_every_thread_the_same_value():
    t: SideTable = SideTable("X", "test", "a lock")
    obj = Unhashable()
    start = threading.Barrier(8)
    got = []

    def take():
        start.wait()
        got.append(t.setdefault(obj, threading.RLock))

    threads = [threading.Thread(target=take) for _ in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert len(got) == 8 and all(g is got[0] for g in got)


def test_a_table_never_keeps_its_object_alive():
    t: SideTable = SideTable("X", "test", "the object itself, by mistake")
    obj = Unhashable()
    t.set(obj, "x")
    collected = []
    import weakref

    weakref.finalize(obj, collected.append, True)
    del obj
    gc.collect()
    assert collected == [True] and len(t) == 0


def test_every_table_is_listed_and_described():
    assert set(state.TABLES) == {n for n, v in vars(state).items() if isinstance(v, SideTable)}
    for name, t in state.TABLES.items():
        assert t.owner and t.holds, name
        for user in (u.strip() for u in t.users.split(",")):
            assert (ADAPTER / f"{user}.py").exists(), (name, user)
            src = (ADAPTER / f"{user}.py").read_text()
            assert f"state.{name}" in src or f"import {name}" in src, (name, user)


def _writes_on_other_objects(tree: ast.AST) -> list[str]:
    """Attribute names of the adapter's (``_kvmem*``) that a module sets on any object:
    ``x._kvmem_y = ...``, ``setattr(x, "_kvmem_y", ...)``, ``x.__dict__[...]`` /
    ``.setdefault("_kvmem_y", ...)``."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                if isinstance(t, ast.Attribute) and t.attr.startswith("_kvmem"):
                    out.append(t.attr)
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and node.value.startswith("_kvmem")
        ):
            out.append(node.value)
    return out


@pytest.mark.parametrize("path", sorted(ADAPTER.glob("*.py")), ids=lambda p: p.name)
def test_no_adapter_module_writes_its_attributes_onto_sglang_objects(path):
    assert _writes_on_other_objects(ast.parse(path.read_text())) == []


def test_the_source_check_finds_each_way_of_writing_one():
    src = (
        "x._kvmem_a = 1\nsetattr(x, '_kvmem_b', 2)\nx.__dict__.setdefault('_kvmem_c', {})\n"
        "x._kvmem_d += 1\n"
    )
    assert sorted(_writes_on_other_objects(ast.parse(src))) == [
        "_kvmem_a",
        "_kvmem_b",
        "_kvmem_c",
        "_kvmem_d",
    ]


def test_a_key_that_takes_no_weak_reference_is_refused():
    from types import SimpleNamespace

    t: SideTable[int] = SideTable("X", "test", "a number")
    with pytest.raises(TypeError):
        t.set(SimpleNamespace(), 1)
    ok = type("Scheduler", (SimpleNamespace,), {})()  # a subclass takes one
    t.set(ok, 1)
    assert t.get(ok) == 1


# calls whose result is not state of ours: immutable values (a MappingProxyType over a dict
# made in the call: nothing else holds the dict), and loggers (logging's own)
_NOT_STATE = {
    "re.compile",
    "logging.getLogger",
    "TypeVar",
    "frozenset",
    "tuple",
    "object",
    "MappingProxyType",
}


def _mutable_globals(tree: ast.Module) -> set[str]:
    """Names a module binds at its top level to a container display or comprehension, or
    to the result of a call (other than :data:`_NOT_STATE`'s), and names a function of it
    rebinds (``global``)."""
    displays = (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp)
    out = set()
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            v = node.value
            if isinstance(v, displays) or (
                isinstance(v, ast.Call) and ast.unparse(v.func) not in _NOT_STATE
            ):
                out.update(t.id for t in targets if isinstance(t, ast.Name))
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            out.update(node.names)
    return out


def _module_globals(sources: dict[str, str]) -> set[str]:
    """``module.name`` of each mutable module global in ``sources`` (the adapter's
    modules: name -> source), less state's side tables and its lists of them."""
    found = set()
    for module, source in sources.items():
        names = _mutable_globals(ast.parse(source))
        if module == "state":
            names -= set(state.TABLES) | {"TABLES", "REGISTRIES"}
        found |= {f"{module}.{n}" for n in names}
    return found


def _adapter_sources() -> dict[str, str]:
    return {path.stem: path.read_text() for path in sorted(ADAPTER.glob("*.py"))}


def test_the_only_module_globals_of_the_adapter_are_its_registries():
    """Beside the side tables, the adapter's mutable module globals are the registries
    ``state.REGISTRIES`` lists (the process's, the manifest's, the variables, the
    metrics): what a process keeps is a field of ``state.Process``, not a new global."""
    found = _module_globals(_adapter_sources())
    listed = set(state.REGISTRIES)
    assert found - listed == set(), (
        "module globals not in state.REGISTRIES (per-process state is a field of state.Process)"
    )
    assert listed - found == set(), "listed in state.REGISTRIES, not found"
    assert all(state.REGISTRIES.values())


def test_a_new_module_global_fails_the_check():
    sources = _adapter_sources()
    sources["chase"] += "\n_SEEN: set = set()\n"
    sources["notify"] += "\ndef _later():\n    global _EXECUTOR\n    _EXECUTOR = object()\n"
    assert _module_globals(sources) - set(state.REGISTRIES) == {"chase._SEEN", "notify._EXECUTOR"}


def test_every_service_of_the_process_is_described():
    from dataclasses import fields

    assert type(state.PROCESS) is state.Process
    names = [f.name for f in fields(state.Process)]
    assert names and all(f"``{name}``: " in (state.Process.__doc__ or "") for name in names)


def test_the_globals_check_finds_each_kind():
    src = (
        "import re, threading\nA = []\nB: dict = {}\nC = threading.Lock()\n"
        "D = re.compile('x')\nE = 3\nF = (1, 2)\nG = None\n"
        "def f():\n    global G\n    G = 1\n"
    )
    assert _mutable_globals(ast.parse(src)) == {"A", "B", "C", "G"}
