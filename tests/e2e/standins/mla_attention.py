"""Stand-in 7 (``sitecustomize.py``): sglang's DeepSeek attention dispatch takes its own
absorbed MLA path under the ``torch_native`` attention backend.

sglang 0.5.23 picks a DeepSeek attention layer's forward method by backend name
(``AttentionBackendRegistry``, ``srt/models/deepseek_common/attention_backend_handler.py``)
and has no handler for ``torch_native``: ``get_handler`` falls back to the triton one
(:55), which sends a prefill with no cached prefix down the MHA path (:248-251).  That
path writes K and V per head and asks the backend for ordinary attention, but the pool
is an ``MLATokenToKVPool`` (one latent row per token), and ``torch_native`` then reads
that latent row as per-head K (``srt/layers/attention/torch_native_backend.py:314``): the
first prefill fails with a shape error in its SDPA call (:160).  The handler registered here always
returns ``_dispatch_mla_subtype`` (:58), the absorbed MLA path sglang itself takes for
decodes, for prefills with a cached prefix, and for every batch under deterministic
inference (:237-239).  It picks which of sglang's own attention paths runs on a CPU;
nothing of kvmem's is involved, and stock and the flag get it alike.
"""

from __future__ import annotations


def apply(module) -> bool:
    """Register the ``torch_native`` handler in ``module`` (sglang's
    attention_backend_handler); False if one is there already (a later sglang may have
    its own: then it is left alone)."""
    registry = module.AttentionBackendRegistry
    if "torch_native" in registry._handlers:
        return False
    dispatch = module._dispatch_mla_subtype

    def handle_attention_torch_native(attn, forward_batch):
        return dispatch(attn, forward_batch)

    registry.register("torch_native", handle_attention_torch_native)
    return True
