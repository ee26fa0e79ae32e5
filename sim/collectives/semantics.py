"""What a collective does to its members' arguments, computed without a backend.

The in-process tier (`pipemetrics.sim.worlds.inprocess`) runs every rank of a world in one process;
when the coordinator releases a matched collective, each member applies its share of the
result here, in its own context (its own ``sys.modules``, so objects unpickle into its own
classes). The semantics are torch.distributed's, member by member:

* tensors are reduced in the tensor's own dtype, in group-rank order, and copied into each
  member's tensors (``copy_``: a non-contiguous view is written through, as by the backends),
  except ``broadcast``, which moves each tensor's memory as it lies in storage, as gloo does
  (`memory`: a non-contiguous source arrives scrambled);
* objects travel pickled, as torch sends them: each member pickles what it sends before the
  collective is released (`Contribution`), so an object that cannot be pickled fails on its
  sender, and every receiver gets its own unpickled copy;
* a rooted collective takes its root as ``src``/``dst`` (a global rank) or ``group_src``/
  ``group_dst`` (the rank within the group), as torch does.

A non-root rank's tensor after ``reduce`` is left as it was: torch leaves it undefined (gloo
writes partial results there), so the tiers may differ in it and no target should read it.

A collective with ``async_op=True`` returns a `CompletedWork` (already complete, as the data has
moved by the time the call returns).
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from pipemetrics.sim.collectives.interpose import reduce_op_name

_OBJECT_ARGUMENTS: dict[str, str] = {
    "all_gather_object": "obj",
    "gather_object": "obj",
    "broadcast_object_list": "object_list",
    "scatter_object_list": "scatter_object_input_list",
}
"""The argument whose objects a member sends, for each object collective."""


class UnsupportedCollectiveError(NotImplementedError):
    """The in-process tier does not simulate this collective or reduce op."""


class CompletedWork:
    """What an ``async_op=True`` collective returns here: the work is already done."""

    def wait(self, timeout: object = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def exception(self) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def result(self) -> list[torch.Tensor]:
        return []


@dataclass
class Contribution:
    """What one member sends, prepared in its own context before the collective is released:
    its objects pickled, or the exception pickling raised (raised on that member alone)."""

    pickled: list[bytes] | None = None
    error: BaseException | None = None


def contribute(op: str, arguments: dict[str, Any]) -> Contribution:
    """Pickle the objects this member sends (nothing for a tensor collective)."""
    name = _OBJECT_ARGUMENTS.get(op)
    if name is None:
        return Contribution()
    value = arguments.get(name)
    if value is None:
        return Contribution()
    items = [value] if name == "obj" else list(value)
    try:
        return Contribution(pickled=[_dumps(item) for item in items])
    except Exception as exc:  # torch raises the same on the sender
        return Contribution(error=exc)


def _dumps(item: object) -> bytes:
    buffer = io.BytesIO()
    pickle.Pickler(buffer).dump(item)
    return buffer.getvalue()


def _loads(data: bytes) -> Any:
    return pickle.Unpickler(io.BytesIO(data)).load()


@dataclass
class Meeting:
    """One released collective: every member's arguments and contribution, in group order."""

    op: str
    ranks: tuple[int, ...]
    arguments: list[dict[str, Any]]
    contributions: list[Contribution]
    _cache: dict[str, Any] = field(default_factory=dict)

    def root(self, global_name: str, group_name: str) -> int:
        """The root's index in the group (every member passed the same root: matched)."""
        arguments = self.arguments[0]
        root = arguments.get(global_name)
        if isinstance(root, int):
            return self.ranks.index(root)
        index = arguments.get(group_name)
        return int(index) if isinstance(index, int) else 0

    def reduced(self, name: str) -> torch.Tensor:
        """The reduction of every member's ``name`` tensor with the (agreed) reduce op."""
        if name not in self._cache:
            tensors = [a[name] for a in self.arguments]
            self._cache[name] = reduce_tensors(tensors, self.arguments[0].get("op"))
        value = self._cache[name]
        assert isinstance(value, torch.Tensor)
        return value

    def apply(self, rank: int) -> Any:
        """Apply the collective's effect to member ``rank``'s arguments; its return value."""
        me = self.ranks.index(rank)
        own = self.contributions[me]
        if own.error is not None:
            raise own.error
        handler = _HANDLERS.get(self.op)
        if handler is None:
            raise UnsupportedCollectiveError(
                f"the in-process tier does not simulate torch.distributed.{self.op}; run this "
                "target on the process tier (--tier process)"
            )
        handler(self, me)
        return CompletedWork() if self.arguments[me].get("async_op") else None


def reduce_tensors(tensors: Sequence[torch.Tensor], op: object) -> torch.Tensor:
    """``tensors`` reduced elementwise in their dtype, in order (``op`` None means SUM)."""
    name = "SUM" if op is None else reduce_op_name(op)
    combine = _COMBINE.get(name)
    if combine is None and name != "AVG":
        raise UnsupportedCollectiveError(
            f"the in-process tier does not simulate reduce op {name}; run this target on the "
            "process tier (--tier process)"
        )
    acc = tensors[0].detach().clone()
    for tensor in tensors[1:]:
        acc = (combine or torch.add)(acc, tensor.detach())
    if name == "AVG":
        acc = acc / len(tensors) if acc.is_floating_point() else acc // len(tensors)
    return acc.to(tensors[0].dtype)


_COMBINE: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "SUM": torch.add,
    "PRODUCT": torch.mul,
    "MIN": torch.minimum,
    "MAX": torch.maximum,
    "BAND": torch.bitwise_and,
    "BOR": torch.bitwise_or,
    "BXOR": torch.bitwise_xor,
}


def _objects(meeting: Meeting, index: int) -> list[Any]:
    pickled = meeting.contributions[index].pickled
    return [_loads(data) for data in pickled or []]


# -- one handler per collective: (meeting, my index in the group) -> None ------------------------


def _all_reduce(m: Meeting, me: int) -> None:
    m.arguments[me]["tensor"].copy_(m.reduced("tensor"))


def _broadcast(m: Meeting, me: int) -> None:
    root = m.root("src", "group_src")
    if me != root:
        memory(m.arguments[me]["tensor"]).copy_(memory(m.arguments[root]["tensor"]))


def memory(tensor: torch.Tensor) -> torch.Tensor:
    """The ``numel`` elements from ``tensor``'s first one in storage order: what gloo's broadcast
    sends from and writes into (it takes a tensor's data pointer as a dense buffer). For a
    contiguous tensor that is the tensor itself; a non-contiguous view (transposed, strided)
    sends its storage as it lies, so the receivers get scrambled data without an error."""
    if tensor.is_contiguous():
        return tensor.view(-1) if tensor.dim() else tensor.reshape(1)
    held = tensor.untyped_storage().nbytes() // tensor.element_size()
    if tensor.storage_offset() + tensor.numel() > held:
        raise UnsupportedCollectiveError(
            "the in-process tier does not simulate a broadcast of a non-contiguous view that "
            "reaches past its storage; run this target on the process tier (--tier process)"
        )
    return tensor.as_strided((tensor.numel(),), (1,))


def _broadcast_object_list(m: Meeting, me: int) -> None:
    root = m.root("src", "group_src")
    if me != root:
        target = m.arguments[me]["object_list"]
        for i, item in enumerate(_objects(m, root)):
            target[i] = item


def _all_gather(m: Meeting, me: int) -> None:
    for out, args in zip(m.arguments[me]["tensor_list"], m.arguments, strict=True):
        out.copy_(args["tensor"])


def _all_gather_into_tensor(m: Meeting, me: int) -> None:
    gathered = torch.cat([a["input_tensor"].detach().reshape(-1) for a in m.arguments])
    output = m.arguments[me]["output_tensor"]
    output.copy_(gathered.reshape(output.shape))


def _all_gather_object(m: Meeting, me: int) -> None:
    target = m.arguments[me]["object_list"]
    for i in range(len(m.ranks)):
        target[i] = _objects(m, i)[0]


def _reduce(m: Meeting, me: int) -> None:
    if me == m.root("dst", "group_dst"):
        m.arguments[me]["tensor"].copy_(m.reduced("tensor"))


def _reduce_scatter(m: Meeting, me: int) -> None:
    parts = [a["input_list"][me] for a in m.arguments]
    m.arguments[me]["output"].copy_(reduce_tensors(parts, m.arguments[0].get("op")))


def _reduce_scatter_tensor(m: Meeting, me: int) -> None:
    output = m.arguments[me]["output"]
    n = output.numel()
    parts = [a["input"].detach().reshape(-1)[me * n : (me + 1) * n] for a in m.arguments]
    output.copy_(reduce_tensors(parts, m.arguments[0].get("op")).reshape(output.shape))


def _all_to_all(m: Meeting, me: int) -> None:
    for out, args in zip(m.arguments[me]["output_tensor_list"], m.arguments, strict=True):
        out.copy_(args["input_tensor_list"][me])


def _all_to_all_single(m: Meeting, me: int) -> None:
    def chunks(args: dict[str, Any]) -> list[torch.Tensor]:
        tensor = args["input"].detach()
        sizes = args.get("input_split_sizes")
        if not sizes:
            return list(torch.chunk(tensor, len(m.ranks), dim=0))
        return list(torch.split(tensor, list(sizes), dim=0))

    received = [chunks(args)[me] for args in m.arguments]
    output = m.arguments[me]["output"]
    output.copy_(torch.cat(received, dim=0).reshape(output.shape))


def _gather(m: Meeting, me: int) -> None:
    if me == m.root("dst", "group_dst"):
        for out, args in zip(m.arguments[me]["gather_list"], m.arguments, strict=True):
            out.copy_(args["tensor"])


def _gather_object(m: Meeting, me: int) -> None:
    if me == m.root("dst", "group_dst"):
        target = m.arguments[me]["object_gather_list"]
        for i in range(len(m.ranks)):
            target[i] = _objects(m, i)[0]


def _scatter(m: Meeting, me: int) -> None:
    root = m.root("src", "group_src")
    m.arguments[me]["tensor"].copy_(m.arguments[root]["scatter_list"][me])


def _scatter_object_list(m: Meeting, me: int) -> None:
    root = m.root("src", "group_src")
    m.arguments[me]["scatter_object_output_list"][0] = _objects(m, root)[me]


def _nothing(m: Meeting, me: int) -> None:
    return None


_HANDLERS: dict[str, Callable[[Meeting, int], None]] = {
    "all_reduce": _all_reduce,
    "broadcast": _broadcast,
    "broadcast_object_list": _broadcast_object_list,
    "all_gather": _all_gather,
    "all_gather_into_tensor": _all_gather_into_tensor,
    "all_gather_object": _all_gather_object,
    "reduce": _reduce,
    "reduce_scatter": _reduce_scatter,
    "reduce_scatter_tensor": _reduce_scatter_tensor,
    "all_to_all": _all_to_all,
    "all_to_all_single": _all_to_all_single,
    "gather": _gather,
    "gather_object": _gather_object,
    "scatter": _scatter,
    "scatter_object_list": _scatter_object_list,
    "barrier": _nothing,
    "monitored_barrier": _nothing,
}

__all__ = [
    "CompletedWork",
    "Contribution",
    "Meeting",
    "UnsupportedCollectiveError",
    "contribute",
    "reduce_tensors",
]
