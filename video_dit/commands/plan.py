"""`video-dit plan JOB.yaml [--gpus N] [--gpu-mem GiB] [--host-mem GiB] [--nodes M] [--hostfile FILE]`: each rank's
memory before anything is loaded (`video_dit.train.plan`): a table per bucket the job's datasets
produce (or `--bucket FxHxW`), predicted GiB against the capacity, and the settings that fit.

    video-dit plan configs/wan21_t2v_1.3b_lora.yaml --gpus 1 --gpu-mem 24
    video-dit plan configs/wan22_i2v_a14b_lora_zero3.yaml --gpus 8 --gpu-mem 80 --host-mem 1024 \\
        --bucket 81x480x832 --bucket 81x720x1280
    video-dit plan configs/demo_i2v_tiny.yaml --cpu-ranks 2 --host-mem 24

Without --gpus / --cpu-ranks the machine is what `./launch/train.sh` would start here: every
visible GPU (their memory read from torch), else 2 CPU ranks sharing this host's memory.
With --hostfile FILE [--master_addr A --master_port P --ssh_port S --include/--exclude/--num_gpus]
(or --launcher slurm inside an allocation) the nodes are checked first, as `train.sh` checks them
before any rank starts (`parallel/preflight.py`: ssh, checkout, interpreter, packages, comm op,
shared training folder, rendezvous address and interfaces; exit 2 naming the host and the fix),
and the plan is made for the ranks the hostfile places.
Exit 0 when every bucket fits, 1 when one does not (the table says which and why), 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
import sys

from video_dit.devices import Machine, local_machine
from video_dit.train.plan import PlanError, format_plan, load_job_for_plan, parse_bucket, plan_job, plan_summary
from video_dit.typed_config import ConfigError

GiB = 2 ** 30


def positive_gib(option: str):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{option} takes a number of GiB (e.g. 80), got {text!r}") from None
        if not 0 < value < float("inf"):
            raise argparse.ArgumentTypeError(f"{option} must be a positive number of GiB, got {text!r}")
        return value
    return parse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", metavar="JOB.yaml", help="the job (ai-toolkit format)")
    p.add_argument("--gpus", type=int, default=None, help="GPUs in total (all nodes)")
    p.add_argument("--cpu-ranks", type=int, default=None, help="plan CPU ranks instead of GPUs")
    p.add_argument("--gpu-mem", type=positive_gib("--gpu-mem"), default=None, help="GiB per GPU")
    p.add_argument("--host-mem", type=positive_gib("--host-mem"), default=None, help="GiB of host RAM per node")
    p.add_argument("--nodes", type=int, default=1, help="nodes the ranks are spread over")
    p.add_argument("--bucket", action="append", default=None, metavar="FxHxW",
                   help="plan this bucket (frames x height x width, pixels) instead of the dataset's; repeatable")
    p.add_argument("--json", default=None, metavar="FILE", help="write the plan's figures here")
    nodes = p.add_argument_group("several nodes: the pre-flight train.sh runs, then the plan of those ranks")
    nodes.add_argument("--hostfile", default=None, help="DeepSpeed hostfile (`node1 slots=8` lines)")
    nodes.add_argument("--launcher", default=None, choices=["ssh", "slurm"],
                       help="slurm: the nodes of the Slurm allocation this runs in")
    for option in ("--master_addr", "--master_port", "--ssh_port", "--include", "--exclude", "--num_gpus",
                   "--num_nodes"):
        nodes.add_argument(option, default=None, help="as for ./launch/train.sh")


def machine_from(args):
    """The `Machine` the options describe, else the one train.sh would start here."""
    if args.gpus is not None and args.cpu_ranks is not None:
        raise PlanError("give --gpus or --cpu-ranks, not both")
    if args.gpus is not None and args.gpus < 1:
        raise PlanError(f"--gpus must be >= 1, got {args.gpus} (to plan CPU ranks use --cpu-ranks N)")
    if args.cpu_ranks is not None and args.cpu_ranks < 1:
        raise PlanError(f"--cpu-ranks must be >= 1, got {args.cpu_ranks}")
    if args.nodes < 1:
        raise PlanError(f"--nodes must be >= 1, got {args.nodes}")
    gpu_mem = args.gpu_mem * GiB if args.gpu_mem else None
    host_mem = args.host_mem * GiB if args.host_mem else None
    if args.gpus is not None:
        if gpu_mem is None:
            raise PlanError("--gpus needs --gpu-mem (GiB per GPU, e.g. 80)")
        return Machine(ranks=args.gpus, nodes=args.nodes, device="cuda", gpu_mem=gpu_mem, host_mem=host_mem)
    here = local_machine(ranks=args.cpu_ranks, nodes=args.nodes)
    return Machine(ranks=here.ranks, nodes=args.nodes, device=here.device, gpu_mem=gpu_mem or here.gpu_mem,
                   host_mem=host_mem or here.host_mem)


def node_args(args) -> list[str]:
    """train.sh's launcher arguments for the --hostfile / --launcher options given ([] when none)."""
    if args.hostfile is None and args.launcher is None:
        return []
    if args.gpus is not None or args.cpu_ranks is not None or args.nodes != 1:
        raise PlanError("--hostfile / --launcher slurm place the ranks: leave --gpus, --cpu-ranks and --nodes out")
    names = ("hostfile", "launcher", "master_addr", "master_port", "ssh_port", "include", "exclude", "num_gpus",
             "num_nodes")
    return [a for n in names if getattr(args, n) is not None for a in (f"--{n}", str(getattr(args, n)))]


def nodes_machine(args, launcher_args: list[str]) -> Machine | int:
    """The Machine of the checked nodes (the pre-flight's exit code 2 when a node fails it)."""
    from video_dit.devices import placement
    from video_dit.train.launcher import preflight_nodes

    ready = preflight_nodes(args.config, launcher_args, placement(launcher_args),
                            log=lambda m: print(m, file=sys.stderr, flush=True))
    if isinstance(ready, int):
        return ready
    here = local_machine(ranks=None)
    return Machine(ranks=ready.place.ranks, nodes=ready.place.nodes, device=ready.place.device,
                   gpu_mem=args.gpu_mem * GiB if args.gpu_mem else here.gpu_mem,
                   host_mem=args.host_mem * GiB if args.host_mem else here.host_mem)


def main(args) -> int:
    try:
        launcher_args = node_args(args)
    except PlanError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    machine = nodes_machine(args, launcher_args) if launcher_args else None
    if isinstance(machine, int):
        return machine
    try:
        job, missing = load_job_for_plan(args.config)
        buckets = [parse_bucket(b) for b in args.bucket] if args.bucket else None
        plan = plan_job(job, machine or machine_from(args), buckets, missing)
    except (ConfigError, PlanError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(format_plan(plan))
    for line in plan.failures():
        print(f"  does not fit: {line}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(plan_summary(plan), f, indent=1)
    return 0 if plan.fits else 1
