"""HunyuanVideo 1.5 VAE benchmark: encode + decode (no grad) time and peak memory, ours vs diffusers'
`AutoencoderKLHunyuanVideo15` with identical random weights and input, each at its defaults (diffusers:
untiled, whole clip; ours: untiled, causal chunks).

    video-dit bench --suite hy15-vae [--small] [--device cuda]  # the same, with the targets (<= 0.7x time and memory)
    python -m video_dit.bench.hunyuan15_vae                    # CPU: released widths, 9x128x128 (12 min, 16 GB RAM)
    python -m video_dit.bench.hunyuan15_vae --small            # CPU: quarter widths, 17 x 64 x 64 (~1 min)
    python -m video_dit.bench.hunyuan15_vae --threads 2        # all of a 2-core CPU (only if no other job runs)
    python -m video_dit.bench.hunyuan15_vae --device cuda      # GPU: the released widths, bf16, 33 x 480 x 832
    python -m video_dit.bench.hunyuan15_vae --frames 17 --size 256 --widths 32,64,128,256,256 --repeats 1

The small CPU shape measures call overheads more than convolutions: ours runs each layer on groups of
frames (one frame per call at 64 x 64), so its ratio there (about 0.85) is not the one at video sizes.

Time: both models in this process after one warm-up call each, alternated per repeat: median wall
seconds and median process CPU seconds. On the CPU one thread by default: on a host shared with other
jobs every multi-threaded op waits for a core another job may hold (OpenMP spins meanwhile), which
measures the neighbours, not the code, and hits ours harder: it runs each layer on groups of frames,
many calls where the reference makes one per layer (this 2-core host at load 4.5: 1.6x the
reference's time with 2 threads, 0.9x with 1). The load average is printed with the figures.
Peak memory: on CPU each model in a fresh subprocess, after one warm-up call, the resident-set
high-water mark above the resident set just before encode + decode (`peak_rss_delta` of
bench/vae.py, `MALLOC_ENV` set); on CUDA the allocator's peak above the memory allocated before the
call (`cuda_peak`), in this process.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from video_dit.bench.common import median, run_json_subprocess
from video_dit.bench.vae import MALLOC_ENV, peak_rss_delta
from video_dit.devices import sync
from video_dit.parallel.memory import cuda_peak

CPU_SHAPE = dict(widths=(128, 256, 512, 1024, 1024), frames=9, height=128, width=128, dtype="float32")
CPU_SMALL_SHAPE = dict(widths=(32, 64, 128, 256, 256), frames=17, height=64, width=64, dtype="float32")
CUDA_SHAPE = dict(widths=(128, 256, 512, 1024, 1024), frames=33, height=480, width=832, dtype="bfloat16")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_pair(widths, seed: int = 0, dtype: torch.dtype = torch.float32, device="cpu"):
    """(ours, diffusers') with the same weights: diffusers' init after `torch.manual_seed(seed)` moved off
    its identities (gammas of one) by small noise, converted to our names. Latent channels 32 as released."""
    from diffusers import AutoencoderKLHunyuanVideo15

    from video_dit.families.hunyuan15.convert_vae import hy15_vae_config_to_diffusers, hy15_vae_from_diffusers
    from video_dit.families.hunyuan15.vae import HunyuanVideo15VAE, HY15VAEConfig

    cfg = HY15VAEConfig(block_out_channels=tuple(widths))
    torch.manual_seed(seed)
    with torch.device(device):  # built where it runs (the released size: 1.26 B parameters)
        ref = AutoencoderKLHunyuanVideo15(**hy15_vae_config_to_diffusers(cfg)).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    ref = ref.to(dtype=dtype)
    with torch.device("meta"):
        ours = HunyuanVideo15VAE(cfg).eval()
    ours.load_state_dict({k: v.clone() for k, v in hy15_vae_from_diffusers(ref.state_dict()).items()}, assign=True)
    return ours, ref


def _clip(frames: int, height: int, width: int, device, dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return (torch.rand(1, 3, frames, height, width, generator=g) * 2 - 1).to(device=device, dtype=dtype)


def roundtrip(which: str, model, video):
    """encode -> mode -> decode, no grad; both unclamped (diffusers does not clamp)."""
    with torch.no_grad():
        if which == "ours":
            return model.decode(model.encode(video).mode(), clamp=False)
        return model.decode(model.encode(video).latent_dist.mode()).sample


def default_shape(device: str, small: bool = False) -> dict:
    return dict(CUDA_SHAPE if device.startswith("cuda") else CPU_SMALL_SHAPE if small else CPU_SHAPE)


def _shape(args) -> dict:
    base = default_shape(args.device, args.small)
    if args.widths:
        base["widths"] = tuple(int(w) for w in args.widths.split(","))
    for key in ("frames", "dtype"):
        if getattr(args, key):
            base[key] = getattr(args, key)
    if args.size:
        base["height"] = base["width"] = args.size
    return base


def _peak_child(which: str, shape: dict, threads: int) -> int:
    args = ["-m", "video_dit.bench.hunyuan15_vae", "--_peak", which, "--threads", str(threads),
            "--widths", ",".join(map(str, shape["widths"])), "--frames", str(shape["frames"]),
            "--height", str(shape["height"]), "--width", str(shape["width"]), "--dtype", shape["dtype"]]
    return run_json_subprocess(args, env={**os.environ, **MALLOC_ENV}, what=f"{which} peak memory")["peak_bytes"]


def run(device: str = "cpu", repeats: int = 3, small: bool = False, threads: int | None = None) -> dict:
    """`video-dit bench --suite hy15-vae`: `measure` at the device's shape (`default_shape`); the process's
    thread count is restored after it."""
    before = torch.get_num_threads()
    try:
        return measure(default_shape(device, small), device, repeats, threads)
    finally:
        torch.set_num_threads(before)


def measure(shape: dict, device: str = "cpu", repeats: int = 3, threads: int | None = None,
            memory: bool = True) -> dict:
    """Median seconds and peak bytes of one no-grad encode + decode, ours and diffusers', and ratios."""
    if threads or device == "cpu":
        torch.set_num_threads(threads or 1)
    dtype = DTYPES[shape["dtype"]]
    ours, ref = build_pair(shape["widths"], dtype=dtype, device=device)
    video = _clip(shape["frames"], shape["height"], shape["width"], device, dtype)
    models = {"ours": ours, "diffusers": ref}
    out = {w: roundtrip(w, m, video) for w, m in models.items()}  # also the warm-up
    scale = out["diffusers"].float().abs().max().item()
    diff = (out["ours"].float() - out["diffusers"].float()).abs().max().item()
    del out
    wall, cpu = {w: [] for w in models}, {w: [] for w in models}
    for r in range(repeats):  # alternated, the order reversed every other round
        for w in (list(models) if r % 2 == 0 else list(models)[::-1]):
            sync(device)
            t0, c0 = time.perf_counter(), time.process_time()
            roundtrip(w, models[w], video)
            sync(device)
            wall[w].append(time.perf_counter() - t0)
            cpu[w].append(time.process_time() - c0)
    result = {"shape": {**shape, "widths": list(shape["widths"]), "device": device, "threads": torch.get_num_threads(),
                        "load_average": os.getloadavg()[0]},
              "max_abs_diff": diff, "output_scale": scale, "time_s": {k: median(v) for k, v in wall.items()},
              "cpu_s": {k: median(v) for k, v in cpu.items()}, "times_all": wall}
    result["time_ratio"] = result["time_s"]["ours"] / result["time_s"]["diffusers"]
    result["cpu_ratio"] = result["cpu_s"]["ours"] / result["cpu_s"]["diffusers"]
    if memory:
        if device.startswith("cuda"):
            peaks = {w: cuda_peak(lambda: roundtrip(w, m, video), device)[1]
                     for w, m in (("ours", ours), ("diffusers", ref))}
        else:  # the children build their own; this process lets go of both first (the released widths: 5 GB each)
            models.clear()
            del ours, ref
            peaks = {w: _peak_child(w, shape, torch.get_num_threads()) for w in ("ours", "diffusers")}
        result["peak_bytes"] = peaks
        result["memory_ratio"] = peaks["ours"] / peaks["diffusers"]
    return result


def print_table(r: dict) -> None:
    s = r["shape"]
    print(f"HunyuanVideo 1.5 VAE encode+decode, widths {s['widths']}, {s['frames']} x {s['height']} x {s['width']}, "
          f"{s['dtype']}, {s['device']}, {s['threads']} threads (load average {s['load_average']:.1f}); "
          f"max |ours - diffusers| = {r['max_abs_diff']:.2e} "
          f"(output max {r['output_scale']:.2f})")
    print(f"{'':12}{'wall (s)':>12}{'CPU (s)':>12}{'peak (MiB)':>14}")
    for k in ("ours", "diffusers"):
        peak = f"{r['peak_bytes'][k] / 2 ** 20:14.1f}" if "peak_bytes" in r else f"{'-':>14}"
        print(f"{k:12}{r['time_s'][k]:12.3f}{r['cpu_s'][k]:12.3f}{peak}")
    mem = f"{r['memory_ratio']:14.2f}" if "memory_ratio" in r else f"{'-':>14}"
    print(f"{'ratio':12}{r['time_ratio']:12.2f}{r['cpu_ratio']:12.2f}{mem}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (default 1 on the CPU)")
    ap.add_argument("--widths", help="block_out_channels, comma-separated (default: per device)")
    ap.add_argument("--frames", type=int)
    ap.add_argument("--size", type=int, help="height = width in pixels (a multiple of 16)")
    ap.add_argument("--dtype", choices=list(DTYPES))
    ap.add_argument("--small", action="store_true",
                    help="CPU: quarter widths, 17 x 64 x 64 frames (call overheads, not convolutions)")
    ap.add_argument("--no-memory", action="store_true")
    ap.add_argument("--json", action="store_true", help="print the result dict as JSON too")
    ap.add_argument("--_peak", choices=("ours", "diffusers"), help=argparse.SUPPRESS)
    ap.add_argument("--height", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--width", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args._peak:  # child of `_peak_child`: one model resident, one measured call
        if args.threads:
            torch.set_num_threads(args.threads)
        dtype = DTYPES[args.dtype]
        pair = dict(zip(("ours", "diffusers"), build_pair([int(w) for w in args.widths.split(",")], dtype=dtype)))
        model = pair.pop(args._peak)
        pair.clear()
        video = _clip(args.frames, args.height, args.width, "cpu", dtype)
        roundtrip(args._peak, model, video)  # warm-up, as for the timing: oneDNN's primitives and caches
        _, peak = peak_rss_delta(lambda: roundtrip(args._peak, model, video))
        print(json.dumps({"peak_bytes": peak}))
        return 0
    r = measure(_shape(args), args.device, args.repeats, args.threads, memory=not args.no_memory)
    print_table(r)
    if args.json:
        print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
