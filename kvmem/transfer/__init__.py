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

from __future__ import annotations

from typing import TYPE_CHECKING

from kvmem.lazy import lazy_names

if TYPE_CHECKING:
    from kvmem.transfer.engine import TransferEngine
    from kvmem.transfer.errors import (
        EngineClosedError,
        MetadataError,
        StaleEpochError,
        TransferError,
        TransferInFlightError,
    )
    from kvmem.transfer.layout import BlockLayout
    from kvmem.transfer.loopback import LoopbackEngine
    from kvmem.transfer.loopback_fabric import LoopbackFabric
    from kvmem.transfer.nixl import NixlEngine
    from kvmem.transfer.records import (
        BlockTable,
        Registration,
        RemoteMemory,
        TransferHandle,
        XferState,
    )

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

# Where each name above is defined: the module is imported when the name is first asked
# for (PEP 562), so that importing one submodule (the sglang adapter imports
# kvmem.transfer.runs) does not load the engines.
_HOME = {
    "TransferEngine": "kvmem.transfer.engine",
    "NixlEngine": "kvmem.transfer.nixl",
    "LoopbackEngine": "kvmem.transfer.loopback",
    "LoopbackFabric": "kvmem.transfer.loopback_fabric",
    "Registration": "kvmem.transfer.records",
    "RemoteMemory": "kvmem.transfer.records",
    "TransferHandle": "kvmem.transfer.records",
    "XferState": "kvmem.transfer.records",
    "StaleEpochError": "kvmem.transfer.errors",
    "TransferInFlightError": "kvmem.transfer.errors",
    "MetadataError": "kvmem.transfer.errors",
    "TransferError": "kvmem.transfer.errors",
    "EngineClosedError": "kvmem.transfer.errors",
    "BlockLayout": "kvmem.transfer.layout",
    "BlockTable": "kvmem.transfer.records",
}

if not TYPE_CHECKING:  # for mypy the names are the imports above, and no others
    __getattr__, __dir__ = lazy_names(__name__, _HOME)
