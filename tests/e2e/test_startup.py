"""Start-up of a real sglang server with the flag: refusals stop the server with one
line that starts with the adapter's prefix and names the setting to change, instead of
a server that runs stock sglang while its operator set SGLANG_KVMEM=1."""

from __future__ import annotations

import time

import pytest

from tests.e2e.deploy import Deployment, tail

EXIT_S = 180.0


def _refused(model, logroot, name, env, *needles):
    d = Deployment(model, logroot / f"startup-{name}", pd=False, env=env)
    d._ports()
    server = d.single
    server.start()
    deadline = time.monotonic() + EXIT_S
    try:
        while server.alive() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not server.alive(), f"still running after {EXIT_S:.0f} s:\n{tail(server.log)}"
        assert server.proc.returncode != 0
        text = server.log_text()
        lines = [ln for ln in text.splitlines() if "kvmem-sglang (SGLANG_KVMEM=1): " in ln]
        assert lines, tail(server.log)
        for n in needles:
            assert any(n in ln for ln in lines), (n, lines)
        assert "The server is fired up" not in text
    finally:
        server.stop()


def test_plugins_list_without_kvmem_stops_the_server(model, logroot):
    """SGLANG_PLUGINS that leaves kvmem out: sglang skips the plugin ("Skipping plugin
    kvmem") and would run stock; the adapter's start-up guard stops it."""
    _refused(
        model,
        logroot,
        "plugins",
        {"SGLANG_KVMEM": "1", "SGLANG_PLUGINS": "other"},
        "SGLANG_PLUGINS='other' leaves the kvmem plugin out",
        "add kvmem to SGLANG_PLUGINS",
    )


@pytest.mark.parametrize(
    "var,value", [("SGLANG_KVMEM_BACKEND", "gpu"), ("SGLANG_KVMEM_DRAIN_TIMEOUT", "-1")]
)
def test_bad_option_stops_the_server(model, logroot, var, value):
    _refused(
        model,
        logroot,
        var.lower(),
        {"SGLANG_KVMEM": "1", var: value},
        f"{var}='{value}'",
        f"set {var}",
    )
