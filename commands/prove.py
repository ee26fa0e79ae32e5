"""The ``pipemetrics prove`` command: arguments, the run or the merge, the printed summary."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from pipemetrics.commands.argv import argv_for, command_args
from pipemetrics.commands.options import (
    PROVE_TIER,
    add_json_out,
    add_load_timeout,
    add_profile,
    add_report_dir,
    add_target,
    add_tier,
)
from pipemetrics.commands.parser import command_parser
from pipemetrics.prove.families import FAMILY_NAMES
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


def add_prove_arguments(parser: argparse.ArgumentParser) -> None:
    default = Bound()
    add_target(parser)
    add_profile(parser)
    parser.add_argument(
        "--max-pp",
        type=int,
        default=default.max_pp,
        metavar="N",
        help="largest pipeline size (default: %(default)s)",
    )
    parser.add_argument(
        "--max-world",
        type=int,
        default=default.max_world,
        metavar="N",
        help="largest world (default: %(default)s ranks)",
    )
    parser.add_argument(
        "--parallel-sizes",
        default=",".join(map(str, default.parallel_sizes)),
        metavar="A,B",
        help="sizes tp, cp and dp each take (default: %(default)s)",
    )
    parser.add_argument(
        "--family",
        dest="families",
        action="append",
        choices=FAMILY_NAMES,
        default=[],
        metavar="NAME",
        help="run only this family of cases (repeatable; the certificate names the families "
        "left out, which are not proven): " + ", ".join(FAMILY_NAMES),
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=default.steps,
        metavar="N",
        help="training steps per case (default: %(default)s)",
    )
    parser.add_argument(
        "--shard",
        default="1/1",
        metavar="K/N",
        help="run the K-th of N deterministic shards of the cases",
    )
    parser.add_argument(
        "--ray",
        default=None,
        metavar="ADDRESS",
        help="run the shards as tasks on a Ray cluster and merge them (ADDRESS as for "
        "ray.init: auto, ray://head:10001, or local for a Ray instance of this machine); "
        "needs the ray extra",
    )
    parser.add_argument(
        "--shards",
        type=int,
        default=None,
        metavar="N",
        help="with --ray: how many shards (default: one per CPU of the cluster)",
    )
    parser.add_argument(
        "--merge",
        nargs="+",
        default=None,
        metavar="CERT",
        help="merge shard certificates: check they cover the bound exactly once",
    )
    add_json_out(parser, what="the certificate")
    add_tier(parser, default=PROVE_TIER)
    add_report_dir(parser)
    add_load_timeout(parser)


def bound_from_args(args: argparse.Namespace) -> Bound:
    """The bound the flags of `add_prove_arguments` ask for."""
    return Bound(
        max_pp=args.max_pp, max_world=args.max_world, steps=args.steps, profile=args.profile,
        families=tuple(args.families), parallel_sizes=tuple(int(x) for x in args.parallel_sizes.split(",")),
    )  # fmt: skip


def bound_options(bound: Bound) -> dict[str, Any]:
    """The option values that ask for ``bound`` (by dest; the inverse of `bound_from_args`)."""
    return {
        "max_pp": bound.max_pp, "max_world": bound.max_world, "steps": bound.steps,
        "profile": bound.profile, "families": list(bound.families),
        "parallel_sizes": ",".join(map(str, bound.parallel_sizes)),
    }  # fmt: skip


def bound_cli_args(bound: Bound) -> list[str]:
    """The flags a shard started for ``bound`` gets (every option explicit, the rest at its
    default): the inverse of `bound_from_args`."""
    args = command_args("prove", **bound_options(bound))
    return argv_for(command_parser("prove"), args, explicit=True)


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
