"""One subcommand of ``pipemetrics``: its name, its help line and the function that declares its
options.

Each command's module declares its own `Subcommand` (``COMMAND``); `pipemetrics.commands.parser`
lists them in one table (`SUBCOMMANDS`). Whatever needs a command's options (`argv`: the child
processes of ``check``, ``bench`` and ``prove --ray``) is given its `Subcommand`, never its name,
so nothing below the parser imports it back.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import NamedTuple


class Subcommand(NamedTuple):
    """A subcommand as the parser adds it: ``pipemetrics NAME``, with ``help`` in the list."""

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]

    def parser(self) -> argparse.ArgumentParser:
        """A parser of this subcommand's options alone (as ``pipemetrics NAME`` parses them)."""
        parser = argparse.ArgumentParser(prog=f"pipemetrics {self.name}")
        self.add_arguments(parser)
        return parser
