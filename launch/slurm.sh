#!/usr/bin/env bash
# Train on the nodes of a Slurm allocation, from this checkout's folder:
#   sbatch launch/slurm.sh CONFIG.yaml [launcher args]                      2 nodes, 2 CPU ranks or every GPU each
#   sbatch --nodes=4 --gpus-per-node=8 launch/slurm.sh CONFIG.yaml          4 nodes x 8 GPUs
#   sbatch --nodes=2 launch/slurm.sh CONFIG.yaml --num_gpus 1               1 rank per node
#   salloc --nodes=2 launch/slurm.sh CONFIG.yaml                            the same, in the foreground
# It is ./launch/train.sh CONFIG --launcher slurm: the job is validated and every node checked (the
# pre-flight, through srun) before any rank starts, then one srun step runs a node agent per node
# (ranks placed from SLURM_* : the allocation's node list, SLURMD_NODENAME), each starting DeepSpeed's
# per-node launcher. scancel or the time limit stops every rank and prints the step reached, the
# last checkpoint and how to resume; resubmitting the same command resumes.
#SBATCH --job-name=video_dit
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
set -euo pipefail
# Slurm runs a copy of this script from its spool folder: the checkout is the folder sbatch ran in
ROOT="${SLURM_SUBMIT_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}"
if [ ! -x "$ROOT/launch/train.sh" ]; then
  echo "[video_dit] error: $ROOT has no launch/train.sh: submit from the video_dit checkout (sbatch launch/slurm.sh CONFIG)" >&2
  exit 2
fi
exec "$ROOT/launch/train.sh" "$@" --launcher slurm
