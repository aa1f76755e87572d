"""Fault injection for the fault suite (`tests/faults/`): inert unless `VIDEO_DIT_FAULT` is set.

`VIDEO_DIT_FAULT` is a comma-separated list of faults:

    kill_rank1_at_step:5             rank 1 SIGKILLs itself in the middle of optimizer step 5 (after the
                                     forward, before the backward); any rank: kill_rank<R>_at_step:<S>
    stall_rank1_at_step:2            rank 1 stops in the middle of optimizer step 2 (after the forward) and
                                     sleeps, alive, for an hour: a stuck peer (any rank:
                                     stall_rank<R>_at_step:<S>); its peers wait in a collective
    kill_during_save:after_file:3    rank 0 SIGKILLs itself right after the 3rd DeepSpeed checkpoint file
                                     it writes in this process (files counted over all saves), i.e.
                                     between two files of a save
    enospc_on_save[:after_file:N]    rank 0's checkpoint file writes after the first N fail with
                                     OSError(ENOSPC), as on a full disk (N = 0 when omitted)
    nan_batch:A[-B][:rank:R]         the A-th (to B-th) batch this process draws (1-based, skipped ones
                                     count) is poisoned with NaN, on every rank or only on rank R
    oom_rank1_at_step:3              rank 1's forward of optimizer step 3 raises torch.OutOfMemoryError,
                                     as a GPU out of memory does (any rank: oom_rank<R>_at_step:<S>)

`install(trainer)` is the one entry point, called once by the Trainer after DeepSpeed is set up: with
the variable unset it returns at once and changes nothing. With it set, it wraps the trainer's
`loss_of` (NaN batches, mid-step kills) and the engine's checkpoint-file writer (kills and ENOSPC
between files): fault injection stays out of the training and checkpoint code.
"""

from __future__ import annotations

import errno
import os
import re
import signal
import time

import torch

ENV = "VIDEO_DIT_FAULT"


def parse(spec: str) -> list[tuple[str, dict[str, int]]]:
    """`[(name, {key: int})]` of a `VIDEO_DIT_FAULT` value; ValueError naming the bad part."""
    faults = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, *rest = part.split(":")
        args: dict[str, int] = {}
        kill = re.fullmatch(r"(kill|stall|oom)_rank(\d+)_at_step", name)
        try:
            if kill:
                args = {"rank": int(kill.group(2)), "step": int(rest[0])}
                name = f"{kill.group(1)}_at_step"
            elif name in ("kill_during_save", "enospc_on_save"):
                args = {"after_file": 0}
                if rest:
                    if rest[0] != "after_file":
                        raise ValueError
                    args["after_file"] = int(rest[1])
                if name == "kill_during_save" and not rest:
                    raise ValueError
            elif name == "nan_batch":
                first, _, last = rest[0].partition("-")
                args = {"first": int(first), "last": int(last or first), "rank": -1}
                if rest[1:]:
                    if rest[1] != "rank":
                        raise ValueError
                    args["rank"] = int(rest[2])
            else:
                raise ValueError
        except (ValueError, IndexError):
            raise ValueError(f"{ENV}: cannot parse {part!r}; accepted: kill_rank<R>_at_step:<S>, "
                             "stall_rank<R>_at_step:<S>, oom_rank<R>_at_step:<S>, "
                             "kill_during_save:after_file:<N>, enospc_on_save[:after_file:<N>], "
                             "nan_batch:<A>[-<B>][:rank:<R>]") from None
        faults.append((name, args))
    return faults


def _kill_self(why: str) -> None:
    print(f"[video_dit] FAULT INJECTED ({ENV}): SIGKILL rank {os.environ.get('RANK', '0')} {why} "
          f"at t={time.time():.3f}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def install(trainer) -> None:
    """Arm the faults of `VIDEO_DIT_FAULT` on `trainer` (a no-op when the variable is unset)."""
    spec = os.environ.get(ENV)
    if not spec:
        return
    faults = parse(spec)
    rank = trainer.rank
    print(f"[video_dit] rank {rank}: {ENV}={spec}", flush=True)

    loss_of, drawn = trainer.loss_of, [0]

    def faulty_loss_of(batch, micro):
        drawn[0] += 1
        for name, a in faults:
            if name == "nan_batch" and a["first"] <= drawn[0] <= a["last"] and a["rank"] in (-1, rank):
                batch = dict(batch, latents=batch["latents"] * float("nan"))
        for name, a in faults:
            if name == "oom_at_step" and a["rank"] == rank and trainer.step + 1 == a["step"]:
                print(f"[video_dit] FAULT INJECTED ({ENV}): rank {rank} runs out of memory in step {a['step']}",
                      flush=True)
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
        loss = loss_of(batch, micro)
        for name, a in faults:
            if name == "kill_at_step" and a["rank"] == rank and trainer.step + 1 == a["step"]:
                _kill_self(f"in the middle of step {a['step']}")
            if name == "stall_at_step" and a["rank"] == rank and trainer.step + 1 == a["step"]:
                print(f"[video_dit] FAULT INJECTED ({ENV}): rank {rank} stalls in the middle of step {a['step']} "
                      f"at t={time.time():.3f}", flush=True)
                time.sleep(3600)
        return loss

    trainer.loss_of = faulty_loss_of

    written = [0]  # files written by this process, over every engine (a two-expert job has one per expert)

    def faulty(save):
        def faulty_save(state_dict, path):
            for name, a in faults:
                if name == "enospc_on_save" and rank == 0 and written[0] >= a["after_file"]:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
            save(state_dict, path)
            written[0] += 1
            for name, a in faults:
                if name == "kill_during_save" and rank == 0 and written[0] == a["after_file"]:
                    _kill_self(f"after checkpoint file {written[0]} ({path})")
        return faulty_save

    engines = trainer.engines()
    for engine in engines.values() if isinstance(engines, dict) else [engines]:
        engine.checkpoint_engine.save = faulty(engine.checkpoint_engine.save)
