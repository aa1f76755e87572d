"""The causal video VAE's layers (Wan 2.1 / Wan 2.2), used by `vae.py`'s encoder and decoder.

Every layer takes `(x, cache)` with x (B, C, T, H, W), T the frames of one chunk, and carries
whatever it needs from the previous chunk in the one `CausalCache` of the pass:

    CausalCache      the past frames of every causal layer, the shared conv window (no autograd)
    _conv            conv3d: a matrix product for 1x1x1, oneDNN on CPU, channels-last kept
    CausalConv3d     output frame t sees input frames <= t (zeros or the cache before)
    RMS_norm         Wan's channel RMS norm, optionally fused with the SiLU after it
    ResidualBlock    norm, SiLU, conv, norm, SiLU, dropout, conv, plus a 1x1 shortcut    C -> C'
    AttentionBlock   single-head attention over the H x W positions of each frame
    Resample         2x space, optionally 2x time, up or down (no-grad: phase convs for up)
    Down_/Up_ResidualBlock   Wan 2.2: res blocks + Resample + parameter-free shortcut

Without autograd the layers work in place and in channels-last-3d memory; with autograd they
take the plain, differentiable path (the same function). Parameter names are Wan's checkpoint names.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from video_dit.models.causal_conv import CausalCache, CausalConv3d, RMS_norm, conv3d, empty_channels_last, inplace_ok

# ---------------------------------------------------------------- the chunk cache



# ---------------------------------------------------------------- layers



class ResidualBlock(nn.Module):
    """norm -> SiLU -> causal conv -> norm -> SiLU -> dropout -> causal conv, plus a 1x1 shortcut."""

    def __init__(self, in_dim: int, out_dim: int, dropout: float = 0.0):
        super().__init__()
        # Sequential only to keep the checkpoint names (residual.0/2/3/6); forward below.
        self.residual = nn.Sequential(
            RMS_norm(in_dim, images=False), nn.SiLU(), CausalConv3d(in_dim, out_dim, 3, padding=1),
            RMS_norm(out_dim, images=False), nn.SiLU(), nn.Dropout(dropout),
            CausalConv3d(out_dim, out_dim, 3, padding=1))
        self.shortcut = CausalConv3d(in_dim, out_dim, 1) if in_dim != out_dim else nn.Identity()

    def forward(self, x: torch.Tensor, cache: CausalCache) -> torch.Tensor:
        """x (B, C_in, T, H, W) -> (B, C_out, T, H, W)."""
        norm1, _, conv1, norm2, _, dropout, conv2 = self.residual
        h = self.shortcut(x)
        y = conv1(x, cache, norm=norm1)  # SiLU(norm(x)) goes straight into conv1's input window
        if dropout.p and self.training:
            y = conv2(dropout(norm2(y, silu=True)), cache)
        else:
            y = conv2(y, cache, norm=norm2)
        return y.add_(h) if inplace_ok() else y + h


class AttentionBlock(nn.Module):
    """Single-head self-attention over the H x W positions of each frame (no mixing in time)."""

    def __init__(self, dim: int):
        super().__init__()
        self.norm = RMS_norm(dim)
        self.to_qkv = nn.Conv2d(dim, dim * 3, 1)
        self.proj = nn.Conv2d(dim, dim, 1)

    def forward(self, x: torch.Tensor, cache: CausalCache | None = None) -> torch.Tensor:
        """x (B, C, T, H, W) -> same shape."""
        B, C, T, H, W = x.shape
        t = self.norm(x).permute(0, 2, 3, 4, 1).reshape(B * T, H * W, C)  # (BT, HW, C)
        q, k, v = F.linear(t, self.to_qkv.weight.view(3 * C, C), self.to_qkv.bias).chunk(3, dim=-1)
        t = F.scaled_dot_product_attention(q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1)).squeeze(1)
        t = F.linear(t, self.proj.weight.view(C, C), self.proj.bias)  # (BT, HW, C)
        t = t.view(B, T, H, W, C).permute(0, 4, 1, 2, 3)  # (B, C, T, H, W), channels-last strides
        return t.add_(x) if inplace_ok() else t + x


def _frame_conv(conv: nn.Conv2d, x: torch.Tensor, stride: int = 1, padding: int = 0) -> torch.Tensor:
    """A 2D conv applied to every frame, as a (1, k, k) Conv3d (no (B T) reshape copies)."""
    return conv3d(x, conv.weight.unsqueeze(2), conv.bias, (1, stride, stride), (0, padding, padding))


def _fold_taps(w: torch.Tensor, dim: int, phase: int) -> torch.Tensor:
    """The 3 taps of w along `dim` (offsets -1, 0, +1 on the 2x-upsampled grid) as the 2 taps they
    become on the input grid for output phase 0 (rows 2i: input i-1, i, i) or 1 (2i+1: i, i, i+1)."""
    w0, w1, w2 = w.unbind(dim)
    return torch.stack((w0, w1 + w2) if phase == 0 else (w0 + w1, w2), dim)


def _up2_conv(conv: nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    """Nearest 2x upsampling, then `conv` (3x3, padding 1), per frame, computed at x's resolution
    (no autograd): output pixel (2i + a, 2j + b) depends only on input pixels i-1..i+1 x j-1..j+1,
    so each phase (a, b) is a 2x2 conv whose taps are sums of the 3x3 taps that land on one input
    pixel. One conv (2x2, padding 1) computes the four phases as 4 x C' channels; each is cropped
    into its interleaved place. 16 instead of 36 multiply-adds per input pixel and channel pair,
    and no upsampled copy of x. (B, C, T, H, W) -> (B, C', T, 2H, 2W)."""
    B, _, T, H, W = x.shape
    phases = [(a, b) for a in (0, 1) for b in (0, 1)]
    weight = torch.cat([_fold_taps(_fold_taps(conv.weight, 2, a), 3, b) for a, b in phases])  # (4C', C, 2, 2)
    y = conv3d(x, weight.unsqueeze(2), conv.bias.repeat(4), padding=(0, 1, 1))  # (B, 4C', T, H + 1, W + 1)
    C = conv.out_channels
    out = empty_channels_last(B, C, T, 2 * H, 2 * W, like=y)
    for k, (a, b) in enumerate(phases):  # phase (a, b) reads input rows i-1+a, i+a: output row i+a
        out[..., a::2, b::2] = y[:, k * C:(k + 1) * C, :, a:a + H, b:b + W]
    return out


class Resample(nn.Module):
    """2x spatial up/down sampling per frame, optionally with 2x temporal up/down sampling.

    Time, causally: `downsample3d` keeps frame 0 and maps frames (2j-2, 2j-1, 2j) to frame j;
    `upsample3d` keeps frame 0 and turns each later frame into two (a causal conv to 2C channels,
    then channel halves interleaved in time). So F = 1 + 4k pixel frames <-> 1 + k latent frames.
    """

    MODES = ("upsample2d", "upsample3d", "downsample2d", "downsample3d")

    def __init__(self, dim: int, mode: str, out_dim: int | None = None):
        super().__init__()
        if mode not in self.MODES:
            raise ValueError(f"Resample mode {mode!r}; accepted: {', '.join(self.MODES)}")
        self.mode = mode
        if mode.startswith("up"):
            # Index 0 was Wan's nearest-exact 2x Upsample (no weights); done in forward.
            self.resample = nn.Sequential(nn.Identity(), nn.Conv2d(dim, out_dim or dim, 3, padding=1))
            if mode == "upsample3d":
                self.time_conv = CausalConv3d(dim, dim * 2, (3, 1, 1), padding=(1, 0, 0))
        else:
            # Index 0 was Wan's ZeroPad2d((0, 1, 0, 1)); done in forward.
            self.resample = nn.Sequential(nn.Identity(), nn.Conv2d(dim, dim, 3, stride=2))
            if mode == "downsample3d":
                self.time_conv = CausalConv3d(dim, dim, (3, 1, 1), stride=(2, 1, 1))

    def forward(self, x: torch.Tensor, cache: CausalCache) -> torch.Tensor:
        """up: (B, C, T, H, W) -> (B, C', T or 1 + 2(T-1) on the first chunk / 2T after, 2H, 2W);
        down: (B, C, T, H, W) -> (B, C, T or 1 + (T-1)/2 / T/2, H/2, W/2)."""
        if self.mode == "upsample3d":
            x = self._time_up(x, cache)
        if self.mode.startswith("up"):
            if inplace_ok():
                return _up2_conv(self.resample[1], x)
            # nearest 2x (equal to Wan's nearest-exact at integer scale) then 3x3 conv
            x = F.interpolate(x, scale_factor=(1.0, 2.0, 2.0), mode="nearest")  # (B, C, T, 2H, 2W)
            return _frame_conv(self.resample[1], x, padding=1)
        x = _frame_conv(self.resample[1], F.pad(x, (0, 1, 0, 1)), stride=2)  # (B, C, T, H/2, W/2)
        if self.mode == "downsample3d":
            return self._time_down(x, cache)
        return x

    def _time_down(self, x: torch.Tensor, cache: CausalCache) -> torch.Tensor:
        conv = self.time_conv
        if cache.first_visit(self):  # the clip's first frame passes through; pairs after it
            y = x if x.shape[2] == 1 else torch.cat([x[:, :, :1], conv3d(x, conv.weight, conv.bias, conv.stride)], 2)
            if inplace_ok():
                cache.keep(self, x, 1)
            else:
                cache.remember(self, x[:, :, -1:])
            return y  # (B, C, 1 + (T - 1) / 2, h, w)
        if not inplace_ok():
            return conv3d(cache.with_past(self, x, 1), conv.weight, conv.bias, conv.stride)
        win = cache.window(self, x, 1)  # (B, C, 1 + T, h, w): the previous chunk's last frame first
        win[:, :, 1:].copy_(x)
        y = conv3d(win, conv.weight, conv.bias, conv.stride)  # (B, C, T / 2, h, w)
        cache.keep(self, win, 1)
        return y

    def _time_up(self, x: torch.Tensor, cache: CausalCache) -> torch.Tensor:
        first = cache.first_visit(self)
        rest = x[:, :, 1:] if first else x  # the clip's first frame is not doubled
        B, C, T, H, W = rest.shape
        head = 1 if first else 0
        out = empty_channels_last(B, C, head + 2 * T, H, W, like=x)
        if first:
            out[:, :, :1].copy_(x[:, :, :1])
        if T:
            y = self.time_conv(rest, cache)  # (B, 2C, T, H, W)
            out[:, :, head::2].copy_(y[:, :C])
            out[:, :, head + 1::2].copy_(y[:, C:])
        return out


def _avg_down(x: torch.Tensor, out_dim: int, ft: int, fs: int) -> torch.Tensor:
    """Parameter-free shortcut: fold ft x fs x fs neighbours into channels, average channel groups.
    (B, C, T, H, W) -> (B, out_dim, ceil(T / ft), H / fs, W / fs); T is zero-padded at the front."""
    x = F.pad(x, (0, 0, 0, 0, (-x.shape[2]) % ft, 0))
    B, C, T, H, W = x.shape
    x = x.view(B, C, T // ft, ft, H // fs, fs, W // fs, fs).permute(0, 1, 3, 5, 7, 2, 4, 6)
    x = x.reshape(B, out_dim, C * ft * fs * fs // out_dim, T // ft, H // fs, W // fs)
    return x.mean(dim=2)


def _dup_up(x: torch.Tensor, out_dim: int, ft: int, fs: int, first: bool) -> torch.Tensor:
    """Parameter-free shortcut, the inverse layout of `_avg_down`: repeat channels, unfold them into
    ft x fs x fs neighbours. (B, C, T, H, W) -> (B, out_dim, ft T (- ft + 1 if first), fs H, fs W)."""
    B, C, T, H, W = x.shape
    x = x.repeat_interleave(out_dim * ft * fs * fs // C, dim=1)
    x = x.view(B, out_dim, ft, fs, fs, T, H, W).permute(0, 1, 5, 2, 6, 3, 7, 4)
    x = x.reshape(B, out_dim, T * ft, H * fs, W * fs)
    return x[:, :, ft - 1:] if first else x


class Down_ResidualBlock(nn.Module):
    """Wan 2.2: res blocks + Resample, plus a parameter-free space/time-to-channel average shortcut."""

    def __init__(self, in_dim, out_dim, dropout, mult, temperal_downsample=False, down_flag=False):
        super().__init__()
        self.out_dim = out_dim
        self.ft, self.fs = (2 if temperal_downsample else 1), (2 if down_flag else 1)
        blocks = [ResidualBlock(in_dim if i == 0 else out_dim, out_dim, dropout) for i in range(mult)]
        if down_flag:
            blocks.append(Resample(out_dim, "downsample3d" if temperal_downsample else "downsample2d"))
        self.downsamples = nn.Sequential(*blocks)

    def forward(self, x: torch.Tensor, cache: CausalCache) -> torch.Tensor:
        """x (B, C, T, H, W) -> (B, C', T / ft, H / fs, W / fs) (first chunk: 1 frame stays 1)."""
        shortcut = _avg_down(x, self.out_dim, self.ft, self.fs)
        for block in self.downsamples:
            x = block(x, cache)
        return x.add_(shortcut) if inplace_ok() else x + shortcut


class Up_ResidualBlock(nn.Module):
    """Wan 2.2: res blocks + Resample, plus a parameter-free channel-to-space/time duplicate shortcut."""

    def __init__(self, in_dim, out_dim, dropout, mult, temperal_upsample=False, up_flag=False):
        super().__init__()
        self.out_dim, self.up = out_dim, up_flag
        self.ft = 2 if temperal_upsample else 1
        blocks = [ResidualBlock(in_dim if i == 0 else out_dim, out_dim, dropout) for i in range(mult)]
        if up_flag:
            blocks.append(Resample(out_dim, "upsample3d" if temperal_upsample else "upsample2d", out_dim))
        self.upsamples = nn.Sequential(*blocks)

    def forward(self, x: torch.Tensor, cache: CausalCache) -> torch.Tensor:
        """x (B, C, T, H, W) -> (B, C', T * ft (first chunk: 1 + ft (T - 1)), 2H, 2W) or same size."""
        first = cache.first_visit(self)
        shortcut = _dup_up(x, self.out_dim, self.ft, 2, first) if self.up else None
        for block in self.upsamples:
            x = block(x, cache)
        if shortcut is None:
            return x
        return x.add_(shortcut) if inplace_ok() else x + shortcut
