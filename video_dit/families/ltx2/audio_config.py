"""LTX-2's audio networks' configurations: the audio VAE (`AudioVAEConfig`), the vocoder (`VocoderConfig`)
and the vocoder with bandwidth extension of LTX-2.3 (`VocoderBWEConfig`); the released ones and tiny ones.

Field names are Lightricks' (ltx-core `AudioEncoderConfigurator` / `AudioDecoderConfigurator`, which read
the checkpoint metadata's `audio_vae.model.params.ddconfig`, and `VocoderConfigurator`, which reads
`config.vocoder`), except `final_activation`, which says in one field what Lightricks says with two
(`apply_final_activation`, `use_tanh_at_final`) and diffusers with one (`final_act_fn`).
`from_dict` builds one from a dict of these names (`typed_config.parse`: an unknown key is an error naming
the nearest valid one); diffusers' config.json names are read in `audio_convert.py`.

Released numbers, from diffusers' scripts/convert_ltx2_to_diffusers.py (`get_ltx2_audio_vae_config`,
`get_ltx2_vocoder_config`, versions "2.0" and "2.3"; its audio VAE is the same for 2.0, 2.3 and 2.5) and
ltx-core's configurator defaults where diffusers has no such field (`n_fft`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal

from video_dit.typed_config import parse

CausalityAxis = Literal["height", "width", "width-compatibility", "none"]


@dataclass(frozen=True)
class AudioVAEConfig:
    """The audio VAE: a 2D conv autoencoder over (time, mel bin) of a stereo log-mel spectrogram.
    Widths `ch * ch_mult[i]`; each level but the last halves time and mel bins; `z_channels` latent
    channels (the encoder emits 2 * z_channels with `double_z`: mean, log-variance)."""

    ch: int = 128
    out_ch: int = 2                     # spectrogram channels decoded (stereo)
    in_channels: int = 2                # spectrogram channels encoded (stereo)
    ch_mult: tuple[int, ...] = (1, 2, 4)
    num_res_blocks: int = 2             # encoder blocks per level; the decoder has one more
    attn_resolutions: tuple[int, ...] = ()  # "resolutions" (resolution / 2^level) with attention after each block
    resolution: int = 256               # only the attention placement reads it
    z_channels: int = 8
    double_z: bool = True
    norm_type: Literal["pixel", "group"] = "pixel"
    causality_axis: CausalityAxis = "height"  # height = the time axis of a (B, C, time, mel) spectrogram
    mid_block_add_attention: bool = False
    # the spectrogram the encoder reads (`mel.MelConfig` of the same numbers)
    sample_rate: int = 16000
    mel_hop_length: int = 160
    n_fft: int = 1024                   # ltx-core: preprocessing.stft.filter_length, default 1024
    mel_bins: int = 64
    is_causal: bool = True              # the stft's `causal` flag; read by the patchifier's timings only

    def __post_init__(self):
        object.__setattr__(self, "ch_mult", tuple(int(m) for m in self.ch_mult))
        object.__setattr__(self, "attn_resolutions", tuple(int(r) for r in self.attn_resolutions))
        if not self.ch_mult or min(self.ch_mult) < 1:
            raise ValueError(f"AudioVAEConfig.ch_mult={self.ch_mult}: one positive multiplier per level")
        if self.norm_type == "group" and self.causality_axis != "none":
            raise ValueError("AudioVAEConfig: norm_type='group' needs causality_axis='none' (both references "
                             "refuse a causal res block with GroupNorm)")
        if self.norm_type == "group" and any(self.ch * m % 32 for m in self.ch_mult):
            raise ValueError(f"AudioVAEConfig: GroupNorm(32) needs every width ch * ch_mult divisible by 32, "
                             f"got ch={self.ch}, ch_mult={self.ch_mult}")
        if self.mel_bins % self.downsample:
            raise ValueError(f"AudioVAEConfig.mel_bins={self.mel_bins} must be divisible by 2^(levels - 1) = "
                             f"{self.downsample}")
        for name in ("ch", "out_ch", "in_channels", "num_res_blocks", "z_channels", "sample_rate",
                     "mel_hop_length", "n_fft", "mel_bins", "resolution"):
            if getattr(self, name) < 1:
                raise ValueError(f"AudioVAEConfig.{name}={getattr(self, name)}; accepted: >= 1")

    @property
    def downsample(self) -> int:
        """Time and mel-bin compression: 2 per level but the last (4 released; Lightricks and diffusers
        hard-code LATENT_DOWNSAMPLE_FACTOR = 4 for time, we derive it, the same for the release)."""
        return 2 ** (len(self.ch_mult) - 1)

    @property
    def latent_mel_bins(self) -> int:
        return self.mel_bins // self.downsample

    @property
    def token_dim(self) -> int:
        """Width of one audio token (a latent frame, all channels and bins): z_channels * latent_mel_bins.
        The per-channel statistics normalise this vector (128 released)."""
        return self.z_channels * self.latent_mel_bins

    def latent_frames(self, mel_frames: int) -> int:
        """Latent frames the encoder makes of `mel_frames` spectrogram frames (each stride-2 conv, time
        padded by 2 in front when causal: n -> (n - 1) // 2 + 1); 4k + 1 frames -> k + 1 at the release."""
        pad = 2 if self.causality_axis == "height" else 1  # the downsample's padding of the time axis
        n = mel_frames
        for _ in range(len(self.ch_mult) - 1):
            n = (n + pad - 3) // 2 + 1
        return n

    def mel_frames(self, latent_frames: int) -> int:
        """Spectrogram frames the decoder makes of `latent_frames`: T * f - (f - 1) when causal
        (f = `downsample`), T * f otherwise (Lightricks `AudioDecoder._denormalize_latents`)."""
        f = self.downsample
        return max(latent_frames * f - (f - 1), 1) if self.causality_axis != "none" else latent_frames * f

    @classmethod
    def from_dict(cls, d: dict, path: str = "AudioVAEConfig") -> "AudioVAEConfig":
        return parse(cls, d, path)


FinalActivation = Literal["tanh", "clamp", "none"]


@dataclass(frozen=True)
class VocoderConfig:
    """HiFi-GAN (resblock "1", LeakyReLU 0.1) or BigVGAN v2 (resblock "AMP1": anti-aliased Snake /
    SnakeBeta) generator: (B, C, T, mel) -> (B, out_channels, T * prod(upsample_rates)) at
    `output_sampling_rate`. `in_channels` = spectrogram channels * mel bins (Lightricks hard-codes 128
    in and 2 out: every release is stereo, 64 bins)."""

    in_channels: int = 128
    out_channels: int = 2
    upsample_initial_channel: int = 1024
    upsample_rates: tuple[int, ...] = (6, 5, 2, 2, 2)
    upsample_kernel_sizes: tuple[int, ...] = (16, 15, 8, 4, 4)
    resblock_kernel_sizes: tuple[int, ...] = (3, 7, 11)
    resblock_dilation_sizes: tuple[tuple[int, int, int], ...] = ((1, 3, 5), (1, 3, 5), (1, 3, 5))
    resblock: Literal["1", "AMP1"] = "1"
    activation: Literal["snake", "snakebeta"] = "snake"  # AMP1's; resblock "1" is LeakyReLU(0.1)
    final_activation: FinalActivation = "tanh"
    use_bias_at_final: bool = True
    output_sampling_rate: int = 24000

    def __post_init__(self):
        for name in ("upsample_rates", "upsample_kernel_sizes", "resblock_kernel_sizes"):
            object.__setattr__(self, name, tuple(int(v) for v in getattr(self, name)))
        object.__setattr__(self, "resblock_dilation_sizes",
                           tuple(tuple(int(v) for v in d) for d in self.resblock_dilation_sizes))
        if len(self.upsample_rates) != len(self.upsample_kernel_sizes):
            raise ValueError(f"VocoderConfig: upsample_rates {self.upsample_rates} and upsample_kernel_sizes "
                             f"{self.upsample_kernel_sizes} must have the same length")
        if len(self.resblock_kernel_sizes) != len(self.resblock_dilation_sizes):
            raise ValueError(f"VocoderConfig: resblock_kernel_sizes {self.resblock_kernel_sizes} and "
                             f"resblock_dilation_sizes {self.resblock_dilation_sizes} must have the same length")
        if any(len(d) != 3 for d in self.resblock_dilation_sizes):
            raise ValueError(f"VocoderConfig.resblock_dilation_sizes={self.resblock_dilation_sizes}: three "
                             "dilations per res block (Lightricks' ResBlock1 / AMPBlock1)")
        if any(k % 2 == 0 for k in self.resblock_kernel_sizes):
            raise ValueError(f"VocoderConfig.resblock_kernel_sizes={self.resblock_kernel_sizes}: odd sizes only "
                             "('same' padding)")
        if self.upsample_initial_channel % 2 ** len(self.upsample_rates):
            raise ValueError(f"VocoderConfig.upsample_initial_channel={self.upsample_initial_channel} must be "
                             f"divisible by 2^{len(self.upsample_rates)} (each upsample halves the width)")
        if any((k - r) % 2 for k, r in zip(self.upsample_kernel_sizes, self.upsample_rates)):
            raise ValueError("VocoderConfig: each upsample_kernel_sizes[i] - upsample_rates[i] must be even "
                             f"(exact rate-times output), got {self.upsample_kernel_sizes} / {self.upsample_rates}")

    @property
    def hop(self) -> int:
        """Waveform samples per spectrogram frame: prod(upsample_rates)."""
        return math.prod(self.upsample_rates)

    @classmethod
    def from_dict(cls, d: dict, path: str = "VocoderConfig") -> "VocoderConfig":
        return parse(cls, d, path)


@dataclass(frozen=True)
class VocoderBWEConfig:
    """LTX-2.3's vocoder: `vocoder` makes a waveform at `input_sampling_rate`; its causal log-mel
    (STFT `n_fft` / `hop_length`, `num_mels` bins) goes through the `bwe` generator, whose output is
    a residual added to the waveform resampled to `output_sampling_rate` (ltx-core `VocoderWithBWE`)."""

    vocoder: VocoderConfig
    bwe: VocoderConfig
    n_fft: int = 512
    hop_length: int = 80
    num_mels: int = 64
    input_sampling_rate: int = 16000
    output_sampling_rate: int = 48000

    def __post_init__(self):
        if self.output_sampling_rate % self.input_sampling_rate:
            raise ValueError(f"VocoderBWEConfig: output_sampling_rate={self.output_sampling_rate} must be a "
                             f"multiple of input_sampling_rate={self.input_sampling_rate}")
        if self.vocoder.output_sampling_rate != self.input_sampling_rate:
            raise ValueError(f"VocoderBWEConfig: vocoder.output_sampling_rate={self.vocoder.output_sampling_rate}"
                             f" must equal input_sampling_rate={self.input_sampling_rate}")
        if self.bwe.output_sampling_rate != self.output_sampling_rate:
            raise ValueError(f"VocoderBWEConfig: bwe.output_sampling_rate={self.bwe.output_sampling_rate} must "
                             f"equal output_sampling_rate={self.output_sampling_rate}")
        if self.bwe.in_channels != self.vocoder.out_channels * self.num_mels:
            raise ValueError(f"VocoderBWEConfig: bwe.in_channels={self.bwe.in_channels} must be vocoder."
                             f"out_channels * num_mels = {self.vocoder.out_channels * self.num_mels}")
        ratio = self.output_sampling_rate // self.input_sampling_rate
        if self.bwe.hop != self.hop_length * ratio:
            raise ValueError(f"VocoderBWEConfig: the bwe generator's prod(upsample_rates)={self.bwe.hop} must be "
                             f"hop_length * output/input rate = {self.hop_length * ratio}")
        if self.n_fft < self.hop_length:
            raise ValueError(f"VocoderBWEConfig: n_fft={self.n_fft} < hop_length={self.hop_length}")

    @property
    def output_channels(self) -> int:
        return self.vocoder.out_channels

    @classmethod
    def from_dict(cls, d: dict, path: str = "VocoderBWEConfig") -> "VocoderBWEConfig":
        return parse(cls, d, path)


# ---------------------------------------------------------------- released and tiny configs

# LTX-2 (2.0), 2.3 and 2.5 share the audio VAE (diffusers get_ltx2_audio_vae_config: attn_resolutions None,
# mid_block_add_attention False; ltx-core's configurator defaults of {8, 16, 32} / True are not the release's).
LTX2_AUDIO_VAE = AudioVAEConfig()
# LTX-2 (2.0): HiFi-GAN, 100 mel frames/s * 240 = 24 kHz stereo.
LTX2_VOCODER = VocoderConfig()
# LTX-2.3 (and 2.5): BigVGAN v2 at 16 kHz (100 frames/s * 160), then the BWE generator on its 200 frames/s
# causal mel (hop 80) * 240 = 48 kHz. The first stage ends in clamp(-1, 1): ltx-core applies its final
# activation (apply_final_activation=True) with use_tanh_at_final false, which diffusers reads as no final
# activation at all (final_act_fn None); we follow Lightricks.
LTX23_VOCODER = VocoderBWEConfig(
    vocoder=VocoderConfig(upsample_initial_channel=1536, upsample_rates=(5, 2, 2, 2, 2, 2),
                          upsample_kernel_sizes=(11, 4, 4, 4, 4, 4), resblock="AMP1", activation="snakebeta",
                          final_activation="clamp", use_bias_at_final=False, output_sampling_rate=16000),
    bwe=VocoderConfig(upsample_initial_channel=512, upsample_rates=(6, 5, 2, 2, 2),
                      upsample_kernel_sizes=(12, 11, 4, 4, 4), resblock="AMP1", activation="snakebeta",
                      final_activation="none", use_bias_at_final=False, output_sampling_rate=48000))

# Tiny configs for tests: three levels as released (the references hard-code 4x time), 16 mel bins -> 4
# latent bins, z = 2: 8-wide tokens = ch, the width the references size their statistics by.
# Rates scaled down with them: 1024 Hz audio, hop 16 (64 mel frames/s), vocoders of hop 8 (512 Hz) and a BWE
# stage to 3x that.
TINY_AUDIO_VAE = AudioVAEConfig(ch=8, ch_mult=(1, 2, 4), num_res_blocks=1, z_channels=2, mel_bins=16,
                                sample_rate=1024, n_fft=64, mel_hop_length=16, resolution=16)
TINY_VOCODER = VocoderConfig(in_channels=32, upsample_initial_channel=16, upsample_rates=(4, 2),
                             upsample_kernel_sizes=(8, 4), resblock_kernel_sizes=(3, 5),
                             resblock_dilation_sizes=((1, 3, 5), (1, 3, 5)), output_sampling_rate=512)
TINY_VOCODER_BWE = VocoderBWEConfig(
    vocoder=replace(TINY_VOCODER, resblock="AMP1", activation="snakebeta", final_activation="clamp",
                    use_bias_at_final=False),
    bwe=replace(TINY_VOCODER, in_channels=16, resblock="AMP1", activation="snakebeta", final_activation="none",
                use_bias_at_final=False, upsample_rates=(6, 2), upsample_kernel_sizes=(12, 4),
                output_sampling_rate=1536),
    n_fft=16, hop_length=4, num_mels=8, input_sampling_rate=512, output_sampling_rate=1536)

AUDIO_VAE_CONFIGS = {"ltx2": LTX2_AUDIO_VAE, "tiny": TINY_AUDIO_VAE}
VOCODER_CONFIGS: dict[str, VocoderConfig | VocoderBWEConfig] = {
    "ltx2": LTX2_VOCODER, "ltx2.3": LTX23_VOCODER, "tiny": TINY_VOCODER, "tiny-bwe": TINY_VOCODER_BWE}
