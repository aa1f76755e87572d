#!/usr/bin/env bash
# Train: ./launch/train.sh [CONFIG.yaml] [DeepSpeed launcher args]   (./launch/train.sh --help: usage)
# The config is validated (and its prepare: stages run) BEFORE any rank starts, then the ranks run under
# video_dit.train.launcher, which owns them: a signal to this script's process ends the whole job.
for arg in "$@"; do [[ "$arg" == "-h" || "$arg" == "--help" ]] && set -- --help && break; done
if [[ "${1:-}" == "--help" ]]; then
  cat <<'USAGE'
Usage: ./launch/train.sh [CONFIG.yaml] [DeepSpeed launcher args]

  ./launch/train.sh                          the embedded default: configs/demo_i2v_tiny.yaml (tiny model,
                                             generated data, i2v previews) on 2 CPU ranks or all GPUs
  ./launch/train.sh CONFIG.yaml              your job (ai-toolkit's job YAML); rerun it to resume
  ./launch/train.sh CONFIG.yaml --hostfile FILE --master_addr NODE1    several nodes over ssh (DeepSpeed's hostfile)
  ./launch/train.sh CONFIG.yaml --launcher slurm [--num_gpus N]         the nodes of a Slurm allocation (srun;
                                             sbatch launch/slurm.sh CONFIG.yaml does this)
  ./launch/train.sh CONFIG.yaml --num_gpus 4 | --include localhost:0,1 | --master_port PORT

Before any rank starts the job is validated (a bad key, value, path or dataset exits 2 naming it) and
its prepare: stages run; on several nodes every node is checked first (ssh or srun, this checkout and
its .venv, package versions, the shared training folder, --master_addr), exit 2 naming the host and the
fix. Ranks: every visible GPU of this node (of each node), else 2 CPU ranks. Ctrl-C, `kill PID`
or a closed terminal stops every rank at once and prints the step reached, the last checkpoint and
how to resume. Port 29500 in use: another free port is picked (said in the log).

Config keys that matter (config.process[0].*; every key is checked, typos get "did you mean"):
  model.name_or_path      preset:NAME (random weights: full fine-tune only) or a weights folder/file,
                          with model.preset; model.vae_path, model.text_encoder_path
  network                 {type: lora, linear: RANK, linear_alpha: ALPHA}; absent: full fine-tune
  datasets[]              folder_path, num_frames (4k+1), resolution, do_i2v, caption_ext,
                          allow_upscale (false: small sources train at their own size)
  train                   steps, lr, batch_size, gradient_accumulation, lr_scheduler (constant | cosine),
                          warmup_steps, dtype, gradient_checkpointing, seed
  save                    save_every, max_step_saves_to_keep, resume (auto | none | PATH), dtype
  sample                  sample_every, samples[] (prompt, ctrl_img), width, height, num_frames
  deepspeed               zero_stage (0-3), offload_optimizer, offload_param, sequence_parallel_size,
                          memory_check (refuse | warn | off: the memory plan printed before any rank)
  training_folder         outputs go to <training_folder>/<name>/ (config.name)

Outputs in <training_folder>/<name>/:
  metrics.jsonl           one line per step (loss, lr, grad_norm, step_time_s, throughput, memory)
  loss.png, throughput.png, memory.png   written when the job finishes (video-dit plot OUTPUT_DIR)
  samples/                MP4 previews + PNG contact sheets
  checkpoints/            the last save.max_step_saves_to_keep checkpoints (resume)
  <name>.safetensors      the LoRA (ComfyUI keys); for a full fine-tune the folder <name>/, which
                          `video-dit sample --model` renders with the previews' settings

More: README.md; video-dit inspect-data CONFIG (what the job will train on), video-dit --help.
USAGE
  exit 0
fi
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
PY="$(vd_python)"
vd_export_extensions "$PY"
cd "$ROOT"
export PYTHONUNBUFFERED=1
exec "$PY" -m video_dit.train.launcher "$@"
