"""Deterministic stand-in KV data: what a request's forward pass "computes".

Both sides build the same *tape* of random bytes from a shared seed.  The K (kv=0) or V
(kv=1) rows of layer ``l`` of request ``rid``, tokens ``t0 .. t1``, are the tape's bytes
``base(rid, l, kv) + row * [t0, t1)``: contiguous, position-dependent, different for every
request and layer.  So the prefill's "forward" costs one memcpy per layer, and the decode
side verifies a landed chunk with one ``torch.equal`` per layer against tape slices (no
data is sent for verification, and nothing is recomputed byte by byte).

Chunks are in kvmem's packed layout (K of every layer, then V; each
``[tokens, heads, head_dim]``), for the request's pages ``[first, last)`` (page ``j`` of a
request holds its tokens ``j * page_size ...``).

On a CUDA pool the tape is copied to the device once (:meth:`Synth.prepare`, which the
sides call at construction); ``fill`` and the checks then run on the device with no host
sync, and a check's verdict is a 0-dim bool tensor on the device that the decode reads
through a :class:`~kvmem.disagg.device.HostCopy`.
"""

from __future__ import annotations

import ctypes
import ctypes.util

import numpy as np
import torch

from kvmem.spec import KVSpec
from kvmem.transfer.runs import merge_runs

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
_libc.memcmp.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
_libc.memcmp.restype = ctypes.c_int

_PERIOD = 16 << 20  # random bytes the per-request bases are drawn from


class Synth:
    """The tape for requests of at most ``max_tokens`` tokens of ``spec``: the model of both
    PD sides, :class:`kvmem.disagg.Forward` (:meth:`fill`) and :class:`kvmem.disagg.Verifier`
    (:meth:`verify`, :meth:`verify_pages`)."""

    def __init__(self, spec: KVSpec, max_tokens: int, seed: int = 0):
        self.spec = spec
        self.max_tokens = max_tokens
        self.rows = [r for r in (spec.k_token_bytes, spec.v_token_bytes) if r]
        longest = max(self.rows) * (-(-max_tokens // spec.page_size) * spec.page_size)
        gen = torch.Generator().manual_seed(seed)
        self.tape = torch.randint(0, 256, (_PERIOD + longest,), generator=gen, dtype=torch.uint8)
        self._tapes = {torch.device("cpu"): self.tape}  # device -> the tape there

    def tape_on(self, device) -> torch.Tensor:
        """The tape on ``device`` (copied there at the first call: one blocking copy of
        16 MiB and the longest request's rows, at set-up rather than in a step)."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        t = self._tapes.get(device)
        if t is None:
            t = self._tapes[device] = self.tape.to(device)
        return t

    def prepare(self, device) -> None:
        """The sides' set-up call (kvmem.disagg.model): the tape on ``device`` now."""
        self.tape_on(device)

    def _base(self, rid: int, layer: int, kv: int) -> int:
        x = rid * 0x9E3779B97F4A7C15 + layer * 0xBF58476D1CE4E5B9 + kv * 0x94D049BB133111EB
        x &= (1 << 64) - 1
        x ^= x >> 31
        return (x % _PERIOD) & ~63  # 64-byte aligned slices

    def _slices(self, rid: int, first_page: int, last_page: int, device=None):
        ps = self.spec.page_size
        tape = self.tape if device is None else self.tape_on(device)
        if not 0 <= first_page <= last_page or last_page * ps > -(-self.max_tokens // ps) * ps:
            raise ValueError(
                f"synth: page range [{first_page}, {last_page}) outside a "
                f"{self.max_tokens}-token request"
            )
        t0, t1 = first_page * ps, last_page * ps
        for kv, row in enumerate(self.rows):
            for l in range(self.spec.num_layers):
                b = self._base(rid, l, kv)
                yield tape[b + t0 * row : b + t1 * row]

    def chunk(self, rid: int, first_page: int, last_page: int, out=None) -> torch.Tensor:
        """uint8 ``[packed_nbytes(spec, last - first)]``: pages ``[first, last)`` of ``rid``
        (into ``out`` when given)."""
        return torch.cat(list(self._slices(rid, first_page, last_page)), out=out)

    def fill(self, pool, rid: int, first_page: int, last_page: int, pages) -> None:
        """Write pages ``[first, last)`` of ``rid`` into ``pool``'s ``pages`` (what a
        forward pass does to the KV cache): what ``unpack_pages(chunk(...), pool, pages)``
        gives, in one pass over the bytes, each layer's tape slice copied straight into
        that layer's page rows (no chunk built, no per-layer validation: this stands in
        for the model, not for kvmem's API)."""
        n = last_page - first_page
        bufs = pool.k_buffer + pool.v_buffer
        idx = pages.numpy() if pages.device.type == "cpu" else pages
        for buf, piece in zip(bufs, self._slices(rid, first_page, last_page, pool.device)):
            rows = buf.view(buf.shape[0], -1).view(torch.uint8)  # [num_pages, page bytes]
            src = piece.view(n, -1)
            if rows.device.type == "cpu":  # NumPy's row assignment: a memcpy per row
                rows.numpy()[idx] = src.numpy()
            else:  # device ids, the device tape: no host sync
                rows.index_copy_(0, idx, src)

    def verify(self, rid: int, first_page: int, last_page: int, data: torch.Tensor) -> torch.Tensor:
        """Whether ``data`` (uint8 ``[nbytes]``, packed) is exactly what :meth:`chunk`
        gives: a 0-dim bool tensor on ``data``'s device (on CUDA computed there, no host
        sync; ``bool()`` of it waits)."""
        slices = list(self._slices(rid, first_page, last_page, data.device))
        if sum(s.numel() for s in slices) != data.numel():
            return _verdict(data, False)
        verdicts, off = [], 0
        for s in slices:
            verdicts.append(_equal(data[off : off + s.numel()], s))
            off += s.numel()
        return _all(data, verdicts)

    def verify_pages(self, pool, rid: int, first_page: int, last_page: int, pages) -> torch.Tensor:
        """Whether ``pool``'s ``pages`` (int64 [last - first] on the host, the pages
        holding the request's pages ``[first, last)``) hold exactly what :meth:`fill`
        writes there: the check of a chunk written straight into the pool, in place.  One
        comparison per layer, K|V and run of consecutive page ids (a run is one range of a
        layer).  A 0-dim bool tensor on the pool's device, as :meth:`verify`."""
        ids = pages.tolist() if hasattr(pages, "tolist") else list(pages)
        n = last_page - first_page
        probe = pool.k_buffer[0]
        if len(ids) != n:
            return _verdict(probe, False)
        # (first index, first page id, length): the ids paired with their indices, which
        # are always adjacent, so a run breaks where the ids do
        merged = merge_runs(np.arange(n), ids, by_source=False)
        runs = list(zip(merged.src.tolist(), merged.dst.tolist(), merged.length.tolist()))
        bufs = pool.k_buffer + pool.v_buffer
        verdicts = []
        for buf, piece in zip(bufs, self._slices(rid, first_page, last_page, pool.device)):
            rows = buf.view(buf.shape[0], -1).view(torch.uint8)  # [num_pages, page bytes]
            pb = rows.shape[1]
            for i, p, k in runs:
                verdicts.append(_equal(rows[p : p + k].reshape(-1), piece[i * pb : (i + k) * pb]))
        return _all(probe, verdicts)


def _equal(a: torch.Tensor, b: torch.Tensor):
    """Whether two uint8 ranges of one device are equal.  On the CPU a bool, by libc's
    memcmp (9.3 GB/s vs 6.1 GB/s for torch.equal of int64 views, 1 MiB ranges out of
    cache, 2-core CPU); elsewhere a 0-dim bool tensor computed on the device (no host
    sync), comparing int64 words when aligned (several times faster than byte-wise)."""
    if (
        a.device.type == "cpu"
        and b.device.type == "cpu"
        and a.is_contiguous()
        and b.is_contiguous()
    ):
        return a.nbytes == b.nbytes and _libc.memcmp(a.data_ptr(), b.data_ptr(), a.nbytes) == 0
    if a.numel() != b.numel():
        return False
    if a.numel() % 8 == 0 and a.data_ptr() % 8 == 0 and b.data_ptr() % 8 == 0:
        a, b = a.view(torch.int64), b.view(torch.int64)
    return (a == b).all()


def _verdict(like: torch.Tensor, ok: bool) -> torch.Tensor:
    """``ok`` as a 0-dim bool tensor on ``like``'s device (a fill there, no copy)."""
    return torch.full((), ok, dtype=torch.bool, device=like.device)


def _all(like: torch.Tensor, verdicts: list) -> torch.Tensor:
    """The conjunction of ``verdicts`` (bools and 0-dim bool tensors on ``like``'s device)
    as one 0-dim bool tensor there; the host bools are decided here, the tensors on the
    device."""
    if not all(v for v in verdicts if isinstance(v, bool)):
        return _verdict(like, False)
    ts = [v for v in verdicts if not isinstance(v, bool)]
    return torch.stack(ts).all() if ts else _verdict(like, True)
