"""Every part of sglang the adapter touches, in one list: what a port to the next sglang
starts from.

* :data:`HOOKS`: each hook target, its kind (sglang's ``HookRegistry``: AROUND, AFTER,
  BEFORE, REPLACE), the adapter function and the option it depends on.  The plugin
  builds its hooks from this list (:func:`kvmem_sglang.plugin.load`), in this order; a
  target has one hook (what a call does is read top to bottom in one function).
* :data:`PRIVATE`: sglang's private names (a leading underscore) the adapter calls,
  reads or writes other than through a hook.
* What the adapter keeps about sglang's objects: none of it is written onto them; it is
  kept beside them, in the side tables :data:`kvmem_sglang.state.TABLES` declares (the
  README's last table is generated from them).

:mod:`kvmem_sglang.manifest_locate` finds these targets in an sglang source tree and
compares them with :data:`kvmem_sglang.manifest_recorded.RECORDED`, what sglang 0.5.23 (the
version the adapter pins) holds; its command line runs from here: ``python -m
kvmem_sglang.manifest record`` writes that record again, ``python -m kvmem_sglang.manifest
drift SITE_PACKAGES`` compares another sglang's tree with it, and ``python -m
kvmem_sglang.manifest table`` prints the table of the adapter's README.

Imports nothing of sglang, and of the adapter's other modules only the modules of the
hooks, for :func:`hooks_for` (and :mod:`kvmem_sglang.manifest_locate`, run as a command).
"""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass

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
    """A private sglang name the adapter uses: ``use`` is ``call``, ``read``,
    ``read, write`` or ``call, read`` (a class raised and caught); ``what`` is
    ``method``, ``function``, ``class`` or ``attribute`` (an instance attribute, found as
    ``self.NAME =`` in the class or its bases); ``where``: the adapter modules that use
    it."""

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
        f"{_MOON}.MooncakeKVManager.send_kvcache_slice",
        "AROUND",
        "mooncake_slice:send_kvcache_slice",
        "unequal TP's per-head slices, calls within the TCP queue",
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
        "drain (503), deregister, sglang's release, pool.release()",
    ),
    Hook(
        f"{_WU}.resume_memory_occupation",
        "AROUND",
        "release:resume_memory_occupation",
        "pool.resume(), then sglang's resume (its registration)",
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
        f"{_COMMON}.CommonKVSender.failure_exception",
        "AROUND",
        "prefill:sender_failure_exception",
        "a failed room's answer, for prepare_abort",
    ),
    Hook(
        f"{_COMMON}.CommonKVManager.parse_kv_status_message",
        "AROUND",
        "decode:parse_status_message",
        "the prefill's answer frame, kept by room",
    ),
    Hook(
        "sglang.srt.disaggregation.utils.prepare_abort",
        "AROUND",
        "decode:prepare_abort",
        "the answer handed over, not sglang's 500",
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
        "a failed room's answer; one whichever rank sees it",
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
        f"{_SCHED}._release_aborted_request",
        "method",
        "call",
        "prefill, prefill_drain, decode_drain",
    ),
    Private(f"{_SCHED}._pending_chunked_abort_req", "attribute", "read, write", "prefill_drain"),
    Private(
        f"{_COMMON}.CommonKVManager._staging_outstanding",
        "attribute",
        "read",
        "prefill_drain, notify, transfer_ahead",
    ),
    Private(f"{_COMMON}.CommonKVManager._room_notify_targets", "method", "call", "notify"),
    Private(f"{_COMMON}.CommonKVManager._encode_kv_status_message", "method", "call", "notify"),
    Private(f"{_COMMON}.CommonKVManager._send_multipart_locked", "method", "call", "notify"),
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
    Private(f"{_NIXL}._NixlPostError", "class", "call, read", "transfer, transfer_wait"),
    Private(f"{_NIXL}.NixlKVManager._post_xfer", "method", "call", "transfer"),
    Private(f"{_NIXL}.NixlKVManager._prepared_state_plans", "attribute", "read, write", "nixl"),
    Private(f"{_MOON}.MooncakeKVManager._registerable_regions", "method", "call", "mooncake"),
    Private(
        f"{_D}.DecodePreallocQueue._resolve_pending_reqs",
        "method",
        "call; replaced on the instance during a drain",
        "decode, decode_drain",
    ),
    Private(
        f"{_D}.DecodeTransferQueue._deferred_releases", "attribute", "read, write", "decode_drain"
    ),
    Private(f"{_D}.DecodeTransferQueue._is_host_destination", "method", "call", "decode_drain"),
    Private(f"{_D}.DecodeTransferQueue._do_release", "method", "call", "decode_drain"),
    Private(f"{_SCHED}._engine_paused", "attribute", "read", "decode_drain"),
    Private(
        "sglang.srt.disaggregation.common.utils.FastQueue._buf",
        "attribute",
        "read",
        "transfer_queue",
    ),
    Private(
        "sglang.srt.disaggregation.common.utils.FastQueue._cond",
        "attribute",
        "read",
        "transfer_queue",
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


def surface() -> dict[str, str]:
    """Every target of :data:`HOOKS` and :data:`PRIVATE`, to its kind of name."""
    out = {h.target: "method" for h in HOOKS}
    out.update({p.target: p.what for p in PRIVATE})
    return out


if __name__ == "__main__":
    from kvmem_sglang.manifest_locate import main

    sys.exit(main(sys.argv[1:]))
