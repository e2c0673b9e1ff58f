"""First-burst TTFT of a real sglang PD pair behind sglang's router, stock against
``SGLANG_KVMEM=1`` (``--kinds``: on both servers, on one, or with one of the adapter's
settings changed), alternating, with sglang's per-request time stats.

Run with the e2e tier's Python (``.venv-e2e``)::

    .venv-e2e/bin/python -m bench.e2e_ttft --rounds 3 --out /tmp/ttft

Each round starts a pair of each kind in turn (``tests/e2e/deploy.py``: the servers the
e2e tier runs, with ``--enable-request-time-stats-logging``), sends ``--bursts`` bursts of
40 plain requests through the router (a third streamed, as the scenario's first burst;
``--gap`` seconds between bursts; before them, with ``--sequential N``, N streamed
requests one at a time, the latency of a request that has the pair to itself), and stops
it.  Per kind and burst it prints the
streamed requests' TTFT (median, max) and the medians of sglang's ``ReqTimeStats`` of
every request: on the prefill ``bootstrap``, ``queue`` and ``forward`` (for a PD prefill
that lasts until its KV transfer is done), on the decode ``transfer`` (waiting for the
KV) and ``forward``.  The load average is printed beside each run: on a machine others
use, these figures swing by several times (bench/results/cpu-2026-12-01-sglang-e2e.md).
On two cores they swing on a quiet machine too: both servers' scheduler loops poll without
sleeping and take a core each while idle, so a burst's TTFT is set by how the kernel shares
two cores among them, the tokenizers, the router and the clients.  The servers run as the
e2e tier runs them: sglang's overlap schedule, one OpenMP thread each (``deploy.py``;
with torch's default of one per core every figure here was several times larger,
bench/results/cpu-2026-12-02-e2e-overlap-threads.md).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.e2e import scenario  # noqa: E402
from tests.e2e.deploy import Deployment, prompt  # noqa: E402
from tests.e2e.tiny_model import make_tiny_model  # noqa: E402

FLAG = {"SGLANG_KVMEM": "1"}
# kind -> (prefill environment, decode environment)
KINDS = {
    "stock": ({}, {}),
    "flag": (FLAG, FLAG),
    "flag-xfer-sglang": (
        {**FLAG, "SGLANG_KVMEM_TRANSFER": "sglang"},
        {**FLAG, "SGLANG_KVMEM_TRANSFER": "sglang"},
    ),
    "flag-prefault0": (
        {**FLAG, "SGLANG_KVMEM_PREFAULT": "0"},
        {**FLAG, "SGLANG_KVMEM_PREFAULT": "0"},
    ),
    "flag-register-layers": (
        {**FLAG, "SGLANG_KVMEM_REGISTER": "layers"},
        {**FLAG, "SGLANG_KVMEM_REGISTER": "layers"},
    ),
    "flag-prefill-only": (FLAG, {}),
    "flag-decode-only": ({}, FLAG),
}
STAGES = {"prefill": ("bootstrap", "queue", "forward"), "decode": ("transfer", "forward")}


def _stats(log: Path) -> dict:
    """bootstrap room -> {stage: ms, "entry": s} from sglang's ReqTimeStats lines."""
    out = {}
    for line in log.read_text(errors="replace").splitlines():
        if "ReqTimeStats(" not in line or "HEALTH_CHECK" in line:
            continue
        room = re.search(r"bootstrap_room=(\d+)", line)
        row = {k: float(v) for k, v in re.findall(r"(\w+)_duration=([0-9.]+)ms", line)}
        row["entry"] = float(re.search(r"entry_time=([0-9.]+)", line).group(1))
        out[room.group(1) if room else line] = row
    return out


def one(
    kind: str,
    model: Path,
    out: Path,
    bursts: int,
    gap: float,
    sequential: int = 0,
    server_args: list[str] = (),
    server_env: dict[str, str] | None = None,
) -> dict:
    prefill_env, decode_env = KINDS[kind]
    env = server_env or {}
    d = Deployment(
        model,
        out / "logs",
        prefill_env={**env, **prefill_env},
        decode_env={**env, **decode_env},
        extra_args=["--enable-request-time-stats-logging", *server_args],
    )
    load = os.getloadavg()[0]
    d.start()
    rows, single = [], []
    try:
        for i in range(sequential):  # one streamed request at a time: latency, no contention
            o = scenario._request(
                d.router.url, prompt(5000 + i, 8 + i % 24), 16, None, True, False, "plain"
            )
            single.append(round(1e3 * o.ttft) if o.ttft is not None else None)
        with ThreadPoolExecutor(64) as pool:
            for b in range(bursts):
                fs = [
                    pool.submit(
                        scenario._request,
                        d.router.url,
                        prompt(i, 8 + i % 24),
                        16,
                        None,
                        k % 3 == 0,
                        False,
                        "plain",
                    )
                    for k, i in enumerate(range(100 * b, 100 * b + 40))
                ]
                outs = [f.result() for f in fs]
                t = sorted(o.ttft for o in outs if o.ttft is not None)
                rows.append(
                    {
                        "ttft_ms": [round(1e3 * x) for x in t],
                        "statuses": sorted({str(o.status) for o in outs}),
                    }
                )
                time.sleep(gap)
    finally:
        d.stop()
    sides = {s: _stats(out / "logs" / f"{s}.log") for s in STAGES}
    entries = sorted(r["entry"] for r in sides["prefill"].values())[sequential:]
    for b, row in enumerate(rows):  # a request's burst: by its arrival at the prefill
        lo = entries[40 * b] if len(entries) > 40 * b else float("inf")
        hi = entries[40 * (b + 1)] if len(entries) > 40 * (b + 1) else float("inf")
        rooms = [k for k, r in sides["prefill"].items() if lo <= r["entry"] < hi]
        for s, stages in STAGES.items():
            for st in stages:
                xs = [sides[s][k][st] for k in rooms if st in sides[s].get(k, {})]
                row[f"{s}_{st}_ms"] = round(statistics.median(xs)) if xs else None
    return {
        "kind": kind,
        "server_args": list(server_args),
        "server_env": env,
        "loadavg_start": load,
        "loadavg_end": os.getloadavg()[0],
        "sequential_ttft_ms": single,
        "bursts": rows,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--bursts", type=int, default=2)
    ap.add_argument("--gap", type=float, default=3.0, help="seconds between bursts")
    ap.add_argument("--out", type=Path, help="logs and results.json here")
    ap.add_argument(
        "--summarize",
        type=Path,
        metavar="RESULTS_JSON",
        help="run nothing: print the summary of an earlier run's results.json "
        "(with the --kinds and --bursts it ran with)",
    )
    ap.add_argument(
        "--sequential",
        type=int,
        default=0,
        help="before the bursts, this many streamed requests one at a time",
    )
    ap.add_argument(
        "--kinds",
        default="stock,flag",
        help="comma-separated, run in this order each round, of: " + ", ".join(KINDS),
    )
    ap.add_argument(
        "--alternate",
        action="store_true",
        help="run the kinds in reverse order in odd rounds (no kind always first)",
    )
    ap.add_argument(
        "--server-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="one more argument for both servers of every kind (repeat it), e.g. "
        "--server-arg=--sleep-on-idle: sglang's schedulers then wait on their "
        "sockets while fully idle instead of polling a core each",
    )
    ap.add_argument(
        "--server-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="one more environment variable for both servers of every kind "
        "(repeat it), e.g. the scenario's --server-env="
        "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT=8",
    )
    a = ap.parse_args(argv)
    bad = [e for e in a.server_env if "=" not in e]
    if bad:
        ap.error(f"--server-env wants NAME=VALUE, got {bad}")
    server_env = dict(e.split("=", 1) for e in a.server_env)
    kinds = [k.strip() for k in a.kinds.split(",") if k.strip()]
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        ap.error(f"unknown kind(s) {unknown}; known: {', '.join(KINDS)}")
    if a.summarize:
        results = json.loads(a.summarize.read_text())
        for i, res in enumerate(results):  # runs recorded before "round" was kept
            res.setdefault("round", i // len(kinds))
        _summary(results, kinds, a.bursts)
        return 0
    if a.out is None:
        ap.error("--out is required (or --summarize)")
    model = make_tiny_model(a.out / "model")
    results = []
    for r in range(a.rounds):
        for kind in kinds[::-1] if a.alternate and r % 2 else kinds:
            res = one(
                kind,
                model,
                a.out / f"{kind}-{r}",
                a.bursts,
                a.gap,
                a.sequential,
                a.server_arg,
                server_env,
            )
            res["round"] = r
            results.append(res)
            if res["sequential_ttft_ms"]:
                print(
                    f"round {r} {kind:20s} one at a time: TTFT {res['sequential_ttft_ms']} ms",
                    flush=True,
                )
            for b, row in enumerate(res["bursts"]):
                t = row["ttft_ms"]
                print(
                    f"round {r} {kind:20s} burst {b}: TTFT median {statistics.median(t)} "
                    f"max {max(t)} ms; "
                    + ", ".join(
                        f"{k[:-3]} {v}"
                        for k, v in row.items()
                        if k.endswith("_ms") and k != "ttft_ms"
                    )
                    + f"; load {res['loadavg_start']:.1f}-{res['loadavg_end']:.1f}",
                    flush=True,
                )
            (a.out / "results.json").write_text(json.dumps(results, indent=1))
    _summary(results, kinds, a.bursts)
    return 0


def _summary(results: list[dict], kinds: list[str], bursts: int) -> None:
    """Per kind and burst: the median over rounds of each round's median TTFT, with the
    rounds' range; then the requests sent one at a time, all rounds together."""
    for kind in kinds:
        runs = [r for r in results if r["kind"] == kind]
        for b in range(bursts):
            meds = [
                statistics.median(r["bursts"][b]["ttft_ms"])
                for r in runs
                if len(r["bursts"]) > b and r["bursts"][b]["ttft_ms"]
            ]
            pooled = sorted(
                x for r in runs if len(r["bursts"]) > b for x in r["bursts"][b]["ttft_ms"]
            )
            if meds:
                print(
                    f"{kind:20s} burst {b}: median over {len(meds)} rounds "
                    f"{statistics.median(meds)} ms (rounds {min(meds)}-{max(meds)}); "
                    f"all rounds' requests together: median {statistics.median(pooled)} ms, "
                    f"p99 {scenario.nearest_rank(pooled, 0.99)} ms (n={len(pooled)})"
                )
        if kind != kinds[0]:
            _against(results, kinds[0], kind, bursts)
        single = sorted(x for r in runs for x in r["sequential_ttft_ms"] if x is not None)
        if single:
            print(
                f"{kind:20s} one at a time: median {statistics.median(single)} ms, p90 "
                f"{single[int(0.9 * (len(single) - 1))]} ms (n={len(single)})"
            )


def _against(results: list[dict], base: str, kind: str, bursts: int) -> None:
    """Per burst, ``kind`` against ``base`` (the first of --kinds) round by round: the
    ratio of the medians over rounds and of the pooled median and p99, and in how many
    rounds ``kind``'s median was the lower (a sign count: on two cores a round's figure
    swings by several times, so a ratio means little without it)."""
    for b in range(bursts):
        pairs, pooled = [], {base: [], kind: []}
        for r in sorted({x["round"] for x in results}):
            meds = {}
            for k in (base, kind):
                run = [x for x in results if x["kind"] == k and x["round"] == r]
                t = run[0]["bursts"][b]["ttft_ms"] if run and len(run[0]["bursts"]) > b else []
                pooled[k] += t
                if t:
                    meds[k] = statistics.median(t)
            if len(meds) == 2:
                pairs.append((meds[kind], meds[base]))
        if not pairs:
            continue
        a, s = sorted(pooled[kind]), sorted(pooled[base])
        lower = sum(x < y for x, y in pairs)
        print(
            f"{kind:20s} burst {b} against {base}: median over rounds "
            f"{statistics.median(x for x, _ in pairs) / statistics.median(y for _, y in pairs):.2f}x, "
            f"pooled median {statistics.median(a) / statistics.median(s):.2f}x, pooled p99 "
            f"{scenario.nearest_rank(a, 0.99) / scenario.nearest_rank(s, 0.99):.2f}x; lower "
            f"in {lower} of {len(pairs)} rounds"
        )


if __name__ == "__main__":
    raise SystemExit(main())
