"""``kvmem demo``'s result: the dict ``--json`` writes, built from the workers' final
reports (:func:`build_result`), and the checks that fail a run (:func:`check`)."""

from __future__ import annotations

import signal
import statistics
from dataclasses import asdict

OUTCOMES = ("succeeded", "aborted", "timed_out", "failed")


def exit_how(code) -> str:
    """A process's ``exitcode`` (multiprocessing's: None while running, -N for signal N)
    in words: 'still running', 'killed by signal 11 (SIGSEGV)', 'exit status 1'."""
    if code is None:
        return "still running"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = "unknown"
        return f"killed by signal {-code} ({name})"
    return f"exit status {code}"


def _ms_stats(xs) -> dict:
    if not xs:
        return {"count": 0, "median_ms": None, "max_ms": None}
    return {"count": len(xs), "median_ms": statistics.median(xs) * 1e3, "max_ms": max(xs) * 1e3}


def _add(a, b):
    """``a`` + ``b`` for the workers' counters: numbers add, dicts add key by key, lists
    join; anything else keeps ``a``."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = dict(a)
        for k, v in b.items():
            out[k] = _add(out[k], v) if k in out else v
        return out
    if isinstance(a, list) and isinstance(b, list):
        return a + b
    if (
        isinstance(a, (int, float))
        and isinstance(b, (int, float))
        and not isinstance(a, bool)
        and not isinstance(b, bool)
    ):
        return a + b
    return a


def _exit_code(codes: list):
    """One side's exit code from its workers': None if one is still running, else the
    worst: a failure status, then a signal, then 0."""
    if any(c is None for c in codes):
        return None
    return max(codes) if any(c > 0 for c in codes) else min(codes)


def _worker_report(f: dict, exit_code, role: str, index: int, agent: str) -> dict:
    m = dict(f["metrics"])
    m.pop("time_to_free")
    return dict(
        role=role,
        index=index,
        agent=agent,
        killed=False,
        metrics=m,
        freed_by_reason=f["freed_by_reason"],
        leaked_pages=int(f["leaked_pages"]),
        leaked_owners=f["leaked_owners"],
        audit=f["audit"],
        allocator_allocated=f["allocator_allocated"],
        arena_used_bytes=f["arena_used_bytes"],
        open_handles=f["open_handles"],
        closed=f["closed"],
        exit_code=exit_code,
        stage_seconds=f["stage_seconds"],
    )


def _side_report(reports: list[dict]) -> dict:
    """One kind's workers as one: a single worker's report as it is; several added up
    (counters summed, owners named ``worker: owner``)."""
    if len(reports) == 1:
        return reports[0]
    out = dict(
        metrics={},
        freed_by_reason={},
        leaked_pages=0,
        leaked_owners={},
        audit={"leaked": {}, "quarantined": {}, "unaccounted": []},
        allocator_allocated=0,
        arena_used_bytes=0,
        open_handles=0,
        closed=True,
        exit_code=_exit_code([r["exit_code"] for r in reports]),
        stage_seconds={},
        workers=[r["key"] for r in reports],
    )
    for r in reports:
        key = r["key"]
        out["metrics"] = _add(out["metrics"], r["metrics"])
        out["freed_by_reason"] = _add(out["freed_by_reason"], r["freed_by_reason"])
        out["stage_seconds"] = _add(out["stage_seconds"], r["stage_seconds"])
        out["leaked_owners"].update({f"{key}: {o}": n for o, n in r["leaked_owners"].items()})
        for part in ("leaked", "quarantined"):
            out["audit"][part].update({f"{key}: {o}": p for o, p in r["audit"][part].items()})
        out["audit"]["unaccounted"] += [[key, p] for p in r["audit"]["unaccounted"]]
        for k in ("leaked_pages", "allocator_allocated", "arena_used_bytes", "open_handles"):
            out[k] += r[k]
        out["closed"] = out["closed"] and r["closed"]
    return out


def build_result(
    cfg,
    final: dict,
    raw,
    wall: float,
    total: float,
    exit_codes: dict,
    *,
    keys=None,
    roles=None,
    agents=None,
    kill=None,
    confirmed=None,
    last=None,
) -> dict:
    """The report from the workers' final messages (``final``: key -> message; a killed
    worker has none).  ``keys``, ``roles``, ``agents``: the workers (default: one prefill
    "prefill", one decode "decode"); ``kill``: what --kill-decode did; ``confirmed``:
    decode key -> the request ids its progress messages reported delivered; ``last``:
    each worker's last progress message."""
    if keys is None:
        keys, roles = ["prefill", "decode"], {"prefill": "prefill", "decode": "decode"}
        agents = {k: k for k in keys}
    confirmed, last = confirmed or {}, last or {}
    index = {}
    for k in keys:
        index[k] = sum(1 for kk in keys[: keys.index(k)] if roles[kk] == roles[k])
    by_agent = {agents[k]: k for k in keys}
    pre = [k for k in keys if roles[k] == "prefill"]
    dec = [k for k in keys if roles[k] == "decode" and k in final]
    workers = {}
    for k in keys:
        if k in final:
            workers[k] = _worker_report(final[k], exit_codes.get(k), roles[k], index[k], agents[k])
            workers[k]["key"] = k
        else:  # killed by the demo: what its last progress message said
            workers[k] = dict(
                role=roles[k],
                index=index[k],
                agent=agents[k],
                killed=True,
                exit_code=exit_codes.get(k),
                last_progress=last.get(k, {}),
                key=k,
            )
    pm = _side_report([workers[k] for k in pre])["metrics"]
    dm = _side_report([workers[k] for k in dec])["metrics"]
    gone = [k for k in keys if workers[k]["killed"]]
    lost = {
        f: sum(int(last.get(k, {}).get(f, 0)) for k in gone)
        for f in ("bytes_landed", "bytes_verified", "bytes_corrupt")
    }
    outcomes = {o: int(pm["requests"].get(o, 0)) for o in OUTCOMES}
    verified = int(dm["bytes_verified"]) + lost["bytes_verified"]
    res = dict(
        requests=cfg.requests,
        **outcomes,
        pauses=int(pm["pauses"] + dm["pauses"]),
        bytes_transferred=int(dm["bytes_landed"]) + lost["bytes_landed"],
        bytes_verified=verified,
        bytes_corrupt=int(dm["bytes_corrupt"]) + lost["bytes_corrupt"],
        leaked_pages={
            "prefill": sum(workers[k]["leaked_pages"] for k in pre),
            "decode": sum(workers[k]["leaked_pages"] for k in dec),
        },
        throughput_gbps=float(verified / wall / 1e9) if wall > 0 else 0.0,
        wall_seconds=wall,
        total_seconds=total,
    )
    calibration = raw.pop("calibration", None) if raw else None
    if raw and "warm_s" not in raw:
        raw = None  # the phase ran for the calibration only (--bw-mib 0)
    if raw:
        warm = raw["warm_s"]
        med = statistics.median(warm)
        res["raw_nixl"] = dict(
            nbytes=raw["nbytes"],
            rounds=len(warm),
            first_s=raw["first_s"],
            median_s=med,
            gbps=raw["nbytes"] / med / 1e9,
            best_gbps=raw["nbytes"] / min(warm) / 1e9,
            verified=raw["verified"],
        )
        res["raw_nixl_gbps"] = res["raw_nixl"]["gbps"]
        res["throughput_vs_raw"] = res["throughput_gbps"] / res["raw_nixl_gbps"]
    else:
        res["raw_nixl_gbps"] = None
        res["throughput_vs_raw"] = None
    fp = [final[k] for k in pre]
    merged: dict[str, dict] = {
        f: {} for f in ("faults_planned", "outcomes_by_fault", "outcomes_by_status")
    }
    for f in fp:
        for field_ in merged:
            merged[field_] = _add(merged[field_], {str(a): b for a, b in f[field_].items()})
    res.update(
        faults_planned=merged["faults_planned"],
        outcomes_by_fault=merged["outcomes_by_fault"],
        outcomes_by_status=merged["outcomes_by_status"],
        pauses_by_side={"prefill": pm["pauses"], "decode": dm["pauses"]},
        pause_mean_ms={
            s: (m["pause_seconds"] / m["pauses"] * 1e3 if m["pauses"] else None)
            for s, m in (("prefill", pm), ("decode", dm))
        },
        time_to_free=_ms_stats([x for k in pre for x in final[k]["metrics"]["time_to_free"]]),
        protocol_errors={"prefill": pm["protocol_errors"], "decode": dm["protocol_errors"]},
        bytes_packed=int(pm["bytes_packed"]),
        bytes_sent=int(pm["bytes_sent"]),
    )
    for side, ks in (("prefill", pre), ("decode", dec)):
        res[side] = {
            k: v
            for k, v in _side_report([workers[k] for k in ks]).items()
            if k not in ("role", "index", "agent", "killed", "key")
        }
    # Delivered, per decode.  A request can end early on the prefill (an abort, a pause)
    # after its last write landed and was announced: the decode has all of it, the client
    # was told otherwise.  The other way round (told delivered, not received) is a failure,
    # unless that decode was killed: what it received after its last progress message is
    # unknown (``unconfirmed``).
    pre_ok = {r for f in fp for r in f["succeeded_rids"]}
    missing, unconfirmed, late, dec_ok_n = [], [], [], 0
    for k in [k for k in keys if roles[k] == "decode"]:
        told = {r for f in fp for r in f["succeeded_by_peer"].get(agents[k], [])}
        if k in final:
            got = set(final[k]["succeeded_rids"])
            missing += sorted(told - got)
            late += sorted(got - pre_ok)
            dec_ok_n += len(got)
        else:
            unconfirmed += sorted(told - set(confirmed.get(k, [])))
            dec_ok_n += len(told & set(confirmed.get(k, [])))
    res["delivered"] = dict(
        prefill=len(pre_ok),
        decode=dec_ok_n,
        missing=sorted(missing),
        received_after_early_end=sorted(late),
        unconfirmed=sorted(unconfirmed),
    )
    res.update(
        transfer_fields(
            cfg, fp, [final[k] for k in dec], calibration, final[pre[0]].get("direct_threshold")
        )
    )
    res["config"] = asdict(cfg)
    res["workers"] = {
        k: {kk: vv for kk, vv in w_.items() if kk != "key"} for k, w_ in workers.items()
    }
    res["peers"] = peer_table(keys, roles, final, workers, by_agent)
    if kill is not None:
        res["killed"] = dict(
            kill,
            ended_on_prefills={
                p: {by_agent.get(a, a): info for a, info in final[p].get("gone", {}).items()}
                for p in pre
            },
        )
    errors = check(res)
    res["ok"] = not errors
    res["errors"] = errors
    res["warnings"] = exit_warnings(res)
    return res


def peer_table(keys, roles, final, workers, by_agent) -> dict:
    """Per worker: its requests by outcome (a prefill: those it ran; a decode: those it
    received), and per peer (by worker key) the requests bound to that peer by outcome,
    the bytes moved with it and the messages it could not be sent; a prefill also
    counts its requests per decode by status.  A killed worker: ``killed`` only."""
    out = {}
    for k in keys:
        if k not in final:
            out[k] = {"role": roles[k], "killed": True}
            continue
        m = final[k]["metrics"]
        row = {
            "role": roles[k],
            "killed": False,
            "requests": dict(m["requests"]),
            "by_peer": {by_agent.get(a, a): c for a, c in m.get("peers", {}).items()},
        }
        if roles[k] == "prefill":
            row["status_by_peer"] = {
                by_agent.get(a, a): {str(s): n for s, n in c.items()}
                for a, c in final[k].get("status_by_peer", {}).items()
            }
            row["routed"] = {by_agent.get(a, a): n for a, n in final[k].get("routed", {}).items()}
        out[k] = row
    return out


def check(res: dict) -> list[str]:
    """What makes the run fail (exit status 1)."""
    errs = []
    parts = sum(res[o] for o in OUTCOMES)
    if parts != res["requests"]:
        errs.append(f"outcomes add up to {parts}, not {res['requests']} requests")
    for key, s in res["workers"].items():
        if s["killed"]:
            continue  # killed by the demo (--kill-decode): nothing of it is left to check
        if s["leaked_pages"]:
            errs.append(
                f"{key}: {s['leaked_pages']} page(s) leaked, held by "
                f"{s['leaked_owners'] or 'nobody (unaccounted)'}"
            )
        if s["allocator_allocated"]:
            errs.append(
                f"{key}: the allocator still counts {s['allocator_allocated']} pages allocated"
            )
        if s["arena_used_bytes"]:
            errs.append(
                f"{key}: {s['arena_used_bytes']} bytes of its registered buffer still reserved"
            )
        if s["open_handles"]:
            errs.append(f"{key}: {s['open_handles']} transfer handle(s) still open")
        if s["metrics"]["protocol_errors"]:
            errs.append(f"{key}: {s['metrics']['protocol_errors']} control message(s) refused")
        if s["exit_code"] is None or s["exit_code"] > 0:  # a signal: exit_warnings
            errs.append(f"{key} worker exited with status {s['exit_code']}")
    for key, row in res.get("peers", {}).items():
        if not row["killed"] and sum(row["requests"].values()) != sum(
            sum(c["requests"].values()) for c in row["by_peer"].values()
        ):
            errs.append(f"{key}: its requests by peer do not add up to its requests")
    if res["bytes_corrupt"]:
        errs.append(f"{res['bytes_corrupt']} landed bytes failed verification")
    if res["bytes_verified"] != res["bytes_transferred"]:
        errs.append(f"{res['bytes_transferred']} bytes landed but {res['bytes_verified']} verified")
    if res["delivered"]["missing"]:
        errs.append(
            f"the prefill reports requests {res['delivered']['missing'][:10]} delivered, "
            "the decode did not receive them"
        )
    if res.get("raw_nixl") and not res["raw_nixl"]["verified"]:
        errs.append("the raw NIXL bandwidth buffer did not arrive intact")
    return errs


def exit_warnings(res: dict) -> list[str]:
    """The workers that died of a signal after their final report: every result came in
    that report, so the run stands; each is named with its signal.  (A worker that dies
    before its final report fails the run, exit status 3, before there is a result; one
    the demo killed is no warning.)"""
    return [
        f"the {key} worker was {exit_how(s['exit_code'])} after its final "
        "report (its results are complete)"
        for key, s in res["workers"].items()
        if not s["killed"] and s["exit_code"] is not None and s["exit_code"] < 0
    ]


def transfer_fields(cfg, pre: list, dec: list, calibration, threshold) -> dict:
    """The report's transfer-mode and CPU fields, from the final messages of the prefill
    workers (``pre``) and the decode workers (``dec``): ``transfer_mode`` (push: the
    prefill writes), ``chunk_mode`` (--chunks), ``direct_threshold`` (``threshold``: bytes
    per merged descriptor from which a chunk went direct; None: every chunk packed),
    ``calibration`` (the measurement behind it, --chunks auto), ``chunks`` (posted, by
    kind), and ``cpu``: per side, CPU seconds of the workload (``time.process_time``,
    every thread of its worker processes) and per GB it moved (prefill: bytes sent, decode:
    bytes landed), and ``poll_share``: the share of its workload loops spent in
    ``get_notifs``."""
    cpu = {}
    for side, fs, moved in (("prefill", pre, "bytes_sent"), ("decode", dec, "bytes_landed")):
        secs = [f.get("cpu_seconds") for f in fs]
        s = None if not secs or any(x is None for x in secs) else sum(secs)
        b = sum(int(f["metrics"][moved]) for f in fs)
        st: dict = {}
        for f in fs:
            st = _add(st, f.get("stage_seconds", {}))
        loop = st.get("loop", {}).get("seconds", 0.0)
        cpu[side] = dict(
            seconds=s,
            bytes=b,
            seconds_per_gb=(s / (b / 1e9)) if s is not None and b else None,
            poll_share=(st.get("get_notifs", {}).get("seconds", 0.0) / loop if loop > 0 else None),
        )
    chunks: dict = {}
    for f in pre:
        chunks = _add(chunks, f.get("chunk_modes", {}))
    return dict(
        transfer_mode=cfg.transfer_mode,
        chunk_mode=cfg.chunks if cfg.transfer_mode == "push" else "pulled",
        direct_threshold=threshold,
        calibration=calibration,
        chunks=chunks,
        cpu=cpu,
        cpu_seconds_per_gb={k: v["seconds_per_gb"] for k, v in cpu.items()},
    )
