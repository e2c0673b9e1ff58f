"""Naps of a loop that polls (:class:`Backoff`)."""

from __future__ import annotations

import math
import time


class Backoff:
    """Naps of a loop that polls (no NIXL progress thread): after ``spins`` steps in a row
    that made no progress the loop sleeps, ``first`` seconds, then twice as long each
    further step without progress, up to ``most``; a step that made progress ends the
    backoff at once (no nap after it, the next lack of progress starts from ``spins``
    again).  So real work never waits for a nap, and a loop that only waits for its peer
    (a PULLED, a CHUNK, a posted write) polls every ``most`` seconds or so instead of
    spinning on the core it shares with the peer and the transfers.

    ``pace(progressed)`` is called once per loop iteration; it returns the seconds it
    asked ``sleep`` for (0.0: no nap).  ``naps`` and ``napped`` count them."""

    def __init__(self, first: float, most: float, spins: int = 0, sleep=time.sleep):
        for name, v in (("first", first), ("most", most)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"Backoff: {name} must be a finite number of seconds, got {v!r}")
        if not 0 < first <= most:
            raise ValueError(f"Backoff: need 0 < first <= most, got {first!r}, {most!r}")
        if isinstance(spins, bool) or not isinstance(spins, int) or spins < 0:
            raise ValueError(f"Backoff: spins must be an int >= 0, got {spins!r}")
        self.first, self.most, self.spins, self.sleep = first, most, spins, sleep
        self.idle_steps = 0  # steps in a row without progress
        self.nap = 0.0  # the last nap (0.0: none since the last progress)
        self.naps = 0
        self.napped = 0.0

    def pace(self, progressed: bool) -> float:
        if progressed:
            self.idle_steps, self.nap = 0, 0.0
            return 0.0
        self.idle_steps += 1
        if self.idle_steps <= self.spins:
            return 0.0
        self.nap = min(max(2 * self.nap, self.first), self.most)
        self.naps += 1
        self.napped += self.nap
        self.sleep(self.nap)
        return self.nap
