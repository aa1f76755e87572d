"""Build the DiT a job trains: `build_dit`, the one function every trainer path calls per DiT, then
`make_trainable`, the fixed order that readies it for training.

    build_dit(source, preset=, zero_stage=, dtype=, device=, seed=, ds_config=) -> the family's DiT

ZeRO 0-2: the family's `load_dit` (every rank holds the whole model; its tensors read one module at a time).
ZeRO-3: `parallel/partition.py` (no rank ever holds the whole model; partitioned module by module).
Either way the weights are checked against the job's preset before any tensor is read.
"""

from __future__ import annotations

import os
import re

import torch

from video_dit.families import family_of
from video_dit.diffusion.experts import EXPERTS
from video_dit.lora import add_lora, start_from
from video_dit.models.layouts import preset_name
from video_dit.models.weights import check_matches_preset
from video_dit.parallel.partition import build_partitioned
from video_dit.parallel.sequence import attach
from video_dit.parallel.zero import partitioned
from video_dit.train.config import checkpointed_blocks_of
from video_dit.train.precision import cast_for_training
from video_dit.typed_config import ConfigError


def build_dit(source: str | os.PathLike, preset=None, *, zero_stage: int = 0, dtype: torch.dtype | None = None,
              device=None, seed: int = 0, ds_config: dict | None = None, config=None, family=None):
    """The DiT of `source` (`preset:NAME`, a diffusers / original / ComfyUI folder or file, as the
    family's `load_dit` reads), checked against `preset` (a `Preset`: the job's `model.preset`) when
    given. `family`: the model family (`families.Family`; the preset's, when a preset is given: one of the
    two is required).

    zero_stage 3 builds it partitioned (`parallel/partition.py`): every rank must call, with
    torch.distributed initialised and `ds_config` the job's DeepSpeed JSON (the dict that
    `deepspeed.initialize` will get: it carries the parameter offload and persistence settings).
    dtype None keeps the stored dtype (uniform), as `load_dit`. Raises `WeightsError` naming the
    source and the first mismatching keys before any tensor is read.
    """
    family = family_of(preset) if preset is not None else family
    if family is None:
        raise ValueError(f"build_dit({source!r}): pass preset= or family= (whose loader reads it)")
    if not partitioned(zero_stage):
        dit = family.load_dit(source, dtype=dtype, device=device, config=config, seed=seed)
        if preset is not None:
            check_matches_preset(dit, preset, str(source), family.arch.cls)
        return dit
    if ds_config is None:
        raise ValueError("build_dit(zero_stage=3) needs ds_config, the job's DeepSpeed JSON")
    name = preset_name(source)
    if name is not None and config is None:  # a preset's seeded init: its own DiT config
        config = (preset if preset is not None else family.presets[name]).dit
    return build_partitioned(str(source), preset, dtype, seed, ds_config, config, family.arch)


def expert_lora(path: str, expert: str | None) -> str:
    """The LoRA file of `expert` of a two-expert pair named like `path` (`NAME_high_noise.safetensors` /
    `NAME_low_noise.safetensors`, the names both trainers export); `path` itself for one model or a file
    not named for an expert."""
    for name in EXPERTS:
        if expert is not None and path.endswith(f"_{name}.safetensors"):
            return path[: -len(f"_{name}.safetensors")] + f"_{expert}.safetensors"
    return path


def make_trainable(dit, process, dtype: torch.dtype, sp_info=None, *, family, expert: str | None = None):
    """The trainer's fixed order after the build (at `precision.build_dtype(dtype, lora)`), in place: the
    attention backend; LoRA adapters (peft, `network`: the family's targets, of one stream with
    `network.streams`, with `pretrained_lora_path` also the file's modules, started from it; `expert`: a
    two-expert job's, whose file of a pair it reads) or the whole DiT trainable; the storage for
    training in `dtype` (`precision.cast_for_training`: trainable parameters float32, the frozen bulk
    in `dtype`, the float32 islands float32); block checkpointing (`train.gradient_checkpointing`: every
    block, none, the first N, or for "auto" every block until the trainer sets each bucket's choice,
    `plan.checkpoint_blocks`); then sequence parallelism (after checkpointing: the seam recomputes
    attention in backward unless every block is checkpointed); then compilation of each block
    (`train.compile`; last, as torchtitan orders it: checkpointing, then compile). `family`: the
    model family, whose LoRA targets the adapters go on."""
    dit.set_attention_backend(process.model.attention_backend)
    net = process.network
    # the family's targets, of the streams `network.streams` names (all of them by default)
    targets = family.stream_lora_targets(net.include_img_emb, net.lora_streams) if net is not None else None
    if net is not None and net.pretrained_lora_path:  # a LoRA file to start from: its modules join the job's
        path = expert_lora(net.pretrained_lora_path, expert)
        start_from(path, dit, net.linear, net.alpha, targets, from_file=family.lora_from_file,
                   key="config.process[0].network.pretrained_lora_path", dropout=net.dropout)
        check_streams(dit, family, net, path)
    elif net is not None:
        add_lora(dit, net.linear, net.alpha, dropout=net.dropout, targets=targets)
    else:
        dit.requires_grad_(True)
    cast_for_training(dit, dtype, family.arch)
    dit.set_recompute_saved(process.train.recompute_saved)
    blocks = checkpointed_blocks_of(process.train, len(dit.blocks))
    if blocks != 0:
        dit.enable_gradient_checkpointing(blocks=blocks)  # None ("auto"): every block, until a bucket's choice
    if sp_info is not None:
        attach(dit, sp_info)  # dit.seq_parallel: Ulysses attention when sequence_parallel_size > 1
    if compiles(process, dit.device):
        dit.compile_blocks()  # compiled at the first step (the trainer reports that step's time)
    return dit


def check_streams(dit, family, net, path: str) -> None:
    """A LoRA file started from (`pretrained_lora_path`) brings its own modules: under `network.streams` other
    than both, one outside the stream would train it after all. Refused, naming the key (the file's modules
    are known only once it is read, at the build)."""
    only = family.stream_modules(net.lora_streams)
    if only is None:
        return
    adapted = sorted({n.split(".lora_A.")[0] for n, _ in dit.named_parameters() if ".lora_A." in n})
    outside = [m for m in adapted if not re.fullmatch(only, m)]
    if outside:
        raise ConfigError("config.process[0].network.pretrained_lora_path",
                          f"{path} holds LoRA on {len(outside)} modules outside the {net.lora_streams} stream "
                          f"(network.{net.streams_key}: {net.lora_streams}), e.g. {', '.join(outside[:3])}; "
                          f"accepted: a file of that stream's modules, or network.streams: both")


def compiles(process, device: torch.device) -> bool:
    """Whether the job's blocks are compiled (`train.compile`): true / false as set; auto on GPU ranks
    under ZeRO 0-2 without sequence parallelism, where torch.compile measured faster (ZeRO-3's gather
    hooks and the sequence-parallel all-to-all break its graphs)."""
    c = process.train.compile
    if c != "auto":
        return bool(c)
    d = process.deepspeed
    return device.type == "cuda" and not partitioned(d.zero_stage) and d.sequence_parallel_size == 1
