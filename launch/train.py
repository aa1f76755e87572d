"""Train a video DiT under DeepSpeed: parse, build, train, close; a finished job draws its curves.

Usually started through `launch/train.sh`, which validates the config before any rank starts:
    ./launch/train.sh                                     # the embedded default (configs/demo_i2v_tiny.yaml)
    ./launch/train.sh configs/wan21_t2v_1.3b_lora.yaml    # 1 GPU
    ./launch/train.sh configs/wan22_i2v_a14b_lora_zero3.yaml   # 8 GPUs on this node (all visible GPUs)
    ./launch/train.sh CONFIG --hostfile hostfile --master_addr node1   # 2 nodes (`node1 slots=8` lines), over ssh
    sbatch launch/slurm.sh CONFIG                         # the nodes of a Slurm allocation, over srun
    ./launch/train.sh CONFIG                              # no GPU: 2 CPU ranks over gloo
Directly:
    deepspeed --num_gpus 8 launch/train.py --config CONFIG [--resume auto|none|PATH]
    python launch/train.py --config CONFIG                # one process, no launcher
"""

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's video_dit, installed or not

from video_dit.commands.plot import write_plots
from video_dit.parallel.process import end_rank, leave_distributed
from video_dit.train.config import load_job
from video_dit.train.trainer import run
from video_dit.typed_config import ConfigError


def main() -> int:
    parser = argparse.ArgumentParser(description="video_dit DeepSpeed trainer")
    parser.add_argument("--config", required=True, help="job YAML (ai-toolkit format)")
    parser.add_argument("--resume", default=None, help="auto | none | a checkpoint folder (default: save.resume)")
    parser.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # set by the launcher
    args = parser.parse_args()
    try:
        job = load_job(args.config)
    except ConfigError as exc:
        print(f"config error in {args.config}: {exc}", file=sys.stderr)
        return 2
    try:
        code = run(job, resume=args.resume)
    finally:
        leave_distributed()
    if code == 0 and os.environ.get("RANK", "0") == "0":  # loss/throughput/memory PNGs beside metrics.jsonl
        write_plots(job.out_dir, log=lambda m: print(m, file=sys.stderr, flush=True))
    return code


if __name__ == "__main__":
    end_rank(main())  # the group is already left; exits without interpreter finalization
