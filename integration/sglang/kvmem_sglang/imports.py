"""Run a function right after a module is first imported (or now, if it already is): how
the adapter reaches modules it must not import itself.

* ``kvmem_sglang.startup`` guards ``sglang.srt.plugins`` from interpreter start, before
  sglang exists in the process;
* ``kvmem_sglang.plugin`` installs the hooks of a PD transfer backend when sglang
  imports that backend's module (``sglang.srt.disaggregation.nixl.conn`` imports the
  NIXL library at module level): a Mooncake server never loads NIXL, a NIXL server never
  loads Mooncake.

Imports nothing beyond the standard library and :mod:`kvmem_sglang.state` (the
functions waiting are ``state.PROCESS.after_import``), itself standard library only.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from typing import Callable

from kvmem_sglang import state


def after_import(name: str, fn: Callable) -> None:
    """Call ``fn(module)`` once module ``name`` has executed its body: now if it is
    imported already, else when it is.  What ``fn`` raises propagates to the import."""
    module = sys.modules.get(name)
    if module is not None:
        fn(module)
        return
    state.PROCESS.after_import.setdefault(name, []).append(fn)
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


class _Loader(importlib.abc.Loader):
    def __init__(self, inner, name: str):
        self._inner, self._name = inner, name

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        self._inner.exec_module(module)
        for fn in state.PROCESS.after_import.pop(self._name, []):
            fn(module)


class _Finder(importlib.abc.MetaPathFinder):
    """Wraps the loader of each module waited for, so the functions run after its body."""

    def find_spec(self, name, path=None, target=None):
        if name not in state.PROCESS.after_import:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _Loader(spec.loader, name)
        return spec
