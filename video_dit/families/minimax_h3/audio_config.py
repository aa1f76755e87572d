"""The MiniMax H3 audio VAE's configuration (`H3AudioVAEConfig`): the released one and a tiny one, and the audio
latent count of a video.

Field names are diffusers' `AutoencoderKLMiniMaxH3Audio` constructor names. MiniMax's own are in two files,
`audio_vae/metadata.json` (the `DacAudioVAE` kwargs: encoder_dim, encoder_rates, latent_dim, decoder_dim,
decoder_rates, sample_rate, vae_latent_channels, attn_proj, decoder_type) and `audio_vae/config.json` (the latent
statistics); MiniMax's dac_audio_vae.py hard-codes the rest (8 attention heads; the BigVGAN table of 32 kHz:
upsample kernels 9, 9, 4, ..., AMP kernels 3, 7, 11 with dilations 1, 3, 5), read by
`audio_vae.h3_audio_config_from_original`.

The waveform is mono at 32 kHz; the VAE hops 800 samples per latent (prod(encoder_rates)), 40 latents a second.
MiniMax H3's soundtrack is stereo, its two channels encoded as two mono waveforms and laid channel-major in the
DiT's audio rows (diffusers modular_pipeline.py `MINIMAX_H3_AUDIO_CHANNELS`, encoders.py / decoders.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from video_dit.families.minimax_h3.vae_config import FPS
from video_dit.typed_config import ConfigError, parse

# Per-channel latent statistics of the release (MiniMaxAI/MiniMax-H3 audio_vae/config.json, the same values as
# FL2VA/audio_vae/config.json)
RELEASED_AUDIO_LATENTS_MEAN = (
    -0.020211687488382354, 0.3876466479950502, -0.04398279799186767, -0.28591514936373, 0.08179686214561671,
    -0.35782641352446604, 0.040623809960919084, -0.01552534501956604, -0.223362481667332, 0.1821006842509091,
    0.2941778783780663, -0.07901167601970885, -0.056815072777201, -0.3699028221860095, -0.31616315591624855,
    0.5905951377425391, -0.052139568068853864, 0.013673160263486295, -0.03691647864630577, 0.09732660653298163,
    -0.3394662328788498, -0.30685677538541667, -0.24504598907458763, -0.034698524462007344, 0.02868032184767538,
    -0.21217779266454084, -0.1678263169941987, 0.3221287889040614, -0.1223055851554907, 0.4356604928128464,
    -0.0502599202236253, 0.3979258376211797)
RELEASED_AUDIO_LATENTS_STD = (
    1.6895524230479284, 2.76263727217653, 1.7945344281264435, 1.6801681847309828, 1.6390226546605453,
    2.7788298348882177, 1.7659090095747236, 1.6199757612137327, 2.6336525640336896, 1.8539356672817833,
    2.5056497896915633, 1.811019237886178, 1.9579657790720237, 1.6685498243529284, 1.4922469314453364,
    3.298670198067373, 1.9491804496832168, 1.8720003270431442, 1.8334080103291832, 1.6488070416529093,
    1.6176957696319716, 1.9131449234774398, 1.5695245398428617, 1.6943659940415912, 1.8318420762504692,
    1.5540637421583379, 1.9344930328968526, 1.599198216109855, 1.718045989838149, 1.6307219190837705,
    1.8661226051202384, 1.5613768203168363)


@dataclass(frozen=True)
class H3AudioVAEConfig:
    """A DAC-lineage encoder (Snake activations, strided weight-normed convs, widths doubling from `encoder_dim`
    to `latent_dim`), a causal-attention projection to `latent_channels` with mean / log-std heads, and a BigVGAN
    decoder (anti-aliased SnakeBeta, transposed-conv upsamplers from `decoder_dim`, AMP residual blocks).
    Defaults are the release's."""

    encoder_dim: int = 64
    encoder_rates: tuple[int, ...] = (2, 4, 4, 5, 5)
    latent_dim: int = 2048
    latent_channels: int = 32
    num_attention_heads: int = 8
    decoder_dim: int = 1024
    decoder_rates: tuple[int, ...] = (5, 5, 2, 2, 2, 2, 2)
    decoder_kernel_sizes: tuple[int, ...] = (9, 9, 4, 4, 4, 4, 4)
    resblock_kernel_sizes: tuple[int, ...] = (3, 7, 11)
    resblock_dilation_sizes: tuple[tuple[int, ...], ...] = ((1, 3, 5), (1, 3, 5), (1, 3, 5))
    sampling_rate: int = 32000
    channels: int = 2  # the soundtrack's channels in the DiT's rows (stereo); the VAE itself is mono
    latents_mean: tuple[float, ...] = RELEASED_AUDIO_LATENTS_MEAN
    latents_std: tuple[float, ...] = RELEASED_AUDIO_LATENTS_STD

    def __post_init__(self):
        def bad(name: str, message: str):
            raise ConfigError(f"H3AudioVAEConfig.{name}", message)

        for name in ("encoder_rates", "decoder_rates", "decoder_kernel_sizes", "resblock_kernel_sizes",
                     "latents_mean", "latents_std"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        object.__setattr__(self, "resblock_dilation_sizes", tuple(tuple(d) for d in self.resblock_dilation_sizes))
        for name in ("encoder_dim", "latent_dim", "latent_channels", "num_attention_heads", "decoder_dim",
                     "sampling_rate", "channels"):
            if getattr(self, name) < 1:
                bad(name, f"{getattr(self, name)}; accepted: >= 1")
        if not self.encoder_rates or min(self.encoder_rates) < 1:
            bad("encoder_rates", f"{self.encoder_rates}: one or more strides >= 1")
        if math.prod(self.decoder_rates) != self.hop_length:
            bad("decoder_rates", f"{self.decoder_rates} upsample by {math.prod(self.decoder_rates)}; the encoder hops "
                f"{self.hop_length} samples (prod(encoder_rates))")
        if len(self.decoder_kernel_sizes) != len(self.decoder_rates):
            bad("decoder_kernel_sizes",
                f"{self.decoder_kernel_sizes}: one per decoder rate ({len(self.decoder_rates)})")
        if self.decoder_dim % 2 ** len(self.decoder_rates):
            bad("decoder_dim", f"{self.decoder_dim} is halved {len(self.decoder_rates)} times; must be divisible by "
                f"{2 ** len(self.decoder_rates)}")
        if len(self.resblock_dilation_sizes) != len(self.resblock_kernel_sizes):
            bad("resblock_dilation_sizes", f"one dilation list per AMP kernel size ({len(self.resblock_kernel_sizes)})")
        # MiniMax's CausalAttention pools heads away only when it narrows (in_dim > out_dim), the release's case
        if self.latent_dim % self.num_attention_heads or self.latent_dim <= self.latent_channels \
                or self.latent_dim % self.latent_channels:
            bad("latent_dim", f"{self.latent_dim} must be a multiple of num_attention_heads={self.num_attention_heads} "
                f"and of latent_channels={self.latent_channels}, and larger than latent_channels")
        for name in ("latents_mean", "latents_std"):
            if len(getattr(self, name)) != self.latent_channels:
                bad(name, f"{len(getattr(self, name))} values for {self.latent_channels} latent channels")
        if min(self.latents_std) <= 0:
            bad("latents_std", "every value must be > 0")

    @property
    def hop_length(self) -> int:
        """Waveform samples per latent: 800 released."""
        return math.prod(self.encoder_rates)

    @property
    def latent_rate(self) -> float:
        """Latents per second: 40 released."""
        return self.sampling_rate / self.hop_length

    def latent_frames(self, video_frames: int, fps: float = FPS) -> int:
        """Audio latents beside a video of `video_frames` frames at `fps`: round(frames / fps x 40) (diffusers
        `audio_latent_num_frames`; 243 frames -> 405)."""
        return int(round(video_frames / fps * self.latent_rate))

    @classmethod
    def from_dict(cls, d: dict) -> "H3AudioVAEConfig":
        """From a dict of field names; an unknown key or a wrong type is an error naming it."""
        return parse(cls, d, "H3AudioVAEConfig")


H3_AUDIO_VAE = H3AudioVAEConfig()
# For tests: hop 4 (rates 2, 2), an 8-channel latent from a 32-wide trunk whose 2 heads of 16 are pooled to 8 (the
# release's pooling branch), a 16-wide BigVGAN with two AMP kernel sizes (diffusers' tiny test config).
H3_AUDIO_VAE_TINY = H3AudioVAEConfig(
    encoder_dim=4, encoder_rates=(2, 2), latent_dim=32, latent_channels=8, num_attention_heads=2, decoder_dim=16,
    decoder_rates=(2, 2), decoder_kernel_sizes=(4, 4), resblock_kernel_sizes=(3, 7),
    resblock_dilation_sizes=((1, 3), (1, 3)), latents_mean=(0.0,) * 8, latents_std=(1.0,) * 8)

AUDIO_PRESETS = {"minimax-h3-audio": H3_AUDIO_VAE, "minimax-h3-audio-tiny": H3_AUDIO_VAE_TINY}
