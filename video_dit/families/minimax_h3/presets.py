"""The MiniMax H3 presets: the two released checkpoint partitions and a tiny seeded model for tests. Beside the
house's `Preset` (DiT, VAE, conditioner, sampling defaults), each H3 preset has its audio VAE (`AUDIO`), and the
family samples two schedules in one loop: the video's (the preset's `sample_shift`) and the audio's (`AUDIO_SHIFT`).

Sources (mirrors under /work/.mirror; "MiniMax" is MiniMax-AI/MiniMax-H3 at commit 8d8824e, "diffusers" is
diffusers 0.42.1 as installed, "ai-toolkit" is ostris/ai-toolkit at 27a03a91):
  [M]  MiniMax FL2VA/model_index.json `_minimax_h3.sigma_shift_scales`: video 12.0, audio 3.0 (the same in
       Ref2VA/); scheduler/ and audio_scheduler/scheduler_config.json (`MiniMaxH3Scheduler`, shift 12.0 / 3.0);
       README: 24 fps output, 32 kHz stereo audio, "The released checkpoints are CFG-distilled", FL2VA serves
       t2va and fl2va (zero, one or two keyframes), Ref2VA serves ref2va; 4 to 15 seconds.
  [D]  diffusers modular_pipelines/minimax_h3: `num_inference_steps` 50 (modular_pipeline_utils.py's template
       default), counting the sigma grid's terminal 0 (scheduling_minimax_h3.py `set_timesteps`: 49 model
       evaluations); `num_frames` 124 (before_denoise.py `MiniMaxH3PrepareLayoutStep`); no guider, no negative
       prompt (the checkpoint is guidance-distilled: one forward per step); the canvas short edge 768, at most
       768 x 1344 pixels (`canvas_short_edge`, `canvas_max_pixels`), 1344 x 768 for 16:9; 5 to 15 s at 24 fps.
  [A]  ai-toolkit extensions_built_in/diffusion_models/minimax_h3 (a trainer of H3; MiniMax publishes none):
       its training scheduler shifts by `VIDEO_SIGMA_SHIFT` 12.0 (`scheduler_config`), and the audio stream's
       sigma is the video's moved from the shift-12 onto the shift-3 schedule (`remap_sigma`).
The house counts `steps` as model evaluations (flow.SamplingSchedule): the reference's 50 grid points are 49 here.
"""

from __future__ import annotations

from dataclasses import replace

from video_dit.families.contract import Preset, lookup_preset
from video_dit.families.minimax_h3.audio_config import H3_AUDIO_VAE, H3_AUDIO_VAE_TINY, H3AudioVAEConfig
from video_dit.families.minimax_h3.dit_config import H3_DIT_CONFIGS
from video_dit.families.minimax_h3.encoders import H3_QWEN3VL, TINY_QWEN3VL
from video_dit.families.minimax_h3.vae_config import FPS, H3_VAE, H3_VAE_TINY

VIDEO_SHIFT, AUDIO_SHIFT = 12.0, 3.0  # [M] sigma_shift_scales
SAMPLE_STEPS = 49                      # [D] num_inference_steps 50 grid points, the terminal 0 among them
NUM_FRAMES = 124                       # [D] the default request: 17 x 7 + 5 frames, 5.17 s at 24 fps
KEYFRAME_NOISE = 0.999                 # [D] `keyframe_noise_aug`: a keyframe's rows are held at t = 0.999

_RELEASED = dict(family="minimax_h3", vae=H3_VAE, vae_name="minimax-h3", text_encoder=H3_QWEN3VL,
                 sample_solver="euler", sample_steps=SAMPLE_STEPS, sample_shift=VIDEO_SHIFT,
                 sample_guidance=1.0, sample_negative="",  # [M][D] guidance-distilled: no unconditional pass
                 train_shift=VIDEO_SHIFT,                  # [A] (no trainer of MiniMax's own is published)
                 fps=FPS,                                  # [M][D] 24 fps only
                 sample_size=(NUM_FRAMES, 768, 1344))      # [D] the default request, its 16:9 canvas

# The tiny model: every part random and small, its widths fitted to one another: the DiT reads the tiny video
# VAE's 4 latent channels, the tiny audio VAE's 8, the tiny Qwen3-VL's 32-wide rows.
TINY_DIT = replace(H3_DIT_CONFIGS["tiny"], in_channels=H3_VAE_TINY.latent_channels,
                   audio_in_channels=H3_AUDIO_VAE_TINY.latent_channels, text_dim=TINY_QWEN3VL.hidden_size)

H3_PRESETS: dict[str, Preset] = {
    # FL2VA/transformer (diffusers `transformer/`): t2va and first / last keyframe
    "minimax-h3-fl2va": Preset(name="minimax-h3-fl2va", dit=H3_DIT_CONFIGS["fl2va"], **_RELEASED),
    # Ref2VA/transformer (diffusers `transformer_ref/`): the same architecture, its own weights; its references
    # (images, videos, sounds before the target) are not sampled here (pipeline.py samples the fl2va layout)
    "minimax-h3-ref2va": Preset(name="minimax-h3-ref2va", dit=H3_DIT_CONFIGS["ref2va"], **_RELEASED),
    # ours (no reference): the release's sampling at 8 steps
    "tiny-h3": Preset(name="tiny-h3", dit=TINY_DIT, **{**_RELEASED, "vae": H3_VAE_TINY, "vae_name": "minimax-h3-tiny",
                                                        "text_encoder": TINY_QWEN3VL, "sample_steps": 8,
                                                        # the other tiny presets' 64 px clip, at 17 n + 5 frames
                                                        "sample_size": (22, 64, 64)}),
}

# The audio VAE of each preset
AUDIO: dict[str, H3AudioVAEConfig] = {"minimax-h3-fl2va": H3_AUDIO_VAE, "minimax-h3-ref2va": H3_AUDIO_VAE,
                                      "tiny-h3": H3_AUDIO_VAE_TINY}
TINY_PRESETS = ("tiny-h3",)  # every part random (seeded); the released ones are never random-initialised


def audio_timesteps(t):
    """The audio stream's timesteps (0..1000) paired with the video's `t` (0..1000): the noise level the video's
    shift-12 schedule reaches, moved onto the audio's shift-3 schedule at the same point of the unshifted grid
    (s = t / 1000, u = s / (12 - 11 s), s_a = 3 u / (1 + 2 u)). The sampler's two schedules pair their steps so
    ([M]: one grid, two shifts); [A] trains the audio stream at this sigma (`remap_sigma`)."""
    s = t / 1000.0
    base = s / (VIDEO_SHIFT + s * (1.0 - VIDEO_SHIFT))
    return 1000.0 * AUDIO_SHIFT * base / (1.0 + (AUDIO_SHIFT - 1.0) * base)


def get_preset(name: str) -> Preset:
    """The H3 preset `name`; an unknown name is a KeyError naming the nearest."""
    return lookup_preset(H3_PRESETS, name, "MiniMax H3")
