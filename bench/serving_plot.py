"""PNG plots of a serving benchmark results file (bench/serving.py's ``serving-cpu.json``),
stock beside the flag, everything from that one run.  ``python -m bench.plot FILE
[OUTDIR]`` draws them (bench/plot.py hands a serving file here):

    cpu-serving.png         per backend: median TTFT, ITL and end-to-end latency and the
                            output throughput against concurrency, one line per kind and
                            prompt length, bars from the rounds' min to max
    cpu-serving-batch.png   per backend: each run's median ITL against the decode's mean
                            running batch over the run, stock and the flag on one axis
    cpu-serving-resume.png  per backend: each run's median TTFT and ITL in the windows
                            before the release and after the resume, against seconds from
                            the release / the resume, one line per kind and cycle

A figure whose rows are absent (no cycles, say) is not drawn.
"""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from bench.plot import COLORS, _save, smoke_banner  # noqa: E402

KIND_COLORS = {"stock": COLORS["baseline"], "flag": COLORS["kvmem"]}
KIND_LABELS = {"stock": "stock sglang", "flag": "SGLANG_KVMEM=1"}
STYLES = ["-o", "--s", ":^", "-.v"]


def _title(fig, results: dict, what: str) -> None:
    rounds = results["config"]["rounds"]
    lines = [
        what,
        f"{results['device']}, sglang {results.get('sglang', '?')}, {results['time']}, "
        f"{rounds} round{'s' if rounds != 1 else ''}, {results['config']['order']}",
    ]
    loaded = sum(bool(r["loaded"]) for r in results.get("runs", []))
    if loaded or results.get("partial") or results.get("note"):
        lines.append(
            "; ".join(
                x
                for x in (
                    f"{loaded} runs under load" if loaded else "",
                    "PARTIAL" if results.get("partial") else "",
                    results.get("note", ""),
                )
                if x
            )
        )
    fig.suptitle("\n".join(lines), fontsize=10)
    smoke_banner(fig, results)


def _from_zero(ax) -> None:
    """The y axis from 0, with room above the highest point."""
    ax.set_ylim(0, ax.get_ylim()[1] * 1.08)


PANELS = (  # (summary figure, axis label)
    ("ttft_median_ms", "median TTFT (ms)"),
    ("itl_median_ms", "median ITL (ms)"),
    ("e2e_median_ms", "median end-to-end latency (ms)"),
    ("output_tok_s", "output throughput (tokens/s)"),
)


def plot_sweep(results: dict, out_dir: str) -> str | None:
    cells = results.get("summary", {}).get("cells", [])
    if not cells:
        return None
    backends = list(dict.fromkeys(c["backend"] for c in cells))
    lens = sorted({c["input_len"] for c in cells})
    fig, axes = plt.subplots(
        len(backends), len(PANELS), figsize=(4.6 * len(PANELS), 3.9 * len(backends)), squeeze=False
    )
    for row, backend in enumerate(backends):
        for col, (fig_name, label) in enumerate(PANELS):
            ax = axes[row][col]
            for kind, color in KIND_COLORS.items():
                for j, n in enumerate(lens):
                    pts = sorted(
                        (c["concurrency"], c["kinds"][kind][fig_name])
                        for c in cells
                        if c["backend"] == backend
                        and c["input_len"] == n
                        and c["kinds"][kind][fig_name]
                    )
                    if not pts:
                        continue
                    xs = [p[0] for p in pts]
                    med = [p[1]["median"] for p in pts]
                    err = [
                        [p[1]["median"] - p[1]["min"] for p in pts],
                        [p[1]["max"] - p[1]["median"] for p in pts],
                    ]
                    ax.errorbar(
                        xs,
                        med,
                        yerr=err,
                        fmt=STYLES[j % len(STYLES)],
                        color=color,
                        capsize=3,
                        markersize=4,
                        label=f"{KIND_LABELS[kind]}, prompt {n}",
                    )
            concs = sorted({c["concurrency"] for c in cells})
            ax.set_xscale("log", base=2)
            ax.set_xticks(concs, [str(c) for c in concs])
            ax.minorticks_off()
            _from_zero(ax)
            ax.set_xlabel("concurrency (requests in flight)")
            ax.set_ylabel(label)
            ax.set_title(f"{backend}: {label.split(' (')[0]}", fontsize=9)
            ax.grid(alpha=0.3, which="both")
            if col == 0:
                ax.legend(fontsize=7, loc="upper left")
    _title(
        fig,
        results,
        "sglang's serving benchmark through a PD pair and its router: stock against "
        "SGLANG_KVMEM=1 (median over rounds, bars: min-max)",
    )
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    return _save(fig, out_dir, results, "serving")


def plot_batch(results: dict, out_dir: str) -> str | None:
    runs = [r for r in results.get("runs", []) if r.get("decode_batch_mean")]
    if not runs:
        return None
    backends = list(dict.fromkeys(r["backend"] for r in runs))
    lens = sorted({r["cell"]["input_len"] for r in runs})
    markers = "osv^D"
    fig, axes = plt.subplots(1, len(backends), figsize=(6 * len(backends), 4.4), squeeze=False)
    for ax, backend in zip(axes[0], backends):
        for kind, color in KIND_COLORS.items():
            for j, n in enumerate(lens):
                pts = [
                    (r["decode_batch_mean"], r["itl_ms"]["median"])
                    for r in runs
                    if r["backend"] == backend and r["kind"] == kind and r["cell"]["input_len"] == n
                ]
                if pts:
                    ax.scatter(
                        *zip(*pts),
                        color=color,
                        marker=markers[j % len(markers)],
                        s=22,
                        alpha=0.8,
                        label=f"{KIND_LABELS[kind]}, prompt {n}",
                    )
        _from_zero(ax)
        ax.set_xlabel("decode's mean running batch per forward pass over the run (requests)")
        ax.set_ylabel("median ITL of the run (ms)")
        ax.set_title(f"{backend}: ITL against the decode's batch, every run", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper left")
    _title(fig, results, "inter-token latency against the decode's running batch size")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    return _save(fig, out_dir, results, "serving-batch")


def _slices(window: dict, before: bool) -> list[tuple[float, dict]]:
    """(seconds from the release or the resume, slice) of a window's runs: a window
    before the release ends at 0 (its last run's end), one after starts at its offset."""
    s = window["slices"]
    if not before:
        return [(x["offset_s"], x) for x in s]
    end = s[-1]["offset_s"] + s[-1]["duration_s"]
    return [(x["offset_s"] - end, x) for x in s]


def plot_resume(results: dict, out_dir: str) -> str | None:
    cycles = results.get("cycles", [])
    if not cycles:
        return None
    backends = list(dict.fromkeys(c["backend"] for c in cycles))
    fig, axes = plt.subplots(len(backends), 2, figsize=(12, 4.2 * len(backends)), squeeze=False)
    for row, backend in enumerate(backends):
        for col, (key, label) in enumerate(
            (("ttft_ms", "median TTFT of the run (ms)"), ("itl_ms", "median ITL of the run (ms)"))
        ):
            ax = axes[row][col]
            for c in (c for c in cycles if c["backend"] == backend):
                color = KIND_COLORS[c["kind"]]
                pts = _slices(c["before"], True) + _slices(c["after"], False)
                ax.plot(
                    [p[0] for p in pts],
                    [p[1][key]["median"] for p in pts],
                    STYLES[c["cycle"] % len(STYLES)],
                    color=color,
                    markersize=4,
                    label=f"{KIND_LABELS[c['kind']]}, cycle {c['cycle']}",
                )
            ax.axvline(0, color="0.4", lw=0.8)
            _from_zero(ax)
            ax.set_xlabel("s from the release (before) / from the resume (after)")
            ax.set_ylabel(label)
            ax.set_title(f"{backend}: {label.split(' of')[0]} around a release/resume", fontsize=9)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7, loc="upper left")
    _title(
        fig,
        results,
        "the serving benchmark before a release of the KV cache and after its resume",
    )
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    return _save(fig, out_dir, results, "serving-resume")


def plot_results(results: dict, out_dir: str) -> list[str]:
    """Every serving figure the file has data for; the paths written."""
    return [p for f in (plot_sweep, plot_batch, plot_resume) if (p := f(results, out_dir))]
