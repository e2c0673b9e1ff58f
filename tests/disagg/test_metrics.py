"""kvmem.disagg.metrics: the PD sides' counters in a prometheus_client registry.  Values after a
real run of both sides (the disagg harness: two engines in this process), the
exposition parsed back with prometheus_client's own parser, a scrape over HTTP from the
server thread, and the registration rules (kvmem's own registry by default, one side of
each kind per registry, errors that change nothing)."""

from __future__ import annotations

import dataclasses
import urllib.request
from types import SimpleNamespace

import prometheus_client
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import kvmem.disagg.metrics
from kvmem.disagg import Metrics

COUNTERS = (
    "kvmem_requests",
    "kvmem_pages_freed",
    "kvmem_transfer_bytes",
    "kvmem_pauses",
    "kvmem_pause_seconds",
    "kvmem_protocol_errors",
    "kvmem_send_errors",
)


def scrape(registry) -> dict:
    """``{family name: (type, help, {(sample name, labels as sorted tuple): value})}``,
    from the text exposition as a Prometheus server would read it."""
    out = {}
    for fam in text_string_to_metric_families(generate_latest(registry).decode()):
        out[fam.name] = (
            fam.type,
            fam.documentation,
            {(s.name, tuple(sorted(s.labels.items()))): s.value for s in fam.samples},
        )
    return out


def value(fams, family, sample, **labels):
    return fams[family][2][(sample, tuple(sorted(labels.items())))]


def run_every_path(pair) -> None:
    """A success, a client abort, an abort in the running batch (time_to_free), a pause
    and resume of each side, then idle."""
    p = pair.prefill
    p.add_request(1, 64)
    p.add_request(2, 100)
    p.abort(2)
    pair.faults.abort_in_batch.add(3)
    p.add_request(3, 80)
    pair.run_idle()
    p.begin_pause()
    pair.run_until(lambda: p.paused)
    pair.clock.advance(0.25)
    p.resume()
    pair.decode.begin_pause()
    pair.run_until(lambda: pair.decode.paused)
    pair.decode.resume()
    p.add_request(4, 40)
    pair.run_idle()
    pair.assert_clean()


def test_values_after_a_real_run_match_the_sides_counters(pair):
    reg = CollectorRegistry()
    assert kvmem.disagg.metrics.register(pair.prefill, reg) is reg
    kvmem.disagg.metrics.register(pair.decode, reg)
    run_every_path(pair)
    fams = scrape(reg)

    for name in COUNTERS:
        assert fams[name][0] == "counter" and fams[name][1], name
    assert fams["kvmem_abort_free_seconds"][0] == "histogram"
    assert fams["kvmem_pages"][0] == "gauge"

    for side in (pair.prefill, pair.decode):
        kind, m = side.metrics.side, side.metrics
        assert m.requests, kind  # the run ended requests on both sides
        for o in ("succeeded", "aborted", "timed_out", "failed"):
            assert (
                value(fams, "kvmem_requests", "kvmem_requests_total", side=kind, outcome=o)
                == m.requests[o]
            )
        freed = dict(side.ledger.freed_by_reason)
        assert sum(freed.values()) > 0
        got = {
            dict(lab)["reason"]: v
            for (n, lab), v in fams["kvmem_pages_freed"][2].items()
            if dict(lab)["side"] == kind
        }
        assert got == freed, kind
        assert value(fams, "kvmem_pauses", "kvmem_pauses_total", side=kind) == m.pauses == 1
        assert value(
            fams, "kvmem_pause_seconds", "kvmem_pause_seconds_total", side=kind
        ) == pytest.approx(m.pause_seconds)
        assert (
            value(fams, "kvmem_protocol_errors", "kvmem_protocol_errors_total", side=kind)
            == m.protocol_errors
        )
        assert (
            value(fams, "kvmem_send_errors", "kvmem_send_errors_total", side=kind) == m.send_errors
        )
        assert (
            value(fams, "kvmem_pages", "kvmem_pages", side=kind, state="free")
            == side.alloc.num_free
            > 0
        )
        assert value(fams, "kvmem_pages", "kvmem_pages", side=kind, state="allocated") == 0
    assert pair.prefill.metrics.pause_seconds == pytest.approx(0.25)

    pm, dm = pair.prefill.metrics, pair.decode.metrics
    stages = {
        (dict(lab)["side"], dict(lab)["stage"]): v
        for (n, lab), v in fams["kvmem_transfer_bytes"][2].items()
    }
    assert stages == {
        (side.metrics.side, stage): getattr(side.metrics, f"bytes_{stage}")
        for side in (pair.prefill, pair.decode)
        for stage in ("packed", "sent", "landed", "verified", "corrupt")
    }
    assert pm.bytes_packed > 0 and pm.bytes_sent > 0
    assert dm.bytes_verified == dm.bytes_landed > 0

    # per peer: each side has one peer here, so its series equal the side's totals
    for side, peer, moved in (
        (pair.prefill, pair.de.name, pm.bytes_sent),
        (pair.decode, pair.pe.name, dm.bytes_landed),
    ):
        kind, m = side.metrics.side, side.metrics
        assert set(m.peers) == {peer}
        for o in ("succeeded", "aborted", "timed_out", "failed"):
            assert (
                value(
                    fams,
                    "kvmem_peer_requests",
                    "kvmem_peer_requests_total",
                    side=kind,
                    peer=peer,
                    outcome=o,
                )
                == m.peers[peer].requests[o]
                == m.requests[o]
            )
        assert (
            value(fams, "kvmem_peer_bytes", "kvmem_peer_bytes_total", side=kind, peer=peer)
            == m.peers[peer].bytes
            == moved
        )
        assert (
            value(
                fams, "kvmem_peer_send_errors", "kvmem_peer_send_errors_total", side=kind, peer=peer
            )
            == m.peers[peer].send_errors
            == m.send_errors
        )

    # the abort in the running batch: one observation (the test's clock stands still)
    assert len(pm.time_to_free) == 1
    hist = fams["kvmem_abort_free_seconds"][2]
    assert hist[("kvmem_abort_free_seconds_count", (("side", "prefill"),))] == 1
    assert hist[("kvmem_abort_free_seconds_bucket", (("le", "+Inf"), ("side", "prefill")))] == 1
    assert hist[("kvmem_abort_free_seconds_count", (("side", "decode"),))] == 0


def test_every_metrics_field_is_exposed():
    """A counter added to Metrics must reach the exposition too."""
    fields = {f.name for f in dataclasses.fields(Metrics)} - {"side"}
    assert fields == kvmem.disagg.metrics.FIELDS


def test_histogram_buckets_are_cumulative():
    m = Metrics("prefill", time_to_free=[0.0002, 0.0002, 0.003, 0.5, 7.0])
    side = SimpleNamespace(
        metrics=m,
        ledger=SimpleNamespace(freed_by_reason={}),
        alloc=SimpleNamespace(num_free=3, num_allocated=4),
    )
    reg = kvmem.disagg.metrics.register(side, CollectorRegistry())
    get = reg.get_sample_value
    want = {
        0.0001: 0,
        0.00025: 2,
        0.0005: 2,
        0.001: 2,
        0.0025: 2,
        0.005: 3,
        0.1: 3,
        0.25: 3,
        1.0: 4,
    }
    for le, n in want.items():
        assert (
            get(
                "kvmem_abort_free_seconds_bucket",
                {"side": "prefill", "le": prometheus_client.utils.floatToGoString(le)},
            )
            == n
        )
    assert get("kvmem_abort_free_seconds_bucket", {"side": "prefill", "le": "+Inf"}) == 5
    assert get("kvmem_abort_free_seconds_count", {"side": "prefill"}) == 5
    assert get("kvmem_abort_free_seconds_sum", {"side": "prefill"}) == pytest.approx(7.5034)
    # a scrape reads the fields as they are now
    m.requests["failed"] += 2
    assert get("kvmem_requests_total", {"side": "prefill", "outcome": "failed"}) == 2
    assert get("kvmem_pages", {"side": "prefill", "state": "allocated"}) == 4


def _fake(kind: str):
    return SimpleNamespace(
        metrics=Metrics(kind),
        ledger=SimpleNamespace(freed_by_reason={}),
        alloc=SimpleNamespace(num_free=1, num_allocated=0),
    )


def test_default_registry_is_kvmems_own_not_the_global_one():
    side = _fake("decode")
    assert kvmem.disagg.metrics.register(side) is kvmem.disagg.metrics.REGISTRY
    assert kvmem.disagg.metrics.REGISTRY is not prometheus_client.REGISTRY
    try:
        side.metrics.requests["succeeded"] = 3
        assert (
            kvmem.disagg.metrics.REGISTRY.get_sample_value(
                "kvmem_requests_total", {"side": "decode", "outcome": "succeeded"}
            )
            == 3
        )
        assert (
            prometheus_client.REGISTRY.get_sample_value(
                "kvmem_requests_total", {"side": "decode", "outcome": "succeeded"}
            )
            is None
        )
    finally:
        kvmem.disagg.metrics.unregister(side)
    assert b"kvmem_" not in generate_latest(kvmem.disagg.metrics.REGISTRY)


def test_one_side_of_each_kind_per_registry():
    reg = CollectorRegistry()
    a, b = _fake("prefill"), _fake("prefill")
    kvmem.disagg.metrics.register(a, reg)
    before = generate_latest(reg)
    with pytest.raises(
        ValueError,
        match="a prefill side is already registered in this "
        r"registry \(another one\)",
    ):
        kvmem.disagg.metrics.register(b, reg)
    with pytest.raises(ValueError, match=r"\(this same side\)"):
        kvmem.disagg.metrics.register(a, reg)
    assert generate_latest(reg) == before  # nothing changed
    # a second instance: a registry of its own
    other = kvmem.disagg.metrics.register(b, CollectorRegistry())
    b.metrics.pauses = 5
    assert other.get_sample_value("kvmem_pauses_total", {"side": "prefill"}) == 5
    assert reg.get_sample_value("kvmem_pauses_total", {"side": "prefill"}) == 0


def test_unregister():
    reg = CollectorRegistry()
    p, d = _fake("prefill"), _fake("decode")
    with pytest.raises(ValueError, match="no kvmem side is registered in this registry"):
        kvmem.disagg.metrics.unregister(p, reg)
    kvmem.disagg.metrics.register(p, reg)
    with pytest.raises(
        ValueError,
        match=r"this decode side is not registered in this "
        r"registry \(registered: \['prefill'\]\)",
    ):
        kvmem.disagg.metrics.unregister(d, reg)
    kvmem.disagg.metrics.register(d, reg)
    kvmem.disagg.metrics.unregister(p, reg)
    assert reg.get_sample_value("kvmem_pauses_total", {"side": "prefill"}) is None
    assert reg.get_sample_value("kvmem_pauses_total", {"side": "decode"}) == 0
    kvmem.disagg.metrics.unregister(d, reg)
    assert generate_latest(reg) == b""  # the last side out took the collector along
    kvmem.disagg.metrics.register(p, reg)  # and a new one comes in
    assert reg.get_sample_value("kvmem_pauses_total", {"side": "prefill"}) == 0


def test_bad_side_kind_and_name_clash_change_nothing():
    with pytest.raises(ValueError, match="must be one of \\['decode', 'prefill'\\], got 'x'"):
        kvmem.disagg.metrics.register(_fake("x"), CollectorRegistry())
    reg = CollectorRegistry()
    clash = prometheus_client.Counter("kvmem_pauses", "a host's own", registry=reg)
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        kvmem.disagg.metrics.register(_fake("prefill"), reg)
    assert (
        reg.get_sample_value("kvmem_requests_total", {"side": "prefill", "outcome": "failed"})
        is None
    )
    reg.unregister(clash)
    kvmem.disagg.metrics.register(_fake("prefill"), reg)  # the failed call left nothing behind
    assert (
        reg.get_sample_value("kvmem_requests_total", {"side": "prefill", "outcome": "failed"}) == 0
    )


def test_a_host_serves_the_registry_over_http(pair):
    """What a host does: prometheus_client's own server, scraped from its thread."""
    reg = CollectorRegistry()
    kvmem.disagg.metrics.register(pair.prefill, reg)
    kvmem.disagg.metrics.register(pair.decode, reg)
    server, thread = prometheus_client.start_http_server(0, addr="127.0.0.1", registry=reg)
    try:
        pair.prefill.add_request(1, 64)
        pair.run_idle()
        url = f"http://127.0.0.1:{server.server_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as r:
            text = r.read().decode()
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    got = {(s.labels["side"], s.labels["outcome"]): s.value for s in fams["kvmem_requests"].samples}
    assert got[("prefill", "succeeded")] == got[("decode", "succeeded")] == 1
