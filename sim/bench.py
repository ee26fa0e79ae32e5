"""``pipemetrics bench`` (being written)."""

from __future__ import annotations

import argparse


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", dest="json_out", default=None, metavar="FILE")


def run_bench(args: argparse.Namespace) -> int:
    raise SystemExit("pipemetrics bench: not implemented yet")
