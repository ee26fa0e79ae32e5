#!/usr/bin/env bash
# Set up (ci/bootstrap.sh) and run the test suite; extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/bootstrap.sh
exec .venv/bin/python -m pytest -n 2 --dist loadfile tests "$@"
