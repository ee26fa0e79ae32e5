"""The reference refuses an unsupported megatron-core at import, naming the supported range.

The module source is exec'd afresh in an empty namespace with the version lookup monkeypatched
(``importlib.metadata.version``, then megatron's own ``package_info`` as the fallback), so no
other release has to be installed.
"""

from __future__ import annotations

import re
import tomllib
import types
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


@pytest.fixture(autouse=True)
def _no_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PIPEMETRICS_SKIP_MEGATRON_VERSION_CHECK", raising=False)


def test_installed_version_is_supported() -> None:
    module = exec_reference()
    assert callable(module.get_moe_metrics)
    assert module.SUPPORTED_MEGATRON_CORE == ">=0.18,<0.20"
    module._check_megatron_core_version(metadata.version("megatron-core"))


@pytest.mark.parametrize(
    "found", ["0.18.0", "0.18.2", "0.19.0", "0.19.2", "0.19.2+abc123", "0.18.0rc1"]
)
def test_supported_versions_import(monkeypatch: pytest.MonkeyPatch, found: str) -> None:
    monkeypatch.setattr(metadata, "version", fake_version(found))
    assert callable(exec_reference().get_mtp_metrics)


@pytest.mark.parametrize("found", ["0.17.1", "0.16.0", "0.20.0", "0.20.0rc0", "1.0.0", "garbage"])
def test_unsupported_version_is_refused_by_name(
    monkeypatch: pytest.MonkeyPatch, found: str
) -> None:
    monkeypatch.setattr(metadata, "version", fake_version(found))
    with pytest.raises(ImportError) as info:
        exec_reference()
    # the exec'd module defines its own class; an ImportError, so `except ImportError` still works
    assert type(info.value).__name__ == "UnsupportedMegatronCoreError"
    message = str(info.value)
    assert message.startswith(
        f"pipemetrics reference supports megatron-core >=0.18,<0.20; found {found}"
    ), message


def test_fallback_to_package_info(monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron.core import package_info

    monkeypatch.setattr(metadata, "version", fake_version(None))
    monkeypatch.setattr(package_info, "__version__", "0.17.1")
    with pytest.raises(ImportError, match=re.escape("found 0.17.1")):
        exec_reference()
    monkeypatch.setattr(package_info, "__version__", "0.19.2")
    assert callable(exec_reference().get_moe_metrics)


def test_unknown_version_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron.core import package_info

    monkeypatch.setattr(metadata, "version", fake_version(None))
    monkeypatch.delattr(package_info, "__version__")
    with pytest.raises(ImportError, match="cannot be determined"):
        exec_reference()


def test_override_lets_a_fork_import(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(metadata, "version", fake_version("0.21.0.dev0"))
    monkeypatch.setenv("PIPEMETRICS_SKIP_MEGATRON_VERSION_CHECK", "1")
    assert callable(exec_reference().get_moe_metrics)


def test_pyproject_declares_the_same_range() -> None:
    dependencies = tomllib.loads(PYPROJECT.read_text(encoding="utf-8"))["project"]["dependencies"]
    assert f"megatron-core{mc.SUPPORTED_MEGATRON_CORE}" in dependencies
