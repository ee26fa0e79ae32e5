"""``get_mtp_metrics`` on the MTP tracker layouts of megatron-core from git (main, dev), and on a
layout it does not know.

* Local mode (no ``torch.distributed``): dev's per-token layout read on any release, the
  acceptance counts switched off, and the unknown layouts that must raise.
* Real two-rank gloo worlds (spawned processes, a file store in a temporary directory, every run
  bounded by `WORLD_DEADLINE_S`; the processes are killed and joined, the directory removed):
  an unknown layout raises a clear ``ValueError`` on every rank, also where the other rank holds
  a known layout and would otherwise wait in the reduction; and, where the installed
  megatron-core has dev's per-token ``save_loss_to_tracker``, ``get_mtp_metrics`` returns what
  dev's own ``track_mtp_metrics`` logs for the same records.
"""

from __future__ import annotations

import inspect
import multiprocessing as mp
import os
import queue
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch
from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

from pipemetrics.reference.megatron_common import get_mtp_metrics

WORLD = 2
WORLD_DEADLINE_S = 120.0
"""The hard bound of one world run, start-up (two interpreters importing torch and
megatron-core) included; a rank still running then is reported as hung and killed."""
GLOO_TIMEOUT = timedelta(seconds=600)
"""Longer than `WORLD_DEADLINE_S`: a rank left in a collective shows as a hang, not an error."""

_SAVE_LOSS = getattr(MTPLossLoggingHelper, "save_loss_to_tracker", None)
PER_TOKEN_SAVE = (
    _SAVE_LOSS is not None
    and "num_tokens" in inspect.signature(_SAVE_LOSS).parameters
    and hasattr(MTPLossLoggingHelper, "configure_acceptance_collection")
)
NEEDS_PER_TOKEN_SAVE = pytest.mark.skipif(
    not PER_TOKEN_SAVE,
    reason="the installed megatron-core's MTPLossLoggingHelper has no per-token "
    "save_loss_to_tracker(loss_sum, num_tokens, ...) with configure_acceptance_collection "
    "(megatron-core dev's tracker layout); run under a venv with megatron-core dev",
)


@pytest.fixture(autouse=True)
def fresh_mtp_tracker() -> Any:
    MTPLossLoggingHelper.tracker = {}
    yield
    MTPLossLoggingHelper.tracker = {}


# ----------------------------------------------------------------------------- local mode


def _dev_tracker(per_token: bool, **extra: Any) -> dict[str, Any]:
    """dev's training-path layout as ``save_loss_to_tracker`` leaves it (two MTP layers)."""
    counts = torch.tensor([[3.0, 0.0], [4.0, 0.0]])
    tracker: dict[str, Any] = {
        "loss_sums": torch.tensor([6.0, 2.0]) if per_token else torch.tensor([1.5, 2.0]),
        "calculate_per_token_loss": per_token,
        "acceptance_counts": counts,
        "correct_values": counts[0],
        "total_values": counts[1],
        "acceptance_reduce_group": None,
        "acceptance_avg_group": None,
        "reduce_group": None,
        "avg_group": None,
        **extra,
    }
    if per_token:
        tracker["num_tokens"] = torch.tensor([4.0, 0.0])
    return tracker


def test_dev_per_token_layout_loss_is_sums_over_tokens() -> None:
    MTPLossLoggingHelper.tracker = _dev_tracker(per_token=True)
    out = get_mtp_metrics(0.5)
    # 6 / 4 and 2 / max(0, 1), scaled; the rates from the packed counts (0 / max(0, 1) = 0).
    assert out == {
        "mtp_1_loss": 0.75,
        "mtp_1_acceptance_rate": 75.0,
        "mtp_2_loss": 1.0,
        "mtp_2_acceptance_rate": 0.0,
    }
    tracker = MTPLossLoggingHelper.tracker
    for key in ("loss_sums", "num_tokens", "values", "acceptance_counts"):
        assert not bool(tracker[key].any()), key
    assert tracker["reduce_group"] is None and tracker["avg_group"] is None


def test_dev_microbatch_normalised_layout() -> None:
    MTPLossLoggingHelper.tracker = _dev_tracker(per_token=False)
    assert get_mtp_metrics(2.0) == {
        "mtp_1_loss": 3.0,
        "mtp_1_acceptance_rate": 75.0,
        "mtp_2_loss": 4.0,
        "mtp_2_acceptance_rate": 0.0,
    }


def test_dev_acceptance_collection_off_reports_the_loss_only() -> None:
    MTPLossLoggingHelper.tracker = _dev_tracker(per_token=True, acceptance_collection_enabled=False)
    assert get_mtp_metrics() == {"mtp_1_loss": 1.5, "mtp_2_loss": 2.0}


def test_dev_without_acceptance_counts_reports_the_loss_only() -> None:
    # The fused linear cross entropy materialises no logits: dev records no counts.
    tracker = _dev_tracker(per_token=True)
    for key in ("acceptance_counts", "correct_values", "total_values"):
        del tracker[key]
    MTPLossLoggingHelper.tracker = tracker
    assert get_mtp_metrics() == {"mtp_1_loss": 1.5, "mtp_2_loss": 2.0}


def test_bookkeeping_without_tensors_is_an_empty_tracker() -> None:
    MTPLossLoggingHelper.tracker = {"acceptance_collection_enabled": True}
    assert get_mtp_metrics() == {}


@pytest.mark.parametrize(
    ("tracker", "named"),
    [
        ({"mystery_loss": torch.tensor([1.0]), "avg_group": None}, "'mystery_loss'"),
        (  # a known layout plus a key it does not have: its meaning may have changed
            {
                "loss_values": torch.tensor([1.0]),
                "loss_weights": torch.tensor([2.0]),
                "reduce_group": None,
                "avg_group": None,
            },
            "'loss_weights'",
        ),
        ({"num_tokens": torch.tensor([1.0])}, "no loss key"),
    ],
    ids=["unknown_loss_key", "unknown_extra_key", "tensors_without_loss"],
)
def test_unknown_layout_raises_naming_the_keys(tracker: dict[str, Any], named: str) -> None:
    MTPLossLoggingHelper.tracker = tracker
    with pytest.raises(ValueError, match="does not know") as raised:
        get_mtp_metrics()
    message = str(raised.value)
    assert named in message and "rank 0" in message and "'loss_sums'" in message
    for value in MTPLossLoggingHelper.tracker.values():  # not touched
        if torch.is_tensor(value):
            assert bool(value.any())


# ----------------------------------------------------------------------------- world runner


def _rank_main(
    worker: str, rank: int, world: int, store: str, args: Any, results: Any
) -> None:  # pragma: no cover - runs in the spawned rank processes
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=GLOO_TIMEOUT
    )
    try:
        value: Any = WORKERS[worker](rank, args)
    except BaseException as exc:  # reported to the parent, which fails the test
        value = {"crashed": repr(exc)}
    results.put((rank, value))
    dist.destroy_process_group()


def run_world(worker: str, args: Any = None, world: int = WORLD) -> dict[int, Any]:
    """Run ``WORKERS[worker](rank, args)`` on every rank of a gloo world; return each
    rank's value. Fails the test when a rank crashes or any rank is still running after
    `WORLD_DEADLINE_S` (a hang); the rank processes never outlive this call."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="pipemetrics-gitsnap-") as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            ctx.Process(
                target=_rank_main, args=(worker, rank, world, store, args, results), daemon=True
            )
            for rank in range(world)
        ]
        for proc in procs:
            proc.start()
        values: dict[int, Any] = {}
        deadline = time.monotonic() + WORLD_DEADLINE_S
        try:
            while len(values) < world:
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(set(range(world)) - set(values))
                    pytest.fail(f"ranks {missing} still running after {WORLD_DEADLINE_S} s: hang")
                try:
                    rank, value = results.get(timeout=min(left, 1.0))
                except queue.Empty:
                    dead = [r for r, p in enumerate(procs) if r not in values and not p.is_alive()]
                    if dead and results.empty():
                        pytest.fail(f"ranks {dead} exited without a result")
                    continue
                values[rank] = value
        finally:
            for proc in procs:
                proc.join(timeout=10)
                if proc.is_alive():
                    proc.kill()
                    proc.join()
            results.close()
            results.join_thread()
    crashed = {r: v["crashed"] for r, v in values.items() if isinstance(v, dict) and "crashed" in v}
    assert not crashed, crashed
    return values


# ----------------------------------------------------------------------------- unknown layouts


def _v019(group: Any, loss: list[float], **extra: Any) -> dict[str, Any]:
    """A megatron-core 0.19-0.20 tracker (``save_metrics_to_tracker``) with ``avg_group``."""
    return {
        "loss_values": torch.tensor(loss),
        "correct_values": torch.tensor([1.0] * len(loss)),
        "total_values": torch.tensor([2.0] * len(loss)),
        "reduce_group": None,
        "avg_group": group,
        **extra,
    }


def _mystery(group: Any) -> dict[str, Any]:
    return {"mystery_loss": torch.tensor([1.0, 2.0]), "avg_group": group}


def _dev(group: Any, per_token: bool) -> dict[str, Any]:
    tracker = _dev_tracker(per_token)
    tracker["avg_group"] = group
    return tracker


#: Scenario -> (rank -> tracker), given the ranks' shared two-rank group. Run in this order in
#: one world: after an error every rank must be ready for the next call (nobody left inside a
#: collective), which the closing scenario checks with a real reduction.
LAYOUT_SCENARIOS: dict[str, Callable[[int, Any], dict[str, Any]]] = {
    "unknown_on_every_rank": lambda rank, g: _mystery(g),
    "unknown_on_rank_0_known_on_rank_1": lambda rank, g: (
        _mystery(g) if rank == 0 else _v019(g, [4.0, 8.0])
    ),
    "known_plus_unknown_key_on_rank_1": lambda rank, g: (
        _v019(g, [4.0]) if rank == 0 else _v019(g, [4.0], loss_weights=torch.tensor([1.0]))
    ),
    "per_token_on_rank_0_only": lambda rank, g: _dev(g, per_token=rank == 0),
    "unknown_without_groups": lambda rank, g: _mystery(None),
    "known_everywhere": lambda rank, g: _v019(g, [2.0 + 2.0 * rank]),
}


def _layouts_worker(rank: int, args: Any) -> dict[str, tuple[str, Any]]:
    import torch.distributed as dist

    group = dist.new_group([0, 1])
    seen: dict[str, tuple[str, Any]] = {}
    for name, make in LAYOUT_SCENARIOS.items():
        MTPLossLoggingHelper.tracker = make(rank, group)
        try:
            seen[name] = ("ok", get_mtp_metrics(1.0))
        except ValueError as exc:
            loss = MTPLossLoggingHelper.tracker.get("loss_values")
            seen[name] = ("error", (str(exc), None if loss is None else loss.tolist()))
        dist.barrier()
    return seen


@pytest.fixture(scope="module")
def layout_results() -> dict[int, dict[str, tuple[str, Any]]]:
    return run_world("layouts")


def _errors(results: dict[int, dict[str, tuple[str, Any]]], scenario: str) -> dict[int, str]:
    errors = {}
    for rank, seen in results.items():
        kind, value = seen[scenario]
        assert kind == "error", f"rank {rank} returned {value!r} instead of raising"
        errors[rank] = value[0]
    return errors


def test_unknown_layout_on_every_rank_raises_everywhere(layout_results: Any) -> None:
    for rank, message in _errors(layout_results, "unknown_on_every_rank").items():
        assert "get_mtp_metrics" in message and "does not know" in message
        assert "'mystery_loss'" in message and "No rank entered the MTP reduction" in message
        assert f"rank {rank}" in message


def test_unknown_layout_on_one_rank_stops_the_rank_with_a_known_one(layout_results: Any) -> None:
    # Without the agreement round rank 1 would enter the reduction over the shared group alone.
    for message in _errors(layout_results, "unknown_on_rank_0_known_on_rank_1").values():
        assert "rank 0: MTPLossLoggingHelper.tracker holds keys" in message
        assert "'mystery_loss'" in message and "does not know" in message
    _, (_, loss) = layout_results[1]["unknown_on_rank_0_known_on_rank_1"]
    assert loss == [4.0, 8.0]  # neither reduced nor cleaned


def test_an_unknown_extra_key_on_one_rank_raises_everywhere(layout_results: Any) -> None:
    for message in _errors(layout_results, "known_plus_unknown_key_on_rank_1").values():
        assert "rank 1:" in message and "'loss_weights'" in message


def test_ranks_of_one_group_with_different_layouts_raise_everywhere(layout_results: Any) -> None:
    # dev's per-token reduction sends [2L] where the other rank's sends [L]: they cannot match.
    for message in _errors(layout_results, "per_token_on_rank_0_only").values():
        assert "differ" in message
        assert "calculate_per_token_loss: True" in message
        assert "calculate_per_token_loss: False" in message


def test_unknown_layout_without_groups_raises_locally(layout_results: Any) -> None:
    for rank, message in _errors(layout_results, "unknown_without_groups").items():
        assert f"rank {rank}:" in message and "'mystery_loss'" in message


def test_the_world_is_usable_after_the_errors(layout_results: Any) -> None:
    # loss 2 on rank 0, 4 on rank 1, AVG over the group: 3 on both; correct 1+1, total 2+2.
    for seen in layout_results.values():
        assert seen["known_everywhere"] == (
            "ok",
            {"mtp_1_loss": 3.0, "mtp_1_acceptance_rate": 50.0},
        )


def _grid_worker(rank: int, args: Any) -> dict[str, tuple[str, Any]]:
    import torch.distributed as dist

    # A 2 x 2 grid: reduce_group = "tensor" rows {0, 1}, {2, 3}; avg_group = "data" columns
    # {0, 2}, {1, 3}. Every rank creates every group, in the same order.
    rows = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    columns = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    row, column = rows[rank // 2], columns[rank % 2]
    seen: dict[str, tuple[str, Any]] = {}
    for name, unknown in (("unknown_on_rank_3", {3}), ("known_everywhere", set())):
        if rank in unknown:
            tracker = {"mystery_loss": torch.tensor([1.0]), "group_a": row, "group_b": column}
        else:
            tracker = _v019(column, [float(rank + 1)], reduce_group=row)
        MTPLossLoggingHelper.tracker = tracker
        try:
            seen[name] = ("ok", get_mtp_metrics(1.0))
        except ValueError as exc:
            seen[name] = ("error", (str(exc), None))
        dist.barrier()
    return seen


def test_unknown_layout_reaches_every_rank_of_a_grid_of_groups() -> None:
    # Rank 0 shares no group with rank 3: it learns through rank 1 or 2, in the second pass.
    results = run_world("grid", world=4)
    errors = _errors(results, "unknown_on_rank_3")
    for rank in (1, 2, 3):  # they share a group with rank 3: its keys are named
        assert "rank 3: MTPLossLoggingHelper.tracker holds keys" in errors[rank]
        assert "'mystery_loss'" in errors[rank]
    assert "rank 3 (learned through another group)" in errors[0]
    # loss: SUM over the row (1+2, 3+4), then AVG over the column: (3 + 7) / 2 on every rank;
    # correct 1 and total 2 per rank, SUM over both: 4 of 8.
    for seen in results.values():
        assert seen["known_everywhere"] == (
            "ok",
            {"mtp_1_loss": 5.0, "mtp_1_acceptance_rate": 50.0},
        )


# ----------------------------------------------------------------------------- dev's own logging


DEV_CASES = [(per_token, acceptance) for per_token in (True, False) for acceptance in (True, False)]
STEPS = 2
MICROBATCHES = 3
MTP_LAYERS = 2
LOSS_SCALE = 0.5


def _record_step(rank: int, step: int, per_token: bool, group: Any) -> None:
    """One training step's MTP records, as dev's ``process_mtp_loss`` makes them: per
    microbatch and MTP layer, ``save_loss_to_tracker(loss_sum, num_tokens, ...)`` with the
    counts only where acceptance is collected. Token counts differ between ranks and
    microbatches (one is 0), so a per-token mean differs from a mean of means."""
    from pipemetrics.sim.megatron.trackers import cpu_current_device

    helper = MTPLossLoggingHelper
    with cpu_current_device():
        for mb in range(MICROBATCHES):
            for layer in range(MTP_LAYERS):
                seed = 1 + rank * 100 + step * 10 + mb * 3 + layer
                tokens = 0.0 if (rank, step, mb, layer) == (1, 0, 2, 1) else float(seed % 7 + 1)
                loss_sum = torch.tensor(0.25 * seed * tokens)
                collect = helper.should_collect_acceptance()
                helper.save_loss_to_tracker(
                    loss_sum,
                    torch.tensor(tokens),
                    layer,
                    MTP_LAYERS,
                    correct=torch.tensor(float(seed % 5)) if collect else None,
                    total=torch.tensor(float(seed % 5 + seed % 3)) if collect else None,
                    avg_group=group,
                    calculate_per_token_loss=per_token,
                )


def _seed_key(tag: str) -> str | None:
    """Megatron's writer tag -> the seed's key (``mtp_1 loss`` -> ``mtp_1_loss``); ``None`` for
    the cumulative rate, which the seed does not return."""
    if tag.endswith(" loss"):
        return tag.replace(" ", "_")
    return None if "cumulative" in tag else tag


def _dev_worker(rank: int, args: Any) -> list[tuple[Any, list[dict[str, float]], list[Any]]]:
    import torch.distributed as dist

    from pipemetrics.sim.megatron.builtin_megatron_core import ScalarCollector

    group = dist.new_group([0, 1])
    helper = MTPLossLoggingHelper
    out = []
    for per_token, acceptance in DEV_CASES:
        megatron: list[dict[str, float]] = []
        helper.tracker = {}
        helper.configure_acceptance_collection(acceptance)
        for step in range(STEPS):
            _record_step(rank, step, per_token, group)
            writer = ScalarCollector()
            helper.track_mtp_metrics(LOSS_SCALE, step, writer)
            keyed = {_seed_key(tag): value for tag, value in writer.scalars.items()}
            megatron.append({k: v for k, v in keyed.items() if k is not None})
        reference: list[Any] = []
        helper.tracker = {}
        helper.configure_acceptance_collection(acceptance)
        for step in range(STEPS):
            _record_step(rank, step, per_token, group)
            reference.append(get_mtp_metrics(LOSS_SCALE))
            left = [k for k, v in helper.tracker.items() if torch.is_tensor(v) and bool(v.any())]
            reference.append(left)
        out.append(((per_token, acceptance), megatron, reference))
    return out


@NEEDS_PER_TOKEN_SAVE
def test_dev_layout_matches_devs_own_track_mtp_metrics() -> None:
    results = run_world("dev")
    for rank, cases in results.items():
        for (per_token, acceptance), megatron, reference in cases:
            where = f"rank {rank}, calculate_per_token_loss={per_token}, acceptance={acceptance}"
            for step in range(STEPS):
                got, left = reference[2 * step], reference[2 * step + 1]
                want = megatron[step]
                assert set(got) == set(want), where
                assert got == pytest.approx(want, rel=1e-6), where
                assert left == [], f"{where}: not cleaned: {left}"
                rates = [k for k in got if k.endswith("_acceptance_rate")]
                assert len(rates) == (MTP_LAYERS if acceptance else 0), where
    # Both ranks hold the reduced (identical) values.
    assert results[0] == results[1]


WORKERS: dict[str, Callable[[int, Any], Any]] = {
    "layouts": _layouts_worker,
    "grid": _grid_worker,
    "dev": _dev_worker,
}
