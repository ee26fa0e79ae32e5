"""``pipemetrics prove --ray``: the shards of a bound as tasks on an existing Ray cluster.

Trainers built on Megatron already run on Ray clusters (verl, NeMo-RL, ROLL, slime), so a bound
too large for one machine goes there as plain Ray tasks: one task per shard (a child
``pipemetrics prove --shard K/N`` process on the worker, the same deterministic partition as
``--shard``), the results merged by
`merge`, which checks that the shards cover the bound exactly once. pipemetrics schedules
nothing itself: Ray places the tasks, retries nothing (a lost task is an error of the run, not
a hole in the certificate) and the driver waits for all of them.

The workers need pipemetrics, torch and megatron-core installed (the cluster's environment),
and the target loadable by the name given: an installed module, or a path every worker sees (a
shared filesystem). A worker whose copy of the target differs from the driver's (another
sha256) refuses to run it. A failing shard's scenario files (one per failing property) are
sent back and written into the driver's report directory, so ``pipemetrics replay`` works where
the command was run.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipemetrics.commands.argv import child_command, command_args
from pipemetrics.commands.prove_options import COMMAND, bound_options
from pipemetrics.prove.prover import Bound, Certificate, merge, target_sha256
from pipemetrics.sim.model.scenario import replay_command
from pipemetrics.sim.worlds.pool import Tier

RAY_EXTRA = "pip install 'pipemetrics[ray]'"


class RayRunError(RuntimeError):
    """Ray is missing, unreachable, or a shard's task failed; the message says which."""


def run_shard(
    target: str, sha256: str | None, bound_json: str, shard: tuple[int, int], tier: Tier
) -> tuple[str, dict[str, str]]:
    """One shard on this worker: its certificate as JSON, and the scenario file (its text) of
    each failing property's smallest case, by property.

    The shard runs as ``pipemetrics prove --shard K/N`` in a child process with a private
    TMPDIR, removed afterwards: a Ray worker is long-lived and ends by being killed, so nothing
    of the worlds (fork server, sockets, Megatron's globals) may live in the worker itself."""
    here = target_sha256(target)
    if here != sha256:
        raise RayRunError(
            f"target {target!r} on worker {socket.gethostname()} has sha256 {here}, the "
            f"driver's has {sha256}: install the same target on every worker (or use a path "
            "on a shared filesystem)"
        )
    bound = Bound.model_validate_json(bound_json)
    k, n = shard
    with tempfile.TemporaryDirectory(prefix="pm-shard-") as scratch:
        out = Path(scratch) / "certificate.json"
        args = command_args(
            COMMAND, impl=target, **bound_options(bound), shard=f"{k}/{n}", tier=tier,
            json_out=str(out), report_dir=str(Path(scratch) / "report"),
        )  # fmt: skip
        command = child_command(COMMAND, args)
        done = subprocess.run(
            command, env={**os.environ, "TMPDIR": scratch}, capture_output=True, text=True,
            check=False,
        )  # fmt: skip
        if done.returncode not in (0, 1) or not out.is_file():
            raise RayRunError(
                f"shard {k}/{n} on worker {socket.gethostname()}: `pipemetrics prove` exited "
                f"{done.returncode}:\n{(done.stdout + done.stderr)[-4000:]}"
            )
        cert = Certificate.model_validate_json(out.read_text(encoding="utf-8"))
        if cert.bound != bound:
            raise RayRunError(f"shard {k}/{n}: ran bound {cert.bound}, asked for {bound}")
        scenarios = {
            entry.property: Path(entry.smallest.scenario_file).read_text(encoding="utf-8")
            for entry in cert.failures
        }
        return cert.model_dump_json(), scenarios


def _ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise RayRunError(f"--ray needs Ray, which is not installed ({exc}): {RAY_EXTRA}") from exc
    return ray


def prove_on_ray(
    target: str,
    bound: Bound,
    shards: int | None,
    *,
    address: str,
    tier: Tier = "inprocess",
    report_dir: Path = Path("pipemetrics-report"),
    progress: Callable[[int, int, str], None] | None = None,
    init_options: dict[str, Any] | None = None,
) -> Certificate:
    """Run the ``shards`` shards of ``bound`` as Ray tasks and merge their certificates.

    ``address`` goes to ``ray.init`` ("auto": the cluster this machine belongs to; "local": a
    Ray instance of this process, shut down at the end; "ray://head:10001": a remote cluster).
    When Ray is already initialised in this process its connection is used and left open.
    ``shards`` None: one per CPU of the cluster."""
    if shards is not None and shards < 1:
        raise ValueError(f"--shards: at least 1, got {shards}")
    ray = _ray()
    connected_here = not ray.is_initialized()
    options = dict(init_options or {})
    scratch: Path | None = None
    if connected_here and address == "local":  # a private instance: its files go with it
        scratch = Path(tempfile.mkdtemp(prefix="pmray-"))
        options = {
            "include_dashboard": False, "log_to_driver": False, "_temp_dir": str(scratch),
            **options,
        }  # fmt: skip
    try:
        if connected_here:
            try:
                ray.init(address=address, **options)
            except (ConnectionError, RuntimeError, ValueError) as exc:
                raise RayRunError(f"--ray {address}: cannot connect to Ray: {exc}") from exc
        return _run_shards(ray, target, bound, shards, tier, report_dir, progress)
    finally:
        if connected_here:
            ray.shutdown()
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)


def _run_shards(
    ray: Any,
    target: str,
    bound: Bound,
    shards: int | None,
    tier: Tier,
    report_dir: Path,
    progress: Callable[[int, int, str], None] | None,
) -> Certificate:
    """Submit every shard, wait for all, merge."""
    if shards is None:
        shards = max(1, int(ray.cluster_resources().get("CPU", 1)))
    task = ray.remote(num_cpus=1, max_retries=0)(run_shard)
    sha = target_sha256(target)
    pending = {
        task.remote(target, sha, bound.model_dump_json(), (k, shards), tier): k
        for k in range(1, shards + 1)
    }
    results: dict[int, tuple[str, dict[str, str]]] = {}
    while pending:
        if progress is not None:
            progress(len(results), shards, f"{len(pending)} shards running on Ray")
        ready, _ = ray.wait(list(pending), num_returns=1)
        k = pending.pop(ready[0])
        try:
            results[k] = ray.get(ready[0])
        except Exception as exc:  # a task's error arrives wrapped by Ray
            for ref in pending:
                ray.cancel(ref, force=True)
            raise RayRunError(f"shard {k}/{shards} failed on Ray: {exc}") from exc
    if progress is not None:
        progress(shards, shards, "done")
    return merge([_certificate(*results[k], report_dir) for k in sorted(results)])


def _certificate(cert_json: str, scenarios: dict[str, str], report_dir: Path) -> Certificate:
    """A shard's certificate, each failing property's scenario written into ``report_dir``."""
    cert = Certificate.model_validate_json(cert_json)
    if not cert.failures:
        return cert
    report_dir.mkdir(parents=True, exist_ok=True)
    k, n = cert.shard
    failures = []
    for entry in cert.failures:
        path = (report_dir / f"prove-{entry.property}-shard-{k}-of-{n}.json").resolve()
        path.write_text(scenarios[entry.property], encoding="utf-8")
        moved = entry.smallest.model_copy(
            update={"scenario_file": str(path), "replay": replay_command(path, cert.target)}
        )
        failures.append(entry.model_copy(update={"smallest": moved}))
    return cert.model_copy(update={"failures": failures})


__all__ = ["RAY_EXTRA", "RayRunError", "prove_on_ray", "run_shard"]
