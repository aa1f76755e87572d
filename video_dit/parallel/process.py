"""The process group of a training job: joined (or created) once per rank, ended before exit.

    init_distributed(timeout_s)   gloo on CPU ranks, NCCL on GPU ranks (each on its LOCAL_RANK's GPU),
                                  with the job's collective timeout; a plain `python launch/train.py`
                                  makes a group of one
    leave_distributed()           end the group locally before the interpreter exits
    end_rank(code)                leave the group, flush, and exit without interpreter finalization
    run_local_ranks(...)          a stage's ranks on this machine: rank 0 here, the others spawned
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import tempfile
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from video_dit.devices import free_port, local_device, on_gpu


def init_distributed(timeout_s: int) -> tuple[int, int]:
    """Join (or, when started without a launcher, create) the process group; returns (rank, world)."""
    import deepspeed

    if not dist.is_initialized():
        if "RANK" not in os.environ:  # plain `python launch/train.py`: a group of one
            os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=str(free_port()))
        if on_gpu():
            torch.cuda.set_device(local_device())
        deepspeed.init_distributed(dist_backend="nccl" if on_gpu() else "gloo",
                                   timeout=timedelta(seconds=timeout_s))
        if not on_gpu():
            unlink_cpu_allreduce_buffer()
    return dist.get_rank(), dist.get_world_size()


def leave_distributed() -> None:
    """End this process's group before the interpreter exits (local, no collective: safe after a
    failed peer). Left to interpreter shutdown, gloo's threads were torn down in an order that
    aborted a rank that had finished ('terminate called without an active exception', SIGABRT)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def end_rank(code: int):
    """End a finished rank: leave the group, flush stdout / stderr, `os._exit(code)`. Even with the group
    ended first, a finished CPU rank still aborted now and then in interpreter finalization (SIGABRT,
    'terminate called without an active exception', after its last collective: the C++ objects DeepSpeed
    keeps references to are torn down in no set order; seen in a CI run). Everything a rank writes is
    written and closed before this (checkpoints, metrics, logs); nothing is left to finalization."""
    try:
        leave_distributed()
    finally:
        exit_now(code)


def exit_now(code: int):
    """Flush stdout / stderr and `os._exit(code)`: no interpreter finalization, for a process whose work is
    written and closed (a finished rank: `end_rank`; the launcher once its job has ended, where tearing down
    the torch its memory plan imported took ~1 s at every job's end)."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


def cpu_allreduce_buffer_path(rank: int) -> Path:
    """The POSIX shared-memory segment DeepSpeed's CPU accelerator creates per rank for its shm
    allreduce (name format of deepspeed/ops/csrc/cpu/comm/shm.cpp, shm_initialize: prefix, uid,
    MASTER_ADDR, MASTER_PORT, rank)."""
    addr, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
    return Path("/dev/shm") / f"deepspeed_allreduce_buffer_{os.getuid()}_{addr}_{port}_{rank}"


def unlink_cpu_allreduce_buffer() -> None:
    """DeepSpeed 0.19.8 never unlinks its CPU shm allreduce segments (shared_close is never
    called): every 2-rank CPU launch left 2 x 66 MiB in /dev/shm (RAM) for good. Once every rank
    has mapped every segment (shm_initialize returns only after it has; the barrier waits for all),
    each rank unlinks its own name: the mappings stay valid and the memory goes with the processes.
    Without the segment (not every rank local: DeepSpeed made none on any rank) nothing to wait for."""
    own = cpu_allreduce_buffer_path(dist.get_rank())
    if own.exists():
        dist.barrier()
        own.unlink()


def run_local_ranks(target, world: int, args: tuple, recipe: dict, what: str):
    """`target(rank, world, init, *args, recipe)` on `world` CPU ranks of this machine, joined by a file
    rendezvous `init` (None for one rank): rank 0 in this process, ranks 1.. spawned with `recipe`'s
    `verbose` off; rank 0's result. Ranks still running 60 s after rank 0 are terminated; a rank that
    failed is a RuntimeError naming `what` and each exit code (the VAE stages' ranks)."""
    if world == 1:
        return target(0, 1, None, *args, recipe)
    with tempfile.TemporaryDirectory(prefix="vd_ranks_") as tmp:
        init = f"file://{tmp}/rendezvous"
        ctx = multiprocessing.get_context("spawn")
        workers = [ctx.Process(target=target, args=(r, world, init, *args, dict(recipe, verbose=False)), daemon=True)
                   for r in range(1, world)]
        for w in workers:
            w.start()
        try:
            result = target(0, world, init, *args, recipe)
        finally:
            for w in workers:
                w.join(timeout=60)
                if w.is_alive():
                    w.terminate()
        failed = [f"rank {r}: exit code {w.exitcode}" for r, w in enumerate(workers, 1) if w.exitcode != 0]
        if failed:
            raise RuntimeError(f"{what}'s other ranks failed ({'; '.join(failed)})")
    return result
