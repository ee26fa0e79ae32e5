"""``pipemetrics prove``: every case of a bound, run and judged, with a certificate.

Sampling (``check``) draws examples; ``prove`` enumerates. The cases and what each family of
them enumerates and fixes are in `pipemetrics.prove.families` (`FAMILIES`, `FIXED`);
a case is one scenario (`pipemetrics.prove.cases`), judged by every property of the
semantic profile its calls concern, with the judges of ``check``. A target that defines only
some of the five functions is proven on those: the cases of the others are skipped and the
certificate names the functions absent. Every case of the bound (or shard) runs; each failing
property is counted, and its smallest counterexample (its first failing case in the canonical
order of `enumerate_cases`: smallest world first, the inputs trainers meet before degenerate
ones) is written as a scenario file that ``pipemetrics replay`` runs on the process tier; shards
(``--shard K/N``: every N-th case from the K-th) merge into one certificate only when they cover
the bound exactly once (the digest of every case key), keeping each property's smallest case.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.metadata
import json
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import Field

from pipemetrics.properties.catalogue import BY_ID
from pipemetrics.prove.cases import (
    AnyCase,
    Bound,
    BroadcastCase,
    Case,
    Family,
    Fixed,
    RoundUpCase,
    TrackNamesCase,
    distinct_value,
)
from pipemetrics.prove.families import FAMILIES, FIXED, enumerate_cases
from pipemetrics.sim.model.layout import Frozen
from pipemetrics.sim.model.scenario import Scenario, replay_command, save_scenario
from pipemetrics.sim.model.target import API_FUNCTIONS, is_path_target, resolve_builtin
from pipemetrics.sim.results.summary import layout_picture
from pipemetrics.sim.worlds.pool import Tier, WorldPool


def digest(keys: list[str]) -> str:
    return hashlib.sha256("\n".join(keys).encode()).hexdigest()


def shard_of(cases: list[AnyCase], shard: tuple[int, int]) -> list[AnyCase]:
    """Shard ``K/N`` (1-based K): every N-th case from the K-th, in canonical order."""
    k, n = shard
    return cases[k - 1 :: n]


# -- the certificate ---------------------------------------------------------------------------


class Failure(Frozen):
    """A property's smallest counterexample: its first failing case in canonical order."""

    case: str
    index: int
    """The case's position in the whole bound's canonical order (`enumerate_cases`): the
    smaller, the smaller the counterexample (merging shards keeps the smallest)."""
    problems: list[str]
    """The property's problems in that case (at most 8 lines)."""
    scenario_file: str
    replay: str
    picture: str
    """The layout picture of the failing run (stages, groups, where each rank stood)."""


class PropertyFailures(Frozen):
    """One property that failed: in how many of the cases run, and its smallest case."""

    property: str
    cases: int
    smallest: Failure


class Coverage(Frozen):
    """What the bound covers, and what it leaves out: the certificate's promise in full."""

    families: list[Family]
    """Every family run, with the input classes it enumerates."""
    left_out: list[str]
    """Families of the full bound not run (`Bound.families`): nothing of theirs is proven."""
    fixed: list[Fixed]
    """Every class not enumerated, the value it is fixed to, and why."""
    absent: list[str]
    """API functions the target does not define: their cases were not run."""
    skipped: int
    """Cases of the bound not run because every function they call is absent."""

    def summary(self) -> str:
        """The one line that always goes with a verdict."""
        absent = f"; functions absent (not proven): {', '.join(self.absent)}" if self.absent else ""
        left = f"; families left out: {', '.join(self.left_out)}" if self.left_out else ""
        return (
            f"covers {sum(len(f.enumerates) for f in self.families)} input classes in "
            f"{len(self.families)} families; {len(self.fixed)} classes fixed (certificate "
            f"'coverage.fixed'){absent}{left}"
        )


def coverage_of(bound: Bound, defined: frozenset[str], skipped: int) -> Coverage:
    run = [f for f in FAMILIES if not bound.families or f.name in bound.families]
    return Coverage(families=run, fixed=list(FIXED), skipped=skipped,
                    left_out=[f.name for f in FAMILIES if f not in run],
                    absent=[name for name in API_FUNCTIONS if name not in defined])  # fmt: skip


class Certificate(Frozen):
    """What ``prove`` proved, or every property it disproved, each with its smallest case."""

    target: str
    target_sha256: str | None
    pipemetrics: str
    megatron_core: str
    torch: str
    tier: str
    bound: Bound
    shard: tuple[int, int] = (1, 1)
    cases_in_bound: int
    bound_digest: str
    """sha256 of every case key of the whole bound, in canonical order."""
    shard_digest: str
    """sha256 of this shard's case keys."""
    cases: dict[str, int]
    """Cases run, counted per class (family, pp, world size, MTP kind), and ``total``."""
    coverage: Coverage
    properties_judged: int
    seconds: float
    proven: bool
    failures: list[PropertyFailures] = Field(default_factory=list)
    """Every failing property, in the order of its smallest case."""
    failing_cases: int = 0
    """Cases in which at least one property failed."""
    stopped_early: bool = False
    """The run stopped at the first failing case (``stop_at_first``): the counts are of the
    cases up to it, not of the bound."""

    @property
    def failure(self) -> Failure | None:
        """The smallest failing case of any property."""
        return self.failures[0].smallest if self.failures else None


def target_sha256(target: str) -> str | None:
    """sha256 of the target's source file (a path, or a module's file)."""
    try:
        if is_path_target(target):
            return hashlib.sha256(Path(target).read_bytes()).hexdigest()
        import importlib.util

        spec = importlib.util.find_spec(resolve_builtin(target))
        origin = spec.origin if spec is not None else None
        return hashlib.sha256(Path(origin).read_bytes()).hexdigest() if origin else None
    except (OSError, ImportError, ValueError):
        return None


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


SENT_AHEAD = 4
"""Cases sent to their worlds before the one being run (`WorldPool.send_ahead`), at most: a
world of the in-process tier starts its next case the moment it has answered one, while this
process judges that one."""


@dataclasses.dataclass
class _Upcoming:
    """The shard's cases as the loop meets them: each case's properties and scenario built once,
    whether the loop or the sending ahead asks first."""

    todo: list[AnyCase]
    target: str
    bound: Bound
    functions: frozenset[str]
    _properties: dict[int, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    _scenarios: dict[int, Scenario] = dataclasses.field(default_factory=dict)

    def properties(self, position: int) -> tuple[str, ...]:
        if position not in self._properties:
            self._properties[position] = self.todo[position].properties(self.bound, self.functions)
        return self._properties[position]

    def scenario(self, position: int) -> Scenario:
        """The case's scenario, for the last time (nothing of the case is kept after it)."""
        self._properties.pop(position, None)
        built = self._scenarios.pop(position, None)
        return built if built is not None else self._build(position)

    def _build(self, position: int) -> Scenario:
        return self.todo[position].scenario(self.target, self.bound, self.functions)

    def after(self, position: int) -> list[Scenario]:
        """The scenarios of the next `SENT_AHEAD` cases after ``position`` that run."""
        later = []
        for upcoming in range(position + 1, min(position + 1 + SENT_AHEAD, len(self.todo))):
            if self.properties(upcoming):
                if upcoming not in self._scenarios:
                    self._scenarios[upcoming] = self._build(upcoming)
                later.append(self._scenarios[upcoming])
        return later


def prove(
    target: str,
    bound: Bound,
    *,
    shard: tuple[int, int] = (1, 1),
    tier: Tier = "inprocess",
    report_dir: Path = Path("pipemetrics-report"),
    progress: Callable[[int, int, str], None] | None = None,
    functions: frozenset[str] | None = None,
    pool: WorldPool | None = None,
    stop_at_first: bool = False,
) -> Certificate:
    """Run every case of ``shard`` of ``bound`` on ``target`` and judge it; every failing
    property is counted, and its first failing case (its smallest) written as a scenario file.

    ``functions``: the API functions the target defines (None: import it in a child process
    to find out, `pipemetrics.sim.worlds.probe.probe_target`); cases calling none of them are skipped.
    ``pool``: live worlds to run in (of ``tier``; the caller closes it), else a pool of its own.
    ``stop_at_first``: stop at the first failing case (a disproof is all the caller needs; the
    certificate says it stopped early).
    """
    if functions is None:
        from pipemetrics.sim.worlds.probe import probe_target

        functions = frozenset(probe_target(resolve_builtin(target)))
    every = enumerate_cases(bound)
    todo = shard_of(every, shard)
    began = time.monotonic()
    counts: Counter[str] = Counter()
    failing: Counter[str] = Counter()
    smallest: dict[str, Failure] = {}
    judged = skipped = failing_cases = ran = 0
    with (
        contextlib.nullcontext(pool)
        if pool is not None
        else WorldPool(max_ranks=16, tier=tier) as worlds
    ):
        upcoming = _Upcoming(todo, target, bound, functions)
        for position, case in enumerate(todo):
            ran = position + 1
            properties = upcoming.properties(position)
            if not properties:
                skipped += 1
                continue
            if progress is not None:
                progress(position, len(todo), case.key)
            scenario = upcoming.scenario(position)
            for sent in (scenario, *upcoming.after(position)):  # in order: this case first
                worlds.send_ahead(sent)
            run = worlds.run(scenario)
            problems: dict[str, list[str]] = {}
            for property_id in properties:
                found = BY_ID[property_id].judge(scenario.model_copy(
                    update={"property": property_id}), run)  # fmt: skip
                judged += 1
                if found:
                    problems[property_id] = found[:8]
            counts.update(case.classes)
            counts["total"] += 1
            if not problems:
                continue
            failing_cases += 1
            failing.update(list(problems))
            index = (shard[0] - 1) + position * shard[1]
            new = [p for p in problems if p not in smallest]
            if new:
                picture = layout_picture(scenario, run)
                for property_id in new:
                    smallest[property_id] = _failure(
                        case, index, scenario, property_id, problems[property_id], report_dir,
                        picture,
                    )  # fmt: skip
            if stop_at_first:
                break
    if progress is not None:
        progress(ran, len(todo), "stopped at the first failing case" if ran < len(todo) else "done")
    return Certificate(
        target=target,
        target_sha256=target_sha256(target),
        pipemetrics=_version("pipemetrics"),
        megatron_core=_version("megatron-core"),
        torch=_version("torch"),
        tier=tier,
        bound=bound,
        shard=shard,
        cases_in_bound=len(every),
        bound_digest=digest([c.key for c in every]),
        shard_digest=digest([c.key for c in todo]),
        cases=dict(sorted(counts.items())),
        coverage=coverage_of(bound, functions, skipped),
        properties_judged=judged,
        seconds=round(time.monotonic() - began, 3),
        proven=not smallest,
        failures=_ranked(failing, smallest),
        failing_cases=failing_cases,
        stopped_early=ran < len(todo),
    )


def _ranked(failing: Counter[str], smallest: dict[str, Failure]) -> list[PropertyFailures]:
    """Every failing property, ordered by its smallest case, then by ID."""
    return sorted(
        (PropertyFailures(property=p, cases=failing[p], smallest=f) for p, f in smallest.items()),
        key=lambda f: (f.smallest.index, f.property),
    )


def _failure(
    case: AnyCase,
    index: int,
    scenario: Scenario,
    property_id: str,
    problems: list[str],
    report_dir: Path,
    picture: str,
) -> Failure:
    report_dir.mkdir(parents=True, exist_ok=True)
    path = save_scenario(
        scenario.model_copy(update={"property": property_id}),
        report_dir / f"prove-{property_id}.json",
    )
    return Failure(
        case=case.key, index=index, problems=problems, scenario_file=str(path),
        replay=replay_command(path, scenario.target), picture=picture,
    )  # fmt: skip


class MergeError(ValueError):
    """Certificates that do not cover one bound exactly once; the message says how."""


def merge(certificates: list[Certificate]) -> Certificate:
    """One certificate from the shards of a bound: same target, versions and bound, shards 1..N
    each exactly once, and together exactly the bound's cases."""
    if not certificates:
        raise MergeError("no certificates to merge")
    first = certificates[0]
    dumped = [c.model_dump(mode="json") for c in certificates]
    for field in ("target", "target_sha256", "pipemetrics", "megatron_core", "torch", "bound"):
        values = {json.dumps(d[field], sort_keys=True) for d in dumped}
        if len(values) > 1:
            raise MergeError(f"{field}: the certificates differ ({sorted(values)})")
    n = first.shard[1]
    seen = Counter(c.shard for c in certificates)
    problems = [f"shard {k}/{n} appears {seen[(k, n)]} times" for k in range(1, n + 1)
                if seen[(k, n)] != 1]  # fmt: skip
    problems += [f"shard {k}/{m} is of another split" for k, m in seen if m != n]
    if problems:
        raise MergeError("the shards do not cover the bound exactly once: " + "; ".join(problems))
    every = enumerate_cases(first.bound)
    if digest([c.key for c in every]) != first.bound_digest:
        raise MergeError("bound_digest: this pipemetrics enumerates another set of cases")
    for cert in certificates:
        expected = digest([c.key for c in shard_of(every, cert.shard)])
        if cert.shard_digest != expected:
            raise MergeError(f"shard {cert.shard[0]}/{n}: its cases are not this bound's shard")
        ran = cert.cases.get("total", 0) + cert.coverage.skipped
        if not cert.stopped_early and ran != len(shard_of(every, cert.shard)):
            raise MergeError(f"shard {cert.shard[0]}/{n}: ran {cert.cases.get('total')} cases")
        if cert.coverage.absent != first.coverage.absent:
            raise MergeError(f"shard {cert.shard[0]}/{n}: the target's functions differ")
    counts: Counter[str] = Counter()
    failing: Counter[str] = Counter()
    smallest: dict[str, Failure] = {}
    for cert in certificates:
        counts.update(cert.cases)
        for entry in cert.failures:
            failing[entry.property] += entry.cases
            held = smallest.get(entry.property)
            if held is None or entry.smallest.index < held.index:
                smallest[entry.property] = entry.smallest
    return first.model_copy(
        update={
            "shard": (1, 1),
            "shard_digest": first.bound_digest,
            "cases": dict(sorted(counts.items())),
            "coverage": first.coverage.model_copy(
                update={"skipped": sum(c.coverage.skipped for c in certificates)}
            ),
            "properties_judged": sum(c.properties_judged for c in certificates),
            "seconds": round(sum(c.seconds for c in certificates), 3),
            "proven": all(c.proven for c in certificates),
            "failures": _ranked(failing, smallest),
            "failing_cases": sum(c.failing_cases for c in certificates),
            "stopped_early": any(c.stopped_early for c in certificates),
        }
    )


def progress_bar(stream: Any = sys.stderr, unit: str = "cases") -> Callable[[int, int, str], None]:
    """A one-line progress bar on ``stream`` (a new line per 5% when it is not a terminal)."""
    last = [-1]
    tty = bool(getattr(stream, "isatty", lambda: False)())

    def show(done: int, total: int, key: str) -> None:
        percent = 100 * done // max(total, 1)
        final = done == total or key.startswith("stopped")
        if tty:
            bar = "#" * (percent // 4)
            stream.write(f"\r[{bar:<25}] {done}/{total} {key[:60]:<60}")
            if final:
                stream.write("\n")
        elif percent // 5 != last[0] // 5 or final:
            note = f", {key}" if key.startswith("stopped") else ""
            stream.write(f"prove: {done}/{total} {unit} ({percent}%){note}\n")
        last[0] = percent
        stream.flush()

    return show


__all__ = [
    "AnyCase",
    "Bound",
    "BroadcastCase",
    "Case",
    "Certificate",
    "Coverage",
    "Failure",
    "MergeError",
    "PropertyFailures",
    "RoundUpCase",
    "TrackNamesCase",
    "distinct_value",
    "enumerate_cases",
    "merge",
    "progress_bar",
    "prove",
    "shard_of",
]
