"""Real sglang 0.5.23 scheduler parts on CPU, for the adapter's tests.

Each function builds what sglang itself builds, through sglang's own construction points
(``KVCacheConfigurator._build_token_to_kv_pool_allocator`` chooses the allocator, so the
adapter's hook runs exactly where it runs in a server).  Stood in, because a CPU test has
no model: the model config (only the numbers the batch reads) and the forward pass (the
test appends output tokens itself).

A process publishes one ServerArgs; the adapter's hooks cannot be undone, so a test that
compares flag off with flag on runs its script in one process per variant
(``run_script``, ``run_both``).  Those processes are forked from one fork server per
pytest session (testkit/zygote.py, :func:`fork_server`) that imported torch and sglang's
scheduler parts once (:data:`PRELOAD`; and one of ``.venv-e2e``'s, :func:`e2e_fork_server`):
each child is the interpreter a fresh
``python`` would be for it, without the 20-30 s of imports.  ``fresh=True`` (and any
environment the server says a fresh interpreter would read differently) starts a
fresh interpreter instead.
"""

from __future__ import annotations

import json
import os
from array import array
from pathlib import Path
from types import SimpleNamespace

from testkit.child import Child, child_env, json_of, run, run_children
from testkit.child import emit, script_main  # noqa: F401 - what the scripts here import
from testkit.zygote import ForkServer

ROOT = Path(__file__).resolve().parents[2]

# What every script here imports before it differs by variant: torch and sglang's
# scheduler parts (about 20 s of the 25-30 s a script took here, python -X importtime;
# what the scripts import after these takes well under a second).  Not NIXL or Mooncake
# (sglang's conn modules load their libraries at import, and a script must show that it
# loads no other backend's), not kvmem_sglang, and no load_plugins() (the adapter's
# hooks cannot be undone): each child does those itself.
PRELOAD = [
    "torch",
    "sglang.srt.server_args",
    "sglang.srt.mem_cache.memory_pool",
    "sglang.srt.managers.schedule_batch",
    "sglang.srt.managers.scheduler",
    "sglang.srt.disaggregation.prefill",
    "sglang.srt.disaggregation.decode",
]
FORBID = [
    "nixl",
    "nixl_cu12",
    "mooncake",
    "kvmem_sglang",
    "sglang.srt.disaggregation.nixl",
    "sglang.srt.disaggregation.mooncake",
]
_FORK: ForkServer | None = None
_E2E_FORK: ForkServer | None = None
ADAPTER = ROOT / "integration" / "sglang"


def fork_server() -> ForkServer:
    """This session's fork server for the scripts here, started at its first child
    (tests/conftest.py stops it at the session's end)."""
    global _FORK
    if _FORK is None:
        _FORK = ForkServer(PRELOAD, forbid=FORBID, env=child_env(drop=("SGLANG_KVMEM",)), cwd=ROOT)
    return _FORK


def e2e_env(env: dict | None = None, drop: tuple[str, ...] = ()) -> dict:
    """The environment of a child of ``.venv-e2e`` (Mooncake's engine is there): ``env``
    over this one's less ``drop`` and SGLANG_KVMEM (the flag on unless ``env`` says
    otherwise), the adapter's source on the path, libibverbs on the loader's."""
    from testkit.sglang_pair import with_ibverbs

    return with_ibverbs(
        child_env(
            {"SGLANG_KVMEM": "1"} | (env or {}), drop=("SGLANG_KVMEM", *drop), paths=[ADAPTER]
        )
    )


def e2e_fork_server() -> ForkServer:
    """This session's fork server of ``.venv-e2e``'s interpreter, for the Mooncake
    scripts here, with the flag on: the environment's ``kvmem_sglang.pth`` reads
    SGLANG_KVMEM at start (and imports the adapter's start-up check with it on: its
    ``startup``, ``imports`` and ``state`` modules, and ``options``, ``chase`` and
    ``rooms``, whose classes the process registry in ``state`` holds; standard library only, and none
    does anything at import), so a child with the flag off starts fresh.  The adapter's
    other modules are not imported there, as in :func:`fork_server`."""
    from testkit.sglang_pair import E2E_PYTHON

    global _E2E_FORK
    if _E2E_FORK is None:
        adapter = sorted(
            f"kvmem_sglang.{p.stem}"
            for p in (ADAPTER / "kvmem_sglang").glob("*.py")
            if p.stem
            not in ("__init__", "startup", "imports", "state", "options", "chase", "rooms")
        )
        forbid = [m for m in FORBID if m != "kvmem_sglang"] + adapter
        _E2E_FORK = ForkServer(PRELOAD, forbid=forbid, env=e2e_env(), cwd=ROOT, python=E2E_PYTHON)
    return _E2E_FORK


def servers() -> dict[str, ForkServer]:
    """The fork servers this session started, by name."""
    return {
        name: s
        for name, s in (("sglang", _FORK), ("sglang .venv-e2e", _E2E_FORK))
        if s is not None and s.starts
    }


def close_fork_server() -> None:
    for server in (_FORK, _E2E_FORK):
        if server is not None:
            server.close()


def run_script(
    code: str, *, kvmem: bool, env: dict | None = None, timeout: float = 240, fresh: bool = False
):
    """Run ``code`` as ``python -c`` with SGLANG_KVMEM on or off (``env`` over it);
    returns the CompletedProcess (stdout, stderr as text).  Forked from the fork server
    unless ``fresh`` (a fresh interpreter: what must be shown of one)."""
    extra = ({"SGLANG_KVMEM": "1"} if kvmem else {}) | (env or {})
    full = child_env(extra)
    if "SGLANG_KVMEM" not in extra:
        full.pop("SGLANG_KVMEM", None)
    return run(Child(code=code, env=full, cwd=ROOT, fork=None if fresh else fork_server()), timeout)


BOTH = {"off": {"SGLANG_KVMEM": "0"}, "on": {"SGLANG_KVMEM": "1"}}


def run_both(
    script: Path, *, env: dict | None = None, timeout: float = 240, variants: dict[str, dict] = BOTH
) -> dict:
    """Run the script file ``script`` once per variant, all at once (by default twice:
    SGLANG_KVMEM off and on), each with ``env`` and then its variant's variables over
    the caller's environment less its SGLANG_KVMEM_* variables (so unset ones are the
    adapter's defaults); ``{variant: ...}``, each the JSON its last stdout line holds,
    plus its ``"stderr"``."""
    children = {
        key: Child(
            script=script,
            env=child_env((env or {}) | extra, drop=("SGLANG_KVMEM_",)),
            cwd=ROOT,
            fork=fork_server(),
        )
        for key, extra in variants.items()
    }
    out = {}
    for key, reply in run_children(children, timeout).items():
        out[key] = reply.value
        out[key]["stderr"] = reply.stderr
    return out


def one(answers: list) -> dict:
    """The one answer of a request (a scenario's list of its answers); fails naming
    them when there are none or several."""
    assert len(answers) == 1, f"answered {len(answers)} times: {answers}"
    return answers[0]


def result_of(proc) -> dict:
    """The JSON a script printed last on stdout (``emit``; ``last_json``: UCX may print
    after it)."""
    return json_of(proc, "script")


def model_dir(*, layers: int = 2, heads: int = 2, head_dim: int = 16) -> Path:
    """A local Hugging Face config of a tiny Llama (no weights): sglang reads the model's
    config while it resolves its server arguments, and nothing may come from a hub."""
    import tempfile

    d = Path(tempfile.gettempdir()) / f"kvmem-sglang-llama-{layers}-{heads}-{head_dim}"
    d.mkdir(exist_ok=True)
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": heads * head_dim,
        "intermediate_size": 4 * heads * head_dim,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "head_dim": head_dim,
        "vocab_size": 32000,
        "max_position_embeddings": 4096,
        "torch_dtype": "bfloat16",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
    }
    # Atomically: other test processes (and other runs on the machine) read the same file.
    tmp = d / f"config.json.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(cfg))
    os.replace(tmp, d / "config.json")
    return d


def publish(page_size: int, *, mode: str = "prefill", **extra):
    """Publish a CPU ServerArgs (a PD prefill server unless told otherwise) and load the
    plugins, as ``run_scheduler_process`` does."""
    from sglang.srt.runtime_context import publish as _publish
    from sglang.srt.server_args import ServerArgs

    args = dict(
        model_path=str(model_dir()), device="cpu", page_size=page_size, disaggregation_mode=mode
    )
    if mode != "null":
        # sglang refuses its "fake" backend for a prefill server's arguments; a test
        # that needs senders picks their class itself (sglang_env.prefill_scheduler).
        args["disaggregation_transfer_backend"] = "nixl"
    args.update(extra)
    sa = ServerArgs(**args)
    _publish(sa, role="test")
    from sglang.srt.plugins import load_plugins

    load_plugins()
    return sa


def model_config(*, layers: int, heads: int, head_dim: int, dtype):
    """The few model numbers the pool and the batch read."""
    return SimpleNamespace(
        vocab_size=32000,
        context_len=1 << 16,
        num_hidden_layers=layers,
        get_num_kv_heads=lambda *a: heads,
        head_dim=head_dim,
        v_head_dim=head_dim,
        is_encoder_decoder=False,
        is_multimodal=False,
        hidden_size=heads * head_dim,
        dtype=dtype,
        attention_arch=None,
        is_hybrid_swa=False,
    )


def build_pools(
    *,
    page_size: int,
    size: int,
    layers: int = 2,
    heads: int = 2,
    head_dim: int = 16,
    max_reqs: int = 64,
    dtype=None,
    kv=None,
):
    """(req_to_token_pool, kv pool, allocator, tree cache) as sglang builds them; the
    allocator comes from ``KVCacheConfigurator._build_token_to_kv_pool_allocator``.
    ``kv``: a KV pool built by the caller (another pool class) instead of an MHA pool."""
    import torch
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator, _PoolSizes
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from sglang.srt.mem_cache.unified_cache.components import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    dtype = dtype or torch.bfloat16
    req_pool = ReqToTokenPool(
        size=max_reqs, max_context_len=4096, device="cpu", enable_memory_saver=False
    )
    kv = kv or MHATokenToKVPool(
        size,
        page_size=page_size,
        dtype=dtype,
        head_num=heads,
        head_dim=head_dim,
        layer_num=layers,
        device="cpu",
        enable_memory_saver=False,
    )
    conf = object.__new__(KVCacheConfigurator)
    conf.is_hybrid_swa = type(kv).__name__ == "SWAKVPool"
    conf.kv_shard_size = 1
    conf.kv_cache_dtype = dtype
    conf.device = "cpu"
    conf.hybrid_gdn_config = None
    conf.is_draft_worker = False
    sizes = _PoolSizes(
        max_total_num_tokens=size,
        max_running_requests=max_reqs,
        # a hybrid SWA pool's two sides, as the configurator sizes them
        full_max_total_num_tokens=kv.size if conf.is_hybrid_swa else None,
        swa_max_total_num_tokens=kv.size_swa if conf.is_hybrid_swa else None,
        c4_max_total_num_tokens=0,
        c128_max_total_num_tokens=0,
        c4_state_pool_size=0,
        c128_state_pool_size=0,
        c4_state_dtype=None,
        c128_state_dtype=None,
    )
    alloc = conf._build_token_to_kv_pool_allocator(
        sizes=sizes,
        token_to_kv_pool=kv,
        is_dsv4_model=False,
        req_to_token_pool=req_pool,
        token_to_kv_pool_allocator=None,
    )
    params = CacheInitParams(
        disable=True,
        req_to_token_pool=req_pool,
        token_to_kv_pool_allocator=alloc,
        page_size=page_size,
    )
    params.tree_components = (ComponentType.FULL,)  # what create_unified_radix_cache sets
    tree = UnifiedRadixCache(params)
    return req_pool, kv, alloc, tree


def make_req(rid: str, n_tokens: int, *, max_new_tokens: int = 8, seed: int = 0):
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    ids = array("q", [(seed * 7919 + i * 31) % 30000 + 1 for i in range(n_tokens)])
    sp = SamplingParams(temperature=0, max_new_tokens=max_new_tokens)
    sp.normalize(None)
    return Req(rid=rid, origin_input_text="", origin_input_ids=ids, sampling_params=sp)


def abort_answer(message, *args, flag: bool = True, **kwargs) -> dict:
    """The finish reason (``to_json``) a PD request gets from sglang's ``prepare_abort``
    (disaggregation/utils.py) with ``message`` and the given status, on a real ``Req``:
    through the adapter's hook (``kvmem_sglang.decode.prepare_abort``), or stock."""
    from sglang.srt.disaggregation.utils import prepare_abort

    from kvmem_sglang import decode

    req = make_req("r0", 16)
    if flag:
        decode.prepare_abort(prepare_abort, req, message, *args, **kwargs)
    else:
        prepare_abort(req, message, *args, **kwargs)
    return req.finished_reason.to_json()


def _extend(reqs, req_pool, alloc, tree, mc):
    import torch
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    for r in reqs:  # the match -> lock -> alloc sequence of a scheduled request
        r.init_next_round_input(tree)
        r.lock = tree.lock(r.last_node)
        r.extend_end = len(r.full_untruncated_fill_ids)
    batch = ScheduleBatch.init_new(
        reqs, req_pool, alloc, tree, mc, False, SpeculativeAlgorithm.NONE
    )
    batch.prepare_for_extend()
    batch.output_ids = torch.zeros(len(reqs), dtype=torch.int64)
    return batch


def _decode(batch, step: int):
    import torch

    tokens = [100 + step + i for i in range(len(batch.reqs))]
    for r, t in zip(batch.reqs, tokens):  # the forward pass's sampled token
        r.output_ids.append(t)
    batch.output_ids = torch.tensor(tokens, dtype=torch.int64)
    batch.prepare_for_decode()


def _finish(batch, keep: list[int], tree):
    from sglang.srt.mem_cache.common import release_kv_cache

    for i, r in enumerate(batch.reqs):
        if i not in keep:
            release_kv_cache(r, tree, checkpoint=False)
    batch.filter_batch(keep_indices=keep)


def alloc_scenario(page_size: int) -> dict:
    """The scheduler's allocator calls, driven through a real ScheduleBatch: two batches
    prefilled (``prepare_for_extend``), decode steps across page boundaries
    (``prepare_for_decode``), requests finishing (``release_kv_cache``) in and out of
    order, a batch that reuses freed pages, then the rest finished.  Records every
    batch's ``out_cache_loc`` and the allocator's ``available_size`` after each step."""
    import torch

    publish(page_size)
    req_pool, _, alloc, tree = build_pools(
        page_size=page_size, size=page_size * 96 if page_size > 1 else 1024
    )
    mc = model_config(layers=2, heads=2, head_dim=16, dtype=torch.bfloat16)
    log = {"allocator": type(alloc).__name__, "slots": [], "available": []}

    def record(what, batch=None):
        if batch is not None and batch.out_cache_loc is not None:
            log["slots"].append([what, batch.out_cache_loc.tolist()])
        log["available"].append([what, int(alloc.available_size())])

    record("start")
    a = _extend(
        [make_req(f"a{i}", n, seed=i) for i, n in enumerate([17, 1, 40, 16, 33])],
        req_pool,
        alloc,
        tree,
        mc,
    )
    record("extend a", a)
    for step in range(18):
        _decode(a, step)
        record(f"decode a {step}", a)
    _finish(a, [0, 2, 4], tree)
    record("finish a1 a3")
    b = _extend(
        [make_req(f"b{i}", n, seed=10 + i) for i, n in enumerate([64, 5, 20])],
        req_pool,
        alloc,
        tree,
        mc,
    )
    record("extend b", b)
    for step in range(5):
        _decode(b, step)
        record(f"decode b {step}", b)
    _finish(a, [], tree)
    record("finish a")
    _finish(b, [1], tree)
    record("finish b0 b2")
    _finish(b, [], tree)
    record("finish b")
    return log


def weight_updater(req_pool, alloc, tree):
    """sglang's real SchedulerWeightUpdaterManager for one CPU rank.  Its
    ``flush_cache`` is what the scheduler's does to the pools (clear the request slots,
    the tree and the allocator); its memory saver is sglang's no-op adapter (no
    torch_memory_saver here)."""
    from sglang.srt.managers.scheduler_components.weight_updater import (
        SchedulerWeightUpdaterManager,
    )
    from sglang.srt.utils.torch_memory_saver_adapter import TorchMemorySaverAdapter

    def flush_cache() -> bool:
        req_pool.clear()
        tree.reset()
        alloc.clear()
        return True

    from sglang.srt.managers.scheduler_components import weight_updater as wu_module

    from tests.e2e.standins import cpu_torch

    # The release ends with torch.get_device_module().synchronize() (weight_updater.py:379),
    # which names CUDA on this CUDA build of torch even with no GPU: that module alone sees
    # torch.cpu there, as the e2e tier's servers do.  Anything else that names CUDA
    # without a device still fails here.
    cpu_torch.apply(wu_module)
    m = object.__new__(SchedulerWeightUpdaterManager)  # __post_init__ wants a TP group
    m.tp_worker = m.draft_worker = m.scheduler = m.metrics_collector = None
    m.memory_saver_adapter = TorchMemorySaverAdapter.create(enable=False)
    m.flush_cache = flush_cache
    m.is_fully_idle = lambda **kw: True
    m.offload_tags = set()
    m.stashed_model_static_state = None
    m._session = None
    m.tp_cpu_group = None
    return m


def rss_anon() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


# -- the transfer-path scenarios (scenario_transfer*.py) and their tests -------------------


def kvmem_send_path() -> bool:
    """Whether this process sends KV on kvmem's path: the flag on and
    ``SGLANG_KVMEM_TRANSFER`` ``kvmem`` (its default)."""
    return (
        os.environ.get("SGLANG_KVMEM") == "1"
        and os.environ.get("SGLANG_KVMEM_TRANSFER", "kvmem") == "kvmem"
    )


def transfer_stats() -> dict:
    """kvmem's send-path counters in this process (``kvmem_sglang.transfer_records.STATS``), or
    ``{}`` without the flag (the adapter is then never imported)."""
    if os.environ.get("SGLANG_KVMEM") != "1":
        return {}
    from kvmem_sglang import transfer_records

    return transfer_records.STATS.as_dict()


def stats_since(before: dict) -> dict:
    """How much each counter of :func:`transfer_stats` grew since ``before``."""
    return {k: v - before.get(k, 0) for k, v in transfer_stats().items()}


def transfer_runs(children: dict) -> dict:
    """Run the scenario ``children`` at once; their results by key, after checking that
    the one named ``kvmem`` sent on kvmem's path and the one named ``sglang`` did not."""
    out = {key: reply.value for key, reply in run_children(children, timeout=900).items()}
    assert out["kvmem"]["kvmem_path"] and not out["sglang"]["kvmem_path"]
    return out


def mooncake_queue_runs(script: Path, tcp_queue: int) -> dict:
    """``script`` run twice at once in ``.venv-e2e`` over Mooncake's engine with a TCP
    queue of ``tcp_queue`` transfers per peer: on kvmem's send path (``kvmem``) and on
    sglang's (``sglang``), the flag on in both; their results by key
    (:func:`transfer_runs`)."""
    from testkit.sglang_pair import E2E_PYTHON

    if not E2E_PYTHON.exists():
        raise AssertionError(
            f"{E2E_PYTHON} is missing: Mooncake's engine is installed there "
            "(make venv-e2e; make test builds it)"
        )
    queue = {
        "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": str(tcp_queue),
        "MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER": str(tcp_queue),
    }
    paths = {"kvmem": "kvmem", "sglang": "sglang"}
    children = {
        key: Child(
            script=script,
            cwd=ROOT,
            python=str(E2E_PYTHON),
            fork=e2e_fork_server(),
            env=e2e_env(
                {"SGLANG_KVMEM": "1", "SGLANG_KVMEM_TRANSFER": path} | queue, drop=("MC_TCP",)
            ),
        )
        for key, path in paths.items()
    }
    return transfer_runs(children)


def all_are(states: list, value) -> bool:
    return states == [value] * len(states)
