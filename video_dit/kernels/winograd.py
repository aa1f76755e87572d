"""Winograd F(4x4, 3x3) for the CPU's no-grad (kt, 3, 3) convolutions, and the layout its weights keep.

A 3x3 kernel over a 6x6 input tile gives a 4x4 output tile with 36 multiplications where the direct
conv does 144 (Lavin & Gray, "Fast Algorithms for Convolutional Neural Networks", CVPR 2016; the three
matrices below are theirs for F(4, 3)):

    Y = At [ (G g Gt) * (Bt d B) ] A        per tile d (6 x 6), kernel g (3 x 3), output Y (4 x 4)

Over channels the elementwise product becomes 36 matrix products, one per tile position, summed over
the kernel's kt time taps:

    V[p]  = Bt d B  of every input tile, position p of 36      (36, Tw, nH, nW, C)
    U[p]  = G g Gt  of every (tap, C, C') kernel                (36, kt, C, C')
    M[p]  = sum over taps a of V[p, a : a + T] @ U[p, a]        (36, T nH nW, C')
    y     = At M A, each 6x6 of M back to a 4x4 output tile     (T, 4 nH, 4 nW, C')

Why here: oneDNN, which runs PyTorch's CPU convolutions, has no Winograd algorithm for 3D kernels, and
runs a wide 3x3x3 conv at the speed of a dense matrix product on this project's CPU (a 1024 -> 1024
conv at 161 GFLOP/s, docs/performance.md). With 4x fewer multiplications the same conv, the transforms
included, took 0.40x oneDNN's time at 1024 channels (4 x 32 x 32 outputs), 0.46-0.67x at 512 (64 x 64),
0.61-0.81x at 256 (128 x 128) and 1.2-1.3x at 128 (one thread, fp32; the transforms are memory-bound
and scale with C where the products scale with C C'). Error: about 1e-5 of the output's scale in fp32
(the transforms' fractions), 1e-14 in fp64. CUDA is not served: cuDNN picks its own algorithms.

The weights: `U` is 4x the weight, so it is never kept; each call transforms the weight in blocks of
`BLOCK` output channels into one reused buffer, a single (36, 9) x (9, kt C BLOCK) product once the
weight's memory is in the tap layout `(3, 3, kt, C, C')` (`to_tap_layout`: the same values and shape,
(C', C, kt, 3, 3), other strides). Calls of few output positions (`MIN_POSITIONS`), where that
transform would cost more than it saves, run as one im2col matrix product over the same layout.
"""

from __future__ import annotations

import torch

# F(4, 3) (Lavin & Gray 2016): input transform Bt (6 x 6), kernel transform G (6 x 3), output At (4 x 6).
_BT = ((4, 0, -5, 0, 1, 0), (0, -4, -4, 1, 1, 0), (0, 4, -4, -1, 1, 0),
       (0, -2, -1, 2, 1, 0), (0, 2, -1, -2, 1, 0), (0, 4, 0, -5, 0, 1))
_G = ((1 / 4, 0, 0), (-1 / 6, -1 / 6, -1 / 6), (-1 / 6, 1 / 6, -1 / 6),
      (1 / 24, 1 / 12, 1 / 6), (1 / 24, -1 / 12, 1 / 6), (0, 0, 1))
_AT = ((1, 1, 1, 1, 1, 0), (0, 1, -1, 2, -2, 0), (0, 1, 1, 4, 4, 0), (0, 1, -1, 8, -8, 1))
TILE = 4  # output pixels per tile side; input tiles are TILE + 2 wide and overlap by 2

# Fewer output positions (B T H W) than this run as one im2col product: the kernel transform costs about
# as much as the 200-500 positions it speeds up (a 1024 -> 1024 conv on 3 x 16 x 16 outputs: Winograd
# 0.24 s, oneDNN 0.37 s; on 1 x 8 x 8 the im2col product 0.05 s).
MIN_POSITIONS = 512
BLOCK = 256  # output channels per kernel-transform block: U's buffer is (36, kt C BLOCK)


def to_tap_layout(weight: torch.Tensor) -> torch.Tensor:
    """The same (C', C, kt, 3, 3) values with memory (3, 3, kt, C, C'): `taps(weight)` is then a view."""
    return weight.permute(3, 4, 2, 1, 0).contiguous().permute(4, 3, 2, 0, 1)


def in_tap_layout(weight: torch.Tensor) -> bool:
    return weight.dim() == 5 and weight.shape[3:] == (3, 3) and weight.permute(3, 4, 2, 1, 0).is_contiguous()


def taps(weight: torch.Tensor) -> torch.Tensor:
    """(9, kt, C, C') view of a weight in the tap layout: taps[3 i + j, a] = weight[:, :, a, i, j].t()."""
    Co, C, kt = weight.shape[:3]
    return weight.permute(3, 4, 2, 1, 0).view(9, kt, C, Co)


@torch.no_grad()
def conv3d(win: torch.Tensor, tap: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """conv3d without padding, stride 1, of a window (B, C, T + kt - 1, H + 2, W + 2) by `tap` (9, kt, C, C')
    (`taps` of a weight, or a sum of its time taps) -> (B, C', T, H, W), channels-last. Any H and W: a
    window whose H or W is not a multiple of TILE gets zero rows and columns, and the extra outputs are cut."""
    B, C, Tw, Hw, Ww = win.shape
    kt, Co = tap.shape[1], tap.shape[3]
    T, H, W = Tw - kt + 1, Hw - 2, Ww - 2
    if B * T * H * W < MIN_POSITIONS:
        return _im2col(win, tap, bias)
    nH, nW = -(-H // TILE), -(-W // TILE)
    x = win.permute(0, 2, 3, 4, 1)  # (B, Tw, Hw, Ww, C), a view of a channels-last window
    if (nH * TILE, nW * TILE) != (H, W):
        padded = win.new_zeros(B, Tw, nH * TILE + 2, nW * TILE + 2, C)
        padded[:, :, :Hw, :Ww] = x
        x = padded
    out = win.new_empty(B, T, nH * TILE, nW * TILE, Co)
    for b in range(B):
        _products(_input_tiles(x[b], nH, nW), tap, out[b].view(T, nH, TILE, nW, TILE, Co))
    if bias is not None:
        out += bias
    y = out[:, :, :H, :W].permute(0, 4, 1, 2, 3)  # (B, C', T, H, W)
    return y if (nH * TILE, nW * TILE) == (H, W) else y.contiguous(memory_format=torch.channels_last_3d)


def _combine(coefficients, terms, out: torch.Tensor) -> torch.Tensor:
    """out = sum of coefficient * term over the non-zero coefficients (small integers or fractions)."""
    first = True
    for c, t in zip(coefficients, terms):
        if c == 0:
            continue
        if not first:
            out.add_(t, alpha=c)
        elif c == 1:
            out.copy_(t)
        else:
            torch.mul(t, c, out=out)
        first = False
    return out


def _input_tiles(x: torch.Tensor, nH: int, nW: int) -> torch.Tensor:
    """V = Bt d B of every 6x6 tile d of x (Tw, 4 nH + 2, 4 nW + 2, C), tiles every 4 pixels ->
    (36, Tw, nH, nW, C): rows first (6 strided row views combined), then columns."""
    Tw, C, n = x.shape[0], x.shape[-1], len(_BT)
    V = x.new_empty(n * n, Tw, nH, nW, C)
    rows = [x[:, i:i + TILE * nH:TILE] for i in range(n)]  # (Tw, nH, Ww, C): row i of every tile row
    r = x.new_empty(Tw, nH, x.shape[2], C)
    for i in range(n):
        _combine(_BT[i], rows, r)
        cols = [r[:, :, j:j + TILE * nW:TILE] for j in range(n)]  # (Tw, nH, nW, C)
        for k in range(n):
            _combine(_BT[k], cols, V[n * i + k])
    return V


def _products(V: torch.Tensor, tap: torch.Tensor, out: torch.Tensor) -> None:
    """out (T, nH, 4, nW, 4, C') = At M A of M = sum over time taps of V[:, a : a + T] @ U[:, a],
    U = G g Gt made per block of output channels."""
    n, kt, C, Co = len(_BT), tap.shape[1], tap.shape[2], tap.shape[3]
    T, rows = out.shape[0], out.shape[0] * out.shape[1] * out.shape[3]
    g = torch.tensor(_G, dtype=torch.float64)
    gg = torch.kron(g, g).to(tap.dtype)  # (36, 9): U[6 p + q] = sum over (i, j) of G[p, i] G[q, j] g[i, j]
    block = min(BLOCK, Co)
    u_buf, m_buf = V.new_empty(n * n * kt * C * block), V.new_empty(n * n * rows * block)
    half = V.new_empty(n, T, out.shape[1], out.shape[3], block)
    for o in range(0, Co, block):
        ob = min(block, Co - o)
        src = tap if ob == Co else tap[..., o:o + ob]
        U = torch.mm(gg, src.reshape(9, -1), out=u_buf[:n * n * kt * C * ob].view(n * n, -1)).view(n * n, kt, C, ob)
        M = m_buf[:n * n * rows * ob].view(n * n, rows, ob)
        torch.bmm(V[:, :T].reshape(n * n, rows, C), U[:, 0], out=M)
        for a in range(1, kt):
            M.baddbmm_(V[:, a:a + T].reshape(n * n, rows, C), U[:, a])
        M = M.view(n, n, T, out.shape[1], out.shape[3], ob)
        h = half[..., :ob]
        for i in range(TILE):  # output row i of each tile, then its columns
            _combine(_AT[i], M, h)
            for j in range(TILE):
                _combine(_AT[j], h, out[:, :, i, :, j, o:o + ob])


def im2col(win: torch.Tensor, kernel, offsets) -> torch.Tensor:
    """The columns of a conv without padding of `win` (B, C, Tw, Hw, Ww) by a `kernel` (kt, kh, kw) sized
    kernel: (B T H W, len(offsets) C), where `offsets[n]` = (a, i, j), the tap's offsets in time, height
    and width, gives columns n C .. (n + 1) C: the order of the weight matrix's rows they will meet."""
    B, C, Tw, Hw, Ww = win.shape
    T, H, W = Tw - kernel[0] + 1, Hw - kernel[1] + 1, Ww - kernel[2] + 1
    src = win.permute(0, 2, 3, 4, 1)  # (B, Tw, Hw, Ww, C), a view of a channels-last window
    cols = win.new_empty(B, T, H, W, len(offsets), C)
    for n, (a, i, j) in enumerate(offsets):
        cols[:, :, :, :, n].copy_(src[:, a:a + T, i:i + H, j:j + W])  # (B, T, H, W, C): tap n's columns
    return cols.view(B * T * H * W, -1)


def _im2col(win: torch.Tensor, tap: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The same conv as one matrix product over the shifted copies of the window, columns ordered as
    the tap layout's rows (i, j, a, C): (B T H W, 9 kt C) x (9 kt C, C') -> (B, C', T, H, W) channels-last."""
    B, C, Tw, Hw, Ww = win.shape
    kt, Co = tap.shape[1], tap.shape[3]
    cols = im2col(win, (kt, 3, 3), [(a, i, j) for i in range(3) for j in range(3) for a in range(kt)])
    w = tap.reshape(9 * kt * C, Co)
    y = torch.addmm(bias, cols, w) if bias is not None else cols @ w  # (B T H W, C')
    return y.view(B, Tw - kt + 1, Hw - 2, Ww - 2, Co).permute(0, 4, 1, 2, 3)
