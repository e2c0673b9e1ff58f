"""A PD decode's registration with its prefill ranks across a release of its KV cache, on
any transfer backend (NIXL, Mooncake).

sglang's decode sends its registration (its KV memory as the transfer engine names it)
to a prefill rank the first time it meets one (``CommonKVReceiver._register_kv_args``,
``disaggregation/common/conn.py``).  While the decode's KV cache is released its
memory is deregistered: a registration sent then names memory no peer can reach (NIXL:
the prefill's bootstrap thread died preparing lists over it; Mooncake: every write
fails).  So :func:`register_kv_args` sends none while deregistered, and the backend's
registration hook (``kvmem_sglang.nixl``, ``kvmem_sglang.mooncake``) calls :func:`resend`
at the resume, which sends the new registration to every prefill rank the decode knows.
"""

from __future__ import annotations

import logging

from kvmem_sglang import state

logger = logging.getLogger("kvmem.sglang")


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


def resend(manager) -> int:
    """On a decode after its registration was made again: send the new registration to
    every prefill rank in its connection pool; the number of ranks reached."""
    from sglang.srt.disaggregation.utils import DisaggregationMode

    if getattr(manager, "disaggregation_mode", None) != DisaggregationMode.DECODE:
        return 0
    with manager.connection_lock:
        infos = [i for infos in manager.connection_pool.values() for i in infos]
    ranks: dict[tuple, dict] = {}
    for info in infos:
        ranks.setdefault((info["rank_ip"], info["rank_port"]), info)
    if not ranks:
        return 0
    from sglang.srt.disaggregation.common.conn import CommonKVReceiver

    message = manager.build_receiver_registration_message()
    sent = 0
    for (ip, port), info in ranks.items():
        try:
            sock, sock_lock = CommonKVReceiver._connect_to_bootstrap_server(info)
            with sock_lock:
                sock.send_multipart(message)
            sent += 1
        except Exception:  # noqa: BLE001 - that prefill then keeps the old registration
            logger.exception(
                "kvmem-sglang: sending this decode's new registration to prefill rank %s:%s failed",
                ip,
                port,
            )
    logger.info(
        "kvmem-sglang: this decode's new registration sent to %d of %d prefill rank(s)",
        sent,
        len(ranks),
    )
    return sent
