"""``kvmem demo``'s configuration: :class:`DemoConfig`, every option a run depends on, the
sizes derived from it (pools, landing buffer, memory) and its validation."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from kvmem.demo.hosts import HOSTS, netns_refusal

DTYPES = ("bf16", "fp16", "fp32", "fp8")
CHUNK_MODES = ("auto", "packed", "direct")
TRANSFER_MODES = ("push", "pull")
LANDING_ALIGN = 256  # the decode's landing Arena rounds each region up to this


@dataclass(frozen=True)
class DemoConfig:
    """Everything a run depends on; both workers get the same copy.

    Defaults: a model of 8 layers x 8 KV heads x 128 dims, bf16, 16-token pages (32 KiB of
    KV per token), prompts of 1..2048 tokens prefilled in 512-token chunks (16 MiB per
    chunk, up to 64 MiB per request), 8 requests in flight.
    """

    requests: int = 300
    abort_rate: float = 0.12
    timeout_rate: float = 0.04
    fail_rate: float = 0.06
    pauses: int = 4
    page_size: int = 16
    layers: int = 8
    heads: int = 8
    head_dim: int = 128
    dtype: str = "bf16"
    chunk_tokens: int = 512
    max_tokens: int = 2048
    concurrency: int = 8
    seed: int = 0
    bootstrap_timeout: float = 2.0  # the prefill's, seconds (sglang: 600)
    transfer_timeout: float = 2.0
    abort_wait: float = 0.02  # how long a client abort waits in its target state
    bw_mib: int = 256  # raw NIXL bandwidth buffer; 0: skip that phase
    bw_rounds: int = 5
    chunks: str = "auto"  # packed | direct | auto (per chunk, threshold calibrated at start)
    # pull: the decode reads; push: the prefill writes.  Pull by default (docs/demo.md,
    # "Pacing").
    transfer_mode: str = "pull"
    hosts: str = "one"  # one: every worker on this host; netns: two network namespaces
    prefills: int = 1  # prefill workers
    decodes: int = 1  # decode workers
    kill_decode: bool = False  # SIGKILL the last decode mid-transfer (needs decodes >= 2)

    # --- derived ------------------------------------------------------------------------
    def spec(self):
        import torch

        import kvmem

        dt = {
            "bf16": torch.bfloat16,
            "fp16": torch.float16,
            "fp32": torch.float32,
            "fp8": torch.float8_e4m3fn,
        }[self.dtype]
        return kvmem.KVSpec(
            num_layers=self.layers,
            num_kv_heads=self.heads,
            head_dim=self.head_dim,
            page_size=self.page_size,
            dtype=dt,
        )

    def calibrates(self) -> bool:
        """Whether the start-up measures the packed/direct threshold (push, --chunks auto)."""
        return self.transfer_mode == "push" and self.chunks == "auto"

    def rates(self) -> dict:
        return {"abort": self.abort_rate, "timeout": self.timeout_rate, "fail": self.fail_rate}

    @property
    def decode_timeout(self) -> float:
        """Well above the prefill's timeouts: those faults are the prefill's to detect."""
        return 5.0 * max(self.bootstrap_timeout, self.transfer_timeout)

    def request_pages(self) -> int:
        return -(-self.max_tokens // self.page_size)

    def token_bytes(self) -> int:
        """KV bytes of one token, all layers."""
        return self.spec().page_bytes // self.page_size

    def slots(self) -> int:
        """Requests at their longest that each side makes room for: those in flight, a
        quarter more for the ones still ending (the decode frees a request when the
        prefill's ABORT or AUX arrives, a little after the prefill counts it finished)."""
        return self.concurrency + -(-self.concurrency // 4)

    def prefill_pages(self) -> int:
        # A request holds its prefill pages until its last chunk is packed.
        return self.slots() * self.request_pages() + 1

    def decode_pages(self) -> int:
        # Every prefill's requests may be routed to one decode (the others paused or gone).
        return self.prefills * self.slots() * self.request_pages() + 1

    def landing_bytes(self) -> int:
        import kvmem
        from kvmem.disagg.protocol import AUX_BYTES

        per = kvmem.packed_nbytes(self.spec(), self.request_pages()) + AUX_BYTES
        return self.prefills * self.slots() * (per + LANDING_ALIGN)

    def batch_tokens(self) -> int:
        return 4 * self.chunk_tokens

    def memory_bytes(self) -> int:
        """About what the workers allocate (pools, staging, landing, bandwidth buffers)."""
        page = self.spec().page_bytes
        staging = 8 * (self.chunk_tokens // self.page_size) * page  # PrefillSide's default
        return (
            self.prefills * (self.prefill_pages() * page + staging)
            + self.decodes * (self.decode_pages() * page + self.landing_bytes())
            + 2 * (self.bw_mib << 20)
        )

    def validate(self) -> None:
        """ValueError naming the option, for anything the run would trip on later."""

        def positive(name):
            v = getattr(self, name)
            if v < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {v}")

        for name in (
            "requests",
            "page_size",
            "layers",
            "heads",
            "head_dim",
            "chunk_tokens",
            "max_tokens",
            "concurrency",
            "prefills",
            "decodes",
        ):
            positive(name)
        if self.hosts not in HOSTS:
            raise ValueError(f"--hosts must be one of {', '.join(HOSTS)}, got {self.hosts!r}")
        if self.requests < self.prefills:
            raise ValueError(
                f"--requests {self.requests} is fewer than --prefills "
                f"{self.prefills}: every prefill runs at least one request"
            )
        if self.kill_decode and self.decodes < 2:
            raise ValueError(
                f"--kill-decode needs --decodes >= 2 (a decode that survives "
                f"serves the rest), got --decodes {self.decodes}"
            )
        for name in ("abort_rate", "timeout_rate", "fail_rate"):
            v = getattr(self, name)
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"--{name.replace('_', '-')} must be in [0, 1], got {v}")
        if self.abort_rate + self.timeout_rate + self.fail_rate > 1.0:
            raise ValueError(
                f"--abort-rate + --timeout-rate + --fail-rate must be <= 1, got "
                f"{self.abort_rate} + {self.timeout_rate} + {self.fail_rate}"
            )
        if self.pauses < 0:
            raise ValueError(f"--pauses must be >= 0, got {self.pauses}")
        if self.pauses > self.requests:
            raise ValueError(
                f"--pauses {self.pauses} is more than --requests {self.requests}: "
                "pauses happen between requests"
            )
        if self.chunk_tokens % self.page_size:
            raise ValueError(
                f"--chunk-tokens must be a multiple of --page-size "
                f"{self.page_size}, got {self.chunk_tokens}"
            )
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.seed < 0:
            raise ValueError(f"--seed must be >= 0, got {self.seed}")
        if self.bw_mib < 0:
            raise ValueError(f"--bw-mib must be >= 0, got {self.bw_mib}")
        if self.transfer_mode not in TRANSFER_MODES:
            raise ValueError(
                f"--transfer-mode must be one of {', '.join(TRANSFER_MODES)}, "
                f"got {self.transfer_mode!r}"
            )
        if self.chunks not in CHUNK_MODES:
            raise ValueError(
                f"--chunks must be one of {', '.join(CHUNK_MODES)}, got {self.chunks!r}"
            )
        if self.transfer_mode == "pull" and self.chunks != "auto":
            raise ValueError(
                f"--chunks {self.chunks} contradicts --transfer-mode pull (the "
                "decode reads pool pages; --chunks chooses how a push writes)"
            )
        for t in (self.bootstrap_timeout, self.transfer_timeout):
            if not (math.isfinite(t) and t > 0):
                raise ValueError(f"--timeout must be a number of seconds > 0, got {t}")
        need = self.memory_bytes()
        have = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        bw = 2 * (self.bw_mib << 20)
        if need > 0.75 * have and bw >= need - bw:  # the bandwidth buffers are most of it
            raise ValueError(
                f"--bw-mib {self.bw_mib}: the raw-bandwidth buffers (one in each worker) need "
                f"{bw / 2**30:.1f} GiB, about {need / 2**30:.1f} GiB with the workload, more "
                f"than 3/4 of this machine's {have / 2**30:.1f} GiB: lower --bw-mib (0 skips "
                "that phase)"
            )
        if need > 0.75 * have:
            raise ValueError(
                f"this model and workload need about {need / 2**30:.1f} GiB of memory for the "
                f"{self.prefills + self.decodes} workers, more than 3/4 of this machine's "
                f"{have / 2**30:.1f} GiB: lower --max-tokens, --concurrency, the model size "
                "or the worker counts"
            )
        if self.hosts == "netns":
            why = netns_refusal()
            if why:
                raise ValueError(why)
