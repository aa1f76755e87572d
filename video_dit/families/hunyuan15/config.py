"""The HunyuanVideo 1.5 DiT's configuration: `HY15DiTConfig` (Tencent's constructor names), the public
variants' configs (`HY15_DIT_CONFIGS`) and the default RoPE bands. Its own file so that the network
(`dit.py`) and its layers (`layers.py`) both read it without importing each other."""

from __future__ import annotations

import difflib
from dataclasses import dataclass, fields, replace
from typing import ClassVar


def default_rope_dims(head_dim: int) -> tuple[int, int, int]:
    """(t, h, w) RoPE bands: head_dim / 8 for frames, the rest split evenly (128 -> Tencent's [16, 56, 56])."""
    t = 2 * (head_dim // 16)
    return (t, (head_dim - t) // 2, (head_dim - t) // 2)


@dataclass
class HY15DiTConfig:
    """Field names are Tencent's `HunyuanVideo_1_5_DiffusionTransformer` constructor names (its config.json)
    where it has one; `refiner_depth`, `byt5_states_dim`, `byt5_hidden_dim` are sizes Tencent hard-codes."""

    patch_size: tuple[int, int, int] = (1, 1, 1)
    in_channels: int = 32           # latent channels
    concat_condition: bool = True   # x carries [latents | condition latents | mask]: 2 * in_channels + 1
    out_channels: int = 32
    hidden_size: int = 2048
    heads_num: int = 16
    mlp_width_ratio: float = 4.0
    mm_double_blocks_depth: int = 54
    mm_single_blocks_depth: int = 0  # no public checkpoint has single-stream blocks; only 0 is built
    rope_dim_list: tuple[int, int, int] | None = None  # None: default_rope_dims(head_dim) ([16, 56, 56] at 128)
    rope_theta: float = 256.0
    qkv_bias: bool = True
    text_states_dim: int = 3584      # Qwen2.5-VL-7B hidden states
    refiner_depth: int = 2
    glyph_byT5_v2: bool = True       # the ByT5 glyph branch (byt5_in)
    byt5_states_dim: int = 1472      # Glyph-SDXL-v2 ByT5 hidden states
    byt5_hidden_dim: int = 2048
    vision_projection: str = "linear"  # "linear": the SigLIP branch (vision_in); "none": without
    vision_states_dim: int = 1152    # SigLIP so400m hidden states
    use_cond_type_embedding: bool = True
    use_meanflow: bool = False       # step-distilled: time_r_in(timestep_r) added to the time vector

    def __post_init__(self):
        self.patch_size = tuple(int(p) for p in self.patch_size)
        if len(self.patch_size) != 3 or min(self.patch_size) < 1:
            raise ValueError(f"HY15DiTConfig.patch_size must be 3 positive ints (t, h, w), got {self.patch_size}")
        if self.hidden_size % self.heads_num:
            raise ValueError(f"HY15DiTConfig.hidden_size={self.hidden_size} is not divisible by "
                             f"heads_num={self.heads_num}")
        dims = self.rope_dim_list = tuple(int(d) for d in self.rope_dim_list or default_rope_dims(self.head_dim))
        if len(dims) != 3 or sum(dims) != self.head_dim or any(d % 2 for d in dims):
            raise ValueError(f"HY15DiTConfig.rope_dim_list={list(dims)} must be 3 even sizes summing to the head "
                             f"dim hidden_size/heads_num={self.head_dim}")
        if self.mm_single_blocks_depth != 0:
            raise ValueError(f"HY15DiTConfig.mm_single_blocks_depth={self.mm_single_blocks_depth}: only 0 is "
                             "supported (no public HunyuanVideo 1.5 checkpoint has single-stream blocks)")
        if self.vision_projection not in ("linear", "none"):
            raise ValueError(f"HY15DiTConfig.vision_projection={self.vision_projection!r}; accepted: 'linear', 'none'")
        if self.use_cond_type_embedding and not (self.glyph_byT5_v2 and self.vision_projection == "linear"):
            raise ValueError("HY15DiTConfig.use_cond_type_embedding needs glyph_byT5_v2=True and "
                             "vision_projection='linear' (Tencent asserts the same)")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.heads_num

    # The family contract's DiT shape (`families.contract.DiTShape`) in neutral words:
    @property
    def num_layers(self) -> int:
        """The blocks that checkpointing and sequence parallelism count: the double-stream blocks."""
        return self.mm_double_blocks_depth

    @property
    def num_heads(self) -> int:
        return self.heads_num

    @property
    def patch_in_channels(self) -> int:
        """The channels of x: [latents | condition latents | mask] with concat_condition."""
        return 2 * self.in_channels + 1 if self.concat_condition else self.in_channels

    # Keys of Tencent's config.json that do not change the network, and keys that only one value is built for.
    _IGNORED: ClassVar = ("_class_name", "_diffusers_version", "attn_mode", "attn_param", "ideal_resolution",
                          "ideal_task")
    _FIXED: ClassVar = {"is_reshape_temporal_channels": False, "mlp_act_type": "gelu_tanh", "qk_norm": True,
                        "qk_norm_type": "rms", "text_projection": "single_refiner", "use_attention_mask": True,
                        "text_pool_type": None, "text_states_dim_2": None, "guidance_embed": False}

    @classmethod
    def from_dict(cls, d: dict) -> "HY15DiTConfig":
        """Build from a dict (e.g. Tencent's transformer config.json); unknown keys are rejected with the
        nearest valid name; keys with a single supported value must have it."""
        names = [f.name for f in fields(cls)]
        for key, value in d.items():
            if key in cls._FIXED:
                if value != cls._FIXED[key]:
                    raise ValueError(f"HY15DiTConfig: {key}={value!r} is not supported; only {cls._FIXED[key]!r} "
                                     "(what every public HunyuanVideo 1.5 checkpoint uses)")
            elif key not in names and key not in cls._IGNORED:
                close = difflib.get_close_matches(key, names + list(cls._FIXED), n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise ValueError(f"unknown HY15DiTConfig key {key!r}{hint}; valid keys: {', '.join(names)}")
        return cls(**{k: v for k, v in d.items() if k in names})


_PUBLIC = HY15DiTConfig()
_TINY = HY15DiTConfig(in_channels=4, out_channels=4, hidden_size=64, heads_num=2, mm_double_blocks_depth=2,
                      text_states_dim=32, byt5_states_dim=24, byt5_hidden_dim=2048, vision_states_dim=40)
# The public variants (Tencent's transformer/<name>/config.json; diffusers' convert_hunyuan_video1_5_to_diffusers.py):
# one architecture, differing in training only, but for the step-distilled model's time_r_in. The cfg-distilled
# models have no guidance embedding (guidance_embed false). Tiny configs for tests: as the public ones, t2v and
# i2v share the architecture (64 wide, 2 heads, 2 double + 2 refiner blocks; the ByT5 hidden width stays 2048,
# which diffusers hard-codes).
HY15_DIT_CONFIGS: dict[str, HY15DiTConfig] = {
    **{name: replace(_PUBLIC) for name in ("480p_t2v", "480p_i2v", "720p_t2v", "720p_i2v", "480p_t2v_distilled",
                                           "480p_i2v_distilled", "720p_i2v_distilled")},
    "480p_i2v_step_distilled": replace(_PUBLIC, use_meanflow=True),
    "tiny_t2v": replace(_TINY),
    "tiny_i2v": replace(_TINY),
    "tiny_i2v_step_distilled": replace(_TINY, use_meanflow=True),
}
