"""Do two runs of one scenario agree? The check between the process and the in-process tier.

Two runs agree when their outcomes are of the same kind and every rank reports the same calls
with the same tracker snapshots, values, exceptions (type and message), returned buffers and
collectives (op, group, signature, outcome). Values are compared exactly but for float rounding
of reductions done in another order (gloo's ring, the in-process tier's group order): a float
may differ by `FLOAT_TOLERANCE` of its magnitude (never less than 1), about a hundred float32
epsilons, far below any error a judge reports (a swapped, diluted or doubly scaled value differs
by a factor). When the outcome is not ``ok``, a rank stops where the outcome found it, which in
the process tier depends on timing: only the calls both runs completed are compared.
"""

from __future__ import annotations

import math
from typing import Any

from pipemetrics.sim.collectives.protocol import CallReport, Done
from pipemetrics.sim.worlds.world import WorldRun

FLOAT_TOLERANCE = 1e-5


def differences(a: WorldRun, b: WorldRun, names: tuple[str, str] = ("a", "b")) -> list[str]:
    """What differs between two runs of the same scenario (empty: they agree)."""
    first, second = names
    found: list[str] = []
    if a.outcome.kind != b.outcome.kind:
        found.append(
            f"outcome: {first} {a.outcome.kind} ({a.outcome.message[:300]}), "
            f"{second} {b.outcome.kind} ({b.outcome.message[:300]})"
        )
        return found
    complete = a.outcome.kind == "ok"
    for rank in sorted(set(a.ranks) | set(b.ranks)):
        done_a = a.ranks[rank].done if rank in a.ranks else None
        done_b = b.ranks[rank].done if rank in b.ranks else None
        found += [f"rank {rank}: {d}" for d in _rank_differences(done_a, done_b, complete, names)]
    return found


def _rank_differences(
    a: Done | None, b: Done | None, complete: bool, names: tuple[str, str]
) -> list[str]:
    if a is None or b is None:
        if complete or (a is None) != (b is None):
            return [] if a is b else [f"reported in one run only ({names[0]}: {a is not None})"]
        return []
    found: list[str] = []
    for field in ("load_error", "harness_error"):
        ea, eb = getattr(a, field), getattr(b, field)
        if (ea is None) != (eb is None) or (ea is not None and ea.type != eb.type):
            found.append(f"{field}: {_error(ea)} vs {_error(eb)}")
    reports_a = {(r.step, r.call): r for r in a.reports}
    reports_b = {(r.step, r.call): r for r in b.reports}
    if complete and reports_a.keys() != reports_b.keys():
        found.append(f"calls {sorted(reports_a)} vs {sorted(reports_b)}")
    for key in sorted(reports_a.keys() & reports_b.keys()):
        found += [
            f"step {key[0]} call {key[1]}: {d}"
            for d in _report_differences(reports_a[key], reports_b[key], complete)
        ]
    return found


def _report_differences(a: CallReport, b: CallReport, complete: bool) -> list[str]:
    found: list[str] = []
    if not same_value(a.snapshot.model_dump(), b.snapshot.model_dump()):
        found.append("tracker snapshots before the call differ")
    cut = any(c.outcome == "aborted" for c in [*a.collectives, *b.collectives])
    if complete or not cut:  # a call the outcome cut short ends where timing left it
        if (a.error is None) != (b.error is None) or (
            a.error is not None
            and b.error is not None
            and (a.error.type, a.error.message) != (b.error.type, b.error.message)
        ):
            found.append(f"exception {_error(a.error)} vs {_error(b.error)}")
        if not same_value(a.value, b.value):
            found.append(f"value {a.value!r} vs {b.value!r}")
        if not same_value(a.buffer, b.buffer):
            found.append(f"buffer {a.buffer!r} vs {b.buffer!r}")
        if not same_value(a.total_loss_dict, b.total_loss_dict):
            found.append(f"total_loss_dict {a.total_loss_dict!r} vs {b.total_loss_dict!r}")
        calls_a = [_collective(c) for c in a.collectives]
        calls_b = [_collective(c) for c in b.collectives]
        if calls_a != calls_b:
            found.append(f"collectives {calls_a} vs {calls_b}")
    return found


def _collective(call: Any) -> tuple[Any, ...]:
    return (call.op, call.group_ranks, call.signature, call.outcome)


def _error(error: Any) -> str:
    return "none" if error is None else f"{error.type}: {error.message[:300]}"


def same_value(a: Any, b: Any) -> bool:
    """Equal plain data (`pipemetrics.sim.model.values.encode`), floats within `FLOAT_TOLERANCE`."""
    if isinstance(a, bool) or isinstance(b, bool):
        return bool(a == b)
    if isinstance(a, float | int) and isinstance(b, float | int):
        if isinstance(a, int) and isinstance(b, int):
            return a == b
        if math.isnan(a) or math.isnan(b):
            return math.isnan(a) and math.isnan(b)
        if math.isinf(a) or math.isinf(b):
            return a == b
        return abs(a - b) <= FLOAT_TOLERANCE * max(1.0, abs(a), abs(b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_value(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


__all__ = ["FLOAT_TOLERANCE", "differences", "same_value"]
