"""Shared pieces of the fault suite: the tiny world (6 clips, base weights), job files, two ways of
starting ranks, and the worker that is one rank of a launch.

- `launch_ranks`: N plain processes with RANK/WORLD_SIZE set (no launcher), each running `worker`;
  the worker records the batches each step trained on and dumps the full trainable state (fp32
  params, Adam moments) after resume and after each save, for the world-size tests.
- `train_sh`: the product's own command, `./launch/train.sh CONFIG` (validation, then the DeepSpeed
  launcher with 2 CPU ranks), for the kill tests: it is the launcher that must stop the job.
Run this file as a script (`--worker SPEC`) to be one rank of `launch_ranks`.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parents[2]
CLIPS = 6


def make_world(root: Path) -> Path:
    """6 clips (9 frames, 32x32) with one held-out first frame, and 'pretrained' tiny DiT weights (the
    preset's init with a non-zero output layer, so a LoRA on the blocks gets gradients)."""
    from safetensors.torch import save_file

    from video_dit.data.demo import make_demo_data
    from video_dit.models.loading import load_dit

    make_demo_data(root / "data", count=CLIPS, frames=9, size=32, seed=0, holdout=1)
    dit = load_dit("preset:tiny", seed=0)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        dit.head.head.weight.copy_(torch.randn(dit.head.head.weight.shape, generator=g) * 0.05)
    save_file({k: v.contiguous() for k, v in dit.state_dict().items()}, str(root / "base.safetensors"))
    return root


def job_yaml(root: Path, name: str, *, steps: int = 6, save_every: int = 2, keep: int = 5, zero: int = 2,
             timeout_s: int = 60, samples: list[dict] | None = None, sample_every: int = 1000,
             max_nonfinite: int = 5) -> Path:
    """A LoRA job on the tiny world (fp32, deterministic); `samples` turns previews on."""
    process = {
        "type": "sd_trainer", "training_folder": str(root / "out"),
        "network": {"type": "lora", "linear": 4, "linear_alpha": 4},
        "save": {"dtype": "float32", "save_every": save_every, "max_step_saves_to_keep": keep},
        "datasets": [{"folder_path": str(root / "data"), "num_frames": 9, "resolution": [32], "do_i2v": True}],
        "train": {"steps": steps, "lr": 1e-2, "batch_size": 1, "dtype": "fp32", "seed": 7, "warmup_steps": 2,
                  "lr_scheduler": "cosine", "max_nonfinite_steps": max_nonfinite,
                  "skip_first_sample": samples is None, "disable_sampling": samples is None},
        "model": {"arch": "video_dit", "name_or_path": str(root / "base.safetensors"), "preset": "tiny"},
        "deepspeed": {"zero_stage": zero, "timeout_s": timeout_s},
    }
    if samples is not None:
        process["sample"] = {"sample_every": sample_every, "width": 32, "height": 32, "num_frames": 5, "fps": 8,
                             "sample_steps": 1, "guidance_scale": 1.0, "samples": samples}
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"job": "extension", "config": {"name": name, "process": [process]}}))
    return path


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("VIDEO_DIT_FAULT", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1")
    env.update({k: str(v) for k, v in extra.items()})
    return env


def launch_ranks(root: Path, world: int, jobs: list[dict], *, fault: str | None = None, timeout: int = 180,
                 check: bool = True) -> tuple[list, str, float]:
    """Run `jobs` ({config, resume, stop_at, dump, run}) on `world` plain processes (no launcher).
    Returns (exit codes, the ranks' logs, seconds until the last rank exited)."""
    spec = root / f"spec_{len(list(root.glob('spec_*.json')))}.json"
    spec.write_text(json.dumps({"jobs": jobs}))
    port = _port()
    procs = []
    t0 = time.monotonic()
    for rank in range(world):
        env = rank_env(RANK=rank, LOCAL_RANK=rank, WORLD_SIZE=world, MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                       **({"VIDEO_DIT_FAULT": fault} if fault else {}))
        log = open(root / f"{spec.stem}_rank{rank}.log", "w")
        procs.append((subprocess.Popen([sys.executable, __file__, "--worker", str(spec)], env=env, cwd=root,
                                       stdout=log, stderr=subprocess.STDOUT), log))
    codes = []
    for proc, log in procs:
        try:
            codes.append(proc.wait(timeout=max(1.0, timeout - (time.monotonic() - t0))))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            codes.append("timeout")
        log.close()
    elapsed = time.monotonic() - t0
    logs = "\n".join(f"--- rank {r} (rc {c}):\n" + (root / f"{spec.stem}_rank{r}.log").read_text()
                     for r, c in enumerate(codes))
    if check and any(c != 0 for c in codes):
        raise AssertionError(f"launch failed: {codes}\n{logs[-8000:]}")
    return codes, logs, elapsed


def train_sh(root: Path, config: Path, *, fault: str | None = None, timeout: int = 300) -> dict:
    """`./launch/train.sh CONFIG` (2 CPU ranks under the DeepSpeed launcher). Returns {rc, output, end
    (wall clock at its exit), leftover (processes of its session still alive 5 s later)}. On timeout the
    session is killed and rc is "timeout"."""
    env = rank_env(**({"VIDEO_DIT_FAULT": fault} if fault else {}))
    env.pop("MASTER_PORT", None)
    proc = subprocess.Popen(["bash", str(ROOT / "launch/train.sh"), str(config), "--master_port", str(_port())],
                            env=env, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, _ = proc.communicate()
        rc = "timeout"
    end = time.time()
    leftover = True
    for _ in range(50):
        try:
            os.killpg(proc.pid, 0)  # signal 0: only asks whether any process of the session exists
        except ProcessLookupError:
            leftover = False
            break
        time.sleep(0.1)
    if leftover:
        os.killpg(proc.pid, 9)
    return {"rc": rc, "output": out, "end": end, "leftover": leftover}


def losses(out_dir: Path) -> dict[int, float]:
    """step -> loss of `metrics.jsonl` (the last row of a step wins: a relaunch appends)."""
    from video_dit.train.metrics import read_metrics

    return {r["step"]: r["loss"] for r in read_metrics(out_dir / "metrics.jsonl")}


def trained_items(out_dir: Path) -> list[tuple[int, int, list[int]]]:
    """(step, rank, dataset indices) of every trained batch the workers recorded, in step order."""
    rows = []
    for f in sorted(out_dir.glob("items_rank*.jsonl")):
        rows += [tuple(json.loads(line)) for line in f.read_text().splitlines()]
    return sorted(rows)


# ---------------------------------------------------------------- the worker (one rank)

def full_state(trainer) -> dict[str, torch.Tensor]:
    """The trainable state as full tensors, whatever the ZeRO partitioning: fp32 params and Adam moments
    (collective under ZeRO; every rank calls), plus the step and the LR scheduler's position."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    out = {}
    for name, p in trainer.module.named_parameters():
        if not p.requires_grad:
            continue
        out[f"param/{name}"] = safe_get_full_fp32_param(p).detach().cpu().clone()
        for key in ("exp_avg", "exp_avg_sq"):
            out[f"{key}/{name}"] = safe_get_full_optimizer_state(p, key).detach().cpu().clone()
    out["step"] = torch.tensor(trainer.step)
    out["lr_step"] = torch.tensor(trainer.scheduler.last_epoch)
    return out


def worker(spec_path: str) -> int:
    from safetensors.torch import save_file

    from video_dit.train.config import load_job
    from video_dit.train.trainer import Trainer, run

    spec = json.loads(Path(spec_path).read_text())
    for item in spec["jobs"]:
        job = load_job(item["config"])
        if item.get("run"):  # the product's path (launch/train.py's run): exit codes and messages
            code = run(job, resume=item.get("resume"))
            if code:
                return code
            continue
        trainer = Trainer(job, resume=item.get("resume"))
        out = job.out_dir

        def dump(tag, trainer=trainer, out=out):
            state = full_state(trainer)
            if trainer.rank == 0:
                save_file(state, str(out / f"state_{tag}_{trainer.step}.safetensors"))

        if item.get("dump"):
            if trainer.step > 0:  # resumed: the state as loaded (a fresh start has no Adam moments yet)
                dump("start")
            save = trainer.save

            def save_and_dump(save=save, dump=dump):
                save()
                dump("saved")

            trainer.save = save_and_dump
        loss_of = trainer.loss_of
        record = open(out / f"items_rank{trainer.rank}.jsonl", "a")

        def recording_loss_of(batch, micro, loss_of=loss_of, trainer=trainer, record=record):
            record.write(json.dumps([trainer.step + 1, trainer.rank, batch["index"].tolist()]) + "\n")
            record.flush()
            return loss_of(batch, micro)

        trainer.loss_of = recording_loss_of
        if item.get("stop_at"):  # the job is stopped after this step (its last save); the LR schedule
            trainer.p.train.steps = item["stop_at"]  # keeps the configured length (built at start-up)
        code = trainer.train()
        record.close()
        trainer.close()
        if code:
            return code
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        sys.exit(worker(sys.argv[2]))
    sys.exit(f"usage: {sys.argv[0]} --worker SPEC.json")
