"""The Wan DiT's configuration: `DiTConfig`, field for field the original `WanModel` constructor's, so a
Wan `config.json` maps 1:1 (`DiTConfig.from_dict`). Its own file so that the network (`dit.py`) and its
layers (`layers.py`) both read it without importing each other."""

from __future__ import annotations

import difflib
from dataclasses import dataclass, fields


@dataclass
class DiTConfig:
    """Field names are the original Wan `WanModel` constructor names, so configs map 1:1."""

    patch_size: tuple[int, int, int] = (1, 2, 2)
    in_dim: int = 16
    dim: int = 1536
    ffn_dim: int = 8960
    freq_dim: int = 256
    text_dim: int = 4096
    out_dim: int = 16
    num_heads: int = 12
    num_layers: int = 30
    text_len: int = 512
    qk_norm: bool = True
    cross_attn_norm: bool = True
    eps: float = 1e-6
    # The CLIP image branch of Wan 2.1 I2V / FLF2V: `img_emb` and, in every cross-attention, `k_img`,
    # `v_img`, `norm_k_img`. None = no branch (t2v, and every Wan 2.2 model: Wan 2.2 I2V A14B's config
    # also says model_type "i2v" but takes the image by channel concat only, so the type cannot decide).
    image_dim: int | None = None  # width of the CLIP features (ViT-H/14: 1280)
    image_tokens: int = 257       # CLIP tokens per image (ViT-H/14 at 224 px: 16 x 16 patches + class token)
    num_images: int = 1           # 1 (I2V: the first frame) or 2 (FLF2V: first and last frame, + img_emb.emb_pos)

    def __post_init__(self):
        self.patch_size = tuple(int(p) for p in self.patch_size)
        if len(self.patch_size) != 3 or min(self.patch_size) < 1:
            raise ValueError(f"DiTConfig.patch_size must be 3 positive ints (t, h, w), got {self.patch_size}")
        if self.dim % self.num_heads:
            raise ValueError(f"DiTConfig.dim={self.dim} is not divisible by num_heads={self.num_heads}")
        if self.head_dim % 2 or self.head_dim < 6:
            raise ValueError(f"DiTConfig head dim dim/num_heads={self.head_dim} must be even and >= 6 (3D RoPE)")
        if self.freq_dim % 2:
            raise ValueError(f"DiTConfig.freq_dim={self.freq_dim} must be even")
        if self.image_dim is not None and self.image_dim < 1:
            raise ValueError(f"DiTConfig.image_dim={self.image_dim} must be None (no image branch) or >= 1")
        if self.num_images not in (1, 2) or self.image_tokens < 1:
            raise ValueError(f"DiTConfig.num_images={self.num_images} must be 1 (I2V) or 2 (FLF2V) and "
                             f"image_tokens={self.image_tokens} >= 1")

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    @property
    def out_channels(self) -> int:
        """The latent channels predicted (the family contract's name for `out_dim`)."""
        return self.out_dim

    @property
    def i2v_only(self) -> bool:
        """Whether the DiT takes image-to-video samples only: its input wider than its output (concat
        i2v: the mask and first-frame latents in extra channels, Wan 2.1 / 2.2 I2V)."""
        return self.in_dim != self.out_dim

    @property
    def image_context_len(self) -> int:
        """Li, the image tokens the image branch attends to: 257 (I2V) or 514 (FLF2V); 0 without a branch."""
        return self.num_images * self.image_tokens if self.image_dim is not None else 0

    @classmethod
    def from_dict(cls, d: dict) -> "DiTConfig":
        """Build from a dict (e.g. an original Wan `config.json`); unknown keys are rejected with the
        nearest valid name. Keys Wan stores that do not change the network are ignored, by name;
        `model_type` among them: Wan 2.1 and 2.2 I2V both say "i2v", only Wan 2.1 has the image
        branch, so `load_dit` sets the image fields from the weights' keys."""
        ignored = {"_class_name", "_diffusers_version", "model_type", "window_size", "__name__"}
        names = [f.name for f in fields(cls)]
        for key in d:
            if key not in names and key not in ignored:
                close = difflib.get_close_matches(key, names, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise ValueError(f"unknown DiTConfig key {key!r}{hint}; valid keys: {', '.join(names)}")
        return cls(**{k: v for k, v in d.items() if k in names})
