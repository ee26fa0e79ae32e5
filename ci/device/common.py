"""What the device checks share: loading the reference from a file, and the PASS/FAIL lines
with the exit status (run as scripts, they import this from their own folder)."""

from __future__ import annotations

import importlib.util
from typing import Any


def load(path: str) -> Any:
    """The module at ``path`` (the reference under test), loaded by file, not by name."""
    spec = importlib.util.spec_from_file_location("reference_under_test", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def report(results: list[tuple[str, str | None]]) -> int:
    """Print a PASS or FAIL line per check (with its error) and the counts; 1 if any failed."""
    for name, error in results:
        print(("PASS " if error is None else "FAIL ") + name)
        if error:
            print(error)
    failed = sum(error is not None for _, error in results)
    print(f"{len(results) - failed} passed, {failed} failed")
    return 1 if failed else 0
