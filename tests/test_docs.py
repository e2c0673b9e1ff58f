"""Every Python example in the documentation runs, so the documentation cannot rot.

The pages are ``docs/*.md`` and ``README.md``.  Each fenced block whose info string is
``python`` is an example; the blocks of one page run in order, in one namespace (a later
block may use what an earlier one made), on the CPU.  A block that cannot run here says
so in its info string, and is only compiled:

    ```python no-run     needs what a CPU test run does not have (a CUDA device, an
                         sglang server); compiled, never executed

Any other word after ``python`` is refused, so a misspelt marker cannot hide a block.
NIXL examples run: ``make test`` installs NIXL.  Besides the examples, the links of these
pages must name files of this repository that exist, and no tracked text file may point
into a directory outside it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
MARKERS = {"no-run"}
# ```python, ```python no-run, ...: the opening fence of a block and its info string.
_FENCE = re.compile(r"^(`{3,})\s*(\S*)\s*(.*?)\s*$")


def _name(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


def blocks(page: Path) -> list[tuple[int, str, set[str]]]:
    """``(first line number, code, markers)`` of every ```python block of ``page``."""
    out, lines = [], page.read_text().splitlines()
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, lang, rest = m.groups()
        j = i + 1
        while j < len(lines) and not lines[j].startswith(fence):
            j += 1
        if j == len(lines):
            raise AssertionError(f"{_name(page)}:{i + 1}: code fence never closed")
        if lang.lower() in ("py", "python3", "pycon") or (
            lang.lower() == "python" and set(rest.split()) - MARKERS
        ):
            raise AssertionError(
                f"{_name(page)}:{i + 1}: fence '{lines[i]}': write "
                f"```python, optionally followed by one of {sorted(MARKERS)}"
            )
        if lang == "python":
            out.append((i + 2, "\n".join(lines[i + 1 : j]) + "\n", set(rest.split())))
        i = j + 1
    return out


def _code(page: Path, line: int, code: str):
    # Leading newlines keep traceback line numbers equal to the page's own.
    return compile("\n" * (line - 1) + code, str(page), "exec")


def _example_params() -> list:
    """Every page; marked ``nixl`` where a runnable example makes a NixlEngine."""
    return [
        pytest.param(
            page,
            id=_name(page),
            marks=[pytest.mark.nixl]
            if any("NixlEngine(" in code for _, code, m in blocks(page) if "no-run" not in m)
            else [],
        )
        for page in PAGES
    ]


@pytest.mark.parametrize("page", _example_params())
def test_examples_run(page: Path):
    """The page's runnable blocks, in order, in one namespace; no-run blocks compile."""
    namespace = {"__name__": f"docs:{_name(page)}"}
    for line, code, markers in blocks(page):
        compiled = _code(page, line, code)
        if "no-run" not in markers:
            exec(compiled, namespace)  # noqa: S102 - the documented example itself


def test_every_page_counted():
    """The documentation has examples, most of them run, and every page has a title."""
    counts = {}
    for page in PAGES:
        bs = blocks(page)
        counts[_name(page)] = (
            sum("no-run" not in m for _, _, m in bs),
            sum("no-run" in m for _, _, m in bs),
        )
        assert page.read_text().startswith("# "), f"{_name(page)}: no title line"
    run = sum(r for r, _ in counts.values())
    skipped = sum(s for _, s in counts.values())
    print(f"\ndocumentation examples: {run} run, {skipped} no-run, by page: {counts}")
    assert counts["docs/api.md"][0] >= 10, counts
    assert run > 3 * skipped, f"most examples must run: {counts}"


_LINK = re.compile(r"\]\(([^)\s]+)\)")


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_links_stay_in_the_repository(page: Path):
    """Every relative link names an existing file or directory of this repository."""
    for target in _LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue  # a web address, or an anchor on the same page
        path = (page.parent / target.split("#")[0]).resolve()
        assert path.is_relative_to(ROOT), f"{_name(page)}: link {target} leaves the repository"
        assert path.exists(), f"{_name(page)}: link {target} names nothing"


def test_nothing_points_outside():
    """No file of the repository points at the ``shared`` directory beside it."""
    needle = "../" + "shared"  # split, so that this file does not match itself
    suffixes = {".md", ".py", ".toml", ".txt", ".sh", ".cfg", ".json", ".yml", ".yaml", ""}
    bad = []
    for top, dirs, files in os.walk(ROOT):
        # hidden directories (.git, .venv*, caches) and build output are not the repository
        dirs[:] = [
            d
            for d in dirs
            if not d.startswith(".")
            and d not in ("build", "dist", "__pycache__")
            and not d.endswith(".egg-info")
        ]
        for f in files:
            path = Path(top, f)
            if path.suffix not in suffixes:
                continue
            try:
                text = path.read_text()
            except (UnicodeDecodeError, OSError):
                continue
            if needle in text:
                bad.append(path.relative_to(ROOT).as_posix())
    assert not bad, f"files that point outside the repository: {bad}"


def test_every_quoted_figure_matches_its_results_file():
    """A figure quoted as ``<!-- fig:NAME -->`` is what bench/figures.py computes from its
    bench/results/ file now (``python -m bench.figures`` rewrites them after a new run)."""
    from bench import figures

    quoted = [name for page in figures.pages() for name, _ in figures.spans(page.read_text())]
    assert set(quoted) == set(figures.FIGURES), "a figure nobody quotes, or one not defined"
    assert figures.stale() == []


MEASURED = re.compile(r"\d(?:\.\d+)?\s?(?:GB/s|MB/s|µs|us\b|ms\b)|\b\d+\.\d+x\b")


def _prose_paragraphs(text: str) -> list[str]:
    """The page's paragraphs outside fenced code blocks, quoted figures taken out."""
    from bench import figures

    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    text = re.sub(r"(?:^(?: {4}|\t).*\n)+", "", text, flags=re.M)  # indented code: examples
    text = figures.SPAN.sub("FIG", text)
    return [p for p in re.split(r"\n\s*\n", text) if p.strip()]


def test_every_measured_figure_is_traced_to_a_results_file():
    """A measured figure in README or docs/ prose (GB/s, µs, ms, a ratio like 0.42x) is a
    quoted figure, or its paragraph names the bench/results/ file it was taken from."""
    from bench import figures

    untraced = []
    for page in figures.pages():
        for para in _prose_paragraphs(page.read_text()):
            if MEASURED.search(para) and "bench/results/" not in para:
                untraced.append(
                    f"{page.relative_to(ROOT)}: {MEASURED.findall(para)} in {para.strip()[:160]!r}"
                )
    assert untraced == [], "\n".join(untraced)


# What library code may not say: measured behaviour and history live in docs/ (which cites
# the results files), so a docstring or comment names a docs heading instead.
_LAB_NOTES = re.compile(r"bench/results/|\bissue \d|\bAbout [\d,]+ lines\b")


def test_library_code_cites_docs_not_results_or_history():
    """No file of kvmem/ or of the adapter's package cites a results file, an issue
    number or its own length."""
    found = []
    for top in (ROOT / "kvmem", ROOT / "integration" / "sglang" / "kvmem_sglang"):
        for path in sorted(top.rglob("*.py")):
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if _LAB_NOTES.search(line):
                    found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert found == [], "\n".join(found)
