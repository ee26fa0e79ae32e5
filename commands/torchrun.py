"""Run a scenario under torchrun (torch.distributed.elastic), e.g. on a real NCCL cluster.

    torchrun --nproc-per-node 4 -m pipemetrics.commands.torchrun scenario.json [--impl TARGET]

Every process is one rank and serves the scenario with the same `RankServer` as a simulated
world, in raw mode: the real backend, no interposition, under a deadline after which each rank
dumps its Python stack to stderr and exits 124. On success the ranks gather their reports and
rank 0 prints the same summary as ``pipemetrics replay``. Exit codes: 0 pass, 1 fail, 2 bad
input, 124 deadline.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import sys
import threading
from collections.abc import Sequence

import torch.distributed as dist

from pipemetrics.sim.collectives.coordinator import Outcome
from pipemetrics.sim.collectives.protocol import Done, RunMode, Task
from pipemetrics.sim.model.scenario import ScenarioFileError, load_scenario
from pipemetrics.sim.model.target import TargetLoadError, precheck_target
from pipemetrics.sim.results.summary import summarize
from pipemetrics.sim.worlds.rank import RankServer, join_world
from pipemetrics.sim.worlds.world import RankResult, WorldRun

DEADLINE_EXIT = 124


def _arm_deadline(seconds: float) -> threading.Timer:
    def expire() -> None:
        print(f"pipemetrics: deadline of {seconds:g} s passed; stacks follow", file=sys.stderr)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
        os._exit(DEADLINE_EXIT)

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()
    return timer


def _outcome(done: list[Done]) -> Outcome:
    faults = [d for d in done if d.harness_error is not None]
    if faults:
        err = faults[0].harness_error
        assert err is not None
        return Outcome(kind="harness_error", message=f"rank {faults[0].rank}: {err.message}")
    return Outcome(
        kind="ok",
        message="every rank returned (raw mode under torchrun: collectives ran unintercepted)",
        finished=[d.rank for d in done],
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipemetrics.commands.torchrun")
    parser.add_argument("scenario")
    parser.add_argument("--impl", default=None)
    args = parser.parse_args(argv)
    try:
        scenario = load_scenario(args.scenario)
    except ScenarioFileError as exc:
        print(f"pipemetrics: {exc}", file=sys.stderr)
        return 2
    if args.impl:
        scenario = scenario.model_copy(update={"target": args.impl})
    try:
        precheck_target(scenario.target)  # before the process group: every rank says it
    except TargetLoadError as exc:
        print(f"pipemetrics: {exc}", file=sys.stderr)
        return 2
    spec = scenario.setup.world
    dist.init_process_group(spec.backend)
    if dist.get_world_size() != spec.world_size:
        print(
            f"pipemetrics: the scenario needs {spec.world_size} ranks, torchrun started "
            f"{dist.get_world_size()}",
            file=sys.stderr,
        )
        dist.destroy_process_group()
        return 2
    timer = _arm_deadline(scenario.deadline_s)
    server = RankServer(dist.get_rank(), None, join_world(spec))
    done = server.run(Task(scenario_json=scenario.model_dump_json(), mode=RunMode.RAW))
    everyone: list[Done | None] = [None] * spec.world_size
    dist.all_gather_object(everyone, done)
    places: list[object] = [None] * spec.world_size
    dist.all_gather_object(places, server.place)
    timer.cancel()
    passed = True
    if dist.get_rank() == 0:
        reports = [d for d in everyone if d is not None]
        run = WorldRun(
            outcome=_outcome(reports),
            ranks={d.rank: RankResult(place=places[d.rank], done=d) for d in reports},
            seconds=0.0,
            reusable=False,
        )
        from pipemetrics.properties.verdict import judge_run, judgement_text  # rank 0 only

        print(summarize(scenario, run))
        problems = judge_run(scenario, run)
        print(judgement_text(scenario, problems))
        passed = not problems
    # Every rank tears the group down together, once rank 0 has judged: a rank that destroyed
    # it (and exited) while rank 0 was still judging was once seen to abort in gloo's teardown
    # ("terminate called without an active exception"), failing a passing run.
    dist.barrier()
    dist.destroy_process_group()
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
