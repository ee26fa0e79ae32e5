"""Interposition on torch.distributed collectives inside a rank process.

While an `Interposer` is active, every collective issued through ``torch.distributed`` (the
public functions and their twins in ``distributed_c10d``, which Megatron and most trainers call)
is described as a `CollectiveCall` and handed to a gate before the real collective runs. The gate
(the rank's link to the controller) blocks until the controller has seen the matching call of
every member of the group and answers, so a mismatched or missing collective is diagnosed before
the real backend can hang on it. Nested collectives (``broadcast_object_list`` issues two
``broadcast``) run unintercepted under their outer call.
"""

from __future__ import annotations

import functools
import inspect
import os
import pickle
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from pipemetrics.sim.collectives.own_lines import OwnLines
from pipemetrics.sim.collectives.protocol import CollectiveCall

COLLECTIVES: tuple[str, ...] = (
    "all_reduce",
    "broadcast",
    "broadcast_object_list",
    "all_gather",
    "all_gather_object",
    "all_gather_into_tensor",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "monitored_barrier",
    "gather",
    "gather_object",
    "scatter",
    "scatter_object_list",
)

_LENGTH_ONLY = {"object_list", "scatter_object_output_list"}
"""Object lists whose contents legitimately differ per rank but whose length must agree."""
_IGNORED_ARGS = {
    "group",
    "async_op",
    "timeout",
    "weights_only",
    "device_ids",
    "wait_all_ranks",
    # Payloads that legitimately differ per rank, or exist on the root only:
    "obj",
    "object_gather_list",
    "scatter_object_input_list",
    "gather_list",
    "scatter_list",
}
_ROOT_ARGS = {"src", "dst"}
_SKIP_FRAMES = (
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))).replace("\\", "/") + "/",
    "torch/distributed/",
    "torch/utils/",
    "contextlib.py",
)

Gate = Callable[[CollectiveCall], None]
"""Blocks until the collective may run; raises to abandon it."""


def reduce_op_name(op: object) -> str:
    """'SUM', 'AVG', ... for a ``ReduceOp`` or ``ReduceOp.RedOpType``."""
    for name in ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "PREMUL_SUM"):
        if op == getattr(dist.ReduceOp, name, object()):
            return name
    return repr(op)


def describe_value(name: str, value: object) -> str:
    """The part of an argument that must agree across the group."""
    if isinstance(value, torch.Tensor):
        return f"{value.dtype}{list(value.shape)}@{value.device.type}"
    if name in _LENGTH_ONLY:
        return f"len={len(value)}" if isinstance(value, list | tuple) else "object"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(describe_value(name, v) for v in value) + "]"
    if name == "op" or type(value).__name__ in ("ReduceOp", "RedOpType"):
        return reduce_op_name(value)
    return repr(value)


def payload_bytes(op: str, arguments: dict[str, Any]) -> int:
    """Bytes of the data this rank hands to the collective: its tensors (a list of them summed)
    and, for an object collective, its objects as pickled (what torch sends for them)."""
    total = 0
    for name, value in arguments.items():
        if name == "obj" or (name == "object_list" and op == "broadcast_object_list"):
            for item in value if name == "object_list" else [value]:
                try:
                    total += len(pickle.dumps(item))
                except Exception:  # torch would fail on it too; the call reports that
                    continue
        elif isinstance(value, torch.Tensor):
            total += value.numel() * value.element_size()
        elif isinstance(value, list | tuple):
            total += sum(v.numel() * v.element_size() for v in value if isinstance(v, torch.Tensor))
    return total


@functools.lru_cache(maxsize=4096)
def _skipped(path: str) -> bool:
    """Whether frames of ``path`` are left out of a call site (pure: cached per file)."""
    normalised = path.replace("\\", "/")
    return any(skip in normalised for skip in _SKIP_FRAMES)


def call_site(limit: int = 4) -> tuple[str, ...]:
    """Innermost-first frames of the caller, skipping torch.distributed and the simulator.

    Walks the frames directly: no source lines are read (``traceback.extract_stack`` would stat
    every file on the stack, on every collective)."""
    frames: list[str] = []
    frame = sys._getframe(1)
    while frame is not None and len(frames) < limit:
        code = frame.f_code
        if not _skipped(code.co_filename):
            path = code.co_filename.replace("\\", "/")
            frames.append(f"{path}:{frame.f_lineno} in {code.co_name}")
        frame = frame.f_back  # type: ignore[assignment]
    return tuple(frames)


class Binder:
    """A collective's arguments by name, in parameter order, defaults filled in: what
    ``inspect.Signature.bind`` and ``apply_defaults`` give, without their cost on every call.
    Calls the plain path does not cover (a missing or duplicate argument, an unknown keyword,
    too many positional arguments, a signature with ``*args``) go to ``bind``, which also raises
    Python's own TypeError for a wrong call."""

    def __init__(self, function: Callable[..., Any]) -> None:
        self.signature = inspect.signature(function)
        parameters = list(self.signature.parameters.values())
        kinds = {inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY}
        self._plain = all(p.kind in kinds for p in parameters)
        self._names = [p.name for p in parameters]
        self._positional = sum(
            1 for p in parameters if p.kind == inspect.Parameter.POSITIONAL_OR_KEYWORD
        )
        self._defaults = {p.name: p.default for p in parameters if p.default is not p.empty}

    def arguments(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        if self._plain and len(args) <= self._positional:
            out: dict[str, Any] = {}
            used = 0
            for index, name in enumerate(self._names):
                if index < len(args):
                    out[name] = args[index]
                elif name in kwargs:
                    out[name] = kwargs[name]
                    used += 1
                elif name in self._defaults:
                    out[name] = self._defaults[name]
                else:
                    break  # a required argument is missing: bind raises
            else:
                if used == len(kwargs):  # none unknown or given twice: bind raises then
                    return out
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return dict(bound.arguments)


def invalid_root(arguments: dict[str, Any], ranks: tuple[int, ...]) -> str | None:
    """Why the root of a rooted collective is not a member of its group, or None.

    torch takes the root either as ``src``/``dst`` (a global rank) or as ``group_src``/
    ``group_dst`` (the rank within the group). It refuses a global root outside the group
    (``get_group_rank``: ValueError) and gloo a group rank out of range (``invalid root rank``)
    on the calling rank, before communicating: such a call is not gated (it is ``rejected``)
    and raises torch's own error, as in a real world, instead of being released into a
    collective its peers would then be reported stuck in.
    """
    for name in ("src", "dst"):
        root = arguments.get(name)
        if isinstance(root, int) and root not in ranks:
            return f"{name}={root} is not a member of the group {list(ranks)}"
    for name in ("group_src", "group_dst"):
        root = arguments.get(name)
        if isinstance(root, int) and not 0 <= root < len(ranks):
            return f"{name}={root} is out of range for a group of {len(ranks)}"
    return None


Exchange = Callable[[CollectiveCall, dict[str, Any]], Callable[[], Any]]
"""The in-process tier's gate: blocks until the collective is released (raises to abandon it)
and returns what performs it on this rank's arguments."""


class Interposer:
    """Installs gated wrappers on the torch.distributed collectives of this process.

    ``rank`` is the global rank. Records every collective of the current task in ``calls``.
    With an ``exchange`` (the in-process tier) no backend runs: the exchange gates the call and
    performs it, every collective goes through it (also outside `active`, unrecorded: Megatron's
    router reduces while the trackers are filled), and the wrappers are installed once for all
    ranks by the tier (``install=False``), which hands each call to the running rank's
    `intercept`.
    """

    def __init__(
        self, rank: int, gate: Gate | None, *, exchange: Exchange | None = None,
        install: bool = True,
    ) -> None:  # fmt: skip
        self.rank = rank
        self.gate = gate
        self.exchange = exchange
        self.install = install
        self.calls: list[CollectiveCall] = []
        self.recording = False
        self._depth = 0
        self._originals: dict[tuple[object, str], Callable[..., Any]] = {}
        self.own_lines: OwnLines | None = None
        """Where a recorded collective entered the target's own code (`CollectiveCall.target_site`);
        set by the rank's server."""

    @contextmanager
    def active(self) -> Iterator[list[CollectiveCall]]:
        """Intercept collectives inside the block; yields the list of calls it records."""
        self.calls = []
        self.recording = True
        if self.install:
            self._install()
        try:
            yield self.calls
        finally:
            self.recording = False
            if self.install:
                self._uninstall()

    def _install(self) -> None:
        for name in COLLECTIVES:
            original = getattr(c10d, name, None)
            if not callable(original):
                continue
            wrapper = self._wrap(name, original)
            for module in (dist, c10d):
                installed = getattr(module, name, None) is original
                if installed:
                    self._originals[(module, name)] = original
                    setattr(module, name, wrapper)

    def _uninstall(self) -> None:
        for (module, name), original in self._originals.items():
            setattr(module, name, original)
        self._originals.clear()

    def _wrap(self, op: str, original: Callable[..., Any]) -> Callable[..., Any]:
        binder = Binder(original)

        def collective(*args: Any, **kwargs: Any) -> Any:
            return self.intercept(op, original, binder, args, kwargs)

        collective.__wrapped__ = original  # type: ignore[attr-defined]
        collective.__name__ = op
        return collective

    def intercept(
        self,
        op: str,
        original: Callable[..., Any],
        binder: Binder,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        """Describe, gate and run one collective call of this rank."""
        if self._depth > 0:
            return original(*args, **kwargs)
        call, arguments = self._describe(op, binder.arguments(args, kwargs))
        index = self._record(call)
        if call.outcome in ("not-member", "rejected"):
            return original(*args, **kwargs)
        try:
            if self.exchange is not None:
                run = self.exchange(call, arguments)
            else:
                if call.outcome == "pending" and self.gate is not None:
                    self.gate(call)
                run = functools.partial(original, *args, **kwargs)
        except BaseException:
            self._update(index, call, outcome="aborted")
            raise
        self._depth += 1
        begin = time.monotonic()
        try:
            result = run()
        except BaseException:
            self._update(index, call, outcome="failed", seconds=time.monotonic() - begin)
            raise
        finally:
            self._depth -= 1
        outcome = "local" if call.outcome == "local" else "ran"
        self._update(index, call, outcome=outcome, seconds=time.monotonic() - begin)
        return result

    def _record(self, call: CollectiveCall) -> int | None:
        if not self.recording:
            return None
        self.calls.append(call)
        return len(self.calls) - 1

    def _update(self, index: int | None, call: CollectiveCall, **update: Any) -> None:
        if index is not None and index < len(self.calls) and self.calls[index] is call:
            self.calls[index] = call.model_copy(update=update)

    def _describe(
        self, op: str, arguments: dict[str, Any]
    ) -> tuple[CollectiveCall, dict[str, Any]]:
        group = arguments.get("group") or dist.group.WORLD
        ranks = tuple(dist.get_process_group_ranks(group))
        described = tuple(
            (name, describe_value(name, value))
            for name, value in arguments.items()
            if name not in _IGNORED_ARGS and (value is not None or name in _ROOT_ARGS)
        )
        outcome: Literal["pending", "local", "not-member", "rejected"]
        if self.rank not in ranks:
            outcome = "not-member"
        elif invalid_root(arguments, ranks) is not None:
            outcome = "rejected"
        elif len(ranks) == 1:
            outcome = "local"
        else:
            outcome = "pending"
        call = CollectiveCall(
            rank=self.rank,
            index=len(self.calls),
            op=op,
            group_name=str(getattr(group, "group_name", id(group))),
            group_ranks=ranks,
            signature=described,
            call_site=call_site(),
            target_site=(
                self.own_lines.innermost(sys._getframe(1))
                if self.own_lines is not None and self.recording
                else None
            ),
            started_s=time.monotonic(),
            outcome=outcome,
            payload_bytes=payload_bytes(op, arguments),
        )
        return call, arguments


def installed_wrappers() -> list[str]:
    """Names of the torch.distributed functions currently replaced by a wrapper (for tests)."""
    return [n for n in COLLECTIVES if hasattr(getattr(dist, n, None), "__wrapped__")]


__all__ = [
    "COLLECTIVES",
    "Binder",
    "Exchange",
    "Gate",
    "Interposer",
    "call_site",
    "installed_wrappers",
    "invalid_root",
]
