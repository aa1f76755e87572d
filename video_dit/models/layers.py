"""The primitives several families' DiTs share (family-neutral): the time sinusoid, RoPE's rotation of
channel pairs, the float32 islands' arithmetic (adaLN modulation, gated residual updates, LayerNorm in
float32), the lean q/k RMSNorm and the activation-memory recipes (`RecomputeSaved`).

    sinusoidal_embedding   (N,) timesteps on 0..1000 -> (N, dim) float32 [cos | sin]
    apply_rope             x (B, L, H, Dh) rotated by (1, L, 1, Dh/2) tables, adjacent channel pairs
    modulate               LayerNorm(x) * (1 + scale) + shift in float32 -> the next Linear's dtype
    gated_add              x + y * gate in float32 (the residual stream stays float32)
    norm_to                a LayerNorm computed in float32, returned in a given dtype
    RMSNorm                RMSNorm with a learned scale, float32 statistics; the fused q/k norm + RoPE op
    RecomputeSaved         cheap elementwise results saved as recipes, recomputed in backward

No family's facts here: each family's layers (its attention blocks, its RoPE tables) live in its own
folder (`video_dit/families/<name>/`) and import these.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from video_dit.kernels import ln_modulate, rms_norm_rope


def sinusoidal_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    """(N,) timesteps on 0..1000 -> (N, dim) float32 [cos | sin], frequencies 10000^(-i/half)."""
    half = dim // 2
    freqs = torch.pow(10000.0, -torch.arange(half, dtype=torch.float64, device=t.device) / half)
    angles = torch.outer(t.to(torch.float64), freqs)  # (N, half)
    return torch.cat([angles.cos(), angles.sin()], dim=1).float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent channel pairs of x (B, L, H, Dh) by the (1, L, 1, Dh/2) tables (Wan's pairing)."""
    x0, x1 = x.unflatten(-1, (-1, 2)).unbind(-1)  # (B, L, H, Dh/2) each, strided views
    out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)  # (B, L, H, Dh/2, 2)
    return out.flatten(-2).to(x.dtype)


def f32(t: torch.Tensor) -> torch.Tensor:
    """t in at least float32 (a float64 model stays float64): the dtype of the float32 islands."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def compute_dtype_of(t: torch.Tensor) -> torch.dtype:
    """The dtype the matmuls run in here: autocast's where it is on (a bf16 DiT's forward), else t's."""
    device = t.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else t.dtype


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float, dtype: torch.dtype,
             rc=None, fused: bool = False) -> torch.Tensor:
    """LayerNorm(x) * (1 + scale) + shift; x (B, L, D), shift/scale (B, T, D) float32, T in {1, L}.
    float32 region: the adaLN math (Wan: `norm(x).float() * (1 + e) + e`; bf16 here visibly degrades
    the pretrained models); the result goes to `dtype`, the next Linear's compute dtype.
    `rc`: a RecomputeSaved that stores the normed x as a recipe. `fused`: one kernel for all of it
    (`video_dit.kernels.ln_modulate`: the same float32 math; saves x and the row statistics)."""
    if fused:
        return ln_modulate(x, shift, scale, eps, dtype)
    with torch.autocast(x.device.type, enabled=False):
        x = f32(x)
        normed = F.layer_norm(x, x.shape[-1:], eps=eps)
        if rc is not None:
            rc.add(normed, _layer_norm, x, eps)
        return torch.addcmul(shift, normed, 1 + scale).to(dtype)


def _layer_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return F.layer_norm(f32(x), x.shape[-1:], eps=eps)


def gated_add(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x + y * gate, float32 (B, L, D): the residual update and the stream it returns stay float32,
    as Wan's `with autocast(dtype=float32): x = x + y * e` (diffusers casts back to bf16)."""
    with torch.autocast(x.device.type, enabled=False):
        return torch.addcmul(f32(x), y, gate)


def norm_to(norm: nn.LayerNorm, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`norm(x)` computed in float32 (Wan's WanLayerNorm runs on x.float() with float32 weights),
    then in `dtype` for the Linear after it."""
    with torch.autocast(x.device.type, enabled=False):
        x = f32(x)
        weight, bias = (None if p is None else p.to(x.dtype) for p in (norm.weight, norm.bias))
        return F.layer_norm(x, norm.normalized_shape, weight, bias, norm.eps).to(dtype)


class RecomputeSaved:
    """Autograd saves some cheap elementwise results for backward (the GELU output that `ffn.2`
    keeps for its weight gradient, the adaLN-modulated inputs the Linears keep). Registered
    tensors are saved as a recipe (function + its inputs, which autograd keeps anyway) and
    recomputed during backward: the same math, a fraction of the activation memory. Works with
    any module (LoRA, quanto) because it only swaps what autograd stores, not what runs.

    Only active outside activation checkpointing (which already stores nothing inside a block).
    `active=False` (a checkpointed or compiled block, no grad): `add` records nothing (its strides and
    storage offset are what torch.compile cannot trace: one graph break per recipe).
    """

    def __init__(self, active: bool = True):
        self.active = active
        self.entries: list[tuple[weakref.ref, object, tuple, tuple, int]] = []

    def add(self, out: torch.Tensor, fn, *inputs) -> torch.Tensor:
        if not self.active:
            return out
        # followed through the tensor that owns the storage: a registered view (the fused q norm's
        # `.flatten(2)`) is often dropped at once for a further view of the same base (`.unflatten`),
        # and a weak reference to the dropped object would miss what autograd then saves
        base = out if out._base is None else out._base
        self.entries.append((weakref.ref(base), fn, inputs, out.stride(), out.storage_offset()))
        return out

    def pack(self, t: torch.Tensor):
        if type(t) not in (torch.Tensor, nn.Parameter) and not isinstance(t, FakeTensor):
            return t  # tensor subclasses (quantized weights) as they are; fake tensors (memory estimates) as plain
        for ref, fn, inputs, stride, offset in self.entries:
            base = ref()
            # the same storage (its StorageImpl: also for fake tensors, whose data pointers are all 0)
            if (base is not None and t.dtype == base.dtype and t.device == base.device
                    and t.untyped_storage()._cdata == base.untyped_storage()._cdata):
                view = (t.size(), t.stride(), t.storage_offset() - offset)
                return (fn, inputs, stride, view)
        return t

    @staticmethod
    def unpack(packed):
        if isinstance(packed, torch.Tensor):
            return packed
        fn, inputs, stride, (size, view_stride, offset) = packed
        with torch.no_grad():
            out = fn(*inputs)
        if out.stride() != stride:
            raise RuntimeError(f"recomputed activation has strides {out.stride()}, saved one had {stride}")
        return out.as_strided(size, view_stride, out.storage_offset() + offset)

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


class _RMSNormFn(torch.autograd.Function):
    """x * rsqrt(mean(x^2) + eps) * weight, statistics in float32. Saves only x and the per-row
    rstd; torch's CPU rms_norm is a composite that also keeps x * rstd for the weight gradient."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        rstd = torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)  # (..., 1)
        ctx.save_for_backward(x, weight, rstd)
        return (xf * rstd).to(x.dtype) * weight

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        xhat = x.to(rstd.dtype) * rstd
        gw = grad.to(rstd.dtype) * weight.to(rstd.dtype)
        grad_x = rstd * (gw - xhat * (gw * xhat).mean(-1, keepdim=True))
        grad_w = (grad.to(rstd.dtype) * xhat).flatten(0, -2).sum(0) if ctx.needs_input_grad[1] else None
        return grad_x.to(x.dtype), None if grad_w is None else grad_w.to(weight.dtype), None


class RMSNorm(nn.Module):
    """RMSNorm with a learned scale (Wan's q/k norm across all heads); parameter name `weight`."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                num_heads: int | None = None) -> torch.Tensor:
        """x (B, L, D) -> the norm in float32 (a float32 weight promotes it); with `num_heads`, the
        fused op instead (`video_dit.kernels.rms_norm_rope`: the norm, then the `rope` (cos, sin) tables
        if given) -> (B, L, H, Dh) in x's dtype. The fused op is called from here, not from the
        attention, so hooks on this module (ZeRO-3 gathering its weight) still run."""
        if num_heads is None:
            return _RMSNormFn.apply(x, self.weight, self.eps)
        return rms_norm_rope(x, self.weight, *(rope or (None, None)), self.eps, num_heads)
