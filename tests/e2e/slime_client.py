"""slime's calls to sglang PD servers over HTTP, replayed call for call: its router, its
HTTP helper, its generate payload, its abort, offload, weight sync and onload
(``tests/e2e/test_slime_loop.py`` drives them in slime's order).

Read from slime's source (THUDM/slime at commit 624b824a8; file:line there):

* the router is sglang's (0.3.2's CLI; slime runs a fork of it) in PD mode with no
  workers, its circuit breaker and health checks off, a request timeout of 14,400 s
  (``slime/ray/rollout.py:916-968``, ``slime/backends/sglang_utils/arguments.py:28-45``);
  each engine polls its own ``GET /health_generate`` every 2 s, then registers with
  ``POST router /workers`` (``sglang_engine.py:67-85, 177-199``);
* the HTTP helper sends a request again 1 s after any non-2xx answer or connection error,
  up to 60 sends in all, and has no timeout (``slime/utils/http_utils.py:165-198,
  213-226``): a generate answered 5xx is sent again as a new request;
* generate: ``POST router /generate`` with ``{"sampling_params": {...}, "return_logprob":
  true, "input_ids": [...]}``, the tokens read from ``meta_info.output_token_logprobs``
  and the status from ``finish_reason.type`` (``slime/rollout/sglang_rollout.py:95-105,
  176-191``); with ``--partial-rollout`` an aborted sample is sent again the next step
  with its prompt and partial response as ``input_ids`` and ``max_new_tokens`` less the
  tokens it has;
* rollout (``generate_rollout_async`` in ``sglang_rollout.py``): while fewer than
  ``rollout_batch_size`` groups are kept, at least that many are kept submitted,
  ``over_sampling_batch_size`` groups at a time, every sample of a group at once; a
  group done is kept unless the dynamic sampling filter drops it, which makes room for
  more; then the abort;
* abort (``sglang_rollout.py:339-371``, ``server_control.py:32-67``): ``GET router
  /workers``, then for every worker URL at once ``POST /abort_request {"abort_all":
  true}`` and ``GET /v1/loads?include=core`` every 3 s until running + waiting is 0; then
  every pending request is waited for;
* offload, every engine at once (``placement_group.py:250-251``): ``GET /flush_cache``
  until 200 (60 tries, 1 s apart), then ``POST /release_memory_occupation {}``, no tags
  (``sglang_engine.py:270-289, 328-330``); control calls are not retried: a non-2xx
  answer raises in slime;
* weight sync from disk (``actor_group.py:227-269``, ``rollout.py:343-356``): ``POST
  /resume_memory_occupation {"tags": ["weights"]}``, ``POST /pause_generation {}``,
  ``GET /flush_cache``, ``POST /update_weights_from_disk {"model_path",
  "weight_version"}``, ``POST /continue_generation {}``; colocated with a disk sync,
  slime resumes the weights once before that too (``train.py:83-84``): a second resume
  of what is no longer released;
* onload: ``POST /resume_memory_occupation {"tags": ["kv_cache", "cuda_graph"]}``
  (``rollout.py:358-363``).

Where the replay departs from slime, for a test: every send is bounded (``HANG_S``; slime
waits for ever) and a send that runs past it is counted as a hang, not sent again; the
abort's polling is bounded the same way; a control call that gets no answer at all (a
dead server) is not tried again.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

from tests.e2e.deploy import START_TIMEOUT, DeployError, Server, free_port, http

RETRY_S = 1.0  # http_utils.py: the pause before a send again
MAX_SENDS = 60  # http_utils.py: max_retries, the sends in all
HEALTH_POLL_S = 2.0  # sglang_engine.py: /health_generate before registering
ABORT_POLL_S = 3.0  # server_control.py: abort_all and /v1/loads again after
FLUSH_TRIES = 60  # sglang_engine.py: /flush_cache until 200
FLUSH_PAUSE_S = 1.0
HANG_S = 150.0  # the replay's bound on one send (slime has none)
ABORT_S = 90.0  # the replay's bound on the abort's polling (slime has none)
ROUTER_TIMEOUT_S = 14400  # slime's router request timeout

# slime's sampling parameters (GenerateState, sglang_rollout.py:95-105), with the values
# of its defaults where the tiny model needs none of its own: temperature 1, top_p 1,
# top_k -1 (its rollout_* arguments); a few stop token ids, so that sampled responses
# end at different lengths (the random tiny model would otherwise always run to
# max_new_tokens).
STOP_TOKEN_IDS = list(range(100, 124))


def sampling_params(max_new_tokens: int, *, temperature: float = 1.0) -> dict:
    return {
        "temperature": temperature,
        "top_p": 1.0,
        "top_k": -1,
        "max_new_tokens": max_new_tokens,
        "stop": None,
        "stop_token_ids": STOP_TOKEN_IDS if temperature else None,
        "skip_special_tokens": False,
        "no_stop_trim": True,
        "spaces_between_special_tokens": False,
    }


def start_router(logdir: Path) -> tuple[Server, str]:
    """sglang's router as slime starts it (PD, no workers, circuit breaker and health
    checks off, slime's request timeout), healthy; (the router, its Prometheus URL)."""
    prometheus = free_port()
    r = Server(
        "router",
        [
            "--pd-disaggregation",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--disable-circuit-breaker",
            "--disable-health-check",
            "--request-timeout-secs",
            str(ROUTER_TIMEOUT_S),
            "--log-level",
            "info",
            "--prometheus-host",
            "127.0.0.1",
            "--prometheus-port",
            str(prometheus),
        ],
        free_port(),
        logdir,
        module="sglang_router.launch_router",
    )
    r.args[r.args.index("--port") + 1] = str(r.port)
    r.start()
    try:
        r.wait_healthy(time.monotonic() + START_TIMEOUT)
    except BaseException:
        r.stop()
        raise
    return r, f"http://127.0.0.1:{prometheus}"


def register(router: Server, server: Server, worker_type: str, bootstrap_port: int = 0) -> None:
    """What a slime engine does once it is up: ``GET /health_generate`` every 2 s until
    200, then ``POST router /workers``; then (the replay, so that the first request finds
    it) until the router lists the worker healthy."""
    deadline = time.monotonic() + START_TIMEOUT
    while (r := http("GET", server.url + "/health_generate", timeout=30)).status != 200:
        if time.monotonic() > deadline:
            raise DeployError(f"{server.name}: /health_generate {r.status} {r.error}")
        time.sleep(HEALTH_POLL_S)
    payload = {"url": server.url, "worker_type": worker_type}
    if worker_type == "prefill":
        payload["bootstrap_port"] = bootstrap_port
    r = http("POST", router.url + "/workers", payload, timeout=30)
    if not 200 <= r.status < 300:
        raise DeployError(f"POST /workers {payload}: {r.status} {r.body} {r.error}")
    while True:
        w = http("GET", router.url + "/workers", timeout=10)
        listed = w.body.get("workers", []) if isinstance(w.body, dict) else []
        if any(x.get("url") == server.url and x.get("is_healthy") for x in listed):
            return
        if time.monotonic() > deadline:
            raise DeployError(f"the router does not list {server.url} healthy: {w.body}")
        time.sleep(0.5)


def prometheus(url: str, name: str) -> dict[str, float]:
    """The samples of metric ``name`` at a Prometheus endpoint, by their label text."""
    r = http("GET", url + "/metrics", timeout=30)
    if r.status != 200:
        raise DeployError(f"{url}/metrics answered {r.status} {r.error}")
    out: dict[str, float] = {}
    for line in str(r.body).splitlines():
        head, _, value = line.rpartition(" ")
        if head == name or head.startswith(name + "{"):
            labels = head[len(name) :].strip("{}")
            out[labels] = out.get(labels, 0.0) + float(value)
    return out


@dataclass
class Send:
    """One send of a request by slime's HTTP helper."""

    status: int  # 0: no answer (refused, reset; or past HANG_S: ``hang``)
    seconds: float
    finish: str = ""  # finish_reason.type of a 200
    hang: bool = False
    body: object = None


@dataclass
class Sample:
    """One sample of a group, as slime keeps it across steps (partial rollout)."""

    group: int
    index: int
    prompt: list[int]
    max_new_tokens: int
    response: list[int] = field(default_factory=list)
    status: str = "pending"  # completed, truncated, aborted, failed (60 sends), hang
    sends: list[Send] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return self.status in ("completed", "truncated")


class SlimeClient:
    """slime's client of one router and its engines (the module docstring's calls)."""

    def __init__(self, router: Server, prometheus_url: str = ""):
        self.router, self.prometheus_url = router, prometheus_url
        # control calls: path, url, status, the body of an answer other than 200
        self.calls: list[tuple[str, str, int, object]] = []
        self._lock = threading.Lock()

    # -- the HTTP helper ----------------------------------------------------------------
    def post(self, url: str, payload: dict, max_sends: int = MAX_SENDS) -> list[Send]:
        """slime's ``post``: send, and send again 1 s after a non-2xx answer or a
        connection error, up to ``max_sends`` sends; every send made."""
        sends: list[Send] = []
        while len(sends) < max_sends:
            r = http("POST", url, payload, timeout=HANG_S)
            hang = r.status == 0 and "timed out" in r.error
            finish = ""
            if r.status == 200 and isinstance(r.body, dict):
                finish = ((r.body.get("meta_info") or {}).get("finish_reason") or {}).get(
                    "type", ""
                )
            sends.append(Send(r.status, r.seconds, finish, hang, r.body))
            if 200 <= r.status < 300 or hang:
                break
            time.sleep(RETRY_S)
        return sends

    def control(self, url: str, path: str, payload=None, method: str = "POST") -> int:
        """One control call as slime's engine makes it (``requests``, not retried); its
        status, kept in :attr:`calls`."""
        r = http(method, url + path, payload, timeout=HANG_S)
        with self._lock:
            self.calls.append((path, url, r.status, r.body if r.status != 200 else None))
        return r.status

    # -- rollout -------------------------------------------------------------------------
    def generate(self, sample: Sample, params: dict) -> Sample:
        """slime's ``generate`` of one sample through the router."""
        params = dict(params, max_new_tokens=sample.max_new_tokens - len(sample.response))
        payload = {
            "sampling_params": params,
            "return_logprob": True,
            "input_ids": sample.prompt + sample.response,
        }
        sends = self.post(self.router.url + "/generate", payload)
        sample.sends += sends
        last = sends[-1]
        if last.hang:
            sample.status = "hang"
        elif last.status != 200:
            sample.status = "failed"
        else:
            meta = last.body["meta_info"]
            sample.response += [t[1] for t in meta.get("output_token_logprobs") or []]
            sample.status = {"abort": "aborted", "length": "truncated"}.get(
                last.finish, "completed"
            )
        return sample

    def rollout(self, source, target: int, over_sampling: int, keep, params: dict) -> dict:
        """slime's rollout (``generate_rollout_async``): while fewer than ``target``
        groups are accepted, keep ``target`` groups or more submitted (``over_sampling``
        groups at a time from ``source(n)``, every sample of a group at once); each group
        done is accepted if ``keep(group)`` (slime's dynamic filter; a dropped group
        makes room for more); then abort (slime's abort) and wait for every request.
        {"data": the accepted groups, "dropped": those the filter dropped, "left": the
        groups pending at the abort (with ``--partial-rollout`` slime puts them back in
        its buffer), "submitted": groups submitted, "in_flight_at_abort": samples not
        answered then, "polls", "held_when_idle": what the abort saw}."""
        pool = ThreadPoolExecutor(256)
        groups: dict[int, list[Sample]] = {}  # submitted, not yet accepted or dropped
        futures: dict = {}  # sample's future -> its group's key
        data: list[list[Sample]] = []
        dropped: list[list[Sample]] = []
        remaining = submitted = 0
        try:
            while len(data) < target:
                while remaining < target:
                    for g in source(over_sampling):
                        key = submitted = submitted + 1
                        groups[key] = g
                        for s in g:
                            if not s.done:  # a partial group's finished samples stay
                                futures[pool.submit(self.generate, s, params)] = key
                        remaining += 1
                finished = [
                    k for k in groups if all(f.done() for f, x in futures.items() if x == k)
                ]
                if not finished:
                    live = [f for f in futures if not f.done()]
                    if not wait(live, timeout=HANG_S * 2, return_when=FIRST_COMPLETED)[0]:
                        raise DeployError(f"no request answered in {HANG_S * 2:.0f} s")
                    continue
                for key in finished:
                    g = groups.pop(key)
                    for f in [f for f, k in futures.items() if k == key]:
                        f.result()
                        del futures[f]
                    if not keep(g):
                        remaining -= 1
                        dropped.append(g)
                    elif len(data) < target:
                        data.append(g)
            in_flight = sum(not f.done() for f in futures)
            seen = self.abort()
            for f in futures:
                f.result(timeout=HANG_S * 2)
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
        return {
            "data": data,
            "dropped": dropped,
            "left": list(groups.values()),
            "submitted": submitted,
            "in_flight_at_abort": in_flight,
            **seen,
        }

    def evaluate(self, prompts: list[list[int]], max_new_tokens: int) -> tuple[list, list]:
        """slime's eval through the router, greedy (temperature 0, the eval payload is the
        rollout's): (the tokens of each prompt, every send)."""
        out: list[list[int]] = []
        sends: list[Send] = []
        for ids in prompts:
            s = Sample(-1, 0, ids, max_new_tokens)
            self.generate(s, sampling_params(max_new_tokens, temperature=0.0))
            out.append(s.response)
            sends += s.sends
        return out, sends

    def workers(self) -> list[dict]:
        r = http("GET", self.router.url + "/workers", timeout=30)
        if r.status != 200 or not isinstance(r.body, dict):
            raise DeployError(f"GET router /workers: {r.status} {r.body} {r.error}")
        return r.body["workers"]

    def abort(self) -> dict:
        """slime's abort: every worker the router lists, at once, until idle by
        ``/v1/loads?include=core``.  What it saw: {"polls": {url: [running + waiting at
        each poll]}, "held_when_idle": {url: the PD queues' counts that the server's own
        ``/v1/loads`` gave beside that last 0, where not all 0}} (slime's count at that
        commit leaves the PD queues out)."""
        urls = [w["url"] for w in self.workers()]
        with ThreadPoolExecutor(len(urls)) as pool:
            seen = dict(zip(urls, pool.map(self._abort_until_idle, urls)))
        return {
            "polls": {u: polls for u, (polls, _) in seen.items()},
            "held_when_idle": {u: held for u, (_, held) in seen.items() if held},
        }

    def _abort_until_idle(self, url: str) -> tuple[list[int], dict]:
        counts = []
        deadline = time.monotonic() + ABORT_S
        while True:
            self.post(url + "/abort_request", {"abort_all": True})
            r = http("GET", url + "/v1/loads?include=core", timeout=30)
            if r.status != 200:
                raise DeployError(f"{url}/v1/loads?include=core: {r.status} {r.error}")
            n = sum(x["num_running_reqs"] + x["num_waiting_reqs"] for x in r.body["loads"])
            counts.append(n)
            if n == 0:  # the replay's look at what that count leaves out
                q = http("GET", url + "/v1/loads?include=disagg", timeout=30)
                queues = q.body["loads"][0].get("disaggregation") or {} if q.status == 200 else {}
                held = {k: v for k, v in queues.items() if k.endswith("_reqs") and v}
                return counts, held
            if time.monotonic() > deadline:
                raise DeployError(f"{url} not idle after {ABORT_S:.0f} s of aborts: {counts}")
            time.sleep(ABORT_POLL_S)

    # -- the engines' lifecycle ----------------------------------------------------------
    def each(self, urls: list[str], fn) -> list:
        """``fn(url)`` on every engine at once (slime's ``ray.get`` over its engines)."""
        with ThreadPoolExecutor(len(urls)) as pool:
            return list(pool.map(fn, urls))

    def flush_cache(self, url: str) -> int:
        """``GET /flush_cache`` until 200 (slime: 60 tries, 1 s apart), kept in
        :attr:`calls` as one call with its last status and its tries; that status.  A
        server that does not answer at all ends the tries at once (the replay's: slime
        tries it 60 times)."""
        for tries in range(1, FLUSH_TRIES + 1):
            r = http("GET", url + "/flush_cache", timeout=HANG_S)
            if r.status in (0, 200) or tries == FLUSH_TRIES:
                break
            time.sleep(FLUSH_PAUSE_S)
        with self._lock:
            self.calls.append(("/flush_cache", url, r.status, {"tries": tries, "body": r.body}))
        return r.status

    def offload(self, url: str) -> int:
        """slime's offload of one engine: flush, then release everything (no tags)."""
        if self.flush_cache(url) != 200:
            return 0
        return self.control(url, "/release_memory_occupation", {})

    def resume(self, url: str, tags: list[str]) -> int:
        return self.control(url, "/resume_memory_occupation", {"tags": tags})

    def update_weights_from_disk(
        self, urls: list[str], model_path: str, version: str, resume_weights: bool = True
    ) -> None:
        """slime's weight sync from disk: each phase on every engine at once, the next
        phase only if every call of this one was answered 200 (slime raises).
        ``resume_weights=False`` leaves out its resume of the weights (the replay's, for
        a server that cannot take a resume of what is not released)."""
        body = {"model_path": model_path, "weight_version": version}
        phases = [
            lambda u: self.resume(u, ["weights"]),
            lambda u: self.control(u, "/pause_generation", {}),
            self.flush_cache,
            lambda u: self.control(u, "/update_weights_from_disk", body),
            lambda u: self.control(u, "/continue_generation", {}),
        ]
        for phase in phases[0 if resume_weights else 1 :]:
            if self.failed_calls():
                return
            self.each(urls, phase)

    def failed_calls(self) -> list[tuple[str, str, int, object]]:
        """Control calls not answered 200 (each would raise in slime)."""
        return [c for c in self.calls if c[2] != 200]
