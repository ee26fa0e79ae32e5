"""The ``pipemetrics`` argument parser: one subcommand each, every option declared by its
command's module (or once in `pipemetrics.commands.options` when several share it)."""

from __future__ import annotations

import argparse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pipemetrics",
        description="Check Megatron pipeline-parallel metric helpers in real multi-rank worlds.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    # the commands' modules are imported here, not above: each imports this module itself
    from pipemetrics.commands.bench import add_bench_arguments
    from pipemetrics.commands.check import add_check_arguments
    from pipemetrics.commands.demo import add_demo_arguments
    from pipemetrics.commands.prove import add_prove_arguments
    from pipemetrics.commands.replay import add_replay_arguments
    from pipemetrics.commands.vendor import add_vendor_arguments

    check = sub.add_parser("check", help="run the conformance suite against an implementation")
    add_check_arguments(check)
    replay = sub.add_parser("replay", help="re-run a scenario file and print its verdict")
    add_replay_arguments(replay)
    demo = sub.add_parser(
        "demo", help="4 gloo ranks, first stage without MoE, MTP on the last stage"
    )
    add_demo_arguments(demo)
    bench = sub.add_parser(
        "bench", help="throughput, scaling, hang detection and per-call cost, side by side"
    )
    add_bench_arguments(bench)
    prove = sub.add_parser(
        "prove", help="run every structural case up to a bound and write a certificate"
    )
    add_prove_arguments(prove)
    vendor = sub.add_parser(
        "vendor", help="write the reference as one file to vendor, or check such a file"
    )
    add_vendor_arguments(vendor)
    return parser


def command_parser(command: str) -> argparse.ArgumentParser:
    """The parser of one subcommand (``check``, ``prove``, ...)."""
    for action in build_parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            found: argparse.ArgumentParser = action.choices[command]
            return found
    raise AssertionError("the pipemetrics parser has no subcommands")
