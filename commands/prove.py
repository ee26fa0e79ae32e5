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
from pipemetrics.sim.model.target import API_FUNCTIONS, TargetLoadError, resolve_builtin
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
            bound = bound_from_args(args)
            shard = _shard(args.shard)
            unsupported = inprocess_unsupported() if args.tier == "inprocess" else None
            if unsupported is not None:
                raise ValueError(f"--tier inprocess: {unsupported}; use --tier process")
            if args.ray is not None and shard != (1, 1):
                raise ValueError("--shard: not with --ray, which runs every shard (use --shards N)")
            if args.ray is None and args.shards is not None:
                raise ValueError("--shards: only with --ray (use --shard K/N otherwise)")
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


def _print(cert: Certificate) -> None:
    out = sys.stdout
    k, n = cert.shard
    total = cert.cases.get("total", 0)
    scope = f"shard {k}/{n}: " if n > 1 else ""
    out.write(
        f"{cert.target}: {'PROVEN' if cert.proven else 'DISPROVEN'} for {scope}{total} of the "
        f"{cert.cases_in_bound} cases of the bound ({cert.bound.describe()})"
        + (f", {cert.coverage.skipped} skipped (their functions are absent)"
           if cert.coverage.skipped else "")
        + f", {cert.properties_judged} property judgements, {cert.seconds:.0f} s on the "
        f"{cert.tier} tier\n"
    )  # fmt: skip
    out.write(f"  {cert.coverage.summary()}\n")
    classes = ", ".join(f"{key} {count}" for key, count in cert.cases.items() if key != "total")
    out.write(f"  cases by class: {classes}\n")
    if cert.failure is not None:
        out.write(f"  first failing case: {cert.failure.case}\n")
        by_problem: dict[str, list[str]] = {}
        for prop, lines in cert.failure.properties.items():
            by_problem.setdefault(lines[0], []).append(prop)
        for line, props in by_problem.items():
            out.write(f"  {', '.join(props)}: {line[:800]}\n")
        out.write(cert.failure.picture.rstrip() + "\n")
        out.write(f"  replay (process tier): {cert.failure.replay}\n")
    out.flush()
