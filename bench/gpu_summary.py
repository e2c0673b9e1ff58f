"""One screen at the end of bench/gpu_check.sh: every step, every target of the benchmarks
against what this run measured, and the figures the plots draw, in about 50 lines.

    python -m bench.gpu_summary DIR

DIR is a gpu_check work folder: ``steps.tsv`` (the step runner's table), ``env.txt``
and, where the benchmark step ran, ``bench-cuda.json`` or ``bench-cpu.json``
(bench/conftest.py's report).  Standard library only (it runs after the steps, in a
second or so).  A target reads ``PASS``, ``FAIL``, or ``n/a`` with why (its rows are
absent: the step did not run, or the benchmark was left out); a smoke run (``make
test``'s tiny sizes) says that its figures mean nothing, and a partial report (the step
was stopped before its end; bench/conftest.py writes the rows as they are measured) says
so.  Exit status 0 (the summary reports, it does not judge: gpu_check.sh's own status
says whether a step failed).

The targets (each benchmark's docstring says where it comes from):

    GPU  pack and unpack, gqa-bf16, chunks >= 1 MiB: >= 85% of the plain copy
         pack and unpack, fp8 MLA, page size >= 16: >= 90% of the plain copy;
         page size 1 is reported beside it, without a target
         release of 64 GiB under 50 ms, resume under 300 ms, each >= 5x faster than
         freeing / allocating the same bytes (bench_release.py)
         alloc_extend of 256 requests, check=False: under 30 us (bench_allocator.py)
    CPU  pack and unpack >= 0.5x the plain copy at page size >= 16; pack >= 3x faster
         than the per-layer gather at page size 1
         release of 2 GiB under 150 ms; resume at least as fast as allocating and
         touching the same bytes (bench_release.py)
"""

from __future__ import annotations

import csv
import json
import os
import sys

MiB, GiB = 1 << 20, 1 << 30
WIDTH = 100


def _steps(folder: str) -> list[dict]:
    path = os.path.join(folder, "steps.tsv")
    if not os.path.exists(path):
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f, delimiter="\t"))


def _report(folder: str) -> dict | None:
    for name in ("bench-cuda.json", "bench-cpu.json"):
        path = os.path.join(folder, name)
        if os.path.exists(path):
            with open(path) as f:
                return json.load(f)
    return None


def _cut(line: str) -> str:
    return line if len(line) <= WIDTH else line[: WIDTH - 3] + "..."


# -- the rows ------------------------------------------------------------------------------


def _pack_ratios(report: dict, model: str, op: str) -> list[dict]:
    """One entry per pack group of ``model`` and ``op``: page size, bytes, kvmem GB/s, and
    kvmem's bandwidth over the plain copy's and over the baseline's in that group."""
    out = []
    for rows in report["groups"].values():
        if not rows or rows[0].get("figure") != "pack" or rows[0].get("op") != op:
            continue
        if rows[0].get("model", "gqa-bf16") != model:
            continue
        by_role = {r["role"]: r for r in rows}
        k = by_role.get("kvmem")
        if k is None:
            continue
        ceil, base = by_role.get("ceiling"), by_role.get("baseline")
        out.append(
            dict(
                ps=k["page_size"],
                nbytes=k["nbytes"],
                gbs=k["gb_per_s"],
                of_copy=k["gb_per_s"] / ceil["gb_per_s"] if ceil else None,
                of_base=k["gb_per_s"] / base["gb_per_s"] if base else None,
            )
        )
    return sorted(out, key=lambda e: (e["ps"], e["nbytes"]))


def _row(report: dict, group: str, role: str) -> dict | None:
    rows = report["groups"].get(group, [])
    return next((r for r in rows if r.get("role") == role), None)


def _worst(entries: list[dict], key: str) -> dict | None:
    have = [e for e in entries if e[key] is not None]
    return min(have, key=lambda e: e[key]) if have else None


def _size(nbytes: int) -> str:
    """A chunk's size in a few characters: 72K, 1M, 34.3M, 512M."""
    if nbytes < MiB:
        return f"{nbytes / 1024:.3g}K"
    return f"{nbytes / MiB:.3g}M"


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def _ms(s: float) -> str:
    return f"{s * 1e3:.1f} ms" if s >= 1e-3 else f"{s * 1e6:.1f} us"


# -- targets ------------------------------------------------------------------------------


def _verdict(ok: bool | None) -> str:
    return {True: "PASS", False: "FAIL", None: "n/a "}[ok]


def _ratio_target(
    report, model: str, floor: float, sizes, min_bytes: int, what: str, aside=None
) -> list[str]:
    """Lines for 'kvmem >= floor x the plain copy' per op, worst chunk per page size."""
    lines = []
    for op in ("pack", "unpack"):
        entries = [
            e
            for e in _pack_ratios(report, model, op)
            if e["nbytes"] >= min_bytes and e["of_copy"] is not None
        ]
        parts, ok = [], None
        for ps in sizes:
            w = _worst([e for e in entries if e["ps"] == ps], "of_copy")
            if w is None:
                continue
            good = w["of_copy"] >= floor
            ok = good if ok is None else (ok and good)
            parts.append(f"P{ps} {_pct(w['of_copy'])} ({_size(w['nbytes'])})")
        if aside is not None:
            w = _worst([e for e in entries if e["ps"] == aside], "of_copy")
            if w is not None:
                parts.append(f"[P{aside} {_pct(w['of_copy'])}, no target]")
        shown = ", ".join(parts) if parts else "no rows"
        lines.append(f"{_verdict(ok)}  {op} {what} >= {_pct(floor)} of copy: {shown}")
    return lines


def _time_target(report, group: str, limit_s: float, speedup: float | None, what: str) -> str:
    k, base = _row(report, group, "kvmem"), _row(report, group, "baseline")
    if k is None:
        return f"n/a   {what}: no row '{group}'"
    ok = k["median_s"] < limit_s if limit_s else True
    text = f"{_ms(k['median_s'])}"
    if limit_s:
        text += f" (limit {_ms(limit_s)})"
    if base is not None:
        x = base["median_s"] / k["median_s"]
        text += f", {x:.1f}x faster than its baseline"
        if speedup is not None:
            ok = ok and x >= speedup
    elif speedup is not None:
        ok, text = None, text + ", no baseline row"
    return f"{_verdict(ok)}  {what}: {text}"


def targets(report: dict) -> list[str]:
    """One line per target (module docstring) against ``report``."""
    if report.get("device_type") == "cuda":
        lines = _ratio_target(
            report, "gqa-bf16", 0.85, (1, 16, 64), MiB, "gqa-bf16, chunks >= 1 MiB,"
        )
        lines += _ratio_target(report, "mla-fp8", 0.90, (16, 64), 0, "fp8 MLA,", aside=1)
        lines.append(_time_target(report, "release 64 GiB", 0.050, 5, "release 64 GiB"))
        lines.append(_time_target(report, "resume 64 GiB", 0.300, 5, "resume 64 GiB"))
        lines.append(
            _time_target(
                report,
                "alloc_extend alone, 256 requests x ~125 tokens, P16, check=False",
                30e-6,
                None,
                "alloc_extend of 256 requests, check=False",
            )
        )
        return lines
    lines = _ratio_target(report, "gqa-bf16", 0.5, (16, 64), 0, "gqa-bf16, page size >= 16,")
    entries = _pack_ratios(report, "gqa-bf16", "pack")
    w = _worst([e for e in entries if e["ps"] == 1], "of_base")
    ok = None if w is None else w["of_base"] >= 3
    shown = "no rows" if w is None else f"worst {w['of_base']:.1f}x ({_size(w['nbytes'])})"
    lines.append(f"{_verdict(ok)}  pack P1 >= 3x faster than the per-layer gather: {shown}")
    lines.append(_time_target(report, "release 2 GiB", 0.150, None, "release 2 GiB"))
    lines.append(_time_target(report, "resume 2 GiB", 0, 1, "resume 2 GiB"))
    return lines


# -- figures ------------------------------------------------------------------------------


def figures(report: dict) -> list[str]:
    """The numbers behind each plot, compactly: GB/s and share of the copy per chunk for
    pack/unpack; medians and ratios for the others."""
    lines = []
    models = list(
        dict.fromkeys(
            r.get("model", "gqa-bf16")
            for rows in report["groups"].values()
            for r in rows
            if r.get("figure") == "pack"
        )
    )
    for model in models:
        for op in ("pack", "unpack"):
            entries = _pack_ratios(report, model, op)
            for ps in sorted({e["ps"] for e in entries}):
                cells = [
                    f"{_size(e['nbytes'])} {e['gbs']:.3g} GB/s"
                    + (f" {_pct(e['of_copy'])}" if e["of_copy"] is not None else "")
                    for e in entries
                    if e["ps"] == ps
                ]
                lines.append(_cut(f"{op} {model} P{ps}: " + " | ".join(cells)))
    for group, rows in report["groups"].items():
        fig = rows[0].get("figure") if rows else None
        mine = [r for r in rows if r.get("role") == "kvmem"]
        if fig in (None, "pack") or not mine:
            continue
        k = mine[0]
        text = _ms(k["median_s"]) + (f" {k['gb_per_s']:.1f} GB/s" if k.get("gb_per_s") else "")
        base = next((r for r in rows if r.get("role") == "baseline"), None)
        if base is not None:
            text += f", {base['median_s'] / k['median_s']:.2f}x the baseline's speed"
        for other in mine[1:]:  # e.g. check=False beside check=True
            text += f"; {other['name']} {_ms(other['median_s'])}"
        lines.append(_cut(f"{fig}: {group}: {text}"))
    return lines


# -- the screen -----------------------------------------------------------------------------


def screen(folder: str) -> list[str]:
    out = []
    report = _report(folder)
    env = os.path.join(folder, "env.txt")
    head = "gpu_check summary"
    if report is not None:
        head += f": {report['device']}, torch {report.get('torch', '?')}, {report.get('time', '?')}"
    out.append(_cut(head))
    if os.path.exists(env):
        with open(env) as f:
            versions = [x.strip() for x in f if x.startswith("torch ")]
        out += [_cut("  " + v) for v in versions[:1]]
    out.append("steps (status, seconds of budget, what pytest said):")
    for s in _steps(folder):
        took = f"{s['seconds']}/{s['budget']}s"
        out.append(_cut(f"  {s['step']:<20} {s['status']:<8} {took:>9}  {s['result']}"))
    if report is None:
        out.append("no benchmark report (the benchmark step did not run): no figure, no target")
        return out
    if report.get("smoke"):
        out.append("SMOKE RUN: tiny sizes, one round: the figures and verdicts below mean nothing")
    if report.get("partial"):
        out.append("PARTIAL: the benchmarks stopped before their end: the rows measured until then")
    out.append("targets:")
    out += ["  " + _cut(x) for x in targets(report)]
    out.append("figures (medians; pack: GB/s and share of the plain copy per chunk size):")
    out += ["  " + _cut(x) for x in figures(report)]
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    print("\n".join(screen(argv[0])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
