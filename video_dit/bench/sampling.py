"""Sampling benchmark: seconds per denoising step and per rendered second of video, through
`video_dit.families.wan.pipeline.VideoPipeline` (UniPC steps, its default, with classifier-free guidance, then VAE
decode to PIL frames), with random weights of a preset.

    python -m video_dit.bench.sampling [--small] [--repeats 3] [--device cpu|cuda]
    video-dit bench --suite sampling

per step        = median seconds of `generate_latents(steps=S)` / S (one CFG-batched DiT call per step)
decode          = median seconds of `VideoPipeline.decode` (VAE decode + PIL conversion)
per video second = (S_ref * per step + decode) / (num_frames / fps), at S_ref = 30 steps (Wan's
                  generate.py uses 40-50), so it reads as "seconds of compute per second of rendered video".
"""

from __future__ import annotations

import argparse
import sys

import torch

from video_dit.bench.common import median, write_json
from video_dit.devices import timed
from video_dit.families import get_preset
from video_dit.families.wan.dit import VideoDiT, cast_dit
from video_dit.families.wan.pipeline import VideoPipeline
from video_dit.families.wan.vae import CausalVideoVAE

# tiny preset (the demo's DiT and VAE), at the demo size and at a larger frame
FULL = dict(preset="tiny", frames=17, height=256, width=256, steps=4, guidance=5.0, text_len=32)
SMALL = dict(preset="tiny", frames=9, height=64, width=64, steps=2, guidance=5.0, text_len=16)
REFERENCE_STEPS = 30


def build(shape: dict, device: str, dtype: torch.dtype):
    """(pipeline, prompt embeds, negative embeds, fps) with seeded random weights."""
    preset = get_preset(shape["preset"])
    torch.manual_seed(0)
    dit = cast_dit(VideoDiT(preset.dit).to(device), dtype).eval()  # as load_dit(dtype=...) stores it
    with torch.no_grad():  # the head is zero-initialised; give it weights so the steps do real work
        dit.head.head.weight.normal_(std=0.02)
    vae = CausalVideoVAE(preset.vae).to(device=device).eval()  # float32, as `video-dit sample` decodes
    g = torch.Generator().manual_seed(1)
    prompt = torch.randn(shape["text_len"], preset.dit.text_dim, generator=g)
    negative = torch.randn(shape["text_len"] // 2, preset.dit.text_dim, generator=g)
    return VideoPipeline(dit, vae), prompt, negative, preset.fps


def run(device: str = "cpu", repeats: int = 3, small: bool = False, threads: int | None = None) -> dict:
    if threads:
        torch.set_num_threads(threads)
    shape = SMALL if small else FULL
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    pipe, prompt, negative, fps = build(shape, device, dtype)
    kw = dict(num_frames=shape["frames"], height=shape["height"], width=shape["width"], steps=shape["steps"],
              guidance_scale=shape["guidance"])

    def denoise():
        return pipe.generate_latents(prompt, negative, generator=torch.Generator().manual_seed(0), **kw)

    latents = denoise()  # warm-up
    pipe.decode(latents)
    denoise_s = [timed(denoise, device) for _ in range(repeats)]
    decode_s = [timed(lambda: pipe.decode(latents), device) for _ in range(repeats)]
    per_step = median(denoise_s) / shape["steps"]
    decode = median(decode_s)
    video_seconds = shape["frames"] / fps
    res = {
        "config": {**shape, "fps": fps, "latent_shape": list(latents.shape), "device": device,
                   "dtype": str(dtype).removeprefix("torch."), "threads": torch.get_num_threads(),
                   "repeats": repeats, "reference_steps": REFERENCE_STEPS},
        "step_s": per_step, "decode_s": decode, "denoise_s_all": denoise_s, "decode_s_all": decode_s,
        "video_seconds": video_seconds,
        "s_per_video_second": (REFERENCE_STEPS * per_step + decode) / video_seconds,
    }
    return res


def print_table(res: dict) -> None:
    c = res["config"]
    print(f"Sampling, preset {c['preset']}, {c['frames']} x {c['height']} x {c['width']} (latents "
          f"{tuple(c['latent_shape'])}), CFG {c['guidance']}, {c['dtype']}, {c['device']}, {c['threads']} threads, "
          f"median of {c['repeats']}")
    per_video = f"s / video s @{c['reference_steps']} steps"
    print(f"{'s / step':>12}{'decode s':>12}{per_video:>28}")
    print(f"{res['step_s']:12.4f}{res['decode_s']:12.4f}{res['s_per_video_second']:28.3f}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--small", action="store_true")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", default=None, help="also write the figures to this file")
    args = p.parse_args(argv)
    res = run(args.device, args.repeats, args.small, args.threads)
    print_table(res)
    write_json(res, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
