"""SIGINT and SIGTERM end a command cleanly, whatever moment they land at.

`SignalGuard` installs handlers for both signals for the duration of a command, whatever the
inherited disposition (a process started from a non-interactive shell's background job, or by
some CI runners, inherits SIGINT *ignored*, and Python then leaves it ignored: Ctrl-C would do
nothing). The first signal raises `Interrupted`, a `KeyboardInterrupt`, in the main thread:
Hypothesis re-raises a `KeyboardInterrupt` without treating it as a test failure (it would
treat a `SystemExit` as one and try to shrink it), and every context manager on the way up ends
its worlds. A signal that lands while the garbage collector runs a finalizer (a ``__del__``, a
``weakref.finalize`` or any weakref callback, such as multiprocessing's ``util.Finalize``) would
be raised there and discarded by Python ("Exception ignored in ..."), and the command would run
to its end: `sys.unraisablehook` sees every such discarded exception, and the guard's delivers
the signal again right after. Code the signal lands in may also catch the `Interrupted` or turn
it into another exception (Hypothesis does, when it lands inside its own bookkeeping while it
draws an example; a library that catches ``BaseException`` would): `raise_if_interrupted` is
a checkpoint where new work begins (each example, each event of a world's run, each property's
result), which raises it again there, so the command stops all the same. Later signals are
ignored, so they cannot cut that cleanup short (it is bounded: a world's `close` takes a few
seconds at most). The command then exits with ``128 + signum``: 130 for SIGINT, 143 for
SIGTERM.

`stop_child` ends a child process the same way: SIGTERM first (so a ``pipemetrics`` child ends
its own worlds), SIGKILL after a grace period.
"""

from __future__ import annotations

import _thread
import contextlib
import signal
import subprocess
import sys
import threading
import traceback
from types import CodeType, FrameType, TracebackType
from typing import Any

HANDLED: tuple[signal.Signals, ...] = (signal.SIGINT, signal.SIGTERM)
REDELIVER_S = 0.01
"""Delay before a signal that landed inside a finalizer is delivered again."""

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
        self.raised_at: str = ""
        """Where the main thread was when `Interrupted` was raised (for a swallowed one)."""
        self._previous: dict[signal.Signals, Any] = {}
        self._previous_unraisablehook: Any = None
        self._raising = True

    def stop_raising(self) -> None:
        """From now on a signal is only recorded in ``received``: the command's work and its
        cleanup are done, and what is left (choosing the exit code) must not be cut short."""
        self._raising = False

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is not None:
            return  # cleanup of the first signal is under way: let it finish
        if not self._raising:
            self.received = signum
            return
        if _runs(frame, _UNRAISABLE_CODE):
            # A redelivered signal landing inside the hook itself: raised here it would be
            # dropped too ("Exception ignored in sys.unraisablehook"). Once more, shortly.
            _redeliver(signum)
            return
        self.received = signum
        self.raised_at = "".join(traceback.format_stack(frame))
        raise Interrupted(signum)

    def raise_again(self) -> None:
        """Raise `Interrupted` again if a signal arrived and the work goes on (the one raised
        where the signal landed was caught there); only in the main thread, where it landed."""
        if (
            self.received is not None
            and self._raising
            and threading.current_thread() is threading.main_thread()
        ):
            raise Interrupted(self.received)

    def _unraisable(self, unraisable: Any) -> None:
        """An `Interrupted` raised where Python discards exceptions (a ``__del__``, a weakref
        callback run by the garbage collector): deliver the signal again once that returned."""
        if isinstance(unraisable.exc_value, Interrupted) and self.received is not None:
            signum, self.received = self.received, None
            _redeliver(signum)
            return
        self._previous_unraisablehook(unraisable)

    @property
    def exit_code(self) -> int | None:
        return None if self.received is None else 128 + self.received

    def __enter__(self) -> SignalGuard:
        for signum in HANDLED:
            self._previous[signum] = signal.signal(signum, self._handle)
        self._previous_unraisablehook = sys.unraisablehook
        sys.unraisablehook = self._unraisable
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        sys.unraisablehook = self._previous_unraisablehook


_UNRAISABLE_CODE = SignalGuard._unraisable.__code__


def _redeliver(signum: int) -> None:
    """Deliver ``signum`` to the main thread's handler again in `REDELIVER_S`."""
    threading.Timer(REDELIVER_S, _thread.interrupt_main, args=(signum,)).start()


def _runs(frame: FrameType | None, code: CodeType) -> bool:
    """Whether ``frame`` or one of its callers runs ``code``."""
    while frame is not None:
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False


def raise_if_interrupted() -> None:
    """A checkpoint where new work begins: under a command's `SignalGuard` (the SIGINT handler
    installed now), raise `Interrupted` again if a signal arrived whose first `Interrupted` was
    caught, or turned into another exception, by the code it landed in. Anywhere else (a test
    session, an adopter's pytest run, a rank) it does nothing."""
    guard = getattr(signal.getsignal(signal.SIGINT), "__self__", None)
    if isinstance(guard, SignalGuard):
        guard.raise_again()


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
