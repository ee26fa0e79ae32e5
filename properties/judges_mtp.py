"""The judges of ``get_mtp_metrics``: keys, loss_scale, the acceptance rate, every value."""

from __future__ import annotations

from typing import Any

from pipemetrics.properties.judging import (
    every_key,
    guarded,
    keyed_per_rank,
    per_rank,
    scaled_problems,
)
from pipemetrics.properties.runview import CallView
from pipemetrics.sim.model.calls import MtpCall
from pipemetrics.sim.model.records import MtpSnapshot
from pipemetrics.sim.model.scenario import Scenario
from pipemetrics.sim.results.summary import short
from pipemetrics.sim.worlds.world import WorldRun


@guarded
def mtp_keys(scenario: Scenario, run: WorldRun) -> list[str]:
    """Keys are ``mtp_{i}_loss`` / ``mtp_{i}_acceptance_rate`` with i from 1, on MTP holders.

    Exactly the oracle's keys: without acceptance counts in the tracker (megatron-core 0.18, or
    dev with acceptance collection off) that is ``mtp_{i}_loss`` only, and an acceptance key is
    reported as unexpected. A holder that returns ``{}`` (or drops keys) is told that the MTP
    metrics went missing: what an implementation returns when it does not read the tracker
    layout the installed megatron-core writes (e.g. a copy reading ``tracker["loss_values"]``
    on megatron-core dev, whose training path writes ``loss_sums``).
    """

    def check(view: CallView, rank: int, exp: dict[str, float], act: Any) -> list[str]:
        if not isinstance(act, dict):
            return [f"returned {short(act)}, not a dict"]
        got = set(map(str, act))
        if got == set(exp):
            return []
        held = view.reports[rank].snapshot.mtp
        layout = "" if held is None else f" ({_mtp_layout_words(held)})"
        missing = sorted(set(exp) - got)
        if exp and not got:
            return [
                f"the MTP metrics went missing: returned {{}} although this rank's MTP tracker "
                f"holds them{layout}; expected keys {sorted(exp)}"
            ]
        if missing:
            return [
                f"MTP metrics went missing: keys {sorted(got)}, expected {sorted(exp)} "
                f"(missing {missing}){layout}"
            ]
        return [f"keys {sorted(got)}, expected {sorted(exp)}"]

    return per_rank(scenario, run, MtpCall, check)


@guarded
def mtp_loss_scale(scenario: Scenario, run: WorldRun) -> list[str]:
    """``mtp_{i}_loss`` is the reduced loss scaled by loss_scale exactly once."""
    return scaled_problems(scenario, run, MtpCall, lambda k: k.endswith("_loss"))


def _mtp_layout_words(held: MtpSnapshot) -> str:
    """The MTP tracker layout a snapshot was taken from, in the words of megatron-core's keys."""
    if held.num_tokens is not None:
        mode = "per-token" if held.per_token else "per-microbatch"
        return f"megatron-core dev's layout: loss_sums ({mode}), no loss_values"
    if held.correct is None:
        return "layout: values (the loss only)"
    return "layout: loss_values, correct_values, total_values"


@guarded
def mtp_acceptance_rate(scenario: Scenario, run: WorldRun) -> list[str]:
    """``100 * correct / max(total, 1)``, never scaled.

    Judges the acceptance keys the oracle expects; where the installed megatron-core's tracker
    holds no acceptance counts (0.18) it expects none and the property holds vacuously (a stray
    acceptance key is ``mtp.keys``'s concern).
    """
    return scaled_problems(scenario, run, MtpCall, lambda k: k.endswith("_acceptance_rate"))


@guarded
def mtp_all_values(scenario: Scenario, run: WorldRun) -> list[str]:
    """Every MTP key and value equals the oracle's."""
    return keyed_per_rank(scenario, run, MtpCall, every_key)
