"""One run of sglang's own serving benchmark (``sglang.benchmark.serving``, imported, run
in this process) against a PD deployment's router, with the decode's running batch size
over the run read from the decode's Prometheus counters.

The benchmark's arguments are parsed by its own parser (``cli_main`` with its
``run_benchmark`` held back), so every default is sglang's; what this module sets:
``--backend sglang --dataset-name random-ids --tokenize-prompt`` (prompts of random token
ids, exactly ``input_len`` of them, sent as ids), ``--random-range-ratio 1.0`` (every
prompt and every answer the same length), ``--request-rate inf`` with
``--max-concurrency`` (a closed loop: ``concurrency`` requests in flight at any time),
``--warmup-requests 0`` (its warm-up request would be the first measured prompt again:
a cached prefix for it; bench/serving.py warms each pair up once instead), ``--seed``
(the same prompts for stock and the flag in a round, new ones every run otherwise),
``--pd-separated``, ``--output-file`` (sglang's own JSON line of the run, kept in the
logs) and ``--disable-tqdm``.  Answers ignore EOS (sglang's default), so each is exactly
``output_len`` tokens.

The decode's running batch size: every decode forward pass adds one to
``sglang:cuda_graph_passes_total{mode="decode_none"}`` and the tokens it generated to
``sglang:realtime_tokens_total{mode="decode"}`` (servers run with ``--enable-metrics``);
their growth over the run gives the mean batch per decode step (``decode_batch_mean``),
the batch that each inter-token latency was spent on.
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import numpy as np

# What each run record keeps of the benchmark's result (its key -> ours).
METRICS = ("ttft", "itl", "e2e_latency", "tpot")
STATS = ("median", "mean", "p90", "p99")
RATES = ("request_throughput", "output_throughput", "total_throughput")


@dataclass(frozen=True)
class Cell:
    """One point of the sweep: prompt length, answer length, requests in flight, and how
    many requests a run sends."""

    input_len: int
    output_len: int
    concurrency: int
    prompts: int

    @property
    def label(self) -> str:
        return f"in{self.input_len}-out{self.output_len}-c{self.concurrency}"


def benchmark_args(argv: list[str]):
    """sglang's parsed arguments for ``argv`` (its parser, defaults and checks)."""
    from sglang.benchmark import serving

    got = []
    with (
        mock.patch.object(serving, "run_benchmark", got.append),
        mock.patch.object(sys, "argv", ["sglang.benchmark.serving", *argv]),
    ):
        serving.cli_main()
    return got[0]


def argv_for(router_url: str, model: Path, cell: Cell, seed: int, output_file: Path) -> list[str]:
    return [
        "--backend",
        "sglang",
        "--base-url",
        router_url,
        "--dataset-name",
        "random-ids",
        "--tokenize-prompt",
        "--random-input-len",
        str(cell.input_len),
        "--random-output-len",
        str(cell.output_len),
        "--random-range-ratio",
        "1.0",
        "--num-prompts",
        str(cell.prompts),
        "--max-concurrency",
        str(cell.concurrency),
        "--request-rate",
        "inf",
        "--warmup-requests",
        "0",
        "--seed",
        str(seed),
        "--model",
        str(model),
        "--tokenizer",
        str(model),
        "--pd-separated",
        "--ready-check-timeout-sec",
        "0",
        "--output-file",
        str(output_file),
        "--disable-tqdm",
    ]


def decode_counters(decode) -> dict[str, float]:
    """The decode's forward passes and generated tokens so far (its /metrics)."""
    passes = decode.metric("sglang:cuda_graph_passes_total")
    tokens = decode.metric("sglang:realtime_tokens_total")
    return dict(
        passes=sum(v for k, v in passes.items() if 'mode="decode_' in k),
        tokens=sum(v for k, v in tokens.items() if 'mode="decode"' in k),
    )


def _stats(xs_s: list[float]) -> dict[str, float | None]:
    """median, mean, p90 and p99 in ms of values in seconds (numpy's linear percentiles,
    as sglang's benchmark computes them); None for none."""
    if not xs_s:
        return {s: None for s in STATS}
    a = np.asarray(xs_s) * 1e3
    return dict(
        median=float(np.median(a)),
        mean=float(a.mean()),
        p90=float(np.percentile(a, 90)),
        p99=float(np.percentile(a, 99)),
    )


def pooled(ttfts: list[float], itls: list[float], e2es: list[float] | None = None) -> dict:
    """TTFT / ITL (/ end-to-end) statistics of many requests together (seconds in, ms
    out): a window of several runs (the release/resume cycle)."""
    out = dict(ttft_ms=_stats(ttfts), itl_ms=_stats(itls), requests=len(ttfts))
    if e2es is not None:
        out["e2e_latency_ms"] = _stats(e2es)
    return out


def run(deployment, model: Path, cell: Cell, seed: int, logdir: Path, name: str) -> dict:
    """One benchmark run of ``cell`` through ``deployment``'s router; its record (the
    benchmark's figures, the decode's batch, errors) and, under ``"detail"``, each
    answered request's TTFT, ITLs and latency in seconds, in the order sent (for pooled
    windows; not stored)."""
    from sglang.benchmark import serving

    logdir.mkdir(parents=True, exist_ok=True)
    args = benchmark_args(
        argv_for(deployment.router.url, model, cell, seed, logdir / f"{name}.jsonl")
    )
    before = decode_counters(deployment.decode)
    with open(logdir / f"{name}.log", "w") as out, contextlib.redirect_stdout(out):
        result = serving.run_benchmark(args)
    after = decode_counters(deployment.decode)
    passes = after["passes"] - before["passes"]
    tokens = after["tokens"] - before["tokens"]
    errors = [e for e in result["errors"] if e]
    rec = dict(  # numpy's numbers made plain (json writes no numpy integer)
        completed=int(result["completed"]),
        failed=cell.prompts - int(result["completed"]),
        errors=[e[-300:] for e in errors[:3]],
        duration_s=float(result["duration"]),
        achieved_concurrency=float(result["concurrency"]),
        decode_passes=passes,
        decode_tokens=tokens,
        decode_batch_mean=tokens / passes if passes else None,
    )
    for m in METRICS:
        rec[f"{m}_ms"] = {s: float(result[f"{s}_{m}_ms"]) for s in STATS}
    for r in RATES:
        rec[r] = float(result[r])
    ok = [i for i, e in enumerate(result["errors"]) if not e]
    rec["detail"] = dict(
        ttfts=[float(result["ttfts"][i]) for i in ok],
        itls=[[float(x) for x in result["itls"][i]] for i in ok],
        # what each client waited: its first token, then every gap
        e2es=[float(result["ttfts"][i] + sum(result["itls"][i])) for i in ok],
    )
    return rec
