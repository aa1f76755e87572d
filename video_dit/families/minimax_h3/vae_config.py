"""The MiniMax H3 video VAE's configuration (`H3VAEConfig`), its tiling (`H3Tiling`) and its frame-count rule.

Field names are diffusers' `AutoencoderKLMiniMaxH3` constructor names; MiniMax's own config is two files,
`video_vae/source/config.json` (`AutoencoderKLLegacy`: `ch` x `ch_mult`, `space_down`, `time_down`, `z_channels`,
`vit_decoder_kwargs`, ...) and `video_vae/config.json` (`vae_clip_length`, `vae_token_drop`, the tiling and the
latent statistics), read by `vae_convert.h3_vae_config_from_original`.

The temporal geometry (MiniMax klvae.py `AutoencoderKL.setup_forward`; diffusers `AutoencoderKLMiniMaxH3.__init__`):
the encoder takes `clip_length` (17) pixel frames at a time and makes `tokens_chunk_size` = ceil(17 / 4) = 5 latent
frames of each; the last `token_drop` (3) latent frames of a video are dropped. So a video of

    F = clip_length n + frame_overlap  = 17 n + 5 pixel frames   (n >= 1; or F = 1, an image)
    F' = tokens_chunk_size n + token_overlap = 5 n + 2 latent frames

with `token_overlap` = (-token_drop) mod 5 = 2 latent frames shared by neighbouring decode chunks and
`frame_overlap` = 2 x 4 - `frame_pre_padding` = 5 pixel frames cross-faded between them (`frame_pre_padding` =
(-17) mod 4 = 3: a decoded chunk of 5 latent frames is 20 pixel frames, of which the first 3 are the encoder's
implicit lead-in and are dropped). MiniMax's `VAEProcessor.get_suitable_video_length` trims a clip down to this
form, diffusers' `align_num_frames` rounds a request up to it; `H3VAEConfig.snap_frames` does either. At 24 fps
(MiniMax H3's only rate) 10 s is 240 frames: 226 (9.4 s) or 243 (10.1 s) are the valid counts around it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from video_dit.typed_config import ConfigError, parse

FPS = 24  # MiniMax H3 generates and conditions at 24 fps only (diffusers modular_pipeline.py MINIMAX_H3_FPS)
# The pixel convention of the VAE: ImageNet-normalised RGB over [0, 1] (MiniMax normalize.py "imagenet", the
# source config's `pixel_norm_type`; diffusers `MiniMaxH3ModularPipeline.pixel_mean` / `pixel_std`)
PIXEL_MEAN = (0.485, 0.456, 0.406)
PIXEL_STD = (0.229, 0.224, 0.225)

# Per-channel latent statistics of the release (MiniMaxAI/MiniMax-H3 vae/config.json; the same float32 values as
# FL2VA/video_vae/config.json, which prints some with more digits)
RELEASED_LATENTS_MEAN = (
    0.858090341091156, -0.9606591463088989, 1.0661640167236328, -0.5090325474739075, -0.2727581858634949,
    -1.3675414323806763, -0.2553254961967468, -0.26907554268836975, -0.5376840829849243, -0.0464097298681736,
    0.6657370328903198, 0.19690127670764923, -0.5460608005523682, -0.4035342037677765, -0.23683024942874908,
    0.25928452610969543, -0.30133944749832153, 0.211341992020607, -1.1206848621368408, 0.3581933379173279,
    -0.04225143790245056, 0.2604829967021942, 0.22864092886447906, 0.7056031823158264)
RELEASED_LATENTS_STD = (
    1.2223774194717407, 1.2767263650894165, 1.6831774711608887, 1.7549455165863037, 1.5636216402053833,
    2.194143533706665, 0.9653137922286987, 1.0569885969161987, 0.841948926448822, 0.7729952931404114,
    1.8955937623977661, 0.946841835975647, 0.7996809482574463, 0.44988900423049927, 0.7197399735450745,
    0.6936293244361877, 2.961095094680786, 2.7694199085235596, 3.0496184825897217, 2.1088054180145264,
    3.276226282119751, 3.1627357006073, 2.2816812992095947, 2.6127843856811523)

Padding = Literal["reflect", "replicate", "zeros"]


@dataclass(frozen=True)
class H3VAEConfig:
    """A causal 3D-CNN encoder (per-frame GroupNorm, `spatial_padding_mode` in space, zeros before the chunk in
    time) and a non-causal ViT decoder whose tokens are latent cells. Defaults are the release's."""

    in_channels: int = 3
    out_channels: int = 3
    latent_channels: int = 24
    block_out_channels: tuple[int, ...] = (128, 256, 256, 512, 512, 1024)
    layers_per_block: int = 2
    spatial_downsample_factors: tuple[int, ...] = (2, 2, 2, 2, 1, 1)
    temporal_downsample_factors: tuple[int, ...] = (1, 2, 2, 1, 1, 1)
    norm_num_groups: int = 32  # MiniMax hard-codes 32 (norm.py get_group_norm_3d); a field for tiny configs
    norm_eps: float = 1e-6
    spatial_padding_mode: Padding = "reflect"
    decoder_num_layers: int = 36
    decoder_num_attention_heads: int = 32
    decoder_attention_head_dim: int = 64
    decoder_num_register_tokens: int = 4
    decoder_ffn_mult: int = 4
    decoder_rope_theta: float = 100.0
    decoder_rope_dim_ratio: float = 0.75  # the first 0.75 x head_dim channels of every head are rotated
    decoder_norm_eps: float = 1e-5
    clip_length: int = 17
    token_drop: int = 3
    latents_mean: tuple[float, ...] = RELEASED_LATENTS_MEAN
    latents_std: tuple[float, ...] = RELEASED_LATENTS_STD

    def __post_init__(self):
        def bad(name: str, message: str):
            raise ConfigError(f"H3VAEConfig.{name}", message)

        for name in ("block_out_channels", "spatial_downsample_factors", "temporal_downsample_factors",
                     "latents_mean", "latents_std"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        for name in ("in_channels", "out_channels", "latent_channels", "layers_per_block", "norm_num_groups",
                     "decoder_num_layers", "decoder_num_attention_heads", "decoder_attention_head_dim",
                     "decoder_ffn_mult", "clip_length"):
            if getattr(self, name) < 1:
                bad(name, f"{getattr(self, name)}; accepted: >= 1")
        levels = len(self.block_out_channels)
        for name in ("spatial_downsample_factors", "temporal_downsample_factors"):
            factors = getattr(self, name)
            if len(factors) != levels or any(f not in (1, 2) for f in factors):
                bad(name, f"{factors}: one factor, 1 or 2, per level ({levels} levels in block_out_channels)")
        for i, (s, t) in enumerate(zip(self.spatial_downsample_factors, self.temporal_downsample_factors)):
            if t == 2 and s == 1:  # MiniMax's Downsample3D pads space only for a spatial stride of 2
                bad("temporal_downsample_factors", f"level {i} halves time but not space; a downsample conv "
                    "without spatial stride would shrink the frame by 2 pixels (no release does this)")
        for c in self.block_out_channels:
            if c % self.norm_num_groups:
                bad("norm_num_groups", f"{self.norm_num_groups} does not divide the width {c}")
        rope = self.rope_dim
        if rope < 6 or rope % 6 or rope > self.decoder_attention_head_dim:
            bad("decoder_rope_dim_ratio", f"{self.decoder_rope_dim_ratio} x head dim {self.decoder_attention_head_dim}"
                f" = {rope} rotated channels; must be a positive multiple of 6 (3 axes, cos and sin halves)")
        if self.decoder_num_register_tokens < 0:
            bad("decoder_num_register_tokens", f"{self.decoder_num_register_tokens}; accepted: >= 0")
        if not 0 <= self.token_drop < self.tokens_chunk_size:
            bad("token_drop", f"{self.token_drop}; accepted: 0 .. {self.tokens_chunk_size - 1} "
                f"(tokens per chunk: ceil({self.clip_length} / {self.temporal_compression}))")
        if self.token_drop and self.token_overlap * self.temporal_compression <= self.frame_pre_padding:
            bad("token_drop", f"{self.token_drop} leaves {self.token_overlap} shared latent frames, fewer pixel "
                f"frames than the {self.frame_pre_padding} a chunk's decode drops: no frames to cross-fade")
        for name in ("latents_mean", "latents_std"):
            if len(getattr(self, name)) != self.latent_channels:
                bad(name, f"{len(getattr(self, name))} values for {self.latent_channels} latent channels")
        if min(self.latents_std) <= 0:
            bad("latents_std", "every value must be > 0")

    # -------------------------------------------------------- the shape shared code reads (contract.VAEShape)

    @property
    def z_dim(self) -> int:
        return self.latent_channels

    @property
    def spatial_compression(self) -> int:
        """Pixels per latent cell along H and W: 16 released."""
        return math.prod(self.spatial_downsample_factors)

    @property
    def temporal_compression(self) -> int:
        """Pixel frames per latent frame inside a chunk: 4 released. The clip rule is not t k + 1 but
        `valid_frames` (17 n + 5 -> 5 n + 2)."""
        return math.prod(self.temporal_downsample_factors)

    # -------------------------------------------------------- temporal chunk geometry (klvae.py setup_forward)

    @property
    def tokens_chunk_size(self) -> int:
        """Latent frames of one encoded `clip_length` chunk: ceil(17 / 4) = 5."""
        return -(-self.clip_length // self.temporal_compression)

    @property
    def frame_pre_padding(self) -> int:
        """Pixel frames a decoded chunk starts with that no input frame stands for: (-17) mod 4 = 3."""
        return -self.clip_length % self.temporal_compression

    @property
    def token_overlap(self) -> int:
        """Latent frames shared by neighbouring decode chunks: (-token_drop) mod 5 = 2."""
        return -self.token_drop % self.tokens_chunk_size

    @property
    def frame_overlap(self) -> int:
        """Pixel frames cross-faded between neighbouring decoded chunks, and the tail of a valid clip: 5."""
        return max(self.token_overlap * self.temporal_compression - self.frame_pre_padding, 0)

    @property
    def rope_dim(self) -> int:
        return int(self.decoder_attention_head_dim * self.decoder_rope_dim_ratio)

    # -------------------------------------------------------- the frame-count rule

    @property
    def min_video_frames(self) -> int:
        """The shortest video (n = 1): 22 released."""
        return self.clip_length + self.frame_overlap

    def valid_frames(self, frames: int) -> bool:
        """Whether a clip of `frames` pixel frames encodes as it is: 1 (an image) or clip_length n +
        frame_overlap, n >= 1 (17 n + 5)."""
        return frames == 1 or (frames >= self.min_video_frames
                               and (frames - self.frame_overlap) % self.clip_length == 0)

    def snap_frames(self, frames: int, up: bool = False) -> int:
        """The nearest valid video length <= `frames` (MiniMax's `get_suitable_video_length`: a clip is trimmed)
        or, with `up`, >= `frames` (diffusers' `align_num_frames`: a request is rounded up). A clip shorter than
        `min_video_frames` has no length to trim to: an error naming it."""
        if frames < 1:
            raise ValueError(f"snap_frames: {frames} frames; accepted: >= 1")
        n = (frames - self.frame_overlap) / self.clip_length
        n = max(1, math.ceil(n)) if up else math.floor(n)
        if n < 1:
            raise ValueError(f"snap_frames: {frames} frames is shorter than the shortest MiniMax H3 video, "
                             f"{self.min_video_frames} frames ({self.clip_length} n + {self.frame_overlap}, n >= 1)")
        return self.clip_length * n + self.frame_overlap

    def latent_frames(self, frames: int) -> int:
        """F' of a valid F: 1 for an image, tokens_chunk_size n + token_overlap (5 n + 2) for 17 n + 5."""
        self.check_frames(frames)
        if frames == 1:
            return 1
        return (frames - self.frame_overlap) // self.clip_length * self.tokens_chunk_size + self.token_overlap

    def pixel_frames(self, latent_frames: int) -> int:
        """F of a valid F': the inverse of `latent_frames`."""
        if latent_frames == 1:
            return 1
        n, rest = divmod(latent_frames - self.token_overlap, self.tokens_chunk_size)
        if n < 1 or rest:
            raise ValueError(f"{latent_frames} latent frames: MiniMax H3 latents have 1 or {self.tokens_chunk_size} n"
                             f" + {self.token_overlap} frames, n >= 1 (nearest: "
                             f"{self._nearest(latent_frames, self.tokens_chunk_size, self.token_overlap)})")
        return self.clip_length * n + self.frame_overlap

    def check_frames(self, frames: int) -> None:
        if not self.valid_frames(frames):
            raise ValueError(f"{frames} frames: a MiniMax H3 clip has 1 or {self.clip_length} n + "
                             f"{self.frame_overlap} frames, n >= 1 (nearest: "
                             f"{self._nearest(frames, self.clip_length, self.frame_overlap)}; at {FPS} fps)")

    @staticmethod
    def _nearest(x: int, step: int, tail: int) -> str:
        n = max(1, (x - tail) // step)
        return " or ".join(str(step * k + tail) for k in sorted({n, n + 1}))

    @classmethod
    def from_dict(cls, d: dict) -> "H3VAEConfig":
        """From a dict of field names (lists for tuples); an unknown key or a wrong type is an error naming it
        (and the nearest field name)."""
        return parse(cls, d, "H3VAEConfig")


@dataclass(frozen=True)
class H3Tiling:
    """Spatial tiles of encode and decode, in pixels: `size` x `size` tiles overlapping by at least `overlap`,
    the slack spread over the overlaps in whole latent cells so the tiles cover the frame exactly, blended
    linearly (MiniMax klvae.py `split_tiles` / `blend`; diffusers `_split_tiles` / `_stitch_tiles`). MiniMax H3
    is released with 256 / 64 tiling on for both (video_vae/config.json `vae_tile_size`, `vae_tile_overlap_min`,
    `vae_encoder_tiling`, `vae_decoder_tiling`): its frames are the blended-tile ones, so it is on by default."""

    size: int = 256
    overlap: int = 64

    def check(self, config: H3VAEConfig) -> None:
        s = config.spatial_compression
        if self.size % s or self.overlap % s or not 0 < self.overlap < self.size:
            raise ValueError(f"H3Tiling(size={self.size}, overlap={self.overlap}): both must be multiples of {s} "
                             "pixels (whole latent cells) and 0 < overlap < size (the references crop a tile's "
                             "overlap with `[:-overlap]`, which a zero overlap turns into an empty tile)")


def split_tiles(length: int, size: int, overlap: int, unit: int) -> tuple[list[int], int, list[int]]:
    """(tile starts, tile length, overlaps) covering `length` pixels: the fewest `size` tiles that cover it with
    every overlap >= `overlap`, the slack added to the overlaps round-robin in steps of `unit` (a latent cell).
    One tile of the whole length when it fits (MiniMax `split_tiles`)."""
    if size >= length:
        return [0], length, []
    n = -(-length // size)
    while size * n - overlap * (n - 1) < length:
        n += 1
    overlaps = [overlap] * (n - 1)
    for i in range((size * n - sum(overlaps) - length) // unit):
        overlaps[i % (n - 1)] += unit
    starts = [0]
    for ov in overlaps:
        starts.append(starts[-1] + size - ov)
    return starts, size, overlaps


# The release (MiniMaxAI/MiniMax-H3 vae/config.json = FL2VA/video_vae/source + wrapper config.json).
H3_VAE = H3VAEConfig()
# For tests: the released temporal geometry (clip 17, drop 3: 17 n + 5 -> 5 n + 2), 4x space (two levels, both
# halving time), widths 8 / 16, 4 latent channels, a 2-block decoder of 2 heads x 16 (12 rotated channels).
H3_VAE_TINY = H3VAEConfig(
    latent_channels=4, block_out_channels=(8, 16), layers_per_block=1, spatial_downsample_factors=(2, 2),
    temporal_downsample_factors=(2, 2), norm_num_groups=4, decoder_num_layers=2, decoder_num_attention_heads=2,
    decoder_attention_head_dim=16, decoder_num_register_tokens=2, decoder_ffn_mult=2,
    latents_mean=(0.0,) * 4, latents_std=(1.0,) * 4)

PRESETS = {"minimax-h3": H3_VAE, "minimax-h3-tiny": H3_VAE_TINY}
