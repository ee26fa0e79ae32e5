"""The options of ``pipemetrics prove`` and the bound they ask for, below both the command
(`pipemetrics.commands.prove`) and its Ray driver (`pipemetrics.commands.prove_ray`), which
starts ``pipemetrics prove --shard`` children with them."""

from __future__ import annotations

import argparse
from typing import Any

from pipemetrics.commands.argv import argv_for, command_args
from pipemetrics.commands.options import (
    PROVE_TIER,
    add_json_out,
    add_list,
    add_load_timeout,
    add_profile,
    add_report_dir,
    add_target,
    add_tier,
    add_verbose,
)
from pipemetrics.commands.subcommand import Subcommand
from pipemetrics.prove.families import FAMILY_NAMES
from pipemetrics.prove.prover import Bound


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
    add_list(
        parser, "--family", dest="families", choices=FAMILY_NAMES, metavar="NAME",
        help="run only these families of cases (the certificate names the families left out, "
        "which are not proven): " + ", ".join(FAMILY_NAMES),
    )  # fmt: skip
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
    add_list(
        parser, "--merge", dest="merge", metavar="CERT",
        help="merge shard certificates: check they cover the bound exactly once",
    )  # fmt: skip
    add_json_out(parser, what="the certificate")
    add_tier(parser, default=PROVE_TIER)
    add_report_dir(parser)
    add_load_timeout(parser)
    add_verbose(parser)


COMMAND = Subcommand(
    "prove",
    "run every structural case up to a bound and write a certificate",
    add_prove_arguments,
)


def bound_from_args(args: argparse.Namespace) -> Bound:
    """The bound the flags of `add_prove_arguments` ask for."""
    return Bound(
        max_pp=args.max_pp, max_world=args.max_world, steps=args.steps, profile=args.profile,
        families=tuple(args.families or ()), parallel_sizes=tuple(int(x) for x in args.parallel_sizes.split(",")),
    )  # fmt: skip


def bound_options(bound: Bound) -> dict[str, Any]:
    """The option values that ask for ``bound`` (by dest; the inverse of `bound_from_args`)."""
    return {
        "max_pp": bound.max_pp, "max_world": bound.max_world, "steps": bound.steps,
        "profile": bound.profile, "families": list(bound.families) or None,
        "parallel_sizes": ",".join(map(str, bound.parallel_sizes)),
    }  # fmt: skip


def bound_cli_args(bound: Bound) -> list[str]:
    """The flags a shard started for ``bound`` gets (every option explicit, the rest at its
    default): the inverse of `bound_from_args`."""
    args = command_args(COMMAND, **bound_options(bound))
    return argv_for(COMMAND.parser(), args, explicit=True)
