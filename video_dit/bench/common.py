"""Shared benchmark helpers: timing (side by side, median), the device's peak FLOP/s, MFU, and
memory measurement on CPU and CUDA.

    time_side_by_side({"ours": f, "ref": g}, repeats, device)   -> {"ours": [s, ...], "ref": [...]}
    device_peak(device, dtype)                                   -> Peak (video_dit.devices, re-used here)
    mfu(flops_per_step, step_s, peak_flops)                      -> fraction of the peak
    profiled_peak(fn) / profiled_live_after(fn)                  -> CPU bytes (profiler allocation timeline)
    cuda_peak(fn)                                                -> CUDA bytes above the start (parallel/memory.py)
    tensor_memory_split(groups)                                  -> bytes per category, each storage once
    diffusers_as_loaded(model, dtype)                            -> a diffusers model as from_pretrained casts it
    dit_pair(shape, seed)                                        -> (ours, diffusers' Wan transformer), same weights

Every figure is a measurement in this process; nothing here knows a target number.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Iterable

import torch
from torch.profiler import ProfilerActivity, profile

from video_dit.devices import free_port, timed
from video_dit.families.wan.config import DiTConfig
from video_dit.families.wan.convert import dit_from_diffusers
from video_dit.families.wan.dit import VideoDiT


def time_side_by_side(fns: dict[str, Callable[[], object]], repeats: int, device="cpu",
                      warmup: int = 1) -> dict[str, list[float]]:
    """Each callable `warmup` times (not timed), then `repeats` timed rounds in which the callables
    alternate (the order reversed every other round), so machine noise hits all of them alike."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    for r in range(repeats):
        for name in (names if r % 2 == 0 else names[::-1]):
            times[name].append(timed(fns[name], device))
    return times


def median(values: Iterable[float]) -> float:
    values = list(values)
    if not values:
        raise ValueError("median of no values")
    return float(statistics.median(values))


def mfu(flops_per_step: float, step_s: float, peak_flops: float) -> float:
    """Model FLOPs utilization: analytic model FLOPs per second over the peak FLOP/s."""
    if step_s <= 0 or peak_flops <= 0:
        raise ValueError(f"step_s and peak_flops must be > 0, got {step_s}, {peak_flops}")
    return flops_per_step / step_s / peak_flops


# ---------------------------------------------------------------- memory


def profiled_peak(fn: Callable[[], object]) -> int:
    """Peak bytes allocated on the CPU by `fn()` above what was alive when it started.

    torch keeps no CPU allocator statistics; the profiler's per-op memory records give the
    allocation timeline (scratch space inside a single kernel is not seen)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.time_range.start, e.self_cpu_memory_usage) for e in prof.events() if e.self_cpu_memory_usage)
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak


def profiled_live_after(fn: Callable[[], object]) -> tuple[object, int]:
    """(fn(), bytes allocated by `fn()` and still alive when it returns), CPU profiler timeline.
    For a forward pass this is the activation memory autograd keeps for backward (plus the output)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    return out, int(sum(e.self_cpu_memory_usage for e in prof.events()))


def _storage_key(t: torch.Tensor) -> tuple[str, int] | None:
    if t.device.type == "meta":
        return None
    storage = t.untyped_storage()
    if storage.nbytes() == 0:
        return None
    return str(t.device), storage.data_ptr()


def tensor_memory_split(groups: dict[str, Iterable[torch.Tensor]]) -> dict[str, int]:
    """Bytes per category; each underlying storage is counted once, in the FIRST category (in the
    dict's order) that holds a tensor on it, and with its whole size (a view of a flat buffer
    counts the buffer). So the categories never double-count and their sum is the bytes of all
    the distinct storages given."""
    seen: set[tuple[str, int]] = set()
    out: dict[str, int] = {}
    for name, tensors in groups.items():
        total = 0
        for t in tensors:
            key = _storage_key(t)
            if key is None or key in seen:
                continue
            seen.add(key)
            total += t.untyped_storage().nbytes()
        out[name] = total
    return out


# ---------------------------------------------------------------- the reference as users load it


def diffusers_as_loaded(model, dtype: torch.dtype):
    """A diffusers model as `from_pretrained(torch_dtype=dtype)` leaves it: every floating parameter
    in `dtype` except those whose dotted name holds one of `_keep_in_fp32_modules` (float32): the rule
    of diffusers' `load_model_dict_into_meta` (models/model_loading_utils.py)."""
    keep = getattr(model, "_keep_in_fp32_modules", None) or []
    for name, p in model.named_parameters():
        if p.is_floating_point():
            kept = any(k in name.split(".") for k in keep)
            p.data = p.data.to(torch.float32 if kept else dtype)
    return model


# ---------------------------------------------------------------- ours and the reference, same weights


def dit_pair(shape: dict, seed: int = 0, ref_dtype: torch.dtype = torch.float32):
    """(ours float32, diffusers' `WanTransformer3DModel`) on the CPU with the same weights (diffusers'
    random init after `torch.manual_seed(seed)`; ours holds its own copy), from a bench shape dict
    (dim, heads, ffn_dim, layers, latents (C, F', h, w), text_len, text_dim). `ref_dtype`: the reference
    as `from_pretrained(torch_dtype=)` leaves it (`diffusers_as_loaded`), ours given those same values."""
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    ref = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=shape["heads"],
                                attention_head_dim=shape["dim"] // shape["heads"], in_channels=shape["latents"][0],
                                out_channels=16, text_dim=shape["text_dim"], freq_dim=256, ffn_dim=shape["ffn_dim"],
                                num_layers=shape["layers"], cross_attn_norm=True, qk_norm="rms_norm_across_heads",
                                eps=1e-6)
    if ref_dtype != torch.float32:
        diffusers_as_loaded(ref, ref_dtype)
    cfg = DiTConfig(in_dim=shape["latents"][0], out_dim=16, dim=shape["dim"], ffn_dim=shape["ffn_dim"], freq_dim=256,
                    text_dim=shape["text_dim"], num_heads=shape["heads"], num_layers=shape["layers"],
                    text_len=shape["text_len"])
    with torch.device("meta"):
        ours = VideoDiT(cfg)
    ours.load_state_dict({k: v.to(torch.float32, copy=True) for k, v in dit_from_diffusers(ref.state_dict()).items()},
                         assign=True)
    return ours, ref


# ---------------------------------------------------------------- subprocesses


def run_json_subprocess(args: list[str], env: dict | None = None, what: str = "benchmark") -> dict:
    """Run `python args...`; its last stdout line is a JSON object, returned. A failure raises with
    the tail of its stderr."""
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{what} subprocess `{' '.join(args)}` failed (exit {proc.returncode}):\n"
                           f"{proc.stderr[-3000:]}")
    lines = proc.stdout.strip().splitlines()
    if not lines:
        raise RuntimeError(f"{what} subprocess `{' '.join(args)}` printed nothing; stderr:\n{proc.stderr[-2000:]}")
    return json.loads(lines[-1])


def launch_ranks(module: str, spec: dict, world: int, workdir: Path, threads: int = 1,
                 hide_cuda: bool = True) -> list[dict]:
    """Run `python -m module --_rank SPEC` as `world` ranks on this machine (`threads` each; CUDA hidden
    unless `hide_cuda` is False, for a rank that runs on its LOCAL_RANK's GPU) and return each rank's
    JSON, which the rank writes to `<spec["out"]>.rank<r>.json`. A failed rank raises with the tail of
    its log."""
    workdir = Path(workdir)
    spec_path = workdir / f"spec_{int(time.time() * 1e6)}.json"
    spec_path.write_text(json.dumps(spec))
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(world),
           "OMP_NUM_THREADS": str(threads), **({"CUDA_VISIBLE_DEVICES": ""} if hide_cuda else {})}
    procs = []
    for r in range(world):
        log = open(workdir / f"{spec_path.stem}_rank{r}.log", "w")
        procs.append((subprocess.Popen([sys.executable, "-m", module, "--_rank", str(spec_path)],
                                       env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                                       stdout=log, stderr=subprocess.STDOUT), log))
    failed = []
    for r, (proc, log) in enumerate(procs):
        if proc.wait() != 0:
            failed.append(r)
        log.close()
    if failed:
        tail = (workdir / f"{spec_path.stem}_rank{failed[0]}.log").read_text()[-3000:]
        raise RuntimeError(f"{module} rank(s) {failed} failed; rank {failed[0]} log tail:\n{tail}")
    return [json.loads(Path(f"{spec['out']}.rank{r}.json").read_text()) for r in range(world)]


def fmt_bytes(n: float) -> str:
    return f"{n / 2 ** 20:.1f} MiB"


def write_json(result: dict, path: str | None) -> None:
    """Write a suite's figures to `path` (no-op when None): the benches' `--json FILE`."""
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=2)
