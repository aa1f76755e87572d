"""The LTX-2 DiT's layers, used by `dit.py`'s `LTX2DiT`:

    video_positions      the video tokens' coordinates: (seconds, pixel row, pixel column)   (F', h', w') -> (L, 3)
    audio_positions      the audio tokens' coordinates: seconds                              T -> (T, 1)
    rope_tables          RoPE (cos, sin) from coordinates, the head dim split per head       -> (1, L, H, Dh/2) each
    timestep_sinusoid    [cos | sin] features of timesteps on 0..1000                        (N,) -> (N, 256)
    AdaLayerNormSingle   sinusoid -> MLP -> embedding e; SiLU(e) -> Linear -> k rows         (N,) -> (N, k*D), (N, D)
    CaptionProjection    the 2.0 text projection (Linear, GELU(tanh), Linear)                (B, Lt, C) -> (B, Lt, D)
    Attention            q / k / v, RMSNorm of q and k across all heads, RoPE, per-head gates, to_out
    FeedForward          Linear -> GELU(tanh) -> Linear (4x)                                 (B, L, D) -> (B, L, D)
    LTX2Block            both streams: self-attention, text cross-attention, audio<->video attention, FFN

Parameter names are Lightricks' (ltx-core `model/transformer/*.py`): `attn1.to_q`, `attn1.q_norm`,
`ff.net.0.proj`, `scale_shift_table_a2v_ca_video`, ... Precision: every norm, the adaLN arithmetic, the
RoPE rotation, the gates and the residual updates in float32; the Linears in the compute dtype `cdt`.
No distributed code here: the attention calls go through `seq_parallel` when it is set (see `LTX2DiT`).

Activation memory (`LTX2Block.recompute`, on unless the block is checkpointed or compiled): the cheap
elementwise results autograd would keep for backward are kept as recipes (`RecomputeSaved`: a function and
inputs autograd keeps anyway) and recomputed in backward: every adaLN-modulated input of a Linear and its
RMS-normed operand, the normed and rotated q / k, the gated attention output, the GELU output, the
modulated text. What stays: the residual streams, the q / k / v projections, the attention outputs, the
Linears' outputs the gates' gradients read, the FFN's hidden layer (the GELU's input).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from video_dit.families.ltx2.dit_config import LTX2DiTConfig
from video_dit.models.attention import attention
from video_dit.models.layers import RecomputeSaved, RMSNorm, apply_rope, f32, gated_add


# ---------------------------------------------------------------- positions and RoPE


def video_positions(grid: tuple[int, int, int], cfg: LTX2DiTConfig, fps: float, device=None) -> torch.Tensor:
    """(L, 3) float32 midpoints of the video tokens' [start, end) bounds, row-major over the (F', h', w')
    token grid: (seconds, pixel row, pixel column). Lightricks' `get_patch_grid_bounds` + `get_pixel_coords(
    causal_fix=True)` / fps, evaluated at the patch middle (use_middle_indices_grid); diffusers'
    `prepare_video_coords` computes the same float32 numbers (patch bounds x VAE scale factors; the
    temporal ones shifted by causal_offset - scale, clamped at 0: the causal VAE's latent 0 is one frame)."""
    mids = []
    for axis, (n, p, s) in enumerate(zip(grid, cfg.patch_size, cfg.vae_scale_factors)):
        start = torch.arange(n, dtype=torch.float32, device=device) * p  # latent coordinate of each patch
        bounds = torch.stack([start, start + p], dim=-1) * s  # (n, 2) in pixels / pixel frames
        if axis == 0:
            bounds = (bounds + cfg.causal_offset - s).clamp(min=0) / fps  # pixel frames -> seconds
        shape = [1, 1, 1]
        shape[axis] = n
        mids.append(((bounds[:, 0] + bounds[:, 1]) / 2.0).view(shape).expand(*grid))
    return torch.stack(mids, dim=-1).reshape(-1, 3)  # (L, 3)


def audio_positions(frames: int, cfg: LTX2DiTConfig, device=None) -> torch.Tensor:
    """(T, 1) float32 midpoints of the audio latent frames in seconds (Lightricks' `AudioPatchifier`
    timings and diffusers' `prepare_audio_coords`): mel frame = latent * scale shifted by the causal offset."""
    f = torch.arange(frames, dtype=torch.float32, device=device)

    def seconds(latent):
        mel = (latent * cfg.audio_scale_factor + cfg.causal_offset - cfg.audio_scale_factor).clip(min=0)
        return mel * cfg.audio_hop_length / cfg.audio_sampling_rate

    return ((seconds(f) + seconds(f + 1)) / 2.0).unsqueeze(-1)  # (T, 1)


def rope_tables(positions: torch.Tensor, max_pos: tuple[int, ...], dim: int, heads: int, cfg: LTX2DiTConfig):
    """RoPE (cos, sin) tables, each (1, L, heads, dim / (2 heads)) float32, for tokens at `positions` (L, n).

    ltx-core `precompute_freqs_cis` / diffusers `LTX2AudioVideoRotaryPosEmbed`: a ladder of F = dim // (2n)
    frequencies theta^(i / (F-1)) * pi/2 (float64 or float32 by frequencies_precision, then float32); the
    angle of frequency f on axis a is f * (2 * position_a / max_pos_a - 1), ordered frequency-major, axis-
    minor, with zero angles (cos 1, sin 0) in front up to dim / 2; then cut into heads. Both rope types use
    these angles: "split" pairs channel i of a head with i + Dh/2, "interleaved" channel 2i with 2i + 1."""
    L, n = positions.shape
    steps = dim // (2 * n)
    ladder_dtype = torch.float64 if cfg.frequencies_precision == "float64" else torch.float32
    ladder = torch.pow(cfg.positional_embedding_theta,
                       torch.linspace(0.0, 1.0, steps, dtype=ladder_dtype, device=positions.device))
    ladder = (ladder * math.pi / 2.0).to(torch.float32)  # (F,)
    frac = torch.stack([positions[:, a] / max_pos[a] for a in range(n)], dim=-1)  # (L, n)
    angles = ((frac.unsqueeze(-1) * 2 - 1) * ladder).transpose(-1, -2).flatten(1)  # (L, F * n)
    angles = F.pad(angles, (dim // 2 - angles.shape[1], 0))  # (L, dim / 2)
    angles = angles.view(1, L, heads, -1)  # (1, L, H, Dh/2)
    return angles.cos(), angles.sin()


def apply_split_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate channel i of each head with channel i + Dh/2 (ltx-core `apply_split_rotary_emb`):
    x (B, L, H, Dh), tables (1, L, H, Dh/2) -> (B, L, H, Dh) in the tables' (float32) precision."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


# ---------------------------------------------------------------- timestep and text embeddings


def timestep_sinusoid(t: torch.Tensor, dim: int = 256) -> torch.Tensor:
    """(N,) timesteps -> (N, dim) float32 [cos | sin] with frequencies 10000^(-i / half), in float32 as
    ltx-core's `get_timestep_embedding` (flip_sin_to_cos=True, downscale_freq_shift=0) computes them."""
    half = dim // 2
    exponent = -math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=t.device) / half
    angles = t.float()[:, None] * torch.exp(exponent)[None]  # (N, half)
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


class TimestepEmbedding(nn.Module):
    """linear_1 -> SiLU -> linear_2 (ltx-core / diffusers `TimestepEmbedding`)."""

    def __init__(self, in_dim: int, dim: int):
        super().__init__()
        self.linear_1 = nn.Linear(in_dim, dim)
        self.linear_2 = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.silu(self.linear_1(x)))


class AdaLayerNormSingle(nn.Module):
    """ltx-core's `AdaLayerNormSingle` (PixArt-alpha's adaLN-single): `emb.timestep_embedder` then `linear`."""

    def __init__(self, dim: int, rows: int):
        super().__init__()
        self.emb = nn.Module()
        self.emb.timestep_embedder = TimestepEmbedding(256, dim)
        self.linear = nn.Linear(dim, rows * dim)

    def forward(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """t (N,) on the adaLN's scale (0..1000 at timestep_scale_multiplier 1000) -> the modulation
        (N, rows * D) and the embedding (N, D), in the weights' dtype (float32: an island, see dit.py)."""
        with torch.autocast(t.device.type, enabled=False):
            weight = self.linear.weight
            emb = self.emb.timestep_embedder(timestep_sinusoid(t).to(weight.dtype))  # (N, D)
            return self.linear(F.silu(emb)), emb


class CaptionProjection(nn.Module):
    """ltx-core `PixArtAlphaTextProjection` (2.0: the connector output -> the stream width)."""

    def __init__(self, in_dim: int, dim: int):
        super().__init__()
        self.linear_1 = nn.Linear(in_dim, dim)
        self.linear_2 = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.gelu(self.linear_1(x), approximate="tanh"))


# ---------------------------------------------------------------- attention and feed-forward


class Attention(nn.Module):
    """ltx-core `Attention`: q from `x`, k / v from `context` (width context_dim), each q / k RMS-normed
    across all heads (learned scale), RoPE on q and k (separate tables for the two streams of a2v / v2a),
    optional per-head gates 2 * sigmoid(to_gate_logits(x)) on the output, then `to_out.0`. The attention
    itself is the caller's (`LTX2Block._attend`: plain attention or the sequence-parallel seam)."""

    def __init__(self, query_dim: int, context_dim: int, heads: int, head_dim: int, eps: float, rope_type: str,
                 gated: bool):
        super().__init__()
        inner = heads * head_dim
        self.heads, self.rope_type = heads, rope_type
        self.q_norm, self.k_norm = RMSNorm(inner, eps), RMSNorm(inner, eps)
        self.to_q = nn.Linear(query_dim, inner)
        self.to_k = nn.Linear(context_dim, inner)
        self.to_v = nn.Linear(context_dim, inner)
        self.to_gate_logits = nn.Linear(query_dim, heads) if gated else None
        self.to_out = nn.Sequential(nn.Linear(inner, query_dim), nn.Identity())
        self.attention_backend = "native"

    def _heads(self, norm: RMSNorm, t: torch.Tensor, rope, cdt: torch.dtype,
               rc: RecomputeSaved | None = None) -> torch.Tensor:
        """t (B, L, H Dh) a q or k projection -> normed, rotated (B, L, H, Dh) in cdt; `rc`: the normed t a
        recipe of t."""
        n = norm(t)  # float32 with the float32 norm weight
        if rc is not None:
            rc.add(n, norm, t)
        t = n.unflatten(2, (self.heads, -1))  # (B, L, H, Dh)
        if rope is not None:  # rotated in float32 (ltx-core rotates in the activation dtype, diffusers in float32)
            t = apply_split_rope(t, *rope) if self.rope_type == "split" else apply_rope(f32(t), *rope)
        return t.to(cdt)

    def qkv(self, x: torch.Tensor, context: torch.Tensor, q_rope, k_rope, cdt: torch.dtype,
            rc: RecomputeSaved | None = None):
        """x (B, Lq, query_dim), context (B, Lk, context_dim) in cdt; ropes (cos, sin) (1, L, H, Dh/2) or
        None -> q (B, Lq, H, Dh), k, v (B, Lk, H, Dh) in cdt. `rc`: the block's recipes (the normed and
        rotated q / k are recomputed from the projections in backward)."""
        rc = rc or RecomputeSaved()
        q_lin, k_lin = self.to_q(x), self.to_k(context)
        q = rc.add(self._heads(self.q_norm, q_lin, q_rope, cdt, rc), self._heads, self.q_norm, q_lin, q_rope, cdt)
        k = rc.add(self._heads(self.k_norm, k_lin, k_rope, cdt, rc), self._heads, self.k_norm, k_lin, k_rope, cdt)
        v = self.to_v(context).unflatten(2, (self.heads, -1))
        return q, k, v

    def output(self, x: torch.Tensor, out: torch.Tensor, cdt: torch.dtype,
               rc: RecomputeSaved | None = None) -> torch.Tensor:
        """x (B, Lq, query_dim) the query input, out (B, Lq, H, Dh) the attention -> (B, Lq, query_dim).
        `rc`: the gated output (and its float32 operand) kept as recipes of `out` and the gates."""
        if self.to_gate_logits is not None:
            rc = rc or RecomputeSaved()
            with torch.autocast(x.device.type, enabled=False):  # float32 region: the gates (ltx-core: bf16)
                gates = 2.0 * torch.sigmoid(f32(self.to_gate_logits(x.to(self.to_gate_logits.weight.dtype))))
                gates = gates.unsqueeze(-1)  # (B, Lq, H, 1)
                out32 = f32(out)
                if out32 is not out:  # (a bf16 attention output: its float32 copy, which the product keeps)
                    rc.add(out32, f32, out)
                out = rc.add((out32 * gates).to(cdt), _gated, out, gates, cdt)  # (B, Lq, H, Dh)
        return self.to_out(out.flatten(2))


def _gated(out: torch.Tensor, gates: torch.Tensor, cdt: torch.dtype) -> torch.Tensor:
    return (f32(out) * gates).to(cdt)


class GELUProjection(nn.Module):
    def __init__(self, dim: int, hidden: int, bias: bool):
        super().__init__()
        self.proj = nn.Linear(dim, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.proj(x), approximate="tanh")


class FeedForward(nn.Module):
    """ltx-core `FeedForward` (mult 4): `net.0.proj` -> GELU(tanh) -> `net.2` (net.1 is an Identity)."""

    def __init__(self, dim: int, bias: bool):
        super().__init__()
        self.net = nn.Sequential(GELUProjection(dim, 4 * dim, bias), nn.Identity(), nn.Linear(4 * dim, dim, bias=bias))

    def forward(self, x: torch.Tensor, rc: RecomputeSaved | None = None) -> torch.Tensor:
        """x (B, L, D) -> (B, L, D); `rc`: `net.2` keeps a recipe of its GELU input, not the GELU output."""
        rc = rc or RecomputeSaved()
        h = self.net[0].proj(x)  # (B, L, 4D)
        return self.net[2](rc.add(_gelu(h), _gelu, h))


def _gelu(h: torch.Tensor) -> torch.Tensor:
    return F.gelu(h, approximate="tanh")


# ---------------------------------------------------------------- the block


@dataclass
class Stream:
    """What the blocks read of one stream, made once per forward (this rank's tokens under sequence
    parallelism). D: the stream's width; T: 1 (one timestep per sample) or L (per-token timesteps)."""

    name: str  # "video" | "audio": the stream's name in the sequence-parallel seam
    temb: torch.Tensor  # (B, T, rows * D) float32: the blocks' adaLN input (`adaln_single`)
    context: torch.Tensor  # (B, Lt, D) the text, in the compute dtype
    context_mask: torch.Tensor | None  # (B, Lt) bool (False = padding) or None
    rope: tuple  # (cos, sin) (1, L, H, Dh/2): self-attention
    cross_rope: tuple  # (cos, sin) (1, L, H, Dh_audio/2): a2v / v2a, from the temporal coordinate only
    cross_ss: torch.Tensor  # (B, T, 4 * D) float32: a2v / v2a scale and shift (this stream's timestep)
    cross_gate: torch.Tensor  # (B, 1, D) float32: the a2v / v2a gate (the other stream's sigma)
    prompt_temb: torch.Tensor | None  # (B, 1, 2 * D) float32: the text k / v modulation (prompt_adaln_single)


def ada_rows(table: torch.Tensor, temb: torch.Tensor, rows: slice) -> tuple[torch.Tensor, ...]:
    """table (n, D) + temb (B, T, n * D) -> the `rows` of the sum, each (B, T, D) float32 (ltx-core
    `get_ada_values`: the per-block table added to the global timestep modulation)."""
    values = f32(table[rows]) + temb.unflatten(-1, (table.shape[0], -1))[:, :, rows]  # (B, T, k, D)
    return values.unbind(2)


def rms_modulate(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, eps: float,
                 dtype: torch.dtype | None, rc: RecomputeSaved | None = None) -> torch.Tensor:
    """RMSNorm(x) (no weight) * (1 + scale) + shift, float32 region (ltx-core `PytorchAdaZeroFunction`);
    the result in `dtype` (None: float32) for the Linear after it. `rc`: the normed x and the result kept as
    recipes of x (which the norm keeps)."""
    with torch.autocast(x.device.type, enabled=False):
        x = f32(x)
        normed = F.rms_norm(x, x.shape[-1:], eps=eps)
        if rc is not None:
            rc.add(normed, _rms_norm, x, eps)
        out = torch.addcmul(shift, normed, 1 + scale)
    out = out if dtype is None else out.to(dtype)
    return out if rc is None else rc.add(out, rms_modulate, x, scale, shift, eps, dtype)


def _rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, x.shape[-1:], eps=eps)


def _rms_norm_to(x: torch.Tensor, eps: float, dtype: torch.dtype) -> torch.Tensor:
    """RMSNorm(x) (no weight) in float32, then `dtype` (2.0's text attention input)."""
    with torch.autocast(x.device.type, enabled=False):
        return F.rms_norm(x, x.shape[-1:], eps=eps).to(dtype)


def _modulate_text(context: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                   rc: RecomputeSaved | None = None) -> torch.Tensor:
    """The text k / v modulation, float32 region: context (B, Lt, D) * (1 + scale) + shift -> `dtype`;
    `rc`: the float32 copy of a bf16 context (which the product keeps) a recipe."""
    with torch.autocast(context.device.type, enabled=False):
        c32 = f32(context)
        if rc is not None and c32 is not context:
            rc.add(c32, f32, context)
        return torch.addcmul(shift, c32, 1 + scale).to(dtype)


class LTX2Block(nn.Module):
    """ltx-core `BasicAVTransformerBlock`, per stream s (video, audio), adaLN rows from `scale_shift_table`:

        s += gate0 * attn1(RMS(s) * (1 + scale0) + shift0)                          self-attention, RoPE
        s += [gate_q *] attn2(RMS(s) [* (1 + scale_q) + shift_q], text [* (1 + scale_kv) + shift_kv])
        video += gate_a2v * a2v(video mod., audio mod.);  audio += gate_v2a * v2a(audio mod., video mod.)
                                                         (both from the streams before either update)
        s += gate1 * ff(RMS(s) * (1 + scale1) + shift1)
    """

    def __init__(self, cfg: LTX2DiTConfig):
        super().__init__()
        D, Da, H = cfg.hidden_size, cfg.audio_hidden_size, cfg.num_attention_heads
        Dh, Dha, eps, rope, gated = cfg.attention_head_dim, cfg.audio_attention_head_dim, cfg.norm_eps, cfg.rope_type, \
            cfg.apply_gated_attention
        self.eps, self.adaln = eps, cfg.cross_attention_adaln
        self.attn1 = Attention(D, D, H, Dh, eps, rope, gated)
        self.attn2 = Attention(D, cfg.cross_attention_dim, H, Dh, eps, rope, gated)
        self.ff = FeedForward(D, cfg.ff_bias)
        self.scale_shift_table = nn.Parameter(torch.empty(cfg.modulation_rows, D))
        self.audio_attn1 = Attention(Da, Da, H, Dha, eps, rope, gated)
        self.audio_attn2 = Attention(Da, cfg.audio_cross_attention_dim, H, Dha, eps, rope, gated)
        self.audio_ff = FeedForward(Da, cfg.audio_ff_bias)
        self.audio_scale_shift_table = nn.Parameter(torch.empty(cfg.modulation_rows, Da))
        self.audio_to_video_attn = Attention(D, Da, H, Dha, eps, rope, gated)  # q: video, k / v: audio
        self.video_to_audio_attn = Attention(Da, D, H, Dha, eps, rope, gated)  # q: audio, k / v: video
        # rows: a2v scale, a2v shift, v2a scale, v2a shift, gate
        self.scale_shift_table_a2v_ca_audio = nn.Parameter(torch.empty(5, Da))
        self.scale_shift_table_a2v_ca_video = nn.Parameter(torch.empty(5, D))
        if self.adaln:  # the text k / v modulation tables: shift, scale
            self.prompt_scale_shift_table = nn.Parameter(torch.empty(2, D))
            self.audio_prompt_scale_shift_table = nn.Parameter(torch.empty(2, Da))
        self.recompute = True  # RecomputeSaved inside the block (module docstring); LTX2DiT turns it off when
        # the block is checkpointed (which keeps nothing inside) or compiled (Inductor chooses what to keep)

    def forward(self, vx: torch.Tensor, ax: torch.Tensor, v: Stream, a: Stream, cdt: torch.dtype, seq_parallel=None,
                skip_self: tuple[bool, bool] = (False, False), cross_modal: bool = True):
        """vx (B, L, D), ax (B, La, Da) float32 residual streams (this rank's tokens) -> the same, updated.
        v, a: the streams' `Stream`s; cdt: the Linears' compute dtype; seq_parallel: see `LTX2DiT`;
        skip_self: (video, audio) self-attention replaced by its value projection (spatio-temporal guidance's
        perturbation, ltx-core `Attention` with `all_perturbed`); cross_modal False: no a2v / v2a attention
        (the modality guidance's isolated pass)."""
        # recipes only when kept (`recompute`, grad on): a compiled block records none, whose strides and storage
        # offsets torch.compile cannot trace (a graph break per recipe: 74 graph breaks, 59 graphs for tiny-ltx2-t2v)
        sp, rc = seq_parallel, RecomputeSaved(active=self.recompute and torch.is_grad_enabled())
        with rc.hooks() if rc.active else contextlib.nullcontext():
            vx = self._self_and_text(vx, v, self.attn1, self.attn2, self.scale_shift_table,
                                     getattr(self, "prompt_scale_shift_table", None), cdt, sp, skip_self[0], rc)
            ax = self._self_and_text(ax, a, self.audio_attn1, self.audio_attn2, self.audio_scale_shift_table,
                                     getattr(self, "audio_prompt_scale_shift_table", None), cdt, sp, skip_self[1], rc)
            if cross_modal:
                vx, ax = self._cross_modal(vx, ax, v, a, cdt, sp, rc)
            vx = self._ffn(vx, v.temb, self.ff, self.scale_shift_table, cdt, rc)
            ax = self._ffn(ax, a.temb, self.audio_ff, self.audio_scale_shift_table, cdt, rc)
        return vx, ax

    def _cross_modal(self, vx, ax, v: Stream, a: Stream, cdt, sp, rc: RecomputeSaved):
        """audio -> video and video -> audio attention, both from the streams before either update."""

        # audio <-> video: the rows are (a2v scale, a2v shift, v2a scale, v2a shift | gate)
        v_a2v_scale, v_a2v_shift, v_v2a_scale, v_v2a_shift = ada_rows(self.scale_shift_table_a2v_ca_video[:4],
                                                                      v.cross_ss, slice(None))
        a_a2v_scale, a_a2v_shift, a_v2a_scale, a_v2a_shift = ada_rows(self.scale_shift_table_a2v_ca_audio[:4],
                                                                      a.cross_ss, slice(None))
        (v_gate,) = ada_rows(self.scale_shift_table_a2v_ca_video[4:], v.cross_gate, slice(None))
        (a_gate,) = ada_rows(self.scale_shift_table_a2v_ca_audio[4:], a.cross_gate, slice(None))
        q_in = rms_modulate(vx, v_a2v_scale, v_a2v_shift, self.eps, cdt, rc)  # (B, L, D)
        kv_in = rms_modulate(ax, a_a2v_scale, a_a2v_shift, self.eps, cdt, rc)  # (B, La, Da)
        a2v = self._attend(self.audio_to_video_attn, q_in, kv_in, v.cross_rope, a.cross_rope, cdt, sp,
                           ("cross", v.name, a.name), rc)  # (B, L, D)
        q_in = rms_modulate(ax, a_v2a_scale, a_v2a_shift, self.eps, cdt, rc)
        kv_in = rms_modulate(vx, v_v2a_scale, v_v2a_shift, self.eps, cdt, rc)
        v2a = self._attend(self.video_to_audio_attn, q_in, kv_in, a.cross_rope, v.cross_rope, cdt, sp,
                           ("cross", a.name, v.name), rc)  # (B, La, Da)
        return gated_add(vx, a2v, v_gate), gated_add(ax, v2a, a_gate)

    def _attend(self, attn: Attention, x, context, q_rope, k_rope, cdt, sp, kind: tuple, rc: RecomputeSaved,
                key_mask=None):
        """attn's output for queries x over keys from context; kind: ("self", stream), ("text", stream) or
        ("cross", query stream, key stream): which attention of the seam (`LTX2DiT`) it is."""
        q, k, v = attn.qkv(x, context, q_rope, k_rope, cdt, rc)
        if sp is None:
            out = attention(q, k, v, backend=attn.attention_backend, attn_mask=key_mask)
        elif kind[0] == "self":
            out = sp.self_attention(q, k, v, kind[1])
        elif kind[0] == "text":
            out = sp.text_attention(q, k, v, key_mask)
        else:
            out = sp.cross_modal_attention(q, k, v, kind[1], kind[2])
        return attn.output(x, out, cdt, rc)

    def _self_and_text(self, x, s: Stream, attn1: Attention, attn2: Attention, table, prompt_table, cdt, sp,
                       skip_self: bool, rc: RecomputeSaved):
        shift, scale, gate = ada_rows(table, s.temb, slice(0, 3))  # (B, T, D) each
        h = rms_modulate(x, scale, shift, self.eps, cdt, rc)
        if skip_self:  # the value projection passed through, then gated and projected (per token: no seam)
            out = attn1.output(h, attn1.to_v(h).unflatten(2, (attn1.heads, -1)), cdt, rc)  # (B, L, D)
        else:
            out = self._attend(attn1, h, h, s.rope, s.rope, cdt, sp, ("self", s.name), rc)
        x = gated_add(x, out, gate)

        if not self.adaln:  # ltx-core: the RMS-normed stream (`PytorchPostSAFunction`) as it is
            h = rc.add(_rms_norm_to(x, self.eps, cdt), _rms_norm_to, x, self.eps, cdt)
            return x + f32(self._attend(attn2, h, s.context, None, None, cdt, sp, ("text", s.name), rc,
                                        s.context_mask))
        # ltx-core `apply_cross_attention_adaln`: q modulated by rows 6..8, the text by the prompt table
        # (+ prompt_adaln_single(sigma) when the model has it), the output gated
        shift_q, scale_q, gate_q = ada_rows(table, s.temb, slice(6, 9))
        h = rms_modulate(x, scale_q, shift_q, self.eps, cdt, rc)
        kv = f32(prompt_table)[None, None]  # (1, 1, 2, D)
        if s.prompt_temb is not None:
            kv = kv + s.prompt_temb.unflatten(-1, (2, -1))  # (B, 1, 2, D)
        shift_kv, scale_kv = kv.unbind(2)
        context = rc.add(_modulate_text(s.context, shift_kv, scale_kv, cdt, rc), _modulate_text, s.context, shift_kv,
                         scale_kv, cdt)  # (B, Lt, D)
        return gated_add(x, self._attend(attn2, h, context, None, None, cdt, sp, ("text", s.name), rc,
                                         s.context_mask), gate_q)

    def _ffn(self, x, temb, ff: FeedForward, table, cdt, rc: RecomputeSaved):
        shift, scale, gate = ada_rows(table, temb, slice(3, 6))
        return gated_add(x, ff(rms_modulate(x, scale, shift, self.eps, cdt, rc), rc), gate)
