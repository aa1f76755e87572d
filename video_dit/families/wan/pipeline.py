"""Embeds in, PIL frames out: text-to-video and image-to-video sampling.

    prompt embeds [(Lt_i, D)] ---------+
    noise or latents= (B, C, F', h, w) -+--> solver steps (schedule.wan_schedule: UniPC or Euler):
    first (+ last) frame (B, 3, H, W) -> encode_conditioning (VAE) --^   conditioning -> dit(x, t,
      (Wan 2.1 I2V / FLF2V: + image_features (CLIP) or image_embeds=) --^   context, clip_fea) -> guidance
                                                                            -> step
                                               VAE decode (B, 3, F, H, W) -> PIL frames

The pipeline never sees text: encode prompts with `TextEncoder.encode` (or read cached embeds).
With the same weights, embeds, initial latents and settings it samples what diffusers' `WanPipeline` /
`WanImageToVideoPipeline` sample (tests/test_sampling_reference.py); the defaults here are Wan's
generate.py ones (UniPC on Wan's grid, 50 steps, shift 5, guidance 5); `Preset` carries each model's.
"""

from __future__ import annotations

import torch
from PIL import Image
from torch import nn

from video_dit.data.frames import snap_size
from video_dit.diffusion.conditioning import (
    I2V_MODES,
    MASK_CHANNELS,
    FirstFrameConditioning,
    clip_features,
    encode_conditioning,
)
from video_dit.diffusion.pipeline_parts import as_embeds_list, config_of, decode_videos, fit_frame
from video_dit.diffusion.sampler import flow_sample, module_dtype_device
from video_dit.families.wan.schedule import wan_schedule
from video_dit.media import pil_to_tensor


def vae_factors(vae_config) -> tuple[int, int]:
    """(temporal, spatial) compression of a Wan-style VAE config: (4, 8) for Wan 2.1, (4, 16) for 2.2."""
    temporal = 2 ** sum(bool(d) for d in vae_config.temperal_downsample)
    spatial = 2 ** (len(vae_config.dim_mult) - 1) * vae_config.patch_size
    return temporal, spatial



class VideoPipeline:
    """Sample videos from a DiT and a VAE.

    dit: a `VideoDiT`, or any module called once per step as `dit(x, t, context)` (a DeepSpeed engine:
    its config is read from `.module.config`; else pass `dit_config`), or a `TwoExperts` (Wan 2.2
    A14B: each step runs the expert of its timestep, `guidance_scale_2` the low-noise expert's scale).
    vae: a `CausalVideoVAE`.
    In i2v replace mode the clean first-frame tokens get t = 0 (per-token timesteps, as in training:
    the one `FirstFrameConditioning` decides it; see conditioning.py). The i2v mode follows from the DiT config:
    in_dim == out_dim + 4 + z_dim is concat (Wan I2V, in_dim 36), in_dim == out_dim is replace;
    `i2v_mode`, when given, is checked against it (a clear error instead of a wrong conditioning).
    image_encoder: the CLIP `ImageEncoder` of a DiT with the image branch (Wan 2.1 I2V / FLF2V), run
    once per `generate` on the given image(s); or pass `image_embeds=` to `generate` instead.
    """

    def __init__(self, dit: nn.Module, vae: nn.Module, *, i2v_mode: str | None = None, dit_config=None,
                 image_encoder: nn.Module | None = None):
        self.dit, self.vae, self.image_encoder = dit, vae, image_encoder
        self.dit_config = dit_config if dit_config is not None else config_of(dit, "dit")
        self.vae_config = config_of(vae, "vae")
        cfg, z = self.dit_config, self.vae_config.z_dim
        if cfg.out_dim != z:
            raise ValueError(f"DiT out_dim {cfg.out_dim} does not match the VAE's z_dim {z}")
        if cfg.in_dim == cfg.out_dim:
            natural = "replace"
        elif cfg.in_dim == cfg.out_dim + MASK_CHANNELS + z:
            natural = "concat"
        else:
            raise ValueError(f"DiT in_dim {cfg.in_dim} fits neither t2v/replace ({cfg.out_dim}) "
                             f"nor concat i2v ({cfg.out_dim + MASK_CHANNELS + z})")
        if i2v_mode is not None and i2v_mode not in I2V_MODES:
            raise ValueError(f"unknown i2v_mode {i2v_mode!r}; accepted: {', '.join(I2V_MODES)}")
        if i2v_mode is not None and i2v_mode != natural:
            raise ValueError(f"i2v_mode {i2v_mode!r} does not fit a DiT with in_dim {cfg.in_dim} "
                             f"(that DiT takes {natural!r})")
        self.i2v_mode = natural
        self.temporal, self.spatial = vae_factors(self.vae_config)
        self.divisibility = self.spatial * cfg.patch_size[1]

    # ---------------------------------------------------------------- sizes
    def snap(self, num_frames: int, height: int, width: int) -> tuple[int, int, int]:
        """`num_frames` down to 4k + 1 and height/width down to the divisibility (VAE x patch), with a
        warning when anything changed; never below one latent frame / one patch."""
        return snap_size(num_frames, height, width, self.temporal, self.divisibility, stacklevel=2)

    # ---------------------------------------------------------------- sampling
    @torch.no_grad()
    def generate_latents(self, prompt_embeds, negative_embeds=None, num_frames: int = 17, height: int = 480,
                         width: int = 832, steps: int = 50, guidance_scale: float = 5.0, shift: float = 5.0,
                         generator: torch.Generator | None = None, first_frame=None,
                         guidance_scale_2: float | None = None,
                         i2v_mode: str | None = None, progress: bool = False, solver: str = "unipc",
                         grid: str = "reference", latents: torch.Tensor | None = None, last_frame=None,
                         image_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Sampled normalized latents (B, C, F', h, w) float32; arguments as for `generate`."""
        prompts = as_embeds_list(prompt_embeds, "prompt_embeds")
        B = len(prompts)
        negatives = None
        if negative_embeds is not None:
            negatives = as_embeds_list(negative_embeds, "negative_embeds")
            if len(negatives) == 1 and B > 1:
                negatives = negatives * B
            if len(negatives) != B:
                raise ValueError(f"{len(negatives)} negative embeds for {B} prompts (give 1 or {B})")
        if i2v_mode is not None and i2v_mode != self.i2v_mode:
            raise ValueError(f"i2v_mode {i2v_mode!r} does not fit this DiT (in_dim {self.dit_config.in_dim} "
                             f"takes {self.i2v_mode!r})")
        if first_frame is None and self.i2v_mode == "concat":
            raise ValueError(f"this DiT (in_dim {self.dit_config.in_dim}) is image-to-video: pass first_frame")
        cfg = self.dit_config
        two_images = cfg.image_dim is not None and cfg.num_images == 2
        if last_frame is not None and (first_frame is None or self.i2v_mode != "concat" or (
                cfg.image_dim is not None and not two_images)):
            raise ValueError("last_frame needs first_frame and a first-last-frame DiT (concat; a CLIP image branch "
                             "must read two images, Wan 2.1 FLF2V)")
        if two_images and last_frame is None and image_embeds is None:
            raise ValueError("this DiT is first-last-frame (Wan 2.1 FLF2V: its image branch reads two images): "
                             "pass last_frame")
        if cfg.image_dim is None and image_embeds is not None:
            raise ValueError("image_embeds given, but this DiT has no CLIP image branch")
        if cfg.image_dim is not None and image_embeds is None and self.image_encoder is None:
            raise ValueError("this DiT has the CLIP image branch (Wan 2.1 I2V / FLF2V): build the pipeline with "
                             "image_encoder= or pass image_embeds=")
        num_frames, height, width = self.snap(num_frames, height, width)
        schedule = wan_schedule(steps, shift, solver, grid)  # checks steps, shift, solver and grid first

        # 1. initial latents: `latents` as given, or noise drawn on the generator's device (CPU by
        #    default, as diffusers' randn_tensor does with a CPU generator) so a seed means the same
        #    video anywhere; float32 either way
        _, device = module_dtype_device(self.dit)
        shape = (B, self.vae_config.z_dim, (num_frames - 1) // self.temporal + 1,
                 height // self.spatial, width // self.spatial)
        if latents is not None:
            if tuple(latents.shape) != shape:
                raise ValueError(f"latents have shape {tuple(latents.shape)}; {B} video(s) of {num_frames} frames "
                                 f"at {height}x{width} need {shape}")
            noise = latents.to(device=device, dtype=torch.float32)
        else:
            noise = torch.randn(shape, generator=generator,
                                device=generator.device if generator is not None else "cpu").to(device)
        # 2. first-frame conditioning latents (and the last frame's), and the CLIP features, computed once
        conditioning = cond = None
        if first_frame is not None:
            pixels = _pixels(first_frame, B, "first_frame", (height, width))  # (B, 3, H, W)
            last = _pixels(last_frame, B, "last_frame", (height, width)) if last_frame is not None else None
            conditioning = FirstFrameConditioning(self.i2v_mode, patch_size=tuple(self.dit_config.patch_size),
                                                  last_frame=last is not None)
            cond = encode_conditioning(self.vae, pixels, self.i2v_mode, num_frames, last_frame=last)
            if cfg.image_dim is not None:  # CLIP sees the images as given, as in Wan (not the resized frames)
                if image_embeds is None:
                    image_embeds = image_features(self.image_encoder, first_frame, last_frame, B)
                if image_embeds.ndim == 2:
                    image_embeds = image_embeds[None]
                cond["clip_features"] = image_embeds.expand(B, -1, -1) if image_embeds.shape[0] == 1 else image_embeds
            cond = {k: v.to(device) for k, v in cond.items()}
        # 3. the solver
        return flow_sample(self.dit, noise, prompts, schedule, negative_context=negatives,
                           guidance_scale=guidance_scale, guidance_scale_2=guidance_scale_2,
                           conditioning=conditioning, cond=cond, progress=progress)

    def decode(self, latents: torch.Tensor) -> list[list[Image.Image]]:
        """Normalized latents (B, C, F', h, w) -> B lists of F PIL frames (VAE decode, one video at a time)."""
        return decode_videos(self.vae, latents)

    def generate(self, prompt_embeds, negative_embeds=None, num_frames: int = 17, height: int = 480,
                 width: int = 832, steps: int = 50, guidance_scale: float = 5.0, shift: float = 5.0,
                 generator: torch.Generator | None = None, first_frame=None, i2v_mode: str | None = None,
                 progress: bool = False, solver: str = "unipc", grid: str = "reference",
                 latents: torch.Tensor | None = None, last_frame=None, image_embeds: torch.Tensor | None = None,
                 guidance_scale_2: float | None = None):
        """Render videos as PIL frames.

        prompt_embeds: one (Lt, D) tensor -> returns list[PIL.Image] (F frames); or a list of B (Lt_i, D)
        tensors -> returns B such lists. negative_embeds: one (Lt, D) for all prompts or B of them;
        required when guidance_scale != 1 (guidance 1 runs the conditional pass alone). With two experts,
        guidance_scale is the high-noise expert's and guidance_scale_2 the low-noise one's (None: the same).
        num_frames (snapped to 4k + 1), height, width (snapped to the divisibility). steps, shift, solver
        ("unipc", Wan's default, or "euler") and grid ("reference": Wan's, or "diffusers" for a diffusers folder's
        UniPC) pick the schedule, `wan_schedule(steps, shift, solver, grid)`.
        generator: seeds the noise. latents: initial latents (B, C, F', h, w) used instead of drawn
        noise, as diffusers' pipelines take them. first_frame: a PIL image, a (3, H, W) / (B, 3, H, W)
        tensor in [-1, 1], or a list of B PIL images; resized to cover height x width and
        centre-cropped; makes it image-to-video in the DiT's i2v mode. last_frame: the same for the
        last frame of a first-last-frame DiT (Wan 2.1 FLF2V). image_embeds: (B or 1, Li, C) CLIP features
        (`image_features`) for a DiT with the image branch, instead of running the pipeline's
        image_encoder on the images (the trainer's previews encode them once at start-up).
        i2v_mode: optional check that the DiT's mode is the one expected. progress: a tqdm bar.
        """
        latents = self.generate_latents(prompt_embeds, negative_embeds, num_frames=num_frames, height=height,
                                        width=width, steps=steps, guidance_scale=guidance_scale, shift=shift,
                                        generator=generator, first_frame=first_frame, i2v_mode=i2v_mode,
                                        progress=progress, solver=solver, grid=grid, latents=latents,
                                        last_frame=last_frame, image_embeds=image_embeds,
                                        guidance_scale_2=guidance_scale_2)
        videos = self.decode(latents)
        return videos[0] if isinstance(prompt_embeds, torch.Tensor) else videos



def _pixels(images, batch: int, name: str, size: tuple[int, int] | None = None) -> torch.Tensor:
    """A PIL image, a list of B of them, or a (3, H, W) / (B, 3, H, W) tensor in [-1, 1] -> (batch, 3, H, W).
    With size = (height, width) each image is resized to cover it and centre-cropped (`fit_frame`: the
    frames the VAE encodes); without, the images are left as given (the CLIP encoder resizes them to
    its own input, as Wan feeds it the original image), so a list must share one size."""
    if isinstance(images, Image.Image):
        images = [images]
    if isinstance(images, (list, tuple)):
        tensors = [pil_to_tensor(im)[None] for im in images]
        if size is not None:
            tensors = [fit_frame(t, *size) for t in tensors]
        elif len({tuple(t.shape) for t in tensors}) > 1:
            raise ValueError(f"{name}: images of different sizes {sorted({im.size for im in images})}; give one size")
        images = torch.cat(tensors)
    if not isinstance(images, torch.Tensor):
        raise TypeError(f"{name} must be a PIL image, a list of them or a tensor, got {type(images).__name__}")
    x = images[None] if images.ndim == 3 else images
    if x.ndim != 4 or x.shape[1] != 3:
        raise ValueError(f"{name} tensor must be (3, H, W) or (B, 3, H, W), got {tuple(images.shape)}")
    if x.shape[0] == 1 and batch > 1:
        x = x.expand(batch, -1, -1, -1)
    if x.shape[0] != batch:
        raise ValueError(f"{x.shape[0]} {name} images for {batch} prompts (give 1 or {batch})")
    return fit_frame(x, *size) if size is not None else x


@torch.no_grad()
def image_features(image_encoder, first_frame, last_frame=None, batch: int = 1) -> torch.Tensor:
    """CLIP features (batch, Li, C) float32 for a DiT's image branch: the first frame's (Li = tokens)
    or [first | last] (Li = 2 tokens, first-last-frame), from the images as given (Wan encodes the
    original image, not the one resized to the video); images as for `generate`'s first_frame."""
    last = _pixels(last_frame, batch, "last_frame") if last_frame is not None else None
    return clip_features(image_encoder, _pixels(first_frame, batch, "first_frame"), last)  # (batch, Li, C)
