"""Fused kernels for the DiT's elementwise / row-reduction work, forward and backward:

    rms_norm_rope(x, weight, cos, sin, eps, num_heads)   q/k RMSNorm across heads, Wan's RoPE   (B, L, D) -> (B, L, H, Dh)
    ln_modulate(x, shift, scale, eps, dtype)             LayerNorm * (1 + scale) + shift        (B, L, D) -> (B, L, D)

Each is a torch custom op (`ops.py`; opaque to torch.compile, fake-tensor traceable) running a Triton
kernel (`triton_impl.py`) on CUDA, and its torch implementation elsewhere; `reference.py` holds the
plain-torch oracle (the DiT's torch path). Triton is optional: this package imports without it
(`TRITON_AVAILABLE` False, `status()` says why).

`winograd.py` (imported as `video_dit.kernels.winograd`) is the CPU's: Winograd F(4x4, 3x3) for no-grad
(kt, 3, 3) convolutions, which the HunyuanVideo 1.5 VAE's wide layers run on the CPU.

The DiT chooses per forward through a flag on its modules, as it does for attention (a flag read in
`forward`, never a swapped module): `set_kernels(model, "auto" | "triton" | "torch")`
(`VideoDiT.set_kernels`); "auto", the default, is the fused ops on CUDA tensors when triton imports,
the torch path otherwise; "torch" is the torch path (`models/layers.py`' `_RMSNormFn`, `apply_rope`,
`modulate`) unchanged.
"""

from __future__ import annotations

import torch
from torch import nn

from video_dit.kernels.ops import (DTYPES, TRITON_AVAILABLE, TRITON_ERROR, TRITON_INTERPRETED, ln_modulate,
                                   rms_norm_rope)
from video_dit.kernels.reference import ln_modulate_reference, rms_norm_rope_reference

KERNELS = ("auto", "triton", "torch")

__all__ = ["KERNELS", "TRITON_AVAILABLE", "TRITON_INTERPRETED", "ln_modulate", "ln_modulate_reference",
           "rms_norm_rope", "rms_norm_rope_reference", "set_kernels", "status", "use_fused"]


def status() -> str:
    """One line: whether the Triton kernels are available, and how they run."""
    if not TRITON_AVAILABLE:
        return f"fused kernels: triton unavailable ({TRITON_ERROR}; pip install triton): the torch path runs"
    import triton

    mode = "interpreter (TRITON_INTERPRET=1): CPU tensors too" if TRITON_INTERPRETED else "compiled: CUDA tensors"
    return f"fused kernels: triton {triton.__version__}, {mode}"


def use_fused(kernels: str, x: torch.Tensor) -> bool:
    """Whether a module whose flag is `kernels` runs the fused ops on the activation x:
    "triton" always, "torch" never, "auto" for CUDA tensors of a supported dtype when triton imports."""
    if kernels == "auto":
        return TRITON_AVAILABLE and x.is_cuda and x.dtype in DTYPES
    return kernels == "triton"


def set_kernels(model: nn.Module, kernels: str) -> nn.Module:
    """Set the `kernels` flag on every module of `model` that has one ("auto", "triton" or "torch")."""
    if kernels not in KERNELS:
        raise ValueError(f"unknown kernels {kernels!r}; accepted: {', '.join(KERNELS)}")
    if kernels == "triton" and not TRITON_AVAILABLE:
        raise RuntimeError(f"kernels 'triton' needs the triton package, which does not import ({TRITON_ERROR}); "
                           "pip install triton, or use 'torch'")
    found = 0
    for module in model.modules():
        if hasattr(module, "kernels"):
            module.kernels = kernels
            found += 1
    if not found:
        raise ValueError(f"{type(model).__name__} has no module with a `kernels` flag")
    return model
