"""``kvmem demo``'s command line: its options (:func:`add_arguments`), the
:class:`~kvmem.demo.config.DemoConfig` they make, :func:`main` (signals, exit status, the
report on stdout, errors on stderr) and the ``--json`` file.  The one module of the demo
that prints."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
from dataclasses import asdict

from kvmem.demo.config import CHUNK_MODES, DTYPES, TRANSFER_MODES, DemoConfig
from kvmem.demo.hosts import HOSTS, HostsError
from kvmem.demo.orchestrator import WorkerFailed, run
from kvmem.demo.report import format_report, summary_line


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = DemoConfig()
    g = p.add_argument_group("workload")
    g.add_argument("--requests", type=int, default=d.requests, help="requests to run (%(default)s)")
    g.add_argument(
        "--concurrency",
        type=int,
        default=d.concurrency,
        help="requests in flight on the prefill side (%(default)s)",
    )
    g.add_argument(
        "--max-tokens",
        type=int,
        default=d.max_tokens,
        help="prompt lengths are drawn from 1..MAX_TOKENS (%(default)s)",
    )
    g.add_argument(
        "--chunk-tokens",
        type=int,
        default=d.chunk_tokens,
        help="chunked prefill: tokens per chunk, a multiple of the page size (%(default)s)",
    )
    g.add_argument("--seed", type=int, default=d.seed, help="seeds prompts, faults and KV data")
    f = p.add_argument_group("faults (0 turns a family off)")
    f.add_argument(
        "--abort-rate",
        type=float,
        default=None,
        help=f"client aborts, in every state and in the running batch ({d.abort_rate})",
    )
    f.add_argument(
        "--timeout-rate",
        type=float,
        default=None,
        help=f"bootstrap and transfer timeouts ({d.timeout_rate})",
    )
    f.add_argument(
        "--fail-rate",
        type=float,
        default=None,
        help=f"send failures of the first, a middle or the last chunk ({d.fail_rate})",
    )
    f.add_argument(
        "--pauses",
        type=int,
        default=None,
        help=f"pause/resume cycles, alternating prefill and decode ({d.pauses})",
    )
    f.add_argument("--no-faults", action="store_true", help="all of the above 0")
    f.add_argument(
        "--timeout",
        type=float,
        default=d.transfer_timeout,
        help="the prefill's bootstrap and transfer timeouts, s (%(default)s)",
    )
    m = p.add_argument_group("model")
    m.add_argument("--layers", type=int, default=d.layers, help="(%(default)s)")
    m.add_argument("--heads", type=int, default=d.heads, help="KV heads (%(default)s)")
    m.add_argument("--head-dim", type=int, default=d.head_dim, help="(%(default)s)")
    m.add_argument("--page-size", type=int, default=d.page_size, help="(%(default)s)")
    m.add_argument("--dtype", default=d.dtype, choices=DTYPES, help="(%(default)s)")
    x = p.add_argument_group("transfer")
    x.add_argument(
        "--transfer-mode",
        default=d.transfer_mode,
        choices=TRANSFER_MODES,
        help="push: the prefill writes each chunk into the decode (as sglang); "
        "pull: the prefill offers the pages and the decode reads them from "
        "its pool, pool to pool (as vLLM's NIXL connector) (%(default)s)",
    )
    x.add_argument(
        "--chunks",
        default=d.chunks,
        choices=CHUNK_MODES,
        help="packed: every chunk packed into the decode's landing buffer; direct: "
        "pool pages written into the decode's pool pages; auto: per chunk, "
        "direct when its page runs (merged where adjacent on both sides) "
        "reach a threshold measured at start-up; push only (%(default)s)",
    )
    h = p.add_argument_group("workers and hosts")
    h.add_argument(
        "--prefills",
        type=int,
        default=d.prefills,
        help="prefill workers; request ids are dealt among them (%(default)s)",
    )
    h.add_argument(
        "--decodes",
        type=int,
        default=d.decodes,
        help="decode workers; each prefill routes each request to the least "
        "loaded decode that is neither paused nor gone (%(default)s)",
    )
    h.add_argument(
        "--kill-decode",
        action="store_true",
        help="kill the last decode worker with SIGKILL in the middle of "
        "receiving requests, once a quarter of them have finished; the "
        "prefills are told and its requests end at once (500), the others "
        "go on (needs --decodes >= 2)",
    )
    h.add_argument(
        "--hosts",
        default=d.hosts,
        choices=HOSTS,
        help="one: every worker on this host (UCX moves KV by cross-memory "
        "attach); netns: prefills and decodes in two network namespaces "
        "joined by a veth pair, made and removed by the demo, KV over TCP "
        "(needs root and `ip`) (%(default)s)",
    )
    o = p.add_argument_group("output")
    o.add_argument("--json", metavar="FILE", help="write the report as JSON (overwrites FILE)")
    o.add_argument(
        "--quiet",
        action="store_true",
        help="no progress line; a one-line summary instead of the report (the "
        "progress line shows only when stderr is a terminal)",
    )
    o.add_argument(
        "--bw-mib",
        type=int,
        default=d.bw_mib,
        help="raw NIXL bandwidth buffer, MiB; 0 skips that phase (%(default)s)",
    )


def config_from_args(args) -> DemoConfig:
    d = DemoConfig()
    faults = {
        "abort_rate": args.abort_rate,
        "timeout_rate": args.timeout_rate,
        "fail_rate": args.fail_rate,
        "pauses": args.pauses,
    }
    if args.no_faults:
        clash = [f"--{k.replace('_', '-')} {v}" for k, v in faults.items() if v]
        if clash:
            raise ValueError(f"--no-faults contradicts {', '.join(clash)}")
        faults = {k: 0 for k in faults}
    faults = {k: getattr(d, k) if v is None else v for k, v in faults.items()}
    cfg = DemoConfig(
        requests=args.requests,
        pauses=faults["pauses"],
        page_size=args.page_size,
        abort_rate=faults["abort_rate"],
        timeout_rate=faults["timeout_rate"],
        fail_rate=faults["fail_rate"],
        layers=args.layers,
        heads=args.heads,
        head_dim=args.head_dim,
        dtype=args.dtype,
        chunk_tokens=args.chunk_tokens,
        max_tokens=args.max_tokens,
        concurrency=args.concurrency,
        seed=args.seed,
        bootstrap_timeout=args.timeout,
        transfer_timeout=args.timeout,
        bw_mib=args.bw_mib,
        chunks=args.chunks,
        transfer_mode=args.transfer_mode,
        hosts=args.hosts,
        prefills=args.prefills,
        decodes=args.decodes,
        kill_decode=args.kill_decode,
    )
    cfg.validate()
    if args.json is not None:
        check_json_path(args.json)
    return cfg


def check_json_path(path: str) -> None:
    """ValueError naming ``--json`` unless the report can be written to ``path``: its
    directory exists and takes a new file (probed by creating and removing one), and
    ``path`` is a regular file or nothing yet."""
    full = os.path.abspath(path)
    parent = os.path.dirname(full)
    if not path or path.endswith(os.sep) or os.path.isdir(full):
        raise ValueError(f"--json {path}: is a directory, not a file")
    if not os.path.isdir(parent):
        raise ValueError(f"--json {path}: directory {parent} does not exist")
    if os.path.lexists(full) and not os.path.isfile(full):
        raise ValueError(f"--json {path}: exists and is not a regular file")
    try:
        fd, probe = tempfile.mkstemp(
            dir=parent, prefix=f".{os.path.basename(full)}.", suffix=".probe"
        )
    except OSError as e:
        raise ValueError(
            f"--json {path}: cannot create a file in {parent}: {e.strerror or e}"
        ) from None
    os.close(fd)
    os.unlink(probe)


class Terminated(Exception):
    """SIGTERM reached the demo's parent process."""


def _on_sigterm(signum, frame):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # one is enough: the clean-up runs now
    raise Terminated()


def main(args, parser: argparse.ArgumentParser) -> int:
    try:
        cfg = config_from_args(args)
    except ValueError as e:
        parser.error(str(e))  # usage + "kvmem demo: error: ...", exit status 2
    old = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        return _main(args, cfg)
    except KeyboardInterrupt:
        print("\nkvmem demo: interrupted; both workers stopped", file=sys.stderr)
        return 130
    except Terminated:
        print("\nkvmem demo: terminated (SIGTERM); both workers stopped", file=sys.stderr)
        return 128 + signal.SIGTERM
    finally:
        signal.signal(signal.SIGTERM, old)


def _main(args, cfg: DemoConfig) -> int:
    try:
        result = run(cfg, progress=not args.quiet)
    except HostsError as e:
        print(f"\nkvmem demo: --hosts netns: {e}", file=sys.stderr)
        return 2
    except WorkerFailed as e:
        print(f"\nkvmem demo: FAILED: {e}", file=sys.stderr)
        if args.json:
            _save(args.json, dict(ok=False, errors=[str(e)], config=asdict(cfg)))
        return 3
    print(summary_line(result) if args.quiet else format_report(result))
    if args.json and not _save(args.json, result):
        return 1
    return 0 if result["ok"] else 1


def _save(path: str, obj: dict) -> bool:
    try:
        write_json(path, obj)
        return True
    except OSError as e:
        print(f"kvmem demo: --json {path}: cannot write the report: {e}", file=sys.stderr)
        return False


def write_json(path: str, obj: dict) -> None:
    """Write ``obj`` to ``path`` atomically (a temporary file in the same directory, then
    a rename); on failure the temporary file is removed and OSError raised."""
    full = os.path.abspath(path)
    fd, tmp = tempfile.mkstemp(
        dir=os.path.dirname(full), prefix=f".{os.path.basename(full)}.", suffix=".tmp"
    )
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=1, sort_keys=False)
            f.write("\n")
        os.chmod(tmp, 0o644)
        os.replace(tmp, full)
    except BaseException:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        raise
