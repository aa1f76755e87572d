"""Triton kernels of the fused ops (imported only where triton is; `ops.py` picks them for CUDA
tensors, or for any tensor when triton runs in its interpreter, TRITON_INTERPRET=1 when this
module is imported). One program per token row of D channels (whole rows in registers: D = 1536
for Wan 2.1 1.3B, 5120 for 14B); float32 arithmetic; inputs and outputs in their own dtypes.

    rms_norm_rope:  read x (B*L, D), write out (B*L, D) and rstd (B*L,)       forward
                    read dy, x, rstd, write dx; dw partials (G, D), summed     backward
    ln_modulate:    read x, scale, shift, write out and mean, rstd (B*L,)     forward
                    read dy, x, scale, mean, rstd, write dx and the scale /    backward
                    shift grads: per token (T = L) or partials (B, G, D) summed over G (T = 1)

RoPE pairs adjacent channels (Wan's layout): a row is reshaped to (D/2, 2) and split into its even
and odd channels, so loads and stores stay contiguous. Backward kernels that reduce over tokens run
G programs that each loop over rows, accumulate in registers and write one partial row each.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

# triton decides interpreter or compiler when a kernel is decorated, i.e. when this module is imported
_knobs = getattr(getattr(triton, "knobs", None), "runtime", None)
INTERPRETED = bool(getattr(_knobs, "interpret", None) if _knobs is not None
                   else os.environ.get("TRITON_INTERPRET", "0") == "1")


@triton.jit
def _rms_norm_rope_fwd(X, W, COS, SIN, OUT, RSTD, L, D, HALF, eps,
                       HAS_ROPE: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.cast(tl.program_id(0), tl.int64)
    d = tl.arange(0, BLOCK)
    mask = d < D
    x = tl.load(X + row * D + d, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    w = tl.load(W + d, mask=mask, other=0.0).to(tl.float32)
    # as _RMSNormFn: x * rstd rounded to x's dtype, then the float32 weight
    n = (x * rstd).to(X.dtype.element_ty).to(tl.float32) * w
    if HAS_ROPE:
        p = tl.arange(0, BLOCK // 2)
        j = (row % L) * HALF + p % HALF  # (token, pair within the head) in the (L, Dh/2) tables
        c = tl.load(COS + j, mask=p < D // 2, other=0.0)
        s = tl.load(SIN + j, mask=p < D // 2, other=0.0)
        n0, n1 = tl.split(tl.reshape(n, (BLOCK // 2, 2)))
        n = tl.reshape(tl.join(n0 * c - n1 * s, n0 * s + n1 * c), (BLOCK,))
    tl.store(OUT + row * D + d, n.to(OUT.dtype.element_ty), mask=mask)
    tl.store(RSTD + row, rstd)


@triton.jit
def _rms_norm_rope_bwd(DY, X, W, COS, SIN, RSTD, DX, DW, n_rows, L, D, HALF,
                       HAS_ROPE: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    d = tl.arange(0, BLOCK)
    mask = d < D
    p = tl.arange(0, BLOCK // 2)
    w = tl.load(W + d, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK,), dtype=tl.float32)
    for r in range(pid, n_rows, tl.num_programs(0)):
        row = tl.cast(r, tl.int64)
        dy = tl.load(DY + row * D + d, mask=mask, other=0.0).to(tl.float32)
        if HAS_ROPE:  # the rotation's transpose: back to the normed channels
            j = (row % L) * HALF + p % HALF
            c = tl.load(COS + j, mask=p < D // 2, other=0.0)
            s = tl.load(SIN + j, mask=p < D // 2, other=0.0)
            g0, g1 = tl.split(tl.reshape(dy, (BLOCK // 2, 2)))
            dy = tl.reshape(tl.join(g0 * c + g1 * s, g1 * c - g0 * s), (BLOCK,))
        rstd = tl.load(RSTD + row)
        xh = tl.load(X + row * D + d, mask=mask, other=0.0).to(tl.float32) * rstd
        dw += dy * xh
        g = dy * w
        dx = rstd * (g - xh * (tl.sum(g * xh, axis=0) / D))
        tl.store(DX + row * D + d, dx.to(DX.dtype.element_ty), mask=mask)
    tl.store(DW + tl.cast(pid, tl.int64) * D + d, dw, mask=mask)


@triton.jit
def _ln_modulate_fwd(X, SHIFT, SCALE, OUT, MEAN, RSTD, L, D, sh_b, sh_t, sc_b, sc_t, eps,
                     BLOCK: tl.constexpr):
    row = tl.cast(tl.program_id(0), tl.int64)
    b, t = row // L, row % L
    d = tl.arange(0, BLOCK)
    mask = d < D
    x = tl.load(X + row * D + d, mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=0) / D
    xc = tl.where(mask, x - mean, 0.0)
    rstd = tl.rsqrt(tl.sum(xc * xc, axis=0) / D + eps)
    scale = tl.load(SCALE + b * sc_b + t * sc_t + d, mask=mask, other=0.0)
    shift = tl.load(SHIFT + b * sh_b + t * sh_t + d, mask=mask, other=0.0)
    out = xc * rstd * (1.0 + scale) + shift
    tl.store(OUT + row * D + d, out.to(OUT.dtype.element_ty), mask=mask)
    tl.store(MEAN + row, mean)
    tl.store(RSTD + row, rstd)


@triton.jit
def _ln_modulate_bwd(DY, X, SCALE, MEAN, RSTD, DX, DSCALE, DSHIFT, L, D, G, sc_b, sc_t,
                     PER_TOKEN: tl.constexpr, BLOCK: tl.constexpr):
    # program b * G + g takes tokens g, g + G, ... of sample b (a 1D grid: a grid's 2nd axis stops at 65535)
    pid = tl.cast(tl.program_id(0), tl.int64)
    b, g = pid // G, pid % G
    d = tl.arange(0, BLOCK)
    mask = d < D
    acc_scale = tl.zeros((BLOCK,), dtype=tl.float32)
    acc_shift = tl.zeros((BLOCK,), dtype=tl.float32)
    for tok in range(g, L, G):
        t = tl.cast(tok, tl.int64)
        row = b * L + t
        dy = tl.load(DY + row * D + d, mask=mask, other=0.0).to(tl.float32)
        x = tl.load(X + row * D + d, mask=mask, other=0.0).to(tl.float32)
        xh = tl.where(mask, (x - tl.load(MEAN + row)) * tl.load(RSTD + row), 0.0)
        gx = dy * (1.0 + tl.load(SCALE + b * sc_b + t * sc_t + d, mask=mask, other=0.0))
        dx = tl.load(RSTD + row) * (gx - tl.sum(gx, axis=0) / D - xh * (tl.sum(gx * xh, axis=0) / D))
        tl.store(DX + row * D + d, dx.to(DX.dtype.element_ty), mask=mask)
        if PER_TOKEN:  # (B, L, D) grads, one row per token
            tl.store(DSCALE + row * D + d, dy * xh, mask=mask)
            tl.store(DSHIFT + row * D + d, dy, mask=mask)
        else:
            acc_scale += dy * xh
            acc_shift += dy
    if not PER_TOKEN:  # partial sums over this program's tokens: (B, G, D), summed over G by the caller
        part = pid * D
        tl.store(DSCALE + part + d, acc_scale, mask=mask)
        tl.store(DSHIFT + part + d, acc_shift, mask=mask)


# ---------------------------------------------------------------- launchers


def _block(D: int) -> tuple[int, int]:
    """(BLOCK, num_warps) for rows of D channels: the row padded to a power of two, ~256 per warp."""
    block = max(triton.next_power_of_2(D), 16)
    return block, min(max(block // 256, 1), 16)


@functools.lru_cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _programs(rows: int, device: torch.device) -> int:
    """How many programs split a reduction over `rows` (each writes one partial row): a few per SM."""
    if device.type == "cuda":
        return max(1, min(rows, 4 * _sm_count(device)))
    return max(1, min(rows, 8))  # the interpreter: a few (uneven shares at the tests' 12 rows)


def rms_norm_rope_fwd(x, weight, cos, sin, eps: float, num_heads: int):
    B, L, D = x.shape
    out = torch.empty((B, L, num_heads, D // num_heads), dtype=x.dtype, device=x.device)
    rstd = torch.empty((B, L), dtype=torch.float32, device=x.device)
    block, warps = _block(D)
    has_rope = cos is not None
    _rms_norm_rope_fwd[(B * L,)](x, weight, cos if has_rope else x, sin if has_rope else x, out, rstd, L, D,
                                 D // num_heads // 2, eps, HAS_ROPE=has_rope, BLOCK=block, num_warps=warps)
    return out, rstd


def rms_norm_rope_bwd(grad, x, weight, cos, sin, rstd, num_heads: int):
    B, L, D = x.shape
    dx = torch.empty_like(x)
    G = _programs(B * L, x.device)
    dw = torch.empty((G, D), dtype=torch.float32, device=x.device)
    block, warps = _block(D)
    has_rope = cos is not None
    _rms_norm_rope_bwd[(G,)](grad, x, weight, cos if has_rope else x, sin if has_rope else x, rstd, dx, dw,
                             B * L, L, D, D // num_heads // 2, HAS_ROPE=has_rope, BLOCK=block, num_warps=warps)
    return dx, dw.sum(0).to(weight.dtype)


def ln_modulate_fwd(x, shift, scale, eps: float, dtype: torch.dtype):
    B, L, D = x.shape
    out = torch.empty((B, L, D), dtype=dtype, device=x.device)
    mean = torch.empty((B, L), dtype=torch.float32, device=x.device)
    rstd = torch.empty_like(mean)
    block, warps = _block(D)
    per_token = shift.shape[1] > 1
    _ln_modulate_fwd[(B * L,)](x, shift, scale, out, mean, rstd, L, D, shift.stride(0),
                               shift.stride(1) if per_token else 0, scale.stride(0),
                               scale.stride(1) if per_token else 0, eps, BLOCK=block, num_warps=warps)
    return out, mean, rstd


def ln_modulate_bwd(grad, x, scale, mean, rstd):
    B, L, D = x.shape
    per_token = scale.shape[1] > 1
    dx = torch.empty_like(x)
    # per token: a program per row, writing the grads themselves; T = 1: G programs per sample, partial sums
    G = L if per_token else max(1, _programs(B * L, x.device) // B)
    dscale = torch.empty((B, G, D), dtype=torch.float32, device=x.device)
    dshift = torch.empty_like(dscale)
    block, warps = _block(D)
    _ln_modulate_bwd[(B * G,)](grad, x, scale, mean, rstd, dx, dscale, dshift, L, D, G, scale.stride(0),
                             scale.stride(1) if per_token else 0, PER_TOKEN=per_token, BLOCK=block,
                             num_warps=warps)
    if not per_token:
        dscale, dshift = dscale.sum(1, keepdim=True), dshift.sum(1, keepdim=True)  # (B, 1, D)
    return dx, dscale, dshift
