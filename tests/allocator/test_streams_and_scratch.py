"""PageAllocator: one stream per allocator, sync-free reset, per-allocator scratch.
The stream rule proper needs CUDA (tests/gpu); here, the
argument checks, that every device-touching method goes through the rule, and the
rule's ordering logic against recording stand-ins for torch.cuda's stream calls."""

from __future__ import annotations

import contextlib
import random
import threading

import numpy as np
import pytest
import torch

import kvmem
from kvmem.allocator import PageAllocator
from kvmem.kernels import alloc as K

# -- the stream rule ----------------------------------------------------------------------

DEVICE_METHODS = [
    "reset",
    "synchronize",
    "check_invariants",
    "allocated_pages",
    "alloc",
    "free",
    "alloc_extend",
    "alloc_decode",
]


def test_cpu_allocator_has_no_stream_and_refuses_one():
    a = PageAllocator(5, 1)
    assert a.stream is None
    with pytest.raises(
        ValueError,
        match=r"stream= is for an allocator on a CUDA device; "
        r"this one is on cpu, got stream='s0'",
    ):
        PageAllocator(5, 1, stream="s0")


@pytest.mark.parametrize("name", DEVICE_METHODS)
def test_every_device_method_runs_under_the_stream_rule(name):
    assert hasattr(getattr(PageAllocator, name), "__wrapped__"), name


class _Stream:
    """A stand-in for torch.cuda.Stream that records what is asked of it."""

    def __init__(self, name, log):
        self.name, self.log = name, log

    def __eq__(self, other):
        return isinstance(other, _Stream) and other.name == self.name

    __hash__ = None

    def wait_stream(self, other):
        self.log.append(f"{self.name} waits for {other.name}")

    def synchronize(self):
        self.log.append(f"sync {self.name}")


def _fake_cuda(monkeypatch, alloc, current: str):
    """Make ``alloc`` look like a CUDA allocator bound to stream "own", with the caller
    on stream ``current``; torch.cuda's context managers record their use."""
    log = []
    alloc._stream = _Stream("own", log)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _Stream(current, log))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)

    @contextlib.contextmanager
    def ctx(what):
        log.append(f"enter {what}")
        yield
        log.append(f"exit {what}")

    monkeypatch.setattr(torch.cuda, "device", lambda d: ctx(f"device {d}"))
    monkeypatch.setattr(torch.cuda, "stream", lambda s: ctx(f"stream {s.name}"))
    return log


def test_a_call_from_another_stream_is_ordered_both_ways(monkeypatch):
    a = PageAllocator(9, 1)
    log = _fake_cuda(monkeypatch, a, current="caller")
    pages = a.alloc(3)
    assert pages.tolist() == [1, 2, 3]
    assert log == [
        "enter device cpu",
        "enter stream own",
        "own waits for caller",
        "caller waits for own",
        "exit stream own",
        "exit device cpu",
    ]
    log.clear()
    a.free(pages)
    assert log[2] == "own waits for caller" and log[-3] == "caller waits for own"


def test_a_call_on_the_allocators_stream_adds_nothing(monkeypatch):
    a = PageAllocator(9, 1)
    log = _fake_cuda(monkeypatch, a, current="own")
    # "already on the allocator's device": current_device() equals the device's index
    # (None for this CPU stand-in)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: None)
    a.free(a.alloc(2))
    assert log == []
    a.synchronize()
    assert log == ["sync own"]  # synchronize waits for the allocator's stream


def test_free_group_applies_on_the_allocators_stream(monkeypatch):
    a = PageAllocator(9, 1)
    p = a.alloc(4)
    log = _fake_cuda(monkeypatch, a, current="caller")
    with a.free_group():
        a.free(p[:2])
        a.free(p[2:])
    assert "own waits for caller" in log and log.count("enter stream own") == 3
    assert a.num_free == 8


def test_state_is_allocated_on_the_allocators_stream(monkeypatch):
    """CUDA's caching allocator hands a freed block out again on the stream it was
    allocated on.  State allocated on the caller's stream and written on the allocator's
    could go to the caller's next tensor while the allocator's stream still writes it
    (the allocator dropped with work queued); allocated on the allocator's stream, it
    cannot."""
    log, current = [], ["caller"]
    monkeypatch.setattr(kvmem.allocator, "own_stream", lambda device, stream: _Stream("own", log))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _Stream(current[-1], log))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)

    @contextlib.contextmanager
    def on(s):
        current.append(s.name)
        yield
        current.pop()

    monkeypatch.setattr(torch.cuda, "stream", on)
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    made = []
    for name in ("empty", "zeros"):
        real = getattr(torch, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            if kwargs.get("device") is not None:  # the allocator's own device tensors
                made.append((_name, current[-1]))
            return _real(*args, **kwargs)

        monkeypatch.setattr(torch, name, spy)
    PageAllocator(9, 1)
    assert len(made) == 3 and {s for _, s in made} == {"own"}, made  # _ring, _owned, _err


# -- reset makes no host tensor (so no host-to-device copy on CUDA) --------------------


def test_reset_makes_no_host_tensor(monkeypatch):
    a = PageAllocator(9, 2)
    a.alloc(3)

    def refuse(*args, **kwargs):
        raise AssertionError("reset() built a tensor from host data: a blocking copy on CUDA")

    monkeypatch.setattr(torch, "tensor", refuse)
    a.reset()
    monkeypatch.undo()
    assert a._err.tolist() == [0, 0, K.NO_BAD, K.NO_BAD]
    assert a.alloc(3).tolist() == [1, 2, 3]
    a.check_invariants()


# -- the free-time scratch is the allocator's own ---------------------------------------


def test_free_scratch_is_per_allocator():
    assert not hasattr(K, "_marks")  # no module-level scratch any more
    a, b = PageAllocator(3000, 1), PageAllocator(3000, 1)
    assert a._marks is not b._marks
    pages = a.alloc(2500)
    a.free(pages)  # a large free grows only a's scratch
    assert a._marks.shape[0] >= 2500 and b._marks.shape[0] <= 1024
    a.check_invariants()


def test_allocators_in_threads_stay_consistent():
    errors = []

    def work(seed):
        try:
            rng = random.Random(seed)
            a = PageAllocator(600, 1)
            held = []
            for _ in range(300):
                if held and rng.random() < 0.5:
                    a.free(held.pop(rng.randrange(len(held))))
                elif a.num_free:
                    held.append(a.alloc(rng.randint(1, min(a.num_free, 200))))
            a.check_invariants()
            assert a.num_allocated == sum(h.numel() for h in held)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_free_pages_cpu_without_scratch_still_works():
    owned = np.array([0, 1, 1, 1, 0], dtype=np.int32)
    ring = np.zeros(3, dtype=np.int64)
    assert K.free_pages_cpu(np.array([3, 1]), ring, owned, 0) is None
    assert owned.tolist() == [0, 0, 1, 0, 0] and ring[:2].tolist() == [3, 1]
    assert kvmem.PageAllocator(3, 1).alloc(2).tolist() == [1, 2]
