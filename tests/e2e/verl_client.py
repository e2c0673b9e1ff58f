"""verl's calls to an sglang PD pair, replayed over HTTP where slime's differ
(``tests/e2e/test_verl_loop.py`` drives them; ``slime_client.py`` has slime's).

Read from verl's source (verl-project/verl, PR #6117's PD rollout and the files it
builds on, at the versions read here: ``sglang_pd_replica.py`` 047621b,
``async_sglang_server.py`` 00c3c04, ``checkpoint_engine/base.py`` 065ef9b):

* no router: verl's prefill server actor pairs each request itself
  (``SGLangHttpServer.generate``): it draws a bootstrap room (``secrets.randbits(63)``),
  then runs the prefill's request (rid ``<id>_P``) and the decode's (rid ``<id>_D``) at
  once, both with the prefill's bootstrap host, port and that room; the decode's output
  is the answer.  verl calls sglang's TokenizerManager in its own process; the replay
  sends the same requests to each server's ``/generate``.  Nothing is sent again;
* the weight sync of its checkpoint engine (``CheckpointEngineManager.update_weights``):
  abort (``pause_generation`` in mode ``abort``, on the replica's first server only:
  ``SGLangReplica.abort_all_requests``; in a PD replica that is the prefill), then at
  once, with no wait for idle and no flush, ``release_memory_occupation`` of the KV cache
  on every server, the update (verl's own transport, from its trainer; the replay loads
  the same weights from disk), ``resume_memory_occupation`` of the KV cache and
  ``flush_cache`` on every server, and ``continue_generation`` on the first server;
* verl's agent loop sends a request that ended in an abort again after the resume,
  its prompt followed by what it had generated (verl PR #5071).
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

from tests.e2e.deploy import Server, http

HANG_S = 150.0  # the replay's bound on one request


def generate(prefill: Server, decode: Server, bootstrap_port: int, rid: str, ids, params):
    """One request as verl's prefill actor sends it: (the prefill's answer, the
    decode's), each a :class:`tests.e2e.deploy.Response`."""
    payload = {
        "input_ids": ids,
        "sampling_params": params,
        "return_logprob": True,
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": bootstrap_port,
        "bootstrap_room": random.getrandbits(63),
    }
    with ThreadPoolExecutor(2) as pool:
        p = pool.submit(
            http, "POST", prefill.url + "/generate", {**payload, "rid": rid + "_P"}, HANG_S
        )
        d = pool.submit(
            http, "POST", decode.url + "/generate", {**payload, "rid": rid + "_D"}, HANG_S
        )
        return p.result(), d.result()


def finish(r) -> str:
    """The finish reason's type of a 200 answer; '' otherwise."""
    if r.status != 200 or not isinstance(r.body, dict):
        return ""
    return ((r.body.get("meta_info") or {}).get("finish_reason") or {}).get("type", "")


def tokens(r) -> list[int]:
    """The tokens of a 200 answer (``meta_info.output_token_logprobs``)."""
    if r.status != 200 or not isinstance(r.body, dict):
        return []
    return [t[1] for t in r.body["meta_info"].get("output_token_logprobs") or []]


def weight_sync(prefill: Server, decode: Server, model_path: str, version: str, released=None):
    """verl's checkpoint-engine weight sync on a 1P:1D replica; every call's (path,
    server, status) in order.  ``released()``, if given, runs once both KV caches are
    released (the test reads memory there)."""
    calls = []

    def call(server, path, payload=None, method="POST"):
        r = http(method, server.url + path, payload, timeout=HANG_S)
        calls.append((path, server.name, r.status))
        return r.status

    def each(fn):
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(fn, (prefill, decode)))

    def resume_kv_cache(server):  # SGLangHttpServer.resume_kv_cache
        call(server, "/resume_memory_occupation", {"tags": ["kv_cache"]})
        call(server, "/flush_cache", method="GET")

    body = {"model_path": model_path, "weight_version": version}
    call(prefill, "/pause_generation", {"mode": "abort"})
    each(lambda s: call(s, "/release_memory_occupation", {"tags": ["kv_cache"]}))
    if released is not None:
        released()
    each(lambda s: call(s, "/update_weights_from_disk", body))
    each(resume_kv_cache)
    call(prefill, "/continue_generation", {})
    return calls
