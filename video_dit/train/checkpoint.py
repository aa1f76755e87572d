"""Checkpoints that a crash cannot corrupt, and resume.

Layout under `<out>/checkpoints/`:
    step_000000300/                 a complete checkpoint (only complete ones ever carry this name)
        mp_rank_00_model_states.pt, *optim_states.pt   DeepSpeed's state (model, optimizer, LR schedule,
                                                        our client state: step, sampler, counters)
        rank_00000.json ...          per-rank RNG states (python, numpy, torch, cuda), JSON, never pickled
        meta.json                    step, world size, ZeRO stage, config hash (written last)
    step_000000400.tmp/             being written: DeepSpeed writes here, every rank adds its file,
                                    then rank 0 renames it into place and updates `latest`
    latest                          the newest complete tag (written to a temp file, then renamed)

A two-expert job (Wan 2.2 A14B, train/experts.py) runs one DeepSpeed engine per trained expert: each
writes its own state (model, optimizer, LR schedule, the client state) into a subfolder named after
the expert, `step_N/high_noise/` and `step_N/low_noise/`; the RNG files and meta.json (which names the
experts) stay beside them. The universal conversion converts each subfolder.

A kill at any moment leaves either the previous checkpoint as latest or the new one complete; a
stale `.tmp` folder is removed (with a warning) on the next start. Resuming with another world size
(or ZeRO stage) goes through DeepSpeed's universal checkpoint format: the error message gives the
conversion command, and a converted folder (it holds `zero/`) is loaded with `load_universal`.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import random
import re
import shutil
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from video_dit.diffusion.experts import EXPERTS
from video_dit.parallel.zero import sharded_checkpoint

TAG_RE = re.compile(r"^step_(\d{9})$")
LATEST = "latest"
META = "meta.json"


class ResumeError(RuntimeError):
    """A checkpoint that cannot be resumed as asked; the message says what to do."""


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (disk full, ...); the previous one stays the latest."""


def tag_for(step: int) -> str:
    return f"step_{step:09d}"


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# ---------------------------------------------------------------- RNG states (JSON, no pickles)

def rng_state() -> dict:
    np_state = np.random.get_state()
    state = {
        "python": _jsonable(random.getstate()),
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
    }
    if torch.cuda.is_available():
        state["cuda"] = base64.b64encode(torch.cuda.get_rng_state().numpy().tobytes()).decode()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(_tuplify(state["python"]))
    n = state["numpy"]
    np.random.set_state((n[0], np.array(n[1], dtype=np.uint32), n[2], n[3], n[4]))
    torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(state["torch"])), dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(state["cuda"])), dtype=torch.uint8))


def _jsonable(x):
    return [_jsonable(v) for v in x] if isinstance(x, (tuple, list)) else x


def _tuplify(x):
    return tuple(_tuplify(v) for v in x) if isinstance(x, list) else x


# ---------------------------------------------------------------- finding checkpoints

def complete_checkpoints(ckpt_dir: Path) -> list[Path]:
    """Complete checkpoint folders, oldest first."""
    if not ckpt_dir.is_dir():
        return []
    found = [p for p in ckpt_dir.iterdir() if p.is_dir() and TAG_RE.match(p.name) and (p / META).is_file()]
    return sorted(found, key=lambda p: int(TAG_RE.match(p.name).group(1)))


def find_latest(ckpt_dir: Path) -> Path | None:
    """The newest complete checkpoint: `latest` when it names a complete one, else the highest step."""
    latest = ckpt_dir / LATEST
    if latest.is_file():
        tag = latest.read_text(encoding="utf-8").strip()
        cand = ckpt_dir / tag
        if TAG_RE.match(tag) and (cand / META).is_file():
            return cand
        warnings.warn(f"{latest} names {tag!r}, which is not a complete checkpoint; using the newest complete one",
                      stacklevel=2)
    done = complete_checkpoints(ckpt_dir)
    return done[-1] if done else None


def resume_hint(ckpt_dir: Path) -> str:
    """What a relaunch does, for the message of an interrupted run (no warnings: `latest` is read as is)."""
    done = complete_checkpoints(Path(ckpt_dir))
    if not done:
        return "no checkpoint yet: relaunching the same command starts again from step 0"
    last = done[-1]
    return (f"last checkpoint {last} (step {int(TAG_RE.match(last.name).group(1))}); relaunch the same command to "
            "resume from it")


def clean_incomplete(ckpt_dir: Path) -> list[Path]:
    """Remove half-written `*.tmp` checkpoint folders (call on rank 0 before training)."""
    removed = []
    if ckpt_dir.is_dir():
        for p in ckpt_dir.iterdir():
            if p.is_dir() and p.name.endswith(".tmp"):
                warnings.warn(f"removing incomplete checkpoint {p} (a save was interrupted)", stacklevel=2)
                shutil.rmtree(p, ignore_errors=True)
                removed.append(p)
    return removed


def _parts(engine) -> list[tuple[str | None, object]]:
    """[(subfolder, engine)]: [(None, engine)] for one engine, [(expert, engine), ...] for a dict of them."""
    return list(engine.items()) if isinstance(engine, dict) else [(None, engine)]


def expert_parts(path: Path) -> list[str]:
    """The expert subfolders of a checkpoint folder (empty for a one-model checkpoint)."""
    return [e for e in EXPERTS if (path / e).is_dir()]


def is_universal(path: Path) -> bool:
    parts = expert_parts(path)
    return all((path / e / "zero").is_dir() for e in parts) if parts else (path / "zero").is_dir()


@dataclass
class ResumePlan:
    path: Path
    meta: dict
    universal: bool
    source: Path | None = None  # the checkpoint as saved (`path` may be its universal conversion)

    def __post_init__(self):
        if self.source is None:
            self.source = self.path


def plan_resume(resume: str, ckpt_dir: Path, world_size: int, zero_stage: int,
                convert=None, experts: tuple[str, ...] | None = None) -> ResumePlan | None:
    """What to load: `resume` is auto (latest complete under `ckpt_dir`, or a fresh start), none, or a
    checkpoint folder. A ZeRO checkpoint of another world size or stage is converted by `convert`
    (`to_universal`, every rank calls) when given; otherwise `ResumeError` gives the command.
    `experts`: the experts the job trains (None: one model); the checkpoint must hold the same ones."""
    if resume == "none":
        return None
    if resume == "auto":
        path = find_latest(ckpt_dir)
        if path is None:
            return None
    else:
        path = Path(resume)
        if not path.is_dir():
            raise ResumeError(f"--resume {resume}: no such checkpoint folder")
    universal = is_universal(path)
    meta_file = path / META
    meta = json.loads(meta_file.read_text()) if meta_file.is_file() else {}
    saved = meta.get("experts", expert_parts(path) or None)
    if (list(saved) if saved else None) != (list(experts) if experts else None):
        what = lambda x: f"the experts {', '.join(x)}" if x else "one model (no experts)"  # noqa: E731
        raise ResumeError(f"{path} holds {what(saved)}, but this job trains {what(experts)}; resume a checkpoint of "
                          "the same experts (model.model_kwargs.train_high_noise / train_low_noise), or set "
                          "save.resume: none")
    if not universal:
        if not meta:
            raise ResumeError(f"{path}: no {META}; not a complete video_dit checkpoint")
        if sharded_checkpoint(meta["zero_stage"]) and (meta["world_size"] != world_size
                                                        or meta["zero_stage"] != zero_stage):
            out = f"{path}_universal"
            if convert is not None:
                converted = convert(path, Path(out))
                return ResumePlan(path=converted, meta=meta, universal=True, source=path)
            raise ResumeError(
                f"{path} was saved by {meta['world_size']} ranks at ZeRO stage {meta['zero_stage']}; this job has "
                f"{world_size} ranks at stage {zero_stage}, and DeepSpeed's ZeRO shards cannot be re-split as "
                f"they are. Convert it once to DeepSpeed's universal format and resume from the result:\n"
                f"  python -m deepspeed.checkpoint.ds_to_universal --input_folder {path} --output_folder {out}\n"
                f"  ./launch/train.sh CONFIG   # with save.resume: {out}   (or launch/train.py --resume {out})")
    return ResumePlan(path=path, meta=meta, universal=universal)


def to_universal(path: Path, out: Path) -> Path:
    """`path` converted once to DeepSpeed's universal format in `out` (every rank calls; rank 0 runs
    DeepSpeed's `ds_to_universal` in-process, the others wait at a barrier bounded by the process
    group's timeout). Written to `out.tmp` and renamed, so an interrupted conversion is never taken
    for a finished one (the `.tmp` folder is removed on the next start); `meta.json` is copied beside
    the result. Reused when `out` exists. Offline equivalent (same result):
        python -m deepspeed.checkpoint.ds_to_universal --input_folder PATH --output_folder PATH_universal"""
    if dist.get_rank() == 0 and not (out / "zero").is_dir():
        from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        print(f"[video_dit] {path} was saved with another world size or ZeRO stage: converting it to "
              f"DeepSpeed's universal format in {out}", file=sys.stderr, flush=True)
        workers = max(1, min(4, (os.cpu_count() or 2) // 2))  # > 1: DeepSpeed forks a process pool
        # one conversion per engine: the folder itself, or each expert's subfolder of a two-expert job
        for part in expert_parts(path) or [None]:
            src, dst = (path, tmp) if part is None else (path / part, tmp / part)
            args = argparse.Namespace(input_folder=str(src), output_folder=str(dst), num_extract_workers=workers,
                                      num_merge_workers=workers, keep_temp_folder=False, strict=True,
                                      inject_missing_state=False)
            try:
                ds_to_universal(args)
            except Exception as exc:  # any failure of the converter becomes one message naming the folder
                raise ResumeError(f"{src}: the conversion to DeepSpeed's universal format failed: "
                                  f"{type(exc).__name__}: {exc}") from exc
        shutil.copyfile(path / META, tmp / META)
        os.replace(tmp, out)
    dist.barrier()  # the process group's timeout bounds this wait
    if not is_universal(out):
        raise ResumeError(f"{out}: rank {dist.get_rank()} cannot see the converted checkpoint (the checkpoint "
                          "folder must be on a file system every rank reads)")
    return out


# ---------------------------------------------------------------- save / load

def save(engine, ckpt_dir: Path, step: int, client_state: dict, meta: dict, keep: int,
         frozen_base: bool = False, extra=None) -> Path:
    """Write checkpoint `step` (every rank calls this); returns the complete folder. `frozen_base`
    (LoRA): the frozen base weights are left out (they come from the model source on resume; this
    also keeps a quantized base's packed tensors out of the checkpoint). `extra(folder)`: every rank
    adds its own files (the EMA) to the folder being written, before it is completed."""
    rank = dist.get_rank()
    tag = tag_for(step)
    tmp_tag = f"{tag}.tmp"
    final, tmp = ckpt_dir / tag, ckpt_dir / tmp_tag
    if rank == 0:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
    dist.barrier()
    client_state = dict(client_state)
    # lets `python -m deepspeed.checkpoint.ds_to_universal` convert this checkpoint for a new world size
    client_state["universal_checkpoint_info"] = {"universal_checkpoint_version": 0.2}
    meta = dict(meta, frozen_base_excluded=frozen_base)
    parts = _parts(engine)
    if parts[0][0] is not None:
        meta["experts"] = [part for part, _ in parts]
    try:
        for part, e in parts:  # one engine: step_N/; a dict of expert engines: step_N/<expert>/
            e.save_checkpoint(str(ckpt_dir) if part is None else str(tmp), tag=tmp_tag if part is None else part,
                              client_state=client_state, save_latest=False, exclude_frozen_parameters=frozen_base)
        tmp.mkdir(parents=True, exist_ok=True)
        _atomic_write_text(tmp / f"rank_{rank:05d}.json", json.dumps(rng_state()))
        if extra is not None:
            extra(tmp)
        dist.barrier()  # every rank's shards, RNG file and extra files are on disk
        if rank == 0:
            _atomic_write_text(tmp / META, json.dumps(meta, indent=1))
            if final.exists():  # the same step saved again (e.g. a resumed run's final save)
                shutil.rmtree(final)
            os.replace(tmp, final)
            _atomic_write_text(ckpt_dir / LATEST, tag)
            for old in complete_checkpoints(ckpt_dir)[:-keep]:  # keep the last K
                shutil.rmtree(old, ignore_errors=True)
                shutil.rmtree(old.with_name(old.name + "_universal"), ignore_errors=True)  # its conversion
    except OSError as exc:  # disk full, quota, I/O error: stop with the previous checkpoint as latest
        # (other ranks may still be writing into the .tmp folder: it is left to clean_incomplete)
        previous = find_latest(ckpt_dir)
        raise CheckpointWriteError(
            f"rank {rank}: could not write checkpoint {tag} in {ckpt_dir}: {exc.strerror or exc} "
            f"({exc.filename or ckpt_dir}). The half-written {tmp_tag} is never used and is removed at the "
            "next start; "
            + (f"the previous checkpoint {previous} is intact and a relaunch resumes from it"
               if previous else "no earlier checkpoint exists") + ". Free space there and relaunch.") from exc
    dist.barrier()
    return final


def load(engine, plan: ResumePlan) -> dict:
    """Load `plan` into `engine` (every rank; a dict {expert: engine} loads each expert's subfolder);
    returns the client state. Restores this rank's RNG states when the checkpoint has them for this
    rank (not after a world-size change)."""
    path = plan.path
    strict = not plan.meta.get("frozen_base_excluded", False)  # LoRA checkpoints hold only the adapters
    client_state = None
    for part, e in _parts(engine):
        load_dir, tag = (path.parent, path.name) if part is None else (path, part)
        load_path, state = e.load_checkpoint(str(load_dir), tag=tag, load_optimizer_states=True,
                                             load_lr_scheduler_states=True, load_module_strict=strict)
        if load_path is None:
            raise ResumeError(f"{load_dir / tag}: DeepSpeed could not load this checkpoint")
        client_state = state if client_state is None else client_state
    rank_file = path / f"rank_{dist.get_rank():05d}.json"
    if rank_file.is_file() and plan.meta.get("world_size") == dist.get_world_size():
        set_rng_state(json.loads(rank_file.read_text()))
    elif dist.get_rank() == 0:
        warnings.warn(f"{path}: no RNG state for this world size; global RNGs are reseeded (the training "
                      f"noise does not depend on them: it is seeded by (seed, rank, step))", stacklevel=2)
    return client_state or {}
