"""The in-process tier: every rank of a world in one host process, scheduled deterministically.

Checked here: it agrees with the process tier (outcome kind, per-rank values, exceptions and
collectives) on generated scenarios of every property and on every mutant of tests/broken; it
is deterministic; each rank keeps its own Megatron state and its own copy of the target's
modules; a target that blocks outside a collective, or ends the process, gets an outcome with
stacks and leaves nothing behind; worlds of 64 ranks run on this machine.
"""

from __future__ import annotations

import os
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import seed as hypothesis_seed

from pipemetrics.bench.measure import throughput_scenario
from pipemetrics.properties.catalogue import BY_ID, CATALOGUE, Property
from pipemetrics.properties.effort import EFFORTS
from pipemetrics.properties.verdict import judge_run
from pipemetrics.sim.collectives.own_lines import TargetLine
from pipemetrics.sim.collectives.protocol import RunMode
from pipemetrics.sim.model.calls import MoeCall, RoundUpCall
from pipemetrics.sim.model.layout import ModelLayout, Setup, WorldSpec
from pipemetrics.sim.model.records import StepRecords
from pipemetrics.sim.model.records import router_record as moe
from pipemetrics.sim.model.scenario import Scenario, Step
from pipemetrics.sim.results.differential import differences
from pipemetrics.sim.results.summary import target_lines
from pipemetrics.sim.worlds.inprocess_world import inprocess_unsupported
from pipemetrics.sim.worlds.world import WorldRun

from .broken.mutants import MUTANTS, write_mutant
from .conftest import Bounds, TrackingPool, tracking_pool
from .test_own_lines import RETURNS_EARLY, returns_early_lines, write_fault_copy
from .test_properties_runner import check
from .test_sim_world import scenario_for

pytestmark = pytest.mark.skipif(
    inprocess_unsupported() is not None, reason=str(inprocess_unsupported())
)

#: Generated scenarios per property compared between the tiers (CI runs this sample; set
#: PIPEMETRICS_DIFFERENTIAL_EXAMPLES for a longer run, e.g. 40 for about 800 scenarios).
EXAMPLES = int(os.environ.get("PIPEMETRICS_DIFFERENTIAL_EXAMPLES", "6"))
#: Generated scenarios per failing property of each mutant.
MUTANT_EXAMPLES = int(os.environ.get("PIPEMETRICS_DIFFERENTIAL_MUTANT_EXAMPLES", "4"))


@pytest.fixture(scope="module")
def tiers(pool: TrackingPool, inprocess_pool: TrackingPool) -> tuple[TrackingPool, TrackingPool]:
    return pool, inprocess_pool


def _semantic(prop: Property) -> str:
    return "strict" if "strict" in prop.profiles else sorted(prop.profiles)[0]


def assert_tiers_agree(
    tiers: tuple[TrackingPool, TrackingPool], prop: Property, semantic: str, target: str | None,
    examples: int,
) -> int:  # fmt: skip
    """Run ``examples`` generated scenarios of ``prop`` on both tiers; returns the number of
    failing (non-ok or judged failing) examples seen, so a caller can tell it saw failures."""
    process, inprocess = tiers
    failing = 0

    @settings(
        max_examples=examples, deadline=None, database=None,
        suppress_health_check=list(HealthCheck),
    )  # fmt: skip
    @hypothesis_seed(0)
    @given(prop.scenarios(EFFORTS["ci"], semantic))  # type: ignore[arg-type]
    def compare(scenario: Scenario) -> None:
        nonlocal failing
        update: dict[str, object] = {"property": prop.id, "profile": semantic}
        if target is not None:
            update["target"] = target
        scenario = scenario.model_copy(update=update)
        a = process.run(scenario)
        b = inprocess.run(scenario)
        found = differences(a, b, ("process", "inprocess"))
        assert not found, f"{prop.id}: {scenario.model_dump_json()}\n" + "\n".join(found[:8])
        outcome_a = judge_run(scenario, a)
        outcome_b = judge_run(scenario, b)
        assert bool(outcome_a) == bool(outcome_b), (outcome_a, outcome_b)
        failing += bool(outcome_a)

    compare()
    return failing


@pytest.mark.parametrize("property_id", [p.id for p in CATALOGUE])
def test_the_tiers_agree_on_generated_scenarios(
    tiers: tuple[TrackingPool, TrackingPool], property_id: str
) -> None:
    prop = BY_ID[property_id]
    assert_tiers_agree(tiers, prop, _semantic(prop), None, EXAMPLES)


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_the_tiers_agree_on_every_mutant(
    tiers: tuple[TrackingPool, TrackingPool], tmp_path: Path, name: str
) -> None:
    """Same scenarios, the mutant as target: both tiers see the same outcomes and values,
    whether the bug shows in them or not."""
    mutant = MUTANTS[name]
    path = str(write_mutant(name, tmp_path))
    for property_id in mutant.fails:
        assert_tiers_agree(tiers, BY_ID[property_id], mutant.profile, path, MUTANT_EXAMPLES)


def test_the_inprocess_tier_names_the_target_s_own_lines(
    inprocess_pool: TrackingPool, tmp_path: Path
) -> None:
    """A hang of a broken copy: the blocked and the returned rank's own line in the copy, as
    the process tier names them (`tests/test_sim_world.py`)."""
    path = write_mutant(RETURNS_EARLY, tmp_path)
    blocked, returned = returns_early_lines(path)
    run = inprocess_pool.run(scenario_for(path))
    assert run.outcome.kind == "deadlock", run.outcome.message
    assert target_lines(run) == {
        0: TargetLine(state="returned", site=f"{path}:{returned} in get_moe_metrics"),
        1: TargetLine(state="blocked", site=f"{path}:{blocked} in _sync", what="all_reduce"),
    }


@pytest.mark.parametrize("kind", ["exit", "sleep"])
def test_the_inprocess_tier_names_the_line_of_a_rank_that_ends_or_holds_the_host(
    own_pool: TrackingPool, tmp_path: Path, kind: str
) -> None:
    """A copy whose rank 1 calls ``os._exit`` (the host process ends: rank 1 at its line, rank
    0 died with it, without a line of its own) or sleeps past the deadline (the watchdog's
    stack: rank 1 at its line, rank 0 blocked in the pipeline reduction)."""
    path, line = write_fault_copy(kind, tmp_path)
    fault = f"{path}:{line} in get_moe_metrics"
    run = own_pool.run(scenario_for(path, deadline_s=3.0))
    lines = target_lines(run)
    if kind == "exit":
        assert run.outcome.kind == "crash", run.outcome.message
        assert lines[1] == TargetLine(state="died", site=fault, what="os._exit(3)"), lines
        assert lines[0].state == "died" and lines[0].site is None, lines
        assert lines[0].note == (
            "no line of its own: rank 1 ended the in-process host, which runs every rank"
        )
    else:
        assert run.outcome.kind == "timeout", run.outcome.message
        assert lines[1] == TargetLine(state="running", site=fault), lines
        assert lines[0].state == "blocked" and lines[0].what == "all_reduce", lines


# -- determinism and isolation -----------------------------------------------------------------


def _scenario(world: WorldSpec, seed: int = 3, target: str | None = None) -> Scenario:
    import random

    scenario = throughput_scenario(world, random.Random(seed))
    return scenario if target is None else scenario.model_copy(update={"target": target})


def _fingerprint(run: WorldRun) -> list[object]:
    out: list[object] = [run.outcome.kind]
    for rank, result in sorted(run.ranks.items()):
        assert result.done is not None
        for report in result.done.reports:
            out.append((rank, report.value, [(c.op, c.group_ranks, c.signature, c.call_site)
                                             for c in report.collectives]))  # fmt: skip
    return out


def test_runs_are_deterministic_across_runs_and_hosts(inprocess_pool: TrackingPool) -> None:
    world = WorldSpec(pp=2, dp=2)
    scenario = _scenario(world)
    first = inprocess_pool.run(scenario)
    assert first.outcome.kind == "ok", first.outcome.message
    again = inprocess_pool.run(scenario)
    assert _fingerprint(first) == _fingerprint(again)
    with tracking_pool("inprocess") as fresh:
        assert _fingerprint(fresh.run(scenario)) == _fingerprint(first)


def test_the_ranks_work_alone_runs_every_rank_and_matches_nothing(
    inprocess_pool: TrackingPool,
) -> None:
    """`RunMode.ALONE` (the bench's ceiling of the tier): every rank runs its fill and call to
    the end, one after another; collectives reach the fake backend, so none is released or
    recorded, and the host stays usable for gated runs."""
    world = WorldSpec(pp=2, dp=2)
    scenario = _scenario(world)
    alone = inprocess_pool.run(scenario, mode=RunMode.ALONE)
    assert alone.outcome.kind == "ok", alone.outcome.message
    assert alone.collectives_released == 0
    for result in alone.ranks.values():
        assert result.done is not None and len(result.done.reports) == 1
        assert result.done.reports[0].error is None and result.done.reports[0].collectives == []
    gated = inprocess_pool.run(scenario)
    assert gated.outcome.kind == "ok" and gated.collectives_released > 0
    assert not judge_run(scenario, gated)


ISOLATION_TARGET = """
import torch.distributed as dist
from megatron.core.transformer.moe import moe_logging
_CALLS = []


def _moe_logging_state():
    # every private module-level value of moe_logging: its trackers (dev adds one)
    return sorted(n for n, v in vars(moe_logging).items()
                  if n.startswith("_") and not n.startswith("__") and not callable(v)
                  and not isinstance(v, type(moe_logging)))


def get_moe_metrics(loss_scale, per_layer_logging=False, num_layers=None, mtp_num_layers=None,
                    total_loss_dict=None, track_names=None):
    me = ("rank", dist.get_rank())
    names = _moe_logging_state()
    saved = {n: getattr(moe_logging, n) for n in names}
    foreign = sum(1 for v in saved.values() if isinstance(v, tuple) and v[:1] == ("rank",))
    for n in names:
        setattr(moe_logging, n, me)  # the other ranks run while this one waits below
    _CALLS.append(dist.get_rank())
    t = __import__("torch").tensor([float(len(_CALLS))])
    dist.all_reduce(t)
    kept = sum(1 for n in names if getattr(moe_logging, n) == me)
    for n, v in saved.items():
        setattr(moe_logging, n, v)
    return {"calls_seen_here": float(len(_CALLS)), "sum": float(t.item()),
            "pp_rank_from_megatron": float(__import__("megatron.core.parallel_state",
                fromlist=["x"]).get_pipeline_model_parallel_rank()),
            "moe_logging_globals": float(len(names)), "foreign_seen": float(foreign),
            "own_kept": float(kept)}
"""


def test_each_rank_has_its_own_module_state_and_megatron_state(
    inprocess_pool: TrackingPool, tmp_path: Path
) -> None:
    """Module-level state of the target is per rank (a rank process has its own),
    parallel_state answers each rank's own pipeline rank, and every tracker ``moe_logging``
    keeps in a module global (dev adds ``_MOE_OVERLOAD_FACTOR_TRACKER``) is each rank's own."""
    path = tmp_path / "isolation_target.py"
    path.write_text(ISOLATION_TARGET)
    world = WorldSpec(pp=2, dp=2)
    run = inprocess_pool.run(_scenario(world, target=str(path)))
    assert run.outcome.kind == "ok", run.outcome.message
    for rank, result in run.ranks.items():
        assert result.done is not None
        value = result.done.reports[0].value
        assert value["calls_seen_here"] == 1.0, (rank, value)
        assert value["sum"] == 4.0, (rank, value)
        assert value["pp_rank_from_megatron"] == float(result.place.pp_rank), (rank, value)
        assert value["moe_logging_globals"] >= 1.0, (rank, value)
        assert value["foreign_seen"] == 0.0, (rank, value)
        assert value["own_kept"] == value["moe_logging_globals"], (rank, value)


# -- faults: an outcome with stacks, nothing left ------------------------------------------------


def _fault_target(tmp_path: Path, body: str) -> str:
    path = tmp_path / "fault_target.py"
    path.write_text(
        "import os, time, torch.distributed as dist\n\n"
        "def get_moe_metrics(loss_scale, **kwargs):\n" + textwrap.indent(body, "    ") + "\n"
    )
    return str(path)


@pytest.fixture
def own_pool() -> Iterator[TrackingPool]:
    with tracking_pool("inprocess") as tracking:
        yield tracking


@pytest.mark.parametrize(
    ("body", "where"),
    [
        ("if dist.get_rank() == 1:\n    time.sleep(3600)\nreturn {}", "time.sleep"),
        ("if dist.get_rank() == 1:\n    while True:\n        pass\nreturn {}", "while True"),
    ],
    ids=["sleep", "spin"],
)
def test_a_rank_that_blocks_outside_a_collective_times_out_with_stacks(
    own_pool: TrackingPool, tmp_path: Path, body: str, where: str
) -> None:
    scenario = _scenario(WorldSpec(pp=2), target=_fault_target(tmp_path, body))
    scenario = scenario.model_copy(update={"deadline_s": 2.0})
    run = own_pool.run(scenario)
    assert run.outcome.kind == "timeout", run.outcome.message
    assert not run.reusable
    assert 1 in run.outcome.stacks and where in run.outcome.stacks[1], run.outcome.stacks
    assert "fault_target.py" in run.outcome.stacks[1]


def test_a_rank_that_ends_the_process_is_a_crash(own_pool: TrackingPool, tmp_path: Path) -> None:
    target = _fault_target(tmp_path, "if dist.get_rank() == 1:\n    os._exit(3)\nreturn {}")
    run = own_pool.run(_scenario(WorldSpec(pp=2), target=target))
    assert run.outcome.kind == "crash", run.outcome.message
    assert "exit code 3" in run.outcome.message
    assert not run.reusable


def test_scenarios_sent_ahead_are_each_answered_with_their_own_run(
    own_pool: TrackingPool,
) -> None:
    """Tasks sent ahead run in the order sent; each `run` returns its own scenario's outcome
    whatever the order it is asked in, as a run not sent ahead would."""
    world = WorldSpec(pp=2, dp=2)
    first, second = _scenario(world, seed=3), _scenario(world, seed=4)
    alone = {id(s): _fingerprint(own_pool.run(s)) for s in (first, second)}
    assert alone[id(first)] != alone[id(second)]  # the test can tell them apart
    assert own_pool.send_ahead(first) and own_pool.send_ahead(second)
    assert _fingerprint(own_pool.run(second)) == alone[id(second)]
    assert _fingerprint(own_pool.run(first)) == alone[id(first)]
    assert own_pool.started == 1


def test_a_scenario_sent_ahead_of_a_crash_runs_in_a_fresh_world(
    own_pool: TrackingPool, tmp_path: Path
) -> None:
    """The world a crash leaves dirty is ended with the task sent behind it, even while that
    task is the one asked for (the crash's answer comes first): it is run in a fresh world,
    not reported as the crash or lost."""
    world = WorldSpec(pp=2)
    target = _fault_target(tmp_path, "if dist.get_rank() == 1:\n    os._exit(3)\nreturn {}")
    crash, after = _scenario(world, target=target), _scenario(world, seed=4)
    expected = _fingerprint(own_pool.run(after))
    assert own_pool.send_ahead(crash) and own_pool.send_ahead(after)
    assert _fingerprint(own_pool.run(after)) == expected
    assert own_pool.run(crash).outcome.kind == "crash"


def test_deadlock_and_mismatch_are_decided_as_in_the_process_tier(
    tiers: tuple[TrackingPool, TrackingPool], tmp_path: Path
) -> None:
    cases = {
        "deadlock": "if dist.get_rank() == 0:\n    return {}\n"
        "t = __import__('torch').zeros(1)\ndist.all_reduce(t)\nreturn {}",
        "mismatch": "t = __import__('torch').zeros(1 + dist.get_rank())\n"
        "dist.all_reduce(t)\nreturn {}",
    }
    for kind, body in cases.items():
        directory = tmp_path / kind
        directory.mkdir()
        scenario = _scenario(WorldSpec(pp=2), target=_fault_target(directory, body))
        runs = [pool.run(scenario) for pool in tiers]
        assert [r.outcome.kind for r in runs] == [kind, kind], [r.outcome.message for r in runs]
        assert runs[1].reusable
        assert runs[1].outcome.pending.keys() == runs[0].outcome.pending.keys()


# -- scale --------------------------------------------------------------------------------------


def test_a_world_of_64_ranks(inprocess_pool: TrackingPool) -> None:
    """pp 4 x tp 2 x dp 8 with a dense first stage: every rank returns the oracle's values."""
    world = WorldSpec(tp=2, pp=4, dp=8)
    layout = ModelLayout(num_layers=4, moe_layer_freq=[0, 1, 1, 1])
    setup = Setup(world=world, layout=layout)
    from pipemetrics.sim.model.topology import coordinates

    records = {
        rank: [moe("load_balancing_loss", layer, 0.5 + rank / 64, layout.num_layers)
               for layer in setup.stage_layer_numbers(coordinates(world, rank)["pp"])
               if layer > 1]
        for rank in range(world.world_size)
    }  # fmt: skip
    scenario = Scenario(
        setup=setup,
        steps=[Step(records=StepRecords(moe=records),
                    calls=[MoeCall(num_layers=4, track_names=["load_balancing_loss"])])],
        deadline_s=120.0,
        property="moe.values",
        profile="seed",
    )  # fmt: skip
    run = inprocess_pool.run(scenario)
    assert run.outcome.kind == "ok", run.outcome.message
    assert len(run.ranks) == 64
    assert judge_run(scenario, run) == [], judge_run(scenario, run)


# -- check --tier inprocess: failures are confirmed on the process tier -------------------------

#: Correct in a real world; wrong when every rank shares one process (it compares pids): the
#: in-process tier fails it and the process tier does not, which must be reported as a fault
#: of pipemetrics, never as the target's failure.
PID_SENSITIVE_TARGET = """
import os
import torch.distributed as dist
from pipemetrics.reference import broadcast_tensor as _reference


def broadcast_tensor(tensor, src_rank, group):
    pids = [None] * dist.get_world_size(group)
    dist.all_gather_object(pids, os.getpid(), group=group)
    out = _reference(tensor, src_rank, group)
    return out + 1 if len(pids) > 1 and len(set(pids)) == 1 else out
"""


def test_check_on_the_inprocess_tier_confirms_failures_on_the_process_tier(
    tmp_path: Path, bounds: Bounds
) -> None:
    mutant = write_mutant("moe_empty_stage_returns_early", tmp_path / "mutants")
    # a confirmed failure is the point, not the smallest one: shrinking gets 3 s
    code, data, output = check(
        tmp_path, "--impl", str(mutant), "--only", "moe.no_hang", "--tier", "inprocess",
        "--max-examples", "60", "--seed", "0", "--shrink-seconds", "3", bounds=bounds,
    )  # fmt: skip
    assert code == 1 and data is not None, output
    assert data["tier"] == "inprocess"
    (entry,) = data["properties"]
    assert entry["status"] == "fail" and entry["confirmed"] is True, entry
    assert entry["replay"]


def test_a_failure_only_the_inprocess_tier_sees_is_a_fault_of_pipemetrics(
    tmp_path: Path, bounds: Bounds
) -> None:
    target = tmp_path / "pid_sensitive.py"
    target.write_text(PID_SENSITIVE_TARGET)
    code, data, output = check(
        tmp_path, "--impl", str(target), "--only", "broadcast.roundtrip", "--tier",
        "inprocess", "--max-examples", "10", "--seed", "0", bounds=bounds,
    )  # fmt: skip
    assert data is not None, output
    (entry,) = data["properties"]
    assert entry["status"] == "error" and entry["confirmed"] is False, entry
    assert (
        "the in-process tier failed this example but the process tier passes it"
        in (entry["message"])
    )
    assert code == 1, output


ALL_COLLECTIVES = Path(__file__).with_name("all_collectives_target.py")


@pytest.mark.parametrize("world", [WorldSpec(pp=2), WorldSpec(pp=2, dp=2)], ids=["2", "4"])
def test_the_tiers_agree_on_every_collective_and_reduce_op(
    tiers: tuple[TrackingPool, TrackingPool], world: WorldSpec
) -> None:
    """Every collective the interposer knows (the object ones, every reduce op, both root
    forms, async_op, the barriers) moves the same data on both tiers."""
    scenario = Scenario(
        setup=Setup(world=world, layout=ModelLayout(num_layers=world.pp)),
        target=str(ALL_COLLECTIVES),
        steps=[Step(calls=[RoundUpCall(value=3, multiple=2)])],
        deadline_s=60.0,
    )
    process, inprocess = (pool.run(scenario) for pool in tiers)
    assert process.outcome.kind == inprocess.outcome.kind == "ok", inprocess.outcome.message
    assert not differences(process, inprocess, ("process", "inprocess"))
    for result in inprocess.ranks.values():
        assert result.done is not None
        value = result.done.reports[0].value
        assert set(value) >= {f"all_reduce_{op}" for op in ("SUM", "AVG", "BXOR")}, value
        assert value["async_wait"] is True


@pytest.mark.parametrize("strided", [False, True], ids=["transposed", "strided"])
def test_the_tiers_scramble_a_non_contiguous_source_alike(
    tiers: tuple[TrackingPool, TrackingPool], tmp_path: Path, strided: bool
) -> None:
    """A copy that sends a non-contiguous source as it is: gloo delivers its storage as it
    lies, scrambled, without an error; the in-process tier delivers the same, so a seed run on
    either tier fails it (and the reference, which sends a contiguous copy, passes on both)."""
    from pipemetrics.sim.model.calls import BroadcastCall
    from pipemetrics.sim.model.values import make_tensor

    call = BroadcastCall(src_rank=0, shape=[3, 2], non_contiguous=True, strided=strided)
    source = make_tensor([3, 2], "float32", 0, True, strided)
    storage = source.as_strided((6,), (1,)).tolist()  # what gloo sends from the data pointer
    for target, want in (
        (str(write_mutant("broadcast_source_not_contiguous", tmp_path)), storage),
        ("pipemetrics.reference", source.reshape(-1).tolist()),
    ):
        scenario = Scenario(
            setup=Setup(world=WorldSpec(pp=2), layout=ModelLayout(num_layers=2)),
            target=target, steps=[Step(calls=[call])], deadline_s=60.0,
        )  # fmt: skip
        process, inprocess = (pool.run(scenario) for pool in tiers)
        assert not differences(process, inprocess, ("process", "inprocess"))
        done = inprocess.ranks[1].done
        assert done is not None
        assert done.reports[0].value["__tensor__"]["values"] == want, target
    assert storage != source.reshape(-1).tolist()
