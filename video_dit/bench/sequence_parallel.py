"""Sequence-parallel benchmark: per-rank activation peak (and step time) of one DiT forward+backward
with Ulysses SP=N against a single process (SP=1) on the same weights and inputs.

SP=1 runs in one process, then SP=N in N processes (gloo on CPU, one GPU per rank on CUDA), each
started fresh (no allocator history). The peak is the highest memory allocated during
forward+backward above what was alive before (weights and gradient buffers excluded: one warm-up
step allocates the gradients first). The SP=N output is checked against the SP=1 output.

    python -m video_dit.bench.sequence_parallel [--sp 2] [--shape small|wan1.3b] [--checkpointing]
    video-dit bench --suite sequence_parallel   (when the lead registers it)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

from video_dit.devices import free_port
from video_dit.families.wan.config import DiTConfig
from video_dit.families.wan.dit import VideoDiT
from video_dit.parallel.memory import activation_peak
from video_dit.parallel.sequence import attach, init_sequence_parallel, launch_env

# latents (C, F', h, w); tokens = F' * h/2 * w/2
SHAPES = {
    "small": dict(dim=256, heads=4, ffn_dim=1024, layers=6, latents=(16, 8, 32, 32), text_len=64, text_dim=256),
    "wan1.3b": dict(dim=1536, heads=12, ffn_dim=8960, layers=2, latents=(16, 16, 32, 32), text_len=512,
                    text_dim=4096),
}


def _worker(rank: int, world: int, port: int, shape: dict, checkpointing: bool, repeats: int, out_dir: str,
            threads: int) -> None:
    torch.set_num_threads(threads)
    device = torch.device("cuda", rank) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    cfg = DiTConfig(in_dim=shape["latents"][0], out_dim=16, dim=shape["dim"], ffn_dim=shape["ffn_dim"],
                    freq_dim=256, text_dim=shape["text_dim"], num_heads=shape["heads"], num_layers=shape["layers"],
                    text_len=shape["text_len"])
    torch.manual_seed(0)
    model = VideoDiT(cfg).to(device)
    with torch.no_grad():
        model.head.head.weight.normal_(std=0.02)  # the zeroed output layer would hide the blocks' gradients
    if checkpointing:
        model.enable_gradient_checkpointing()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, *shape["latents"], generator=g).to(device)
    t = torch.tensor([700.0], device=device)
    ctx = torch.randn(1, shape["text_len"], shape["text_dim"], generator=g).to(device)

    info = None
    if world > 1:
        import deepspeed

        launch_env(rank, world, port)
        deepspeed.init_distributed("nccl" if device.type == "cuda" else "gloo")
        info = init_sequence_parallel(world)
        attach(model, info)

    def step():
        y = model(x, t, ctx)
        y.float().square().mean().backward()
        return y.detach()

    y = step()  # warm-up: gradient buffers allocated outside the measurement
    peaks, times = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        y, peak = activation_peak(step, device)
        times.append(time.perf_counter() - t0)
        peaks.append(peak)
    result = {"rank": rank, "peak_bytes": min(peaks), "step_s": statistics.median(times)}
    out = Path(out_dir)
    if world == 1:
        torch.save(y.cpu(), out / "reference.pt")
    else:
        ref = torch.load(out / "reference.pt", weights_only=True)
        result["max_abs_diff_vs_sp1"] = (y.cpu() - ref).abs().max().item()
        result["sp1_output_max_abs"] = ref.abs().max().item()  # the scale the difference is measured against
    (out / f"sp{world}_rank{rank}.json").write_text(json.dumps(result))


def run(sp: int = 2, shape: str | dict = "small", checkpointing: bool = False, repeats: int = 2) -> dict:
    """Measure SP=1 then SP=`sp`; returns the figures (bytes and GB, seconds, ratio per rank)."""
    shape = SHAPES[shape] if isinstance(shape, str) else dict(shape)
    if shape["heads"] % sp:
        raise ValueError(f"sp={sp} does not divide heads={shape['heads']}")
    cores = os.cpu_count() or 1
    with tempfile.TemporaryDirectory() as tmp:
        for world in (1, sp):
            mp.start_processes(_worker, args=(world, free_port(), shape, checkpointing, repeats, tmp,
                                              max(1, cores // world)),
                               nprocs=world, start_method="spawn", join=True)
        base = json.loads((Path(tmp) / "sp1_rank0.json").read_text())
        ranks = [json.loads((Path(tmp) / f"sp{sp}_rank{r}.json").read_text()) for r in range(sp)]
    _, F_, h, w = shape["latents"]
    gb = 2 ** 30
    worst = max(r["peak_bytes"] for r in ranks)
    return {
        "shape": shape, "tokens": F_ * (h // 2) * (w // 2), "sp": sp, "checkpointing": checkpointing,
        "device": "cuda" if torch.cuda.is_available() else "cpu",
        "sp1_act_peak_gb": base["peak_bytes"] / gb,
        "sp_act_peak_gb_per_rank": [r["peak_bytes"] / gb for r in ranks],
        "peak_ratio": worst / base["peak_bytes"],
        "sp1_step_s": base["step_s"], "sp_step_s_per_rank": [r["step_s"] for r in ranks],
        "max_abs_diff_vs_sp1": max(r["max_abs_diff_vs_sp1"] for r in ranks),
        "sp1_output_max_abs": ranks[0]["sp1_output_max_abs"],
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sp", type=int, default=2)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="small")
    ap.add_argument("--frames", type=int, default=None, help="latent frames F' (sets the sequence length)")
    ap.add_argument("--layers", type=int, default=None, help="DiT blocks (activations grow with them)")
    ap.add_argument("--checkpointing", action="store_true")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args(argv)
    shape = dict(SHAPES[args.shape])
    if args.layers:
        shape["layers"] = args.layers
    if args.frames:
        shape["latents"] = (shape["latents"][0], args.frames, *shape["latents"][2:])
    print(json.dumps(run(args.sp, shape, args.checkpointing, args.repeats), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
