#!/usr/bin/env python3
"""Render a ``pipemetrics check --json`` report as Markdown (for ``$GITHUB_STEP_SUMMARY``).

    python render_summary.py pipemetrics.json [--title TEXT] >> "$GITHUB_STEP_SUMMARY"

Standard library only, so it runs with any Python 3.10+ before or without pipemetrics installed.
The action uses it when the installed ``pipemetrics check`` has no ``--markdown`` option.
Output: a verdict line, a table of id / status / examples / seconds, then per failing property
its message, the layout picture (when the counterexample carries one under ``"picture"``: stages
by layers, each rank's groups, where each rank stood), the minimal counterexample (a JSON code
block) and the replay command.
"""

from __future__ import annotations

import argparse
import json
import sys

_ICON = {"pass": "✅", "fail": "❌", "error": "💥", "absent": "⚪", "skipped": "⏭️"}


def _cell(value: object) -> str:
    return "" if value is None else str(value).replace("|", "\\|").replace("\n", " ")


def _fence(text: str, lang: str = "") -> str:
    ticks = "```"
    while ticks in text:
        ticks += "`"
    return f"{ticks}{lang}\n{text}\n{ticks}"


def render(report: dict, title: str) -> str:
    props = report.get("properties", [])
    conformant = report.get("conformant")
    verdict = "CONFORMANT" if conformant else "NOT CONFORMANT"
    lines = [
        f"## {title}",
        "",
        f"**{'✅' if conformant else '❌'} `{report.get('target')}`: {verdict}** "
        f"({report.get('profile', 'seed')} profile)",
        "",
        "| property | status | examples | seconds |",
        "| --- | --- | ---: | ---: |",
    ]
    for p in props:
        status = p.get("status")
        shown_status = f"{status} (xfail)" if p.get("xfail") else status
        seconds = p.get("seconds")
        shown = f"{seconds:.1f}" if isinstance(seconds, int | float) else _cell(seconds)
        lines.append(
            f"| `{_cell(p.get('id'))}` | {_ICON.get(status, '')} {_cell(shown_status)} "
            f"| {_cell(p.get('examples'))} | {shown} |"
        )
    failures = [p for p in props if p.get("status") in ("fail", "error")]
    for p in failures:
        xfail = " (xfail: expected)" if p.get("xfail") else ""
        lines += ["", f"### ❌ `{p.get('id')}` ({p.get('function')}): {p.get('status')}{xfail}", ""]
        if p.get("message"):
            lines += [_fence(str(p["message"])), ""]
        counterexample = p.get("counterexample")
        picture = None
        if isinstance(counterexample, dict) and "picture" in counterexample:
            counterexample = dict(counterexample)
            picture = counterexample.pop("picture")
        if picture:
            lines += ["Layout and where each rank stood:", "", _fence(str(picture), "text"), ""]
        if counterexample is not None:
            lines += [
                "<details open><summary>minimal counterexample</summary>",
                "",
                _fence(json.dumps(counterexample, indent=2, sort_keys=False), "json"),
                "",
                "</details>",
                "",
            ]
        if p.get("replay"):
            lines += ["Replay it locally:", "", _fence(str(p["replay"]), "bash"), ""]
    coverage = report.get("coverage") or {}
    never = coverage.get("never_seen") or []
    if never:
        lines += ["", f"Layouts never generated in this run: {', '.join(never)}"]
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report", help="the JSON file written by pipemetrics check --json")
    parser.add_argument("--title", default="pipemetrics conformance")
    args = parser.parse_args(argv)
    try:
        with open(args.report, encoding="utf-8") as handle:
            report = json.load(handle)
    except (OSError, ValueError) as exc:
        print(f"## {args.title}\n\n❌ no report: {exc}\n")
        return 0
    sys.stdout.write(render(report, args.title))
    return 0


if __name__ == "__main__":
    sys.exit(main())
