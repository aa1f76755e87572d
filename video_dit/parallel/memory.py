"""Activation peak of a piece of work on this rank: the highest memory allocated during it above
what was alive when it started (parameters, gradient buffers and optimizer state already there do
not count; gradient buffers first allocated inside do).

CUDA: the caching allocator's peak counter. CPU: torch keeps no allocator statistics, so
`CPUAllocationTracker` follows every tensor storage that an op creates until it is freed
(scratch space inside one kernel is not seen; everything autograd saves, and every op's output, is).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import time
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def _plain_cpu(t) -> bool:
    # tensor subclasses (quantized weights) may have no storage of their own: their parts are plain tensors
    return type(t) in (torch.Tensor, torch.nn.Parameter) and t.device.type == "cpu"


class CPUAllocationTracker(TorchDispatchMode):
    """Live and peak bytes of the CPU storages created by ops while the mode is on (forward and the
    backward it triggers on this thread). A storage is counted from the op that creates it until it
    is freed (a weak reference to it dies), also after the mode is left. Outputs that alias an input
    (views, in-place and `out=` ops, gradient accumulation into an existing .grad) are not new."""

    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self._refs: dict[int, weakref.ref] = {}

    def settled_live(self, quiet_s: float = 0.05, limit_s: float = 5.0) -> int:
        """`live` once no storage has been freed for `quiet_s`: a gloo collective's worker thread drops its
        reference to the collective's tensors just after `wait()` has returned (a race of microseconds,
        which made an SP rank's saved bytes 1.5-8.5 KiB more now and then); waits at most `limit_s`."""
        end = time.monotonic() + limit_s
        while True:
            before = self.live
            time.sleep(quiet_s)
            if self.live == before or time.monotonic() > end:
                return self.live

    def _freed(self, key: int, nbytes: int) -> None:
        if self._refs.pop(key, None) is not None:
            self.live -= nbytes

    def count(self, tensors, seen=()) -> None:
        """Count the new CPU storages of `tensors` (those not in `seen`, data pointers) until they are freed: what
        ops create, and what is made outside torch's dispatch (safetensors' `get_tensor`) when a caller hands it in."""
        seen = set(seen)
        for t in tensors:
            if not _plain_cpu(t):
                continue
            st = t.untyped_storage()
            key, nbytes = st.data_ptr(), st.nbytes()
            if nbytes == 0 or key in seen or key in self._refs:
                continue
            seen.add(key)
            self._refs[key] = weakref.ref(st, lambda _, key=key, nbytes=nbytes: self._freed(key, nbytes))
            self.live += nbytes
            self.peak = max(self.peak, self.live)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.count(tree_flatten(out)[0],
                   {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if _plain_cpu(t)})
        return out


def cuda_peak(fn, device="cuda") -> tuple[object, int]:
    """(fn(), CUDA allocator peak bytes during `fn()` above the bytes allocated at its start)."""
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    out = fn()
    torch.cuda.synchronize(device)
    return out, torch.cuda.max_memory_allocated(device) - base


def activation_peak(fn, device: torch.device | str | None = None):
    """(fn()'s result, peak extra bytes allocated while it ran on `device` (CPU by default))."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type == "cuda":
        return cuda_peak(fn, device)
    if device.type != "cpu":
        raise ValueError(f"activation_peak measures cuda or cpu devices, got {device}")
    with CPUAllocationTracker() as tracker:
        out = fn()
    return out, tracker.peak


class ActivationPeak:
    """The activation peak of spans of a training loop, for metrics.

        meter.start(); loss = forward(); meter.stop()      # per micro-batch
        meter.read_gb()     # the highest span peak since the last read, in GiB

    The trainer measures the forward: its peak is the activations autograd keeps for backward plus
    the forward's transients. (A span through backward would also count DeepSpeed's gradient
    buckets, `reduce_bucket_size` elements allocated in each ZeRO-1/2 backward, 190 MiB by default,
    which hide the activations of small models.)

    A span that is started again without being stopped (a skipped non-finite batch) is dropped.
    CUDA: the allocator's peak counter, reset at each start; the peak before the reset is kept in
    `run_peak_bytes`, so the run's overall peak (see `run_peak_gb`) is not lost. CPU: a
    `CPUAllocationTracker` over the span, which costs Python work per op (a tiny model's step runs
    several times slower), so only every `cpu_every`-th span is measured (the first included) and
    `read_gb` repeats the last figure in between: the peak depends on the batch shape, not the step.
    """

    run_peak_bytes = 0  # CUDA: the allocator peak of the whole run, across this meter's resets

    def __init__(self, device, cpu_every: int = 50):
        self.device = torch.device(device)
        self.cpu_every = cpu_every
        self._spans = 0
        self._base = None
        self._tracker = None
        self._best = None
        self._last = 0

    def start(self) -> None:
        self._abandon()
        if self.device.type == "cuda":
            ActivationPeak.run_peak_bytes = max(ActivationPeak.run_peak_bytes,
                                                torch.cuda.max_memory_allocated(self.device))
            self._base = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self._spans += 1
            if (self._spans - 1) % self.cpu_every:
                return  # not measured; stop() is a no-op
            self._tracker = CPUAllocationTracker()
            self._tracker.__enter__()
            self._base = 0

    def stop(self) -> int | None:
        """End the span; returns its peak in bytes (None when this span was not measured)."""
        if self._base is None:
            return None
        if self.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(self.device) - self._base
        else:
            self._tracker.__exit__(None, None, None)
            peak, self._tracker = self._tracker.peak, None
        self._base = None
        self._best = peak if self._best is None else max(self._best, peak)
        return peak

    def read_gb(self) -> float:
        """The highest peak of the spans measured since the last read (else the last figure), GiB."""
        if self._best is not None:
            self._last, self._best = self._best, None
        return self._last / 2 ** 30

    def _abandon(self) -> None:
        if self._tracker is not None:
            self._tracker.__exit__(None, None, None)
            self._tracker = None
        self._base = None


def run_peak_gb(device) -> float:
    """This rank's allocator peak over the whole run on CUDA, also across ActivationPeak's resets."""
    device = torch.device(device)
    return max(ActivationPeak.run_peak_bytes, torch.cuda.max_memory_allocated(device)) / 2 ** 30


def release_freed_memory() -> None:
    """Hand the heap pages freed since the last call back to the OS (glibc's `malloc_trim`; a no-op
    elsewhere). Why: each group's full tensors are freed, but the partitions allocated between them
    live on, and glibc keeps the freed pages in its heap, so the process's RSS would grow by about
    half a group per group (measured: +0.7 GiB over the 1.3B's 30 blocks) though no tensor is live.
    The same holds for ZeRO-3's per-block gathers on CPU ranks (`release_heap_per_block`)."""
    global _malloc_trim
    if _malloc_trim is None:
        try:
            _malloc_trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
        except (OSError, AttributeError):  # not glibc (macOS, musl): nothing to trim this way
            _malloc_trim = False
    if _malloc_trim:
        _malloc_trim(0)


_malloc_trim = None


def release_heap_per_block(dit) -> None:
    """Hand freed heap pages back to the OS before each DiT block runs (forward, and the recomputation
    in backward when blocks are checkpointed): for ZeRO-3 on CPU ranks, whose parameters are gathered
    into host memory block by block and freed after use. glibc keeps those freed pages, so without
    this a rank's RSS grows by about its partition of every block in a step though no gathered
    tensor is alive (measured, `wan2.1-t2v-1.3b` LoRA, 2 CPU ranks, ZeRO-3, SP 2, checkpointing:
    3.2 GiB after set-up -> 6.8 GiB peak by the end of the first step, 4.0 GiB with this; the
    planner says 4.22). A no-op where `release_freed_memory` is (not glibc)."""
    for block in dit.blocks:
        block.register_forward_pre_hook(lambda module, args: release_freed_memory())
