"""How hard the conformance suite searches, chosen by Hypothesis profile name (``check
--hypothesis-profile``): how many examples, which world shapes, budgets. Called `Effort` here, so
that "profile" alone means the semantic profile (seed, megatron, strict).

Three of them, ``dev`` (fast), ``ci`` (sized for a CI job on a 2-core machine) and ``thorough``.
Worlds are the expensive part, so each profile draws worlds from a short fixed list of shapes
(every shape is started once per pool and reused across examples). The Hypothesis side of each
profile is also registered with Hypothesis as ``pipemetrics-<name>`` (namespaced, so an adopter's
own ``ci`` profile is never overwritten).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from hypothesis import HealthCheck, Phase, Verbosity, settings

from pipemetrics.sim.model.layout import WorldSpec

Semantic = Literal["seed", "megatron", "strict"]
"""The semantic profile: what the suite requires (`pipemetrics.properties.catalogue`)."""

EFFORT_NAMES: tuple[str, ...] = ("dev", "ci", "thorough")

GENERATOR_CLASSES: dict[str, str] = {
    "flexible_layout": "Megatron's pipeline_model_parallel_layout (PipelineParallelLayerLayout): "
    "embedding-only and loss-only stages, stages without decoder layers, standalone MTP",
    "virtual_pipeline": "interleaved schedule: several non-contiguous layer chunks per rank",
    "wide_world": "dp = 3, tp x dp > 2, ep = 2 and wider shapes",
    "group_broadcast": "broadcast_tensor over the pipeline, data-parallel and new_group groups "
    "with a global source that is not the group's rank 0",
    "argument_forms": "every argument form: None defaults, loss_scale 0 / negative / large / "
    "0-d tensor / numpy scalar, get_mtp_metrics() with its default",
    "multi_step": "step sequences: names first recorded in a later step, MTP in some steps only, "
    "calls in either order, steps that call one function",
}
"""Classes of generated input beyond the basic even/explicit layouts on small worlds. A profile
generates every class unless told not to (``pipemetrics check --without-class NAME``): an adopter
whose trainer never uses one can leave it out, and the mutant tests show that each class is what
catches its mutant."""
DEFAULT_EFFORT = "ci"


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


def is_wide(world: WorldSpec) -> bool:
    """Whether ``world`` belongs to the ``wide_world`` generator class: dp >= 3, tp x dp > 2,
    expert parallelism, or more than 8 ranks."""
    return world.dp >= 3 or world.tp * world.dp > 2 or world.ep > 1 or world.world_size > 8


WIDE_SHAPES: tuple[WorldSpec, ...] = (
    _shape(dp=2, ep=2),
    _shape(dp=3),
    _shape(tp=2, dp=2),
    _shape(pp=2, dp=2, ep=2),
    _shape(pp=2, dp=3),
)
"""The ``ci`` profile's wide shapes: ep = 2, dp = 3, tp x dp = 4; at most 6 ranks."""

LARGE_SHAPES: tuple[WorldSpec, ...] = (
    *SMALL_SHAPES,
    *WIDE_SHAPES,
    _shape(pp=5),
    _shape(pp=3, dp=2),
    _shape(pp=7),
    _shape(tp=2, pp=2, dp=2),
    _shape(pp=2, cp=2, dp=2, ep=2),
    _shape(pp=4, dp=2),
    _shape(pp=8),
    _shape(dp=4, ep=4),
    _shape(pp=2, dp=4, ep=2),
    _shape(tp=4, pp=2),
    _shape(pp=2, cp=4),
    _shape(tp=2, dp=4),
    _shape(tp=2, cp=2, dp=2, ep=2),
)
"""World sizes 1..8, for the ``thorough`` profile: dp, tp and cp up to 4."""


@dataclass(frozen=True)
class Effort:
    """Everything a Hypothesis profile (by its name: dev, ci, thorough) decides for the suite."""

    name: str
    max_examples: int
    shapes: tuple[WorldSpec, ...]
    max_steps: int = 3
    max_microbatches: int = 3
    max_layers_per_stage: int = 3
    max_vpp: int = 2
    """Most chunks per pipeline rank of a generated virtual pipeline."""
    deadline_s: float = 20.0
    """Per-example deadline enforced by the simulator (Hypothesis's own deadline is off)."""
    shrink_budget_s: float = 60.0
    """Wall-clock cap on shrinking one failure."""
    max_ranks: int = 16
    """Rank processes the world pool keeps alive at once."""
    classes: frozenset[str] = frozenset(GENERATOR_CLASSES)
    """The `GENERATOR_CLASSES` this profile generates."""

    def generates(self, name: str) -> bool:
        """Whether the strategies may draw inputs of generator class ``name``."""
        if name not in GENERATOR_CLASSES:
            raise ValueError(f"unknown generator class {name!r}")
        return name in self.classes

    def without(self, names: list[str]) -> Effort:
        """This profile without the generator classes ``names`` (each must be known)."""
        unknown = sorted(set(names) - set(GENERATOR_CLASSES))
        if unknown:
            raise ValueError(
                f"--without-class: unknown generator class {', '.join(unknown)}; "
                f"choose from {', '.join(GENERATOR_CLASSES)}"
            )
        return replace(self, classes=self.classes - set(names))

    def examples_for(self, override: int | None) -> int:
        """Examples per property: ``override`` (``--max-examples``) or the profile's count."""
        return self.max_examples if override is None else override


EFFORTS: dict[str, Effort] = {
    "dev": Effort(
        "dev",
        max_examples=10,
        shapes=(*SMALL_SHAPES[:5], WIDE_SHAPES[0]),
        max_steps=2,
        max_microbatches=2,
        max_layers_per_stage=2,
        deadline_s=15.0,
        shrink_budget_s=20.0,
    ),
    "ci": Effort("ci", max_examples=150, shapes=SMALL_SHAPES + WIDE_SHAPES, shrink_budget_s=45.0),
    "thorough": Effort(
        "thorough",
        max_examples=1000,
        shapes=LARGE_SHAPES,
        max_steps=4,
        max_microbatches=4,
        max_layers_per_stage=4,
        max_vpp=3,
        deadline_s=60.0,
        shrink_budget_s=300.0,
        max_ranks=24,
    ),
}


def get_effort(name: str) -> Effort:
    try:
        return EFFORTS[name]
    except KeyError:
        raise ValueError(
            f"unknown Hypothesis profile {name!r}; choose one of {', '.join(EFFORT_NAMES)}"
        ) from None


SUPPRESSED = [
    HealthCheck.too_slow,
    HealthCheck.data_too_large,
    HealthCheck.filter_too_much,
    HealthCheck.large_base_example,
]
PHASES = (Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink)


def hypothesis_settings(effort: Effort, max_examples: int, *, database: object) -> settings:
    """Settings for one property: no Hypothesis deadline (the simulator enforces deadlines), and
    nothing printed (pipemetrics reports every failure itself)."""
    return settings(
        max_examples=max_examples,
        deadline=None,
        verbosity=Verbosity.quiet,
        database=database,  # type: ignore[arg-type]
        phases=PHASES,
        suppress_health_check=SUPPRESSED,
        print_blob=False,
        report_multiple_bugs=False,
    )


def register_hypothesis_profiles() -> None:
    """Register ``pipemetrics-dev``/``-ci``/``-thorough`` with Hypothesis (idempotent)."""
    for effort in EFFORTS.values():
        settings.register_profile(
            f"pipemetrics-{effort.name}",
            max_examples=effort.max_examples,
            deadline=None,
            phases=PHASES,
            suppress_health_check=SUPPRESSED,
        )
