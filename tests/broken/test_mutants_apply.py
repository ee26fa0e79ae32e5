"""The mutants apply to the current reference, compile, and really change behaviour.

No processes are started. Behaviour is compared in one process: either in the documented local
mode (torch.distributed not initialised), or with a recording stand-in for ``torch.distributed``
and ``parallel_state`` patched into the loaded module, which lets one rank see what its peers
described in the metadata round and records which collectives it then enters. Every check runs
the same situation against the reference and the mutant and pins both outcomes.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import math
import uuid
from collections.abc import Callable
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

from pipemetrics.reference.megatron_common import get_moe_metrics_tracker
from pipemetrics.sim.mcore import installed_features
from pipemetrics.sim.mcore.mtp_tracker import (
    installed_mtp_layout,
    installed_z_loss_nan_at_zero_coeff,
)
from pipemetrics.sim.megatron.trackers import (
    apply_moe_records,
    cpu_current_device,
    reset_trackers,
)
from pipemetrics.sim.model.records import MoeRecord

from ..conftest import set_mtp_tracker
from .mutants import (
    MUTANTS,
    REFERENCE_PATH,
    Mutant,
    MutantApplyError,
    mutant_source,
    reference_source,
    write_mutant,
)

AUX = "load_balancing_loss"
GLOBAL = "global_load_balancing_loss"
Z = "z_loss"


pytestmark = pytest.mark.usefixtures("fresh_trackers")

#: Mutants whose code needs an API the installed megatron-core lacks, with the reason.
NEEDS_TO_RUN: dict[str, str] = {}
#: Mutants whose bug cannot show on the installed megatron-core (also those that cannot run).
NEEDS_TO_SHOW: dict[str, str] = {}
if not installed_features().class_tracker:
    NEEDS_TO_RUN["moe_dp_avg_over_expert_data_group"] = (
        "the mutant hands MoEMetricsTracker._sync_metrics a ProcessGroupCollection; "
        "megatron.core.transformer.moe.moe_logging is missing in the installed megatron-core"
    )
    NEEDS_TO_SHOW.update(NEEDS_TO_RUN)
    if not installed_features().legacy_saver_has_dp_flag:
        NEEDS_TO_SHOW["moe_placeholder_skips_dp_avg"] = (
            "needs a per-entry data-parallel setting (save_to_aux_losses_tracker's "
            "reduce_group_has_dp, or moe_logging's MetricEntry.needs_dp_avg), missing in the "
            "installed megatron-core"
        )


if not hasattr(MTPLossLoggingHelper, "reduce_metrics_in_tracker"):
    NEEDS_TO_RUN["mtp_nemo_rl_reads_loss_values_only"] = (
        "NeMo-RL's copy calls MTPLossLoggingHelper.reduce_metrics_in_tracker, missing in the "
        "installed megatron-core"
    )
    NEEDS_TO_SHOW.update(NEEDS_TO_RUN)
if not installed_z_loss_nan_at_zero_coeff():
    NEEDS_TO_SHOW["moe_nan_mean_zeroed"] = (
        "its bug hides a NaN mean, which the router records for z_loss at moe_z_loss_coeff=0.0 "
        "(z_loss / coeff); the installed router records the plain mean there (megatron-core "
        "dev), so no reachable state holds a NaN"
    )
if installed_mtp_layout() != "loss_sums":
    NEEDS_TO_SHOW["mtp_nemo_rl_reads_loss_values_only"] = (
        "NeMo-RL's copy reads tracker['loss_values']; its bug shows where the training path "
        "writes megatron-core dev's loss_sums layout, not the installed helper's "
        f"{installed_mtp_layout()!r}"
    )


def _mutant_params(needs: dict[str, str]) -> list[Any]:
    return [
        pytest.param(name, marks=[pytest.mark.skip(reason=needs[name])] if name in needs else [])
        for name in sorted(MUTANTS)
    ]


def _fresh_trackers(module: ModuleType) -> None:
    """Empty trackers with no history. 0.18+: a new ``MoEMetricsTracker`` (what
    ``get_moe_metrics`` keeps on the tracker, its steady state, goes with the old one).
    0.13-0.17's dict tracker is only cleared in place, so ``module``'s view of it, which holds
    that state, is dropped too."""
    reset_trackers()
    getattr(module, "_LEGACY_TRACKERS", []).clear()


def _load(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"mutant_{uuid.uuid4().hex[:12]}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def modules(tmp_path_factory: pytest.TempPathFactory) -> dict[str, ModuleType]:
    """The reference (key ``"reference"``) and every mutant, loaded from written files."""
    directory = tmp_path_factory.mktemp("mutants")
    loaded = {"reference": _load(REFERENCE_PATH)}
    for name in MUTANTS:
        loaded[name] = _load(write_mutant(name, directory))
    return loaded


# ----------------------------------------------------------------------------- structure


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_mutant_applies_compiles_and_differs(name: str) -> None:
    mutant = MUTANTS[name]
    source = mutant_source(name)
    compile(source, f"{name}.py", "exec")
    reference = reference_source()
    assert source != reference
    for snippet, replacement in mutant.edits:
        assert reference.count(snippet) == 1, f"{name}: snippet not unique in the reference"
        assert replacement in source


def test_write_mutant_writes_the_source(tmp_path: Path) -> None:
    name = next(iter(MUTANTS))
    path = write_mutant(name, tmp_path / "nested")
    assert path == tmp_path / "nested" / f"{name}.py"
    assert path.read_text(encoding="utf-8") == mutant_source(name)


def test_missing_or_repeated_snippet_is_loud(monkeypatch: pytest.MonkeyPatch) -> None:
    def bogus(snippet: str) -> Mutant:
        return Mutant(
            name="bogus",
            description="x",
            edits=((snippet, "y"),),
            fails=("moe.values",),
            functions=("get_moe_metrics",),
            sim_outcome=None,
            cause="loss_scale_twice",
        )

    monkeypatch.setitem(MUTANTS, "bogus", bogus("this text is not in the reference"))
    with pytest.raises(MutantApplyError, match="occurs 0 times"):
        mutant_source("bogus")
    monkeypatch.setitem(
        MUTANTS, "bogus", bogus("import torch")
    )  # twice: import torch(.distributed)
    with pytest.raises(MutantApplyError, match="occurs 2 times"):
        mutant_source("bogus")
    with pytest.raises(KeyError, match="unknown mutant"):
        mutant_source("no_such_mutant")


def test_metadata_is_validated() -> None:
    base: dict[str, Any] = {
        "name": "m",
        "description": "d",
        "edits": (("a", "b"),),
        "fails": ("moe.values",),
        "functions": ("get_moe_metrics",),
        "sim_outcome": None,
        "cause": "loss_scale_twice",
    }
    Mutant(**base)
    for bad in (
        {"fails": ("moe.value",)},
        {"functions": ("get_metrics",)},
        {"sim_outcome": "hang"},
        {"edits": (("a", "a"),)},
        {"edits": ()},
        {"name": "not an identifier"},
        {"cause": "no_such_cause"},
        {"cause": None},  # neither a cause nor why there is none
        {"no_cause": "a hang"},  # both
    ):
        with pytest.raises(ValueError):
            Mutant(**(base | bad))


def test_brief_coverage() -> None:
    """The outcomes the simulator must produce, and the properties the suite must fail."""
    outcomes = {m.sim_outcome for m in MUTANTS.values()}
    assert {"deadlock", "mismatch", None} <= outcomes
    failed = {p for m in MUTANTS.values() for p in m.fails}
    assert {
        "moe.no_hang",
        "moe.values",
        "mtp.keys",
        "mtp.acceptance_rate",
        "moe.reset",
        "track_names.router_parity",
        "broadcast.errors_everywhere",
    } <= failed


# ----------------------------------------------------------------------------- stand-in world


class FakeDist:
    """Enough of ``torch.distributed`` for one rank of a CPU (gloo) world.

    ``peers`` maps another rank to the object it contributes to ``all_gather_object`` (ranks
    not listed contribute the same object as this rank). Every collective entered is recorded.
    """

    ReduceOp = dist.ReduceOp

    def __init__(
        self,
        rank: int,
        world: int,
        peers: dict[int, Any] | None = None,
        ranks: list[int] | None = None,
    ) -> None:
        self.rank = rank
        self.world = world
        self.peers = peers or {}
        self.ranks = list(range(world)) if ranks is None else ranks
        """The members of the group passed (global ranks); ``peers`` is keyed by group rank."""
        self.calls: list[str] = []
        self.contributions: list[torch.Tensor] = []
        """What the other ranks contribute to the next ``all_reduce`` (each used once, in
        order; by default they contribute what this rank does)."""
        self.roots: list[int | str] = []
        """The global root of each broadcast entered."""
        self.contiguous: list[bool] = []
        """Whether the tensor of each broadcast entered was contiguous (gloo sends a
        non-contiguous one's storage as it lies)."""
        self.group = SimpleNamespace(WORLD=None)

    def is_available(self) -> bool:
        return True

    def is_initialized(self) -> bool:
        return True

    def get_rank(self, group: Any = None) -> int:
        return self.rank

    def get_world_size(self, group: Any = None) -> int:
        return self.world

    def get_backend(self, group: Any = None) -> str:
        return "gloo"

    def get_process_group_ranks(self, group: Any) -> list[int]:
        return list(self.ranks)

    def all_gather_object(self, out: list[Any], obj: Any, group: Any = None) -> None:
        self.calls.append("all_gather_object")
        me = self.ranks.index(self.rank)
        for i in range(len(out)):
            peer = obj if i == me else self.peers.get(i, obj)
            if isinstance(obj, dict) and isinstance(peer, dict) and "arguments" not in peer:
                peer = {**peer, "arguments": obj.get("arguments")}  # peers pass the same ones
            if i != me and isinstance(obj, tuple) and isinstance(obj[0], int):
                peer = (obj[0], peer)  # broadcast_tensor's (src_rank, description): same source
            out[i] = peer

    def all_reduce(self, tensor: torch.Tensor, op: Any = None, group: Any = None) -> None:
        self.calls.append("all_reduce")
        if self.contributions:
            theirs = self.contributions.pop(0)
            assert op == dist.ReduceOp.MAX, op
            tensor.copy_(torch.maximum(tensor, theirs))

    def broadcast(
        self,
        tensor: torch.Tensor,
        src: int | None = None,
        group: Any = None,
        group_src: int | None = None,
    ) -> None:
        """torch's signature: ``src`` is a global rank, ``group_src`` a rank within the group."""
        self.calls.append("broadcast")
        self.contiguous.append(tensor.is_contiguous())
        if group_src is None:
            assert src is not None
            self.roots.append(src)
        elif 0 <= group_src < len(self.ranks):
            self.roots.append(self.ranks[group_src])
        else:
            self.roots.append(f"group rank {group_src} out of range")


def fake_parallel_state(**overrides: Any) -> SimpleNamespace:
    """Enough of ``parallel_state`` for the last pipeline stage of a world without a virtual
    pipeline or expert parallelism (``overrides`` replace functions)."""
    functions: dict[str, Any] = {
        "model_parallel_is_initialized": lambda: True,
        "is_pipeline_last_stage": lambda ignore_virtual=True, vp_stage=None: True,
        "get_virtual_pipeline_model_parallel_rank": lambda: None,
        "get_expert_data_parallel_group": lambda: "expert_data",
        "get_pipeline_model_parallel_group": lambda: "pipeline",
    }
    functions.update(overrides)
    return SimpleNamespace(**functions)


def _fake_world(
    module: ModuleType, monkeypatch: pytest.MonkeyPatch, fake: FakeDist
) -> list[list[tuple[str, int]]]:
    """Patch ``fake`` into ``module``; returns the list of ``_sync_metrics`` calls, each as
    ``[(name, length), ...]`` in the order the names would be reduced."""
    monkeypatch.setattr(module, "dist", fake)
    monkeypatch.setattr(module, "parallel_state", fake_parallel_state())
    syncs: list[list[tuple[str, int]]] = []
    tracker = module.get_moe_metrics_tracker()

    def sync(names: list[str], pg_collection: Any = None) -> None:
        syncs.append([(n, int(tracker.metrics[n].values.numel())) for n in names])

    _replace_sync(monkeypatch, tracker, sync)
    return syncs


def _replace_sync(mp: pytest.MonkeyPatch, tracker: Any, sync: Callable[..., None]) -> None:
    """Stand ``sync`` in for the tracker's reduction (0.18+: ``MoEMetricsTracker._sync_metrics``;
    the reference's view of 0.13-0.17's dict tracker has none and its reduction is written out
    in ``_sync``, which calls a ``_sync_metrics`` it finds)."""
    mp.setattr(tracker, "_sync_metrics", sync, raising=hasattr(tracker, "_sync_metrics"))


def _peer_payload(module: ModuleType, entries: dict[str, int], track: list[str], req: int) -> Any:
    """Another rank's metadata: entries recorded with no groups and needs_dp_avg False."""
    return {
        "error": None,
        "entries": {
            n: module._EntryMeta(k, str(torch.float32), None, None, False)
            for n, k in entries.items()
        },
        "track_names": track,
        "requested_length": req,
        "kinds": [],
    }


def _record(name: str, values: list[float]) -> None:
    """Record a full per-layer vector (no groups, needs_dp_avg False: never a placeholder)
    through the installed release's recording function."""
    apply_moe_records(
        [
            MoeRecord(
                name=name,
                layer_number=layer,
                value=value,
                num_layers=len(values),
                needs_dp_avg=False,
            )
            for layer, value in enumerate(values, start=1)
        ],
        {},
    )


def _values(result: dict[str, Any], suffix: str, prefix: str = "") -> list[Any]:
    """The values of the keys with ``prefix`` and ``suffix``, in key order; NaN as "nan" (so
    that it compares equal to itself). Key spelling is deliberately not observed here."""
    return [
        "nan" if isinstance(v, float) and math.isnan(v) else v
        for k, v in sorted(result.items())
        if k.startswith(prefix) and k.endswith(suffix)
    ]


# ----------------------------------------------------------------------------- behaviour
# Each check runs one situation on a module and returns what can be observed; the test pins the
# observation for the reference and for the mutant.

Check = Callable[[ModuleType, pytest.MonkeyPatch], Any]


def _empty_stage(m: ModuleType, mp: pytest.MonkeyPatch) -> Any:
    # This rank (global rank 1, stage 0) recorded nothing; rank 0 (stage 1) recorded AUX over
    # 5 slots (4 layers + 1 MTP layer).
    fake = FakeDist(1, 2, {0: _peer_payload(m, {AUX: 5}, [AUX], 5)})
    syncs = _fake_world(m, mp, fake)
    out = m.get_moe_metrics(1.0, None, False, 4, 1, [AUX])
    return out.get(AUX), syncs


def _preinit_length(m: ModuleType, mp: pytest.MonkeyPatch) -> Any:
    fake = FakeDist(1, 2, {0: _peer_payload(m, {AUX: 5}, [AUX], 5)})
    syncs = _fake_world(m, mp, fake)
    m.get_moe_metrics(1.0, None, False, 4, 1, [AUX])
    _fresh_trackers(m)
    mp.undo()
    local = m.get_moe_metrics(1.0, None, True, 4, 1, [AUX])  # local mode, nothing recorded
    return syncs, len([k for k in local if k.startswith("moe/")])


def _sync_order(m: ModuleType, mp: pytest.MonkeyPatch) -> Any:
    # The router records z_loss before the aux losses, and load_balancing before global.
    _record(Z, [1.0, 1.0, 1.0, 1.0])
    _record(AUX, [2.0, 2.0, 2.0, 2.0])
    _record(GLOBAL, [3.0, 3.0, 3.0, 3.0])
    syncs = _fake_world(m, mp, FakeDist(1, 2))
    m.get_moe_metrics(1.0)
    return [[n for n, _ in call] for call in syncs]


def _rank_zero_raises(m: ModuleType, mp: pytest.MonkeyPatch) -> Any:
    seen = []
    for rank in (0, 1):
        _fresh_trackers(m)
        _record(AUX, [2.0, 2.0])
        fake = FakeDist(rank, 2)
        _fake_world(m, mp, fake)
        try:
            out: Any = m.get_moe_metrics(1.0)
        except RuntimeError as exc:
            out = f"RuntimeError before {fake.calls}: {exc}"
        seen.append(out if isinstance(out, str) else (out.get(AUX), fake.calls))
        mp.undo()
    return seen


def _mean_with_mtp(m: ModuleType, mp: pytest.MonkeyPatch) -> Any:
    _record(AUX, [1.0, 2.0, 3.0, 4.0, 10.0])  # 4 decoder layers + 1 MTP layer
    return m.get_moe_metrics(1.0, None, False, 4, 1, [AUX])[AUX]


def _mtp_keys(m: ModuleType, mp: pytest.MonkeyPatch) -> Any:
    set_mtp_tracker([4.0, 8.0], [3.0, 1.0], [4.0, 2.0])
    return sorted(m.get_mtp_metrics(0.5))


def _mtp_rate_scaled(m: ModuleType, mp: pytest.MonkeyPatch) -> Any:
    set_mtp_tracker([4.0], [3.0], [4.0])
    return _values(m.get_mtp_metrics(0.5), "_acceptance_rate")


def _mtp_rate_zero_total(m: ModuleType, mp: pytest.MonkeyPatch) -> Any:
    set_mtp_tracker([4.0, 4.0, 4.0], [0.0, 2.0, 1.0], [0.0, 0.0, 4.0])
    return _values(m.get_mtp_metrics(1.0), "_acceptance_rate")


def _mtp_rate_empty_layer(m: ModuleType, mp: pytest.MonkeyPatch) -> Any:
    set_mtp_tracker([0.0, 4.0], [0.0, 1.0], [0.0, 4.0])  # layer 1 masked: loss 0, 0 of 0
    return _values(m.get_mtp_metrics(1.0), "_acceptance_rate")


def _two_steps(m: ModuleType, mp: pytest.MonkeyPatch) -> Any:
    totals: dict[str, Any] = {}
    _record(AUX, [2.0, 4.0])
    first = m.get_moe_metrics(1.0, totals)
    _record(AUX, [1.0, 1.0])
    second = m.get_moe_metrics(1.0, totals)
    values = get_moe_metrics_tracker().metrics[AUX].values.tolist()
    return first[AUX], second[AUX], float(totals[AUX]), values


def _track_names(m: ModuleType, mp: pytest.MonkeyPatch) -> Any:
    configs = [
        SimpleNamespace(moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.01),
        SimpleNamespace(
            moe_router_load_balancing_type="aux_loss",
            moe_aux_loss_coeff=0.01,
            moe_z_loss_coeff=None,
        ),
        SimpleNamespace(moe_z_loss_coeff=1e-3),
    ]
    return [m.get_aux_loss_track_names(c) for c in configs]


def _track_names_order(m: ModuleType, mp: pytest.MonkeyPatch) -> Any:
    config = SimpleNamespace(
        moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.01, moe_z_loss_coeff=1e-3
    )
    return m.get_aux_loss_track_names(config)


def _wired_recording_stage(m: ModuleType, mp: pytest.MonkeyPatch) -> Any:
    # Rank 1, an MoE stage: the router recorded z_loss, then the aux loss; its peer (a stage
    # without MoE layers) recorded nothing. Both pass the names the module's own
    # get_aux_loss_track_names gives: the order this rank reduces in must be its peer's.
    _record(Z, [1.0, 1.0, 1.0, 1.0])
    _record(AUX, [2.0, 2.0, 2.0, 2.0])
    config = SimpleNamespace(
        moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.01, moe_z_loss_coeff=1e-3
    )
    track = m.get_aux_loss_track_names(config)
    syncs = _fake_world(m, mp, FakeDist(1, 2, {0: _peer_payload(m, {}, track, 4)}))
    m.get_moe_metrics(1.0, None, False, 4, 0, track)
    return [[n for n, _ in call] for call in syncs]


def _broadcast_transposed_source(m: ModuleType, mp: pytest.MonkeyPatch) -> Any:
    # Rank 1 of 2, the source, passes a transposed (non-contiguous) view.
    fake = FakeDist(1, 2)
    mp.setattr(m, "dist", fake)
    m.broadcast_tensor(torch.arange(6.0).reshape(2, 3).t(), 1, object())
    return fake.contiguous


def _moe_names_without_z(m: ModuleType, mp: pytest.MonkeyPatch) -> Any:
    empty = sorted(m.get_moe_metrics(1.0, None, False, 2, 0, []))
    _record(AUX, [2.0, 4.0])
    return empty, sorted(m.get_moe_metrics(1.0))


def _broadcast_bad_peer(m: ModuleType, mp: pytest.MonkeyPatch) -> Any:
    # Rank 1 is a receiver with a good buffer; rank 2 passed a wrong-shaped buffer.
    seen = {}
    descs = {
        0: ("src", (4,), "torch.float32", "cpu"),
        1: ("recv", (4,), "torch.float32", "cpu", True),
        2: ("recv", (5,), "torch.float32", "cpu", True),
    }
    for me, buffer in ((1, torch.zeros(4)), (2, torch.zeros(5))):
        fake = FakeDist(me, 3, descs)
        mp.setattr(m, "dist", fake)
        try:
            m.broadcast_tensor(buffer, 0, object())
            seen[me] = ("returned", fake.calls)
        except ValueError as exc:
            seen[me] = ("ValueError", fake.calls, "rank 2" in str(exc))
        mp.undo()
    return seen


def _moe_loss_scale(m: ModuleType, mp: pytest.MonkeyPatch) -> Any:
    _record(AUX, [2.0, 4.0])
    out = m.get_moe_metrics(0.5, None, True)
    return out[AUX], _values(out, "", prefix="moe/")


def _moe_per_layer(m: ModuleType, mp: pytest.MonkeyPatch) -> Any:
    _record(AUX, [2.0, 4.0])
    return sorted(k for k in m.get_moe_metrics(1.0, None, True) if k.startswith("moe/"))


def _mtp_loss_scale(m: ModuleType, mp: pytest.MonkeyPatch) -> Any:
    set_mtp_tracker([4.0], [1.0], [2.0])
    return _values(m.get_mtp_metrics(0.25), "_loss")


def _round_up(m: ModuleType, mp: pytest.MonkeyPatch) -> Any:
    return [m._round_up_to_multiple(v, k) for v, k in ((0, 4), (4, 4), (5, 4), (8, 1), (7, 3))]


def _broadcast_receive_none(m: ModuleType, mp: pytest.MonkeyPatch) -> Any:
    # Rank 1 of 2 receives an int64[3] from rank 0, passing no buffer.
    fake = FakeDist(1, 2, {0: ("src", (3,), "torch.int64", "cpu")})
    mp.setattr(m, "dist", fake)
    out = m.broadcast_tensor(None, 0, object())
    return str(out.dtype), list(out.shape), fake.calls


def _broadcast_into_buffer(m: ModuleType, mp: pytest.MonkeyPatch) -> Any:
    # Rank 1 of 2 receives a float32[3] from rank 0 into its own valid buffer.
    fake = FakeDist(1, 2, {0: ("src", (3,), "torch.float32", "cpu")})
    mp.setattr(m, "dist", fake)
    buffer = torch.zeros(3)
    out = m.broadcast_tensor(buffer, 0, object())
    return out is buffer, fake.calls


def _broadcast_wrong_dtype(m: ModuleType, mp: pytest.MonkeyPatch) -> Any:
    # Rank 1 of 2 passes an int64 buffer of the right shape for a float32[3] source.
    fake = FakeDist(1, 2, {0: ("src", (3,), "torch.float32", "cpu")})
    mp.setattr(m, "dist", fake)
    try:
        m.broadcast_tensor(torch.zeros(3, dtype=torch.int64), 0, object())
    except (ValueError, TypeError) as exc:
        return type(exc).__name__, fake.calls, "rank 1" in str(exc)
    return "returned", fake.calls


def _broadcast_subgroup_roots(m: ModuleType, mp: pytest.MonkeyPatch) -> Any:
    # Global rank 3, the source (last stage) of pipeline group [1, 3]; then global rank 1, a
    # receiver passing None in new_group [1, 2, 3] whose source is global rank 2 (group rank 1).
    roots = []
    fake = FakeDist(3, 4, ranks=[1, 3])
    mp.setattr(m, "dist", fake)
    m.broadcast_tensor(torch.zeros(3), 3, object())
    roots += fake.roots
    fake = FakeDist(1, 4, {1: ("src", (3,), "torch.float32", "cpu")}, ranks=[1, 2, 3])
    mp.setattr(m, "dist", fake)
    m.broadcast_tensor(None, 2, object())
    return roots + fake.roots


def _placeholder_dp_avg(m: ModuleType, mp: pytest.MonkeyPatch) -> Any:
    # This rank (1 of 2) recorded only z_loss; rank 0 recorded AUX with the router's
    # needs_dp_avg=True. The reduction must treat this rank's AUX placeholder alike.
    _record(Z, [1.0, 1.0, 1.0, 1.0])
    peer = _peer_payload(m, {}, [], 0)
    peer["entries"][AUX] = m._EntryMeta(4, str(torch.float32), None, None, True)
    _fake_world(m, mp, FakeDist(1, 2, {0: peer}))
    tracker = m.get_moe_metrics_tracker()
    seen: list[dict[str, bool]] = []

    def sync(names: list[str], pg_collection: Any = None) -> None:
        seen.append({n: bool(tracker.metrics[n].needs_dp_avg) for n in names})

    _replace_sync(mp, tracker, sync)
    m.get_moe_metrics(1.0)
    return seen


def _nan_mean(m: ModuleType, mp: pytest.MonkeyPatch) -> Any:
    # What the router records for z_loss with moe_z_loss_coeff=0.0: z_loss / 0.0 = NaN.
    _record(Z, [math.nan, math.nan])
    out = m.get_moe_metrics(1.0, None, True)
    return _values(out, Z), _values(out, "", prefix="moe/")


def _mtp_reduce_ranks(m: ModuleType, mp: pytest.MonkeyPatch) -> Any:
    # Ranks 0 and 1 of 2 both hold the MTP tracker: which of them enter the helper's reduction
    # (its collectives)? The tracker is in the installed helper's own layout (the reference
    # reduces that one with the helper's methods, `_MTP_REDUCERS`), and those methods record.
    release = m._installed_mtp_release()
    marker = next(lay.marker for lay in m._MTP_LAYOUTS if lay.release == release)
    seen = []
    for rank in (0, 1):
        if marker == "loss_values":
            set_mtp_tracker([4.0], [1.0], [2.0])
        else:
            MTPLossLoggingHelper.tracker = {marker: torch.tensor([4.0]), "reduce_group": None,
                                            "avg_group": None}  # fmt: skip
        calls: list[str] = []

        def reduce(name: str, calls: list[str] = calls) -> None:
            calls.append("reduce")
            tracker = MTPLossLoggingHelper.tracker
            if name == "reduce_loss_in_tracker" and "loss_sums" in tracker:  # dev, no groups
                tracker["values"] = tracker["loss_sums"]

        for name in m._MTP_REDUCERS[release]:
            mp.setattr(MTPLossLoggingHelper, name, functools.partial(reduce, name))
        mp.setattr(m, "dist", FakeDist(rank, 2))
        # dev: a rank that skipped reduce_loss_in_tracker has no "values" to read
        with contextlib.suppress(KeyError):
            m.get_mtp_metrics(1.0)
        seen.append(calls[:1])
        mp.undo()
    return seen


def _mtp_training_path(m: ModuleType, mp: pytest.MonkeyPatch) -> Any:
    # megatron-core dev's process_mtp_loss saves through save_loss_to_tracker(loss_sum,
    # num_tokens, ...): how many metrics does this holder get back? (None: no such path.)
    if installed_mtp_layout() != "loss_sums":
        return None
    with cpu_current_device():
        MTPLossLoggingHelper.save_loss_to_tracker(
            torch.tensor(6.0), torch.tensor(3.0), 0, 1,
            correct=torch.tensor(2.0), total=torch.tensor(3.0), calculate_per_token_loss=True,
        )  # fmt: skip
    return len(m.get_mtp_metrics(1.0))


def _mtp_after_call(m: ModuleType, mp: pytest.MonkeyPatch) -> Any:
    set_mtp_tracker([4.0, 2.0], [1.0, 1.0], [2.0, 2.0])
    m.get_mtp_metrics(0.5)
    tracker = MTPLossLoggingHelper.tracker
    return [tracker[k].tolist() for k in ("loss_values", "correct_values", "total_values")]


def _standalone_mtp_slots(m: ModuleType, mp: pytest.MonkeyPatch) -> Any:
    # This rank is not the last stage but holds the MTP layer (a standalone MTP stage): its
    # router recorded AUX into the MTP slot (num_layers + 1) too. What enters the reduction?
    _record(AUX, [1.0, 2.0, 3.0, 4.0, 10.0])
    _fake_world(m, mp, FakeDist(1, 2))
    mp.setattr(m, "parallel_state", fake_parallel_state(is_pipeline_last_stage=lambda **_: False))
    tracker = m.get_moe_metrics_tracker()
    seen: list[list[float]] = []
    _replace_sync(
        mp, tracker, lambda names, pg=None: seen.append(tracker.metrics[AUX].values.tolist())
    )
    m.get_moe_metrics(1.0, None, False, 4, 1, [AUX])
    return seen


def _virtual_pipeline_last_stage(m: ModuleType, mp: pytest.MonkeyPatch) -> Any:
    # The last pipeline stage of a virtual pipeline of 2 chunks, virtual rank 0 (what
    # initialize_model_parallel sets): Megatron's is_pipeline_last_stage(ignore_virtual=False,
    # vp_stage=v) is True only for v == 1.
    set_mtp_tracker([4.0], [1.0], [2.0])
    last = fake_parallel_state(
        is_pipeline_last_stage=lambda ignore_virtual=True, vp_stage=None: (
            ignore_virtual or vp_stage == 1
        ),
        get_virtual_pipeline_model_parallel_rank=lambda: 0,
    )
    mp.setattr(m, "parallel_state", last)
    return len(m.get_mtp_metrics(1.0))  # how many metrics (their keys are another check's)


def _dp_average_group(m: ModuleType, mp: pytest.MonkeyPatch) -> Any:
    # Which data-parallel group does the reduction average over? (None: Megatron's default,
    # parallel_state's data-parallel group.)
    _record(AUX, [2.0, 4.0])
    _fake_world(m, mp, FakeDist(1, 2))
    tracker = m.get_moe_metrics_tracker()
    seen: list[Any] = []
    _replace_sync(
        mp, tracker, lambda names, pg=None: seen.append(getattr(pg, "dp_cp_gtp_remat", None))
    )
    m.get_moe_metrics(1.0)
    return seen


def _names_from_the_second_step(m: ModuleType, mp: pytest.MonkeyPatch) -> Any:
    # A forward-only first step records nothing; the second records AUX (on every rank).
    fake = FakeDist(1, 2)
    _fake_world(m, mp, fake)
    first = m.get_moe_metrics(1.0)
    _record(AUX, [2.0, 4.0])
    second = m.get_moe_metrics(1.0)
    return first.get(AUX), second.get(AUX), fake.calls.count("all_gather_object")


def _a_peer_changed_after_the_steady_state(m: ModuleType, mp: pytest.MonkeyPatch) -> Any:
    # The same names three times; in the third call another rank's tracker has changed.
    fake = FakeDist(0, 2)
    _fake_world(m, mp, fake)
    for call in range(3):
        _record(AUX, [2.0, 4.0])
        if call == 2:
            fake.contributions.append(torch.tensor([1] + [0] * 8))  # "changed", in its vector
        try:
            m.get_moe_metrics(1.0)
        except RuntimeError as exc:
            return str(exc)
    return fake.calls.count("all_gather_object")


def _moe_after_mtp(m: ModuleType, mp: pytest.MonkeyPatch) -> Any:
    # The MoE tracker holds this step's AUX when get_mtp_metrics runs first.
    _record(AUX, [2.0, 4.0])
    set_mtp_tracker([4.0], [1.0], [2.0])
    m.get_mtp_metrics(1.0)
    return get_moe_metrics_tracker().metrics[AUX].values.tolist()


SYNC_5 = [[(AUX, 5)]]


#: mutant -> (situation, what the reference shows, what the mutant shows)
def _outcome(call: Callable[[], Any]) -> Any:
    """What a call returned, or the type of the exception it raised."""
    try:
        return call()
    except (ValueError, TypeError) as exc:
        return type(exc).__name__


def _moe_scale_objects(m: ModuleType, mp: pytest.MonkeyPatch) -> Any:
    # The same scale as a numpy float64 (a float subclass) and as a 0-d tensor.
    import numpy as np

    seen = []
    for scale in (np.float64(1.0), torch.tensor(1.0)):
        _fresh_trackers(m)
        _record(AUX, [2.0, 4.0])
        seen.append(_outcome(lambda scale=scale: m.get_moe_metrics(scale)[AUX]))
    return seen


def _moe_negative_scale(m: ModuleType, mp: pytest.MonkeyPatch) -> Any:
    _record(AUX, [2.0, 4.0])
    return _outcome(lambda: _values(m.get_moe_metrics(-0.5, None, True), "", prefix="moe/"))


def _mtp_no_argument(m: ModuleType, mp: pytest.MonkeyPatch) -> Any:
    set_mtp_tracker([4.0], [1.0], [2.0])
    return _outcome(lambda: _values(m.get_mtp_metrics(), "_loss"))


def _moe_num_layers_none(m: ModuleType, mp: pytest.MonkeyPatch) -> Any:
    _record(AUX, [2.0, 4.0])
    return _outcome(lambda: m.get_moe_metrics(1.0, None, False, None, None, [AUX])[AUX])


BEHAVIOUR: dict[str, tuple[Check, Any, Any]] = {
    "moe_empty_stage_returns_early": (
        _empty_stage,
        (0.0, SYNC_5),  # the empty stage enters the pipeline reduction with a zero entry
        (None, []),  # ... the mutant returns {} without entering it
    ),
    "moe_preinit_without_mtp": (
        _preinit_length,
        (SYNC_5, 5),  # peers reduce float32[5]; 5 per-layer values locally
        ([[(AUX, 4)]], 4),  # this rank would send float32[4]: a size mismatch
    ),
    "moe_local_insertion_order": (
        _sync_order,
        [[GLOBAL, AUX, Z]],
        [[Z, AUX, GLOBAL]],
    ),
    "moe_raises_on_rank0": (
        _rank_zero_raises,
        [(2.0, ["all_reduce", "all_gather_object"])] * 2,
        [
            "RuntimeError before []: get_moe_metrics: logging rank 0 failed",
            (2.0, ["all_reduce", "all_gather_object"]),
        ],
    ),
    "moe_mean_over_num_layers": (_mean_with_mtp, 4.0, 5.0),  # sum 20 over 5 slots, not 4
    "mtp_zero_based_keys": (
        _mtp_keys,
        ["mtp_1_acceptance_rate", "mtp_1_loss", "mtp_2_acceptance_rate", "mtp_2_loss"],
        ["mtp_0_acceptance_rate", "mtp_0_loss", "mtp_1_acceptance_rate", "mtp_1_loss"],
    ),
    "mtp_acceptance_scaled": (_mtp_rate_scaled, [75.0], [37.5]),
    # correct/total = 0/0, 2/0, 1/4: the clamp gives 0 and 100 (200 clamped); without it nan
    # and inf (clamped to 100).
    "mtp_acceptance_unclamped_total": (
        _mtp_rate_zero_total,
        [0.0, 100.0, 25.0],
        ["nan", 100.0, 25.0],
    ),
    # a layer without tokens (0 of 0): Megatron's clamp gives 0; the mutant's "nothing wrong"
    "mtp_empty_layer_rate_hundred": (_mtp_rate_empty_layer, [0.0, 25.0], [100.0, 25.0]),
    "moe_tracker_not_cleared": (
        _two_steps,
        (3.0, 1.0, 4.0, [0.0, 0.0]),
        (3.0, 4.0, 7.0, [3.0, 5.0]),
    ),
    "track_names_always_z_loss": (
        _track_names,
        [[AUX], [AUX], [Z]],
        [[Z, AUX], [Z, AUX], [Z]],
    ),
    "track_names_aux_before_z_loss": (_track_names_order, [Z, AUX], [AUX, Z]),
    # the reference reduces in sorted order on every rank; the lineage copy in its own
    # insertion order (the router's), which its peer, pre-initialised from [AUX, Z], does not
    "moe_wired_names_paired_by_position": (_wired_recording_stage, [[AUX, Z]], [[Z, AUX]]),
    "broadcast_source_not_contiguous": (_broadcast_transposed_source, [True], [False]),
    "moe_always_reports_z_loss": (
        _moe_names_without_z,
        ([], [AUX]),
        ([Z], [AUX, Z]),
    ),
    "broadcast_local_buffer_check": (
        _broadcast_bad_peer,
        {
            1: ("ValueError", ["all_gather_object"], True),
            2: ("ValueError", ["all_gather_object"], True),
        },
        {
            1: ("returned", ["all_gather_object", "broadcast"]),  # blocks in the broadcast
            2: ("ValueError", ["all_gather_object"], True),
        },
    ),
    "moe_loss_scale_twice": (_moe_loss_scale, (1.5, [1.0, 2.0]), (0.75, [1.0, 2.0])),
    "moe_loss_scale_tensor_rejected": (
        _moe_scale_objects,
        [3.0, 3.0],
        [3.0, "ValueError"],
    ),
    "moe_loss_scale_exact_float_type": (
        _moe_scale_objects,
        [3.0, 3.0],
        ["ValueError", "ValueError"],
    ),
    "moe_loss_scale_negative_rejected": (
        _moe_negative_scale,
        [-1.0, -2.0],  # the per-layer values
        "ValueError",
    ),
    "mtp_loss_scale_required": (_mtp_no_argument, [4.0], "TypeError"),
    "moe_num_layers_none_crash": (_moe_num_layers_none, 3.0, "TypeError"),
    "moe_per_layer_one_based": (
        _moe_per_layer,
        [f"moe/{AUX}_layer_0", f"moe/{AUX}_layer_1"],
        [f"moe/{AUX}_layer_1", f"moe/{AUX}_layer_2"],
    ),
    "mtp_loss_unscaled": (_mtp_loss_scale, [1.0], [4.0]),
    "round_up_off_by_one": (_round_up, [0, 4, 8, 8, 9], [4, 8, 8, 9, 9]),
    "broadcast_none_receiver_default_dtype": (
        _broadcast_receive_none,
        ("torch.int64", [3], ["all_gather_object", "broadcast"]),
        ("torch.float32", [3], ["all_gather_object", "broadcast"]),  # a float32 receive buffer
    ),
    "broadcast_receiver_fresh_tensor": (
        _broadcast_into_buffer,
        (True, ["all_gather_object", "broadcast"]),
        (False, ["all_gather_object", "broadcast"]),  # the caller's buffer is left alone
    ),
    "broadcast_global_src_as_group_src": (
        _broadcast_subgroup_roots,
        [3, 2],
        ["group rank 3 out of range", 3],  # a non-member root; a receiver as the root
    ),
    "broadcast_dtype_type_error": (
        _broadcast_wrong_dtype,
        ("ValueError", ["all_gather_object"], True),
        ("TypeError", ["all_gather_object"], True),
    ),
    "moe_placeholder_skips_dp_avg": (
        _placeholder_dp_avg,
        [{AUX: True, Z: False}],
        [{AUX: False, Z: False}],  # this rank would skip the DP average of AUX
    ),
    "moe_total_loss_overwritten": (
        _two_steps,
        (3.0, 1.0, 4.0, [0.0, 0.0]),
        (3.0, 1.0, 1.0, [0.0, 0.0]),  # the total holds the last step only
    ),
    "moe_nan_mean_zeroed": (_nan_mean, (["nan"], ["nan", "nan"]), ([0.0], ["nan", "nan"])),
    "mtp_reduce_on_logging_rank_only": (
        _mtp_reduce_ranks,
        [["reduce"], ["reduce"]],
        [[], ["reduce"]],  # rank 0 skips the collectives rank 1 enters
    ),
    # The helper's clean zeroes the values; not cleaned, they stay for the next step.
    "mtp_tracker_not_cleaned": (
        _mtp_after_call,
        [[0.0, 0.0], [0.0, 0.0], [0.0, 0.0]],
        [[4.0, 2.0], [1.0, 1.0], [2.0, 2.0]],
    ),
    "mtp_clears_moe_tracker": (_moe_after_mtp, [2.0, 4.0], [0.0, 0.0]),
    # dev's training-path tracker: the loss and the rate, or nothing from a loss_values reader
    "mtp_nemo_rl_reads_loss_values_only": (_mtp_training_path, 2, 0),
    "moe_mtp_slots_only_on_last_stage": (
        _standalone_mtp_slots,
        [[1.0, 2.0, 3.0, 4.0, 10.0]],
        [[1.0, 2.0, 3.0, 4.0, 0.0]],  # the MTP layer's slot is zeroed before the reduction
    ),
    "mtp_gated_on_virtual_last_stage": (
        _virtual_pipeline_last_stage,
        2,  # loss and acceptance rate: set_mtp_tracker writes 0.19's layout on every release
        0,
    ),
    "moe_dp_avg_over_expert_data_group": (
        _dp_average_group,
        [None],
        ["expert_data"],
    ),
    "moe_steady_state_decided_locally": (
        _a_peer_changed_after_the_steady_state,
        2,  # the first call and the third: every rank sees the change
        1,  # this rank alone does not: its peers hang in the metadata round
    ),
    "moe_plan_cached_after_first_call": (
        _names_from_the_second_step,
        (None, 3.0, 2),
        (None, None, 1),  # AUX dropped, no second metadata round
    ),
}


def _observe(check: Check, module: ModuleType, monkeypatch: pytest.MonkeyPatch) -> Any:
    _fresh_trackers(module)
    try:
        return check(module, monkeypatch)
    finally:
        monkeypatch.undo()


def test_every_mutant_has_a_behaviour_check() -> None:
    assert sorted(BEHAVIOUR) == sorted(MUTANTS)


@pytest.mark.parametrize("name", _mutant_params(NEEDS_TO_SHOW))
def test_mutant_changes_behaviour(
    name: str, modules: dict[str, ModuleType], monkeypatch: pytest.MonkeyPatch
) -> None:
    check, expected_reference, expected_mutant = BEHAVIOUR[name]
    reference = _observe(check, modules["reference"], monkeypatch)
    mutant = _observe(check, modules[name], monkeypatch)
    assert reference == expected_reference
    assert mutant == expected_mutant
    assert mutant != reference


#: Pairs of mutants whose bug also shows in the other's situation: a stage that recorded
#: nothing is exactly where both the early return and the short pre-initialisation act.
OVERLAPS: frozenset[frozenset[str]] = frozenset(
    {
        frozenset({"moe_preinit_without_mtp", "moe_empty_stage_returns_early"}),
        # Two steps into one total_loss_dict: a tracker that is not cleared and a total that
        # is overwritten both change what the total holds after the second step.
        frozenset({"moe_tracker_not_cleared", "moe_total_loss_overwritten"}),
        # Both refuse a 0-d tensor; only the exact type check also refuses a numpy float64.
        frozenset({"moe_loss_scale_tensor_rejected", "moe_loss_scale_exact_float_type"}),
        # Both change the rate of a layer with total 0: nan (unclamped) and 100 (empty layer).
        frozenset({"mtp_acceptance_unclamped_total", "mtp_empty_layer_rate_hundred"}),
        # The rank-0 situation lists the collectives each rank enters, the agreement one too.
        frozenset({"moe_raises_on_rank0", "moe_steady_state_decided_locally"}),
        # Both reduce in the tracker's insertion order (the lineage copy by design, with its
        # names in NeMo-RL's order): a recording stage's order shows in either situation.
        frozenset({"moe_local_insertion_order", "moe_wired_names_paired_by_position"}),
        # The lineage copy carries the names' order among its defects; its situation is a
        # recording stage whose reduction order the names' order does not change in the
        # reference's sorted reduction, so that one shows in one direction only (ALSO_SHOWS_IN).
    }
)
#: (mutant, other): the mutant's bug also shows in the other's situation, not the other way
#: round. NeMo-RL's copy is a whole function, not one edit: it computes Megatron's unclamped
#: rate (200 for 2 correct of 0 total); on megatron-core dev it neither reduces the helper's own
#: layout (loss_sums: it returns {} first) nor zeroes 0.19-layout counts (dev's
#: clean_metrics_in_tracker zeroes only acceptance_counts).
ALSO_SHOWS_IN: frozenset[tuple[str, str]] = frozenset(
    {("mtp_nemo_rl_reads_loss_values_only", "mtp_acceptance_unclamped_total")}
    | {("moe_wired_names_paired_by_position", "track_names_aux_before_z_loss")}
    | (
        {
            ("mtp_nemo_rl_reads_loss_values_only", "mtp_reduce_on_logging_rank_only"),
            ("mtp_nemo_rl_reads_loss_values_only", "mtp_tracker_not_cleaned"),
        }
        if installed_mtp_layout() == "loss_sums"
        else set()
    )
)


@pytest.mark.parametrize("name", _mutant_params(NEEDS_TO_RUN))
def test_other_situations_unchanged(
    name: str, modules: dict[str, ModuleType], monkeypatch: pytest.MonkeyPatch
) -> None:
    """One bug each: in every other mutant's situation the mutant behaves like the reference,
    except for the pairs in OVERLAPS and ALSO_SHOWS_IN (which must really overlap, so the lists
    stay honest)."""
    for other, (check, _, _) in BEHAVIOUR.items():
        if other == name:
            continue
        same = _observe(check, modules["reference"], monkeypatch) == _observe(
            check, modules[name], monkeypatch
        )
        if frozenset({name, other}) in OVERLAPS or (name, other) in ALSO_SHOWS_IN:
            assert not same, f"{name} no longer shows in the situation of {other}"
        else:
            assert same, f"{name} also changes the situation of {other}"
