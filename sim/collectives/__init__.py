"""Running one task over a world's ranks: matching their collectives, the messages between
controller and ranks, and the one scheduling policy both tiers share.

Holds the controller's matcher that decides hangs before they happen (`coordinator`), the
messages (`protocol`), what a collective does to its members' arguments (`semantics`), the
interposition on torch.distributed inside a rank (`interpose`), the scheduler (`scheduler`) and
how SIGINT/SIGTERM end a task cleanly (`interrupt`).

May import: `pipemetrics.sim.model` and `pipemetrics.sim.mcore`; never `megatron`, `worlds` or
`results` (independent of `pipemetrics.sim.megatron`).
"""
