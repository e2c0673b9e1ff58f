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
"""

from __future__ import annotations

import ctypes
import ctypes.util

import torch

from kvmem.spec import KVSpec

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
_libc.memcmp.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
_libc.memcmp.restype = ctypes.c_int

_PERIOD = 16 << 20  # random bytes the per-request bases are drawn from


class Synth:
    """The tape for requests of at most ``max_tokens`` tokens of ``spec``."""

    def __init__(self, spec: KVSpec, max_tokens: int, seed: int = 0):
        self.spec = spec
        self.max_tokens = max_tokens
        self.rows = [r for r in (spec.k_token_bytes, spec.v_token_bytes) if r]
        longest = max(self.rows) * (-(-max_tokens // spec.page_size) * spec.page_size)
        gen = torch.Generator().manual_seed(seed)
        self.tape = torch.randint(0, 256, (_PERIOD + longest,), generator=gen, dtype=torch.uint8)

    def _base(self, rid: int, layer: int, kv: int) -> int:
        x = (rid * 0x9E3779B97F4A7C15 + layer * 0xBF58476D1CE4E5B9 + kv * 0x94D049BB133111EB)
        x &= (1 << 64) - 1
        x ^= x >> 31
        return (x % _PERIOD) & ~63  # 64-byte aligned slices

    def _slices(self, rid: int, first_page: int, last_page: int):
        ps = self.spec.page_size
        if not 0 <= first_page <= last_page or last_page * ps > -(-self.max_tokens // ps) * ps:
            raise ValueError(f"synth: page range [{first_page}, {last_page}) outside a "
                             f"{self.max_tokens}-token request")
        t0, t1 = first_page * ps, last_page * ps
        for kv, row in enumerate(self.rows):
            for l in range(self.spec.num_layers):
                b = self._base(rid, l, kv)
                yield self.tape[b + t0 * row: b + t1 * row]

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
        for buf, piece in zip(bufs, self._slices(rid, first_page, last_page)):
            rows = buf.view(buf.shape[0], -1).view(torch.uint8)  # [num_pages, page bytes]
            src = piece.view(n, -1)
            if rows.device.type == "cpu":  # NumPy's row assignment: a memcpy per row
                rows.numpy()[idx] = src.numpy()
            else:
                rows.index_copy_(0, idx, src.to(rows.device))

    def verify(self, rid: int, first_page: int, last_page: int, data: torch.Tensor) -> bool:
        """True when ``data`` (uint8, packed) is exactly what :meth:`chunk` gives."""
        off = 0
        for s in self._slices(rid, first_page, last_page):
            n = s.numel()
            if off + n > data.numel() or not _equal(data[off:off + n], s):
                return False
            off += n
        return off == data.numel()


    def verify_pages(self, pool, rid: int, first_page: int, last_page: int, pages) -> bool:
        """True when ``pool``'s ``pages`` (int64 [last - first], the pages holding the
        request's pages ``[first, last)``) hold exactly what :meth:`fill` writes there:
        the check of a chunk written straight into the pool, in place.  One comparison per
        layer, K|V and run of consecutive page ids (a run is one range of a layer)."""
        ids = pages.tolist() if hasattr(pages, "tolist") else list(pages)
        n = last_page - first_page
        if len(ids) != n:
            return False
        runs, i = [], 0  # (first index, first page id, length)
        while i < n:
            j = i + 1
            while j < n and ids[j] == ids[j - 1] + 1:
                j += 1
            runs.append((i, ids[i], j - i))
            i = j
        bufs = pool.k_buffer + pool.v_buffer
        for buf, piece in zip(bufs, self._slices(rid, first_page, last_page)):
            rows = buf.view(buf.shape[0], -1).view(torch.uint8)  # [num_pages, page bytes]
            pb = rows.shape[1]
            for i, p, k in runs:
                if not _equal(rows[p:p + k].reshape(-1), piece[i * pb:(i + k) * pb]):
                    return False
        return True


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """torch.equal of two uint8 ranges.  On the CPU: libc's memcmp (9.3 GB/s vs 6.1 GB/s
    for torch.equal of int64 views, 1 MiB ranges out of cache, 2-core CPU); elsewhere
    compared as int64 words when aligned (several times faster than byte-wise)."""
    if a.device.type == "cpu" and b.device.type == "cpu" and a.is_contiguous() and b.is_contiguous():
        return a.nbytes == b.nbytes and _libc.memcmp(a.data_ptr(), b.data_ptr(), a.nbytes) == 0
    if a.numel() % 8 == 0 and a.data_ptr() % 8 == 0 and b.data_ptr() % 8 == 0:
        return torch.equal(a.view(torch.int64), b.view(torch.int64))
    return torch.equal(a, b)
