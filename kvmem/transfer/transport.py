"""The transport primitives: what an engine subclass implements, and nothing else.

Contract: :class:`Transport` names the ``_t_*`` methods through which a
:class:`~kvmem.transfer.engine.TransferEngine` reaches its transport (NIXL's agent, the
loopback fabric).  The engine calls them only after its own checks passed, so a primitive
checks nothing the engine checks; it moves bytes, loads peers and reports states.  The
prepared-list primitives are optional: their defaults refuse, and an engine without them
moves packed chunks only.
"""

from __future__ import annotations

import abc

import numpy as np

from kvmem.transfer.errors import TransferError
from kvmem.transfer.layout import BlockLayout
from kvmem.transfer.records import Registration, RemoteMemory


class Transport(abc.ABC):
    """The ``_t_*`` primitives of one transport (abstract unless said optional)."""

    @abc.abstractmethod
    def _t_register(self, reg: Registration) -> object: ...

    @abc.abstractmethod
    def _t_deregister(self, native) -> None: ...

    @abc.abstractmethod
    def _t_blob(self) -> bytes: ...

    @abc.abstractmethod
    def _t_load_peer(self, blob: bytes) -> str:
        """Load a peer's blob; return the peer name the transport read from it."""

    @abc.abstractmethod
    def _t_unload_peer(self, name: str) -> None: ...

    @abc.abstractmethod
    def _t_post(
        self,
        local: np.ndarray,
        lreg: Registration,
        remote: np.ndarray,
        rmem: RemoteMemory,
        notif: bytes,
    ) -> tuple[object, str]:
        """Post one write of paired ranges; return (native handle, initial state)."""

    @abc.abstractmethod
    def _t_state(self, native) -> str: ...

    @abc.abstractmethod
    def _t_release(self, native) -> None: ...

    @abc.abstractmethod
    def _t_send_notif(self, peer: str, msg: bytes) -> None: ...

    @abc.abstractmethod
    def _t_get_notifs(self) -> dict[str, list[bytes]]: ...

    @abc.abstractmethod
    def _t_close(self) -> None: ...

    # Prepared block lists (optional: an engine without them moves packed chunks only).
    def _t_prep(self, layout: BlockLayout, mem: str, device_id: int, peer: str | None) -> object:
        """Prepare every block of ``layout`` once (index ``plane * count + i``); ``peer``
        None: local.  Called only when :meth:`direct_refusal` found nothing."""
        raise TransferError(f"{type(self).__name__} has no prepared descriptor lists")

    def _t_prep_refusal(self, layout: BlockLayout) -> str | None:
        """The transport's own reason not to prepare ``layout`` (None: it can)."""
        return f"{type(self).__name__} has no prepared descriptor lists"

    def _t_unprep(self, native) -> None:
        pass

    def _t_post_blocks(
        self,
        op: str,
        local: object,
        lidx: np.ndarray,
        remote: object,
        ridx: np.ndarray,
        peer: str,
        notif: bytes,
    ) -> tuple[object, str]:
        raise TransferError(f"{type(self).__name__} has no prepared descriptor lists")
