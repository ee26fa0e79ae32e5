"""The simulator in real gloo worlds: outcomes for broken targets, raw mode, faults, cleanup.

Each test bounds its own wall time through the scenario deadline (and subprocess timeouts), and
the module's pool asserts at the end that no rank process or world directory survived.
"""

from __future__ import annotations

import io
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from pipemetrics.properties.engine import PropertyResult
from pipemetrics.properties.report import print_failures, report_json
from pipemetrics.properties.verdict import judge_run
from pipemetrics.sim.collectives.own_lines import TargetLine, lines_json
from pipemetrics.sim.collectives.protocol import RunMode
from pipemetrics.sim.mcore import installed_features
from pipemetrics.sim.model.calls import MoeCall, MtpCall
from pipemetrics.sim.model.layout import (
    ExplicitSplit,
    ModelLayout,
    Setup,
    WorldSpec,
)
from pipemetrics.sim.model.records import ROUTER_REDUCTION, MoeRecord, StepRecords, router_record
from pipemetrics.sim.model.scenario import Scenario, Step, save_scenario
from pipemetrics.sim.model.topology import places_for
from pipemetrics.sim.results.summary import layout_picture, summarize, target_lines, what_ranks_did

from .broken.mutants import write_mutant
from .conftest import (
    Bounds,
    Lines,
    TrackingPool,
    assert_no_leftovers,
    assert_nothing_left,
    pid_alive,
    private_tmpdir,
)
from .test_own_lines import RETURNS_EARLY, returns_early_lines, write_fault_copy

SETUP = Setup(world=WorldSpec(pp=2), layout=ModelLayout(num_layers=2, moe_layer_freq=[0, 1]))
RECORDS = StepRecords(
    moe={
        1: [
            MoeRecord(
                name="load_balancing_loss",
                layer_number=2,
                value=2.0,
                num_layers=2,
                reduce="tp_cp",
            )
        ]
    }
)
MOE = MoeCall(loss_scale=1.0, num_layers=2, track_names=["load_balancing_loss"])


def scenario_for(target: Path | str, *, deadline_s: float = 30.0, setup: Setup = SETUP) -> Scenario:
    return Scenario(
        setup=setup,
        target=str(target),
        steps=[Step(records=RECORDS, calls=[MOE])],
        deadline_s=deadline_s,
    )


def write_target(directory: Path, name: str, body: str) -> Path:
    path = directory / f"{name}.py"
    path.write_text(textwrap.dedent(body), encoding="utf-8")
    return path


def test_reference_is_clean(pool: TrackingPool) -> None:
    run = pool.run(scenario_for("pipemetrics.reference"))
    assert not judge_run(scenario_for("pipemetrics.reference"), run), run.outcome.message
    assert run.reusable and run.collectives_released > 0


def test_skipped_pipeline_all_reduce_is_a_deadlock_naming_the_call_site(
    pool: TrackingPool, tmp_path: Path
) -> None:
    target = write_target(
        tmp_path,
        "skips_empty",
        """
        import torch.distributed as dist
        from megatron.core import parallel_state
        from pipemetrics.reference.megatron_common import get_moe_metrics_tracker  # any release

        def get_moe_metrics(loss_scale, total_loss_dict=None, per_layer_logging=False,
                            num_layers=None, mtp_num_layers=None, track_names=None):
            tracker = get_moe_metrics_tracker()
            out = {}
            for name, entry in tracker.metrics.items():  # an empty stage skips the loop
                dist.all_reduce(entry.values,
                                group=parallel_state.get_pipeline_model_parallel_group())
                out[name] = float(entry.values.mean()) * loss_scale
            tracker.clear()
            return out
        """,
    )
    run = pool.run(scenario_for(target))
    outcome = run.outcome
    assert outcome.kind == "deadlock", outcome.message
    assert "rank 0 returned" in outcome.message
    assert f"{target}:11 in get_moe_metrics" in outcome.message
    assert outcome.latency_ms is not None  # the speed itself is measured by pipemetrics bench
    assert run.reusable, "a prevented deadlock leaves the process group untouched"


def test_a_hang_of_a_broken_copy_names_its_own_lines_in_the_write_up_json_and_replay(
    pool: TrackingPool, tmp_path: Path
) -> None:
    """The blocked rank's and the returned rank's own line in the copy (found in its source),
    in the failure write-up, the JSON report, the picture and the replay's account: one run, in
    the module's live pp=2 world."""
    path = write_mutant(RETURNS_EARLY, tmp_path)
    blocked_line, returned_line = returns_early_lines(path)
    blocked = f"{path}:{blocked_line} in _sync"
    returned = f"{path}:{returned_line} in get_moe_metrics"
    scenario = scenario_for(path)
    run = pool.run(scenario)
    assert run.outcome.kind == "deadlock", run.outcome.message
    # the failure as the engine keeps it: its write-up and its picture, made from the run
    result = PropertyResult(
        "moe.no_hang", "get_moe_metrics", "fail", message=run.outcome.text(),
        details=what_ranks_did(run), picture=layout_picture(scenario, run),
        counterexample=scenario.model_dump(mode="json"), target_lines=lines_json(target_lines(run)),
    )  # fmt: skip
    out = io.StringIO()
    print_failures([result], out)
    write_up = out.getvalue()
    assert f"rank 1: blocked in all_reduce at {blocked}" in write_up, write_up
    assert f"rank 0: returned from {returned}" in write_up, write_up
    # the picture, clipped on the left to its width, keeps file name, line and function
    picture = result.picture or ""
    assert f"{path.name}:{blocked_line} in _sync" in picture, picture
    assert "rank 0  returned from" in picture, picture
    assert f"{path.name}:{returned_line} in get_moe_metrics" in picture, picture
    (entry,) = report_json(str(path), "seed", [result], {})["properties"]
    lines = entry["target_lines"]
    assert lines["1"]["state"] == "blocked" and lines["1"]["what"] == "all_reduce", lines
    assert (lines["1"]["file"], lines["1"]["line"]) == (str(path), blocked_line)
    assert lines["1"]["function"] == "_sync"
    assert lines["0"]["state"] == "returned" and lines["0"]["site"] == returned, lines
    # the replay's account (``pipemetrics replay`` prints `summarize`) and its JSON's lines
    account = summarize(scenario, run)
    assert f"rank 1: blocked in all_reduce at {blocked}" in account
    assert f"rank 0: returned from {returned}" in account


def test_size_mismatch_is_reported_before_the_backend_sees_it(
    pool: TrackingPool, tmp_path: Path
) -> None:
    target = write_target(
        tmp_path,
        "preinit_short",
        """
        import torch, torch.distributed as dist
        from megatron.core import parallel_state

        def get_moe_metrics(loss_scale, num_layers=None, mtp_num_layers=None, **_):
            n = num_layers + (1 if parallel_state.is_pipeline_last_stage() else 0)
            dist.all_reduce(torch.zeros(n),
                            group=parallel_state.get_pipeline_model_parallel_group())
            return {}
        """,
    )
    run = pool.run(scenario_for(target))
    assert run.outcome.kind == "mismatch", run.outcome.message
    assert "tensor" in run.outcome.message and "float32[2]" in run.outcome.message


def test_raise_on_one_rank_is_a_deadlock_with_the_exception(
    pool: TrackingPool, tmp_path: Path
) -> None:
    target = write_target(
        tmp_path,
        "raises_rank0",
        """
        import torch, torch.distributed as dist
        def get_moe_metrics(loss_scale, **_):
            if dist.get_rank() == 0:
                raise RuntimeError("only rank 0 is unhappy")
            dist.all_reduce(torch.zeros(2))
            return {}
        """,
    )
    run = pool.run(scenario_for(target))
    assert run.outcome.kind == "deadlock", run.outcome.message
    done = run.ranks[0].done
    assert done is not None and done.reports[0].error is not None
    assert "only rank 0 is unhappy" in done.reports[0].error.message


def test_raw_mode_confirms_the_hang_with_stacks(pool: TrackingPool, tmp_path: Path) -> None:
    target = write_target(
        tmp_path,
        "raw_hang",
        """
        import torch, torch.distributed as dist
        def get_moe_metrics(loss_scale, **_):
            if dist.get_rank() == 1:
                dist.all_reduce(torch.zeros(2))
            return {}
        """,
    )
    run = pool.run(scenario_for(target, deadline_s=3.0), mode=RunMode.RAW)
    assert run.outcome.kind == "timeout", run.outcome.message
    assert not run.reusable
    assert "all_reduce" in run.outcome.stacks.get(1, ""), run.outcome.stacks


def test_crash_of_one_rank(pool: TrackingPool, tmp_path: Path) -> None:
    target = write_target(
        tmp_path,
        "exits",
        """
        import os, torch, torch.distributed as dist
        def get_moe_metrics(loss_scale, **_):
            if dist.get_rank() == 1:
                os._exit(3)
            dist.all_reduce(torch.zeros(2))
            return {}
        """,
    )
    world = pool.world(SETUP.world)
    run = pool.run(scenario_for(target))
    assert run.outcome.kind in ("crash", "deadlock"), run.outcome.message
    assert "rank 1" in run.outcome.message
    if run.outcome.kind == "crash":
        assert run.outcome.crashed == {1: 3}
        assert not run.reusable
        assert not any(pid_alive(p) for p in world.pids)
    after = pool.run(scenario_for("pipemetrics.reference"))
    assert after.outcome.kind == "ok", "the pool must start a fresh world after a crash"


@pytest.mark.parametrize("kind", ["exit", "segfault", "killed", "sleep"])
def test_a_rank_that_dies_or_outlives_the_deadline_has_its_own_line(
    pool: TrackingPool, tmp_path: Path, kind: str
) -> None:
    """A copy of the reference whose rank 1 ends its process (``os._exit``, a segfault), is
    killed, or sleeps past the deadline at a known line of ``get_moe_metrics``: the line where
    the process left one (the os._exit record, the fatal signal's traceback, the stack at the
    deadline), in the write-up, the picture and the JSON; for the kill, no line, and why."""
    path, line = write_fault_copy(kind, tmp_path)
    fault = f"{path}:{line} in get_moe_metrics"
    scenario = scenario_for(path, deadline_s=4.0)
    run = pool.run(scenario)
    lines = target_lines(run)
    expected = {
        "exit": TargetLine(state="died", site=fault, what="os._exit(3)"),
        "segfault": TargetLine(state="died", site=fault, what="SIGSEGV"),
        "sleep": TargetLine(state="running", site=fault),
    }
    assert run.outcome.kind == ("timeout" if kind == "sleep" else "crash"), run.outcome.message
    if kind == "killed":
        own = lines[1]
        assert (own.state, own.site, own.what) == ("died", None, "killed by SIGKILL"), own
        assert own.note is not None and own.note.startswith("no line: SIGKILL"), own
        assert "; last seen entering " in own.note and f" at {path}:" in own.note, own
        assert "rank 1: died (killed by SIGKILL): no line: SIGKILL" in what_ranks_did(run)
        return
    assert lines[1] == expected[kind], lines
    if kind == "sleep":  # rank 0 waits in the pipeline reduction meanwhile
        assert lines[0].state == "blocked" and lines[0].what == "all_reduce", lines
    assert f"rank 1: {expected[kind].text()}" in what_ranks_did(run)
    assert f"rank 1: {expected[kind].text()}" in summarize(scenario, run)  # replay's account
    assert f"{path.name}:{line} in get_moe_metrics" in layout_picture(scenario, run)
    own_json = lines_json(lines)["1"]
    assert (own_json["file"], own_json["line"], own_json["note"]) == (str(path), line, None)


def test_sleeping_forever_hits_the_deadline_with_stacks(pool: TrackingPool, tmp_path: Path) -> None:
    target = write_target(
        tmp_path,
        "sleeps",
        """
        import time
        def get_moe_metrics(loss_scale, **_):
            time.sleep(3600)
        """,
    )
    run = pool.run(scenario_for(target, deadline_s=2.0))
    assert run.outcome.kind == "timeout"
    assert "sleep" in run.outcome.stacks.get(0, ""), run.outcome.stacks
    assert not run.reusable


def test_stray_thread_and_megabytes_of_output_do_not_disturb(
    pool: TrackingPool, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    target = write_target(
        tmp_path,
        "noisy",
        """
        import sys, threading, time
        def get_moe_metrics(loss_scale, **_):
            threading.Thread(target=lambda: time.sleep(3600)).start()  # never ends
            sys.stdout.write("x" * 3_000_000)
            return {"fine": 1.0}
        """,
    )
    run = pool.run(scenario_for(target))
    assert run.outcome.kind == "ok"
    assert len(capfd.readouterr().out) < 100_000, "rank output must go to the rank's log"


def test_reference_clean_over_random_router_layouts(pool: TrackingPool) -> None:
    rng = random.Random(20261202)
    shapes = [WorldSpec(pp=2), WorldSpec(pp=2, dp=2), WorldSpec(tp=2, pp=2)]
    # The types the installed router runs (global_aux_loss: 0.15+); the same list, so the same
    # draws, where it runs all three.
    routing_types = ["aux_loss", "seq_aux_loss", "global_aux_loss"]
    if not installed_features().routing.global_aux_loss:
        routing_types.remove("global_aux_loss")
    for _ in range(6):
        world = rng.choice(shapes)
        num_layers = rng.choice([2, 4])
        freq = [rng.choice([0, 1]) for _ in range(num_layers)]
        layout = ModelLayout(
            num_layers=num_layers,
            moe_layer_freq=freq,
            mtp_num_layers=rng.choice([0, 1]),
            routing_type=rng.choice(routing_types),
            z_loss_coeff=rng.choice([None, 0.001]),
            microbatches=rng.choice([1, 2]),
            split=ExplicitSplit(layers=[1, num_layers - 1]),
        )
        scenario = Scenario(
            setup=Setup(world=world, layout=layout),
            mode="router",
            seed=rng.randrange(1000),
            steps=[
                Step(
                    calls=[
                        MoeCall(
                            loss_scale=1 / layout.microbatches,
                            per_layer_logging=True,
                            num_layers=num_layers,
                            mtp_num_layers=layout.mtp_num_layers,
                            track_names=layout.live_track_names,
                        ),
                        MtpCall(loss_scale=1 / layout.microbatches),
                    ]
                )
            ]
            * 2,
        )
        run = pool.run(scenario)
        assert not judge_run(scenario, run), (layout, run.outcome.message)


def test_reference_clean_over_random_synthetic_records(pool: TrackingPool) -> None:
    rng = random.Random(7)
    names = list(ROUTER_REDUCTION)
    for world in (WorldSpec(pp=2, dp=2), WorldSpec(pp=4)):
        for _ in range(3):
            length = 4
            per_rank: dict[int, list[MoeRecord]] = {}
            for rank in range(world.world_size):
                chosen = rng.sample(names, rng.randrange(0, len(names) + 1))
                per_rank[rank] = []
                per_rank[rank] += [
                    router_record(name, rng.randrange(1, length + 1), rng.uniform(-10, 10), length)
                    for name in chosen
                ]
            scenario = Scenario(
                setup=Setup(world=world, layout=ModelLayout(num_layers=4)),
                steps=[Step(records=StepRecords(moe=per_rank), calls=[MoeCall(loss_scale=0.25)])],
            )
            run = pool.run(scenario)
            assert not judge_run(scenario, run), run.outcome.message


# -- the controller going away --------------------------------------------------------------------

CONTROLLER = """
import signal, sys, time
# Python keeps SIGINT ignored when it starts that way (a background job of a non-interactive
# shell, some CI runners): this controller must see it whatever started the test run
signal.signal(signal.SIGINT, signal.default_int_handler)
from pipemetrics.sim.model.layout import WorldSpec
from pipemetrics.sim.mcore import installed_features
from pipemetrics.sim.worlds.world import World, _forkserver_directory
world = World(WorldSpec(pp=2)).start()
print(" ".join(map(str, world.pids)), world.directory, *_forkserver_directory(), flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT])
def test_nothing_survives_the_controller(
    how: signal.Signals, tmp_path: Path, bounds: Bounds
) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", CONTROLLER], stdout=subprocess.PIPE, text=True, cwd=tmp_path
    )
    try:
        assert proc.stdout is not None
        lines = Lines(proc.stdout)
        assert lines.wait_for("pipemetrics-world-", bounds(6, 60)), "no world was started"
        line = lines.seen[0].split()
        pids, dirs = {int(line[0]), int(line[1])}, set(line[2:])
        os.kill(proc.pid, how)
        proc.wait(timeout=bounds(3, 30))
        deadline = time.monotonic() + bounds(1, 10)
        while time.monotonic() < deadline and (
            any(pid_alive(p) for p in pids) or any(os.path.exists(d) for d in dirs)
        ):
            time.sleep(0.1)
        assert_nothing_left(pids, dirs)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_replay_cli_reproduces_an_outcome(tmp_path: Path, bounds: Bounds) -> None:
    target = write_target(
        tmp_path,
        "raises_rank0",
        """
        import torch, torch.distributed as dist
        def get_moe_metrics(loss_scale, **_):
            if dist.get_rank() == 0:
                raise RuntimeError("boom")
            dist.all_reduce(torch.zeros(2))
            return {}
        """,
    )
    path = save_scenario(scenario_for(target), tmp_path / "scenario.json")
    out = tmp_path / "run.json"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipemetrics.commands.cli",
            "replay",
            str(path),
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=bounds(18, 180),
    )
    assert result.returncode == 1, result.stderr
    assert "outcome: deadlock" in result.stdout
    replayed = json.loads(out.read_text())
    assert replayed["run"]["outcome"]["kind"] == "deadlock" and not replayed["passed"]
    # the target's own lines: rank 0 raised at line 5, rank 1 entered the all_reduce at line 6
    assert f"rank 0: raised RuntimeError at {target}:5 in get_moe_metrics" in result.stdout
    own = replayed["target_lines"]
    assert (own["0"]["state"], own["0"]["line"]) == ("raised", 5), own
    assert (own["1"]["state"], own["1"]["line"], own["1"]["file"]) == ("blocked", 6, str(target))
    fixed = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipemetrics.commands.cli",
            "replay",
            str(path),
            "--impl",
            "pipemetrics.reference",
        ],
        capture_output=True,
        text=True,
        timeout=bounds(18, 180),
    )
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr


@pytest.mark.parametrize(
    "content, field",
    [
        ("{not json", "<file>"),
        ('{"setup": {"layout": {"num_layers": 0}}, "steps": []}', "setup.layout.num_layers"),
        ('{"setup": {"world": {"pp": 4}, "layout": {"num_layers": 2}}, "steps": []}', "setup"),
    ],
)
def test_bad_scenario_files_are_clear_errors(
    tmp_path: Path, bounds: Bounds, content: str, field: str
) -> None:
    path = tmp_path / "bad.json"
    path.write_text(content)
    result = subprocess.run(
        [sys.executable, "-m", "pipemetrics.commands.cli", "replay", str(path)],
        capture_output=True,
        text=True,
        timeout=bounds(12, 120),
    )
    assert result.returncode == 2
    assert "not a valid pipemetrics scenario" in result.stderr and field in result.stderr
    assert "Traceback" not in result.stderr


def test_torchrun_runs_the_same_scenario(tmp_path: Path, bounds: Bounds) -> None:
    scenario = scenario_for("pipemetrics.reference")
    path = save_scenario(scenario, tmp_path / "scenario.json")
    torchrun = Path(sys.executable).with_name("torchrun")
    with private_tmpdir() as tmp:  # torchrun writes its log directory under TMPDIR
        result = subprocess.run(
            [
                str(torchrun),
                "--standalone",
                "--nproc-per-node",
                "2",
                "-m",
                "pipemetrics.commands.torchrun",
                str(path),
            ],
            capture_output=True,
            text=True,
            timeout=bounds(24, 240),
            env={**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp)},
        )
        assert_no_leftovers(tmp)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "judged by the whole run (a scenario without a property): PASS" in result.stdout


def test_raising_inside_a_released_collective_is_diagnosed_not_timed_out(
    pool: TrackingPool, tmp_path: Path
) -> None:
    target = write_target(
        tmp_path,
        "unpicklable",
        """
        import torch.distributed as dist
        def get_moe_metrics(loss_scale, **_):
            out = [None] * dist.get_world_size()
            dist.all_gather_object(out, (lambda: 1) if dist.get_rank() == 0 else 1)
            return {}
        """,
    )
    run = pool.run(scenario_for(target, deadline_s=600.0))
    # A deadlock outcome, not a timeout: decided when the rank reported, not at the deadline.
    assert run.outcome.kind == "deadlock", run.outcome.message
    assert "rank 0 raised inside all_gather_object" in run.outcome.message
    assert not run.reusable


def test_classes_defined_in_a_path_target_pickle_between_ranks(
    pool: TrackingPool, tmp_path: Path
) -> None:
    target = write_target(
        tmp_path,
        "dataclass_meta",
        """
        import dataclasses, torch.distributed as dist
        @dataclasses.dataclass
        class Meta:
            rank: int
        def get_moe_metrics(loss_scale, **_):
            out = [None] * dist.get_world_size()
            dist.all_gather_object(out, Meta(dist.get_rank()))
            return {"ranks": float(sum(m.rank for m in out))}
        """,
    )
    run = pool.run(scenario_for(target))
    assert run.outcome.kind == "ok", run.outcome.message
    for result in run.ranks.values():
        assert result.done is not None and result.done.reports[0].value == {"ranks": 1.0}


def test_too_long_tmpdir_is_a_clear_start_error(tmp_path: Path, bounds: Bounds) -> None:
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    code = (
        "from pipemetrics.sim import World, WorldSpec, WorldStartError\n"
        "try:\n"
        "    World(WorldSpec(pp=2)).start()\n"
        "except WorldStartError as exc:\n"
        "    print(exc)\n"
        "    raise SystemExit(3)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=bounds(18, 180),
        env={**os.environ, "TMPDIR": str(deep)},
    )
    assert result.returncode == 3, result.stdout + result.stderr
    assert "TMPDIR" in result.stdout and "shorter directory" in result.stdout
    ours = [*deep.glob("pipemetrics-world-*"), *deep.glob("pymp-*")]
    assert not ours, f"left in TMPDIR: {ours}"


@pytest.mark.parametrize("world", [WorldSpec(pp=2, dp=2), WorldSpec(tp=2, pp=2)])
def test_live_places_match_the_arithmetic(pool: TrackingPool, world: WorldSpec) -> None:
    assert pool.world(world).places == places_for(world)


def test_a_legacy_layout_steps_key_is_ignored() -> None:
    """Scenario files written before ``ModelLayout.steps`` was removed still load."""
    layout = ModelLayout.model_validate({"num_layers": 2, "steps": 1})
    assert layout == ModelLayout(num_layers=2)
    assert "steps" not in layout.model_dump()


def test_a_fork_server_started_on_its_own_preloads_the_rank_code(bounds: Bounds) -> None:
    """`start_forkserver` called before any world (a test helper, the probe) starts the server
    every later world of the process forks from: it must preload torch, megatron-core and the
    rank code, or each rank imports them itself (seconds a rank, for the process's life)."""
    script = textwrap.dedent(
        """
        import time
        from multiprocessing import forkserver
        from pipemetrics.sim.worlds.world import PRELOAD, start_forkserver, stop_forkserver
        start_forkserver()
        pid = forkserver._forkserver._forkserver_pid
        # the server is forked, then execs its own command line: until then /proc shows ours
        while True:
            with open(f"/proc/{pid}/cmdline", "rb") as handle:
                command = handle.read().decode()
            if "forkserver import main" in command:  # its main, not this script
                break
            time.sleep(0.01)
        stop_forkserver()
        print("preloads", all(repr(name) in command for name in PRELOAD))
        """
    )
    result = run_script(script, bounds(3, 60))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "preloads True" in result.stdout, result.stdout


def test_a_world_starts_after_the_fork_server_was_stopped(bounds: Bounds) -> None:
    """`stop_forkserver` (what every CLI command does at its end, also when called in-process)
    forgets the server, so the next world of the process starts a new one. In its own process:
    stopping the fork server of this test process would take the module pool's worlds along."""
    script = textwrap.dedent(
        """
        from pipemetrics.sim.model.layout import WorldSpec
        from pipemetrics.sim.worlds.world import World, stop_forkserver
        for _ in range(2):
            with World(WorldSpec()) as world:
                assert world.alive
            stop_forkserver()
        print("two worlds")
        """
    )
    result = run_script(script, bounds(6, 120))
    assert result.returncode == 0 and "two worlds" in result.stdout, result.stderr[-3000:]


def run_script(script: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """Run ``script`` in a Python process of its own with a private TMPDIR, bounded by
    ``timeout``; assert that it left nothing there."""
    with private_tmpdir() as tmp:
        result = subprocess.run(
            [sys.executable, "-c", script],
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**os.environ, "TMPDIR": str(tmp), "OMP_NUM_THREADS": "1"},
        )
        assert_no_leftovers(tmp)
    return result
