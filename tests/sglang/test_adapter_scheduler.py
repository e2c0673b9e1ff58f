"""The adapter under sglang 0.5.23's real scheduler classes, flag off against flag on, each
in a process of its own (sglang's hooks cannot be undone in-process)."""

from __future__ import annotations

import pytest

from tests.sglang.sglang_env import result_of, run_script

SCENARIO = """
from tests.sglang.sglang_env import alloc_scenario, emit
emit({str(ps): alloc_scenario(ps) for ps in (1, 16, 64)})
"""


@pytest.fixture(scope="module")
def scenario():
    return {flag: result_of(run_script(SCENARIO, kvmem=flag)) for flag in (False, True)}


@pytest.mark.parametrize("ps", ["1", "16", "64"])
def test_schedule_batch_slots_and_counts_match_stock(scenario, ps):
    stock, ours = scenario[False][ps], scenario[True][ps]
    assert stock["allocator"] in ("TokenToKVPoolAllocator", "PagedTokenToKVPoolAllocator")
    assert ours["allocator"] == "KvmemTokenToKVPoolAllocator"
    assert len(stock["slots"]) == len(ours["slots"]) > 20
    for (what, want), (what2, got) in zip(stock["slots"], ours["slots"]):
        assert what == what2
        assert got == want, f"page_size {ps}, {what}: kvmem's slots differ from stock's"
    assert ours["available"] == stock["available"]
    assert ours["available"][-1][1] == ours["available"][0][1]  # every page back
