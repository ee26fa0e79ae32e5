"""One list per choice: the pytest plugin offers every option of ``pipemetrics check`` that
makes sense inside pytest (the others are named in `NOT_IN_PYTEST`, each with its reason), as
``--pipemetrics-NAME`` with the same choices, default, type and action as the parser's."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from pipemetrics.commands.parser import command_parser
from pipemetrics.properties import plugin

#: Runs with megatron-core unreachable (ci/test.sh); the oldest release's leg leaves it out.
pytestmark = pytest.mark.release_independent


class _Recorder:
    """Stands in for pytest's parser and its option group: records every ``addoption``."""

    def __init__(self) -> None:
        self.options: dict[str, dict[str, Any]] = {}

    def getgroup(self, *args: object) -> _Recorder:
        return self

    def addoption(self, *names: str, **kwargs: Any) -> None:
        for name in names:
            self.options[name] = kwargs


def _check_options() -> dict[str, argparse.Action]:
    return {
        max(action.option_strings, key=len): action
        for action in command_parser("check")._actions
        if action.option_strings
        and not isinstance(action, argparse._HelpAction)
        and action.help != argparse.SUPPRESS
    }


def _plugin_options() -> dict[str, dict[str, Any]]:
    recorder = _Recorder()
    plugin.pytest_addoption(recorder)  # type: ignore[arg-type]
    return recorder.options


def test_the_plugin_offers_every_check_option_but_the_named_ones() -> None:
    check = _check_options()
    offered = {name.removeprefix("--pipemetrics-") for name in _plugin_options()}
    wanted = {name.removeprefix("--") for name in check if name not in plugin.NOT_IN_PYTEST}
    assert offered == wanted, (sorted(offered - wanted), sorted(wanted - offered))
    assert set(plugin.NOT_IN_PYTEST) <= set(check), "NOT_IN_PYTEST names no check option"


def test_each_option_has_the_same_choices_default_type_and_action() -> None:
    options = _plugin_options()
    for name, action in _check_options().items():
        if name in plugin.NOT_IN_PYTEST:
            continue
        ours = options["--pipemetrics-" + name.removeprefix("--")]
        choices = None if action.choices is None else tuple(action.choices)
        theirs = ours.get("choices")
        assert (None if theirs is None else tuple(theirs)) == choices, name
        assert ours.get("default") == action.default, name
        assert ours.get("type") == action.type, name
        assert ours.get("nargs") == action.nargs, name
        kind = ours.get("action", "store")
        assert (
            kind
            == {"_AppendAction": "append", "_ExtendAction": "extend", "_StoreAction": "store"}[
                type(action).__name__
            ]
        ), name
