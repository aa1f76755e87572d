"""The LTX-2 video VAE (Lightricks; 32x space, 8x time, 128 latent channels), weight-compatible with
Lightricks' checkpoints, diffusers' `AutoencoderKLLTX2Video` and ComfyUI's files (`vae_convert.py`).

Dataflow (LTX-2.0 widths; LTX-2.3 has other widths, depths and upsample kinds: `vae_config.py`)

    video (B, 3, F, H, W) in [-1, 1], F = 8k + 1, H and W multiples of 32
      -> patchify 4x4                                  (B, 48, F, H/4, W/4)
      -> conv_in                                       (B, 128, F, H/4, W/4)
      -> res x4, down space                            (B, 256, F, H/8, W/8)
      -> res x6, down time                             (B, 512, 4k + 1, H/8, W/8)
      -> res x6, down all                              (B, 1024, 2k + 1, H/16, W/16)
      -> res x2, down all                              (B, 2048, k + 1, H/32, W/32)
      -> res x2, norm, SiLU, conv_out                  (B, 129, F', h, w)   F' = k + 1, h, w = H/32, W/32
      -> posterior: mean (128 channels), logvar (the 129th, shared by all)   (B, 128, F', h, w) each
    z (B, 128, F', h, w), VAE units (`denormalize` the DiT's latents first)
      -> conv_in, res x5                               (B, 1024, F', h, w)
      -> up all (+ input), res x5                      (B, 512, 2F' - 1, 2h, 2w)
      -> up all (+ input), res x5                      (B, 256, 4F' - 3, 4h, 4w)
      -> up all (+ input), res x5                      (B, 128, F, H/4, W/4)
      -> norm, SiLU, conv_out                          (B, 48, F, H/4, W/4)
      -> unpatchify 4x4, clamp                         (B, 3, F, H, W) in [-1, 1]

Causality is a property of one layer, `LTX2Conv3d` (vae_layers.py): the encoder's convs pad time with
copies of the first frame only, so a latent frame depends on its own and earlier frames; the released
decoders pad both ends (`decoder_causal=False`). Every conv runs a few output frames at a time, so the
activation memory of a decode is each stage's tensors plus one chunk (`decode_peak_bytes`); frames
and space can further be cut into tiles blended over their overlaps as Lightricks blends them
(`LTX2Tiling`). Parameter names are Lightricks' (ltx-core `VideoEncoder` / `ConvVideoDecoder`):
`encoder.down_blocks.0.res_blocks.0.conv1.conv.weight`, `decoder.up_blocks.1.conv.conv.weight`,
`per_channel_statistics.mean-of-means`, ...

Where Lightricks' ltx-core (model/video_vae/) and diffusers (autoencoder_kl_ltx2.py) differ, Lightricks'
is followed: the tiling (trapezoidal masks on the latent grid, frames too: diffusers blends linear ramps
row by row, with other tile positions), the decode defaults of a timestep-conditioned decoder (timestep
0.05, noise 0.025: diffusers' pipeline passes its own), and the scale-shift tables' init (zeros).
Lightricks' encoder crops a clip of the wrong length with a warning; here it is an error.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch
from torch import nn

from video_dit.families.ltx2.vae_config import STRIDES, LTX2VAEConfig
from video_dit.families.ltx2.vae_layers import (Downsample, LTX2Conv3d, ResStage, TimestepEmbedder, Upsample, norm_silu,
                                                norm_silu_plain)
from video_dit.models.common import initialize_by_name
from video_dit.models.causal_conv import DiagonalGaussian

# Output frames per conv call (every conv runs `LTX2Conv3d.run` chunks of this many frames).
CHUNK_FRAMES = 4


def patchify(video: torch.Tensor, p: int) -> torch.Tensor:
    """(B, C, F, H, W) -> (B, C p p, F, H/p, W/p), channels (c, column in patch, row in patch) as ltx-core's
    `patchify` ("b c (f p) (h q) (w r) -> b (c p r q) f h w")."""
    B, C, T, H, W = video.shape
    x = video.view(B, C, T, H // p, p, W // p, p).permute(0, 1, 6, 4, 2, 3, 5)  # (B, C, r, q, F, h, w)
    return x.reshape(B, C * p * p, T, H // p, W // p)


class Encoder(nn.Module):
    """video -> the posterior's parameters (Lightricks' `VideoEncoder` with "uniform" log-variance)."""

    def __init__(self, cfg: LTX2VAEConfig):
        super().__init__()
        w, pad = cfg.encoder_widths, cfg.encoder_padding
        self.patch_size = cfg.patch_size
        self.conv_in = LTX2Conv3d(cfg.in_channels * cfg.patch_size ** 2, w[0], causal=True, padding=pad)
        blocks = []
        for i, layers in enumerate(cfg.encoder_layers):
            blocks.append(ResStage(w[i], layers, causal=True, padding=pad, timestep_conditioning=False))
            if i < len(cfg.encoder_downsamples):
                blocks.append(Downsample(w[i], w[i + 1], cfg.encoder_downsamples[i], pad))
        self.down_blocks = nn.ModuleList(blocks)
        # latent_channels means and one log-variance channel shared by all of them
        self.conv_out = LTX2Conv3d(w[-1], cfg.latent_channels + 1, causal=True, padding=pad)

    def forward(self, video: torch.Tensor, chunk: int) -> torch.Tensor:
        """video (B, 3, F, H, W) -> (B, latent_channels + 1, F', h, w)."""
        x = self.conv_in(patchify(video, self.patch_size), chunk)  # (B, C0, F, H/p, W/p)
        for block in self.down_blocks:
            x = block(x, None, chunk) if isinstance(block, ResStage) else block(x, chunk)
        return self.conv_out(x, chunk, norm_silu())  # conv_norm_out (pixel norm), SiLU, conv_out

    def plain(self, video: torch.Tensor) -> torch.Tensor:
        """`forward` as whole-clip convs without in-place writes (autograd records it: training)."""
        x = self.conv_in.plain(patchify(video, self.patch_size))  # (B, C0, F, H/p, W/p)
        for block in self.down_blocks:
            x = block.plain(x, None) if isinstance(block, ResStage) else block.plain(x)
        return self.conv_out.plain(norm_silu_plain(x))  # (B, latent_channels + 1, F', h, w)


class Decoder(nn.Module):
    """VAE latents -> video (Lightricks' `ConvVideoDecoder`, the latents' un-normalising and decode
    noise left to `LTX2VideoVAE.decode`)."""

    def __init__(self, cfg: LTX2VAEConfig):
        super().__init__()
        w, causal, pad, cond = cfg.decoder_widths, cfg.decoder_causal, cfg.decoder_padding, cfg.timestep_conditioning
        self.patch_size = cfg.patch_size
        self.out_channels = cfg.in_channels
        self.conv_in = LTX2Conv3d(cfg.latent_channels, w[0], causal, pad)
        blocks = []
        for i, layers in enumerate(cfg.decoder_layers):
            if i:
                blocks.append(Upsample(w[i - 1], w[i], cfg.decoder_upsamples[i - 1], cfg.decoder_residual[i - 1],
                                       causal, pad))
            blocks.append(ResStage(w[i], layers, causal, pad, cond))
        self.up_blocks = nn.ModuleList(blocks)
        self.conv_out = LTX2Conv3d(w[-1], cfg.in_channels * cfg.patch_size ** 2, causal, pad)
        self.timestep_conditioning = cond
        if cond:
            self.timestep_scale_multiplier = nn.Parameter(torch.tensor(1000.0))
            self.last_time_embedder = TimestepEmbedder(2 * w[-1])
            self.last_scale_shift_table = nn.Parameter(torch.zeros(2, w[-1]))

    def forward(self, z: torch.Tensor, timestep: torch.Tensor | None, chunk: int) -> torch.Tensor:
        """z (B, L, F', h, w) VAE latents, timestep (B,) in [0, 1] or None -> video (B, 3, F, H, W)."""
        t = timestep * self.timestep_scale_multiplier.to(timestep.dtype) if self.timestep_conditioning else None
        x = self.conv_in(z, chunk)  # (B, C0, F', h, w)
        for block in self.up_blocks:
            x = block(x, t, chunk) if isinstance(block, ResStage) else block(x, chunk)
        B, C, T, H, W = x.shape
        scale = shift = None
        if self.timestep_conditioning:  # adaLN before the head: (1 + scale) and shift from the table + embedding
            table = self.last_scale_shift_table[None].to(x.dtype)  # (1, 2, C)
            shift, scale = (table + self.last_time_embedder(t).view(B, 2, C)).view(B, 2, C, 1, 1, 1).unbind(1)
        p = self.patch_size
        video = x.new_empty(B, self.out_channels, T, H * p, W * p)
        pixels = video.view(B, self.out_channels, T, H, p, W, p)

        def write(t0: int, t1: int, y: torch.Tensor) -> None:  # unpatchify, straight into the video
            y = y.view(B, self.out_channels, p, p, t1 - t0, H, W)  # channels (c, column r, row q)
            pixels[:, :, t0:t1].copy_(y.permute(0, 1, 4, 5, 3, 6, 2))

        self.conv_out.run(x, write, chunk, norm_silu(scale, shift))  # conv_norm_out, [adaLN], SiLU, conv_out
        return video

    def plain(self, z: torch.Tensor, timestep: torch.Tensor | None) -> torch.Tensor:
        """`forward` as whole-clip convs without in-place writes (autograd records it: training)."""
        t = timestep * self.timestep_scale_multiplier.to(timestep.dtype) if self.timestep_conditioning else None
        x = self.conv_in.plain(z)  # (B, C0, F', h, w)
        for block in self.up_blocks:
            x = block.plain(x, t) if isinstance(block, ResStage) else block.plain(x)
        B, C, T, H, W = x.shape
        scale = shift = None
        if self.timestep_conditioning:
            table = self.last_scale_shift_table[None].to(x.dtype)  # (1, 2, C)
            shift, scale = (table + self.last_time_embedder(t).view(B, 2, C)).view(B, 2, C, 1, 1, 1).unbind(1)
        y = self.conv_out.plain(norm_silu_plain(x, scale, shift))  # (B, 3 p p, F, H, W), channels (c, r, q)
        p = self.patch_size
        y = y.view(B, self.out_channels, p, p, T, H, W).permute(0, 1, 4, 5, 3, 6, 2)  # (B, 3, F, H, q, W, r)
        return y.reshape(B, self.out_channels, T, H * p, W * p)


class PerChannelStatistics(nn.Module):
    """Each latent channel's mean and std over Lightricks' data: checkpoint buffers `mean-of-means` and
    `std-of-means` (ltx-core `PerChannelStatistics`); identity until a checkpoint is loaded."""

    def __init__(self, channels: int):
        super().__init__()
        self.register_buffer("std-of-means", torch.ones(channels))
        self.register_buffer("mean-of-means", torch.zeros(channels))

    def stats(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean, std), each (1, L, 1, 1, 1) in `like`'s dtype and device."""
        return tuple(self.get_buffer(n).view(1, -1, 1, 1, 1).to(like) for n in ("mean-of-means", "std-of-means"))


# ---------------------------------------------------------------- tiling (Lightricks' tiling.py, rewritten)


@dataclass(frozen=True)
class LTX2Tiling:
    """How a decode is cut into tiles: ltx-core's `TileSizeConfig` with one spatial size for H and W.
    Sizes and overlaps are in video units (pixels, frames); 0 leaves that axis whole. Tiles are cut on
    the latent grid (size / 32 cells, size / 8 latent frames, at least 2) and blended with ltx-core's
    trapezoidal ramps over the overlap, which sum to one. The defaults are `TileSizeConfig.default()`."""

    spatial: int = 768
    spatial_overlap: int = 64
    frames: int = 80
    frames_overlap: int = 24

    def __post_init__(self):
        for size, overlap, name in ((self.spatial, self.spatial_overlap, "spatial"),
                                    (self.frames, self.frames_overlap, "frames")):
            if size < 0 or overlap < 0 or (size and overlap >= size) or (not size and overlap):
                raise ValueError(f"LTX2Tiling.{name}={size}, {name}_overlap={overlap}: accepted 0 (untiled, no "
                                 "overlap) or a size above an overlap >= 0")

    def check(self, config: LTX2VAEConfig) -> None:
        """ltx-core's `_validate_size_axis`: a tiled axis's size is at least 2 latent cells (frames) and
        size and overlap are whole cells (spatial_compression pixels, temporal_compression frames)."""
        for size, overlap, name, cell in ((self.spatial, self.spatial_overlap, "spatial", config.spatial_compression),
                                          (self.frames, self.frames_overlap, "frames", config.temporal_compression)):
            if size and (size < 2 * cell or size % cell or overlap % cell):
                raise ValueError(f"LTX2Tiling.{name}={size}, {name}_overlap={overlap}: a tile must be at least "
                                 f"{2 * cell} and both multiples of {cell} for this VAE")


def _split(n: int, size: int, overlap: int) -> list[tuple[int, int, int, int]]:
    """ltx-core `split_by_size`: [0, n) in tiles of `size` overlapping by `overlap`, the last one shorter;
    (start, end, left ramp, right ramp) each, the ramps as long as the overlaps."""
    if n <= size:
        return [(0, n, 0, 0)]
    count = (n + size - 2 * overlap - 1) // (size - overlap)
    starts = [i * (size - overlap) for i in range(count)]
    return [(a, min(a + size, n) if i < count - 1 else n, overlap if i else 0, overlap if i < count - 1 else 0)
            for i, a in enumerate(starts)]


def _trapezoid(length: int, left: int, right: int, left_from_zero: bool) -> torch.Tensor:
    """ltx-core `compute_trapezoidal_mask_1d`: ones, rising over `left` samples (from 0 when
    `left_from_zero`: a causal tile's first frame is not used; else from 1 / (left + 1)) and falling over
    `right` to 1 / (right + 1); float32 (length,). Facing ramps of equal length sum to one."""
    left, right = min(left, length), min(right, length)
    mask = torch.ones(length)
    if left:
        mask[:left] *= (torch.linspace(0, 1, left + 1)[:-1] if left_from_zero
                        else torch.linspace(0, 1, left + 2)[1:-1])
    if right:
        mask[length - right:] *= torch.linspace(1, 0, right + 2)[1:-1]
    return mask


def tile_plan(config: LTX2VAEConfig, tiling: LTX2Tiling, frames: int, h: int, w: int):
    """The tiles of a decode of latents (F' = `frames`, h, w): per axis (time, height, width) a list of
    (latent slice, output slice, mask over the output slice). Time as ltx-core's `split_temporal_causal` +
    `map_temporal_slice`: every tile after the first starts one latent frame earlier, its first output
    frame (the latent frame decoded as a clip start) weighted 0; latent frames [a, b) give output frames
    [8a, 8(b - 1) + 1). Space as `split_by_size` + `map_spatial_slice`."""
    t, s = config.temporal_compression, config.spatial_compression

    def cells(size: int, overlap: int, cell: int) -> tuple[int, int]:
        return max(2, overlap // cell + 1, size // cell), overlap // cell  # ltx-core `enable_size_axis`

    time = []
    spans = _split(frames, *cells(tiling.frames, tiling.frames_overlap, t)) if tiling.frames else [(0, frames, 0, 0)]
    for i, (a, b, left, right) in enumerate(spans):
        a, left = (a - 1, left + 1) if i else (a, left)  # causal: one more latent frame on the left
        out = slice(a * t, (b - 1) * t + 1)
        time.append((slice(a, b), out, _trapezoid(out.stop - out.start, 1 + (left - 1) * t if left else 0,
                                                   right * t, left_from_zero=True)))
    space = []
    for n in (h, w):
        spans = _split(n, *cells(tiling.spatial, tiling.spatial_overlap, s)) if tiling.spatial else [(0, n, 0, 0)]
        space.append([(slice(a, b), slice(a * s, b * s), _trapezoid((b - a) * s, left * s, right * s, False))
                      for a, b, left, right in spans])
    return time, space[0], space[1]


# ---------------------------------------------------------------- the VAE


class LTX2VideoVAE(nn.Module):
    """The LTX-2 video VAE. `encode(video)` -> posterior over VAE latents, `normalize` -> the DiT's
    latents; `denormalize` -> `decode(z)` -> video: the interface of the house's other VAEs (vae.py).
    Inference runs without autograd (the convs write chunks into shared tensors); when autograd records
    and something asks for a gradient (a trainable weight or an input that requires grad: training the
    VAE, `vae_stage.py`), encode and decode take the layers' `plain` path instead (whole-clip convs, no
    in-place writes; the same results). `chunk_frames`: output frames per conv call of the inference
    path; `enable_tiling` cuts decodes into blended tiles."""

    def __init__(self, config: LTX2VAEConfig, seed: int | None = None):
        super().__init__()
        self.config = config
        self.encoder = Encoder(config)
        self.decoder = Decoder(config)
        self.per_channel_statistics = PerChannelStatistics(config.latent_channels)
        self.chunk_frames = CHUNK_FRAMES
        self.tiling: LTX2Tiling | None = None
        self.initialize_weights(seed)

    def initialize_weights(self, seed: int | None = None) -> None:
        """Seeded by (seed, parameter name) (`initialize_by_name`): conv and linear weights and biases
        U(+-1 / sqrt(fan_in)) (PyTorch's default, the references'), the adaLN scale-shift tables zero
        (ltx-core's `ResnetBlock3D`: modulation starts as identity; diffusers draws them), the timestep
        multiplier 1000. The latent statistics are buffers: identity until a checkpoint is loaded."""
        fan_in = {name: m.weight[0].numel() for name, m in self.named_modules()
                  if isinstance(m, (nn.Conv3d, nn.Linear))}

        def init(config, name: str, p: nn.Parameter, generator: torch.Generator) -> None:
            module, _, leaf = name.rpartition(".")
            with torch.no_grad():
                if leaf in ("scale_shift_table", "last_scale_shift_table"):
                    p.zero_()
                elif leaf == "timestep_scale_multiplier":
                    p.fill_(1000.0)
                else:  # weight or bias of a conv / linear
                    bound = fan_in[module] ** -0.5
                    p.copy_(torch.empty(p.shape).uniform_(-bound, bound, generator=generator))

        initialize_by_name(self, init, self.config, seed)

    @property
    def device(self) -> torch.device:
        return self.encoder.conv_in.conv.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.encoder.conv_in.conv.weight.dtype

    def latent_shape(self, video_shape) -> tuple[int, ...]:
        B, _, T, H, W = video_shape
        s, t = self.config.spatial_compression, self.config.temporal_compression
        return (B, self.config.latent_channels, (T - 1) // t + 1, H // s, W // s)

    # -------------------------------------------------------- encode / decode

    def _differentiable(self, x: torch.Tensor) -> bool:
        """Whether this call trains: autograd records and the input or a weight asks for a gradient."""
        return torch.is_grad_enabled() and (x.requires_grad or self.encoder.conv_in.conv.weight.requires_grad)

    def encode(self, video: torch.Tensor) -> DiagonalGaussian:
        """video (B, 3, F, H, W) in [-1, 1], F = 8k + 1, H and W multiples of 32 (cast to the VAE's dtype)
        -> posterior over VAE latents, mean and logvar (B, 128, F', h, w), F' = k + 1, h, w = H/32, W/32.
        `.mode()` is the mean: `normalize(encode(video).mode())` is what Lightricks' `VideoEncoder`
        returns; `.sample(generator)` a draw (one log-variance per position, shared by the channels)."""
        t, s = self.config.temporal_compression, self.config.spatial_compression
        if video.ndim != 5 or video.shape[1] != self.config.in_channels:
            raise ValueError(f"LTX2VideoVAE.encode expects video (B, 3, F, H, W), got {tuple(video.shape)}")
        T, H, W = video.shape[2:]
        if (T - 1) % t:
            raise ValueError(f"LTX2VideoVAE.encode: F={T} frames; F must be {t}k + 1 (nearest: "
                             f"{(T - 1) // t * t + 1} or {((T - 1) // t + 1) * t + 1})")
        if H % s or W % s:
            raise ValueError(f"LTX2VideoVAE.encode: H x W = {H} x {W}; both must be multiples of {s}")
        if self._differentiable(video):
            h = self.encoder.plain(video.to(self.dtype))  # (B, L + 1, F', h, w)
        else:
            with torch.no_grad():
                h = self.encoder(video.to(self.dtype), self.chunk_frames)
        L = self.config.latent_channels
        return DiagonalGaussian(h[:, :L], h[:, L:].expand(-1, L, -1, -1, -1))

    def decode(self, z: torch.Tensor, timestep: float | torch.Tensor | None = None,
               generator: torch.Generator | None = None, clamp: bool = True) -> torch.Tensor:
        """z (B, 128, F', h, w) VAE latents (`denormalize` the DiT's first; cast to the VAE's dtype) ->
        video (B, 3, 8 (F' - 1) + 1, 32 h, 32 w), in [-1, 1] unless `clamp=False` (the references do
        not clamp inside the VAE). Tiled when `enable_tiling` was called and z spans several tiles.
        A timestep-conditioned decoder (no released one) first mixes noise into the normalized
        latents, (1 - s) z + s n with s = `decode_noise_scale` and n ~ N(0, 1) from `generator`, and is
        conditioned on `timestep` (a float or (B,), default `decode_timestep`), as ltx-core's
        `ConvVideoDecoder.forward` does; the noise is drawn once for the whole latent (ltx-core draws it
        per tile)."""
        cfg = self.config
        if z.ndim != 5 or z.shape[1] != cfg.latent_channels:
            raise ValueError(f"LTX2VideoVAE.decode expects latents (B, {cfg.latent_channels}, F', h, w), "
                             f"got {tuple(z.shape)}")
        if self._differentiable(z):  # training: the plain path, untiled, without the decode noise
            t = None
            if cfg.timestep_conditioning:
                t = torch.as_tensor(cfg.decode_timestep if timestep is None else timestep, dtype=torch.float32,
                                    device=z.device).expand(z.shape[0]).to(self.dtype)
            video = self.decoder.plain(z.to(self.dtype), t)
            return video.clamp(-1.0, 1.0) if clamp else video
        with torch.no_grad():
            return self._decode(z, timestep, generator, clamp)

    def _decode(self, z: torch.Tensor, timestep, generator, clamp: bool) -> torch.Tensor:
        """`decode`'s inference path (no autograd): decode noise, tiles, chunked convs."""
        cfg = self.config
        z = z.to(self.dtype)
        t = None
        if cfg.timestep_conditioning:
            t = torch.as_tensor(cfg.decode_timestep if timestep is None else timestep, dtype=torch.float32,
                                device=z.device).expand(z.shape[0]).to(self.dtype)
            noise = torch.randn(z.shape, generator=generator, dtype=z.dtype,
                                device=z.device if generator is None else generator.device).to(z.device)
            mean, std = self.per_channel_statistics.stats(z)
            s = cfg.decode_noise_scale
            z = self.normalize(z).mul_(1 - s).add_(noise, alpha=s).mul_(std).add_(mean)  # denormalized again
            del noise
        plan = tile_plan(cfg, self.tiling, *z.shape[2:]) if self.tiling is not None else None
        if plan is None or math.prod(len(axis) for axis in plan) == 1:
            video = self.decoder(z, t, self.chunk_frames)
        else:
            video = self._tiled_decode(z, t, plan)
        return video.clamp_(-1.0, 1.0) if clamp else video

    def _tiled_decode(self, z: torch.Tensor, t: torch.Tensor | None, plan) -> torch.Tensor:
        """Each tile decoded alone, weighted by its masks (one per axis) and summed; the sum is divided
        by the summed masks, one per axis (the tiles form a grid, so the weight at a position is the
        product of its axes' sums: 1 wherever facing ramps meet, as ltx-core's do)."""
        B = z.shape[0]
        T, H, W = (axis[-1][1].stop for axis in plan)
        video = z.new_zeros(B, self.config.in_channels, T, H, W)
        for (ts, to, mt), (hs, ho, mh), (ws, wo, mw) in itertools.product(*plan):
            tile = self.decoder(z[:, :, ts, hs, ws], t, self.chunk_frames)  # (B, 3, n, H_tile, W_tile)
            tile.mul_(mt.to(tile.device).view(-1, 1, 1)).mul_(mh.to(tile.device).view(-1, 1)).mul_(mw.to(tile.device))
            video[:, :, to, ho, wo].add_(tile)
            del tile
        for axis, shape in zip(plan, ((-1, 1, 1), (-1, 1), (-1,))):
            total = torch.zeros(axis[-1][1].stop)
            for _, out, mask in axis:
                total[out] += mask
            video.div_(total.to(video.device).view(shape))
        return video

    def enable_tiling(self, tiling: LTX2Tiling | None = None) -> None:
        """Decode in tiles (`LTX2Tiling()`: ltx-core's default 768-pixel / 80-frame tiles, 64 / 24 overlap)."""
        tiling = LTX2Tiling() if tiling is None else tiling
        tiling.check(self.config)
        self.tiling = tiling

    def disable_tiling(self) -> None:
        self.tiling = None

    def forward(self, video: torch.Tensor, generator: torch.Generator | None = None, sample: bool = False):
        """Reconstruction: video (B, 3, F, H, W) -> (recon (B, 3, F, H, W), posterior)."""
        posterior = self.encode(video)
        z = posterior.sample(generator) if sample else posterior.mode()
        return self.decode(z, generator=generator), posterior

    # -------------------------------------------------------- latent statistics

    def normalize(self, z: torch.Tensor) -> torch.Tensor:
        """VAE latents -> the DiT's: (z - mean) / std per channel (ltx-core `PerChannelStatistics.normalize`;
        diffusers' pipelines: `(z - latents_mean) * scaling_factor / latents_std`, scaling_factor 1)."""
        mean, std = self.per_channel_statistics.stats(z)
        return (z - mean) / std

    def denormalize(self, z: torch.Tensor) -> torch.Tensor:
        """The DiT's latents -> VAE latents: z std + mean per channel (ltx-core `un_normalize`)."""
        mean, std = self.per_channel_statistics.stats(z)
        return z * std + mean


# ---------------------------------------------------------------- memory


def decode_peak_bytes(config: LTX2VAEConfig, frames: int, height: int, width: int, tiling: LTX2Tiling | None = None,
                      dtype: torch.dtype = torch.bfloat16, batch: int = 1, chunk_frames: int = CHUNK_FRAMES) -> int:
    """The activation peak of `LTX2VideoVAE.decode` of a (frames, height, width) video, in bytes: the
    most its tensors hold at once beyond the weights and the input latents (in the VAE's dtype), from the
    layer shapes. Per stage: its input (the storage it views), the stage's work tensor (res stages) or
    output (upsamples, the video), and one conv chunk: the gathered input (chunk + 2 frames), the float32
    per-position RMS or, during the conv, the reflect-padded copy and the output chunk. Tiled: the
    video plus the largest tile's decode. Kernel workspaces (cuDNN's, oneDNN's) are not tensors and are
    not counted."""
    t, s = config.temporal_compression, config.spatial_compression
    if (frames - 1) % t or height % s or width % s:
        raise ValueError(f"decode_peak_bytes: {frames} x {height} x {width}; frames must be {t}k + 1 and height, "
                         f"width multiples of {s}")
    e = torch.empty((), dtype=dtype).element_size()
    F_, h, w = (frames - 1) // t + 1, height // s, width // s
    L = config.latent_channels
    mixed = 2 * batch * L * F_ * h * w * e if config.timestep_conditioning else 0  # normalized copy + noise
    plan = tile_plan(config, tiling, F_, h, w) if tiling is not None else None
    if plan is None or math.prod(len(axis) for axis in plan) == 1:
        return mixed + _decoder_peak(config, batch, F_, h, w, e, chunk_frames)
    shapes = {(ts.stop - ts.start, hs.stop - hs.start, ws.stop - ws.start)
              for (ts, _, _), (hs, _, _), (ws, _, _) in itertools.product(*plan)}
    video = batch * config.in_channels * frames * height * width * e
    return mixed + video + max(_decoder_peak(config, batch, *shape, e, chunk_frames) for shape in shapes)


def _decoder_peak(cfg: LTX2VAEConfig, B: int, T: int, H: int, W: int, e: int, chunk: int) -> int:
    """`Decoder.forward`'s peak bytes for latents (B, L, T, H, W): its stages in order (see
    `decode_peak_bytes`)."""
    reflect = cfg.decoder_padding == "reflect"

    def conv_chunk(cin: int, cout: int, T: int, H: int, W: int, prep: bool) -> int:
        n = min(chunk, T)
        gathered = B * cin * (n + 2) * H * W * e
        rms = B * (n + 2) * H * W * 4 if prep else 0  # freed before the conv runs
        padded = B * cin * (n + 2) * (H + 2) * (W + 2) * e if reflect else 0  # nn.Conv3d's reflect pad
        return gathered + max(rms, padded + B * cout * n * H * W * e)

    widths = cfg.decoder_widths
    live = B * widths[0] * T * H * W * e  # conv_in's output: the first stage's input
    peak = live + conv_chunk(cfg.latent_channels, widths[0], T, H, W, prep=False)
    for i, layers in enumerate(cfg.decoder_layers):
        C = widths[i]
        if i:  # upsample: input and output tensor both held (the output one frame longer before its first is dropped)
            s0, s1, s2 = STRIDES[cfg.decoder_upsamples[i - 1]]
            out = B * C * T * s0 * H * s1 * W * s2 * e
            peak = max(peak, live + out + conv_chunk(widths[i - 1], C * s0 * s1 * s2, T, H, W, prep=False))
            live, T, H, W = out, T * s0 - (s0 - 1), H * s1, W * s2
        if layers:  # res stage: its input, updated in place, and one work tensor
            peak = max(peak, live + B * C * T * H * W * e + conv_chunk(C, C, T, H, W, prep=True))
    p = cfg.patch_size
    video = B * cfg.in_channels * T * H * p * W * p * e
    return max(peak, live + video + conv_chunk(widths[-1], cfg.in_channels * p * p, T, H, W, prep=True))
