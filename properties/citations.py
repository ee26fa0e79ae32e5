"""What a property cites, each part said as what it is: the API document's words (`Doc`),
megatron-core's source with its file and release (`Source`), or pipemetrics' own reading
(`Interpretation`).

A `pipemetrics.properties.catalogue.Property` holds a tuple of them (``citations``); its
``cites`` is their text (`text`), printed in failure write-ups (``requires:``) and the JSON
report: a `Doc` in quote marks, a `Source` in quote marks after its release and file, an
`Interpretation` after ``reading:``, the parts joined by `` / `` (`text`). ``tests/test_citations.py``
holds every `Doc` quote to ``docs/megatron-common-api.txt`` (`misquoted`) and every `Source`
quote to that release's file where the release is installed.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

DOCUMENT = "docs/megatron-common-api.txt"
"""The API document every `Doc` quotes, from the repository root."""

# The document's typographic quote marks, written as the ASCII ones in a quote.
_QUOTE_MARKS = str.maketrans({"\u201c": '"', "\u201d": '"', "\u2018": "'", "\u2019": "'"})
QUOTE_MARKS = ('"', "\u201c", "\u201d")
"""What opens or closes a quotation: an `Interpretation` holds none."""


@dataclass(frozen=True)
class Doc:
    """Words of the API document as it prints them: its typographic quote marks may be written
    as ASCII ones, and a run of whitespace (a line break) as one space; nothing else differs
    (its dashes, arrows and the underscores its Markdown lost included)."""

    quote: str

    def __str__(self) -> str:
        return f'"{self.quote}"'


@dataclass(frozen=True)
class Source:
    """Words of megatron-core's source (a comment's without its ``#``): the file, from the
    package root (``megatron/core/...``), and the release it was read in."""

    file: str
    release: str
    quote: str

    def __str__(self) -> str:
        return f'megatron-core {self.release} {self.file}: "{self.quote}"'


@dataclass(frozen=True)
class Interpretation:
    """pipemetrics' own words: a reading where the document is silent or ambiguous, an account
    of Megatron's behaviour, the reference's promise (strict). It quotes nothing: a quotation is
    a `Doc` or `Source` beside it."""

    text: str

    def __str__(self) -> str:
        return f"reading: {self.text}"


Citation = Doc | Source | Interpretation


def text(citations: Iterable[Citation]) -> str:
    """The citations as one line: their texts joined by `` / `` (consecutive interpretations as
    one ``reading:``, joined by ``; ``)."""
    parts: list[str] = []
    previous: Citation | None = None
    for citation in citations:
        if isinstance(citation, Interpretation) and isinstance(previous, Interpretation):
            parts[-1] += f"; {citation.text}"
        else:
            parts.append(str(citation))
        previous = citation
    return " / ".join(parts)


def normalised(words: str) -> str:
    """``words`` with typographic quote marks made ASCII and each whitespace run one space."""
    return " ".join(words.translate(_QUOTE_MARKS).split())


def misquoted(citations: Iterable[Citation], document: str) -> list[Doc]:
    """The `Doc` citations whose quote does not occur in ``document`` (both `normalised`)."""
    page = normalised(document)
    return [c for c in citations if isinstance(c, Doc) and normalised(c.quote) not in page]


def misquoted_source(source: Source, file_text: str) -> bool:
    """Whether ``source``'s quote does not occur in ``file_text``, the text of its file in its
    release (both `normalised`, each comment's ``#`` dropped, so a comment over two lines is
    one quote)."""
    lines = (line.strip().removeprefix("#") for line in file_text.splitlines())
    return normalised(source.quote) not in normalised("\n".join(lines))


def quoting(interpretation: Interpretation) -> bool:
    """Whether the interpretation holds a quotation (it must be a `Doc` or `Source` instead)."""
    return any(mark in interpretation.text for mark in QUOTE_MARKS)
