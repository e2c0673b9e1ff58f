"""NIXL's own API under kvmem.transfer (UCX, DRAM): what NIXL does when kvmem's checks are
not in the way.  The engine rules themselves (writes, notifications, the epoch guard,
range checks, in-flight refusal and drain, metadata validation, leaks) are
tests/transfer/test_engine_contract.py, run over NIXL and over the loopback engine; the
chunk-boundary refusals are tests/transfer/test_chunked_regions.py.
"""

from __future__ import annotations

import pytest
import torch

from tests.transfer.test_engine_contract import SENTINEL, make_pool, page_ranges

pytestmark = pytest.mark.nixl


def test_nixl_itself_does_not_revoke(nixl_agents):
    """Why the guard is kvmem's: through raw NIXL, writes built from the old descriptors
    land after the target deregistered, and after it released, resumed and registered its
    memory again (seen on this project's 2-core VM).  If this starts failing, NIXL began
    revoking: revisit kvmem/transfer's docstrings."""
    pa, pb = make_pool(seed=4), make_pool(fill=SENTINEL)
    a, b = nixl_agents.engine(), nixl_agents.engine()
    try:
        a.register_pool(pa)
        b.register_pool(pb)
        a.add_peer(b.local_metadata())
        ag = a.agent

        def raw_write(src_page: int, dst_page: int) -> str:
            src_addr, n = page_ranges(pa, [src_page])[0]
            dst_addr, _ = page_ranges(pb, [dst_page])[0]
            xh = ag.initialize_xfer(
                "WRITE",
                ag.get_xfer_descs([(src_addr, n, 0)], "DRAM"),
                ag.get_xfer_descs([(dst_addr, n, 0)], "DRAM"),
                b.name,
                b"raw",
            )
            state = ag.transfer(xh)
            while state == "PROC":
                b.get_notifs()  # no progress thread: the target's agent is driven too
                state = ag.check_xfer_state(xh)
            xh.release()
            return state

        b.deregister("kv")
        assert raw_write(5, 6) == "DONE"
        assert torch.equal(pb.k_buffer[0][6].view(torch.uint8), pa.k_buffer[0][5].view(torch.uint8))
        pb.release()
        pb.resume()
        b.register_pool(pb)
        assert raw_write(7, 8) == "DONE"
        assert torch.equal(pb.k_buffer[0][8].view(torch.uint8), pa.k_buffer[0][7].view(torch.uint8))
    finally:
        nixl_agents.give_back(a, b)
