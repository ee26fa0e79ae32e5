"""``moe.rank_agreement`` compares a rank with the ranks Megatron's reduction gives its value.

megatron-core 0.13-0.18's router records ``z_loss`` without groups, so with tensor parallelism
(sequence-parallel shards of the tokens, which MoE with tp > 1 requires) each tensor-parallel rank
keeps its own ``z_loss``: Megatron's own reduction leaves them apart, and so does a correct
implementation. 0.19's router averages it over tensor+data+context, and every rank must agree.
Found by the whole suite under megatron-core 0.14.0: the reference failed ``moe.rank_agreement``
on such a state while passing ``moe.values``. Both records are written out here, so the test
runs the same on every release.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pipemetrics.properties.catalogue import BY_ID
from pipemetrics.sim.model.calls import MoeCall
from pipemetrics.sim.model.layout import ModelLayout, Setup, WorldSpec
from pipemetrics.sim.model.records import MoeRecord, StepRecords
from pipemetrics.sim.model.scenario import Scenario, Step

from .conftest import TrackingPool

#: pp=2 x tp=2, stage 0 dense, stage 1 one MoE layer whose tensor-parallel ranks record
#: different z_loss values.
SETUP = Setup(
    world=WorldSpec(tp=2, pp=2),
    layout=ModelLayout(num_layers=2, moe_layer_freq=[0, 1], aux_loss_coeff=0.0, z_loss_coeff=1e-3),
)
TP_RANK_DEPENDENT = """
import torch.distributed as dist

def get_moe_metrics(loss_scale, total_loss_dict=None, per_layer_logging=False, num_layers=None,
                    mtp_num_layers=None, track_names=None):
    return {"z_loss": float(dist.get_rank() % 2)}  # the tensor-parallel rank (tp is innermost)
"""


def scenario(target: str, avg: str | None) -> Scenario:
    records = {
        rank: [MoeRecord(name="z_loss", layer_number=2, value=value, num_layers=2, avg=avg)]
        for rank, value in ((2, 1.0), (3, 2.0))
    }
    return Scenario(
        setup=SETUP,
        target=target,
        steps=[
            Step(
                records=StepRecords(moe=records),
                calls=[MoeCall(loss_scale=1.0, num_layers=2, track_names=["z_loss"])],
            )
        ],
    )


def judged(pool: TrackingPool, case: Scenario, property_id: str) -> list[str]:
    return BY_ID[property_id].judge(case, pool.run(case))


@pytest.mark.parametrize("avg", [None, "tp_dp_cp"], ids=["without_groups", "averaged"])
def test_the_reference_agrees_where_the_reduction_binds_the_ranks(
    pool: TrackingPool, avg: str | None
) -> None:
    case = scenario("pipemetrics.reference", avg)
    assert judged(pool, case, "moe.values") == []
    assert judged(pool, case, "moe.rank_agreement") == []


def test_tensor_parallel_ranks_apart_only_where_the_reduction_leaves_them(
    pool: TrackingPool, tmp_path: Path
) -> None:
    target = tmp_path / "tp_rank_dependent.py"
    target.write_text(TP_RANK_DEPENDENT, encoding="utf-8")
    # z_loss without groups: the tensor-parallel ranks keep their own values; a result that
    # differs between them (and agrees within each) is no disagreement
    assert judged(pool, scenario(str(target), None), "moe.rank_agreement") == []
    # averaged over tensor+data+context: every rank must return the same value
    problems = judged(pool, scenario(str(target), "tp_dp_cp"), "moe.rank_agreement")
    assert problems == [
        "step 0: 'z_loss' is 1.0 on rank 1 but 0.0 on rank 0",
        "step 0: 'z_loss' is 1.0 on rank 3 but 0.0 on rank 0",
    ], problems
