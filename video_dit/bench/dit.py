"""DiT benchmark: forward+backward of our VideoDiT against diffusers' WanTransformer3DModel.

Both models hold identical weights (ours converted from diffusers' state dict) and run side by
side in one process with the same threads, alternating, so machine noise hits both alike; the
ratio of medians is the figure. Activation memory of each is measured in a fresh subprocess
(no allocator history): `saved` = bytes alive after forward (what autograd keeps), `peak` = the
highest extra bytes during forward+backward (grad buffers pre-allocated, so they do not count).

    python -m video_dit.bench.dit [--repeats 3] [--small] [--device cpu|cuda] [--shape NAME] [--layers N]
    video-dit bench --suite dit [--device cuda]

CPU shape ("full"): Wan 2.1 1.3B widths (dim 1536, 12 heads, ffn 8960, text 512 x 4096) but 2 blocks,
2304 video tokens (latents 16 x 9 x 32 x 32), fp32. GPU shape ("wan1.3b-81x480x832", the default
with --device cuda): the same widths at 81 frames of 480 x 832 = latents 16 x 21 x 60 x 104 =
32,760 tokens, bf16, both models' attention held to SDPA's flash kernel (an error where it is
unavailable, never a silent fallback to the math kernel). MFU = analytic FLOPs (3x forward) per
second over `video_dit.bench.common.device_peak`: a dense matmul measured in this process at the
same dtype and threads on CPU; the datasheet table on known GPUs (the measured matmul reported too).
diffusers is a test/bench-only dependency.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from video_dit.bench.common import (
    dit_pair,
    median,
    mfu,
    profiled_live_after,
    profiled_peak,
    run_json_subprocess,
    time_side_by_side,
    write_json,
)
from video_dit.devices import device_peak
from video_dit.models.dit import DiTConfig, cast_dit, dit_flops
from video_dit.parallel.memory import cuda_peak

FULL = dict(dim=1536, heads=12, ffn_dim=8960, layers=2, latents=(16, 9, 32, 32), text_len=512, text_dim=4096)
SMALL = dict(dim=256, heads=4, ffn_dim=1024, layers=2, latents=(16, 4, 24, 24), text_len=64, text_dim=256)
GPU = dict(FULL, latents=(16, 21, 60, 104))  # 1.3B widths, 81 frames at 480 x 832: 21 x 30 x 52 = 32,760 tokens
SHAPES = {"full": FULL, "small": SMALL, "wan1.3b-81x480x832": GPU}


def _shape(small: bool, device: str, name: str | None = None, layers: int | None = None) -> dict:
    """The named shape, else small / the GPU shape on CUDA / the CPU shape; `layers` overrides blocks."""
    if name is not None and name not in SHAPES:
        raise ValueError(f"unknown DiT bench shape {name!r}; accepted: {', '.join(SHAPES)}")
    shape = SHAPES[name] if name else SMALL if small else GPU if device.startswith("cuda") else FULL
    return dict(shape, layers=layers) if layers else dict(shape)


def _dtype(device: str) -> torch.dtype:
    return torch.bfloat16 if device.startswith("cuda") else torch.float32


def _kernel(device: str):
    """CUDA: SDPA's flash kernel only, for both models; CPU: torch's own choice."""
    if device.startswith("cuda"):
        return sdpa_kernel(SDPBackend.FLASH_ATTENTION)
    return contextlib.nullcontext()


def build(shape: dict, device: str, seed: int = 0, dtype: torch.dtype = torch.float32):
    """(ours, reference, inputs) with identical weights, in `dtype`."""
    # the reference as from_pretrained(torch_dtype=...) leaves it (_keep_in_fp32_modules stay float32), ours
    # given its values and stored as load_dit(dtype=...) stores it: bf16 bulk, float32 islands
    ours, ref = dit_pair(shape, seed, ref_dtype=dtype)
    ref.to(device)
    cast_dit(ours.to(device), dtype)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(1, *shape["latents"], generator=g).to(device=device, dtype=dtype)
    t = torch.tensor([700.0], device=device)
    context = torch.randn(1, shape["text_len"], shape["text_dim"], generator=g).to(device=device, dtype=dtype)
    return ours, ref, (x, t, context)


def _step_fn(model, inputs, is_ref: bool, device: str = "cpu"):
    def step():
        with _kernel(device):
            out = model(*inputs, return_dict=False)[0] if is_ref else model(*inputs)
            out.float().square().mean().backward()
    return step


def _forward_fn(model, inputs, is_ref: bool, device: str = "cpu"):
    def forward():
        with _kernel(device):
            out = model(*inputs, return_dict=False)[0] if is_ref else model(*inputs)
        return out.float().square().mean()
    return forward


def _measure_memory(which: str, small: bool, device: str, shape: dict | None = None) -> dict:
    """In this (fresh) process: saved activations and fwd+bwd peak of one model."""
    ours, ref, inputs = build(shape or _shape(small, device), device, dtype=_dtype(device))
    model, is_ref = (ref, True) if which == "diffusers" else (ours, False)
    del ours, ref
    step = _step_fn(model, inputs, is_ref, device)
    step()  # warm-up; leaves .grad buffers allocated, so backward adds into them
    model.zero_grad(set_to_none=False)
    forward = _forward_fn(model, inputs, is_ref, device)
    if device.startswith("cuda"):
        loss, saved = cuda_peak(forward, device)
        del loss
        _, peak = cuda_peak(step, device)
        torch.cuda.synchronize()
        return {"saved": saved, "peak": peak}
    loss, saved = profiled_live_after(forward)
    del loss
    return {"saved": saved, "peak": profiled_peak(step)}


def run(device: str = "cpu", repeats: int = 3, small: bool = False, threads: int | None = None,
        shape: str | None = None, layers: int | None = None) -> dict:
    """Time both models side by side, then measure each one's memory in a fresh process; print a
    table and return the figures. `shape`: a name in SHAPES (default: see `_shape`)."""
    if threads:
        torch.set_num_threads(threads)
    shape_name, shape = shape, _shape(small, device, shape, layers)
    dtype = _dtype(device)
    ours, ref, inputs = build(shape, device, dtype=dtype)
    steps = {"ours": _step_fn(ours, inputs, False, device), "diffusers": _step_fn(ref, inputs, True, device)}
    times = time_side_by_side(steps, repeats, device)  # one warm-up each, then alternating rounds
    del ours, ref, steps
    peak = device_peak(device, dtype)  # the MFU denominator: this process, same dtype and threads

    memory = {}
    for name in ("ours", "diffusers"):
        args = ["-m", "video_dit.bench.dit", "--memory-of", name, "--device", device,
                "--threads", str(torch.get_num_threads())] + (["--small"] if small else [])
        args += (["--shape", shape_name] if shape_name else []) + (["--layers", str(layers)] if layers else [])
        memory[name] = run_json_subprocess(args, what=f"DiT memory ({name})")

    tokens = shape["latents"][1] * shape["latents"][2] * shape["latents"][3] // 4
    cfg = DiTConfig(dim=shape["dim"], ffn_dim=shape["ffn_dim"], num_heads=shape["heads"], num_layers=shape["layers"],
                    text_dim=shape["text_dim"], text_len=shape["text_len"])
    flops = 3 * dit_flops(cfg, tokens, shape["text_len"])  # forward + backward
    res = {
        "config": {**shape, "tokens": tokens, "device": device, "threads": torch.get_num_threads(),
                   "repeats": repeats, "dtype": str(dtype).removeprefix("torch."), "torch": torch.__version__,
                   "gpu": torch.cuda.get_device_name(0) if device.startswith("cuda") else None,
                   "attention": "SDPA flash kernel" if device.startswith("cuda") else "SDPA (torch's CPU choice)"},
        "step_s": {k: median(v) for k, v in times.items()},
        "step_s_all": times,
        "memory_bytes": memory,
    }
    res["time_ratio"] = res["step_s"]["ours"] / res["step_s"]["diffusers"]
    res["saved_ratio"] = memory["ours"]["saved"] / memory["diffusers"]["saved"]
    res["peak_ratio"] = memory["ours"]["peak"] / memory["diffusers"]["peak"]
    res["tflops"] = {k: flops / v / 1e12 for k, v in res["step_s"].items()}
    res["peak"] = peak.as_dict()
    res["mfu"] = mfu(flops, res["step_s"]["ours"], peak.flops)
    res["mfu_diffusers"] = mfu(flops, res["step_s"]["diffusers"], peak.flops)

    mib = 2 ** 20
    print(f"DiT fwd+bwd, dim {shape['dim']}, {shape['heads']} heads, {shape['layers']} blocks, {tokens} tokens, "
          f"{res['config']['dtype']}, {device}, {torch.get_num_threads()} threads, median of {repeats}; peak "
          f"{peak.flops / 1e12:.3f} TFLOP/s ({peak.source}; matmul measured {peak.measured / 1e12:.3f})")
    print(f"{'':12}{'step s':>10}{'TFLOP/s':>10}{'MFU':>8}{'saved MiB':>12}{'peak MiB':>12}")
    for name in ("ours", "diffusers"):
        util = res["mfu"] if name == "ours" else res["mfu_diffusers"]
        print(f"{name:12}{res['step_s'][name]:10.3f}{res['tflops'][name]:10.3f}{util:8.1%}"
              f"{memory[name]['saved'] / mib:12.1f}{memory[name]['peak'] / mib:12.1f}")
    targets = "time <= 0.8, MFU >= 45%" if device.startswith("cuda") else "time <= 1.0, MFU >= 75%, peak <= 0.8"
    print(f"{'ours/diff.':12}{res['time_ratio']:10.3f}{'':18}{res['saved_ratio']:12.3f}{res['peak_ratio']:12.3f}"
          f"   (targets: {targets})")
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--small", action="store_true", help="a small shape for a quick smoke run")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--shape", choices=sorted(SHAPES), default=None,
                   help="default: small with --small, wan1.3b-81x480x832 on cuda, else full")
    p.add_argument("--layers", type=int, default=None, help="DiT blocks (default: the shape's 2)")
    p.add_argument("--memory-of", choices=("ours", "diffusers"), help=argparse.SUPPRESS)  # subprocess mode
    p.add_argument("--json", default=None, help="also write the figures to this file")
    args = p.parse_args(argv)
    if args.memory_of:
        if args.threads:
            torch.set_num_threads(args.threads)
        shape = _shape(args.small, args.device, args.shape, args.layers)
        print(json.dumps(_measure_memory(args.memory_of, args.small, args.device, shape)))
        return 0
    res = run(args.device, args.repeats, args.small, args.threads, args.shape, args.layers)
    write_json(res, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
