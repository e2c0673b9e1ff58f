"""Small helpers shared by tests."""

import contextlib
import os

_SCALE = {"dev": 0.1, "ci": 1.0, "nightly": 10.0}


def examples(ci: int) -> int:
    """How many examples a property test runs: ``ci`` under the ``ci`` Hypothesis profile
    (make test), a tenth of it (at least 5) under ``dev`` (the default), ten times under
    ``nightly`` (KVMEM_HYPOTHESIS, tests/conftest.py)."""
    return max(5, int(ci * _SCALE[os.environ.get("KVMEM_HYPOTHESIS", "dev")]))


def vm_rss() -> int:
    """This process's resident set size in bytes (VmRSS of /proc/self/status)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def assert_closed_pool_refuses(pool, ids, chunk, **more) -> None:
    """Every use of the closed ``pool`` raises ClosedPoolError with its message: its
    buffers, pack/unpack of ``ids`` (``chunk`` packed from them before the close),
    release/resume, regions, residency, prefault, and the calls in ``more`` (name ->
    callable) that a test adds for its backend."""
    import pytest

    import kvmem
    from kvmem.errors import ClosedPoolError

    calls = {
        "k_buffer": lambda: pool.k_buffer,
        "v_buffer": lambda: pool.v_buffer,
        "token_buffers": pool.token_buffers,
        "pack": lambda: kvmem.pack_pages(pool, ids),
        "unpack": lambda: kvmem.unpack_pages(chunk, pool, ids),
        "release": pool.release,
        "resume": pool.resume,
        "regions": pool.regions,
        "resident_bytes": pool.resident_bytes,
        "prefault": pool.prefault,
        **more,
    }
    for name, call in calls.items():
        with pytest.raises(ClosedPoolError, match=r"the KV pool is closed; create a new pool"):
            call()


@contextlib.contextmanager
def no_host_sync():
    """Raise on any host sync torch makes inside (blocking copies, .item(), ...): CUDA's
    sync-debug mode "error" for the block, the previous mode restored after."""
    import torch

    old = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(old)


def no_core_dumps() -> None:
    """``preexec_fn`` of a child that a test expects to crash (or whose children it
    crashes): no core file from it or them."""
    import resource

    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def communicate(proc, timeout: float):
    """``(stdout, stderr)`` of ``proc`` once it ends; killed and reaped if it is still
    running after ``timeout`` s (then the TimeoutExpired goes on)."""
    try:
        return proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def pythonpath_env(*dirs, **extra) -> dict:
    """This process's environment with ``extra`` set and ``dirs`` (paths) ahead of its
    PYTHONPATH."""
    import os

    env = dict(os.environ, **extra)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(d) for d in dirs] + [q for q in env.get("PYTHONPATH", "").split(os.pathsep) if q]
    )
    return env
