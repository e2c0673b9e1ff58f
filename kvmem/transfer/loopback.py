"""LoopbackEngine: the TransferEngine between agents of one process, over host memory.

What it is for: the PD lifecycle's tests and tools that run a prefill and a decode side in
one process and need an engine that keeps every rule of :mod:`kvmem.transfer.engine`
(epochs, tombstones, snapshot order, the checks made before a post, the in-flight table,
prepared block tables) and behaves, where the lifecycle can see it, as NIXL does on this
machine (docs/transfer.md), without creating NIXL agents, UCX workers and connections.
The rules both engines must keep are held against both by
tests/transfer/test_engine_contract.py.

The model, each point a promise of this module:

* **Fabric.**  A :class:`~kvmem.transfer.loopback_fabric.LoopbackFabric` is the wire
  (that module: the agents, their inboxes and the copier): the open agents of this process
  by name, what each one ever registered, and each agent's inbox of notifications.  Engines
  made without a fabric share the process's default one.  An agent name is open at most
  once per fabric; a closed agent's name can be used again (a restarted peer).
* **Metadata.**  The transport's blob names the fabric, this process, the agent (name and
  a number unique in the fabric) and its live regions.  Loading it (``add_peer``) refuses
  another process's or fabric's blob, and a region the agent never registered
  (:class:`MetadataError`); it adds the blob's regions to what this engine knows of that
  peer: like NIXL, newer metadata *merges*, so a region the peer dropped stays
  addressable to the transport (the epoch guard of the engine is what refuses it).  A
  second agent under a name already loaded is refused until that peer is unloaded
  (NIXL: NIXL_ERR_NOT_ALLOWED; the engine unloads a restarted peer first).
* **One descriptor, one region.**  Every local range of a post must lie inside one region
  of a live local registration, every remote range inside one region loaded for the
  peer; otherwise :class:`TransferError` with ``LOOPBACK_ERR_NOT_FOUND`` (NIXL refuses a
  descriptor across two registrations, adjacent or not, with NIXL_ERR_NOT_FOUND).  The
  same holds for every plane of a prepared table.  Host memory ("DRAM") only: a VRAM
  registration is refused.
* **Bytes** are copied by ``process_vm_writev`` / ``process_vm_readv`` on this process,
  the system calls UCX's ``cma`` transport uses between processes here, so a range whose
  memory is no longer mapped fails that write (ERR, ``EFAULT``) instead of crashing the
  process.  Where the system calls are refused (a seccomp profile), the fabric copies
  with ``memmove`` (:attr:`LoopbackFabric.copier` says which).  When: at post with
  ``landing="post"`` (the default; what ``cma`` does, inside NIXL's ``transfer()``), or at
  the poll that settles the write with ``landing="settle"`` (a transport whose bytes land
  later).  Either way PROC says nothing about the bytes; DONE and the notification mean
  they landed.
* **States.**  A post answers PROC.  The initiator's polls settle it: the
  ``settle_polls``-th poll reads DONE (1: the first poll), and at that moment the write's
  notification, if not empty, joins the target's inbox: the target never hears of a write
  nobody polls (as with NIXL).  ERR when the copy failed, when the target agent was
  closed or unloaded by the initiator while the write was in flight (the error says
  ``LOOPBACK_ERR_REMOTE_DISCONNECT``, as NIXL's says NIXL_ERR_REMOTE_DISCONNECT), or by
  injection (:meth:`LoopbackEngine.fail_next`).  ``release(h, abort=True)`` of a PROC
  write cancels it: its notification is never delivered (and with ``landing="settle"``
  its bytes never land).
* **No revocation.**  Deregistration stops nothing already posted (a posted write still
  settles DONE, its bytes where they were written), and a write built from sections the
  initiator loaded before still lands after the target deregistered: NIXL on this machine
  does the same, which is why the epoch guard is the initiator's (docs/transfer.md).
* **Notifications.**  ``send_notif`` puts the message in the target's inbox at once (NIXL:
  a moment later, over TCP); ``get_notifs`` hands out the inbox in arrival order per
  sender, each message once.  Sending to a closed agent raises :class:`TransferError`
  (``LOOPBACK_ERR_REMOTE_DISCONNECT``).
* **Faults.**  :meth:`LoopbackEngine.freeze` stops an agent as SIGSTOP stops a NIXL
  process: writes to, from or reading it stay PROC and notifications to it wait on the
  wire until :meth:`LoopbackEngine.thaw`.  :meth:`LoopbackEngine.fail_next` makes this
  engine's next posts fail, refused at post or ERR when polled.
* **Threads.**  One lock per fabric: one thread may drive an engine while another calls
  ``get_notifs`` of its peer (the PD calibration does), as with NIXL.

Where it differs from NIXL by necessity (the contract suite states each): the bytes of a
write land inside the post or at its settling poll, never in between by another thread;
a notification is in the inbox when ``send_notif`` or the settling poll returns; an
engine without a progress thread needs nobody else's calls to progress (NIXL's needs the
target's ``get_notifs`` for a write without a notification).
"""

from __future__ import annotations

import itertools
import json
import os
from dataclasses import dataclass, field

import numpy as np

from kvmem.transfer.engine import TransferEngine
from kvmem.transfer.errors import MetadataError, TransferError
from kvmem.transfer.layout import BlockLayout
from kvmem.transfer.loopback_fabric import (
    DISCONNECT,
    NOT_FOUND,
    Agent,
    LoopbackFabric,
    default_fabric,
)
from kvmem.transfer.records import Registration, RemoteMemory


# --- what the engine hands the base class as native objects -----------------------------------

_NO_RANGES = np.zeros(0, dtype=np.int64)


@dataclass(eq=False)
class _Sections:
    """What this engine loaded of one peer: its agent and every region any of its blobs
    named (merged, as NIXL merges), indexed for "inside one section"."""

    agent: Agent
    regions: set
    # both set by index(), which every load calls before the sections are read
    starts: np.ndarray = field(default_factory=lambda: _NO_RANGES)
    reach: np.ndarray = field(default_factory=lambda: _NO_RANGES)  # prefix max of the ends

    def index(self) -> None:
        r = np.array(sorted(self.regions), dtype=np.int64).reshape(-1, 2)
        self.starts = r[:, 0]
        self.reach = np.maximum.accumulate(r[:, 0] + r[:, 1]) if len(r) else r[:, 0]


def _inside(ranges: np.ndarray, starts: np.ndarray, reach: np.ndarray) -> np.ndarray:
    """Per ``(addr, n)`` row: whether one of the sections (sorted ``starts``, prefix
    maximum ``reach`` of their ends) holds it whole.  Among sections starting at or before
    ``addr``, the one reaching furthest holds it if any does."""
    if starts.size == 0:
        return np.zeros(ranges.shape[0], dtype=bool)
    i = np.searchsorted(starts, ranges[:, 0], side="right") - 1
    ok = i >= 0
    ok[ok] = ranges[ok, 0] + ranges[ok, 1] <= reach[i[ok]]
    return ok


@dataclass(eq=False)
class _Table:
    planes: np.ndarray  # [planes, 3] int64: base, stride, nbytes
    count: int
    peer: str | None


@dataclass(eq=False)
class _Write:
    op: str
    target: Agent
    peer: str
    local: np.ndarray
    remote: np.ndarray
    notif: bytes
    polls_left: int
    fail: str | None  # injected: the error it reads when it settles
    landed: bool
    state: str = "PROC"
    cancelled: bool = False


# --- the engine ----------------------------------------------------------------------------------


class LoopbackEngine(TransferEngine):
    """A TransferEngine whose peers are loopback agents of the same process (module
    docstring: the model, the faults, where it differs from NIXL).

    Args:
        name: the agent name peers see; open at most once per fabric.
        fabric: the wire (None: the process's default fabric).
        settle_polls: polls of the initiator before a write reads DONE (>= 1).
        landing: ``"post"`` (bytes copied inside the post, as UCX's cma does here) or
            ``"settle"`` (at the poll that settles the write).
    """

    kind = "loopback"

    def __init__(
        self,
        name: str,
        *,
        fabric: LoopbackFabric | None = None,
        settle_polls: int = 1,
        landing: str = "post",
    ):
        super().__init__(name)
        if isinstance(settle_polls, bool) or not isinstance(settle_polls, int) or settle_polls < 1:
            raise ValueError(
                f"LoopbackEngine: settle_polls must be an int >= 1, got {settle_polls!r}"
            )
        if landing not in ("post", "settle"):
            raise ValueError(f"LoopbackEngine: landing must be 'post' or 'settle', got {landing!r}")
        self.fabric = fabric if fabric is not None else default_fabric()
        self.settle_polls, self.landing = settle_polls, landing
        self._agent = self.fabric._open(name)
        self._loaded: dict[str, _Sections] = {}
        self._reg_ids = itertools.count(1)
        self._local_starts = np.zeros(0, dtype=np.int64)
        self._local_reach = np.zeros(0, dtype=np.int64)
        self._faults: list[tuple[str, str]] = []  # (at, reason) of the next posts
        self._writes: set = set()  # natives not released

    # --- faults --------------------------------------------------------------------------
    @property
    def frozen(self) -> bool:
        return self._agent.frozen

    def freeze(self) -> None:
        """Stop this agent as SIGSTOP stops a process: writes it posted, writes into it and
        reads of its memory stay PROC however often they are polled, and notifications to
        it wait on the wire (``get_notifs`` returns none) until :meth:`thaw`.  Its own
        calls still work (it is one process)."""
        with self.fabric.lock:
            self._agent.frozen = True

    def thaw(self) -> None:
        """Undo :meth:`freeze`: what waited settles at its next poll, what waited on the
        wire is delivered."""
        with self.fabric.lock:
            self._agent.frozen = False

    def fail_next(
        self, count: int = 1, *, at: str = "poll", reason: str = "injected failure"
    ) -> None:
        """This engine's next ``count`` posts (``post_write`` or ``post_blocks`` that the
        engine's and the transport's own checks let through; a post they refuse uses no
        injected failure) fail: ``at="post"``: refused with :class:`TransferError`
        naming ``reason`` (nothing posted; the engine as it was, one injected failure
        fewer); ``at="poll"``: posted, no byte moved, the poll that settles it reads ERR
        with ``reason`` in ``h.error`` and no notification is delivered."""
        if at not in ("post", "poll"):
            raise ValueError(f"fail_next: at must be 'post' or 'poll', got {at!r}")
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"fail_next: count must be an int >= 1, got {count!r}")
        self._faults += [(at, str(reason))] * count

    def pending_faults(self) -> int:
        """Injected failures not yet used by a post."""
        return len(self._faults)

    # --- registrations -------------------------------------------------------------------
    def _index_local(self) -> None:
        regs = sorted(r for rs in self._agent.live.values() for r in rs)
        arr = np.array(regs, dtype=np.int64).reshape(-1, 2)
        self._local_starts = arr[:, 0]
        self._local_reach = np.maximum.accumulate(arr[:, 0] + arr[:, 1]) if len(arr) else arr[:, 0]

    def _t_register(self, reg: Registration):
        if reg.mem != "DRAM":
            raise TransferError(
                f"register {reg.key!r}: the loopback engine moves host memory "
                f"only, not {reg.mem} (use NixlEngine on a GPU)"
            )
        with self.fabric.lock:
            rid = next(self._reg_ids)
            self._agent.live[rid] = tuple(reg.regions)
            self._agent.ever.update(reg.regions)
            self._index_local()
        return rid

    def _t_deregister(self, native) -> None:
        # Revokes nothing: writes posted into these regions settle as they would have,
        # and peers that loaded them can still write there (module docstring).
        with self.fabric.lock:
            self._agent.live.pop(native, None)
            self._index_local()

    # --- metadata and peers --------------------------------------------------------------
    def _t_blob(self) -> bytes:
        with self.fabric.lock:
            regions = sorted(r for rs in self._agent.live.values() for r in rs)
        return json.dumps(
            dict(
                loopback=1,
                fabric=self.fabric.id,
                pid=self.fabric.pid,
                agent=self.name,
                number=self._agent.number,
                regions=[list(r) for r in regions],
            ),
            separators=(",", ":"),
        ).encode()

    def _t_load_peer(self, blob: bytes) -> str:
        try:
            d = json.loads(blob)
            name, number = d["agent"], d["number"]
            regions = {(int(a), int(n)) for a, n in d["regions"]}
            ok = d["loopback"] == 1 and isinstance(name, str) and type(number) is int
        except (ValueError, TypeError, KeyError) as e:
            raise MetadataError(
                f"add_peer: not loopback transport metadata: {type(e).__name__}: {e}"
            ) from None
        if not ok:
            raise MetadataError("add_peer: not loopback transport metadata")
        if d["fabric"] != self.fabric.id or d["pid"] != os.getpid():
            raise MetadataError(
                f"add_peer: loopback metadata of {name!r} comes from another "
                "process or fabric; loopback agents talk within one fabric"
            )
        with self.fabric.lock:
            agent = self.fabric._find(name, number)
            if agent is None:
                raise MetadataError(
                    f"add_peer: loopback agent {name!r} (number {number}) is "
                    "not open in this fabric"
                )
            foreign = regions - agent.ever
            if foreign:
                a, n = min(foreign)
                raise MetadataError(
                    f"add_peer: loopback metadata of {name!r} names memory it "
                    f"never registered: [{a:#x}, +{n})"
                )
            have = self._loaded.get(name)
            if have is not None and have.agent is not agent:
                raise MetadataError(
                    f"add_peer: another loopback agent named {name!r} is loaded "
                    "(a restarted peer): unload it first"
                )
            if have is None:
                have = self._loaded[name] = _Sections(agent, set())
            have.regions |= regions  # merged, as NIXL merges a peer's newer metadata
            have.index()
        return name

    def _t_unload_peer(self, name: str) -> None:
        # Writes to it still in flight read ERR at their next poll (NIXL: the transfer's
        # status raises once its remote agent was removed).
        with self.fabric.lock:
            self._loaded.pop(name, None)

    # --- posting -------------------------------------------------------------------------
    def _check_post(self, what: str, peer: str, local: np.ndarray, remote: np.ndarray) -> Agent:
        """The transport's own checks of a post (under the fabric lock): the fabric is this
        process's, the peer loaded and open, every range inside one region."""
        if self.fabric.pid != os.getpid():
            raise TransferError(
                f"{what}: the loopback fabric belongs to process "
                f"{self.fabric.pid}, this is {os.getpid()}"
            )
        sec = self._loaded.get(peer)
        if sec is None:
            raise TransferError(f"{what}: peer {peer!r} is not loaded ({NOT_FOUND})")
        if sec.agent.closed:
            raise TransferError(f"{what}: peer {peer!r} closed ({DISCONNECT})")
        for side, rng, starts, reach in (
            ("local", local, self._local_starts, self._local_reach),
            ("remote", remote, sec.starts, sec.reach),
        ):
            bad = np.flatnonzero(~_inside(rng, starts, reach))
            if bad.size:
                a, n = (int(x) for x in rng[bad[0]])
                raise TransferError(
                    f"{what}: {side} descriptor {int(bad[0])} [{a:#x}, +{n}) is "
                    f"not inside one registered region ({NOT_FOUND})"
                )
        return sec.agent

    def _post(
        self, op: str, what: str, peer: str, local: np.ndarray, remote: np.ndarray, notif: bytes
    ):
        with self.fabric.lock:
            target = self._check_post(what, peer, local, remote)
            fail = None
            if self._faults:
                at, reason = self._faults[0]
                if at == "post":
                    self._faults.pop(0)
                    raise TransferError(f"{what}: {reason} (injected at post)")
                fail = self._faults.pop(0)[1]
            w = _Write(
                op, target, peer, local, remote, bytes(notif), self.settle_polls, fail, landed=False
            )
            if fail is None and self.landing == "post":
                err = self.fabric._copier.copy(op, local, remote)
                w.landed = True
                if err is not None:
                    w.fail = f"copy failed: {err}"
            self._writes.add(w)
            return w, "PROC"

    def _t_post(
        self,
        local: np.ndarray,
        lreg: Registration,
        remote: np.ndarray,
        rmem: RemoteMemory,
        notif: bytes,
    ):
        return self._post("WRITE", f"post_write to {rmem.peer!r}", rmem.peer, local, remote, notif)

    # --- prepared tables -----------------------------------------------------------------
    def _t_prep(self, layout: BlockLayout, mem: str, device_id: int, peer: str | None):
        if mem != "DRAM":
            raise TransferError(f"prep: the loopback engine moves host memory only, not {mem}")
        spans = np.array(layout.spans(), dtype=np.int64).reshape(-1, 2)
        with self.fabric.lock:
            if peer is None:
                starts, reach, of = self._local_starts, self._local_reach, ""
            else:
                sec = self._loaded.get(peer)
                if sec is None:
                    raise TransferError(f"prep: peer {peer!r} is not loaded ({NOT_FOUND})")
                starts, reach, of = sec.starts, sec.reach, f" of {peer!r}"
            bad = np.flatnonzero(~_inside(spans, starts, reach))
        if bad.size:
            raise TransferError(
                f"prep: plane {int(bad[0])}{of} is not inside one registered region ({NOT_FOUND})"
            )
        return _Table(np.array(layout.planes, dtype=np.int64).reshape(-1, 3), layout.count, peer)

    def _t_prep_refusal(self, layout: BlockLayout) -> str | None:
        return None

    def _t_post_blocks(self, op, local, lidx, remote, ridx, peer, notif):
        def ranges(t: _Table, idx: np.ndarray) -> np.ndarray:
            p = t.planes[idx // t.count]
            out = np.empty((idx.size, 2), dtype=np.int64)
            out[:, 0] = p[:, 0] + (idx % t.count) * p[:, 1]
            out[:, 1] = p[:, 2]
            return out

        return self._post(
            op,
            f"post_blocks {op} with {peer!r}",
            peer,
            ranges(local, lidx),
            ranges(remote, ridx),
            notif,
        )

    # --- states --------------------------------------------------------------------------
    def _t_state(self, native: _Write) -> str:
        with self.fabric.lock:
            w = native
            if w.state != "PROC":
                return w.state
            sec = self._loaded.get(w.peer)
            if w.target.closed or sec is None or sec.agent is not w.target:
                w.state = "ERR"
                gone = "closed" if w.target.closed else "was unloaded"
                raise TransferError(
                    f"peer {w.peer!r} {gone} while the {w.op} was in flight ({DISCONNECT})"
                )
            if self._agent.frozen or w.target.frozen:
                return "PROC"
            w.polls_left -= 1
            if w.polls_left > 0:
                return "PROC"
            if w.fail is None and not w.landed:
                err = self.fabric._copier.copy(w.op, w.local, w.remote)
                w.landed = True
                if err is not None:
                    w.fail = f"copy failed: {err}"
            if w.fail is not None:
                w.state = "ERR"
                raise TransferError(w.fail)
            w.state = "DONE"
            if w.notif:
                w.target.inbox.append((self.name, w.notif))
            return "DONE"

    def _t_release(self, native: _Write) -> None:
        with self.fabric.lock:
            if native.state == "PROC":
                native.cancelled, native.state = True, "ERR"
            self._writes.discard(native)

    # --- notifications -------------------------------------------------------------------
    def _t_send_notif(self, peer: str, msg: bytes) -> None:
        with self.fabric.lock:
            sec = self._loaded.get(peer)
            if sec is None:
                raise TransferError(f"send_notif: peer {peer!r} is not loaded ({NOT_FOUND})")
            if sec.agent.closed:
                raise TransferError(f"send_notif: peer {peer!r} closed ({DISCONNECT})")
            sec.agent.inbox.append((self.name, bytes(msg)))

    def _t_get_notifs(self) -> dict[str, list[bytes]]:
        with self.fabric.lock:
            if self._agent.frozen or not self._agent.inbox:
                return {}
            out: dict[str, list[bytes]] = {}
            for sender, msg in self._agent.inbox:
                out.setdefault(sender, []).append(msg)
            self._agent.inbox.clear()
            return out

    # --- lifetime ------------------------------------------------------------------------
    def _t_close(self) -> None:
        with self.fabric.lock:
            self._loaded.clear()
            self._writes.clear()
            self.fabric._close(self._agent)
