#!/usr/bin/env bash
# Lint and type-check (ruff, mypy --strict over every package, the layer contracts); run by
# .ci/run and the workflow.
set -euo pipefail
cd "$(dirname "$0")/.."
echo "== ruff"
.venv/bin/ruff check .
.venv/bin/ruff format --check .
echo "== mypy --strict"
# mypy reads the installed package: the strict editable install of ci/bootstrap.sh (a link tree);
# pip's default editable install hides the package behind an import hook mypy cannot follow.
if ! .venv/bin/python -c 'import pipemetrics.sim, sys; sys.exit("__editable__" not in pipemetrics.sim.__path__[0])'; then
  echo "pipemetrics is not installed as ci/bootstrap.sh installs it: run bash ci/bootstrap.sh" >&2
  exit 2
fi
.venv/bin/mypy -p pipemetrics.reference -p pipemetrics.sim -p pipemetrics.properties -p pipemetrics.prove -p pipemetrics.bench -p pipemetrics.testing -p pipemetrics.commands
echo "== import layers (lint-imports: pyproject.toml [tool.importlinter])"
.venv/bin/lint-imports --no-cache
