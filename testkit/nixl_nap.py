"""NIXL's progress thread with a nap between polls, for the CPU test tiers.

NIXL's Python agent hard-codes ``pthrDelay = 0`` (``nixl_cu13/_api.py:226``, the same in
``nixl_cu12``), so an agent with a progress thread (NIXL's default, and sglang's) makes
the UCX backend's shared thread (``nixlUcxSharedThread::run``) call ``poll()`` with a
zero timeout in a loop: measured here, an idle agent uses a whole core (3.0 s of CPU in
3 s), and 0.03 s with the delay below.  The thread still wakes at once when a worker's
file descriptor is ready; the delay only bounds its periodic wake-up (NIXL keeps that
wake-up as a workaround for fds that poll does not report).

Applied to one ``_api`` module at a time (:func:`apply`), or to each of NIXL's wheels'
``_api`` modules when it is imported (:func:`install`): every agent it makes gets
:data:`PTHR_DELAY_US`.  Used by the e2e tier's servers
(``tests/e2e/standins/sitecustomize.py``, stock and the flag alike), the test session
(``tests/conftest.py``) and the harness's processes (``testkit.sglang_pair``, the NIXL
scripts of ``tests/sglang``).  kvmem itself keeps NIXL's default.

:func:`vram_as_dram` is the other NIXL setting those processes need where sglang labels
host memory "VRAM" (the e2e servers, the harness's pairs at TP 2): sglang registers and
describes KV buffers as "VRAM" (``_normalize_kv_mem_kinds``, ``disaggregation/
decode.py:629``), which UCX refuses for CPU memory, and no flag selects DRAM.
"""

from __future__ import annotations

import types

# The modules that define NIXL's Python agent, one per wheel (sglang imports ``nixl``,
# the meta package, which loads one of them).
API_MODULES = ("nixl_cu12._api", "nixl_cu13._api")

PTHR_DELAY_US = 5000


class NappingBind(types.ModuleType):
    """NIXL's bindings module as ``_api`` sees it, but every agent made with a progress
    thread delay of :data:`PTHR_DELAY_US`."""

    def __init__(self, inner):
        super().__init__(inner.__name__)
        self._inner = inner

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def nixlAgent(self, name, config):
        config.pthrDelay = PTHR_DELAY_US
        return self._inner.nixlAgent(name, config)


def apply(module) -> bool:
    """Give NIXL's ``_api`` ``module`` the napping bindings; False if it has them."""
    if isinstance(module.nixlBind, NappingBind):
        return False
    module.nixlBind = NappingBind(module.nixlBind)
    return True


def vram_as_dram(module) -> bool:
    """Make every agent of NIXL's ``_api`` ``module`` resolve the memory type "VRAM" as
    DRAM (each descriptor call of an agent looks its memory type up in the agent's
    ``nixl_mems``); False if it does already."""
    cls = module.nixl_agent
    if getattr(cls, "_kvmem_vram_as_dram", False):
        return False
    init = cls.__init__

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.nixl_mems["VRAM"] = self.nixl_mems["DRAM"]

    cls.__init__ = __init__
    cls._kvmem_vram_as_dram = True
    return True


def install() -> None:
    """Nap in this process: :func:`apply` to each ``_api`` module of :data:`API_MODULES`,
    now if it is imported already, else when it is (the adapter's post-import hook,
    ``kvmem_sglang.imports``, standard library only); nothing where the adapter is not
    installed (a bare GPU host: no NIXL there either)."""
    try:
        from kvmem_sglang.imports import after_import
    except ImportError:
        return

    for name in API_MODULES:
        after_import(name, apply)
