"""Run by tests/sglang/test_conformance.py in a process of its own, flag off or on
(``SGLANG_KVMEM``): every case of the PD contract (kvmem/lifecycle.py) that a prefill
scheduler meets, through one real PD prefill scheduler (``prefill_env.PrefillHarness``),
one after the other, recording what the client got, whether the decode was told (the KV
sender aborted) and what stays held once the case settled.  Prints one JSON object on its
last line: case id -> what it did."""

from __future__ import annotations

import json
import sys
import time
import traceback

from kvmem.lifecycle import Cause, State
from tests.sglang.prefill_env import PrefillHarness

TRANSFER_TIMEOUT = 0.3  # SGLANG_DISAGGREGATION_TRANSFER_TIMEOUT set by the test
BOOTSTRAP_TIMEOUT = 1  # SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT (sglang reads an int)

# the cases a prefill scheduler meets, each driven below
DRIVEN = (
    (Cause.CLIENT_ABORT, State.BOOTSTRAPPING),
    (Cause.CLIENT_ABORT, State.WAITING),
    (Cause.CLIENT_ABORT, State.IN_BATCH),
    (Cause.CLIENT_ABORT, State.TRANSFERRING),
    (Cause.BOOTSTRAP_TIMEOUT, State.BOOTSTRAPPING),
    (Cause.TRANSFER_TIMEOUT, State.WAITING),
    (Cause.TRANSFER_TIMEOUT, State.TRANSFERRING),
    (Cause.SEND_FAILED, State.TRANSFERRING),
    (Cause.PREFILL_RELEASE, State.ARRIVING),
    (Cause.PREFILL_RELEASE, State.BOOTSTRAPPING),
    (Cause.PREFILL_RELEASE, State.WAITING),
    (Cause.PREFILL_RELEASE, State.IN_BATCH),
    (Cause.PREFILL_RELEASE, State.TRANSFERRING),
    (Cause.STALE_SEND, State.IN_BATCH),
)


def _forward_held(h, rid: str, hold):
    """Bootstrap ``rid``, run its forward and leave its sender in ``hold``; the loop
    iteration ends with a poll of the inflight queue and no last batch."""
    h.pop_bootstrapped()
    batch = h.launch()
    h.sender(rid).hold = hold
    h.finish_forward(batch)
    h.inflight()
    h.s.last_batch = None


def _call(fn):
    try:
        fn()
        return None
    except Exception:  # what sglang's loop would die of: recorded, the case goes on
        return traceback.format_exc(limit=3)


def meet(h, cause: Cause, state: State, rid: str) -> list:
    """Bring request ``rid`` to ``state`` and let ``cause`` meet it there; the errors
    sglang's paths raised on the way (a scheduler loop would die of any)."""
    from sglang.srt.disaggregation.base.conn import KVPoll as K

    errors: list = []

    def call(fn):
        e = _call(fn)
        if e is not None:
            errors.append(e)

    if state is State.ARRIVING:  # a release meets a request before it has a sender
        call(h.release)
        h.submit(rid, 9)
        call(h.resume)
        return errors
    if state is State.BOOTSTRAPPING:
        h.submit(rid, 9, hold=K.Bootstrapping)
        h.step()
        h.s.last_batch = None
    elif state is State.WAITING:
        h.submit(rid, 9, hold=K.WaitingForInput if cause is Cause.TRANSFER_TIMEOUT else None)
        if cause is Cause.TRANSFER_TIMEOUT:  # its forward ran, its sender waits for input
            _forward_held(h, rid, K.WaitingForInput)
        else:  # bootstrapped (metadata slot taken), not yet in a batch
            h.pop_bootstrapped()
    elif state is State.TRANSFERRING:
        h.submit(rid, 9)
        _forward_held(h, rid, K.Transferring)
    elif state is State.IN_BATCH:
        h.submit(rid, 9)
        h.pop_bootstrapped()
        batch = h.launch()  # its forward runs
        if cause is Cause.CLIENT_ABORT:
            h.abort(rid)
        elif cause is Cause.PREFILL_RELEASE:
            call(h.release)
        elif cause is Cause.STALE_SEND:  # released and resumed while its forward ran
            call(h.release)
            call(h.resume)
        h.sender(rid).hold = K.Transferring
        call(lambda: h.finish_forward(batch))
        call(h.inflight)
        h.s.last_batch = None
        if cause is Cause.PREFILL_RELEASE:
            call(h.resume)
        return errors
    # the cause meets the request in its state
    if cause is Cause.CLIENT_ABORT:
        h.abort(rid)
    elif cause is Cause.BOOTSTRAP_TIMEOUT:
        time.sleep(BOOTSTRAP_TIMEOUT + 0.1)
    elif cause is Cause.TRANSFER_TIMEOUT:
        time.sleep(TRANSFER_TIMEOUT + 0.1)
    elif cause is Cause.SEND_FAILED:
        h.sender(rid).fail(f"a write of {rid}'s KV failed")
    elif cause is Cause.PREFILL_RELEASE:
        call(h.release)
        call(h.resume)
    else:
        raise AssertionError((cause, state))
    call(h.inflight)
    call(h.step)
    h.s.last_batch = None
    call(h.step)
    h.s.last_batch = None
    return errors


def main() -> dict:
    h = PrefillHarness(page_size=4, pages=64, max_reqs=8)
    out: dict = {"kvmem": _kvmem_on(), "cases": {}}
    for cause, state in DRIVEN:
        cid = f"{cause.name.lower()}-{state.name.lower()}"
        errors = meet(h, cause, state, cid)
        sender = h.sender(cid)
        answered = [
            {"type": r.get("type"), "status": _code(r), "message": r.get("message")}
            for _, r in h.outbox.answers.get(cid, [])
        ]
        # let every held sender finish and the loop run dry: the next case starts clean
        for req in h.reqs.values():
            if req.disagg_kv_sender is not None:
                req.disagg_kv_sender.hold = None
        for _ in range(4):
            errors += [e for e in [_call(h.step)] if e is not None]
            h.s.last_batch = None
        out["cases"][cid] = {
            "answers": answered,
            "answers_settled": len(h.outbox.answers.get(cid, [])),
            "decode_told": None if sender is None else sender.aborts,
            "sender_failed": sender is not None and sender.failure_reason is not None,
            "errors": errors,
            "held": h.held(),
            "queues": h.queues(),
        }
        if h.wu.offload_tags:  # stock: a release that raised half-way left tags behind
            _call(h.resume)
    return out


def _code(reason: dict):
    code = reason.get("status_code")
    if reason.get("type") == "abort":
        return int(code) if code is not None else "abort"
    return 200


def _kvmem_on() -> bool:
    try:
        from kvmem_sglang import state

        return state.PROCESS.options.is_active()
    except ImportError:
        return False


if __name__ == "__main__":
    result = main()
    sys.stdout.flush()
    print(json.dumps(result, default=str))
