"""LTX-2's audio VAE: a causal 2D conv autoencoder over stereo log-mel spectrograms, weight-compatible with
Lightricks' single-file checkpoint (`audio_vae.*` keys, ltx-core `AudioEncoder` / `AudioDecoder`) and
diffusers' `AutoencoderKLLTX2Audio` (names: `audio_convert.py`).

Dataflow (released sizes: ch 128, ch_mult (1, 2, 4), 2 res blocks per level, z = 8, 64 mel bins; time is
the height axis, causal: a latent frame sees only its own and earlier spectrogram frames)

    log-mel (B, 2, T, 64), T = 4k + 1 (`mel.py`: 100 frames/s of 16 kHz audio)
      conv_in                                         (B, 128, T, 64)
      level 0: res x2, down 2x (time, mel)            (B, 128, 2k + 1, 32)
      level 1: res x2 (128 -> 256), down 2x           (B, 256, k + 1, 16)
      level 2: res x2 (256 -> 512)                    (B, 512, k + 1, 16)
      mid: res, (no attention), res; pixel norm, SiLU, conv_out
                                                      (B, 2z, T', 16)      T' = k + 1 (25 per second)
      mean (first z channels) -> tokens (B, T', z * 16 = 128) -> (x - mean-of-means) / std-of-means
      -> normalised latents                           (B, 8, T', 16)       [encode]
    normalised latents (B, 8, T', 16)
      -> x * std-of-means + mean-of-means (per token channel)
      conv_in                                         (B, 512, T', 16)
      mid: res, res
      level 2: res x3; up 2x (drop the first frame)   (B, 512, 2T' - 1, 32)
      level 1: res x3 (512 -> 256); up 2x             (B, 256, 4T' - 3, 64)
      level 0: res x3 (256 -> 128); pixel norm, SiLU, conv_out
                                                      (B, 2, 4T' - 3, 64)  [decode]

Causality is a property of one layer, `CausalConv2d`: it zero-pads only the past of the causal axis (and
both sides of the other); the stride-2 downsamples are `CausalConv2d`s too, and the upsample drops the first
frame its causal conv made of the repeated first input (Lightricks' `Upsample` comment explains why).
Normalised latents are what the DiT reads: `audio_tokens` packs them (B, T', z * F') as both references'
patchifiers do ("b c t f -> b t (c f)"); the per-channel statistics act on that packed width.

Where diffusers and Lightricks differ we follow Lightricks: `encode` returns the normalised mean latents
(ltx-core `AudioEncoder.forward` normalises inside; diffusers' `encode` returns the raw posterior and its
pipeline normalises with `latents_mean` / `latents_std`, the same numbers); the statistics are sized by
the token width z * F' (the references size them by `ch`, 128 either way at the release); the time
compression is derived from `ch_mult` (the references hard-code 4).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from video_dit.families.ltx2.audio_config import AudioVAEConfig
from video_dit.models.attention import attention
from video_dit.models.common import initialize_by_name

# ---------------------------------------------------------------- the causal layer


def causal_padding(axis: str, stride: int) -> tuple[int, int, int, int]:
    """F.pad's (left, right, top, bottom) for a 3x3 conv of `stride` 1 or 2 causal along `axis` of a
    (B, C, height, width) map (ltx-core `CausalConv2d` and `Downsample`, the same tables in diffusers).
    Stride 1: the causal axis gets both pads in front (the past), the other one on each side. Stride 2
    (the downsamples): one pad behind on the non-causal axis; "width-compatibility" pads width by one in
    front only (a legacy layout)."""
    if stride == 1:
        return {"none": (1, 1, 1, 1), "height": (1, 1, 2, 0), "width": (2, 0, 1, 1),
                "width-compatibility": (2, 0, 1, 1)}[axis]
    return {"none": (0, 1, 0, 1), "height": (0, 1, 2, 0), "width": (2, 0, 0, 1),
            "width-compatibility": (1, 0, 0, 1)}[axis]


class CausalConv2d(nn.Module):
    """A k x k conv (k 1 or 3, stride 1 or 2) that sees only the past of the causal axis: zero padding
    (`causal_padding`), then an unpadded conv, so the output keeps the input's size (halved at stride 2)."""

    def __init__(self, cin: int, cout: int, kernel: int, axis: str, stride: int = 1):
        super().__init__()
        self.padding = causal_padding(axis, stride) if kernel == 3 else (0, 0, 0, 0)
        self.conv = nn.Conv2d(cin, cout, kernel, stride=stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, cin, H, W) -> (B, cout, H, W), or (B, cout, ceil(H / 2), ceil(W / 2)) at stride 2."""
        return self.conv(F.pad(x, self.padding))


# ---------------------------------------------------------------- blocks


class PixelNorm(nn.Module):
    """x / sqrt(mean over channels of x^2 + 1e-6): RMS over channels at each (time, bin); no parameters."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(dim=1, keepdim=True) + 1e-6)


def _norm(channels: int, norm_type: str) -> nn.Module:
    return PixelNorm() if norm_type == "pixel" else nn.GroupNorm(32, channels, eps=1e-6)


class ResnetBlock(nn.Module):
    """norm, SiLU, conv3, norm, SiLU, conv3, plus the input (a causal 1x1 conv when the width changes)."""

    def __init__(self, cin: int, cout: int, config: AudioVAEConfig):
        super().__init__()
        axis = config.causality_axis
        self.norm1 = _norm(cin, config.norm_type)
        self.conv1 = CausalConv2d(cin, cout, 3, axis)
        self.norm2 = _norm(cout, config.norm_type)
        self.conv2 = CausalConv2d(cout, cout, 3, axis)
        self.nin_shortcut = CausalConv2d(cin, cout, 1, axis) if cin != cout else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))                                     # (B, cout, H, W)
        h = self.conv2(F.silu(self.norm2(h)))
        return (x if self.nin_shortcut is None else self.nin_shortcut(x)) + h


class AttnBlock(nn.Module):
    """Single-head self-attention over every (time, bin) position of the map, 1x1-conv projections.
    Not in the release (attn_resolutions empty, no mid attention); kept for configs that have it."""

    def __init__(self, channels: int, config: AudioVAEConfig):
        super().__init__()
        self.norm = _norm(channels, config.norm_type)
        self.q, self.k, self.v, self.proj_out = (nn.Conv2d(channels, channels, 1) for _ in range(4))
        self.attention_backend = "native"  # `models.attention.set_attention_backend` flips it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        n = self.norm(x)
        q, k, v = (p(n).flatten(2).transpose(1, 2).unsqueeze(2) for p in (self.q, self.k, self.v))  # (B, HW, 1, C)
        out = attention(q, k, v, backend=self.attention_backend).squeeze(2).transpose(1, 2).reshape(b, c, h, w)
        return x + self.proj_out(out)


class Upsample(nn.Module):
    """Nearest 2x in both axes, a causal conv, then the first frame of the causal axis dropped: n -> 2n - 1
    frames (Lightricks `Upsample`: the first two outputs both depend on the first input only)."""

    def __init__(self, channels: int, axis: str):
        super().__init__()
        self.axis = axis
        self.conv = CausalConv2d(channels, channels, 3, axis)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))        # (B, C, 2H, 2W)
        if self.axis == "height":
            return x[:, :, 1:]                                                     # (B, C, 2H - 1, 2W)
        if self.axis == "width":
            return x[:, :, :, 1:]
        return x


def _level(blocks: list[nn.Module], attns: list[nn.Module]) -> nn.Module:
    stage = nn.Module()
    stage.block = nn.ModuleList(blocks)
    stage.attn = nn.ModuleList(attns)
    return stage


def _mid(channels: int, config: AudioVAEConfig) -> nn.Module:
    mid = nn.Module()
    mid.block_1 = ResnetBlock(channels, channels, config)
    mid.attn_1 = AttnBlock(channels, config) if config.mid_block_add_attention else nn.Identity()
    mid.block_2 = ResnetBlock(channels, channels, config)
    return mid


def _run_level(stage: nn.Module, x: torch.Tensor) -> torch.Tensor:
    for i, block in enumerate(stage.block):
        x = block(x)
        if len(stage.attn):
            x = stage.attn[i](x)
    return x


def _run_mid(mid: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return mid.block_2(mid.attn_1(mid.block_1(x)))


class AudioEncoder(nn.Module):
    """Spectrogram (B, in_channels, T, mel_bins) -> posterior moments (B, 2 z, T', mel_bins / f)."""

    def __init__(self, config: AudioVAEConfig):
        super().__init__()
        axis, ch, levels = config.causality_axis, config.ch, len(config.ch_mult)
        self.conv_in = CausalConv2d(config.in_channels, ch, 3, axis)
        self.down = nn.ModuleList()
        cin, res = ch, config.resolution
        for i, mult in enumerate(config.ch_mult):
            cout = ch * mult
            blocks = [ResnetBlock(cin if j == 0 else cout, cout, config) for j in range(config.num_res_blocks)]
            attns = [AttnBlock(cout, config) for _ in blocks] if res in config.attn_resolutions else []
            stage = _level(blocks, attns)
            if i != levels - 1:
                stage.downsample = CausalConv2d(cout, cout, 3, axis, stride=2)
                res //= 2
            self.down.append(stage)
            cin = cout
        self.mid = _mid(cin, config)
        self.norm_out = _norm(cin, config.norm_type)
        self.conv_out = CausalConv2d(cin, 2 * config.z_channels if config.double_z else config.z_channels, 3, axis)

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        x = self.conv_in(mel)                                                      # (B, ch, T, M)
        for stage in self.down:
            x = _run_level(stage, x)
            if hasattr(stage, "downsample"):
                x = stage.downsample(x)                                            # (B, C, T / 2, M / 2), causal
        x = _run_mid(self.mid, x)
        return self.conv_out(F.silu(self.norm_out(x)))                             # (B, 2z, T', M')


class AudioDecoder(nn.Module):
    """Latents (B, z, T', M') -> spectrogram (B, out_ch, T' * f (- f + 1 causal), mel_bins)."""

    def __init__(self, config: AudioVAEConfig):
        super().__init__()
        axis, ch, levels = config.causality_axis, config.ch, len(config.ch_mult)
        cin = ch * config.ch_mult[-1]
        self.conv_in = CausalConv2d(config.z_channels, cin, 3, axis)
        self.mid = _mid(cin, config)
        ups: list[nn.Module] = []
        res = config.resolution // 2 ** (levels - 1)
        for i in reversed(range(levels)):  # built deepest level first; `up[i]` is level i, as in the checkpoint
            cout = ch * config.ch_mult[i]
            blocks = [ResnetBlock(cin if j == 0 else cout, cout, config) for j in range(config.num_res_blocks + 1)]
            attns = [AttnBlock(cout, config) for _ in blocks] if res in config.attn_resolutions else []
            stage = _level(blocks, attns)
            if i != 0:
                stage.upsample = Upsample(cout, axis)
                res *= 2
            ups.insert(0, stage)
            cin = cout
        self.up = nn.ModuleList(ups)
        self.norm_out = _norm(cin, config.norm_type)
        self.conv_out = CausalConv2d(cin, config.out_ch, 3, axis)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        x = _run_mid(self.mid, self.conv_in(z))                                    # (B, ch * mult[-1], T', M')
        for stage in reversed(self.up):
            x = _run_level(stage, x)
            if hasattr(stage, "upsample"):
                x = stage.upsample(x)                                              # (B, C, 2T - 1, 2M), causal
        return self.conv_out(F.silu(self.norm_out(x)))                             # (B, out_ch, T, mel_bins)


class PerChannelStatistics(nn.Module):
    """The dataset statistics of the mean latents, per token channel (ltx-core's buffer names, which
    carry a hyphen): the DiT sees (token - mean-of-means) / std-of-means."""

    def __init__(self, width: int):
        super().__init__()
        self.register_buffer("std-of-means", torch.ones(width))
        self.register_buffer("mean-of-means", torch.zeros(width))

    def normalize(self, tokens: torch.Tensor) -> torch.Tensor:
        mean, std = self.get_buffer("mean-of-means"), self.get_buffer("std-of-means")
        return (tokens - mean.to(tokens)) / std.to(tokens)

    def denormalize(self, tokens: torch.Tensor) -> torch.Tensor:
        mean, std = self.get_buffer("mean-of-means"), self.get_buffer("std-of-means")
        return tokens * std.to(tokens) + mean.to(tokens)


def audio_tokens(latents: torch.Tensor) -> torch.Tensor:
    """(B, z, T', M') latents -> (B, T', z * M') tokens, channel-major ("b c t f -> b t (c f)")."""
    return latents.transpose(1, 2).flatten(2)


def audio_latents(tokens: torch.Tensor, z_channels: int) -> torch.Tensor:
    """The inverse of `audio_tokens`: (B, T', z * M') -> (B, z, T', M')."""
    return tokens.unflatten(2, (z_channels, -1)).transpose(1, 2)


# ---------------------------------------------------------------- the VAE


@torch.no_grad()
def init_parameter(config: AudioVAEConfig, name: str, t: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """The seeded initial value of parameter `name`: conv weights U(+-1/sqrt(fan_in)) (torch's default for
    a conv), conv biases 0, GroupNorm scales 1 and shifts 0. Drawn in float32 on the CPU, then copied."""
    values = torch.empty(t.shape, dtype=torch.float32, device="cpu")
    if name.endswith(".weight") and t.dim() == 4:
        bound = 1.0 / math.sqrt(t[0].numel())
        values.uniform_(-bound, bound, generator=generator)
    elif name.endswith(".bias"):
        values.zero_()
    elif name.endswith(".weight") and t.dim() == 1:  # GroupNorm (norm_type "group" only)
        values.fill_(1.0)
    else:
        raise ValueError(f"init_parameter: no initialisation rule for audio VAE parameter {name!r} {tuple(t.shape)}")
    return t.copy_(values)


class LTX2AudioVAE(nn.Module):
    """The audio VAE: `encode` (log-mel -> normalised latents), `decode` (normalised latents -> log-mel),
    `moments` (the raw posterior, for training it). Parameters carry Lightricks' names without the
    checkpoint's `audio_vae.` prefix (`encoder.down.0.block.0.conv1.conv.weight`, `per_channel_statistics.
    mean-of-means`, ...). It computes in its weights' dtype; Lightricks runs it in float32 ("needs float32
    for quality", ltx-trainer process_videos.py), as `load_ltx2_audio_vae` does by default."""

    def __init__(self, config: AudioVAEConfig, seed: int | None = None):
        super().__init__()
        self.config = config
        self.encoder = AudioEncoder(config)
        self.decoder = AudioDecoder(config)
        self.per_channel_statistics = PerChannelStatistics(config.token_dim)
        initialize_by_name(self, init_parameter, config, seed)

    @property
    def dtype(self) -> torch.dtype:
        return self.encoder.conv_in.conv.weight.dtype

    def _check(self, x: torch.Tensor, channels: int, bins: int, what: str) -> None:
        if x.dim() != 4 or x.shape[1] != channels or x.shape[3] != bins:
            raise ValueError(f"LTX2AudioVAE.{what}: expected (B, {channels}, T, {bins}), got {tuple(x.shape)}")

    def moments(self, mel: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-mel (B, in_channels, T, mel_bins) -> posterior mean and log-variance, each (B, z, T', M'),
        not normalised (logvar clamped to [-30, 20] as diffusers' DiagonalGaussianDistribution does)."""
        self._check(mel, self.config.in_channels, self.config.mel_bins, "moments")
        h = self.encoder(mel.to(self.dtype))                                       # (B, 2z, T', M')
        if not self.config.double_z:
            return h, torch.zeros_like(h)
        mean, logvar = h.chunk(2, dim=1)
        return mean, logvar.clamp(-30.0, 20.0)

    def encode(self, mel: torch.Tensor) -> torch.Tensor:
        """Log-mel (B, in_channels, T, mel_bins), `mel.log_mel_spectrogram`'s output -> normalised mean
        latents (B, z, T', mel_bins / f), T' = `config.latent_frames(T)`: what the DiT reads (as tokens,
        `audio_tokens`) and what a trainer caches."""
        mean = self.moments(mel)[0]
        tokens = self.per_channel_statistics.normalize(audio_tokens(mean))         # (B, T', z * M')
        return audio_latents(tokens, self.config.z_channels)                       # (B, z, T', M')

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Normalised latents (B, z, T', M') -> log-mel (B, out_ch, `config.mel_frames(T')`, mel_bins), the
        vocoder's input. The decoder's output is cropped (or zero-padded) to that shape, as both
        references do."""
        c = self.config
        self._check(latents, c.z_channels, c.latent_mel_bins, "decode")
        tokens = self.per_channel_statistics.denormalize(audio_tokens(latents.to(self.dtype)))
        mel = self.decoder(audio_latents(tokens, c.z_channels))                    # (B, out_ch, ~T, ~mel_bins)
        frames = c.mel_frames(latents.shape[2])
        mel = mel[:, :, :frames, :c.mel_bins]
        return F.pad(mel, (0, c.mel_bins - mel.shape[3], 0, frames - mel.shape[2]))  # (B, out_ch, frames, bins)
