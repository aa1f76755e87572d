"""DeepSpeed set-up, applied to the model from the outside, in a fixed order:

  1. process group: gloo on CPU, NCCL on CUDA, with the job's collective timeout;
  2. the trainable parameters: LoRA adapters (peft) or the whole DiT;
  3. block gradient checkpointing (a model flag; the DiT checkpoints each block);
  4. the optimizer (torch AdamW; fused on CUDA, so no JIT-compiled DeepSpeed extension is built),
     warmup + constant/cosine LR, and `deepspeed.initialize` with ZeRO 0-3 (optional CPU offload);
     DeepSpeed's own bf16 mode stays off: it would cast every parameter to bf16, float32 islands
     included. bf16 is the model's (`video_dit.models.dit.cast_dit` with master weights: trainable
     parameters float32, updated in place by AdamW; the frozen bulk bf16; the forward under bf16
     autocast with its float32 islands, as Wan runs its float32 weights);
  5. only then quantization of the frozen base (optimum-quanto; ZeRO 0-2 only): quanto swaps the
     Linears' weights for packed tensors, which `deepspeed.initialize` (it walks and casts every
     parameter) and ZeRO-3 partitioning cannot handle, so it must come after and never with stage 3.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import socket
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

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
        if not on_gpu():
            unlink_cpu_allreduce_buffer()
    return dist.get_rank(), dist.get_world_size()


def leave_distributed() -> None:
    """End this process's group before the interpreter exits (local, no collective: safe after a
    failed peer). Left to interpreter shutdown, gloo's threads were torn down in an order that
    aborted a rank that had finished ('terminate called without an active exception', SIGABRT)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def cpu_allreduce_buffer_path(rank: int) -> Path:
    """The POSIX shared-memory segment DeepSpeed's CPU accelerator creates per rank for its shm
    allreduce (name format of deepspeed/ops/csrc/cpu/comm/shm.cpp, shm_initialize: prefix, uid,
    MASTER_ADDR, MASTER_PORT, rank)."""
    addr, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
    return Path("/dev/shm") / f"deepspeed_allreduce_buffer_{os.getuid()}_{addr}_{port}_{rank}"


def unlink_cpu_allreduce_buffer() -> None:
    """DeepSpeed 0.19.8 never unlinks its CPU shm allreduce segments (shared_close is never
    called): every 2-rank CPU launch left 2 x 66 MiB in /dev/shm (RAM) for good. Once every rank
    has mapped every segment (shm_initialize returns only after it has; the barrier waits for all),
    each rank unlinks its own name: the mappings stay valid and the memory goes with the processes.
    Without the segment (not every rank local: DeepSpeed made none on any rank) nothing to wait for."""
    own = cpu_allreduce_buffer_path(dist.get_rank())
    if own.exists():
        dist.barrier()
        own.unlink()


def train_dtype(name: str, cpu_bf16: bool = False) -> torch.dtype:
    """The compute dtype of a job's `train.dtype`: bf16 on GPU; on CPU ranks float32 (CPU bf16
    matmuls are slow) unless `train.cpu_bf16` forces bf16 (for testing the bf16 path on CPU)."""
    if name in ("bf16", "bfloat16") and (on_gpu() or cpu_bf16):
        return torch.bfloat16
    return torch.float32


def cpu_fp32_notice(name: str, dtype: torch.dtype) -> str | None:
    """The one log line of a job that asks for bf16 and trains in float32 on CPU ranks (else None)."""
    if name in ("bf16", "bfloat16") and dtype == torch.float32:
        return ("train.dtype is bf16, but these are CPU ranks: training in float32 (CPU bf16 matmuls are slow); "
                "set train.cpu_bf16: true to train in bf16 here")
    return None


def build_dtype(dtype: torch.dtype, lora: bool) -> torch.dtype:
    """The dtype a DiT trained in `dtype` is built / loaded at (`build_dit(dtype=)`): a LoRA job's
    frozen base in `dtype` (its float32 islands stay float32), a full fine-tune in float32 (every
    parameter is trainable: float32 master weights)."""
    return dtype if lora else torch.float32


def cast_for_training(model, dtype: torch.dtype):
    """The DiT's storage for training in `dtype`, set after its trainable parameters are chosen:
    `cast_dit(model, dtype, masters=True)`: trainable parameters (LoRA adapters, or every weight of a
    full fine-tune) float32, the optimizer's master weights; frozen ones in `dtype` except the
    float32 islands; the forward computes in `dtype`. ZeRO-3 parameters, already partitioned, must
    have their dtype from the build (`build_dtype`): a partition is never cast here."""
    from video_dit.models.dit import cast_dit, param_dtypes

    want = param_dtypes(model, dtype, masters=True)
    wrong = [n for n, p in model.named_parameters() if hasattr(p, "ds_tensor") and p.dtype != want[n]]
    if wrong:
        raise RuntimeError(f"ZeRO-3 parameters {', '.join(wrong[:3])} are {dict(model.named_parameters())[wrong[0]].dtype}, "
                           f"not their training dtype {want[wrong[0]]}: build the DiT at build_dtype()")
    return cast_dit(model, dtype, masters=True)


def ds_config(job, world_size: int, cuda: bool | None = None) -> dict:
    """The DeepSpeed JSON of a job; `deepspeed.config` (the user's JSON) is merged last. `cuda`: the
    JSON for GPU (True) or CPU (False) ranks rather than this machine's (the memory planner's).
    The training dtype is not in it: DeepSpeed's bf16 mode stays off (module docstring, step 4)."""
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
        # never DeepSpeed's bf16 mode, which casts every parameter (islands included): a bf16 job's
        # model is cast by `cast_for_training` and runs its own autocast (module docstring, step 4)
        "bf16": {"enabled": False},
    }
    if sp > 1:
        cfg["sequence_parallel_size"] = sp
    return _merge(cfg, d.extra())


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


@dataclass(frozen=True)
class LRSchedule:
    """Multiplier of the peak LR at optimizer step s (0-based: step s + 1 of metrics.jsonl trains at
    lr x at(s)): linear warmup over `warmup` steps, then constant, or a cosine to 0 at step `total`.

    A run resumed at step s0 with another `train.steps` T follows `extended(s0, T)` (the rule; the
    trainer logs it and the checkpoint stores the result, so a later resume continues it):
      - constant: unchanged (the warmup does not depend on train.steps);
      - cosine, resumed inside the warmup: the warmup, then the cosine over the new total;
      - cosine, resumed after it: the cosine re-stretched from s0 to T, starting at the multiplier
        the checkpoint's schedule had at s0 (no jump): at(s) = c * (1 + cos(pi (s - s0) / (T - s0))) / 2,
        c = at_old(s0); when that schedule had already reached 0 (the run finished, c = 0) it restarts
        at c = 1 (a warm restart over the added steps; otherwise every added step would train at lr 0).
    `anchor`/`scale` hold s0 and c (0 and 1 for a schedule never extended).
    """

    kind: str
    warmup: int
    total: int
    anchor: int = 0
    scale: float = 1.0

    @classmethod
    def of(cls, train_cfg) -> "LRSchedule":
        return cls(train_cfg.lr_scheduler, train_cfg.warmup_steps, train_cfg.steps)

    def __call__(self, s: int) -> float:
        if s < self.warmup:
            return (s + 1) / self.warmup
        if self.kind == "constant":
            return 1.0
        start = max(self.warmup, self.anchor)
        progress = (s - start) / max(1, self.total - start)
        return self.scale * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    def extended(self, step: int, total: int) -> "LRSchedule":
        """The schedule of a run resumed at `step` whose train.steps is now `total` (see the class)."""
        if self.kind == "constant" or step < max(self.warmup, self.anchor) or total == self.total:
            return dataclasses.replace(self, total=total)
        scale = self(step)
        return dataclasses.replace(self, total=total, anchor=step, scale=scale if scale > 0 else 1.0)

    def describe(self, step: int, old: "LRSchedule") -> str:
        """One log line: what the resumed run's LR does from `step` on, and why."""
        if self.kind == "constant":
            return f"train.steps {old.total} -> {self.total}: the constant LR schedule is unchanged"
        if self.anchor != step:
            return (f"train.steps {old.total} -> {self.total} inside the warmup: the cosine now ends at step "
                    f"{self.total}")
        how = ("the checkpoint's cosine had finished (LR 0), so a new cosine (warm restart) runs over the added "
               "steps" if old(step) <= 0 else "the cosine is re-stretched from the LR it had at the resumed step "
               "(no jump)")
        return (f"train.steps {old.total} -> {self.total}: {how}, x{self.scale:.4g} of the peak at step {step + 1} "
                f"down to 0 at step {self.total}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def at_steps(schedule, steps: list[int] | None, total: int):
    """The LR multiplier of an optimizer that steps only at the global optimizer steps `steps` (one
    expert of a two-expert job): its k-th step trains at `schedule(steps[k])`, the job's schedule at
    that global step (as ai-toolkit's one scheduler gives); past the last listed step, at the steps
    after `total`. `steps` None: every step (the schedule itself)."""
    if steps is None:
        return schedule
    return lambda k: schedule(steps[k] if k < len(steps) else total + k - len(steps))


def schedule_change(meta: dict, train_cfg) -> tuple[str, str] | None:
    """(key, message) when the job changes what a resumed run cannot change about the LR schedule
    of the checkpoint described by `meta` (its meta.json): the peak `lr`, `warmup_steps` or
    `lr_scheduler` (DeepSpeed restores the schedule's state; a new value would apply silently or not
    at all). `train.steps` may change (`LRSchedule.extended`). None when nothing conflicts."""
    saved = meta.get("lr_schedule")
    if saved is None:
        return None
    was = {"lr": meta.get("lr"), "warmup_steps": saved["warmup"], "lr_scheduler": saved["kind"]}
    for key, old in was.items():
        new = getattr(train_cfg, key)
        if old is not None and new != old:
            return key, (f"{new!r}, but checkpoint step {meta.get('step')} was trained with {old!r}, and a resumed "
                         "run continues the checkpoint's LR schedule (only train.steps may change: the schedule is "
                         f"then re-stretched, see the README). Accepted: {old!r}, or save.resume: none (a new run "
                         "from step 0)")
    return None


def lr_lambda(warmup_steps: int, total_steps: int, kind: str):
    """The LR multiplier of a fresh schedule (`LRSchedule`) as a plain function of the step."""
    return LRSchedule(kind, warmup_steps, total_steps)


def build_optimizer(params, train_cfg, schedule: LRSchedule | None = None, steps: list[int] | None = None):
    """AdamW and its LambdaLR over `schedule` (default: `LRSchedule.of(train_cfg)`); `steps`: the global
    steps this optimizer steps at (`at_steps`)."""
    o = train_cfg.optimizer_params
    kwargs = dict(lr=train_cfg.lr, betas=tuple(o.betas), eps=o.eps,
                  weight_decay=o.weight_decay if train_cfg.optimizer == "adamw" else 0.0)
    if on_gpu():
        kwargs["fused"] = True
    optimizer = torch.optim.AdamW(params, **kwargs)
    schedule = schedule or LRSchedule.of(train_cfg)
    fn = at_steps(schedule, steps, train_cfg.steps)
    # a plain function, not the dataclass: LambdaLR.state_dict() saves a callable object's __dict__ and
    # load_state_dict() writes it back, which would put the checkpoint's schedule over an extended one
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: fn(s))
    return optimizer, scheduler


def sync_lr(scheduler) -> None:
    """Set the optimizer's LR (and `get_last_lr()`) to the schedule's value at the scheduler's step.
    After a resume, DeepSpeed restores the LR the checkpoint's optimizer had after its last step; with
    an extended schedule that is the old schedule's value (0.0 at the end of a finished cosine), which
    the first resumed step would train at."""
    step = scheduler.last_epoch
    lrs = [base * fn(step) for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, lr in zip(scheduler.optimizer.param_groups, lrs):
        group["lr"] = lr
    scheduler._last_lr = lrs


def initialize(model, job, world_size: int, load_universal: bool = False, schedule: LRSchedule | None = None,
               steps: list[int] | None = None):
    """(engine, optimizer, scheduler) for `model` whose trainable parameters have requires_grad (and
    whose dtypes `cast_for_training` set: DeepSpeed keeps them as they are); `schedule`: the LR
    schedule (default: the job's own, `LRSchedule.of(job.process.train)`); `steps`: the global
    optimizer steps it trains at (one expert of two; None: every step)."""
    import deepspeed

    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the model has no trainable parameters")
    optimizer, scheduler = build_optimizer(params, job.process.train, schedule, steps)
    config = ds_config(job, world_size)
    if load_universal:
        config.setdefault("checkpoint", {})["load_universal"] = True
    engine, optimizer, _, scheduler = deepspeed.initialize(model=model, model_parameters=params,
                                                           optimizer=optimizer, lr_scheduler=scheduler,
                                                           config=config)
    alias_fp32_partitions(optimizer)
    return engine, optimizer, scheduler


def alias_fp32_partitions(optimizer) -> int:
    """ZeRO-3 with float32 parameter partitions: let the optimizer update them in place instead of
    a second float32 copy (4 bytes per parameter and rank over the world size). DeepSpeed 0.19.8
    means to (stage3.py `_create_fp32_partitions`: "we don't need another copy of the weights" when
    the partition is already float32 on the optimizer's device) but compares the tensor's
    torch.device with its device *string*, which is never equal, so it always copies. Its step then
    copies the master partition into the parameter partition: with one storage, a copy onto itself.
    Returns how many partitions now share storage (0 for other stages, offload, or bf16 params)."""
    flat16 = getattr(optimizer, "fp16_partitioned_groups_flat", None)
    flat32 = getattr(optimizer, "fp32_partitioned_groups_flat", None)
    if not flat16 or not flat32 or getattr(optimizer, "offload_optimizer", False):
        return 0
    aliased = 0
    for low, master in zip(flat16, flat32):
        if (low is not None and low.dtype == master.dtype and low.device == master.device
                and low.numel() == master.numel() and low.data_ptr() != master.data_ptr()):
            master.data = low.data
            aliased += 1
    return aliased


def initialize_frozen(model, job, world_size: int):
    """A DeepSpeed engine without optimizer for a frozen ZeRO-3 (partitioned) model, so its forward
    gathers each block's parameters as a training engine's does (DeepSpeed runs ZeRO-3 inference
    through `DeepSpeedZeRoOffload` when no optimizer is given). Under ZeRO 0-2 the model is used as is."""
    import deepspeed

    engine, *_ = deepspeed.initialize(model=model, config=ds_config(job, world_size))
    return engine


def quantize_frozen(model, qtype: str) -> None:
    """optimum-quanto weights for the frozen Linears of the blocks; the LoRA adapters and the float32
    islands (time MLPs, head: `FLOAT32_MODULES`) stay in full precision."""
    from optimum import quanto

    from video_dit.models.dit import FLOAT32_MODULES

    exclude = ["*lora_A*", "*lora_B*", *(f"{name}*" for name in FLOAT32_MODULES)]
    quanto.quantize(model, weights=getattr(quanto, qtype), exclude=exclude)
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
