"""Calls into the CUDA driver through cuda-python, and what they answer.

Contract: :func:`default_driver` is the driver module (``cuda.bindings.driver``; the
backends take another one, such as the CPU tests' fake driver, by injection);
:func:`call` calls one of its functions and returns its value(s), raising
:class:`~kvmem.errors.CudaDriverError` with the error's name when the call failed.
``OOM`` is the name of the out-of-memory error, which callers turn into
:class:`~kvmem.errors.PoolMemoryError`.
"""

from __future__ import annotations

from kvmem.errors import CudaDriverError

OOM = "CUDA_ERROR_OUT_OF_MEMORY"


def default_driver():
    """``cuda.bindings.driver`` (``cuda.cuda`` on cuda-python before the bindings
    namespace)."""
    try:
        from cuda.bindings import driver
    except ImportError:  # cuda-python before the cuda.bindings namespace
        from cuda import cuda as driver  # type: ignore[no-redef]
    return driver


def _error_name(drv, err) -> str:
    try:
        res, name = drv.cuGetErrorName(err)
        if res == drv.CUresult.CUDA_SUCCESS and name:
            return name.decode() if isinstance(name, bytes) else str(name)
    except Exception:  # noqa: BLE001 - a name is a nicety; the code below still says it
        pass
    return getattr(err, "name", str(err))


def call(drv, fn: str, *args, what: str = ""):
    """Call ``drv.<fn>(*args)``; cuda-python returns ``(CUresult, *values)``: raise
    :class:`CudaDriverError` on an error, return the value(s)."""
    result = getattr(drv, fn)(*args)
    err, *values = result if isinstance(result, tuple) else (result,)
    if err != drv.CUresult.CUDA_SUCCESS:
        raise CudaDriverError(fn, _error_name(drv, err), what)
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)
