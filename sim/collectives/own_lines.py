"""The target's own lines: where, in the adopter's own files, a rank entered a collective, raised,
or returned from the call under test.

A verdict names where each blocked rank stood inside megatron-core or torch (``call_site``); the
adopter needs the line of *their* code too. The target's files (`TargetFiles`) are the module file
the target was loaded from, or, for a package, every file under the package's directory (the
built-in reference: ``reference/``). Three lines are kept, as ``path:line in function`` sites:

* entered: the innermost frame of the target's files on the stack of a collective
  (`OwnLines.innermost`, at the collective's description, walking the frames only);
* raised: the innermost frame of the target's files in an exception's traceback
  (`OwnLines.raised_at`);
* returned: the line of the target's API function the call returned from
  (`OwnLines.returning`): ``sys.monitoring`` ``PY_RETURN`` events enabled only on the code
  objects of the API functions the target defines (local events: nothing else of the
  interpreter is instrumented, one event per call). Where a decorated function's wrapped one
  returned to it, or one of them returned another's value on the line it called it from
  (``return get_moe_metrics(...)``), the line is the innermost one's.

One `OwnLines` serves one process (every rank of the in-process tier shares its host's): events
are told apart by frame, never by rank, so ranks in greenlets cannot mix their lines.

A rank that died or was still running at the deadline sends no report; its line is what the
tier saw (`SeenLine`), recorded at no cost to a run that ends well:

* died in ``os._exit`` called from the target's code: the innermost frame of the target's files
  then, written by the process to its ``.ended`` file on the way out (`record_exits`: the only
  work is at the exit itself);
* died of a fatal signal (``SIGSEGV``, ``SIGABRT``, ``SIGBUS``, ``SIGFPE``, ``SIGILL``): the
  innermost frame of the target's files in the traceback ``faulthandler`` writes to the
  ``.fatal`` file as the process dies (`death_line`);
* killed (``SIGKILL``, ``SIGTERM``) or exited another way: no line, and the write-up says so
  (with the last collective the rank was seen entering, where it entered one);
* running at the deadline: the innermost frame of the target's files in its stack then
  (`stack_site`).
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
from collections.abc import Callable, Mapping
from types import CodeType, FrameType, FunctionType, ModuleType, TracebackType
from typing import Any, Literal, NoReturn

from pipemetrics.sim.collectives.coordinator import Outcome, SeenLine
from pipemetrics.sim.collectives.protocol import Done
from pipemetrics.sim.model.layout import Frozen
from pipemetrics.sim.model.target import API_FUNCTIONS, TargetLoadError, resolve_builtin, spec_for

TOOL_NAME = "pipemetrics.own_lines"
FREE_TOOL_IDS = (3, 4)
"""``sys.monitoring`` tool ids no well-known tool claims (0 debugger, 1 coverage, 2 profiler, 5
optimizer); without a free one, no returned line is kept (entered and raised still are)."""
MAX_WALK = 64
"""Frames walked outwards from a collective to the target's innermost frame."""
_MAX_PENDING = 4096
"""Chains kept for frames still running (a frame unwound by an exception leaves its entry)."""


def site(frame: FrameType) -> str:
    """``path:line in function`` of a frame, as `pipemetrics.sim.collectives.interpose.call_site`
    writes its frames."""
    code = frame.f_code
    return f"{code.co_filename.replace(os.sep, '/')}:{frame.f_lineno} in {code.co_name}"


class TargetFiles:
    """Which source files are the target's: its module file, or a package's whole directory."""

    def __init__(self, files: frozenset[str], directories: tuple[str, ...] = ()) -> None:
        self.files = files
        self.directories = directories
        self._known: dict[str, bool] = {}

    @classmethod
    def of(cls, module: ModuleType) -> TargetFiles:
        path = getattr(module, "__file__", None)
        if not isinstance(path, str):
            return cls(frozenset())
        if getattr(module, "__path__", None) is not None:  # a package: every file under it
            return cls(frozenset(), (os.path.dirname(path) + os.sep,))
        return cls(frozenset({path}))

    def __contains__(self, filename: str) -> bool:
        known = self._known.get(filename)
        if known is None:
            known = filename in self.files or filename.startswith(self.directories)
            self._known[filename] = known
        return known

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TargetFiles) and (self.files, self.directories) == (
            other.files,
            other.directories,
        )

    def __hash__(self) -> int:
        return hash((self.files, self.directories))


def target_files_for(target: str) -> TargetFiles:
    """`TargetFiles` of a target by its name, without executing it (for the controller, which
    reads the stacks of ranks that left no report); empty where it cannot be found."""
    try:
        spec = spec_for(resolve_builtin(target))
    except (TargetLoadError, ImportError, ValueError):
        return TargetFiles(frozenset())
    origin = spec.origin
    if not isinstance(origin, str):
        return TargetFiles(frozenset())
    if spec.submodule_search_locations is not None:
        return TargetFiles(frozenset(), (os.path.dirname(origin) + os.sep,))
    return TargetFiles(frozenset({origin}))


def api_codes(module: ModuleType, files: TargetFiles) -> list[CodeType]:
    """The code objects of the API functions the target defines in its own files (a decorated
    one's wrapped functions too, `functools.wraps`' ``__wrapped__``): the only code whose
    returns are followed, one event per call (its helpers' returns would cost an event each)."""
    found: dict[int, CodeType] = {}
    for name in API_FUNCTIONS:
        function: Any = getattr(module, name, None)
        for _ in range(8):
            if isinstance(function, FunctionType) and function.__code__.co_filename in files:
                found[id(function.__code__)] = function.__code__
            function = getattr(function, "__wrapped__", None)
            if function is None:
                break
    return list(found.values())


class OwnLines:
    """The target's own lines of one process's calls (see the module's docstring)."""

    def __init__(self) -> None:
        self.files = TargetFiles(frozenset())
        self._pending: dict[int, tuple[tuple[str, ...], int, object, CodeType]] = {}
        """Per running frame (its id): the outermost-first chain of sites of the target function
        that last returned to it, the frame's line then, the value it returned and the frame's
        code (an entry left by a frame unwound since never matches a new frame's code)."""
        self._tool: int | None = None

    # -- which code is the target's -------------------------------------------------------------

    def follow(self, module: ModuleType) -> None:
        """The target of the current task is ``module`` (loaded afresh: new code objects)."""
        files = TargetFiles.of(module)
        if files != self.files:  # the same files keep their answers from task to task
            self.files = files
        tool = self._claim()
        if tool is None:
            return
        monitoring = sys.monitoring
        # every time: cheap where already set, and a fresh module's code objects compare equal
        # to the last one's, so no set of them could tell which are instrumented
        for code in api_codes(module, self.files):
            monitoring.set_local_events(tool, code, monitoring.events.PY_RETURN)

    def _claim(self) -> int | None:
        """The tool id whose ``PY_RETURN`` callback is this object's (claimed once)."""
        monitoring = sys.monitoring
        if self._tool is not None and monitoring.get_tool(self._tool) == TOOL_NAME:
            return self._tool
        for tool in FREE_TOOL_IDS:
            owner = monitoring.get_tool(tool)
            if owner is None:
                monitoring.use_tool_id(tool, TOOL_NAME)
            elif owner != TOOL_NAME:
                continue
            monitoring.register_callback(tool, monitoring.events.PY_RETURN, self._on_return)
            self._tool = tool
            return tool
        return None

    def close(self) -> None:
        """Give the tool id back (its local events go with it)."""
        monitoring = sys.monitoring
        if self._tool is not None and monitoring.get_tool(self._tool) == TOOL_NAME:
            monitoring.register_callback(self._tool, monitoring.events.PY_RETURN, None)
            monitoring.free_tool_id(self._tool)
        self._tool = None

    # -- the three lines ------------------------------------------------------------------------

    def innermost(self, frame: FrameType | None) -> str | None:
        """The innermost frame of the target's files from ``frame`` outwards."""
        files = self.files
        for _ in range(MAX_WALK):
            if frame is None:
                return None
            if frame.f_code.co_filename in files:
                return site(frame)
            frame = frame.f_back
        return None

    def raised_at(self, traceback: TracebackType | None) -> str | None:
        """The innermost frame of the target's files in ``traceback``."""
        found = None
        files = self.files
        while traceback is not None:
            code = traceback.tb_frame.f_code
            if code.co_filename in files:
                path = code.co_filename.replace(os.sep, "/")
                found = f"{path}:{traceback.tb_lineno} in {code.co_name}"
            traceback = traceback.tb_next
        return found

    def returning[T](self, call: Callable[[], T]) -> tuple[T, str | None]:
        """``call()``, and the line of the target it returned from (innermost; None when no
        target code returned to this frame: the function is not the target's, or no tool id)."""
        here = id(sys._getframe())
        self._pending.pop(here, None)  # a frame unwound earlier at this address left it
        try:
            value = call()
            chain = self._pending.pop(here, None)
        finally:
            self._pending.pop(here, None)
        return value, chain[0][-1] if chain is not None else None

    def _on_return(self, code: CodeType, offset: int, value: object) -> None:
        frame = sys._getframe(1)
        line = site(frame)
        below = self._pending.pop(id(frame), None)
        chain: tuple[str, ...] = (line,)
        if (
            below is not None
            and below[1] == frame.f_lineno
            and below[2] is value
            and below[3] is code
        ):
            chain = (line, *below[0])  # ``return helper(...)``: helper's line is the one
        parent = frame.f_back
        files = self.files
        returning = _RETURNING
        for _ in range(MAX_WALK):
            if parent is None:
                return
            if parent.f_code is returning or parent.f_code.co_filename in files:
                break
            parent = parent.f_back
        else:
            return
        if len(self._pending) > _MAX_PENDING:
            self._pending.clear()
        caller_line = parent.f_lineno if parent.f_code is not returning else -1
        self._pending[id(parent)] = (chain, caller_line, value, parent.f_code)


_RETURNING = OwnLines.returning.__code__


# -- the lines no report carries: a death, a deadline ---------------------------------------------

ENDED = ".ended"
"""Suffix of the file a process writes where the target's code called ``os._exit``."""
FATAL = ".fatal"
"""Suffix of the file ``faulthandler`` writes a fatal signal's traceback to."""
_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+),? in (?P<function>\S+)')
_FATAL_ERROR = re.compile(r"^Fatal Python error: (?P<what>.+)$", re.MULTILINE)


def stack_site(text: str, files: TargetFiles) -> str | None:
    """The innermost frame of the target's files in a stack as text: ``faulthandler``'s (most
    recent call first, per thread) or ``traceback``'s (most recent call last)."""
    newest_first = "most recent call first" in text
    found = None
    for line in text.splitlines():
        frame = _FRAME.match(line)
        if frame is None or frame["file"] not in files:
            continue
        found = f"{frame['file'].replace(os.sep, '/')}:{frame['line']} in {frame['function']}"
        if newest_first:
            return found
    return found


def record_exits(own: OwnLines, path: str, rank: Callable[[], int | None]) -> None:
    """Make ``os._exit`` called from the target's code write, before the process ends, one
    JSON line to ``path``: the rank ``rank()`` names, the exit code and the innermost frame
    of the target's files. Nothing runs until ``os._exit`` is called; a call from anywhere
    else (pipemetrics' own exits) writes nothing."""
    real = os._exit
    if getattr(real, "_pipemetrics_records", None) is not None:
        real = real._pipemetrics_records  # type: ignore[attr-defined]

    def _exit(status: int) -> NoReturn:
        try:
            site = own.innermost(sys._getframe(1))
            if site is not None:
                with open(path, "a", encoding="utf-8") as handle:
                    handle.write(json.dumps({"rank": rank(), "code": status, "site": site}) + "\n")
        except BaseException:  # the exit must happen whatever the record does
            pass
        real(status)

    _exit._pipemetrics_records = real  # type: ignore[attr-defined]
    os._exit = _exit


def exit_records(path: str) -> list[dict[str, Any]]:
    """The records `record_exits` wrote to ``path`` (none where it wrote none)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            lines = handle.read().splitlines()
    except OSError:
        return []
    records = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            return handle.read()
    except OSError:
        return ""


def died_how(exitcode: int | None) -> str:
    """``exit code 3``, ``SIGSEGV``, or ``unknown exit``."""
    if exitcode is None:
        return "unknown exit"
    if exitcode < 0:
        try:
            return signal.Signals(-exitcode).name
        except ValueError:
            return f"signal {-exitcode}"
    return f"exit code {exitcode}"


def death_line(
    stem: str, exitcode: int | None, files: TargetFiles, rank: int | None = None
) -> SeenLine:
    """Where a process that died was in the target's files, from what it left at ``stem`` +
    `ENDED` (``os._exit``: the record of ``rank``, or the only one) or `FATAL` (a fatal
    signal's traceback); otherwise no line, and why."""
    how = died_how(exitcode)
    records = exit_records(stem + ENDED)
    mine = [r for r in records if rank is None or r.get("rank") in (rank, None)]
    if mine and isinstance(mine[-1].get("site"), str):
        return SeenLine(site=mine[-1]["site"], what=f"os._exit({mine[-1].get('code')})")
    fatal = _read(stem + FATAL)
    error = _FATAL_ERROR.search(fatal)
    if error is not None:
        site = stack_site(fatal, files)
        if site is not None:
            return SeenLine(site=site, what=how)
        return SeenLine(
            what=how, note=f"{error['what']} outside the target's own code (no frame of its files)"
        )
    if exitcode is not None and exitcode < 0:
        return SeenLine(
            what=f"killed by {how}",
            note=f"no line: {how} ended the process at once, and it leaves no trace of where",
        )
    return SeenLine(
        what=how,
        note="no line: the process ended without leaving a record of where (no fatal signal, "
        "and not through os._exit in the target's code)",
    )


def running_lines(
    stacks: Mapping[int, str], ranks: list[int], files: TargetFiles
) -> dict[int, SeenLine]:
    """Each of ``ranks`` (running at the deadline): the innermost frame of the target's files
    in its stack then, or why none is known."""
    seen = {}
    for rank in ranks:
        stack = stacks.get(rank)
        site = stack_site(stack, files) if stack else None
        seen[rank] = (
            SeenLine(site=site)
            if site is not None
            else SeenLine(
                note="no line: no stack of the rank at the deadline"
                if not stack
                else "no line: no frame of the target's files on its stack at the deadline"
            )
        )
    return seen


# -- a run's lines, per rank ----------------------------------------------------------------------

State = Literal["blocked", "raised", "returned", "died", "running"]
HEADING = "the target's own lines (where each rank was in the target's files):"
"""The heading of `lines_text`'s block."""
_SITE = re.compile(r"^(?P<file>.+):(?P<line>\d+) in (?P<function>\S+)$")


class TargetLine(Frozen):
    """One rank's own line of the target when a run ended: blocked in a collective it entered
    at ``site``, raised at ``site``, returned from ``site``; died or still running (no site)."""

    state: State
    site: str | None = None
    """``path:line in function`` in the target's files; None where none is known."""
    what: str | None = None
    """Blocked: the collective (``all_reduce``); raised: the exception's type; died: how
    (``SIGSEGV``, ``os._exit(3)``, ``killed by SIGKILL``)."""
    note: str | None = None
    """Died or running without a site: why no line is known (``no line: ...``)."""

    def text(self) -> str:
        if self.state == "blocked":
            head = f"blocked in {self.what}"
        elif self.state == "raised":
            head = f"raised {self.what}"
        elif self.state == "died" and self.what is not None:
            head = f"died ({self.what})"
        else:
            head = self.state
        if self.site is None:
            if self.note is not None:
                return f"{head}: {self.note}"
            return head if self.state in ("died", "running") else f"{head} (no line of the target)"
        return f"{head} {'from' if self.state == 'returned' else 'at'} {self.site}"

    def as_json(self) -> dict[str, Any]:
        """``state``, ``site`` and its ``file``, ``line``, ``function`` (null where unknown),
        ``what`` (the collective, the exception's type, how a rank died, or null), ``note``
        (why a rank that died or was running has no line, or null)."""
        found = _SITE.match(self.site) if self.site is not None else None
        return {
            "state": self.state,
            "file": found["file"] if found else None,
            "line": int(found["line"]) if found else None,
            "function": found["function"] if found else None,
            "site": self.site,
            "what": self.what,
            "note": self.note,
        }


def target_lines(outcome: Outcome, dones: Mapping[int, Done | None]) -> dict[int, TargetLine]:
    """Each rank's own line of the target when the run ended, for a run whose world did not end
    ``ok`` or one of whose ranks raised; empty otherwise (nothing to point at)."""
    raised = any(
        d is not None and d.reports and d.reports[-1].error is not None for d in dones.values()
    )
    if outcome.kind == "ok" and not raised:
        return {}
    ranks = set(dones) | set(outcome.pending) | set(outcome.crashed) | set(outcome.running)
    lines: dict[int, TargetLine] = {}
    for rank in sorted(ranks | set(outcome.finished)):
        call = outcome.pending.get(rank)
        done = dones.get(rank)
        seen = outcome.seen.get(rank)
        if call is not None:
            lines[rank] = TargetLine(state="blocked", site=call.target_site, what=call.op)
        elif rank in outcome.crashed or (outcome.kind == "crash" and done is None):
            lines[rank] = TargetLine(
                state="died",
                site=seen.site if seen else None,
                what=seen.what if seen else None,
                note=seen.note if seen else None,
            )
        elif rank in outcome.running:
            lines[rank] = TargetLine(
                state="running",
                site=seen.site if seen else None,
                note=seen.note if seen else None,
            )
        elif done is not None and done.reports:
            report = done.reports[-1]
            if report.error is not None:
                lines[rank] = TargetLine(
                    state="raised", site=report.error.target_site, what=report.error.type
                )
            else:
                lines[rank] = TargetLine(state="returned", site=report.returned_from)
    return lines


def lines_text(lines: Mapping[int, TargetLine]) -> list[str]:
    """The block of a write-up: `HEADING`, then ``  rank N: ...`` per rank (none: no lines)."""
    if not lines:
        return []
    return [HEADING, *(f"  rank {rank}: {line.text()}" for rank, line in sorted(lines.items()))]


def lines_json(lines: Mapping[int, TargetLine]) -> dict[str, dict[str, Any]]:
    """The JSON reports' ``target_lines``: rank (a string) -> `TargetLine.as_json`."""
    return {str(rank): line.as_json() for rank, line in sorted(lines.items())}


__all__ = [
    "ENDED",
    "FATAL",
    "HEADING",
    "OwnLines",
    "TargetFiles",
    "TargetLine",
    "api_codes",
    "death_line",
    "died_how",
    "exit_records",
    "lines_json",
    "lines_text",
    "record_exits",
    "running_lines",
    "site",
    "stack_site",
    "target_files_for",
    "target_lines",
]
