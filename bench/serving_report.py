"""The serving benchmark's results file (bench/serving.py writes it, ``serving-cpu.json``
in ``make bench``'s bench/results/): its schema, the summary computed from its runs,
the table printed from that summary, and a check of a file's shape.  Plain Python, no
sglang: bench/figures.py (the README's figures) and the tests read it with the main
environment.

A *run* is one call of sglang's serving benchmark on one pair (backend, kind) at one
cell (prompt length, answer length, concurrency), recorded with the benchmark's
medians and percentiles of TTFT, ITL, end-to-end latency and TPOT (ms), its throughputs,
the decode's mean running batch, and the machine's load (bench/serving_load.py).  The
summary takes, per backend and cell, each kind's median over the rounds of each run's
figure with the rounds' min and max (the spread), and the ratio flag / stock of the runs
of one round (the two kinds ran back to back), its median over the rounds, min and max,
and in how many rounds the flag's figure was the lower.  Below 1 the flag's latency is
the lower; above 1 its throughput is the higher.

A *cycle* is the release/resume measurement: a window of runs before the release, the
release and resume of the KV cache on both servers, and a window after the resume; its
summary sets, per backend and kind, the TTFT and ITL after the resume against those
before the release (the ratio after / before of each cycle), and the first batch after
the resume (the first ``concurrency`` requests, sent at once to an idle pair) against
the first batch of the window before (the same burst on a pair that was not released).
"""

from __future__ import annotations

import statistics

SCHEMA = 1
KINDS = ("stock", "flag")
# summary figure -> how to read it from a run record
FIGURES = {
    "ttft_median_ms": lambda r: r["ttft_ms"]["median"],
    "ttft_p99_ms": lambda r: r["ttft_ms"]["p99"],
    "itl_median_ms": lambda r: r["itl_ms"]["median"],
    "itl_p99_ms": lambda r: r["itl_ms"]["p99"],
    "e2e_median_ms": lambda r: r["e2e_latency_ms"]["median"],
    "output_tok_s": lambda r: r["output_throughput"],
    "request_per_s": lambda r: r["request_throughput"],
    "decode_batch_mean": lambda r: r["decode_batch_mean"],
}
# the keys every run record has (check())
RUN_KEYS = {
    "backend",
    "kind",
    "round",
    "seq",
    "cell",
    "seed",
    "completed",
    "failed",
    "ttft_ms",
    "itl_ms",
    "e2e_latency_ms",
    "tpot_ms",
    "output_throughput",
    "request_throughput",
    "total_throughput",
    "decode_batch_mean",
    "loadavg_before",
    "loadavg_after",
    "others_cores",
    "steal_cores",
    "loaded",
}
CYCLE_KEYS = {
    "backend",
    "kind",
    "cycle",
    "release_s",
    "resume_s",
    "given_back_mib",
    "before",
    "after",
    "loaded",
}


def spread(xs: list[float]) -> dict | None:
    xs = [x for x in xs if x is not None]
    if not xs:
        return None
    return dict(median=statistics.median(xs), min=min(xs), max=max(xs), n=len(xs))


def _cell_key(run: dict) -> tuple:
    c = run["cell"]
    return (run["backend"], c["input_len"], c["output_len"], c["concurrency"])


def summarize_cells(runs: list[dict]) -> list[dict]:
    """One entry per (backend, cell), in the order first run: each kind's figures over
    the rounds and the per-round ratio flag / stock (module docstring)."""
    cells: dict[tuple, list[dict]] = {}
    for r in runs:
        cells.setdefault(_cell_key(r), []).append(r)
    out = []
    for (backend, inp, outp, conc), rs in cells.items():
        entry = dict(
            backend=backend,
            input_len=inp,
            output_len=outp,
            concurrency=conc,
            loaded_runs=sum(bool(r["loaded"]) for r in rs),
            failed_requests=sum(r["failed"] for r in rs),
            kinds={},
            ratio={},
        )
        by_round = {k: {r["round"]: r for r in rs if r["kind"] == k} for k in KINDS}
        for k in KINDS:
            entry["kinds"][k] = {
                f: spread([get(r) for r in by_round[k].values()]) for f, get in FIGURES.items()
            }
        both = sorted(set(by_round["stock"]) & set(by_round["flag"]))
        for f, get in FIGURES.items():
            pairs = [(get(by_round["flag"][n]), get(by_round["stock"][n])) for n in both]
            pairs = [(a, b) for a, b in pairs if a is not None and b]
            s = spread([a / b for a, b in pairs])
            if s is not None:
                s["flag_lower_in"] = sum(1 for a, b in pairs if a < b)
            entry["ratio"][f] = s
        out.append(entry)
    return out


def summarize_cycles(cycles: list[dict]) -> list[dict]:
    """One entry per (backend, kind): over the cycles, TTFT and ITL before the release
    and in the window after the resume, the first batch of each window, and the ratios
    after / before of each cycle."""
    groups: dict[tuple, list[dict]] = {}
    for c in cycles:
        groups.setdefault((c["backend"], c["kind"]), []).append(c)
    out = []
    for (backend, kind), cs in groups.items():
        e = dict(
            backend=backend, kind=kind, cycles=len(cs), loaded=sum(bool(c["loaded"]) for c in cs)
        )
        for what, get in (
            ("ttft_median_ms", lambda w: w["ttft_ms"]["median"]),
            ("ttft_p99_ms", lambda w: w["ttft_ms"]["p99"]),
            ("itl_median_ms", lambda w: w["itl_ms"]["median"]),
            ("itl_p99_ms", lambda w: w["itl_ms"]["p99"]),
        ):
            before = [get(c["before"]["window"]) for c in cs]
            after = [get(c["after"]["window"]) for c in cs]
            first0 = [get(c["before"]["first"]) for c in cs]
            first = [get(c["after"]["first"]) for c in cs]
            e[what] = dict(
                before=spread(before),
                after=spread(after),
                first_batch_before=spread(first0),
                first_batch=spread(first),
                after_over_before=spread([a / b for a, b in zip(after, before) if a and b]),
                first_over_before=spread([a / b for a, b in zip(first, first0) if a and b]),
            )
        e["release_s"] = spread([max(c["release_s"].values()) for c in cs])
        e["resume_s"] = spread([max(c["resume_s"].values()) for c in cs])
        e["given_back_mib"] = spread([min(c["given_back_mib"].values()) for c in cs])
        out.append(e)
    return out


def summarize(results: dict) -> dict:
    return dict(
        cells=summarize_cells(results.get("runs", [])),
        resume=summarize_cycles(results.get("cycles", [])),
    )


def _f(x: float | None, nd: int = 1) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def _med(s: dict | None, nd: int = 1) -> str:
    return "-" if s is None else _f(s["median"], nd)


def _ratio(s: dict | None) -> str:
    if s is None:
        return "-"
    return f"{s['median']:.2f}x [{s['min']:.2f}-{s['max']:.2f}]"


COLUMNS = (  # (figure, header, decimals)
    ("ttft_median_ms", "TTFT ms", 1),
    ("itl_median_ms", "ITL ms", 2),
    ("e2e_median_ms", "E2E ms", 0),
    ("output_tok_s", "out tok/s", 0),
)


def table(summary: dict) -> list[str]:
    """The summary as text: per backend and cell, stock's and the flag's medians over the
    rounds and the ratio flag / stock (median [min-max] over rounds) of TTFT, ITL,
    end-to-end latency and output throughput, the decode's mean batch; then the
    release/resume cycle."""
    lines = []
    head = (
        f"{'backend':<9}{'in':>5}{'out':>4}{'c':>4} "
        + " ".join(f"| {h:<30}" for _, h, _ in COLUMNS)
        + " | batch s/f  | load"
    )
    lines += [head, "-" * len(head)]
    for c in summary["cells"]:
        k = c["kinds"]
        parts = []
        for f, _, nd in COLUMNS:
            parts.append(
                f"| {_med(k['stock'][f], nd):>7} {_med(k['flag'][f], nd):>7} "
                f"{_ratio(c['ratio'][f]):<15}"
            )
        batch = f"{_med(k['stock']['decode_batch_mean'])}/{_med(k['flag']['decode_batch_mean'])}"
        loaded = f"{c['loaded_runs']} loaded" if c["loaded_runs"] else "quiet"
        lines.append(
            f"{c['backend']:<9}{c['input_len']:>5}{c['output_len']:>4}{c['concurrency']:>4} "
            + " ".join(parts)
            + f" | {batch:<10} | {loaded}"
        )
    lines.append("(each cell: stock's median, the flag's median, flag / stock over the rounds)")
    if summary["resume"]:
        lines.append("")
        lines.append(
            "release/resume cycle: TTFT and ITL medians in the window before the release and "
            "in the window after the resume, and of each window's first batch (ms; after / "
            "before)"
        )
        for e in summary["resume"]:
            t, i = e["ttft_median_ms"], e["itl_median_ms"]
            lines.append(
                f"  {e['backend']:<9}{e['kind']:<6} TTFT {_med(t['before'])} -> "
                f"{_med(t['after'])} ({_ratio(t['after_over_before'])}), first batch "
                f"{_med(t['first_batch_before'])} -> {_med(t['first_batch'])} "
                f"({_ratio(t['first_over_before'])}); ITL "
                f"{_med(i['before'], 2)} -> {_med(i['after'], 2)} "
                f"({_ratio(i['after_over_before'])}); release {_med(e['release_s'], 2)} s, "
                f"resume {_med(e['resume_s'], 2)} s, given back "
                f"{_med(e['given_back_mib'])} MiB; {e['cycles']} cycles"
                + (f", {e['loaded']} loaded" if e["loaded"] else "")
            )
    return lines


def check(results: dict) -> list[str]:
    """What is wrong with a results file's shape (empty: nothing): the top-level keys,
    every run's and every cycle's keys, stock and the flag in every cell, and a summary
    that is the one its runs give."""
    bad = []
    for key in ("bench", "schema", "time", "device", "smoke", "partial", "config", "gate"):
        if key not in results:
            bad.append(f"no {key!r}")
    if results.get("bench") != "serving" or results.get("schema") != SCHEMA:
        bad.append(f"not a serving results file of schema {SCHEMA}")
    for r in results.get("runs", []):
        missing = RUN_KEYS - set(r)
        if missing:
            bad.append(f"run {r.get('seq')}: no {sorted(missing)}")
    for c in results.get("cycles", []):
        missing = CYCLE_KEYS - set(c)
        if missing:
            bad.append(f"cycle {c.get('backend')}/{c.get('kind')}: no {sorted(missing)}")
    if not bad:
        for cell in summarize_cells(results.get("runs", [])):
            absent = [k for k in KINDS if cell["kinds"][k]["ttft_median_ms"] is None]
            if absent:
                bad.append(f"{cell['backend']} c{cell['concurrency']}: no {absent} runs")
        if results.get("summary") != summarize(results):
            bad.append("the stored summary is not the one its runs give")
    return bad
