"""What every pack/unpack call checks, and the copy plan both paths run: a selection of
buffers, layers and heads validated and turned into copy geometry (cached per device),
page ids and chunks validated, and the per-device error flags of unchecked CUDA calls.
Layouts: ``kvmem.kernels.pack``."""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Sequence

import torch
import triton

# Units of one copy element, widest first.  4 bytes is enough for 16-byte vector accesses
# (ld/st.global.v4.b32) when addresses and sizes are 16-byte aligned.
_UNITS = {4: torch.int32, 2: torch.int16, 1: torch.uint8}
# Elements one program moves per loop iteration.  2048 x 4 B = 8 KiB: with 4 warps each
# thread has four 16-byte loads in flight.  A guess, not yet measured on an H200.
_TILE = 2048


def _as_pages(buf: torch.Tensor, page_size: int | None, what: str) -> torch.Tensor:
    """View a layer buffer as ``[num_pages, page_size, H, D]``."""
    if not isinstance(buf, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(buf).__name__}")
    if buf.dim() == 4:
        if page_size is not None and buf.shape[1] != page_size:
            raise ValueError(f"{what} has page_size {buf.shape[1]}, expected {page_size}")
        return buf
    if buf.dim() == 3:
        if page_size is None:
            raise ValueError(f"{what} is [num_tokens, H, D]: pass page_size=")
        if buf.shape[0] % page_size:
            raise ValueError(
                f"{what} has {buf.shape[0]} token rows, not a multiple of page_size {page_size}"
            )
        return buf.unflatten(0, (buf.shape[0] // page_size, page_size))
    raise ValueError(
        f"{what} must be [num_pages, page_size, H, D] or [num_tokens, H, D], "
        f"got shape {tuple(buf.shape)}"
    )


@dataclass(frozen=True)
class _Kind:
    """How to copy one page of one layer of K (or V): ROWS rows of SEG units."""

    rows: int
    nh: int
    seg: int
    page_stride: int
    tok_stride: int
    head_stride: int
    head0: int
    block_r: int
    block_c: int


@dataclass(frozen=True)
class _Plan:
    """Geometry of one (buffers, layers, heads) selection.  Holds no tensor views, so a
    cached plan never keeps a pool's memory alive."""

    device: torch.device
    unit_bytes: int  # bytes of one copy element of the Triton path
    num_pages: int
    page_size: int
    heads: tuple[int, int]
    layers: tuple[int, ...]  # selected layer indices, chunk order
    has_v: bool
    k: _Kind
    v: _Kind | None
    align: int  # every layer offset is a multiple of `align` units
    layer_offs: torch.Tensor  # int64 [len(layers) * (1 + has_v)], units from layer 0's start
    k_page_bytes: int  # bytes of one page of one selected layer in the chunk
    v_page_bytes: int
    # CUDA: [event] recorded after layer_offs' non-blocking copy, until a launch sees it
    # complete; launches before that make their stream wait on it (the copy was queued
    # on whichever stream was current when the plan was made).  Empty otherwise.
    ready: list = field(default_factory=list, compare=False, repr=False)
    # The Triton launch's keyword arguments per direction ({pack: dict}), made by the
    # first launch in that direction (kvmem.kernels.pack.triton._launch_args), so later
    # launches build nothing.  A plan is immutable otherwise.
    launch: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_copies(self) -> int:
        return len(self.layers) * (2 if self.has_v else 1)

    def nbytes(self, n: int) -> int:
        return n * len(self.layers) * (self.k_page_bytes + self.v_page_bytes)


def _kind(view: torch.Tensor, unit: int, h0: int, nh: int) -> _Kind:
    """Copy geometry of the head slice [h0, h0+nh) of a [P, ps, H, D] view, in units."""
    item = view.element_size()
    ps, d = view.shape[1], view.shape[3]
    page_stride, tok_stride, head_stride = (s * item // unit for s in view.stride()[:3])
    seg = d * item // unit
    rows_per_tok = nh
    if nh == 1 or head_stride == seg:  # the token's selected heads are back to back: one row
        seg, rows_per_tok = seg * nh, 1
        if ps == 1 or tok_stride == seg:  # and the page's tokens too: one row per page
            seg, ps = seg * ps, 1
    rows = ps * rows_per_tok
    block_c = min(triton.next_power_of_2(seg), _TILE)
    block_r = max(1, min(triton.next_power_of_2(rows), _TILE // block_c))
    return _Kind(
        rows,
        rows_per_tok,
        seg,
        page_stride,
        tok_stride,
        head_stride,
        h0 * view.stride(2) * item // unit,
        block_r,
        block_c,
    )


def _check_layers(layers, num_layers: int) -> tuple[int, ...]:
    """``layers`` (None: all; else a sequence of distinct layer indices, a CPU tensor
    included) as a tuple.  A tensor on another device is refused: reading its values on
    the host would be a hidden sync (CUDA) on every call."""
    if layers is None:
        return tuple(range(num_layers))
    if isinstance(layers, torch.Tensor):
        if layers.device.type != "cpu":
            raise ValueError(
                f"layers is a tensor on {layers.device}: reading it would cost a host sync "
                "on every call; pass a list, a tuple or a CPU tensor of layer indices"
            )
        layers = layers.tolist()
    try:
        out = tuple(layers)
    except TypeError:
        raise ValueError(f"layers must be a sequence of layer indices, got {layers!r}") from None
    if not out:
        raise ValueError("layers is empty: select at least one layer")
    for l in out:
        if isinstance(l, bool) or not isinstance(l, int) or not 0 <= l < num_layers:
            raise ValueError(f"layers: {l!r} is not a layer index in [0, {num_layers})")
    if len(set(out)) != len(out):
        raise ValueError(f"layers lists a layer twice: {list(out)}")
    return out


def _check_heads(heads, num_heads: int) -> tuple[int, int]:
    if heads is None:
        return (0, num_heads)
    try:
        h0, h1 = heads
    except (TypeError, ValueError):
        raise ValueError(f"heads must be a (start, stop) pair, got {heads!r}") from None
    for h in (h0, h1):
        if isinstance(h, bool) or not isinstance(h, int):
            raise ValueError(f"heads must be a pair of ints, got {heads!r}")
    if not 0 <= h0 < h1 <= num_heads:
        raise ValueError(f"heads=({h0}, {h1}) is not a non-empty range within [0, {num_heads}]")
    return (h0, h1)


def _uniform(views: Sequence[torch.Tensor], what: str) -> None:
    first = views[0]
    if first.stride(-1) != 1:
        raise ValueError(
            f"{what}[0]: the head_dim axis must be contiguous (stride 1), "
            f"got strides {first.stride()}"
        )
    for i, v in enumerate(views[1:], 1):
        if (v.shape, v.stride(), v.dtype, v.device) != (
            first.shape,
            first.stride(),
            first.dtype,
            first.device,
        ):
            raise ValueError(
                f"{what}[{i}] differs from {what}[0] in shape, strides, dtype or device: "
                f"{tuple(v.shape)} {v.stride()} {v.dtype} {v.device} vs "
                f"{tuple(first.shape)} {first.stride()} {first.dtype} {first.device}"
            )


def _buffers(buffers, what: str) -> list:
    if buffers is None:
        return []
    if isinstance(buffers, torch.Tensor):
        raise TypeError(f"{what} must be a list of per-layer tensors, got one tensor")
    return list(buffers)


# The plan cache, one LRU per device, shared by every thread under _LOCK (it is
# thread-safe; a plan is immutable once made).  A miss costs a plan (host work) and one
# non-blocking copy of the layer offsets; a hit costs the key.  Sized so that normal use
# never evicts: sglang packs one layer at a time, so an 80-layer model asks for 80
# single-layer plans per head range, and two pools (or K/V layouts) x 80 layers x 4 head
# ranges = 640 < 1024.  Each entry holds one small int64 tensor on its device.  (A
# size chosen from that count, not measured.)
_PLAN_CACHE_SIZE = 1024
_PLANS: dict[torch.device, OrderedDict] = {}
_LOCK = threading.Lock()


def make_plan(k_buffers, v_buffers, page_size, layers, heads) -> _Plan:
    """Validate a selection and return its copy plan, cached by device, addresses and
    shapes (thread-safe; see ``_PLAN_CACHE_SIZE``).  On CUDA a new plan's layer offsets
    go to the device with a non-blocking copy from pinned memory (no host sync)."""
    k_buffers, v_buffers = _buffers(k_buffers, "k_buffers"), _buffers(v_buffers, "v_buffers")
    if not k_buffers:
        raise ValueError("k_buffers is empty")
    for what, bufs in (("k_buffers", k_buffers), ("v_buffers", v_buffers)):
        for i, b in enumerate(bufs):
            if not isinstance(b, torch.Tensor):
                raise TypeError(f"{what}[{i}] must be a torch.Tensor, got {type(b).__name__}")
    layers = _check_layers(layers, len(k_buffers))
    if k_buffers[0].dim() not in (3, 4):
        raise ValueError(
            "k_buffers[0] must be [num_pages, page_size, H, D] or [num_tokens, H, D], "
            f"got shape {tuple(k_buffers[0].shape)}"
        )
    heads = _check_heads(heads, k_buffers[0].shape[-2])
    # Every buffer's address, shape and strides: what tells a changed buffer from the one
    # planned, O(layers) on every call (a list comprehension, a quarter faster than a
    # generator: docs/kernels.md, "Measured on the CPU").
    key = (
        tuple([(b.data_ptr(), b.shape, b.stride()) for b in k_buffers]),
        tuple([(b.data_ptr(), b.shape, b.stride()) for b in v_buffers]),
        k_buffers[0].dtype,
        k_buffers[0].device,
        page_size,
        layers,
        heads,
    )
    device = k_buffers[0].device
    with _LOCK:
        cache = _PLANS.setdefault(device, OrderedDict())
        plan = cache.get(key)
        if plan is not None:
            cache.move_to_end(key)
            return plan
    plan = _make_plan(k_buffers, v_buffers, page_size, layers, heads)  # outside the lock
    with _LOCK:
        plan = cache.setdefault(key, plan)  # a plan another thread made first wins
        cache.move_to_end(key)
        if len(cache) > _PLAN_CACHE_SIZE:
            cache.popitem(last=False)
    return plan


def _make_plan(k_buffers, v_buffers, page_size, layers, heads) -> _Plan:
    k_views = [_as_pages(b, page_size, f"k_buffers[{i}]") for i, b in enumerate(k_buffers)]
    v_views = [_as_pages(b, page_size, f"v_buffers[{i}]") for i, b in enumerate(v_buffers)]
    _uniform(k_views, "k_buffers")
    k0 = k_views[0]
    num_pages, ps, num_heads, _ = k0.shape
    if v_views:
        if len(v_views) != len(k_views):
            raise ValueError(f"{len(k_views)} K layers but {len(v_views)} V layers")
        _uniform(v_views, "v_buffers")
        v0 = v_views[0]
        if v0.shape[:3] != k0.shape[:3] or v0.dtype != k0.dtype or v0.device != k0.device:
            raise ValueError(
                f"v_buffers[0] {tuple(v0.shape)} {v0.dtype} {v0.device} does not match "
                f"k_buffers[0] {tuple(k0.shape)} {k0.dtype} {k0.device} in pages, page_size, "
                "heads, dtype or device"
            )
    sel = layers
    h0, h1 = heads
    sel_views = [k_views[l] for l in sel] + [v_views[l] for l in sel if v_views]
    item = k0.element_size()
    # The widest unit dividing every address, stride, head offset and row size.
    g = 0
    for v in sel_views:
        g = math.gcd(g, v.data_ptr())
    for v in (k0,) + ((v_views[0],) if v_views else ()):
        for q in [s * item for s in v.stride()[:3]] + [h0 * v.stride(2) * item, v.shape[3] * item]:
            g = math.gcd(g, q)
    unit = next(u for u in _UNITS if g % u == 0)
    anchor = sel_views[0].data_ptr()
    offs_bytes = [v.data_ptr() - anchor for v in sel_views]
    layer_offs, ready = _to_device([o // unit for o in offs_bytes], k0.device)
    return _Plan(
        device=k0.device,
        unit_bytes=unit,
        num_pages=num_pages,
        page_size=ps,
        heads=(h0, h1),
        layers=sel,
        has_v=bool(v_views),
        k=_kind(k0, unit, h0, h1 - h0),
        v=_kind(v_views[0], unit, h0, h1 - h0) if v_views else None,
        align=16 // unit if all(o % 16 == 0 for o in offs_bytes) else 1,
        layer_offs=layer_offs,
        ready=ready,
        k_page_bytes=ps * (h1 - h0) * k0.shape[3] * item,
        v_page_bytes=ps * (h1 - h0) * v_views[0].shape[3] * item if v_views else 0,
    )


def _to_device(values: list[int], device: torch.device) -> tuple[torch.Tensor, list]:
    """(int64 [len(values)] on ``device``, ``_Plan.ready``).  CUDA: from pinned memory
    with a non-blocking copy on the device's current stream and an event recorded after
    it (no host sync; PyTorch's pinned-memory cache keeps the staging buffer until the
    copy is done)."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=torch.int64).to(device), []
    host = torch.tensor(values, dtype=torch.int64, pin_memory=True)
    with torch.cuda.device(device):
        out = host.to(device, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
    return out, [event]


def _wait_ready(plan: _Plan) -> None:
    """Order the current stream after the copy of ``plan.layer_offs`` (CUDA; a no-op
    once a launch has seen that copy complete).  Call under the plan's device guard."""
    pending = plan.ready
    event = next(iter(pending), None)  # another thread may clear it: read it once
    if event is None:
        return
    if event.query():  # done: no launch needs to wait any more
        pending.clear()
    else:
        torch.cuda.current_stream().wait_event(event)


# Device-side error flags of unchecked (check=False) CUDA calls, one per device:
# int64 [flag, bad page id].  Raised by the next checked call on that device.  Made
# once per device under _LOCK (two threads must not each make one and lose a flag).
_ERR_FLAGS: dict[torch.device, torch.Tensor] = {}


def _err_flag(device: torch.device) -> torch.Tensor:
    flag = _ERR_FLAGS.get(device)
    if flag is None:
        with _LOCK:
            flag = _ERR_FLAGS.get(device)
            if flag is None:
                flag = _ERR_FLAGS[device] = torch.zeros(2, dtype=torch.int64, device=device)
    return flag


def _validate_page_ids(page_ids: torch.Tensor, num_pages: int, *, unique: bool, what: str) -> None:
    """Raise ValueError for ids outside [0, num_pages) (and, for unpack, ids listed twice).
    One host sync on CUDA; also raises what an earlier unchecked call flagged."""
    flag = _ERR_FLAGS.get(page_ids.device)
    stats = [page_ids.min(), page_ids.max()] if page_ids.numel() else []
    if unique and page_ids.numel() > 1:
        srt = torch.sort(page_ids).values
        stats.append((srt[1:] == srt[:-1]).any().to(page_ids.dtype))
    if flag is not None:
        stats += [flag[0].to(page_ids.dtype), flag[1].to(page_ids.dtype)]
    if not stats:
        return
    values = torch.stack(stats).tolist()  # the one host sync
    if flag is not None and values[-2]:
        bad = values[-1]
        flag.zero_()
        raise ValueError(
            f"an earlier unchecked (check=False) pack/unpack on {page_ids.device} was given "
            f"page id {bad}, outside [0, {num_pages}); its pages were skipped"
        )
    if page_ids.numel():
        lo, hi = values[0], values[1]
        if lo < 0 or hi >= num_pages:
            bad = lo if lo < 0 else hi
            raise ValueError(f"{what}: page id {bad} is outside [0, {num_pages})")
        if unique and page_ids.numel() > 1 and values[2]:
            raise ValueError(f"{what}: page_ids lists a page twice; unpack needs distinct pages")


def _check_chunk(buf: torch.Tensor, nbytes: int, device: torch.device, what: str) -> None:
    if not isinstance(buf, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(buf).__name__}")
    if buf.dtype != torch.uint8:
        raise ValueError(f"{what} must be uint8, got {buf.dtype}")
    if buf.dim() != 1 or not buf.is_contiguous():
        raise ValueError(
            f"{what} must be a contiguous 1-D tensor, got shape "
            f"{tuple(buf.shape)} strides {buf.stride()}"
        )
    if buf.device != device:
        raise ValueError(f"{what} is on {buf.device}, the KV buffers on {device}")
    if buf.numel() != nbytes:
        raise ValueError(f"{what} has {buf.numel()} bytes, the chunk needs {nbytes}")
