"""Which properties run: ``--only`` IDs, skip and xfail lists kept in an adopter's repository.

A list file holds one property ID per line; ``#`` starts a comment. IDs that are not (or no
longer) in the catalogue produce a warning, never an error, so an adopter's list survives the
suite growing. A trailing ``.*`` or a bare family (``moe``) selects a whole family.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from pipemetrics.properties.catalogue import BY_ID, CATALOGUE, PROPERTY_IDS, Property
from pipemetrics.properties.effort import Semantic


def read_id_list(path: str | Path) -> list[str]:
    """The IDs of a list file (comments and blank lines dropped)."""
    ids = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        text = line.split("#", 1)[0].strip()
        if text:
            ids.append(text)
    return ids


def expand(pattern: str) -> list[str]:
    """Property IDs matched by an ID, ``family.*`` or a bare family name."""
    if pattern in PROPERTY_IDS:
        return [pattern]
    family = pattern.removesuffix(".*")
    return [pid for pid in PROPERTY_IDS if pid.split(".")[0] == family]


@dataclass
class Selection:
    properties: list[Property]
    skip: set[str] = field(default_factory=set)
    xfail: set[str] = field(default_factory=set)
    warnings: list[str] = field(default_factory=list)


class SelectionError(ValueError):
    """An ``--only`` ID that matches nothing (a usage error)."""


def _matched(ids: list[str], source: str, warnings: list[str]) -> set[str]:
    found: set[str] = set()
    for pid in ids:
        hits = expand(pid)
        if not hits:
            warnings.append(f"{source}: {pid!r} is not a pipemetrics property ID (any more)")
        found.update(hits)
    return found


def select(
    only: list[str] | None = None,
    skip_file: str | None = None,
    xfail_file: str | None = None,
    *,
    profile: Semantic = "seed",
) -> Selection:
    """The properties of ``profile`` to run (``--only`` narrows them), with the skip and xfail
    lists. An ``--only`` ID of another profile is a `SelectionError` naming its profiles."""
    warnings: list[str] = []
    chosen = [p.id for p in CATALOGUE if profile in p.profiles]
    if only:
        unknown = [pid for pid in only if not expand(pid)]
        if unknown:
            raise SelectionError(
                f"--only: unknown property IDs {unknown}; known: {', '.join(PROPERTY_IDS)}"
            )
        wanted = {hit for pid in only for hit in expand(pid)}
        elsewhere = sorted(pid for pid in wanted if pid not in chosen)
        if elsewhere:
            profiles = sorted({sem for pid in elsewhere for sem in BY_ID[pid].profiles})
            text = (
                f"--only: {', '.join(elsewhere)} not part of the {profile} profile "
                f"(use --profile {' or '.join(profiles)})"
            )
            if not wanted & set(chosen):
                raise SelectionError(text)
            warnings.append(text)
        chosen = [pid for pid in chosen if pid in wanted]
    skip, xfail = (
        _matched(read_id_list(path), f"{what} list {path}", warnings) if path else set()
        for what, path in (("skip", skip_file), ("xfail", xfail_file))
    )
    props = [p for p in CATALOGUE if p.id in chosen]
    return Selection(props, skip, xfail, warnings)
