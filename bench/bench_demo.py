"""`kvmem demo` throughput (GB/s of KV delivered and verified) against the raw NIXL write
bandwidth between the same two worker processes, measured in the same run (one registered
256 MiB buffer written into one registered buffer of the decode process, median of 5 warm
writes), with faults off and with every fault on; and where the demo's time goes.

Each row of the ``vs raw NIXL`` groups is the time to move the demo's verified bytes: the
demo's workload wall time, and that of the raw writes at their measured bandwidth, so the
ratio printed is raw GB/s / demo GB/s.  The ``stage`` groups are seconds inside the worker
loops (one core each, measured by timing the workers' real calls; see
:class:`kvmem.demo_worker.StageClock`) with the bytes each stage handled.

Runs on the CPU (UCX over loopback; the model, pools and NIXL memory are host memory).
``KVMEM_BENCH_DEMO_REQUESTS`` sets the request count (200).  The smoke mode runs 6 short
requests of a 2-layer model, one pause, and an 8 MiB raw NIXL buffer written once.
"""

from __future__ import annotations

import os

import pytest

from bench.conftest import pick
from kvmem.demo import DemoConfig, run

REQUESTS = pick(int(os.environ.get("KVMEM_BENCH_DEMO_REQUESTS", "200")), 6)
SIZES = pick({}, dict(layers=2, max_tokens=256, chunk_tokens=128, concurrency=2, bw_mib=8,
                      bw_rounds=1))
MODES = {
    "faults off": dict(abort_rate=0.0, timeout_rate=0.0, fail_rate=0.0, pauses=0),
    "faults on": pick({}, dict(pauses=1)),  # the demo's defaults: every family, 4 pauses
}
STAGES = {  # group name -> (side, stage names summed, the byte counter they handled)
    "prefill: forward stand-in (Synth.chunk + unpack_pages into the pool)":
        ("prefill", ("forward: synth KV into pool pages",), "bytes_packed"),
    "prefill: pack_pages into staging":
        ("prefill", ("pack_pages",), "bytes_packed"),
    "prefill: post_write (UCX cma copies into the decode here)":
        ("prefill", ("post_write (UCX copies here)",), "bytes_sent"),
    "decode: Synth.verify of every landed chunk":
        ("decode", ("verify (Synth.verify)",), "bytes_landed"),
    "decode: unpack_pages into the pool":
        ("decode", ("unpack_pages into pool",), "bytes_landed"),
}


def _row(report, group: str, name: str, seconds: float, nbytes: int, **extra) -> None:
    """A row of bench/conftest.py's report for a figure the demo measured itself (the
    report's ``add`` reads a pytest-benchmark timing)."""
    report.groups[group].append(dict(name=name, median_s=seconds, nbytes=nbytes,
                                     gb_per_s=nbytes / seconds / 1e9, **extra))


def _fig(role: str) -> dict:
    """The fields that put a row in the demo figure (bench/plot.py)."""
    return dict(figure="demo", role=role)


@pytest.mark.parametrize("mode", list(MODES))
def test_demo_vs_raw_nixl(benchmark, report, mode):
    cfg = DemoConfig(requests=REQUESTS, **{**SIZES, **MODES[mode]})
    r = benchmark.pedantic(run, args=(cfg,), kwargs=dict(progress=False), rounds=1,
                           iterations=1)
    assert r["ok"], r["errors"]
    assert r["leaked_pages"] == {"prefill": 0, "decode": 0}
    assert r["bytes_transferred"] == r["bytes_verified"] > 0
    raw = r["raw_nixl"]
    assert raw["verified"]
    moved = r["bytes_verified"]
    group = f"kvmem demo vs raw NIXL write between the same 2 processes, {mode}"
    _row(report, group, f"kvmem demo: {REQUESTS} requests, verified KV / workload wall",
         r["wall_seconds"], moved, ratio_to_raw=r["throughput_vs_raw"], **_fig("kvmem"))
    _row(report, group, f"raw NIXL write of the same bytes ({raw['nbytes'] >> 20} MiB writes)",
         moved / raw["gbps"] / 1e9, moved, **_fig("baseline"))
    benchmark.extra_info.update(throughput_gbps=r["throughput_gbps"], raw_gbps=raw["gbps"],
                                ratio=r["throughput_vs_raw"], wall_s=r["wall_seconds"])
    if mode != "faults off":
        return
    for stage, (side, names, counter) in STAGES.items():
        st = r[side]["stage_seconds"]
        seconds = sum(st[n]["seconds"] for n in names)
        nbytes = r[side]["metrics"][counter]
        _row(report, f"demo stage, {mode}: {stage}",
             f"{seconds / r['wall_seconds']:.0%} of the workload wall", seconds, nbytes)
    for side in ("prefill", "decode"):
        st = r[side]["stage_seconds"]
        step = st["step"]["seconds"]
        inner = sum(v["seconds"] for k, v in st.items() if k not in ("step", "loop"))
        group = f"demo stage, {mode}: {side}: the rest of step() (Python, notifications)"
        _row(report, group, f"{(step - inner) / r['wall_seconds']:.0%} of the workload wall",
             step - inner, r[side]["metrics"]["bytes_landed" if side == "decode" else "bytes_sent"])
