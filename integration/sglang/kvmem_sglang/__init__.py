"""kvmem's sglang adapter: glue between sglang 0.5.23's scheduler and kvmem.

Inert unless ``SGLANG_KVMEM=1``.  sglang loads :func:`kvmem_sglang.plugin.load` from the
``sglang.srt.plugins`` entry point in every process it starts; with the flag on, that
function installs the hooks (allocator, KV pool, release/resume, transfer registration,
staging kernels) or stops the process with one clear error.
"""

__version__ = "0.1.0"
