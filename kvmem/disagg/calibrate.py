"""The packed/direct threshold of a prefill side, measured between its pool and the
decode's, at start-up (``kvmem demo`` runs it before the workload).

A direct write costs the wire time plus a fixed cost per descriptor (one ``cma`` write per
merged run of pages, per layer and K|V, on UCX here); a packed chunk costs a pack on the
prefill, one contiguous write and an unpack on the decode.  So direct wins above some run
length.  The calibration moves one chunk of ``chunk_pages`` pages both ways, its pages laid
out in runs of ``r`` adjacent pages (a one-page gap between runs, on both sides, so NIXL
cannot merge across runs), for ``r`` = 1, 2, 4, ...; each a median of ``rounds`` timed
moves:

    direct_s(r)  post_blocks of the chunk's blocks, polled to DONE
    packed_s(r)  pack_pages into staging + post_write into the landing region, polled to
                 DONE, + the pack time again for the decode's unpack (same kernel, the other
                 direction; the decode's time is not visible from here, so it is estimated)

Each row keeps the fastest of its moves (the figure least disturbed by other processes
on a shared machine) beside the median and the spread.  A straight line through the
direct times against the number of descriptors (Theil-Sen: robust to one slow move)
gives the cost of one descriptor and the rest; the packed time hardly depends on ``r`` (its median over the
rows is taken).  The threshold is the descriptor size at which the line meets the packed
time: ``r* = descriptors(r=1) * per_descriptor / (packed - rest)`` pages of a layer,
at least one page; ``None`` (pack everything) when direct is slower even as one
descriptor per layer and K|V.  The record (:func:`calibrate_direct`'s return) keeps every
measurement and the fit beside the result.

Needs: no request in flight (it writes into free pages of the decode's pool and the start
of its landing region), the decode's engine driven meanwhile (its worker polls
notifications: without a progress thread a write completes when both sides progress).
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch

import kvmem
from kvmem.disagg.peers import RegionMap


def _spread(n: int, r: int) -> np.ndarray:
    """``n`` page ids from 1 in runs of ``r`` adjacent ids, one id skipped between runs."""
    i = np.arange(n, dtype=np.int64)
    return 1 + (i // r) * (r + 1) + i % r


def _wait(engine, h) -> None:
    while engine.poll(h) == "PROC":
        pass
    state, err = h.state, h.error
    engine.release(h)
    if state != "DONE":
        raise RuntimeError(f"calibration write ended {state}: {err}")


def calibrate_direct(
    side, chunk_pages: int, rounds: int = 5, runs=None, peer: str | None = None
) -> dict:
    """Measure packed against direct for one chunk of ``chunk_pages`` pages of ``side``
    (a :class:`~kvmem.disagg.prefill.PrefillSide` whose peer's metadata is loaded), moved
    to decode peer ``peer`` (may be left out when the side has one), at several run
    lengths; returns the record, ``threshold`` (bytes per merged descriptor, or None)
    among it.  Nothing of the side changes (its threshold is the caller's to set)."""
    eng, pool = side.engine, side.pool
    spec = pool.spec
    peer = side.peers.sole if peer is None else peer
    own = side.sending.direct.local_table is None  # the side sends packed only: prepare lists here
    lt = eng.prep_local("kv") if own else side.sending.direct.local_table
    rt = eng.prep_remote(eng.remote(peer, "kv")) if own else side.peers.get(peer).table.get()
    landing = eng.remote(peer, "landing")
    plane = int(lt.nbytes.min())
    nbytes = kvmem.packed_nbytes(spec, chunk_pages)
    if runs is None:
        runs, r = [], 1
        while r <= chunk_pages:
            runs.append(r)
            r *= 2
    most = max(int(_spread(chunk_pages, r)[-1]) for r in runs)
    if most >= min(lt.layout.count, rt.layout.count) or nbytes > side.staging.arena.size:
        raise ValueError(
            f"calibrate_direct: {chunk_pages} pages spread in runs need pool "
            f"pages up to {most} and {nbytes} bytes of staging"
        )
    staging = side.staging.tensor[:nbytes]
    landing_map = RegionMap(landing.regions)
    if nbytes > landing_map.size:
        raise ValueError(
            f"calibrate_direct: the decode's landing buffer ({landing_map.size} "
            f"bytes) is smaller than one chunk ({nbytes} bytes)"
        )
    # both cut at their physical chunks' boundaries, as the side's own writes are
    local = side.staging.map.ranges(0, nbytes)
    remote = landing_map.ranges(0, nbytes)
    planes = np.arange(lt.nbytes.size, dtype=np.int64)[:, None]
    # a timed pack ends when the device is done (CUDA runs it asynchronously): this is a
    # measurement at start-up, not the hot path
    done = (
        (lambda: torch.cuda.synchronize(pool.device))
        if pool.device.type == "cuda"
        else (lambda: None)
    )
    rows = []
    try:
        for r in runs:
            pages = _spread(chunk_pages, r)
            li = (planes * lt.layout.count + pages).reshape(-1)
            ri = (planes * rt.layout.count + pages).reshape(-1)
            d, p, k = [], [], []
            for i in range(rounds + 1):  # the first of each is a warm-up
                t0 = time.perf_counter()
                _wait(eng, eng.post_blocks(lt, li, rt, ri))
                t1 = time.perf_counter()
                kvmem.pack_pages(pool, pages, out=staging)  # NumPy ids: to the pool's device
                done()
                t2 = time.perf_counter()
                _wait(eng, eng.post_write(local, landing, remote))
                t3 = time.perf_counter()
                if i:
                    d.append(t1 - t0)
                    k.append(t2 - t1)
                    p.append(t3 - t1 + (t2 - t1))
            rows.append(
                dict(
                    run_pages=r,
                    descriptor_bytes=r * plane,
                    descriptors=int(li.size // r),
                    direct_s=min(d),
                    packed_s=min(p),
                    pack_s=min(k),
                    direct_median_s=statistics.median(d),
                    packed_median_s=statistics.median(p),
                    direct_spread_s=[min(d), max(d)],
                    packed_spread_s=[min(p), max(p)],
                )
            )
    finally:
        if own:
            eng.release_table(rt)
            eng.release_table(lt)
    x = np.array([row["descriptors"] for row in rows], dtype=np.float64)
    y = np.array([row["direct_s"] for row in rows], dtype=np.float64)
    # Theil-Sen: the median of the slopes between every two rows, so that one move slowed
    # by another process (a 5x outlier was seen at load 4) does not tilt the line
    slopes = [
        (y[j] - y[i]) / (x[j] - x[i])
        for i in range(len(x))
        for j in range(i + 1, len(x))
        if x[j] != x[i]
    ]
    per_desc = float(np.median(slopes)) if slopes else 0.0
    rest = float(np.median(y - per_desc * x))
    packed = statistics.median(row["packed_s"] for row in rows)
    descs = float(x.max())  # descriptors at one page per run
    if per_desc <= 0:
        threshold = plane  # no measurable cost per descriptor: direct whenever possible
    elif rest + per_desc * descs <= packed:
        threshold = plane  # direct wins even at one page per descriptor
    elif rest >= packed:
        threshold = None  # direct loses even as one descriptor per layer and K|V
    else:
        r_star = descs * per_desc / (packed - rest)  # pages of a layer per descriptor
        threshold = int(np.ceil(r_star)) * plane
    return dict(
        threshold=threshold,
        chunk_pages=chunk_pages,
        chunk_bytes=nbytes,
        page_plane_bytes=plane,
        rounds=rounds,
        rows=rows,
        fit=dict(direct_per_descriptor_s=per_desc, direct_rest_s=rest, packed_s=packed),
        how="fastest of the timed moves of one chunk, pages in runs of run_pages on "
        "both sides; packed = pack + contiguous write + the pack time again for "
        "the decode's unpack (estimated); direct fitted (Theil-Sen) as rest + "
        "per_descriptor * descriptors; threshold where it meets the packed median",
    )
