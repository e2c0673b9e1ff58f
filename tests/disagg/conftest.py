"""The lifecycle tests' shared fixtures: ``pair`` (both PD sides wired, tests/disagg/harness.py)
and ``engine_pair`` (two engines, no sides), each over the loopback engine unless a test
needs real NIXL (harness.engine_kind says how that is chosen).

A module says what pair its tests get, instead of defining its own fixture:

* ``PAIR``: the :class:`~tests.disagg.harness.Pair` keyword arguments (a dict, or a function
  returning one: a fresh stand-in event per test), for every test of the module that
  takes ``pair``;
* ``PAIR_PARAMS``: ``{test id: kwargs}``: every test of the module that takes ``pair``
  runs once per entry (``test_x[packed]``, ``test_x[pull]``, ...).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.disagg.harness import Pair, close_engines, engine_kind, make_engines

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    """With ``KVMEM_TEST_ENGINE=nixl`` every test here runs over real NIXL: marked ``nixl``."""
    if engine_kind() == "nixl":
        for item in items:
            if HERE in Path(item.path).resolve().parents:
                item.add_marker(pytest.mark.nixl)


def pytest_generate_tests(metafunc):
    params = getattr(metafunc.module, "PAIR_PARAMS", None)
    if params is not None and "pair" in metafunc.fixturenames:
        metafunc.parametrize("pair", list(params.values()), ids=list(params), indirect=True)


@pytest.fixture
def pair(request):
    kw = getattr(request, "param", None)
    if kw is None:
        kw = getattr(request.module, "PAIR", {})
    p = Pair(**(kw() if callable(kw) else kw))
    yield p
    p.close()


@pytest.fixture
def engine_pair():
    """``(prefill engine, decode engine)``, closed after the test."""
    pe, de = make_engines(tag="engines")
    yield pe, de
    close_engines(pe, de)
