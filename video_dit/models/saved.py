"""What a saved full fine-tune folder holds, whichever trainer wrote it (our DeepSpeed trainer's exports,
the ai-toolkit arch's `save_model`): one layout, written here and nowhere else, read by every front end
through `video_dit.spec` (`video-dit sample --model`, either trainer's `name_or_path`, ai-toolkit's resume).

    FOLDER/                                     one DiT
        diffusion_pytorch_model-0000i-of-0000n.safetensors   the family's native tensor names, at the save dtype
        diffusion_pytorch_model.safetensors.index.json      but its float32 islands (`DiTArch.param_dtypes`)
        config.json                             the DiT config (the family's config dataclass, `asdict`)
        video_dit_sources.json                  preset, VAE, encoders, i2v mode, sampling; paths absolute
                                                (`layouts.SOURCES_FILE`)
    FOLDER/                                     two experts (Wan 2.2 A14B)
        high_noise_model/  low_noise_model/     each a one-DiT folder without the sources
        video_dit_sources.json                  (`layouts.EXPERT_FOLDERS["original"]`: Wan's own names)

A trainer adds what its own resume reads (the arch: ai-toolkit's `aitk_meta.yaml`). ai-toolkit names the
folder of a full fine-tune `<name>_<step>.safetensors/` (its LoRA file's name); ours `<name>_<step>/`, with
`<name>/` the latest; both are folders of this layout.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Iterable

import torch

from video_dit.models.layouts import EXPERT_FOLDERS, write_sources

SHARD_BYTES = 2 * 2 ** 30
WEIGHTS_INDEX = "diffusion_pytorch_model.safetensors.index.json"


def dit_folder(folder: str | os.PathLike, expert: str | None) -> Path:
    """Where one DiT of a saved model lives: `folder` itself (one model), or its expert's subfolder."""
    return Path(folder) if expert is None else Path(folder) / EXPERT_FOLDERS["original"][expert]


def write_dit(folder: str | os.PathLike, items: Iterable[tuple[str, torch.Tensor]], config, metadata: dict,
              shard_bytes: int = SHARD_BYTES, config_json=asdict) -> Path:
    """One DiT's weights (`items`: (native name, CPU tensor at the dtype it is stored in), any order) as
    safetensors shards of at most `shard_bytes` + their index + `config.json` (`config_json(config)`: the
    family's `Family.config_json`, what its `dit_config` reads back) in `folder` (created)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, tensor in items:
        nbytes = tensor.numel() * tensor.element_size()
        if size and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = tensor.contiguous()
        size += nbytes
    weight_map = {}
    meta = {k: str(v) for k, v in metadata.items()}
    for i, shard in enumerate(shards):
        name = f"diffusion_pytorch_model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(folder / name), metadata=meta)
        weight_map.update({k: name for k in shard})
    total = sum(t.numel() * t.element_size() for s in shards for t in s.values())
    (folder / WEIGHTS_INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                   indent=1))
    (folder / "config.json").write_text(json.dumps(config_json(config), indent=1))  # tuples become lists
    return folder


def stored_state(dit: torch.nn.Module, dtype: torch.dtype, storage) -> Iterable[tuple[str, torch.Tensor]]:
    """(name, CPU tensor) of a whole DiT's state dict (LoRA adapters left out) at `dtype`, its float32 islands
    float32 (`storage`: the family's `DiTArch.param_dtypes`)."""
    dtypes = storage(dit, dtype)
    for key, value in dit.state_dict().items():
        if ".lora_" not in key:
            yield key, value.detach().to("cpu", dtypes.get(key, dtype), copy=True)


def write_model(folder: str | os.PathLike, dits: dict, dtype: torch.dtype, family, metadata: dict,
                sources: dict) -> Path:
    """A whole saved model from DiTs in memory (`dits`: {None: dit} or {expert: dit} of a two-expert model;
    the ai-toolkit arch's save) of `family` (its float32 islands, its config.json): each one's weights
    (`write_dit`) in its place (`dit_folder`), and the sources."""
    for expert, dit in dits.items():
        write_dit(dit_folder(folder, expert), stored_state(dit, dtype, family.arch.param_dtypes), dit.config,
                  metadata, config_json=family.config_json)
    write_sources(folder, sources)
    return Path(folder)
