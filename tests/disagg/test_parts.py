"""How each side is built from its parts (docs/disagg.md): one frozen context shared by
all, and each part handed the context and the parts built before it, never a later part
(nor the side), not even as a bound method."""

from __future__ import annotations

import dataclasses

import pytest

# each side's parts, in the order it builds them
ORDER = {
    "prefill": ("scheduler", "ending", "sending", "messages", "pause"),
    "decode": ("memory", "receiving", "pause"),
}


def _held(obj) -> list:
    """What ``obj`` holds in its attributes, bound methods as the object they are bound to."""
    out = []
    for v in vars(obj).values():
        out.append(getattr(v, "__self__", v))
        if isinstance(v, (list, tuple)):
            out.extend(getattr(x, "__self__", x) for x in v)
    return out


@pytest.mark.parametrize("name", sorted(ORDER))
def test_no_part_holds_a_part_built_after_it_or_the_side(pair, name):
    side = getattr(pair, name)
    parts = [getattr(side, p) for p in ORDER[name]]
    if name == "prefill":  # the sending part's own part, which it builds (and holds)
        parts.insert(parts.index(side.sending), side.sending.direct)
    for i, part in enumerate(parts):
        held = _held(part)
        assert part.ctx is side.ctx
        later = [type(p).__name__ for p in parts[i + 1 :] if any(h is p for h in held)]
        assert not later, f"{type(part).__name__} holds {later}, built after it"
        assert not any(h is side for h in held), f"{type(part).__name__} holds the side"


@pytest.mark.parametrize("name", sorted(ORDER))
def test_the_context_is_frozen_and_holds_the_sides_tables(pair, name):
    side = getattr(pair, name)
    ctx = side.ctx
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.requests = None  # type: ignore[misc]
    assert ctx.requests is side.requests and ctx.peers is side.peers
    assert ctx.ledger is side.ledger and ctx.metrics is side.metrics
    # the side's request views are the tables' own, not copies
    assert side.reqs is side.requests.active
