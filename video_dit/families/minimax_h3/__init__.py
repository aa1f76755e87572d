"""MiniMax H3 (MiniMax-AI/MiniMax-H3): one audio-video DiT over one packed sequence of text, keyframe, audio and
video rows, as one family. Its files:

    dit_config.py  H3DiTConfig        dit.py, layers.py, packing.py   the DiT (`H3DiT`) and its packed layout
    vae*.py        the video VAE (17 n + 5 frames)                   audio_*.py, codec.py   the audio VAE, codec
    encoders.py    the Qwen3-VL conditioner (`H3TextEncoder`)
    convert.py     the DiT's key layouts and the LoRA keys          loading.py  the loaders, detection
    presets.py     the released partitions and the tiny model       pipeline.py t2va / fl2va sampling with sound
    memory.py      the activation model (exact on CPU ranks: tests/test_plan_h3.py)
    conditioning.py  the first keyframe in training (a do_i2v dataset), as ai-toolkit's H3 trainer builds it

`FAMILY` is its record (`video_dit.families.contract.Family`), registered by `video_dit.families`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from video_dit.families.contract import AudioPath, DiTArch, Family, MemoryModel, Preset, Training
from video_dit.families.minimax_h3 import loading as h3_load
from video_dit.families.minimax_h3.convert import h3_lora_from_file, h3_lora_to_comfy
from video_dit.families.minimax_h3.dit import (FLOAT32_MODULES, LORA_TARGETS, H3DiT, cast_h3_dit, h3_dit_flops,
                                               init_parameter, param_dtypes)
from video_dit.families.minimax_h3.conditioning import (H3KeyframeConditioning, batch_tags, keyframe_latents, prompt,
                                                       text_entry)
from video_dit.families.minimax_h3.encoders import TEXT_LAYER, vision_block_rows
from video_dit.families.minimax_h3.memory import PLAN_TEXT_TOKENS, h3_activation_bytes
from video_dit.families.minimax_h3.pipeline import GRIDS, H3Pipeline, fit_keyframes, h3_schedule
from video_dit.families.minimax_h3.presets import (AUDIO, H3_PRESETS, SAMPLE_STEPS, TINY_PRESETS, VIDEO_SHIFT,
                                                   audio_timesteps)
from video_dit.families.minimax_h3.vae import H3VideoVAE
from video_dit.families.minimax_h3.vae_config import FPS
from video_dit.families.minimax_h3.vae_config import PRESETS as VAE_PRESETS


def _pipeline(dit, vae, *, image_encoder=None, i2v_mode=None, audio_codec=None):
    """MiniMax H3's pipeline: t2va, and fl2va with keyframes (they are conditioning rows, whatever `i2v_mode`)."""
    if image_encoder is not None:
        raise ValueError("MiniMax H3 reads no image encoder (its keyframes go through the VAE and the conditioner)")
    return H3Pipeline(dit, vae, audio_codec)


def _pad_stack(rows: list[torch.Tensor], device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(B, Lt, D) of B (Lt_i, D) rows right-padded with zeros, and the (B, Lt) mask (None: all as long)."""
    n = max(r.shape[0] for r in rows)
    out = torch.stack([F.pad(r, (0, 0, 0, n - r.shape[0])) for r in rows]).to(device)
    same = all(r.shape[0] == n for r in rows)
    return out, None if same else torch.stack([torch.arange(n) < r.shape[0] for r in rows]).to(device)


def _text_inputs(batch, device, dit_config):
    """A batch's cached captions as the DiT takes them: the rows right-padded (B, Lt, D), their mask (each sample's
    padded rows masked as keys and its media clock at its own length, as its request alone) and, for captions
    presented with their clip's keyframe, the rows' modality tags (Lt,) the batch shares (`batch_tags`)."""
    rows = list(batch["text_embeds"])
    text, mask = _pad_stack(rows, device)
    tags = batch_tags(batch.get("text_tags"), [r.shape[0] for r in rows])
    return text, {"text_mask": mask, **({} if tags is None else {"text_tags": tags.to(device)})}


def _conditioning(i2v_mode, patch_size, mask_first_frame_loss, last_frame):
    """The first keyframe's rows (conditioning.py); the job's i2v mode is None (the keyframe is rows of its own, no
    input channels or frame replaced)."""
    if last_frame:
        raise ValueError("MiniMax H3 trains the first keyframe only (ai-toolkit's H3 trainer's fl2va; a last "
                         "keyframe is sampled, not trained here); accepted: do_flf2v false")
    return H3KeyframeConditioning(mask_first_frame_loss)


# ai-toolkit's H3 trainer: a do_i2v clip's first frame as a keyframe row held at t = 0.999, its caption presented with
# that frame (conditioning.py; the conditioner's presentation: `Family.prompt_images`, which the trainer's text cache
# asks for each conditioned clip)
TRAINING = Training(
    conditioning=_conditioning, conditions_t2v=False,
    cache_item=lambda vae, video, i2v_mode, last_frame, image_encoder: keyframe_latents(vae, video),
    cond_keys=("first_frame_latents",), text_entry=text_entry, text_inputs=_text_inputs, prompt=prompt,
)


def _audio_frames(grid, vae, fps: float, audio) -> int:
    """Audio latents per channel beside a latent grid (F', h, w): its 17 n + 5 pixel frames at fps, 40 a second."""
    return audio.latent_frames(vae.pixel_frames(grid[0]), fps)


def _activations(cfg, grid, setting, *, lora_rank, s, fused, inputs):
    """A first-frame job's step (the most rows): one keyframe latent frame of rows, and its caption presented with
    the frame: the vision block's rows beside the caption's (`encoders.vision_block_rows`)."""
    keyframes, text_len = inputs["keyframes"], inputs["text_len"]
    if keyframes:
        cell = inputs["vae"].spatial_compression
        text_len += vision_block_rows(inputs["text_encoder"], grid[1] * cell, grid[2] * cell)
    return h3_activation_bytes(cfg, grid, setting, lora_rank=lora_rank, s=s, text_len=text_len,
                               audio_frames=_audio_frames(grid, inputs["vae"], inputs["fps"], inputs["audio"]),
                               keyframes=keyframes, presented=bool(keyframes))


def _job_inputs(job, preset) -> dict:
    """The caption rows the plan assumes (`memory.PLAN_TEXT_TOKENS`), the VAE's frame rule and the audio VAE's
    rate (the sound's latents follow the clip's frames at 24 fps); with a `do_i2v` dataset, the first keyframe
    (conditioning.py) and the conditioner that presents it."""
    keyframes = 1 if any(d.do_i2v for d in job.process.datasets) else 0
    return {"text_len": PLAN_TEXT_TOKENS, "vae": preset.vae, "fps": preset.fps, "audio": AUDIO[preset.name],
            "keyframes": keyframes, "text_encoder": preset.text_encoder}


# The released conditioner's architecture ([M] FL2VA/text_encoder/config.json, MiniMax-AI/MiniMax-H3 8d8824e: the
# same in Ref2VA/), what `memory` counts without its files: Qwen3-VL's language model (64 decoder layers of 5120,
# of which the loader builds `TEXT_LAYER` = 50) and its 27-block vision tower.
QWEN3VL_TEXT = dict(hidden_size=5120, intermediate_size=25600, num_hidden_layers=64, num_attention_heads=64,
                    num_key_value_heads=8, head_dim=128, vocab_size=151936, attention_bias=False, rms_norm_eps=1e-6,
                    max_position_embeddings=262144, rope_parameters={"rope_type": "default", "rope_theta": 5000000.0,
                                                                     "mrope_section": [24, 20, 20],
                                                                     "mrope_interleaved": True})
QWEN3VL_VISION = dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, out_hidden_size=5120,
                      patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=2304,
                      deepstack_visual_indexes=[8, 16, 24], hidden_act="gelu_pytorch_tanh", in_channels=3)


def qwen3vl_parameters(layers: int = TEXT_LAYER) -> int:
    """The parameters of the released Qwen3-VL the loader builds (`encoders.load_h3_text_encoder`: `Qwen3VLModel`
    with `layers` decoder layers, no LM head), on the meta device."""
    from transformers import Qwen3VLConfig, Qwen3VLModel

    with torch.device("meta"):
        model = Qwen3VLModel(Qwen3VLConfig(text_config={**QWEN3VL_TEXT, "num_hidden_layers": layers},
                                           vision_config=QWEN3VL_VISION))
    return sum(p.numel() for p in model.parameters())


def _encoder_parameters(preset: Preset, parts) -> dict:
    """The VAE and the Qwen3-VL from their architectures on the meta device: the tiny one, or the released one
    (`qwen3vl_parameters`)."""
    counts = {}
    if "vae" in parts:
        with torch.device("meta"):
            counts["vae"] = sum(p.numel() for p in H3VideoVAE(preset.vae).parameters())
    if "text_encoder" in parts:
        if preset.name in TINY_PRESETS:
            from video_dit.families.minimax_h3.encoders import tiny_h3_text_encoder

            counts["text_encoder"] = sum(p.numel() for p in tiny_h3_text_encoder(0).parameters())
        else:
            counts["text_encoder"] = qwen3vl_parameters(preset.text_encoder.layer)
    if "image_encoder" in parts:
        counts["image_encoder"] = 0
    return counts


# The Qwen3-VL checkpoint (Qwen3VLForConditionalGeneration, 64 decoder layers released): the loader builds 50
# decoder layers and no LM head, so the rest of its files is not counted.
_UNREAD_TEXT = ("lm_head.", *(f"model.language_model.layers.{i}." for i in range(50, 64)))
MEMORY = MemoryModel(
    activations=_activations, job_inputs=_job_inputs, encoder_parameters=_encoder_parameters,
    encoder_files={"vae": (("vae", ()),), "text_encoder": (("text_encoder", _UNREAD_TEXT),)},
)


def _no_image_encoder(*args, **kwargs):
    raise ValueError("MiniMax H3 reads no image encoder: its keyframes go through the VAE and the conditioner")


FAMILY = Family(
    name="minimax_h3", title="MiniMax H3", presets=H3_PRESETS,
    trains=("video_dit", "ai-toolkit"),
    load_dit=h3_load.load_h3_dit, load_vae=h3_load.load_vae, load_text_encoder=h3_load.load_text_encoder,
    load_image_encoder=_no_image_encoder, dit_config=h3_load.dit_config, claims=h3_load.claims,
    claims_config=h3_load.claims_config, claim_order=0,  # the strict key test (every DiT key mapped)
    classes=(*h3_load.PIPELINE_CLASSES, *h3_load.DIT_CLASSES),
    pipeline=_pipeline, image_embeds=_no_image_encoder, random_source=h3_load.random_source,
    folder_source=h3_load.folder_source,
    accepts={"vae": "the MiniMax H3 video VAE: a diffusers vae/ folder, MiniMax's video_vae/ folder, a model folder "
                    "holding either, or a VAE file",
             "text_encoder": "a MiniMax H3 folder (text_encoder/ + tokenizer/ + processor/) or one Qwen3-VL folder; "
                             f"{h3_load.DOWNLOAD}",
             "image_encoder": "none: MiniMax H3 reads no image encoder",
             "audio": "the audio VAE: a MiniMax H3 folder with audio_vae/ (diffusers' or MiniMax's), or that folder"},
    needs={"text_encoder": "the Qwen3-VL conditioner", "image_encoder": "no image encoder",
           "text_folder": "no text_encoder/ + tokenizer/ folders in it",
           "no_images": "is a MiniMax H3 model (it reads no image encoder)",
           "audio": "its audio VAE (the DiT generates sound with the picture)"},
    # keyframes are sampled (fl2va: `video-dit sample --image / --last-image`) and the first one trained (a do_i2v
    # dataset: conditioning.py), as rows of their own: no first-frame mode of the input
    natural_i2v=lambda cfg, task, z_dim=None: None, i2v_only=lambda cfg: False,
    reads_images=lambda spec: False, last_frame=lambda cfg, i2v_mode: "no",
    image_encoder_fits=lambda source, cfg: "MiniMax H3 reads no image encoder",
    lora_targets=lambda include_img_emb: LORA_TARGETS, image_branch_lora=lambda cfg: False,
    # ComfyUI and diffusers' MiniMaxH3LoraLoaderMixin read `diffusion_model.<original module>` (convert.py)
    lora_to_comfy=h3_lora_to_comfy, lora_from_file=h3_lora_from_file,
    arch=DiTArch(H3DiT, init_parameter, param_dtypes, cast_h3_dit, h3_load.open_h3_dit, FLOAT32_MODULES,
                 embedders=("video_patch_proj", "audio_patch_proj", "condition_proj"), block_list="blocks"),
    # the house's signature counts the video tokens; the audio rows (`audio_tokens`: channels x latents) are the
    # caller's to add
    flops=lambda cfg, num_tokens, text_len, batch=1, audio_tokens=0: h3_dit_flops(cfg, num_tokens, text_len,
                                                                                  audio_tokens, batch),
    training=TRAINING, memory=MEMORY,
    sampling_schedule=h3_schedule, sampling_grids=GRIDS, solvers=("euler",),
    # a model whose preset is not known: the release's (presets.py, its sources)
    sampling_defaults=dict(solver="euler", steps=SAMPLE_STEPS, shift=VIDEO_SHIFT, guidance=1.0, negative=""),
    sampling_origin="MiniMax H3's released sampling (diffusers' modular pipeline; no preset known)", fps=FPS,
    refused_flags={"--tokenizer": "MiniMax H3's Qwen3-VL loads its tokenizer from its own folder"},
    vae_presets=VAE_PRESETS,
    scheduler_classes={"MiniMaxH3Scheduler": ("euler", "shift", {})},
    # the audio VAE: 32 kHz stereo in and out ([M] README; each channel a mono waveform through it); the audio's
    # noise level tied to the video's through the two schedules' pairing (presets.audio_timesteps, [A]
    # `remap_sigma`); the audio loss beside the video's at weight 1 ([A] ai-toolkit's `audio_loss_multiplier` 1.0);
    # no `lora_streams`: its blocks attend over one packed sequence of text, audio and video rows through the same
    # Linears (dit.py), so no LoRA target is one stream's alone (`network.streams` other than both is refused)
    audio=AudioPath(rate=32000, channels=2, out_rate=32000, load_codec=h3_load.load_codec, timesteps="tied",
                    loss_weight=1.0, tied_map=audio_timesteps),
    prompt_images=lambda first, last, height, width: fit_keyframes(first, last, height, width)[0],
)
