"""PNG plots of one benchmark run: kvmem beside its baselines, all from that run.

    python -m bench.plot RESULTS.json [OUTDIR]

RESULTS.json is what bench/conftest.py writes with ``KVMEM_BENCH_OUT`` (``make bench``
writes ``bench/results/bench-cpu.json`` and calls this at the end of the session), or the
serving benchmark's ``serving-cpu.json`` (bench/serving.py; its figures are
bench/serving_plot.py's).  Rows
say which figure they belong to (``figure``) and what they are (``role``: ``kvmem``,
``baseline`` or ``ceiling``); the figures:

    <tag>-pack.png       pack / unpack GB/s against chunk size and page size, plain copy
                         of the same bytes as the ceiling, one row of panels per model
                         and direction (bench_pack.py)
    <tag>-allocator.png  kvmem's allocator against sglang's (bench_allocator.py,
                         bench_sglang_allocator.py)
    <tag>-release.png    release / resume time against pool size (bench_release.py)
    <tag>-demo.png       kvmem demo throughput against raw NIXL (bench_demo.py)
    <tag>-transfer.png   NixlEngine writes against raw NIXL and memcpy (bench_transfer.py)
    <tag>-netns.png      kvmem demo over two network namespaces (TCP over a veth) against
                         raw NIXL over the same link, packed / direct / pull (bench_netns.py)

``<tag>`` is ``cpu`` for a CPU run and the GPU's name for a CUDA run (``nvidia-h200``),
so GPU figures never overwrite the CPU ones.  Each title names the device, the time and
the report's note (``KVMEM_BENCH_NOTE``, e.g. that the machine was loaded); a smoke run
says so in red.  A figure whose rows are absent (a bench file not run) is not drawn.
"""

from __future__ import annotations

import json
import os
import re
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLORS = {"kvmem": "tab:blue", "baseline": "tab:orange", "ceiling": "0.45"}
PAGE_COLORS = ["tab:blue", "tab:green", "tab:purple", "tab:red", "tab:brown"]


def tag(report: dict) -> str:
    """File name prefix: ``cpu``, or the GPU's name in lower case with dashes."""
    if report.get("device_type", "cpu") == "cpu":
        return "cpu"
    return re.sub(r"[^a-z0-9]+", "-", report["device"].lower()).strip("-")


def _rows(report: dict, figure: str) -> dict[str, list[dict]]:
    out = {}
    for group, rows in report["groups"].items():
        picked = [r for r in rows if r.get("figure") == figure]
        if picked:
            out[group] = picked
    return out


def _title(fig, report: dict, what: str) -> None:
    lines = [
        what,
        f"{report['device']}, torch {report.get('torch', '?')}, {report.get('time', '?')}",
    ]
    if report.get("note"):
        lines.append(report["note"])
    fig.suptitle("\n".join(lines), fontsize=10)
    smoke_banner(fig, report)


def smoke_banner(fig, report: dict) -> None:
    """A red line on ``fig`` when ``report`` is a smoke run's."""
    if report.get("smoke"):
        fig.text(
            0.01,
            0.01,
            "SMOKE RUN (make test): tiny sizes, one round; the figures mean nothing",
            color="red",
            fontsize=9,
        )


def _us(v: float) -> str:
    """Microseconds as a label: 850 us, 24.3 ms, 1203 ms."""
    if v >= 1e5:
        return f"{v / 1e3:.0f} ms"
    return f"{v / 1e3:.3g} ms" if v >= 1e3 else f"{v:.3g} us"


def _save(fig, out_dir: str, report: dict, figure: str) -> str:
    path = os.path.join(out_dir, f"{tag(report)}-{figure}.png")
    fig.savefig(path, dpi=110, bbox_inches="tight", pad_inches=0.15)
    plt.close(fig)
    return path


# -- pack / unpack -----------------------------------------------------------------------


def plot_pack(report: dict, out_dir: str) -> str | None:
    rows = [r for g in _rows(report, "pack").values() for r in g]
    if not rows:
        return None
    # one row of panels per (model, op); rows from before the model field are gqa-bf16
    models = list(dict.fromkeys(r.get("model", "gqa-bf16") for r in rows))
    panels = [
        (m, op)
        for m in models
        for op in ("pack", "unpack")
        if any(r["op"] == op and r.get("model", "gqa-bf16") == m for r in rows)
    ]
    fig, axes = plt.subplots(len(panels), 2, figsize=(12, 5.4 * len(panels)), squeeze=False)
    for i, (model, op) in enumerate(panels):
        mine = [r for r in rows if r["op"] == op and r.get("model", "gqa-bf16") == model]
        sizes = sorted({r["page_size"] for r in mine})
        panel = op if len(models) == 1 else f"{op} ({model})"
        chunks = sorted({r["nbytes"] for r in mine})
        # left: GB/s against chunk size, one colour per page size
        ax = axes[i][0]
        for k, ps in enumerate(sizes):
            color = PAGE_COLORS[k % len(PAGE_COLORS)]
            for role, style, what in (("kvmem", "-o", "kvmem"), ("baseline", ":x", None)):
                pts = sorted(
                    (r["nbytes"], r["gb_per_s"], r["name"])
                    for r in mine
                    if r["page_size"] == ps and r["role"] == role
                )
                if pts:
                    label = f"{what or pts[0][2]}, page {ps}"
                    ax.plot(
                        [p[0] / 2**20 for p in pts],
                        [p[1] for p in pts],
                        style,
                        color=color,
                        label=label,
                    )
        ceiling = []
        for c in chunks:  # the copy is measured in every page size's group: their median
            bws = sorted(r["gb_per_s"] for r in mine if r["nbytes"] == c and r["role"] == "ceiling")
            if bws:
                ceiling.append((c / 2**20, bws[len(bws) // 2]))
        if ceiling:
            ax.plot(
                *zip(*ceiling), "--s", color="black", markersize=4, label="plain copy_ (ceiling)"
            )
        ax.set_xscale("log", base=2)
        ax.set_xticks([c / 2**20 for c in chunks], [f"{c / 2**20:.4g}" for c in chunks])
        ax.minorticks_off()
        ax.set_yscale("log")  # the baselines sit 10-100x below the copy on a CPU
        ax.set_xlabel("chunk size (MiB)")
        ax.set_ylabel("GB/s (log)")
        ax.set_title(f"{panel}: bandwidth against chunk size")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6.5, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.16))
        # right: GB/s against page size at the largest chunk
        ax = axes[i][1]
        big = chunks[-1]
        width = 0.27
        for j, role in enumerate(("kvmem", "baseline", "ceiling")):
            pts = [
                (k, r)
                for k, ps in enumerate(sizes)
                for r in mine
                if r["page_size"] == ps and r["nbytes"] == big and r["role"] == role
            ]
            if not pts:
                continue
            xs = [k + (j - 1) * width for k, _ in pts]
            label = "kvmem" if role == "kvmem" else pts[0][1]["name"]
            bars = ax.bar(
                xs, [r["gb_per_s"] for _, r in pts], width, color=COLORS[role], label=label
            )
            ax.bar_label(bars, fmt="%.1f", fontsize=7)
        ax.set_xticks(range(len(sizes)), [f"page {ps}" for ps in sizes])
        ax.set_ylabel("GB/s")
        ax.set_title(f"{panel}: bandwidth against page size, {big / 2**20:.4g} MiB chunk")
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=7)
    _title(fig, report, "pack_pages / unpack_pages against a per-layer gather and a plain copy")
    fig.tight_layout(rect=(0, 0.03, 1, 1))  # tight_layout makes room for the suptitle
    return _save(fig, out_dir, report, "pack")


# -- release / resume --------------------------------------------------------------------


def plot_release(report: dict, out_dir: str) -> str | None:
    rows = [r for g in _rows(report, "release").values() for r in g]
    if not rows:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, op in zip(axes, ("release", "resume")):
        for role in ("kvmem", "baseline"):
            pts = sorted(
                (r["pool_bytes"], r["median_s"], r["name"])
                for r in rows
                if r["op"] == op and r["role"] == role
            )
            if not pts:
                continue
            ax.plot(
                [p[0] / 2**30 for p in pts],
                [p[1] * 1e3 for p in pts],
                "-o",
                color=COLORS[role],
                label=pts[0][2],
            )
            for x, y, _ in pts:
                ax.annotate(
                    _us(y * 1e6),
                    (x / 2**30, y * 1e3),
                    fontsize=7,
                    textcoords="offset points",
                    xytext=(4, 4),
                )
        ax.set_xscale("log", base=2)
        sizes = sorted({r["pool_bytes"] / 2**30 for r in rows})
        ax.set_xticks(sizes, [f"{x:g}" for x in sizes])
        ax.minorticks_off()
        ax.set_yscale("log")
        ax.set_xlabel("pool size (GiB)")
        ax.set_ylabel("median time (ms)")
        ax.set_title(f"{op} against pool size")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    _title(
        fig, report, "pool.release() / pool.resume() against freeing and allocating the same bytes"
    )
    fig.tight_layout(rect=(0, 0.03, 1, 1))  # tight_layout makes room for the suptitle
    return _save(fig, out_dir, report, "release")


# -- bar charts: allocator, demo, transfer ------------------------------------------------


def _ref_row(rows: list, row: dict) -> dict:
    """The kvmem row that ``row`` is compared with (``row`` itself for a kvmem row)."""
    if row.get("role") == "kvmem":
        return row
    i = next(k for k, r in enumerate(rows) if r is row)
    above = [r for r in rows[:i] if r.get("role") == "kvmem"]
    if above:
        return above[-1]
    return next((r for r in rows if r.get("role") == "kvmem"), rows[0])


def _bars(report: dict, out_dir: str, figure: str, what: str, rate: bool) -> str | None:
    """One horizontal bar per row, grouped as the report groups them; ``rate``: GB/s
    (longer is better), else median time (shorter is better)."""
    groups = _rows(report, figure)
    if not groups:
        return None
    n = sum(len(g) for g in groups.values())
    fig, ax = plt.subplots(figsize=(12, 1.2 + 0.42 * n + 0.45 * len(groups)))
    y, ticks, labels = 0.0, [], []
    for group, rows in groups.items():
        ax.text(
            0, y - 0.75, group, fontsize=8, fontweight="bold", transform=ax.get_yaxis_transform()
        )
        for r in rows:
            # A baseline or ceiling row is compared with the kvmem row it belongs to: the
            # nearest kvmem row above it (a group of several kvmem modes lists each one's
            # own baseline after it, as the demo does), else the group's first kvmem row.
            ref = _ref_row(rows, r)
            v = r["gb_per_s"] if rate else r["median_s"] * 1e6
            ax.barh(y, v, 0.7, color=COLORS.get(r.get("role"), "tab:gray"))
            note = f" {v:.2f} GB/s" if rate else " " + _us(v)
            if r is not ref and rate:
                note += f"  (kvmem at {ref['gb_per_s'] / v:.2f}x this)"
            elif r is not ref:
                note += (
                    f"  (kvmem: {r['median_s'] / ref['median_s']:.2f}x faster)"
                    if r["median_s"] >= ref["median_s"]
                    else f"  (kvmem takes {ref['median_s'] / r['median_s']:.2f}x the time)"
                )
            ax.text(v, y, note, va="center", fontsize=7)
            ticks.append(y)
            labels.append(r["name"])
            y += 1
        y += 1.2
    ax.set_yticks(ticks, labels, fontsize=7)
    ax.set_ylim(-1.3, y - 1.2 + 0.5)  # room above the first group's title
    ax.invert_yaxis()
    ax.set_xlabel("GB/s (longer is better)" if rate else "median time, us (log; shorter is better)")
    if not rate:
        ax.set_xscale("log")
    ax.set_xlim(right=ax.get_xlim()[1] * (1.6 if rate else 8))
    ax.grid(axis="x", alpha=0.3, which="both")
    _title(fig, report, what)
    fig.tight_layout(rect=(0, 0.03, 1, 1))  # tight_layout makes room for the suptitle
    return _save(fig, out_dir, report, figure)


def plot_allocator(report, out_dir):
    return _bars(
        report,
        out_dir,
        "allocator",
        "PageAllocator (and the sglang adapter) against "
        "sglang's own allocators, same device, same run",
        rate=False,
    )


def plot_demo(report, out_dir):
    return _bars(
        report,
        out_dir,
        "demo",
        "kvmem demo throughput (verified KV) against raw "
        "NIXL writes between the same two processes",
        rate=True,
    )


def plot_transfer(report, out_dir):
    return _bars(
        report,
        out_dir,
        "transfer",
        "NixlEngine writes against raw NIXL calls and a plain copy",
        rate=True,
    )


def plot_netns(report, out_dir):
    return _bars(
        report,
        out_dir,
        "netns",
        "kvmem demo between two network namespaces (UCX "
        "over TCP on a veth) against raw NIXL writes over the same link",
        rate=True,
    )


FIGURES = (plot_pack, plot_allocator, plot_release, plot_demo, plot_transfer, plot_netns)


def plot_report(report: dict, out_dir: str) -> list[str]:
    """Every figure the report has rows for; the paths written."""
    os.makedirs(out_dir, exist_ok=True)
    return [p for f in FIGURES if (p := f(report, out_dir))]


def plot_file(path: str, out_dir: str | None = None) -> list[str]:
    """The figures of a results file: a benchmark report, or the serving benchmark's
    results (``"bench": "serving"``, bench/serving_plot.py)."""
    with open(path) as f:
        report = json.load(f)
    out_dir = out_dir or os.path.dirname(os.path.abspath(path))
    if report.get("bench") == "serving":
        from bench import serving_plot

        os.makedirs(out_dir, exist_ok=True)
        return serving_plot.plot_results(report, out_dir)
    return plot_report(report, out_dir)


def main(argv: list[str]) -> int:
    if not 1 <= len(argv) <= 2:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    for p in plot_file(*argv):
        print("written:", p)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
