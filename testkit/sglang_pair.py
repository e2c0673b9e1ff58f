"""A real sglang 0.5.23 PD pair in two processes on DRAM: a prefill-side ``NixlKVManager``
with its ``NixlKVSender``s and sglang's ``NixlKVBootstrapServer`` in this process, a
decode-side ``NixlKVManager`` with its ``NixlKVReceiver``s in a child process; NIXL over
UCX between them (or, ``backend="mooncake"``, sglang's ``MooncakeKV*`` classes over
Mooncake's transfer engine on TCP, with :data:`MOONCAKE_ENV`); KV pools built by sglang's
own ``MHATokenToKVPool`` (with ``SGLANG_KVMEM=1`` in a side's environment, the adapter's
hooks put a kvmem pool under it).  Used by ``bench/sglang_pair.py`` (stock against the
flag, a raw write in the same processes) and by the adapter's transfer tests
(``tests/sglang``).

Shapes (named symbols used below)::

    L layers, H KV heads, D head dim, bf16            (the issue's model: 32 x 8 x 128)
    P page size (tokens), R requests, T tokens each   (32 requests x 1024 tokens)
    planes = 2 L: K of layer 0..L-1, then V of layer 0..L-1 (sglang's buffer order)
    pool rows = R T + P (page 0 is sglang's padding page); pages 1 .. R T / P

Page ids are the same on both sides and no two pages of a request are adjacent: request
``r`` holds pages ``1 + r + j R`` (``j < T / P``), so the R requests interleave (R >= 2).
The prefill fills every row of its pool with a positional pattern (int64 word ``i`` of
plane ``k`` holds ``k << 40 | i``), so the decode checks what landed without being told
the bytes: a row of a plane must hold the prefill's word for that row.

One *round* of the sglang transfer: the decode makes a receiver per request, allocates
its metadata slot, clears the rows it will check and publishes its pages
(``send_metadata``); the prefill waits until every sender is WaitingForInput, then,
timed, calls ``sender.send(pages)`` for every request (one chunk, the last) and waits
until every room is Success on both sides.  The *raw* write moves the same bytes between
the same two processes with the prefill manager's own NIXL agent: per request one
``initialize_xfer`` of 2 L descriptors (the request's share of each plane, contiguous,
same offsets on both sides), all requests posted at once, polled to DONE.  On Mooncake:
the prefill manager's own engine, one ``batch_transfer_sync_write`` of those 2 L R
slices.

At TP (``Shape.prefill_tp`` / ``decode_tp`` above 1) every rank is a process of its own
(the prefill's rank 0 is this one) holding ``H / tp`` of the heads, as sglang's ranks do;
one bootstrap server, this process's.  Prefill rank ``r`` fills its heads' words of the
same pattern, so a decode rank checks its rows against the whole row's pattern whichever
prefill ranks wrote them.  The raw write at unequal TP moves each prefill rank's bytes
contiguously into its decode rank's share of the request (the same bytes, not the
decode's head layout: the ceiling a transfer of them could reach).  At TP 2 the pools are
labelled VRAM and NIXL takes that for DRAM, as on sglang's CPU servers (:func:`kv_args`).

Stand-ins: the model (only the KV shape), the forward pass (the pattern), the
scheduler (the senders and receivers are driven here as the bootstrap/inflight queues
drive them).  One environment shim: the NIXL wheel installed is ``nixl_cu12``, which
sglang imports as ``nixl``.
"""

from __future__ import annotations

import os
import shutil
import socket
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from pathlib import Path

import numpy as np

from testkit import child
from testkit.zygote import ForkServer

# sglang's PD transfer backends this pair runs: the module and class-name prefix of
# each one's manager, sender, receiver and bootstrap server.
BACKENDS = {
    "nixl": ("sglang.srt.disaggregation.nixl.conn", "Nixl"),
    "mooncake": ("sglang.srt.disaggregation.mooncake.conn", "Mooncake"),
}
# What Mooncake needs in a pair's processes here (set where unset): TCP, as no RDMA
# device exists, and room in its TCP transport's per-peer queues (1,024 transfers by
# default; 4,096 is the most it accepts): sglang's four transfer workers each post one
# batch of 2 L x T / P slices per request (16,384 in flight at the shape, page
# size 16), and past the queue the engine logs "TCP lane queue-full rejection", fails
# the session, and every room in flight fails (measured with mooncake-transfer-engine-
# non-cuda 0.3.13.post1, stock and the flag alike).  Its engine.so also needs
# libibverbs.so.1 on the loader's path, which must be in LD_LIBRARY_PATH when the
# process starts (``.venv-e2e/ibverbs.path``).
MOONCAKE_ENV = {
    "MOONCAKE_PROTOCOL": "tcp",
    "SGLANG_HOST_IP": "127.0.0.1",
    "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": "4096",
    "MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER": "4096",
}
# The environment that has Mooncake's engine (the main one has none: `make venv-e2e`),
# and the file where `make venv-e2e` wrote the directories of libibverbs.so.1 (empty:
# the system has it).
REPO = Path(__file__).resolve().parents[1]
E2E_PYTHON = REPO / ".venv-e2e" / "bin" / "python"
IBVERBS_PATH = Path(os.environ.get("KVMEM_E2E_IBVERBS_PATH") or REPO / ".venv-e2e" / "ibverbs.path")


def with_ibverbs(env: dict) -> dict:
    """``env`` with the directories of ``IBVERBS_PATH`` ahead of its LD_LIBRARY_PATH (what
    a process that loads Mooncake's engine needs when it starts); FileNotFoundError
    naming the make target when the file is missing."""
    try:
        dirs = IBVERBS_PATH.read_text().strip()
    except OSError:
        raise FileNotFoundError(
            f"{IBVERBS_PATH} is missing: Mooncake's engine needs "
            "libibverbs1 (make venv-e2e fetches it)"
        ) from None
    out = dict(env)
    if dirs:
        out["LD_LIBRARY_PATH"] = os.pathsep.join(
            [dirs] + [p for p in env.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p]
        )
    return out


POLL_S = 0.0005  # the drivers' poll period while they wait (they must not spin a core)
# How long a decode process may take to start (import sglang, build its pool and manager):
# about 30 s on the 2-core machine here, several minutes when other runs share it.
START_S = 900


@dataclass(frozen=True)
class Shape:
    layers: int = 32
    heads: int = 8
    head_dim: int = 128
    page_size: int = 16
    requests: int = 32
    tokens: int = 1024
    # pages of request r are 1 + spread (r + j R): at 1 together they are every page from
    # 1 to R T / P; at 2 no two pages of a round are adjacent, across requests either
    spread: int = 1
    # attention TP of each side: a rank holds H / tp of the KV heads (rank r the heads
    # [r H / tp, (r + 1) H / tp)), in a process of its own; the prefill's TP a multiple
    # of the decode's (each prefill rank writes to one decode rank)
    prefill_tp: int = 1
    decode_tp: int = 1

    def __post_init__(self):
        if self.spread < 1:
            raise ValueError(f"{self}: spread must be at least 1")
        if (
            min(self.prefill_tp, self.decode_tp) < 1
            or self.heads % self.prefill_tp
            or self.heads % self.decode_tp
            or self.prefill_tp % self.decode_tp
        ):
            raise ValueError(
                f"{self}: each TP must divide the KV heads, and the decode's the prefill's"
            )
        if self.requests < 2 or self.tokens % self.page_size:
            raise ValueError(
                f"{self}: need requests >= 2 and tokens a multiple of the page "
                "size (pages of a request are made non-adjacent by interleaving)"
            )

    @property
    def pages_per_request(self) -> int:
        return self.tokens // self.page_size

    @property
    def planes(self) -> int:
        return 2 * self.layers

    @property
    def row_bytes(self) -> int:
        """Bytes of one token of one plane."""
        return self.heads * self.head_dim * 2

    @property
    def page_bytes(self) -> int:
        """Bytes of one page of one plane (a NIXL descriptor when nothing merges)."""
        return self.page_size * self.row_bytes

    @property
    def request_bytes(self) -> int:
        return self.tokens * self.planes * self.row_bytes

    @property
    def pool_tokens(self) -> int:
        return self.requests * self.tokens * self.spread

    @property
    def mem_kind(self) -> str:
        """The memory kind the pair's KV args give (:func:`kv_args`): DRAM at TP 1,
        VRAM (taken as DRAM) at TP 2 and more, as sglang's servers give it."""
        return "DRAM" if self.prefill_tp == 1 else "VRAM"

    @property
    def tp_label(self) -> str:
        """``"<prefill TP>x<decode TP>"``."""
        return f"{self.prefill_tp}x{self.decode_tp}"


def request_pages(shape: Shape, r: int) -> np.ndarray:
    """int32 [T / P] page ids of request ``r`` (same on both sides; never adjacent)."""
    j = np.arange(shape.pages_per_request, dtype=np.int64)
    return (1 + shape.spread * (r + j * shape.requests)).astype(np.int32)


def merged_runs(src: np.ndarray, dst: np.ndarray) -> int:
    """Runs of pages adjacent on both sides (what NIXL merges into one descriptor per
    plane): 1 + the number of breaks."""
    if src.size == 0:
        return 0
    brk = (np.diff(src.astype(np.int64)) != 1) | (np.diff(dst.astype(np.int64)) != 1)
    return 1 + int(brk.sum())


# -- one side's sglang parts ---------------------------------------------------------------


def nixl_as_sglang_imports_it() -> None:
    """sglang imports ``nixl._api``; the wheel installed here is ``nixl_cu12``.  Its
    agents nap between progress polls and take "VRAM" for DRAM (``testkit.nixl_nap``:
    the pairs at TP 2 label their pools as sglang's servers do, see :func:`kv_args`)."""
    from testkit import nixl_nap

    nixl_nap.install()
    try:
        import nixl._api  # noqa: F401 - sglang imports it so
    except ImportError:
        import nixl_cu12
        import nixl_cu12._api

        sys.modules.setdefault("nixl", nixl_cu12)
        sys.modules.setdefault("nixl._api", nixl_cu12._api)
    nixl_nap.vram_as_dram(sys.modules["nixl._api"])


_PUBLISHED: dict = {}


def conn_class(backend: str, name: str):
    """sglang's ``<Backend>KV<name>`` class (``name``: Manager, Sender, Receiver,
    BootstrapServer) of ``backend`` (:data:`BACKENDS`)."""
    import importlib

    module, prefix = BACKENDS[backend]
    return getattr(importlib.import_module(module), f"{prefix}KV{name}")


def publish(role: str, page_size: int, backend: str = "nixl", tp: int = 1, rank: int = 0):
    """Publish this process's ServerArgs (a PD ``role`` server on the CPU, ``backend``,
    attention TP ``tp``, this process its rank ``rank``) and load sglang's plugins, as
    ``run_scheduler_process`` does, and start the shared Mooncake engine as the scheduler
    does for that backend; once per process (a later call returns the first ServerArgs:
    the page size that matters is the pool's)."""
    if role in _PUBLISHED:
        return _PUBLISHED[role]
    if backend == "nixl":
        nixl_as_sglang_imports_it()
    else:
        for k, v in MOONCAKE_ENV.items():
            os.environ.setdefault(k, v)
    from sglang.srt.runtime_context import get_parallel
    from sglang.srt.runtime_context import publish as _publish
    from sglang.srt.server_args import ServerArgs

    sa = ServerArgs(
        model_path="dummy",
        device="cpu",
        page_size=page_size,
        tp_size=tp,
        disaggregation_mode=role,
        disaggregation_transfer_backend=backend,
    )
    _publish(sa, role="test")
    from sglang.srt.plugins import load_plugins

    load_plugins()
    # one rank, as a launcher's rank bundle would say; pp_size 1 (the group is never used)
    get_parallel().override_permanently(
        tp_rank=rank,
        pp_rank=0,
        attn_tp_rank=rank,
        attn_cp_rank=0,
        attn_dp_rank=0,
        moe_ep_rank=0,
        dp_rank=None,
        pp_group=None,
    )
    if backend == "mooncake":
        from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import (
            init_mooncake_transfer_engine,
        )

        init_mooncake_transfer_engine("127.0.0.1", gpu_id=0)
    _PUBLISHED[role] = sa
    return sa


def build_pool(shape: Shape, tp: int = 1):
    """sglang's CPU MHA pool of ``R T`` tokens (a rank's at TP ``tp``: ``H / tp`` heads)
    and its creation time (s)."""
    import torch
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    t0 = time.perf_counter()
    kv = MHATokenToKVPool(
        shape.pool_tokens,
        page_size=shape.page_size,
        dtype=torch.bfloat16,
        head_num=shape.heads // tp,
        head_dim=shape.head_dim,
        layer_num=shape.layers,
        device="cpu",
        enable_memory_saver=False,
    )
    return kv, time.perf_counter() - t0


def memory_counters() -> dict:
    """This process's anonymous memory in transparent huge pages (``AnonHugePages`` of
    /proc/self/smaps_rollup) and the machine's THP and compaction counters
    (/proc/vmstat: huge pages faulted in, faults that fell back to small pages, direct
    compactions stalled in), in bytes and counts; where the files are missing, empty."""
    out = {}
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    out["anon_huge_bytes"] = int(line.split()[1]) << 10
    except OSError:
        pass
    try:
        with open("/proc/vmstat") as f:
            for line in f:
                k, v = line.split()
                if k in ("thp_fault_alloc", "thp_fault_fallback", "compact_stall"):
                    out[k] = int(v)
    except OSError:
        pass
    return out


def counter_delta(before: dict, after: dict) -> dict:
    return {k: after[k] - before.get(k, 0) for k in after if k != "anon_huge_bytes"} | (
        {"anon_huge_bytes": after["anon_huge_bytes"]} if "anon_huge_bytes" in after else {}
    )


def planes_of(kv) -> list:
    """The pool's planes (K of every layer, then V), each ``[rows, H, D]``."""
    return list(kv.k_buffer) + list(kv.v_buffer)


def words(buf):
    """A plane as int64 words ``[rows, H D / 4]``."""
    return buf.view(buf.shape[0], -1).view(__import__("torch").int64)


def fill_pattern(kv, tp: int = 1, rank: int = 0) -> float:
    """Write the positional pattern into every row of every plane (rank ``rank`` of TP
    ``tp``: its heads' words of the whole row's pattern); seconds taken."""
    import torch

    t0 = time.perf_counter()
    for k, buf in enumerate(planes_of(kv)):
        w = words(buf)
        torch.add(
            _row_words(w.shape[0], w.shape[1], k, tp, rank),
            torch.arange(w.shape[1], dtype=torch.int64),
            out=w,
        )
    return time.perf_counter() - t0


def _row_words(rows, per_rank: int, k: int, tp: int, rank: int):
    """The pattern's first word of rank ``rank``'s share of each row of ``rows`` (a count
    or a tensor of row ids) of plane ``k``, ``[n, 1]``: a row of the whole plane holds
    ``tp x per_rank`` words."""
    import torch

    if isinstance(rows, int):
        rows = torch.arange(rows, dtype=torch.int64)
    return (k << 40) + rows[:, None] * (per_rank * tp) + rank * per_rank


def check_rows(kv, shape: Shape, pages: np.ndarray, plane_ids, tp: int = 1, rank: int = 0) -> int:
    """Rows of ``pages`` in the planes ``plane_ids`` that differ from the prefill's
    pattern (0: every byte landed); ``kv`` is rank ``rank``'s pool at TP ``tp``."""
    import torch

    rows = (
        torch.from_numpy(pages.astype(np.int64))[:, None] * shape.page_size
        + torch.arange(shape.page_size)
    ).reshape(-1)
    bad = 0
    for k in plane_ids:
        w = words(planes_of(kv)[k])
        per_row = w.shape[1]
        want = _row_words(rows, per_row, k, tp, rank) + torch.arange(per_row)
        bad += int((w[rows] != want).any(dim=1).sum())
    return bad


def clear_rows(kv, shape: Shape, pages: np.ndarray, plane_ids) -> None:
    import torch

    rows = (
        torch.from_numpy(pages.astype(np.int64))[:, None] * shape.page_size
        + torch.arange(shape.page_size)
    ).reshape(-1)
    for k in plane_ids:
        words(planes_of(kv)[k])[rows] = 0


def metadata_buffers(n: int):
    import torch
    from sglang.srt.disaggregation.utils import MetadataBuffers

    return MetadataBuffers(
        n, hidden_size=64, hidden_states_dtype=torch.bfloat16, max_sampling_mask_tokens=0
    )


def kv_args(kv, meta, rank: int = 0, kind: str = "DRAM", tp: int = 1):
    """What ``PrefillBootstrapQueue._init_kv_manager`` / ``DecodePreallocQueue.
    _init_kv_manager`` put in a KVArgs for a plain MHA pool on rank ``rank`` of TP ``tp``
    (the pool holds ``1 / tp`` of the heads), the pool's
    memory kind ``kind``: DRAM (host memory here), or VRAM as sglang's servers label it
    (:func:`nixl_as_sglang_imports_it` makes that DRAM; sglang's NIXL manager refuses a
    DRAM destination at unequal TP, ``nixl/conn.py:1587-1593``)."""
    from sglang.srt.disaggregation.base.conn import KVArgs
    from sglang.srt.disaggregation.utils import get_kv_transfer_buf_infos

    a = KVArgs()
    a.engine_rank, a.pp_rank, a.system_dp_rank, a.gpu_id = rank, 0, 0, 0
    a.kv_cache_dtype_str, a.kv_layout, a.ib_device = "bfloat16", None, None
    a.kv_data_ptrs, a.kv_data_lens, a.kv_item_lens = get_kv_transfer_buf_infos(kv)
    a.kv_data_mem_kinds = [kind] * len(a.kv_data_ptrs)
    a.num_draft_entries = 0
    layers = len(a.kv_data_ptrs) // 2
    a.kv_layer_ids = list(range(layers)) * 2  # k0..kL-1 then v0..vL-1
    a.page_size = kv.page_size
    a.kv_head_num, a.total_kv_head_num = kv.head_num, kv.head_num * tp
    a.prefill_start_layer, a.prefill_end_layer = kv.start_layer, getattr(kv, "end_layer", None)
    a.mla_compression_ratios = None
    a.aux_data_ptrs, a.aux_data_lens, a.aux_item_lens = meta.get_buf_infos()
    a.state_types, a.state_data_ptrs, a.state_data_lens = [], [], []
    a.state_item_lens, a.state_layer_ids = [], []
    return a


def manager(
    kv,
    meta,
    role: str,
    server_args,
    backend: str = "nixl",
    rank: int = 0,
    kind: str = "DRAM",
    tp: int = 1,
):
    from sglang.srt.disaggregation.utils import DisaggregationMode

    mode = DisaggregationMode.PREFILL if role == "prefill" else DisaggregationMode.DECODE
    return conn_class(backend, "Manager")(
        kv_args(kv, meta, rank, kind, tp), mode, server_args, False
    )


class DescriptorCount:
    """Counts what an agent is asked to move: descriptors per ``make_prepped_xfer`` /
    ``initialize_xfer`` call (wraps the two methods of one agent instance).  With
    ``record`` the ``(address, bytes)`` of every descriptor of every ``initialize_xfer``
    are kept too, local and remote (``ranges``; for small test rounds: a descriptor list
    is read entry by entry)."""

    def __init__(self, agent, record: bool = False):
        self.record = record
        self._reset()
        prepped, plain = agent.make_prepped_xfer, agent.initialize_xfer

        def make_prepped_xfer(op, ls, lidx, rs, ridx, *a, **k):
            self._count(len(lidx))
            return prepped(op, ls, lidx, rs, ridx, *a, **k)

        def initialize_xfer(op, ls, rs, *a, **k):
            self._count(ls.descCount() if hasattr(ls, "descCount") else len(ls))
            if self.record:
                self.ranges.append((_ranges_of(ls), _ranges_of(rs)))
            return plain(op, ls, rs, *a, **k)

        agent.make_prepped_xfer, agent.initialize_xfer = make_prepped_xfer, initialize_xfer

    def _reset(self) -> None:
        self.calls = self.descs = 0
        self.by_call: list[int] = []
        self.ranges: list[tuple[list, list]] = []  # per call: (local, remote) [(addr, n)]

    def _count(self, n: int) -> None:
        self.calls += 1
        self.descs += n
        self.by_call.append(n)

    def take(self) -> dict:
        out = dict(calls=self.calls, descriptors=self.descs, ranges=self.ranges)
        self._reset()
        return out


class SliceCount(DescriptorCount):
    """:class:`DescriptorCount` for a Mooncake manager: slices per
    ``batch_transfer_sync`` call of its engine (the wrapper sglang's sends and aux
    writes go through; wrapped on that instance)."""

    def __init__(self, engine, record: bool = False):
        self.record = record
        self._reset()
        plain = engine.batch_transfer_sync

        def batch_transfer_sync(session, buffers, peers, lengths, *a, **k):
            self._count(len(buffers))
            if self.record:
                self.ranges.append((list(zip(buffers, lengths)), list(zip(peers, lengths))))
            return plain(session, buffers, peers, lengths, *a, **k)

        engine.batch_transfer_sync = batch_transfer_sync


def _ranges_of(dlist) -> list[tuple[int, int]]:
    """``(address, bytes)`` of every entry of a NIXL descriptor list."""
    return [(int(d[0]), int(d[1])) for d in (dlist[i] for i in range(dlist.descCount()))]


def registered(mgr) -> dict:
    """``(address, bytes)`` of every registration a ``NixlKVManager`` holds now: ``kv``
    (its ``kv_descs``: one per layer and K/V stock, one per pool region, i.e. physical
    chunk, with the adapter's ``SGLANG_KVMEM_REGISTER=regions``) and ``other`` (aux and
    state buffers)."""
    other = [
        d
        for d in (getattr(mgr, "aux_descs", None), getattr(mgr, "state_descs", None))
        if d is not None
    ]
    return dict(
        kv=[r for descs in mgr.kv_descs for r in _ranges_of(descs)],
        other=[r for descs in other for r in _ranges_of(descs)],
    )


def outside_one_region(ranges, regions) -> int:
    """How many ``(address, bytes)`` ranges do not lie inside one of ``regions`` (NIXL
    refuses a descriptor across two registrations, also two adjacent ones)."""
    return sum(not any(a <= p and p + n <= a + m for a, m in regions) for p, n in ranges)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bootstrap_server(backend: str, attempts: int = 5, wait_s: float = 30.0):
    """sglang's bootstrap server of ``backend`` on a free port of 127.0.0.1, and the port.

    The port is picked free and bound later by the server's thread, so another process
    can take it in between (seen with the end-to-end tier running beside the main
    suite); the thread then ends at once, and another port is tried.  A server whose
    thread listens (its aiohttp runner has an address) is the one returned."""
    for _ in range(attempts):
        port = _free_port()
        server = conn_class(backend, "BootstrapServer")("127.0.0.1", port)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            runner = getattr(server, "_runner", None)
            if runner is not None and runner.addresses:
                return server, port
            if not server.thread.is_alive():
                break  # its bind failed: the port was taken meanwhile
            time.sleep(0.01)
        else:
            raise RuntimeError(f"the bootstrap server on port {port} did not listen in {wait_s} s")
    raise RuntimeError(f"no free port held for the bootstrap server in {attempts} tries")


def _wait(pred, timeout: float, what: str):
    end = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > end:
            raise TimeoutError(f"{what}: not reached in {timeout:.0f} s")
        time.sleep(POLL_S)


# -- the decode process ----------------------------------------------------------------------


def record_abort_acks(manager) -> dict:
    """Wrap ``manager._send_abort_ack`` (on that instance): the returned dict fills with
    room -> ``time.monotonic()`` of the first ABORT_ACK the manager sent for it."""
    acks: dict[int, float] = {}
    real = manager._send_abort_ack

    def send_abort_ack(room, target):
        acks.setdefault(room, time.monotonic())
        return real(room, target)

    manager._send_abort_ack = send_abort_ack
    return acks


def _serve(conn, env: dict, start) -> None:
    """A rank process's life: ``env`` set, ``start()`` builds the rank and returns its
    start-up reply and its command handler ``handle(cmd, arg) -> reply``; each command
    from ``conn`` then gets one reply until ``stop``.  A failure sends its traceback
    (the pair raises it); the process leaves with ``os._exit`` (sglang's threads are not
    daemons; NIXL's exit is not clean here)."""
    try:
        os.environ.update(env)
        hello, handle = start()
        conn.send(hello)
        while True:
            cmd, arg = conn.recv()
            if cmd == "stop":
                conn.send("bye")
                break
            conn.send(handle(cmd, arg))
    except BaseException:  # noqa: BLE001 - the pair reads the traceback
        conn.send(dict(error=traceback.format_exc()))
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def _decode_main(
    conn, shape_d: dict, addr: str, env: dict, backend: str = "nixl", rank: int = 0
) -> None:
    """The decode side (rank ``rank`` of its TP): commands from the prefill over
    ``conn``, one reply each (:func:`_serve`)."""
    _serve(conn, env, lambda: _decode_start(Shape(**shape_d), addr, backend, rank))


def _decode_start(shape: Shape, addr: str, backend: str, rank: int):
    sa = publish("decode", shape.page_size, backend, shape.decode_tp, rank)
    m0 = memory_counters()
    kv, created_s = build_pool(shape, shape.decode_tp)
    memory = counter_delta(m0, memory_counters())
    meta = metadata_buffers(shape.requests)
    dm = manager(kv, meta, "decode", sa, backend, rank, shape.mem_kind, shape.decode_tp)
    # DecodePreallocQueue asks again at every step until the prefill answers
    end = time.monotonic() + START_S
    while not dm.try_ensure_parallel_info(addr):
        if time.monotonic() > end:
            raise TimeoutError(
                f"the prefill's bootstrap server {addr} did not answer in {START_S} s"
            )
        time.sleep(0.2)
    recv = {}

    def handle(cmd, arg):
        if cmd == "publish":  # arg: (rooms, planes to check[, clear them first])
            receiver = conn_class(backend, "Receiver")
            rooms, check, *more = arg
            clear = more[0] if more else True
            recv.clear()
            for r, room in enumerate(rooms):
                if clear:
                    clear_rows(kv, shape, request_pages(shape, r), check)
                rc = receiver(dm, addr, room)
                rc.init(0)
                recv[room] = rc
            for r, room in enumerate(rooms):
                recv[room].send_metadata(request_pages(shape, r), aux_index=r)
            return "published"
        if cmd == "wait":  # arg: (timeout, planes to check) -> every room's end
            timeout, check = arg
            return _decode_wait(dm, kv, shape, recv, timeout, check, rank)
        if cmd == "info":
            return dict(
                dst_kv_ptrs=list(dm.kv_args.kv_data_ptrs),
                **(
                    dict(agent=dm.agent.name, registered=registered(dm))
                    if backend == "nixl"
                    else {}
                ),
            )
        return f"unknown command {cmd!r}"

    # what the engine has registered (the pool, the metadata buffers) must outlive the
    # loop: the manager keeps their addresses only
    handle.keep = (kv, meta, dm)
    return dict(pool_create_s=created_s, kvmem_pool=_kvmem_pool(kv), memory=memory), handle


def _decode_wait(dm, kv, shape: Shape, recv: dict, timeout: float, check, rank: int = 0) -> dict:
    """Poll every receiver as the decode's transfer queue does until each room is
    Success, or Failed with its release safe: a Failed room's ABORT goes to the prefill
    (``ensure_abort_notified(force_arm=True)``, decode.py:2899-2906) and its pages count as
    free once the prefill's ABORT_ACK made ``is_abort_release_safe`` true
    (decode.py:3046-3060).  Returns when (monotonic clock) each room ended, the rows of
    the Success rooms that differ from the pattern in the planes ``check``, and when
    ``done_at`` every room ended."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    rooms = list(recv)
    state, failed_at, safe_at, ok_at = {}, {}, {}, {}
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        for room in rooms:
            if room in ok_at or room in safe_at:
                continue
            st = recv[room].poll()
            state[room] = int(st)
            if st == KVPoll.Success:
                ok_at[room] = time.monotonic()
            elif st == KVPoll.Failed:
                if room not in failed_at:
                    failed_at[room] = time.monotonic()
                    recv[room].ensure_abort_notified(force_arm=True)
                if dm.is_abort_release_safe(room, 1):
                    safe_at[room] = time.monotonic()
        if len(ok_at) + len(safe_at) == len(rooms):
            break
        time.sleep(POLL_S)
    done_at = time.monotonic()
    bad = (
        sum(
            check_rows(kv, shape, request_pages(shape, r), check, shape.decode_tp, rank)
            for r, room in enumerate(rooms)
            if room in ok_at
        )
        if check
        else 0
    )
    return dict(
        done_at=done_at,
        states=[state.get(room) for room in rooms],
        ok_at={str(k): v for k, v in ok_at.items()},
        failed_at={str(k): v for k, v in failed_at.items()},
        safe_at={str(k): v for k, v in safe_at.items()},
        bad_rows=bad,
    )


def _kvmem_pool(kv) -> bool:
    """Whether the adapter put a kvmem pool under sglang's KV cache ``kv``."""
    try:
        from kvmem_sglang.state import POOL
    except ImportError:  # no adapter in this environment: a stock cache
        return False
    return POOL.get(kv) is not None


# -- one prefill rank's work (this process's rank 0, a child's other ranks) ------------------


def _make_senders(pm, backend: str, addr: str, shape: Shape, rooms) -> list:
    """A sender per room (request ``r`` the ``r``-th), initialized as the bootstrap queue
    does."""
    sender = conn_class(backend, "Sender")
    out = []
    for r, room in enumerate(rooms):
        s = sender(pm, addr, room)
        s.init(shape.pages_per_request, aux_index=r)
        out.append(s)
    return out


def _wait_waiting(senders, timeout: float) -> None:
    from sglang.srt.disaggregation.base.conn import KVPoll

    _wait(
        lambda: all(s.poll() == KVPoll.WaitingForInput for s in senders),
        timeout,
        "every sender WaitingForInput",
    )


def _wait_concluded(senders, timeout: float) -> float:
    """Wait until every room is Success or Failed on this rank; when (monotonic)."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    _wait(
        lambda: all(s.poll() in (KVPoll.Success, KVPoll.Failed) for s in senders),
        timeout,
        "every room concluded on the prefill",
    )
    return time.monotonic()


def _raw_offsets(shape: Shape, rank: int) -> tuple[int, list[int], list[int]]:
    """The raw write of prefill rank ``rank``: bytes a request of one plane (``span``),
    and per request the offset it is read from in the rank's plane and written to in its
    decode rank's plane.  At unequal TP the prefill ranks that write one decode rank put
    their spans side by side in that request's share of the plane (the bytes a
    transfer moves, contiguous; not the decode's head layout)."""
    src_row = shape.row_bytes // shape.prefill_tp
    dst_row = shape.row_bytes // shape.decode_tp
    span, slot = shape.tokens * src_row, rank % (shape.prefill_tp // shape.decode_tp)
    src = [shape.page_size * src_row + r * span for r in range(shape.requests)]
    dst = [
        shape.page_size * dst_row + r * shape.tokens * dst_row + slot * span
        for r in range(shape.requests)
    ]
    return span, src, dst


def _raw_write(pm, shape: Shape, count, backend: str, rank: int, timeout: float) -> dict:
    """The raw write of one prefill rank (module docstring), with the manager's own NIXL
    agent or Mooncake engine, to the one decode peer it has sent to."""
    peer = next(iter(pm.decode_kv_args_table))
    dst = pm.decode_kv_args_table[peer].dst_kv_ptrs
    src = pm.kv_args.kv_data_ptrs
    span, src_offs, dst_offs = _raw_offsets(shape, rank)
    count.take()
    if backend == "mooncake":
        bufs = [s + o for o in src_offs for s in src]
        peers = [d + o for o in dst_offs for d in dst]
        t0 = time.monotonic()
        code = pm.engine.batch_transfer_sync(peer, bufs, peers, [span] * len(bufs))
        done = time.monotonic()
        if code != 0:
            raise RuntimeError(f"raw Mooncake batch write returned {code}")
    else:
        agent = pm.agent
        lists = []
        for so, do in zip(src_offs, dst_offs):
            ld = np.array([(s + so, span, 0) for s in src], dtype=np.uint64)
            rd = np.array([(d + do, span, 0) for d in dst], dtype=np.uint64)
            lists.append((agent.get_xfer_descs(ld, "DRAM"), agent.get_xfer_descs(rd, "DRAM")))
        t0 = time.monotonic()
        handles = []
        for ld, rd in lists:
            h = agent.initialize_xfer("WRITE", ld, rd, peer)
            agent.transfer(h)
            handles.append(h)
        pending = list(handles)
        end = t0 + timeout
        while pending:
            states = [agent.check_xfer_state(h) for h in pending]
            if "ERR" in states:
                raise RuntimeError("raw NIXL write ended ERR")
            pending = [h for h, st in zip(pending, states) if st != "DONE"]
            if pending:
                if time.monotonic() > end:
                    raise TimeoutError("raw NIXL write not DONE")
                time.sleep(POLL_S)
        done = time.monotonic()
        for h in handles:
            agent.release_xfer_handle(h)
    counted = count.take()
    return dict(
        t0=t0,
        done_at=done,
        nbytes=span * len(src) * shape.requests,
        descriptors=counted["descriptors"],
    )


def _counter(pm, backend: str, record: bool = False):
    return DescriptorCount(pm.agent, record) if backend == "nixl" else SliceCount(pm.engine, record)


def _prefill_main(
    conn, shape_d: dict, port: int, env: dict, backend: str, rank: int, timeout: float
) -> None:
    """Prefill rank ``rank`` (not 0) of the pair's TP: its pool (its heads, the pattern),
    manager (registered with the bootstrap server on ``port`` of this host) and senders;
    commands from the pair over ``conn``, one reply each (:func:`_serve`)."""
    _serve(conn, env, lambda: _prefill_start(Shape(**shape_d), port, backend, rank, timeout))


def _prefill_start(shape: Shape, port: int, backend: str, rank: int, timeout: float):
    sa = publish("prefill", shape.page_size, backend, shape.prefill_tp, rank)
    from sglang.srt.runtime_context import get_disagg

    get_disagg()._set("disaggregation_bootstrap_port", port)
    addr = f"127.0.0.1:{port}"
    kv, created_s = build_pool(shape, shape.prefill_tp)
    fill_s = fill_pattern(kv, shape.prefill_tp, rank)
    meta = metadata_buffers(shape.requests)
    pm = manager(kv, meta, "prefill", sa, backend, rank, shape.mem_kind, shape.prefill_tp)
    count = _counter(pm, backend)
    senders = []

    def handle(cmd, arg):
        if cmd == "senders":  # arg: rooms
            senders[:] = _make_senders(pm, backend, addr, shape, arg)
            return "made"
        if cmd == "waiting":
            _wait_waiting(senders, timeout)
            return "waiting"
        if cmd == "send":  # every request's one chunk; replies when all concluded
            count.take()
            for r, s in enumerate(senders):
                s.send(request_pages(shape, r))
            done_at = _wait_concluded(senders, timeout)
            counted = count.take()
            return dict(
                done_at=done_at,
                states=[int(s.poll()) for s in senders],
                calls=counted["calls"],
                descriptors=counted["descriptors"],
                aux=len(pm.kv_args.aux_data_ptrs),
            )
        if cmd == "clear":
            for s in senders:
                s.clear()
            senders.clear()
            return "cleared"
        if cmd == "raw":
            return _raw_write(pm, shape, count, backend, rank, timeout)
        return f"unknown command {cmd!r}"

    handle.keep = (kv, meta, pm)  # registered memory outlives the loop (_decode_start)
    return dict(pool_create_s=created_s, fill_s=fill_s, kvmem_pool=_kvmem_pool(kv)), handle


class _Child:
    """A rank's process and the connection to it: one command, one reply.

    The process runs :func:`_rank_main` with ``env`` as its
    whole environment (the flag as the rank wants it from its start: the adapter's
    start-up check reads SGLANG_KVMEM then), forked from the fork server that forked
    this process when there is one (``testkit.zygote``: sglang imported once, not once
    per rank), else a fresh interpreter.  It connects to a Unix socket of this process
    and is sent ``target``'s name and ``args``.  Its stdout and stderr are copied to this
    process's stderr when it ends."""

    def __init__(self, target, args: tuple, env: dict, timeout: float):
        self.timeout = timeout
        self._dir = tempfile.mkdtemp(prefix="sglang-pair-")
        path = os.path.join(self._dir, "sock")
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(path)
        self._listener.listen(1)
        self._job = (target.__name__, args)
        self._conn = None
        code = f"from testkit.sglang_pair import _rank_main; _rank_main({path!r})"
        self.proc = child.start(
            child.Child(code=code, env=env, cwd=REPO, fork=ForkServer.of_parent())
        )
        self._ended = threading.Event()
        threading.Thread(target=self._copy_output, daemon=True).start()

    def _copy_output(self) -> None:
        try:
            out, err = self.proc.communicate()
            sys.stderr.write(out + err)
            sys.stderr.flush()
        finally:
            self._ended.set()

    def _connected(self, timeout: float):
        """The connection, accepted at the first use; TimeoutError when the process has
        not connected in ``timeout`` s, RuntimeError when it ended first."""
        if self._conn is None:
            self._listener.settimeout(0.2)
            end = time.monotonic() + timeout
            while self._conn is None:
                try:
                    sock, _ = self._listener.accept()
                except socket.timeout:
                    if self._ended.is_set():
                        raise RuntimeError(
                            f"a rank's process ended (status "
                            f"{self.proc.returncode}) before it connected; "
                            "its output is above"
                        ) from None
                    if time.monotonic() > end:
                        raise TimeoutError(
                            f"a rank's process did not connect in {timeout} s"
                        ) from None
                    continue
                sock.setblocking(True)
                self._conn = Connection(sock.detach())
            self._listener.close()
            self._conn.send(self._job)
        return self._conn

    def post(self, cmd: str, arg=None) -> None:
        self._connected(START_S).send((cmd, arg))

    def reply(self, timeout: float | None = None):
        timeout = timeout or self.timeout
        conn = self._connected(timeout)
        if not conn.poll(timeout):
            raise TimeoutError(f"a rank's process did not answer in {timeout} s")
        out = conn.recv()
        if isinstance(out, dict) and "error" in out:
            raise RuntimeError("a rank's process failed:\n" + out["error"])
        return out

    def ask(self, cmd: str, arg=None, timeout: float | None = None):
        self.post(cmd, arg)
        return self.reply(timeout)

    def close(self) -> None:
        if self._conn is not None:
            try:
                self.ask("stop", timeout=30)
            except Exception:  # noqa: BLE001 - the child may be gone already
                pass
        if not self._ended.wait(10):
            self.proc.kill()
            self._ended.wait(10)
        self._listener.close()  # never accepted when the process did not connect
        shutil.rmtree(self._dir, ignore_errors=True)


def _rank_main(path: str) -> None:
    """A rank's process (:class:`_Child`): connect to ``path``, run the target it names."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    conn = Connection(sock.detach())
    name, args = conn.recv()
    {"_prefill_main": _prefill_main, "_decode_main": _decode_main}[name](conn, *args)


def _all(children, cmd: str, arg=None, timeout: float | None = None) -> list:
    """Post ``cmd`` to every child, then read their replies (they work at once)."""
    for c in children:
        c.post(cmd, arg)
    return [c.reply(timeout) for c in children]


# -- the pair (the prefill's rank 0 is this process) -----------------------------------------


class Pair:
    """The prefill side in this process and the decode side in a child; see the module
    docstring.  At TP (``shape.prefill_tp`` / ``decode_tp`` above 1) this process is the
    prefill's rank 0, each other prefill rank and each decode rank a child of its own,
    every rank with its share of the heads; one bootstrap server (this process's).
    ``decode_env``: environment of the decode processes (the flag there); the prefill's
    other ranks get this process's SGLANG_KVMEM* variables.  ``wait=False``: return once
    the children are started; :meth:`ready` waits for them (several pairs of one process
    then start their children together).  ``record``: keep every descriptor of a round
    (``DescriptorCount``) for :meth:`regions_check` (NIXL, TP 1).  ``backend``: ``nixl``
    or ``mooncake`` (:data:`BACKENDS`)."""

    def __init__(
        self,
        shape: Shape,
        decode_env: dict | None = None,
        timeout: float = 300,
        wait: bool = True,
        record: bool = False,
        backend: str = "nixl",
    ):
        self.shape, self.timeout, self.backend = shape, timeout, backend
        sa = publish("prefill", shape.page_size, backend, shape.prefill_tp, 0)
        from sglang.srt.runtime_context import get_disagg

        self.bootstrap, port = bootstrap_server(backend)
        get_disagg()._set("disaggregation_bootstrap_port", port)
        self.addr = f"127.0.0.1:{port}"
        m0 = memory_counters()
        self.kv, self.pool_create_s = build_pool(shape, shape.prefill_tp)
        self.fill_s = fill_pattern(self.kv, shape.prefill_tp, 0)
        self.memory = counter_delta(m0, memory_counters())  # the pool made and filled
        self.meta = metadata_buffers(shape.requests)
        self.pm = manager(
            self.kv, self.meta, "prefill", sa, backend, 0, shape.mem_kind, shape.prefill_tp
        )
        self.count = _counter(self.pm, backend, record)
        env = {k: v for k, v in os.environ.items() if not k.startswith("SGLANG_KVMEM")}
        mine = {k: v for k, v in os.environ.items() if k.startswith("SGLANG_KVMEM")}
        self.ranks = [
            _Child(
                _prefill_main,
                (asdict(shape), port, {**env, **mine}, backend, rank, timeout),
                {**env, **mine},
                timeout,
            )
            for rank in range(1, shape.prefill_tp)
        ]
        denv = {**env, **(decode_env if decode_env is not None else mine)}
        self.decodes = [
            _Child(_decode_main, (asdict(shape), self.addr, denv, backend, rank), denv, timeout)
            for rank in range(shape.decode_tp)
        ]
        self.decode_info = None
        self.next_room = 1000
        self.rounds = 0
        if wait:
            self.ready()

    def ready(self) -> "Pair":
        """Wait until every child is up (its pool, manager and bootstrap);
        ``decode_info``: decode rank 0's start-up reply, ``rank_info`` the prefill
        ranks'."""
        if self.decode_info is None:
            self.rank_info = [c.reply(START_S) for c in self.ranks]
            self.decode_info = [c.reply(START_S) for c in self.decodes][0]
        return self

    def ask(self, cmd: str, arg=None, timeout: float | None = None):
        """A command to decode rank 0, its reply."""
        return self.decodes[0].ask(cmd, arg, timeout)

    def senders(self, n: int, check=(), clear: bool = True):
        """``n`` bootstrapped senders of this process's rank (rooms WaitingForInput, on
        every rank), one per request; the decode clears the rows of the planes ``check``
        first unless ``clear`` is False."""
        rooms = list(range(self.next_room, self.next_room + n))
        self.next_room += n
        out = _make_senders(self.pm, self.backend, self.addr, self.shape, rooms)
        assert _all(self.ranks, "senders", rooms) == ["made"] * len(self.ranks)
        assert _all(self.decodes, "publish", (rooms, list(check), clear)) == ["published"] * len(
            self.decodes
        )
        for c in self.ranks:
            c.post("waiting")
        _wait_waiting(out, self.timeout)
        for c in self.ranks:
            c.reply()
        return out

    def sglang_round(
        self,
        check=(0,),
        on_sent=None,
        at_once: bool = False,
        decode_timeout: float | None = None,
        clear: bool = True,
        send=None,
    ) -> dict:
        """One timed round of sglang's transfer of every request; see the module
        docstring.  ``check``: planes the decode clears before and checks after (in the
        rooms that end Success).  ``on_sent(senders)``: called once every chunk is
        queued (a test's abort or fault).  ``at_once``: the chunks reach the workers'
        queues together (queued on queues no worker reads, then moved over in one step),
        as a worker still busy with an earlier room would find them.
        ``decode_timeout``: how long the decode waits for every room to end.
        ``clear=False``: the decode does not clear the rows first (a fresh pool reads as
        zeros, and no pattern word of a transferred row is zero): the round is then the
        first write into those pages, and pays their first touch where the pool left it
        to the first touch.  ``send(r, sender, pages)``: how request ``r`` is handed to
        its sender (default ``sender.send(pages)``; a test passes sglang's other
        arguments, as a scheduler would).  ``on_sent``, ``at_once`` and ``send`` act on
        this process's rank only; the other prefill ranks send every chunk plainly."""
        from sglang.srt.disaggregation.common.utils import FastQueue

        shape = self.shape
        senders = self.senders(shape.requests, check, clear)
        self.count.take()
        real = self.pm.transfer_queues
        if at_once:
            self.pm.transfer_queues = [FastQueue() for _ in real]
        t0 = time.monotonic()
        for c in self.ranks:
            c.post("send")
        for r, s in enumerate(senders):
            if send is None:
                s.send(request_pages(shape, r))
            else:
                send(r, s, request_pages(shape, r))
        if at_once:
            backlog, self.pm.transfer_queues = self.pm.transfer_queues, real
            for b, q in zip(backlog, real):
                with q._cond:  # FastQueue: a deque and a condition
                    q._buf.extend(b._buf)
                    q._cond.notify_all()
        if on_sent is not None:
            on_sent(senders)
        t_prefill = _wait_concluded(senders, self.timeout)
        ranks = [c.reply() for c in self.ranks]
        wait_s = decode_timeout or self.timeout
        ds = _all(self.decodes, "wait", (wait_s, list(check)), timeout=wait_s + self.timeout)
        states = [int(s.poll()) for s in senders]
        counted = self.count.take()
        for s in senders:
            s.clear()
        _all(self.ranks, "clear")
        self.rounds += 1
        wall = max([t_prefill] + [x["done_at"] for x in ranks + ds]) - t0
        nbytes = shape.requests * shape.request_bytes
        # send_aux: one descriptor per aux buffer, on every prefill rank
        aux = len(self.pm.kv_args.aux_data_ptrs) + sum(x["aux"] for x in ranks)
        calls = counted["calls"] + sum(x["calls"] for x in ranks)
        descs = counted["descriptors"] + sum(x["descriptors"] for x in ranks)
        return dict(
            seconds=wall,
            gbps=nbytes / wall / 1e9,
            nbytes=nbytes,
            t0=t0,
            rooms=[s.bootstrap_room for s in senders],
            prefill_states=states,
            decode_states=ds[0]["states"],
            rank_states=[x["states"] for x in ranks],
            decode_rank_states=[d["states"] for d in ds[1:]],
            bad_rows=sum(d["bad_rows"] for d in ds),
            decode=ds[0],
            engine_writes=calls - shape.requests * shape.prefill_tp,
            kv_descriptors_per_request=descs / shape.requests - aux,
            **({"regions": self.regions_check(counted["ranges"])} if self.count.record else {}),
        )

    def regions_check(self, ranges) -> dict:
        """Of the descriptors ``ranges`` recorded in a round: how many lie inside no
        single registration, locally and on the decode, and each side's KV registrations
        (a kvmem pool registers one per physical chunk)."""
        mine = registered(self.pm)
        theirs = self.ask("info")["registered"]
        local = [r for lo, _ in ranges for r in lo]
        remote = [r for _, ro in ranges for r in ro]
        return dict(
            descriptors=len(local),
            kv_regions=len(mine["kv"]),
            decode_kv_regions=len(theirs["kv"]),
            local_outside=outside_one_region(local, mine["kv"] + mine["other"]),
            remote_outside=outside_one_region(remote, theirs["kv"] + theirs["other"]),
        )

    def registrations(self) -> int:
        """The prefill's registrations with its engine: NIXL's KV descriptors; on
        Mooncake every region it registers (KV and aux)."""
        if self.backend == "nixl":
            return sum(d.descCount() for d in self.pm.kv_descs)
        return len(self.pm._registerable_regions())

    def raw_round(self) -> dict:
        """The raw write of the same bytes (module docstring), every prefill rank at
        once."""
        for c in self.ranks:
            c.post("raw")
        mine = _raw_write(self.pm, self.shape, self.count, self.backend, 0, self.timeout)
        every = [mine] + [c.reply() for c in self.ranks]
        wall = max(x["done_at"] for x in every) - min(x["t0"] for x in every)
        nbytes = sum(x["nbytes"] for x in every)
        return dict(
            seconds=wall,
            gbps=nbytes / wall / 1e9,
            nbytes=nbytes,
            kv_descriptors_per_request=sum(x["descriptors"] for x in every) / self.shape.requests,
        )

    def close(self) -> None:
        for c in self.ranks + self.decodes:
            c.close()
