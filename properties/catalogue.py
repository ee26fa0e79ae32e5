"""The property catalogue, the one list of property IDs (``pipemetrics check --list`` prints
it; every other list derives from it). Property IDs are a public contract: never rename, drop
or reuse a released one (``tests/published_property_ids.txt`` holds those a release published:
``tests/test_property_ids_doc.py``).

Each `Property` names the seed API function it tests, what it enforces (``citations``: the
words of the API document, ``docs/megatron-common-api.txt``, the documentation of
``nemo_rl.models.megatron.common``, as `Doc`; megatron-core's source, with file and release, as
`Source`; pipemetrics' own reading as `Interpretation`: `pipemetrics.properties.citations`), the
semantic profiles it belongs to, a strategy of scenarios (given the Hypothesis profile and the
semantic profile), a judge that turns the run into problems, and the combinations of two
conditions its pass runs first (`pipemetrics.properties.combinations`).

Semantic profiles:

* ``seed``: the documented contract and nothing more. Means are over the tracker's entries
  (``D = num_layers + mtp_num_layers``); hang freedom is required where the document promises it
  (the pre-initialising call, or every rank holding every name); behaviour the document leaves
  open (whether the name list holds the z-loss, what the other ranks do when one rank's
  broadcast input is invalid, arguments that do not mirror what the router records) is not
  judged. ``get_moe_metrics`` is also called as trainers wire it, ``track_names`` from the
  target's own ``get_aux_loss_track_names`` ("callers should derive it via
  get_aux_loss_track_names(model_config)"), and the end result is judged; every input the
  documented types admit is generated (``broadcast_tensor``: non-contiguous sources too).
* ``megatron``: ``seed`` with Megatron's ``report()`` normalisation (means over the number of MoE
  layers, passed as ``num_moe_layers``).
* ``strict``: ``seed`` plus the guarantees of pipemetrics' reference: collective safety for every
  argument form (partial or absent ``track_names``, ``num_layers=None``), errors raised on every
  rank, z-loss in the name list, ``loss_scale`` in every form trainers pass.

``loss_scale`` forms (generator class ``argument_forms``), decided by `DOC_LOSS_SCALE_TYPE`: the
document types ``loss_scale: float`` and does not bound it, so every profile passes a Python
float or a numpy float64 (a subclass of ``float``), zero, negative and very large values, and
``get_mtp_metrics()`` without an argument (``loss_scale: float = 1.0``). A 0-d tensor
(``torch.tensor(1 / n)``) and a numpy float32 are not ``float``s: only ``strict`` passes them,
where the reference promises the same results for every form (issue 12, section 3). The
``loss_scale`` properties cite the type along with the sentence they enforce.

In Markdown the document's key templates lost their underscores (``mtp_{i}loss``,
``mtp{i}_acceptance_rate``, ``moe/{name}layer{i}``): a `Doc` quotes them so, and an
`Interpretation` beside it says that the keys are Megatron-LM's ``mtp_{i}_loss``,
``mtp_{i}_acceptance_rate`` and ``moe/{name}_layer_{i}``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from hypothesis import strategies as st

from pipemetrics.properties import citations as c
from pipemetrics.properties import strategies as s
from pipemetrics.properties.citations import Citation, Doc, Interpretation, Source
from pipemetrics.properties.combinations import (
    LIVE_NAMES_CHANGE,
    NAME_FIRST_RECORDED_LATER,
    STATE_BETWEEN_CALLS,
    Calling,
    Combination,
)
from pipemetrics.properties.effort import Effort, Semantic
from pipemetrics.properties.judges_broadcast import (
    broadcast_errors_everywhere,
    broadcast_receiver_buffer,
    broadcast_roundtrip,
    broadcast_value_error,
)
from pipemetrics.properties.judges_moe import (
    moe_all_values,
    moe_loss_scale,
    moe_names,
    moe_per_layer,
    moe_rank_agreement,
    moe_total_loss_dict,
    moe_values,
)
from pipemetrics.properties.judges_mtp import mtp_acceptance_rate, mtp_keys, mtp_loss_scale
from pipemetrics.properties.judges_single_rank import round_up_least_multiple, track_names_parity
from pipemetrics.properties.judges_steps import interleaved_values, moe_reset, mtp_reset
from pipemetrics.properties.judging import Judge, checked, no_problems
from pipemetrics.sim.model.scenario import Scenario

SEMANTIC_PROFILES: tuple[Semantic, ...] = ("seed", "megatron", "strict")
EVERY_PROFILE: frozenset[Semantic] = frozenset(SEMANTIC_PROFILES)
STRICT_ONLY: frozenset[Semantic] = frozenset({"strict"})


@dataclass(frozen=True)
class Generator:
    """A property's scenarios: a strategy of `pipemetrics.properties.strategies` and its
    arguments, as a value. The properties of one generator are judged in one pass of it
    (`pipemetrics.properties.passes.Pass`): each scenario drawn once, run once, judged by each."""

    strategy: Callable[..., st.SearchStrategy[Scenario]]
    options: tuple[tuple[str, object], ...] = ()
    semantic: bool = True
    """Whether the strategy takes the semantic profile (``semantic=``)."""

    def __call__(self, effort: Effort, semantic: Semantic) -> st.SearchStrategy[Scenario]:
        kwargs = dict(self.options)
        if self.semantic:
            kwargs["semantic"] = semantic
        return self.strategy(effort, **kwargs)


@dataclass(frozen=True)
class Property:
    id: str
    function: str
    summary: str
    citations: tuple[Citation, ...]
    """What it enforces: the API document's words (`Doc`), megatron-core's source (`Source`),
    pipemetrics' reading (`Interpretation`); ``tests/test_citations.py`` holds each quote to the
    words it quotes."""
    scenarios: Generator
    judge: Judge
    profiles: frozenset[Semantic] = EVERY_PROFILE
    also_calls: tuple[str, ...] = ()
    """Further API functions its scenarios call (the property is absent without any of them)."""
    combinations: tuple[Combination, ...] = ()
    """The bug classes of two conditions at once its pass runs first, at their floor
    (`pipemetrics.properties.combinations`), built for what it calls (`calling`)."""

    @property
    def functions(self) -> tuple[str, ...]:
        return (self.function, *self.also_calls)

    @property
    def calling(self) -> Calling:
        """What its scenarios call: its functions, with its generator's options."""
        return Calling(self.functions, self.scenarios.options)

    @property
    def cites(self) -> str:
        """The citations as one line, as reports print them (`pipemetrics.properties.citations`)."""
        return c.text(self.citations)


def _with(strategy: Callable[..., st.SearchStrategy[Scenario]], **options: object) -> Generator:
    """The generator of ``strategy`` with ``options`` (and the semantic profile)."""
    return Generator(strategy, tuple(sorted(options.items())))


def _moe(**options: object) -> Generator:
    return _with(s.moe_scenarios, **options)


def _mtp(**options: object) -> Generator:
    return _with(s.mtp_scenarios, **options)


def _broadcast(mode: str) -> Generator:
    return _with(s.broadcast_scenarios, mode=mode)


MOE = "get_moe_metrics"
MTP = "get_mtp_metrics"
BROADCAST = "broadcast_tensor"

MTP_FILE = "megatron/core/transformer/multi_token_prediction.py"
MOE_LOGGING_FILE = "megatron/core/transformer/moe/moe_logging.py"
READ_IN = "0.19.2"
"""The megatron-core release the `Source` quotes were read in."""

DOC_MOE_RETURNS = (
    Doc(
        "This function reduces MoE auxiliary losses across ranks, aggregates them, and returns a "
        "dictionary of metrics."
    ),
    Doc(
        "For each aux loss name, the mean value is returned under the same key "
        '(e.g., "load_balancing_loss").'
    ),
)
DOC_PREINIT = (
    Doc(
        "num_layers/mtp_num_layers/track_names pre-initialize the aux-loss tracker so every "
        "pipeline-parallel rank participates in the collective all_reduce below with an "
        "equally-sized tensor, preventing a hang when some PP rank did not record an aux loss "
        "this step (e.g. a stage with no MoE layer, or an MTP MoE layer that lives only on the "
        "last stage)."
    ),
)
DOC_MTP_REDUCES = Doc(
    "This function reduces MTP metrics across ranks and returns a dictionary of metrics."
)
DOC_MTP_RETURNS = (
    Doc(
        'Each MTP layer\'s loss is returned under the key "mtp_{i}loss" and acceptance rate '
        'under "mtp{i}_acceptance_rate" where i is 1-indexed (matching Megatron-LM).'
    ),
    Interpretation(
        "the document's Markdown lost two underscores: the keys are Megatron-LM's mtp_{i}_loss "
        "and mtp_{i}_acceptance_rate"
    ),
)
DOC_MTP_SCALE = (
    Doc(
        "loss_scale – Scale factor applied to each MTP layer's loss (e.g., 1/num_microbatches). "
        "MTPLossLoggingHelper accumulates the per-microbatch loss across microbatches without "
        "dividing, so callers must pass 1/num_microbatches to recover the mean (mirroring "
        "get_moe_metrics)."
    ),
    Doc("Acceptance rate is a ratio of counts and is not scaled."),
)
DOC_MTP_EMPTY_LAYER = (
    Doc("where i is 1-indexed (matching Megatron-LM)"),
    Interpretation(
        "a layer without valid positions: the document is silent (it names no case without "
        "tokens); its keys follow Megatron-LM, whose track_mtp_metrics clamps the count "
        "(megatron-core 0.19+ and main)"
    ),
    Source(
        MTP_FILE,
        READ_IN,
        "Empty masks can leave no valid MTP positions, so clamp denominators to avoid NaNs.",
    ),
    Interpretation(
        "so its rate is 100 * 0 / max(0, 1) = 0, and its loss, as process_mtp_loss records it, "
        "is 0; seed and megatron profiles alike"
    ),
    Source(
        MTP_FILE,
        READ_IN,
        "mtp_loss_for_log = ( torch.sum(mtp_loss) * (num_tokens > 0).to(mtp_loss.dtype) ) "
        "/ num_tokens.clamp(min=1)",
    ),
)
DOC_LOSS_SCALE_TYPE = (
    Doc("get_moe_metrics( loss_scale: float,"),
    Doc("get_mtp_metrics(loss_scale: float = 1.0)"),
    Interpretation(
        "any float (numpy.float64 is one), of any sign and size, or no argument for "
        "get_mtp_metrics (strict: also a 0-d tensor and a numpy float32, the reference's promise)"
    ),
)
DOC_VALUE_ERROR = Doc(
    "ValueError – If the tensor is None on the source rank, or if a tensor provided on a "
    "non-source rank has mismatched shape/dtype/device."
)
EVERY_ARGUMENT = Interpretation("for every argument the signature allows")
MEGATRON_CLEARS = (
    Interpretation(
        "Megatron-LM's training_log reports once per step and clears the trackers afterwards "
        "(MoEMetricsTracker.report -> clear(), track_mtp_metrics -> clean_metrics_in_tracker()); "
        "loss_scale = 1/num_microbatches then gives the step's mean"
    ),
)

CATALOGUE: tuple[Property, ...] = (
    Property(
        "round_up.least_multiple",
        "_round_up_to_multiple",
        "the least multiple of `multiple` that is >= value, as an int",
        (
            Doc("_round_up_to_multiple(value: int, multiple: int) → int"),
            Interpretation(
                "the document gives the signature alone: the name says the rest, value rounded up "
                "to a multiple of multiple"
            ),
        ),
        Generator(s.round_up_scenarios, semantic=False),
        checked(round_up_least_multiple),
    ),
    Property(
        "broadcast.roundtrip",
        BROADCAST,
        "every rank gets the source tensor (dtype, shape, values), receivers passing None or a "
        "buffer",
        (
            Doc("Broadcasts a tensor from src_rank to all ranks in the group"),
            Doc("Can be None on non-source ranks (will be created with correct shape/dtype)"),
            Doc(
                "Returns: The broadcasted tensor. On non-source ranks, this will be the tensor "
                "received from the source."
            ),
        ),
        _broadcast("mixed"),
        checked(broadcast_roundtrip),
    ),
    Property(
        "broadcast.receiver_buffer",
        BROADCAST,
        "a receiver's valid buffer is filled and returned",
        (
            Doc(
                "If not None on non-source ranks, it's used as the buffer for the broadcast and "
                "must match the source tensor's metadata."
            ),
        ),
        _broadcast("buffers"),
        checked(broadcast_receiver_buffer),
    ),
    Property(
        "broadcast.value_error",
        BROADCAST,
        "the rank whose input is invalid (source passing None, receiver buffer of the wrong "
        "shape, dtype or device) raises ValueError; what its peers do is left open",
        (DOC_VALUE_ERROR,),
        _broadcast("invalid"),
        broadcast_value_error,
    ),
    Property(
        "broadcast.errors_everywhere",
        BROADCAST,
        "an invalid input on any rank raises ValueError on every rank; no rank hangs",
        (
            DOC_VALUE_ERROR,
            Interpretation(
                "pipemetrics' reference (strict profile): that ValueError, raised on every rank "
                "of the group after one metadata round, so no peer is left in the broadcast"
            ),
        ),
        _broadcast("invalid"),
        broadcast_errors_everywhere,
        STRICT_ONLY,
    ),
    Property(
        "track_names.router_parity",
        "get_aux_loss_track_names",
        "the load-balancing names megatron-core's TopKRouter records for the config, every "
        "name returned in recording order (a returned z_loss first), and z_loss only where it "
        "records one (strict: z_loss too, first, whenever moe_z_loss_coeff is set)",
        (
            Doc("Returns the aux-loss tracker names the router records for a model config."),
            Doc(
                "Aux-loss tracker names to pre-initialize, in the order Megatron records them. "
                "Empty when no aux loss is enabled."
            ),
            Interpretation(
                "whether z_loss counts as an aux loss is left open, its place when returned is "
                "not: the router records it first; a z_loss the router does not record, without "
                "moe_z_loss_coeff, is never one of them"
            ),
        ),
        Generator(s.track_names_scenarios, semantic=False),
        checked(track_names_parity),
        combinations=(LIVE_NAMES_CHANGE,),
    ),
    Property(
        "moe.no_hang",
        MOE,
        "every rank returns: no hang, crash, mismatched collective or exception",
        (*DOC_PREINIT, EVERY_ARGUMENT, *DOC_LOSS_SCALE_TYPE),
        _moe(),
        checked(no_problems),
    ),
    Property(
        "moe.values",
        MOE,
        "per-name means equal the oracle's",
        (*DOC_MOE_RETURNS, Doc("loss_scale – Scale factor to apply to each auxiliary loss")),
        _moe(),
        checked(moe_values),
    ),
    Property(
        "moe.rank_agreement",
        MOE,
        "every rank returns the same keys, and the value of every rank that Megatron's "
        "reduction gives the same value",
        (
            *DOC_MOE_RETURNS,
            Interpretation(
                "Megatron's reduction spans every rank for every name on 0.19, so every rank "
                "holds the same reduced values; on 0.13-0.18 the router records z_loss without "
                "groups, and its tensor-parallel ranks keep their own values"
            ),
        ),
        _moe(),
        checked(moe_rank_agreement),
    ),
    Property(
        "moe.names",
        MOE,
        "the per-name keys are exactly the names reported",
        DOC_MOE_RETURNS,
        _moe(),
        checked(moe_names),
    ),
    Property(
        "moe.per_layer",
        MOE,
        "per_layer_logging adds moe/{name}_layer_{i} = loss_scale * v[i] and nothing else",
        (
            Doc("per_layer_logging – If True, include per-layer values in the returned dict."),
            Doc(
                "If per_layer_logging is True, per-layer values are returned under keys of the "
                'form "moe/{name}layer{i}".'
            ),
            Interpretation(
                "the document's Markdown lost the key's underscores: the keys are Megatron-LM's "
                "moe/{name}_layer_{i}, i from 0, as Megatron-LM's per-layer logging enumerates "
                "the tracker"
            ),
            Source(MOE_LOGGING_FILE, READ_IN, "for i, val in enumerate(values.tolist()):"),
            Source(
                MOE_LOGGING_FILE,
                READ_IN,
                'writer.add_scalar(f"moe/{name}_layer_{i}", val, iteration)',
            ),
        ),
        _moe(per_layer=True),
        checked(moe_per_layer),
    ),
    Property(
        "moe.loss_scale",
        MOE,
        "means and per-layer values are scaled by loss_scale exactly once",
        (
            Doc(
                "loss_scale – Scale factor to apply to each auxiliary loss "
                "(e.g., 1/num_microbatches)."
            ),
            *DOC_LOSS_SCALE_TYPE,
        ),
        _moe(per_layer=True, scale_one=False),
        checked(moe_loss_scale),
    ),
    Property(
        "moe.total_loss_dict",
        MOE,
        "total_loss_dict accumulates the per-name means of every step",
        (Doc("total_loss_dict – If provided, accumulate means into this dict (by name)."),),
        _moe(min_steps=1, max_steps=3, total_loss_dict=True),
        checked(moe_total_loss_dict),
        combinations=(STATE_BETWEEN_CALLS,),
    ),
    Property(
        "moe.reset",
        MOE,
        "a step's result does not depend on earlier steps (the tracker is cleared)",
        MEGATRON_CLEARS,
        _moe(min_steps=2, max_steps=3, per_layer=True),
        checked(moe_reset),
        combinations=(STATE_BETWEEN_CALLS, NAME_FIRST_RECORDED_LATER),
    ),
    Property(
        "moe.router_mode",
        MOE,
        "values equal the oracle when megatron-core's real routers fill the tracker",
        (
            *DOC_MOE_RETURNS,
            Interpretation("on trackers filled by megatron-core's TopKRouter itself"),
        ),
        _with(s.router_scenarios),
        checked(moe_all_values),
    ),
    Property(
        "mtp.no_hang",
        MTP,
        "every rank returns: no hang, crash, mismatched collective or exception",
        (
            DOC_MTP_REDUCES,
            Interpretation(
                "Megatron's MTP reduction has no pipeline collective: ranks without MTP layers "
                "hold no tracker and take part in none"
            ),
            EVERY_ARGUMENT,
            *DOC_LOSS_SCALE_TYPE,
        ),
        _mtp(),
        checked(no_problems),
    ),
    Property(
        "mtp.keys",
        MTP,
        "mtp_{i}_loss / mtp_{i}_acceptance_rate with i from 1 on MTP ranks, {} elsewhere "
        "(no rate with megatron-core 0.18 or with dev's acceptance collection off: no counts); "
        "a holder returning {} or fewer keys: the MTP metrics went missing",
        (
            *DOC_MTP_RETURNS,
            Interpretation(
                "a rank holding no MTP layer has no layer to report; a rank holding one reports it"
            ),
            DOC_MTP_REDUCES,
        ),
        _mtp(),
        checked(mtp_keys),
    ),
    Property(
        "mtp.loss_scale",
        MTP,
        "mtp_{i}_loss is the reduced loss scaled by loss_scale exactly once",
        (*DOC_MTP_SCALE, *DOC_LOSS_SCALE_TYPE),
        _mtp(scale_one=False),
        checked(mtp_loss_scale),
    ),
    Property(
        "mtp.acceptance_rate",
        MTP,
        "100 * correct / max(total, 1), never scaled; a layer whose positions were all masked "
        "(0 tokens on every rank) reports 0, not NaN or 100, in every profile (vacuous with "
        "megatron-core 0.13-0.18: no counts)",
        (
            *DOC_MTP_SCALE,
            Interpretation("Megatron's rate: 100 * correct / max(total, 1) (track_mtp_metrics)"),
            Source(
                MTP_FILE,
                READ_IN,
                "step_rate = (mtp_corrects[i] / torch.clamp(mtp_totals[i], min=1)) * 100.0",
            ),
            *DOC_MTP_EMPTY_LAYER,
        ),
        _mtp(scale_one=False, masked_mtp=True),
        checked(mtp_acceptance_rate),
    ),
    Property(
        "mtp.reset",
        MTP,
        "a step's result does not depend on earlier steps (the tracker is cleaned)",
        MEGATRON_CLEARS,
        _mtp(min_steps=2, max_steps=3),
        checked(mtp_reset),
        combinations=(STATE_BETWEEN_CALLS,),
    ),
)

CATALOGUE += (
    Property(
        "steps.interleaved",
        MOE,
        "over a sequence of training and forward-only steps, get_moe_metrics and "
        "get_mtp_metrics in either order, some steps calling one or none: no hang, and every "
        "call returns the oracle's values for what was recorded since the previous call",
        (*DOC_PREINIT, *DOC_MTP_RETURNS, *MEGATRON_CLEARS),
        _with(s.interleaved_scenarios),
        checked(interleaved_values),
        also_calls=(MTP,),
        combinations=(STATE_BETWEEN_CALLS, NAME_FIRST_RECORDED_LATER),
    ),
)

BY_ID: dict[str, Property] = {prop.id: prop for prop in CATALOGUE}
PROPERTY_IDS: tuple[str, ...] = tuple(BY_ID)


ALSO_JUDGED_ON: dict[Generator, tuple[str, ...]] = {
    # moe_scenarios() draws per_layer_logging either way and, with scale_one, the scales of
    # scale_one=False and a scale of 1 besides: every scenario of these two is one of its own.
    _moe(per_layer=True): ("moe.no_hang", "moe.values", "moe.rank_agreement", "moe.names"),
    _moe(per_layer=True, scale_one=False): (
        "moe.no_hang", "moe.values", "moe.rank_agreement", "moe.names", "moe.per_layer",
    ),
    # mtp_scenarios() draws the scales of scale_one=False and more; masked_mtp=True draws every
    # record of masked_mtp=False and masked layers besides.
    _mtp(scale_one=False): ("mtp.no_hang", "mtp.keys", "mtp.acceptance_rate"),
}  # fmt: skip
"""Properties judged on the scenarios of a generator besides their own: each of those scenarios
is one their own generator draws too (the comments say why), so they are judged on more of
their own kind and never on one their own test could not draw."""
