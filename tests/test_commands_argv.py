"""Every option of ``check``, ``prove`` and ``bench`` survives the trip to a child's argv
(`pipemetrics.commands.argv`): parse(argv_for(parse(x))) == parse(x), for a non-default value of
each option the parser has, alone and all together. The values are generated from the parser's
own actions, so an option added later is covered, and one of a kind the generator or `argv_for`
does not know fails here instead of silently missing from the children."""

from __future__ import annotations

import argparse

import pytest

from pipemetrics.commands.argv import argv_for, child_command, command_args
from pipemetrics.commands.check import COMMAND as CHECK
from pipemetrics.commands.parser import SUBCOMMANDS, command_parser
from pipemetrics.commands.workers import workers_value

#: Runs with megatron-core unreachable (ci/test.sh); the oldest release's leg leaves it out.
pytestmark = pytest.mark.release_independent

COMMANDS = ("check", "prove", "bench")


def _value(action: argparse.Action, index: int) -> str:
    """A value for ``action`` other than its default (``index`` picks among the choices)."""
    if action.choices is not None:
        choices = [str(c) for c in action.choices if c != action.default]
        return choices[index % len(choices)]
    if action.type in (int, workers_value):
        return str(7 + index)
    if action.type is float:
        return str(2.5 + index)
    if action.type is None:
        return f"some/value{index}" if "," not in str(action.default) else "3,5"
    raise AssertionError(f"{action.dest}: no generated value for type {action.type!r}")


def _generated(action: argparse.Action) -> list[str]:
    """Argv giving ``action`` a non-default value; fails for an action of an unknown kind."""
    flag = action.option_strings[-1]
    kind = type(action)
    if kind is argparse._StoreTrueAction:
        return [flag]
    if kind is argparse._ExtendAction:  # several values at once, and the flag again
        return [flag, _value(action, 0), _value(action, 1), flag, _value(action, 2)]
    if kind is argparse._StoreAction and action.nargs in ("+", "*"):
        return [flag, _value(action, 0), _value(action, 1)]
    if kind is argparse._StoreAction and action.nargs is None:
        return [flag, _value(action, 0)]
    raise AssertionError(f"{action.dest}: an option of kind {kind.__name__}: add it here")


def _options(command: str) -> list[argparse.Action]:
    parser = command_parser(command)
    found = [a for a in parser._actions if not isinstance(a, argparse._HelpAction)]
    assert all(a.option_strings for a in found), f"{command}: positionals are not generated"
    return found


CASES = [(command, action.dest) for command in COMMANDS for action in _options(command)]


@pytest.mark.parametrize("command", ["check", "prove", "replay", "demo", "bench", "vendor"])
def test_options_of_several_values_take_them_one_way(command: str) -> None:
    """Every option that takes several values takes them as ``--opt a b`` and repeated
    (``options.add_list``), in every command: none appends one value per flag, none takes a
    fixed list."""
    parser = command_parser(command)
    several = [a for a in parser._actions if a.option_strings and (
        a.nargs in ("+", "*") or isinstance(a, argparse._AppendAction))]  # fmt: skip
    odd = [a.dest for a in several if type(a) is not argparse._ExtendAction or a.nargs != "+"]
    assert not odd, f"pipemetrics {command}: {odd} take several values another way"


@pytest.mark.parametrize(("command", "dest"), CASES)
def test_every_option_round_trips(command: str, dest: str) -> None:
    parser = command_parser(command)
    (action,) = [a for a in _options(command) if a.dest == dest]
    x = _generated(action)
    parsed = parser.parse_args(x)
    assert parsed != parser.parse_args([]), f"{x} leaves {dest} at its default"
    assert parser.parse_args(argv_for(parser, parsed)) == parsed
    assert parser.parse_args(argv_for(parser, parsed, explicit=True)) == parsed


@pytest.mark.parametrize("command", COMMANDS)
def test_all_options_at_once_round_trip(command: str) -> None:
    parser = command_parser(command)
    x = [word for action in _options(command) for word in _generated(action)]
    parsed = parser.parse_args(x)
    assert parser.parse_args(argv_for(parser, parsed)) == parsed
    assert parser.parse_args(argv_for(parser, parsed, explicit=True)) == parsed
    assert parser.parse_args(argv_for(parser, parser.parse_args([]))) == parser.parse_args([])


def test_a_child_gets_every_option_but_its_overrides() -> None:
    args = command_args(CHECK, seed=3, without_class=["wide_world"], json_out="r.json")
    command = child_command(CHECK, args, json_out=None, only=["moe.no_hang"])
    assert command[1:4] == ["-m", "pipemetrics.commands.cli", "check"]
    child = command_parser("check").parse_args(command[4:])
    assert vars(child) == {**vars(args), "json_out": None, "only": ["moe.no_hang"]}


def test_a_value_like_an_option_travels_attached_or_is_refused() -> None:
    parser = command_parser("check")
    negative = command_args(CHECK, seed=-1)
    assert parser.parse_args(argv_for(parser, negative)) == negative
    with pytest.raises(ValueError, match="only"):
        argv_for(parser, command_args(CHECK, only=["moe", "-x"]))
    with pytest.raises(ValueError, match="no option sedd"):
        command_args(CHECK, sedd=3)


def test_an_empty_list_is_refused_not_written_as_a_bare_option() -> None:
    """An option of several values takes at least one: `--only` alone does not parse, so an
    empty list raises instead of giving a child a command line it refuses."""
    parser = command_parser("check")
    with pytest.raises(ValueError, match="only: no argv sets it to an empty list"):
        argv_for(parser, command_args(CHECK, only=[]))
    with pytest.raises(SystemExit):
        parser.parse_args(["--only"])


def test_a_subcommand_parses_its_options_alone_as_the_full_parser_does() -> None:
    """`Subcommand.parser` (what `argv` reads) declares the same options as the command's
    subparser in ``pipemetrics``'s parser, for every subcommand of the table."""
    for command in SUBCOMMANDS:
        alone = {a.dest: a.default for a in command.parser()._actions}
        full = {a.dest: a.default for a in command_parser(command.name)._actions}
        assert alone == full, command.name
