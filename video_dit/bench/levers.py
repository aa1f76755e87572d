"""Optimization levers of the DiT training step, one at a time: each lever is switched off and on
on ONE model (same weights, same inputs, everything else as shipped), the two states timed side by
side (alternating rounds, median) and their forward + backward activation peak measured (CPU:
the profiler's allocation timeline; CUDA: the allocator's peak), so a lever's effect is a ratio
measured in one run rather than a comparison between runs on a noisy machine.

    python -m video_dit.bench.levers [--shape lever|small|full] [--repeats 3] [--threads N] [--lever NAME ...]
    video-dit bench --suite levers

Levers ("on" is what ships unless the table says otherwise):
  recompute   RecomputeSaved: cheap elementwise results autograd would keep (GELU, modulated
              inputs, norms, rotated q/k) are stored as recipes and recomputed in backward.
  rms_norm    our RMSNorm autograd function (saves x and the row rstd) vs torch's F.rms_norm.
  rope_cache  the real RoPE tables cached per token grid vs rebuilt on every forward.
  kernels     the fused ops (`set_kernels("triton")`: q/k RMSNorm + RoPE, LayerNorm + adaLN modulation,
              Triton kernels on CUDA) vs the torch path (`set_kernels("torch")`). Ships as "auto" (on
              on CUDA when triton imports); on CPU "on" runs the fused ops' torch implementation, and
              the row says "failed" without triton.
  compile     `VideoDiT.compile_blocks()` (each block compiled in place, dynamic=False, Inductor's
              mix-order reduction off, RecomputeSaved off inside) vs eager, with the model's kernels
              as shipped; the first (compiling) step is reported apart as compile_s. Off by default.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn.functional as F

from video_dit.bench.common import median, profiled_peak, time_side_by_side, write_json
from video_dit.families.wan import dit
from video_dit.families.wan.config import DiTConfig
from video_dit.families.wan.dit import VideoDiT, cast_dit
from video_dit.parallel.memory import cuda_peak

LEVER = dict(dim=1536, heads=12, ffn_dim=8960, layers=1, latents=(16, 4, 32, 32), text_len=512, text_dim=4096)
SMALL = dict(dim=256, heads=4, ffn_dim=1024, layers=2, latents=(16, 4, 24, 24), text_len=64, text_dim=256)
SHAPES = {"lever": LEVER, "small": SMALL}
LEVERS = ("recompute", "rms_norm", "rope_cache", "kernels", "compile")


def build(shape: dict, device: str, dtype: torch.dtype):
    """Our DiT with Wan's init (head given small weights, so every block gets gradient) and inputs."""
    torch.manual_seed(0)
    cfg = DiTConfig(in_dim=shape["latents"][0], out_dim=16, dim=shape["dim"], ffn_dim=shape["ffn_dim"],
                    freq_dim=256, text_dim=shape["text_dim"], num_heads=shape["heads"],
                    num_layers=shape["layers"], text_len=shape["text_len"])
    model = VideoDiT(cfg)
    with torch.no_grad():
        model.head.head.weight.normal_(std=0.02)
    cast_dit(model.to(device), dtype, masters=True).train()  # the trainer's storage: a full fine-tune
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, *shape["latents"], generator=g).to(device=device, dtype=dtype)
    context = torch.randn(1, shape["text_len"], shape["text_dim"], generator=g).to(device=device, dtype=dtype)
    return model, (x, torch.tensor([700.0], device=device), context)


def _torch_rms_norm(self, x):
    return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class Switch:
    """`set(on)` puts the model in the lever's on / off state; `restore()` leaves it as shipped."""

    def __init__(self, name: str, model):
        self.name, self.model, self.dit = name, model, dit
        self.shipped_forward = dit.RMSNorm.forward
        self.compiled = None  # each block's compiled call, once compiled
        self.on = True

    def set(self, on: bool) -> None:
        m, name = self.model, self.name
        self.on = on
        if name == "recompute":
            for block in m.blocks:
                block.recompute = on
        elif name == "rms_norm":  # the torch path's norm (the fused ops do not call _RMSNormFn)
            m.set_kernels("torch")
            self.dit.RMSNorm.forward = self.shipped_forward if on else _torch_rms_norm
        elif name == "kernels":
            m.set_kernels("triton" if on else "torch")
        elif name == "compile":
            if on and self.compiled is None:
                m.compile_blocks(dynamic=False)
                self.compiled = [b._compiled_call_impl for b in m.blocks]
            # compile_blocks compiles in place (nn.Module.compile): toggling the compiled call toggles it
            for block, call in zip(m.blocks, self.compiled or [None] * len(m.blocks)):
                block._compiled_call_impl = call if on else None
            m.blocks_compiled = on and self.compiled is not None
            m.set_recompute_saved(m.recompute_saved)

    def before_step(self) -> None:
        if self.name == "rope_cache" and not self.on:
            self.model._rope_cache.clear()

    def restore(self) -> None:
        if self.name in ("kernels", "rms_norm"):  # as shipped: "auto"
            for module in self.model.modules():
                if hasattr(module, "kernels"):
                    module.kernels = "auto"
        else:
            self.set(self.name != "compile")
        self.dit.RMSNorm.forward = self.shipped_forward


def measure(name: str, model, inputs, repeats: int, device: str) -> dict:
    sw = Switch(name, model)

    def step_in(on: bool):
        def step():
            sw.set(on)
            sw.before_step()
            model(*inputs).float().square().mean().backward()
        return step

    out: dict = {}
    try:
        if name == "compile":  # the compiling step, apart
            t0 = time.perf_counter()
            step_in(True)()
            out["compile_s"] = time.perf_counter() - t0
        times = time_side_by_side({"off": step_in(False), "on": step_in(True)}, repeats, device)
        out["step_s"] = {k: median(v) for k, v in times.items()}
        out["step_s_all"] = times
        out["time_ratio"] = out["step_s"]["on"] / out["step_s"]["off"]
        peaks = {}
        for state in ("off", "on"):
            model.zero_grad(set_to_none=False)  # grad buffers exist: only activations count
            if device.startswith("cuda"):
                peaks[state] = cuda_peak(step_in(state == "on"), device)[1]
            else:
                peaks[state] = profiled_peak(step_in(state == "on"))
        out["act_peak_bytes"] = peaks
        out["peak_ratio"] = peaks["on"] / peaks["off"]
    except Exception as e:  # noqa: BLE001 - a lever that fails to run is reported, the others still run
        out["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
    finally:
        sw.restore()
    return out


def run(device: str = "cpu", repeats: int = 3, small: bool = False, threads: int | None = None,
        shape: str | None = None, levers=LEVERS) -> dict:
    if threads:
        torch.set_num_threads(threads)
    unknown = sorted(set(levers) - set(LEVERS))
    if unknown:
        raise ValueError(f"unknown lever(s) {', '.join(unknown)}; accepted: {', '.join(LEVERS)}")
    name = shape or ("small" if small else "lever")
    if name not in SHAPES:
        raise ValueError(f"unknown levers shape {name!r}; accepted: {', '.join(SHAPES)}")
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    model, inputs = build(SHAPES[name], device, dtype)
    _, Fl, h, w = SHAPES[name]["latents"]
    res = {"config": {**SHAPES[name], "shape": name, "tokens": Fl * h * w // 4, "device": device,
                      "dtype": str(dtype).removeprefix("torch."), "threads": torch.get_num_threads(),
                      "repeats": repeats, "torch": torch.__version__}, "levers": {}}
    for lever in levers:
        res["levers"][lever] = measure(lever, model, inputs, repeats, device)
    return res


def print_table(res: dict) -> None:
    c, mib = res["config"], 2 ** 20
    print(f"DiT levers, one at a time: dim {c['dim']}, {c['layers']} block(s), {c['tokens']} tokens, {c['dtype']}, "
          f"{c['device']}, {c['threads']} threads, median of {c['repeats']} (torch {c['torch']})")
    print(f"{'lever':12}{'off s':>9}{'on s':>9}{'time on/off':>13}{'act off MiB':>13}{'act on MiB':>12}"
          f"{'act on/off':>12}  notes")
    for name, r in res["levers"].items():
        if "error" in r:
            print(f"{name:12}{'failed: ' + r['error']}")
            continue
        p = r["act_peak_bytes"]
        note = f"compile {r['compile_s']:.1f}s" if "compile_s" in r else ""
        print(f"{name:12}{r['step_s']['off']:9.3f}{r['step_s']['on']:9.3f}{r['time_ratio']:13.3f}"
              f"{p['off'] / mib:13.1f}{p['on'] / mib:12.1f}{r['peak_ratio']:12.3f}  {note}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--shape", choices=tuple(SHAPES), default=None)
    p.add_argument("--small", action="store_true")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--lever", action="append", choices=LEVERS, help="only these (repeatable; default: all)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    res = run(args.device, args.repeats, args.small, args.threads, args.shape, args.lever or LEVERS)
    print_table(res)
    write_json(res, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
