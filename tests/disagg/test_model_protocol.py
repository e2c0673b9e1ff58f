"""kvmem.disagg without the demo: importing it loads nothing of kvmem.demo, and the PD
sides run with any model that keeps the contract of kvmem.disagg.model (Forward on the
prefill, Verifier on the decode), here one written for this test, in every transfer
mode; a verifier that disagrees with the model is what counts the bytes corrupt; a model
that lacks a member is refused before the side registers anything."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kvmem
from kvmem.disagg import DecodeSide, Forward, PrefillSide, Verifier
from kvmem.disagg.protocol import AUX_BYTES

ROOT = Path(__file__).resolve().parents[2]
SPEC = kvmem.KVSpec(num_layers=2, num_kv_heads=2, head_dim=64, page_size=16)
PAGES = 65


class Ramp:
    """KV in which every byte is a function of where it is: the request, the page of the
    request, the buffer (K of layer 0 .. L-1, then V of layer 0 .. L-1) and the byte within
    that page's row, shifted by ``salt``.  ``prepared``: the devices ``prepare`` got."""

    def __init__(self, spec: kvmem.KVSpec, max_tokens: int, salt: int = 0):
        self.max_tokens, self.salt = max_tokens, salt
        per_token = [spec.k_token_bytes] * spec.num_layers
        if spec.v_token_bytes:
            per_token += [spec.v_token_bytes] * spec.num_layers
        self.row_bytes = [n * spec.page_size for n in per_token]  # one page of each buffer
        self.prepared: list = []

    def prepare(self, device) -> None:
        self.prepared.append(torch.device(device))

    def page(self, rid: int, j: int, b: int) -> torch.Tensor:
        """uint8 [row_bytes[b]]: page ``j`` of request ``rid`` in buffer ``b``."""
        pos = torch.arange(self.row_bytes[b], dtype=torch.int64)
        return ((pos * 7 + rid * 131 + j * 17 + b * 29 + self.salt) % 251).to(torch.uint8)

    @staticmethod
    def rows(pool, b: int) -> torch.Tensor:
        buf = (pool.k_buffer + pool.v_buffer)[b]
        return buf.view(buf.shape[0], -1).view(torch.uint8)  # [num_pages, page bytes]

    def fill(self, pool, rid, first_page, last_page, pages) -> None:
        for b in range(len(self.row_bytes)):
            rows = self.rows(pool, b)
            for i, p in enumerate(pages.tolist()):
                rows[p] = self.page(rid, first_page + i, b)

    def verify(self, rid, first_page, last_page, data) -> torch.Tensor:
        want = torch.cat(
            [
                self.page(rid, j, b)
                for b in range(len(self.row_bytes))
                for j in range(first_page, last_page)
            ]
        )
        ok = want.numel() == data.numel() and torch.equal(want, data.cpu())
        return torch.tensor(ok, device=data.device)

    def verify_pages(self, pool, rid, first_page, last_page, pages) -> torch.Tensor:
        ids = [int(p) for p in pages]
        ok = len(ids) == last_page - first_page and all(
            torch.equal(self.rows(pool, b)[p], self.page(rid, first_page + i, b))
            for b in range(len(self.row_bytes))
            for i, p in enumerate(ids)
        )
        return torch.tensor(ok, device=pool.device)


def _pair(engine_pair, model, verifier, mode: str):
    pe, de = engine_pair
    pull = "pull" if mode == "pull" else "push"
    decode = DecodeSide(
        kvmem.KVPool(SPEC, PAGES),
        kvmem.PageAllocator(PAGES, 16),
        de,
        verifier,
        prefill_peer=pe.name,
        transfer_mode=pull,
        landing_bytes=kvmem.packed_nbytes(SPEC, PAGES - 1) + 65536,
    )
    finished = {}
    prefill = PrefillSide(
        kvmem.KVPool(SPEC, PAGES),
        kvmem.PageAllocator(PAGES, 16),
        pe,
        model,
        decode_peer=de.name,
        chunk_tokens=64,
        transfer_mode=pull,
        direct_threshold=0 if mode == "direct" else None,
        on_finish=lambda rid, reason: finished.__setitem__(rid, reason),
    )
    pe.add_peer(de.local_metadata())
    de.add_peer(pe.local_metadata())
    return prefill, decode, finished


def _run(prefill, decode, finished, lengths) -> None:
    for rid, tokens in enumerate(lengths):
        prefill.add_request(rid, tokens)
    for _ in range(5000):
        if len(finished) == len(lengths) and prefill.idle and decode.idle:
            return
        prefill.step()
        decode.step()
    raise AssertionError(f"not done: finished {finished}")


@pytest.mark.subprocess  # a fresh interpreter: what importing kvmem loads
def test_import_kvmem_and_kvmem_disagg_load_nothing_of_the_demo():
    code = (
        "import sys, kvmem, kvmem.disagg, kvmem.disagg.metrics, kvmem.disagg.calibrate\n"
        "print(sorted(m for m in sys.modules if m.split('.')[:2] == ['kvmem', 'demo']))"
    )
    p = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "[]"


def test_the_demo_synth_keeps_both_contracts():
    from kvmem.demo.synth import Synth

    synth = Synth(SPEC, 256)
    assert isinstance(synth, Forward) and isinstance(synth, Verifier)
    assert isinstance(Ramp(SPEC, 256), Forward) and isinstance(Ramp(SPEC, 256), Verifier)


@pytest.mark.parametrize("mode", ["packed", "direct", "pull"])
def test_the_sides_run_with_a_model_that_is_not_synth(engine_pair, mode):
    model, verifier = Ramp(SPEC, 256), Ramp(SPEC, 256)
    prefill, decode, finished = _pair(engine_pair, model, verifier, mode)
    assert model.prepared == [prefill.pool.device] and verifier.prepared == [decode.pool.device]
    _run(prefill, decode, finished, [200, 64, 1, 130])
    assert {rid: r.status for rid, r in finished.items()} == {0: 200, 1: 200, 2: 200, 3: 200}
    kind = {"packed": "packed", "direct": "direct", "pull": "pulled"}[mode]
    assert decode.chunk_modes[kind] == 4 + 1 + 1 + 3  # 64-token chunks
    m = decode.metrics  # the KV of 27 pages, and each request's extra state
    kv = kvmem.packed_nbytes(SPEC, 13 + 4 + 1 + 9)
    assert m.bytes_verified == m.bytes_landed == kv + 4 * AUX_BYTES
    assert m.bytes_corrupt == 0
    for side in (prefill, decode):
        assert side.audit() == {"leaked": {}, "quarantined": {}, "unaccounted": []}
        side.close()


@pytest.mark.parametrize("mode", ["packed", "pull"])
def test_a_verifier_that_disagrees_counts_every_landed_byte_corrupt(engine_pair, mode):
    prefill, decode, finished = _pair(engine_pair, Ramp(SPEC, 256), Ramp(SPEC, 256, salt=1), mode)
    _run(prefill, decode, finished, [100])
    m = decode.metrics  # the KV corrupt; the extra state, the sides' own, verified
    assert m.bytes_corrupt == kvmem.packed_nbytes(SPEC, 7)
    assert m.bytes_verified == AUX_BYTES and m.bytes_landed == m.bytes_corrupt + AUX_BYTES
    for side in (prefill, decode):
        side.close()


class _NoFill:
    max_tokens = 256

    def prepare(self, device) -> None:
        raise AssertionError("a refused model is not prepared")


@pytest.mark.parametrize(
    "model, error, message",
    [
        (
            object(),
            TypeError,
            "PrefillSide: object is not a kvmem.disagg.Forward: it has no "
            "max_tokens, prepare, fill",
        ),
        (
            _NoFill(),
            TypeError,
            "PrefillSide: _NoFill is not a kvmem.disagg.Forward: it has no fill",
        ),
        (
            Ramp(SPEC, 0),
            ValueError,
            "PrefillSide: kvmem.disagg.Forward.max_tokens must be >= 1, got 0",
        ),
    ],
)
def test_a_model_without_the_contract_is_refused_before_anything_is_registered(
    engine_pair, model, error, message
):
    pe, de = engine_pair
    with pytest.raises(error) as e:
        PrefillSide(
            kvmem.KVPool(SPEC, PAGES),
            kvmem.PageAllocator(PAGES, 16),
            pe,
            model,
            decode_peer=de.name,
            chunk_tokens=64,
        )
    assert str(e.value) == message
    assert pe.registrations() == {}


def test_a_verifier_without_the_contract_is_refused(engine_pair):
    pe, de = engine_pair
    with pytest.raises(
        TypeError,
        match=r"^DecodeSide: _NoFill is not a kvmem.disagg.Verifier: "
        r"it has no verify, verify_pages$",
    ):
        DecodeSide(
            kvmem.KVPool(SPEC, PAGES),
            kvmem.PageAllocator(PAGES, 16),
            de,
            _NoFill(),
            prefill_peer=pe.name,
            landing_bytes=1 << 20,
        )
    assert de.registrations() == {}
