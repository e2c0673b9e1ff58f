"""`kvmem demo` throughput (GB/s of KV delivered and verified) against the raw NIXL write
bandwidth between the same two worker processes, measured in the same run (one registered
256 MiB buffer written into one registered buffer of the decode process, median of 5 warm
writes), with faults off and with every fault on, in push mode with chunks packed (the
path before direct chunks) and chosen per chunk (``--chunks auto``, the threshold
calibrated at start-up), and in pull mode (the decode reads pool to pool); and where the
demo's time goes.

Each mode runs ``KVMEM_BENCH_DEMO_RUNS`` times (3); a run's ratio is its throughput over
its own raw NIXL figure.  A row gives the median wall time and bytes of the runs, and its
extra fields the median ratio with its spread (min, max), each run's figures (with the
worker loops' step, get_notifs and nap call counts), and how
much CPU *other* processes used meanwhile: /proc/stat's busy time over the runs minus
this process's and its children's (the two workers), in cores.  On this 2-core machine
anything above ``LOADED_CORES`` of others' CPU is flagged ``under_load`` (and named in
the row), and such a figure is no measurement of a target.

The ``stage`` groups (last run of each transfer mode, faults off) are seconds inside the worker
loops (one core each, measured by timing the workers' real calls; see
:class:`kvmem.demo.worker_base.StageClock`) with the bytes each stage handled.

Runs on the CPU (UCX over loopback; the model, pools and NIXL memory are host memory).
``KVMEM_BENCH_DEMO_REQUESTS`` sets the request count (200).  The smoke mode runs 6 short
requests of a 2-layer model, one pause, an 8 MiB raw NIXL buffer written once, one run.
"""

from __future__ import annotations

import os
import resource
import statistics
import time

import pytest

from bench.conftest import pick
from kvmem.demo import DemoConfig, run
from kvmem.demo.report import loop_breakdown

REQUESTS = pick(int(os.environ.get("KVMEM_BENCH_DEMO_REQUESTS", "200")), 6)
RUNS = pick(int(os.environ.get("KVMEM_BENCH_DEMO_RUNS", "3")), 1)
# Others' CPU from which a figure is flagged: a quarter of a core on average.  Not a
# measured constant: a quiet VM here shows well under 0.1 core of background work, and
# at 0.25 of one of two cores the demo's two workers already wait for a core now and then.
LOADED_CORES = 0.25
SIZES = pick(
    {}, dict(layers=2, max_tokens=256, chunk_tokens=128, concurrency=2, bw_mib=8, bw_rounds=1)
)
FAULTS = {
    "faults off": dict(abort_rate=0.0, timeout_rate=0.0, fail_rate=0.0, pauses=0),
    "faults on": pick({}, dict(pauses=1)),  # the demo's defaults: every family, 4 pauses
}
TRANSFERS = {
    "push, chunks packed": dict(transfer_mode="push", chunks="packed"),
    "push, chunks auto": dict(transfer_mode="push", chunks="auto"),
    "pull": dict(transfer_mode="pull"),
}
STAGES = {  # group name -> (side, stage names summed, the byte counter they handled)
    "prefill: forward stand-in (Synth.chunk + unpack_pages into the pool)": (
        "prefill",
        ("forward: synth KV into pool pages",),
        "bytes_sent",
    ),
    "prefill: pack_pages into staging": ("prefill", ("pack_pages",), "bytes_packed"),
    "prefill: post_write / post_blocks (UCX cma copies into the decode here)": (
        "prefill",
        ("post_write (UCX copies here)", "post_blocks (direct; UCX copies here)"),
        "bytes_sent",
    ),
    "decode: verify every landed chunk (landing region or pool pages in place)": (
        "decode",
        ("verify (Synth.verify)", "verify in place (Synth.verify_pages)"),
        "bytes_landed",
    ),
    "decode: unpack_pages into the pool": ("decode", ("unpack_pages into pool",), "bytes_landed"),
    "decode: post_blocks READ (pull; UCX cma copies from the prefill here)": (
        "decode",
        ("post_blocks (pull; UCX reads here)",),
        "bytes_landed",
    ),
}


def _row(report, group: str, name: str, seconds: float, nbytes: int, **extra) -> None:
    """A row of bench/conftest.py's report for a figure the demo measured itself (the
    report's ``add`` reads a pytest-benchmark timing)."""
    report.groups[group].append(
        dict(name=name, median_s=seconds, nbytes=nbytes, gb_per_s=nbytes / seconds / 1e9, **extra)
    )


def _fig(role: str) -> dict:
    """The fields that put a row in the demo figure (bench/plot.py)."""
    return dict(figure="demo", role=role)


def _busy_seconds() -> float:
    """CPU seconds every process of the machine spent busy (/proc/stat: all but idle and
    iowait), since boot."""
    with open("/proc/stat") as f:
        vals = [int(v) for v in f.readline().split()[1:]]
    return (sum(vals[:8]) - vals[3] - vals[4]) / os.sysconf("SC_CLK_TCK")


def _own_seconds() -> float:
    """CPU seconds of this process and its reaped children (the demo's workers)."""
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime


def _spread(xs) -> dict:
    return dict(median=statistics.median(xs), min=min(xs), max=max(xs))


@pytest.mark.parametrize("transfer", list(TRANSFERS))
@pytest.mark.parametrize("faults", list(FAULTS))
def test_demo_vs_raw_nixl(benchmark, report, faults, transfer):
    cfg = DemoConfig(requests=REQUESTS, **{**SIZES, **FAULTS[faults], **TRANSFERS[transfer]})
    results = []
    load0 = os.getloadavg()[0]
    busy0, own0, t0 = _busy_seconds(), _own_seconds(), time.monotonic()

    def one():
        results.append(run(cfg, progress=False))

    benchmark.pedantic(one, rounds=RUNS, iterations=1)
    wall = time.monotonic() - t0
    others = max(0.0, (_busy_seconds() - busy0) - (_own_seconds() - own0)) / wall
    loaded = others > LOADED_CORES
    for r in results:
        assert r["ok"], r["errors"]
        assert r["leaked_pages"] == {"prefill": 0, "decode": 0}
        assert r["bytes_transferred"] == r["bytes_verified"] > 0
        assert r["raw_nixl"]["verified"]
        assert r["transfer_mode"] == cfg.transfer_mode
    ratios = [r["throughput_vs_raw"] for r in results]
    raws = [r["raw_nixl_gbps"] for r in results]
    moved = int(statistics.median(r["bytes_verified"] for r in results))
    walls = [r["wall_seconds"] for r in results]
    env = dict(
        others_cpu_cores=others,
        under_load=loaded,
        loadavg_1min=[load0, os.getloadavg()[0]],
        runs=len(results),
    )
    per_run = [
        dict(
            ratio=r["throughput_vs_raw"],
            gbps=r["throughput_gbps"],
            raw_gbps=r["raw_nixl_gbps"],
            chunks=r["chunks"],
            direct_threshold=r["direct_threshold"],
            cpu_s_per_gb={k: v["seconds_per_gb"] for k, v in r["cpu"].items()},
            poll_share={k: v["poll_share"] for k, v in r["cpu"].items()},
            **{
                f"{k}_calls": {
                    side: r[side]["stage_seconds"].get(name, {}).get("calls", 0)
                    for side in ("prefill", "decode")
                }
                for k, name in (("step", "step"), ("get_notifs", "get_notifs"), ("nap", "nap"))
            },
        )
        for r in results
    ]
    flag = f" UNDER LOAD (others {others:.2f} cores)" if loaded else ""
    group = f"kvmem demo vs raw NIXL write between the same 2 processes, {faults}"
    _row(
        report,
        group,
        f"kvmem demo, {transfer}: {REQUESTS} requests x {len(results)} "
        f"runs, ratio {statistics.median(ratios):.2f}x [{min(ratios):.2f}, {max(ratios):.2f}]"
        + flag,
        statistics.median(walls),
        moved,
        ratio_to_raw=_spread(ratios),
        raw_gbps=_spread(raws),
        per_run=per_run,
        **env,
        **_fig("kvmem"),
    )
    _row(
        report,
        group,
        f"raw NIXL write of the same bytes, same runs "
        f"({results[0]['raw_nixl']['nbytes'] >> 20} MiB writes)" + flag,
        moved / statistics.median(raws) / 1e9,
        moved,
        **env,
        **_fig("baseline"),
    )
    benchmark.extra_info.update(
        ratio=_spread(ratios),
        raw_gbps=_spread(raws),
        **env,
        cpu_s_per_gb=[p["cpu_s_per_gb"] for p in per_run],
    )
    if faults != "faults off" or transfer == "push, chunks packed":
        return
    r = results[-1]
    for stage, (side, names, counter) in STAGES.items():
        st = r[side]["stage_seconds"]
        seconds = sum(st.get(n, {}).get("seconds", 0.0) for n in names)
        nbytes = r[side]["metrics"][counter]
        if seconds > 0 and nbytes:
            _row(
                report,
                f"demo stage, {faults}, {transfer}: {stage}",
                f"{seconds / r['wall_seconds']:.0%} of the workload wall",
                seconds,
                nbytes,
            )
    for side in ("prefill", "decode"):
        rest = loop_breakdown(r[side]["stage_seconds"])["rest_of_step"]
        group = f"demo stage, {faults}, {transfer}: {side}: the rest of step() (Python)"
        _row(
            report,
            group,
            f"{rest / r['wall_seconds']:.0%} of the workload wall",
            max(rest, 1e-9),
            r[side]["metrics"]["bytes_landed" if side == "decode" else "bytes_sent"],
        )
