"""The adapter's sglang surface (kvmem_sglang/manifest.py; manifest_locate.py finds it)
against the installed sglang, read as source (nothing of sglang imported): every hook
target and private name is where and as it was recorded for 0.5.23; the plugin builds
its hooks from the manifest and nothing else; the README's table is the manifest's; and
the drift report tells a moved target from a changed one, follows a class's bases
through its module's imports, and names what is gone."""

from __future__ import annotations

import dataclasses
import itertools
import textwrap
from pathlib import Path

from kvmem_sglang import manifest, manifest_locate, plugin
from kvmem_sglang.manifest_recorded import RECORDED, VERSION
from kvmem_sglang.options import Options

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "integration" / "sglang" / "README.md"


def test_every_target_is_in_the_installed_sglang_as_recorded():
    import importlib.metadata

    assert importlib.metadata.version("sglang") == VERSION == plugin.SGLANG_VERSION
    found = manifest_locate.record()
    assert set(found) == set(RECORDED) == set(manifest.surface())
    changed = {t: (RECORDED[t], found[t]) for t in found if found[t] != RECORDED[t]}
    assert not changed, changed


def test_the_plugin_builds_its_hooks_from_the_manifest_alone():
    base = Options.from_env()
    fields = ("staging", "transfer", "register_regions")
    for values in itertools.product((False, True), repeat=len(fields)):
        opts = dataclasses.replace(base, enabled=True, **dict(zip(fields, values)))
        want = [
            (h.target, h.kind) for h in manifest.HOOKS if h.when is None or getattr(opts, h.when)
        ]
        got = plugin._hooks(opts)
        assert [(t, k) for t, _, k in got] == want, values
    targets = [h.target for h in manifest.HOOKS]
    assert len(targets) == len(set(targets)), "one hook a target: a call reads top to bottom"
    for h in manifest.HOOKS:
        assert callable(manifest.hook_function(h)), h.hook
        assert h.kind in ("AROUND", "AFTER", "BEFORE", "REPLACE"), h
        assert h.when in (None, *fields), h


def test_the_readme_table_is_the_manifests():
    text = README.read_text()
    start, end = "<!-- manifest: python -m kvmem_sglang.manifest table -->", "<!-- /manifest -->"
    assert start in text and end in text
    table = text.split(start, 1)[1].split(end, 1)[0].strip()
    assert table == manifest_locate.table()


def _tree(root: Path, files: dict[str, str]) -> None:
    for rel, src in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(src))


def test_drift_tells_moved_changed_inherited_and_missing(tmp_path):
    common = "sglang.srt.disaggregation.common.conn"
    utils = "sglang.srt.disaggregation.utils.prepare_abort"
    _tree(
        tmp_path,
        {
            "sglang/srt/disaggregation/utils.py": """
            import os


            def prepare_abort(req, error_message, status_code=None):
                return req
            """,
            "sglang/srt/disaggregation/base/conn.py": """
            class BaseKVReceiver:
                def failure_exception(self):
                    raise RuntimeError("x")
            """,
            "sglang/srt/disaggregation/common/conn.py": """
            from sglang.srt.disaggregation.base.conn import BaseKVReceiver


            class CommonKVManager:
                def __init__(self):
                    self._staging_outstanding = {}

                def _room_notify_targets(self, room, extra):
                    return []


            class CommonKVReceiver(BaseKVReceiver):
                pass
            """,
        },
    )
    here = {
        t: manifest_locate.locate(t, w, root=tmp_path)
        for t, w in manifest.surface().items()
        if t
        in (
            utils,
            f"{common}.CommonKVReceiver.failure_exception",
            f"{common}.CommonKVManager._staging_outstanding",
            f"{common}.CommonKVManager._room_notify_targets",
        )
    }
    assert (
        here[f"{common}.CommonKVReceiver.failure_exception"].where
        == "sglang/srt/disaggregation/base/conn.py:3"
    )  # through the base class's import
    assert here[f"{common}.CommonKVManager._staging_outstanding"].signature == "attribute"
    recorded = {t: (f.where, f.signature, f.digest) for t, f in here.items()}
    moved = dict(recorded)
    moved[utils] = ("sglang/srt/disaggregation/utils.py:99",) + recorded[utils][1:]
    changed = dict(moved)
    t = f"{common}.CommonKVManager._room_notify_targets"
    changed[t] = (recorded[t][0], "(self, room)", recorded[t][2])
    t2 = f"{common}.CommonKVReceiver.failure_exception"
    changed[t2] = recorded[t2][:2] + ("0" * 16,)
    rows = {r["target"]: r for r in manifest_locate.drift(tmp_path, changed)}
    assert rows[utils]["status"] == "moved"
    assert rows[t]["status"] == "signature" and rows[t2]["status"] == "body"
    assert rows[f"{common}.CommonKVManager._staging_outstanding"]["status"] == "same"
    gone = rows[f"{common}.CommonKVSender.abort"]
    assert gone["status"] == "missing" and "CommonKVSender" in gone["why"]
    assert rows["sglang.srt.managers.scheduler.Scheduler.abort_request"]["status"] == "missing"


def test_the_drift_counts_the_docs_quote_are_the_reports():
    """The adapter's README and docs/sglang.md quote the 0.5.22 drift report's counts; they
    are the counts its summary line gives (bench/results/sglang-0.5.22-drift.txt)."""
    import re

    report = (ROOT / "bench" / "results" / "sglang-0.5.22-drift.txt").read_text().splitlines()
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (\w+)", report[2])}
    assert set(counts) == {"body", "missing", "moved", "same", "signature"}, report[2]
    total = sum(counts.values())
    readme = " ".join(README.read_text().split())
    docs = " ".join((ROOT / "docs" / "sglang.md").read_text().split())
    assert (
        f"{counts['same']} same, {counts['moved']} moved, {counts['body']} changed in body, "
        f"{counts['signature']} in signature, {counts['missing']} missing" in readme
    )
    assert f"the {total} targets" in readme
    assert (
        f"of {total} targets, {counts['same']} are the same, {counts['moved']} only moved, "
        f"{counts['body']} changed in body, {counts['signature']} in signature, "
        f"{counts['missing']} are missing" in docs
    )
