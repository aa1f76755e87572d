"""What every family's pipeline shares: the conditioning frame fitted to the output size (`fit_frame`),
normalized latents decoded to PIL frames (`decode_videos`), the config of a possibly wrapped module
(`config_of`) and the per-prompt embeds check (`as_embeds_list`)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F_
from PIL import Image
from torch import nn

from video_dit.diffusion.sampler import module_dtype_device
from video_dit.media import tensor_to_pil


def config_of(module: nn.Module, what: str):
    """`module.config`, looking through one wrapper level (`.module`, as DeepSpeed engines have)."""
    for m in (module, getattr(module, "module", None)):
        config = getattr(m, "config", None)
        if config is not None:
            return config
    raise ValueError(f"cannot find the {what} config on {type(module).__name__}; pass {what}_config=")


@torch.no_grad()
def decode_videos(vae: nn.Module, latents: torch.Tensor) -> list[list[Image.Image]]:
    """Normalized latents (B, C, F', h, w) -> B lists of F PIL frames, one video at a time through `vae`
    (any VAE with `denormalize` and `decode` -> (1, 3, F, H, W) in [-1, 1]: Wan's, HunyuanVideo 1.5's)."""
    dtype, device = module_dtype_device(vae)
    videos = []
    for z in latents:
        z = vae.denormalize(z[None].to(device=device, dtype=dtype))
        video = vae.decode(z)[0].float().clamp(-1, 1)  # (3, F, H, W)
        videos.append(tensor_to_pil(video.transpose(0, 1)))
    return videos


def as_embeds_list(embeds, name: str) -> list[torch.Tensor]:
    items = [embeds] if isinstance(embeds, torch.Tensor) else list(embeds)
    if not items:
        raise ValueError(f"{name} is empty")
    for i, e in enumerate(items):
        if not isinstance(e, torch.Tensor) or e.ndim != 2:
            raise ValueError(f"{name}[{i}] must be a 2D (Lt, D) tensor, got "
                             f"{tuple(e.shape) if isinstance(e, torch.Tensor) else type(e).__name__}")
    return items


def fit_frame(pixels: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """(B, 3, H0, W0) -> (B, 3, height, width): resize to cover, then centre-crop (aspect kept)."""
    h0, w0 = pixels.shape[-2:]
    if (h0, w0) == (height, width):
        return pixels
    scale = max(height / h0, width / w0)
    h1, w1 = max(height, math.ceil(h0 * scale)), max(width, math.ceil(w0 * scale))
    x = F_.interpolate(pixels.float(), size=(h1, w1), mode="bicubic", align_corners=False, antialias=True)
    top, left = (h1 - height) // 2, (w1 - width) // 2
    return x[:, :, top:top + height, left:left + width].clamp(-1, 1)
