"""What the generator actually produced: rare layouts, world sizes, broadcast inputs.

A suite that never generates a stage without MoE, MTP or a large world proves nothing about
them; `features` names the interesting traits of a scenario, and `Coverage` counts them over a
run so the report can say which rare cases were exercised.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any

from pipemetrics.properties.combinations import COMBINATIONS, present_combinations
from pipemetrics.properties.effort import GENERATOR_CLASSES, is_wide
from pipemetrics.properties.strategies_scales import LARGEST_ORDINARY_SCALE
from pipemetrics.sim.model.calls import NEW_GROUP, BroadcastCall, MoeCall, MtpCall, TrackNamesCall
from pipemetrics.sim.model.layout import EvenSplit, Setup, WorldSpec
from pipemetrics.sim.model.scenario import Scenario
from pipemetrics.sim.model.topology import broadcast_plan, places_for
from pipemetrics.sim.worlds.world import WorldRun

RARE: tuple[str, ...] = (
    "stage_without_moe",
    "mtp",
    "mtp_moe_layers",
    "num_layers_eq_pp",
    "one_layer_stage",
    "uneven_split",
    "empty_stage",
    "routing_list",
    "zero_coefficient",
    "z_loss",
    "no_live_names",
    "multi_step",
    "router_mode",
    "mtp_standalone",
    "embedding_only_stage",
    "loss_only_stage",
    "vpp=2",
)
"""Traits the report always lists, even when never seen (a zero count is the warning)."""


def layout_features(setup: Setup) -> list[str]:
    world, layout = setup.world, setup.layout
    found = []
    stages = range(world.pp)
    if any(not setup.records_moe(stage) for stage in stages):
        found.append("stage_without_moe")
    if layout.mtp_num_layers:
        found.append("mtp")
        found.append("mtp_moe_layers" if layout.mtp_is_moe else "mtp_dense_layers")
        if layout.mtp_per_token_loss:
            found.append("mtp_per_token_loss")
        if not layout.mtp_acceptance:
            found.append("mtp_acceptance_off")
    sizes = setup.layers_per_stage
    if layout.num_layers == world.pp:
        found.append("num_layers_eq_pp")
    if 1 in sizes:
        found.append("one_layer_stage")
    if 0 in sizes:
        found.append("empty_stage")
    if not isinstance(layout.split, EvenSplit) and len(set(sizes)) > 1:
        found.append("uneven_split")
    if isinstance(layout.routing_type, list):
        found.append("routing_list")
    coeffs = (
        layout.aux_loss_coeff
        if isinstance(layout.aux_loss_coeff, list)
        else [layout.aux_loss_coeff]
    )
    if 0.0 in coeffs:
        found.append("zero_coefficient")
    if layout.z_loss_coeff is not None:
        found.append("z_loss" if layout.z_loss_coeff else "z_loss_zero_coeff")
    if not layout.live_track_names:
        found.append("no_live_names")
    if layout.microbatches > 1:
        found.append("microbatches>1")
    flexible = setup.pipeline_layout
    if flexible is not None:
        found.append(f"vpp={flexible.vpp}")
        if flexible.mtp_standalone:
            found.append("mtp_standalone")
        if flexible.grid[0][0] == ["E"]:
            found.append("embedding_only_stage")
        if flexible.grid[-1][-1] == ["L"]:
            found.append("loss_only_stage")
    return found


def broadcast_features(call: BroadcastCall, world: WorldSpec) -> list[str]:
    found = [f"dtype={call.dtype}"]
    if is_group_broadcast(call, world):
        found.append(f"group={call.group}")
        plan = broadcast_plan(call, world)
        if len({role.members for role in plan.values()}) > 1:
            found.append("several_groups_at_once")
        if any(role.members.index(role.source) != 0 for role in plan.values()):
            found.append("src_not_group_rank0")
        if any(role.source != role.members.index(role.source) for role in plan.values()):
            found.append("src_global_ne_group_rank")
    if not call.shape:
        found.append("0-d")
    elif 0 in call.shape:
        found.append("empty")
    if call.non_contiguous:
        found.append("non_contiguous")
        found.append("strided_source" if call.strided else "transposed_source")
    if call.source_passes_none:
        found.append("source_none")
    if call.buffers:
        found.append("receiver_buffer")
    if any(
        b.shape != call.shape or b.dtype != call.dtype or b.device != "default"
        for b in call.buffers.values()
    ):
        found.append("invalid_buffer")
    return found


def loss_scale_features(call: MoeCall | MtpCall) -> list[str]:
    """How ``loss_scale`` was passed: its form (``loss_scale=numpy``, ``loss_scale=tensor``,
    ``mtp_default``: ``get_mtp_metrics()``) and value (0, negative, large)."""
    found = []
    form = call.loss_scale_form
    if form == "default":
        found.append("mtp_default")
    elif form != "float":
        found.append(f"loss_scale={form.partition('.')[0]}")
    if call.loss_scale == 0:
        found.append("loss_scale=0")
    elif call.loss_scale < 0:
        found.append("loss_scale<0")
    if abs(call.loss_scale) > LARGEST_ORDINARY_SCALE:
        found.append("loss_scale_large")
    return found


def uses_new_argument_form(call: MoeCall | MtpCall) -> bool:
    """Whether a call passes ``loss_scale`` in a form of the generator class ``argument_forms``
    (anything but a Python float between 0 and `LARGEST_ORDINARY_SCALE`)."""
    return call.loss_scale_form != "float" or not 0 <= call.loss_scale <= LARGEST_ORDINARY_SCALE


def moe_call_features(setup: Setup, call: MoeCall) -> list[str]:
    """The argument forms of a ``get_moe_metrics`` call (strict generates them all)."""
    found = []
    if call.num_layers is None:
        found.append("num_layers=None")
    if call.track_names is None:
        found.append("track_names=None")
    elif not call.track_names:
        found.append("track_names=[]")
    else:
        live = set(setup.layout.recorded_track_names)
        if live - set(call.track_names):
            found.append("recorded_names_outside_track_names")
        if set(call.track_names) - live:
            found.append("track_names_never_recorded")
    if setup.layout.mtp_num_layers and call.mtp_num_layers is None:
        found.append("mtp_num_layers=None_with_mtp")
    return found


def step_program_traits(scenario: Scenario) -> list[str]:
    """What makes a multi-step scenario a step program rather than the same step repeated."""
    steps = scenario.steps
    if len(steps) < 2 or scenario.mode != "synthetic":
        return []
    found = []
    if any(step.records is None for step in steps):
        found.append("forward_only_step")
    if any(step.records is None for step in steps[:1]) and any(s.records for s in steps[1:]):
        found.append("first_records_in_a_later_step")
    kinds = [tuple(type(call).__name__ for call in step.calls) for step in steps]
    if any(not k for k in kinds):
        found.append("step_without_call")
    if len(set(kinds)) > 1:
        found.append("calls_differ_between_steps")
    if any(k[:2] == ("MtpCall", "MoeCall") for k in kinds):
        found.append("mtp_before_moe")
    return found


def is_group_broadcast(call: BroadcastCall, world: WorldSpec) -> bool:
    """A broadcast over a new_group or over a role whose groups do not span the world (where a
    group rank and a global rank differ): generator class ``group_broadcast``."""
    if call.group == NEW_GROUP:
        return True
    return len(places_for(world)[0].groups[call.group]) < world.world_size


def step_sources(scenario: Scenario) -> list[set[int]]:
    """Per step, the global source ranks of its broadcasts."""
    world = scenario.setup.world
    return [
        {
            role.source
            for call in step.calls
            if isinstance(call, BroadcastCall)
            for role in broadcast_plan(call, world).values()
        }
        for step in scenario.steps
    ]


def generator_classes(scenario: Scenario) -> set[str]:
    """The `GENERATOR_CLASSES` one scenario belongs to."""
    found: set[str] = set()
    setup = scenario.setup
    world = setup.world
    uses_layout = any(
        isinstance(call, MoeCall | MtpCall) for step in scenario.steps for call in step.calls
    )
    flexible = setup.pipeline_layout
    if uses_layout and flexible is not None:
        found.add("virtual_pipeline" if flexible.vpp > 1 else "flexible_layout")
    if is_wide(world):
        found.add("wide_world")
    if step_program_traits(scenario):
        found.add("multi_step")
    calls = [call for step in scenario.steps for call in step.calls]
    if any(isinstance(c, BroadcastCall) and is_group_broadcast(c, world) for c in calls):
        found.add("group_broadcast")
    if any(isinstance(c, MoeCall | MtpCall) and uses_new_argument_form(c) for c in calls):
        found.add("argument_forms")
    return found


def features(scenario: Scenario) -> list[str]:
    """The traits of one scenario."""
    world = scenario.setup.world
    found = [f"world_size={world.world_size}", f"shape={world.key.removeprefix('gloo-')}"]
    calls = [call for step in scenario.steps for call in step.calls]
    if any(isinstance(c, MoeCall | MtpCall | TrackNamesCall) for c in calls):
        found += layout_features(scenario.setup)
    if any(
        rec.num_tokens == 0.0
        for step in scenario.steps
        if step.records is not None
        for recs in step.records.mtp.values()
        for rec in recs
    ):
        found.append("mtp_zero_token_microbatch")
    if len(scenario.steps) > 1:
        found.append("multi_step")
        found += step_program_traits(scenario)
    if scenario.mode == "router":
        found.append("router_mode")
    for call in calls:
        if isinstance(call, BroadcastCall):
            found += broadcast_features(call, world)
        elif isinstance(call, MoeCall):
            found += moe_call_features(scenario.setup, call) + loss_scale_features(call)
        elif isinstance(call, MtpCall):
            found += loss_scale_features(call)
    if any(len(sources) > 1 for sources in step_sources(scenario)):
        found.append("several_sources")
    found += [f"class:{name}" for name in sorted(generator_classes(scenario))]
    found += [f"combination:{name}" for name in present_combinations(scenario)]
    return found


WIRED_WORDS: dict[str, str] = {
    "absent": "the target defines no get_aux_loss_track_names",
    "raised": "its get_aux_loss_track_names raised or returned no list of names",
    "not_mirrored": "its names are not the router's (outside strict the document promises "
    "nothing for them)",
}
"""Why a trainer-wired call passed the router's names (`ComposedStatus`), in words."""


def wired_features(run: WorldRun) -> list[str]:
    """``wired:STATUS`` for every trainer-wired ``get_moe_metrics`` call of a run, by the
    `ComposedStatus` of its lowest rank (``wired:composed``: the target's own names passed)."""
    found = []
    for result in run.ranks.values():
        if result.done is None:
            continue
        for report in result.done.reports:
            if report.composed is not None:
                found.append(f"wired:{report.composed.status}")
    return found


def wired_notes(counts: Counter[str]) -> list[str]:
    """One line for each reason trainer-wired calls were not made as wired (the router's names
    passed instead), with the number of scenarios."""
    return [
        f"the trainer-wired get_moe_metrics form was skipped in {counts[f'wired:{status}']} "
        f"scenario(s): {words}; the router's names were passed instead"
        for status, words in WIRED_WORDS.items()
        if counts.get(f"wired:{status}")
    ]


class Coverage:
    """Counts of traits over every scenario run.

    ``classes``: the generator classes the profile generates; one of them that no scenario
    belonged to is listed under ``classes_never_generated`` (a warning in the report).
    """

    def __init__(self, classes: Iterable[str] = GENERATOR_CLASSES) -> None:
        self.counts: Counter[str] = Counter()
        self.scenarios = 0
        self.classes = tuple(name for name in GENERATOR_CLASSES if name in set(classes))

    def add(self, scenario: Scenario) -> None:
        self.scenarios += 1
        self.counts.update(set(features(scenario)))

    def expect(self, combination: str, floor: int) -> None:
        """A property that runs ``floor`` scenarios of ``combination`` first is about to run."""
        self.counts[f"floor:{combination}"] += floor

    def add_run(self, run: WorldRun) -> None:
        """Count what the ranks did that the scenario alone does not say: how each
        trainer-wired ``get_moe_metrics`` call was made (`wired_features`)."""
        self.counts.update(set(wired_features(run)))

    def merge(self, data: dict[str, Any]) -> None:
        self.scenarios += int(data.get("scenarios", 0))
        self.counts.update({k: int(v) for k, v in data.get("counts", {}).items()})

    def as_json(self) -> dict[str, Any]:
        counts = {name: self.counts.get(name, 0) for name in RARE}
        counts.update(self.counts)
        sizes = sorted(int(k.split("=")[1]) for k in self.counts if k.startswith("world_size="))
        return {
            "scenarios": self.scenarios,
            "world_sizes": sizes,
            "never_seen": [name for name in RARE if not self.counts.get(name)],
            "classes": {name: self.counts.get(f"class:{name}", 0) for name in self.classes},
            "classes_never_generated": [
                name for name in self.classes if not self.counts.get(f"class:{name}")
            ],
            "counts": dict(sorted(counts.items())),
            "notes": wired_notes(self.counts),
            "combinations": {
                c.name: {
                    "count": self.counts.get(f"combination:{c.name}", 0),
                    "floor": self.counts.get(f"floor:{c.name}", 0),
                }
                for c in COMBINATIONS
            },
            "combinations_below_floor": [
                c.name
                for c in COMBINATIONS
                if self.counts.get(f"combination:{c.name}", 0)
                < self.counts.get(f"floor:{c.name}", 0)
            ],
        }
