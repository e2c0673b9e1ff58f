"""Transfer registration: the :class:`TransferEngine` interface with the epoch guard
(:mod:`kvmem.transfer.engine`), the NIXL engine (:mod:`kvmem.transfer.nixl`; NIXL itself
is imported when a :class:`NixlEngine` is created, so ``import kvmem.transfer`` works
without it) and the loopback engine between agents of one process
(:mod:`kvmem.transfer.loopback`).

One job a module: ``engine`` (the rules), ``transport`` (the primitives a subclass
implements), ``inflight`` (handles in flight), ``tables`` (prepared block tables),
``nixl`` (NIXL's agent API), ``loopback`` (one process's agents, host memory),
``loopback_fabric`` (their wire), ``errors``, ``ranges`` (range checks), ``runs`` (page
runs merged into descriptors), ``layout`` (block layouts), ``records`` (the values an
engine hands out), ``envelope`` (the metadata envelope), ``nixl_exit`` (ending a process
that loaded NIXL).  The rules themselves: docs/transfer.md.
"""

from kvmem.transfer.engine import TransferEngine
from kvmem.transfer.errors import (
    EngineClosedError,
    MetadataError,
    StaleEpochError,
    TransferError,
    TransferInFlightError,
)
from kvmem.transfer.layout import BlockLayout
from kvmem.transfer.records import BlockTable, Registration, RemoteMemory, TransferHandle, XferState
from kvmem.transfer.loopback import LoopbackEngine
from kvmem.transfer.loopback_fabric import LoopbackFabric
from kvmem.transfer.nixl import NixlEngine

__all__ = [
    "TransferEngine",
    "NixlEngine",
    "LoopbackEngine",
    "LoopbackFabric",
    "Registration",
    "RemoteMemory",
    "TransferHandle",
    "XferState",
    "StaleEpochError",
    "TransferInFlightError",
    "MetadataError",
    "TransferError",
    "EngineClosedError",
    "BlockLayout",
    "BlockTable",
]
