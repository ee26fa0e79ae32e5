"""The ``pipemetrics`` command: check, prove, replay, demo, bench, vendor.

Each subcommand lives in its own module of `pipemetrics.commands` (the parser in `parser`); this
file only parses arguments and maps outcomes to exit codes (0 success, 1 a failing verdict, 2
usage or load errors). SIGINT and SIGTERM, at any moment, stop the command: every world it started is ended and removed (`SignalGuard`), and it
exits with 130 (SIGINT) or 143 (SIGTERM).
"""

from __future__ import annotations

import argparse
import atexit
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from typing import NoReturn

from pipemetrics.commands.parser import build_parser
from pipemetrics.sim.collectives.interrupt import Interrupted, SignalGuard
from pipemetrics.sim.worlds.quiet import VERBOSE_ENV, keep_compile_cache

PARENT_POLL_S = 0.2


def _exit_with_parent() -> None:
    """End this command (cleanly, through SIGTERM) if the process that started it dies."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(PARENT_POLL_S)
            if os.getppid() != parent:
                os.kill(os.getpid(), signal.SIGTERM)
                return

    threading.Thread(target=watch, name="pipemetrics-parent-watch", daemon=True).start()


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "check":
        from pipemetrics.commands.check import run_check

        return run_check(args)
    if args.command == "replay":
        from pipemetrics.commands.replay import replay_command

        return replay_command(args)
    if args.command == "bench":
        from pipemetrics.commands.bench import run_bench

        return run_bench(args)
    if args.command == "prove":
        from pipemetrics.commands.prove import prove_main

        return prove_main(args)
    if args.command == "vendor":
        from pipemetrics.commands.vendor import vendor_command

        return vendor_command(args)
    from pipemetrics.commands.demo import demo_command

    return demo_command(args)


def _end_forkserver() -> None:
    """`stop_forkserver`, finished even when a signal lands inside it (the command's work may be
    done by then): once more, where `SignalGuard` ignores every later signal, then the
    `Interrupted` goes on up, so the command still exits with 128 + signum."""
    from pipemetrics.sim.worlds.world import stop_forkserver

    try:
        stop_forkserver()
    except Interrupted:
        stop_forkserver()
        raise


def main(argv: Sequence[str] | None = None) -> int:
    keep_compile_cache()  # before anything imports torch
    with SignalGuard() as guard:
        unwound = False
        try:
            try:
                _exit_with_parent()
                args = build_parser().parse_args(argv)
                if getattr(args, "verbose", False):  # inherited by every process it starts
                    os.environ[VERBOSE_ENV] = "1"
                code = _dispatch(args)
            finally:
                _end_forkserver()
                guard.stop_raising()  # a signal from here on is recorded, then exits as one
        except Interrupted:
            unwound = True  # every world was ended on the way up
        if guard.received is not None:
            name = signal.Signals(guard.received).name
            if not unwound and guard.raised_at:  # a bug of ours or of a package we call
                sys.stderr.write(
                    f"pipemetrics: internal error: the {name} was caught by the code it landed "
                    f"in and the command ran on; it landed here:\n{guard.raised_at}"
                )
            sys.stderr.write(f"pipemetrics: interrupted by {name}; everything it started ended\n")
            sys.stderr.flush()
            return 128 + guard.received
    return code


def run() -> NoReturn:
    """The ``pipemetrics`` command (and ``python -m pipemetrics.commands.cli`` or
    ``python -m pipemetrics.commands``): `main`, then
    exit. After a signal (exit 128 + signum) the exit handlers run (multiprocessing's removes
    its temp dir) and the process ends with ``os._exit``, without the interpreter's teardown:
    everything the command started has ended by then, and the teardown could crash on what the
    interrupted code left half-done (a message being pickled when the signal landed:
    "SystemError: deallocated BytesIO object has exported buffers", then SIGSEGV instead of
    the exit code)."""
    code = main()
    if code >= 128:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    run()
