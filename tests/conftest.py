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
"""

import os

import torch

collect_ignore = []
if os.environ.get("TRITON_INTERPRET") != "1":
    collect_ignore.append("interpret")
if not torch.cuda.is_available():
    collect_ignore.append("gpu")
if os.environ.get("KVMEM_E2E") != "1":
    collect_ignore.append("e2e")
