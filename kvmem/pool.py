"""KVPool: the paged K/V buffers of every layer over one memory backend.

The pool is one address range from one backend, cut into physical chunks by a
:class:`~kvmem.memory.plan.ChunkPlan` (:attr:`KVPool.plan`).  Two layouts of that range,
chosen by ``layout`` (``rows = num_pages * page_size``; every block below starts on a
512-byte boundary, padding after a block up to the next boundary):

``layout="kvmem"`` (default): all K layers, then all V layers::

    [K layer 0][K layer 1]...[K layer L-1][V layer 0]...[V layer L-1]

``layout="sglang"``: per layer one block holding K, then V *immediately after it* (no
padding between the two halves), as sglang 0.5.23's ``MHATokenToKVPool`` allocates one
``[2, rows, H, D]`` tensor per layer and reaches V from K's base by ``rows * H * D``
elements::

    [K layer 0|V layer 0][K layer 1|V layer 1]...[K layer L-1|V layer L-1]

    v_buffer[l].data_ptr() == k_buffer[l].data_ptr() + spec.k_layer_bytes(num_pages)

    (a K-only spec, ``v_head_dim=0``, holds only K in each block; ``v_head_dim !=
    head_dim`` keeps K and V adjacent all the same.)

Chunk boundaries fall only between the blocks above (a K or V plane in kvmem's layout, a
K|V block in sglang's), and a boundary moves the next block to the allocation granularity
(2 MiB), so no page, plane or run of pages ever spans two physical allocations, and a
transfer engine can register one region per chunk (:meth:`KVPool.regions`).  A pool up to
the chunk target (2 GiB by default, ``chunk_bytes`` / ``$KVMEM_CHUNK_BYTES``) is one chunk.

In both layouts::

    k_buffer[l] : [num_pages, page_size, num_kv_heads, head_dim]    spec.storage_dtype
    v_buffer[l] : [num_pages, page_size, num_kv_heads, v_head_dim]  (empty list: K-only)

Page 0 is the padding page (sglang writes padded tokens there); an allocator never hands
it out.  ``k_buffer[l].flatten(0, 1)`` is sglang's ``[size + page_size, H, D]`` layer buffer
(:meth:`KVPool.token_buffers` returns those views).
"""

from __future__ import annotations

import torch

from kvmem.errors import ClosedPoolError, ReleasedPoolError
from kvmem.kernels import pack as _pack
from kvmem.memory import MemoryBackend, make_backend
from kvmem.memory.plan import LAYOUTS, ChunkPlan, plan_pool
from kvmem.spec import KVSpec


def layer_offsets(spec: KVSpec, num_pages: int, layout: str) -> tuple[list[int], list[int], int]:
    """Byte offsets of every K and V layer in a one-chunk pool's range, and the range's
    size: ``(k_offsets [L], v_offsets [L] or [] for a K-only spec, total_bytes)``; see the
    module docstring for the two layouts.  A pool of several chunks places its layers by
    its :attr:`KVPool.plan` (:func:`kvmem.memory.plan.plan_pool`)."""
    plan = plan_pool(spec, num_pages, layout, 1, None)
    return list(plan.k_offsets), list(plan.v_offsets), plan.nbytes


class KVPool:
    """Per-layer K/V page buffers over one memory backend.

    Args:
        spec: the model's KV shape.
        num_pages: pages per layer, the padding page 0 included (sglang's
            ``size // page_size + 1``).
        device: ``"cpu"`` or a CUDA device.
        backend: memory backend kind (default: the device's), or a callable
            ``(nbytes, device) -> MemoryBackend`` (see :func:`kvmem.memory.make_backend`).
        layout: ``"kvmem"`` (all K layers, then all V layers) or ``"sglang"`` (per layer,
            K then V adjacent in one block); see the module docstring.  Both are one
            address range cut into chunks between blocks, and pack/unpack work on either.
        chunk_bytes: the chunk target of the ``host`` and ``cuda_vmm`` backends: bytes of
            planes grouped into one physical chunk at most (a bigger plane is a chunk of
            its own).  Default: ``$KVMEM_CHUNK_BYTES``, else 2 GiB.

    Attributes:
        k_buffer, v_buffer: lists of per-layer views (see the module docstring).
        layout: ``"kvmem"`` or ``"sglang"``.
        plan: the :class:`~kvmem.memory.plan.ChunkPlan` (chunks, layer offsets, padding).
        epoch: incremented by every resume.

    Raises:
        PoolMemoryError: the pool's bytes cannot be had (too large to address, or out of
            memory); names the bytes, the backend and the page count.
        ValueError: a bad ``num_pages``, ``layout``, ``chunk_bytes`` or backend kind.
    """

    def __init__(
        self,
        spec: KVSpec,
        num_pages: int,
        device="cpu",
        *,
        backend=None,
        layout: str = "kvmem",
        chunk_bytes: int | None = None,
    ):
        if not isinstance(spec, KVSpec):
            raise TypeError(f"spec must be a KVSpec, got {type(spec).__name__}")
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 2:
            raise ValueError(
                f"num_pages must be an int >= 2 (page 0 is padding), got {num_pages!r}"
            )
        self.spec = spec
        self.num_pages = num_pages
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if not isinstance(layout, str) or layout not in LAYOUTS:
            raise ValueError(f"unknown KVPool layout {layout!r} (known: {', '.join(LAYOUTS)})")
        self.layout = layout

        def planner(granularity: int, target: int | None) -> ChunkPlan:
            return plan_pool(spec, num_pages, layout, granularity, target)

        self._mem: MemoryBackend = make_backend(
            planner(1, None).nbytes,
            self.device,
            backend,
            purpose=f"a KV pool of {num_pages} pages ({spec.page_bytes} bytes each)",
            planner=planner,
            chunk_bytes=chunk_bytes,
        )
        # make_backend plans and maps every range of a byte or more
        assert self._mem.plan is not None and self._mem.tensor is not None
        self.plan: ChunkPlan = self._mem.plan
        self._k_offsets, self._v_offsets = self.plan.k_offsets, self.plan.v_offsets
        self.epoch = 0
        self._released = False
        self._closed = False
        raw = self._mem.tensor
        dt = spec.storage_dtype
        self._k_buffer = [
            raw[o : o + spec.k_layer_bytes(num_pages)].view(dt).view(spec.k_shape(num_pages))
            for o in self._k_offsets
        ]
        self._v_buffer = [
            raw[o : o + spec.v_layer_bytes(num_pages)].view(dt).view(spec.v_shape(num_pages))
            for o in self._v_offsets
        ]
        self._plans: dict = {}

    # --- views ----------------------------------------------------------------------------
    @property
    def k_buffer(self) -> list[torch.Tensor]:
        """Per-layer K views ``[num_pages, page_size, num_kv_heads, head_dim]``.  Refused
        while the pool is released (on CUDA a touch would kill the process); views taken
        before a release must not be used until resume."""
        self.check_live("pool.k_buffer")
        return self._k_buffer

    @property
    def v_buffer(self) -> list[torch.Tensor]:
        """Per-layer V views ``[num_pages, page_size, num_kv_heads, v_head_dim]`` (empty
        for a K-only cache); refused while released, like :attr:`k_buffer`."""
        self.check_live("pool.v_buffer")
        return self._v_buffer

    def token_buffers(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """sglang's flat per-layer views ``(k_list, v_list)``: ``k_list[l] :
        [num_pages * page_size, num_kv_heads, head_dim]`` (``k_buffer[l].flatten(0, 1)``),
        ``v_list`` likewise (empty for a K-only cache).  Same memory, refused while released."""
        self.check_live("pool.token_buffers")
        return (
            [b.flatten(0, 1) for b in self._k_buffer],
            [b.flatten(0, 1) for b in self._v_buffer],
        )

    def as_cupy(self):
        """The same K/V buffers as CuPy arrays (zero-copy; CUDA pools only):
        ``(k_list, v_list)``.  CuPy has no bfloat16: bf16 buffers come as int16 arrays of
        the same bits."""
        self.check_live("pool.as_cupy")
        if self.device.type != "cuda":
            raise ValueError(f"as_cupy needs a CUDA pool, this one is on {self.device}")
        try:
            import cupy
        except ImportError as e:
            raise ImportError("as_cupy needs CuPy (pip install cupy-cuda12x / cupy-cuda13x)") from e

        def view(b):
            return cupy.asarray(b.view(torch.int16) if b.dtype == torch.bfloat16 else b)

        with cupy.cuda.Device(self.device.index):
            return [view(b) for b in self._k_buffer], [view(b) for b in self._v_buffer]

    # --- memory -------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """Bytes of the pool's address range (layer padding included)."""
        return self._mem.nbytes

    @property
    def released(self) -> bool:
        """The pool's memory must not be touched: released, or closed."""
        return self._released

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def backend(self) -> str:
        return self._mem.name

    def regions(self) -> list[tuple[int, int]]:
        """One ``(ptr, nbytes)`` per physical chunk (its used bytes, in address order),
        covering every buffer: what a transfer engine registers.  Every K and V plane
        (kvmem layout) or K|V block (sglang layout) lies inside one region."""
        self._check_open("pool.regions")
        return self._mem.regions()

    def memory_info(self) -> dict:
        """What the backend says about the pool's memory (:meth:`MemoryBackend.info`):
        ``backend``, ``chunks``, ``granularity``, ``target``, ``padding``, ``exportable``
        (CUDA: chunks made with POSIX file-descriptor handles, which UCX's ``cuda_ipc``
        needs to map them into a peer process), ``handle_type``, and on CUDA ``rdma``."""
        self._check_open("pool.memory_info")
        return self._mem.info()

    def resident_bytes(self) -> int:
        """Physical bytes behind the pool now, measured by the backend (``mincore`` on the
        host, bytes of live chunk handles on CUDA)."""
        self._check_open("pool.resident_bytes")
        return self._mem.resident_bytes()

    def prefault(self) -> None:
        """Back every page now instead of at first touch (host pools; a no-op on CUDA)."""
        self.check_live("pool.prefault")
        self._mem.prefault()

    @property
    def can_release(self) -> bool:
        return self._mem.can_release

    def release(self) -> None:
        """Return the pool's physical memory; every ``data_ptr()`` stays; contents are
        discarded.  Waits for outstanding device work first.  Memory only: it knows nothing
        of requests, allocators or transfer engines (the pause orchestrator orders those).
        Releasing a released pool does nothing, unless the backend still holds memory
        after a failed resume (:meth:`MemoryBackend.partly_held`): that is given back.

        If the backend fails, :attr:`released` says what it left: a CUDA unmap that fails
        half-way is undone (the pool stays live and usable, retry later); a chunk handle
        that cannot be freed after a complete unmap leaves the pool released (the handle
        is reused by :meth:`resume`).
        """
        self._check_open("pool.release")
        if self._released and not self._mem.partly_held():
            return
        try:
            self._mem.release()
        finally:
            self._released = bool(self._mem.released)

    def resume(self, prefault: bool = True) -> None:
        """Map physical memory back under the same addresses (contents undefined) and
        increment :attr:`epoch`.  ``prefault`` populates host pages now rather than at first
        touch.  Resuming a live pool does nothing.

        Raises:
            PoolMemoryError: not enough device memory.  Whatever this call had mapped is
                given back, the pool stays released with the same epoch: free memory and
                call ``resume()`` again.
        """
        self._check_open("pool.resume")
        if not self._released:
            return
        try:
            self._mem.resume(prefault=prefault)
        finally:
            self._released = bool(self._mem.released)
        self.epoch += 1

    def close(self) -> None:
        """Give the pool's memory and address range back now, instead of when the pool is
        garbage.  Idempotent.  Afterwards every use raises :class:`ClosedPoolError`, and
        views taken before must not be used (on CUDA their addresses are gone).  Waits for
        outstanding device work first."""
        if self._closed:
            return
        self._closed = True
        self._released = True
        self._k_buffer, self._v_buffer = [], []
        self._plans.clear()
        self._mem.close()

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise ClosedPoolError(f"{what}: the KV pool is closed; create a new pool")

    def check_live(self, what: str = "this operation") -> None:
        """Raise :class:`ReleasedPoolError` when the pool's memory is released
        (:class:`ClosedPoolError`, a subclass, when the pool is closed)."""
        self._check_open(what)
        if self._released:
            raise ReleasedPoolError(
                f"{what}: the KV pool's memory is released (epoch {self.epoch}); "
                "call pool.resume() first"
            )

    # --- pack / unpack -------------------------------------------------------------------
    def _plan(self, layers, heads):
        """The pool's plan of a selection, made once.  The whole pool (``layers`` and
        ``heads`` None, the common call) is found without validating or keying again."""
        whole = layers is None and heads is None
        if whole:
            plan = self._plans.get(None)
            if plan is not None:
                return plan
        key = (
            _pack._check_layers(layers, self.spec.num_layers),
            _pack._check_heads(heads, self.spec.num_kv_heads),
        )
        plan = self._plans.get(key)
        if plan is None:
            plan = _pack.make_plan(self._k_buffer, self._v_buffer, None, *key)
            self._plans[key] = plan
        if whole:
            self._plans[None] = plan
        return plan

    def pack(self, page_ids, layers=None, heads=None, out=None, check=True) -> torch.Tensor:
        self.check_live("pack_pages")
        return _pack.run_pack(
            self._plan(layers, heads),
            self._k_buffer,
            self._v_buffer,
            page_ids,
            out=out,
            check=check,
        )

    def unpack(self, buf, page_ids, layers=None, heads=None, check=True) -> None:
        self.check_live("unpack_pages")
        _pack.run_unpack(
            self._plan(layers, heads), buf, self._k_buffer, self._v_buffer, page_ids, check=check
        )

    def __repr__(self) -> str:
        s = self.spec
        return (
            f"KVPool(layers={s.num_layers}, kv_heads={s.num_kv_heads}, head_dim={s.head_dim}, "
            f"v_head_dim={s.v_head_dim}, page_size={s.page_size}, dtype={s.dtype}, "
            f"num_pages={self.num_pages}, device={self.device}, backend={self.backend}, "
            f"layout={self.layout}, "
            f"nbytes={self.nbytes}, epoch={self.epoch}, released={self._released}"
            + (", closed" if self._closed else "")
            + ")"
        )


def packed_nbytes(spec: KVSpec, n: int, layers=None, heads=None) -> int:
    """Bytes of a packed chunk of ``n`` pages (kvmem.kernels.pack's layout)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be an int >= 0, got {n!r}")
    sel = _pack._check_layers(layers, spec.num_layers)
    h0, h1 = _pack._check_heads(heads, spec.num_kv_heads)
    per_token = (h1 - h0) * (spec.head_dim + spec.v_dim) * spec.itemsize
    return n * len(sel) * spec.page_size * per_token


def pack_pages(
    pool: KVPool, page_ids, layers=None, heads=None, out=None, check=True
) -> torch.Tensor:
    """Pack pages of ``pool`` into one chunk: see :mod:`kvmem.kernels.pack` for the layout.

    Args:
        page_ids: int32/int64 ``[n]`` page ids on the pool's device, in chunk order.
        layers: layer indices in chunk order (e.g. ``[1, 3]``); ``None`` = all.
        heads: ``(start, stop)`` head range; ``None`` = all.
        out: optional ``uint8 [packed_nbytes(spec, n, layers, heads)]`` on the pool's device.
        check: on CUDA, validate page ids (one host sync).  CPU always validates.

    Raises:
        ReleasedPoolError: the pool's memory is released.
        ValueError: a page id outside ``[0, num_pages)``, bad layers/heads/out.
    """
    return pool.pack(page_ids, layers=layers, heads=heads, out=out, check=check)


def unpack_pages(buf, pool: KVPool, page_ids, layers=None, heads=None, check=True) -> None:
    """Write a chunk made by :func:`pack_pages` into ``pool``'s pages ``page_ids``
    (distinct), the same ``layers`` and ``heads``."""
    pool.unpack(buf, page_ids, layers=layers, heads=heads, check=check)
