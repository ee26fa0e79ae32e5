"""``pipemetrics vendor DEST``: write the reference as one self-contained file to copy into a tree;
``pipemetrics vendor --check FILE``: whether such a file is still what ``vendor`` writes (exit 0
identical, 1 drift, 2 unreadable or not a vendored copy). The file and its header are
`pipemetrics.properties.vendor`'s.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pipemetrics.commands.subcommand import Subcommand
from pipemetrics.properties.vendor import (
    VendoredHeader,
    first_difference,
    pipemetrics_version,
    read_header,
    reference_path,
    resolve_dest,
    shown_path,
    source_digest,
    vendored_text,
)

_EXIT_OK = 0
_EXIT_DRIFT = 1
_EXIT_USAGE = 2


def add_vendor_arguments(parser: argparse.ArgumentParser) -> None:
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument(
        "dest", nargs="?", help="file (or directory) to write the reference module to"
    )
    what.add_argument(
        "--check",
        metavar="FILE",
        help="exit 0 when FILE is what `vendor` writes for its header's destination, 1 on "
        "drift (naming the first differing line), 2 when FILE is not a vendored copy",
    )


COMMAND = Subcommand(
    "vendor",
    "write the reference as one file to vendor, or check such a file",
    add_vendor_arguments,
)


def vendor_command(args: argparse.Namespace) -> int:
    return vendor_main(args.dest) if args.check is None else check_main(args.check)


def _why(declared: VendoredHeader, text: str) -> str:
    """Which part drifted: the header, the reference text, or neither (another reference)."""
    body = source_digest("".join(text.splitlines(keepends=True)[declared.length :]))
    if body == source_digest(reference_path().read_text(encoding="utf-8")):
        if declared.digest is None:
            return (
                "the header has no sha256 line (vendored by an older pipemetrics, or edited); "
                "the reference text is intact"
            )
        return "the header was edited (the reference text is intact)"
    if body == declared.digest:
        return (
            f"the copy is unedited but vendored from another reference (pipemetrics "
            f"{declared.version}, installed {pipemetrics_version()}): regenerate it with "
            f"`pipemetrics vendor {declared.dest}`"
        )
    return "the reference text was edited after vendoring (its sha256 is not the header's)"


def check_main(path: str) -> int:
    """``pipemetrics vendor --check FILE``: 0 when FILE is what ``vendor`` writes for the
    destination its header declares (FILE itself when no line declares one), 1 on drift, 2
    when FILE is unreadable or has no vendored header."""
    try:
        text = Path(path).read_text(encoding="utf-8")
        declared = read_header(text)
        expected = vendored_text(declared.dest or shown_path(Path(path)))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        print(f"pipemetrics vendor --check: {path}: {exc}", file=sys.stderr)
        return _EXIT_USAGE
    difference = first_difference(text, expected)
    if difference is None:
        digest = source_digest(reference_path().read_text(encoding="utf-8"))
        print(f"{path}: up to date (pipemetrics {declared.version}, sha256 {digest[:12]})")
        return _EXIT_OK
    number, found, wanted = difference
    print(
        f"{path}:{number}: drift: {_why(declared, text)}\n"
        f"  found:    {found.rstrip(chr(10))!r}\n"
        f"  expected: {wanted.rstrip(chr(10))!r}",
        file=sys.stderr,
    )
    return _EXIT_DRIFT


def vendor_main(dest: str) -> int:
    try:
        target = resolve_dest(dest)
    except FileNotFoundError as exc:
        print(f"pipemetrics vendor: {exc}", file=sys.stderr)
        return _EXIT_USAGE
    try:
        text = vendored_text(shown_path(target))
        target.write_text(text, encoding="utf-8")
    except (OSError, ValueError) as exc:
        print(f"pipemetrics vendor: {exc}", file=sys.stderr)
        return _EXIT_USAGE
    print(f"wrote {target} (pipemetrics {pipemetrics_version()} reference)")
    return _EXIT_OK
