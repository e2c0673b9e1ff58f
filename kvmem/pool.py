"""KVPool: the paged K/V buffers of every layer over one memory backend.

Layout of the backend's range (one allocation; layer starts padded to ``_LAYER_ALIGN``)::

    [K layer 0][K layer 1]...[K layer L-1][V layer 0]...[V layer L-1]

    k_buffer[l] : [num_pages, page_size, num_kv_heads, head_dim]    spec.storage_dtype
    v_buffer[l] : [num_pages, page_size, num_kv_heads, v_head_dim]  (empty list: K-only)

Page 0 is the padding page (sglang writes padded tokens there); an allocator never hands
it out.  ``k_buffer[l].flatten(0, 1)`` is sglang's ``[size + page_size, H, D]`` layer buffer.
"""

from __future__ import annotations

import torch

from kvmem.errors import ReleasedPoolError
from kvmem.kernels import pack as _pack
from kvmem.memory import MemoryBackend, make_backend
from kvmem.spec import KVSpec

# Each layer starts on a 512-byte boundary: 16-byte vector accesses need 16, and 512 is
# what CUDA's caching allocator gives separate tensors, so kvmem's and sglang's buffers
# behave alike in the kernels.
_LAYER_ALIGN = 512


def _round_up(x: int, a: int) -> int:
    return (x + a - 1) // a * a


class KVPool:
    """Per-layer K/V page buffers over one memory backend.

    Args:
        spec: the model's KV shape.
        num_pages: pages per layer, the padding page 0 included (sglang's
            ``size // page_size + 1``).
        device: ``"cpu"`` or a CUDA device.
        backend: memory backend kind (default: the device's).

    Attributes:
        k_buffer, v_buffer: lists of per-layer views (see the module docstring).
        epoch: incremented by every resume.
    """

    def __init__(self, spec: KVSpec, num_pages: int, device="cpu", *, backend: str | None = None):
        if not isinstance(spec, KVSpec):
            raise TypeError(f"spec must be a KVSpec, got {type(spec).__name__}")
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 2:
            raise ValueError(f"num_pages must be an int >= 2 (page 0 is padding), got {num_pages!r}")
        self.spec = spec
        self.num_pages = num_pages
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        k_stride = _round_up(spec.k_layer_bytes(num_pages), _LAYER_ALIGN)
        v_stride = _round_up(spec.v_layer_bytes(num_pages), _LAYER_ALIGN)
        self._k_offsets = [l * k_stride for l in range(spec.num_layers)]
        v_base = spec.num_layers * k_stride
        self._v_offsets = [v_base + l * v_stride for l in range(spec.num_layers)] if spec.has_v else []
        total = v_base + (spec.num_layers * v_stride if spec.has_v else 0)
        self._mem: MemoryBackend = make_backend(total, self.device, backend)
        self.epoch = 0
        self._released = False
        raw = self._mem.tensor
        dt = spec.storage_dtype
        self._k_buffer = [
            raw[o:o + spec.k_layer_bytes(num_pages)].view(dt).view(spec.k_shape(num_pages))
            for o in self._k_offsets
        ]
        self._v_buffer = [
            raw[o:o + spec.v_layer_bytes(num_pages)].view(dt).view(spec.v_shape(num_pages))
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
        return self._released

    @property
    def backend(self) -> str:
        return self._mem.name

    def regions(self) -> list[tuple[int, int]]:
        """Few large ``(ptr, nbytes)`` ranges covering every buffer, for a transfer engine."""
        return self._mem.regions()

    def resident_bytes(self) -> int:
        """Physical bytes behind the pool now, measured by the backend (``mincore`` on the
        host, mapped bytes on CUDA)."""
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
        Releasing a released pool does nothing."""
        if self._released:
            return
        self._mem.release()
        self._released = True

    def resume(self, prefault: bool = True) -> None:
        """Map physical memory back under the same addresses (contents undefined) and
        increment :attr:`epoch`.  ``prefault`` populates host pages now rather than at first
        touch.  Resuming a live pool does nothing."""
        if not self._released:
            return
        self._mem.resume(prefault=prefault)
        self._released = False
        self.epoch += 1

    def check_live(self, what: str = "this operation") -> None:
        """Raise :class:`ReleasedPoolError` when the pool's memory is released."""
        if self._released:
            raise ReleasedPoolError(
                f"{what}: the KV pool's memory is released (epoch {self.epoch}); "
                "call pool.resume() first"
            )

    # --- pack / unpack -------------------------------------------------------------------
    def _plan(self, layers, heads):
        key = (_pack._check_layers(layers, self.spec.num_layers),
               _pack._check_heads(heads, self.spec.num_kv_heads))
        plan = self._plans.get(key)
        if plan is None:
            plan = _pack.make_plan(self._k_buffer, self._v_buffer, None, *key)
            self._plans[key] = plan
        return plan

    def pack(self, page_ids, layers=None, heads=None, out=None, check=True) -> torch.Tensor:
        self.check_live("pack_pages")
        return _pack.run_pack(self._plan(layers, heads), self._k_buffer, self._v_buffer,
                              page_ids, out=out, check=check)

    def unpack(self, buf, page_ids, layers=None, heads=None, check=True) -> None:
        self.check_live("unpack_pages")
        _pack.run_unpack(self._plan(layers, heads), buf, self._k_buffer, self._v_buffer,
                         page_ids, check=check)

    def __repr__(self) -> str:
        s = self.spec
        return (f"KVPool(layers={s.num_layers}, kv_heads={s.num_kv_heads}, head_dim={s.head_dim}, "
                f"v_head_dim={s.v_head_dim}, page_size={s.page_size}, dtype={s.dtype}, "
                f"num_pages={self.num_pages}, device={self.device}, backend={self.backend}, "
                f"nbytes={self.nbytes}, epoch={self.epoch}, released={self._released})")


def packed_nbytes(spec: KVSpec, n: int, layers=None, heads=None) -> int:
    """Bytes of a packed chunk of ``n`` pages (kvmem.kernels.pack's layout)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be an int >= 0, got {n!r}")
    sel = _pack._check_layers(layers, spec.num_layers)
    h0, h1 = _pack._check_heads(heads, spec.num_kv_heads)
    per_token = (h1 - h0) * (spec.head_dim + spec.v_head_dim) * spec.itemsize
    return n * len(sel) * spec.page_size * per_token


def pack_pages(pool: KVPool, page_ids, layers=None, heads=None, out=None, check=True) -> torch.Tensor:
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
