"""What one run of properties is asked to do: the target, what it requires, how hard it
searches, the draws' seed, where examples run and who is told what (`RunOptions`)."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from pipemetrics.properties.effort import Effort, Semantic
from pipemetrics.sim.model.scenario import Scenario
from pipemetrics.sim.worlds.pool import Tier
from pipemetrics.sim.worlds.world import WorldRun


@dataclass
class RunOptions:
    target: str
    profile: Semantic
    """The semantic profile: what the suite requires (seed, megatron, strict)."""
    effort: Effort
    """How hard it searches (the Hypothesis profile: examples, shapes, budgets)."""
    max_examples: int | None = None
    seed: int | None = None
    """The user's seed (``--seed``): the draws, and no example database."""
    draws_seed: int = field(default_factory=lambda: random.getrandbits(32))
    """The seed of every property's draws in this run where no ``seed`` is given (one drawn
    per run), so that properties of one generator draw the same scenarios and share their runs
    (`pipemetrics.properties.shared`); the example database still replays each property's
    earlier failures first."""
    database: str | None = None
    report_dir: Path = Path("pipemetrics-report")
    progress: Callable[[str], None] | None = None
    """Told (one line) when a property first fails and shrinking begins."""
    tier: Tier = "process"
    """Where examples run; a failure found in-process is confirmed on the process tier."""
    observe: Callable[[Scenario, WorldRun], None] | None = None
    """Shown every scenario run and its run (check's referee samples the in-process runs)."""
