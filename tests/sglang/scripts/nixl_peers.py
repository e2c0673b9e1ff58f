"""Run by tests/sglang/test_nixl_peers.py in a process of its own, with the flag on: a real
sglang prefill ``NixlKVManager`` (``testkit.sglang_pair``: its pool, metadata buffers and
bootstrap server, NIXL/UCX on DRAM) with two decode peers in this process, each a NIXL agent
of its own whose KV planes are host tensors, registered with the prefill as sglang's
bootstrap thread registers a decode (``_add_remote_peer`` with sglang's
``KVArgsRegisterInfo``).

Peer ``decode-b`` registered with NIXL only the first half of each of its KV planes (as a
decode whose registration no longer covers the KV it publishes), so NIXL refuses to prepare
a list over its planes (``NIXL_ERR_NOT_FOUND``); ``decode-a`` registered all of them.  ``b``
registers first, so the local list every peer shares (``prep_handles[""]``) is made by
``b``'s preparation before its own list fails.

Then the prefill's KV registration is taken back and made again (the adapter's
``deregister_buffer_to_engine``, sglang's ``register_buffer_to_engine``), which prepares
every known peer again (``kvmem_sglang.nixl.prepare_peers``).  Recorded after each step:
which lists the manager holds, per peer and shared.  Then one KV write to each peer through
sglang's ``_send_kvcache_generic`` (the send sglang's worker makes for a chunk): whether it
took the prepared path (``make_prepped_xfer``) or built descriptors per transfer
(``initialize_xfer``), its end, and whether the bytes landed.  Prints one JSON object on its
last line.
"""

from __future__ import annotations

import time

from tests.sglang.sglang_env import script_main

SHAPE = dict(layers=2, heads=2, head_dim=64, page_size=16, requests=2, tokens=64)
PAGES = [1, 3]  # written to both peers: inside the first half of every plane (9 pages)


def _lists(pm, names) -> dict:
    """Which prepared lists ``pm`` holds: the shared local ones, and each peer's own."""
    return dict(
        shared=sorted(
            ([""] if "" in pm.prep_handles else [])
            + (["slice_src"] if pm.prep_handle_slice_src is not None else [])
            + [str(k) for k in pm.prep_handles_segment_src]
        ),
        peers={
            n: sorted(
                (["kv"] if n in pm.prep_handles else [])
                + (["slice"] if n in pm.prep_handles_slice_dst else [])
                + (["state"] if n in pm._prepared_state_plans else [])
                + (["segments"] if pm.decode_kv_args_table[n].kv_xfer_segments else [])
            )
            for n in names
        },
    )


def _peer(name: str, pm, half: bool):
    """A decode peer: its agent, its KV planes (uint8 host tensors, as long as the
    prefill's) and its ``KVArgsRegisterInfo``; ``half``: only the first half of each
    plane registered with NIXL."""
    import torch
    from nixl._api import nixl_agent, nixl_agent_config
    from sglang.srt.disaggregation.nixl.conn import KVArgsRegisterInfo

    args = pm.kv_args
    agent = nixl_agent(name, nixl_agent_config(backends=["UCX"]))
    planes = [torch.zeros(n, dtype=torch.uint8) for n in args.kv_data_lens]
    aux = [torch.zeros(n, dtype=torch.uint8) for n in args.aux_data_lens]
    regs = [(p.data_ptr(), p.numel() // 2 if half else p.numel(), 0, "") for p in planes]
    agent.register_memory(regs + [(a.data_ptr(), a.numel(), 0, "") for a in aux], "DRAM")
    info = KVArgsRegisterInfo(
        room="None",
        endpoint="127.0.0.1",
        dst_port=0,
        agent_name=name,
        agent_metadata=agent.get_agent_metadata(),
        dst_kv_ptrs=[p.data_ptr() for p in planes],
        dst_kv_mem_kinds=["DRAM"] * len(planes),
        dst_aux_ptrs=[a.data_ptr() for a in aux],
        dst_state_data_ptrs=[],
        gpu_id=0,
        decode_tp_size=1,
        decode_tp_rank=0,
        dst_kv_item_len=args.kv_item_lens[0],
        dst_kv_item_lens=list(args.kv_item_lens),
        dst_kv_layer_ids=list(args.kv_layer_ids),
        dst_num_slots=args.kv_data_lens[0] // args.kv_item_lens[0],
    )
    return agent, planes, info


def _write(pm, info, planes, kv) -> dict:
    """One KV write of :data:`PAGES` to a peer through sglang's own send; which path it
    took, its end, and whether every page of every plane landed."""
    import numpy as np
    import torch
    from testkit.sglang_pair import planes_of

    calls = {"prepared": 0, "per_transfer": 0}
    agent = pm.agent
    prepped, plain = agent.make_prepped_xfer, agent.initialize_xfer

    def make_prepped_xfer(*a, **k):
        calls["prepared"] += 1
        return prepped(*a, **k)

    def initialize_xfer(*a, **k):
        calls["per_transfer"] += 1
        return plain(*a, **k)

    agent.make_prepped_xfer, agent.initialize_xfer = make_prepped_xfer, initialize_xfer
    pages = np.array(PAGES, dtype=np.int32)
    try:
        h = pm._send_kvcache_generic(
            info.agent_name,
            pm.kv_args.kv_data_ptrs,
            info.dst_kv_ptrs,
            pm.kv_args.kv_item_lens,
            pages,
            pages,
            0,
            src_mem_kind="DRAM",
            dst_mem_kind="DRAM",
        )
        end = time.monotonic() + 30
        state = agent.check_xfer_state(h)
        while state == "PROC" and time.monotonic() < end:
            time.sleep(0.001)
            state = agent.check_xfer_state(h)
    except Exception as e:  # noqa: BLE001 - recorded: the test says what it expected
        state = f"raised {type(e).__name__}: {e}"
    finally:
        agent.make_prepped_xfer, agent.initialize_xfer = prepped, plain
    item = pm.kv_args.kv_item_lens
    landed = all(
        torch.equal(
            src.view(torch.uint8).reshape(-1)[p * item[k] : (p + 1) * item[k]],
            planes[k][p * item[k] : (p + 1) * item[k]],
        )
        for k, src in enumerate(planes_of(kv))
        for p in PAGES
    )
    return dict(calls=calls, state=state, landed=landed)


def main() -> dict:
    from sglang.srt.runtime_context import get_disagg
    from testkit.sglang_pair import (
        Shape,
        bootstrap_server,
        build_pool,
        fill_pattern,
        manager,
        metadata_buffers,
        publish,
    )

    shape = Shape(**SHAPE)
    sa = publish("prefill", shape.page_size)  # loads the plugin (the flag is on)
    server, port = bootstrap_server("nixl")
    get_disagg()._set("disaggregation_bootstrap_port", port)
    kv, _ = build_pool(shape)
    fill_pattern(kv)
    pm = manager(kv, metadata_buffers(shape.requests), "prefill", sa)
    peers = {name: _peer(name, pm, half=name == "decode-b") for name in ("decode-b", "decode-a")}
    names = list(peers)
    for _, _, info in peers.values():
        pm._add_remote_peer(info)  # what sglang's bootstrap thread calls
    out = {"registered": _lists(pm, names)}
    pm.deregister_buffer_to_engine()
    out["released"] = _lists(pm, names)
    pm.register_buffer_to_engine()
    out["resumed"] = _lists(pm, names)
    out["writes"] = {n: _write(pm, info, planes, kv) for n, (_, planes, info) in peers.items()}
    return out


if __name__ == "__main__":
    script_main(main)
