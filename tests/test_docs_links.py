"""Every relative link in README.md, ARCHITECTURE.md and docs/ goes where it says: the file
exists and, with an anchor, the file has a heading of that anchor (GitHub's slugs); and where its
label names a file, a folder, the README or a page's title, it goes there."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

#: Runs with megatron-core unreachable (ci/test.sh); the oldest release's leg leaves it out.
pytestmark = pytest.mark.release_independent

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted([ROOT / "README.md", ROOT / "ARCHITECTURE.md", *(ROOT / "docs").rglob("*.md")])
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text(encoding="utf-8"))
    return {slug(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", text, re.M)}


def links(page: Path) -> list[str]:
    text = FENCE.sub("", page.read_text(encoding="utf-8"))
    return [
        target
        for target in LINK.findall(text)
        if not re.match(r"[a-z][a-z0-9+.-]*:", target)  # http:, mailto: ...
    ]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    broken = []
    for target in links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no file {dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.name}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_the_slugs_are_githubs() -> None:
    assert slug("Where the reference deliberately differs from the seed API") == (
        "where-the-reference-deliberately-differs-from-the-seed-api"
    )
    assert slug("The `pipemetrics` command") == "the-pipemetrics-command"


LABELLED = re.compile(r"(?<!!)\[([^\]]*)\]\(([^)\s]+)\)")
TITLE = re.compile(r"\A#\s+(.*)$", re.M)


def labelled_links(page: Path) -> list[tuple[str, Path]]:
    """(label, destination file) of every relative link of ``page``."""
    text = FENCE.sub("", page.read_text(encoding="utf-8"))
    found = []
    for label, target in LABELLED.findall(text):
        path = target.partition("#")[0]
        if not re.match(r"[a-z][a-z0-9+.-]*:", target):
            found.append((label, (page.parent / path).resolve() if path else page))
    return found


def label_mismatch(label: str, dest: Path, page: Path, titles: dict[str, Path]) -> str | None:
    """Why a link labelled ``label`` must not go to ``dest``, or None: a label that is a path
    (``docs/cli.md``, ``prove.md``, ``docs/upstream/``) names the file or folder it goes to; a
    label naming the README goes to a README; a label that is a page's title goes to that page."""
    text = label.strip().strip("`")
    if re.fullmatch(r"[\w.-]+(/[\w.-]*)*", text) and ("/" in text or re.search(r"\.\w+$", text)):
        named = [(ROOT / text).resolve(), (page.parent / text).resolve()]
        if not any(dest == n or (text.endswith("/") and n in dest.parents) for n in named):
            return f"[{label}] names {text}, goes to {dest.relative_to(ROOT)}"
    if "readme" in text.lower() and dest.name != "README.md":
        return f"[{label}] names the README, goes to {dest.relative_to(ROOT)}"
    titled = titles.get(text.lower())
    if titled is not None and dest != titled:
        return f"[{label}] is the title of {titled.relative_to(ROOT)}, goes to {dest.relative_to(ROOT)}"
    return None


def titles() -> dict[str, Path]:
    """Each page's title (its first-line heading), lower case, without backticks."""
    found = {}
    for page in PAGES:
        match = TITLE.search(page.read_text(encoding="utf-8"))
        if match:
            found[match.group(1).replace("`", "").strip().lower()] = page
    return found


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_goes_where_its_label_says(page: Path) -> None:
    known = titles()
    wrong = [
        problem
        for label, dest in labelled_links(page)
        if (problem := label_mismatch(label, dest, page, known)) is not None
    ]
    assert not wrong, f"{page.relative_to(ROOT)}: " + "; ".join(wrong)


def test_a_label_that_says_otherwise_is_caught() -> None:
    page = ROOT / "docs" / "migration.md"
    known = titles()
    reference = ROOT / "docs" / "reference.md"
    assert label_mismatch("the README's list", reference, page, known)
    assert label_mismatch("docs/cli.md", reference, page, known)
    assert label_mismatch("The in-process tier", reference, page, known)
    assert label_mismatch("docs/upstream/", reference, page, known)
    assert (
        label_mismatch("docs/upstream/", ROOT / "docs" / "upstream" / "README.md", page, known)
        is None
    )
    assert label_mismatch("the reference", reference, page, known) is None
