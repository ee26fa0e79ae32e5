"""The judges of ``get_moe_metrics``: values, names, per-layer keys, loss_scale, agreement
between ranks, ``total_loss_dict``, and every value of a run the real routers filled.
"""

from __future__ import annotations

from typing import Any

from pipemetrics.properties.diagnosis import Expected
from pipemetrics.properties.judging import (
    every_key,
    expected_views,
    guarded,
    held_zero_names,
    is_mean,
    is_per_layer,
    keyed_per_rank,
    keyed_problems,
    per_rank,
    reported,
    scaled_problems,
    where,
)
from pipemetrics.properties.runview import CallView, HarnessFault, call_views, composed_disagreement
from pipemetrics.sim.model.calls import MoeCall
from pipemetrics.sim.model.scenario import Scenario
from pipemetrics.sim.results import oracle
from pipemetrics.sim.results.oracle import close
from pipemetrics.sim.results.summary import short
from pipemetrics.sim.worlds.world import WorldRun


@guarded
def moe_values(scenario: Scenario, run: WorldRun) -> list[str]:
    """Every per-name mean equals the oracle's (loss_scale * sum / D)."""

    def check(view: CallView, rank: int, exp: dict[str, float], act: Any) -> list[str]:
        if not isinstance(act, dict):
            return [f"returned {short(act)}, not a dict"]
        return keyed_problems(exp, {k: v for k, v in act.items() if k in exp}, is_mean, "mean")

    problems = [
        f"step {view.step}: {line}"
        for view in call_views(scenario, run)
        if (line := composed_disagreement(view)) is not None
    ]
    problems += per_rank(scenario, run, MoeCall, check, is_mean)
    return problems + _composed_orders(scenario, run) if problems else []


def _composed_orders(scenario: Scenario, run: WorldRun) -> list[str]:
    """For a failing run with trainer-wired calls whose names came back in another order than
    the router records them: one line saying both orders (the data a diagnosis of pairing by
    position needs; the call reports hold them per rank)."""
    router = list(scenario.setup.layout.recorded_track_names)
    lines = []
    for view in call_views(scenario, run):
        made = [r.composed for _, r in sorted(view.reports.items()) if r.composed is not None]
        if made and made[0].status == "composed" and made[0].passed != router:
            lines.append(
                f"step {view.step}: track_names {made[0].passed} came from the target's "
                f"get_aux_loss_track_names; the router records {router} in that order"
            )
    return lines[:1]


@guarded
def moe_names(scenario: Scenario, run: WorldRun) -> list[str]:
    """The per-name keys are exactly the oracle's: recorded names plus pre-initialised ones."""
    live = set(scenario.setup.layout.recorded_track_names)

    def check(view: CallView, rank: int, exp: dict[str, float], act: Any) -> list[str]:
        expected = {k for k in exp if is_mean(k)}
        assert isinstance(view.spec, MoeCall)
        requested = set(view.spec.track_names or []) if view.spec.preinit_length else set()
        trained = scenario.steps[0].records is not None  # step 0 recorded every live name
        if (
            scenario.mode == "synthetic"
            and view.step == 0
            and trained
            and (expected != live | requested)
        ):
            raise HarnessFault(
                f"oracle names {sorted(expected)} differ from the recorded and requested names "
                f"{sorted(live | requested)}"
            )
        if not isinstance(act, dict):
            return [f"returned {short(act)}, not a dict"]
        got = {k for k in act if is_mean(str(k))}
        if got == expected:
            return []
        return [
            f"names {sorted(map(str, got))}, expected exactly {sorted(expected)}"
            f" (missing {sorted(expected - got)}, extra {sorted(map(str, got - expected))})"
        ]

    return per_rank(scenario, run, MoeCall, check)


@guarded
def moe_per_layer(scenario: Scenario, run: WorldRun) -> list[str]:
    """With per_layer_logging, ``moe/{name}_layer_{i}`` = loss_scale * v[i], nothing else."""
    return keyed_per_rank(scenario, run, MoeCall, is_per_layer, "per-layer")


@guarded
def moe_all_values(scenario: Scenario, run: WorldRun) -> list[str]:
    """Means and per-layer values equal the oracle's (router mode: megatron's own records)."""
    return keyed_per_rank(scenario, run, MoeCall, every_key)


@guarded
def moe_loss_scale(scenario: Scenario, run: WorldRun) -> list[str]:
    """Means and per-layer values are scaled by loss_scale exactly once."""
    return scaled_problems(scenario, run, MoeCall, every_key)


@guarded
def moe_rank_agreement(scenario: Scenario, run: WorldRun) -> list[str]:
    """Every rank returns the same keys from ``get_moe_metrics``, and the same value for a key
    as every rank that Megatron's reduction gives the same value (``get_mtp_metrics`` returns {}
    off the MTP ranks by design).

    On 0.19 the reduction spans every rank for every name, so every rank returns the same dict.
    On 0.13-0.18 the router records ``z_loss`` without groups: its tensor-parallel ranks
    (sequence-parallel shards of the tokens) keep their own values, as Megatron's own reduction
    leaves them, so they are compared only with ranks the oracle gives the same value."""
    problems = []
    for view, expected in expected_views(scenario, run, MoeCall):
        held = held_zero_names(scenario, view)
        values = {
            r: reported(rep.value, expected.get(r, {}), held)
            for r, rep in sorted(view.reports.items())
        }
        if not values:
            continue
        first_rank, first = next(iter(values.items()))
        for rank, value in values.items():
            if not isinstance(value, dict) or not isinstance(first, dict):
                if value != first:
                    problems.append(f"step {view.step}: rank {rank} returned {short(value)}")
                continue
            if set(value) != set(first):
                problems.append(
                    f"step {view.step}: rank {rank} keys {sorted(value)} differ from rank "
                    f"{first_rank} keys {sorted(first)}"
                )
                continue
            for key in first:
                peer = _first_alike(expected, values, rank, key)
                a, b = values[peer][key], value[key]
                na, nb = oracle.as_number(a), oracle.as_number(b)
                same = a == b or (na is not None and nb is not None and close(na, nb))
                if not same:
                    problems.append(
                        f"step {view.step}: {key!r} is {b!r} on rank {rank} but {a!r} on rank "
                        f"{peer}"
                    )
    return problems


def _first_alike(expected: Expected, values: dict[int, Any], rank: int, key: str) -> int:
    """The lowest rank whose expected value for ``key`` is ``rank``'s (``rank`` itself when none
    lower is; every rank when the oracle expects nothing for ``key``)."""
    mine = expected.get(rank, {}).get(key)
    for other, value in values.items():
        if other == rank:
            return rank
        if not isinstance(value, dict) or key not in value:
            continue  # reported on its own
        theirs = expected.get(other, {}).get(key)
        if mine is None or (theirs is not None and close(mine, theirs)):
            return other
    return rank


@guarded
def moe_total_loss_dict(scenario: Scenario, run: WorldRun) -> list[str]:
    """total_loss_dict accumulates the per-name means of every step, on every rank."""
    problems: list[str] = []
    history: list[Expected] = []
    for view, expected in expected_views(scenario, run, MoeCall):
        history.append(expected)
        totals = oracle.expected_total_loss_dict(history)
        held = held_zero_names(scenario, view)
        for rank, report in sorted(view.reports.items()):
            want = totals.get(rank, {})
            got = report.total_loss_dict
            if got is None:
                problems.append(f"{where(view, rank)}: no total_loss_dict was reported")
                continue
            got = reported(got, want, held)
            for line in keyed_problems(want, got, every_key, "total_loss_dict"):
                problems.append(f"{where(view, rank)}: total_loss_dict {line}")
    return problems
