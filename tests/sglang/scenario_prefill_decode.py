"""Run by tests/sglang/test_prefill_decode.py in a process of its own, flag off or on: a
real PD prefill scheduler (``prefill_env.PrefillHarness``, chunked prefill) whose
bootstrap queue holds a real prefill-side ``NixlKVManager`` (its own ``__init__``: NIXL
agent over UCX on DRAM, transfer workers, bootstrap thread, registration with the
bootstrap server), its senders real ``NixlKVSender``s; a real decode-side
``NixlKVManager`` (listener and heartbeat threads) over its own KV pool and metadata
buffers, with one real ``NixlKVReceiver`` per request; sglang's real
``NixlKVBootstrapServer`` (aiohttp) on a localhost port.  The decode fetches the
prefill's parallel info, bootstraps each request, pre-allocates its KV pages and a
metadata slot and publishes them (``send_metadata``): the prefill's bootstrap thread
then moves the room to WaitingForInput, exactly as between two servers.

Four requests, each aborted on the prefill in one state:

* ``xfer``:  Transferring: its first chunk was written into the decode's pages by a
  transfer worker (real NIXL WRITE), its last chunk is queued; client abort;
* ``wait``:  WaitingForInput: its only chunk is queued, none written; client abort;
* ``boot``:  Bootstrapping: the client aborts before the decode's metadata arrives; the
  decode publishes its pre-allocated pages afterwards;
* ``late``:  WaitingForInput for longer than ``SGLANG_DISAGGREGATION_TRANSFER_TIMEOUT``
  (1.2 s): the adapter's transfer timeout (flag on; stock never aborts it).

What is stood in: the transfer workers' backlog.  The chunks of ``wait``/``late`` and the
last chunk of ``xfer`` are put on queues no worker reads (``transfer_queues`` swapped for
fresh ``FastQueue``s, as a worker still busy with other rooms would leave them); the
workers themselves, and the first chunk of ``xfer``, are real.  One more environment
shim: the NIXL wheel installed here is ``nixl_cu12``, which sglang imports as ``nixl``.

Then the decode polls its receivers as its transfer queue does, for up to
``WATCH_S``, with ``SGLANG_DISAGGREGATION_WAITING_TIMEOUT`` = 3 s.  For each request:
when its receiver reported Failed and why (``failure_exception``); then what the decode's
transfer queue does for a Failed poll with deferred KV release (sglang's default):
``ensure_abort_notified(force_arm=True)`` (ABORT to the prefill), and when the prefill's
ABORT_ACK makes ``is_abort_release_safe`` true, the moment ``resolve_deferred_releases``
frees the pre-allocated pages and metadata slot (decode.py:3046-3060).  Also what the
prefill still holds for each room afterwards.  Prints one JSON object on its last line
and leaves with ``os._exit`` (sglang's prefill bootstrap thread is not a daemon).
"""

from __future__ import annotations

import os
import time
from http import HTTPStatus

from testkit.sglang_pair import kv_args, nixl_as_sglang_imports_it
from tests.sglang.sglang_env import make_req, script_main

WAITING_TIMEOUT_S = 3  # the decode's SGLANG_DISAGGREGATION_WAITING_TIMEOUT (an int)
TRANSFER_TIMEOUT_S = 1.2  # the adapter's SGLANG_DISAGGREGATION_TRANSFER_TIMEOUT
WATCH_S = 4.5  # how long the decode is watched after the aborts
PAGE = 4


def _wait_for(pred, timeout: float = 5.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.002)
    return pred()


def main() -> dict:
    os.environ["SGLANG_DISAGGREGATION_WAITING_TIMEOUT"] = str(WAITING_TIMEOUT_S)
    os.environ["SGLANG_DISAGGREGATION_TRANSFER_TIMEOUT"] = str(TRANSFER_TIMEOUT_S)
    nixl_as_sglang_imports_it()
    from tests.sglang.prefill_env import PrefillHarness

    h = PrefillHarness(page_size=PAGE, pages=64, max_reqs=8, chunk_pages=2)
    import numpy as np
    import torch
    from sglang.srt.disaggregation import prefill as P
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.common.utils import FastQueue
    from sglang.srt.disaggregation.nixl.conn import (
        NixlKVManager,
        NixlKVReceiver,
        NixlKVSender,
    )
    from sglang.srt.disaggregation.utils import (
        DisaggregationMode,
        MetadataBuffers,
        ReqToMetadataIdxAllocator,
        TransferBackend,
        get_kv_class,
    )
    from sglang.srt.runtime_context import get_disagg, get_parallel
    from testkit.sglang_pair import bootstrap_server
    from tests.sglang.sglang_env import build_pools

    get_parallel().override_permanently(pp_group=None)  # pp_size 1: never used
    _server, port = bootstrap_server("nixl")  # sglang's NixlKVBootstrapServer
    get_disagg()._set("disaggregation_bootstrap_port", port)  # this process's server
    addr = f"127.0.0.1:{port}"

    # -- the prefill: the harness's scheduler over a real NIXL manager and real senders ----
    pm = NixlKVManager(
        kv_args(h.kv, h.s.disagg_metadata_buffers),
        DisaggregationMode.PREFILL,
        h.s.server_args,
        False,
    )
    queue = h.s.disagg_prefill_bootstrap_queue
    queue.kv_manager, queue.transfer_backend = pm, TransferBackend.NIXL
    P.get_kv_class = get_kv_class  # create_sender: sglang's NixlKVSender again
    real_queues = pm.transfer_queues
    backlog = [FastQueue() for _ in real_queues]  # read by no worker

    # -- the decode: its own pool, metadata buffers and NIXL manager -------------------------
    _, dkv, dalloc, _ = build_pools(page_size=PAGE, size=PAGE * 64, max_reqs=8)
    dmeta = MetadataBuffers(
        16, hidden_size=32, hidden_states_dtype=torch.bfloat16, max_sampling_mask_tokens=0
    )
    dslots = ReqToMetadataIdxAllocator(16)
    dm = NixlKVManager(kv_args(dkv, dmeta), DisaggregationMode.DECODE, h.s.server_args, False)
    assert dm.try_ensure_parallel_info(addr)  # DecodePreallocQueue._ensure_prefill_info
    assert dm.enable_deferred_decode_kv_release
    free_pages_at_start = int(dalloc.available_size())
    recv, held = {}, {}

    def decode_bootstrap(rid, n_tokens):
        room = h.reqs[rid].bootstrap_room
        r = NixlKVReceiver(dm, addr, room)
        r.init(0)
        recv[rid] = r
        held[rid] = (dalloc.alloc(-(-n_tokens // PAGE) * PAGE), dslots.alloc())

    def decode_publish(rid):
        pages, slot = held[rid]
        page_ids = np.asarray(pages[::PAGE].tolist(), dtype=np.int32) // PAGE
        recv[rid].send_metadata(page_ids, aux_index=slot)

    def prefill_status(rid):
        return pm.request_status.get(h.reqs[rid].bootstrap_room)

    sizes = {"late": 5, "xfer": 12, "wait": 5, "boot": 5}
    out = {"states_at_abort": {}, "answers": {}}
    published, aborted, failed, reasons, safe, errors = {}, {}, {}, {}, {}, {}
    answered: dict = {}

    def decode_answer(rid, room, error) -> dict:
        """What the decode's transfer queue answers next, on this thread (decode.py:2885:
        sglang's ``prepare_abort(req, message, 500)``, through the adapter's hook when the
        flag is on), for a decode request of the room."""
        from sglang.srt.disaggregation import utils

        req = make_req(rid, 4)
        req.bootstrap_room = room
        message = (
            f"Decode transfer failed for request rank=0 {req.rid=} {req.bootstrap_room=} "
            f"with exception {error}"
        )
        utils.prepare_abort(req, message, status_code=HTTPStatus.INTERNAL_SERVER_ERROR)
        got = req.finished_reason.to_json()
        return {"type": got["type"], "status_code": got["status_code"]}

    def decode_poll():
        """What the decode's transfer queue does each step (pop_transferred for a Failed
        poll with deferred KV release, resolve_deferred_releases once drained)."""
        for rid, r in recv.items():
            room = h.reqs[rid].bootstrap_room
            if rid in published and rid not in failed and r.poll() == KVPoll.Failed:
                failed[rid] = time.monotonic()
                r.ensure_abort_notified(force_arm=True)  # decode.py:2899-2906
                try:
                    r.failure_exception()
                except Exception as e:  # KVTransferError: the decode's answer carries it
                    reasons[rid] = getattr(e, "failure_reason", str(e))
                    errors[rid] = str(e)  # what sglang's failure path puts in its answer
                    answered[rid] = decode_answer(rid, room, e)
            if rid in failed and rid not in safe and dm.is_abort_release_safe(room, 1):
                safe[rid] = time.monotonic()
                pages, slot = held[rid]  # what resolve_deferred_releases frees now
                dalloc.free(pages)
                dslots.free(slot)

    def step():
        h.loop_step()
        decode_poll()

    def publish(rid):
        decode_publish(rid)
        published[rid] = time.monotonic()

    def wait_status(rid, state):
        assert _wait_for(lambda: prefill_status(rid) == state), (rid, prefill_status(rid))

    # late: one chunk, queued; left in flight (the adapter's transfer timeout)
    h.submit("late", sizes["late"])
    decode_bootstrap("late", sizes["late"])
    pm.transfer_queues = backlog
    publish("late")
    wait_status("late", KVPoll.WaitingForInput)
    step()
    # xfer: chunk 1 (2 pages) written by a real worker, the last chunk queued
    pm.transfer_queues = real_queues
    h.submit("xfer", sizes["xfer"])
    decode_bootstrap("xfer", sizes["xfer"])
    publish("xfer")
    wait_status("xfer", KVPoll.WaitingForInput)
    step()  # chunk 1's forward: it "computed" its KV (a pattern the decode must receive)
    xtok = h.req_pool.req_to_token[h.reqs["xfer"].kv.req_pool_idx, :8].long()
    for layer in range(len(h.kv.k_buffer)):
        h.kv.k_buffer[layer][xtok] = 7.0
        h.kv.v_buffer[layer][xtok] = -3.0
    batch = h.schedule()  # process_prefill_chunk sends chunk 1; chunk 2 admitted
    xroom = h.reqs["xfer"].bootstrap_room
    assert _wait_for(
        lambda: (
            prefill_status("xfer") == KVPoll.Transferring
            and pm._staging_outstanding.get(xroom, 0) == 0
        )
    )
    dtok = held["xfer"][0].long()
    out["xfer_decode_pages"] = {  # chunk 1 landed, chunk 2 did not
        "chunk1_k": sorted(set(dkv.k_buffer[1][dtok[:8]].float().flatten().tolist())),
        "chunk1_v": sorted(set(dkv.v_buffer[0][dtok[:8]].float().flatten().tolist())),
        "chunk2_k": sorted(set(dkv.k_buffer[1][dtok[8:]].float().flatten().tolist())),
    }
    pm.transfer_queues = backlog
    h.finish_forward(batch)
    h.inflight()
    h.s.last_batch = batch
    # wait: one chunk, queued
    h.submit("wait", sizes["wait"])
    decode_bootstrap("wait", sizes["wait"])
    publish("wait")
    wait_status("wait", KVPoll.WaitingForInput)
    step()
    # boot: the decode has bootstrapped and pre-allocated; its metadata is not sent yet
    h.submit("boot", sizes["boot"])
    decode_bootstrap("boot", sizes["boot"])
    out["queues_before_abort"] = h.queues()
    for rid in ("xfer", "wait", "boot"):
        out["states_at_abort"][rid] = prefill_status(rid)
        h.abort(rid)
        aborted[rid] = time.monotonic()
    step()  # the failure paths: bootstrap failure, inflight Failed
    publish("boot")  # the decode's metadata arrives after the abort
    out["states_at_abort"]["late"] = prefill_status("late")
    end = published["late"] + WATCH_S
    while time.monotonic() < end and len(safe) < len(recv):
        step()
        time.sleep(0.005)

    def rel(times, since):
        return {rid: round(t - since[rid], 3) for rid, t in times.items() if rid in since}

    out["decode_failed_after_publish_s"] = rel(failed, published)
    out["decode_failed_after_abort_s"] = rel(failed, aborted)
    out["decode_reasons"] = reasons
    out["decode_errors"] = errors
    out["decode_answers"] = answered
    out["decode_release_safe_after_publish_s"] = rel(safe, published)
    out["decode_pages_held_at_end"] = free_pages_at_start - int(dalloc.available_size())
    out["prefill_rooms_left"] = {
        rid: {
            "status": pm.request_status.get(req.bootstrap_room),
            "transfer_infos": req.bootstrap_room in pm.transfer_infos,
        }
        for rid, req in h.reqs.items()
    }
    for rid in h.reqs:
        got = h.outbox.answers.get(rid, [])
        out["answers"][rid] = [[k, r.get("status_code")] for k, r in got]

    # boom: telling the decode fails (its notify targets cannot be read): the abort
    # itself still goes through and the request is answered once (best effort)
    h.submit("boom", sizes["wait"])
    decode_bootstrap("boom", sizes["wait"])
    publish("boom")
    wait_status("boom", KVPoll.WaitingForInput)
    step()
    real_targets = pm._room_notify_targets

    def no_targets(room):
        raise RuntimeError("kvmem test: notify targets unreadable")

    pm._room_notify_targets = no_targets
    try:
        h.abort("boom")
        out["boom_abort"] = "returned"
    except BaseException as e:  # noqa: BLE001
        out["boom_abort"] = f"{type(e).__name__}: {e}"
    finally:
        pm._room_notify_targets = real_targets
    out["boom_failed"] = prefill_status("boom") == KVPoll.Failed
    for _ in range(3):
        step()
    out["answers"]["boom"] = [
        [k, r.get("status_code")] for k, r in h.outbox.answers.get("boom", [])
    ]
    out["prefill_held"] = h.held()
    out["prefill_queues"] = h.queues()
    if os.environ.get("SGLANG_KVMEM") == "1":
        from kvmem_sglang import notify, prefill

        out["notify"] = dict(vars(notify.STATS))  # before the room cases count more
        out["transfer_timeouts"] = prefill.STATS.transfer_timeouts
    out["senders"] = sorted({type(r.disagg_kv_sender).__name__ for r in h.reqs.values()})
    assert out["senders"] == [NixlKVSender.__name__]
    from tests.sglang import scenario_room_records

    out["rooms"] = scenario_room_records.run(pm, dm)
    return out


if __name__ == "__main__":
    script_main(main)
