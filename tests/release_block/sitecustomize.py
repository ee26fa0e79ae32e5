"""Makes megatron-core unreachable in every Python process started with this directory on
``PYTHONPATH``: importing ``megatron``, finding its files (``importlib.util.find_spec``, which
`pipemetrics.sim.mcore.source` reads the installed release through) or reading its metadata
raises `ReleaseDependent`, which no code of pipemetrics catches.

ci/test.sh runs the tests marked ``release_independent`` so (children included: a command a
test starts, a fork server, a rank), which proves that their outcome cannot depend on the
installed release; the oldest release's leg (ci/noxfile.py) then leaves them out.
"""

from __future__ import annotations

import os
import sys
from importlib.abc import MetaPathFinder
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any


class ReleaseDependent(RuntimeError):
    """A test marked release_independent reached megatron-core."""


LOG = os.environ.get("PIPEMETRICS_RELEASE_BLOCK_LOG")
"""The file every process appends each reach to (whatever code then does with the exception:
one that catches it and carries on is found all the same); the block is off without it."""


def _reached(what: str) -> ReleaseDependent:
    assert LOG is not None
    with open(LOG, "a", encoding="utf-8") as log:
        test = os.environ.get("PYTEST_CURRENT_TEST", "outside any test").removesuffix(" (call)")
        log.write(f"{test}: pid {os.getpid()}: {what}\n")
    return ReleaseDependent(
        f"{what} from a test marked release_independent: its outcome can depend on the "
        "megatron-core release, so it must not carry the marker"
    )


def _ours(name: str) -> bool:
    return name == "megatron" or name.startswith("megatron.")


class _Block(MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Any = None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if _ours(fullname):
            raise _reached(f"{fullname!r} imported or looked up")
        return None

    def find_distributions(self, context: Any = None) -> list[Any]:
        name = getattr(context, "name", None) or ""
        if name.replace("_", "-").lower() == "megatron-core":
            raise _reached("megatron-core's metadata read")
        return []


if LOG:
    sys.meta_path.insert(0, _Block())
