"""Training-step benchmark: throughput, MFU and per-rank memory of the DiT's training step under
DeepSpeed ZeRO 0/2/3, block checkpointing on/off, the data path over cached latents, and on a GPU
the one-GPU jobs of the real Wan 2.1 1.3B.

    python -m video_dit.bench.train [--small] [--repeats 3] [--world-size 2] [--device cpu|cuda]
    python -m video_dit.bench.train --device cuda [--steps 4] [--budget S]      # the jobs (the default on cuda)
    python -m video_dit.bench.train --parts jobs --small --steps 2              # the jobs' CPU smoke path
    video-dit bench --suite train [--device cuda] [--steps N]

Parts: "zero", "activations", "cache" (1-3, the default on CPU) and "jobs" (4, the default on CUDA).

1. ZeRO: `world_size` ranks (CPU: gloo, OMP threads split between them) each build the same DiT
   and set it up with the trainer's own `video_dit.train.engine.initialize` (full fine-tune: its
   torch AdamW, LR schedule, clipping and DeepSpeed JSON for the stage), and time
   forward + backward + step of a flow-matching MSE step (median of `repeats` after a warm-up).
   tokens/s counts every data-parallel rank; MFU is the analytic DiT FLOPs (3x forward) per
   second per rank over the rank's peak (a dense matmul measured in the same process at the same
   threads on CPU; the datasheet table on known GPUs). After a step, one more step is taken apart:
   the bytes its forward leaves alive (the activations autograd saved), and, right after backward
   (when gradients are at their largest), every tensor of the model and the DeepSpeed optimizer,
   split by storage into parameters / gradients (incl. ZeRO's reduce buckets) / optimizer state
   (Adam moments + ZeRO's fp32 master partitions) / other; see `engine_memory_split`.
2. Checkpointing, at `layers` = 8 blocks: step time on / off alternating on one ZeRO-0 engine (the
   model flag is toggled between steps), and the activation peak of forward + backward of each in
   a fresh single process (gradient buffers pre-allocated, so only activations count).
3. Caching: the demo dataset is encoded with the tiny VAE and text encoder (epoch 1), then a
   second pass runs the same cache build (counting every VAE / text-encoder call) and a training
   epoch over `CachedDataset` + `BucketBatchSampler` + DataLoader, timing the data loading against
   the tiny DiT's step on the same batches.
4. Jobs (`JOBS`): the four one-GPU configurations measured on the H200 (LoRA r32 ZeRO-2 at 33x480x832;
   LoRA r32 ZeRO-2 + block checkpointing at 81x480x832; full fine-tune ZeRO-2 + checkpointing at
   33x480x832; LoRA r32 ZeRO-3 + checkpointing at 81x480x832), each in a fresh process (world size
   1) through the trainer's own set-up: a job parsed by `parse_job`, `build_dit` (ZeRO-3: partitioned),
   `make_trainable`, `engine.initialize`; the real 1.3B shape with random weights (the head given
   small weights, so every gradient is non-zero), the trainer's dtype (bf16 on a GPU), batch 1, a
   512-token text context, `flow_matching_loss` on random latents. Every step is timed and recorded
   (outliers show: one ZeRO-3 step once took 53 s between 6 s and 3.3 s; on CUDA each step's allocator
   counters are recorded beside it, `allocator_counts`, so an outlier says whether the caching allocator
   retried, i.e. freed its cache and synchronised); the figure is the median
   after the first (warm-up) step. Peak = `torch.cuda.max_memory_allocated` over the steps after the
   first (on CPU the allocation tracker's), beside the memory plan's prediction for the same job
   (`planned_peak`). MFU: 3x the analytic forward FLOPs (`dit_flops`) per second over the device's
   peak; the recomputation of checkpointing is not counted (it is work the job chose to redo), and
   neither is a LoRA job's saving of the frozen weights' gradients (counted as if computed).
   `--small`: the same four jobs on a 2-block DiT of width 64 at a few dozen tokens (a CPU smoke run).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from video_dit.bench.common import (
    launch_ranks,
    median,
    mfu,
    profiled_live_after,
    profiled_peak,
    run_json_subprocess,
    tensor_memory_split,
    time_side_by_side,
    write_json,
)
from video_dit.data import BucketBatchSampler, CachedDataset, DatasetConfig, build_cache, collate, scan_datasets
from video_dit.data.demo import make_demo_data
from video_dit.devices import device_peak, free_port, local_device, timed
from video_dit.diffusion.conditioning import masked_mse
from video_dit.diffusion.flow import add_noise, velocity_target
from video_dit.diffusion.objective import flow_matching_loss
from video_dit.families import get_preset
from video_dit.families.wan import FAMILY as WAN
from video_dit.families.wan.config import DiTConfig
from video_dit.families.wan.dit import VideoDiT, dit_flops
from video_dit.families.wan.loading import load_text_encoder
from video_dit.families.wan.vae import CausalVideoVAE
from video_dit.parallel.memory import CPUAllocationTracker
from video_dit.parallel.process import init_distributed, leave_distributed
from video_dit.parallel.zero import Distribution
from video_dit.train import plan as memory_plan
from video_dit.train.build import build_dit, make_trainable
from video_dit.train.config import NetworkConfig, parse_job
from video_dit.train.engine import initialize
from video_dit.train.precision import build_dtype, cast_for_training, train_dtype

# 8 blocks (the checkpointing target is stated at 8), small widths so 2 CPU ranks finish in minutes
FULL = dict(dim=384, heads=6, ffn_dim=1536, layers=8, latents=(16, 5, 24, 24), text_len=64, text_dim=256, batch=1)
SMALL = dict(dim=64, heads=4, ffn_dim=128, layers=8, latents=(16, 2, 8, 8), text_len=16, text_dim=32, batch=1)
STAGES = (0, 2, 3)
CACHE_FULL = dict(count=8, frames=17, size=64, batch=4)
CACHE_SMALL = dict(count=4, frames=5, size=64, batch=2)
MEMORY_KEYS = ("parameters", "gradients", "optimizer", "other")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


# ---------------------------------------------------------------- the step being measured


def dit_config(shape: dict):
    return DiTConfig(in_dim=shape["latents"][0], out_dim=shape["latents"][0], dim=shape["dim"],
                     ffn_dim=shape["ffn_dim"], freq_dim=256, text_dim=shape["text_dim"], num_heads=shape["heads"],
                     num_layers=shape["layers"], text_len=shape["text_len"])


def build_model(shape: dict, seed: int = 0):
    """The DiT with Wan's init, its zeroed output layer given small weights so every parameter gets
    a gradient from step one (a zero head would make the blocks' gradients exactly zero)."""
    torch.manual_seed(seed)
    model = VideoDiT(dit_config(shape))
    with torch.no_grad():
        model.head.head.weight.normal_(std=0.02)
    return model


def make_batch(shape: dict, seed: int, device, dtype=torch.float32) -> dict:
    """One flow-matching micro-batch: x_t, t on 0..1000, text context and the velocity target."""
    g = torch.Generator().manual_seed(seed)
    B = shape["batch"]
    x0 = torch.randn(B, *shape["latents"], generator=g)
    noise = torch.randn(x0.shape, generator=g)
    t = torch.rand(B, generator=g) * 1000
    context = torch.randn(B, shape["text_len"], shape["text_dim"], generator=g)
    batch = {"x_t": add_noise(x0, noise, t), "t": t, "context": context, "target": velocity_target(x0, noise)}
    return {k: v.to(device=device, dtype=dtype if v.is_floating_point() and k != "t" else v.dtype)
            for k, v in batch.items()}


def loss_of(model, batch: dict) -> torch.Tensor:
    """The trainer's loss: MSE of the predicted velocity, in float32."""
    return masked_mse(model(batch["x_t"], batch["t"], batch["context"]), batch["target"])


def step_flops(shape: dict) -> tuple[float, int]:
    """(analytic model FLOPs of one forward + backward micro-batch = 3 x forward, tokens in it)."""
    cfg = dit_config(shape)
    _, Fl, h, w = shape["latents"]
    pt, ph, pw = cfg.patch_size
    tokens = (Fl // pt) * (h // ph) * (w // pw)
    return 3.0 * dit_flops(cfg, tokens, shape["text_len"], shape["batch"]), tokens * shape["batch"]


def throughput(flops: float, tokens: int, step_s: float, dp_world: int, peak_flops: float) -> dict:
    """Per-step figures of one rank's step time: tokens/s over all data-parallel ranks, TFLOP/s per
    rank, MFU per rank."""
    return {"tokens_per_s": tokens * dp_world / step_s, "tflops_per_rank": flops / step_s / 1e12,
            "mfu": mfu(flops, step_s, peak_flops)}


def trainer_job(stage: int, data_dir: str, out_dir: str, checkpointing: bool = False):
    """A minimal job of the real trainer (`video_dit.train.config`): full fine-tune, batch 1, AdamW,
    clipping at 1.0, ZeRO `stage`. Only its DeepSpeed and optimizer settings are used here; the
    dataset entry (a folder with one demo clip) is there because a job must name one."""
    return parse_job({"job": "extension", "config": {"name": "bench_train", "process": [{
        "type": "sd_trainer", "training_folder": out_dir,
        "datasets": [{"folder_path": data_dir, "num_frames": 5, "resolution": [64]}],
        "train": {"batch_size": 1, "steps": 1000, "lr": 1e-4, "dtype": "bf16", "max_grad_norm": 1.0,
                  "gradient_checkpointing": checkpointing},
        "model": {"name_or_path": "preset:tiny"},
        "deepspeed": {"zero_stage": stage}}]}}, source="video_dit.bench.train")


# ---------------------------------------------------------------- memory split of an engine


def _named_tensors(obj, prefix: str, depth: int = 3):
    """(attribute path, tensor) for tensors held directly, or in lists / tuples / dicts, by `obj`'s
    attributes (not inside other objects: those are the model, the process groups, ...)."""
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
        return
    if depth == 0:
        return
    if isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _named_tensors(v, f"{prefix}[{i}]", depth - 1)
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _named_tensors(v, f"{prefix}[{k!r}]", depth - 1)


def engine_memory_split(engine) -> dict:
    """Bytes this rank holds for the engine, by category, each storage counted once (first match in
    this order): parameters (the module's parameters, ZeRO-3's `ds_tensor` partitions), gradients
    (`.grad` of parameters and of the optimizer's partitions, and every tensor in an attribute of
    the ZeRO optimizer named like a gradient or a reduce bucket: *grad*, *ipg*), optimizer (the
    inner torch optimizer's state and parameters, and ZeRO attributes named *fp32* / *master*: the
    fp32 master partitions DeepSpeed keeps even when training in fp32), other (any other tensor
    the ZeRO optimizer holds). `attributes` lists which attribute went where."""
    module, opt = engine.module, engine.optimizer
    inner = getattr(opt, "optimizer", opt)  # ZeRO wraps a torch optimizer; stage 0 is the torch one
    params, grads = [], []
    for p in module.parameters():
        params.append(p)
        if hasattr(p, "ds_tensor"):  # ZeRO-3: p.data is empty outside forward, the shard lives here
            params.append(p.ds_tensor)
        if p.grad is not None:
            grads.append(p.grad)
    master = [p for group in inner.param_groups for p in group["params"]]
    grads += [p.grad for p in master if p.grad is not None]
    state = [t for s in inner.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    grad_attrs, other_attrs, master_attrs = {}, {}, []
    if opt is not inner:
        for name, value in vars(opt).items():
            if value is inner or isinstance(value, torch.nn.Module):
                continue
            found = list(_named_tensors(value, name))
            if not found:
                continue
            if re.search(r"grad|ipg", name, re.IGNORECASE):
                grad_attrs[name] = [t for _, t in found]
            elif re.search(r"fp32|master", name, re.IGNORECASE):  # ZeRO's fp32 master partitions
                master += [t for _, t in found]
                master_attrs.append(name)
            else:
                other_attrs[name] = [t for _, t in found]
    split = tensor_memory_split({
        "parameters": params,
        "gradients": grads + [t for ts in grad_attrs.values() for t in ts],
        "optimizer": state + master,
        "other": [t for ts in other_attrs.values() for t in ts],
    })
    split["attributes"] = {"gradients": sorted(grad_attrs), "optimizer": sorted(master_attrs),
                           "other": sorted(other_attrs)}
    return split


# ---------------------------------------------------------------- rank worker (ZeRO stages, checkpointing)


def _measure_stage(shape: dict, stage: int, repeats: int, device, dtype, rank: int, checkpointing: bool,
                   data_dir: str, out_dir: str) -> dict:
    # the trainer's set-up: its cast (a full fine-tune: float32 master weights computing in `dtype`),
    # optimizer (torch AdamW, fused on CUDA), LR schedule and DeepSpeed JSON
    model = cast_for_training(build_model(shape).to(device=device).train(), dtype, WAN.arch)
    job = trainer_job(stage, data_dir, out_dir)
    engine, optimizer, _ = initialize(model, job, dist.get_world_size())
    batch = make_batch(shape, seed=1 + rank, device=device, dtype=dtype)

    def step():
        engine.backward(loss_of(engine, batch))
        engine.step()

    out: dict = {"step_s_all": time_side_by_side({"step": step}, repeats, device)["step"]}
    out["step_s"] = median(out["step_s_all"])
    # one more step, taken apart: saved activations after forward, the split after backward
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        loss = loss_of(engine, batch)
        saved = torch.cuda.memory_allocated(device) - base
    else:
        loss, saved = profiled_live_after(lambda: loss_of(engine, batch))
    engine.backward(loss)
    out["memory"] = engine_memory_split(engine)
    out["memory"]["activations_saved"] = int(saved)
    engine.step()
    if checkpointing:  # on / off alternating on this engine: the same weights, optimizer and data
        def toggled(on: bool):
            def run():
                (engine.module.enable_gradient_checkpointing if on else engine.module.disable_gradient_checkpointing)()
                step()
            return run
        times = time_side_by_side({"off": toggled(False), "on": toggled(True)}, repeats, device)
        engine.module.disable_gradient_checkpointing()
        out["checkpointing"] = {"step_s": {k: median(v) for k, v in times.items()}, "step_s_all": times}
    engine.destroy()
    del engine, model, optimizer
    gc.collect()
    return out


def _rank_main(spec: dict) -> int:
    import deepspeed

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(spec["threads"])
    cuda = spec["device"].startswith("cuda")
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dtype = DTYPES[spec["dtype"]]
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
    res = {"rank": rank, "world_size": world, "threads": torch.get_num_threads(), "dtype": str(dtype),
           "peak": device_peak(device, dtype).as_dict(), "zero": {}}
    for stage in spec["stages"]:
        res["zero"][str(stage)] = _measure_stage(spec["shape"], stage, spec["repeats"], device, dtype, rank,
                                                 checkpointing=stage == 0, data_dir=spec["data_dir"],
                                                 out_dir=spec["out_dir"])
        dist.barrier()
    Path(spec["out"]).with_suffix(f".rank{rank}.json").write_text(json.dumps(res))
    dist.barrier()
    dist.destroy_process_group()
    return 0


def run_ranks(shape: dict, stages, repeats: int, world_size: int, device: str, threads: int, workdir: Path,
              dtype: str) -> list:
    """Start `world_size` rank processes of `_rank_main` and return their results (rank order)."""
    make_demo_data(workdir / "job_data", count=1, frames=5, size=64, holdout=0)  # the job must name a dataset
    spec = {"shape": shape, "stages": list(stages), "repeats": repeats, "device": device, "dtype": dtype,
            "threads": max(1, threads // world_size) if device == "cpu" else threads, "out": str(workdir / "ranks"),
            "data_dir": str(workdir / "job_data"), "out_dir": str(workdir / "job_out")}
    return launch_ranks("video_dit.bench.train", spec, world_size, workdir, threads=spec["threads"], hide_cuda=False)


# ---------------------------------------------------------------- activation peak, checkpointing on/off


def _activation_main(shape: dict, checkpointing: bool, device: str) -> dict:
    """In this (fresh) process: the forward's saved activations and the forward + backward peak."""
    cuda = device.startswith("cuda")
    dtype = torch.bfloat16 if cuda else torch.float32
    model = cast_for_training(build_model(shape).to(device=device).train(), dtype, WAN.arch)  # as the trainer stores it
    if checkpointing:
        model.enable_gradient_checkpointing()
    batch = make_batch(shape, seed=1, device=device, dtype=dtype)

    def step():
        loss_of(model, batch).backward()

    step()  # warm-up; leaves the .grad buffers allocated, so backward adds into them
    model.zero_grad(set_to_none=False)
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        loss = loss_of(model, batch)
        saved = torch.cuda.memory_allocated() - base
        loss.backward()
        torch.cuda.synchronize()
        return {"saved": saved, "peak": torch.cuda.max_memory_allocated() - base}
    _, saved = profiled_live_after(lambda: loss_of(model, batch))
    return {"saved": saved, "peak": profiled_peak(step)}


def activation_figures(shape: dict, device: str, threads: int, small: bool) -> dict:
    out = {}
    for ckpt in (False, True):
        args = ["-m", "video_dit.bench.train", "--_activation", "on" if ckpt else "off", "--device", device,
                "--threads", str(threads)] + (["--small"] if small else [])
        out["on" if ckpt else "off"] = run_json_subprocess(args, what="activation")
    return out


# ---------------------------------------------------------------- caching


def cache_figures(small: bool, repeats: int, workdir: Path) -> dict:
    """Epoch 1 builds the caches; epoch 2 re-runs the cache build (every VAE and text-encoder call
    counted) and trains one epoch of the tiny DiT over the cached batches, timing the loading."""
    c = CACHE_SMALL if small else CACHE_FULL
    preset = get_preset("tiny")
    make_demo_data(workdir / "demo", count=c["count"], frames=c["frames"], size=c["size"], holdout=0)
    cfg = DatasetConfig(folder_path=str(workdir / "demo"), num_frames=c["frames"], resolution=[c["size"]], fps=16)
    cfg.validate("datasets[0]")
    scan = scan_datasets([cfg], preset.divisibility, verbose=False)
    torch.manual_seed(0)
    vae = CausalVideoVAE(preset.vae).eval().requires_grad_(False)
    text_encoder = load_text_encoder("preset:tiny")
    calls = {"vae": 0, "text": 0}

    def encode_fn(video):
        calls["vae"] += 1
        return {"latents": vae.normalize(vae.encode(video).mode()).float()}

    def text_fn(captions):
        calls["text"] += len(captions)
        return [e.float() for e in text_encoder.encode(captions)]

    spaces = dict(space_version="bench-train-cache", text_space_version="bench-train-cache-text")
    t0 = time.perf_counter()
    first = build_cache(scan, encode_fn, text_fn, verbose=False, **spaces)
    epoch1 = {"s": time.perf_counter() - t0, "vae_calls": calls["vae"], "text_calls": calls["text"],
              "latent_misses": first.misses, "text_misses": first.text_misses}
    calls.update(vae=0, text=0)
    t0 = time.perf_counter()
    second = build_cache(scan, encode_fn, text_fn, verbose=False, **spaces)
    epoch2 = {"cache_check_s": time.perf_counter() - t0, "vae_calls": calls["vae"], "text_calls": calls["text"],
              "latent_misses": second.misses, "text_misses": second.text_misses, "latent_hits": second.hits,
              "text_hits": second.text_hits}

    dataset = CachedDataset(scan, **spaces)
    sampler = BucketBatchSampler(dataset, c["batch"], seed=0)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, collate_fn=collate, num_workers=0)
    torch.manual_seed(0)

    dit = VideoDiT(preset.dit).train()
    optimizer = torch.optim.AdamW(dit.parameters(), lr=1e-4)

    def train_step(batch):
        x0 = batch["latents"]
        noise = torch.randn_like(x0)
        t = torch.rand(x0.shape[0]) * 1000
        loss = masked_mse(dit(add_noise(x0, noise, t), t, batch["text_embeds"]), velocity_target(x0, noise))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    load_s, step_s = [], []
    for epoch in range(1, 1 + max(1, repeats)):  # epoch 0 was the caching pass
        sampler.set_epoch(epoch)
        dataset.set_epoch(epoch)
        it = iter(loader)
        while True:
            t0 = time.perf_counter()
            batch = next(it, None)
            t1 = time.perf_counter()
            if batch is None:
                break
            train_step(batch)
            load_s.append(t1 - t0)
            step_s.append(time.perf_counter() - t1)
    epoch2.update(batches=len(load_s), load_s=sum(load_s), step_s=sum(step_s),
                  load_fraction=sum(load_s) / (sum(load_s) + sum(step_s)),
                  median_load_s=median(load_s), median_step_s=median(step_s))
    return {"config": {**c, "preset": "tiny", "latent_shape": list(dataset[0]["latents"].shape)},
            "epoch1": epoch1, "epoch2": epoch2}


# ---------------------------------------------------------------- one-GPU jobs of the real 1.3B model

JOB_PRESET = "wan2.1-t2v-1.3b"
JOB_TEXT_LEN = 512  # umT5's context length, as the trainer pads it
JOBS = (
    dict(name="LoRA r32, ZeRO-2, 33x480x832", lora=32, zero=2, ckpt=False, bucket=(33, 480, 832)),
    dict(name="LoRA r32, ZeRO-2, checkpointing, 81x480x832", lora=32, zero=2, ckpt=True, bucket=(81, 480, 832)),
    dict(name="full, ZeRO-2, checkpointing, 33x480x832", lora=None, zero=2, ckpt=True, bucket=(33, 480, 832)),
    dict(name="LoRA r32, ZeRO-3, checkpointing, 81x480x832", lora=32, zero=3, ckpt=True, bucket=(81, 480, 832)),
)
# --small: the same jobs on a 2-block DiT of width 64 (text 16 x 32) at 9x64x64 / 17x64x64 (48 / 80 tokens)
SMALL_JOB_DIT = dict(dim=64, ffn_dim=128, num_heads=2, num_layers=2, text_dim=32, text_len=16)
SMALL_BUCKETS = {(33, 480, 832): (9, 64, 64), (81, 480, 832): (17, 64, 64)}
STEPS = 4  # per job: 1 warm-up + 3 timed
JOB_TIMEOUT_S = 180.0  # per job, without a budget
JOB_FLOOR_S = 15.0  # with a budget: kept back for each job still to run (its start-up and build, ~15-20 s)
JOBS_BUDGET_S = 180.0  # the jobs' default budget on a GPU (the issue's ~3 minutes; ~2 expected on an H200)
FLOPS_CONVENTION = ("3x the analytic forward FLOPs (dit_flops: matmuls + attention) per step; the recomputation "
                    "of block checkpointing not counted; a LoRA job's frozen-weight gradients counted as if computed")


def job_spec(job: dict, small: bool) -> dict:
    """The DiT config, latent grid, tokens and text length of a job (`JOBS`), full size or --small."""
    preset = get_preset(JOB_PRESET)
    cfg = dataclasses.replace(preset.dit, **SMALL_JOB_DIT) if small else preset.dit
    f, h, w = SMALL_BUCKETS[tuple(job["bucket"])] if small else job["bucket"]
    t, sp = preset.vae.temporal_compression, preset.vae_spatial
    grid = ((f - 1) // t + 1, h // sp, w // sp)  # pixels -> latents (F', h, w)
    pt, ph, pw = cfg.patch_size
    return {"config": cfg, "grid": grid, "tokens": (grid[0] // pt) * (grid[1] // ph) * (grid[2] // pw),
            "text_len": cfg.text_len, "pixels": [f, h, w]}


def job_config(job: dict, data_dir: str, out_dir: str):
    """The trainer job of `job`: batch 1, AdamW, clipping at 1.0, bf16 (the trainer's float32 on CPU ranks)."""
    parsed = parse_job({"job": "extension", "config": {"name": "bench_train_job", "process": [{
        "type": "sd_trainer", "training_folder": out_dir,
        "datasets": [{"folder_path": data_dir, "num_frames": 5, "resolution": [64]}],  # a job must name one
        "train": {"batch_size": 1, "steps": 1000, "lr": 1e-4, "dtype": "bf16", "max_grad_norm": 1.0,
                  "gradient_checkpointing": job["ckpt"]},
        "model": {"name_or_path": f"preset:{JOB_PRESET}"},
        "deepspeed": {"zero_stage": job["zero"]}}]}}, source="video_dit.bench.train")
    if job["lora"]:
        # the config refuses LoRA on a preset's random init (it would train nothing: the head is zero); what
        # is measured here is its cost, so the network is set after that check and the head given weights
        parsed.process.network = NetworkConfig(linear=job["lora"], linear_alpha=job["lora"])
        parsed.process.network.validate("network")
    return parsed


def planned_peak(cfg, grid, job, dtype: torch.dtype, cuda: bool, ds: dict) -> dict:
    """The memory plan's per-rank peak for `job` at world size 1 (`video_dit.train.plan.predict`): the one
    call of the planner here, so a change of its signature is one edit. {"bytes", "phase"} or {"error"}."""
    try:
        pred = memory_plan.predict(cfg, grid, memory_plan.setting_of(job), world=1,
                                   lora_rank=job.process.network.linear if job.process.network else None,
                                   dtype=dtype, ds=ds, cuda=cuda, family=WAN, inputs={"per_token": False, "lora_img_emb": False})
        return {"bytes": int(pred.device_bytes), "phase": pred.phase}
    except Exception as exc:  # noqa: BLE001 - the measurement stands without the prediction
        return {"error": f"{type(exc).__name__}: {exc}"[:300]}


ALLOCATOR_COUNTS = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams")


def allocator_counts(device: torch.device) -> dict[str, int]:
    """The CUDA caching allocator's counters (`torch.cuda.memory_stats`): retries after a failed cudaMalloc
    (each one frees the cache and synchronises), cudaMalloc / cudaFree calls, whole-device syncs. Empty on
    the CPU."""
    if device.type != "cuda":
        return {}
    stats = torch.cuda.memory_stats(device)
    return {k: int(stats.get(k, 0)) for k in ALLOCATOR_COUNTS}


def _job_main(spec: dict) -> int:
    """One job in this fresh process (world size 1): build, set up, `spec["steps"]` timed steps. The
    record is rewritten to `spec["out"]` after each phase and step, so a job stopped by its timeout
    still reports the steps it finished."""
    out = Path(spec["out"])
    rec: dict = {"phase": "start", "step_s_all": [], "loss": []}

    def save(phase: str) -> None:
        rec["phase"] = phase
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(rec))
        tmp.replace(out)

    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    init_distributed(600)
    device = local_device()
    cuda = device.type == "cuda"
    tracker = None if cuda else CPUAllocationTracker().__enter__()  # CPU: every storage from here on
    job = job_config(spec["job"], spec["data_dir"], spec["out_dir"])
    js = job_spec(spec["job"], spec["small"])
    cfg, grid = js["config"], tuple(js["grid"])
    dtype = train_dtype(job.process.train.dtype)
    distribution = Distribution.of(job, 1)
    rec["planned"] = planned_peak(cfg, grid, job, dtype, cuda, distribution.config)
    rec["dtype"] = str(dtype).removeprefix("torch.")
    rec["peak"] = device_peak(device, dtype, n=512 if spec["small"] else None).as_dict()
    save("build")

    t0 = time.perf_counter()
    dit = build_dit(f"preset:{JOB_PRESET}", None, zero_stage=distribution.stage,
                    dtype=build_dtype(dtype, lora=job.process.network is not None), device=device, seed=0,
                    ds_config=distribution.config, config=cfg, family=WAN)
    head = dit.head.head.weight
    with torch.no_grad(), distribution.gathered([head], modifier_rank=0):  # Wan's zero head: no gradient at all
        head.copy_(torch.randn(head.shape, generator=torch.Generator().manual_seed(0)) * 0.02)
    make_trainable(dit, job.process, dtype, family=WAN).train()
    rec["build_s"] = time.perf_counter() - t0
    engine, _, _ = initialize(dit, job, 1, distribution=distribution)
    rec["setup_s"] = time.perf_counter() - t0
    rec["trainable_params"] = sum(getattr(p, "ds_numel", p.numel()) for p in dit.parameters() if p.requires_grad)
    g = torch.Generator().manual_seed(1)
    x0 = torch.randn(1, cfg.in_dim, *grid, generator=g).to(device)
    noise = torch.randn(x0.shape, generator=g).to(device)
    t = (torch.rand(1, generator=g) * 1000).to(device)
    context = [torch.randn(js["text_len"], cfg.text_dim, generator=g).to(device)]  # the cache's float32 embeds
    save("steps")

    losses = []

    def step():
        loss = flow_matching_loss(engine, x0, context, t, noise)
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach())

    for i in range(spec["steps"]):
        before = allocator_counts(device)
        rec["step_s_all"].append(timed(step, device))
        rec["loss"].append(float(losses[-1]))
        if cuda:  # what the caching allocator did in this step: a slow step with retries was the allocator's
            after = allocator_counts(device)
            rec.setdefault("allocator", []).append({k: after[k] - before[k] for k in after})
        if i == 0:  # the peak over the steps after the first, from what lives now (as the H200 rows)
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
            else:
                tracker.peak = tracker.live
        save("steps")
    rec["peak_bytes"] = int(torch.cuda.max_memory_allocated(device) if cuda else tracker.peak)
    rec["allocated_after_bytes"] = int(torch.cuda.memory_allocated(device) if cuda else tracker.live)
    if tracker is not None:
        tracker.__exit__(None, None, None)
    engine.destroy()
    save("done")
    leave_distributed()
    return 0


def _run_job_process(spec: dict, workdir: Path, timeout: float, threads: int | None) -> tuple[dict, float]:
    """Run `_job_main` in a fresh process (world size 1), killed after `timeout` seconds; (its record, seconds)."""
    spec_path = workdir / f"{Path(spec['out']).stem}.spec.json"
    spec_path.write_text(json.dumps(spec))
    log_path = workdir / f"{Path(spec['out']).stem}.log"
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        # in this process's group: whoever stops the suite by its group (gpu_check) stops the job too
        proc = subprocess.Popen([sys.executable, "-m", "video_dit.bench.train", "--_job", str(spec_path)],
                                env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()  # it starts no process of its own
            proc.wait()
            code = None
    wall = time.perf_counter() - t0
    out = Path(spec["out"])
    rec = json.loads(out.read_text()) if out.exists() else {"phase": "start", "step_s_all": []}
    if code is None:
        rec["error"] = f"timed out after {timeout:.0f} s, during {rec['phase']} (steps done: {len(rec['step_s_all'])})"
    elif code != 0:
        rec["error"] = f"exit {code}: " + log_path.read_text()[-2000:]
    return rec, wall


def outlier_text(o: dict) -> str:
    """`step 2 (allocator: 3 retries, 41 cudaMalloc, 40 cudaFree, 3 syncs)`; the step alone on the CPU."""
    a = o.get("allocator")
    if not a:
        return f"step {o['step']}"
    return (f"step {o['step']} (allocator: {a['num_alloc_retries']} retries, {a['num_device_alloc']} cudaMalloc, "
            f"{a['num_device_free']} cudaFree, {a['num_sync_all_streams']} syncs)")


def job_row(job: dict, rec: dict, small: bool, peak_flops: float | None) -> dict:
    """The figures of one job from its process's record: median step after the first, tokens/s, MFU,
    measured and planned peak, and every step's time with the outliers (> 2x the median) named."""
    js = job_spec(job, small)
    flops = 3.0 * dit_flops(js["config"], js["tokens"], js["text_len"])
    row = {"name": job["name"], "lora_rank": job["lora"], "zero_stage": job["zero"], "checkpointing": job["ckpt"],
           "pixels": js["pixels"], "latent_grid": list(js["grid"]), "tokens": js["tokens"], "flops_per_step": flops,
           **{k: rec[k] for k in ("step_s_all", "loss", "build_s", "setup_s", "trainable_params", "dtype", "planned",
                                  "peak_bytes", "allocated_after_bytes", "allocator", "error", "wall_s")
                                  if k in rec}}
    steps = rec.get("step_s_all", [])
    if len(steps) >= 2:
        step_s = median(steps[1:])
        row.update(step_s=step_s, tokens_per_s=js["tokens"] / step_s, tflops=flops / step_s / 1e12)
        if peak_flops:  # the job process's own (the datasheet's on a known GPU; a matmul it measured on CPU)
            row.update(peak_flops=peak_flops, mfu=mfu(flops, step_s, peak_flops))
        per_step = rec.get("allocator", [])
        row["outliers"] = [{"step": i, "s": s, **({"allocator": per_step[i]} if i < len(per_step) else {})}
                           for i, s in enumerate(steps) if i > 0 and s > 2 * step_s]
    planned = rec.get("planned", {})
    if "peak_bytes" in rec and "bytes" in planned:
        row["planned_over_measured"] = planned["bytes"] / rec["peak_bytes"]
    return row


def run_jobs(small: bool, steps: int, workdir: Path, budget_s: float | None = None,
             job_timeout_s: float = JOB_TIMEOUT_S, threads: int | None = None, only=None) -> dict:
    """Every job of `JOBS` (or the indices `only`) in turn, each in its own process. With `budget_s`,
    a job may take what is left of it less `JOB_FLOOR_S` for each job after it (at most
    `job_timeout_s`), so the suite ends within its budget and reports what it measured (a job cut off
    keeps the steps it finished)."""
    if steps < 2:
        raise ValueError(f"--steps must be >= 2 (a warm-up step, then timed ones), got {steps}")
    start = time.perf_counter()
    make_demo_data(workdir / "job_data", count=1, frames=5, size=64, holdout=0)  # a job must name a dataset
    picked = [JOBS[i] for i in only] if only else list(JOBS)
    rows, peak = [], None
    for k, job in enumerate(picked):
        timeout = job_timeout_s
        if budget_s is not None:
            left = budget_s - (time.perf_counter() - start)
            timeout = min(timeout, left - JOB_FLOOR_S * (len(picked) - k - 1))
        if timeout < 5:
            rows.append({"name": job["name"], "error": "skipped: no time left of the suite's budget"})
            continue
        spec = {"job": job, "small": small, "steps": steps, "out": str(workdir / f"job{k}.json"),
                "data_dir": str(workdir / "job_data"), "out_dir": str(workdir / "job_out"), "threads": threads}
        rec, wall = _run_job_process(spec, workdir, timeout, threads)
        rec["wall_s"] = wall
        peak = peak or rec.get("peak")
        rows.append(job_row(job, rec, small, (rec.get("peak") or {}).get("flops")))
        r = rows[-1]
        print(f"  {job['name']}: " + (f"{r['step_s']:.3f} s/step" if "step_s" in r else "no timed step")
              + (f", error: {r['error'].splitlines()[0]}" if "error" in r else "") + f" ({wall:.0f} s)", flush=True)
    return {"jobs": rows, "peak": peak, "steps": steps, "flops_convention": FLOPS_CONVENTION,
            "model": f"preset:{JOB_PRESET}" + (" at --small widths" if small else ""), "world_size": 1,
            "budget_s": budget_s, "wall_s": time.perf_counter() - start}


def print_jobs(res: dict) -> None:
    gib = 2 ** 30
    peak = res.get("peak") or {}
    print(f"One-GPU jobs, {res['model']}, world size 1, {res['steps']} steps each (the first a warm-up; median of "
          f"the rest); MFU over {peak.get('flops', float('nan')) / 1e12:.3g} TFLOP/s ({peak.get('source', '-')}), "
          f"{res['flops_convention']}")
    print(f"{'job':46}{'tokens':>8}{'s/step':>9}{'tok/s':>9}{'MFU':>7}{'planned':>10}{'measured':>10}{'p/m':>7}"
          "   steps s")
    for r in res["jobs"]:
        if "step_s" not in r:
            print(f"{r['name']:46}failed: {r.get('error', 'no step timed').splitlines()[0][:120]}")
            continue
        planned = r.get("planned", {})
        pl = f"{planned['bytes'] / gib:8.2f} G" if "bytes" in planned else f"{'-':>10}"
        me = f"{r['peak_bytes'] / gib:8.2f} G" if "peak_bytes" in r else f"{'-':>10}"
        pm = f"{r['planned_over_measured']:7.3f}" if "planned_over_measured" in r else f"{'-':>7}"
        mf = f"{r['mfu']:7.1%}" if "mfu" in r else f"{'-':>7}"
        steps = ", ".join(f"{s:.2f}" for s in r["step_s_all"])
        print(f"{r['name']:46}{r['tokens']:8d}{r['step_s']:9.3f}{r['tokens_per_s']:9.0f}{mf}{pl}{me}{pm}   {steps}"
              + (f"  outliers: {', '.join(outlier_text(o) for o in r['outliers'])}" if r["outliers"] else "")
              + (f"  ({r['error'].splitlines()[0][:80]})" if "error" in r else ""))
        if "error" in planned:
            print(f"{'':46}plan: {planned['error']}")


# ---------------------------------------------------------------- the suite


PARTS = ("zero", "activations", "cache", "jobs")


def default_parts(device: str) -> tuple[str, ...]:
    """On a GPU the one-GPU jobs; on CPU the ZeRO, checkpointing and caching parts."""
    return ("jobs",) if device.startswith("cuda") else ("zero", "activations", "cache")


def run(device: str = "cpu", repeats: int = 3, small: bool = False, threads: int | None = None,
        world_size: int = 2, stages=STAGES, parts=None, dtype: str | None = None, steps: int = STEPS,
        budget_s: float | None = None, only=None) -> dict:
    """parts: a subset of `PARTS` (default: `default_parts(device)`). dtype: the ZeRO runs' training
    dtype, "fp32" or "bf16" (default: bf16 on CUDA, fp32 on CPU; the jobs train in the trainer's own).
    On CPU fp32, DeepSpeed's ZeRO 1-3 keep an fp32 master copy of the partition that ZeRO-0 does
    not, so the ZeRO-3 / ZeRO-0 state ratio cannot fall below 10/16; in bf16 (as on GPU) both
    stages keep fp32 master weights and the ratio is the partitioning's own. steps, budget_s, only:
    the jobs' steps each, the seconds they may take in all (default on CUDA: `JOBS_BUDGET_S`), and
    which of `JOBS` (indices)."""
    parts = tuple(parts or default_parts(device))
    bad = sorted(set(parts) - set(PARTS))
    if bad:
        raise ValueError(f"train bench parts {', '.join(bad)}; accepted: {', '.join(PARTS)}")
    if "jobs" in parts and device.startswith("cuda") != torch.cuda.is_available():
        raise ValueError(f"the jobs run on this machine's device ({'cuda' if torch.cuda.is_available() else 'cpu'}, "
                         f"as the trainer's ranks do), not --device {device}")
    dtype = dtype or ("bf16" if device.startswith("cuda") else "fp32")
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}; accepted: {', '.join(DTYPES)}")
    if threads:
        torch.set_num_threads(threads)
    threads = torch.get_num_threads()
    shape = SMALL if small else FULL
    notes = []
    if "zero" in parts and device.startswith("cuda") and torch.cuda.device_count() < world_size:
        notes.append(f"{world_size} ranks asked, {torch.cuda.device_count()} GPU(s) present: ran "
                     f"{torch.cuda.device_count()} rank(s), so ZeRO partitions over that many")
        world_size = torch.cuda.device_count()
    flops, tokens = step_flops(shape)
    res: dict = {"config": {"parts": list(parts), "device": device, "threads_total": threads, "repeats": repeats,
                            "notes": notes}}
    if "zero" in parts or "activations" in parts:  # the shape those parts measure
        res["config"].update(**shape, tokens=tokens, world_size=world_size, stages=list(stages), flops_per_step=flops,
                             dtype=str(DTYPES[dtype]).removeprefix("torch."))
    with tempfile.TemporaryDirectory(prefix="video_dit_bench_train_") as tmp:
        tmp = Path(tmp)
        if "zero" in parts:
            ranks = run_ranks(shape, stages, repeats, world_size, device, threads, tmp, dtype)
            res["config"]["threads_per_rank"] = ranks[0]["threads"]
            res["peak"] = ranks[0]["peak"]
            res["zero"] = {}
            for stage in map(str, stages):
                per_rank = [r["zero"][stage] for r in ranks]
                step_s = max(r["step_s"] for r in per_rank)  # the step ends when the slowest rank ends
                mem = {k: max(r["memory"][k] for r in per_rank) for k in (*MEMORY_KEYS, "activations_saved")}
                mem["param_grad_optimizer"] = max(sum(r["memory"][k] for k in MEMORY_KEYS[:3]) for r in per_rank)
                res["zero"][stage] = {"step_s": step_s, **throughput(flops, tokens, step_s, world_size,
                                                                     ranks[0]["peak"]["flops"]),
                                      "memory_max_over_ranks": mem,
                                      "memory_per_rank": [r["memory"] for r in per_rank],
                                      "step_s_per_rank": [r["step_s_all"] for r in per_rank]}
            if "0" in res["zero"] and "3" in res["zero"]:
                z0 = res["zero"]["0"]["memory_max_over_ranks"]["param_grad_optimizer"]
                z3 = res["zero"]["3"]["memory_max_over_ranks"]["param_grad_optimizer"]
                res["zero3_vs_zero0_state"] = z3 / z0
            if "0" in res["zero"]:
                ck = [r["zero"]["0"]["checkpointing"] for r in ranks]
                on, off = max(c["step_s"]["on"] for c in ck), max(c["step_s"]["off"] for c in ck)
                res["checkpointing"] = {"step_s": {"on": on, "off": off}, "time_ratio": on / off}
        if "activations" in parts:
            act = activation_figures(shape, device, threads, small)
            res.setdefault("checkpointing", {})["activation_bytes"] = act
            res["checkpointing"]["peak_ratio"] = act["on"]["peak"] / act["off"]["peak"]
            res["checkpointing"]["saved_ratio"] = act["on"]["saved"] / act["off"]["saved"]
        if "cache" in parts:
            res["cache"] = cache_figures(small, repeats, tmp)
        if "jobs" in parts:
            cuda = device.startswith("cuda")
            res["jobs"] = run_jobs(small, steps, tmp, JOBS_BUDGET_S if budget_s is None and cuda else budget_s,
                                   threads=None if cuda else threads, only=only)
    return res


def print_table(res: dict) -> None:
    c, mib = res["config"], 2 ** 20
    if "jobs" in res:
        print_jobs(res["jobs"])
    if "zero" in res:
        print(f"Training step, DiT dim {c['dim']}, {c['layers']} blocks, {c['tokens']} tokens x batch {c['batch']}, "
              f"{c['dtype']}, {c['device']}, {c['world_size']} ranks x {c.get('threads_per_rank')} threads, "
              f"median of {c['repeats']}; peak {res['peak']['flops'] / 1e12:.3f} TFLOP/s ({res['peak']['source']})")
        print(f"{'ZeRO':6}{'step s':>9}{'tok/s':>10}{'MFU':>8}{'params':>10}{'grads':>10}{'optim':>10}{'other':>10}"
              f"{'p+g+o':>10}{'act':>10}   (MiB per rank, max over ranks)")
        for stage, z in res["zero"].items():
            m = z["memory_max_over_ranks"]
            print(f"{stage:6}{z['step_s']:9.3f}{z['tokens_per_s']:10.1f}{z['mfu']:8.1%}"
                  + "".join(f"{m[k] / mib:10.1f}" for k in (*MEMORY_KEYS, "param_grad_optimizer", "activations_saved")))
        if "zero3_vs_zero0_state" in res:
            print(f"ZeRO-3 / ZeRO-0 param+grad+optimizer bytes per rank: {res['zero3_vs_zero0_state']:.3f} "
                  "(target <= 0.55)")
    ck = res.get("checkpointing", {})
    if ck:
        parts = []
        if "time_ratio" in ck:
            parts.append(f"step {ck['step_s']['on']:.3f}s / {ck['step_s']['off']:.3f}s = {ck['time_ratio']:.3f} "
                         "(target <= 1.35)")
        if "peak_ratio" in ck:
            a = ck["activation_bytes"]
            parts.append(f"activation peak {a['on']['peak'] / mib:.1f} / {a['off']['peak'] / mib:.1f} MiB = "
                         f"{ck['peak_ratio']:.3f} (target <= 0.3); saved {ck['saved_ratio']:.3f}")
        print(f"Block checkpointing on/off at {c['layers']} blocks: " + "; ".join(parts))
    if "cache" in res:
        e1, e2, cc = res["cache"]["epoch1"], res["cache"]["epoch2"], res["cache"]["config"]
        print(f"Caching ({cc['count']} demo clips, {cc['frames']} x {cc['size']}^2, tiny preset, batch {cc['batch']}): "
              f"epoch 1 {e1['vae_calls']} VAE + {e1['text_calls']} text-encoder calls in {e1['s']:.2f}s; "
              f"epoch 2 {e2['vae_calls']} VAE + {e2['text_calls']} text-encoder calls, data loading "
              f"{e2['load_fraction']:.2%} of step time ({e2['median_load_s'] * 1e3:.2f} ms load vs "
              f"{e2['median_step_s'] * 1e3:.1f} ms step, median; target < 5%)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--small", action="store_true")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--dtype", choices=tuple(DTYPES), default=None,
                   help="the ZeRO runs' dtype (default: bf16 on cuda, fp32 on cpu)")
    p.add_argument("--parts", default=None,
                   help=f"comma-separated subset of {', '.join(PARTS)} (default: jobs on cuda, the others on cpu)")
    p.add_argument("--steps", type=int, default=STEPS, help="jobs: optimizer steps per job, the first a warm-up")
    p.add_argument("--budget", type=float, default=None, metavar="S",
                   help=f"jobs: seconds they may take in all (default on cuda: {JOBS_BUDGET_S:.0f})")
    p.add_argument("--only", default=None, help="jobs: comma-separated indices into JOBS")
    p.add_argument("--json", default=None, help="also write the figures to this file")
    p.add_argument("--_rank", default=None, help=argparse.SUPPRESS)  # rank process: path of its spec
    p.add_argument("--_job", default=None, help=argparse.SUPPRESS)  # job process: path of its spec
    p.add_argument("--_activation", choices=("on", "off"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args._rank:
        return _rank_main(json.loads(Path(args._rank).read_text()))
    if args._job:
        return _job_main(json.loads(Path(args._job).read_text()))
    if args._activation:
        if args.threads:
            torch.set_num_threads(args.threads)
        print(json.dumps(_activation_main(SMALL if args.small else FULL, args._activation == "on", args.device)))
        return 0
    parts = tuple(x for x in args.parts.split(",") if x) if args.parts else None
    bad = sorted(set(parts or ()) - set(PARTS))
    if bad:
        p.error(f"--parts {','.join(bad)}: accepted parts are {', '.join(PARTS)}")
    only = [int(i) for i in args.only.split(",")] if args.only else None
    res = run(args.device, args.repeats, args.small, args.threads, args.world_size, parts=parts, dtype=args.dtype,
              steps=args.steps, budget_s=args.budget, only=only)
    print_table(res)
    write_json(res, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
