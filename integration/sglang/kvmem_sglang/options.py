"""The adapter's options: ``SGLANG_KVMEM`` and the ``SGLANG_KVMEM_*`` variables.

Every variable is read once, when the plugin loads, and checked there: a value the
adapter does not understand stops the process with an error naming the variable (a typo
must not silently run stock sglang, or run kvmem with a default the user did not ask
for).  The README lists them; :data:`VARIABLES` is the same list, and a test keeps the two
in step.  The options a process runs with are ``kvmem_sglang.state.PROCESS.options``
(:class:`ProcessOptions`); this module imports nothing of the adapter.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


PREFIX = "kvmem-sglang (SGLANG_KVMEM=1): "
RUN_STOCK = "unset SGLANG_KVMEM (or set it to 0) to run this server on stock sglang"


class AdapterError(RuntimeError):
    """The adapter cannot do what the flag asks: a hook target is missing, the sglang
    version or the model's KV layout is one it does not support, an option is bad.

    Its text starts with :data:`PREFIX` and ends with what to change (``change``;
    default: :data:`RUN_STOCK`), so an operator who sees only that line knows whose
    refusal it is and which setting to touch.

    Raised at call time (inside sglang's pool or allocator construction) it propagates
    to sglang and stops the scheduler; at plugin load it is turned into ``SystemExit``,
    since sglang logs and swallows plugin exceptions."""

    def __init__(self, reason: str, change: str = RUN_STOCK):
        self.reason, self.change = reason, change
        super().__init__(f"{PREFIX}{reason}; {change}")


# name -> (default, allowed values or None for free text, one-line meaning)
VARIABLES: dict[str, tuple[str, tuple[str, ...] | None, str]] = {
    "SGLANG_KVMEM": ("0", ("0", "1"), "1 turns the adapter on; 0 or unset leaves sglang stock"),
    "SGLANG_KVMEM_BACKEND": (
        "auto",
        ("auto", "host", "cuda_vmm", "plain"),
        "memory behind the KV pool: auto = host mapping on CPU, CUDA VMM on a GPU; "
        "plain = one ordinary allocation (no release)",
    ),
    "SGLANG_KVMEM_CHECK": (
        "0",
        ("0", "1"),
        "1 validates every allocator call on the host (one device sync per call; for "
        "debugging); 0 checks on the device and raises at the next synchronising call",
    ),
    "SGLANG_KVMEM_REGISTER": (
        "regions",
        ("regions", "layers"),
        "what the PD transfer engine registers: the pool's few regions, or sglang's one "
        "buffer per layer and per K/V",
    ),
    "SGLANG_KVMEM_STAGING": (
        "1",
        ("0", "1"),
        "1 runs sglang's heterogeneous-TP staging gather/scatter on kvmem's pack/unpack "
        "kernels (only matters with SGLANG_DISAGG_STAGING_BUFFER=1)",
    ),
    "SGLANG_KVMEM_PREFAULT": (
        "1",
        ("0", "1"),
        "1 backs every page of a host pool again at resume instead of at first touch",
    ),
    "SGLANG_KVMEM_DRAIN_TIMEOUT": (
        "30",
        None,
        "seconds a KV release waits for transfer writes already posted to settle (DONE "
        "or ERR) before it goes on with an error log; a positive number",
    ),
    "SGLANG_KVMEM_TRANSFER": (
        "kvmem",
        ("kvmem", "sglang"),
        "how a NIXL or Mooncake prefill moves KV: kvmem = merged runs across the chunks "
        "queued for a decode (NIXL: several writes in flight, no spinning, "
        "kvmem_sglang.transfer; Mooncake: calls within its TCP queue, "
        "kvmem_sglang.mooncake_send; at unequal attention TP, sglang's per-head slices "
        "in calls within that queue, kvmem_sglang.mooncake_slice); sglang = sglang's "
        "own send",
    ),
}
DEFAULT_DRAIN_TIMEOUT = 30.0
# sglang's own variable for the prefill-side transfer timeout, which 0.5.23 reads nowhere
# (the adapter applies it: kvmem_sglang.prefill); the seed fix's default.
TRANSFER_TIMEOUT_VAR = "SGLANG_DISAGGREGATION_TRANSFER_TIMEOUT"
DEFAULT_TRANSFER_TIMEOUT = 600.0


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
        raise AdapterError(
            f"{name}={raw!r} is not a positive number of seconds",
            f"set {name} to a positive number, or unset it for the default ({default:g})",
        )
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
    transfer_timeout: float = DEFAULT_TRANSFER_TIMEOUT
    transfer: bool = True  # SGLANG_KVMEM_TRANSFER=kvmem (the default)

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
                    f"{name}={raw!r} is not understood (allowed: {', '.join(allowed)})",
                    f"set {name} to one of those, or unset it for the default ({default})",
                )
            values[name] = value
            if name == "SGLANG_KVMEM" and value == "0":
                return cls(False, None, False, True, True, True)
        backend = values["SGLANG_KVMEM_BACKEND"]
        drain_timeout = positive_seconds(
            "SGLANG_KVMEM_DRAIN_TIMEOUT",
            env.get("SGLANG_KVMEM_DRAIN_TIMEOUT"),
            DEFAULT_DRAIN_TIMEOUT,
        )
        transfer_timeout = transfer_timeout_from_env(env)
        return cls(
            enabled=True,
            backend=None if backend == "auto" else backend,
            check=values["SGLANG_KVMEM_CHECK"] == "1",
            register_regions=values["SGLANG_KVMEM_REGISTER"] == "regions",
            staging=values["SGLANG_KVMEM_STAGING"] == "1",
            prefault=values["SGLANG_KVMEM_PREFAULT"] == "1",
            drain_timeout=drain_timeout,
            transfer_timeout=transfer_timeout,
            transfer=values["SGLANG_KVMEM_TRANSFER"] == "kvmem",
        )


def transfer_timeout_from_env(env=None) -> float:
    """``SGLANG_DISAGGREGATION_TRANSFER_TIMEOUT`` in seconds (default 600); AdapterError
    naming the value when it is not a positive number."""
    env = os.environ if env is None else env
    return positive_seconds(
        TRANSFER_TIMEOUT_VAR, env.get(TRANSFER_TIMEOUT_VAR), DEFAULT_TRANSFER_TIMEOUT
    )


class ProcessOptions:
    """The options of this process: none until the plugin loads with the flag on, then
    the ones it parsed, for good.  The process has one,
    ``kvmem_sglang.state.PROCESS.options``."""

    def __init__(self) -> None:
        self._options: Options | None = None

    def activate(self, options: Options) -> None:
        """Make ``options`` this process's options (the plugin does, once, with the flag
        on).  A second activation with other options is an error: hooks already
        installed read the first."""
        if self._options is not None and self._options != options:
            raise AdapterError(
                f"the adapter's options are already set ({self._options}); "
                f"cannot change them to {options} in a running process"
            )
        self._options = options

    def is_active(self) -> bool:
        """Whether the plugin loaded with the flag on in this process."""
        return self._options is not None

    def active(self) -> Options:
        """This process's options; AdapterError when the plugin has not loaded with the
        flag on (the hooks are only installed then)."""
        if self._options is None:
            raise AdapterError("kvmem hook called before the plugin loaded with SGLANG_KVMEM=1")
        return self._options
