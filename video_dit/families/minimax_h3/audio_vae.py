"""The MiniMax H3 audio VAE: mono 32 kHz waveform -> 32 latent channels at 40 per second -> waveform, with no
spectrogram front end and no separate vocoder (its decoder is a BigVGAN). Weight-compatible with MiniMax's
release (`audio_vae/model.safetensors`, `DacAudioVAE`) and diffusers' `AutoencoderKLMiniMaxH3Audio`, which keep the
same names (`weight_g` / `weight_v` of weight norm, the Kaiser filters as buffers); `load_h3_audio_vae` at the end.

Dataflow (released widths)

    audio (B, C, S) in [-1, 1] at 32 kHz, C = 2 (stereo; each channel is a mono waveform of the batch)
      -> (B C, 1, S'), right-padded with zeros to S' = 800 T, T = ceil(S / 800)
      -> encoder: conv 7                                   (B C, 64, S')
         5 blocks: residual units (Snake, dilated conv 7 at 1 / 3 / 9, Snake, conv 1) x3, Snake, strided conv,
         widths 128 .. 2048, strides 2, 4, 4, 5, 5          (B C, 2048, T)
         Snake, conv 3                                     (B C, 2048, T)
      -> pre_block: proj(LN(x)) + causal attention(LN(x)) (8 heads of 256 mean-pooled, then avg-pooled to 32),
         + GeGLU MLP                                      (B C, T, 32)
      -> mean_proj, logs_proj (1x1)                        (B C, 32, T) each: posterior N(mean, exp(logs)^2)
      -> normalize, channel-major rows (the DiT's layout)  (B, C T, 32)
    rows (B, C T, 32) -> denormalize                       (B, C, 32, T)
      -> dec_in_proj (1x1)                                 (B C, 2048, T)
      -> BigVGAN: conv 7 (-> 1024); 7 x [transposed conv up 5, 5, 2, 2, 2, 2, 2 (halving the width), the mean of
         3 AMP blocks (kernels 3 / 7 / 11, dilations 1 / 3 / 5; each conv after an anti-aliased SnakeBeta: 2x up,
         SnakeBeta, 2x down, Kaiser-sinc filters of 12 taps)]; anti-aliased SnakeBeta, conv 7 (-> 1), clamp
                                                           (B C, 1, 800 T)
      -> audio (B, C, 800 T) in [-1, 1]

MiniMax's release has no encode (its `DacAudioVAE` only decodes, `preprocess` pads); the encode path is diffusers'
(`AutoencoderKLMiniMaxH3Audio.encode`), which its pipeline runs on reference soundtracks (encoders.py,
`MiniMaxH3Ref2VAReferenceEncoderStep`: the posterior mean, never sampled). The posterior here is the house's
`DiagonalGaussian` with log-variance 2 logs (its clamp to [-30, 20] only matters at std outside e^-15 .. e^10).
The release is float32 and diffusers pins it so: bfloat16 decodes come out about 20 dB quieter.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from video_dit.families.minimax_h3.audio_config import AUDIO_PRESETS, H3AudioVAEConfig
from video_dit.models.attention import attention
from video_dit.models.causal_conv import DiagonalGaussian
from video_dit.models.common import initialize_by_name
from video_dit.models.layouts import preset_name
from video_dit.models.weights import WeightsError, materialize, read_state_dict

# The anti-aliased activations' resampling: 2x, 12-tap Kaiser-sinc filters (MiniMax dac_alias_free_act.py defaults)
ALIAS_RATIO = 2
ALIAS_TAPS = 12


@functools.lru_cache(maxsize=None)
def _kaiser_sinc(cutoff: float, half_width: float, taps: int) -> torch.Tensor:
    """(1, 1, taps) low-pass filter: a sinc of cutoff `cutoff` (in cycles per sample) under a Kaiser window whose
    beta follows Kaiser's formula for the transition width 4 `half_width`, normalised to sum 1. The arithmetic is
    alias-free-torch's (MiniMax dac_alias_free_filter.py), since its result is stored in the checkpoint. Always
    computed on the CPU (on the meta device torch would run it through slow decompositions, for no values)."""
    half = taps // 2
    attenuation = 2.285 * (half - 1) * math.pi * (4 * half_width) + 7.95
    if attenuation > 50.0:
        beta = 0.1102 * (attenuation - 8.7)
    elif attenuation >= 21.0:
        beta = 0.5842 * (attenuation - 21) ** 0.4 + 0.07886 * (attenuation - 21.0)
    else:
        beta = 0.0
    window = torch.kaiser_window(taps, beta=beta, periodic=False, device="cpu")
    time = torch.arange(-half, half, device="cpu") + 0.5 if taps % 2 == 0 else torch.arange(taps, device="cpu") - half
    filt = 2 * cutoff * window * torch.sinc(2 * cutoff * time)
    return (filt / filt.sum()).view(1, 1, taps)


def kaiser_sinc_filter(cutoff: float, half_width: float, taps: int) -> torch.Tensor:
    """A fresh copy of `_kaiser_sinc` (each module's buffer its own tensor)."""
    return _kaiser_sinc(cutoff, half_width, taps).clone()


# ---------------------------------------------------------------- layers


class WNConv1d(nn.Module):
    """Conv1d, or with `transpose` ConvTranspose1d, whose kernel is weight-normalised: weight_g weight_v / ||weight_v||,
    the norm over all but dim 0 (`torch.nn.utils.weight_norm`'s parameters, as the checkpoint stores them)."""

    def __init__(self, cin: int, cout: int, kernel: int, stride: int = 1, dilation: int = 1, padding: int = 0,
                 bias: bool = True, transpose: bool = False):
        super().__init__()
        shape = (cin, cout, kernel) if transpose else (cout, cin, kernel)
        self.weight_g = nn.Parameter(torch.ones(shape[0], 1, 1))
        self.weight_v = nn.Parameter(torch.empty(shape))
        self.bias = nn.Parameter(torch.zeros(cout)) if bias else None
        self.stride, self.dilation, self.padding, self.transpose = stride, dilation, padding, transpose

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        v = self.weight_v
        w = v * (self.weight_g / torch.linalg.vector_norm(v, dim=(1, 2), keepdim=True))
        if self.transpose:
            return F.conv_transpose1d(x, w, self.bias, self.stride, self.padding)
        return F.conv1d(x, w, self.bias, self.stride, self.padding, self.dilation)


class Snake1d(nn.Module):
    """x + sin(alpha x)^2 / (alpha + 1e-9), alpha (1, C, 1) per channel (DAC's)."""

    def __init__(self, channels: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(1, channels, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + (self.alpha + 1e-9).reciprocal() * torch.sin(self.alpha * x).pow(2)


class SnakeBeta(nn.Module):
    """x + sin(e^alpha x)^2 / (e^beta + 1e-9), alpha and beta (C,) in log scale (BigVGAN's `snake_logscale`)."""

    def __init__(self, channels: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(channels))
        self.beta = nn.Parameter(torch.zeros(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alpha, beta = self.alpha.exp().view(1, -1, 1), self.beta.exp().view(1, -1, 1)
        return x + (beta + 1e-9).reciprocal() * torch.sin(alpha * x).pow(2)


class UpSample1d(nn.Module):
    """2x anti-aliased upsampling: replicate-pad, a depthwise transposed conv with the Kaiser-sinc filter (gain 2),
    crop. (B, C, N) -> (B, C, 2N) (MiniMax dac_alias_free_resample.py `UpSample1d`)."""

    def __init__(self, ratio: int = ALIAS_RATIO, taps: int = ALIAS_TAPS):
        super().__init__()
        self.ratio, self.pad = ratio, taps // ratio - 1
        self.crop = (self.pad * ratio + (taps - ratio) // 2, self.pad * ratio + (taps - ratio + 1) // 2)
        self.register_buffer("filter", kaiser_sinc_filter(0.5 / ratio, 0.6 / ratio, taps))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        C = x.shape[1]
        x = F.pad(x, (self.pad, self.pad), mode="replicate")
        x = self.ratio * F.conv_transpose1d(x, self.filter.expand(C, -1, -1), stride=self.ratio, groups=C)
        return x[..., self.crop[0]:x.shape[-1] - self.crop[1]]


class LowPassFilter1d(nn.Module):
    """Replicate-pad and a strided depthwise conv with the Kaiser-sinc filter. (B, C, N) -> (B, C, N / stride)."""

    def __init__(self, cutoff: float, half_width: float, stride: int, taps: int):
        super().__init__()
        self.pads, self.stride = (taps // 2 - (taps % 2 == 0), taps // 2), stride
        self.register_buffer("filter", kaiser_sinc_filter(cutoff, half_width, taps))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        C = x.shape[1]
        x = F.pad(x, self.pads, mode="replicate")
        return F.conv1d(x, self.filter.expand(C, -1, -1), stride=self.stride, groups=C)


class DownSample1d(nn.Module):
    """2x anti-aliased downsampling (the low-pass at a quarter of the input rate). (B, C, 2N) -> (B, C, N)."""

    def __init__(self, ratio: int = ALIAS_RATIO, taps: int = ALIAS_TAPS):
        super().__init__()
        self.lowpass = LowPassFilter1d(0.5 / ratio, 0.6 / ratio, ratio, taps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lowpass(x)


class Activation1d(nn.Module):
    """An activation at twice the rate: up, act, down (alias-free-torch's; BigVGAN's anti-aliased SnakeBeta)."""

    def __init__(self, act: nn.Module):
        super().__init__()
        self.act, self.upsample, self.downsample = act, UpSample1d(), DownSample1d()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.downsample(self.act(self.upsample(x)))


class ResidualUnit(nn.Module):
    """DAC's: x + conv1(Snake(conv7 dilated(Snake(x)))), the shortcut centre-cropped if the convs shrank time."""

    def __init__(self, dim: int, dilation: int):
        super().__init__()
        self.block = nn.Sequential(Snake1d(dim), WNConv1d(dim, dim, 7, dilation=dilation, padding=3 * dilation),
                                   Snake1d(dim), WNConv1d(dim, dim, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.block(x)
        crop = (x.shape[-1] - y.shape[-1]) // 2
        return (x[..., crop:x.shape[-1] - crop] if crop > 0 else x) + y


class EncoderBlock(nn.Module):
    """Three residual units (dilations 1, 3, 9) at dim / 2, Snake, a strided conv to dim.
    (B, dim / 2, N) -> (B, dim, N / stride)."""

    def __init__(self, dim: int, stride: int):
        super().__init__()
        self.block = nn.Sequential(ResidualUnit(dim // 2, 1), ResidualUnit(dim // 2, 3), ResidualUnit(dim // 2, 9),
                                   Snake1d(dim // 2),
                                   WNConv1d(dim // 2, dim, 2 * stride, stride=stride, padding=math.ceil(stride / 2)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x)


class Encoder(nn.Module):
    """DAC's waveform encoder: (B, 1, S) -> (B, latent_dim, S / hop)."""

    def __init__(self, cfg: H3AudioVAEConfig):
        super().__init__()
        d = cfg.encoder_dim
        blocks: list[nn.Module] = [WNConv1d(1, d, 7, padding=3)]
        for stride in cfg.encoder_rates:
            d *= 2
            blocks.append(EncoderBlock(d, stride))
        blocks += [Snake1d(d), WNConv1d(d, cfg.latent_dim, 3, padding=1)]
        self.block = nn.Sequential(*blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x)


class CausalAttention(nn.Module):
    """Causal self-attention that narrows the width: q, k, v at in_dim in `heads` heads of in_dim / heads, the
    heads mean-pooled away, the head width average-pooled to out_dim, then `proj` (MiniMax dac_attn_proj.py,
    `in_dim > out_dim`). One fused bias-less `qkv`, biases `q_bias`, `v_bias` and a zero key bias (a buffer, in the
    checkpoint). (B, N, in_dim) -> (B, N, out_dim)."""

    def __init__(self, in_dim: int, out_dim: int, heads: int):
        super().__init__()
        self.heads, self.out_dim = heads, out_dim
        self.qkv = nn.Linear(in_dim, 3 * in_dim, bias=False)
        self.q_bias = nn.Parameter(torch.zeros(in_dim))
        self.v_bias = nn.Parameter(torch.zeros(in_dim))
        self.register_buffer("zero_k_bias", torch.zeros(in_dim))
        self.proj = nn.Linear(out_dim, out_dim)
        self.attention_backend = "native"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, _ = x.shape
        bias = torch.cat([self.q_bias, self.zero_k_bias, self.v_bias])
        q, k, v = F.linear(x, self.qkv.weight, bias).view(B, N, 3, self.heads, -1).unbind(2)  # (B, N, H, hd) each
        causal = torch.ones(N, N, dtype=torch.bool, device=x.device).tril()[None, None]  # (1, 1, N, N)
        o = attention(q, k, v, backend=self.attention_backend, attn_mask=causal).mean(dim=2)  # (B, N, hd)
        if o.shape[-1] != self.out_dim:
            o = F.adaptive_avg_pool1d(o, self.out_dim)  # (B, N, out_dim)
        return self.proj(o)


class GeGluMlp(nn.Module):
    """LN, then w2(gelu_tanh(w0 x) w1 x). (B, N, dim) -> (B, N, dim)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.w0, self.w1, self.w2 = nn.Linear(dim, hidden), nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x)
        return self.w2(F.gelu(self.w0(x), approximate="tanh") * self.w1(x))


class AttnProjection(nn.Module):
    """`pre_block`: proj(norm3(x)) + attn(norm1(x)), then + mlp(norm2(.)) (the MLP norms once more inside).
    (B, N, latent_dim) -> (B, N, latent_channels)."""

    def __init__(self, in_dim: int, out_dim: int, heads: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(in_dim)
        self.attn = CausalAttention(in_dim, out_dim, heads)
        self.proj = nn.Linear(in_dim, out_dim)
        self.norm3 = nn.LayerNorm(in_dim)
        self.norm2 = nn.LayerNorm(out_dim)
        self.mlp = GeGluMlp(out_dim, 2 * out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj(self.norm3(x)) + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class AMPBlock(nn.Module):
    """BigVGAN's AMPBlock1: per dilation d, x + conv(act(conv_d(act(x)))), each act an anti-aliased SnakeBeta."""

    def __init__(self, channels: int, kernel: int, dilations: tuple[int, ...]):
        super().__init__()
        self.convs1 = nn.ModuleList([WNConv1d(channels, channels, kernel, dilation=d, padding=(kernel * d - d) // 2)
                                     for d in dilations])
        self.convs2 = nn.ModuleList([WNConv1d(channels, channels, kernel, padding=(kernel - 1) // 2)
                                     for _ in dilations])
        self.activations = nn.ModuleList([Activation1d(SnakeBeta(channels)) for _ in range(2 * len(dilations))])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for c1, c2, a1, a2 in zip(self.convs1, self.convs2, self.activations[::2], self.activations[1::2]):
            x = x + c2(a2(c1(a1(x))))
        return x


class BigVGAN(nn.Module):
    """(B, latent_dim, T) -> (B, 1, hop T) in [-1, 1] (clamped, no tanh: MiniMax's `use_tanh_at_final` False).
    Each upsampler sits alone in a list (`ups.{i}.0`), as in the checkpoint."""

    def __init__(self, cfg: H3AudioVAEConfig):
        super().__init__()
        c = cfg.decoder_dim
        self.conv_pre = WNConv1d(cfg.latent_dim, c, 7, padding=3)
        self.ups = nn.ModuleList([nn.ModuleList([WNConv1d(c >> i, c >> (i + 1), k, stride=u, padding=(k - u) // 2,
                                                          transpose=True)])
                                  for i, (u, k) in enumerate(zip(cfg.decoder_rates, cfg.decoder_kernel_sizes))])
        self.resblocks = nn.ModuleList([AMPBlock(c >> (i + 1), k, d) for i in range(len(cfg.decoder_rates))
                                        for k, d in zip(cfg.resblock_kernel_sizes, cfg.resblock_dilation_sizes)])
        last = c >> len(cfg.decoder_rates)
        self.activation_post = Activation1d(SnakeBeta(last))
        self.conv_post = WNConv1d(last, 1, 7, padding=3, bias=False)
        self.kernels = len(cfg.resblock_kernel_sizes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv_pre(x)
        for i, up in enumerate(self.ups):
            x = up[0](x)  # (B, c / 2^(i+1), N u)
            x = sum(self.resblocks[i * self.kernels + j](x) for j in range(self.kernels)) / self.kernels
        return self.conv_post(self.activation_post(x)).clamp(-1.0, 1.0)


# ---------------------------------------------------------------- the VAE


class H3AudioVAE(nn.Module):
    """The MiniMax H3 audio VAE. `encode(audio)` -> posterior over VAE latents, `normalize` -> the DiT's audio rows;
    `denormalize` -> `decode(z)` -> audio. Inference only (no autograd)."""

    def __init__(self, config: H3AudioVAEConfig, seed: int | None = None):
        super().__init__()
        self.config = config
        z = config.latent_channels
        self.encoder = Encoder(config)
        self.pre_block = AttnProjection(config.latent_dim, z, config.num_attention_heads)
        self.mean_proj = nn.Conv1d(z, z, 1)
        self.logs_proj = nn.Conv1d(z, z, 1)
        self.dec_in_proj = nn.Conv1d(z, config.latent_dim, 1)
        self.decoder = BigVGAN(config)
        self.initialize_weights(seed)

    @torch.no_grad()
    def initialize_weights(self, seed: int | None = None) -> None:
        """Seeded by (seed, parameter name) (`initialize_by_name`), as MiniMax's `init_weights` draws (a fresh VAE;
        the release's weights replace it): weight-normed kernels' directions N(0, 0.01) (hifi-gan's
        `init_weights`) with weight_g their norms (what `weight_norm` sets when it wraps a conv), the 1x1 convs
        N(0, 0.02) (DAC's, untruncated here), conv biases zero; Linears PyTorch's default U(+-1 / sqrt(fan_in)),
        the attention's q / v biases zero; Snake alphas one, SnakeBetas' log alpha and beta zero; LayerNorms 1, 0."""
        fan_in = {name: m.weight.shape[1] for name, m in self.named_modules() if isinstance(m, nn.Linear)}
        plain = {name for name, m in self.named_modules() if isinstance(m, nn.Conv1d)}

        def init(config, name: str, p: nn.Parameter, generator: torch.Generator) -> None:
            module, _, leaf = name.rpartition(".")
            values = torch.zeros(p.shape)
            if leaf == "weight_v":
                values.normal_(0.0, 0.01, generator=generator)
            elif module in plain and leaf == "weight":
                values.normal_(0.0, 0.02, generator=generator)
            elif module in fan_in:
                bound = fan_in[module] ** -0.5
                values.uniform_(-bound, bound, generator=generator)
            elif (leaf == "alpha" and p.ndim == 3) or leaf == "weight_g" or (leaf == "weight" and p.ndim == 1):
                values.fill_(1.0)  # Snake1d alpha, LayerNorm weights; weight_g is set from weight_v below
            p.copy_(values)

        initialize_by_name(self, init, self.config, seed)
        for m in self.modules():
            if isinstance(m, WNConv1d) and m.weight_v.device.type != "meta":
                m.weight_g.copy_(torch.linalg.vector_norm(m.weight_v, dim=(1, 2), keepdim=True))

    @property
    def device(self) -> torch.device:
        return self.mean_proj.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.mean_proj.weight.dtype

    def latent_frames(self, samples: int) -> int:
        """T = ceil(S / hop): the waveform is right-padded to whole latents."""
        return -(-samples // self.config.hop_length)

    @torch.no_grad()
    def encode(self, audio: torch.Tensor) -> DiagonalGaussian:
        """audio (B, C, S) in [-1, 1] at `sampling_rate` (any channel count: each channel is encoded as a mono
        waveform) -> posterior over VAE latents, mean and log-variance (B, C, 32, T) in float32, T = ceil(S / 800),
        the waveform right-padded with zeros (diffusers `encode`, MiniMax `preprocess`). MiniMax H3 reads the mean."""
        cfg = self.config
        if audio.ndim != 3:
            raise ValueError(f"H3AudioVAE.encode expects audio (B, C, S), got {tuple(audio.shape)}")
        B, C, S = audio.shape
        x = audio.reshape(B * C, 1, S).to(self.dtype)
        x = F.pad(x, (0, self.latent_frames(S) * cfg.hop_length - S))  # (B C, 1, hop T)
        h = self.encoder(x)  # (B C, latent_dim, T)
        h = self.pre_block(h.transpose(1, 2)).transpose(1, 2)  # (B C, 32, T)
        mean = self.mean_proj(h).float().view(B, C, cfg.latent_channels, -1)
        logs = self.logs_proj(h).float().view(B, C, cfg.latent_channels, -1)
        return DiagonalGaussian(mean, 2 * logs)  # the heads predict log std

    @torch.no_grad()
    def decode(self, z: torch.Tensor) -> torch.Tensor:
        """z (B, C, 32, T) VAE latents (`denormalize` the DiT's rows first) -> audio (B, C, 800 T) in [-1, 1], float32,
        at `sampling_rate`."""
        cfg = self.config
        if z.ndim != 4 or z.shape[2] != cfg.latent_channels:
            raise ValueError(f"H3AudioVAE.decode expects latents (B, C, {cfg.latent_channels}, T), "
                             f"got {tuple(z.shape)}")
        B, C, _, T = z.shape
        x = self.decoder(self.dec_in_proj(z.reshape(B * C, cfg.latent_channels, T).to(self.dtype)))  # (B C, 1, hop T)
        return x.float().view(B, C, -1)

    def forward(self, audio: torch.Tensor, generator: torch.Generator | None = None, sample: bool = False):
        """Reconstruction: audio (B, C, S) -> (audio (B, C, 800 T), posterior)."""
        posterior = self.encode(audio)
        return self.decode(posterior.sample(generator) if sample else posterior.mode()), posterior

    # -------------------------------------------------------- the DiT's layout

    def _stats(self, ref: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mean = torch.tensor(self.config.latents_mean, dtype=torch.float32, device=ref.device)
        std = torch.tensor(self.config.latents_std, dtype=torch.float32, device=ref.device)
        return mean.to(ref.dtype), std.to(ref.dtype)

    def normalize(self, z: torch.Tensor) -> torch.Tensor:
        """VAE latents (B, C, 32, T) -> the DiT's audio rows (B, C T, 32): (z - latents_mean) / latents_std per
        channel, each audio channel's T rows in turn (channel-major; diffusers encoders.py, the ref2va reference
        soundtracks). C must be `config.channels` (stereo; `as_stereo` repeats a mono waveform, as MiniMax does)."""
        B, C, Z, T = z.shape
        if C != self.config.channels:
            raise ValueError(f"H3AudioVAE.normalize: {C} audio channel(s); the DiT's rows hold {self.config.channels} "
                             "(encode `as_stereo(audio)` for a mono track)")
        mean, std = self._stats(z)
        return ((z.transpose(2, 3) - mean) / std).reshape(B, C * T, Z)

    def denormalize(self, rows: torch.Tensor) -> torch.Tensor:
        """The DiT's audio rows (B, C T, 32) -> VAE latents (B, C, 32, T), C = `config.channels` (diffusers
        decoders.py `MiniMaxH3AfterDenoiseStep` / `MiniMaxH3AudioDecodeStep`)."""
        B, N, Z = rows.shape
        C = self.config.channels
        if N % C or Z != self.config.latent_channels:
            raise ValueError(f"H3AudioVAE.denormalize expects rows (B, {C} T, {self.config.latent_channels}), "
                             f"got {tuple(rows.shape)}")
        mean, std = self._stats(rows)
        return (rows * std + mean).view(B, C, N // C, Z).transpose(2, 3)


def as_stereo(audio: torch.Tensor) -> torch.Tensor:
    """(B, 1 or 2, S) -> (B, 2, S): a mono track repeated on both channels (MiniMax H3's pipeline upmixes so,
    diffusers before_encoder.py `_normalize_audio_condition`)."""
    if audio.ndim != 3 or audio.shape[1] not in (1, 2):
        raise ValueError(f"as_stereo expects audio (B, 1 or 2, S), got {tuple(audio.shape)}")
    return audio.expand(-1, 2, -1) if audio.shape[1] == 1 else audio


# ---------------------------------------------------------------- weights

# `torch.nn.utils.parametrizations.weight_norm` (MiniMax's modules) saves weight_g / weight_v as these
_PARAMETRIZED = re.compile(r"(?P<m>.+)\.parametrizations\.weight\.original(?P<i>[01])")


def h3_audio_vae_to_native(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """MiniMax's and diffusers' keys are ours (`weight_g` / `weight_v`, the filters as buffers); a state dict saved
    from modules under torch's newer parametrized weight norm (`*.parametrizations.weight.original0 / 1`) is renamed
    to them. Unknown keys are left to the load's check, which names them."""
    out = {}
    for key, value in sd.items():
        m = _PARAMETRIZED.fullmatch(key)
        out[f"{m['m']}.weight_{'gv'[int(m['i'])]}" if m else key] = value
    return out


def h3_audio_config_from_original(metadata: dict, wrapper: dict) -> H3AudioVAEConfig:
    """MiniMax's `audio_vae/metadata.json` (its "metadata"."kwargs") and `audio_vae/config.json` -> the config.
    MiniMax's code builds only the BigVGAN decoder with the attention projection, and hard-codes the heads (8), the
    AMP kernels and dilations and the upsample kernels (2u, or 2u - 1 for odd u) of its two rates' tables."""
    kw = metadata["metadata"]["kwargs"] if "metadata" in metadata else metadata
    if kw.get("decoder_type", "bigvgan") != "bigvgan" or not kw.get("attn_proj", False):
        raise ValueError(f"audio_vae/metadata.json: decoder_type={kw.get('decoder_type')!r}, attn_proj="
                         f"{kw.get('attn_proj')!r}; MiniMax H3's audio VAE is the BigVGAN one with attn_proj true")
    if kw["sample_rate"] != wrapper.get("sample_rate", kw["sample_rate"]):
        raise ValueError(f"audio_vae: metadata.json sample_rate={kw['sample_rate']} but config.json says "
                         f"{wrapper['sample_rate']}")
    return H3AudioVAEConfig(
        encoder_dim=kw.get("encoder_dim", 64), encoder_rates=tuple(kw["encoder_rates"]), latent_dim=kw["latent_dim"],
        latent_channels=kw["vae_latent_channels"], decoder_dim=kw["decoder_dim"],
        decoder_rates=tuple(kw["decoder_rates"]),
        decoder_kernel_sizes=tuple(2 * u - u % 2 for u in kw["decoder_rates"]),
        sampling_rate=kw["sample_rate"], latents_mean=tuple(wrapper["latents_mean"]),
        latents_std=tuple(wrapper["latents_std"]))


_DIFFUSERS_FIELDS = set(H3AudioVAEConfig.__dataclass_fields__) - {"channels"}


def h3_audio_config_from_diffusers(d: dict) -> H3AudioVAEConfig:
    """A diffusers `AutoencoderKLMiniMaxH3Audio` config.json dict -> the config (its names are ours; the latent
    statistics required, diffusers defaults them to none); an unknown key is an error naming it."""
    d = {k: v for k, v in d.items() if not k.startswith("_")}
    unknown = sorted(set(d) - _DIFFUSERS_FIELDS)
    if unknown:
        raise ValueError(f"AutoencoderKLMiniMaxH3Audio config: unknown keys {unknown}; "
                         f"known: {sorted(_DIFFUSERS_FIELDS)}")
    missing = [k for k in ("latents_mean", "latents_std") if d.get(k) is None]
    if missing:
        raise ValueError(f"AutoencoderKLMiniMaxH3Audio config: no {' / '.join(missing)}")
    return H3AudioVAEConfig.from_dict(d)


def h3_audio_config_to_diffusers(config: H3AudioVAEConfig) -> dict:
    """The config -> `AutoencoderKLMiniMaxH3Audio(**kwargs)` arguments (diffusers has no `channels`: it is the
    pipeline's `audio_channels`)."""
    out = {}
    for name in sorted(_DIFFUSERS_FIELDS):
        v = getattr(config, name)
        out[name] = [list(x) if isinstance(x, tuple) else x for x in v] if isinstance(v, tuple) else v
    return out


def load_h3_audio_vae(source: str | os.PathLike, dtype: torch.dtype | None = None, device=None,
                      config: H3AudioVAEConfig | None = None, seed: int = 0) -> H3AudioVAE:
    """An `H3AudioVAE` from `preset:NAME` (seeded random init of `AUDIO_PRESETS[NAME]`), a folder (diffusers'
    `audio_vae/`: config.json + diffusion_pytorch_model.safetensors; MiniMax's `audio_vae/`: config.json +
    metadata.json + model.safetensors; or a pipeline folder holding one) or a `.safetensors` file with `config`.
    dtype None keeps the stored dtype (the release: float32, which it should stay)."""
    src = str(source)
    name = preset_name(src)
    if name is not None:
        if config is None and name not in AUDIO_PRESETS:
            raise WeightsError(f"{src}: unknown MiniMax H3 audio VAE preset {name!r}; "
                               f"valid: {', '.join(AUDIO_PRESETS)}")
        model = H3AudioVAE(config or AUDIO_PRESETS[name], seed=seed).to(device)
        return model.to(dtype=dtype) if dtype is not None else model
    path = Path(src)
    if path.is_dir():
        for sub in ("audio_vae", "FL2VA/audio_vae", "Ref2VA/audio_vae"):
            if (path / sub / "config.json").is_file():
                path = path / sub
                break
        cfg_json = path / "config.json"
        if not cfg_json.is_file():
            raise WeightsError(f"{path}: no config.json; expected diffusers' or MiniMax's audio_vae/ folder "
                               "(huggingface-cli download MiniMaxAI/MiniMax-H3 --include 'audio_vae/*' "
                               "--local-dir MODELS/minimax-h3)")
        wrapper = json.loads(cfg_json.read_text())
        try:
            if "source_metadata_path" in wrapper:  # MiniMax's audio_vae/
                found = h3_audio_config_from_original(
                    json.loads((path / wrapper["source_metadata_path"]).read_text()), wrapper)
                weights = path / wrapper.get("source_safetensors_path", "model.safetensors")
            else:
                found, weights = h3_audio_config_from_diffusers(wrapper), path
        except (ValueError, TypeError, KeyError) as exc:
            raise WeightsError(f"{cfg_json}: not a MiniMax H3 audio VAE config ({exc})") from exc
        config = config or found
    elif config is None:
        raise WeightsError(f"{path}: a bare weights file; pass config= (an H3AudioVAEConfig) or load its folder")
    else:
        weights = path
    sd = h3_audio_vae_to_native(read_state_dict(weights))
    return materialize(H3AudioVAE, config, sd, str(weights), dtype, device)
