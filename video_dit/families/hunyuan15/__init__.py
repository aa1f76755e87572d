"""HunyuanVideo 1.5 (Tencent-Hunyuan/HunyuanVideo-1.5): the 480p / 720p, t2v / i2v, cfg- and step-distilled
models as one family. Its files:

    config.py     HY15DiTConfig                    dit.py, layers.py   the DiT (`HunyuanVideo15DiT`)
    vae.py        the causal chunked VAE           convert.py, convert_vae.py   Tencent's / diffusers' / ComfyUI's keys
    encoders.py   Qwen2.5-VL + ByT5, SigLIP (transformers)   loading.py   the loaders
    conditioning.py   [noisy | cond | mask] and the text stream   pipeline.py   sampling on Tencent's grid
    presets.py    the released models and the tiny ones         memory.py     the activation model

`FAMILY` is its record (`video_dit.families.contract.Family`), registered by `video_dit.families`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from video_dit.families.contract import DiTArch, Family, MemoryModel, Preset, Training
from video_dit.families.hunyuan15 import conditioning as hy15_cond
from video_dit.families.hunyuan15 import dit as hy15_dit
from video_dit.families.hunyuan15 import encoders as hy15_enc
from video_dit.families.hunyuan15 import loading as hy15_load
from video_dit.families.hunyuan15.convert import hy15_lora_split, hy15_lora_to_comfy
from video_dit.families.hunyuan15.convert_vae import load_hy15_vae
from video_dit.families.hunyuan15.dit import LORA_TARGETS as HY15_LORA_TARGETS
from video_dit.families.hunyuan15.dit import HunyuanVideo15DiT, hy15_dit_flops
from video_dit.families.hunyuan15.memory import hy15_activation_bytes, hy15_text_tokens
from video_dit.families.hunyuan15.pipeline import HunyuanVideo15Pipeline, fit_image, hy15_schedule
from video_dit.families.hunyuan15.presets import HY15_PRESETS, get_preset
from video_dit.families.hunyuan15.vae import HunyuanVideo15VAE
from video_dit.models.layouts import diffusers_folder, preset_name
from video_dit.models.weights import WeightsError

HY15_TEXT_PARTS = ("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2")


def _hy15_random(preset: Preset, part: str) -> str | None:
    """The tiny presets build every part at random (seeded); the released ones never."""
    if part == "vae":
        return f"preset:{preset.vae_name}" if preset.vae_name == "hy15-tiny" else None
    own = preset.text_encoder if part == "text_encoder" else preset.image_encoder
    return f"preset:{preset.name}" if own is not None and own.tiny else None


def _hy15_folder(base: Path, part: str) -> str | None:
    """diffusers' layout (`vae/`, `text_encoder/` + `text_encoder_2/`, `image_encoder/`), or for the VAE
    Tencent's (ckpts/transformer/<variant> -> ckpts/vae)."""
    if part == "text_encoder":
        return str(base) if (base / "text_encoder").is_dir() and (base / "text_encoder_2").is_dir() else None
    found = diffusers_folder(base, part)
    return found if found is not None or part != "vae" else hy15_load.tencent_vae(base)


def _hy15_text_encoder(source, dtype=None, device=None, quantize=None, tokenizer=None):
    if tokenizer is not None:
        raise ValueError(f"--tokenizer {tokenizer}: HunyuanVideo 1.5's two text encoders load from a diffusers "
                         "folder (text_encoder/ + tokenizer/, text_encoder_2/ + tokenizer_2/); remove --tokenizer")
    name = preset_name(source)
    if name is None:
        return hy15_enc.load_hy15_prompt_encoder(source, dtype, device, quantize)
    config = get_preset(name).text_encoder
    if not getattr(config, "tiny", False):
        raise WeightsError(f"{source}: this preset's Qwen2.5-VL-7B and ByT5 are never random-initialised or "
                           f"downloaded here; {hy15_enc._download(hy15_enc.REPO_T2V, HY15_TEXT_PARTS)}")
    encoder = hy15_enc.tiny_hy15_prompt_encoder(0, text_len=config.text_len)
    return encoder.to(device=device, dtype=dtype) if dtype is not None or device is not None else encoder


def _hy15_image_encoder(source, dtype=None, device=None, quantize=None):
    name = preset_name(source)
    if name is None:
        return hy15_enc.load_hy15_image_encoder(source, dtype, device, quantize)
    config = get_preset(name).image_encoder
    if config is None or not config.tiny:
        raise WeightsError(f"{source}: this preset's SigLIP is never random-initialised or downloaded here; "
                           f"{hy15_enc._download(hy15_enc.REPO_I2V, ('image_encoder', 'feature_extractor'))}")
    encoder = hy15_enc.tiny_hy15_image_encoder(0)
    return encoder.to(device=device, dtype=dtype) if dtype is not None or device is not None else encoder


def hy15_image_encoder_width(source) -> tuple[int, str]:
    """(hidden width, where it is said) of a SigLIP source, from its config.json alone."""
    name = preset_name(source)
    if name is not None:
        return get_preset(name).image_encoder.hidden_size, f"preset {name}"
    path = Path(source)
    cfg = (path / "image_encoder" / "config.json") if (path / "image_encoder").is_dir() else path / "config.json"
    if not cfg.is_file():
        raise WeightsError(f"{path}: expected a folder holding image_encoder/config.json (SigLIP); "
                           f"{hy15_enc._download(hy15_enc.REPO_I2V, ('image_encoder', 'feature_extractor'))}")
    try:
        c = json.loads(cfg.read_text())
        c = c.get("vision_config", c)
        return int(c["hidden_size"]), f"{cfg}: hidden_size"
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise WeightsError(f"{cfg}: not a SigLIP vision config ({exc})") from exc


def _hy15_image_embeds(encoder, image, last, height, width):
    d = 16  # the VAE's 16 x the DiT's spatial patch of 1: every released model
    return encoder.encode(fit_image(image, max(d, height // d * d), max(d, width // d * d))).float()


def _hy15_pipeline(dit, vae, *, image_encoder=None, i2v_mode=None):
    return HunyuanVideo15Pipeline(dit, vae, image_encoder=image_encoder)  # (its i2v is the first frame's alone)


def _hy15_text_inputs(batch, device, dit_config):
    """The DiT's text arguments of a batch, and for a DiT with the SigLIP branch and a batch without image
    embeds (text-to-video samples) one masked-out zero image token per sample: the same output as none
    (Tencent and diffusers pass zeros and mask them), and the branch runs in every forward as the ByT5 one
    does (`always_glyph`): ZeRO-3 gathers a module's parameters on every rank together, and a rank whose
    batch holds no glyph or no image would otherwise skip a gather the others wait in."""
    args = hy15_cond.text_inputs(batch["text_embeds"], batch["glyph_embeds"], device=device, dtype=torch.float32,
                                 always_glyph=True)
    if dit_config.vision_projection != "none" and "image_embeds" not in batch:
        B = len(batch["text_embeds"])
        args.update(image_embeds=torch.zeros(B, 1, dit_config.vision_states_dim, device=device),
                    image_mask=torch.zeros(B, 1, dtype=torch.bool, device=device))
    return args.pop("context"), args


# Tencent's train.py trains t2v and i2v samples through one DiT input ([noisy | cond | mask], zeros for t2v):
# the conditioning object is the job's whatever its datasets (`HY15Conditioning`).
TRAINING = Training(
    conditioning=lambda i2v_mode, patch_size, mask_first_frame_loss, last_frame: hy15_cond.HY15Conditioning(),
    conditions_t2v=True,
    cache_item=lambda vae, video, i2v_mode, last_frame, image_encoder: hy15_cond.encode_hy15_conditioning(
        vae, video[:, :, 0], image_encoder),  # SigLIP reads the first frame as uint8, as Tencent's train.py
    cond_keys=("first_frame_latents", "image_embeds"),
    text_entry=lambda e: {"text_embeds": e.text.float(), "glyph_embeds": e.glyph.float()},
    text_inputs=_hy15_text_inputs,
    prompt=lambda entry: hy15_enc.HY15PromptEmbeds(entry["text_embeds"], entry["glyph_embeds"]),
)


def _image_encoder_fits(source, cfg) -> str | None:
    width, where = hy15_image_encoder_width(source)
    if width == cfg.vision_states_dim:
        return None
    return (f"an image encoder of width {width} ({where}), but the DiT reads image embeds of width "
            f"{cfg.vision_states_dim}; accepted: an image encoder of width {cfg.vision_states_dim} (the DiT's own)")


def _lora_from_file(sd: dict, source: str) -> dict:
    """ComfyUI's fused `<stream>_attn_qkv` adapters back into our split q / k / v ones (`hy15_lora_split`)."""
    return hy15_lora_split(sd, source) if any("_attn_qkv.lora_" in k for k in sd) else sd


def _activations(cfg, grid, setting, *, lora_rank, s, fused, inputs):
    text_len, glyph_len, image_len = inputs["text_tokens"]
    return hy15_activation_bytes(cfg, grid, setting, lora_rank=lora_rank, s=s, text_len=text_len,
                                 glyph_len=glyph_len, image_len=image_len)


def _encoder_parameters(preset: Preset, parts) -> dict:
    """The released (or tiny) architectures on the meta device (2 s: asked only when files are missing)."""
    counts = hy15_enc.encoder_parameters(preset.text_encoder, preset.image_encoder)
    if "vae" in parts:
        with torch.device("meta"):
            counts["vae"] = sum(p.numel() for p in HunyuanVideo15VAE(preset.vae).parameters())
    return {part: counts[part] for part in parts}


MEMORY = MemoryModel(
    activations=_activations,
    job_inputs=lambda job, preset: {"text_tokens": hy15_text_tokens(preset, any(d.do_i2v for d in job.process.datasets))},
    encoder_parameters=_encoder_parameters,
    # Qwen2.5-VL's language model + ByT5; SigLIP (i2v)
    encoder_files={"vae": (("vae", ()),), "text_encoder": (("text_encoder", ()), ("text_encoder_2", ())),
                   "image_encoder": (("image_encoder", ()),)},
)

FAMILY = Family(
    name="hunyuan15", title="HunyuanVideo 1.5", presets=HY15_PRESETS, trains=("video_dit", "ai-toolkit"),
    load_dit=hy15_load.load_hy15_dit, load_vae=load_hy15_vae, load_text_encoder=_hy15_text_encoder,
    load_image_encoder=_hy15_image_encoder, dit_config=hy15_load.dit_config, claims=hy15_load.claims,
    # Tencent's DiT config has no _class_name: its own key names it
    claims_config=lambda config: "mm_double_blocks_depth" in config, claim_order=0,  # the strict key test first
    classes=(*hy15_load.PIPELINE_TASKS, *hy15_load.DIT_CLASSES),
    pipeline=_hy15_pipeline, image_embeds=_hy15_image_embeds, random_source=_hy15_random,
    folder_source=_hy15_folder,
    accepts={"vae": "the HunyuanVideo 1.5 VAE: a vae/ folder (diffusers' or Tencent's) or a .safetensors file",
             "text_encoder": "a diffusers HunyuanVideo 1.5 folder holding text_encoder/ + tokenizer/ (Qwen2.5-VL) "
                             "and text_encoder_2/ + tokenizer_2/ (ByT5), or put them next to the model; "
                             + hy15_enc._download(hy15_enc.REPO_T2V, HY15_TEXT_PARTS),
             "image_encoder": "a diffusers HunyuanVideo 1.5 i2v folder holding image_encoder/ + feature_extractor/ "
                              "(SigLIP): " + hy15_enc._download(hy15_enc.REPO_I2V, ("image_encoder", "feature_extractor"))},
    needs={"text_encoder": "the Qwen2.5-VL and ByT5 text encoders",
           "image_encoder": "SigLIP (HunyuanVideo 1.5 image-to-video), never random here",
           "text_folder": "no text_encoder/ and text_encoder_2/ folders in it",
           "no_images": "is a text-to-video model (it reads no SigLIP image embeds)"},
    # Tencent's train.py trains t2v and i2v through one DiT input: i2v only by the checkpoint's task
    natural_i2v=lambda cfg, task, z_dim=None: "concat" if task is not None and task[0] == "i2v" else None,
    i2v_only=lambda cfg: False,
    reads_images=lambda spec: spec.i2v_mode is not None, last_frame=lambda cfg, i2v_mode: "no",
    image_encoder_fits=_image_encoder_fits, task_of=hy15_load.task_of,
    lora_targets=lambda include_img_emb: HY15_LORA_TARGETS,  # (its SigLIP projection trains in full jobs only)
    image_branch_lora=lambda cfg: False,
    lora_to_comfy=hy15_lora_to_comfy,  # q / k / v fused as ComfyUI's HunyuanVideo LoRA keys name them
    lora_from_file=_lora_from_file,
    arch=DiTArch(HunyuanVideo15DiT, hy15_dit.init_parameter, hy15_dit.param_dtypes, hy15_dit.cast_hy15_dit,
                 hy15_load.open_hy15_dit, hy15_dit.FLOAT32_MODULES,
                 embedders=("img_in", "txt_in", "byt5_in", "vision_in"), block_list="double_blocks"),
    flops=hy15_dit_flops, training=TRAINING, memory=MEMORY,
    sampling_schedule=hy15_schedule, sampling_grids=("reference",), solvers=("euler",),
    # hyvideo/pipelines/hunyuan_video_pipeline.py lines 99-101 (flow_shift 7, guidance 6, 50 steps are the
    # class defaults; a diffusers folder's scheduler and guider configs then give its shift and guidance)
    sampling_defaults=dict(solver="euler", steps=50, shift=7.0, guidance=6.0, negative=""),
    sampling_origin="Tencent's HunyuanVideo 1.5 pipeline defaults (no preset known)", fps=24,  # generate.py line 48
    refused_flags={"--last-image": "HunyuanVideo 1.5 takes a first frame only",
                   "--tokenizer": "HunyuanVideo 1.5's text encoders load from a diffusers folder"},
)
