"""Functions `tests/test_testing.py` runs on both ranks of `pipemetrics.testing.run_two_stage`
(top-level in a module of their own, so each rank imports them without the test module)."""

from __future__ import annotations

import os
from typing import Any

from pipemetrics.testing import Stage, moe_values, mtp_values, record_moe, record_mtp


def place(stage: Stage, extra: int) -> dict[str, Any]:
    """What the rank knows about its world, from torch and megatron-core themselves."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    return {
        "stage": stage,
        "extra": extra,
        "rank": dist.get_rank(),
        "world": dist.get_world_size(),
        "pp_rank": ps.get_pipeline_model_parallel_rank(),
        "pp_size": ps.get_pipeline_model_parallel_world_size(),
        "trackers": (moe_values(), mtp_values()),
    }


def dense_stage_metrics(stage: Stage, impl: str) -> dict[str, Any]:
    """Stage 1 records MoE losses (layers 3 and 4 of 4) and the MTP loss; stage 0 records
    nothing; both call ``impl``'s metric functions (a .py path) and report what they return and
    what the trackers hold afterwards."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("impl_under_test", impl)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if stage.has_moe_layers:
        record_moe({"load_balancing_loss": {3: 1.0, 4: 3.0}}, num_layers=4)
    if stage.is_last_stage:
        record_mtp([0.5], correct=[3.0], total=[4.0])
    moe = module.get_moe_metrics(0.5, num_layers=4, track_names=["load_balancing_loss"])
    mtp = module.get_mtp_metrics(1.0)
    return {"moe": moe, "mtp": mtp, "after": (moe_values(), mtp_values())}


def raise_on_stage_0_die_on_stage_1(stage: Stage) -> None:
    import torch
    import torch.distributed as dist

    if stage.rank == 1:
        os._exit(3)
    dist.all_reduce(torch.ones(1))  # its peer is gone: gloo raises, or the rank waits
    raise ValueError("stage 0 got past the all_reduce")


def raise_on_both(stage: Stage) -> None:
    raise ValueError(f"num_layers differs between ranks (rank {stage.rank})")


def wait_on_stage_1(stage: Stage) -> str:
    """Stage 1 enters an all_reduce that stage 0 never enters."""
    import torch
    import torch.distributed as dist

    if stage.rank == 1:
        dist.all_reduce(torch.ones(1))
    return f"stage {stage.rank} returned"
