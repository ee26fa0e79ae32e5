"""``pipemetrics prove``: every case of a bound, run and judged, with a certificate.

Sampling (``check``) draws examples; ``prove`` enumerates. The cases and what each family of
them enumerates and fixes are in `pipemetrics.prove.families` (`FAMILIES`, `FIXED`);
a case is one scenario (`pipemetrics.prove.cases`), judged by every property of the
semantic profile its calls concern, with the judges of ``check``. A target that defines only
some of the five functions is proven on those: the cases of the others are skipped and the
certificate names the functions absent. The first failing case (cases run smallest world first)
is written as a scenario file that ``pipemetrics replay`` runs on the process tier; shards
(``--shard K/N``: every N-th case from the K-th) merge into one certificate only when they cover
the bound exactly once (the digest of every case key).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

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
from pipemetrics.sim.model.scenario import Scenario, save_scenario
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
    case: str
    properties: dict[str, list[str]]
    """Each failing property's problems (at most 8 lines each)."""
    scenario_file: str
    replay: str
    picture: str
    """The layout picture of the failing run (stages, groups, where each rank stood)."""


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
    """What ``prove`` proved, or the first case that disproved it."""

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
    failure: Failure | None = None


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
) -> Certificate:
    """Run every case of ``shard`` of ``bound`` on ``target``; stop at the first failing case.

    ``functions``: the API functions the target defines (None: import it in a child process
    to find out, `pipemetrics.sim.worlds.probe.probe_target`); cases calling none of them are skipped.
    ``pool``: live worlds to run in (of ``tier``; the caller closes it), else a pool of its own.
    """
    if functions is None:
        from pipemetrics.sim.worlds.probe import probe_target

        functions = frozenset(probe_target(resolve_builtin(target)))
    every = enumerate_cases(bound)
    todo = shard_of(every, shard)
    began = time.monotonic()
    counts: Counter[str] = Counter()
    judged = skipped = 0
    failure: Failure | None = None
    with (
        contextlib.nullcontext(pool)
        if pool is not None
        else WorldPool(max_ranks=16, tier=tier) as worlds
    ):
        for index, case in enumerate(todo):
            properties = case.properties(bound, functions)
            if not properties:
                skipped += 1
                continue
            if progress is not None:
                progress(index, len(todo), case.key)
            scenario = case.scenario(target, bound, functions)
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
            if problems:
                failure = _failure(case, scenario, problems, report_dir, layout_picture(
                    scenario, run))  # fmt: skip
                break
    if progress is not None:
        progress(len(todo), len(todo), "done")
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
        proven=failure is None,
        failure=failure,
    )


def _failure(
    case: AnyCase,
    scenario: Scenario,
    problems: dict[str, list[str]],
    report_dir: Path,
    picture: str,
) -> Failure:
    report_dir.mkdir(parents=True, exist_ok=True)
    first = next(iter(problems))
    path = save_scenario(
        scenario.model_copy(update={"property": first}), report_dir / "prove-failure.json"
    )
    return Failure(
        case=case.key, properties=problems, scenario_file=str(path),
        replay=f"pipemetrics replay {path}", picture=picture,
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
        if cert.proven and ran != len(shard_of(every, cert.shard)):
            raise MergeError(f"shard {cert.shard[0]}/{n}: ran {cert.cases.get('total')} cases")
        if cert.coverage.absent != first.coverage.absent:
            raise MergeError(f"shard {cert.shard[0]}/{n}: the target's functions differ")
    counts: Counter[str] = Counter()
    for cert in certificates:
        counts.update(cert.cases)
    failures = [c.failure for c in certificates if c.failure is not None]
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
            "failure": failures[0] if failures else None,
        }
    )


def progress_bar(stream: Any = sys.stderr, unit: str = "cases") -> Callable[[int, int, str], None]:
    """A one-line progress bar on ``stream`` (a new line per 5% when it is not a terminal)."""
    last = [-1]
    tty = bool(getattr(stream, "isatty", lambda: False)())

    def show(done: int, total: int, key: str) -> None:
        percent = 100 * done // max(total, 1)
        if tty:
            bar = "#" * (percent // 4)
            stream.write(f"\r[{bar:<25}] {done}/{total} {key[:60]:<60}")
            if done == total:
                stream.write("\n")
        elif percent // 5 != last[0] // 5 or done == total:
            stream.write(f"prove: {done}/{total} {unit} ({percent}%)\n")
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
    "MergeError",
    "RoundUpCase",
    "TrackNamesCase",
    "distinct_value",
    "enumerate_cases",
    "merge",
    "progress_bar",
    "prove",
    "shard_of",
]
