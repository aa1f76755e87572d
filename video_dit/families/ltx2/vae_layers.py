"""The layers of the LTX-2 video VAE (`vae.py` builds the encoder and decoder from them).

    LTX2Conv3d       3x3x3 conv; time padded by repeating edge frames: causal (2 copies of the first frame
                     before: an output frame sees only its own and earlier frames) or not (1 before, 1 after)
    ResBlock         x + conv2(silu(norm(conv1(silu(norm(x)))))), norm = per-position RMS over channels,
                     optionally adaLN-modulated by a timestep embedding
    ResStage         a run of res blocks (Lightricks' "res_x", `UNetMidBlock3D`), with its timestep embedder
    Downsample       space-to-depth 2x (space, time or both): conv to C'/p channels, fold p positions into
                     channels, plus the input folded the same way and averaged in groups (Lightricks'
                     `SpaceToDepthDownsample`)
    Upsample         depth-to-space 2x: conv to C' p channels, unfold into p positions, optionally plus the
                     input unfolded and repeated (Lightricks' `DepthToSpaceUpsample`)
    TimestepEmbedder PixArt-alpha's: 256 sinusoidal features, Linear, SiLU, Linear

Every conv runs in chunks of output frames (`LTX2Conv3d.run`): the frames a chunk reads (its padding
included) are gathered into a small buffer, the pointwise ops before the conv (norm, modulation, SiLU)
run in place on that buffer, and the conv's output chunk is handed to the caller, who writes it where
it belongs (a work tensor, the residual sum, the unfolded output). So a res block holds its input and
one work tensor, and a resample its input and its output, plus one chunk: the activation memory
`decode_peak_bytes` (vae.py) counts. These paths are for inference: the VAE runs them without autograd.
Each layer also has `plain(...)`, the same math as one whole-clip conv per layer with no in-place
writes, which autograd can differentiate: the path a VAE being trained takes (`LTX2VideoVAE.encode` /
`decode` pick it when autograd records; `families/ltx2/vae_stage.py`), equal to the chunked one.

Parameter names are Lightricks' (ltx-core `model/video_vae/`): `conv1.conv.weight`, `res_blocks.0`,
`time_embedder.timestep_embedder.linear_1.weight`, `scale_shift_table`.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from video_dit.families.ltx2.vae_config import STRIDES

# Write one conv output chunk: (first output frame, end frame, chunk (B, C_out, t1 - t0, H, W)).
Writer = Callable[[int, int, torch.Tensor], None]
# In place on a gathered input chunk (B, C, n, H, W), before the conv.
Prep = Callable[[torch.Tensor], None]

PIXEL_NORM_EPS = 1e-8  # ltx-core PixelNorm / diffusers PerChannelRMSNorm


def pixel_norm_(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(mean over channels of x^2 + 1e-8), in place; x (B, C, ...). Float32 island: the RMS is
    reduced and kept in float32 (one value per position), so a bf16 activation is rounded once, by
    the division, instead of through a bf16 mean of squares as in the references."""
    rms = torch.linalg.vector_norm(x, dim=1, keepdim=True, dtype=torch.float32)  # (B, 1, ...)
    rms.square_().div_(x.shape[1]).add_(PIXEL_NORM_EPS).sqrt_()
    return x.div_(rms)


def pixel_norm(x: torch.Tensor) -> torch.Tensor:
    """`pixel_norm_` out of place (the differentiable path): the RMS in float32, the result in x's dtype."""
    rms = (x.float().square().mean(dim=1, keepdim=True) + PIXEL_NORM_EPS).sqrt()  # (B, 1, ...)
    return (x / rms).to(x.dtype)


def norm_silu_plain(x: torch.Tensor, scale: torch.Tensor | None = None,
                    shift: torch.Tensor | None = None) -> torch.Tensor:
    """`norm_silu`'s head out of place: pixel norm, [x (1 + scale) + shift], SiLU."""
    x = pixel_norm(x)
    if scale is not None:
        x = x * (1 + scale) + shift
    return F.silu(x)


def norm_silu(scale: torch.Tensor | None = None, shift: torch.Tensor | None = None) -> Prep:
    """The pointwise head of every conv after the first: pixel norm, then `x (1 + scale) + shift` when
    the timestep modulates it (scale, shift (B, C, 1, 1, 1)), then SiLU; in place."""
    def prep(x: torch.Tensor) -> None:
        pixel_norm_(x)
        if scale is not None:
            x.mul_(1 + scale).add_(shift)
        F.silu(x, inplace=True)
    return prep


class LTX2Conv3d(nn.Module):
    """A 3x3x3 conv, stride 1, whose time axis is padded by repeating edge frames. `causal`: two copies
    of the first frame before the clip, so an output frame sees only its own and earlier input frames
    (the encoder; Lightricks' `CausalConv3d(causal=True)`); else one copy of the first frame before and
    of the last after (the released decoders). Space is padded by the conv ("zeros" or "reflect").
    Parameters `conv.weight`, `conv.bias`, as Lightricks' `CausalConv3d` names them."""

    def __init__(self, in_channels: int, out_channels: int, causal: bool, padding: str):
        super().__init__()
        self.causal = causal
        self.conv = nn.Conv3d(in_channels, out_channels, 3, padding=(0, 1, 1), padding_mode=padding)

    def padded_frames(self, frames: int, t0: int, t1: int) -> list[int]:
        """The input frame under each time position the conv reads for output frames [t0, t1) of a clip of
        `frames` frames: t0 - 2 .. t1 - 1 (causal) or t0 - 1 .. t1 (not), clamped into the clip."""
        lo, hi = (t0 - 2, t1) if self.causal else (t0 - 1, t1 + 1)
        return [min(max(j, 0), frames - 1) for j in range(lo, hi)]

    def run(self, x: torch.Tensor, write: Writer, chunk: int, prep: Prep | None = None,
            frames: list[int] | None = None) -> None:
        """Convolve x (B, C, T, H, W) `chunk` output frames at a time: each chunk's input frames (padding
        included) are copied into a buffer, `prep` runs on it in place, and the conv's output (B, C_out,
        n, H, W) goes to `write(t0, t1, y)`. `frames`: the clip the conv sees, as indices into x's frames
        (a time downsample repeats the first frame); by default x's own frames."""
        frames = list(range(x.shape[2])) if frames is None else frames
        B, C, _, H, W = x.shape
        for t0 in range(0, len(frames), chunk):
            t1 = min(t0 + chunk, len(frames))
            src = [frames[j] for j in self.padded_frames(len(frames), t0, t1)]
            buf = x.new_empty(B, C, len(src), H, W)
            i = 0
            while i < len(src):  # copy runs of consecutive frames as one slice
                j = i
                while j + 1 < len(src) and src[j + 1] == src[j] + 1:
                    j += 1
                buf[:, :, i:j + 1] = x[:, :, src[i]:src[j] + 1]
                i = j + 1
            if prep is not None:
                prep(buf)
            y = self.conv(buf)  # (B, C_out, t1 - t0, H, W)
            del buf
            write(t0, t1, y)
            del y

    def plain(self, x: torch.Tensor, frames: list[int] | None = None) -> torch.Tensor:
        """`run`'s result as one differentiable conv: x (B, C, T, H, W) (its `frames`, default all) ->
        (B, C_out, len(frames), H, W). The head before the conv is the caller's (`norm_silu_plain`)."""
        frames = list(range(x.shape[2])) if frames is None else frames
        src = [frames[j] for j in self.padded_frames(len(frames), 0, len(frames))]
        return self.conv(x[:, :, src])  # (B, C_out, len(frames), H, W)

    def forward(self, x: torch.Tensor, chunk: int, prep: Prep | None = None) -> torch.Tensor:
        """x (B, C, T, H, W) -> (B, C_out, T, H, W), `run` into one output tensor."""
        B, _, T, H, W = x.shape
        out = x.new_empty(B, self.conv.out_channels, T, H, W)
        self.run(x, lambda t0, t1, y: out[:, :, t0:t1].copy_(y), chunk, prep)
        return out


class TimestepEmbedder(nn.Module):
    """PixArt-alpha's timestep embedding (diffusers / ltx-core `PixArtAlphaCombinedTimestepSizeEmbeddings`
    with no size embedding): 256 sinusoidal features [cos, sin] at frequencies 10000^(-i / 128), then
    Linear, SiLU, Linear to `dim`. Parameter names `timestep_embedder.linear_1` / `linear_2`."""

    FEATURES = 256

    def __init__(self, dim: int):
        super().__init__()
        self.timestep_embedder = nn.Module()
        self.timestep_embedder.linear_1 = nn.Linear(self.FEATURES, dim)
        self.timestep_embedder.linear_2 = nn.Linear(dim, dim)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        """t (B,) scaled timesteps (float) -> (B, dim) in the weights' dtype."""
        half = self.FEATURES // 2
        freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
        angles = t.float()[:, None] * freqs[None]  # (B, 128), float32 as the references
        features = torch.cat([angles.cos(), angles.sin()], dim=1)  # (B, 256)
        mlp = self.timestep_embedder
        h = F.silu(mlp.linear_1(features.to(mlp.linear_1.weight.dtype)))
        return mlp.linear_2(h)


class ResBlock(nn.Module):
    """x + conv2(silu(norm(conv1(silu(norm(x)))))) at constant width, norm the per-position RMS norm;
    with a timestep, each norm is followed by `(1 + scale) + shift` from `scale_shift_table` (4, C) plus
    the stage's embedding (Lightricks' `ResnetBlock3D`; a width-changing block is not in any release)."""

    def __init__(self, channels: int, causal: bool, padding: str, timestep_conditioning: bool):
        super().__init__()
        self.conv1 = LTX2Conv3d(channels, channels, causal, padding)
        self.conv2 = LTX2Conv3d(channels, channels, causal, padding)
        if timestep_conditioning:
            self.scale_shift_table = nn.Parameter(torch.zeros(4, channels))

    def forward(self, x: torch.Tensor, hidden: torch.Tensor, emb: torch.Tensor | None, chunk: int) -> torch.Tensor:
        """x (B, C, T, H, W) += the block's branch, in place (and returned); `hidden` (B, C, T, H, W) is
        work space, overwritten. `emb` (B, 4C) the stage's timestep embedding, or None."""
        mods = [None] * 4
        if emb is not None:  # (shift1, scale1, shift2, scale2), each (B, C, 1, 1, 1)
            table = self.scale_shift_table[None, :, :, None, None, None].to(x.dtype)
            mods = list((table + emb.view(x.shape[0], 4, -1, 1, 1, 1)).unbind(1))
        shift1, scale1, shift2, scale2 = mods
        self.conv1.run(x, lambda t0, t1, y: hidden[:, :, t0:t1].copy_(y), chunk, norm_silu(scale1, shift1))
        self.conv2.run(hidden, lambda t0, t1, y: x[:, :, t0:t1].add_(y), chunk, norm_silu(scale2, shift2))
        return x

    def plain(self, x: torch.Tensor, emb: torch.Tensor | None) -> torch.Tensor:
        """`forward`'s result out of place (differentiable): x (B, C, T, H, W) -> x + the branch."""
        mods = [None] * 4
        if emb is not None:
            table = self.scale_shift_table[None, :, :, None, None, None].to(x.dtype)
            mods = list((table + emb.view(x.shape[0], 4, -1, 1, 1, 1)).unbind(1))
        shift1, scale1, shift2, scale2 = mods
        h = self.conv1.plain(norm_silu_plain(x, scale1, shift1))
        return x + self.conv2.plain(norm_silu_plain(h, scale2, shift2))


class ResStage(nn.Module):
    """`layers` res blocks at one width (Lightricks' "res_x" block, `UNetMidBlock3D`); with a timestep,
    one `time_embedder` (to 4C) shared by its blocks."""

    def __init__(self, channels: int, layers: int, causal: bool, padding: str, timestep_conditioning: bool):
        super().__init__()
        if timestep_conditioning:
            self.time_embedder = TimestepEmbedder(4 * channels)
        self.res_blocks = nn.ModuleList(ResBlock(channels, causal, padding, timestep_conditioning)
                                        for _ in range(layers))

    def forward(self, x: torch.Tensor, t: torch.Tensor | None, chunk: int) -> torch.Tensor:
        """x (B, C, T, H, W), updated in place and returned; t (B,) scaled timesteps or None."""
        if not len(self.res_blocks):
            return x
        emb = self.time_embedder(t) if t is not None else None  # (B, 4C)
        hidden = torch.empty_like(x)  # one work tensor for the stage's blocks
        for block in self.res_blocks:
            block(x, hidden, emb, chunk)
        return x

    def plain(self, x: torch.Tensor, t: torch.Tensor | None) -> torch.Tensor:
        """`forward` out of place (differentiable)."""
        emb = self.time_embedder(t) if t is not None and len(self.res_blocks) else None
        for block in self.res_blocks:
            x = block.plain(x, emb)
        return x


class Downsample(nn.Module):
    """Space-to-depth by `kind` ("space", "time", "all"), C -> C' channels (Lightricks'
    `SpaceToDepthDownsample`, "compress_*_res"): a causal conv to C'/p channels (p = positions folded,
    2 to 8), each output position gathering its p input positions as channels, plus the input folded the
    same way (C p channels) averaged over groups of C p / C' consecutive channels. A time downsample
    first repeats the clip's first frame, so 1 + 2k frames become 1 + k."""

    def __init__(self, in_channels: int, out_channels: int, kind: str, padding: str):
        super().__init__()
        self.stride = STRIDES[kind]
        self.out_channels = out_channels
        p = math.prod(self.stride)
        self.group = in_channels * p // out_channels
        self.conv = LTX2Conv3d(in_channels, out_channels // p, causal=True, padding=padding)

    def forward(self, x: torch.Tensor, chunk: int) -> torch.Tensor:
        """x (B, C, T, H, W), T odd when folding time -> (B, C', (T + 1) / 2 or T, H / s, W / s)."""
        B, C, T, H, W = x.shape
        s0, s1, s2 = self.stride
        frames = [0] * (s0 - 1) + list(range(T))  # the clip the conv sees
        if len(frames) % s0:
            raise ValueError(f"Downsample: {T} frames cannot be folded in pairs (1 + 2k frames expected)")
        Tout, h, w, c = len(frames) // s0, H // s1, W // s2, self.out_channels // math.prod(self.stride)
        out = x.new_empty(B, self.out_channels, Tout, h, w)
        folded = out.view(B, c, s0, s1, s2, Tout, h, w)  # channel order (c, s0, s1, s2), as Lightricks'

        def write(t0: int, t1: int, y: torch.Tensor) -> None:  # y (B, c, t1 - t0, H, W), t0 and t1 multiples of s0
            y = y.view(B, c, (t1 - t0) // s0, s0, h, s1, w, s2).permute(0, 1, 3, 5, 7, 2, 4, 6)
            folded[:, :, :, :, :, t0 // s0:t1 // s0].copy_(y)

        step = -(-chunk // s0) * s0  # chunks of whole folds
        self.conv.run(x, write, step, frames=frames)
        # skip: the folded input averaged over groups of channels, a chunk of output frames at a time
        for a in range(0, Tout, step // s0):
            b = min(a + step // s0, Tout)
            src = x[:, :, frames[a * s0:b * s0]]  # (B, C, (b - a) s0, H, W), the first frame repeated
            src = src.view(B, C, b - a, s0, h, s1, w, s2).permute(0, 1, 3, 5, 7, 2, 4, 6)
            out[:, :, a:b].add_(src.reshape(B, self.out_channels, self.group, b - a, h, w).mean(2))
        return out

    def plain(self, x: torch.Tensor) -> torch.Tensor:
        """`forward` out of place (differentiable): the conv and the skip over the whole clip at once."""
        B, C, T, H, W = x.shape
        s0, s1, s2 = self.stride
        frames = [0] * (s0 - 1) + list(range(T))
        if len(frames) % s0:
            raise ValueError(f"Downsample: {T} frames cannot be folded in pairs (1 + 2k frames expected)")
        Tout, h, w = len(frames) // s0, H // s1, W // s2

        def fold(y: torch.Tensor) -> torch.Tensor:  # (B, c, Tout s0, H, W) -> (B, c, s0, s1, s2, Tout, h, w)
            return y.view(y.shape[0], y.shape[1], Tout, s0, h, s1, w, s2).permute(0, 1, 3, 5, 7, 2, 4, 6)

        y = fold(self.conv.plain(x, frames)).reshape(B, self.out_channels, Tout, h, w)
        skip = fold(x[:, :, frames]).reshape(B, self.out_channels, self.group, Tout, h, w).mean(2)
        return y + skip                                                    # (B, C', Tout, h, w)


class Upsample(nn.Module):
    """Depth-to-space by `kind`, C -> C' channels (Lightricks' `DepthToSpaceUpsample`, "compress_*" in
    the decoder): a conv to C' p channels unfolded into p positions each; with `residual`, plus the input
    unfolded the same way (C / p channels) and repeated to C'. A time upsample drops its first output
    frame: the clip's first latent frame stands for one frame, so T frames become 2T - 1."""

    def __init__(self, in_channels: int, out_channels: int, kind: str, residual: bool, causal: bool, padding: str):
        super().__init__()
        self.stride = STRIDES[kind]
        self.out_channels = out_channels
        self.residual = residual
        self.conv = LTX2Conv3d(in_channels, out_channels * math.prod(self.stride), causal, padding)

    def forward(self, x: torch.Tensor, chunk: int) -> torch.Tensor:
        """x (B, C, T, H, W) -> (B, C', 2T - 1 or T, 2H or H, 2W or W) (a view of one output tensor)."""
        B, C, T, H, W = x.shape
        s0, s1, s2 = self.stride
        c = self.out_channels
        out = x.new_empty(B, c, T * s0, H * s1, W * s2)
        unfolded = out.view(B, c, T, s0, H, s1, W, s2)

        def write(t0: int, t1: int, y: torch.Tensor) -> None:  # y (B, c p, t1 - t0, H, W), channels (c, s0, s1, s2)
            unfolded[:, :, t0:t1].copy_(y.view(B, c, s0, s1, s2, t1 - t0, H, W).permute(0, 1, 5, 2, 6, 3, 7, 4))

        self.conv.run(x, write, chunk)
        if self.residual:  # + x unfolded (C / p channels), repeated p c / C times along channels: a broadcast add
            p = math.prod(self.stride)
            x_up = x.view(B, C // p, s0, s1, s2, T, H, W)
            x_up = x_up.permute(0, 1, 5, 2, 6, 3, 7, 4)  # (B, C/p, T, s0, H, s1, W, s2)
            out.view(B, p * c // C, C // p, T, s0, H, s1, W, s2).add_(x_up[:, None])
        return out[:, :, s0 - 1:]

    def plain(self, x: torch.Tensor) -> torch.Tensor:
        """`forward` out of place (differentiable)."""
        B, C, T, H, W = x.shape
        s0, s1, s2 = self.stride
        c = self.out_channels
        y = self.conv.plain(x).view(B, c, s0, s1, s2, T, H, W).permute(0, 1, 5, 2, 6, 3, 7, 4)  # (B, c, T, s0, H, s1, W, s2)
        if self.residual:
            p = math.prod(self.stride)
            x_up = x.view(B, C // p, s0, s1, s2, T, H, W).permute(0, 1, 5, 2, 6, 3, 7, 4)
            y = (y.reshape(B, p * c // C, C // p, T, s0, H, s1, W, s2) + x_up[:, None])
        return y.reshape(B, c, T * s0, H * s1, W * s2)[:, :, s0 - 1:]     # (B, C', 2T - 1 or T, ...)
