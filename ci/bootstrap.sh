#!/usr/bin/env bash
# Create .venv with Python 3.12 and install pipemetrics (editable) with its pinned dependencies.
# Idempotent: a second run only re-links new source files.
set -euo pipefail
cd "$(dirname "$0")/.."

find_python() {
  for candidate in "${PIPEMETRICS_PYTHON:-}" python3.12 /root/.pyenv/versions/3.12.1/bin/python3.12; do
    [ -n "$candidate" ] || continue
    if command -v "$candidate" >/dev/null 2>&1 &&
       "$candidate" -c 'import sys; raise SystemExit(sys.version_info < (3, 12))' 2>/dev/null; then
      command -v "$candidate"
      return 0
    fi
  done
  if command -v pyenv >/dev/null 2>&1; then
    local root
    root=$(pyenv root)
    for p in "$root"/versions/3.1[2-9]*/bin/python3; do
      [ -x "$p" ] && { echo "$p"; return 0; }
    done
  fi
  echo "pipemetrics needs Python >= 3.12; set PIPEMETRICS_PYTHON to its path" >&2
  return 1
}

if [ ! -x .venv/bin/python ]; then
  "$(find_python)" -m venv .venv
fi
# Strict editable mode: a link tree that mypy and subprocesses see like an installed package.
.venv/bin/python -m pip install -q --disable-pip-version-check \
  -c ci/constraints.txt -e '.[dev]' --config-settings editable_mode=strict
