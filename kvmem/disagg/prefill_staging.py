"""The staging buffer of the prefill side (:class:`Staging`): registered memory the packed
chunks and the AUX are written from, and the arena of its slots.  The sending part fills
and posts the slots, the ending part frees a slot staged and never posted
(:mod:`kvmem.disagg.prefill_send`, :mod:`kvmem.disagg.prefill_ending`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

import kvmem
from kvmem.disagg.arena import Arena
from kvmem.disagg.peers import buffer_map
from kvmem.disagg.protocol import AUX_BYTES
from kvmem.memory import make_backend

if TYPE_CHECKING:
    from kvmem.pool import KVPool
    from kvmem.transfer.engine import TransferEngine


class Staging:
    """The staging buffer of one prefill side: its memory (``mem``), registered with the
    engine as ``staging`` when made and kept registered (a pause leaves it as it is), its
    bytes (``tensor``, uint8 ``[arena.size]`` or more, on the pool's device), the map of
    its regions (``map``: one per physical chunk of ``mem``; NIXL refuses a descriptor
    across two registrations, so a slot's write is cut where it crosses one) and the
    arena of its slots (``arena``).

    ``nbytes``: its size; None: room for 8 chunks of ``chunk_tokens`` and 64 AUX slots.
    ValueError when it cannot hold one chunk and one AUX slot (nothing registered)."""

    def __init__(self, pool: KVPool, engine: TransferEngine, chunk_tokens: int, nbytes: int | None):
        spec = pool.spec
        chunk_max = kvmem.packed_nbytes(spec, chunk_tokens // spec.page_size)
        nbytes = nbytes or 8 * chunk_max + 64 * AUX_BYTES
        self.arena = Arena(nbytes)
        if self.arena.size < chunk_max + AUX_BYTES:
            raise ValueError(f"staging_bytes {nbytes} cannot hold one chunk ({chunk_max} bytes)")
        self.mem = make_backend(nbytes, pool.device)
        tensor = self.mem.tensor
        assert tensor is not None  # mapped until the backend is freed
        self.tensor: torch.Tensor = tensor
        regions = self.mem.regions()
        self.map = buffer_map(tensor, regions)
        engine.register("staging", regions, 0, pool.device)
