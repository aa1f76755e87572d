"""The MiniMax H3 video VAE (16x space, 4x time inside 17-frame chunks, 24 latent channels): a causal 3D-CNN
encoder and a non-causal ViT decoder, weight-compatible with MiniMax's release (`video_vae/source/model.safetensors`,
whose names are ours) and diffusers' `AutoencoderKLMiniMaxH3` (`vae_convert.py`).

Dataflow (released widths 128, 256, 256, 512, 512, 1024; 2 res blocks per level; z = 24)

    video (B, 3, F, H, W) in [-1, 1], F = 17 n + 5 (or 1), H and W multiples of 16
      -> ImageNet pixels ((v + 1) / 2 - mean) / std, one chunk at a time: n chunks of 17 frames, then the last
         5 frames alone (an image: its one frame); every chunk is encoded on its own, in 256-pixel tiles
         conv_in                                      (B, 128, T, H, W)          T = 17, 5 or 1
         level 0: res x2, down 2x space               (B, 128, T, H/2, W/2)
         level 1: res x2 (-> 256), down 2x space+time (B, 256, ceil(T/2), H/4, W/4)
         level 2: res x2, down 2x space + time        (B, 256, ceil(T/4), H/8, W/8)
         level 3: res x2 (-> 512), down 2x space      (B, 512, ceil(T/4), h, w)   h, w = H/16, W/16
         levels 4, 5: res x2 (-> 512, -> 1024)        (B, 1024, ceil(T/4), h, w)
         norm, SiLU, conv_out, quant_conv             (B, 48, 5 | 2 | 1, h, w)   tiles blended in latent cells
      -> posterior: mean, logvar (float32)            (B, 24, F', h, w)           F' = 5 n + 2
    z (B, 24, F', h, w) VAE latents (`denormalize` the DiT's first)
      -> n chunks of 7 latent frames (5 + the 2 the next chunk starts with), each in 256-pixel tiles:
         post_quant_conv, one token per latent cell   (B, 7 h_t w_t, 24)
         x_embedder; + 4 register tokens + one zero   (B, L, 2048)                L = 7 h_t w_t + 5
         36 blocks: RMSNorm, attention (32 heads x 64, QK RMSNorm, 3-axis RoPE on 48 channels), RMSNorm, SwiGLU
         (8192); each branch scaled per channel (scale1, scale2) onto the residual
         LayerNorm, proj_out on the cell tokens       (B, 7 h_t w_t, 3 x 4 x 16 x 16)
         unpatchify                                   (B, 3, 28, H_t, W_t)
      -> of the 28 frames: 3..19 are the chunk's 17, cross-faded over their first 5 with the previous chunk's
         23..27; 23..27 are written as the tail, which the next chunk cross-fades (the last chunk's stays)
      -> pixels (x std + mean) 2 - 1, clamp            (B, 3, F, H, W) in [-1, 1]

Causality is a property of one layer, `CausalConv3d`: zero frames before the chunk, none after, so a latent frame
depends on its own and earlier pixel frames. That is why the last 5 frames can be encoded alone: MiniMax and
diffusers pad them to 17 by repeating the last frame and drop the 3 latent frames that read the copies; the 2
they keep read only the 5 real frames (tested equal). The GroupNorms take statistics over each frame alone, so
nothing else mixes frames. The decoder is not causal: every token of a 7-frame chunk sees every other.

Memory: decode writes each tile's frames straight into the output video (one allocation), cross-fading in place;
beside it a decode holds one tile's ViT activations and the raw edge strips its neighbours blend with
(`decode_peak_bytes`, from the layer shapes; 240 x 720 x 1280 is in the docstring there).

Where MiniMax's code (video_vae/klvae.py, vae_vit.py, base_module.py, attention.py, func.py) and diffusers
differ, MiniMax's is followed: the decoder's residual stream is in the decoder's dtype (diffusers keeps it
float32), the RoPE coordinates are made in that dtype too (`rope`), the register tokens' initial values and the
ViT's Xavier init (`initialize_weights`), and a single latent frame decodes as an image (the last of its 4
frames: MiniMax `decode_base` / `trim_output`; diffusers' `decode` cannot take one). Inference only: encode and
decode run without autograd and update tensors in place.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from video_dit.families.minimax_h3.vae_config import (PIXEL_MEAN, PIXEL_STD, H3Tiling, H3VAEConfig,
                                                      split_tiles)
from video_dit.models.attention import attention
from video_dit.models.causal_conv import DiagonalGaussian
from video_dit.models.common import initialize_by_name

KEYFRAME_SEED = 42  # diffusers `MiniMaxH3ModularPipeline.keyframe_encode_seed`: conditions are sampled under it


# ---------------------------------------------------------------- encoder layers


class CausalConv3d(nn.Conv3d):
    """Conv3d that sees only the past in time: kernel_t - 1 zero frames before the chunk, none after, and
    `spatial_padding` pixels on each side in `padding_mode` (MiniMax conv.py `BaseConv3d`, causal).
    (B, C, T, H, W) -> (B, C', ceil(T / stride_t), H + 2p - k + 1 (/ stride), ...)."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride=1, spatial_padding: int = 0,
                 padding_mode: str = "reflect"):
        super().__init__(in_channels, out_channels, kernel_size, stride=stride)
        self.past = self.kernel_size[0] - 1
        self.spatial_padding = spatial_padding
        self.pad_mode = "constant" if padding_mode == "zeros" else padding_mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = self.spatial_padding
        if p:
            x = F.pad(x, (p, p, p, p, 0, 0), mode=self.pad_mode)
        if self.past:
            x = F.pad(x, (0, 0, 0, 0, self.past, 0))  # zeros: the frames before the chunk
        return F.conv3d(x, self.weight, self.bias, self.stride)


class FrameGroupNorm(nn.Module):
    """GroupNorm with each frame's own statistics (MiniMax's `use_t_isolated_gn`), float32 statistics, an
    optional SiLU after. (B, C, T, H, W) -> same shape and dtype."""

    def __init__(self, groups: int, channels: int, eps: float):
        super().__init__()
        self.groups, self.eps = groups, eps
        self.weight = nn.Parameter(torch.ones(channels))
        self.bias = nn.Parameter(torch.zeros(channels))

    def forward(self, x: torch.Tensor, silu: bool = False) -> torch.Tensor:
        B, C, T, H, W = x.shape
        xf = x.float().reshape(B, self.groups, C // self.groups, T, H * W)
        var, mean = torch.var_mean(xf, dim=(2, 4), correction=0, keepdim=True)  # (B, G, 1, T, 1): per frame
        y = ((xf - mean) * torch.rsqrt(var + self.eps)).view(B, C, T, H, W)
        y = torch.addcmul(self.bias.float().view(C, 1, 1, 1), y, self.weight.float().view(C, 1, 1, 1))
        return (F.silu(y) if silu else y).to(x.dtype)


class ResnetBlock(nn.Module):
    """norm, SiLU, conv, norm, SiLU, conv, plus the input (through a 1x1 conv when the width changes)."""

    def __init__(self, cin: int, cout: int, cfg: H3VAEConfig):
        super().__init__()
        g, eps, pad = cfg.norm_num_groups, cfg.norm_eps, cfg.spatial_padding_mode
        self.norm1 = FrameGroupNorm(g, cin, eps)
        self.conv1 = CausalConv3d(cin, cout, 3, spatial_padding=1, padding_mode=pad)
        self.norm2 = FrameGroupNorm(g, cout, eps)
        self.conv2 = CausalConv3d(cout, cout, 3, spatial_padding=1, padding_mode=pad)
        self.nin_shortcut = CausalConv3d(cin, cout, 1) if cin != cout else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1(self.norm1(x, silu=True))
        h = self.conv2(self.norm2(h, silu=True))
        return (x if self.nin_shortcut is None else self.nin_shortcut(x)) + h


class Downsample(nn.Module):
    """A strided 3x3x3 causal conv; a spatial stride of 2 after a bottom / right pad of one pixel, so the
    output is exactly ceil(H / 2) (MiniMax vae_cnn.py `Downsample3D`)."""

    def __init__(self, channels: int, space: int, time: int, padding_mode: str):
        super().__init__()
        self.space = space
        self.pad_mode = "constant" if padding_mode == "zeros" else padding_mode
        self.conv = CausalConv3d(channels, channels, 3, stride=(time, space, space), padding_mode=padding_mode)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.space == 2:
            x = F.pad(x, (0, 1, 0, 1, 0, 0), mode=self.pad_mode)
        return self.conv(x)


class DownLevel(nn.Module):
    """One encoder level: `block` res blocks, then `downsample` when the level compresses."""

    def __init__(self, cin: int, cout: int, space: int, time: int, cfg: H3VAEConfig):
        super().__init__()
        self.block = nn.ModuleList([ResnetBlock(cin if i == 0 else cout, cout, cfg)
                                    for i in range(cfg.layers_per_block)])
        self.downsample = Downsample(cout, space, time, cfg.spatial_padding_mode) if space * time > 1 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.block:
            x = block(x)
        return x if self.downsample is None else self.downsample(x)


class Encoder(nn.Module):
    """ImageNet pixels of one chunk -> the posterior's moments before `quant_conv` (MiniMax `EncoderFCN3D`).
    (B, 3, T, H, W) -> (B, 2z, ceil(T / 4), H / 16, W / 16)."""

    def __init__(self, cfg: H3VAEConfig):
        super().__init__()
        w, pad = cfg.block_out_channels, cfg.spatial_padding_mode
        self.conv_in = CausalConv3d(cfg.in_channels, w[0], 3, spatial_padding=1, padding_mode=pad)
        ins = (w[0],) + w[:-1]
        self.down = nn.ModuleList([DownLevel(ins[i], w[i], s, t, cfg) for i, (s, t) in
                                   enumerate(zip(cfg.spatial_downsample_factors, cfg.temporal_downsample_factors))])
        self.norm_out = FrameGroupNorm(cfg.norm_num_groups, w[-1], cfg.norm_eps)
        self.conv_out = CausalConv3d(w[-1], 2 * cfg.latent_channels, 3, spatial_padding=1, padding_mode=pad)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv_in(x)
        for level in self.down:
            x = level(x)
        return self.conv_out(self.norm_out(x, silu=True))


# ---------------------------------------------------------------- decoder layers


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim in float32, back to x's dtype (MiniMax `_vit_norm_input`: every ViT norm reads
    x.float(), MINIMAX_H3_VAE_DECODER_VIT_FP32_NORM defaults on)."""
    w = None if weight is None else weight.float()
    return F.rms_norm(x.float(), x.shape[-1:], w, eps).to(x.dtype)


def rope_(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """In place: rotate the first r channels of t (B, L, H, d) by (cos, sin) (1, L, 1, r), the halves [a | b] ->
    [a cos - b sin | b cos + a sin] (MiniMax func.py `_apply_rotary_pos_emb_impl`, rotate_half); the rest pass."""
    half = cos.shape[-1] // 2
    a, b = t[..., :half], t[..., half:2 * half]
    a_new = a * cos[..., :half] - b * sin[..., :half]
    b.mul_(cos[..., half:]).addcmul_(a, sin[..., half:])
    a.copy_(a_new)
    return t


class Attention(nn.Module):
    """Self-attention with RMS-normed queries and keys (no weights) and partial RoPE. `to_qkv` rows are per head
    [q | k | v] (MiniMax attention.py: `view(B, L, H, 3 d).chunk(3)`). (B, L, D) -> (B, L, D)."""

    def __init__(self, dim: int, heads: int, head_dim: int, eps: float):
        super().__init__()
        self.heads, self.head_dim, self.eps = heads, head_dim, eps
        self.to_qkv = nn.Linear(dim, 3 * heads * head_dim)
        self.to_out = nn.Linear(heads * head_dim, dim)
        self.attention_backend = "native"

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, L, _ = x.shape
        q, k, v = self.to_qkv(x).view(B, L, self.heads, 3 * self.head_dim).chunk(3, dim=-1)  # (B, L, H, d) each
        q = rope_(rms_norm(q, None, self.eps), cos, sin)
        k = rope_(rms_norm(k, None, self.eps), cos, sin)
        o = attention(q, k, v, backend=self.attention_backend)  # (B, L, H, d)
        del q, k, v
        return self.to_out(o.reshape(B, L, -1))


class FeedForward(nn.Module):
    """SwiGLU: `w1` gives [gate | value] (MiniMax base_module.py; diffusers' `SwiGLU` stores [value | gate]),
    w2(silu(gate) value). (B, L, D) -> (B, L, D); the product is formed in place in w1's output."""

    def __init__(self, dim: int, inner: int):
        super().__init__()
        self.w1 = nn.Linear(dim, 2 * inner)
        self.w2 = nn.Linear(inner, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, L, _ = x.shape
        gate, value = self.w1(x).view(B * L, -1).chunk(2, dim=-1)  # (B L, I) views of (B L, 2I)
        F.silu(gate, inplace=True).mul_(value)
        # addmm on the strided view: F.linear runs a 3-d strided input as mm + add, holding its output twice
        return torch.addmm(self.w2.bias, gate, self.w2.weight.t()).view(B, L, -1)


class TransformerBlock(nn.Module):
    """x + attn(norm1(x)) scale1, then + ff(norm2(x)) scale2, the residual updated in place, in the decoder's
    dtype (MiniMax `TransformerBlock`; diffusers keeps it float32)."""

    def __init__(self, cfg: H3VAEConfig):
        super().__init__()
        dim, eps = cfg.decoder_num_attention_heads * cfg.decoder_attention_head_dim, cfg.decoder_norm_eps
        self.norm1 = nn.RMSNorm(dim, eps=eps)
        self.attn = Attention(dim, cfg.decoder_num_attention_heads, cfg.decoder_attention_head_dim, eps)
        self.scale1 = nn.Parameter(torch.zeros(dim))
        self.norm2 = nn.RMSNorm(dim, eps=eps)
        self.ff = FeedForward(dim, cfg.decoder_ffn_mult * dim)
        self.scale2 = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = self.attn(rms_norm(x, self.norm1.weight, self.norm1.eps), cos, sin)
        x.addcmul_(h, self.scale1)
        del h
        h = self.ff(rms_norm(x, self.norm2.weight, self.norm2.eps))
        return x.addcmul_(h, self.scale2)


class ViTDecoder(nn.Module):
    """Latents of one chunk (after `post_quant_conv`) -> its pixels: one token per latent cell, 4 register
    tokens and one zero token appended (all at position 0), full attention, each cell token projected to a
    4 x 16 x 16 pixel block (MiniMax vae_vit.py `ViT3DDecoder`, `t_causal` off)."""

    def __init__(self, cfg: H3VAEConfig):
        super().__init__()
        dim = cfg.decoder_num_attention_heads * cfg.decoder_attention_head_dim
        self.out_channels, self.p, self.pt = cfg.out_channels, cfg.spatial_compression, cfg.temporal_compression
        self.theta, self.rope_dim = cfg.decoder_rope_theta, cfg.rope_dim
        self.x_embedder = nn.Linear(cfg.latent_channels, dim)
        self.register_tokens = nn.Parameter(torch.zeros(1, cfg.decoder_num_register_tokens, dim))
        self.transformer_blocks = nn.ModuleList([TransformerBlock(cfg) for _ in range(cfg.decoder_num_layers)])
        self.norm_out = nn.LayerNorm(dim, eps=cfg.decoder_norm_eps)
        self.proj_out = nn.Linear(dim, cfg.out_channels * self.pt * self.p * self.p)

    def rope(self, T: int, h: int, w: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), each (1, T h w + R + 1, 1, r) in `dtype`: per axis the coordinates 2 (i + 0.5) / n - 1
        (length-normalised to [-1, 1) over this tile), angles 2 pi x coordinate x theta^(-6 j / r) for
        j < r / 6, the three axes' angles side by side and repeated for the two halves; the suffix tokens at 0.
        The coordinates are made in `dtype`, as MiniMax's `create_token_ids(..., x.dtype)` makes them (diffusers:
        float32); the angles in float32."""
        inv_freq = 1.0 / self.theta ** torch.arange(0, 1, 6 / self.rope_dim, dtype=torch.float32, device=device)
        axes = [2.0 * (torch.arange(0.5, n, dtype=dtype, device=device) / n) - 1.0 for n in (T, h, w)]
        pos = torch.stack(torch.meshgrid(*axes, indexing="ij"), dim=-1).view(-1, 3)  # (T h w, 3)
        pos = torch.cat([pos, pos.new_zeros(self.register_tokens.shape[1] + 1, 3)])  # (L, 3)
        angles = (2.0 * math.pi * pos[:, :, None] * inv_freq).flatten(1).tile(2)  # (L, r) float32
        return angles.cos().to(dtype)[None, :, None], angles.sin().to(dtype)[None, :, None]

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        """z (B, z, T, h, w) -> pixels (B, 3, 4 T, 16 h, 16 w), ImageNet-normalised, any T."""
        B, C, T, h, w = z.shape
        n = T * h * w
        x = self.x_embedder(z.permute(0, 2, 3, 4, 1).reshape(B, n, C))  # (B, n, D)
        x = torch.cat([x, self.register_tokens.to(x.dtype).expand(B, -1, -1), x.new_zeros(B, 1, x.shape[2])], 1)
        cos, sin = self.rope(T, h, w, x.dtype, x.device)  # (1, L, 1, r) each
        for block in self.transformer_blocks:
            x = block(x, cos, sin)  # (B, L, D), L = n + R + 1
        x = self.proj_out(self.norm_out(x[:, :n]))  # (B, n, 3 pt p p); the suffix tokens are dropped
        p, pt = self.p, self.pt
        x = x.view(B, T, h, w, self.out_channels, pt, p, p).permute(0, 4, 1, 5, 2, 6, 3, 7)
        return x.reshape(B, self.out_channels, T * pt, h * p, w * p)


# ---------------------------------------------------------------- tiles


def _blend_(prev: torch.Tensor, t: torch.Tensor, dim: int) -> None:
    """In place: t's first e entries along `dim` become prev's last e (1 - r / e) + t's r / e, r = 0 .. e - 1
    (MiniMax / diffusers `blend`, in t's dtype); `prev` is the raw neighbour's edge strip."""
    e = min(prev.shape[dim], t.shape[dim])
    if e == 0:
        return
    r = torch.arange(e, dtype=t.dtype, device=t.device) / e
    r = r.view([e] + [1] * (-dim - 1))
    head = t.narrow(dim, 0, e)
    head.copy_(prev.narrow(dim, prev.shape[dim] - e, e) * (1 - r) + head * r)


def tiled(fn, x: torch.Tensor, plan_h, plan_w, in_div: int, out_div: int, put) -> None:
    """`put(top, left, block)` for each tile of x in turn: `fn` of the tile, blended with the raw bottom strip of
    the tile above and the raw right strip of the tile to its left, cropped to the part it owns (all but its
    overlap with the next tile), positions in fn's output units. Plans are `split_tiles` results in pixels;
    x is indexed in pixels / in_div, fn's output in pixels / out_div. Only the edge strips of the previous
    row of tiles are held (diffusers holds every tile of the clip), and no tile outlives its `put`."""
    (ys, th, ovh), (xs, tw, ovw) = plan_h, plan_w
    above: list[torch.Tensor | None] = [None] * len(xs)
    for i, y0 in enumerate(ys):
        left = None
        for j, x0 in enumerate(xs):
            t = fn(x[..., y0 // in_div:(y0 + th) // in_div, x0 // in_div:(x0 + tw) // in_div])
            down = ovh[i] // out_div if i < len(ys) - 1 else 0  # rows the tile below owns
            right = ovw[j] // out_div if j < len(xs) - 1 else 0
            strips = (t[..., t.shape[-2] - down:, :].clone() if down else None,
                      t[..., t.shape[-1] - right:].clone() if right else None)  # raw, before blending
            if i:
                _blend_(above[j], t, -2)
            if j:
                _blend_(left, t, -1)
            above[j], left = strips
            put(y0 // out_div, x0 // out_div, t[..., :t.shape[-2] - down, :t.shape[-1] - right])
            del t


# ---------------------------------------------------------------- the VAE


class H3VideoVAE(nn.Module):
    """The MiniMax H3 video VAE. `encode(video)` -> posterior over VAE latents, `normalize` -> the DiT's latents;
    `denormalize` -> `decode(z)` -> video: the interface of the house's other VAEs. `tiling` (an `H3Tiling`, the
    release's 256 / 64 by default; None: whole frames) applies to encode and decode alike."""

    def __init__(self, config: H3VAEConfig, seed: int | None = None):
        super().__init__()
        self.config = config
        z = config.latent_channels
        self.encoder = Encoder(config)
        self.quant_conv = nn.Conv3d(2 * z, 2 * z, 1)
        self.post_quant_conv = nn.Conv3d(z, z, 1)
        self.decoder = ViTDecoder(config)
        self.tiling: H3Tiling | None = H3Tiling()
        self.initialize_weights(seed)

    def initialize_weights(self, seed: int | None = None) -> None:
        """Seeded by (seed, parameter name) (`initialize_by_name`). Convs (encoder, quant convs): PyTorch's default,
        U(+-1 / sqrt(fan_in)) for weights and biases (MiniMax keeps it). The ViT's Linears: Xavier-uniform weights,
        zero biases (MiniMax `ViTBase._init_weights`); register tokens N(0, 0.02) (`init_suffix_tokens`; diffusers:
        zeros); the branch scales zero (both: every block starts as the identity); norm weights one, biases zero."""
        shapes = {name: m.weight.shape for name, m in self.named_modules() if isinstance(m, (nn.Conv3d, nn.Linear))}
        linear = {name for name, m in self.named_modules() if isinstance(m, nn.Linear)}

        def init(config, name: str, p: nn.Parameter, generator: torch.Generator) -> None:
            module, _, leaf = name.rpartition(".")
            values = torch.zeros(p.shape)
            if module in linear and leaf == "weight":
                bound = math.sqrt(6.0 / (shapes[module][0] + shapes[module][1]))
                values.uniform_(-bound, bound, generator=generator)
            elif module in shapes and module not in linear:
                bound = shapes[module][1:].numel() ** -0.5
                values.uniform_(-bound, bound, generator=generator)
            elif leaf == "register_tokens":
                values.normal_(0.0, 0.02, generator=generator)
            elif leaf == "weight":  # GroupNorm / RMSNorm / LayerNorm
                values.fill_(1.0)
            with torch.no_grad():
                p.copy_(values)  # Linear biases, norm biases, scale1 / scale2: zero

        initialize_by_name(self, init, self.config, seed)

    @property
    def device(self) -> torch.device:
        return self.quant_conv.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.quant_conv.weight.dtype

    def latent_shape(self, video_shape) -> tuple[int, ...]:
        B, _, T, H, W = video_shape
        s = self.config.spatial_compression
        return (B, self.config.latent_channels, self.config.latent_frames(T), H // s, W // s)

    def enable_tiling(self, tiling: H3Tiling | None = None) -> None:
        tiling = tiling or H3Tiling()
        tiling.check(self.config)
        self.tiling = tiling

    def disable_tiling(self) -> None:
        self.tiling = None

    def _plans(self, height: int, width: int):
        """The tile plans (`split_tiles`) of a frame of height x width pixels, one tile each without tiling."""
        s, t = self.config.spatial_compression, self.tiling
        if t is None:
            return ([0], height, []), ([0], width, [])
        return split_tiles(height, t.size, t.overlap, s), split_tiles(width, t.size, t.overlap, s)

    # -------------------------------------------------------- encode

    def _pixels(self, video: torch.Tensor) -> torch.Tensor:
        """[-1, 1] -> ImageNet-normalised pixels ((v + 1) / 2 - mean) / std in float32, in the VAE's dtype."""
        mean = torch.tensor(PIXEL_MEAN, device=video.device).view(1, 3, 1, 1, 1)
        std = torch.tensor(PIXEL_STD, device=video.device).view(1, 3, 1, 1, 1)
        return ((video.float() + 1) / 2 - mean).div_(std).to(self.dtype)

    def _encode_chunk(self, x: torch.Tensor) -> torch.Tensor:
        """ImageNet pixels of one chunk (B, 3, T, H, W) -> moments (B, 2z, ceil(T / 4), h, w), in tiles."""
        s = self.config.spatial_compression
        B, _, T, H, W = x.shape
        out = []

        def put(top: int, left: int, block: torch.Tensor) -> None:
            if not out:
                out.append(block.new_empty(B, block.shape[1], block.shape[2], H // s, W // s))
            out[0][..., top:top + block.shape[-2], left:left + block.shape[-1]] = block

        tiled(lambda tile: self.quant_conv(self.encoder(tile)), x, *self._plans(H, W), 1, s, put)
        return out[0]

    def chunks(self, frames: int) -> list[tuple[int, int]]:
        """The pixel-frame ranges encoded on their own: an image's one frame; else clip_length frames n times,
        then the last frame_overlap frames (`valid_frames` is checked)."""
        cfg = self.config
        cfg.check_frames(frames)
        if frames == 1:
            return [(0, 1)]
        edges = list(range(0, frames - cfg.frame_overlap + 1, cfg.clip_length))
        if cfg.frame_overlap:
            edges.append(frames)
        return list(zip(edges[:-1], edges[1:]))

    @torch.no_grad()
    def encode(self, video: torch.Tensor) -> DiagonalGaussian:
        """video (B, 3, F, H, W) in [-1, 1], F = 17 n + 5 or 1, H and W multiples of 16 -> posterior over VAE latents,
        mean and log-variance (B, 24, F', h, w) in float32 (MiniMax upcasts the moments), F' = 5 n + 2 (an image:
        1), h, w = H / 16, W / 16. `normalize(posterior.mode())` is what the DiT reads."""
        cfg, s = self.config, self.config.spatial_compression
        if video.ndim != 5 or video.shape[1] != cfg.in_channels:
            raise ValueError(f"H3VideoVAE.encode expects video (B, {cfg.in_channels}, F, H, W), "
                             f"got {tuple(video.shape)}")
        H, W = video.shape[-2:]
        if H % s or W % s:
            raise ValueError(f"H3VideoVAE.encode: H x W = {H} x {W}; both must be multiples of {s}")
        moments = torch.cat([self._encode_chunk(self._pixels(video[:, :, a:b]))
                             for a, b in self.chunks(video.shape[2])], 2).float()  # (B, 2z, F', h, w)
        mean, logvar = moments.chunk(2, dim=1)
        return DiagonalGaussian(mean, logvar)

    @torch.no_grad()
    def condition_latents(self, video: torch.Tensor, seed: int = KEYFRAME_SEED) -> torch.Tensor:
        """A keyframe's or reference's conditioning latents as MiniMax H3's pipeline makes them (diffusers
        `encode_vae_condition`): the posterior *sampled* under a CPU generator seeded `seed` (42, whatever the
        request's seed), rounded to float16, normalised. video (B, 3, F, H, W) in [-1, 1] -> (B, 24, F', h, w)."""
        z = self.encode(video).sample(torch.Generator().manual_seed(seed))
        return self.normalize(z.to(torch.float16).float())

    # -------------------------------------------------------- decode

    def _decode_tiles(self, z: torch.Tensor, put) -> None:
        """`put(top, left, block)` for the decoded tiles of latents z (B, z, T, h, w): blocks (B, 3, 4 T, ., .)."""
        s = self.config.spatial_compression
        fn = lambda tile: self.decoder(self.post_quant_conv(tile))  # noqa: E731
        tiled(fn, z, *self._plans(z.shape[-2] * s, z.shape[-1] * s), s, 1, put)

    @torch.no_grad()
    def decode(self, z: torch.Tensor, clamp: bool = True) -> torch.Tensor:
        """z (B, 24, F', h, w) VAE latents (`denormalize` the DiT's first; cast to the VAE's dtype), F' = 5 n + 2 or 1
        -> video (B, 3, F, 16 h, 16 w), F = 17 n + 5 (one latent frame: one frame), in [-1, 1] unless `clamp=False`
        (MiniMax and diffusers clamp after mapping to [0, 1], the same thing). Each chunk of 7 latent frames is
        decoded in tiles written straight into the output (MiniMax `_decode_temporal_streaming`)."""
        cfg, s = self.config, self.config.spatial_compression
        if z.ndim != 5 or z.shape[1] != cfg.latent_channels:
            raise ValueError(f"H3VideoVAE.decode expects latents (B, {cfg.latent_channels}, F', h, w), "
                             f"got {tuple(z.shape)}")
        B, _, Fl, h, w = z.shape
        frames = cfg.pixel_frames(Fl)  # checks F'
        z = z.to(self.dtype)
        video = z.new_empty(B, cfg.out_channels, frames, h * s, w * s)
        if Fl == 1:  # an image: its 4 decoded frames' last (MiniMax trim_output keeps a causal encoder's last)
            def put(top: int, left: int, block: torch.Tensor) -> None:
                video[..., top:top + block.shape[-2], left:left + block.shape[-1]] = block[:, :, -1:]

            self._decode_tiles(z, put)
        k, tov, cl, fo = cfg.tokens_chunk_size, cfg.token_overlap, cfg.clip_length, cfg.frame_overlap
        pre, cf = cfg.frame_pre_padding, cfg.tokens_chunk_size * cfg.temporal_compression
        for i in range((Fl - tov) // k if Fl > 1 else 0):
            def put(top: int, left: int, block: torch.Tensor, base: int = i * cl, first: bool = i == 0) -> None:
                out = video[..., top:top + block.shape[-2], left:left + block.shape[-1]]
                main = block[:, :, pre:cf]  # the chunk's clip_length frames, output frames base ..
                if fo and not first:  # cross-faded with the previous chunk's tail, which `out` holds there
                    _blend_(out[:, :, base:base + fo], main, -3)
                out[:, :, base:base + cl] = main
                if fo:  # the tail: the next chunk cross-fades it (the last chunk's stays)
                    out[:, :, base + cl:base + cl + fo] = block[:, :, cf + pre:cf + pre + fo]

            self._decode_tiles(z[:, :, i * k:(i + 1) * k + tov], put)  # 7 latent frames -> blocks (B, 3, 28, ., .)
        scale = torch.tensor(PIXEL_STD, dtype=video.dtype, device=video.device).view(1, 3, 1, 1, 1) * 2
        shift = torch.tensor(PIXEL_MEAN, dtype=torch.float32).mul(2).sub(1).to(video.dtype).to(video.device)
        video.mul_(scale).add_(shift.view(1, 3, 1, 1, 1))  # ImageNet pixels -> (x std + mean) 2 - 1
        return video.clamp_(-1.0, 1.0) if clamp else video

    def forward(self, video: torch.Tensor, generator: torch.Generator | None = None, sample: bool = False):
        """Reconstruction: video (B, 3, F, H, W) -> (recon (B, 3, F, H, W), posterior)."""
        posterior = self.encode(video)
        z = posterior.sample(generator) if sample else posterior.mode()
        return self.decode(z), posterior

    # -------------------------------------------------------- latent statistics

    def _stats(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (1, -1) + (1,) * (z.ndim - 2)
        mean = torch.tensor(self.config.latents_mean, dtype=torch.float32, device=z.device).view(shape)
        std = torch.tensor(self.config.latents_std, dtype=torch.float32, device=z.device).view(shape)
        return mean.to(z.dtype), std.to(z.dtype)

    def normalize(self, z: torch.Tensor) -> torch.Tensor:
        """VAE latents -> the DiT's: (z - latents_mean) / latents_std per channel (diffusers' pipeline; MiniMax's
        video_vae/config.json statistics). (B, 24, ...)."""
        mean, std = self._stats(z)
        return (z - mean) / std

    def denormalize(self, z: torch.Tensor) -> torch.Tensor:
        """The DiT's latents -> VAE latents: z latents_std + latents_mean."""
        mean, std = self._stats(z)
        return z * std + mean


# ---------------------------------------------------------------- memory


def decode_peak_bytes(config: H3VAEConfig, frames: int, height: int, width: int, tiling: H3Tiling | None = H3Tiling(),
                      dtype: torch.dtype = torch.bfloat16, batch: int = 1) -> int:
    """The activation peak of `H3VideoVAE.decode` of a (frames, height, width) video, in bytes: the most its tensors
    hold at once beyond the weights and the input latents (given in the VAE's dtype), from the layer shapes and the
    order `decode` runs them in. The output video is one tensor from the start; beside it, the raw edge strips of
    the previous row of tiles and one tile's decode: the ViT's tensors at its largest step (the SwiGLU's input,
    hidden and output beside the residual stream at released widths; at the attention, the normed input, q k v,
    the rotated q and k and the output), then the tile's pixels and its blends. RMSNorm is counted as torch
    decomposes it (x^2, x rsqrt, x weight; float32, with a float32 copy of a lower-precision input), attention as
    a fused kernel (output + float32 log-sum-exp). Kernel workspaces (cuBLAS', cuDNN's, oneDNN's) are not tensors
    and are not counted; CUDA's fused RMSNorm would hold less than counted here.

    Released VAE, bf16, 243 x 720 x 1280 (the valid length nearest 10 s at 24 fps; 226 is the one below):
    1.36 GiB with the release's 256-pixel tiles (the video itself 1.25 GiB, one 7 x 16 x 16-cell tile's ViT and
    the edge strips 0.11), 2.31 GiB without tiling (a 7 x 45 x 80-cell chunk, 25205 tokens: the SwiGLU's hidden
    state, 25205 x 16384, is 0.77 GiB of it). Attention is counted as a fused kernel: SDPA's math fallback would
    add the score matrix, 32 x 25205^2 x 2 bytes = 38 GiB untiled.
    `tests/test_h3_vae.py` checks the model against `CPUAllocationTracker` at a tiny size."""
    cfg, s = config, config.spatial_compression
    cfg.check_frames(frames)
    if height % s or width % s:
        raise ValueError(f"decode_peak_bytes: {height} x {width}; both must be multiples of {s}")
    if tiling is not None:
        tiling.check(cfg)
    e, f, B = torch.empty((), dtype=dtype).element_size(), 4, batch
    T = 1 if frames == 1 else cfg.tokens_chunk_size + cfg.token_overlap  # latent frames per decoder call
    pt = cfg.temporal_compression
    if tiling is None:
        plan_h, plan_w = ([0], height, []), ([0], width, [])
    else:
        plan_h = split_tiles(height, tiling.size, tiling.overlap, s)
        plan_w = split_tiles(width, tiling.size, tiling.overlap, s)
    (ys, th, ovh), (xs, tw, ovw) = plan_h, plan_w
    px = B * cfg.out_channels * T * pt * e  # bytes per decoded pixel position of a tile
    ov_h, ov_w = max(ovh, default=0), max(ovw, default=0)
    held = px * (len(xs) * ov_h * tw + th * ov_w)  # the previous row's bottom strips, the left tile's right strip
    tile = px * th * tw
    strips = 3 * px * max(ov_h * tw, th * ov_w)  # the newest strips' clones, or a blend's three temporaries
    fade = 3 * B * cfg.out_channels * cfg.frame_overlap * th * tw * e if frames > 1 else 0  # the temporal cross-fade
    video = B * cfg.out_channels * frames * height * width * e
    vit = _vit_peak(cfg, B, T * (th // s) * (tw // s), e, f)
    return video + held + max(vit, tile + px * (ov_h * tw + th * ov_w) + max(strips, fade))


def _rms_peak(size: int, weighted: bool, e: int, f: int) -> tuple[int, int]:
    """(most bytes held at once inside `rms_norm` of `size` elements beyond its input, its output's bytes)."""
    muls = (2 if weighted else 1) * size * f  # x * rsqrt, then * weight (the first freed after the second)
    if e == f:
        return muls, size * f
    return max(size * f + muls, 2 * size * f + size * e), size * e  # a float32 copy of x first; the cast back last


def _vit_peak(cfg: H3VAEConfig, B: int, n: int, e: int, f: int) -> int:
    """`post_quant_conv` + `ViTDecoder.forward` on one tile of n latent cells: the most bytes held at once (the
    tile's latents, then the residual stream, the RoPE tables and each step's own tensors)."""
    D, H = cfg.decoder_num_attention_heads * cfg.decoder_attention_head_dim, cfg.decoder_num_attention_heads
    L, r, I = n + cfg.decoder_num_register_tokens + 1, cfg.rope_dim, cfg.decoder_ffn_mult * D
    P = cfg.out_channels * cfg.temporal_compression * cfg.spatial_compression ** 2
    z = B * n * cfg.latent_channels * e  # post_quant_conv's output, the decoder's argument
    x, ld = B * L * D * e, B * L * D
    embed = B * n * cfg.latent_channels * e + B * n * D * e + x  # the cells' copy, x_embedder, the concatenation
    tables = 2 * L * r * e  # cos, sin
    rope = L * r * f + (L * r * f + L * r * e if e != f else L * r * f) + L * r * e  # angles, cos (and cast), sin
    norm_peak, norm = _rms_peak(ld, True, e, f)
    q_peak, q = _rms_peak(ld, False, e, f)
    qkv = 3 * ld * e
    rotate = 3 * B * L * H * (r // 2) * e  # a cos, b sin, their difference
    attn = norm + qkv + max(q_peak,  # q's norm
                            q + max(q_peak, q + rotate, 2 * q + max(rotate, ld * e + B * H * L * f)))  # k's; the kernel
    attn = max(attn, norm + 3 * ld * e)  # to_out: the kernel's output, its (B, L, D) copy, the projection
    ff = norm + B * L * 2 * I * e + ld * e  # w1's output (gate and value, the product formed in it), w2's output
    head = max(x + B * n * D * e + B * n * P * e, 2 * B * n * P * e)  # norm_out, proj_out; the unpatchified copy
    return z + max(embed, x + rope, x + tables + max(norm_peak, attn, ff), tables + head)
