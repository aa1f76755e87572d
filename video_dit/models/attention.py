"""One attention entry point for the whole package.

    attention(q, k, v, *, backend="native", attn_mask=None)   q (B, Lq, H, Dh), k/v (B, Lk, H, Dh) -> (B, Lq, H, Dh)

`native` is torch SDPA (flash / memory-efficient kernels where torch has them, CPU included);
`flash` is the flash-attn package, imported behind a guard. Modules that attend carry an
`attention_backend` flag read inside their `forward`; `set_attention_backend` flips that flag and
never swaps module instances (so LoRA/quantization wrappers and checkpoints are untouched).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

try:  # optional kernel; everything works without it
    from flash_attn import flash_attn_func as _flash_attn_func
except ImportError:  # the package is simply not installed
    _flash_attn_func = None

BACKENDS = ("native", "flash")


def flash_available() -> bool:
    return _flash_attn_func is not None


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, backend: str = "native",
              attn_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax attention without dropout or causality.

    q: (B, Lq, H, Dh), k, v: (B, Lk, H, Dh), same dtype. attn_mask: optional bool (B, Lk) key mask
    (True = attend) or anything SDPA broadcasts to (B, H, Lq, Lk). Returns (B, Lq, H, Dh).
    flash-attn has no mask argument: masked calls always go through SDPA (documented, not silent).
    """
    if backend == "flash" and attn_mask is None:
        if _flash_attn_func is None:
            raise RuntimeError("attention backend 'flash' needs the flash_attn package (pip install flash-attn)")
        return _flash_attn_func(q, k, v)
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; accepted: {', '.join(BACKENDS)}")
    if attn_mask is not None and attn_mask.dtype == torch.bool and attn_mask.dim() == 2:
        attn_mask = attn_mask[:, None, None, :]  # (B, Lk) -> (B, 1, 1, Lk)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=attn_mask)  # (B, H, Lq, Dh)
    return out.transpose(1, 2)  # (B, Lq, H, Dh)


def set_attention_backend(model: nn.Module, backend: str) -> nn.Module:
    """Set the `attention_backend` flag on every attending module of `model` ("native" or "flash")."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; accepted: {', '.join(BACKENDS)}")
    if backend == "flash" and _flash_attn_func is None:
        raise RuntimeError("attention backend 'flash' needs the flash_attn package, which is not installed "
                           "(pip install flash-attn); use 'native' (torch SDPA)")
    found = 0
    for module in model.modules():
        if hasattr(module, "attention_backend"):
            module.attention_backend = backend
            found += 1
    if not found:
        raise ValueError(f"{type(model).__name__} has no module with an `attention_backend` flag")
    return model
