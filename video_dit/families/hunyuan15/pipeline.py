"""Embeds in, PIL frames out: HunyuanVideo 1.5 text-to-video and image-to-video sampling.

    prompt embeds [(text (Lt_i, 3584), glyph (Lg_i, 1472))]; negatives: text only (no glyph, as Tencent)
    noise or latents= (B, 32, F', h, w) -------------------------------------------+
    first frame (i2v) -> fit to H x W -> VAE -> first-frame latents -> HY15Conditioning  -> Euler steps on
                                     \\-> SigLIP -> image embeds --------------------^   Tencent's grid:
                                                          dit([x | cond | mask], t, text, glyph, image)
                                                          -> guidance (scale > 1) -> x += dsigma * v
                                                 VAE decode (B, 3, F, H, W) -> PIL frames

The pipeline never sees text: encode prompts with `HY15PromptEncoder.encode` (both text encoders).
With the same weights, embeds, initial latents and settings it samples what diffusers'
`HunyuanVideo15Pipeline` / `HunyuanVideo15ImageToVideoPipeline` sample (tests/test_hunyuan15_pipeline.py).
Where the references disagree, Tencent's (hyvideo/pipelines/hunyuan_video_pipeline.py) is followed:
  - the negative prompt gets no glyph tokens (Tencent `_prepare_byt5_embeddings` encodes "" for it;
    diffusers encodes the negative prompt's quoted text): they differ only when the negative quotes text;
  - guidance runs when the scale is > 1 (Tencent `do_classifier_free_guidance`; diffusers' guider runs it
    for any scale but 1): they differ only for scales below 1;
  - the first frame is resized to cover H x W with LANCZOS and centre-cropped (Tencent
    `get_image_condition_latents`); diffusers derives H x W from the image and its `target_size`
    instead: for an image of the video's size both leave it as it is;
  - the schedule is Tencent's float32 torch grid (flow.sampling_schedule grid "hunyuan": an ulp from
    diffusers' numpy one).
The step-distilled model (`use_meanflow`) is told the next timestep too (0 at the last step), as both do.
"""

from __future__ import annotations

import torch
from PIL import Image
from torch import nn
from tqdm.auto import tqdm

from video_dit.data.frames import snap_size
from video_dit.diffusion.flow import NUM_TRAIN_TIMESTEPS, SamplingSchedule, check_schedule, shift_sigmas
from video_dit.diffusion.pipeline_parts import config_of, decode_videos, fit_frame
from video_dit.diffusion.sampler import module_dtype_device
from video_dit.families.hunyuan15.conditioning import HY15Conditioning, encode_hy15_conditioning, text_inputs
from video_dit.families.hunyuan15.encoders import HY15PromptEmbeds
from video_dit.media import pil_to_tensor


def fit_image(image: Image.Image, height: int, width: int) -> Image.Image:
    """Tencent's resize of the reference image: scale to cover height x width (sides rounded), LANCZOS,
    then centre-crop (torchvision's Resize + CenterCrop on a PIL image, `get_image_condition_latents`)."""
    w0, h0 = image.size
    if (w0, h0) == (width, height):
        return image.convert("RGB")
    scale = max(width / w0, height / h0)
    w1, h1 = max(width, round(w0 * scale)), max(height, round(h0 * scale))
    image = image.convert("RGB").resize((w1, h1), Image.LANCZOS)
    top, left = int(round((h1 - height) / 2.0)), int(round((w1 - width) / 2.0))
    return image.crop((left, top, left + width, top + height))


class HunyuanVideo15Pipeline:
    """Sample videos from a `HunyuanVideo15DiT` and a `HunyuanVideo15VAE`.

    dit: the DiT, or any module called once per step as `dit(x, t, context, context_mask, glyph,
    glyph_mask, image_embeds, image_mask, timestep_r)` (a DeepSpeed engine: its config is read from
    `.module.config`; else pass `dit_config`). image_encoder: the `HY15ImageEncoder` (SigLIP) run on the
    first frame of an i2v `generate`; or pass `image_embeds=` instead. Whether a checkpoint is meant for
    t2v or i2v is the front end's to check (`spec.ModelSpec.task`): the network takes both.
    """

    def __init__(self, dit: nn.Module, vae: nn.Module, *, image_encoder: nn.Module | None = None, dit_config=None):
        self.dit, self.vae, self.image_encoder = dit, vae, image_encoder
        self.dit_config = dit_config if dit_config is not None else config_of(dit, "dit")
        self.vae_config = config_of(vae, "vae")
        cfg, z = self.dit_config, self.vae_config.z_dim
        if cfg.out_channels != z or not cfg.concat_condition or cfg.in_channels != z:
            raise ValueError(f"the DiT reads {cfg.patch_in_channels} channels and writes {cfg.out_channels}; with "
                             f"the VAE's {z} latent channels it must read {2 * z + 1} ([latents | first frame | "
                             f"mask], concat_condition) and write {z}")
        self.temporal, self.spatial = self.vae_config.temporal_compression, self.vae_config.spatial_compression
        self.divisibility = self.spatial * cfg.patch_size[1]

    def snap(self, num_frames: int, height: int, width: int) -> tuple[int, int, int]:
        """`num_frames` down to 4k + 1 and height/width down to the divisibility (VAE x patch), with a
        warning when anything changed; never below one latent frame / one patch."""
        return snap_size(num_frames, height, width, self.temporal, self.divisibility, stacklevel=2)

    @torch.no_grad()
    def generate_latents(self, prompt_embeds, negative_embeds=None, num_frames: int = 17, height: int = 480,
                         width: int = 832, steps: int = 50, guidance_scale: float = 6.0, shift: float = 5.0,
                         generator: torch.Generator | None = None, first_frame=None,
                         latents: torch.Tensor | None = None, image_embeds: torch.Tensor | None = None,
                         solver: str = "euler", grid: str = "reference", progress: bool = False) -> torch.Tensor:
        """Sampled normalized latents (B, C, F', h, w) float32; arguments as for `generate`."""
        prompts = _as_prompts(prompt_embeds, "prompt_embeds")
        B = len(prompts)
        guided = guidance_scale > 1.0  # Tencent's do_classifier_free_guidance
        negatives = None
        if guided:
            if negative_embeds is None:
                raise ValueError(f"guidance scale {guidance_scale} needs negative embeds (encode '' or a negative "
                                 "prompt); use a guidance scale of 1 for none")
            negatives = _as_prompts(negative_embeds, "negative_embeds")
            negatives = negatives * B if len(negatives) == 1 and B > 1 else negatives
            if len(negatives) != B:
                raise ValueError(f"{len(negatives)} negative embeds for {B} prompts (give 1 or {B})")
        if (solver, grid) != ("euler", "reference"):
            raise ValueError(f"solver {solver!r} on grid {grid!r}: HunyuanVideo 1.5 samples with Euler on its own "
                             "grid (Tencent's FlowMatchDiscreteScheduler has no other solver); accepted: "
                             "solver='euler', grid='reference'")
        cfg = self.dit_config
        if image_embeds is not None and cfg.vision_projection == "none":
            raise ValueError("image_embeds given, but this DiT has no SigLIP branch (vision_projection='none')")
        if first_frame is not None and image_embeds is None and cfg.vision_projection != "none" \
                and self.image_encoder is None:
            raise ValueError("image-to-video needs the SigLIP image embeds: build the pipeline with image_encoder= "
                             "or pass image_embeds=")
        num_frames, height, width = self.snap(num_frames, height, width)
        schedule = hy15_schedule(steps, shift, solver, grid)  # checks steps and shift
        dtype, device = module_dtype_device(self.dit)

        # 1. initial latents: `latents` as given, or noise drawn on the generator's device (CPU by default,
        #    as diffusers' randn_tensor with a CPU generator), float32 either way
        shape = (B, self.vae_config.z_dim, (num_frames - 1) // self.temporal + 1, height // self.spatial,
                 width // self.spatial)
        if latents is not None:
            if tuple(latents.shape) != shape:
                raise ValueError(f"latents have shape {tuple(latents.shape)}; {B} video(s) of {num_frames} frames "
                                 f"at {height}x{width} need {shape}")
            x = latents.to(device=device, dtype=torch.float32)
        else:
            x = torch.randn(shape, generator=generator,
                            device=generator.device if generator is not None else "cpu").to(device)
        # 2. the first frame's latents and SigLIP embeds (i2v), computed once
        conditioning, cond = HY15Conditioning(), None
        if first_frame is not None:
            pixels, images = _first_frames(first_frame, B, height, width)  # (B, 3, H, W), what SigLIP reads
            encoder = self.image_encoder if image_embeds is None and cfg.vision_projection != "none" else None
            cond = encode_hy15_conditioning(self.vae, pixels, encoder, images)
            if image_embeds is not None:
                cond["image_embeds"] = image_embeds[None] if image_embeds.ndim == 2 else image_embeds
            if "image_embeds" in cond and cond["image_embeds"].shape[0] == 1 and B > 1:
                cond["image_embeds"] = cond["image_embeds"].expand(B, -1, -1)
            cond = {k: v.to(device) for k, v in cond.items()}
        # 3. the text stream, padded and masked: [prompts | negatives] under guidance
        glyphs = [p.glyph for p in prompts] + ([p.glyph[:0] for p in prompts] if guided else [])  # negatives: none
        pair = 2 if guided else 1
        extra = {k: torch.cat([v] * pair) for k, v in conditioning.dit_kwargs(cond).items()}
        kwargs = dict(**text_inputs([p.text for p in prompts] + ([n.text for n in negatives] if guided else []),
                                    glyphs, device=device, dtype=dtype),
                      **{k: v.to(device=device, dtype=dtype) for k, v in extra.items()})
        steps_ = tqdm(range(schedule.steps), desc="sampling", unit="step") if progress else range(schedule.steps)
        sigmas, timesteps = schedule.sigmas, schedule.timesteps
        for i in steps_:
            # 4. this step's input: [x | first frame | mask], both guidance halves in one batch
            t = timesteps[i].to(device=device, dtype=torch.float32).expand(B)  # (B,)
            model_in, t_in, _ = conditioning.apply(x, t, cond)  # (B, 2C + 1, F', h, w)
            t_r = None
            if cfg.use_meanflow:  # the step-distilled model is told where the step lands
                nxt = timesteps[i + 1] if i + 1 < schedule.steps else torch.tensor(0.0)
                t_r = torch.cat([nxt.to(device=device, dtype=torch.float32).expand(B)] * pair)
            v = self.dit(torch.cat([model_in] * pair), torch.cat([t_in] * pair), timestep_r=t_r, **kwargs).float()
            # 5. guidance (Tencent's and diffusers' order) and the Euler step in float32
            if guided:
                v_cond, v_uncond = v.chunk(2)
                v = v_uncond + guidance_scale * (v_cond - v_uncond)
            x = x + (sigmas[i + 1] - sigmas[i]).to(device) * v
        return conditioning.restore(x, cond)

    def decode(self, latents: torch.Tensor) -> list[list[Image.Image]]:
        """Normalized latents (B, C, F', h, w) -> B lists of F PIL frames."""
        return decode_videos(self.vae, latents)

    def generate(self, prompt_embeds, negative_embeds=None, num_frames: int = 17, height: int = 480,
                 width: int = 832, steps: int = 50, guidance_scale: float = 6.0, shift: float = 5.0,
                 generator: torch.Generator | None = None, first_frame=None, latents: torch.Tensor | None = None,
                 image_embeds: torch.Tensor | None = None, solver: str = "euler", grid: str = "reference",
                 progress: bool = False):
        """Render videos as PIL frames.

        prompt_embeds: one `HY15PromptEmbeds` (text (Lt, D), glyph (Lg, Dg)) or a (Lt, D) text tensor
        (no glyph) -> returns list[PIL.Image] (F frames); or a list of B of them -> B such lists.
        negative_embeds: one for all prompts or B of them (their glyph is not used); required when
        guidance_scale > 1 (1 or below runs the conditional pass alone, as Tencent).
        num_frames (snapped to 4k + 1), height, width (snapped to multiples of 16). steps, shift: the
        Euler schedule on Tencent's grid (solver / grid accept only "euler" / "reference").
        generator: seeds the noise; latents: initial latents (B, C, F', h, w) instead of drawn noise.
        first_frame: a PIL image (or a list of B), or a (3, H, W) / (B, 3, H, W) tensor in [-1, 1]:
        fitted to height x width (`fit_image`) and made image-to-video. image_embeds: (B or 1, Li, D)
        SigLIP embeds instead of running the pipeline's image_encoder. progress: a tqdm bar.
        """
        latents = self.generate_latents(prompt_embeds, negative_embeds, num_frames=num_frames, height=height,
                                        width=width, steps=steps, guidance_scale=guidance_scale, shift=shift,
                                        generator=generator, first_frame=first_frame, latents=latents,
                                        image_embeds=image_embeds, solver=solver, grid=grid, progress=progress)
        videos = self.decode(latents)
        return videos if isinstance(prompt_embeds, list) else videos[0]


def _as_prompts(embeds, name: str) -> list[HY15PromptEmbeds]:
    """One or a list of `HY15PromptEmbeds` / (Lt, D) text tensors -> a list of `HY15PromptEmbeds`."""
    items = embeds if isinstance(embeds, list) else [embeds]
    if not items:
        raise ValueError(f"{name} is empty")
    out = []
    for i, e in enumerate(items):
        if isinstance(e, torch.Tensor):
            e = HY15PromptEmbeds(e, e.new_zeros(0, 0))
        if not isinstance(e, tuple) or e.text.ndim != 2 or e.glyph.ndim != 2:
            raise ValueError(f"{name}[{i}] must be an HY15PromptEmbeds (text (Lt, D), glyph (Lg, Dg)) or a (Lt, D) "
                             f"tensor, got {type(e).__name__}")
        out.append(HY15PromptEmbeds(*e))
    return out


def _first_frames(images, batch: int, height: int, width: int):
    """The first frame(s) fitted to the video: ((batch, 3, H, W) in [-1, 1] for the VAE, what SigLIP reads:
    the fitted PIL images (as both references give it), or for tensors None (the VAE's pixels))."""
    if isinstance(images, Image.Image):
        images = [images]
    if isinstance(images, (list, tuple)):
        fitted = [fit_image(im, height, width) for im in images]
        pixels = torch.stack([pil_to_tensor(im) for im in fitted])  # (N, 3, H, W)
    elif isinstance(images, torch.Tensor):
        x = images[None] if images.ndim == 3 else images
        if x.ndim != 4 or x.shape[1] != 3:
            raise ValueError(f"first_frame tensor must be (3, H, W) or (B, 3, H, W), got {tuple(images.shape)}")
        fitted, pixels = None, fit_frame(x, height, width)
    else:
        raise TypeError(f"first_frame must be a PIL image, a list of them or a tensor, got {type(images).__name__}")
    if pixels.shape[0] == 1 and batch > 1:
        pixels, fitted = pixels.expand(batch, -1, -1, -1), None if fitted is None else fitted * batch
    if pixels.shape[0] != batch:
        raise ValueError(f"{pixels.shape[0]} first_frame images for {batch} prompts (give 1 or {batch})")
    return pixels, fitted


def hy15_schedule(steps: int, shift: float, solver: str = "euler", grid: str = "reference") -> SamplingSchedule:
    """HunyuanVideo 1.5's schedule: Tencent's `FlowMatchDiscreteScheduler(shift=shift).set_timesteps(steps)`
    (hyvideo/schedulers/scheduling_flow_match_discrete.py lines 127-142):
        s = shift(torch.linspace(1, 0, steps + 1)) in float32 torch: starts at pure noise, ends at 0
        timesteps = s[:-1] * 1000 (float32); sigmas = s
    diffusers' HunyuanVideo15 pipelines pass the same grid as `sigmas=np.linspace(1, 0, steps + 1)[:-1]` to
    `FlowMatchEulerDiscreteScheduler` and shift it in numpy float32: at most an ulp apart. Tencent's is
    followed. UniPC cannot start at s = 1 (its log-SNR is -inf there): this grid is Euler's only."""
    check_schedule(steps, shift, solver, solvers=("euler",))
    if grid != "reference":
        raise ValueError(f"schedule grid {grid!r}: HunyuanVideo 1.5 samples on its own grid only; accepted: reference")
    sigmas = shift_sigmas(torch.linspace(1.0, 0.0, steps + 1), shift)  # float32, as Tencent's
    return SamplingSchedule(solver, sigmas, sigmas[:-1] * NUM_TRAIN_TIMESTEPS)
