"""LTX-2 weights in: the DiT, the video VAE, the audio codec (audio VAE + vocoder) and the prompt encoder
(Gemma 3 + text connectors) from a preset's seeded init, a diffusers folder, Lightricks' single file or
ComfyUI's files; configs from config.json or the file's metadata, without reading a tensor; checkpoint
detection for the registry.

Layouts of a model:
    diffusers   Lightricks/LTX-2 (diffusers' layout): model_index.json (`LTX2Pipeline`), transformer/, vae/,
                audio_vae/, vocoder/, connectors/, text_encoder/ + tokenizer/ (Gemma 3), scheduler/
    Lightricks  one .safetensors (ltx-2-19b-dev.safetensors, ltx-2.3-22b-dev.safetensors): the DiT under
                `model.diffusion_model.`, beside it the text connectors, `vae.`, `audio_vae.`, `vocoder.`; its
                safetensors metadata `config` holds each part's config ("transformer", "vae", "audio_vae",
                "vocoder"). The Gemma is not in it (ltx-pipelines' --gemma-root): give it as GEMMA::FILE
                (`load_prompt_encoder`).
    ComfyUI     the same file as Lightricks' (ComfyUI loads it as it is), or a DiT alone under `diffusion_model.`
                and split VAE files (`vae.` or bare Lightricks names): read by the same loaders.
Each loader reads only its part's tensors of a combined file (`LazyWeights`: names from the header).
A file that does not fit names itself and its first wrong keys (`WeightsError`).
"""

from __future__ import annotations

import json
import os
from dataclasses import fields, replace
from pathlib import Path

import torch

from video_dit.families.ltx2 import audio_convert as AC
from video_dit.families.ltx2.audio_vae import LTX2AudioVAE
from video_dit.families.ltx2.codec import LTX2AudioCodec
from video_dit.families.ltx2.convert import (SINGLE_FILE_PREFIX, ltx2_config_from_diffusers, ltx2_key_layout,
                                             ltx2_to_native)
from video_dit.families.ltx2.dit import LTX2DiT, cast_ltx2_dit, param_dtypes
from video_dit.families.ltx2.dit_config import LTX2_DIT_CONFIGS, LTX2DiTConfig
from video_dit.families.ltx2.presets import AUDIO, LTX2_PRESETS, get_preset
from video_dit.families.ltx2.text_encoder import (DIFFUSERS_REPO, GEMMA_REPO, LTX2PromptEncoder,
                                                  load_ltx2_text_encoder, tiny_ltx2_prompt_encoder)
from video_dit.families.ltx2.vae_convert import (ltx2_vae_config_from_diffusers, ltx2_vae_config_from_ltx,
                                                 ltx2_vae_release_from_shapes, ltx2_vae_to_native)
from video_dit.families.ltx2.vae import LTX2VideoVAE
from video_dit.families.ltx2.vae_config import PRESETS as VAE_PRESETS
from video_dit.families.ltx2.vocoder import LTX2Vocoder, LTX2VocoderWithBWE
from video_dit.models.layouts import dit_path, preset_name
from video_dit.models.weights import LazyWeights, WeightsError, materialize, open_weights

DIT_CLASSES = ("LTX2VideoTransformer3DModel",)
PIPELINE_CLASSES = ("LTX2Pipeline", "LTX2ImageToVideoPipeline", "LTX2ConditionPipeline")
PAIR = "::"  # GEMMA::CONNECTORS, a text encoder of two sources
DOWNLOAD = (f"download them (no network is used here): huggingface-cli download {DIFFUSERS_REPO} --local-dir "
            "MODELS/ltx-2 (the diffusers folder), or Lightricks' single file and "
            f"huggingface-cli download {GEMMA_REPO} --local-dir MODELS/gemma-3-12b")


# ---------------------------------------------------------------- what a source holds (names only)


def _config_json(path: Path) -> Path:
    return (path if path.is_dir() else path.parent) / "config.json"


def metadata_config(path: Path) -> dict | None:
    """The `config` JSON of a Lightricks single file's safetensors metadata (every part's), or None."""
    return AC.read_metadata_config(path)


def _native_names(weights, source) -> tuple[dict[str, str], str]:
    """({native DiT name: the file's name}, layout) of a weights source's DiT tensors, from the names alone
    (the conversions are one-to-one renames; a combined file's other parts are left out)."""
    meta = weights.meta()
    by_id = {id(t): k for k, t in meta.items()}
    try:
        native = ltx2_to_native(meta, str(source))
        layout = ltx2_key_layout({k: None for k in native})
    except ValueError as exc:
        raise WeightsError(str(exc)) from exc
    if any(k.startswith(SINGLE_FILE_PREFIX) for k in meta):
        layout = "Lightricks single-file"
    return {name: by_id[id(t)] for name, t in native.items()}, layout


def claims(meta: dict) -> bool:
    """Whether tensor names (-> meta tensors or shapes) hold an LTX-2 DiT in any layout (a combined file's DiT
    part too): every DiT key maps to one of its parameters, and its audio stream is there."""
    tensors = {k: v if isinstance(v, torch.Tensor) else torch.empty(v, device="meta") for k, v in meta.items()}
    try:
        native = ltx2_to_native(tensors)
    except ValueError:
        return False
    return "audio_patchify_proj.weight" in native


def claims_config(config: dict) -> bool:
    """A DiT config.json of diffusers' LTX-2 transformer without its class name (the audio stream's keys)."""
    return "audio_num_attention_heads" in config and "audio_cross_attention_dim" in config


def config_from_json(path: Path) -> LTX2DiTConfig:
    """A DiT config.json: diffusers' `LTX2VideoTransformer3DModel`, or ours (a full fine-tune's export writes its
    `LTX2DiTConfig` fields: Lightricks' names, read as its checkpoint metadata is)."""
    try:
        d = json.loads(path.read_text())
        if "_class_name" not in d and set(d) <= {f.name for f in fields(LTX2DiTConfig)}:
            return LTX2DiTConfig.from_dict(d)
        return ltx2_config_from_diffusers(d)
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise WeightsError(f"{path}: not an LTX2VideoTransformer3DModel config ({exc})") from exc


def _release_from_shapes(meta: dict, path) -> LTX2DiTConfig:
    shapes = {k: tuple(v.shape) for k, v in meta.items()}
    for name, config in LTX2_DIT_CONFIGS.items():
        with torch.device("meta"):
            expected = {k: tuple(v.shape) for k, v in LTX2DiT(config).state_dict().items()}
        if expected == shapes:
            return config
    raise WeightsError(f"{path}: the DiT's tensors match no known LTX-2 config ({', '.join(LTX2_DIT_CONFIGS)}) and "
                       "the file carries no config (Lightricks' metadata, a config.json beside it): pass config=")


def dit_config(source: str | os.PathLike) -> LTX2DiTConfig:
    """The DiT config of a weights source, read without a tensor: config.json (diffusers' folder, or beside the
    file), else the single file's metadata ("transformer"), else the release whose shapes the tensors have."""
    path = dit_path(source)
    if _config_json(path).is_file():
        return config_from_json(_config_json(path))
    meta = metadata_config(path) if path.is_file() else None
    if meta is not None and "transformer" in meta:
        try:
            return LTX2DiTConfig.from_dict(meta["transformer"])
        except (ValueError, TypeError) as exc:
            raise WeightsError(f"{path}: its metadata's transformer config: {exc}") from exc
    weights = open_weights(path)
    names, _ = _native_names(weights, path)
    meta = weights.meta()
    return _release_from_shapes({n: meta[k] for n, k in names.items()}, path)


# ---------------------------------------------------------------- the DiT


def open_ltx2_dit(source: str | os.PathLike, config: LTX2DiTConfig | None = None):
    """(weights under native names, config, description) of a DiT source, read lazily one module group at a
    time (every layout's names map one to one: `LazyWeights.renamed`, nothing read yet)."""
    path = dit_path(source)
    weights = open_weights(path)
    names, layout = _native_names(weights, path)
    config = config or dit_config(source)
    return weights.renamed(names), config, f"{path} ({layout} layout)"


def load_ltx2_dit(source: str | os.PathLike, dtype: torch.dtype | None = None, device=None,
                  config: LTX2DiTConfig | None = None, seed: int = 0) -> LTX2DiT:
    """An `LTX2DiT` from `preset:NAME` (seeded random init, `seed`), a diffusers folder (transformer/), a
    Lightricks / ComfyUI single file (its DiT part only) or a DiT file or folder in any layout `convert.py`
    reads. The config: `config`, else config.json, else the file's metadata, else the shapes' release. dtype
    None keeps the stored dtype; a dtype casts as `cast_ltx2_dit` (bf16 keeps the float32 islands)."""
    name = preset_name(source)
    if name is not None:
        config = config or get_preset(name).dit
        if not isinstance(config, LTX2DiTConfig):
            raise WeightsError(f"{source}: not an LTX-2 preset")
        with torch.device(device or "cpu"):
            model = LTX2DiT(config, init_seed=seed)
        return cast_ltx2_dit(model, dtype) if dtype is not None else model
    weights, config, description = open_ltx2_dit(source, config)
    model = materialize(LTX2DiT, config, weights, description, dtype, device, storage=param_dtypes)
    return cast_ltx2_dit(model, dtype) if dtype is not None else model


# ---------------------------------------------------------------- the video VAE


def _prefixed(path: Path, prefix: str) -> LazyWeights | None:
    """The tensors of a combined file under `prefix`, renamed without it (nothing read), or None when it has none."""
    weights = open_weights(path)
    names = {k[len(prefix):]: k for k in weights.keys() if k.startswith(prefix)}
    return weights.renamed(names) if names else None


def load_vae(source: str | os.PathLike, dtype: torch.dtype | None = None, device=None, config=None,
             seed: int = 0) -> LTX2VideoVAE:
    """The video VAE (`vae_convert.load_ltx2_vae`: `preset:NAME` of its VAE presets, a diffusers vae/ folder or
    a file); a Lightricks single file's `vae.` tensors are read alone, its metadata giving the config."""
    path = Path(str(source))
    if preset_name(source) is not None or not path.is_file():
        from video_dit.families.ltx2.vae_convert import load_ltx2_vae

        return load_ltx2_vae(source, dtype, device, config, seed)
    part = _prefixed(path, "vae.")
    if part is None:
        from video_dit.families.ltx2.vae_convert import load_ltx2_vae

        return load_ltx2_vae(source, dtype, device, config, seed)
    try:
        meta = metadata_config(path)
        if config is None and meta is not None and "vae" in meta:
            config = ltx2_vae_config_from_ltx(meta["vae"])
        if config is None and _config_json(path).is_file():
            config = ltx2_vae_config_from_diffusers(json.loads(_config_json(path).read_text()))
        kept = ltx2_vae_to_native(part.meta(), "original")[0]  # checked, the unused statistics dropped
        sd = part.renamed({k: k for k in kept})
        config = config or ltx2_vae_release_from_shapes(sd.meta())
    except (ValueError, TypeError, KeyError) as exc:
        raise WeightsError(f"{path}: {exc}") from exc
    return materialize(LTX2VideoVAE, config, sd, f"{path} (Lightricks single-file layout: vae.*)", dtype, device)


# ---------------------------------------------------------------- the audio codec


def load_codec(source: str | os.PathLike, dtype: torch.dtype | None = torch.float32, device=None,
               seed: int = 0) -> LTX2AudioCodec:
    """The audio VAE and vocoder as an `LTX2AudioCodec`, from `preset:NAME` (a tiny preset's seeded random
    ones; a released preset's are never random), a diffusers folder (audio_vae/ + vocoder/) or a Lightricks
    single file (its `audio_vae.` and `vocoder.` tensors and metadata). dtype float32 by default (ltx-core runs
    the audio VAE in float32, the BWE vocoder computes in float32 whatever its weights)."""
    name = preset_name(source)
    if name is not None:
        config = AUDIO.get(name)
        if config is None:
            raise WeightsError(f"{source}: not an LTX-2 preset; accepted: {', '.join(LTX2_PRESETS)}")
        if not config.tiny:
            raise WeightsError(f"{source}: this preset's audio VAE and vocoder are never random-initialised here; "
                               f"{DOWNLOAD}")
        cls = LTX2VocoderWithBWE if hasattr(config.vocoder, "bwe") else LTX2Vocoder
        codec = LTX2AudioCodec(LTX2AudioVAE(config.vae, seed=seed), cls(config.vocoder, seed=seed + 1)).to(device)
        return codec.to(dtype) if dtype is not None else codec
    vae = AC.load_ltx2_audio_vae(source, dtype, device)
    meta = metadata_config(Path(str(source)))
    config = None
    if meta is not None and "vocoder" in meta:  # ltx-core hard-codes the vocoder's input, the audio VAE's 2 x 64
        config = AC.vocoder_config_from_metadata(meta)
        width = vae.config.out_ch * vae.config.mel_bins
        config = replace(config, vocoder=replace(config.vocoder, in_channels=width)) if hasattr(config, "bwe") \
            else replace(config, in_channels=width)
    vocoder = AC.load_ltx2_vocoder(source, dtype, device, config=config)
    try:
        return LTX2AudioCodec(vae, vocoder)
    except ValueError as exc:
        raise WeightsError(f"{source}: {exc}") from exc


# ---------------------------------------------------------------- the prompt encoder


def load_prompt_encoder(source, dtype=None, device=None, quantize=None, tokenizer=None) -> LTX2PromptEncoder:
    """Gemma 3 + the text connectors (`LTX2PromptEncoder`) from
      `preset:NAME`          a tiny preset's seeded ones (a released preset's are never random);
      a diffusers folder     text_encoder/ + tokenizer/ (Gemma 3) and connectors/;
      GEMMA::CONNECTORS      a Gemma 3 folder (or a diffusers folder holding one) and the file or folder holding
                             the connectors: Lightricks' single file (its `model.diffusion_model.*_embeddings_
                             connector.*` and `text_embedding_projection.*`), a diffusers connectors/ folder.
    dtype: Gemma's and the connectors' (None: stored); quantize: Gemma's ("qfloat8", "qint8", None)."""
    if tokenizer is not None:
        raise ValueError(f"--tokenizer {tokenizer}: LTX-2's Gemma loads its tokenizer from its own folder; remove "
                         "--tokenizer")
    name = preset_name(source)
    if name is not None:
        text = get_preset(name).text_encoder
        if not text.tiny:
            raise WeightsError(f"{source}: this preset's Gemma and connectors are never random-initialised or "
                               f"downloaded here; {DOWNLOAD}")
        encoder = tiny_ltx2_prompt_encoder(0, max_length=text.gemma.max_length, connectors=text.connectors)
        return encoder.to(device=device, dtype=dtype) if dtype is not None or device is not None else encoder
    gemma, _, connectors = str(source).partition(PAIR)
    gemma, connectors = Path(gemma), Path(connectors or gemma)
    if not gemma.is_dir():
        raise WeightsError(f"{gemma}: no such folder; LTX-2's text encoder is a diffusers LTX-2 folder (text_encoder/ "
                           f"+ tokenizer/ + connectors/) or GEMMA{PAIR}CONNECTORS; {DOWNLOAD}")
    if PAIR not in str(source) and not (gemma / "connectors").is_dir():
        raise WeightsError(f"{gemma}: no connectors/ folder (LTX-2's text connectors); a Lightricks single file "
                           f"holds them: pass {gemma}{PAIR}MODEL.safetensors")
    from video_dit.families.ltx2.audio_convert import load_ltx2_connectors

    text_encoder = load_ltx2_text_encoder(gemma, dtype, device, quantize)
    conn = load_ltx2_connectors(connectors, dtype, device)
    try:
        return LTX2PromptEncoder(text_encoder, conn)
    except ValueError as exc:
        raise WeightsError(f"{source}: {exc}") from exc


# ---------------------------------------------------------------- where the parts of a model are


def _file_holds(path: Path, *prefixes: str) -> bool:
    if not (path.is_file() and path.suffix == ".safetensors"):
        return False
    keys = open_weights(path).keys()
    return all(any(k.startswith(p) for k in keys) for p in prefixes)


def folder_source(base: Path, part: str) -> str | None:
    """A part's source in a model's own layout: diffusers' folder (vae/; audio_vae/ + vocoder/; text_encoder/ +
    tokenizer/ + connectors/), or a Lightricks single file holding it (`vae.`; `audio_vae.` + `vocoder.`; its
    text encoder is never in it)."""
    base = Path(base)
    if base.is_dir():
        need = {"vae": ("vae",), "audio": ("audio_vae", "vocoder"),
                "text_encoder": ("text_encoder", "tokenizer", "connectors")}.get(part)
        return str(base) if need and all((base / n).is_dir() for n in need) else None
    if part == "vae" and _file_holds(base, "vae."):
        return str(base)
    if part == "audio" and _file_holds(base, "audio_vae.", "vocoder."):
        return str(base)
    return None


def random_source(preset, part: str) -> str | None:
    """The tiny presets build every part at random (seeded); the released ones never."""
    if part == "vae":
        return f"preset:{preset.vae_name}" if preset.vae_name in VAE_PRESETS and "tiny" in preset.vae_name else None
    if part == "audio":
        return f"preset:{preset.name}" if AUDIO[preset.name].tiny else None
    if part == "text_encoder":
        return f"preset:{preset.name}" if preset.text_encoder.tiny else None
    return None
