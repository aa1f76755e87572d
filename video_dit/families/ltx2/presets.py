"""The LTX-2 presets (Lightricks/LTX-2, LTX-2.3, LTX-2.5; diffusers' Lightricks/LTX-2* folders): the released
non-distilled ("dev") models and the tiny seeded ones for tests. Beside the house's `Preset` (DiT, VAE, text
encoder, sampling defaults), each LTX-2 preset has its audio codec (audio VAE + vocoder: `AUDIO`) and the
guidance its reference samples with beyond the video's CFG scale (`guidance_for`).

Sources (read in the mirrors under /work/.mirror; "ltx-pipelines" is Lightricks/LTX-2 at commit 400fd31,
"diffusers" is diffusers 0.42.1 as installed):
  [P]  ltx-pipelines utils/constants.py: `LTX_2_PARAMS` (2.0: 40 steps, stg_blocks [29]), `LTX_2_3_PARAMS`
       (2.3: 30 steps, stg_blocks [28]), `LTX_2_4_PARAMS` (2.4 and later, so 2.5: 2.3's, image CRF 18);
       `MultiModalGuiderParams` video cfg 3.0, audio cfg 7.0, stg 1.0, rescale 0.7, modality 3.0 (both
       streams); frame_rate 24.0; `DEFAULT_NEGATIVE_PROMPT`; `DEFAULT_IMAGE_CRF` 33, `LTX_2_4_IMAGE_CRF` 18.
  [S]  ltx-core components/schedulers.py `LTX2Scheduler.execute(steps)`: max_shift 2.05, base_shift 0.95,
       terminal 0.1, stretched, evaluated at its default 4096 tokens (every ltx-pipelines call but the HQ
       one passes no latent): the shift exp(2.05) on every resolution. Euler (`EulerDiffusionStep`).
  [D]  diffusers pipeline_ltx2.py `LTX2Pipeline.__call__` defaults: 30 steps, guidance 3.0, audio 7.0, stg 1.0
       (blocks [28]), modality 3.0, rescale 0.7, frame_rate 24.0, negative prompt "" (encode_prompt); its
       scheduler (scripts/convert_ltx2_to_diffusers.py): FlowMatchEulerDiscreteScheduler with dynamic
       shifting (base 0.95 at 1024 tokens, max 2.05 at 4096) and shift_terminal 0.1, so the shift follows
       the video token count.
Where they differ the presets follow Lightricks' (the model's own code): 40 steps for 2.0 (diffusers 30), STG
at block 29 for 2.0 (diffusers [28], and its converted 2.0 transformer has no perturbable attention), the
negative prompt [P] (diffusers ""), the shift of [S] at every size (diffusers': by token count; a diffusers
folder's scheduler config still gives its own, `sampling_settings`). Not presets: the distilled checkpoints
(8 steps on `DISTILLED_SIGMA_VALUES`, a fixed sigma list this house's schedules do not carry yet), the
two-stage pipelines' upsampler, LTX-2.5's diffusion decoder (its conv decoder, the 2.3 VAE, is used here).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from video_dit.families.contract import Preset
from video_dit.families.ltx2.audio_config import (
    LTX2_AUDIO_VAE, LTX2_VOCODER, LTX23_VOCODER, AudioVAEConfig, VocoderBWEConfig, VocoderConfig)
from video_dit.families.ltx2.connectors import LTX2_CONNECTORS, LTX23_CONNECTORS, ConnectorConfig, StreamConfig
from video_dit.families.ltx2.dit_config import LTX2_DIT_CONFIGS, LTX2DiTConfig
from video_dit.families.ltx2.text_encoder import LTX2_GEMMA, TINY_GEMMA, LTX2TextEncoderConfig
from video_dit.families.ltx2.vae_config import PRESETS as VAE_PRESETS

# [P] DEFAULT_NEGATIVE_PROMPT, word for word
LTX2_NEGATIVE_PROMPT = (
    "has_subtitles, has_blurbox, transition from black, transition to black, speech_ending_short, "
    "blurry, out of focus, overexposed, underexposed, low contrast, washed out colors, excessive noise, "
    "grainy texture, poor lighting, flickering, motion blur, distorted proportions, unnatural skin tones, "
    "deformed facial features, asymmetrical face, missing facial features, extra limbs, disfigured hands, "
    "wrong hand count, artifacts around text, inconsistent perspective, camera shake, incorrect depth of "
    "field, background too sharp, background clutter, distracting reflections, harsh shadows, inconsistent "
    "lighting direction, color banding, cartoonish rendering, 3D CGI look, unrealistic materials, uncanny "
    "valley effect, incorrect ethnicity, wrong gender, exaggerated expressions, wrong gaze direction, "
    "mismatched lip sync, silent or muted audio, distorted voice, robotic voice, echo, background noise, "
    "off-sync audio, incorrect dialogue, added dialogue, repetitive speech, jittery movement, awkward "
    "pauses, incorrect timing, unnatural transitions, inconsistent framing, tilted camera, flat lighting, "
    "inconsistent tone, cinematic oversaturation, stylized filters, or AI artifacts.")

# [S]: the schedule's shift (exp(mu), mu = max_shift at 4096 tokens) and its anchors; `pipeline.ltx2_schedule`
MAX_SHIFT, BASE_SHIFT, BASE_TOKENS, MAX_TOKENS, TERMINAL = 2.05, 0.95, 1024, 4096, 0.1
LTX2_SHIFT = math.exp(MAX_SHIFT)  # 7.7679...


@dataclass(frozen=True)
class LTX2TextConfig:
    """What turns a prompt into the DiT's two contexts: the Gemma (its width and states) and the connectors."""

    gemma: LTX2TextEncoderConfig | None  # None: a text encoder not built here (LTX-2.5's Gemma 4)
    connectors: ConnectorConfig | None

    @property
    def tiny(self) -> bool:
        return self.gemma is not None and self.gemma.tiny


@dataclass(frozen=True)
class LTX2AudioConfig:
    """The audio codec of a preset: the audio VAE (with its mel front end's numbers) and the vocoder."""

    vae: AudioVAEConfig
    vocoder: VocoderConfig | VocoderBWEConfig
    tiny: bool = False

    @property
    def out_rate(self) -> int:
        return self.vocoder.output_sampling_rate


@dataclass(frozen=True)
class LTX2Guidance:
    """The reference's guidance beyond the video's CFG scale (`generate(guidance_scale=)`), per stream, as
    ltx-core's `MultiModalGuider` combines them on the denoised latents:
        x0 = cond + (cfg - 1)(cond - uncond) + stg (cond - perturbed) + (modality - 1)(cond - isolated)
        x0 *= rescale * std(cond) / std(x0) + (1 - rescale)                     (rescale > 0)
    perturbed: the pass with each stream's self-attention skipped in its `stg_blocks`; isolated: the pass
    without audio<->video attention. A scale at its neutral value (stg 0, modality 1) skips its pass."""

    audio_cfg: float = 7.0
    stg: float = 1.0
    audio_stg: float = 1.0
    stg_blocks: tuple[int, ...] = (28,)
    audio_stg_blocks: tuple[int, ...] = (28,)
    modality: float = 3.0
    audio_modality: float = 3.0
    rescale: float = 0.7
    audio_rescale: float = 0.7
    image_crf: int = 33  # the H.264 CRF a conditioning image is re-compressed at (0: none) [P]

    def __post_init__(self):
        for name in ("audio_cfg", "stg", "audio_stg", "modality", "audio_modality", "rescale", "audio_rescale"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"LTX2Guidance.{name}={value!r}; accepted: a number >= 0")
        for name in ("stg_blocks", "audio_stg_blocks"):
            object.__setattr__(self, name, tuple(int(b) for b in getattr(self, name)))
            if any(b < 0 for b in getattr(self, name)):
                raise ValueError(f"LTX2Guidance.{name}={getattr(self, name)}; accepted: block indices >= 0")
        if not isinstance(self.image_crf, int) or not 0 <= self.image_crf <= 51:
            raise ValueError(f"LTX2Guidance.image_crf={self.image_crf!r}; accepted: an H.264 CRF 0..51 (0: none)")


def guidance_for(cfg: LTX2DiTConfig) -> LTX2Guidance:
    """The reference's guidance for a DiT of this variant [P]: LTX-2.0 (caption projections in the DiT, no
    text adaLN) STG at block 29, LTX-2.3 and later at 28; LTX-2.5 (the keyframe embedding: the 2.4+ lineage)
    re-compresses a conditioning image at CRF 18, earlier ones at 33. A block past the DiT's last (a tiny
    test model) skips nothing, as in ltx-core: its STG pass is the conditional one and adds 0."""
    if not cfg.cross_attention_adaln:
        return LTX2Guidance(stg_blocks=(29,), audio_stg_blocks=(29,))
    return LTX2Guidance(image_crf=18 if cfg.use_keyframes_abs_pos_embedding else 33)


# ---------------------------------------------------------------- released

LTX2_TEXT = LTX2TextConfig(LTX2_GEMMA, LTX2_CONNECTORS)        # Gemma 3 12B + LTX-2's connectors
LTX23_TEXT = LTX2TextConfig(LTX2_GEMMA, LTX23_CONNECTORS)      # Gemma 3 12B + LTX-2.3's (v2, 8 blocks)
# LTX-2.5 reads a Gemma 4 (`gemma4_unified`), whose width and depth size its connectors' input (diffusers'
# converter derives them from its config); neither is built here: None, refused by the loader naming this
LTX25_TEXT = LTX2TextConfig(None, None)

_DEV = dict(sample_solver="euler", sample_shift=LTX2_SHIFT, sample_guidance=3.0, sample_negative=LTX2_NEGATIVE_PROMPT,
            # `timestep_type: shift` at ltx-trainer's 4096-token shift; ltx-trainer's own draw is a stretched
            # shifted logit-normal whose mean follows the token count (timestep_samplers.py)
            train_shift=LTX2_SHIFT, fps=24,
            # [P] `PipelineParams`: num_frames 121, stage_1_height 512, stage_1_width 768 (the one-stage size)
            sample_size=(121, 512, 768))


def _dev(name: str, version: str, vae: str, text: LTX2TextConfig, steps: int) -> Preset:
    """One released model: text-to-video, and image-to-video on the same weights (the first frame's latent
    replaces latent frame 0 at timestep 0, as ltx-pipelines and ltx-trainer condition it: "replace")."""
    return Preset(name, "ltx2", LTX2_DIT_CONFIGS[version], VAE_PRESETS[vae], vae, text, sample_steps=steps,
                  i2v_mode="replace", **_DEV)


# ---------------------------------------------------------------- tiny (random init, tests)

# 2.3's flags at the tiny widths (video 2 x 16, audio 2 x 8, 2 blocks, 8 latent channels); the audio at the
# release's rates (16 kHz, hop 160: 25 latent frames a second), so the positions and the data path agree
TINY_LTX2_DIT = LTX2_DIT_CONFIGS["tiny_2.3"]
# the tiny Gemma (16 wide, 3 states), LTX-2.3's feature extractor, one gated block per stream at the DiT's widths
TINY_LTX2_CONNECTORS = ConnectorConfig(
    caption_channels=TINY_GEMMA.hidden_size, text_states=TINY_GEMMA.num_layers + 1,
    video=StreamConfig(heads=2, head_dim=16, layers=1, registers=8, gated_attention=True),
    audio=StreamConfig(heads=2, head_dim=8, layers=1, registers=8, gated_attention=True),
    feature_extractor="v2", proj_bias=True, rope_max_pos=32)
TINY_LTX2_TEXT = LTX2TextConfig(TINY_GEMMA, TINY_LTX2_CONNECTORS)
# 16 mel bins, 2 latent channels (tokens 2 x 4 = the DiT's 8), one res block per level; a HiFi-GAN vocoder of
# hop 80 (5 x 4 x 4) on the 100 mel frames a second: 8 kHz, an AAC rate
TINY_LTX2_AUDIO = LTX2AudioConfig(
    AudioVAEConfig(ch=8, num_res_blocks=1, z_channels=2, mel_bins=16, resolution=16),
    VocoderConfig(in_channels=32, upsample_initial_channel=16, upsample_rates=(5, 4, 4),
                  upsample_kernel_sizes=(11, 8, 8), resblock_kernel_sizes=(3,), resblock_dilation_sizes=((1, 3, 5),),
                  output_sampling_rate=8000),
    tiny=True)
# No reference: Euler at 8 steps, the release's shift and guidance, no negative prompt (the text encoder is random)
_TINY = dict(sample_solver="euler", sample_steps=8, sample_shift=LTX2_SHIFT, sample_guidance=3.0, sample_negative="",
             train_shift=LTX2_SHIFT, fps=24, sample_size=(17, 64, 64))  # the other tiny presets' clip, 8k + 1 frames

# The embedded audio-video demo's model (configs/demo_av_tiny.yaml; docs/demo_recipe.md, "The audio-video demo"):
# LTX-2.3's blocks at the video demo's sizes. Video: the demo VAE's 8 x 8 x 4 cell of 16 channels
# (`vae_config.LTX2_VAE_DEMO`) in 2 x 2 patches (80 tokens for 17 frames of 64 x 64, as Wan's `tiny`), 4 heads of
# 32 (128 wide, Wan's `tiny` width), 4 blocks. Audio: 4 heads of 16 (the heads must equal the video's), tokens of
# 4 channels x 16 latent mel bins.
# The sound's frame rate. A mel vocoder is equivariant to a shift of one mel frame (its output moves by one hop),
# so on a steady tone, whose log-mel is the same in every frame, it writes a signal that repeats every hop: its
# pitch can only sit on a multiple of the frame rate (measured: a tiny vocoder at the release's 100 frames a
# second sounded 300, 400 and 1000 Hz for notes of 220 to 1109 Hz). At 25 frames a second (hop 640 at 16 kHz)
# every demo note (demo_av.NOTES) is within 0.4 semitone of a multiple of 25 Hz, and a clip's 17 frames at 16 fps
# hold 7 audio latent frames.
DEMO_MEL_HOP = 640
DEMO_LTX2_DIT = replace(
    TINY_LTX2_DIT, in_channels=16, out_channels=16, patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=32,
    cross_attention_dim=128, audio_in_channels=64, audio_out_channels=64, audio_num_attention_heads=4,
    audio_attention_head_dim=16, audio_cross_attention_dim=64, num_layers=4, vae_scale_factors=(4, 8, 8),
    audio_hop_length=DEMO_MEL_HOP)
DEMO_LTX2_TEXT = LTX2TextConfig(TINY_GEMMA, replace(
    TINY_LTX2_CONNECTORS, video=StreamConfig(heads=4, head_dim=32, layers=1, registers=8, gated_attention=True),
    audio=StreamConfig(heads=4, head_dim=16, layers=1, registers=8, gated_attention=True)))
# 64 mel bins (the release's) at 25 frames a second, 4 latent channels x 16 bins; a HiFi-GAN vocoder writing 8 kHz
# (every note below 1.2 kHz) in one 320x upsample: the frame's waveform from a learned table
DEMO_LTX2_AUDIO = LTX2AudioConfig(
    AudioVAEConfig(ch=16, num_res_blocks=1, z_channels=4, mel_bins=64, mel_hop_length=DEMO_MEL_HOP, resolution=16),
    VocoderConfig(in_channels=128, upsample_initial_channel=64, upsample_rates=(320,), upsample_kernel_sizes=(640,),
                  resblock_kernel_sizes=(3,), resblock_dilation_sizes=((1, 3, 5),), output_sampling_rate=8000),
    tiny=True)
# No reference: the video demo's sampling (Euler, 20 steps, shift 3: its recipe's), its 16 fps
_DEMO = dict(sample_solver="euler", sample_steps=20, sample_shift=3.0, sample_guidance=1.0, sample_negative="",
             train_shift=3.0, fps=16, sample_size=(17, 64, 64))  # the demo's clips (configs/demo_av_tiny.yaml)

LTX2_PRESETS: dict[str, Preset] = {
    p.name: p
    for p in [
        _dev("ltx2-19b-dev", "2.0", "ltx2.0", LTX2_TEXT, steps=40),       # Lightricks/LTX-2 ltx-2-19b-dev
        _dev("ltx2.3-22b-dev", "2.3", "ltx2.3", LTX23_TEXT, steps=30),    # Lightricks/LTX-2.3 ltx-2.3-22b-dev
        _dev("ltx2.5-dev", "2.5", "ltx2.5", LTX25_TEXT, steps=30),        # Lightricks/LTX-2.5 (its file name: not read)
        # image-to-video needs no other preset: any LTX-2 DiT takes the first frame in "replace" mode
        Preset("tiny-ltx2-t2v", "ltx2", TINY_LTX2_DIT, VAE_PRESETS["ltx2-tiny"], "ltx2-tiny", TINY_LTX2_TEXT, **_TINY),
        Preset("tiny-ltx2-demo", "ltx2", DEMO_LTX2_DIT, VAE_PRESETS["ltx2-demo"], "ltx2-demo", DEMO_LTX2_TEXT,
               i2v_mode="replace", **_DEMO),
    ]
}

# The audio codec of each preset: LTX-2.0's HiFi-GAN (24 kHz), LTX-2.3's and 2.5's BigVGAN + bandwidth
# extension (48 kHz); one audio VAE for all (diffusers' converter: "Same config as LTX-2.0 / 2.3")
AUDIO: dict[str, LTX2AudioConfig] = {
    name: (DEMO_LTX2_AUDIO if name == "tiny-ltx2-demo" else TINY_LTX2_AUDIO if name.startswith("tiny-") else
           LTX2AudioConfig(LTX2_AUDIO_VAE, LTX2_VOCODER if name.startswith("ltx2-19b") else LTX23_VOCODER))
    for name in LTX2_PRESETS
}


def get_preset(name: str) -> Preset:
    """This family's preset called `name`; another name is a KeyError listing this family's presets."""
    if name not in LTX2_PRESETS:
        raise KeyError(f"{name!r} is not a preset of this family; accepted: {', '.join(LTX2_PRESETS)}")
    return LTX2_PRESETS[name]
