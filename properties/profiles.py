"""Hypothesis profiles of the conformance suite: how many examples, which world shapes, budgets.

Three profiles, ``dev`` (fast), ``ci`` (sized for a CI job on a 2-core machine) and ``thorough``.
Worlds are the expensive part, so each profile draws worlds from a short fixed list of shapes
(every shape is started once per pool and reused across examples). The Hypothesis side of each
profile is also registered with Hypothesis as ``pipemetrics-<name>`` (namespaced, so an adopter's
own ``ci`` profile is never overwritten).
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import HealthCheck, Phase, settings

from pipemetrics.sim.layout import WorldSpec

PROFILE_NAMES: tuple[str, ...] = ("dev", "ci", "thorough")
DEFAULT_PROFILE = "ci"


def _shape(tp: int = 1, pp: int = 1, cp: int = 1, dp: int = 1, ep: int = 1) -> WorldSpec:
    return WorldSpec(tp=tp, pp=pp, cp=cp, dp=dp, ep=ep)


SMALL_SHAPES: tuple[WorldSpec, ...] = (
    _shape(),
    _shape(pp=2),
    _shape(dp=2),
    _shape(pp=3),
    _shape(pp=2, dp=2),
    _shape(tp=2, pp=2),
    _shape(pp=2, cp=2),
    _shape(pp=4),
)
"""World size <= 4, ordered so that shrinking moves towards the smallest world."""

LARGE_SHAPES: tuple[WorldSpec, ...] = (
    *SMALL_SHAPES,
    _shape(dp=2, ep=2),
    _shape(pp=5),
    _shape(pp=3, dp=2),
    _shape(pp=7),
    _shape(tp=2, pp=2, dp=2),
    _shape(pp=2, cp=2, dp=2, ep=2),
    _shape(pp=4, dp=2),
    _shape(pp=8),
)
"""World sizes 1..8, for the ``thorough`` profile."""


@dataclass(frozen=True)
class Profile:
    """Everything a Hypothesis profile decides for the suite."""

    name: str
    max_examples: int
    shapes: tuple[WorldSpec, ...]
    max_steps: int = 3
    max_microbatches: int = 3
    max_layers_per_stage: int = 3
    deadline_s: float = 20.0
    """Per-example deadline enforced by the simulator (Hypothesis's own deadline is off)."""
    shrink_budget_s: float = 60.0
    """Wall-clock cap on shrinking one failure."""
    max_ranks: int = 16
    """Rank processes the world pool keeps alive at once."""

    def examples_for(self, override: int | None) -> int:
        """Examples per property: ``override`` (``--max-examples``) or the profile's count."""
        return self.max_examples if override is None else override


PROFILES: dict[str, Profile] = {
    "dev": Profile(
        "dev",
        max_examples=10,
        shapes=SMALL_SHAPES[:5],
        max_steps=2,
        max_microbatches=2,
        max_layers_per_stage=2,
        deadline_s=15.0,
        shrink_budget_s=20.0,
    ),
    "ci": Profile("ci", max_examples=150, shapes=SMALL_SHAPES, shrink_budget_s=45.0),
    "thorough": Profile(
        "thorough",
        max_examples=1000,
        shapes=LARGE_SHAPES,
        max_steps=4,
        max_microbatches=4,
        max_layers_per_stage=4,
        deadline_s=60.0,
        shrink_budget_s=300.0,
        max_ranks=24,
    ),
}


def get_profile(name: str) -> Profile:
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(
            f"unknown Hypothesis profile {name!r}; choose one of {', '.join(PROFILE_NAMES)}"
        ) from None


SUPPRESSED = [
    HealthCheck.too_slow,
    HealthCheck.data_too_large,
    HealthCheck.filter_too_much,
    HealthCheck.large_base_example,
]
PHASES = (Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink)


def hypothesis_settings(profile: Profile, max_examples: int, *, database: object) -> settings:
    """Settings for one property: no Hypothesis deadline (the simulator enforces deadlines)."""
    return settings(
        max_examples=max_examples,
        deadline=None,
        database=database,  # type: ignore[arg-type]
        phases=PHASES,
        suppress_health_check=SUPPRESSED,
        print_blob=False,
        report_multiple_bugs=False,
    )


def register_hypothesis_profiles() -> None:
    """Register ``pipemetrics-dev``/``-ci``/``-thorough`` with Hypothesis (idempotent)."""
    for profile in PROFILES.values():
        settings.register_profile(
            f"pipemetrics-{profile.name}",
            max_examples=profile.max_examples,
            deadline=None,
            phases=PHASES,
            suppress_health_check=SUPPRESSED,
        )
