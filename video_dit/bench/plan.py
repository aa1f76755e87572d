"""Planner validation: the memory planner's per-rank peak (`video_dit.train.plan.predict`) against
the peak measured on 2 CPU ranks, for configurations spanning ZeRO 0/2/3, LoRA and full
fine-tuning, sequence parallelism 1 and 2, block checkpointing on and off, two widths and two token
counts.

    video-dit bench --suite plan            # every configuration (CPU, fp32, ~15 min on 2 cores)
    python -m video_dit.bench.plan --experts  # two trained experts: two engines in one process, alternating
    python -m video_dit.bench.plan --only 0,3 --json plan.json

Each configuration runs in 2 fresh rank processes (gloo, 1 thread each) through the trainer's own
set-up: `build_dit` (ZeRO-3 partitioned), `make_trainable` (LoRA / checkpointing / Ulysses SP) and
`engine.initialize` (the trainer's DeepSpeed JSON), then 1 + `repeats` flow-matching steps on random
latents of the configuration's size. A `CPUAllocationTracker` is on from before the DiT is built, so
it sees every tensor the rank makes (parameters, DeepSpeed's partitions and buckets, Adam's state,
activations): the measured peak is the highest live total during a step after the first, what
`torch.cuda.max_memory_allocated` would report on a GPU (kernel scratch excepted). The prediction
is made in the same process from the same job, before anything is built.
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
from video_dit.models.dit import DiTConfig
from video_dit.parallel.memory import CPUAllocationTracker
from video_dit.parallel.sequence import init_sequence_parallel
from video_dit.parallel.zero import ds_config
from video_dit.train.build import build_dit, make_trainable
from video_dit.train.config import parse_job
from video_dit.train.engine import initialize
from video_dit.train.plan import Experts, Setting, predict
from video_dit.train.precision import build_dtype

GiB = 2 ** 30
TOLERANCE = 0.15
# width -> (heads, layers); the FFN is 4 x the width, text_len 128, text_dim 256
WIDTHS = {64: (2, 2), 256: (4, 4), 512: (8, 4)}
TOKENS = {256: (4, 16, 16), 1024: (4, 32, 32), 4096: (16, 32, 32)}  # latents (F', h, w): F' * h/2 * w/2 tokens
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
]
SMALL = [dict(zero=z, lora=lora, sp=sp, ckpt=ck, dim=64, tokens=256)
         for z, lora, sp, ck in ((0, None, 1, False), (3, 4, 2, True))]
# two trained experts (Wan 2.2 A14B's training, train/experts.py): two engines in one process, the steps
# alternating between them (`--experts`)
EXPERT_CONFIGS = [dict(zero=2, lora=8, sp=1, ckpt=False, dim=512, tokens=1024, experts=2),
                  dict(zero=3, lora=8, sp=1, ckpt=True, dim=512, tokens=1024, experts=2),
                  dict(zero=3, lora=None, sp=1, ckpt=False, dim=256, tokens=1024, experts=2)]


def dit_config(c: dict):
    heads, layers = WIDTHS[c["dim"]]
    return DiTConfig(in_dim=16, out_dim=16, dim=c["dim"], ffn_dim=4 * c["dim"], freq_dim=256, text_dim=256,
                     num_heads=heads, num_layers=layers, text_len=128)


def job_of(c: dict, data_dir: str, out_dir: str):
    """The trainer job of a configuration (the DiT's shape comes from `dit_config`)."""
    process = {"type": "sd_trainer", "training_folder": out_dir,
               "datasets": [{"folder_path": data_dir, "num_frames": 5, "resolution": [64]}],
               "train": {"batch_size": 1, "steps": 100, "lr": 1e-4, "dtype": "fp32",
                         "gradient_checkpointing": c["ckpt"]},
               "model": {"name_or_path": "preset:tiny"},
               "deepspeed": {"zero_stage": c["zero"], "sequence_parallel_size": c["sp"]}}
    if c["lora"]:
        process["network"] = {"type": "lora", "linear": c["lora"]}
    return parse_job({"job": "extension", "config": {"name": "bench_plan", "process": [process]}},
                     source="video_dit.bench.plan")


def name_of(c: dict) -> str:
    return (f"ZeRO-{c['zero']} {'LoRA r' + str(c['lora']) if c['lora'] else 'full'} SP{c['sp']} "
            f"{'ckpt' if c['ckpt'] else 'no-ckpt'} D{c['dim']} L{c['tokens']}"
            + (f" x{c['experts']} experts" if c.get("experts", 1) > 1 else ""))


# ---------------------------------------------------------------- one rank


def _rank_main(spec: dict) -> int:
    import deepspeed

    torch.set_num_threads(1)
    deepspeed.init_distributed("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    c = spec["config"]
    n_experts = c.get("experts", 1)
    job = job_of(c, spec["data_dir"], spec["out_dir"])
    cfg, grid, dtype = dit_config(c), TOKENS[c["tokens"]], torch.float32
    ds = ds_config(job, world)
    experts = Experts(("high_noise", "low_noise")[:n_experts]) if n_experts > 1 else None
    pred = predict(cfg, grid, Setting(c["zero"], sp=c["sp"], checkpointing=c["ckpt"]), world=world,
                   lora_rank=c["lora"], dtype=dtype, ds=ds, cuda=False, experts=experts)

    tracker = CPUAllocationTracker()
    tracker.__enter__()
    sp_info = init_sequence_parallel(c["sp"])
    engines = []
    for i in range(n_experts):  # one engine per expert, built one after the other (as the trainer does)
        dit = build_dit("preset:tiny", None, zero_stage=c["zero"], dtype=build_dtype(dtype, lora=bool(c["lora"])),
                        config=cfg, seed=i, ds_config=ds if c["zero"] == 3 else None)
        make_trainable(dit, job.process, dtype, sp_info).train()
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
    ranks = launch_ranks("video_dit.bench.plan", spec, world=2, workdir=workdir, threads=1)
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


def run(device: str = "cpu", repeats: int = 1, small: bool = False, threads: int | None = None,
        only: list[int] | None = None, experts: bool = False) -> dict:
    if device != "cpu":
        raise ValueError("the plan suite measures CPU ranks (a CUDA comparison with max_memory_allocated "
                         "is not implemented: no GPU was lent to this project)")

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
    return {"rows": rows, "max_rel_error": worst, "within_tolerance": sum(abs(r["ratio"] - 1) <= TOLERANCE
                                                                          for r in rows),
            "configs": len(rows), "tolerance": TOLERANCE}


def print_table(res: dict) -> None:
    print(f"\nPlanner vs measured per-rank peak, 2 CPU ranks, fp32 (target: every row within "
          f"{res['tolerance']:.0%})")
    print(f"{'configuration':40}{'predicted':>11}{'measured':>10}{'ratio':>7}   {'step rise pred / meas':>22}")
    for r in res["rows"]:
        print(f"{r['name']:40}{r['predicted_gib']:>9.3f} G{r['measured_gib']:>8.3f} G{r['ratio']:>7.3f}   "
              f"{r['activations_predicted_gib']:>10.3f} G / {r['activations_measured_gib']:.3f} G")
    print(f"max |predicted / measured - 1| = {res['max_rel_error']:.3f}; "
          f"{res['within_tolerance']}/{res['configs']} within {res['tolerance']:.0%}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--only", default=None, help="comma-separated configuration indices")
    ap.add_argument("--experts", action="store_true", help="the two-expert configurations (Wan 2.2 A14B training)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--_rank", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args._rank:
        return _rank_main(json.loads(Path(args._rank).read_text()))

    res = run(repeats=args.repeats, small=args.small, only=[int(i) for i in args.only.split(",")] if args.only else None,
              experts=args.experts)
    print_table(res)
    write_json(res, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
