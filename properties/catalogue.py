"""The property catalogue. Property IDs are a public contract: never rename or reuse one.

Each `Property` names the seed API function it tests, a strategy of scenarios (given the
Hypothesis profile and the semantic profile) and a judge that turns the run into problems.
Semantic profiles: ``seed`` (the documented contract: means over the tracker's entries, i.e.
``D = num_layers + mtp_num_layers``) and ``megatron`` (Megatron's ``report()``: means over the
number of MoE layers, passed as ``num_moe_layers``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from hypothesis import strategies as st

from pipemetrics.properties import judges as j
from pipemetrics.properties import strategies as s
from pipemetrics.properties.profiles import Profile
from pipemetrics.properties.strategies import Semantic
from pipemetrics.sim.scenario import Scenario

SEMANTIC_PROFILES: tuple[Semantic, ...] = ("seed", "megatron")

ScenarioStrategy = Callable[[Profile, Semantic], st.SearchStrategy[Scenario]]


@dataclass(frozen=True)
class Property:
    id: str
    function: str
    summary: str
    scenarios: ScenarioStrategy
    judge: j.Judge


def _moe(**kwargs: object) -> ScenarioStrategy:
    return lambda profile, semantic: s.moe_scenarios(profile, semantic, **kwargs)  # type: ignore[arg-type]


def _mtp(**kwargs: object) -> ScenarioStrategy:
    return lambda profile, semantic: s.mtp_scenarios(profile, **kwargs)  # type: ignore[arg-type]


MOE = "get_moe_metrics"
MTP = "get_mtp_metrics"
BROADCAST = "broadcast_tensor"

CATALOGUE: tuple[Property, ...] = (
    Property(
        "round_up.least_multiple",
        "_round_up_to_multiple",
        "the least multiple of `multiple` that is >= value, as an int",
        lambda p, _: s.round_up_scenarios(p),
        j.checked(j.round_up_least_multiple),
    ),
    Property(
        "broadcast.roundtrip",
        BROADCAST,
        "every rank gets the source tensor (dtype, shape, values), receivers passing None or a "
        "buffer",
        lambda p, _: s.broadcast_scenarios(p, "mixed"),
        j.checked(j.broadcast_roundtrip),
    ),
    Property(
        "broadcast.receiver_buffer",
        BROADCAST,
        "a receiver's valid buffer is filled and returned",
        lambda p, _: s.broadcast_scenarios(p, "buffers"),
        j.checked(j.broadcast_receiver_buffer),
    ),
    Property(
        "broadcast.errors_everywhere",
        BROADCAST,
        "an invalid input on any rank raises ValueError on every rank; no rank hangs",
        lambda p, _: s.broadcast_scenarios(p, "invalid"),
        j.broadcast_errors_everywhere,
    ),
    Property(
        "track_names.router_parity",
        "get_aux_loss_track_names",
        "the names megatron-core's TopKRouter records for the config, in recording order",
        lambda p, _: s.track_names_scenarios(p),
        j.checked(j.track_names_parity),
    ),
    Property(
        "moe.no_hang",
        MOE,
        "every rank returns: no hang, crash, mismatched collective or exception",
        _moe(),
        j.checked(j.no_problems),
    ),
    Property(
        "moe.values", MOE, "per-name means equal the oracle's", _moe(), j.checked(j.moe_values)
    ),
    Property(
        "moe.rank_agreement",
        MOE,
        "every rank returns the same dict",
        _moe(),
        j.checked(j.moe_rank_agreement),
    ),
    Property(
        "moe.names",
        MOE,
        "the per-name keys are exactly the live names",
        _moe(),
        j.checked(j.moe_names),
    ),
    Property(
        "moe.per_layer",
        MOE,
        "per_layer_logging adds moe/{name}_layer_{i} = loss_scale * v[i] and nothing else",
        _moe(per_layer=True),
        j.checked(j.moe_per_layer),
    ),
    Property(
        "moe.loss_scale",
        MOE,
        "means and per-layer values are scaled by loss_scale exactly once",
        _moe(per_layer=True, scale_one=False),
        j.checked(j.moe_loss_scale),
    ),
    Property(
        "moe.total_loss_dict",
        MOE,
        "total_loss_dict accumulates the per-name means of every step",
        _moe(min_steps=1, max_steps=3, total_loss_dict=True),
        j.checked(j.moe_total_loss_dict),
    ),
    Property(
        "moe.reset",
        MOE,
        "a step's result does not depend on earlier steps (the tracker is cleared)",
        _moe(min_steps=2, max_steps=3, per_layer=True),
        j.checked(j.moe_reset),
    ),
    Property(
        "moe.router_mode",
        MOE,
        "values equal the oracle when megatron-core's real routers fill the tracker",
        lambda p, sem: s.router_scenarios(p, sem),
        j.checked(j.moe_all_values),
    ),
    Property(
        "mtp.no_hang",
        MTP,
        "every rank returns: no hang, crash, mismatched collective or exception",
        _mtp(),
        j.checked(j.no_problems),
    ),
    Property(
        "mtp.keys",
        MTP,
        "mtp_{i}_loss / mtp_{i}_acceptance_rate with i from 1 on MTP ranks, {} elsewhere "
        "(no rate with megatron-core 0.18: no counts)",
        _mtp(),
        j.checked(j.mtp_keys),
    ),
    Property(
        "mtp.loss_scale",
        MTP,
        "mtp_{i}_loss is the reduced loss scaled by loss_scale exactly once",
        _mtp(scale_one=False),
        j.checked(j.mtp_loss_scale),
    ),
    Property(
        "mtp.acceptance_rate",
        MTP,
        "100 * correct / max(total, 1), clamped to [0, 100], never scaled "
        "(vacuous with megatron-core 0.18: no counts)",
        _mtp(scale_one=False),
        j.checked(j.mtp_acceptance_rate),
    ),
    Property(
        "mtp.reset",
        MTP,
        "a step's result does not depend on earlier steps (the tracker is cleaned)",
        _mtp(min_steps=2, max_steps=3),
        j.checked(j.mtp_reset),
    ),
)

BY_ID: dict[str, Property] = {prop.id: prop for prop in CATALOGUE}
PROPERTY_IDS: tuple[str, ...] = tuple(BY_ID)
