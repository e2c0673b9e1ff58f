"""The adapter as sglang loads it: sglang's own ``load_plugins()`` finds the installed
``kvmem`` entry point; with the flag off nothing is patched, with it on every hook is in
place, and every way it cannot be installed stops the process with one clear error.
Each case runs in a process of its own (forked from the session's fork server,
sglang_env.run_script); the bad option values are checked in this process too, and one
of them stops a fresh interpreter."""

from __future__ import annotations

import pytest

from tests.sglang.sglang_env import result_of, run_script

TARGETS = """
import pkgutil
from kvmem_sglang import plugin
from kvmem_sglang.options import Options
def targets_all(transfer):
    return [t for t, _, _ in plugin._hooks(Options(True, None, False, True, True, transfer))]
targets = targets_all(True)
def current():
    out = {}
    for t in targets:
        owner, name = t.rsplit(".", 1)
        obj = pkgutil.resolve_name(owner)
        out[t] = id(obj.__dict__[name]) if isinstance(obj, type) else id(getattr(obj, name))
    return out
"""


def test_flag_off_patches_nothing():
    proc = run_script(
        TARGETS
        + """
import sys
from tests.sglang.sglang_env import emit
before = current()
from tests.sglang.sglang_env import publish
publish(16)  # load_plugins() inside, as the scheduler process does
from sglang.srt.plugins.hook_registry import HookRegistry
emit({"same": current() == before, "loaded": "kvmem_sglang.plugin" in sys.modules,
      "installed": plugin.INSTALLED, "registered": sorted(set(HookRegistry._hooks) & set(targets))})
""",
        kvmem=False,
    )
    out = result_of(proc)
    assert out["loaded"], "sglang's load_plugins() did not load the kvmem entry point"
    assert out["same"], "a hook target changed with SGLANG_KVMEM unset"
    assert out["installed"] == [] and out["registered"] == []


def test_flag_on_installs_every_hook_and_logs_once():
    proc = run_script(
        TARGETS
        + """
import logging
logging.basicConfig(level=logging.INFO)  # as sglang's configure_logger does
from tests.sglang.sglang_env import emit, publish
before = current()
publish(16)
from sglang.srt.plugins import load_plugins
load_plugins()  # a second call (sglang calls it once per process) changes nothing
after = current()
emit({"changed": sorted(t for t in targets if after[t] != before[t]),
      "installed": plugin.INSTALLED, "targets": len(set(targets))})
""",
        kvmem=True,
    )
    out = result_of(proc)
    assert out["installed"] and sorted(out["installed"]) == out["changed"]
    # every target of the options' hook list (both transfer backends' modules were
    # imported by current() above, so their hooks are in place too), each once
    assert len(out["installed"]) == len(set(out["installed"])) == out["targets"]
    assert proc.stderr.count("kvmem-sglang: SGLANG_KVMEM=1, ") == 1
    assert "transfer kvmem)" in proc.stderr
    assert "Multiple AROUND hooks" not in proc.stderr


def test_sglang_send_path_leaves_the_send_hooks_out():
    """SGLANG_KVMEM_TRANSFER=sglang: sglang's own send, none of the 3 send-path hooks."""
    proc = run_script(
        """
from sglang.srt.plugins import load_plugins
load_plugins()
from kvmem_sglang import plugin
from tests.sglang.sglang_env import emit
emit({"installed": plugin.INSTALLED})
""",
        kvmem=True,
        env={"SGLANG_KVMEM_TRANSFER": "sglang"},
    )
    out = result_of(proc)
    assert len(out["installed"]) == len(set(out["installed"]))
    assert not [
        t
        for t in out["installed"]
        if t.endswith(("send_kvcache", "transfer_worker", "_await_handles"))
    ]
    assert "transfer sglang)" in proc.stderr


LOAD = """
from sglang.srt.plugins import load_plugins
load_plugins()  # what every sglang process does first
print("SERVED STOCK")
"""


def _refused(proc, *needles):
    assert proc.returncode != 0, "the process went on after a refusal"
    assert "SERVED STOCK" not in proc.stdout
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("kvmem-sglang (SGLANG_KVMEM=1): "), proc.stderr[-2000:]
    for n in needles:
        assert n in last, f"{n!r} not in {last!r}"


BAD_OPTIONS = pytest.mark.parametrize(
    "env, needle",
    [
        ({"SGLANG_KVMEM": "yes"}, "SGLANG_KVMEM='yes'"),
        ({"SGLANG_KVMEM_BACKEND": "gpu"}, "SGLANG_KVMEM_BACKEND='gpu'"),
        ({"SGLANG_KVMEM_REGISTER": "all"}, "SGLANG_KVMEM_REGISTER='all'"),
        ({"SGLANG_KVMEM_TRANSFER": "fast"}, "SGLANG_KVMEM_TRANSFER='fast'"),
    ],
    ids=["flag", "backend", "register", "transfer"],
)


@BAD_OPTIONS
def test_bad_option_is_refused_at_plugin_load(env, needle, monkeypatch):
    """In this process: the entry point sglang calls refuses before it installs
    anything, with the one message a process stop shows (below)."""
    import os

    from kvmem_sglang import plugin
    from kvmem_sglang.options import PREFIX

    for name in [k for k in os.environ if k.startswith("SGLANG_KVMEM")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("SGLANG_KVMEM", "1")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    installed = list(plugin.INSTALLED)
    with pytest.raises(SystemExit) as stop:
        plugin.load()
    msg = str(stop.value.code)
    assert msg.startswith(PREFIX) and "\n" not in msg, msg
    assert needle in msg and "not understood" in msg, msg
    assert plugin.INSTALLED == installed


@BAD_OPTIONS
def test_bad_option_stops_the_process(env, needle):
    # one case in a fresh interpreter: sglang's load_plugins() at its start, as a server's
    fresh = "SGLANG_KVMEM" in env
    _refused(run_script(LOAD, kvmem=True, env=env, fresh=fresh), needle, "not understood")


def test_other_sglang_version_stops_the_process():
    _refused(
        run_script("import sglang; sglang.__version__ = '0.5.24'\n" + LOAD, kvmem=True),
        "supports sglang 0.5.23",
        "found sglang 0.5.24",
    )


def test_missing_target_stops_the_process():
    code = (
        "from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool\n"
        "del MHATokenToKVPool._create_buffers_normal\n" + LOAD
    )
    _refused(
        run_script(code, kvmem=True), "MHATokenToKVPool._create_buffers_normal", "does not exist"
    )


def test_hook_sglang_did_not_apply_stops_the_process():
    # sglang skips a target it believes patched already, and would say nothing
    code = (
        "from sglang.srt.plugins.hook_registry import HookRegistry\n"
        "HookRegistry._patched.add('sglang.srt.mem_cache.kv_cache_configurator."
        "KVCacheConfigurator._build_token_to_kv_pool_allocator')\n" + LOAD
    )
    _refused(run_script(code, kvmem=True), "did not apply", "_build_token_to_kv_pool_allocator")


BUILD_REFUSALS = """
import os, torch
from tests.sglang.sglang_env import emit, publish, build_pools
from kvmem_sglang.options import AdapterError
publish(16)
out = {}
def refused(name, fn):
    try:
        fn()
    except AdapterError as e:
        out[name] = str(e)
    else:
        out[name] = None
refused("float64", lambda: build_pools(page_size=16, size=256, dtype=torch.float64))
os.environ["SGLANG_USE_HND_KVCACHE"] = "1"
refused("hnd", lambda: build_pools(page_size=16, size=256))
del os.environ["SGLANG_USE_HND_KVCACHE"]
from sglang.srt.mem_cache.memory_pool import NoOpMHATokenToKVPool
def noop():
    pool = NoOpMHATokenToKVPool(256, page_size=16, dtype=torch.bfloat16, head_num=2,
                                head_dim=16, layer_num=2, device="cpu",
                                enable_memory_saver=False)
    build_pools(page_size=16, size=256, kv=pool)
refused("noop", noop)
emit(out)
"""


def test_pools_kvmem_cannot_place_are_refused_by_name():
    out = result_of(run_script(BUILD_REFUSALS, kvmem=True))
    assert out["float64"] and "float64" in out["float64"]
    assert out["hnd"] and "'hnd' KV layout" in out["hnd"]
    assert out["noop"] and "NoOpMHATokenToKVPool" in out["noop"]


BACKEND = """
import sys
from sglang.srt.plugins import load_plugins
load_plugins()
from kvmem_sglang import plugin
from tests.sglang.sglang_env import emit
before = list(plugin.INSTALLED)
import sglang.srt.disaggregation.{backend}.conn
emit({{"before": before, "after": plugin.INSTALLED,
      "nixl": sorted(m for m in sys.modules if m.split(".")[0].startswith("nixl")),
      "mooncake": sorted(m for m in sys.modules if m.split(".")[0] == "mooncake")}})
"""


@pytest.mark.parametrize("backend, other", [("mooncake", "nixl"), ("nixl", "mooncake")])
def test_a_backends_hooks_wait_for_its_module_and_load_no_other(backend, other):
    """The hooks on a PD transfer backend's classes are installed when sglang imports
    that backend's module, not at plugin load: importing NIXL's module loads the NIXL
    library, which a Mooncake server (sglang's default backend) must not load because
    the adapter named NIXL's classes."""
    out = result_of(run_script(BACKEND.format(backend=backend), kvmem=True))
    new = [t for t in out["after"] if t not in out["before"]]
    assert new and all(f"disaggregation.{backend}.conn." in t for t in new), new
    assert not any(f"disaggregation.{backend}." in t for t in out["before"])
    assert not any(f"disaggregation.{other}." in t for t in out["after"])
    assert out[other] == [], out[other]
