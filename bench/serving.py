"""sglang's serving benchmark (``sglang.benchmark.serving``) on real PD pairs behind
sglang's router, stock against ``SGLANG_KVMEM=1``, on NIXL and Mooncake: TTFT, ITL,
end-to-end latency and throughput, with their spread over repeated runs, over a sweep of
concurrency and prompt length; then the same benchmark through release/resume cycles of
the KV cache.

Run with the e2e tier's Python (``.venv-e2e``: sglang with its benchmark, the router,
Mooncake)::

    .venv-e2e/bin/python -m bench.serving --out DIR [--backends nixl,mooncake]
        [--rounds 3] [--concurrency 1,4,8,16] [--input-lens 128,1024] [--cycles 2] ...

``make bench`` runs it through bench/bench_serving.py (the defaults below) and
``--smoke`` is the smoke run of the main suite.  The servers are the e2e tier's
(``tests/e2e/fleet.py``: the tiny 2-layer model of ``tests/e2e/tiny_model.py``, sglang's
CPU flags, ``--enable-metrics``, ``--sleep-on-idle``), one prefill and one decode per
kind, each kind behind its own router.

Per backend, both kinds' pairs are started once and serve the whole sweep
(``--one-pair-at-a-time`` instead runs one kind's pair, all its runs, then the other's:
no interleaving, for a machine that cannot hold four engines, and the smoke run).  Each
pair is warmed up with one burst of the largest cell (kept apart from the runs).  Then
``--rounds`` rounds; in each, every cell (prompt length x concurrency) runs once on each
kind, back to back, the kind that goes first alternating from cell to cell and round to
round, so that drift in the machine hits both (:func:`plan`).  Both kinds get the same
prompts in a round (the seed), new ones in every run.  A run sends
``max(--prompts-per-slot x concurrency, --min-prompts)`` requests
(bench/serving_client.py has the benchmark's arguments).

The release/resume cycle (``--cycles`` per backend and kind, kinds alternating): runs of
``--resume-prompts`` requests at ``--resume-concurrency`` and the longest prompt length
back to back for ``--before-s`` seconds; the pair left idle; ``POST
/release_memory_occupation {"tags": ["kv_cache"]}`` to the prefill, then to the decode,
and ``/resume_memory_occupation`` likewise (each timed; the schedulers' resident memory
given back is read between); then the same runs for ``--after-s`` seconds from the
resume.  Stock sglang accepts both calls on this host and gives nothing back (no
torch_memory_saver without CUDA); the flag releases the pool and, at the first
transfers after the resume, registers it again and rebuilds its prepared transfer
lists: that is the cost measured.

The machine must be quiet (bench/serving_load.py): a load average above ``--max-load``
before the first server starts, or others' CPU above ``--max-others`` before a run,
waited on and then refused (exit 3; ``KVMEM_SERVING_ALLOW_LOAD=1`` / ``--allow-load``
runs anyway and flags each run).  The load average and others' CPU are recorded beside
every run.

Writes ``OUT/serving-cpu.json`` (bench/serving_report.py has its schema; written again
after every run, ``partial: true`` until the end) and its plots
``OUT/cpu-serving*.png`` (bench/serving_plot.py; drawn by ``.venv``'s Python when this
one has no matplotlib); logs (servers, each benchmark run's output and sglang's own
JSON line) in ``--logs`` (default: a new directory under $TMPDIR).  Exit status 0; 1
when a request failed or a server died; 2 for bad options; 3 when the machine was not
quiet.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import serving_report  # noqa: E402
from bench.serving_client import Cell, pooled  # noqa: E402
from bench.serving_load import Gate, NotQuiet, Window, loadavg  # noqa: E402

FLAG = {"SGLANG_KVMEM": "1"}
KINDS = {"stock": ({}, {}), "flag": (FLAG, FLAG)}
RESULTS_NAME = "serving-cpu.json"
KV = {"tags": ["kv_cache"]}
CONTROL_TIMEOUT_S = 120.0
SMOKE = dict(
    backends="nixl",
    rounds=1,
    concurrency="2",
    input_lens="32",
    output_len=4,
    prompts_per_slot=2,
    min_prompts=4,
    cycles=1,
    resume_concurrency=2,
    resume_prompts=4,
    before_s=0.0,
    after_s=0.0,
    one_pair_at_a_time=True,
    allow_load=True,
    quiet_wait=0.0,
)


class Failed(RuntimeError):
    """A server died or a request failed."""


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m bench.serving", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--out", type=Path, required=True, help="serving-cpu.json and plots here")
    ap.add_argument("--logs", type=Path, help="server and run logs (default: new dir in $TMPDIR)")
    ap.add_argument("--backends", default="nixl,mooncake", help="comma-separated: nixl, mooncake")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", default="1,4,8,16", help="comma-separated")
    ap.add_argument("--input-lens", default="128,1024", help="prompt lengths, comma-separated")
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--prompts-per-slot", type=int, default=8, help="requests per run / conc.")
    ap.add_argument("--min-prompts", type=int, default=16)
    ap.add_argument("--cycles", type=int, default=2, help="release/resume cycles (0: none)")
    ap.add_argument("--resume-concurrency", type=int, default=8)
    ap.add_argument("--resume-prompts", type=int, help="requests per run (default 2 x conc.)")
    ap.add_argument("--before-s", type=float, default=30.0, help="window before the release")
    ap.add_argument("--after-s", type=float, default=60.0, help="window after the resume")
    ap.add_argument("--one-pair-at-a-time", action="store_true")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--note", default=os.environ.get("KVMEM_BENCH_NOTE", ""))
    ap.add_argument("--allow-load", action="store_true", help="never refuse; flag loaded runs")
    ap.add_argument("--max-load", type=float, help="load average allowed at the start")
    ap.add_argument("--max-others", type=float, help="others' CPU (cores) allowed in a run")
    ap.add_argument("--quiet-wait", type=float, help="seconds to wait for quiet")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, one backend: plumbing")
    a = ap.parse_args(argv)
    if a.smoke:
        for k, v in SMOKE.items():
            setattr(a, k, v)
    a.backends = [b.strip() for b in a.backends.split(",") if b.strip()]
    if not a.backends or set(a.backends) - {"nixl", "mooncake"}:
        ap.error(f"--backends: a comma-separated subset of nixl,mooncake, got {a.backends}")
    a.concurrency, a.input_lens = _ints(a.concurrency), _ints(a.input_lens)
    if a.rounds < 1 or not a.concurrency or not a.input_lens or min(a.concurrency) < 1:
        ap.error("--rounds, --concurrency and --input-lens need positive values")
    return a


def cells(a) -> list[Cell]:
    return [
        Cell(n, a.output_len, c, max(a.prompts_per_slot * c, a.min_prompts))
        for n in a.input_lens
        for c in a.concurrency
    ]


def resume_cell(a) -> Cell:
    c = a.resume_concurrency
    return Cell(max(a.input_lens), a.output_len, c, a.resume_prompts or 2 * c)


class Bench:
    """One invocation: the fleet, the gate, the results so far and where they go."""

    def __init__(self, a, gate: Gate):
        from tests.e2e.deploy import CPU_THREADS, DECODE_ARGS, SERVER_ARGS
        from tests.e2e.fleet import Fleet
        from tests.e2e.tiny_model import CONFIG, make_tiny_model

        self.a, self.gate = a, gate
        self.logs = a.logs or Path(tempfile.mkdtemp(prefix="kvmem-serving-"))
        self.model = make_tiny_model(self.logs / "model")
        self.fleet = Fleet(self._model_of, self.logs / "servers")
        self.seq = 0
        self.results = dict(
            bench="serving",
            schema=serving_report.SCHEMA,
            time=time.strftime("%Y-%m-%dT%H:%M:%S"),
            device=f"CPU {platform.processor() or platform.machine()} x{os.cpu_count()}",
            device_type="cpu",
            sglang=_version("sglang"),
            smoke=bool(a.smoke),
            partial=True,
            refused=None,
            note=a.note,
            logs=str(self.logs),
            config=dict(
                backends=a.backends,
                kinds={k: dict(prefill_env=p, decode_env=d) for k, (p, d) in KINDS.items()},
                cells=[asdict(c) for c in cells(a)],
                rounds=a.rounds,
                order="one pair at a time" if a.one_pair_at_a_time else "interleaved",
                resume=dict(
                    cycles=a.cycles,
                    before_s=a.before_s,
                    after_s=a.after_s,
                    **asdict(resume_cell(a)),
                ),
                seed=a.seed,
                model=CONFIG,
                server_args=SERVER_ARGS,
                decode_args=DECODE_ARGS,
                omp_threads=CPU_THREADS,
            ),
            gate=gate.as_dict(),
            pairs=[],
            warmups=[],
            runs=[],
            cycles=[],
        )

    def _model_of(self, family: str) -> Path:
        """The fleet's model of ``family``: the benchmark serves the tiny dense model only."""
        if family != "llama":
            raise ValueError(f"the serving benchmark serves the dense tiny model, not {family!r}")
        return self.model

    # -- output ---------------------------------------------------------------------------

    def write(self) -> Path:
        self.results["summary"] = serving_report.summarize(self.results)
        self.a.out.mkdir(parents=True, exist_ok=True)
        path = self.a.out / RESULTS_NAME
        tmp = path.with_suffix(".json.part")
        tmp.write_text(json.dumps(self.results, indent=1, default=_plain))
        os.replace(tmp, path)
        return path

    def pgids(self) -> set[int]:
        return {s.proc.pid for s in self.fleet.live() if s.proc is not None}

    # -- pairs ----------------------------------------------------------------------------
    def pair(self, backend: str, kind: str):
        prefill_env, decode_env = KINDS[kind]
        t0, starts = time.monotonic(), sum(self.fleet.started.values())
        d = self.fleet.get(dict(prefill_env=prefill_env, decode_env=decode_env), backend)
        start_s = time.monotonic() - t0
        if sum(self.fleet.started.values()) > starts:  # started now, not kept by the fleet
            self.results["pairs"].append(
                dict(backend=backend, kind=kind, start_s=round(start_s, 1))
            )
            print(f"serving: {backend} {kind} pair up in {start_s:.0f} s", flush=True)
            # one burst of the largest requests at the largest concurrency, not recorded
            # with the runs: the pair's first transfers and first use of its pools
            c = max(self.a.concurrency)
            warm = Cell(max(self.a.input_lens), self.a.output_len, c, c)
            rec = self._bench(d, backend, kind, warm, self.a.seed + 900_000, "warmup")
            rec.pop("detail")
            self.results["warmups"].append(dict(backend=backend, kind=kind, **rec))
        return d

    def _bench(self, d, backend: str, kind: str, cell: Cell, seed: int, name: str) -> dict:
        from bench import serving_client

        self.seq += 1
        rec = serving_client.run(
            d, self.model, cell, seed, self.logs / "runs", f"{self.seq:04d}-{backend}-{kind}-{name}"
        )
        crashed = d.crashed()
        if crashed:
            raise Failed(f"{backend} {kind}: {crashed}\n{d.logs(30)}")
        return rec

    # -- the sweep ------------------------------------------------------------------------
    def run(self, d, backend: str, kind: str, rnd: int, cell: Cell, seed: int) -> dict:
        before = self.gate.before_run(self.pgids())
        load0, w, t = loadavg(), Window(self.pgids()).open(), time.strftime("%H:%M:%S")
        rec = self._bench(d, backend, kind, cell, seed, f"r{rnd}-{cell.label}")
        during = w.close()
        rec.pop("detail")
        run = dict(
            backend=backend,
            kind=kind,
            round=rnd,
            seq=self.seq,
            cell=asdict(cell),
            seed=seed,
            time=t,
            loadavg_before=load0,
            loadavg_after=loadavg(),
            **during,
            **before,
            loaded=self.gate.flag(during, before),
            **rec,
        )
        self.results["runs"].append(run)
        self.write()
        print(_line(run), flush=True)
        return run

    # -- release / resume -----------------------------------------------------------------
    def window(self, d, backend, kind, cell: Cell, seconds: float, t0: float, seed0: int) -> dict:
        """Runs of ``cell`` back to back until ``seconds`` passed since ``t0`` (one at
        least): each run's record with its start after ``t0``, and the pooled figures
        of all of them and of the first run's first batch."""
        slices, ttfts, itls, e2es, first = [], [], [], [], None
        while not slices or time.monotonic() - t0 < seconds:
            start = time.monotonic() - t0
            rec = self._bench(d, backend, kind, cell, seed0 + len(slices), f"slice{len(slices)}")
            detail = rec.pop("detail")
            if first is None:
                n = cell.concurrency
                first = pooled(detail["ttfts"][:n], [x for xs in detail["itls"][:n] for x in xs])
            ttfts += detail["ttfts"]
            itls += [x for xs in detail["itls"] for x in xs]
            e2es += detail["e2es"]
            slices.append(dict(offset_s=round(start, 3), **rec))
        return dict(window=pooled(ttfts, itls, e2es), first=first, slices=slices)

    def cycle(self, d, backend: str, kind: str, n: int, seed0: int) -> dict:
        from tests.e2e.deploy import given_back, rss_by_mapping

        cell = resume_cell(self.a)
        before_gate = self.gate.before_run(self.pgids())
        load0, w = loadavg(), Window(self.pgids()).open()
        before = self.window(d, backend, kind, cell, self.a.before_s, time.monotonic(), seed0)
        held = d.settle()
        if held:
            raise Failed(f"{backend} {kind}: not idle before the release: {held}")
        servers = (d.prefill, d.decode)
        snaps = {s.name: {p: rss_by_mapping(p) for p in s.scheduler_pids()} for s in servers}
        release_s, resume_s, back = {}, {}, {}
        for s in servers:
            release_s[s.name] = self._control(d, s, "/release_memory_occupation")
        for s in servers:
            back[s.name] = round(
                sum(given_back(snap, rss_by_mapping(p)) for p, snap in snaps[s.name].items())
                / 2**20,
                1,
            )
        for s in servers:
            resume_s[s.name] = self._control(d, s, "/resume_memory_occupation")
        t_resume = time.monotonic()
        after = self.window(d, backend, kind, cell, self.a.after_s, t_resume, seed0 + 100)
        during = w.close()
        rec = dict(
            backend=backend,
            kind=kind,
            cycle=n,
            seq=self.seq,
            cell=asdict(cell),
            loadavg_before=load0,
            loadavg_after=loadavg(),
            **during,
            **before_gate,
            loaded=self.gate.flag(during, before_gate),
            release_s=release_s,
            resume_s=resume_s,
            given_back_mib=back,
            before=before,
            after=after,
        )
        self.results["cycles"].append(rec)
        self.write()
        t, f = after["window"]["ttft_ms"], after["first"]["ttft_ms"]
        print(
            f"[{self.seq}] {backend:<8} {kind:<5} cycle {n}: TTFT "
            f"{before['window']['ttft_ms']['median']:.1f} -> {t['median']:.1f} ms, first batch "
            f"{before['first']['ttft_ms']['median']:.1f} -> {f['median']:.1f} ms; ITL "
            f"{before['window']['itl_ms']['median']:.2f} -> "
            f"{after['window']['itl_ms']['median']:.2f} ms; release "
            f"{max(release_s.values()):.2f} s, resume {max(resume_s.values()):.2f} s, given back "
            f"{back} MiB" + (" LOADED" if rec["loaded"] else ""),
            flush=True,
        )
        return rec

    def _control(self, d, server, path: str) -> float:
        t0 = time.monotonic()
        r = d.control(server, path, KV, timeout=CONTROL_TIMEOUT_S)
        if r.status != 200:
            raise Failed(f"{server.name} {path}: {r.status} {r.body} {r.error}")
        return round(time.monotonic() - t0, 3)

    # -- all of it ------------------------------------------------------------------------
    def main(self) -> None:
        """The steps of :func:`plan`, in order."""
        self.results["gate"]["at_start"] = self.gate.before_start()
        deps = {}
        for step, *args in plan(self.a):
            if step == "pair":
                deps[tuple(args)] = self.pair(*args)
            elif step == "run":
                backend, kind, *rest = args
                self.run(deps[backend, kind], backend, kind, *rest)
            elif step == "cycle":
                backend, kind, *rest = args
                self.cycle(deps[backend, kind], backend, kind, *rest)
            else:  # "stop"
                self.fleet.stop_all()
                deps.clear()


def plan(a) -> list[tuple]:
    """The steps of an invocation, in order: ``("pair", backend, kind)`` (start its
    pair), ``("run", backend, kind, round, cell, seed)``, ``("cycle", backend, kind, n,
    seed)`` (a release/resume cycle; its runs take seeds from ``seed`` on) and
    ``("stop",)`` (every server stopped).  Per backend: both kinds' pairs, then every
    round of every cell on each kind back to back, the first kind alternating from cell
    to cell and round to round, then the cycles, kinds alternating; with
    ``one_pair_at_a_time``, one kind's pair with all its runs and cycles, stopped, then
    the other's.  Both kinds of a round get the same seed; every other run its own."""
    steps: list[tuple] = []
    for b, backend in enumerate(a.backends):
        kinds = list(KINDS) if b % 2 == 0 else list(KINDS)[::-1]
        blocks = [[k] for k in kinds] if a.one_pair_at_a_time else [kinds]
        for block in blocks:
            steps += [("pair", backend, k) for k in block]
            for rnd in range(a.rounds):
                for i, cell in enumerate(cells(a)):
                    order = block if (rnd + i) % 2 == 0 else block[::-1]
                    steps += [
                        ("run", backend, k, rnd, cell, a.seed + 1000 * rnd + i) for k in order
                    ]
            for n in range(a.cycles):
                order = block if n % 2 == 0 else block[::-1]
                steps += [("cycle", backend, k, n, a.seed + 500_000 + 1000 * n) for k in order]
            steps.append(("stop",))
    return steps


def _plain(x):
    """A numpy scalar as the Python number it holds (else json's own error)."""
    if hasattr(x, "item"):
        return x.item()
    raise TypeError(f"{type(x).__name__} is not JSON serializable")


def _line(run: dict) -> str:
    c = run["cell"]
    return (
        f"[{run['seq']}] {run['backend']:<8} {run['kind']:<5} r{run['round']} "
        f"in {c['input_len']:>4} c {c['concurrency']:>2}: TTFT {run['ttft_ms']['median']:7.1f} ms "
        f"ITL {run['itl_ms']['median']:6.2f} ms E2E {run['e2e_latency_ms']['median']:7.0f} ms "
        f"{run['output_throughput']:7.0f} tok/s batch {run['decode_batch_mean'] or 0:5.2f} | "
        f"load {run['loadavg_before'][0]:.1f} others {run['others_cores']:.2f}"
        + (" LOADED" if run["loaded"] else "")
        + (f" FAILED {run['failed']}" if run["failed"] else "")
    )


def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "?"


def plot(path: Path, out: Path) -> list[str]:
    """The plots of ``path`` (bench/serving_plot.py), here or, where this environment has
    no matplotlib (``.venv-e2e``), with ``.venv``'s Python."""
    try:
        from bench import plot as bench_plot
    except ImportError:
        py = ROOT / ".venv" / "bin" / "python"
        if not py.exists():
            print(f"no plots: no matplotlib here; python -m bench.plot {path} draws them")
            return []
        p = subprocess.run(
            [str(py), "-m", "bench.plot", str(path), str(out)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )
        if p.returncode:
            print(f"no plots: bench.plot failed:\n{p.stdout}{p.stderr}")
            return []
        return [x.split(" ", 1)[1] for x in p.stdout.splitlines() if x.startswith("written: ")]
    return bench_plot.plot_file(str(path), str(out))


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    gate = Gate()
    for name, value in (
        ("max_load", a.max_load),
        ("max_others", a.max_others),
        ("wait_s", a.quiet_wait),
    ):
        if value is not None:
            setattr(gate, name, value)
    gate.allow_load = gate.allow_load or a.allow_load
    bench = Bench(a, gate)
    print(f"serving: logs in {bench.logs}", flush=True)
    status, done = 0, False
    try:
        bench.main()
        done = True
    except NotQuiet as e:
        bench.results["refused"] = str(e)
        print(f"serving: refused: {e}", flush=True)
        status = 3
    except Failed as e:
        print(f"serving: {e}", flush=True)
        status = 1
    finally:
        bench.fleet.stop_all()
        bench.results["partial"] = not done
        path = bench.write()
    if any(r["failed"] for r in bench.results["runs"]):
        status = status or 1
    print("\n".join(serving_report.table(bench.results["summary"])))
    print(f"written: {path}")
    for png in plot(path, a.out):
        print(f"written: {png}")
    return status


if __name__ == "__main__":
    raise SystemExit(main())
