"""`kvmem demo` across two "hosts" and with several peers.

- The two hosts of ``--hosts netns``: two network namespaces joined by a veth pair, their
  addresses only inside them, TCP between them, removed on close and when stale.
- The demo over them, every fault and the pauses on: the same lifecycle checks as on one
  host, and the KV crossed the veth (its byte counters).
- 2 prefills x 2 decodes, one decode paused and resumed, one killed with SIGKILL in the
  middle of receiving requests: every request answered once, nothing leaked, every byte
  verified, the killed decode's requests ended as the lifecycle table says on every
  prefill, the survivor's requests unaffected, every table per peer adding up.

The netns tests need root and ``ip`` (this machine and CI have both).  Namespaces are
only made by the code under test; a fixture removes any that a demo this test started
left behind (it was killed, say) before the test reports.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvmem.demo.hosts import ADDRESS, NetnsHosts, PREFIX, netns_refusal, remove_stale
from tests.demo.test_demo import LOADED, assert_every_fault_lifecycle
from tests.util import communicate

pytestmark = pytest.mark.subprocess  # starts other interpreters

ROOT = Path(__file__).resolve().parents[2]
DEMO = [sys.executable, "-m", "kvmem.cli", "demo"]
# A small model, so that four workers start and run in tens of seconds on 2 busy cores:
# 2 layers x 8 KV heads x 128, bf16 (8 KiB of KV per token), prompts of 1..512 tokens in
# 128-token chunks (1 MiB each, up to 4 per request).
SMALL = ["--layers", "2", "--max-tokens", "512", "--chunk-tokens", "128"]


def _namespaces() -> set[str]:
    try:
        return set(os.listdir("/run/netns"))
    except FileNotFoundError:
        return set()


def _ip(*args) -> str:
    return subprocess.run(
        ["ip", *args], check=True, capture_output=True, text=True, timeout=20
    ).stdout


@pytest.fixture
def netns_demo():
    """Runs the demo with ``--hosts netns`` (``run(args, timeout)``: CompletedProcess);
    afterwards removes any namespace left by a demo it started (their names carry the
    demo's pid), so that a failed or killed run leaves nothing on the machine."""
    why = netns_refusal()
    assert why is None, why  # root and ip are there, here and in CI
    pids = []

    def run(args, timeout=180):
        proc = subprocess.Popen(
            DEMO + ["--hosts", "netns"] + args,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        pids.append(proc.pid)
        out, err = communicate(proc, timeout)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out.decode(), err.decode())

    yield run
    left = sorted(n for n in _namespaces() for p in pids if n.startswith(f"{PREFIX}{p}-"))
    for name in left:
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=20)
    assert not left, f"the demo left network namespaces behind: {left}"


def test_two_hosts_are_apart_joined_by_tcp_and_removed():
    why = netns_refusal()
    assert why is None, why
    before = _namespaces()
    hosts = NetnsHosts()
    try:
        hosts.make()
        p, d = hosts.namespaces["prefill"], hosts.namespaces["decode"]
        assert {p, d} <= _namespaces()
        # the addresses and the veth ends exist only inside the two namespaces
        assert ADDRESS["prefill"] not in _ip("-o", "addr")
        assert hosts.devices["prefill"] not in _ip("-o", "link")
        assert f"{ADDRESS['prefill']}/30" in _ip("-n", p, "-o", "addr")
        assert f"{ADDRESS['decode']}/30" in _ip("-n", d, "-o", "addr")
        # TCP from one to the other over the veth: a listener in the decode's namespace,
        # a client in the prefill's
        server = subprocess.Popen(
            [
                "ip",
                "netns",
                "exec",
                d,
                sys.executable,
                "-c",
                textwrap.dedent(f"""
                import socket
                s = socket.create_server(("{ADDRESS["decode"]}", 7700))
                print("listening", flush=True)
                c, _ = s.accept()
                c.sendall(c.recv(5)[::-1])
            """),
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert server.stdout.readline().strip() == "listening"
            got = subprocess.run(
                [
                    "ip",
                    "netns",
                    "exec",
                    p,
                    sys.executable,
                    "-c",
                    textwrap.dedent(f"""
                    import socket
                    c = socket.create_connection(("{ADDRESS["decode"]}", 7700), timeout=10)
                    c.sendall(b"hello")
                    print(c.recv(5).decode())
                """),
                ],
                capture_output=True,
                text=True,
                timeout=30,
            )
            assert got.stdout.strip() == "olleh", got.stderr
            assert server.wait(10) == 0
        finally:
            if server.poll() is None:
                server.kill()
                server.wait()
        link = hosts.link_bytes()
        assert link["prefill"]["tx"] > 0 and link["decode"]["rx"] >= link["prefill"]["tx"]
    finally:
        hosts.close()
    assert _namespaces() & set(hosts.namespaces.values()) == set()
    assert hosts.link_bytes() is None
    hosts.close()  # idempotent

    # the namespaces of a demo that is gone (its pid runs no more) are removed by the next
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = f"{PREFIX}{dead.pid}-abcdef-prefill"
    _ip("netns", "add", stale)
    try:
        assert stale in remove_stale()
    finally:
        if stale in _namespaces():
            _ip("netns", "del", stale)
    assert _namespaces() - before == set()


@pytest.mark.nixl
def test_demo_over_two_netns_hosts_every_fault(netns_demo, tmp_path):
    out = tmp_path / "demo.json"
    p = netns_demo(SMALL + ["--requests", "60", "--bw-mib", "8", "--json", str(out)] + LOADED)
    assert p.returncode == 0, p.stdout + p.stderr
    r = json.loads(out.read_text())
    assert r["errors"] == []
    assert_every_fault_lifecycle(r, 60)  # what a run on one host is checked for
    assert r["raw_nixl"]["verified"] is True and r["raw_nixl"]["gbps"] > 0
    # the two hosts, and the KV crossed the veth: the prefills' end sent at least every
    # byte the decode verified (pull: the decode reads them, over TCP), plus the raw
    # bandwidth buffer's writes
    h = r["hosts"]
    assert h["kind"] == "netns" and h["ucx_tls"] == "tcp"
    assert set(h["namespaces"]) == {"prefill", "decode"}
    raw_bytes = r["raw_nixl"]["nbytes"] * (1 + r["raw_nixl"]["rounds"])
    assert h["link_bytes"]["prefill"]["tx"] >= r["bytes_verified"] + raw_bytes
    assert "joined by a veth pair" in p.stdout and p.stdout.rstrip().endswith("OK")


@pytest.mark.nixl
def test_two_prefills_two_decodes_one_paused_one_killed(tmp_path):
    """Random faults off, two pauses on: the first a prefill's, the second a decode's
    (decode0: the one --kill-decode spares); decode1 killed mid-transfer.  32-token
    chunks (up to 16 per request), so that requests spend long enough half-received for
    the kill to find one from every prefill.  The timeouts are 30 s, not the demo's 2 s:
    the survivor must see no 504, and a loaded machine can stall a transfer to it past
    2 s (CI's once) and past 10 s (the e2e tier running beside the main suite,
    2026-12-05, load average 5-7 on two cores)."""
    out = tmp_path / "demo.json"
    proc = subprocess.Popen(
        DEMO
        + SMALL
        + [
            "--chunk-tokens",
            "32",
            "--prefills",
            "2",
            "--decodes",
            "2",
            "--kill-decode",
            "--requests",
            "80",
            "--abort-rate",
            "0",
            "--timeout-rate",
            "0",
            "--fail-rate",
            "0",
            "--pauses",
            "2",
            "--bw-mib",
            "0",
            "--timeout",
            "30",
            "--json",
            str(out),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    o, e = communicate(proc, 240)
    assert proc.returncode == 0, o.decode() + e.decode()
    r = json.loads(out.read_text())
    assert r["ok"] is True and r["errors"] == [], r["errors"]

    # every request answered once: each prefill's requests add up to the ids it ran, and
    # per peer to the same
    assert r["succeeded"] + r["aborted"] + r["timed_out"] + r["failed"] == 80
    peers = r["peers"]
    for i, key in enumerate(("prefill0", "prefill1")):
        ran = len(range(i, 80, 2))
        assert sum(peers[key]["requests"].values()) == ran, key
        assert sum(sum(c["requests"].values()) for c in peers[key]["by_peer"].values()) == ran
        assert sum(sum(c.values()) for c in peers[key]["status_by_peer"].values()) == ran
        assert sum(peers[key]["routed"].values()) == ran
        assert set(peers[key]["routed"]) == {"decode0", "decode1"}  # routed across both
    # nothing leaked, every byte verified
    assert r["leaked_pages"] == {"prefill": 0, "decode": 0}
    assert r["bytes_transferred"] == r["bytes_verified"] > 0 and r["bytes_corrupt"] == 0
    assert r["protocol_errors"] == {"prefill": 0, "decode": 0}
    assert not r["delivered"]["missing"]
    for key, w in r["workers"].items():
        if key != "decode1":
            assert not w["killed"] and w["exit_code"] == 0, key
            assert w["leaked_pages"] == 0 and w["open_handles"] == 0, key

    # the pauses: one prefill's, one decode's (decode0 paused and resumed)
    assert r["pauses_by_side"] == {"prefill": 1, "decode": 1}
    assert r["workers"]["decode0"]["metrics"]["pauses"] == 1

    # decode1 killed in the middle of receiving requests; on every prefill the requests it
    # was receiving, and those still active when the prefill heard of its death, ended as
    # the lifecycle table says for a decode that is gone: a failed write (500), a timeout
    # (504), or a pause's 503 first; never delivered (200).  (A request it was receiving
    # may end before its prefill hears: a transfer timeout.)
    k = r["killed"]
    assert k["worker"] == "decode1" and k["exit_code"] == -9
    assert r["workers"]["decode1"]["killed"] is True and peers["decode1"]["killed"] is True
    assert k["mid_transfer"], "killed before it was mid-transfer"
    for p in ("prefill0", "prefill1"):
        ended = k["ended_on_prefills"][p]["decode1"]
        assert set(ended["status"].values()) <= {500, 503, 504}, (p, ended)
        bound = {int(rid): s for rid, s in ended["bound"].items()}
        assert len(bound) == peers[p]["routed"]["decode1"], (p, bound)  # each answered once
        for rid in k["mid_transfer"].get(p, []):
            assert bound[rid] in (500, 503, 504), (p, rid, bound[rid])
    # the survivor unaffected: requests bound to decode0 ended succeeded, or with the
    # pauses' 503 (no random faults); decode0 received exactly what the prefills sent it,
    # and completed the requests they count delivered, plus those a pause ended on the
    # prefill after their last write had landed (delivered.received_after_early_end)
    got = peers["decode0"]["by_peer"]
    late = len(r["delivered"]["received_after_early_end"])
    for p in ("prefill0", "prefill1"):
        to = peers[p]["by_peer"]["decode0"]
        assert set(peers[p]["status_by_peer"]["decode0"]) <= {"200", "503"}, p
        assert set(to["requests"]) <= {"succeeded", "aborted"}, p
        assert to["send_errors"] == 0, p
        assert to["requests"].get("succeeded", 0) > 0, p
        extra = got[p]["requests"].get("succeeded", 0) - to["requests"].get("succeeded", 0)
        assert 0 <= extra <= late, (p, got[p], to, r["delivered"])
        late -= extra
        assert got[p]["bytes"] == to["bytes"], p
    assert "decode1   KILLED by the demo (SIGKILL)" in o.decode()
