"""A scenario: everything needed to reproduce one run exactly.

World and model layout, how the trackers are filled (synthetic records chosen by the caller, or
megatron-core's real routers), the seed, the implementation under test, and for every training
step the calls a trainer makes after it. Scenarios are written as JSON for `pipemetrics replay`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, ValidationError, model_validator

from pipemetrics.sim.layout import Frozen, Setup
from pipemetrics.sim.records import StepRecords

DEFAULT_TARGET = "pipemetrics.reference"


class MoeCall(Frozen):
    """``get_moe_metrics`` as a trainer calls it after a step.

    ``use_total_loss_dict``: pass one dict per rank that lives across the steps of the scenario.
    ``num_moe_layers`` is only passed when the target's signature accepts it.
    """

    function: Literal["get_moe_metrics"] = "get_moe_metrics"
    loss_scale: float = 1.0
    per_layer_logging: bool = False
    num_layers: int | None = None
    mtp_num_layers: int | None = None
    track_names: list[str] | None = None
    num_moe_layers: int | None = None
    use_total_loss_dict: bool = False


class MtpCall(Frozen):
    """``get_mtp_metrics(loss_scale)``."""

    function: Literal["get_mtp_metrics"] = "get_mtp_metrics"
    loss_scale: float = 1.0


class BufferSpec(Frozen):
    """A receiver's buffer for ``broadcast_tensor``."""

    shape: list[int]
    dtype: str
    device: str = "default"
    """'default' is the group's device (cpu for gloo); anything else is used verbatim."""


class BroadcastCall(Frozen):
    """``broadcast_tensor(tensor, src_rank, group)`` over a Megatron group.

    The source tensor is filled deterministically from ``fill_seed``; ``non_contiguous`` makes it
    a transposed view (needs >= 2 dims). ``buffers`` maps a receiver's global rank to the buffer
    it passes (absent: it passes None). ``source_passes_none`` makes the source pass None.
    """

    function: Literal["broadcast_tensor"] = "broadcast_tensor"
    group: str = "world"
    src_rank: int = 0
    shape: list[Annotated[int, Field(ge=0)]] = Field(default_factory=lambda: [4])
    dtype: str = "float32"
    non_contiguous: bool = False
    fill_seed: int = 0
    buffers: dict[int, BufferSpec] = Field(default_factory=dict)
    source_passes_none: bool = False

    @model_validator(mode="after")
    def _transposable(self) -> BroadcastCall:
        if self.non_contiguous and len(self.shape) < 2:
            raise ValueError("non_contiguous: a transposed source needs at least 2 dimensions")
        return self


class TrackNamesCall(Frozen):
    """``get_aux_loss_track_names(config)`` with a real TransformerConfig-like object."""

    function: Literal["get_aux_loss_track_names"] = "get_aux_loss_track_names"


class RoundUpCall(Frozen):
    """``_round_up_to_multiple(value, multiple)``."""

    function: Literal["_round_up_to_multiple"] = "_round_up_to_multiple"
    value: int
    multiple: int


CallSpec = Annotated[
    MoeCall | MtpCall | BroadcastCall | TrackNamesCall | RoundUpCall,
    Field(discriminator="function"),
]


class Step(Frozen):
    """One training step: what is recorded (synthetic mode), then the calls after it."""

    records: StepRecords | None = None
    calls: list[CallSpec] = Field(default_factory=list)


class Scenario(Frozen):
    """One reproducible run of an implementation in a simulated world."""

    setup: Setup
    mode: Literal["synthetic", "router"] = "synthetic"
    seed: int = 0
    target: str = DEFAULT_TARGET
    steps: list[Step]
    deadline_s: Annotated[float, Field(gt=0)] = 30.0

    @model_validator(mode="after")
    def _records_fit(self) -> Scenario:
        world = self.setup.world.world_size
        for i, step in enumerate(self.steps):
            if self.mode == "router" and step.records is not None:
                raise ValueError(f"steps[{i}].records: router mode records through the routers")
            records = step.records
            if records is None:
                continue
            for kind, per_rank in (("moe", records.moe), ("mtp", records.mtp)):
                bad = [r for r in per_rank if not 0 <= r < world]
                if bad:
                    raise ValueError(
                        f"steps[{i}].records.{kind}: ranks {bad} outside a world of {world}"
                    )
            for call in step.calls:
                if isinstance(call, BroadcastCall) and not 0 <= call.src_rank < world:
                    raise ValueError(f"steps[{i}]: src_rank {call.src_rank} outside the world")
        return self


class ScenarioFileError(ValueError):
    """A scenario file that cannot be read; the message says which field is wrong."""


def load_scenario(path: str | Path) -> Scenario:
    """Read a scenario file, turning every problem into one readable `ScenarioFileError`."""
    file = Path(path)
    try:
        text = file.read_text(encoding="utf-8")
    except OSError as exc:
        raise ScenarioFileError(f"{file}: cannot read the scenario file ({exc.strerror})") from exc
    try:
        return Scenario.model_validate_json(text)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or '<file>'}: {err['msg']}"
            for err in exc.errors()[:8]
        )
        raise ScenarioFileError(f"{file}: not a valid pipemetrics scenario: {problems}") from exc


def save_scenario(scenario: Scenario, path: str | Path) -> Path:
    file = Path(path)
    file.write_text(scenario.model_dump_json(indent=2), encoding="utf-8")
    return file
