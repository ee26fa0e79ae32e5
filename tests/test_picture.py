"""The layout picture, drawn from hand-made outcomes and computed places (no processes)."""

from __future__ import annotations

import json

import pytest

from pipemetrics.properties.engine import PropertyResult
from pipemetrics.properties.report import render_markdown
from pipemetrics.sim.collectives.coordinator import Coordinator, Outcome
from pipemetrics.sim.collectives.protocol import CollectiveCall
from pipemetrics.sim.model.layout import ExplicitSplit, ModelLayout, Setup, WorldSpec
from pipemetrics.sim.model.scenario import Scenario, Step
from pipemetrics.sim.model.topology import places_for
from pipemetrics.sim.results.picture import MAX_WIDTH, layout_picture, member_list, short_site
from pipemetrics.sim.results.summary import summarize
from pipemetrics.sim.worlds.world import RankResult, WorldRun

#: Runs with megatron-core unreachable (ci/test.sh); the oldest release's leg leaves it out.
pytestmark = pytest.mark.release_independent

SITE = (
    "/venv/lib/python3.12/site-packages/megatron/core/transformer/moe/moe_logging.py:277 "
    "in _sync_metrics"
)
# 8 ranks: pp 2 x tp 2 x dp 2; stage 0 dense only, stage 1 MoE plus one MoE MTP layer
SETUP = Setup(
    world=WorldSpec(pp=2, tp=2, dp=2),
    layout=ModelLayout(num_layers=4, moe_layer_freq=[0, 0, 1, 1], mtp_num_layers=1),
)
PLACES = places_for(SETUP.world)


def pp_call(rank: int) -> CollectiveCall:
    return CollectiveCall(
        rank=rank,
        index=1,
        op="all_reduce",
        group_name="12",
        group_ranks=PLACES[rank].groups["pp"],
        signature=(("tensor", "torch.float32[2]@cpu"), ("op", "SUM")),
        call_site=(SITE,),
    )


def deadlock() -> Outcome:
    """Rank 4 (stage 1) blocks in the pp all_reduce; its stage-0 partner rank 0 returned."""
    c = Coordinator(list(range(8)), PLACES)
    c.on_done(0, at=0.0)
    c.on_call(pp_call(4))
    assert c.outcome is not None and c.outcome.kind == "deadlock"
    return c.outcome


def assert_plain(text: str) -> None:
    assert "\x1b" not in text
    assert all(len(line) <= MAX_WIDTH for line in text.splitlines()), text


def test_stage_rows_show_layer_kinds_numbers_and_ranks() -> None:
    text = layout_picture(SETUP, PLACES)
    assert_plain(text)
    lines = text.splitlines()
    stage0 = next(line for line in lines if line.strip().startswith("stage 0 |"))
    stage1 = next(line for line in lines if line.strip().startswith("stage 1 |"))
    assert "D1 D2" in stage0 and "ranks 0-3" in stage0 and "no MoE router" in stage0
    assert "M3 M4 T1" in stage1 and "ranks 4-7" in stage1 and "no MoE router" not in stage1
    assert "where each rank stood" not in text


def test_group_memberships_per_rank() -> None:
    text = layout_picture(SETUP, PLACES)
    header = next(line for line in text.splitlines() if "tp_dp_cp" in line)
    assert header.split() == ["rank", "pp", "tp", "cp", "dp", "|", "pp", "dp", "tp_cp", "tp_dp_cp"]
    row5 = next(line for line in text.splitlines() if line.split()[:1] == ["5"])
    # rank 5: pp 1, tp 1, cp 0, dp 0; pp group (1, 5), dp (5, 7), tp_cp (4, 5), tp_dp_cp 4..7
    assert row5.split() == ["5", "1", "1", "0", "0", "|", "1,5", "5,7", "4-5", "4-7"]
    rows = [line for line in text.splitlines() if line.startswith("  ") and "|" in line]
    rows = [line for line in rows if "stage" not in line]
    ranks = [line.split()[0] for line in rows]
    assert ranks == ["rank", *(str(r) for r in range(8))]


def test_where_each_rank_stood_at_a_deadlock() -> None:
    text = layout_picture(SETUP, PLACES, deadlock())
    assert_plain(text)
    assert "where each rank stood when the world ended (deadlock):" in text
    assert "rank 4  blocked in all_reduce #1 on pp [0,4] (pg 12)" in text
    assert "tensor=torch.float32[2]@cpu, op=SUM" in text
    assert "at megatron/core/transformer/moe/moe_logging.py:277 in _sync_metrics" in text
    assert "rank 0  returned" in text
    assert "rank 1  running" in text and "rank 7  running" in text


def test_crash_and_timeout_states() -> None:
    c = Coordinator(list(range(8)), PLACES)
    c.on_call(pp_call(4))
    c.on_crash(3, -9, at=0.0)
    crashed = layout_picture(SETUP, PLACES, c.outcome)
    assert "rank 3  died (exit code -9)" in crashed and "rank 4  blocked in" in crashed
    c = Coordinator(list(range(8)), PLACES)
    c.on_call(pp_call(4))
    c.on_timeout(20.0, {})
    timed_out = layout_picture(SETUP, PLACES, c.outcome)
    assert "(timeout)" in timed_out
    assert "rank 2  running (never reached a collective or returned)" in timed_out


def test_ok_outcome_everyone_returned() -> None:
    c = Coordinator(list(range(8)), PLACES)
    for rank in range(8):
        c.on_done(rank, at=0.0)
    c.finish_ok()
    text = layout_picture(SETUP, PLACES, c.outcome)
    assert all(f"rank {r}  returned" in text for r in range(8))


def test_empty_stage_dense_mtp_and_long_stages() -> None:
    empty = Setup(
        world=WorldSpec(pp=2),
        layout=ModelLayout(
            num_layers=2, split=ExplicitSplit(layers=[0, 2]), mtp_num_layers=2, mtp_is_moe=False
        ),
    )
    text = layout_picture(empty, places_for(empty.world))
    assert "stage 0 | (no layers)" in text and "M1 M2 t1 t2" in text
    long = Setup(
        world=WorldSpec(pp=2, dp=4),
        layout=ModelLayout(num_layers=120, moe_layer_freq=[0] * 3 + [1] * 117, mtp_num_layers=1),
    )
    text = layout_picture(long, places_for(long.world))
    assert_plain(text)
    assert "D1-3 M4-60" in text and "M61-120 T1" in text


def test_member_list_and_short_site() -> None:
    assert member_list((0, 1, 2, 3)) == "0-3"
    assert member_list((0, 4)) == "0,4"
    assert member_list((5, 0, 1, 2)) == "0-2,5"
    assert member_list(()) == "-"
    assert short_site(SITE) == "megatron/core/transformer/moe/moe_logging.py:277 in _sync_metrics"
    assert short_site("/home/me/impl.py:3 in f") == "/home/me/impl.py:3 in f"


def test_outcome_text_names_the_kind_once() -> None:
    assert deadlock().text().startswith("deadlock: rank 4 blocked")
    assert not deadlock().text().startswith("deadlock: deadlock")
    crash = Outcome(kind="crash", message="rank 1 died (exit code -9) while the task was running")
    assert crash.text() == "crash: rank 1 died (exit code -9) while the task was running"


def failed_result() -> PropertyResult:
    scenario = Scenario(setup=SETUP, steps=[Step(calls=[])])
    return PropertyResult(
        "moe.no_hang",
        "get_moe_metrics",
        "fail",
        examples=3,
        seconds=1.5,
        counterexample=scenario.model_dump(mode="json"),
        replay="pipemetrics replay pipemetrics-report/moe.no_hang.json",
        message=deadlock().text(),
        picture=layout_picture(SETUP, PLACES, deadlock()),
    )


def test_json_counterexample_carries_the_picture_and_the_contract_holds() -> None:
    entry = failed_result().as_json()
    assert set(entry) == {
        "id", "function", "status", "examples", "found_at", "seconds", "counterexample", "replay",
        "message", "confirmed", "drawn_by", "cites", "target_lines",
    }  # fmt: skip
    assert "stage 1 |" in entry["counterexample"]["picture"]
    assert entry["counterexample"]["setup"]["world"]["pp"] == 2
    assert failed_result().counterexample is not None
    assert "picture" not in (failed_result().counterexample or {})


def test_markdown_has_table_picture_counterexample_and_replay() -> None:
    passed = PropertyResult("moe.values", "get_moe_metrics", "pass", examples=5, seconds=2.0)
    md = render_markdown("my/impl.py", "seed", [passed, failed_result()])
    assert "| property | function | status | examples | seconds |" in md
    assert "| `moe.values` | `get_moe_metrics` | pass | 5 | 2.0 |" in md
    assert "NOT CONFORMANT" in md
    picture = md.split("```text\n")[2].split("\n```")[0]
    assert "stage 0 |" in picture and "at megatron/core/transformer/moe" in picture
    counterexample = json.loads(md.split("```json\n")[1].split("\n```")[0])
    assert counterexample["setup"]["world"]["tp"] == 2 and "picture" not in counterexample
    assert "```bash\npipemetrics replay pipemetrics-report/moe.no_hang.json\n```" in md


def test_replay_summary_shows_the_picture_after_the_outcome() -> None:
    outcome = deadlock()
    run = WorldRun(
        outcome=outcome,
        ranks={rank: RankResult(place=place) for rank, place in PLACES.items()},
        seconds=0.0,
        reusable=True,
    )
    text = summarize(Scenario(setup=SETUP, steps=[Step(calls=[])]), run)
    lines = text.splitlines()
    outcome_at = next(i for i, line in enumerate(lines) if line.startswith("outcome: "))
    assert lines[outcome_at] == f"outcome: {outcome.text()}"
    stage_at = next(i for i, line in enumerate(lines) if line.strip().startswith("stage 0 |"))
    assert stage_at > outcome_at
    assert "rank 4  blocked in all_reduce #1 on pp [0,4]" in text


def test_a_long_call_site_keeps_its_file_line_and_function() -> None:
    """A path target's site is an absolute path; clipped, it keeps its end, not its start."""
    from pipemetrics.sim.results.picture import _SITE_WIDTH, _clip_site

    site = "/tmp/" + "d" * 120 + "/mutants/impl.py:697 in _sync"
    clipped = _clip_site(site)
    assert len(clipped) == _SITE_WIDTH
    assert clipped.startswith("...") and clipped.endswith("/mutants/impl.py:697 in _sync")
    assert _clip_site("/home/me/impl.py:3 in f") == "/home/me/impl.py:3 in f"
