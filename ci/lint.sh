#!/usr/bin/env bash
# Lint and type-check (ruff, mypy --strict over every package); run by .ci/run and the workflow.
set -euo pipefail
cd "$(dirname "$0")/.."
echo "== ruff"
.venv/bin/ruff check .
.venv/bin/ruff format --check .
echo "== mypy --strict"
.venv/bin/mypy -p pipemetrics.reference -p pipemetrics.sim -p pipemetrics.properties -p pipemetrics.prove -p pipemetrics.bench -p pipemetrics.testing -p pipemetrics.commands
