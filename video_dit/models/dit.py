"""The 3D-latent video DiT: the Wan 2.1 / 2.2 transformer, written from the math.

    x (B, in_dim, F', h, w) latents        timestep (B,) or (B, L) on 0..1000     context (B, Lt, text_dim)
      -> patch_embedding Conv3d (1,2,2)     -> sinusoid(freq_dim) -> time_embedding  -> text_embedding MLP
      -> tokens (B, L, D), L = F'*h/2*w/2      e (B, T, D), T = 1 or L (fp32)          -> (B, Lt, D)
         RoPE tables (1, L, 1, Dh/2)        -> time_projection -> e0 (B, T, 6, D)
                                            clip_fea (B, Li, image_dim), Wan 2.1 I2V / FLF2V only
                                              (+ emb_pos for FLF2V) -> img_emb MLP  -> (B, Li, D)
      -> num_layers x Block:
           x += gate1 * self_attn(LN(x) * (1 + scale1) + shift1)   q/k RMSNorm across heads, 3D RoPE
           x += cross_attn(LN_affine(x), context)                   q/k RMSNorm, no RoPE
                [image branch: + attention(q, k_img, v_img) over the image tokens, before `o`]
           x += gate2 * ffn(LN(x) * (1 + scale2) + shift2)          Linear -> GELU(tanh) -> Linear
      -> head: LN(x) * (1 + scale) + shift -> Linear(D, out_dim * 1*2*2)      (B, L, out_dim*4)
      -> unpatchify                                                             (B, out_dim, F', h, w)

Precision, as Wan's own code runs it (float32 weights under bf16 autocast): the Linears, the patch
Conv3d and attention compute in the model's compute dtype (bf16: `cast_dit`, torch autocast), while
the float32 islands stay float32 in storage and arithmetic: the sinusoid, `time_embedding`,
`time_projection`, every `modulation` table, the norms, the adaLN arithmetic, the residual stream
with its gated updates (`x + y * gate`), and the head. `FLOAT32_MODULES` / `param_dtypes` /
`cast_dit` (end of this file) are the one statement of which parameters stay float32.

Parameter names are the original Wan checkpoint names, so a LoRA on these modules maps 1:1 to the
ComfyUI `diffusion_model.` convention. Sequence parallelism plugs in through `VideoDiT.seq_parallel`
(see `VideoDiT.forward`); this file holds no distributed code.
"""

from __future__ import annotations

import contextlib
import difflib
import hashlib
import math
import weakref
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from video_dit.models.attention import attention, set_attention_backend


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


# ---------------------------------------------------------------- embeddings and RoPE


def sinusoidal_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    """(N,) timesteps on 0..1000 -> (N, dim) float32 [cos | sin], frequencies 10000^(-i/half)."""
    half = dim // 2
    freqs = torch.pow(10000.0, -torch.arange(half, dtype=torch.float64, device=t.device) / half)
    angles = torch.outer(t.to(torch.float64), freqs)  # (N, half)
    return torch.cat([angles.cos(), angles.sin()], dim=1).float()


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
             rc=None) -> torch.Tensor:
    """LayerNorm(x) * (1 + scale) + shift; x (B, L, D), shift/scale (B, T, D) float32, T in {1, L}.
    float32 region: the adaLN math (Wan: `norm(x).float() * (1 + e) + e`; bf16 here visibly degrades
    the pretrained models); the result goes to `dtype`, the next Linear's compute dtype.
    `rc`: a RecomputeSaved that stores the normed x as a recipe."""
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


# ---------------------------------------------------------------- activation memory


class RecomputeSaved:
    """Autograd saves some cheap elementwise results for backward (the GELU output that `ffn.2`
    keeps for its weight gradient, the adaLN-modulated inputs the Linears keep). Registered
    tensors are saved as a recipe (function + its inputs, which autograd keeps anyway) and
    recomputed during backward: the same math, a fraction of the activation memory. Works with
    any module (LoRA, quanto) because it only swaps what autograd stores, not what runs.

    Only active outside activation checkpointing (which already stores nothing inside a block).
    """

    def __init__(self):
        self.entries: list[tuple[weakref.ref, object, tuple]] = []

    def add(self, out: torch.Tensor, fn, *inputs) -> torch.Tensor:
        self.entries.append((weakref.ref(out), fn, inputs))
        return out

    def pack(self, t: torch.Tensor):
        if type(t) not in (torch.Tensor, nn.Parameter):  # tensor subclasses (quantized weights) as they are
            return t
        for ref, fn, inputs in self.entries:
            out = ref()
            if (out is not None and t.dtype == out.dtype and t.device == out.device
                    and t.untyped_storage().data_ptr() == out.untyped_storage().data_ptr()):
                view = (t.size(), t.stride(), t.storage_offset() - out.storage_offset())
                return (fn, inputs, out.stride(), view)
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


# ---------------------------------------------------------------- network


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _RMSNormFn.apply(x, self.weight, self.eps)


class SelfAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int, qk_norm: bool, eps: float):
        super().__init__()
        self.num_heads = num_heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))
        self.norm_q = RMSNorm(dim, eps) if qk_norm else nn.Identity()  # across all heads
        self.norm_k = RMSNorm(dim, eps) if qk_norm else nn.Identity()
        self.attention_backend = "native"

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
        return apply_rope(norm(t).unflatten(2, (self.num_heads, -1)), cos, sin).to(t.dtype)  # (B, L, H, Dh)


def _norm_as(norm: nn.Module, t: torch.Tensor) -> torch.Tensor:
    """norm(t) in t's dtype (the norm's float32 weight would otherwise promote it)."""
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

    def forward(self, x: torch.Tensor, context: torch.Tensor, context_mask: torch.Tensor | None = None,
                rc: RecomputeSaved | None = None, image_context: torch.Tensor | None = None):
        """x (B, L, D), context (B, Lt, D), context_mask (B, Lt) bool or None (text only),
        image_context (B, Li, D) for the image branch -> (B, L, D)."""
        rc = rc or RecomputeSaved()
        q = self.q(x)
        q = rc.add(_norm_as(self.norm_q, q), _norm_as, self.norm_q, q)
        q = q.unflatten(2, (self.num_heads, -1))  # (B, L, H, Dh)
        k = self.k(context)
        k = _norm_as(self.norm_k, k).unflatten(2, (self.num_heads, -1))  # (B, Lt, H, Dh)
        v = self.v(context).unflatten(2, (self.num_heads, -1))
        out = attention(q, k, v, backend=self.attention_backend, attn_mask=context_mask)  # (B, L, H, Dh)
        if image_context is not None:
            # Wan and diffusers concatenate [image | text] into one context and split it again here
            # (at context length - 512); we pass the two parts separately, which is the same math.
            k_img = _norm_as(self.norm_k_img, self.k_img(image_context))
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

    def forward(self, x, e0, context, rope, context_mask=None, seq_parallel=None, image_context=None):
        """x (B, L, D) the residual stream (float32 from the first gated add on; the patch tokens
        entering block 0 are in the compute dtype); e0 (B, T, 6, D) float32, T in {1, L};
        context (B, Lt, D); image_context (B, Li, D) or None -> (B, L, D) float32."""
        cdt = compute_dtype_of(context)  # the Linears' dtype: bf16 under a bf16 DiT's autocast
        with torch.autocast(x.device.type, enabled=False):
            # float32 region: the six adaLN vectors (Wan: `with autocast(dtype=float32)`)
            shift1, scale1, gate1, shift2, scale2, gate2 = (f32(self.modulation).unsqueeze(1) + e0).unbind(2)
        eps, rc = self.eps, RecomputeSaved()
        with rc.hooks() if self.recompute and torch.is_grad_enabled() else contextlib.nullcontext():
            h = rc.add(modulate(x, shift1, scale1, eps, cdt, rc), modulate, x, shift1, scale1, eps, cdt)
            y = self.self_attn(h, rope, seq_parallel, rc)
            x = rc.add(gated_add(x, y, gate1), gated_add, x, y, gate1)  # x, y are kept anyway
            if isinstance(self.norm3, nn.LayerNorm):
                c = rc.add(norm_to(self.norm3, x, cdt), norm_to, self.norm3, x, cdt)
            else:
                c = x.to(cdt)
            x = x + self.cross_attn(c, context, context_mask, rc, image_context)  # float32 + compute dtype
            h = rc.add(modulate(x, shift2, scale2, eps, cdt, rc), modulate, x, shift2, scale2, eps, cdt)
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

    def forward(self, x: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        """x (B, L, D), e (B, T, D) float32 -> (B, L, out_dim * pt*ph*pw) in the head's weight dtype."""
        # float32 region: modulation, norm and the output Linear (Wan runs its head under autocast(float32))
        with torch.autocast(x.device.type, enabled=False):
            shift, scale = (f32(self.modulation).unsqueeze(1) + e.unsqueeze(2)).unbind(2)  # (B, T, D) each
            return self.head(modulate(x, shift, scale, self.eps, self.head.weight.dtype))


# ---------------------------------------------------------------- initialisation


def parameter_generator(seed: int, name: str) -> torch.Generator:
    """The CPU generator of one parameter's initial values: seeded by (seed, parameter name)."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2 ** 63 - 1))


@torch.no_grad()
def init_parameter(config: DiTConfig, name: str, t: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Wan's initial value of the parameter called `name` (native names), written into `t` in place.
    Drawn in float32 on the CPU from `generator` and then copied, so every dtype and device gets the
    same numbers. A name no rule covers is an error: a new parameter needs its rule here."""
    values = torch.empty(t.shape, dtype=torch.float32)
    if name == "head.head.weight":  # output layer zeroed: a fresh model predicts 0
        values.zero_()
    elif name.endswith("modulation"):  # adaLN tables: random unit-scale per channel (added to the time projection)
        values.normal_(std=config.dim ** -0.5, generator=generator)
    elif name.startswith(("text_embedding.", "time_embedding.")) and name.endswith(".weight"):
        values.normal_(std=0.02, generator=generator)  # text and time MLPs: small normal weights
    elif name == "img_emb.emb_pos":  # FLF2V's image position embedding starts at zero (Wan)
        values.zero_()
    elif name == "patch_embedding.weight":  # Xavier over the flattened (in_dim * patch) fan-in, like a Linear
        nn.init.xavier_uniform_(values.flatten(1), generator=generator)
    elif name.endswith(".bias"):  # every Linear / conv / norm bias
        values.zero_()
    elif name.endswith(".weight") and t.dim() == 1:  # RMSNorm / LayerNorm scales
        values.fill_(1.0)
    elif name.endswith(".weight") and t.dim() == 2:  # every other Linear: Xavier-uniform
        nn.init.xavier_uniform_(values, generator=generator)
    else:
        raise ValueError(f"init_parameter: no initialisation rule for DiT parameter {name!r} {tuple(t.shape)}")
    return t.copy_(values)


class VideoDiT(nn.Module):
    """The Wan 2.x DiT. Build on the meta device and materialise with
    `load_state_dict(sd, assign=True)` (see `video_dit.models.loading.load_dit`).

    Sequence-parallel seam: `model.seq_parallel = sp` (None = off), where `sp` has
      split(t, dim) -> this rank's slice of t along dim,
      attention(q, k, v) -> out, all (B, L_local, H, Dh), q/k already RMS-normed and rotated,
      gather(t, dim) -> the full tensor from every rank's slice.
    forward splits the tokens (B, L, D), the RoPE tables (1, L, 1, Dh/2) and per-token time
    vectors (B, L, ...) along dim 1 right after the embeddings (broadcast (B, 1, ...) ones stay
    whole), every self-attention calls `sp.attention` instead of the local kernel, and the head
    output is gathered along dim 1 before unpatchify. Cross-attention, FFN and modulation stay
    local; padding to a multiple of the ranks is the sp object's business.
    """

    def __init__(self, config: DiTConfig, init_seed: int | None = None):
        super().__init__()
        cfg = self.config = config
        self.patch_embedding = nn.Conv3d(cfg.in_dim, cfg.dim, kernel_size=cfg.patch_size, stride=cfg.patch_size)
        self.text_embedding = nn.Sequential(nn.Linear(cfg.text_dim, cfg.dim), nn.GELU(approximate="tanh"),
                                            nn.Linear(cfg.dim, cfg.dim))
        self.time_embedding = nn.Sequential(nn.Linear(cfg.freq_dim, cfg.dim), nn.SiLU(), nn.Linear(cfg.dim, cfg.dim))
        self.time_projection = nn.Sequential(nn.SiLU(), nn.Linear(cfg.dim, 6 * cfg.dim))
        self.img_emb = ImageEmbedding(cfg) if cfg.image_dim is not None else None  # Wan 2.1 I2V / FLF2V
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.head = Head(cfg)
        self.gradient_checkpointing = False
        self.offload_checkpoints = False
        self.seq_parallel = None  # set from outside (video_dit/parallel); see forward()
        self.compute_dtype: torch.dtype | None = None  # None: the bulk weights' dtype; set by cast_dit
        self._rope_cache: dict = {}
        self.initialize_weights(init_seed)

    # -------------------------------------------------------------- set-up

    @torch.no_grad()
    def initialize_weights(self, seed: int | None = None) -> None:
        """Wan's initialisation, one parameter at a time by name (`init_parameter`), each from its own
        generator seeded by (`seed`, name): the same values whatever order or device the parameters
        are made in (a ZeRO-3 build materialises them one module at a time). `seed=None` draws the
        seed from torch's global RNG, so `torch.manual_seed(s); VideoDiT(cfg)` stays reproducible.
        A no-op on the meta device."""
        params = [(n, p) for n, p in self.named_parameters() if p.device.type != "meta"]
        if params and seed is None:
            seed = int(torch.randint(0, 2 ** 62, (), device="cpu").item())
        for name, p in params:
            init_parameter(self.config, name, p, parameter_generator(seed, name))

    @property
    def device(self) -> torch.device:
        return self.patch_embedding.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The bulk weights' storage dtype (the float32 islands aside; see `cast_dit`)."""
        return self.patch_embedding.weight.dtype

    def precision(self, device_type: str):
        """The forward's context: a bf16 / fp16 DiT (`compute_dtype`, else its bulk weights' dtype)
        runs under torch autocast in that dtype, as Wan runs its model; its weight cache is off (each
        weight is used once per forward; the cache would keep a low-precision copy of every weight
        until the forward ends). A float32 / float64 DiT adds nothing: a caller's autocast applies."""
        dtype = self.compute_dtype or self.dtype
        if dtype in (torch.bfloat16, torch.float16):
            return torch.autocast(device_type, dtype=dtype, cache_enabled=False)
        return contextlib.nullcontext()

    def enable_gradient_checkpointing(self, offload: bool = False) -> None:
        """Re-run each block in backward (when grad is enabled). `offload`: keep the saved block
        inputs in CPU memory (pinned on CUDA) instead of on the device, for long videos."""
        self.gradient_checkpointing = True
        self.offload_checkpoints = offload
        for block in self.blocks:  # a checkpointed block stores nothing inside, so nothing to recompute
            block.recompute = False

    def disable_gradient_checkpointing(self) -> None:
        self.gradient_checkpointing = False
        self.offload_checkpoints = False
        for block in self.blocks:
            block.recompute = True

    def set_attention_backend(self, backend: str) -> "VideoDiT":
        """"native" (torch SDPA) or "flash" (flash-attn; a clear error when it is not installed)."""
        return set_attention_backend(self, backend)

    # -------------------------------------------------------------- forward

    def _rope(self, grid: tuple[int, int, int], device) -> tuple[torch.Tensor, torch.Tensor]:
        key = (grid, str(device))
        if key not in self._rope_cache:
            self._rope_cache[key] = rope_tables(grid, self.config.head_dim, device=device)
        return self._rope_cache[key]

    def _pad_context(self, context) -> torch.Tensor:
        cfg = self.config
        if isinstance(context, (list, tuple)):
            for i, u in enumerate(context):
                if u.dim() != 2 or u.shape[1] != cfg.text_dim or u.shape[0] > cfg.text_len:
                    raise ValueError(f"context[{i}] has shape {tuple(u.shape)}; expected (L_i <= text_len="
                                     f"{cfg.text_len}, text_dim={cfg.text_dim})")
            # Zero-pad each prompt to text_len, as the pretrained Wan models were trained.
            context = torch.stack([F.pad(u, (0, 0, 0, cfg.text_len - u.shape[0])) for u in context])
        if context.dim() != 3 or context.shape[-1] != cfg.text_dim:
            raise ValueError(f"context has shape {tuple(context.shape)}; expected (B, Lt, text_dim={cfg.text_dim}) "
                             "or a list of (L_i, text_dim) tensors")
        return context.to(self.dtype)

    def _image_context(self, clip_fea: torch.Tensor | None, B: int) -> torch.Tensor | None:
        cfg = self.config
        if cfg.image_dim is None:
            if clip_fea is not None:
                raise ValueError("clip_fea was given, but this DiT has no image branch (config.image_dim is None)")
            return None
        want = (B, cfg.image_context_len, cfg.image_dim)
        if clip_fea is None or tuple(clip_fea.shape) != want:
            got = None if clip_fea is None else tuple(clip_fea.shape)
            raise ValueError(f"this DiT has the CLIP image branch: clip_fea must be {want} (B, num_images="
                             f"{cfg.num_images} x {cfg.image_tokens} tokens, image_dim), got {got}")
        return self.img_emb(clip_fea)  # (B, Li, D)

    def forward(self, x: torch.Tensor, timestep: torch.Tensor, context, context_mask: torch.Tensor | None = None,
                clip_fea: torch.Tensor | None = None):
        """Velocity prediction of the Wan models.

        x: (B, in_dim, F', h, w) latents, h and w divisible by the spatial patch; cast to the model dtype.
        timestep: (B,) or per-token (B, L) on the 0..1000 scale (1000 = pure noise); L = F' * h/2 * w/2.
        context: (B, Lt, text_dim) or a list of B (L_i, text_dim) tensors, zero-padded to text_len.
        context_mask: optional (B, Lt) bool, True = attend (for models trained with it; pretrained Wan
            models were trained without a mask).
        clip_fea: (B, Li, image_dim) CLIP features (penultimate block), required exactly when the config
            has an image branch: Li = 257 (I2V, the first frame) or 514 (FLF2V, [first | last] per sample;
            Wan passes FLF2V features as (2B, 257, .) and views them as (B, 514, .)).
        Returns (B, out_dim, F', h, w) in the head's weight dtype (float32 unless the whole model was cast).
        """
        with self.precision(x.device.type):
            return self._forward(x, timestep, context, context_mask, clip_fea)

    def _forward(self, x, timestep, context, context_mask, clip_fea):
        cfg = self.config
        B, C, Fr, H, W = x.shape
        pt, ph, pw = cfg.patch_size
        if C != cfg.in_dim or Fr % pt or H % ph or W % pw:
            raise ValueError(f"x has shape {tuple(x.shape)}; expected (B, in_dim={cfg.in_dim}, F', h, w) with "
                             f"F', h, w divisible by patch_size={cfg.patch_size}")
        grid = (Fr // pt, H // ph, W // pw)
        L = math.prod(grid)

        x = self.patch_embedding(x.to(self.dtype)).flatten(2).transpose(1, 2).contiguous()  # (B, L, D) compute dtype
        rope = self._rope(grid, x.device)  # (cos, sin), each (1, L, 1, Dh/2)

        if timestep.numel() not in (B, B * L):
            raise ValueError(f"timestep has shape {tuple(timestep.shape)}; expected ({B},) or per-token ({B}, {L})")
        t = timestep.reshape(B, -1)  # (B, T), T = 1 or L
        T = t.shape[1]
        # float32 region: the sinusoid and the time MLPs, in their float32 weights (Wan: autocast(float32));
        # they run in their weights' dtype, so a wholly cast model computes them in that dtype.
        with torch.autocast(x.device.type, enabled=False):
            sinusoid = sinusoidal_embedding(t.flatten(), cfg.freq_dim)  # (B*T, freq_dim) fp32
            e = self.time_embedding(sinusoid.to(self.time_embedding[0].weight.dtype))  # (B*T, D)
            e0 = self.time_projection(e.to(self.time_projection[1].weight.dtype))  # (B*T, 6D)
            e0 = f32(e0).view(B, T, 6, cfg.dim)  # (B, T, 6, D) fp32
            e = f32(e).view(B, T, cfg.dim)  # (B, T, D) fp32

        context = self.text_embedding(self._pad_context(context))  # (B, Lt, D)
        image_context = self._image_context(clip_fea, B)  # (B, Li, D) or None

        sp = self.seq_parallel
        if sp is not None:  # tokens, their RoPE rows and per-token time vectors go to their rank
            x = sp.split(x, dim=1)  # (B, L_local, D)
            rope = tuple(sp.split(r, dim=1) for r in rope)
            if T > 1:
                e, e0 = sp.split(e, dim=1), sp.split(e0, dim=1)

        for block in self.blocks:
            args = (x, e0, context, rope, context_mask, sp, image_context)
            if self.gradient_checkpointing and torch.is_grad_enabled():
                # save_on_cpu moves the checkpoint's saved inputs (this block's x) to host memory.
                offload = torch.autograd.graph.save_on_cpu(pin_memory=x.is_cuda) if self.offload_checkpoints \
                    else contextlib.nullcontext()
                with offload:
                    x = checkpoint(block, *args, use_reentrant=False)
            else:
                x = block(*args)

        x = self.head(x, e)  # (B, L_local, out_dim * pt*ph*pw)
        if sp is not None:
            x = sp.gather(x, dim=1)  # (B, L, out_dim * pt*ph*pw)

        x = x.view(B, *grid, pt, ph, pw, cfg.out_dim)  # unpatchify
        x = x.permute(0, 7, 1, 4, 2, 5, 3, 6)  # (B, C, F', pt, h', ph, w', pw)
        return x.reshape(B, cfg.out_dim, Fr, H, W)


# ---------------------------------------------------------------- precision: the float32 islands

# Sub-modules kept whole in float32 in a bf16 DiT. Wan's own code holds every weight in float32 and
# runs these under `autocast(dtype=float32)` (wan/modules/model.py: the time embedding and projection
# in WanModel.forward, the head in Head.forward); diffusers keeps `time_embedder` (its time_proj is
# bf16: we follow Wan) in float32 through `_keep_in_fp32_modules` (transformer_wan.py).
FLOAT32_MODULES = ("time_embedding", "time_projection", "head")
# Parameters kept in float32 wherever they sit, by name: every block's and the head's adaLN table
# (diffusers' `scale_shift_table`).
FLOAT32_PARAMS = ("modulation",)
# ... and every parameter of a norm (diffusers keeps norm1-3; Wan's are float32 like all its weights).
FLOAT32_NORMS = (nn.LayerNorm, RMSNorm)


def float32_param_names(model: nn.Module) -> set[str]:
    """Names of the parameters a DiT stores in float32 whatever dtype it computes in."""
    names = set()
    for module_name, module in model.named_modules():
        whole = module_name.split(".")[0] in FLOAT32_MODULES or isinstance(module, FLOAT32_NORMS)
        for name, _ in module.named_parameters(recurse=False):
            if whole or name in FLOAT32_PARAMS:
                names.add(f"{module_name}.{name}" if module_name else name)
    return names


def param_dtypes(model: nn.Module, dtype: torch.dtype, masters: bool = False) -> dict[str, torch.dtype]:
    """The storage dtype of each floating parameter of a DiT that computes in `dtype`: float32 for
    the float32 islands (`float32_param_names`), and with `masters` for every parameter that
    requires grad (the optimizer then updates float32 master weights in place, as Wan-style fp32
    weights under bf16 autocast train); `dtype` for the rest (frozen bulk weights, inference).
    Every way of building a DiT (loading, the trainer, a partitioned constructor) stores these."""
    keep = float32_param_names(model) if dtype != torch.float32 else set()
    out = {}
    for name, p in model.named_parameters():
        if p.is_floating_point():
            out[name] = torch.promote_types(dtype, torch.float32) if name in keep or (masters and p.requires_grad) \
                else dtype
    return out


def cast_dit(model: nn.Module, dtype: torch.dtype, masters: bool = False) -> nn.Module:
    """Cast a DiT for computing in `dtype`, in place: each parameter to `param_dtypes(model, dtype,
    masters)`, and `model.compute_dtype = dtype`, so its forward runs the bulk under `dtype` autocast
    and the float32 islands in float32. `cast_dit(m, torch.float32)` is a plain float32 model.
    (`model.to(torch.bfloat16)` instead casts every parameter: the pure-bf16 baseline of
    `video-dit bench --suite precision`.)"""
    dtypes = param_dtypes(model, dtype, masters)
    for name, p in model.named_parameters():
        if name in dtypes and p.dtype != dtypes[name]:
            p.data = p.data.to(dtypes[name])
    model.compute_dtype = dtype if dtype in (torch.bfloat16, torch.float16) else None
    return model


def dit_flops(config: DiTConfig, num_tokens: int, text_len: int, batch: int = 1) -> float:
    """Analytic forward FLOPs (2 per multiply-add) of matmuls and attention; backward is ~2x this."""
    D, Fd, L, Lt, Li = config.dim, config.ffn_dim, num_tokens, text_len, config.image_context_len
    patch = math.prod(config.patch_size)
    per_block = (
        2 * L * D * 4 * D  # self-attn q, k, v, o
        + 4 * L * L * D  # self-attn scores and weighted sum
        + 2 * L * D * 2 * D + 2 * Lt * D * 2 * D  # cross-attn q, o on video; k, v on text
        + 4 * L * Lt * D  # cross-attn scores and weighted sum
        + 2 * Li * D * 2 * D + 4 * L * Li * D  # image branch: k_img, v_img; its scores and weighted sum
        + 2 * L * D * Fd * 2  # FFN
    )
    embed = (2 * L * D * config.in_dim * patch  # patch embedding
             + 2 * Lt * D * (config.text_dim + D)  # text MLP
             + 2 * Li * (config.image_dim or 0) * ((config.image_dim or 0) + D)  # image MLP (img_emb)
             + 2 * D * (config.freq_dim + D + 6 * D)  # time MLP + projection (one timestep)
             + 2 * L * D * config.out_dim * patch)  # head
    return float(batch * (config.num_layers * per_block + embed))
