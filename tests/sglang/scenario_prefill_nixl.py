"""Run by tests/sglang/test_prefill_nixl.py in a process of its own, flag off or on:
a real PD prefill scheduler (``prefill_env.PrefillHarness``) whose bootstrap queue holds a
real ``NixlKVManager`` over a real NIXL agent (UCX, DRAM), registered as its
``__init__`` registers (``register_buffer_to_engine``); then 20 release/resume cycles
through sglang's real ``SchedulerWeightUpdaterManager`` (tag ``kv_cache``).  A spy on the
agent's bound ``register_memory`` / ``deregister_memory`` counts what is registered and
still live.  A second agent that loaded the prefill agent's metadata before a release
WRITEs into the KV pool while it is released.  Prints one JSON object on its last line.

The manager is ``object.__new__`` with the two attributes ``register_buffer_to_engine``
reads (``agent``, ``kv_args``): its ``__init__`` starts bootstrap threads and sockets."""

from __future__ import annotations

import json
import sys
import time

CYCLES = 20


def main() -> dict:
    from tests.sglang.prefill_env import PrefillHarness

    h = PrefillHarness(page_size=4, pages=64, max_reqs=8)
    import torch
    from testkit import nixl_nap

    nixl_nap.install()  # its agents nap between progress polls
    from nixl_cu12._api import nixl_agent, nixl_agent_config
    from sglang.srt.disaggregation.base.conn import KVArgs
    from sglang.srt.disaggregation.nixl.conn import NixlKVManager, _normalize_kv_mem_kinds
    from sglang.srt.disaggregation.utils import get_kv_transfer_buf_infos

    ptrs, lens, item_lens = get_kv_transfer_buf_infos(h.kv)
    kv_args = KVArgs()
    kv_args.kv_data_ptrs, kv_args.kv_data_lens, kv_args.kv_item_lens = ptrs, lens, item_lens
    kv_args.kv_data_mem_kinds = _normalize_kv_mem_kinds(["DRAM"] * len(ptrs), len(ptrs))
    aux_ptrs, aux_lens, aux_items = h.s.disagg_metadata_buffers.get_buf_infos()
    kv_args.aux_data_ptrs, kv_args.aux_data_lens, kv_args.aux_item_lens = (
        aux_ptrs,
        aux_lens,
        aux_items,
    )
    kv_args.state_data_ptrs, kv_args.state_data_lens = [], []
    kv_args.gpu_id = 0

    agent = nixl_agent("prefill", nixl_agent_config(backends=["UCX"]))
    calls = {"register": 0, "deregister": 0}
    live: dict[int, tuple] = {}  # id(descs) -> (descs, entries); descs kept: no id reuse
    real_register, real_deregister = agent.register_memory, agent.deregister_memory

    def register_spy(reg_list, mem_type=None, *a, **k):
        descs = real_register(reg_list, mem_type, *a, **k)
        calls["register"] += 1
        live[id(descs)] = (descs, len(reg_list))
        return descs

    def deregister_spy(descs, *a, **k):
        real_deregister(descs, *a, **k)
        calls["deregister"] += 1
        live.pop(id(descs), None)

    agent.register_memory, agent.deregister_memory = register_spy, deregister_spy
    mgr = object.__new__(NixlKVManager)
    mgr.agent, mgr.kv_args = agent, kv_args
    mgr.register_buffer_to_engine()  # what NixlKVManager.__init__ does
    h.s.disagg_prefill_bootstrap_queue.kv_manager = mgr

    out = {"first": {"live_entries": _entries(live), "lists": len(live)}}
    peer = nixl_agent("decode-peer", nixl_agent_config(backends=["UCX"]))
    peer.add_remote_agent(agent.get_agent_metadata())  # metadata from before the release
    live_per_cycle, while_released = [], None
    for cycle in range(CYCLES):
        h.release()
        if cycle == 0:
            fresh = nixl_agent("decode-peer-2", nixl_agent_config(backends=["UCX"]))
            fresh.add_remote_agent(agent.get_agent_metadata())  # published while released
            while_released = {
                "live_entries": _entries(live),
                "write_old_metadata": _write(peer, agent.name, h.kv.k_buffer[0]),
                "write_new_metadata": _write(fresh, agent.name, h.kv.k_buffer[0]),
            }
        h.resume()
        live_per_cycle.append(_entries(live))
    out["live_per_cycle"] = live_per_cycle
    out["while_released"] = while_released
    out["calls"] = calls
    out["kv_entries_per_registration"] = out["first"]["live_entries"]
    # the pool still serves after the cycles: one request through the scheduler (its
    # sender is the scripted fake one again)
    h.s.disagg_prefill_bootstrap_queue.kv_manager = h.mgr
    h.submit("after", 9)
    h.step()
    out["after_answer"] = h.outbox.status("after")
    out["held_after"] = h.held()
    del torch
    return out


def _entries(live) -> int:
    return sum(n for _, n in live.values())


def _write(peer, target_name: str, buf) -> dict:
    """The peer WRITEs 64 bytes into ``buf`` using the target metadata it loaded earlier."""
    import torch

    src = torch.full((64,), 0x5A, dtype=torch.uint8)
    rec = {}
    try:
        local = peer.register_memory([(src.data_ptr(), 64, 0, "")], "DRAM")
        h = peer.initialize_xfer(
            "WRITE",
            peer.get_xfer_descs([(src.data_ptr(), 64, 0)], "DRAM"),
            peer.get_xfer_descs([(buf.data_ptr(), 64, 0)], "DRAM"),
            target_name,
            b"w",
        )
        state = peer.transfer(h)
        t0 = time.monotonic()
        while state not in ("DONE", "ERR") and time.monotonic() - t0 < 10:
            state = peer.check_xfer_state(h)
        rec["state"] = state
        peer.release_xfer_handle(h)
        peer.deregister_memory(local)
    except Exception as e:  # NIXL refuses a target outside registered memory
        rec["state"], rec["error"] = "REFUSED", f"{type(e).__name__}: {e}"[:300]
    return rec


if __name__ == "__main__":
    from kvmem.transfer.nixl_exit import process_body  # this process loads NIXL

    with process_body():
        result = main()
        sys.stdout.flush()
        print(json.dumps(result, default=str))
