"""LTX-2's text connectors: Gemma 3's stacked hidden states to the video and the audio context the DiT
reads; weight-compatible with Lightricks' single-file checkpoint (`text_embedding_projection.*`,
`model.diffusion_model.{video,audio}_embeddings_connector.*`; ltx-core `FeatureExtractorV1/V2`,
`Embeddings1DConnector`, `EmbeddingsProcessor`) and diffusers' `LTX2TextConnectors` (names: `audio_convert.py`).

Dataflow (LTX-2 released: Gemma 3 12B, D = 3840, 48 blocks + embeddings = 49 states, Lt = 1024 tokens left
padded; connectors 2 blocks of 30 heads x 128 = 3840, 128 learnable registers)

    hidden states (B, Lt, D, 49) + mask (B, Lt)                    [text_encoder.py]
      feature extractor "v1" (LTX-2): per prompt and state, (x - mean) / (max - min) * 8 over its valid tokens
        and channels; flattened (B, Lt, D * 49), padding zeroed; one Linear (no bias) -> (B, Lt, 3840),
        the same features for both streams
      feature extractor "v2" (LTX-2.3): per token and state, x / rms(x over D); flattened, padding zeroed;
        x sqrt(4096 / D) -> video Linear -> (B, Lt, 4096); x sqrt(2048 / D) -> audio Linear -> (B, Lt, 2048)
      each stream: valid tokens moved to the front in order (stable), the tail filled with the learnable
        registers (register j at position j mod 128): every position is now valid
      blocks x N: x + attn(rms(x)) (q/k RMS-normed across heads, split RoPE at positions i / 4096, [gates]),
        x + ff(rms(x)) (Linear, GELU-tanh, Linear, 4x); rms
      -> video (B, Lt, 3840) and audio (B, Lt, 3840) context, every row of it (the references' mask is all ones)

Where diffusers and Lightricks differ we follow Lightricks: the valid tokens are moved to the front before
either connector whether or not it has registers (ltx-core `EmbeddingsProcessor.create_embeddings`: the
connectors are trained on right-padded input; diffusers moves them only when registers exist, so a
register-less connector there sees left-padded positions; the releases all have registers, where the two
agree), and the mean/range normalisation reads the mask rather than a padding side (the same numbers
for contiguous padding).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from video_dit.models.attention import attention
from video_dit.models.common import initialize_by_name
from video_dit.typed_config import parse


@dataclass(frozen=True)
class StreamConfig:
    """One connector (video or audio): `layers` blocks of `heads` x `head_dim`; `registers` learnable
    registers replacing padding (None: padding stays masked); per-head output gates (LTX-2.3)."""

    heads: int = 30
    head_dim: int = 128
    layers: int = 2
    registers: int | None = 128
    gated_attention: bool = False

    @property
    def dim(self) -> int:
        return self.heads * self.head_dim


@dataclass(frozen=True)
class ConnectorConfig:
    """`caption_channels` x `text_states`: the stacked Gemma hidden states' width and count (hidden_size,
    num_hidden_layers + 1). Field names follow diffusers' `LTX2TextConnectors` where it has them."""

    caption_channels: int = 3840
    text_states: int = 49
    video: StreamConfig = field(default_factory=StreamConfig)
    audio: StreamConfig = field(default_factory=StreamConfig)
    feature_extractor: Literal["v1", "v2"] = "v1"   # v1: LTX-2 (masked mean/range, one projection); v2: LTX-2.3
    proj_bias: bool = False                          # the projections' bias (v2: True)
    ff_bias: bool = True                             # ltx-core `connector_ff_bias`
    rope_max_pos: int = 4096                         # position i at i / rope_max_pos (connector_rope_base_seq_len)
    rope_theta: float = 10000.0
    rope_double_precision: bool = True               # frequencies in float64 (ltx-core frequencies_precision "float64")
    scale_factor: float = 8.0                        # v1's normalised range

    def __post_init__(self):
        if self.feature_extractor == "v1" and not self.video.dim == self.audio.dim == self.caption_channels:
            raise ValueError(f"ConnectorConfig: feature extractor 'v1' projects to caption_channels="
                             f"{self.caption_channels}, so both connectors must be that wide; got video "
                             f"{self.video.dim}, audio {self.audio.dim}")
        for name, s in (("video", self.video), ("audio", self.audio)):
            if s.head_dim % 2 or s.layers < 1 or s.heads < 1:
                raise ValueError(f"ConnectorConfig.{name}: heads={s.heads}, head_dim={s.head_dim} (even), "
                                 f"layers={s.layers} (>= 1)")
            if s.registers is not None and s.registers < 1:
                raise ValueError(f"ConnectorConfig.{name}.registers={s.registers}; accepted: None or >= 1")

    @property
    def feature_dim(self) -> int:
        return self.caption_channels * self.text_states

    @classmethod
    def from_dict(cls, d: dict, path: str = "ConnectorConfig") -> "ConnectorConfig":
        return parse(cls, d, path)


# LTX-2 (2.0) and LTX-2.3 (diffusers scripts/convert_ltx2_to_diffusers.py get_ltx2_connectors_config; ltx-core's
# configurators read the same from the checkpoint's transformer config). Only split RoPE is built: both use it.
LTX2_CONNECTORS = ConnectorConfig()
LTX23_CONNECTORS = ConnectorConfig(
    video=StreamConfig(heads=32, head_dim=128, layers=8, gated_attention=True),
    audio=StreamConfig(heads=32, head_dim=64, layers=8, gated_attention=True),
    feature_extractor="v2", proj_bias=True)
# Tiny, for tests: a 3-state, 16-wide text encoder; 8 registers.
TINY_CONNECTORS = ConnectorConfig(caption_channels=16, text_states=3,
                                  video=StreamConfig(heads=2, head_dim=8, layers=2, registers=8),
                                  audio=StreamConfig(heads=2, head_dim=8, layers=1, registers=8), rope_max_pos=32)
TINY_CONNECTORS_V2 = replace(TINY_CONNECTORS, feature_extractor="v2", proj_bias=True,
                             video=StreamConfig(heads=2, head_dim=8, layers=1, registers=8, gated_attention=True),
                             audio=StreamConfig(heads=2, head_dim=4, layers=1, registers=8, gated_attention=True))
CONNECTOR_CONFIGS = {"ltx2": LTX2_CONNECTORS, "ltx2.3": LTX23_CONNECTORS, "tiny": TINY_CONNECTORS,
                     "tiny-v2": TINY_CONNECTORS_V2}


# ---------------------------------------------------------------- feature extraction


def masked_range_norm(states: torch.Tensor, mask: torch.Tensor, scale: float = 8.0) -> torch.Tensor:
    """v1 (ltx-core `_norm_and_concat_padded_batch`): (B, Lt, D, N) states, (B, Lt) mask -> (B, Lt, D * N):
    per prompt and state, scale * (x - mean) / (max - min + 1e-6) over the valid tokens and channels; padded
    positions zero. In the states' dtype."""
    b, _, d, _ = states.shape
    valid = mask.bool()[:, :, None, None]                                            # (B, Lt, 1, 1)
    count = (mask.sum(dim=1) * d).view(b, 1, 1, 1)
    mean = states.masked_fill(~valid, 0.0).sum(dim=(1, 2), keepdim=True) / (count + 1e-6)   # (B, 1, 1, N)
    lo = states.masked_fill(~valid, float("inf")).amin(dim=(1, 2), keepdim=True)
    hi = states.masked_fill(~valid, float("-inf")).amax(dim=(1, 2), keepdim=True)
    normed = scale * (states - mean) / (hi - lo + 1e-6)
    return normed.flatten(2).masked_fill(~valid[..., 0], 0.0)                        # (B, Lt, D * N)


def token_rms_norm(states: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """v2 (ltx-core `norm_and_concat_per_token_rms`): each token's each state divided by its RMS over D
    (eps 1e-6); (B, Lt, D, N) -> (B, Lt, D * N), padded positions zero."""
    normed = states * torch.rsqrt(states.pow(2).mean(dim=2, keepdim=True) + 1e-6)
    return normed.flatten(2).masked_fill(~mask.bool()[:, :, None], 0.0)


class FeatureExtractor(nn.Module):
    """The stacked states' normalisation and projection (ltx-core: `aggregate_embed` for v1, `video_` /
    `audio_aggregate_embed` for v2; the checkpoint keeps them under `text_embedding_projection.`)."""

    def __init__(self, config: ConnectorConfig):
        super().__init__()
        self.config = config
        if config.feature_extractor == "v1":
            self.aggregate_embed = nn.Linear(config.feature_dim, config.caption_channels, bias=config.proj_bias)
        else:
            self.video_aggregate_embed = nn.Linear(config.feature_dim, config.video.dim, bias=config.proj_bias)
            self.audio_aggregate_embed = nn.Linear(config.feature_dim, config.audio.dim, bias=config.proj_bias)

    def forward(self, states: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, Lt, D, N) states, (B, Lt) mask -> video (B, Lt, Dv), audio (B, Lt, Da) features."""
        c = self.config
        if c.feature_extractor == "v1":
            features = self.aggregate_embed(masked_range_norm(states, mask, c.scale_factor).to(states.dtype))
            return features, features
        normed = token_rms_norm(states, mask).to(states.dtype)
        video = self.video_aggregate_embed(normed * math.sqrt(c.video.dim / c.caption_channels))
        audio = self.audio_aggregate_embed(normed * math.sqrt(c.audio.dim / c.caption_channels))
        return video, audio


# ---------------------------------------------------------------- the 1D connector


def rope_frequencies(length: int, config: ConnectorConfig, stream: StreamConfig,
                     device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Split RoPE tables cos, sin (1, heads, length, head_dim / 2) float32 for positions 0..length-1: the
    angle of pair k at position i is (2 i / rope_max_pos - 1) * theta^(k / (dim/2 - 1)) * pi / 2, the
    dim / 2 pairs spread over the heads in order (ltx-core `precompute_freqs_cis` with one position axis)."""
    half = stream.dim // 2
    dtype = torch.float64 if config.rope_double_precision else torch.float32
    freqs = (config.rope_theta ** torch.linspace(0.0, 1.0, half, dtype=dtype, device=device) * math.pi / 2).float()
    pos = torch.arange(length, dtype=torch.float32, device=device) / config.rope_max_pos
    angles = (pos[:, None] * 2 - 1) * freqs                                          # (length, dim / 2)
    angles = angles.view(length, stream.heads, -1).transpose(0, 1)[None]             # (1, H, length, Dh / 2)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Split RoPE on (B, H, L, Dh): the first and second halves of each head are the pair's two parts.
    In the activations' dtype with the tables cast to it, as ltx-core (`precompute_freqs_cis(out_dtype=
    hidden_states.dtype)`, `apply_split_rotary_emb`); diffusers rotates in float32 (the same in float32)."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class Attention(nn.Module):
    """Self-attention with q / k RMSNorm across all heads (learned scale), split RoPE, optional per-head
    gates 2 sigmoid(Linear(x)) on the output (ltx-core `Attention`, names kept: `to_q`, `q_norm`, `to_out.0`)."""

    def __init__(self, stream: StreamConfig):
        super().__init__()
        dim = stream.dim
        self.heads = stream.heads
        self.to_q, self.to_k, self.to_v = (nn.Linear(dim, dim) for _ in range(3))
        self.q_norm = nn.RMSNorm(dim, eps=1e-6)
        self.k_norm = nn.RMSNorm(dim, eps=1e-6)
        self.to_gate_logits = nn.Linear(dim, stream.heads) if stream.gated_attention else None
        self.to_out = nn.Sequential(nn.Linear(dim, dim), nn.Identity())
        self.attention_backend = "native"  # `models.attention.set_attention_backend` flips it

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                key_mask: torch.Tensor | None) -> torch.Tensor:
        """x (B, L, D); key_mask (B, L) bool, True = may be attended, or None (all)."""
        b, n, _ = x.shape
        q = self.q_norm(self.to_q(x)).view(b, n, self.heads, -1).transpose(1, 2)    # (B, H, L, Dh)
        k = self.k_norm(self.to_k(x)).view(b, n, self.heads, -1).transpose(1, 2)
        q, k = apply_rope(q, *rope).transpose(1, 2), apply_rope(k, *rope).transpose(1, 2)   # (B, L, H, Dh)
        v = self.to_v(x).view(b, n, self.heads, -1)
        out = attention(q, k, v, backend=self.attention_backend, attn_mask=key_mask)  # (B, L, H, Dh)
        if self.to_gate_logits is not None:
            out = out * (2.0 * torch.sigmoid(self.to_gate_logits(x)))[..., None]
        return self.to_out(out.flatten(2))


class GELUProj(nn.Module):
    """Linear then GELU (tanh approximation): ltx-core's `GELUApprox`, its weights under `proj`."""

    def __init__(self, dim_in: int, dim_out: int, bias: bool):
        super().__init__()
        self.proj = nn.Linear(dim_in, dim_out, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.proj(x), approximate="tanh")


class FeedForward(nn.Module):
    """Linear (4x), GELU (tanh), Linear; ltx-core names `net.0.proj`, `net.2`."""

    def __init__(self, dim: int, bias: bool):
        super().__init__()
        self.net = nn.Sequential(GELUProj(dim, 4 * dim, bias), nn.Identity(), nn.Linear(4 * dim, dim, bias=bias))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)                                                           # (B, L, D)


class Block(nn.Module):
    def __init__(self, stream: StreamConfig, ff_bias: bool):
        super().__init__()
        self.attn1 = Attention(stream)
        self.ff = FeedForward(stream.dim, ff_bias)

    def forward(self, x, rope, key_mask):
        x = x + self.attn1(F.rms_norm(x, (x.shape[-1],), eps=1e-6), rope, key_mask)
        return x + self.ff(F.rms_norm(x, (x.shape[-1],), eps=1e-6))


class Connector(nn.Module):
    """One stream's 1D transformer (ltx-core `Embeddings1DConnector`): front-aligned features (valid tokens
    first) -> context of the same shape."""

    def __init__(self, config: ConnectorConfig, stream: StreamConfig):
        super().__init__()
        self.config, self.stream = config, stream
        if stream.registers is not None:
            self.learnable_registers = nn.Parameter(torch.empty(stream.registers, stream.dim))
        self.transformer_1d_blocks = nn.ModuleList(Block(stream, config.ff_bias) for _ in range(stream.layers))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """x (B, L, D) with its valid rows first, mask (B, L) 1 / 0 -> (B, L, D). With registers the padded
        rows become registers and every row attends to every row; without, padded rows are masked as keys."""
        n = x.shape[1]
        key_mask = mask.bool()
        if self.stream.registers is not None:
            if n % self.stream.registers:
                raise ValueError(f"Connector: {n} text tokens is not a multiple of the {self.stream.registers} "
                                 "learnable registers (pad the prompts to max_length)")
            registers = self.learnable_registers.repeat(n // self.stream.registers, 1).to(x.dtype)  # (L, D)
            x = torch.where(key_mask[..., None], x, registers[None])
            key_mask = torch.ones_like(key_mask)
        rope = rope_frequencies(n, self.config, self.stream, device=x.device)
        attn_mask = None if bool(key_mask.all()) else key_mask
        for block in self.transformer_1d_blocks:
            x = block(x, rope, attn_mask)
        return F.rms_norm(x, (x.shape[-1],), eps=1e-6)


# ---------------------------------------------------------------- the module the pipeline calls


@torch.no_grad()
def init_parameter(config: ConnectorConfig, name: str, t: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Seeded initial value: Linear weights Xavier-uniform, biases 0, RMSNorm scales 1, learnable registers
    U(-1, 1) (as both references draw them). Drawn in float32 on the CPU, then copied."""
    values = torch.empty(t.shape, dtype=torch.float32, device="cpu")
    if name.endswith("learnable_registers"):
        values.uniform_(-1.0, 1.0, generator=generator)
    elif name.endswith(".bias"):
        values.zero_()
    elif name.endswith(".weight") and t.dim() == 1:
        values.fill_(1.0)
    elif name.endswith(".weight") and t.dim() == 2:
        nn.init.xavier_uniform_(values, generator=generator)
    else:
        raise ValueError(f"init_parameter: no initialisation rule for connector parameter {name!r} {tuple(t.shape)}")
    return t.copy_(values)


def front_align(x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's valid positions moved to the front in order (a stable sort of the mask), the rest after
    them: (B, L, D), (B, L) -> the same shapes (ltx-core `_compute_right_pad_order`)."""
    order = torch.argsort(mask.to(torch.int32), dim=1, descending=True, stable=True)      # (B, L)
    return torch.gather(x, 1, order[..., None].expand_as(x)), torch.gather(mask, 1, order)


class LTX2TextConnectors(nn.Module):
    """Stacked Gemma hidden states (B, Lt, D, N) + mask (B, Lt) -> video context (B, Lt, Dv) and audio context
    (B, Lt, Da), the DiT's text inputs. Submodules under ltx-core's names (the
    checkpoint's `text_embedding_projection` and `{video,audio}_embeddings_connector`); it computes in
    its weights' dtype (the RoPE tables are computed in float32 / float64 and cast to it)."""

    def __init__(self, config: ConnectorConfig, seed: int | None = None):
        super().__init__()
        self.config = config
        self.text_embedding_projection = FeatureExtractor(config)
        self.video_embeddings_connector = Connector(config, config.video)
        self.audio_embeddings_connector = Connector(config, config.audio)
        initialize_by_name(self, init_parameter, config, seed)

    @property
    def dtype(self) -> torch.dtype:
        return self.video_embeddings_connector.transformer_1d_blocks[0].attn1.to_q.weight.dtype

    def forward(self, states: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """states (B, Lt, D, N) or flattened (B, Lt, D * N) (diffusers' `prompt_embeds`), mask (B, Lt) 1 / 0,
        any padding side -> video (B, Lt, Dv), audio (B, Lt, Da): the prompt's tokens first, then registers.
        Every one of the Lt rows is context for the DiT: the references return a mask `(additive mask <
        1e-6)`, which is true for every row (their additive mask is 0 or -max), so the DiT's text mask is all
        ones (with registers, every row is a token or a register anyway; all releases have registers)."""
        c = self.config
        if states.dim() == 3:
            states = states.unflatten(2, (c.caption_channels, c.text_states))
        if states.shape[2:] != (c.caption_channels, c.text_states) or states.shape[:2] != mask.shape:
            raise ValueError(f"LTX2TextConnectors: expected states (B, Lt, {c.caption_channels}, {c.text_states}) "
                             f"and mask (B, Lt), got {tuple(states.shape)} and {tuple(mask.shape)}")
        video, audio = self.text_embedding_projection(states.to(self.dtype), mask)   # (B, Lt, Dv), (B, Lt, Da)
        video, aligned = front_align(video, mask)
        audio, _ = front_align(audio, mask)
        return self.video_embeddings_connector(video, aligned), self.audio_embeddings_connector(audio, aligned)
