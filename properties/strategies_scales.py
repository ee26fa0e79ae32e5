"""Strategies of ``loss_scale``: the scales a step is called with, their sign, the forms the
argument is passed in by semantic profile, and the recorded values a scenario with these
scales may hold.
"""

from __future__ import annotations

from hypothesis import strategies as st

from pipemetrics.properties.effort import Semantic
from pipemetrics.properties.reuse import reused, sampled
from pipemetrics.properties.synthetic import recorded_values
from pipemetrics.sim.model.calls import LossScaleForm, MtpLossScaleForm

LOSS_SCALES: tuple[float, ...] = (1.0, 0.5, 0.25, 0.125, 1.0 / 3.0, 1e-3, 2.0, 0.0)
"""Fixed loss scales drawn besides ``1/num_microbatches`` (1.0 first: shrinking goes there)."""
LARGE_LOSS_SCALES: tuple[float, ...] = (2.0**16, 1e6, 1e30)
"""Very large scales (generator class ``argument_forms``): fp16's loss-scaler range, and far
beyond; a step with one records no loss from the huge band (the product would overflow the
float32 tracker values any implementation scales)."""
LARGEST_ORDINARY_SCALE = max(LOSS_SCALES)
"""Scales above this magnitude are `LARGE_LOSS_SCALES`."""


@reused
def loss_scales(
    microbatches: int, *, allow_one: bool = True, large: bool = False
) -> st.SearchStrategy[float]:
    """``1/num_microbatches`` as trainers pass it, and other scales (zero included); with
    ``large`` also `LARGE_LOSS_SCALES`."""
    scales = [scale for scale in LOSS_SCALES if allow_one or scale != 1.0]
    if large:
        scales += LARGE_LOSS_SCALES
    pick = sampled(scales)
    if allow_one or microbatches > 1:
        return st.one_of(st.just(1.0 / microbatches), pick)
    return pick


SEED_LOSS_SCALE_FORMS: tuple[LossScaleForm, ...] = ("float", "numpy.float64")
"""``loss_scale: float`` in the document: a Python float, or a numpy float64, a subclass of
``float``."""
STRICT_LOSS_SCALE_FORMS: tuple[LossScaleForm, ...] = (
    *SEED_LOSS_SCALE_FORMS,
    "tensor.float32",
    "numpy.float32",
    "tensor.float64",
)
"""Also what trainers pass that is not a ``float``: a 0-d tensor (``torch.tensor(1 / n)``) and a
numpy float32; the reference promises the same results for every form (strict only)."""


@reused
def loss_scale_forms(
    semantic: Semantic, *, default: bool = False
) -> st.SearchStrategy[MtpLossScaleForm]:
    """The object ``loss_scale`` is passed as (see `pipemetrics.sim.model.calls.LossScaleForm`);
    ``default``: also no argument at all (``get_mtp_metrics()``, whose default the document
    gives)."""
    forms: list[MtpLossScaleForm] = list(
        STRICT_LOSS_SCALE_FORMS if semantic == "strict" else SEED_LOSS_SCALE_FORMS
    )
    if default:
        forms.append("default")
    return sampled(forms)


@reused
@st.composite
def step_scales(
    draw: st.DrawFn, microbatches: int, count: int, *, allow_one: bool, forms: bool, sign: float
) -> list[float]:
    """The ``loss_scale`` of each of ``count`` steps. With ``forms`` (generator class
    ``argument_forms``) they include `LARGE_LOSS_SCALES` and take ``sign``, one sign per
    scenario so that ``total_loss_dict`` sums never cancel."""
    scales = loss_scales(microbatches, allow_one=allow_one, large=forms)
    return [sign * draw(scales) for _ in range(count)]


def values_for(scales: list[float]) -> st.SearchStrategy[float] | None:
    """The recorded values a scenario with these scales may hold: no loss from the huge band
    when any scale is large (the product would overflow the float32 tracker values any
    implementation scales; with step programs a step's records may meet a later step's scale).
    ``None``: every band."""
    if any(abs(scale) > LARGEST_ORDINARY_SCALE for scale in scales):
        return recorded_values(huge=False)
    return None


SCALE_SIGNS = st.sampled_from([1.0, -1.0])
"""The sign of every scale of a scenario (``argument_forms``: the document does not forbid a
negative scale; the result is then just scaled)."""
