"""The LTX-2 DiT's configuration: `LTX2DiTConfig` (field names are Lightricks' checkpoint-metadata names,
the "transformer" dict ltx-core's `LTXModelConfigurator.from_metadata` reads), the released variants
(`LTX2_DIT_CONFIGS`) and tiny ones for tests. Its own file so the network (`dit.py`) and its layers
(`layers.py`) both read it without importing each other.

Sources named below (read in the mirrors under /work/.mirror and by code search):
  [L]  Lightricks/LTX-2 packages/ltx-core/src/ltx_core/model/transformer/model_configurator.py
       (`LTXModelConfigurator.from_metadata`, mirror commit 400fd31): its defaults and `check_config_value`s.
  [D]  huggingface/diffusers scripts/convert_ltx2_to_diffusers.py `get_ltx2_transformer_config`
       (mirror commit 58eb52c080): the "2.0", "2.3" and "2.5" configs of the released transformers.
  [H]  the "transformer" dict of the ltx-2.3-22b-dev.safetensors header, as a public third-party test file
       quotes it (read through code search, which does not name its repository): caption_proj_before_connector,
       frequencies_precision, rope_type, av_ca_timestep_scale_multiplier.
  The 2.0 file's header was not available: its av_ca_timestep_scale_multiplier (1000) is [D]'s
  cross_attn_timestep_scale_multiplier; ltx-core's default when the header lacks the key is 1.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, fields, replace
from typing import ClassVar

ROPE_TYPES = ("split", "interleaved")
PRECISIONS = ("float32", "float64")


@dataclass(frozen=True)
class LTX2DiTConfig:
    """One LTX-2 audio-video DiT. Widths: video hidden_size = num_attention_heads * attention_head_dim,
    audio audio_hidden_size = audio_num_attention_heads * audio_attention_head_dim."""

    # video stream
    in_channels: int = 128              # video VAE latent channels (before patching)
    out_channels: int = 128
    patch_size: tuple[int, int, int] = (1, 1, 1)  # (t, h, w); Lightricks' patchifier: (1, p, p), p = 1 released
    num_attention_heads: int = 32
    attention_head_dim: int = 128
    cross_attention_dim: int = 4096     # the text context width attn2 reads (= hidden_size, see __post_init__)
    # audio stream
    audio_in_channels: int = 128        # audio VAE latent channels x mel bins (8 x 16): one token per latent frame
    audio_out_channels: int = 128
    audio_num_attention_heads: int = 32
    audio_attention_head_dim: int = 64
    audio_cross_attention_dim: int = 2048
    # shared
    num_layers: int = 48
    norm_eps: float = 1e-6
    caption_proj_before_connector: bool = False  # True: the text arrives at the stream widths (no caption_projection)
    caption_channels: int = 3840        # the connector output width caption_projection reads (Gemma 3 12B)
    apply_gated_attention: bool = False  # per-head gates 2 * sigmoid(to_gate_logits(x)) on every attention
    cross_attention_adaln: bool = False  # text cross-attention modulated: q by 3 more adaLN rows, k/v by prompt tables
    use_prompt_adaln_single: bool = True  # with cross_attention_adaln: k/v modulated by the sigma too
    ff_bias: bool = True
    audio_ff_bias: bool = True
    use_keyframes_abs_pos_embedding: bool = False  # a learned (1, D) embedding added to marked video tokens
    # positions (RoPE on real coordinates: pixels and seconds)
    positional_embedding_theta: float = 10000.0
    positional_embedding_max_pos: tuple[int, int, int] = (20, 2048, 2048)  # seconds, pixels, pixels
    audio_positional_embedding_max_pos: tuple[int] = (20,)  # seconds
    rope_type: str = "split"             # "split": halves of each head rotate together; "interleaved": pairs
    frequencies_precision: str = "float64"  # the frequency ladder computed in float64 ("float32": in float32)
    timestep_scale_multiplier: int = 1000
    av_ca_timestep_scale_multiplier: int = 1000  # the a2v / v2a gates' timestep: other stream's sigma x this
    # what the VAEs do to positions (diffusers' config carries them; Lightricks' pipelines pass positions)
    vae_scale_factors: tuple[int, int, int] = (8, 32, 32)  # pixel frames / rows / columns per latent
    causal_offset: int = 1               # the causal video / audio VAEs: latent 0 covers one frame
    audio_sampling_rate: int = 16000
    audio_hop_length: int = 160
    audio_scale_factor: int = 4          # mel frames per audio latent frame

    def __post_init__(self):
        for name in ("patch_size", "positional_embedding_max_pos", "audio_positional_embedding_max_pos",
                     "vae_scale_factors"):
            object.__setattr__(self, name, tuple(int(v) for v in getattr(self, name)))
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type == "int" and (not isinstance(value, int) or isinstance(value, bool) or value < 1) \
                    and f.name != "causal_offset":
                raise ValueError(f"LTX2DiTConfig.{f.name}={value!r}: a positive integer is accepted")
        checks = [
            (len(self.patch_size) == 3 and min(self.patch_size) >= 1, "patch_size", "3 positive ints (t, h, w)"),
            (len(self.positional_embedding_max_pos) == 3, "positional_embedding_max_pos", "3 ints (s, px, px)"),
            (len(self.audio_positional_embedding_max_pos) == 1, "audio_positional_embedding_max_pos", "1 int (s)"),
            (len(self.vae_scale_factors) == 3, "vae_scale_factors", "3 ints (t, h, w)"),
            (self.rope_type in ROPE_TYPES, "rope_type", " or ".join(map(repr, ROPE_TYPES))),
            (self.frequencies_precision in PRECISIONS, "frequencies_precision", " or ".join(map(repr, PRECISIONS))),
            (self.causal_offset in (0, 1), "causal_offset", "0 or 1"),
            (self.attention_head_dim % 2 == 0 and self.audio_attention_head_dim % 2 == 0,
             "attention_head_dim / audio_attention_head_dim", "even head dims (RoPE rotates pairs)"),
            # Lightricks asserts it ([L] check_config_value): the a2v / v2a RoPE tables are laid out with
            # the video head count over the audio attention's width
            (self.num_attention_heads == self.audio_num_attention_heads, "audio_num_attention_heads",
             f"the video's num_attention_heads={self.num_attention_heads}"),
            # the context is reshaped to the stream width (ltx-core `_prepare_context`: view(B, -1, inner_dim))
            (self.cross_attention_dim == self.hidden_size, "cross_attention_dim",
             f"hidden_size={self.hidden_size} (num_attention_heads * attention_head_dim)"),
            # ... and the a2v / v2a RoPE is built at audio_cross_attention_dim for the audio-width attention
            (self.audio_cross_attention_dim == self.audio_hidden_size, "audio_cross_attention_dim",
             f"audio_hidden_size={self.audio_hidden_size}"),
            (self.audio_out_channels == self.audio_in_channels, "audio_out_channels",
             f"audio_in_channels={self.audio_in_channels} (the output has the input's layout)"),
        ]
        for ok, name, accepted in checks:
            if not ok:
                raise ValueError(f"LTX2DiTConfig.{name}: {self._show(name)} is not accepted; accepted: {accepted}")

    def _show(self, names: str) -> str:
        return ", ".join(f"{n.strip()}={getattr(self, n.strip())!r}" for n in names.split("/"))

    # What the trainer's checks ask of any DiT config (neutral names):
    @property
    def hidden_size(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @property
    def audio_hidden_size(self) -> int:
        return self.audio_num_attention_heads * self.audio_attention_head_dim

    @property
    def num_heads(self) -> int:
        """The attention heads of every attention (video, audio and a2v / v2a have the same count)."""
        return self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.attention_head_dim

    @property
    def audio_head_dim(self) -> int:
        return self.audio_attention_head_dim

    @property
    def patch_in_channels(self) -> int:
        """The width of one video token before `patchify_proj`: in_channels * pt * ph * pw."""
        return self.in_channels * math.prod(self.patch_size)

    @property
    def ffn_dim(self) -> int:
        return 4 * self.hidden_size  # ltx-core FeedForward mult=4

    @property
    def audio_ffn_dim(self) -> int:
        return 4 * self.audio_hidden_size

    @property
    def modulation_rows(self) -> int:
        """adaLN rows per block and stream: shift, scale, gate of self-attention and FFN (+ the text
        cross-attention's q shift, scale, gate with cross_attention_adaln) ([L] adaln.py)."""
        return 9 if self.cross_attention_adaln else 6

    @property
    def has_prompt_adaln(self) -> bool:
        return self.cross_attention_adaln and self.use_prompt_adaln_single

    # Keys of the checkpoint's "transformer" metadata that do not change this network (the text connectors',
    # which are not part of it), and keys only one value is built for ([L] check_config_value).
    _IGNORED: ClassVar = (
        "_class_name", "attention_type", "norm_num_groups", "causal_temporal_positioning", "use_embeddings_connector",
        "connector_attention_head_dim", "connector_num_attention_heads", "connector_num_layers",
        "connector_positional_embedding_max_pos", "connector_num_learnable_registers", "connector_norm_output",
        "connector_apply_gated_attention", "connector_learnable_registers_std", "caption_projection_first_linear",
        "caption_projection_second_linear", "caption_proj_input_norm", "audio_connector_attention_head_dim",
        "audio_connector_num_attention_heads", "text_encoder_norm_type", "audio_caption_channels")
    _FIXED: ClassVar = {
        "dropout": 0.0, "attention_bias": True, "num_vector_embeds": None, "activation_fn": "gelu-approximate",
        "num_embeds_ada_norm": 1000, "use_linear_projection": False, "only_cross_attention": False,
        "cross_attention_norm": True, "double_self_attention": False, "upcast_attention": False,
        "standardization_norm": "rms_norm", "norm_elementwise_affine": False, "qk_norm": "rms_norm",
        "positional_embedding_type": "rope", "use_audio_video_cross_attention": True, "share_ff": False,
        "av_cross_ada_norm": True, "use_middle_indices_grid": True}

    @classmethod
    def from_dict(cls, d: dict) -> "LTX2DiTConfig":
        """From Lightricks' checkpoint metadata ("config" -> "transformer" dict). Unknown keys are
        rejected with the nearest valid name; keys Lightricks checks for one value must have it. A key
        the metadata lacks takes ltx-core's default ([L]), which is this dataclass's for every field but
        `av_ca_timestep_scale_multiplier` (ltx-core: 1) and `frequencies_precision` (ltx-core: float32)."""
        names = [f.name for f in fields(cls)]
        for key, value in d.items():
            if key in cls._FIXED:
                if value != cls._FIXED[key]:
                    raise ValueError(f"LTX2DiTConfig: {key}={value!r} is not supported; only {cls._FIXED[key]!r} "
                                     "(Lightricks' configurator checks the same)")
            elif key not in names and key not in cls._IGNORED:
                close = difflib.get_close_matches(key, names + list(cls._FIXED), n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise ValueError(f"unknown LTX2DiTConfig key {key!r}{hint}; valid keys: {', '.join(names)}")
        kwargs = {k: v for k, v in d.items() if k in names}
        kwargs.setdefault("av_ca_timestep_scale_multiplier", 1)  # [L]: config.get(..., 1)
        kwargs.setdefault("frequencies_precision", "float32")  # [L]: float64 only when the key says so
        for key in ("timestep_scale_multiplier", "av_ca_timestep_scale_multiplier"):  # the headers hold 1000.0
            value = kwargs.get(key)
            if isinstance(value, float) and value.is_integer():
                kwargs[key] = int(value)
        return cls(**kwargs)


# The released transformers. Every number: [D] for 2.0 / 2.3 / 2.5 (diffusers' names in brackets where
# they differ), cross-checked with [L] defaults and, for 2.3, the header [H].
_LTX_2_0 = LTX2DiTConfig(
    in_channels=128, out_channels=128, patch_size=(1, 1, 1),           # [D] in/out_channels, patch_size(_t) 1
    num_attention_heads=32, attention_head_dim=128,                     # [D]; 32 x 128 = 4096 wide
    cross_attention_dim=4096,                                           # [D]
    audio_in_channels=128, audio_out_channels=128,                      # [D] (8 latent channels x 16 mel bins)
    audio_num_attention_heads=32, audio_attention_head_dim=64,          # [D]; 32 x 64 = 2048 wide
    audio_cross_attention_dim=2048,                                     # [D]
    num_layers=48, norm_eps=1e-6,                                       # [D]
    caption_proj_before_connector=False, caption_channels=3840,         # [D] use_prompt_embeddings=True, 3840
    apply_gated_attention=False, cross_attention_adaln=False,           # [D] (audio_)gated_attn, (audio_)cross_attn_mod
    positional_embedding_theta=10000.0,                                 # [D] rope_theta
    positional_embedding_max_pos=(20, 2048, 2048),                      # [D] pos_embed_max_pos, base_height / width
    audio_positional_embedding_max_pos=(20,),                           # [D] audio_pos_embed_max_pos
    rope_type="split", frequencies_precision="float64",                 # [D] rope_type, rope_double_precision
    timestep_scale_multiplier=1000, av_ca_timestep_scale_multiplier=1000,  # [D] cross_attn_timestep_scale_multiplier
    vae_scale_factors=(8, 32, 32), causal_offset=1,                     # [D]
    audio_sampling_rate=16000, audio_hop_length=160, audio_scale_factor=4)  # [D]
# 2.3: gated attention, modulated text cross-attention, the caption projection moved before the
# connectors ([D] gated_attn / cross_attn_mod True, use_prompt_embeddings False; [H] the same, and
# av_ca_timestep_scale_multiplier 1000.0, frequencies_precision "float64", rope_type "split")
_LTX_2_3 = replace(_LTX_2_0, apply_gated_attention=True, cross_attention_adaln=True, caption_proj_before_connector=True)
# 2.5: the video FFN without biases and the keyframe embedding ([D] ff_bias False,
# use_keyframes_abs_pos_embedding True; [L] "LTX 2.5 (gemma4) sets ff_bias=false"); audio_ff_bias and
# use_prompt_adaln_single keep their True defaults for this checkpoint ([D]'s comment)
_LTX_2_5 = replace(_LTX_2_3, ff_bias=False, use_keyframes_abs_pos_embedding=True)

# Tiny configs for tests: 2 heads (video 2 x 16 = 32 wide, audio 2 x 8 = 16), 2 blocks, 8 video latent
# channels, audio 2 channels x 4 mel bins = 8, text 24 wide before the 2.0 caption projection.
_TINY = dict(in_channels=8, out_channels=8, num_attention_heads=2, attention_head_dim=16, cross_attention_dim=32,
             audio_in_channels=8, audio_out_channels=8, audio_num_attention_heads=2, audio_attention_head_dim=8,
             audio_cross_attention_dim=16, num_layers=2, caption_channels=24)

LTX2_DIT_CONFIGS: dict[str, LTX2DiTConfig] = {
    "2.0": _LTX_2_0,
    "2.3": _LTX_2_3,
    "2.5": _LTX_2_5,
    "tiny_2.0": replace(_LTX_2_0, **_TINY),
    "tiny_2.3": replace(_LTX_2_3, **_TINY),
    "tiny_2.5": replace(_LTX_2_5, **_TINY),
    "tiny": replace(_LTX_2_3, **_TINY),
}
