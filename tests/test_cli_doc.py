"""docs/cli.md, the home of the command's options, names every option of every subcommand the
parser has (so an option added without its documentation fails here); an option hidden from
``--help`` (a worker's internal channel) is not the user's and is left out."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from pipemetrics.commands.parser import build_parser, command_parser

#: Runs with megatron-core unreachable (ci/test.sh); the oldest release's leg leaves it out.
pytestmark = pytest.mark.release_independent

CLI_DOC = Path(__file__).resolve().parent.parent / "docs" / "cli.md"


def commands() -> list[str]:
    for action in build_parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            return sorted(action.choices)
    raise AssertionError("the pipemetrics parser has no subcommands")


@pytest.mark.parametrize("command", commands())
def test_docs_cli_names_every_option(command: str) -> None:
    text = CLI_DOC.read_text(encoding="utf-8")
    assert f"pipemetrics {command}" in text, f"docs/cli.md does not show `pipemetrics {command}`"
    options = [
        option
        for action in command_parser(command)._actions
        if not isinstance(action, argparse._HelpAction) and action.help != argparse.SUPPRESS
        for option in action.option_strings
        if option.startswith("--")
    ]
    missing = [o for o in options if o not in text]
    assert not missing, f"docs/cli.md does not document `pipemetrics {command}` {missing}"
