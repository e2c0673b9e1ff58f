"""A ``benchmark`` fixture for hosts without pytest-benchmark (the bare GPU host: no
package index, nothing installed): bench/conftest.py registers this module as a plugin
when pytest-benchmark is not loaded (not installed, or ``-p no:benchmark``), so the
benchmarks run there unchanged.

It offers the part of pytest-benchmark's fixture the benchmarks use, with the same
meaning:

    benchmark.pedantic(target, args=(), kwargs=None, setup=None, teardown=None,
                       rounds=1, warmup_rounds=0, iterations=1) -> target's last result
        ``setup()`` runs before every round (warm-up rounds included), untimed; when it
        returns ``(args, kwargs)`` those are the target's arguments for that round, and
        ``iterations`` must then be 1.  A round's time is the wall time of its
        ``iterations`` calls divided by ``iterations`` (``time.perf_counter``).
    benchmark.stats.stats.median, .min, .max, .mean, .rounds   seconds, over the timed rounds
    benchmark.extra_info                                        a dict, kept with nothing
    benchmark.enabled                                           always True

Anything else (``benchmark(fn)``, pytest-benchmark's command-line options, its table and
JSON) is pytest-benchmark's alone: the report of bench/conftest.py is the output."""

from __future__ import annotations

import statistics
import time

import pytest


class Stats:
    """Seconds per round of one ``pedantic`` call."""

    def __init__(self, data: list[float]):
        self.data = list(data)
        self.rounds = len(self.data)
        self.median = statistics.median(self.data)
        self.mean = statistics.fmean(self.data)
        self.min, self.max = min(self.data), max(self.data)


class _Metadata:
    def __init__(self, stats: Stats):
        self.stats = stats


class Timer:
    """The ``benchmark`` fixture's object (module docstring)."""

    enabled = True

    def __init__(self):
        self.extra_info: dict = {}
        self.stats: _Metadata | None = None

    def pedantic(
        self,
        target,
        args=(),
        kwargs=None,
        setup=None,
        teardown=None,
        rounds=1,
        warmup_rounds=0,
        iterations=1,
    ):
        if rounds < 1 or iterations < 1 or warmup_rounds < 0:
            raise ValueError(
                f"rounds and iterations must be >= 1 and warmup_rounds >= 0, "
                f"got {rounds}, {iterations}, {warmup_rounds}"
            )
        if self.stats is not None:
            raise RuntimeError("benchmark.pedantic may run once per test (as pytest-benchmark's)")
        if setup is not None and iterations != 1:
            raise ValueError("with setup=, iterations must be 1 (as pytest-benchmark asks)")
        times, result = [], None
        for i in range(warmup_rounds + rounds):
            a, kw = args, kwargs or {}
            if setup is not None:
                got = setup()
                if got is not None:
                    a, kw = got
            t = time.perf_counter()
            for _ in range(iterations):
                result = target(*a, **kw)
            dt = (time.perf_counter() - t) / iterations
            if teardown is not None:
                teardown(*a, **kw)
            if i >= warmup_rounds:
                times.append(dt)
        self.stats = _Metadata(Stats(times))
        return result


@pytest.fixture
def benchmark() -> Timer:
    """pytest-benchmark's fixture, the part the benchmarks use (module docstring)."""
    return Timer()
