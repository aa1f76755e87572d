"""The causal video VAE (Wan 2.1 / 2.2). Network body: see issue 3 (being written)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class VAEConfig:
    """Field names are the original Wan VAE constructor names (`temperal` is Wan's spelling)."""

    dim: int = 96
    z_dim: int = 16
    dim_mult: tuple[int, ...] = (1, 2, 4, 4)
    num_res_blocks: int = 2
    attn_scales: tuple[float, ...] = ()
    temperal_downsample: tuple[bool, ...] = (False, True, True)
    dropout: float = 0.0
    # Wan 2.2 only: decoder width, residual up/down blocks, 2x2 pixel patchify.
    dec_dim: int | None = None
    is_residual: bool = False
    patch_size: int = 1
    # Per-channel latent statistics: the DiT sees (z - mean) / std.
    mean: tuple[float, ...] = field(default_factory=tuple)
    std: tuple[float, ...] = field(default_factory=tuple)
