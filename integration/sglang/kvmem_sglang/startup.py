"""Run at interpreter start (``kvmem_sglang.pth``): with ``SGLANG_KVMEM=1``, make sure
that an sglang process that loads its plugins really loaded kvmem's.

sglang loads plugins through ``load_plugins()`` (``srt/plugins/__init__.py``) and skips
or swallows what does not load: ``SGLANG_PLUGINS`` that leaves ``kvmem`` out ("Skipping
plugin kvmem"), a ``SGLANG_PLATFORM`` that excludes the distribution, an exception while
the entry point loads ("Failed to load plugin").  Each of those would leave a server
running stock sglang while its operator set the flag.  So, only when the flag is on,
this module wraps ``load_plugins`` the moment ``sglang.srt.plugins`` is imported: after
sglang's own loading, a process in which the adapter is not active stops with one line
naming the cause and what to change.

Without the flag nothing is imported: the .pth line reads one environment variable, in
every Python process of the environment.
"""

from __future__ import annotations

import os

from kvmem_sglang import state

_TARGET = "sglang.srt.plugins"


def _why_not_loaded() -> str:
    allowed = os.environ.get("SGLANG_PLUGINS", "").strip()
    names = {x.strip() for x in allowed.split(",") if x.strip()}
    if names and "kvmem" not in names:
        return (
            f"SGLANG_PLUGINS={allowed!r} leaves the kvmem plugin out, so sglang "
            "skipped it; add kvmem to SGLANG_PLUGINS, or unset SGLANG_KVMEM to run "
            "this server on stock sglang"
        )
    return (
        "sglang did not load the kvmem plugin (see sglang's log: 'Skipping plugin' or "
        "'Failed to load plugin kvmem'; SGLANG_PLATFORM may exclude it); install "
        "kvmem-sglang in this environment, or unset SGLANG_KVMEM to run this server "
        "on stock sglang"
    )


def _guard(module) -> None:
    load = module.load_plugins
    if state.GUARDED.get(load, False):
        return

    def load_plugins(*args, **kwargs):
        out = load(*args, **kwargs)
        if not state.PROCESS.options.is_active():
            from kvmem_sglang.options import PREFIX

            raise SystemExit(PREFIX + _why_not_loaded())
        return out

    state.GUARDED.set(load_plugins, True)
    setattr(load_plugins, "__wrapped__", load)  # as functools.wraps: mypy types no such field
    module.load_plugins = load_plugins


def install() -> None:
    """What the .pth line calls: a no-op unless ``SGLANG_KVMEM=1``."""
    if os.environ.get("SGLANG_KVMEM", "").strip() != "1":
        return
    from kvmem_sglang.imports import after_import

    after_import(_TARGET, _guard)
