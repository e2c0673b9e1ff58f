"""sglang 0.5.23's ``NixlKVManager`` across a KV release: what it registered and what it
prepared over that registration are given back together, and built again at the resume.

Names below are of the installed sglang 0.5.23's ``sglang/srt/disaggregation/nixl/conn.py``,
methods of its ``NixlKVManager`` unless said otherwise.

* sglang registers the KV buffers one by one (``NixlKVManager.register_buffer_to_engine``)
  and has no ``deregister_buffer_to_engine``, so a release leaves everything registered and
  each resume registers it all again.  The manager gets one here (an instance attribute,
  which the prefill and decode queues' ``release_memory_occupation`` call when present).
* The prefill prepares NIXL descriptor lists once, when a decode peer registers
  (``NixlKVManager._prepare_payload_xfer``): the local one over its own KV
  (``prep_handles[""]``; also the heterogeneous-TP and mixed-memory variants,
  ``_init_hetero_tp_prep_handle`` and ``_init_mixed_equal_tp_prep_handles``, and the state
  plans, ``_build_prepared_state_plan``) and one per peer over the peer's KV.  Every KV send
  then uses them (``make_prepped_xfer`` on ``_send_kvcache_generic``'s prepared path).  A
  prepared local list refers to the registration it was made over: after that registration
  is gone, a transfer made from it reads freed NIXL state and the process dies (a segfault
  in the ``agent.transfer`` of ``_post_xfer``, seen on the first request after a release
  and a resume).  So :func:`deregister` releases every prepared list *before* it
  deregisters the memory, and the registration at the resume prepares them again for every
  known peer (:func:`register_buffer_to_engine`).  If that fails for a peer, that peer
  alone is left without prepared lists (:func:`prepare_peers`: the local lists shared by
  all peers stay, and so do the other peers' lists): its sends take sglang's unprepared
  path (``_send_kvcache_generic`` takes the prepared one only while both the local list and
  the peer's are in ``prep_handles``), which builds descriptors per transfer over the new
  registration.
* sglang's bootstrap thread prepares a new decode peer's lists the moment its
  registration arrives (``NixlKVManager._add_remote_peer``, called on the bootstrap thread
  of ``_start_bootstrap_thread``), at any time, also while the KV cache is released:
  preparing over the deregistered pool fails (``NIXL_ERR_NOT_FOUND``) and the exception
  kills the bootstrap thread, after which every request to the prefill hangs in
  Bootstrapping (seen in a real deployment: a decode's first request arriving during a
  release).  :func:`prepare_payload` defers the preparation while deregistered (the peer
  is already in ``decode_kv_args_table``, so the resume prepares it), and one lock per
  manager orders preparations against the deregistration and the registration.
* A decode's registration describes its KV by the NIXL agent metadata of the moment.
  A decode with the flag that released its KV cache has deregistered it: the
  registration it would send a prefill it meets for the first time then carries no KV
  memory, and sglang's prefill, preparing its lists over it, fails the same way and
  loses its bootstrap thread (seen in a real deployment: a decode released before its
  first request).  After a resume the decode's KV is registered again under new keys,
  which a prefill that kept the old metadata would use (over RDMA every write then
  fails).  So, on a decode: ``registrations.register_kv_args`` sends no registration while
  deregistered, and the resume sends the new registration to every prefill rank the
  decode knows (``registrations.resend``).  On a prefill, :func:`add_remote_peer`
  takes a known decode's new registration in place of the old one (sglang's
  ``_add_remote_peer`` ignores an agent it already has) and never lets a peer's preparation
  kill the bootstrap thread: a peer whose lists cannot be prepared is kept without them,
  and its sends build descriptors per transfer (a send that then fails is a failed
  transfer, answered, not a hang).
* With ``SGLANG_KVMEM_REGISTER=regions`` the registration covers the kvmem pool's few
  regions instead of one buffer per layer and per K/V (transfers still address each
  layer inside them).

Chunk sends set up before a release are refused by the prefill lifecycle hooks
(:mod:`kvmem_sglang.prefill`, ``send_kv_chunk``) before they reach a prepared list.
"""

from __future__ import annotations

import functools
import logging
import threading

from kvmem_sglang import kvpool, registrations, state

logger = logging.getLogger("kvmem.sglang")


def register_buffer_to_engine(original, manager, *args, **kwargs):
    """AROUND ``NixlKVManager.register_buffer_to_engine``: give the manager its
    deregistration; register the pool's regions (``SGLANG_KVMEM_REGISTER=regions``) or
    sglang's per-layer buffers; after a deregistration, prepare the transfer lists of
    every known peer again over the new registration."""
    if "deregister_buffer_to_engine" not in vars(manager):
        manager.deregister_buffer_to_engine = functools.partial(deregister, manager)
    with _lock(manager):
        again = state.DEREGISTERED.get(manager, False)
        out = _register(
            original, manager, state.PROCESS.options.active().register_regions, *args, **kwargs
        )
        state.DEREGISTERED.set(manager, False)
        if again:
            prepare_peers(manager)
    if again:
        registrations.resend(manager)
    return out


def _lock(manager) -> threading.RLock:
    """The manager's registration lock (made on first use; the first use is sglang's
    registration in the manager's constructor, before any other thread of it runs)."""
    return state.REG_LOCK.setdefault(manager, threading.RLock)


def prepare_payload(original, manager, *args, **kwargs):
    """AROUND ``NixlKVManager._prepare_payload_xfer`` and ``_prepare_state_xfer``: under
    the registration lock; skipped while the manager's memory is deregistered (the resume
    prepares every known peer, :func:`prepare_peers`)."""
    with _lock(manager):
        if state.DEREGISTERED.get(manager, False):
            peer = args[0] if args else kwargs.get("peer_info")
            logger.info(
                "kvmem-sglang: NIXL transfer lists of decode peer %s deferred to "
                "the resume (the KV cache is released)",
                getattr(peer, "agent_name", peer),
            )
            return None
        return original(manager, *args, **kwargs)


def _register(original, manager, regions: bool, *args, **kwargs):
    kv_args = manager.kv_args
    ptrs, lens = list(kv_args.kv_data_ptrs), list(kv_args.kv_data_lens)
    kinds = list(getattr(kv_args, "kv_data_mem_kinds", None) or [])
    if not regions:
        return original(manager, *args, **kwargs)
    new_ptrs, new_lens = kvpool.coalesce(ptrs, lens)
    if new_ptrs == ptrs or len(set(kinds)) > 1:
        return original(manager, *args, **kwargs)
    saved = (
        kv_args.kv_data_ptrs,
        kv_args.kv_data_lens,
        getattr(kv_args, "kv_data_mem_kinds", None),
    )
    kv_args.kv_data_ptrs, kv_args.kv_data_lens = new_ptrs, new_lens
    if kinds:
        kv_args.kv_data_mem_kinds = kinds[:1] * len(new_ptrs)
    try:
        return original(manager, *args, **kwargs)
    finally:
        kv_args.kv_data_ptrs, kv_args.kv_data_lens = saved[0], saved[1]
        if kinds:
            kv_args.kv_data_mem_kinds = saved[2]


def deregister(manager) -> None:
    """Release every descriptor list prepared over the manager's registrations, then
    deregister what ``register_buffer_to_engine`` registered (KV, aux and state lists),
    each once; a second call finds nothing left (the adapter's release deregisters ahead
    of sglang's, ``kvmem_sglang.release``, whose own call then does nothing)."""
    from kvmem_sglang import prefill

    with _lock(manager):
        if state.DEREGISTERED.get(manager, False):
            return
        released = release_prepared(manager)
        agent = manager.agent
        lists = list(getattr(manager, "kv_descs", None) or [])
        for name in ("aux_descs", "state_descs"):
            descs = getattr(manager, name, None)
            if descs is not None:
                lists.append(descs)
        for descs in lists:
            agent.deregister_memory(descs)
            prefill.STATS.deregistrations += 1
        manager.kv_descs = []
        manager.aux_descs = manager.state_descs = None
        if lists:
            state.DEREGISTERED.set(manager, True)
    logger.info(
        "kvmem: NIXL KV, aux and state buffers deregistered (%d list(s); %d "
        "prepared transfer list(s) released first)",
        len(lists),
        released,
    )


def _prepared(manager) -> list:
    """Every prepared descriptor-list handle the manager holds (sglang's caches of them,
    made in ``NixlKVManager.__init__``, nixl/conn.py, and the state plans)."""
    out = list(getattr(manager, "prep_handles", {}).values())
    slice_src = getattr(manager, "prep_handle_slice_src", None)
    if slice_src is not None:
        out.append(slice_src[0])
    out += [v[0] for v in getattr(manager, "prep_handles_slice_dst", {}).values()]
    out += list(getattr(manager, "prep_handles_segment_src", {}).values())
    for plan in getattr(manager, "_prepared_state_plans", {}).values():
        out += [plan.src_handle, plan.dst_handle]
    return [h for h in out if h is not None]


def release_prepared(manager) -> int:
    """Release and forget every prepared descriptor list of ``manager``; the number
    released.  sglang then takes its unprepared path until :func:`prepare_peers`."""
    handles = _prepared(manager)
    _release_handles(manager, handles)
    for name in (
        "prep_handles",
        "prep_handles_slice_dst",
        "prep_handles_segment_src",
        "_prepared_state_plans",
    ):
        table = getattr(manager, name, None)
        if table is not None:
            table.clear()
    if getattr(manager, "prep_handle_slice_src", None) is not None:
        manager.prep_handle_slice_src = None
    for peer in getattr(manager, "decode_kv_args_table", {}).values():
        if hasattr(peer, "kv_xfer_segments"):
            peer.kv_xfer_segments = None
    return len(handles)


def prepare_peers(manager) -> list[str]:
    """Prepare the transfer lists of every decode peer the prefill knows, as sglang does
    when a peer registers (``NixlKVManager._add_remote_peer``, nixl/conn.py); the names of
    the peers left unprepared.

    sglang keeps two kinds of prepared lists (``NixlKVManager.__init__`` and the
    ``_init_*_prep_handle*`` methods, nixl/conn.py): local lists over this prefill's own
    memory, made by the first peer that needs one and shared by every peer
    (``prep_handles[""]``, ``prep_handle_slice_src``, ``prep_handles_segment_src``), and
    each peer's own (its remote KV list ``prep_handles[name]``, its slice list
    ``prep_handles_slice_dst[name]``, its mixed-memory segments ``kv_xfer_segments``, its
    state plan ``_prepared_state_plans[name]``, both of whose lists are its own).  A peer
    whose preparation fails is logged, and what was prepared of its own lists is released
    (:func:`_release_peer_lists`: no peer is left half-prepared), so that it alone takes
    sglang's unprepared path; the shared local lists (over this prefill's memory and the
    new registration, whichever peer made them) and every other peer's lists stay.
    (sglang has an unprepared path for equal-TP KV sends on one memory kind and for state
    sends; a heterogeneous-TP or mixed-memory peer left unprepared has its sends fail: a
    failed transfer, answered.)"""
    from sglang.srt.disaggregation.utils import DisaggregationMode

    if getattr(manager, "disaggregation_mode", None) != DisaggregationMode.PREFILL:
        return []
    peers = list(getattr(manager, "decode_kv_args_table", {}).values())
    failed = []
    for peer in peers:
        try:  # through the hooks: the lock is re-entrant, the manager registered again
            manager._prepare_payload_xfer(peer)
            manager._prepare_state_xfer(peer)
        except Exception:  # noqa: BLE001 - the unprepared path still serves this peer
            logger.exception(
                "kvmem-sglang: preparing NIXL transfer lists for decode peer "
                "%s after the resume failed; its sends build descriptors per "
                "transfer (the other peers keep theirs)",
                peer.agent_name,
            )
            _release_peer_lists(manager, peer.agent_name)
            failed.append(peer.agent_name)
    if peers:
        logger.info(
            "kvmem-sglang: NIXL transfer lists prepared again for %d decode "
            "peer(s) over the new registration (%d left unprepared)",
            len(peers) - len(failed),
            len(failed),
        )
    return failed


def _release_peer_lists(manager, name: str) -> int:
    """Release and forget the lists prepared over decode peer ``name``'s memory and for it
    alone: its remote KV list, its slice list, its mixed-memory segments' remote lists and
    its state plan (both lists: ``_build_prepared_state_plan`` prepares the plan's local
    list per peer); the local lists shared by every peer stay.  The number released."""
    handles = []
    h = getattr(manager, "prep_handles", {}).pop(name, None)
    if h is not None:
        handles.append(h)
    sliced = getattr(manager, "prep_handles_slice_dst", {}).pop(name, None)
    if sliced is not None:
        handles.append(sliced[0])
    plan = getattr(manager, "_prepared_state_plans", {}).pop(name, None)
    if plan is not None:
        handles += [plan.src_handle, plan.dst_handle]
    peer = getattr(manager, "decode_kv_args_table", {}).get(name)
    if peer is not None and getattr(peer, "kv_xfer_segments", None) is not None:
        handles += [seg.dst_handle for seg in peer.kv_xfer_segments]  # src: shared
        peer.kv_xfer_segments = None
    handles = [h for h in handles if h is not None]
    _release_handles(manager, handles)
    return len(handles)


def _release_handles(manager, handles) -> None:
    for h in handles:
        try:
            manager.agent.release_dlist_handle(h)
        except Exception:  # noqa: BLE001 - a list NIXL cannot release is dropped all the same
            logger.exception("kvmem-sglang: NIXL could not release a prepared list %r", h)


def add_remote_peer(original, manager, peer, *args, **kwargs):
    """AROUND ``NixlKVManager._add_remote_peer`` (the prefill's bootstrap thread, on a
    decode's registration): a known decode's new registration (it released and resumed
    its KV cache) replaces the old one; a failure never leaves this call (module
    docstring), so the bootstrap thread lives on."""
    name = peer.agent_name
    try:
        with _lock(manager):
            table = manager.decode_kv_args_table
            old = table.get(name)
            if old is None or old.agent_metadata == peer.agent_metadata:
                return original(manager, peer, *args, **kwargs)
            released = _release_peer_lists(manager, name)
            del table[name]
            try:
                manager.agent.remove_remote_agent(name)
            except Exception:  # noqa: BLE001 - NIXL may have dropped it already
                logger.debug("kvmem-sglang: NIXL had no remote agent %s to remove", name)
            out = original(manager, peer, *args, **kwargs)
            logger.info(
                "kvmem-sglang: decode peer %s registered again (its KV cache was "
                "released and resumed): its NIXL metadata reloaded, %d prepared "
                "list(s) over the old one released",
                name,
                released,
            )
            return out
    except Exception:  # noqa: BLE001 - the bootstrap thread must not die of one peer
        logger.exception(
            "kvmem-sglang: registering decode peer %s failed; it is kept "
            "without prepared transfer lists (its sends build descriptors "
            "per transfer)",
            name,
        )
        if name in getattr(manager, "decode_kv_args_table", {}):
            _release_peer_lists(manager, name)
        return None
