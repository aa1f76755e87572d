"""Winograd F(4x4, 3x3) (`video_dit/kernels/winograd.py`) against torch's conv3d: both of its paths (the
tiled products and the im2col product of few positions), several output-channel blocks, frames whose
sides are no multiple of the tile, batches, one and three time taps, without a bias; and the tap layout."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from video_dit.kernels import winograd

SHAPES = [  # (B, C, C', kt, T, H, W)
    (1, 8, 5, 3, 2, 8, 12),     # whole tiles
    (2, 6, 37, 3, 1, 7, 10),    # a batch of two, sides 7 and 10, C' over three blocks of 16 (the last of 5)
    (1, 16, 16, 1, 3, 5, 5),    # one time tap (the first frame's folded kernel)
    (1, 4, 4, 3, 1, 1, 1),      # one output pixel
]


def _case(shape, dtype, seed=0):
    B, C, Co, kt, T, H, W = shape
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(Co, C, kt, 3, 3, generator=g, dtype=dtype)
    bias = torch.randn(Co, generator=g, dtype=dtype)
    win = torch.randn(B, C, T + kt - 1, H + 2, W + 2, generator=g, dtype=dtype)
    return win.contiguous(memory_format=torch.channels_last_3d), weight, bias


@pytest.mark.parametrize("path,min_positions", [("tiles", 0), ("im2col", 10 ** 9)])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-5)], ids=["fp64", "fp32"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_conv3d_equals_torch(monkeypatch, shape, dtype, tol, path, min_positions):
    """Within `tol` of the output's scale (F(4, 3)'s fractions cost about 1e-6 in float32), the shape and
    channels-last format of the result, with and without a bias."""
    monkeypatch.setattr(winograd, "MIN_POSITIONS", min_positions)
    monkeypatch.setattr(winograd, "BLOCK", 16)
    win, weight, bias = _case(shape, dtype)
    for b in (bias, None):
        ref = F.conv3d(win, weight, b)
        y = winograd.conv3d(win, winograd.taps(winograd.to_tap_layout(weight)), b)
        assert y.shape == ref.shape and y.dtype == dtype
        assert y.is_contiguous(memory_format=torch.channels_last_3d)
        assert ((y - ref).abs().max() / ref.abs().max()).item() <= tol


def test_folded_time_taps_are_the_sum_of_the_taps():
    """A kernel's time taps summed in the tap layout (what the causal conv does for a clip's lone first
    frame, whose replicated past every tap sees) convolve as the torch conv of the summed kernel."""
    win, weight, bias = _case((1, 12, 7, 3, 1, 6, 9), torch.float64)
    one = win[:, :, 2:]  # the window of one frame
    folded = winograd.taps(winograd.to_tap_layout(weight)).sum(1, keepdim=True)  # (9, 1, C, C')
    ref = F.conv3d(one, weight.sum(2, keepdim=True), bias)
    assert torch.allclose(winograd.conv3d(one, folded, bias), ref, rtol=0, atol=1e-12 * ref.abs().max().item())


def test_tap_layout():
    """Same values and shape, memory (3, 3, kt, C, C'); `taps` a view whose entries are the kernel's."""
    weight = torch.randn(5, 4, 3, 3, 3)
    laid = winograd.to_tap_layout(weight)
    assert torch.equal(laid, weight) and laid.shape == weight.shape
    assert winograd.in_tap_layout(laid)
    assert not winograd.in_tap_layout(weight)
    assert not winograd.in_tap_layout(weight.contiguous(memory_format=torch.channels_last_3d))
    t = winograd.taps(laid)
    assert t.shape == (9, 3, 4, 5) and t.data_ptr() == laid.data_ptr()
    assert torch.equal(t[3 * 2 + 1, 0], weight[:, :, 0, 2, 1].t())
