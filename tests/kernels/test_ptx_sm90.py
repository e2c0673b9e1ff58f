"""The pack/unpack kernel compiled ahead of time for the H200 (sm_90) on this CPU machine:
its page-copy loops must issue 16-byte global loads and stores (``ld/st.global.v4``) for
bf16 pages whose rows are multiples of 16 bytes.  Reading the PTX is the CPU-checkable
proxy for how the kernel will use HBM bandwidth."""

from __future__ import annotations

import re

import pytest
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import kvmem
from kvmem.kernels.pack import triton as P

_POINTERS = {
    "base": "*i32",
    "layer_offs": "*i64",
    "page_ids": "*i64",
    "chunk": "*i32",
    "err": "*i64",
}
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
    kernel = triton.compile(
        src, target=GPUTarget("cuda", 90, 32), options={"num_warps": P._NUM_WARPS}
    )
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
    spec = kvmem.KVSpec(
        num_layers=2,
        num_kv_heads=heads,
        head_dim=head_dim,
        page_size=page_size,
        dtype=torch.bfloat16,
    )
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
    assert accesses <= {"ld.global.v4.b32", "st.global.v4.b32", "ld.global.b64", "st.global.b64"}, (
        accesses
    )


def test_misaligned_rows_fall_back_to_narrow_units():
    # 3 heads x 6 dims x 2 bytes = 36-byte rows: 4-byte units, no 16-byte promise.
    spec = kvmem.KVSpec(num_layers=2, num_kv_heads=3, head_dim=6, page_size=2, dtype=torch.bfloat16)
    pool = kvmem.KVPool(spec, num_pages=4)
    plan = pool._plan(None, (1, 2))  # one head: 12-byte rows
    assert plan.unit_bytes == 4
    assert "ld.global.v4.b32" not in _global_accesses(compile_ptx(plan, True))


# -- no 32-bit address arithmetic -------------------------------------------------------
#
# The bug: the V half's offset NUM_K * n * (K_ROWS * K_SEG) was an int32 product, which
# for sm_90 became `mul.lo.s32` / `shl.b32` and then a sign-extending `mad.wide.s32`
# into the address, so past 2^31 units pack wrote V gigabytes below the chunk.  A flat
# "no mul.lo.s32 anywhere" test would be fragile: the compiler legitimately does 32-bit
# math on thread indices, and LLVM narrows a 64-bit division to 32 bits behind a runtime
# range check.  So the check follows the data: values that can be large are the program
# ids (%ctaid) and the 32-bit kernel arguments (ld.param.*32), and whatever is computed
# from them; no 32-bit add / sub / mul / mad / shl / neg on such a value may feed,
# directly or through later instructions, a memory operand's address.

_INSTR = re.compile(r"^\s*(?:@!?%p\d+\s+)?([a-z][\w.]*)\s+([^;]*);", re.M)
_REG = re.compile(r"%[a-z]+\d*(?:\.[xyz])?")
_NARROW_OPS = ("add", "sub", "mul", "mad", "shl", "neg")


def narrow_address_math(ptx: str) -> list[str]:
    """The 32-bit instructions on large values (see above) that feed an address."""
    instrs = []
    for op, args in _INSTR.findall(ptx):
        regs = _REG.findall(args)
        mem = [_REG.findall(m) for m in re.findall(r"\[([^\]]*)\]", args)]
        writes = (
            regs
            and not args.lstrip().startswith("[")
            and not op.startswith(("st.", "red.", "atom."))
        )
        dst = regs[0] if writes else None
        srcs = regs[1:] if writes else regs
        instrs.append((op, args.strip(), dst, srcs, mem))

    def reads_large(op, srcs, large):
        return any(s in large or s.startswith(("%ctaid", "%nctaid")) for s in srcs) or (
            op.startswith("ld.param") and re.search(r"\.[bsu]32$", op) is not None
        )

    def closure(seed, instrs):  # seed: reg -> origin; follow every non-predicate write
        out, changed = dict(seed), True
        while changed:
            changed = False
            for op, args, dst, srcs, mem in instrs:
                if dst and not dst.startswith("%p") and dst not in out:
                    origin = next((out[s] for s in srcs if s in out), None)
                    if origin is not None:
                        out[dst], changed = origin, True
        return out

    large = set()
    changed = True
    while changed:
        changed = False
        for op, args, dst, srcs, mem in instrs:
            if (
                dst
                and not dst.startswith("%p")
                and dst not in large
                and reads_large(op, srcs, large)
            ):
                large.add(dst)
                changed = True
    narrow = {
        dst: f"{op} {args}"
        for op, args, dst, srcs, mem in instrs
        if dst
        and re.fullmatch(r"%r\d+", dst)
        and op.split(".")[0] in _NARROW_OPS
        and reads_large(op, srcs, large)
    }
    fed = closure(narrow, instrs)
    return sorted({fed[r] for *_, mem in instrs for regs in mem for r in regs if r in fed})


def test_the_check_catches_the_reported_pattern():
    """The checker itself, on the shape of the sm_90 code the issue reported (and that
    the int32 kernel compiled to), and on 32-bit math it must let through."""
    bug = """
    mov.u32 %r3, %ctaid.y;
    ld.param.u32 %r1, [k_param_4];
    shl.b32 %r37, %r1, 13;
    mul.lo.s32 %r39, %r3, %r1;
    mad.wide.s32 %rd39, %r37, 4, %rd38;
    add.s64 %rd40, %rd39, %rd2;
    st.global.v4.b32 [ %rd40 + 0 ], { %r5, %r6, %r7, %r8 };
    """
    assert narrow_address_math(bug) == ["shl.b32 %r37, %r1, 13"]
    fine = """
    mov.u32 %r1, %tid.x;
    shl.b32 %r2, %r1, 2;
    mov.u32 %r3, %ctaid.x;
    cvt.u64.u32 %rd1, %r3;
    mul.lo.s64 %rd2, %rd1, 4096;
    mul.wide.u32 %rd3, %r2, 4;
    add.s64 %rd4, %rd2, %rd3;
    cvt.u32.u64 %r4, %rd1;
    setp.ne.b32 %p1, %r4, 0;
    ld.global.b64 { %rd5 }, [ %rd4 + 0 ];
    """
    assert narrow_address_math(fine) == []


PTX_CASES = CASES + [(16, 2, 128, None, 0), (1, 3, 5, None, 1)]  # K-only; 1-byte units


@pytest.mark.parametrize("pack", [True, False], ids=["pack", "unpack"])
@pytest.mark.parametrize(
    "case",
    PTX_CASES,
    ids=[
        f"P{c[0]}-H{c[1]}-D{c[2]}-heads{c[3]}" + (f"-{c[4]}" if len(c) > 4 else "")
        for c in PTX_CASES
    ],
)
def test_pack_kernel_address_math_is_64_bit(case, pack):
    page_size, heads, head_dim, sel = case[:4]
    kw = {}
    if len(case) > 4:
        kw = dict(v_head_dim=0) if case[4] == 0 else dict(dtype=torch.float8_e4m3fn)
    spec = kvmem.KVSpec(
        num_layers=3,
        num_kv_heads=heads,
        head_dim=head_dim,
        page_size=page_size,
        **{"dtype": torch.bfloat16, **kw},
    )
    plan = kvmem.KVPool(spec, num_pages=4)._plan(None, sel)
    ptx = compile_ptx(plan, pack)
    assert "%ctaid" in ptx  # the analysis has something to follow
    assert narrow_address_math(ptx) == []


_ALLOC_SIGS = {
    "_take_pages_kernel": (
        {
            "ring_ptr": "*i64",
            "owned_ptr": "*i32",
            "out_ptr": "*i64",
            "err_ptr": "*i64",
            "head": "i32",
            "n": "i32",
            "cap": "i32",
            "num_pages": "i32",
        },
        dict(BLOCK=1024, FLAG=True),
    ),
    "_free_apply_kernel": (
        {
            "pages_ptr": "*i64",
            "ring_ptr": "*i64",
            "owned_ptr": "*i32",
            "err_ptr": "*i64",
            "n": "i32",
            "pages_stride": "i32",
            "tail": "i32",
            "cap": "i32",
            "num_pages": "i32",
            "parity": "i32",
        },
        dict(BLOCK=1024, FLAG=True),
    ),
    "_free_commit_kernel": (
        {
            "pages_ptr": "*i64",
            "ring_ptr": "*i64",
            "owned_ptr": "*i32",
            "err_ptr": "*i64",
            "n": "i32",
            "pages_stride": "i32",
            "tail": "i32",
            "cap": "i32",
            "num_pages": "i32",
            "parity": "i32",
        },
        dict(BLOCK=1024),
    ),
    "_extend_slots_kernel": (
        {
            "prefix_ptr": "*i32",
            "seq_ptr": "*i32",
            "last_loc_ptr": "*i64",
            "new_pages_ptr": "*i64",
            "out_ptr": "*i64",
            "err_ptr": "*i64",
            "bs": "i32",
            "num_new": "i32",
            "total": "i32",
        },
        dict(PAGE_SIZE=16, REQ_BLOCK=1024, TOKEN_BLOCK=1024, FLAG=True),
    ),
    "_decode_slots_kernel": (
        {
            "seq_ptr": "*i32",
            "last_loc_ptr": "*i64",
            "new_pages_ptr": "*i64",
            "out_ptr": "*i64",
            "err_ptr": "*i64",
            "bs": "i32",
            "num_new": "i32",
        },
        dict(PAGE_SIZE=16, BLOCK=1024, FLAG=True),
    ),
}


@pytest.mark.parametrize("name", list(_ALLOC_SIGS))
def test_allocator_kernel_address_math_is_64_bit(name):
    from kvmem.kernels.alloc import triton as K

    fn = getattr(K, name)
    sig, consts = _ALLOC_SIGS[name]
    names = fn.arg_names
    signature = {a: sig.get(a, "constexpr") for a in names}
    src = ASTSource(
        fn=fn,
        signature=signature,
        constexprs={(names.index(k),): v for k, v in consts.items()},
        attrs={
            (names.index(a),): [["tt.divisibility", 16]]
            for a, t in sig.items()
            if t.startswith("*")
        },
    )
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
    assert "%ctaid" in ptx
    assert narrow_address_math(ptx) == []
