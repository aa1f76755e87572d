"""The LTX-2 video VAE's configuration: `LTX2VAEConfig` and the released numbers.

Lightricks describes the network as two block lists (ltx-core `VideoEncoder(encoder_blocks=...)`,
`ConvVideoDecoder(decoder_blocks=...)`, read from a checkpoint's metadata by `model_configurator.py`):
res stages ("res_x", n layers) alternating with 2x resamples ("compress_space_res" / "_time_res" /
"_all_res" down, "compress_space" / "_time" / "_all" up, each with a channel multiplier). The same
network here is one typed record: the width of every stage, the res blocks in it and the kind of each
resample between stages. The decoder is listed in the order it runs (Lightricks lists it in the
encoder's order and reverses it).

    encoder   patchify 4x4 -> conv_in -> [res stage, downsample] x n -> res stage -> conv_out
              stage widths `encoder_widths` (the first is conv_in's: latent_channels, as Lightricks'),
              res blocks `encoder_layers`, resample kinds `encoder_downsamples`
    decoder   conv_in -> res stage -> [upsample, res stage] x n -> conv_out -> unpatchify 4x4
              stage widths `decoder_widths`, res blocks `decoder_layers`, kinds `decoder_upsamples`,
              whether each upsample adds its input as a residual `decoder_residual`

A resample kind is "space" (2x in H and W), "time" (2x in F) or "all" (2x in all three).

Where the numbers come from (diffusers `scripts/convert_ltx2_to_diffusers.py`, `get_ltx2_video_vae_config`,
in diffusers' constructor names, whose decoder lists run from the output end, except `upsample_type`,
which diffusers reads in the order the decoder runs; the Lightricks block lists are in no public file):

    LTX-2.0   block_out_channels (256, 512, 1024, 2048), layers_per_block (4, 6, 6, 2, 2), downsample_type
              (spatial, temporal, spatiotemporal, spatiotemporal); decoder_block_out_channels (256, 512,
              1024), decoder_layers_per_block (5, 5, 5, 5), upsample_type spatiotemporal x3,
              upsample_residual (True,) x3, upsample_factor (2,) x3, decoder_spatial_padding_mode reflect
    LTX-2.3   block_out_channels (256, 512, 1024, 1024), layers_per_block (4, 6, 4, 2, 2); decoder_block_out_
              channels (256, 512, 512, 1024), decoder_layers_per_block (4, 6, 4, 2, 2), upsample_type
              (spatiotemporal, spatiotemporal, temporal, spatial), upsample_residual (False,) x4,
              upsample_factor (2, 2, 1, 2), decoder_spatial_padding_mode zeros
    LTX-2.5   the script's "2.5" entry repeats 2.3's numbers ("byte-identical to 2.3's" block metadata); 2.5
              ships a diffusion (transformer) decoder as its default decoder, a different network
              (ltx-core `DiffusionVideoDecoder`, diffusers `LTX2VideoDiffusionDecoderModel`), not built here
    all       latent_channels 128, patch_size 4, encoder causal with zero spatial padding, decoder
              non-causal (`decoder_causal` False), timestep_conditioning False (the converter's
              `--timestep_conditioning` flag defaults off, and the diffusers-format vae/config.json of
              Lightricks/LTX-2 and of LTX-2.3 conversions say false)

The per-channel latent statistics are not configuration: they are weights of the checkpoint
(`per_channel_statistics.mean-of-means` / `std-of-means`), loaded with the VAE (identity until then).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from video_dit.models.causal_conv import FirstFrameKept
from video_dit.typed_config import ConfigError, parse

Resample = Literal["space", "time", "all"]
Padding = Literal["zeros", "reflect"]

# (time, height, width) stride of each resample kind
STRIDES: dict[str, tuple[int, int, int]] = {"space": (1, 2, 2), "time": (2, 1, 1), "all": (2, 2, 2)}


@dataclass(frozen=True)
class LTX2VAEConfig(FirstFrameKept):
    """The LTX-2 causal video VAE. Defaults are LTX-2.0's (`LTX2_VAE_20`). Its frame rule is the causal VAEs'
    (`FirstFrameKept`: 8k + 1 frames released, the family contract's `VAEShape`)."""

    in_channels: int = 3
    latent_channels: int = 128
    patch_size: int = 4  # pixels per side folded into channels before the encoder (and unfolded after the decoder)
    encoder_widths: tuple[int, ...] = (128, 256, 512, 1024, 2048)
    encoder_layers: tuple[int, ...] = (4, 6, 6, 2, 2)
    encoder_downsamples: tuple[Resample, ...] = ("space", "time", "all", "all")
    decoder_widths: tuple[int, ...] = (1024, 512, 256, 128)
    decoder_layers: tuple[int, ...] = (5, 5, 5, 5)
    decoder_upsamples: tuple[Resample, ...] = ("all", "all", "all")
    decoder_residual: tuple[bool, ...] = (True, True, True)
    encoder_padding: Padding = "zeros"  # spatial padding of every conv (time is padded by repeating frames)
    decoder_padding: Padding = "reflect"
    decoder_causal: bool = False  # the encoder is always causal
    # Decoder conditioned on a timestep (Lightricks' LTX-Video 0.9.x VAEs; no released LTX-2 VAE): adaLN
    # scale / shift in every res block and before conv_out, and noise mixed into the latents at decode.
    timestep_conditioning: bool = False
    decode_timestep: float = 0.05  # ltx-core ConvVideoDecoder.decode_timestep
    decode_noise_scale: float = 0.025  # ltx-core ConvVideoDecoder.decode_noise_scale

    def __post_init__(self):
        def bad(name: str, message: str):
            raise ConfigError(f"LTX2VAEConfig.{name}", message)

        for name in ("in_channels", "latent_channels", "patch_size"):
            if getattr(self, name) < 1:
                bad(name, f"{getattr(self, name)}; accepted: >= 1")
        for side in ("encoder", "decoder"):
            widths, layers = getattr(self, f"{side}_widths"), getattr(self, f"{side}_layers")
            kinds = getattr(self, f"{side}_downsamples" if side == "encoder" else f"{side}_upsamples")
            if not widths or min(widths) < 1:
                bad(f"{side}_widths", f"{widths}; accepted: one or more positive widths")
            if len(layers) != len(widths) or min(layers) < 0:
                bad(f"{side}_layers", f"{layers}: one count >= 0 per stage ({len(widths)} stages in {side}_widths)")
            if len(kinds) != len(widths) - 1:
                bad(f"{side}_{'down' if side == 'encoder' else 'up'}samples",
                    f"{kinds}: one resample between each two stages ({len(widths) - 1})")
            for kind in kinds:
                if kind not in STRIDES:
                    bad(f"{side}_{'down' if side == 'encoder' else 'up'}samples",
                        f"{kind!r}; accepted: {', '.join(STRIDES)}")
        if self.encoder_widths[0] != self.latent_channels:
            bad("encoder_widths", f"starts at {self.encoder_widths[0]}; Lightricks' conv_in widens to "
                                  f"latent_channels = {self.latent_channels}, so the first width must be that")
        for i, (c, c2, kind) in enumerate(zip(self.encoder_widths, self.encoder_widths[1:], self.encoder_downsamples)):
            p = math.prod(STRIDES[kind])  # space-to-depth: conv to c2 / p channels, skip = mean of groups of c p / c2
            if c2 % p or (c * p) % c2:
                bad("encoder_widths", f"downsample {i} ({kind}) from {c} to {c2} channels: {c2} must be a multiple "
                                      f"of {p} and divide {c * p}")
        if len(self.decoder_residual) != len(self.decoder_upsamples):
            bad("decoder_residual", f"{self.decoder_residual}: one per upsample ({len(self.decoder_upsamples)})")
        for i, (c, c2, kind, res) in enumerate(zip(self.decoder_widths, self.decoder_widths[1:],
                                                   self.decoder_upsamples, self.decoder_residual)):
            p = math.prod(STRIDES[kind])  # depth-to-space: conv to c2 p channels; skip = input repeated p c2 / c times
            if c % c2:
                bad("decoder_widths", f"upsample {i} ({kind}) from {c} to {c2} channels: {c2} must divide {c} "
                                      "(Lightricks' channel reduction factor)")
            if res and (c % p or (p * c2) % c):
                bad("decoder_residual", f"upsample {i} ({kind}, {c} -> {c2} channels) cannot add its input: "
                                        f"{c} must be a multiple of {p} and divide {p * c2}")
        if self.decode_noise_scale < 0 or self.decode_noise_scale > 1:
            bad("decode_noise_scale", f"{self.decode_noise_scale}; accepted: 0 to 1")

    # The names the house's callers read from a VAE config.
    @property
    def z_dim(self) -> int:
        return self.latent_channels

    @property
    def spatial_compression(self) -> int:
        """Pixels per latent cell along H and W: 32 for every released VAE."""
        return self.patch_size * math.prod(STRIDES[k][1] for k in self.encoder_downsamples)

    @property
    def temporal_compression(self) -> int:
        """Pixel frames per latent frame after the first: 8 for every released VAE."""
        return math.prod(STRIDES[k][0] for k in self.encoder_downsamples)

    @classmethod
    def from_dict(cls, d: dict) -> "LTX2VAEConfig":
        """From a dict of field names (lists for tuples); an unknown key or a wrong type is an error
        naming it (and the nearest field name)."""
        return parse(cls, d, "LTX2VAEConfig")


# LTX-2.0 (Lightricks/LTX-2): the numbers above.
LTX2_VAE_20 = LTX2VAEConfig()

# LTX-2.3 (Lightricks/LTX-2.3); LTX-2.5's encoder, and its conv decoder, are the same network.
LTX2_VAE_23 = LTX2VAEConfig(
    encoder_widths=(128, 256, 512, 1024, 1024), encoder_layers=(4, 6, 4, 2, 2),
    decoder_widths=(1024, 512, 512, 256, 128), decoder_layers=(2, 2, 4, 6, 4),
    decoder_upsamples=("all", "all", "time", "space"), decoder_residual=(False, False, False, False),
    decoder_padding="zeros")

# For tests: still 4x4 patches, 32x space and 8x time, 8 latent channels, widths 8 to 32, one res block per
# stage; every resample kind, a width-keeping and a width-changing one on each side, an upsample with and
# without the residual (ltx-core adds it to "all" upsamples only), both paddings (encoder zeros, decoder reflect).
LTX2_VAE_TINY = LTX2VAEConfig(
    latent_channels=8, encoder_widths=(8, 16, 16, 32, 32), encoder_layers=(1, 1, 1, 1, 1),
    encoder_downsamples=("space", "time", "all", "all"),
    decoder_widths=(32, 16, 16, 8, 8), decoder_layers=(1, 1, 1, 1, 1),
    decoder_upsamples=("space", "time", "all", "all"), decoder_residual=(False, False, True, False))

# The embedded audio-video demo's (configs/demo_av_tiny.yaml; trained by `vae_stage.train_tiny_vae`): the video
# demo's cell (8 x 8 pixels x 4 frames, 16 channels; Wan's `tiny-p2`) in LTX-2's blocks: a 2 x 2 patchify, two
# "all" resamples, one res block per stage, widths 16 to 64; upsamples without the added input (LTX-2.3's), so
# the demo stage can start it as a mean-colour codec (`vae_stage.init_colour_path`).
LTX2_VAE_DEMO = LTX2VAEConfig(
    latent_channels=16, patch_size=2, encoder_widths=(16, 32, 64), encoder_layers=(1, 1, 1),
    encoder_downsamples=("all", "all"), decoder_widths=(64, 32, 16), decoder_layers=(1, 1, 1),
    decoder_upsamples=("all", "all"), decoder_residual=(False, False))

PRESETS = {"ltx2.0": LTX2_VAE_20, "ltx2.3": LTX2_VAE_23, "ltx2.5": LTX2_VAE_23, "ltx2-tiny": LTX2_VAE_TINY,
           "ltx2-demo": LTX2_VAE_DEMO}
