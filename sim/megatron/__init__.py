"""Megatron contained: megatron-core's own code run inside a rank, and its process-global state.

Holds the per-rank globals the in-process tier swaps (`rank_globals`), Megatron's trackers
(`trackers`), router mode filling them with megatron-core's own router (`router_fill`), and the
built-in ``megatron-core`` target (`builtin_megatron_core`). Imports torch and megatron-core.

May import: `pipemetrics.sim.model` and `pipemetrics.sim.mcore`; never `collectives`, `worlds`
or `results` (independent of `pipemetrics.sim.collectives`).
"""
