"""The HunyuanVideo 1.5 sampling parity figures of the README, printed (not a test: the tests assert bounds):

    PYTHONPATH=. python tests/parity_figures_hy15.py

diffusers' HunyuanVideo15Pipeline / HunyuanVideo15ImageToVideoPipeline against our pipeline on the tiny
random folders of tests/test_hunyuan15_pipeline.py (fp32, CPU): the sampled latents from the same initial
latents (t2v, i2v, i2v step-distilled), and the decoded frames from the same seed (t2v, i2v), as
max |diff| and max |diff| / max |reference|."""
import pathlib
import sys
import tempfile
from dataclasses import replace

import numpy as np
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import test_hunyuan15_pipeline as T  # noqa: E402

from video_dit.families.hunyuan15.presets import TINY_HY15_DIT
from video_dit.families.wan.loading import load_dit


def show(what, ours, ref):
    ours, ref = np.asarray(ours, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    diff = np.abs(ours - ref).max()
    print(f"{what}: max|diff| = {diff:.2e}, max|diff|/max|ref| = {diff / np.abs(ref).max():.2e}")


root = pathlib.Path(tempfile.mkdtemp())
for kind in ("t2v", "i2v"):
    pipe = T._pipe(kind)
    pipe.save_pretrained(root / kind)
    ours, prompt, negative = T._ours(root / kind, kind)
    first = T._image() if kind == "i2v" else None
    kw = dict(num_frames=T.FRAMES, height=T.HEIGHT, width=T.WIDTH, steps=T.STEPS, guidance_scale=T.CFG,
              shift=T.SHIFT, first_frame=first)
    ref = T._reference(pipe, kind, latents=T._latents(), output_type="latent")
    show(f"{kind} latents", ours.generate_latents(prompt, negative, latents=T._latents(), **kw), ref)
    ref = T._reference(pipe, kind, generator=torch.Generator().manual_seed(T.SEED), output_type="np")
    z = ours.generate_latents(prompt, negative, generator=torch.Generator().manual_seed(T.SEED), **kw)
    with torch.no_grad():
        video = ours.vae.decode(ours.vae.denormalize(z))
    show(f"{kind} frames (0..1)", (video / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 4, 1).numpy(), ref)
    if kind == "i2v":
        pipe.transformer = T._transformer(replace(TINY_HY15_DIT, use_meanflow=True), 5)
        pipe.transformer.save_pretrained(root / "meanflow" / "transformer")
        ours.dit = load_dit(root / "meanflow", family="hunyuan15").eval()
        ours.dit_config = ours.dit.config
        ref = T._reference(pipe, kind, latents=T._latents(), output_type="latent")
        show("i2v step-distilled latents", ours.generate_latents(prompt, negative, latents=T._latents(), **kw), ref)
