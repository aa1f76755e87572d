"""The Wan 2.1 I2V / FLF2V parity figures of the README, printed (not a test: the tests assert bounds):

    PYTHONPATH=. python tests/parity_figures_clip.py

the DiT's image branch against diffusers' WanTransformer3DModel (small widths, then Wan's CLIP sizes in
the original, diffusers and ComfyUI key layouts), and sampling end to end against diffusers'
WanImageToVideoPipeline on the tiny random folders of tests/test_sampling_reference.py."""
import pathlib
import sys
import tempfile

import numpy as np
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import test_dit as td
import test_dit_loading as tl
import test_sampling_reference as tsr

from video_dit.families.wan.loading import load_dit, load_image_encoder, load_vae
from video_dit.families.wan.pipeline import VideoPipeline

# 1. DiT image branch vs diffusers WanTransformer3DModel (small widths; Wan sizes in 3 layouts below)
for image in ("i2v", "flf2v"):
    ref = td.reference(in_dim=36, out_dim=16, image=image); ours = td.ours_from(ref)
    x, t, _ = td.inputs(ours); ctx = torch.randn(2, 512, td.TEXT_DIM)
    clip = torch.randn(2, ours.config.image_context_len, td.IMAGE_DIM)
    with torch.no_grad():
        e = ref(x, t, ctx, encoder_hidden_states_image=clip.reshape(-1, td.IMAGE_TOKENS, td.IMAGE_DIM), return_dict=False)[0]
        g = ours(x, t, ctx, clip_fea=clip)
    print(f"DiT {image} small: max|diff|/max|ref| = {((g - e).abs().max() / e.abs().max()).item():.2e}")
for image in ("i2v", "flf2v"):
    ref = tl.wan21_image_reference(image)
    for layout in ("native", "diffusers", "comfyui"):
        with tempfile.TemporaryDirectory() as d:
            tl.save_in_layout(ref, layout, f"{d}/dit.safetensors")
            m = load_dit(f"{d}/dit.safetensors")
            print(f"DiT {image} (image_dim 1280, {257 * m.config.num_images} tokens) {layout}: "
                  f"{tl.image_parity(m, ref, m.config.num_images):.2e}")
# 2. e2e vs WanImageToVideoPipeline (UniPC on Wan's grid, 4 steps, CFG 3, 5 frames 32x32)
class F:  # pytest's tmp_path_factory, as the folder builder takes it
    def mktemp(self, name):
        return pathlib.Path(tempfile.mkdtemp(prefix=name))
for kind in ("i2v_clip", "flf2v_clip"):
    pipe, folder = tsr._folder(F(), kind)
    pipe.scheduler = tsr.SCHEDULERS["unipc-wan"]()
    dit, vae = load_dit(folder).eval(), load_vae(folder).eval()
    ours = VideoPipeline(dit, vae, image_encoder=load_image_encoder(folder))
    prompt, negative, latents, image, last_image = tsr._inputs(vae.config.z_dim)
    last = last_image if kind == "flf2v_clip" else None
    with torch.no_grad():
        ref = pipe(prompt_embeds=tsr._padded(prompt), negative_prompt_embeds=tsr._padded(negative), image=image,
                   **({} if last is None else {"last_image": last}), height=32, width=32, num_frames=5,
                   num_inference_steps=4, guidance_scale=3.0, latents=latents.clone(), output_type="np",
                   return_dict=False)[0]
        z = ours.generate_latents(prompt, negative, num_frames=5, height=32, width=32, steps=4, guidance_scale=3.0,
                                  shift=tsr.SHIFT, first_frame=image, latents=latents, last_frame=last,
                                  solver="unipc", grid="reference")
        video = vae.decode(vae.denormalize(z))
    frames = (video / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 4, 1).numpy()
    print(f"e2e {kind}: frames max|diff| = {np.abs(frames - ref).max():.2e} (frame values 0..1, std {ref.std():.3f})")
