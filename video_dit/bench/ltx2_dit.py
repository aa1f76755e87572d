"""LTX-2 DiT benchmark: forward+backward of our `LTX2DiT` (both streams) against diffusers'
`LTX2VideoTransformer3DModel`, same weights and inputs, side by side in one process (alternating, the
order reversed every other round, so machine noise hits both alike); the ratio of medians is the figure,
in wall seconds (`time_ratio`, the target's) and in process CPU seconds (`cpu_ratio`: on a shared CPU host
with one thread, the work done, whatever the neighbours hold).

    video-dit bench --suite ltx2-dit [--small] [--device cuda] [--repeats 3]
    python -m video_dit.bench.ltx2_dit [--shape cpu|small|ltx2.3-121x704x1280] [--variant 2.0|2.3|2.5]
                                       [--layers N] [--repeats 3] [--threads N] [--no-memory] [--json FILE]

One step: both streams' velocities from the latents, timesteps and text contexts, loss = mean(video^2) +
mean(audio^2), backward into every parameter (a full fine-tune's gradients; grad buffers allocated before
the measured step, so they do not count as activations). Each model takes its own call: ours the latents
(B, C, F', h, w) and (B, Ca, T, M), diffusers' the token sequences its pipeline packs (`_pack_latents`,
`_pack_audio_latents`, packed once, outside the timed step), its RoPE coordinates made inside its forward
from the sizes and fps as its pipelines have them made; both t2v (one timestep per sample, the same for
both streams), no text mask (LTX-2's connectors replace the padding with registers and unmask every token),
SDPA with torch's kernel choice on both sides.

Activation memory, each model in a fresh subprocess (no allocator history, the device still empty):
`saved` = bytes alive after forward (what autograd keeps for backward), `peak` = the highest extra bytes
during forward+backward above the start. CPU: the profiler's allocation timeline (`profiled_peak`); CUDA:
the allocator's peak (`cuda_peak`).

Shapes (the variant's flags; head dims 128 video / 64 audio as released):
  cpu                   LTX-2.3, 12 heads (video 1536 wide, audio 768: Wan 1.3B's width, as the Wan suite's CPU
                        shape), 2 blocks, latents 128 x 3 x 24 x 32 = 2,304 video tokens (17 x 768 x 1024 pixels),
                        18 audio tokens (17 frames at 24 fps, 25 audio latents a second), 1,024 text tokens, fp32
  small                 LTX-2.3, 4 heads (512 / 256), 2 blocks, 2 x 12 x 12 = 288 video tokens, 12 audio, 64 text
  ltx2.3-121x704x1280   the released LTX-2.3 widths (32 heads: 4096 / 2048), 2 blocks, 121 frames at 704 x 1280:
                        16 x 22 x 40 = 14,080 video tokens, 126 audio, 1,024 text, bf16 (the default on CUDA)
MFU = analytic forward FLOPs (`ltx2_dit_flops`) x 3 per second over `video_dit.devices.device_peak` (a matmul
measured in this process on CPU; the datasheet on known GPUs). diffusers is a test/bench-only dependency.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace

import torch

from video_dit.bench.common import (diffusers_as_loaded, median, mfu, profiled_live_after, profiled_peak,
                                    run_json_subprocess, write_json)
from video_dit.devices import device_peak, sync
from video_dit.families.ltx2.convert import ltx2_config_to_diffusers, ltx2_from_diffusers
from video_dit.families.ltx2.dit import LTX2DiT, cast_ltx2_dit, ltx2_dit_flops
from video_dit.families.ltx2.dit_config import LTX2_DIT_CONFIGS, LTX2DiTConfig
from video_dit.families.ltx2.memory import audio_tokens_of
from video_dit.parallel.memory import cuda_peak

FPS = 24.0
CPU = dict(variant="2.3", heads=12, layers=2, latents=(128, 3, 24, 32), text_len=1024)
SMALL = dict(variant="2.3", heads=4, layers=2, latents=(128, 2, 12, 12), text_len=64)
GPU = dict(variant="2.3", heads=32, layers=2, latents=(128, 16, 22, 40), text_len=1024)
SHAPES = {"cpu": CPU, "small": SMALL, "ltx2.3-121x704x1280": GPU}
VARIANTS = ("2.0", "2.3", "2.5")


def shape_of(small: bool, device: str, name: str | None = None, variant: str | None = None,
             layers: int | None = None) -> dict:
    """The named shape, else small / the GPU shape on CUDA / the CPU shape; `variant` / `layers` override."""
    if name is not None and name not in SHAPES:
        raise ValueError(f"unknown LTX-2 DiT bench shape {name!r}; accepted: {', '.join(SHAPES)}")
    if variant is not None and variant not in VARIANTS:
        raise ValueError(f"unknown LTX-2 variant {variant!r}; accepted: {', '.join(VARIANTS)}")
    shape = dict(SHAPES[name or ("small" if small else "ltx2.3-121x704x1280" if device.startswith("cuda") else "cpu")])
    shape.update({k: v for k, v in (("variant", variant), ("layers", layers)) if v is not None})
    shape["audio_frames"] = audio_tokens_of(shape["latents"][1:], FPS)  # (F' - 1) 8 + 1 frames at 24 fps
    return shape


def config_of(shape: dict) -> LTX2DiTConfig:
    """The variant's released config at `heads` heads (head dims kept), `layers` blocks, `latents` channels."""
    H = shape["heads"]
    return replace(LTX2_DIT_CONFIGS[shape["variant"]], num_attention_heads=H, audio_num_attention_heads=H,
                   cross_attention_dim=H * 128, audio_cross_attention_dim=H * 64, num_layers=shape["layers"],
                   in_channels=shape["latents"][0], out_channels=shape["latents"][0])


def dtype_of(device: str) -> torch.dtype:
    return torch.bfloat16 if device.startswith("cuda") else torch.float32


def build(shape: dict, device: str, dtype: torch.dtype, seed: int = 0):
    """(ours, diffusers', our inputs, diffusers' inputs) with the same weights: diffusers' init after
    `torch.manual_seed(seed)` moved off its zeros and identities by N(0, 0.02) noise, converted to our names.
    diffusers' as `from_pretrained(torch_dtype=dtype)` leaves it; ours as `load_ltx2_dit(dtype=)` stores it
    (`cast_ltx2_dit`: the bulk in dtype, its float32 islands)."""
    from diffusers import LTX2Pipeline, LTX2VideoTransformer3DModel

    cfg = config_of(shape)
    torch.manual_seed(seed)
    with torch.device(device):
        ref = LTX2VideoTransformer3DModel(**ltx2_config_to_diffusers(cfg))
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    with torch.device("meta"):
        ours = LTX2DiT(cfg)
    ours.load_state_dict({k: v.detach().to(torch.float32, copy=True)
                          for k, v in ltx2_from_diffusers(ref.state_dict()).items()}, assign=True)
    if dtype != torch.float32:
        diffusers_as_loaded(ref, dtype)
        cast_ltx2_dit(ours, dtype)

    C, Fr, h, w = shape["latents"]
    T, Lt = shape["audio_frames"], shape["text_len"]
    ctx_v, ctx_a = (cfg.caption_channels,) * 2 if not cfg.caption_proj_before_connector \
        else (cfg.hidden_size, cfg.audio_hidden_size)
    g = torch.Generator().manual_seed(seed + 1)
    video = torch.randn(1, C, Fr, h, w, generator=g)
    audio = torch.randn(1, 8, T, cfg.audio_in_channels // 8, generator=g)  # 8 latent channels x 16 mel bins
    vctx, actx = torch.randn(1, Lt, ctx_v, generator=g), torch.randn(1, Lt, ctx_a, generator=g)
    t = torch.tensor([700.0], device=device)
    to = dict(device=device, dtype=dtype)
    ours_in = dict(video=video.to(**to), video_timestep=t, video_context=vctx.to(**to), audio=audio.to(**to),
                   audio_timestep=t, audio_context=actx.to(**to), fps=FPS)
    ref_in = dict(hidden_states=LTX2Pipeline._pack_latents(video, 1, 1).to(**to),
                  audio_hidden_states=LTX2Pipeline._pack_audio_latents(audio).to(**to),
                  encoder_hidden_states=vctx.to(**to), audio_encoder_hidden_states=actx.to(**to),
                  timestep=t, audio_timestep=t, sigma=t, audio_sigma=t, num_frames=Fr, height=h, width=w, fps=FPS,
                  audio_num_frames=T, use_cross_timestep=True, return_dict=False)
    return ours.to(device), ref, ours_in, ref_in


def outputs(model, inputs: dict, is_ref: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(video, audio) velocities, each model in its own layout (the loss reads them as flat values)."""
    return tuple(model(**inputs)[:2]) if is_ref else model(**inputs)


def _loss(model, inputs, is_ref):
    v, a = outputs(model, inputs, is_ref)
    return v.float().square().mean() + a.float().square().mean()


def _step_fn(model, inputs, is_ref):
    return lambda: _loss(model, inputs, is_ref).backward()


def memory_of(model, inputs: dict, is_ref: bool, device: str) -> dict:
    """Activation bytes of one model: `saved` after forward, `peak` of forward+backward above the start."""
    step = _step_fn(model, inputs, is_ref)
    step()  # warm-up; leaves .grad buffers allocated, so backward adds into them
    model.zero_grad(set_to_none=False)
    if device.startswith("cuda"):
        loss, saved = cuda_peak(lambda: _loss(model, inputs, is_ref), device)
        del loss
        return {"saved": saved, "peak": cuda_peak(step, device)[1]}
    loss, saved = profiled_live_after(lambda: _loss(model, inputs, is_ref))
    del loss
    return {"saved": saved, "peak": profiled_peak(step)}


def _measure_memory(which: str, shape: dict, device: str) -> dict:
    """In this (fresh) process: one model's saved activations and fwd+bwd peak."""
    ours, ref, ours_in, ref_in = build(shape, device, dtype_of(device))
    model, inputs, is_ref = (ref, ref_in, True) if which == "diffusers" else (ours, ours_in, False)
    del ours, ref
    return memory_of(model, inputs, is_ref, device)


def _memory_subprocesses(shape: dict, device: str) -> dict:
    out = {}
    for which in ("ours", "diffusers"):
        args = ["-m", "video_dit.bench.ltx2_dit", "--_memory-of", which, "--device", device,
                "--threads", str(torch.get_num_threads()), "--_shape-json", json.dumps(shape)]
        out[which] = run_json_subprocess(args, what=f"LTX-2 DiT memory ({which})")
    return out


def flops_of(shape: dict) -> float:
    """Analytic forward FLOPs of one batch-1 step at `shape` (both streams)."""
    _, Fr, h, w = shape["latents"]
    return ltx2_dit_flops(config_of(shape), Fr * h * w, shape["audio_frames"], shape["text_len"])


def time_both(steps: dict, repeats: int, device: str) -> tuple[dict, dict]:
    """({name: [wall s]}, {name: [process CPU s]}) of each step after one warm-up each, the steps alternated and the
    order reversed every other round (`common.time_side_by_side`'s schedule); CPU seconds are steadier than wall
    ones on a shared host (with one thread, the work done whoever else holds the cores)."""
    for step in steps.values():
        step()
    wall, cpu = {k: [] for k in steps}, {k: [] for k in steps}
    for r in range(repeats):
        for name in (list(steps) if r % 2 == 0 else list(steps)[::-1]):
            sync(device)
            t0, c0 = time.perf_counter(), time.process_time()
            steps[name]()
            sync(device)
            wall[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
    return wall, cpu


def max_rel_diff(ours, ref, ours_in: dict, ref_in: dict) -> float:
    """max |ours - diffusers| / max |diffusers| over both streams' outputs (no grad): the same work is timed."""
    from diffusers import LTX2Pipeline

    with torch.no_grad():
        v, a = outputs(ours, ours_in, False)
        rv, ra = outputs(ref, ref_in, True)
    Fr, h, w = ref_in["num_frames"], ref_in["height"], ref_in["width"]
    rv = LTX2Pipeline._unpack_latents(rv, Fr, h, w, 1, 1)
    ra = LTX2Pipeline._unpack_audio_latents(ra, ref_in["audio_num_frames"], a.shape[3])
    return max(((x.float() - y.float()).abs().max() / y.float().abs().max()).item() for x, y in ((v, rv), (a, ra)))


def run(device: str = "cpu", repeats: int = 3, small: bool = False, threads: int | None = None,
        shape: str | None = None, variant: str | None = None, layers: int | None = None,
        memory: bool = True) -> dict:
    """Memory first (fresh subprocesses, the device still empty), then both models side by side; the
    figures (`print_table` prints them)."""
    if threads:
        torch.set_num_threads(threads)
    shp = shape_of(small, device, shape, variant, layers)
    dtype = dtype_of(device)
    mem = _memory_subprocesses(shp, device) if memory else None
    ours, ref, ours_in, ref_in = build(shp, device, dtype)
    diff = max_rel_diff(ours, ref, ours_in, ref_in)
    times, cpu = time_both({"ours": _step_fn(ours, ours_in, False), "diffusers": _step_fn(ref, ref_in, True)},
                           repeats, device)
    step_s = {k: median(v) for k, v in times.items()}
    cpu_s = {k: median(v) for k, v in cpu.items()}
    fwd = flops_of(shp)
    peak = device_peak(device, dtype)
    _, Fr, h, w = shp["latents"]
    res = {
        "config": {**shp, "latents": list(shp["latents"]), "video_tokens": Fr * h * w, "device": device,
                   "dtype": str(dtype).removeprefix("torch."), "threads": torch.get_num_threads(), "repeats": repeats,
                   "load_average": os.getloadavg()[0],
                   "torch": torch.__version__,
                   "gpu": torch.cuda.get_device_name(0) if device.startswith("cuda") else None},
        "max_rel_diff": diff,
        "step_s": step_s, "step_s_all": times, "cpu_s": cpu_s, "cpu_s_all": cpu,
        "time_ratio": step_s["ours"] / step_s["diffusers"],
        "cpu_ratio": cpu_s["ours"] / cpu_s["diffusers"],
        "flops": 3 * fwd,
        "tflops": {k: 3 * fwd / v / 1e12 for k, v in step_s.items()},
        "peak": peak.as_dict(),
        "mfu": mfu(3 * fwd, step_s["ours"], peak.flops),
        "mfu_diffusers": mfu(3 * fwd, step_s["diffusers"], peak.flops),
    }
    if mem is not None:
        res["memory_bytes"] = mem
        res["saved_ratio"] = mem["ours"]["saved"] / mem["diffusers"]["saved"]
        res["peak_ratio"] = mem["ours"]["peak"] / mem["diffusers"]["peak"]
    return res


def print_table(res: dict) -> None:
    c, mib = res["config"], 2 ** 20
    print(f"LTX-{c['variant']} DiT fwd+bwd, {c['heads']} heads, {c['layers']} blocks, {c['video_tokens']} video + "
          f"{c['audio_frames']} audio tokens, {c['text_len']} text, {c['dtype']}, {c['device']}, {c['threads']} "
          f"threads, median of {c['repeats']}; max |ours - diffusers| / max |diffusers| = {res['max_rel_diff']:.1e}")
    print(f"(load average {c['load_average']:.1f})")
    print(f"{'':12}{'step s':>10}{'CPU s':>10}{'MFU':>9}{'saved MiB':>12}{'peak MiB':>12}")
    mem = res.get("memory_bytes", {})
    for k in ("ours", "diffusers"):
        m = [f"{mem[k][f] / mib:12.0f}" if k in mem else f"{'-':>12}" for f in ("saved", "peak")]
        print(f"{k:12}{res['step_s'][k]:10.3f}{res['cpu_s'][k]:10.3f}"
              f"{res['tflops'][k] * 1e12 / res['peak']['flops']:9.1%}{m[0]}{m[1]}")
    ratios = [f"{res[k]:12.3f}" if k in res else f"{'-':>12}" for k in ("saved_ratio", "peak_ratio")]
    print(f"{'ratio':12}{res['time_ratio']:10.3f}{res['cpu_ratio']:10.3f}{'':9}{ratios[0]}{ratios[1]}")
    print("targets: time <= 1.0, activation peak <= 0.8")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--small", action="store_true", help="the small shape (a quick smoke run)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--shape", choices=list(SHAPES), default=None,
                   help="default: small with --small, ltx2.3-121x704x1280 on cuda, else cpu")
    p.add_argument("--variant", choices=VARIANTS, default=None, help="the flags of LTX-2.0 / 2.3 / 2.5 (default 2.3)")
    p.add_argument("--layers", type=int, default=None, help="blocks (default: the shape's 2)")
    p.add_argument("--no-memory", action="store_true")
    p.add_argument("--json", default=None, help="also write the figures to this file")
    p.add_argument("--_memory-of", choices=("ours", "diffusers"), help=argparse.SUPPRESS)  # subprocess mode
    p.add_argument("--_shape-json", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args._memory_of:
        if args.threads:
            torch.set_num_threads(args.threads)
        print(json.dumps(_measure_memory(args._memory_of, json.loads(args._shape_json), args.device)))
        return 0
    res = run(args.device, args.repeats, args.small, args.threads, args.shape, args.variant, args.layers,
              memory=not args.no_memory)
    print_table(res)
    write_json(res, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
