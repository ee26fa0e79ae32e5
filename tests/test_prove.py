"""``pipemetrics prove``: the enumeration, the certificate and its coverage, partial targets,
shards and their merge, the command. tests/test_prove_matches_check.py runs the default bound
against the reference, the false-positive control and every mutant."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from pipemetrics.commands.prove_options import (
    add_prove_arguments,
    bound_cli_args,
    bound_from_args,
)
from pipemetrics.properties.catalogue import CATALOGUE, PROPERTY_IDS
from pipemetrics.properties.strategies_broadcast import DTYPES
from pipemetrics.properties.strategies_moe_calls import every_rank_records_every_name
from pipemetrics.prove.cases import LEFT_TO_CHECK
from pipemetrics.prove.families import FAMILIES, FAMILY_NAMES
from pipemetrics.prove.prover import (
    Bound,
    BroadcastCase,
    Case,
    Certificate,
    MergeError,
    coverage_of,
    enumerate_cases,
    merge,
    prove,
    shard_of,
)
from pipemetrics.sim.model.target import API_FUNCTIONS
from pipemetrics.sim.worlds.inprocess_world import inprocess_unsupported

from .broken.mutants import REFERENCE_PATH as REFERENCE
from .broken.mutants import write_combined
from .conftest import Bounds, private_tmpdir, run_bounded
from .test_properties_runner import assert_printed_replay_runs_elsewhere

pytestmark = pytest.mark.skipif(
    inprocess_unsupported() is not None, reason=str(inprocess_unsupported())
)

TINY = Bound(max_pp=2, max_world=2, families=("layouts", "flexible", "broadcast"))


def test_the_enumeration_is_canonical_and_smallest_first() -> None:
    cases = enumerate_cases(Bound())
    keys = [c.key for c in cases]
    assert len(set(keys)) == len(keys)
    assert keys == [c.key for c in enumerate_cases(Bound())]
    sizes = [c.world.world_size for c in cases]
    assert sizes == sorted(sizes)
    assert {c.family for c in cases} == set(FAMILY_NAMES)  # every family has cases
    moe_cases = [c for c in cases if isinstance(c, Case)]
    assert {c.mtp for c in moe_cases} == {"none", "dense", "moe"}
    assert {k for c in moe_cases for k in c.stages} >= {"", "d", "m", "dm", "md", "mm"}
    assert max(c.world.pp for c in cases) == Bound().max_pp
    assert max(c.world.dp for c in moe_cases) == 3 and max(c.mtp_layers for c in moe_cases) == 2
    flexible = [c for c in moe_cases if c.family == "flexible"]
    assert {c.vpp for c in flexible} == {1, 2} and {c.mtp_rank for c in flexible} >= {None, 0}
    for case in flexible:  # every layout string passes Megatron's rules (Setup validates)
        case.setup()
    new_groups = {(c.world.world_size, c.members) for c in cases
                  if isinstance(c, BroadcastCase) and c.members and c.family == "broadcast"}  # fmt: skip
    world = Bound().max_world  # every subset of two or more ranks, at every world size
    assert len(new_groups) == sum(2**n - n - 1 for n in range(2, world + 1))
    assert (4, (1, 3)) in new_groups  # members that are not the first ranks


def test_every_family_is_described_once_and_a_restricted_bound_says_what_it_left_out() -> None:
    assert [family.name for family in FAMILIES] == list(FAMILY_NAMES)
    assert all(family.enumerates for family in FAMILIES)
    restricted = Bound(families=("round_up",))
    assert {c.family for c in enumerate_cases(restricted)} == {"round_up"}
    coverage = coverage_of(restricted, frozenset(API_FUNCTIONS), 0)
    assert [f.name for f in coverage.families] == ["round_up"]
    assert "layouts" in coverage.left_out and "families left out: layouts" in coverage.summary()


def test_the_seed_profile_draws_only_the_documented_argument_forms() -> None:
    """Seed: a float loss_scale, and the pre-initialising call wherever a stage records
    nothing; strict: every form everywhere (issue: prove never stricter than the profile)."""
    seed = [c for c in enumerate_cases(Bound()) if isinstance(c, Case)]
    strict = [c for c in enumerate_cases(Bound(profile="strict")) if isinstance(c, Case)]
    assert {c.arguments.form for c in seed} == {"float", "numpy.float64"}
    assert {c.arguments.form for c in strict} >= {"tensor.float32", "numpy.float32"}
    for case in seed:
        setup = case.setup()
        if not every_rank_records_every_name(setup):
            assert case.arguments.track_names == "live" and case.arguments.num_layers == "given"
    assert any(c.arguments.track_names == "none" and not every_rank_records_every_name(c.setup())
               for c in strict)  # fmt: skip
    seed_broadcasts = [c for c in enumerate_cases(Bound()) if isinstance(c, BroadcastCase)]
    # every input the documented types admit: non-contiguous sources of every dtype, in seed too
    values = {(c.dtype, c.shape) for c in seed_broadcasts if c.family == "broadcast_values"}
    assert {(d, v) for d in DTYPES for v in ("transposed", "strided", "scalar", "empty")} <= values
    # the trainer-wired call, which needs get_aux_loss_track_names, is a seed case too
    assert any(c.arguments.wired and c.arguments.track_names == "live" for c in seed)


def test_a_target_with_some_of_the_functions_is_proven_on_those(tmp_path: Path) -> None:
    """verl-style copies define two or three of the five functions: prove runs their cases,
    names the others as absent, and skips (never refuses) the rest."""
    target = tmp_path / "partial.py"
    source = REFERENCE.read_text()
    target.write_text(source + "\ndel get_moe_metrics, get_mtp_metrics, broadcast_tensor\n")
    bound = Bound(max_pp=1, max_world=1, families=("layouts", "round_up", "track_names"))
    cert = prove(str(target), bound, report_dir=tmp_path / "report")
    assert cert.proven, cert.failure
    assert cert.coverage.absent == ["broadcast_tensor", "get_moe_metrics", "get_mtp_metrics"]
    assert cert.cases["total"] == cert.cases.get("family:round_up", 0) + cert.cases.get(
        "family:track_names", 0)  # fmt: skip
    assert cert.coverage.skipped == cert.cases_in_bound - cert.cases["total"] > 0
    assert "functions absent (not proven): broadcast_tensor" in cert.coverage.summary()


def test_shards_partition_the_cases() -> None:
    cases = enumerate_cases(TINY)
    shards = [shard_of(cases, (k, 3)) for k in (1, 2, 3)]
    keys = [c.key for shard in shards for c in shard]
    assert sorted(keys) == sorted(c.key for c in cases) and len(keys) == len(cases)


@pytest.mark.parametrize(
    "bound",
    [Bound(), TINY, Bound(profile="strict", families=("arguments", "round_up")),
     Bound(max_pp=8, max_world=16, parallel_sizes=(1, 2, 4), steps=3)],
)  # fmt: skip
def test_a_bound_goes_through_the_command_line_unchanged(bound: Bound) -> None:
    """What a Ray shard is started with (bound_cli_args) parses back to the same bound."""
    parser = argparse.ArgumentParser()
    add_prove_arguments(parser)
    assert bound_from_args(parser.parse_args(bound_cli_args(bound))) == bound


SHARDED = Bound(max_pp=1, max_world=2, families=("layouts", "broadcast"))


def _shard(tmp_path: Path, k: int, n: int) -> Certificate:
    return prove("pipemetrics.reference", SHARDED, shard=(k, n), report_dir=tmp_path)


def test_merged_shards_cover_the_bound_exactly_once(tmp_path: Path) -> None:
    first, second = _shard(tmp_path, 1, 2), _shard(tmp_path, 2, 2)
    merged = merge([first, second])
    assert merged.proven and merged.shard == (1, 1)
    assert merged.cases["total"] == merged.cases_in_bound
    with pytest.raises(MergeError, match="shard 1/2 appears 2 times; shard 2/2 appears 0"):
        merge([first, first])
    with pytest.raises(MergeError, match="shard 2/2 appears 0 times"):
        merge([first])
    forged = second.model_copy(update={"shard_digest": first.shard_digest})
    with pytest.raises(MergeError, match="its cases are not this bound's shard"):
        merge([first, forged])
    other = second.model_copy(update={"bound": Bound(max_pp=1, max_world=1)})
    with pytest.raises(MergeError, match="bound: the certificates differ"):
        merge([first, other])


TWO_BUGS = ("round_up_off_by_one", "track_names_always_z_loss")
"""Two independent bugs, each failing every case of its family (0 is a multiple of every
multiple; every track_names case has a config without z-loss)."""


def test_prove_reports_every_failing_property_with_true_counts(
    tmp_path: Path, bounds: Bounds
) -> None:
    """A target with two independent bugs: the whole bound runs, both properties are reported,
    each with its count and its smallest case (the first of its family in canonical order: a
    single known routing type with a positive coefficient before lists and duplicates), and
    the verdict line says what ran. The printed replay command runs from another directory,
    the target having been named relative to the prove's."""
    target = write_combined(TWO_BUGS, tmp_path)
    out = tmp_path / "cert.json"
    done = _prove_cli(tmp_path, bounds, "--impl", target.name, "--family", "round_up",
                      "track_names", "--json", str(out))  # fmt: skip
    assert done.returncode == 1, done.stdout
    cert = Certificate.model_validate_json(out.read_text())
    every = enumerate_cases(cert.bound)
    per_family = {f: [i for i, c in enumerate(every) if c.family == f]
                  for f in ("round_up", "track_names")}  # fmt: skip
    assert cert.cases["total"] == cert.cases_in_bound == len(every) and not cert.stopped_early
    found = {entry.property: entry for entry in cert.failures}
    assert set(found) == {"round_up.least_multiple", "track_names.router_parity"}
    for property_id, family in (("round_up.least_multiple", "round_up"),
                                ("track_names.router_parity", "track_names")):  # fmt: skip
        entry = found[property_id]
        assert entry.cases == len(per_family[family]), (property_id, entry.cases)
        assert entry.smallest.index == per_family[family][0]
        assert entry.smallest.case == every[entry.smallest.index].key
        assert f"{property_id}: fails in {entry.cases} case(s)" in done.stdout
    assert found["track_names.router_parity"].smallest.case == "track_names|'aux_loss'|0.01"
    assert cert.failing_cases == len(every)
    assert (f"DISPROVEN for {len(every)} of the {len(every)} cases run ({len(every)} of the "
            f"{len(every)} cases of the bound run; 2 properties fail)") in done.stdout  # fmt: skip
    assert_printed_replay_runs_elsewhere(
        found["track_names.router_parity"].smallest.replay, tmp_path, bounds, expect=1
    )


def _prove_cli(tmp_path: Path, bounds: Bounds, *args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "pipemetrics.commands.cli", "prove",
               "--report-dir", str(tmp_path / "report"), *args]  # fmt: skip
    with private_tmpdir() as tmp:
        import os

        return run_bounded(command, cwd=tmp_path, env=dict(os.environ, TMPDIR=str(tmp)),
                           timeout=bounds(20, 300))  # fmt: skip


def test_the_command_writes_certificates_and_merges_them(tmp_path: Path, bounds: Bounds) -> None:
    outs = []
    for k in (1, 2):
        out = tmp_path / f"shard{k}.json"
        done = _prove_cli(tmp_path, bounds, "--max-pp", "1", "--max-world", "2", "--family",
                          "layouts", "--family", "broadcast", "--shard", f"{k}/2", "--json",
                          str(out))  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
        assert f"PROVEN for shard {k}/2" in done.stdout
        outs.append(str(out))
    merged = tmp_path / "merged.json"
    done = _prove_cli(tmp_path, bounds, "--merge", *outs, "--json", str(merged))
    assert done.returncode == 0, done.stdout + done.stderr
    data = json.loads(merged.read_text())
    assert data["proven"] is True and data["cases"]["total"] == data["cases_in_bound"]
    done = _prove_cli(tmp_path, bounds, "--shard", "3/2")
    assert done.returncode == 2 and "--shard: K must be between 1 and N" in done.stdout


def test_docs_prove_describes_every_family() -> None:
    """docs/prove.md is where a user reads the abstraction: every family has its row."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "prove.md").read_text()
    assert [name for name in FAMILY_NAMES if f"| `{name}` |" not in text] == []


def test_every_catalogue_property_is_judged_by_a_case_or_left_to_check_with_a_reason() -> None:
    """A property added to the catalogue is judged by prove's cases of its function (the case
    lists derive from the catalogue), unless `LEFT_TO_CHECK` says why not: prove is never
    silently weaker than check. The strict profile's cases, every function defined (1 s)."""
    bound = Bound(profile="strict")
    functions = frozenset(p.function for p in CATALOGUE)
    judged = {p for case in enumerate_cases(bound) for p in case.properties(bound, functions)}
    assert set(LEFT_TO_CHECK) <= set(PROPERTY_IDS)
    assert not judged & set(LEFT_TO_CHECK)
    assert judged | set(LEFT_TO_CHECK) == set(PROPERTY_IDS)
