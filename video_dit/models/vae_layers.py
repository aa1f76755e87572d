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

# ---------------------------------------------------------------- the chunk cache


class CausalCache:
    """The state carried between chunks for ONE encode or decode pass: for every causal layer the
    last `n` input frames it saw (`n` = its temporal kernel's reach into the past), and whether it
    has seen the clip's first frame.

    Without autograd, a layer's input `[n past frames | chunk]` is assembled in one workspace shared
    by all layers (they run one after another): the past frames are copied in, the layer writes
    the chunk behind them (a norm writes its output there directly), the conv reads the window, and
    `keep` copies the window's last n frames back into the layer's preallocated past. Nothing is
    concatenated or padded per chunk, and the workspace grows to the largest window once.
    With autograd on, `with_past` concatenates instead (reused buffers would break the backward pass).
    """

    def __init__(self):
        self._past: dict[int, torch.Tensor] = {}  # id(layer) -> (B, C, n, H, W)
        self._seen: set[int] = set()
        self._count: dict[int, int] = {}  # id(layer) -> frames it has seen
        self._work = torch.empty(0)

    def frames_before(self, layer: nn.Module, T: int) -> int:
        """How many frames `layer` saw before this chunk of T (which is counted now)."""
        key = id(layer)
        seen = self._count.get(key, 0)
        self._count[key] = seen + T
        return seen

    def first_visit(self, layer: nn.Module) -> bool:
        """True the first time `layer` asks (its first chunk holds the clip's first frame)."""
        key = id(layer)
        if key in self._seen:
            return False
        self._seen.add(key)
        return True

    def window(self, layer: nn.Module, x: torch.Tensor, n: int) -> torch.Tensor:
        """An uninitialised-chunk window (B, C, n + T, H, W) for input shaped like x, whose first n
        frames hold `layer`'s past (zeros before its first chunk). Valid until the next `window`."""
        B, C, T, H, W = x.shape
        size = B * C * (n + T) * H * W
        if self._work.numel() < size or self._work.dtype != x.dtype or self._work.device != x.device:
            self._work = torch.empty(size, dtype=x.dtype, device=x.device)
        win = self._work[:size].view(B, n + T, H, W, C).permute(0, 4, 1, 2, 3)  # channels-last
        past = self._past.get(id(layer))
        if past is None:
            win[:, :, :n].zero_()
        elif past.shape != (B, C, n, H, W):
            raise ValueError(f"CausalCache: a chunk of shape {tuple(x.shape)} does not continue the "
                             f"stream of {type(layer).__name__} (past frames {tuple(past.shape)})")
        else:
            win[:, :, :n].copy_(past)
        return win

    def keep(self, layer: nn.Module, frames: torch.Tensor, n: int) -> None:
        """Remember the last n frames of the stream `layer` saw, ending with `frames` (B, C, T, H, W)."""
        key, m = id(layer), min(n, frames.shape[2])
        past = self._past.get(key)
        if past is None:  # allocated once per layer and pass; zeros stand for frames before the clip
            past = self._past[key] = _empty_cl(frames.shape[0], frames.shape[1], n, *frames.shape[3:], like=frames)
            past.zero_()
        for i in range(n - m):  # shift older frames left when the chunk is shorter than n
            past[:, :, i].copy_(past[:, :, i + m])
        past[:, :, n - m:].copy_(frames[:, :, -m:])

    def fresh(self, layer: nn.Module) -> bool:
        """Autograd path: has `layer` seen no frame yet (its past is the zeros before the clip)?"""
        return id(layer) not in self._past

    def remember(self, layer: nn.Module, frames: torch.Tensor) -> None:
        """Autograd path: `frames` (B, C, T, H, W) are the last frames `layer` has seen, zeros before
        them. Kept as they are: the next chunk's past is built from them only if a next chunk comes
        (`with_past`), and a batch of single images has none."""
        self._past[id(layer)] = frames

    def with_past(self, layer: nn.Module, x: torch.Tensor, n: int) -> torch.Tensor:
        """Autograd path: `[n past frames | x]` (B, C, n + T, H, W) by concatenation."""
        key, (B, C, T, H, W) = id(layer), x.shape
        past = self._past.get(key)
        if past is None:
            past = x.new_zeros(B, C, n, H, W)
        elif past.shape[2] != n:  # `remember`ed: its last n frames, zeros before it
            past = past[:, :, -n:]
            past = torch.cat([past.new_zeros(B, C, n - past.shape[2], H, W), past], 2) if past.shape[2] < n else past
        out = torch.cat([past, x], 2)
        self._past[key] = out[:, :, -n:]
        return out


def _inplace() -> bool:
    """In-place activations are safe only when no backward pass needs the overwritten input."""
    return not torch.is_grad_enabled()


_MKLDNN = torch.backends.mkldnn.is_available()
_CL = torch.channels_last_3d


def _empty_cl(B: int, C: int, T: int, H: int, W: int, like: torch.Tensor) -> torch.Tensor:
    """An uninitialised (B, C, T, H, W) tensor with channels-last strides (memory (B, T, H, W, C))."""
    return torch.empty(B, T, H, W, C, dtype=like.dtype, device=like.device).permute(0, 4, 1, 2, 3)


def _is_cl(x: torch.Tensor) -> bool:
    return x.ndim == 5 and not x.is_contiguous() and x.is_contiguous(memory_format=_CL)


def _conv(x: torch.Tensor, weight: torch.Tensor, bias, stride=(1, 1, 1), padding=(0, 0, 0)) -> torch.Tensor:
    """conv3d. On CPU without autograd, oneDNN directly: PyTorch's backend choice sends small
    (B C T H < 20480) and (k, 1, 1) convs to its im2col `slow_conv3d`, several times slower here.
    With autograd, a float32 batch of one clip runs as its two halves in time (`_conv_as_pair`).
    A 1x1x1 conv is one matrix product."""
    if weight.shape[2:] == (1, 1, 1) and stride == (1, 1, 1) and padding == (0, 0, 0):
        B, C, T, H, W = x.shape
        if _is_cl(x):  # (B, T, H, W, C) in memory: a Linear over the last dim, channels-last out
            return F.linear(x.permute(0, 2, 3, 4, 1), weight.view(weight.shape[0], C), bias).permute(0, 4, 1, 2, 3)
        y = torch.matmul(weight.view(weight.shape[0], C), x.reshape(B, C, T * H * W))  # (B, C', THW)
        return (y.add_(bias.view(-1, 1)) if _inplace() else y + bias.view(-1, 1)).view(B, -1, T, H, W)
    if _MKLDNN and x.device.type == "cpu" and x.dtype == torch.float32 and _inplace():
        # Channels-last input and weights: oneDNN reads and writes them as they are. A plain NCDHW
        # input is first reordered by oneDNN into a scratch copy (3x the output at a 3-frame window).
        fmt = _CL if _is_cl(x) else torch.contiguous_format
        return torch.ops.aten.mkldnn_convolution(x.contiguous(memory_format=fmt), weight.contiguous(memory_format=fmt),
                                                 bias, list(padding),
                                                 list(stride), [1, 1, 1], 1)
    if x.shape[0] == 1 and x.device.type == "cpu" and x.dtype == torch.float32 and padding[0] == 0 \
            and not torch.is_autocast_enabled("cpu"):
        return _conv_as_pair(x, weight, bias, stride, padding)
    return F.conv3d(x, weight, bias, stride, padding)


def _conv_as_pair(x: torch.Tensor, weight: torch.Tensor, bias, stride, padding) -> torch.Tensor:
    """conv3d of ONE float32 clip (1, C, T, H, W) on CPU with autograd, as a batch of its two halves
    in time. Why: for a batch of one, PyTorch's backend choice sends these small convs, forward and
    backward, to its im2col `slow_conv3d` (a training step of the tiny VAE on one 17-frame clip: 1.25 s
    where the two halves as a batch of two take 0.35 s). The halves are the input frames of the
    first ceil(T'/2) output frames and of the last ceil(T'/2) (they overlap by the kernel's reach,
    and by one output frame when T' is odd, which is taken once); no time padding (the causal convs
    pad before). (1, C, T, H, W) -> (1, C', T', H', W')."""
    kt, st = weight.shape[2], stride[0]
    frames = (x.shape[2] - kt) // st + 1                      # T', the output frames
    if frames < 2:
        return F.conv3d(x, weight, bias, stride, padding)
    half = (frames + 1) // 2
    pair = torch.cat([x[:, :, :(half - 1) * st + kt],        # outputs 0 .. half - 1
                      x[:, :, (frames - half) * st:(frames - 1) * st + kt]])  # outputs T' - half .. T' - 1
    y = F.conv3d(pair, weight, bias, stride, padding)         # (2, C', half, H', W')
    return torch.cat([y[:1], y[1:, :, 2 * half - frames:]], 2)


# ---------------------------------------------------------------- layers


class CausalConv3d(nn.Conv3d):
    """Conv3d whose time padding is all on the past side: output frame t sees input frames <= t.

    `padding=(p, ph, pw)` means `2p` past frames in time (zeros at the clip start, the cached last
    frames of the previous chunk later) and symmetric zero padding `ph, pw` in space.
    """

    def __init__(self, in_dim: int, out_dim: int, kernel_size, stride=1, padding=0):
        super().__init__(in_dim, out_dim, kernel_size, stride=stride, padding=padding)
        self.past = 2 * self.padding[0]
        self.padding = (0, self.padding[1], self.padding[2])

    def forward(self, x: torch.Tensor, cache: CausalCache | None = None, norm: "RMS_norm | None" = None):
        """x (B, C, T, H, W) -> (B, C', T, H', W') (stride 1 in time). With `norm`, the conv's input
        is SiLU(norm(x)), written straight into the cache's window."""
        n = self.past
        if n == 0 or cache is None or not _inplace():
            x = norm(x, silu=True) if norm is not None else x
            if n and x.shape[2] == 1 and self.stride[0] == 1 and (cache is None or cache.fresh(self)):
                # The clip's first frame (an image, an i2v conditioning frame): its past is all zeros,
                # so only the last temporal tap counts (the zero-padded conv costs n + 1 times as much)
                if cache is not None:
                    cache.remember(self, x)  # the next chunk's past, if one comes
                return _conv(x, self.weight[:, :, -1:], self.bias, self.stride, self.padding)
            if n:
                x = cache.with_past(self, x, n) if cache is not None else F.pad(x, (0, 0, 0, 0, n, 0))
            return _conv(x, self.weight, self.bias, self.stride, self.padding)
        seen = cache.frames_before(self, x.shape[2])
        if x.shape[2] == 1 and seen == 0 and self.stride[0] == 1:
            # The clip's first frame: the past is all zeros, so only the last temporal tap counts.
            x = norm(x, silu=True) if norm is not None else x
            cache.keep(self, x, n)
            return _conv(x, self.weight[:, :, -1:], self.bias, self.stride, self.padding)
        win = cache.window(self, x, n)  # (B, C, n + T, H, W), past frames in place
        if norm is not None:
            norm(x, silu=True, out=win[:, :, n:])
        else:
            win[:, :, n:].copy_(x)
        # One output frame early in the clip: its window still starts with zeros for frames before
        # the clip, whose taps add nothing; skip them (the second frame: 2 of 3 taps).
        z = max(0, n - seen) if x.shape[2] == 1 and self.stride[0] == 1 else 0
        y = _conv(win[:, :, z:], self.weight[:, :, z:], self.bias, self.stride, self.padding)
        cache.keep(self, win, n)
        return y


class RMS_norm(nn.Module):
    """x / ||x||_channels * sqrt(C) * gamma (Wan's RMS norm over the channel dim); fp32 math for
    half-precision inputs, since the channel sum of squares overflows fp16 and loses bits in bf16."""

    def __init__(self, dim: int, images: bool = True):
        super().__init__()
        self.scale = dim ** 0.5
        self.gamma = nn.Parameter(torch.ones(dim, *((1, 1) if images else (1, 1, 1))))

    def forward(self, x: torch.Tensor, silu: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
        """x (B, C, ...) -> same shape; `silu=True` applies the following SiLU too; `out` (no
        autograd) receives the result in place."""
        xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        gain = (self.gamma * self.scale).view(-1, *(1,) * (x.ndim - 2))  # (C, 1, ...)
        if not _inplace():
            # sum of squares, not vector_norm: with its backward 3.5x faster on CPU over the channel
            # dim (a (4, 16, 9, 32, 32) activation: 3.9 vs 13.8 ms); a VAE training step 0.357 -> 0.299 s
            norm = xf.square().sum(dim=1, keepdim=True).sqrt().clamp_min(1e-12)  # (B, 1, ...)
            y = xf / norm * gain
            return (F.silu(y) if silu else y).to(x.dtype)
        # The channel sum of squares as a (1, C) x (C, L) product: a strided reduction over dim 1
        # (vector_norm) is several times slower on CPU.
        direct = out is not None and out.dtype == xf.dtype
        B, C = x.shape[:2]
        if _is_cl(xf):  # channels innermost in memory: a contiguous reduction
            norm = torch.linalg.vector_norm(xf, dim=1, keepdim=True).clamp_min_(1e-12)
        else:
            sq = xf.square().reshape(B, C, -1)  # (B, C, L)
            norm = torch.matmul(xf.new_ones(1, C), sq).sqrt_().clamp_min_(1e-12).view(B, 1, *x.shape[2:])
            del sq
        y = torch.div(xf, norm, out=out) if direct else torch.div(xf, norm)
        y.mul_(gain)
        if silu:
            F.silu(y, inplace=True)
        if out is not None and y is not out:
            return out.copy_(y)
        return y.to(x.dtype)


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
        return y.add_(h) if _inplace() else y + h


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
        return t.add_(x) if _inplace() else t + x


def _frame_conv(conv: nn.Conv2d, x: torch.Tensor, stride: int = 1, padding: int = 0) -> torch.Tensor:
    """A 2D conv applied to every frame, as a (1, k, k) Conv3d (no (B T) reshape copies)."""
    return _conv(x, conv.weight.unsqueeze(2), conv.bias, (1, stride, stride), (0, padding, padding))


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
    y = _conv(x, weight.unsqueeze(2), conv.bias.repeat(4), padding=(0, 1, 1))  # (B, 4C', T, H + 1, W + 1)
    C = conv.out_channels
    out = _empty_cl(B, C, T, 2 * H, 2 * W, like=y)
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
            if _inplace():
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
            y = x if x.shape[2] == 1 else torch.cat([x[:, :, :1], _conv(x, conv.weight, conv.bias, conv.stride)], 2)
            if _inplace():
                cache.keep(self, x, 1)
            else:
                cache.remember(self, x[:, :, -1:])
            return y  # (B, C, 1 + (T - 1) / 2, h, w)
        if not _inplace():
            return _conv(cache.with_past(self, x, 1), conv.weight, conv.bias, conv.stride)
        win = cache.window(self, x, 1)  # (B, C, 1 + T, h, w): the previous chunk's last frame first
        win[:, :, 1:].copy_(x)
        y = _conv(win, conv.weight, conv.bias, conv.stride)  # (B, C, T / 2, h, w)
        cache.keep(self, win, 1)
        return y

    def _time_up(self, x: torch.Tensor, cache: CausalCache) -> torch.Tensor:
        first = cache.first_visit(self)
        rest = x[:, :, 1:] if first else x  # the clip's first frame is not doubled
        B, C, T, H, W = rest.shape
        head = 1 if first else 0
        out = _empty_cl(B, C, head + 2 * T, H, W, like=x)
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
        return x.add_(shortcut) if _inplace() else x + shortcut


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
        return x.add_(shortcut) if _inplace() else x + shortcut
