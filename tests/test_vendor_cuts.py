"""``pipemetrics vendor DEST --megatron-core X.Y``: the reference cut for one release (without the
parts marked ``# only: ...`` for other releases), and ``vendor --check`` on such a cut. Static:
no cut is imported here (``tests/test_vendor.py`` runs ``check`` on the installed release's cut).
"""

from __future__ import annotations

import ast
import io
import os
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest

from pipemetrics.commands import vendor_text as vendor_module
from pipemetrics.commands.cli import main as cli_main
from pipemetrics.commands.vendor_text import (
    CUT_RELEASES,
    cut_source,
    marker_releases,
    reference_path,
    release_of,
)

#: Runs with megatron-core unreachable (ci/test.sh); the oldest release's leg leaves it out.
pytestmark = pytest.mark.release_independent

REPO = Path(__file__).resolve().parents[1]
#: What each cut saves at least, in lines against the full file (measured 2026-12-07: 0.13-0.17
#: 116, 0.18 286, 0.19 309; the full file 1,593 lines, as before the passage markers).
SHORTER_BY = {"0.18": 280, "0.19": 300} | {r: 110 for r in CUT_RELEASES[:5]}
API = ("_round_up_to_multiple", "broadcast_tensor", "get_aux_loss_track_names", "get_moe_metrics",
       "get_mtp_metrics")  # fmt: skip


def run_vendor(cwd: Path, *args: str) -> int:
    before = Path.cwd()
    os.chdir(cwd)
    try:
        return cli_main(["vendor", *args])
    finally:
        os.chdir(before)


def test_every_cut_parses_and_is_shorter(tmp_path: Path) -> None:
    """Each release's cut: valid Python defining the five functions, nothing marked for other
    releases only left in it, its tested range narrowed, and at least `SHORTER_BY` lines
    shorter than the full file as `vendor` writes it by default."""
    assert run_vendor(tmp_path, "full.py") == 0
    full = (tmp_path / "full.py").read_text(encoding="utf-8").splitlines()
    for release in CUT_RELEASES:
        name = f"cut_{release.replace('.', '_')}.py"
        assert run_vendor(tmp_path, name, "--megatron-core", release) == 0
        text = (tmp_path / name).read_text(encoding="utf-8")
        tree = ast.parse(text)
        defined = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
        assert set(API) <= defined, release
        lines = text.splitlines()
        assert len(full) - len(lines) >= SHORTER_BY[release], (release, len(full), len(lines))
        for token in tokenize.generate_tokens(io.StringIO(text).readline):
            if token.type == tokenize.COMMENT and token.string.startswith("# only:"):
                spec = token.string.removeprefix("# only:").split("(")[0]
                assert release in marker_releases(spec), (release, token.line)
        major, minor = release.split(".")
        assert f'SUPPORTED_MEGATRON_CORE = ">={release},<{major}.{int(minor) + 1}"' in text
        assert f"# Cut for megatron-core {release}: " in text
        assert f"pipemetrics vendor {name} --megatron-core {release}\n" in text


def test_cuts_are_lint_clean(tmp_path: Path) -> None:
    """``ruff check`` and ``ruff format --check`` with the project's settings pass every cut (the
    full file is linted by ci/lint.sh; mypy --strict on the cuts was run by hand)."""
    pytest.importorskip("ruff")
    source = reference_path().read_text(encoding="utf-8")
    paths = []
    for release in CUT_RELEASES:
        path = tmp_path / f"cut_{release.replace('.', '_')}.py"
        path.write_text(cut_source(source, release), encoding="utf-8")
        paths.append(str(path))
    config = ["--config", str(REPO / "pyproject.toml")]
    for command in (["check", "--no-cache"], ["format", "--check", "--no-cache"]):
        done = subprocess.run(
            [sys.executable, "-m", "ruff", *command, *config, *paths],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr


def _nox_releases() -> list[str]:
    """ci/noxfile.py's MEGATRON_CORE, read without executing the noxfile."""
    tree = ast.parse((REPO / "ci" / "noxfile.py").read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "MEGATRON_CORE" for t in node.targets
        ):
            return [str(v) for v in ast.literal_eval(node.value)]
    raise AssertionError("ci/noxfile.py has no MEGATRON_CORE")


@pytest.mark.parametrize("version", _nox_releases())
def test_each_release_leg_has_its_cut(tmp_path: Path, version: str) -> None:
    """Every release the nox legs install has a cut, and naming the leg's full version (what
    `tests/test_vendor.py` does on that leg) writes the same file as naming its minor release."""
    release = release_of(version)
    assert release == ".".join(version.split(".")[:2])
    assert run_vendor(tmp_path, "a.py", "--megatron-core", version) == 0
    assert run_vendor(tmp_path, "b.py", "--megatron-core", release) == 0
    a = (tmp_path / "a.py").read_text(encoding="utf-8").replace("vendor a.py", "vendor b.py")
    a = a.replace("--check a.py", "--check b.py").replace("--impl a.py", "--impl b.py")
    assert a == (tmp_path / "b.py").read_text(encoding="utf-8")


@pytest.mark.parametrize("value", ["0.12", "0.20", "main", "dev", "latest"])
def test_an_unknown_release_is_refused_naming_the_option(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], value: str
) -> None:
    assert run_vendor(tmp_path, "c.py", "--megatron-core", value) == 2
    err = capsys.readouterr().err
    assert f"--megatron-core {value}: no cut for this release" in err
    assert ", ".join(CUT_RELEASES) in err
    assert not (tmp_path / "c.py").exists()


def test_check_accepts_a_cut_and_detects_its_drift(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_vendor(tmp_path, "c.py", "--megatron-core", "0.19") == 0
    capsys.readouterr()
    assert run_vendor(tmp_path, "--check", "c.py") == 0
    out = capsys.readouterr().out
    assert out.startswith("c.py: up to date (pipemetrics ") and "cut for megatron-core 0.19" in out
    path = tmp_path / "c.py"
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines(keepends=True)
    number = next(i for i, t in enumerate(lines, 1) if t.startswith("def _sync("))
    lines[number - 1] = lines[number - 1].replace("_sync", "_synk")
    path.write_text("".join(lines), encoding="utf-8")
    assert run_vendor(tmp_path, "--check", "c.py") == 1
    err = capsys.readouterr().err
    assert err.startswith(f"c.py:{number}: drift: the reference text was edited"), err
    # the release dropped from the regenerate line: still a cut (its "Cut for" line), drifted
    path.write_text(text.replace(" --megatron-core 0.19\n", "\n"), encoding="utf-8")
    assert run_vendor(tmp_path, "--check", "c.py") == 1
    assert "the header was edited (the reference text is intact)" in capsys.readouterr().err
    assert run_vendor(tmp_path, "--check", "c.py", "--megatron-core", "0.19") == 2


def test_a_marker_naming_an_unknown_release_is_refused() -> None:
    source = reference_path().read_text(encoding="utf-8")
    with pytest.raises(ValueError, match=r"unknown megatron-core release '0\.12-0\.17'"):
        cut_source(source.replace("# only: 0.13-0.17", "# only: 0.12-0.17", 1), "0.19")
    assert marker_releases("0.13-0.15, dev") == {"0.13", "0.14", "0.15", "dev"}
    assert vendor_module.SNAPSHOTS == ("main", "dev")
    with pytest.raises(ValueError, match="no cut for megatron-core main"):
        cut_source(source, "main")


TOY = """SUPPORTED_MEGATRON_CORE = ">=0.13,<0.21"
_SUPPORTED_MIN = (0, 13)
_SUPPORTED_END = (0, 21)
X = 1 if SUPPORTED_MEGATRON_CORE else 2
KEYS = (
    "a",
    "b",  # only: dev
)


@staticmethod
def old() -> int:  # only: 0.13-0.17
    return 0


def f(a: int) -> int:
    y = a if a else 0
    if y:
        return 1
    else:  # only: dev
        return 2
    return 3


# ------------------------------------------------ legacy (only: 0.13-0.14)

LEGACY = 1
"""


def test_what_each_kind_of_marker_drops() -> None:
    """A statement with its decorators, an ``else:`` clause (beside conditional expressions),
    an element of a literal, a section; kept where the SPEC names the release."""
    cut = cut_source(TOY, "0.19")
    assert "def old" not in cut and "@staticmethod" not in cut
    assert "return 2" not in cut and "else:" not in cut and "return 3" in cut
    assert '"b"' not in cut and '"a"' in cut and "LEGACY" not in cut
    assert 'SUPPORTED_MEGATRON_CORE = ">=0.19,<0.20"' in cut
    assert "\n\n\n\n" not in cut
    kept = cut_source(TOY, "0.13")
    assert "def old" in kept and "LEGACY = 1" in kept and "return 2" not in kept


PASSAGES = '''"""Module.

Kept for every cut.

Explains the releases side by side. (only: full)
"""

#: Kept: a comment run without a marker.
A = 1
#: The legacy spelling, on 0.13-0.17 only: the whole run goes
#: with it. (only: 0.13-0.17)
B = 2


def f() -> int:
    """What f does.

    How 0.13-0.18 differ, a paragraph of its own, marked at its end, with the closing quotes
    on its last line. (only: 0.13-0.18)"""
    return 1
'''


def test_what_passage_markers_drop() -> None:
    """A docstring paragraph marked at its end goes with the blank line before it (its
    closing quotes stay, on the line left where only one is); a marked run of comments goes whole; ``full``
    names no cut; the full file is the text itself."""
    source = PASSAGES.replace('"""Module.', 'DOC = """Module.') + "\n\n" + TOY
    cut = cut_source(source, "0.19")
    assert "Kept for every cut." in cut and "side by side" not in cut
    assert "#: Kept: a comment run without a marker." in cut and "legacy spelling" not in cut
    assert "with it." not in cut and "B = 2" in cut
    assert '    """What f does."""\n    return 1' in cut  # one line left: the quotes on it
    assert "How 0.13-0.18 differ" not in cut
    older = cut_source(source, "0.13")
    assert "legacy spelling" in older and "How 0.13-0.18 differ" in older
    assert "side by side" not in older
    assert marker_releases("full, dev") == {"full", "dev"}
    ast.parse(cut)


def test_a_marker_cannot_end_a_string_s_first_paragraph() -> None:
    with pytest.raises(ValueError, match="a marker ends a string's first paragraph"):
        cut_source('DOC = """One paragraph only. (only: dev)\n"""\n' + TOY, "0.19")
    with pytest.raises(ValueError, match="a marker follows the code it marks"):
        cut_source("# only: dev\nZ = 1\n" + TOY, "0.19")
