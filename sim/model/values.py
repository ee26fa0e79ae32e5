"""Turning what an implementation returns into plain data, and making test tensors.

torch is imported where a function needs it: the controller imports this module for
`TENSOR_KEY` and should not pay seconds of torch import for a check that makes no tensor.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

TENSOR_KEY = "__tensor__"


def make_tensor(
    shape: list[int], dtype: str, seed: int, non_contiguous: bool, strided: bool = False
) -> torch.Tensor:
    """A deterministic tensor; ``non_contiguous`` returns a view: of the last 2 dims transposed,
    or, with ``strided``, of every other element of a last dimension twice as long."""
    import torch

    torch_dtype = getattr(torch, dtype)
    generator = torch.Generator().manual_seed(seed)
    stored = list(shape)
    if non_contiguous and strided:
        stored[-1] *= 2
    elif non_contiguous:
        stored[-1], stored[-2] = stored[-2], stored[-1]
    if torch_dtype == torch.bool:
        tensor = torch.randint(0, 2, stored, generator=generator).bool()
    elif torch_dtype.is_floating_point:
        tensor = torch.randn(stored, generator=generator).to(torch_dtype)
    else:
        tensor = torch.randint(-1000, 1000, stored, generator=generator).to(torch_dtype)
    if non_contiguous and strided:
        tensor = tensor[..., ::2]
    elif non_contiguous:
        tensor = tensor.transpose(-1, -2)
    return tensor


def describe_tensor(tensor: torch.Tensor) -> dict[str, Any]:
    """dtype, shape, device type and values (``None`` for a meta tensor: it holds none)."""
    meta = tensor.device.type == "meta"
    return {
        "dtype": str(tensor.dtype).removeprefix("torch."),
        "shape": list(tensor.shape),
        "device": tensor.device.type,
        "values": None if meta else tensor.detach().cpu().reshape(-1).tolist(),
    }


def encode(value: Any, *, buffer: Any = None) -> Any:
    """Plain, picklable, JSON-able data for a returned value.

    A tensor becomes ``{"__tensor__": {dtype, shape, device, values, is_buffer}}``, where
    ``is_buffer`` says whether it is the very buffer the caller passed in.
    """
    import torch

    if isinstance(value, torch.Tensor):
        described = describe_tensor(value)
        described["is_buffer"] = buffer is not None and value is buffer
        return {TENSOR_KEY: described}
    if isinstance(value, dict):
        return {str(k): encode(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [encode(v) for v in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return {"__repr__": f"{type(value).__name__}: {value!r}"[:500]}
