"""The one LoRA file format, shared by the DeepSpeed trainer and the ai-toolkit adapter.

On the model, LoRA is peft's (`inject_adapter_in_model`: the model keeps its class and names, each
targeted `nn.Linear` gains `lora_A` / `lora_B`). In a file, keys follow ComfyUI's convention for Wan:

    diffusion_model.blocks.0.self_attn.q.lora_A.weight   (rank, in)
    diffusion_model.blocks.0.self_attn.q.lora_B.weight   (out, rank)
    diffusion_model.blocks.0.self_attn.q.alpha           scalar; the update is B @ A * alpha / rank

with string metadata (`format`, `base_preset`, `rank`, `alpha`, `step`, ...). Because our parameter
names are the original Wan names, a native module path maps 1:1 to ComfyUI's `diffusion_model.` path.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch
from torch import nn

from video_dit.models.hunyuan15_convert import hy15_lora_split
from video_dit.models.weights import WeightsError, read_state_dict

# The blocks' attention and FFN Linears (native Wan names), with the image branch's k_img / v_img of
# Wan 2.1 I2V / FLF2V (absent, so never matched, in other models).
LORA_TARGETS = r"blocks\.\d+\.((self_attn|cross_attn)\.(q|k|v|o)|cross_attn\.(k_img|v_img)|ffn\.(0|2))"
# Opt-in (`network.include_img_emb`): also the image-embedding MLP's two Linears, img_emb.proj.1 / .3.
IMG_EMB_TARGETS = r"img_emb\.proj\.(1|3)"


def lora_targets(include_img_emb: bool = False) -> str:
    """The peft `target_modules` regex: LORA_TARGETS, plus IMG_EMB_TARGETS when asked."""
    return f"({LORA_TARGETS})|({IMG_EMB_TARGETS})" if include_img_emb else LORA_TARGETS
FILE_FORMAT = "video_dit.lora.v1"
_PREFIXES = ("diffusion_model.", "transformer.", "base_model.model.", "model.diffusion_model.")
_LORA_KEY = re.compile(r"^(?P<module>.+)\.(?P<kind>lora_A|lora_B)(\.default)?\.weight$")


def add_lora(model: nn.Module, rank: int, alpha: float | None = None, targets: str = LORA_TARGETS,
             dropout: float = 0.0) -> nn.Module:
    """Inject peft LoRA adapters into `model` in place (class and names unchanged); `alpha` defaults
    to `rank` (scale 1). Only the adapters require grad afterwards."""
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


def from_comfy(sd: dict[str, torch.Tensor], source: str = "LoRA") -> tuple[dict[str, torch.Tensor], float, int]:
    """ComfyUI (`diffusion_model.`), ai-toolkit/peft (`transformer.`, `base_model.model.`) keys ->
    (native adapter keys, alpha, rank). Files without `.alpha` (peft format) mean alpha = rank.
    HunyuanVideo 1.5's fused `<stream>_attn_qkv` adapters (ComfyUI's keys) come back as the split q / k / v
    ones (`hy15_lora_split`)."""
    sd = {_strip(k): v for k, v in sd.items()}
    if any("_attn_qkv.lora_" in k for k in sd):
        try:
            sd = hy15_lora_split(sd, source)
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
    the family's native -> ComfyUI key conversion (`Family.lora_to_comfy`; Wan's `to_comfy` by default)."""
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


def read_lora(path) -> tuple[dict[str, torch.Tensor], float, int, dict[str, str]]:
    """(native adapter keys, alpha, rank, metadata) of a LoRA file."""
    from safetensors import safe_open

    sd = read_state_dict(path)
    metadata = {}
    if str(path).endswith(".safetensors"):
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
    native, alpha, rank = from_comfy(sd, source=str(path))
    return native, alpha, rank, metadata


def _strip(key: str) -> str:
    for prefix in _PREFIXES:
        if key.startswith(prefix):
            return key[len(prefix):]
    return key


def load_lora(path, model: nn.Module, targets: str | None = None) -> nn.Module:
    """Load a LoRA file into `model`, adding adapters of the file's rank/alpha when it has none, on
    `targets` (the family's peft regex, `Family.lora_targets`; None: Wan's, with img_emb when the file
    has it).

    A file made for another model (other modules or shapes) raises `WeightsError` naming the file
    and the first mismatching keys."""
    native, alpha, rank, _ = read_lora(path)
    if not has_lora(model):
        add_lora(model, rank, alpha, targets=targets or lora_targets(any(k.startswith("img_emb.") for k in native)))
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
