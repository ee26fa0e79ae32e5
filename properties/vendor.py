"""The vendored reference: the file ``pipemetrics vendor DEST`` writes and ``pipemetrics vendor
--check FILE`` compares against (the command itself is `pipemetrics.commands.vendor`).

The file is the text of ``pipemetrics/reference/megatron_common.py`` unchanged, behind a header
comment that names the pipemetrics version, the sha256 of the reference text, the megatron-core
range the reference is tested against, the command that regenerates the file and the command
that checks it has not drifted (no date, so regenerating an unchanged reference gives a
byte-identical file). ``--check`` reads the destination the header declares, writes the text
``vendor`` would write for it in memory and compares: exit 0 when identical, 1 on drift (the
first differing line, both texts, and whether the copy was edited or comes from another
reference), 2 when the file cannot be read or has no vendored header. Nothing here imports torch
or megatron-core.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import os
from importlib import metadata
from pathlib import Path
from typing import NamedTuple

MODULE_FILE = "megatron_common.py"
_FIRST_LINE = "# Vendored from pipemetrics "
_DIGEST_LINE = "# Reference sha256: "
_REGENERATE_LINE = "#     pipemetrics vendor "


def reference_path() -> Path:
    """Where the installed ``pipemetrics.reference.megatron_common`` lives, without importing it."""
    spec = importlib.util.find_spec("pipemetrics.reference")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("pipemetrics.reference is not installed")
    for location in spec.submodule_search_locations:
        candidate = Path(location) / MODULE_FILE
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"{MODULE_FILE} not found in pipemetrics.reference")


def supported_range(source: str) -> str:
    """The value of ``SUPPORTED_MEGATRON_CORE`` in the reference source."""
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = [t.id for t in targets if isinstance(t, ast.Name)]
            if "SUPPORTED_MEGATRON_CORE" in names and isinstance(node.value, ast.Constant):
                return str(node.value.value)
    raise ValueError("the reference defines no SUPPORTED_MEGATRON_CORE")


def pipemetrics_version() -> str:
    try:
        return metadata.version("pipemetrics")
    except metadata.PackageNotFoundError:
        return "unknown"


def source_digest(source: str) -> str:
    """sha256 of the reference text (UTF-8), as the header states it."""
    return hashlib.sha256(source.encode("utf-8")).hexdigest()


def header(shown_dest: str, *, version: str, digest: str, megatron_range: str) -> str:
    lines = [
        f"{_FIRST_LINE}{version}: pipemetrics.reference.megatron_common.",
        f"{_DIGEST_LINE}{digest}",
        f"# Tested against megatron-core {megatron_range}. Under another release it warns once",
        "# (UntestedMegatronCoreWarning) and carries on when every megatron-core API it uses is",
        "# present; it raises UnsupportedMegatronCoreError, naming the API, when one is missing.",
        "# Do not edit by hand. Regenerate with:",
        f"{_REGENERATE_LINE}{shown_dest}",
        "# check that this copy has not drifted (exit 1 names the first differing line) with:",
        f"{_REGENERATE_LINE}--check {shown_dest}",
        "# and check its behaviour with:",
        f"#     pipemetrics check --impl {shown_dest}",
    ]
    return "\n".join(lines) + "\n"


def shown_path(path: Path) -> str:
    """``path`` relative to the working directory when it lies below it, else absolute."""
    absolute = path.absolute()
    try:
        return absolute.relative_to(Path.cwd()).as_posix()
    except ValueError:
        return str(absolute)


def resolve_dest(dest: str) -> Path:
    """DEST as a file path: an existing directory (or one named with a trailing slash) gets
    ``megatron_common.py`` inside it. Raises ``FileNotFoundError`` when the parent is missing."""
    path = Path(dest)
    if path.is_dir():
        return path / MODULE_FILE
    if dest.endswith(("/", os.sep)):
        raise FileNotFoundError(f"directory {dest} does not exist")
    if not path.absolute().parent.is_dir():
        raise FileNotFoundError(f"directory {path.absolute().parent} does not exist")
    return path


def vendored_text(shown_dest: str) -> str:
    source = reference_path().read_text(encoding="utf-8")
    return (
        header(
            shown_dest,
            version=pipemetrics_version(),
            digest=source_digest(source),
            megatron_range=supported_range(source),
        )
        + source
    )


_CHECK_IMPL_LINE = "#     pipemetrics check --impl "


class VendoredHeader(NamedTuple):
    """What a vendored file's header declares (``None``: that line is missing or edited)."""

    version: str | None
    digest: str | None
    dest: str | None
    length: int  # lines of the header: the reference text starts after them


def read_header(text: str) -> VendoredHeader:
    """The header ``vendor`` wrote at the top of ``text``, read so that one edited line still
    leaves it recognisable (its first line, its sha256 line and three lines naming the
    destination are each enough); ``ValueError`` when ``text`` has none of them."""
    version = digest = None
    dests: dict[str, str] = {}
    length = 0
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.startswith("#"):
            break
        length = number
        if number == 1 and line.startswith(_FIRST_LINE):
            version = line.removeprefix(_FIRST_LINE).split(":", 1)[0]
        elif line.startswith(_DIGEST_LINE):
            digest = line.removeprefix(_DIGEST_LINE).strip()
        elif line.startswith(f"{_REGENERATE_LINE}--check "):
            dests.setdefault("check", line.removeprefix(f"{_REGENERATE_LINE}--check ").strip())
        elif line.startswith(_REGENERATE_LINE):
            dests.setdefault("vendor", line.removeprefix(_REGENERATE_LINE).strip())
        elif line.startswith(_CHECK_IMPL_LINE):
            dests.setdefault("impl", line.removeprefix(_CHECK_IMPL_LINE).strip())
    dest = next((dests[k] for k in ("vendor", "check", "impl") if k in dests), None)
    if version is None and digest is None and dest is None:
        raise ValueError("no header written by `pipemetrics vendor` at the top of the file")
    return VendoredHeader(version=version, digest=digest, dest=dest, length=length)


def first_difference(actual: str, expected: str) -> tuple[int, str, str] | None:
    """The first line (1-based) where the two texts differ, with both lines (``<end of file>``
    past the end of one); ``None`` when the texts are identical."""
    if actual == expected:
        return None
    ours, theirs = actual.splitlines(keepends=True), expected.splitlines(keepends=True)
    for number in range(1, max(len(ours), len(theirs)) + 1):
        a = ours[number - 1] if number <= len(ours) else "<end of file>"
        b = theirs[number - 1] if number <= len(theirs) else "<end of file>"
        if a != b:
            return number, a, b
    raise AssertionError("unreachable: different texts with the same lines")
