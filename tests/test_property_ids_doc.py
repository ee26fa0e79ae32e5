"""The README's list of property IDs: the one list of IDs kept by hand apart from the catalogue,
and the guard of their stability.

Property IDs are a public contract (never renamed, never reused). The README's list is what a
user reads and relies on, so it is also the stability list: an ID it lists must stay in the
catalogue (renaming or dropping one fails here, unless the public list is edited too, the
deliberate act a guard asks for), and it lists every ID of the catalogue, in order (a new ID is
listed, and so guarded, when it is added). Every other list of IDs derives from the catalogue
(`PROPERTY_IDS`, `BY_ID`); tests name the few IDs they are about.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pipemetrics.properties.catalogue import BY_ID, CATALOGUE, PROPERTY_IDS, STRICT_ONLY

#: Runs with megatron-core unreachable (ci/test.sh); the oldest release's leg leaves it out.
pytestmark = pytest.mark.release_independent

README = Path(__file__).resolve().parent.parent / "README.md"
ID = re.compile(r"`([a-z_]+\.[a-z_]+)`( \(strict only\))?")  # IDs: one dot, nothing else


def _listed() -> list[tuple[str, bool]]:
    """The README's IDs in order, each with whether it is marked ``(strict only)``."""
    text = README.read_text(encoding="utf-8")
    section = text.split("### Property IDs", 1)[1].split("\n#", 1)[0]
    return [(name, bool(strict)) for name, strict in ID.findall(section)]


def test_no_listed_id_is_renamed_or_dropped() -> None:
    gone = [name for name, _ in _listed() if name not in BY_ID]
    assert not gone, (
        f"property IDs the README promises are gone from the catalogue: {gone}; IDs are never "
        "renamed or dropped: keep the old ID"
    )


def test_the_readme_lists_every_property_id_of_the_catalogue_in_order() -> None:
    assert [name for name, _ in _listed()] == list(PROPERTY_IDS), (
        "list each new property ID in the README, in the catalogue's order"
    )


def test_the_readme_marks_exactly_the_strict_only_ids() -> None:
    assert {name for name, strict in _listed() if strict} == {
        p.id for p in CATALOGUE if p.profiles == STRICT_ONLY
    }


def test_every_id_is_one_property() -> None:
    assert len(BY_ID) == len(CATALOGUE), "two properties share an ID"
