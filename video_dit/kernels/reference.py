"""The fused ops' math in plain torch, as the DiT's torch path computes it (`models/layers.py`: `_RMSNormFn`
+ `apply_rope`, `modulate`): the test oracle of the Triton kernels and of the ops' own torch
implementation. Differentiable by autograd; no custom Function, no saved-tensor tricks.

    rms_norm_rope_reference(x, weight, cos, sin, eps, num_heads)   (B, L, D) -> (B, L, H, Dh) x.dtype
    ln_modulate_reference(x, shift, scale, eps, dtype)             (B, L, D) -> (B, L, D) dtype
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.promote_types(t.dtype, torch.float32))


def rms_norm_rope_reference(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor | None,
                            sin: torch.Tensor | None, eps: float, num_heads: int) -> torch.Tensor:
    """q/k RMSNorm across all heads, then Wan's RoPE. x (B, L, D) in the compute dtype; weight (D,);
    cos, sin (1, L, 1, Dh/2) float32 (`rope_tables`) or both None (the norm alone) -> (B, L, H, Dh)
    in x's dtype. Statistics in float32; x * rstd is rounded to x's dtype before the weight (as
    `_RMSNormFn`), the weight product and the rotation are float32, rounded once at the end."""
    xf = _f32(x)
    normed = (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)).to(x.dtype) * weight
    normed = normed.unflatten(-1, (num_heads, -1))  # (B, L, H, Dh)
    if cos is None:
        return normed.to(x.dtype)
    x0, x1 = normed.unflatten(-1, (-1, 2)).unbind(-1)  # (B, L, H, Dh/2) each
    out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)  # (B, L, H, Dh/2, 2)
    return out.flatten(-2).to(x.dtype)


def ln_modulate_reference(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float,
                          dtype: torch.dtype) -> torch.Tensor:
    """LayerNorm(x) (no affine, float32 statistics) * (1 + scale) + shift, in float32, -> `dtype`.
    x (B, L, D); shift, scale (B, T, D) float32, T in {1, L}."""
    xf = _f32(x)
    return torch.addcmul(shift, F.layer_norm(xf, xf.shape[-1:], eps=eps), 1 + scale).to(dtype)
