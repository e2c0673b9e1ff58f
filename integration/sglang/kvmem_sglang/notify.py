"""The decode side is told when the prefill aborts a KV sender.

sglang 0.5.23 (the installed package; paths below are under ``sglang/srt/disaggregation/``):

* ``CommonKVSender.abort`` (common/conn.py) records "Aborted by AbortReq." and marks the
  room Failed in the *prefill's* own table; it sends nothing.  The failure path that
  follows (``failure_exception`` -> ``clear``, both of ``CommonKVSender``) drops the room;
  ``clear`` tells the decode only under ``--disaggregation-decode-allocation-policy
  prefill_complete`` (the default is ``early``).  A transfer worker that later dequeues a
  chunk of the room skips it silently (the cleared-room and Failed checks at the top of
  ``NixlKVManager.transfer_worker``'s loop, nixl/conn.py).
* The decode learns a room's end only from a status message
  (``CommonKVManager.apply_prefill_status``, common/conn.py, called from NIXL's listener
  thread, ``NixlKVManager._start_decode_listener_thread``), from its heartbeat to a *dead*
  prefill (``CommonKVManager._start_heartbeat_checker_thread``), or from its own waiting
  timeout: its receiver stays WaitingForInput until
  ``SGLANG_DISAGGREGATION_WAITING_TIMEOUT`` (default 300 s) after ``send_metadata``
  (``CommonKVReceiver._check_waiting_timeout``), holding the KV pages and the metadata
  slot it pre-allocated for the request all that time.
* A room aborted while Bootstrapping whose decode metadata arrives afterwards: the
  prefill's bootstrap thread stores its ``transfer_infos`` and ``update_status(room,
  WaitingForInput)`` re-creates the cleared room (the thread of
  ``NixlKVManager._start_bootstrap_thread``, nixl/conn.py;
  ``CommonKVManager.update_status`` lets a room's opening status create it); both stay for
  good on the prefill, and the decode again waits out its waiting timeout.

With SGLANG_KVMEM=1:

* ``sender_abort`` (around ``CommonKVSender.abort``, so every caller: the adapter's
  transfer timeout and release, ``Scheduler.abort_request``, sglang's own retire paths):
  a room that was Bootstrapping, WaitingForInput or Transferring has Failed, with the
  reason, pushed to every decode endpoint of the room on sglang's status channel
  (``send_kv_status_message``, the message its transfer workers send on a failure).  The
  decode's receiver reports Failed at its next poll; its transfer queue answers the
  request and, with deferred KV release (sglang's default), sends ABORT and frees the pages
  at the prefill's ABORT_ACK, which the prefill sends only once no write of the room is
  outstanding (``CommonKVManager._maybe_ack_drained_abort``).  Without deferred release on
  the manager and with a write still outstanding, nothing is sent (the decode would free
  pages the NIC may still write): the decode falls back to its waiting timeout, as sglang
  arranges for an unsettled write (``NixlKVManager.transfer_worker`` poisons the room's
  ACK and leaves it to that timeout).  Success or an already Failed room is not touched (a
  Failed one was told, or must not be).
* ``manager_update_status`` (around ``CommonKVManager.update_status``): the decode
  metadata of a room aborted while Bootstrapping is answered Failed and dropped, instead of
  re-creating the room.
* :func:`refuse_room`: a request the prefill refuses on arrival (its KV cache is
  released) never gets a sender; its decode, which the router asked at the same time and
  which waits for the room's KV, is sent Failed at once if its metadata is all in (the
  bootstrap thread moved the room to WaitingForInput), else when the last of it comes
  (the room is remembered as aborted).  Only the bootstrap thread that stores a room's
  ``transfer_infos`` drops them while they are incomplete: it reads them back between
  its statements (``MooncakeKVManager``'s and ``NixlKVManager``'s bootstrap threads), and
  a room dropped there by another thread raised ``KeyError`` and ended that thread.  A
  new sender for the same room (its ``Bootstrapping``) forgets the record.

* ``abort_notification`` (around the NIXL and mooncake managers'
  ``_handle_abort_notification``): a decode's ABORT for a room the prefill does not know
  yet (its request has not reached the prefill's scheduler, a race the router's
  simultaneous dispatch makes common) is ignored by sglang, and the prefill's request
  later bootstraps alone until its bootstrap timeout (300 s), while the router waits for
  the prefill's answer: the client hangs.  The room is remembered, and the sender that
  later opens it (``manager_update_status``, its ``Bootstrapping``) is failed at once with
  the decode's reason.  An ABORT for a room a sender of this prefill opened lately
  (:data:`kvmem_sglang.state.OPENED`) is not remembered: that room ended here, and the
  record would fail the next sender that reuses the room (sglang's PD retraction
  re-bootstraps a request under its room).  An ABORT that fails a room this prefill is
  serving leaves the room's answer, an abort, for sglang's failure path
  (:data:`kvmem_sglang.state.ANSWERS`; Mooncake records no reason for it).

The rooms these hooks remember (:class:`kvmem_sglang.rooms.Rooms`) come from peers and
clients: each record is kept at most :data:`kvmem_sglang.rooms.KEEP_S` seconds and at
most :data:`kvmem_sglang.rooms.ROOM_LIMIT` of them per manager, at O(1) amortized cost per message.

The messages leave on one background thread: a send to a dead decode may block for
``SGLANG_DISAGGREGATION_ZMQ_SEND_TIMEOUT`` and must not stall the scheduler loop.  Each
carries the request's answer in a frame of its own after sglang's
(:mod:`kvmem_sglang.reasons`), never in its text.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from kvmem_sglang import state
from kvmem_sglang.reasons import ABORT, EARLY_ABORT, Told, to_frame
from kvmem_sglang.rooms import rooms_of

logger = logging.getLogger("kvmem.sglang")


@dataclass
class NotifyStats:
    told: int = 0  # aborted rooms whose decode endpoints were sent Failed
    told_late: int = 0  # late decode metadata of a room aborted while bootstrapping
    not_told_writing: int = 0  # aborts left to the decode's timeout (write outstanding)
    early_aborts: int = 0  # senders failed at once: their decode aborted the room first


STATS = NotifyStats()


def abort_notification(original, mgr, msg, *args, **kwargs):
    """Remember a decode's ABORT for a room this prefill does not know yet, and the
    answer of a room it fails (module docstring); sglang's own handling runs as
    before."""
    room = before = None
    try:
        from sglang.srt.disaggregation.common.conn import ABORT_TAG, AbortNotification

        if _is_prefill(mgr) and msg and msg[0] == ABORT_TAG:
            note = AbortNotification.from_zmq(msg)
            if note is not None:
                room = note.room
                before = mgr.request_status.get(room)
                if before is None and room not in rooms_of(state.OPENED, mgr):
                    rooms_of(state.EARLY_ABORTS, mgr).put(room, True)
    except Exception:  # noqa: BLE001 - sglang's handling below still runs
        logger.exception("kvmem-sglang: reading a decode's abort notification failed")
    out = original(mgr, msg, *args, **kwargs)
    if room is not None and before is not None:
        try:
            from sglang.srt.disaggregation.base.conn import KVPoll

            if before not in (KVPoll.Success, KVPoll.Failed) and (
                mgr.request_status.get(room) == KVPoll.Failed
            ):
                rooms_of(state.ANSWERS, mgr).put(room, ABORT)
        except Exception:  # noqa: BLE001 - sglang's own status stands
            logger.exception("kvmem-sglang: keeping the answer of room %s failed", room)
    return out


def _is_prefill(mgr) -> bool:
    from sglang.srt.disaggregation.utils import DisaggregationMode

    return getattr(mgr, "disaggregation_mode", None) == DisaggregationMode.PREFILL


def _send(mgr, targets, room: int, told: Told) -> None:
    """Send ``targets`` room's Failed status with ``told``'s message, and its answer in a
    frame of its own, off the calling thread."""
    state.PROCESS.notify.submit(_send_now, mgr, list(targets), room, told)


def _send_now(mgr, targets, room: int, told: Told) -> None:
    """sglang's ``send_kv_status_message`` with the answer's frame after its frames
    (the reason's frame first, empty where the backend sends none)."""
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.utils.network import NetworkAddress

    parts = mgr._encode_kv_status_message(
        bootstrap_room=room, status=KVPoll.Failed, failure_reason=told.message
    )
    if told.answer is not None:
        if not mgr.kv_status_msg_carries_reason:
            parts.append(b"")
        parts.append(to_frame(told.answer))
    for endpoint, port in targets:
        address = NetworkAddress(endpoint, port)
        try:
            mgr._send_multipart_locked(address.to_tcp(), parts, is_ipv6=address.is_ipv6)
        except Exception as e:  # noqa: BLE001 - as sglang's own send: that decode times out
            logger.warning(
                "kvmem-sglang: telling decode %s that room %s failed did not go: %s",
                address.to_host_port_str(),
                room,
                e,
            )


def _remember(mgr, room: int, told: Told | None = None) -> None:
    """Remember ``room`` as aborted before its decode metadata came, with what to tell
    its decode (None: the generic reason)."""
    rooms_of(state.ABORTED_ROOMS, mgr).put(room, told)


def sender_abort(original, sender, *args, **kwargs):
    mgr = getattr(sender, "kv_mgr", None)
    room = getattr(sender, "bootstrap_room", None)
    status = getattr(mgr, "request_status", None)
    before = status.get(room) if status is not None and _is_prefill(mgr) else None
    concluded = getattr(sender, "conclude_state", None)
    out = original(sender, *args, **kwargs)
    if before is None:
        return out
    try:  # telling the decode is best effort: never an exception out of abort()
        _tell(sender, mgr, room, before, concluded)
    except Exception:  # noqa: BLE001 (callers such as abort_request run in the loop)
        logger.exception(
            "kvmem-sglang: telling the decode of room %s's abort failed; it "
            "falls back to its waiting timeout",
            room,
        )
    return out


def _tell(sender, mgr, room, before, concluded) -> None:
    """sender_abort's notification, after sglang's abort ran (module docstring)."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    if concluded is not None or before not in (
        KVPoll.Bootstrapping,
        KVPoll.WaitingForInput,
        KVPoll.Transferring,
    ):
        return
    if mgr.request_status.get(room) != KVPoll.Failed:
        return  # sglang declined the abort (a room it does not own)
    # the adapter's reason where it decided the abort (reasons.decide), else sglang's own
    # record ("Aborted by AbortReq.": a client's abort), answered as an abort
    why = state.ABORT_WHY.get(sender) or Told(mgr.failure_records.get(room) or "Aborted", ABORT)
    if before == KVPoll.Bootstrapping:
        _remember(
            mgr,
            room,
            Told(
                f"Prefill aborted room {room} while bootstrapping ({why.message}); "
                "its decode metadata came after the abort",
                why.answer,
            ),
        )
    targets = mgr._room_notify_targets(room)
    if not targets:
        return
    if mgr._staging_outstanding.get(room, 0) > 0 and not mgr.enable_deferred_decode_kv_release:
        STATS.not_told_writing += 1
        logger.warning(
            "kvmem-sglang: room %s aborted with a write still outstanding and "
            "no deferred decode KV release: its decode is not told (it "
            "falls back to its waiting timeout)",
            room,
        )
        return
    name = {
        KVPoll.Bootstrapping: "Bootstrapping",
        KVPoll.WaitingForInput: "WaitingForInput",
        KVPoll.Transferring: "Transferring",
    }[before]
    told = Told(
        f"Prefill aborted the KV transfer of room {room} in {name} ({why.message})", why.answer
    )
    STATS.told += 1
    logger.info("kvmem-sglang: %s; telling decode %s", told.message, targets)
    _send(mgr, targets, room, told)


def refuse_room(mgr, room, told: Told) -> None:
    """A room whose request the prefill answered before creating its sender: tell its
    decode Failed with ``told`` now if the decode's metadata for the room is all here
    (the bootstrap thread is done with the room), and else when it is (remembered:
    :func:`manager_update_status`).  Best effort, never raises."""
    if mgr is None or room is None or not _is_prefill(mgr):
        return
    try:
        rooms = rooms_of(state.ABORTED_ROOMS, mgr)
        with rooms.guard:  # against manager_update_status's check on the bootstrap thread
            rooms.put(room, told)
            # WaitingForInput is the bootstrap thread's last step for a room whose metadata
            # is all in: from then on it no longer reads the room's transfer_infos (module
            # docstring); before, the metadata still coming ends in manager_update_status
            if mgr.request_status.get(room) != _waiting():
                return
            rooms.pop(room)  # told now
        targets = mgr._room_notify_targets(room)
        mgr.transfer_infos.pop(room, None)
        mgr.req_to_decode_prefix_len.pop(room, None)
        mgr.request_status.pop(room, None)  # left by the bootstrap thread
        if targets:
            STATS.told += 1
            logger.info("kvmem-sglang: %s; telling decode %s", told.message, targets)
            _send(mgr, targets, room, told)
    except Exception:  # noqa: BLE001 - the request is answered; the decode may time out
        logger.exception(
            "kvmem-sglang: telling the decode of refused room %s failed; it "
            "falls back to its waiting timeout",
            room,
        )


def _waiting():
    from sglang.srt.disaggregation.base.conn import KVPoll

    return KVPoll.WaitingForInput


def manager_update_status(original, mgr, bootstrap_room, status, *args, **kwargs):
    from sglang.srt.disaggregation.base.conn import KVPoll

    if status == KVPoll.Bootstrapping and _is_prefill(mgr):  # a sender opens the room
        rooms_of(state.OPENED, mgr).put(bootstrap_room, True)
    early = state.EARLY_ABORTS.get(mgr)
    if early is not None and status == KVPoll.Bootstrapping and early.pop(bootstrap_room):
        # the sender of a room its decode aborted
        out = original(mgr, bootstrap_room, status, *args, **kwargs)
        STATS.early_aborts += 1
        logger.info(
            "kvmem-sglang: room %s was aborted by its decode before its request "
            "reached this prefill; its sender fails now",
            bootstrap_room,
        )
        mgr.record_failure(bootstrap_room, EARLY_ABORT)
        original(mgr, bootstrap_room, KVPoll.Failed, *args, **kwargs)
        return out
    rooms = state.ABORTED_ROOMS.get(mgr)
    if rooms is None or status not in (KVPoll.Bootstrapping, KVPoll.WaitingForInput):
        return original(mgr, bootstrap_room, status, *args, **kwargs)
    # refuse_room records a room and reads its status under the guard: it finds either the
    # room's WaitingForInput or its record taken here, never neither
    with rooms.guard:
        if bootstrap_room not in rooms:
            return original(mgr, bootstrap_room, status, *args, **kwargs)
        if status == KVPoll.Bootstrapping:  # a new sender: a new lifecycle of the room
            rooms.pop(bootstrap_room)
        elif status == KVPoll.WaitingForInput and mgr.request_status.get(bootstrap_room) in (
            None,
            KVPoll.Failed,
        ):
            told = rooms.pop(bootstrap_room) or Told(
                f"Prefill aborted room {bootstrap_room} while "
                "bootstrapping; its decode metadata came after the abort",
                None,
            )
            targets = mgr._room_notify_targets(bootstrap_room)
            mgr.transfer_infos.pop(bootstrap_room, None)
            mgr.req_to_decode_prefix_len.pop(bootstrap_room, None)
            STATS.told_late += 1
            logger.info("kvmem-sglang: %s; telling decode %s", told.message, targets)
            if targets:
                _send(mgr, targets, bootstrap_room, told)
            return None
    return original(mgr, bootstrap_room, status, *args, **kwargs)
