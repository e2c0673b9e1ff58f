"""A pytest plugin for tests/test_bench_gpu_paths.py (``-p tests.random_draw_spy``): records
every random draw a benchmark makes that does not name its device, into the file
``$KVMEM_FILL_SPY`` (one line each).

A draw without a device (``torch.randint(..., generator=cpu_gen)`` then ``.to(dev)``)
runs on the host CPU's generator whatever the pool's device is: on the GPU host, 7.7 GiB
of pools filled that way took tens of seconds of one core.  On this CPU machine the pool
is on the host too, so the draw itself cannot show where it ran; what it names can:
``torch.randint`` / ``torch.randperm`` without ``device=``, or ``Tensor.random_`` with a
generator of another device than the tensor's."""

from __future__ import annotations

import os
import traceback

import torch


def _record(what: str) -> None:
    where = next(
        (
            f"{f.filename}:{f.lineno}"
            for f in reversed(traceback.extract_stack()[:-2])
            if "/bench/" in f.filename
        ),
        "?",
    )
    with open(os.environ["KVMEM_FILL_SPY"], "a") as f:
        f.write(f"{what} at {where}\n")


def _factory(name: str):
    real = getattr(torch, name)

    def spy(*args, **kwargs):
        if kwargs.get("device") is None:
            _record(f"torch.{name} without device=")
        return real(*args, **kwargs)

    return spy


def pytest_configure(config):
    for name in ("randint", "randperm"):
        setattr(torch, name, _factory(name))
    real_random_ = torch.Tensor.random_

    def random_(self, *args, generator=None, **kwargs):
        if generator is not None and generator.device.type != self.device.type:
            _record(f"Tensor.random_ on {self.device} with a {generator.device} generator")
        return real_random_(self, *args, generator=generator, **kwargs)

    torch.Tensor.random_ = random_
