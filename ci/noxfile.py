"""The megatron-core version matrix: the test suite against every supported minor release
(`MEGATRON_CORE`), each in its own Python 3.12 virtualenv.

    .venv/bin/nox -f ci/noxfile.py                        # every release
    .venv/bin/nox -f ci/noxfile.py -s "tests(megatron='0.18.2')" -- -k vendor   # one, pytest args
    .venv/bin/nox -f ci/noxfile.py -s "git(branch='dev')"  # megatron-core from a git snapshot

``git(branch=...)`` runs the suite under megatron-core from a git branch: pipemetrics with its
pinned dependencies, then the snapshot archive ``megatron-core-<branch>-<commit>.tar.gz`` from
``$PIPEMETRICS_MEGATRON_GIT`` (default ``../shared/megatron-core-git``, beside the checkout)
installed over it without dependencies (pip would otherwise replace torch and check the
snapshot's version against pipemetrics' declared range). The session skips, saying where it
looked, when no archive is there.

``.ci/run`` does not run this (it tests the pinned default, ``ci/constraints.txt``); the GitHub
workflow runs it on a schedule. torch stays at the pinned default in these sessions, so the only
thing that varies is megatron-core; the environment sessions at the end (`nemo_rl`,
`lower_bounds`, `newest`) vary Python, torch and the rest instead. pipemetrics is installed
non-editable from a copy of the checkout, so the session never rewrites the checkout's
``build/`` link tree that ``.venv`` uses.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import nox

ROOT = Path(__file__).resolve().parent.parent
CONSTRAINTS = ROOT / "ci" / "constraints.txt"
#: Every supported minor release on PyPI, oldest first, the newest patch of each (the range is
#: SUPPORTED_MEGATRON_CORE in the reference, ``megatron-core>=0.13,<0.21`` in pyproject.toml;
#: 0.20 is megatron-core's main branch, which the git sessions run). Push CI (``.ci/run``) runs
#: the suite on the oldest (`oldest`) and on the newest, the pinned default, outside nox; the
#: weekly workflow runs all.
MEGATRON_CORE = ["0.13.1", "0.14.0", "0.15.3", "0.16.1", "0.17.1", "0.18.2", "0.19.2"]
OLDEST = MEGATRON_CORE[0]
#: Megatron-LM branches whose snapshots ``git(branch=...)`` installs.
GIT_BRANCHES = ["main", "dev"]
GIT_ARCHIVES = Path(
    os.environ.get("PIPEMETRICS_MEGATRON_GIT") or ROOT.parent / "shared" / "megatron-core-git"
)
#: nox points TMPDIR at the session's (deep) tmp dir; the worlds' unix sockets need a short one.
HOST_TMPDIR = tempfile.gettempdir()
_COPY_IGNORE = shutil.ignore_patterns(
    ".venv", ".nox", "build", "*.egg-info", "__pycache__", ".hypothesis", ".mypy_cache",
    ".ruff_cache", ".pytest_cache", ".git", "pipemetrics-report*",
)  # fmt: skip

nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = True
nox.options.error_on_missing_interpreters = True


def _constraints(session: nox.Session, megatron: str) -> Path:
    """ci/constraints.txt with megatron-core replaced by ``megatron``."""
    pins = [
        line
        for line in CONSTRAINTS.read_text(encoding="utf-8").splitlines()
        if line.strip() and not line.startswith("#") and not line.startswith("megatron-core")
    ]
    path = Path(session.create_tmp()) / "constraints.txt"
    path.write_text("\n".join([*pins, f"megatron-core=={megatron}"]) + "\n", encoding="utf-8")
    return path


def _env(session: nox.Session) -> dict[str, str]:
    """The test run's environment. megatron-core 0.15.3 compiles a CUDA allocator while being
    imported (``inference/unified_memory.py``); on a host without a visible GPU and without
    ``TORCH_CUDA_ARCH_LIST`` torch then raises an ``IndexError`` that 0.15.3 does not catch, so
    every ``import megatron.core`` fails. An arch list makes the build fail with an error it
    does catch; its scratch build goes under the session's tmp dir."""
    env = {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "TMPDIR": HOST_TMPDIR}
    if not os.environ.get("TORCH_CUDA_ARCH_LIST"):
        env["TORCH_CUDA_ARCH_LIST"] = "9.0"
    env.setdefault("TORCH_EXTENSIONS_DIR", str(Path(session.create_tmp()) / "torch_extensions"))
    return env


def _install(session: nox.Session, constraints: Path) -> None:
    """pipemetrics from a copy of the checkout, with ``constraints``."""
    source = Path(session.create_tmp()) / "src"
    shutil.rmtree(source, ignore_errors=True)
    shutil.copytree(ROOT, source, ignore=_COPY_IGNORE)
    session.install("-c", str(constraints), f"{source}[dev]")


def _run_suite(session: nox.Session, arguments: list[str] | None = None) -> None:
    """pytest on two workers, with ``arguments`` (default: the session's, else ``tests``)."""
    session.run(
        "python", "-c",
        "from importlib.metadata import version as v; "
        "print('megatron-core', v('megatron-core'), 'torch', v('torch'))",
        env=_env(session),
    )  # fmt: skip
    session.chdir(ROOT)
    session.run(
        "python", "-m", "pytest", "-n", "2", "--dist", "loadfile",
        *(arguments or session.posargs or ["tests"]),
        env=_env(session),
    )  # fmt: skip


@nox.session(python="3.12")
@nox.parametrize("megatron", MEGATRON_CORE)
def tests(session: nox.Session, megatron: str) -> None:
    _install(session, _constraints(session, megatron))
    _run_suite(session)


#: What push CI's `oldest` session leaves out (each runs on the pinned release in ``.ci/run`` and
#: on every release and git branch in the weekly matrix): prove's mutant proofs (about 6 minutes
#: there, on the process tier: 0.13 refuses the in-process one) and the runner's fault handling
#: (signals, crashes and leftovers of pipemetrics' own processes, which no megatron-core release
#: enters; about 3 minutes).
OLDEST_LEAVES_OUT = ["tests/test_prove_matches_check.py", "tests/test_faults.py"]
#: The tests the `oldest` session selects: every test but those marked release_independent,
#: which ci/test.sh runs with megatron-core unreachable (tests/release_block), so their outcome
#: is the same on every release (tests/test_release_block.py).
OLDEST_SELECTS = "not release_independent"


@nox.session(python="3.12", default=False)  # the matrix runs 0.13.1 in full
def oldest(session: nox.Session) -> None:
    """Push CI's second leg (``.ci/run``, the workflow's ``oldest-release`` job): the suite
    under the oldest supported release, but `OLDEST_LEAVES_OUT` and the release-independent
    tests (`OLDEST_SELECTS`); pytest arguments replace the default ones."""
    _install(session, _constraints(session, OLDEST))
    leave_out = [arg for path in OLDEST_LEAVES_OUT for arg in ("--ignore", path)]
    default = ["-q", "--durations=15", "-m", OLDEST_SELECTS, *leave_out, "tests"]
    _run_suite(session, session.posargs or default)


@nox.session(python="3.12")
@nox.parametrize("branch", GIT_BRANCHES)
def git(session: nox.Session, branch: str) -> None:
    archives = sorted(GIT_ARCHIVES.glob(f"megatron-core-{branch}-*.tar.gz"))
    if len(archives) != 1:
        session.skip(
            f"expected one megatron-core-{branch}-<commit>.tar.gz in {GIT_ARCHIVES} "
            f"(set PIPEMETRICS_MEGATRON_GIT), found {[a.name for a in archives]}"
        )
    _install(session, CONSTRAINTS)
    session.install("--no-deps", str(archives[0]))
    _run_suite(session)


# Adopters' environments (issue 50): pipemetrics installed as an adopter installs it (no extras)
# into an interpreter and dependency set other than the pinned default's, then the reference's
# own tests and a reduced `pipemetrics check` of the reference, which must end CONFORMANT (exit
# 0). Each session pins exactly what its table names and lets pip pick the newest of the rest.
# Weekly (the workflow's `environments` job), not in `.ci/run`; docs/releases.md has each one's
# last result.
#
#     .venv/bin/nox -f ci/noxfile.py -s nemo_rl "lower_bounds(megatron='0.13.1')" newest

#: What each environment session runs: the reference's tests (pytest arguments replace them).
ENVIRONMENT_TESTS = [
    "tests/test_reference_unit.py",
    "tests/test_reference_distributed.py",
    "tests/test_version_guard.py",
]
#: `pipemetrics check` at reduced examples, derandomised (one seed, no example database).
ENVIRONMENT_CHECK = ["--max-examples", "20", "--seed", "0"]
#: NeMo-RL's pins at its HEAD (the home of the API the reference implements): Python
#: ``>=3.13.14,<3.14`` and ``torch==2.11.0``; megatron-core 0.19.2 is the release NeMo-RL's
#: pinned torch pairs with.
NEMO_RL_PYTHON = "3.13"
NEMO_RL = {"torch": "2.11.0", "megatron-core": "0.19.2"}
#: The lower bounds pyproject.toml declares, on the lowest Python it declares (requires-python),
#: each tested by `lower_bounds` (tests/test_environments.py holds the two equal). torch: 0.15
#: and later require ``torch>=2.6.0``, and 2.6 and 2.7 have no ``ReduceOp.AVG`` for gloo, which
#: every world here runs on and both megatron-core's reduction and the reference's use (2.6.0:
#: 13 of the reference's distributed tests end in a deadlock verdict); 2.8.0 has it.
LOWER_BOUNDS_PYTHON = "3.12"
LOWER_BOUNDS = {"torch": "2.8.0", "hypothesis": "6.100.0", "pydantic": "2.6.0"}
#: The lower bounds under the oldest and the newest supported megatron-core.
LOWER_BOUNDS_MEGATRON = [MEGATRON_CORE[0], MEGATRON_CORE[-1]]
#: `newest`: the newest release of every dependency pip offers inside pyproject.toml's ranges, on
#: the newest Python here, without constraints; PIP_CONSTRAINT is pointed at an empty file so
#: that a machine-wide cap (this machine's /etc/xdg/pip caps torch) does not apply.
NEWEST_PYTHON = "3.13"


def _interpreter(minor: str) -> str:
    """Python ``minor`` for nox: pyenv's newest ``minor.*`` when pyenv holds one (nox does not
    find a pyenv version that is not active: this machine keeps 3.13.0 there), else ``minor``
    (found on PATH, as on GitHub's runners)."""
    root = Path(os.environ.get("PYENV_ROOT") or Path.home() / ".pyenv") / "versions"
    found = [
        p for p in root.glob(f"{minor}.*/bin/python{minor}") if p.parts[-3].split(".")[2].isdigit()
    ]
    found.sort(key=lambda p: int(p.parts[-3].split(".")[2]))
    return str(found[-1]) if found else minor


def _install_pins(session: nox.Session, pins: dict[str, str] | None) -> None:
    """pipemetrics (no extras) from a copy of the checkout, constrained to exactly ``pins``
    (``None``: nothing, the machine's own pip constraints lifted too)."""
    source = Path(session.create_tmp()) / "src"
    shutil.rmtree(source, ignore_errors=True)
    shutil.copytree(ROOT, source, ignore=_COPY_IGNORE)
    if pins is None:
        session.install(str(source), env={"PIP_CONSTRAINT": os.devnull})
        return
    constraints = Path(session.create_tmp()) / "constraints.txt"
    constraints.write_text("".join(f"{n}=={v}\n" for n, v in pins.items()), encoding="utf-8")
    session.install("-c", str(constraints), str(source))


def _run_environment(session: nox.Session) -> None:
    """The reference's tests (one process, no xdist workers), then the reduced check (in the
    session's tmp dir, where a failure's scenarios are written)."""
    work = Path(session.create_tmp()).resolve() / "check"
    env = _env(session)  # before the first chdir: its tmp paths are relative
    session.run(
        "python", "-c",
        "import sys; from importlib.metadata import version as v; print('python', "
        "sys.version.split()[0], *(f'{n} {v(n)}' for n in ('torch', 'megatron-core', "
        "'hypothesis', 'pydantic', 'numpy', 'pytest')))",
        env=env,
    )  # fmt: skip
    session.chdir(ROOT)
    session.run(
        "python", "-m", "pytest", "-p", "no:xdist", "-q",
        *(session.posargs or ENVIRONMENT_TESTS),
        env=env,
    )  # fmt: skip
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    session.chdir(work)
    session.run(
        "pipemetrics", "check", *ENVIRONMENT_CHECK, "--report-dir", str(work / "report"),
        env=env,
    )  # fmt: skip


@nox.session(python=_interpreter(NEMO_RL_PYTHON), default=False)
def nemo_rl(session: nox.Session) -> None:
    """NeMo-RL's pins (`NEMO_RL`)."""
    _install_pins(session, NEMO_RL)
    _run_environment(session)


@nox.session(python=_interpreter(LOWER_BOUNDS_PYTHON), default=False)
@nox.parametrize("megatron", LOWER_BOUNDS_MEGATRON)
def lower_bounds(session: nox.Session, megatron: str) -> None:
    """pyproject.toml's lower bounds (`LOWER_BOUNDS`) under ``megatron``."""
    _install_pins(session, {**LOWER_BOUNDS, "megatron-core": megatron})
    _run_environment(session)


@nox.session(python=_interpreter(NEWEST_PYTHON), default=False)
def newest(session: nox.Session) -> None:
    """The newest release of every dependency, no constraints."""
    _install_pins(session, None)
    _run_environment(session)
