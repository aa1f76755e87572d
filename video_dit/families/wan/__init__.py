"""Wan 2.1 / 2.2 (Wan-Video/Wan2.1, Wan2.2): T2V, I2V with CLIP, FLF2V, TI2V-5B and the two-expert A14B
models, as one family. Its files:

    config.py        DiTConfig                     dit.py, layers.py   the DiT (`VideoDiT`)
    vae.py, vae_layers.py   the causal VAE (Wan 2.1 / 2.2)   text_encoder.py   umT5   image_encoder.py   CLIP
    convert.py       diffusers / ComfyUI / original key layouts   loading.py   the loaders
    presets.py       the released models and the tiny ones      pipeline.py   sampling (`VideoPipeline`)
    schedule.py      Wan's UniPC grid                            memory.py     the activation model

`FAMILY` is its record (`video_dit.families.contract.Family`), registered by `video_dit.families`.
"""

from __future__ import annotations

import torch

from video_dit.devices import to_device
from video_dit.diffusion.conditioning import MASK_CHANNELS, FirstFrameConditioning, encode_conditioning
from video_dit.families.contract import DiTArch, Family, MemoryModel, Preset, Training
from video_dit.families.wan import dit as wan_dit
from video_dit.families.wan import loading as wan_load
from video_dit.families.wan import memory as wan_memory
from video_dit.families.wan.convert import dit_key_layout
from video_dit.families.wan.dit import VideoDiT, dit_flops
from video_dit.families.wan.dit import lora_targets as wan_lora_targets
from video_dit.families.wan.image_encoder import build_clip_vision
from video_dit.families.wan.pipeline import VideoPipeline, image_features
from video_dit.families.wan.presets import (
    VAE_PRESETS,
    WAN21_FLF2V_NEGATIVE_PROMPT,
    WAN21_I2V_NEGATIVE_PROMPT,
    WAN_NEGATIVE_PROMPT,
    WAN_PRESETS,
)
from video_dit.families.wan.schedule import wan_schedule
from video_dit.families.wan.text_encoder import build_umt5
from video_dit.families.wan.vae import CausalVideoVAE
from video_dit.families.wan.vae_stage import train_tiny_vae
from video_dit.lora import to_comfy
from video_dit.models.layouts import diffusers_folder


def wan_natural_i2v(cfg, z_dim: int | None = None) -> str | None:
    """"replace" when a Wan DiT's input is its output, "concat" when its input holds the output's channels,
    the 4 mask channels and the conditioning latents (`z_dim`: the VAE's; unknown: as many as out_dim)."""
    z = cfg.out_dim if z_dim is None else z_dim
    return {cfg.out_dim: "replace", cfg.out_dim + MASK_CHANNELS + z: "concat"}.get(cfg.in_dim)


def _claims(meta: dict) -> bool:
    try:
        dit_key_layout(meta)
    except ValueError:
        return False
    return True


def _random(preset: Preset, part: str) -> str | None:
    """The tiny presets' random parts: the tiny VAE, the ByT5-tokenised umT5, a small CLIP (never ViT-H/14)."""
    if part == "vae":
        return f"preset:{preset.vae_name}" if preset.vae_name == "tiny" else None
    if part == "text_encoder":
        return f"preset:{preset.name}" if preset.text_encoder.tokenizer == "byt5" else None
    own = preset.image_encoder
    return f"preset:{preset.name}" if own is not None and own.hidden_size != 1280 else None


def _pipeline(dit, vae, *, image_encoder=None, i2v_mode=None):
    return VideoPipeline(dit, vae, image_encoder=image_encoder, i2v_mode=i2v_mode)


def _last_frame(cfg, i2v_mode: str | None) -> str:
    """FLF2V (Wan 2.1: an image branch reading two images, `img_emb.emb_pos`) needs the last frame; a concat
    model without an image branch (Wan 2.2 I2V) takes it (mask + VAE, as diffusers' pipeline allows); an
    image branch reading one image (Wan 2.1 I2V) or replace mode cannot."""
    if cfg.image_dim is not None:
        return "required" if cfg.num_images == 2 else "no"
    return "optional" if i2v_mode == "concat" else "no"


def _image_encoder_fits(source, cfg) -> str | None:
    """Whether a CLIP source's features are what the DiT's image branch reads (width, tokens per image)."""
    width, tokens = wan_load.image_encoder_shape(source)
    want = (cfg.image_dim, cfg.image_tokens)
    if (width, tokens) == want:
        return None
    return (f"a CLIP image encoder of width {width} with {tokens} tokens per image; the DiT's image branch reads "
            f"width {want[0]} x {want[1]} tokens (accepted: "
            f"{'ViT-H/14 at 224 px' if want[0] == 1280 else 'the preset image encoder'})")


def _activations(cfg, grid, setting, *, lora_rank, s, fused, inputs):
    return wan_memory.activation_bytes(cfg, grid, setting, lora_rank=lora_rank, s=s, fused=fused,
                                       per_token=inputs["per_token"], lora_img_emb=inputs["lora_img_emb"])


def _job_inputs(job, preset) -> dict:
    """Per-token timesteps (replace-mode i2v datasets) and LoRA on the image MLP change what a step keeps."""
    p = job.process
    return {"per_token": any(d.do_i2v for d in p.datasets) and p.i2v_mode == "replace",
            "lora_img_emb": bool(p.network is not None and p.network.include_img_emb)}


def _encoder_parameters(preset: Preset, parts) -> dict:
    """The released architectures on the meta device; CLIP counted whole (an upper bound: the trainer drops
    its last block, quanto's fp8 halves it)."""
    counts = {}
    if "text_encoder" in parts:
        counts["text_encoder"] = sum(p.numel() for p in build_umt5(preset.text_encoder, device="meta").parameters())
    if "vae" in parts:
        with torch.device("meta"):
            counts["vae"] = sum(p.numel() for p in CausalVideoVAE(preset.vae).parameters())
    if "image_encoder" in parts:
        counts["image_encoder"] = sum(p.numel() for p in build_clip_vision(preset.image_encoder,
                                                                             device="meta").parameters())
    return counts


TRAINING = Training(
    # the i2v mode, the DiT's patch, `mask_first_frame_loss` (None: the mode's default), a first-last-frame job
    conditioning=lambda i2v_mode, patch_size, mask_first_frame_loss, last_frame: FirstFrameConditioning(
        i2v_mode, patch_size=tuple(patch_size), mask_first_frame_loss=mask_first_frame_loss, last_frame=last_frame),
    conditions_t2v=False,
    cache_item=lambda vae, video, i2v_mode, last_frame, image_encoder: encode_conditioning(
        vae, video, i2v_mode, video.shape[2], image_encoder=image_encoder,
        last_frame=video[:, :, -1] if last_frame else None),
    cond_keys=("first_frame_latents", "cond_latents", "clip_features"),
    text_entry=lambda e: {"text_embeds": e.float()},
    text_inputs=lambda batch, device, dit_config: ([to_device(e, device) for e in batch["text_embeds"]], {}),
    prompt=lambda entry: entry["text_embeds"],
)

MEMORY = MemoryModel(
    activations=_activations, job_inputs=_job_inputs, encoder_parameters=_encoder_parameters,
    # a full umT5 checkpoint: its encoder only; CLIP is always counted from its architecture (above)
    encoder_files={"vae": (("vae", ()),), "text_encoder": (("text_encoder", ("decoder.", "lm_head.")),)},
)

FAMILY = Family(
    name="wan", title="Wan 2.1 / 2.2", presets=WAN_PRESETS, trains=("video_dit", "ai-toolkit"),
    load_dit=wan_load.load_dit, load_vae=wan_load.load_vae, load_text_encoder=wan_load.load_text_encoder,
    load_image_encoder=wan_load.load_image_encoder, dit_config=lambda source: wan_load.open_dit(source)[1],
    claims=_claims, claims_config=lambda config: False, claim_order=1,  # after stricter tests: diffusers' proj_out
    classes=("WanPipeline", "WanImageToVideoPipeline", "WanVideoToVideoPipeline", "WanVACEPipeline",
             "WanTransformer3DModel", "WanModel"),
    pipeline=_pipeline,
    image_embeds=lambda encoder, image, last, height, width: image_features(encoder, image, last),  # as given
    random_source=_random, folder_source=diffusers_folder,
    accepts={"vae": "a Wan VAE .pth/.safetensors or a vae/ folder",
             "text_encoder": "a folder holding text_encoder/ and tokenizer/, or put them next to the model",
             "image_encoder": "clip_vision_h.safetensors from ComfyUI, Wan's models_clip_open-clip-xlm-roberta-"
                              "large-vit-huge-14.pth, or a folder with image_encoder/ + image_processor/ from "
                              "diffusers"},
    needs={"text_encoder": "the umT5 text encoder", "image_encoder": "the CLIP image branch (Wan 2.1 I2V / FLF2V), "
                                                                      "whose ViT-H/14 is never random here",
           "text_folder": "no text_encoder/ folder in it", "no_images": "has no CLIP image branch"},
    natural_i2v=lambda cfg, task, z_dim=None: wan_natural_i2v(cfg, z_dim), i2v_only=lambda cfg: cfg.i2v_only,
    reads_images=lambda spec: spec.dit_shape.image_dim is not None, last_frame=_last_frame,
    image_encoder_fits=_image_encoder_fits,
    lora_targets=wan_lora_targets, image_branch_lora=lambda cfg: cfg.image_dim is not None,
    lora_to_comfy=to_comfy, lora_from_file=lambda sd, source: sd,  # native names are ComfyUI's
    arch=DiTArch(VideoDiT, wan_dit.init_parameter, wan_dit.param_dtypes, wan_dit.cast_dit, wan_load.open_dit,
                 wan_dit.FLOAT32_MODULES, embedders=("patch_embedding", "text_embedding"), block_list="blocks"),
    flops=dit_flops, training=TRAINING, memory=MEMORY,
    sampling_schedule=wan_schedule, sampling_grids=("reference", "diffusers"),
    negative_prompts={WAN_NEGATIVE_PROMPT: "Wan's default", WAN21_I2V_NEGATIVE_PROMPT: "Wan 2.1 I2V's default",
                      WAN21_FLF2V_NEGATIVE_PROMPT: "Wan 2.1 FLF2V's default"},
    # Wan2.1 generate.py's defaults for a t2v task (lines 72, 77, 231, 244) and wan/configs/shared_config.py
    sampling_defaults=dict(solver="unipc", steps=50, shift=5.0, guidance=5.0, negative=WAN_NEGATIVE_PROMPT),
    sampling_origin="Wan's generate.py defaults (no preset known)", fps=16,
    vae_presets=VAE_PRESETS, vae_stage=train_tiny_vae,
)
