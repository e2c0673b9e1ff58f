"""Run by tests/sglang/test_adapter_registration.py in a process of its own (sglang's
hooks cannot be undone in-process): build a real CPU ``MHATokenToKVPool``, hand its
per-layer buffers to sglang's real ``NixlKVManager.register_buffer_to_engine`` on a real
NIXL agent (UCX, DRAM), and count what NIXL was asked to register; then release and
resume the KV memory through sglang's real ``SchedulerWeightUpdaterManager`` (which, for
a prefill, re-registers through ``PrefillBootstrapQueue.resume_memory_occupation``) and
count again.  After each registration a second real agent WRITEs into the pool, which
only succeeds where the target lies inside registered memory.

``SGLANG_KVMEM`` (0 or 1) in the environment decides stock or kvmem; the plugin is
loaded by sglang's own ``load_plugins()``.  Prints one JSON object on its last line.

Stand-ins (what has no CPU form or no part in this path): the scheduler object the
weight updater reads (its disaggregation mode and bootstrap queue), ``flush_cache`` and
``is_fully_idle`` (an idle server, nothing cached), and ``torch.cuda.synchronize``: the
updater ends with ``torch.get_device_module().synchronize()``, which is ``torch.cuda``'s on
a CUDA build of torch even with no driver, and raises there; this process has no CUDA
work to wait for, so the stand-in only counts the call.
"""

from __future__ import annotations

import json
import os
import sys
import time
from types import SimpleNamespace

LAYERS = 6
HEADS, HEAD_DIM, PAGE_SIZE, PAGES = 4, 64, 16, 64


def main() -> dict:
    from sglang.srt.runtime_context import publish
    from sglang.srt.server_args import ServerArgs

    publish(
        ServerArgs(
            model_path="dummy",
            device="cpu",
            disaggregation_mode="prefill",
            disaggregation_transfer_backend="nixl",
            page_size=PAGE_SIZE,
        ),
        role="test",
    )
    from sglang.srt.plugins import load_plugins

    load_plugins()

    import torch
    from testkit import nixl_nap

    nixl_nap.install()  # its agents nap between progress polls
    from nixl_cu12._api import nixl_agent, nixl_agent_config
    from sglang.srt.constants import GPU_MEMORY_TYPE_KV_CACHE
    from sglang.srt.disaggregation.base.conn import KVArgs
    from sglang.srt.disaggregation.nixl.conn import NixlKVManager, _normalize_kv_mem_kinds
    from sglang.srt.disaggregation.prefill import PrefillBootstrapQueue
    from sglang.srt.disaggregation.utils import DisaggregationMode, get_kv_transfer_buf_infos
    from sglang.srt.managers.io_struct import (
        ReleaseMemoryOccupationReqInput,
        ResumeMemoryOccupationReqInput,
    )
    from sglang.srt.managers.scheduler_components.weight_updater import (
        SchedulerWeightUpdaterManager,
    )
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.utils.torch_memory_saver_adapter import TorchMemorySaverAdapter

    from kvmem_sglang.kvpool import pool_of

    kv = MHATokenToKVPool(
        size=PAGE_SIZE * PAGES,
        page_size=PAGE_SIZE,
        dtype=torch.bfloat16,
        head_num=HEADS,
        head_dim=HEAD_DIM,
        layer_num=LAYERS,
        device="cpu",
        enable_memory_saver=False,
    )
    pool = pool_of(kv)

    ptrs, lens, item_lens = get_kv_transfer_buf_infos(kv)
    kv_args = KVArgs()
    kv_args.kv_data_ptrs, kv_args.kv_data_lens, kv_args.kv_item_lens = ptrs, lens, item_lens
    kv_args.kv_data_mem_kinds = _normalize_kv_mem_kinds(["DRAM"] * len(ptrs), len(ptrs))
    aux = torch.zeros(4096, dtype=torch.uint8)
    kv_args.aux_data_ptrs, kv_args.aux_data_lens = [aux.data_ptr()], [aux.numel()]
    kv_args.aux_item_lens = [64]
    kv_args.state_data_ptrs, kv_args.state_data_lens = [], []
    kv_args.gpu_id = 0

    agent = nixl_agent("prefill", nixl_agent_config(backends=["UCX"]))
    # Spies on the real agent: every register_memory call the manager makes, and which of
    # those registrations are still live (registered, not yet deregistered).
    calls: list[dict] = []
    live: dict[int, dict] = {}  # id(returned descriptor list) -> its call record
    real_register, real_deregister = agent.register_memory, agent.deregister_memory

    def register_spy(reg_list, mem_type=None, *a, **k):
        descs = real_register(reg_list, mem_type, *a, **k)
        rec = {
            "mem_type": mem_type,
            "ranges": [[int(d[0]), int(d[1])] for d in reg_list],
            "descs": descs,
        }
        rec["kv"] = all(r[0] != aux.data_ptr() for r in rec["ranges"])
        calls.append(rec)
        live[id(descs)] = rec
        return descs

    def deregister_spy(descs, *a, **k):
        real_deregister(descs, *a, **k)
        live.pop(id(descs), None)

    agent.register_memory, agent.deregister_memory = register_spy, deregister_spy

    def live_kv_entries() -> int:
        return sum(len(r["ranges"]) for r in live.values() if r["kv"])

    manager = object.__new__(NixlKVManager)
    manager.agent, manager.kv_args = agent, kv_args

    def registered(fresh: list[dict]) -> dict:
        kv_calls = [c for c in fresh if c["kv"]]
        return {
            "kv_entries": sum(len(c["ranges"]) for c in kv_calls),
            "kv_descs": sum(d.descCount() for d in manager.kv_descs),
            # transfers still address each layer: sglang's per-layer lists are back
            "kv_args_per_layer": (
                list(kv_args.kv_data_ptrs) == list(ptrs)
                and list(kv_args.kv_data_lens) == list(lens)
            ),
            "kv_ranges": [r for c in kv_calls for r in c["ranges"]],
            "calls": len(fresh),
        }

    # the first registration, as NixlKVManager.__init__ makes it
    manager.register_buffer_to_engine()
    first = registered(calls)
    first["writes"] = writes(nixl_agent, nixl_agent_config, agent, kv, "peer-1")

    # release and resume through sglang's weight updater (kv_cache tag)
    queue = object.__new__(PrefillBootstrapQueue)
    queue.queue, queue.kv_manager = [], manager
    # the few fields of sglang's Scheduler the release reads (a class of its own: the
    # adapter keeps the scheduler's registration epoch in a weak side table)
    scheduler = type("Scheduler", (SimpleNamespace,), {})(
        disaggregation_mode=DisaggregationMode.PREFILL,
        disagg_prefill_bootstrap_queue=queue,
        _engine_paused=False,
    )
    updater = object.__new__(SchedulerWeightUpdaterManager)
    updater.scheduler = scheduler
    updater.memory_saver_adapter = TorchMemorySaverAdapter.create(enable=False)
    updater.flush_cache = lambda *a, **k: True
    updater.is_fully_idle = lambda *a, **k: True
    updater.offload_tags = set()
    syncs = []
    if not torch.cuda.is_available():
        torch.cuda.synchronize = lambda *a, **k: syncs.append(1)

    buf_ptrs = [t.data_ptr() for t in kv.k_buffer + kv.v_buffer]
    at_release: list[int] = []  # live KV registrations when kvmem releases the memory
    if pool is not None:
        real_release = pool.release

        def release_spy(*a, **k):
            at_release.append(live_kv_entries())
            return real_release(*a, **k)

        pool.release = release_spy
    for t in kv.k_buffer + kv.v_buffer:  # every page resident before the release
        t.view(torch.uint8).fill_(0xC3)
    before = (
        {"epoch": pool.epoch, "resident": pool.resident_bytes(), "nbytes": pool.nbytes}
        if pool
        else {}
    )
    n_calls = len(calls)
    updater.release_memory_occupation(
        ReleaseMemoryOccupationReqInput(tags=[GPU_MEMORY_TYPE_KV_CACHE])
    )
    released = {"released": pool.released, "resident": pool.resident_bytes()} if pool else {}
    calls_during_release = len(calls) - n_calls
    updater.resume_memory_occupation(
        ResumeMemoryOccupationReqInput(tags=[GPU_MEMORY_TYPE_KV_CACHE])
    )
    resumed = (
        {"released": pool.released, "epoch": pool.epoch, "resident": pool.resident_bytes()}
        if pool
        else {}
    )
    second = registered(calls[n_calls:])
    second["calls_during_release"] = calls_during_release
    second["ptrs_kept"] = buf_ptrs == [t.data_ptr() for t in kv.k_buffer + kv.v_buffer]
    second["writes"] = writes(nixl_agent, nixl_agent_config, agent, kv, "peer-2")
    second["live_kv_entries"] = live_kv_entries()
    second["live_kv_at_release"] = at_release
    # On NIXL itself: drop the registration the resume made; a write into the pool that
    # still lands is carried by a registration left over from before the release.
    for descs in manager.kv_descs:
        real_deregister(descs)
    second["write_after_dropping_current"] = writes(
        nixl_agent, nixl_agent_config, agent, kv, "peer-3"
    )[0]

    return {
        "flag": os.environ.get("SGLANG_KVMEM", "0"),
        "layers": LAYERS,
        "per_layer_ranges": [[p, n] for p, n in zip(ptrs, lens)],
        "kvmem_pool": pool is not None,
        "regions": [[p, n] for p, n in pool.regions()] if pool else None,
        "first": first,
        "after_resume": second,
        "device_syncs": len(syncs),
        "pool_before": before,
        "pool_released": released,
        "pool_resumed": resumed,
    }


def writes(nixl_agent, nixl_agent_config, target, kv, peer_name: str) -> list[dict]:
    """A second agent WRITEs known bytes into the pool: into layer 0's K (first token),
    into the last layer's V (an inner token), and one write that runs from the end of
    layer 0's K into the start of layer 0's V.  Each: NIXL's final state and whether the
    bytes landed."""
    import torch

    peer = nixl_agent(peer_name, nixl_agent_config(backends=["UCX"]))
    peer.add_remote_agent(target.get_agent_metadata())
    last = len(kv.v_buffer) - 1
    k0, v_last, v0 = kv.k_buffer[0], kv.v_buffer[last], kv.v_buffer[0]
    row = k0[0].numel() * k0.element_size()  # bytes of one token, all heads
    k0_end = k0.data_ptr() + k0.numel() * k0.element_size()
    cases = [
        ("layer0-K", k0.data_ptr(), row),
        (f"layer{last}-V", v_last[37].data_ptr(), row),
        ("layer0-K-into-V", k0_end - row, 2 * row),
    ]
    out = []
    for i, (where, addr, nbytes) in enumerate(cases):
        gap = v0.data_ptr() - k0_end  # kvmem pads K to a block boundary; stock has none
        if where.endswith("into-V") and gap:
            nbytes += gap
        src = torch.arange(nbytes, dtype=torch.int64).to(torch.uint8) ^ (0x5A + i)
        rec = {"where": where, "nbytes": nbytes}
        try:
            local = peer.register_memory([(src.data_ptr(), nbytes, 0, "")], "DRAM")
            src_descs = peer.get_xfer_descs([(src.data_ptr(), nbytes, 0)], "DRAM")
            dst_descs = peer.get_xfer_descs([(addr, nbytes, 0)], "DRAM")
            h = peer.initialize_xfer("WRITE", src_descs, dst_descs, target.name, b"w")
            state = peer.transfer(h)
            t0 = time.monotonic()
            while state not in ("DONE", "ERR") and time.monotonic() - t0 < 10:
                state = peer.check_xfer_state(h)
            rec["state"] = state
            landed = torch.frombuffer(_span(addr, nbytes), dtype=torch.uint8)
            rec["landed"] = bool(torch.equal(landed, src))
            peer.release_xfer_handle(h)
            peer.deregister_memory(local)
        except Exception as e:  # NIXL refuses a target outside registered memory
            rec["state"], rec["error"] = "REFUSED", f"{type(e).__name__}: {e}"[:300]
        out.append(rec)
    peer.remove_remote_agent(target.name)
    return out


def _span(addr: int, nbytes: int):
    import ctypes

    return (ctypes.c_ubyte * nbytes).from_address(addr)


if __name__ == "__main__":
    from kvmem.transfer.nixl_exit import process_body  # this process loads NIXL

    with process_body():
        result = main()
        sys.stdout.flush()
        print(json.dumps(result))
