"""Everything the adapter keeps: about sglang's objects, in side tables beside them, and
for the whole process, in one registry.

The adapter writes no attribute onto an sglang object.  What it must remember about one
(a request's decided answer, a scheduler's registration epoch, a KV manager's
deregistered pool, ...) lives in a :class:`SideTable` declared here, one table per fact,
so that this module is the whole list (:data:`TABLES`; the README's table of them is
generated from it by :mod:`kvmem_sglang.manifest`).

What it keeps for the process, not for one sglang object (its options, the pools it
made, the threads it starts, ...), is a field of :data:`PROCESS`, the one
:class:`Process`; beside it the adapter's only other module globals are the registries
:data:`REGISTRIES` names (tests/test_sglang_state.py checks both lists).

Standard library only, with :mod:`kvmem_sglang.options`, :mod:`kvmem_sglang.chase` and
:mod:`kvmem_sglang.rooms` (standard library only themselves, and importing nothing of the
adapter):
:mod:`kvmem_sglang.startup` uses it at interpreter start.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, TypeVar, overload

from kvmem_sglang.chase import Chase
from kvmem_sglang.options import ProcessOptions
from kvmem_sglang.rooms import Rooms

if TYPE_CHECKING:
    from concurrent.futures import Future, ThreadPoolExecutor

    from kvmem import KVPool

V = TypeVar("V")


@dataclass(eq=False)
class SideTable(Generic[V]):
    """One value per live object of an sglang class, kept beside it.

    Keyed by identity (sglang's objects need not be hashable); an entry goes when its
    object is collected (the table holds a weak reference to it, never the object), so a
    table neither keeps an sglang object alive nor hands a new object the value of a
    collected one with the same ``id``.  A key must take a weak reference (TypeError
    otherwise): instances of ordinary classes do, as every sglang class the adapter keys
    on is; a ``types.SimpleNamespace`` does not, a subclass of it does.  Every method is safe from any thread and costs
    one dict operation under the table's lock.

    ``owner`` names the sglang classes whose objects are keys, ``users`` the adapter
    modules that read or write the table, ``holds`` what a value means.
    """

    owner: str
    users: str
    holds: str
    _entries: dict[int, tuple[weakref.ref, Any]] = field(default_factory=dict, repr=False)
    _dead: list[int] = field(default_factory=list, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def _purge(self) -> None:
        # entries whose object was collected; the weak reference's callback only notes
        # them (it may run inside any allocation, this table's own included)
        while self._dead:
            key = self._dead.pop()
            entry = self._entries.get(key)
            if entry is not None and entry[0]() is None:
                del self._entries[key]

    def _ref(self, obj) -> weakref.ref:
        key, dead = id(obj), self._dead

        def gone(_ref: weakref.ref) -> None:
            dead.append(key)

        return weakref.ref(obj, gone)

    def _live(self, obj) -> tuple[weakref.ref, Any] | None:
        entry = self._entries.get(id(obj))
        return entry if entry is not None and entry[0]() is obj else None

    @overload
    def get(self, obj) -> V | None: ...

    @overload
    def get(self, obj, default: V) -> V: ...

    def get(self, obj, default=None):
        """The value kept for ``obj``, or ``default``."""
        with self._lock:
            self._purge()
            entry = self._live(obj)
            return default if entry is None else entry[1]

    def set(self, obj, value: V) -> None:
        """Keep ``value`` for ``obj`` (replacing any)."""
        ref = self._ref(obj)
        with self._lock:
            self._purge()
            self._entries[id(obj)] = (ref, value)

    def setdefault(self, obj, make: Callable[[], V]) -> V:
        """The value kept for ``obj``; ``make()`` kept and returned when there is none
        (one value per object even when threads race)."""
        with self._lock:
            self._purge()
            entry = self._live(obj)
            if entry is not None:
                return entry[1]
        value = make()
        ref = self._ref(obj)
        with self._lock:
            entry = self._live(obj)
            if entry is not None:
                return entry[1]
            self._entries[id(obj)] = (ref, value)
            return value

    def pop(self, obj, default: Any = None) -> Any:
        """Forget ``obj``; the value it had, or ``default``."""
        with self._lock:
            self._purge()
            entry = self._live(obj)
            if entry is None:
                return default
            del self._entries[id(obj)]
            return entry[1]

    def objects(self) -> list:
        """The live objects the table keeps a value for (a snapshot, in no set order)."""
        with self._lock:
            self._purge()
            return [o for o in (ref() for ref, _ in self._entries.values()) if o is not None]

    def __contains__(self, obj) -> bool:
        with self._lock:
            self._purge()
            return self._live(obj) is not None

    def __len__(self) -> int:
        with self._lock:
            self._purge()
            return sum(1 for ref, _ in self._entries.values() if ref() is not None)


# -- the tables ------------------------------------------------------------------------------

REASON: SideTable = SideTable(
    "Req",
    "reasons",
    "the one answer the request ends with (a FINISH_ABORT with its "
    "message and HTTP status; the hooks use reasons.decide and reasons.reason_of)",
)
REQ_EPOCH: SideTable[int] = SideTable("Req", "prefill", "the registration epoch it was queued in")
INFLIGHT_SINCE: SideTable[float] = SideTable(
    "Req", "prefill", "when it was first seen in the inflight queue (monotonic seconds)"
)
LIVE: SideTable[bool] = SideTable(
    "Req", "audit", "it entered the scheduler (the idle audit's requests)"
)
ABORT_WHY: SideTable = SideTable(
    "CommonKVSender",
    "reasons, notify",
    "what its decode is told when it is aborted: a message and the answer (reasons.Told)",
)
BUSY: SideTable[bool] = SideTable(
    "Scheduler", "prefill", "it queued work since it was last fully idle"
)
EPOCH: SideTable[int] = SideTable(
    "Scheduler", "prefill, release", "its registration epoch (+1 at each KV release)"
)
POOL: SideTable = SideTable(
    "MHATokenToKVPool, MLATokenToKVPool", "kvpool", "the kvmem KVPool under it"
)
DEREGISTERED: SideTable[bool] = SideTable(
    "NixlKVManager, MooncakeKVManager",
    "nixl, mooncake, release, registrations",
    "its pool's registrations were taken back at a release (False once registered again)",
)
REG_LOCK: SideTable = SideTable(
    "NixlKVManager", "nixl", "the lock its registration and deregistration take"
)
SETTLE_UNTIL: SideTable[float] = SideTable(
    "MooncakeKVManager",
    "mooncake, prefill_drain",
    "until when a release waits for its unsettled sends (monotonic seconds)",
)
DRAIN_GIVEN_UP: SideTable = SideTable(
    "NixlKVManager, MooncakeKVManager",
    "prefill_drain",
    "the rooms whose writes a release stopped waiting for",
)
EARLY_ABORTS: SideTable[Rooms[bool]] = SideTable(
    "NixlKVManager, MooncakeKVManager",
    "notify",
    "rooms a decode aborted before their request reached this prefill (rooms.Rooms)",
)
ABORTED_ROOMS: SideTable[Rooms] = SideTable(
    "NixlKVManager, MooncakeKVManager",
    "notify",
    "rooms aborted before their decode metadata came, with what to tell it (rooms.Rooms)",
)
OPENED: SideTable[Rooms[bool]] = SideTable(
    "NixlKVManager, MooncakeKVManager",
    "notify",
    "rooms a sender of this prefill opened lately, so ended ones are told from unknown ones "
    "(rooms.Rooms)",
)
ANSWERS: SideTable[Rooms] = SideTable(
    "NixlKVManager, MooncakeKVManager",
    "decode, notify",
    "the answer of a room that failed, until sglang reads the failure: a decode's from its "
    "prefill's answer frame, a prefill's for a room its decode aborted (rooms.Rooms)",
)
TRANSFERS: SideTable = SideTable(
    "NixlKVManager",
    "transfer_records",
    "kvmem's send path state: writes sent ahead, by their pages",
)
QUEUES: SideTable = SideTable(
    "FastQueue",
    "transfer_ahead",
    "its chunks by peer and page count, and its worker's gets (transfer_queue.QueueIndex)",
)
RESENDS: SideTable = SideTable(
    "NixlKVManager, MooncakeKVManager",
    "registrations",
    "a decode's registrations made again, and the condition their sends wait on "
    "(registrations.Resends)",
)
GUARDED: SideTable[bool] = SideTable(
    "load_plugins (function)", "startup", "the start-up check wrapped it already"
)

TABLES: dict[str, SideTable] = {
    name: t for name, t in globals().items() if isinstance(t, SideTable)
}

# -- the process ------------------------------------------------------------------------------


class Pools:
    """The kvmem pools the process made for sglang, each with what it was made for
    (``kvmem_sglang.kvpool``): weakly, so a pool goes with sglang's KV cache, and a
    release gives back every live one."""

    def __init__(self) -> None:
        self._made: weakref.WeakKeyDictionary[KVPool, str] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()  # guards _made

    def add(self, pool: KVPool, kind: str) -> None:
        with self._lock:
            self._made[pool] = kind

    def live(self) -> list[KVPool]:
        with self._lock:
            return list(self._made)


class Background:
    """One thread that runs calls off the caller's thread, in the order submitted: a
    ``ThreadPoolExecutor`` of one worker named ``name``, made on the first call (a
    process that never needs it starts no thread)."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()  # guards _pool

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        from concurrent.futures import ThreadPoolExecutor

        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix=self._name)
            pool = self._pool
        return pool.submit(fn, *args, **kwargs)


@dataclass(frozen=True, eq=False)
class Process:
    """What the adapter keeps for the whole process rather than for one sglang object
    (those are the side tables above), each field a service of its own with its own
    locking; the process has one, :data:`PROCESS`.

    ``options``: the adapter's options, parsed once when the plugin loads
    (:class:`~kvmem_sglang.options.ProcessOptions`).
    ``after_import``: the functions waiting for a module's import, by module name
    (:mod:`kvmem_sglang.imports`: a backend's hooks, the start-up guard); once a process.
    ``pools``: the kvmem pools the process made for sglang, weakly, with their lock
    (:class:`Pools`; a release gives back every one).
    ``chase``: the decode's ABORTs sent again, with their heap of due repeats and the one
    thread that sends them, started on first use (:class:`~kvmem_sglang.chase.Chase`).
    ``notify``: the thread that sends abort notifications to decodes off the scheduler
    thread, made on first use (:class:`Background`, :mod:`kvmem_sglang.notify`).
    ``registrations``: the thread that sends a decode's new registration to its prefill
    ranks after a resume, and tries again where a send failed, off the scheduler thread,
    made on first use (:class:`Background`, :mod:`kvmem_sglang.registrations`).
    ``warned``: the KV-manager classes already warned about having no deregistration
    (:func:`kvmem_sglang.release.queue_release`), so one line a class.
    ``worker``: per transfer worker thread, ``.queue``: the queue the calling thread
    serves (:mod:`kvmem_sglang.transfer_ahead`; its index is in :data:`QUEUES`).
    ``handed``: per thread, ``.room`` and ``.answer``: the failure sglang's
    ``failure_exception`` read last on the calling thread, for the ``prepare_abort`` that
    follows it (:func:`kvmem_sglang.reasons.hand_over`).
    """

    options: ProcessOptions = field(default_factory=ProcessOptions)
    after_import: dict[str, list[Callable]] = field(default_factory=dict)
    pools: Pools = field(default_factory=Pools)
    chase: Chase = field(default_factory=Chase)
    notify: Background = field(default_factory=lambda: Background("kvmem-notify"))
    registrations: Background = field(default_factory=lambda: Background("kvmem-registrations"))
    warned: set[str] = field(default_factory=set)
    worker: threading.local = field(default_factory=threading.local)
    handed: threading.local = field(default_factory=threading.local)


PROCESS = Process()

# The registries: the process's (above), the manifest's (its record, its application),
# the adapter's table of variables, and the metrics (counters sglang's processes export).
# With the side tables, the only mutable module globals of the adapter;
# tests/test_sglang_state.py finds every one and checks it is here.
REGISTRIES: dict[str, str] = {
    "state.PROCESS": "the process's services (Process)",
    "manifest_recorded.RECORDED": "the manifest's record of sglang 0.5.23 (generated)",
    "options.VARIABLES": "the adapter's environment variables, their values and meaning",
    "plugin.INSTALLED": "hook targets patched in this process",
    "plugin.PENDING": "hook targets waiting for their backend module's import",
    "audit.STATS": "metrics",
    "audit._COUNTER": "metrics (prometheus)",
    "notify.STATS": "metrics",
    "prefill.STATS": "metrics",
    "transfer_records.STATS": "metrics",
    "transfer_records._COUNTER": "metrics (prometheus)",
}
