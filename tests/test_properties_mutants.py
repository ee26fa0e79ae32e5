"""Every deliberately broken implementation of tests/broken fails the properties it names.

The mutants are judged as `check --only` judges one (its listed properties, ``--seed 0``, its
budget), but on shared passes (`MutantPasses`): for each generator and way of drawing, one pass
drawn once, every mutant of it run on each scenario, each failure then shrunk, confirmed and
written for replay by its property's real test on that mutant; inside the test's process, with
a hard bound and leftover checks (`bounded_here`). The CLI around the engine is tested in
test_properties_runner.py; a class run (below) is `check` itself (`check_here`).
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest

from pipemetrics.commands.replay import replay_main
from pipemetrics.properties.catalogue import BY_ID, CATALOGUE, Generator
from pipemetrics.properties.catalogue import PROPERTY_IDS as CATALOGUE_IDS
from pipemetrics.properties.coverage import Coverage
from pipemetrics.properties.diagnosis import PHRASES, Cause
from pipemetrics.properties.effort import EFFORTS, get_effort
from pipemetrics.properties.engine import PropertyResult
from pipemetrics.properties.passes import Pass, combined, passes, run_pass_on
from pipemetrics.properties.run_options import RunOptions
from pipemetrics.properties.shared import SharedRuns
from pipemetrics.properties.tier import check_tier
from pipemetrics.sim.mcore import installed_features
from pipemetrics.sim.model.target import resolve_target
from pipemetrics.sim.worlds.inprocess_world import inprocess_unsupported
from pipemetrics.sim.worlds.pool import WorldPool

from .broken.mutants import MUTANTS, without_mutant, write_mutant
from .broken.test_mutants_apply import NEEDS_TO_RUN, NEEDS_TO_SHOW
from .conftest import Bounds
from .test_pipeline_layout import NEEDS_STANDALONE_MTP as STANDALONE_MTP_REFUSED
from .test_properties_runner import bounded_here, check_here

#: Mutants whose bug is in the MTP acceptance rate: with an MTP tracker that holds no acceptance
#: counts (megatron-core 0.18) there is no rate to get wrong, so they cannot fail there.
ACCEPTANCE_MUTANTS = frozenset(
    {"mtp_acceptance_scaled", "mtp_acceptance_unclamped_total", "mtp_empty_layer_rate_hundred"}
)
NO_COUNTS = (
    "the installed megatron-core's MTP tracker has no acceptance counts (0.18): "
    "an acceptance-rate bug cannot show"
)

#: Examples per property for a mutant's run with ``--seed 0`` (a found bug ends the search, so a
#: budget costs only where a mutant is not caught, and in its class run, which passes every
#: example). Hypothesis draws its first ``min(max_examples // 10, 50)`` examples small, so from
#: 500 examples on, what a seed draws no longer depends on the budget, and the example at which
#: a bug is first found (the report's ``found_at``), measured once with a large budget, holds.
#: It also does not depend on the install or on literals in the code
#: (drawing.draws_independent_of_local_code), but does on Hypothesis's version (pinned in
#: ci/constraints.txt), on the strategies and on the release (the generators draw only what it
#: can build): re-measure after changing any of them. With 500, every mutant outside `EXAMPLES`
#: is found by example 152 or earlier on every release 0.13.1-0.19.2 (measured 2026-12-03:
#: moe_steady_state_decided_locally 152 on 0.13.1 and 72 on 0.19.2; moe_local_insertion_order
#: 85, moe_total_loss_overwritten 76, moe_tracker_not_cleared 65, all on 0.13.1;
#: mtp_tracker_not_cleaned 47; every other one by example 24). Measured 2026-12-05 on 0.19.2:
#: broadcast_source_not_contiguous 55, moe_wired_names_paired_by_position 3,
#: track_names_aux_before_z_loss 3 (1 with the live_names_change combination run first).
MAX_EXAMPLES = 500
#: Other budgets, each with the largest ``found_at`` over 0.13.1-0.19.2 at 2,500 examples. Below
#: 500 only for mutants with a class run (whose cost is every example); as a budget under 500
#: shapes the draws, each of those was checked at its own budget by a whole-suite run on every
#: release (2026-12-03).
EXAMPLES: dict[str, int] = {
    # a broadcast over a subgroup whose global and group ranks of the source differ: 59
    "broadcast_global_src_as_group_src": 200,
    # ep = 2 with dp = 2 and a load-balancing loss that differs between dp ranks: 127 (0.19)
    "moe_dp_avg_over_expert_data_group": 400,
    # argument_forms: a negative, tensor or non-float loss_scale: 7 at most
    "moe_loss_scale_exact_float_type": 80,
    "moe_loss_scale_negative_rejected": 80,
    "moe_loss_scale_tensor_rejected": 80,
    "mtp_loss_scale_required": 80,
    # a first step that records nothing and a later one that does, track_names None: 32 (0.13.1)
    "moe_plan_cached_after_first_call": 100,
    # get_mtp_metrics before get_moe_metrics in a step, with a live MoE name: 40 (0.13.1)
    "mtp_clears_moe_tracker": 120,
    # MTP layers in a virtual pipeline (the last chunk of the last rank): 230 (0.16.1-0.19.2)
    "mtp_gated_on_virtual_last_stage": 700,
}


#: The Hypothesis profile a mutant's run draws from, where it is not ``dev``.
HYPOTHESIS_PROFILES: dict[str, str] = {
    # its deadlock needs a second rank in the last stage's MTP averaging group: data+context
    # parallel on 0.14+ (dev draws dp = 2), tensor+context on 0.13 (only ci draws tp or cp = 2)
    "mtp_reduce_on_logging_rank_only": "ci",
}


#: Shrinking budget per failing property: the test needs a failure that replays, not the
#: smallest one (every example shrinking runs is a world).
SHRINK_SECONDS = 3


def why_not_here(name: str) -> list[str]:
    """Every reason ``name``'s bug cannot show on the installed megatron-core: the
    acceptance-rate mutants without counts, those of `NEEDS_TO_SHOW` (an API the mutant's code
    or its bug needs is missing, e.g. a per-entry data-parallel setting on 0.13-0.15), and
    those needing MTP in a flexible layout, a standalone MTP stage or the MTP layers' own
    tracker slots where the release has none."""
    features = installed_features()
    reasons = []
    if name in ACCEPTANCE_MUTANTS and not features.mtp_counts_acceptance:
        reasons.append(NO_COUNTS)
    if name in NEEDS_TO_SHOW:
        reasons.append(NEEDS_TO_SHOW[name])
    if name in NEEDS_MTP_IN_FLEXIBLE_LAYOUT and not features.layout_takes_mtp:
        reasons.append(NO_MTP_IN_FLEXIBLE_LAYOUT)
    if name in NEEDS_STANDALONE_MTP and STANDALONE_MTP_REFUSED.args[0]:
        reasons.append(STANDALONE_MTP_REFUSED.kwargs["reason"])
    if name in NEEDS_MTP_SLOTS and features.mtp_router_numbering == "default_layer_number":
        reasons.append(NO_MTP_SLOTS)
    return reasons


def mutant_param(name: str) -> Any:
    """``name``, skipped where its bug cannot show on the installed megatron-core
    (`why_not_here`)."""
    return pytest.param(name, marks=[pytest.mark.skip(reason=r) for r in why_not_here(name)])


#: Mutants whose bug shows only with MTP layers in a flexible or virtual pipeline layout (a
#: standalone MTP stage; a virtual last stage), which megatron-core 0.13's
#: PipelineParallelLayerLayout refuses, so the generators do not draw them there.
NEEDS_MTP_IN_FLEXIBLE_LAYOUT = frozenset(
    {"moe_mtp_slots_only_on_last_stage", "mtp_gated_on_virtual_last_stage"}
)
NO_MTP_IN_FLEXIBLE_LAYOUT = (
    "needs MTP layers in a flexible or virtual pipeline layout; the installed megatron-core's "
    "PipelineParallelLayerLayout.validate_layer_layout takes no mtp_num_layers (refuses them)"
)
#: Mutants whose bug shows only with the MTP layers on a stage that is not the last
#: (``mtp_standalone``), which megatron-core 0.15's layout refuses (0.14's assert is a tuple);
#: skipped there by test_pipeline_layout's marker.
NEEDS_STANDALONE_MTP = frozenset({"moe_mtp_slots_only_on_last_stage"})


#: Mutants whose bug is in the MTP layers' own tracker slots (``num_layers + k``), which the
#: MoE routers inside MTP layers record into from 0.16 on; 0.13-0.15's record into the slot of
#: the MTP chunk's first decoder layer, so there are no MTP slots to lose.
NEEDS_MTP_SLOTS = frozenset({"moe_mtp_slots_only_on_last_stage"})
NO_MTP_SLOTS = (
    "needs MoE routers inside MTP layers that record into the MTP layers' own tracker slots "
    "(num_layers + k); the installed megatron-core's record into a decoder layer's slot"
)


@dataclass(frozen=True)
class Draws:
    """How a mutant's passes draw, besides their generator and the seed (0 for every mutant):
    the semantic profile, the Hypothesis profile and the examples per property."""

    profile: Any
    effort: str
    examples: int


def draws_of(name: str) -> Draws:
    mutant = MUTANTS[name]
    effort = HYPOTHESIS_PROFILES.get(name, "dev")
    return Draws(mutant.profile, effort, EXAMPLES.get(name, MAX_EXAMPLES))


def passes_of(name: str) -> list[Pass]:
    """The passes `check --only` runs for the mutant's listed properties."""
    fails = MUTANTS[name].fails
    return passes([prop for prop in CATALOGUE if prop.id in fails])


@dataclass
class MutantPasses:
    """Every mutant that can show here judged on shared passes, each run on first need: for a
    generator and `Draws`, one pass (`pipemetrics.properties.passes.run_pass_on`) judges every
    such mutant's listed properties of that generator, each mutant run on each scenario drawn,
    and a property a mutant does not pass is shrunk, confirmed on the process tier and written
    for replay by its real test on that mutant. A mutant's result for a property is then
    `combined` over its passes, as `check` combines them."""

    root: Path
    bounds: Bounds
    results: dict[str, list[PropertyResult]] = field(default_factory=dict)
    output: dict[tuple[Generator, Draws], str] = field(default_factory=dict)
    """What each pass printed, by its generator and draws."""

    def results_of(self, name: str) -> tuple[dict[str, PropertyResult], str]:
        """The mutant's result for each listed property, and the output of its passes."""
        draws = draws_of(name)
        for held in passes_of(name):
            if (held.generator, draws) not in self.output:
                self._run(held.generator, draws)
        mine = combined(self.results.get(name, []), passes_of(name))
        text = "\n".join(self.output[held.generator, draws] for held in passes_of(name))
        return {result.id: result for result in mine}, text

    def _options(self, name: str) -> RunOptions:
        draws = draws_of(name)
        effort = replace(get_effort(draws.effort), shrink_budget_s=SHRINK_SECONDS)
        path = write_mutant(name, self.root / "mutants")
        return RunOptions(
            target=resolve_target(str(path)), profile=draws.profile, effort=effort,
            max_examples=draws.examples, seed=0, database="none",
            report_dir=self.root / name, tier=check_tier("inprocess")[0],
        )  # fmt: skip

    def _run(self, generator: Generator, draws: Draws) -> None:
        """The pass of ``generator`` for every mutant here that draws by ``draws`` on it."""
        members = [
            (name, held)
            for name in sorted(MUTANTS)
            if not why_not_here(name) and draws_of(name) == draws
            for held in passes_of(name)
            if held.generator == generator
        ]
        targets = [(held, self._options(name)) for name, held in members]
        options = targets[0][1]
        bound = self.bounds(42, 420) * len(members)  # each mutant's run as `check_here` bounds it
        ranks = options.effort.max_ranks
        with (
            bounded_here(bound, self.bounds(1, 10), "the mutants' pass") as text,
            WorldPool(max_ranks=ranks, tier=options.tier) as pool,
            WorldPool(max_ranks=ranks) as confirm_pool,  # starts worlds only to confirm
        ):
            found = run_pass_on(targets, SharedRuns(pool), Coverage(), confirm_pool)
        for (name, _), results in zip(members, found, strict=True):
            self.results.setdefault(name, []).extend(results)
        self.output[generator, draws] = text.getvalue()


@pytest.fixture(scope="module")
def mutant_passes(
    tmp_path_factory: pytest.TempPathFactory, bounds: Bounds
) -> Iterator[MutantPasses]:
    yield MutantPasses(tmp_path_factory.mktemp("mutant-passes"), bounds)


@pytest.mark.parametrize("name", [mutant_param(n) for n in sorted(MUTANTS)])
def test_mutant_fails_its_properties(
    tmp_path: Path, mutant_passes: MutantPasses, name: str
) -> None:
    """Each named property fails, and replaying each failure file judges the same."""
    mutant = MUTANTS[name]
    found, output = mutant_passes.results_of(name)
    for property_id in mutant.fails:
        entry = found[property_id].as_json()
        assert entry["status"] == "fail", f"{name}: {property_id} is {entry['status']}\n{output}"
        assert "PicklingError" not in (entry["message"] or "")
        assert entry["replay"] and entry["counterexample"]
        assert_replay_reproduces(entry, tmp_path / f"{property_id}.replay.json")
        assert_diagnosis_names_cause(mutant.cause, entry["message"])


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(name, marks=pytest.mark.skip(reason=NEEDS_TO_RUN[name]))
        if name in NEEDS_TO_RUN
        else mutant_param(name)  # where the bug cannot show, no class can be shown to matter
        for name, mutant in sorted(MUTANTS.items())
        if mutant.caught_by_classes
    ],
)
def test_the_generators_before_its_class_miss_the_mutant(
    tmp_path: Path, bounds: Bounds, name: str
) -> None:
    """Proof that a generator class matters: with the classes that expose the mutant left out
    (``--without-class``), the same run (seed, examples) passes it; test_mutant_fails_its_
    properties shows that it fails with them.

    Every example of this run passes, so it runs on the in-process tier where the release
    allows it (about twice as fast here; tests/test_inprocess.py holds the two tiers to the same
    outcomes), the process tier elsewhere."""
    mutant = MUTANTS[name]
    path = write_mutant(name, tmp_path / "mutants")
    without = [arg for cls in mutant.caught_by_classes for arg in ("--without-class", cls)]
    tier = "process" if inprocess_unsupported() is not None else "inprocess"
    code, data, output = check_here(
        tmp_path, "--impl", str(path), "--only", *mutant.fails, "--profile", mutant.profile,
        "--hypothesis-profile", HYPOTHESIS_PROFILES.get(name, "dev"),
        "--max-examples", str(EXAMPLES.get(name, MAX_EXAMPLES)), "--seed", "0",
        "--tier", tier, *without, bounds=bounds,
    )  # fmt: skip
    assert data is not None, output
    assert code == 0, output
    assert {p["id"]: p["status"] for p in data["properties"]} == dict.fromkeys(
        mutant.fails, "pass"
    ), output
    generated = data["coverage"]["classes"]
    assert not set(generated) & set(mutant.caught_by_classes), generated


def assert_diagnosis_names_cause(cause: Cause | None, message: str) -> None:
    """A mutant with a known cause: the failure's first diagnosis line names that cause, alone,
    or among the candidates where the shrunk counterexample's numbers cannot tell it from
    another hypothesis (moe_loss_scale_twice shrinks to loss_scale 2 with one stage's values,
    where a doubled scale and an extra SUM over pp give the same numbers); never another cause
    alone. Without a cause (`Mutant.no_cause` says why) nothing is asserted of its diagnoses:
    test_diagnosis.py holds that no diagnosis names a cause another hypothesis explains as
    well."""
    if cause is None:
        return
    lines = [line for line in message.splitlines() if ": diagnosis: " in line]
    assert lines, f"no diagnosis line for cause {cause!r}:\n{message}"
    named = lines[0].split(": diagnosis: ", 1)[1]
    if named.startswith("no single cause"):
        candidates = named.split(" equally well: ", 1)[1].split("; ")
        assert any(c.startswith(PHRASES[cause]) for c in candidates), message
    else:
        assert named.startswith(PHRASES[cause]), f"expected {PHRASES[cause]!r}:\n{message}"


OUTCOME_KINDS = frozenset({"deadlock", "mismatch", "crash", "timeout"})
RUNNER_NOTES = ("... and ", "(the failure did not reproduce")


def outcome_of(lines: list[str]) -> list[str]:
    """Problem lines with a world outcome reduced to its kind (which rank was still running
    when a deadlock was decided may differ between two runs; the outcome may not)."""
    return [
        line.split(":", 1)[0] if line.split(":", 1)[0] in OUTCOME_KINDS else line for line in lines
    ]


def assert_replay_reproduces(entry: dict[str, Any], out: Path) -> None:
    """`pipemetrics replay` of the failure file judges as the runner did, and exits 1."""
    scenario_file = shlex.split(entry["replay"])[2]
    assert replay_main(scenario_file, impl=None, raw=False, json_out=str(out)) == 1, entry["id"]
    replayed = json.loads(out.read_text())
    assert replayed["property"] == entry["id"]
    runner = [line for line in entry["message"].splitlines() if not line.startswith(RUNNER_NOTES)]
    assert outcome_of(replayed["problems"][: len(runner)]) == outcome_of(runner), entry["id"]


def test_every_mutant_fails_properties_of_its_profile() -> None:
    for mutant in MUTANTS.values():
        for property_id in mutant.fails:
            assert mutant.profile in BY_ID[property_id].profiles, (mutant.name, property_id)


def test_budgets_and_profiles_name_mutants() -> None:
    """Budgets below MAX_EXAMPLES only where a class run pays for every example."""
    assert set(EXAMPLES) <= set(MUTANTS)
    assert all(MUTANTS[name].caught_by_classes for name, n in EXAMPLES.items() if n < MAX_EXAMPLES)
    assert set(HYPOTHESIS_PROFILES) <= set(MUTANTS)
    assert set(HYPOTHESIS_PROFILES.values()) <= set(EFFORTS)


def test_every_property_has_a_mutant() -> None:
    """Every property of the catalogue can fail: some mutant names it in ``fails``."""
    uncovered = without_mutant(CATALOGUE_IDS, MUTANTS.values())
    assert not uncovered, f"no mutant fails these properties: {uncovered}"
