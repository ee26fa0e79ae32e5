"""`pipemetrics.sim.model.pipeline_layout` against megatron-core's own ``PipelineParallelLayerLayout``.

Covered, not sampled: every layout of up to four virtual stages over a fixed alphabet of stage
contents (embedding, decoder, MTP and loss in the combinations that matter, and wrong ones), for
every pipeline size dividing the stage count, with the matching layer counts and with counts off
by one. Both sides must accept or refuse alike, with the same message, and an accepted layout
must give every (pipeline rank, chunk) the same global decoder layers and the same
``mtp_standalone``.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from itertools import product
from typing import Any

import pytest

from pipemetrics.sim.mcore import MTP_ON_THE_LAST_STAGE, installed_features
from pipemetrics.sim.model.layout import (
    LayoutSplit,
    ModelLayout,
    Setup,
    WorldSpec,
)
from pipemetrics.sim.model.pipeline_layout import LayoutError, PipelineLayout, parse_layout

NEEDS_STANDALONE_MTP = pytest.mark.skipif(
    installed_features().layout_keeps_mtp_last,
    reason="needs a standalone MTP stage (MTP layers on a stage that is not the last, 'Et|tm|L'), "
    "which the installed megatron-core's PipelineParallelLayerLayout refuses (0.15: MTP layers "
    "must be in the last stage)",
)

STAGE_CONTENTS = ("", "E", "t", "tt", "m", "L", "Et", "tm", "tL", "mL", "Etm", "mt", "LE", "EtL")
"""Stage contents: valid pieces and out-of-order ones (``mt``, ``LE``)."""
MAX_STAGES = 4


def layouts() -> Iterator[tuple[str, int]]:
    """(layout text, pp) for every stage list up to `MAX_STAGES` and every pp dividing it."""
    for count in range(1, MAX_STAGES + 1):
        for stages in product(STAGE_CONTENTS, repeat=count):
            text = "|".join(stages)
            for pp in range(1, count + 1):
                if count % pp == 0:
                    yield text, pp


@pytest.fixture
def megatron_layout() -> Iterator[Any]:
    """megatron-core's class, with the virtual pipeline size Megatron reads from parallel_state
    set for each check and restored afterwards."""
    from megatron.core import parallel_state
    from megatron.core.transformer import pipeline_parallel_layer_layout as module

    before = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    yield module.PipelineParallelLayerLayout, parallel_state
    parallel_state.set_virtual_pipeline_model_parallel_world_size(before)


def megatron_outcome(cls: Any, parallel_state: Any, text: str, pp: int, n: int, m: int) -> Any:
    from megatron.core.transformer.enums import LayerType

    try:
        layout = cls(text, pp)
        standalone = layout.validate_layer_layout(n, m)
    except AssertionError as exc:
        return ("refused", str(exc))
    if standalone is None and installed_features().layout_keeps_mtp_last:
        standalone = False  # 0.15 returns nothing: every layout it accepts keeps MTP last
    vpp = layout.virtual_pipeline_model_parallel_size
    parallel_state.set_virtual_pipeline_model_parallel_world_size(vpp if vpp > 1 else None)
    chunks = [
        [
            tuple(i + 1 for i in layout.get_layer_id_list(LayerType.decoder, vp_stage=v, pp_rank=p))
            for v in range(vpp)
        ]
        for p in range(pp)
    ]
    return ("accepted", chunks, standalone)


def our_outcome(text: str, pp: int, n: int, m: int) -> Any:
    try:
        layout = PipelineLayout(text, pp, n, m)
    except LayoutError as exc:
        return ("refused", str(exc))
    chunks = [[c.decoder_numbers for c in row] for row in layout.chunks]
    return ("accepted", chunks, layout.mtp_standalone)


def test_every_small_layout_agrees_with_megatron(megatron_layout: Any) -> None:
    cls, parallel_state = megatron_layout
    if "pp_rank" not in inspect.signature(cls.get_layer_id_list).parameters:
        pytest.skip(
            "pipemetrics models megatron-core 0.15+'s layout class (get_layer_id_list(pp_rank=), "
            "validate_layer_layout(num_layers, mtp_num_layers), mtp_standalone); 0.13/0.14 read "
            "the rank from parallel_state and 0.13 refuses MTP in a layout"
        )
    checked = accepted = 0
    for text, pp in layouts():
        flat = "".join(text.split("|"))
        for n, m in {(flat.count("t"), flat.count("m")), (flat.count("t") + 1, flat.count("m"))}:
            if flat == "":
                continue  # Megatron indexes the first layer of an empty layout (IndexError)
            theirs = megatron_outcome(cls, parallel_state, text, pp, n, m)
            assert our_outcome(text, pp, n, m) == theirs, (text, pp, n, m)
            checked += 1
            accepted += theirs[0] == "accepted"
    # not vacuous: 0.15, which refuses standalone MTP stages, accepts 385 of them
    assert checked > 200_000 and accepted > 300, (checked, accepted)


@pytest.mark.parametrize(
    ("text", "stages"),
    [
        ("Ettt|(tt|)*2,m|L", [["E", "t", "t", "t"], ["t", "t"], ["t", "t"], ["m"], ["L"]]),
        ("Et*2|t,L", [["E", "t", "t"], ["t", "L"]]),
    ],
)
def test_repeats_and_commas_parse_as_megatron_parses_them(
    megatron_layout: Any, text: str, stages: list[list[str]]
) -> None:
    cls, _ = megatron_layout
    theirs = cls.parse_str_to_list(text)
    assert [[t.name for t in s] for s in theirs] == [[{"E": "embedding", "t": "decoder",
        "m": "mtp", "L": "loss"}[c] for c in s] for s in stages]  # fmt: skip
    assert parse_layout(text) == stages


def test_an_unknown_character_is_refused_naming_it() -> None:
    with pytest.raises(LayoutError, match="Invalid layer character: x"):
        parse_layout("Et|x|L")


def test_setup_refuses_a_layout_naming_the_field_and_megatrons_rule() -> None:
    with pytest.raises(ValueError, match=r"split\.layout: 'Et\|tt\|L' for pp=2: .*divisible"):
        Setup(
            world=WorldSpec(pp=2),
            layout=ModelLayout(num_layers=3, split=LayoutSplit(layout="Et|tt|L")),
        )
    with pytest.raises(ValueError, match="decoder layers must be placed before MTP layers"):
        Setup(
            world=WorldSpec(pp=2),
            layout=ModelLayout(num_layers=2, mtp_num_layers=1, split=LayoutSplit(layout="Etm|tL")),
        )


def test_virtual_stages_give_each_rank_non_contiguous_chunks() -> None:
    setup = Setup(
        world=WorldSpec(pp=2),
        layout=ModelLayout(
            num_layers=5, mtp_num_layers=1, split=LayoutSplit(layout="Et|tt|t|t,mL")
        ),
    )
    # virtual stage v * pp + p is chunk v of rank p: rank 0 holds stages 0 and 2, rank 1 1 and 3
    assert setup.vpp == 2
    assert setup.stage_chunks == [[(1,), (4,)], [(2, 3), (5,)]]
    assert setup.layers_per_stage == [2, 3]
    assert setup.stage_layer_numbers(0) == [1, 4]
    assert setup.mtp_stage == 1 and setup.records_mtp_loss(1)


@NEEDS_STANDALONE_MTP
def test_standalone_mtp_routers_and_the_loss_tracker_live_on_different_stages() -> None:
    setup = Setup(
        world=WorldSpec(pp=3),
        layout=ModelLayout(num_layers=2, mtp_num_layers=1, split=LayoutSplit(layout="Et|tm|L")),
    )
    assert setup.mtp_stage == 1 and setup.mtp_layers_on_stage(1) == [1]
    # the MTP layer's router: slot num_layers + 1, or on megatron-core 0.13-0.15 the slot of
    # its chunk's first decoder layer (layer 2)
    legacy = installed_features().mtp_router_numbering == "default_layer_number"
    assert setup.router_slots(1) == [2, 2 if legacy else 3]
    assert [setup.records_mtp_loss(s) for s in range(3)] == [False, False, True]
    assert not setup.records_moe(2)  # the loss-only stage holds no router


@NEEDS_STANDALONE_MTP
def test_mtp_chunk_layer_offset_counts_the_decoders_of_every_earlier_chunk() -> None:
    # megatron-core 0.13-0.15 number an MTP layer's router 1 + this offset.
    assert Setup(layout=ModelLayout(num_layers=3, mtp_num_layers=1)).mtp_chunk_layer_offset == 0
    even = Setup(world=WorldSpec(pp=2), layout=ModelLayout(num_layers=4, mtp_num_layers=1))
    assert even.mtp_chunk_layer_offset == 2
    standalone = Setup(
        world=WorldSpec(pp=3),
        layout=ModelLayout(num_layers=2, mtp_num_layers=1, split=LayoutSplit(layout="Et|tm|L")),
    )
    assert standalone.mtp_chunk_layer_offset == 1  # stage 1 follows stage 0's one decoder
    virtual = Setup(
        world=WorldSpec(pp=2),
        layout=ModelLayout(
            num_layers=5, mtp_num_layers=1, split=LayoutSplit(layout="Et|tt|t|t,mL")
        ),
    )
    # chunks in order (v0: ranks 0, 1; v1: ranks 0, 1): 1 + 2 + 1 decoders before rank 1's v1
    assert virtual.mtp_chunk_layer_offset == 4


def test_layout_mtp_support_read_without_megatron_matches_the_class() -> None:
    # the controller decides from the source text whether to draw MTP in layouts
    from megatron.core.transformer.pipeline_parallel_layer_layout import (
        PipelineParallelLayerLayout,
    )

    takes = inspect.signature(PipelineParallelLayerLayout.validate_layer_layout).parameters
    assert installed_features().layout_takes_mtp == ("mtp_num_layers" in takes)


def test_mtp_outside_the_last_stage_read_without_megatron_matches_the_class() -> None:
    """`installed_layout_keeps_mtp_last` (read from the source) says what the class does with
    a standalone MTP stage: 0.15 refuses it, 0.14 (whose assert is a tuple) and 0.16+ accept it;
    0.13 refuses MTP in any layout (`installed_layout_takes_mtp`)."""
    from megatron.core.transformer.pipeline_parallel_layer_layout import (
        PipelineParallelLayerLayout,
    )

    if not installed_features().layout_takes_mtp:
        pytest.skip("the installed megatron-core refuses MTP layers in any layout (0.13)")
    try:
        PipelineParallelLayerLayout("Et|tm|L", 3).validate_layer_layout(2, 1)
        refused = None
    except AssertionError as exc:
        refused = str(exc)
    assert installed_features().layout_keeps_mtp_last == (refused == MTP_ON_THE_LAST_STAGE), refused
    assert refused in (None, MTP_ON_THE_LAST_STAGE)
    ours = pytest.raises(LayoutError, match=MTP_ON_THE_LAST_STAGE) if refused else None
    with ours or contextlib.nullcontext():
        PipelineLayout("Et|tm|L", 3, 2, 1)
