"""The fused ops as torch custom ops (`video_dit::...`): opaque to torch.compile (Inductor neither
fuses into nor re-derives them, so its LayerNorm-backward reduction bugs cannot reach them), with a
fake (meta) implementation for tracing and an autograd formula that is itself a custom op.

    rms_norm_rope(x, weight, cos, sin, eps, num_heads) -> (B, L, H, Dh) x.dtype   saves x, rstd (B, L)
    ln_modulate(x, shift, scale, eps, dtype)           -> (B, L, D) dtype         saves x, scale, mean, rstd

Each op runs its Triton kernel (`triton_impl`) on CUDA tensors, and on any tensor when triton is in
its interpreter (TRITON_INTERPRET=1 before `video_dit.kernels` is imported); otherwise (CPU, or no
triton) its torch implementation below: the same saved tensors and backward formulas, in torch.
"""

import importlib
from typing import Optional

import torch
from torch import Tensor

try:  # optional: everything runs without triton
    _triton = importlib.import_module("video_dit.kernels.triton_impl")
    TRITON_ERROR = None
except ImportError as e:  # triton not installed (or too old for triton.language's split/join)
    _triton = None
    TRITON_ERROR = f"{type(e).__name__}: {e}"

TRITON_AVAILABLE = _triton is not None
TRITON_INTERPRETED = bool(_triton is not None and _triton.INTERPRETED)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # of x (and of the outputs) the fused ops accept


def _runs_triton(x: Tensor) -> bool:
    return _triton is not None and (x.is_cuda or _triton.INTERPRETED)


def _check(name: str, x: Tensor, **float32: Tensor) -> None:
    if x.dim() != 3 or x.dtype not in DTYPES or x.stride(-1) != 1:
        raise ValueError(f"{name}: x must be (B, L, D) in one of {[str(d) for d in DTYPES]} with unit "
                         f"channel stride, got {tuple(x.shape)} {x.dtype} strides {x.stride()}")
    for key, t in float32.items():
        if t is not None and t.dtype != torch.float32:
            raise ValueError(f"{name}: {key} must be float32 (the float32 adaLN / RoPE region), got {t.dtype}")


# ---------------------------------------------------------------- q/k RMSNorm + RoPE


def _rope_rows(t: Tensor, L: int) -> Tensor:
    return t.reshape(L, -1)  # (1, L, 1, Dh/2) -> (L, Dh/2)


@torch.library.custom_op("video_dit::rms_norm_rope", mutates_args=())
def _rms_norm_rope(x: Tensor, weight: Tensor, cos: Optional[Tensor], sin: Optional[Tensor], eps: float,
                   num_heads: int) -> tuple[Tensor, Tensor]:
    x = x.contiguous()
    B, L, D = x.shape
    if cos is not None:
        cos, sin = _rope_rows(cos, L).contiguous(), _rope_rows(sin, L).contiguous()
    if _runs_triton(x):
        return _triton.rms_norm_rope_fwd(x, weight.contiguous(), cos, sin, eps, num_heads)
    xf = x.float()
    rstd = torch.rsqrt(xf.square().mean(-1) + eps)  # (B, L)
    n = ((xf * rstd[..., None]).to(x.dtype).float() * weight.float()).view(B, L, num_heads, -1)
    if cos is not None:
        n = _rotate(n, cos[:, None], sin[:, None])
    return n.to(x.dtype), rstd


@_rms_norm_rope.register_fake
def _(x, weight, cos, sin, eps, num_heads):
    B, L, D = x.shape
    return x.new_empty((B, L, num_heads, D // num_heads)), x.new_empty((B, L), dtype=torch.float32)


def _rotate(t: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Adjacent pairs of t (B, L, H, Dh) float32 rotated by (L, 1, Dh/2) angles (sin negated: the inverse)."""
    t0, t1 = t.unflatten(-1, (-1, 2)).unbind(-1)
    return torch.stack((t0 * cos - t1 * sin, t0 * sin + t1 * cos), dim=-1).flatten(-2)


@torch.library.custom_op("video_dit::rms_norm_rope_backward", mutates_args=())
def _rms_norm_rope_backward(grad: Tensor, x: Tensor, weight: Tensor, cos: Optional[Tensor],
                            sin: Optional[Tensor], rstd: Tensor, num_heads: int) -> tuple[Tensor, Tensor]:
    x, grad = x.contiguous(), grad.contiguous()
    B, L, D = x.shape
    if cos is not None:
        cos, sin = _rope_rows(cos, L).contiguous(), _rope_rows(sin, L).contiguous()
    if _runs_triton(x):
        return _triton.rms_norm_rope_bwd(grad, x, weight.contiguous(), cos, sin, rstd, num_heads)
    g = grad.float().view(B, L, num_heads, -1)
    if cos is not None:
        g = _rotate(g, cos[:, None], -sin[:, None])  # the rotation's transpose
    g = g.view(B, L, D)
    xh = x.float() * rstd[..., None]
    gw = g * weight.float()
    dx = rstd[..., None] * (gw - xh * (gw * xh).mean(-1, keepdim=True))
    return dx.to(x.dtype), (g * xh).sum((0, 1)).to(weight.dtype)


@_rms_norm_rope_backward.register_fake
def _(grad, x, weight, cos, sin, rstd, num_heads):
    return torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(weight)


def _rms_setup(ctx, inputs, output):
    x, weight, cos, sin, _, num_heads = inputs
    ctx.save_for_backward(x, weight, cos, sin, output[1])
    ctx.num_heads = num_heads


def _rms_backward(ctx, grad, _grad_rstd):
    x, weight, cos, sin, rstd = ctx.saved_tensors
    dx, dw = _rms_norm_rope_backward(grad, x, weight, cos, sin, rstd, ctx.num_heads)
    return dx, dw if ctx.needs_input_grad[1] else None, None, None, None, None


_rms_norm_rope.register_autograd(_rms_backward, setup_context=_rms_setup)


def rms_norm_rope(x: Tensor, weight: Tensor, cos: Tensor | None, sin: Tensor | None, eps: float,
                  num_heads: int) -> Tensor:
    """x * rsqrt(mean(x^2) + eps) * weight across all heads, then Wan's RoPE (adjacent pairs).

    x (B, L, D) q or k in the compute dtype; weight (D,); cos, sin (1, L, 1, Dh/2) float32 as
    `rope_tables` makes them, or both None (the norm alone: cross-attention). -> (B, L, H, Dh) in
    x's dtype. float32 statistics and arithmetic; x * rstd rounded to x's dtype before the weight,
    as the torch path. Backward gives the grads of x and weight (`weight`'s dtype)."""
    _check("rms_norm_rope", x, cos=cos, sin=sin)
    if (cos is None) != (sin is None):
        raise ValueError("rms_norm_rope: give both cos and sin, or neither")
    return _rms_norm_rope(x, weight, cos, sin, eps, num_heads)[0]


# ---------------------------------------------------------------- LayerNorm + adaLN modulation


@torch.library.custom_op("video_dit::ln_modulate", mutates_args=())
def _ln_modulate(x: Tensor, shift: Tensor, scale: Tensor, eps: float,
                 dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    x = x.contiguous()
    if _runs_triton(x):
        return _triton.ln_modulate_fwd(x, shift, scale, eps, dtype)
    xf = x.float()
    mean = xf.mean(-1)  # (B, L)
    xc = xf - mean[..., None]
    rstd = torch.rsqrt(xc.square().mean(-1) + eps)
    return torch.addcmul(shift, xc * rstd[..., None], 1 + scale).to(dtype), mean, rstd


@_ln_modulate.register_fake
def _(x, shift, scale, eps, dtype):
    B, L, D = x.shape
    stat = x.new_empty((B, L), dtype=torch.float32)
    return x.new_empty((B, L, D), dtype=dtype), stat, torch.empty_like(stat)


@torch.library.custom_op("video_dit::ln_modulate_backward", mutates_args=())
def _ln_modulate_backward(grad: Tensor, x: Tensor, scale: Tensor, mean: Tensor,
                          rstd: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    x, grad = x.contiguous(), grad.contiguous()
    if _runs_triton(x):
        return _triton.ln_modulate_bwd(grad, x, scale, mean, rstd)
    dy = grad.float()
    xh = (x.float() - mean[..., None]) * rstd[..., None]
    gx = dy * (1 + scale)
    dx = rstd[..., None] * (gx - gx.mean(-1, keepdim=True) - xh * (gx * xh).mean(-1, keepdim=True))
    dscale, dshift = dy * xh, dy.clone()  # dy may be grad itself: an op's output must not alias an input
    if scale.shape[1] == 1:  # T = 1: one (scale, shift) per sample, broadcast over its tokens
        dscale, dshift = dscale.sum(1, keepdim=True), dshift.sum(1, keepdim=True)
    return dx.to(x.dtype), dscale, dshift


@_ln_modulate_backward.register_fake
def _(grad, x, scale, mean, rstd):
    B, T, D = scale.shape
    g = scale.new_empty((B, T, D))
    return torch.empty_like(x, memory_format=torch.contiguous_format), g, torch.empty_like(g)


def _ln_setup(ctx, inputs, output):
    x, _, scale, _, _ = inputs
    ctx.save_for_backward(x, scale, output[1], output[2])


def _ln_backward(ctx, grad, _grad_mean, _grad_rstd):
    x, scale, mean, rstd = ctx.saved_tensors
    dx, dscale, dshift = _ln_modulate_backward(grad, x, scale, mean, rstd)
    return dx, dshift, dscale, None, None


_ln_modulate.register_autograd(_ln_backward, setup_context=_ln_setup)


def ln_modulate(x: Tensor, shift: Tensor, scale: Tensor, eps: float, dtype: torch.dtype) -> Tensor:
    """LayerNorm(x) * (1 + scale) + shift -> `dtype` (the next Linear's compute dtype).

    x (B, L, D) (the float32 residual stream, or the compute dtype entering block 0); shift, scale
    (B, T, D) float32, T in {1, L} (per-token timesteps), any strides with unit channel stride (the
    `unbind` views of the adaLN table). LayerNorm without affine, float32 statistics and arithmetic.
    Backward gives the grads of x (x's dtype) and of shift and scale ((B, T, D) float32; summed
    over the tokens when T = 1)."""
    _check("ln_modulate", x, shift=shift, scale=scale)
    B, L, D = x.shape
    for key, t in (("shift", shift), ("scale", scale)):
        if t.dim() != 3 or t.shape[0] != B or t.shape[1] not in (1, L) or t.shape[2] != D or t.stride(-1) != 1:
            raise ValueError(f"ln_modulate: {key} must be (B={B}, T in (1, {L}), D={D}) with unit channel "
                             f"stride, got {tuple(t.shape)} strides {t.stride()}")
    if shift.shape != scale.shape:
        raise ValueError(f"ln_modulate: shift {tuple(shift.shape)} and scale {tuple(scale.shape)} differ")
    if dtype not in DTYPES:
        raise ValueError(f"ln_modulate: dtype must be one of {[str(d) for d in DTYPES]}, got {dtype}")
    return _ln_modulate(x, shift, scale, eps, dtype)[0]
