"""The end-to-end tier: real sglang 0.5.23 servers and sglang's router, over HTTP.

Run by ``make test-e2e`` (part of ``make test``) with ``.venv-e2e``'s Python, which has
sglang with its full dependencies, sglang-router, NIXL and kvmem with its adapter
installed.  The main suite (``.venv``) does not collect this directory
(tests/conftest.py).

Servers are shared by the whole session (``fleet.py``): starting one costs 30-55 s on two
cores, so every engine configuration runs once and serves every deployment kind that
names it, and the tests are ordered (backend, then kind) so that each server serves one
contiguous block of them.  Each test that can leave a server changed (a crash, a stopped
server) says so (``leaves_broken``) and restarts what it needs.  Server logs go to a
directory per server; the tail of every live server's log is attached to a failing
test's report, and the directory is kept (``KVMEM_E2E_LOGS`` chooses where; default:
pytest's tmp dir).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tests.e2e import scenario
from tests.e2e.deploy import BACKENDS as B
from tests.e2e.deploy import IDLE_S, Deployment, tail
from tests.e2e.fleet import Fleet
from tests.e2e.tiny_model import make_tiny_model

FLAG = {"SGLANG_KVMEM": "1"}
_FLEETS: list = []  # the session's fleet, for the failure report

# sglang's PD transfer backends every PD test runs on (KVMEM_E2E_BACKENDS narrows it,
# e.g. "mooncake" while working on one); a test takes them through its ``backend``
# argument.
BACKENDS = tuple(b for b in os.environ.get("KVMEM_E2E_BACKENDS", ",".join(B)).split(",") if b)
if not BACKENDS or set(BACKENDS) - set(B):
    raise pytest.UsageError(
        f"KVMEM_E2E_BACKENDS={os.environ['KVMEM_E2E_BACKENDS']!r}: "
        f"a comma-separated subset of {','.join(B)}"
    )

# The prefill's transfer and bootstrap timeouts of every PD server of the tier (sglang's
# defaults: 600 s and 300 s), short enough for the scenario (tests/e2e/scenario.py: its
# decode stops for longer than the transfer timeout, and requests whose bootstrap the
# stopped decode left unfinished are ended by the bootstrap timeout inside its HANG_S),
# long enough for a loaded machine and for the tests that show an answer comes sooner
# than a timeout would give it (PROMPT_S).  One value for every server, so that the
# scenario runs on the servers of the other tests.
#
# The decode's deferred release (sglang's default 30 s: how long a decode keeps the pages
# of a request whose prefill's write failed and may still be moving, unless the prefill
# says it drained) is shortened the same way, so that a test that fails a write sees the
# pages come back within its settle time.
DEFERRED_RELEASE_S = 10.0
TIMEOUTS = {
    "SGLANG_DISAGGREGATION_TRANSFER_TIMEOUT": str(scenario.TRANSFER_TIMEOUT_S),
    "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": str(scenario.BOOTSTRAP_TIMEOUT_S),
    "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT": str(DEFERRED_RELEASE_S),
}


# The tiny MLA model's deployments (tests.e2e.tiny_model, family "mla"): a DeepSeek-V3
# whose KV pool is sglang's MLATokenToKVPool; its servers need the stand-in
# standins/mla_attention.py on a CPU, stock and the flag alike.
MLA = {"family": "mla"}
# The tiny hybrid sliding-window model's (family "swa", a Mellum): sglang's SWAKVPool
# (two MHA pools, one per layer kind) and SWATokenToKVPoolAllocator.
SWA = {"family": "swa"}


def _pd(prefill: dict | None = None, decode: dict | None = None, **kwargs) -> dict:
    return dict(
        prefill_env={**TIMEOUTS, **(prefill or {})},
        decode_env={**TIMEOUTS, **(decode or {})},
        **kwargs,
    )


# The deployments the tests share, by name: (Deployment kwargs, what it is).  A PD kind
# runs on each backend a test asks for (its ``backend`` argument); a plain one on none.
KINDS = {
    "stock": (_pd(), "stock prefill, stock decode"),
    "kvmem-prefill": (_pd(FLAG), "SGLANG_KVMEM=1 prefill, stock decode"),
    "kvmem-decode": (_pd(decode=FLAG), "stock prefill, SGLANG_KVMEM=1 decode"),
    "kvmem-both": (_pd(FLAG, FLAG), "SGLANG_KVMEM=1 prefill and decode"),
    "kvmem-both-no-overlap": (
        _pd(FLAG, FLAG, overlap=False),
        "SGLANG_KVMEM=1 prefill and decode, --disable-overlap-schedule",
    ),
    # sglang's grammar timeout (SGLANG_GRAMMAR_MAX_POLL_ITERATIONS, 10,000 polls of at
    # least 5 ms) ten times longer: the grammar test's regex compiled for about 5 s quiet
    # and past the default's 50 s with the main suite running beside the tier
    "single-kvmem": (
        dict(pd=False, env={**FLAG, "SGLANG_GRAMMAR_MAX_POLL_ITERATIONS": "100000"}),
        "one plain server, SGLANG_KVMEM=1",
    ),
    "tp2-plain": (dict(pd=False, env=FLAG, tp=2), "one plain server at TP 2, SGLANG_KVMEM=1"),
    # tp2-prefill before tp2-both: it finds kvmem-both's decode still up (the four
    # engines before it leave room for a TP 2 prefill beside it), and tp2-both finds its
    # TP 2 prefill
    "tp2-prefill": (
        _pd(FLAG, FLAG, prefill_tp=2),
        "SGLANG_KVMEM=1 prefill at TP 2, SGLANG_KVMEM=1 decode at TP 1",
    ),
    "tp2-both": (_pd(FLAG, FLAG, tp=2), "SGLANG_KVMEM=1 prefill and decode, both at TP 2"),
    "tp2-stock": (_pd(tp=2), "stock prefill and decode, both at TP 2"),
    # the MLA model: four engines per backend (stock and flag, prefill and decode), and
    # one plain stock server that its PD outputs are held against
    "mla-stock": (_pd(**MLA), "MLA model: stock prefill, stock decode"),
    "mla-kvmem-prefill": (_pd(FLAG, **MLA), "MLA model: SGLANG_KVMEM=1 prefill, stock decode"),
    "mla-kvmem-both": (_pd(FLAG, FLAG, **MLA), "MLA model: SGLANG_KVMEM=1 prefill and decode"),
    "mla-plain-stock": (dict(pd=False, **MLA), "MLA model: one plain stock server"),
    # the sliding-window model: the same four engines per backend and a plain server
    "swa-stock": (_pd(**SWA), "SWA model: stock prefill, stock decode"),
    "swa-kvmem-prefill": (_pd(FLAG, **SWA), "SWA model: SGLANG_KVMEM=1 prefill, stock decode"),
    "swa-kvmem-both": (_pd(FLAG, FLAG, **SWA), "SWA model: SGLANG_KVMEM=1 prefill and decode"),
    "swa-plain-stock": (dict(pd=False, **SWA), "SWA model: one plain stock server"),
}


# Kinds of the other model families that run on the first backend only: their stock
# pair (the reference every kind of the family is held against, taken there) and the
# flag on the prefill alone (kvmem's send into a stock decode, which the Llama's kinds
# show on every backend), and, unless KVMEM_E2E_FAMILIES_EVERY_BACKEND=1, their
# flag-on-both kinds too: a family then starts five servers (the plain one, four engines
# on the first backend), which keeps `make test` inside CI's time; with it, seven (two
# more on each other backend).
FIRST_BACKEND_ONLY = {"mla-stock", "mla-kvmem-prefill", "swa-stock", "swa-kvmem-prefill"}
if os.environ.get("KVMEM_E2E_FAMILIES_EVERY_BACKEND", "").strip() != "1":
    FIRST_BACKEND_ONLY |= {"mla-kvmem-both", "swa-kvmem-both"}


def family(kind: str) -> str:
    """The model family a kind serves (tests.e2e.tiny_model.FAMILIES)."""
    return KINDS[kind][0].get("family", "llama")


# The stock PD kind of each family: what that family's outputs are compared with.
STOCK = {"llama": "stock", "mla": "mla-stock", "swa": "swa-stock"}


class Deployments:
    """Session-wide deployments by name (:data:`KINDS`, or any name with its Deployment
    kwargs), over the engines and routers of one :class:`~tests.e2e.fleet.Fleet`: started
    on first use, started again when a server died or a test called :meth:`discard`."""

    def __init__(self, models, logroot: Path):
        self.fleet = Fleet(models, logroot)

    def get(self, name: str, backend: str = "nixl", **kwargs) -> Deployment:
        """The deployment ``name`` on ``backend`` (a PD one; a plain one has none)."""
        return self.fleet.get(kwargs or KINDS[name][0], backend)

    def discard(
        self, name: str, backend: str = "nixl", roles=("prefill", "decode", "plain")
    ) -> None:
        """Stop the servers of ``name`` with those roles (a test left them changed); the
        next :meth:`get` starts them anew."""
        self.fleet.discard(KINDS[name][0], backend, roles)

    def discard_broken(self, name: str, backend: str, d: Deployment) -> list[str]:
        """After a test that may have left ``d`` crashed or busy: stop its servers that
        crashed, or that still hold something once they had ``IDLE_S`` to settle; the
        others serve the next tests as they are (a restart costs a minute here).  The
        roles stopped."""
        crashed = {c.split(":", 1)[0] for c in d.crashed()}
        deadline = time.monotonic() + IDLE_S
        broken = [
            role
            for role, s in (("prefill", d.prefill), ("decode", d.decode))
            if s.name in crashed or not _idle_by(s, deadline)
        ]
        if broken:
            self.discard(name, backend, tuple(broken))
        return broken

    def stop_all(self) -> None:
        self.fleet.stop_all()


def _idle_by(server, deadline: float) -> bool:
    """Whether ``server`` holds nothing (its own ``/v1/loads``) before ``deadline``; a
    server that does not answer is not idle."""
    while True:
        try:
            if not server.held():
                return True
        except Exception:  # noqa: BLE001 - no answer: as good as crashed
            return False
        if time.monotonic() > deadline:
            return False
        time.sleep(0.25)


# The greedy eval of the RL loops (test_slime_loop.py, test_verl_loop.py): prompts as
# token ids, and the tokens to expect (stock's, :func:`rl_reference`).
RL_EVAL = [[4 + (7 * i + 3 * k) % 90 for k in range(12 + i)] for i in range(3)]
RL_EVAL_TOKENS = 16


@pytest.fixture(scope="session")
def rl_reference(deployments) -> list[list[int]]:
    """The RL loops' greedy eval on the stock pair, through the fleet's router with
    slime's payload (the stock tests run first: the order above)."""
    from tests.e2e.slime_client import SlimeClient

    d = deployments.get("stock", BACKENDS[0])
    out, sends = SlimeClient(d.router).evaluate(RL_EVAL, RL_EVAL_TOKENS)
    assert {s.status for s in sends} == {200}, [(s.status, s.body) for s in sends]
    return out


@pytest.fixture(scope="session")
def models(tmp_path_factory):
    """The tiny model of a family (``models("mla")``), made on first use."""
    made: dict[str, Path] = {}

    def get(family: str = "llama") -> Path:
        if family not in made:
            made[family] = make_tiny_model(
                tmp_path_factory.mktemp(f"tiny-model-{family}"), family=family
            )
        return made[family]

    return get


@pytest.fixture(scope="session")
def model(models) -> Path:
    return models("llama")


@pytest.fixture(scope="session")
def logroot(tmp_path_factory) -> Path:
    root = os.environ.get("KVMEM_E2E_LOGS")
    if root:
        Path(root).mkdir(parents=True, exist_ok=True)
        return Path(root)
    return tmp_path_factory.mktemp("e2e-logs")


@pytest.fixture(scope="session")
def deployments(models, logroot):
    reg = Deployments(models, logroot)
    _FLEETS.append(reg.fleet)
    yield reg
    reg.stop_all()
    print(f"\ne2e servers started: {reg.fleet.started}")


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "backends(*names): the PD transfer backends a test runs on (default: "
        "all of KVMEM_E2E_BACKENDS)",
    )
    config.addinivalue_line(
        "markers",
        "leaves_broken: the test may leave its deployment crashed or changed; "
        "it runs last among the tests of that deployment, which is restarted after it",
    )


def pytest_generate_tests(metafunc):
    """Every test that takes ``backend`` runs on each of BACKENDS, unless it names its
    own (``@pytest.mark.backends("nixl")``: what only that backend has)."""
    if "backend" in metafunc.fixturenames:
        mark = metafunc.definition.get_closest_marker("backends")
        names = [b for b in (mark.args if mark else BACKENDS) if b in BACKENDS]
        metafunc.parametrize("backend", names, scope="module")


def pytest_collection_modifyitems(session, config, items):
    """The tests of one deployment run together, whatever their module: ordered by
    backend (tests without one first), then by kind (their ``kind`` parameter, in the
    order of KINDS; tests without one first), those marked ``leaves_broken`` last in
    their block; otherwise the written order holds (module, then position).  A test of a
    kind in FIRST_BACKEND_ONLY on another backend is deselected."""
    kept, dropped = [], []
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        other = params.get("backend") not in (None, BACKENDS[0])
        (dropped if other and params.get("kind") in FIRST_BACKEND_ONLY else kept).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept
    modules = {}
    for item in items:
        modules.setdefault(item.module, len(modules))
    position = {id(item): i for i, item in enumerate(items)}

    def key(item):
        params = getattr(getattr(item, "callspec", None), "params", {})
        backend = params.get("backend")
        kind = params.get("kind")
        return (
            BACKENDS.index(backend) if backend in BACKENDS else -1,
            list(KINDS).index(kind) if kind in KINDS else -1,
            item.get_closest_marker("leaves_broken") is not None,
            modules[item.module],
            position[id(item)],
        )

    items.sort(key=key)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.when == "call" and report.failed:
        for fleet in _FLEETS:
            for s in fleet.live():
                report.sections.append((f"log of {s.logdir.name}/{s.name}", tail(s.log, 80)))
