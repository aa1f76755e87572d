"""The MiniMax H3 DiT's configuration: `H3DiTConfig` (field names are diffusers' `MiniMaxH3Transformer3DModel`
constructor names, every one of them), the released configs (`H3_DIT_CONFIGS`) and a tiny one for tests. Its
own file so the network (`dit.py`), its layers (`layers.py`) and the packing (`packing.py`) read it without
importing each other.

Sources:
  [M]  MiniMaxAI/MiniMax-H3 (GitHub mirror MiniMax-AI/MiniMax-H3, commit 8d8824e): FL2VA/transformer/config.json
       and Ref2VA/transformer/config.json, the original checkpoint's configs (`MiniMaxH3DiTModel`, SGLang's
       names: latents_dim, ffn_hidden_size, token_refiner_num_layers, adaln_out_features, ...), identical for the
       two partitions; transformer/config.json and transformer_ref/config.json, the diffusers-format ones.
  [D]  diffusers 0.42.1 models/transformers/transformer_minimax_h3.py (`MiniMaxH3Transformer3DModel` defaults)
       and scripts/convert_minimax_h3_to_diffusers.py `MINIMAX_H3_TRANSFORMER_CONFIG` (the name map [M] -> [D]).
  [P]  diffusers modular_pipelines/minimax_h3/modular_pipeline.py: MINIMAX_H3_AUDIO_CHANNELS = 2 (stereo,
       packed channel-major), a pipeline constant the DiT's packing needs (not a key of [D]).
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, fields, replace
from typing import ClassVar

MODALITIES = 3  # AdaLN entries per timestep: 0 video, 1 text, 2 audio ([D] MINIMAX_H3_MODALITY_NUM)


@dataclass(frozen=True)
class H3DiTConfig:
    """One MiniMax H3 DiT. The attention is wider than the residual stream: num_attention_heads x
    attention_head_dim (56 x 128 = 7168) > hidden_size (5376) in the release."""

    num_attention_heads: int = 56
    attention_head_dim: int = 128
    hidden_size: int = 5376          # the residual stream (the packed rows' width)
    num_layers: int = 50
    num_refiner_layers: int = 2      # plain pre-norm blocks refining the projected text rows
    ffn_dim: int = 14336             # SwiGLU inner width
    in_channels: int = 24            # video VAE latent channels (out_channels: the same)
    audio_in_channels: int = 32      # audio VAE latent channels
    patch_size: tuple[int, int, int] = (1, 2, 2)  # (t, h, w) video latent cells per row
    text_dim: int = 5120             # the conditioner's rows (Qwen3-VL hidden_states[50])
    freq_dim: int = 256              # timestep sinusoid width (timesteps in 0..1, unscaled)
    time_embed_hidden_dim: int = 5376
    time_embed_dim: int = 2688       # the input of every AdaLN projection
    rope_freq_dim: int = 16          # rotary frequencies per (t, h, w) axis: 6 x 16 = 96 channels rotated
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5           # the blocks' (and refiner blocks') pre-norms
    qk_norm_eps: float = 1e-5
    final_norm_eps: float = 1e-5     # the refiner's output norm and the final norm
    audio_channels: int = 2          # [P]: stereo channels, packed channel-major (not a key of [D])

    def __post_init__(self):
        object.__setattr__(self, "patch_size", tuple(int(v) for v in self.patch_size))
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type == "int" and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"H3DiTConfig.{f.name}={value!r}: a positive integer is accepted")
            if f.type == "float" and (not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0):
                raise ValueError(f"H3DiTConfig.{f.name}={value!r}: a positive number is accepted")
        if len(self.patch_size) != 3 or min(self.patch_size) < 1:
            raise ValueError(f"H3DiTConfig.patch_size={self.patch_size!r}: 3 positive ints (t, h, w) are accepted")
        if self.patch_size[0] != 1:
            # the rotary clock gives one time per latent frame ([D] pipeline `_temporal_position_grid`)
            raise ValueError(f"H3DiTConfig.patch_size={self.patch_size!r}: only a temporal patch of 1 is accepted "
                             "(one rotary time per latent frame, as the released model)")
        if self.rotary_dim > self.attention_head_dim:
            raise ValueError(f"H3DiTConfig.rope_freq_dim={self.rope_freq_dim}: 6 x rope_freq_dim = {self.rotary_dim} "
                             f"rotated channels must fit attention_head_dim={self.attention_head_dim}")

    # The family contract's DiT shape (`families.contract.DiTShape`) in neutral words:
    @property
    def num_heads(self) -> int:
        return self.num_attention_heads

    @property
    def out_channels(self) -> int:
        """The video latent channels predicted (the video VAE's z_dim)."""
        return self.in_channels

    @property
    def head_dim(self) -> int:
        return self.attention_head_dim

    @property
    def inner_dim(self) -> int:
        """The attention's width, heads x head_dim (7168 released: wider than hidden_size)."""
        return self.num_attention_heads * self.attention_head_dim

    @property
    def rotary_dim(self) -> int:
        """Channels of each head the RoPE rotates (the first ones; the rest pass): 2 x 3 axes x rope_freq_dim."""
        return 6 * self.rope_freq_dim

    @property
    def patch_dim(self) -> int:
        """The width of one video row before `video_patch_proj`: in_channels * pt * ph * pw."""
        return self.in_channels * math.prod(self.patch_size)

    # MiniMax's original config.json names
    # ([M] FL2VA/transformer/config.json) -> ours ([D] convert script's comments), and its derived keys.
    _ORIGINAL: ClassVar = {"token_refiner_num_layers": "num_refiner_layers", "ffn_hidden_size": "ffn_dim",
                           "latents_dim": "in_channels", "audio_latents_dim": "audio_in_channels",
                           "timestep_input_dim": "freq_dim", "time_embed_hidden_size": "time_embed_hidden_dim",
                           "rope_inv_freq_len": "rope_freq_dim"}
    _DERIVED: ClassVar = {"adaln_out_features": lambda c: 6 * MODALITIES * c.hidden_size,
                          "final_adaln_out_features": lambda c: 2 * c.hidden_size}

    @classmethod
    def from_dict(cls, d: dict) -> "H3DiTConfig":
        """From a transformer config.json: diffusers' (`MiniMaxH3Transformer3DModel`) or MiniMax's original
        (`MiniMaxH3DiTModel`, whose names are mapped, whose derived adaln_out_features /
        final_adaln_out_features must agree). Unknown keys are rejected with the nearest valid name; a key
        the file lacks takes the released value (diffusers' defaults)."""
        names = [f.name for f in fields(cls)]
        kwargs = {}
        for key, value in d.items():
            if key.startswith("_") or key in cls._DERIVED:  # _class_name, _diffusers_version, ...: not the network
                continue
            name = cls._ORIGINAL.get(key, key)
            if name not in names:
                close = difflib.get_close_matches(key, names + list(cls._ORIGINAL), n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise ValueError(f"unknown H3DiTConfig key {key!r}{hint}; valid keys: {', '.join(names)}")
            kwargs[name] = tuple(value) if name == "patch_size" else value
        config = cls(**kwargs)
        for key, derive in cls._DERIVED.items():
            if key in d and d[key] != derive(config):
                raise ValueError(f"H3DiTConfig: {key}={d[key]} does not fit hidden_size={config.hidden_size} "
                                 f"(expected {derive(config)})")
        return config


# The released DiT ([M], [D]: both partitions, FL2VA `transformer/` for t2va / fl2va and Ref2VA
# `transformer_ref/` for ref2va, share it; [M]'s names in brackets where they differ).
_RELEASED = H3DiTConfig(
    num_attention_heads=56, attention_head_dim=128, hidden_size=5376,   # [M][D]
    num_layers=50, num_refiner_layers=2,                                # [M] token_refiner_num_layers
    ffn_dim=14336,                                                      # [M] ffn_hidden_size
    in_channels=24, audio_in_channels=32, patch_size=(1, 2, 2),         # [M] latents_dim, audio_latents_dim
    text_dim=5120, freq_dim=256,                                        # [M] timestep_input_dim
    time_embed_hidden_dim=5376, time_embed_dim=2688,                    # [M] time_embed_hidden_size
    rope_freq_dim=16, rope_theta=10000.0,                               # [M] rope_inv_freq_len; [D] rope_theta
    norm_eps=1e-5, qk_norm_eps=1e-5, final_norm_eps=1e-5,               # [M][D]
    audio_channels=2)                                                   # [P]

# Tiny config for tests (a forward + backward in well under a second on one core): the attention wider
# than the residual stream (2 x 16 = 32 vs 24) and a partial rotation (6 x 2 = 12 of 16 channels), as released.
_TINY = dict(num_attention_heads=2, attention_head_dim=16, hidden_size=24, num_layers=2, num_refiner_layers=2,
             ffn_dim=40, in_channels=4, audio_in_channels=6, text_dim=20, freq_dim=16, time_embed_hidden_dim=24,
             time_embed_dim=12, rope_freq_dim=2)

H3_DIT_CONFIGS: dict[str, H3DiTConfig] = {
    "fl2va": _RELEASED,       # t2va and first / last frame (fl2va) partition
    "ref2va": _RELEASED,      # omni-reference partition (same architecture, its own weights)
    "tiny": replace(_RELEASED, **_TINY),
}
