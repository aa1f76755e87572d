"""ZeRO, decided once: what a job's `deepspeed.zero_stage` implies for building, running, averaging,
exporting and rendering its DiT. The trainer makes one `Distribution` from the job and asks it;
nothing else tests the stage.

    stage 0     every rank holds the whole model, optimizer state and gradients
    stage 1/2   optimizer state (1) and gradients (2) sharded over the W ranks; weights whole
    stage 3     parameters sharded too (`partitioned`): the DiT is built partitioned (no rank holds
                it whole, `parallel/partition.py`), DeepSpeed gathers each block's parameters just
                before it runs, a parameter's local tensor is its 1/W slice (`p.ds_tensor`), and
                reading whole weights (exports, EMA swaps) is a collective (`gathered`)

What follows from `partitioned` for the trainer: previews and a validation under ZeRO-3 run on
every rank together (each forward gathers from all ranks); a frozen model (a two-expert job's
untrained expert) is partitioned behind an optimizer-less engine under ZeRO-3, and kept on the host
between uses under ZeRO 0-2 (`frozen_on_host`).

DeepSpeed's JSON (`ds_config`): ZeRO settings, micro-batch and accumulation, clipping, and never
DeepSpeed's bf16 mode (it would cast every parameter, the DiT's float32 islands included; a bf16
job's model carries its own dtypes and autocast, `train/precision.py`). Our optimizer is torch's
AdamW, so no JIT-compiled DeepSpeed optimizer extension is built.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch

from video_dit.devices import on_gpu, overlap_comm


def partitioned(stage: int) -> bool:
    """Whether ZeRO `stage` shards the parameters themselves (stage 3)."""
    return stage == 3


def shards_optimizer(stage: int) -> bool:
    """Whether ZeRO `stage` shards the optimizer state over the ranks (stages 1-3; offloadable)."""
    return stage >= 1


def sharded_checkpoint(stage: int) -> bool:
    """Whether a checkpoint written at `stage` holds per-rank shards (optimizer state at 1-2,
    parameters too at 3) that only the same world size and stage can load directly."""
    return stage > 0


def local_tensor(p: torch.nn.Parameter, stage: int) -> torch.Tensor:
    """This rank's tensor of `p`: its ZeRO-3 partition (1-D, padded), else the whole parameter."""
    return p.ds_tensor if partitioned(stage) else p.data


@contextmanager
def gathered(params, zero_stage: int, modifier_rank=None):
    """Whole parameters inside the block under ZeRO-3 (every rank must enter); a no-op otherwise."""
    if not partitioned(zero_stage):
        with nullcontext():
            yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(params), modifier_rank=modifier_rank):
        yield


def ds_config(job, world_size: int, cuda: bool | None = None) -> dict:
    """The DeepSpeed JSON of a job; `deepspeed.config` (the user's JSON) is merged last. `cuda`: the
    JSON for GPU (True) or CPU (False) ranks rather than this machine's (the memory planner's)."""
    gpu = on_gpu() if cuda is None else cuda
    p = job.process
    t, d = p.train, p.deepspeed
    sp = d.sequence_parallel_size
    dp = world_size // sp
    zero: dict = {"stage": d.zero_stage}
    if shards_optimizer(d.zero_stage):
        zero.update(overlap_comm=overlap_comm(gpu), contiguous_gradients=True, reduce_bucket_size=int(5e7))
    if partitioned(d.zero_stage):
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
        # model is cast by `precision.cast_for_training` and runs its own autocast (module docstring)
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


def initialize(model, optimizer, scheduler, config: dict):
    """(engine, optimizer, scheduler): `deepspeed.initialize` of `model` whose trainable parameters
    have requires_grad (their dtypes already set: DeepSpeed keeps them as they are), with torch's
    `optimizer` and its LR `scheduler` and the DeepSpeed JSON `config`."""
    import deepspeed

    params = [p for p in model.parameters() if p.requires_grad]
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


def initialize_frozen(model, config: dict):
    """A DeepSpeed engine without optimizer for a frozen ZeRO-3 (partitioned) model, so its forward
    gathers each block's parameters as a training engine's does (DeepSpeed runs ZeRO-3 inference
    through `DeepSpeedZeRoOffload` when no optimizer is given)."""
    import deepspeed

    engine, *_ = deepspeed.initialize(model=model, config=config)
    return engine


@dataclass(frozen=True)
class Distribution:
    """A job's ranks and what its ZeRO stage implies, made once (`of`): `world` ranks, sequence
    groups of `sp`, ZeRO `stage`, and the DeepSpeed JSON (`config`)."""

    stage: int
    world: int
    sp: int
    config: dict

    @classmethod
    def of(cls, job, world: int, cuda: bool | None = None) -> "Distribution":
        d = job.process.deepspeed
        return cls(d.zero_stage, world, d.sequence_parallel_size, ds_config(job, world, cuda))

    @property
    def partitioned(self) -> bool:
        """Parameters sharded over the ranks (ZeRO-3): built partitioned, gathered to be read."""
        return partitioned(self.stage)

    @property
    def frozen_on_host(self) -> bool:
        """A frozen model that is not partitioned lives on the host and visits the device when used."""
        return not self.partitioned

    @property
    def collective_forward(self) -> bool:
        """A forward is a collective of all ranks (ZeRO-3 gathers, or attention over a sequence group):
        previews and validation then run on every rank together."""
        return self.partitioned or self.sp > 1

    def gathered(self, params, modifier_rank=None):
        return gathered(params, self.stage, modifier_rank)

    def initialize(self, model, optimizer, scheduler, load_universal: bool = False):
        config = self.config
        if load_universal:  # a checkpoint of another world size / stage, converted (train/checkpoint.py)
            config = _merge(config, {"checkpoint": {"load_universal": True}})
        return initialize(model, optimizer, scheduler, config)

    def frozen(self, model):
        """A frozen model ready for forwards: partitioned behind an optimizer-less engine (ZeRO-3),
        else the model itself."""
        return initialize_frozen(model, self.config).module if self.partitioned else model
