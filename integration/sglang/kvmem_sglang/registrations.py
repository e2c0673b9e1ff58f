"""A PD decode's registration with its prefill ranks across a release of its KV cache, on
any transfer backend (NIXL, Mooncake).

sglang's decode sends its registration (its KV memory as the transfer engine names it)
to a prefill rank the first time it meets one (``CommonKVReceiver._register_kv_args``,
``disaggregation/common/conn.py``).  While the decode's KV cache is released its
memory is deregistered: a registration sent then names memory no peer can reach (NIXL:
the prefill's bootstrap thread died preparing lists over it; Mooncake: every write
fails).  So :func:`register_kv_args` sends none while deregistered, and the backend's
registration hook (``kvmem_sglang.nixl``, ``kvmem_sglang.mooncake``) calls :func:`resend`
at the resume, which sends the new registration to every prefill rank the decode knows,
off the scheduler's thread and again, with a growing wait, to a rank it did not reach.
"""

from __future__ import annotations

import logging
import threading

from kvmem_sglang import state

logger = logging.getLogger("kvmem.sglang")

# Tries of one registration to one prefill rank: the first at once, then after
# RESEND_FIRST_S, twice as long each time up to RESEND_MAX_S, RESEND_TRIES in all (about
# two minutes).  A guess, not a measurement: long enough to ride out a prefill rank that
# restarts or a network that drops for a while, short enough that a rank that is gone
# stops being tried.  sglang bounds each send (SGLANG_DISAGGREGATION_ZMQ_SEND_TIMEOUT, 1 s).
RESEND_FIRST_S = 0.5
RESEND_MAX_S = 30.0
RESEND_TRIES = 10


def register_kv_args(original, receiver, *args, **kwargs):
    """AROUND ``CommonKVReceiver._register_kv_args`` (a decode meeting a prefill rank
    for the first time): while the decode's KV is deregistered nothing is sent (the
    request is refused, :func:`kvmem_sglang.decode.pop_preallocated`), and the resume
    sends the registration (:func:`resend`); otherwise sglang's."""
    if state.DEREGISTERED.get(receiver.kv_mgr, False) and receiver.bootstrap_infos:
        logger.info(
            "kvmem-sglang: registration with prefill rank(s) %s deferred to the "
            "resume (this decode's KV cache is released)",
            ", ".join(f"{i.get('rank_ip')}:{i.get('rank_port')}" for i in receiver.bootstrap_infos),
        )
        return True
    return original(receiver, *args, **kwargs)


class Resends:
    """One decode manager's registrations made again (:data:`state.RESENDS`): ``made``
    counts them, and ``changed`` is notified at each; the sends of an older one stop once
    a newer one is made or the KV cache is deregistered again (:meth:`stale`), so a
    prefill rank never gets an old registration after a new one."""

    def __init__(self) -> None:
        self.made = 0
        self.changed = threading.Condition()

    def stale(self, made: int, manager) -> bool:
        """Whether the ``made``-th registration is no longer the one to send."""
        return self.made != made or state.DEREGISTERED.get(manager, False)


def resend(manager):
    """On a decode after its registration was made again: send the new registration to
    every prefill rank in its connection pool, on the adapter's registrations thread
    (``state.PROCESS.registrations``), never on the caller's, and never raising into it.
    The Future of those sends (its result: the number of ranks reached), or None when
    there is nothing to send (not a decode, no rank known, or the message could not be
    built: logged).

    Each rank is tried until it takes the message, :data:`RESEND_TRIES` times at most,
    the first at once and then after :data:`RESEND_FIRST_S`, twice as long each time up
    to :data:`RESEND_MAX_S`; each failed try is logged with the rank and the next try,
    the last as given up.  The tries of a registration stop when a newer one is made (a
    later resume) or the KV cache is deregistered again (:class:`Resends`): the sends of
    the resumes go out in their order, each after the one before it stopped."""
    from sglang.srt.disaggregation.utils import DisaggregationMode

    try:
        if getattr(manager, "disaggregation_mode", None) != DisaggregationMode.DECODE:
            return None
        with manager.connection_lock:
            infos = [i for infos in manager.connection_pool.values() for i in infos]
        ranks: dict[tuple, dict] = {}
        for info in infos:
            ranks.setdefault((info["rank_ip"], info["rank_port"]), info)
        if not ranks:
            return None
        message = manager.build_receiver_registration_message()
        resends = state.RESENDS.setdefault(manager, Resends)
        with resends.changed:
            resends.made += 1
            made = resends.made
            resends.changed.notify_all()  # an older registration's tries stop now
        return state.PROCESS.registrations.submit(_send, manager, resends, made, ranks, message)
    except Exception:  # noqa: BLE001 - the resume stands; the prefills keep the old one
        logger.exception("kvmem-sglang: this decode's new registration could not be sent")
        return None


def _send(manager, resends: Resends, made: int, ranks: dict[tuple, dict], message) -> int:
    """The tries of :func:`resend` (on the registrations thread); the ranks reached."""
    from sglang.srt.disaggregation.common.conn import CommonKVReceiver

    left, wait, tries = dict(ranks), RESEND_FIRST_S, 0
    while left and tries < RESEND_TRIES:
        if tries:
            with resends.changed:
                if resends.changed.wait_for(lambda: resends.stale(made, manager), wait):
                    break
            wait = min(2 * wait, RESEND_MAX_S)
        elif resends.stale(made, manager):
            break
        tries += 1
        for (ip, port), info in list(left.items()):
            try:
                sock, sock_lock = CommonKVReceiver._connect_to_bootstrap_server(info)
                with sock_lock:
                    sock.send_multipart(message)
                del left[(ip, port)]
            except Exception:  # noqa: BLE001 - tried again, below
                last = tries == RESEND_TRIES
                logger.warning(
                    "kvmem-sglang: sending this decode's new registration to prefill rank "
                    "%s:%s failed (try %d of %d)%s",
                    ip,
                    port,
                    tries,
                    RESEND_TRIES,
                    "; giving up: that rank keeps the old registration"
                    if last
                    else f"; again in {wait:.1f} s",
                    exc_info=True,
                )
    if left and resends.stale(made, manager):
        logger.info(
            "kvmem-sglang: this decode's registration changed (a later resume, or a "
            "release) before %d prefill rank(s) took it; they get the next one",
            len(left),
        )
    logger.info(
        "kvmem-sglang: this decode's new registration sent to %d of %d prefill rank(s)",
        len(ranks) - len(left),
        len(ranks),
    )
    return len(ranks) - len(left)
