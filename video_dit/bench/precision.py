"""Precision benchmark: how far the bf16 DiT is from a float64 run of the same weights, beside
diffusers' `WanTransformer3DModel` in bf16 and a pure-bf16 cast of our model, for the forward
(the velocity) and for the gradient of a LoRA step; then what our bf16 costs against the pure cast.

    video-dit bench --suite precision [--small]
    python -m video_dit.bench.precision [--small] [--layers N] [--parts errors,cost] [--json FILE]

The four runs hold the same weights (diffusers' random init, converted to our names) and the same
LoRA (rank 16 on the blocks' attention and FFN Linears, lora_B non-zero so both halves get a gradient):
  float64    ours, every parameter float64: the reference;
  ours bf16  as the trainer stores a LoRA job (`cast_dit(model, bf16, masters=True)`): frozen bulk bf16,
             the float32 islands (time MLPs, modulation tables, norms, head) and the adapters float32,
             the forward under bf16 autocast with float32 islands and a float32 residual stream;
  pure bf16  `torch.nn.Module.to(model, torch.bfloat16)`, adapters included (DeepSpeed's bf16 mode casts every parameter),
             our forward otherwise unchanged (float32 adaLN arithmetic and residual stream);
  before     the pure cast with a bf16 residual stream (`x + y * gate` back in bf16, as diffusers does):
             what this project computed before the float32 islands;
  diffusers  bf16 as `from_pretrained(torch_dtype=bf16)` leaves it (`_keep_in_fp32_modules`: time_embedder,
             scale_shift_table, norm1-3 float32), adapters float32 (diffusers' training scripts'
             `cast_training_params`), no autocast (its pipelines run none).
Inputs as in training: normalized latents x0 ~ N(0, 1) noised at t in {50, 350, 650, 950} (one sample
each), per-token timesteps (the last two samples' first latent frame clean at t = 0, as first-frame
conditioning does), prompts of 24-120 tokens zero-padded to text_len. Error = ||y - y64|| / ||y64||:
of each sample's velocity, and of all LoRA gradients of the MSE loss together.

Shapes: "full" is the Wan 2.1 1.3B width (dim 1536, 12 heads, ffn 8960, text 512 x 4096), 2 blocks,
4 samples x 768 tokens (latents 16 x 3 x 32 x 32); "small" (CI) is dim 128. Cost: fwd+bwd time of
one sample, ours / pure bf16, side by side, for the LoRA job and for a full fine-tune (ours: float32
master weights under bf16 autocast; pure: bf16 weights), the parameter bytes and the activation peak.
diffusers is a test/bench-only dependency.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import sys
import time

import torch

from video_dit.bench.common import diffusers_as_loaded, dit_pair, median, profiled_peak, time_side_by_side, write_json
from video_dit.diffusion.flow import add_noise, velocity_target
from video_dit.families.wan import layers as dit_layers
from video_dit.families.wan.convert import dit_from_diffusers
from video_dit.families.wan.dit import LORA_TARGETS, cast_dit
from video_dit.lora import add_lora
from video_dit.parallel.memory import cuda_peak

FULL = dict(dim=1536, heads=12, ffn_dim=8960, layers=2, latents=(16, 3, 32, 32), text_len=512, text_dim=4096,
            rank=16)
SMALL = dict(dim=128, heads=4, ffn_dim=384, layers=2, latents=(16, 3, 16, 16), text_len=64, text_dim=128, rank=4)
SHAPES = {"full": FULL, "small": SMALL}
T_VALUES = (50.0, 350.0, 650.0, 950.0)  # one sample each; the last two with a clean first frame (t = 0)
DIFFUSERS_LORA = r"blocks\.\d+\.((attn1|attn2)\.(to_q|to_k|to_v|to_out\.0)|ffn\.net\.(0\.proj|2))"
RUNS = ("float64", "ours", "pure", "before", "diffusers")


@contextlib.contextmanager
def bf16_residual():
    """The "before" run: our gated residual update returning its input's dtype (bf16 from the patch
    embedding on), instead of Wan's float32 stream. Swaps `dit_layers.gated_add`, which `Block` looks up."""
    shipped = dit_layers.gated_add

    def gated_add(x, y, gate):
        return shipped(x, y, gate).to(x.dtype)

    dit_layers.gated_add = gated_add
    try:
        yield
    finally:
        dit_layers.gated_add = shipped


def build(shape: dict, seed: int = 0):
    """(ours float32 with LoRA, diffusers float32 with the same LoRA); diffusers' random init."""
    from peft import LoraConfig, inject_adapter_in_model

    ours, ref = dit_pair(shape, seed)
    rank = shape["rank"]
    add_lora(ours, rank, rank, targets=LORA_TARGETS)
    g = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():  # lora_B = 0 (peft's init) would give lora_A no gradient
        for name, p in ours.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5 / rank)
    ref.requires_grad_(False)
    inject_adapter_in_model(LoraConfig(r=rank, lora_alpha=rank, target_modules=DIFFUSERS_LORA), ref)
    lora = _lora_of(ours)
    theirs = {k: v for k, v in ref.named_parameters() if ".lora_" in k}
    mapped = dit_from_diffusers(theirs)
    if set(mapped) != set(lora):
        raise RuntimeError(f"LoRA modules differ: ours {sorted(set(lora) - set(mapped))[:3]}, diffusers "
                           f"{sorted(set(mapped) - set(lora))[:3]}")
    with torch.no_grad():
        for key, p in theirs.items():
            p.copy_(lora[_native(key)])
            p.requires_grad_(True)
    return ours, ref


def _native(diffusers_key: str) -> str:
    return next(iter(dit_from_diffusers({diffusers_key: None})))


def _lora_of(model) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.named_parameters() if ".lora_" in k}


def make_inputs(shape: dict, seed: int = 1) -> dict:
    """Training-like inputs (see the module docstring), float32 on CPU."""
    g = torch.Generator().manual_seed(seed)
    B = len(T_VALUES)
    C, Fl, h, w = shape["latents"]
    x0 = torch.randn(B, C, Fl, h, w, generator=g)
    noise = torch.randn(x0.shape, generator=g)
    t = torch.tensor(T_VALUES)
    x_t = add_noise(x0, noise, t)
    per_frame = t.view(B, 1).repeat(1, Fl)  # (B, F') timestep of each latent frame
    per_frame[B // 2:, 0] = 0.0  # first-frame conditioning: a clean first frame at t = 0
    x_t[B // 2:, :, 0] = x0[B // 2:, :, 0]
    tokens_per_frame = (h // 2) * (w // 2)
    timestep = per_frame.repeat_interleave(tokens_per_frame, dim=1)  # (B, L)
    lengths = torch.randint(24, min(120, shape["text_len"]) + 1, (B,), generator=g)
    context = [torch.randn(int(n), shape["text_dim"], generator=g) for n in lengths]
    padded = torch.stack([torch.cat([c, c.new_zeros(shape["text_len"] - c.shape[0], c.shape[1])]) for c in context])
    return {"x": x_t, "timestep": timestep, "context": context, "padded": padded,
            "target": velocity_target(x0, noise)}


def _forward(model, inputs: dict, is_ref: bool, dtype: torch.dtype) -> torch.Tensor:
    device = next(model.parameters()).device
    x, timestep = inputs["x"].to(device, dtype), inputs["timestep"].to(device)
    if is_ref:
        return model(hidden_states=x, timestep=timestep, encoder_hidden_states=inputs["padded"].to(device, dtype),
                     return_dict=False)[0]
    return model(x, timestep, [c.to(device, dtype) for c in inputs["context"]])


def _run(model, inputs: dict, is_ref: bool, dtype: torch.dtype) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(velocity (B, C, F', h, w) float64, LoRA gradients by native name, float64) of one fwd+bwd."""
    model.zero_grad(set_to_none=True)
    pred = _forward(model, inputs, is_ref, dtype)
    loss = (pred.double() - inputs["target"].to(pred.device).double()).square().mean()
    loss.backward()
    grads = {(_native(k) if is_ref else k): p.grad.double().cpu() for k, p in _lora_of(model).items()}
    return pred.detach().double().cpu(), grads


def variant(name: str, ours, ref, device="cpu"):
    """(model, is_diffusers, input dtype) of a run, built from the float32 originals."""
    if name == "float64":
        return copy.deepcopy(ours).to(device).double(), False, torch.float64
    if name == "ours":
        return cast_dit(copy.deepcopy(ours).to(device), torch.bfloat16, masters=True), False, torch.bfloat16
    if name in ("pure", "before"):
        return torch.nn.Module.to(copy.deepcopy(ours), device, torch.bfloat16), False, torch.bfloat16  # every parameter
    if name == "diffusers":
        model = diffusers_as_loaded(copy.deepcopy(ref).to(device), torch.bfloat16)
        for k, p in _lora_of(model).items():
            p.data = p.data.float()
        return model, True, torch.bfloat16
    raise ValueError(f"unknown precision run {name!r}; accepted: {', '.join(RUNS)}")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def errors(shape: dict, seed: int = 0, runs=RUNS, device="cpu") -> dict:
    """Each run's relative error against the float64 run: per-sample velocity and LoRA gradient."""
    ours, ref = build(shape, seed)
    inputs = make_inputs(shape, seed + 1)
    outs = {}
    for name in runs:
        model, is_ref, dtype = variant(name, ours, ref, device)
        with bf16_residual() if name == "before" else contextlib.nullcontext():
            outs[name] = _run(model, inputs, is_ref, dtype)
        del model
    pred64, grad64 = outs["float64"]
    keys = sorted(grad64)
    g64 = torch.cat([grad64[k].flatten() for k in keys])
    res = {}
    for name in runs:
        if name == "float64":
            continue
        pred, grads = outs[name]
        per_sample = [_rel(pred[i], pred64[i]) for i in range(pred.shape[0])]
        res[name] = {"velocity": median(per_sample), "velocity_max": max(per_sample),
                     "velocity_per_t": dict(zip([f"{t:g}" for t in T_VALUES], per_sample)),
                     "lora_grad": _rel(torch.cat([grads[k].flatten() for k in keys]), g64)}
    return res


def cost(shape: dict, repeats: int, seed: int = 0, device="cpu") -> dict:
    """Ours bf16 against the pure-bf16 cast and "before", one sample: fwd+bwd time (side by side),
    parameter and gradient bytes, the fwd+bwd activation peak; for the LoRA job and a full fine-tune."""
    ours, _ = build(shape, seed)
    ours.to(device)
    inputs = {k: v[:1] for k, v in make_inputs(shape, seed + 1).items()}  # the first sample
    out = {}
    for job in ("lora", "full"):
        base = copy.deepcopy(ours)
        if job == "full":
            base.requires_grad_(True)
        models = {"ours": cast_dit(copy.deepcopy(base), torch.bfloat16, masters=True),
                  "pure": torch.nn.Module.to(copy.deepcopy(base), torch.bfloat16)}
        models["before"] = models["pure"]

        def step(name):
            m = models[name]

            def fn():
                m.zero_grad(set_to_none=False)  # the .grad buffers of the warm-up stay: not in the peak
                with bf16_residual() if name == "before" else contextlib.nullcontext():
                    _forward(m, inputs, False, torch.bfloat16).float().square().mean().backward()
            return fn

        cpu_s: dict[str, list[float]] = {k: [] for k in models}

        def cpu_timed(name):  # CPU seconds too: on a shared machine they are steadier than wall time
            fn = step(name)

            def run_once():
                start = time.process_time()
                fn()
                cpu_s[name].append(time.process_time() - start)
            return run_once

        times = time_side_by_side({k: cpu_timed(k) for k in models}, repeats, device)
        cpu = {k: median(v[-repeats:]) for k, v in cpu_s.items()}  # the timed rounds, not the warm-up
        peaks = {k: cuda_peak(step(k), device)[1] if str(device).startswith("cuda") else profiled_peak(step(k))
                 for k in models}
        nbytes = {k: {"params": sum(p.numel() * p.element_size() for p in m.parameters()),
                      "grads": sum(p.grad.numel() * p.grad.element_size() for p in m.parameters()
                                   if p.grad is not None)}
                  for k, m in models.items()}
        step_s = {k: median(v) for k, v in times.items()}
        out[job] = {"step_s": step_s, "step_s_all": times, "cpu_s": cpu, "bytes": nbytes, "act_peak_bytes": peaks,
                    **{f"vs_{b}": {"time": step_s["ours"] / step_s[b], "cpu_time": cpu["ours"] / cpu[b],
                                   "act_peak": peaks["ours"] / peaks[b],
                                   "params": nbytes["ours"]["params"] / nbytes[b]["params"]}
                       for b in ("pure", "before")}}
        del models, base
    return out


def run(device: str = "cpu", repeats: int = 2, small: bool = False, threads: int | None = None,
        layers: int | None = None, parts=("errors", "cost")) -> dict:
    if threads:
        torch.set_num_threads(threads)
    shape = dict(SMALL if small else FULL)
    if layers:
        shape["layers"] = layers
    C, Fl, h, w = shape["latents"]
    res: dict = {"config": {**shape, "tokens": Fl * (h // 2) * (w // 2), "samples": len(T_VALUES),
                            "t": list(T_VALUES), "device": device, "threads": torch.get_num_threads(),
                            "torch": torch.__version__}}
    if "errors" in parts:
        e = res["errors"] = errors(shape, device=device)
        res["velocity_ours_vs_diffusers"] = e["ours"]["velocity"] / e["diffusers"]["velocity"]
        res["velocity_ours_vs_pure"] = e["ours"]["velocity"] / e["pure"]["velocity"]
        res["lora_grad_ours_vs_diffusers"] = e["ours"]["lora_grad"] / e["diffusers"]["lora_grad"]
        res["lora_grad_ours_vs_pure"] = e["ours"]["lora_grad"] / e["pure"]["lora_grad"]
    if "cost" in parts:
        res["cost"] = cost(shape, repeats, device=device)
    return res


def print_table(res: dict) -> None:
    c = res["config"]
    print(f"bf16 precision vs a float64 run of the same weights: dim {c['dim']}, {c['layers']} blocks, "
          f"{c['samples']} samples x {c['tokens']} tokens, t {c['t']} (per-token, clean first frame on the last two)")
    if "errors" in res:
        print(f"{'run':12}{'velocity (median)':>20}{'velocity (max)':>16}{'LoRA gradient':>16}")
        for name, e in res["errors"].items():
            print(f"{name:12}{e['velocity']:>20.3e}{e['velocity_max']:>16.3e}{e['lora_grad']:>16.3e}")
        print(f"ours / diffusers: velocity {res['velocity_ours_vs_diffusers']:.3f}, LoRA gradient "
              f"{res['lora_grad_ours_vs_diffusers']:.3f}; ours / pure bf16: velocity "
              f"{res['velocity_ours_vs_pure']:.3f}, "
              f"LoRA gradient {res['lora_grad_ours_vs_pure']:.3f}")
    for job, k in res.get("cost", {}).items():
        b, peak = k["bytes"], k["act_peak_bytes"]
        print(f"cost, {job}: fwd+bwd {k['step_s']['ours']:.2f} s vs pure {k['step_s']['pure']:.2f} / before "
              f"{k['step_s']['before']:.2f} s (ratio {k['vs_pure']['time']:.3f} / {k['vs_before']['time']:.3f}; "
              f"CPU time {k['vs_pure']['cpu_time']:.3f} / {k['vs_before']['cpu_time']:.3f}); "
              f"activation peak {peak['ours'] / 2 ** 20:.0f} vs {peak['pure'] / 2 ** 20:.0f} / "
              f"{peak['before'] / 2 ** 20:.0f} MiB ({k['vs_pure']['act_peak']:.3f} / "
              f"{k['vs_before']['act_peak']:.3f}); "
              f"params + grads {(b['ours']['params'] + b['ours']['grads']) / 2 ** 20:.0f} vs "
              f"{(b['pure']['params'] + b['pure']['grads']) / 2 ** 20:.0f} MiB")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--small", action="store_true", help="dim 128 (the CI shape) instead of the 1.3B width")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--layers", type=int, default=None, help="blocks (default 2)")
    p.add_argument("--repeats", type=int, default=2, help="timed repeats of the cost part")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--parts", default="errors,cost", help="comma-separated: errors, cost")
    p.add_argument("--json", default=None, metavar="FILE")
    args = p.parse_args(argv)
    parts = tuple(args.parts.split(","))
    unknown = set(parts) - {"errors", "cost"}
    if unknown:
        print(f"error: --parts {sorted(unknown)}; accepted: errors, cost", file=sys.stderr)
        return 2
    res = run(device=args.device, repeats=args.repeats, small=args.small, threads=args.threads, layers=args.layers,
              parts=parts)
    print_table(res)
    write_json(res, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
