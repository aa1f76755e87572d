"""MiniMax H3's audio codec: a waveform to the latents its DiT reads and back, as the family contract's
`AudioPath` asks (`loading.load_codec` returns one). The audio VAE (`audio_vae.py`) is the whole codec: no
spectrogram, no vocoder; it is mono, the soundtrack's two channels go through it as two waveforms.

    wave (B, 2, S) at 32 kHz --H3AudioVAE.encode (each channel alone; the posterior mean)--> (B, 2, 32, T')
      T' = round(S / 800) (40 a second), --(z - latents_mean) / latents_std per latent channel-->
      normalized latents (B, 2, 32, T'): the DiT's `audio` input                                   [encode]
    normalized latents (B, 2, 32, T') --x latents_std + latents_mean--> H3AudioVAE.decode (BigVGAN)
      --> wave (B, 2, 800 T') at 32 kHz in [-1, 1]                                                  [decode]

The numbers are the release's. A clip of F frames at 24 fps has round(F / 24 x 40) latents per channel: 40 a
second is the DiT's clock (its audio rows are 1 rotary unit apart, a video frame 5/3: packing.py), a constant of
diffusers' pipeline (modular_pipeline.py `MINIMAX_H3_AUDIO_LATENTS_PER_SECOND`, `audio_latent_num_frames`) that
the released VAE makes (32 kHz / hop 800): `latent_shape`. The encode keeps the posterior mean (diffusers
encoders.py `MiniMaxH3Ref2VAReferenceEncoderStep` conditions on it; ai-toolkit's trainer caches it) and the
latents of the waveform's seconds at 40 a second, rounded: the VAE pads the waveform to whole latents (ceil), the
references count them by rounding (ai-toolkit trims a clip's rows to the rounded count). A VAE of another latent
rate (the tiny test one: hop 4 at 32 kHz) keeps its first that many latents: the release's shapes, not its timing.
"""

from __future__ import annotations

import torch
from torch import nn

from video_dit.families.minimax_h3.audio_vae import H3AudioVAE

LATENTS_PER_SECOND = 40  # the DiT's audio clock (diffusers `MINIMAX_H3_AUDIO_LATENTS_PER_SECOND`)


class H3AudioCodec(nn.Module):
    """The audio VAE of one MiniMax H3 model. rate: what it reads and writes (32 kHz released); channels: the
    soundtrack's (stereo, each a mono waveform through the VAE)."""

    def __init__(self, vae: H3AudioVAE):
        super().__init__()
        self.vae = vae

    @property
    def rate(self) -> int:
        return self.vae.config.sampling_rate

    @property
    def out_rate(self) -> int:
        return self.vae.config.sampling_rate

    @property
    def channels(self) -> int:
        return self.vae.config.channels

    def latent_shape(self, num_frames: int, fps: float) -> tuple[int, int, int]:
        """(channels, latent channels, T') of the latents of a clip of `num_frames` frames at `fps`:
        T' = round(frames / fps x 40), at least 1 (diffusers `audio_latent_num_frames`)."""
        if num_frames < 1 or fps <= 0:
            raise ValueError(f"latent_shape: num_frames={num_frames}, fps={fps}; accepted: num_frames >= 1, fps > 0")
        c = self.vae.config
        return c.channels, c.latent_channels, max(1, round(num_frames / fps * LATENTS_PER_SECOND))

    def _stats(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.vae.config
        mean = torch.tensor(c.latents_mean, dtype=torch.float32, device=like.device).view(1, 1, -1, 1)
        std = torch.tensor(c.latents_std, dtype=torch.float32, device=like.device).view(1, 1, -1, 1)
        return mean, std

    @torch.no_grad()
    def encode(self, wave: torch.Tensor, rate: int | None = None) -> torch.Tensor:
        """wave (B, channels, S) float in [-1, 1] at the codec's rate -> normalized latents (B, channels,
        latent channels, round(S / rate x 40)) float32, what the DiT reads and a trainer caches. A waveform at
        another rate or channel count is refused (the data path reads each track at `rate` / `channels`)."""
        c = self.vae.config
        if wave.dim() != 3 or wave.shape[1] != c.channels:
            raise ValueError(f"H3AudioCodec.encode expects a waveform (B, {c.channels}, S), got {tuple(wave.shape)}")
        if rate is not None and rate != self.rate:
            raise ValueError(f"H3AudioCodec.encode: a waveform at {rate} Hz; MiniMax H3's audio VAE reads {self.rate} "
                             "Hz (resample it first)")
        T = max(1, round(wave.shape[-1] / self.rate * LATENTS_PER_SECOND))
        z = self.vae.encode(wave.to(self.vae.dtype)).mode()[..., :T]  # (B, C, Z, T) float32
        mean, std = self._stats(z)
        return (z - mean) / std

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Normalized latents (B, channels, latent channels, T') -> wave (B, channels, hop T') float32 in [-1, 1] at
        `out_rate` (diffusers decoders.py `MiniMaxH3AudioDecodeStep`)."""
        mean, std = self._stats(latents)
        return self.vae.decode(latents.float() * std + mean)
