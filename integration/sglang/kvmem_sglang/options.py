"""The adapter's options: ``SGLANG_KVMEM`` and the ``SGLANG_KVMEM_*`` variables.

Every variable is read once, when the plugin loads, and checked there: a value the
adapter does not understand stops the process with an error naming the variable (a typo
must not silently run stock sglang, or run kvmem with a default the user did not ask
for).  The README lists them; :data:`VARIABLES` is the same list, and a test keeps the two
in step.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


class AdapterError(RuntimeError):
    """The adapter cannot do what the flag asks: a hook target is missing, the sglang
    version or the model's KV layout is one it does not support, an option is bad.

    Raised at call time (inside sglang's pool or allocator construction) it propagates
    to sglang and stops the scheduler; at plugin load it is turned into ``SystemExit``,
    since sglang logs and swallows plugin exceptions."""


# name -> (default, allowed values or None for free text, one-line meaning)
VARIABLES: dict[str, tuple[str, tuple[str, ...] | None, str]] = {
    "SGLANG_KVMEM": ("0", ("0", "1"), "1 turns the adapter on; 0 or unset leaves sglang stock"),
    "SGLANG_KVMEM_BACKEND": (
        "auto", ("auto", "host", "cuda_vmm", "plain"),
        "memory behind the KV pool: auto = host mapping on CPU, CUDA VMM on a GPU; "
        "plain = one ordinary allocation (no release)"),
    "SGLANG_KVMEM_CHECK": (
        "0", ("0", "1"),
        "1 validates every allocator call on the host (one device sync per call; for "
        "debugging); 0 checks on the device and raises at the next synchronising call"),
    "SGLANG_KVMEM_REGISTER": (
        "regions", ("regions", "layers"),
        "what the PD transfer engine registers: the pool's few regions, or sglang's one "
        "buffer per layer and per K/V"),
    "SGLANG_KVMEM_STAGING": (
        "1", ("0", "1"),
        "1 runs sglang's heterogeneous-TP staging gather/scatter on kvmem's pack/unpack "
        "kernels (only matters with SGLANG_DISAGG_STAGING_BUFFER=1)"),
    "SGLANG_KVMEM_PREFAULT": (
        "1", ("0", "1"),
        "1 backs every page of a host pool again at resume instead of at first touch"),
    "SGLANG_KVMEM_DRAIN_TIMEOUT": (
        "30", None,
        "seconds a KV release waits for transfer writes already posted to settle (DONE "
        "or ERR) before it goes on with an error log; a positive number"),
}
DEFAULT_DRAIN_TIMEOUT = 30.0


def positive_seconds(name: str, raw: str | None, default: float) -> float:
    """The variable ``name`` (its text ``raw``, None when unset) as a positive, finite
    number of seconds; blank or unset: ``default``.  AdapterError naming the value
    otherwise."""
    raw_s = (raw or "").strip()
    if not raw_s:
        return default
    try:
        value = float(raw_s)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise AdapterError(f"{name}={raw!r} is not a positive number of seconds")
    return value


@dataclass(frozen=True)
class Options:
    enabled: bool
    backend: str | None  # None: the device's default backend
    check: bool
    register_regions: bool
    staging: bool
    prefault: bool
    drain_timeout: float = DEFAULT_DRAIN_TIMEOUT

    @classmethod
    def from_env(cls, env=None) -> Options:
        """Read and check the variables; AdapterError naming the first bad one.  With
        the flag off the other variables are not read at all."""
        env = os.environ if env is None else env
        values = {}
        for name, (default, allowed, _) in VARIABLES.items():
            raw = env.get(name, "")
            value = raw.strip() or default
            if allowed is not None and value not in allowed:
                raise AdapterError(
                    f"{name}={raw!r} is not understood (allowed: {', '.join(allowed)})")
            values[name] = value
            if name == "SGLANG_KVMEM" and value == "0":
                return cls(False, None, False, True, True, True)
        backend = values["SGLANG_KVMEM_BACKEND"]
        drain_timeout = positive_seconds("SGLANG_KVMEM_DRAIN_TIMEOUT",
                                         env.get("SGLANG_KVMEM_DRAIN_TIMEOUT"),
                                         DEFAULT_DRAIN_TIMEOUT)
        return cls(
            enabled=True,
            backend=None if backend == "auto" else backend,
            check=values["SGLANG_KVMEM_CHECK"] == "1",
            register_regions=values["SGLANG_KVMEM_REGISTER"] == "regions",
            staging=values["SGLANG_KVMEM_STAGING"] == "1",
            prefault=values["SGLANG_KVMEM_PREFAULT"] == "1",
            drain_timeout=drain_timeout,
        )
