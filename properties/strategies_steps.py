"""Strategies of the steps of a scenario: records, then calls, one step per ``loss_scale``;
drawn as a step program (generator class ``multi_step``) or every step alike.
"""

from __future__ import annotations

from collections.abc import Callable

from hypothesis import strategies as st

from pipemetrics.properties.effort import Effort
from pipemetrics.properties.strategies_scales import values_for
from pipemetrics.properties.synthetic import synthetic_records
from pipemetrics.sim.model.calls import CallSpec
from pipemetrics.sim.model.layout import Setup
from pipemetrics.sim.model.scenario import Step

CallMaker = Callable[[float], CallSpec]
"""A call of a step, given the step's ``loss_scale``."""


@st.composite
def step_program(
    draw: st.DrawFn,
    setup: Setup,
    scales: list[float],
    calls: list[CallMaker],
    masked_mtp: bool = False,
) -> list[Step]:
    """One step per scale, as a rule-based state machine walks them (the ``multi_step``
    class). Each step either trains (every router and the MTP loss record, as Megatron's do
    only in training) or is forward-only (nothing recorded: an evaluation or log-prob pass, so
    a name can first appear in a later step and MTP be recorded in one step and not the
    next); after it, any subset of ``calls`` in any order, the last step making at least one
    (a step without a call leaves its records to the next call). Shrinking removes steps, then
    calls and records, so a failure comes down to the shortest sequence. It is drawn as one
    scenario, not run rule by rule with Hypothesis's ``RuleBasedStateMachine``, because a world
    runs a scenario as one task: every rule would otherwise re-run the whole prefix."""
    values = values_for(scales)
    steps = []
    for index, scale in enumerate(scales):
        trains = draw(st.booleans())
        records = (
            draw(synthetic_records(setup, values=values, masked_mtp=masked_mtp)) if trains else None
        )
        order = draw(st.permutations(range(len(calls))))
        chosen = [i for i in order if draw(st.booleans())]
        if index == len(scales) - 1 and not chosen:
            chosen = [order[0]]
        steps.append(Step(records=records, calls=[calls[i](scale) for i in chosen]))
    return steps


@st.composite
def steps_of(
    draw: st.DrawFn,
    effort: Effort,
    setup: Setup,
    scales: list[float],
    calls: list[CallMaker],
    masked_mtp: bool = False,
) -> list[Step]:
    """One step per scale: a `step_program` when there is more than one and the effort
    generates the ``multi_step`` class, else every step records and makes every call, in
    order. ``masked_mtp``: MTP layers may have no valid position in a step
    (`pipemetrics.properties.synthetic.masked_mtp_layers`)."""
    if len(scales) > 1 and effort.generates("multi_step"):
        return draw(step_program(setup, scales, calls, masked_mtp))
    values = values_for(scales)
    return [
        Step(
            records=draw(synthetic_records(setup, values=values, masked_mtp=masked_mtp)),
            calls=[call(scale) for call in calls],
        )
        for scale in scales
    ]
