"""The documentation's links resolve inside the repository.

Checks every Markdown file under docs/, the top-level README.md and the contract's README: each
relative link `[text](target)` names a file or folder that exists, and its `#anchor` (if any) a
heading of the target (GitHub's slugs); each `docs/....md` path mentioned in the text exists; and
nothing points outside the repository (a reader has only the repository). Code that names a
document (`docs/runtime.md, "Preprocessing"` in a docstring) names one that exists.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
DOC_PATH = re.compile(r"(?<![\w./-])(docs/[\w./-]*\.md)\b")
OUTSIDE = re.compile(r"\.\./shared|/work/|\.library")
FENCE = re.compile(r"^\s*(```|~~~)")


def _documents() -> list[Path]:
    docs = sorted((ROOT / "docs").rglob("*.md"))
    return [ROOT / "README.md", ROOT / "proto/epd/v1/README.md", *docs]


def _prose(path: Path) -> list[str]:
    """The file's lines outside fenced code blocks."""
    lines, fenced = [], False
    for line in path.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = heading.strip().lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    anchors = set()
    for line in _prose(path):
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        slug = _slug(match.group(1))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def _problems(path: Path, root: Path = ROOT) -> list[str]:
    problems = []
    for number, line in enumerate(_prose(path), start=1):
        where = f"{path.name}:{number}"
        if OUTSIDE.search(line):
            problems.append(f"{where}: points outside the repository: {line.strip()}")
        for match in LINK.finditer(line):
            target = match.group(1) or match.group(2)
            if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
                continue
            file_part, _, anchor = target.partition("#")
            resolved = (path.parent / file_part).resolve() if file_part else path
            if not resolved.exists():
                problems.append(f"{where}: link to a missing file: {target}")
            elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
                problems.append(f"{where}: link to a missing heading: {target}")
        for mention in DOC_PATH.findall(line):
            if not (root / mention).exists():
                problems.append(f"{where}: mentions a missing document: {mention}")
    return problems


def test_every_link_resolves() -> None:
    problems = [f"{path.parent.relative_to(ROOT)}/{problem}" for path in _documents() for problem in _problems(path)]
    assert not problems, "\n".join(problems)


CODE_DIRS = ("libs", "services", "tests", "proto", "deploy")


def test_documents_named_in_code_exist() -> None:
    here = Path(__file__).resolve()  # this module names broken documents on purpose
    sources = [ROOT / "Makefile"] + [p for d in CODE_DIRS for p in sorted((ROOT / d).rglob("*.py")) if p != here]
    missing = [
        f"{path.relative_to(ROOT)}: {mention}"
        for path in sources
        for mention in DOC_PATH.findall(path.read_text(encoding="utf-8"))
        if not (ROOT / mention).exists()
    ]
    assert not missing, "\n".join(missing)


def test_the_checker_finds_what_is_broken(tmp_path: Path) -> None:
    (tmp_path / "there.md").write_text("# A heading (`with/code`)\n", encoding="utf-8")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](there.md#a-heading-withcode) [gone](nowhere.md) [bad](there.md#nope) docs/nowhere.md\n"
        "```\n[fenced](fenced.md)\n```\nsee ../shared/x\n",
        encoding="utf-8",
    )
    problems = _problems(page, root=tmp_path)
    assert len(problems) == 4, problems
    assert [p.split(": ")[1] for p in problems] == [
        "link to a missing file",
        "link to a missing heading",
        "mentions a missing document",
        "points outside the repository",
    ]
