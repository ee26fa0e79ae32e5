"""A test target: the reference, loaded where it also breaks the in-process tier's SUM.

Loading it replaces `pipemetrics.sim.collectives.semantics`' SUM of floating tensors with one
that counts every member after the first twice. Only the in-process tier's host computes
collectives with that module (the process tier's ranks reduce over real gloo, where loading
this changes nothing), so the target is correct and the in-process tier is wrong: what
tests/test_referee.py needs to show that a tier disagreement is reported as a fault of
pipemetrics, never as the target's failure.
"""

import torch

from pipemetrics.reference.megatron_common import *  # noqa: F403
from pipemetrics.sim.collectives import semantics


def _sum_counting_twice(acc: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    if acc.is_floating_point():
        return torch.add(acc, tensor, alpha=2)
    return torch.add(acc, tensor)


semantics._COMBINE["SUM"] = _sum_counting_twice
