"""Every citation is what it says it is: a `Doc` quote occurs in the API document as quoted
(typographic quote marks and whitespace runs aside), a `Source` quote in its file of the
megatron-core release it names (where that release is installed), and an `Interpretation`
quotes nothing. The checkers are also run on planted wrong quotes: they can fail."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest

from pipemetrics.properties.catalogue import (
    BY_ID,
    CATALOGUE,
    MOE,
    MOE_LOGGING_FILE,
    MTP_FILE,
    READ_IN,
)
from pipemetrics.properties.citations import (
    DOCUMENT,
    Citation,
    Doc,
    Interpretation,
    Source,
    misquoted,
    misquoted_source,
    normalised,
    quoting,
    text,
)

ROOT = Path(__file__).resolve().parent.parent
PAGE = (ROOT / DOCUMENT).read_text(encoding="utf-8")
SEED = "shared/seed/megatron-common-api.txt"

SOURCES = sorted(
    {c for prop in CATALOGUE for c in prop.citations if isinstance(c, Source)},
    key=lambda c: (c.file, c.quote),
)


def _release_file(source: Source) -> str:
    """The text of ``source``'s file in the installed megatron-core, skipping unless the
    installed release is the one it names."""
    try:
        dist = importlib.metadata.distribution("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip(f"megatron-core is not installed (the quote is of {source.release})")
    if dist.version != source.release:
        pytest.skip(f"megatron-core {dist.version} is installed; the quote is of {source.release}")
    path = Path(str(dist.locate_file(source.file)))
    assert path.is_file(), f"megatron-core {source.release} has no {source.file}"
    return path.read_text(encoding="utf-8")


def test_the_document_is_the_seed_copy() -> None:
    seeds = [base / SEED for base in (ROOT, ROOT.parent) if (base / SEED).is_file()]
    if not seeds:
        pytest.skip(f"no {SEED} beside this checkout")
    assert seeds[0].read_bytes() == (ROOT / DOCUMENT).read_bytes()


@pytest.mark.parametrize("prop", CATALOGUE, ids=[p.id for p in CATALOGUE])
def test_every_doc_quote_is_the_documents_words(prop: object) -> None:
    from pipemetrics.properties.catalogue import Property

    assert isinstance(prop, Property)
    assert prop.citations, f"{prop.id} cites nothing"
    wrong = [str(c) for c in misquoted(prop.citations, PAGE)]
    assert not wrong, f"{prop.id} quotes words {DOCUMENT} does not hold: {wrong}"
    quoting_ = [c.text for c in prop.citations if isinstance(c, Interpretation) and quoting(c)]
    assert not quoting_, (
        f"{prop.id}: an interpretation quotes (make it a Doc or Source): {quoting_}"
    )


@pytest.mark.parametrize("source", SOURCES, ids=[f"{s.file}:{s.quote[:40]}" for s in SOURCES])
def test_every_source_quote_is_its_releases_words(source: Source) -> None:
    assert source.file.startswith("megatron/core/") and source.file.endswith(".py")
    assert not misquoted_source(source, _release_file(source)), (
        f"megatron-core {source.release} {source.file} does not hold: {source.quote!r}"
    )


def test_the_doc_checker_fails_a_planted_wrong_quote() -> None:
    right = Doc("Acceptance rate is a ratio of counts and is not scaled.")
    # the catalogue's wrong quotes before the citations were checked: each must be found
    planted: list[Citation] = [
        Doc("_round_up_to_multiple(value: int, multiple: int) -> int"),  # the document: →
        Doc(
            "Raises: ValueError - If the tensor is None on the source rank, or if a tensor "
            "provided on a non-source rank has mismatched shape/dtype/device."
        ),  # a bullet between, an en dash
        Doc("get_moe_metrics(loss_scale: float, ...)"),  # abbreviated
        Doc("per-layer values are returned under keys of the form moe/{name}_layer_{i}"),
        Doc(
            'Each MTP layer\'s loss is returned under the key "mtp_{i}_loss" and acceptance '
            'rate under "mtp_{i}_acceptance_rate" where i is 1-indexed (matching Megatron-LM).'
        ),  # the document: mtp_{i}loss, mtp{i}_acceptance_rate
        Doc("so callers must pass 1/num_microbatches to recover the mean."),  # cut short
        Doc("Empty masks can leave no valid MTP positions, so clamp denominators to avoid NaNs."),
        Doc("loss_scale - Scale factor to apply to each auxiliary loss"),  # the document: –
        Doc("per_layer_logging - If True, include per-layer values in the returned dict."),
        Doc("total_loss_dict - If provided, accumulate means into this dict (by name)."),
    ]
    assert misquoted([right, *planted], PAGE) == planted
    assert misquoted([right, Interpretation("not a quote: never checked")], PAGE) == []


def test_quote_marks_and_whitespace_are_all_that_is_set_aside() -> None:
    # the document prints typographic quote marks, and its words as one line
    assert (
        misquoted([Doc('returned under the same key (e.g., "load_balancing_loss").')], PAGE) == []
    )
    assert misquoted([Doc("MoE\n  auxiliary   losses")], PAGE) == []
    assert normalised("it\u2019s \u201cx\u201d") == 'it\'s "x"'
    assert misquoted([Doc("returned under the same key (e.g., load_balancing_loss).")], PAGE)


def test_the_source_checker_fails_a_planted_wrong_quote() -> None:
    file_text = (
        "    # Empty masks can leave no valid MTP positions,\n    # so clamp denominators.\n"
    )
    right = Source(MTP_FILE, READ_IN, "no valid MTP positions, so clamp denominators.")
    assert not misquoted_source(right, file_text)
    assert misquoted_source(Source(MTP_FILE, READ_IN, "so clamp the numerators."), file_text)


def test_a_planted_wrong_source_quote_fails_against_the_installed_release() -> None:
    wrong = Source(MOE_LOGGING_FILE, READ_IN, 'writer.add_scalar(f"moe/{name}layer{i}", val)')
    assert misquoted_source(wrong, _release_file(wrong))


def test_an_interpretation_that_quotes_is_found() -> None:
    assert quoting(Interpretation('its keys are "matching Megatron-LM"'))
    assert not quoting(Interpretation("Megatron-LM's keys"))


def test_cites_says_what_each_part_is() -> None:
    parts = (
        Doc("a"),
        Source(MTP_FILE, READ_IN, "b"),
        Interpretation("c"),
        Interpretation("d"),
        Doc("e"),
    )
    assert text(parts) == f'"a" / megatron-core {READ_IN} {MTP_FILE}: "b" / reading: c; d / "e"'
    for prop in CATALOGUE:
        assert prop.cites == text(prop.citations)


def test_reports_print_the_citations_readably() -> None:
    import io

    from pipemetrics.properties.engine import PropertyResult
    from pipemetrics.properties.report import print_failures, render_markdown

    failed = PropertyResult("moe.per_layer", MOE, "fail", message="wrong")
    out = io.StringIO()
    print_failures([failed], out)
    cites = BY_ID["moe.per_layer"].cites
    assert f"requires: {cites}\n" in out.getvalue()
    assert failed.as_json()["cites"] == cites
    # Markdown would take the underscores of moe/{name}_layer_{i} for emphasis, as the API
    # document's did: they are escaped
    markdown = render_markdown("impl.py", "seed", [failed])
    assert "moe/{name}\\_layer\\_{i}" in markdown and "moe/{name}_layer_{i}" not in markdown
