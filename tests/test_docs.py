"""Every Python and shell snippet in README.md and docs/ runs as written: Sybil parses the
Markdown, and each fenced ```python, ```bash, ```sh, ```shell or ```console block is one test
whose ID names its file and line (``docs/findings.md:115``).

What a snippet runs in (the visible fixture, `checkout`): a fresh temporary directory that holds a
symlink to every top-level entry of the repository, so that the paths the docs give relative to
the repository root resolve, with ``.venv/bin`` (the running interpreter's) first on ``PATH`` and
``TMPDIR`` inside it; it is removed afterwards, and no process started with that ``TMPDIR`` may
outlive the snippet. Each snippet runs in a subprocess under a hard deadline:

* a shell snippet with ``bash -e -o pipefail``; it must exit 0, or N where its last line ends in
  a comment ``# exit N``;
* a Python snippet as a script (tracebacks point into the Markdown file); one that defines
  ``test_`` functions is a test module and runs under pytest, which must pass it.

A snippet that cannot run here is skipped by name in `SKIPPED`, with the reason: an excerpt, or
too costly for CI (what it costs), or what it needs that CI lacks; the ``pipemetrics`` commands
of a skipped shell snippet are still parsed by the command's parser. `SETUP` prepares what a
snippet's text says it runs against, and `NEEDS` skips a snippet under a megatron-core release
without what it needs. All three are held to the docs: every entry must name exactly one
snippet, so no list can rot.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from sybil import Example, Sybil
from sybil.example import SybilFailure
from sybil.parsers.markdown import CodeBlockParser

from pipemetrics.commands.parser import build_parser
from pipemetrics.sim.mcore import installed_features

from .conftest import assert_no_leftovers, private_tmpdir, run_bounded

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
SHELLS = ("bash", "sh", "shell", "console")
LANGUAGES = ("python", *SHELLS)
#: Fenced blocks in these languages are not code to run (configuration, output, patches).
NOT_RUN = ("yaml", "text", "diff")
TIMEOUT_S = 300.0
"""The hard deadline of one snippet (the costliest run here takes about 20 s on an idle
2-core machine)."""

CONSOLE_PROMPT = "$ "
EXPECTED_EXIT = re.compile(r"#.*\bexit (\d+)\s*$")

_UPSTREAM_QUOTE = "a quote of megatron-core's source (an excerpt, not a program)"
_WHOLE_CHECK = "too costly for CI: ends in a whole `pipemetrics check` (about 3 min on 2 cores)"

#: (page, a substring of the snippet) -> why the snippet is not run.
SKIPPED: dict[tuple[str, str], str] = {
    ("README.md", "bash ci/bootstrap.sh && .venv/bin/pipemetrics check"): (
        "too costly for CI: sets up .venv (minutes), then the whole conformance suite (about "
        "3 min) and the whole test suite (20+ min); it is what .ci/run runs"
    ),
    ("README.md", "pip install ."): (
        "builds and installs a wheel into the environment the suite runs in; CI installs "
        "pipemetrics through ci/bootstrap.sh (the editable variant)"
    ),
    ("README.md", "pipemetrics check --impl path/to/your/common.py"): (
        f"{_WHOLE_CHECK[:-1]}; path/to/your/common.py stands for the reader's file)"
    ),
    ("README.md", "pytest --pyargs pipemetrics.properties"): (
        "too costly for CI: the whole property suite inside pytest (minutes); "
        "mytrainer.megatron.common stands for the reader's module"
    ),
    ("README.md", "pipemetrics vendor mytrainer/megatron/common.py     # or a directory"): (
        f"{_WHOLE_CHECK}; mytrainer/ stands for the reader's package"
    ),
    ("docs/migration.md", "pipemetrics vendor --check mytrainer/megatron/common.py"): (
        f"{_WHOLE_CHECK}; mytrainer/ stands for the reader's package"
    ),
    ("docs/migration.md", "def calls(monkeypatch):"): (
        "an excerpt of ci/example-adopter/tests/copy_style/test_copy_moe_metrics.py (its "
        "imports and the Calls stand-in left out); tests/test_testing_migration.py runs that file"
    ),
    (
        "docs/megatron-core-releases.md",
        "save_to_aux_losses_tracker(name: str, loss: Tensor",
    ): _UPSTREAM_QUOTE,
    ("docs/megatron-core-releases.md", "if layer_number is None: return"): _UPSTREAM_QUOTE,
    (
        "docs/megatron-core-releases.md",
        "track_moe_metrics(loss_scale: float, iteration: int",
    ): _UPSTREAM_QUOTE,
    ("docs/megatron-core-releases.md", "track_names = []"): _UPSTREAM_QUOTE,
    ("docs/megatron-core-releases.md", "from megatron.core.transformer.moe.moe_utils import"): (
        _UPSTREAM_QUOTE
    ),
    ("docs/megatron-core-releases.md", "from megatron.core.transformer.moe.moe_logging import"): (
        _UPSTREAM_QUOTE
    ),
    ("docs/upstream/ISSUE.md", "self._metrics[name] = MetricEntry("): _UPSTREAM_QUOTE,
    ("docs/upstream/ISSUE.md", "case = sys.argv[1]"): (
        "too costly for CI: a torchrun program of 4 ranks, each importing megatron-core; the "
        "text is docs/upstream/repro.py's (test_the_issue_quotes_repro_py)"
    ),
    ("docs/releases.md", ".venv/bin/nox -f ci/noxfile.py"): (
        "too costly for CI: installs each megatron-core release in a nox venv and runs the "
        "whole suite under it (hours); .ci/run runs the oldest release's session"
    ),
    ("docs/releases.md", "python ci/device/gloo_cuda_ranks.py"): (
        "needs a GPU (without one its first line prints SKIP and exits 0), and its --dry-run "
        "is too costly for CI: 2- and 4-rank worlds for about 50 s"
    ),
    ("docs/upstream/README.md", "cd Megatron-LM && git apply"): (
        "needs a Megatron-LM checkout and writes /tmp/mc; tests/test_upstream_patch.py applies "
        "both patches to copies in a temporary directory"
    ),
    ("docs/upstream/README.md", "python docs/upstream/run_gloo.py --megatron-root /tmp/mc"): (
        "needs the patched copy the Apply snippet writes to /tmp/mc, and is too costly for CI: "
        "two pytest runs of 4 processes; tests/test_upstream_patch.py runs both on copies"
    ),
}


def vendored_toytrainer(checkout: Path) -> None:
    """The migration guide's "After" imports the trainer's module ``toytrainer.megatron.metrics``,
    which after the migration is the vendored reference: the example adopter's package, with
    ``pipemetrics vendor`` run over its copy as the guide's first command does."""
    shutil.copytree(
        ROOT / "ci" / "example-adopter" / "toytrainer",
        checkout / "toytrainer",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    done = run_bounded(
        ["pipemetrics", "vendor", "toytrainer/megatron/metrics.py"],
        cwd=checkout,
        env=snippet_env(checkout),
        timeout=60.0,
    )
    assert done.returncode == 0, done.stdout


def has_report() -> bool:
    return installed_features().class_tracker


_FINDINGS = (
    has_report,
    "the findings are in MoEMetricsTracker.report() (megatron-core 0.18+), the built-in target "
    "megatron-core's path; the installed megatron-core has no moe_logging",
)
#: (page, a substring of the snippet) -> (what it needs of the installed megatron-core, and why):
#: the snippet is skipped under a release without it.
NEEDS: dict[tuple[str, str], tuple[Callable[[], bool], str]] = {
    ("docs/findings.md", "global_aux_loss_dense_stage.json   # exit 1"): _FINDINGS,
    ("docs/findings.md", "--impl tests/megatron_core_findings/fixed_report.py"): _FINDINGS,
}

#: (page, a substring of the snippet) -> what prepares the checkout before the snippet runs.
SETUP: dict[tuple[str, str], Callable[[Path], None]] = {
    ("docs/migration.md", "from toytrainer.megatron import metrics"): vendored_toytrainer,
}


def snippet_env(checkout: Path) -> dict[str, str]:
    """The snippet's environment: ``.venv/bin`` first on ``PATH`` (``pipemetrics``, ``python``
    and ``pytest`` are the suite's), the checkout on ``PYTHONPATH``, ``TMPDIR`` inside it."""
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["PYTHONPATH"] = str(checkout)
    env["TMPDIR"] = str(checkout / "tmp")
    return env


def run_shell(example: Example) -> str | None:
    """A shell snippet's evaluator: ``bash -e -o pipefail``, exit 0 or the ``# exit N`` of its
    last line; a ```console block runs its ``$ `` lines."""
    checkout: Path = example.namespace["checkout"]
    source: str = example.parsed
    if example.region.lexemes["arguments"] == "console":
        lines = source.splitlines()
        source = "\n".join(s[len(CONSOLE_PROMPT) :] for s in lines if s.startswith(CONSOLE_PROMPT))
    last = [line for line in source.splitlines() if line.strip()][-1]
    expected = int(m.group(1)) if (m := EXPECTED_EXIT.search(last)) else 0
    done = run_bounded(
        ["bash", "-e", "-o", "pipefail", "-c", source],
        cwd=checkout,
        env=snippet_env(checkout),
        timeout=example.namespace["timeout_s"],
    )
    if done.returncode != expected:
        return f"exit {done.returncode}, the snippet says {expected}:\n{done.stdout[-6000:]}"
    return None


SCRIPT = (
    "import sys; page, line, file = sys.argv[1:]; "
    "exec(compile('\\n' * int(line) + open(file).read(), page, 'exec'), {'__name__': '__main__'})"
)


def run_python(example: Example) -> str | None:
    """A Python snippet's evaluator: a script (compiled with the page's name and line numbers), or
    a test module under pytest when it defines ``test_`` functions."""
    checkout: Path = example.namespace["checkout"]
    is_tests = re.search(r"^def test_", example.parsed, re.M) is not None
    file = checkout / f"{'test_' if is_tests else ''}snippet_line_{example.line}.py"
    file.write_text(example.parsed, encoding="utf-8")
    if is_tests:
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", file.name]
    else:
        command = [sys.executable, "-c", SCRIPT, example.path, str(example.line), str(file)]
    done = run_bounded(
        command, cwd=checkout, env=snippet_env(checkout), timeout=example.namespace["timeout_s"]
    )
    if done.returncode != 0:
        return f"exit {done.returncode}:\n{done.stdout[-6000:]}"
    return None


SYBIL = Sybil(
    parsers=[CodeBlockParser("python", run_python)]
    + [CodeBlockParser(shell, run_shell) for shell in SHELLS],
    path=str(ROOT),
)


def snippets(page: Path) -> list[Example]:
    return list(SYBIL.parse(page))


def snippet_id(example: Example) -> str:
    path = Path(example.path)
    name = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
    return f"{name}:{example.line}"


def entry_for[V](table: dict[tuple[str, str], V], example: Example) -> V | None:
    page = snippet_id(example).rsplit(":", 1)[0]
    found = [v for (p, text), v in table.items() if p == page and text in example.parsed]
    assert len(found) <= 1, f"{snippet_id(example)}: more than one entry names it"
    return found[0] if found else None


@contextmanager
def checkout_dir() -> Iterator[Path]:
    """A temporary directory that looks like the repository root (a symlink per top-level
    entry), with its own TMPDIR; removed afterwards, nothing left running."""
    with private_tmpdir() as path:
        for entry in ROOT.iterdir():
            if entry.name != ".git":
                (path / entry.name).symlink_to(entry)
        (path / "tmp").mkdir()
        yield path
        assert_no_leftovers(path / "tmp")


@pytest.fixture
def checkout() -> Iterator[Path]:
    """`checkout_dir` as a fixture: where every snippet runs."""
    with checkout_dir() as path:
        yield path


def evaluate(example: Example, checkout: Path, timeout_s: float = TIMEOUT_S) -> None:
    example.namespace["checkout"] = checkout
    example.namespace["timeout_s"] = timeout_s
    example.evaluate()


ALL = [example for page in PAGES for example in snippets(page)]


@pytest.mark.parametrize("example", ALL, ids=snippet_id)
def test_snippet_runs(example: Example, checkout: Path) -> None:
    reason = entry_for(SKIPPED, example)
    if reason is not None:
        pytest.skip(reason)
    needs = entry_for(NEEDS, example)
    if needs is not None and not needs[0]():
        pytest.skip(needs[1])
    setup = entry_for(SETUP, example)
    if setup is not None:
        setup(checkout)
    evaluate(example, checkout)


@pytest.mark.parametrize("table", [SKIPPED, NEEDS, SETUP], ids=["SKIPPED", "NEEDS", "SETUP"])
def test_every_entry_names_one_snippet(table: dict[tuple[str, str], object]) -> None:
    pages = {str(page.relative_to(ROOT)) for page in PAGES}
    for page, text in table:
        assert page in pages, f"{page}: not a page of the docs"
        named = [
            snippet_id(e) for e in ALL if snippet_id(e).startswith(f"{page}:") and text in e.parsed
        ]
        assert len(named) == 1, f"{page}, {text!r}: names {named or 'no snippet'}"


def test_every_fenced_block_is_run_or_not_code() -> None:
    """No code hides from the test in a block without a language, or in one it does not run."""
    fence = re.compile(r"^[ \t]*```(\S*)", re.M)
    found = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        languages = fence.findall(text)[::2]  # opening fences (every block here is closed)
        found += [f"{page.relative_to(ROOT)}: ```{lang}" for lang in languages if lang == ""]
        found += [
            f"{page.relative_to(ROOT)}: ```{lang}"
            for lang in languages
            if lang and lang not in (*LANGUAGES, *NOT_RUN)
        ]
    assert not found, f"blocks neither run nor declared not code: {found}"


def pipemetrics_commands(source: str) -> list[list[str]]:
    """The arguments of every ``pipemetrics`` command in a shell snippet (line continuations
    joined, comments dropped, split at line ends, ``&&``, ``||`` and ``;``)."""
    commands: list[list[str]] = []
    for line in source.replace("\\\n", " ").splitlines():
        commands.append([])
        for word in shlex.split(line, comments=True):
            if word in ("&&", "||", ";"):
                commands.append([])
            else:
                commands[-1].append(word)
    return [c[1:] for c in commands if c and Path(c[0]).name == "pipemetrics"]


def test_skipped_pipemetrics_commands_parse() -> None:
    """A shell snippet too costly to run still names only options that exist: each of its
    ``pipemetrics`` commands is parsed by the command's own parser."""
    parsed = 0
    for example in ALL:
        if example.region.lexemes["arguments"] in SHELLS and entry_for(SKIPPED, example):
            for argv in pipemetrics_commands(example.parsed):
                try:
                    build_parser().parse_args(argv)
                except SystemExit as exit:
                    pytest.fail(f"{snippet_id(example)}: pipemetrics {shlex.join(argv)}: {exit}")
                parsed += 1
    assert parsed >= 5
    (wrong,) = pipemetrics_commands("true && pipemetrics check \\\n  --no-such-option  # a comment")
    with pytest.raises(SystemExit):
        build_parser().parse_args(wrong)


def test_the_issue_quotes_repro_py() -> None:
    """The reproducer ISSUE.md quotes (not run here) is docs/upstream/repro.py, less its usage
    line."""
    (quoted,) = [
        e
        for e in snippets(ROOT / "docs" / "upstream" / "ISSUE.md")
        if "case = sys.argv" in e.parsed
    ]
    script = (ROOT / "docs" / "upstream" / "repro.py").read_text(encoding="utf-8")
    assert script.split("\n", 1)[1] == quoted.parsed


BROKEN_PAGE = """# A page

```python
print("fine")
```

```bash
true
```

```python
import pipemetrics.no_such_module
```

```bash
pipemetrics no-such-command
```

```bash
true  # exit 1
```

```python
def test_wrong():
    assert 1 == 2
```

```console
$ false
```
"""


@pytest.fixture
def broken_page(tmp_path: Path) -> list[Example]:
    page = tmp_path / "page.md"
    page.write_text(BROKEN_PAGE, encoding="utf-8")
    return snippets(page)


def test_a_broken_snippet_fails(broken_page: list[Example], checkout: Path) -> None:
    fine, true, *broken = broken_page
    assert [snippet_id(e) for e in broken_page] == [
        f"page.md:{line}" for line in (3, 7, 11, 15, 19, 23, 28)
    ]
    evaluate(fine, checkout)
    evaluate(true, checkout)
    for example in broken:
        with pytest.raises(SybilFailure, match=rf"line {example.line}, "):
            evaluate(example, checkout)


def test_a_hanging_snippet_is_ended(checkout: Path, tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("```bash\nsleep 60\n```\n", encoding="utf-8")
    (hang,) = snippets(page)
    with pytest.raises(pytest.fail.Exception, match=r"ran past 1\.0 s"):
        evaluate(hang, checkout, timeout_s=1.0)


def test_the_checkout_is_removed() -> None:
    """What a snippet writes lands in the checkout, which is gone afterwards."""
    with checkout_dir() as path:
        assert (path / "README.md").resolve() == ROOT / "README.md"
        (path / "report.json").write_text("{}", encoding="utf-8")
    assert not path.exists()
    assert not (ROOT / "report.json").exists()
