"""The values kvmem.transfer hands out: a local :class:`Registration`, a peer's
:class:`RemoteMemory`, a posted write's :class:`TransferHandle`, a prepared
:class:`BlockTable`; and :func:`mem_of`, the memory kind of a device.  The engine
(:mod:`kvmem.transfer.engine`) makes and checks them."""

from __future__ import annotations

import enum

from dataclasses import dataclass, field

import numpy as np
import torch

from kvmem.transfer.layout import BlockLayout


@dataclass(frozen=True)
class Registration:
    """A live local registration.  ``regions``: ``((addr, nbytes), ...)``."""

    key: str
    epoch: int
    regions: tuple
    mem: str  # "DRAM" | "VRAM"
    device_id: int  # 0 for DRAM, the CUDA index for VRAM
    layout: BlockLayout | None = None  # the blocks inside (a pool's pages), if given


@dataclass(frozen=True)
class RemoteMemory:
    """One registration of a peer, as learned from its metadata (``add_peer``).

    ``live`` is False for a tombstone (the peer deregistered ``key`` at ``epoch``); its
    ``regions`` are empty and every write to it is refused as stale.
    """

    peer: str
    key: str
    epoch: int
    regions: tuple
    mem: str
    device_id: int
    incarnation: int
    live: bool = True
    layout: BlockLayout | None = None

    @property
    def order(self) -> tuple:
        """Total order of a (peer, key)'s states: a tombstone closes its epoch."""
        return (self.incarnation, self.epoch, 0 if self.live else 1)

    def describe(self) -> str:
        closed = "" if self.live else " (closed)"
        return f"epoch {self.epoch}{closed}, incarnation {self.incarnation}"


class XferState(enum.StrEnum):
    """A posted transfer's state, as NIXL names it (a ``str``: ``XferState.DONE == "DONE"``)."""

    PROC = "PROC"  # posted, not finished
    DONE = "DONE"  # the bytes landed and the notification was sent
    ERR = "ERR"  # failed (``TransferHandle.error`` says why); its bytes may be partial


@dataclass
class TransferHandle:
    """A posted write.  ``state`` is the last state poll() saw; ``error`` says why ERR."""

    id: int
    peer: str
    remote_key: str
    local_keys: tuple
    nbytes: int
    notif: bytes
    state: XferState = XferState.PROC
    error: str | None = None
    released: bool = False
    native: object = field(default=None, repr=False)
    tables: tuple = ()  # ids of the prepared tables a post_blocks handle uses
    op: str = "WRITE"


@dataclass
class BlockTable:
    """A descriptor list prepared once (NIXL ``prep_xfer_dlist``) for every block of a
    layout, local (``key`` of this engine) or remote (``remote``: a peer's RemoteMemory).
    :meth:`TransferEngine.post_blocks` then names blocks by index.  A local table dies with
    its registration (deregister releases it); a remote one is refused as stale once the
    engine learns newer metadata of its (peer, key)."""

    id: int
    key: str
    epoch: int
    layout: BlockLayout
    remote: RemoteMemory | None = None
    nbytes: np.ndarray = field(
        default_factory=lambda: np.zeros(0, np.int64), repr=False
    )  # bytes of each plane's blocks
    native: object = field(default=None, repr=False)
    released: bool = False


def mem_of(device) -> tuple[str, int]:
    """``("DRAM", 0)`` for the CPU, ``("VRAM", index)`` for a CUDA device."""
    dev = torch.device(device)
    if dev.type == "cpu":
        return "DRAM", 0
    if dev.type == "cuda":
        return "VRAM", dev.index if dev.index is not None else torch.cuda.current_device()
    raise ValueError(f"register: unsupported device {dev} (cpu or cuda)")
