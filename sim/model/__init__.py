"""The model of a scenario: plain, validated data that no process is needed to build or read.

Holds the world and model layout (`layout`, `pipeline_layout`), where each rank sits
(`topology`), the calls a trainer makes (`calls`), what ranks record and report (`records`),
the values returned (`values`), the target under test (`target`) and the scenario itself
(`scenario`).

May import: `pipemetrics.sim.mcore` (what the installed megatron-core offers) only. Nothing here
starts a process or touches Megatron's trackers.
"""
