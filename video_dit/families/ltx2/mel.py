"""LTX-2's audio front end: a waveform to the log-mel spectrogram its audio VAE encodes, in torch.

    waveform (B, C, S) at any rate --to_stereo (C -> 2, ltx-trainer's downmix rules)--> (B, 2, S)
      --resample to 16 kHz (torchaudio.functional.resample's windowed sinc)--> (B, 2, S')
      --STFT: n_fft 1024, hop 160, periodic Hann window of 1024, centred (reflect pad 512), |.|-->
        (B, 2, 513, T), T = S' // 160 + 1 (100 frames per second)
      --mel filter bank: 64 bins, 0..8000 Hz, Slaney mel scale and Slaney area normalisation-->
        (B, 2, 64, T) --log(max(x, 1e-5)), then (time, bin) order--> (B, 2, T, 64)          [waveform_to_mel]

The reference is ltx-core `AudioProcessor` (model/audio_vae/ops.py), which the trainer's preprocessing
(ltx-trainer scripts/process_videos.py `_encode_audio`) and ltx-pipelines' audio conditioning use:
`torchaudio.transforms.MelSpectrogram(sample_rate, n_fft, win_length=n_fft, hop_length, f_min=0,
f_max=sample_rate / 2, n_mels, window_fn=torch.hann_window, center=True, pad_mode="reflect", power=1.0,
mel_scale="slaney", norm="slaney")`, then `log(clamp(mel, 1e-5))` and `permute(0, 1, 3, 2)`; waveforms
at another rate first go through `torchaudio.functional.resample` (its defaults). The numbers come from
the audio VAE's config (`AudioEncoder.sample_rate / mel_bins / mel_hop_length / n_fft`: 16000, 64, 160,
1024 released; `MelConfig.from_audio_vae`). torchaudio is not a dependency here: the STFT is `torch.stft`
with the arguments torchaudio's `spectrogram` passes it, the filter bank and the resampling kernel follow
torchaudio's `melscale_fbanks` and `_get_sinc_resample_kernel` formulas (computed in float64 and cast,
torchaudio computes them in float32: they agree to float32 rounding).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from video_dit.families.ltx2.audio_config import AudioVAEConfig


@dataclass(frozen=True)
class MelConfig:
    """The log-mel spectrogram's numbers. Fixed, as in the reference: window length = n_fft, periodic
    Hann window, centred frames with reflect padding, magnitude (power 1), Slaney mel scale and norm."""

    sample_rate: int = 16000
    n_fft: int = 1024
    hop_length: int = 160
    n_mels: int = 64
    f_min: float = 0.0
    f_max: float = 8000.0       # sample_rate / 2
    log_floor: float = 1e-5     # log(clamp(mel, min=1e-5))

    def __post_init__(self):
        if self.n_fft < 2 or self.hop_length < 1 or self.n_mels < 1 or self.sample_rate < 1:
            raise ValueError(f"MelConfig: n_fft={self.n_fft}, hop_length={self.hop_length}, n_mels={self.n_mels}, "
                             f"sample_rate={self.sample_rate}; accepted: n_fft >= 2, the others >= 1")
        if not 0 <= self.f_min < self.f_max <= self.sample_rate / 2:
            raise ValueError(f"MelConfig: need 0 <= f_min < f_max <= sample_rate / 2 = {self.sample_rate / 2}, "
                             f"got f_min={self.f_min}, f_max={self.f_max}")

    @property
    def n_freqs(self) -> int:
        return self.n_fft // 2 + 1

    def frames(self, samples: int) -> int:
        """Spectrogram frames of `samples` samples (centred frames): samples // hop + 1."""
        return samples // self.hop_length + 1

    @classmethod
    def from_audio_vae(cls, config: AudioVAEConfig) -> "MelConfig":
        """The spectrogram an audio VAE of `config` reads (ltx-core `encode_audio` builds its AudioProcessor
        from the encoder's sample_rate, mel_bins, mel_hop_length, n_fft; f_max = sample_rate / 2)."""
        return cls(sample_rate=config.sample_rate, n_fft=config.n_fft, hop_length=config.mel_hop_length,
                   n_mels=config.mel_bins, f_max=config.sample_rate / 2)


LTX2_MEL = MelConfig()


# ---------------------------------------------------------------- the Slaney mel filter bank


def hz_to_mel(freq: torch.Tensor) -> torch.Tensor:
    """Slaney's mel scale (librosa's default, torchaudio mel_scale="slaney"): linear below 1 kHz (3 mels
    per 200 Hz), logarithmic above (27 mels per factor 6.4)."""
    logstep = math.log(6.4) / 27.0
    return torch.where(freq >= 1000.0, 15.0 + torch.log(freq.clamp(min=1e-10) / 1000.0) / logstep, freq * 3.0 / 200.0)


def mel_to_hz(mels: torch.Tensor) -> torch.Tensor:
    logstep = math.log(6.4) / 27.0
    return torch.where(mels >= 15.0, 1000.0 * torch.exp(logstep * (mels - 15.0)), mels * 200.0 / 3.0)


def mel_filter_bank(n_freqs: int, n_mels: int, f_min: float, f_max: float, sample_rate: int) -> torch.Tensor:
    """(n_freqs, n_mels) float32 triangular filters, evenly spaced on the Slaney mel scale between f_min and
    f_max, each scaled to unit area (2 / its width in Hz: Slaney norm), over the STFT bins at
    linspace(0, sample_rate // 2, n_freqs) Hz (torchaudio `melscale_fbanks` with norm and mel_scale "slaney")."""
    f64 = torch.float64
    bins = torch.linspace(0, sample_rate // 2, n_freqs, dtype=f64)
    edges = mel_to_hz(torch.linspace(hz_to_mel(torch.tensor(f_min, dtype=f64)).item(),
                                     hz_to_mel(torch.tensor(f_max, dtype=f64)).item(), n_mels + 2, dtype=f64))
    width = edges[1:] - edges[:-1]                                                 # (n_mels + 1,)
    slopes = edges[None, :] - bins[:, None]                                        # (n_freqs, n_mels + 2)
    rising = -slopes[:, :-2] / width[:-1]
    falling = slopes[:, 2:] / width[1:]
    bank = torch.clamp(torch.minimum(rising, falling), min=0.0)                    # (n_freqs, n_mels)
    bank = bank * (2.0 / (edges[2:] - edges[:-2]))[None, :]
    return bank.to(torch.float32)


# ---------------------------------------------------------------- spectrogram


def log_mel_spectrogram(waveform: torch.Tensor, config: MelConfig = LTX2_MEL) -> torch.Tensor:
    """Waveform (B, C, S) at `config.sample_rate`, S > n_fft // 2 -> log-mel (B, C, T, n_mels) float32,
    T = S // hop + 1. Computed in float32 whatever the input dtype (the reference runs torchaudio's float32
    transform on the waveform and casts the result to the waveform's dtype; cast it yourself if you want
    that)."""
    if waveform.dim() != 3:
        raise ValueError(f"log_mel_spectrogram: expected a (B, C, samples) waveform, got {tuple(waveform.shape)}")
    if waveform.shape[-1] <= config.n_fft // 2:
        raise ValueError(f"log_mel_spectrogram: {waveform.shape[-1]} samples; the centred STFT's reflect padding "
                         f"needs more than n_fft // 2 = {config.n_fft // 2}")
    b, c, s = waveform.shape
    x = waveform.reshape(b * c, s).float()
    window = torch.hann_window(config.n_fft, periodic=True, dtype=torch.float32, device=x.device)
    spec = torch.stft(x, config.n_fft, hop_length=config.hop_length, win_length=config.n_fft, window=window,
                      center=True, pad_mode="reflect", normalized=False, onesided=True,
                      return_complex=True).abs()                                   # (B * C, n_freqs, T)
    bank = mel_filter_bank(config.n_freqs, config.n_mels, config.f_min, config.f_max, config.sample_rate)
    mel = torch.matmul(spec.transpose(1, 2), bank.to(x.device))                    # (B * C, T, n_mels)
    return torch.log(mel.clamp(min=config.log_floor)).reshape(b, c, -1, config.n_mels)


# ---------------------------------------------------------------- resampling and channels


def resample(waveform: torch.Tensor, orig_freq: int, new_freq: int, lowpass_filter_width: int = 6,
             rolloff: float = 0.99) -> torch.Tensor:
    """(..., S) at orig_freq -> (..., ceil(S * new / orig)) at new_freq: torchaudio.functional.resample with
    its defaults (method "sinc_interp_hann"). The rates are reduced by their gcd; each of the `new` output
    phases is a Hann-windowed sinc low-pass at rolloff * min(orig, new) / 2, zero past
    `lowpass_filter_width` zero crossings; the signal is zero-padded at both ends."""
    if orig_freq == new_freq:
        return waveform
    if orig_freq < 1 or new_freq < 1:
        raise ValueError(f"resample: rates must be positive integers, got {orig_freq} -> {new_freq}")
    gcd = math.gcd(int(orig_freq), int(new_freq))
    orig, new = int(orig_freq) // gcd, int(new_freq) // gcd
    base = min(orig, new) * rolloff
    width = math.ceil(lowpass_filter_width * orig / base)
    f64 = torch.float64
    idx = torch.arange(-width, width + orig, dtype=f64)[None, None] / orig        # (1, 1, K) input offsets
    t = (torch.arange(0, -new, -1, dtype=f64)[:, None, None] / new + idx) * base   # (new, 1, K) one row per phase
    t = t.clamp(-lowpass_filter_width, lowpass_filter_width)
    window = torch.cos(t * math.pi / lowpass_filter_width / 2) ** 2
    t = t * math.pi
    kernel = torch.where(t == 0, torch.ones_like(t), torch.sin(t) / t) * window * (base / orig)
    shape = waveform.shape
    x = waveform.reshape(-1, 1, shape[-1])
    x = F.pad(x, (width, width + orig))
    out = F.conv1d(x, kernel.to(device=x.device, dtype=x.dtype), stride=orig)      # (N, new, S / orig + ...)
    out = out.transpose(1, 2).reshape(x.shape[0], -1)[:, :math.ceil(new * shape[-1] / orig)]
    return out.reshape(*shape[:-1], -1)


def to_stereo(waveform: torch.Tensor) -> torch.Tensor:
    """(B, C, S) -> (B, 2, S), the audio VAE's two channels (ltx-trainer process_videos.py `_encode_audio`):
    mono duplicated; 5.1 [L, R, C, LFE, Ls, Rs] and 7.1 [.., Lb, Rb] folded down with weights summing to 1
    (0.707 for centre and surrounds, LFE dropped); any other count > 2 averaged and duplicated."""
    if waveform.dim() != 3:
        raise ValueError(f"to_stereo: expected a (B, C, samples) waveform, got {tuple(waveform.shape)}")
    c = waveform.shape[1]
    if c == 2:
        return waveform
    if c == 1:
        return waveform.repeat(1, 2, 1)
    if c in (6, 8):
        total = 2.414 if c == 6 else 3.121  # 1 + 0.707 * (number of folded channels per side)
        side = [2, 4] + ([6] if c == 8 else [])  # centre, surround (, back) of the left side
        left = waveform[:, 0] + 0.707 * sum(waveform[:, i] for i in side)
        right = waveform[:, 1] + 0.707 * sum(waveform[:, i + (i > 2)] for i in side)
        return torch.stack([left, right], dim=1) / total
    return waveform.mean(dim=1, keepdim=True).repeat(1, 2, 1)


def waveform_to_mel(waveform: torch.Tensor, sample_rate: int, config: MelConfig = LTX2_MEL) -> torch.Tensor:
    """(B, C, S) at `sample_rate`, any channel count -> the audio VAE's input (B, 2, T, n_mels) float32:
    `to_stereo`, `resample` to config.sample_rate, `log_mel_spectrogram` (ltx-core
    `AudioProcessor.waveform_to_mel` after the trainer's channel rules)."""
    x = resample(to_stereo(waveform).float(), sample_rate, config.sample_rate)
    return log_mel_spectrogram(x, config)
