"""Activation peak of a piece of work on this rank: the highest memory allocated during it above
what was alive when it started (parameters, gradient buffers and optimizer state already there do
not count; gradient buffers first allocated inside do).

CUDA: the caching allocator's peak counter. CPU: torch keeps no allocator statistics, so the
profiler's per-op allocation records are replayed in time order (scratch space inside one kernel is
not seen; everything autograd saves, and every op's output, is).
"""

from __future__ import annotations

import torch


def activation_peak(fn, device: torch.device | str | None = None):
    """(fn()'s result, peak extra bytes allocated while it ran on `device` (CPU by default))."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        out = fn()
        torch.cuda.synchronize(device)
        return out, torch.cuda.max_memory_allocated(device) - base
    if device.type != "cpu":
        raise ValueError(f"activation_peak measures cuda or cpu devices, got {device}")
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    events = sorted((e.time_range.start, e.self_cpu_memory_usage) for e in prof.events() if e.self_cpu_memory_usage)
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return out, peak
