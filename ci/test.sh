#!/usr/bin/env bash
# Set up (ci/bootstrap.sh) and run the test suite; extra arguments go to pytest (both runs).
#
# Two pytest runs: first the tests marked release_independent, with megatron-core unreachable in
# every process they start (tests/release_block: an import, a look-up of its files or of its
# metadata is recorded and fails the run, whatever the code did with it), which proves that
# their outcome cannot depend on the release; the oldest release's leg (ci/noxfile.py) leaves
# them out. Then every other test. A test without the marker always runs on both legs.
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/bootstrap.sh
log=$(mktemp)
trap 'rm -f "$log"' EXIT
status=0
MARKED="pytestmark = pytest.mark.release_independent"
junit() { [ -z "${PIPEMETRICS_JUNIT:-}" ] || echo "--junitxml=$PIPEMETRICS_JUNIT-$1.xml"; }
# The marker is a module's (collecting a module imports it): the files that carry it.
mapfile -t independent < <(grep -lx "$MARKED" tests/test_*.py)
PIPEMETRICS_RELEASE_BLOCK_LOG="$log" PYTHONPATH="$PWD/tests/release_block" \
  .venv/bin/python -m pytest -n 2 -q -m release_independent $(junit independent) \
  "${independent[@]}" "$@" || status=$?
# pytest's 5 is "no test collected": extra arguments may select none of one run's tests.
[ "$status" -eq 5 ] && status=0
# --durations: the slowest tests in every CI log (the suite must stay inside its time budget).
.venv/bin/python -m pytest -n 2 --dist loadfile --durations=25 -m "not release_independent" \
  $(junit rest) tests "$@" || { rest=$?; [ "$rest" -eq 5 ] || status=$rest; }
exit "$status"
