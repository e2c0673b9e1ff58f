"""tools/planted_defects.py can still plant its defects: each one's text is in its file
exactly once.  (Running the tool shows the tiers catch them; that takes minutes and is
done by hand, README.md "Testing".)  A reformatted or moved line fails here, in make
check, instead of the tool refusing to run when someone needs it."""

from __future__ import annotations

import os

import pytest

from tools.planted_defects import DEFECTS, ROOT


@pytest.mark.parametrize("defect", DEFECTS, ids=lambda d: d.name)
def test_each_defect_text_is_in_its_file_once(defect):
    with open(os.path.join(ROOT, defect.path)) as f:
        text = f.read()
    assert text.count(defect.old) == 1, f"{defect.path}: update DEFECTS[{defect.name!r}]"
    assert defect.new != defect.old
