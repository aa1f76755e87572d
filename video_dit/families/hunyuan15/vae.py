"""The HunyuanVideo 1.5 VAE (causal, 16x space, 4x time, 32 latent channels), weight-compatible with
Tencent's release (`vae/` of tencent/HunyuanVideo-1.5), diffusers' `AutoencoderKLHunyuanVideo15` and
ComfyUI's files (key names and configs: `convert_vae.py`).

Dataflow (released sizes: widths 128, 256, 512, 1024, 1024; 2 res blocks per level; z = 32)

    video (B, 3, F, H, W) in [-1, 1], F = 4k + 1, H and W multiples of 16
      -> chunks of K latent frames (pixel frames 1 + 4 (K - 1), then 4K at a time), K the fewest latent
         frames holding `chunk_cells` positions, each through the encoder with one HY15Cache:
         conv_in                                       (B, 128, T, H, W)         } groups of frames
         level 0: res x2, down 2x space                (B, 256, T, H/2, W/2)     } of `chunk_cells`
         level 1: res x2, down 2x space                (B, 512, T, H/4, W/4)     } positions (one
         level 2: res x2, down 2x space + 2x time      (B, 1024, T/2, H/8, W/8)    frame at 480p)
         level 3: res x2, down 2x space + 2x time      (B, 1024, T/4, h, w)      h, w = H/16, W/16
         level 4: res x2; mid: res, attention over every frame so far, res
         norm, SiLU, conv_out + channel-group mean     (B, 2z, K, h, w)          (the clip's first
      -> posterior: mean, logvar                       (B, z, F', h, w)           frame: T/2 -> 1 +
    z (B, z, F', h, w)                                   F' = (F - 1) / 4 + 1      (T - 1) / 2, ...)
      -> chunks of K latent frames through the decoder with one HY15Cache:
         conv_in + channel repeat                      (B, 1024, K, h, w)
         mid: res, attention over every frame so far, res
         level 0: res x3, up 2x space + 2x time        (B, 1024, 2K, H/8, W/8)   (the clip's first
         level 1: res x3, up 2x space + 2x time        (B, 512, 4K, H/4, W/4)     frame stays one)
         level 2: res x3, up 2x space                  (B, 256, 4K, H/2, W/2)    } groups of frames
         level 3: res x3, up 2x space                  (B, 128, 4K, H, W)        } of `chunk_cells`
         level 4: res x3; norm, SiLU, conv_out         (B, 3, 4K, H, W)          } positions
      -> clamp                                         (B, 3, F, H, W) in [-1, 1]

Causality is a property of one layer: `HY15CausalConv3d` sees only past frames, which come either
from replicating the clip's first frame (the reference pads with mode="replicate", in time and in
space) or from the `HY15Cache` (the previous chunk). The mid-block attention is causal by frame:
a position attends to every position of its own and earlier frames, whose keys and values the same
cache keeps. Every layer takes `(x, cache)`; the cache is the only state carried between chunks, so
chunked and whole-clip passes give the same result (tested). Parameter names are Tencent's
checkpoint names (`encoder.down.0.block.0.conv1.conv.weight`, `encoder.mid.attn_1.q.weight`, ...).

Shared with the Wan VAE (`video_dit/models/causal_conv.py`, the same math): the chunk cache it extends, the channel
RMS norm, the conv kernel dispatch and the posterior (`vae.py`). What differs lives here: replicate
padding, pixel-(un)shuffle resampling with parameter-free shortcuts, frame-causal attention. On the
CPU without autograd, the causal convs of `WINOGRAD_CHANNELS` input channels or more run as Winograd
F(4x4, 3x3) (`kernels/winograd.py`; the same values within float32 rounding).

Where Tencent's code (hyvideo/models/autoencoders/hunyuanvideo_15_vae.py) and diffusers disagree,
Tencent's is followed: see the comments at `RMS_norm` use, `enable_tiling` and `normalize`.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn

from video_dit.kernels import winograd
from video_dit.models.causal_conv import (
    CausalCache,
    DiagonalGaussian,
    RMS_norm,
    conv3d,
    empty_channels_last,
    inplace_ok,
)
from video_dit.models.common import parameter_generator
from video_dit.models.causal_conv import FirstFrameKept

# ---------------------------------------------------------------- configuration


@dataclass
class HY15VAEConfig(FirstFrameKept):
    """Field names are diffusers' `AutoencoderKLHunyuanVideo15` constructor names (Tencent's config says
    `ffactor_spatial` / `ffactor_temporal` for the two ratios and adds `shift_factor`)."""

    in_channels: int = 3
    out_channels: int = 3
    latent_channels: int = 32
    block_out_channels: tuple[int, ...] = (128, 256, 512, 1024, 1024)
    layers_per_block: int = 2
    spatial_compression_ratio: int = 16
    temporal_compression_ratio: int = 4
    downsample_match_channel: bool = True
    upsample_match_channel: bool = True
    # The DiT sees (z - shift_factor) * scaling_factor (`normalize`); the release has no shift.
    scaling_factor: float = 1.03682
    shift_factor: float | None = None

    def __post_init__(self):
        self.block_out_channels = tuple(self.block_out_channels)
        widths, z = self.block_out_channels, self.latent_channels
        for name in ("spatial_compression_ratio", "temporal_compression_ratio"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"HY15VAEConfig.{name}={v}; accepted: a power of two (1, 2, 4, 8, 16, ...)")
        if self.temporal_compression_ratio > self.spatial_compression_ratio:
            raise ValueError(f"HY15VAEConfig.temporal_compression_ratio={self.temporal_compression_ratio} exceeds "
                             f"spatial_compression_ratio={self.spatial_compression_ratio}: every temporal "
                             "resample is also a spatial one")
        if len(widths) <= self.spatial_levels:
            raise ValueError(f"HY15VAEConfig.block_out_channels has {len(widths)} entries; spatial_compression_ratio="
                             f"{self.spatial_compression_ratio} needs at least {self.spatial_levels + 1}")
        if self.layers_per_block < 1:
            raise ValueError(f"HY15VAEConfig.layers_per_block={self.layers_per_block}; accepted: >= 1")
        if widths[-1] % (2 * z):
            raise ValueError(f"HY15VAEConfig.block_out_channels[-1]={widths[-1]} must be a multiple of "
                             f"2 * latent_channels = {2 * z} (the encoder's channel-group mean shortcut)")
        if self.scaling_factor <= 0:
            raise ValueError(f"HY15VAEConfig.scaling_factor={self.scaling_factor}; accepted: > 0")
        for cin, cout, temporal in self.resamples("down"):
            f = 8 if temporal else 4
            if cout % f or (f * cin) % cout or (temporal and (4 * cin) % cout):
                raise ValueError(f"HY15VAEConfig: a {'2x time + ' if temporal else ''}2x space downsample from "
                                 f"{cin} to {cout} channels needs {cout} divisible by {f} and {cout} dividing "
                                 f"{4 * cin if temporal else f * cin} (block_out_channels={list(widths)})")
        for cin, cout, temporal in self.resamples("up"):
            if (4 * cout) % cin or (temporal and cin % 8):
                raise ValueError(f"HY15VAEConfig: a {'2x time + ' if temporal else ''}2x space upsample from "
                                 f"{cin} to {cout} channels needs {cin} dividing {4 * cout}"
                                 f"{' and a multiple of 8' if temporal else ''} (block_out_channels={list(widths)})")

    @property
    def spatial_levels(self) -> int:
        return int(math.log2(self.spatial_compression_ratio))

    @property
    def temporal_levels(self) -> int:
        return int(math.log2(self.temporal_compression_ratio))

    def resamples(self, which: str) -> list[tuple[int, int, bool]]:
        """(in channels, out channels, also 2x in time) of each encoder ("down") or decoder ("up")
        resample, level by level; the temporal ones are the encoder's last / the decoder's first."""
        s, t = self.spatial_levels, self.temporal_levels
        widths = self.block_out_channels if which == "down" else self.block_out_channels[::-1]
        match = self.downsample_match_channel if which == "down" else self.upsample_match_channel
        return [(widths[i], widths[i + 1] if match else widths[i], i >= s - t if which == "down" else i < t)
                for i in range(s)]

    # The names `CausalVideoVAE`'s callers read.
    @property
    def z_dim(self) -> int:
        return self.latent_channels

    @property
    def spatial_compression(self) -> int:
        return self.spatial_compression_ratio

    @property
    def temporal_compression(self) -> int:
        return self.temporal_compression_ratio

    @classmethod
    def from_dict(cls, d: dict) -> "HY15VAEConfig":
        """Build from a dict of field names; an unknown key is an error naming the nearest one."""
        names = [f.name for f in fields(cls)]
        for key in d:
            if key not in names:
                close = difflib.get_close_matches(key, names, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise ValueError(f"unknown HY15VAEConfig key {key!r}{hint}; valid keys: {', '.join(names)}")
        return cls(**d)


# The released VAE (tencent/HunyuanVideo-1.5 vae/config.json; diffusers' defaults are the same numbers).
HY15_VAE_CONFIG = HY15VAEConfig()
# For tests: 8 to 16 channels, one res block per level, still 16x space and 4x time, 4 latent channels.
HY15_VAE_TINY = HY15VAEConfig(latent_channels=4, block_out_channels=(8, 8, 16, 16, 16), layers_per_block=1)


# ---------------------------------------------------------------- the chunk cache


class HY15Cache(CausalCache):
    """The state carried between chunks for ONE encode or decode pass: the Wan VAE's `CausalCache`
    (every causal conv's past frames, each resample's first-frame flag, one shared conv workspace)
    plus the keys and values of every frame each attention layer has seen.

    `last` is set while the layers see their final input of the pass (the last chunk, and in it the
    last group of frames): they then keep nothing and drop what they held, so a pass in one chunk
    holds no past at all and a long one frees its pasts as the last chunk moves down the network."""

    def __init__(self):
        super().__init__()
        self._kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.last = False

    def keep_or_drop(self, layer: nn.Module, frames: torch.Tensor, n: int) -> None:
        """`keep` the last n frames `layer` saw, or, on its last input, forget its past."""
        if self.last:
            self._past.pop(id(layer), None)
        else:
            self.keep(layer, frames, n)

    def padded_window(self, layer: nn.Module, x: torch.Tensor, n: int, p: int) -> torch.Tensor:
        """No autograd: a window (B, C, n + T, H + 2p, W + 2p) for x (B, C, T, H, W) whose first n
        frames hold `layer`'s padded past (zeros before its first chunk); the rest is uninitialised."""
        B, C, T, H, W = x.shape
        # `window` reads only the shape, dtype and device of its argument: a free view of that shape
        return self.window(layer, x[:, :, :, :1, :1].expand(B, C, T, H + 2 * p, W + 2 * p), n)

    def attention_past(self, layer: nn.Module, k: torch.Tensor, v: torch.Tensor):
        """(K, V) of every frame `layer` has seen, this chunk's last: (B, S + L, C) each for this
        chunk's (B, L, C), S the positions of the earlier chunks."""
        past = self._kv.pop(id(layer), None)
        if past is not None:
            k, v = torch.cat([past[0], k], 1), torch.cat([past[1], v], 1)
        if not self.last:
            self._kv[id(layer)] = (k, v)
        return k, v


# ---------------------------------------------------------------- layers


def _replicate_edges(x: torch.Tensor, p: int) -> None:
    """In place: fill the p-wide border of x (..., H + 2p, W + 2p) by repeating its inner edge pixels
    (rows first, then columns over the full height, so corners repeat the corner pixel)."""
    if p == 0:
        return
    H, W = x.shape[-2] - 2 * p, x.shape[-1] - 2 * p
    top, bottom = x[..., p:p + 1, p:p + W], x[..., p + H - 1:p + H, p:p + W]
    x[..., :p, p:p + W].copy_(top.expand(*top.shape[:-2], p, W))
    x[..., p + H:, p:p + W].copy_(bottom.expand(*bottom.shape[:-2], p, W))
    left, right = x[..., :, p:p + 1], x[..., :, p + W - 1:p + W]
    x[..., :, :p].copy_(left.expand(*left.shape[:-1], p))
    x[..., :, p + W:].copy_(right.expand(*right.shape[:-1], p))


_CL = torch.channels_last_3d
# From this many input channels a causal conv keeps its weight in Winograd's tap layout on the CPU and runs
# as Winograd F(4x4, 3x3) without autograd (`kernels/winograd.py`): 0.40x oneDNN's time at 1024 channels,
# 0.46-0.67x at 512, 0.61-0.81x at 256, 1.2-1.3x at 128 (one thread, this project's 2-core CPU).
# Every other conv keeps a channels-last weight.
WINOGRAD_CHANNELS = 256


def _winograd(weight: torch.Tensor) -> bool:
    """Does this causal conv run as Winograd? Its weight says so: `HunyuanVideo15VAE.conv_formats` keeps
    a wide layer's weight on the CPU in the tap layout (and every other one channels-last)."""
    return weight.device.type == "cpu" and winograd.in_tap_layout(weight)


def _window_conv(win: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """conv3d without padding of a causal window (B, C, T + k - 1, H + k - 1, W + k - 1) ->
    (B, C', T, H, W), no autograd. A weight in the tap layout runs as Winograd (`winograd.conv3d`).
    Otherwise on the CPU, a call with few output positions (B T H W under 256 and under the output
    channels: the lowest levels of small frames) is one matrix product over the k^3 shifted copies of
    the channels-last window (im2col: (B T H W, k^3 C) x (k^3 C, C')): oneDNN reorders the whole
    weight on every call, which there costs several times the convolution (a 1024 -> 1024 conv on
    64 positions: 47 ms instead of 125). Otherwise `conv3d` (oneDNN on the CPU)."""
    if _winograd(weight):
        return winograd.conv3d(win, winograd.taps(weight), bias)
    B, C, Tw, Hw, Ww = win.shape
    Co, k = weight.shape[0], weight.shape[2:]
    T, H, W = Tw - k[0] + 1, Hw - k[1] + 1, Ww - k[2] + 1
    if win.device.type != "cpu" or B * T * H * W >= min(Co, 256):
        return conv3d(win, weight, bias)
    cols = winograd.im2col(win, k, [(a, b, c) for a in range(k[0]) for b in range(k[1]) for c in range(k[2])])
    w = weight.permute(0, 2, 3, 4, 1).reshape(Co, -1)  # (C', k^3 C), a view of the channels-last weight
    y = torch.addmm(bias, cols, w.t())  # (B T H W, C')
    return y.view(B, T, H, W, Co).permute(0, 4, 1, 2, 3)  # (B, C', T, H, W), channels-last


class HY15CausalConv3d(nn.Module):
    """Conv3d (k, k, k), stride 1, whose time window reaches only into the past: output frame t sees
    input frames t - k + 1 .. t. Padding is replicate, as the reference's: before the clip its first
    frame stands in for the missing past, and k // 2 edge pixels repeat on each side in space.
    The weights sit under `.conv` (checkpoint names `conv_in.conv.weight`)."""

    def __init__(self, in_dim: int, out_dim: int, kernel_size: int = 3):
        super().__init__()
        self.conv = nn.Conv3d(in_dim, out_dim, kernel_size)
        self.past, self.pad = kernel_size - 1, kernel_size // 2

    def forward(self, x: torch.Tensor, cache: HY15Cache, norm: RMS_norm | None = None) -> torch.Tensor:
        """x (B, C, T, H, W) -> (B, C', T, H, W). With `norm`, the conv's input is SiLU(norm(x)),
        written straight into the cache's window (no autograd)."""
        n, p, w, b = self.past, self.pad, self.conv.weight, self.conv.bias
        if not inplace_ok():  # autograd: concatenate and pad; no buffer is reused
            x = norm(x, silu=True) if norm is not None else x
            if cache.fresh(self):  # the clip's first frame stands for the frames before it
                cache.remember(self, x[:, :, :1].expand(-1, -1, n, -1, -1))
            x = cache.with_past(self, x, n)  # (B, C, n + T, H, W)
            return conv3d(F.pad(x, (p, p, p, p, 0, 0), mode="replicate"), w, b)
        B, _, T, H, W = x.shape
        seen = cache.frames_before(self, T)
        win = cache.padded_window(self, x, n, p)  # (B, C, n + T, H + 2p, W + 2p), past frames in place
        body = win[:, :, n:]
        if norm is not None:
            norm(x, silu=True, out=body[..., p:p + H, p:p + W])
        else:
            body[..., p:p + H, p:p + W].copy_(x)
        _replicate_edges(body, p)
        if seen == 0:  # the clip starts in this chunk: its first frame, repeated, is the past
            win[:, :, :n].copy_(body[:, :, :1].expand(-1, -1, n, -1, -1))
            wino = _winograd(w)
            if T == 1 and w.dtype in (torch.float32, torch.float64) and (wino or B * H * W >= w.shape[0]):
                # and it is alone: the n + 1 taps all see it and fold into one (a third of the work
                # where the frame is large; where the weight is the larger, summing it costs more, but
                # less than Winograd's transform of three taps; not in half precision, where the summed
                # weight would be rounded once more)
                if wino:
                    y = winograd.conv3d(body, winograd.taps(w).sum(1, keepdim=True), b)  # taps (9, 1, C, C')
                else:
                    y = conv3d(body, sum(w.narrow(2, i, 1) for i in range(n + 1)), b)  # (C', C, 1, k, k)
                cache.keep_or_drop(self, win, n)
                return y
        y = _window_conv(win, w, b)
        cache.keep_or_drop(self, win, n)
        return y


def _conv1x1(conv: nn.Conv3d, x: torch.Tensor) -> torch.Tensor:
    return conv3d(x, conv.weight, conv.bias)


class HY15ResBlock(nn.Module):
    """norm -> SiLU -> causal conv -> norm -> SiLU -> causal conv, plus x (a 1x1 conv when C changes)."""

    def __init__(self, in_dim: int, out_dim: int):
        super().__init__()
        # RMS_norm (the Wan VAE's: x / ||x|| * sqrt(C) * gamma) computes half-precision inputs in float32.
        # Tencent's code calls F.normalize in the input dtype, but its pipeline runs the VAE under CUDA
        # fp16 autocast, where `norm` is on the float32 list and the division promotes: float32, as
        # here (followed where the two differ). diffusers upcasts too but rounds the normalised values
        # back to half before gamma. In float32, where the parity tests compare, all three agree.
        self.norm1 = RMS_norm(in_dim, images=False)
        self.conv1 = HY15CausalConv3d(in_dim, out_dim)
        self.norm2 = RMS_norm(out_dim, images=False)
        self.conv2 = HY15CausalConv3d(out_dim, out_dim)
        self.nin_shortcut = nn.Conv3d(in_dim, out_dim, 1) if in_dim != out_dim else None

    def forward(self, x: torch.Tensor, cache: HY15Cache) -> torch.Tensor:
        """x (B, C_in, T, H, W) -> (B, C_out, T, H, W)."""
        h = x if self.nin_shortcut is None else _conv1x1(self.nin_shortcut, x)
        y = self.conv1(x, cache, norm=self.norm1)  # SiLU(norm(x)) goes straight into conv1's window
        y = self.conv2(y, cache, norm=self.norm2)
        return y.add_(h) if inplace_ok() else y + h


class HY15Attention(nn.Module):
    """Single-head attention over space and time, causal by frame: a position of frame t attends to
    every position of frames <= t (the reference's block mask), past frames' keys and values from
    the cache."""

    def __init__(self, dim: int):
        super().__init__()
        self.norm = RMS_norm(dim, images=False)
        self.q, self.k, self.v, self.proj_out = (nn.Conv3d(dim, dim, 1) for _ in range(4))

    def forward(self, x: torch.Tensor, cache: HY15Cache) -> torch.Tensor:
        """x (B, C, T, H, W) -> same shape."""
        B, C, T, H, W = x.shape
        L = H * W
        t = self.norm(x).permute(0, 2, 3, 4, 1).reshape(B, T * L, C)  # (B, T H W, C)
        q, k, v = (F.linear(t, m.weight.view(C, C), m.bias) for m in (self.q, self.k, self.v))
        k, v = cache.attention_past(self, k, v)  # (B, S + T H W, C): every frame so far
        S = k.shape[1] - T * L
        # One query frame at a time over the keys up to its own frame: the block-causal mask,
        # without building it ((T H W)^2 entries in the reference).
        frames = [F.scaled_dot_product_attention(q[:, None, i * L:(i + 1) * L], k[:, None, :S + (i + 1) * L],
                                                 v[:, None, :S + (i + 1) * L])[:, 0] for i in range(T)]
        o = frames[0] if T == 1 else torch.cat(frames, 1)  # (B, T H W, C)
        y = F.linear(o, self.proj_out.weight.view(C, C), self.proj_out.bias)
        y = y.view(B, T, H, W, C).permute(0, 4, 1, 2, 3)  # (B, C, T, H, W), channels-last strides
        return y.add_(x) if inplace_ok() else y + x


def _space_to_channels(x: torch.Tensor, rt: int) -> torch.Tensor:
    """(B, C, rt F, 2H, 2W) -> (B, rt 2 2 C, F, H, W), channel order (rt, row, col, c) as the
    reference's `b c (f r1) (h r2) (w r3) -> b (r1 r2 r3 c) f h w`; channels-last result."""
    B, C, T, H2, W2 = x.shape
    t = x.permute(0, 2, 3, 4, 1).reshape(B, T // rt, rt, H2 // 2, 2, W2 // 2, 2, C)
    t = t.permute(0, 1, 3, 5, 2, 4, 6, 7)  # (B, F, H, W, rt, 2, 2, C)
    return t.reshape(B, T // rt, H2 // 2, W2 // 2, rt * 4 * C).permute(0, 4, 1, 2, 3)


def _channels_to_space(x: torch.Tensor, rt: int) -> torch.Tensor:
    """(B, rt 2 2 C, F, H, W) -> (B, C, rt F, 2H, 2W), the inverse of `_space_to_channels`."""
    B, K, T, H, W = x.shape
    C = K // (4 * rt)
    t = x.permute(0, 2, 3, 4, 1).reshape(B, T, H, W, rt, 2, 2, C)
    t = t.permute(0, 1, 4, 2, 5, 3, 6, 7)  # (B, F, rt, H, 2, W, 2, C)
    return t.reshape(B, T * rt, 2 * H, 2 * W, C).permute(0, 4, 1, 2, 3)


def _group_mean(x: torch.Tensor, groups: int) -> torch.Tensor:
    """(B, groups g, ...) -> (B, groups, ...): the mean of each run of g consecutive channels."""
    return x.view(x.shape[0], groups, x.shape[1] // groups, *x.shape[2:]).mean(2)


class HY15Downsample(nn.Module):
    """2x space (and 2x time): a causal conv to C_out / (4 or 8) channels folded into C_out by
    space(-time)-to-channel, plus the same fold of x averaged over channel groups (no parameters).
    In time, causally: the clip's first frame alone (its fold duplicated to fill the channels),
    then frames (1, 2), (3, 4), ... pairwise. So F = 1 + 2k frames -> 1 + k."""

    def __init__(self, in_dim: int, out_dim: int, temporal: bool):
        super().__init__()
        self.temporal, self.out_dim = temporal, out_dim
        self.conv = HY15CausalConv3d(in_dim, out_dim // (8 if temporal else 4))

    def forward(self, x: torch.Tensor, cache: HY15Cache) -> torch.Tensor:
        """(B, C, T, H, W) -> (B, C', T' , H/2, W/2), T' = T (space only), T / 2, or 1 + (T - 1) / 2
        on the chunk holding the clip's first frame."""
        first = self.temporal and cache.first_visit(self)
        h = self.conv(x, cache)  # (B, C' / f, T, H, W)
        outs, skips = [], []
        if first:
            h0 = _space_to_channels(h[:, :, :1], 1)  # (B, C' / 2, 1, H/2, W/2)
            outs.append(torch.cat([h0, h0], 1))
            skips.append(_group_mean(_space_to_channels(x[:, :, :1], 1), self.out_dim))
            h, x = h[:, :, 1:], x[:, :, 1:]
        if h.shape[2]:
            rt = 2 if self.temporal else 1
            outs.append(_space_to_channels(h, rt))  # (B, C', T / rt, H/2, W/2)
            skips.append(_group_mean(_space_to_channels(x, rt), self.out_dim))
        out = outs[0] if len(outs) == 1 else torch.cat(outs, 2)
        skip = skips[0] if len(skips) == 1 else torch.cat(skips, 2)
        return out.add_(skip) if inplace_ok() else out + skip


class HY15Upsample(nn.Module):
    """2x space (and 2x time): a causal conv to C_out x (4 or 8) channels unfolded by channel-to-
    space(-time), plus x with each channel repeated (no parameters). In time, causally: the clip's
    first frame becomes one frame (the first half of its unfolded channels), every later one two."""

    def __init__(self, in_dim: int, out_dim: int, temporal: bool):
        super().__init__()
        self.temporal, self.out_dim = temporal, out_dim
        f = 8 if temporal else 4
        self.conv = HY15CausalConv3d(in_dim, out_dim * f)
        self.repeats = f * out_dim // in_dim

    def forward(self, x: torch.Tensor, cache: HY15Cache) -> torch.Tensor:
        """(B, C, T, H, W) -> (B, C', T' , 2H, 2W), T' = T (space only), 2T, or 1 + 2 (T - 1) on the
        chunk holding the clip's first frame."""
        first = self.temporal and cache.first_visit(self)
        h = self.conv(x, cache)  # (B, f C', T, H, W)
        B, C, _, H, W = x.shape
        outs = []
        # The shortcut, repeat channels then unfold, is added before the unfold: unfolded channel k
        # of the conv comes from x's channel k // repeats (the reference repeats after unfolding in
        # time; the same numbers since C is a multiple of 8).
        if first:
            h0 = h[:, :, :1].reshape(B, 4, 2 * self.out_dim, 1, H, W)[:, :, :self.out_dim]  # first half
            x0 = x[:, :, :1].repeat_interleave(self.repeats // 2, dim=1).view(B, 4, self.out_dim, 1, H, W)
            outs.append(_channels_to_space((h0 + x0).reshape(B, 4 * self.out_dim, 1, H, W), 1))
            h, x = h[:, :, 1:], x[:, :, 1:]
        if h.shape[2]:
            if inplace_ok():
                h.view(B, C, self.repeats, *h.shape[2:]).add_(x.unsqueeze(2))
            else:
                h = h + x.repeat_interleave(self.repeats, dim=1)
            outs.append(_channels_to_space(h, 2 if self.temporal else 1))  # (B, C', rt T, 2H, 2W)
        return outs[0] if len(outs) == 1 else torch.cat(outs, 2)


class _Level(nn.Module):
    """One resolution level: res blocks (`block`) and an optional `downsample` / `upsample`."""

    def __init__(self, blocks: list[nn.Module], resample: nn.Module | None, name: str):
        super().__init__()
        self.block = nn.ModuleList(blocks)
        self.layers = [*blocks, *([resample] if resample is not None else [])]  # in order (plain list)
        if resample is not None:
            setattr(self, name, resample)


class _Mid(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.block_1, self.attn_1, self.block_2 = HY15ResBlock(dim, dim), HY15Attention(dim), HY15ResBlock(dim, dim)


def _run(steps, x: torch.Tensor, cache: HY15Cache) -> torch.Tensor:
    for step in steps:
        x = step(x, cache)
    return x


def _bounds(T: int, group: int, first: bool) -> list[int]:
    """Group boundaries over T frames, `group` at a time; `first`: the clip's first frame goes alone
    (the causal convs then fold its replicated past into one tap)."""
    return [0, *range(1 if first and T > 1 else group, T, group), T]


def _group_size(cells: int, x_cells: int) -> int:
    """The fewest frames of `x_cells` positions each holding `cells` (a call's work, see `chunk_cells`)."""
    return max(1, -(-cells // x_cells))


def _fine_to_coarse(segments, x: torch.Tensor, cache: HY15Cache, cells: int, first: bool) -> torch.Tensor:
    """The encoder's head, no autograd: `segments` [(layers, scale)] in order, each keeping the frame
    count, each halving the resolution, so the later ones take more frames per call. The last runs on
    groups of its size, each group's input made by the earlier segments in their own smaller groups.
    Exact: the cache carries every layer's past from one group to the next. (B, C, T, H, W) ->
    (B, C', T, H / s, W / s)."""
    *inner, (layers, scale) = segments
    T, H, W = x.shape[2:]
    bounds = _bounds(T, _group_size(cells, H * W // scale ** 2), first)
    out, last = None, cache.last
    for a, b in zip(bounds[:-1], bounds[1:]):
        cache.last = last and b == T  # only the final group of the final chunk is anyone's last input
        y = x[:, :, a:b]
        y = _run(layers, _fine_to_coarse(inner, y, cache, cells, first and a == 0) if inner else y, cache)
        if len(bounds) == 2:
            return y
        if out is None:
            out = empty_channels_last(y.shape[0], y.shape[1], T, *y.shape[3:], like=y)
        out[:, :, a:b] = y
    cache.last = last
    return out


def _coarse_to_fine(segments, x: torch.Tensor, cache: HY15Cache, cells: int, first: bool, size) -> torch.Tensor:
    """The decoder's tail, no autograd: `segments` [(layers, scale)] in order, each keeping the frame
    count, each doubling the resolution, so the later ones take fewer frames per call: the first runs
    on groups of its size and hands each group's output to the rest, in their own smaller groups.
    `size`: the full-resolution (H, W). (B, C, T, H / s, W / s) -> (B, C', T, H, W)."""
    (layers, scale), *rest = segments
    T = x.shape[2]
    bounds = _bounds(T, _group_size(cells, size[0] * size[1] // scale ** 2), first)
    out, last = None, cache.last
    for a, b in zip(bounds[:-1], bounds[1:]):
        cache.last = last and b == T
        y = _run(layers, x[:, :, a:b], cache)
        if rest:
            y = _coarse_to_fine(rest, y, cache, cells, first and a == 0, size)
        if len(bounds) == 2:
            return y
        if out is None:
            out = empty_channels_last(y.shape[0], y.shape[1], T, *y.shape[3:], like=y)
        out[:, :, a:b] = y
    cache.last = last
    return out


def _segments(layers, resample_type, scale: int, step) -> list[tuple[list, int]]:
    """`layers` cut after each spatial resample into [(layers, scale)], the scale of each segment's
    input resolution (full / scale), changed by `step` (x2 down the encoder, /2 down the decoder)."""
    out = [([], scale)]
    for m in layers:
        out[-1][0].append(m)
        if isinstance(m, resample_type):
            scale = step(scale)
            out.append(([], scale))
    return [seg for seg in out if seg[0]]


# ---------------------------------------------------------------- encoder / decoder


class HY15Encoder(nn.Module):
    def __init__(self, cfg: HY15VAEConfig):
        super().__init__()
        widths = cfg.block_out_channels
        self.groups = 2 * cfg.latent_channels
        self.conv_in = HY15CausalConv3d(cfg.in_channels, widths[0])
        self.down = nn.ModuleList()
        resamples, dim = cfg.resamples("down"), widths[0]
        for i, width in enumerate(widths):
            blocks = [HY15ResBlock(dim if j == 0 else width, width) for j in range(cfg.layers_per_block)]
            down = HY15Downsample(*resamples[i]) if i < len(resamples) else None
            dim = resamples[i][1] if down is not None else width
            self.down.append(_Level(blocks, down, "downsample"))
        self.mid = _Mid(dim)
        self.norm_out = RMS_norm(dim, images=False)
        self.conv_out = HY15CausalConv3d(dim, 2 * cfg.latent_channels)
        # The layers in order (plain lists: the modules are registered above). The head, before the
        # first temporal downsample, is stride-1 causal convs and per-frame layers: it may run on
        # groups of frames, one group size per resolution (`_fine_to_coarse`).
        steps = [self.conv_in, *(m for level in self.down for m in level.layers)]
        until = next((i for i, m in enumerate(steps) if isinstance(m, HY15Downsample) and m.temporal), len(steps))
        self.head = _segments(steps[:until], HY15Downsample, 1, lambda s: 2 * s)
        self.tail = [*steps[until:], self.mid.block_1, self.mid.attn_1, self.mid.block_2]

    def forward(self, x: torch.Tensor, cache: HY15Cache, cells: int | None = None) -> torch.Tensor:
        """x (B, 3, T, H, W), a chunk (whole clip: F) -> moments (B, 2z, T', h, w). `cells` (no
        autograd): the head's layers take as many frames per call as hold that many positions, so
        their activations are a group's instead of the chunk's."""
        first = cache.first_visit(self)
        if cells is None or not inplace_ok():
            x = _run([m for layers, _ in self.head for m in layers], x, cache)
        else:
            x = _fine_to_coarse(self.head, x, cache, cells, first)  # (B, C, T, H / 2^k, W / 2^k)
        x = _run(self.tail, x, cache)  # (B, C, T', h, w)
        skip = _group_mean(x, self.groups)  # (B, 2z, T', h, w)
        y = self.conv_out(x, cache, norm=self.norm_out)
        return y.add_(skip) if inplace_ok() else y + skip


class HY15Decoder(nn.Module):
    def __init__(self, cfg: HY15VAEConfig):
        super().__init__()
        widths = cfg.block_out_channels[::-1]
        self.z, self.repeats = cfg.latent_channels, widths[0] // cfg.latent_channels
        self.conv_in = HY15CausalConv3d(cfg.latent_channels, widths[0])
        self.mid = _Mid(widths[0])
        self.up = nn.ModuleList()
        resamples, dim = cfg.resamples("up"), widths[0]
        for i, width in enumerate(widths):
            blocks = [HY15ResBlock(dim if j == 0 else width, width) for j in range(cfg.layers_per_block + 1)]
            up = HY15Upsample(*resamples[i]) if i < len(resamples) else None
            dim = resamples[i][1] if up is not None else width
            self.up.append(_Level(blocks, up, "upsample"))
        self.norm_out = RMS_norm(dim, images=False)
        self.conv_out = HY15CausalConv3d(dim, cfg.out_channels)
        # After the last temporal upsample every layer is a stride-1 causal conv or per frame: the
        # tail may run on groups of frames, one group size per resolution (`_coarse_to_fine`).
        steps = [self.mid.block_1, self.mid.attn_1, self.mid.block_2, *(m for level in self.up for m in level.layers)]
        start = 1 + max((i for i, m in enumerate(steps) if isinstance(m, HY15Upsample) and m.temporal), default=-1)
        self.head = steps[:start]
        tail = [*steps[start:], self._out]
        spatial_ups = sum(isinstance(m, HY15Upsample) for m in tail)
        self.tail = _segments(tail, HY15Upsample, 2 ** spatial_ups, lambda s: s // 2)

    def _out(self, x: torch.Tensor, cache: HY15Cache) -> torch.Tensor:
        return self.conv_out(x, cache, norm=self.norm_out)  # norm, SiLU, conv: (B, 3, T, H, W)

    def forward(self, z: torch.Tensor, cache: HY15Cache, cells: int | None = None) -> torch.Tensor:
        """z (B, z, T', h, w) -> (B, 3, 1 + 4 (T' - 1) on the first chunk / 4 T' after, H, W).
        `cells` (no autograd): the tail's layers take as many frames per call as hold that many positions."""
        first = cache.first_visit(self)
        x = self.conv_in(z, cache)  # (B, C, T', h, w)
        if inplace_ok():  # + z with each channel repeated
            x.view(x.shape[0], self.z, self.repeats, *x.shape[2:]).add_(z.unsqueeze(2))
        else:
            x = x + z.repeat_interleave(self.repeats, dim=1)
        x = _run(self.head, x, cache)  # (B, C, 4 T' (first chunk: 4 T' - 3), H / 2^k, W / 2^k)
        if cells is None or not inplace_ok():
            return _run([m for layers, _ in self.tail for m in layers], x, cache)
        scale = self.tail[0][1]
        return _coarse_to_fine(self.tail, x, cache, cells, first, (x.shape[-2] * scale, x.shape[-1] * scale))


# ---------------------------------------------------------------- the VAE


class HunyuanVideo15VAE(nn.Module):
    """HunyuanVideo 1.5 causal video VAE. `encode(video)` -> posterior, `decode(z)` -> video; the same
    interface as `CausalVideoVAE` (vae.py).

    Both run the clip in causal chunks (K latent frames, pixel frames 1 + 4 (K - 1) then 4K) through one
    `HY15Cache`, and the full-resolution levels in groups of frames, so memory is set by
    `chunk_cells`, not by the clip (attention's keys and values aside: h w positions per latent
    frame). `chunked=False` runs the clip whole, as the reference does. `enable_tiling` adds the
    reference's spatial tiling (off by default, as in diffusers).

    The causal convs' weights are held channels-last, the layout the no-grad path's kernels read
    without reordering the weight on every chunk (a per-call copy of each weight otherwise: time, and
    peak memory where a weight outweighs the activations); `state_dict()` returns them contiguous.
    """

    def __init__(self, config: HY15VAEConfig, seed: int | None = None):
        super().__init__()
        self.config = config
        self.encoder = HY15Encoder(config)
        self.decoder = HY15Decoder(config)
        self.tile_size: int | None = None  # pixels; None = no tiling
        self.tile_overlap_factor = 0.25
        # Positions (frames x height x width) a layer's call holds at least, the chunk's length aside:
        # a chunk is the fewest latent frames with this many latent cells (480p, 30 x 52: 3 frames; 256
        # x 256: all of a 61-frame clip), and above the temporal resamples the layers take the fewest
        # frames holding it at their resolution (480p: one). Calls below ~1000 positions run oneDNN
        # at a fraction of its speed (and, per call, reorder the weight), so smaller chunks trade time
        # for memory; memory is bounded by this, not by the clip's length.
        self.chunk_cells = 4096
        self.initialize_weights(seed)
        self.conv_formats()
        self.register_load_state_dict_post_hook(_after_load)
        self.register_state_dict_post_hook(_contiguous_state)

    @torch.no_grad()
    def conv_formats(self) -> None:
        """Give each causal conv weight the memory format its convolution runs fastest in (same values):
        channels-last, except on the CPU for float32 and float64 layers of `WINOGRAD_CHANNELS` input
        channels or more, which keep Winograd's tap layout (`_winograd`). Done on construction, after
        each `load_state_dict` and after each move (`_apply`)."""
        for m in self.modules():
            if isinstance(m, HY15CausalConv3d):
                w = m.conv.weight
                if w.device.type == "meta":
                    continue
                if (w.device.type == "cpu" and w.dtype in (torch.float32, torch.float64)
                        and w.shape[1] >= WINOGRAD_CHANNELS and w.shape[2:] == (3, 3, 3)):
                    if not winograd.in_tap_layout(w):
                        w.data = winograd.to_tap_layout(w.data)
                elif not w.is_contiguous(memory_format=_CL):
                    w.data = w.data.contiguous(memory_format=_CL)

    def _apply(self, fn, *args, **kwargs):
        out = super()._apply(fn, *args, **kwargs)
        self.conv_formats()  # a move to or from the CPU changes what runs fastest
        return out

    @torch.no_grad()
    def initialize_weights(self, seed: int | None = None) -> None:
        """PyTorch's default conv init (the reference's: weights Kaiming-uniform with a = sqrt(5), i.e.
        U(+-1/sqrt(fan_in)), biases U(+-1/sqrt(fan_in))) and RMS gammas at one, each parameter drawn in
        float32 on the CPU from its own generator seeded by (`seed`, name) and then copied: the same
        VAE on any device and dtype. `seed=None` draws the seed from torch's global RNG. A no-op on
        the meta device."""
        if self.encoder.conv_in.conv.weight.device.type == "meta":
            return
        if seed is None:
            seed = int(torch.randint(0, 2 ** 62, (), device="cpu").item())
        for name, m in self.named_modules():
            if isinstance(m, nn.Conv3d):  # every conv: causal ones (`.conv`), 1x1 shortcuts, attention
                bound = m.weight[0].numel() ** -0.5  # 1 / sqrt(fan_in)
                for pname in ("weight", "bias"):
                    p = getattr(m, pname)
                    values = torch.empty(p.shape, dtype=torch.float32)
                    values.uniform_(-bound, bound, generator=parameter_generator(seed, f"{name}.{pname}"))
                    p.copy_(values)
            elif isinstance(m, RMS_norm):  # the norms' scales
                m.gamma.fill_(1.0)
            elif next(m.parameters(recurse=False), None) is not None:
                raise ValueError(f"initialize_weights: no rule for the parameters of {name!r} "
                                 f"({type(m).__name__}); add one")

    @property
    def device(self) -> torch.device:
        return self.encoder.conv_in.conv.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.encoder.conv_in.conv.weight.dtype

    # -------------------------------------------------------- shapes

    def latent_shape(self, video_shape) -> tuple[int, ...]:
        B, _, T, H, W = video_shape
        s, t = self.config.spatial_compression, self.config.temporal_compression
        return (B, self.config.latent_channels, (T - 1) // t + 1, H // s, W // s)

    def _check_video(self, video: torch.Tensor) -> None:
        t, s, c = self.config.temporal_compression, self.config.spatial_compression, self.config.in_channels
        if video.ndim != 5 or video.shape[1] != c:
            raise ValueError(f"HunyuanVideo15VAE.encode expects video (B, {c}, F, H, W), got {tuple(video.shape)}")
        T, H, W = video.shape[2:]
        if (T - 1) % t:
            raise ValueError(f"HunyuanVideo15VAE.encode: F={T} frames; F must be {t}k + 1 (accepted: 1, {1 + t}, "
                             f"{1 + 2 * t}, ...; nearest: {(T - 1) // t * t + 1} or {((T - 1) // t + 1) * t + 1})")
        if H % s or W % s:
            raise ValueError(f"HunyuanVideo15VAE.encode: H x W = {H} x {W}; both must be multiples of {s}")

    # -------------------------------------------------------- encode / decode

    def encode(self, video: torch.Tensor, chunked: bool = True) -> DiagonalGaussian:
        """video (B, 3, F, H, W) in [-1, 1], F = 4k + 1, H, W multiples of 16 -> posterior with mean /
        logvar (B, z, F', h, w), F' = (F - 1) // 4 + 1, h, w = H / 16, W / 16. `chunked=False` runs
        the whole clip at once (same result, memory grows with F)."""
        self._check_video(video)
        if self.tile_size is not None and max(video.shape[-2:]) > self.tile_size:
            moments = self._tiled_encode(video, chunked)
        else:
            moments = self._encode(video, chunked)
        mean, logvar = moments.chunk(2, dim=1)  # (B, z, F', h, w) each
        return DiagonalGaussian(mean, logvar)

    def _encode(self, video: torch.Tensor, chunked: bool) -> torch.Tensor:
        """(B, 3, F, H, W) -> moments (B, 2z, F', h, w)."""
        B, _, frames, h, w = self.latent_shape(video.shape)
        t = self.config.temporal_compression
        k = _group_size(self.chunk_cells, h * w)  # latent frames per chunk
        latent = [*range(0, frames, k), frames] if chunked else [0, frames]
        # latent frames [a, b) come from pixel frames [4a - 3, 4b - 3) (frame 0 alone makes latent frame 0)
        bounds = [0, *(t * (j - 1) + 1 for j in latent[1:])]
        chunks = [video[:, :, a:b] for a, b in zip(bounds[:-1], bounds[1:])]
        cache = HY15Cache()
        if torch.is_grad_enabled():  # training: keep the autograd graph, concatenate once
            return torch.cat([self.encoder(c, cache) for c in chunks], 2)
        out, frame = None, 0
        for i, c in enumerate(chunks):
            cache.last = i == len(chunks) - 1
            y = self.encoder(c, cache, self.chunk_cells if chunked else None)  # (B, 2z, K, h, w)
            if out is None:  # allocated once; every chunk writes its latent frames in place
                out = y.new_empty(B, y.shape[1], frames, h, w)
            out[:, :, frame:frame + y.shape[2]] = y
            frame += y.shape[2]
        return out

    def decode(self, z: torch.Tensor, chunked: bool = True, clamp: bool = True) -> torch.Tensor:
        """z (B, z, F', h, w) (VAE latents: `denormalize` DiT latents first) -> video (B, 3, F, H, W),
        F = 4 (F' - 1) + 1, in [-1, 1] unless `clamp=False` (the reference does not clamp; its pipelines
        clamp after mapping to [0, 1], the same thing). `chunked=False` decodes all frames at once."""
        if z.ndim != 5 or z.shape[1] != self.config.latent_channels:
            raise ValueError(f"HunyuanVideo15VAE.decode expects latents (B, {self.config.latent_channels}, "
                             f"F', h, w), got {tuple(z.shape)}")
        s = self.config.spatial_compression
        if self.tile_size is not None and max(z.shape[-2:]) > self.tile_size // s:
            y = self._tiled_decode(z, chunked)
        else:
            y = self._decode(z, chunked)
        if not clamp:
            return y
        return y.clamp_(-1.0, 1.0) if inplace_ok() else y.clamp(-1.0, 1.0)

    def _decode(self, z: torch.Tensor, chunked: bool) -> torch.Tensor:
        """(B, z, F', h, w) -> video (B, 3, F, H, W), unclamped."""
        cfg, (B, _, T, h, w) = self.config, z.shape
        s, t = cfg.spatial_compression, cfg.temporal_compression
        k = _group_size(self.chunk_cells, h * w)  # latent frames per chunk
        bounds = [*range(0, T, k), T] if chunked else [0, T]
        chunks = [z[:, :, a:b] for a, b in zip(bounds[:-1], bounds[1:])]
        cache = HY15Cache()
        if torch.is_grad_enabled():
            return torch.cat([self.decoder(c, cache) for c in chunks], 2)
        out = torch.empty(B, cfg.out_channels, (T - 1) * t + 1, h * s, w * s, dtype=z.dtype, device=z.device)
        frame = 0
        for i, c in enumerate(chunks):
            cache.last = i == len(chunks) - 1
            y = self.decoder(c, cache, self.chunk_cells if chunked else None)  # (B, 3, 4K (first: 4K - 3), H, W)
            out[:, :, frame:frame + y.shape[2]] = y
            frame += y.shape[2]
        return out

    def forward(self, video: torch.Tensor, generator: torch.Generator | None = None, sample: bool = False):
        """Reconstruction: video (B, 3, F, H, W) -> (recon (B, 3, F, H, W), posterior)."""
        posterior = self.encode(video)
        z = posterior.sample(generator) if sample else posterior.mode()
        return self.decode(z), posterior

    # -------------------------------------------------------- latent normalisation

    def normalize(self, z: torch.Tensor) -> torch.Tensor:
        """VAE latents -> DiT latents: (z - shift_factor) * scaling_factor, as the HunyuanVideo 1.5
        pipelines encode (diffusers' i2v: `latents * scaling_factor`; Tencent's: the same, its decode
        honouring a `shift_factor` the release does not set). (B, z, F', h, w)."""
        cfg = self.config
        return (z - cfg.shift_factor if cfg.shift_factor else z) * cfg.scaling_factor

    def denormalize(self, z: torch.Tensor) -> torch.Tensor:
        """DiT latents -> VAE latents: z / scaling_factor + shift_factor (the pipelines' decode)."""
        cfg = self.config
        z = z / cfg.scaling_factor
        return z + cfg.shift_factor if cfg.shift_factor else z

    # -------------------------------------------------------- spatial tiling

    def enable_tiling(self, tile_size: int = 256, overlap_factor: float = 0.25) -> None:
        """Encode / decode frames larger than `tile_size` pixels in tiles, blended and cropped exactly as
        diffusers' `tiled_encode` / `tiled_decode` and Tencent's `spatial_tiled_*` do (their output,
        tile for tile). Off by default, as in diffusers; Tencent's pipeline decodes tiled, with
        (256, 0.125) on GPUs over 21 GB and (128, 0.25) below (`get_vae_inference_config`)."""
        s = self.config.spatial_compression
        cells = tile_size // s
        blend = cells * overlap_factor
        # the reference's own arithmetic (int() of float products) must land on whole latent cells,
        # so that its tiles, blends and crops line up (its tiled output has the input's size)
        b = int(blend)
        exact = blend == b and int(tile_size * (1 - overlap_factor)) == tile_size - s * b \
            and int(cells * (1 - overlap_factor)) == cells - b and int(tile_size * overlap_factor) == s * b
        if tile_size % s or not 0 < overlap_factor < 1 or not exact:
            raise ValueError(f"enable_tiling(tile_size={tile_size}, overlap_factor={overlap_factor}): tile_size "
                             f"must be a multiple of {s} and tile_size / {s} * overlap_factor a whole number "
                             "of latent cells, 0 < overlap_factor < 1 (e.g. 256 with 0.25 or 0.125, 128 with 0.25)")
        self.tile_size, self.tile_overlap_factor = tile_size, overlap_factor

    def disable_tiling(self) -> None:
        self.tile_size = None

    def _tiled_encode(self, video: torch.Tensor, chunked: bool) -> torch.Tensor:
        s, px = self.config.spatial_compression, self.tile_size
        step = int(px * (1 - self.tile_overlap_factor))  # pixels between tile starts
        blend = int(px // s * self.tile_overlap_factor)  # latent cells blended
        B, _, T, h, w = self.latent_shape(video.shape)
        shape = (B, 2 * self.config.latent_channels, T, h, w)
        return _tiled(lambda v: self._encode(v, chunked), video, px, step, blend, px // s - blend, shape)

    def _tiled_decode(self, z: torch.Tensor, chunked: bool) -> torch.Tensor:
        cfg = self.config
        s, cells = cfg.spatial_compression, self.tile_size // cfg.spatial_compression
        step = int(cells * (1 - self.tile_overlap_factor))  # latent cells between tile starts
        blend = int(self.tile_size * self.tile_overlap_factor)  # pixels blended
        B, _, T, h, w = z.shape
        shape = (B, cfg.out_channels, (T - 1) * cfg.temporal_compression + 1, h * s, w * s)
        return _tiled(lambda v: self._decode(v, chunked), z, cells, step, blend, self.tile_size - blend, shape)


def _after_load(module: HunyuanVideo15VAE, incompatible_keys) -> None:
    module.conv_formats()


def _contiguous_state(module, state_dict: dict, prefix: str, local_metadata) -> None:
    """state_dict post-hook: the channels-last and tap-layout conv weights as contiguous tensors (what savers such as
    safetensors' `save_file` require; the values are the same)."""
    for key, value in state_dict.items():
        if key.startswith(prefix) and not value.is_contiguous():
            state_dict[key] = value.contiguous()


def _tiled(fn, x: torch.Tensor, tile: int, step: int, blend: int, keep: int, out_shape) -> torch.Tensor:
    """The reference's spatial tiling, one row of tiles at a time: tiles of `tile` x `tile` cells of x
    start every `step` cells; each goes through `fn`; tile (i, j) is blended in place with the tile
    above it over `blend` rows, then with the tile to its left over `blend` columns (weight y / blend
    on its own row y, those tiles already blended); its top-left `keep` x `keep` block is its part
    of the output. Only the previous row of tiles is held."""
    out = None
    above: list[torch.Tensor] = []
    for a, i in enumerate(range(0, x.shape[-2], step)):
        row: list[torch.Tensor] = []
        for b, j in enumerate(range(0, x.shape[-1], step)):
            y = fn(x[..., i:i + tile, j:j + tile])
            if a:
                _blend(above[b], y, blend, dim=-2)
            if b:
                _blend(row[b - 1], y, blend, dim=-1)
            row.append(y)
            if out is None:
                out = y.new_empty(out_shape)
            piece = y[..., :keep, :keep]
            out[..., a * keep:a * keep + piece.shape[-2], b * keep:b * keep + piece.shape[-1]] = piece
        above = row
    return out


def _blend(prev: torch.Tensor, y: torch.Tensor, extent: int, dim: int) -> None:
    """In place, diffusers' `blend_v` (dim -2) / `blend_h` (dim -1): the first e rows (columns) of y
    become prev's last e * (1 - r / e) + y's * r / e, r = 0 .. e - 1, e = min(extent, both sizes)."""
    e = min(prev.shape[dim], y.shape[dim], extent)
    if e == 0:
        return
    r = torch.arange(e, dtype=y.dtype, device=y.device) / e
    r = r.view(e, 1) if dim == -2 else r
    head, tail = y.narrow(dim, 0, e), prev.narrow(dim, prev.shape[dim] - e, e)
    head.copy_(tail * (1 - r) + head * r)
