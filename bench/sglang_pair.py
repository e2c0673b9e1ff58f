"""sglang 0.5.23's PD transfer between two processes on DRAM, stock against
``SGLANG_KVMEM=1``, with a raw write of the same bytes between the same processes: each
mode (:data:`MODES`), backend (NIXL, or Mooncake over TCP) and page size measured in a
child process of its own around ``testkit.sglang_pair.Pair`` (its docstring has the
pair, the shapes and one round).  Mooncake's pairs run with ``.venv-e2e``'s interpreter,
the environment that has Mooncake's engine (``make venv-e2e``).
``bench/bench_sglang_transfer.py`` runs it under pytest; ``python -m bench.sglang_pair``
prints the table.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
import traceback
from dataclasses import asdict

from testkit.child import Child, child_env, run_children
from testkit.zygote import ForkServer
from testkit.sglang_pair import (
    E2E_PYTHON,
    Pair,
    Shape,
    _kvmem_pool,
    merged_runs,
    request_pages,
    with_ibverbs,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# -- measurements --------------------------------------------------------------------------

# name -> (prefill environment, decode environment): the SGLANG_KVMEM* variables of each
# side and THP_MEM_ALLOC_ENABLE (everything else is inherited; other SGLANG_KVMEM*
# variables and THP_MEM_ALLOC_ENABLE are removed).
MODES = {
    "stock": ({"SGLANG_KVMEM": "0"}, {"SGLANG_KVMEM": "0"}),
    "kvmem": (
        {"SGLANG_KVMEM": "1", "SGLANG_KVMEM_TRANSFER": "kvmem"},
        {"SGLANG_KVMEM": "1", "SGLANG_KVMEM_TRANSFER": "kvmem"},
    ),
    "kvmem transfer=sglang": (
        {"SGLANG_KVMEM": "1", "SGLANG_KVMEM_TRANSFER": "sglang"},
        {"SGLANG_KVMEM": "1", "SGLANG_KVMEM_TRANSFER": "sglang"},
    ),
    "kvmem register=layers transfer=sglang": (
        {"SGLANG_KVMEM": "1", "SGLANG_KVMEM_REGISTER": "layers", "SGLANG_KVMEM_TRANSFER": "sglang"},
        {"SGLANG_KVMEM": "1", "SGLANG_KVMEM_REGISTER": "layers", "SGLANG_KVMEM_TRANSFER": "sglang"},
    ),
    "kvmem prefill + stock decode": (
        {"SGLANG_KVMEM": "1", "SGLANG_KVMEM_TRANSFER": "kvmem"},
        {"SGLANG_KVMEM": "0"},
    ),
    # stock sglang with torch's CPU allocator asking for transparent huge pages
    # (THP_MEM_ALLOC_ENABLE, read by c10's alloc_cpu): stock pools in huge pages, as
    # kvmem's host backend maps its own (MADV_HUGEPAGE)
    "stock THP_MEM_ALLOC_ENABLE=1": (
        {"SGLANG_KVMEM": "0", "THP_MEM_ALLOC_ENABLE": "1"},
        {"SGLANG_KVMEM": "0", "THP_MEM_ALLOC_ENABLE": "1"},
    ),
    # the host pools backed at first touch (before kvmem_sglang.kvpool prefaulted them at
    # creation): the first fill and the first transfer pay the page faults
    "kvmem prefault=0": (
        {"SGLANG_KVMEM": "1", "SGLANG_KVMEM_PREFAULT": "0", "SGLANG_KVMEM_TRANSFER": "kvmem"},
        {"SGLANG_KVMEM": "1", "SGLANG_KVMEM_PREFAULT": "0"},
    ),
}


def measure(
    shape: Shape, repeats: int, decode_env: dict | None = None, backend: str = "nixl"
) -> dict:
    """Start a pair, move the requests once (the first round: fresh pools, the decode's
    rows not cleared first, so the round is the first touch of its pages), then
    ``repeats`` rounds of the raw write and of the sglang transfer, alternating; the
    rows checked: every plane in the first round, the first and last plane after."""
    t0 = time.monotonic()
    pair = Pair(shape, decode_env, backend=backend)
    out = dict(
        shape=asdict(shape),
        backend=backend,
        pool_create_s=pair.pool_create_s,
        fill_s=pair.fill_s,
        decode_pool_create_s=pair.decode_info["pool_create_s"],
        kvmem_pool=dict(prefill=_kvmem_pool(pair.kv), decode=pair.decode_info["kvmem_pool"]),
        registrations=pair.registrations(),
        memory=dict(prefill=pair.memory, decode=pair.decode_info.get("memory")),
    )
    stats0 = _transfer_stats()
    try:
        # fresh pools, not cleared: the first write into the decode's pages
        out["first"] = pair.sglang_round(check=range(shape.planes), clear=False)
        sg, raw = [], []
        for _ in range(repeats):
            raw.append(pair.raw_round())
            sg.append(pair.sglang_round(check=(0, shape.planes - 1)))
        out["sglang"], out["raw"] = sg, raw
    finally:
        pair.close()
    pages = request_pages(shape, 0)
    out["index_pairs_per_request"] = shape.pages_per_request * shape.planes
    out["merged_within_request"] = merged_runs(pages, pages) * shape.planes
    out["page_bytes"] = shape.page_bytes
    out["setup_and_run_s"] = time.monotonic() - t0
    stats = _transfer_stats()
    if stats is not None:
        out["kvmem_transfer"] = {k: v - stats0.get(k, 0) for k, v in stats.items()}
    return out


def _transfer_stats() -> dict | None:
    try:
        from kvmem_sglang import state, transfer_records
    except ImportError:
        return None
    return transfer_records.STATS.as_dict() if state.PROCESS.options.is_active() else None


def summary(xs) -> dict:
    xs = list(xs)
    return dict(median=statistics.median(xs), min=min(xs), max=max(xs))


def _busy_seconds() -> float:
    """CPU seconds every process of the machine spent busy since boot (/proc/stat)."""
    with open("/proc/stat") as f:
        vals = [int(v) for v in f.readline().split()[1:]]
    return (sum(vals[:8]) - vals[3] - vals[4]) / os.sysconf("SC_CLK_TCK")


def run_mode(
    mode: str,
    page_sizes,
    shape: Shape,
    repeats: int,
    *,
    one_process: bool = False,
    timeout: float = 1800,
    backend: str = "nixl",
    forked: bool = False,
) -> list[dict]:
    """Measure ``mode`` (a key of MODES) on ``backend`` at each page size: one prefill
    process (and its decode child) per page size, or one for them all (``one_process``:
    the smoke mode; the pairs made first keep their engine threads while the later ones
    run).  ``forked``: those processes are forked from the fork server of their
    interpreter this process was told of (``testkit.zygote.ForkServer.of_parent``; the
    smoke run's, whose figures mean nothing), where there is one that takes them; else
    each is a fresh interpreter, which is what a measurement needs.  Each result gets
    ``mode``, the machine's load meanwhile (``others_cpu_cores``: busy CPU of other
    processes, in cores; ``loadavg``) and the ratios of each round to the raw write just
    before it."""
    import resource

    prefill_env, decode_env = MODES[mode]
    env = child_env(
        prefill_env,
        drop=("SGLANG_KVMEM", "THP_MEM_ALLOC_ENABLE"),
        paths=[os.path.join(ROOT, "integration", "sglang")],
    )
    python = None
    if backend == "mooncake":
        if not E2E_PYTHON.exists():
            raise FileNotFoundError(
                f"{E2E_PYTHON} is missing: Mooncake's pairs run in the "
                "e2e environment (make venv-e2e)"
            )
        env, python = with_ibverbs(env), str(E2E_PYTHON)
    groups = [list(page_sizes)] if one_process else [[p] for p in page_sizes]
    results = []
    for pages in groups:
        cfg = dict(
            shape=asdict(shape),
            pages=pages,
            repeats=repeats,
            decode_env=decode_env,
            backend=backend,
        )

        def cpu() -> float:
            c = resource.getrusage(resource.RUSAGE_CHILDREN)
            return c.ru_utime + c.ru_stime

        busy0, own0, t0, load0 = _busy_seconds(), cpu(), time.monotonic(), os.getloadavg()[0]
        name = f"{mode} on {backend} at page sizes {pages}"
        child = Child(
            module="bench.sglang_pair",
            args=("--child", json.dumps(cfg)),
            env=env,
            cwd=ROOT,
            python=python,
            fork=ForkServer.of_parent(python) if forked else None,
        )
        reply = run_children({name: child}, timeout)[name]
        wall = time.monotonic() - t0
        others = max(0.0, (_busy_seconds() - busy0) - (cpu() - own0)) / wall
        for r in reply.value:
            r.update(
                mode=mode,
                others_cpu_cores=others,
                loadavg=[load0, os.getloadavg()[0]],
                ratio_to_raw=[s["gbps"] / w["gbps"] for s, w in zip(r["sglang"], r["raw"])],
            )
            results.append(r)
    return results


def table(results: list[dict]) -> list[str]:
    """A compact table of ``run_mode`` results: one line per mode and page size."""

    def key(r):
        return (r.get("backend", "nixl"), r["shape"]["page_size"], _tp(r))

    stock = {
        key(r): statistics.median(x["gbps"] for x in r["sglang"])
        for r in results
        if r["mode"] == "stock"
    }
    head = (
        f"{'tp':>3} {'page':>4} {'backend':<8} {'mode':<40} {'GB/s':>6} {'[min, max]':>13} {'raw':>6} "
        f"{'x raw':>6} {'x stock':>7} {'desc/req':>8} {'first':>6} {'regs':>4} {'load':>5}"
    )
    out = [head, "-" * len(head)]
    for r in sorted(
        results,
        key=lambda r: (
            _tp(r),
            r["shape"]["page_size"],
            r.get("backend", "nixl"),
            list(MODES).index(r["mode"]) if r["mode"] in MODES else 99,
        ),
    ):
        ps, backend = r["shape"]["page_size"], r.get("backend", "nixl")
        g = summary(x["gbps"] for x in r["sglang"])
        raw = statistics.median(x["gbps"] for x in r["raw"])
        ratio = statistics.median(r["ratio_to_raw"])
        vs = g["median"] / stock[key(r)] if key(r) in stock else float("nan")
        desc = statistics.median(x["kv_descriptors_per_request"] for x in r["sglang"])
        out.append(
            f"{_tp(r):>3} {ps:>4} {backend:<8} {r['mode']:<40} {g['median']:6.2f} [{g['min']:5.2f},{g['max']:5.2f}] "
            f"{raw:6.2f} {ratio:6.2f} {vs:7.2f} {desc:8.0f} {r['first']['gbps']:6.2f} "
            f"{r['registrations']:>4} {r['others_cpu_cores']:5.2f}"
        )
    return out


def _tp(result: dict) -> str:
    """``Shape.tp_label`` of a result (1x1 for results made before TP)."""
    return Shape(**result["shape"]).tp_label


def _child(cfg: dict) -> list[dict]:
    shape = cfg["shape"]
    return [
        measure(
            Shape(**{**shape, "page_size": ps}),
            cfg["repeats"],
            cfg.get("decode_env"),
            cfg.get("backend", "nixl"),
        )
        for ps in cfg["pages"]
    ]


def main(argv: list[str]) -> None:
    import argparse

    ap = argparse.ArgumentParser(
        prog="python -m bench.sglang_pair",
        description="sglang 0.5.23's PD transfer between two processes on DRAM, stock "
        "against SGLANG_KVMEM=1, with a raw NIXL write between the same "
        "processes; prints a table (bench/bench_sglang_transfer.py runs the "
        "same under pytest).",
    )
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--pages", default="1,16,64")
    ap.add_argument("--backends", default="nixl", help="comma-separated: nixl, mooncake")
    ap.add_argument(
        "--modes", default=",".join(MODES), help="comma-separated, of: " + "; ".join(MODES)
    )
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument(
        "--tp",
        default="1x1",
        help="comma-separated <prefill TP>x<decode TP> (the decode's dividing "
        "the prefill's): 1x1, 2x1, 2x2, ...",
    )
    ap.add_argument("--json", help="write every result here")
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(_child(json.loads(a.child))), flush=True)
        return
    pages = [int(p) for p in a.pages.split(",")]
    results = []
    for tp in [t.strip() for t in a.tp.split(",") if t.strip()]:
        ptp, dtp = (int(x) for x in tp.split("x"))
        shape = Shape(
            layers=a.layers, requests=a.requests, tokens=a.tokens, prefill_tp=ptp, decode_tp=dtp
        )
        for backend in [b.strip() for b in a.backends.split(",") if b.strip()]:
            for mode in [m.strip() for m in a.modes.split(",") if m.strip()]:
                results += run_mode(mode, pages, shape, a.repeats, backend=backend)
                print("\n".join(table(results)), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(
                dict(time=time.strftime("%Y-%m-%dT%H:%M:%S"), cpus=os.cpu_count(), results=results),
                f,
                indent=1,
            )


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except BaseException as e:
        if isinstance(e, SystemExit) and not e.code:
            raise
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    os._exit(0)
