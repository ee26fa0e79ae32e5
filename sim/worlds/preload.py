"""What the fork server imports before it forks anything (`pipemetrics.sim.worlds.world.PRELOAD`).

torch, megatron-core and the rank code, imported once so that every rank and probe forked later
starts in milliseconds; their import-time warnings and log lines are held back
(`pipemetrics.sim.worlds.quiet.import_quietly`: shown with ``-v`` or when the import fails), since the
fork server writes to the user's terminal.
"""

from __future__ import annotations

from pipemetrics.sim.worlds.quiet import import_quietly, keep_compile_cache

RANK_CODE = (
    "pipemetrics.sim.worlds.rank",
    "pipemetrics.sim.megatron.router_fill",
    "pipemetrics.sim.worlds.inprocess",
)
"""The modules every forked process runs (they import torch and megatron-core)."""

keep_compile_cache()  # every process forked later inherits it
import_quietly(*RANK_CODE)
