"""ARCHITECTURE.md's module tables match the tree: every module of a package is in its table,
and every module a table names exists.

A package with a section ``## DIR/: ...`` holds a table whose first column names its modules
(`` `a.py` ``, or several: `` `a.py`, `b.py` ``); every other package (one or two modules) is
described in the folder table at the top, which must name each of its modules.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

#: Runs with megatron-core unreachable (ci/test.sh); the oldest release's leg leaves it out.
pytestmark = pytest.mark.release_independent

ROOT = Path(__file__).resolve().parent.parent
ARCHITECTURE = ROOT / "ARCHITECTURE.md"
SECTION = re.compile(r"^## (\w+)/: ", re.MULTILINE)
MODULE = re.compile(r"`(\w+\.py)`")
NESTED = re.compile(r"`(?:\w+/)*(\w+\.py)`")
"""A module named with its subpackage's path, as a subpackage's rows name theirs."""


def packages() -> list[str]:
    """The folders pyproject.toml installs under ``pipemetrics``."""
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    block = text.split("[tool.setuptools.package-dir]", 1)[1].split("\n[", 1)[0]
    return sorted(re.findall(r'^"pipemetrics\.[\w.]+" = "([\w/]+)"$', block, re.MULTILINE))


def modules(folder: str) -> set[str]:
    return {p.name for p in (ROOT / folder).glob("*.py") if p.name != "__init__.py"}


def tables_rows(folder: str) -> list[str]:
    """The rows of ``folder``'s module table."""
    text = ARCHITECTURE.read_text(encoding="utf-8")
    for match in SECTION.finditer(text):
        if match.group(1) == folder:
            body = text[match.end() :].split("\n## ", 1)[0]
            return [line for line in body.splitlines() if line.startswith("| `")]
    return []


def tables() -> dict[str, set[str]]:
    """Each sectioned package's module table: the names in its rows' first column."""
    text = ARCHITECTURE.read_text(encoding="utf-8")
    found: dict[str, set[str]] = {}
    for match in SECTION.finditer(text):
        body = text[match.end() :].split("\n## ", 1)[0]
        rows = [line for line in body.splitlines() if line.startswith("| `")]
        found[match.group(1)] = {m for row in rows for m in MODULE.findall(row.split(" | ")[0])}
    return found


def folder_row(folder: str) -> str:
    text = ARCHITECTURE.read_text(encoding="utf-8")
    rows = [line for line in text.splitlines() if line.startswith(f"| `{folder}/` |")]
    assert rows, f"ARCHITECTURE.md's folder table has no row for {folder}/"
    return rows[0]


def test_every_installed_package_is_in_the_folder_table() -> None:
    assert packages(), "no package found in pyproject.toml"
    for folder in packages():
        if "/" not in folder:
            folder_row(folder)


@pytest.mark.parametrize("folder", packages())
def test_the_module_table_matches_the_package(folder: str) -> None:
    present = modules(folder)
    if "/" in folder:  # a subpackage: its row in the parent's table names each of its modules
        parent, name = folder.split("/", 1)
        rows = [r for r in tables_rows(parent) if r.startswith(f"| `{name}/")]
        assert rows, f"ARCHITECTURE.md's {parent}/ table has no row for {name}/"
        named = {m for r in rows for m in NESTED.findall(r)}
        assert not present - named, f"{folder}/ modules not named in its row: {present - named}"
        return
    table = tables().get(folder)
    if table is None:
        named = set(MODULE.findall(folder_row(folder)))
        missing = present - named
        assert not missing, (
            f"{folder}/ modules not named in ARCHITECTURE.md's folder table: {missing}"
        )
        return
    assert not present - table, f"{folder}/ modules missing from its table: {present - table}"
    assert not table - present, (
        f"ARCHITECTURE.md's {folder}/ table names modules that do not exist: {table - present}"
    )


def layers_contracts() -> dict[str, list[str]]:
    """pyproject.toml's import-linter layers contracts: id -> layers, short names (the top
    level's without ``pipemetrics.``, a container's relative to it)."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    found: dict[str, list[str]] = {}
    for contract in config["tool"]["importlinter"]["contracts"]:
        if contract["type"] == "layers":
            found[contract["id"]] = [
                " | ".join(p.strip().removeprefix("pipemetrics.") for p in layer.split("|"))
                for layer in contract["layers"]
            ]
    return found


def test_the_layers_section_states_the_import_contracts() -> None:
    """ARCHITECTURE.md's Layers section names each layers contract's layers, in order."""
    text = ARCHITECTURE.read_text(encoding="utf-8")
    body = text.split("\n## Layers\n", 1)[1].split("\n## ", 1)[0]
    stated = [
        [layer.strip("` ") for layer in line.split(": ", 1)[1].split(" > ")]
        for line in body.splitlines()
        if line.startswith("- ")
    ]
    assert sorted(stated) == sorted(layers_contracts().values())
