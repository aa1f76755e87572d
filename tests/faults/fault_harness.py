"""Shared pieces of the fault suite: the tiny world (6 clips, base weights), its job files, and the
product's own command as a launcher.

- `launch_ranks`: N plain processes with RANK/WORLD_SIZE set (no launcher) running tests/ranks.py's job
  worker; every job records the batches each step trained on (`record`), and may dump the full trainable
  state (fp32 params, Adam moments) after resume and after each save (`dump`), for the world-size tests.
- `train_sh`: the product's own command, `./launch/train.sh CONFIG` (validation, then the DeepSpeed
  launcher with 2 CPU ranks), for the kill tests: it is the launcher that must stop the job.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the shared helpers and launchers

import helpers  # noqa: E402
import ranks  # noqa: E402
from helpers import losses  # noqa: E402,F401  (step -> loss of an output folder)
from ranks import rank_env  # noqa: E402,F401

from video_dit.devices import free_port  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CLIPS = 6


def make_world(root: Path) -> Path:
    """6 clips (9 frames, 32x32) with one held-out first frame, and 'pretrained' tiny DiT weights."""
    return helpers.make_world(root, count=CLIPS)


def job_yaml(root: Path, name: str, *, steps: int = 6, save_every: int = 2, keep: int = 5, zero: int = 2,
             timeout_s: int = 60, samples: list[dict] | None = None, sample_every: int = 1000,
             max_nonfinite: int = 5) -> Path:
    """A LoRA job on the tiny world (fp32, deterministic, `save.resume: auto` as a user's relaunch
    needs); `samples` turns previews on."""
    return helpers.write_job(root, name, steps=steps, save_every=save_every, keep=keep, zero=zero, lr=1e-2,
                             timeout_s=timeout_s, samples=samples, sample_every=sample_every, sample_steps=1,
                             save={"resume": "auto"}, train={"max_nonfinite_steps": max_nonfinite})


def launch_ranks(root: Path, world: int, jobs: list[dict], *, fault: str | None = None, timeout: int = 180,
                 check: bool = True) -> tuple[list, str, float]:
    """Run `jobs` ({config, resume, stop_at, dump, run}; each records its batches) on `world` plain
    processes (no launcher). Returns (exit codes, the ranks' logs, seconds until the last rank exited)."""
    return ranks.run_jobs(root, [{"record": True, **j} for j in jobs], world, fault=fault, timeout=timeout,
                          check=check)


def train_sh(root: Path, config: Path, *, fault: str | None = None, timeout: int = 300) -> dict:
    """`./launch/train.sh CONFIG` (2 CPU ranks under the DeepSpeed launcher). Returns {rc, output, end
    (wall clock at its exit), leftover (processes of its session still alive 5 s later)}. On timeout the
    session is killed and rc is "timeout"."""
    env = rank_env(**({"VIDEO_DIT_FAULT": fault} if fault else {}))
    env.pop("MASTER_PORT", None)
    proc = subprocess.Popen(["bash", str(ROOT / "launch/train.sh"), str(config), "--master_port", str(free_port())],
                            env=env, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        kill_session(proc.pid)
        out, _ = proc.communicate()
        rc = "timeout"
    end = time.time()
    leftover = session_left(proc.pid, 5.0)
    if leftover:
        kill_session(proc.pid)
    return {"rc": rc, "output": out, "end": end, "leftover": leftover}


def session_processes(sid: int) -> list[int]:
    """Live (not zombie) processes of session `sid`: the launcher runs the ranks in a process group of
    their own, so a process group no longer finds them all; the session (start_new_session) does."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:  # gone meanwhile
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # state ppid pgrp session ...
        if int(fields[3]) == sid and fields[0] != "Z":
            out.append(int(d.name))
    return out


def session_left(sid: int, within_s: float) -> list[int]:
    """The processes of session `sid` still alive after waiting up to `within_s` seconds for none."""
    end = time.monotonic() + within_s
    while True:
        left = session_processes(sid)
        if not left or time.monotonic() > end:
            return left
        time.sleep(0.1)


def kill_session(sid: int) -> None:
    for pid in session_processes(sid):
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass


def trained_items(out_dir: Path) -> list[tuple[int, int, list[int]]]:
    """(step, rank, dataset indices) of every trained batch the workers recorded, in step order."""
    rows = []
    for f in sorted(out_dir.glob("items_rank*.jsonl")):
        rows += [tuple(json.loads(line)) for line in f.read_text().splitlines()]
    return sorted(rows)
