"""A transfer worker's queue as kvmem's send path reads it (both backends): the chunks
queued on it, by peer in queue order with their page counts (:class:`QueueIndex`), so that
:func:`kvmem_sglang.transfer_ahead.take_ahead` looks only at the chunks it may take.

The queue is sglang's ``FastQueue`` (``disaggregation/common/utils.py``): a deque ``_buf``
under a condition ``_cond``; ``put`` appends, ``get`` pops from the left.  Each worker
thread is the only reader of its queue (``NixlKVManager.__init__`` and
``MooncakeKVManager.__init__`` start one ``transfer_worker`` per queue) and is handed a
:class:`CountedQueue` in its place (:func:`kvmem_sglang.transfer_ahead.transfer_worker`),
which counts its gets.

Following the queue.  Between two reads (:meth:`QueueIndex.read`, on the worker thread)
the deque only lost chunks at its left, the worker's gets, and gained chunks at its right
(``add_transfer_request``'s puts from the scheduler thread, the worker's own put of a chunk
whose staging is not ready, a test moving a backlog in at once).  So it holds the chunks
indexed less the first ``gets`` of them, then ``len(_buf)`` minus those left, which are
read from its right end.  Should the deque not be so (both of its ends are checked), the
index is built again from the whole deque.

Each chunk is classified once, when first read: its pages and its peer, the peer of its
room's one transfer info that is not a dummy (what ``take_ahead`` requires of a chunk).
That peer cannot change while the chunk is queued: ``add_transfer_request`` queues no chunk
for a room without transfer infos, a room's infos are all in before its sender leaves
Bootstrapping (the scheduler sends no chunk before), and they only go when the room is
cleared.  A chunk without such a peer, or without pages, can never go ahead of its turn and
is kept in queue order only.

What it costs: a read, the chunks put and got since the last one, each O(1) amortized
(O(log n) where it enters a peer's tree); the search for a peer's first chunk at or after a
position with at most ``limit`` pages, O(log n) (:class:`PeerChunks`: a min-tree over page
counts); n the peer's chunks queued.  Nothing depends on the depth of the queue.
"""

from __future__ import annotations

import itertools
from collections import deque

# The page count of a chunk that is not to be found (gone from the queue, or never to go
# ahead): more than any budget holds.
NEVER = 1 << 62


class CountedQueue:
    """What sglang's transfer worker is handed in place of its ``FastQueue``: the same
    queue (every other name is the queue's), each ``get`` counted in ``index``."""

    def __init__(self, queue, index: QueueIndex):
        self._queue, self._index = queue, index

    def get(self):
        item = self._queue.get()
        self._index.gets += 1
        return item

    def put(self, item) -> None:
        self._queue.put(item)

    def __getattr__(self, name):
        return getattr(self._queue, name)


class PeerChunks:
    """One peer's queued chunks in queue order, at positions ``0, 1, ...`` (never reused),
    with a min-tree over their page counts; a chunk forgotten, or gone from the queue,
    counts :data:`NEVER` pages.  Positions below :attr:`head` are gone.

    Invariants: ``tree[size + i]`` is the page count of position ``base + i`` (:data:`NEVER`
    past the last), ``tree[j] == min(tree[2 j], tree[2 j + 1])`` for ``1 <= j < size``;
    ``base <= head <= base + len(chunks)``."""

    def __init__(self):
        self.chunks: list = []  # position base + i at i
        self.pages: list[int] = []
        self.base = 0
        self.head = 0
        self._size = 1
        self._tree = [NEVER, NEVER]

    def append(self, chunk, pages: int) -> int:
        """Queue ``chunk`` of ``pages`` pages last; its position."""
        if len(self.chunks) == self._size:
            self._rebuild(extra=1)
        self.chunks.append(chunk)
        self.pages.append(pages)
        pos = self.base + len(self.chunks) - 1
        self._set(pos, pages)
        return pos

    def gone(self, pos: int) -> None:
        """The chunk at ``pos``, this peer's first still queued, left the queue."""
        self._set(pos, NEVER)
        self.head = pos + 1
        if self.head - self.base >= 64 and 2 * (self.head - self.base) >= len(self.chunks):
            self._rebuild()

    def forget(self, pos: int) -> None:
        """The chunk at ``pos`` can never go ahead of its turn: no search finds it."""
        self._set(pos, NEVER)

    def chunk(self, pos: int):
        return self.chunks[pos - self.base]

    def first(self, start: int, limit: int) -> int:
        """The first position at or after ``start`` (and :attr:`head`) whose chunk has at
        most ``limit`` pages; -1 if none.  O(log n)."""
        i = max(start, self.head) - self.base
        if i >= len(self.chunks):
            return -1
        tree, size = self._tree, self._size
        j = i + size
        while tree[j] > limit:
            while j & 1:  # a right child: its parent's range ends where its own does
                j >>= 1
            if j == 0:
                return -1
            j += 1  # the range right after
        while j < size:  # down to the leftmost leaf within the limit
            j = 2 * j if tree[2 * j] <= limit else 2 * j + 1
        return self.base + j - size

    def _set(self, pos: int, pages: int) -> None:
        i = pos - self.base
        self.pages[i] = pages
        tree, j = self._tree, i + self._size
        tree[j] = pages
        j >>= 1
        while j:
            tree[j] = min(tree[2 * j], tree[2 * j + 1])
            j >>= 1

    def _rebuild(self, extra: int = 0) -> None:
        """Drop the positions gone; a tree for twice what is left (and ``extra`` more)."""
        cut = self.head - self.base
        self.chunks, self.pages = self.chunks[cut:], self.pages[cut:]
        self.base = self.head
        size = 1
        while size < 2 * len(self.chunks) + extra:
            size *= 2
        tree = [NEVER] * (2 * size)
        tree[size : size + len(self.pages)] = self.pages
        for j in range(size - 1, 0, -1):
            tree[j] = min(tree[2 * j], tree[2 * j + 1])
        self._size, self._tree = size, tree


class _Entry:
    __slots__ = ("chunk", "peer", "pos")

    def __init__(self, chunk, peer, pos: int):
        self.chunk, self.peer, self.pos = chunk, peer, pos


class QueueIndex:
    """The chunks of one worker's queue (module docstring).  Used on that worker's thread
    only: :attr:`gets` by its :class:`CountedQueue`, the rest by ``take_ahead``.

    ``peers``: peer -> :class:`PeerChunks`.  ``indexed``: chunks classified so far (each
    once)."""

    def __init__(self):
        self.gets = 0
        self.indexed = 0
        self.peers: dict[str, PeerChunks] = {}
        self._order: deque[_Entry] = deque()  # every chunk queued, as last read

    def read(self, queue, classify) -> int:
        """Bring the index up to ``queue`` (the module docstring says how);
        ``classify(chunk)``: ``(peer, pages)``, peer None for a chunk that can never go
        ahead of its turn.  The number of chunks classified."""
        order = self._order
        with queue._cond:  # FastQueue: a deque and a condition
            buf = queue._buf
            gets, self.gets = self.gets, 0
            for _ in range(min(gets, len(order))):
                self._gone(order.popleft())
            new = len(buf) - len(order)
            if order and (
                new < 0
                or buf[0] is not order[0].chunk
                or buf[len(order) - 1] is not order[-1].chunk
            ):  # not as counted: build it again
                order = self._order = deque()
                self.peers = {}
                new = len(buf)
            fresh = list(itertools.islice(reversed(buf), new))
        for chunk in reversed(fresh):
            peer, pages = classify(chunk)
            if peer is None or pages <= 0:
                order.append(_Entry(chunk, None, -1))
                continue
            chunks = self.peers.get(peer)
            if chunks is None:
                chunks = self.peers[peer] = PeerChunks()
            order.append(_Entry(chunk, peer, chunks.append(chunk, pages)))
        self.indexed += len(fresh)
        return len(fresh)

    def _gone(self, entry: _Entry) -> None:
        if entry.peer is not None:
            chunks = self.peers[entry.peer]
            chunks.gone(entry.pos)
            if chunks.head == chunks.base + len(chunks.chunks):
                del self.peers[entry.peer]  # none queued: a peer gone for good leaves nothing
