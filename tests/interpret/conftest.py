"""Tests in this folder run the Triton kernels on CPU tensors under Triton's
interpreter; without both variables they would test nothing, so refuse to run."""

import os

_NEEDED = {"TRITON_INTERPRET": "1", "KVMEM_FORCE_TRITON": "1"}
_missing = [f"{k}={v}" for k, v in _NEEDED.items() if os.environ.get(k) != v]
if _missing:
    raise RuntimeError(
        "tests/interpret must run with "
        + " ".join(f"{k}={v}" for k, v in _NEEDED.items())
        + " set before Python starts (make test-interpret); missing: "
        + ", ".join(_missing)
    )
