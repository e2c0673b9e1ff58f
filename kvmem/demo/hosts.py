"""Where ``kvmem demo``'s workers run: on one host (the default: UCX moves the KV by
cross-memory attach), or on two "hosts" with a network between them (``--hosts netns``):
two Linux network namespaces joined by a veth pair, the prefill workers in one, the
decode workers in the other, UCX restricted to TCP over that veth, as between two nodes
without RDMA::

    namespace kvmem-<pid>-<tag>-prefill          namespace kvmem-<pid>-<tag>-decode
      lo (up)                                      lo (up)
      kvm<tag>p  10.200.0.1/30  <== veth ==>       kvm<tag>d  10.200.0.2/30
      prefill workers                              decode workers

The demo makes the pair and removes it (:class:`NetnsHosts`, a context manager; removal
also on Ctrl-C, SIGTERM and failure, after the workers are gone).  The addresses exist
only inside the two namespaces, so runs side by side (each its own pair, named after the
demo's pid and a random tag) do not collide; namespaces left by a demo that was killed
(SIGKILL: no clean-up could run) are removed by the next one, whose pid check shows their
owner is gone.  Making them needs root and ``ip`` (iproute2): :func:`netns_refusal` says
why not, before anything starts.

A worker enters its place first thing (:func:`enter`): ``setns`` into the network
namespace, then a mount namespace of its own with a fresh ``/sys`` (UCX lists network
devices from ``/sys/class/net``, which shows the namespace that mounted it: the host's,
without the veth), as ``ip netns exec`` does; then ``UCX_TLS=tcp`` and
``UCX_NET_DEVICES`` the veth (UCX would otherwise still pick cross-memory attach, which
does not care about network namespaces).  The control plane needs nothing more: the
parent relays the NIXL metadata over the workers' pipes (not over the network), and every
later control message is a NIXL notification over the same TCP connection as the KV.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import secrets
import shutil
import subprocess
import time

HOSTS = ("one", "netns")
PREFIX = "kvmem-"  # the namespaces this module makes: kvmem-<pid>-<tag>-<side>
_NAME = re.compile(r"kvmem-(\d+)-([0-9a-f]{6})-(prefill|decode)")
SUBNET = "10.200.0"  # the pair's /30 (addresses only inside the two namespaces)
ADDRESS = {"prefill": f"{SUBNET}.1", "decode": f"{SUBNET}.2"}
UCX_TLS = "tcp"  # KV over TCP; cma (cross-memory attach) ignores network namespaces
IP_TIMEOUT = 20.0  # seconds for one `ip` command (they take milliseconds)

_CLONE_NEWNS = 0x00020000
_CLONE_NEWNET = 0x40000000
_MS_REC = 0x4000
_MS_SLAVE = 1 << 19
_MNT_DETACH = 2


class HostsError(RuntimeError):
    """The network namespaces could not be made (or entered); the message says which
    ``ip`` command failed and what it printed."""


def netns_refusal() -> str | None:
    """Why ``--hosts netns`` cannot run here (not root, no ``ip``), or None."""
    if os.geteuid() != 0:
        return (
            f"--hosts netns needs root (it makes two network namespaces and a veth pair "
            f"with `ip`); this is uid {os.geteuid()}"
        )
    if shutil.which("ip") is None:
        return (
            "--hosts netns needs the `ip` command (iproute2) to make the network "
            "namespaces; it is not on PATH"
        )
    return None


def _ip(*args: str) -> str:
    try:
        p = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=IP_TIMEOUT)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise HostsError(f"`ip {' '.join(args)}`: {e}") from None
    if p.returncode:
        raise HostsError(
            f"`ip {' '.join(args)}` failed (status {p.returncode}): "
            f"{p.stderr.strip() or p.stdout.strip()}"
        )
    return p.stdout


def _namespaces() -> list[str]:
    try:
        return sorted(os.listdir("/run/netns"))
    except FileNotFoundError:
        return []


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale() -> list[str]:
    """Remove the namespaces of demos that are gone (their pid does not run); the names
    removed."""
    gone = []
    for name in _namespaces():
        m = _NAME.fullmatch(name)
        if m and not _alive(int(m.group(1))):
            try:
                _ip("netns", "del", name)
                gone.append(name)
            except HostsError:
                pass  # another demo removing it at the same moment
    return gone


class NetnsHosts:
    """Two network namespaces joined by a veth pair, made on ``__enter__`` (or
    :meth:`make`) and removed by :meth:`close` (idempotent; also when making them failed
    half-way).  ``place(side)`` is what a worker of ``side`` ("prefill" or "decode")
    passes to :func:`enter`."""

    kind = "netns"

    def __init__(self):
        tag = secrets.token_hex(3)
        self.namespaces = {s: f"{PREFIX}{os.getpid()}-{tag}-{s}" for s in ("prefill", "decode")}
        self.devices = {s: f"kvm{tag}{s[0]}" for s in ("prefill", "decode")}  # <= 15 chars
        self.made: list[str] = []
        self.stale_removed: list[str] = []

    def make(self) -> "NetnsHosts":
        self.stale_removed = remove_stale()
        try:
            for side in ("prefill", "decode"):
                _ip("netns", "add", self.namespaces[side])
                self.made.append(self.namespaces[side])
            p, d = self.namespaces["prefill"], self.namespaces["decode"]
            _ip(
                "link",
                "add",
                self.devices["prefill"],
                "netns",
                p,
                "type",
                "veth",
                "peer",
                "name",
                self.devices["decode"],
                "netns",
                d,
            )
            for side in ("prefill", "decode"):
                ns, dev = self.namespaces[side], self.devices[side]
                _ip("-n", ns, "addr", "add", f"{ADDRESS[side]}/30", "dev", dev)
                _ip("-n", ns, "link", "set", dev, "up")
                _ip("-n", ns, "link", "set", "lo", "up")  # NIXL connects an agent to itself
        except BaseException:
            self.close()
            raise
        return self

    def __enter__(self) -> "NetnsHosts":
        return self.make()

    def __exit__(self, *exc) -> None:
        self.close()

    def place(self, side: str) -> dict:
        return {
            "netns": self.namespaces[side],
            "device": self.devices[side],
            "address": ADDRESS[side],
        }

    def link_bytes(self) -> dict | None:
        """Bytes sent and received on each end of the veth so far (``ip -s -j link``):
        ``{side: {"tx": n, "rx": n}}``; None once the pair is gone."""
        out = {}
        for side in ("prefill", "decode"):
            try:
                info = json.loads(
                    _ip(
                        "-n",
                        self.namespaces[side],
                        "-s",
                        "-j",
                        "link",
                        "show",
                        "dev",
                        self.devices[side],
                    )
                )
            except (HostsError, ValueError):
                return None
            st = info[0].get("stats64", {})
            out[side] = {
                "tx": int(st.get("tx", {}).get("bytes", 0)),
                "rx": int(st.get("rx", {}).get("bytes", 0)),
            }
        return out

    def describe(self) -> dict:
        return {
            "kind": self.kind,
            "namespaces": dict(self.namespaces),
            "devices": dict(self.devices),
            "addresses": dict(ADDRESS),
            "ucx_tls": UCX_TLS,
            "stale_removed": list(self.stale_removed),
        }

    def close(self) -> None:
        """Remove both namespaces (their veth ends go with them).  Retried for a few
        seconds while a worker that entered one is still exiting; HostsError naming what
        is left if that does not end."""
        left = []
        for name in reversed(self.made):
            end = time.monotonic() + 5.0
            while True:
                try:
                    _ip("netns", "del", name)
                    break
                except HostsError as e:
                    if name not in _namespaces():
                        break
                    if time.monotonic() > end:
                        left.append(f"{name}: {e}")
                        break
                    time.sleep(0.1)
        self.made = []
        if left:
            raise HostsError("could not remove the demo's network namespaces: " + "; ".join(left))


def enter(place: dict | None) -> None:
    """In a worker, before its NIXL agent exists: move this process into ``place``'s
    network namespace (None: stay), give it a mount namespace with a ``/sys`` of that
    network namespace, and point UCX at the veth over TCP.  HostsError naming the call
    that failed."""
    if place is None:
        return
    libc = ctypes.CDLL(None, use_errno=True)

    def check(rc: int, what: str) -> None:
        if rc != 0:
            err = ctypes.get_errno()
            raise HostsError(f"entering {place['netns']}: {what} failed: {os.strerror(err)}")

    fd = os.open(f"/run/netns/{place['netns']}", os.O_RDONLY)
    try:
        check(libc.setns(fd, _CLONE_NEWNET), "setns(CLONE_NEWNET)")
    finally:
        os.close(fd)
    check(libc.unshare(_CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    # our mounts must not propagate back to the host's namespace
    check(libc.mount(b"none", b"/", None, _MS_REC | _MS_SLAVE, None), "mount --make-rslave /")
    check(libc.umount2(b"/sys", _MNT_DETACH), "umount /sys")
    check(libc.mount(b"sysfs", b"/sys", b"sysfs", 0, None), "mount sysfs /sys")
    if not os.path.exists(f"/sys/class/net/{place['device']}"):
        raise HostsError(f"entering {place['netns']}: /sys/class/net shows no {place['device']}")
    os.environ["UCX_TLS"] = UCX_TLS
    os.environ["UCX_NET_DEVICES"] = place["device"]
