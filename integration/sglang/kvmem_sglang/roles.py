"""What a scheduler is and what it has released: the questions every lifecycle hook asks
of sglang's ``Scheduler`` before it decides anything.

* :func:`role`: ``"prefill"``, ``"decode"`` or ``"plain"`` (sglang's
  ``disaggregation_mode``: PREFILL, DECODE, NULL).
* :func:`released`: the memory tags released now (``weight_updater.offload_tags``)
  that a forward pass needs: ``kv_cache`` (the KV pool) and ``weights``.  While either is
  released no request may reach a forward.
* :func:`server`: how a refusal names the server, with the scheduler's real tensor
  parallel rank (sglang 0.5.23's ``Scheduler`` has no ``tp_rank`` attribute; the rank is
  in its runtime context).
"""

from __future__ import annotations


def role(sched) -> str:
    from sglang.srt.disaggregation.utils import DisaggregationMode

    mode = getattr(sched, "disaggregation_mode", None)
    if mode == DisaggregationMode.PREFILL:
        return "prefill"
    if mode == DisaggregationMode.DECODE:
        return "decode"
    return "plain"


def released(sched) -> frozenset[str]:
    """The tags among ``kv_cache`` and ``weights`` that ``sched`` has released."""
    from sglang.srt.constants import GPU_MEMORY_TYPE_KV_CACHE, GPU_MEMORY_TYPE_WEIGHTS

    wu = getattr(sched, "weight_updater", None)
    tags = getattr(wu, "offload_tags", None) or ()
    return frozenset(t for t in (GPU_MEMORY_TYPE_KV_CACHE, GPU_MEMORY_TYPE_WEIGHTS) if t in tags)


def kv_released(sched) -> bool:
    from sglang.srt.constants import GPU_MEMORY_TYPE_KV_CACHE

    return GPU_MEMORY_TYPE_KV_CACHE in released(sched)


def tp_rank() -> int:
    """This process's tensor-parallel rank (0 when sglang has not published one)."""
    try:
        from sglang.srt.runtime_context import get_parallel

        return int(get_parallel().tp_rank)
    except Exception:  # noqa: BLE001 - a harness without a published parallel context
        return 0


def server(sched) -> str:
    """``"Prefill server (TP rank 1)"``, ``"Decode server (TP rank 0)"``,
    ``"Server (TP rank 0)"``."""
    name = {"prefill": "Prefill server", "decode": "Decode server"}.get(role(sched), "Server")
    return f"{name} (TP rank {tp_rank()})"


def describe(tags) -> str:
    """How a refusal names the memory of ``tags``: ``"KV cache"``, ``"weights"``, or
    ``"KV cache and weights"`` (other tags are not named)."""
    names = {"kv_cache": "KV cache", "weights": "weights"}
    return " and ".join(names[t] for t in ("kv_cache", "weights") if t in tags)


def what_released(sched) -> str:
    return describe(released(sched))
