#!/usr/bin/env bash
# Set up (ci/bootstrap.sh) and run the test suite; extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/bootstrap.sh
# --durations: the slowest tests in every CI log (the suite must stay inside its time budget).
exec .venv/bin/python -m pytest -n 2 --dist loadfile --durations=25 tests "$@"
