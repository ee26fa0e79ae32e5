"""SIGINT and SIGTERM end a command cleanly, whatever moment they land at.

`SignalGuard` installs handlers for both signals for the duration of a command, whatever the
inherited disposition (a process started from a non-interactive shell's background job, or by
some CI runners, inherits SIGINT *ignored*, and Python then leaves it ignored: Ctrl-C would do
nothing). The first signal raises `Interrupted`, a `KeyboardInterrupt`, in the main thread:
Hypothesis re-raises a `KeyboardInterrupt` without treating it as a test failure (it would
treat a `SystemExit` as one and try to shrink it), and every context manager on the way up ends
its worlds. A signal that lands while the garbage collector runs a ``__del__`` or a
``weakref.finalize`` callback would be raised there and dropped by Python ("Exception ignored
in ..."), and the command would run to its end: it is delivered again right after
(`inside_finalizer`). Later signals are ignored, so they cannot cut that cleanup short
(it is bounded: a world's `close` takes a few seconds at most). The command then exits with
``128 + signum``: 130 for SIGINT, 143 for SIGTERM.

`stop_child` ends a child process the same way: SIGTERM first (so a ``pipemetrics`` child ends
its own worlds), SIGKILL after a grace period.
"""

from __future__ import annotations

import _thread
import contextlib
import signal
import subprocess
import threading
import weakref
from types import CodeType, FrameType, TracebackType
from typing import Any

HANDLED: tuple[signal.Signals, ...] = (signal.SIGINT, signal.SIGTERM)
REDELIVER_S = 0.01
"""Delay before a signal that landed inside a finalizer is delivered again."""
_FINALIZER_CODES: frozenset[CodeType] = frozenset({weakref.finalize.__call__.__code__})


def inside_finalizer(frame: FrameType | None) -> bool:
    """Whether ``frame`` runs inside a ``__del__`` or a ``weakref.finalize`` callback (which the
    garbage collector may start at any allocation): an exception raised there is discarded."""
    while frame is not None:
        if frame.f_code.co_name == "__del__" or frame.f_code in _FINALIZER_CODES:
            return True
        frame = frame.f_back
    return False


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
        if inside_finalizer(frame):
            # Raised here, it would be printed and dropped ("Exception ignored in ...") and the
            # command would run on: deliver the signal again once the finalizer has returned.
            threading.Timer(REDELIVER_S, _thread.interrupt_main, args=(signum,)).start()
            return
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
