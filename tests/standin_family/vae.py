"""The stand-in family's VAE: a causal patch autoencoder (one Linear each way), for the contract test.

    video (B, 3, F, H, W) in [-1, 1], F = t k + 1
      frame 0 alone        -> patches (1, s, s)  -> encode_first (3 s^2 -> 2 z)   -> latent frame 0
      frames 1..F-1 by t   -> patches (t, s, s)  -> encode_rest (3 t s^2 -> 2 z)  -> latent frames 1..k
      -> (mean, logvar) (B, z, k + 1, H/s, W/s): `DiagonalGaussian`
    latents (B, z, k + 1, h, w) -> decode_first / decode_rest -> unpatchify -> (B, 3, t k + 1, H, W)

Causal by construction: latent frame j reads pixel frames <= t j only (frame 0 by itself, as the
families' causal VAEs encode it). `normalize` / `denormalize` map between the posterior's latents and
the DiT's (per-channel mean and std of the config)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from video_dit.models.causal_conv import DiagonalGaussian, FirstFrameKept
from video_dit.models.common import initialize_by_name


@dataclass(frozen=True)
class StandinVAEConfig(FirstFrameKept):
    """`z_dim`, `spatial_compression` and the frame rule (`FirstFrameKept`: t k + 1) are the contract's `VAEShape`."""

    z_dim: int = 4
    spatial_compression: int = 8
    temporal_compression: int = 4
    latents_mean: tuple[float, ...] = (0.1, -0.1, 0.05, 0.0)
    latents_std: tuple[float, ...] = (0.9, 1.1, 1.0, 0.8)

    def __post_init__(self):
        if len(self.latents_mean) != self.z_dim or len(self.latents_std) != self.z_dim:
            raise ValueError(f"StandinVAEConfig: latents_mean / latents_std need {self.z_dim} values each")


@torch.no_grad()
def _init(cfg, name: str, t: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Xavier-uniform weights, zero biases (the patch Linears)."""
    values = torch.zeros(t.shape)
    if name.endswith(".weight"):
        nn.init.xavier_uniform_(values, generator=generator)
    return t.copy_(values)


class StandinVAE(nn.Module):
    def __init__(self, config: StandinVAEConfig, init_seed: int | None = None):
        super().__init__()
        self.config = cfg = config
        s, t, z = cfg.spatial_compression, cfg.temporal_compression, cfg.z_dim
        self.encode_first, self.encode_rest = nn.Linear(3 * s * s, 2 * z), nn.Linear(3 * t * s * s, 2 * z)
        self.decode_first, self.decode_rest = nn.Linear(z, 3 * s * s), nn.Linear(z, 3 * t * s * s)
        initialize_by_name(self, _init, cfg, init_seed)

    @property
    def dtype(self) -> torch.dtype:
        return self.encode_first.weight.dtype

    def encode(self, video: torch.Tensor) -> DiagonalGaussian:
        """(B, 3, F, H, W) in [-1, 1], F = t k + 1, H and W multiples of s -> the posterior over
        (B, z, k + 1, H/s, W/s)."""
        B, C, Fr, H, W = video.shape
        s, t = self.config.spatial_compression, self.config.temporal_compression
        if C != 3 or (Fr - 1) % t or H % s or W % s:
            raise ValueError(f"video has shape {tuple(video.shape)}; expected (B, 3, {t}k + 1, H, W) with H, W "
                             f"multiples of {s}")
        h, w, k = H // s, W // s, (Fr - 1) // t
        x = video.to(self.dtype)
        first = x[:, :, :1].reshape(B, 3, 1, h, s, w, s).permute(0, 2, 3, 5, 1, 4, 6).reshape(B, 1, h, w, -1)
        rest = x[:, :, 1:].reshape(B, 3, k, t, h, s, w, s).permute(0, 2, 4, 6, 1, 3, 5, 7).reshape(B, k, h, w, -1)
        moments = torch.cat([self.encode_first(first), self.encode_rest(rest)], dim=1)  # (B, k + 1, h, w, 2z)
        mean, logvar = moments.permute(0, 4, 1, 2, 3).chunk(2, dim=1)  # (B, z, k + 1, h, w) each
        return DiagonalGaussian(mean, logvar.clamp(-30.0, 20.0))

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        """(B, z_dim, k + 1, h, w) latents (denormalized) -> (B, 3, t k + 1, h s, w s), unclamped."""
        B, Z, K, h, w = z.shape
        s, t = self.config.spatial_compression, self.config.temporal_compression
        if Z != self.config.z_dim:
            raise ValueError(f"latents have {Z} channels; this VAE's z_dim is {self.config.z_dim}")
        z = z.to(self.dtype).permute(0, 2, 3, 4, 1)  # (B, K, h, w, z)
        first = self.decode_first(z[:, :1]).view(B, 1, h, w, 3, 1, s, s)
        rest = self.decode_rest(z[:, 1:]).view(B, K - 1, h, w, 3, t, s, s)
        frames = torch.cat([first.permute(0, 4, 1, 5, 2, 6, 3, 7).reshape(B, 3, 1, h * s, w * s),
                            rest.permute(0, 4, 1, 5, 2, 6, 3, 7).reshape(B, 3, (K - 1) * t, h * s, w * s)], dim=2)
        return frames  # (B, 3, t (K - 1) + 1, H, W)

    def _stats(self, like: torch.Tensor):
        shape = (1, -1, 1, 1, 1)
        mean = torch.tensor(self.config.latents_mean, device=like.device, dtype=like.dtype).view(shape)
        std = torch.tensor(self.config.latents_std, device=like.device, dtype=like.dtype).view(shape)
        return mean, std

    def normalize(self, z: torch.Tensor) -> torch.Tensor:
        mean, std = self._stats(z)
        return (z - mean) / std

    def denormalize(self, z: torch.Tensor) -> torch.Tensor:
        mean, std = self._stats(z)
        return z * std + mean
