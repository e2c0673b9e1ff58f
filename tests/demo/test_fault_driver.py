"""The demo's fault driver (kvmem.demo.faults.FaultPlan.drive) against real sides: a
planned abort comes before the timeout that would end the request in the same state, also
when the process was held off the CPU right after the request entered it."""

from __future__ import annotations

import contextlib

import pytest

from kvmem.demo.faults import FaultPlan
from kvmem.disagg import KVPoll, Outcome
from tests.disagg.harness import Pair

TIMEOUT = 1.0


@contextlib.contextmanager
def planned(kind: str, state: KVPoll, wait: float):
    """A pair whose faults are a plan of aborts only, with one request of ``kind`` added
    and stepped until it is in ``state``: ``(pair, plan, rid)``; checked clean at the end."""
    pair = Pair(
        num_pages=97,
        chunk_tokens=64,
        max_tokens=256,
        bootstrap_timeout=TIMEOUT,
        transfer_timeout=TIMEOUT,
        decode_timeout=5 * TIMEOUT,
    )
    try:
        plan = FaultPlan(seed=7, rates={"abort": 1.0}, chunk_tokens=64, max_tokens=256, wait=wait)
        pair.faults = pair.prefill.faults = pair.decode.faults = plan
        rid = next(r for r in range(10_000) if plan.kind(r) == kind)
        pair.prefill.add_request(rid, plan.tokens(rid))
        pair.run_until(lambda: pair.prefill.state(rid) == state)
        yield pair, plan, rid
        pair.run_until(lambda: rid in pair.finished)
        assert pair.finished[rid].outcome == Outcome.ABORTED, pair.finished[rid]
        pair.run_idle()
        pair.assert_clean()
    finally:
        pair.close()


def drive_and_step(pair, plan) -> None:
    """One pass of the demo worker's prefill loop: the driver, then the side's step."""
    plan.drive(pair.prefill, pair.clock())
    pair.step()


@pytest.mark.parametrize(
    "kind,state",
    [("abort_waiting", KVPoll.WaitingForInput), ("abort_bootstrapping", KVPoll.Bootstrapping)],
)
def test_abort_wins_over_a_stall_longer_than_the_timeout(kind, state):
    with planned(kind, state, wait=0.05) as (pair, plan, rid):
        # the process is held off the CPU for longer than the timeout right after the step
        # that moved the request into the state, before the driver first sees it there
        pair.clock.advance(1.5 * TIMEOUT)
        drive_and_step(pair, plan)


def test_abort_waits_its_time_in_the_state_when_nothing_stalls():
    with planned("abort_waiting", KVPoll.WaitingForInput, wait=0.2) as (pair, plan, rid):
        for _ in range(3):  # 0.1 s seen in the state: not yet
            drive_and_step(pair, plan)
            pair.clock.advance(0.05)
        assert rid not in pair.finished and pair.prefill.state(rid) == KVPoll.WaitingForInput
        pair.clock.advance(0.1)
        drive_and_step(pair, plan)


def test_abort_planned_later_comes_before_a_late_boot_times_the_request_out():
    """The decode's BOOT late (its process held off the CPU): the request of a planned
    abort in WaitingForInput is still Bootstrapping once half the bootstrap timeout has
    run, and is aborted there instead of ending as a timeout case."""
    with planned("abort_waiting", KVPoll.Bootstrapping, wait=0.05) as (pair, plan, rid):
        plan.drive(pair.prefill, pair.clock())
        assert pair.prefill.state(rid) == KVPoll.Bootstrapping  # not yet halfway
        pair.clock.advance(0.6 * TIMEOUT)
        plan.drive(pair.prefill, pair.clock())  # before any step delivers the BOOT
        assert rid in pair.prefill.finished
