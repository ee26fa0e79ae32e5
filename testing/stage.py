"""One rank of `pipemetrics.testing.worlds.run_two_stage` (``python -m pipemetrics.testing.stage
DIRECTORY RANK``): joins the two-stage gloo world over a ``FileStore`` in DIRECTORY, builds
``parallel_state`` (``pp=2``), says it is ready (``rankN.ready``), runs the function the spec names and writes its result (or its
exception) to ``rankN.result``, then waits for the peer's result so that no rank leaves a
collective its peer is still in. Output and stack dumps go to ``rankN.log``/``rankN.stacks``;
the process dies with its controller (`pipemetrics.sim.worlds.rank.run_child`).
"""

from __future__ import annotations

import datetime
import json
import os
import pickle
import sys
import time
import traceback
from pathlib import Path
from typing import Any

WORLD_SIZE = 2


def _outcome(directory: str, rank: int, spec: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist

    from pipemetrics.sim.megatron.trackers import cpu_current_device, reset_trackers
    from pipemetrics.sim.model.layout import WorldSpec
    from pipemetrics.sim.worlds.rank import join_world
    from pipemetrics.testing.worlds import Stage, _FunctionRef

    try:
        function = _FunctionRef(**spec["function"]).load()
        args = pickle.loads(Path(directory, "args.pkl").read_bytes())
        store = dist.FileStore(os.path.join(directory, "store"), WORLD_SIZE)  # type: ignore[attr-defined]
        dist.init_process_group(
            "gloo",
            store=store,
            rank=rank,
            world_size=WORLD_SIZE,
            timeout=datetime.timedelta(seconds=spec["timeout_s"]),
        )
        join_world(WorldSpec(pp=WORLD_SIZE))
        reset_trackers()
        Path(directory, f"rank{rank}.ready").touch()  # the function's deadline starts
        with cpu_current_device():
            value = function(Stage(rank=rank, pp_rank=rank, pp_size=WORLD_SIZE), *args)
        pickle.dumps(value)  # fails here, with a traceback, when the result cannot travel
        return {"ok": True, "value": value}
    except Exception as exc:
        return {
            "ok": False,
            "message": f"{type(exc).__qualname__}: {exc}",
            "traceback": traceback.format_exc(),
        }


def _serve(directory: str, rank: int, spec: dict[str, Any]) -> None:
    outcome = _outcome(directory, rank, spec)
    result = Path(directory, f"rank{rank}.result")
    partial = result.with_suffix(".partial")
    partial.write_bytes(pickle.dumps(outcome))
    partial.rename(result)
    deadline = time.monotonic() + float(spec["timeout_s"])
    peers = [Path(directory, f"rank{r}.result") for r in range(WORLD_SIZE)]
    while not all(p.exists() for p in peers) and time.monotonic() < deadline:
        time.sleep(0.02)


def main(argv: list[str]) -> None:
    directory, rank = argv[0], int(argv[1])
    spec = json.loads(Path(directory, "spec.json").read_text(encoding="utf-8"))
    sys.path[:0] = [p for p in spec["sys_path"] if p not in sys.path]
    from pipemetrics.sim.worlds.rank import run_child

    run_child(
        directory,
        f"rank{rank}",
        int(spec["controller_pid"]),
        [directory],
        lambda: _serve(directory, rank, spec),
    )


if __name__ == "__main__":
    main(sys.argv[1:])
