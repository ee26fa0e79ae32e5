"""``python -m pipemetrics.commands ...``: the ``pipemetrics`` command."""

from pipemetrics.commands.cli import run

run()
