"""The pack/unpack kernel compiled ahead of time for the H200 (sm_90) on this CPU machine:
its page-copy loops must issue 16-byte global loads and stores (``ld/st.global.v4``) for
bf16 pages whose rows are multiples of 16 bytes.  Reading the PTX is the CPU-checkable
proxy for how the kernel will use HBM bandwidth (ENV_NOTES.md)."""

from __future__ import annotations

import re

import pytest
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import kvmem
from kvmem.kernels import pack as P

_POINTERS = {"base": "*i32", "layer_offs": "*i64", "page_ids": "*i64", "chunk": "*i32",
             "err": "*i64"}
_SCALARS = {"n": "i32", "num_pages": "i32"}


def compile_ptx(plan, pack: bool) -> str:
    fn = P._copy_pages_kernel
    names = fn.arg_names
    unit = {4: "i32", 2: "i16", 1: "u8"}[plan.unit_bytes]
    signature = {}
    for a in names:
        t = _POINTERS.get(a) or _SCALARS.get(a) or "constexpr"
        signature[a] = t.replace("*i32", f"*{unit}") if a in ("base", "chunk") else t
    constexprs = {(names.index(k),): v for k, v in P.kernel_params(plan, pack).items()}
    # What Triton's launcher specialises at run time for 16-byte-aligned pointers.
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in _POINTERS}
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": P._NUM_WARPS})
    return kernel.asm["ptx"]


def _global_accesses(ptx: str) -> set[str]:
    return set(re.findall(r"\b(ld\.global(?:\.[\w]+)*|st\.global(?:\.[\w]+)*)", ptx))


CASES = [
    # (page_size, heads, head_dim, heads selected)
    (16, 8, 128, None),
    (1, 8, 128, None),
    (64, 8, 128, (2, 6)),
    (16, 1, 576, None),
    (16, 8, 64, (3, 4)),
]


@pytest.mark.parametrize("pack", [True, False], ids=["pack", "unpack"])
@pytest.mark.parametrize("case", CASES, ids=[f"P{c[0]}-H{c[1]}-D{c[2]}-heads{c[3]}" for c in CASES])
def test_copy_loops_use_16_byte_accesses(case, pack):
    page_size, heads, head_dim, sel = case
    spec = kvmem.KVSpec(num_layers=2, num_kv_heads=heads, head_dim=head_dim, page_size=page_size,
                        dtype=torch.bfloat16)
    pool = kvmem.KVPool(spec, num_pages=4)
    plan = pool._plan(None, sel)
    assert plan.unit_bytes == 4 and plan.align == 4
    ptx = compile_ptx(plan, pack)
    accesses = _global_accesses(ptx)
    # The copy loops: 16-byte vector loads and stores of 4-byte units ...
    assert "ld.global.v4.b32" in accesses, accesses
    assert "st.global.v4.b32" in accesses, accesses
    # ... and no narrower data accesses: besides them only the 8-byte loads of one page
    # id and one layer offset per program, and the error flag's 8-byte store.
    assert accesses <= {"ld.global.v4.b32", "st.global.v4.b32", "ld.global.b64",
                        "st.global.b64"}, accesses


def test_misaligned_rows_fall_back_to_narrow_units():
    # 3 heads x 6 dims x 2 bytes = 36-byte rows: 4-byte units, no 16-byte promise.
    spec = kvmem.KVSpec(num_layers=2, num_kv_heads=3, head_dim=6, page_size=2, dtype=torch.bfloat16)
    pool = kvmem.KVPool(spec, num_pages=4)
    plan = pool._plan(None, (1, 2))  # one head: 12-byte rows
    assert plan.unit_bytes == 4
    assert "ld.global.v4.b32" not in _global_accesses(compile_ptx(plan, True))
