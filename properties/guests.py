"""Guests: a pass's scenarios judged also by the properties of other generators that draw every
one of them.

A generator may draw every scenario another draws (`pipemetrics.properties.catalogue.Generator.
covers`): ``moe.values`` draws ``per_layer_logging`` either way, so every scenario of
``moe.per_layer`` (always on) is one ``moe.values`` could have drawn itself. Such a property
judges the other generator's scenarios too, as a guest of its pass
(`pipemetrics.properties.ahead.judge_together`): the runs are made anyway, so it is judged on
more scenarios of its own kind for the price of its judge, and never on one it could not have
drawn, so it fails for nothing its own test could not fail for. A guest never keeps the
drawing going and stops being judged at its first scenario that does not pass; where it did
not pass, its judge is run on the other generator's Hypothesis test
(`pipemetrics.properties.engine.run_together`), which draws the same scenarios, meets the
failure at the same example and shrinks it under that generator.

Each property's result is its own (its own generator's examples, coverage and verdict),
then `merged` with what it judged as a guest: a failure found as a guest is reported only where
its own test passed, and says which property's scenarios found it (``drawn_by``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from pipemetrics.properties.ahead import drawn_alike
from pipemetrics.properties.catalogue import Property
from pipemetrics.properties.engine import PropertyResult
from pipemetrics.properties.run_options import RunOptions


def guests_of(
    together: Sequence[Property], chosen: Sequence[Property], options: RunOptions
) -> tuple[Property, ...]:
    """The properties of ``chosen`` that judge the scenarios of ``together``'s pass as guests:
    of another generator that draws every scenario this one does. None where the pass draws
    otherwise than its generator alone would (`drawn_alike`: combinations, saved examples)."""
    host = together[0].scenarios
    if not drawn_alike(together, options):
        return ()
    return tuple(prop for prop in chosen if prop.scenarios != host and prop.scenarios.covers(host))


def merged(results: Sequence[PropertyResult], order: Sequence[str]) -> list[PropertyResult]:
    """Each property's own result (``drawn_by`` None) with its guest results folded in: their
    seconds added and, where every one passed, the scenarios they judged as ``also_judged``
    (else 0: which guests ran after a failure depends on how the work was split); where its own
    result passed and a guest result did not, the first of those in ``order`` (property IDs:
    the passes' order, whatever order the workers finished in) is its result instead, its own
    examples added."""
    own = {result.id: result for result in results if result.drawn_by is None}
    rank = {prop_id: place for place, prop_id in enumerate(order)}
    guests = sorted(
        (result for result in results if result.drawn_by is not None),
        key=lambda result: rank.get(result.drawn_by or "", len(rank)),
    )
    out = []
    for prop_id, result in own.items():
        theirs = [guest for guest in guests if guest.id == prop_id]
        failed = next((guest for guest in theirs if guest.status != "pass"), None)
        chosen = result
        if result.status == "pass" and failed is not None:
            chosen = replace(failed, examples=failed.examples + result.examples)
        passed = chosen.status == "pass"
        out.append(
            replace(
                chosen,
                also_judged=sum(guest.also_judged for guest in theirs) if passed else 0,
                seconds=result.seconds + sum(guest.seconds for guest in theirs),
            )
        )
    return out
