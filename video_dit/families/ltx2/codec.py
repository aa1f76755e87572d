"""LTX-2's audio codec: a waveform to the latents its DiT reads and back, as the family contract's `AudioPath`
asks (`load_codec` returns one), built from the audio VAE (`audio_vae.py`), its mel front end (`mel.py`) and
the vocoder (`vocoder.py`):

    wave (B, C, S) at any rate --mel.waveform_to_mel (stereo, 16 kHz, 64-bin log-mel)--> (B, 2, T, 64)
      --LTX2AudioVAE.encode--> normalized latents (B, 8, T', 16), T' = (T - 1) // 4 + 1      [encode]
    normalized latents (B, 8, T', 16) --LTX2AudioVAE.decode--> log-mel (B, 2, 4 T' - 3, 64)
      --vocoder--> wave (B, 2, S') at `out_rate` (24 kHz LTX-2.0, 48 kHz LTX-2.3 / 2.5)      [decode]

The numbers above are the release's; every one is read from the configs. A clip of F frames at fps has
round(F / fps x rate / hop / 4) latent frames (ltx-core `AudioLatentShape.from_video_pixel_shape`, diffusers'
`audio_num_frames`): `latent_shape`.
"""

from __future__ import annotations

import torch
from torch import nn

from video_dit.families.ltx2.audio_vae import LTX2AudioVAE
from video_dit.families.ltx2.mel import MelConfig, waveform_to_mel
from video_dit.families.ltx2.vocoder import LTX2Vocoder, LTX2VocoderWithBWE


class LTX2AudioCodec(nn.Module):
    """The audio VAE and the vocoder of one LTX-2 model. rate / channels: what its encoder reads (16 kHz
    stereo released); out_rate: what its vocoder writes."""

    def __init__(self, vae: LTX2AudioVAE, vocoder: LTX2Vocoder | LTX2VocoderWithBWE):
        super().__init__()
        c = vae.config
        bins = vocoder.config.vocoder.in_channels if isinstance(vocoder, LTX2VocoderWithBWE) \
            else vocoder.config.in_channels
        if bins != c.out_ch * c.mel_bins:
            raise ValueError(f"the vocoder reads {bins} mel channels x bins; the audio VAE decodes {c.out_ch} x "
                             f"{c.mel_bins} = {c.out_ch * c.mel_bins}: not one model's audio codec")
        self.vae, self.vocoder = vae, vocoder
        self.mel = MelConfig.from_audio_vae(c)

    @property
    def rate(self) -> int:
        return self.vae.config.sample_rate

    @property
    def channels(self) -> int:
        return self.vae.config.in_channels

    @property
    def out_rate(self) -> int:
        return self.vocoder.config.output_sampling_rate

    def latent_shape(self, num_frames: int, fps: float) -> tuple[int, int, int]:
        """(z, T', M') of the latents of a clip of `num_frames` frames at `fps`: T' = round(seconds x latent
        frames per second), the references' rounding (a clip's sound spans its frames' F / fps seconds)."""
        c = self.vae.config
        if num_frames < 1 or fps <= 0:
            raise ValueError(f"latent_shape: num_frames={num_frames}, fps={fps}; accepted: num_frames >= 1, fps > 0")
        per_second = c.sample_rate / c.mel_hop_length / c.downsample
        return c.z_channels, max(1, round(num_frames / fps * per_second)), c.latent_mel_bins

    @torch.no_grad()
    def encode(self, wave: torch.Tensor, rate: int | None = None) -> torch.Tensor:
        """wave (B, C, S) float in [-1, 1] at `rate` (default: the codec's own) -> normalized latents
        (B, z, T', M') float32, what the DiT reads and a trainer caches."""
        if wave.dim() != 3:
            raise ValueError(f"LTX2AudioCodec.encode expects a waveform (B, C, S), got {tuple(wave.shape)}")
        mel = waveform_to_mel(wave.float(), self.rate if rate is None else rate, self.mel)  # (B, 2, T, bins)
        return self.vae.encode(mel.to(self.vae.dtype)).float()

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Normalized latents (B, z, T', M') -> wave (B, C, S') float32 at `out_rate`, in [-1, 1] for the
        released vocoders (tanh / clamp)."""
        mel = self.vae.decode(latents.to(self.vae.dtype))                           # (B, 2, 4 T' - 3, bins)
        dtype = next(self.vocoder.parameters()).dtype
        return self.vocoder(mel.to(dtype)).float()                                    # (B, 2, S')
