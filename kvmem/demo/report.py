"""``kvmem demo``'s report as text: the full report (:func:`format_report`), the
``--quiet`` line (:func:`summary_line`) and where the workers' time went
(:func:`loop_breakdown`)."""

from __future__ import annotations

from kvmem.demo.config import DemoConfig
from kvmem.demo.result import OUTCOMES


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 2**20:.1f} MiB"


def format_report(r: dict) -> str:
    c = r["config"]
    lines: list[str] = []
    add = lines.append
    tok = DemoConfig(**c).token_bytes()
    add(
        f"kvmem demo: {r['requests']} requests, model {c['layers']} layers x {c['heads']} KV "
        f"heads x {c['head_dim']} ({c['dtype']}), page {c['page_size']} tokens, "
        f"{tok // 1024} KiB of KV per token; prompts 1..{c['max_tokens']} tokens in "
        f"{c['chunk_tokens']}-token chunks ({_gb(c['chunk_tokens'] * tok)} each), "
        f"{c['concurrency']} in flight"
    )
    add("")
    add("requests by outcome")
    for o in OUTCOMES:
        add(f"  {o:<10} {r[o]:>7}")
    by_status = r["outcomes_by_status"]
    add(
        f"  (aborted includes {by_status.get('503', 0)} aborted by a pause (503); "
        f"sum {sum(r[o] for o in OUTCOMES)} of {r['requests']})"
    )
    late = r["delivered"]["received_after_early_end"]
    add(
        f"  the decode received all KV of {r['delivered']['decode']} requests: the "
        f"{r['succeeded']} succeeded"
        + (
            f", and {len(late)} whose last write had landed when the prefill ended them early"
            if late
            else ""
        )
    )
    add("")
    add("faults injected (planned kind -> how those requests ended)")
    for kind in sorted(r["faults_planned"], key=lambda k: (k != "none", k)):
        ends = r["outcomes_by_fault"].get(kind, {})
        ends_s = ", ".join(f"{k} {v}" for k, v in sorted(ends.items()))
        add(f"  {kind:<22} {r['faults_planned'][kind]:>6}   {ends_s}")
    add("")
    pm = r["pause_mean_ms"]
    add(
        f"pauses: {r['pauses']} (prefill {r['pauses_by_side']['prefill']}, mean "
        f"{_ms(pm['prefill'])}; decode {r['pauses_by_side']['decode']}, mean {_ms(pm['decode'])})"
    )
    ttf = r["time_to_free"]
    add(
        f"aborts in the running batch: {ttf['count']}, prefill pages freed in the same step's "
        f"fill_batch after median {_ms(ttf['median_ms'], 3)}, max {_ms(ttf['max_ms'], 3)}"
    )
    add("")
    add(
        f"bytes: packed {_gb(r['bytes_packed'])}, sent {_gb(r['bytes_sent'])}, landed "
        f"{_gb(r['bytes_transferred'])}, verified {_gb(r['bytes_verified'])}, corrupt "
        f"{r['bytes_corrupt']}"
    )
    raw = r.get("raw_nixl")
    thr = (
        f"throughput: {r['throughput_gbps']:.2f} GB/s of verified KV over {r['wall_seconds']:.1f} s"
    )
    several = c.get("prefills", 1) > 1 or c.get("decodes", 1) > 1
    if raw:
        between = "prefill 0 and decode 0" if several else "the same processes"
        thr += (
            f"; raw NIXL write between {between} {raw['gbps']:.2f} GB/s "
            f"({raw['nbytes'] >> 20} MiB, median of {raw['rounds']}; first write "
            f"{raw['first_s'] * 1e3:.0f} ms): {r['throughput_vs_raw']:.2f}x raw"
        )
    add(thr)
    add(transfer_line(r))
    add(
        f"leaked pages: prefill {r['leaked_pages']['prefill']}, decode "
        f"{r['leaked_pages']['decode']}"
    )
    for side in ("prefill", "decode"):
        if r[side]["leaked_owners"]:
            add(f"  {side} owners: {r[side]['leaked_owners']}")
    add(
        f"protocol errors: prefill {r['protocol_errors']['prefill']}, decode "
        f"{r['protocol_errors']['decode']}"
    )
    hosts = r.get("hosts", {})
    if hosts.get("kind") == "netns":
        link = hosts.get("link_bytes") or {}
        sent = link.get("prefill", {}).get("tx")
        add(
            f"hosts: prefills in network namespace {hosts['namespaces']['prefill']}, decodes "
            f"in {hosts['namespaces']['decode']}, joined by a veth pair "
            f"({hosts['addresses']['prefill']} <-> {hosts['addresses']['decode']}), UCX over "
            f"{hosts['ucx_tls']}"
            + (
                f"; the prefills' end sent {_gb(sent)}, received {_gb(link['prefill']['rx'])}"
                if sent is not None
                else ""
            )
        )
    if several or "killed" in r:
        add("")
        lines.extend(peer_lines(r))
    add("")
    add(f"where the time went (seconds of the {r['wall_seconds']:.1f} s workload)")
    for side in ("prefill", "decode"):
        st = r[side]["stage_seconds"]
        b = loop_breakdown(st)
        nap = st.get("nap", {})
        ws = r[side].get("workers")
        who = f"{side} ({len(ws)} workers, summed)" if ws else side
        add(
            f"  {who}: worker loop {b['loop']:.2f}, of which in step() {b['step']:.2f}, "
            f"napping {b['nap']:.2f} ({nap.get('calls', 0)} naps)"
        )
        for k, sec in sorted(b["in_step"].items(), key=lambda x: -x[1]):
            add(f"    {k:<32} {sec:7.2f}   {st[k]['calls']:>8} calls")
        add(f"    {'rest of step() (Python)':<32} {b['rest_of_step']:7.2f}")
    add("")
    ph = r.get("phase_seconds", {})
    add(f"total {r['total_seconds']:.1f} s: " + ", ".join(f"{k} {v:.1f} s" for k, v in ph.items()))
    for side, st in r.get("setup_seconds", {}).items():
        add(
            f"  {side} set-up: "
            + ", ".join(f"{k} {v:.1f} s" for k, v in st.items())
            + " (the rest of start-up: interpreter and imports)"
        )
    for w in r.get("warnings", []):
        add(f"warning: {w}")
    add("OK" if r["ok"] else "FAILED:\n  " + "\n  ".join(r["errors"]))
    return "\n".join(lines)


# stages a worker times outside step(): its loop, the naps between steps
_OUTSIDE_STEP = ("step", "loop", "nap")


def loop_breakdown(stage_seconds: dict) -> dict:
    """A worker's ``stage_seconds`` (name -> {"seconds", "calls"}) as ``loop``, ``step``
    and ``nap`` seconds, ``in_step`` (the stages timed inside ``step()``, name -> seconds)
    and ``rest_of_step``: ``step`` minus those, the Python of ``step()`` itself."""
    sec = {k: v["seconds"] for k, v in stage_seconds.items()}
    in_step = {k: v for k, v in sec.items() if k not in _OUTSIDE_STEP}
    step = sec.get("step", 0.0)
    return {
        "loop": sec.get("loop", 0.0),
        "step": step,
        "nap": sec.get("nap", 0.0),
        "in_step": in_step,
        "rest_of_step": step - sum(in_step.values()),
    }


def _counts(d: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(d.items()) if v) or "none"


def peer_lines(r: dict) -> list[str]:
    """The report's per-worker section: each worker's requests, per peer."""
    out = ["workers (requests by outcome, and per peer: the requests bound to it, bytes)"]
    kill = r.get("killed") or {}  # a worker's row says killed only when this is set
    for key, row in r["peers"].items():
        if row["killed"]:
            mid = "; ".join(f"{p}: {rids}" for p, rids in kill["mid_transfer"].items())
            out.append(
                f"  {key:<9} KILLED by the demo (SIGKILL) after {kill['finished_before']} "
                f"requests had finished, in the middle of receiving "
                + (mid or "nothing (it never was: killed at the end)")
            )
            continue
        n = sum(row["requests"].values())
        verb = "ran" if row["role"] == "prefill" else "received"
        out.append(f"  {key:<9} {verb} {n}: {_counts(row['requests'])}")
        for peer, c in sorted(row["by_peer"].items()):
            what = "to" if row["role"] == "prefill" else "from"
            st = row.get("status_by_peer", {}).get(peer)
            out.append(
                f"    {what} {peer:<9} {sum(c['requests'].values()):>5}: "
                f"{_counts(c['requests'])}"
                + (f" (status {_counts(st)})" if st else "")
                + f"; {_gb(c['bytes'])}"
                + (f"; {c['send_errors']} messages not sent" if c["send_errors"] else "")
            )
    if kill:
        for p, by in kill["ended_on_prefills"].items():
            for peer, info in by.items():
                ends: dict[str, int] = {}
                for st in info["status"].values():
                    ends[str(st)] = ends.get(str(st), 0) + 1
                out.append(
                    f"  {p}: {len(info['active'])} request(s) bound to {peer} were "
                    f"active when it died; they ended with status {_counts(ends)}"
                )
        un = r["delivered"]["unconfirmed"]
        if un:
            out.append(
                f"  {len(un)} request(s) the prefills count delivered to "
                f"{kill['worker']} are not confirmed by it (its last progress message "
                f"came before they landed): {un[:10]}"
            )
    return out


def _ms(x, digits: int = 0) -> str:
    return "-" if x is None else f"{x:.{digits}f} ms"


def transfer_line(r: dict) -> str:
    thr = r.get("direct_threshold")
    cal = r.get("calibration")
    how = {
        "auto": "per chunk",
        "packed": "all packed",
        "direct": "all direct",
        "pulled": "read by the decode, pool to pool",
    }[r["chunk_mode"]]
    if r["chunk_mode"] == "auto":
        how += (
            ", direct from "
            + (
                f"{thr / 1024:g} KiB per merged descriptor"
                if thr is not None
                else "nowhere (packing won at every run length)"
            )
            + (f" (calibrated at start-up over {len(cal['rows'])} run lengths)" if cal else "")
        )
    ch = r.get("chunks", {})
    cpu = r["cpu"]
    per = "; ".join(
        f"{s} {c['seconds']:.1f} s"
        + (f" = {c['seconds_per_gb']:.2f} s/GB" if c["seconds_per_gb"] is not None else "")
        + (
            f", {c['poll_share']:.0%} of its loop polling"
            if c.get("poll_share") is not None
            else ""
        )
        for s, c in cpu.items()
        if c["seconds"] is not None
    )
    kinds = ", ".join(f"{n} {k}" for k, n in sorted(ch.items())) or "none"
    return (
        f"transfer: {r['transfer_mode']}, chunks {how}: {kinds}; CPU of the workload: {per or '-'}"
    )


def summary_line(r: dict) -> str:
    raw = f", {r['throughput_vs_raw']:.2f}x raw NIXL" if r.get("raw_nixl") else ""
    status = "OK" if r["ok"] else "FAILED: " + "; ".join(r["errors"])
    warn = "".join(f"; warning: {w}" for w in r.get("warnings", []))
    if r.get("killed"):
        warn += f"; {r['killed']['worker']} killed by the demo"
    return (
        f"kvmem demo: {r['requests']} requests: "
        + ", ".join(f"{o} {r[o]}" for o in OUTCOMES)
        + f"; pauses {r['pauses']}; leaked {r['leaked_pages']}; "
        f"{r['throughput_gbps']:.2f} GB/s verified{raw}; {r['wall_seconds']:.1f} s{warn}: "
        f"{status}"
    )
