"""The video DiT's layers (Wan 2.1 / 2.2), used by `dit.py`'s `VideoDiT`: the time sinusoid and 3D
RoPE tables, the adaLN and residual arithmetic with its float32 regions, the activation-memory
recipes (`RecomputeSaved`) and the modules of one block:

    RMSNorm          q/k norm across all heads (float32 statistics, a lean backward)
    SelfAttention    q, k, v, o; q/k RMSNorm and 3D RoPE; the sequence-parallel seam   (B, L, D) -> (B, L, D)
    CrossAttention   video tokens -> text (+ Wan 2.1 I2V's image attention before o)   (B, L, D) -> (B, L, D)
    ImageEmbedding   Wan's `MLPProj` (`img_emb`): CLIP features -> image context       (B, Li, image_dim) -> (B, Li, D)
    Block            adaLN self-attn, cross-attn, adaLN FFN, gated residual updates    (B, L, D) -> (B, L, D)
    Head             adaLN, Linear(D, out_dim * pt*ph*pw)                              (B, L, D) -> (B, L, out_dim*4)

Parameter names are Wan's checkpoint names. No distributed code here (the seam is `seq_parallel`).
The q/k RMSNorm + RoPE and the LayerNorm + adaLN modulation run either as written here (the torch
path) or as fused ops (`video_dit.kernels`), by the `kernels` flag of the modules that hold them
("auto" | "triton" | "torch", read in forward; `VideoDiT.set_kernels`). Same math, same float32 regions.
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch import nn

from video_dit.families.wan.config import DiTConfig
from video_dit.kernels import use_fused
from video_dit.models.attention import attention
from video_dit.models.layers import (
    RecomputeSaved,
    RMSNorm,
    apply_rope,
    compute_dtype_of,
    f32,
    gated_add,
    modulate,
    norm_to,
)

# ---------------------------------------------------------------- embeddings and RoPE



def rope_tables(grid: tuple[int, int, int], head_dim: int, device=None, theta: float = 10000.0):
    """Real RoPE tables for a (F', h, w) token grid: (cos, sin), each (1, L, 1, Dh/2) float32.

    The head dim is split into frame / height / width bands as Wan does (height and width get
    2*(Dh//6) channels each, frames the rest), each band with its own frequency ladder. Row i is
    the token at row-major position i of the grid, so the tables can be split along tokens (dim 1).
    """
    d_hw = 2 * (head_dim // 6)
    bands = (head_dim - 2 * d_hw, d_hw, d_hw)
    parts = []
    for axis, (n, d) in enumerate(zip(grid, bands)):
        inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64, device=device) / d)
        angle = torch.outer(torch.arange(n, dtype=torch.float64, device=device), inv_freq)  # (n, d/2)
        shape = [1, 1, 1, d // 2]
        shape[axis] = n
        parts.append(angle.view(shape).expand(*grid, d // 2))
    angles = torch.cat(parts, dim=-1).reshape(1, math.prod(grid), 1, head_dim // 2)  # (1, L, 1, Dh/2)
    return angles.cos().float(), angles.sin().float()



# ---------------------------------------------------------------- activation memory



# ---------------------------------------------------------------- layers



class SelfAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int, qk_norm: bool, eps: float):
        super().__init__()
        self.num_heads = num_heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))
        self.norm_q = RMSNorm(dim, eps) if qk_norm else nn.Identity()  # across all heads
        self.norm_k = RMSNorm(dim, eps) if qk_norm else nn.Identity()
        self.attention_backend = "native"
        self.kernels = "auto"  # q/k norm + RoPE: "auto" | "triton" (one fused op) | "torch" (video_dit.kernels)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], seq_parallel=None,
                rc: RecomputeSaved | None = None) -> torch.Tensor:
        """x (B, L, D) -> (B, L, D); rope = (cos, sin) (1, L, 1, Dh/2) for exactly these L tokens.
        rc: the block's RecomputeSaved (normed, rotated q/k are recomputed from q/k in backward)."""
        rc = rc or RecomputeSaved()
        q, k = self.q(x), self.k(x)  # (B, L, D)
        q_rot = rc.add(self._norm_rope(self.norm_q, q, *rope), self._norm_rope, self.norm_q, q, *rope)
        k_rot = rc.add(self._norm_rope(self.norm_k, k, *rope), self._norm_rope, self.norm_k, k, *rope)
        v = self.v(x).unflatten(2, (self.num_heads, -1))  # (B, L, H, Dh)
        # The sequence-parallel seam: with tokens split over ranks, the parallel layer's attention
        # sees this rank's (B, L_local, H, Dh) q/k/v (already normed and rotated) and returns the same shape.
        if seq_parallel is not None:
            out = seq_parallel.attention(q_rot, k_rot, v)
        else:
            out = attention(q_rot, k_rot, v, backend=self.attention_backend)
        return self.o(out.flatten(2))  # (B, L, D)

    def _norm_rope(self, norm: nn.Module, t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # float32 weights give a float32 normed, rotated q/k (Wan's, rotated in float64); attention
        # then takes them in t's (the compute) dtype, as Wan's flash attention casts them
        if isinstance(norm, RMSNorm) and use_fused(self.kernels, t):  # the same math in one op, saving t and rstd
            return norm(t, (cos, sin), self.num_heads)  # (B, L, H, Dh)
        return apply_rope(norm(t).unflatten(2, (self.num_heads, -1)), cos, sin).to(t.dtype)  # (B, L, H, Dh)


def _norm_as(norm: nn.Module, t: torch.Tensor, fused: bool = False) -> torch.Tensor:
    """norm(t) in t's dtype (the norm's float32 weight would otherwise promote it); `fused`: an
    RMSNorm as one op (`rms_norm_rope` without RoPE)."""
    if fused and isinstance(norm, RMSNorm):
        return norm(t, num_heads=1).flatten(2)  # (B, L, D)
    return norm(t).to(t.dtype)


class CrossAttention(nn.Module):
    """Attention from the video tokens to the text; with `image`, Wan 2.1 I2V's second attention
    (same q, its own k_img / v_img / norm_k_img) over the image tokens, added before `o`."""

    def __init__(self, dim: int, num_heads: int, qk_norm: bool, eps: float, image: bool = False):
        super().__init__()
        self.num_heads = num_heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))
        self.norm_q = RMSNorm(dim, eps) if qk_norm else nn.Identity()
        self.norm_k = RMSNorm(dim, eps) if qk_norm else nn.Identity()
        if image:
            self.k_img, self.v_img = nn.Linear(dim, dim), nn.Linear(dim, dim)
            self.norm_k_img = RMSNorm(dim, eps) if qk_norm else nn.Identity()
        self.attention_backend = "native"
        self.kernels = "auto"  # q/k RMSNorm as one fused op or the torch path (video_dit.kernels)

    def forward(self, x: torch.Tensor, context: torch.Tensor, context_mask: torch.Tensor | None = None,
                rc: RecomputeSaved | None = None, image_context: torch.Tensor | None = None):
        """x (B, L, D), context (B, Lt, D), context_mask (B, Lt) bool or None (text only),
        image_context (B, Li, D) for the image branch -> (B, L, D)."""
        rc = rc or RecomputeSaved()
        fused = use_fused(self.kernels, x)
        q = self.q(x)
        q = rc.add(_norm_as(self.norm_q, q, fused), _norm_as, self.norm_q, q, fused)
        q = q.unflatten(2, (self.num_heads, -1))  # (B, L, H, Dh)
        k = self.k(context)
        k = _norm_as(self.norm_k, k, fused).unflatten(2, (self.num_heads, -1))  # (B, Lt, H, Dh)
        v = self.v(context).unflatten(2, (self.num_heads, -1))
        out = attention(q, k, v, backend=self.attention_backend, attn_mask=context_mask)  # (B, L, H, Dh)
        if image_context is not None:
            # Wan and diffusers concatenate [image | text] into one context and split it again here
            # (at context length - 512); we pass the two parts separately, which is the same math.
            k_img = _norm_as(self.norm_k_img, self.k_img(image_context), fused)
            k_img = k_img.unflatten(2, (self.num_heads, -1))  # (B, Li, H, Dh)
            v_img = self.v_img(image_context).unflatten(2, (self.num_heads, -1))
            out = out + attention(q, k_img, v_img, backend=self.attention_backend)  # every image token is real
        return self.o(out.flatten(2))


class ImageEmbedding(nn.Module):
    """Wan's `MLPProj` (`img_emb`): CLIP features (B, Li, image_dim) -> image context (B, Li, D).

    proj = LayerNorm, Linear(image_dim, image_dim), GELU (exact), Linear(image_dim, D), LayerNorm.
    FLF2V (num_images 2) first adds the learned `emb_pos` (1, 2 * image_tokens, image_dim), which tells
    the first frame's tokens from the last frame's.
    """

    def __init__(self, cfg: DiTConfig):
        super().__init__()
        c = cfg.image_dim
        self.proj = nn.Sequential(nn.LayerNorm(c), nn.Linear(c, c), nn.GELU(), nn.Linear(c, cfg.dim),
                                  nn.LayerNorm(cfg.dim))
        self.emb_pos = nn.Parameter(torch.zeros(1, cfg.image_context_len, c)) if cfg.num_images > 1 else None

    def forward(self, clip_fea: torch.Tensor) -> torch.Tensor:
        x = clip_fea.to(self.proj[1].weight.dtype)
        if self.emb_pos is not None:
            x = x + self.emb_pos  # (B, 2 * image_tokens, image_dim)
        cdt = compute_dtype_of(x)
        x = norm_to(self.proj[0], x, cdt)  # the LayerNorms in float32, as Wan's under autocast
        x = self.proj[3](self.proj[2](self.proj[1](x)))  # (B, Li, D)
        return norm_to(self.proj[4], x, cdt)


class Block(nn.Module):
    def __init__(self, cfg: DiTConfig):
        super().__init__()
        self.eps = cfg.eps
        self.self_attn = SelfAttention(cfg.dim, cfg.num_heads, cfg.qk_norm, cfg.eps)
        # Wan's names: norm1 before self-attn, norm3 (affine) before cross-attn, norm2 before the FFN.
        self.norm3 = nn.LayerNorm(cfg.dim, eps=cfg.eps) if cfg.cross_attn_norm else nn.Identity()
        self.cross_attn = CrossAttention(cfg.dim, cfg.num_heads, cfg.qk_norm, cfg.eps, image=cfg.image_dim is not None)
        self.ffn = nn.Sequential(nn.Linear(cfg.dim, cfg.ffn_dim), nn.GELU(approximate="tanh"),
                                 nn.Linear(cfg.ffn_dim, cfg.dim))
        self.modulation = nn.Parameter(torch.empty(1, 6, cfg.dim))
        self.recompute = True  # RecomputeSaved inside the block; VideoDiT turns it off under checkpointing
        self.kernels = "auto"  # adaLN LayerNorm + modulation as one fused op or the torch path (video_dit.kernels)

    def forward(self, x, e0, context, rope, context_mask=None, seq_parallel=None, image_context=None):
        """x (B, L, D) the residual stream (float32 from the first gated add on; the patch tokens
        entering block 0 are in the compute dtype); e0 (B, T, 6, D) float32, T in {1, L};
        context (B, Lt, D); image_context (B, Li, D) or None -> (B, L, D) float32."""
        cdt = compute_dtype_of(context)  # the Linears' dtype: bf16 under a bf16 DiT's autocast
        with torch.autocast(x.device.type, enabled=False):
            # float32 region: the six adaLN vectors (Wan: `with autocast(dtype=float32)`)
            shift1, scale1, gate1, shift2, scale2, gate2 = (f32(self.modulation).unsqueeze(1) + e0).unbind(2)
        # recipes only when kept (`recompute`, grad on): a compiled block records none, whose strides and storage
        # offsets torch.compile cannot trace (a graph break per recipe: 12 breaks, 17 graphs in one block)
        eps, fused = self.eps, use_fused(self.kernels, x)
        rc = RecomputeSaved(active=self.recompute and torch.is_grad_enabled())
        with rc.hooks() if rc.active else contextlib.nullcontext():
            h = modulate(x, shift1, scale1, eps, cdt, rc, fused)
            h = rc.add(h, modulate, x, shift1, scale1, eps, cdt, None, fused)
            y = self.self_attn(h, rope, seq_parallel, rc)
            x = rc.add(gated_add(x, y, gate1), gated_add, x, y, gate1)  # x, y are kept anyway
            if isinstance(self.norm3, nn.LayerNorm):
                c = rc.add(norm_to(self.norm3, x, cdt), norm_to, self.norm3, x, cdt)
            else:
                c = x.to(cdt)
            x = x + self.cross_attn(c, context, context_mask, rc, image_context)  # float32 + compute dtype
            h = modulate(x, shift2, scale2, eps, cdt, rc, fused)
            h = rc.add(h, modulate, x, shift2, scale2, eps, cdt, None, fused)
            h = self.ffn[0](h)  # (B, L, ffn_dim)
            g = rc.add(self.ffn[1](h), self.ffn[1], h)  # ffn.2 saves only a recipe of its GELU input
            x = gated_add(x, self.ffn[2](g), gate2)
        return x


class Head(nn.Module):
    def __init__(self, cfg: DiTConfig):
        super().__init__()
        self.eps = cfg.eps
        self.head = nn.Linear(cfg.dim, cfg.out_dim * math.prod(cfg.patch_size))
        self.modulation = nn.Parameter(torch.empty(1, 2, cfg.dim))
        self.kernels = "auto"  # its LayerNorm + modulation fused or not (video_dit.kernels)

    def forward(self, x: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        """x (B, L, D), e (B, T, D) float32 -> (B, L, out_dim * pt*ph*pw) in the head's weight dtype."""
        # float32 region: modulation, norm and the output Linear (Wan runs its head under autocast(float32))
        with torch.autocast(x.device.type, enabled=False):
            shift, scale = (f32(self.modulation).unsqueeze(1) + e.unsqueeze(2)).unbind(2)  # (B, T, D) each
            fused = use_fused(self.kernels, x)
            return self.head(modulate(x, shift, scale, self.eps, self.head.weight.dtype, fused=fused))
