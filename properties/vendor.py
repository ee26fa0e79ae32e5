"""``pipemetrics vendor DEST`` (being written)."""

from __future__ import annotations


def vendor_main(dest: str) -> int:
    raise SystemExit("pipemetrics vendor: not implemented yet")
