"""The causal video VAE (Wan 2.1 / Wan 2.2), weight-compatible with the original checkpoints.

Dataflow (Wan 2.1 sizes: dim 96, z 16, 8x space, 4x time; Wan 2.2: 2x2 patchify first, z 48, 16x space)

    video (B, 3, F, H, W) in [-1, 1], F = 4k + 1
      -> patchify p x p                        (B, 3p^2, F, H/p, W/p)          Wan 2.2 only
      -> chunks of 1, 4, 4, ... frames, each through the encoder with one CausalCache:
         conv1 -> downsamples (res blocks, 2x space / 2x time) -> middle (res, attn, res) -> head
                                               (B, 2z, 1 per chunk, h, w)
      -> conv1 (1x1)                           (B, 2z, F', h, w)  F' = (F - 1) // 4 + 1
      -> posterior: mean, logvar               (B, z, F', h, w)
    z (B, z, F', h, w)
      -> conv2 (1x1) -> latent frames one at a time through the decoder with one CausalCache:
         conv1 -> middle -> upsamples (res blocks, 2x space / 2x time) -> head
                                               (B, 3p^2, 1 then 4 per latent frame, H/p, W/p)
      -> unpatchify, clamp                     (B, 3, F, H, W) in [-1, 1]

Causality is a property of one layer: `CausalConv3d` sees only past frames, which come either
from zero padding (the clip start) or from the `CausalCache` (the previous chunk). Every module
takes `(x, cache)`; the cache is the only state carried between chunks. Parameter names are the
original Wan checkpoint names (`encoder.downsamples.0.residual.2.weight`, `conv1`, `conv2`, ...).

The layers (the chunk cache, `CausalConv3d`, norms, residual / attention / resample blocks) are in
`vae_layers.py`; this file holds the configuration, the encoder and decoder built from them, the
posterior and `CausalVideoVAE` (chunked encode / decode, tiling).
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, field, fields

import torch
from torch import nn

from video_dit.families.wan.vae_layers import (
    AttentionBlock,
    Down_ResidualBlock,
    Resample,
    ResidualBlock,
    Up_ResidualBlock,
)
from video_dit.models.causal_conv import CausalCache, CausalConv3d, DiagonalGaussian, RMS_norm, inplace_ok
from video_dit.models.causal_conv import FirstFrameKept

# ---------------------------------------------------------------- configuration


@dataclass
class VAEConfig(FirstFrameKept):
    """Field names are the original Wan VAE constructor names (`temperal` is Wan's spelling)."""

    dim: int = 96
    z_dim: int = 16
    dim_mult: tuple[int, ...] = (1, 2, 4, 4)
    num_res_blocks: int = 2
    attn_scales: tuple[float, ...] = ()
    temperal_downsample: tuple[bool, ...] = (False, True, True)
    dropout: float = 0.0
    # Wan 2.2 only: decoder width, residual up/down blocks, 2x2 pixel patchify.
    dec_dim: int | None = None
    is_residual: bool = False
    patch_size: int = 1
    # Per-channel latent statistics: the DiT sees (z - mean) / std.
    mean: tuple[float, ...] = field(default_factory=tuple)
    std: tuple[float, ...] = field(default_factory=tuple)

    def __post_init__(self):
        for name in ("dim_mult", "attn_scales", "temperal_downsample", "mean", "std"):
            setattr(self, name, tuple(getattr(self, name)))
        if len(self.temperal_downsample) != len(self.dim_mult) - 1:
            raise ValueError(f"VAEConfig.temperal_downsample has {len(self.temperal_downsample)} entries; "
                             f"expected len(dim_mult) - 1 = {len(self.dim_mult) - 1}")
        for name in ("mean", "std"):
            if getattr(self, name) and len(getattr(self, name)) != self.z_dim:
                raise ValueError(f"VAEConfig.{name} has {len(getattr(self, name))} entries; "
                                 f"expected z_dim = {self.z_dim} (or none)")
        if self.std and min(self.std) <= 0:
            raise ValueError(f"VAEConfig.std must be positive, got min {min(self.std)}")
        if self.patch_size not in (1, 2, 4):
            raise ValueError(f"VAEConfig.patch_size={self.patch_size}; accepted: 1, 2, 4")
        if self.is_residual and self.attn_scales:
            raise ValueError("VAEConfig.attn_scales must be empty when is_residual=True "
                             "(the Wan 2.2 layout has attention only in the middle blocks)")

    @property
    def decoder_dim(self) -> int:
        return self.dim if self.dec_dim is None else self.dec_dim

    @property
    def spatial_compression(self) -> int:
        """Pixels per latent cell along H and W: 8 (Wan 2.1) or 16 (Wan 2.2, 2x2 patchify)."""
        return 2 ** (len(self.dim_mult) - 1) * self.patch_size

    @property
    def temporal_compression(self) -> int:
        """Pixel frames per latent frame after the first: 4 for both Wan VAEs."""
        return 2 ** sum(bool(t) for t in self.temperal_downsample)

    @classmethod
    def from_dict(cls, d: dict) -> "VAEConfig":
        """Build from a dict of constructor names; an unknown key is an error naming the nearest one."""
        names = [f.name for f in fields(cls)]
        for key in d:
            if key not in names:
                close = difflib.get_close_matches(key, names, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise ValueError(f"unknown VAEConfig key {key!r}{hint}; valid keys: {', '.join(names)}")
        return cls(**d)



# ---------------------------------------------------------------- encoder / decoder


class Encoder3d(nn.Module):
    def __init__(self, cfg: VAEConfig):
        super().__init__()
        dims = [cfg.dim * u for u in (1, *cfg.dim_mult)]
        self.conv1 = CausalConv3d(3 * cfg.patch_size ** 2, dims[0], 3, padding=1)
        blocks, scale, last = [], 1.0, len(cfg.dim_mult) - 1
        for i, (in_dim, out_dim) in enumerate(zip(dims[:-1], dims[1:])):
            if cfg.is_residual:  # Wan 2.2: one residual down block per level
                blocks.append(Down_ResidualBlock(in_dim, out_dim, cfg.dropout, cfg.num_res_blocks,
                                                 temperal_downsample=i != last and cfg.temperal_downsample[i],
                                                 down_flag=i != last))
                continue
            for _ in range(cfg.num_res_blocks):  # Wan 2.1: a flat list
                blocks.append(ResidualBlock(in_dim, out_dim, cfg.dropout))
                if scale in cfg.attn_scales:
                    blocks.append(AttentionBlock(out_dim))
                in_dim = out_dim
            if i != last:
                blocks.append(Resample(out_dim, "downsample3d" if cfg.temperal_downsample[i] else "downsample2d"))
                scale /= 2.0
        self.downsamples = nn.Sequential(*blocks)
        self.middle = nn.Sequential(ResidualBlock(dims[-1], dims[-1], cfg.dropout), AttentionBlock(dims[-1]),
                                    ResidualBlock(dims[-1], dims[-1], cfg.dropout))
        self.head = nn.Sequential(RMS_norm(dims[-1], images=False), nn.SiLU(),
                                  CausalConv3d(dims[-1], cfg.z_dim * 2, 3, padding=1))
        # Index into downsamples of the first block that mixes frames other than causally (the
        # first temporal downsample); every layer before it is a stride-1 causal conv or per frame.
        self.frame_wise_until = min(
            (i for i, b in enumerate(self.downsamples)
             if (isinstance(b, Resample) and b.mode == "downsample3d") or (isinstance(b, Down_ResidualBlock) and b.ft == 2)),
            default=len(self.downsamples))

    def forward(self, x: torch.Tensor, cache: CausalCache) -> torch.Tensor:
        """x (B, 3p^2, T, H/p, W/p), T = 1 or 4 per chunk -> (B, 2z, 1, h, w) per chunk (whole clip: F')."""
        until = self.frame_wise_until
        if not inplace_ok() or x.shape[2] == 1:
            x = self.conv1(x, cache)
            for block in self.downsamples[:until]:
                x = block(x, cache)
        else:
            # The mirror of the decoder's frame-wise tail: the full-resolution levels before the first
            # temporal downsample run one frame at a time, carrying the cache, which is exact and keeps
            # their activations at one frame instead of the chunk's four.
            out = None
            for t in range(x.shape[2]):
                y = self.conv1(x[:, :, t:t + 1], cache)
                for block in self.downsamples[:until]:
                    y = block(y, cache)
                if out is None:
                    out = y.new_empty(*y.shape[:2], x.shape[2], *y.shape[3:])
                out[:, :, t:t + 1] = y
            x = out
        for block in (*self.downsamples[until:], *self.middle):
            x = block(x, cache)
        return self.head[2](x, cache, norm=self.head[0])


class Decoder3d(nn.Module):
    def __init__(self, cfg: VAEConfig):
        super().__init__()
        dim, mult = cfg.decoder_dim, cfg.dim_mult
        dims = [dim * u for u in (mult[-1], *mult[::-1])]
        temperal_upsample = cfg.temperal_downsample[::-1]
        self.conv1 = CausalConv3d(cfg.z_dim, dims[0], 3, padding=1)
        self.middle = nn.Sequential(ResidualBlock(dims[0], dims[0], cfg.dropout), AttentionBlock(dims[0]),
                                    ResidualBlock(dims[0], dims[0], cfg.dropout))
        blocks, scale, last = [], 1.0 / 2 ** (len(mult) - 2), len(mult) - 1
        for i, (in_dim, out_dim) in enumerate(zip(dims[:-1], dims[1:])):
            up_mode = None if i == last else ("upsample3d" if temperal_upsample[i] else "upsample2d")
            if cfg.is_residual:  # Wan 2.2: one residual up block per level
                blocks.append(Up_ResidualBlock(in_dim, out_dim, cfg.dropout, cfg.num_res_blocks + 1,
                                               temperal_upsample=up_mode == "upsample3d",
                                               up_flag=up_mode is not None))
                continue
            if i > 0:  # Wan 2.1: the previous Resample halved the channels
                in_dim //= 2
            for _ in range(cfg.num_res_blocks + 1):
                blocks.append(ResidualBlock(in_dim, out_dim, cfg.dropout))
                if scale in cfg.attn_scales:
                    blocks.append(AttentionBlock(out_dim))
                in_dim = out_dim
            if up_mode is not None:
                blocks.append(Resample(out_dim, up_mode, out_dim // 2))
                scale *= 2.0
        self.upsamples = nn.Sequential(*blocks)
        self.head = nn.Sequential(RMS_norm(dims[-1], images=False), nn.SiLU(),
                                  CausalConv3d(dims[-1], 3 * cfg.patch_size ** 2, 3, padding=1))
        # Index into (*middle, *upsamples) of the first block after the last temporal upsample.
        blocks = (*self.middle, *self.upsamples)
        self.frame_wise_from = 1 + max(
            (i for i, b in enumerate(blocks)
             if (isinstance(b, Resample) and b.mode == "upsample3d") or (isinstance(b, Up_ResidualBlock) and b.ft == 2)),
            default=-1)

    def forward(self, x: torch.Tensor, cache: CausalCache) -> torch.Tensor:
        """x (B, z, T', h, w) -> (B, 3p^2, 1 + 4 (T' - 1) on the first chunk / 4 T' after, H/p, W/p)."""
        x = self.conv1(x, cache)
        blocks = (*self.middle, *self.upsamples)
        for block in blocks[:self.frame_wise_from]:
            x = block(x, cache)
        if not inplace_ok() or x.shape[2] == 1:
            for block in blocks[self.frame_wise_from:]:
                x = block(x, cache)
            return self.head[2](x, cache, norm=self.head[0])
        # After the last temporal upsample every layer is a stride-1 causal conv (or per frame), so
        # running the full-resolution levels one frame at a time, carrying the cache, is exact and
        # keeps their activations at one frame instead of four.
        out = None
        for t in range(x.shape[2]):
            y = x[:, :, t:t + 1]
            for block in blocks[self.frame_wise_from:]:
                y = block(y, cache)
            y = self.head[2](y, cache, norm=self.head[0])  # (B, 3p^2, 1, H/p, W/p)
            if out is None:
                out = y.new_empty(*y.shape[:2], x.shape[2], *y.shape[3:])
            out[:, :, t:t + 1] = y
        return out


# ---------------------------------------------------------------- posterior



# ---------------------------------------------------------------- the VAE


def _patchify(x: torch.Tensor, p: int) -> torch.Tensor:
    """(B, C, F, H, W) -> (B, C p p, F, H/p, W/p), channel order (c, r, q) as in Wan 2.2."""
    if p == 1:
        return x
    B, C, T, H, W = x.shape
    x = x.view(B, C, T, H // p, p, W // p, p).permute(0, 1, 6, 4, 2, 3, 5)  # (B, C, r, q, T, h, w)
    return x.reshape(B, C * p * p, T, H // p, W // p)


class CausalVideoVAE(nn.Module):
    """Wan 2.1 / 2.2 causal video VAE. `encode(video)` -> posterior, `decode(z)` -> video.

    Both process the clip in the causal chunks the model was trained with (encode: 1 frame, then
    4 at a time; decode: 1 latent frame at a time), so peak memory is set by the chunk, not the
    clip length. `enable_tiling` adds spatial tiling with linear overlap blending.
    """

    def __init__(self, config: VAEConfig):
        super().__init__()
        self.config = config
        self.encoder = Encoder3d(config)
        self.conv1 = CausalConv3d(config.z_dim * 2, config.z_dim * 2, 1)  # diffusers: quant_conv
        self.conv2 = CausalConv3d(config.z_dim, config.z_dim, 1)  # diffusers: post_quant_conv
        self.decoder = Decoder3d(config)
        # Latent statistics: buffers so they follow .to(device), not saved (checkpoint keys stay Wan's).
        self.reset_latent_stats()
        self.tile_size: int | None = None  # pixels; None = no tiling
        self.tile_overlap = 0
        self.initialize_weights()

    def reset_latent_stats(self, device=None) -> None:
        """(Re)create the latent mean / std buffers from the config: non-persistent, so the state
        dict keys stay the checkpoint's, and they follow `.to(device)`."""
        cfg = self.config
        stats = (cfg.mean, cfg.std) if cfg.mean else ((0.0,) * cfg.z_dim, (1.0,) * cfg.z_dim)
        for name, values in zip(("latent_mean", "latent_std"), stats):
            self.register_buffer(name, torch.tensor(values, device=device).view(1, -1, 1, 1, 1), persistent=False)

    def initialize_weights(self) -> None:
        """Wan's init: PyTorch's default (Kaiming-uniform) for every conv, RMS gammas at one, and
        each attention block's output projection weight zeroed (attention starts as identity + bias)."""
        for m in self.modules():
            if isinstance(m, AttentionBlock):
                nn.init.zeros_(m.proj.weight)

    @property
    def device(self) -> torch.device:  # as VideoDiT and TextEncoder; ai-toolkit's trainer reads vae.device
        return self.encoder.conv1.weight.device

    @property
    def dtype(self) -> torch.dtype:  # ai-toolkit's trainer compares vae.dtype every step
        return self.encoder.conv1.weight.dtype

    # -------------------------------------------------------- shapes

    def latent_shape(self, video_shape) -> tuple[int, ...]:
        B, _, T, H, W = video_shape
        s, t = self.config.spatial_compression, self.config.temporal_compression
        return (B, self.config.z_dim, (T - 1) // t + 1, H // s, W // s)

    def _check_video(self, video: torch.Tensor) -> None:
        t, s = self.config.temporal_compression, self.config.spatial_compression
        if video.ndim != 5 or video.shape[1] != 3:
            raise ValueError(f"VAE.encode expects video (B, 3, F, H, W), got {tuple(video.shape)}")
        T, H, W = video.shape[2:]
        if (T - 1) % t:
            raise ValueError(f"VAE.encode: F={T} frames; F must be {t}k + 1 "
                             f"(accepted: 1, {1 + t}, {1 + 2 * t}, {1 + 3 * t}, ...; nearest: "
                             f"{(T - 1) // t * t + 1} or {((T - 1) // t + 1) * t + 1})")
        if H % s or W % s:
            raise ValueError(f"VAE.encode: H x W = {H} x {W}; both must be multiples of {s}")

    # -------------------------------------------------------- encode / decode

    def encode(self, video: torch.Tensor, chunked: bool = True) -> DiagonalGaussian:
        """video (B, 3, F, H, W) in [-1, 1], F = 4k + 1 -> posterior with mean/logvar (B, z, F', h, w),
        F' = (F - 1) // 4 + 1, h, w = H / 8, W / 8 (Wan 2.2: / 16). `chunked=False` runs the whole
        clip at once (same result, memory grows with F)."""
        self._check_video(video)
        s = self.config.spatial_compression
        if self._use_tiles(video.shape[-2] // s, video.shape[-1] // s):
            B, _, T, h, w = self.latent_shape(video.shape)
            h = self._tiled(lambda v: self._encode(v, chunked), video, (B, 2 * self.config.z_dim, T, h, w),
                            cell_in=s, cell_out=1)
        else:
            h = self._encode(video, chunked)
        mean, logvar = self.conv1(h).chunk(2, dim=1)  # (B, z, F', h, w) each
        return DiagonalGaussian(mean, logvar)

    def _encode(self, video: torch.Tensor, chunked: bool) -> torch.Tensor:
        """(B, 3, F, H, W) -> encoder output before conv1, (B, 2z, F', h, w)."""
        # contiguous: the layers pick their memory layout from their input's, so a caller's strides
        # (a permuted image tensor, say) must not change which kernels run (or the last bits)
        x = _patchify(video, self.config.patch_size).contiguous()  # (B, 3p^2, F, H/p, W/p)
        t, T = self.config.temporal_compression, x.shape[2]
        bounds = [0, 1, *range(1 + t, T + 1, t)] if chunked else [0, T]
        chunks = [x[:, :, a:b] for a, b in zip(bounds[:-1], bounds[1:])]
        cache = CausalCache()
        if torch.is_grad_enabled():  # training: keep the autograd graph, concatenate once
            return torch.cat([self.encoder(c, cache) for c in chunks], 2)
        out, frame = None, 0
        for c in chunks:
            y = self.encoder(c, cache)  # (B, 2z, 1, h, w) per chunk
            if out is None:  # allocated once; every chunk writes its latent frame in place
                out = y.new_empty(*y.shape[:2], (T - 1) // t + 1, *y.shape[3:])
            out[:, :, frame:frame + y.shape[2]] = y
            frame += y.shape[2]
        return out

    def decode(self, z: torch.Tensor, chunked: bool = True, clamp: bool = True) -> torch.Tensor:
        """z (B, z, F', h, w) (VAE latents: `denormalize` DiT latents first) -> video (B, 3, F, H, W),
        F = 4 (F' - 1) + 1, in [-1, 1] unless `clamp=False` (VAE training: the clamp has no
        gradient outside the range). `chunked=False` decodes all latent frames at once."""
        if z.ndim != 5 or z.shape[1] != self.config.z_dim:
            raise ValueError(f"VAE.decode expects latents (B, {self.config.z_dim}, F', h, w), "
                             f"got {tuple(z.shape)}")
        x = self.conv2(z.contiguous())  # contiguous: see _encode
        if not self._use_tiles(*z.shape[-2:]):
            return self._decode(x, chunked, clamp)
        s = self.config.spatial_compression
        B, _, T, h, w = z.shape
        out_shape = (B, 3, (T - 1) * self.config.temporal_compression + 1, h * s, w * s)
        return self._tiled(lambda v: self._decode(v, chunked, clamp), x, out_shape, cell_in=1, cell_out=s)

    def _decode(self, x: torch.Tensor, chunked: bool, clamp: bool) -> torch.Tensor:
        """(B, z, F', h, w) after conv2 -> video (B, 3, F, H, W)."""
        cfg, (B, _, T, h, w) = self.config, x.shape
        p, s, t = cfg.patch_size, cfg.spatial_compression, cfg.temporal_compression
        chunks = [x[:, :, i:i + 1] for i in range(T)] if chunked else [x]
        cache = CausalCache()
        if torch.is_grad_enabled():  # training: keep the autograd graph, concatenate once
            y = _unpatchify(torch.cat([self.decoder(c, cache) for c in chunks], 2), p)
            return y.clamp(-1.0, 1.0) if clamp else y
        out = torch.empty(B, 3, (T - 1) * t + 1, h * s, w * s, dtype=x.dtype, device=x.device)
        # Chunks are written straight into `out`; for p > 1 through a (B, 3, r, q, F, H/p, W/p) view
        # of it, which is the unpatchify, so there is no separate whole-clip copy.
        dst = out if p == 1 else out.view(B, 3, -1, h * s // p, p, w * s // p, p).permute(0, 1, 6, 4, 2, 3, 5)
        frame = 0
        for c in chunks:
            y = self.decoder(c, cache)  # (B, 3p^2, 1 then 4, H/p, W/p)
            if clamp:
                y.clamp_(-1.0, 1.0)
            n = y.shape[2]
            if p == 1:
                dst[:, :, frame:frame + n] = y
            else:
                dst[:, :, :, :, frame:frame + n] = y.view(B, 3, p, p, *y.shape[2:])
            frame += n
        return out

    def forward(self, video: torch.Tensor, generator: torch.Generator | None = None, sample: bool = False):
        """Reconstruction: (video (B, 3, F, H, W), posterior) -> (recon (B, 3, F, H, W), posterior)."""
        posterior = self.encode(video)
        z = posterior.sample(generator) if sample else posterior.mode()
        return self.decode(z), posterior

    # -------------------------------------------------------- latent statistics

    def normalize(self, z: torch.Tensor) -> torch.Tensor:
        """VAE latents -> DiT latents: (z - mean) / std per channel. (B, z, F', h, w)."""
        self._check_stats()
        return (z - self.latent_mean.to(z.dtype)) / self.latent_std.to(z.dtype)

    def denormalize(self, z: torch.Tensor) -> torch.Tensor:
        """DiT latents -> VAE latents: z * std + mean per channel. (B, z, F', h, w)."""
        self._check_stats()
        return z * self.latent_std.to(z.dtype) + self.latent_mean.to(z.dtype)

    def _check_stats(self) -> None:
        if not self.config.mean or not self.config.std:
            raise ValueError("VAEConfig.mean / std are empty: this VAE has no latent statistics; "
                             "set them (one per latent channel, z_dim values) in the preset")

    # -------------------------------------------------------- spatial tiling

    def enable_tiling(self, tile_size: int = 256, overlap: int = 64) -> None:
        """Encode / decode frames larger than `tile_size` pixels in overlapping tiles blended with
        linear ramps over `overlap` pixels. Both must be multiples of the spatial compression."""
        s = self.config.spatial_compression
        if tile_size % s or overlap % s or not 0 <= overlap < tile_size:
            raise ValueError(f"enable_tiling(tile_size={tile_size}, overlap={overlap}): both must be "
                             f"multiples of {s} with 0 <= overlap < tile_size")
        self.tile_size, self.tile_overlap = tile_size, overlap

    def disable_tiling(self) -> None:
        self.tile_size = None

    def _use_tiles(self, h: int, w: int) -> bool:
        """Whether a latent grid of h x w cells is larger than one tile."""
        return self.tile_size is not None and max(h, w) > self.tile_size // self.config.spatial_compression

    def _tiled(self, fn, x: torch.Tensor, out_shape, cell_in: int, cell_out: int) -> torch.Tensor:
        """Run `fn` on overlapping spatial tiles of x and blend: out = sum(w_i y_i) / sum(w_i), w_i a
        linear ramp over the overlap on every side that touches another tile. Tiles are laid out on
        the latent grid; one latent cell is `cell_in` units of x and `cell_out` units of the output."""
        s = self.config.spatial_compression
        tile, ov = self.tile_size // s, self.tile_overlap // s  # latent cells
        H, W = x.shape[-2] // cell_in, x.shape[-1] // cell_in
        out = x.new_zeros(out_shape)
        weight = x.new_zeros(out_shape[-2:])
        o = ov * cell_out
        for i0, i1 in _spans(H, tile, ov):
            for j0, j1 in _spans(W, tile, ov):
                y = fn(x[..., i0 * cell_in:i1 * cell_in, j0 * cell_in:j1 * cell_in])
                ramp = (_ramp(y.shape[-2], o if i0 else 0, o if i1 < H else 0, y)[:, None]
                        * _ramp(y.shape[-1], o if j0 else 0, o if j1 < W else 0, y)[None, :])
                out[..., i0 * cell_out:i1 * cell_out, j0 * cell_out:j1 * cell_out].addcmul_(y, ramp)
                weight[i0 * cell_out:i1 * cell_out, j0 * cell_out:j1 * cell_out] += ramp
        return out.div_(weight)


def _spans(total: int, tile: int, overlap: int) -> list[tuple[int, int]]:
    """Tile start/end pairs covering [0, total); consecutive tiles overlap by at least `overlap`."""
    if total <= tile:
        return [(0, total)]
    n = math.ceil((total - overlap) / (tile - overlap))
    starts = [round(k * (total - tile) / (n - 1)) for k in range(n)]
    return [(a, a + tile) for a in starts]


def _ramp(n: int, left: int, right: int, like: torch.Tensor) -> torch.Tensor:
    """Weights (n,): rising over `left` samples, falling over `right`, 1 elsewhere; never zero."""
    w = torch.ones(n, dtype=like.dtype, device=like.device)
    if left:
        w[:left] = torch.arange(1, left + 1, dtype=like.dtype, device=like.device) / (left + 1)
    if right:
        w[n - right:] = torch.arange(right, 0, -1, dtype=like.dtype, device=like.device) / (right + 1)
    return w


def _unpatchify(x: torch.Tensor, p: int) -> torch.Tensor:
    """(B, C p p, F, h, w) -> (B, C, F, h p, w p), inverse of `_patchify`."""
    if p == 1:
        return x
    B, Cpp, T, h, w = x.shape
    x = x.view(B, Cpp // (p * p), p, p, T, h, w).permute(0, 1, 4, 5, 3, 6, 2)  # (B, C, T, h, q, w, r)
    return x.reshape(B, Cpp // (p * p), T, h * p, w * p)
