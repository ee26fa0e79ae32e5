"""Parsed options back to argv: the one way a command passes its options to the processes it
starts (``check -n`` workers, ``prove --ray`` shards, the commands ``bench`` times).

`argv_for` reads the command's own parser, so an option added to a command travels to its
children without further code; an option of a kind it cannot write back raises (and the
round-trip test over every option of ``check``, ``prove`` and ``bench`` fails) instead of being
dropped. A caller changes what a child gets only by naming the option (`child_command`'s
``overrides``), never by leaving it out of a hand-written list.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from pipemetrics.commands.subcommand import Subcommand

_SKIPPED = (argparse._HelpAction, argparse._VersionAction)


def _text(action: argparse.Action, value: Any, *, attached: bool = False) -> str:
    """``value`` as one argv word; ``attached``: written as ``--flag=value``, where a leading
    ``-`` is read as part of the value (elsewhere it would be read as an option)."""
    text = str(value)
    if text.startswith("-") and not attached:
        raise ValueError(f"{action.dest}: cannot pass {text!r} on a command line")
    return text


def argv_for(
    parser: argparse.ArgumentParser, args: argparse.Namespace, *, explicit: bool = False
) -> list[str]:
    """The arguments that ``parser`` parses back into ``args``. An option at its default is left
    out, unless ``explicit`` (then only an unset one is: None, False, empty), so that a child on
    another machine, whose defaults may differ, runs with these values. Raises ValueError for a
    value no argv can give, TypeError for an option of a kind not written back here."""
    options: list[str] = []
    positionals: list[str] = []
    for action in parser._actions:
        if isinstance(action, _SKIPPED):
            continue
        value = getattr(args, action.dest)
        default = action.default
        if value == default and not (explicit and value not in (None, False, [])):
            continue
        flag = action.option_strings[-1] if action.option_strings else None
        if type(action) is argparse._StoreTrueAction:
            options.append(_flag(action, flag))
        elif type(action) is argparse._ExtendAction:
            if not value:  # `--only` alone is refused by its parser: no argv gives []
                raise ValueError(f"{action.dest}: no argv sets it to an empty list")
            options += [_flag(action, flag), *(_text(action, item) for item in value)]
        elif type(action) is argparse._AppendAction:
            if default:  # argparse appends to a non-empty default: it could never round-trip
                raise TypeError(f"{action.dest}: an appending option with a default")
            options += [
                f"{_flag(action, flag)}={_text(action, item, attached=True)}" for item in value
            ]
        elif type(action) is argparse._StoreAction:
            if value is None:
                raise ValueError(f"{action.dest}: no argv sets it to None (default {default!r})")
            many = action.nargs in ("+", "*")
            attached = flag is not None and not many
            items = [
                _text(action, item, attached=attached) for item in (value if many else [value])
            ]
            if flag is None:
                positionals += items
            elif many:
                options += [flag, *items]
            else:
                options.append(f"{flag}={items[0]}")
        else:
            raise TypeError(
                f"{action.dest}: {type(action).__name__} options are not written back to argv"
            )
    return positionals + options


def _flag(action: argparse.Action, flag: str | None) -> str:
    if flag is None:
        raise TypeError(f"{action.dest}: a positional of kind {type(action).__name__}")
    return flag


def command_args(command: Subcommand, **values: Any) -> argparse.Namespace:
    """``command``'s options at their defaults, then ``values`` (each an option's dest)."""
    return _updated(command, command.parser().parse_args([]), values)


def child_command(command: Subcommand, args: argparse.Namespace, **overrides: Any) -> list[str]:
    """The full command line of a child running ``pipemetrics COMMAND`` with ``args`` (every
    option passed through, defaults included), but ``overrides`` (each an option's dest) set
    for it."""
    child = _updated(command, args, overrides)
    argv = argv_for(command.parser(), child, explicit=True)
    return [sys.executable, "-m", "pipemetrics.commands.cli", command.name, *argv]


def _updated(
    command: Subcommand, args: argparse.Namespace, values: dict[str, Any]
) -> argparse.Namespace:
    known = {action.dest for action in command.parser()._actions}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"pipemetrics {command.name} has no option {', '.join(unknown)}")
    return argparse.Namespace(**{**vars(args), **values})
