"""Every part of sglang the adapter touches, in one list: what a port to the next sglang
starts from.

* :data:`HOOKS`: each hook target, its kind (sglang's ``HookRegistry``: AROUND, AFTER,
  BEFORE, REPLACE), the adapter function and the option it depends on.  The plugin
  builds its hooks from this list (:func:`kvmem_sglang.plugin.load`), in this order:
  two AROUND hooks of one target nest, the later one outside.
* :data:`PRIVATE`: sglang's private names (a leading underscore) the adapter calls,
  reads or writes other than through a hook.
* What the adapter keeps about sglang's objects: none of it is written onto them; it is
  kept beside them, in the side tables :data:`kvmem_sglang.state.TABLES` declares (the
  README's last table is generated from them).

:func:`locate` finds a target in an sglang source tree without importing it (the
class and function definitions, ``self.NAME =`` for an instance attribute, a class's
bases through the module's imports), and gives its signature, a digest of its code
(``ast.dump``: blind to comments, formatting and line moves) and its ``file:line``.
:data:`kvmem_sglang.manifest_recorded.RECORDED` holds those of sglang 0.5.23, the
version the adapter pins; ``python -m kvmem_sglang.manifest record`` writes it again,
``python -m kvmem_sglang.manifest drift SITE_PACKAGES`` compares another sglang's
tree with it, and ``python -m kvmem_sglang.manifest table`` prints the table of the
adapter's README.

Imports nothing of sglang, and of the adapter's other modules only
:mod:`kvmem_sglang.state` (standard library only) and, for :func:`hooks_for`, the
modules of the hooks.
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path

_MEM = "sglang.srt.mem_cache.memory_pool"
_CONF = "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator"
_WU = "sglang.srt.managers.scheduler_components.weight_updater.SchedulerWeightUpdaterManager"
_SCHED = "sglang.srt.managers.scheduler.Scheduler"
_STREAMER = "sglang.srt.managers.scheduler_components.output_streamer.SchedulerOutputStreamer"
_P = "sglang.srt.disaggregation.prefill"
_D = "sglang.srt.disaggregation.decode"
_COMMON = "sglang.srt.disaggregation.common.conn"
_NIXL = "sglang.srt.disaggregation.nixl.conn"
_MOON = "sglang.srt.disaggregation.mooncake.conn"
_STAGING = "sglang.srt.disaggregation.common.staging_buffer"


@dataclass(frozen=True)
class Hook:
    """``target`` (sglang's dotted path) gets ``hook`` (``module:function`` of the
    adapter) as a ``kind`` hook when the option ``when`` (an
    :class:`~kvmem_sglang.options.Options` field) is true, or always (None)."""

    target: str
    kind: str
    hook: str
    does: str
    when: str | None = None


@dataclass(frozen=True)
class Private:
    """A private sglang name the adapter uses: ``use`` is ``call``, ``read`` or
    ``read, write``; ``what`` is ``method``, ``function`` or ``attribute`` (an instance
    attribute, found as ``self.NAME =`` in the class or its bases); ``where``: the
    adapter modules that use it."""

    target: str
    what: str
    use: str
    where: str


HOOKS: tuple[Hook, ...] = (
    Hook(
        f"{_MEM}.MHATokenToKVPool._create_buffers",
        "AROUND",
        "hooks:mha_create_buffers",
        "refuses KV layouts kvmem cannot place",
    ),
    Hook(
        f"{_MEM}.MHATokenToKVPool._create_buffers_normal",
        "REPLACE",
        "hooks:mha_create_buffers_normal",
        "K/V views of a kvmem KVPool",
    ),
    Hook(
        f"{_MEM}.MLATokenToKVPool._create_buffers",
        "REPLACE",
        "hooks:mla_create_buffers",
        "KV views of a kvmem KVPool",
    ),
    Hook(
        f"{_CONF}._build_token_to_kv_pool_allocator",
        "AROUND",
        "hooks:build_allocator",
        "kvmem's allocator; refuses pools kvmem does not own",
    ),
    Hook(
        f"{_WU}.release_memory_occupation",
        "AROUND",
        "hooks:release_memory_occupation",
        "pool.release() after sglang's kv_cache release",
    ),
    Hook(
        f"{_WU}.resume_memory_occupation",
        "AROUND",
        "hooks:resume_memory_occupation",
        "pool.resume() before sglang's kv_cache resume",
    ),
    Hook(
        f"{_NIXL}.NixlKVManager.register_buffer_to_engine",
        "AROUND",
        "nixl:register_buffer_to_engine",
        "registers the pool's regions; the deregistration sglang lacks",
    ),
    Hook(
        f"{_NIXL}.NixlKVManager._prepare_payload_xfer",
        "AROUND",
        "nixl:prepare_payload",
        "refuses a descriptor that crosses a registration",
    ),
    Hook(
        f"{_NIXL}.NixlKVManager._prepare_state_xfer",
        "AROUND",
        "nixl:prepare_payload",
        "the same for the state transfer",
    ),
    Hook(
        f"{_NIXL}.NixlKVManager._add_remote_peer",
        "AROUND",
        "nixl:add_remote_peer",
        "a peer's new registrations after its resume",
    ),
    Hook(
        f"{_COMMON}.CommonKVReceiver._register_kv_args",
        "AROUND",
        "registrations:register_kv_args",
        "the decode's regions to its prefills",
    ),
    Hook(
        f"{_NIXL}.NixlKVManager.transfer_worker",
        "AROUND",
        "transfer_ahead:transfer_worker",
        "KV sends on kvmem's path: merged runs, no spinning",
        when="transfer",
    ),
    Hook(
        f"{_NIXL}.NixlKVManager.send_kvcache",
        "AROUND",
        "transfer:send_kvcache",
        "(the same)",
        when="transfer",
    ),
    Hook(
        f"{_NIXL}.NixlKVManager._await_handles",
        "AROUND",
        "transfer_wait:await_handles",
        "(the same)",
        when="transfer",
    ),
    Hook(
        f"{_MOON}.MooncakeKVManager.transfer_worker",
        "AROUND",
        "transfer_ahead:transfer_worker",
        "KV sends on kvmem's Mooncake path",
        when="transfer",
    ),
    Hook(
        f"{_MOON}.MooncakeKVManager.send_kvcache",
        "AROUND",
        "mooncake_send:send_kvcache",
        "merged slices, calls within the TCP queue",
        when="transfer",
    ),
    Hook(
        f"{_MOON}.MooncakeKVManager.register_buffer_to_engine",
        "AROUND",
        "mooncake:register_buffer_to_engine",
        "registers the pool's regions",
    ),
    Hook(
        f"{_MOON}.MooncakeKVManager.deregister_buffer_to_engine",
        "AROUND",
        "mooncake:deregister_buffer_to_engine",
        "deregisters them at a release",
    ),
    Hook(
        f"{_MOON}.MooncakeKVManager._poison_unsettled_send",
        "AROUND",
        "mooncake:poison_unsettled_send",
        "a release waits for unsettled sends",
    ),
    Hook(
        f"{_MOON}.MooncakeKVManager._registerable_regions",
        "AFTER",
        "mooncake:registerable_regions",
        "the pool's regions, one per mapping",
        when="register_regions",
    ),
    Hook(
        f"{_SCHED}._add_request_to_queue",
        "AROUND",
        "prefill:add_request_to_queue",
        "503 while released; the registration epoch",
    ),
    Hook(
        f"{_SCHED}.abort_request",
        "AROUND",
        "prefill:abort_request",
        "a client's abort in every PD state",
    ),
    Hook(
        f"{_STREAMER}.stream_output",
        "BEFORE",
        "prefill:stream_output",
        "one status and one reason per request",
    ),
    Hook(
        f"{_P}.SchedulerDisaggregationPrefillMixin.handle_bootstrap_failure",
        "BEFORE",
        "prefill:handle_bootstrap_failure",
        "the failure's status (503, 504)",
    ),
    Hook(
        f"{_P}.SchedulerDisaggregationPrefillMixin.process_disagg_prefill_inflight_queue",
        "AROUND",
        "prefill:process_inflight_queue",
        "the transfer timeout; the audit",
    ),
    Hook(
        f"{_P}.SchedulerDisaggregationPrefillMixin.send_kv_chunk",
        "AROUND",
        "prefill:send_kv_chunk",
        "no send of memory set up before a release",
    ),
    Hook(
        f"{_SCHED}.continue_generation",
        "AROUND",
        "release:continue_generation",
        "503 for what a release interrupted",
    ),
    Hook(
        f"{_WU}.release_memory_occupation",
        "AROUND",
        "release:release_memory_occupation",
        "drain (503) before sglang's release; refuses a second one",
    ),
    Hook(
        f"{_WU}.resume_memory_occupation",
        "AROUND",
        "release:resume_memory_occupation",
        "the new registration epoch",
    ),
    Hook(
        f"{_P}.PrefillBootstrapQueue.release_memory_occupation",
        "AFTER",
        "release:queue_release",
        "the queue's part of the release",
    ),
    Hook(
        f"{_P}.PrefillBootstrapQueue.resume_memory_occupation",
        "AROUND",
        "release:queue_resume",
        "the queue's part of the resume",
    ),
    Hook(
        f"{_COMMON}.CommonKVSender.abort",
        "AROUND",
        "notify:sender_abort",
        "the decode is told of an aborted sender",
    ),
    Hook(
        f"{_COMMON}.CommonKVManager.update_status",
        "AROUND",
        "notify:manager_update_status",
        "(the same, for a failed room)",
    ),
    Hook(
        f"{_NIXL}.NixlKVManager._handle_abort_notification",
        "AROUND",
        "notify:abort_notification",
        "an ABORT for a room not yet known",
    ),
    Hook(
        f"{_MOON}.MooncakeKVManager._handle_abort_notification",
        "AROUND",
        "notify:abort_notification",
        "(the same on Mooncake)",
    ),
    Hook(
        "sglang.srt.disaggregation.utils.prepare_abort",
        "AROUND",
        "decode:prepare_abort",
        "the decode answers with the prefill's status",
    ),
    Hook(
        f"{_D}.DecodePreallocQueue.pop_preallocated",
        "AROUND",
        "decode:pop_preallocated",
        "503 while released, told to the prefill",
    ),
    Hook(
        f"{_COMMON}.CommonKVReceiver.failure_exception",
        "AROUND",
        "decode:receiver_failure_exception",
        "one status whichever rank sees it first",
    ),
    Hook(
        f"{_STAGING}.gather_all_layers_to_staging",
        "REPLACE",
        "hooks:gather_all_layers_to_staging",
        "kvmem.pack_buffers",
        when="staging",
    ),
    Hook(
        f"{_STAGING}.scatter_staging_to_kv",
        "REPLACE",
        "hooks:scatter_staging_to_kv",
        "kvmem.unpack_buffers",
        when="staging",
    ),
)

PRIVATE: tuple[Private, ...] = (
    Private(
        f"{_SCHED}._release_aborted_request", "method", "call", "prefill, prefill_drain, decode"
    ),
    Private(f"{_SCHED}._pending_chunked_abort_req", "attribute", "read, write", "prefill_drain"),
    Private(
        f"{_COMMON}.CommonKVManager._staging_outstanding",
        "attribute",
        "read",
        "prefill_drain, notify, transfer_ahead",
    ),
    Private(f"{_COMMON}.CommonKVManager._room_notify_targets", "method", "call", "notify"),
    Private(
        f"{_COMMON}.CommonKVManager._maybe_ack_drained_abort", "method", "call", "transfer_ahead"
    ),
    Private(
        f"{_COMMON}.CommonKVReceiver._connect_to_bootstrap_server",
        "method",
        "call",
        "registrations, chase",
    ),
    Private(f"{_NIXL}._nixl_device_id", "function", "call", "transfer"),
    Private(f"{_NIXL}.NixlKVManager._post_xfer", "method", "call", "transfer"),
    Private(f"{_MOON}.MooncakeKVManager._registerable_regions", "method", "call", "mooncake"),
    Private(
        f"{_D}.DecodePreallocQueue._resolve_pending_reqs",
        "method",
        "call; replaced on the instance during a drain",
        "decode",
    ),
)


def hook_function(hook: Hook):
    """The adapter function ``hook.hook`` names (imports its module)."""
    module, name = hook.hook.split(":")
    return getattr(importlib.import_module(f"kvmem_sglang.{module}"), name)


def hooks_for(options) -> list[tuple[str, object, str]]:
    """(target, function, kind) of every hook ``options`` turns on, in :data:`HOOKS`'
    order."""
    return [
        (h.target, hook_function(h), h.kind)
        for h in HOOKS
        if h.when is None or getattr(options, h.when)
    ]


# -- where a target is in an sglang tree -------------------------------------------------------


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


def surface() -> dict[str, str]:
    """Every target of :data:`HOOKS` and :data:`PRIVATE`, to its kind of name."""
    out = {h.target: "method" for h in HOOKS}
    out.update({p.target: p.what for p in PRIVATE})
    return out


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


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
