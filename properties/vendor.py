"""``pipemetrics vendor DEST``: write the reference as one self-contained file to copy into a tree.

The file is the text of ``pipemetrics/reference/megatron_common.py`` unchanged, behind a header
comment that names the pipemetrics version, the megatron-core range the reference is tested
against, and the command that regenerates the file (no date, so regenerating an unchanged
reference gives a byte-identical file). Nothing here imports torch or megatron-core.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import sys
from importlib import metadata
from pathlib import Path

MODULE_FILE = "megatron_common.py"
_EXIT_OK = 0
_EXIT_USAGE = 2


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


def header(shown_dest: str, *, version: str, megatron_range: str) -> str:
    lines = [
        f"# Vendored from pipemetrics {version}: pipemetrics.reference.megatron_common.",
        f"# Tested against megatron-core {megatron_range}. Under another release it warns once",
        "# (UntestedMegatronCoreWarning) and carries on when every megatron-core API it uses is",
        "# present; it raises UnsupportedMegatronCoreError, naming the API, when one is missing.",
        "# Do not edit by hand. Regenerate with:",
        f"#     pipemetrics vendor {shown_dest}",
        "# and check this copy with:",
        f"#     pipemetrics check --impl {shown_dest}",
    ]
    return "\n".join(lines) + "\n"


def _shown(path: Path) -> str:
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
        header(shown_dest, version=pipemetrics_version(), megatron_range=supported_range(source))
        + source
    )


def vendor_main(dest: str) -> int:
    try:
        target = resolve_dest(dest)
    except FileNotFoundError as exc:
        print(f"pipemetrics vendor: {exc}", file=sys.stderr)
        return _EXIT_USAGE
    try:
        text = vendored_text(_shown(target))
        target.write_text(text, encoding="utf-8")
    except (OSError, ValueError) as exc:
        print(f"pipemetrics vendor: {exc}", file=sys.stderr)
        return _EXIT_USAGE
    print(f"wrote {target} (pipemetrics {pipemetrics_version()} reference)")
    return _EXIT_OK
