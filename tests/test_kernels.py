"""The fused kernels (`video_dit.kernels`): each op against the plain-torch reference (forward and
every gradient, float32 and bf16, T = 1 and per-token), the reference against the DiT's torch path,
`torch.library.opcheck`, the whole DiT fused vs torch, and the attention backends' errors
(compiled blocks: tests/test_compile.py).

The Triton kernels run in triton's interpreter on CPU, in one subprocess (`kernel_cases.py`; the
interpreter must be chosen before the kernels are decorated), skipped when triton is not installed.
Everything else runs the ops' torch implementation in this process, triton or not. `gpu` tests run
the compiled kernels on CUDA.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import time
from pathlib import Path

import helpers
import kernel_cases as kc
import pytest
import torch

from video_dit import kernels
from video_dit.families.wan.dit import cast_dit
from video_dit.families.wan.layers import SelfAttention
from video_dit.kernels import ln_modulate, ln_modulate_reference, ops, rms_norm_rope, rms_norm_rope_reference
from video_dit.models import attention as attn
from video_dit.models.layers import modulate

TESTS = Path(__file__).resolve().parent
HAS_TRITON = kernels.TRITON_AVAILABLE  # triton imports here


# ---------------------------------------------------------------- the reference is the torch path


def test_reference_is_the_dit_torch_path():
    """The oracle computes what the DiT's torch path computes: bit-equal forwards (SelfAttention's q/k
    norm + RoPE, `modulate`), gradients to float32 rounding."""
    case = kc.rms_case("bfloat16", rope=True)
    attn_layer = SelfAttention(24, 2, qk_norm=True, eps=kc.EPS)
    attn_layer.kernels = "torch"
    with torch.no_grad():
        attn_layer.norm_q.weight.copy_(case["weight"])
    ours = kc.run_rms(lambda x, w, c, s, eps, h: attn_layer._norm_rope(attn_layer.norm_q, x, c, s), case)
    ours["weight"] = attn_layer.norm_q.weight.grad
    ref = kc.run_rms(rms_norm_rope_reference, case)
    assert torch.equal(ours["out"], ref["out"])
    kc.assert_near(ours, ref, "bfloat16")  # _RMSNormFn's weight grad uses the unrounded x * rstd
    for T in ("1", "L"):
        case = kc.ln_case("float32", T)
        got = kc.run_ln(lambda x, sh, sc, eps, dt: modulate(x, sh, sc, eps, dt), case)
        ref = kc.run_ln(ln_modulate_reference, case)
        assert torch.equal(got["out"], ref["out"])
        kc.assert_near(got, ref, "float32")


# ---------------------------------------------------------------- the ops (torch implementation here)


@pytest.mark.parametrize("dtype, rope", kc.RMS_CASES)
def test_rms_norm_rope_matches_reference(dtype, rope):
    case = kc.rms_case(dtype, rope)
    kc.assert_near(kc.run_rms(rms_norm_rope, case), kc.run_rms(rms_norm_rope_reference, case), dtype)


@pytest.mark.parametrize("dtype, T", kc.LN_CASES)
def test_ln_modulate_matches_reference(dtype, T):
    case = kc.ln_case(dtype, T)
    got, ref = kc.run_ln(ln_modulate, case), kc.run_ln(ln_modulate_reference, case)
    kc.assert_near(got, ref, dtype)
    assert got["scale"].shape == (2, 1 if T == "1" else 6, 24)  # (B, T, D): summed over tokens for T = 1


def test_opcheck_custom_ops():
    """Schema, fake tensors (what torch.compile traces), autograd registration, AOT dispatch."""
    case, ln = kc.rms_case("bfloat16", True), kc.ln_case("float32", "1")
    x, w = case["x"].requires_grad_(), case["weight"].requires_grad_()
    shift, scale = ln["table"].requires_grad_().unbind(2)
    out, rstd = ops._rms_norm_rope(x, w, case["cos"], case["sin"], kc.EPS, 2)
    checks = [
        (ops._rms_norm_rope, (x, w, case["cos"], case["sin"], kc.EPS, 2)),
        (ops._rms_norm_rope, (x, w, None, None, kc.EPS, 2)),
        (ops._rms_norm_rope_backward,
         (case["grad"], x.detach(), w.detach(), case["cos"], case["sin"], rstd.detach(), 2)),
        (ops._ln_modulate, (ln["x"].requires_grad_(), shift, scale, kc.EPS, torch.bfloat16)),
    ]
    for op, args in checks:
        result = torch.library.opcheck(op, args)
        assert set(result.values()) == {"SUCCESS"}, (op, result)


def test_ops_reject_what_they_cannot_compute():
    x, table = torch.randn(2, 6, 8), torch.randn(2, 1, 2, 8)
    shift, scale = table.unbind(2)
    with pytest.raises(ValueError, match="float32"):
        ln_modulate(x, shift.double(), scale.double(), 1e-6, torch.float32)
    with pytest.raises(ValueError, match=r"shift must be \(B=2, T in \(1, 6\), D=8\)"):
        ln_modulate(x, torch.randn(2, 3, 8), torch.randn(2, 3, 8), 1e-6, torch.float32)
    with pytest.raises(ValueError, match="x must be"):
        rms_norm_rope(x.double(), torch.ones(8), None, None, 1e-6, 2)
    with pytest.raises(ValueError, match="both cos and sin"):
        rms_norm_rope(x, torch.ones(8), torch.ones(1, 6, 1, 2), None, 1e-6, 2)


@pytest.mark.parametrize("dtype, per_token", kc.DIT_CASES)
def test_dit_with_fused_ops_tracks_the_torch_path(dtype, per_token):
    """The whole DiT with every fused op (their torch implementation here) vs the torch path:
    same outputs and gradients to rounding, with and without RecomputeSaved."""
    kc.assert_dit_tracks(kc.dit_runs(dtype, per_token), dtype)


def test_fused_ops_keep_recompute_saved_and_checkpointing():
    """With the fused ops, RecomputeSaved gives the gradients of keeping everything and still saves
    memory (less than on the torch path: the ops save only their inputs and row statistics), block
    checkpointing the same gradients; the activation peak is no higher than the torch path's."""
    from video_dit.bench.common import profiled_peak

    model = kc.flag(helpers.tiny_dit(dim=64, ffn_dim=256, num_heads=4), "triton")
    g = torch.Generator().manual_seed(1)
    x, context = torch.randn(1, 4, 4, 16, 16, generator=g), torch.randn(1, 10, 24, generator=g)
    t = 1000 * torch.rand(1, 256, generator=g)  # 256 tokens, per-token timesteps

    def step():
        model.zero_grad(set_to_none=True)
        model(x, t, context).square().mean().backward()

    grads, peaks = {}, {}
    for state in ("torch", "recompute", "keep", "checkpoint"):
        kc.flag(model, "torch" if state == "torch" else "triton")
        model.set_recompute_saved(state in ("torch", "recompute"))
        model.enable_gradient_checkpointing() if state == "checkpoint" else model.disable_gradient_checkpointing()
        peaks[state] = profiled_peak(step)
        grads[state] = {n: p.grad.clone() for n, p in model.named_parameters()}
    for state in ("keep", "checkpoint"):
        for n, grad in grads["recompute"].items():
            torch.testing.assert_close(grads[state][n], grad, rtol=1e-5, atol=1e-7, msg=(state, n))
    assert peaks["recompute"] < 0.95 * peaks["keep"] and peaks["recompute"] <= peaks["torch"], peaks


def test_kernels_switch():
    model = helpers.tiny_dit()
    assert {m.kernels for m in model.modules() if hasattr(m, "kernels")} == {"auto"}
    x = torch.randn(1, 2, 8)
    assert not kernels.use_fused("auto", x) and not kernels.use_fused("torch", x) and kernels.use_fused("triton", x)
    with pytest.raises(ValueError, match="accepted: auto, triton, torch"):
        model.set_kernels("cuda")
    if HAS_TRITON:
        assert model.set_kernels("triton").blocks[1].self_attn.kernels == "triton"
        assert model.head.kernels == model.blocks[0].cross_attn.kernels == model.blocks[0].kernels == "triton"
    else:
        with pytest.raises(RuntimeError, match="pip install triton"):
            model.set_kernels("triton")
    assert model.set_kernels("torch").blocks[0].self_attn.kernels == "torch"
    assert ("unavailable" not in kernels.status()) == HAS_TRITON


# ---------------------------------------------------------------- Triton, interpreted on CPU


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    if not HAS_TRITON:
        pytest.skip(f"the Triton kernels are not tested: {kernels.status()}")
    out = tmp_path_factory.mktemp("kernels") / "cases.pt"
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(TESTS.parent), str(TESTS)])}
    proc = subprocess.run([sys.executable, str(TESTS / "kernel_cases.py"), str(out)], env=env, cwd=TESTS.parent,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = torch.load(out, weights_only=False)
    assert res["interpreted"], res["status"]  # the kernels ran, not the torch implementation
    return res


@pytest.mark.parametrize("dtype, rope", kc.RMS_CASES)
def test_triton_rms_norm_rope(interpreted, dtype, rope):
    kc.assert_near(*interpreted["rms", dtype, rope], dtype)


@pytest.mark.parametrize("dtype, T", kc.LN_CASES)
def test_triton_ln_modulate(interpreted, dtype, T):
    kc.assert_near(*interpreted["ln", dtype, T], dtype)


@pytest.mark.parametrize("dtype, per_token", kc.DIT_CASES)
def test_triton_dit_tracks_the_torch_path(interpreted, dtype, per_token):
    kc.assert_dit_tracks(interpreted["dit", dtype, per_token], dtype)


def test_triton_opcheck(interpreted):
    for op, result in interpreted["opcheck"].items():
        assert set(result.values()) == {"SUCCESS"}, (op, result)


# ---------------------------------------------------------------- attention backends


def test_attention_backends_and_their_errors():
    assert attn.BACKENDS == ("native", "flash", "flash3", "sage")
    model = helpers.tiny_dit()
    for backend, package in (("flash", "flash_attn"), ("flash3", "flash_attn_interface"), ("sage", "sageattention")):
        if attn.available(backend):
            continue
        with pytest.raises(RuntimeError, match=f"needs the {package} package"):
            model.set_attention_backend(backend)
        q = torch.randn(1, 4, 2, 8)
        with pytest.raises(RuntimeError, match=f"needs the {package} package"):
            attn.attention(q, q, q, backend=backend)
        # masked calls go through SDPA whatever the backend
        mask = torch.tensor([[True, True, False, True]])
        torch.testing.assert_close(attn.attention(q, q, q, backend=backend, attn_mask=mask),
                                   attn.attention(q, q, q, attn_mask=mask))
    with pytest.raises(ValueError, match="accepted: native, flash, flash3, sage"):
        model.set_attention_backend("xformers")
    # the sequence-parallel layer's local attention takes its backend through (no process group needed here)
    from video_dit.parallel.sequence import UlyssesSequenceParallel

    sp = object.__new__(UlyssesSequenceParallel)
    sp.backend = next((b for b in attn.BACKENDS if not attn.available(b)), None)
    if sp.backend is not None:
        q = torch.randn(1, 4, 2, 8)
        with pytest.raises(RuntimeError, match=f"backend {sp.backend!r} needs"):
            sp._local_attention(q, q, q, None)


# ---------------------------------------------------------------- CUDA: the compiled kernels


def _cuda_rms_case(L=1024, H=12, Dh=128, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1, L, H * Dh, device="cuda", generator=g).to(dtype)
    cos, sin = (t.cuda() for t in kc.rope_tables((4, 16, L // 64), Dh))
    return dict(x=x, weight=1 + 0.1 * torch.randn(H * Dh, device="cuda", generator=g), cos=cos, sin=sin,
                num_heads=H, grad=torch.randn(1, L, H, Dh, device="cuda", generator=g).to(dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_kernels_match_reference_at_wan_width(dtype):
    case = _cuda_rms_case(dtype=getattr(torch, dtype))
    # scale 4: the weight gradient and T = 1's scale / shift gradients sum 1024 rows in another order
    kc.assert_near(kc.run_rms(rms_norm_rope, case), kc.run_rms(rms_norm_rope_reference, case), dtype, scale=4)
    for T in (1, 1024):
        g = torch.Generator(device="cuda").manual_seed(1)
        ln = dict(x=2 + torch.randn(1, 1024, 1536, device="cuda", generator=g), dtype=getattr(torch, dtype),
                  table=0.5 * torch.randn(1, T, 2, 1536, device="cuda", generator=g),
                  grad=torch.randn(1, 1024, 1536, device="cuda", generator=g).to(getattr(torch, dtype)))
        kc.assert_near(kc.run_ln(ln_modulate, ln), kc.run_ln(ln_modulate_reference, ln), dtype, scale=4)


@pytest.mark.gpu
def test_cuda_dit_fused_vs_torch():
    """A bf16 DiT at tiny width on CUDA, 16,384 tokens: the fused kernels' step vs the torch path's."""
    base = cast_dit(helpers.tiny_dit(num_layers=2).cuda(), torch.bfloat16, masters=True)
    g = torch.Generator().manual_seed(1)
    inputs = (torch.randn(1, 4, 16, 64, 64, generator=g).cuda(), torch.tensor([700.0]).cuda(),
              torch.randn(1, 10, 24, generator=g).cuda())  # 16 x 32 x 32 = 16,384 tokens
    runs = {}
    for name, kernels_flag, dtype in (("fused", "triton", torch.bfloat16), ("torch", "torch", torch.bfloat16),
                                      ("float32", "torch", torch.float32)):
        model = kc.flag(cast_dit(copy.deepcopy(base), dtype, masters=True), kernels_flag)
        out = model(*inputs)
        out.float().square().mean().backward()
        runs[name] = {"out": out.detach().float().cpu(), **{n: p.grad.cpu() for n, p in model.named_parameters()}}
    runs["fused"]["out"] = runs["fused"]["out"].bfloat16()
    runs["torch"]["out"] = runs["torch"]["out"].bfloat16()
    kc.assert_dit_tracks(runs, "bfloat16")


@pytest.mark.gpu
def test_cuda_fused_ops_are_faster_than_the_torch_path():
    """Forward + backward of the q/k norm + RoPE and the adaLN modulation at Wan 2.1 1.3B widths and
    32,760 tokens, bf16: the fused ops take less time than the torch path (the speed they exist for)."""
    L, D, H = 32760, 1536, 12
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, L, D, device="cuda", generator=g).bfloat16().requires_grad_()
    cos, sin = (t.cuda() for t in kc.rope_tables((21, 30, 52), D // H))
    x = torch.randn(1, L, D, device="cuda", generator=g).requires_grad_()
    table = torch.randn(1, 1, 2, D, device="cuda", generator=g).requires_grad_()
    layer = SelfAttention(D, H, qk_norm=True, eps=1e-6).cuda()

    def step(fused):
        layer.kernels = "triton" if fused else "torch"
        shift, scale = table.unbind(2)
        out = layer._norm_rope(layer.norm_q, q, cos, sin).float().sum()
        out = out + modulate(x, shift, scale, 1e-6, torch.bfloat16, fused=fused).float().sum()
        out.backward()

    times = {}
    for fused in (False, True, False, True):
        step(fused)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(5):
            step(fused)
        torch.cuda.synchronize()
        times[fused] = time.perf_counter() - t0
    assert times[True] < 0.8 * times[False], times
