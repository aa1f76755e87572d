"""ZeRO-3 set-up memory: per-rank peak host RSS of the partitioned build (`build_dit`) against the
full load (`load_dit` on every rank, then `deepspeed.initialize` partitions it), side by side in one
run, at the real Wan 2.1 1.3B shape (random weights written in the original Wan single-file layout:
`diffusion_pytorch_model.safetensors` with Wan's key names, fp32, 5.7 GB).

    video-dit bench --suite load                 # 2 CPU ranks; needs ~12 GiB free (flock /tmp/bigmem.lock)
    python -m video_dit.bench.load --dtype bf16 --keep /tmp/wan13 --json load.json

Each (path, dtype) runs in 2 fresh rank processes (gloo): the set-up of a ZeRO-3 LoRA job
(rank 32): the DiT, LoRA injection, `engine.initialize`. Every rank records its RSS after imports
and joining the process group (the fixed overhead, measured) and its peak RSS (VmHWM) at the end of
set-up. The target: partitioned peak <= full / N + one checkpoint shard + the fixed overhead, where
the shard is the largest unit the build reads at once (one module group, a DiT block) and the
overhead is the process's RSS before loading (measured) plus what the LoRA injection and
`deepspeed.initialize` add after the DiT, alike in both paths: the adapters as peft makes them (fp32)
and DeepSpeed's ZeRO-3 state for them with its reduce bucket (the planner's `state_memory`).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from video_dit.bench.common import launch_ranks, write_json
from video_dit.data.demo import make_demo_data
from video_dit.families import get_preset
from video_dit.families.wan import FAMILY as WAN
from video_dit.families.wan.dit import VideoDiT, init_parameter
from video_dit.families.wan.loading import load_dit
from video_dit.models.common import parameter_generator
from video_dit.models.weights import check_matches_preset, module_groups
from video_dit.parallel.zero import ds_config
from video_dit.train.build import build_dit, make_trainable
from video_dit.train.config import parse_job
from video_dit.train.engine import build_optimizer
from video_dit.train.plan import Setting, model_sizes, state_memory

GiB = 2 ** 30
PRESET = "wan2.1-t2v-1.3b"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def rss() -> dict:
    """This process's current and peak resident set (bytes), from /proc/self/status."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                out[key] = int(value.split()[0]) * 1024
    return out


def write_wan_file(folder: Path, preset: str = PRESET, seed: int = 0) -> Path:
    """Random weights of `preset`'s DiT in the original Wan single-file layout (native names, fp32,
    `diffusion_pytorch_model.safetensors` + Wan's `config.json`), written one module group at a time
    into one file; returns the file. Reused when it exists."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "diffusion_pytorch_model.safetensors"
    cfg = get_preset(preset).dit
    if not path.is_file():
        with torch.device("meta"):
            meta = VideoDiT(cfg)
        tensors = {}  # save_file writes from the tensors' memory: the model is held once
        for name, p in meta.named_parameters():  # Wan's init by name; the head made non-zero
            t = init_parameter(cfg, name, torch.empty(p.shape), parameter_generator(seed, name))
            if name == "head.head.weight":
                t.normal_(std=0.02, generator=parameter_generator(seed + 1, name))
            tensors[name] = t
        tmp = path.with_suffix(".tmp")
        save_file(tensors, str(tmp))
        del tensors
        tmp.replace(path)
    wan_config = {"_class_name": "WanModel", "model_type": "t2v", "patch_size": list(cfg.patch_size), "dim": cfg.dim,
                  "eps": cfg.eps, "ffn_dim": cfg.ffn_dim, "freq_dim": cfg.freq_dim, "in_dim": cfg.in_dim,
                  "num_heads": cfg.num_heads, "num_layers": cfg.num_layers, "out_dim": cfg.out_dim,
                  "text_len": cfg.text_len, "text_dim": cfg.text_dim}
    (folder / "config.json").write_text(json.dumps(wan_config, indent=1))
    return path


def job_of(weights: str, data_dir: str, out_dir: str, dtype: str):
    return parse_job({"job": "extension", "config": {"name": "bench_load", "process": [{
        "type": "sd_trainer", "training_folder": out_dir, "network": {"type": "lora", "linear": 32},
        "datasets": [{"folder_path": data_dir, "num_frames": 5, "resolution": [64]}],
        "train": {"batch_size": 1, "steps": 10, "dtype": dtype},
        "model": {"name_or_path": weights, "preset": PRESET},
        "deepspeed": {"zero_stage": 3}}]}}, source="video_dit.bench.load")


def _rank_main(spec: dict) -> int:
    import deepspeed

    deepspeed.init_distributed("gloo")
    dist.barrier()
    rank, world = dist.get_rank(), dist.get_world_size()
    before = rss()
    dtype = DTYPES[spec["dtype"]]
    job = job_of(spec["weights"], spec["data_dir"], spec["out_dir"], spec["dtype"])
    ds = ds_config(job, world)
    preset = get_preset(PRESET)
    t0 = time.perf_counter()
    if spec["path"] == "full":  # what every rank did before build_dit: the whole model, then partitioned
        dit = load_dit(spec["weights"], dtype=dtype)
        check_matches_preset(dit, preset, spec["weights"], VideoDiT)
    else:
        dit = build_dit(spec["weights"], preset, zero_stage=3, dtype=dtype, ds_config=ds)
    built = rss()
    make_trainable(dit, job.process, dtype, family=WAN)
    params = [p for p in dit.parameters() if p.requires_grad]
    optimizer, scheduler = build_optimizer(params, job.process.train)
    engine, *_ = deepspeed.initialize(model=dit, model_parameters=params, optimizer=optimizer,
                                      lr_scheduler=scheduler, config=ds)
    dist.barrier()
    after = rss()
    held = sum(p.ds_tensor.numel() * p.ds_tensor.element_size() for p in engine.module.parameters())
    out = {"rank": rank, "before": before, "built": built, "after": after, "setup_s": time.perf_counter() - t0,
           "partition_bytes": held}
    Path(spec["out"]).with_suffix(f".rank{rank}.json").write_text(json.dumps(out))
    dist.barrier()
    return 0


def run(device: str = "cpu", repeats: int = 1, small: bool = False, threads: int | None = None,
        dtypes=("fp32", "bf16"), keep: str | None = None) -> dict:
    if device != "cpu":
        raise ValueError("the load suite measures host RSS on CPU ranks")

    cfg = get_preset(PRESET).dit
    world = 2
    with tempfile.TemporaryDirectory(prefix="bench_load_") as tmp:
        work = Path(tmp)
        weights = write_wan_file(Path(keep) if keep else work / "wan")
        make_demo_data(work / "data", count=1, frames=5, size=64, holdout=0)
        with torch.device("meta"):
            numels = {n: p.numel() for n, p in VideoDiT(cfg).named_parameters()}
        rows = []
        for dtype in dtypes:
            s = DTYPES[dtype].itemsize
            full_bytes = sum(numels.values()) * s
            shard = max(sum(numels[n] for n in g) for g in module_groups(numels)) * s
            job = job_of(str(weights), str(work / "data"), str(work / "out"), dtype)
            ds = ds_config(job, world, cuda=False)
            sizes = model_sizes(cfg, 32, DTYPES[dtype], WAN)
            res, _ = state_memory(sizes, Setting(3), world, ds, DTYPES[dtype], cuda=False)
            # set up after the DiT, the same for both paths: the LoRA adapters as peft makes them (fp32,
            # whole on every rank until initialize partitions them) and DeepSpeed's ZeRO-3 state
            # (reduce bucket, the adapters' fp32 master, gradient partition and Adam moments)
            zero3_buffers = sizes.lora * 4 + res.buffers + res.gradients + res.optimizer
            row = {"dtype": dtype, "file_gib": weights.stat().st_size / GiB, "full_model_gib": full_bytes / GiB,
                   "shard_gib": shard / GiB, "zero3_buffers_gib": zero3_buffers / GiB}
            for path in ("full", "partitioned"):
                spec = {"path": path, "dtype": dtype, "weights": str(weights), "data_dir": str(work / "data"),
                        "out_dir": str(work / "out"), "out": str(work / f"{path}_{dtype}")}
                ranks = launch_ranks("video_dit.bench.load", spec, world=world, workdir=work, threads=1)
                row[path] = {"peak_rss_gib": [r["after"]["VmHWM"] / GiB for r in ranks],
                             "overhead_gib": [r["before"]["VmRSS"] / GiB for r in ranks],
                             "setup_s": max(r["setup_s"] for r in ranks),
                             "partition_gib": [r["partition_bytes"] / GiB for r in ranks]}
                print(f"  {dtype} {path}: peak RSS per rank {', '.join(f'{v:.2f}' for v in row[path]['peak_rss_gib'])} "
                      f"GiB (process before loading {max(row[path]['overhead_gib']):.2f} GiB)", flush=True)
            p = row["partitioned"]
            target = [full_bytes / world / GiB + shard / GiB + o + zero3_buffers / GiB for o in p["overhead_gib"]]
            row["target_gib"] = target
            row["met"] = all(v <= t for v, t in zip(p["peak_rss_gib"], target))
            row["partitioned_vs_full"] = max(p["peak_rss_gib"]) / max(row["full"]["peak_rss_gib"])
            rows.append(row)
    return {"rows": rows, "world_size": world, "preset": PRESET, "met": all(r["met"] for r in rows),
            "partitioned_vs_full": max(r["partitioned_vs_full"] for r in rows)}


def print_table(res: dict) -> None:
    print(f"\nZeRO-3 set-up, {res['preset']} (original Wan single file, fp32), LoRA job, "
          f"{res['world_size']} CPU ranks: per-rank peak host RSS")
    print(f"{'model dtype':12}{'full load':>12}{'partitioned':>13}{'ratio':>7}{'target':>10}  target = full/N + shard + overhead")
    for r in res["rows"]:
        full, part = max(r["full"]["peak_rss_gib"]), max(r["partitioned"]["peak_rss_gib"])
        print(f"{r['dtype']:12}{full:>10.2f} G{part:>11.2f} G{part / full:>7.3f}{max(r['target_gib']):>8.2f} G  "
              f"= {r['full_model_gib']:.2f}/{res['world_size']} + {r['shard_gib']:.2f} + "
              f"({max(r['partitioned']['overhead_gib']):.2f} process + {r['zero3_buffers_gib']:.2f} LoRA + ZeRO-3 state)"
              f"  {'met' if r['met'] else 'NOT met'}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", choices=("fp32", "bf16", "both"), default="both")
    ap.add_argument("--keep", default=None, help="folder for the 5.7 GB weights file (kept, reused)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--_rank", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args._rank:
        return _rank_main(json.loads(Path(args._rank).read_text()))

    res = run(dtypes=("fp32", "bf16") if args.dtype == "both" else (args.dtype,), keep=args.keep)
    print_table(res)
    write_json(res, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
