"""A seeded fault plan: which fault each request gets, decided from the seed and the
request id alone, so the prefill and decode processes agree without talking about it.

Kinds (each a row of the lifecycle table (docs/disagg.md)):

=====================  =========================================================
kind                   how it is injected
=====================  =========================================================
none                   -
abort_bootstrapping    decode withholds BOOT; the client aborts while Bootstrapping
abort_waiting          the forward is held back; abort in WaitingForInput
abort_transferring     the 2nd chunk is held back; abort in Transferring
abort_in_batch         abort arrives while the request's forward runs
bootstrap_timeout      decode withholds BOOT; the prefill's bootstrap timeout fires
timeout_waiting        the forward is held back until the transfer timeout (504)
timeout_transferring   the 2nd chunk is held back until the transfer timeout (504)
fail_first             the write of the first chunk fails (500)
fail_middle            the write of a middle chunk fails (500)
fail_last              the write of the extra-state (last) chunk fails (500)
=====================  =========================================================

``rates`` gives the probability of each family ("abort", "timeout", "fail"); a family's
kinds are equally likely.  Requests whose fault needs several chunks get enough tokens.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from kvmem.disagg.outcome import KVPoll
from kvmem.disagg.decode import DecodeFaults
from kvmem.disagg.prefill import Faults

FAMILIES = {
    "abort": ("abort_bootstrapping", "abort_waiting", "abort_transferring", "abort_in_batch"),
    "timeout": ("bootstrap_timeout", "timeout_waiting", "timeout_transferring"),
    "fail": ("fail_first", "fail_middle", "fail_last"),
}
KINDS = ("none",) + tuple(k for ks in FAMILIES.values() for k in ks)
# chunks a kind needs to be injectable (middle needs a chunk on either side of it)
_MIN_CHUNKS = {"abort_transferring": 2, "timeout_transferring": 2, "fail_middle": 3}


@dataclass
class FaultPlan(Faults, DecodeFaults):
    """Per-request faults for a run; implements both sides' fault hooks.  ``wait`` is how
    long an abort waits in its target state (seconds of the sides' clock)."""

    seed: int
    rates: dict
    chunk_tokens: int
    max_tokens: int
    min_tokens: int = 1
    wait: float = 0.05
    _kinds: dict = field(default_factory=dict)
    _tokens: dict = field(default_factory=dict)
    _seen: dict = field(default_factory=dict)  # rid -> time first seen in the target state

    def __post_init__(self):
        for fam, rate in self.rates.items():
            if fam not in FAMILIES:
                raise ValueError(f"unknown fault family {fam!r} (known: {sorted(FAMILIES)})")
            if not 0.0 <= rate <= 1.0:
                raise ValueError(f"fault rate of {fam!r} must be in [0, 1], got {rate}")
        if sum(self.rates.values()) > 1.0:
            raise ValueError(f"fault rates add up to more than 1: {self.rates}")

    def _draw(self, rid: int) -> None:
        rng = random.Random(self.seed * 1_000_003 + rid)
        x, kind = rng.random(), "none"
        for fam in sorted(self.rates):
            if x < self.rates[fam]:
                kind = FAMILIES[fam][rng.randrange(len(FAMILIES[fam]))]
                break
            x -= self.rates[fam]
        need = _MIN_CHUNKS.get(kind, 1)
        lo = max(self.min_tokens, (need - 1) * self.chunk_tokens + 1)
        if lo > self.max_tokens:
            kind, lo = "none", self.min_tokens
        self._kinds[rid] = kind
        self._tokens[rid] = rng.randint(lo, self.max_tokens)

    def kind(self, rid: int) -> str:
        if rid not in self._kinds:
            self._draw(rid)
        return self._kinds[rid]

    def tokens(self, rid: int) -> int:
        if rid not in self._tokens:
            self._draw(rid)
        return self._tokens[rid]

    def _chunks(self, rid: int) -> int:
        return -(-self.tokens(rid) // self.chunk_tokens)

    # --- decode-side hook ------------------------------------------------------------------
    def withhold_boot(self, rid: int) -> bool:
        return self.kind(rid) in ("abort_bootstrapping", "bootstrap_timeout")

    # --- prefill-side hooks ------------------------------------------------------------------
    def stall(self, rid: int, seq: int) -> bool:
        k = self.kind(rid)
        if k in ("abort_waiting", "timeout_waiting"):
            return seq == 0
        if k in ("abort_transferring", "timeout_transferring"):
            return seq == 1
        return False

    def fail_send(self, rid: int, seq: int, aux: bool) -> bool:
        k = self.kind(rid)
        if k == "fail_last":
            return aux
        if aux:
            return False
        if k == "fail_first":
            return seq == 0
        if k == "fail_middle":
            return seq == self._chunks(rid) // 2
        return False

    def during_forward(self, side, batch) -> None:
        for req, *_ in batch:
            if self.kind(req.rid) == "abort_in_batch":
                side.abort(req.rid)

    def drive(self, side, now: float) -> None:
        """Issue the client aborts that are due: called by the prefill's loop each step,
        before the step checks its timeouts.  An abort is due once the request was seen
        ``wait`` seconds in its target state, or once half of the timeout that would end
        it there has run: a process held off the CPU between the step that moved the
        request into the state and this call must not let the timeout, checked after this
        call, come first (it would end an abort case as a timeout case).  For the same
        reason a request still in a state before its target once half of that state's
        timeout has run (its decode's BOOT late on a loaded machine) is aborted there: an
        abort in that state, a row of the table that ends the same way."""
        for rid in list(side.reqs):
            want = _ABORT_IN.get(self.kind(rid))
            if want is None:
                continue
            poll = side.state(rid)
            if poll == want:
                t0 = self._seen.setdefault(rid, now)
                if now - t0 >= self.wait or now >= _halfway(side, side.reqs[rid], want):
                    side.abort(rid)
                    self._seen.pop(rid, None)
            elif poll in _BEFORE[want] and now >= _halfway(side, side.reqs[rid], poll):
                side.abort(rid)


# the state each abort kind aborts in, and the states a request passes before it
_ABORT_IN = {
    "abort_bootstrapping": KVPoll.Bootstrapping,
    "abort_waiting": KVPoll.WaitingForInput,
    "abort_transferring": KVPoll.Transferring,
}
_BEFORE = {
    KVPoll.Bootstrapping: (),
    KVPoll.WaitingForInput: (KVPoll.Bootstrapping,),
    KVPoll.Transferring: (KVPoll.Bootstrapping, KVPoll.WaitingForInput),
}


def _halfway(side, req, poll: KVPoll) -> float:
    """When half of the timeout that ends ``req`` in ``poll`` has run (the prefill's
    rules: the bootstrap timeout from its creation, the transfer timeout from its BOOT)."""
    if poll == KVPoll.Bootstrapping:
        return req.t_created + side.bootstrap_timeout / 2
    return req.t_bootstrapped + side.transfer_timeout / 2
