"""``pipemetrics bench --plot DIR``: the bench's curves as PNG files (needs the ``plot`` extra).

Drawn from the bench's JSON only, so ``--from-json`` redraws an earlier run:

* ``throughput.png``: examples per second against world size, one curve per way of running the
  examples (persistent pool, fresh forked world per example, spawned world per test);
* ``scaling.png``: against world size, per tier: examples per second, memory per rank process
  (peak RSS and proportional share) and world start time (preloaded and cold).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

DPI = 80


def _sizes(by_size: dict[str, Any]) -> list[int]:
    return sorted(int(s) for s in by_size)


def _log2_axis(axis: Any, sizes: list[int]) -> None:
    axis.set_xscale("log", base=2)
    axis.set_xticks(sizes)
    axis.set_xticklabels([str(s) for s in sizes])
    axis.set_xlabel("ranks")
    axis.grid(True, which="both", alpha=0.3)


def _subtitle(data: dict[str, Any]) -> str:
    machine = data["machine"]
    load = machine.get("loadavg_1min")
    text = f"{machine['cores']} cores, torch {machine['torch']}, gloo"
    if load:
        text += f", load average {load['start']}-{load['end']}"
    return text + (" (--quick)" if data["quick"] else "")


def plot(data: dict[str, Any], directory: Path) -> list[Path]:
    """Write the PNG files into ``directory`` (created if needed); their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []

    through = data["throughput"]
    figure, axis = plt.subplots(figsize=(6.4, 4.6), dpi=DPI)
    every: set[int] = set()
    for mode, label in through["modes"].items():
        rates = through["examples_per_s"][mode]
        sizes = _sizes(rates)
        every.update(sizes)
        axis.plot(sizes, [rates[str(s)] for s in sizes], marker="o", label=label)
    axis.set_yscale("log")
    axis.set_ylabel("examples per second (log)")
    _log2_axis(axis, sorted(every))
    axis.set_title("Throughput of the property loop\n" + _subtitle(data), fontsize=10)
    axis.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), frameon=False)
    figure.tight_layout()
    path = directory / "throughput.png"
    figure.savefig(path, dpi=DPI)
    plt.close(figure)
    written.append(path)

    figure, (rate_axis, memory_axis, start_axis) = plt.subplots(1, 3, figsize=(12, 3.8), dpi=DPI)
    every = set()
    for tier, by_size in data["scaling"].items():
        sizes = _sizes(by_size)
        every.update(sizes)
        points = [by_size[str(s)] for s in sizes]
        rate_axis.plot(sizes, [p["examples_per_s"] for p in points], marker="o", label=tier)
        for key, style, what in (
            ("peak_rss_mb_per_rank", "-", "peak RSS"),
            ("pss_mb_per_rank", "--", "PSS"),
        ):
            known = [(s, p[key]["median"]) for s, p in zip(sizes, points, strict=True) if p[key]]
            if known:
                memory_axis.plot(
                    [s for s, _ in known], [m for _, m in known], style, marker="o",
                    label=f"{tier}: {what}",
                )  # fmt: skip
        start_axis.plot(
            sizes,
            [p["start_s"] for p in points],
            marker="o",
            label=f"{tier}: fresh world" if tier != "process" else "process: preloaded (fork)",
        )
    cold = data["world_start_s"]["cold"]
    if cold:
        sizes = _sizes(cold)
        every.update(sizes)
        start_axis.plot(
            sizes, [cold[str(s)] for s in sizes], marker="s", label="process: cold (spawn)"
        )
    for axis, title, ylabel in (
        (rate_axis, "examples/s, pooled", "examples per second (log)"),
        (memory_axis, "memory per rank (median)", "MB"),
        (start_axis, "world start", "seconds (log)"),
    ):
        _log2_axis(axis, sorted(every))
        axis.set_title(title, fontsize=10)
        axis.set_ylabel(ylabel)
        axis.legend(fontsize=7, loc="best")
    memory_axis.set_ylim(bottom=0)
    rate_axis.set_yscale("log")
    start_axis.set_yscale("log")
    figure.suptitle("Scaling with world size: " + _subtitle(data), fontsize=10)
    figure.tight_layout()
    path = directory / "scaling.png"
    figure.savefig(path, dpi=DPI)
    plt.close(figure)
    written.append(path)
    return written
