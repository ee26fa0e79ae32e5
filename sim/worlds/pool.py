"""A pool of live worlds keyed by shape, so that examples reuse processes.

Starting a world costs process creation and joining gloo; running an example in a live world
costs milliseconds. The pool hands out a live world per `WorldSpec`, retires a world whose run
was not clean (crash, deadline, ranks that did not unwind: its process group is suspect), and
keeps at most ``max_ranks`` rank processes alive, closing the least recently used worlds first.
"""

from __future__ import annotations

from collections import OrderedDict
from types import TracebackType
from typing import Literal

from pipemetrics.sim.collectives.protocol import RunMode
from pipemetrics.sim.model.layout import WorldSpec
from pipemetrics.sim.model.scenario import Scenario
from pipemetrics.sim.worlds.inprocess_world import InProcessWorld, TaskLost
from pipemetrics.sim.worlds.world import World, WorldRun

DEFAULT_MAX_RANKS = 12

Tier = Literal["process", "inprocess"]
"""``process``: one OS process per rank over real gloo (`World`); ``inprocess``: every rank in
one host process, scheduled deterministically (`InProcessWorld`)."""
TIERS: tuple[Tier, ...] = ("process", "inprocess")
LiveWorld = World | InProcessWorld


class WorldPool:
    """Live worlds by shape. Use as a context manager; `close` ends every world."""

    def __init__(self, *, max_ranks: int = DEFAULT_MAX_RANKS, tier: Tier = "process") -> None:
        """``max_ranks``: the most OS processes the live worlds may hold together (a world of
        the in-process tier holds one)."""
        self.max_ranks = max_ranks
        self.tier = tier
        self._worlds: OrderedDict[str, LiveWorld] = OrderedDict()
        self.started = 0
        self.retired = 0

    def __enter__(self) -> WorldPool:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def world(self, spec: WorldSpec) -> LiveWorld:
        """A live world of this shape on the pool's tier, started if needed."""
        world = self._worlds.get(spec.key)
        if world is not None and world.alive:
            self._worlds.move_to_end(spec.key)
            return world
        if world is not None:
            self._drop(spec.key)
        world = InProcessWorld(spec) if self.tier == "inprocess" else World(spec)
        self._make_room(world.processes)
        world.start()
        self.started += 1
        self._worlds[spec.key] = world
        return world

    def run(self, scenario: Scenario, *, mode: RunMode = RunMode.GATED) -> WorldRun:
        """Run a scenario in a pooled world; a world that ran unclean is retired. A scenario
        sent ahead whose world ended before it ran is run in a fresh one."""
        try:
            result = self._run_in_live_world(scenario, mode)
        except TaskLost:
            result = self._run_in_live_world(scenario, mode)
        if not result.reusable:
            self._drop(scenario.setup.world.key)
        return result

    def send_ahead(self, scenario: Scenario) -> bool:
        """Let the scenario's live in-process world start it while this process is busy (see
        `InProcessWorld.send_ahead`); `run` collects it. Starts no world; False where nothing
        was sent."""
        world = self._worlds.get(scenario.setup.world.key)  # a dead one: `run` finds out
        return isinstance(world, InProcessWorld) and world.send_ahead(scenario)

    def _run_in_live_world(self, scenario: Scenario, mode: RunMode) -> WorldRun:
        world = self.world(scenario.setup.world)
        try:
            return world.run(scenario, mode=mode)
        except BaseException:
            self._drop(scenario.setup.world.key)
            raise

    def live_ranks(self) -> int:
        """OS processes of the live worlds."""
        return sum(w.processes for w in self._worlds.values())

    def pids(self) -> list[int]:
        return [pid for world in self._worlds.values() for pid in world.pids]

    def close(self) -> None:
        """End every world; an interruption while doing so still kills the rest."""
        try:
            for key in list(self._worlds):
                self._drop(key, retired=False)
        finally:
            for key in list(self._worlds):
                self._drop(key)

    def _drop(self, key: str, *, retired: bool = True) -> None:
        world = self._worlds.pop(key, None)
        if world is None:
            return
        if retired:
            world.kill()
            self.retired += 1
        else:
            world.close()

    def _make_room(self, processes: int) -> None:
        while self._worlds and self.live_ranks() + processes > self.max_ranks:
            oldest = next(iter(self._worlds))
            self._drop(oldest, retired=False)
