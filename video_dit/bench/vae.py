"""VAE benchmark: encode + decode time and peak memory, ours vs diffusers' `AutoencoderKLWan`
with identical weights, at a Wan 2.1-shaped config (base dim 96, 17 frames, 256 x 256), CPU fp32.

    python -m video_dit.bench.vae                 # the full size (minutes on 2 CPU cores)
    python -m video_dit.bench.vae --small         # a quick smaller shape
    python -m video_dit.bench.vae --repeats 5 --threads 2

Time: both models in this process, alternated per repeat, median of `repeats`.
Peak memory: each model in a fresh subprocess (so neither sees the other's allocator state):
the kernel's resident-set high-water mark (VmHWM) is reset just before encode + decode and read
after, minus the resident set just before; see `peak_rss_delta`.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import threading
import time

import torch

from video_dit.families.wan.convert import vae_config_to_diffusers, vae_from_diffusers
from video_dit.families.wan.presets import VAE_PRESETS
from video_dit.families.wan.vae import CausalVideoVAE, VAEConfig

FULL = dict(dim=96, frames=17, size=256)
SMALL = dict(dim=32, frames=9, size=64)
# Large blocks straight from mmap and back to the OS on free, so the resident set follows the live
# tensors instead of glibc's retained heap (applied to both models alike).
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _hwm_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise OSError("/proc/self/status has no VmHWM line")


def peak_rss_delta(fn, interval_s: float = 0.002):
    """(fn(), peak resident bytes above the resident set just before the call).

    Linux only. The exact peak comes from the kernel's high-water mark, reset by writing `5` to
    /proc/self/clear_refs; a sampler thread reading /proc/self/statm every `interval_s` backs it
    up (and is the only source where clear_refs is not writable). CPU tensors live in ordinary
    process memory, so this sees every allocation torch makes; run it in a fresh process with
    `MALLOC_ENV` set for numbers that do not depend on what ran before.
    """
    gc.collect()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        hwm = True
    except OSError:
        hwm = False
    base = _rss_bytes()
    peak = [base]
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], _rss_bytes())
            time.sleep(interval_s)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        result = fn()
    finally:
        stop.set()
        sampler.join()
    top = max(peak[0], _rss_bytes(), _hwm_bytes() if hwm else 0)
    return result, top - base


def build_pair(dim: int, seed: int = 0):
    """(ours, diffusers') with identical random weights at a Wan 2.1-shaped config of base `dim`."""
    from diffusers import AutoencoderKLWan

    cfg = VAEConfig(**{**VAE_PRESETS["wan2.1"].__dict__, "dim": dim})
    torch.manual_seed(seed)
    ref = AutoencoderKLWan(**vae_config_to_diffusers(cfg)).eval()
    with torch.no_grad():  # random gammas / attention output too, so nothing is an identity
        for p in ref.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    ours = CausalVideoVAE(cfg).eval()
    ours.load_state_dict(vae_from_diffusers(ref.state_dict()))
    return ours, ref


def _clip(frames: int, size: int, device: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return (torch.rand(1, 3, frames, size, size, generator=g) * 2 - 1).to(device)


def _roundtrip(which: str, model, video):
    with torch.no_grad():
        if which == "ours":
            return model.decode(model.encode(video).mode())
        return model.decode(model.encode(video).latent_dist.mode()).sample


def _peak_in_subprocess(which: str, shape: dict, device: str, threads: int) -> int:
    cmd = [sys.executable, "-m", "video_dit.bench.vae", "--_peak", which, "--device", device,
           "--threads", str(threads), "--dim", str(shape["dim"]), "--frames", str(shape["frames"]),
           "--size", str(shape["size"])]
    env = {**os.environ, **MALLOC_ENV}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if out.returncode:
        raise RuntimeError(f"peak-memory subprocess for {which} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])["peak_bytes"]


def run(device: str = "cpu", repeats: int = 3, small: bool = False, threads: int | None = None,
        memory: bool = True) -> dict:
    """Time (median seconds of encode + decode) and peak memory of ours and diffusers' VAE."""
    shape = SMALL if small else FULL
    if threads:
        torch.set_num_threads(threads)
    ours, ref = build_pair(shape["dim"])
    ours, ref = ours.to(device), ref.to(device)
    video = _clip(shape["frames"], shape["size"], device)
    times = {"ours": [], "diffusers": []}
    cpu = {"ours": [], "diffusers": []}  # process CPU seconds: steadier than wall time on a shared host
    outputs = {}
    for _ in range(repeats):
        for which, model in (("ours", ours), ("diffusers", ref)):
            if device != "cpu":
                torch.cuda.synchronize()
            t0, c0 = time.perf_counter(), time.process_time()
            out = _roundtrip(which, model, video)
            if device != "cpu":
                torch.cuda.synchronize()
            times[which].append(time.perf_counter() - t0)
            cpu[which].append(time.process_time() - c0)
            outputs.setdefault(which, out)
    diff = (outputs["ours"] - outputs["diffusers"]).abs().max().item()
    result = {"shape": {**shape, "device": device, "threads": torch.get_num_threads()}, "max_abs_diff": diff,
              "time_s": {k: statistics.median(v) for k, v in times.items()},
              "cpu_s": {k: statistics.median(v) for k, v in cpu.items()}, "times_all": times}
    result["cpu_ratio"] = result["cpu_s"]["ours"] / result["cpu_s"]["diffusers"]
    result["time_ratio"] = result["time_s"]["ours"] / result["time_s"]["diffusers"]
    if memory and device == "cpu":
        peaks = {w: _peak_in_subprocess(w, shape, device, torch.get_num_threads()) for w in ("ours", "diffusers")}
        result["peak_bytes"] = peaks
        result["memory_ratio"] = peaks["ours"] / peaks["diffusers"]
    return result


def print_table(r: dict) -> None:
    s = r["shape"]
    print(f"VAE encode+decode, dim {s['dim']}, {s['frames']} x {s['size']} x {s['size']}, {s['device']}, "
          f"{s['threads']} threads; max |ours - diffusers| = {r['max_abs_diff']:.2e}")
    print(f"{'':12}{'wall (s)':>12}{'CPU (s)':>12}{'peak (MiB)':>14}")
    for k in ("ours", "diffusers"):
        peak = f"{r['peak_bytes'][k] / 2**20:14.0f}" if "peak_bytes" in r else f"{'-':>14}"
        print(f"{k:12}{r['time_s'][k]:12.2f}{r['cpu_s'][k]:12.2f}{peak}")
    mem = f"{r['memory_ratio']:14.2f}" if "memory_ratio" in r else f"{'-':>14}"
    print(f"{'ratio':12}{r['time_ratio']:12.2f}{r['cpu_ratio']:12.2f}{mem}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--no-memory", action="store_true")
    ap.add_argument("--json", action="store_true", help="print the result dict as JSON too")
    ap.add_argument("--_peak", choices=("ours", "diffusers"), help=argparse.SUPPRESS)
    ap.add_argument("--dim", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--frames", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--size", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args._peak:  # child process of `_peak_in_subprocess`
        if args.threads:
            torch.set_num_threads(args.threads)
        pair = dict(zip(("ours", "diffusers"), build_pair(args.dim)))
        model = pair.pop(args._peak).to(args.device)
        pair.clear()  # only the measured model stays resident
        video = _clip(args.frames, args.size, args.device)
        _, peak = peak_rss_delta(lambda: _roundtrip(args._peak, model, video))
        print(json.dumps({"peak_bytes": peak}))
        return 0
    r = run(args.device, args.repeats, args.small, args.threads, memory=not args.no_memory)
    print_table(r)
    if args.json:
        print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
