"""LTX-2 video VAE benchmark: encode + decode (no grad) time and peak memory, ours vs diffusers'
`AutoencoderKLLTX2Video` with identical random weights and input, each at its defaults (diffusers:
untiled, whole clip; ours: untiled, a few frames per conv call).

    video-dit bench --suite ltx2-vae [--small] [--device cuda]    # with the targets (time <= 1.0x, memory <= 0.8x)
    python -m video_dit.bench.ltx2_vae                    # CPU: LTX-2.3's released widths, 9 x 128 x 128, fp32
    python -m video_dit.bench.ltx2_vae --small            # CPU: LTX-2.3 at quarter widths, 9 x 64 x 64
    python -m video_dit.bench.ltx2_vae --device cuda      # GPU: LTX-2.3's widths, 33 x 480 x 832, bf16
    python -m video_dit.bench.ltx2_vae --variant 2.0 --frames 17 --size 256 --repeats 1

Time: both models in this process after one warm-up call each, alternated per repeat (the order reversed
every other round): median wall seconds and median process CPU seconds. On the CPU one thread by default,
for the reason `bench/hunyuan15_vae.py` gives (on a shared host a multi-threaded op waits for a core another
job holds); the load average is printed with the figures.
Peak memory: on CPU each model in a fresh subprocess, after one warm-up call, the resident-set high-water
mark above the resident set just before encode + decode (`peak_rss_delta` of bench/vae.py, `MALLOC_ENV`
set); on CUDA the allocator's peak above the memory allocated before the call (`cuda_peak`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import torch

from video_dit.bench.common import median, run_json_subprocess
from video_dit.bench.vae import MALLOC_ENV, peak_rss_delta
from video_dit.devices import sync
from video_dit.families.ltx2.vae_config import LTX2_VAE_20, LTX2_VAE_23, LTX2_VAE_TINY, LTX2VAEConfig
from video_dit.parallel.memory import cuda_peak

# LTX-2.3's network at a quarter of its widths (the latent channels too: Lightricks' conv_in widens to them)
QUARTER_23 = dataclasses.replace(LTX2_VAE_23, latent_channels=32, encoder_widths=(32, 64, 128, 256, 256),
                                 decoder_widths=(256, 128, 128, 64, 32))
# the released networks (2.5's conv VAE is 2.3's), the quarter widths, and the tests' tiny one
VARIANTS = {"2.0": LTX2_VAE_20, "2.3": LTX2_VAE_23, "2.3-quarter": QUARTER_23, "tiny": LTX2_VAE_TINY}
CPU_SHAPE = dict(variant="2.3", frames=9, height=128, width=128, dtype="float32")
CPU_SMALL_SHAPE = dict(variant="2.3-quarter", frames=9, height=64, width=64, dtype="float32")
CUDA_SHAPE = dict(variant="2.3", frames=33, height=480, width=832, dtype="bfloat16")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def config_of(shape: dict) -> LTX2VAEConfig:
    if shape["variant"] not in VARIANTS:
        raise ValueError(f"unknown LTX-2 VAE variant {shape['variant']!r}; accepted: {', '.join(VARIANTS)}")
    return VARIANTS[shape["variant"]]


def build_pair(cfg: LTX2VAEConfig, seed: int = 0, dtype: torch.dtype = torch.float32, device="cpu"):
    """(ours, diffusers') with the same weights: diffusers' init after `torch.manual_seed(seed)` moved off its
    identities by N(0, 0.02) noise, converted to our names."""
    from diffusers import AutoencoderKLLTX2Video

    from video_dit.families.ltx2.vae import LTX2VideoVAE
    from video_dit.families.ltx2.vae_convert import ltx2_vae_config_to_diffusers, ltx2_vae_to_native

    torch.manual_seed(seed)
    with torch.device(device):
        ref = AutoencoderKLLTX2Video(**ltx2_vae_config_to_diffusers(cfg)).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    if dtype != torch.float32:  # (a float32 model is left as built: diffusers warns at any `to(dtype)`)
        ref = ref.to(dtype=dtype)
    sd, _ = ltx2_vae_to_native(ref.state_dict())
    with torch.device("meta"):
        ours = LTX2VideoVAE(cfg).eval()
    ours.load_state_dict({k: v.clone() for k, v in sd.items()}, strict=True, assign=True)
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


def _peak_child(which: str, shape: dict, threads: int) -> int:
    args = ["-m", "video_dit.bench.ltx2_vae", "--_peak", which, "--threads", str(threads),
            "--_shape-json", json.dumps(shape)]
    return run_json_subprocess(args, env={**os.environ, **MALLOC_ENV}, what=f"{which} peak memory")["peak_bytes"]


def run(device: str = "cpu", repeats: int = 3, small: bool = False, threads: int | None = None) -> dict:
    """`video-dit bench --suite ltx2-vae`: `measure` at the device's shape (`default_shape`); the process's
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
    cfg = config_of(shape)
    ours, ref = build_pair(cfg, dtype=dtype, device=device)
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
    result = {"shape": {**shape, "widths": list(cfg.encoder_widths), "device": device,
                        "threads": torch.get_num_threads(), "load_average": os.getloadavg()[0]},
              "max_abs_diff": diff, "output_scale": scale, "time_s": {k: median(v) for k, v in wall.items()},
              "cpu_s": {k: median(v) for k, v in cpu.items()}, "times_all": wall, "cpu_all": cpu}
    result["time_ratio"] = result["time_s"]["ours"] / result["time_s"]["diffusers"]
    result["cpu_ratio"] = result["cpu_s"]["ours"] / result["cpu_s"]["diffusers"]
    if memory:
        if device.startswith("cuda"):
            peaks = {w: cuda_peak(lambda: roundtrip(w, m, video), device)[1] for w, m in models.items()}
        else:  # the children build their own; this process lets go of both first
            models.clear()
            del ours, ref
            peaks = {w: _peak_child(w, shape, torch.get_num_threads()) for w in ("ours", "diffusers")}
        result["peak_bytes"] = peaks
        result["memory_ratio"] = peaks["ours"] / peaks["diffusers"]
    return result


def print_table(r: dict) -> None:
    s = r["shape"]
    print(f"LTX-{s['variant']} VAE encode+decode, encoder widths "
          f"{s['widths']}, {s['frames']} x {s['height']} x {s['width']}, {s['dtype']}, {s['device']}, {s['threads']} "
          f"threads (load average {s['load_average']:.1f}); max |ours - diffusers| = {r['max_abs_diff']:.2e} "
          f"(output max {r['output_scale']:.2f})")
    print(f"{'':12}{'wall (s)':>12}{'CPU (s)':>12}{'peak (MiB)':>14}")
    for k in ("ours", "diffusers"):
        peak = f"{r['peak_bytes'][k] / 2 ** 20:14.1f}" if "peak_bytes" in r else f"{'-':>14}"
        print(f"{k:12}{r['time_s'][k]:12.3f}{r['cpu_s'][k]:12.3f}{peak}")
    mem = f"{r['memory_ratio']:14.2f}" if "memory_ratio" in r else f"{'-':>14}"
    print(f"{'ratio':12}{r['time_ratio']:12.2f}{r['cpu_ratio']:12.2f}{mem}")
    print("targets: time <= 1.0, peak memory <= 0.8")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (default 1 on the CPU)")
    ap.add_argument("--variant", choices=list(VARIANTS), help="the network (default 2.3; --small: 2.3-quarter)")
    ap.add_argument("--frames", type=int, help="8k + 1 frames")
    ap.add_argument("--size", type=int, help="height = width in pixels (a multiple of 32)")
    ap.add_argument("--dtype", choices=list(DTYPES))
    ap.add_argument("--small", action="store_true", help="CPU: LTX-2.3 at quarter widths, 9 x 64 x 64 frames")
    ap.add_argument("--no-memory", action="store_true")
    ap.add_argument("--json", action="store_true", help="print the result dict as JSON too")
    ap.add_argument("--_peak", choices=("ours", "diffusers"), help=argparse.SUPPRESS)
    ap.add_argument("--_shape-json", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args._peak:  # child of `_peak_child`: one model resident, one measured call
        if args.threads:
            torch.set_num_threads(args.threads)
        shape = json.loads(args._shape_json)
        dtype = DTYPES[shape["dtype"]]
        pair = dict(zip(("ours", "diffusers"), build_pair(config_of(shape), dtype=dtype)))
        model = pair.pop(args._peak)
        pair.clear()
        video = _clip(shape["frames"], shape["height"], shape["width"], "cpu", dtype)
        roundtrip(args._peak, model, video)  # warm-up, as for the timing: oneDNN's primitives and caches
        _, peak = peak_rss_delta(lambda: roundtrip(args._peak, model, video))
        print(json.dumps({"peak_bytes": peak}))
        return 0
    shape = default_shape(args.device, args.small)
    for key in ("variant", "frames", "dtype"):
        if getattr(args, key):
            shape[key] = getattr(args, key)
    if args.size:
        shape["height"] = shape["width"] = args.size
    r = measure(shape, args.device, args.repeats, args.threads, memory=not args.no_memory)
    print_table(r)
    if args.json:
        print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
