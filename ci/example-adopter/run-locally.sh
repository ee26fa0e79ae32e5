#!/usr/bin/env bash
# Run, from this example repository's root, the command its CI job runs: .github/workflows/ci.yml
# calls the pipemetrics action (ci/action/action.yml) with
#   impl: toytrainer/megatron/common.py   args: --max-examples 100
# and the action runs exactly this `pipemetrics check` line, then renders the job summary.
#
# Expected: exit 1. toytrainer's get_moe_metrics returns early on a stage without MoE layers,
# so moe.no_hang fails with a deadlock; the summary shows the minimal counterexample and the
# `pipemetrics replay` command.
#
#   bash ci/example-adopter/run-locally.sh              # the CI command
#   bash ci/example-adopter/run-locally.sh --only moe.no_hang   # extra arguments are appended
#
# pipemetrics: $PIPEMETRICS, else `pipemetrics` on the PATH, else this checkout's .venv.
# Output files go to $PIPEMETRICS_OUT (default: this directory, as on CI).
set -uo pipefail
cd "$(dirname "$0")"
here=$(pwd)

if [ -n "${PIPEMETRICS:-}" ]; then
  pipemetrics=$PIPEMETRICS
elif command -v pipemetrics >/dev/null 2>&1; then
  pipemetrics=$(command -v pipemetrics)
elif [ -x ../../.venv/bin/pipemetrics ]; then
  pipemetrics=$here/../../.venv/bin/pipemetrics
else
  echo "run-locally.sh: no pipemetrics found (run bash ci/bootstrap.sh first)" >&2
  exit 2
fi
out=${PIPEMETRICS_OUT:-$here}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1

IMPL=toytrainer/megatron/common.py
PROFILE=seed
ARGS="--max-examples 100"

set -x
# shellcheck disable=SC2086  # ARGS is split into arguments, as in the action
"$pipemetrics" check --impl "$IMPL" --profile "$PROFILE" \
  --json "$out/pipemetrics.json" --junit "$out/pipemetrics.xml" \
  --report-dir "$out/pipemetrics-report" --markdown "$out/pipemetrics-summary.md" $ARGS "$@"
code=$?
{ set +x; } 2>/dev/null

# the job summary the action writes to $GITHUB_STEP_SUMMARY
echo
echo "----- job summary ($out/pipemetrics-summary.md) -----"
cat "$out/pipemetrics-summary.md"
echo "-----"
echo "pipemetrics check exited with $code (expected 1: the planted bug is caught)"
exit "$code"
