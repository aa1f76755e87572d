"""Weights out of a DeepSpeed engine: the LoRA file (ComfyUI keys, shared with ai-toolkit) and, for a
full fine-tune, a saved model folder (`video_dit.models.saved`, the layout the ai-toolkit arch writes too).

Under ZeRO-3 every rank holds 1/N of each parameter: all ranks gather (collective), rank 0 writes.
The full export gathers one top-level module (one DiT block) at a time, so no rank ever holds more
than one block beyond its own shard.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

from video_dit.lora import lora_state_dict, save_lora, to_comfy
from video_dit.models.layouts import write_sources
from video_dit.models.saved import SHARD_BYTES, write_dit
from video_dit.parallel.zero import gathered



def lora_export_state(module, zero_stage: int) -> dict[str, torch.Tensor]:
    """Native LoRA keys -> full CPU tensors (gathered under ZeRO-3; every rank must call)."""
    params = [p for n, p in module.named_parameters() if ".lora_" in n]
    with gathered(params, zero_stage):
        return {k: v.detach().to("cpu", copy=True) for k, v in lora_state_dict(module).items()}


def export_lora(module, zero_stage: int, path: Path, alpha: float, dtype: torch.dtype, metadata: dict,
                comfy=to_comfy) -> Path | None:
    """Write the LoRA of `module` to `path` (rank 0) in the family's ComfyUI keys (`comfy`: its
    `lora_to_comfy`); every rank must call. Returns the path on rank 0."""
    sd = lora_export_state(module, zero_stage)
    if dist.get_rank() != 0:
        return None
    return save_lora(path, {k: v.to(dtype) for k, v in sd.items()}, alpha, metadata, comfy=comfy)


def _gathered_state(module, zero_stage: int, dtype: torch.dtype, storage):
    """Yield (key, full CPU tensor) for `module`'s state dict, one top-level child (one block) at a
    time, each at the dtype a DiT stored in `dtype` holds it (`storage`, the family's `param_dtypes`:
    a bf16 / fp16 file keeps the float32 islands float32, so a trained time MLP or modulation table is
    not rounded)."""
    dtypes = storage(module, dtype)

    def out(key, t):
        return t.detach().to("cpu", dtype=dtypes.get(key, dtype), copy=True)

    own = {n: t for n, t in module.named_parameters(recurse=False)}
    own.update({n: b for n, b in module.named_buffers(recurse=False)})
    with gathered(list(module.parameters(recurse=False)), zero_stage):
        for n, t in own.items():
            yield n, out(n, t)
    for name, child in module.named_children():
        if isinstance(child, torch.nn.ModuleList):
            for i, sub in enumerate(child):
                with gathered(list(sub.parameters()), zero_stage):
                    for k, v in sub.state_dict().items():
                        yield f"{name}.{i}.{k}", out(f"{name}.{i}.{k}", v)
        else:
            with gathered(list(child.parameters()), zero_stage):
                for k, v in child.state_dict().items():
                    yield f"{name}.{k}", out(f"{name}.{k}", v)


def export_full(module, zero_stage: int, folder: Path, dtype: torch.dtype, metadata: dict,
                shard_bytes: int = SHARD_BYTES, sources: dict | None = None, *, storage,
                config_json=asdict) -> Path | None:
    """One DiT's folder of a saved model (`video_dit.models.saved`: sharded native safetensors + index +
    config.json) in `folder` (rank 0 writes, through `<folder>.tmp` and a rename); every rank must call.
    `sources` (preset, VAE, text encoder, the previews' sampling settings) goes to `video_dit_sources.json`
    beside them, so `video-dit sample --model FOLDER` needs no other flag. `storage`: the family's
    `param_dtypes` (`DiTArch.param_dtypes`); `config_json`: its `Family.config_json`."""
    rank0 = dist.get_rank() == 0
    tmp = folder.with_name(folder.name + ".tmp")
    if rank0:
        shutil.rmtree(tmp, ignore_errors=True)
    items = _gathered_state(module, zero_stage, dtype, storage)  # every rank gathers; rank 0 keeps
    if not rank0:
        for _ in items:
            pass
        return None
    write_dit(tmp, items, module.config, metadata, shard_bytes, config_json=config_json)
    if sources is not None:
        write_sources(tmp, sources)
    if folder.exists():
        shutil.rmtree(folder)
    os.replace(tmp, folder)
    return folder


def point_latest(link: Path, target: Path) -> None:
    """`link` -> `target`: a copy for a file (small LoRA), a relative symlink for a folder; atomic."""
    tmp = link.with_name(f".{link.name}.tmp{os.getpid()}")
    if target.is_dir():
        if tmp.is_symlink() or tmp.exists():
            tmp.unlink()
        os.symlink(os.path.relpath(target, link.parent), tmp)
    else:
        shutil.copyfile(target, tmp)
    if link.is_dir() and not link.is_symlink():
        shutil.rmtree(link)
    os.replace(tmp, link)
