"""MiniMax H3 weights in: the DiT, the video VAE, the audio codec (the audio VAE) and the Qwen3-VL conditioner
from a preset's seeded init, diffusers' folder or MiniMax's original layout; the DiT's config from config.json or
the tensor headers, without reading a tensor; checkpoint detection for the registry.

Layouts of a model:
    diffusers  MiniMaxAI/MiniMax-H3 (its root): model_index.json (`MiniMaxH3ModularPipeline`), transformer/
               (`MiniMaxH3Transformer3DModel`, t2va / fl2va), transformer_ref/ (ref2va), vae/, audio_vae/,
               text_encoder/ (Qwen3VLForConditionalGeneration) + tokenizer/ + processor/, scheduler/ and
               audio_scheduler/ (`MiniMaxH3Scheduler`, shift 12 / 3).
    original   MiniMaxAI/MiniMax-H3 FL2VA/ and Ref2VA/: model_index.json (`MiniMaxH3Pipeline`), transformer/
               (`MiniMaxH3DiTModel`: the native names, each qkv_proj interleaved per head, `rope.inv_freq`
               stored), video_vae/ (+ source/), audio_vae/, text_encoder/ + tokenizer/ + processor/.
    ComfyUI    a DiT file with the native names under `model.diffusion_model.` / `diffusion_model.` (qkv stacked);
               the house's own exports are the same names bare.
The qkv row order of an original-names file is not in its keys: MiniMax's shards are said by their config.json
(`_class_name` MiniMaxH3DiTModel, `convert.qkv_layout_of_config`), every other file is stacked. A ref2va
checkpoint is the model folder's transformer_ref/ given as the model (the same architecture).
A file that does not fit names itself and its first wrong keys (`WeightsError`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from video_dit.families.minimax_h3.audio_vae import load_h3_audio_vae
from video_dit.families.minimax_h3.codec import H3AudioCodec
from video_dit.families.minimax_h3.convert import (ROPE_BUFFER, deinterleave_qkv, h3_from_diffusers, h3_key_layout,
                                                   h3_to_diffusers, h3_to_native, infer_h3_config,
                                                   qkv_layout_of_config)
from video_dit.families.minimax_h3.dit import H3DiT, cast_h3_dit, param_dtypes
from video_dit.families.minimax_h3.dit_config import H3DiTConfig
from video_dit.families.minimax_h3.encoders import REPO, H3TextEncoder, load_h3_text_encoder, tiny_h3_text_encoder
from video_dit.families.minimax_h3.presets import AUDIO, H3_PRESETS, TINY_PRESETS, get_preset
from video_dit.families.minimax_h3.vae import H3VideoVAE
from video_dit.families.minimax_h3.vae_config import PRESETS as VAE_PRESETS
from video_dit.families.minimax_h3.vae_convert import load_h3_vae
from video_dit.models.layouts import dit_path, preset_name
from video_dit.models.weights import (ConvertedWeights, LazyWeights, WeightsError, materialize, open_weights,
                                     strip_dit_prefix)

DIT_CLASSES = ("MiniMaxH3Transformer3DModel", "MiniMaxH3DiTModel")
PIPELINE_CLASSES = ("MiniMaxH3ModularPipeline", "MiniMaxH3Pipeline")
DOWNLOAD = (f"download it (no network is used here): huggingface-cli download {REPO} --exclude "
            "'transformer_ref/*' 'FL2VA/*' 'Ref2VA/*' 'assets/*' --local-dir MODELS/minimax-h3 (the diffusers "
            "folder), and pass that folder")


# ---------------------------------------------------------------- what a source holds (names only)


def _config_json(path: Path) -> Path:
    return (path if path.is_dir() else path.parent) / "config.json"


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise WeightsError(f"{path}: not a readable JSON file ({exc})") from exc
    return data if isinstance(data, dict) else {}


def config_from_json(path: Path) -> H3DiTConfig:
    """A transformer config.json: diffusers' `MiniMaxH3Transformer3DModel` or MiniMax's `MiniMaxH3DiTModel`."""
    try:
        return H3DiTConfig.from_dict(_read_json(path))
    except (ValueError, TypeError) as exc:
        raise WeightsError(f"{path}: not a MiniMax H3 DiT config ({exc})") from exc


def _qkv_layout(path: Path) -> str:
    cfg = _config_json(path)
    return qkv_layout_of_config(_read_json(cfg)) if cfg.is_file() else "stacked"


def claims(meta: dict) -> bool:
    """Whether tensor names (-> meta tensors or shapes) hold a MiniMax H3 DiT in any layout: every key maps to one
    of its parameters (`h3_to_native` on meta tensors reads no data), the AdaLN table and the audio head there."""
    tensors = {k: v if isinstance(v, torch.Tensor) else torch.empty(v, device="meta") for k, v in meta.items()}
    try:
        native = h3_to_native(tensors)
    except ValueError:
        return False
    return "audio_patch_proj.weight" in native and "blocks.0.adaln_proj.linear.weight" in native


def claims_config(config: dict) -> bool:
    """A DiT config.json of MiniMax H3 without its class name: the original's `audio_latents_dim` with
    `token_refiner_num_layers`, or diffusers' `audio_in_channels` with `num_refiner_layers`."""
    return ({"audio_latents_dim", "token_refiner_num_layers"} <= set(config)
            or {"audio_in_channels", "num_refiner_layers", "time_embed_hidden_dim"} <= set(config))


def _layout(meta: dict, path: Path, qkv: str) -> str:
    try:
        layout = h3_key_layout(strip_dit_prefix(meta))
    except ValueError as exc:
        raise WeightsError(f"{path}: {exc}") from exc
    if layout == "diffusers":
        return "diffusers"
    return "MiniMax original (qkv interleaved)" if qkv == "interleaved" else "original names (qkv stacked)"


def dit_config(source: str | os.PathLike) -> H3DiTConfig:
    """The DiT config of a weights source, read without a tensor: the config.json of the folder (or beside the
    file), else inferred from the tensor headers' names and shapes."""
    path = dit_path(source)
    if _config_json(path).is_file():
        return config_from_json(_config_json(path))
    try:
        return infer_h3_config(open_weights(path).meta())
    except ValueError as exc:
        raise WeightsError(f"{path}: {exc}") from exc


# ---------------------------------------------------------------- the DiT


def _converted(lazy: LazyWeights, qkv: str, layout: str, path: Path) -> ConvertedWeights:
    """`ConvertedWeights` of a diffusers-names file (each native tensor's sources: `h3_to_diffusers` of that one
    name, on a meta stand-in) or of MiniMax's shards (qkv interleaved: each qkv_proj de-interleaved at its block's
    head_dim, read from its q_norm's shape; every other tensor as stored)."""
    native = h3_to_native(lazy.meta(), str(path), qkv)  # every key converted and checked on the meta device
    if layout == "diffusers":
        sources = {n: list(h3_to_diffusers({n: torch.empty(6, device="meta")})) for n in native}

        def convert(name, tensors):
            return h3_from_diffusers(tensors)[name]
    else:
        sources = {n: [n] for n in native}
        head_dim = {n: native[n.replace("qkv_proj", "q_norm")].shape[0] for n in native
                    if n.endswith(".attn.qkv_proj.weight")}

        def convert(name, tensors):
            return deinterleave_qkv(tensors[name], head_dim[name]) if name in head_dim else tensors[name]
    return ConvertedWeights(lazy, sources, convert, native, str(path))


def open_h3_dit(source: str | os.PathLike, config: H3DiTConfig | None = None):
    """(weights under native names, config, description) of a DiT source, for a build that reads one module group
    at a time (ZeRO-3, `parallel/partition.py`), no tensor read yet: a stacked original-names file is renamed
    (`LazyWeights`); diffusers' (q / k / v split, fc1's halves swapped) and MiniMax's own shards (qkv interleaved)
    are converted one native tensor at a time as they are read (`ConvertedWeights`)."""
    path = dit_path(source)
    weights = open_weights(path)
    qkv = _qkv_layout(path)
    meta = weights.meta()
    layout = _layout(meta, path, qkv)
    description = f"{path} ({layout} layout)"
    if config is None and _config_json(path).is_file():
        config = config_from_json(_config_json(path))
    try:
        names = strip_dit_prefix({k: k for k in weights.keys()})  # native name -> stored name
        rope = {ROPE_BUFFER: meta[names.pop(ROPE_BUFFER)]} if ROPE_BUFFER in names else {}
        weights = weights.renamed(names)
        if layout.startswith("original names"):
            h3_to_native(weights.meta(), str(path))  # every key checked, none read
        else:
            weights = _converted(weights, qkv, layout, path)
        # the shapes with the file's `rope.inv_freq` (its length: the rotary width; prefixed or not), which the
        # renamed weights leave out (it is computed, not loaded)
        config = config or infer_h3_config({**weights.meta(), **rope})
    except ValueError as exc:
        raise WeightsError(f"{path}: {exc}") from exc
    return weights, config, description


def load_h3_dit(source: str | os.PathLike, dtype: torch.dtype | None = None, device=None,
                config: H3DiTConfig | None = None, seed: int = 0) -> H3DiT:
    """An `H3DiT` from `preset:NAME` (seeded random init, `seed`), a diffusers folder (transformer/, or give
    transformer_ref/ for ref2va), MiniMax's FL2VA/ or Ref2VA/ folder, or a DiT file or folder in any layout
    `convert.py` reads. The config: `config`, else config.json, else the weights' shapes. dtype None keeps the
    stored dtype; a dtype casts as `cast_h3_dit` (bf16 keeps the float32 islands)."""
    name = preset_name(source)
    if name is not None:
        config = config or get_preset(name).dit
        if not isinstance(config, H3DiTConfig):
            raise WeightsError(f"{source}: not a MiniMax H3 preset")
        with torch.device(device or "cpu"):
            model = H3DiT(config, init_seed=seed)
        return cast_h3_dit(model, dtype) if dtype is not None else model
    weights, config, description = open_h3_dit(source, config)
    sd = weights if isinstance(weights, LazyWeights) else weights.read_all()  # converted (the whole model is built)
    model = materialize(H3DiT, config, sd, description, dtype, device, storage=param_dtypes)
    return cast_h3_dit(model, dtype) if dtype is not None else model


# ---------------------------------------------------------------- the VAEs and the conditioner


def load_vae(source: str | os.PathLike, dtype: torch.dtype | None = None, device=None, config=None,
             seed: int = 0) -> H3VideoVAE:
    """The video VAE (`vae_convert.load_h3_vae`: `preset:NAME` of its VAE presets, diffusers' vae/ or MiniMax's
    video_vae/ folder, a pipeline folder holding one, or a file)."""
    return load_h3_vae(source, dtype, device, config, seed)


def load_codec(source: str | os.PathLike, dtype: torch.dtype | None = torch.float32, device=None,
               seed: int = 0) -> H3AudioCodec:
    """The audio VAE as an `H3AudioCodec`, from `preset:NAME` (the tiny preset's seeded random one; a released
    preset's is never random), or a folder holding diffusers' or MiniMax's audio_vae/ (or that folder). dtype
    float32 by default: the release is float32 and diffusers pins it so (bfloat16 decodes come out quieter)."""
    name = preset_name(source)
    if name is not None:
        if name not in AUDIO:
            raise WeightsError(f"{source}: not a MiniMax H3 preset; accepted: {', '.join(H3_PRESETS)}")
        if name not in TINY_PRESETS:
            raise WeightsError(f"{source}: this preset's audio VAE is never random-initialised here; {DOWNLOAD}")
        vae = load_h3_audio_vae(source, dtype, device, config=AUDIO[name], seed=seed)
    else:
        vae = load_h3_audio_vae(source, dtype, device)
    return H3AudioCodec(vae.eval())


def load_text_encoder(source, dtype=None, device=None, quantize=None, tokenizer=None) -> H3TextEncoder:
    """The Qwen3-VL conditioner (`encoders.H3TextEncoder`) from `preset:NAME` (the tiny preset's seeded one; a
    released preset's Qwen3-VL is never random-initialised) or a folder (`encoders.load_h3_text_encoder`: a
    MiniMax H3 folder with text_encoder/ + tokenizer/ + processor/, or one Qwen3-VL folder). dtype: the model's
    (None: stored); quantize: None, "qfloat8" or "qint8"."""
    if tokenizer is not None:
        raise ValueError(f"--tokenizer {tokenizer}: MiniMax H3's Qwen3-VL loads its tokenizer from its own folder "
                         "(tokenizer/ beside text_encoder/); remove --tokenizer")
    name = preset_name(source)
    if name is not None:
        if not get_preset(name).text_encoder.tiny:
            raise WeightsError(f"{source}: this preset's Qwen3-VL is never random-initialised here; {DOWNLOAD}")
        encoder = tiny_h3_text_encoder(0)
        return encoder.to(device=device, dtype=dtype) if dtype is not None or device is not None else encoder
    return load_h3_text_encoder(source, dtype, device, quantize)


# ---------------------------------------------------------------- where the parts of a model are


def folder_source(base: Path, part: str) -> str | None:
    """A part's source in a model folder's own layout: diffusers' (vae/; audio_vae/; text_encoder/ + tokenizer/)
    or MiniMax's FL2VA/ (video_vae/; audio_vae/; text_encoder/ + tokenizer/); the loaders find the subfolder."""
    base = Path(base)
    if not base.is_dir():
        return None
    need = {"vae": (("vae",), ("video_vae",)), "audio": (("audio_vae",),),
            "text_encoder": (("text_encoder", "tokenizer"),)}.get(part, ())
    return str(base) if any(all((base / n).is_dir() for n in names) for names in need) else None


def random_source(preset, part: str) -> str | None:
    """The tiny preset builds every part at random (seeded); the released ones never."""
    if preset.name not in TINY_PRESETS:
        return None
    if part == "vae":
        return f"preset:{preset.vae_name}" if preset.vae_name in VAE_PRESETS else None
    return f"preset:{preset.name}" if part in ("audio", "text_encoder") else None
