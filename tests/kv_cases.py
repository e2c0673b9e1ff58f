"""Test grid shared by the pack/unpack tests (the grid every kernel test uses): readable case ids like
``P16-D128-bf16-strided``; buffers filled with distinct bytes so any misplaced byte shows."""

from __future__ import annotations

from dataclasses import dataclass

import torch

import kvmem

DTYPES = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp8": torch.float8_e4m3fn,  # stored as uint8
}


@dataclass(frozen=True)
class Case:
    page_size: int
    head_dim: int
    dtype: str
    strided: bool
    num_layers: int = 3
    num_heads: int = 4
    v_head_dim: int | None = None
    num_pages: int = 9

    @property
    def id(self) -> str:
        v = "" if self.v_head_dim is None else f"-V{self.v_head_dim}"
        return (
            f"P{self.page_size}-D{self.head_dim}{v}-{self.dtype}-"
            f"{'strided' if self.strided else 'contig'}"
        )

    def spec(self) -> kvmem.KVSpec:
        return kvmem.KVSpec(
            num_layers=self.num_layers,
            num_kv_heads=self.num_heads,
            head_dim=self.head_dim,
            page_size=self.page_size,
            dtype=DTYPES[self.dtype],
            v_head_dim=self.v_head_dim,
        )


def fill_random(t: torch.Tensor, gen: torch.Generator) -> None:
    """Random bytes (any bit pattern: copies must be exact, NaN payloads included)."""
    raw = t.view(torch.uint8)  # works for strided views too: the last axis is contiguous
    raw.copy_(torch.randint(0, 256, raw.shape, generator=gen, dtype=torch.uint8).to(t.device))


def make_buffers(
    case: Case,
    gen: torch.Generator,
    sentinel: int | None = None,
    device: str | torch.device = "cpu",
):
    """Per-layer K and V lists, ``[num_pages, page_size, H, D]``; strided ones are views
    into wider tensors (padded heads, head_dim and tokens)."""
    spec = case.spec()
    dt = spec.storage_dtype

    def one(d):
        if d == 0:
            return None
        shape = (case.num_pages, case.page_size, case.num_heads, d)
        if case.strided:
            big = torch.empty(
                case.num_pages,
                case.page_size + 1,
                case.num_heads + 1,
                d + 16,
                dtype=dt,
                device=device,
            )
            t = big[:, 1:, 1:, 8 : 8 + d]
        else:
            t = torch.empty(shape, dtype=dt, device=device)
        assert t.shape == shape
        if sentinel is None:
            fill_random(t, gen)
        else:
            t.view(torch.uint8).fill_(sentinel)
        return t

    ks = [one(case.head_dim) for _ in range(case.num_layers)]
    vs = [one(spec.v_head_dim) for _ in range(case.num_layers)] if spec.has_v else []
    return ks, vs


def grid() -> list[Case]:
    cases = []
    for ps in (1, 16, 64):
        for d in (64, 128, 576):
            for dt in DTYPES:
                for strided in (False, True):
                    # Keep the grid's memory small: big pages with wide heads get fewer heads.
                    heads = 4 if ps * d <= 16 * 128 else 2
                    cases.append(Case(ps, d, dt, strided, num_heads=heads))
    # K and V of different head dims; K-only (MLA latent cache).
    cases.append(Case(16, 128, "bf16", False, v_head_dim=64))
    cases.append(Case(16, 576, "bf16", False, num_heads=1, v_head_dim=0))
    cases.append(Case(1, 576, "fp8", True, num_heads=1, v_head_dim=0))
    return cases


def scrambled_ids(case: Case, gen: torch.Generator) -> torch.Tensor:
    """An odd number of distinct pages in a scrambled order, page 0 included."""
    n = case.num_pages - 2 if case.num_pages % 2 else case.num_pages - 1
    return torch.randperm(case.num_pages, generator=gen)[:n]


def selections(case: Case):
    """(layers, heads) selections every pack test runs: all; two layers out of order with
    a head range; the last head of one layer."""
    yield None, None
    yield [2, 0], (1, 3) if case.num_heads >= 3 else (0, 1)
    yield [1], (case.num_heads - 1, case.num_heads)
