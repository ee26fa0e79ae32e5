"""The bench's report: the measured results as JSON (`report`) and as the table ``pipemetrics
bench`` prints (`table`), with the machine they were measured on (`machine_info`)."""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import os
import platform
import statistics
from typing import Any

from pipemetrics.bench.call_cost import CallCost
from pipemetrics.bench.hang_detection import (
    default_timeout_s,
    report_section,
)
from pipemetrics.bench.measure import (
    NOT_MEASURED,
    PERCENTILES,
    THROUGHPUT_MODES,
    BenchError,
    Leftovers,
    Mode,
    Plan,
    Results,
    deadlock_sizes,
    percentile,
    pipeline_world,
)


def four_digits(value: float) -> float:
    """Four significant digits: readable JSON, and ratios that still agree within rounding."""
    return float(f"{value:.4g}")


def machine_info() -> dict[str, Any]:
    def version(name: str) -> str | None:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    cpu = platform.processor() or None
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8") as handle:
        for line in handle:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {
        "cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)),
        "cpu": cpu,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": version("torch"),
        "megatron-core": version("megatron-core"),
        "pipemetrics": version("pipemetrics"),
    }


def _stats(values: list[float]) -> dict[str, float] | None:
    return (
        {"median": four_digits(statistics.median(values)), "max": four_digits(max(values))}
        if values
        else None
    )


def _mode_label(mode: Mode, plan_examples_per_test: int) -> str:
    return mode.label.format(n=plan_examples_per_test)


def report(plan: Plan, results: Results, leftovers: Leftovers) -> dict[str, Any]:
    first = THROUGHPUT_MODES[0].name
    modes = [m for m in THROUGHPUT_MODES if m.name in results.runs]
    measured = {m.name: results.runs[m.name] for m in modes}
    ours = measured.get(first)
    if not ours:
        raise BenchError("the persistent throughput was not measured")
    preloaded = results.tier_starts_s.get("process", {})
    pids, directories = leftovers.survivors()
    sizes = deadlock_sizes(plan)
    machine = machine_info()
    return {
        "throughput": {
            "sizes": list(plan.sizes),
            "examples_per_test": plan.examples_per_test,
            "modes": {m.name: _mode_label(m, plan.examples_per_test) for m in modes},
            "examples": {
                name: {str(s): run.examples for s, run in runs.items()}
                for name, runs in measured.items()
            },
            "examples_per_s": {
                name: {str(s): four_digits(run.rate) for s, run in runs.items()}
                for name, runs in measured.items()
            },
            "peak_rss_mb_per_rank": {
                name: {
                    str(s): _stats(run.memory.peak_rss_mb) for s, run in runs.items() if run.memory
                }
                for name, runs in measured.items()
            },
            "pss_mb_per_rank": {
                name: {str(s): _stats(run.memory.pss_mb) for s, run in runs.items() if run.memory}
                for name, runs in measured.items()
            },
            "speedup": {
                name: {
                    str(s): four_digits(ours[s].rate / run.rate)
                    for s, run in runs.items()
                    if s in ours
                }
                for name, runs in measured.items()
                if name != first
            },
        },
        "scaling": {
            tier: {
                str(size): {
                    "examples_per_s": four_digits(run.rate),
                    "start_s": four_digits(statistics.median(results.tier_starts_s[tier][size])),
                    "peak_rss_mb_per_rank": _stats(run.memory.peak_rss_mb if run.memory else []),
                    "pss_mb_per_rank": _stats(run.memory.pss_mb if run.memory else []),
                }
                for size, run in by_size.items()
            }
            for tier, by_size in results.scaling.items()
        },
        "world_start_s": {
            "preloaded": {
                str(s): four_digits(statistics.median(v)) for s, v in preloaded.items() if v
            },
            "cold": {
                str(s): four_digits(statistics.median(v))
                for s, v in results.cold_start_s.items()
                if v
            },
            "first_forkserver_world_s": four_digits(results.first_forkserver_start_s or 0.0),
        },
        "deadlock": {
            "end_to_end_ms": {
                f"p{q}": four_digits(percentile(results.deadlock_run_ms, q)) for q in PERCENTILES
            },
            "reaction_ms": {
                f"p{q}": four_digits(percentile(results.deadlock_ms, q)) for q in PERCENTILES
            },
            "samples": len(results.deadlock_ms),
            "sizes": sizes,
            "torch_default_timeout_s": default_timeout_s(),
        },
        "check_ci_profile_s": None if results.check_s is None else four_digits(results.check_s),
        "prove": _prove_report(results),
        "check_ceiling": _ceiling_report(results),
        "call_cost": _call_cost(results.call_cost),
        "call_cost_wide": _call_cost(results.call_cost_wide),
        "hang_detection": None if results.hang is None else report_section(results.hang),
        "not_measured": {
            key: f"{NOT_MEASURED} (megatron-core {machine['megatron-core']}): {why}"
            for key, why in results.not_measured.items()
        },
        "quick": plan.quick,
        "machine": machine,
        "details": {
            "world_shapes": {
                str(s): pipeline_world(s).key
                for s in sorted({*plan.sizes, *[s for v in plan.scaling_sizes.values() for s in v]})
            },
            "warmup_examples": plan.warmup_examples,
            "preloaded_start_s": {
                str(s): [four_digits(v) for v in vs] for s, vs in sorted(preloaded.items())
            },
            "cold_start_s": {
                str(s): [four_digits(v) for v in vs]
                for s, vs in sorted(results.cold_start_s.items())
            },
            "deadlock_reaction_ms_max": four_digits(max(results.deadlock_ms)),
            "deadlock_end_to_end_ms_max": four_digits(max(results.deadlock_run_ms)),
        },
        "leftovers": {
            "rank_pids_started": len(leftovers.pids),
            "world_dirs_started": len(leftovers.directories),
            "surviving_pids": pids,
            "surviving_dirs": directories,
            "pids": list(leftovers.pids),
            "dirs": leftovers.directories,
        },
        "notes": [
            "throughput: the same synthetic get_moe_metrics examples in every mode, each judged "
            "by the oracle; worlds are pp=2 x dp=size/2, gloo. persistent: the steady state of "
            f"one pooled world per shape after {plan.warmup_examples} warm-up example(s), its "
            "start not timed; fork_per_example: a fresh world per example forked from the warm "
            "fork server (start, run, judge, close, all timed); spawn_per_test: one world per "
            f"size started with the spawn method (each rank imports torch and megatron-core), "
            f"{plan.examples_per_test} examples run in it, closed, all timed",
            "speedup: persistent examples/s over the mode's",
            "scaling: the persistent mode per tier and size; peak_rss_mb_per_rank is VmHWM of "
            "each rank process after the examples (it counts pages shared with the fork server), "
            "pss_mb_per_rank its proportional share (shared pages divided among their users); "
            "start_s the median start of a fresh world of that tier",
            "world_start_s: preloaded is a world forked from the warm fork server, cold a "
            "spawned world (World.startup_s, median); first_forkserver_world_s the first world "
            "of the process, which waits for the fork server to import torch and megatron-core",
            "deadlock: end_to_end_ms from handing a deadlocking scenario to pool.run until the "
            "outcome is returned (dispatch, target load, fill, the outcome, unwind); reaction_ms "
            "Outcome.latency_ms, from the event that makes the deadlock certain to the outcome; "
            "without pipemetrics a hang like this one blocks until torch's default process-group "
            "timeout (torch_default_timeout_s, stated, never waited for): see hang_detection",
            "call_cost: get_moe_metrics of the reference and megatron-core's own logging call "
            "(built-in target megatron-core: MoEMetricsTracker.report() on 0.18+; on 0.13-0.17, "
            "which have no report(), moe_utils.track_moe_metrics(), whose collectives are the "
            "release's reduce_aux_losses_tracker_across_ranks; each side's 'function' says which "
            "ran) on the same steps in the same worlds; collectives "
            "and bytes moved into the busiest rank per call from a gated run (the first call "
            "and the steady state apart), steady_ms the median wall time of a steady call in a "
            f"raw run of {plan.cost_steps} steps; call_cost_wide the same collectives and bytes "
            "counted on the in-process tier (every rank in one process, no real backend: no "
            "time)",
            "hang_detection: per mismatch kind and tool; pipemetrics seconds are the end-to-end "
            "wall time of pool.run in a live gated world (median of the samples), reaction_ms "
            "Outcome.latency_ms; PyTorch seconds run from the later rank's start of the "
            "mismatching collectives to the first error any rank raised, each case in two fresh "
            "python processes; short_timeout_s is our setting, default_timeout_s torch's "
            "default_pg_timeout (stated, never waited for)",
            "not_measured: what the installed megatron-core cannot run, left out of this run "
            "rather than missing silently: where it would be in this report (throughput.MODE, "
            "scaling.TIER, call_cost_wide) and why; empty when everything was measured",
            *results.notes,
        ],
    }


def _prove_report(results: Results) -> dict[str, Any] | None:
    """``pipemetrics prove`` beside ``check``: its cases, wall time and cases per second (the
    certificate's own time, the cases' run alone), and the wall-time ratio to the check run."""
    cert = results.outputs.get("prove")
    if results.prove_s is None or cert is None:
        return None
    cases = int(cert["cases"]["total"])
    return {
        "bound": cert["bound"],
        "cases": cases,
        "wall_s": four_digits(results.prove_s),
        "cases_per_s": four_digits(cases / max(float(cert["seconds"]), 1e-9)),
        "to_check_ci_profile": None
        if results.check_s is None
        else four_digits(results.prove_s / results.check_s),
    }


def _ceiling_report(results: Results) -> dict[str, Any] | None:
    """Check's loop beside the ranks' own work on its world runs (`pipemetrics.bench.ceiling`):
    scenarios judged per second of each, and the ratio."""
    ceiling = results.ceiling
    if ceiling is None:
        return None
    return {
        "properties": ceiling.properties,
        "judged": ceiling.judged,
        "world_runs": ceiling.runs,
        "world_runs_by_size": {str(size): n for size, n in ceiling.sizes.items()},
        "check_s": four_digits(ceiling.check_s),
        "alone_s": four_digits(ceiling.alone_s),
        "judged_per_s": {
            "check": four_digits(ceiling.check_rate),
            "ceiling": four_digits(ceiling.ceiling_rate),
        },
        "to_ceiling": four_digits(ceiling.ratio),
        "failed": ceiling.failed,
    }


def _call_cost(costs: list[CallCost]) -> dict[str, dict[str, Any]]:
    """{size: {"reference": ..., "megatron": ..., "steady_extra": ...}}: the steady extra is
    what the reference adds to Megatron's own call (each side's ``function``) per call, in
    collectives, bytes and ratio of wall time."""
    out: dict[str, dict[str, Any]] = {}
    for cost in costs:
        side = cost.model_dump(exclude={"target", "world_size"})
        side["steady_ms"] = None if cost.steady_ms is None else four_digits(cost.steady_ms)
        out.setdefault(str(cost.world_size), {})[cost.target] = side
    for sides in out.values():
        ours, theirs = sides["reference"], sides["megatron"]
        timed = ours["steady_ms"] is not None and theirs["steady_ms"] is not None
        sides["steady_extra"] = {
            "collectives": ours["steady"]["collectives"] - theirs["steady"]["collectives"],
            "bytes": ours["steady"]["bytes"] - theirs["steady"]["bytes"],
            "ms_ratio": four_digits(ours["steady_ms"] / theirs["steady_ms"]) if timed else None,
        }
    return out


def _ms(value: float | None) -> str:
    return "not timed (in-process)" if value is None else f"{value:.1f} ms"


def _ratio_text(value: float | None) -> str:
    return "not timed" if value is None else f"{value:.2f}x time"


def _fmt_rate(value: float) -> str:
    return f"{value:.3g}" if value < 10 else f"{value:.1f}"


def _ratio_cell(mode: str, value: float) -> str:
    """``value`` is the first mode's rate over ``mode``'s; below 1 ``mode`` is the faster."""
    if value < 1:
        return f"{_fmt_ratio(value)} ({mode} {_fmt_ratio(1 / value)} faster)"
    return _fmt_ratio(value)


def _fmt_ratio(value: float) -> str:
    return f"{value:.2g}x" if value < 10 else f"{value:.0f}x"


def _fmt_s(value: float) -> str:
    return f"{1000.0 * value:.0f} ms" if value < 1.0 else f"{value:.2f} s"


def _fmt_mb(stats: dict[str, float] | None) -> str:
    return "n/a" if stats is None else f"{stats['median']:.0f} MB ({stats['max']:.0f})"


def _left_out(not_measured: dict[str, str], prefix: str) -> list[str]:
    """A line per measurement under ``prefix`` that the release could not run: what and why."""
    found = [f"{key}: {why}" for key, why in not_measured.items() if key.startswith(prefix)]
    return ["", *found] if found else []


def _megatron_call(call_cost: dict[str, dict[str, Any]]) -> str:
    """The megatron side's function, as the table names it (``report()`` in JSON without one)."""
    functions = {sides["megatron"].get("function", "report()") for sides in call_cost.values()}
    return " / ".join(sorted(functions))


def table(data: dict[str, Any]) -> str:
    """The results as markdown tables, those of docs/measured.md."""
    machine = data["machine"]
    load = machine.get("loadavg_1min", {})
    through = data["throughput"]
    modes = list(through["modes"])
    first, others = modes[0], modes[1:]
    rates = through["examples_per_s"]
    lines = [
        f"pipemetrics bench{' --quick' if data['quick'] else ''}: {machine['cores']} cores "
        f"({machine['cpu']}), Python {machine['python']}, torch {machine['torch']}, "
        f"megatron-core {machine['megatron-core']}"
        + (f"; load average {load['start']} at the start, {load['end']} at the end" if load else ""),
        "",
        "Throughput, examples/s (the same synthetic get_moe_metrics examples, judged by the "
        "oracle; worlds pp=2 x dp=ranks/2, gloo)",
        "",
        "| ranks | " + " | ".join(through["modes"][m] for m in modes) + " | "
        + " | ".join(f"ratio: {first} vs {m}" for m in others) + " |",
        "| --- |" + " --- |" * (len(modes) + len(others)),
    ]  # fmt: skip
    for size in (str(s) for s in through["sizes"]):
        cells = [_fmt_rate(rates[m][size]) if size in rates[m] else "not run" for m in modes]
        ratios = [
            _ratio_cell(m, through["speedup"][m][size]) if size in through["speedup"][m] else ""
            for m in others
        ]
        lines.append(f"| {size} | " + " | ".join(cells + ratios) + " |")
    not_measured: dict[str, str] = data.get("not_measured", {})
    lines += _left_out(not_measured, "throughput.")
    start = data["world_start_s"]
    for tier, by_size in data["scaling"].items():
        lines += [
            "",
            f"Scaling, {tier} tier (pooled steady state; memory per rank process after the "
            "examples: median (max); start: median of fresh worlds)",
            "",
            "| ranks | examples/s | peak RSS per rank (VmHWM) | PSS per rank | world start"
            + (" | cold (spawned) world start |" if tier == "process" else " |"),
            "| --- | --- | --- | --- | --- |" + (" --- |" if tier == "process" else ""),
        ]
        for size, point in by_size.items():
            row = (
                f"| {size} | {_fmt_rate(point['examples_per_s'])} | "
                f"{_fmt_mb(point['peak_rss_mb_per_rank'])} | {_fmt_mb(point['pss_mb_per_rank'])} | "
                f"{_fmt_s(point['start_s'])} |"
            )
            if tier == "process":
                cold = start["cold"].get(size)
                row += f" {'not measured' if cold is None else _fmt_s(cold)} |"
            lines.append(row)
    lines += _left_out(not_measured, "scaling.")
    dl = data["deadlock"]
    e2e, reaction = dl["end_to_end_ms"], dl["reaction_ms"]
    sizes = " and ".join(str(s) for s in dl["sizes"])
    lines += [
        "",
        f"Deadlock detection ({dl['samples']} deadlocking examples, {sizes} ranks, pooled gated "
        "world): end to end from handing the scenario to pool.run until the outcome is "
        "returned; reaction from the event that makes the deadlock certain to the outcome",
        "",
        "| | p50 | p95 | without pipemetrics |",
        "| --- | --- | --- | --- |",
        f"| end to end | {e2e['p50']:.2f} ms | {e2e['p95']:.2f} ms | blocked until torch's "
        f"default timeout, {dl['torch_default_timeout_s']:g} s (stated, not waited for; "
        "measured tools: hang detection table) |",
        f"| reaction | {reaction['p50']:.2f} ms | {reaction['p95']:.2f} ms | |",
    ]
    if data["call_cost"]:
        theirs = _megatron_call(data["call_cost"])
        column = theirs.split(" (", 1)[0]  # the function, without what the title adds
        lines += [
            "",
            f"get_moe_metrics per call, busiest rank: the reference against megatron-core's "
            f"{theirs}; steady call: collectives, bytes, median wall time in a raw run",
            "",
            f"| ranks | reference, first call | reference, steady | {column}, every call | "
            f"steady: reference vs {column} |",
            "| --- | --- | --- | --- | --- |",
        ]
        for size, sides in [*data["call_cost"].items(), *data.get("call_cost_wide", {}).items()]:
            ours, theirs, extra = sides["reference"], sides["megatron"], sides["steady_extra"]
            lines.append(
                f"| {size} | {ours['first']['collectives']} collectives, "
                f"{ours['first']['bytes']:,} B | {ours['steady']['collectives']} collectives, "
                f"{ours['steady']['bytes']:,} B, {_ms(ours['steady_ms'])} | "
                f"{theirs['steady']['collectives']} collectives, {theirs['steady']['bytes']:,} B, "
                f"{_ms(theirs['steady_ms'])} | +{extra['collectives']} "
                f"collective{'' if abs(extra['collectives']) == 1 else 's'}, "
                f"+{extra['bytes']} B, {_ratio_text(extra['ms_ratio'])} |"
            )
    lines += _left_out(not_measured, "call_cost_wide")
    check, prove = data["check_ci_profile_s"], data["prove"]
    lines += [
        "",
        "pipemetrics check on the reference, ci profile: "
        + ("not run" if check is None else f"{check:.1f} s"),
        "pipemetrics prove on the reference: "
        + ("not run" if prove is None else (
            f"{prove['cases']:,} cases in {prove['wall_s']:.1f} s "
            f"({_fmt_rate(prove['cases_per_s'])} cases/s), "
            + ("check not timed" if prove["to_check_ci_profile"] is None else
               f"{prove['to_check_ci_profile']:.2f}x the check's wall time")
            + ("" if not prove["bound"]["families"] else
               f"; families {', '.join(prove['bound']['families'])} only"))),
        _ceiling_line(data.get("check_ceiling")),
    ]  # fmt: skip
    lines += _left_out(not_measured, "check_ceiling")
    return "\n".join(lines)


def _ceiling_line(ceiling: dict[str, Any] | None) -> str:
    head = "check's loop beside the ranks' own work (one process, in-process tier, ci profile): "
    if ceiling is None:
        return head + "not run"
    rates = ceiling["judged_per_s"]
    failed = f"; did not pass: {', '.join(ceiling['failed'])}" if ceiling["failed"] else ""
    return (
        head + f"{ceiling['properties']} properties, {ceiling['judged']:,} scenarios judged "
        f"({ceiling['world_runs']:,} world runs) in {ceiling['check_s']:.1f} s "
        f"({_fmt_rate(rates['check'])}/s); the ranks' work alone on the same runs "
        f"{ceiling['alone_s']:.1f} s ({_fmt_rate(rates['ceiling'])}/s): check at "
        f"{100 * ceiling['to_ceiling']:.0f}% of the ceiling{failed}"
    )
