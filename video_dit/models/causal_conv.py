"""The causal video VAEs' shared pieces (family-neutral): the chunk cache, the conv3d entry point, the
causal conv that pads only the past, the channel RMS norm and the encoder's Gaussian posterior.

    CausalCache         the past frames of every causal layer, one shared conv window (no autograd)
    conv3d              conv3d: a matrix product for 1x1x1, oneDNN on CPU, channels-last kept
    CausalConv3d        output frame t sees input frames <= t (zeros or the cache before)   (B, C, T, H, W) -> (B, C', T, H', W')
    RMS_norm            the channel RMS norm (Wan's), optionally fused with the SiLU after it
    DiagonalGaussian    per-element mean and log-variance of an encoder's posterior

Without autograd the layers work in place and in channels-last-3d memory (`inplace_ok`); with autograd
they take the plain, differentiable path (the same function). Each family's VAE (its blocks, resampling,
layouts) lives in its own folder and builds on these.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


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
            past = self._past[key] = empty_channels_last(frames.shape[0], frames.shape[1], n, *frames.shape[3:], like=frames)
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


def inplace_ok() -> bool:
    """In-place activations are safe only when no backward pass needs the overwritten input."""
    return not torch.is_grad_enabled()


_MKLDNN = torch.backends.mkldnn.is_available()


_CL = torch.channels_last_3d


def empty_channels_last(B: int, C: int, T: int, H: int, W: int, like: torch.Tensor) -> torch.Tensor:
    """An uninitialised (B, C, T, H, W) tensor with channels-last strides (memory (B, T, H, W, C))."""
    return torch.empty(B, T, H, W, C, dtype=like.dtype, device=like.device).permute(0, 4, 1, 2, 3)


def is_channels_last(x: torch.Tensor) -> bool:
    return x.ndim == 5 and not x.is_contiguous() and x.is_contiguous(memory_format=_CL)


def conv3d(x: torch.Tensor, weight: torch.Tensor, bias, stride=(1, 1, 1), padding=(0, 0, 0)) -> torch.Tensor:
    """conv3d. On CPU without autograd, oneDNN directly: PyTorch's backend choice sends small
    (B C T H < 20480) and (k, 1, 1) convs to its im2col `slow_conv3d`, several times slower here.
    With autograd, a float32 batch of one clip runs as its two halves in time (`conv3d_as_pair`).
    A 1x1x1 conv is one matrix product."""
    if weight.shape[2:] == (1, 1, 1) and stride == (1, 1, 1) and padding == (0, 0, 0):
        B, C, T, H, W = x.shape
        if is_channels_last(x):  # (B, T, H, W, C) in memory: a Linear over the last dim, channels-last out
            return F.linear(x.permute(0, 2, 3, 4, 1), weight.view(weight.shape[0], C), bias).permute(0, 4, 1, 2, 3)
        y = torch.matmul(weight.view(weight.shape[0], C), x.reshape(B, C, T * H * W))  # (B, C', THW)
        return (y.add_(bias.view(-1, 1)) if inplace_ok() else y + bias.view(-1, 1)).view(B, -1, T, H, W)
    if _MKLDNN and x.device.type == "cpu" and x.dtype == torch.float32 and inplace_ok():
        # Channels-last input and weights: oneDNN reads and writes them as they are. A plain NCDHW
        # input is first reordered by oneDNN into a scratch copy (3x the output at a 3-frame window).
        fmt = _CL if is_channels_last(x) else torch.contiguous_format
        return torch.ops.aten.mkldnn_convolution(x.contiguous(memory_format=fmt), weight.contiguous(memory_format=fmt),
                                                 bias, list(padding),
                                                 list(stride), [1, 1, 1], 1)
    if x.shape[0] == 1 and x.device.type == "cpu" and x.dtype == torch.float32 and padding[0] == 0 \
            and not torch.is_autocast_enabled("cpu"):
        return conv3d_as_pair(x, weight, bias, stride, padding)
    return F.conv3d(x, weight, bias, stride, padding)


def conv3d_as_pair(x: torch.Tensor, weight: torch.Tensor, bias, stride, padding) -> torch.Tensor:
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
        if n == 0 or cache is None or not inplace_ok():
            x = norm(x, silu=True) if norm is not None else x
            if n and x.shape[2] == 1 and self.stride[0] == 1 and (cache is None or cache.fresh(self)):
                # The clip's first frame (an image, an i2v conditioning frame): its past is all zeros,
                # so only the last temporal tap counts (the zero-padded conv costs n + 1 times as much)
                if cache is not None:
                    cache.remember(self, x)  # the next chunk's past, if one comes
                return conv3d(x, self.weight[:, :, -1:], self.bias, self.stride, self.padding)
            if n:
                x = cache.with_past(self, x, n) if cache is not None else F.pad(x, (0, 0, 0, 0, n, 0))
            return conv3d(x, self.weight, self.bias, self.stride, self.padding)
        seen = cache.frames_before(self, x.shape[2])
        if x.shape[2] == 1 and seen == 0 and self.stride[0] == 1:
            # The clip's first frame: the past is all zeros, so only the last temporal tap counts.
            x = norm(x, silu=True) if norm is not None else x
            cache.keep(self, x, n)
            return conv3d(x, self.weight[:, :, -1:], self.bias, self.stride, self.padding)
        win = cache.window(self, x, n)  # (B, C, n + T, H, W), past frames in place
        if norm is not None:
            norm(x, silu=True, out=win[:, :, n:])
        else:
            win[:, :, n:].copy_(x)
        # One output frame early in the clip: its window still starts with zeros for frames before
        # the clip, whose taps add nothing; skip them (the second frame: 2 of 3 taps).
        z = max(0, n - seen) if x.shape[2] == 1 and self.stride[0] == 1 else 0
        y = conv3d(win[:, :, z:], self.weight[:, :, z:], self.bias, self.stride, self.padding)
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
        if not inplace_ok():
            # sum of squares, not vector_norm: with its backward 3.5x faster on CPU over the channel
            # dim (a (4, 16, 9, 32, 32) activation: 3.9 vs 13.8 ms); a VAE training step 0.357 -> 0.299 s
            norm = xf.square().sum(dim=1, keepdim=True).sqrt().clamp_min(1e-12)  # (B, 1, ...)
            y = xf / norm * gain
            return (F.silu(y) if silu else y).to(x.dtype)
        # The channel sum of squares as a (1, C) x (C, L) product: a strided reduction over dim 1
        # (vector_norm) is several times slower on CPU.
        direct = out is not None and out.dtype == xf.dtype
        B, C = x.shape[:2]
        if is_channels_last(xf):  # channels innermost in memory: a contiguous reduction
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


class DiagonalGaussian:
    """The encoder's posterior: per-element mean and log-variance, (B, z, F', h, w) each."""

    def __init__(self, mean: torch.Tensor, logvar: torch.Tensor):
        self.mean = mean
        self.logvar = logvar.clamp(-30.0, 20.0)

    @property
    def std(self) -> torch.Tensor:
        return torch.exp(0.5 * self.logvar)

    def mode(self) -> torch.Tensor:
        return self.mean

    def sample(self, generator: torch.Generator | None = None) -> torch.Tensor:
        noise = torch.randn(self.mean.shape, generator=generator, dtype=self.mean.dtype,
                            device=self.mean.device if generator is None else generator.device)
        return self.mean + self.std * noise.to(self.mean.device)

    def kl(self) -> torch.Tensor:
        """KL(q || N(0, 1)) summed over all but the batch dim: (B,)."""
        return 0.5 * (self.mean.pow(2) + self.logvar.exp() - 1.0 - self.logvar).flatten(1).sum(1)


class FirstFrameKept:
    """The frame rule of a causal video VAE that compresses time `temporal_compression` = t times and keeps
    the first frame on its own: clips of t k + 1 frames, (n - 1) / t + 1 latent frames (the family contract's
    `VAEShape` methods; a base of such a VAE's config dataclass)."""

    def snap_frames(self, n: int) -> int:
        """The largest t k + 1 not above `n` (`n >= 1`; never rounds up, so a clip is never asked for frames
        it lacks)."""
        t = self.temporal_compression
        if n < 1:
            raise ValueError(f"num_frames must be >= 1, got {n}")
        return (int(n) - 1) // t * t + 1

    def latent_frames(self, n: int) -> int:
        return (int(n) - 1) // self.temporal_compression + 1

    def pixel_frames(self, n: int) -> int:
        return (int(n) - 1) * self.temporal_compression + 1


def first_frame_kept(temporal: int) -> FirstFrameKept:
    """The t k + 1 frame rule of compression `temporal` on its own (no VAE config at hand)."""
    rule = FirstFrameKept()
    rule.temporal_compression = temporal
    return rule
