"""Planner validation: the memory planner's per-rank peak (`video_dit.train.plan.predict`) against
the measured peak, on CPU ranks, on one GPU, and at full size on fake tensors.

    video-dit bench --suite plan                  # CPU: every configuration (2 ranks or 1, fp32 and bf16, ~10 min)
    video-dit bench --suite plan --device cuda --json plan.json   # one GPU: the width of the 1.3B, bf16 (< 6 min, H200)
    python -m video_dit.bench.plan --experts      # two trained experts: two engines in one process, alternating
    python -m video_dit.bench.plan --only 0,3 --json plan.json
    python -m video_dit.bench.plan --device cuda --budget 300 --jobs 2   # the GPU suite within 300 s
    python -m video_dit.bench.plan --fake         # no GPU: the activation model at the real 1.3B's sizes

CPU ranks (`CONFIGS`: ZeRO 0/2/3, LoRA and full, SP 1 and 2, checkpointing off, on and of some blocks, three
widths, three token counts, float32 and `train.cpu_bf16` rows, two rows on one rank): each configuration
runs in 2 (its `ranks`) fresh rank processes (gloo, 1 thread each) through the trainer's own set-up:
`build_dit` (ZeRO-3 partitioned), `make_trainable` (LoRA / checkpointing / Ulysses SP) and
`engine.initialize` (the trainer's DeepSpeed JSON, with a configuration's `reduce_bucket`), then 1 +
`repeats` flow-matching steps on random latents of the configuration's size. A `CPUAllocationTracker` is on
from before the DiT is built, so it sees every tensor the rank makes (parameters, DeepSpeed's partitions and
buckets, Adam's state, activations): the measured peak is the highest live total during a step after the
first, what `torch.cuda.max_memory_allocated` would report on a GPU (kernel scratch excepted). The
prediction is made in the same process from the same job.

One GPU (`GPU_CONFIGS`, `--device cuda`): the width of Wan 2.1 1.3B (1536, 12 heads, FFN 8960, 512 text
tokens of 4096) in bf16, at world size 1, each configuration in a fresh process through the same set-up;
peak = `torch.cuda.max_memory_allocated` over the steps after the first, planned = `predict` for the same
job (with the fused kernels when they ran). Ten configurations of 10 blocks (ZeRO 0/2/3, LoRA r32 and
full, checkpointing off, on and of some blocks, RecomputeSaved off, 14,040 and 32,760 tokens), then the
real 30-block model's LoRA job at 81x480x832 with `gradient_checkpointing: auto` on this GPU and with
every block checkpointed (timed: auto must be faster), and `auto` under a 40 GiB cap
(`torch.cuda.set_per_process_memory_fraction`: a plan that under-counts would fail there). Configurations
run two at a time when their planned peaks fit the GPU together (`--jobs`; each process has its own
allocator, so one's peak does not include the other's; the timed ones run alone); `--budget` skips what
would not finish in time. `--small` runs the same list at tiny sizes, on CPU when there is no GPU.

Fake tensors (`--fake`, `fake_check`): the DiT at the real 1.3B's sizes built under torch's
`FakeTensorMode` (no memory, no compute) and run forward + backward under PyTorch's own
`torch.distributed._tools.mem_tracker.MemTracker` (the tracker torchtitan's estimator uses), on fake
*CPU* tensors: this torch has no CUDA, and fake CUDA tensors need it (autocast("cuda") turns itself off
and a CUDA op finds no device guard). What it checks: the activation terms at the real proportions
(30 blocks, 14,040-32,760 tokens, F = 5.8 D), the fused kernels' saved set (their fake kernels; CPU
autocast casts the same ops to bf16 as CUDA's for the ops the DiT uses: linear, conv, SDPA). What it
cannot: DeepSpeed (its state comes from the plan's formulas, checked on CPU ranks), CUDA's SDPA backend
choice and workspaces, cuBLAS workspaces, the caching allocator's rounding and fragmentation.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import weakref
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from video_dit.bench.common import launch_ranks, write_json
from video_dit.data.demo import make_demo_data
from video_dit.devices import Machine, host_ram, local_device
from video_dit.families import get_preset
from video_dit.families.wan import FAMILY as WAN
from video_dit.families.wan.config import DiTConfig
from video_dit.families.wan.memory import activation_bytes
from video_dit.parallel.memory import CPUAllocationTracker
from video_dit.parallel.sequence import init_sequence_parallel
from video_dit.parallel.zero import Distribution, ds_config
from video_dit.train.build import build_dit, make_trainable
from video_dit.train.config import NetworkConfig, parse_job
from video_dit.train.engine import initialize
from video_dit.train.plan import CUDA_CONTEXT_BYTES, AutoCheckpointing, Experts, Setting, checkpointed_count, predict
from video_dit.train.precision import build_dtype, train_dtype

GiB = 2 ** 30
TOLERANCE = 0.15
GPU_TOLERANCE = 0.10
# width -> (heads, layers); the FFN is 4 x the width, text_len 128, text_dim 256
WIDTHS = {64: (2, 2), 256: (4, 4), 384: (6, 8), 512: (8, 4)}
# latents (F', h, w): F' * h/2 * w/2 tokens; 1152: a 9x256x384 clip
TOKENS = {256: (4, 16, 16), 1024: (4, 32, 32), 1152: (3, 32, 48), 4096: (16, 32, 32)}
CONFIGS = [
    dict(zero=0, lora=None, sp=1, ckpt=False, dim=256, tokens=1024),
    dict(zero=0, lora=8, sp=1, ckpt=True, dim=512, tokens=4096),
    dict(zero=0, lora=None, sp=2, ckpt=False, dim=256, tokens=4096),
    dict(zero=2, lora=None, sp=1, ckpt=False, dim=512, tokens=1024),
    dict(zero=2, lora=8, sp=2, ckpt=False, dim=256, tokens=4096),
    dict(zero=2, lora=8, sp=1, ckpt=True, dim=256, tokens=1024),
    dict(zero=3, lora=None, sp=2, ckpt=True, dim=512, tokens=4096),
    dict(zero=3, lora=8, sp=1, ckpt=False, dim=512, tokens=4096),
    dict(zero=3, lora=None, sp=1, ckpt=False, dim=256, tokens=1024),
    dict(zero=3, lora=8, sp=2, ckpt=True, dim=256, tokens=1024),
    # bf16 as a GPU job stores it (`train.cpu_bf16`: float32 masters, the float32 residual stream), a row per
    # ZeRO stage, and checkpointing of some blocks (the first 2 of 4)
    dict(zero=0, lora=None, sp=1, ckpt=False, dim=256, tokens=1024, dtype="bf16"),
    dict(zero=2, lora=8, sp=1, ckpt=2, dim=512, tokens=4096, dtype="bf16"),
    dict(zero=2, lora=None, sp=1, ckpt=True, dim=256, tokens=1024, dtype="bf16"),
    dict(zero=3, lora=8, sp=1, ckpt=True, dim=256, tokens=1024, dtype="bf16"),
    dict(zero=2, lora=8, sp=1, ckpt=2, dim=256, tokens=1024),
    # one rank, a full fine-tune with every block checkpointed (width 384, 8 blocks, 9x256x384): its trainable
    # gradients fit DeepSpeed's reduce bucket, so ZeRO-2 makes the gradient partition after the activations;
    # ZeRO-3's peak is the optimizer step (AdamW's two temporaries)
    dict(zero=2, lora=None, sp=1, ckpt=True, dim=384, tokens=1152, dtype="bf16", ranks=1),
    dict(zero=3, lora=None, sp=1, ckpt=True, dim=384, tokens=1152, dtype="bf16", ranks=1),
]
# --small: tiny widths; the one-rank rows with a reduce bucket of 2^18 elements, just over the DiT's 208,896
# trainable parameters (the default 5e7 would be 190 MiB of these rows' ~6 MiB)
ONE_RANK = dict(sp=1, ckpt=True, dim=64, tokens=256, dtype="bf16", ranks=1, reduce_bucket=2 ** 18)
SMALL = [dict(zero=z, lora=lora, sp=sp, ckpt=ck, dim=64, tokens=256, **kw)
         for z, lora, sp, ck, kw in ((0, None, 1, False, {}), (3, 4, 2, True, {}), (2, 4, 1, 1, {"dtype": "bf16"}))]
SMALL += [dict(ONE_RANK, zero=2, lora=None), dict(ONE_RANK, zero=3, lora=None)]
# two trained experts (Wan 2.2 A14B's training, train/experts.py): two engines in one process, the steps
# alternating between them (`--experts`)
EXPERT_CONFIGS = [dict(zero=2, lora=8, sp=1, ckpt=False, dim=512, tokens=1024, experts=2),
                  dict(zero=3, lora=8, sp=1, ckpt=True, dim=512, tokens=1024, experts=2),
                  dict(zero=3, lora=None, sp=1, ckpt=False, dim=256, tokens=1024, experts=2)]


def dit_config(c: dict):
    heads, layers = WIDTHS[c["dim"]]
    return DiTConfig(in_dim=16, out_dim=16, dim=c["dim"], ffn_dim=4 * c["dim"], freq_dim=256, text_dim=256,
                     num_heads=heads, num_layers=layers, text_len=128)


def _job(preset: str, data_dir: str, out_dir: str, train: dict, zero: int, sp: int, lora: int | None, source: str,
         reduce_bucket: int | None = None):
    """A trainer job on `preset`'s weights (a random init). The config refuses LoRA on a preset's random init
    (it would train nothing: the head is zero); what is measured here is its memory, so the network is set
    after that check. `reduce_bucket`: DeepSpeed's `reduce_bucket_size` in elements (None: the trainer's)."""
    deepspeed = {"zero_stage": zero, "sequence_parallel_size": sp}
    if reduce_bucket is not None:
        deepspeed["config"] = {"zero_optimization": {"reduce_bucket_size": reduce_bucket}}
    process = {"type": "sd_trainer", "training_folder": out_dir,
               "datasets": [{"folder_path": data_dir, "num_frames": 5, "resolution": [64]}],
               "train": {"batch_size": 1, "steps": 100, "lr": 1e-4, **train},
               "model": {"name_or_path": f"preset:{preset}"}, "deepspeed": deepspeed}
    job = parse_job({"job": "extension", "config": {"name": "bench_plan", "process": [process]}}, source=source)
    if lora:
        job.process.network = NetworkConfig(linear=lora, linear_alpha=lora)
        job.process.network.validate("network")
    return job


def job_of(c: dict, data_dir: str, out_dir: str):
    """The trainer job of a CPU configuration (the DiT's shape comes from `dit_config`)."""
    bf16 = c.get("dtype") == "bf16"
    train = {"dtype": "bf16" if bf16 else "fp32", "cpu_bf16": bf16, "gradient_checkpointing": c["ckpt"]}
    return _job("tiny", data_dir, out_dir, train, c["zero"], c["sp"], c["lora"], "video_dit.bench.plan",
                c.get("reduce_bucket"))


def ckpt_name(ckpt) -> str:
    return {True: "ckpt", False: "no-ckpt"}.get(ckpt, f"ckpt{ckpt}") if isinstance(ckpt, bool) else \
        ("ckpt-auto" if ckpt == "auto" else f"ckpt{ckpt}")


def name_of(c: dict) -> str:
    return (f"ZeRO-{c['zero']} {'LoRA r' + str(c['lora']) if c['lora'] else 'full'} SP{c['sp']} "
            f"{ckpt_name(c['ckpt'])} D{c['dim']} L{c['tokens']}" + (" bf16" if c.get("dtype") == "bf16" else "")
            + (f" x{c['experts']} experts" if c.get("experts", 1) > 1 else "")
            + (f" {c['ranks']} rank{'s' if c['ranks'] > 1 else ''}" if c.get("ranks", 2) != 2 else "")
            + (f" reduce bucket {c['reduce_bucket']:.0e}" if c.get("reduce_bucket") else ""))


def setting_for(c: dict, layers: int, **changes) -> Setting:
    """The plan's `Setting` of a configuration: its ZeRO stage, SP degree and checkpointed blocks."""
    n = layers if c["ckpt"] is True else 0 if c["ckpt"] is False else int(c["ckpt"])
    return Setting(c["zero"], sp=c.get("sp", 1), checkpointing=n > 0, checkpoint_blocks=n,
                   recompute=c.get("recompute", True), **changes)


# ---------------------------------------------------------------- one rank


def _rank_main(spec: dict) -> int:
    import deepspeed

    torch.set_num_threads(1)
    deepspeed.init_distributed("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    c = spec["config"]
    n_experts = c.get("experts", 1)
    job = job_of(c, spec["data_dir"], spec["out_dir"])
    cfg, grid = dit_config(c), TOKENS[c["tokens"]]
    dtype = train_dtype(job.process.train.dtype, job.process.train.cpu_bf16)
    ds = ds_config(job, world)
    experts = Experts(("high_noise", "low_noise")[:n_experts]) if n_experts > 1 else None
    pred = predict(cfg, grid, setting_for(c, cfg.num_layers), world=world, lora_rank=c["lora"], dtype=dtype, ds=ds,
                   cuda=False, experts=experts, fused=False, family=WAN, inputs={"per_token": False, "lora_img_emb": False})

    tracker = CPUAllocationTracker()
    tracker.__enter__()
    sp_info = init_sequence_parallel(c["sp"])
    engines = []
    for i in range(n_experts):  # one engine per expert, built one after the other (as the trainer does)
        dit = build_dit("preset:tiny", None, zero_stage=c["zero"], dtype=build_dtype(dtype, lora=bool(c["lora"])),
                        config=cfg, seed=i, ds_config=ds if c["zero"] == 3 else None, family=WAN)
        make_trainable(dit, job.process, dtype, sp_info, family=WAN).train()
        engines.append(initialize(dit, job, world)[0])
    g = torch.Generator().manual_seed(sp_info.dp_rank)  # a sequence group shares its batch
    x = torch.randn(1, cfg.in_dim, *grid, generator=g)
    target = torch.randn(1, cfg.out_dim, *grid, generator=g)
    t = torch.rand(1, generator=g) * 1000
    context = [torch.randn(cfg.text_len, cfg.text_dim, generator=g)]
    steps = []
    for i in range(n_experts * (1 + spec["repeats"])):  # the experts alternate, step by step
        engine = engines[i % n_experts]
        base = tracker.live
        tracker.peak = base
        t0 = time.perf_counter()
        loss = (engine(x, t, context).float() - target).square().mean()
        saved = tracker.live - base
        engine.backward(loss)
        engine.step()
        del loss
        steps.append({"base": base, "peak": tracker.peak, "saved": saved, "s": time.perf_counter() - t0})
    tracker.__exit__(None, None, None)
    measured = steps[n_experts:]  # after every engine's first step (Adam's moments exist from then on)
    out = {"rank": rank, "steps": steps, "measured_peak": max(s["peak"] for s in measured),
           "measured_activations": max(s["peak"] - s["base"] for s in measured),  # the step's rise above what lives

           "measured_saved": max(s["saved"] for s in measured),
           "predicted_peak": pred.device_bytes, "predicted_activations": pred.device_bytes - pred.resident.device,
           "predicted_saved": pred.activations.saved, "predicted": pred.memory.as_gib(), "phase": pred.phase,
           "step_s": min(s["s"] for s in measured)}
    Path(spec["out"]).with_suffix(f".rank{rank}.json").write_text(json.dumps(out))
    dist.barrier()
    return 0


# ---------------------------------------------------------------- the suite


def run_config(c: dict, repeats: int, workdir: Path) -> dict:
    spec = {"config": c, "repeats": repeats, "data_dir": str(workdir / "data"), "out_dir": str(workdir / "out"),
            "out": str(workdir / "rank")}
    ranks = launch_ranks("video_dit.bench.plan", spec, world=c.get("ranks", 2), workdir=workdir, threads=1)
    worst = max(ranks, key=lambda r: r["measured_peak"])
    row = {"name": name_of(c), **c, "predicted_gib": worst["predicted_peak"] / GiB,
           "measured_gib": worst["measured_peak"] / GiB,
           "ratio": worst["predicted_peak"] / worst["measured_peak"],
           "activations_predicted_gib": worst["predicted_activations"] / GiB,
           "activations_measured_gib": worst["measured_activations"] / GiB,
           "saved_predicted_gib": worst["predicted_saved"] / GiB, "saved_measured_gib": worst["measured_saved"] / GiB,
           "phase": worst["phase"], "predicted_split_gib": worst["predicted"], "step_s": worst["step_s"],
           "per_rank_measured_gib": [r["measured_peak"] / GiB for r in ranks]}
    return row


def run_cpu(repeats: int = 1, small: bool = False, only: list[int] | None = None, experts: bool = False) -> dict:
    configs = EXPERT_CONFIGS if experts else SMALL if small else CONFIGS
    picked = [configs[i] for i in only] if only else configs
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_plan_") as tmp:
        workdir = Path(tmp)
        make_demo_data(workdir / "data", count=1, frames=5, size=64, holdout=0)  # a job must name a dataset
        for c in picked:
            t0 = time.perf_counter()
            rows.append(run_config(c, repeats, workdir))
            print(f"  {rows[-1]['name']}: predicted {rows[-1]['predicted_gib']:.3f} GiB, measured "
                  f"{rows[-1]['measured_gib']:.3f} GiB ({rows[-1]['ratio']:.3f}) in {time.perf_counter() - t0:.0f}s",
                  flush=True)
    worst = max(abs(r["ratio"] - 1) for r in rows)
    return {"suite": "cpu", "device": "cpu", "rows": rows, "max_rel_error": worst,
            "within_tolerance": sum(abs(r["ratio"] - 1) <= TOLERANCE for r in rows), "configs": len(rows),
            "tolerance": TOLERANCE}


# ---------------------------------------------------------------- one GPU

GPU_PRESET = "wan2.1-t2v-1.3b"
GPU_LAYERS = 10  # the suite's models: the 1.3B's width, a third of its blocks (the plan is per block)
GPU_BUCKETS = {"33x480x832": (9, 60, 104), "81x480x832": (21, 60, 104)}  # latents: 14,040 and 32,760 tokens
SMALL_BUCKETS = {"33x480x832": (2, 8, 8), "81x480x832": (3, 8, 8)}  # --small: the tiny preset, 32 / 48 tokens
AUTO_CAP_GIB = 40
GPU_CONFIGS = [
    dict(zero=0, lora=None, ckpt=False, bucket="33x480x832"),
    dict(zero=0, lora=32, ckpt=True, bucket="81x480x832"),
    dict(zero=2, lora=32, ckpt=False, bucket="33x480x832"),
    dict(zero=2, lora=32, ckpt=4, bucket="81x480x832"),
    dict(zero=2, lora=None, ckpt=True, bucket="81x480x832"),
    dict(zero=2, lora=None, ckpt=5, bucket="33x480x832"),
    dict(zero=2, lora=32, ckpt=False, bucket="33x480x832", recompute=False),
    dict(zero=3, lora=32, ckpt=True, bucket="81x480x832"),
    dict(zero=3, lora=None, ckpt=False, bucket="33x480x832"),
    dict(zero=3, lora=32, ckpt=3, bucket="33x480x832"),
    # the real 1.3B (30 blocks), LoRA r32, ZeRO-2, 81x480x832: `auto` on this GPU against every block
    # checkpointed (timed; 2.67 s a step measured on the H200 with every block), and `auto` under a cap
    dict(zero=2, lora=32, ckpt="auto", bucket="81x480x832", layers=30, timed=True),
    dict(zero=2, lora=32, ckpt=True, bucket="81x480x832", layers=30, timed=True),
    dict(zero=2, lora=32, ckpt="auto", bucket="81x480x832", layers=30, cap_gib=AUTO_CAP_GIB),
]
GPU_STEPS = 3  # the first a warm-up; the peak over the others
TIMED_STEPS = 5
PAIR_SHARE = 0.6  # two configurations run together when their planned peaks sum to at most this share of the GPU
START_ESTIMATE_S = {10: 25.0, 30: 50.0}  # a configuration's wall time on an H200 (process, build, steps): a guess


def gpu_name(c: dict) -> str:
    layers = c.get("layers", GPU_LAYERS)
    return (f"ZeRO-{c['zero']} {'LoRA r' + str(c['lora']) if c['lora'] else 'full'} {ckpt_name(c['ckpt'])}"
            f"{' no-recompute' if c.get('recompute') is False else ''} {layers} blocks {c['bucket']}"
            + (f" cap {c['cap_gib']} GiB" if c.get("cap_gib") else ""))


def gpu_dit_config(c: dict, small: bool) -> DiTConfig:
    """The DiT of a GPU configuration: the 1.3B's (`GPU_PRESET`) with its `layers` (default `GPU_LAYERS`);
    `small`: the tiny preset's (4 blocks)."""
    if small:
        return get_preset("tiny").dit
    return replace(get_preset(GPU_PRESET).dit, num_layers=c.get("layers", GPU_LAYERS))


def gpu_checkpointing(c: dict, layers: int, small: bool):
    """`train.gradient_checkpointing` of a configuration at `layers` blocks (a partial count scaled to the
    tiny preset's blocks when `small`)."""
    ckpt = c["ckpt"]
    if small and not isinstance(ckpt, (bool, str)):
        return max(1, min(layers - 1, round(ckpt * layers / c.get("layers", GPU_LAYERS))))
    return ckpt


def gpu_job(c: dict, small: bool, data_dir: str, out_dir: str):
    cfg = gpu_dit_config(c, small)
    train = {"dtype": "bf16", "cpu_bf16": True, "max_grad_norm": 1.0, "recompute_saved": c.get("recompute", True),
             "gradient_checkpointing": gpu_checkpointing(c, cfg.num_layers, small)}
    return _job("tiny" if small else GPU_PRESET, data_dir, out_dir, train, c["zero"], 1, c["lora"],
                "video_dit.bench.plan")


def _gpu_main(spec: dict) -> int:
    """One GPU configuration in this fresh process (world size 1): the plan, then build, set up and steps.
    The record is rewritten to `spec["out"]` after each phase, so a process killed at its time limit still
    says how far it got."""
    from video_dit.devices import timed
    from video_dit.diffusion.objective import flow_matching_loss
    from video_dit.kernels import use_fused
    from video_dit.parallel.process import init_distributed, leave_distributed

    out = Path(spec["out"])
    rec: dict = {"phase": "start", "step_s_all": []}

    def save(phase: str) -> None:
        rec["phase"] = phase
        out.with_suffix(".tmp").write_text(json.dumps(rec))
        out.with_suffix(".tmp").replace(out)

    c, small = spec["config"], spec["small"]
    init_distributed(600)
    device = local_device()
    cuda = device.type == "cuda"
    tracker = None if cuda else CPUAllocationTracker().__enter__()  # CPU (--small): every storage from here on
    cfg = gpu_dit_config(c, small)
    grid = (SMALL_BUCKETS if small else GPU_BUCKETS)[c["bucket"]]
    job = gpu_job(c, small, spec["data_dir"], spec["out_dir"])
    dtype = train_dtype("bf16", cpu_bf16=True)
    total = torch.cuda.get_device_properties(device).total_memory if cuda else None
    cap = c.get("cap_gib")
    if cap and cuda:  # the allocator may not reserve more: a plan that under-counts fails here
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap * GiB / total), device)
    gpu_mem = (cap * GiB + CUDA_CONTEXT_BYTES) if cap and cuda else total
    machine = Machine(ranks=1, device=device.type, gpu_mem=gpu_mem, host_mem=host_ram())
    distribution = Distribution.of(job, 1, cuda=cuda)
    fused = use_fused("auto", torch.empty(1, 1, 1, device=device, dtype=dtype))  # as the DiT's default flag
    if c["ckpt"] == "auto":
        choice = AutoCheckpointing(job, machine).choose(grid)
        blocks = choice.blocks
        rec["auto"] = choice.describe()
    else:
        blocks = checkpointed_count(setting_for({**c, "ckpt": gpu_checkpointing(c, cfg.num_layers, small)},
                                                cfg.num_layers), cfg.num_layers)
    setting = Setting(c["zero"], checkpointing=blocks > 0, checkpoint_blocks=blocks, recompute=c.get("recompute", True))
    pred = predict(cfg, grid, setting, world=1, lora_rank=c["lora"], dtype=dtype, ds=distribution.config, cuda=cuda,
                   fused=fused, family=WAN, inputs={"per_token": False, "lora_img_emb": False})
    rec.update(planned=pred.device_bytes, planned_split_gib=pred.memory.as_gib(), planned_phase=pred.phase,
               fused=fused, blocks=blocks, layers=cfg.num_layers, tokens=pred.tokens, device=str(device),
               gpu=torch.cuda.get_device_name(device) if cuda else None, total_bytes=total)
    save("build")

    t0 = time.perf_counter()
    dit = build_dit(f"preset:{'tiny' if small else GPU_PRESET}", None, zero_stage=c["zero"],
                    dtype=build_dtype(dtype, lora=bool(c["lora"])), device=device, seed=0,
                    ds_config=distribution.config, config=cfg, family=WAN)
    head = dit.head.head.weight
    with torch.no_grad(), distribution.gathered([head], modifier_rank=0):  # Wan's zero head passes no gradient
        head.copy_(torch.randn(head.shape, generator=torch.Generator().manual_seed(0)) * 0.02)
    make_trainable(dit, job.process, dtype, family=WAN).train()
    dit.set_checkpointed_blocks(blocks)  # what `auto` chose (the trainer: per bucket)
    engine, _, _ = initialize(dit, job, 1, distribution=distribution)
    rec["setup_s"] = time.perf_counter() - t0
    g = torch.Generator().manual_seed(1)
    x0 = torch.randn(1, cfg.in_dim, *grid, generator=g).to(device)
    noise = torch.randn(x0.shape, generator=g).to(device)
    t = (torch.rand(1, generator=g) * 1000).to(device)
    context = [torch.randn(cfg.text_len, cfg.text_dim, generator=g).to(device)]
    save("steps")

    def step():
        loss = flow_matching_loss(engine, x0, context, t, noise)
        engine.backward(loss)
        engine.step()

    for i in range(spec["steps"]):
        rec["step_s_all"].append(timed(step, device))
        if i == 0:  # the peak over the steps after the first, from what lives now
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
            else:
                tracker.peak = tracker.live
        save("steps")
    rec["measured"] = int(torch.cuda.max_memory_allocated(device) if cuda else tracker.peak)
    if cuda:
        rec["reserved_peak"] = int(torch.cuda.max_memory_reserved(device))
    if tracker is not None:
        tracker.__exit__(None, None, None)
    save("done")
    leave_distributed()
    return 0


def _start_gpu_config(c: dict, small: bool, workdir: Path, index: int, steps: int):
    """The process of configuration `index` (world size 1, on this machine's first GPU when there is one)."""
    import subprocess

    from video_dit.devices import free_port

    out = workdir / f"gpu_{index}.json"
    spec = {"config": c, "small": small, "steps": steps, "data_dir": str(workdir / "data"),
            "out_dir": str(workdir / f"out_{index}"), "out": str(out)}
    spec_path = workdir / f"gpu_{index}.spec.json"
    spec_path.write_text(json.dumps(spec))
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    log = open(workdir / f"gpu_{index}.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "video_dit.bench.plan", "--_gpu", str(spec_path)], env=env,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, log, out, time.perf_counter()


def _gpu_row(c: dict, rec: dict, wall: float) -> dict:
    row = {"name": gpu_name(c), "config": c, **{k: rec[k] for k in (
        "tokens", "layers", "blocks", "fused", "planned_phase", "planned_split_gib", "auto", "setup_s", "step_s_all",
        "device", "gpu", "error", "reserved_peak") if k in rec}, "wall_s": wall}
    if "planned" in rec:
        row["planned_gib"] = rec["planned"] / GiB
    if "measured" in rec:
        row["measured_gib"] = rec["measured"] / GiB
        row["ratio"] = rec["planned"] / rec["measured"]
    steps = rec.get("step_s_all", [])[1:]
    if steps:
        row["step_s"] = statistics.median(steps)
    return row


def run_gpu(small: bool = False, only: list[int] | None = None, budget_s: float | None = None,
            jobs: int | None = None, steps: int | None = None) -> dict:
    """The GPU suite (`GPU_CONFIGS`; module docstring); `small`: tiny sizes, on CPU when there is no GPU.
    `budget_s`: a configuration that would not finish in the time left is skipped (and says so); `jobs`:
    configurations run at once (default 2 on a GPU); `steps`: steps per configuration (default `GPU_STEPS`,
    the timed ones `TIMED_STEPS`)."""
    import signal

    cuda = torch.cuda.is_available()
    if not cuda and not small:
        raise ValueError("the GPU plan suite needs a CUDA device (--small runs its configurations at tiny sizes "
                         "on CPU)")
    picked = [(i, GPU_CONFIGS[i]) for i in (only if only else range(len(GPU_CONFIGS)))]
    jobs = jobs or (2 if cuda else 1)
    total = torch.cuda.get_device_properties(0).total_memory if cuda else None
    start = time.perf_counter()
    rows: dict[int, dict] = {}
    with tempfile.TemporaryDirectory(prefix="bench_plan_gpu_") as tmp:
        workdir = Path(tmp)
        make_demo_data(workdir / "data", count=1, frames=5, size=64, holdout=0)  # a job must name a dataset
        planned = {}
        for i, c in picked:  # for pairing: each configuration's plan on this GPU (auto and timed ones run alone)
            if not c.get("timed") and c["ckpt"] != "auto" and total:
                job = gpu_job(c, small, str(workdir / "data"), str(workdir / "out"))
                cfg = gpu_dit_config(c, small)
                planned[i] = predict(cfg, GPU_BUCKETS[c["bucket"]], setting_for(c, cfg.num_layers), world=1,
                                     lora_rank=c["lora"], dtype=torch.bfloat16, ds=ds_config(job, 1, cuda=True),
                                     cuda=True, family=WAN, inputs={"per_token": False, "lora_img_emb": False}).device_bytes
        pending, running = list(picked), []
        while pending or running:
            for item in list(running):
                (i, c), (proc, log, out, t0) = item
                left = None if budget_s is None else budget_s - (time.perf_counter() - start)
                code = proc.poll()
                if code is None and left is not None and left <= 0:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                    code = "timeout"
                if code is None:
                    continue
                log.close()
                rec = json.loads(out.read_text()) if out.exists() else {"phase": "start"}
                if code == "timeout":
                    rec["error"] = f"stopped at the budget ({budget_s:.0f} s) during {rec['phase']}"
                elif code != 0:
                    rec["error"] = f"exit {code}: " + (workdir / f"gpu_{i}.log").read_text()[-2000:]
                rows[i] = _gpu_row(c, rec, time.perf_counter() - t0)
                running.remove(item)
                r = rows[i]
                print(f"  {r['name']}: planned {r.get('planned_gib', float('nan')):.2f} GiB, measured "
                      f"{r.get('measured_gib', float('nan')):.2f} GiB ({r.get('ratio', float('nan')):.3f})"
                      f"{', ' + r['error'].splitlines()[0] if 'error' in r else ''} in {r['wall_s']:.0f}s", flush=True)
            if pending:
                i, c = pending[0]
                alone = c.get("timed") or c["ckpt"] == "auto" or i not in planned
                busy = [j for (j, _), _ in running]
                fits = (not busy or (not alone and len(busy) < jobs and all(j in planned for j in busy)
                                     and sum(planned[j] for j in busy) + planned[i] <= PAIR_SHARE * total))
                if fits and not any(GPU_CONFIGS[j].get("timed") or GPU_CONFIGS[j]["ckpt"] == "auto" for j in busy):
                    pending.pop(0)
                    left = None if budget_s is None else budget_s - (time.perf_counter() - start)
                    need = START_ESTIMATE_S[30 if c.get("layers", GPU_LAYERS) == 30 else 10]
                    if left is not None and left < need:
                        rows[i] = {"name": gpu_name(c), "config": c,
                                   "skipped": f"{left:.0f} s of the budget left, under the {need:.0f} s it takes"}
                        print(f"  {gpu_name(c)}: skipped ({rows[i]['skipped']})", flush=True)
                        continue
                    n = steps or (TIMED_STEPS if c.get("timed") else GPU_STEPS)
                    running.append(((i, c), _start_gpu_config(c, small, workdir, i, n)))
                    continue
            time.sleep(0.2)
    ordered = [rows[i] for i, _ in picked]
    return {"suite": "gpu", "device": "cuda" if cuda else "cpu", "small": small, **gpu_summary(ordered),
            "wall_s": time.perf_counter() - start}


def gpu_summary(rows: list[dict]) -> dict:
    """The suite's figures: the planned / measured ratios, and the `auto` checks (faster than every block
    checkpointed; within the cap and the plan)."""
    measured = [r for r in rows if "ratio" in r]
    out = {"rows": rows, "configs": len(rows), "measured": len(measured), "tolerance": GPU_TOLERANCE,
           "within_tolerance": sum(abs(r["ratio"] - 1) <= GPU_TOLERANCE for r in measured),
           "max_rel_error": max((abs(r["ratio"] - 1) for r in measured), default=None)}
    timed = {r["config"]["ckpt"]: r for r in rows if r["config"].get("timed") and "step_s" in r}
    if "auto" in timed and True in timed:
        out["auto"] = {"blocks": timed["auto"]["blocks"], "of": timed["auto"]["layers"],
                       "step_s": timed["auto"]["step_s"], "every_block_step_s": timed[True]["step_s"],
                       "speedup": timed[True]["step_s"] / timed["auto"]["step_s"],
                       "ratio": timed["auto"]["ratio"]}
    capped = [r for r in rows if r["config"].get("cap_gib") and "ratio" in r]
    if capped:
        r = capped[0]
        out["auto_capped"] = {"cap_gib": r["config"]["cap_gib"], "blocks": r["blocks"], "of": r["layers"],
                              "measured_gib": r["measured_gib"], "ratio": r["ratio"]}
    return out


def run(device: str = "cpu", repeats: int = 1, small: bool = False, threads: int | None = None,
        only: list[int] | None = None, experts: bool = False, budget_s: float | None = None,
        jobs: int | None = None) -> dict:
    """`video-dit bench --suite plan`: the CPU suite, or with `device="cuda"` the GPU suite."""
    if device == "cuda":
        return run_gpu(small=small, only=only, budget_s=budget_s, jobs=jobs)
    return run_cpu(repeats=repeats, small=small, only=only, experts=experts)


# ---------------------------------------------------------------- fake tensors at the real size

FAKE_CONFIGS = [  # the 1.3B's LoRA r32 and full jobs of the H200 rows, and some blocks checkpointed
    dict(lora=32, ckpt=False, bucket="33x480x832"),
    dict(lora=32, ckpt=True, bucket="81x480x832"),
    dict(lora=None, ckpt=True, bucket="33x480x832"),
    dict(lora=32, ckpt=15, bucket="81x480x832"),
    dict(lora=None, ckpt=False, bucket="33x480x832"),
]


def fake_check(configs=FAKE_CONFIGS, kernels: str = "triton", cfg: DiTConfig | None = None,
               buckets: dict | None = None) -> dict:
    """The activation model on the real 1.3B made of fake tensors (module docstring): per configuration,
    the forward + backward's peak above what lived before it (parameters and gradients), followed by the
    project's allocation tracker made to follow fake storages (`FakeAllocationTracker`: the same rule as
    `CPUAllocationTracker`, which equals the real run's on CPU) and by PyTorch's `MemTracker`, against
    `activation_bytes(...).peak`; bf16 as a GPU job stores it, through the fused kernels
    (`kernels="triton"`) or the torch path. `cfg`, `buckets`: another DiT and its buckets' latent grids
    (default: the 1.3B's, `GPU_BUCKETS`)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from video_dit.families.wan.dit import VideoDiT, cast_dit, lora_targets
    from video_dit.lora import add_lora

    cfg = cfg or get_preset(GPU_PRESET).dit
    buckets = buckets or GPU_BUCKETS
    peak_tracker = _peak_tracker_class()
    rows = []
    for c in configs:
        grid = buckets[c["bucket"]]
        t0 = time.perf_counter()
        with torch.device("meta"):  # the model as the trainer stores it (LoRA, float32 masters), then made fake
            model = VideoDiT(cfg)
            if c["lora"]:
                add_lora(model, c["lora"], targets=lora_targets(False))
            else:
                model.requires_grad_(True)
            cast_dit(model, torch.bfloat16, masters=True)
        mode = FakeTensorMode()
        for module in model.modules():
            for name, p in list(module._parameters.items()):
                if p is not None:
                    with mode:  # a fake CPU tensor of the same shape and dtype: no memory
                        fake = torch.empty(p.shape, dtype=p.dtype, device="cpu")
                    module._parameters[name] = torch.nn.Parameter(fake, requires_grad=p.requires_grad)
        setting = setting_for({**c, "zero": 0}, cfg.num_layers)
        measured = {}
        with mode:
            model.set_kernels(kernels)
            model.set_checkpointed_blocks(checkpointed_count(setting, cfg.num_layers))
            x, target = torch.randn(1, cfg.in_dim, *grid), torch.randn(1, cfg.out_dim, *grid)
            context, t = [torch.randn(cfg.text_len, cfg.text_dim)], torch.tensor([500.0])
            for p in model.parameters():  # the gradients exist before the measured step (as after the first)
                if p.requires_grad:
                    p.grad = torch.zeros_like(p)
            with FakeAllocationTracker() as tracker:
                (model(x, t, context).float() - target).square().mean().backward()
            measured["allocation_tracker"] = tracker.peak
            mem = peak_tracker()
            for p in model.parameters():  # MemTracker hooks every parameter's gradient, and a frozen one refuses
                if not p.requires_grad:   # a hook (torch 2.13): a frozen parameter gets handles that do nothing
                    mem._param_to_grad_hook_handles[p] = (_NoHook(), _NoHook())
            mem.track_external(model, x, target, *context, t)
            with mem:
                before = mem.get_tracker_snapshot("current")
                (model(x, t, context).float() - target).square().mean().backward()
                peak = mem.get_tracker_snapshot("peak")
            dev = next(iter(peak))
            measured["mem_tracker"] = peak[dev]["Total"] - before[dev]["Total"]
        act = activation_bytes(cfg, grid, setting, lora_rank=c["lora"], s=2, fused=kernels == "triton")
        m = measured["allocation_tracker"]
        rows.append({"name": f"{'LoRA r' + str(c['lora']) if c['lora'] else 'full'} {ckpt_name(c['ckpt'])} "
                             f"{c['bucket']}", **c, "tokens": tokens_of_grid(cfg, grid), "kernels": kernels,
                     "planned_gib": act.peak / GiB, "measured_gib": m / GiB, "ratio": act.peak / m,
                     "mem_tracker_gib": measured["mem_tracker"] / GiB,
                     "ratio_mem_tracker": act.peak / measured["mem_tracker"], "seconds": time.perf_counter() - t0})
        print(f"  fake {rows[-1]['name']}: planned {act.peak / GiB:.2f} GiB, tracked {m / GiB:.2f} GiB "
              f"({rows[-1]['ratio']:.3f}), MemTracker {measured['mem_tracker'] / GiB:.2f} GiB "
              f"({rows[-1]['ratio_mem_tracker']:.3f}) in {rows[-1]['seconds']:.0f}s", flush=True)
    return {"suite": "fake", "device": "fake cpu", "kernels": kernels, "rows": rows,
            "max_rel_error": max(abs(r["ratio"] - 1) for r in rows),
            "max_rel_error_mem_tracker": max(abs(r["ratio_mem_tracker"] - 1) for r in rows)}


class FakeAllocationTracker(CPUAllocationTracker):
    """`CPUAllocationTracker` for fake tensors too: a storage is known by its StorageImpl (a fake
    tensor's data pointer is 0), counted from the op that makes it until it is freed."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.utils._pytree import tree_flatten

        out = func(*args, **(kwargs or {}))
        seen = {t.untyped_storage()._cdata for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
                continue
            st = t.untyped_storage()
            key, nbytes = st._cdata, st.nbytes()
            if nbytes == 0 or key in seen or key in self._refs:
                continue
            seen.add(key)
            self._refs[key] = weakref.ref(st, lambda _, key=key, nbytes=nbytes: self._freed(key, nbytes))
            self.live += nbytes
            self.peak = max(self.peak, self.live)
        return out


def _peak_tracker_class():
    from torch.distributed._tools.mem_tracker import MemTracker

    class PeakTracker(MemTracker):
        """MemTracker keeping the device's peak only: its per-module peaks scan every module it has seen at
        every op (minutes per step for the 1.3B with LoRA's thousand modules); the device total is the
        same code's."""

        def _update_peak_stats(self, peak_state) -> None:
            for dev, snap in self._curr_mem_snap.items():
                if self._peak_mem.get(dev, 0) < snap["Total"]:
                    self._peak_mem[dev] = snap["Total"]
                    self._peak_mem_snap[dev] = dict(snap)

    return PeakTracker


class _NoHook:
    def remove(self) -> None:
        pass


def tokens_of_grid(cfg, grid) -> int:
    pt, ph, pw = cfg.patch_size
    return (grid[0] // pt) * (grid[1] // ph) * (grid[2] // pw)


def print_table(res: dict) -> None:
    rows = res["rows"]
    if res.get("suite") == "fake":
        print(f"\nActivation peak, planned vs tracked on fake tensors: the real 1.3B, bf16, "
              f"{'fused kernels' if res['kernels'] == 'triton' else 'torch path'}")
        print(f"{'configuration':36}{'planned':>10}{'tracked':>10}{'ratio':>7}{'MemTracker':>12}{'ratio':>7}")
        for r in rows:
            print(f"{r['name']:36}{r['planned_gib']:>8.2f} G{r['measured_gib']:>8.2f} G{r['ratio']:>7.3f}"
                  f"{r['mem_tracker_gib']:>10.2f} G{r['ratio_mem_tracker']:>7.3f}")
        print(f"max |planned / tracked - 1| = {res['max_rel_error']:.3f} (allocation tracker), "
              f"{res['max_rel_error_mem_tracker']:.3f} (MemTracker)")
        return
    if res.get("suite") == "gpu":
        print(f"\nPlanner vs max_memory_allocated, one {'GPU' if res['device'] == 'cuda' else 'CPU rank (--small)'}, "
              f"bf16 (target: every row within {GPU_TOLERANCE:.0%})")
        print(f"{'configuration':58}{'blocks':>7}{'planned':>10}{'measured':>10}{'ratio':>7}{'s/step':>8}")
        for r in rows:
            if "ratio" not in r:
                print(f"{r['name']:58}  {r.get('skipped') or (r.get('error') or '').splitlines()[0][:60]}")
                continue
            print(f"{r['name']:58}{r['blocks']:>4}/{r['layers']:<2}{r['planned_gib']:>8.2f} G"
                  f"{r['measured_gib']:>8.2f} G{r['ratio']:>7.3f}{r.get('step_s', float('nan')):>8.2f}")
        if res["max_rel_error"] is not None:
            print(f"max |planned / measured - 1| = {res['max_rel_error']:.3f}; {res['within_tolerance']}/"
                  f"{res['measured']} measured within {GPU_TOLERANCE:.0%} ({res['configs']} configurations)")
        if "auto" in res:
            a = res["auto"]
            print(f"auto: {a['blocks']} of {a['of']} blocks checkpointed, {a['step_s']:.2f} s a step against "
                  f"{a['every_block_step_s']:.2f} s with every block ({a['speedup']:.2f}x), planned / measured "
                  f"{a['ratio']:.3f}")
        if "auto_capped" in res:
            a = res["auto_capped"]
            print(f"auto under a {a['cap_gib']} GiB cap: {a['blocks']} of {a['of']} blocks, measured "
                  f"{a['measured_gib']:.2f} GiB, planned / measured {a['ratio']:.3f}")
        return
    print(f"\nPlanner vs measured per-rank peak, 2 CPU ranks (or as named), fp32 and bf16 (target: every row within "
          f"{res['tolerance']:.0%})")
    print(f"{'configuration':50}{'predicted':>11}{'measured':>10}{'ratio':>7}   {'step rise pred / meas':>22}")
    for r in rows:
        print(f"{r['name']:50}{r['predicted_gib']:>9.3f} G{r['measured_gib']:>8.3f} G{r['ratio']:>7.3f}   "
              f"{r['activations_predicted_gib']:>10.3f} G / {r['activations_measured_gib']:.3f} G")
    print(f"max |predicted / measured - 1| = {res['max_rel_error']:.3f}; "
          f"{res['within_tolerance']}/{res['configs']} within {res['tolerance']:.0%}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                    help="cpu: 2 CPU ranks (CONFIGS); cuda: one GPU (GPU_CONFIGS)")
    ap.add_argument("--gpu-configs", action="store_true",
                    help="the GPU suite's configurations even without a GPU (with --small: tiny sizes, on CPU)")
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--only", default=None, help="comma-separated configuration indices")
    ap.add_argument("--experts", action="store_true", help="the two-expert configurations (Wan 2.2 A14B training)")
    ap.add_argument("--budget", type=float, default=None, metavar="S", help="GPU suite: stop starting after S s")
    ap.add_argument("--jobs", type=int, default=None, help="GPU suite: configurations at once (default 2)")
    ap.add_argument("--fake", action="store_true", help="the activation model on fake tensors at the 1.3B's size")
    ap.add_argument("--kernels", default="triton", choices=("triton", "torch"), help="--fake: fused ops or torch path")
    ap.add_argument("--json", default=None)
    ap.add_argument("--_rank", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--_gpu", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args._rank:
        return _rank_main(json.loads(Path(args._rank).read_text()))
    if args._gpu:
        return _gpu_main(json.loads(Path(args._gpu).read_text()))
    only = [int(i) for i in args.only.split(",")] if args.only else None
    if args.fake:
        res = fake_check(kernels=args.kernels)
    elif args.device == "cuda" or args.gpu_configs:
        res = run_gpu(small=args.small, only=only, budget_s=args.budget, jobs=args.jobs)
    else:
        res = run_cpu(repeats=args.repeats, small=args.small, only=only, experts=args.experts)
    print_table(res)
    write_json(res, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
