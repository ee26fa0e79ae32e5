"""``prove`` is never weaker than ``check`` inside its bound: every mutant of tests/broken that
``check`` detects under its profile (tests/test_properties_mutants.py holds that) is disproven by
``prove`` at the default bound under the same profile, on a case whose failing properties concern
a function the bug is in; and the reference and the false-positive control (tests/seed_letter, an
implementation to the letter of the API document, which needs megatron-core's MoEMetricsTracker:
0.18+) are proven there.

These run the default bound in full (the two proofs) or, for a mutant, its families that
concern a function the bug is in (where `FOUND_IN` names one, that family alone), up to the
first failing case (``stop_at_first``; canonical order, smallest world first); that case is one
of the default bound's, so the default bound is disproven too (a proof of it runs every case).
On the in-process tier: where the installed megatron-core does not allow it (0.13-0.17), on the
process tier.
"""

from __future__ import annotations

import shlex
from collections.abc import Iterator
from pathlib import Path

import pytest

from pipemetrics.commands.replay import replay_main
from pipemetrics.properties.catalogue import BY_ID
from pipemetrics.prove.families import FAMILIES, enumerate_cases
from pipemetrics.prove.prover import Bound, prove
from pipemetrics.sim.model.target import API_FUNCTIONS
from pipemetrics.sim.worlds.inprocess_world import inprocess_unsupported
from pipemetrics.sim.worlds.pool import Tier, WorldPool

from .broken.mutants import MUTANTS, write_mutant
from .test_properties_mutants import mutant_param
from .test_seed_letter import NEEDS_CLASS_TRACKER, SEED_LETTER

TIER: Tier = "process" if inprocess_unsupported() is not None else "inprocess"


@pytest.mark.parametrize(
    "target", ["pipemetrics.reference", pytest.param(str(SEED_LETTER), marks=NEEDS_CLASS_TRACKER)]
)
def test_the_default_bound_proves_a_correct_implementation(tmp_path: Path, target: str) -> None:
    cert = prove(target, Bound(), tier=TIER, report_dir=tmp_path)
    assert cert.proven, cert.failure
    assert cert.cases["total"] == cert.cases_in_bound and not cert.coverage.absent


#: The family of a mutant's first failing case, for the mutants that meet it late in the
#: canonical order of every family concerning their functions: their disproof runs that family
#: alone and meets the same case after far fewer. Measured 2026-12-08 on 0.19.2, cases run
#: before the failing one over every concerning family / in this family alone: see each line.
#: A family that stops holding a failure makes the test fail (re-measure: `prove` with every
#: concerning family and ``stop_at_first`` names the case, whose key's first ``|`` field is
#: its family).
FOUND_IN: dict[str, str] = {
    "moe_mtp_slots_only_on_last_stage": "flexible",  # 1,826 / 211 (MTP on stage 0 of pp = 2)
    "mtp_gated_on_virtual_last_stage": "depth",  # 1,386 / 204 (pp = 2, vpp = 2)
    "moe_steady_state_decided_locally": "programs",  # 937 / 93 (a forward-only step first)
    "broadcast_global_src_as_group_src": "broadcast",  # 383 / 201 (a subgroup of dp = 3)
    # 5 s or more each in CI over every concerning family
    "broadcast_dtype_type_error": "broadcast_invalid",  # 178 / 2
    "broadcast_local_buffer_check": "broadcast_invalid",  # 217 / 1
    "moe_dp_avg_over_expert_data_group": "layouts",  # 387 / 11 (ep = 2 with dp = 2)
    "moe_empty_stage_returns_early": "arguments",  # 369 / 69 (pp = 2, stage 0 dense)
    "moe_local_insertion_order": "arguments",  # 369 / 69
    "moe_placeholder_skips_dp_avg": "arguments",  # 369 / 69
    "moe_plan_cached_after_first_call": "programs",  # 185 / 13
    "moe_preinit_without_mtp": "arguments",  # 369 / 69
    "mtp_acceptance_scaled": "depth",  # 159 / 11 (two MTP layers)
    "mtp_acceptance_unclamped_total": "programs",  # 213 / 41
    "mtp_empty_layer_rate_hundred": "programs",  # 213 / 41
    "mtp_reduce_on_logging_rank_only": "layouts",  # 395 / 19 (dp = 2)
}


def test_found_in_names_mutants_and_their_families() -> None:
    """A renamed mutant or family cannot leave an entry of `FOUND_IN` that nothing reads."""
    assert set(FOUND_IN) <= set(MUTANTS), sorted(set(FOUND_IN) - set(MUTANTS))
    assert set(FOUND_IN.values()) <= {f.name for f in FAMILIES}, FOUND_IN


@pytest.fixture(scope="module")
def worlds() -> Iterator[WorldPool]:
    """One pool for every mutant's proof (a world runs any target: it loads it per task)."""
    with WorldPool(max_ranks=16, tier=TIER) as pool:
        yield pool


@pytest.mark.parametrize("name", [mutant_param(n) for n in sorted(MUTANTS)])
def test_prove_disproves_every_mutant_that_check_detects(
    tmp_path: Path, worlds: WorldPool, name: str
) -> None:
    mutant = MUTANTS[name]
    path = write_mutant(name, tmp_path / "mutants")
    every = frozenset(API_FUNCTIONS)  # a mutant is the reference with one bug: all five
    concerning = tuple(f.name for f in FAMILIES if set(f.functions) & set(mutant.functions))
    assert name not in FOUND_IN or FOUND_IN[name] in concerning, FOUND_IN[name]
    families = (FOUND_IN[name],) if name in FOUND_IN else concerning
    bound = Bound(profile=mutant.profile, families=families)
    cert = prove(str(path), bound, tier=TIER, functions=every, pool=worlds,
                 report_dir=tmp_path / "r", stop_at_first=True)  # fmt: skip
    assert not cert.proven and cert.failure is not None, f"{name}: proven at {bound.describe()}"
    default_bound = {case.key for case in enumerate_cases(Bound(profile=mutant.profile))}
    assert cert.failure.case in default_bound, cert.failure.case
    failing = [entry.property for entry in cert.failures]
    concerned = {f for p in failing for f in BY_ID[p].functions}
    assert concerned & set(mutant.functions), (cert.failure.case, failing)
    if mutant.sim_outcome is not None:  # a hang or crash: its case replays on the process tier
        scenario_file = shlex.split(cert.failure.replay)[2]
        assert replay_main(scenario_file, impl=None, raw=False, json_out=None) == 1
