"""SIGINT and SIGTERM end a command cleanly, whatever moment they land at.

`SignalGuard` installs handlers for both signals for the duration of a command, whatever the
inherited disposition (a process started from a non-interactive shell's background job, or by
some CI runners, inherits SIGINT *ignored*, and Python then leaves it ignored: Ctrl-C would do
nothing). The first signal raises `Interrupted`, a `KeyboardInterrupt`, in the main thread:
Hypothesis re-raises a `KeyboardInterrupt` without treating it as a test failure (it would
treat a `SystemExit` as one and try to shrink it), and every context manager on the way up ends
its worlds. Later signals are ignored, so they cannot cut that cleanup short
(it is bounded: a world's `close` takes a few seconds at most). The command then exits with
``128 + signum``: 130 for SIGINT, 143 for SIGTERM.

`stop_child` ends a child process the same way: SIGTERM first (so a ``pipemetrics`` child ends
its own worlds), SIGKILL after a grace period.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
from types import FrameType, TracebackType
from typing import Any

HANDLED: tuple[signal.Signals, ...] = (signal.SIGINT, signal.SIGTERM)
CHILD_GRACE_S = 30.0
"""How long a child gets to end its own worlds after SIGTERM before it is killed."""


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM arrived; unwinding ends every world on the way up."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class SignalGuard:
    """Turn the first SIGINT/SIGTERM into `Interrupted`; ignore later ones.

    Use as a context manager around a whole command; ``received`` is the first signal number
    (None when none arrived), ``exit_code`` the exit code it calls for.
    """

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous: dict[signal.Signals, Any] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is not None:
            return  # cleanup of the first signal is under way: let it finish
        self.received = signum
        raise Interrupted(signum)

    @property
    def exit_code(self) -> int | None:
        return None if self.received is None else 128 + self.received

    def __enter__(self) -> SignalGuard:
        for signum in HANDLED:
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)


def signal_name(signum: int) -> str:
    """``SIGSEGV`` for 11; the number itself for a signal without a name."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return str(signum)


def stop_child(proc: subprocess.Popen[Any], grace_s: float = CHILD_GRACE_S) -> None:
    """End ``proc`` if it still runs: SIGTERM, then SIGKILL after ``grace_s``; always reaped."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
    proc.wait()
