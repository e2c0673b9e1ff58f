"""A PD prefill scheduler of real sglang 0.5.23 classes on CPU, for the adapter's
lifecycle tests.

What is real: ``Scheduler`` (``object.__new__`` with its real parts attached, running
its own ``_add_request_to_queue``, ``abort_request``, ``is_fully_idle``, the prefill
mixin's ``process_batch_result_disagg_prefill``, ``process_disagg_prefill_inflight_queue``,
``send_kv_chunk``, ``handle_bootstrap_failure`` ...), ``PrefillBootstrapQueue`` (built by
its own ``__init__``) over a real ``FakeKVManager``, ``ReqToMetadataIdxAllocator``,
``MetadataBuffers``, ``ReqToTokenPool``, ``MHATokenToKVPool``, the allocator sglang's
``KVCacheConfigurator`` chooses (kvmem's with the flag on), ``UnifiedRadixCache``,
``SchedulerOutputStreamer``, ``SchedulerBatchResultProcessor``,
``SchedulerWeightUpdaterManager``, real ``Req`` / ``ScheduleBatch.init_new`` /
``prepare_for_extend`` for the KV allocation, and a size-1 gloo group for the poll
all-reduces and the weight updater's TP group (or the caller's group, one process per TP
rank: ``tests/sglang/scenario_release_tp.py``).

Stood in (what a CPU test cannot have):

* the forward pass: ``finish_forward`` hands a ``GenerationBatchResult`` with the sampled
  tokens to the result handler;
* admission: ``launch`` runs the match -> lock -> ``init_new`` -> ``prepare_for_extend``
  sequence on the bootstrapped requests (sglang's ``PrefillAdder`` needs a model); for
  chunked prefill (``chunk_pages``) ``schedule`` / ``loop_step`` run sglang's own
  ``get_next_disagg_prefill_batch_to_run`` with only ``get_new_batch_prefill``'s sizing
  stood in (``_admit``: the chunk budget and the free pages instead of the model's);
* the zmq sockets: :class:`Outbox` records every message the scheduler sends to the
  detokenizer (``BatchTokenIDOutput``) or the tokenizer (``AbortReq``);
* the decode side: :class:`ScriptedKVSender`, a subclass of sglang's ``FakeKVSender``
  whose ``poll()`` state the test sets (``hold``), and which records what it was asked to
  send and whether it was aborted.
"""

from __future__ import annotations

import time
from collections import defaultdict
from types import SimpleNamespace

from tests.sglang.sglang_env import build_pools, make_req, model_config, publish

# the two kinds of answer Outbox.status tells apart
OK, ABORT = "ok", "abort"


class Outbox:
    """What the scheduler sends out: every final answer per rid, in order.

    ``answers[rid]`` is a list of ``(kind, finish_reason)`` where kind is ``"stream"``
    (a finished ``BatchTokenIDOutput`` entry) or ``"abort"`` (an ``AbortReq`` to the
    tokenizer); non-final streamed chunks are not answers and are not recorded."""

    def __init__(self):
        self.answers: dict[str, list] = defaultdict(list)
        self.messages = 0

    # SchedulerOutputStreamer.send_to_detokenizer
    def send_output(self, payload, recv_obj=None):
        self.messages += 1
        if hasattr(payload, "finished_reasons"):
            for rid, reason in zip(payload.rids, payload.finished_reasons):
                if reason is not None:
                    self.answers[rid].append(("stream", reason))
        elif type(payload).__name__ == "AbortReq":
            reason = payload.finished_reason or {
                "type": "abort",
                "message": payload.abort_message or "Abort in waiting queue",
                "status_code": None,
            }
            self.answers[payload.rid].append(("abort", reason))
        else:  # control outputs are not request answers
            pass

    def status(self, rid: str):
        """(finish type, HTTP status) of the one answer to ``rid``, as the tokenizer
        turns it into a response; AssertionError if it got none or several."""
        got = self.answers.get(rid, [])
        assert len(got) == 1, f"{rid} answered {len(got)} times: {got}"
        reason = got[0][1]
        code = reason.get("status_code")
        if reason.get("type") == "abort":
            return ABORT, int(code) if code else None
        return OK, 200

    def message(self, rid: str) -> str:
        return self.answers[rid][0][1].get("message") or ""


def sender_class():
    """sglang's FakeKVSender, driven by the test (defined lazily: sglang must be
    imported after ``publish``)."""
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.fake.conn import FakeKVSender
    from sglang.srt.environ import envs

    class ScriptedKVSender(FakeKVSender):
        """A FakeKVSender whose state the test holds: ``hold = KVPoll.X`` keeps it in X
        (Bootstrapping, WaitingForInput, Transferring) until released with ``hold =
        None``; ``fail()`` makes it report Failed like a real sender that recorded a
        failure.  With ``hold`` None it is sglang's FakeKVSender (WaitingForInput, then
        Success once a last chunk was sent).  A sender held in Bootstrapping times out
        like ``CommonKVSender`` (``SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT`` after it was
        made): it records "timed out" and reports Failed."""

        def __init__(self, mgr, bootstrap_addr, bootstrap_room, *a, **k):
            super().__init__(mgr, bootstrap_addr, bootstrap_room, *a, **k)
            self.hold = None
            self.init_time = time.time()
            self.sends: list[tuple[int, bool]] = []  # (pages, last chunk)
            self.aborts = 0
            self.failure_reason = None
            self.fail_on_send = None  # fail at the n-th send (1-based), or "last"
            self.fail_chunk = None  # "first", "middle", "last" or "extra" of the last send
            self.after_send = None  # the state to hold once the last chunk was sent
            mgr.senders[bootstrap_room] = self

        def poll(self):
            if self.conclude_state is not None:
                return self.conclude_state
            if self.hold == KVPoll.Bootstrapping:
                timeout = envs.SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT.get()
                if time.time() - self.init_time >= timeout:
                    self.fail(
                        f"Request {self.bootstrap_room} timed out after "
                        f"{time.time() - self.init_time:.1f}s in KVPoll.Bootstrapping"
                    )
                    return self.conclude_state
            if self.hold is not None:
                return self.hold
            return super().poll()

        def fail(self, reason: str = "peer failed"):
            # as CommonKVSender: the manager records why, the state becomes Failed
            self.kv_mgr.failure_records[self.bootstrap_room] = reason
            self.failure_reason = reason
            self.conclude_state = KVPoll.Failed

        def send(self, kv_indices, state_indices=None, num_kv_tokens=None):
            n = len(self.sends) + 1
            last = self.kv_mgr.last_chunk_flag
            self.sends.append((len(kv_indices), last))
            super().send(kv_indices, state_indices, num_kv_tokens)
            if self.fail_on_send == n or (self.fail_on_send == "last" and last):
                self.fail(f"send of chunk {n} failed")
            elif self.fail_chunk is not None and last:
                # a real sender moves a send as several transfers (one per page run here)
                # and, with the last one, the extra state; the decode side reports which
                # one failed
                runs = max(len(kv_indices), 1)
                which = {
                    "first": "transfer 1",
                    "middle": f"transfer {max(runs // 2, 1) + 1}",
                    "last": f"transfer {runs}",
                    "extra": "extra state",
                }[self.fail_chunk]
                self.fail(f"{which} of {runs} (+ extra state) failed on the decode side")
            elif self.after_send is not None:
                self.hold = self.after_send

        def failure_exception(self):
            reason = self.kv_mgr.failure_records.pop(self.bootstrap_room, None)
            raise Exception(reason or "Fake KVSender Exception")

        def abort(self):
            self.aborts += 1
            super().abort()

    return ScriptedKVSender


class PrefillHarness:
    """One PD prefill scheduler; see the module docstring."""

    def __init__(
        self,
        *,
        page_size: int = 4,
        pages: int = 64,
        max_reqs: int = 16,
        meta_slots: int | None = None,
        chunk_pages: int | None = None,
        rank: int = 0,
        server_args: dict | None = None,
    ):
        import torch
        import torch.distributed as dist

        # server_args: more of the published ServerArgs (another transfer backend for
        # the managers a test builds itself, tp_size); rank: this process's TP rank, of
        # the process group the caller initialized (one rank of its own otherwise)
        self.server_args = publish(page_size, **(server_args or {}))
        from sglang.srt.runtime_context import get_parallel

        # one rank, as a launcher's rank bundle would say (sglang_env publishes none)
        get_parallel().override_permanently(
            tp_rank=rank,
            pp_rank=0,
            attn_tp_rank=rank,
            attn_cp_rank=0,
            attn_dp_rank=0,
            moe_ep_rank=0,
            dp_rank=None,
        )
        from sglang.srt.disaggregation import prefill as P
        from sglang.srt.disaggregation.fake.conn import FakeKVManager
        from sglang.srt.disaggregation.utils import (
            DisaggregationMode,
            KVClassType,
            MetadataBuffers,
            ReqToMetadataIdxAllocator,
            TransferBackend,
        )
        from sglang.srt.managers.scheduler import Scheduler
        from sglang.srt.managers.scheduler_components.output_streamer import SchedulerOutputStreamer
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
        from tests.sglang.sglang_env import weight_updater

        if not dist.is_initialized():
            # one rank: an in-process store, no port to pick (a port picked free and bound
            # later was taken meanwhile by another process, with the end-to-end tier
            # running beside the main suite: EADDRINUSE)
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        group = dist.group.WORLD
        self.page_size = page_size
        # chunked prefill (sglang's --chunked-prefill-size): at most this many tokens of
        # one pass; None: a prompt is prefilled whole (schedule() only; launch() never
        # chunks)
        self.chunk_tokens = chunk_pages * page_size if chunk_pages else None
        size = page_size * pages
        req_pool, kv, alloc, tree = build_pools(page_size=page_size, size=size, max_reqs=max_reqs)
        self.req_pool, self.kv, self.alloc, self.tree = req_pool, kv, alloc, tree
        self.size = size
        self.mc = model_config(layers=2, heads=2, head_dim=16, dtype=torch.bfloat16)
        self.mc.num_key_value_heads = 2
        self.mc.hf_text_config = SimpleNamespace()
        self.mc.get_total_num_kv_heads = lambda: 2
        self.outbox = Outbox()
        self.Sender = sender_class()

        # -- the scheduler ---------------------------------------------------------------
        s = object.__new__(Scheduler)
        self.s = s
        meta_slots = meta_slots or max_reqs * 2  # sglang: max_running_requests * 2
        s.disaggregation_mode = DisaggregationMode.PREFILL
        s.transfer_backend = TransferBackend.FAKE
        s.req_to_token_pool, s.token_to_kv_pool_allocator, s.tree_cache = req_pool, alloc, tree
        s.model_config = self.mc
        s.server_args = SimpleNamespace(sampling_mask_max_tokens=0, enable_lmcache=False)
        s.enable_overlap = False
        s.device_module = torch.get_device_module("cpu")  # as Scheduler.init_overlap
        s.enable_staging = False
        s.enable_priority_scheduling = False
        s.abort_on_priority_when_disabled = False
        s.spec_algorithm = SpeculativeAlgorithm.NONE
        s.attn_cp_cpu_group = s.attn_tp_cpu_group = s.tp_cpu_group = group
        s.tp_size = dist.get_world_size(group)
        s.chunked_req = None
        s._pending_chunked_abort_req = None
        s.mm_receiver = None
        s.dllm_config = None
        s.enable_hisparse = False
        s.enable_hierarchical_cache = False
        s.enable_hicache_storage = False
        s.enable_continuous_input_polling = False
        s.enable_unified_memory = False
        s.enable_lmcache = False
        s.enable_unified_cache_external_linker = False
        s.rust_server = None
        s.kv_shard_widening = 1
        s.processed_tokens_counter = 0
        s.kv_checksum_computer = None
        s.waiting_queue = []
        s.disagg_prefill_inflight_queue = []
        s.disagg_prefill_pending_chunk_rids = set()
        s.chunked_prefill_size = self.chunk_tokens
        # what get_next_disagg_prefill_batch_to_run reaches besides the admission
        s.dp_attn_adapter = SimpleNamespace(maybe_prepare_mlp_sync_batch=lambda b: b)
        s.get_new_batch_prefill = self._admit  # admission sizing: PrefillAdder stood in
        s.result_queue = []
        s._engine_paused = False
        s.last_batch = None
        s.running_batch = self._empty_batch()
        s.grammar_manager = SimpleNamespace(grammar_queue=[], abort_requests=lambda r: None)
        s.dllm_manager = SimpleNamespace(any_staging_reqs=lambda: False)
        s.beam_coordinator = SimpleNamespace(retire_group=lambda req: None)
        s._pp_microbatches_drained = lambda: True
        s._prefetch_kvcache = lambda req: None
        s.maybe_send_health_check_signal = lambda: None
        s.metrics_reporter = SimpleNamespace(
            enable_metrics=False, report_prefill_stats=lambda **k: None
        )
        s.metrics_collector = None
        s.ipc_channels = SimpleNamespace(send_to_tokenizer=self.outbox)
        s.scheduler_stage_metrics = None  # scheduler_stage_method skips a None recorder
        s.tp_worker = SimpleNamespace(
            model_runner=SimpleNamespace(
                effective_logical_max_total_num_tokens=size, kv_cache_dtype_str="bfloat16"
            )
        )
        s.output_streamer = SchedulerOutputStreamer(
            send_to_detokenizer=self.outbox,
            tree_cache=tree,
            server_args=s.server_args,
            is_generation=True,
            spec_algorithm=s.spec_algorithm,
            disaggregation_mode=s.disaggregation_mode,
            enable_hicache_storage=lambda: False,
        )
        s.batch_result_processor = _batch_result_processor(s)

        # -- PD prefill parts, as Scheduler.init_disaggregation builds them -------------
        s.req_to_metadata_buffer_idx_allocator = ReqToMetadataIdxAllocator(meta_slots)
        s.disagg_metadata_buffers = MetadataBuffers(
            meta_slots,
            hidden_size=32,
            hidden_states_dtype=torch.bfloat16,
            max_sampling_mask_tokens=0,
        )
        # the real queue's __init__ builds its KV manager through get_kv_class(backend,
        # MANAGER): FakeKVManager here; senders come from the same lookup (scripted)
        real_get_kv_class = P.get_kv_class
        sender_cls = self.Sender

        def get_kv_class(backend, class_type):
            if class_type == KVClassType.SENDER:
                return sender_cls
            return real_get_kv_class(backend, class_type)

        P.get_kv_class = get_kv_class
        s.disagg_prefill_bootstrap_queue = P.PrefillBootstrapQueue(
            token_to_kv_pool=kv,
            draft_token_to_kv_pool=None,
            req_to_metadata_buffer_idx_allocator=s.req_to_metadata_buffer_idx_allocator,
            metadata_buffers=s.disagg_metadata_buffers,
            gpu_id=0,
            bootstrap_port=8998,
            max_total_num_tokens=size,
            scheduler=s,
            scheduler_stage_metrics=s.scheduler_stage_metrics,
            transfer_backend=TransferBackend.FAKE,
        )
        mgr = s.disagg_prefill_bootstrap_queue.kv_manager
        assert isinstance(mgr, FakeKVManager), type(mgr)
        mgr.senders = {}
        mgr.failure_records = {}
        mgr.last_chunk_flag = False
        self.mgr = mgr
        # the sender learns which chunk is the last one from sglang's send_kv_chunk
        real_send = type(s)._send_kv_chunk

        def _send_kv_chunk(sched, req, last_chunk=False, end_idx=None):
            mgr.last_chunk_flag = last_chunk
            return real_send(sched, req, last_chunk=last_chunk, end_idx=end_idx)

        s._send_kv_chunk = _send_kv_chunk.__get__(s)

        wu = weight_updater(req_pool, alloc, tree)
        wu.scheduler = s
        wu.tp_cpu_group = group  # SchedulerWeightUpdaterManager.__post_init__'s TP group
        wu.is_fully_idle = s.is_fully_idle
        s.weight_updater = wu
        s.flush_cache = wu.flush_cache
        self.wu = wu
        self._room = 0
        self.reqs: dict = {}

    def _empty_batch(self):
        from sglang.srt.managers.schedule_batch import ScheduleBatch
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        return ScheduleBatch(reqs=[], spec_algorithm=SpeculativeAlgorithm.NONE)

    # -- client side ------------------------------------------------------------------------
    def submit(self, rid: str, n_tokens: int = 9, *, hold=None):
        """A generate request reaching the scheduler (``handle_generate_request`` ends in
        ``_add_request_to_queue``).  ``hold``: the state its sender stays in."""
        req = make_req(rid, n_tokens, max_new_tokens=8, seed=len(self.reqs))
        self._room += 1
        req.bootstrap_host, req.bootstrap_port, req.bootstrap_room = "10.0.0.2", 8998, self._room
        self.reqs[rid] = req
        self.s._add_request_to_queue(req)
        if req.disagg_kv_sender is not None:
            req.disagg_kv_sender.hold = hold
        return req

    def sender(self, rid: str):
        return self.reqs[rid].disagg_kv_sender

    def abort(self, rid: str, **kw):
        from sglang.srt.managers.io_struct import AbortReq

        self.s.abort_request(AbortReq(rid=rid, **kw))

    def release(self, tags=("kv_cache",)):
        """``release_memory_occupation`` with ``tags`` (None: no tags, i.e. all)."""
        from sglang.srt.managers.io_struct import ReleaseMemoryOccupationReqInput

        return self.wu.release_memory_occupation(
            ReleaseMemoryOccupationReqInput(tags=None if tags is None else list(tags))
        )

    def resume(self, tags=("kv_cache",)):
        """``resume_memory_occupation`` with ``tags`` (None: no tags, i.e. all)."""
        from sglang.srt.managers.io_struct import ResumeMemoryOccupationReqInput

        return self.wu.resume_memory_occupation(
            ResumeMemoryOccupationReqInput(tags=None if tags is None else list(tags))
        )

    # -- one scheduler step, in phases (event_loop_normal_disagg_prefill) ------------------
    def pop_bootstrapped(self):
        self.s.waiting_queue.extend(self.s.disagg_prefill_bootstrap_queue.pop_bootstrapped())

    def launch(self, max_batch: int | None = None):
        """Admit bootstrapped waiting requests that fit into one prefill batch and
        allocate their KV (the forward is 'running' after this).  Returns the batch or
        None."""
        from sglang.srt.managers.schedule_batch import ScheduleBatch

        s = self.s
        picked, tokens = [], 0
        free_tokens = self.alloc.available_size()
        for req in list(s.waiting_queue):
            if max_batch is not None and len(picked) >= max_batch:
                break
            need = -(-len(req.origin_input_ids) // self.page_size) * self.page_size
            if len(picked) >= self.req_pool.available_size() or tokens + need > free_tokens:
                break
            picked.append(req)
            tokens += need
        if not picked:
            return None
        for r in picked:
            s.waiting_queue.remove(r)
            r.init_next_round_input(self.tree)
            r.lock = self.tree.lock(r.last_node)
            r.extend_end = len(r.full_untruncated_fill_ids)
        batch = ScheduleBatch.init_new(
            picked, self.req_pool, self.alloc, self.tree, self.mc, False, s.spec_algorithm
        )
        batch.prepare_for_extend()
        s.last_batch = batch
        return batch

    def finish_forward(self, batch):
        """The forward's result reaches the scheduler: ``process_batch_result``."""
        import torch
        from sglang.srt.managers.utils import GenerationBatchResult

        result = GenerationBatchResult(
            next_token_ids=torch.arange(len(batch.reqs), dtype=torch.int64) + 11
        )
        self.s.process_batch_result_disagg_prefill(batch, result)

    def inflight(self):
        return self.s.process_disagg_prefill_inflight_queue()

    def prefill_to_transferring(self, rid: str) -> None:
        """Bootstrap the request just submitted, run its forward, and leave its sender in
        Transferring (the decode has not finished reading); the loop iteration ends with
        a poll of the inflight queue, where the request stays, and no last batch."""
        from sglang.srt.disaggregation.base.conn import KVPoll

        self.pop_bootstrapped()
        batch = self.launch()
        self.sender(rid).hold = KVPoll.Transferring
        self.finish_forward(batch)
        self.inflight()
        self.s.last_batch = None

    def time_retires(self, which=None) -> list[float]:
        """From now on, time sglang's ``_retire_aborted_prefill_result`` (the result
        step's free of an aborted request) for the requests ``which(req)`` accepts (all
        when None): the list each call's microseconds are appended to.  A timed call that
        retired its request must have given back its KV row."""
        retire = self.s._retire_aborted_prefill_result
        times: list[float] = []

        def timed(req):
            t0 = time.perf_counter()
            out = retire(req)
            if which is None or which(req):
                times.append((time.perf_counter() - t0) * 1e6)
                assert not out or req.kv.req_pool_idx is None, f"{req.rid} still holds its KV row"
            return out

        self.s._retire_aborted_prefill_result = timed
        return times

    def step(self):
        """One iteration of the prefill event loop (ingest happened before)."""
        self.pop_bootstrapped()
        batch = self.launch()
        if batch is not None:
            self.finish_forward(batch)
        self.inflight()
        self.s.last_batch = batch

    # -- chunked prefill: sglang's own scheduling step around a stand-in admission ----------
    def _admit(self, running_batch):
        """``Scheduler.get_new_batch_prefill`` for a PD prefill server, with the sizing
        ``PrefillAdder`` does from the model's budgets replaced by: a pass holds at most
        ``chunk_tokens`` tokens (sglang's ``chunked_prefill_size``) and what the allocator
        has free.  The rest is sglang's sequence (scheduler.py ``_get_new_batch_prefill_raw``
        and schedule_policy.py ``add_chunked_req`` / ``_select_prefill_admission`` /
        ``_commit_prefill_admission``): the continuing ``chunked_req`` first
        (``init_next_round_input()``, its next chunk page-floored unless it is the last),
        then waiting requests (match, ``extend_end``, lock; one that does not fit whole
        becomes the new ``chunked_req``, page-floored), ``inflight_middle_chunks += 1``,
        ``ScheduleBatch.init_new(..., chunked_req=...)``, ``prepare_for_extend``."""
        from sglang.srt.managers.schedule_batch import NextBatchPlan, ScheduleBatch

        s, page = self.s, self.page_size
        if not s.waiting_queue and s.chunked_req is None:
            return NextBatchPlan(batch_to_run=None, running_batch=running_batch)
        rem = self.chunk_tokens
        free = int(self.alloc.available_size())
        picked, new_chunked, used = [], None, 0
        cont = int(s.chunked_req is not None)  # the continuing one holds its slot already
        if cont:
            req = s.chunked_req
            req.init_next_round_input()
            left = len(req.full_untruncated_fill_ids) - req.prefix_len
            n = left if rem is None or left <= rem else rem // page * page
            req.extend_end = req.prefix_len + n
            picked.append(req)
            used += -(-n // page) * page
            if rem is not None:
                rem -= n
            s.chunked_req = req if n < left else None
        for req in list(s.waiting_queue):
            if rem is not None and rem <= 0:
                break
            if len(picked) - cont >= self.req_pool.available_size():  # request slots
                break
            req.init_next_round_input(self.tree)
            left = len(req.full_untruncated_fill_ids) - req.prefix_len
            n = left
            if rem is not None and -(-left // page) * page > rem:
                n = rem // page * page  # chunked: page-floored, no new tokens
                if n <= 0:
                    break
            if used + -(-n // page) * page > free:
                break
            req.extend_end = req.prefix_len + n
            req.lock = self.tree.lock(req.last_node)
            picked.append(req)
            used += -(-n // page) * page
            if rem is not None:
                rem -= n
            if n < left:
                new_chunked = req
                break
        if not picked:
            return NextBatchPlan(batch_to_run=None, running_batch=running_batch)
        s.waiting_queue = [r for r in s.waiting_queue if r not in picked]
        if new_chunked is not None:
            assert s.chunked_req is None
            s.chunked_req = new_chunked
        if s.chunked_req is not None:
            s.chunked_req.inflight_middle_chunks += 1
        batch = ScheduleBatch.init_new(
            picked,
            self.req_pool,
            self.alloc,
            self.tree,
            self.mc,
            s.enable_overlap,
            s.spec_algorithm,
            chunked_req=s.chunked_req,
        )
        batch.contains_last_prefill_chunk = s.chunked_req is None or len(picked) != 1
        batch.prepare_for_extend()
        return NextBatchPlan(batch_to_run=batch, running_batch=running_batch)

    def schedule(self):
        """The scheduling half of one ``event_loop_normal_disagg_prefill`` iteration after
        ingest: ``pop_bootstrapped`` and sglang's ``get_next_disagg_prefill_batch_to_run``
        (pending chunked abort, waiting-queue bootstrap check, ``process_prefill_chunk``:
        the previous chunk of ``chunked_req`` sent, ``last_batch`` filtered; then the
        admission).  The returned batch's forward is 'running' until
        :meth:`finish_forward`."""
        s = self.s
        self.pop_bootstrapped()
        plan = s.get_next_disagg_prefill_batch_to_run(
            running_batch=s.running_batch, last_batch=s.last_batch
        )
        s.running_batch = plan.running_batch
        return plan.batch_to_run

    def loop_step(self):
        """One whole ``event_loop_normal_disagg_prefill`` iteration (ingest happened
        before): schedule, forward + result, inflight queue, ``last_batch = batch``.
        Returns the batch (None when idle)."""
        batch = self.schedule()
        if batch is not None:
            self.finish_forward(batch)
        self.inflight()
        self.s.last_batch = batch
        return batch

    # -- accounting ----------------------------------------------------------------------------
    def held(self) -> dict:
        """What is not free now: KV tokens, request slots, metadata slots."""
        s = self.s
        return {
            "kv_tokens": self.size - int(self.alloc.available_size()),
            "req_slots": self.req_pool.size - self.req_pool.available_size(),
            "meta_slots": (
                s.req_to_metadata_buffer_idx_allocator.size
                - s.req_to_metadata_buffer_idx_allocator.available_size()
            ),
        }

    def queues(self) -> dict:
        s = self.s
        return {
            "bootstrap": [r.rid for r in s.disagg_prefill_bootstrap_queue.queue],
            "waiting": [r.rid for r in s.waiting_queue],
            "inflight": [r.rid for r in s.disagg_prefill_inflight_queue],
        }


def _batch_result_processor(s):
    """sglang's own result processor; the parts a prefill batch without logprobs,
    hisparse, offload or speculative decoding never reads are None."""
    from sglang.srt.managers.scheduler_components.batch_result_processor import (
        SchedulerBatchResultProcessor,
    )

    return SchedulerBatchResultProcessor(
        is_generation=True,
        disaggregation_mode=s.disaggregation_mode,
        enable_overlap=False,
        enable_overlap_mlx=False,
        model_config=s.model_config,
        token_to_kv_pool_allocator=s.token_to_kv_pool_allocator,
        tree_cache=s.tree_cache,
        hisparse_coordinator=None,
        req_to_token_pool=s.req_to_token_pool,
        decode_offload_manager=None,
        metrics_collector=None,
        metrics_reporter=s.metrics_reporter,
        draft_worker=None,
        model_worker=None,
        logprob_result_processor=None,
        output_streamer=s.output_streamer,
        beam_coordinator=s.beam_coordinator,
        abort_request=s.abort_request,
    )


def prefill_stats() -> dict | None:
    """What the adapter's prefill hooks counted in this process (``PrefillStats`` as a
    dict); None with the flag off (the adapter is not loaded)."""
    try:
        from dataclasses import asdict

        from kvmem_sglang import prefill, state
    except ImportError:
        return None
    return asdict(prefill.STATS) if state.PROCESS.options.is_active() else None
