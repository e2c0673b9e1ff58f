"""NixlEngine: the TransferEngine over NIXL (UCX), DRAM on the CPU, VRAM on CUDA.

The epoch rule, the tombstones and the pause/resume ordering are in docs/transfer.md (and
:mod:`kvmem.transfer.engine`); this module only maps them onto NIXL's agent API.  The
facts about NIXL it relies on (no revocation, re-adding peers, damaged metadata,
notifications, transports, the progress thread, the first transfer) are in
docs/transfer.md, "NIXL facts kvmem relies on".

VRAM (not run on this CPU machine; each spot is marked ``GPU-CHECK``): regions on a CUDA
device register as "VRAM" with the device index as NIXL's device id; a CUDA context must
be current when the agent is created (NIXL's note on GPU memory views), so create the
engine after the pool.  On a CUDA 13 host use the ``nixl-cu13`` build (the cu12 build's
CUDA plugins need libcudart.so.12); :func:`import_nixl` picks the build.
"""

from __future__ import annotations

import importlib
import os

import numpy as np
import torch

from kvmem.transfer.engine import TransferEngine
from kvmem.transfer.errors import MetadataError, TransferError
from kvmem.transfer.layout import MAX_TABLE_BLOCKS, BlockLayout
from kvmem.transfer.records import Registration, RemoteMemory

# Blocks a table may hold where NIXL has no strided lists and every block is one row: a
# choice, not a limit NIXL reported (docs/transfer.md, "Costs").
EXPANDED_MAX_BLOCKS = 1 << 24


def import_nixl():
    """NIXL's Python API module: ``KVMEM_NIXL_MODULE`` when set; else the ``nixl`` meta
    package where it is installed, which is what sglang imports (``from nixl._api import
    nixl_agent``), so that kvmem and sglang in one process use one NIXL build; else the
    build that matches torch's CUDA major version (``nixl_cu13`` for CUDA 13, else
    ``nixl_cu12``), then the other one."""
    forced = os.environ.get("KVMEM_NIXL_MODULE")
    if forced:
        names = [forced]
    else:
        cu13 = (torch.version.cuda or "").startswith("13")
        names = ["nixl"] + (["nixl_cu13", "nixl_cu12"] if cu13 else ["nixl_cu12", "nixl_cu13"])
    errors = []
    for name in names:
        try:
            mod = importlib.import_module(name)
            mod.nixl_agent  # noqa: B018 - the meta package `nixl` re-exports it
            return mod
        except (ImportError, AttributeError) as e:
            errors.append(f"{name}: {e}")
    raise ImportError(
        "NIXL is not installed (pip install 'kvmem[nixl]', nixl-cu12 here, "
        "nixl-cu13 on CUDA 13): " + "; ".join(errors)
    )


class NixlEngine(TransferEngine):
    """A TransferEngine over one NIXL agent.

    Args:
        name: the agent name peers see (unique among the agents that talk to each other).
        backends: NIXL backend plugins to create; each must be available.
        progress_thread: NIXL's progress thread.  On (NIXL's default): transfers progress
            with nobody polling, at the cost of one spinning core per process.  Off: every
            engine involved must be driven (``in_flight()`` / ``get_notifs()``), see the
            module docstring for what it gains on a small CPU.
        num_threads: UCX worker threads (0: NIXL's default).
        agent: an existing NIXL agent named ``name`` to drive instead of creating one
            (``progress_thread`` and ``num_threads`` are then the agent's own), for a
            process that keeps agents across engines (a test session: each creation
            sets up a UCX context and worker).  It must hold nothing of an
            earlier engine: no registrations, prepared lists, transfers or loaded peers,
            and no notifications left unread.  ``close()`` leaves it so, and leaves it
            alive for its owner.
    """

    kind = "nixl"

    def __init__(
        self,
        name: str,
        backends=("UCX",),
        *,
        progress_thread: bool = True,
        num_threads: int = 0,
        agent=None,
    ):
        super().__init__(name)
        if agent is None:
            nixl = import_nixl()
            conf = nixl.nixl_agent_config(
                enable_prog_thread=progress_thread, num_threads=num_threads, backends=list(backends)
            )
            try:
                agent = nixl.nixl_agent(name, conf)
            except Exception as e:
                raise TransferError(
                    f"NixlEngine {name!r}: NIXL agent creation failed: {type(e).__name__}: {e}"
                ) from None
        elif getattr(agent, "name", None) != name:
            raise ValueError(
                f"NixlEngine {name!r}: the agent given is named {getattr(agent, 'name', None)!r}"
            )
        missing = [b for b in backends if b not in agent.backends]
        if missing:  # NIXL only logs a warning for a missing plugin
            raise TransferError(
                f"NixlEngine {name!r}: NIXL backend(s) {missing} not available "
                f"(plugins: {agent.get_plugin_list()})"
            )
        self.agent = agent
        self.backends = tuple(backends)
        self._strided: bool | None = None  # NIXL takes strided lists (None: not tried yet)

    # --- transport primitives ---------------------------------------------------------
    def _t_register(self, reg: Registration):
        # One registerMem call with every region of the key: O(regions) per resume.
        # GPU-CHECK: "VRAM" with device_id = CUDA index, regions from the cuda_vmm backend
        # (cuMemCreate with gpuDirectRDMACapable); UCX needs its cuda transports loaded.
        descs = [(a, n, reg.device_id, "") for a, n in reg.regions]
        try:
            return self.agent.register_memory(descs, reg.mem)
        except Exception as e:
            raise TransferError(
                f"register {reg.key!r}: NIXL refused {len(descs)} {reg.mem} "
                f"region(s): {type(e).__name__}: {e}"
            ) from None

    def _t_deregister(self, native) -> None:
        try:
            self.agent.deregister_memory(native)
        except Exception as e:
            raise TransferError(f"deregister: NIXL refused: {type(e).__name__}: {e}") from None

    def _t_blob(self) -> bytes:
        return bytes(self.agent.get_agent_metadata())

    def _t_load_peer(self, blob: bytes) -> str:
        try:
            name = self.agent.add_remote_agent(blob)
        except Exception as e:
            raise MetadataError(
                f"add_peer: NIXL refused the agent metadata: {type(e).__name__}: {e}"
            ) from None
        return name.decode() if isinstance(name, (bytes, bytearray)) else str(name)

    def _t_unload_peer(self, name: str) -> None:
        try:
            self.agent.remove_remote_agent(name)
        except Exception as e:
            raise TransferError(
                f"NIXL could not remove peer {name!r}: {type(e).__name__}: {e}"
            ) from None

    def _t_post(
        self,
        local: np.ndarray,
        lreg: Registration,
        remote: np.ndarray,
        rmem: RemoteMemory,
        notif: bytes,
    ):
        # Nx3 (addr, len, device id) arrays: one descriptor per paired range.
        # GPU-CHECK: VRAM on either side (device ids from the registrations).
        ld = np.empty((local.shape[0], 3), dtype=np.uint64)
        ld[:, :2], ld[:, 2] = local, lreg.device_id
        rd = np.empty((remote.shape[0], 3), dtype=np.uint64)
        rd[:, :2], rd[:, 2] = remote, rmem.device_id
        a = self.agent
        try:
            h = a.initialize_xfer(
                "WRITE",
                a.get_xfer_descs(ld, lreg.mem),
                a.get_xfer_descs(rd, rmem.mem),
                rmem.peer,
                notif,
            )
        except Exception as e:
            raise TransferError(
                f"post_write to {rmem.peer!r}: NIXL refused the request "
                f"({ld.shape[0]} descriptor(s)): {type(e).__name__}: {e}"
            ) from None
        return self._post(h, f"post_write to {rmem.peer!r}")

    def _t_prep(self, layout: BlockLayout, mem: str, device_id: int, peer: str | None):
        # One prep_xfer_dlist per table: NIXL resolves every descriptor against the
        # registrations (local) or the peer's loaded metadata (remote) here, once, so a
        # post names blocks by index.  The list is NIXL's strided form, one (base, nbytes,
        # device id, stride, count) row per plane: O(planes) to build and to prepare (an
        # expanded row per block costs memory and prep time per block: docs/transfer.md,
        # "Costs").
        # Index plane * count + i is block i of that plane.  A plane's whole span must lie
        # inside one registered region (NIXL_ERR_NOT_FOUND otherwise, checked), which a
        # pool's chunk plan guarantees.  Adjacent blocks picked in a row are merged into
        # one descriptor by make_prepped_xfer (its skip_desc_merge=False): a run of k pages
        # of a layer, adjacent on both sides, goes as one cma write.
        where = "NIXL_INIT_AGENT" if peer is None else peer
        of = "" if peer is None else " of " + repr(peer)
        if self._strided is not False:
            rows = np.array(
                [(b, n, device_id, st, layout.count) for b, st, n in layout.planes], dtype=np.uint64
            )
            try:
                native = self.agent.prep_xfer_dlist(where, rows, mem)
                self._strided = True
                return native
            except TypeError:  # a NIXL without strided lists: its get_xfer_descs refused Nx5
                self._strided = False
            except Exception as e:
                raise TransferError(
                    f"prep: NIXL refused {rows.shape[0]} strided {mem} "
                    f"descriptor(s) ({layout.blocks} blocks){of}: "
                    f"{type(e).__name__}: {e}"
                ) from None
        why = self._t_prep_refusal(layout)
        if why is not None:
            raise TransferError(f"prep: {why}")
        d = np.empty((layout.blocks, 3), dtype=np.uint64)
        d[:, :2], d[:, 2] = layout.descs(), device_id
        try:
            return self.agent.prep_xfer_dlist(where, d, mem)
        except Exception as e:
            raise TransferError(
                f"prep: NIXL refused {d.shape[0]} {mem} descriptor(s){of}: {type(e).__name__}: {e}"
            ) from None

    def _t_prep_refusal(self, layout: BlockLayout) -> str | None:
        if self._strided is False and layout.blocks > EXPANDED_MAX_BLOCKS:
            return (
                f"this NIXL has no strided descriptor lists, and {layout.blocks} blocks "
                f"one by one would be more than {EXPANDED_MAX_BLOCKS} descriptors"
            )
        return None

    def _t_unprep(self, native) -> None:
        try:
            self.agent.release_dlist_handle(native)
        except Exception as e:
            raise TransferError(
                f"NIXL could not release a prepared list: {type(e).__name__}: {e}"
            ) from None

    def _t_post_blocks(self, op, local, lidx, remote, ridx, peer, notif):
        # NIXL reads the indices as int32 (base.MAX_TABLE_BLOCKS): prepared tables hold
        # fewer blocks, so the indices, checked against them, fit; refuse rather than wrap.
        top = max(int(lidx.max()), int(ridx.max()))
        if top > MAX_TABLE_BLOCKS or min(int(lidx.min()), int(ridx.min())) < 0:
            raise TransferError(
                f"post_blocks {op} with {peer!r}: block index {top} does not "
                "fit NIXL's int32 indices"
            )
        a = self.agent
        try:
            h = a.make_prepped_xfer(
                op, local, lidx.astype(np.int32), remote, ridx.astype(np.int32), notif
            )
        except Exception as e:
            raise TransferError(
                f"post_blocks {op} with {peer!r}: NIXL refused the request "
                f"({lidx.size} block(s)): {type(e).__name__}: {e}"
            ) from None
        return self._post(h, f"post_blocks {op} with {peer!r}")

    def _post(self, h, what: str):
        """``(h, state)`` of a created transfer, posted; its handle released if NIXL
        cannot post it."""
        try:
            return h, self.agent.transfer(h)
        except Exception as e:
            h.release()
            raise TransferError(f"{what}: NIXL could not post: {type(e).__name__}: {e}") from None

    def _t_state(self, native) -> str:
        return self.agent.check_xfer_state(native)

    def _t_release(self, native) -> None:
        native.release()

    def _t_send_notif(self, peer: str, msg: bytes) -> None:
        self.agent.send_notif(peer, msg)

    def _t_get_notifs(self) -> dict[str, list[bytes]]:
        return self.agent.get_new_notifs()

    def _t_close(self) -> None:
        # The agent's destructor stops its threads and closes UCX once nothing holds it
        # (an agent given to __init__ stays with its owner).
        self.agent = None
