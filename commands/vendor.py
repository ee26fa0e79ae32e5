"""``pipemetrics vendor DEST``: write the reference as one self-contained file to copy into a tree
(``--megatron-core X.Y``: its cut for that release);
``pipemetrics vendor --check FILE``: whether such a file (full or cut) is still what ``vendor``
writes (exit 0 identical, 1 drift, 2 unreadable or not a vendored copy). The file, its cuts and
its header are `pipemetrics.commands.vendor_text`'s.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pipemetrics.commands.subcommand import Subcommand
from pipemetrics.commands.vendor_text import (
    CUT_RELEASES,
    VendoredHeader,
    first_difference,
    pipemetrics_version,
    read_header,
    release_of,
    resolve_dest,
    shown_path,
    source_digest,
    vendored_body,
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
        help="exit 0 when FILE is what `vendor` writes for its header's destination (and "
        "release, for a cut), 1 on drift (naming the first differing line), 2 when FILE is not "
        "a vendored copy",
    )
    parser.add_argument(
        "--megatron-core",
        metavar="X.Y",
        dest="megatron_core",
        help="write the reference cut for this megatron-core release: without the parts only "
        f"other releases run ({', '.join(CUT_RELEASES)}; default: the full file, every release "
        "and git snapshot)",
    )


COMMAND = Subcommand(
    "vendor",
    "write the reference as one file to vendor, or check such a file",
    add_vendor_arguments,
)


def vendor_command(args: argparse.Namespace) -> int:
    if args.check is not None and args.megatron_core is not None:
        print(
            "pipemetrics vendor: --megatron-core is not allowed with --check (the file's header "
            "names its release)",
            file=sys.stderr,
        )
        return _EXIT_USAGE
    if args.check is not None:
        return check_main(args.check)
    return vendor_main(args.dest, args.megatron_core)


def _why(declared: VendoredHeader, text: str) -> str:
    """Which part drifted: the header, the reference text, or neither (another reference)."""
    body = source_digest("".join(text.splitlines(keepends=True)[declared.length :]))
    if body == source_digest(vendored_body(declared.release)):
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
        release = None if declared.release is None else release_of(declared.release)
        expected = vendored_text(declared.dest or shown_path(Path(path)), release)
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        print(f"pipemetrics vendor --check: {path}: {exc}", file=sys.stderr)
        return _EXIT_USAGE
    difference = first_difference(text, expected)
    if difference is None:
        digest = source_digest(vendored_body(release))
        cut = "" if release is None else f", cut for megatron-core {release}"
        print(f"{path}: up to date (pipemetrics {declared.version}{cut}, sha256 {digest[:12]})")
        return _EXIT_OK
    number, found, wanted = difference
    print(
        f"{path}:{number}: drift: {_why(declared, text)}\n"
        f"  found:    {found.rstrip(chr(10))!r}\n"
        f"  expected: {wanted.rstrip(chr(10))!r}",
        file=sys.stderr,
    )
    return _EXIT_DRIFT


def vendor_main(dest: str, megatron_core: str | None = None) -> int:
    try:
        release = None if megatron_core is None else release_of(megatron_core)
        target = resolve_dest(dest)
    except (FileNotFoundError, ValueError) as exc:
        print(f"pipemetrics vendor: {exc}", file=sys.stderr)
        return _EXIT_USAGE
    try:
        text = vendored_text(shown_path(target), release)
        target.write_text(text, encoding="utf-8")
    except (OSError, ValueError) as exc:
        print(f"pipemetrics vendor: {exc}", file=sys.stderr)
        return _EXIT_USAGE
    cut = "" if release is None else f", cut for megatron-core {release}"
    print(f"wrote {target} (pipemetrics {pipemetrics_version()} reference{cut})")
    return _EXIT_OK
