"""The PD prefill lifecycle under sglang's scheduler: every request's KV freed once and
every request answered (transfer timeout, release with requests in flight, status codes,
NIXL deregistration, leak audit).  ``hooks(options)`` lists the hooks the plugin
registers for it; the lifecycle hooks come with their own issue and are not yet here."""

from __future__ import annotations


def hooks(options) -> list[tuple[str, object, str]]:
    """(target, hook, kind) of the prefill lifecycle hooks for these options."""
    return []
