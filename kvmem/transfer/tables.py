"""Prepared block tables: a registration's blocks prepared once, then moved by index.

Contract: :class:`BlockTables` decides whether a layout can be prepared
(:meth:`BlockTables.direct_refusal`), prepares a local or a peer's table, frees it
(refused while a write posted from it is in flight), and posts block writes and reads
between two tables after the same checks a write gets (the epoch rule, the local
registration live at its epoch, indices and sizes), nothing changed on error.  The
engine's state, the epoch rule and the handles belong to
:class:`~kvmem.transfer.engine.TransferEngine`, which this class is a base of.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from kvmem.transfer.errors import StaleEpochError, TransferError, TransferInFlightError
from kvmem.transfer.layout import MAX_TABLE_BLOCKS, BlockLayout
from kvmem.transfer.records import (
    BlockTable,
    Registration,
    RemoteMemory,
    TransferHandle,
    XferState,
)
from kvmem.transfer.transport import Transport


class BlockTables(Transport):
    """Prepare, free and post between block tables."""

    if TYPE_CHECKING:  # what TransferEngine (kvmem/transfer/engine.py) provides
        name: str
        _regs: dict[str, Registration]
        _handles: dict[int, TransferHandle]
        _tables: dict[int, BlockTable]
        _next_id: int

        def _check_open(self, what: str) -> None: ...

        def _refresh(self, h: TransferHandle) -> XferState: ...

        def check_fresh(self, remote: RemoteMemory, what: str = ...) -> None: ...

    def direct_refusal(self, layout: BlockLayout | None) -> str | None:
        """Why this engine cannot prepare a block table of ``layout`` (so neither direct
        writes nor pull reads of its blocks are possible, and only packed transfers can
        move them), or None when it can.  The PD layer asks this before choosing direct
        or pull: ``engine.direct_refusal(engine.registrations()["kv"].layout)`` for its
        own pool, ``engine.direct_refusal(engine.remote(peer, "kv").layout)`` for the
        peer's.  Reasons: no layout (a page of a layer is not one contiguous range), more
        than :data:`MAX_TABLE_BLOCKS` blocks (the transport's indices are int32), or a
        limit of the transport (:meth:`_t_prep_refusal`)."""
        if layout is None:
            return (
                "no block layout: a page of a layer is not one contiguous range, so "
                "pages cannot be addressed as blocks"
            )
        if layout.blocks > MAX_TABLE_BLOCKS:
            return (
                f"{layout.blocks} blocks ({len(layout.planes)} planes x {layout.count} "
                f"pages) is more than the {MAX_TABLE_BLOCKS} a prepared table can index "
                "(NIXL reads block indices as int32)"
            )
        return self._t_prep_refusal(layout)

    def _prep_table(
        self, what: str, layout: BlockLayout | None, mem: str, device_id: int, peer: str | None
    ):
        why = self.direct_refusal(layout)
        if why is not None:
            raise TransferError(
                f"{what}: cannot prepare a block table: {why}; only packed "
                "transfers can move these pages"
            )
        assert layout is not None  # direct_refusal refuses a missing layout
        return self._t_prep(layout, mem, device_id, peer)

    def prep_local(self, key: str) -> BlockTable:
        """Prepare every block of the live registration ``key``'s layout, once (NIXL
        ``prep_xfer_dlist`` of one strided descriptor per plane: O(planes)).  Released by
        ``deregister(key)``.

        Raises:
            ValueError: ``key`` is not live or has no layout.
            TransferError: the table cannot be prepared (:meth:`direct_refusal` says why,
                before the transport is asked), or the transport refused it.
        """
        self._check_open("prep_local")
        reg = self._regs.get(key)
        if reg is None or reg.layout is None:
            raise ValueError(
                f"prep_local: {key!r} is not a live registration with a layout "
                f"(live: {sorted(self._regs)})"
            )
        native = self._prep_table(f"prep_local {key!r}", reg.layout, reg.mem, reg.device_id, None)
        return self._new_table(key, reg.epoch, reg.layout, None, native)

    def prep_remote(self, remote: RemoteMemory) -> BlockTable:
        """Prepare every block of a peer registration's layout, once per (peer, key,
        epoch); refused as stale like a write (:meth:`check_fresh`), and as
        :meth:`prep_local` for a layout no table can hold."""
        self._check_open("prep_remote")
        self.check_fresh(remote, "prep_remote")
        if remote.layout is None:
            raise ValueError(f"prep_remote: {remote.peer!r} key {remote.key!r} carries no layout")
        native = self._prep_table(
            f"prep_remote {remote.peer!r} {remote.key!r}",
            remote.layout,
            remote.mem,
            remote.device_id,
            remote.peer,
        )
        return self._new_table(remote.key, remote.epoch, remote.layout, remote, native)

    def _new_table(self, key, epoch, layout, remote, native) -> BlockTable:
        t = BlockTable(
            self._next_id,
            key,
            epoch,
            layout,
            remote,
            np.array([n for _, _, n in layout.planes], dtype=np.int64),
            native,
        )
        self._next_id += 1
        self._tables[t.id] = t
        return t

    def _drop_table(self, t: BlockTable) -> None:
        if not t.released:
            self._t_unprep(t.native)
            t.released, t.native = True, None
            self._tables.pop(t.id, None)

    def release_table(self, t: BlockTable) -> None:
        """Free a prepared table (refused while a write posted from it is in flight)."""
        busy = [
            h
            for h in self._handles.values()
            if t.id in h.tables and self._refresh(h) == XferState.PROC
        ]
        if busy:
            raise TransferInFlightError("release_table", len(busy))
        self._drop_table(t)

    def post_blocks(
        self,
        local: BlockTable,
        local_idx,
        remote: BlockTable,
        remote_idx,
        notif: bytes = b"",
        op: str = "WRITE",
    ) -> TransferHandle:
        """Move blocks ``local_idx`` of ``local`` to (``"WRITE"``) or from (``"READ"``)
        blocks ``remote_idx`` of ``remote`` (int64 arrays of equal length, i-th to i-th);
        ``notif`` delivered to the peer once done.  Adjacent blocks that are adjacent on
        both sides travel as one descriptor (NIXL merges them in prepared lists).

        Checks, before posting (nothing changed on error): the remote table's metadata is
        the newest known (StaleEpochError, the epoch rule), the local table's registration
        is live at its epoch, indices within the tables and sizes equal pairwise
        (ValueError).  Cost: a few numpy reductions over the indices, no range search
        (the blocks were checked inside their registrations when prepared; figures:
        docs/transfer.md, "Costs").
        """
        self._check_open("post_blocks")
        if op not in ("WRITE", "READ"):
            raise ValueError(f"post_blocks: op must be 'WRITE' or 'READ', got {op!r}")
        for t, side in ((local, "local"), (remote, "remote")):
            if not isinstance(t, BlockTable) or self._tables.get(t.id) is not t:
                raise ValueError(
                    f"post_blocks: {side} table {t!r} is not an open table of engine {self.name!r}"
                )
        if local.remote is not None or remote.remote is None:
            raise ValueError(
                "post_blocks: needs a local table (prep_local) and a remote one (prep_remote)"
            )
        self.check_fresh(remote.remote, "post_blocks")
        reg = self._regs.get(local.key)
        if reg is None or reg.epoch != local.epoch:
            raise StaleEpochError(
                self.name,
                local.key,
                f"epoch {local.epoch}",
                "closed" if reg is None else f"epoch {reg.epoch}",
                "post_blocks (local table)",
            )
        if not isinstance(notif, (bytes, bytearray)):
            raise ValueError(f"post_blocks: notif must be bytes, got {type(notif).__name__}")
        li = np.ascontiguousarray(local_idx, dtype=np.int64).reshape(-1)
        ri = np.ascontiguousarray(remote_idx, dtype=np.int64).reshape(-1)
        if li.size == 0 or li.size != ri.size:
            raise ValueError(
                f"post_blocks: {li.size} local and {ri.size} remote indices; "
                "they must be equal in number and > 0"
            )
        ln, rn = local.nbytes.size * local.layout.count, remote.nbytes.size * remote.layout.count
        if li.min() < 0 or li.max() >= ln or ri.min() < 0 or ri.max() >= rn:
            raise ValueError(
                f"post_blocks: an index outside the tables ({ln} local blocks, {rn} remote)"
            )
        lb = local.nbytes[li // local.layout.count]
        if not np.array_equal(lb, remote.nbytes[ri // remote.layout.count]):
            raise ValueError("post_blocks: paired blocks differ in size")
        native, state = self._t_post_blocks(
            op, local.native, li, remote.native, ri, remote.remote.peer, bytes(notif)
        )
        state = XferState(state)
        h = TransferHandle(
            self._next_id,
            remote.remote.peer,
            remote.key,
            (local.key,),
            int(lb.sum()),
            bytes(notif),
            state,
            None if state != XferState.ERR else "failed at post",
            native=native,
        )
        h.tables = (local.id, remote.id)
        h.op = op
        self._next_id += 1
        self._handles[h.id] = h
        return h
