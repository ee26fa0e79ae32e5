"""``pipemetrics demo``: the embedded default world, shown rank by rank.

Four gloo ranks as pipeline 2 x data-parallel 2. Stage 0 holds only dense layers (no router, so
it records nothing), stage 1 holds the MoE layers and one MTP layer. megatron-core's real
routers fill the trackers over two microbatches, then every rank calls the implementation the
way a trainer does after a step.
"""

from __future__ import annotations

import argparse
import sys

from pipemetrics.commands.options import add_load_timeout, add_target, add_verbose
from pipemetrics.commands.subcommand import Subcommand
from pipemetrics.properties.verdict import judge_run, judgement_text
from pipemetrics.sim.model.calls import MoeCall, MtpCall
from pipemetrics.sim.model.layout import ModelLayout, Setup, WorldSpec
from pipemetrics.sim.model.scenario import DEFAULT_TARGET, Scenario, Step
from pipemetrics.sim.model.target import TargetLoadError, precheck_target
from pipemetrics.sim.results.summary import summarize
from pipemetrics.sim.worlds.probe import DEFAULT_LOAD_TIMEOUT_S, probe_target, require_api
from pipemetrics.sim.worlds.world import World


def demo_scenario(target: str = DEFAULT_TARGET) -> Scenario:
    layout = ModelLayout(
        num_layers=4,
        moe_layer_freq=[0, 0, 1, 1],
        mtp_num_layers=1,
        routing_type="aux_loss",
        aux_loss_coeff=0.01,
        z_loss_coeff=0.001,
        microbatches=2,
    )
    setup = Setup(world=WorldSpec(pp=2, dp=2), layout=layout)
    loss_scale = 1.0 / layout.microbatches
    calls = [
        MoeCall(
            loss_scale=loss_scale,
            per_layer_logging=True,
            num_layers=layout.num_layers,
            mtp_num_layers=layout.mtp_num_layers,
            track_names=layout.live_track_names,
        ),
        MtpCall(loss_scale=loss_scale),
    ]
    return Scenario(setup=setup, mode="router", seed=7, target=target, steps=[Step(calls=calls)])


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    add_target(parser, instead_of="the reference")
    add_load_timeout(parser)
    add_verbose(parser)


COMMAND = Subcommand(
    "demo",
    "4 gloo ranks, first stage without MoE, MTP on the last stage",
    add_demo_arguments,
)


def demo_command(args: argparse.Namespace) -> int:
    return demo_main(impl=args.impl, load_timeout_s=args.load_timeout)


def demo_main(impl: str | None = None, load_timeout_s: float = DEFAULT_LOAD_TIMEOUT_S) -> int:
    """Exit 0 when every rank got what the oracle says, 1 otherwise, 2 when ``impl`` (loaded
    first in a child process, under ``load_timeout_s``) cannot be loaded or defines no API
    function."""
    if impl is not None:
        try:
            precheck_target(impl)
            require_api(impl, probe_target(impl, load_timeout_s))
        except TargetLoadError as exc:
            print(f"pipemetrics demo: {exc}", file=sys.stderr)
            return 2
    scenario = demo_scenario(impl or DEFAULT_TARGET)
    print(
        "pipemetrics demo: 4 gloo ranks, pp=2 x dp=2; stage 0 dense only, stage 1 MoE + MTP",
        flush=True,
    )
    with World(scenario.setup.world) as world:
        print(f"world started in {world.startup_s:.2f} s")
        run = world.run(scenario)
    print(summarize(scenario, run))
    problems = judge_run(scenario, run)
    print(judgement_text(scenario, problems))
    return 1 if problems else 0
