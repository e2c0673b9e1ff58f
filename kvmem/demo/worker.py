"""The worker processes of ``kvmem demo`` (started by :mod:`kvmem.demo.orchestrator` with
the 'spawn' context; this module is what each child imports): ``--prefills`` prefill
workers and ``--decodes`` decode workers, one and one by default.

This module is the process's entry point (:func:`worker_main`) and the protocol below.
The two worker classes share their pipe, start-up, pacing and final report
(:class:`~kvmem.demo.worker_base.Worker`), and each is the one place its side's setup and
workload are driven from (:mod:`kvmem.demo.prefill_worker`,
:mod:`kvmem.demo.decode_worker`).

Each worker owns a KVPool (host backend), a PageAllocator, a NixlEngine (UCX, no progress
thread: the loops poll) and one side of the PD lifecycle
(:class:`~kvmem.disagg.PrefillSide` or :class:`~kvmem.disagg.DecodeSide`), whose peers
are every worker of the other kind.  With ``--hosts netns`` a worker first enters its
network namespace (:func:`kvmem.demo.hosts.enter`).  After the start-up exchange below,
every PD control message travels as a NIXL notification inside the sides; the pipe to
the parent carries only the orchestration (start, pause, stop, kill) and the counters.

Pipe messages, ``(kind, payload)``::

    worker -> parent                        parent -> worker
    ("ready", {metadata, setup times})      ("peer", [the other kind's metadata])
    ("bw_listening", None)      decode 0    ("bw_listen", None)     decode 0: poll notifs
    ("bw_result", {...})        prefill 0   ("bw_run", None)        prefill 0: timed writes
    ("bw_checked", {...})       decode 0    ("bw_end", None)        decode 0: check bytes
    ("progress", {...})         ~5 per s    ("start", {...})        the workload begins
    ("pause_decode", i)         prefill     ("pause", i)            decode: pause i now
    ("resumed", i)              decode      ("decode_resumed", i)   prefill: pause i done
    ("kill_me", {...})          decode      ("arm_kill", None)      decode: ask to be killed
                                            ("peer_gone", agent)    prefill: route elsewhere
                                            ("expect", n)           decode: n requests are
                                                                    yours (several decodes)
    ("done", {...})             own work finished, still stepping
    ("final", {...})            after ("stop", None): audit, close, counters
    ("error", traceback)        then the worker exits with status 1

The bandwidth phase runs between prefill 0 and decode 0 only (their raw NIXL write is
the baseline, over the same link as the workload's), and prefill 0's packed/direct
calibration gives the other prefills their threshold (``start``'s payload).

Requests: prefill ``p`` of ``P`` runs the request ids ``p, p + P, p + 2P, ...`` (ids are
unique across the prefills, as a decode requires), each bound to the decode its router
picks (:meth:`~kvmem.demo.prefill_worker.PrefillWorker.route`: the least loaded decode
that is neither paused nor gone).  Pauses are decided by the prefill workers from their
own counts of finished requests, one at a time each, alternating sides: pause ``i`` of
``--pauses`` belongs to prefill ``(i // 2) % P``; even ``i``: that prefill pauses itself;
odd ``i``: it asks for a decode pause through the parent (which picks the decode and runs
one decode pause at a time per decode) and keeps stepping, which is what lets the
decode's pause complete: the prefills drain their writes into it and acknowledge.  A
prefill's ``j``-th pause starts when ``thresholds[j]`` of its requests have finished, and
admission stops at ``thresholds[j + 1] + concurrency`` until it is over, so every pause
happens with traffic in flight and none is left for after the last request.  The other
workers keep serving.

``--kill-decode``: once a quarter of the requests have finished the parent arms the last decode;
that decode, as soon as it is in the middle of receiving a request from every prefill
(some pages landed, not all), reports those requests (``kill_me``) and stops (no more
steps), and the parent kills it with SIGKILL.  The prefills are told (``peer_gone``) so
their routers stop picking it and its requests end at once (``PrefillSide.peer_gone``:
500); one that ended before the prefill heard ended as the lifecycle says (a failed
write, 500, or a timeout, 504).
"""

from __future__ import annotations

import logging
import os
import signal
import traceback

import torch

from kvmem.demo.decode_worker import DecodeWorker
from kvmem.demo.hosts import enter
from kvmem.demo.prefill_worker import PrefillWorker


def worker_main(role: str, cfg, conn, names: dict, index: int = 0, place=None) -> None:
    """Entry point of a worker process.  SIGINT and SIGTERM are ignored: the parent owns
    the workers' lives (a Ctrl-C or SIGTERM to the demo stops them through their pipes,
    which end their loops; a worker that does not stop is killed), so a signal sent to
    the whole process group ends the run the same way as one sent to the parent.
    ``index``: the worker's among its kind; ``place``: its network namespace
    (:meth:`kvmem.demo.hosts.NetnsHosts.place`; None: this host's).

    The process ends here, never by returning: status 0 after its ``final`` report (its
    engine closed in order by then), 1 after an ``error`` message; through
    :func:`kvmem.transfer.nixl_exit.end_process`, so the native destructors that crash
    at exit on a host with RDMA libraries do not run."""
    from kvmem.transfer.nixl_exit import end_process

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # This process hosts a PD side: its kvmem.* records (WARNING and up, the root's
    # level) go to stderr, named after the worker.  NIXL's logger keeps its own handler.
    handler = logging.StreamHandler()
    handler.setFormatter(
        logging.Formatter(f"kvmem demo {role} worker: %(levelname)s %(name)s: %(message)s")
    )
    logging.getLogger("kvmem").addHandler(handler)
    try:
        enter(place)  # before the NIXL agent: its UCX context reads the network devices
        torch.set_num_threads(1)  # two workers on a small machine: one core each
        os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # not an INFO line per agent
        worker = (PrefillWorker if role == "prefill" else DecodeWorker)(cfg, conn, names, index)
        worker.run()
        status = 0
    except BaseException:  # noqa: BLE001 - tell the parent, whatever it was
        try:
            conn.send(("error", traceback.format_exc()))
        except (OSError, EOFError):
            pass
        status = 1
    end_process(status)
