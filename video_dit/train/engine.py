"""DeepSpeed set-up, applied to the model from the outside, in a fixed order:

  1. process group: gloo on CPU, NCCL on CUDA, with the job's collective timeout;
  2. the trainable parameters: LoRA adapters (peft) or the whole DiT;
  3. block gradient checkpointing (a model flag; the DiT checkpoints each block);
  4. the optimizer (torch AdamW; fused on CUDA, so no JIT-compiled DeepSpeed extension is built),
     warmup + constant/cosine LR, and `deepspeed.initialize` with ZeRO 0-3 (optional CPU offload);
  5. only then quantization of the frozen base (optimum-quanto; ZeRO 0-2 only): quanto swaps the
     Linears' weights for packed tensors, which `deepspeed.initialize` (it walks and casts every
     parameter) and ZeRO-3 partitioning cannot handle, so it must come after and never with stage 3.
"""

from __future__ import annotations

import functools
import math
import os
import socket
from contextlib import contextmanager, nullcontext
from datetime import timedelta

import torch
import torch.distributed as dist


def on_gpu() -> bool:
    return torch.cuda.is_available()


def local_device() -> torch.device:
    if on_gpu():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a process group's MASTER_PORT; the one home of this helper)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(timeout_s: int) -> tuple[int, int]:
    """Join (or, when started without a launcher, create) the process group; returns (rank, world)."""
    import deepspeed

    if not dist.is_initialized():
        if "RANK" not in os.environ:  # plain `python launch/train.py`: a group of one
            os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=str(free_port()))
        if on_gpu():
            torch.cuda.set_device(local_device())
        deepspeed.init_distributed(dist_backend="nccl" if on_gpu() else "gloo",
                                   timeout=timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


def train_dtype(name: str) -> torch.dtype:
    """bf16 on GPU; fp32 on CPU (CPU bf16 matmuls are slow and DeepSpeed's CPU path is fp32)."""
    if name in ("bf16", "bfloat16") and on_gpu():
        return torch.bfloat16
    return torch.float32


def ds_config(job, world_size: int, dtype: torch.dtype, cuda: bool | None = None) -> dict:
    """The DeepSpeed JSON of a job; `deepspeed.config` (the user's JSON) is merged last. `cuda`: the
    JSON for GPU (True) or CPU (False) ranks rather than this machine's (the memory planner's)."""
    gpu = on_gpu() if cuda is None else cuda
    p = job.process
    t, d = p.train, p.deepspeed
    sp = d.sequence_parallel_size
    dp = world_size // sp
    zero: dict = {"stage": d.zero_stage}
    if d.zero_stage >= 1:
        zero.update(overlap_comm=gpu, contiguous_gradients=True, reduce_bucket_size=int(5e7))
    if d.zero_stage == 3:
        zero.update(stage3_gather_16bit_weights_on_model_save=False, stage3_param_persistence_threshold=int(1e4))
    if d.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": gpu}
    if d.offload_param:
        zero["offload_param"] = {"device": "cpu", "pin_memory": gpu}
    cfg = {
        "train_micro_batch_size_per_gpu": t.batch_size,
        "gradient_accumulation_steps": t.gradient_accumulation,
        "train_batch_size": t.batch_size * t.gradient_accumulation * dp,
        "gradient_clipping": t.max_grad_norm,
        "zero_optimization": zero,
        # our optimizer is torch's AdamW; DeepSpeed's CPU Adam would need a JIT-compiled extension
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 10 ** 9,
        "wall_clock_breakdown": False,
        "bf16": {"enabled": dtype == torch.bfloat16},
    }
    if sp > 1:
        cfg["sequence_parallel_size"] = sp
    return _merge(cfg, d.extra())


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def lr_lambda(warmup_steps: int, total_steps: int, kind: str):
    """Multiplier of the peak LR at optimizer step s (0-based): linear warmup, then constant or cosine to 0."""
    def f(s: int) -> float:
        if s < warmup_steps:
            return (s + 1) / warmup_steps
        if kind == "constant":
            return 1.0
        progress = (s - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return f


def build_optimizer(params, train_cfg):
    o = train_cfg.optimizer_params
    kwargs = dict(lr=train_cfg.lr, betas=tuple(o.betas), eps=o.eps,
                  weight_decay=o.weight_decay if train_cfg.optimizer == "adamw" else 0.0)
    if on_gpu():
        kwargs["fused"] = True
    optimizer = torch.optim.AdamW(params, **kwargs)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda(train_cfg.warmup_steps, train_cfg.steps, train_cfg.lr_scheduler))
    return optimizer, scheduler


def initialize(model, job, world_size: int, dtype: torch.dtype, load_universal: bool = False):
    """(engine, optimizer, scheduler) for `model` whose trainable parameters have requires_grad."""
    import deepspeed

    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the model has no trainable parameters")
    optimizer, scheduler = build_optimizer(params, job.process.train)
    config = ds_config(job, world_size, dtype)
    if load_universal:
        config.setdefault("checkpoint", {})["load_universal"] = True
    engine, optimizer, _, scheduler = deepspeed.initialize(model=model, model_parameters=params,
                                                           optimizer=optimizer, lr_scheduler=scheduler,
                                                           config=config)
    return engine, optimizer, scheduler


def quantize_frozen(model, qtype: str) -> None:
    """optimum-quanto weights for the frozen Linears (the LoRA adapters stay in full precision)."""
    from optimum import quanto

    quanto.quantize(model, weights=getattr(quanto, qtype), exclude=["*lora_A*", "*lora_B*"])
    quanto.freeze(model)


@contextmanager
def gathered(params, zero_stage: int, modifier_rank=None):
    """Full parameters inside the block under ZeRO-3 (every rank must enter); a no-op otherwise."""
    if zero_stage != 3:
        with nullcontext():
            yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(params), modifier_rank=modifier_rank):
        yield


# ---------------------------------------------------------------- device peak for MFU

def device_peak_flops(dtype: torch.dtype) -> tuple[float, str]:
    """(peak FLOP/s of this rank's device, how it was obtained): the datasheet table for known GPUs,
    else a dense matmul measured now (n = 1024 keeps start-up short on CPU ranks). The same
    definition as `video-dit bench` (`video_dit.bench.common.device_peak`). Measured once per
    process, device, dtype and thread count (a process running several jobs reuses it)."""
    return _device_peak(local_device(), dtype, torch.get_num_threads())


@functools.lru_cache(maxsize=None)
def _device_peak(device: torch.device, dtype: torch.dtype, threads: int) -> tuple[float, str]:
    from video_dit.bench.common import device_peak

    peak = device_peak(device, dtype, n=None if device.type == "cuda" else 1024)
    return peak.flops, peak.source
