#!/usr/bin/env bash
# Train: ./launch/train.sh [CONFIG.yaml] [extra deepspeed launcher args, e.g. --hostfile FILE]
# No CONFIG: the embedded default job (configs/demo_i2v_tiny.yaml). The config is validated (and its
# prepare: stages run: demo data, tiny VAE) BEFORE any rank starts; a bad config exits 2 naming the key.
# GPUs: all visible ones on this node (deepspeed --num_gpus N); none: 2 CPU ranks over gloo with the
# cores split between them. Multi-node: pass --hostfile (see README); --num_gpus is then not added.
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
PY="$(vd_python)"
cd "$ROOT"
CONFIG="configs/demo_i2v_tiny.yaml"
if [ $# -gt 0 ] && [[ "$1" != -* ]]; then CONFIG="$1"; shift; fi
export PYTHONUNBUFFERED=1

# --plan: the memory plan of the ranks about to start (deepspeed.memory_check: refuse | warn | off)
"$PY" -m video_dit.train.validate --prepare --plan -- "$CONFIG" "$@" || exit $?

LAUNCH=()
if [[ " $* " == *" --hostfile"* || " $* " == *" --num_gpus"* || " $* " == *" --include"* ]]; then
  :  # the user chose the ranks
elif command -v nvidia-smi >/dev/null 2>&1 && [ "${CUDA_VISIBLE_DEVICES-unset}" != "" ] \
     && NGPU="$("$PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null)" && [ "${NGPU:-0}" -gt 0 ]; then
  LAUNCH=(--num_gpus "$NGPU")
else
  CORES="$(nproc 2>/dev/null || echo 2)"
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( CORES / 2 > 0 ? CORES / 2 : 1 ))}"
  LAUNCH=(--num_gpus 2)
fi
DS="$(dirname "$PY")/deepspeed"
if [ -x "$DS" ]; then DSCMD=("$DS"); else DSCMD=("$PY" -m deepspeed.launcher.runner); fi
exec "${DSCMD[@]}" "${LAUNCH[@]}" "$@" launch/train.py --config "$CONFIG"
