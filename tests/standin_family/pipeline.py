"""Embeds in, PIL frames out: the stand-in family's text-to-video sampling (Euler on its own grid).

    prompt embeds [(Lt_i, text_dim)] -+
    noise (B, z, F', h, w) -----------+-> `flow_sample` (video_dit.diffusion.sampler): Euler steps on
                                          `standin_schedule`, guidance batched -> latents
                                      -> `decode_videos` (VAE) -> B lists of F PIL frames
"""

from __future__ import annotations

import torch
from torch import nn

from video_dit.data.frames import snap_size
from video_dit.diffusion.flow import NUM_TRAIN_TIMESTEPS, SamplingSchedule, check_schedule, shift_sigmas
from video_dit.diffusion.pipeline_parts import as_embeds_list, config_of, decode_videos
from video_dit.diffusion.sampler import flow_sample, module_dtype_device


def standin_schedule(steps: int, shift: float, solver: str = "euler", grid: str = "reference") -> SamplingSchedule:
    """The stand-in's grid: sigmas = shift(linspace(1, 0, steps + 1)) in float32, timesteps = sigmas[:-1] x 1000.
    Euler only (UniPC cannot start at sigma 1)."""
    check_schedule(steps, shift, solver, solvers=("euler",))
    if grid != "reference":
        raise ValueError(f"schedule grid {grid!r}: the stand-in family samples on its own grid only; "
                         "accepted: reference")
    sigmas = shift_sigmas(torch.linspace(1.0, 0.0, steps + 1), shift)
    return SamplingSchedule(solver, sigmas, sigmas[:-1] * NUM_TRAIN_TIMESTEPS)


class StandinPipeline:
    """Sample videos from a `StandinDiT` (or any module called as `dit(x, t, context)`, a DeepSpeed engine
    included) and a `StandinVAE`. Text-to-video only: the DiT reads no first frame."""

    def __init__(self, dit: nn.Module, vae: nn.Module):
        self.dit, self.vae = dit, vae
        self.dit_config, self.vae_config = config_of(dit, "dit"), config_of(vae, "vae")
        if self.dit_config.in_channels != self.vae_config.z_dim:
            raise ValueError(f"the DiT reads {self.dit_config.in_channels} latent channels, the VAE makes "
                             f"{self.vae_config.z_dim}")
        self.temporal, self.spatial = self.vae_config.temporal_compression, self.vae_config.spatial_compression
        self.divisibility = self.spatial * self.dit_config.patch_size[1]

    @torch.no_grad()
    def generate(self, prompt_embeds, negative_embeds=None, num_frames: int = 9, height: int = 32, width: int = 32,
                 steps: int = 8, guidance_scale: float = 2.0, shift: float = 3.0,
                 generator: torch.Generator | None = None, first_frame=None, image_embeds=None,
                 solver: str = "euler", grid: str = "reference", progress: bool = False):
        """prompt_embeds: one (Lt, text_dim) tensor -> F PIL frames; a list of B -> B lists of them.
        negative_embeds: one for all or B, required when guidance_scale != 1. The noise is drawn on the
        generator's device (CPU by default) in float32. first_frame / image_embeds: refused (t2v only)."""
        if first_frame is not None or image_embeds is not None:
            raise ValueError("the stand-in family is text-to-video only: it takes no first frame or image embeds")
        prompts = as_embeds_list(prompt_embeds, "prompt_embeds")
        B = len(prompts)
        negatives = None
        if negative_embeds is not None:
            negatives = as_embeds_list(negative_embeds, "negative_embeds")
            negatives = negatives * B if len(negatives) == 1 and B > 1 else negatives
        num_frames, height, width = snap_size(num_frames, height, width, self.temporal, self.divisibility, stacklevel=2)
        schedule = standin_schedule(steps, shift, solver, grid)
        _, device = module_dtype_device(self.dit)
        shape = (B, self.vae_config.z_dim, (num_frames - 1) // self.temporal + 1, height // self.spatial,
                 width // self.spatial)
        noise = torch.randn(shape, generator=generator,
                            device=generator.device if generator is not None else "cpu").to(device)
        latents = flow_sample(self.dit, noise, prompts, schedule, negative_context=negatives,
                              guidance_scale=guidance_scale, progress=progress)
        videos = decode_videos(self.vae, latents)
        return videos[0] if isinstance(prompt_embeds, torch.Tensor) else videos

    def decode(self, latents: torch.Tensor):
        return decode_videos(self.vae, latents)
