"""The ``kvmem`` command (also ``python -m kvmem``).

``kvmem demo`` is the main job: a prefill worker and a decode worker in two processes
moving KV over NIXL with every fault injected (:mod:`kvmem.demo`, the app beside the
library, imported only when that subcommand runs).  ``kvmem selfcheck`` exercises a
pool, the allocator and the pack/unpack kernels end to end on the chosen device, in one
process, with what it did printed as it goes.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from kvmem import __version__


def _selfcheck_plan(args):
    """Check every option before any work: ``(device, spec, prompt lengths)``, or a
    ValueError naming the option."""
    import kvmem

    try:
        dev = torch.device(args.device)
    except (RuntimeError, ValueError) as e:
        raise ValueError(f"--device {args.device!r}: {e}") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"--device {args.device}: CUDA is not available here (torch "
                f"{torch.__version__}, CUDA build {torch.version.cuda}); use "
                "--device cpu"
            )
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(
                f"--device {args.device}: this machine has "
                f"{torch.cuda.device_count()} CUDA device(s)"
            )
    elif dev.type != "cpu":
        raise ValueError(f"--device must be cpu or cuda[:N], got {args.device!r}")
    for name in ("layers", "heads", "head_dim", "page_size", "requests"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.pages < 2:
        raise ValueError(f"--pages must be >= 2 (page 0 is padding), got {args.pages}")
    if args.seed < 0:
        raise ValueError(f"--seed must be >= 0, got {args.seed}")
    dtype = {
        "bf16": torch.bfloat16,
        "fp16": torch.float16,
        "fp32": torch.float32,
        "fp8": torch.float8_e4m3fn,
    }[args.dtype]
    spec = kvmem.KVSpec(
        num_layers=args.layers,
        num_kv_heads=args.heads,
        head_dim=args.head_dim,
        page_size=args.page_size,
        dtype=dtype,
    )
    # Two pools (the second receives the unpacked pages).
    need = 2 * spec.page_bytes * args.pages
    have = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if dev.type == "cuda":
        have = torch.cuda.get_device_properties(dev).total_memory
    if need > 0.75 * have:
        raise ValueError(
            f"--pages {args.pages}: two pools of {spec.page_bytes} bytes a page "
            f"need {need / 2**30:.1f} GiB, more than 3/4 of the "
            f"{have / 2**30:.1f} GiB of {dev}: lower --pages or the model size"
        )
    gen = torch.Generator().manual_seed(args.seed)
    lens = torch.randint(1, 8 * args.page_size, (args.requests,), generator=gen)
    pages = int(((lens + args.page_size - 1) // args.page_size).sum())
    if pages > args.pages - 1:
        raise ValueError(
            f"--requests {args.requests} take {pages} pages at once (prompts of "
            f"1..{8 * args.page_size - 1} tokens, seed {args.seed}), more than "
            f"--pages {args.pages} holds ({args.pages - 1} usable; page 0 is "
            "padding): raise --pages or lower --requests"
        )
    return dev, spec, lens, gen


def _selfcheck(args, plan) -> int:
    import kvmem

    dev, spec, lens, gen = plan
    t0 = time.perf_counter()
    pool = kvmem.KVPool(spec, num_pages=args.pages, device=dev)
    alloc = kvmem.PageAllocator(num_pages=args.pages, page_size=args.page_size, device=dev)
    print(f"pool:      {pool}")
    print(
        f"           {pool.nbytes / 2**20:.1f} MiB in {len(pool.regions())} region(s); "
        f"{spec.page_bytes / 2**10:.1f} KiB per page over all layers"
    )

    # A batch of requests: prefill (alloc_extend), fill their pages, pack, unpack elsewhere.
    prefix = torch.zeros_like(lens)
    last_loc = torch.full_like(lens, -1)
    slots = alloc.alloc_extend(
        prefix.to(dev),
        lens.to(dev),
        last_loc.to(dev),
        prefix_lens_cpu=prefix,
        seq_lens_cpu=lens,
        extend_num_tokens=int(lens.sum()),
    )
    print(
        f"allocator: alloc_extend of {args.requests} requests, {int(lens.sum())} tokens -> "
        f"{alloc.num_allocated} pages allocated, {alloc.num_free} free"
    )
    starts = torch.cumsum(lens, 0) - lens
    twin = kvmem.KVPool(spec, num_pages=args.pages, device=dev)
    twin_alloc = kvmem.PageAllocator(num_pages=args.pages, page_size=args.page_size, device=dev)
    moved = 0
    for r in range(args.requests):
        s, n = int(starts[r]), int(lens[r])
        pages = torch.unique_consecutive(slots[s : s + n] // args.page_size)
        for b in pool.k_buffer + pool.v_buffer:  # stand-in for a forward pass
            rows = b.view(b.shape[0], -1).view(torch.uint8)
            rows[pages] = torch.randint(
                0, 256, (pages.numel(), rows.shape[1]), generator=gen, dtype=torch.uint8
            ).to(dev)
        chunk = kvmem.pack_pages(pool, pages)
        dst = twin_alloc.alloc(pages.numel())
        kvmem.unpack_pages(chunk, twin, dst)
        if not torch.equal(kvmem.pack_pages(twin, dst), chunk):
            print(f"FAILED: request {r}: unpacked pages differ from the packed chunk")
            return 1
        moved += chunk.numel()
        with alloc.free_group():
            alloc.free(pages)
        twin_alloc.free(dst)
    alloc.check_invariants()
    twin_alloc.check_invariants()
    dt = time.perf_counter() - t0
    print(
        f"pack:      {args.requests} requests packed, unpacked into a second pool and "
        f"verified byte for byte: {moved / 2**20:.1f} MiB"
    )
    leaked = alloc.num_allocated + twin_alloc.num_allocated
    print(f"leaks:     {leaked} pages still allocated")
    print(f"done in {dt:.2f} s: {'OK' if leaked == 0 else 'LEAK'}")
    return 0 if leaked == 0 else 1


def _subcommand(argv: list[str]) -> str | None:
    """The subcommand ``argv`` names: its first word that is not an option (the top
    level's options, ``--version`` and ``--help``, take no value)."""
    return next((a for a in argv if not a.startswith("-")), None)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(
        prog="kvmem", description=__doc__.split("\n\n")[0].replace("``", "")
    )
    parser.add_argument("--version", action="version", version=f"kvmem {__version__}")
    sub = parser.add_subparsers(dest="cmd", required=True)
    demo_parser = sub.add_parser(
        "demo",
        help="the main job: prefill and decode processes over NIXL, every fault injected",
        description="A prefill worker and a decode worker in two processes move KV over NIXL "
        "(UCX, loopback) through kvmem's PD lifecycle, with every fault injected "
        "by default; a progress line (on a terminal), then a report.  Exit "
        "status: 0 all checks passed, 1 a check failed (a leaked page, a corrupt "
        "byte, ...), 2 bad options, 3 a worker failed before its final report.",
    )
    if _subcommand(argv) == "demo":  # the demo's options, from the demo, for the demo only
        from kvmem.demo import add_arguments

        add_arguments(demo_parser)
    p = sub.add_parser(
        "selfcheck",
        help="pool + allocator + pack/unpack, end to end",
        description="Builds a KV pool and a page allocator on one device, allocates a "
        "batch of prompts, fills their pages, packs each request's pages into "
        "one chunk, unpacks it into a second pool and compares byte for byte, "
        "then frees everything and checks that no page is left allocated.  "
        "Exit status: 0 OK, 1 a check failed, 2 bad options.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--layers", type=int, default=8, help="layers of the model")
    p.add_argument("--heads", type=int, default=4, help="KV heads per layer")
    p.add_argument("--head-dim", type=int, default=128, help="elements per head")
    p.add_argument("--page-size", type=int, default=16, help="tokens per page")
    p.add_argument(
        "--dtype", default="bf16", choices=["bf16", "fp16", "fp32", "fp8"], help="KV element type"
    )
    p.add_argument(
        "--pages", type=int, default=1025, help="pages in each of the two pools (page 0 is padding)"
    )
    p.add_argument(
        "--requests", type=int, default=32, help="prompts in the batch (1 to 8 pages long each)"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the prompt lengths and bytes")
    args, extra = parser.parse_known_args(argv)
    if extra:  # the subcommand's usage, not the top level's: `kvmem demo --bogus`
        (demo_parser if args.cmd == "demo" else p).error(
            f"unrecognized arguments: {' '.join(extra)}"
        )
    if args.cmd == "demo":
        from kvmem.demo import main as demo_main

        return demo_main(args, demo_parser)
    try:
        plan = _selfcheck_plan(args)
    except (ValueError, TypeError) as e:
        p.error(str(e))  # usage + "kvmem selfcheck: error: ...", exit status 2
    try:
        return _selfcheck(args, plan)
    except (ValueError, TypeError) as e:
        print(f"kvmem {args.cmd}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
