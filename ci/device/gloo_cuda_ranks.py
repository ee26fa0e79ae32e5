"""The reference multi-rank with CUDA tensors over gloo, on one GPU (prepared; no CI runs it).

NCCL refuses two ranks on one device, but gloo carries CUDA tensors between several ranks on
one GPU. This starts worlds of 2 and 4 ranks (pp 2 x dp 1, pp 2 x dp 2; gloo over a FileStore),
every rank on ``cuda:0``; megatron-core's ``initialize_model_parallel`` makes the groups. Per
world, on every rank:

* the MoE tracker filled with CUDA tensors on the MoE stage only (stage 0 has no MoE layer),
  then the reference's ``get_moe_metrics`` with pre-initialisation: every rank returns the same
  dict, equal to the same run on CPU tensors (the reference creates the missing entries on the
  recording ranks' device, so the pipeline all_reduce meets tensors of one device type);
* the MTP tracker filled with CUDA tensors on the last stage, ``get_mtp_metrics``: the same on
  every rank of the last stage, equal to the CPU run;
* ``broadcast_tensor`` of a CUDA source (non-contiguous too) from the first and the last rank:
  every rank gets the source's values; a receiver buffer of the wrong shape on one rank makes
  every rank raise ``ValueError`` (its device checks run before any data moves).

    python ci/device/gloo_cuda_ranks.py reference/megatron_common.py            # on a GPU
    python ci/device/gloo_cuda_ranks.py reference/megatron_common.py --dry-run  # CPU tensors

Without CUDA (and without ``--dry-run``) it prints why and exits 0 having checked nothing.
``--dry-run`` runs the same code on CPU tensors, so the logic is exercised anywhere (by hand:
no test runs it). Prints one line per check and ``N passed, N failed``; exits 1 on a failure.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import tempfile
import traceback
from typing import Any

from common import load, report  # ci/device/common.py, beside this script

WORLDS = ((2, 1), (2, 2))
"""(pp, dp) of each world: 2 and 4 ranks."""
TIMEOUT_S = 120.0
"""Bound on one world (start, every check, teardown)."""


def moe_step(reference: Any, ps: Any, device: str) -> dict[str, float]:
    import torch
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    tracker = get_moe_metrics_tracker()
    if ps.get_pipeline_model_parallel_rank() == 1:  # the MoE stage: layer 2 of 2
        dp = ps.get_data_parallel_rank()
        tracker.record("load_balancing_loss", torch.tensor(0.5 + dp, device=device), 2, 2,
                       reduce_group=ps.get_tensor_and_context_parallel_group())  # fmt: skip
        tracker.record("z_loss", torch.tensor(0.25 * (dp + 1), device=device), 2, 2,
                       avg_group=ps.get_tensor_and_data_parallel_group(with_context_parallel=True))  # fmt: skip
    got = reference.get_moe_metrics(1.0, {}, True, 2, None, ["z_loss", "load_balancing_loss"])
    return {k: float(v) for k, v in got.items()}


def mtp_step(reference: Any, ps: Any, device: str) -> dict[str, float]:
    import torch
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    if ps.get_pipeline_model_parallel_rank() == 1:
        group = ps.get_data_parallel_group(with_context_parallel=True)
        MTPLossLoggingHelper.save_metrics_to_tracker(
            torch.tensor(0.75, device=device), torch.tensor(3.0, device=device),
            torch.tensor(4.0, device=device), 0, 1, avg_group=group,
        )  # fmt: skip
    got = reference.get_mtp_metrics(0.5)
    return {k: float(v) for k, v in got.items()}


def broadcast_step(reference: Any, device: str, src: int) -> list[float]:
    import torch
    import torch.distributed as dist

    source = torch.arange(6, dtype=torch.float32, device=device).reshape(2, 3).t()
    mine = source if dist.get_rank() == src else None
    got = reference.broadcast_tensor(mine, src, dist.group.WORLD)
    assert got.device.type == torch.device(device).type, (got.device, device)
    return [float(x) for x in got.cpu().flatten()]


def bad_buffer_step(reference: Any, device: str) -> str:
    """A wrong-shaped receiver buffer on the last rank: every rank must raise ValueError."""
    import torch
    import torch.distributed as dist

    rank, last = dist.get_rank(), dist.get_world_size() - 1
    tensor = torch.ones(3, device=device) if rank in (0, last) else None
    if rank == last:
        tensor = torch.ones(4, device=device)
    try:
        reference.broadcast_tensor(tensor, 0, dist.group.WORLD)
    except ValueError as exc:
        return f"ValueError: {exc}"
    return "no error"


def rank_main(rank: int, pp: int, dp: int, store: str, path: str, dry_run: bool, out: Any) -> None:
    """One rank: both devices' runs (CPU only with ``dry_run``), results sent to ``out``."""
    try:
        import torch
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        devices = ["cpu"] if dry_run else ["cpu", "cuda:0"]
        if dry_run:  # megatron-core's MTP tracker allocates on torch.cuda.current_device()
            torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
        else:
            torch.cuda.set_device(0)
        reference = load(path)
        dist.init_process_group("gloo", store=dist.FileStore(store, pp * dp), rank=rank,
                                world_size=pp * dp)  # fmt: skip
        ps.initialize_model_parallel(pipeline_model_parallel_size=pp)
        results: dict[str, Any] = {}
        try:
            for device in devices:
                kind = device.split(":")[0]
                results[f"moe {kind}"] = moe_step(reference, ps, device)
                results[f"mtp {kind}"] = mtp_step(reference, ps, device)
                for src in (0, pp * dp - 1):
                    results[f"broadcast from {src} {kind}"] = broadcast_step(reference, device, src)
                results[f"bad buffer {kind}"] = bad_buffer_step(reference, device)
        finally:
            ps.destroy_model_parallel()
            dist.destroy_process_group()
        out.put((rank, ps_stage(rank, dp), results, None))
    except BaseException:
        out.put((rank, None, {}, traceback.format_exc(limit=6)))


def ps_stage(rank: int, dp: int) -> int:
    """The pipeline stage of global ``rank`` (tp = cp = 1: ranks fill dp first)."""
    return rank // dp


def run_world(pp: int, dp: int, path: str, dry_run: bool) -> list[tuple[str, str | None]]:
    """Start one world, collect every rank's results and judge them."""
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    name = f"pp {pp} x dp {dp} ({'cpu dry run' if dry_run else 'cuda over gloo'})"
    with tempfile.TemporaryDirectory() as directory:
        store = os.path.join(directory, "store")
        procs = [
            context.Process(target=rank_main, args=(r, pp, dp, store, path, dry_run, out))
            for r in range(pp * dp)
        ]
        for proc in procs:
            proc.start()
        got = []
        try:
            for _ in procs:
                got.append(out.get(timeout=TIMEOUT_S))
        except Exception:
            return [(f"{name}: every rank answers within {TIMEOUT_S:g} s", "timed out")]
        finally:
            for proc in procs:
                proc.join(5)
                if proc.is_alive():
                    proc.kill()
                    proc.join()
    errors = [f"rank {rank}:\n{error}" for rank, _, _, error in got if error]
    if errors:
        return [(f"{name}: every rank runs", "\n".join(errors))]
    return judge(name, sorted(got, key=lambda item: item[0]), dry_run)


def judge(name: str, got: list[Any], dry_run: bool) -> list[tuple[str, str | None]]:
    checks: list[tuple[str, str | None]] = []
    kinds = ["cpu"] if dry_run else ["cpu", "cuda"]

    def check(what: str, ok: bool, detail: object) -> None:
        checks.append((f"{name}: {what}", None if ok else repr(detail)))

    for kind in kinds:
        moe = [results[f"moe {kind}"] for _, _, results, _ in got]
        check(f"get_moe_metrics ({kind}) the same dict on every rank",
              all(m == moe[0] for m in moe) and set(moe[0]) >= {"z_loss", "load_balancing_loss"},
              moe)  # fmt: skip
        last = [results[f"mtp {kind}"] for _, stage, results, _ in got if stage == 1]
        check(f"get_mtp_metrics ({kind}) the same on the last stage, layer 1 reported",
              all(m == last[0] for m in last) and "mtp_1_loss" in last[0], last)  # fmt: skip
        for key in [k for k in got[0][2] if k.startswith("broadcast") and k.endswith(kind)]:
            values = [results[key] for _, _, results, _ in got]
            check(f"{key}: every rank gets the source's values",
                  all(v == [0.0, 3.0, 1.0, 4.0, 2.0, 5.0] for v in values), values)  # fmt: skip
        errors = [results[f"bad buffer {kind}"] for _, _, results, _ in got]
        check(f"a bad receiver buffer on one rank ({kind}): ValueError on every rank",
              all(e.startswith("ValueError") for e in errors), errors)  # fmt: skip
    if not dry_run:
        for key in [k.removesuffix(" cpu") for k in got[0][2] if k.endswith(" cpu")]:
            if key.startswith("bad buffer"):
                continue
            same = all(r[f"{key} cpu"] == r[f"{key} cuda"] for _, _, r, _ in got)
            check(f"{key}: CUDA tensors give what CPU tensors give", same,
                  [(r[f"{key} cpu"], r[f"{key} cuda"]) for _, _, r, _ in got])  # fmt: skip
    return checks


def main(argv: list[str]) -> int:
    if not argv or argv[0].startswith("-"):
        print(__doc__)
        return 2
    path, dry_run = argv[0], "--dry-run" in argv[1:]
    if not dry_run:
        import torch

        if not torch.cuda.is_available():
            print("SKIP: no CUDA device here; nothing checked (--dry-run runs the same code on "
                  "CPU tensors)")  # fmt: skip
            return 0
    results = []
    for pp, dp in WORLDS:
        results += run_world(pp, dp, path, dry_run)
    return report(results)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
