"""A stand-in model family, defined outside the package and registered at run time, for
tests/test_family_contract.py: the proof that shared code (the trainer, the memory plan, `video-dit
sample`, the ai-toolkit arch) asks a family only through its record (`video_dit.families.contract.Family`).

    dit.py       StandinDiT: adaLN-zero blocks, self- and cross-attention, its own parameter names
    vae.py       StandinVAE: a causal patch autoencoder (time 4, space 8)
    text.py      ByteTextEncoder: a prompt's bytes, embedded
    pipeline.py  StandinPipeline: Euler on its own grid (`flow_sample`)
    memory.py    the DiT's activation model (what its forward makes autograd keep)

Text-to-video only: the DiT reads no first frame and no image embeds. Every part of a preset is a seeded
random init (`preset:NAME`); a trained DiT is a folder of safetensors + config.json (our exports' layout),
a VAE or text encoder a folder of `model.safetensors` + `config.json`.

Registered in a process by `video_dit.families.register(FAMILY)`, or in every process a launch starts
by `VIDEO_DIT_FAMILIES=standin_family` with tests/ on PYTHONPATH (`registry.load_plugins`).
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import torch

from standin_family import memory
from standin_family.dit import (
    FLOAT32_MODULES,
    LORA_TARGETS,
    StandinDiT,
    StandinDiTConfig,
    cast_standin,
    init_parameter,
    param_dtypes,
    standin_flops,
)
from standin_family.pipeline import StandinPipeline, standin_schedule
from standin_family.text import ByteTextConfig, ByteTextEncoder
from standin_family.vae import StandinVAE, StandinVAEConfig
from video_dit.families.contract import DiTArch, Family, MemoryModel, Preset, Training
from video_dit.lora import to_comfy
from video_dit.models.common import check_quantize, quantize_encoder
from video_dit.models.layouts import dit_path, preset_name
from video_dit.models.weights import WeightsError, check_state_dict, materialize, open_weights, read_state_dict

NAME = "standin"
BLOCKS = "layers"  # the DiT's block list: its state-dict prefix (`DiTArch.block_list`)

# Sampling defaults of the tiny preset: no reference model to quote; Euler at 6 steps, shift 3, guidance 2
TINY = Preset("standin-tiny", NAME, StandinDiTConfig(), StandinVAEConfig(), "standin-tiny", ByteTextConfig(),
              sample_solver="euler", sample_steps=6, sample_shift=3.0, sample_guidance=2.0, sample_negative="",
              train_shift=3.0, fps=8)
PRESETS = {TINY.name: TINY}


def _preset(name: str) -> Preset:
    if name not in PRESETS:
        raise WeightsError(f"preset:{name}: not a stand-in preset; accepted: {', '.join(PRESETS)}")
    return PRESETS[name]


# ---------------------------------------------------------------- loaders


def dit_config(source) -> StandinDiTConfig:
    """The config.json in the DiT's folder (or beside its file); the tensor names and shapes cannot tell the
    patch size from the channels, so a weights file without one is refused."""
    name = preset_name(source)
    if name is not None:
        return _preset(name).dit
    path = dit_path(source)
    config = (path if path.is_dir() else path.parent) / "config.json"
    if not config.is_file():
        raise WeightsError(f"{path}: no config.json beside the stand-in DiT weights; accepted: a folder holding "
                           "the weights and their config.json (as the trainer's full export writes it)")
    try:
        return StandinDiTConfig.from_dict(json.loads(config.read_text()))
    except (OSError, ValueError, TypeError) as exc:
        raise WeightsError(f"{config}: not a stand-in DiT config ({exc})") from exc


def open_dit(source, config=None):
    """(weights under native names, config, description): the ZeRO-3 build's one-module-group-at-a-time read."""
    path = dit_path(source)
    return open_weights(path), config or dit_config(source), f"{path} (stand-in layout)"


def load_dit(source, dtype=None, device=None, config=None, seed: int = 0) -> StandinDiT:
    """`preset:NAME` (seeded init) or a folder / file of native-named safetensors with config.json."""
    name = preset_name(source)
    if name is not None:
        with torch.device(device or "cpu"):
            model = StandinDiT(config or _preset(name).dit, init_seed=seed)
        return cast_standin(model, dtype) if dtype is not None else model
    weights, config, description = open_dit(source, config)
    model = materialize(StandinDiT, config, weights, description, dtype, device, storage=param_dtypes,
                        block_list=BLOCKS)
    return cast_standin(model, dtype) if dtype is not None else model


def _part(source, what: str, build, config_cls, seed: int, dtype, device, config=None):
    """A VAE or text encoder: a preset's seeded init (of `config`, else the preset's), or a folder with
    config.json + model.safetensors."""
    name = preset_name(source)
    if name is not None:
        config = config or getattr(_preset(name), what)
        with torch.device(device or "cpu"):
            model = build(config, init_seed=seed)
    else:
        folder = Path(source)
        try:
            config = config_cls(**json.loads((folder / "config.json").read_text()))
        except (OSError, ValueError, TypeError) as exc:
            raise WeightsError(f"{folder}: expected a stand-in {what} folder (config.json + model.safetensors): "
                               f"{exc}") from exc
        with torch.device("meta"):
            model = build(config)
        sd = read_state_dict(folder / "model.safetensors")
        check_state_dict(model, sd, str(folder / "model.safetensors"))  # names the missing / extra / misshapen keys
        model.load_state_dict(sd, assign=True)
    return model.to(device=device, dtype=dtype)


def load_vae(source, dtype=None, device=None, config=None, seed: int = 0) -> StandinVAE:
    return _part(source, "vae", StandinVAE, StandinVAEConfig, seed, dtype, device, config)


def load_text_encoder(source, dtype=None, device=None, quantize=None, tokenizer=None) -> ByteTextEncoder:
    if tokenizer is not None:
        raise ValueError(f"--tokenizer {tokenizer}: the stand-in text encoder reads bytes (no tokenizer); remove it")
    check_quantize(quantize)
    encoder = _part(source, "text_encoder", ByteTextEncoder, ByteTextConfig, 0, dtype, device)
    quantize_encoder(encoder, quantize)
    return encoder.eval()


def load_image_encoder(source, dtype=None, device=None, quantize=None):
    raise WeightsError(f"{source}: the stand-in family has no image encoder (its DiT reads no image embeds)")


def _no_image_embeds(encoder, image, last, height, width):
    raise ValueError("the stand-in family has no image branch: no image embeds")


# ---------------------------------------------------------------- checkpoint detection

_CONFIG_KEYS = {f for f in asdict(StandinDiTConfig())}


def claims(meta: dict) -> bool:
    """Tensor names (-> meta tensors or shapes) that are exactly a stand-in DiT's, for the depth they show."""
    keys = set(meta)
    depth = len({k.split(".")[1] for k in keys if k.startswith("layers.")})
    if not depth or "patch_embed.weight" not in keys:
        return False
    with torch.device("meta"):
        expected = set(StandinDiT(StandinDiTConfig(depth=depth)).state_dict())
    return keys == expected


def claims_config(config: dict) -> bool:
    return set(config) == _CONFIG_KEYS


# ---------------------------------------------------------------- what the trainer and the plan ask


def _conditioning(i2v_mode, patch_size, mask_first_frame_loss, last_frame):
    raise ValueError(f"i2v_mode {i2v_mode!r}: the stand-in family takes no first frame (text-to-video only); "
                     "accepted: datasets with do_i2v: false")


def _cache_item(vae, video, i2v_mode, last_frame, image_encoder):
    raise ValueError("the stand-in family caches no first-frame conditioning (text-to-video only)")


TRAINING = Training(
    conditioning=_conditioning, conditions_t2v=False, cache_item=_cache_item, cond_keys=(),
    text_entry=lambda e: {"text_embeds": e.float()},
    text_inputs=lambda batch, device, dit_config: ([e.to(device) for e in batch["text_embeds"]], {}),
    prompt=lambda entry: entry["text_embeds"],
)


def _encoder_parameters(preset: Preset, parts) -> dict:
    """The VAE and the text encoder built on the meta device; no image encoder."""
    counts = {}
    with torch.device("meta"):
        if "vae" in parts:
            counts["vae"] = sum(p.numel() for p in StandinVAE(preset.vae).parameters())
        if "text_encoder" in parts:
            counts["text_encoder"] = sum(p.numel() for p in ByteTextEncoder(preset.text_encoder).parameters())
    if "image_encoder" in parts:
        counts["image_encoder"] = 0
    return counts


MEMORY = MemoryModel(
    activations=lambda cfg, grid, setting, *, lora_rank, s, fused, inputs: memory.activation_bytes(
        cfg, grid, setting, lora_rank=lora_rank, s=s),
    job_inputs=lambda job, preset: {},  # nothing of a job beyond the DiT config changes what a step keeps
    encoder_parameters=_encoder_parameters,
)

FAMILY = Family(
    name=NAME, title="Stand-in (tests)", presets=PRESETS, trains=("video_dit", "ai-toolkit"),
    load_dit=load_dit, load_vae=load_vae, load_text_encoder=load_text_encoder, load_image_encoder=load_image_encoder,
    dit_config=dit_config, claims=claims, claims_config=claims_config, claim_order=2, classes=(),
    pipeline=lambda dit, vae, *, image_encoder=None, i2v_mode=None: StandinPipeline(dit, vae),
    image_embeds=_no_image_embeds,
    random_source=lambda preset, part: f"preset:{preset.name}" if part in ("vae", "text_encoder") else None,
    folder_source=lambda base, part: str(base / part) if part != "image_encoder" and (base / part).is_dir() else None,
    accepts={"vae": "preset:standin-tiny or a folder with config.json + model.safetensors",
             "text_encoder": "preset:standin-tiny or a folder with config.json + model.safetensors",
             "image_encoder": "none: the stand-in DiT reads no image embeds"},
    needs={"text_encoder": "the byte text encoder", "image_encoder": "no image encoder",
           "text_folder": "no text_encoder/ folder in it", "no_images": "reads no image embeds"},
    natural_i2v=lambda cfg, task, z_dim=None: None, i2v_only=lambda cfg: False, reads_images=lambda spec: False,
    last_frame=lambda cfg, i2v_mode: "no",
    image_encoder_fits=lambda source, cfg: "the stand-in DiT reads no image embeds",
    lora_targets=lambda include_image_branch: LORA_TARGETS, image_branch_lora=lambda cfg: False,
    lora_to_comfy=to_comfy, lora_from_file=lambda sd, source: sd,  # native names are the file's
    arch=DiTArch(StandinDiT, init_parameter, param_dtypes, cast_standin, open_dit, FLOAT32_MODULES,
                 embedders=("patch_embed", "text_embed"), block_list=BLOCKS),
    flops=standin_flops, training=TRAINING, memory=MEMORY,
    sampling_schedule=standin_schedule, sampling_grids=("reference",), solvers=("euler",),
    sampling_defaults=dict(solver="euler", steps=6, shift=3.0, guidance=2.0, negative=""),
    sampling_origin="the stand-in family's defaults (no preset known)", fps=8,
    refused_flags={"--last-image": "the stand-in family takes no frame", "--tokenizer": "it reads bytes"},
)
