"""Run by tests/sglang/test_release_tp.py, in two processes at once (``.venv-e2e``'s
interpreter, which has Mooncake's engine): TP rank ``KVMEM_TEST_RANK`` of a PD prefill at
TP 2 with ``SGLANG_KVMEM=1``, the two ranks in one gloo group (a file store at
``KVMEM_TEST_STORE``), as sglang's scheduler ranks are.

Each rank is :class:`tests.sglang.prefill_env.PrefillHarness` (sglang's real scheduler
parts and ``SchedulerWeightUpdaterManager``, whose TP group is the gloo group of the two
processes) with its bootstrap queue's manager a real ``MooncakeKVManager`` over the
rank's KV pool, registered with Mooncake's transfer engine over TCP (rank 0 runs sglang's
bootstrap server).  The faults of the end-to-end tier (``tests/e2e/standins/faults.py``:
the real engine refuses a registration, -7, or a deregistration, -3) are armed in one
rank's own folder (``KVMEM_E2E_FAULTS``) only, so that one rank is refused, as on a TP 2
server where only the first rank to reach an armed fault is refused.

Both ranks run the same steps, each a release or a resume sglang broadcasts to them:

* ``release_refused``: rank 1's engine refuses the deregistration of one region;
* ``release``, ``resume``: a plain cycle;
* ``resume_refused``: rank 0's engine refuses the registration (the rank whose answer
  the client gets);
* ``drain_refused``: rank 1's drain raises (a planted failure of sglang's paths);
* ``resume_kept``: after a release, rank 1's engine refuses the registration and rank
  0's then refuses the deregistration that would take its own back;
* ``resume_after``: the next resume.

After each step each rank records its state: the tags it holds released, its pool's
state and resident bytes, whether its manager is deregistered, what its faults noted;
then one all-reduce over the group, which returns only while the ranks are in step.
Prints one JSON object on its last line.
"""

from __future__ import annotations

import os
from pathlib import Path

from tests.sglang.sglang_env import script_main

RANK = int(os.environ.get("KVMEM_TEST_RANK", "0"))
STORE = os.environ.get("KVMEM_TEST_STORE", "")
FAULTS = Path(os.environ.get("KVMEM_E2E_FAULTS", "."))


def _arm(rank: int, fault: str) -> None:
    if rank == RANK:
        (FAULTS / fault).write_text("")


def main() -> dict:
    import torch
    import torch.distributed as dist

    from testkit.sglang_pair import MOONCAKE_ENV

    for k, v in MOONCAKE_ENV.items():
        os.environ.setdefault(k, v)
    FAULTS.mkdir(parents=True, exist_ok=True)
    store = dist.FileStore(STORE, 2)
    dist.init_process_group("gloo", store=store, rank=RANK, world_size=2)
    from tests.sglang.prefill_env import PrefillHarness

    h = PrefillHarness(
        page_size=4,
        pages=64,
        rank=RANK,
        server_args=dict(disaggregation_transfer_backend="mooncake", tp_size=2),
    )
    from sglang.srt.distributed.device_communicators import mooncake_transfer_engine as mte
    from sglang.srt.runtime_context import get_disagg, get_parallel

    get_parallel().override_permanently(pp_group=None)  # pp_size 1: never used

    from kvmem_sglang import kvpool, prefill, release, state
    from testkit.sglang_pair import bootstrap_server, manager
    from tests.e2e.standins import faults

    faults.apply(mte)  # the engine's calls, refused where a test armed a fault
    mte.init_mooncake_transfer_engine("127.0.0.1", gpu_id=0)
    held = []  # rank 0's bootstrap server, alive as long as this function runs
    if RANK == 0:
        server, port = bootstrap_server("mooncake")
        held.append(server)
        store.set("bootstrap_port", str(port))
    port = int(store.get("bootstrap_port"))
    get_disagg()._set("disaggregation_bootstrap_port", port)
    pm = manager(
        h.kv, h.s.disagg_metadata_buffers, "prefill", h.server_args, "mooncake", RANK, tp=2
    )
    h.s.disagg_prefill_bootstrap_queue.kv_manager = pm
    pool = kvpool.pool_of(h.kv)
    assert pool is not None, "no kvmem pool under the harness's KV cache"

    def snapshot() -> dict:
        fired = FAULTS / "fired.log"
        return dict(
            tags=sorted(h.wu.offload_tags),
            pool_released=pool.released,
            resident=pool.resident_bytes(),
            deregistered=state.DEREGISTERED.get(pm),
            fired=fired.read_text().splitlines() if fired.exists() else [],
            refused=[prefill.STATS.refused_releases, prefill.STATS.refused_resumes],
        )

    def in_step() -> int:
        t = torch.ones(1)
        dist.all_reduce(t)  # both ranks here, or this never returns
        return int(t.item())

    out: dict = {"rank": RANK, "pool_bytes": pool.nbytes, "start": snapshot()}

    def step(name: str, call) -> None:
        call()
        out[name] = snapshot() | {"in_step": in_step()}

    _arm(1, "deregister-missing")
    step("release_refused", h.release)
    step("release", h.release)
    step("resume", h.resume)
    step("release_again", h.release)
    _arm(0, "register-overlap")
    step("resume_refused", h.resume)
    step("resume", h.resume)

    real_drain = release.drain_for_release

    def planted(sched, what):
        raise RuntimeError("planted: sglang's drain path raised")

    if RANK == 1:
        release.drain_for_release = planted
    try:
        step("drain_refused", h.release)
    finally:
        release.drain_for_release = real_drain
    step("release_for_kept", h.release)
    _arm(1, "register-overlap")
    _arm(0, "deregister-missing")
    step("resume_kept", h.resume)
    step("resume_after", h.resume)
    step("release_last", h.release)
    step("resume_last", h.resume)
    out["bootstrap_servers"] = len(held)
    return out


if __name__ == "__main__":
    script_main(main)
