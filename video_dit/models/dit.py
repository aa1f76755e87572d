"""The 3D-latent video DiT (Wan 2.x transformer family). Network body: see issue 2 (being written)."""

from __future__ import annotations

from dataclasses import dataclass


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
