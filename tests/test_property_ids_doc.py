"""Property IDs: a public contract (never renamed, never dropped, never reused), guarded by the
IDs already published, not by a list kept beside the catalogue.

Where a user reads the IDs: ``pipemetrics check --list`` prints the catalogue's, in its order,
each with its functions, profiles and summary (the README's "Property IDs" says so, and its
snippet runs under tests/test_docs.py). Nothing lists them by hand: every other list of IDs
derives from the catalogue (`PROPERTY_IDS`, `BY_ID`, the combinations' and prove's), so adding
a property touches no list (tests/test_add_a_property.py).

What guards them: `PUBLISHED`, the file of the IDs pipemetrics has published, each under the
version that first shipped it (``# published with X.Y.Z``). Every published ID must stay in the
catalogue, so a rename or a drop fails here, unless the published file is edited too: the
deliberate act a guard asks for. Adding a property does not touch the file: a new ID is not
promised until a release publishes it, and until then it may still be renamed. A release
does: when pyproject.toml's version is not the newest one the file names, the check fails
and lists the catalogue's IDs not yet published, to append under a line for the new version.
What it cannot know: an ID added after a release and renamed before the next was never
published, so nothing is broken; and a release line written without appending the IDs the
failure listed would go unnoticed, which is why the failure lists them.
"""

from __future__ import annotations

import contextlib
import io
import re
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from pipemetrics.commands.check import run_check
from pipemetrics.commands.parser import build_parser
from pipemetrics.properties.catalogue import BY_ID, CATALOGUE, PROPERTY_IDS, Property

#: Runs with megatron-core unreachable (ci/test.sh); the oldest release's leg leaves it out.
pytestmark = pytest.mark.release_independent

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PUBLISHED = Path(__file__).resolve().parent / "published_property_ids.txt"
ID = re.compile(r"[a-z_]+\.[a-z_]+")  # IDs: one dot, nothing else
RELEASE = re.compile(r"#\s*published with (\S+)\s*$")


@dataclass(frozen=True)
class Published:
    """The published file read: each version's line and the IDs listed under it."""

    releases: tuple[tuple[str, tuple[str, ...]], ...]

    @property
    def ids(self) -> list[str]:
        return [pid for _, ids in self.releases for pid in ids]

    @property
    def newest(self) -> str | None:
        return self.releases[-1][0] if self.releases else None


def read_published(text: str) -> Published:
    releases: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        if found := RELEASE.match(line.strip()):
            releases.append((found.group(1), []))
            continue
        word = line.split("#", 1)[0].strip()
        if word:
            if not releases:
                raise ValueError(f"{word!r} before the first '# published with' line")
            releases[-1][1].append(word)
    return Published(tuple((version, tuple(ids)) for version, ids in releases))


def version() -> str:
    data = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    return str(data["project"]["version"])


def guard(catalogue: Sequence[Property], published: Published, current: str) -> list[str]:
    """What the guard refuses of ``catalogue`` against ``published`` at version ``current``:
    empty when every published ID is still in it (once, well formed) and the newest release
    line is ``current``'s."""
    ids = [p.id for p in catalogue]
    problems = []
    gone = [pid for pid in published.ids if pid not in ids]
    if gone:
        problems.append(
            f"published property IDs gone from the catalogue: {gone}; IDs are never renamed or "
            "dropped: keep the old ID"
        )
    twice = sorted({pid for pid in published.ids if published.ids.count(pid) > 1})
    malformed = [pid for pid in published.ids if not ID.fullmatch(pid)]
    if twice or malformed:
        problems.append(f"{PUBLISHED.name}: listed twice {twice}, malformed {malformed}")
    if published.newest != current:
        new = [pid for pid in ids if pid not in published.ids]
        problems.append(
            f"pyproject.toml's version is {current}, the newest release in {PUBLISHED.name} "
            f"{published.newest}: a release publishes its IDs; append '# published with "
            f"{current}' and under it {new}"
        )
    return problems


def test_no_published_id_is_renamed_or_dropped_and_the_release_is_current() -> None:
    published = read_published(PUBLISHED.read_text(encoding="utf-8"))
    assert published.ids, f"{PUBLISHED.name} lists no ID"
    assert guard(CATALOGUE, published, version()) == []


def test_the_guard_refuses_a_rename_a_drop_and_an_unpublished_release() -> None:
    """The guard can fail: on a catalogue whose published ID was renamed or dropped, and on a
    version no release line names (its message lists what to append)."""
    published = Published((("0.1.0", ("moe.values", "moe.names")),))
    renamed = [p if p.id != "moe.values" else replace(p, id="moe.value") for p in CATALOGUE]
    (problem,) = guard(renamed, published, "0.1.0")
    assert "['moe.values']" in problem
    dropped = [p for p in CATALOGUE if p.id != "moe.names"]
    assert "['moe.names']" in guard(dropped, published, "0.1.0")[0]
    (problem,) = guard(CATALOGUE, published, "0.2.0")
    assert "published with 0.2.0" in problem and "'moe.reset'" in problem
    assert "'moe.values'" not in problem


def test_the_published_file_is_read_by_release() -> None:
    text = "# a comment\n# published with 0.1.0\na.b\nc.d  # note\n\n# published with 0.2.0\ne.f\n"
    assert read_published(text).releases == (("0.1.0", ("a.b", "c.d")), ("0.2.0", ("e.f",)))
    with pytest.raises(ValueError, match="before the first"):
        read_published("a.b\n")


def test_list_prints_every_id_in_the_catalogues_order() -> None:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert run_check(build_parser().parse_args(["check", "--list"])) == 0
    lines = out.getvalue().splitlines()
    assert [line.split()[0] for line in lines] == list(PROPERTY_IDS)
    strict_only = next(p for p in CATALOGUE if p.profiles == {"strict"})
    assert lines[PROPERTY_IDS.index(strict_only.id)].split()[2] == "strict"


def test_the_readme_says_where_the_ids_are_and_what_guards_them() -> None:
    section = README.read_text(encoding="utf-8").split("### Property IDs", 1)[1].split("\n#", 1)
    assert "pipemetrics check --list" in section[0]
    assert f"tests/{PUBLISHED.name}" in section[0]


def test_every_id_is_one_property() -> None:
    assert len(BY_ID) == len(CATALOGUE), "two properties share an ID"
