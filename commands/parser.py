"""The ``pipemetrics`` argument parser: one subcommand each (`SUBCOMMANDS`), every option declared
by its command's module (or once in `pipemetrics.commands.options` when several share it)."""

from __future__ import annotations

import argparse

from pipemetrics.commands import bench, check, demo, prove_options, replay, vendor
from pipemetrics.commands.subcommand import Subcommand

SUBCOMMANDS: tuple[Subcommand, ...] = (
    check.COMMAND,
    replay.COMMAND,
    demo.COMMAND,
    bench.COMMAND,
    prove_options.COMMAND,
    vendor.COMMAND,
)
"""Every subcommand, in the order ``pipemetrics --help`` lists them."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pipemetrics",
        description="Check Megatron pipeline-parallel metric helpers in real multi-rank worlds.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for command in SUBCOMMANDS:
        command.add_arguments(sub.add_parser(command.name, help=command.help))
    return parser


def command_parser(command: str) -> argparse.ArgumentParser:
    """The parser of one subcommand (``check``, ``prove``, ...)."""
    for action in build_parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            found: argparse.ArgumentParser = action.choices[command]
            return found
    raise AssertionError("the pipemetrics parser has no subcommands")
