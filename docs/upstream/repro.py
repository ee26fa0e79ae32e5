# torchrun --nproc-per-node 4 repro.py {global|z|aux}
import sys

import torch
import torch.distributed as dist

from megatron.core import parallel_state as ps
from megatron.core.transformer.moe.moe_logging import MoEMetricsTracker

case = sys.argv[1]
name, sizes = {
    "global": ("global_load_balancing_loss", {}),  # pp 2 x dp 2
    "z": ("z_loss", dict(tensor_model_parallel_size=2)),  # tp 2 x pp 2
    "aux": ("load_balancing_loss", dict(context_parallel_size=2)),  # cp 2 x pp 2
}[case]
dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
if torch.cuda.is_available():
    torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
ps.initialize_model_parallel(pipeline_model_parallel_size=2, **sizes)
device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"

# the groups router.py records each name with
tp_cp = ps.get_tensor_and_context_parallel_group()
tp_dp_cp = ps.get_tensor_and_data_parallel_group(with_context_parallel=True)
groups = {
    "global_load_balancing_loss": dict(reduce_group=tp_dp_cp, needs_dp_avg=False),
    "z_loss": dict(avg_group=tp_dp_cp),
    "load_balancing_loss": dict(reduce_group=tp_cp),
}[name]

tracker = MoEMetricsTracker()
stage = ps.get_pipeline_model_parallel_rank()
if stage == 0:  # layer 1 of 2 is the only MoE layer; stage 1 is dense
    value = float(dist.get_rank(group=tp_dp_cp))  # 0.0 and 1.0
    tracker.record(name, torch.tensor(value, device=device), 1, 2, **groups)


class Writer:
    def add_scalar(self, tag, value, iteration):
        print(f"rank {dist.get_rank()} (stage {stage}): {tag} = {float(value)}", flush=True)


tracker.report(1.0, 0, writer=Writer(), force_initialize=True, track_names=[name], num_layers=2)
dist.destroy_process_group()
