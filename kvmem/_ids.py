"""Page ids from a caller: the one coercion every public function that takes them uses
(``pack_pages`` / ``unpack_pages`` / ``pack_buffers`` / ``unpack_buffers`` through
``kvmem.kernels.pack``, and ``PageAllocator.free``; the one exception: on the CPU a
``free`` of a short list of Python ints is checked in plain Python first,
``kvmem.kernels.alloc.free_pages_list``, and anything else it meets comes here).

What is accepted, and what comes out::

    torch tensor   1-D, an integer dtype, on the target device (never moved: a tensor on
                   another device is refused); int32 / int64 kept, other integer dtypes
                   widened to int64; a strided tensor is made contiguous (the kernels
                   read ids at stride 1)
    NumPy array    1-D, integer dtype ('i' or 'u'); CPU target: a zero-copy view when it
                   is already contiguous native int32 / int64; CUDA target: copied into
                   pinned host memory, then to the device with a non-blocking copy
    DLPack object  (CuPy, ...) taken zero-copy with torch.from_dlpack, then as a tensor
    sequence       list / tuple / range of Python ints (or anything with __index__, such
                   as NumPy integer scalars); CUDA target: built in pinned host memory
                   and copied with a non-blocking copy

    result : int32 | int64 [n], contiguous, on the target device

Refused with ValueError, naming the value: bool and floating-point ids (``True``,
``1.7``, bool / float / complex tensors and arrays), strings, nested or non-1-D input,
ids outside int64, input on another device.  Range (``[0, num_pages)``) is not checked
here: that is the caller's ``check`` (it costs a host sync on CUDA).

Host syncs.  None on these paths: pinned memory plus ``non_blocking=True`` lets the host
return before the copy runs, and PyTorch's pinned-memory cache keeps the staging buffer
until the copy has finished.  The copy is queued on the target device's current stream,
so work queued after it on that stream sees the ids.  Building the host tensor of a long
Python list is CPU work, O(n).

Beside it, :func:`as_int`: one integer argument (a count, a size), by the same rule (bool
refused).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import numpy as np
import torch

_KEPT = (torch.int32, torch.int64)
_NP_KEPT = (np.dtype(np.int32), np.dtype(np.int64))
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1


def as_page_ids(
    page_ids,
    device: torch.device,
    *,
    what: str = "page_ids",
    where: str = "the KV buffers",
    int64: bool = False,
) -> torch.Tensor:
    """Coerce ``page_ids`` to ``int32 | int64 [n]`` (``int64 [n]`` with ``int64=True``),
    contiguous, on ``device`` (module docstring: what is accepted, which copies happen).

    ``what`` names the argument in messages (``"page_ids"``, ``"free: pages"``) and
    ``where`` the thing whose device the ids must be on.  Raises ValueError, and never
    writes to the caller's object."""
    if not isinstance(device, torch.device):
        device = torch.device(device)
    if isinstance(page_ids, torch.Tensor):
        ids = page_ids
        if (
            ids.dtype is torch.int64
            and ids.dim() == 1
            and ids.device == device
            and ids.is_contiguous()
        ):
            return ids  # the common case, checked in one line
        return _from_tensor(ids, device, what, where, int64)
    if isinstance(page_ids, np.ndarray):
        return _from_numpy(page_ids, device, what, int64)
    if hasattr(page_ids, "__dlpack__") and not isinstance(page_ids, (str, bytes)):
        try:
            ids = torch.from_dlpack(page_ids)  # CuPy and others, zero-copy
        except (TypeError, ValueError, RuntimeError, BufferError) as e:
            raise ValueError(
                f"{what}: cannot take a {type(page_ids).__name__} through DLPack ({e})"
            ) from None
        return _from_tensor(ids, device, what, where, int64)
    if isinstance(page_ids, Sequence) and not isinstance(page_ids, (str, bytes)):
        return _from_sequence(page_ids, device, what)
    raise ValueError(
        f"{what} must be a 1-D tensor, array or sequence of integer page ids, "
        f"got {type(page_ids).__name__} {page_ids!r:.80}"
    )


def _from_tensor(
    ids: torch.Tensor, device: torch.device, what: str, where: str, int64: bool
) -> torch.Tensor:
    if ids.dtype is torch.bool or ids.is_floating_point() or ids.is_complex():
        raise ValueError(f"{what} must be an integer tensor, int32 or int64, got {ids.dtype}")
    if ids.dim() != 1:
        raise ValueError(f"{what} must be 1-D, got shape {tuple(ids.shape)}")
    if ids.device != device:
        raise ValueError(f"{what} are on {ids.device}, {where} on {device}")
    if ids.dtype not in _KEPT or (int64 and ids.dtype is not torch.int64):
        ids = ids.to(torch.int64)  # a new, contiguous tensor
    return ids.contiguous()


def _from_numpy(arr: np.ndarray, device: torch.device, what: str, int64: bool) -> torch.Tensor:
    if arr.dtype.kind not in "iu":
        raise ValueError(
            f"{what} must be an integer array, got dtype {arr.dtype}"
            + (f" {arr.tolist()!r:.80}" if arr.dtype.kind in "bf" else "")
        )
    if arr.ndim != 1:
        raise ValueError(f"{what} must be 1-D, got shape {arr.shape}")
    if arr.dtype.kind == "u" and arr.size and int(arr.max()) > _INT64_MAX:
        raise ValueError(f"{what}: page id {int(arr.max())} does not fit in int64")
    if arr.dtype not in _NP_KEPT or (int64 and arr.dtype != np.int64):
        arr = arr.astype(np.int64)  # native byte order, contiguous, a copy
    elif not arr.flags.c_contiguous or not arr.flags.writeable:
        arr = arr.copy()  # torch.from_numpy needs a writable array; strided ids are copied
    host = torch.from_numpy(arr)  # zero-copy view of arr
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host if device.type == "cpu" else host.to(device)


def _from_sequence(seq, device: torch.device, what: str) -> torch.Tensor:
    ids: range | list[int]
    if isinstance(seq, range):
        ids = seq
    else:
        ids = [x if type(x) is int else _one_id(x, what) for x in seq]
    try:
        host = torch.tensor(ids, dtype=torch.int64, pin_memory=device.type == "cuda")
    except (OverflowError, RuntimeError, ValueError):  # torch raises any of these
        bad = next((x for x in ids if not _INT64_MIN <= x <= _INT64_MAX), None)
        if bad is None:
            raise
        raise ValueError(f"{what}: page id {bad} does not fit in int64") from None
    if device.type == "cpu":
        return host
    return host.to(device, non_blocking=device.type == "cuda")


def _one_id(x, what: str) -> int:
    """A page id that is not a plain int: anything with __index__ but a bool."""
    if isinstance(x, (bool, np.bool_)) or (
        isinstance(x, torch.Tensor)
        and (x.dtype is torch.bool or x.is_floating_point() or x.is_complex())
    ):
        raise ValueError(f"{what} must be integers, got {x!r} (a {type(x).__name__})")
    try:
        return operator.index(x)
    except TypeError:
        raise ValueError(f"{what} must be integers, got {x!r:.80} (a {type(x).__name__})") from None


def as_int(name: str, v) -> int:
    """An integer argument ``name`` (a count, a size) from a caller: anything with
    __index__ but a bool; ValueError naming it otherwise."""
    if isinstance(v, bool):
        raise ValueError(f"{name} must be an integer, got {v!r}")
    try:
        return operator.index(v)
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {v!r}") from None
