"""The README's list of property IDs is the catalogue's, in its order (no list of IDs is kept by
hand apart from the catalogue: this test holds the one a user reads)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pipemetrics.properties.catalogue import PROPERTY_IDS

#: Runs with megatron-core unreachable (ci/test.sh); the oldest release's leg leaves it out.
pytestmark = pytest.mark.release_independent

README = Path(__file__).resolve().parent.parent / "README.md"


def test_the_readme_lists_every_property_id_of_the_catalogue_in_order() -> None:
    text = README.read_text(encoding="utf-8")
    section = text.split("### Property IDs", 1)[1].split("\n#", 1)[0]
    listed = re.findall(r"`([a-z_]+\.[a-z_]+)`", section)  # IDs: one dot, nothing else
    assert listed == list(PROPERTY_IDS)
