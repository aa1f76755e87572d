"""`VideoDiT.compile_blocks`: each Block compiled in place trains like the eager model (loss and every
gradient to float32 rounding) over a long sequence, with one (scale, shift) per sample and per-token
ones, through the fused ops (opaque custom ops inside the graph) and the torch path; the Inductor
option that produced wrong gradients is off. Inductor on CPU compiles C++ (tens of seconds per graph):
the torch path's larger graph runs with -m slow on CPU; on CUDA (`gpu`) every combination runs."""

from __future__ import annotations

import copy

import helpers
import kernel_cases as kc
import pytest
import torch

from video_dit.families.wan.dit import cast_dit
from video_dit.models.common import COMPILE_OPTIONS


def long_inputs(per_token: bool, seed: int = 1, device: str = "cpu"):
    """4096 tokens (latents 4 x 64 x 64): the long-sequence path, at tiny width."""
    g = torch.Generator().manual_seed(seed)
    x, context = torch.randn(1, 4, 4, 64, 64, generator=g), torch.randn(1, 10, 24, generator=g)
    t = 1000 * torch.rand(1, 4096, generator=g) if per_token else torch.tensor([700.0])
    return tuple(v.to(device) for v in (x, t, context))


@pytest.mark.parametrize("per_token, fused", [
    (False, True), (True, True), pytest.param(False, False, marks=pytest.mark.slow)])
def test_compiled_blocks_train_like_eager(per_token, fused):
    """T = 1 is the reduction over tokens Inductor got wrong on CUDA (see COMPILE_OPTIONS)."""
    torch._dynamo.reset()  # a first compile (static shapes), not the dynamic recompile of another test's shapes
    eager = kc.flag(helpers.tiny_dit(num_layers=1), "triton" if fused else "torch")
    inputs = long_inputs(per_token)
    compiled = copy.deepcopy(eager)
    eager(*inputs).square().mean().backward()
    seconds = compiled.compile_blocks(example=inputs)
    assert seconds > 0 and all(p.grad is None for p in compiled.parameters())  # the example step left no grads
    assert compiled.blocks[0]._compiled_call_impl is not None and not compiled.blocks[0].recompute
    assert compiled.state_dict().keys() == eager.state_dict().keys()  # compiled in place: same names
    compiled.disable_gradient_checkpointing()  # re-syncing the blocks' recompute keeps it off once compiled
    assert not compiled.blocks[0].recompute
    compiled(*inputs).square().mean().backward()
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5 * p.grad.abs().max().item(), msg=name)


def test_compile_options_switch_off_mix_order_reduction():
    from torch._inductor import config

    assert COMPILE_OPTIONS == {"triton.mix_order_reduction": False}
    assert isinstance(config.triton.mix_order_reduction, bool)  # the knob exists in this torch, by that name


@pytest.mark.gpu
@pytest.mark.parametrize("kernels_flag", ["triton", "torch"])
def test_cuda_compiled_blocks_train_like_eager(kernels_flag):
    """bf16 on CUDA at 16,384 tokens with one (scale, shift) per sample: the shape of pytorch#178080's
    invalid gradient and pytorch#193061's silently wrong ones. Compiled vs eager within bf16 noise."""
    base = cast_dit(helpers.tiny_dit(num_layers=2).cuda(), torch.bfloat16, masters=True)
    g = torch.Generator().manual_seed(1)
    inputs = (torch.randn(1, 4, 16, 64, 64, generator=g).cuda(), torch.tensor([700.0]).cuda(),
              torch.randn(1, 10, 24, generator=g).cuda())  # 16 x 32 x 32 = 16,384 tokens
    runs = {}
    for name, dtype, compiled in (("compiled", torch.bfloat16, True), ("torch", torch.bfloat16, False),
                                  ("float32", torch.float32, False)):
        model = kc.flag(cast_dit(copy.deepcopy(base), dtype, masters=True), kernels_flag)
        if compiled:
            model.compile_blocks()
        out = model(*inputs)
        out.float().square().mean().backward()
        runs[name] = {"out": out.detach().float().cpu().bfloat16(),
                      **{n: p.grad.cpu() for n, p in model.named_parameters()}}
    kc.assert_dit_tracks(runs, "bfloat16", "compiled")


@pytest.mark.slow
def test_hunyuan15_compiled_blocks_train_like_eager():
    """HunyuanVideo 1.5's double blocks compiled in place (`BlockTraining.compile_blocks`, the same options)
    train like the eager model at 1,024 video tokens with padded text: every gradient. (It found the
    ~5% gradient error Inductor gave for the transposed, non-contiguous patch tokens the blocks once read.)"""
    from video_dit.families.hunyuan15.loading import load_hy15_dit

    torch._dynamo.reset()
    eager = helpers.randomize_zeros(load_hy15_dit("preset:tiny-hy15-t2v", seed=0))
    cfg = eager.config
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, cfg.patch_in_channels, 4, 16, 16, generator=g)  # 1,024 tokens
    text, mask = torch.randn(1, 12, cfg.text_states_dim, generator=g), torch.arange(12)[None] < 9
    inputs = (x, torch.tensor([700.0]), text, mask)
    compiled = copy.deepcopy(eager)
    eager(*inputs).square().mean().backward()
    assert compiled.compile_blocks(example=inputs) > 0
    assert all(p.grad is None for p in compiled.parameters())
    compiled(*inputs).square().mean().backward()
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters()):
        if p.grad is None:  # the last block's text stream feeds nothing (compiled: zeros rather than None)
            assert q.grad is None or not q.grad.any(), name
            continue
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5 * p.grad.abs().max().item(), msg=name)
