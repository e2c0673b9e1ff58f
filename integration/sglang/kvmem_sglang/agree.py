"""One outcome of a release or a resume on every tensor-parallel rank.

sglang 0.5.23 broadcasts ``release_memory_occupation`` and ``resume_memory_occupation``
to the scheduler of every TP rank and answers the client once rank 0 has answered
(``SchedulerWeightUpdaterManager`` in ``managers/scheduler_components/weight_updater.py``
runs on each rank; ``/release_memory_occupation`` in ``entrypoints/http_server.py``
answers 200 with no body whatever it did).  A rank that refuses alone (its transfer
engine refused a registration, its drain raised) leaves the ranks disagreeing: one has
released its KV cache and refuses every request while another serves, and the next
collective of the group (a prefill's ``pop_bootstrapped`` poll, a decode's transfer poll,
a forward's all-reduce) is entered by one rank only, so the server hangs.

So every refusal the adapter can decide at a release or a resume is one decision of the
ranks (:func:`refusal`): each rank gathers every rank's refusal (None, or its reason)
over the group the call was broadcast to, the one sglang's own release and resume barrier
on (``SchedulerWeightUpdaterManager.tp_cpu_group``, ``get_parallel().tp_group.cpu_group``),
and all take the same decision: if any rank refused, every rank refuses.

Deadlock: :mod:`kvmem_sglang.release` calls :func:`refusal` at fixed points (its
docstring lists them), on every rank, whatever the rank found, before the next one and
before sglang's own collectives of the call; a decision is the same on every rank, so the
ranks take the same path to the next point.  A rank that raises anything else there dies
with its scheduler, as in stock sglang (sglang then stops the server).  At TP 1, or
without a group (the harness's weight updater), no collective runs.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvmem_sglang import roles


@dataclass(frozen=True)
class Refusal:
    """What the ranks decided: ``refused`` the TP ranks that refused (in rank order),
    ``reason`` the first one's, ``ranks`` the size of the group."""

    refused: tuple[int, ...]
    reason: str
    ranks: int = 1

    def by(self) -> str:
        """How a log line names who refused: nothing at TP 1; else
        ``" on all 2 TP ranks, by TP rank 1"`` (``"TP ranks 0, 1"`` when several)."""
        if self.ranks <= 1:
            return ""
        rank = "TP ranks" if len(self.refused) > 1 else "TP rank"
        return f" on all {self.ranks} TP ranks, by {rank} {', '.join(map(str, self.refused))}"


def group_size(manager) -> int:
    """How many ranks take a decision of ``manager`` (sglang's weight updater) together:
    the size of its ``tp_cpu_group``; 1 without one or without torch.distributed."""
    group = getattr(manager, "tp_cpu_group", None)
    if group is None:
        return 1
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return int(dist.get_world_size(group=group))


def refusal(manager, mine: str | None) -> Refusal | None:
    """The decision of every rank of ``manager``'s TP group, given this rank's refusal
    ``mine`` (its reason, or None): None if no rank refused, else the :class:`Refusal`,
    the same on every rank.  Every rank of the group must call it at the same point
    (one ``all_gather_object`` over the group's CPU group; none at TP 1)."""
    n = group_size(manager)
    if n <= 1:
        return None if mine is None else Refusal((roles.tp_rank(),), mine)
    import torch.distributed as dist

    reasons: list = [None] * n
    dist.all_gather_object(reasons, mine, group=manager.tp_cpu_group)
    refused = tuple(r for r, why in enumerate(reasons) if why is not None)
    if not refused:
        return None
    return Refusal(refused, str(reasons[refused[0]]), n)
