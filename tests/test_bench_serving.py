"""The serving benchmark's plumbing without servers (bench/serving.py runs them; its smoke
run is in test_bench_smoke.py): the summary of a results file (medians over rounds,
their spread, the per-round ratio flag / stock), the check of a file's shape, the order
of the runs (the kinds interleaved), the plots drawn from a small results file made
here, and the quiet gate (a loaded machine refused or flagged; our own servers' CPU never
counted as others')."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import time

import pytest

from bench import serving_load, serving_report

STATS = ("median", "mean", "p90", "p99")


def _stats(median: float) -> dict:
    return dict(median=median, mean=median * 1.1, p90=median * 1.5, p99=median * 2)


def _run(seq, kind, rnd, inp, conc, ttft, itl, tok_s) -> dict:
    return dict(
        backend="nixl",
        kind=kind,
        round=rnd,
        seq=seq,
        cell=dict(input_len=inp, output_len=32, concurrency=conc, prompts=8 * conc),
        seed=1 + 1000 * rnd,
        time="12:00:00",
        completed=8 * conc,
        failed=0,
        errors=[],
        ttft_ms=_stats(ttft),
        itl_ms=_stats(itl),
        e2e_latency_ms=_stats(ttft + 31 * itl),
        tpot_ms=_stats(itl),
        output_throughput=tok_s,
        request_throughput=tok_s / 32,
        total_throughput=tok_s * 2,
        decode_batch_mean=conc * 0.9,
        loadavg_before=[0.4, 0.5],
        loadavg_after=[1.2, 0.7],
        others_cores=0.05,
        ours_cores=1.8,
        steal_cores=0.0,
        loaded=False,
    )


def _window(ttft, itl, first) -> dict:
    pooled = dict(ttft_ms=_stats(ttft), itl_ms=_stats(itl), requests=16)
    slice_ = dict(offset_s=0.0, duration_s=2.0, failed=0, ttft_ms=_stats(ttft), itl_ms=_stats(itl))
    return dict(window=pooled, first=dict(pooled, ttft_ms=_stats(first)), slices=[slice_])


def fixture_results() -> dict:
    """A results file of two rounds on NIXL, prompts of 128 and 1024 tokens at
    concurrency 1 and 4, and one release/resume cycle per kind.  Round 0: the flag's
    TTFT 0.8 of stock's, round 1: 0.9; ITL and throughput equal."""
    runs, seq = [], 0
    for rnd, f in ((0, 0.8), (1, 0.9)):
        for inp in (128, 1024):
            for conc in (1, 4):
                for kind in ("stock", "flag"):
                    seq += 1
                    base = 10.0 * conc + inp / 128
                    ttft = base * (f if kind == "flag" else 1.0)
                    runs.append(_run(seq, kind, rnd, inp, conc, ttft, 2.5, 100.0 * conc))
    cycles = [
        dict(
            backend="nixl",
            kind=kind,
            cycle=0,
            seq=100,
            release_s=dict(prefill=0.5, decode=0.25),
            resume_s=dict(prefill=0.125, decode=0.75),
            given_back_mib=dict(prefill=back, decode=back),
            before=_window(20.0, 2.5, 30.0),
            after=_window(20.0 * slow, 2.5, 30.0 * first),
            loaded=False,
        )
        for kind, slow, first, back in (("stock", 1.0, 1.0, 0.0), ("flag", 1.25, 4.0, 34.0))
    ]
    results = dict(
        bench="serving",
        schema=serving_report.SCHEMA,
        time="2026-12-08T03:00:00",
        device="CPU x86_64 x2",
        device_type="cpu",
        sglang="0.5.23",
        smoke=False,
        partial=False,
        refused=None,
        note="",
        config=dict(
            backends=["nixl"],
            rounds=2,
            order="interleaved",
            cells=[],
            resume=dict(cycles=1),
        ),
        gate=dict(max_load=1.5, max_others=0.5, at_start=dict(loadavg=0.3, loaded=False)),
        runs=runs,
        cycles=cycles,
    )
    results["summary"] = serving_report.summarize(results)
    return results


def test_summary_takes_medians_over_rounds_and_per_round_ratios():
    s = serving_report.summarize(fixture_results())
    cells = {(c["input_len"], c["concurrency"]): c for c in s["cells"]}
    assert list(cells) == [(128, 1), (128, 4), (1024, 1), (1024, 4)]
    c = cells[(1024, 4)]
    assert c["kinds"]["stock"]["ttft_median_ms"] == dict(median=48.0, min=48.0, max=48.0, n=2)
    flag = c["kinds"]["flag"]["ttft_median_ms"]
    assert flag == dict(median=pytest.approx(40.8), min=pytest.approx(38.4), max=43.2, n=2)
    ratio = c["ratio"]["ttft_median_ms"]
    assert ratio["median"] == pytest.approx(0.85) and ratio["n"] == 2
    assert (ratio["min"], ratio["max"]) == (pytest.approx(0.8), pytest.approx(0.9))
    assert ratio["flag_lower_in"] == 2
    assert c["ratio"]["itl_median_ms"]["median"] == 1.0
    assert c["ratio"]["itl_median_ms"]["flag_lower_in"] == 0
    assert c["kinds"]["flag"]["decode_batch_mean"]["median"] == pytest.approx(3.6)
    (stock, flag) = s["resume"]
    assert flag["kind"] == "flag" and flag["ttft_median_ms"]["after_over_before"]["median"] == 1.25
    assert flag["ttft_median_ms"]["first_over_before"]["median"] == 4.0
    assert flag["release_s"]["median"] == 0.5 and flag["resume_s"]["median"] == 0.75
    assert stock["given_back_mib"]["median"] == 0.0 and flag["given_back_mib"]["median"] == 34.0
    lines = serving_report.table(s)
    assert any(line.startswith("nixl      1024  32   4 ") for line in lines), lines
    assert any("0.85x [0.80-0.90]" in line for line in lines), lines


def test_check_finds_what_a_file_lacks():
    good = fixture_results()
    assert serving_report.check(json.loads(json.dumps(good))) == []
    bad = copy.deepcopy(good)
    del bad["runs"][3]["others_cores"]
    assert any("no ['others_cores']" in x for x in serving_report.check(bad))
    stale = copy.deepcopy(good)
    stale["runs"][0]["ttft_ms"]["median"] += 1
    assert serving_report.check(stale) == ["the stored summary is not the one its runs give"]
    one_kind = copy.deepcopy(good)
    one_kind["runs"] = [r for r in one_kind["runs"] if r["kind"] == "stock"]
    one_kind["summary"] = serving_report.summarize(one_kind)
    assert any("no ['flag'] runs" in x for x in serving_report.check(one_kind))


def test_plan_interleaves_the_kinds_and_alternates_which_goes_first():
    """Both pairs of a backend up before its first run; each cell of a round on stock and
    the flag back to back with the same prompts (seed), the first kind alternating; new
    prompts every other run; the cycles after the sweep; ``--one-pair-at-a-time`` never
    has two pairs up."""
    from bench import serving

    a = serving.parse(
        ["--out", "x", "--rounds", "2", "--concurrency", "1,4", "--input-lens", "128"]
    )
    steps = serving.plan(a)
    nixl = steps[: steps.index(("stop",)) + 1]
    assert nixl[:2] == [("pair", "nixl", "stock"), ("pair", "nixl", "flag")]
    runs = [s for s in nixl if s[0] == "run"]
    assert [(s[2], s[3], s[4].concurrency, s[4].prompts) for s in runs] == [
        ("stock", 0, 1, 16),
        ("flag", 0, 1, 16),
        ("flag", 0, 4, 32),
        ("stock", 0, 4, 32),
        ("flag", 1, 1, 16),
        ("stock", 1, 1, 16),
        ("stock", 1, 4, 32),
        ("flag", 1, 4, 32),
    ]
    seeds: dict = {}
    for s in runs:
        seeds.setdefault((s[3], s[4]), set()).add(s[5])
    assert all(len(v) == 1 for v in seeds.values())
    assert len({min(v) for v in seeds.values()}) == len(seeds) == 4
    cycles = [(s[2], s[3]) for s in nixl if s[0] == "cycle"]
    assert cycles == [("stock", 0), ("flag", 0), ("flag", 1), ("stock", 1)]
    mooncake = steps[len(nixl) :]
    assert mooncake[:2] == [("pair", "mooncake", "flag"), ("pair", "mooncake", "stock")]
    assert mooncake[-1] == ("stop",) and len(mooncake) == len(nixl)

    one = serving.plan(serving.parse(["--out", "x", "--one-pair-at-a-time"]))
    up = 0
    for s in one:
        up = 0 if s[0] == "stop" else up + (s[0] == "pair")
        assert up <= 1
    default = serving.plan(serving.parse(["--out", "x"]))
    assert sum(s[0] == "run" for s in one) == sum(s[0] == "run" for s in default) == 2 * 2 * 3 * 8

    smoke = serving.parse(["--out", "x", "--smoke"])
    assert smoke.backends == ["nixl"] and smoke.one_pair_at_a_time and smoke.allow_load
    assert [s[0] for s in serving.plan(smoke)] == [
        "pair",
        "run",
        "cycle",
        "stop",
        "pair",
        "run",
        "cycle",
        "stop",
    ]


def test_plots_drawn_from_a_results_file(tmp_path):
    path = tmp_path / "serving-cpu.json"
    path.write_text(json.dumps(fixture_results()))
    from bench import plot

    written = plot.plot_file(str(path), str(tmp_path))
    names = sorted(os.path.basename(p) for p in written)
    assert names == ["cpu-serving-batch.png", "cpu-serving-resume.png", "cpu-serving.png"]
    assert all(os.path.getsize(p) > 10_000 for p in written)


def test_gate_refuses_a_loaded_machine_or_flags_it(monkeypatch):
    monkeypatch.setattr(os, "getloadavg", lambda: (3.0, 2.0, 1.0))
    gate = serving_load.Gate(max_load=1.5, wait_s=0.0, allow_load=False, log=lambda *_: None)
    with pytest.raises(serving_load.NotQuiet, match="load average 3.00 > 1.5"):
        gate.before_start()
    gate.allow_load = True
    assert gate.before_start() == dict(loadavg=3.0, loaded=True)
    monkeypatch.setattr(os, "getloadavg", lambda: (1.0, 2.0, 1.0))
    gate.allow_load = False
    assert gate.before_start() == dict(loadavg=1.0, loaded=False)
    assert gate.flag(dict(others_cores=0.6), dict(loaded_before=False))
    assert not gate.flag(dict(others_cores=0.4), dict(loaded_before=False))
    assert gate.flag(dict(others_cores=0.0), dict(loaded_before=True))


def test_gate_variables(monkeypatch):
    monkeypatch.setenv("KVMEM_SERVING_MAX_LOAD", "0.75")
    monkeypatch.setenv("KVMEM_SERVING_MAX_OTHERS", "0.25")
    monkeypatch.setenv("KVMEM_SERVING_QUIET_WAIT_S", "7")
    monkeypatch.setenv("KVMEM_SERVING_ALLOW_LOAD", "1")
    g = serving_load.Gate()
    assert g.as_dict() == dict(max_load=0.75, max_others=0.25, wait_s=7.0, allow_load=True)


@pytest.mark.subprocess
def test_our_servers_cpu_is_not_counted_as_others():
    """A busy process in a process group the window is told of (as a server's) is ours;
    outside it the same process counts as others'."""
    spin = "import time\nt = time.monotonic()\nwhile time.monotonic() - t < 3.0: pass"
    got = {}
    for named in (True, False):
        p = subprocess.Popen([sys.executable, "-c", spin], start_new_session=True)
        try:
            time.sleep(0.3)
            w = serving_load.Window({p.pid} if named else set()).open()
            time.sleep(1.5)  # the window closes while it still spins
            got[named] = w.close()
        finally:
            p.kill()
            p.wait()
    # the spinner takes up to a core (less on a loaded machine); this process sleeps
    assert got[True]["ours_cores"] >= 0.2, got
    assert got[False]["ours_cores"] < 0.1 and got[False]["others_cores"] >= 0.2, got
