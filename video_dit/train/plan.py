"""Memory plan of a training job, per rank, before anything is loaded: `predict` (one setting, one
bucket) and `plan_job` (every bucket of a job against the machine, with the settings that fit).

Everything is counted in bytes from the job's own numbers: parameter counts from the DiT built on
the meta device (`model_sizes`, exact, LoRA adapters included), DeepSpeed's buffer sizes from the
job's DeepSpeed JSON (`video_dit.train.engine.ds_config`, read through DeepSpeed's own
`DeepSpeedZeroConfig`, so its defaults are DeepSpeed's), and the activation model below, which is
each family's activation model (`Family.memory`: Wan's `families/wan/memory.py`, HunyuanVideo 1.5's
`families/hunyuan15/memory.py`), derived from what its DiT makes autograd keep. No constant in it is
fitted. The byte widths s, a, w and the `Setting` are `video_dit.models.activation_terms`'.

DeepSpeed (per rank, P = parameters, Pt = trainable, N = ranks ZeRO partitions over, from DeepSpeed
0.19's stage_1_and_2.py / stage3.py / engine.py). Parameters are counted at the dtypes they are
trained in (the family's `param_dtypes(masters=True)`: trainable ones float32, the frozen bulk s, the
float32 islands 4); DeepSpeed's bf16 mode is off, so the trainable parameters' gradients, reduce
buckets and gradient partitions are float32 too (the `s` of those terms is 4); under ZeRO-3 the
fp32 master partition is the parameter partition itself unless the optimizer is offloaded
(`engine.alias_fp32_partitions`). The activations are counted as above.
  ZeRO-0   P s parameters; Pt s gradients (backward to step); Adam 2 Pt s; the all-reduce flattens
           the gradients into min(Pt, allreduce bucket) s at the end of backward
  ZeRO-1/2 P s parameters (the trainable ones flattened, same bytes); an fp32 master partition Pt/N 4
           (kept in fp32 training too); Adam 2 Pt/N 4; during backward the reduce bucket
           (reduce_bucket_size s, twice with overlap_comm) and (ZeRO-2) the gradient partition Pt/N s
           (ZeRO-1: full gradients Pt s); at the step the fp32 gradient partition Pt/N 4. ZeRO-2 (with
           contiguous gradients) allocates its gradient partition at the bucket's first reduction
           (stage_1_and_2.py copy_grads_in_partition, from reduce_ipg_grads): when the next gradient
           would overflow the bucket, which every rank's gradients pass through, or else in the
           backward epilogue. So with Pt <= reduce_bucket_size the partition comes after the last
           activation is freed: the backward's peak is the bucket and the higher of the activations and
           the partition (`partition_during_backward`); with more, it is counted beside the activations'
           peak (an upper bound: the peak may come before the first reduction)
  ZeRO-3   sum ceil(p/N) s partitions (+ parameters under the persistence threshold in full); fp32
           master Pt/N 4; the gradient partition buffer Pt/N s and the reduce bucket
           (reduce_bucket_size s), both allocated at initialize; Adam 2 Pt/N 4; while forward and
           backward run, gathered parameters: min(P, max(prefetch bucket, max live parameters,
           max reuse distance) + largest module) s. From the second step (its trace known) DeepSpeed
           prefetches ahead of the module running while fewer than stage3_max_live_parameters
           elements are gathered (partitioned_param_coordinator.fetch_sub_module: each prefetch at
           most the prefetch bucket), and after a module runs it keeps the parameters gathered that
           recur within the next stage3_max_reuse_distance elements of the trace
           (__params_to_release); so every parameter gathered at a moment t is the running module's,
           a prefetched one, or one used again in the trace window after t that holds at most that
           many elements: an upper bound, near for a model larger than these (default 1e9 elements
           each: 3.7 GiB in fp32, 1.9 GiB in bf16). Measured (the rehearsal's job, max live 1e8,
           reuse 5e7): 0.41 GiB gathered from step 2, the bound 0.42 GiB. At a partition world size of
           1 (one rank) nothing is gathered: DeepSpeed's all_gather_coalesced returns a NoGatherHandle
           whose parameter becomes a view of its own partition (partition_parameters.py), unless the
           partition is offloaded (then it is copied to the device)
  offload_optimizer moves master, Adam state and gradient partitions to host memory; offload_param
  (ZeRO-3) moves the partitions there too (the gathered working set stays on the device).
The optimizer step adds Adam's temporaries: on CPU ranks torch's single-tensor AdamW holds two at once,
each the size of the tensor it updates (`exp_avg_sq.sqrt()` and its quotient by the bias correction:
torch/optim/adam.py `_single_tensor_adam`), so twice the largest tensor (the flat fp32 partition under
ZeRO-1/2/3); on CUDA the fused AdamW allocates none. ZeRO-1/2 copy this rank's gradients into that flat
fp32 partition and free them before AdamW runs (stage_1_and_2.py `step`): the step holds the gradients
and the copy, then the copy and Adam's temporaries. ZeRO-3's gradient partition buffer stays.

Two-expert jobs (Wan 2.2 A14B, `Experts`): the DeepSpeed state above once per trained expert (each
its own engine), the activations and transient buffers of one (one expert trains per step), plus a
frozen expert's base (ZeRO-3 partitions, or host memory under ZeRO 0-2) when a one-expert job
previews or validates with both.

Host RAM (per node): each rank's process (`PROCESS_BYTES`, the interpreter with torch and
DeepSpeed imported, measured by `video-dit bench --suite rehearsal`), the frozen encoders while the
caches are built (umT5, the VAE and for Wan 2.1 I2V / FLF2V CLIP on each rank: they are loaded on
every rank, then the text and image encoders are freed), the DiT set-up (ZeRO-3: one module group
read on rank 0; otherwise the whole model passes through host memory on every rank, one module
group at a time when on a GPU), then whatever is offloaded.
"""

from __future__ import annotations

import copy
import math
import os
import tempfile
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from PIL import Image

from video_dit.data import DataError, scan_dataset
from video_dit.data.buckets import candidate_buckets
from video_dit.devices import DeviceError, Machine, host_ram, machine_of, placement
from video_dit.families import family_of, get_preset
from video_dit.lora import add_lora
from video_dit.models.activation_terms import Activations, Setting, checkpointed_count
from video_dit.models.layouts import expert_sources, preset_name
from video_dit.models.weights import WeightsError, module_groups, open_weights
from video_dit.parallel.zero import ds_config, partitioned, shards_optimizer
from video_dit.spec import spec_of_job
from video_dit.train.config import checkpointed_blocks_of, parse_job, raw_process, read_yaml
from video_dit.train.experts import requested
from video_dit.typed_config import ConfigError

GiB = 2 ** 30
# One rank's process before any model: python + torch + deepspeed + video_dit imported, a gloo process
# group joined: 0.25 GiB RSS measured by `video-dit bench --suite load` (CPU ranks)
PROCESS_BYTES = int(0.25 * GiB)
# Not measured here (no GPU): what a CUDA context with NCCL takes, of device memory and of host RAM
CUDA_CONTEXT_BYTES = int(0.6 * GiB)
CUDA_HOST_BYTES = int(0.5 * GiB)
# `train.gradient_checkpointing: auto` leaves this share of a rank's capacity unplanned: the plan's error
# (the GPU suite holds it to 10%, the four measured H200 jobs are within 2%) and what the caching
# allocator reserves beyond the live tensors it does not count
AUTO_MARGIN = 0.10


class PlanError(ValueError):
    """A plan that cannot be made as asked; the message names the option or the bucket."""


# ---------------------------------------------------------------- parameter counts (exact)


@dataclass(frozen=True)
class ModelSizes:
    """Parameter counts of the DiT (+ LoRA) as built: numels, bytes at the training dtype."""

    base: int                      # parameters of the DiT itself
    lora: int                      # adapter parameters (0 for a full fine-tune)
    trainable: int
    base_bytes: int                # at the per-parameter dtypes of training (the family's `DiTArch.param_dtypes`)
    trainable_bytes: int
    numels: tuple[int, ...]        # every parameter's numel (ZeRO-3 partitions, persistence)
    itemsizes: tuple[int, ...]     # ... and its bytes per element as trained (float32 islands, masters)
    largest_module: int            # the most elements one module owns (ZeRO-3 gathers per module)
    largest_tensor: int
    frozen_sized: tuple[tuple[int, int], ...] = ()  # (numel, bytes per element) of the DiT's own
    # parameters stored frozen (no master weights): what a frozen expert holds


def model_sizes(dit_config, lora_rank: int | None, dtype: torch.dtype, family, lora_img_emb: bool = False,
                lora_streams: str = "both") -> ModelSizes:
    """Counts of `family`'s DiT (a `families.Family`) built on the meta device (and its LoRA adapters, on the
    trainer's targets: `Family.stream_lora_targets(network.include_img_emb, network.streams)`, one stream's
    only where the job adapts one): nothing allocated."""
    fam = family
    with torch.device("meta"):
        model = fam.arch.cls(dit_config)
        if lora_rank:
            add_lora(model, lora_rank, targets=fam.stream_lora_targets(lora_img_emb, lora_streams))
    param_dtypes = fam.arch.param_dtypes
    # the trainer's storage (`engine.cast_for_training`): trainable float32, frozen bulk in `dtype`,
    # the float32 islands float32
    dtypes = param_dtypes(model, dtype, masters=True)
    base = lora = base_bytes = train_bytes = 0
    frozen_dtypes = param_dtypes(model, dtype)  # a frozen expert's storage: the bulk in `dtype`, islands float32
    numels, itemsizes, frozen_sized, per_module = [], [], [], {}
    for name, p in model.named_parameters():
        n = p.numel()
        numels.append(n)
        itemsizes.append(dtypes[name].itemsize)
        if ".lora_" not in name:
            frozen_sized.append((n, frozen_dtypes[name].itemsize))
        owner = name.rsplit(".", 1)[0]
        per_module[owner] = per_module.get(owner, 0) + n
        nbytes = n * dtypes[name].itemsize
        if ".lora_" in name:
            lora += n
            train_bytes += nbytes
        else:
            base += n
            base_bytes += nbytes
            if not lora_rank:
                train_bytes += nbytes
    return ModelSizes(base=base, lora=lora, trainable=lora if lora_rank else base, base_bytes=base_bytes,
                      trainable_bytes=train_bytes, numels=tuple(numels), itemsizes=tuple(itemsizes),
                      largest_module=max(per_module.values()), largest_tensor=max(numels),
                      frozen_sized=tuple(frozen_sized))


# ---------------------------------------------------------------- activations (derived, see docstring)



# ---------------------------------------------------------------- DeepSpeed state (see docstring)


def zero_config(ds: dict):
    """DeepSpeed's own view of the job's `zero_optimization` block (its defaults filled in)."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    z = dict(ds.get("zero_optimization", {}))
    for key in ("offload_optimizer", "offload_param"):
        z.pop(key, None)  # parsed by DeepSpeed into device objects; the planner reads the Setting
    return DeepSpeedZeroConfig(**z)


@dataclass
class RankMemory:
    """One rank's predicted bytes, by what holds them."""

    parameters: int = 0
    gradients: int = 0
    optimizer: int = 0
    buffers: int = 0        # ZeRO reduce / all-reduce buckets, ZeRO-3's gathered parameters
    activations: int = 0
    host: int = 0           # offloaded state on the host (per rank)

    @property
    def device(self) -> int:
        return self.parameters + self.gradients + self.optimizer + self.buffers + self.activations

    def as_gib(self) -> dict:
        return {k: getattr(self, k) / GiB for k in ("parameters", "gradients", "optimizer", "buffers",
                                                       "activations", "host")} | {"device": self.device / GiB}


def state_memory(sizes: ModelSizes, setting: Setting, world: int, ds: dict, dtype: torch.dtype,
                 cuda: bool, experts: Experts | None = None) -> tuple[RankMemory, RankMemory]:
    """(resident, transient) DeepSpeed memory of one rank (see the module docstring). `resident`
    lives through the whole step after the first; `transient` is what exists only during backward
    (`buffers`, ZeRO-1/2 `gradients`) or at the optimizer step (`optimizer`: its temporaries).
    `experts`: the DiTs of a two-expert job (`Experts`; None: one model)."""
    res, trans = _engine_memory(sizes, setting, world, ds, dtype, cuda)
    if experts is None:
        return res, trans
    return experts.resident(res, sizes, setting, world, ds, dtype), trans


@dataclass(frozen=True)
class Experts:
    """The DiTs of a two-expert job (Wan 2.2 A14B, train/experts.py), as the trainer holds them: one
    DeepSpeed engine per trained expert, each with its own parameters, optimizer state and ZeRO
    buffers, all resident through every step (the inactive expert's too: it only stops computing);
    one expert trains per step, so the activations and the transient buffers are one expert's. A
    one-expert job with previews or validation also loads the other expert frozen
    (`Trainer._build_preview_experts`): under ZeRO-3 partitioned (its base partitions on the device),
    under ZeRO 0-2 on the host (rank 0's alone for previews; every rank's with validation: counted on
    every rank, an upper bound)."""

    trained: tuple[str, ...]
    frozen: int = 0

    def resident(self, one: RankMemory, sizes: ModelSizes, setting: Setting, world: int, ds: dict,
                 dtype: torch.dtype) -> RankMemory:
        n = len(self.trained)
        out = RankMemory(parameters=one.parameters * n, gradients=one.gradients * n, optimizer=one.optimizer * n,
                         buffers=one.buffers * n, activations=one.activations, host=one.host * n)
        if self.frozen:
            if partitioned(setting.zero_stage):
                persist = zero_config(ds).param_persistence_threshold
                frozen = sum(-(-k // world) * b + (k * b if k < persist else 0) for k, b in sizes.frozen_sized)
                if setting.offload_param:
                    out.host += frozen * self.frozen
                else:
                    out.parameters += frozen * self.frozen
            else:
                out.host += sum(k * b for k, b in sizes.frozen_sized) * self.frozen
        return out

    def describe(self) -> str:
        names = " and ".join(e.replace("_", "-") for e in self.trained)
        frozen = ", the other frozen for previews / validation" if self.frozen else ""
        return (f"two experts: {names} trained ({len(self.trained)} DeepSpeed engine(s): parameters, optimizer "
                f"state and ZeRO buffers per expert; activations of one){frozen}")


def job_experts(job) -> Experts | None:
    """The `Experts` of a job (None for a one-model preset), from its keys and, when the model folder is
    on this machine, from what it holds; a folder that is not here is taken to hold both experts."""
    p = job.process
    preset = get_preset(p.model.preset)
    if not preset.two_experts:
        return None
    trained = requested(p.model, preset)
    frozen = 0
    if len(trained) == 1:
        src = p.model.name_or_path
        both = preset_name(src) is not None or not Path(src).exists() or expert_sources(src) is not None
        uses = (p.sample is not None and bool(p.sample.samples) and not p.train.disable_sampling) or \
            p.train.validation_config is not None
        frozen = int(both and uses)
    return Experts(trained, frozen)


def partition_during_backward(sizes: ModelSizes, setting: Setting, ds: dict) -> bool:
    """Whether ZeRO-1/2's transient gradients (`RankMemory.gradients` of `state_memory`'s transient) live
    while the activations do. Under ZeRO-2 with contiguous gradients DeepSpeed 0.19 allocates the gradient
    partition (`grads_in_partition`) at the reduce bucket's first reduction (stage_1_and_2.py:
    `copy_grads_in_partition`, called by `reduce_ipg_grads`), which comes when the next gradient would
    overflow the bucket (`reduce_independent_p_g_buckets_and_remove_grads`; every trainable gradient of
    every rank's partition passes through it) or else in `independent_gradient_partition_epilogue`, after
    the last activation is freed. So only Pt > reduce_bucket_size elements make it during backward.
    ZeRO-1's full gradients and a non-contiguous ZeRO-2's grow as they are made: counted beside the
    activations, as before (an upper bound)."""
    if setting.zero_stage != 2:
        return True
    z = zero_config(ds)
    return not z.contiguous_gradients or sizes.trainable > z.reduce_bucket_size


def adam_temporaries(numel: int, cuda: bool) -> int:
    """Bytes torch's AdamW allocates while it updates a float32 tensor of `numel` elements: on CPU
    ranks the single-tensor implementation holds `exp_avg_sq.sqrt()` and its quotient by the bias correction
    at once (torch/optim/adam.py `_single_tensor_adam`: `denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt)
    .add_(eps)`), two temporaries of the tensor; on CUDA the fused AdamW none."""
    return 0 if cuda else 2 * numel * 4


def _engine_memory(sizes: ModelSizes, setting: Setting, world: int, ds: dict, dtype: torch.dtype,
                   cuda: bool) -> tuple[RankMemory, RankMemory]:
    """`state_memory` of one DeepSpeed engine."""
    z = zero_config(ds)
    N, stage = world, setting.zero_stage
    Pt, Pt_b = sizes.trainable, sizes.trainable_bytes
    s = Pt_b // max(1, Pt)  # gradients and their buckets: the trainable (master) parameters' dtype, float32
    res, trans = RankMemory(), RankMemory()
    if stage == 0:
        res.parameters = sizes.base_bytes + (Pt_b if sizes.lora else 0)
        res.optimizer = 2 * Pt_b
        trans.gradients = Pt_b
        trans.buffers = min(Pt, int(ds.get("allreduce_bucket_size", 5e8))) * s
        trans.optimizer = adam_temporaries(sizes.largest_tensor, cuda)
        return res, trans
    part = -(-Pt // N)
    master = part * 4 * 3  # fp32 master + Adam's two moments (ZeRO-3 without optimizer offload: the
    # master is the float32 partition itself, `engine.alias_fp32_partitions`)
    if stage in (1, 2):
        res.parameters = sizes.base_bytes + (Pt_b if sizes.lora else 0)
        res.optimizer = master
        buckets = 2 if z.overlap_comm else 1
        trans.buffers = z.reduce_bucket_size * s * buckets
        trans.gradients = part * s if stage == 2 else Pt_b
        # the fp32 gradient partition, made while the gradients live; Adam's temporaries come once they are freed
        trans.optimizer = part * 4 + max(0, adam_temporaries(part, cuda) - trans.gradients)
    else:
        persist = z.param_persistence_threshold
        sized = list(zip(sizes.numels, sizes.itemsizes))
        res.parameters = sum(-(-n // N) * b for n, b in sized)
        res.parameters += sum(n * b for n, b in sized if n < persist)
        res.optimizer = master if setting.offload_optimizer else part * 4 * 2
        res.gradients = part * s
        res.buffers = z.reduce_bucket_size * s
        gatherable = sum(n for n in sizes.numels if n >= persist)
        # gathered at once: the module running, what is prefetched (up to max_live_parameters gathered
        # in all) and what DeepSpeed keeps gathered because it is used again within max_reuse_distance
        # elements of the step's trace (bound below). At a partition world size of 1 nothing is gathered:
        # DeepSpeed's all_gather_coalesced / _all_gather return a NoGatherHandle, whose parameter becomes a
        # view of its own partition (`ds_tensor.data.to(device)`, no copy on the same device); only an
        # offloaded partition is copied to the device.
        gathers = N > 1 or setting.offload_param
        trans.buffers = min(gatherable, max(z.prefetch_bucket_size, z.max_live_parameters, z.max_reuse_distance)
                            + sizes.largest_module) * max(sizes.itemsizes) if gathers else 0
        trans.optimizer = part * 4 + adam_temporaries(part, cuda)  # the fp32 gradient partition; the buffer stays
    if setting.offload_optimizer:  # master, moments and gradient partitions live in host buffers
        res.host += res.optimizer + res.gradients + (trans.gradients if stage in (1, 2) else 0)
        trans.host = trans.optimizer
        res.optimizer = res.gradients = trans.optimizer = 0
        if stage in (1, 2):
            trans.gradients = 0
    if setting.offload_param and partitioned(stage):
        res.host += res.parameters
        res.parameters = sum(n * b for n, b in zip(sizes.numels, sizes.itemsizes) if n < z.param_persistence_threshold)
    return res, trans


# ---------------------------------------------------------------- one prediction


@dataclass
class Prediction:
    setting: Setting
    grid: tuple[int, int, int]
    tokens: int
    memory: RankMemory          # at the step's peak
    activations: Activations
    phase: str                  # where the peak is: "backward", "end of backward" or "optimizer step"
    resident: RankMemory        # what lives through the whole step (parameters, optimizer state, ...)

    @property
    def device_bytes(self) -> int:
        return self.memory.device


def tokens_of(cfg, grid) -> int:
    pt, ph, pw = cfg.patch_size
    return (grid[0] // pt) * (grid[1] // ph) * (grid[2] // pw)


def job_inputs(job, preset) -> dict:
    """What of `job` beyond the DiT config its family's activation model reads (`MemoryModel.job_inputs`)."""
    return family_of(preset).memory.job_inputs(job, preset)


def predict(cfg, grid: tuple[int, int, int], setting: Setting, *, world: int, lora_rank: int | None,
            dtype: torch.dtype, ds: dict, cuda: bool, family, inputs: dict, sizes: ModelSizes | None = None,
            lora_img_emb: bool = False, experts: Experts | None = None, fused: bool | None = None) -> Prediction:
    """The per-rank peak of a training step at latents `grid` (F', h, w) under `setting`; `experts`:
    the DiTs of a two-expert job (None: one model); `fused`: the DiT runs its fused kernels (None: on
    CUDA, as `kernels: auto` does when triton imports, which CUDA builds of torch ship with; Wan's DiT
    only); `family`: the model's `families.Family`, whose activation model (`MemoryModel.activations`)
    reads `inputs` (`job_inputs`: what of the job beyond the DiT config it needs)."""
    sizes = sizes or model_sizes(cfg, lora_rank, dtype, family, lora_img_emb)
    act = family.memory.activations(cfg, grid, setting, lora_rank=lora_rank, s=dtype.itemsize,
                                    fused=cuda if fused is None else fused, inputs=inputs)
    res, trans = state_memory(sizes, setting, world, ds, dtype, cuda, experts)
    if not shards_optimizer(setting.zero_stage):
        # ZeRO-0 gradients grow through backward while activations shrink: the peak is at one end
        during = act.peak
        after = trans.gradients + max(trans.buffers, trans.optimizer)
        mem = replace(res, activations=during if during >= after else 0,
                      gradients=0 if during >= after else trans.gradients,
                      buffers=0 if during >= after else trans.buffers,
                      optimizer=res.optimizer + (0 if during >= after else trans.optimizer))
        phase = "backward" if during >= after else "end of backward / step"
        return Prediction(setting, grid, tokens_of(cfg, grid), mem, act, phase, res)
    grads = trans.gradients if not partitioned(setting.zero_stage) else 0  # ZeRO-1/2's, made in backward
    early = partition_during_backward(sizes, setting, ds)
    during = replace(res, activations=act.peak, buffers=res.buffers + trans.buffers,
                     gradients=res.gradients + (grads if early else 0))
    # ZeRO-2 with its gradients in one bucket: the partition is made in the backward epilogue, the bucket still held
    epilogue = replace(res, buffers=res.buffers + trans.buffers, gradients=res.gradients + grads)
    at_step = replace(res, gradients=res.gradients + grads, optimizer=res.optimizer + trans.optimizer)
    phases = [(during, "backward")] + ([] if early else [(epilogue, "end of backward")]) + [(at_step, "optimizer step")]
    mem, phase = max(phases, key=lambda p: p[0].device)  # the first of equal ones
    return Prediction(setting, grid, tokens_of(cfg, grid), mem, act, phase, res)


# ---------------------------------------------------------------- a whole job against a machine


def parse_bucket(text: str) -> tuple[int, int, int]:
    """"81x480x832" (frames x height x width in pixels) -> (81, 480, 832)."""
    try:
        f, h, w = (int(v) for v in text.lower().split("x"))
    except ValueError as exc:
        raise PlanError(f"--bucket {text!r}: expected FRAMESxHEIGHTxWIDTH in pixels, e.g. 81x480x832") from exc
    if min(f, h, w) < 1:
        raise PlanError(f"--bucket {text!r}: frames, height and width must be >= 1")
    return f, h, w


def latent_grid(preset, bucket: tuple[int, int, int]) -> tuple[int, int, int]:
    """Pixel bucket (F, H, W) -> latent grid (F', h, w) of the preset's VAE."""
    f, h, w = bucket
    sp = preset.vae_spatial
    return preset.vae.latent_frames(f), h // sp, w // sp


def job_buckets(job, preset, missing=()) -> list[tuple[tuple[int, int, int], int, str]]:
    """[(pixel bucket (F, H, W), items per epoch, where it comes from)] the job's datasets will
    produce: the scanned folder's bucket histogram; for a dataset in `missing` (its folder is not on
    this machine) or one with no usable item, per resolution the bucket of the resolution's grid with
    the most tokens (every bucket of a resolution has about its area)."""
    out: dict = {}
    for i, d in enumerate(job.process.datasets):
        counts = {}
        if i not in missing:
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # skipped files are the validator's business
                    counts = scan_dataset(d, preset.divisibility, dataset_index=i, verbose=False).bucket_counts()
            except DataError:
                counts = {}
        for b, n in counts.items():
            prev = out.get(tuple(b), (0, ""))[0]
            out[tuple(b)] = (prev + n, "dataset scan")
        if not counts:
            for r in d.resolution:
                # the most pixels the resolution gives, the one nearest 16:9 landscape among equals
                hw = max(candidate_buckets(r, preset.divisibility),
                         key=lambda b: (b[0] * b[1], -abs(math.log(b[1] / b[0] / (16 / 9)))))
                out.setdefault((d.num_frames, *hw), (0, f"largest bucket of resolution {r} (no data here)"))
    return [(b, n, src) for b, (n, src) in sorted(out.items())]


def planned_dtype(job, device: str) -> torch.dtype:
    """The dtype the trainer would train at on `device` (`precision.train_dtype`: bf16 on CUDA, and on CPU
    ranks with `train.cpu_bf16`)."""
    t = job.process.train
    bf16 = t.dtype in ("bf16", "bfloat16") and (device == "cuda" or t.cpu_bf16)
    return torch.bfloat16 if bf16 else torch.float32


def setting_of(job, **changes) -> Setting:
    """The `Setting` a job is configured with; `train.gradient_checkpointing: auto` is every block here (the
    plan narrows it per bucket: `AutoCheckpointing`)."""
    d, t = job.process.deepspeed, job.process.train
    layers = get_preset(job.process.model.preset).dit.num_layers
    blocks = checkpointed_blocks_of(t, layers)
    base = Setting(zero_stage=d.zero_stage, sp=d.sequence_parallel_size, checkpointing=blocks != 0,
                   micro_batch=t.batch_size, offload_optimizer=d.offload_optimizer, offload_param=d.offload_param,
                   recompute=t.recompute_saved, checkpoint_blocks=None if blocks in (None, layers) else blocks)
    return replace(base, **changes)


def auto_checkpointing(job) -> bool:
    """`train.gradient_checkpointing: auto`: the plan chooses the checkpointed blocks per bucket."""
    return checkpointed_blocks_of(job.process.train, 1) is None


def capacity_of(machine: Machine) -> int:
    """Bytes one rank may use on its device: the GPU's memory less the CUDA context, or on CPU ranks
    its share of the node's memory less its process."""
    if machine.device == "cuda":
        if machine.gpu_mem is None:
            raise PlanError("--gpu-mem is needed to plan for GPUs (GiB per GPU, e.g. 80)")
        return int(machine.gpu_mem) - CUDA_CONTEXT_BYTES
    if machine.host_mem is None:
        raise PlanError("--host-mem is needed to plan CPU ranks (GiB per node)")
    return int(machine.host_mem) // machine.ranks_per_node - PROCESS_BYTES


def fewest_checkpointed(predict_at, setting: Setting, layers: int, budget: int) -> tuple[int, Prediction, bool]:
    """(n, its prediction, whether it fits): the fewest checkpointed blocks (the first n of `layers`) under
    `setting` whose planned peak is within `budget` bytes; all of them (and False) when none is.
    `predict_at(setting)` makes a prediction."""
    pred = None
    for n in range(layers + 1):
        pred = predict_at(replace(setting, checkpointing=n > 0, checkpoint_blocks=n))
        if pred.device_bytes <= budget:
            return n, pred, True
    return layers, pred, False


@dataclass(frozen=True)
class CheckpointChoice:
    """What `train.gradient_checkpointing: auto` checkpoints for one bucket."""

    grid: tuple[int, int, int]  # the bucket's latent grid (F', h, w)
    blocks: int                 # checkpointed blocks (the first ones)
    layers: int                 # the DiT's blocks
    prediction: Prediction
    budget: int                 # bytes the choice had to fit in: the capacity less AUTO_MARGIN
    capacity: int
    fits: bool
    device: str

    def describe(self) -> str:
        where = ("CPU ranks: planned against host memory, " if self.device != "cuda" else "") + \
            f"{self.capacity / GiB:.1f} GiB per rank less {AUTO_MARGIN:.0%}"
        f, h, w = self.grid
        line = (f"gradient_checkpointing auto: latents {f}x{h}x{w} ({self.prediction.tokens} tokens): "
                f"{self.blocks} of {self.layers} blocks checkpointed, planned peak "
                f"{self.prediction.device_bytes / GiB:.2f} GiB per rank ({where} = {self.budget / GiB:.1f} GiB)")
        return line if self.fits else line + "; does not fit even with every block checkpointed"


class AutoCheckpointing:
    """`train.gradient_checkpointing: auto` for one job on one machine: per bucket (its latent grid), the
    fewest checkpointed blocks whose planned peak fits a rank's capacity less `AUTO_MARGIN`; on CPU ranks
    the capacity is the host's memory per rank. Choices are remembered per grid."""

    def __init__(self, job, machine: Machine):
        p = job.process
        self.preset = get_preset(p.model.preset)
        self.cfg = self.preset.dit
        self.machine = machine
        self.cuda = machine.device == "cuda"
        self.dtype = planned_dtype(job, machine.device)
        self.lora = p.network.linear if p.network is not None else None
        self.img_emb = bool(p.network is not None and p.network.include_img_emb)
        self.streams = p.network.lora_streams if p.network is not None else "both"  # `network.streams`
        self.ds = ds_config(job, machine.ranks, cuda=self.cuda)
        self.family = family_of(self.preset)
        self.inputs = job_inputs(job, self.preset)
        self.sizes = model_sizes(self.cfg, self.lora, self.dtype, self.family, self.img_emb, self.streams)
        self.experts = job_experts(job)
        self.capacity = capacity_of(machine)
        self.budget = int(self.capacity * (1 - AUTO_MARGIN))
        self.setting = setting_of(job)
        self._choices: dict[tuple[int, int, int], CheckpointChoice] = {}

    def predict(self, grid, setting: Setting) -> Prediction:
        return predict(self.cfg, grid, setting, world=self.machine.ranks, lora_rank=self.lora, dtype=self.dtype,
                       ds=self.ds, cuda=self.cuda, family=self.family, inputs=self.inputs, sizes=self.sizes,
                       experts=self.experts)

    def choose(self, grid) -> CheckpointChoice:
        grid = tuple(int(v) for v in grid)
        if grid not in self._choices:
            n, pred, fits = fewest_checkpointed(lambda s: self.predict(grid, s), self.setting, self.cfg.num_layers,
                                                self.budget)
            self._choices[grid] = CheckpointChoice(grid, n, self.cfg.num_layers, pred, self.budget, self.capacity,
                                                   fits, self.machine.device)
        return self._choices[grid]


_AUTO: dict = {}


def checkpoint_blocks(job, machine: Machine, grid) -> int:
    """How many blocks (the first ones: `VideoDiT.set_checkpointed_blocks`) `train.gradient_checkpointing:
    auto` checkpoints for a bucket whose latents are `grid` (F', h, w), as the trainer's batch has them
    (`batch["latents"].shape[2:]`), on `machine` (`machine_here` in a rank); `checkpoint_choice` says why."""
    return checkpoint_choice(job, machine, grid).blocks


def checkpoint_choice(job, machine: Machine, grid) -> CheckpointChoice:
    """`checkpoint_blocks`' choice with its prediction and budget (`CheckpointChoice.describe`: one line)."""
    key = (id(job), machine)
    if key not in _AUTO or _AUTO[key][0] is not job:
        _AUTO[key] = (job, AutoCheckpointing(job, machine))
    return _AUTO[key][1].choose(grid)


def machine_here(world: int, device) -> Machine:
    """The `Machine` a running rank is part of: `world` ranks on this rank's `device`, as many per node as
    LOCAL_WORLD_SIZE says (the launcher sets it), this node's GPU (or host) memory."""
    device = torch.device(device)
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    nodes = max(1, world // max(1, per_node))
    gpu_mem = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    return Machine(ranks=world, nodes=nodes, device=device.type, gpu_mem=gpu_mem, host_mem=host_ram())


def oom_message(job, grid, measured_peak: int, machine: Machine, step: int | None = None,
                checkpointed: int | None = None) -> str:
    """The one line an out-of-memory step reports: the step, the bucket, the planned and the measured peak
    (`torch.cuda.max_memory_allocated` when it failed), and what would lower it with the plan's figures
    (block checkpointing, ZeRO-3, sequence parallelism, optimizer offload). `grid`: the batch's latent grid
    (F', h, w); `checkpointed`: the blocks checkpointed when it failed (None: as the job says)."""
    where = f"step {step}, " if step is not None else ""
    chooser = AutoCheckpointing(job, machine)
    grid = tuple(int(v) for v in grid)
    cfg, preset = chooser.cfg, chooser.preset
    setting = chooser.setting
    if checkpointed is not None:
        setting = replace(setting, checkpointing=checkpointed > 0, checkpoint_blocks=checkpointed)
    predicted = chooser.predict(grid, setting)
    t, sp = preset.vae.temporal_compression, preset.vae_spatial
    bucket = f"{(grid[0] - 1) * t + 1}x{grid[1] * sp}x{grid[2] * sp}"
    levers = []
    if checkpointed_count(setting, cfg.num_layers) < cfg.num_layers:
        every = replace(setting, checkpointing=True, checkpoint_blocks=None)
        levers.append(("train.gradient_checkpointing: true", every))
        setting_ck = every
    else:
        setting_ck = setting
    if not partitioned(setting.zero_stage):
        levers.append(("deepspeed.zero_stage: 3", replace(setting_ck, zero_stage=3)))
    sps = [n for n in range(setting.sp + 1, cfg.num_heads + 1) if cfg.num_heads % n == 0 and machine.ranks % n == 0]
    if sps:
        levers.append((f"deepspeed.sequence_parallel_size: {sps[0]}", replace(setting_ck, sp=sps[0])))
    if shards_optimizer(setting.zero_stage) and not setting.offload_optimizer:
        levers.append(("deepspeed.offload_optimizer: true", replace(setting_ck, offload_optimizer=True)))
    lower = [(key, chooser.predict(grid, s).device_bytes) for key, s in levers]
    fixes = "; ".join(f"{key} -> {b / GiB:.1f} GiB" for key, b in lower if b < predicted.device_bytes)
    return (f"out of memory: {where}bucket {bucket} ({grid[0]}x{grid[1]}x{grid[2]} latents, {predicted.tokens} tokens), "
            f"{predicted.setting.describe()}: measured peak {measured_peak / GiB:.2f} GiB, planned "
            f"{predicted.device_bytes / GiB:.2f} GiB of {chooser.capacity / GiB:.1f} GiB per rank; what would lower "
            f"it (planned peak): {fixes or 'nothing the plan knows of'}")


@dataclass
class BucketPlan:
    bucket: tuple[int, int, int]
    items: int
    source: str
    tokens: int
    as_configured: Prediction
    fits: bool
    recommended: Prediction | None  # the first setting that fits (smallest SP, then checkpointing, offload)
    max_micro_batch: int            # at the recommended setting (0: none fits)
    why: str = ""                   # when nothing fits
    auto: CheckpointChoice | None = None  # `gradient_checkpointing: auto`: the blocks chosen for this bucket


@dataclass
class HostPlan:
    startup: int    # per node, while the frozen encoders cache and the DiT is set up
    training: int   # per node
    peak_per_rank: int  # one rank's peak RSS over the run (the larger of its start-up and training)
    parts: dict = field(default_factory=dict)


@dataclass
class JobPlan:
    job_name: str
    preset: str
    machine: Machine
    capacity: int
    dtype: torch.dtype
    setting: Setting
    lora_rank: int | None
    sizes: ModelSizes
    buckets: list[BucketPlan]
    host: HostPlan
    experts: Experts | None = None

    @property
    def fits(self) -> bool:
        host_ok = self.machine.host_mem is None or self.host.startup <= self.machine.host_mem
        return all(b.fits for b in self.buckets) and host_ok

    def failures(self) -> list[str]:
        out = []
        for b in self.buckets:
            if not b.fits:
                f, h, w = b.bucket
                fix = (f"; fits with {b.recommended.setting.describe()}" if b.recommended else f"; {b.why}")
                out.append(f"bucket {f}x{h}x{w} ({b.tokens} tokens): {b.as_configured.device_bytes / GiB:.1f} GiB "
                           f"per rank predicted > {self.capacity / GiB:.1f} GiB available{fix}")
        if self.machine.host_mem is not None and self.host.startup > self.machine.host_mem:
            out.append(f"host RAM at start-up: {self.host.startup / GiB:.1f} GiB per node predicted > "
                       f"{self.machine.host_mem / GiB:.1f} GiB")
        return out


def file_parameters(src: str, sub: str, skip=()) -> int | None:
    """Parameters in a model's files, from their headers (`sub`: its folder in a diffusers layout, `skip`:
    key prefixes not loaded); None when `src` is a preset or not on this machine."""
    path = Path(src)
    if preset_name(src) is not None or not path.exists():
        return None
    path = path / sub if (path / sub).is_dir() else path
    try:
        w = open_weights(path)
    except WeightsError:
        return None
    return sum(math.prod(e.shape) for k, e in w.entries.items() if not k.startswith(skip))


def encoder_bytes(job, preset, dtype: torch.dtype) -> dict:
    """Parameter bytes, at `dtype`, of the frozen text encoder(s), VAE (and image encoder) the job loads:
    counted from their files' headers when they are on this machine (`model_sources`, as the trainer finds
    them; the family's `MemoryModel.encoder_files` say where in a folder), else from the preset's
    architectures built on the meta device (`MemoryModel.encoder_parameters`)."""
    memory = family_of(preset).memory
    try:
        spec = spec_of_job(job.process)
        sources = {"vae": spec.vae, "text_encoder": spec.text_encoder, "image_encoder": spec.image_encoder}
    except ConfigError:  # the model folder is not on this machine (yet): the preset's architectures
        own = f"preset:{preset.name}"
        sources = {"vae": own, "text_encoder": own, "image_encoder": own if preset.image_encoder is not None else None}
    counts = {}
    for part, src in sources.items():
        files = memory.encoder_files.get(part)
        if src is None:
            counts[part] = 0
        elif files:
            found = [file_parameters(src, sub, skip) for sub, skip in files]
            counts[part] = None if None in found else sum(found)
        else:
            counts[part] = None  # counted from its architecture only
    missing = [part for part, n in counts.items() if n is None]
    if missing:
        counts.update(memory.encoder_parameters(preset, missing))
    return {part: n * dtype.itemsize for part, n in counts.items()}


def candidate_settings(job, heads: int, world: int):
    """Settings to try, in the order the plan recommends them: the job's ZeRO stage before ZeRO-3;
    within a stage the smallest sequence-parallel degree first; then nothing else, block
    checkpointing (a third more compute), optimizer offload without and with checkpointing (the
    step then runs on the CPU), and last (ZeRO-3) parameter offload."""
    base = setting_of(job, micro_batch=1)
    sps = [n for n in range(1, heads + 1) if heads % n == 0 and world % n == 0]
    levers = ((False, False, False), (True, False, False), (False, True, False), (True, True, False),
              (True, True, True))  # (checkpointing, offload_optimizer, offload_param)
    for stage in dict.fromkeys((base.zero_stage, 3)):
        for sp in sps:
            for ckpt, off_opt, off_par in levers:
                if (off_opt and not shards_optimizer(stage)) or (off_par and not partitioned(stage)):
                    continue
                yield replace(base, zero_stage=stage, sp=sp, checkpointing=ckpt, checkpoint_blocks=None,
                              offload_optimizer=off_opt, offload_param=off_par,
                              recompute=base.recompute or sp > 1)  # see train.recompute_saved


def plan_job(job, machine: Machine, buckets: list[tuple[int, int, int]] | None = None, missing=()) -> JobPlan:
    """Per-bucket predictions of `job` on `machine`, the settings that fit, host RAM per node."""
    if machine.ranks < 1:
        raise PlanError(f"the machine has {machine.ranks} ranks; --gpus, --cpu-ranks or --num_gpus must be >= 1")
    if machine.nodes < 1 or machine.ranks % machine.nodes:
        raise PlanError(f"--nodes {machine.nodes} must be >= 1 and divide the {machine.ranks} ranks")
    p = job.process
    preset = get_preset(p.model.preset)
    cfg = preset.dit
    heads = cfg.num_heads
    sp = p.deepspeed.sequence_parallel_size
    if heads % sp:
        valid = [n for n in range(1, heads + 1) if heads % n == 0]
        raise PlanError(f"deepspeed.sequence_parallel_size={sp} does not divide the model's {heads} heads; "
                        f"accepted: {', '.join(map(str, valid))}")
    if machine.ranks % sp:
        raise PlanError(f"deepspeed.sequence_parallel_size={sp} does not divide the {machine.ranks} ranks")
    try:  # train.global_batch_size: each rank's micro-batch follows from the rank count
        job = job.for_ranks(machine.ranks)
    except ConfigError as exc:
        raise PlanError(str(exc)) from exc
    model = AutoCheckpointing(job, machine)  # the job's predictions (and, with `auto`, its choice per bucket)
    pred = model.predict
    dtype, lora, sizes, capacity = model.dtype, model.lora, model.sizes, model.capacity
    setting, experts, cuda = model.setting, model.experts, model.cuda
    auto = model if auto_checkpointing(job) else None

    for f, h, w in buckets or ():
        d, snap = preset.divisibility, preset.vae.snap_frames
        if snap(f) != f or h % d or w % d:
            raise PlanError(f"--bucket {f}x{h}x{w}: {preset.name} takes frame counts its VAE encodes and sides that "
                            f"are multiples of {d} pixels (e.g. {snap(f)}x{max(d, h // d * d)}x{max(d, w // d * d)})")
    listed = ([(b, 0, "--bucket") for b in buckets] if buckets else job_buckets(job, preset, missing))
    rows = []
    for bucket, items, source in listed:
        grid = latent_grid(preset, bucket)
        choice = auto.choose(grid) if auto is not None else None
        now = choice.prediction if choice is not None else pred(grid, setting)
        recommended, best_b, why = None, 0, ""
        for s in candidate_settings(job, heads, machine.ranks):
            first = pred(grid, s)
            if first.device_bytes <= capacity:
                recommended = first
                break
        if recommended is not None:
            best_b = 1
            while best_b < 256 and pred(grid, replace(recommended.setting, micro_batch=best_b + 1)).device_bytes \
                    <= capacity:
                best_b += 1
        else:
            largest = max(n for n in range(1, heads + 1) if heads % n == 0 and machine.ranks % n == 0)
            last = pred(grid, replace(setting, sp=largest, checkpointing=True, micro_batch=1,
                                      offload_optimizer=shards_optimizer(setting.zero_stage),
                                      offload_param=partitioned(setting.zero_stage)))
            why = (f"does not fit anywhere: even at the largest sequence-parallel degree the heads and ranks allow "
                   f"(SP {largest}) with block checkpointing and offload, {last.device_bytes / GiB:.1f} GiB per rank "
                   f"(activations {last.memory.activations / GiB:.1f} GiB, parameters {last.memory.parameters / GiB:.1f}"
                   f" GiB) > {capacity / GiB:.1f} GiB")
        rows.append(BucketPlan(bucket, items, source, now.tokens, now, now.device_bytes <= capacity, recommended,
                               best_b, why, choice))
    host = host_memory(job, preset, machine, sizes, setting, dtype, cuda, rows, experts)
    return JobPlan(job.name, preset.name, machine, capacity, dtype, setting, lora, sizes, rows, host, experts)


def host_memory(job, preset, machine: Machine, sizes: ModelSizes, setting: Setting, dtype, cuda: bool,
                rows: list[BucketPlan], experts: Experts | None = None) -> HostPlan:
    """Host RAM per node at start-up and during training (see the module docstring; the DiTs of a
    two-expert job are built one after the other, so under ZeRO-3 or on a GPU the set-up peak is one
    expert's, on CPU ranks under ZeRO 0-2 the experts built before stay)."""
    enc = encoder_bytes(job, preset, dtype)
    n = machine.ranks_per_node
    process = PROCESS_BYTES + (CUDA_HOST_BYTES if cuda else 0)
    arch = family_of(preset).arch
    with torch.device("meta"):
        names = dict((k, v.numel()) for k, v in arch.cls(preset.dit).named_parameters())
    group = max(sum(names[k] for k in g) for g in module_groups(names, arch.block_list)) * dtype.itemsize
    if partitioned(setting.zero_stage):
        dit_setup = group  # one module group on rank 0 (the others receive it by broadcast)
    else:
        dit_setup = group if cuda else sizes.base_bytes * (len(experts.trained) if experts else 1)  # on CPU it stays
    # the encoders come to the host first (transformers / our loaders), then go to the device; the
    # text and image encoders are freed after the caches, the VAE stays (previews)
    encoders = enc["text_encoder"] + enc["vae"] + enc["image_encoder"]
    offloaded = max((b.as_configured.memory.host for b in rows), default=0)
    device = max((b.as_configured.device_bytes for b in rows), default=0)
    startup_rank = process + max(encoders, dit_setup + (0 if cuda else enc["vae"]))
    training_rank = process + offloaded + (0 if cuda else enc["vae"] + device)  # CPU: device = host
    return HostPlan(n * startup_rank, n * training_rank, max(startup_rank, training_rank),
                    {"encoders_per_rank": encoders, "text_encoder": enc["text_encoder"], "vae": enc["vae"],
                     "dit_setup_per_rank": dit_setup, "offloaded_per_rank": offloaded})


def format_plan(plan: JobPlan) -> str:
    m = plan.machine
    where = (f"{m.ranks} x GPU ({m.gpu_mem / GiB:.0f} GiB)" if m.device == "cuda" else f"{m.ranks} CPU ranks") + \
        f" on {m.nodes} node(s)" + (f", {m.host_mem / GiB:.0f} GiB host RAM per node" if m.host_mem else "")
    kind = f"LoRA rank {plan.lora_rank}" if plan.lora_rank else "full fine-tune"
    configured = plan.setting.describe()
    if any(b.auto is not None for b in plan.buckets):
        configured = configured.replace("ckpt", "ckpt auto (per bucket, below)", 1)
    s = plan.sizes
    lines = [f"memory plan: {plan.job_name} ({plan.preset}, {kind}, {str(plan.dtype).replace('torch.', '')}) on {where}",
             f"  DiT {s.base / 1e6:,.1f} M parameters, {s.trainable / 1e6:,.1f} M trainable; per rank up to "
             f"{plan.capacity / GiB:.1f} GiB; as configured: {configured}",
             *([f"  {plan.experts.describe()}"] if plan.experts else []),
             f"  {'bucket FxHxW':>14} {'tokens':>7} {'params':>7} {'grads':>6} {'optim':>6} {'buffers':>7} "
             f"{'activ.':>7} {'total':>7}  fits  settings that fit (smallest SP first), largest micro-batch"]
    for b in plan.buckets:
        mem = b.as_configured.memory
        f, h, w = b.bucket
        fix = (f"{b.recommended.setting.describe().replace(', batch 1', '')}, micro-batch <= {b.max_micro_batch}"
               if b.recommended else b.why)
        lines.append(f"  {f'{f}x{h}x{w}':>14} {b.tokens:>7} {mem.parameters / GiB:>7.2f} {mem.gradients / GiB:>6.2f} "
                     f"{mem.optimizer / GiB:>6.2f} {mem.buffers / GiB:>7.2f} {mem.activations / GiB:>7.2f} "
                     f"{mem.device / GiB:>7.2f}  {'yes' if b.fits else 'NO':>4}  {fix}")
    for b in plan.buckets:
        if b.auto is not None:
            lines.append(f"  {b.auto.describe()}")
    host = plan.host
    lines.append(f"  host RAM per node: {host.startup / GiB:.1f} GiB at start-up (per rank: process "
                 f"{(PROCESS_BYTES + (CUDA_HOST_BYTES if m.device == 'cuda' else 0)) / GiB:.2f} + frozen encoders {host.parts['encoders_per_rank'] / GiB:.1f} or DiT set-up "
                 f"{host.parts['dit_setup_per_rank'] / GiB:.1f}), {host.training / GiB:.1f} GiB while training")
    return "\n".join(lines)


def plan_summary(plan: JobPlan) -> dict:
    """The plan's figures as JSON-able data."""
    def pred(p: Prediction | None):
        if p is None:
            return None
        return {"setting": p.setting.describe(), "phase": p.phase, **p.memory.as_gib()}
    return {"job": plan.job_name, "preset": plan.preset, "dtype": str(plan.dtype), "capacity_gib": plan.capacity / GiB,
            "machine": {"ranks": plan.machine.ranks, "nodes": plan.machine.nodes, "device": plan.machine.device,
                        "gpu_mem_gib": (plan.machine.gpu_mem or 0) / GiB, "host_mem_gib": (plan.machine.host_mem or 0) / GiB},
            "parameters": plan.sizes.base, "trainable": plan.sizes.trainable, "fits": plan.fits,
            "experts": None if plan.experts is None else {"trained": list(plan.experts.trained),
                                                          "frozen": plan.experts.frozen},
            "host_startup_gib": plan.host.startup / GiB, "host_training_gib": plan.host.training / GiB,
            "buckets": [{"bucket": list(b.bucket), "tokens": b.tokens, "items": b.items, "source": b.source,
                         "fits": b.fits, "as_configured": pred(b.as_configured), "recommended": pred(b.recommended),
                         "max_micro_batch": b.max_micro_batch, "why": b.why} for b in plan.buckets]}


def preflight(job, launcher_args: list[str]) -> tuple[str, list[str]]:
    """(the plan's table, what does not fit) for `job` started by `train.sh` with `launcher_args`."""
    try:
        machine = machine_of(placement(launcher_args))
    except DeviceError as exc:
        raise PlanError(str(exc)) from exc
    plan = plan_job(job, machine)
    return format_plan(plan), plan.failures()


def load_job_for_plan(path: str):
    """(job, indices of datasets whose folder is not on this machine) of a job YAML. A plan is made
    before the data is copied to the machine it is made on: a missing dataset folder is replaced by
    an empty stand-in for the parse (its buckets then come from its resolution, `job_buckets`)."""
    raw = read_yaml(path)
    missing = set()
    if isinstance(raw, dict):
        raw = copy.deepcopy(raw)
        datasets = raw_process(raw).get("datasets")
        for i, d in enumerate(datasets if isinstance(datasets, list) else []):
            if isinstance(d, dict) and d.get("folder_path") and not Path(str(d["folder_path"])).is_dir():
                stand_in = Path(tempfile.mkdtemp(prefix="video_dit_plan_"))
                Image.new("RGB", (8, 8)).save(stand_in / "stand_in.png")
                d["folder_path"] = str(stand_in)
                missing.add(i)
    return parse_job(raw, str(path)), missing
