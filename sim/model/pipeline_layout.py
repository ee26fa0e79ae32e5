"""Megatron's flexible pipeline layouts (``pipeline_model_parallel_layout``), without importing it.

megatron-core's ``PipelineParallelLayerLayout`` reads a layout such as ``"Et|tt|m|L"`` (one
``|``-separated entry per virtual stage: ``E`` embedding, ``t`` decoder layer, ``m`` MTP layer,
``L`` loss; ``(..)*n`` and ``x*n`` repeat), assigns virtual stage ``v * pp + p`` to chunk ``v`` of
pipeline rank ``p`` (so ``len(stages) / pp`` is the virtual pipeline size) and refuses a layout
that breaks its rules (``validate_layer_layout``). This module does the same arithmetic and
refuses the same layouts with Megatron's own messages, so that a scenario can be validated and its
records drawn in the controller, which never imports megatron-core (a multi-second import).
`tests/test_pipeline_layout.py` holds it to Megatron's class over every layout up to a bound, and
each rank process checks the layers it is told it holds against Megatron's
``get_layer_id_list`` before it records anything (`pipemetrics.sim.worlds.rank`).
"""

from __future__ import annotations

import re
from functools import cached_property

from pydantic import BaseModel, ConfigDict

from pipemetrics.sim.mcore import MTP_ON_THE_LAST_STAGE, installed_features

LAYER_CHARS: dict[str, str] = {"E": "embedding", "L": "loss", "t": "decoder", "m": "mtp"}
"""Megatron's ``char2layer_type``: layout character -> ``LayerType`` member name."""

_REPEATS = (r"\(([^)]+)\)\*(\d+)", r"(.)\*(\d+)")


class LayoutError(ValueError):
    """A layout Megatron refuses; the message is Megatron's."""


def parse_layout(text: str) -> list[list[str]]:
    """The virtual stages of ``text`` as lists of layer characters (Megatron's
    ``parse_str_to_list``: commas are cosmetic, ``(ab|cd)*2`` and ``t*3`` unroll)."""
    text = text.replace(",", "")
    for pattern in _REPEATS:
        text = re.sub(pattern, lambda m: m.group(1) * int(m.group(2)), text)
    stages: list[list[str]] = []
    for stage in text.split("|"):
        for char in stage:
            if char not in LAYER_CHARS:
                raise LayoutError(
                    f"Invalid layer character: {char} (stage={stage!r}, layout_str={text!r}),"
                    f" known layer characters: {list(LAYER_CHARS)}"
                )
        stages.append(list(stage))
    return stages


class Chunk(BaseModel):
    """One virtual stage held by a pipeline rank: its layer characters and the 1-based global
    numbers of its decoder layers."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    layers: tuple[str, ...]
    decoder_numbers: tuple[int, ...]

    @property
    def mtp_layers(self) -> int:
        return self.layers.count("m")


class PipelineLayout:
    """A layout for ``pp`` pipeline ranks, validated as Megatron validates it.

    ``chunks[p][v]`` is chunk ``v`` of pipeline rank ``p``.
    """

    def __init__(self, text: str, pp: int, num_layers: int, mtp_num_layers: int) -> None:
        self.text = text
        stages = parse_layout(text)
        if len(stages) % pp != 0:
            raise LayoutError(
                "pipeline_model_parallel_layout must be divisible by "
                f"pipeline_model_parallel_size (len(layout)={len(stages)}, "
                f"pipeline_model_parallel_size={pp})"
            )
        self.pp = pp
        self.vpp = len(stages) // pp
        self.grid = [[stages[v * pp + p] for v in range(self.vpp)] for p in range(pp)]
        self.flat = [char for v in range(self.vpp) for p in range(pp) for char in self.grid[p][v]]
        self._validate(num_layers, mtp_num_layers)

    def _validate(self, num_layers: int, mtp_num_layers: int) -> None:
        """Megatron's ``validate_layer_layout``, rule by rule, with its messages."""
        flat, grid = self.flat, self.grid
        first = f"LayerType.{LAYER_CHARS[flat[0]]}" if flat else None
        last = f"LayerType.{LAYER_CHARS[flat[-1]]}" if flat else None
        rules: list[tuple[bool, str]] = [
            (first == "LayerType.embedding", f"The first layer must be embedding, but got {first}"),
            (last == "LayerType.loss", f"The last layer must be loss, but got {last}"),
            (flat.count("E") == 1, "Embedding must be specified exactly once"),
            (flat.count("L") == 1, "Loss must be specified exactly once"),
            (
                flat.count("t") == num_layers,
                f"Number of decoder layers {flat.count('t')}must match num_layers {num_layers}",
            ),
            (
                flat.count("m") == mtp_num_layers,
                "Number of mtp layers in layout must match mtp_num_layers",
            ),
        ]
        if "m" in flat:
            rules.append(
                (
                    "t" not in flat[flat.index("m") :],
                    "decoder layers must be placed before MTP layers",
                )
            )
        for row in grid:
            for chunk in row[:-1]:
                rules.append(
                    (
                        "m" not in chunk,
                        "Currently we restrict that the MTP should be always in the last ",
                    )
                )
        keeps_last = installed_features().layout_keeps_mtp_last  # 0.15, with its message
        same = "same stage" if keeps_last else "same one virtual pipeline stage"
        for pp_rank, row in enumerate(grid):
            if "m" in row[-1]:
                rules.append(
                    (
                        row[-1].count("m") == mtp_num_layers,
                        f"All of the MTP layers must be in the {same}",
                    )
                )
                if keeps_last:
                    on_last = pp_rank == len(grid) - 1 and "L" in row[-1]
                    rules.append((on_last, MTP_ON_THE_LAST_STAGE))
        for chunk in grid[0][:-1]:
            rules.append(
                (
                    "m" not in chunk,
                    "Currently we restrict that the MTP should not be in the first pp rank."
                    f"But got {grid[0]} for the first pp rank.",
                )
            )
        for holds, message in rules:
            if not holds:
                raise LayoutError(message)

    @cached_property
    def chunks(self) -> list[list[Chunk]]:
        """Every rank's chunks with global decoder numbers (Megatron's ``get_layer_offset``:
        the decoders of every earlier virtual stage, in virtual stage order, come first)."""
        numbers: dict[tuple[int, int], tuple[int, ...]] = {}
        offset = 0
        for v in range(self.vpp):
            for p in range(self.pp):
                count = self.grid[p][v].count("t")
                numbers[(p, v)] = tuple(range(offset + 1, offset + count + 1))
                offset += count
        return [
            [
                Chunk(layers=tuple(self.grid[p][v]), decoder_numbers=numbers[(p, v)])
                for v in range(self.vpp)
            ]
            for p in range(self.pp)
        ]

    @property
    def mtp_stage(self) -> int | None:
        """The pipeline rank holding the MTP layers (in its last chunk), or ``None``."""
        for p, row in enumerate(self.grid):
            if "m" in row[-1]:
                return p
        return None

    @property
    def mtp_standalone(self) -> bool:
        """Megatron's ``mtp_standalone``: the MTP layers are not on the last pipeline rank."""
        stage = self.mtp_stage
        return stage is not None and stage != self.pp - 1
