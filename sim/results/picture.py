"""A plain-text picture of a world's layout and of where each rank stood when an outcome came.

`layout_picture` draws three blocks, every line at most `MAX_WIDTH` columns and without colour
codes, so it reads the same in a terminal, a log file and a Markdown ``text`` block:

* the pipeline stages by layers, one row per stage (``D3`` a dense main layer numbered 3, ``M4``
  a MoE layer, ``T1``/``t1`` MTP layer 1 with/without MoE), with the ranks of each stage;
* each rank's coordinates and the members of the groups the metric helpers reduce over
  (``pp``, ``dp``, ``tp_cp``, ``tp_dp_cp``);
* with an outcome: each rank's state at that moment, a pending collective (op, group role,
  signature) with its call site, or ``returned``, ``running``, ``died (exit code N)``; with the
  ranks' own lines of the target (`pipemetrics.sim.collectives.own_lines`), the line of the
  target's files it entered the collective from, raised at or returned from.

It needs no processes: places may come from a finished run (``RankResult.place``) or from
`pipemetrics.sim.model.topology.places_for`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import TYPE_CHECKING

from pipemetrics.sim.collectives.coordinator import Outcome, group_roles
from pipemetrics.sim.collectives.own_lines import TargetLine, target_lines
from pipemetrics.sim.collectives.protocol import CollectiveCall
from pipemetrics.sim.model.layout import Setup
from pipemetrics.sim.model.records import RankPlace
from pipemetrics.sim.model.topology import places_for

if TYPE_CHECKING:
    from pipemetrics.sim.worlds.world import WorldRun

MAX_WIDTH = 100
GROUP_COLUMNS: tuple[str, ...] = ("pp", "dp", "tp_cp", "tp_dp_cp")
"""The groups shown per rank: the ones the MoE and MTP trackers reduce over."""
LEGEND = "D dense, M MoE, T MTP with MoE, t MTP dense; the number is the layer"
_MAX_CELL = 18
_SITE_PACKAGES = re.compile(r"^.*?[/\\](?:site|dist)-packages[/\\]")


def member_list(ranks: tuple[int, ...] | list[int]) -> str:
    """``0-3``, ``0,4``, ``0-2,5``: ascending ranks with consecutive runs collapsed."""
    values = sorted(set(ranks))
    if not values:
        return "-"
    parts: list[str] = []
    start = prev = values[0]
    for value in [*values[1:], None]:
        if value is not None and value == prev + 1:
            prev = value
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if value is not None:
            start = prev = value
    return ",".join(parts)


def short_site(site: str) -> str:
    """A call site without the interpreter's install prefix (``megatron/core/...:277 in f``)."""
    return _SITE_PACKAGES.sub("", site)


def _clip(text: str, width: int = MAX_WIDTH) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


_SITE_WIDTH = MAX_WIDTH - 24
"""Room for a call site on its line (after the rank column's indent and ``at ``)."""


def _clip_site(site: str, width: int = _SITE_WIDTH) -> str:
    """A call site that fits in ``width``, clipped on the left: the file name, line and
    function are the end of it (a path target's long absolute path would otherwise leave only
    its directories once the line is clipped)."""
    return site if len(site) <= width else "..." + site[len(site) - width + 3 :]


def _chunk_cells(setup: Setup, stage: int, chunk: int) -> list[tuple[str, int]]:
    """(kind letter, layer number) for every layer of one chunk of ``stage``, MTP layers last."""
    numbers = setup.stage_chunks[stage][chunk]
    cells = [("M" if setup.layout.is_moe_layer(n) else "D", n) for n in numbers]
    if chunk == setup.vpp - 1:
        mtp = "T" if setup.layout.mtp_is_moe else "t"
        cells += [(mtp, k) for k in setup.mtp_layers_on_stage(stage)]
    return cells


def _stage_layers(setup: Setup, stage: int, width: int) -> str:
    """The layers of ``stage``; with virtual pipeline chunks, ``chunk / chunk``; a flexible
    layout's embedding-only or loss-only place is marked ``E`` / ``L``."""
    flexible = setup.pipeline_layout
    texts = []
    for chunk in range(setup.vpp):
        text = _stage_text(_chunk_cells(setup, stage, chunk), width)
        if flexible is not None:
            layers = flexible.grid[stage][chunk]
            if not any(c in layers for c in "tm"):
                text = " ".join(c for c in layers) or "(empty)"
            else:
                text = ("E " if "E" in layers else "") + text + (" L" if "L" in layers else "")
        texts.append(text)
    return " / ".join(texts)


def _stage_text(cells: list[tuple[str, int]], width: int) -> str:
    """``D1 D2 M3`` when it fits in ``width``, else runs: ``D1-2 M3-40 T1``."""
    if not cells:
        return "(no layers)"
    plain = " ".join(f"{kind}{n}" for kind, n in cells)
    if len(plain) <= width:
        return plain
    runs: list[tuple[str, int, int]] = []
    for kind, n in cells:
        if runs and runs[-1][0] == kind and runs[-1][2] == n - 1:
            runs[-1] = (kind, runs[-1][1], n)
        else:
            runs.append((kind, n, n))
    return " ".join(f"{k}{a}" if a == b else f"{k}{a}-{b}" for k, a, b in runs)


def _stage_rows(setup: Setup, places: dict[int, RankPlace]) -> list[str]:
    pp = setup.world.pp
    stage_width = max(24, MAX_WIDTH - 48)
    texts = [_clip(_stage_layers(setup, s, stage_width), stage_width) for s in range(pp)]
    pad = max(len(t) for t in texts)
    label = len(str(pp - 1))
    rows = []
    for stage, text in enumerate(texts):
        ranks = [r for r, p in sorted(places.items()) if p.pp_rank == stage]
        note = "" if setup.records_moe(stage) else " (no MoE router)"
        rows.append(f"  stage {stage:>{label}} | {text:<{pad}} | ranks {member_list(ranks)}{note}")
    return rows


def _group_rows(places: dict[int, RankPlace]) -> list[str]:
    header = ["rank", "pp", "tp", "cp", "dp", *GROUP_COLUMNS]
    rows = [
        [
            str(rank),
            str(place.pp_rank),
            str(place.tp_rank),
            str(place.cp_rank),
            str(place.dp_rank),
            *(_clip(member_list(place.groups.get(g, ())), _MAX_CELL) for g in GROUP_COLUMNS),
        ]
        for rank, place in sorted(places.items())
    ]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        coords = " ".join(f"{c:>{w}}" for c, w in zip(cells[:5], widths[:5], strict=True))
        groups = "  ".join(f"{c:<{w}}" for c, w in zip(cells[5:], widths[5:], strict=True))
        return f"  {coords} | {groups}".rstrip()

    return [line(header), *(line(row) for row in rows)]


def _pending_lines(
    call: CollectiveCall, place: RankPlace | None, own: TargetLine | None = None
) -> list[str]:
    roles = group_roles(call.group_ranks, place)
    head = (
        f"blocked in {call.op} #{call.index} on {roles} [{member_list(call.group_ranks)}] "
        f"(pg {call.group_name})"
    )
    lines = [head]
    if call.signature:
        lines.append(", ".join(f"{k}={v}" for k, v in call.signature))
    site = short_site(call.call_site[0]) if call.call_site else "unknown call site"
    lines.append(f"at {_clip_site(site)}")
    target = own.site if own is not None else call.target_site
    if target is not None and (not call.call_site or target != call.call_site[0]):
        lines.append(f"from {_clip_site(short_site(target), _SITE_WIDTH - 2)}")
    return lines


def _finished_lines(own: TargetLine | None) -> list[str]:
    """``returned`` (from the target's line), or ``raised T`` (at the target's line)."""
    if own is None or own.state not in ("returned", "raised"):
        return ["returned"]
    head = "returned from" if own.state == "returned" else f"raised {own.what} at"
    if own.site is None:
        return [head.rsplit(" ", 1)[0]]
    site = short_site(own.site)
    if len(head) + 1 + len(site) <= MAX_WIDTH - 12:  # after the rank column
        return [f"{head} {site}"]
    return [head, _clip_site(site)]


def _seen_lines(own: TargetLine | None) -> list[str]:
    """A dead or running rank's own line of the target: ``at`` its site (``os._exit(3)``,
    ``SIGSEGV``), or nothing where none is known (the write-up's block says why)."""
    if own is None or own.site is None:
        return []
    return [f"at {_clip_site(short_site(own.site), _SITE_WIDTH - 2)}"]


def _state_lines(
    outcome: Outcome, rank: int, place: RankPlace | None, own: TargetLine | None = None
) -> list[str]:
    if rank in outcome.pending:
        return _pending_lines(outcome.pending[rank], place, own)
    if rank in outcome.crashed:
        code = outcome.crashed[rank]
        head = f"died (exit code {code})" if code is not None else "died (unknown exit code)"
        return [head, *_seen_lines(own)]
    if rank in outcome.finished:
        return _finished_lines(own)
    if rank in outcome.running:
        if outcome.kind == "timeout":
            return ["running (never reached a collective or returned)", *_seen_lines(own)]
        return ["running"]
    return ["unknown"]


def _outcome_rows(
    outcome: Outcome, places: dict[int, RankPlace], own: Mapping[int, TargetLine]
) -> list[str]:
    ranks = sorted(
        set(places)
        | set(outcome.pending)
        | set(outcome.finished)
        | set(outcome.running)
        | set(outcome.crashed)
    )
    label = max(len(str(r)) for r in ranks) if ranks else 1
    rows = [f"where each rank stood when the world ended ({outcome.kind}):"]
    for rank in ranks:
        first, *rest = _state_lines(outcome, rank, places.get(rank), own.get(rank))
        head = f"  rank {rank:>{label}}  "
        rows.append(head + first)
        rows += [" " * (len(head) + 2) + text for text in rest]
    return rows


def layout_picture(
    setup: Setup,
    places: dict[int, RankPlace],
    outcome: Outcome | None = None,
    own: Mapping[int, TargetLine] | None = None,
) -> str:
    """The stages by layers, each rank's groups and, with ``outcome``, where each rank stood
    (with ``own``, the ranks' own lines of the target).

    Plain text, no line longer than `MAX_WIDTH`.
    """
    world, layout = setup.world, setup.layout
    mtp = f" + {layout.mtp_num_layers} MTP" if layout.mtp_num_layers else ""
    flexible = setup.pipeline_layout
    lines = [
        f"model: {layout.num_layers} layers{mtp} over pp {world.pp} (tp {world.tp}, "
        f"cp {world.cp}, dp {world.dp}, ep {world.ep}; {world.world_size} ranks, "
        f"{world.backend})",
    ]
    if flexible is not None:
        chunks = ", / between chunks" if flexible.vpp > 1 else ""
        lines.append(
            f"pipeline_model_parallel_layout {flexible.text!r} "
            f"(vpp {flexible.vpp}; E embedding, L loss{chunks})"
        )
    lines += [
        f"stages ({LEGEND}):",
        *_stage_rows(setup, places),
        "ranks (coordinates | members of the groups the metrics reduce over):",
        *_group_rows(places),
    ]
    if outcome is not None:
        lines += _outcome_rows(outcome, places, own or {})
    return "\n".join(_clip(line) for line in lines)


def run_picture(setup: Setup, run: WorldRun) -> str:
    """`layout_picture` of a finished run: the places its ranks reported, its outcome and the
    ranks' own lines of the target.

    Ranks that never reported a place (a world that could not start) are computed with
    `places_for`.
    """
    places = places_for(setup.world)
    places.update({rank: result.place for rank, result in run.ranks.items()})
    return layout_picture(setup, places, run.outcome, run_target_lines(run))


def run_target_lines(run: WorldRun) -> dict[int, TargetLine]:
    """`pipemetrics.sim.collectives.own_lines.target_lines` of a finished run."""
    return target_lines(run.outcome, {rank: result.done for rank, result in run.ranks.items()})
