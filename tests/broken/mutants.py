"""Deliberately broken copies of the reference implementation, generated on demand.

Each `Mutant` is the reference (``reference/megatron_common.py``) with exactly one bug, written
as a few exact text edits. The simulator's and the conformance suite's tests load a mutant as a
path target (``write_mutant(name, tmp_path)``) and check that the bug is caught with the right
diagnosis: the conformance property IDs in ``fails`` must fail, and in a suitable scenario the
simulator must end with ``sim_outcome`` (``None``: the world stays healthy, only values are
wrong).

The edits are applied to the reference text as it is now. A snippet that is not found exactly
once raises `MutantApplyError`, so a change to the reference breaks these fixtures loudly
instead of silently producing a copy without the bug.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, field_validator, model_validator

from pipemetrics.properties.catalogue import PROPERTY_IDS as CATALOGUE_IDS
from pipemetrics.properties.diagnosis import Cause
from pipemetrics.properties.effort import GENERATOR_CLASSES

REFERENCE_PATH = Path(__file__).resolve().parents[2] / "reference" / "megatron_common.py"

SEED_FUNCTIONS: frozenset[str] = frozenset(
    {
        "_round_up_to_multiple",
        "broadcast_tensor",
        "get_aux_loss_track_names",
        "get_moe_metrics",
        "get_mtp_metrics",
    }
)

#: Conformance property IDs the mutants may refer to: the catalogue's (the published ones are
#: held by tests/test_property_ids_doc.py).
PROPERTY_IDS: frozenset[str] = frozenset(CATALOGUE_IDS)

SimOutcome = Literal["deadlock", "mismatch", "crash"]


class MutantApplyError(ValueError):
    """A mutant's edit does not apply to the current reference."""


class Mutant(BaseModel):
    """One bug, as exact ``(snippet, replacement)`` edits of the reference source."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    """Identifier; also the file stem `write_mutant` uses."""
    description: str
    """The bug, and the scenario that exposes it."""
    edits: tuple[tuple[str, str], ...]
    """Applied in order; each snippet must occur exactly once in the text at that point."""
    fails: tuple[str, ...]
    """Conformance property IDs that must fail for this mutant."""
    functions: tuple[str, ...]
    """Seed functions whose code the edits change."""
    sim_outcome: SimOutcome | None
    """Simulator outcome kind in a suitable scenario; None: the world stays healthy."""
    profile: Literal["seed", "megatron", "strict"] = "seed"
    """The semantic profile under which ``fails`` must fail (``strict`` for a behaviour the API
    document leaves open and only the reference promises)."""
    cause: Cause | None = None
    """The cause the first diagnosis line of its failure must name (`diagnosis.PHRASES`)."""
    no_cause: str = ""
    """Why the mutant has no cause to name (not a value bug, or one outside the hypotheses)."""
    caught_by_classes: tuple[str, ...] = ()
    """The generator classes (`GENERATOR_CLASSES`) that expose this bug: the check must pass
    with ``--without-class`` each of them (the generators before those classes miss it) and fail
    without."""

    @field_validator("name")
    @classmethod
    def _identifier(cls, value: str) -> str:
        if not value.isidentifier():
            raise ValueError(f"mutant name must be an identifier, got {value!r}")
        return value

    @field_validator("edits")
    @classmethod
    def _non_trivial(cls, value: tuple[tuple[str, str], ...]) -> tuple[tuple[str, str], ...]:
        if not value:
            raise ValueError("a mutant needs at least one edit")
        for snippet, replacement in value:
            if not snippet or snippet == replacement:
                raise ValueError(f"edit of {snippet!r} changes nothing")
        return value

    @field_validator("fails")
    @classmethod
    def _known_properties(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        unknown = sorted(set(value) - PROPERTY_IDS)
        if unknown:
            raise ValueError(f"unknown conformance property IDs {unknown}")
        return value

    @model_validator(mode="after")
    def _cause_or_why_not(self) -> Mutant:
        if (self.cause is None) == (not self.no_cause):
            raise ValueError(f"{self.name}: give exactly one of cause and no_cause")
        return self

    @field_validator("caught_by_classes")
    @classmethod
    def _known_classes(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        unknown = sorted(set(value) - set(GENERATOR_CLASSES))
        if unknown:
            raise ValueError(f"unknown generator classes {unknown}")
        return value

    @field_validator("functions")
    @classmethod
    def _seed_functions(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        unknown = sorted(set(value) - SEED_FUNCTIONS)
        if not value or unknown:
            raise ValueError(f"functions must be non-empty seed functions, got {list(value)}")
        return value


NAMES_EDITS: tuple[tuple[str, str], ...] = (
    (
        "    names: list[str] = []\n"
        '    if _is_number(_attr(model_config, "moe_z_loss_coeff")):\n'
        "        names.append(_Z_LOSS_NAME)\n",
        "    names: list[str] = []\n",
    ),
    (
        "            names.append(name)\n    return names\n",
        "            names.append(name)\n"
        '    if _is_number(_attr(model_config, "moe_z_loss_coeff")):\n'
        "        names.append(_Z_LOSS_NAME)  # the aux losses first\n"
        "    return names\n",
    ),
)
"""get_aux_loss_track_names with the aux losses before z_loss (NeMo-RL's order)."""

_MUTANTS: list[Mutant] = [
    Mutant(
        name="mtp_clears_moe_tracker",
        description=(
            "get_mtp_metrics also clears the MoE aux-loss tracker after logging ('a new step "
            "starts: reset every loss tracker'). Harmless while get_moe_metrics is called "
            "first in every step; when a step calls get_mtp_metrics first, the MTP stage's "
            "MoE losses are gone before get_moe_metrics reduces them. Scenario: one step, "
            "get_mtp_metrics then get_moe_metrics, MoE layers on the last stage."
        ),
        edits=(
            (
                "    _clean_mtp(tracker, layout, own_layout)\n",
                "    get_moe_metrics_tracker().clear()  # a new step starts: reset every tracker\n"
                "    _clean_mtp(tracker, layout, own_layout)\n",
            ),
        ),
        fails=("steps.interleaved",),
        functions=("get_mtp_metrics",),
        sim_outcome=None,
        no_cause="a value bug across calls: tracker state kept or lost between calls, which the property reports in its own words",
        caught_by_classes=("multi_step",),
    ),
    Mutant(
        name="moe_plan_cached_after_first_call",
        description=(
            "get_moe_metrics skips the metadata round after its first call and reuses the "
            "first plan (the 'steady state' shortcut, with no check that the tracker's names "
            "are unchanged). Harmless while every step records the "
            "same names; when the first call follows a forward-only step (nothing recorded, "
            "e.g. an evaluation pass) and the names appear from the second step on, they are "
            "dropped from every later result. Scenario: two steps, the first records nothing, "
            "track_names=None. moe.total_loss_dict fails in the same scenario (not listed: one "
            "search is enough, moe_total_loss_overwritten proves that property, and its search "
            "for this mutant is the longer one: 443 examples under megatron-core 0.14.0)."
        ),
        edits=(("        and kept.local == _steady_key(payload)\n", ""),),
        fails=("moe.reset",),
        functions=("get_moe_metrics",),
        sim_outcome=None,
        no_cause="a value bug across calls: tracker state kept or lost between calls, which the property reports in its own words",
        caught_by_classes=("multi_step",),
    ),
    Mutant(
        name="moe_steady_state_decided_locally",
        description=(
            "get_moe_metrics decides on its own whether its tracker changed since the last "
            "metadata round, without the agreement all_reduce: the rank whose stage records a "
            "new name enters the metadata round (all_gather_object) while its peers go "
            "straight to the pipeline all_reduce. Scenario: pp=2, a forward-only first step "
            "(nothing recorded), then a training step in which only the MoE stage records, "
            "track_names=None. Strict profile: the API document prescribes the pre-initialising "
            "call on layouts with a stage that records nothing, and with it every rank's "
            "tracker changes in the same steps."
        ),
        edits=(("    dist.all_reduce(agreed, op=dist.ReduceOp.MAX)\n", ""),),
        fails=("moe.reset",),
        functions=("get_moe_metrics",),
        sim_outcome="deadlock",
        no_cause="not a value bug: a hang, crash or mismatched collective",
        profile="strict",
        caught_by_classes=("multi_step",),
    ),
    Mutant(
        name="moe_dp_avg_over_expert_data_group",
        description=(
            "get_moe_metrics hands Megatron's reduction a ProcessGroupCollection whose "
            "data-parallel group (what _sync_metrics averages over: dp on 0.18, dp_cp_gtp_remat on 0.19) is the "
            "expert data-parallel group ('the data-parallel replicas of the experts'). Without "
            "expert parallelism that group spans the stage's data x context ranks, and the "
            "average comes out the same (context-parallel peers already agree after the "
            "reduce-group sum); with ep = 2 it holds fewer ranks than the data-parallel group, "
            "so the data-parallel ranks report their own values. Scenario: dp=2, ep=2, "
            "load_balancing_loss differing between the data-parallel ranks."
        ),
        edits=(
            (
                "        _sync(tracker, sorted(lengths))\n",
                "        from megatron.core.process_groups_config import ProcessGroupCollection\n"
                "\n"
                "        groups = ProcessGroupCollection(pp=parallel_state.get_pipeline_model_parallel_group())\n"
                "        expert_dp = parallel_state.get_expert_data_parallel_group()\n"
                "        groups.dp = expert_dp  # what 0.18's _sync_metrics averages over\n"
                "        groups.dp_cp_gtp_remat = expert_dp  # 0.19's\n"
                "        tracker._sync_metrics(sorted(lengths), groups)\n",
            ),
        ),
        fails=("moe.values",),
        functions=("get_moe_metrics",),
        sim_outcome=None,
        cause="reduction_missing",
        caught_by_classes=("wide_world",),
    ),
    Mutant(
        name="moe_mtp_slots_only_on_last_stage",
        description=(
            "get_moe_metrics zeroes the MTP layers' tracker slots on every stage but the last "
            "before the reduction ('the MTP layers live on the last stage; drop stale values'). "
            "Harmless while they do; with a flexible layout that places the MTP layers "
            "standalone on an earlier stage (Megatron's mtp_standalone, e.g. 'Et|tm|L'), the "
            "MoE losses of the MTP layers' routers are lost (a virtual pipeline can place them "
            "so too: the last chunk of an earlier rank). Scenario: pp=3, MoE MTP layer on "
            "stage 1, a live aux loss."
        ),
        edits=(
            (
                "        _sync(tracker, sorted(lengths))\n",
                "        if mtp_num_layers and not parallel_state.is_pipeline_last_stage():\n"
                "            for name in lengths:  # the MTP layers live on the last stage\n"
                "                tracker.metrics[name].values[-mtp_num_layers:] = 0\n"
                "        _sync(tracker, sorted(lengths))\n",
            ),
        ),
        fails=("moe.values",),
        functions=("get_moe_metrics",),
        sim_outcome=None,
        no_cause="a value bug outside the hypothesis set (the MTP layers' slots zeroed on some stages)",
        caught_by_classes=("flexible_layout", "virtual_pipeline"),
    ),
    Mutant(
        name="mtp_gated_on_virtual_last_stage",
        description=(
            "get_mtp_metrics returns {} unless parallel_state.is_pipeline_last_stage("
            "ignore_virtual=False, vp_stage=get_virtual_pipeline_model_parallel_rank()) (code "
            "from releases whose default was ignore_virtual=False). Right without a virtual "
            "pipeline; with one, initialize_model_parallel leaves the virtual rank at 0 and "
            "megatron-core 0.19's schedules never move it, so the last stage is never the "
            "'virtual last stage' and the MTP metrics vanish. Scenario: pp=2, vpp=2, MTP."
        ),
        edits=(
            (
                "    tracker = MTPLossLoggingHelper.tracker\n",
                "    if parallel_state.model_parallel_is_initialized() and not (\n"
                "        parallel_state.is_pipeline_last_stage(\n"
                "            ignore_virtual=False,\n"
                "            vp_stage=parallel_state.get_virtual_pipeline_model_parallel_rank(),\n"
                "        )\n"
                "    ):  # only the last pipeline stage computes the MTP loss\n"
                "        return {}\n"
                "    tracker = MTPLossLoggingHelper.tracker\n",
            ),
        ),
        fails=("mtp.keys",),
        functions=("get_mtp_metrics",),
        sim_outcome=None,
        no_cause="not a value bug: keys missing, extra or misnamed",
        caught_by_classes=("virtual_pipeline",),
    ),
    Mutant(
        name="moe_empty_stage_returns_early",
        description=(
            "get_moe_metrics returns {} right after the metadata round on a rank that recorded "
            "nothing (the classic 'stage without MoE skips the collectives'), so the stages that "
            "did record block in the pipeline all_reduce of _sync_metrics. Scenario: pp=2, "
            "stage 0 dense, stage 1 records load_balancing_loss."
        ),
        edits=(
            (
                "    assert scale is not None  # checked by _validate_args on every rank\n",
                "    assert scale is not None  # checked by _validate_args on every rank\n"
                "    if not local:  # this stage recorded nothing: nothing to report\n"
                "        return {}\n",
            ),
        ),
        fails=("moe.no_hang",),
        functions=("get_moe_metrics",),
        sim_outcome="deadlock",
        no_cause="not a value bug: a hang, crash or mismatched collective",
    ),
    Mutant(
        name="moe_preinit_without_mtp",
        description=(
            "Pre-initialises missing entries with num_layers instead of num_layers + "
            "mtp_num_layers and does not pad entries to the agreed length: a stage that "
            "recorded nothing all_reduces float32[num_layers] over the pipeline group while the "
            "recording stage (router length num_layers + mtp) sends float32[num_layers + mtp]. "
            "Scenario: pp=2, mtp_num_layers=1, stage 0 dense, stage 1 MoE, track_names given."
        ),
        edits=(
            (
                "num_layers + (mtp_num_layers or 0) if num_layers is not None and names else 0",
                "num_layers if num_layers is not None and names else 0",
            ),
            (
                "_align_entries(tracker, local, lengths, settings,",
                "_align_entries(tracker, local, {n: num_layers or k for n, k in lengths.items()}, "
                "settings,",
            ),
            (
                "        entry = tracker.metrics[name]\n"
                "        short = lengths[name] - entry.values.numel()\n"
                "        if short > 0:\n"
                "            entry.values = torch.cat([entry.values, entry.values.new_zeros(short)])\n",
                "",
            ),
        ),
        fails=("moe.no_hang",),
        functions=("get_moe_metrics",),
        sim_outcome="mismatch",
        no_cause="not a value bug: a hang, crash or mismatched collective",
    ),
    Mutant(
        name="moe_local_insertion_order",
        description=(
            "Reduces the names in the tracker's local insertion order instead of the agreed "
            "sorted order. A recording stage holds the router's order (z_loss before "
            "load_balancing_loss; load_balancing before global_load_balancing) while a stage "
            "that pre-initialised holds sorted order, so the i-th pipeline all_reduce pairs "
            "different names. Every pipeline collective is a SUM of float32[agreed length], and "
            "the other groups lie within a stage, so nothing hangs or mismatches: the stages "
            "silently swap values (a stage reports z_loss as load_balancing_loss and vice "
            "versa). Scenario: pp=2, stage 0 dense, stage 1 records z_loss and "
            "load_balancing_loss, track_names from the config. (Only when ranks of one stage "
            "disagree on the order do they block on different groups: a deadlock.)"
        ),
        edits=(
            (
                "        _sync(tracker, sorted(lengths))\n",
                "        _sync(tracker, [name for name in tracker.metrics if name in lengths])\n",
            ),
        ),
        fails=("moe.values",),
        functions=("get_moe_metrics",),
        sim_outcome=None,
        cause="paired_out_of_order",
    ),
    Mutant(
        name="moe_raises_on_rank0",
        description=(
            "get_moe_metrics raises RuntimeError on global rank 0 only, before the metadata "
            "round; every other rank blocks in all_gather_object. Scenario: any distributed "
            "get_moe_metrics call with at least 2 ranks."
        ),
        edits=(
            (
                "    distributed = dist.is_available() and dist.is_initialized()\n"
                "    if distributed and error is None",
                "    distributed = dist.is_available() and dist.is_initialized()\n"
                "    if distributed and dist.get_rank() == 0:\n"
                '        raise RuntimeError("get_moe_metrics: logging rank 0 failed")\n'
                "    if distributed and error is None",
            ),
        ),
        fails=("moe.no_hang",),
        functions=("get_moe_metrics",),
        sim_outcome="deadlock",
        no_cause="not a value bug: a hang, crash or mismatched collective",
    ),
    Mutant(
        name="moe_mean_over_num_layers",
        description=(
            "The mean divides by num_layers (the MTP slot forgotten) instead of len(v) = "
            "num_layers + mtp_num_layers, when num_moe_layers is not given. Identical on every "
            "rank, so nothing hangs. Scenario: num_layers given and mtp_num_layers >= 1."
        ),
        edits=(
            (
                "mean = scaled.sum() / (num_moe_layers or scaled.numel())",
                "mean = scaled.sum() / (num_moe_layers or num_layers or scaled.numel())",
            ),
        ),
        fails=("moe.values",),
        functions=("get_moe_metrics",),
        sim_outcome=None,
        cause="mean_denominator",
    ),
    Mutant(
        name="mtp_zero_based_keys",
        description="MTP keys are 0-based (mtp_0_loss, mtp_0_acceptance_rate, ...).",
        edits=(
            ('result[f"mtp_{i + 1}_loss"]', 'result[f"mtp_{i}_loss"]'),
            ('result[f"mtp_{i + 1}_acceptance_rate"]', 'result[f"mtp_{i}_acceptance_rate"]'),
        ),
        fails=("mtp.keys",),
        functions=("get_mtp_metrics",),
        sim_outcome=None,
        no_cause="not a value bug: keys missing, extra or misnamed",
    ),
    Mutant(
        name="mtp_acceptance_scaled",
        description=(
            "The acceptance rate is multiplied by loss_scale (it is a ratio of counts and must "
            "never be scaled). Scenario: loss_scale != 1 (e.g. 1/num_microbatches) and some "
            "correct > 0. May also fail mtp.loss_scale if that property checks the rate."
        ),
        edits=(
            (
                "rate = 100.0 * float(corrects[i])",
                "rate = 100.0 * loss_scale * float(corrects[i])",
            ),
        ),
        fails=("mtp.acceptance_rate",),
        functions=("get_mtp_metrics",),
        sim_outcome=None,
        cause="loss_scale_on_rate",
    ),
    Mutant(
        name="mtp_acceptance_unclamped_total",
        description=(
            "The acceptance rate divides by total without the max(total, 1) clamp (tensor "
            "division): total 0 gives nan (0/0, not removed by the [0, 100] clamp) or inf "
            "(clamped to 100). Scenario: an MTP layer with total 0, e.g. a step in which "
            "nothing was counted or the tracker after a clean."
        ),
        edits=(
            (
                "rate = 100.0 * float(corrects[i]) / max(float(totals[i]), 1.0)",
                "rate = 100.0 * float(corrects[i] / totals[i])",
            ),
        ),
        fails=("mtp.acceptance_rate",),
        functions=("get_mtp_metrics",),
        sim_outcome=None,
        no_cause="a value bug outside the hypothesis set (an unclamped denominator: NaN where the rate is 0)",
    ),
    Mutant(
        name="mtp_empty_layer_rate_hundred",
        description=(
            "A layer whose positions were all masked (0 tokens: nothing predicted, so nothing "
            "predicted wrong) reports an acceptance rate of 100 instead of Megatron's clamped "
            "100 * 0 / max(0, 1) = 0. Scenario: an MTP layer with 0 tokens on every rank of its "
            "group in a step (the masked layers of the mtp.acceptance_rate generator, prove's "
            "counts family)."
        ),
        edits=(
            (
                "rate = 100.0 * float(corrects[i]) / max(float(totals[i]), 1.0)",
                "rate = 100.0 * float(corrects[i]) / float(totals[i]) if float(totals[i]) "
                "else 100.0",
            ),
        ),
        fails=("mtp.acceptance_rate",),
        functions=("get_mtp_metrics",),
        sim_outcome=None,
        no_cause="a value bug outside the hypothesis set (a rate of 100 for a layer without tokens)",
    ),
    Mutant(
        name="moe_tracker_not_cleared",
        description=(
            "get_moe_metrics does not clear the tracker afterwards, so the next step reports "
            "the sum of both steps (and a total_loss_dict accumulates stale values: likely "
            "moe.total_loss_dict too). Scenario: two steps."
        ),
        edits=(("    tracker.clear()\n    return result\n", "    return result\n"),),
        fails=("moe.reset",),
        functions=("get_moe_metrics",),
        sim_outcome=None,
        no_cause="a value bug across calls: tracker state kept or lost between calls, which the property reports in its own words",
    ),
    Mutant(
        name="track_names_always_z_loss",
        description=(
            "get_aux_loss_track_names always lists z_loss, also when moe_z_loss_coeff is None "
            "(the router then never records it), so a caller pre-initialises and reports a "
            "permanently-zero z_loss. Scenario: a config without z-loss. Every profile: the "
            'document leaves open whether z_loss is an "aux loss" name, but the names are '
            '"the aux-loss tracker names the router records", and it records no z_loss here.'
        ),
        edits=(
            (
                "    names: list[str] = []\n"
                '    if _is_number(_attr(model_config, "moe_z_loss_coeff")):\n'
                "        names.append(_Z_LOSS_NAME)\n",
                "    names: list[str] = [_Z_LOSS_NAME]  # the router always computes it\n",
            ),
        ),
        fails=("track_names.router_parity",),
        functions=("get_aux_loss_track_names",),
        sim_outcome=None,
        no_cause="not a value bug: get_aux_loss_track_names returns a wrong list of names",
    ),
    Mutant(
        name="moe_always_reports_z_loss",
        description=(
            "get_moe_metrics always returns a z_loss key (0.0 when nobody recorded or "
            "requested it). Scenario: z-loss disabled."
        ),
        edits=(
            (
                "    result.update(per_layer)\n",
                "    result.setdefault(_Z_LOSS_NAME, 0.0)\n    result.update(per_layer)\n",
            ),
        ),
        fails=("moe.names",),
        functions=("get_moe_metrics",),
        sim_outcome=None,
        no_cause="not a value bug: keys missing, extra or misnamed",
    ),
    Mutant(
        name="broadcast_local_buffer_check",
        description=(
            "broadcast_tensor validates only the calling rank's own buffer after the metadata "
            "round: a receiver with a bad buffer (wrong shape/dtype/device, or not a Tensor) "
            "raises ValueError alone while the source and the other receivers enter the data "
            "broadcast and block. Scenario: 3 ranks, one receiver passes a wrong-shaped buffer. "
            "Strict profile: the API document only asks the faulty rank to raise."
        ),
        edits=(
            (
                "    for rank, d in zip(ranks, gathered, strict=True):\n",
                "    me = dist.get_rank()\n"
                "    for rank, d in ((me, gathered[ranks.index(me)]),):  # its own buffer only\n",
            ),
        ),
        fails=("broadcast.errors_everywhere",),
        functions=("broadcast_tensor",),
        sim_outcome="deadlock",
        no_cause="not a value bug: a hang, crash or mismatched collective",
        profile="strict",
    ),
    Mutant(
        name="moe_loss_scale_twice",
        description=(
            "The MoE mean is multiplied by loss_scale a second time (per-layer values are "
            "scaled once, correctly). Scenario: loss_scale != 1."
        ),
        edits=(
            (
                "mean = scaled.sum() / (num_moe_layers or scaled.numel())",
                "mean = scaled.sum() * loss_scale / (num_moe_layers or scaled.numel())",
            ),
        ),
        fails=("moe.loss_scale",),
        functions=("get_moe_metrics",),
        sim_outcome=None,
        cause="loss_scale_twice",
    ),
    Mutant(
        name="moe_per_layer_one_based",
        description=(
            "Per-layer keys are 1-based (moe/{name}_layer_1 for the first layer). Scenario: "
            "per_layer_logging=True."
        ),
        edits=(('per_layer[f"moe/{name}_layer_{i}"]', 'per_layer[f"moe/{name}_layer_{i + 1}"]'),),
        fails=("moe.per_layer",),
        functions=("get_moe_metrics",),
        sim_outcome=None,
        no_cause="not a value bug: keys missing, extra or misnamed",
    ),
    Mutant(
        name="mtp_loss_unscaled",
        description=(
            "The MTP loss ignores loss_scale (the NeMo-RL 'MTP loss off by the number of "
            "microbatches' bug). Scenario: loss_scale != 1."
        ),
        edits=(
            (
                "losses = tracker[loss_key].float() * (0.0 if scale is None else scale)\n",
                "losses = tracker[loss_key].float()\n",
            ),
        ),
        fails=("mtp.loss_scale",),
        functions=("get_mtp_metrics",),
        sim_outcome=None,
        cause="loss_scale_missing",
    ),
    Mutant(
        name="round_up_off_by_one",
        description=(
            "_round_up_to_multiple adds a whole multiple before flooring ((value + multiple) "
            "// multiple * multiple, the '- 1' forgotten), so a value that already is a "
            "multiple is rounded up to the next one: 8 -> 12 for multiple 4, 0 -> multiple, "
            "and every value -> value + 1 for multiple 1. Scenario: any call with value % "
            "multiple == 0."
        ),
        edits=(
            (
                "    return -(-value // multiple) * multiple\n",
                "    return (value + multiple) // multiple * multiple\n",
            ),
        ),
        fails=("round_up.least_multiple",),
        functions=("_round_up_to_multiple",),
        sim_outcome=None,
        no_cause="not a metric value: _round_up_to_multiple's integer result",
    ),
    Mutant(
        name="broadcast_none_receiver_default_dtype",
        description=(
            "A receiver that passes None allocates its receive tensor without the source's dtype "
            "(torch.empty(shape, device=device): float32), so for any other source dtype the "
            "receiver enters the broadcast with float32 while the source sends its own dtype "
            "(garbage or an abort with real gloo/NCCL). Scenario: 2 ranks, source dtype int64, "
            "the receiver passes None."
        ),
        edits=(
            (
                "        out = torch.empty(shape, dtype=_dtype_from_str(dtype_name), device=device)\n",
                "        out = torch.empty(shape, device=device)\n",
            ),
        ),
        fails=("broadcast.roundtrip",),
        functions=("broadcast_tensor",),
        sim_outcome="mismatch",
        no_cause="not a value bug: a hang, crash or mismatched collective",
    ),
    Mutant(
        name="broadcast_receiver_fresh_tensor",
        description=(
            "A receiver that passes a valid buffer receives into a fresh contiguous tensor and "
            "returns that, leaving the caller's buffer untouched (the copy back forgotten). "
            "Values, dtype and shape of the returned tensor are right; the buffer is not. "
            "Scenario: 2 ranks, the receiver passes a float32[3] buffer."
        ),
        edits=(
            (
                "    recv = tensor if tensor.is_contiguous() else "
                "torch.empty_like(tensor).contiguous()\n"
                "    with torch.no_grad():\n"
                "        dist.broadcast(recv, src=src_rank, group=group)\n"
                "        if recv is not tensor:\n"
                "            tensor.copy_(recv)\n"
                "    return tensor\n",
                "    recv = torch.empty_like(tensor).contiguous()  # a contiguous tensor to receive into\n"
                "    with torch.no_grad():\n"
                "        dist.broadcast(recv, src=src_rank, group=group)\n"
                "    return recv\n",
            ),
        ),
        fails=("broadcast.receiver_buffer",),
        functions=("broadcast_tensor",),
        sim_outcome=None,
        no_cause="not a metric value: a broadcast tensor returned in a new buffer",
    ),
    Mutant(
        name="broadcast_global_src_as_group_src",
        description=(
            "broadcast_tensor passes the GLOBAL src_rank as torch's group_src (the root's rank "
            "within the group: torch >= 2.6 takes either src, global, or group_src), as a port "
            "to the group-relative root easily does. Over a group that spans the world the two "
            "coincide, so broadcasts over world-spanning groups pass. Over a subgroup they "
            "differ: new_group [1, 2, 3] with source 2 roots the broadcast at group rank 2, "
            "global rank 3, a receiver, so the receivers get rank 3's uninitialised tensor "
            "(wrong values, the world stays healthy); each pipeline group [c, c + 2] of pp=2 x "
            "dp=2 broadcasting from its last stage (global 2 or 3) passes a group rank out of "
            "range and every member raises inside the broadcast. Scenario: 4 ranks, a "
            "new_group over ranks 1-3, source 2."
        ),
        edits=(
            (
                "        dist.broadcast(send, src=src_rank, group=group)\n",
                "        dist.broadcast(send, group_src=src_rank, group=group)\n",
            ),
            (
                "        dist.broadcast(out, src=src_rank, group=group)\n",
                "        dist.broadcast(out, group_src=src_rank, group=group)\n",
            ),
            (
                "        dist.broadcast(recv, src=src_rank, group=group)\n",
                "        dist.broadcast(recv, group_src=src_rank, group=group)\n",
            ),
        ),
        fails=("broadcast.roundtrip", "broadcast.receiver_buffer"),
        functions=("broadcast_tensor",),
        sim_outcome=None,
        no_cause="not a metric value: a broadcast tensor from the wrong source",
        caught_by_classes=("group_broadcast",),
    ),
    Mutant(
        name="broadcast_dtype_type_error",
        description=(
            "A receiver buffer with the wrong dtype is reported as TypeError instead of the "
            "documented ValueError (raised on every rank, after the metadata round, so nothing "
            "hangs). Wrong shape or device, and a source passing None, still raise ValueError. "
            "Scenario: 2 ranks, source float32, the receiver passes an int64 buffer of the "
            "right shape."
        ),
        edits=(
            (
                "            if d[2] != dtype_name:\n"
                '                wrong.append(f"dtype {d[2]} (source {dtype_name})")\n',
                "            if d[2] != dtype_name:\n"
                "                raise TypeError(\n"
                '                    f"broadcast_tensor: rank {rank} buffer has dtype {d[2]} "\n'
                '                    f"(source {dtype_name})"\n'
                "                )\n",
            ),
        ),
        fails=("broadcast.value_error",),
        functions=("broadcast_tensor",),
        sim_outcome=None,
        no_cause="not a value bug: an exception (or a missing one) on every rank",
    ),
    Mutant(
        name="moe_placeholder_skips_dp_avg",
        description=(
            "A name this rank did not record (a dense pipeline stage's pre-initialised zeros) is "
            "created with needs_dp_avg=False ('zeros need no data-parallel average', to save a "
            "collective). The pipeline SUM runs first and fills it with the recording stage's "
            "values, so such a rank reports its own data-parallel replica's sum instead of the "
            "DP mean: the dense stage disagrees with the MoE stage (and with the oracle). No "
            "hang: a data-parallel group lies within one stage, whose ranks all skip. Scenario: "
            "pp=2 x dp=2, stage 0 dense, stage 1 records load_balancing_loss with values that "
            "differ between its two data-parallel ranks. moe.values fails in the same scenario "
            "(not listed: one search is enough, and this layout is rare in the dev profile)."
        ),
        edits=(
            (
                "            entry.needs_dp_avg = meta.needs_dp_avg\n",
                "            entry.needs_dp_avg = False  # a placeholder: nothing to average\n",
            ),
        ),
        fails=("moe.rank_agreement",),
        functions=("get_moe_metrics",),
        sim_outcome=None,
        no_cause="judged by rank agreement (ranks compared with each other), not against the oracle's values",
    ),
    Mutant(
        name="moe_total_loss_overwritten",
        description=(
            "total_loss_dict[name] is overwritten with this step's mean instead of accumulated "
            "(d[name] = mean, not d[name] + mean), so after several steps it holds the last "
            "step only. Scenario: two steps with non-zero means and one total_loss_dict."
        ),
        edits=(
            (
                "            total_loss_dict[name] = mean if prev is None else prev + mean\n",
                "            total_loss_dict[name] = mean\n",
            ),
        ),
        fails=("moe.total_loss_dict",),
        functions=("get_moe_metrics",),
        sim_outcome=None,
        no_cause="a value bug across calls: tracker state kept or lost between calls, which the property reports in its own words (total_loss_dict overwritten instead of accumulated)",
    ),
    Mutant(
        name="moe_nan_mean_zeroed",
        description=(
            "A non-finite mean is reported as 0.0 ('keep NaN out of the logger'). That hides "
            "exactly what the metric must show: megatron-core's router records z_loss / coeff, "
            "NaN when moe_z_loss_coeff is 0.0 (and a diverging router's z_loss). Per-layer "
            "values stay NaN. Synthetic records are finite, so only megatron's real routers "
            "expose it. Scenario: router mode with moe_z_loss_coeff=0.0."
        ),
        edits=(
            (
                "        result[name] = float(mean)\n",
                "        result[name] = float(mean) if torch.isfinite(mean) else 0.0\n",
            ),
        ),
        fails=("moe.router_mode",),
        functions=("get_moe_metrics",),
        sim_outcome=None,
        no_cause="a value bug outside the hypothesis set (a NaN mean replaced by 0)",
    ),
    Mutant(
        name="mtp_reduce_on_logging_rank_only",
        description=(
            "Only the logging rank (the last global rank) reduces the MTP tracker; the other "
            "holders skip the collectives and return their local values. The logging rank "
            "then blocks in the all_reduce over the data+context-parallel avg_group whose other "
            "members already returned. Scenario: dp=2 (the last stage has two data-parallel "
            "ranks), mtp_num_layers=1."
        ),
        edits=(
            (
                "    if distributed and own_layout:\n",
                "    logging_rank = distributed and dist.get_rank() == dist.get_world_size() - 1\n"
                "    if distributed and not logging_rank:  # only the rank that logs needs them\n"
                "        pass\n"
                "    elif distributed and own_layout:\n",
            ),
        ),
        fails=("mtp.no_hang",),
        functions=("get_mtp_metrics",),
        sim_outcome="deadlock",
        no_cause="not a value bug: a hang, crash or mismatched collective",
    ),
    Mutant(
        name="mtp_tracker_not_cleaned",
        description=(
            "get_mtp_metrics does not clean the MTP tracker afterwards (relying on Megatron's "
            "training loop, which the trainer does not run), so the next step's records are "
            "added to this step's reduced values and the next result mixes both steps. "
            "Scenario: two steps with non-zero MTP losses."
        ),
        edits=(
            (
                "    _clean_mtp(tracker, layout, own_layout)\n",
                "    # Megatron's training loop cleans the tracker after logging\n",
            ),
        ),
        fails=("mtp.reset",),
        functions=("get_mtp_metrics",),
        sim_outcome=None,
        no_cause="a value bug across calls: tracker state kept or lost between calls, which the property reports in its own words",
    ),
    Mutant(
        name="moe_loss_scale_tensor_rejected",
        description=(
            "get_moe_metrics accepts loss_scale only as a Python number (int or float, a numpy "
            "float64 included: it subclasses float) and raises ValueError on every rank for a "
            "0-d tensor or a numpy float32, what trainers pass (torch.tensor(1 / n)). Caught "
            "only by the generator class argument_forms, under strict (the reference's promise: "
            "the same results for every form)."
        ),
        edits=(
            (
                "    if _loss_scale_value(loss_scale) is None:\n",
                "    if not _is_number(loss_scale):\n",
            ),
        ),
        fails=("moe.no_hang",),
        functions=("get_moe_metrics",),
        sim_outcome=None,
        no_cause="not a value bug: an exception (or a missing one) on every rank",
        caught_by_classes=("argument_forms",),
        profile="strict",
    ),
    Mutant(
        name="moe_loss_scale_exact_float_type",
        description=(
            "get_moe_metrics checks loss_scale with an exact type test (type(x) in (int, float)) "
            "and raises ValueError on every rank for a numpy float64, which is a float (a "
            "subclass) as the document's 'loss_scale: float' allows. Caught only by the "
            "generator class argument_forms (seed: the numpy.float64 form)."
        ),
        edits=(
            (
                "    if _loss_scale_value(loss_scale) is None:\n",
                "    if type(loss_scale) not in (int, float):\n",
            ),
        ),
        fails=("moe.no_hang",),
        functions=("get_moe_metrics",),
        sim_outcome=None,
        no_cause="not a value bug: an exception (or a missing one) on every rank",
        caught_by_classes=("argument_forms",),
    ),
    Mutant(
        name="moe_loss_scale_negative_rejected",
        description=(
            "get_moe_metrics refuses a negative loss_scale (ValueError on every rank, from the "
            "argument check); the document does not forbid one, the result is then just "
            "scaled. Caught only by the generator class argument_forms (negative scales)."
        ),
        edits=(
            (
                "    if total_loss_dict is not None and not isinstance(total_loss_dict, dict):\n",
                "    if (_loss_scale_value(loss_scale) or 0.0) < 0:\n"
                '        return f"loss_scale must be non-negative, got {loss_scale!r}"\n'
                "    if total_loss_dict is not None and not isinstance(total_loss_dict, dict):\n",
            ),
        ),
        fails=("moe.no_hang",),
        functions=("get_moe_metrics",),
        sim_outcome=None,
        no_cause="not a value bug: an exception (or a missing one) on every rank",
        caught_by_classes=("argument_forms",),
    ),
    Mutant(
        name="mtp_loss_scale_required",
        description=(
            "get_mtp_metrics has no default for loss_scale, so get_mtp_metrics() (the "
            "document's default of 1.0) raises TypeError on every rank. Caught only by the "
            "generator class argument_forms (the 'default' form)."
        ),
        edits=(
            (
                "def get_mtp_metrics(loss_scale: float | torch.Tensor = 1.0) -> dict[str, Any]:",
                "def get_mtp_metrics(loss_scale: float | torch.Tensor) -> dict[str, Any]:",
            ),
        ),
        fails=("mtp.no_hang",),
        functions=("get_mtp_metrics",),
        sim_outcome=None,
        no_cause="not a value bug: an exception (or a missing one) on every rank",
        caught_by_classes=("argument_forms",),
    ),
    Mutant(
        name="mtp_nemo_rl_reads_loss_values_only",
        description=(
            "get_mtp_metrics is NeMo-RL's copy (nemo_rl.models.megatron.common, written for "
            "megatron-core 0.19): it reads tracker['loss_values'] and returns {} when the key "
            "is missing, reducing with the helper's reduce_metrics_in_tracker and cleaning with "
            "clean_metrics_in_tracker. megatron-core dev's training path "
            "(save_loss_to_tracker(loss_sum, num_tokens, ...)) writes loss_sums and packed "
            "acceptance_counts and no loss_values, so every rank returns {} silently: the MTP "
            "metrics go missing. Caught by mtp.keys on dev; 0.19-0.20 write loss_values (the "
            "copy reads them), 0.13-0.18 lack reduce_metrics_in_tracker."
        ),
        edits=(
            (
                "def get_mtp_metrics(loss_scale: float | torch.Tensor = 1.0) -> dict[str, Any]:\n",
                "def get_mtp_metrics(loss_scale: float = 1.0) -> dict[str, Any]:\n"
                '    """Returns Multi-Token Prediction (MTP) loss and acceptance rate metrics."""\n'
                "    tracker = MTPLossLoggingHelper.tracker\n"
                '    if "loss_values" not in tracker:\n'
                "        return {}\n"
                "    MTPLossLoggingHelper.reduce_metrics_in_tracker()\n"
                '    mtp_losses = tracker["loss_values"] * loss_scale\n'
                '    mtp_corrects = tracker.get("correct_values", torch.zeros_like(mtp_losses))\n'
                '    mtp_totals = tracker.get("total_values", torch.ones_like(mtp_losses))\n'
                "    metrics: dict[str, Any] = {}\n"
                "    for i in range(mtp_losses.shape[0]):\n"
                '        metrics[f"mtp_{i + 1}_loss"] = mtp_losses[i].item()\n'
                "        rate = mtp_corrects[i] / torch.clamp(mtp_totals[i], min=1) * 100.0\n"
                '        metrics[f"mtp_{i + 1}_acceptance_rate"] = rate.item()\n'
                "    MTPLossLoggingHelper.clean_metrics_in_tracker()\n"
                "    return metrics\n"
                "\n"
                "\n"
                "def _reference_get_mtp_metrics(\n"
                "    loss_scale: float | torch.Tensor = 1.0,\n"
                ") -> dict[str, Any]:\n",
            ),
        ),
        fails=("mtp.keys",),
        functions=("get_mtp_metrics",),
        sim_outcome=None,
        no_cause="not a value bug: keys missing, extra or misnamed",
    ),
    Mutant(
        name="moe_num_layers_none_crash",
        description=(
            "get_moe_metrics computes the pre-initialisation length num_layers + mtp_num_layers "
            "whenever track_names is non-empty, so num_layers=None with track_names (the "
            "document's default for num_layers) raises TypeError on every rank. Caught by the "
            "None forms the seed profile draws where every rank records every name."
        ),
        edits=(
            (
                "num_layers + (mtp_num_layers or 0) if num_layers is not None and names else 0",
                "num_layers + (mtp_num_layers or 0) if names else 0",
            ),
        ),
        fails=("moe.no_hang",),
        functions=("get_moe_metrics",),
        sim_outcome=None,
        no_cause="not a value bug: an exception (or a missing one) on every rank",
    ),
    Mutant(
        name="track_names_aux_before_z_loss",
        description=(
            "get_aux_loss_track_names lists the aux losses before z_loss (as NeMo-RL's copy "
            'appends z_loss last), while the router records z_loss first: not "in the order '
            "Megatron records them\". The reference's own reduction (in sorted order) is immune "
            "to the order, so only the names property sees it. Scenario: a config with "
            "moe_z_loss_coeff and an aux loss."
        ),
        edits=NAMES_EDITS,
        fails=("track_names.router_parity",),
        functions=("get_aux_loss_track_names",),
        sim_outcome=None,
        no_cause="not a value bug: names in another order than Megatron records them",
    ),
    Mutant(
        name="moe_wired_names_paired_by_position",
        description=(
            "The seed module's lineage as trainers ship it: get_aux_loss_track_names lists the "
            "aux losses before z_loss, get_moe_metrics pre-initialises the names in the order "
            "it is given and reduces the tracker in its insertion order (as megatron-core's "
            "reduce_aux_losses_tracker_across_ranks does). Wired as a trainer wires it "
            "(track_names=get_aux_loss_track_names(config)), a stage without MoE layers holds "
            "[load_balancing_loss, z_loss] while the MoE stages hold the router's [z_loss, "
            "load_balancing_loss]; the pipeline all_reduce pairs them by position, and the two "
            "come back exchanged. Called with the router's own names it is correct. Scenario: "
            "pp=2, stage 0 dense, stage 1 MoE with z-loss and an aux loss, the trainer-wired call."
        ),
        edits=(
            *NAMES_EDITS,
            (
                "    _align_entries(tracker, local, lengths, settings, dict(known), distributed)\n",
                "    _align_entries(\n"
                "        tracker, local, lengths, settings, dict(known), distributed, track_names\n"
                "    )\n",
            ),
            (
                '    distributed: bool,\n) -> None:\n    """Step 3 of `get_moe_metrics`',
                "    distributed: bool,\n    track_names: Any = None,\n) -> None:\n"
                '    """Step 3 of `get_moe_metrics`',
            ),
            (
                "    for name in sorted(lengths):\n        meta = settings[name]\n",
                "    given = [n for n in dict.fromkeys(track_names or []) if n in lengths]\n"
                "    for name in given + [n for n in sorted(lengths) if n not in given]:\n"
                "        meta = settings[name]\n",
            ),
            (
                "        _sync(tracker, sorted(lengths))\n",
                "        _sync(tracker, [name for name in tracker.metrics if name in lengths])\n",
            ),
        ),
        fails=("moe.values",),
        functions=("get_moe_metrics", "get_aux_loss_track_names"),
        sim_outcome=None,
        cause="paired_out_of_order",
    ),
    Mutant(
        name="broadcast_source_not_contiguous",
        description=(
            "broadcast_tensor sends the source tensor as it is, without .contiguous(): gloo "
            "sends a non-contiguous view's storage as it lies, so the receivers get scrambled "
            "values without an error (a transposed 3x2 source [[0,3],[1,4],[2,5]] arrives as "
            "[[0,1],[2,3],[4,5]]). Every profile: the document types the source torch.Tensor "
            "and excludes no layout. Scenario: 2 ranks, a transposed or strided source."
        ),
        edits=(
            (
                "        send = tensor.detach().to(device).contiguous()\n",
                "        send = tensor.detach().to(device)\n",
            ),
        ),
        fails=("broadcast.roundtrip",),
        functions=("broadcast_tensor",),
        sim_outcome=None,
        no_cause="not a value bug of a reduction: the broadcast delivers scrambled storage",
    ),
]

MUTANTS: dict[str, Mutant] = {m.name: m for m in _MUTANTS}
assert len(MUTANTS) == len(_MUTANTS), "duplicate mutant names"


def without_mutant(property_ids: Iterable[str], mutants: Iterable[Mutant]) -> list[str]:
    """The IDs of ``property_ids`` that no mutant of ``mutants`` fails, in their order."""
    failed = {p for mutant in mutants for p in mutant.fails}
    return [pid for pid in property_ids if pid not in failed]


def reference_source() -> str:
    return REFERENCE_PATH.read_text(encoding="utf-8")


def apply_edits(source: str, edits: tuple[tuple[str, str], ...], label: str) -> str:
    """Apply ``edits`` in order; each snippet must occur exactly once at that point."""
    for index, (snippet, replacement) in enumerate(edits):
        count = source.count(snippet)
        if count != 1:
            raise MutantApplyError(
                f"mutant {label!r}, edit {index}: the snippet occurs {count} times in "
                f"{REFERENCE_PATH} (expected exactly once); the reference changed, update "
                f"tests/broken/mutants.py. Snippet: {snippet!r}"
            )
        source = source.replace(snippet, replacement, 1)
    return source


def mutant_source(name: str) -> str:
    """The reference source with mutant ``name``'s edits applied."""
    try:
        mutant = MUTANTS[name]
    except KeyError:
        raise KeyError(f"unknown mutant {name!r}; known: {sorted(MUTANTS)}") from None
    return apply_edits(reference_source(), mutant.edits, name)


def write_mutant(name: str, directory: Path) -> Path:
    """Write ``<directory>/<name>.py`` (exactly `mutant_source`) and return its path."""
    source = mutant_source(name)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.py"
    path.write_text(source, encoding="utf-8")
    return path


def write_combined(names: tuple[str, ...], directory: Path) -> Path:
    """Write ``<directory>/<name>__<name>....py``: the reference with the edits of every mutant
    of ``names`` applied in turn (independent bugs at once, for a run that must report each)."""
    source = reference_source()
    for name in names:
        source = apply_edits(source, MUTANTS[name].edits, name)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{'__'.join(names)}.py"
    path.write_text(source, encoding="utf-8")
    return path
