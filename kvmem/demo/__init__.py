"""``kvmem demo``: the main job.  A prefill worker and a decode worker, two processes, each
with its own KVPool, PageAllocator and NIXL agent (UCX over loopback), run the PD lifecycle
of :mod:`kvmem.disagg` over requests of varied prompt lengths with chunked prefill, and by
default every fault of :class:`~kvmem.disagg.faults.FaultPlan` plus pause/resume cycles on
both sides.  The decode side verifies every chunk that lands, on arrival; at the end both
sides audit their pages.

::

    parent (this module)                      orchestration only: start, relay the two
      |  pipe                   |  pipe        metadata blobs once, pause the decode when
      v                         v              the prefill asks, progress line, report
    prefill worker  <== NIXL ==>  decode worker
    PrefillSide                   DecodeSide   every PD control message: NIXL notifications
    KVPool + alloc + staging      KVPool + alloc + landing buffer

Phases: start-up (pools pre-faulted, agents created, metadata exchanged); raw NIXL write
bandwidth between the same two processes (one registered ``bw_mib`` buffer into another,
the figure the demo's throughput is compared with); the workload; stop (audit, close,
counters).  The worker side is in :mod:`kvmem.demo_worker`.

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
