"""Sampling end to end against diffusers' Wan pipelines: a tiny random diffusers folder (as
`WanPipeline.save_pretrained` / `WanImageToVideoPipeline.save_pretrained` write it) sampled by
diffusers in memory and by us from the folder (our loaders, our `VideoPipeline`), with the same prompt
embeds, initial latents and settings, gives the same latents and frames (fp32, within LATENT_ATOL and
FRAME_ATOL: 1% more guidance, or a latent statistic off by 1% of its std, fails them): text-to-video,
Wan 2.2 TI2V-style image-to-video (first-frame latent replace, diffusers' `expand_timesteps`), Wan 2.2
I2V-style channel concat without an image encoder, and Wan 2.1 I2V / FLF2V (concat + the transformer's
CLIP image branch + a CLIP image encoder and processor; FLF2V with a last image); UniPC on diffusers'
grid and on Wan's, and Euler."""

import helpers
import numpy as np
import pytest
import torch
from PIL import Image

from video_dit.families import get_preset
from video_dit.families.wan.convert import vae_config_to_diffusers
from video_dit.families.wan.loading import load_dit, load_image_encoder, load_vae
from video_dit.families.wan.pipeline import VideoPipeline
from video_dit.families.wan.vae import VAEConfig

diffusers = pytest.importorskip("diffusers")

FRAMES, SIZE, STEPS, SHIFT, CFG = 5, 32, 4, 3.0, 3.0
# Tolerances from the measured errors (2-core x86 CPU, torch 2.13, diffusers 0.42.1), each CASE:
# latents (magnitude 5-7): measured max |diff| 3.2e-6 .. 8.3e-6 (concat / euler), tolerance 1e-4 (12x the
# largest); 1% more guidance moves them 2.3e-4 .. 4.6e-4, so it fails. Frames (in [0, 1]): measured 5.1e-7 ..
# 1.9e-6, tolerance 2e-5 (10x); a latent statistic off by 1% of its std moves them 8.8e-4 or more.
LATENT_ATOL, FRAME_ATOL = 1e-4, 2e-5
TEXT_DIM = get_preset("tiny").text_encoder.d_model  # 64: the t2v folder carries the tiny umT5 + ByT5 tokenizer
# 8x spatial, 4x temporal VAEs: Wan 2.1's layout (t2v, concat) and Wan 2.2's patchified residual one (TI2V)
VAE21 = VAEConfig(dim=4, z_dim=4, dim_mult=(1, 2, 2, 2), num_res_blocks=1,
                  mean=(0.1, -0.2, 0.3, 0.0), std=(1.5, 0.8, 1.2, 2.0))
VAE22 = VAEConfig(dim=4, dec_dim=8, z_dim=6, dim_mult=(1, 2, 2), num_res_blocks=1,
                  temperal_downsample=(True, True), is_residual=True, patch_size=2,
                  mean=tuple(0.1 * i for i in range(6)), std=(2.0, 1.0, 0.5, 1.5, 1.0, 0.7))


class WanGridUniPC(diffusers.UniPCMultistepScheduler):
    """diffusers' UniPC on Wan's sigma grid: Wan's FlowUniPCMultistepScheduler(shift=1)
    .set_timesteps(n, shift) (wan/utils/fm_solvers_unipc.py) is diffusers' UniPC with the grid
    linspace(sigma_max, 0, n + 1)[:-1], sigma_max = float32(0.999) the first of its training sigmas,
    written out here; diffusers then shifts it by flow_shift and feeds int64(sigma * 1000) as Wan does."""

    def set_timesteps(self, num_inference_steps=None, device=None, sigmas=None, mu=None):
        grid = np.linspace(float(np.float32(0.999)), 0.0, num_inference_steps + 1)[:-1]
        super().set_timesteps(device=device, sigmas=grid)


SCHEDULERS = {
    "unipc": lambda: diffusers.UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                                       flow_shift=SHIFT),
    "unipc-wan": lambda: WanGridUniPC(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=SHIFT),
    "euler": lambda: diffusers.FlowMatchEulerDiscreteScheduler(shift=SHIFT),
}
OURS = {"unipc": dict(solver="unipc", grid="diffusers"), "unipc-wan": dict(solver="unipc", grid="reference"),
        "euler": dict(solver="euler")}


def _transformer(in_dim, out_dim, seed, image=None):
    """The suite's small diffusers Wan transformer (image: None, "i2v" or "flf2v" at the tiny CLIP's 32 wide,
    17 tokens), with a larger head so steps move the latents."""
    ref = helpers.diffusers_wan(in_dim, out_dim, seed, text_dim=TEXT_DIM, image=image, image_dim=32, image_tokens=17)
    with torch.no_grad():
        ref.proj_out.weight.mul_(4.0)
    return ref


def _clip_parts():
    """A tiny random CLIP vision model (32 wide, 32 px in 8 px patches: 17 tokens) and its processor at
    that size (so diffusers' resize and crop leave a 32 x 32 image as it is, and Wan's resize too)."""
    from transformers import CLIPImageProcessor, CLIPVisionModel

    from video_dit.families.wan.image_encoder import clip_vision_config
    from video_dit.families.wan.presets import TINY_CLIP

    torch.manual_seed(4)
    encoder = CLIPVisionModel(clip_vision_config(TINY_CLIP)).eval()
    processor = CLIPImageProcessor(size={"shortest_edge": SIZE}, crop_size={"height": SIZE, "width": SIZE})
    return encoder, processor


def _folder(tmp_path_factory, kind):
    """(diffusers pipeline in memory, its save_pretrained folder) for kind t2v | ti2v | concat | i2v_clip
    | flf2v_clip (Wan 2.1 I2V / FLF2V: concat + the transformer's image branch + a CLIP image encoder)."""
    vae_cfg = VAE22 if kind == "ti2v" else VAE21
    z = vae_cfg.z_dim
    torch.manual_seed(1)
    vae = diffusers.AutoencoderKLWan(**vae_config_to_diffusers(vae_cfg)).eval()
    clip = kind in ("i2v_clip", "flf2v_clip")
    transformer = _transformer(z + 4 + z if kind in ("concat", "i2v_clip", "flf2v_clip") else z, z, seed=2,
                               image=None if not clip else "flf2v" if kind == "flf2v_clip" else "i2v")
    common = dict(tokenizer=None, text_encoder=None, vae=vae, scheduler=SCHEDULERS["unipc"](), transformer=transformer)
    if kind == "t2v":  # with a (tiny) text encoder, so `video-dit sample` can run on the folder as it is
        from transformers import ByT5Tokenizer

        from video_dit.families.wan.text_encoder import build_umt5

        common.update(tokenizer=ByT5Tokenizer(), text_encoder=build_umt5(get_preset("tiny").text_encoder, seed=4))
        pipe = diffusers.WanPipeline(**common)
    elif clip:
        encoder, processor = _clip_parts()
        pipe = diffusers.WanImageToVideoPipeline(**common, image_encoder=encoder, image_processor=processor)
    else:  # Wan 2.2 TI2V (expand_timesteps) or Wan 2.2 I2V-style concat, both without a CLIP image encoder
        pipe = diffusers.WanImageToVideoPipeline(**common, image_encoder=None, image_processor=None,
                                                 expand_timesteps=kind == "ti2v")
    pipe.set_progress_bar_config(disable=True)
    folder = tmp_path_factory.mktemp(f"wan_{kind}")
    pipe.save_pretrained(folder)
    return pipe, folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return {kind: _folder(tmp_path_factory, kind) for kind in ("t2v", "ti2v", "concat", "i2v_clip", "flf2v_clip")}


def _inputs(z, seed=3):
    g = torch.Generator().manual_seed(seed)
    prompt, negative = torch.randn(5, TEXT_DIM, generator=g), torch.randn(3, TEXT_DIM, generator=g)
    latents = torch.randn(1, z, (FRAMES - 1) // 4 + 1, SIZE // 8, SIZE // 8, generator=g)
    image, last = (Image.fromarray((torch.rand(SIZE, SIZE, 3, generator=g) * 255).to(torch.uint8).numpy())
                   for _ in range(2))
    return prompt, negative, latents, image, last


def _padded(embeds, length=512):
    """diffusers' `encode_prompt` output: the prompt's tokens zero-padded to max_sequence_length (512),
    what our DiT does to each (L_i, D) context itself (text_len 512, from the folder's config)."""
    return torch.nn.functional.pad(embeds, (0, 0, 0, length - embeds.shape[0]))[None]


# every kind x solver compares the sampled latents; one run per kind also decodes and compares frames
# (the VAE decode, equal to diffusers' on its own, is most of the time and does not depend on the solver)
CASES = [("t2v", "unipc", True), ("t2v", "unipc-wan", False), ("t2v", "euler", False),
         ("ti2v", "unipc", True), ("ti2v", "euler", False),
         ("concat", "unipc-wan", True), ("concat", "unipc", False), ("concat", "euler", False),
         ("i2v_clip", "unipc-wan", True), ("flf2v_clip", "unipc-wan", True)]


@pytest.mark.parametrize("kind,scheduler,decode", CASES)
def test_sampling_equals_diffusers_pipeline(folders, kind, scheduler, decode):
    pipe, folder = folders[kind]
    pipe.scheduler = SCHEDULERS[scheduler]()
    dit, vae = load_dit(folder).eval(), load_vae(folder).eval()
    clip = kind in ("i2v_clip", "flf2v_clip")
    ours = VideoPipeline(dit, vae, image_encoder=load_image_encoder(folder) if clip else None)
    assert ours.i2v_mode == ("concat" if kind in ("concat", "i2v_clip", "flf2v_clip") else "replace")
    assert (dit.config.image_dim, dit.config.num_images) == ((32, 1 + (kind == "flf2v_clip")) if clip else (None, 1))
    prompt, negative, latents, image, last_image = _inputs(vae.config.z_dim)
    first = None if kind == "t2v" else image
    last = last_image if kind == "flf2v_clip" else None

    def reference(output_type):
        return pipe(prompt_embeds=_padded(prompt), negative_prompt_embeds=_padded(negative),
                    **({} if first is None else {"image": first}), **({} if last is None else {"last_image": last}),
                    height=SIZE, width=SIZE, num_frames=FRAMES, num_inference_steps=STEPS, guidance_scale=CFG,
                    latents=latents.clone(), output_type=output_type, return_dict=False)[0]

    def sample(guidance_scale):
        return ours.generate_latents(prompt, negative, num_frames=FRAMES, height=SIZE, width=SIZE, steps=STEPS,
                                     guidance_scale=guidance_scale, shift=SHIFT, first_frame=first, latents=latents,
                                     last_frame=last, **OURS[scheduler])

    with torch.no_grad():
        ref = reference("latent")  # normalized latents (1, C, F', h, w), the clean first frame restored in TI2V
        z = sample(CFG)
        assert float((ref - latents).abs().mean()) > 0.05  # the steps moved them
        torch.testing.assert_close(z, ref, rtol=0, atol=LATENT_ATOL)
        assert (sample(1.01 * CFG) - ref).abs().max() > LATENT_ATOL  # the comparison sees 1% more guidance
        if not decode:
            return
        ref = reference("np")

        def frames(latents):  # as diffusers' "np" output
            video = vae.decode(vae.denormalize(latents))  # (1, 3, F, H, W) in [-1, 1]
            return (video / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 4, 1).numpy()

        got = frames(z)
        off = z.clone()
        off[:, 0] += 0.01  # as if channel 0's latent mean were off by 1% of its std
        off = frames(off)
    assert got.shape == ref.shape == (1, FRAMES, SIZE, SIZE, 3)
    assert float(np.std(ref)) > 0.02  # not a flat or saturated video: the comparison means something
    np.testing.assert_allclose(got, ref, rtol=0, atol=FRAME_ATOL)
    assert np.abs(off - ref).max() > FRAME_ATOL  # the comparison sees a latent statistic off


def test_sample_command_takes_solver_and_shift_from_the_scheduler_config(folders, tmp_path, capsys):
    """`video-dit sample` on the diffusers folder: UniPC on diffusers' grid at the config's flow_shift
    (3, not the default 5), said in one line; the MP4 is the one our pipeline renders with those
    settings (the pipeline equals diffusers' above)."""
    from video_dit.cli import main as cli
    from video_dit.families.wan.loading import load_text_encoder
    from video_dit.media import write_video

    _, folder = folders["t2v"]
    args = ["sample", "--model", str(folder), "--prompt", "a red ball", "--negative", "blurry", "--frames", str(FRAMES),
            "--height", str(SIZE), "--width", str(SIZE), "--steps", "2", "--cfg", str(CFG), "--seed", "5"]
    assert cli(args + ["--out", str(tmp_path / "cli.mp4")]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("sampling:"))
    config = str(folder / "scheduler" / "scheduler_config.json")
    assert line == (f"sampling: unipc on diffusers' grid, 2 steps, shift 3, guidance 3, negative prompt 'blurry' "
                    f"[solver, shift: {config}; steps: --steps; guidance: --cfg; negative: --negative]")
    te = load_text_encoder(folder)
    embeds = te.encode(["a red ball", "blurry"])
    frames = VideoPipeline(load_dit(folder).eval(), load_vae(folder).eval()).generate(
        embeds[0], embeds[1], num_frames=FRAMES, height=SIZE, width=SIZE, steps=2, guidance_scale=CFG, shift=SHIFT,
        solver="unipc", grid="diffusers", generator=torch.Generator().manual_seed(5))
    write_video(frames, tmp_path / "direct.mp4", fps=16)
    assert (tmp_path / "cli.mp4").read_bytes() == (tmp_path / "direct.mp4").read_bytes()
    # the command's --solver / --shift win over the folder's config, and the line says so
    assert cli(args + ["--solver", "euler", "--shift", "5", "--out", str(tmp_path / "euler.mp4")]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("sampling:"))
    assert line.startswith("sampling: euler, 2 steps, shift 5,") and "scheduler_config" not in line
