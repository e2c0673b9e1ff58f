"""A scenario of a few hundred requests through sglang's router, with everything a PD
deployment meets: client disconnects, ``/abort_request`` by rid and ``abort_all``, a
decode that stops mid-transfer for longer than the prefill's transfer timeout, and two
release/resume cycles of both engines with requests in every state.  :func:`run` drives
one deployment and returns what happened, per request category:

* answered: an HTTP answer came (a disconnected client counts as answered: it left);
* hangs: no answer within ``HANG_S`` (45 s);
* wrong: an answer whose status the lifecycle table does not allow for its category
  (:data:`ALLOWED`);
* crashes: servers whose process died or whose log shows a scheduler crash;
* leaks: KV tokens or requests still held by a server once everything was answered and
  the servers had ``IDLE_S`` to settle (its own ``/v1/loads``), the adapter's leak counter
  (``kvmem_sglang_prefill_leaked_total`` in ``/metrics``) and leak log lines;
* TTFT of the streamed requests that succeeded (time to the first streamed token), of
  the plain traffic before any fault (``plain``: the same conditions for stock and the
  flag) and after all of them (``plain_after``; stock has usually crashed by then).
"""

from __future__ import annotations

import json
import random
import signal
import statistics
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from tests.e2e.deploy import IDLE_S, http, prompt

HANG_S = 45.0
# SGLANG_DISAGGREGATION_TRANSFER_TIMEOUT of the tier's PD servers (tests/e2e/conftest.py
# TIMEOUTS): the decode stops for longer than it
TRANSFER_TIMEOUT_S = 8.0
# SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT of the tier's PD servers (an int; sglang's
# default is 300 s): a request whose bootstrap handshake the stopped decode left
# unfinished (seen: 15 requests in the prefill's bootstrap queue and the decode's
# transfer queue for 26 s after SIGCONT) is ended by it inside HANG_S.  Longer than the
# tests' PROMPT_S (20 s), so that an answer they see within PROMPT_S is never this
# timeout's.
BOOTSTRAP_TIMEOUT_S = 25
KV = {"tags": ["kv_cache"]}

# status codes each category may end with (0: the client disconnected on purpose)
ALLOWED = {
    "plain": {200},
    "plain_after": {200},  # the same traffic after every fault below
    "disconnect": {0},
    "abort_rid": {200, 400, 499, 503},  # finished first, or answered as the abort
    "abort_all": {200, 400, 499, 503},
    "decode_stopped": {200, 504},  # finished in time, or a transfer or bootstrap
    # timeout
    "release": {200, 503},  # finished first, or refused by the release
}


@dataclass
class Outcome:
    category: str
    status: int | None = None  # None: no answer within HANG_S
    seconds: float = 0.0
    ttft: float | None = None
    body: str = ""


@dataclass
class Report:
    requests: int = 0
    answered: int = 0
    hangs: int = 0
    wrong: int = 0
    crashes: list = field(default_factory=list)
    leaks: dict = field(default_factory=dict)
    by_category: dict = field(default_factory=dict)
    wrong_examples: list = field(default_factory=list)
    ttft_ms: dict = field(default_factory=dict)
    seconds: float = 0.0

    def as_json(self) -> dict:
        return dict(self.__dict__)


def _request(
    url: str, text: str, tokens: int, rid: str | None, stream: bool, disconnect: bool, category: str
) -> Outcome:
    payload = {"text": text, "sampling_params": {"max_new_tokens": tokens, "temperature": 0}}
    if rid:
        payload["rid"] = rid
    if stream:
        payload["stream"] = True
    req = urllib.request.Request(
        url + "/generate",
        data=json.dumps(payload).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    t0 = time.monotonic()
    out = Outcome(category)
    try:
        with urllib.request.urlopen(req, timeout=HANG_S) as r:
            if not stream:
                out.body = r.read().decode(errors="replace")[:300]
                out.status = r.status
            else:
                status = r.status
                for line in r:
                    if line.startswith(b"data:") and out.ttft is None:
                        out.ttft = time.monotonic() - t0
                        if disconnect:
                            break  # the client goes away mid-stream
                    if b'"abort"' in line or b'"error"' in line:
                        out.body = line.decode(errors="replace")[:300]
                        status = _stream_status(line) or status
                out.status = 0 if disconnect else status
    except urllib.error.HTTPError as e:
        out.status, out.body = e.code, e.read().decode(errors="replace")[:300]
    except (TimeoutError, OSError) as e:
        if "timed out" in str(e):
            out.status = None
        else:
            out.status, out.body = -1, f"{type(e).__name__}: {e}"[:300]
    out.seconds = time.monotonic() - t0
    return out


def _stream_status(line: bytes) -> int | None:
    """The status of an error or abort inside a stream chunk (sglang streams the
    finish reason's ``status_code``)."""
    try:
        chunk = json.loads(line[len(b"data:") :])
    except ValueError:
        return None
    reason = (chunk.get("meta_info") or {}).get("finish_reason") or {}
    err = chunk.get("error") or {}
    code = reason.get("status_code") or err.get("code")
    return int(code) if isinstance(code, int) else None


def run(d, seed: int = 0, scale: int = 1) -> Report:
    """Drive the scenario on deployment ``d`` (a PD pair); ``scale`` multiplies the
    request counts (1: about 240 requests)."""
    rng = random.Random(seed)
    report = Report()
    outcomes: list[Outcome] = []
    lock = threading.Lock()
    pool = ThreadPoolExecutor(256)  # every request leaves when submitted, as clients send
    futures = []
    t_start = time.monotonic()
    serial = iter(range(10**9))

    def submit(category, n, *, tokens=16, stream=False, disconnect=False, rid=False):
        rids = []
        for _ in range(n):
            i = next(serial)
            r = f"scn-{seed}-{i}" if rid else None
            rids.append(r)
            futures.append(
                pool.submit(
                    _request,
                    d.router.url,
                    prompt(i, 8 + i % 24),
                    tokens,
                    r,
                    stream,
                    disconnect,
                    category,
                )
            )
        return rids

    def both(path, body):
        for s in (d.prefill, d.decode):
            http("POST", s.url + path, body, timeout=90)

    # 1. plain traffic, a third streamed (TTFT)
    for k in range(40 * scale):
        submit("plain", 1, stream=k % 3 == 0)
    time.sleep(1.0)
    # 2. clients that leave mid-stream
    submit("disconnect", 20 * scale, tokens=64, stream=True, disconnect=True)
    # 3. /abort_request by rid, shortly after each request left
    rids = submit("abort_rid", 20 * scale, tokens=64, rid=True)
    for r in rids:
        time.sleep(rng.uniform(0.0, 0.05))
        both("/abort_request", {"rid": r})
    # 4. abort_all in the middle of a burst
    submit("abort_all", 20 * scale, tokens=64)
    time.sleep(0.2)
    both("/abort_request", {"abort_all": True})
    _drain(futures)
    # 5. the decode stops mid-transfer for longer than the prefill's transfer timeout
    submit("decode_stopped", 20 * scale, tokens=16)
    time.sleep(0.3)
    d.decode.signal(signal.SIGSTOP)
    time.sleep(TRANSFER_TIMEOUT_S + 2.0)
    d.decode.signal(signal.SIGCONT)
    _drain(futures)
    # 6. two release/resume cycles of both engines, requests in every state
    for cycle in range(2):
        submit("release", 15 * scale, tokens=32)
        time.sleep(rng.uniform(0.1, 0.4))
        both("/release_memory_occupation", KV)
        submit("release", 10 * scale, tokens=8)  # arriving while released
        time.sleep(0.5)
        both("/resume_memory_occupation", KV)
        _drain(futures)
    # 7. plain traffic after everything
    for k in range(40 * scale):
        submit("plain_after", 1, stream=k % 3 == 0)
    _drain(futures)
    with lock:
        outcomes = [f.result() for f in futures]
    pool.shutdown()
    report.seconds = time.monotonic() - t_start

    report.requests = len(outcomes)
    for o in outcomes:
        cat = report.by_category.setdefault(o.category, {})
        key = "hang" if o.status is None else str(o.status)
        cat[key] = cat.get(key, 0) + 1
        if o.status is None:
            report.hangs += 1
            continue
        report.answered += 1
        if o.status not in ALLOWED[o.category]:
            report.wrong += 1
            if len(report.wrong_examples) < 8:
                report.wrong_examples.append([o.category, o.status, o.body[:200]])
    for cat in ("plain", "plain_after"):  # before any fault, and after all of them
        ttfts = sorted(
            o.ttft for o in outcomes if o.category == cat and o.ttft is not None and o.status == 200
        )
        if ttfts:
            report.ttft_ms[cat] = {
                "n": len(ttfts),
                "median": 1e3 * statistics.median(ttfts),
                "p99": 1e3 * nearest_rank(ttfts, 0.99),
            }
    report.crashes = d.crashed()
    report.leaks = _leaks(d) if not report.crashes else {"unknown": "a server crashed"}
    return report


def nearest_rank(xs: list, q: float):
    """The ``q`` quantile of sorted ``xs`` by nearest rank: the report's p99 (and
    bench/e2e_ttft.py's)."""
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _drain(futures) -> None:
    for f in list(futures):
        try:
            f.result(timeout=HANG_S + 30)
        except Exception:  # noqa: BLE001 - counted from the outcome
            pass


def _leaks(d) -> dict:
    """What the servers still hold once idle (bounded wait): their own counts, the
    adapter's leak counter, and leak log lines."""
    held = d.settle(IDLE_S)
    for s in (d.prefill, d.decode):
        name = "kvmem_sglang_prefill_leaked_total"
        for labels, n in s.metric(name).items():
            if n > 0:
                held.setdefault(s.name, {})[name] = f"{name}{{{labels}}} {n}"
        leak_lines = [ln for ln in s.log_text().splitlines() if "kvmem-sglang leak audit" in ln]
        if leak_lines:
            held.setdefault(s.name, {})["log"] = leak_lines[:3]
    return held
