"""`compile_blocks` (`train.compile: auto` compiles every family's blocks on GPU ranks under ZeRO 0-2): each
block compiled in place trains like the eager model (loss and every gradient to float32 rounding), for each
family: Wan over a long sequence with per-token (scale, shift) through the fused ops (opaque custom ops
inside the graph), HunyuanVideo 1.5's double blocks with padded text; the Inductor option that produced wrong
gradients is off.

Inductor on CPU compiles C++ per kernel, so CI pays one compile per family (one shape): measured with a cold
Inductor cache on the 2-core machine (load ~3), forward and backward, Wan's 41 s (the first also starts
Inductor) and HunyuanVideo's 43 s; HunyuanVideo's two blocks share one graph, so one block would cost the
same (a second Wan shape reuses most kernels: 8 s). Wan's one (scale, shift) per sample, its torch path and
HunyuanVideo at 1,024 tokens run with -m slow on CPU; on CUDA (`gpu`) every combination runs, and
tests/test_gpu.py trains each family with compile on and off."""

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


# Gradients: compiled vs eager, measured max |diff| / max |grad| 1.6e-6 (Wan, 4,096 tokens) and 9e-7 (HunyuanVideo
# 1.5, 128 tokens); the checks below allow rtol 1e-4 with atol 1e-5 of the tensor's largest gradient (the
# ~5% error Inductor once gave HunyuanVideo's transposed patch tokens is 5,000x that).
GRAD_RTOL, GRAD_ATOL = 1e-4, 1e-5


def assert_gradients_equal(eager, compiled) -> None:
    """Every parameter's gradient of `compiled` equals `eager`'s (a parameter without one in eager, such as
    HunyuanVideo's last text stream, which feeds nothing, may have zeros compiled)."""
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters()):
        if p.grad is None:
            assert q.grad is None or not q.grad.any(), name
            continue
        torch.testing.assert_close(q.grad, p.grad, rtol=GRAD_RTOL, atol=GRAD_ATOL * p.grad.abs().max().item(), msg=name)


# CI compiles Wan once (per-token timesteps, the fused ops); one (scale, shift) per sample, whose T = 1 is the
# reduction Inductor got wrong on CUDA (see COMPILE_OPTIONS; CPU Inductor cannot reproduce it), and the torch
# path run with -m slow here and on CUDA in test_cuda_compiled_blocks_train_like_eager.
@pytest.mark.parametrize("per_token, fused", [
    pytest.param(False, True, marks=pytest.mark.slow), (True, True),
    pytest.param(False, False, marks=pytest.mark.slow)])
def test_compiled_blocks_train_like_eager(per_token, fused):
    """Wan's block, compiled in place, at 4,096 tokens."""
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
    assert_gradients_equal(eager, compiled)


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


def hy15_inputs(model, frames: int, side: int, seed: int = 1):
    """HunyuanVideo 1.5 DiT inputs: latents (1, C, frames, side, side) (patch 1: frames x side^2 video tokens),
    12 text tokens of which 9 are real (the rest padding)."""
    cfg = model.config
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, cfg.patch_in_channels, frames, side, side, generator=g)
    text, mask = torch.randn(1, 12, cfg.text_states_dim, generator=g), torch.arange(12)[None] < 9
    return x, torch.tensor([700.0]), text, mask


@pytest.mark.parametrize("frames, side", [(2, 8), pytest.param(4, 16, marks=pytest.mark.slow)])
def test_hunyuan15_compiled_blocks_train_like_eager(frames, side):
    """HunyuanVideo 1.5's double blocks (the tiny preset's two, every zero-initialised weight drawn) compiled in
    place (`BlockTraining.compile_blocks`, the same options) train like the eager model: every gradient, at
    128 video tokens in CI and 1,024 with -m slow. (The slow one found the ~5% gradient error Inductor gave
    for the transposed, non-contiguous patch tokens the blocks once read.) Both blocks share one graph: the
    compile costs what one block's does."""
    from video_dit.families.hunyuan15.loading import load_hy15_dit

    torch._dynamo.reset()
    eager = helpers.randomize_zeros(load_hy15_dit("preset:tiny-hy15-t2v", seed=0))
    inputs = hy15_inputs(eager, frames, side)
    compiled = copy.deepcopy(eager)
    eager(*inputs).square().mean().backward()
    assert compiled.compile_blocks(example=inputs) > 0
    assert all(p.grad is None for p in compiled.parameters())
    assert all(b._compiled_call_impl is not None for b in compiled.blocks)
    compiled(*inputs).square().mean().backward()
    assert_gradients_equal(eager, compiled)


@pytest.mark.gpu
def test_cuda_hunyuan15_compiled_blocks_train_like_eager():
    """HunyuanVideo 1.5 on CUDA in bf16 (float32 masters, the family's float32 islands): compiled blocks
    against eager bf16 and a float32 run, at 4,096 video tokens, every gradient within bf16 noise."""
    from video_dit.families.hunyuan15.dit import cast_hy15_dit
    from video_dit.families.hunyuan15.loading import load_hy15_dit

    torch._dynamo.reset()
    base = helpers.randomize_zeros(load_hy15_dit("preset:tiny-hy15-t2v", seed=0)).cuda()
    inputs = tuple(v.cuda() for v in hy15_inputs(base, 4, 32))
    runs = {}
    for name, dtype, compiled in (("compiled", torch.bfloat16, True), ("torch", torch.bfloat16, False),
                                  ("float32", torch.float32, False)):
        model = cast_hy15_dit(copy.deepcopy(base), dtype, masters=True)
        if compiled:
            model.compile_blocks()
        x, t, text, mask = inputs
        out = model(x.to(dtype), t, text.to(dtype), mask)
        out.float().square().mean().backward()
        # the last block's text stream feeds nothing: no gradient eagerly, zeros compiled (compared as such)
        runs[name] = {"out": out.detach().float().cpu().bfloat16(),
                      **{n: (p.grad if p.grad is not None else torch.zeros_like(p)).cpu()
                         for n, p in model.named_parameters()}}
    for n in [n for n, g in runs["torch"].items() if n != "out" and not g.any()]:
        assert not runs["compiled"][n].any(), n
        for run in runs.values():
            del run[n]
    kc.assert_dit_tracks(runs, "bfloat16", "compiled")
