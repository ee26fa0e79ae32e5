"""Real gloo worlds for behavioural tests of the metric helpers, set up and torn down in one call.

* `one_rank_world`: this process joins a one-rank gloo world (a ``FileStore`` in a private temp
  dir, no port) and builds ``megatron.core.parallel_state``'s groups, so an implementation runs
  its real reduction; everything is torn down on exit, also when the body raises.
* `run_two_stage`: two processes, one per pipeline stage (``pp=2``; by convention stage 0 holds
  no MoE layers and stage 1 does, and holds the MTP layers: the smallest layout in which a copy
  that skips or reorders collectives on a dense stage shows it), each running the same
  function; returns each rank's result. Two hard deadlines (starting: interpreters, imports,
  the world; then the function itself): a rank that hangs, dies or raises is reported with its
  stack or traceback, and both processes are killed and reaped and the temp dir removed on
  every outcome.

torch and megatron-core are imported when a world starts, not when this module is.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib
import importlib.util
import inspect
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_TIMEOUT_S = 60.0
"""`run_two_stage`'s deadline for the function, counted from the moment both ranks are in the
world (a hang is reported this long after it starts)."""
DEFAULT_START_TIMEOUT_S = 180.0
"""`run_two_stage`'s deadline for starting: two fresh interpreters importing torch and
megatron-core and joining the world (a few seconds on an idle machine; far more on a busy
one)."""
STACK_GRACE_S = 1.0
POLL_S = 0.02


@dataclass(frozen=True)
class Stage:
    """Where a rank stands in the world a helper built."""

    rank: int
    pp_rank: int
    pp_size: int

    @property
    def has_moe_layers(self) -> bool:
        """The convention of these worlds: every stage but the first of a pipeline holds MoE
        layers (one stage: it does)."""
        return self.pp_size == 1 or self.pp_rank > 0

    @property
    def is_last_stage(self) -> bool:
        """The stage that records the MTP loss (megatron-core records it on the last stage)."""
        return self.pp_rank == self.pp_size - 1


@dataclass(frozen=True)
class RankFailure:
    """What went wrong on one rank of `run_two_stage`."""

    rank: int
    kind: str  # "raised", "died", "hung"
    message: str  # the exception's type and text, the exit code, or the deadline
    details: str  # the traceback, or the end of the rank's output and its Python stack


class TwoStageError(AssertionError):
    """A rank of `run_two_stage` raised, died or missed the deadline. ``failures`` maps each
    failing rank to its `RankFailure`; ``results`` holds the ranks that returned."""

    def __init__(self, failures: dict[int, RankFailure], results: dict[int, Any]) -> None:
        self.failures = failures
        self.results = results
        lines = [f"rank {r} {f.kind}: {f.message}" for r, f in sorted(failures.items())]
        for rank, failure in sorted(failures.items()):
            lines.append(f"----- rank {rank} -----\n{failure.details.rstrip()}")
        super().__init__("\n".join(lines))


@contextmanager
def one_rank_world() -> Iterator[Stage]:
    """Join a one-rank gloo world with ``parallel_state`` initialised (every group of one rank)
    and clean trackers; tear it all down on exit (trackers reset, ``destroy_model_parallel``,
    ``destroy_process_group``, temp dir removed), also when the body raises. While it is open,
    ``torch.cuda.current_device()`` answers ``"cpu"`` on a machine without CUDA, since
    megatron-core places tracker tensors with it. Refuses to start inside an initialised
    ``torch.distributed`` world."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from pipemetrics.sim.megatron.trackers import cpu_current_device, reset_trackers
    from pipemetrics.sim.model.layout import WorldSpec
    from pipemetrics.sim.worlds.rank import join_world

    if dist.is_initialized():
        raise RuntimeError(
            "one_rank_world: torch.distributed is already initialised in this process; "
            "destroy that process group first"
        )
    with ExitStack() as stack:
        directory = tempfile.mkdtemp(prefix="pipemetrics-one-rank-")
        stack.callback(shutil.rmtree, directory, ignore_errors=True)
        store = dist.FileStore(os.path.join(directory, "store"), 1)  # type: ignore[attr-defined]
        dist.init_process_group(
            "gloo",
            store=store,
            rank=0,
            world_size=1,
            timeout=datetime.timedelta(seconds=DEFAULT_TIMEOUT_S),
        )
        stack.callback(dist.destroy_process_group)
        stack.callback(parallel_state.destroy_model_parallel)
        join_world(WorldSpec())
        stack.callback(reset_trackers)
        reset_trackers()
        stack.enter_context(cpu_current_device())
        yield Stage(rank=0, pp_rank=0, pp_size=1)


@dataclass(frozen=True)
class _FunctionRef:
    module: str
    qualname: str
    path: str | None
    by_path: bool = False  # a "file.py:name" reference: never looked up by module name

    @classmethod
    def of(cls, function: Callable[..., Any] | str) -> _FunctionRef:
        if isinstance(function, str):
            where, sep, qualname = function.rpartition(":")
            if not sep or not where or not qualname:
                raise ValueError(
                    f"run_two_stage: {function!r}: name the function as 'package.module:name' "
                    "or 'path/to/file.py:name'"
                )
            if where.endswith(".py"):
                path = str(Path(where).resolve())
                return cls(Path(where).stem, qualname, path, by_path=True)
            return cls(module=where, qualname=qualname, path=None)
        module = getattr(function, "__module__", None)
        qualname = getattr(function, "__qualname__", "")
        if not module or module == "__main__" or "<" in qualname:
            raise ValueError(
                f"run_two_stage: {function!r} must be defined at the top level of a module the "
                "child processes can import (not in __main__, a function body or a lambda)"
            )
        try:
            source = inspect.getsourcefile(function)
        except TypeError:
            source = None
        return cls(module=module, qualname=qualname, path=source)

    def load(self) -> Callable[..., Any]:
        target: Any
        try:
            if self.by_path:
                raise ImportError(self.module)
            target = importlib.import_module(self.module)
        except ImportError:
            if self.path is None:
                raise
            spec = importlib.util.spec_from_file_location(self.module, self.path)
            if spec is None or spec.loader is None:
                raise
            target = importlib.util.module_from_spec(spec)
            sys.modules[self.module] = target
            spec.loader.exec_module(target)
        for part in self.qualname.split("."):
            target = getattr(target, part)
        if not callable(target):
            raise TypeError(f"{self.module}:{self.qualname} is not callable")
        return target  # type: ignore[no-any-return]


def _result_file(directory: str, rank: int) -> Path:
    return Path(directory, f"rank{rank}.result")


def _tail(path: Path, limit: int = 4000) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""
    return text[-limit:]


def _ready_file(directory: str, rank: int) -> Path:
    return Path(directory, f"rank{rank}.ready")


def _details(directory: str, rank: int) -> str:
    output = _tail(Path(directory, f"rank{rank}.log"))
    stack = _tail(Path(directory, f"rank{rank}.stacks"))
    parts = [f"output:\n{output}" if output.strip() else "output: (none)"]
    if stack.strip():
        parts.append(f"Python stack when stopped:\n{stack}")
    return "\n".join(parts)


def _dump_stacks(procs: Sequence[subprocess.Popen[bytes]]) -> None:
    """Ask every live rank for its Python stack (``faulthandler`` on SIGUSR1) and give the
    dumps a moment to land."""
    live = [p for p in procs if p.poll() is None]
    for proc in live:
        with suppress(ProcessLookupError):
            proc.send_signal(signal.SIGUSR1)
    if live:
        time.sleep(STACK_GRACE_S)


def _wait(
    procs: Sequence[subprocess.Popen[bytes]],
    directory: str,
    timeout_s: float,
    start_timeout_s: float,
) -> dict[int, RankFailure]:
    """Wait until every rank exits, one exits without a result, or a deadline passes (the
    start's, then the function's, counted from when every rank is in the world); the ranks
    that did not return as `RankFailure`s (the live ones are left for the caller to kill)."""
    start_deadline = time.monotonic() + start_timeout_s
    deadline: float | None = None
    while True:
        codes = [p.poll() for p in procs]
        died = {
            rank: code
            for rank, code in enumerate(codes)
            if code is not None and not _result_file(directory, rank).exists()
        }
        ready = [_ready_file(directory, rank).exists() for rank in range(len(procs))]
        if deadline is None and all(ready):
            deadline = time.monotonic() + timeout_s
        if died or time.monotonic() > (start_deadline if deadline is None else deadline):
            _dump_stacks(procs)
            failures = {
                rank: RankFailure(rank, "died", f"exited with code {code} before returning", "")
                for rank, code in died.items()
            }
            for rank in range(len(procs)):
                if rank not in died and not _result_file(directory, rank).exists():
                    if died:
                        what = f"still running when rank(s) {sorted(died)} died"
                    elif not ready[rank]:
                        what = (
                            f"did not start (imports, joining the world) in {start_timeout_s:g} s"
                        )
                    else:
                        what = f"did not return within {timeout_s:g} s"
                    failures[rank] = RankFailure(rank, "hung", what, "")
            return {
                rank: RankFailure(f.rank, f.kind, f.message, _details(directory, rank))
                for rank, f in failures.items()
            }
        if all(code is not None for code in codes):
            return {}
        time.sleep(POLL_S)


def run_two_stage(
    function: Callable[..., Any] | str,
    *,
    args: Sequence[Any] = (),
    timeout_s: float = DEFAULT_TIMEOUT_S,
    start_timeout_s: float = DEFAULT_START_TIMEOUT_S,
) -> list[Any]:
    """Run ``function(stage, *args)`` on both ranks of a fresh two-stage gloo world (``pp=2``,
    ``parallel_state`` initialised, clean trackers, ``torch.cuda.current_device()`` answering
    ``"cpu"`` without CUDA) and return ``[rank 0's result, rank 1's result]``.

    ``function`` is a top-level function of an importable module (or ``"module:name"``, or
    ``"path/to/file.py:name"``): each rank is a new interpreter that imports it (with this
    process's ``sys.path``). ``args`` and the results travel pickled. Raises `TwoStageError`
    when a rank raises (its traceback), dies, is not in the world after ``start_timeout_s``, or
    has not returned ``timeout_s`` after both ranks were (its Python stack at that moment);
    both processes are killed and reaped and the temp dir is removed on every outcome.
    """
    ref = _FunctionRef.of(function)
    payload = pickle.dumps(tuple(args))
    directory = tempfile.mkdtemp(prefix="pipemetrics-two-stage-")
    procs: list[subprocess.Popen[bytes]] = []
    try:
        Path(directory, "args.pkl").write_bytes(payload)
        spec = {
            "function": dataclasses.asdict(ref),
            "sys_path": [p or os.getcwd() for p in sys.path],
            "timeout_s": timeout_s + start_timeout_s,
            "controller_pid": os.getpid(),
        }
        Path(directory, "spec.json").write_text(json.dumps(spec), encoding="utf-8")
        for rank in range(2):
            # the rank's log from its first byte (an import error too); the rank appends to it
            with open(Path(directory, f"rank{rank}.log"), "ab") as log:
                procs.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "pipemetrics.testing.stage", directory, str(rank)],
                        stdin=subprocess.DEVNULL,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        env={**os.environ, "OMP_NUM_THREADS": "1"},
                    )
                )
        failures = _wait(procs, directory, timeout_s, start_timeout_s)
        results: dict[int, Any] = {}
        for rank in range(2):
            if rank in failures:
                continue
            outcome = pickle.loads(_result_file(directory, rank).read_bytes())
            if outcome["ok"]:
                results[rank] = outcome["value"]
            else:
                failures[rank] = RankFailure(
                    rank, "raised", outcome["message"], outcome["traceback"]
                )
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        for proc in procs:
            proc.wait()
        shutil.rmtree(directory, ignore_errors=True)
    if failures:
        raise TwoStageError(failures, results)
    return [results[0], results[1]]
