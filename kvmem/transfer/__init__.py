"""Transfer registration: the :class:`TransferEngine` interface with the epoch guard
(:mod:`kvmem.transfer.base`) and the NIXL engine (:mod:`kvmem.transfer.nixl`; NIXL itself
is imported when a :class:`NixlEngine` is created, so ``import kvmem.transfer`` works
without it)."""

from kvmem.transfer.base import (
    BlockLayout, BlockTable, EngineClosedError, MetadataError, Registration, RemoteMemory, StaleEpochError,
    TransferEngine, TransferError, TransferHandle, TransferInFlightError,
)
from kvmem.transfer.nixl import NixlEngine

__all__ = [
    "TransferEngine", "NixlEngine", "Registration", "RemoteMemory", "TransferHandle",
    "StaleEpochError", "TransferInFlightError", "MetadataError", "TransferError",
    "EngineClosedError", "BlockLayout", "BlockTable",
]
