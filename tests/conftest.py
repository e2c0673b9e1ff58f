"""What the main test run (``pytest tests``) collects.

- ``tests/interpret``: the Triton kernels under Triton's interpreter run in a process of
  their own (``make test-interpret``: ``TRITON_INTERPRET=1 KVMEM_FORCE_TRITON=1 pytest
  tests/interpret``), because TRITON_INTERPRET is read when a kernel is decorated; the
  main run leaves that folder out.
- ``tests/gpu``: CUDA-only tests (bench/gpu_check.sh), collected only where CUDA is
  available.
- ``tests/e2e``: real sglang servers and sglang's router, run by ``make test-e2e`` with
  ``.venv-e2e`` (sglang with its full dependencies and the router), which sets
  ``KVMEM_E2E=1``; the main run leaves that folder out.

A run that loaded NIXL ends through :func:`kvmem.transfer.nixl_exit.finish_pytest` once
pytest has written everything (on a host with RDMA libraries NIXL's native destructors
crash at exit, status 139, after the tests passed; docs/transfer.md, "Process exit").

Physical chunks: ``KVMEM_CHUNK_BYTES`` is set to 256 KiB here (unless the caller set it),
for this process and every process it starts (demo workers, sglang servers), so the
small pools of the tests have several chunks, each one mapping and one registered region,
as a GPU pool has at 2 GiB: a descriptor, registration or page run that crosses a chunk
fails here as it would on the GPU.  Most test pools then have a chunk boundary after
every one to five layer planes.
"""

import os

import pytest
import torch

os.environ.setdefault("KVMEM_CHUNK_BYTES", str(256 << 10))

collect_ignore = []
if os.environ.get("TRITON_INTERPRET") != "1":
    collect_ignore.append("interpret")
if not torch.cuda.is_available():
    collect_ignore.append("gpu")
if os.environ.get("KVMEM_E2E") != "1":
    collect_ignore.append("e2e")


@pytest.hookimpl(wrapper=True)
def pytest_cmdline_main(config):
    status = yield
    from kvmem.transfer.nixl_exit import finish_pytest  # here: collection imports no kvmem

    return finish_pytest(config, status)
