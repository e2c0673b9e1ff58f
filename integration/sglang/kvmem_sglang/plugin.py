"""The plugin sglang loads: ``load()`` installs kvmem under sglang, or does nothing.

sglang calls :func:`load` (entry point ``kvmem`` in the ``sglang.srt.plugins`` group)
first thing in every process it starts, before the scheduler builds its KV pool and
allocator.  With ``SGLANG_KVMEM`` unset or ``0`` it returns at once and patches nothing.
With ``SGLANG_KVMEM=1`` it registers the hooks below through sglang's ``HookRegistry``,
applies them, checks that every one is in place, and logs once what it installed.

sglang logs and swallows exceptions from plugins and from hook application, which would
leave a server running stock sglang while its operator believes kvmem is under it.  So
every problem found here (bad option, other sglang version, missing hook target, a hook
that did not apply) ends the process with ``SystemExit`` and one message naming the
cause.  Problems found later, when sglang builds its pool (a KV layout kvmem cannot
place), raise :class:`~kvmem_sglang.options.AdapterError` from inside the hook, which
sglang does not catch: the scheduler stops with that message.

The hooks, their targets and kinds, and the options they depend on
(``SGLANG_KVMEM_REGISTER``, ``SGLANG_KVMEM_STAGING``, ``SGLANG_KVMEM_TRANSFER``) are
listed in :mod:`kvmem_sglang.manifest`, with every other part of sglang the adapter
touches; the README's table is generated from it.
"""

from __future__ import annotations

import functools
import logging
import os
import pkgutil
import sys
import time

from kvmem_sglang import state
from kvmem_sglang.imports import after_import
from kvmem_sglang.options import AdapterError, Options

logger = logging.getLogger("kvmem.sglang")

SGLANG_VERSION = "0.5.23"

INSTALLED: list[str] = []  # targets patched in this process
PENDING: dict[str, list[str]] = {}  # backend module -> targets patched when it is imported


def load() -> None:
    """Entry point: install kvmem's hooks when ``SGLANG_KVMEM=1``, else nothing."""
    try:
        options = Options.from_env()
    except AdapterError as e:
        _fatal(str(e))
    if not options.enabled:
        return
    if state.PROCESS.options.is_active():  # sglang guards against a second load; so do we
        return
    try:
        _check_version()
        hooks = _hooks(options)
        now, later = _by_backend(hooks)
        _install(now)
    except AdapterError as e:
        _fatal(str(e))
    state.PROCESS.options.activate(options)
    for module, group in later.items():
        PENDING[module] = [t for t, _, _ in group]
        after_import(module, functools.partial(_install_backend, group))
    _announce(
        "kvmem-sglang: SGLANG_KVMEM=1, %d hooks installed, %s (pid %d, backend %s, "
        "check %s, register %s, staging %s, transfer %s): %s",
        len(now),
        ", ".join(f"{len(g)} when {m.rsplit('.', 2)[-2]} loads" for m, g in later.items()),
        os.getpid(),
        options.backend or "auto",
        options.check,
        "regions" if options.register_regions else "layers",
        options.staging,
        "kvmem" if options.transfer else "sglang",
        ", ".join(t.rsplit(".", 2)[-2] + "." + t.rsplit(".", 1)[-1] for t, _, _ in hooks),
    )


# The modules of sglang's PD transfer backends whose hooks wait for sglang to import them:
# importing NIXL's (nixl/conn.py, which imports ``nixl._bindings`` at module level) loads
# the NIXL library, so a server on another backend (Mooncake, sglang's default) would load
# NIXL only because the adapter named its classes.
BACKEND_MODULES = ("sglang.srt.disaggregation.nixl.conn", "sglang.srt.disaggregation.mooncake.conn")


def _by_backend(hooks):
    """(the hooks to install now, {backend module: its hooks, installed when sglang
    imports it}); a backend module already imported has its hooks installed now."""
    now, later = [], {}
    for hook in hooks:
        module = next((m for m in BACKEND_MODULES if hook[0].startswith(m + ".")), None)
        if module is None or module in sys.modules:
            now.append(hook)
        else:
            later.setdefault(module, []).append(hook)
    return now, later


def _install_backend(hooks, module) -> None:
    """After sglang imported a backend's module: install its hooks, or stop the process
    (the import raises ``SystemExit`` with the adapter's message)."""
    try:
        _install(hooks)
    except AdapterError as e:
        _fatal(str(e))
    PENDING.pop(module.__name__, None)
    logger.info("kvmem-sglang: %d hook(s) installed on %s", len(hooks), module.__name__)


def _announce(fmt: str, *args) -> None:
    """Log at INFO, or, before anyone configured logging, write the line to stderr.

    sglang loads plugins before it configures logging (``launch_server.py``'s ``__main__``
    block calls ``load_plugins()`` first; in the scheduler, ``run_scheduler_process`` in
    ``managers/scheduler.py`` calls it before ``configure_scheduler_process`` calls
    ``configure_logger``): an INFO record then reaches no handler and the start line
    would never show in a server's log."""
    if logger.isEnabledFor(logging.INFO) and (logger.handlers or logging.getLogger().handlers):
        logger.info(fmt, *args)
        return
    line = time.strftime("[%Y-%m-%d %H:%M:%S] ") + (fmt % args)
    print(line, file=sys.stderr, flush=True)


def _fatal(msg: str):
    logger.critical("%s", msg)
    raise SystemExit(msg)


def _check_version() -> None:
    try:
        import sglang
    except ImportError as e:
        raise AdapterError(f"sglang is not importable: {e}") from None
    version = getattr(sglang, "__version__", "unknown")
    if version != SGLANG_VERSION:
        raise AdapterError(
            f"this adapter supports sglang {SGLANG_VERSION}, found sglang {version}",
            f"install sglang=={SGLANG_VERSION}, or unset SGLANG_KVMEM to run this sglang stock",
        )


def _hooks(options: Options) -> list[tuple[str, object, str]]:
    """(target, hook, kind) for these options: :data:`kvmem_sglang.manifest.HOOKS`, one
    hook a target (AdapterError for a second: sglang's HookRegistry would bypass one of
    two AROUND hooks of a target, with a warning at every start)."""
    from kvmem_sglang import manifest

    hooks = manifest.hooks_for(options)
    seen: set[str] = set()
    for target, _, _ in hooks:
        if target in seen:
            raise AdapterError(f"the manifest gives {target} two hooks")
        seen.add(target)
    return hooks


def _resolve(target: str):
    """(owner, attribute name, current value); AdapterError when it does not exist."""
    owner_path, name = target.rsplit(".", 1)
    try:
        owner = pkgutil.resolve_name(owner_path)
    except (ImportError, AttributeError, ValueError) as e:
        raise AdapterError(
            f"hook target {target} cannot be resolved: {type(e).__name__}: {e}"
        ) from None
    if isinstance(owner, type):
        raw = next((k.__dict__[name] for k in owner.__mro__ if name in k.__dict__), None)
        if raw is None:
            raise AdapterError(f"hook target {target} does not exist in this sglang")
        return owner, name, getattr(raw, "__func__", raw)
    if not hasattr(owner, name):
        raise AdapterError(f"hook target {target} does not exist in this sglang")
    return owner, name, getattr(owner, name)


def _holds(fn, hook) -> bool:
    """Whether ``fn`` is, or wraps (through sglang's hook wrappers), ``hook``."""
    seen = 0
    while fn is not None and seen < 32:
        if fn is hook:
            return True
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                if cell.cell_contents is hook:
                    return True
            except ValueError:  # an empty cell
                pass
        fn = getattr(fn, "__wrapped__", None)
        seen += 1
    return False


def _install(hooks) -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for target, _, _ in hooks:  # every target exists before anything is registered
        _resolve(target)
    for target, hook, kind in hooks:
        HookRegistry.register(target, hook, HookType[kind])
    HookRegistry.apply_hooks()  # idempotent: load_plugins' own call skips these
    missing = [t for t, hook, _ in hooks if not _holds(_resolve(t)[2], hook)]
    if missing:
        raise AdapterError(
            "sglang did not apply the hook(s) on "
            + ", ".join(missing)
            + " (see sglang's log for the exception it swallowed)"
        )
    INSTALLED.extend(t for t, _, _ in hooks)
