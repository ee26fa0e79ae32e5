"""Live worlds: the process tier (one OS process per rank), the in-process tier (every rank in
one host process), the pool that reuses them, and the rank side of both.

Holds the rank process (`rank`), the entry points a controller starts (`entry`), the process
tier's world (`world`), the in-process host (`inprocess`) and its controller side
(`inprocess_world`), the pool (`pool`), the target's probe (`probe`) and what the fork server imports first,
its import-time warnings held back (`preload`, `quiet`). The in-process tier
does not import back into the process tier: `world` reaches the hosts only through `entry`.

May import: `pipemetrics.sim.collectives`, `pipemetrics.sim.megatron`, `pipemetrics.sim.model`,
`pipemetrics.sim.mcore`; never `results`.
"""
