"""``pipemetrics prove``: the enumeration, the certificate, shards and their merge, and that every
hang-class mutant of the seed profile is disproven with a smallest layout that replays on the
process tier. CI runs reduced bounds (the README states the default bound's numbers)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from pipemetrics.properties.prove import (
    Bound,
    BroadcastCase,
    Case,
    Certificate,
    MergeError,
    enumerate_cases,
    merge,
    prove,
    shard_of,
)
from pipemetrics.properties.prove_command import (
    add_prove_arguments,
    bound_cli_args,
    bound_from_args,
)
from pipemetrics.sim.inprocess_world import inprocess_unsupported
from pipemetrics.sim.replay import replay_main

from .broken.mutants import MUTANTS, write_mutant
from .conftest import Bounds, private_tmpdir, run_bounded

pytestmark = pytest.mark.skipif(
    inprocess_unsupported() is not None, reason=str(inprocess_unsupported())
)

TINY = Bound(max_pp=2, max_world=2)
SEED_HANG_MUTANTS = sorted(
    name for name, m in MUTANTS.items() if m.sim_verdict is not None and m.profile == "seed"
)


def test_the_enumeration_is_canonical_and_smallest_first() -> None:
    cases = enumerate_cases(Bound())
    keys = [c.key for c in cases]
    assert len(set(keys)) == len(keys)
    assert keys == [c.key for c in enumerate_cases(Bound())]
    sizes = [c.world.world_size for c in cases]
    assert sizes == sorted(sizes)
    families = {c.family for c in cases}
    assert families == {"layouts", "routing", "flexible", "broadcast"}
    moe_cases = [c for c in cases if isinstance(c, Case)]
    assert {c.mtp for c in moe_cases} == {"none", "dense", "moe"}
    assert {k for c in moe_cases for k in c.stages} == {"empty", "dense", "moe"}
    assert max(c.world.pp for c in cases) == Bound().max_pp
    flexible = [c for c in moe_cases if c.family == "flexible"]
    assert {c.vpp for c in flexible} == {1, 2} and {c.mtp_rank for c in flexible} >= {None, 0}
    for case in flexible:  # every layout string passes Megatron's rules (Setup validates)
        case.setup()
    new_groups = {(c.world.world_size, c.members) for c in cases
                  if isinstance(c, BroadcastCase) and c.members}  # fmt: skip
    world = Bound().max_world  # every subset of two or more ranks, at every world size
    assert len(new_groups) == sum(2**n - n - 1 for n in range(2, world + 1))
    assert (4, (1, 3)) in new_groups  # members that are not the first ranks


def test_shards_partition_the_cases() -> None:
    cases = enumerate_cases(TINY)
    shards = [shard_of(cases, (k, 3)) for k in (1, 2, 3)]
    keys = [c.key for shard in shards for c in shard]
    assert sorted(keys) == sorted(c.key for c in cases) and len(keys) == len(cases)


@pytest.mark.parametrize(
    "bound", [Bound(), TINY, Bound(max_pp=8, max_world=16, parallel_sizes=(1, 2, 4), steps=3)]
)
def test_a_bound_goes_through_the_command_line_unchanged(bound: Bound) -> None:
    """What a Ray shard is started with (bound_cli_args) parses back to the same bound."""
    parser = argparse.ArgumentParser()
    add_prove_arguments(parser)
    assert bound_from_args(parser.parse_args(bound_cli_args(bound))) == bound


def test_the_reference_is_proven_on_a_small_bound(tmp_path: Path) -> None:
    cert = prove("pipemetrics.reference", TINY, report_dir=tmp_path)
    assert cert.proven, cert.failure
    assert cert.cases["total"] == cert.cases_in_bound == len(enumerate_cases(TINY))
    assert cert.properties_judged > cert.cases["total"]
    assert cert.target_sha256 and cert.megatron_core != "unknown"


def test_an_implementation_to_the_letter_of_the_document_is_proven(tmp_path: Path) -> None:
    """The false-positive control (tests/seed_letter, unlike the reference in every way the
    document allows): prove must not disprove it. It caught prove calling get_moe_metrics
    without the pre-initialisation the document prescribes for a stage that records nothing."""
    seed_letter = Path(__file__).resolve().parent / "seed_letter" / "common.py"
    bound = Bound(max_pp=2, max_world=3)
    cert = prove(str(seed_letter), bound, report_dir=tmp_path)
    assert cert.proven, cert.failure
    assert cert.cases["total"] == len(enumerate_cases(bound))


def test_a_standalone_mtp_stage_disproves_the_last_stage_only_mutant(tmp_path: Path) -> None:
    """The flexible family reaches a bug the samplers find in about 3% of their examples."""
    path = write_mutant("moe_mtp_slots_only_on_last_stage", tmp_path / "mutants")
    cert = prove(str(path), TINY, report_dir=tmp_path / "report")
    assert not cert.proven and cert.failure is not None
    assert cert.failure.case.startswith("flexible|") and "mtp-moe@0" in cert.failure.case
    assert "moe.values" in cert.failure.properties


def test_calls_in_both_orders_disprove_a_get_mtp_metrics_that_clears_the_moe_tracker(
    tmp_path: Path,
) -> None:
    """The second step calls get_mtp_metrics first: a bug the samplers need a budget of about
    400 examples for is a 1-rank case here."""
    path = write_mutant("mtp_clears_moe_tracker", tmp_path / "mutants")
    cert = prove(str(path), TINY, report_dir=tmp_path / "report")
    assert not cert.proven and cert.failure is not None
    assert "steps.interleaved" in cert.failure.properties, cert.failure.properties


def test_a_new_group_of_later_ranks_disproves_a_global_source_passed_as_group_rank(
    tmp_path: Path,
) -> None:
    """Sampling rarely draws a group whose members are not its first ranks; the new_group
    broadcasts enumerate them (the smallest is [0, 2] of 3 ranks)."""
    path = write_mutant("broadcast_global_src_as_group_src", tmp_path / "mutants")
    cert = prove(str(path), Bound(max_pp=1, max_world=3), report_dir=tmp_path / "report")
    assert not cert.proven and cert.failure is not None
    assert "|new_group[0, 2]|" in cert.failure.case, cert.failure.case
    assert "broadcast.roundtrip" in cert.failure.properties


@pytest.mark.parametrize("name", SEED_HANG_MUTANTS)
def test_every_seed_hang_mutant_is_disproven(tmp_path: Path, name: str) -> None:
    path = write_mutant(name, tmp_path / "mutants")
    cert = prove(str(path), Bound(max_pp=2, max_world=4), report_dir=tmp_path / "report")
    assert not cert.proven and cert.failure is not None
    failing = next(c for c in enumerate_cases(Bound(max_pp=2, max_world=4))
                   if c.key == cert.failure.case)  # fmt: skip
    assert failing.world.world_size <= 2, cert.failure.case  # the smallest world that shows it
    scenario_file = cert.failure.replay.split(" ", 2)[2]
    assert replay_main(scenario_file, impl=None, raw=False, json_out=None) == 1


SHARDED = Bound(max_pp=1, max_world=2)


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


def _prove_cli(tmp_path: Path, bounds: Bounds, *args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "pipemetrics.properties.cli", "prove",
               "--report-dir", str(tmp_path / "report"), *args]  # fmt: skip
    with private_tmpdir() as tmp:
        import os

        return run_bounded(command, cwd=tmp_path, env=dict(os.environ, TMPDIR=str(tmp)),
                           timeout=bounds(20, 300))  # fmt: skip


def test_the_command_writes_certificates_and_merges_them(tmp_path: Path, bounds: Bounds) -> None:
    outs = []
    for k in (1, 2):
        out = tmp_path / f"shard{k}.json"
        done = _prove_cli(tmp_path, bounds, "--max-pp", "1", "--max-world", "2",
                          "--shard", f"{k}/2", "--json", str(out))  # fmt: skip
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
