"""Training-step benchmark: throughput, MFU and per-rank memory of the DiT's training step under
DeepSpeed ZeRO 0/2/3, block checkpointing on/off, and the data path over cached latents.

    python -m video_dit.bench.train [--small] [--repeats 3] [--world-size 2] [--device cpu|cuda]
    video-dit bench --suite train

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
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
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
from video_dit.devices import device_peak
from video_dit.diffusion.conditioning import masked_mse
from video_dit.diffusion.flow import add_noise, velocity_target
from video_dit.models.dit import DiTConfig, VideoDiT, dit_flops
from video_dit.models.loading import load_text_encoder
from video_dit.models.presets import get_preset
from video_dit.models.vae import CausalVideoVAE
from video_dit.train.config import parse_job
from video_dit.train.engine import initialize
from video_dit.train.precision import cast_for_training

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
    model = cast_for_training(build_model(shape).to(device=device).train(), dtype)
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
    model = cast_for_training(build_model(shape).to(device=device).train(), dtype)  # as the trainer stores it
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


# ---------------------------------------------------------------- the suite


def run(device: str = "cpu", repeats: int = 3, small: bool = False, threads: int | None = None,
        world_size: int = 2, stages=STAGES, parts=("zero", "activations", "cache"), dtype: str | None = None) -> dict:
    """dtype: the ZeRO runs' training dtype, "fp32" or "bf16" (default: bf16 on CUDA, fp32 on CPU).
    On CPU fp32, DeepSpeed's ZeRO 1-3 keep an fp32 master copy of the partition that ZeRO-0 does
    not, so the ZeRO-3 / ZeRO-0 state ratio cannot fall below 10/16; in bf16 (as on GPU) both
    stages keep fp32 master weights and the ratio is the partitioning's own."""
    dtype = dtype or ("bf16" if device.startswith("cuda") else "fp32")
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}; accepted: {', '.join(DTYPES)}")
    if threads:
        torch.set_num_threads(threads)
    threads = torch.get_num_threads()
    shape = SMALL if small else FULL
    notes = []
    if device.startswith("cuda") and torch.cuda.device_count() < world_size:
        notes.append(f"{world_size} ranks asked, {torch.cuda.device_count()} GPU(s) present: ran "
                     f"{torch.cuda.device_count()} rank(s), so ZeRO partitions over that many")
        world_size = torch.cuda.device_count()
    flops, tokens = step_flops(shape)
    res: dict = {"config": {**shape, "tokens": tokens, "device": device, "world_size": world_size,
                            "threads_total": threads, "repeats": repeats, "stages": list(stages),
                            "flops_per_step": flops,
                            "dtype": str(DTYPES[dtype]).removeprefix("torch."), "notes": notes}}
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
    return res


def print_table(res: dict) -> None:
    c, mib = res["config"], 2 ** 20
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
    p.add_argument("--parts", default="zero,activations,cache",
                   help="comma-separated subset of zero, activations, cache")
    p.add_argument("--json", default=None, help="also write the figures to this file")
    p.add_argument("--_rank", default=None, help=argparse.SUPPRESS)  # rank process: path of its spec
    p.add_argument("--_activation", choices=("on", "off"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args._rank:
        return _rank_main(json.loads(Path(args._rank).read_text()))
    if args._activation:
        if args.threads:
            torch.set_num_threads(args.threads)
        print(json.dumps(_activation_main(SMALL if args.small else FULL, args._activation == "on", args.device)))
        return 0
    parts = tuple(x for x in args.parts.split(",") if x)
    bad = sorted(set(parts) - {"zero", "activations", "cache"})
    if bad:
        p.error(f"--parts {','.join(bad)}: accepted parts are zero, activations, cache")
    res = run(args.device, args.repeats, args.small, args.threads, args.world_size, parts=parts, dtype=args.dtype)
    print_table(res)
    write_json(res, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
