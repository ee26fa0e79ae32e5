"""Behavioural unit-test helpers for any implementation of the five metric helpers
(``get_moe_metrics``, ``get_mtp_metrics``, ``broadcast_tensor``, ``get_aux_loss_track_names``,
``_round_up_to_multiple``): a trainer's own copy, a vendored reference, or anything else.

Tests written with them assert on what a function returns and on the trackers it leaves, never
on which megatron-core functions it calls:

* fill megatron-core's real trackers as its router and MTP layer record (`record_moe`,
  `record_mtp`; every supported release, by feature), read them back (`moe_values`,
  `mtp_values`, `tracker_snapshot`) and check they were cleared (`assert_trackers_cleared`);
* run the function with its real reduction in a one-rank gloo world in this process
  (`one_rank_world`, fixture ``pipemetrics_one_rank``), or in a two-stage world of two processes
  in one call (`run_two_stage`, fixture ``pipemetrics_two_stage``), stage 0 without MoE layers.

The pytest fixtures come from `pipemetrics.testing.plugin`, loaded automatically where
pipemetrics is installed (``pytest11`` entry point ``pipemetrics-testing``); they need neither
the property suite nor its options. Importing this package or the plugin imports neither torch
nor megatron-core: a world or a tracker function does, when called. See docs/migration.md.
"""

from pipemetrics.testing.trackers import (
    LayerValues,
    assert_trackers_cleared,
    moe_values,
    mtp_values,
    record_moe,
    record_mtp,
    reset_trackers,
    tracker_snapshot,
)
from pipemetrics.testing.worlds import (
    DEFAULT_START_TIMEOUT_S,
    DEFAULT_TIMEOUT_S,
    RankFailure,
    Stage,
    TwoStageError,
    one_rank_world,
    run_two_stage,
)

__all__ = [
    "DEFAULT_START_TIMEOUT_S",
    "DEFAULT_TIMEOUT_S",
    "LayerValues",
    "RankFailure",
    "Stage",
    "TwoStageError",
    "assert_trackers_cleared",
    "moe_values",
    "mtp_values",
    "one_rank_world",
    "record_moe",
    "record_mtp",
    "reset_trackers",
    "run_two_stage",
    "tracker_snapshot",
]
