"""Write the PD contract's table (:func:`kvmem.lifecycle.markdown`) into the documents that
quote it, between ``<!-- contract -->`` and ``<!-- /contract -->``:

    .venv/bin/python tools/contract_tables.py          # rewrite them
    .venv/bin/python tools/contract_tables.py --check  # exit 1 if one differs

tests/test_lifecycle_contract.py runs the check."""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvmem.lifecycle import markdown  # noqa: E402

DOCS = ("docs/disagg.md", "integration/sglang/README.md")
SPAN = re.compile(r"(<!-- contract -->\n)(.*?)(<!-- /contract -->)", re.S)


def rewrite(text: str) -> str:
    """``text`` with every contract span holding the table now."""
    return SPAN.sub(lambda m: m.group(1) + markdown() + m.group(3), text)


def main(argv: list[str]) -> int:
    check = "--check" in argv
    stale = []
    for rel in DOCS:
        path = ROOT / rel
        text = path.read_text()
        if not SPAN.search(text):
            print(f"{rel}: no <!-- contract --> span", file=sys.stderr)
            return 1
        new = rewrite(text)
        if new != text:
            stale.append(rel)
            if not check:
                path.write_text(new)
    if check and stale:
        print(
            f"the contract table differs in {stale}: run tools/contract_tables.py", file=sys.stderr
        )
        return 1
    print(("stale: " if check else "rewritten: ") + (", ".join(stale) or "none"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
