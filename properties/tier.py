"""Where a check's worlds run: its default tier, and the tier it falls back to.

One definition for ``pipemetrics check`` and the pytest plugin (``--tier``,
``--pipemetrics-tier``): both default to `CHECK_TIER` and both run a request through
`check_tier`, so the two never differ in where a property's examples run.
"""

from __future__ import annotations

from pipemetrics.sim.worlds.pool import Tier

CHECK_TIER: Tier = "inprocess"
"""``check`` runs on the in-process tier by default: every rank of a world in one process,
scheduled deterministically, about three times faster than one OS process per rank, so that a
conformance job is cheap enough for every pull request. The real world stays the referee: every
failure is confirmed on the process tier before it is reported (`engine.confirm_failure`), and
a stratified sample of the scenarios judged runs there too (`referee`), any disagreement being
reported as a fault of pipemetrics. Where the installed megatron-core refuses the in-process
tier (`check_tier`), the check runs on the process tier."""


def check_tier(requested: Tier) -> tuple[Tier, str | None]:
    """The tier a check asked for ``requested`` runs on, and why it is not ``requested`` (None
    when it is): the in-process tier falls back to the process tier where the installed
    megatron-core refuses it (`pipemetrics.sim.worlds.inprocess_world.inprocess_unsupported`,
    decided from the installed files), so that a check never fails for the tier."""
    if requested != "inprocess":
        return requested, None
    from pipemetrics.sim.worlds.inprocess_world import inprocess_unsupported

    refusal = inprocess_unsupported()
    if refusal is None:
        return requested, None
    return "process", refusal
