"""A test target: calls every torch.distributed collective the interposer knows, on the world
group, and returns what each produced on this rank (tests/test_inprocess.py runs it on both
tiers). A non-root rank's tensor after ``reduce`` is undefined in torch (gloo leaves partial
results there), so only the root reports it."""

import torch
import torch.distributed as dist


def _round_up_to_multiple(value, multiple):
    rank, size = dist.get_rank(), dist.get_world_size()
    out = {}

    def t(*values, dtype=torch.float32):
        return torch.tensor(values, dtype=dtype)

    for op in ("SUM", "PRODUCT", "MIN", "MAX", "AVG"):
        x = t(rank + 1.5, 2.0 - rank)
        dist.all_reduce(x, op=getattr(dist.ReduceOp, op))
        out[f"all_reduce_{op}"] = x.tolist()
    for op in ("BAND", "BOR", "BXOR"):
        x = t(rank + 5, 3 * rank + 1, dtype=torch.int64)
        dist.all_reduce(x, op=getattr(dist.ReduceOp, op))
        out[f"all_reduce_{op}"] = x.tolist()
    x = t(rank * 10.0, 1.0)
    dist.broadcast(x, src=size - 1)
    out["broadcast"] = x.tolist()
    x = t(rank * 3.0)
    dist.broadcast(x, group_src=0, group=dist.group.WORLD)
    out["broadcast_group_src"] = x.tolist()
    objects = [{"rank": rank, "tag": "a" * rank}] if rank == 0 else [None]
    dist.broadcast_object_list(objects, src=0)
    out["broadcast_object_list"] = objects
    gathered = [torch.zeros(2) for _ in range(size)]
    dist.all_gather(gathered, t(rank, rank + 0.5))
    out["all_gather"] = [g.tolist() for g in gathered]
    into = torch.zeros(2 * size)
    dist.all_gather_into_tensor(into, t(rank, -rank))
    out["all_gather_into_tensor"] = into.tolist()
    objects = [None] * size
    dist.all_gather_object(objects, ("r", rank, [rank] * rank))
    out["all_gather_object"] = objects
    x = t(rank + 1.0, 2.0)
    dist.reduce(x, dst=0, op=dist.ReduceOp.MAX)
    out["reduce"] = x.tolist() if rank == 0 else "undefined off the root (torch docs)"
    output = torch.zeros(1)
    dist.reduce_scatter(output, [t(rank * 10.0 + i) for i in range(size)])
    out["reduce_scatter"] = output.tolist()
    output = torch.zeros(2)
    dist.reduce_scatter_tensor(output, torch.arange(2.0 * size) + rank)
    out["reduce_scatter_tensor"] = output.tolist()
    received = [torch.zeros(1) for _ in range(size)]
    dist.all_to_all(received, [t(rank * 100.0 + i) for i in range(size)])
    out["all_to_all"] = [r.tolist() for r in received]
    single = torch.zeros(size)
    dist.all_to_all_single(single, torch.arange(float(size)) + 10 * rank)
    out["all_to_all_single"] = single.tolist()
    gathered = [torch.zeros(1) for _ in range(size)] if rank == 0 else None
    dist.gather(t(rank * 2.0), gather_list=gathered, dst=0)
    out["gather"] = None if gathered is None else [g.tolist() for g in gathered]
    objects = [None] * size if rank == 0 else None
    dist.gather_object({"from": rank}, objects, dst=0)
    out["gather_object"] = objects
    x = torch.zeros(1)
    dist.scatter(x, [t(i * 7.0) for i in range(size)] if rank == size - 1 else None, src=size - 1)
    out["scatter"] = x.tolist()
    received = [None]
    dist.scatter_object_list(
        received, [f"to {i}" for i in range(size)] if rank == 0 else None, src=0
    )
    out["scatter_object_list"] = received
    work = dist.all_reduce(t(1.0), async_op=True)
    out["async_wait"] = bool(work.wait())
    dist.barrier()
    dist.monitored_barrier()
    return out
