"""Unit tests of the non-distributed parts of pipemetrics.reference.

Distributed behaviour (collectives, hangs, cross-rank agreement) is tested elsewhere with the
project's simulator; here torch.distributed is never initialised, so get_moe_metrics and
get_mtp_metrics run in their documented single-process mode.
"""

from __future__ import annotations

import inspect
import itertools
from types import SimpleNamespace
from typing import Any
from unittest.mock import MagicMock

import numpy as np
import pytest
import torch
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper
from megatron.core.transformer.transformer_config import TransformerConfig

import pipemetrics.reference as ref
from pipemetrics.reference import (
    _AUX_LOSS_TRACK_NAMES,
    _round_up_to_multiple,
    broadcast_tensor,
    get_aux_loss_track_names,
    get_moe_metrics,
    get_mtp_metrics,
)
from pipemetrics.reference import megatron_common as mc
from pipemetrics.sim.mcore import installed_features
from pipemetrics.sim.megatron.trackers import apply_moe_records
from pipemetrics.sim.model.records import MoeRecord

from .conftest import set_mtp_tracker

#: The installed release's MoE tracker as the reference sees it: 0.18+'s ``MoEMetricsTracker``,
#: or the reference's view of 0.13-0.17's dict tracker (same ``metrics`` and
#: ``ensure_initialized``).
get_moe_metrics_tracker = mc.get_moe_metrics_tracker

PER_ENTRY_DP_SETTING = pytest.mark.skipif(
    not installed_features().class_tracker and not installed_features().legacy_saver_has_dp_flag,
    reason=(
        "needs a per-entry data-parallel setting (moe_logging's MetricEntry.needs_dp_avg, or "
        "save_to_aux_losses_tracker's reduce_group_has_dp), missing in the installed "
        "megatron-core"
    ),
)

AUX = "load_balancing_loss"
SEQ = "seq_load_balancing_loss"
GLOBAL = "global_load_balancing_loss"
Z = "z_loss"


pytestmark = pytest.mark.usefixtures("fresh_trackers")


# ----------------------------------------------------------------------------- exports


def test_package_exports() -> None:
    assert sorted(ref.__all__) == sorted(
        [
            "_round_up_to_multiple",
            "broadcast_tensor",
            "get_aux_loss_track_names",
            "get_moe_metrics",
            "get_mtp_metrics",
            "_AUX_LOSS_TRACK_NAMES",
        ]
    )
    for name in ref.__all__:
        assert getattr(ref, name) is getattr(mc, name)


# ----------------------------------------------------------------------------- signatures

_P = inspect.Parameter
_EMPTY = _P.empty
SEED_SIGNATURES: dict[str, list[tuple[str, Any, Any]]] = {
    "_round_up_to_multiple": [
        ("value", _EMPTY, _P.POSITIONAL_OR_KEYWORD),
        ("multiple", _EMPTY, _P.POSITIONAL_OR_KEYWORD),
    ],
    "broadcast_tensor": [
        ("tensor", _EMPTY, _P.POSITIONAL_OR_KEYWORD),
        ("src_rank", _EMPTY, _P.POSITIONAL_OR_KEYWORD),
        ("group", _EMPTY, _P.POSITIONAL_OR_KEYWORD),
    ],
    "get_aux_loss_track_names": [("model_config", _EMPTY, _P.POSITIONAL_OR_KEYWORD)],
    "get_moe_metrics": [
        ("loss_scale", _EMPTY, _P.POSITIONAL_OR_KEYWORD),
        ("total_loss_dict", None, _P.POSITIONAL_OR_KEYWORD),
        ("per_layer_logging", False, _P.POSITIONAL_OR_KEYWORD),
        ("num_layers", None, _P.POSITIONAL_OR_KEYWORD),
        ("mtp_num_layers", None, _P.POSITIONAL_OR_KEYWORD),
        ("track_names", None, _P.POSITIONAL_OR_KEYWORD),
        # Deliberate addition, keyword-only so positional seed calls are unaffected.
        ("num_moe_layers", None, _P.KEYWORD_ONLY),
    ],
    "get_mtp_metrics": [("loss_scale", 1.0, _P.POSITIONAL_OR_KEYWORD)],
}


@pytest.mark.parametrize("name", sorted(SEED_SIGNATURES))
def test_signature_matches_seed(name: str) -> None:
    params = inspect.signature(getattr(ref, name)).parameters.values()
    assert [(p.name, p.default, p.kind) for p in params] == SEED_SIGNATURES[name]


def test_aux_loss_track_names_mapping() -> None:
    assert _AUX_LOSS_TRACK_NAMES == {
        "aux_loss": AUX,
        "seq_aux_loss": SEQ,
        "global_aux_loss": GLOBAL,
    }
    # Iteration order is the order the router applies the losses.
    assert list(_AUX_LOSS_TRACK_NAMES) == ["aux_loss", "seq_aux_loss", "global_aux_loss"]


# ----------------------------------------------------------------------------- round up


@pytest.mark.parametrize(
    ("value", "multiple", "expected"),
    [(0, 1, 0), (0, 8, 0), (1, 8, 8), (8, 8, 8), (9, 8, 16), (17, 1, 17), (100, 7, 105)],
)
def test_round_up_table(value: int, multiple: int, expected: int) -> None:
    assert _round_up_to_multiple(value, multiple) == expected


def test_round_up_is_least_multiple() -> None:
    for value, multiple in itertools.product(range(0, 60), range(1, 13)):
        r = _round_up_to_multiple(value, multiple)
        assert r % multiple == 0
        assert value <= r < value + multiple


def test_round_up_large_values_exact() -> None:
    assert _round_up_to_multiple(10**30 + 1, 10**15) == 10**30 + 10**15


@pytest.mark.parametrize(("value", "multiple"), [(-1, 4), (5, 0), (5, -3), (-2, 0)])
def test_round_up_rejects_bad_input(value: int, multiple: int) -> None:
    with pytest.raises(ValueError):
        _round_up_to_multiple(value, multiple)


# ----------------------------------------------------------------------------- track names


def _tc(**kw: Any) -> TransformerConfig:
    # Without linear biases: megatron-core 0.13 refuses them with MoE ("Bias is not supported
    # for MoE"); later releases accept either.
    return TransformerConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_moe_experts=4,
        add_bias_linear=False,
        **kw,
    )


@pytest.mark.parametrize(
    ("kw", "expected"),
    [
        ({}, []),  # defaults: aux_loss with coefficient 0.0, no z-loss
        ({"moe_aux_loss_coeff": 1e-2}, [AUX]),
        ({"moe_aux_loss_coeff": 1e-2, "moe_z_loss_coeff": 1e-3}, [Z, AUX]),
        ({"moe_z_loss_coeff": 0.0}, [Z]),
        ({"moe_router_load_balancing_type": "seq_aux_loss", "moe_aux_loss_coeff": 1.0}, [SEQ]),
        (
            {"moe_router_load_balancing_type": "global_aux_loss", "moe_aux_loss_coeff": 1.0},
            [GLOBAL],
        ),
        ({"moe_router_load_balancing_type": "none", "moe_aux_loss_coeff": 0.0}, []),
        (
            {
                "moe_router_load_balancing_type": ["global_aux_loss", "aux_loss", "seq_aux_loss"],
                "moe_aux_loss_coeff": [0.3, 0.1, 0.0],
                "moe_z_loss_coeff": 1e-3,
            },
            [Z, AUX, GLOBAL],
        ),
    ],
)
def test_track_names_real_config(kw: dict[str, Any], expected: list[str]) -> None:
    assert get_aux_loss_track_names(_tc(**kw)) == expected


_TYPES: list[Any] = [
    "aux_loss",
    "seq_aux_loss",
    "global_aux_loss",
    "none",
    "sinkhorn",
    ["aux_loss", "seq_aux_loss"],
    ["seq_aux_loss", "global_aux_loss", "aux_loss"],
    ["global_aux_loss"],
    [],
]


def _coeffs_for(routing_type: Any) -> list[Any]:
    if isinstance(routing_type, list):
        n = len(routing_type)
        return [list(c) for c in itertools.product([0.0, 0.5, -1.0], repeat=n)]
    return [0.0, 0.5, -1.0, 2]


@pytest.mark.skipif(
    not hasattr(TopKRouter, "get_aux_loss_coeff"),
    reason="megatron-core's TopKRouter.get_aux_loss_coeff (the cross-check's source of truth) "
    "is missing in the installed release",
)
@pytest.mark.parametrize("routing_type", _TYPES, ids=str)
def test_track_names_agree_with_megatron_router(routing_type: Any) -> None:
    """Cross-check against TopKRouter.get_aux_loss_coeff itself (not a re-derivation)."""
    for coeff, z in itertools.product(_coeffs_for(routing_type), [None, 0.0, 1e-3]):
        cfg = SimpleNamespace(
            moe_router_load_balancing_type=routing_type,
            moe_aux_loss_coeff=coeff,
            moe_z_loss_coeff=z,
        )
        router = SimpleNamespace(routing_type=routing_type, config=cfg)
        expected = [Z] if z is not None else []
        expected += [
            name
            for t, name in _AUX_LOSS_TRACK_NAMES.items()
            if TopKRouter.get_aux_loss_coeff(router, t) > 0
        ]
        assert get_aux_loss_track_names(cfg) == expected, (routing_type, coeff, z)


@pytest.mark.parametrize(
    ("cfg", "expected"),
    [
        (SimpleNamespace(), []),
        (object(), []),
        (None, []),
        (SimpleNamespace(moe_router_load_balancing_type="aux_loss"), []),
        (SimpleNamespace(moe_aux_loss_coeff=1.0), []),
        (SimpleNamespace(moe_z_loss_coeff=0.0), [Z]),
        (SimpleNamespace(moe_z_loss_coeff=None), []),
        (SimpleNamespace(moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=None), []),
        # A list routing type with a scalar coefficient would crash Megatron's router: absent.
        (SimpleNamespace(moe_router_load_balancing_type=["aux_loss"], moe_aux_loss_coeff=1.0), []),
        # Coefficient list shorter than the type list: the missing entry counts as absent.
        (
            SimpleNamespace(
                moe_router_load_balancing_type=["aux_loss", "seq_aux_loss"],
                moe_aux_loss_coeff=[0.1],
            ),
            [AUX],
        ),
        # Bools are not coefficients.
        (SimpleNamespace(moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=True), []),
        (SimpleNamespace(moe_z_loss_coeff=False), []),
        # Tuples behave like lists.
        (
            SimpleNamespace(
                moe_router_load_balancing_type=("seq_aux_loss", "aux_loss"),
                moe_aux_loss_coeff=(0.2, 0.1),
            ),
            [AUX, SEQ],
        ),
    ],
)
def test_track_names_partial_configs(cfg: Any, expected: list[str]) -> None:
    assert get_aux_loss_track_names(cfg) == expected


def test_track_names_magicmock_is_absent() -> None:
    assert get_aux_loss_track_names(MagicMock()) == []
    m = MagicMock()
    m.moe_router_load_balancing_type = "aux_loss"
    m.moe_aux_loss_coeff = 0.1
    assert get_aux_loss_track_names(m) == [AUX]  # moe_z_loss_coeff stays a MagicMock: absent
    m.moe_z_loss_coeff = 0.0
    assert get_aux_loss_track_names(m) == [Z, AUX]
    m.moe_aux_loss_coeff = MagicMock()
    assert get_aux_loss_track_names(m) == [Z]
    m.moe_router_load_balancing_type = [MagicMock(), "seq_aux_loss"]
    m.moe_aux_loss_coeff = [MagicMock(), 0.5]
    assert get_aux_loss_track_names(m) == [Z, SEQ]


def test_track_names_attribute_that_raises() -> None:
    class Exploding:
        moe_z_loss_coeff = 1e-3

        @property
        def moe_router_load_balancing_type(self) -> str:
            raise RuntimeError("boom")

    assert get_aux_loss_track_names(Exploding()) == [Z]


# ----------------------------------------------------------------------------- MoE (local mode)


def _record(name: str, value: float, layer: int, n: int, needs_dp_avg: bool = True) -> None:
    """One record through the installed release's own recording function (0.18+:
    ``MoEMetricsTracker.record``; 0.13-0.17: ``save_to_aux_losses_tracker``), no groups."""
    record = MoeRecord(
        name=name, layer_number=layer, value=value, num_layers=n, needs_dp_avg=needs_dp_avg
    )
    apply_moe_records([record], {})


def test_moe_metrics_mean_and_per_layer() -> None:
    _record(AUX, 2.0, 1, 4)
    _record(AUX, 4.0, 3, 4)
    _record(AUX, 1.0, 3, 4)  # accumulates into the same slot
    _record(Z, 8.0, 2, 4)
    out = get_moe_metrics(0.5, per_layer_logging=True)
    assert list(out)[:2] == [AUX, Z]  # sorted names first
    assert out[AUX] == pytest.approx(0.5 * 7.0 / 4)
    assert out[Z] == pytest.approx(0.5 * 8.0 / 4)
    assert [out[f"moe/{AUX}_layer_{i}"] for i in range(4)] == pytest.approx([1.0, 0.0, 2.5, 0.0])
    assert [out[f"moe/{Z}_layer_{i}"] for i in range(4)] == pytest.approx([0.0, 4.0, 0.0, 0.0])
    assert all(type(v) is float for v in out.values())
    assert len(out) == 2 + 8


def test_moe_metrics_no_per_layer_keys_by_default() -> None:
    _record(AUX, 2.0, 1, 2)
    assert get_moe_metrics(1.0) == {AUX: pytest.approx(1.0)}


def test_moe_metrics_num_moe_layers_denominator() -> None:
    _record(AUX, 6.0, 1, 4)
    assert get_moe_metrics(1.0, num_moe_layers=3)[AUX] == pytest.approx(2.0)


@PER_ENTRY_DP_SETTING
def test_moe_metrics_clears_but_keeps_entries() -> None:
    # needs_dp_avg=False, like the router's global aux loss: not a placeholder once zeroed.
    _record(GLOBAL, 6.0, 1, 2, needs_dp_avg=False)
    get_moe_metrics(1.0)
    tracker = get_moe_metrics_tracker()
    assert GLOBAL in tracker.metrics
    assert torch.count_nonzero(tracker.metrics[GLOBAL].values) == 0
    assert get_moe_metrics(1.0) == {GLOBAL: 0.0}


def test_moe_metrics_zeroed_default_settings_entry_counts_as_placeholder() -> None:
    # Documented limitation: an all-zero entry with MetricEntry's default settings (no groups,
    # needs_dp_avg=True) cannot be told apart from a pre-initialised placeholder, so it is
    # only reported while non-zero somewhere or when listed in track_names.
    _record(AUX, 6.0, 1, 2)
    assert get_moe_metrics(1.0) == {AUX: pytest.approx(3.0)}
    assert get_moe_metrics(1.0) == {}
    assert get_moe_metrics(1.0, None, False, 2, None, [AUX]) == {AUX: 0.0}


def test_moe_metrics_total_loss_dict_accumulates_tensors() -> None:
    total: dict[str, Any] = {}
    _record(AUX, 4.0, 1, 2)
    get_moe_metrics(1.0, total)
    assert isinstance(total[AUX], torch.Tensor)
    assert float(total[AUX]) == pytest.approx(2.0)
    _record(AUX, 2.0, 2, 2)
    get_moe_metrics(1.0, total)
    assert float(total[AUX]) == pytest.approx(3.0)


def test_moe_metrics_pre_initialises_track_names_with_mtp_length() -> None:
    out = get_moe_metrics(1.0, None, True, 3, 1, [Z, AUX])
    assert out[AUX] == 0.0 and out[Z] == 0.0
    assert sorted(k for k in out if k.startswith(f"moe/{AUX}")) == [
        f"moe/{AUX}_layer_{i}" for i in range(4)
    ]
    tracker = get_moe_metrics_tracker()
    assert tracker.metrics[AUX].values.shape == (4,)
    assert tracker.metrics[AUX].values.device.type == "cpu"


def test_moe_metrics_pads_shorter_entry_to_requested_length() -> None:
    _record(AUX, 3.0, 2, 2)  # recorded with length num_layers, tracker asked for +1 MTP
    out = get_moe_metrics(1.0, None, True, 2, 1, [AUX])
    assert out[AUX] == pytest.approx(1.0)  # 3 / 3 layers
    assert get_moe_metrics_tracker().metrics[AUX].values.shape == (3,)


def test_moe_metrics_track_names_without_num_layers_are_dropped() -> None:
    _record(AUX, 2.0, 1, 1)
    assert get_moe_metrics(1.0, track_names=[AUX, Z]) == {AUX: pytest.approx(2.0)}


def test_moe_metrics_recorded_name_not_in_track_names_is_reported() -> None:
    _record(SEQ, 2.0, 1, 2)
    out = get_moe_metrics(1.0, None, False, 2, None, [AUX])
    assert out == {AUX: 0.0, SEQ: pytest.approx(1.0)}


def test_moe_metrics_placeholder_not_reported_unless_tracked() -> None:
    # An entry created by Megatron's own pre-initialisation (all zero, default groups) is a
    # placeholder, not a recorded loss: it must not show up as a permanent zero.
    get_moe_metrics_tracker().ensure_initialized(SEQ, 4, device="cpu")
    assert get_moe_metrics(1.0) == {}
    assert get_moe_metrics(1.0, None, False, 4, None, [SEQ]) == {SEQ: 0.0}


def test_moe_metrics_empty_tracker() -> None:
    assert get_moe_metrics(1.0) == {}


@pytest.mark.parametrize(
    "kwargs",
    [
        {"loss_scale": "1"},
        {"loss_scale": True},
        {"loss_scale": None},
        {"loss_scale": torch.tensor([0.5, 0.5])},
        {"loss_scale": torch.tensor(True)},
        {"loss_scale": torch.tensor(1.0, device="meta")},
        {"loss_scale": 1.0, "num_layers": -1, "track_names": [AUX]},
        {"loss_scale": 1.0, "mtp_num_layers": 1.5},
        {"loss_scale": 1.0, "track_names": AUX},
        {"loss_scale": 1.0, "track_names": [AUX, 3]},
        {"loss_scale": 1.0, "num_moe_layers": 0},
        {"loss_scale": 1.0, "total_loss_dict": [1]},
    ],
)
def test_moe_metrics_rejects_bad_arguments(kwargs: dict[str, Any]) -> None:
    _record(AUX, 1.0, 1, 1)
    with pytest.raises(ValueError):
        get_moe_metrics(**kwargs)


# Every form a trainer passes loss_scale in gives the same result as the Python float holding
# the same value (a float32 form holds the value rounded to float32).
LOSS_SCALE_VALUES = (0.25, 1.0 / 3.0, 0.0, -0.5, 1e6, 1e30)
LOSS_SCALE_FORMS: dict[str, Any] = {
    "int": lambda x: int(x),
    "numpy.float64": np.float64,
    "numpy.float32": np.float32,
    "tensor.float32": lambda x: torch.tensor(x),
    "tensor.float64": lambda x: torch.tensor(x, dtype=torch.float64),
    "tensor.shape[1]": lambda x: torch.tensor([x]),
    "tensor.requires_grad": lambda x: torch.tensor(x, requires_grad=True),
}


def _number(scale: Any) -> float:
    """The number a loss_scale form holds (a tensor that requires grad detached first)."""
    return float(scale.detach() if isinstance(scale, torch.Tensor) else scale)


@pytest.mark.parametrize("form", sorted(LOSS_SCALE_FORMS))
@pytest.mark.parametrize("value", LOSS_SCALE_VALUES)
def test_moe_metrics_loss_scale_forms(form: str, value: float) -> None:
    make = LOSS_SCALE_FORMS[form]
    if form == "int" and value != int(value):
        pytest.skip("not an integer")
    received = _number(make(value))
    totals: dict[str, Any] = {}
    for _ in range(2):
        _record(AUX, 2.0, 1, 2)
        _record(AUX, 4.0, 2, 2)
        out = get_moe_metrics(make(value), totals, per_layer_logging=True)
    want = {AUX: received * 3.0, f"moe/{AUX}_layer_0": received * 2.0}
    want[f"moe/{AUX}_layer_1"] = received * 4.0
    assert out == {k: pytest.approx(v, rel=1e-6) for k, v in want.items()}
    assert all(type(v) is float for v in out.values())
    assert float(totals[AUX]) == pytest.approx(2 * received * 3.0, rel=1e-6)


@pytest.mark.parametrize("form", sorted(LOSS_SCALE_FORMS))
def test_mtp_metrics_loss_scale_forms(form: str) -> None:
    scale = LOSS_SCALE_FORMS[form](2.0 if form == "int" else -1.0 / 3.0)
    received = _number(scale)
    set_mtp_tracker([3.0], [1.0], [2.0])
    out = get_mtp_metrics(scale)
    want = {"mtp_1_loss": pytest.approx(3.0 * received, rel=1e-6), "mtp_1_acceptance_rate": 50.0}
    assert out == want


def test_mtp_metrics_rejects_a_non_number_after_cleaning() -> None:
    set_mtp_tracker([3.0], [1.0], [2.0])
    with pytest.raises(ValueError, match="loss_scale"):
        get_mtp_metrics("0.5")  # type: ignore[arg-type]
    assert torch.count_nonzero(MTPLossLoggingHelper.tracker["loss_values"]) == 0


# ----------------------------------------------------------------------------- _plan (pure)


def _payload(entries: dict[str, Any], track: list[str] | None = None, req: int = 0) -> Any:
    kinds = ["tensor_and_context", "tensor_data_context", "data"]
    return {
        "error": None,
        "entries": entries,
        "track_names": track or [],
        "requested_length": req,
        "arguments": {},
        "kinds": kinds,
    }


def _meta(length: int, reduce: Any = ("kind", "tensor_and_context"), dp: bool = True) -> Any:
    return mc._EntryMeta(length, "torch.float32", reduce, None, dp)


def test_plan_union_lengths_and_canonical() -> None:
    payloads = [_payload({}), _payload({AUX: _meta(2)}), _payload({AUX: _meta(3)}, [Z], 4)]
    lengths, settings, errors = mc._plan(payloads, True)
    assert errors == []
    assert lengths == {AUX: 3, Z: 4}
    assert settings[AUX] == _meta(2)
    # nobody recorded z_loss: the installed router's groups
    z_avg = ("kind", "tensor_data_context") if installed_features().router_averages_z_loss else None
    assert settings[Z].avg == z_avg
    assert settings[Z].reduce is None


def _apply_z_loss_records(with_avg_group: bool) -> Any:
    """A stand-in ``TopKRouter.apply_z_loss`` recording z_loss as 0.19's (avg over tensor+data+
    context) or as 0.13-0.18's (no groups) does; never called, only read."""
    if with_avg_group:

        def apply_z_loss(self: Any, logits: Any) -> Any:
            self.record("z_loss", logits, 1, 1, avg_group=self.tp_dp_cp_group)

    else:

        def apply_z_loss(self: Any, logits: Any) -> Any:
            self.record("z_loss", logits, 1, 1)

    return apply_z_loss


@pytest.mark.parametrize("with_avg_group", [True, False])
def test_plan_creates_a_name_nobody_recorded_with_the_installed_routers_groups(
    monkeypatch: pytest.MonkeyPatch, with_avg_group: bool
) -> None:
    # read from the router's code, not the version: 0.16's created z_loss got 0.19's avg group,
    # and the next step's trackers disagreed with what the router recorded
    monkeypatch.setattr(TopKRouter, "apply_z_loss", _apply_z_loss_records(with_avg_group))
    _, settings, errors = mc._plan([_payload({}, [Z], 2), _payload({}, [Z], 2)], True)
    assert errors == []
    assert settings[Z].avg == (("kind", "tensor_data_context") if with_avg_group else None)
    assert (settings[Z].reduce, settings[Z].needs_dp_avg) == (None, True)


def test_plan_disagreement_names_ranks() -> None:
    payloads = [_payload({AUX: _meta(2)}), _payload({AUX: _meta(2, reduce=None)})]
    _, _, errors = mc._plan(payloads, True)
    assert len(errors) == 1 and "ranks [0]" in errors[0] and "ranks [1]" in errors[0]


def test_plan_missing_rank_cannot_rebuild_custom_group() -> None:
    payloads = [_payload({AUX: _meta(2, reduce=("custom", (0, 5)))}), _payload({})]
    _, _, errors = mc._plan(payloads, True)
    assert len(errors) == 1 and "ranks [1]" in errors[0]


def test_plan_argument_error_wins() -> None:
    bad = _payload({})
    bad["error"] = "num_layers must be ..."
    _, _, errors = mc._plan([_payload({AUX: _meta(1)}), bad], True)
    assert errors == ["rank 1: num_layers must be ..."]


# ----------------------------------------------------------------------------- MTP (local mode)


def test_mtp_metrics_keys_and_values() -> None:
    set_mtp_tracker([4.0, 8.0], [3.0, 0.0], [4.0, 0.0])
    out = get_mtp_metrics(0.25)
    assert out == {
        "mtp_1_loss": pytest.approx(1.0),
        "mtp_1_acceptance_rate": pytest.approx(75.0),
        "mtp_2_loss": pytest.approx(2.0),
        "mtp_2_acceptance_rate": 0.0,  # total 0 -> denominator clamped to 1
    }
    assert all(type(v) is float for v in out.values())


def test_mtp_acceptance_rate_not_scaled_and_clamped() -> None:
    set_mtp_tracker([1.0, 1.0], [5.0, -2.0], [4.0, 4.0])
    out = get_mtp_metrics(10.0)
    assert out["mtp_1_acceptance_rate"] == 100.0
    assert out["mtp_2_acceptance_rate"] == 0.0
    assert out["mtp_1_loss"] == pytest.approx(10.0)


def test_mtp_default_loss_scale_is_one() -> None:
    set_mtp_tracker([3.0], [1.0], [2.0])
    assert get_mtp_metrics()["mtp_1_loss"] == pytest.approx(3.0)


def test_mtp_metrics_cleans_tracker() -> None:
    set_mtp_tracker([3.0], [1.0], [2.0])
    get_mtp_metrics()
    tracker = MTPLossLoggingHelper.tracker
    assert tracker["reduce_group"] is None and tracker["avg_group"] is None
    assert torch.count_nonzero(tracker["loss_values"]) == 0
    # After the clean the groups are None but loss_values remain: still reported, as zeros.
    assert get_mtp_metrics() == {"mtp_1_loss": 0.0, "mtp_1_acceptance_rate": 0.0}


def test_mtp_missing_count_vectors_use_megatron_defaults() -> None:
    MTPLossLoggingHelper.tracker = {"loss_values": torch.tensor([2.0])}
    assert get_mtp_metrics() == {"mtp_1_loss": 2.0, "mtp_1_acceptance_rate": 0.0}


def test_mtp_no_tracker_returns_empty() -> None:
    assert get_mtp_metrics() == {}
    MTPLossLoggingHelper.tracker = {"reduce_group": None, "avg_group": None}
    assert get_mtp_metrics(0.5) == {}


def test_mtp_megatron_018_layout_reports_loss_only_and_cleans() -> None:
    # megatron-core 0.18's save_loss_to_tracker: "values" (the loss), no acceptance counts.
    MTPLossLoggingHelper.tracker = {
        "values": torch.tensor([4.0, 8.0]),
        "reduce_group": None,
        "avg_group": None,
    }
    out = get_mtp_metrics(0.25)
    assert out == {"mtp_1_loss": pytest.approx(1.0), "mtp_2_loss": pytest.approx(2.0)}
    assert list(out) == ["mtp_1_loss", "mtp_2_loss"]
    assert all(type(v) is float for v in out.values())
    tracker = MTPLossLoggingHelper.tracker
    assert torch.count_nonzero(tracker["values"]) == 0
    assert tracker["reduce_group"] is None and tracker["avg_group"] is None
    assert get_mtp_metrics() == {"mtp_1_loss": 0.0, "mtp_2_loss": 0.0}


def test_mtp_metrics_through_the_installed_helper() -> None:
    # Filled with whatever save method the installed megatron-core has (0.19: with counts).
    from pipemetrics.sim.megatron.trackers import cpu_current_device, save_mtp

    with cpu_current_device():
        save_mtp(torch.tensor(2.0), torch.tensor(1.0), torch.tensor(4.0), 0, 1)
        out = get_mtp_metrics(0.5)
    if installed_features().mtp_counts_acceptance:
        assert out == {"mtp_1_loss": 1.0, "mtp_1_acceptance_rate": 25.0}
    else:
        assert out == {"mtp_1_loss": 1.0}
    assert all(
        not bool(v.any()) for v in MTPLossLoggingHelper.tracker.values() if torch.is_tensor(v)
    )


# ----------------------------------------------------------------------------- broadcast


def test_broadcast_tensor_documents_global_src_rank() -> None:
    doc = broadcast_tensor.__doc__ or ""
    assert "GLOBAL" in doc or "global" in doc


@pytest.mark.parametrize(
    ("backend", "source", "expected"),
    [
        ("gloo", "cpu", "cpu"),
        ("gloo", "cuda", "cpu"),  # gloo: a CUDA source is sent from a CPU copy
        ("nccl", "cuda", "cuda"),
        ("nccl", "cpu", "cuda"),  # nccl: a CPU source is sent from a CUDA copy
        ("cpu:gloo,cuda:nccl", "cpu", "cpu"),  # the source's type, where the backend serves it
        ("cpu:gloo,cuda:nccl", "cuda", "cuda"),
        ("cpu:gloo,cuda:nccl", "meta", "cuda"),
        ("cpu:gloo,cuda:nccl", None, "cuda"),  # no tensor decides: the accelerator
        ("cuda:nccl,cpu:gloo", "cpu", "cpu"),
        ("cpu:gloo", None, "cpu"),
    ],
)
def test_the_communication_device_follows_the_data_and_the_groups_backend_for_it(
    backend: str, source: str | None, expected: str
) -> None:
    """A default group created with ``"cpu:gloo,cuda:nccl"`` serves both device types: data
    on the CPU goes over gloo, CUDA data over NCCL; one backend string no longer decides."""
    assert mc._comm_device_type(backend, source) == expected
