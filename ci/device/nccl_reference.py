"""The reference on CUDA trackers and NCCL groups, on a machine with one GPU (no CI runs it).

CI has no GPU, so the reference's device paths (a group's backend decides the device its
collectives use; trackers recorded on CUDA) are unit-tested on CPU only. On one GPU this runs,
in a one-rank world of each backend (``nccl``, ``cpu:gloo,cuda:nccl``): megatron-core's
``MoEMetricsTracker`` and ``MTPLossLoggingHelper`` filled with CUDA tensors through their own
recording functions, then the reference's ``get_moe_metrics`` / ``get_mtp_metrics`` against
megatron-core's own ``report()`` / ``track_mtp_metrics`` on the same records, and
``broadcast_tensor`` of CPU and CUDA tensors; where the installed helper has the dev branch's
per-token path (``save_loss_to_tracker``), the reference against ``track_mtp_metrics`` on it.
NCCL refuses two ranks on one GPU, so the multi-rank paths stay with the CPU tests.

    python ci/device/nccl_reference.py reference/megatron_common.py

Prints one line per check and ``N passed, N failed``; exits 1 on a failure.
"""

from __future__ import annotations

import os
import sys
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from common import load, report  # ci/device/common.py, beside this script


def fill_moe(ps: Any) -> None:
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    tracker = get_moe_metrics_tracker()
    for layer, value in ((1, 0.5), (2, 0.25)):
        tracker.record("load_balancing_loss", torch.tensor(value, device="cuda"), layer, 2,
                       reduce_group=ps.get_tensor_and_context_parallel_group())  # fmt: skip
        tracker.record("z_loss", torch.tensor(2 * value, device="cuda"), layer, 2,
                       avg_group=ps.get_tensor_and_data_parallel_group(with_context_parallel=True))  # fmt: skip


def fill_mtp(ps: Any) -> None:
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    group = ps.get_data_parallel_group(with_context_parallel=True)
    for layer in range(2):
        MTPLossLoggingHelper.save_metrics_to_tracker(
            torch.tensor(0.75 + layer, device="cuda"), torch.tensor(3.0, device="cuda"),
            torch.tensor(4.0, device="cuda"), layer, 2, avg_group=group,
        )  # fmt: skip


def fill_mtp_per_token(ps: Any) -> None:
    """The dev branch's per-token path: raw loss sums and token counts, packed acceptance."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    group = ps.get_data_parallel_group(with_context_parallel=True)
    for layer in range(2):
        MTPLossLoggingHelper.save_loss_to_tracker(
            torch.tensor(6.0 + layer, device="cuda"), torch.tensor(4.0, device="cuda"), layer, 2,
            correct=torch.tensor(3.0, device="cuda"), total=torch.tensor(4.0, device="cuda"),
            avg_group=group, calculate_per_token_loss=True,
        )  # fmt: skip


def megatron_mtp() -> dict[str, float]:
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    totals: dict[str, Any] = {}
    MTPLossLoggingHelper.track_mtp_metrics(1.0, 1, None, None, totals)
    return {k: float(v) for k, v in totals.items()}


def megatron_moe() -> dict[str, float]:
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    tracker = get_moe_metrics_tracker()
    totals: dict[str, Any] = {}
    tracker.report(loss_scale=1.0, iteration=1, writer=None, total_loss_dict=totals,
                   num_layers=2, moe_layer_freq=1, force_initialize=True,
                   track_names=["load_balancing_loss", "z_loss"])  # fmt: skip
    return {k: float(v) for k, v in totals.items()}


def run(reference: Any, backend: str) -> list[tuple[str, str | None]]:
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    results: list[tuple[str, str | None]] = []

    def check(name: str, body: Callable[[], None]) -> None:
        try:
            body()
            results.append((f"{backend}: {name}", None))
        except Exception:
            results.append((f"{backend}: {name}", traceback.format_exc(limit=4)))

    with tempfile.TemporaryDirectory() as directory:
        store = dist.FileStore(os.path.join(directory, "store"), 1)
        dist.init_process_group(backend, store=store, rank=0, world_size=1)
        ps.initialize_model_parallel()
        try:

            def moe() -> None:
                fill_moe(ps)
                ours = reference.get_moe_metrics(1.0, {}, True, 2, None,
                                                 ["load_balancing_loss", "z_loss"])  # fmt: skip
                get_moe_metrics_tracker().clear()
                fill_moe(ps)
                theirs = megatron_moe()
                get_moe_metrics_tracker().clear()
                for name, value in theirs.items():
                    assert abs(ours[name] - value) < 1e-6, (name, ours, theirs)

            def mtp() -> None:
                fill_mtp(ps)
                ours = reference.get_mtp_metrics(0.5)
                assert ours["mtp_1_loss"] == 0.375 and ours["mtp_2_loss"] == 0.875, ours
                assert ours["mtp_1_acceptance_rate"] == 75.0, ours
                tracker = MTPLossLoggingHelper.tracker
                for key in ("loss_values", "correct_values", "total_values", "loss_sums"):
                    if key in tracker:  # the keys of the installed helper's layout
                        assert not tracker[key].any(), (key, tracker[key])

            def mtp_per_token() -> None:
                fill_mtp_per_token(ps)
                ours = reference.get_mtp_metrics(1.0)
                MTPLossLoggingHelper.tracker.clear()
                fill_mtp_per_token(ps)
                theirs = megatron_mtp()
                MTPLossLoggingHelper.tracker.clear()
                for layer in (1, 2):
                    mine, megatron = ours[f"mtp_{layer}_loss"], theirs[f"mtp_{layer} loss"]
                    assert abs(mine - megatron) < 1e-6, (layer, ours, theirs)
                assert ours["mtp_1_acceptance_rate"] == 75.0, ours

            def broadcast(device: str) -> Callable[[], None]:
                def body() -> None:
                    source = torch.arange(6, dtype=torch.float32, device=device).reshape(2, 3).t()
                    got = reference.broadcast_tensor(source, 0, dist.group.WORLD)
                    assert torch.equal(got.cpu(), source.cpu()), got

                return body

            check("get_moe_metrics equals report() on CUDA records", moe)
            check("get_mtp_metrics on CUDA records", mtp)
            if hasattr(MTPLossLoggingHelper, "save_loss_to_tracker"):
                check("get_mtp_metrics equals track_mtp_metrics on per-token CUDA records",
                      mtp_per_token)  # fmt: skip
            check("broadcast_tensor of a CUDA tensor", broadcast("cuda"))
            if "gloo" in backend:
                check("broadcast_tensor of a CPU tensor", broadcast("cpu"))
        finally:
            ps.destroy_model_parallel()
            dist.destroy_process_group()
    return results


def main() -> int:
    reference = load(sys.argv[1])
    torch.cuda.set_device(0)
    results = []
    for backend in ("nccl", "cpu:gloo,cuda:nccl"):
        results += run(reference, backend)
    return report(results)


if __name__ == "__main__":
    sys.exit(main())
