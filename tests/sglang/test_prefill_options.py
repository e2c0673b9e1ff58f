"""SGLANG_DISAGGREGATION_TRANSFER_TIMEOUT, the one variable the prefill lifecycle hooks
read (at plugin load, like the SGLANG_KVMEM_* options): seconds, default 600; a value
that is not a positive number stops the process with the variable named."""

from __future__ import annotations

import pytest

from kvmem_sglang.options import AdapterError
from kvmem_sglang.options import DEFAULT_TRANSFER_TIMEOUT, transfer_timeout_from_env
from tests.sglang.sglang_env import run_script

VAR = "SGLANG_DISAGGREGATION_TRANSFER_TIMEOUT"


@pytest.mark.parametrize(
    "raw,value", [(None, 600.0), ("", 600.0), (" 0.25 ", 0.25), ("900", 900.0)]
)
def test_transfer_timeout_values(raw, value):
    env = {} if raw is None else {VAR: raw}
    assert transfer_timeout_from_env(env) == value
    assert DEFAULT_TRANSFER_TIMEOUT == 600.0


@pytest.mark.parametrize("raw", ["0", "-5", "ten", "nan", "inf"])
def test_transfer_timeout_refused(raw):
    with pytest.raises(AdapterError, match=f"{VAR}='{raw}' is not a positive number"):
        transfer_timeout_from_env({VAR: raw})


def test_bad_transfer_timeout_stops_the_process_at_load():
    proc = run_script(
        """
from tests.sglang.sglang_env import publish
publish(16)
print("still running")
""",
        kvmem=True,
        env={VAR: "soon"},
    )
    assert proc.returncode != 0 and "still running" not in proc.stdout
    assert f"{VAR}='soon' is not a positive number of seconds" in proc.stderr


@pytest.mark.parametrize("raw,value", [(None, 30.0), ("", 30.0), ("2.5", 2.5)])
def test_drain_timeout_values(raw, value):
    from kvmem_sglang.options import Options

    env = {"SGLANG_KVMEM": "1"} | ({} if raw is None else {"SGLANG_KVMEM_DRAIN_TIMEOUT": raw})
    assert Options.from_env(env).drain_timeout == value


@pytest.mark.parametrize("raw", ["0", "-1", "soon", "inf"])
def test_drain_timeout_refused(raw):
    from kvmem_sglang.options import Options

    with pytest.raises(
        AdapterError,
        match=f"SGLANG_KVMEM_DRAIN_TIMEOUT='{raw}' is not a positive number of seconds",
    ):
        Options.from_env({"SGLANG_KVMEM": "1", "SGLANG_KVMEM_DRAIN_TIMEOUT": raw})
