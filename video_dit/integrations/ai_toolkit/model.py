"""`model.arch: video_dit`: our DiT, VAE, text encoder and conditioning inside ai-toolkit's trainer.

    ai-toolkit (SDTrainer, BaseModel)            this adapter (our components, unchanged)
    -------------------------------------------  -----------------------------------------------------
    batch.tensor (B, F, 3, H, W) in [-1, 1]  ->  encode_images: VAE encode (mode) + normalize
                                                 -> latents (B, C, F', h, w)
    captions list[str]                       ->  get_prompt_embeds: TextEncoder -> [(Lt_i, D)] per prompt
    scheduler.add_noise(x0, noise, t)            x_t = (1 - t/1000) x0 + t/1000 noise, t on 0..1000
    predict_noise(x_t, t, embeds, batch)     ->  get_noise_prediction: FirstFrameConditioning (the object
                                                 our DeepSpeed trainer uses) -> VideoDiT -> (B, C, F', h, w)
    target                                   <-  get_loss_target: noise - x0
    mse(reduction="none") (B, C, F', h, w)   ->  scale_loss: i2v loss mask, renormalised to a masked mean
    LoRA state dict (`transformer.` peft)   <->  convert_lora_weights_before_save/load: our one LoRA file
    sample(): GenerateImageConfig            ->  generate_single_image: VideoPipeline -> PIL frames -> MP4

A model with sound (LTX-2, MiniMax H3: `Family.audio`) trains its audio stream through ai-toolkit's own channel
for it (its `do_audio` datasets, read from its ltx2 model at 27a03a91):
    file_item.audio_data {waveform (C, S), sample_rate}  ->  encode_audio: resampled to the codec's rate and
                                                             channels (`codec_wave`), the family's audio codec
                                                             -> normalized audio latents (B, ...) (cached)
    batch.audio_latents / batch.audio_data           ->  get_noise_prediction: the audio at its t (tied: the
                                                         video's through `AudioPath.tied_map`; independent: its
                                                         own draw, `model_kwargs.audio_timesteps`), the DiT's
                                                         audio prediction
    batch.audio_pred, batch.audio_target             ->  SDTrainer adds mse(audio_pred, audio_target) x
                                                         train.audio_loss_multiplier to the loss
A sample without sound (a `do_audio: false` dataset, an image, a clip without an audio stream) trains the
picture alone, as our trainer does (diffusion/objective.py): its audio input is pure noise at t = 1000 and
its audio loss 0 (its target is the prediction). Previews are MP4s with the AAC track.

It refuses, skips and warns as our DeepSpeed trainer does, through the same functions (`video_dit.spec`):
a LoRA on a preset's random init (`check_lora`) when ai-toolkit attaches its network (the `network`
setter: ai-toolkit builds the model from the `model` block alone, then the network right after
`load_model()`, before it reads any data); the stills of a `do_i2v` dataset on a concat model
(`diffusion.conditioning.stills_skipped`) with one warning per dataset at its first batch of them (ai-toolkit shows a model
its datasets no earlier), and a loss of exactly 0 that no weight gets a gradient from (ai-toolkit
cannot drop an item from a batch). Both read a dataset folder alike (`dataset.list_media`).

This is the only module that imports ai-toolkit (`toolkit`); `import video_dit` never does.
"""

from __future__ import annotations

# ai-toolkit first: without it this fails at once, before importing torch
try:
    from toolkit.advanced_prompt_embeds import AdvancedPromptEmbeds
    from toolkit.models.base_model import BaseModel
    from toolkit.samplers.custom_flowmatch_sampler import CustomFlowMatchEulerDiscreteScheduler
except ImportError as exc:  # ai-toolkit's registration catches ImportError and skips the package
    raise ImportError("video_dit.integrations.ai_toolkit runs inside ai-toolkit: its `toolkit` package must "
                      "be importable (run from an ai-toolkit checkout registered with `video-dit "
                      f"aitk-install AITK_DIR`): {exc}") from exc

import dataclasses
import functools
import json
import os
import re
import sys
import warnings
from dataclasses import dataclass
from typing import Literal

import av
import numpy as np
import torch
import torch.nn.functional as F
import yaml

from video_dit.data.audio import resampler_for
from video_dit.data.cache import latent_space, source_identity, text_space
from video_dit.data.dataset import VIDEO_EXTS, list_media
from video_dit.diffusion.conditioning import skipped_stills, stills_skipped
from video_dit.diffusion.experts import EXPERTS, TwoExperts, expert_at
from video_dit.diffusion.flow import NUM_TRAIN_TIMESTEPS, TimestepSampler, add_noise, velocity_target
from video_dit.families import PRESETS, Preset
from video_dit.integrations.ai_toolkit.job_checks import check_generation, check_job
from video_dit.lora import check_targets, from_comfy
from video_dit.media import load_image, write_video
from video_dit.models.common import te_quantization
from video_dit.models.layouts import SOURCES_FILE, mixed_outputs, preset_name
from video_dit.models.saved import write_model
from video_dit.models.weights import WeightsError, read_state_dict
from video_dit.spec import (
    AITK_KEYS,
    Request,
    check_dataset_i2v,
    check_lora,
    i2v_mode_of,
    resolve,
)
from video_dit.typed_config import ConfigError, parse

ARCH = "video_dit"
# ai-toolkit builds a first training scheduler from the class, before any preset is known
# (BaseSDTrainProcess calls the static get_train_scheduler() and hands it to the constructor); load_model
# replaces it with one at the preset's `train_shift`, and the trainer reads `sd.noise_scheduler` from
# then on. It draws training timesteps and adds noise (the shift applies with `timestep_type: shift`);
# previews use our own sampler at the preset's `sample_solver` and `sample_shift` (ai-toolkit gives steps, guidance).
TRAIN_SCHEDULER_CONFIG = {"num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": False}
# Bump when get_prompt_embeds / encode_images change what they compute: the numbers are part of
# ai-toolkit's text-embedding and latent cache keys, so old caches are recomputed, never reused.
TEXT_EMBEDDING_VERSION = 1
LATENT_VERSION = 1
PEFT_PREFIX = "transformer."  # ai-toolkit's LoRA key prefix for `is_transformer` models (peft format)
SAVED_SOURCES = SOURCES_FILE  # written by save_model beside full fine-tune weights, as our trainer's exports


def snap_num_frames(num_frames: int, snap_frames) -> int:
    """Frame count down to one the VAE encodes (`snap_frames`: its `VAEShape.snap_frames`, picklable, a
    frozen dataclass's bound method; module level, bound with functools.partial: ai-toolkit pickles the
    snapper).

    ai-toolkit's auto_frame_count asks for int(seconds * fps) frames, 0 for a clip shorter than one
    frame at the dataset fps; its own rule then keeps the key frame, so 0 gives 1 here too."""
    return snap_frames(max(1, int(num_frames)))


@dataclass
class ModelKwargs:
    """`model.model_kwargs` of the job file, which ai-toolkit hands to the model untouched.

    preset: names the DiT/VAE/text-encoder family; required when `name_or_path` is a weights path
        (`preset:NAME` implies it). i2v_mode: first-frame conditioning for `do_i2v` datasets; default:
        the preset's, else "replace" for a t2v DiT. attention_backend: "native" (SDPA, torch's kernel
        choice), "flash" or "flash3" (FlashAttention 2 / 3, their packages installed).
    mask_first_frame_loss: None = latent frame 0 out of the loss in replace mode, in it in concat
        mode; true masks it in either; false is concat only (the key our DeepSpeed trainer reads too).
    image_encoder_path: the CLIP image encoder of a Wan 2.1 I2V / FLF2V preset (default: the weights
        folder's image_encoder/, or a tiny preset's random one); quantize_image_encoder: qfloat8 weights.
        Both keys are our DeepSpeed trainer's too (ai-toolkit's ModelConfig would drop them elsewhere).
    train_high_noise / train_low_noise: a two-expert preset's experts to train (ai-toolkit's wan22_14b
        keys; None = true); boundary_ratio (ours): default the folder's model_index.json, else the preset's.
    audio_path: a model with sound (LTX-2, MiniMax H3): its audio codec (LTX-2: a diffusers folder with audio_vae/ +
        vocoder/, or Lightricks' single file); default: the model's own (`video-dit sample --audio-codec`).
    audio_timesteps: a model with sound: the audio stream's timesteps, our trainer's `train.audio_timesteps`
        (ai-toolkit's TrainConfig would drop an unknown train key, so the arch reads it here; our trainer reads
        it here too): "tied" (each sample's audio at the video's t, through the family's coupling of the two
        schedules where it has one, `AudioPath.tied_map`) or "independent" (its own draw from the job's timestep
        distribution, `audio_timestep_sampler`); None: the family's reference trainer's (`AudioPath.timesteps`).
    """

    preset: str | None = None
    i2v_mode: Literal["replace", "concat"] | None = None
    attention_backend: Literal["native", "flash", "flash3"] = "native"
    mask_first_frame_loss: bool | None = None
    image_encoder_path: str | None = None
    quantize_image_encoder: bool | None = None
    train_high_noise: bool | None = None
    train_low_noise: bool | None = None
    boundary_ratio: float | None = None
    audio_path: str | None = None
    audio_timesteps: Literal["tied", "independent"] | None = None

    def validate(self, path: str) -> None:
        if self.preset is not None and self.preset not in PRESETS:
            raise ConfigError(f"{path}.preset", f"unknown preset {self.preset!r}; accepted: {', '.join(PRESETS)}")


# The independent audio timesteps of a batch, kept on ai-toolkit's batch object for the step's other passes
AUDIO_T_ATTR = "video_dit_audio_timesteps"
# ai-toolkit's `train.timestep_type` values whose distribution our `TimestepSampler` draws (diffusion/flow.py: the
# same distributions, continuous where ai-toolkit picks a point of its 1000-point grid): shift (the scheduler's at
# the preset's `train_shift`), linear / weighted (uniform), sigmoid (logit-normal, mean 0, std 1)
AUDIO_T_KINDS = ("shift", "linear", "weighted", "sigmoid")


def audio_timestep_sampler(train, preset: Preset) -> TimestepSampler:
    """The distribution `model_kwargs.audio_timesteps: independent` draws the audio's timesteps from: the one
    ai-toolkit's trainer draws the video's from (`train` is its TrainConfig: `timestep_type`, `linear_timesteps`,
    BaseSDTrainProcess L1195-1225; its flowmatch scheduler at the preset's `train_shift`, `load_model`), as our
    trainer's sampler for the same keys (`train.trainer.timestep_sampler`: `timestep_type` at the preset's shift on
    0..1000). What the arch cannot draw alike is a ConfigError naming the key: a timestep_type outside
    `AUDIO_T_KINDS`, `content_or_style` other than balanced, a narrowed min / max_denoising_steps."""
    why = "with model_kwargs.audio_timesteps independent (the audio's own draw from the video's distribution)"
    linear = getattr(train, "linear_timesteps", False) or getattr(train, "linear_timesteps2", False)
    kind = "linear" if linear else getattr(train, "timestep_type", "sigmoid")
    if kind not in AUDIO_T_KINDS:
        raise ConfigError("train.timestep_type", f"{kind!r} {why}; accepted: {', '.join(AUDIO_T_KINDS)}, or "
                                                 "model_kwargs.audio_timesteps tied")
    if getattr(train, "content_or_style", "balanced") != "balanced":
        raise ConfigError("train.content_or_style", f"{train.content_or_style!r} {why}; accepted: balanced, or "
                                                    "model_kwargs.audio_timesteps tied")
    for key, full in (("min_denoising_steps", 0), ("max_denoising_steps", 999)):
        if getattr(train, key, full) != full:
            raise ConfigError(f"train.{key}", f"{getattr(train, key)!r} {why}; accepted: {full} (the whole "
                                              "schedule), or model_kwargs.audio_timesteps tied")
    return TimestepSampler(kind, shift=preset.train_shift)


def codec_wave(wave: torch.Tensor, rate: int, out_rate: int, channels: int) -> torch.Tensor:
    """ai-toolkit's track (C, S) float at `rate` -> (channels, round(S x out_rate / rate)) float32 at `out_rate`:
    what a family's codec reads (`AudioPath.rate` / `channels`), through PyAV's resampler as our data path reads a
    clip's track (data/audio.py `read_audio`: fltp, a downmix at unit gain, a mono track twice for stereo). A
    track already at the codec's rate and channels is returned as it is."""
    C, S = wave.shape
    if rate == out_rate and C == channels:
        return wave.float()
    if C not in (1, 2) or channels not in (1, 2):
        raise ValueError(f"an audio item of {C} channels for a codec of {channels}: mono and stereo are accepted")
    frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(wave.detach().float().cpu().numpy()), format="fltp",
                                       layout={1: "mono", 2: "stereo"}[C])
    frame.sample_rate = rate
    resampler, mixed, duplicate = resampler_for(C, out_rate, channels)
    parts = [o.to_ndarray() for o in (*resampler.resample(frame), *resampler.resample(None))]  # flushed
    out = torch.from_numpy(np.concatenate(parts, axis=1)) if parts else torch.zeros(mixed, 0)
    n = round(S * out_rate / rate)
    out = F.pad(out[:, :n], (0, max(0, n - out.shape[1])))  # (mixed, n): the resampler's length to the span's
    return out.repeat(2, 1) if duplicate else out


def plain_meta(meta) -> dict:
    """ai-toolkit's save metadata as plain YAML-able data. With the default `save.save_format:
    safetensors` it hands `save_model` an OrderedDict (which `yaml.safe_dump` refuses) whose non-string
    values are JSON strings (`get_meta_for_safetensors`, toolkit/metadata.py); its resume then reads
    `aitk_meta.yaml`'s `training_info["step"]` (BaseSDTrainProcess.load_training_state_from_metadata),
    so each value is parsed back as ai-toolkit's own `parse_metadata_from_safetensors` does."""
    out = {}
    for key, value in dict(meta or {}).items():
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError:
                pass  # a plain string
        out[str(key)] = value
    return json.loads(json.dumps(out, default=str))  # nested OrderedDicts -> dicts, odd objects -> str


def _module_path(lora) -> str:
    """The DiT module an ai-toolkit LoRA module adapts: its `lora_name` (`transformer.<path>` with `$$` for `.`
    in peft format: toolkit/lora_special.py `create_modules`) as a module path."""
    path = lora.lora_name.replace("$$", ".")
    return path[len(PEFT_PREFIX):] if path.startswith(PEFT_PREFIX) else path


def network_modules(net) -> list[str]:
    """The module paths ai-toolkit's network adapts: its LoRA modules' (`_module_path`), made before `apply_to`
    registers them."""
    net = getattr(net, "module", net)  # accelerate may wrap it
    return sorted(_module_path(lora) for lora in getattr(net, "unet_loras", []))


def keep_streams(net, family) -> str:
    """`network.network_kwargs.streams` (ours, as our trainer's `network.streams`; ai-toolkit hands unknown
    network_kwargs to its network's constructor, which takes them as **kwargs and keeps none): of the LoRA
    modules ai-toolkit made (every Linear of the blocks, less what only_if_contains / ignore_if_contains drop),
    only those on the stream's modules (`Family.stream_modules`) are kept. ai-toolkit registers its LoRA
    modules in `apply_to`, which runs after the model's `network` setter calls this (BaseSDTrainProcess), and
    builds the optimizer and the saved file from `unet_loras`: the dropped modules never train, hook or save.
    Returns the streams; a family that cannot take them, or a stream left with no module, is a ConfigError."""
    inner = getattr(net, "module", net)  # accelerate may wrap it
    kwargs = getattr(getattr(inner, "network_config", None), "network_kwargs", None) or {}
    streams = kwargs.get("streams", "both")
    try:
        only = family.stream_modules(streams)
    except ValueError as exc:
        raise ConfigError("network.network_kwargs.streams", str(exc)) from exc
    if only is None:
        return streams
    keep = re.compile(only)
    made = getattr(inner, "unet_loras", [])
    kept = [lora for lora in made if keep.fullmatch(_module_path(lora))]
    if not kept:
        raise ConfigError("network.network_kwargs.streams", f"{streams!r}: none of the {len(made)} "
                                                            f"modules the network adapts is the {streams} stream's; "
                                                            "accepted: only_if_contains / ignore_if_contains that "
                                                            "keep some of them, or streams: both")
    inner.unet_loras = kept
    return streams


# GenerateImageConfig fields our previews do not act on, with ai-toolkit's default (accepted silently)
PREVIEW_IGNORED = (("guidance_rescale", 0.0, "plain classifier-free guidance"),
                   ("do_cfg_norm", False, "plain classifier-free guidance"),
                   ("ctrl_idx", 0, "one first frame: ctrl_img"),
                   ("ctrl_img_3", None, "one first frame: ctrl_img (and ctrl_img_2, the last frame)"))


def _prompt_text(prompt) -> str:
    """A prompt as text: None and False (ai-toolkit's default `sample.neg`) are the empty prompt."""
    if prompt is None or prompt is False:
        return ""
    if not isinstance(prompt, str):
        raise TypeError(f"a prompt must be a string (or None / false for none), got {type(prompt).__name__} "
                        f"{prompt!r}")
    return prompt


def _device_of(module) -> torch.device:
    for p in module.parameters():
        return p.device
    raise ValueError(f"{type(module).__name__} has no parameters")


def _ensure_on(module, device: torch.device) -> None:
    """ai-toolkit parks components on the CPU (latent caching, low_vram); each hook moves its own back."""
    if _device_of(module) != device:
        module.to(device)


def _save_video(gen_config, frames, count: int = 0, max_count: int = 0, audio=None, audio_rate=None,
                **kwargs) -> None:
    """Replaces `GenerateImageConfig.save_image` for video previews (as LTX2 does): H.264 MP4, not WebP;
    with `audio` (C, S) in [-1, 1] at `audio_rate`, its AAC track. `save_image_atomic` points
    `output_folder` at its tmp folder around this call; honour it."""
    path = gen_config.get_image_path(count, max_count)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    write_video(frames, path, fps=gen_config.fps, audio=audio, audio_rate=audio_rate)


def _skip_log(gen_config, *args, **kwargs) -> None:
    """Replaces `GenerateImageConfig.log_image` for video previews: ai-toolkit's loggers take one image."""


class VideoDiTModel(BaseModel):
    """ai-toolkit model class for `model.arch: video_dit` (UI: `video_dit:<preset>`)."""

    arch = ARCH

    def __init__(self, device, model_config, dtype="bf16", custom_pipeline=None, noise_scheduler=None, **kwargs):
        super().__init__(device, model_config, dtype, custom_pipeline, noise_scheduler, **kwargs)
        # BaseModel.__init__ assigns these as instance attributes, so they are set here, after it.
        self.is_flow_matching = True  # target noise - x0; timestep weighting
        self.is_transformer = True  # LoRA keys `transformer.<path>.lora_A/B.weight`, peft format (scale 1)
        self.use_old_lokr_format = False
        self.options = parse(ModelKwargs, model_config.model_kwargs or {}, "model.model_kwargs")
        # ai-toolkit's full fine-tune resume points name_or_path at the latest save in the job's folder
        if model_config.name_or_path and preset_name(model_config.name_or_path) is None:
            mixed = mixed_outputs(os.path.dirname(os.path.abspath(model_config.name_or_path)), "ai-toolkit",
                                  also_own=True)
            if mixed is not None:
                raise ConfigError("model.name_or_path", f"{model_config.name_or_path}: {mixed}")
        self.spec = resolve(self._request(model_config), AITK_KEYS)  # which files make up the model, once
        self.family = self.spec.family  # its loaders, pipeline and what a trainer asks of it (`families.contract.Family`)
        self.target_lora_modules = [self.family.arch.cls.__name__]  # compared with type(module).__name__
        self._configure(self.spec.preset)
        self.audio_codec = None  # a model with sound: its audio VAE and vocoder (load_model)
        self.audio_timesteps = self._audio_timesteps_choice()  # a model with sound: tied | independent
        self._audio_t_sampler = None  # independent: the job's timestep distribution (add_after_sample_image_hook)
        self._i2v_loss_mask = None  # set by get_noise_prediction, consumed by scale_loss
        self._skip_loss = False  # set by get_noise_prediction for a batch it skips, consumed by scale_loss
        self.skipped_stills = 0  # still items skipped (`diffusion.conditioning.stills_skipped`), counted over the run
        self._stills_warned: set[str] = set()  # the datasets whose skipped stills were warned about
        self._configure_experts()

    @property
    def network(self):
        """ai-toolkit's network (`self.sd.network`), None without one."""
        return getattr(self, "_network", None)

    @network.setter
    def network(self, net) -> None:
        """ai-toolkit attaches its network here (BaseSDTrainProcess.run, right after `load_model()`,
        before applying it, reading the datasets or any step): the first moment the model can tell a
        LoRA will train, since ai-toolkit builds the model from its `model` block alone. A network
        our LoRA files cannot hold, and a LoRA on a preset's random init (every LoRA gradient is 0: the
        trainer's refusal, in its words, `spec.check_lora`) are refused here; `network_kwargs.streams` keeps
        one stream's modules (`keep_streams`)."""
        if net is not None:
            kind = str(getattr(getattr(net, "module", net), "network_type", "lora")).lower()  # accelerate may wrap it
            if kind != "lora":
                raise ConfigError("network.type", f"{kind!r}: video_dit's LoRA files (shared with its DeepSpeed "
                                                  "trainer) hold plain LoRA; accepted: lora")
            check_lora(self.spec.request.name_or_path, True, AITK_KEYS)
            keep_streams(net, self.family)  # network_kwargs.streams: one stream's modules
            try:  # what ai-toolkit's options picked must be a LoRA our files write and read back (`check_targets`)
                check_targets(network_modules(net), self.family.lora_to_comfy, self.family.lora_from_file,
                              f"network (ai-toolkit's LoRA on {self.family.title}'s DiT)")
            except ValueError as exc:
                raise ConfigError("network", f"{exc}; accepted: network_kwargs (only_if_contains, "
                                             "ignore_if_contains) that keep or drop whole modules the file can "
                                             "hold") from exc
        self._network = net

    def _audio_timesteps_choice(self) -> str | None:
        """`model_kwargs.audio_timesteps`, else the family's reference trainer's (`AudioPath.timesteps`); refused for
        a model without sound, as our trainer refuses `train.audio_timesteps` there."""
        sound, given = self.family.audio, self.options.audio_timesteps
        if sound is None:
            if given is not None:
                raise ConfigError("model.model_kwargs.audio_timesteps", f"preset {self.spec.preset.name!r} "
                                                                         "generates no sound; remove it")
            return None
        return given or sound.timesteps

    def _request(self, cfg) -> Request:
        """What ai-toolkit's `model` block and our `model_kwargs` ask for (`video_dit.spec.Request`)."""
        o = self.options
        return Request(cfg.name_or_path or "", preset=o.preset, vae=cfg.vae_path, text_encoder=cfg.te_name_or_path,
                       image_encoder=o.image_encoder_path, i2v_mode=o.i2v_mode, boundary=o.boundary_ratio,
                       train_high_noise=o.train_high_noise, train_low_noise=o.train_low_noise, audio=o.audio_path)

    def _configure(self, preset: Preset) -> None:
        """Preset-derived settings; redone in load_model with the DiT config the weights carry."""
        self.preset = preset
        self.i2v_mode = i2v_mode_of(preset, self.options.i2v_mode, AITK_KEYS.i2v_mode)
        # the object our DeepSpeed trainer and pipeline use: per-token t = 0 on the clean first frame in
        # replace mode, one t per sample in concat; the loss mask by `mask_first_frame_loss`
        # a first-last-frame DiT (`Family.last_frame`: "required") is conditioned on the last frame of every
        # clip too (ai-toolkit's dataset config has no such key, so the model decides)
        self.last_frame = self.family.last_frame(preset.dit, self.i2v_mode) == "required"
        self.conditioning = None  # a model that takes no first frame and is not conditioned in t2v: none, as
        # our trainer's `job_conditioning` (a do_i2v batch is then refused, `_first_frame_condition`)
        if self.i2v_mode is None and not self.family.training.conditions_t2v:
            return
        try:  # the family's (`Training.conditioning`)
            self.conditioning = self.family.training.conditioning(self.i2v_mode, preset.dit.patch_size,
                                                                  self.options.mask_first_frame_loss, self.last_frame)
        except ValueError as exc:
            raise ConfigError("model.model_kwargs.mask_first_frame_loss", str(exc)) from exc

    def _configure_experts(self) -> None:
        """A two-expert preset (Wan 2.2 A14B) is ai-toolkit's multistage model, as its wan22_14b: stage 0
        = the high-noise expert (t in [boundary x 1000, 1000]), stage 1 = the low-noise one; ai-toolkit's
        trainer draws each step's timesteps inside the current stage and switches stages every
        `train.switch_boundary_every` steps among `trainable_multistage_boundaries`. We route each
        forward to the expert of the batch's timesteps (get_noise_prediction) and split the LoRA into one
        file per expert (save_lora / load_lora, ai-toolkit's `_high_noise` / `_low_noise` names)."""
        self.experts: tuple[str, ...] = ()  # the trained experts (empty for one model)
        found = self.spec.experts  # (the keys of a one-model preset are refused by the spec)
        if found is None:
            return
        self.experts, self.boundary, self.expert_sources = found.trained, found.boundary, found.sources
        self.is_multistage = True
        self.multistage_boundaries = [self.boundary, 0.0]
        self.trainable_multistage_boundaries = [EXPERTS.index(e) for e in self.experts]

    @property
    def max_step_saves_to_keep_multiplier(self) -> int:
        """ai-toolkit keeps this many files per save: one LoRA file per trained expert."""
        return max(1, len(self.experts)) if self._split_loras() else 1

    def _split_loras(self) -> bool:
        net = getattr(self, "network", None)
        config = getattr(getattr(net, "module", net), "network_config", None)
        return bool(getattr(config, "split_multistage_loras", True))

    def get_model_to_train(self):
        """What ai-toolkit attaches its LoRA to: both experts (`TwoExperts`, LoRA keys `high.` / `low.`)
        when both train, the one trained expert alone otherwise (as ai-toolkit's wan22_14b)."""
        if isinstance(self.model, TwoExperts) and len(self.experts) == 1:
            return self.model.expert(self.experts[0])
        return self.model

    # ---------------------------------------------------------------- identity and sizes

    @staticmethod
    def get_train_scheduler(shift: float = TRAIN_SCHEDULER_CONFIG["shift"]):
        """ai-toolkit's flow-matching training scheduler; ai-toolkit calls it with no argument before
        the model exists, load_model again with the preset's `train_shift`."""
        return CustomFlowMatchEulerDiscreteScheduler(**{**TRAIN_SCHEDULER_CONFIG, "shift": float(shift)})

    @property
    def text_embedding_space_version(self) -> str:
        """Set by load_model (the text encoder's weights, tokenizer, dtype, quantization)."""
        if getattr(self, "_text_space", None) is None:
            raise RuntimeError("text_embedding_space_version is known once load_model has run")
        return self._text_space

    def get_bucket_divisibility(self) -> int:
        return self.preset.divisibility  # the VAE's spatial factor x the DiT's patch

    def get_frame_count_snapper(self):
        return functools.partial(snap_num_frames, snap_frames=self.preset.vae.snap_frames)

    def get_base_model_version(self) -> str:
        return f"{ARCH}:{self.preset.name}"

    def get_transformer_block_names(self) -> list[str]:
        return [self.family.arch.block_list]

    def get_quantization_exclude_modules(self) -> list[str]:
        # the embedders and the head feed every modulation: the float32 islands stay float32, the
        # input embedders in the training dtype
        arch = self.family.arch
        return [f"{name}*" for name in (*arch.embedders, *arch.float32_modules)]

    def get_model_has_grad(self) -> bool:
        return any(p.requires_grad for n, p in self.model.named_parameters() if ".lora_" not in n)

    def get_te_has_grad(self) -> bool:
        return any(p.requires_grad for p in self.text_encoder.parameters())

    # ---------------------------------------------------------------- loading

    def load_model(self):
        cfg = self.model_config
        spec = self.spec
        dit_src, vae_src, te_src = spec.dit, spec.vae, spec.text_encoder
        self.print_and_status_update(f"Loading video_dit DiT ({self.preset.name}) from {dit_src}")
        if self.experts:  # a two-expert model: each loadable expert (both, or one expert's own weights)

            parts = {e: self.family.load_dit(src, dtype=self.torch_dtype, device="cpu", seed=seed)
                     for e, (src, seed) in self.expert_sources.items()}
            dits = [parts[e] for e in EXPERTS if e in parts]
            dit = TwoExperts(*dits, self.boundary) if len(dits) == 2 else dits[0]
        else:
            dits = [dit := self.family.load_dit(dit_src, dtype=self.torch_dtype, device="cpu")]
        self._configure(dataclasses.replace(self.preset, dit=dit.config))  # a weights path may differ in depth
        for part in dits:
            part.set_attention_backend(self.options.attention_backend)
            if cfg.quantize:
                from toolkit.util.quantize import quantize_model

                quantize_model(self, part)  # ai-toolkit's qtype handling and our exclusions
        dit.to("cpu" if cfg.low_vram else self.device_torch)

        self.print_and_status_update(f"Loading video_dit VAE from {vae_src}")
        vae = self.family.load_vae(vae_src, dtype=self.vae_torch_dtype, device=self.vae_device_torch)
        vae.eval().requires_grad_(False)

        self.print_and_status_update(f"Loading video_dit text encoder from {te_src}")
        te = self.family.load_text_encoder(te_src, dtype=self.te_torch_dtype, device=self.te_device_torch,
                                           quantize=te_quantization(cfg))  # qfloat8 | qint8
        te.eval().requires_grad_(False)

        self.image_encoder, clip_src = None, spec.image_encoder
        if clip_src is not None:  # frozen, like the text encoder; features computed per batch from pixels
            self.print_and_status_update(f"Loading video_dit image encoder from {clip_src}")
            self.image_encoder = self.family.load_image_encoder(
                clip_src, dtype=self.te_torch_dtype, device=self.te_device_torch,
                quantize="qfloat8" if self.options.quantize_image_encoder else None)

        self.audio_codec, audio_src, stores = None, None, "latents"
        if self.family.audio is not None:  # a model with sound: its audio VAE and vocoder, frozen as the VAE
            audio_src = spec.audio
            self.print_and_status_update(f"Loading video_dit audio codec from {audio_src}")
            self.audio_codec = self.family.audio.load_codec(audio_src, dtype=self.vae_torch_dtype,
                                                            device=self.vae_device_torch, seed=spec.seed)
            self.audio_codec.eval().requires_grad_(False)
            # ai-toolkit caches a clip's audio latents in its latent file (`audio_latent`): their space too
            stores += (f";audio={source_identity(audio_src, 'audio_vae')};rate={self.audio_codec.rate};"
                       f"channels={self.audio_codec.channels}")

        self.noise_scheduler = VideoDiTModel.get_train_scheduler(self.preset.train_shift)
        self.model, self.vae, self.text_encoder = dit, vae, te
        self.tokenizer = getattr(te, "tokenizer", None)  # (HunyuanVideo 1.5's two encoders: each its own)
        self.sources = {**spec.sources(), "trainer": "ai-toolkit"}  # paths absolute: samples from any directory
        # ai-toolkit keys its latent / text caches by these two strings (and the file and caption): name
        # everything that changes what they hold, as our trainer's caches do (data/cache.py)
        self.latent_space_version = cfg.latent_space_version or f"{ARCH}.vae{LATENT_VERSION}." + latent_space(
            self.preset.name, vae_src, next(vae.parameters()).dtype, stores)
        self._text_space = f"{ARCH}.te{TEXT_EMBEDDING_VERSION}." + text_space(
            self.preset.name, te_src, None, te.dtype, te_quantization(cfg))
        self.pipeline = self.get_generation_pipeline()
        self.print_and_status_update("video_dit model loaded")

    # ---------------------------------------------------------------- VAE and text encoder

    @torch.no_grad()
    def encode_images(self, image_list, device=None, dtype=None) -> torch.Tensor:
        """Pixels in [-1, 1] -> normalized latents (B, C, F', h, w).

        image_list: ai-toolkit's layouts: a tensor (B, F, 3, H, W) (video) or (B, 3, H, W) (images), or a
        list of (F, 3, H, W) / (3, H, W) tensors. An image becomes one latent frame. F must be a count the VAE encodes (`VAEShape.snap_frames`).
        """
        device = device or self.vae_device_torch
        dtype = dtype or self.vae_torch_dtype
        x = torch.stack(list(image_list)) if isinstance(image_list, (list, tuple)) else image_list
        if x.ndim == 4 and x.shape[1] == 3:
            x = x[:, :, None]  # (B, 3, 1, H, W)
        elif x.ndim == 5 and x.shape[2] == 3:
            x = x.permute(0, 2, 1, 3, 4)  # (B, F, 3, H, W) -> (B, 3, F, H, W)
        else:
            raise ValueError(f"encode_images takes (B, F, 3, H, W) or (B, 3, H, W) pixels, got {tuple(x.shape)}")
        frames = x.shape[2]
        snapped = snap_num_frames(frames, self.preset.vae.snap_frames)
        if snapped != frames:
            raise ValueError(f"a clip of {frames} frames cannot be encoded by this VAE; set datasets[].num_frames to "
                             f"{snapped} (or use auto_frame_count)")
        _ensure_on(self.vae, self.vae_device_torch)
        vae_dtype = next(self.vae.parameters()).dtype
        z = self.vae.encode(x.to(self.vae_device_torch, vae_dtype)).mode()  # (B, C, F', h, w)
        return self.vae.normalize(z).to(device, dtype)

    @torch.no_grad()
    def decode_latents(self, latents: torch.Tensor, device=None, dtype=None) -> torch.Tensor:
        """Normalized latents (B, C, F', h, w) -> pixels (B, 3, F, H, W) in [-1, 1]."""
        _ensure_on(self.vae, self.vae_device_torch)
        vae_dtype = next(self.vae.parameters()).dtype
        video = self.vae.decode(self.vae.denormalize(latents.to(self.vae_device_torch, vae_dtype)))
        return video.to(device or self.vae_device_torch, dtype or self.vae_torch_dtype)

    @torch.no_grad()
    def get_prompt_embeds(self, prompt) -> AdvancedPromptEmbeds:
        """Prompts -> `text_embeds`: one 2D (Lt_i, D) tensor per prompt at its natural length, so
        ai-toolkit caches stay small and any prompts share a batch (padding happens in the DiT or, for
        HunyuanVideo 1.5, in `Training.text_inputs`); HunyuanVideo 1.5 adds `glyph_embeds`, the ByT5
        states of each prompt's quoted text ((0, D) without quotes): what our trainer caches per caption.

        A prompt of None or False is the empty prompt: ai-toolkit's `sample.neg` defaults to False
        and reaches here as the negative prompt of every preview."""
        prompts = [_prompt_text(p) for p in ([prompt] if isinstance(prompt, (str, bool)) or prompt is None
                                             else prompt)]
        _ensure_on(self.text_encoder, self.te_device_torch)
        entries = [self.family.training.text_entry(e) for e in self.text_encoder.encode(prompts)]
        return AdvancedPromptEmbeds(**{key: [e[key].to(self.te_device_torch, self.torch_dtype) for e in entries]
                                       for key in entries[0]})

    # ---------------------------------------------------------------- training step

    def _skips_stills(self, batch, x: torch.Tensor) -> bool:
        """Whether this batch is stills of a `do_i2v` dataset that the model skips (`diffusion.conditioning.stills_skipped`:
        a concat model), as our trainer does; the first such batch of a dataset warns once, naming how
        many stills its folder holds (listed as both trainers list a folder) and why. ai-toolkit keys
        its buckets by frame count, so a batch of one latent frame holds stills only."""
        if batch is None or x.shape[2] != 1 or not stills_skipped(self.i2v_mode) or not batch.dataset_config.do_i2v:
            return False
        items = getattr(batch, "file_items", None) or []
        self.skipped_stills += len(items) or x.shape[0]
        cfg = batch.dataset_config
        folder = str(getattr(cfg, "dataset_path", None) or getattr(cfg, "folder_path", None) or "(dataset)")
        if folder not in self._stills_warned:
            self._stills_warned.add(folder)
            video = getattr(cfg, "num_frames", 1) > 1 or getattr(cfg, "auto_frame_count", False)
            if os.path.isdir(folder):  # the folder's stills, listed as both trainers list a folder
                paths, _ = list_media(folder, getattr(cfg, "caption_ext", "txt"))
                clips = [p for p in paths if p.suffix.lower() in VIDEO_EXTS] if video else []
                names = [os.path.relpath(p, os.path.abspath(folder)) for p in paths if p not in clips]
            else:  # a JSON dataset_path: the stills this batch shows
                clips, names = [None], sorted(os.path.basename(str(it.path)) for it in items)
            # printed, not warnings.warn: ai-toolkit silences UserWarnings (toolkit/control_generator.py L15,
            # imported with its data loader); the line our trainer's DataWarning prints
            print(f"[video_dit] warning: {skipped_stills(folder, names, every=not clips)}", file=sys.stderr, flush=True)
        return True

    def refuse_first_frame(self, key: str) -> None:
        """A `do_i2v` dataset on a model the arch builds no first-frame conditioning for: a ConfigError naming
        `key`, in its family's words where its training record refuses one (`Training.conditioning`), as our
        trainer's `job_conditioning` refuses the job. A family whose conditioner presents the first frame with the
        caption (`Family.prompt_images`: MiniMax H3) trains it in our trainer alone: ai-toolkit encodes and caches
        each caption by itself, so the caption the keyframe needs is not there."""
        try:
            self.family.training.conditioning(self.i2v_mode, self.preset.dit.patch_size,
                                              self.options.mask_first_frame_loss, self.last_frame)
        except ValueError as exc:
            raise ConfigError(key, str(exc)) from exc
        if self.family.prompt_images is not None:
            raise ConfigError(key, f"preset {self.preset.name!r} conditions on a first frame through its caption too "
                                   f"(its text encoder presents the frame with the caption), which ai-toolkit encodes "
                                   f"and caches alone: its first-frame training runs in video_dit's trainer "
                                   f"(`video-dit train` on the same job file); accepted here: false")
        raise ConfigError(key, f"preset {self.preset.name!r} takes no first frame (its family builds no first-frame "
                               "conditioning); accepted: false")

    def _first_frame_condition(self, batch, x: torch.Tensor) -> dict | None:
        """Conditioning latents for this batch, or None (plain t2v / image items / no batch).

        ai-toolkit gives the first frame as `batch.first_frame_latents` (cached latents + do_i2v) or as
        pixels in `batch.tensor[:, 0]`; image items (one latent frame) train unconditioned, since
        conditioning their only frame would leave nothing to learn (a concat model skips them before
        this: `_skips_stills`). A CLIP-branch DiT (Wan 2.1 I2V / FLF2V) also gets the CLIP features of
        `batch.tensor[:, 0]` (and of `[:, -1]`, the last frame).
        """
        if batch is not None and not batch.dataset_config.do_i2v:
            folder = getattr(batch.dataset_config, "folder_path", None)
            check_dataset_i2v(self.preset, False, f"datasets[].do_i2v ({folder})")  # as our trainer's check
        if batch is not None and batch.dataset_config.do_i2v and self.conditioning is None:
            folder = getattr(batch.dataset_config, "folder_path", None)
            self.refuse_first_frame(f"datasets[].do_i2v ({folder})")
        if batch is None or not batch.dataset_config.do_i2v or x.shape[2] == 1:
            if self.family.i2v_only(self.preset.dit):
                raise ValueError(f"preset {self.preset.name!r} is an image-to-video DiT (i2v_mode concat): it has "
                                 "no unconditioned input, so every prediction needs a batch of video items of a "
                                 "`do_i2v: true` dataset")
            return None
        B, num_frames = x.shape[0], self.preset.vae.pixel_frames(x.shape[2])
        if self.i2v_mode == "replace" and batch.first_frame_latents is not None:  # Wan, replace mode
            cond = {"first_frame_latents": batch.first_frame_latents}
        else:
            frames = batch.tensor
            if frames is None or frames.ndim != 5:
                need = ("the first frame's conditioning latents and image-encoder embeds, from pixels"
                        if self.image_encoder else "VAE(first frame + zero frames), from pixels"
                        if self.i2v_mode == "concat" else "the first frame's latent or pixels")
                raise ValueError(f"i2v_mode {self.i2v_mode!r} needs {need}, but this batch has neither "
                                 "first_frame_latents nor video pixels: set datasets[].cache_tensors_to_disk: true "
                                 "or load_image_when_caching_latents: true (or turn off cache_latents_to_disk)")
            _ensure_on(self.vae, self.vae_device_torch)
            if self.image_encoder is not None:
                _ensure_on(self.image_encoder, self.te_device_torch)
            if frames.shape[1] != num_frames:
                raise ValueError(f"a batch of {frames.shape[1]} frames for latents of {num_frames}")
            # the family's (`Training.cache_item`): what our trainer caches for a clip, from its pixels; the clip
            # stays on the host: only the frames it reads (the first, a last) go to the VAE's / encoder's device
            cond = self.family.training.cache_item(self.vae, frames.permute(0, 2, 1, 3, 4), self.i2v_mode,
                                                   self.last_frame, self.image_encoder)
        cond = {k: v.to(x.device, torch.float32) for k, v in cond.items()}
        n = next(iter(cond.values())).shape[0]
        if n * 2 == B:  # predict_noise doubles the latents for CFG (uncond, cond)
            cond = {k: torch.cat([v, v]) for k, v in cond.items()}
        elif n != B:
            raise ValueError(f"{n} first frames for a batch of {B} latents")
        return cond

    def get_noise_prediction(self, latent_model_input: torch.Tensor, timestep: torch.Tensor, text_embeddings,
                             batch=None, **kwargs) -> torch.Tensor:
        """The DiT's velocity prediction (B, C, F', h, w) for noisy latents (B, C, F', h, w).

        timestep: (B,) float on 0..1000 (1000 = noise). text_embeddings: `text_embeds` = B (Lt_i, D).
        batch: ai-toolkit's DataLoaderBatchDTO or None (validation, sampling): with `do_i2v`, the
        first frame is conditioned exactly as in our trainer and the loss mask kept for `scale_loss`.
        """
        if kwargs:
            raise TypeError(f"video_dit takes no adapter inputs in get_noise_prediction; got {sorted(kwargs)}")
        self._i2v_loss_mask, self._skip_loss = None, False
        if self._skips_stills(batch, latent_model_input):
            # ai-toolkit cannot drop an item from its batch: the prediction is a fresh leaf, no function of
            # the weights, and scale_loss zeroes the loss, so no weight gets a gradient (its .grad stays
            # None and the optimizer leaves it alone); ai-toolkit still counts the step
            self._skip_loss = True
            return torch.zeros_like(latent_model_input, dtype=self.torch_dtype, device=self.device_torch,
                                    requires_grad=True)  # (B, C, 1, h, w)
        _ensure_on(self.model, self.device_torch)
        x = latent_model_input.to(self.device_torch, self.torch_dtype)
        t = timestep.to(self.device_torch, torch.float32).reshape(-1).expand(x.shape[0])
        model = self.model

        if isinstance(model, TwoExperts):  # the expert of the batch's timesteps (ai-toolkit draws one stage's)
            model = model.expert(expert_at(float(t.mean()), self.boundary))
        # the cached text as the DiT takes it (`Training.text_inputs`: Wan's list of (Lt_i, D), HunyuanVideo
        # 1.5's padded text, glyphs and masks), in the training dtype
        text = {k: [e.to(self.device_torch, self.torch_dtype) for e in text_embeddings[k]]
                for k in text_embeddings.keys()}
        cond = self._first_frame_condition(batch, x)
        # (the conditioning's tensors beside the text: HunyuanVideo 1.5 adds a masked image token only without)
        context, text_kwargs = self.family.training.text_inputs({**text, **(cond or {})}, self.device_torch,
                                                                self.preset.dit)
        extra, t_sample = {}, t
        if cond is not None or self.family.training.conditions_t2v:  # (HunyuanVideo 1.5: zeros for t2v)
            x, t, mask = self.conditioning.apply(x, t, cond)  # t: per token (B, L) in replace, (B,) in concat
            self._i2v_loss_mask = mask if getattr(self.conditioning, "mask_first_frame_loss", False) else None
            extra = self.conditioning.dit_kwargs(cond)  # the image branch's embeds (CLIP, SigLIP)
        extra = {k: v.to(self.torch_dtype) if v.is_floating_point() else v for k, v in extra.items()}
        if self.audio_codec is None:
            return model(x, t, context, **text_kwargs, **extra)  # (B, C, F', h, w)
        audio, state = self._audio_inputs(batch, x, t_sample)  # a model with sound: its audio stream
        video, a_pred = model(x, t, context, **text_kwargs, **extra, **audio)  # (B, C, F', h, w), (B, ...)
        self._audio_outputs(batch, a_pred, state)
        return video

    # ---------------------------------------------------------------- the audio stream (a model with sound)

    @torch.no_grad()
    def encode_audio(self, audio_data_list) -> torch.Tensor:
        """ai-toolkit's audio items -> normalized audio latents (B, ...) float32 (each track resampled and mixed to
        what the family's codec reads, `codec_wave`). An item is `file_item.audio_data`: {"waveform": (C, S) float in
        [-1, 1], "sample_rate": int}, the clip's track over its frames' span (ai-toolkit stretches it to
        num_frames / fps seconds); ai-toolkit calls this when it caches a `do_audio` dataset's latents."""
        if self.audio_codec is None:
            raise ConfigError("datasets[].do_audio", f"preset {self.preset.name!r} ({self.family.title}) makes no "
                                                     "sound; accepted: false")
        _ensure_on(self.audio_codec, self.vae_device_torch)
        out = []
        for i, item in enumerate(audio_data_list):
            wave = item["waveform"] if isinstance(item, dict) else None
            if not torch.is_tensor(wave) or wave.dim() != 2:
                raise ValueError(f"audio item {i}: expected ai-toolkit's {{'waveform': (channels, samples), "
                                 f"'sample_rate': int}}, got {type(item).__name__}")
            wave = codec_wave(wave, int(item["sample_rate"]), self.audio_codec.rate, self.audio_codec.channels)
            wave = wave[None].to(self.vae_device_torch, torch.float32)  # (1, channels, S') at the codec's rate
            out.append(self.audio_codec.encode(wave))  # (1, ...): LTX-2's (z, T', M'), MiniMax H3's (2, z, T')
        return torch.cat(out)

    def _audio_latents(self, batch, x: torch.Tensor, fps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(normalized audio latents (n, ...) float32, whether each sample has sound (n,) bool) of a batch whose
        video latents are x (B, C, F', h, w): ai-toolkit's cached `audio_latents` (a clip without a track is
        zeros there: ai-toolkit's fill) or its `audio_data` (encoded here; None for a clip without a track);
        zeros of the clip's audio length (`latent_shape`) and no sound for a dataset without `do_audio`, an image
        batch, or none (validation, previews)."""
        dev, B = self.device_torch, x.shape[0]
        silent = torch.zeros(B, *self.audio_codec.latent_shape(self.preset.vae.pixel_frames(x.shape[2]), fps),
                             device=dev), torch.zeros(B, dtype=torch.bool, device=dev)
        if batch is None or x.shape[2] == 1 or not getattr(batch.dataset_config, "do_audio", False):
            return silent
        cached = getattr(batch, "audio_latents", None)
        if cached is not None:
            x0 = cached.to(dev, torch.float32)
            return x0, x0.flatten(1).ne(0).any(1)
        data = getattr(batch, "audio_data", None) or []
        encoded = [None if d is None else self.encode_audio([d])[0].to(dev) for d in data]
        like = next((e for e in encoded if e is not None), None)
        if like is None:
            return silent
        return (torch.stack([torch.zeros_like(like) if e is None else e for e in encoded]),
                torch.tensor([e is not None for e in encoded], device=dev))

    def _audio_inputs(self, batch, x: torch.Tensor, t: torch.Tensor) -> tuple[dict, tuple]:
        """The DiT's audio keywords for latents x (B, C, F', h, w) at per-sample timesteps t (B,): `audio` where
        the sample has sound at the audio's t (`audio_timesteps`: tied, the video's t through the family's
        `tied_map` where it has one, as ltx-trainer, ai-toolkit's ltx2 and minimax_h3 `remap_sigma`; independent,
        its own draw, `_independent_audio_t`), pure noise at t = 1000 where it has none (objective.py),
        `audio_timestep`, `fps` (the dataset's: the positions are seconds); and (x0, noise, present) for
        `_audio_outputs`. The noise is ai-toolkit's `batch.audio_noise` when a pass of this step drew it (its
        other passes reuse it), else drawn and kept there."""
        fps = float(batch.dataset_config.fps) if batch is not None else float(self.preset.fps)
        x0, present = self._audio_latents(batch, x, fps)
        t_a = None  # tied
        if self.audio_timesteps == "independent" and bool(present.any()):
            t_a = self._independent_audio_t(batch, x0.shape[0]).to(x0.device)  # (n,)
        if x0.shape[0] * 2 == x.shape[0]:  # predict_noise doubles the latents for CFG (uncond, cond)
            x0, present = torch.cat([x0, x0]), torch.cat([present, present])
            t_a = None if t_a is None else torch.cat([t_a, t_a])
        elif x0.shape[0] != x.shape[0]:
            raise ValueError(f"{x0.shape[0]} audio latents for a batch of {x.shape[0]} video latents")
        noise = getattr(batch, "audio_noise", None) if batch is not None else None
        if noise is None or noise.shape != x0.shape:
            noise = torch.randn(x0.shape, device=x0.device)  # (ai-toolkit's ltx2: randn_like, its global RNG)
            if batch is not None:
                batch.audio_noise = noise
        noise = noise.to(x0.device, torch.float32)
        if t_a is None:  # tied: the video's t, through the family's coupling of the two schedules where it has one
            tied = self.family.audio.tied_map
            t_a = t.to(x0.device) if tied is None else tied(t.to(x0.device, torch.float32))
        t_a = torch.where(present, t_a, torch.full_like(t_a, NUM_TRAIN_TIMESTEPS))
        audio = add_noise(x0, noise, t_a).to(self.torch_dtype)
        return {"audio": audio, "audio_timestep": t_a, "fps": fps}, (x0, noise, present)

    def _independent_audio_t(self, batch, n: int) -> torch.Tensor:
        """(n,) float32 audio timesteps of `audio_timesteps: independent`: drawn once per batch from the job's
        timestep distribution (`audio_timestep_sampler`) with torch's global generator (ai-toolkit's own draws
        use it) and kept on the batch (`AUDIO_T_ATTR`) for the step's other passes, as its `audio_noise`."""
        drawn = getattr(batch, AUDIO_T_ATTR, None) if batch is not None else None
        if drawn is not None and drawn.shape == (n,):
            return drawn
        if self._audio_t_sampler is None:
            raise RuntimeError("model_kwargs.audio_timesteps independent draws from the job's timestep distribution, "
                               "which the arch reads from ai-toolkit's trainer (its train config, handed with the "
                               "preview hook before step 1): none was registered")
        drawn = self._audio_t_sampler.sample(n)
        if batch is not None:
            setattr(batch, AUDIO_T_ATTR, drawn)
        return drawn

    @staticmethod
    def _audio_outputs(batch, a_pred: torch.Tensor, state: tuple) -> None:
        """Hand the audio prediction to ai-toolkit's loss (SDTrainer: mse(audio_pred, audio_target) x
        audio_loss_multiplier): a grad-enabled pass outside ai-toolkit's secondary slots sets `audio_pred` and
        `audio_target` (noise - x0; the prediction itself, detached, for a sample without sound: its audio loss
        0, as our trainer's); a secondary pass goes to its slot. A batch without sound records nothing."""
        x0, noise, present = state
        if batch is None or not bool(present.any()):
            return
        keep = present.view(-1, *([1] * (x0.dim() - 1)))
        target = torch.where(keep, velocity_target(x0, noise), a_pred.detach().float())
        if torch.is_grad_enabled() and getattr(batch, "audio_pred_slot", None) is None:
            batch.audio_pred, batch.audio_target = a_pred, target.detach()
        elif hasattr(batch, "set_secondary_audio_pred"):
            batch.set_secondary_audio_pred(a_pred)

    def get_loss_target(self, *args, noise: torch.Tensor, batch, timesteps=None, **kwargs) -> torch.Tensor:
        return velocity_target(batch.latents, noise).detach()

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Element-wise loss (B, C, F', h, w) -> masked: conditioned first-frame positions contribute
        nothing, and dividing each sample by its mask's mean makes ai-toolkit's per-sample mean
        (SDTrainer: `loss.mean([1, 2, 3, 4])`, then the timestep weight, then the batch mean) a masked
        mean per sample: our trainer's loss (diffusion/objective.py). ai-toolkit's Wan 2.2 5B divides
        by the batch's mask mean instead; the two agree whenever every sample is conditioned alike."""
        mask, self._i2v_loss_mask = self._i2v_loss_mask, None
        if self._skip_loss:  # a batch of skipped stills (get_noise_prediction): exactly 0
            self._skip_loss = False
            return loss * 0.0
        if mask is None:
            return loss
        if mask.shape[0] != loss.shape[0] or mask.shape[2:] != loss.shape[2:]:
            raise ValueError(f"i2v loss mask {tuple(mask.shape)} does not fit the loss {tuple(loss.shape)}")
        m = mask.to(loss.device, loss.dtype)
        return loss * m / m.mean(dim=(1, 2, 3, 4), keepdim=True).clamp(min=1e-8)

    # ---------------------------------------------------------------- previews

    def add_after_sample_image_hook(self, func):
        """ai-toolkit's trainer registers its per-preview hook here right after `load_model()`, before the
        network, the data or any preview: the job's previews and datasets are checked now (`job_checks`)."""
        super().add_after_sample_image_hook(func)
        process = getattr(func, "__self__", None)
        check_job(self, process)
        train = getattr(process, "train_config", None)
        if self.audio_timesteps == "independent" and train is not None:
            self._audio_t_sampler = audio_timestep_sampler(train, self.preset)

    def generate_images(self, image_configs, *args, **kwargs):
        check_generation(self, image_configs)  # before a preview of the round renders (`job_checks`)
        return super().generate_images(image_configs, *args, **kwargs)

    def get_generation_pipeline(self):
        sound = {"audio_codec": self.audio_codec} if getattr(self, "audio_codec", None) is not None else {}
        return self.family.pipeline(self.model, self.vae, image_encoder=getattr(self, "image_encoder", None),
                                    i2v_mode=self.i2v_mode, **sound)

    def generate_single_image(self, pipeline, gen_config, conditional_embeds, unconditional_embeds, generator,
                              extra):
        """One preview: a list of PIL frames (saved as MP4) or, for `num_frames: 1`, one PIL image.

        `gen_config.ctrl_img` (a path; or `ctrl_img_1`, the UI's first of three control images) makes it
        image-to-video; ai-toolkit leaves opening it to us; `ctrl_img_2` (its second control image) is the last
        frame of a first-last-frame model.
        num_frames is snapped to a count the VAE encodes and width/height to the bucket divisibility, in place.
        """
        if extra:
            raise TypeError(f"video_dit previews take no adapter inputs; got {sorted(extra)}")
        for key, default, why in PREVIEW_IGNORED:  # ai-toolkit's defaults are fine; anything else is said once
            value = getattr(gen_config, key, default)
            if value != default:
                warnings.warn(f"video_dit previews ignore {key}={value!r} ({why})", stacklevel=2)
        gen_config.num_frames = snap_num_frames(gen_config.num_frames, self.preset.vae.snap_frames)
        d = self.get_bucket_divisibility()
        gen_config.width, gen_config.height = max(d, gen_config.width // d * d), max(d, gen_config.height // d * d)
        first_frame = None
        first = gen_config.ctrl_img or getattr(gen_config, "ctrl_img_1", None)  # the UI's Control Image 1 too
        if first is not None:
            first_frame = load_image(first)  # resized to cover W x H and centre-cropped
        last_frame = None
        if getattr(gen_config, "ctrl_img_2", None) is not None:
            if self.last_frame:
                last_frame = load_image(gen_config.ctrl_img_2)
            else:
                warnings.warn(f"video_dit previews ignore ctrl_img_2={gen_config.ctrl_img_2!r} (preset "
                              f"{self.preset.name!r} takes one first frame: ctrl_img)", stacklevel=2)
        _ensure_on(self.model, self.device_torch)
        _ensure_on(self.vae, self.vae_device_torch)
        if self.image_encoder is not None:
            _ensure_on(self.image_encoder, self.te_device_torch)
        if gen_config.guidance_scale == 1.0:  # every family's pipeline runs the conditional pass alone at guidance
            unconditional_embeds = None        # 1; a guidance-distilled one (MiniMax H3) refuses a negative outright
        prompts, negative = (None if e is None else self._pipeline_prompts(e)
                             for e in (conditional_embeds, unconditional_embeds))
        codec = self.audio_codec  # a model with sound: its track too, at the preview's frame rate (its positions)
        if codec is not None:
            _ensure_on(codec, self.vae_device_torch)
        sound = codec is not None and gen_config.num_frames > 1
        out = (pipeline.generate_with_audio if sound else pipeline.generate)(
            prompts, negative, num_frames=gen_config.num_frames,
            height=gen_config.height, width=gen_config.width, steps=gen_config.num_inference_steps,
            guidance_scale=gen_config.guidance_scale, shift=self.preset.sample_shift, generator=generator,
            first_frame=first_frame, solver=self.preset.sample_solver,
            **({"last_frame": last_frame} if last_frame is not None else {}),
            **({"fps": gen_config.fps} if codec is not None else {}))[0]
        frames, wave = out if sound else (out, None)
        if gen_config.num_frames == 1:
            return frames[0]
        # ai-toolkit writes frame lists as animated WebP; replace its writer with ours, as LTX2 does (with the
        # model's sound as the MP4's AAC track)
        gen_config.output_ext = "mp4"
        gen_config.save_image = functools.partial(_save_video, gen_config, **(
            {"audio": wave.float().cpu(), "audio_rate": codec.out_rate} if sound else {}))
        gen_config.log_image = functools.partial(_skip_log, gen_config)
        return frames

    def _pipeline_prompts(self, embeds) -> list:
        """ai-toolkit's prompt embeds -> one prompt per item as the family's pipeline takes them
        (`Training.prompt`: Wan's (Lt, D), HunyuanVideo 1.5's text and glyph states)."""
        keys = embeds.keys()
        return [self.family.training.prompt({k: embeds[k][i] for k in keys}) for i in range(len(embeds.text_embeds))]

    # ---------------------------------------------------------------- saving

    def convert_lora_weights_before_save(self, state_dict: dict) -> dict:
        """ai-toolkit's peft LoRA (`transformer.<module>.lora_A/B.weight`, no alpha, update B @ A) ->
        our file format (`diffusion_model.<module>.lora_A/B.weight` + `.alpha`), the file our DeepSpeed
        trainer exports; alpha = rank states ai-toolkit's scale of 1."""
        for key in state_dict:
            if not key.startswith(PEFT_PREFIX) or not key.endswith((".lora_A.weight", ".lora_B.weight")):
                raise WeightsError(f"ai-toolkit LoRA key {key!r}: video_dit's LoRA file holds plain LoRA "
                                   f"(network.type: lora) under {PEFT_PREFIX}<module>.lora_A/lora_B.weight")
        native, _, rank = from_comfy(state_dict, source="ai-toolkit LoRA state dict")
        return self.family.lora_to_comfy(native, float(rank))  # (HunyuanVideo 1.5: q / k / v fused)

    def convert_lora_weights_before_load(self, state_dict: dict) -> dict:
        """Our LoRA file (or a ComfyUI / peft one) -> ai-toolkit's peft keys. ai-toolkit applies B @ A
        with scale 1 and drops alphas, so alpha / rank is folded into lora_B: same update, any alpha."""
        native, alpha, rank = from_comfy(state_dict, source="LoRA file", from_file=self.family.lora_from_file)
        if self.network is not None:  # ai-toolkit would keep a module its network lacks aside, silently
            have = set(network_modules(self.network))
            absent = sorted({k.rsplit(".", 2)[0] for k in native} - have)
            if absent:
                raise WeightsError(f"LoRA file: adapters on {len(absent)} modules ai-toolkit's network does not "
                                   f"adapt ({', '.join(absent[:6])}): it would leave them out and train without "
                                   "them; accepted: a network covering them (network.transformer_only: false "
                                   "adapts every Linear of the DiT, not the blocks' alone)")
        scale = alpha / rank
        out = {}
        for key, value in native.items():
            if key.endswith(".lora_B.weight") and scale != 1.0:
                value = (value.float() * scale).to(value.dtype)
            out[PEFT_PREFIX + key] = value
        return out

    # a two-expert model's LoRA keys carry the expert's attribute in `TwoExperts` ahead of the module path
    _EXPERT_CHILD = {"high_noise": "high", "low_noise": "low"}

    def save_lora(self, state_dict: dict, output_path: str, metadata: dict | None = None) -> None:
        """ai-toolkit's hook (network.save_weights calls it with our converted keys): a two-expert model's
        LoRA as one ComfyUI-keyed file per trained expert, `<name>_high_noise.safetensors` /
        `<name>_low_noise.safetensors` (ai-toolkit's wan22_14b names, our DeepSpeed trainer's too), each
        with `expert` and `boundary_ratio` in its metadata; one model (or split_multistage_loras: false):
        the one file."""
        from safetensors.torch import save_file

        metadata = {k: str(v) for k, v in (metadata or {}).items()}
        if not self.experts or not self._split_loras():
            save_file(state_dict, output_path, metadata=metadata)
            return
        for expert in self.experts:
            prefix = f"diffusion_model.{self._EXPERT_CHILD[expert]}." if len(self.experts) == 2 else "diffusion_model."
            part = {"diffusion_model." + k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)}
            if not part:
                raise WeightsError(f"{output_path}: no LoRA keys of the {expert} expert (under {prefix})")
            save_file(part, output_path.replace(".safetensors", f"_{expert}.safetensors"),
                      metadata=dict(metadata, expert=expert, boundary_ratio=str(self.boundary)))

    def load_lora(self, file: str) -> dict:
        """ai-toolkit's hook (network.load_weights): a `_high_noise` / `_low_noise` file of a two-expert
        model loads with its pair (every trained expert's file, as ai-toolkit's wan22_14b), keys placed
        under each expert; a file whose metadata names the other expert than its name (swapped files) is
        a `WeightsError` naming it. Any other file loads as it is."""
        from safetensors import safe_open

        mixed = mixed_outputs(os.path.dirname(os.path.abspath(file)), "ai-toolkit", also_own=True)
        if mixed is not None:  # ai-toolkit resuming from our trainer's LoRA of a job of the same name
            raise WeightsError(f"{file}: {mixed}")
        named = next((e for e in EXPERTS if file.endswith(f"_{e}.safetensors")), None)
        if not self.experts or named is None:
            return read_state_dict(file)
        base = file[: -len(f"_{named}.safetensors")]
        combined = {}
        for expert in self.experts:
            path = f"{base}_{expert}.safetensors"
            if not os.path.isfile(path):
                raise WeightsError(f"{path}: missing; {file} is one of a two-expert LoRA pair, and this job trains "
                                   f"the {expert} expert too")
            with safe_open(path, framework="pt") as f:
                said = (f.metadata() or {}).get("expert")
            if said not in (None, expert):
                raise WeightsError(f"{path}: its metadata says it is the {said} expert's LoRA, but its name says "
                                   f"{expert}: the two files are swapped; rename them to match")
            prefix = f"diffusion_model.{self._EXPERT_CHILD[expert]}." if len(self.experts) == 2 else "diffusion_model."
            for key, value in read_state_dict(path).items():
                if not key.startswith("diffusion_model."):
                    raise WeightsError(f"{path}: key {key!r} is not a ComfyUI LoRA key (diffusion_model.<module>)")
                combined[prefix + key[len("diffusion_model."):]] = value
        return combined

    def save_model(self, output_path, meta, save_dtype):
        """Full fine-tune: a saved model folder (`video_dit.models.saved`, the layout our trainer exports: native
        weights at `save_dtype` but for the float32 islands, config.json, the sources with absolute paths; two
        experts in high_noise_model/ + low_noise_model/), so that `name_or_path: <this folder>` and `video-dit
        sample --model <this folder>` load it alone; `aitk_meta.yaml` holds `meta` as plain data (see
        `plain_meta`), which ai-toolkit's resume reads. ai-toolkit names the folder `<name>_<step>.safetensors`."""
        model = getattr(self.model, "module", self.model)
        dits = {e: model.expert(e) for e in EXPERTS} if isinstance(model, TwoExperts) else {None: model}
        write_model(output_path, dits, save_dtype, self.family, {"format": "pt"}, self.sources)
        with open(os.path.join(output_path, "aitk_meta.yaml"), "w") as f:
            yaml.safe_dump(plain_meta(meta), f)
