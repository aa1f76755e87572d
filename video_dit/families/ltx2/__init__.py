"""LTX-2 (Lightricks: LTX-2, 2.3, 2.5): one audio-video DiT generating a clip and its sound, as one family.
Its files:

    dit_config.py  LTX2DiTConfig         dit.py, layers.py   the DiT (`LTX2DiT`, both streams)
    vae*.py        the video VAE          audio_*.py, vocoder.py, mel.py, codec.py   the audio codec
    vae_stage.py   the embedded audio-video demo's first stage: the tiny video VAE and audio codec trained
    text_encoder.py, connectors.py   Gemma 3 + the text connectors (`LTX2PromptEncoder`)
    convert.py     the DiT's key layouts and ComfyUI's LoRA keys   loading.py   the loaders, detection
    presets.py     the released models and the tiny ones            pipeline.py  sampling with sound
    memory.py      the activation model (exact on CPU ranks, tests/test_plan_ltx2.py)

`FAMILY` is its record (`video_dit.families.contract.Family`), registered by `video_dit.families`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from video_dit.diffusion.conditioning import FirstFrameConditioning, encode_conditioning
from video_dit.diffusion.flow import DYNAMIC_GRID
from video_dit.families.contract import AudioPath, DiTArch, Family, MemoryModel, Preset, Training
from video_dit.families.ltx2 import loading as ltx2_load
from video_dit.families.ltx2.convert import ltx2_config_to_diffusers, ltx2_lora_keys, ltx2_lora_to_comfy
from video_dit.families.ltx2.dit import (FLOAT32_MODULES, LORA_STREAMS, LORA_TARGETS, LTX2DiT, cast_ltx2_dit,
                                         init_parameter, ltx2_dit_flops, param_dtypes)
from video_dit.families.ltx2.memory import audio_tokens_of, ltx2_activation_bytes
from video_dit.families.ltx2.pipeline import LTX2Pipeline, ltx2_schedule
from video_dit.families.ltx2.presets import LTX2_NEGATIVE_PROMPT, LTX2_PRESETS, LTX2_SHIFT
from video_dit.families.ltx2.text_encoder import LTX2PromptEmbeds
from video_dit.families.ltx2.vae import LTX2VideoVAE
from video_dit.families.ltx2.vae_config import PRESETS as VAE_PRESETS
from video_dit.families.ltx2.vae_stage import train_tiny_codec, train_tiny_vae
from video_dit.models.weights import WeightsError


def _pipeline(dit, vae, *, image_encoder=None, i2v_mode=None, audio_codec=None):
    """LTX-2's pipeline; its first frame conditions in "replace" mode whatever `i2v_mode` (no other exists)."""
    if image_encoder is not None:
        raise ValueError("LTX-2 reads no image encoder (its first frame goes through the VAE)")
    return LTX2Pipeline(dit, vae, audio_codec)


def _pad_stack(rows: list[torch.Tensor], device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(B, Lt, D) of B (Lt_i, D) rows right-padded with zeros, and the (B, Lt) mask (None: all as long)."""
    n = max(r.shape[0] for r in rows)
    out = torch.stack([F.pad(r, (0, 0, 0, n - r.shape[0])) for r in rows]).to(device)
    same = all(r.shape[0] == n for r in rows)
    return out, None if same else torch.stack([torch.arange(n) < r.shape[0] for r in rows]).to(device)


def _text_inputs(batch, device, dit_config):
    """A batch's cached contexts as the DiT takes them: the video context positionally, the audio one and the
    masks by keyword (every rank runs the same modules whatever its captions)."""
    video, video_mask = _pad_stack(list(batch["text_embeds"]), device)
    audio, audio_mask = _pad_stack(list(batch["audio_context"]), device)
    return video, {"audio_context": audio, "video_context_mask": video_mask, "audio_context_mask": audio_mask}


# ltx-trainer (training_strategies/text_to_video.py) conditions on the first frame by replacing latent frame 0
# with its clean latent, its tokens at timestep 0 and out of the loss: `FirstFrameConditioning("replace")`,
# whose per-token timesteps follow the DiT's token order (frame, row, column; LTX-2's temporal patch is 1).
TRAINING = Training(
    conditioning=lambda i2v_mode, patch_size, mask_first_frame_loss, last_frame: FirstFrameConditioning(
        i2v_mode, patch_size=tuple(patch_size), mask_first_frame_loss=mask_first_frame_loss, last_frame=last_frame),
    conditions_t2v=False,
    cache_item=lambda vae, video, i2v_mode, last_frame, image_encoder: encode_conditioning(
        vae, video, i2v_mode, video.shape[2]),
    cond_keys=("first_frame_latents",),
    # what a caption caches: each connector's context (Lt, D) (`LTX2PromptEncoder.encode`); the video's under the
    # name every family's main text has (ai-toolkit reads a prompt's batch size from `text_embeds`)
    text_entry=lambda e: {"text_embeds": e.video.float(), "audio_context": e.audio.float()},
    text_inputs=_text_inputs,
    prompt=lambda entry: LTX2PromptEmbeds(entry["text_embeds"], entry["audio_context"]),
)


def _activations(cfg, grid, setting, *, lora_rank, s, fused, inputs):
    # every caption is the connectors' max_length rows (its tokens, then registers): no text key mask
    return ltx2_activation_bytes(cfg, grid, setting, lora_rank=lora_rank, s=s, text_len=inputs["text_len"],
                                 audio_tokens=audio_tokens_of(grid, inputs["fps"], inputs["temporal"]),
                                 per_token=inputs["per_token"],
                                 text_masked=False, lora_streams=inputs["streams"])


def _job_inputs(job, preset) -> dict:
    """The connectors' length (every caption padded to the Gemma's max_length), the frame rate the audio's
    length follows (the datasets' lowest: the most audio tokens for a clip's frames) and the VAE's frames per
    latent frame, per-token timesteps (image-to-video datasets), the streams a LoRA adapts (`network.streams`)."""
    gemma = preset.text_encoder.gemma
    fps = min((d.fps for d in job.process.datasets if d.fps), default=preset.fps)
    return {"text_len": gemma.max_length if gemma is not None else 1024, "fps": fps,
            "temporal": preset.vae.temporal_compression, "per_token": any(d.do_i2v for d in job.process.datasets),
            "streams": job.process.network.lora_streams if job.process.network is not None else "both"}


def _encoder_parameters(preset: Preset, parts) -> dict:
    """The VAE, the connectors and the Gemma from their architectures on the meta device: the tiny Gemma, or
    Gemma 3 12B's language model (LTX-2.0, 2.3: `GEMMA3_12B_TEXT`); LTX-2.5's Gemma 4 is counted from its
    files only (its architecture is not built here)."""
    counts = {}
    if "vae" in parts:
        with torch.device("meta"):
            counts["vae"] = sum(p.numel() for p in LTX2VideoVAE(preset.vae).parameters())
    if "text_encoder" in parts:
        from video_dit.families.ltx2.connectors import LTX2TextConnectors
        from video_dit.families.ltx2.text_encoder import gemma3_12b_parameters, tiny_gemma3_text_model

        text = preset.text_encoder
        if text.gemma is None or text.connectors is None:
            raise WeightsError(f"preset {preset.name}: its Gemma 4 is counted from its files' headers; give the "
                               f"text encoder folder ({ltx2_load.DOWNLOAD})")
        with torch.device("meta"):
            connectors = sum(p.numel() for p in LTX2TextConnectors(text.connectors).parameters())
        gemma = sum(p.numel() for p in tiny_gemma3_text_model(0).parameters()) if text.tiny \
            else gemma3_12b_parameters()
        counts["text_encoder"] = connectors + gemma
    if "image_encoder" in parts:
        counts["image_encoder"] = 0
    return counts


MEMORY = MemoryModel(
    activations=_activations, job_inputs=_job_inputs, encoder_parameters=_encoder_parameters,
    # Gemma 3's checkpoint is the multimodal model: its language model only (the loader frees the rest)
    encoder_files={"vae": (("vae", ()),),
                   "text_encoder": (("text_encoder", ("vision_tower.", "multi_modal_projector.", "lm_head.",
                                                      "model.vision_tower.", "model.multi_modal_projector.")),
                                    ("connectors", ()))},
)


def _no_image_encoder(*args, **kwargs):
    raise ValueError("LTX-2 reads no image encoder: its first frame goes through the VAE")


FAMILY = Family(
    name="ltx2", title="LTX-2", presets=LTX2_PRESETS,
    # our trainer (its audio path: the codec caches each clip's track, the step trains both streams) and the
    # ai-toolkit arch (its `do_audio` datasets' tracks through ai-toolkit's audio channel: integrations/ai_toolkit)
    trains=("video_dit", "ai-toolkit"),
    load_dit=ltx2_load.load_ltx2_dit, load_vae=ltx2_load.load_vae, load_text_encoder=ltx2_load.load_prompt_encoder,
    load_image_encoder=_no_image_encoder, dit_config=ltx2_load.dit_config, claims=ltx2_load.claims,
    claims_config=ltx2_load.claims_config, claim_order=0,  # the strict key test (every DiT key mapped)
    classes=(*ltx2_load.PIPELINE_CLASSES, *ltx2_load.DIT_CLASSES),
    pipeline=_pipeline, image_embeds=_no_image_encoder, random_source=ltx2_load.random_source,
    folder_source=ltx2_load.folder_source,
    accepts={"vae": "the LTX-2 video VAE: a diffusers vae/ folder, Lightricks' single file (its vae.*) or a VAE file",
             "text_encoder": "a diffusers LTX-2 folder (text_encoder/ + tokenizer/ + connectors/), or "
                             "GEMMA_FOLDER::CONNECTORS (a Gemma 3 folder and Lightricks' single file holding the "
                             f"connectors); {ltx2_load.DOWNLOAD}",
             "image_encoder": "none: LTX-2 reads no image encoder",
             "audio": "the audio VAE and vocoder: a diffusers LTX-2 folder (audio_vae/ + vocoder/) or Lightricks' "
                      "single file (audio_vae.*, vocoder.*)"},
    needs={"text_encoder": "Gemma 3 and LTX-2's text connectors",
           "image_encoder": "no image encoder",
           "text_folder": "no text_encoder/ + tokenizer/ + connectors/ folders in it",
           "no_images": "is an LTX-2 model (it reads no image encoder)",
           "audio": "its audio VAE and vocoder (the DiT generates sound with the picture)"},
    natural_i2v=lambda cfg, task, z_dim=None: "replace", i2v_only=lambda cfg: False,
    reads_images=lambda spec: False, last_frame=lambda cfg, i2v_mode: "no",
    image_encoder_fits=lambda source, cfg: "LTX-2 reads no image encoder",
    lora_targets=lambda include_img_emb: LORA_TARGETS, image_branch_lora=lambda cfg: False,
    lora_to_comfy=ltx2_lora_to_comfy,  # ComfyUI's LTX-2 keys are Lightricks' names under diffusion_model.
    lora_from_file=ltx2_lora_keys,
    arch=DiTArch(LTX2DiT, init_parameter, param_dtypes, cast_ltx2_dit, ltx2_load.open_ltx2_dit, FLOAT32_MODULES,
                 embedders=("patchify_proj", "audio_patchify_proj", "caption_projection", "audio_caption_projection"),
                 block_list="transformer_blocks"),
    # the house's signature counts the video tokens; the audio stream's (`audio_tokens`) is the caller's to add
    flops=lambda cfg, num_tokens, text_len, batch=1, audio_tokens=0: ltx2_dit_flops(cfg, num_tokens, audio_tokens,
                                                                                    text_len, batch),
    training=TRAINING, memory=MEMORY,
    sampling_schedule=ltx2_schedule, sampling_grids=("reference", DYNAMIC_GRID), solvers=("euler",),
    negative_prompts={LTX2_NEGATIVE_PROMPT: "Lightricks' default"},
    # ltx-pipelines' LTX-2.3 defaults (utils/constants.py LTX_2_3_PARAMS, DEFAULT_NEGATIVE_PROMPT; ltx-core
    # LTX2Scheduler's shift): a model whose preset is not known
    sampling_defaults=dict(solver="euler", steps=30, shift=LTX2_SHIFT, guidance=3.0, negative=LTX2_NEGATIVE_PROMPT),
    sampling_origin="Lightricks' ltx-pipelines LTX-2.3 defaults (no preset known)", fps=24,
    refused_flags={"--last-image": "LTX-2 takes a first frame only here (its keyframe conditioning is not built)",
                   "--tokenizer": "LTX-2's Gemma loads its tokenizer from its own folder"},
    vae_presets=VAE_PRESETS,
    vae_stage=train_tiny_vae,  # the embedded audio-video demo's first stage (vae_stage.py), and its codec's below
    # ltx-trainer: one sigma for both streams (text_to_video.py `_prepare_audio_inputs`: "same sigma as video"),
    # loss = video_loss + audio_loss (`compute_loss`)
    # rate / channels: the audio VAE's mel front end (16 kHz stereo, every release); out_rate: LTX-2.3's and 2.5's
    # vocoder (LTX-2.0's writes 24 kHz, the tiny preset's 8 kHz: a loaded codec's `out_rate` is its own)
    # lora_streams: each stream's own attentions and FFN, the cross-modal attention with the stream it writes
    # (dit.py LORA_STREAMS: audio_to_video_attn the video's, video_to_audio_attn the audio's)
    audio=AudioPath(rate=16000, channels=2, out_rate=48000, load_codec=ltx2_load.load_codec, timesteps="tied",
                    loss_weight=1.0, lora_streams=LORA_STREAMS, codec_stage=train_tiny_codec),
    # a saved folder's config.json is diffusers' (what `dit_config` reads from a folder)
    config_json=lambda cfg: {"_class_name": ltx2_load.DIT_CLASSES[0], **ltx2_config_to_diffusers(cfg)},
)
