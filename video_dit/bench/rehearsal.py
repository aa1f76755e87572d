"""Full-size rehearsal on CPU: the real `wan2.1-t2v-1.3b` preset (30 blocks of width 1536; random
weights written by `video_dit.bench.load.write_wan_file` in the original Wan single-file layout,
fp32, 5.7 GB) trained as a LoRA job through `./launch/train.sh` on 2 CPU ranks, ZeRO-3 (built
partitioned), sequence parallelism 2, block checkpointing, 17x128x128 clips; killed mid-step,
relaunched, resumed; its ComfyUI-keyed LoRA export checked. It reports each run's per-rank peak RSS
beside the memory planner's prediction for this job and machine, and the step time.

    flock /tmp/bigmem.lock video-dit bench --suite rehearsal     # ~9 GiB, ~20 min on 2 cores
    python -m video_dit.bench.rehearsal --keep /tmp/wan13 --json rehearsal.json

Text encoder: the preset's umT5-XXL is never downloaded here, so the benchmark writes a random umT5
with the real text width (d_model 4096 = the DiT's text_dim; 1 layer, 2 heads, ByT5 byte vocabulary,
saved as a transformers folder with a `ByT5Tokenizer`), loaded by the trainer like the real one.
VAE: Wan 2.1's architecture (the preset's), random weights, as a `.safetensors` file.
The kill: `VIDEO_DIT_FAULT=kill_rank1_at_step:4` (rank 1 SIGKILLs itself in step 4; the launcher
ends the job); the relaunch resumes from the step-2 checkpoint and its step 3 must reproduce the
first run's step 3 loss.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from video_dit.bench.common import write_json
from video_dit.bench.load import write_wan_file
from video_dit.data.demo import make_demo_data
from video_dit.devices import local_machine
from video_dit.families.wan.loading import load_vae
from video_dit.families.wan.text_encoder import TextEncoderConfig, build_umt5
from video_dit.train.config import load_job
from video_dit.train.metrics import read_metrics
from video_dit.train.plan import plan_job

GiB = 2 ** 30
ROOT = Path(__file__).resolve().parents[2]
PRESET = "wan2.1-t2v-1.3b"
STEPS, KILL_AT, SAVE_EVERY, RANK = 4, 4, 2, 16


def write_text_encoder(folder: Path) -> Path:
    """A random umT5 encoder with the Wan text width (4096) and a byte tokenizer, as a folder holding
    `text_encoder/` (transformers, safetensors) and `tokenizer/` (what `load_text_encoder` reads)."""
    from transformers import ByT5Tokenizer

    if not (folder / "text_encoder" / "config.json").is_file():
        config = TextEncoderConfig(vocab_size=384, d_model=4096, d_ff=256, num_layers=1, num_heads=2, d_kv=64,
                                   text_len=512, tokenizer="byt5")
        build_umt5(config, seed=0).save_pretrained(folder / "text_encoder", safe_serialization=True)
        ByT5Tokenizer().save_pretrained(folder / "tokenizer")
    return folder


def write_vae(path: Path) -> Path:
    from safetensors.torch import save_file

    if not path.is_file():
        vae = load_vae("preset:wan2.1", seed=0)
        save_file({k: v.contiguous() for k, v in vae.state_dict().items()}, str(path))
    return path


def write_job(work: Path, weights: Path, vae: Path, te: Path) -> Path:
    process = {
        "type": "sd_trainer", "training_folder": str(work / "out"), "device": "cpu",
        "network": {"type": "lora", "linear": RANK, "linear_alpha": RANK},
        "save": {"dtype": "float32", "save_every": SAVE_EVERY, "max_step_saves_to_keep": 2, "resume": "auto"},
        "datasets": [{"folder_path": str(work / "data"), "num_frames": 17, "resolution": [128], "caption_ext": "txt"}],
        "train": {"steps": STEPS, "lr": 1e-4, "batch_size": 1, "dtype": "fp32", "seed": 3,
                  "gradient_checkpointing": True, "disable_sampling": True, "skip_first_sample": True},
        "model": {"arch": "video_dit", "name_or_path": str(weights.parent), "preset": PRESET,
                  "vae_path": str(vae), "text_encoder_path": str(te)},
        # DeepSpeed's default stage3_max_reuse_distance (1e9 elements) may keep up to 3.7 GiB of the
        # gathered fp32 model per rank from the second step on (the planner's bound); re-gathering
        # instead keeps a rank near 1/N of the model
        "deepspeed": {"zero_stage": 3, "sequence_parallel_size": 2, "timeout_s": 1800,
                      "config": {"zero_optimization": {"stage3_max_reuse_distance": int(5e7),
                                                       "stage3_max_live_parameters": int(1e8)}}},
    }
    path = work / "rehearsal.yaml"
    path.write_text(yaml.safe_dump({"job": "extension", "config": {"name": "rehearsal", "process": [process]}}))
    return path


def launch(job: Path, log: Path, fault: str | None = None) -> tuple[int, float]:
    env = {k: v for k, v in os.environ.items() if k not in ("VIDEO_DIT_FAULT", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    if fault:
        env["VIDEO_DIT_FAULT"] = fault
    t0 = time.perf_counter()
    with open(log, "w") as f:
        rc = subprocess.run([str(ROOT / "launch" / "train.sh"), str(job)], cwd=ROOT, env=env, stdout=f,
                            stderr=subprocess.STDOUT, check=False).returncode
    return rc, time.perf_counter() - t0


def rows(path: Path) -> list[dict]:
    return read_metrics(path) if path.is_file() else []


def prediction(job_path: Path) -> dict:
    """The planner's figures for this job on the 2 CPU ranks train.sh starts here."""
    job = load_job(job_path)
    plan = plan_job(job, local_machine(ranks=2))
    b = max(plan.buckets, key=lambda b: b.as_configured.device_bytes)
    per_rank = plan.host.peak_per_rank
    return {"device_gib": b.as_configured.device_bytes / GiB, "peak_rss_per_rank_gib": per_rank / GiB,
            "bucket": list(b.bucket), "tokens": b.tokens, "split_gib": b.as_configured.memory.as_gib()}


def run(device: str = "cpu", repeats: int = 1, small: bool = False, threads: int | None = None,
        keep: str | None = None) -> dict:
    if device != "cpu":
        raise ValueError("the rehearsal runs on 2 CPU ranks")
    from safetensors import safe_open

    base = Path(keep) if keep else None
    with tempfile.TemporaryDirectory(prefix="bench_rehearsal_") as tmp:
        work = Path(tmp)
        assets = base or work
        weights = write_wan_file(assets / "wan")
        vae = write_vae(assets / "wan21_vae.safetensors")
        te = write_text_encoder(assets / "umt5_4096")
        make_demo_data(work / "data", count=2, frames=17, size=128, holdout=0)
        job = write_job(work, weights, vae, te)
        predicted = prediction(job)
        metrics_path = work / "out" / "rehearsal" / "metrics.jsonl"
        rc_a, wall_a = launch(job, work / "run_a.log", fault=f"kill_rank1_at_step:{KILL_AT}")
        first = rows(metrics_path)
        rc_b, wall_b = launch(job, work / "run_b.log")
        log_b = (work / "run_b.log").read_text()
        resumed = re.search(r"resumed from \S+ at step (\d+)", log_b)
        resumed_at = int(resumed.group(1)) if resumed else 0
        # metrics.jsonl drops the rows after the resumed step, which the relaunch writes again
        every = rows(metrics_path)
        second = [r for r in every if r["step"] > resumed_at]
        export = work / "out" / "rehearsal" / "rehearsal.safetensors"
        lora = {}
        if export.is_file():
            with safe_open(str(export), "pt") as f:
                keys = list(f.keys())
                meta = f.metadata() or {}
                shape = tuple(f.get_slice("diffusion_model.blocks.0.self_attn.q.lora_A.weight").get_shape())
            lora = {"keys": len(keys), "comfy_prefix": all(k.startswith("diffusion_model.") for k in keys),
                    "alpha_keys": sum(k.endswith(".alpha") for k in keys), "lora_A_shape": list(shape),
                    "rank": meta.get("rank"), "step": meta.get("step"), "base_preset": meta.get("base_preset")}
        a3 = next((r["loss"] for r in first if r["step"] == KILL_AT - 1), None)
        b3 = next((r["loss"] for r in second if r["step"] == KILL_AT - 1), None)
        res = {
            "preset": PRESET, "tokens": predicted["tokens"], "predicted": predicted,
            "run_a": {"rc": rc_a, "wall_s": wall_a, "steps": [r["step"] for r in first],
                      "peak_rss_gib": max((r["peak_mem_gb"] for r in first), default=None)},
            "run_b": {"rc": rc_b, "wall_s": wall_b, "steps": [r["step"] for r in second],
                      "resumed": resumed is not None, "resumed_at_step": resumed_at,
                      "peak_rss_gib": max((r["peak_mem_gb"] for r in second), default=None)},
            "step_s": statistics.median(r["step_time_s"] for r in every) if every else None,
            "loss_step3": {"first_run": a3, "resumed": b3,
                           "equal": a3 is not None and b3 is not None and abs(a3 - b3) <= 1e-5 * max(1.0, abs(a3))},
            "lora_export": lora,
            "plan_printed_by_train_sh": "memory plan:" in (work / "run_a.log").read_text(),
        }
        measured = max(v for v in (res["run_a"]["peak_rss_gib"], res["run_b"]["peak_rss_gib"]) if v is not None) \
            if every else None
        res["peak_rss_gib"] = measured
        res["predicted_vs_measured"] = predicted["peak_rss_per_rank_gib"] / measured if measured else None
        if not every or rc_b != 0:
            res["log_tail"] = (work / "run_b.log").read_text()[-3000:] + (work / "run_a.log").read_text()[-3000:]
    return res


def print_table(res: dict) -> None:
    a, b, p = res["run_a"], res["run_b"], res["predicted"]
    print(f"\nRehearsal: {res['preset']} LoRA r{RANK}, ZeRO-3 (partitioned build), SP 2, block checkpointing, "
          f"2 CPU ranks, 17x128x128 ({res['tokens']} tokens), fp32")
    print(f"  run 1: exit {a['rc']} (killed in step {KILL_AT}), steps {a['steps']}, {a['wall_s']:.0f} s")
    print(f"  run 2: exit {b['rc']}, resumed {b['resumed']} (from step {b['resumed_at_step']}), steps {b['steps']}, {b['wall_s']:.0f} s")
    ls = res["loss_step3"]
    print(f"  step {KILL_AT - 1} loss: first run {ls['first_run']}, resumed {ls['resumed']}, equal {ls['equal']}")
    print(f"  per-rank peak RSS: measured {res['peak_rss_gib']} GiB, planner {p['peak_rss_per_rank_gib']:.2f} GiB "
          f"(ratio {res['predicted_vs_measured']}); step time {res['step_s']} s (machine shared)")
    print(f"  LoRA export: {res['lora_export']}; train.sh printed the plan: {res['plan_printed_by_train_sh']}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keep", default=None, help="folder for the generated weights (kept and reused)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    res = run(keep=args.keep)
    print_table(res)
    write_json(res, args.json)
    return 0 if res["loss_step3"]["equal"] and res["run_b"]["rc"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
