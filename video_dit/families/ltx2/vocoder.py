"""LTX-2's vocoders: the audio VAE's log-mel spectrogram to a stereo waveform, weight-compatible with
Lightricks' single-file checkpoint (`vocoder.*` keys, ltx-core `Vocoder` / `VocoderWithBWE`) and
diffusers' `LTX2Vocoder` / `LTX2VocoderWithBWE` (names: `audio_convert.py`).

`LTX2Vocoder` (LTX-2: HiFi-GAN, resblock "1"; LTX-2.3's first stage: BigVGAN v2, resblock "AMP1"):

    log-mel (B, 2, T, 64) --(time last, channels x bins stacked)--> (B, 128, T)
      conv_pre (k 7)                                              (B, 1024, T)
      5 times: [LeakyReLU 0.1 (HiFi-GAN)] ConvTranspose x r_i, then the mean of 3 res blocks
        (kernels 3, 7, 11; dilations 1, 3, 5)                     (B, 1024 / 2^i, T * r_1 ... r_i)
      act_post (LeakyReLU 0.01, or anti-aliased SnakeBeta for AMP1), conv_post (k 7)
      final activation (tanh, clamp or none)                      (B, 2, T * 240)  24 kHz released

    An AMP1 block's activation is `Activation1d`: 2x upsample (Kaiser-windowed sinc), Snake / SnakeBeta
    (x + sin^2(a x) / b, a and b stored as logs), 2x low-pass downsample.

`LTX2VocoderWithBWE` (LTX-2.3, 48 kHz):

    log-mel (B, 2, T, 64) --vocoder--> waveform x (B, 2, L) at 16 kHz, L = 160 T
      x padded to a multiple of hop 80 --causal STFT (n_fft 512, left pad 432) + mel basis, log--> (B, 2, L / 80, 64)
      --bwe_generator (BigVGAN v2, x240)--> residual (B, 2, 3 L)
      + x resampled x3 (Hann-windowed sinc, torchaudio.functional.resample's filter), clamp(-1, 1)
                                                                  (B, 2, 3 L) at 48 kHz

Where diffusers and Lightricks differ we follow Lightricks: the BWE vocoder runs in float32 whatever its
weights' dtype (ltx-core autocasts to float32; diffusers runs in the weights' dtype), and a final
activation of "clamp" exists for the first stage (ltx-core `apply_final_activation` with
`use_tanh_at_final` false; diffusers maps that config to no activation, see `audio_config.LTX23_VOCODER`).
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from video_dit.families.ltx2.audio_config import VocoderBWEConfig, VocoderConfig
from video_dit.families.ltx2.mel import mel_filter_bank
from video_dit.models.common import initialize_by_name

LRELU_SLOPE = 0.1  # HiFi-GAN's LeakyReLU slope inside the generator (ltx-core resnet.py)

# ---------------------------------------------------------------- anti-aliased resampling (BigVGAN v2)


def kaiser_sinc_filter(cutoff: float, half_width: float, kernel_size: int) -> torch.Tensor:
    """(1, 1, K) low-pass: a sinc at `cutoff` (of the sampling rate) under a Kaiser window whose beta
    comes from the transition width (Kaiser's formula), normalised to unit DC gain (BigVGAN v2's
    `kaiser_sinc_filter1d`, in ltx-core and diffusers alike)."""
    half = kernel_size // 2
    amplitude = 2.285 * (half - 1) * math.pi * 4 * half_width + 7.95
    if amplitude > 50.0:
        beta = 0.1102 * (amplitude - 8.7)
    elif amplitude >= 21.0:
        beta = 0.5842 * (amplitude - 21) ** 0.4 + 0.07886 * (amplitude - 21.0)
    else:
        beta = 0.0
    window = torch.kaiser_window(kernel_size, beta=beta, periodic=False)
    time = torch.arange(-half, half) + 0.5 if kernel_size % 2 == 0 else torch.arange(kernel_size) - half
    x = 2 * cutoff * time
    sinc = torch.where(x == 0, torch.ones_like(x), torch.sin(math.pi * x) / (math.pi * x))
    filt = 2 * cutoff * window * sinc
    return (filt / filt.sum()).view(1, 1, kernel_size)


def hann_sinc_filter(ratio: int, lowpass_filter_width: int = 6, rolloff: float = 0.99) -> tuple[torch.Tensor, int]:
    """(1, 1, 2 w ratio + 1) interpolation filter of an integer upsampling by `ratio`, and its half width w in
    input samples: torchaudio.functional.resample's Hann-windowed sinc (ltx-core `UpSample1d(window_type=
    "hann")`)."""
    width = math.ceil(lowpass_filter_width / rolloff)
    t = (torch.arange(2 * width * ratio + 1) / ratio - width) * rolloff
    window = torch.cos(t.clamp(-lowpass_filter_width, lowpass_filter_width) * math.pi / lowpass_filter_width / 2) ** 2
    return (torch.sinc(t) * window * rolloff / ratio).view(1, 1, -1), width


class UpSample1d(nn.Module):
    """Per-channel upsampling by `ratio`: replicate padding, a transposed conv with the filter, times ratio,
    cropped to exactly ratio x the input length. "kaiser": BigVGAN's anti-aliasing (kernel 12 at ratio 2);
    "hann": the BWE's skip resampler."""

    def __init__(self, ratio: int = 2, kernel_size: int = 12, window: str = "kaiser", persistent: bool = True):
        super().__init__()
        self.ratio = ratio
        with torch.device("cpu"):  # a fixed filter: made on the CPU even inside a meta-device build
            if window == "hann":
                filt, self.pad = hann_sinc_filter(ratio)
                k = filt.shape[-1]
                self.crop = (2 * self.pad * ratio, k - ratio)
            else:
                filt, k = kaiser_sinc_filter(0.5 / ratio, 0.6 / ratio, kernel_size), kernel_size
                self.pad = k // ratio - 1
                self.crop = (self.pad * ratio + (k - ratio) // 2, self.pad * ratio + (k - ratio + 1) // 2)
        self.register_buffer("filter", filt, persistent=persistent)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, L) -> (B, C, ratio * L)."""
        c = x.shape[1]
        x = F.pad(x, (self.pad, self.pad), mode="replicate")
        x = self.ratio * F.conv_transpose1d(x, self.filter.to(x).expand(c, -1, -1), stride=self.ratio, groups=c)
        return x[..., self.crop[0]:-self.crop[1]]


class LowPassFilter1d(nn.Module):
    """Per-channel Kaiser-sinc low-pass with `stride` (replicate padding): (B, C, L) -> (B, C, L / stride)."""

    def __init__(self, cutoff: float, half_width: float, stride: int, kernel_size: int = 12):
        super().__init__()
        self.stride = stride
        self.pads = (kernel_size // 2 - (kernel_size % 2 == 0), kernel_size // 2)
        with torch.device("cpu"):
            filt = kaiser_sinc_filter(cutoff, half_width, kernel_size)
        self.register_buffer("filter", filt)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = x.shape[1]
        x = F.pad(x, self.pads, mode="replicate")
        return F.conv1d(x, self.filter.to(x).expand(c, -1, -1), stride=self.stride, groups=c)


class DownSample1d(nn.Module):
    """2x anti-aliased downsampling; the filter sits in `lowpass` (ltx-core's checkpoint name)."""

    def __init__(self, ratio: int = 2, kernel_size: int = 12):
        super().__init__()
        self.lowpass = LowPassFilter1d(0.5 / ratio, 0.6 / ratio, ratio, kernel_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lowpass(x)


class Snake(nn.Module):
    """x + sin^2(a x) / b per channel, a = exp(alpha), b = exp(beta) (SnakeBeta) or b = a (Snake); the
    logs start at 0. `eps` 1e-9 under the division, as both references."""

    def __init__(self, channels: int, beta: bool):
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(channels))
        self.beta = nn.Parameter(torch.zeros(channels)) if beta else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = torch.exp(self.alpha)[None, :, None]
        b = torch.exp(self.beta)[None, :, None] if self.beta is not None else a
        return x + torch.sin(x * a).pow(2) / (b + 1e-9)


class Activation1d(nn.Module):
    """An activation at twice the rate: upsample 2x, act, downsample 2x (BigVGAN v2's anti-aliasing)."""

    def __init__(self, act: nn.Module):
        super().__init__()
        self.act = act
        self.upsample = UpSample1d(2, 12)
        self.downsample = DownSample1d(2, 12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.downsample(self.act(self.upsample(x)))                          # (B, C, L)


class ResBlock(nn.Module):
    """Three (act, dilated conv, act, conv) residual steps, 'same' padding. HiFi-GAN's ResBlock1 (LeakyReLU
    0.1, no parameters in `acts`) or BigVGAN's AMPBlock1 (anti-aliased Snake / SnakeBeta in `acts1`, `acts2`)."""

    def __init__(self, channels: int, kernel: int, dilations: tuple[int, int, int], config: VocoderConfig):
        super().__init__()
        self.convs1 = nn.ModuleList(nn.Conv1d(channels, channels, kernel, dilation=d, padding=d * (kernel - 1) // 2)
                                    for d in dilations)
        self.convs2 = nn.ModuleList(nn.Conv1d(channels, channels, kernel, padding=(kernel - 1) // 2)
                                    for _ in dilations)
        if config.resblock == "AMP1":
            beta = config.activation == "snakebeta"
            self.acts1 = nn.ModuleList(Activation1d(Snake(channels, beta)) for _ in dilations)
            self.acts2 = nn.ModuleList(Activation1d(Snake(channels, beta)) for _ in dilations)
        else:
            self.acts1 = self.acts2 = None

    def _act(self, acts, i: int, x: torch.Tensor) -> torch.Tensor:
        return F.leaky_relu(x, LRELU_SLOPE) if acts is None else acts[i](x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, (c1, c2) in enumerate(zip(self.convs1, self.convs2)):
            x = x + c2(self._act(self.acts2, i, c1(self._act(self.acts1, i, x))))
        return x


# ---------------------------------------------------------------- the generator


@torch.no_grad()
def init_parameter(config, name: str, t: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Seeded initial value of a vocoder parameter: conv weights U(+-1/sqrt(fan_in)) (fan_in = the
    weight's size past its first dimension, torch's default bound for a conv), biases 0, Snake log-scales
    0 (a = b = 1, as both references initialise them). Drawn in float32 on the CPU, then copied."""
    values = torch.empty(t.shape, dtype=torch.float32, device="cpu")
    if name.endswith(".weight") and t.dim() == 3:
        bound = 1.0 / math.sqrt(t[0].numel())
        values.uniform_(-bound, bound, generator=generator)
    elif name.endswith((".bias", ".alpha", ".beta")):
        values.zero_()
    else:
        raise ValueError(f"init_parameter: no initialisation rule for vocoder parameter {name!r} {tuple(t.shape)}")
    return t.copy_(values)


class LTX2Vocoder(nn.Module):
    """Log-mel (B, C, T, M), C * M = config.in_channels -> waveform (B, out_channels, T * config.hop) at
    config.output_sampling_rate, in [-1, 1] with a tanh / clamp final activation. Parameters carry
    ltx-core's names (`conv_pre`, `ups.i`, `resblocks.j.convs1.k`, `act_post`, `conv_post`)."""

    def __init__(self, config: VocoderConfig, seed: int | None = None):
        super().__init__()
        self.config = config
        c0, n = config.upsample_initial_channel, len(config.resblock_kernel_sizes)
        self.conv_pre = nn.Conv1d(config.in_channels, c0, 7, padding=3)
        self.ups = nn.ModuleList(nn.ConvTranspose1d(c0 // 2 ** i, c0 // 2 ** (i + 1), k, r, padding=(k - r) // 2)
                                 for i, (r, k) in enumerate(zip(config.upsample_rates, config.upsample_kernel_sizes)))
        self.resblocks = nn.ModuleList(
            ResBlock(c0 // 2 ** (i + 1), k, d, config)
            for i in range(len(config.upsample_rates))
            for k, d in zip(config.resblock_kernel_sizes, config.resblock_dilation_sizes))
        self.num_kernels = n
        c_out = c0 // 2 ** len(config.upsample_rates)
        # AMP1 ends in SnakeBeta whatever `activation` is (ltx-core `act_post`); HiFi-GAN in LeakyReLU's default
        # slope 0.01 (not 0.1: ltx-core's nn.LeakyReLU(), which diffusers keeps on purpose)
        self.act_post = Activation1d(Snake(c_out, beta=True)) if config.resblock == "AMP1" else nn.LeakyReLU()
        self.conv_post = nn.Conv1d(c_out, config.out_channels, 7, padding=3, bias=config.use_bias_at_final)
        initialize_by_name(self, init_parameter, config, seed)

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        """(B, C, T, M) log-mel, C * M = in_channels -> (B, out_channels, T * hop), in the weights' dtype."""
        c = self.config
        if mel.dim() != 4 or mel.shape[1] * mel.shape[3] != c.in_channels:
            raise ValueError(f"LTX2Vocoder: expected (B, C, T, M) with C * M = {c.in_channels}, got {tuple(mel.shape)}")
        x = self.conv_pre(mel.transpose(2, 3).flatten(1, 2).to(self.conv_pre.weight.dtype))  # (B, c0, T)
        for i, up in enumerate(self.ups):
            if c.resblock == "1":
                x = F.leaky_relu(x, LRELU_SLOPE)
            x = up(x)                                                                # (B, c0 / 2^(i+1), T * r...)
            blocks = self.resblocks[i * self.num_kernels:(i + 1) * self.num_kernels]
            x = torch.stack([block(x) for block in blocks]).mean(dim=0)
        x = self.conv_post(self.act_post(x))                                         # (B, out_channels, T * hop)
        if c.final_activation == "tanh":
            return torch.tanh(x)
        return x.clamp(-1.0, 1.0) if c.final_activation == "clamp" else x


# ---------------------------------------------------------------- bandwidth extension (LTX-2.3)


class _STFT(nn.Module):
    """Causal magnitude STFT as a strided conv with stored bases (`forward_basis`: n_freqs real rows, then
    n_freqs imaginary rows, each a DFT row times the window). The release loads its own bfloat16 bases
    (ltx-core: "the exact bfloat16 bases from training"); a fresh model gets Hann-windowed DFT rows, a
    stand-in of the same shape (not checked against the checkpoint). `inverse_basis` is stored in the
    checkpoint but read by no forward (kept for the keys)."""

    def __init__(self, n_fft: int, hop: int):
        super().__init__()
        self.hop, self.left_pad = hop, n_fft - hop
        with torch.device("cpu"):
            dft = torch.fft.rfft(torch.eye(n_fft, dtype=torch.float64))             # (n_fft, n_freqs) complex
            window = torch.hann_window(n_fft, periodic=True, dtype=torch.float64)
            basis = torch.cat([dft.real.T, dft.imag.T]) * window                     # (2 n_freqs, n_fft)
        self.register_buffer("forward_basis", basis.float()[:, None, :])
        self.register_buffer("inverse_basis", torch.zeros(basis.shape[0], 1, n_fft, device="cpu"))

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        """(N, L) -> magnitude (N, n_freqs, L / hop): each frame the n_fft samples ending at its hop."""
        spec = F.conv1d(F.pad(y[:, None], (self.left_pad, 0)), self.forward_basis.to(y), stride=self.hop)
        real, imag = spec.chunk(2, dim=1)
        return torch.sqrt(real ** 2 + imag ** 2)


class MelSTFT(nn.Module):
    """Causal log-mel of the first stage's waveform: mel_basis (n_mels, n_freqs) @ |STFT|, log(max(., 1e-5)).
    Like the STFT bases, the release loads `mel_basis`; a fresh model gets the Slaney filter bank over
    0..rate/2 (`mel.mel_filter_bank`), a stand-in."""

    def __init__(self, config: VocoderBWEConfig):
        super().__init__()
        self.stft_fn = _STFT(config.n_fft, config.hop_length)
        with torch.device("cpu"):
            bank = mel_filter_bank(config.n_fft // 2 + 1, config.num_mels, 0.0, config.input_sampling_rate / 2,
                                   config.input_sampling_rate)
        self.register_buffer("mel_basis", bank.T.contiguous())

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        """(N, L) -> (N, n_mels, L / hop)."""
        mel = torch.matmul(self.mel_basis.to(y), self.stft_fn(y))
        return torch.log(mel.clamp(min=1e-5))


@contextmanager
def _float32(module: nn.Module):
    """The module's floating tensors in float32 for the block, then back to their dtype (exact: bf16 and
    fp16 round-trip through float32). ltx-core does this on MPS and autocasts to float32 elsewhere, which
    it measured bit-identical; CPU autocast has no float32 mode, so we do this everywhere."""
    dtype = next(module.parameters()).dtype
    if dtype == torch.float32:
        yield
        return
    module.float()
    try:
        yield
    finally:
        module.to(dtype)


class LTX2VocoderWithBWE(nn.Module):
    """LTX-2.3's vocoder: log-mel (B, C, T, M) -> waveform (B, C, T * vocoder.hop * ratio) at
    output_sampling_rate in [-1, 1]. Submodules under ltx-core's names: `vocoder`, `bwe_generator`,
    `mel_stft`; the skip resampler's filter is not stored (computed, as in both references)."""

    def __init__(self, config: VocoderBWEConfig, seed: int | None = None):
        super().__init__()
        self.config = config
        self.vocoder = LTX2Vocoder(config.vocoder, seed=seed)
        self.bwe_generator = LTX2Vocoder(config.bwe, seed=None if seed is None else seed + 1)
        self.mel_stft = MelSTFT(config)
        self.resampler = UpSample1d(config.output_sampling_rate // config.input_sampling_rate, window="hann",
                                    persistent=False)

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        """(B, C, T, M) -> (B, C, T * hop * ratio) in the input's dtype, computed in float32 (ltx-core: bf16
        "degrades spectral metrics by 40-90%" through the 108 convolutions)."""
        c = self.config
        with _float32(self):
            x = self.vocoder(mel.float())                                            # (B, C, L) at the input rate
            b, ch, length = x.shape
            out_length = length * c.output_sampling_rate // c.input_sampling_rate
            x = F.pad(x, (0, -length % c.hop_length))                                # a whole number of hops
            spec = self.mel_stft(x.flatten(0, 1)).unflatten(0, (b, ch))             # (B, C, n_mels, frames)
            residual = self.bwe_generator(spec.transpose(2, 3))                      # (B, C, ratio * L')
            out = (residual + self.resampler(x)).clamp(-1.0, 1.0)[..., :out_length]
        return out.to(mel.dtype)
