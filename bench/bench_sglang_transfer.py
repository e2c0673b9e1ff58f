"""sglang 0.5.23's PD KV transfer (real ``NixlKVManager``s, prefill and decode in two
processes, NIXL/UCX on DRAM; and real ``MooncakeKVManager``s, Mooncake's engine over TCP),
stock against ``SGLANG_KVMEM=1``, with a raw write of the same bytes between the same two
processes in the same run (a NIXL write; one Mooncake ``batch_transfer_sync_write``).

The harness is :mod:`bench.sglang_pair` (its docstring has the set-up: the model is 32
layers x 8 KV heads x 128, bf16; 32 requests x 1,024 tokens, the pages of a request never
adjacent, interleaved with the other requests' pages, the same page ids on both sides and
in every mode).  Modes (``bench.sglang_pair.MODES``): stock; the flag on both sides; the
flag with sglang's own send (``SGLANG_KVMEM_TRANSFER=sglang``: the flag before
kvmem_sglang.transfer); that with sglang's per-layer registration
(``SGLANG_KVMEM_REGISTER=layers``: the pool's memory alone); the flag on the prefill with
a stock decode.  Page sizes 1, 16 and 64, one prefill/decode pair per mode and page size.

Each pair: a first round on fresh pools (every plane checked on the decode), then
``KVMEM_BENCH_SGL_REPEATS`` (5) rounds of the raw write and of sglang's transfer,
alternating; a round of sglang's transfer is timed from the first ``sender.send`` to the
last room Success on both sides.  A row: the median of the rounds and their spread,
the median ratio of each round to the raw write just before it, sglang's descriptors per
request as NIXL was asked for them (counted on the prefill's agent), the NIXL
registrations, the first round, pool creation and first fill times, and how much CPU
*other* processes used meanwhile (on this 2-core machine anything above
``LOADED_CORES`` is flagged ``under_load``: no measurement of a target).

On Mooncake the modes are stock, the flag, and the flag on the prefill alone
(:data:`MOONCAKE_MODES`); the flag sends on kvmem's Mooncake path
(``kvmem_sglang.mooncake_send``: merged slices, calls within the TCP queue).  Mooncake's
pairs run with ``.venv-e2e``'s interpreter (``make venv-e2e``).  The pairs here are at
TP 1; ``python -m bench.sglang_pair --tp 2x1,2x2`` measures TP 2 prefills (each rank a
process with its share of the heads).

``KVMEM_BENCH_SGL_REQUESTS`` / ``_TOKENS`` / ``_PAGES`` / ``_MODES`` (comma-separated
MODES keys) / ``_BACKENDS`` (``nixl,mooncake``) change the run; ``python -m bench.sglang_pair`` runs the same and prints a
compact table.  The smoke mode: a 2-layer model, 4 requests x 64 tokens, one round,
page size 16 alone, the flag on both backends (the modes differ only in their
variables; tests/sglang/test_transfer_path.py moves pages of size 1 and 16 for real), its
processes forked from the fork servers the smoke test names (``run_mode``'s ``forked``).
"""

from __future__ import annotations

import os
import statistics

import pytest

from bench.conftest import SMOKE, pick
from bench.sglang_pair import MODES, run_mode, table
from testkit.sglang_pair import Shape

# Others' CPU from which a figure is flagged (cores): a guess, as in bench_demo.py.
LOADED_CORES = 0.25
SHAPE = pick(
    Shape(
        requests=int(os.environ.get("KVMEM_BENCH_SGL_REQUESTS", "32")),
        tokens=int(os.environ.get("KVMEM_BENCH_SGL_TOKENS", "1024")),
    ),
    Shape(layers=2, requests=4, tokens=64, page_size=4),
)
PAGES = [int(p) for p in os.environ.get("KVMEM_BENCH_SGL_PAGES", pick("1,16,64", "16")).split(",")]
REPEATS = pick(int(os.environ.get("KVMEM_BENCH_SGL_REPEATS", "5")), 1)
_MODES = os.environ.get("KVMEM_BENCH_SGL_MODES")
MOONCAKE_MODES = ["stock", "kvmem", "kvmem prefill + stock decode"]
BACKENDS = os.environ.get("KVMEM_BENCH_SGL_BACKENDS", "nixl,mooncake").split(",")
RUNS = [
    (b, m)
    for b in BACKENDS
    for m in (
        [m for m in _MODES.split(",") if m]
        if _MODES
        else pick(list(MODES) if b == "nixl" else MOONCAKE_MODES, ["kvmem"])
    )
]
_RESULTS: list[dict] = []


def _row(report, r: dict) -> None:
    ps = r["shape"]["page_size"]
    sg = [x["gbps"] for x in r["sglang"]]
    med = statistics.median(sg)
    nbytes = r["sglang"][0]["nbytes"]
    loaded = r["others_cpu_cores"] > LOADED_CORES
    flag = f" UNDER LOAD (others {r['others_cpu_cores']:.2f} cores)" if loaded else ""
    over = "" if r["backend"] == "nixl" else f" over {r['backend']}"
    group = (
        f"sglang PD transfer{over}, page {ps}: {r['shape']['requests']} requests x "
        f"{r['shape']['tokens']} tokens, {r['shape']['layers']} layers"
    )
    ratio = statistics.median(r["ratio_to_raw"])
    desc = statistics.median(x["kv_descriptors_per_request"] for x in r["sglang"])
    name = "stock sglang" if r["mode"] == "stock" else r["mode"]
    extra = dict(
        mode=r["mode"],
        backend=r["backend"],
        page_size=ps,
        ratio_to_raw=ratio,
        ratio_spread=[min(r["ratio_to_raw"]), max(r["ratio_to_raw"])],
        gbps_spread=[min(sg), max(sg)],
        kv_descriptors_per_request=desc,
        engine_writes_per_round=statistics.median(x["engine_writes"] for x in r["sglang"]),
        registrations=r["registrations"],
        first_gbps=r["first"]["gbps"],
        pool_create_s=r["pool_create_s"],
        fill_s=r["fill_s"],
        decode_pool_create_s=r["decode_pool_create_s"],
        kvmem_pool=r["kvmem_pool"],
        kvmem_transfer=r.get("kvmem_transfer"),
        others_cpu_cores=r["others_cpu_cores"],
        under_load=loaded,
        loadavg=r["loadavg"],
    )
    report.groups[group].append(
        dict(
            name=f"{name}: {med:.2f} GB/s, {ratio:.2f}x raw, {desc:.0f} descriptors/request" + flag,
            median_s=nbytes / med / 1e9,
            nbytes=nbytes,
            gb_per_s=med,
            **extra,
        )
    )
    raw = statistics.median(x["gbps"] for x in r["raw"])
    report.groups[group].append(
        dict(
            name=f"raw {'NIXL' if r['backend'] == 'nixl' else 'Mooncake'} write, same processes "
            f"({r['mode']}): {raw:.2f} GB/s" + flag,
            median_s=nbytes / raw / 1e9,
            nbytes=nbytes,
            gb_per_s=raw,
            mode=r["mode"],
            backend=r["backend"],
            page_size=ps,
            role="raw",
            others_cpu_cores=r["others_cpu_cores"],
        )
    )


@pytest.mark.parametrize("backend,mode", RUNS, ids=[f"{b}-{m}" for b, m in RUNS])
def test_sglang_transfer(benchmark, report, backend, mode):
    results = []

    def one():
        results.extend(
            run_mode(mode, PAGES, SHAPE, REPEATS, one_process=SMOKE, backend=backend, forked=SMOKE)
        )

    benchmark.pedantic(one, rounds=1, iterations=1)
    assert [r["shape"]["page_size"] for r in results] == PAGES
    for r in results:
        rounds = [r["first"]] + r["sglang"]
        assert all(x["bad_rows"] == 0 for x in rounds), [x["bad_rows"] for x in rounds]
        assert all(
            set(x["prefill_states"]) == {4} and set(x["decode_states"]) == {4} for x in rounds
        ), "a room did not end Success"
        assert r["kvmem_pool"]["prefill"] == (MODES[mode][0]["SGLANG_KVMEM"] == "1")
        assert r["kvmem_pool"]["decode"] == (MODES[mode][1]["SGLANG_KVMEM"] == "1")
        _row(report, r)
    _RESULTS.extend(results)
    benchmark.extra_info.update(table=table(results))


def test_sglang_transfer_table(report):
    """The compact table of everything measured above (printed in the session report)."""
    if not _RESULTS:
        pytest.fail("no sglang transfer results (the mode tests did not run)")
    lines = table(_RESULTS)
    report.groups["sglang PD transfer: table"].append(
        dict(name="\n      " + "\n      ".join(lines), median_s=1.0, nbytes=None)
    )
