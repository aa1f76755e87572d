"""Weights in: `load_dit`, `load_vae`, `load_text_encoder` from presets, diffusers folders,
original Wan files or single safetensors files. Kept apart from the network math.

Only safetensors and `torch.load(weights_only=True)` pickles are ever read: a `.pth` holding
anything but tensors is refused, never unpickled.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch import nn


class WeightsError(ValueError):
    """A weights file or folder that does not fit the model; the message names the file and keys."""


def read_state_dict(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Tensors of one `.safetensors` / `.pth` / `.pt` / `.bin` file, or of a folder of sharded
    safetensors with or without a `*.safetensors.index.json`."""
    path = Path(path)
    if path.is_dir():
        index = sorted(path.glob("*.safetensors.index.json"))
        if index:
            weight_map = json.loads(index[0].read_text())["weight_map"]
            files = sorted({path / f for f in weight_map.values()})
        else:
            files = sorted(path.glob("*.safetensors"))
        if not files:
            raise WeightsError(f"{path}: no .safetensors files in this folder")
        sd: dict[str, torch.Tensor] = {}
        for f in files:
            sd.update(read_state_dict(f))
        return sd
    if not path.exists():
        raise WeightsError(f"{path}: no such file")
    suffix = path.suffix.lower()
    if suffix == ".safetensors":
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return load_file(str(path))
        except (SafetensorError, OSError) as exc:
            raise WeightsError(f"{path}: not a readable safetensors file ({exc})") from exc
    if suffix in (".pth", ".pt", ".bin", ".ckpt"):
        import pickle

        try:
            obj = torch.load(str(path), map_location="cpu", weights_only=True)
        except (pickle.UnpicklingError, RuntimeError, EOFError) as exc:
            raise WeightsError(
                f"{path}: refused: not a tensors-only checkpoint (loaded with weights_only=True; "
                f"pickled objects other than tensors are never unpickled): {exc}"
            ) from exc
        for key in ("state_dict", "model", "module"):  # common wrappers around the tensors
            if isinstance(obj, dict) and isinstance(obj.get(key), dict):
                obj = obj[key]
        if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
            raise WeightsError(f"{path}: expected a dict of tensors, got {type(obj).__name__}")
        return obj
    raise WeightsError(f"{path}: unsupported weights file type {suffix!r}; "
                       "accepted: .safetensors, .pth, .pt, .bin, .ckpt or a folder of safetensors")


def check_state_dict(model: nn.Module, sd: dict[str, torch.Tensor], source: str, limit: int = 8) -> None:
    """Raise `WeightsError` naming `source` and the first missing / unexpected / wrong-shape keys."""
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    missing = [k for k in expected if k not in sd]
    unexpected = [k for k in sd if k not in expected]
    wrong = [f"{k}: file {tuple(sd[k].shape)} vs model {expected[k]}"
             for k in expected if k in sd and tuple(sd[k].shape) != expected[k]]
    if missing or unexpected or wrong:
        parts = [f"{source}: weights do not fit {type(model).__name__}"]
        for name, keys in (("missing", missing), ("unexpected", unexpected), ("wrong shape", wrong)):
            if keys:
                more = f" (+{len(keys) - limit} more)" if len(keys) > limit else ""
                parts.append(f"  {len(keys)} {name}: " + ", ".join(keys[:limit]) + more)
        raise WeightsError("\n".join(parts))


def strip_prefix(sd: dict[str, torch.Tensor], prefixes=("model.diffusion_model.", "diffusion_model.")):
    """Drop a ComfyUI-style prefix when every key carries it."""
    for prefix in prefixes:
        if sd and all(k.startswith(prefix) for k in sd):
            return {k[len(prefix):]: v for k, v in sd.items()}
    return sd


# ---------------------------------------------------------------- DiT (issue 2)

# ---------------------------------------------------------------- VAE (issue 3)

# ---------------------------------------------------------------- text encoder (issue 4)
