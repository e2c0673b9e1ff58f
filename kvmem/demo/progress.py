"""``kvmem demo``'s progress line (tqdm, on stderr, only on a terminal)."""

from __future__ import annotations

import math
import sys
import time

from kvmem.demo.config import DemoConfig


class Progress:
    """The demo's progress: one tqdm line on stderr, redrawn in place at most every
    ``EVERY`` seconds: requests finished of ``cfg.requests``, their outcomes, pauses done,
    GB/s verified.  tqdm draws nothing when the stream is not a terminal (``disable=None``):
    a pipe or a log file gets only the report."""

    EVERY = 0.2  # seconds between redraws (the workers report about that often)
    NOTE = "{desc} ... {elapsed}"  # before the workload: what happens, for how long

    def __init__(self, cfg: DemoConfig, file=None):
        from tqdm import tqdm  # here: the library and `kvmem selfcheck` do without it

        self.cfg = cfg
        self.t = -math.inf  # the last draw
        self.bar = tqdm(
            total=cfg.requests,
            desc="kvmem demo",
            unit="req",
            leave=True,
            file=sys.stderr if file is None else file,
            disable=None,
            dynamic_ncols=True,
            bar_format=self.NOTE,
        )

    @property
    def shown(self) -> bool:
        return not self.bar.disable

    def note(self, text: str) -> None:
        """What the demo does before the workload (start-up, the raw bandwidth)."""
        self.bar.set_description_str(f"kvmem demo: {text}")

    def start(self) -> None:
        """The workload begins: count and clock from zero."""
        self.bar.set_description_str("kvmem demo", refresh=False)
        self.bar.bar_format = None  # tqdm's own: percentage, bar, count, times, postfix
        self.bar.reset(total=self.cfg.requests)

    def update(self, last: dict, elapsed: float, force: bool = False) -> None:
        """``last``: the workers' latest progress messages; ``elapsed``: seconds of
        workload."""
        t = time.monotonic()
        if not force and t - self.t < self.EVERY:
            return
        self.t = t
        p, d = last["prefill"], last["decode"]
        o = p.get("outcomes", {})
        gbps = d.get("bytes_verified", 0) / elapsed / 1e9 if elapsed > 0 else 0.0
        self.bar.n = p.get("finished", 0)
        self.bar.set_postfix_str(
            f"ok {o.get('succeeded', 0)} abort {o.get('aborted', 0)} timeout "
            f"{o.get('timed_out', 0)} fail {o.get('failed', 0)}, pauses "
            f"{p.get('pauses', 0)}/{self.cfg.pauses}, {gbps:.2f} GB/s",
            refresh=False,
        )
        self.bar.refresh()

    def close(self) -> None:
        """Leave the last state on its line; a second call does nothing."""
        self.bar.close()
