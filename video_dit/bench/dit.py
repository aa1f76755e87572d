"""DiT benchmark: forward+backward of our VideoDiT against diffusers' WanTransformer3DModel, with the
same attention kernel on both sides, then our own levers (fused kernels, compiled blocks) one run each.

Both models hold identical weights (ours converted from diffusers' state dict) and run side by
side in one process with the same threads, alternating, so machine noise hits both alike; the
ratio of medians is the figure. Activation memory of the headline row is measured first, in a fresh
subprocess per model (no allocator history, the device still empty): `saved` = bytes alive after
forward (what autograd keeps), `peak` = the highest extra bytes during forward+backward (grad buffers
pre-allocated, so they do not count); the other rows' memory is the CUDA allocator's, in this process.
On the CPU `saved` and `peak` are the allocations torch's profiler records (`profiled_live_after`,
`profiled_peak`: every tensor, not the scratch inside a kernel); `rss_peak` is the process's resident set
above where it stood, over one more forward+backward (`vae.peak_rss_delta`: the kernel's high-water mark,
so it also sees scratch inside kernels and the allocator's overhead), with glibc's large blocks mapped and
unmapped per tensor
(`vae.MALLOC_ENV`: without it the growth depends on what glibc kept from the steps before; at 1,280 tokens
ours / diffusers ranged over 0.76-1.03 in repeated runs, and was 0.664 in each with it).

    python -m video_dit.bench.dit [--repeats 3] [--small] [--device cpu|cuda] [--shape NAME] [--layers N]
                                  [--attention native,flash,...] [--levers kernels,compile] [--budget S]
    video-dit bench --suite dit [--device cuda]

Rows:
  attention   one per backend of `video_dit.models.attention.BACKENDS`: ours `set_attention_backend(name)`,
              diffusers' `set_attention_backend` with its dispatcher's name for the same kernel
              (`DIFFUSERS_BACKEND`). "native" is SDPA with torch's own kernel choice on both sides (flash /
              memory-efficient / cuDNN on CUDA): the headline row, whose figures are the suite's top-level
              ones. A backend whose package does not import is a row that says so; "sage" has no backward
              (SageAttention is forward only), so its row times the forward alone (no grad).
  levers      ours only, at the native attention, each switched off and on on one model side by side
              (`video_dit.bench.levers.measure`): "kernels" the fused ops (`set_kernels("triton")`) vs the
              torch path; "compile" `compile_blocks()` vs eager, its first (compiling) step apart as
              compile_s. Each also as a ratio to diffusers' native step time. With a budget (`--budget`),
              a lever still running when it is spent is interrupted and its row says so.

CPU shape ("full"): Wan 2.1 1.3B widths (dim 1536, 12 heads, ffn 8960, text 512 x 4096) but 2 blocks,
2304 video tokens (latents 16 x 9 x 32 x 32), fp32. GPU shape ("wan1.3b-81x480x832", the default
with --device cuda): the same widths at 81 frames of 480 x 832 = latents 16 x 21 x 60 x 104 =
32,760 tokens, bf16. MFU = analytic FLOPs (3x forward; 1x for a forward-only row) per second over
`video_dit.devices.device_peak`: a dense matmul measured in this process at the same dtype and
threads on CPU; the datasheet table on known GPUs (the measured matmul reported too).
diffusers is a test/bench-only dependency.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import time

import torch

from video_dit.bench import levers as lever_bench
from video_dit.bench.common import (
    dit_pair,
    median,
    mfu,
    profiled_live_after,
    profiled_peak,
    run_json_subprocess,
    time_side_by_side,
    write_json,
)
from video_dit.bench.vae import MALLOC_ENV, peak_rss_delta
from video_dit.devices import device_peak
from video_dit.families.wan.config import DiTConfig
from video_dit.families.wan.dit import cast_dit, dit_flops
from video_dit.models import attention
from video_dit.parallel.memory import cuda_peak

FULL = dict(dim=1536, heads=12, ffn_dim=8960, layers=2, latents=(16, 9, 32, 32), text_len=512, text_dim=4096)
SMALL = dict(dim=256, heads=4, ffn_dim=1024, layers=2, latents=(16, 4, 24, 24), text_len=64, text_dim=256)
GPU = dict(FULL, latents=(16, 21, 60, 104))  # 1.3B widths, 81 frames at 480 x 832: 21 x 30 x 52 = 32,760 tokens
SHAPES = {"full": FULL, "small": SMALL, "wan1.3b-81x480x832": GPU}
# ours -> the name diffusers 0.42's attention dispatcher (`AttentionBackendName`) gives the same kernel
DIFFUSERS_BACKEND = {"native": "native", "flash": "flash", "flash3": "_flash_3", "sage": "sage"}
FORWARD_ONLY = ("sage",)  # no backward: the row times the forward alone
LEVERS = ("kernels", "compile")


def _shape(small: bool, device: str, name: str | None = None, layers: int | None = None) -> dict:
    """The named shape, else small / the GPU shape on CUDA / the CPU shape; `layers` overrides blocks."""
    if name is not None and name not in SHAPES:
        raise ValueError(f"unknown DiT bench shape {name!r}; accepted: {', '.join(SHAPES)}")
    shape = SHAPES[name] if name else SMALL if small else GPU if device.startswith("cuda") else FULL
    return dict(shape, layers=layers) if layers else dict(shape)


def _dtype(device: str) -> torch.dtype:
    return torch.bfloat16 if device.startswith("cuda") else torch.float32


def build(shape: dict, device: str, seed: int = 0, dtype: torch.dtype = torch.float32):
    """(ours, reference, inputs) with identical weights, in `dtype`."""
    # the reference as from_pretrained(torch_dtype=...) leaves it (_keep_in_fp32_modules stay float32), ours
    # given its values and stored as load_dit(dtype=...) stores it: bf16 bulk, float32 islands
    ours, ref = dit_pair(shape, seed, ref_dtype=dtype)
    ref.to(device)
    cast_dit(ours.to(device), dtype)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(1, *shape["latents"], generator=g).to(device=device, dtype=dtype)
    t = torch.tensor([700.0], device=device)
    context = torch.randn(1, shape["text_len"], shape["text_dim"], generator=g).to(device=device, dtype=dtype)
    return ours, ref, (x, t, context)


def _out(model, inputs, is_ref: bool):
    return model(*inputs, return_dict=False)[0] if is_ref else model(*inputs)


def _step_fn(model, inputs, is_ref: bool, forward_only: bool = False):
    def step():
        if forward_only:
            with torch.no_grad():
                _out(model, inputs, is_ref)
            return
        _out(model, inputs, is_ref).float().square().mean().backward()
    return step


def _forward_fn(model, inputs, is_ref: bool):
    def forward():
        return _out(model, inputs, is_ref).float().square().mean()
    return forward


def set_backend(ours, ref, backend: str) -> str | None:
    """Both models on attention `backend` (ours' name); returns why diffusers cannot follow (None: it did)."""
    ours.set_attention_backend(backend)
    try:
        ref.set_attention_backend(DIFFUSERS_BACKEND[backend])  # also diffusers' process-wide active backend
    except (RuntimeError, ValueError, ImportError) as exc:
        ref.set_attention_backend("native")
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
    return None


def memory_of(model, inputs, is_ref: bool, device: str, forward_only: bool = False) -> dict:
    """Activation bytes of one model: kept after forward (`saved`) and the forward+backward `peak` above
    the start (gradient buffers allocated beforehand, so they do not count). Forward-only: the peak of a
    no-grad forward, nothing saved."""
    step = _step_fn(model, inputs, is_ref, forward_only)
    if device.startswith("cuda"):
        if forward_only:
            return {"saved": 0, "peak": cuda_peak(step, device)[1]}
        step()  # warm-up; leaves .grad buffers allocated, so backward adds into them
        model.zero_grad(set_to_none=False)
        loss, saved = cuda_peak(_forward_fn(model, inputs, is_ref), device)
        del loss
        _, peak = cuda_peak(step, device)
        return {"saved": saved, "peak": peak}
    if forward_only:
        return {"saved": 0, "peak": profiled_peak(step)}
    step()
    model.zero_grad(set_to_none=False)
    loss, saved = profiled_live_after(_forward_fn(model, inputs, is_ref))
    del loss
    return {"saved": saved, "peak": profiled_peak(step)}


def _measure_memory(which: str, small: bool, device: str, shape: dict | None = None) -> dict:
    """In this (fresh) process: saved activations and fwd+bwd peak of one model at native attention."""
    ours, ref, inputs = build(shape or _shape(small, device), device, dtype=_dtype(device))
    model, is_ref = (ref, True) if which == "diffusers" else (ours, False)
    del ours, ref
    out = memory_of(model, inputs, is_ref, device)
    if device == "cpu":  # the resident set over one more step, gradient buffers allocated (module docstring)
        out["rss_peak"] = peak_rss_delta(_step_fn(model, inputs, is_ref))[1]
    return out


def _flops(shape: dict) -> tuple[float, int]:
    """(analytic forward FLOPs, video tokens) of one batch-1 step at `shape`."""
    tokens = shape["latents"][1] * shape["latents"][2] * shape["latents"][3] // 4
    cfg = DiTConfig(dim=shape["dim"], ffn_dim=shape["ffn_dim"], num_heads=shape["heads"], num_layers=shape["layers"],
                    text_dim=shape["text_dim"], text_len=shape["text_len"])
    return dit_flops(cfg, tokens, shape["text_len"]), tokens


def attention_row(ours, ref, inputs, backend: str, repeats: int, device: str, memory: bool) -> dict:
    """One attention backend, both models side by side (module docstring); the models are left on it."""
    row: dict = {"attention": backend, "diffusers_backend": DIFFUSERS_BACKEND[backend],
                 "mode": "forward" if backend in FORWARD_ONLY else "forward+backward"}
    if not attention.available(backend):
        module, _, install = attention._OPTIONAL[backend]
        row["skipped"] = f"{module} does not import here ({install})"
        return row
    forward_only = backend in FORWARD_ONLY
    try:
        # both start on native (ours' default, diffusers' default active backend): set only another one,
        # which also keeps diffusers' "experimental feature" warning out of the default run
        why_not = set_backend(ours, ref, backend) if backend != "native" else None
        steps = {"ours": _step_fn(ours, inputs, False, forward_only)}
        if why_not is None:
            steps["diffusers"] = _step_fn(ref, inputs, True, forward_only)
        else:
            row["diffusers_error"] = why_not  # ours timed alone
        times = time_side_by_side(steps, repeats, device)
        row["step_s"] = {k: median(v) for k, v in times.items()}
        row["step_s_all"] = times
        if "diffusers" in times:
            row["time_ratio"] = row["step_s"]["ours"] / row["step_s"]["diffusers"]
        if memory:  # the headline row's memory comes from fresh processes instead
            row["memory_bytes"] = {"ours": memory_of(ours, inputs, False, device, forward_only)}
            if "diffusers" in times:
                row["memory_bytes"]["diffusers"] = memory_of(ref, inputs, True, device, forward_only)
    except Exception as exc:  # noqa: BLE001 - a backend that fails is reported, the other rows still run
        row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
    finally:
        if backend != "native":
            set_backend(ours, ref, "native")
    return row


def _ratios(row: dict, fwd_flops: float, peak_flops: float) -> None:
    """TFLOP/s, MFU and memory ratios of a timed attention row, in place."""
    if "step_s" not in row:
        return
    flops = fwd_flops * (1 if row["mode"] == "forward" else 3)
    row["flops"] = flops
    row["tflops"] = {k: flops / v / 1e12 for k, v in row["step_s"].items()}
    row["mfu"] = {k: mfu(flops, v, peak_flops) for k, v in row["step_s"].items()}
    mem = row.get("memory_bytes", {})
    if "ours" in mem and "diffusers" in mem:
        if mem["diffusers"]["saved"]:
            row["saved_ratio"] = mem["ours"]["saved"] / mem["diffusers"]["saved"]
        row["peak_ratio"] = mem["ours"]["peak"] / mem["diffusers"]["peak"]
        if "rss_peak" in mem["ours"] and "rss_peak" in mem["diffusers"]:
            row["rss_peak_ratio"] = mem["ours"]["rss_peak"] / mem["diffusers"]["rss_peak"]


def lever_row(ours, inputs, name: str, repeats: int, device: str, diffusers_s: float | None,
              fwd_flops: float, peak_flops: float) -> dict:
    """A lever of ours, off and on side by side at native attention (`levers.measure`)."""
    row = {"lever": name, **lever_bench.measure(name, ours, inputs, repeats, device)}
    if "step_s" in row:
        row["mfu_on"] = mfu(3 * fwd_flops, row["step_s"]["on"], peak_flops)
        if diffusers_s:
            row["on_vs_diffusers"] = row["step_s"]["on"] / diffusers_s
    return row


class BudgetExceeded(Exception):
    """The suite's time budget ran out inside a measurement."""


@contextlib.contextmanager
def time_limit(seconds: float | None):
    """Raise `BudgetExceeded` in this (main) thread once `seconds` have passed (None: no limit). SIGALRM:
    a torch.compile that outlasts the budget is interrupted between Python steps, not left to run on."""
    if seconds is None:
        yield
        return

    def expire(signum, frame):
        raise BudgetExceeded(f"did not finish within the {seconds:.0f} s left of the suite's budget")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.01))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def native_memory(device: str, small: bool, shape_name: str | None, layers: int | None) -> dict:
    """The headline row's memory, each model in a fresh process (no allocator history; `MALLOC_ENV`, for the
    resident set on the CPU)."""
    out = {}
    env = {**os.environ, **MALLOC_ENV}
    for name in ("ours", "diffusers"):
        args = ["-m", "video_dit.bench.dit", "--memory-of", name, "--device", device,
                "--threads", str(torch.get_num_threads())] + (["--small"] if small else [])
        args += (["--shape", shape_name] if shape_name else []) + (["--layers", str(layers)] if layers else [])
        out[name] = run_json_subprocess(args, env=env, what=f"DiT memory ({name})")
    return out


def run(device: str = "cpu", repeats: int = 3, small: bool = False, threads: int | None = None,
        shape: str | None = None, layers: int | None = None, backends=attention.BACKENDS, levers=LEVERS,
        memory: bool = True, budget_s: float | None = None) -> dict:
    """The headline (native) row's memory in fresh processes first (the device is still empty), then
    both models side by side per attention backend, then our levers; return the figures (`print_table`
    prints them). `shape`: a name in SHAPES (default: see `_shape`); `memory` False skips every memory
    figure; `budget_s`: the seconds the suite may take, the levers (compile) cut off when they run out."""
    start = time.monotonic()
    if threads:
        torch.set_num_threads(threads)
    unknown = sorted(set(backends) - set(attention.BACKENDS)) + sorted(set(levers) - set(LEVERS))
    if unknown:
        raise ValueError(f"unknown attention backend / lever {', '.join(unknown)}; accepted: "
                         f"{', '.join(attention.BACKENDS)} / {', '.join(LEVERS)}")
    backends = ["native", *[b for b in backends if b != "native"]]  # the headline row always, first
    shape_name, shape = shape, _shape(small, device, shape, layers)
    dtype = _dtype(device)
    cuda = device.startswith("cuda")
    native_mem = native_memory(device, small, shape_name, layers) if memory else None

    ours, ref, inputs = build(shape, device, dtype=dtype)
    # the other rows' memory in this process: the CUDA allocator's (cheap); on CPU only the headline row's
    rows = [attention_row(ours, ref, inputs, b, repeats, device, memory=memory and cuda and b != "native")
            for b in backends]
    native = rows[0]
    if "error" in native:
        raise RuntimeError(f"DiT bench, native attention: {native['error']}")
    if memory:
        native["memory_bytes"] = native_mem
    fwd_flops, tokens = _flops(shape)
    peak = device_peak(device, dtype)  # the MFU denominator: this process, same dtype and threads
    for row in rows:
        _ratios(row, fwd_flops, peak.flops)
    lever_rows = []
    for name in levers:
        left = None if budget_s is None else budget_s - (time.monotonic() - start)
        if left is not None and left <= 1:
            lever_rows.append({"lever": name, "skipped": f"no time left of the suite's {budget_s:.0f} s budget"})
            continue
        try:
            with time_limit(left):
                lever_rows.append(lever_row(ours, inputs, name, repeats, device, native["step_s"]["diffusers"],
                                            fwd_flops, peak.flops))
        except BudgetExceeded as exc:  # raised outside measure()'s own handler
            lever_rows.append({"lever": name, "error": f"BudgetExceeded: {exc}"})

    res = {
        "config": {**shape, "tokens": tokens, "device": device, "threads": torch.get_num_threads(),
                   "repeats": repeats, "dtype": str(dtype).removeprefix("torch."), "torch": torch.__version__,
                   "gpu": torch.cuda.get_device_name(0) if cuda else None, "budget_s": budget_s,
                   "attention": "native: SDPA with torch's own kernel choice, both models (the headline row)",
                   "flops_convention": "analytic matmul + attention FLOPs (dit_flops); forward+backward = 3x forward"},
        "rows": rows,
        "levers": lever_rows,
        "step_s": native["step_s"],
        "step_s_all": native["step_s_all"],
        "time_ratio": native["time_ratio"],
        "tflops": native["tflops"],
        "peak": peak.as_dict(),
        "mfu": native["mfu"]["ours"],
        "mfu_diffusers": native["mfu"]["diffusers"],
    }
    if memory:
        res["memory_bytes"] = native["memory_bytes"]
        res["saved_ratio"] = native["saved_ratio"]
        res["peak_ratio"] = native["peak_ratio"]
        if "rss_peak_ratio" in native:
            res["rss_peak_ratio"] = native["rss_peak_ratio"]
    return res


def print_table(res: dict) -> None:
    c, mib, p = res["config"], 2 ** 20, res["peak"]
    print(f"DiT fwd+bwd, dim {c['dim']}, {c['heads']} heads, {c['layers']} blocks, {c['tokens']} tokens, {c['dtype']}, "
          f"{c['device']}, {c['threads']} threads, median of {c['repeats']}; peak {p['flops'] / 1e12:.3f} TFLOP/s "
          f"({p['source']}; matmul measured {p['measured'] / 1e12:.3f})")
    print(f"{'attention':10}{'ours s':>9}{'diff s':>9}{'ours/diff':>11}{'MFU ours':>10}{'MFU diff':>10}"
          f"{'saved MiB o/d':>18}{'peak MiB o/d':>18}")
    for r in res["rows"]:
        if "skipped" in r or "error" in r:
            print(f"{r['attention']:10}{'skipped: ' + r['skipped'] if 'skipped' in r else 'failed: ' + r['error']}")
            continue
        s, m = r["step_s"], r.get("memory_bytes", {})
        mem = ["/".join(f"{m[k][f] / mib:.0f}" for k in ("ours", "diffusers") if k in m) or "-"
               for f in ("saved", "peak")]
        diff = f"{s['diffusers']:9.3f}" if "diffusers" in s else f"{'-':>9}"
        ratio = f"{r['time_ratio']:11.3f}" if "time_ratio" in r else f"{'-':>11}"
        mfu_d = f"{r['mfu']['diffusers']:10.1%}" if "diffusers" in r["mfu"] else f"{'-':>10}"
        note = (" (forward only)" if r["mode"] == "forward" else "") + (
            f" diffusers: {r['diffusers_error']}" if "diffusers_error" in r else "")
        print(f"{r['attention']:10}{s['ours']:9.3f}{diff}{ratio}{r['mfu']['ours']:10.1%}{mfu_d}"
              f"{mem[0]:>18}{mem[1]:>18}{note}")
    native = res["rows"][0]
    if "rss_peak_ratio" in native:
        m = native["memory_bytes"]
        print(f"{'':10}resident-set peak of the native row, ours / diffusers: {m['ours']['rss_peak'] / mib:.0f} / "
              f"{m['diffusers']['rss_peak'] / mib:.0f} MiB = {native['rss_peak_ratio']:.3f}")
    if res["levers"]:
        print(f"{'lever':10}{'off s':>9}{'on s':>9}{'on/off':>11}{'MFU on':>10}{'on/diff':>10}{'act peak on/off':>18}")
    for r in res["levers"]:
        if "error" in r or "skipped" in r:
            print(f"{r['lever']:10}{'failed: ' + r['error'] if 'error' in r else 'skipped: ' + r['skipped']}")
            continue
        note = f"   compile {r['compile_s']:.1f} s" if "compile_s" in r else ""
        vs = f"{r['on_vs_diffusers']:10.3f}" if "on_vs_diffusers" in r else f"{'-':>10}"
        print(f"{r['lever']:10}{r['step_s']['off']:9.3f}{r['step_s']['on']:9.3f}{r['time_ratio']:11.3f}"
              f"{r['mfu_on']:10.1%}{vs}{r['peak_ratio']:18.3f}{note}")
    targets = ("time <= 0.8, MFU >= 50%, peak <= today's 0.643" if c["device"].startswith("cuda")
               else "time <= 1.0, MFU >= 75%, peak <= 0.8")
    print(f"targets (native row): {targets}")


def _names(text: str, accepted) -> tuple[str, ...]:
    names = tuple(x for x in text.split(",") if x)
    bad = sorted(set(names) - set(accepted))
    if bad:
        raise argparse.ArgumentTypeError(f"{','.join(bad)}: accepted: {', '.join(accepted)}")
    return names


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--small", action="store_true", help="a small shape for a quick smoke run")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--shape", choices=sorted(SHAPES), default=None,
                   help="default: small with --small, wan1.3b-81x480x832 on cuda, else full")
    p.add_argument("--layers", type=int, default=None, help="DiT blocks (default: the shape's 2)")
    p.add_argument("--attention", type=lambda s: _names(s, attention.BACKENDS), default=attention.BACKENDS,
                   help=f"comma-separated backends (default: {','.join(attention.BACKENDS)}; native always runs)")
    p.add_argument("--levers", type=lambda s: _names(s, LEVERS), default=LEVERS,
                   help=f"comma-separated levers of ours (default: {','.join(LEVERS)}; '' for none)")
    p.add_argument("--budget", type=float, default=None, metavar="S",
                   help="seconds the suite may take; the levers (compile) are cut off when they run out")
    p.add_argument("--memory-of", choices=("ours", "diffusers"), help=argparse.SUPPRESS)  # subprocess mode
    p.add_argument("--json", default=None, help="also write the figures to this file")
    args = p.parse_args(argv)
    if args.memory_of:
        if args.threads:
            torch.set_num_threads(args.threads)
        shape = _shape(args.small, args.device, args.shape, args.layers)
        print(json.dumps(_measure_memory(args.memory_of, args.small, args.device, shape)))
        return 0
    res = run(args.device, args.repeats, args.small, args.threads, args.shape, args.layers, args.attention, args.levers,
              budget_s=args.budget)
    print_table(res)
    write_json(res, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
