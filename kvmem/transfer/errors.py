"""Errors of kvmem.transfer, each saying what it means and what it leaves changed (nothing:
every error of an engine leaves it as it was).  Raised by :mod:`kvmem.transfer.engine` and
:mod:`kvmem.transfer.envelope`; the table is in docs/transfer.md (Errors)."""

from __future__ import annotations

from kvmem.errors import KVMemError


class StaleEpochError(KVMemError):
    """A write (or a metadata snapshot) was built from a peer's memory that this engine
    knows is gone: an older epoch, an older incarnation, or a closed registration.
    Nothing was posted; nothing changed."""

    def __init__(self, peer: str, key: str | None, have, newest, what: str = "post_write"):
        self.peer, self.key, self.have, self.newest = peer, key, have, newest
        where = f"{peer!r}" + (f" key {key!r}" if key is not None else "")
        super().__init__(
            f"{what}: stale metadata of {where}: built from {have}, newest known is {newest}; "
            "nothing was posted (ask the peer for its current metadata)"
        )


class TransferInFlightError(KVMemError):
    """Writes are still in flight (PROC) where the operation needs none.  Nothing changed."""

    def __init__(self, what: str, count: int, detail: str = ""):
        self.count = count
        super().__init__(
            f"{what}: {count} posted write(s) still in flight{detail}; "
            "poll them to DONE/ERR (engine.drain(timeout)) first"
        )


class MetadataError(KVMemError, ValueError):
    """Bytes given to add_peer are not a usable metadata snapshot.  Nothing changed; the
    transport never saw them."""


class TransferError(KVMemError):
    """The transport refused or failed an operation kvmem had validated."""


class EngineClosedError(KVMemError):
    """The engine was closed."""
