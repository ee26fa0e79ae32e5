"""The reference decides at import by the APIs present, not by the version string: a missing
API is refused by name; an untested version with every API warns once and carries on.

The module source is exec'd afresh in an empty namespace with the version lookup monkeypatched
(``importlib.metadata.version``, then megatron's own ``package_info`` as the fallback), so no
other release has to be installed.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import tomllib
import types
import warnings
from importlib import metadata
from pathlib import Path

import pytest

from pipemetrics.reference import megatron_common as mc

SOURCE_PATH = Path(mc.__file__)
PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"
REAL_VERSION = metadata.version


def exec_reference() -> types.ModuleType:
    """Execute the reference source as a fresh module (what importing a vendored copy does)."""
    module = types.ModuleType("vendored_megatron_common")
    module.__file__ = str(SOURCE_PATH)
    code = compile(SOURCE_PATH.read_text(encoding="utf-8"), str(SOURCE_PATH), "exec")
    exec(code, module.__dict__)
    return module


def fake_version(found: str | None) -> object:
    def version(name: str) -> str:
        if name.replace("_", "-").lower() == "megatron-core":
            if found is None:
                raise metadata.PackageNotFoundError(name)
            return found
        return REAL_VERSION(name)

    return version


def test_installed_version_is_tested_and_imports_silently() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        module = exec_reference()
    assert callable(module.get_moe_metrics)
    assert module.SUPPORTED_MEGATRON_CORE == ">=0.13,<0.21"
    assert module._is_tested(metadata.version("megatron-core"))


@pytest.mark.parametrize(
    "found",
    ["0.13.1", "0.15.3", "0.17.1", "0.18.2", "0.19.0", "0.19.2+abc123", "0.18.0rc1", "0.20.0"],
)
def test_tested_versions_import_without_a_warning(
    monkeypatch: pytest.MonkeyPatch, found: str
) -> None:
    monkeypatch.setattr(metadata, "version", fake_version(found))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert callable(exec_reference().get_mtp_metrics)


@pytest.mark.parametrize(
    "found", ["0.21.0", "0.21.0rc0", "0.22.0.dev0+g1a2b3c", "1.0.0", "garbage", "0.12.3"]
)
def test_an_untested_version_with_every_api_warns_once_and_carries_on(
    monkeypatch: pytest.MonkeyPatch, found: str
) -> None:
    """A release candidate, a git checkout or a fork's own version string must not break a
    training job at import: the APIs are there (the installed release's), so it carries on."""
    monkeypatch.setattr(metadata, "version", fake_version(found))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("default")
        module = exec_reference()
    assert callable(module.get_moe_metrics)
    untested = [w for w in seen if type(w.message).__name__ == "UntestedMegatronCoreWarning"]
    assert len(untested) == 1, [str(w.message) for w in seen]
    assert str(untested[0].message).startswith(
        f"pipemetrics reference is tested with megatron-core >=0.13,<0.21; found {found}"
    )


def test_an_unknown_version_warns_and_carries_on(monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron.core import package_info

    monkeypatch.setattr(metadata, "version", fake_version(None))
    monkeypatch.delattr(package_info, "__version__")
    with pytest.warns(UserWarning, match="found not installed or of unknown version"):
        assert callable(exec_reference().get_moe_metrics)


def test_version_falls_back_to_package_info(monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron.core import package_info

    monkeypatch.setattr(metadata, "version", fake_version(None))
    monkeypatch.setattr(package_info, "__version__", "0.21.1")
    with pytest.warns(UserWarning, match=re.escape("found 0.21.1")):
        exec_reference()
    monkeypatch.setattr(package_info, "__version__", "0.19.2")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert callable(exec_reference().get_moe_metrics)


def test_a_missing_api_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """The installed release without the tracker function its tracker API needs (a tested
    version string changes nothing: the APIs decide)."""
    import importlib

    try:
        module = importlib.import_module("megatron.core.transformer.moe.moe_logging")
        missing = "megatron.core.transformer.moe.moe_logging.get_moe_metrics_tracker"
        monkeypatch.delattr(module, "get_moe_metrics_tracker")
    except ImportError:  # 0.13-0.17: the dict tracker of moe_utils
        from megatron.core.transformer.moe import moe_utils

        missing = "megatron.core.transformer.moe.moe_utils.get_moe_layer_wise_logging_tracker"
        monkeypatch.delattr(moe_utils, "get_moe_layer_wise_logging_tracker")
    monkeypatch.setattr(metadata, "version", fake_version("0.19.2"))
    with pytest.raises(ImportError) as info:
        exec_reference()
    # the exec'd module defines its own class; an ImportError, so `except ImportError` still works
    assert type(info.value).__name__ == "UnsupportedMegatronCoreError"
    assert str(info.value).startswith(
        f"pipemetrics reference needs {missing}, missing in the installed megatron-core (0.19.2)"
    ), str(info.value)


def test_the_tracker_api_is_chosen_by_the_module_present(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without ``moe_logging`` (what 0.13-0.17 look like) the dict tracker of ``moe_utils`` is
    used, whatever the version string says; with it, the class tracker (0.18+ keep the dict
    functions as deprecated shims, so their presence decides nothing)."""
    import sys

    monkeypatch.setattr(metadata, "version", fake_version("0.19.2"))
    monkeypatch.setitem(sys.modules, "megatron.core.transformer.moe.moe_logging", None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module = exec_reference()
    assert module._TRACKER_API == "dict"
    assert module.get_moe_metrics_tracker is module._legacy_moe_metrics_tracker


def test_a_missing_module_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "megatron.core.transformer.multi_token_prediction", None)
    with pytest.raises(ImportError, match=r"needs megatron\.core\.transformer\.multi_token_pred"):
        exec_reference()


def test_pyproject_declares_the_same_range() -> None:
    dependencies = tomllib.loads(PYPROJECT.read_text(encoding="utf-8"))["project"]["dependencies"]
    assert f"megatron-core{mc.SUPPORTED_MEGATRON_CORE}" in dependencies


def test_the_inprocess_tier_runs_only_where_it_is_validated(tmp_path: Path) -> None:
    """The in-process tier refuses megatron-core's legacy dict tracker (0.13-0.17), where the
    differential test against the process tier fails, instead of giving an outcome there; the
    decision is read from the installed files (checked here on the installed release and on a
    tree without ``moe_logging``), and ``prove`` says what to do instead."""
    from pipemetrics.sim.worlds.inprocess_world import inprocess_unsupported

    legacy_here = importlib.util.find_spec("megatron.core.transformer.moe.moe_logging") is None
    assert (inprocess_unsupported() is not None) == legacy_here
    (tmp_path / "megatron" / "core" / "transformer" / "moe").mkdir(parents=True)
    (tmp_path / "megatron" / "__init__.py").write_text("")
    probe = (
        "from pipemetrics.sim.worlds.inprocess_world import inprocess_unsupported as u; print(u())"
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    legacy = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                            text=True, timeout=120, check=True)  # fmt: skip
    assert "validated on megatron-core 0.18+" in legacy.stdout
    refused = subprocess.run(
        [sys.executable, "-m", "pipemetrics.commands.cli", "prove", "--max-pp", "1"],
        env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert refused.returncode == 2 and "use --tier process" in refused.stderr
    (tmp_path / "megatron" / "core" / "transformer" / "moe" / "moe_logging.py").write_text("")
    current = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                             text=True, timeout=120, check=True)  # fmt: skip
    assert current.stdout.strip() == "None"
