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

``vendor DEST --megatron-core X.Y`` writes the reference cut for one release instead
(`cut_source`): without the parts marked ``# only: SPEC`` (or sections, comment runs and
docstring paragraphs ending ``(only: SPEC)``) whose SPEC does not name the release, its tested
range narrowed to it, behind the same header plus a line naming the release (``--check`` reads
it back from there). docs/reference.md has the marker rules and what each cut drops.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import io
import os
import re
import tokenize
from importlib import metadata
from pathlib import Path
from typing import NamedTuple

MODULE_FILE = "megatron_common.py"
_FIRST_LINE = "# Vendored from pipemetrics "
_DIGEST_LINE = "# Reference sha256: "
_REGENERATE_LINE = "#     pipemetrics vendor "
_CUT_LINE = "# Cut for megatron-core "
_RELEASE_OPTION = " --megatron-core "

#: The megatron-core releases ``vendor --megatron-core`` cuts the reference for (PyPI minors,
#: oldest first). The git snapshots the suite also tests (`SNAPSHOTS`) have no cut: a branch has
#: no fixed API, and dev calls itself 0.19.0; they take the full file.
CUT_RELEASES = ("0.13", "0.14", "0.15", "0.16", "0.17", "0.18", "0.19")
SNAPSHOTS = ("main", "dev")
#: What a SPEC may name besides releases: the full file, which no cut is (a passage marked
#: ``full`` only explains the releases side by side, and every cut drops it).
FULL = "full"
#: A marker: ``# only: SPEC`` after the code of a line (the statement, ``else:`` clause or
#: element of a literal that starts there), or ``(only: SPEC)`` ending a section line
#: (``# ---- title``: up to the next section line), a run of full-line comments (the run) or a
#: paragraph of a docstring (its lines since the blank line before, which goes with them).
#: SPEC: releases, ``X.Y-X.Y`` ranges of `CUT_RELEASES`, ``main``, ``dev``, ``full``,
#: separated by commas; a bracketed remark may follow.
#: The reference's line length (``ruff`` in pyproject.toml): a docstring a cut leaves one line
#: long ends on that line where it fits, as ``ruff format`` writes it.
LINE_LENGTH = 100
_MARKER = re.compile(r"^#\s*only:\s*(?P<spec>[\w.\-]+(?:\s*,\s*[\w.\-]+)*)\s*(?:\(.*\))?$")
_SECTION = re.compile(r"^# [-=]{10,} ")
_SECTION_MARKER = re.compile(r"\(only:\s*(?P<spec>[^)]*)\)\s*$")
_PASSAGE_MARKER = re.compile(r"\(only:\s*(?P<spec>[^)]*)\)\s*(?:\"\"\")?\s*$")


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


def header(
    shown_dest: str, *, version: str, digest: str, megatron_range: str, release: str | None = None
) -> str:
    option = "" if release is None else f"{_RELEASE_OPTION}{release}"
    cut = [] if release is None else [
        f"{_CUT_LINE}{release}: without the parts only other releases run; where the",
        "# installed release needs one, it raises UnsupportedMegatronCoreError at import. The",
        "# full file (vendor without --megatron-core) runs on every release and git snapshot.",
    ]  # fmt: skip
    lines = [
        f"{_FIRST_LINE}{version}: pipemetrics.reference.megatron_common.",
        f"{_DIGEST_LINE}{digest}",
        *cut,
        f"# Tested against megatron-core {megatron_range}. Under another release it warns once",
        "# (UntestedMegatronCoreWarning) and carries on when every megatron-core API it uses is",
        "# present; it raises UnsupportedMegatronCoreError, naming the API, when one is missing.",
        "# Do not edit by hand. Regenerate with:",
        f"{_REGENERATE_LINE}{shown_dest}{option}",
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


def release_of(value: str) -> str:
    """The release ``--megatron-core VALUE`` names (``0.19`` or ``0.19.2``: ``0.19``);
    ``ValueError`` naming the option when no cut exists for it."""
    match = re.fullmatch(r"v?(\d+)\.(\d+)(?:\.\d+\S*)?", value.strip())
    release = f"{match[1]}.{match[2]}" if match else value
    if release not in CUT_RELEASES:
        snapshot = " (a git snapshot: use the full file, the default)" if value in SNAPSHOTS else ""
        raise ValueError(
            f"--megatron-core {value}: no cut for this release{snapshot}; cuts exist for "
            f"{', '.join(CUT_RELEASES)}, and without --megatron-core the full file (every "
            "release and git snapshot) is written"
        )
    return release


def marker_releases(spec: str) -> set[str]:
    """The releases a marker's SPEC names; ``ValueError`` for one it does not know."""
    known = (*CUT_RELEASES, *SNAPSHOTS, FULL)
    releases: set[str] = set()
    for item in (part.strip() for part in spec.split(",")):
        first, _, last = item.partition("-")
        if last and first in CUT_RELEASES and last in CUT_RELEASES:
            releases.update(CUT_RELEASES[CUT_RELEASES.index(first) : CUT_RELEASES.index(last) + 1])
        elif item in known:
            releases.add(item)
        else:
            raise ValueError(f"unknown megatron-core release {item!r} in a marker ({spec!r})")
    return releases


def _marked_lines(source: str, release: str) -> tuple[set[int], dict[int, str]]:
    """The lines (1-based) of the parts marked for releases other than ``release``, and the
    lines that stand in for some of them (a docstring's closing quotes)."""
    lines = source.splitlines()
    nodes = [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.stmt | ast.expr)]
    sections = [n for n, line in enumerate(lines, 1) if _SECTION.match(line)]
    dropped: set[int] = set()
    kept: dict[int, str] = {}
    comment_runs: list[int] = []  # the full-line comments of the run being read
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.STRING:
            dropped.update(_marked_paragraphs(token, lines, release, kept))
        if token.type != tokenize.COMMENT:
            continue
        number, column = token.start
        if not lines[number - 1][:column].strip() and not _SECTION.match(token.string):
            if _MARKER.match(token.string):
                raise ValueError(f"line {number}: a marker follows the code it marks")
            if not comment_runs or comment_runs[-1] != number - 1:
                comment_runs = []
            comment_runs.append(number)
            passage = _PASSAGE_MARKER.search(token.string)
            if passage and release not in marker_releases(passage["spec"]):
                dropped.update(comment_runs)
            continue
        section = _SECTION_MARKER.search(token.string) if column == 0 else None
        if section and _SECTION.match(token.string):
            if release not in marker_releases(section["spec"]):
                end = next((n for n in sections if n > number), len(lines) + 1)
                dropped.update(range(number, end))
            continue
        marker = _MARKER.match(token.string)
        if marker is None:
            continue
        if column == 0 or not lines[number - 1][:column].strip():
            raise ValueError(f"line {number}: a marker follows the code it marks")
        if release not in marker_releases(marker["spec"]):
            dropped.update(range(*_marked_span(nodes, lines, number)))
    return dropped, kept


def _marked_paragraphs(
    token: tokenize.TokenInfo, lines: list[str], release: str, kept: dict[int, str]
) -> set[int]:
    """The lines of a string's paragraphs marked ``(only: SPEC)`` at their end for releases
    other than ``release``, each with the blank line before it. A paragraph with the string's
    first line cannot be marked (its quotes open the string); a marked last paragraph leaves
    the closing quotes on a line of their own (in ``kept``, by the line they stand in for)."""
    first, last = token.start[0], token.end[0]
    dropped: set[int] = set()
    start = first
    for number in range(first, last + 1):
        text = lines[number - 1]
        if not text.strip():
            start = number + 1
            continue
        marker = _PASSAGE_MARKER.search(text)
        if marker is None or release in marker_releases(marker["spec"]):
            continue
        if start == first:
            raise ValueError(f"line {number}: a marker ends a string's first paragraph")
        dropped.update(range(start - 1, number + 1))
        if number == last:  # the closing quotes stay: after a one-line rest, on its line
            quotes = text.rstrip()[-3:]
            joined = lines[first - 1].rstrip() + quotes
            if start - 2 == first and len(joined) <= LINE_LENGTH:
                kept[first] = joined
            else:
                kept[number] = text[: len(text) - len(text.lstrip())] + quotes
    return dropped


def _marked_span(
    nodes: list[ast.stmt | ast.expr], lines: list[str], number: int
) -> tuple[int, int]:
    """[first, end) of what a marker on line ``number`` marks: the ``else:`` clause that line
    opens, else the outermost statement or expression starting there (a definition with its
    decorators and the ``#:`` comments right above it)."""
    text = lines[number - 1]
    indent = len(text) - len(text.lstrip())
    if text.lstrip().startswith("else:"):
        for node in nodes:
            body, orelse = getattr(node, "body", None), getattr(node, "orelse", None)
            if not (isinstance(body, list) and isinstance(orelse, list) and body and orelse):
                continue  # no else clause (a conditional expression's parts are no lists)
            if (body[-1].end_lineno or 0) < number < orelse[0].lineno:
                return number, (orelse[-1].end_lineno or number) + 1
        raise ValueError(f"line {number}: no else clause for the marker")
    starting = [node for node in nodes if node.lineno == number and node.col_offset == indent]
    if not starting:
        raise ValueError(f"line {number}: the marker marks no statement or element")
    node = max(starting, key=lambda n: n.end_lineno or n.lineno)
    first = min([number, *(d.lineno for d in getattr(node, "decorator_list", []))])
    while first > 1 and lines[first - 2].strip().startswith("#:"):
        first -= 1
    return first, (node.end_lineno or number) + 1


def _tidy_blank_lines(lines: list[str]) -> list[str]:
    """At most two blank lines before a top-level line and one before an indented one (what
    ``ruff format`` leaves), none at the end."""
    out: list[str] = []
    blanks = 0
    for line in lines:
        if not line.strip():
            blanks += 1
            continue
        top = not line[:1].isspace()
        out.extend([""] * min(blanks, 2 if top else 1) if out else [])
        out.append(line)
        blanks = 0
    return out


def _narrowed(source: str, release: str) -> str:
    """``source`` with the tested range (`SUPPORTED_MEGATRON_CORE`, the import guard's bounds)
    narrowed to ``release``."""
    major, minor = (int(x) for x in release.split("."))
    for pattern, value in (
        (
            r'^SUPPORTED_MEGATRON_CORE = "[^"]*"',
            f'SUPPORTED_MEGATRON_CORE = ">={release},<{major}.{minor + 1}"',
        ),
        (r"^_SUPPORTED_MIN = \(\d+, \d+\)", f"_SUPPORTED_MIN = ({major}, {minor})"),
        (r"^_SUPPORTED_END = \(\d+, \d+\)", f"_SUPPORTED_END = ({major}, {minor + 1})"),
    ):
        source, count = re.subn(pattern, value, source, flags=re.MULTILINE)
        if count != 1:
            raise ValueError(f"the reference has no single line matching {pattern!r}")
    return source


def cut_source(source: str, release: str) -> str:
    """The reference ``source`` cut for megatron-core ``release`` (one of `CUT_RELEASES`):
    without the parts marked (``# only: ...``) for other releases only, its tested range
    narrowed to that release. ``ValueError`` when the result would not parse."""
    if release not in CUT_RELEASES:
        raise ValueError(f"no cut for megatron-core {release}")
    dropped, standing_in = _marked_lines(source, release)
    kept = [
        standing_in.get(n, line)
        for n, line in enumerate(source.splitlines(), 1)
        if n not in dropped or n in standing_in
    ]
    cut = _narrowed("\n".join(_tidy_blank_lines(kept)) + "\n", release)
    try:
        ast.parse(cut)
    except SyntaxError as exc:
        raise ValueError(f"the cut for megatron-core {release} does not parse: {exc}") from exc
    return cut


def vendored_body(release: str | None = None) -> str:
    """The text below the header: the reference, or its cut for ``release``."""
    source = reference_path().read_text(encoding="utf-8")
    return source if release is None else cut_source(source, release)


def vendored_text(shown_dest: str, release: str | None = None) -> str:
    """What ``vendor`` writes for ``shown_dest``: the full reference, or (``release``) its cut
    for that megatron-core release."""
    body = vendored_body(release)
    return (
        header(
            shown_dest,
            version=pipemetrics_version(),
            digest=source_digest(body),
            megatron_range=supported_range(body),
            release=release,
        )
        + body
    )


_CHECK_IMPL_LINE = "#     pipemetrics check --impl "


class VendoredHeader(NamedTuple):
    """What a vendored file's header declares (``None``: that line is missing or edited)."""

    version: str | None
    digest: str | None
    dest: str | None
    length: int  # lines of the header: the reference text starts after them
    release: str | None = None  # the megatron-core release of a cut; None: the full file


def read_header(text: str) -> VendoredHeader:
    """The header ``vendor`` wrote at the top of ``text``, read so that one edited line still
    leaves it recognisable (its first line, its sha256 line and three lines naming the
    destination are each enough); ``ValueError`` when ``text`` has none of them."""
    version = digest = None
    releases: dict[str, str] = {}
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
        elif line.startswith(_CUT_LINE):
            releases.setdefault("cut", line.removeprefix(_CUT_LINE).split(":", 1)[0].strip())
        elif line.startswith(f"{_REGENERATE_LINE}--check "):
            dests.setdefault("check", line.removeprefix(f"{_REGENERATE_LINE}--check ").strip())
        elif line.startswith(_REGENERATE_LINE):
            shown, option, named = line.removeprefix(_REGENERATE_LINE).partition(_RELEASE_OPTION)
            dests.setdefault("vendor", shown.strip())
            if option:
                releases.setdefault("vendor", named.strip())
        elif line.startswith(_CHECK_IMPL_LINE):
            dests.setdefault("impl", line.removeprefix(_CHECK_IMPL_LINE).strip())
    dest = next((dests[k] for k in ("vendor", "check", "impl") if k in dests), None)
    if version is None and digest is None and dest is None:
        raise ValueError("no header written by `pipemetrics vendor` at the top of the file")
    return VendoredHeader(
        version, digest, dest, length, releases.get("vendor", releases.get("cut"))
    )


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
