"""The one LoRA file format, shared by the DeepSpeed trainer, the ai-toolkit adapter and the sampler.

On the model, LoRA is peft's (`inject_adapter_in_model`: the model keeps its class and names, each
targeted `nn.Linear` gains `lora_A` / `lora_B`), on the modules a family's regex names
(`Family.lora_targets`). In a file, keys follow ComfyUI's convention:

    diffusion_model.blocks.0.self_attn.q.lora_A.weight   (rank, in)
    diffusion_model.blocks.0.self_attn.q.lora_B.weight   (out, rank)
    diffusion_model.blocks.0.self_attn.q.alpha           scalar; the update is B @ A * alpha / rank

with string metadata (`format`, `base_preset`, `rank`, `alpha`, `step`, ...). Each family's parameter
names are its original checkpoint names, so a native module path maps to ComfyUI's `diffusion_model.`
path (`to_comfy`); a family whose ComfyUI keys differ (HunyuanVideo 1.5's fused q / k / v) converts
both ways (`Family.lora_to_comfy`, `Family.lora_from_file`).

What a LoRA may target, one definition per family for both trainers, `video-dit sample`, resume and ComfyUI:
any `nn.Linear` of its DiT whose adapter the family's file keys write and read back unchanged
(`check_targets`: `Family.lora_to_comfy` then `Family.lora_from_file`; HunyuanVideo 1.5's fused q / k / v need
all three of a stream). Our trainer's `network` block adapts the family's default set (`Family.lora_targets`),
ai-toolkit's network whatever its options pick (every Linear of the blocks by default, `Family.arch.block_list`;
`transformer_only: false` every Linear of the DiT), each checked by `check_targets` before a step. Loading a
file adds adapters on exactly the modules it holds (`load_lora`), whichever target set it was trained with; a
file starting our trainer's LoRA (`network.pretrained_lora_path`) adds its modules to the job's
(`start_from`).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch
from torch import nn

from video_dit.models.weights import WeightsError, read_state_dict

FILE_FORMAT = "video_dit.lora.v1"
_PREFIXES = ("diffusion_model.", "transformer.", "base_model.model.", "model.diffusion_model.")
_LORA_KEY = re.compile(r"^(?P<module>.+)\.(?P<kind>lora_A|lora_B)(\.default)?\.weight$")


def add_lora(model: nn.Module, rank: int, alpha: float | None = None, *, targets: str,
             dropout: float = 0.0) -> nn.Module:
    """Inject peft LoRA adapters into `model` in place (class and names unchanged) on the Linears whose
    names fully match the regex `targets` (the family's, `Family.lora_targets`); `alpha` defaults to
    `rank` (scale 1). Only the adapters require grad afterwards."""
    from peft import LoraConfig, inject_adapter_in_model

    if rank <= 0:
        raise ValueError(f"LoRA rank must be > 0, got {rank}")
    config = LoraConfig(r=rank, lora_alpha=float(alpha if alpha is not None else rank),
                        target_modules=targets, lora_dropout=dropout, bias="none")
    from peft.tuners.tuners_utils import BaseTunerLayer

    model.requires_grad_(False)
    inject_adapter_in_model(config, model)
    for name, p in model.named_parameters():
        p.requires_grad_(".lora_" in name)
    for module in model.modules():
        # The adapters see their input as the base Linear does: a bf16 DiT computes under autocast,
        # which runs float32 adapters in bf16 anyway; peft's own cast to the adapter dtype would keep
        # a second (float32 -> bf16) copy of every adapted Linear's input for backward.
        if isinstance(module, BaseTunerLayer):
            module.cast_input_dtype_enabled = False
    model._lora_rank, model._lora_alpha = rank, float(config.lora_alpha)
    return model


def has_lora(model: nn.Module) -> bool:
    return any(".lora_A." in n for n, _ in model.named_parameters())


def lora_state_dict(model_or_sd) -> dict[str, torch.Tensor]:
    """Adapter weights under native keys `<module>.lora_A.weight` / `<module>.lora_B.weight`.

    Accepts a model or an already-gathered full state dict (ZeRO-3 exports gather first)."""
    sd = model_or_sd.state_dict() if isinstance(model_or_sd, nn.Module) else model_or_sd
    out = {}
    for key, value in sd.items():
        m = _LORA_KEY.match(key)
        if m:
            out[f"{m['module']}.{m['kind']}.weight"] = value.detach()
    return out


def to_comfy(sd: dict[str, torch.Tensor], alpha: float) -> dict[str, torch.Tensor]:
    """Native adapter keys -> ComfyUI keys with one `.alpha` per module."""
    out = {}
    for key, value in sd.items():
        m = _LORA_KEY.match(key)
        if not m:
            raise KeyError(f"not a LoRA key: {key!r}")
        out[f"diffusion_model.{m['module']}.{m['kind']}.weight"] = value
        out[f"diffusion_model.{m['module']}.alpha"] = torch.tensor(float(alpha))
    return out


def from_comfy(sd: dict[str, torch.Tensor], source: str = "LoRA", from_file=None) -> tuple[dict[str, torch.Tensor], float, int]:
    """ComfyUI (`diffusion_model.`), ai-toolkit/peft (`transformer.`, `base_model.model.`) keys ->
    (native adapter keys, alpha, rank). Files without `.alpha` (peft format) mean alpha = rank.
    `from_file`: the family's conversion of its file keys to native ones (`Family.lora_from_file`: e.g.
    HunyuanVideo 1.5's fused `<stream>_attn_qkv` adapters split into q / k / v); None: the keys are native."""
    sd = {_strip(k): v for k, v in sd.items()}
    if from_file is not None:
        try:
            sd = from_file(sd, source)
        except ValueError as exc:
            raise WeightsError(str(exc)) from exc
    native, alphas = {}, set()
    for key, value in sd.items():
        if key.endswith(".alpha"):
            alphas.add(float(value))
            continue
        m = _LORA_KEY.match(key)
        if not m:
            raise WeightsError(f"{source}: unexpected key {key!r} (expected <module>.lora_A.weight, "
                               "<module>.lora_B.weight or <module>.alpha)")
        native[f"{m['module']}.{m['kind']}.weight"] = value
    ranks = {v.shape[0] for k, v in native.items() if k.endswith("lora_A.weight")}
    if len(ranks) != 1 or len(alphas) > 1:
        raise WeightsError(f"{source}: expected one rank and one alpha for all modules, got ranks "
                           f"{sorted(ranks)} and alphas {sorted(alphas)}")
    rank = ranks.pop()
    return native, (alphas.pop() if alphas else float(rank)), rank


def save_lora(path, model_or_sd, alpha: float, metadata: dict | None = None, comfy=to_comfy) -> Path:
    """Write the adapters of `model_or_sd` as a ComfyUI-keyed safetensors file (atomic rename); `comfy`:
    the family's native -> ComfyUI key conversion (`Family.lora_to_comfy`; `to_comfy`: names as they are)."""
    from safetensors.torch import save_file

    native = lora_state_dict(model_or_sd)
    if not native:
        raise ValueError(f"{path}: the model has no LoRA adapters to save")
    rank = next(v.shape[0] for k, v in native.items() if k.endswith("lora_A.weight"))
    meta = {"format": FILE_FORMAT, "rank": str(rank), "alpha": str(float(alpha))}
    meta.update({k: str(v) for k, v in (metadata or {}).items()})
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in comfy(native, alpha).items()}
    save_file(tensors, str(tmp), metadata=meta)
    os.replace(tmp, path)
    return path


def read_lora(path, from_file=None) -> tuple[dict[str, torch.Tensor], float, int, dict[str, str]]:
    """(native adapter keys, alpha, rank, metadata) of a LoRA file; `from_file`: as `from_comfy`'s."""
    from safetensors import safe_open

    sd = read_state_dict(path)
    metadata = {}
    if str(path).endswith(".safetensors"):
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
    native, alpha, rank = from_comfy(sd, source=str(path), from_file=from_file)
    return native, alpha, rank, metadata


def _strip(key: str) -> str:
    for prefix in _PREFIXES:
        if key.startswith(prefix):
            return key[len(prefix):]
    return key


def check_targets(modules, to_comfy=to_comfy, from_file=None, where: str = "LoRA") -> None:
    """Whether a LoRA on the native `modules` (Linear module names) can be written in the family's file keys
    (`to_comfy`: `Family.lora_to_comfy`) and read back onto the same modules (`from_file`:
    `Family.lora_from_file`); a `ValueError` naming `where` and what the file keys cannot hold otherwise."""
    native = {}
    if not modules:
        return
    for m in modules:
        native[f"{m}.lora_A.weight"], native[f"{m}.lora_B.weight"] = torch.ones(1, 1), torch.ones(1, 1)
    try:
        back, _, _ = from_comfy(to_comfy(native, 1.0), where, from_file)
    except (ValueError, KeyError, WeightsError) as exc:
        raise ValueError(f"{where}: a LoRA file cannot hold adapters on these modules: {exc}") from exc
    if set(back) != set(native):
        lost = sorted({k.rsplit(".", 2)[0] for k in set(native) ^ set(back)})
        raise ValueError(f"{where}: the family's LoRA file keys do not read back onto the same modules: "
                         f"{', '.join(lost[:6])}")


def start_from(path, model: nn.Module, rank: int, alpha: float, targets: str, from_file=None,
               key: str = "network.pretrained_lora_path", dropout: float = 0.0) -> nn.Module:
    """Adapters of rank `rank`, alpha `alpha` on the `targets` regex's modules and every module the LoRA file
    `path` holds (whatever targets it was trained with), those of the file starting from its update (its
    lora_B rescaled by its alpha / `alpha`: the same B A alpha / rank); the others from peft's init. A file of
    another rank, or with modules `model` lacks, is a `WeightsError` naming `key`, the file and the keys."""
    native, file_alpha, file_rank, _ = read_lora(path, from_file)
    if file_rank != rank:
        raise WeightsError(f"{key}: {path} has rank {file_rank}, the job's network.linear is {rank}; accepted: "
                           f"network.linear: {file_rank}")
    modules = sorted({k.rsplit(".", 2)[0] for k in native})
    linears = {name for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    absent = [m for m in modules if m not in linears]
    if absent:
        raise WeightsError(f"{key}: {path} holds LoRA on {len(absent)} modules this model does not have: "
                           f"{', '.join(absent[:6])}")
    add_lora(model, rank, alpha, targets="|".join([f"({targets})", *(re.escape(m) for m in modules)]),
             dropout=dropout)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in native.items():
            module, kind = name.rsplit(".", 2)[0], name.rsplit(".", 2)[1]
            value = value.float() * (file_alpha / alpha) if kind == "lora_B" else value
            params[f"{module}.{kind}.default.weight"].copy_(value)
    return model


def load_lora(path, model: nn.Module, from_file=None) -> nn.Module:
    """Load a LoRA file into `model`. A model without adapters gets them, of the file's rank and alpha, on
    exactly the modules the file holds (whatever target set it was trained with); a model with adapters
    must have the file's rank, alpha and modules. `from_file`: the family's key conversion (`from_comfy`).

    A file made for another model (modules it does not have, other shapes) raises `WeightsError` naming
    the file and the first mismatching keys."""
    native, alpha, rank, _ = read_lora(path, from_file)
    modules = {k.rsplit(".", 2)[0] for k in native}
    if not has_lora(model):
        present = modules & {name for name, m in model.named_modules() if isinstance(m, nn.Linear)}
        if present:  # the file's modules this model has; the others are named below
            add_lora(model, rank, alpha, targets="|".join(re.escape(m) for m in sorted(present)))
    elif (model._lora_rank, model._lora_alpha) != (rank, alpha):
        raise WeightsError(f"{path}: rank/alpha {rank}/{alpha} differ from the model's adapters "
                           f"{model._lora_rank}/{model._lora_alpha}")
    expected = lora_state_dict(model)
    missing = sorted(set(expected) - set(native))
    unexpected = sorted(set(native) - set(expected))
    wrong = [f"{k}: file {tuple(native[k].shape)} vs model {tuple(expected[k].shape)}"
             for k in sorted(set(expected) & set(native)) if native[k].shape != expected[k].shape]
    if missing or unexpected or wrong:
        lines = [f"{path}: LoRA does not fit this model"]
        for label, keys in (("missing", missing), ("unexpected", unexpected), ("wrong shape", wrong)):
            if keys:
                lines.append(f"  {len(keys)} {label}: {', '.join(keys[:6])}")
        raise WeightsError("\n".join(lines))
    params = dict(model.named_parameters())
    with torch.no_grad():
        for key, value in native.items():
            module, kind = key.rsplit(".", 2)[0], key.rsplit(".", 2)[1]
            params[f"{module}.{kind}.default.weight"].copy_(value)
    return model
