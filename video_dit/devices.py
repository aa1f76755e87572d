"""Device decisions, in one place below everything that trains, samples or measures:

    local_device()               which device this rank computes on (its LOCAL_RANK's GPU, else the CPU)
    resolve_device(name)         a `--device` value checked against what torch sees (`DeviceError`)
    placement(launcher_args)     how many ranks a launch starts, on which GPUs or CPU cores, and the
                                 DeepSpeed runner arguments that start them there (`Placement`)
    machine_of(placement)        the same ranks with their memory, for the memory plan (`Machine`)
    device_peak(device, dtype)   the peak FLOP/s MFU is measured against (datasheet or measured matmul)
    pin_memory(), to_device(t)   pinned host memory and non-blocking copies for data going to a GPU
    fused_optimizer()            torch's fused AdamW (CUDA only; no JIT-compiled DeepSpeed extension)
    overlap_comm(cuda)           DeepSpeed's communication/computation overlap (GPU ranks only)

The launcher and the memory plan read the same `placement`, so the plan counts the ranks the
launcher starts. Nothing here imports from the rest of the package.
"""

from __future__ import annotations

import functools
import math
import os
import random
import socket
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable

import torch


class DeviceError(ValueError):
    """A device or rank placement that this machine cannot give; the message says what was found."""


# ---------------------------------------------------------------- this process


def on_gpu() -> bool:
    return torch.cuda.is_available()


def local_device() -> torch.device:
    """This rank's device: the GPU of its LOCAL_RANK (among the visible ones), else the CPU."""
    if on_gpu():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def resolve_device(name: str | None) -> torch.device:
    """A command's `--device` (None: cuda when torch sees a GPU, else cpu); asking for CUDA where
    torch sees none, or for a GPU index beyond those visible, is a `DeviceError` saying what was found."""
    if name is None:
        return torch.device("cuda" if on_gpu() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise DeviceError(f"--device {name!r}: not a torch device ({exc}); accepted: cpu, cuda, cuda:N") from exc
    if device.type == "cuda":
        found = torch.cuda.device_count() if on_gpu() else 0
        if found == 0:
            raise DeviceError(f"--device {name}: torch sees no CUDA GPU here ({_cuda_found()}); accepted: cpu")
        if device.index is not None and device.index >= found:
            raise DeviceError(f"--device {name}: torch sees {found} GPU(s) (cuda:0 .. cuda:{found - 1})")
    elif device.type != "cpu":
        raise DeviceError(f"--device {name}: accepted: cpu, cuda, cuda:N")
    return device


def _cuda_found() -> str:
    """What torch says about CUDA here, for error messages."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    build = f"torch {torch.__version__}, built {'with CUDA ' + torch.version.cuda if torch.version.cuda else 'without CUDA'}"
    return build + (f", CUDA_VISIBLE_DEVICES={visible!r}" if visible is not None else "")


EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
PORTS_BELOW_EPHEMERAL = 20000  # the lowest port `free_port` draws


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, for a process group's MASTER_PORT, drawn below the kernel's
    ephemeral range: between this check and the store's bind, a port of that range can be taken by any
    outgoing connection (gloo's pairs among them: a 2-rank launch failed with EADDRINUSE), one below it
    only by another explicit bind. Where that range is unknown or starts too low, a port the kernel picks."""
    try:
        low = int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 0
    rng = random.SystemRandom()
    for _ in range(64 if low - PORTS_BELOW_EPHEMERAL >= 1000 else 0):
        port = rng.randrange(PORTS_BELOW_EPHEMERAL, low)
        if _bindable(port):
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pin_memory() -> bool:
    """Whether host batches are pinned (page-locked) for asynchronous copies: on GPU ranks."""
    return on_gpu()


def to_device(t: torch.Tensor, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`t` on `device` (and `dtype`), the copy non-blocking when it goes to a GPU (from pinned memory
    it overlaps with compute; the stream orders it before the kernels that read it)."""
    return t.to(device, dtype, non_blocking=device.type == "cuda")


def fused_optimizer() -> bool:
    """torch's fused AdamW (one kernel per step over all parameters): CUDA only."""
    return on_gpu()


def overlap_comm(cuda: bool) -> bool:
    """DeepSpeed's `overlap_comm` (gradient reduction overlapping backward): on GPU ranks; on CPU
    ranks gloo shares the cores the backward needs, so it only adds buffers."""
    return cuda


def sync(device) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn: Callable[[], object], device="cpu") -> float:
    """Wall seconds of one `fn()` call, the device synchronized on both sides."""
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


# ---------------------------------------------------------------- peak FLOP/s

# Dense bf16 tensor-core peak per GPU (no sparsity), FLOP/s. fp32 runs as TF32 at half of it.
GPU_PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "H800": 989e12, "A100": 312e12, "A800": 312e12,
                 "L40S": 362e12, "L40": 181e12, "A10G": 70e12, "RTX 4090": 165e12, "RTX 3090": 71e12}


def matmul_flops(dtype: torch.dtype = torch.float32, device="cpu", n: int | None = None, repeats: int = 5) -> float:
    """Dense `n x n @ n x n` FLOP/s measured now (median of `repeats` after a warm-up), at the
    current thread count: the CPU "peak" that MFU is measured against. n defaults to 2048 on CPU
    and 8192 on CUDA (big enough to sit on the flat part of the roofline)."""
    if n is None:
        n = 8192 if str(device).startswith("cuda") else 2048
    g = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=g).to(device=device, dtype=dtype)
    b = torch.randn(n, n, generator=g).to(device=device, dtype=dtype)
    a @ b  # warm-up
    return 2.0 * n ** 3 / statistics.median(timed(lambda: a @ b, device) for _ in range(repeats))


@dataclass
class Peak:
    flops: float  # what MFU divides by
    source: str  # "table:H200" or "measured matmul"
    measured: float  # the matmul measured in this run (always)
    table: float | None  # the known device's datasheet figure, when the device is in the table

    def as_dict(self) -> dict:
        return asdict(self)


def table_peak(device_name: str, dtype: torch.dtype) -> tuple[float, str] | None:
    """(dense peak FLOP/s, table key) of a known GPU name, or None."""
    for key, bf16 in GPU_PEAK_BF16.items():
        if key in device_name:
            return (bf16 if dtype in (torch.bfloat16, torch.float16) else bf16 / 2), key
    return None


def device_peak(device="cpu", dtype: torch.dtype = torch.float32, n: int | None = None) -> Peak:
    """The peak MFU is measured against: on a known GPU the datasheet figure (dense bf16; fp32 as
    TF32 at half), else the dense matmul measured now at this dtype and thread count. The measured
    matmul is always returned too, so a GPU run shows both."""
    measured = matmul_flops(dtype, device, n=n)
    if str(device).startswith("cuda"):
        found = table_peak(torch.cuda.get_device_name(torch.device(device)), dtype)
        if found is not None:
            return Peak(found[0], f"table:{found[1]}", measured, found[0])
    return Peak(measured, "measured matmul", measured, None)


def device_peak_flops(dtype: torch.dtype) -> tuple[float, str]:
    """(peak FLOP/s of this rank's device, how it was obtained), `device_peak` with n = 1024 on CPU
    ranks (a short start-up); measured once per process, device, dtype and thread count."""
    return _device_peak(local_device(), dtype, torch.get_num_threads())


@functools.lru_cache(maxsize=None)
def _device_peak(device: torch.device, dtype: torch.dtype, threads: int) -> tuple[float, str]:
    peak = device_peak(device, dtype, n=None if device.type == "cuda" else 1024)
    return peak.flops, peak.source


# ---------------------------------------------------------------- where a launch's ranks go

CPU_RANKS = 2  # the ranks a launch starts on a machine without a visible GPU


def launcher_option(args: list[str], name: str) -> str | None:
    """The value of `--name V` or `--name=V` in a DeepSpeed launcher argument list, or None."""
    for i, a in enumerate(args):
        if a == name and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return None


def visible_gpus() -> list[int]:
    """The GPU ids this process may use, as the runner names them (`--include localhost:IDS`):
    CUDA_VISIBLE_DEVICES's entries when it is set, else 0 .. N-1; counted by torch (so a container
    without `nvidia-smi` counts its GPUs too), [] where torch sees none."""
    count = torch.cuda.device_count() if on_gpu() else 0
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is None:
        return list(range(count))
    ids = [x.strip() for x in listed.split(",") if x.strip()]
    if not all(x.isdigit() for x in ids):  # GPU UUIDs (GPU-...): the runner takes indices only
        raise DeviceError(f"CUDA_VISIBLE_DEVICES={listed!r}: DeepSpeed's runner takes GPU indices; give "
                          "indices (e.g. 2,3) or pass --include localhost:IDS yourself")
    return [int(x) for x in ids[:count]]


@dataclass(frozen=True)
class Placement:
    """The ranks a `./launch/train.sh` command line starts: `ranks` on `nodes` nodes, on GPUs
    (`device` "cuda", `gpus` their local ids) or CPU ranks; `runner_args` the DeepSpeed runner
    arguments to add to the user's (less the options named in `drop`) to start them there, `env` what
    the ranks' environment changes, `note` a line for the log when the choice needs saying."""

    ranks: int
    nodes: int = 1
    device: str = "cpu"
    gpus: tuple[int, ...] = ()
    runner_args: tuple[str, ...] = ()
    env: dict = field(default_factory=dict)
    note: str | None = None
    drop: tuple[str, ...] = ()

    def runner(self, user_args: list[str]) -> list[str]:
        """The DeepSpeed runner's rank arguments: the user's (less `drop`) and ours."""
        args = list(user_args)
        for name in self.drop:
            args = without_option(args, name)
        return [*self.runner_args, *args]

    @property
    def ranks_per_node(self) -> int:
        return math.ceil(self.ranks / self.nodes)


def _count(text: str, what: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise DeviceError(f"{what} takes a whole number >= 1, got {text!r}")
    return n


def _hostfile_slots(path: str) -> list[int]:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise DeviceError(f"--hostfile {path}: cannot be read ({exc.strerror})") from exc
    slots = []
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            found = [t.split("=", 1)[1] for t in line.split() if t.startswith("slots=")]
            slots.append(_count(found[0], f"--hostfile {path}: slots=") if found else 1)
    if not slots:
        raise DeviceError(f"--hostfile {path}: no `host slots=N` lines")
    return slots


def _slurm_nodes() -> int:
    """The node count of the Slurm allocation this runs in (`--launcher slurm`)."""
    count = os.environ.get("SLURM_JOB_NUM_NODES") or os.environ.get("SLURM_NNODES")
    if not count:
        raise DeviceError("--launcher slurm runs inside a Slurm allocation (sbatch launch/slurm.sh, or salloc): "
                          "SLURM_JOB_NUM_NODES is not set here")
    return _count(count, "SLURM_JOB_NUM_NODES")


def _included(spec: str, visible: list[int]) -> list[int]:
    """The local GPU ids of `--include localhost:0,1` (`localhost` alone: every visible GPU)."""
    hosts = [h for h in spec.split("@") if h]
    if len(hosts) != 1 or hosts[0].split(":")[0] not in ("localhost", "127.0.0.1"):
        raise DeviceError(f"--include {spec}: one local host is planned here (localhost:IDS); a multi-node "
                          "job is described by --hostfile")
    _, _, ids = hosts[0].partition(":")
    if not ids:
        return visible
    if not all(x.strip().isdigit() for x in ids.split(",")):
        raise DeviceError(f"--include {spec}: GPU ids are whole numbers, e.g. localhost:0,1")
    return [int(x) for x in ids.split(",")]


def placement(args: list[str], cpu_ranks: int = CPU_RANKS) -> Placement:
    """Where the ranks of a launch go. The user's --hostfile / --include / --num_gpus decide when
    given (a --num_gpus with CUDA_VISIBLE_DEVICES set becomes `--include localhost:` the first N
    visible ids: DeepSpeed's runner drops CUDA_VISIBLE_DEVICES when given --num_gpus, which would put
    the ranks on GPUs 0..N-1 whatever a scheduler handed out); else every visible GPU, named by
    `--include localhost:IDS` when CUDA_VISIBLE_DEVICES is set; else `cpu_ranks` CPU ranks with the
    cores split between them. Several nodes (--hostfile, or --launcher slurm: the allocation's nodes with
    --num_gpus, the visible GPUs or `cpu_ranks` ranks each): CPU ranks get this host's cores split by
    the ranks per node, carried to every node. Asking for GPUs where torch sees none (or fewer) is a
    `DeviceError`."""
    hostfile = launcher_option(args, "--hostfile")
    device = "cuda" if on_gpu() else "cpu"
    if hostfile is not None:  # several nodes: the threads every CPU rank gets, the same on every node
        slots = _hostfile_slots(hostfile)
        return Placement(sum(slots), len(slots), device, env=_cpu_env(max(slots)) if device == "cpu" else {})
    if launcher_option(args, "--launcher") == "slurm":
        nodes, per = _slurm_nodes(), launcher_option(args, "--num_gpus")
        per = _count(per, "--num_gpus") if per is not None else (len(visible_gpus()) or cpu_ranks)
        return Placement(nodes * per, nodes, device, env=_cpu_env(per) if device == "cpu" else {})
    visible = visible_gpus()
    include, num = launcher_option(args, "--include"), launcher_option(args, "--num_gpus")
    if include is not None:
        ids = _included(include, visible)
        if visible and not set(ids) <= set(visible):
            raise DeviceError(f"--include {include}: GPU(s) {sorted(set(ids) - set(visible))} are not visible "
                              f"here (visible: {visible}; {_cuda_found()})")
        return Placement(len(ids), 1, "cuda" if visible else "cpu", tuple(ids) if visible else ())
    if num is not None:
        n = _count(num, "--num_gpus")
        if not visible:  # DeepSpeed's CPU accelerator: --num_gpus N starts N CPU ranks
            return Placement(n, 1, "cpu")
        if n > len(visible):
            raise DeviceError(f"--num_gpus {n}: torch sees {len(visible)} GPU(s) here ({_cuda_found()})")
        if "CUDA_VISIBLE_DEVICES" not in os.environ:
            return Placement(n, 1, "cuda", tuple(visible[:n]))
        ids = visible[:n]
        return Placement(n, 1, "cuda", tuple(ids), _include_args(ids), {},
                         f"--num_gpus {n} with CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']}: the ranks "
                         f"run on GPUs {ids} (--include localhost:{','.join(map(str, ids))})", drop=("--num_gpus",))
    if visible:
        runner = _include_args(visible) if "CUDA_VISIBLE_DEVICES" in os.environ else ("--num_gpus", str(len(visible)))
        return Placement(len(visible), 1, "cuda", tuple(visible), runner)
    return Placement(cpu_ranks, 1, "cpu", (), ("--num_gpus", str(cpu_ranks)), _cpu_env(cpu_ranks),
                     f"no GPU visible ({_cuda_found()}): {cpu_ranks} CPU ranks")


def _include_args(ids: list[int]) -> tuple[str, ...]:
    return ("--include", "localhost:" + ",".join(map(str, ids)))


def without_option(args: list[str], name: str) -> list[str]:
    """`args` without `--name V` / `--name=V`."""
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a == name:
            skip = True
        elif not a.startswith(name + "="):
            out.append(a)
    return out


def _cpu_env(ranks: int) -> dict:
    """CPU ranks share the cores: OMP threads split between them (unless OMP_NUM_THREADS is set)."""
    cores = os.cpu_count() or ranks
    return {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(max(1, cores // ranks)))}


def host_ram() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@dataclass(frozen=True)
class Machine:
    """Where the job runs, with memory, for the plan: `ranks` processes on `nodes` nodes; `device`
    "cuda" or "cpu" (CPU ranks: the device memory is the host's)."""

    ranks: int
    nodes: int = 1
    device: str = "cuda"
    gpu_mem: float | None = None  # bytes per GPU
    host_mem: float | None = None  # bytes per node

    @property
    def ranks_per_node(self) -> int:
        return math.ceil(self.ranks / self.nodes)


def machine_of(place: Placement) -> Machine:
    """The memory plan's view of a placement: GPU memory of the first placed GPU, this host's RAM."""
    gpu_mem = None
    if place.device == "cuda" and on_gpu():  # the placed GPUs are taken to be alike: the first visible one's
        gpu_mem = torch.cuda.get_device_properties(0).total_memory
    return Machine(ranks=place.ranks, nodes=place.nodes, device=place.device, gpu_mem=gpu_mem, host_mem=host_ram())


def local_machine(ranks: int | None = None, nodes: int = 1) -> Machine:
    """What `./launch/train.sh` starts here (every visible GPU, else 2 CPU ranks) on `nodes` such
    nodes; `ranks`: that many CPU ranks instead."""
    if ranks is not None:
        return Machine(ranks=ranks, nodes=nodes, device="cpu", host_mem=host_ram())
    one = machine_of(placement([]))
    return replace(one, ranks=one.ranks * nodes, nodes=nodes)
