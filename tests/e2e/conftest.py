"""The end-to-end tier: real sglang 0.5.23 servers and sglang's router, over HTTP.

Run by ``make test-e2e`` (part of ``make test``) with ``.venv-e2e``'s Python, which has
sglang with its full dependencies, sglang-router, NIXL and kvmem with its adapter
installed.  The main suite (``.venv``) does not collect this directory
(tests/conftest.py).

Deployments are module-scoped: starting a PD pair and the router costs about a minute
on two cores, so each module starts the few it needs and its tests share them, in the
order they are written.  Each test that can leave a deployment changed (a crash, a
stopped server) says so and restarts what it needs.  Server logs go to a directory per
deployment; the tail of every log is attached to a failing test's report, and the
directory is kept (``KVMEM_E2E_LOGS`` chooses where; default: pytest's tmp dir).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.e2e.deploy import Deployment
from tests.e2e.tiny_model import make_tiny_model

FLAG = {"SGLANG_KVMEM": "1"}
_LIVE: list[Deployment] = []

# The deployments the tests share, by name: (Deployment kwargs, what it is).
KINDS = {
    "stock": (dict(), "stock prefill, stock decode"),
    "kvmem-prefill": (dict(prefill_env=FLAG), "SGLANG_KVMEM=1 prefill, stock decode"),
    "kvmem-decode": (dict(decode_env=FLAG), "stock prefill, SGLANG_KVMEM=1 decode"),
    "kvmem-both": (dict(prefill_env=FLAG, decode_env=FLAG),
                   "SGLANG_KVMEM=1 prefill and decode"),
    "kvmem-both-no-overlap": (dict(prefill_env=FLAG, decode_env=FLAG, overlap=False),
                              "SGLANG_KVMEM=1 prefill and decode, --disable-overlap-schedule"),
}
# At most this many deployments run at once: a PD pair and its router are six Python
# processes of about 1.1-1.3 GB resident each here.  Tests are ordered so that each
# deployment serves one contiguous block of them (pytest_collection_modifyitems).
MAX_LIVE = 1


class Deployments:
    """Session-wide deployments by name (:data:`KINDS`, or any name with its kwargs),
    started on first use, restarted when a server died or a test called
    :meth:`discard`, the least recently used one stopped when :data:`MAX_LIVE` run."""

    def __init__(self, model: Path, logroot: Path):
        self.model, self.logroot = model, logroot
        self.live: dict[str, Deployment] = {}
        self.starts: dict[str, int] = {}

    def get(self, name: str, **kwargs) -> Deployment:
        d = self.live.pop(name, None)
        if d is not None and d.crashed():
            d.stop()
            _LIVE.remove(d)
            d = None
        if d is None:
            while len(self.live) >= MAX_LIVE:
                old, dep = next(iter(self.live.items()))
                dep.stop()
                _LIVE.remove(dep)
                del self.live[old]
            n = self.starts[name] = self.starts.get(name, 0) + 1
            conf = kwargs or KINDS[name][0]
            d = Deployment(self.model, self.logroot / f"{name}-{n}", **conf)
            _LIVE.append(d)
            try:
                d.start()
            except BaseException:
                _LIVE.remove(d)
                raise
        self.live[name] = d  # most recently used last
        return d

    def discard(self, name: str) -> None:
        """Stop ``name`` (a test left it changed); the next :meth:`get` starts it anew."""
        d = self.live.pop(name, None)
        if d is not None:
            d.stop()
            _LIVE.remove(d)

    def stop_all(self) -> None:
        for name in list(self.live):
            self.discard(name)


@pytest.fixture(scope="session")
def model(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def logroot(tmp_path_factory) -> Path:
    root = os.environ.get("KVMEM_E2E_LOGS")
    if root:
        Path(root).mkdir(parents=True, exist_ok=True)
        return Path(root)
    return tmp_path_factory.mktemp("e2e-logs")


@pytest.fixture(scope="session")
def deployments(model, logroot):
    reg = Deployments(model, logroot)
    yield reg
    reg.stop_all()


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "leaves_broken: the test may leave its deployment crashed or changed; "
        "it runs last among the tests of that deployment, which is restarted after it")


def pytest_collection_modifyitems(session, config, items):
    """Within each module, the tests of one deployment kind (their ``kind`` parameter,
    in the order of KINDS; tests without one first) run together, and those marked
    ``leaves_broken`` last in their kind's block; otherwise the written order holds."""
    modules = {}
    for item in items:
        modules.setdefault(item.module, len(modules))

    def key(item):
        params = getattr(getattr(item, "callspec", None), "params", {})
        kind = params.get("kind")
        rank = list(KINDS).index(kind) if kind in KINDS else -1
        return (modules[item.module], rank, item.get_closest_marker("leaves_broken") is not None)

    items.sort(key=key)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.when == "call" and report.failed:
        for d in _LIVE:
            report.sections.append((f"server logs of {d.logdir.name}", d.logs(80)))
