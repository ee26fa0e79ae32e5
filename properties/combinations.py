"""Bug classes that need two conditions at once, run as combinations rather than left to chance.

A copy that keeps state between calls (a module-level cache, names remembered from an earlier
step), or that decides something from the first call alone, fails only when the generator
happens to draw both conditions in one scenario. Each `Combination` here names such a class,
recognises a scenario of it (`Combination.present`, counted for every scenario, drawn or not)
and builds the scenarios that make it at the defaults (`Combination.scenarios`): the engine runs
them first, as Hypothesis' explicit examples, for every property whose catalogue entry names the
combination (`Property.combinations`), so every run of those properties holds at least that many
(the class's floor). The coverage block counts each class and flags one below its floor
(`pipemetrics.properties.coverage`).

Nothing here names a property: a combination builds its scenarios for what the property calls
(`Calling`: its API functions and its generator's options, read from its catalogue entry), so
that the property judges every call they make.

A combination that needs several steps belongs to the generator class ``multi_step`` and runs
only where the effort generates it (``--without-class multi_step`` leaves it out, as it leaves
out the drawn step programs).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pipemetrics.properties.effort import Effort, Semantic
from pipemetrics.properties.strategies_moe_calls import moe_call
from pipemetrics.properties.synthetic import step_records
from pipemetrics.sim.model.calls import CallSpec, MoeCall, MtpCall, RouterConfig, TrackNamesCall
from pipemetrics.sim.model.layout import ModelLayout, Setup, WorldSpec
from pipemetrics.sim.model.records import StepRecords
from pipemetrics.sim.model.scenario import Scenario, Step


def _records(setup: Setup, step: int) -> StepRecords:
    """One training step's records, every value distinct (per step, rank, slot and name)."""
    names = {name: i for i, name in enumerate(setup.layout.recorded_track_names)}
    return step_records(
        setup,
        lambda rank, mb, slot, name: 1.0 + rank / 7 + slot / 131 + names[name] / 1009 + step / 97,
        lambda rank, mb, layer: (0.5 + rank / 11 + step / 97, 1.0, 2.0),
    )


def _moe_stages_setup(mtp: bool) -> Setup:
    """pp 2: stage 0 without MoE layers (it holds the names only as pre-initialised), stage 1
    with an MoE layer recording z_loss and load_balancing_loss; an MTP layer with ``mtp``."""
    layout = ModelLayout(
        num_layers=2, moe_layer_freq=[0, 1], mtp_num_layers=1 if mtp else 0,
        routing_type="aux_loss", aux_loss_coeff=0.01, z_loss_coeff=1e-3,
    )  # fmt: skip
    return Setup(world=WorldSpec(pp=2), layout=layout)


MOE = "get_moe_metrics"
MTP = "get_mtp_metrics"


@dataclass(frozen=True)
class Calling:
    """What a property calls, and so what the scenarios a combination builds for it call: its
    API functions (`Property.functions`) and its generator's options (`Generator.options`)."""

    functions: tuple[str, ...]
    options: tuple[tuple[str, object], ...] = ()

    @property
    def moe(self) -> bool:
        return MOE in self.functions

    @property
    def mtp(self) -> bool:
        return MTP in self.functions

    @property
    def total_loss_dict(self) -> bool:
        """Whether its ``get_moe_metrics`` calls accumulate into a ``total_loss_dict``."""
        return dict(self.options).get("total_loss_dict") is True


def _calls(setup: Setup, semantic: Semantic, calling: Calling) -> list[CallSpec]:
    """The calls a property's scenario makes after each step: those of its functions."""
    calls: list[CallSpec] = []
    if calling.moe:
        moe = moe_call(
            setup.layout, semantic, loss_scale=0.5, per_layer_logging=True,
            use_total_loss_dict=calling.total_loss_dict, composed=True,
        )  # fmt: skip
        calls.append(moe)
    if calling.mtp:
        calls.append(MtpCall(loss_scale=0.5))
    return calls


def state_between_calls(effort: Effort, semantic: Semantic, calling: Calling) -> list[Scenario]:
    """Three steps, a call after each: train, forward-only (nothing recorded: a call that
    remembered the first step's names or values returns them again), train."""
    setup = _moe_stages_setup(mtp=calling.mtp)
    calls = _calls(setup, semantic, calling)
    steps = [
        Step(records=_records(setup, 0), calls=list(calls)),
        Step(records=None, calls=list(calls)),
        Step(records=_records(setup, 2), calls=list(calls)),
    ]
    return [Scenario(setup=setup, steps=steps, deadline_s=effort.deadline_s)]


def first_recorded_later(effort: Effort, semantic: Semantic, calling: Calling) -> list[Scenario]:
    """One rank (every rank records every name, so ``track_names=None`` is a documented call):
    a forward-only step and its call (nothing recorded yet), then a training step and its call,
    without pre-initialisation: the names appear only in the later step (and an MTP call after
    each where the property calls ``get_mtp_metrics`` too)."""
    layout = ModelLayout(
        num_layers=1, moe_layer_freq=[1], routing_type="aux_loss", aux_loss_coeff=0.01,
        z_loss_coeff=1e-3, mtp_num_layers=1 if calling.mtp else 0,
    )  # fmt: skip
    setup = Setup(world=WorldSpec(), layout=layout)
    unwired = MoeCall(
        loss_scale=0.5, per_layer_logging=True, num_layers=None, track_names=None,
        num_moe_layers=layout.num_moe_layers if semantic == "megatron" else None,
    )  # fmt: skip
    calls: list[CallSpec] = [unwired]
    if calling.mtp:
        calls.append(MtpCall(loss_scale=0.5))
    steps = [Step(records=None, calls=list(calls)), Step(records=_records(setup, 1), calls=calls)]
    return [Scenario(setup=setup, steps=steps, deadline_s=effort.deadline_s)]


LIVE_NAMES_CONFIGS: tuple[RouterConfig, ...] = (
    RouterConfig(routing_type="aux_loss", aux_loss_coeff=0.01, z_loss_coeff=1e-3),
    RouterConfig(routing_type="seq_aux_loss", aux_loss_coeff=0.01),
    RouterConfig(routing_type="none", aux_loss_coeff=0.0),
    RouterConfig(routing_type=["aux_loss", "seq_aux_loss"], aux_loss_coeff=[0.0, 0.01]),
    RouterConfig(routing_type="aux_loss", aux_loss_coeff=0.01, z_loss_coeff=1e-3),
)
"""Configs in one run whose live names change from one to the next (and come back): a copy that
caches the names of the first config, or keys a cache on anything but the config's values,
returns stale names."""


def live_names_change(effort: Effort, semantic: Semantic, calling: Calling) -> list[Scenario]:
    """One rank calls ``get_aux_loss_track_names`` for several configs in one process."""
    setup = Setup(layout=ModelLayout(num_layers=1))
    calls: list[CallSpec] = [TrackNamesCall(config=config) for config in LIVE_NAMES_CONFIGS]
    return [Scenario(setup=setup, steps=[Step(calls=calls)], deadline_s=effort.deadline_s)]


def _steps_between(scenario: Scenario, kind: type) -> bool:
    calling = [
        i for i, step in enumerate(scenario.steps) if any(isinstance(c, kind) for c in step.calls)
    ]
    if len(calling) < 2:
        return False
    trains = [scenario.steps[i].records is not None for i in range(calling[-1] + 1)]
    return any(trains) and not all(trains)


def _has_state_between_calls(scenario: Scenario) -> bool:
    """Two steps call one function, and the steps up to the last call both record and not:
    what one call saw differs from what a later one must see."""
    return scenario.mode == "synthetic" and (
        _steps_between(scenario, MoeCall) or _steps_between(scenario, MtpCall)
    )


def _has_first_recorded_later(scenario: Scenario) -> bool:
    """A ``get_moe_metrics`` call with ``track_names=None`` after an earlier call made before
    anything was recorded, with records between them."""
    if scenario.mode != "synthetic":
        return False
    first_call: int | None = None
    for index, step in enumerate(scenario.steps):
        moe = [c for c in step.calls if isinstance(c, MoeCall)]
        recorded = any(s.records is not None for s in scenario.steps[: index + 1])
        if first_call is None and moe and not recorded:
            first_call = index
        elif first_call is not None and recorded and any(c.track_names is None for c in moe):
            return True
    return False


def _has_live_names_change(scenario: Scenario) -> bool:
    """Several ``get_aux_loss_track_names`` calls in one run whose live names differ."""
    layout = scenario.setup.layout
    found = {
        tuple(call.expected_names(layout))
        for step in scenario.steps
        for call in step.calls
        if isinstance(call, TrackNamesCall)
    }
    return len(found) > 1


@dataclass(frozen=True)
class Combination:
    name: str
    what: str
    scenarios: Callable[[Effort, Semantic, Calling], list[Scenario]]
    """The scenarios that make it (one floor's worth) for a property that calls what
    `Calling` says."""
    present: Callable[[Scenario], bool]
    generator_class: str | None = None
    """The generator class the combination belongs to (it runs only where that is generated)."""

    def runs_under(self, effort: Effort) -> bool:
        return self.generator_class is None or effort.generates(self.generator_class)


STATE_BETWEEN_CALLS = Combination(
    "state_between_calls",
    "state kept between calls: a later call after a step that recorded nothing (a "
    "module-level cache, names or values remembered from an earlier step)",
    state_between_calls,
    _has_state_between_calls,
    "multi_step",
)
NAME_FIRST_RECORDED_LATER = Combination(
    "name_first_recorded_later",
    "a name first recorded in a later step while track_names is None (a plan decided at "
    "the first call, when nothing was recorded)",
    first_recorded_later,
    _has_first_recorded_later,
    "multi_step",
)
LIVE_NAMES_CHANGE = Combination(
    "live_names_change",
    "a config whose live names change between calls in one process (names cached from "
    "an earlier config)",
    live_names_change,
    _has_live_names_change,
)
COMBINATIONS: tuple[Combination, ...] = (
    STATE_BETWEEN_CALLS,
    NAME_FIRST_RECORDED_LATER,
    LIVE_NAMES_CHANGE,
)
"""Every combination, each counted in every scenario's coverage; a catalogue entry names those
its property runs first (`Property.combinations`)."""


def combinations_under(combinations: Sequence[Combination], effort: Effort) -> list[Combination]:
    """Those of ``combinations`` (a property's) that run under ``effort``."""
    return [c for c in combinations if c.runs_under(effort)]


def combination_scenarios(
    combinations: Sequence[Combination], calling: Calling, effort: Effort, semantic: Semantic
) -> list[Scenario]:
    """Every scenario a property that calls ``calling`` runs first: those of its
    ``combinations`` that run under ``effort``, at their floor."""
    return [
        scenario
        for c in combinations_under(combinations, effort)
        for scenario in c.scenarios(effort, semantic, calling)
    ]


def present_combinations(scenario: Scenario) -> list[str]:
    """The combinations a scenario makes, drawn or built."""
    return [c.name for c in COMBINATIONS if c.present(scenario)]
