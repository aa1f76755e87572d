"""The HunyuanVideo 1.5 presets (Tencent-Hunyuan/HunyuanVideo-1.5; diffusers'
hunyuanvideo-community/HunyuanVideo-1.5-*): every released variant and the tiny seeded ones for tests."""

from __future__ import annotations

from dataclasses import replace

from video_dit.families.contract import Preset, lookup_preset
from video_dit.families.hunyuan15.config import HY15_DIT_CONFIGS
from video_dit.families.hunyuan15.encoders import HY15_SIGLIP, HY15_TEXT, TINY_HY15_SIGLIP, TINY_HY15_TEXT
from video_dit.families.hunyuan15.vae import HY15_VAE_CONFIG, HY15_VAE_TINY

# The tiny presets' sampling defaults. No reference: Euler at 20 steps, shift 3, guidance 5, no negative
# prompt (the text encoder is random); 24 fps as Tencent's.
TINY_SAMPLING = dict(sample_solver="euler", sample_steps=20, sample_shift=3.0, sample_guidance=5.0, sample_negative="",
                     train_shift=3.0, fps=24, sample_size=(17, 64, 64))  # the embedded demo's clip size, as Wan's tiny

# HunyuanVideo 1.5 (Tencent-Hunyuan/HunyuanVideo-1.5; diffusers' hunyuanvideo-community/HunyuanVideo-1.5-*).
# Every released variant has one DiT architecture (HY15_DIT_CONFIGS), the one VAE and the Qwen2.5-VL + ByT5
# text encoders; i2v variants add SigLIP. Sampling defaults are Tencent's (diffusers' conversion script
# writes the same into each folder's scheduler / guider configs, scripts/convert_hunyuan_video1_5_to_diffusers.py
# lines 79-131):
#   shift and guidance: hyvideo/commons/__init__.py lines 48-105 (PIPELINE_CONFIGS; README.md lines 347-357):
#     480p 5.0, 720p t2v 9.0, 720p i2v 7.0, 480p i2v step-distilled 7.0; guidance 6.0, 1.0 when distilled;
#   steps: 50 (hyvideo/pipelines/hunyuan_video_pipeline.py line 101; README.md line 361: the cfg-distilled
#     models "must use 50 steps"), 12 for the step-distilled model (hyvideo/commons/__init__.py line 104);
#   solver: Euler, the only one of Tencent's FlowMatchDiscreteScheduler (scheduling_flow_match_discrete.py
#     lines 79-83), on its grid (flow.sampling_schedule grid "hunyuan");
#   negative prompt: "" (generate.py line 282, --negative_prompt default); fps 24 (generate.py line 48);
#   train shift 3.0: Tencent's train.py line 140 (train_timestep_shift, the training timesteps of `train.timestep_type: shift`).
# i2v_mode "concat": the i2v models read the first frame's latent and a mask in extra input channels (and
# SigLIP tokens), frame 0 is generated (nothing replaces it): Wan I2V's "concat" semantics. t2v: None.
# The 720p sparse-attention variant (720p_i2v_distilled_sparse) needs Tencent's SSTA kernel: not a preset.
#   default size (frames, height, width): diffusers' HunyuanVideo15Pipeline, 121 frames (pipeline_hunyuan_video1_5.py
#     line 550), 16:9 at the transformer's `target_size` (line 652: `calculate_default_height_width(9, 16,
#     target_size)`; scripts/convert_hunyuan_video1_5_to_diffusers.py lines 47-76: 640 for 480p, 960 for 720p),
#     which gives 480 x 848 and 720 x 1280.
_HY15 = dict(sample_solver="euler", sample_steps=50, sample_negative="", train_shift=3.0, fps=24)
_SIZE = {"480p": (121, 480, 848), "720p": (121, 720, 1280)}


def _hy15(name: str, variant: str, shift: float, guidance: float, i2v: bool, **changes) -> Preset:
    return Preset(name, "hunyuan15", HY15_DIT_CONFIGS[variant], HY15_VAE_CONFIG, "hy15", HY15_TEXT,
                  **{**_HY15, "sample_shift": shift, "sample_guidance": guidance, "i2v_mode": "concat" if i2v else None,
                     "image_encoder": HY15_SIGLIP if i2v else None, "sample_size": _SIZE[variant[:4]], **changes})


# Tiny HunyuanVideo 1.5 (random init, tests): the tiny DiT (HY15_DIT_CONFIGS "tiny_t2v") with its text,
# glyph and image widths those of the tiny seeded encoders (32 each), the tiny VAE; the tiny sampling defaults.
TINY_HY15_DIT = replace(HY15_DIT_CONFIGS["tiny_t2v"], text_states_dim=TINY_HY15_TEXT.text_dim,
                        byt5_states_dim=TINY_HY15_TEXT.glyph_dim, vision_states_dim=TINY_HY15_SIGLIP.hidden_size)

HY15_PRESETS: dict[str, Preset] = {
    p.name: p
    for p in [
        _hy15("hunyuan15-480p-t2v", "480p_t2v", shift=5.0, guidance=6.0, i2v=False),
        _hy15("hunyuan15-480p-i2v", "480p_i2v", shift=5.0, guidance=6.0, i2v=True),
        _hy15("hunyuan15-720p-t2v", "720p_t2v", shift=9.0, guidance=6.0, i2v=False),
        _hy15("hunyuan15-720p-i2v", "720p_i2v", shift=7.0, guidance=6.0, i2v=True),
        _hy15("hunyuan15-480p-t2v-cfg-distilled", "480p_t2v_distilled", shift=5.0, guidance=1.0, i2v=False),
        _hy15("hunyuan15-480p-i2v-cfg-distilled", "480p_i2v_distilled", shift=5.0, guidance=1.0, i2v=True),
        _hy15("hunyuan15-720p-i2v-cfg-distilled", "720p_i2v_distilled", shift=7.0, guidance=1.0, i2v=True),
        _hy15("hunyuan15-480p-i2v-step-distilled", "480p_i2v_step_distilled", shift=7.0, guidance=1.0, i2v=True,
              sample_steps=12),
        Preset("tiny-hy15-t2v", "hunyuan15", TINY_HY15_DIT, HY15_VAE_TINY, "hy15-tiny", TINY_HY15_TEXT,
               **TINY_SAMPLING),
        Preset("tiny-hy15-i2v", "hunyuan15", TINY_HY15_DIT, HY15_VAE_TINY, "hy15-tiny", TINY_HY15_TEXT,
               **TINY_SAMPLING, i2v_mode="concat",
               image_encoder=TINY_HY15_SIGLIP),
    ]
}


def get_preset(name: str) -> Preset:
    """This family's preset called `name` (a KeyError naming the nearest and listing them otherwise)."""
    return lookup_preset(HY15_PRESETS, name)
