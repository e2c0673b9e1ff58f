"""Compile every Triton kernel of kvmem ahead of time for the H200 (sm_90), without a GPU,
with the triton of the Python that runs this: the check that the kernels build on the GPU
host's triton (3.6) as well as on the one ``make test`` installs.

    python tools/aot_sm90.py cases CASES.json            # needs torch and kvmem
    python tools/aot_sm90.py compile CASES.json OUTDIR   # needs triton only

``cases`` writes the launches to compile: each kernel with the argument types and
constexpr values its launcher passes (the pack kernel's come from kvmem's own
``kernel_params`` for real pool layouts).  ``compile`` reads the kernels' source from
kvmem/kernels/*/triton.py without importing kvmem or torch (the small environment that
``make venv-triton36`` builds holds triton alone): it keeps the ``@triton.jit``
functions, the module-level constants that evaluate with triton only and the names they
import from kvmem modules that need nothing beyond the standard library (the error
codes of kvmem/errors.py), writes them to a module of their own, and compiles each case with ``triton.compile(ASTSource(...),
target=GPUTarget("cuda", 90, 32))``, which builds PTX and, with the ptxas inside the
triton wheel, a cubin.  OUTDIR gets ``results.json`` (triton's version; per case: ok or
the error, the global load/store kinds in the PTX) and each case's PTX.  Exit status 1
if any case failed.  tests/kernels/test_aot_sm90.py runs both steps, with both tritons.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import sys
import tempfile
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KERNEL_FILES = ("kvmem/kernels/pack/triton.py", "kvmem/kernels/alloc/triton.py")
TARGET = ("cuda", 90, 32)  # H200: sm_90, 32-thread warps


def jit_functions(path: str) -> list[str]:
    """Names of the top-level ``@triton.jit`` functions of a source file."""
    tree = ast.parse(open(path).read())
    return [n.name for n in tree.body if isinstance(n, ast.FunctionDef) and _is_jit(n)]


def _is_jit(node: ast.FunctionDef) -> bool:
    return any(ast.unparse(d).startswith("triton.jit") for d in node.decorator_list)


# -- step 1: the cases (kvmem and torch) --------------------------------------------------

# What the pack launcher passes: the buffers as 4/2/1-byte units, int64 layer offsets,
# int64 page ids (kvmem._ids), int64 error flag; n and num_pages are int32.
_PACK_PTRS = {
    "base": "*unit",
    "layer_offs": "*i64",
    "page_ids": "*i64",
    "chunk": "*unit",
    "err": "*i64",
}
_PACK_SCALARS = {"n": "i32", "num_pages": "i32"}
_UNIT_TYPES = {4: "i32", 2: "i16", 1: "u8"}


def make_cases() -> list[dict]:
    import torch

    import kvmem
    from kvmem.kernels.alloc import triton as A
    from kvmem.kernels.pack import triton as P

    cases = []
    layouts = [  # (id, KVSpec keywords, heads selected): the grid tests/kernels/test_ptx_sm90.py uses
        ("P16-H8-D128-bf16", dict(page_size=16, num_kv_heads=8, head_dim=128), None),
        ("P1-H8-D128-bf16", dict(page_size=1, num_kv_heads=8, head_dim=128), None),
        ("P64-H8-D128-bf16-heads2-6", dict(page_size=64, num_kv_heads=8, head_dim=128), (2, 6)),
        (
            "P16-H1-D576-bf16-konly",
            dict(page_size=16, num_kv_heads=1, head_dim=576, v_head_dim=0),
            None,
        ),
        (
            "P1-H3-D5-fp8",
            dict(page_size=1, num_kv_heads=3, head_dim=5, dtype=torch.float8_e4m3fn),
            None,
        ),
    ]
    fn = P._copy_pages_kernel
    for lid, kw, heads in layouts:
        spec = kvmem.KVSpec(num_layers=3, **{"dtype": torch.bfloat16, **kw})
        plan = kvmem.KVPool(spec, num_pages=4)._plan(None, heads)
        unit = _UNIT_TYPES[plan.unit_bytes]
        sig = {
            a: (_PACK_PTRS.get(a) or _PACK_SCALARS[a]).replace("unit", unit)
            for a in fn.arg_names
            if a in _PACK_PTRS or a in _PACK_SCALARS
        }
        for pack in (True, False):
            cases.append(
                dict(
                    id=f"pack.{fn.__name__}.{'pack' if pack else 'unpack'}.{lid}",
                    file=KERNEL_FILES[0],
                    kernel=fn.__name__,
                    signature=sig,
                    constexprs=P.kernel_params(plan, pack),
                    num_warps=P._NUM_WARPS,
                    unit_bytes=plan.unit_bytes,
                )
            )

    # The allocator kernels as their launchers call them: pages and rings int64, the
    # ownership map int32, lengths int64 (sglang's) or int32, scalars int32.
    free_sig = {
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
    }

    def lens_sig(t):
        return {
            "prefix_ptr": f"*{t}",
            "seq_ptr": f"*{t}",
            "last_loc_ptr": "*i64",
            "new_pages_ptr": "*i64",
            "out_ptr": "*i64",
            "err_ptr": "*i64",
            "bs": "i32",
            "num_new": "i32",
            "total": "i32",
        }

    alloc = [
        (
            "_take_pages_kernel",
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
            [dict(BLOCK=A.TAKE_BLOCK, FLAG=f) for f in (True, False)],
        ),
        ("_free_apply_kernel", free_sig, [dict(BLOCK=A.TAKE_BLOCK, FLAG=f) for f in (True, False)]),
        ("_free_commit_kernel", free_sig, [dict(BLOCK=A.TAKE_BLOCK)]),
        (
            "_extend_slots_kernel",
            lens_sig("i64"),
            [
                dict(PAGE_SIZE=ps, REQ_BLOCK=A.REQ_BLOCK, TOKEN_BLOCK=A.TOKEN_BLOCK, FLAG=f)
                for ps, f in ((16, True), (16, False), (1, True))
            ],
        ),
        (
            "_extend_slots_kernel",
            lens_sig("i32"),
            [dict(PAGE_SIZE=64, REQ_BLOCK=A.REQ_BLOCK, TOKEN_BLOCK=A.TOKEN_BLOCK, FLAG=False)],
        ),
        (
            "_decode_slots_kernel",
            {k: v for k, v in lens_sig("i64").items() if k not in ("prefix_ptr", "total")},
            [
                dict(PAGE_SIZE=ps, BLOCK=A.DECODE_BLOCK, FLAG=f)
                for ps, f in ((16, True), (16, False), (1, True))
            ],
        ),
    ]
    for name, sig, variants in alloc:
        fn = getattr(A, name)
        for consts in variants:
            vid = "-".join(f"{k}{int(v)}" for k, v in consts.items() if k in ("PAGE_SIZE", "FLAG"))
            lens = sig.get("seq_ptr", "").lstrip("*")
            cases.append(
                dict(
                    id=".".join(x for x in ("alloc", name, vid, lens) if x),
                    file=KERNEL_FILES[1],
                    kernel=name,
                    signature={a: sig[a] for a in fn.arg_names if a in sig},
                    constexprs=consts,
                    num_warps=4,
                )
            )
    return cases


# -- step 2: compile (triton only) --------------------------------------------------------


def load_kernels(relpath: str, workdir: str):
    """The ``@triton.jit`` functions of a kvmem kernel file and the module constants they
    may read, as a module imported from ``workdir`` (not kvmem's: torch is not needed)."""
    import triton
    import triton.language as tl

    src = open(os.path.join(ROOT, relpath)).read()
    tree = ast.parse(src)
    ns = {"triton": triton, "tl": tl}
    kept = [
        "from __future__ import annotations",
        "import triton",
        "import triton.language as tl",
        "",
    ]
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kvmem."):
            dep = _stdlib_only_module(node.module)
            if dep is None:  # needs torch or more of kvmem: no kernel reads its names
                continue
            names = [(a.name, a.asname or a.name) for a in node.names]
            ns.update({alias: getattr(dep, name) for name, alias in names})
            kept.append(f"from {dep.__name__} import " + ", ".join(f"{n} as {a}" for n, a in names))
        elif isinstance(node, ast.FunctionDef) and _is_jit(node):
            start = node.decorator_list[0].lineno
            kept.append("\n".join(src.splitlines()[start - 1 : node.end_lineno]) + "\n")
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            code = ast.get_source_segment(src, node)
            try:  # constants in plain Python or tl.constexpr; torch dtypes etc. fail: dropped
                exec(compile(code, relpath, "exec"), ns)
            except Exception:  # noqa: BLE001
                continue
            kept.append(code)
    name = "kvmem_aot_" + os.path.splitext(relpath)[0].replace("/", "_")
    path = os.path.join(workdir, name + ".py")
    with open(path, "w") as f:
        f.write("\n".join(kept) + "\n")
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # triton resolves a kernel's globals through its module
    spec.loader.exec_module(mod)
    return mod


def _stdlib_only_module(module: str):
    """The kvmem module ``module`` (dotted), loaded from its file under a name of its own
    (not through the kvmem package, whose import needs torch) when it imports nothing but
    the standard library; else None."""
    base = os.path.join(ROOT, *module.split("."))
    path = base + ".py" if os.path.exists(base + ".py") else os.path.join(base, "__init__.py")
    tree = ast.parse(open(path).read())
    for n in ast.walk(tree):
        mods = (
            [a.name for a in n.names]
            if isinstance(n, ast.Import)
            else [n.module or ""]
            if isinstance(n, ast.ImportFrom)
            else []
        )
        if any(m.split(".")[0] not in sys.stdlib_module_names for m in mods):
            return None
    name = "kvmem_aot_dep_" + module.replace(".", "_")
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


def _accesses(ptx: str) -> list[str]:
    return sorted(set(re.findall(r"\b(ld\.global(?:\.\w+)*|st\.global(?:\.\w+)*)", ptx)))


def compile_case(fn, case: dict) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = fn.arg_names
    signature = {a: case["signature"].get(a, "constexpr") for a in names}
    missing = [a for a in names if signature[a] == "constexpr" and a not in case["constexprs"]]
    if missing:
        raise ValueError(f"no type or constexpr value for {missing}")
    constexprs = {(names.index(k),): v for k, v in case["constexprs"].items()}
    # Triton's launcher specialises 16-byte-aligned pointers so at run time; say it here.
    attrs = {
        (names.index(a),): [["tt.divisibility", 16]]
        for a, t in case["signature"].items()
        if t.startswith("*")
    }
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    k = triton.compile(src, target=GPUTarget(*TARGET), options={"num_warps": case["num_warps"]})
    return dict(ptx=k.asm["ptx"], cubin_bytes=len(k.asm.get("cubin", b"")))


def compile_all(cases_path: str, out_dir: str) -> int:
    import triton

    cases = json.load(open(cases_path))
    os.makedirs(out_dir, exist_ok=True)
    results = dict(triton=triton.__version__, python=sys.version.split()[0], cases={})
    with tempfile.TemporaryDirectory() as work:
        mods = {f: load_kernels(f, work) for f in sorted({c["file"] for c in cases})}
        for case in cases:
            r = results["cases"][case["id"]] = dict(kernel=case["kernel"])
            try:
                out = compile_case(getattr(mods[case["file"]], case["kernel"]), case)
            except Exception as e:  # noqa: BLE001 -- every failure is reported, then exit 1
                r.update(
                    ok=False, error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()
                )
                continue
            with open(os.path.join(out_dir, case["id"] + ".ptx"), "w") as f:
                f.write(out["ptx"])
            r.update(ok=True, accesses=_accesses(out["ptx"]), cubin_bytes=out["cubin_bytes"])
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    bad = [i for i, r in results["cases"].items() if not r["ok"]]
    print(
        f"triton {results['triton']}: {len(cases) - len(bad)}/{len(cases)} cases compiled for sm_90"
    )
    for i in bad:
        print(f"FAILED {i}: {results['cases'][i]['error']}")
    return 1 if bad else 0


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "cases":
        sys.path.insert(0, ROOT)
        with open(argv[1], "w") as f:
            json.dump(make_cases(), f, indent=1)
        return 0
    if len(argv) == 3 and argv[0] == "compile":
        return compile_all(argv[1], argv[2])
    print(__doc__.split("\n\n")[1], file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
