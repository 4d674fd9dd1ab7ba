"""The documentation's cross-references resolve.

Code comments cite the design as ``design.md §N``; those must name a numbered section of
docs/design.md (headings ``## N. Title``). Markdown links from README.md and docs/ to files of
the repository, and paths under docs/ named in the Python source, must point at files that
exist. Both rot silently when a section is renumbered or
a file moves, so they are checked here rather than by review.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DESIGN = ROOT / "docs" / "design.md"
SOURCE_PACKAGES = tuple(
    tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["root_packages"])

SECTION_HEADING = re.compile(r"^## (\d+)\. \S", re.MULTILINE)
# "design.md §7", "design.md §9-§10", "design.md §2 and §7"; a reference may wrap onto the next
# comment line, so whitespace (newline and "#" included) may sit between "design.md" and "§".
REFERENCE = re.compile(r"design\.md[\s#]*((?:§\d+(?:\s*(?:-|\u2013|and|,)\s*)?)+)")
SECTION_NUMBER = re.compile(r"§(\d+)")
# [text](target) with a target that is not a URL; an optional "#anchor" is dropped.
MARKDOWN_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
# A markdown file under docs/ named in Python source (a decision record, a measurement).
DOC_PATH = re.compile(r"\bdocs/[\w./-]+\.md\b")


def design_sections() -> set[int]:
    return {int(n) for n in SECTION_HEADING.findall(DESIGN.read_text(encoding="utf-8"))}


def design_references() -> list[tuple[str, int]]:
    """(file:line, section) for every ``design.md §N`` in the packages' Python source."""
    found: list[tuple[str, int]] = []
    for package in SOURCE_PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            text = path.read_text(encoding="utf-8")
            for match in REFERENCE.finditer(text):
                line = text.count("\n", 0, match.start()) + 1
                where = f"{path.relative_to(ROOT)}:{line}"
                found.extend((where, int(n)) for n in SECTION_NUMBER.findall(match.group(1)))
    return found


def markdown_files() -> list[Path]:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    for package in SOURCE_PACKAGES:
        files.extend(sorted((ROOT / package).rglob("README.md")))
    return files


def test_design_has_numbered_sections() -> None:
    sections = design_sections()
    assert sections, f"no '## N. Title' headings in {DESIGN}"
    assert sorted(sections) == list(range(1, max(sections) + 1)), sorted(sections)


def test_every_design_reference_names_an_existing_section() -> None:
    sections = design_sections()
    references = design_references()
    assert references, "found no design.md references at all: is the pattern still right?"
    missing = [f"{where}: §{n}" for where, n in references if n not in sections]
    assert not missing, f"sections missing from docs/design.md: {missing}"


def test_relative_markdown_links_resolve() -> None:
    broken = []
    for doc in markdown_files():
        for target in MARKDOWN_LINK.findall(doc.read_text(encoding="utf-8")):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                continue  # a URL (http:, mailto:, ...) or an anchor in the same page
            path = target.split("#", 1)[0]
            if not (doc.parent / path).exists():
                broken.append(f"{doc.relative_to(ROOT)} -> {target}")
    assert not broken, f"links to missing files: {broken}"


def test_doc_paths_named_in_source_exist() -> None:
    missing = []
    for package in (*SOURCE_PACKAGES, "tests"):
        for path in sorted((ROOT / package).rglob("*.py")):
            for doc in DOC_PATH.findall(path.read_text(encoding="utf-8")):
                if not (ROOT / doc).exists():
                    missing.append(f"{path.relative_to(ROOT)} -> {doc}")
    assert not missing, f"documentation files named in the source do not exist: {missing}"
