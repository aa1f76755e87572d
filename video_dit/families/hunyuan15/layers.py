"""The HunyuanVideo 1.5 DiT's layers, used by `dit.py`'s `HunyuanVideo15DiT`:

    hy15_rope_tables    3D RoPE tables for the video tokens, bands (t, h, w) = rope_dim_list, theta 256
    timestep_sinusoid   Tencent's float32 [cos | sin] timestep features             (B,) -> (B, 256)
    TimestepEmbedder    sinusoid(256) -> Linear -> SiLU -> Linear            (B,) -> (B, D)         float32 island
    SingleTokenRefiner  the MLLM text's token refiner (`txt_in`)             (B, Lt, text_dim) -> (B, Lt, D)
    ByT5Mapper          the glyph (ByT5) projection (`byt5_in`)              (B, Lg, byt5_dim) -> (B, Lg, D)
    VisionProjection    the SigLIP projection (`vision_in`)                  (B, Li, vision_dim) -> (B, Li, D)
    DoubleStreamBlock   video and text streams, each with its own weights, one joint attention
                                                                             (B, L, D), (B, Lt, D) -> same
    FinalLayer          adaLN, Linear(D, out_channels * pt*ph*pw)            (B, L, D) -> (B, L, C_out*pt*ph*pw)

Parameter names are Tencent's checkpoint names (hyvideo/models/transformers/). The adaLN and residual
arithmetic (`modulate`, `gated_add`), RMSNorm and `apply_rope` are the family-neutral ones of `video_dit/models/layers.py`:
HunyuanVideo 1.5 uses the same math (LayerNorm eps 1e-6 without affine, x * (1 + scale) + shift,
adjacent-pair RoPE). No distributed code here.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from video_dit.families.hunyuan15.config import HY15DiTConfig
from video_dit.models.attention import attention, joint_attention
from video_dit.models.layers import RMSNorm, apply_rope, f32, gated_add, modulate, norm_to

EPS = 1e-6  # every LayerNorm / RMSNorm of the blocks, refiner and final layer (Tencent)
REFINER_MLP_RATIO = 4.0  # Tencent's SingleTokenRefiner default, whatever the main blocks' ratio


def hy15_rope_tables(grid: tuple[int, int, int], rope_dims: tuple[int, int, int], theta: float, device=None):
    """Real RoPE tables for a (F', h', w') token grid: (cos, sin), each (1, L, 1, Dh/2) float32.

    The head dim is split into frame / height / width bands of rope_dims channels (Tencent: [16, 56, 56]),
    each with its own ladder 1 / theta^(2i / band); row i is the token at row-major position i of the grid
    (Tencent's meshgrid, indexing "ij"), so the tables can be split along tokens (dim 1)."""
    parts = []
    for axis, (n, d) in enumerate(zip(grid, rope_dims)):
        inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64, device=device) / d)
        angle = torch.outer(torch.arange(n, dtype=torch.float64, device=device), inv_freq)  # (n, d/2)
        shape = [1, 1, 1, d // 2]
        shape[axis] = n
        parts.append(angle.view(shape).expand(*grid, d // 2))
    angles = torch.cat(parts, dim=-1).reshape(1, math.prod(grid), 1, sum(rope_dims) // 2)  # (1, L, 1, Dh/2)
    return angles.cos().float(), angles.sin().float()


class MLP(nn.Module):
    """fc1 -> act -> fc2 (Tencent's `MLP`, parameter names fc1 / fc2)."""

    def __init__(self, dim: int, hidden: int, act: nn.Module, bias: bool = True):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden, bias=bias)
        self.act = act
        self.fc2 = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def timestep_sinusoid(t: torch.Tensor, dim: int = 256) -> torch.Tensor:
    """(N,) timesteps on 0..1000 -> (N, dim) float32 [cos | sin], frequencies 10000^(-i/half), computed in
    float32 as Tencent's `timestep_embedding` (and diffusers') computes it: at t ~ 1000 its rounding is
    ~1e-4 rad, part of what the weights were trained with (Wan's sinusoid, in float64, differs by that)."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    angles = t.float()[:, None] * freqs[None]  # (N, half)
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


class TimestepEmbedder(nn.Module):
    """Tencent's `TimestepEmbedder`: (B,) timesteps on 0..1000 -> (B, D), `mlp.0` / `mlp.2`."""

    def __init__(self, dim: int, freq_dim: int = 256):
        super().__init__()
        self.freq_dim = freq_dim
        self.mlp = nn.Sequential(nn.Linear(freq_dim, dim), nn.SiLU(), nn.Linear(dim, dim))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        # float32 region: the sinusoid (Tencent: float32) and the MLP in its float32 weights (a float32
        # island here; Tencent runs it in bf16); a wholly cast model computes it in that dtype.
        with torch.autocast(t.device.type, enabled=False):
            sinusoid = timestep_sinusoid(t.flatten(), self.freq_dim)  # (B, 256) fp32
            return self.mlp(sinusoid.to(self.mlp[0].weight.dtype))  # (B, D)


class RefinerBlock(nn.Module):
    """Tencent's `IndividualTokenRefinerBlock`: LayerNorm (affine) self-attention and SiLU MLP over the
    text tokens, each update gated by `adaLN_modulation(c)`; no q/k norm, no RoPE."""

    def __init__(self, dim: int, heads: int, qkv_bias: bool = True):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim, eps=EPS)
        self.self_attn_qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
        self.self_attn_proj = nn.Linear(dim, dim, bias=qkv_bias)
        self.norm2 = nn.LayerNorm(dim, eps=EPS)
        self.mlp = MLP(dim, int(dim * REFINER_MLP_RATIO), nn.SiLU())
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(dim, 2 * dim))
        self.attention_backend = "native"

    def forward(self, x: torch.Tensor, c: torch.Tensor, key_mask: torch.Tensor | None, cdt: torch.dtype):
        """x (B, Lt, D), c (B, D) float32, key_mask (B, Lt) bool or None -> (B, Lt, D) float32."""
        gate_msa, gate_mlp = f32(self.adaLN_modulation(c.to(cdt))).unsqueeze(1).chunk(2, dim=-1)  # (B, 1, D) each
        qkv = self.self_attn_qkv(norm_to(self.norm1, x, cdt))  # (B, Lt, 3D), laid out [q | k | v]
        q, k, v = qkv.unflatten(2, (3, self.heads, -1)).unbind(2)  # (B, Lt, H, Dh) each
        out = attention(q, k, v, backend=self.attention_backend, attn_mask=key_mask)
        x = gated_add(x, self.self_attn_proj(out.flatten(2)), gate_msa)
        return gated_add(x, self.mlp(norm_to(self.norm2, x, cdt)), gate_mlp)


class TextProjection(nn.Module):
    """Tencent's `TextProjection` (`c_embedder`): linear_1 -> SiLU -> linear_2."""

    def __init__(self, in_dim: int, dim: int):
        super().__init__()
        self.linear_1 = nn.Linear(in_dim, dim)
        self.linear_2 = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.silu(self.linear_1(x)))


class IndividualTokenRefiner(nn.Module):
    def __init__(self, dim: int, heads: int, depth: int):
        super().__init__()
        self.blocks = nn.ModuleList(RefinerBlock(dim, heads) for _ in range(depth))


class SingleTokenRefiner(nn.Module):
    """Tencent's `SingleTokenRefiner` (`txt_in`): the MLLM hidden states -> refined text tokens.

        c = t_embedder(t) + c_embedder(masked mean of x over its valid tokens)   (B, D)
        x = input_embedder(x) -> depth x RefinerBlock(x, c)                       (B, Lt, D)
    """

    def __init__(self, text_dim: int, dim: int, heads: int, depth: int):
        super().__init__()
        self.input_embedder = nn.Linear(text_dim, dim)
        self.t_embedder = TimestepEmbedder(dim)
        self.c_embedder = TextProjection(text_dim, dim)
        self.individual_token_refiner = IndividualTokenRefiner(dim, heads, depth)

    def forward(self, x: torch.Tensor, t: torch.Tensor, mask: torch.Tensor | None, cdt: torch.dtype):
        """x (B, Lt, text_dim), t (B,) on 0..1000, mask (B, Lt) bool or None (all valid) -> (B, Lt, D) float32."""
        with torch.autocast(x.device.type, enabled=False):  # float32 region: the masked mean (Tencent: float32)
            xf = f32(x)
            if mask is None:
                pooled = xf.mean(dim=1)  # (B, text_dim)
            else:
                m = mask.to(xf.dtype).unsqueeze(-1)  # (B, Lt, 1)
                pooled = (xf * m).sum(dim=1) / m.sum(dim=1)
        c = f32(self.t_embedder(t)) + f32(self.c_embedder(pooled.to(cdt)))  # (B, D)
        key_mask = None
        if mask is not None:
            # Tencent lets every query see token 0 (`mask[:, 0] = True`), so a prompt whose mask is all
            # False attends somewhere instead of giving NaN; with right-padded prompts it changes nothing.
            key_mask = mask.clone()
            key_mask[:, 0] = True
        x = self.input_embedder(x.to(cdt))  # (B, Lt, D)
        for block in self.individual_token_refiner.blocks:
            x = block(x, c, key_mask, cdt)
        return x


class ByT5Mapper(nn.Module):
    """Tencent's `ByT5Mapper` (`byt5_in`, use_residual=False): LayerNorm -> fc1 -> GELU -> fc2 -> GELU -> fc3."""

    def __init__(self, in_dim: int, hidden: int, dim: int):
        super().__init__()
        self.layernorm = nn.LayerNorm(in_dim)  # eps 1e-5 (torch's default, as Tencent)
        self.fc1 = nn.Linear(in_dim, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor, cdt: torch.dtype) -> torch.Tensor:
        """x (B, Lg, byt5_dim) -> (B, Lg, D)."""
        h = norm_to(self.layernorm, x, cdt)  # the LayerNorm in float32 (Tencent: autocast keeps it float32)
        return self.fc3(F.gelu(self.fc2(F.gelu(self.fc1(h)))))


class VisionProjection(nn.Module):
    """Tencent's `VisionProjection` (`vision_in`): proj = LayerNorm, Linear, GELU, Linear, LayerNorm."""

    def __init__(self, in_dim: int, dim: int):
        super().__init__()
        self.proj = nn.Sequential(nn.LayerNorm(in_dim), nn.Linear(in_dim, in_dim), nn.GELU(), nn.Linear(in_dim, dim),
                                  nn.LayerNorm(dim))

    def forward(self, x: torch.Tensor, cdt: torch.dtype) -> torch.Tensor:
        """x (B, Li, vision_dim) SigLIP last hidden states -> (B, Li, D) float32."""
        h = norm_to(self.proj[0], x, cdt)
        h = self.proj[3](self.proj[2](self.proj[1](h)))  # (B, Li, D)
        return norm_to(self.proj[4], h, torch.promote_types(cdt, torch.float32))


class ModulateDiT(nn.Module):
    """Tencent's `ModulateDiT`: SiLU -> Linear(D, factor * D) (`linear`)."""

    def __init__(self, dim: int, factor: int):
        super().__init__()
        self.linear = nn.Linear(dim, factor * dim)

    def forward(self, vec: torch.Tensor, cdt: torch.dtype) -> torch.Tensor:
        """vec (B, D) -> (B, 1, factor * D) float32 (the Linear in the compute dtype, as Tencent's)."""
        return f32(self.linear(F.silu(vec).to(cdt))).unsqueeze(1)



class DoubleStreamBlock(nn.Module):
    """Tencent's `MMDoubleStreamBlock`: the video (`img_`) and text (`txt_`) streams each have their own
    adaLN modulation, q/k/v, per-head q/k RMSNorm, output projection and GELU(tanh) MLP; the two attend
    jointly. RoPE on the video q/k only."""

    def __init__(self, cfg: HY15DiTConfig):
        super().__init__()
        D, bias = cfg.hidden_size, cfg.qkv_bias
        self.heads = cfg.heads_num
        hidden = int(D * cfg.mlp_width_ratio)
        self.img_mod = ModulateDiT(D, 6)
        self.img_attn_q, self.img_attn_k, self.img_attn_v = (nn.Linear(D, D, bias=bias) for _ in range(3))
        self.img_attn_q_norm, self.img_attn_k_norm = RMSNorm(cfg.head_dim, EPS), RMSNorm(cfg.head_dim, EPS)
        self.img_attn_proj = nn.Linear(D, D, bias=bias)
        self.img_mlp = MLP(D, hidden, nn.GELU(approximate="tanh"))
        self.txt_mod = ModulateDiT(D, 6)
        self.txt_attn_q, self.txt_attn_k, self.txt_attn_v = (nn.Linear(D, D, bias=bias) for _ in range(3))
        self.txt_attn_q_norm, self.txt_attn_k_norm = RMSNorm(cfg.head_dim, EPS), RMSNorm(cfg.head_dim, EPS)
        self.txt_attn_proj = nn.Linear(D, D, bias=bias)
        self.txt_mlp = MLP(D, hidden, nn.GELU(approximate="tanh"))
        self.attention_backend = "native"

    def _heads(self, linear: nn.Module, norm: nn.Module, x: torch.Tensor, cdt: torch.dtype, rope=None):
        t = norm(linear(x).unflatten(2, (self.heads, -1)))  # (B, L, H, Dh), float32 with the float32 norm weight
        if rope is not None:
            t = apply_rope(t, *rope)  # rotated in float32 (Tencent: float32)
        return t.to(cdt)

    def forward(self, img, txt, vec, rope, txt_key_mask, cdt, seq_parallel=None):
        """img (B, L, D) video stream, txt (B, Lt, D) text stream (both float32 from their first gated add
        on), vec (B, D) float32, rope = (cos, sin) (1, L, 1, Dh/2) for exactly these L tokens, txt_key_mask
        (B, Lt) bool or None, cdt: the Linears' compute dtype -> (img, txt) float32, same shapes.
        seq_parallel: None, or the parallel layer's `joint_attention` (see `HunyuanVideo15DiT`)."""
        i_shift1, i_scale1, i_gate1, i_shift2, i_scale2, i_gate2 = self.img_mod(vec, cdt).chunk(6, -1)  # (B, 1, D)
        t_shift1, t_scale1, t_gate1, t_shift2, t_scale2, t_gate2 = self.txt_mod(vec, cdt).chunk(6, -1)

        h = modulate(img, i_shift1, i_scale1, EPS, cdt)  # (B, L, D): LayerNorm and adaLN in float32
        q = self._heads(self.img_attn_q, self.img_attn_q_norm, h, cdt, rope)  # (B, L, H, Dh)
        k = self._heads(self.img_attn_k, self.img_attn_k_norm, h, cdt, rope)
        v = self.img_attn_v(h).unflatten(2, (self.heads, -1))
        th = modulate(txt, t_shift1, t_scale1, EPS, cdt)  # (B, Lt, D)
        tq = self._heads(self.txt_attn_q, self.txt_attn_q_norm, th, cdt)  # (B, Lt, H, Dh)
        tk = self._heads(self.txt_attn_k, self.txt_attn_k_norm, th, cdt)
        tv = self.txt_attn_v(th).unflatten(2, (self.heads, -1))
        # The sequence-parallel seam: this rank's video tokens, the whole (replicated) text.
        if seq_parallel is not None:
            out, txt_out = seq_parallel.joint_attention(q, k, v, tq, tk, tv, txt_key_mask)
        else:
            out, txt_out = joint_attention(q, k, v, tq, tk, tv, txt_key_mask, self.attention_backend)

        img = gated_add(img, self.img_attn_proj(out.flatten(2)), i_gate1)
        img = gated_add(img, self.img_mlp(modulate(img, i_shift2, i_scale2, EPS, cdt)), i_gate2)
        txt = gated_add(txt, self.txt_attn_proj(txt_out.flatten(2)), t_gate1)
        txt = gated_add(txt, self.txt_mlp(modulate(txt, t_shift2, t_scale2, EPS, cdt)), t_gate2)
        return img, txt


class FinalLayer(nn.Module):
    """Tencent's `FinalLayer`: LayerNorm (no affine) * (1 + scale) + shift, then `linear`; the adaLN
    vector is laid out [shift | scale] (diffusers' norm_out: [scale | shift])."""

    def __init__(self, cfg: HY15DiTConfig):
        super().__init__()
        D = cfg.hidden_size
        self.linear = nn.Linear(D, cfg.out_channels * math.prod(cfg.patch_size))
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(D, 2 * D))

    def forward(self, x: torch.Tensor, vec: torch.Tensor) -> torch.Tensor:
        """x (B, L, D), vec (B, D) float32 -> (B, L, C_out * pt*ph*pw) in the layer's weight dtype."""
        # float32 region: the modulation, norm and output Linear (a float32 island here; small)
        with torch.autocast(x.device.type, enabled=False):
            dtype = self.linear.weight.dtype
            shift, scale = f32(self.adaLN_modulation(vec.to(dtype))).unsqueeze(1).chunk(2, dim=-1)  # (B, 1, D)
            return self.linear(modulate(x, shift, scale, EPS, dtype))
