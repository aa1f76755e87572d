"""The cases of tests/test_kernels.py and test_compile.py: small inputs of the fused ops and of a tiny
DiT, what an implementation makes of them (forward and every gradient), and how close two must be.

Run as a script, `TRITON_INTERPRET=1 python tests/kernel_cases.py OUT.pt` computes every case through
the Triton kernels in triton's interpreter (CPU tensors) and through the reference, and saves them for
the test to compare: the interpreter has to be chosen before triton's kernels are decorated, which a
pytest process that may already have imported them cannot do, so those cases run in this subprocess.
"""

from __future__ import annotations

import sys

import torch

from video_dit.families.wan.layers import rope_tables
from video_dit.kernels import ln_modulate, ln_modulate_reference, rms_norm_rope, rms_norm_rope_reference

RMS_CASES = [(dtype, rope) for dtype in ("float32", "bfloat16") for rope in (True, False)]
LN_CASES = [(dtype, T) for dtype in ("float32", "bfloat16") for T in ("1", "L")]
DIT_CASES = [("float32", False), ("bfloat16", True)]  # (compute dtype, per-token timesteps)
EPS = 1e-6


def rms_case(dtype: str, rope: bool, seed: int = 0, B: int = 2, grid=(1, 2, 3), H: int = 2, Dh: int = 12):
    """q-like x (B, L, H*Dh) in `dtype` (D = 24: not a power of two), a non-trivial float32 weight,
    the RoPE tables of a (1, 2, 3) grid (or none), an output gradient."""
    g = torch.Generator().manual_seed(seed)
    L, dt = grid[0] * grid[1] * grid[2], getattr(torch, dtype)
    cos, sin = rope_tables(grid, Dh) if rope else (None, None)
    return dict(x=(3 * torch.randn(B, L, H * Dh, generator=g)).to(dt), cos=cos, sin=sin, num_heads=H,
                weight=1 + 0.3 * torch.randn(H * Dh, generator=g), grad=torch.randn(B, L, H, Dh, generator=g).to(dt))


def run_rms(fn, case: dict) -> dict:
    x, weight = case["x"].clone().requires_grad_(), case["weight"].clone().requires_grad_()
    out = fn(x, weight, case["cos"], case["sin"], EPS, case["num_heads"])
    out.backward(case["grad"])
    return {"out": out.detach(), "x": x.grad, "weight": weight.grad}


def ln_case(dtype: str, T: str, seed: int = 0, B: int = 2, L: int = 6, D: int = 24):
    """x (B, L, D) in `dtype` off-centre, shift / scale the (B, T, D) `unbind` views of one float32
    (B, T, 2, D) table as a block makes them, output and its gradient in `dtype`."""
    g = torch.Generator().manual_seed(seed)
    dt = getattr(torch, dtype)
    table = 0.5 * torch.randn(B, 1 if T == "1" else L, 2, D, generator=g)
    return dict(x=(2 + 3 * torch.randn(B, L, D, generator=g)).to(dt), table=table, dtype=dt,
                grad=torch.randn(B, L, D, generator=g).to(dt))


def run_ln(fn, case: dict) -> dict:
    x, table = case["x"].clone().requires_grad_(), case["table"].clone().requires_grad_()
    shift, scale = table.unbind(2)  # strided (B, T, D) views
    out = fn(x, shift, scale, EPS, case["dtype"])
    out.backward(case["grad"])
    return {"out": out.detach(), "x": x.grad, "shift": table.grad[:, :, 0], "scale": table.grad[:, :, 1]}


def flag(model, kernels: str):
    """Set every `kernels` flag directly (`set_kernels` asks for triton; the fused ops' torch
    implementation, which runs on CPU without the interpreter, needs none)."""
    for module in model.modules():
        if hasattr(module, "kernels"):
            module.kernels = kernels
    return model


def run_dit(kernels: str, dtype: str, per_token: bool) -> dict:
    """A tiny DiT (tests/helpers.tiny_dit: dim 32, 2 heads, 2 blocks, 12 tokens), trained as the
    trainer stores it (float32 masters computing in `dtype`), one step with `kernels` set."""
    import helpers

    from video_dit.families.wan.dit import cast_dit

    model = flag(cast_dit(helpers.tiny_dit(), getattr(torch, dtype), masters=True), kernels)
    g = torch.Generator().manual_seed(1)
    x, context = torch.randn(2, 4, 2, 4, 6, generator=g), torch.randn(2, 10, 24, generator=g)
    t = 1000 * torch.rand(2, 12, generator=g) if per_token else torch.tensor([900.0, 250.0])
    out = model(x, t, context)
    out.float().square().mean().backward()
    return {"out": out.detach(), **{n: p.grad for n, p in model.named_parameters()}}


def dit_runs(dtype: str, per_token: bool) -> dict:
    """The fused and the torch path in `dtype`, and for bf16 the torch path in float32 (the bf16 noise floor)."""
    runs = {"fused": run_dit("triton", dtype, per_token), "torch": run_dit("torch", dtype, per_token)}
    if dtype != "float32":
        runs["float32"] = run_dit("torch", "float32", per_token)
    return runs


# ---------------------------------------------------------------- comparisons

# max |a - b| over max |b|: float32 rounding (a few ulps after a row reduction); bf16: two ulps (2^-8
# relative each), one where x * rstd is rounded to bf16 before the weight (as the torch path does), one at the end
TOL = {"float32": 2e-6, "bfloat16": 2 ** -6}


def assert_near(got: dict, want: dict, dtype: str, scale: float = 1.0):
    for key, w in want.items():
        g = got[key]
        assert g.shape == w.shape and g.dtype == w.dtype, (key, g.shape, w.shape, g.dtype, w.dtype)
        err = ((g.float() - w.float()).abs().max() / w.float().abs().max()).item()
        assert err <= scale * TOL[dtype], f"{key}: relative error {err:.2e} > {scale * TOL[dtype]:.1e}"


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def assert_dit_tracks(runs: dict, dtype: str, name: str = "fused"):
    """runs[name] (a fused or compiled DiT step) vs runs["torch"] (the eager torch path): float32 to
    rounding (1e-5 of each tensor's norm); bf16 within the bf16 noise itself: each gradient no further
    from the torch path than twice the torch path's own distance from float32 (runs["float32"]), plus
    2^-8 (gradients that are mostly cancellation, such as the k biases', differ by ~2% between bf16
    and float32 on either path); the output to bf16 rounding."""
    fused, ref = runs[name], runs["torch"]
    assert_near({"out": fused["out"]}, {"out": ref["out"]}, dtype)
    for key in ref:
        bound = 1e-5 if dtype == "float32" else 2 * rel(ref[key], runs["float32"][key]) + 2 ** -8
        assert rel(fused[key], ref[key]) <= bound, (key, rel(fused[key], ref[key]), bound)


def interpreted_cases() -> dict:
    """Every case through the Triton kernels (this process must run under TRITON_INTERPRET=1) and the reference."""
    from video_dit import kernels
    from video_dit.kernels import ops

    res = {"interpreted": kernels.TRITON_INTERPRETED, "status": kernels.status()}
    for dtype, rope in RMS_CASES:
        case = rms_case(dtype, rope)
        res["rms", dtype, rope] = run_rms(rms_norm_rope, case), run_rms(rms_norm_rope_reference, case)
    for dtype, T in LN_CASES:
        case = ln_case(dtype, T)
        res["ln", dtype, T] = run_ln(ln_modulate, case), run_ln(ln_modulate_reference, case)
    for dtype, per_token in DIT_CASES:
        res["dit", dtype, per_token] = dit_runs(dtype, per_token)
    case, ln = rms_case("bfloat16", True), ln_case("bfloat16", "1")
    x, w = case["x"].requires_grad_(), case["weight"].requires_grad_()
    shift, scale = ln["table"].requires_grad_().unbind(2)
    res["opcheck"] = {
        "rms_norm_rope": torch.library.opcheck(ops._rms_norm_rope, (x, w, case["cos"], case["sin"], EPS, 2)),
        "ln_modulate": torch.library.opcheck(ops._ln_modulate, (ln["x"].requires_grad_(), shift, scale, EPS,
                                                                torch.bfloat16)),
    }
    return res


if __name__ == "__main__":
    torch.save(interpreted_cases(), sys.argv[1])
