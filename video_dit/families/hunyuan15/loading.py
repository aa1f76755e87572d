"""HunyuanVideo 1.5 weights in: the DiT from a preset's seeded init, a diffusers folder, Tencent's own
layout or a single file (any key layout `convert.py` reads); its config and its task (t2v or
i2v) from the files' metadata, without reading a tensor. The VAE and encoders load through
`convert_vae.load_hy15_vae` and `encoders`; `__init__.py`'s `FAMILY` puts them together.

Layouts of a model folder:
    diffusers  hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-*: model_index.json (its `_class_name`,
               HunyuanVideo15Pipeline or HunyuanVideo15ImageToVideoPipeline, says t2v or i2v), transformer/,
               vae/, text_encoder/ + tokenizer/ (Qwen2.5-VL), text_encoder_2/ + tokenizer_2/ (ByT5),
               i2v: image_encoder/ + feature_extractor/ (SigLIP), scheduler/, guider/
    Tencent    tencent/HunyuanVideo-1.5: transformer/<variant>/ (config.json with `ideal_task`, safetensors),
               vae/; the model is one variant's folder, ckpts/transformer/480p_i2v (its VAE is found at
               ckpts/vae). Tencent's text and vision encoders (a whole Qwen2.5-VL, Glyph-SDXL-v2's .pt)
               are not read: give the encoders as a diffusers folder.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from video_dit.families.hunyuan15.config import HY15DiTConfig
from video_dit.families.hunyuan15.convert import (
    hy15_config_from_diffusers,
    hy15_from_comfy,
    hy15_from_diffusers,
    hy15_key_layout,
    hy15_to_diffusers,
    hy15_to_native,
    infer_hy15_config,
)
from video_dit.families.hunyuan15.dit import HunyuanVideo15DiT, cast_hy15_dit, param_dtypes
from video_dit.families.hunyuan15.presets import get_preset
from video_dit.models.layouts import dit_path, preset_name
from video_dit.models.weights import (ConvertedWeights, LazyWeights, WeightsError, materialize, open_weights,
                                     strip_dit_prefix)

DIT_CLASSES = ("HunyuanVideo15Transformer3DModel", "HunyuanVideo_1_5_DiffusionTransformer")
PIPELINE_TASKS = {"HunyuanVideo15Pipeline": "t2v", "HunyuanVideo15ImageToVideoPipeline": "i2v"}
TASKS = ("t2v", "i2v")



def _config_json(path: Path) -> Path:
    return (path if path.is_dir() else path.parent) / "config.json"


def config_from_json(path: Path) -> HY15DiTConfig:
    """A DiT config.json: diffusers' `HunyuanVideo15Transformer3DModel` or Tencent's (its constructor
    names); `WeightsError` naming the file otherwise."""
    try:
        d = json.loads(path.read_text())
        if d.get("_class_name") == DIT_CLASSES[0] or "num_attention_heads" in d:
            return hy15_config_from_diffusers(d)
        return HY15DiTConfig.from_dict(d)
    except (OSError, ValueError, TypeError) as exc:
        raise WeightsError(f"{path}: not a HunyuanVideo 1.5 DiT config ({exc})") from exc


def dit_config(source: str | os.PathLike) -> HY15DiTConfig:
    """The DiT config of a weights source, read without a tensor: the config.json of the folder (or
    beside the file), else inferred from the tensor headers' names and shapes."""
    path = dit_path(source)
    cfg = _config_json(path)
    if cfg.is_file():
        return config_from_json(cfg)
    weights = open_weights(path)
    try:
        return infer_hy15_config(weights.meta())
    except ValueError as exc:
        raise WeightsError(f"{path}: {exc}") from exc


def claims(meta: dict) -> bool:
    """Whether tensor names (-> meta tensors or shapes) are a HunyuanVideo 1.5 DiT's, in any layout:
    every key maps to one of its parameters (`hy15_to_native` on meta tensors reads no data)."""
    try:
        hy15_key_layout(meta)
        hy15_to_native({k: v if isinstance(v, torch.Tensor) else torch.empty(v, device="meta")
                        for k, v in meta.items()})
    except ValueError:
        return False
    return True


def task_of(source: str | os.PathLike) -> tuple[str, str] | None:
    """(task, where it is said) of a HunyuanVideo 1.5 model from its metadata: a diffusers folder's
    model_index.json `_class_name` (the pipeline diffusers samples it with), else Tencent's DiT
    config.json `ideal_task` (which Tencent's pipeline enforces); None when neither says (a bare file).
    diffusers' transformer config `task_type` is not read: its conversion script writes "i2v" for the
    480p t2v model (scripts/convert_hunyuan_video1_5_to_diffusers.py line 50)."""
    if preset_name(source) is not None:
        return None
    path = Path(source)
    folder = path if path.is_dir() else path.parent
    for index in (folder / "model_index.json", folder.parent / "model_index.json"):
        if index.is_file():
            name = _read_json(index).get("_class_name")
            if name in PIPELINE_TASKS:
                return PIPELINE_TASKS[name], f"{index}: _class_name {name!r}"
    cfg = _config_json(dit_path(path))
    if cfg.is_file():
        task = _read_json(cfg).get("ideal_task")
        if task in TASKS:
            return task, f"{cfg}: ideal_task {task!r}"
    return None


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise WeightsError(f"{path}: not a readable JSON file ({exc})") from exc
    return data if isinstance(data, dict) else {}


def tencent_vae(source: str | os.PathLike) -> str | None:
    """The VAE folder of Tencent's layout for a DiT at ckpts/transformer/<variant>[/file]: ckpts/vae."""
    path = Path(source)
    variant = path if path.is_dir() else path.parent
    if variant.parent.name == "transformer" and (variant.parent.parent / "vae").is_dir():
        return str(variant.parent.parent / "vae")
    return None


def load_hy15_dit(source: str | os.PathLike, dtype: torch.dtype | None = None, device=None,
                  config: HY15DiTConfig | None = None, seed: int = 0) -> HunyuanVideo15DiT:
    """A `HunyuanVideo15DiT` from
      `preset:NAME`      seeded random init (`seed`) of the preset's DiT config;
      a folder           diffusers' (with `transformer/`, or the transformer folder itself) or one of
                         Tencent's transformer/<variant>/ folders: safetensors (sharded or not) + config.json;
      a file             .safetensors / .pth in Tencent's, diffusers' or ComfyUI's key names.
    The config: `config`, else config.json, else the weights' shapes. dtype None keeps the stored dtype;
    a dtype casts as `cast_hy15_dit` (bf16 keeps the float32 islands). The layouts other than Tencent's
    fuse or split tensors: converted whole before the model takes them (the whole model is built here; a
    ZeRO-3 build reads one module group at a time through `open_hy15_dit`).
    """
    src = str(source)
    name = preset_name(src)
    if name is not None:
        config = config or get_preset(name).dit
        if not isinstance(config, HY15DiTConfig):
            raise WeightsError(f"{src}: not a HunyuanVideo 1.5 preset")
        with torch.device(device or "cpu"):
            model = HunyuanVideo15DiT(config, init_seed=seed)
        return cast_hy15_dit(model, dtype) if dtype is not None else model
    weights, config, description = open_hy15_dit(src, config)
    sd = weights if isinstance(weights, LazyWeights) else weights.read_all()  # converted (the whole model is built)
    model = materialize(HunyuanVideo15DiT, config, sd, description, dtype, device, storage=param_dtypes)
    return cast_hy15_dit(model, dtype) if dtype is not None else model


def _converted(lazy: LazyWeights, layout: str, description: str) -> ConvertedWeights:
    """`ConvertedWeights` of a diffusers- or ComfyUI-names file (prefix stripped), every key converted and checked
    on the meta device. Each native tensor's sources: diffusers', `hy15_to_diffusers` of that one name on a meta
    stand-in (the refiner's self_attn_qkv: its to_q / to_k / to_v); ComfyUI's, the stored tensor whose
    `hy15_from_comfy` gives it (a double block's q, k and v: its fused qkv, read once for the three)."""
    meta = lazy.meta()
    native = hy15_to_native(meta)
    if layout == "diffusers":
        sources = {n: list(hy15_to_diffusers({n: torch.empty(6, device="meta")})) for n in native}

        def convert(name, tensors):
            return hy15_from_diffusers(tensors)[name]
    else:
        sources = {n: [key] for key in meta for n in hy15_from_comfy({key: meta[key]})}

        def convert(name, tensors):
            return hy15_from_comfy(tensors)[name]
    return ConvertedWeights(lazy, sources, convert, native, description)


def open_hy15_dit(source: str | os.PathLike, config: HY15DiTConfig | None = None):
    """(weights under native names, config, description) of a DiT source, for a build that reads one
    module group at a time (ZeRO-3, `parallel/partition.py`, on every rank), no tensor read yet: Tencent's
    layout is renamed (`LazyWeights`); diffusers' and ComfyUI's fuse or split tensors, so they are converted
    one native tensor at a time as they are read (`ConvertedWeights`: a group read holds that group plus one
    tensor's sources, never the model)."""
    path = dit_path(source)
    weights = open_weights(path)
    layout = _layout(weights.meta(), path)
    description = f"{path} ({layout} layout)"
    if config is None and _config_json(path).is_file():
        config = config_from_json(_config_json(path))
    try:
        weights = weights.renamed(strip_dit_prefix({k: k for k in weights.keys()}))  # native name -> stored
        if layout == "Tencent":
            hy15_to_native(weights.meta())  # every key checked, none read
        else:
            weights = _converted(weights, layout, description)
        config = config or infer_hy15_config(weights.meta())
    except ValueError as exc:
        raise WeightsError(f"{path}: {exc}") from exc
    return weights, config, description


def _layout(meta: dict, path: Path) -> str:
    try:
        return {"native": "Tencent"}.get(layout := hy15_key_layout(meta), layout)
    except ValueError as exc:
        raise WeightsError(f"{path}: {exc}") from exc
