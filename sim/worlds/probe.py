"""Loading the target first in a child process, under a deadline.

A target runs arbitrary code when it is imported: it may hang, call ``os._exit``, crash the
interpreter or raise. `probe_target` therefore imports it in a child process forked from the
fork server (which has already imported torch and megatron-core, so the child pays only for
the target itself, and the fork server is needed for the worlds anyway) and waits at most
``timeout_s`` for the answer: which API functions the target defines. Whatever goes wrong
becomes a `TargetLoadError` naming the target and what happened (timed out after N s, exited
with code N, killed by signal X, raised E: msg). The child runs in its own session and is
killed with its whole process group on every path; should the caller die first, the child's
watchdog ends it.
"""

from __future__ import annotations

import contextlib
import multiprocessing.connection
import os
import signal
import sys
from multiprocessing.connection import Connection
from typing import Any

from pipemetrics.sim.collectives.interrupt import signal_name
from pipemetrics.sim.model.target import TargetLoadError, no_api_message

DEFAULT_LOAD_TIMEOUT_S = 120.0
"""Default deadline for importing the target (``--load-timeout``): generous, since a trainer's
module may import a large package, yet bounded."""
REAP_WAIT_S = 5.0


def probe_main(target: str, conn: Connection, parent_pid: int, leftovers: list[str]) -> None:
    """Child side: import the target, send ``("ok", functions)`` or ``("error", message)``."""
    from pipemetrics.sim.model.target import load_target, provided_functions
    from pipemetrics.sim.worlds.rank import _die_with

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when this ends
    os.setsid()  # one process group to kill, with whatever the target starts
    _die_with(parent_pid, leftovers)
    os.dup2(2, 1)  # what the target prints must not mix with a report on stdout
    try:
        reply: tuple[str, Any] = ("ok", provided_functions(load_target(target)))
    except TargetLoadError as exc:
        reply = ("error", str(exc))
    conn.send(reply)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # threads or atexit hooks the target left must not keep this alive


def probe_target(target: str, timeout_s: float = DEFAULT_LOAD_TIMEOUT_S) -> list[str]:
    """The API functions ``target`` defines, found by importing it in a child process.

    Raises `TargetLoadError` when the import raises, hangs past ``timeout_s`` (counted from the
    child's start), exits or is killed by a signal.
    """
    from pipemetrics.sim.worlds.world import (
        WorldStartError,
        _forkserver_directory,
        _RankProcess,
        fork_context,
        start_forkserver,
    )

    if timeout_s <= 0:
        raise TargetLoadError(f"--load-timeout must be > 0 (got {timeout_s:g})")
    context = fork_context()
    try:
        start_forkserver()
    except (WorldStartError, OSError) as exc:
        raise TargetLoadError(f"cannot start a process to load target {target!r}: {exc}") from exc
    ours, theirs = context.Pipe(duplex=False)
    proc = _RankProcess(
        target=probe_main,
        args=(target, theirs, os.getpid(), _forkserver_directory()),
        name="pipemetrics-probe",
        daemon=True,
    )
    try:
        proc.start()
        theirs.close()
        return _await_reply(target, proc, ours, timeout_s)
    finally:
        _end(proc)
        ours.close()
        theirs.close()


def _await_reply(target: str, proc: Any, conn: Connection, timeout_s: float) -> list[str]:
    ready = multiprocessing.connection.wait([conn, proc.sentinel], timeout_s)
    if not ready:
        raise TargetLoadError(
            f"cannot load target {target!r}: timed out after {timeout_s:g} s while importing it "
            "(a hang at import time?); raise the deadline with --load-timeout"
        )
    if conn in ready:
        with contextlib.suppress(EOFError, OSError):
            status, payload = conn.recv()
            if status == "ok":
                return list(payload)
            raise TargetLoadError(str(payload))
    proc.join(REAP_WAIT_S)
    raise TargetLoadError(f"cannot load target {target!r}: {_ending(proc.exitcode)}")


def _ending(code: int | None) -> str:
    if code is None:
        return "the loading process stopped answering"
    if code < 0:
        return f"killed by signal {signal_name(-code)} while importing it"
    return f"exited with code {code} while importing it"


def _end(proc: Any) -> None:
    """Kill the child's process group (the target may have started processes) and reap it."""
    pid = proc.pid
    if pid is None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)  # the child's own group, made by its setsid
    with contextlib.suppress(ProcessLookupError, PermissionError, OSError, ValueError):
        proc.kill()
    proc.join(REAP_WAIT_S)


def require_api(target: str, provided: list[str], *, option: str = "--impl") -> list[str]:
    """``provided``, or a `TargetLoadError` when the target defines none of the API functions
    (a mistyped ``--impl`` that lands on another module must not pass; most such targets are
    stopped sooner, from their source, by `pipemetrics.sim.model.target.precheck_target`)."""
    if not provided:
        raise TargetLoadError(no_api_message(target, option=option))
    return provided
