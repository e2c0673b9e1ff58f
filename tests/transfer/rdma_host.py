"""Debian's RDMA user-space libraries for chosen processes only: what an RDMA host has
(``libibverbs1``, ``ibverbs-providers`` and the libnl packages they depend on), without
installing anything on this machine.  The packages are downloaded with ``apt-get
download`` and unpacked with ``dpkg-deb -x``; a command then runs in a private mount
namespace (``unshare --mount --propagation private``) where the system's library
directory and ``/etc`` are overlays (lower: the host's, read-only; upper: a tmpfs of that
namespace) holding the unpacked files, and ``ldconfig`` has rebuilt ld.so's cache: inside,
what ``apt-get install`` would have left; outside, every other process on the machine
sees nothing of it, and it is gone when the command's processes are.  (Mounts below those
directories, as a container's ``/etc/hosts``, are hidden in there: the overlay's lower
layer is the directory itself.)

    python tests/transfer/rdma_host.py fetch DIR          unpack the packages under DIR, print the root
    python tests/transfer/rdma_host.py fetch-lib DIR PKG  unpack PKG and what it depends on (no
                                                          recommended packages) under DIR, print
                                                          the directories that hold its libraries
    python tests/transfer/rdma_host.py run ROOT CMD...    run CMD; its exit status (128 + N: signal N)

``fetch-lib`` is for a library a process loads through ``LD_LIBRARY_PATH`` (Mooncake's
engine needs ``libibverbs.so.1``, from ``libibverbs1``): apt would add
``ibverbs-providers`` as a recommended package, and with it a second libnl in every NIXL
process (docs/transfer.md, "Process exit"), so neither is installed on the machine.

Needs root, util-linux's ``unshare``, ``dpkg-deb``, ``apt-get`` with a reachable archive
and the kernel's overlay filesystem; :class:`RdmaHostError` names what is missing.
"""

from __future__ import annotations

import ctypes.util
import os
import shutil
import subprocess
import sys

# What an RDMA host installs; the dependencies apt would add here come too.
PACKAGES = ("libibverbs1", "ibverbs-providers")
_SKIP = ("usr/share",)  # documentation and lintian overrides: nothing a process loads


class RdmaHostError(RuntimeError):
    """A step could not be done here; the message says which and why."""


def _run(argv: list[str], what: str, timeout: float = 120) -> str:
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError:
        raise RdmaHostError(f"{what}: {argv[0]} is not installed") from None
    except subprocess.TimeoutExpired:
        raise RdmaHostError(f"{what}: {' '.join(argv)} took over {timeout:.0f} s") from None
    if p.returncode != 0:
        raise RdmaHostError(
            f"{what}: {' '.join(argv)} exited {p.returncode}:\n{(p.stdout + p.stderr)[-2000:]}"
        )
    return p.stdout


def installed_here() -> bool:
    """Whether this machine's processes see those libraries already (ld.so finds
    ``libibverbs.so.1`` and ``libefa.so.1``): an RDMA host, or a process already inside
    a namespace of :func:`command`."""
    return all(ctypes.util.find_library(n) is not None for n in ("ibverbs", "efa"))


def _to_install(apt_opts: list[str], packages=PACKAGES) -> list[str]:
    """What ``apt-get install packages`` would install here (apt's own resolver, in a
    simulation: ``apt-get -s`` changes nothing)."""
    out = _run(
        ["apt-get", *apt_opts, "-s", "install", *packages],
        "resolving what apt-get install would add",
    )
    names = [line.split()[1] for line in out.splitlines() if line.startswith("Inst ")]
    if not names:
        raise RdmaHostError(
            f"apt-get install {' '.join(packages)} would install nothing:\n{out[-2000:]}"
        )
    return names


def fetch(dest: str, packages=PACKAGES, recommends: bool = True) -> str | None:
    """Download ``packages`` and the dependencies apt would add (``recommends``: its
    recommended packages too) into ``dest`` and unpack them into ``dest/root``; that root
    (reused when a previous call completed it), or None when this machine's processes
    have PACKAGES already (:func:`installed_here`).  apt's own package lists are used
    when they know the packages; else a private ``apt-get update`` under ``dest`` (the
    host's lists stay as they are)."""
    if packages == PACKAGES and installed_here():
        return None
    root = os.path.join(dest, "root")
    done = os.path.join(dest, "unpacked")
    if os.path.exists(done):
        return root
    if os.geteuid() != 0:
        raise RdmaHostError(
            f"needs root (euid {os.geteuid()}): apt-get download, and the mount namespace"
        )
    debs = os.path.join(dest, "debs")
    os.makedirs(debs, exist_ok=True)
    opts = ["-o", "APT::Sandbox::User=root"]  # root downloads into a root-owned directory
    if not recommends:
        opts += ["-o", "APT::Install-Recommends=false"]
    try:
        names = _to_install(opts, packages)
    except RdmaHostError:  # this machine's lists do not know them (or none): lists of our own
        state, cache = os.path.join(dest, "lists"), os.path.join(dest, "cache")
        os.makedirs(os.path.join(state, "partial"), exist_ok=True)
        os.makedirs(os.path.join(cache, "archives", "partial"), exist_ok=True)
        opts += ["-o", f"Dir::State::Lists={state}", "-o", f"Dir::Cache={cache}"]
        _run(
            ["apt-get", *opts, "update"],
            "apt-get update into a private list directory",
            timeout=300,
        )
        names = _to_install(opts, packages)
    p = subprocess.run(
        ["apt-get", *opts, "download", *names],
        cwd=debs,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if p.returncode != 0:
        raise RdmaHostError(
            f"apt-get download {' '.join(names)} exited {p.returncode}:\n"
            f"{(p.stdout + p.stderr)[-2000:]}"
        )
    files = sorted(f for f in os.listdir(debs) if f.endswith(".deb"))
    got = {f.split("_")[0] for f in files}
    if set(names) - got:
        raise RdmaHostError(f"apt-get download left out {sorted(set(names) - got)}")
    for f in files:
        _run(["dpkg-deb", "-x", os.path.join(debs, f), root], f"unpacking {f}")
    open(done, "w").close()
    return root


def library_dirs(root: str) -> list[str]:
    """The directories under ``root`` that hold shared libraries (``*.so*``), for
    ``LD_LIBRARY_PATH``."""
    out = set()
    for top, _, files in os.walk(root):
        if any(".so" in f for f in files):
            out.add(top)
    return sorted(out)


def fetch_lib(dest: str, package: str) -> list[str]:
    """``package``'s libraries for ``LD_LIBRARY_PATH`` (module docstring): [] when ld.so
    finds them on this machine already, else the directories :func:`fetch` unpacked them
    to, without recommended packages."""
    soname = {"libibverbs1": "ibverbs"}.get(package)
    if soname is not None and ctypes.util.find_library(soname) is not None:
        return []
    return library_dirs(fetch(dest, (package,), recommends=False))


def command(root: str | None, argv: list[str]) -> list[str]:
    """The command line that runs ``argv`` in a private mount namespace with ``root``'s
    files in place (see the module docstring); ``argv`` is exec'd there, so its exit
    status (or signal) is the command line's.  ``root`` None (this machine has them):
    ``argv``."""
    if root is None:
        return list(argv)
    return [
        "unshare",
        "--mount",
        "--propagation",
        "private",
        sys.executable,
        os.path.abspath(__file__),
        "_inside",
        os.path.abspath(root),
        *argv,
    ]


def _targets(root: str) -> list[tuple[str, str]]:
    """``(file in root, where it goes on this host)`` for every file and link, the host
    path with its existing part resolved (``/lib`` is ``/usr/lib`` on a merged-/usr
    system)."""
    out = []
    for top, dirs, files in os.walk(root):
        rel = os.path.relpath(top, root)
        if rel.startswith(_SKIP):
            dirs[:] = []
            continue
        for name in files + [d for d in dirs if os.path.islink(os.path.join(top, d))]:
            out.append((os.path.join(top, name), os.path.join(os.path.realpath("/" + rel), name)))
    return out


def _mount_points(paths: list[str]) -> list[str]:
    """The existing directories to overlay so that every path can be created: each path's
    deepest existing ancestor, ``/etc`` (ld.so's cache), none inside another."""
    found = {"/etc"}
    for p in paths:
        d = os.path.dirname(p)
        while not os.path.isdir(d):
            d = os.path.dirname(d)
        found.add(d)
    return sorted(
        d for d in found if not any(d != o and d.startswith(o.rstrip("/") + "/") for o in found)
    )


def _inside(root: str, argv: list[str]) -> None:
    """In the new namespace: overlays, files, ld.so's cache, then exec ``argv``."""
    pairs = _targets(root)
    scratch = os.path.join(os.path.dirname(root), "overlays")  # empty, seen from outside
    os.makedirs(scratch, exist_ok=True)
    _run(["mount", "-t", "tmpfs", "tmpfs", scratch], "a tmpfs for the overlays' upper layers")
    for i, d in enumerate(_mount_points([dst for _, dst in pairs])):
        up, work = os.path.join(scratch, f"{i}.up"), os.path.join(scratch, f"{i}.work")
        os.makedirs(up)
        os.makedirs(work)
        _run(
            [
                "mount",
                "-t",
                "overlay",
                "overlay",
                "-o",
                f"lowerdir={d},upperdir={up},workdir={work}",
                d,
            ],
            f"an overlay on {d}",
        )
    for src, dst in pairs:
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        if os.path.islink(src):
            if os.path.lexists(dst):
                os.unlink(dst)
            os.symlink(os.readlink(src), dst)
        else:
            shutil.copy2(src, dst)
    # -X: no soname links made (the packages carry theirs); it scans other directories too,
    # and those are the host's own.
    _run(["ldconfig", "-X"], "ldconfig")
    os.execvp(argv[0], argv)


def main(args: list[str]) -> int:
    if len(args) >= 2 and args[0] == "fetch":
        print(fetch(args[1]) or "this machine has them already")
        return 0
    if len(args) == 3 and args[0] == "fetch-lib":
        try:
            print(os.pathsep.join(fetch_lib(args[1], args[2])))
        except RdmaHostError as e:
            print(
                f"{args[2]} is needed and could not be fetched: {e}\nInstall it "
                f"(apt-get install {args[2]}) or run as root with apt.",
                file=sys.stderr,
            )
            return 1
        return 0
    if len(args) >= 3 and args[0] == "run":
        rc = subprocess.call(command(args[1], args[2:]))
        return 128 - rc if rc < 0 else rc  # killed by signal N: 128 + N, as a shell says
    if len(args) >= 3 and args[0] == "_inside":
        _inside(args[1], args[2:])
    print(__doc__.split("\n\n")[1], file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
