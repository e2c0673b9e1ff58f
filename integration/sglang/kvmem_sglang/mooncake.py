"""sglang 0.5.23's ``MooncakeKVManager`` (sglang's default PD transfer backend) under the
flag: registrations that fail loudly, one log line each, and reasons the decode can read.

Names below are of the installed sglang 0.5.23; their paths are under ``sglang/srt/``.

* Registration.  sglang registers the KV, aux and state buffers with
  ``engine.batch_register`` and ignores its return code
  (``MooncakeKVManager.register_buffer_to_engine``, ``disaggregation/mooncake/conn.py``;
  the wrapper logs a failure at debug level, ``MooncakeTransferEngine.batch_register``,
  ``distributed/device_communicators/mooncake_transfer_engine.py``), at start and again at
  every resume; the same for ``batch_deregister`` at a release
  (``MooncakeKVManager.deregister_buffer_to_engine``).  A prefill whose registration
  failed serves on: every write its peers build then fails ("not within any registered
  buffer"), and a decode's failed registration lets no prefill reach its pages.  Here each
  is logged once with the engine's return code, and a non-zero code raises
  :class:`RegistrationError`: at start the scheduler stops with it; at a resume the
  adapter refuses the resume and keeps the KV cache released
  (``kvmem_sglang.release.resume_memory_occupation``); at a release it refuses the release
  before any memory is given back, and registers again what a refused deregistration
  dropped (:func:`deregister_buffer_to_engine` deregisters region by region for that).
  What is registered is the kvmem pool's few regions (``SGLANG_KVMEM_REGISTER=regions``:
  :func:`registerable_regions`) or sglang's one buffer per layer and per K/V.
* Failed writes.  ``batch_transfer_sync_write`` returns -1 while other slices of the
  batch may still be in flight (they landed after the -1 once the target registered the
  region again within milliseconds).  sglang poisons such a room's ABORT_ACK (its decode
  keeps the pages until its deferred-release timeout, 30 s) but uncounts it at once, so
  a release right after would deregister and give back memory those slices still read:
  :func:`poison_unsettled_send` opens a settle window a release waits out.
* Reasons.  A Mooncake status message carries no failure reason
  (``kv_status_msg_carries_reason`` is False for this manager): a decode learns only that
  the room failed and answers its generic 500 (``DEFAULT_PREFILL_FAILURE_REASON``) where
  NIXL's carries the prefill's reason and status.  sglang's decode parses a reason frame
  from any backend (``CommonKVManager.parse_kv_status_message``,
  ``disaggregation/common/conn.py``), so a prefill with the flag sends one (an instance
  attribute set at registration): a decode with the flag answers the status the prefill
  decided (503 for a release, 504 for a timeout, ``kvmem_sglang.decode.prepare_abort``), a
  stock one logs the real reason.
"""

from __future__ import annotations

import logging
import time

from kvmem_sglang import kvpool, registrations, state
from kvmem_sglang.options import AdapterError

logger = logging.getLogger("kvmem.sglang")


# Seconds after a Mooncake write that failed during which slices of it may still move:
# batch_transfer_sync_write returns -1 while other slices of the batch are in flight;
# measured here (TCP, 8 slices of 1 MiB): they landed within milliseconds once the target
# registered the region again, and were refused about 1 s after the failure otherwise.
SETTLE_S = 2.0


class RegistrationError(AdapterError):
    """The transfer engine refused a registration or a deregistration (its code in the
    message)."""


def registerable_regions(result, manager, *args, **kwargs):
    """AFTER ``MooncakeKVManager._registerable_regions``: the kvmem pool's regions in
    place of its per-layer buffers (other buffers as sglang listed them)."""
    ptrs, lens = kvpool.coalesce([p for p, _ in result], [n for _, n in result])
    return list(zip(ptrs, lens))


def _regions(manager) -> tuple[list[int], list[int]]:
    regions = manager._registerable_regions()
    return [p for p, _ in regions], [n for _, n in regions]


def _role(manager) -> str:
    mode = getattr(manager, "disaggregation_mode", None)
    return str(getattr(mode, "value", mode) or "?")


def register_buffer_to_engine(original, manager, *args, **kwargs):
    """AROUND ``MooncakeKVManager.register_buffer_to_engine``: sglang's registration with
    its return code checked and logged (module docstring)."""
    from sglang.srt.disaggregation.utils import DisaggregationMode

    if getattr(manager, "disaggregation_mode", None) == DisaggregationMode.PREFILL:
        manager.kv_status_msg_carries_reason = True  # the decode reads it (docstring)
    if state.DEREGISTERED.get(manager, True) is False:
        # registered and not deregistered since: a resume refused on another TP rank,
        # whose deregistration this rank's engine refused, kept it (kvmem_sglang.release)
        logger.info(
            "kvmem-sglang: Mooncake %s: still registered; not registering twice", _role(manager)
        )
        return None
    ptrs, lens = _regions(manager)
    if not ptrs:
        return None
    code = manager.engine.batch_register(ptrs, lens)
    again = manager in state.DEREGISTERED  # registered before
    if code != 0:
        raise RegistrationError(
            f"Mooncake batch_register of {len(ptrs)} region(s) ({sum(lens)} bytes) on "
            f"this {_role(manager)} returned {code}{' at the resume' if again else ''}",
            "check the Mooncake engine's log above; the KV cache must be registered "
            "before it can be served",
        )
    state.DEREGISTERED.set(manager, False)
    logger.info(
        "kvmem-sglang: Mooncake %s: %s %d region(s), %d bytes (batch_register returned 0)",
        _role(manager),
        "registered again" if again else "registered",
        len(ptrs),
        sum(lens),
    )
    if again:
        registrations.resend(manager)
    return None


def deregister_buffer_to_engine(original, manager, *args, **kwargs):
    """AROUND ``MooncakeKVManager.deregister_buffer_to_engine``: sglang's deregistration
    (and its connection pool cleared, as sglang does), one region at a time, each code
    checked and logged.

    Not one ``batch_deregister`` as sglang does: Mooncake 0.3.13 answers a batch holding
    one region it does not have (-3) by dropping the batch's other regions half-way
    (measured here: they can then be neither deregistered, -3, nor registered again, -7
    "overlapped memory region", for the life of the engine).  Region by region, a refused
    region leaves the others as they were, and :func:`_register_again` can put them back.

    A manager deregistered already is left as it is: the adapter's release deregisters
    ahead of sglang's (``kvmem_sglang.release``), whose own call then finds nothing to do.
    """
    if state.DEREGISTERED.get(manager, False):
        return None
    ptrs, lens = _regions(manager)
    codes = [manager.engine.batch_deregister([p]) for p in ptrs]
    if any(codes):
        again = _register_again(manager, ptrs, lens)
        raise RegistrationError(
            f"Mooncake deregistration of {len(ptrs)} region(s) on this {_role(manager)} "
            f"refused (codes {codes})",
            "nothing is released; every region is registered again "
            f"(codes {again}) and the server keeps serving"
            if set(again) <= {0, -7}
            else "nothing is released, but not every region could be registered again "
            f"(codes {again}): transfers of this server may fail until it is restarted",
        )
    if hasattr(manager, "connection_pool"):
        with manager.connection_lock:
            manager.connection_pool.clear()
    state.DEREGISTERED.set(manager, True)
    logger.info(
        "kvmem-sglang: Mooncake %s: deregistered %d region(s), %d bytes "
        "(batch_deregister returned 0)",
        _role(manager),
        len(ptrs),
        sum(lens),
    )
    return None


def _register_again(manager, ptrs: list[int], lens: list[int]) -> list[int]:
    """After a refused deregistration: register each region again alone; the engine's
    codes.  -7 ("overlapped memory region") is the code for a region it still holds,
    which is what the caller needs too."""
    return [manager.engine.batch_register([p], [n]) for p, n in zip(ptrs, lens)]


def poison_unsettled_send(original, manager, room, *args, **kwargs):
    """AROUND ``MooncakeKVManager._poison_unsettled_send`` (sglang calls it for a write
    that failed and may still be moving, as its docstring in mooncake/conn.py says; it
    poisons the room's ABORT_ACK so the decode keeps the pages until its deferred-release
    timeout): also open a settle window of :data:`SETTLE_S` on the manager, which a
    release of this prefill's KV cache waits out before it deregisters and gives the
    memory back (``kvmem_sglang.prefill_drain``): sglang's worker uncounts the room at once, and
    a registration made again at once lets the late slices land (module docstring)."""
    until = time.monotonic() + SETTLE_S
    state.SETTLE_UNTIL.set(manager, max(state.SETTLE_UNTIL.get(manager, 0.0), until))
    logger.warning(
        "kvmem-sglang: Mooncake write of room %s failed and may still move for "
        "%.1f s; a release waits that long",
        room,
        SETTLE_S,
    )
    return original(manager, room, *args, **kwargs)
