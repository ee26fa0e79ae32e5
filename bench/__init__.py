"""``pipemetrics bench``: what the simulator and the suite cost, and what they catch, measured
against what a user would otherwise use.

A user of the simulator (`pipemetrics.sim`) above the suite: the measurements (`measure`), their JSON report and table (`report`), the
per-call cost of the reference against Megatron's own code (`call_cost`), hang and mismatch
detection against PyTorch's own tools (`hang_detection`) and the curves (`plot`).

May import: `pipemetrics.sim`, `pipemetrics.properties`; only `pipemetrics.commands` imports it.
"""
