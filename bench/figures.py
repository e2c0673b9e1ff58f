"""The figures README.md and docs/*.md quote, computed from the benchmark results they
come from, so a page never quotes a number its source does not hold.

A page quotes a figure as ``<!-- fig:NAME -->TEXT<!-- /fig -->``: NAME is a key of
:data:`FIGURES`, TEXT what :func:`render` makes of the results file the figure names.

    python -m bench.figures           rewrite every quoted figure from its source
    python -m bench.figures --check   list the quoted figures that differ; exit 1 if any

``tests/test_docs.py`` runs the check, and fails on a measured figure (GB/s, µs, ms, a
ratio such as 0.42x) written in a page's prose outside a quoted figure unless its
paragraph names the ``bench/results/`` file it was taken from.  After ``make bench``
wrote a new ``bench/results/bench-cpu.json``, ``python -m bench.figures`` brings every
page along.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
PAGES = ("README.md", "docs/*.md", "integration/sglang/README.md")
SPAN = re.compile(r"<!-- fig:([a-z0-9_.-]+) -->(.*?)<!-- /fig -->", re.S)


@dataclass(frozen=True)
class Figure:
    source: str  # a file in bench/results/
    text: Callable[[dict], str]  # the results file's JSON -> the quoted text
    missing: str | None = None  # the quoted text while the file does not exist (else: error)


def _group(d: dict, name: str) -> list:
    try:
        return d["groups"][name]
    except KeyError:
        raise KeyError(f"bench/figures: no group {name!r} in the results file") from None


def _row(d: dict, group: str, role: str, nth: int = 0) -> dict:
    rows = [r for r in _group(d, group) if r.get("role") == role]
    if len(rows) <= nth:
        raise KeyError(f"bench/figures: group {group!r} has no {role} row #{nth}")
    return rows[nth]


def _gbs(x: float) -> str:
    return f"{x:.1f} GB/s"


def _x(x: float) -> str:
    return f"{x:.2f}x"


def _us(s: float) -> str:
    return f"{s * 1e6:.0f} µs" if s < 1e-3 else f"{s * 1e3:.1f} ms"


def _pack(d: dict, op: str, page_size: int, mib: int = 128) -> tuple[float, float, float]:
    """(kvmem GB/s, its ratio to the plain copy, its ratio to the per-layer gather)."""
    g = f"{op} P{page_size}, {mib} MiB chunk"
    k, base, ceil = (_row(d, g, r) for r in ("kvmem", "baseline", "ceiling"))
    return k["gb_per_s"], k["gb_per_s"] / ceil["gb_per_s"], k["gb_per_s"] / base["gb_per_s"]


def _kernels_pack(d: dict) -> str:
    p16, c16, g16 = _pack(d, "pack", 16)
    unpack = [_pack(d, "unpack", p)[0] for p in (1, 16, 64)]
    p1, _, g1 = _pack(d, "pack", 1)
    return (
        f"pack {_gbs(p16)} at page_size 16, {_x(c16)} a plain copy of the same bytes "
        f"and {_x(g16)} `index_select` + `cat`; unpack {min(unpack):.1f}-"
        f"{_gbs(max(unpack))} over page sizes 1, 16 and 64; at page_size 1, pack "
        f"{_gbs(p1)}, {_x(g1)} the `index_select` baseline"
    )


def _first_ms(row: dict) -> float:
    m = re.search(r"first: ([0-9.]+) ms", row["name"])
    if not m:
        raise KeyError(f"bench/figures: no 'first: N ms' in {row['name']!r}")
    return float(m.group(1))


def _transfer_write(d: dict) -> str:
    g = "nixl write 256 MiB, 1 process, polled"
    k, raw = _row(d, g, "kvmem"), _row(d, g, "baseline")
    ranges = "chunk -> pool pages, polled"
    scattered, contiguous = _row(d, ranges, "kvmem"), _row(d, ranges, "ceiling")
    firsts = [
        _first_ms(_row(d, g2, "kvmem")) for g2 in (g, "nixl write 256 MiB, 1 process, thread")
    ]
    return (
        f"kvmem's `post_write` {_gbs(k['gb_per_s'])} against raw NIXL "
        f"{_gbs(raw['gb_per_s'])}; a packed chunk written into 4096 page ranges "
        f"{_gbs(scattered['gb_per_s'])} against {_gbs(contiguous['gb_per_s'])} "
        f"contiguous; the first write after `add_peer` {min(firsts):.0f}-"
        f"{max(firsts):.0f} ms, spent setting up the connection"
    )


DEMO_MODES = ("push, chunks packed", "push, chunks auto", "pull")


def _demo_row(d: dict, faults: str, mode: str) -> tuple[dict, dict]:
    """The demo's row for ``mode`` and the raw NIXL row of its own runs (the next one)."""
    g = f"kvmem demo vs raw NIXL write between the same 2 processes, faults {faults}"
    rows = _group(d, g)
    for i, r in enumerate(rows):
        if r.get("role") == "kvmem" and r["name"].startswith(f"kvmem demo, {mode}:"):
            return r, rows[i + 1]
    raise KeyError(f"bench/figures: no demo row for {mode!r} in {g!r}")


def _demo_ratio(d: dict, faults: str, mode: str) -> float:
    return _demo_row(d, faults, mode)[0]["ratio_to_raw"]["median"]


def _demo_expect(d: dict) -> str:
    parts = []
    for faults in ("off", "on"):
        ratios = ", ".join(f"{_x(_demo_ratio(d, faults, m))} for {m}" for m in DEMO_MODES)
        parts.append(f"with faults {faults} {ratios}")
    pull, raw = _demo_row(d, "off", "pull")
    runs = len(pull["per_run"])
    return (
        f"{runs} runs of 200 requests per mode, medians of the per-run ratio to raw "
        f"NIXL: {'; '.join(parts)} (pull with faults off: {_gbs(pull['gb_per_s'])} of "
        f"verified KV against {_gbs(raw['gb_per_s'])} of raw NIXL)"
    )


STAGES = (  # (the stage's group suffix, how the page names it)
    (
        "prefill: forward stand-in (Synth.chunk + unpack_pages into the pool)",
        "the forward stand-in",
    ),
    ("prefill: the rest of step() (Python)", "the rest of its step (Python)"),
    ("prefill: post_write / post_blocks (UCX cma copies into the decode here)", "its posts"),
    (
        "decode: post_blocks READ (pull; UCX cma copies from the prefill here)",
        "the decode's READs (UCX's copy of the bytes)",
    ),
    (
        "decode: verify every landed chunk (landing region or pool pages in place)",
        "the decode's verification of every page",
    ),
    ("decode: the rest of step() (Python)", "the rest of the decode's step"),
)


def _demo_stages(d: dict) -> str:
    parts = []
    for suffix, what in STAGES:
        (row,) = _group(d, f"demo stage, faults off, pull: {suffix}")
        parts.append(f"{what} {row['median_s']:.2f} s ({row['name'].split('%')[0]}%)")
    return "; ".join(parts)


def _readme_table(d: dict) -> str:
    alloc = "alloc_extend+free, 32 requests x ~1000 tokens, P16"
    ka, ba = _row(d, alloc, "kvmem"), _row(d, alloc, "baseline")
    pd = "PD prefill allocator calls, 8 batches of 32 x ~1000 tokens, P16"
    kp, bp = _row(d, pd, "kvmem"), _row(d, pd, "baseline")
    p16, c16, g16 = _pack(d, "pack", 16)
    rel = [
        (_row(d, f"{op} 2 GiB", "kvmem"), _row(d, f"{op} 2 GiB", "baseline"))
        for op in ("release", "resume")
    ]
    k, raw = _demo_row(d, "off", "pull")
    pull = k["ratio_to_raw"]["median"]
    rows = [
        (
            "pack a request's pages (P16, 128 MiB chunk)",
            _gbs(p16),
            f"{_x(c16)} a plain copy, {_x(g16)} per-layer `index_select` + `cat`",
        ),
        (
            "`alloc_extend` + free, 32 requests x ~1000 tokens, P16",
            _us(ka["median_s"]),
            f"{ba['median_s'] / ka['median_s']:.2f}x faster than sglang's "
            "`PagedTokenToKVPoolAllocator`",
        ),
        (
            "the adapter's allocator under a PD prefill, 8 batches, P16",
            _us(kp["median_s"]),
            f"{bp['median_s'] / kp['median_s']:.2f}x faster than stock sglang",
        ),
        (
            "`pool.release()`, 2 GiB",
            _us(rel[0][0]["median_s"]),
            f"{rel[0][1]['median_s'] / rel[0][0]['median_s']:.0f}x faster than freeing a tensor",
        ),
        (
            "`pool.resume()`, 2 GiB, every page touched",
            _us(rel[1][0]["median_s"]),
            f"{rel[1][1]['median_s'] / rel[1][0]['median_s']:.1f}x faster than allocating and "
            "touching one",
        ),
        (
            "`kvmem demo`, pull, faults off",
            _gbs(k["gb_per_s"]),
            f"{_x(pull)} raw NIXL between the same processes ({_gbs(raw['gb_per_s'])})",
        ),
    ]
    lines = ["", "| what | kvmem | against its baseline, same run |", "|---|---|---|"]
    lines += [f"| {a} | {b} | {c} |" for a, b, c in rows]
    return "\n".join(lines) + "\n"


# -- the serving benchmark (bench/serving.py; bench/serving_report.py has the file) ------

SERVING = "serving-cpu.json"
NOT_MEASURED = "not yet measured on a quiet machine"
NO_TABLE = (
    "\n_Not yet measured on a quiet machine: `make bench` (or `python -m bench.serving`) "
    "writes `bench/results/serving-cpu.json` and its plots, and `python -m bench.figures` "
    "then fills in this table._\n"
)
NO_RESUME = "\n_Not yet measured on a quiet machine (the same file)._\n"
PLOTS = (  # (file in bench/results/, what it shows, drawn only when the file has cycles)
    ("cpu-serving.png", "TTFT, ITL, end-to-end latency and throughput against concurrency", 0),
    ("cpu-serving-batch.png", "ITL against the decode's running batch", 0),
    ("cpu-serving-resume.png", "TTFT and ITL before a release and after the resume", 1),
)


def _serving_cells(d: dict) -> list[dict]:
    cells = d.get("summary", {}).get("cells", [])
    if not cells:
        raise KeyError("bench/figures: the serving results have no summary cells")
    return cells


def _serving_when(d: dict) -> str:
    cfg = d["config"]
    loaded = sum(bool(r["loaded"]) for r in d["runs"])
    notes = [f"{loaded} of {len(d['runs'])} runs under load" if loaded else "quiet"]
    if d.get("partial"):
        notes.append("PARTIAL")
    if d.get("smoke"):
        notes.append("SMOKE")
    return (
        f"{d['time'][:10]}, {d['device']}, sglang {d.get('sglang', '?')}, "
        f"{cfg['rounds']} rounds, {', '.join(notes)}"
    )


def _ms(s: dict | None, nd: int = 1) -> str:
    return "-" if s is None else f"{s['median']:.{nd}f}"


def _vs(c: dict, fig: str, nd: int = 1) -> str:
    """stock's median -> the flag's (flag / stock over the rounds: median [min-max])."""
    k, r = c["kinds"], c["ratio"][fig]
    ratio = "" if r is None else f" ({r['median']:.2f}x [{r['min']:.2f}-{r['max']:.2f}])"
    return f"{_ms(k['stock'][fig], nd)} -> {_ms(k['flag'][fig], nd)}{ratio}"


def _serving_table(d: dict) -> str:
    """Per backend and concurrency, at the longest prompt: stock's median -> the flag's
    and the ratio flag / stock of TTFT, ITL, end-to-end latency and throughput."""
    cells = _serving_cells(d)
    longest = max(c["input_len"] for c in cells)
    lines = [
        "",
        "| backend | prompt / answer, concurrency | TTFT ms | ITL ms | end-to-end ms "
        "| output tokens/s |",
        "|---|---|---|---|---|---|",
    ]
    for c in (c for c in cells if c["input_len"] == longest):
        lines.append(
            f"| {c['backend']} | {c['input_len']} / {c['output_len']}, {c['concurrency']} "
            f"| {_vs(c, 'ttft_median_ms')} | {_vs(c, 'itl_median_ms', 2)} "
            f"| {_vs(c, 'e2e_median_ms', 0)} | {_vs(c, 'output_tok_s', 0)} |"
        )
    return "\n".join(lines) + "\n"


def _serving_resume(d: dict) -> str:
    """Per backend and kind: TTFT and ITL in the window before the release and in the
    one after the resume, and the first batch of each."""
    rows = d.get("summary", {}).get("resume", [])
    if not rows:
        raise KeyError("bench/figures: the serving results have no release/resume cycles")
    lines = [
        "",
        "| backend | kind | TTFT ms, before -> after | first batch TTFT ms | ITL ms "
        "| release, resume s |",
        "|---|---|---|---|---|---|",
    ]
    for e in rows:
        t, i = e["ttft_median_ms"], e["itl_median_ms"]
        lines.append(
            f"| {e['backend']} | {e['kind']} "
            f"| {_ms(t['before'])} -> {_ms(t['after'])} ({_ms(t['after_over_before'], 2)}x) "
            f"| {_ms(t['first_batch_before'])} -> {_ms(t['first_batch'])} "
            f"({_ms(t['first_over_before'], 2)}x) "
            f"| {_ms(i['before'], 2)} -> {_ms(i['after'], 2)} ({_ms(i['after_over_before'], 2)}x) "
            f"| {_ms(e['release_s'], 2)}, {_ms(e['resume_s'], 2)} |"
        )
    return "\n".join(lines) + "\n"


def _serving_plots(d: dict) -> str:
    """The plots bench/serving_plot.py drew from the file, as images of the page."""
    lines = [
        f"![{what}, stock against the flag](bench/results/{png})"
        for png, what, cycles in PLOTS
        if not cycles or d.get("cycles")
    ]
    return "\n" + "\n".join(lines) + "\n"


FIGURES: dict[str, Figure] = {
    "kernels.pack": Figure("bench-cpu.json", _kernels_pack),
    "transfer.write": Figure("bench-cpu.json", _transfer_write),
    "demo.expect": Figure("bench-cpu.json", _demo_expect),
    "demo.stages": Figure("bench-cpu.json", _demo_stages),
    "readme.table": Figure("bench-cpu.json", _readme_table),
    "bench.when": Figure("bench-cpu.json", lambda d: f"{d['time'][:10]}, {d['device']}"),
    "serving.when": Figure(SERVING, _serving_when, NOT_MEASURED),
    "serving.table": Figure(SERVING, _serving_table, NO_TABLE),
    "serving.resume": Figure(SERVING, _serving_resume, NO_RESUME),
    "serving.plots": Figure(SERVING, _serving_plots, ""),
}


def render(name: str, cache: dict | None = None, results: Path | None = None) -> str:
    """The text of figure ``name`` from its results file (in ``results``, by default
    bench/results/); a figure whose file does not exist yet says so (``missing``)."""
    if name not in FIGURES:
        raise KeyError(f"bench/figures: no figure {name!r} (known: {', '.join(FIGURES)})")
    fig = FIGURES[name]
    cache = {} if cache is None else cache
    if fig.source not in cache:
        path = (results or RESULTS) / fig.source
        if not path.exists() and fig.missing is not None:
            cache[fig.source] = None
        else:
            cache[fig.source] = json.loads(path.read_text())
    if cache[fig.source] is None:
        return fig.missing
    return fig.text(cache[fig.source])


def pages() -> list[Path]:
    return sorted({p for pat in PAGES for p in ROOT.glob(pat)})


def spans(text: str) -> list[tuple[str, str]]:
    """``(name, text)`` of every quoted figure in a page's text."""
    return [(m.group(1), m.group(2)) for m in SPAN.finditer(text)]


def rewrite(text: str, cache: dict | None = None, results: Path | None = None) -> str:
    cache = {} if cache is None else cache
    return SPAN.sub(
        lambda m: f"<!-- fig:{m.group(1)} -->{render(m.group(1), cache, results)}<!-- /fig -->",
        text,
    )


def stale() -> list[str]:
    """One line per quoted figure whose text differs from its source."""
    out, cache = [], {}
    for page in pages():
        for name, text in spans(page.read_text()):
            want = render(name, cache)
            if text != want:
                out.append(
                    f"{page.relative_to(ROOT)}: fig:{name} says {text!r}, "
                    f"{FIGURES[name].source} gives {want!r}"
                )
    return out


def main(argv: list[str]) -> int:
    if argv not in ([], ["--check"]):
        print(__doc__.split("\n\n")[2], file=sys.stderr)
        return 2
    if argv == ["--check"]:
        bad = stale()
        for line in bad:
            print(line)
        return 1 if bad else 0
    cache: dict = {}
    for page in pages():
        text = page.read_text()
        new = rewrite(text, cache)
        if new != text:
            page.write_text(new)
            print("rewritten:", page.relative_to(ROOT))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
