"""Entry points of the processes a controller starts, importable without torch or megatron-core.

A process's target is pickled by name, so the controller need not import the module that
defines it; importing `pipemetrics.sim.worlds.rank` costs seconds of CPU (torch, megatron-core). Each
function here imports its module inside: in a child forked from the fork server that module is
already loaded (`pipemetrics.sim.worlds.world.PRELOAD`), in a spawned child it is imported there, its
import-time output held back (`pipemetrics.sim.worlds.quiet`) as the fork server's is. So the
controller of ``pipemetrics check`` (and of every other command) never imports torch.
"""

from __future__ import annotations

from multiprocessing.connection import Connection

from pipemetrics.sim.worlds.quiet import import_quietly


def rank_entry(
    rank: int,
    spec_json: str,
    directory: str,
    conn: Connection,
    controller_pid: int,
    leftovers: list[str],
) -> None:
    """A rank of a process-tier world: `pipemetrics.sim.worlds.rank.rank_main`."""
    import_quietly("pipemetrics.sim.worlds.rank")
    from pipemetrics.sim.worlds.rank import rank_main

    rank_main(rank, spec_json, directory, conn, controller_pid, leftovers)


def host_entry(
    spec_json: str, directory: str, conn: Connection, controller_pid: int, leftovers: list[str]
) -> None:
    """The host of an in-process world: `pipemetrics.sim.worlds.inprocess.host_main`."""
    import_quietly("pipemetrics.sim.worlds.inprocess")
    from pipemetrics.sim.worlds.inprocess import host_main

    host_main(spec_json, directory, conn, controller_pid, leftovers)
