"""The MiniMax H3 DiT's layers (`dit.py` assembles them): the timestep MLP, the attention (fused q / k / v,
per-head q / k RMSNorm, partial rotate-half RoPE), the SwiGLU MLP, the text refiner blocks, the AdaLN blocks
modulated per run of rows and the final layer with its two heads. Module and parameter names are MiniMax's
original checkpoint names (SGLang `MiniMaxH3DiTModel`, the MiniMaxAI/MiniMax-H3 FL2VA/ shards).

Precision: float32 regions are the AdaLN arithmetic (norm(x) * (1 + scale) + shift, x + gate * y: the
residual stream stays float32), the RMSNorms, the RoPE rotation, the sinusoid and the timestep MLP; the
Linears of the blocks, the refiner and the AdaLN projections compute in the bulk dtype (bf16 under a bf16
model's autocast), as the reference's bf16 weights do.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from video_dit.families.minimax_h3.dit_config import MODALITIES, H3DiTConfig
from video_dit.families.minimax_h3.packing import entry_table
from video_dit.models.attention import attention
from video_dit.models.layers import RMSNorm, f32


def timestep_sinusoid(t: torch.Tensor, dim: int) -> torch.Tensor:
    """(N,) timesteps in 0..1 (unscaled) -> (N, dim) float32 [cos | sin], frequencies exp(-ln(10^4) i / half),
    computed in float32 as the reference (SGLang `MiniMaxH3TimeEmbedder`, diffusers `Timesteps(flip_sin_to_cos)`)."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = t.to(torch.float32)[:, None] * freqs[None]  # (N, half)
    return torch.cat([args.cos(), args.sin()], dim=-1)


class TimeEmbedder(nn.Module):
    """`time_embedder`: sinusoid -> proj_in -> SiLU -> proj_out, a float32 island (float32 in the checkpoint)."""

    def __init__(self, cfg: H3DiTConfig):
        super().__init__()
        self.freq_dim = cfg.freq_dim
        self.proj_in = nn.Linear(cfg.freq_dim, cfg.time_embed_hidden_dim)
        self.proj_out = nn.Linear(cfg.time_embed_hidden_dim, cfg.time_embed_dim)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        """t (N,) in 0..1 -> (N, time_embed_dim) in the layer's weight dtype (float32 unless cast whole)."""
        with torch.autocast(t.device.type, enabled=False):
            dtype = self.proj_in.weight.dtype
            return self.proj_out(F.silu(self.proj_in(timestep_sinusoid(t, self.freq_dim).to(dtype))))


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, L, H, Dh) with its first R channels rotated (rotate-half pairing: channel i with i + R/2) by the
    (B|1, L, 1, R) tables, the rest passed; float32 region (x and the tables float32)."""
    R = cos.shape[-1]
    x_rot, x_pass = x[..., :R], x[..., R:]
    x1, x2 = x_rot.chunk(2, dim=-1)
    rotated = torch.addcmul(x_rot * cos, torch.cat([-x2, x1], dim=-1), sin)
    return torch.cat([rotated, x_pass], dim=-1)


class Attention(nn.Module):
    """`attn`: fused `qkv_proj` (rows [q | k | v], each heads x head_dim: the reference's in-memory order; MiniMax's
    shards interleave them per head, `convert.py` reorders), `q_norm` / `k_norm` RMSNorm over each head, RoPE on
    the first rotary_dim channels of q / k (blocks only), softmax attention, `out_proj`. No biases."""

    def __init__(self, cfg: H3DiTConfig):
        super().__init__()
        self.heads = cfg.num_attention_heads
        self.qkv_proj = nn.Linear(cfg.hidden_size, 3 * cfg.inner_dim, bias=False)
        self.q_norm = RMSNorm(cfg.attention_head_dim, cfg.qk_norm_eps)
        self.k_norm = RMSNorm(cfg.attention_head_dim, cfg.qk_norm_eps)
        self.out_proj = nn.Linear(cfg.inner_dim, cfg.hidden_size, bias=False)
        self.attention_backend = "native"

    def forward(self, x: torch.Tensor, rope, key_mask: torch.Tensor | None, cdt: torch.dtype,
                seq_parallel=None) -> torch.Tensor:
        """x (B, L, D) in cdt, rope = (cos, sin) (B|1, L, 1, R) float32 or None, key_mask (B, L) bool (False: a
        padded key) or None -> (B, L, D). seq_parallel: None (attend over these L rows) or the sequence-parallel
        layer (`H3DiT`'s docstring): these are this rank's rows, and each attends over all ranks' rows."""
        q, k, v = self.qkv_proj(x).unflatten(-1, (3, self.heads, -1)).unbind(2)  # (B, L, H, Dh) each
        q, k = self.q_norm(q), self.k_norm(k)  # float32 (float32 norm weights)
        if rope is not None:
            with torch.autocast(x.device.type, enabled=False):  # float32 region: the rotation
                q, k = rotate(f32(q), *rope), rotate(f32(k), *rope)
        q, k, v = q.to(cdt), k.to(cdt), v.to(cdt)
        if seq_parallel is not None:
            out = seq_parallel.attention(q, k, v, key_mask)
        else:
            out = attention(q, k, v, backend=self.attention_backend, attn_mask=key_mask)  # (B, L, H, Dh)
        return self.out_proj(out.flatten(2))


class MLP(nn.Module):
    """`mlp`: SwiGLU, fc2(silu(gate) * value) with fc1's rows [gate | value] (the reference's order; diffusers'
    SwiGLU reads [value | gate], `convert.py` swaps the halves)."""

    def __init__(self, cfg: H3DiTConfig):
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden_size, 2 * cfg.ffn_dim, bias=False)
        self.fc2 = nn.Linear(cfg.ffn_dim, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, value = self.fc1(x).chunk(2, dim=-1)  # (B, L, ffn_dim) each
        return self.fc2(F.silu(gate) * value)


class RefinerBlock(nn.Module):
    """`token_refiner.blocks.N`: a plain pre-norm block over the text rows (no AdaLN, no RoPE)."""

    def __init__(self, cfg: H3DiTConfig):
        super().__init__()
        self.norm1 = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.norm2 = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None, cdt: torch.dtype) -> torch.Tensor:
        """x (B, Lt, D) float32, key_mask (B, Lt) bool or None -> (B, Lt, D) float32."""
        x = x + self.attn(self.norm1(x).to(cdt), None, key_mask, cdt)
        return x + self.mlp(self.norm2(x).to(cdt))


class TokenRefiner(nn.Module):
    """`token_refiner`: the refiner blocks, then `final_norm`."""

    def __init__(self, cfg: H3DiTConfig):
        super().__init__()
        self.blocks = nn.ModuleList(RefinerBlock(cfg) for _ in range(cfg.num_refiner_layers))
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.final_norm_eps)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None, cdt: torch.dtype) -> torch.Tensor:
        """x (B, Lt, D) -> (B, Lt, D) float32."""
        x = f32(x)
        for block in self.blocks:
            x = block(x, key_mask, cdt)
        return self.final_norm(x)


class AdalnProj(nn.Module):
    """`adaln_proj`: `linear` from the (SiLU-ed) timestep embedding to `expand` vectors per modality."""

    def __init__(self, cfg: H3DiTConfig, expand: int, modalities: int):
        super().__init__()
        self.expand, self.modalities = expand, modalities
        self.linear = nn.Linear(cfg.time_embed_dim, expand * modalities * cfg.hidden_size)

    def forward(self, temb: torch.Tensor, batch: int) -> torch.Tensor:
        """temb (B G, time_embed_dim) SiLU-ed, in the Linear's compute dtype, sample-major -> (B, G, modalities,
        expand D) float32: per sample, timestep group and modality, the layout [t0 m0, t0 m1, t0 m2, t1 m0, ...]
        of the reference's `view(M * 3, expand * D)`."""
        out = f32(self.linear(temb))  # (B G, modalities expand D)
        return out.view(batch, -1, self.modalities, out.shape[-1] // self.modalities)


def modulate_runs(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, runs) -> torch.Tensor:
    """x * (1 + scale[e]) + shift[e] over each run (start, stop, e) of rows; x (B, L, D) float32, shift / scale
    (B, E, D) float32 -> (B, L, D) float32. One broadcast row per run: no per-row table is gathered."""
    parts = [torch.addcmul(shift[:, e, None], x[:, a:b], 1 + scale[:, e, None]) for a, b, e in runs]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def gated_runs(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor, runs) -> torch.Tensor:
    """x + gate[e] * y over each run; x (B, L, D) float32, y (B, L, D), gate (B, E, D) -> (B, L, D) float32."""
    parts = [torch.addcmul(x[:, a:b], y[:, a:b], gate[:, e, None]) for a, b, e in runs]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


class Block(nn.Module):
    """`blocks.N`: norm1 -> AdaLN scale / shift -> attention over the whole packed sequence -> gated residual;
    norm2 -> scale / shift -> MLP -> gated residual. The six (B, E, D) modulation vectors per AdaLN entry
    come from this block's `adaln_proj` (18 D per timestep: 3 modalities x [shift, scale, gate] x 2)."""

    def __init__(self, cfg: H3DiTConfig):
        super().__init__()
        self.norm1 = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.norm2 = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.mlp = MLP(cfg)
        self.adaln_proj = AdalnProj(cfg, 6, MODALITIES)

    def forward(self, x: torch.Tensor, temb: torch.Tensor, runs, rope, key_mask: torch.Tensor | None,
                cdt: torch.dtype, seq_parallel=None) -> torch.Tensor:
        """x (B, L, D) float32 (this rank's rows), temb (B G, time_embed_dim) SiLU-ed float32, runs [(start,
        stop, entry)] covering the L rows, rope (cos, sin) (B|1, L, 1, R), key_mask (B, L) or None -> (B, L, D)
        float32. The AdaLN projection runs in cdt (the reference casts the SiLU-ed embedding to its bf16 weight)."""
        table = entry_table(self.adaln_proj(temb.to(cdt), x.shape[0]))  # (B, E, 6 D) float32
        shift1, scale1, gate1, shift2, scale2, gate2 = table.chunk(6, dim=-1)  # (B, E, D) each
        with torch.autocast(x.device.type, enabled=False):  # float32 region: the AdaLN arithmetic
            h = modulate_runs(self.norm1(x), shift1, scale1, runs).to(cdt)
        a = self.attn(h, rope, key_mask, cdt, seq_parallel)
        with torch.autocast(x.device.type, enabled=False):
            x = gated_runs(x, a, gate1, runs)
            h = modulate_runs(self.norm2(x), shift2, scale2, runs).to(cdt)
        m = self.mlp(h)
        with torch.autocast(x.device.type, enabled=False):
            return gated_runs(x, m, gate2, runs)


class FinalLayer(nn.Module):
    """`final_layer`: norm -> scale / shift per timestep (one modality: [shift | scale], 2 D) -> both heads
    (`video_out`, `audio_out`) over every row; a float32 island (the heads are float32 in the checkpoint)."""

    def __init__(self, cfg: H3DiTConfig):
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.final_norm_eps)
        self.adaln_proj = AdalnProj(cfg, 2, 1)
        self.video_out = nn.Linear(cfg.hidden_size, cfg.patch_dim)
        self.audio_out = nn.Linear(cfg.hidden_size, cfg.audio_in_channels)

    def forward(self, x: torch.Tensor, temb: torch.Tensor, runs) -> torch.Tensor:
        """x (B, L, D) float32, temb (B G, time_embed_dim) SiLU-ed float32, runs as the blocks' -> (B, L, patch_dim +
        audio_in_channels) [video | audio] in the heads' dtype (float32 unless cast whole)."""
        with torch.autocast(x.device.type, enabled=False):
            dtype = self.video_out.weight.dtype
            per_group = self.adaln_proj(temb.to(self.adaln_proj.linear.weight.dtype), x.shape[0])  # (B, G, 1, 2 D)
            # per entry: its timestep group's row (the final modulation has no modality)
            table = entry_table(per_group.expand(-1, -1, MODALITIES, -1))  # (B, E, 2 D)
            shift, scale = table.chunk(2, dim=-1)
            h = modulate_runs(self.norm(x), shift, scale, runs).to(dtype)
            return torch.cat([self.video_out(h), self.audio_out(h)], dim=-1)
