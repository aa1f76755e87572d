# Sourced by launch/train.sh and launch/test.sh: find or make a Python where video_dit imports.
# Uses the active Python when `import video_dit` (with the dev extra, for tests) already works;
# otherwise creates .venv next to the repository and installs into it. Idempotent.
# torch is installed first and explicitly (TORCH_SPEC, default torch==2.13.0) only when no torch
# is importable, so the bare `torch` requirement never pulls a second, multi-GB build.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"

_vd_imports() {  # $1 = python, $2 = extra modules that must be installed
  (cd / && "$1" - "$2" "$ROOT") >/dev/null 2>&1 <<'PY'
import importlib.util, os, sys
import video_dit
# the package must be this checkout's (an editable install), not another copy
assert os.path.realpath(video_dit.__file__).startswith(os.path.realpath(sys.argv[2]) + os.sep)
# found, not imported: importing deepspeed, peft and matplotlib takes ~5 s on 2 cores, at every launch
missing = [name for name in filter(None, sys.argv[1].split(",")) if importlib.util.find_spec(name) is None]
assert not missing, missing
PY
}

vd_python() {  # $1 = "dev" to also require the test extra; prints the python to use
  local need="deepspeed,peft,av,yaml,matplotlib"
  [ "${1:-}" = "dev" ] && need="$need,pytest,diffusers"
  local active
  active="$(command -v python3 || command -v python)"
  if [ -x "$ROOT/.venv/bin/python" ] && _vd_imports "$ROOT/.venv/bin/python" "$need"; then
    echo "$ROOT/.venv/bin/python"; return
  fi
  if _vd_imports "$active" "$need"; then echo "$active"; return; fi
  if [ ! -x "$ROOT/.venv/bin/python" ]; then
    echo "[video_dit] creating $ROOT/.venv" >&2
    "$active" -m venv "$ROOT/.venv" >&2
  fi
  local py="$ROOT/.venv/bin/python"
  if ! "$py" -c "import torch" >/dev/null 2>&1; then
    echo "[video_dit] installing $TORCH_SPEC" >&2
    "$py" -m pip install -q "$TORCH_SPEC" >&2
  fi
  local extra=""
  [ "${1:-}" = "dev" ] && extra="[dev]"
  echo "[video_dit] installing video_dit$extra into .venv" >&2
  "$py" -m pip install -q -e "$ROOT$extra" >&2
  # DeepSpeed compiles its shared-memory collective op when the ranks start (15-45 s on 2 cores):
  # build it now, once per .venv (video_dit/parallel/ops.py)
  echo "[video_dit] building DeepSpeed's communication op into .venv/torch_extensions" >&2
  if ! (cd / && TORCH_EXTENSIONS_DIR="$(vd_extensions_dir "$py")" "$py" -m video_dit.parallel.ops) >&2; then
    echo "[video_dit] warning: that build failed; the ranks will build it when they start" >&2
  fi
  echo "$py"
}

vd_extensions_dir() {  # $1 = python; where its compiled DeepSpeed ops live (.venv's own, or torch's default)
  if [ "$1" = "$ROOT/.venv/bin/python" ]; then echo "${TORCH_EXTENSIONS_DIR:-$ROOT/.venv/torch_extensions}"
  else echo "${TORCH_EXTENSIONS_DIR:-}"; fi
}

vd_export_extensions() {  # $1 = python; exports TORCH_EXTENSIONS_DIR for it when it has its own
  local dir
  dir="$(vd_extensions_dir "$1")"
  if [ -n "$dir" ]; then export TORCH_EXTENSIONS_DIR="$dir"; fi
}
