"""What the PD sides need of the model: the prefill's forward pass (:class:`Forward`) and
the decode's check of the KV that lands (:class:`Verifier`).

The sides move KV pages and free them exactly once; they compute nothing.  A
:class:`~kvmem.disagg.PrefillSide` calls its ``model`` to write each chunk's KV into the
chunk's pool pages, right before it packs or sends them; a
:class:`~kvmem.disagg.DecodeSide` calls its ``verifier`` on every chunk that lands, and
counts the bytes verified or corrupt.  The two of one deployment must agree on what a
request's KV is (the decode checks what the prefill wrote; kvmem.demo's ``Synth``, a
deterministic tape both processes build from one seed, is both).

Shapes, in the names the rest of kvmem uses (``docs/disagg.md``): a request's page ``j``
holds its tokens ``j * page_size ... (j + 1) * page_size - 1``; ``pool.k_buffer[l]``,
``pool.v_buffer[l]`` : ``[num_pages, page_size, num_kv_heads, head_dim]``; a packed chunk
of pages ``[first_page, last_page)`` is uint8 ``[packed_nbytes(spec, last_page -
first_page)]``: the K rows of every layer, then the V rows, each ``[tokens, heads,
head_dim]`` (``kvmem.kernels.pack``).

A verdict is a 0-dim bool tensor on the device of the bytes it looked at: on CUDA it is
computed there and read later through a :class:`~kvmem.disagg.device.HostCopy`, so a
check must not synchronise the host.  A wrong size is a False verdict, not an error.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class Forward(Protocol):
    """The prefill's model: writes a chunk's KV into the pool (what a forward pass does to
    the KV cache)."""

    max_tokens: int
    """The longest request it takes, in prompt tokens: ``PrefillSide.add_request``
    refuses a longer one (ValueError)."""

    def prepare(self, device: torch.device) -> None:
        """Called once, by the side's constructor, with the pool's device, before any
        other call: set-up that must not fall inside a step (a copy to the device).  May
        do nothing."""

    def fill(self, pool, rid: int, first_page: int, last_page: int, pages: torch.Tensor) -> None:
        """Write the KV of request ``rid``'s pages ``[first_page, last_page)`` into
        ``pool``'s pages ``pages`` (int64 ``[last_page - first_page]``, on the pool's
        device), every layer, K and V.  Called inside ``step()``; on CUDA the work is
        queued on the pool device's current stream (the side packs the pages after it on
        that stream) and must not synchronise the host."""


@runtime_checkable
class Verifier(Protocol):
    """The decode's check: whether the bytes that landed are what the prefill's model
    wrote."""

    max_tokens: int
    """The longest request it knows, in prompt tokens: the decode refuses a ``REQ`` for
    more (ProtocolError)."""

    def prepare(self, device: torch.device) -> None:
        """As :meth:`Forward.prepare`."""

    def verify(self, rid: int, first_page: int, last_page: int, data: torch.Tensor) -> torch.Tensor:
        """Whether ``data`` (uint8 ``[nbytes]``, a packed chunk in the decode's landing
        buffer) is exactly request ``rid``'s pages ``[first_page, last_page)``: a 0-dim
        bool tensor on ``data``'s device."""

    def verify_pages(self, pool, rid: int, first_page: int, last_page: int, pages) -> torch.Tensor:
        """Whether ``pool``'s pages ``pages`` (int64 ``[last_page - first_page]`` on the
        host: a NumPy array) hold exactly request ``rid``'s pages ``[first_page,
        last_page)``: the check of a chunk written (push, direct) or read (pull) straight
        into the pool.  A 0-dim bool tensor on the pool's device."""


# Each protocol's members, in the order an error names the missing ones (typing has no
# public list of them before Python 3.13).
_MEMBERS: dict[type, tuple[str, ...]] = {
    Forward: ("max_tokens", "prepare", "fill"),
    Verifier: ("max_tokens", "prepare", "verify", "verify_pages"),
}


def prepare_model(model, protocol: type, device, who: str) -> None:
    """Check that ``model`` has every member of ``protocol`` (:class:`Forward` or
    :class:`Verifier`) and a ``max_tokens`` int >= 1, then call ``model.prepare(device)``.
    TypeError or ValueError naming ``who`` (the side) and what is missing or wrong; the
    model is not prepared then."""
    name = f"kvmem.disagg.{protocol.__name__}"
    missing = [m for m in _MEMBERS[protocol] if not hasattr(model, m)]
    if missing:
        raise TypeError(
            f"{who}: {type(model).__name__} is not a {name}: it has no {', '.join(missing)}"
        )
    n = model.max_tokens
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"{who}: {name}.max_tokens must be an int, got {n!r}")
    if n < 1:
        raise ValueError(f"{who}: {name}.max_tokens must be >= 1, got {n}")
    model.prepare(device)
