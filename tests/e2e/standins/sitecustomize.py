"""CPU stand-ins for the CUDA-only calls sglang 0.5.23 hard-codes, for the end-to-end
tier's server processes only (this directory is put first on their PYTHONPATH, so Python
imports this module at start-up in every process sglang spawns).

Each stand-in replaces one CUDA-only call and nothing of sglang's or kvmem's logic; it
is applied when its module is first imported, through a post-import hook below:

1. ``common_ops`` (the module beside this one): ``sgl_kernel`` has no CPU build on the
   package index, and ``sglang/kernels/ops/kvcache/cache_move.py:10`` (imported by
   ``srt/mem_cache/memory_pool.py:42``) fails with "Could not load any common_ops
   library" (it wants ``libcuda.so.1``).  ``sgl_kernel/load_utils.py`` falls back to a
   plain ``import common_ops``; an empty module of that name is enough on a CPU without
   AMX: sglang then takes its torch paths and calls no ``torch.ops.sgl_kernel`` op for
   Llama.

2. NIXL memory kind (:func:`_dram_for_vram`): sglang registers and describes KV buffers
   as "VRAM" (``srt/disaggregation/nixl/conn.py:204-230`` ``_normalize_kv_mem_kinds``,
   hard-coded at ``srt/disaggregation/decode.py:629``); UCX refuses CPU memory as VRAM
   (``NIXL_ERR_BACKEND`` at ``nixl/conn.py:1992``), and no flag selects DRAM.  Every
   NIXL descriptor call resolves its memory type through the agent's ``nixl_mems``
   table, so "VRAM" is made to mean DRAM in that table, per agent.

3. ``torch.get_device_module()`` in ``release_memory_occupation``
   (``srt/managers/scheduler_components/weight_updater.py:379``,
   ``torch.get_device_module().synchronize()``): on a CUDA build of torch with no CUDA
   device that is ``torch.cuda``, and the scheduler dies.  In that module only,
   ``torch.get_device_module()`` without an argument returns ``torch.cpu`` when no CUDA
   device is available (:func:`_cpu_device_module`, ``cpu_torch.py``).

4. ``torch.cuda.Event()`` in a PD prefill with the overlap schedule on
   (``srt/disaggregation/prefill.py:1496``: an event recorded on the forward stream
   before a cached prefix is sent early): in that module only it is a CPU event with
   nothing to wait for, since a CPU forward is done when its call returns
   (:func:`_cpu_device_module` again, ``cpu_torch.py``).

Besides the stand-ins, one setting for a machine of two cores, applied to stock and the
flag alike (as the tier's one OpenMP thread per server is):

5. NIXL's progress thread naps between polls (:func:`_progress_thread_naps`): NIXL's
   Python agent hard-codes ``pthrDelay = 0`` (``nixl_cu13/_api.py:226``), so the UCX
   backend's shared progress thread (``nixlUcxSharedThread::run``) calls ``poll()`` with
   a zero timeout in a loop: every idle NIXL server here kept 40-70% of a core busy
   (seen with gdb: the scheduler's main thread asleep in its idle poll, that thread
   running), and a tier with four servers up ran at a load of 12-14 on two cores.  With
   ``pthrDelay`` at ``PTHR_DELAY_US`` (``testkit/nixl_nap.py``) the thread still wakes at
   once when a worker's file descriptor is ready; the delay only bounds its periodic
   wake-up.

6. sglang's child processes (scheduler, detokenizer) come from a fork server
   (:func:`_children_from_a_fork_server`): sglang starts them with "spawn"
   (``srt/entrypoints/engine.py:1995``), and each fresh interpreter imported torch and
   sglang again (about 22 s of a core each here, three times a server).  The fork
   server, started by a server's first child, imports the children's modules once with
   that moment's environment; each child then runs with the environment it would have
   been spawned with.  A server starts about a quarter sooner (a PD pair: 72 s -> 54 s
   here).  ``KVMEM_E2E_SPAWN=1`` turns it off.  The adapter's start line is then
   written by the fork server rather than by each child.

7. sglang's DeepSeek attention dispatch under ``torch_native`` (``mla_attention.py``
   beside this file): no handler is registered for that backend
   (``srt/models/deepseek_common/attention_backend_handler.py``), the triton one it falls
   back to sends a first prefill down the MHA path, and ``torch_native`` then misreads
   the MLA latent buffer.  A ``torch_native`` handler that always takes sglang's own
   absorbed MLA path is registered; it chooses between sglang's paths, nothing else.

Besides those, ``faults.py`` (beside this file) lets a test make the real
Mooncake engine refuse one registration or deregistration of a running server; it does
nothing until a test arms it (its docstring).

``KVMEM_E2E_STANDINS`` lists the stand-ins that were applied in a process, for the
tests to check (``KVMEM_E2E_STANDINS_LOG``: a file each process appends its list to).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys

_APPLIED: list[str] = []


def _note(name: str) -> None:
    _APPLIED.append(name)
    path = os.environ.get("KVMEM_E2E_STANDINS_LOG")
    if path:
        try:
            with open(path, "a") as f:
                f.write(f"{os.getpid()} {name}\n")
        except OSError:
            pass


def _nap_module():
    """testkit/nixl_nap.py, loaded from its file once: the repository is not on this
    path."""
    nap = sys.modules.get("kvmem_e2e_nixl_nap")
    if nap is None:
        path = os.path.join(
            os.path.dirname(os.path.abspath(__file__)),
            os.pardir,
            os.pardir,
            os.pardir,
            "testkit",
            "nixl_nap.py",
        )
        spec = importlib.util.spec_from_file_location("kvmem_e2e_nixl_nap", path)
        nap = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(nap)
        sys.modules["kvmem_e2e_nixl_nap"] = nap
    return nap


def _dram_for_vram(module) -> None:
    if _nap_module().vram_as_dram(module):
        _note(f"nixl-vram-as-dram:{module.__name__}")


def _progress_thread_naps(module) -> None:
    if _nap_module().apply(module):
        _note(f"nixl-progress-thread-delay:{module.__name__}")


def _nixl_api(module) -> None:
    _dram_for_vram(module)
    _progress_thread_naps(module)


def _cpu_device_module(module) -> None:
    from cpu_torch import apply  # beside this file, on the same PYTHONPATH entry

    if apply(module):
        _note(f"cpu-device-module:{module.__name__}")


def _mla_attention(module) -> None:
    from mla_attention import apply  # beside this file

    if apply(module):
        _note(f"mla-torch-native-handler:{module.__name__}")


def _faults(module) -> None:
    from faults import apply  # beside this file

    if apply(module):
        _note(f"faults-armable:{module.__name__}")


def _fault_managers(module) -> None:
    from faults import apply_managers  # beside this file

    if apply_managers(module):
        _note(f"faults-armable:{module.__name__}")


_HOOKS = {
    "sglang.srt.distributed.device_communicators.mooncake_transfer_engine": _faults,
    "sglang.srt.disaggregation.mooncake.conn": _fault_managers,
    "nixl_cu12._api": _nixl_api,
    "nixl_cu13._api": _nixl_api,
    "sglang.srt.managers.scheduler_components.weight_updater": _cpu_device_module,
    "sglang.srt.disaggregation.prefill": _cpu_device_module,
    "sglang.srt.models.deepseek_common.attention_backend_handler": _mla_attention,
}


class _Loader(importlib.abc.Loader):
    def __init__(self, inner, after):
        self._inner, self._after = inner, after

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        self._inner.exec_module(module)
        self._after(module)


class _Finder(importlib.abc.MetaPathFinder):
    """Wraps the loader of each module in ``_HOOKS`` so that its stand-in runs right
    after the module body."""

    def find_spec(self, name, path=None, target=None):
        after = _HOOKS.get(name)
        if after is None:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _Loader(spec.loader, after)
        return spec


sys.meta_path.insert(0, _Finder())


class _InEnv:
    """A child's target run with ``env`` as its whole environment: what a spawned child
    would have had, since a fork server's children inherit the server's instead."""

    def __init__(self, target, env: dict):
        self.target, self.env = target, env

    def __call__(self, *args, **kwargs):
        # only what differs: emptying the environment first leaves setproctitle no room
        # for the title sglang gives the process (``sglang::scheduler``; the tests find
        # the schedulers by it)
        for k in [k for k in os.environ if k not in self.env]:
            del os.environ[k]
        for k, v in self.env.items():
            if os.environ.get(k) != v:
                os.environ[k] = v
        return self.target(*args, **kwargs)


# what the children's fork server imports once (the targets of sglang's scheduler and
# detokenizer processes); the rest of sglang comes with them
_PRELOAD = ["sglang.srt.managers.scheduler", "sglang.srt.managers.detokenizer_manager"]
# variables that act only when a process starts: a child whose own differ from the fork
# server's is spawned
_EXEC_TIME = ("LD_PRELOAD", "LD_LIBRARY_PATH")


def _children_from_a_fork_server() -> None:
    """Item 6 of the module docstring: ``multiprocessing.Process`` of the default
    context, while its start method is sglang's "spawn", starts its child from a fork
    server that imported :data:`_PRELOAD` once; a child that names another executable
    (numactl) or other :data:`_EXEC_TIME` variables than the fork server had, or a
    process of an explicit context, starts as before."""
    import multiprocessing
    import multiprocessing.context as mp_context
    import multiprocessing.forkserver as forkserver
    import multiprocessing.spawn as mp_spawn

    default_popen = mp_context.Process._Popen
    server = {}  # what the fork server started with: executable, exec-time variables

    def _popen(process_obj):
        if multiprocessing.get_start_method(allow_none=True) != "spawn":
            return default_popen(process_obj)
        now = (mp_spawn.get_executable(), *(os.environ.get(k) for k in _EXEC_TIME))
        if not server:
            forkserver.set_forkserver_preload(_PRELOAD)
            server["start"] = now
            _note("children-from-fork-server")
        if now != server["start"]:
            return default_popen(process_obj)
        process_obj._target = _InEnv(process_obj._target, dict(os.environ))
        return mp_context.ForkServerProcess._Popen(process_obj)

    mp_context.Process._Popen = staticmethod(_popen)


if os.environ.get("KVMEM_E2E_SPAWN") != "1":
    _children_from_a_fork_server()
