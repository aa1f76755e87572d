#!/usr/bin/env bash
# Run the test suite (sets up .venv on a fresh machine). Extra args go to pytest,
# e.g. ./launch/test.sh -m slow   or   ./launch/test.sh tests/test_dit.py -x
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
PY="$(vd_python dev)"
vd_export_extensions "$PY"
cd "$ROOT"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}" PYTHONUNBUFFERED=1
exec "$PY" -m pytest "$@"
