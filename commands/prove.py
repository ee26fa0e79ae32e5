"""The ``pipemetrics prove`` command: arguments, the run or the merge, the printed summary."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pydantic import ValidationError

from pipemetrics.commands.prove_options import bound_from_args
from pipemetrics.prove.prover import (
    Bound,
    Certificate,
    MergeError,
    merge,
    progress_bar,
    prove,
)
from pipemetrics.sim.model.target import (
    API_FUNCTIONS,
    TargetLoadError,
    precheck_target,
    resolve_builtin,
    resolve_target,
)
from pipemetrics.sim.worlds.inprocess_world import inprocess_unsupported
from pipemetrics.sim.worlds.probe import probe_target

EXIT_PROVEN, EXIT_DISPROVEN, EXIT_USAGE = 0, 1, 2


def _shard(text: str) -> tuple[int, int]:
    try:
        k, n = (int(part) for part in text.split("/"))
    except ValueError:
        raise ValueError(f"--shard: expected K/N such as 2/4, got {text!r}") from None
    if not 1 <= k <= n:
        raise ValueError(f"--shard: K must be between 1 and N, got {text!r}")
    return k, n


def prove_main(args: argparse.Namespace) -> int:
    try:
        if args.merge:
            certificate = merge([_load(path) for path in args.merge])
        else:
            precheck_target(args.impl)  # before the fork server, the probe and any world
            bound = bound_from_args(args)
            shard = _shard(args.shard)
            unsupported = inprocess_unsupported() if args.tier == "inprocess" else None
            if unsupported is not None:
                raise ValueError(f"--tier inprocess: {unsupported}; use --tier process")
            if args.ray is not None and shard != (1, 1):
                raise ValueError("--shard: not with --ray, which runs every shard (use --shards N)")
            if args.ray is None and args.shards is not None:
                raise ValueError("--shards: only with --ray (use --shard K/N otherwise)")
            args.impl = resolve_target(args.impl)  # the scenario files name it from anywhere
            functions = frozenset(probe_target(resolve_builtin(args.impl), args.load_timeout))
            if not functions:
                raise ValueError(
                    f"--impl {args.impl}: defines none of {', '.join(API_FUNCTIONS)}; nothing "
                    "to prove"
                )
            if args.ray is not None:
                certificate = _on_ray(args, bound)
            else:
                certificate = prove(
                    args.impl, bound, shard=shard, tier=args.tier, functions=functions,
                    report_dir=Path(args.report_dir), progress=progress_bar(),
                )  # fmt: skip
    except (ValueError, ValidationError, MergeError, TargetLoadError, OSError) as exc:
        sys.stderr.write(f"pipemetrics prove: {exc}\n")
        return EXIT_USAGE
    _print(certificate)
    if args.json_out:
        Path(args.json_out).write_text(certificate.model_dump_json(indent=2) + "\n")
    return EXIT_PROVEN if certificate.proven else EXIT_DISPROVEN


def _on_ray(args: argparse.Namespace, bound: Bound) -> Certificate:
    from pipemetrics.commands.prove_ray import RayRunError, prove_on_ray

    try:
        return prove_on_ray(
            args.impl, bound, args.shards, address=args.ray, tier=args.tier,
            report_dir=Path(args.report_dir), progress=progress_bar(unit="shards"),
        )  # fmt: skip
    except RayRunError as exc:
        raise ValueError(str(exc)) from exc


def _load(path: str) -> Certificate:
    try:
        return Certificate.model_validate_json(Path(path).read_text(encoding="utf-8"))
    except ValidationError as exc:
        raise MergeError(f"{path}: not a prove certificate ({exc.error_count()} errors)") from exc


def verdict_line(cert: Certificate) -> str:
    """The certificate's one-line verdict: what ran, out of what, and what failed (true
    whether the run covered the bound, one shard, or stopped at its first failing case)."""
    k, n = cert.shard
    total = cert.cases.get("total", 0)
    scope = f"shard {k}/{n}: " if n > 1 else ""
    counted = f"{total} of the {cert.cases_in_bound} cases of the bound"
    if cert.proven:
        head = f"PROVEN for {scope}{counted}"
    else:
        stopped = ", stopped at the first failing case" if cert.stopped_early else ""
        head = (
            f"DISPROVEN for {scope}{cert.failing_cases} of the {total} cases run ({counted} "
            f"run{stopped}; {len(cert.failures)} properties fail)"
        )
    skipped = cert.coverage.skipped
    return (
        f"{cert.target}: {head} ({cert.bound.describe()})"
        + (f", {skipped} skipped (their functions are absent)" if skipped else "")
        + f", {cert.properties_judged} property judgements, {cert.seconds:.0f} s on the "
        f"{cert.tier} tier"
    )


def _print(cert: Certificate) -> None:
    out = sys.stdout
    out.write(verdict_line(cert) + "\n")
    out.write(f"  {cert.coverage.summary()}\n")
    classes = ", ".join(f"{key} {count}" for key, count in cert.cases.items() if key != "total")
    out.write(f"  cases by class: {classes}\n")
    for entry in cert.failures:
        first = entry.smallest
        out.write(f"  {entry.property}: fails in {entry.cases} case(s); smallest: {first.case}\n")
        for line in first.problems[:3]:
            out.write(f"    {line[:800]}\n")
        out.write(f"    replay (process tier): {first.replay}\n")
    if cert.failure is not None:
        out.write(f"  the smallest failing case ({cert.failure.case}):\n")
        out.write(cert.failure.picture.rstrip() + "\n")
    out.flush()
