"""Which properties run: ``--only`` IDs, skip and xfail lists kept in an adopter's repository.

A list file holds one property ID per line; ``#`` starts a comment. IDs that are not (or no
longer) in the catalogue produce a warning, never an error, so an adopter's list survives the
suite growing. A trailing ``.*`` or a bare family (``moe``) selects a whole family.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pipemetrics.properties.catalogue import CATALOGUE, SEMANTIC_PROFILES, Property
from pipemetrics.properties.effort import Semantic


def read_id_list(path: str | Path) -> list[str]:
    """The IDs of a list file (comments and blank lines dropped)."""
    ids = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        text = line.split("#", 1)[0].strip()
        if text:
            ids.append(text)
    return ids


def expand(pattern: str, catalogue: Sequence[Property] = CATALOGUE) -> list[str]:
    """Property IDs of ``catalogue`` matched by an ID, ``family.*`` or a bare family name."""
    ids = [p.id for p in catalogue]
    if pattern in ids:
        return [pattern]
    family = pattern.removesuffix(".*")
    return [pid for pid in ids if pid.split(".")[0] == family]


@dataclass
class Selection:
    properties: list[Property]
    skip: set[str] = field(default_factory=set)
    xfail: set[str] = field(default_factory=set)
    warnings: list[str] = field(default_factory=list)


class SelectionError(ValueError):
    """An ``--only`` ID that matches nothing (a usage error)."""


def _matched(
    ids: list[str], source: str, warnings: list[str], catalogue: Sequence[Property]
) -> set[str]:
    found: set[str] = set()
    for pid in ids:
        hits = expand(pid, catalogue)
        if not hits:
            warnings.append(f"{source}: {pid!r} is not a pipemetrics property ID (any more)")
        found.update(hits)
    return found


def named(only: list[str] | None, catalogue: Sequence[Property] = CATALOGUE) -> list[Property]:
    """The properties of ``catalogue`` that ``only``'s IDs and families match (all of them
    without ``only``), in its order; an ID that matches nothing is a `SelectionError`."""
    if not only:
        return list(catalogue)
    unknown = [pid for pid in only if not expand(pid, catalogue)]
    if unknown:
        known = ", ".join(p.id for p in catalogue)
        raise SelectionError(f"--only: unknown property IDs {unknown}; known: {known}")
    wanted = {hit for pid in only for hit in expand(pid, catalogue)}
    return [p for p in catalogue if p.id in wanted]


def select(
    only: list[str] | None = None,
    skip_file: str | None = None,
    xfail_file: str | None = None,
    *,
    profile: Semantic = "seed",
    catalogue: Sequence[Property] = CATALOGUE,
) -> Selection:
    """The properties of ``profile`` to run (``--only`` narrows them), with the skip and xfail
    lists. An ``--only`` ID of another profile is a `SelectionError` naming its profiles."""
    warnings: list[str] = []
    chosen = [p.id for p in catalogue if profile in p.profiles]
    if only:
        wanted = named(only, catalogue)
        elsewhere = [p for p in wanted if p.id not in chosen]
        if elsewhere:
            profiles = sorted({sem for p in elsewhere for sem in p.profiles})
            text = (
                f"--only: {', '.join(sorted(p.id for p in elsewhere))} not part of the "
                f"{profile} profile (use --profile {' or '.join(profiles)})"
            )
            if len(elsewhere) == len(wanted):
                raise SelectionError(text)
            warnings.append(text)
        chosen = [p.id for p in wanted if p.id in chosen]
    skip, xfail = (
        _matched(read_id_list(path), f"{what} list {path}", warnings, catalogue) if path else set()
        for what, path in (("skip", skip_file), ("xfail", xfail_file))
    )
    props = [p for p in catalogue if p.id in chosen]
    return Selection(props, skip, xfail, warnings)


def listing(properties: Sequence[Property]) -> str:
    """One line per property, in the order given: its ID, the API functions it calls, its
    semantic profiles and what it enforces (``pipemetrics check --list``)."""
    rows = [
        (
            p.id,
            "+".join(p.functions),
            ",".join(s for s in SEMANTIC_PROFILES if s in p.profiles),
            p.summary,
        )
        for p in properties
    ]
    widths = [max((len(row[i]) for row in rows), default=0) for i in range(3)]
    return "".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row[:3], widths, strict=True))
        + f"  {row[3]}\n"
        for row in rows
    )
