#!/usr/bin/env bash
# Check this checkout on a machine with a GPU, in one command (README: On a GPU machine):
#   ./launch/gpu_check.sh                 the gpu tests, the embedded default and the benchmark suites on CUDA,
#                                         8 minutes in all, one summary table, docs/bench/gpu_check_*.json
#   ./launch/gpu_check.sh --only dit,train --total 300 --budget train=200 -v    (--help: every option)
# It installs nothing and creates no venv (launch/_env.sh would, when a package is missing): it runs with
# the Python it finds, with this checkout on PYTHONPATH, and $VIDEO_DIT_SITE (default /tmp/site: where
# `pip install --no-index --target /tmp/site WHEELS` put the packages brought as wheels) when it exists.
# The Python: $GPU_CHECK_PYTHON when set; else this checkout's .venv when its torch sees CUDA; else python3.
# Exit: 0 every step passed; 1 a step failed or ran out of time; 2 no CUDA device, or a package missing.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SITE="${VIDEO_DIT_SITE:-/tmp/site}"
PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
if [ -d "$SITE" ]; then PYTHONPATH="$ROOT:$SITE${PYTHONPATH#"$ROOT"}"; fi
export PYTHONPATH PYTHONUNBUFFERED=1

sees_cuda() { "$1" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1; }

if [ -n "${GPU_CHECK_PYTHON:-}" ]; then
  PY="$GPU_CHECK_PYTHON"
elif [ -x "$ROOT/.venv/bin/python" ] && sees_cuda "$ROOT/.venv/bin/python"; then
  PY="$ROOT/.venv/bin/python"
else
  PY="$(command -v python3 || true)"
fi
if [ -z "$PY" ]; then
  echo "[gpu-check] error: no python3 on PATH; set GPU_CHECK_PYTHON=/path/to/python" >&2
  exit 2
fi
if ! err="$("$PY" -c "import torch" 2>&1)"; then
  echo "[gpu-check] error: $PY cannot import torch (a CUDA build of torch must be installed for it):" >&2
  echo "${err##*$'\n'}" >&2
  exit 2
fi
echo "[gpu-check] python: $PY; PYTHONPATH=$PYTHONPATH"
cd "$ROOT"
exec "$PY" -m video_dit.bench.gpu_check "$@"
