"""The check's outputs: the human table and failure write-ups, the JSON report, JUnit XML, and
a Markdown summary (for a CI job summary).

JSON contract: ``{"target", "profile", "tier", "conformant", "properties": [{"id", "function",
"status", "examples", "found_at", "seconds", "counterexample", "replay", "message", "confirmed",
"drawn_by", "cites", "target_lines"}]}`` plus the additional top-level key ``"coverage"``. ``examples`` counts
the scenarios the property judged, on its own generator's pass and on those of
`pipemetrics.properties.catalogue.ALSO_JUDGED_ON`. ``found_at`` is the example at which a
failure first appeared, before shrinking (null otherwise); ``drawn_by`` names the property
whose generator drew it when not its own (null otherwise; ``found_at`` then counts that
generator's examples). ``confirmed`` is true for a failure that
reproduced on the process tier (every reported failure; a failure of the in-process tier that
did not is an ``error`` with ``confirmed`` false), null otherwise. A failure's ``counterexample`` (the scenario) carries one extra
key, ``"picture"``: the plain-text layout picture of `pipemetrics.sim.results.picture`.
``target_lines`` is, for a failure whose minimal example hung, mismatched, crashed or raised,
each rank's own line of the target (rank as a string -> ``{"state": "blocked" | "raised" |
"returned" | "died" | "running", "file", "line", "function", "site", "what"}``: where, in the
target's own files, it entered the collective it was blocked in, raised, or returned from;
`pipemetrics.sim.collectives.own_lines`), ``{}`` otherwise.
"""

from __future__ import annotations

import json
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any, TextIO

from pipemetrics.properties.catalogue import BY_ID
from pipemetrics.properties.coverage import RARE
from pipemetrics.properties.engine import PropertyResult


def conformant(results: list[PropertyResult]) -> bool:
    """True when no property of a provided function failed or errored (xfails excepted)."""
    return all(r.status in ("pass", "absent", "skipped") or r.xfail for r in results)


def report_json(
    target: str,
    profile: str,
    results: list[PropertyResult],
    coverage: dict[str, Any],
    tier: str = "process",
) -> dict[str, Any]:
    return {
        "target": target,
        "profile": profile,
        "tier": tier,
        "conformant": conformant(results),
        "properties": [r.as_json() for r in results],
        "coverage": coverage,
    }


def write_json(path: str, data: dict[str, Any]) -> None:
    Path(path).write_text(json.dumps(data, indent=2, default=repr) + "\n", encoding="utf-8")


def write_junit(path: str, target: str, results: list[PropertyResult]) -> None:
    suite = ET.Element(
        "testsuite",
        name="pipemetrics.check",
        tests=str(len(results)),
        failures=str(sum(r.status == "fail" for r in results)),
        errors=str(sum(r.status == "error" for r in results)),
        skipped=str(sum(r.status in ("absent", "skipped") for r in results)),
        time=f"{sum(r.seconds for r in results):.3f}",
    )
    for r in results:
        case = ET.SubElement(
            suite, "testcase", classname=f"pipemetrics.{r.function}", name=r.id,
            time=f"{r.seconds:.3f}",
        )  # fmt: skip
        if r.status == "fail":
            node = ET.SubElement(case, "failure", message=(r.message or "")[:500])
            node.text = "\n".join(x for x in (r.message, r.details, r.replay) if x)
        elif r.status == "error":
            node = ET.SubElement(case, "error", message=(r.message or "")[:500])
            node.text = "\n".join(x for x in (r.message, r.details) if x)
        elif r.status in ("absent", "skipped"):
            ET.SubElement(case, "skipped", message=r.message or r.status)
    ET.SubElement(suite, "properties").append(ET.Element("property", name="target", value=target))
    ET.ElementTree(suite).write(path, encoding="utf-8", xml_declaration=True)


def _status_text(r: PropertyResult) -> str:
    return f"{r.status} (xfail)" if r.xfail else r.status


def print_table(results: list[PropertyResult], out: TextIO) -> None:
    width = max((len(r.id) for r in results), default=10)
    out.write(f"\n{'property':<{width}}  {'status':<12} {'examples':>8} {'seconds':>8}\n")
    out.write(f"{'-' * width}  {'-' * 12} {'-' * 8} {'-' * 8}\n")
    for r in results:
        out.write(f"{r.id:<{width}}  {_status_text(r):<12} {r.examples:>8} {r.seconds:>8.1f}\n")


def _counterexample_summary(data: dict[str, Any]) -> str:
    setup = data.get("setup", {})
    world = {k: v for k, v in setup.get("world", {}).items() if v != 1 or k == "pp"}
    lines = [f"  world: {json.dumps(world)}", f"  layout: {json.dumps(setup.get('layout', {}))}"]
    if data.get("mode") == "router":
        lines.append(f"  mode: router (megatron-core's routers record), seed {data.get('seed')}")
    for i, step in enumerate(data.get("steps", [])):
        lines.append(f"  step {i} calls: {json.dumps(step.get('calls', []))}")
        records = step.get("records") or {}
        for kind in ("moe", "mtp"):
            for rank, recs in sorted((records.get(kind) or {}).items(), key=lambda x: int(x[0])):
                if kind == "moe":
                    items = [f"{r['name']}[{r['layer_number']}]={r['value']!r}" for r in recs]
                else:
                    items = [
                        f"L{r['layer_number']}: loss={r['loss']!r} correct={r['correct']!r} "
                        f"total={r['total']!r}"
                        + (
                            f" num_tokens={r['num_tokens']!r} per_token={r.get('per_token')!r}"
                            if r.get("num_tokens") is not None
                            else ""
                        )
                        for r in recs
                    ]
                text = ", ".join(items)
                if len(text) > 400:
                    text = text[:397] + "..."
                lines.append(f"  step {i} rank {rank} records {kind}: {text}")
    return "\n".join(lines)


def _indent(text: str, prefix: str = "  ") -> str:
    return "\n".join(prefix + line if line else line for line in text.splitlines())


def print_failures(results: list[PropertyResult], out: TextIO) -> None:
    for r in results:
        if r.status not in ("fail", "error"):
            continue
        out.write(
            f"\n=== {r.status.upper()}: {r.id} ({r.function}){' [xfail]' if r.xfail else ''}\n"
        )
        out.write(f"requires: {BY_ID[r.id].cites}\n" if r.id in BY_ID else "")
        out.write(f"{r.message}\n")
        if r.drawn_by is not None:
            out.write(
                f"found at example {r.found_at} of {r.drawn_by}'s scenarios (each one its own "
                "generator draws too), shrunk under that generator\n"
            )
        if r.counterexample is not None:
            out.write("minimal counterexample:\n")
            out.write(_counterexample_summary(r.counterexample) + "\n")
            if r.picture:
                out.write(_indent(r.picture) + "\n")
        if r.details:
            out.write("what each rank did:\n" + r.details + "\n")
        if r.replay:
            out.write(f"reproduce with: {r.replay}\n")


COVERAGE_COLUMNS = 3
"""Name-count cells per line of the coverage table."""
COVERAGE_WIDTH = 100
"""Where the coverage block's warnings wrap."""


def _grid(label: str, counts: dict[str, int], widths: tuple[int, int, int]) -> list[str]:
    """``counts`` as rows of `COVERAGE_COLUMNS` name-count cells, the first headed ``label``;
    ``widths``: of the label, a name and a count."""
    label_width, name_width, count_width = widths
    items = list(counts.items())
    rows = [items[i : i + COVERAGE_COLUMNS] for i in range(0, len(items), COVERAGE_COLUMNS)]
    return [
        f"  {(label if i == 0 else ''):<{label_width}}"
        + "  ".join(f"{name:<{name_width}} {count:>{count_width}}" for name, count in row)
        for i, row in enumerate(rows)
    ]


def _wrapped(text: str) -> str:
    """``text`` as a line of the coverage block, wrapped at `COVERAGE_WIDTH`."""
    return textwrap.fill(text, COVERAGE_WIDTH, initial_indent="  ", subsequent_indent="    ") + "\n"


def _warning(what: str, names: list[str]) -> str:
    return _wrapped(
        f"WARNING: {what} never generated (by the properties that ran): {', '.join(names)}"
    )


def print_coverage(coverage: dict[str, Any], out: TextIO) -> None:
    """The coverage block of the human report: a short table of the generator classes
    (``classes``) and the rare cases (`pipemetrics.properties.coverage.RARE`), each with the number of scenarios that
    had it, then what was never generated. Every count is in the JSON report (``coverage``)."""
    sizes = ", ".join(str(size) for size in coverage.get("world_sizes", [])) or "none"
    out.write(
        f"\ncoverage: {coverage.get('scenarios', 0)} scenarios, world sizes {sizes} "
        "(every count: the JSON report's coverage, --json)\n"
    )
    counts = coverage.get("counts", {})
    tables = {
        "classes": {name: int(n) for name, n in coverage.get("classes", {}).items()},
        "rare cases": {name: int(counts.get(name, 0)) for name in RARE},
    }
    cells = [item for table in tables.values() for item in table.items()]
    widths = (
        max(len(label) for label in tables) + 2,
        max(len(name) for name, _ in cells),
        max(len(str(count)) for _, count in cells),
    )
    for label, table in tables.items():
        for line in _grid(label, table, widths):
            out.write(line + "\n")
    if coverage.get("classes_never_generated"):
        out.write(_warning("generator classes", coverage["classes_never_generated"]))
    if coverage.get("never_seen"):
        out.write(_warning("rare cases", coverage["never_seen"]))
    combinations = coverage.get("combinations", {})
    ran = {name: c for name, c in combinations.items() if c.get("floor")}
    if ran:
        out.write(
            _wrapped(
                "combinations: "
                + ", ".join(f"{n} {c['count']} (floor {c['floor']})" for n, c in ran.items())
            )
        )
    if coverage.get("combinations_below_floor"):
        below = ", ".join(coverage["combinations_below_floor"])
        out.write(_wrapped(f"WARNING: combinations below their floor: {below}"))
    for note in coverage.get("notes", []):
        out.write(_wrapped(f"NOTE: {note}"))


def _fence(text: str, lang: str = "") -> str:
    ticks = "```"
    while ticks in text:
        ticks += "`"
    return f"{ticks}{lang}\n{text}\n{ticks}"


def _cell(value: object) -> str:
    return "" if value is None else str(value).replace("|", "\\|").replace("\n", " ")


def render_markdown(target: str, profile: str, results: list[PropertyResult]) -> str:
    """The report as Markdown: a verdict line, the table (id, function, status, examples,
    seconds), then per failure its message, layout picture, counterexample and replay command."""
    ok = conformant(results)
    lines = [
        "## pipemetrics conformance",
        "",
        f"**`{target}`: {'CONFORMANT' if ok else 'NOT CONFORMANT'}** ({profile} profile)",
        "",
        "| property | function | status | examples | seconds |",
        "| --- | --- | --- | ---: | ---: |",
    ]
    for r in results:
        lines.append(
            f"| `{_cell(r.id)}` | `{_cell(r.function)}` | {_cell(_status_text(r))} "
            f"| {r.examples} | {r.seconds:.1f} |"
        )
    for r in results:
        if r.status not in ("fail", "error"):
            continue
        xfail = " (xfail: expected)" if r.xfail else ""
        lines += ["", f"### `{r.id}` ({r.function}): {r.status}{xfail}", ""]
        if r.id in BY_ID:
            requires = BY_ID[r.id].cites.replace("_", "\\_")  # Markdown keeps moe/{name}_layer_{i}
            lines += [f"Requires: {requires}", ""]
        if r.message:
            lines += [_fence(r.message, "text"), ""]
        if r.picture:
            lines += ["Layout and where each rank stood:", "", _fence(r.picture, "text"), ""]
        if r.counterexample is not None:
            lines += [
                "<details><summary>minimal counterexample (scenario JSON)</summary>",
                "",
                _fence(json.dumps(r.counterexample, indent=2), "json"),
                "",
                "</details>",
                "",
            ]
        if r.replay:
            lines += ["Replay it locally:", "", _fence(r.replay, "bash"), ""]
    return "\n".join(lines).rstrip() + "\n"


def write_markdown(path: str, target: str, profile: str, results: list[PropertyResult]) -> None:
    Path(path).write_text(render_markdown(target, profile, results), encoding="utf-8")
