"""``kvmem demo``: the main job, an app beside the library that uses it as a user would.  A
prefill worker and a decode worker, two processes, each with its own KVPool, PageAllocator
and NIXL agent (UCX over loopback), run the PD lifecycle of :mod:`kvmem.disagg` over
requests of varied prompt lengths with chunked prefill, and by default every fault of
:class:`~kvmem.demo.faults.FaultPlan` plus pause/resume cycles on both sides.  The decode
side verifies every chunk that lands, on arrival; at the end both sides audit their pages.

::

    parent (orchestrator)                     orchestration only: start, relay the two
      |  pipe                   |  pipe        metadata blobs once, pause the decode when
      v                         v              the prefill asks, progress line, report
    prefill worker  <== NIXL ==>  decode worker
    PrefillSide                   DecodeSide   every PD control message: NIXL notifications
    KVPool + alloc + staging      KVPool + alloc + landing buffer

Phases: start-up (pools pre-faulted, agents created, metadata exchanged); raw NIXL write
bandwidth between the same two processes (one registered ``bw_mib`` buffer into another,
the figure the demo's throughput is compared with); the workload; stop (audit, close,
counters).

The parts, one job each: :mod:`.config` (:class:`DemoConfig`, the sizes it implies, its
checks), :mod:`.command` (the options, :func:`main`, the ``--json`` file: the one module
that prints), :mod:`.orchestrator` (the parent process: :func:`run`), :mod:`.worker` (the
worker processes), :mod:`.result` (the result dict and its checks), :mod:`.report` (the
result as text), :mod:`.progress` (the progress line), :mod:`.faults` (the seeded fault
plan), :mod:`.synth` (the stand-in model: deterministic KV both sides know, a
:class:`kvmem.disagg.Forward` and :class:`kvmem.disagg.Verifier`) and :mod:`.hosts` (one
host, or two network namespaces).  kvmem itself imports none of them.

Exit status: 0 when every request ended in exactly one outcome, no page leaked on either
side, every landed byte verified and no control message was refused; 1 when a check
failed; 2 for bad options; 3 when a worker failed or stopped answering before its final
report.  A worker that died of a signal after its final report (a native destructor at
its exit, say) leaves the results valid: the report carries a warning naming the signal.
"""

from kvmem.demo.command import add_arguments, main
from kvmem.demo.config import DemoConfig
from kvmem.demo.orchestrator import WorkerFailed, run

__all__ = ["DemoConfig", "run", "WorkerFailed", "add_arguments", "main"]
