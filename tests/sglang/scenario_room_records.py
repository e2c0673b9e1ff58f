"""Part of tests/sglang/scenario_prefill_decode.py (its process, its real NIXL managers):
what the adapter remembers about rooms, and what it does with what a peer sends.

``pm`` is a real prefill-side ``NixlKVManager`` (its bootstrap thread running), ``dm`` a
real decode-side one (its listener thread reading status messages on ``dm.rank_port``).
Each case drives them as their peers and threads do: status messages cross ZMQ into the
decode's real listener; a decode's ABORT goes through the prefill's own
``_handle_abort_notification``; the bootstrap thread's steps for a room whose decode has
two endpoints are the statements sglang's bootstrap thread runs (``nixl/conn.py``, the
thread of ``_start_bootstrap_thread``), with the adapter's refusal of the room between two
of them, where the race put it.

Flag off, the same steps run on stock sglang (what the adapter's tables change is then
absent); the cases that call the adapter itself run with the flag only.
"""

from __future__ import annotations

import os
import time

FLAG = os.environ.get("SGLANG_KVMEM") == "1"
WAIT_S = 5.0


def _wait_for(pred, timeout: float = WAIT_S) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.002)
    return pred()


def run(pm, dm) -> dict:
    out = {"frames": _frames(dm), "aborts": _aborts(pm)}
    if FLAG:
        out["refused"] = _refused(pm, dm)
    return out


def _answer_of(dm, room) -> str:
    """What the decode's failure path answers a Failed ``room`` with: the answer the
    adapter's ``failure_exception`` hook hands over ("none": sglang's own 500)."""
    if not FLAG:
        return "none"
    from sglang.srt.disaggregation.common.conn import KVTransferError

    from kvmem_sglang.reasons import failure_answer

    with dm.failure_lock:
        reason = dm.failure_records.pop(room, None)
    answer = failure_answer(dm, room, KVTransferError(room, reason or ""))
    return "none" if answer is None else str(answer)


def _frames(dm) -> dict:
    """Status messages into the decode's real listener: a kvmem prefill's with its answer
    frame, and what a hostile or broken peer may send instead.  Each case's room is one
    the decode serves (WaitingForInput), except where the case says otherwise."""
    import zmq
    from sglang.srt.disaggregation.base.conn import KVPoll

    from kvmem_sglang.reasons import to_frame

    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.connect(f"tcp://{dm.local_ip}:{dm.rank_port}")
    tag, rooms = dm.kv_status_msg_tag, iter(range(9_000_000, 9_100_000))

    def failed(room: int, *extra: bytes) -> list:
        return [tag, str(room).encode(), str(int(KVPoll.Failed)).encode(), b"0", b"no", *extra]

    def deliver(room: int, msg: list) -> str:
        dm.update_status(room, KVPoll.WaitingForInput)  # as the decode's receiver does
        sock.send_multipart(msg)
        if not _wait_for(lambda: dm.check_status(room) == KVPoll.Failed):
            dm.request_status.pop(room, None)
            return "not failed"
        answer = _answer_of(dm, room)
        dm.request_status.pop(room, None)
        return answer

    cases = {
        "answer-503": [to_frame(503)],
        "answer-504": [to_frame(504)],
        "answer-abort": [to_frame("abort")],
        "no-frame": [],
        "status-999": [b"kvmem-sglang answer 999"],
        "status-200": [b"kvmem-sglang answer 200"],
        "spaced": [b"kvmem-sglang answer 503 "],
        "huge": [b"kvmem-sglang answer " + b"5" * 100_000],
        "frames-after": [to_frame(503), b"more", b"and more"],
        "empty": [b""],
    }
    got = {}
    for name, extra in cases.items():
        room = next(rooms)
        got[name] = deliver(room, failed(room, *extra))
    # garbage the listener must survive: too few frames, a room that is no number, an
    # answer frame for a room this decode does not serve; then a good message still lands
    for msg in (
        [tag],
        [tag, b"not a room", b"0", b"0", b"", to_frame(503)],
        [tag, b"123", b"zero", b"0"],
    ):
        sock.send_multipart(msg)
    unserved = next(rooms)
    sock.send_multipart(failed(unserved, to_frame(503)))
    room = next(rooms)
    got["after-garbage"] = deliver(room, failed(room, to_frame(504)))
    got["unserved-kept"] = str(_answer_of(dm, unserved))
    # a room that already failed here for its own abort keeps it
    room = next(rooms)
    dm.update_status(room, KVPoll.WaitingForInput)
    dm.record_failure(room, "Aborted by AbortReq.")
    dm.update_status(room, KVPoll.Failed)
    sock.send_multipart(failed(room, to_frame(503)))
    time.sleep(0.3)  # the listener applies it (it only overwrites the reason)
    got["own-abort-first"] = _answer_of(dm, room)
    dm.request_status.pop(room, None)
    sock.close(linger=0)
    return got


def _aborts(pm) -> dict:
    """A decode's ABORTs on the prefill: for a room not known yet, for a room that ended
    here, for one in flight, and a flood of them."""
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.common.conn import AbortNotification

    def abort(room: int) -> None:
        pm._handle_abort_notification(AbortNotification(room=room).to_zmq())

    got: dict = {}
    # not known yet: the sender that opens it later fails at once (an abort)
    abort(8_000_001)
    pm.update_status(8_000_001, KVPoll.Bootstrapping)
    got["early"] = [int(pm.check_status(8_000_001)), pm.failure_records.get(8_000_001)]
    pm.request_status.pop(8_000_001, None)
    pm.failure_records.pop(8_000_001, None)
    # ended here (a sender opened it, sglang's clear dropped it): an ABORT coming after
    # (the decode's repeats, a PD retraction's re-bootstrap of the room) leaves nothing,
    # and a new sender of the room bootstraps
    pm.update_status(8_000_002, KVPoll.Bootstrapping)
    pm.request_status.pop(8_000_002, None)  # CommonKVSender.clear
    abort(8_000_002)
    pm.update_status(8_000_002, KVPoll.Bootstrapping)
    got["ended_then_reopened"] = int(pm.check_status(8_000_002))
    pm.request_status.pop(8_000_002, None)
    # in flight: Failed, and its answer an abort
    pm.update_status(8_000_003, KVPoll.Bootstrapping)
    pm.update_status(8_000_003, KVPoll.WaitingForInput)
    abort(8_000_003)
    got["in_flight"] = int(pm.check_status(8_000_003))
    got["in_flight_answer"] = _answer_of(pm, 8_000_003)
    pm.request_status.pop(8_000_003, None)
    # malformed ABORTs (no room, not a number, 5,000 digits, a broken return address)
    from sglang.srt.disaggregation.common.conn import ABORT_TAG

    errors = []
    for msg in (
        [ABORT_TAG],
        [ABORT_TAG, b"no room"],
        [ABORT_TAG, b"9" * 5000],
        [ABORT_TAG, b"8000004", b"\xff", b"port", b"generation"],
    ):
        try:
            pm._handle_abort_notification(msg)
        except Exception as e:  # noqa: BLE001 - what would end the bootstrap thread
            errors.append(f"{type(e).__name__}: {e}")
    got["malformed_errors"] = errors
    # a flood: a hostile or broken decode's ABORTs for 20,000 rooms nobody opened
    for room in range(7_000_000, 7_020_000):
        abort(room)
    if FLAG:
        from kvmem_sglang import state

        got["flood_kept"] = len(state.EARLY_ABORTS.get(pm))
    return got


def _refused(pm, dm) -> dict:
    """A room the prefill refuses (its request arrived while the KV cache was released)
    while the bootstrap thread stores the decode's metadata of it, one endpoint of two in;
    and one refused after all of its metadata came.  The decode is told (its listener
    shows the room Failed with the refusal's answer), and the prefill keeps nothing."""
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.nixl.conn import TransferInfo

    from kvmem_sglang import notify
    from kvmem_sglang.reasons import Told

    import numpy as np

    def info(room: int, agent: str) -> TransferInfo:
        return TransferInfo(
            room=room,
            endpoint=dm.local_ip,
            dst_port=dm.rank_port,
            agent_name=agent,
            dst_kv_indices=np.zeros(0, dtype=np.int32),
            dst_aux_index=0,
            required_dst_info_num=2,
            dst_state_indices=[],
        )

    got: dict = {}
    refused = Told("Prefill server released its KV cache; refused", 503)
    for name, room, refuse_after in (("partial", 8_100_001, 1), ("complete", 8_100_002, 2)):
        dm.update_status(room, KVPoll.WaitingForInput)  # the decode waits for the room
        infos = pm.transfer_infos
        error = None
        for n, agent in enumerate(("decode-a", "decode-b"), start=1):
            try:  # the bootstrap thread's statements for one endpoint's metadata
                if room not in infos:
                    infos[room] = {}
                if n == refuse_after + 1:
                    notify.refuse_room(pm, room, refused)  # the scheduler, in between
                infos[room][agent] = info(room, agent)
                if len(infos[room]) == 2:
                    pm.update_status(room, KVPoll.WaitingForInput)
            except Exception as e:  # noqa: BLE001 - what killed the bootstrap thread
                error = f"{type(e).__name__}: {e}"
                break
        if refuse_after == 2:
            notify.refuse_room(pm, room, refused)
        told = _wait_for(lambda r=room: dm.check_status(r) == KVPoll.Failed)
        got[name] = {
            "bootstrap_thread_error": error,
            "decode_told": told,
            "decode_answer": _answer_of(dm, room) if told else None,
            "prefill_keeps": [
                room in pm.transfer_infos,
                room in pm.request_status,
                room in pm.req_to_decode_prefix_len,
            ],
        }
        dm.request_status.pop(room, None)
    return got
