"""The training job file: ai-toolkit's job YAML (one file serves both tools), as typed dataclasses.

    job: extension
    config:
      name: my_job
      process:
        - type: sd_trainer           # config.process[0]: the one process we run
          training_folder: output    # outputs go to <training_folder>/<name>/
          network / save / datasets / train / model / sample   (ai-toolkit's blocks)
          deepspeed: {...}           # ours: ZeRO stage, offload, sequence parallel, collective timeout
          prepare: {...}             # ours: set-up stages of the embedded demo (dataset, tiny VAE)
    meta: {...}                      # ai-toolkit's free-form metadata, kept in exports

Every key is checked (`video_dit.typed_config.parse`): an unknown key is an error with the nearest
valid name. ai-toolkit keys we accept but do not act on are listed per block in `IGNORED` with the reason
(they are validated for type where it matters and otherwise have no effect on our trainer); a key whose
other values would change training is accepted at its no-op value only (`IGNORED` says which), any other
value refused naming it. The job files ai-toolkit's web UI writes read here as they are (`.job_config.json`
is JSON, which YAML reads): `type: diffusion_trainer`, the UI's arch tag `model.arch: video_dit:<preset>`
(the preset taken from it) and every key the UI writes (tests/test_aitk_ui.py, from ai-toolkit 27a03a91).
Checks that need the file system (dataset folders, control images, output folder) live in
`video_dit.train.validate`, which `launch/train.sh` runs before any rank starts.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import torch
import yaml

from video_dit.data import DatasetConfig
from video_dit.data.dataset import inject_trigger
from video_dit.families import PRESETS, family_of, get_preset
from video_dit.families.contract import LORA_STREAMS
from video_dit.models.layouts import preset_name
from video_dit.parallel.zero import partitioned, shards_optimizer
from video_dit.spec import (
    boundary_of,
    check_dataset_i2v,
    check_lora,
    i2v_mode_of,
    job_keys,
    last_frame_presets,
    requested,
)
from video_dit.train.experts import check_ranges
from video_dit.typed_config import ConfigError, did_you_mean, parse

# ai-toolkit keys accepted for compatibility that have no effect here, by block, each with the reason;
# "(X only)": other values are refused naming the key (they would change what trains).
IGNORED = {
    "process": {
        "device": "ranks use DeepSpeed's accelerator",
        "sqlite_db_path": "the web UI's job database, where ai-toolkit's diffusion_trainer reports progress",
        "performance_log_every": "ai-toolkit's timing printout; metrics.jsonl records each step's time",
    },
    "network": {
        "transformer_only": "LoRA targets the family's default set (`Family.lora_targets`)",
        "conv": "convolutions are never LoRA-targeted (the UI writes 16 with its conv rank hidden)",
        "conv_alpha": "convolutions are never LoRA-targeted",
        "lokr_full_rank": "LoKr's shape, read with type: lokr only",
        "lokr_factor": "LoKr's shape, read with type: lokr only",
        "network_kwargs": "ai-toolkit's extra network arguments (ignore_if_contains: [] only; streams: as "
                          "network.streams)",
    },
    "logging": {
        "verbose": "ai-toolkit's console detail",
        "use_ui_logger": "ai-toolkit's UI loss database",
    },
    "save": {"save_format": "a LoRA is one ComfyUI-keyed safetensors file, a full fine-tune native safetensors"},
    "datasets": {
        "mask_path": "loss masks (null only)",
        "mask_min_value": "read with mask_path only",
        "is_reg": "regularisation datasets (false only)",
        "network_weight": "a dataset's LoRA strength (1 only)",
        "controls": "control images of image models (empty only)",
        "control_path": "control images of image models (null only): first and last frames come from each clip",
        "control_path_1": "the UI's first control folder (null only): frames come from each clip",
        "control_path_2": "the UI's second control folder (null only): frames come from each clip",
        "control_path_3": "the UI's third control folder (null only): frames come from each clip",
        "flip_x": "mirrored copies (false only): latents are cached once per item",
        "flip_y": "mirrored copies (false only): latents are cached once per item",
        "auto_frame_count": "each clip's own length (false only): num_frames is one per dataset here",
        "batch_size": "a dataset's own batch size (null only): train.batch_size is one per job here",
    },
    "train": {
        "noise_scheduler": "flow matching either way",
        "train_unet": "the DiT is what trains (true only)",
        "train_text_encoder": "the text encoder is frozen (false only)",
        "cache_text_embeddings": "caption embeds are always cached",
        "unload_text_encoder": "the text encoder only encodes the captions, once, before training",
        "disable_sampling_at_start": "previews before step 1 follow skip_first_sample",
        "force_first_sample": "previews before step 1 follow skip_first_sample (false only)",
        "bypass_guidance_embedding": "Flux's guidance embedding; these DiTs have none",
        "content_or_style": "the timestep draw is timestep_type's (balanced only)",
        "loss_type": "the flow-matching MSE (mse only)",
        "diff_output_preservation": "differential output preservation (false only)",
        "diff_output_preservation_multiplier": "read with diff_output_preservation only",
        "diff_output_preservation_class": "read with diff_output_preservation only",
        "blank_prompt_preservation": "blank prompt preservation (false only)",
        "blank_prompt_preservation_multiplier": "read with blank_prompt_preservation only",
        "do_guidance_loss": "guidance loss (false only)",
        "guidance_loss_target": "read with do_guidance_loss only",
        "do_differential_guidance": "differential guidance (false only)",
        "differential_guidance_scale": "read with do_differential_guidance only",
    },
    "model": {
        "low_vram": "ZeRO offload is the memory lever here",
        "block_compile": "compilation is per block always (train.compile)",
    },
    "sample": {"format": "previews are always MP4 + PNG sheet"},
    "job": {"meta": "kept and written into the exports' metadata"},
}


# the dataset keys of IGNORED accepted at their no-op values only
DATASET_INERT = {"mask_path": (None,), "is_reg": (False,), "network_weight": (1.0,), "controls": ([],),
                 "control_path": (None, ""), "control_path_1": (None, ""), "control_path_2": (None, ""),
                 "control_path_3": (None, ""), "flip_x": (False,), "flip_y": (False,), "auto_frame_count": (False,),
                 "batch_size": (None,)}


def check_inert(obj, path: str, accepted: dict) -> None:
    """`accepted`: {field of `obj`: its accepted values}: the no-op values of ai-toolkit keys this trainer does
    not act on (`IGNORED`); any other value is a `ConfigError` naming the key, the reason and what is accepted."""
    block = path.rsplit(".", 1)[-1].split("[")[0]
    for key, values in accepted.items():
        value = getattr(obj, key)
        if value not in values:
            shown = ", ".join("null" if v is None else json.dumps(v) for v in values)
            raise ConfigError(f"{path}.{key}", f"{value!r} is not supported by video_dit's trainer "
                                               f"({IGNORED[block][key]}); accepted: {shown}")


def torch_dtype(name: str):
    """The torch dtype of a dtype name a job file accepts (float16 / fp16, bf16 / bfloat16, float32 / fp32)."""
    return {"float16": torch.float16, "fp16": torch.float16, "bf16": torch.bfloat16,
            "bfloat16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32}[name]


@dataclass
class NetworkConfig:
    """`network`: LoRA on the blocks' self/cross-attention q, k, v, o and FFN Linears (and the image
    branch's k_img / v_img of a Wan 2.1 I2V / FLF2V model). Ours: `include_img_emb` also adapts the
    image-embedding MLP's two Linears (img_emb.proj.1 / .3).

    `streams` (ours; a family with sound): which stream's modules the LoRA adapts, of the family's targets:
    "both" (the default: all of them), "video" or "audio" (each stream's own attentions and FFN, and the
    cross-modal attention that writes into it: `AudioPath.lora_streams`; LTX-2's audio_to_video_attn is the
    video's, video_to_audio_attn the audio's). A family without sound, or whose streams share their modules
    (MiniMax H3), takes "both" only; the loss stays both streams'. `network_kwargs: {streams: ...}` (where
    ai-toolkit's arch reads it) is the same setting. A full fine-tune has no `network` block, so no streams."""

    type: Literal["lora"] = "lora"
    linear: int = 16             # rank
    linear_alpha: float | None = None  # None: = rank (scale 1)
    dropout: float = 0.0
    transformer_only: bool = True  # ignored (always the transformer blocks)
    include_img_emb: bool = False
    streams: Literal["both", "video", "audio"] | None = None  # None: network_kwargs' streams, else both
    # ai-toolkit's key: a LoRA file (either trainer's, ComfyUI's keys) the adapters start from; its modules,
    # whatever targets it was trained with, are adapted beside the family's (`lora.start_from`)
    pretrained_lora_path: str | None = None
    # ai-toolkit keys ignored (IGNORED["network"]); the web UI writes them all
    conv: int | None = None
    conv_alpha: float | None = None
    lokr_full_rank: bool | None = None
    lokr_factor: int | None = None
    network_kwargs: dict | None = None

    def validate(self, path: str) -> None:
        extra = dict(self.network_kwargs or {})
        streams = extra.pop("streams", None)
        if extra.get("ignore_if_contains", []) != [] or set(extra) - {"ignore_if_contains"}:
            raise ConfigError(f"{path}.network_kwargs", f"{extra!r} is not supported by video_dit's trainer "
                                                        f"({IGNORED['network']['network_kwargs']}); accepted: "
                                                        "{}, {ignore_if_contains: []}, {streams: ...}")
        if streams is not None and streams not in LORA_STREAMS:
            raise ConfigError(f"{path}.network_kwargs.streams",
                              f"{streams!r}; accepted: {', '.join(LORA_STREAMS)}")
        if streams is not None and self.streams is not None and streams != self.streams:
            raise ConfigError(f"{path}.network_kwargs.streams", f"{streams!r} disagrees with network.streams "
                                                                f"{self.streams!r}; set one of them")
        if self.linear <= 0:
            raise ConfigError(f"{path}.linear", f"LoRA rank must be a positive integer, got {self.linear}")
        if self.linear_alpha is not None and self.linear_alpha <= 0:
            raise ConfigError(f"{path}.linear_alpha", f"must be > 0, got {self.linear_alpha}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"{path}.dropout", f"must be in [0, 1), got {self.dropout}")
        if self.pretrained_lora_path is not None and not Path(self.pretrained_lora_path).is_file():
            raise ConfigError(f"{path}.pretrained_lora_path", f"{self.pretrained_lora_path!r}: no such file; "
                                                             "accepted: a LoRA .safetensors file")

    @property
    def alpha(self) -> float:
        return float(self.linear if self.linear_alpha is None else self.linear_alpha)

    @property
    def lora_streams(self) -> str:
        """The streams the LoRA adapts (`streams`, else `network_kwargs.streams`, else both)."""
        return self.streams or (self.network_kwargs or {}).get("streams") or LORA_STREAMS[0]

    @property
    def streams_key(self) -> str:
        """Where the job sets the streams (error messages)."""
        return "streams" if self.streams is not None or "streams" not in (self.network_kwargs or {}) \
            else "network_kwargs.streams"


@dataclass
class SaveConfig:
    """`save`: exports and checkpoints every `save_every` steps (and at the end); keep the last K."""

    dtype: Literal["float16", "fp16", "bf16", "bfloat16", "float32", "fp32"] = "float16"
    save_every: int = 250
    max_step_saves_to_keep: int = 4
    resume: str = "auto"         # ours: auto | none | a checkpoint folder (overridden by --resume)
    push_to_hub: bool = False    # ai-toolkit key; true is refused (no network here)
    save_format: Literal["safetensors", "diffusers"] | None = None  # ai-toolkit key; ignored (IGNORED["save"])

    def validate(self, path: str) -> None:
        if self.save_every < 1:
            raise ConfigError(f"{path}.save_every", f"must be >= 1, got {self.save_every}")
        if self.max_step_saves_to_keep < 1:
            raise ConfigError(f"{path}.max_step_saves_to_keep", f"must be >= 1, got {self.max_step_saves_to_keep}")
        if self.push_to_hub:
            raise ConfigError(f"{path}.push_to_hub", "not supported by video_dit's trainer; accepted: false")
        if not self.resume:
            raise ConfigError(f"{path}.resume", "accepted: auto, none or a checkpoint folder")

    @property
    def torch_dtype(self):
        return torch_dtype(self.dtype)


@dataclass
class OptimizerParams:
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8


@dataclass
class EMAConfig:
    """`train.ema_config` (ai-toolkit's keys `use_ema`, `ema_decay`, `use_feedback`, `param_multiplier`):
    an exponential moving average of the trainable weights, ema = decay * ema + (1 - decay) * weights
    after every optimizer step, starting from the initial weights (ai-toolkit's update, without its
    num_updates warm-up). Saved in checkpoints and exported beside the raw weights (`<name>_ema...`).
    Ours: `sample_with_ema` renders the previews with the EMA weights, `validate_with_ema` adds
    `val_loss_ema` (and per sigma) to the validation figures. ai-toolkit always samples and saves
    with the EMA; here the raw weights stay the main export."""

    use_ema: bool = False
    ema_decay: float = 0.999
    use_feedback: bool = False     # ai-toolkit key; only false
    param_multiplier: float = 1.0  # ai-toolkit key; only 1.0
    sample_with_ema: bool = False
    validate_with_ema: bool = False

    def validate(self, path: str) -> None:
        if not 0.0 <= self.ema_decay < 1.0:
            raise ConfigError(f"{path}.ema_decay", f"must be in [0, 1) (e.g. 0.999), got {self.ema_decay}")
        if self.use_feedback:
            raise ConfigError(f"{path}.use_feedback", "not supported by video_dit's trainer; accepted: false")
        if self.param_multiplier != 1.0:
            raise ConfigError(f"{path}.param_multiplier", "not supported by video_dit's trainer; accepted: 1.0")


@dataclass
class ValidationItem:
    """One `validation_items` entry (ai-toolkit's keys): a held-out image or, here, also a video clip
    (read like a training item of the first dataset: its num_frames, fps and frame selection), with
    its prompt. An item without a readable file is skipped with a warning naming it (as ai-toolkit
    does); the job stops before training when no item is left."""

    image_path: str = ""
    prompt: str = ""


@dataclass
class ValidationConfig:
    """`train.validation_config` (ai-toolkit's keys): every `validate_every_n_steps` (and at step 0 and
    the last step) the loss of each held-out item at each of `validation_sigmas` with noise fixed per
    item, computed as the training loss is (conditioning, i2v loss mask, weighting), logged as
    `val_loss` (mean over sigmas) and `val_loss@<sigma>` in metrics.jsonl. The items are
    `validation_items` plus every dataset's `validation_split` share (see `DatasetConfig`).
    ai-toolkit's `resolution` default is 512 (an image trainer's size); here None means the first
    dataset's first resolution. Ours: `num_frames` (None: the first dataset's), `seed` (item i's noise
    comes from seed + i; ai-toolkit's is 42 + i)."""

    validation_items: list[ValidationItem] = field(default_factory=list)
    validation_sigmas: list[float] = field(default_factory=lambda: [1.0, 0.75, 0.5, 0.25])
    validate_every_n_steps: int = 10
    resolution: int | None = None
    num_frames: int | None = None
    seed: int = 42

    def validate(self, path: str) -> None:
        if not self.validation_sigmas:
            raise ConfigError(f"{path}.validation_sigmas", "give at least one sigma in (0, 1]")
        for i, s in enumerate(self.validation_sigmas):
            if not 0.0 < s <= 1.0:
                raise ConfigError(f"{path}.validation_sigmas[{i}]", f"must be in (0, 1] (1 = pure noise), got {s}")
        if len(set(self.validation_sigmas)) != len(self.validation_sigmas):
            raise ConfigError(f"{path}.validation_sigmas", f"repeats a sigma: {self.validation_sigmas}")
        if self.validate_every_n_steps < 1:
            raise ConfigError(f"{path}.validate_every_n_steps", f"must be >= 1, got {self.validate_every_n_steps}")
        for key in ("resolution", "num_frames"):
            if getattr(self, key) is not None and getattr(self, key) < 1:
                raise ConfigError(f"{path}.{key}", f"must be >= 1, got {getattr(self, key)}")


@dataclass
class TrainConfig:
    """`train`. Ours beyond ai-toolkit: `warmup_steps`, `lr_scheduler`, `max_nonfinite_steps`,
    `timestep_shift` (None: the preset's), `min_t`/`max_t`, `cpu_bf16` (CPU ranks train a bf16 job
    in float32, saying so once, unless this is true: then in bf16, slowly; for testing that path),
    `recompute_saved` (without gradient checkpointing, the blocks store cheap elementwise results as
    recipes recomputed in backward; false keeps them: more activation memory, which the memory plan
    counts, for ~10% faster CPU steps; not with sequence parallelism, which the plan does not model so),
    `compile` (auto | true | false: `torch.compile` of each DiT block, with the Inductor fusion that
    broke the modulation's gradients switched off, `VideoDiT.compile_blocks`; auto turns it on for GPU
    ranks under ZeRO 0-2 without sequence parallelism, where it measured faster, and off elsewhere).
    `gradient_checkpointing`: ai-toolkit's true / false, or N (checkpoint the first N of the DiT's blocks,
    `VideoDiT.set_checkpointed_blocks`), or "auto": per bucket, the fewest checkpointed blocks whose planned
    peak fits the device with `plan.AUTO_MARGIN` to spare (`plan.checkpoint_blocks`; on CPU ranks against
    the host's memory). The losses are the same whatever is checkpointed.
    `global_batch_size` (ours; ai-toolkit's trainer ignores it): the samples of one optimizer step over
    all data-parallel ranks; `batch_size` is then the largest micro-batch per rank and the accumulation
    follows from the rank count (`for_ranks`), so a recipe trains alike on 1, 2 or 8 GPUs.
    `ema_config` and `validation_config` are ai-toolkit's blocks (see `EMAConfig`, `ValidationConfig`).
    A model that generates sound (`Family.audio`, docs/configuration.md "Sound"): `audio_timesteps` (tied: each sample's
    audio stream at the video's t; independent: its own draw from the same distribution; None: the family's
    reference trainer's choice) and `audio_loss_weight` (the audio loss beside the video's 1; None: the
    reference's); refused for a model without sound."""

    batch_size: int = 1
    steps: int = 1000
    gradient_accumulation: int = 1
    gradient_accumulation_steps: int | None = None  # ai-toolkit's older name for the same thing
    # ours: the batch of one optimizer step over all data-parallel ranks, whatever their number (`for_ranks`)
    global_batch_size: int | None = None
    gradient_checkpointing: Any = False  # true | false | N blocks | "auto" (`check_checkpointing`)
    compile: bool | str = "auto"  # ours: torch.compile of each block; auto = on GPU ranks under ZeRO 0-2 without SP
    lr: float = 1e-4
    optimizer: Literal["adamw", "adam"] = "adamw"
    optimizer_params: OptimizerParams = field(default_factory=OptimizerParams)
    dtype: Literal["bf16", "bfloat16", "fp32", "float32"] = "bf16"
    cpu_bf16: bool = False
    recompute_saved: bool = True
    # conditioned on [min_t, max_t]; "weighted" = ai-toolkit's table, "bell" = ours (diffusion/flow.py)
    timestep_type: Literal["shift", "uniform", "linear", "sigmoid", "logit_normal", "weighted", "bell"] = "shift"
    timestep_shift: float | None = None
    min_t: float = 0.0
    max_t: float = 1000.0
    seed: int = 42
    max_grad_norm: float = 1.0
    warmup_steps: int = 0
    lr_scheduler: Literal["constant", "cosine"] = "constant"
    max_nonfinite_steps: int = 5
    skip_first_sample: bool = False
    disable_sampling: bool = False
    # two-expert models (train/experts.py): ai-toolkit's switch_boundary_every (optimizer steps per expert
    # turn) and ours, expert_choice: "alternate" (ai-toolkit's rule) or "timestep"
    switch_boundary_every: int = 1
    expert_choice: Literal["alternate", "timestep"] = "alternate"
    # a model with sound (ours): the audio stream's timesteps and loss weight (None: its family's reference's)
    audio_timesteps: Literal["tied", "independent"] | None = None
    audio_loss_weight: float | None = None
    # ai-toolkit keys accepted and ignored (see IGNORED)
    # flow matching either way; ai-toolkit's default "ddpm" makes ai-toolkit draw t from its shifted sampling
    # grid instead of by timestep_type: a job shared with ai-toolkit should say flowmatch
    noise_scheduler: Literal["flowmatch", "ddpm"] = "flowmatch"
    train_unet: bool = True
    train_text_encoder: Literal[False] = False
    cache_text_embeddings: bool = True
    disable_sampling_at_start: bool | None = None
    unload_text_encoder: bool = False
    force_first_sample: bool = False
    bypass_guidance_embedding: bool | None = None
    content_or_style: Literal["balanced", "content", "style"] = "balanced"
    loss_type: Literal["mse", "mae", "wavelet", "stepped"] = "mse"
    diff_output_preservation: bool = False
    diff_output_preservation_multiplier: float | None = None
    diff_output_preservation_class: str | None = None
    blank_prompt_preservation: bool = False
    blank_prompt_preservation_multiplier: float | None = None
    do_guidance_loss: bool | None = None
    guidance_loss_target: float | None = None
    do_differential_guidance: bool | None = None
    differential_guidance_scale: float | None = None
    ema_config: EMAConfig = field(default_factory=EMAConfig)
    validation_config: ValidationConfig | None = None

    def validate(self, path: str) -> None:
        check_inert(self, path, {"force_first_sample": (False,), "content_or_style": ("balanced",),
                                 "loss_type": ("mse",), "diff_output_preservation": (False,),
                                 "blank_prompt_preservation": (False,), "do_guidance_loss": (None, False),
                                 "do_differential_guidance": (None, False)})
        check_checkpointing(self.gradient_checkpointing, f"{path}.gradient_checkpointing")
        for key in ("batch_size", "steps", "gradient_accumulation", "max_nonfinite_steps", "switch_boundary_every"):
            if getattr(self, key) < 1:
                raise ConfigError(f"{path}.{key}", f"must be >= 1, got {getattr(self, key)}")
        if self.gradient_accumulation_steps is not None:
            if self.gradient_accumulation_steps < 1:
                raise ConfigError(f"{path}.gradient_accumulation_steps", "must be >= 1")
            if self.gradient_accumulation not in (1, self.gradient_accumulation_steps):
                raise ConfigError(f"{path}.gradient_accumulation_steps",
                                  "conflicts with gradient_accumulation; give only one of them")
            self.gradient_accumulation = self.gradient_accumulation_steps
        if self.global_batch_size is not None:
            if self.global_batch_size < 1:
                raise ConfigError(f"{path}.global_batch_size", f"must be >= 1, got {self.global_batch_size}")
            if self.gradient_accumulation != 1:
                raise ConfigError(f"{path}.global_batch_size", "conflicts with gradient_accumulation (it sets "
                                                                "the accumulation from the rank count); give only "
                                                                "one of them")
        if not self.lr > 0:
            raise ConfigError(f"{path}.lr", f"must be > 0, got {self.lr}")
        if self.warmup_steps < 0:
            raise ConfigError(f"{path}.warmup_steps", f"must be >= 0, got {self.warmup_steps}")
        if self.max_grad_norm < 0:
            raise ConfigError(f"{path}.max_grad_norm", f"must be >= 0 (0 disables clipping), got {self.max_grad_norm}")
        if not 0.0 <= self.min_t < self.max_t <= 1000.0:
            raise ConfigError(f"{path}.min_t", f"need 0 <= min_t < max_t <= 1000, got {self.min_t}, {self.max_t}")
        if self.timestep_shift is not None and self.timestep_shift <= 0:
            raise ConfigError(f"{path}.timestep_shift", f"must be > 0, got {self.timestep_shift}")
        if not self.train_unet:
            raise ConfigError(f"{path}.train_unet", "video_dit trains the DiT; accepted: true")
        if self.compile not in (True, False, "auto"):
            raise ConfigError(f"{path}.compile", f"{self.compile!r}; accepted: auto, true, false")
        if self.audio_loss_weight is not None and not self.audio_loss_weight >= 0:
            raise ConfigError(f"{path}.audio_loss_weight", f"must be >= 0, got {self.audio_loss_weight}")

    def for_ranks(self, dp_ranks: int, path: str = "train") -> TrainConfig:
        """This config on `dp_ranks` data-parallel ranks. With `global_batch_size` G: G / dp_ranks samples
        per rank and step, as micro-batches of the largest size <= `batch_size` that divides them, and
        the accumulation that makes up the rest (G 16, batch_size 8: 1 rank 8 x 2, 2 ranks 8 x 1, 8 ranks
        2 x 1); so a recipe trains the same batch on any number of GPUs. Without it, unchanged."""
        g = self.global_batch_size
        if g is None:
            return self
        if g % dp_ranks:
            fits = [n for n in range(1, g + 1) if g % n == 0]
            raise ConfigError(f"{path}.global_batch_size", f"{g} does not split evenly over {dp_ranks} data-parallel "
                                                           f"ranks; accepted: a multiple of {dp_ranks}, or run on "
                                                           f"{', '.join(map(str, fits))} ranks (CUDA_VISIBLE_DEVICES, "
                                                           "--num_gpus)")
        per_rank = g // dp_ranks
        micro = max(b for b in range(1, min(self.batch_size, per_rank) + 1) if per_rank % b == 0)
        return replace(self, batch_size=micro, gradient_accumulation=per_rank // micro)


CHECKPOINTING_WORDS = ("auto",)


def check_checkpointing(value, path: str, blocks: int | None = None) -> None:
    """`train.gradient_checkpointing`: true, false, "auto" or a number of blocks in 0..`blocks` (the
    preset's; unknown here when None)."""
    accepted = f"true, false, auto, or a number of blocks 0..{blocks if blocks is not None else 'blocks'}"
    if isinstance(value, bool):
        return
    if isinstance(value, str):
        if value not in CHECKPOINTING_WORDS:
            raise ConfigError(path, f"{value!r} is not accepted; accepted: {accepted}")
        return
    if not isinstance(value, int):
        raise ConfigError(path, f"{value!r} is not accepted; accepted: {accepted}")
    if value < 0 or (blocks is not None and value > blocks):
        raise ConfigError(path, f"{value} is not a number of blocks of this DiT; accepted: {accepted}")


def checkpointed_blocks_of(train, blocks: int) -> int | None:
    """How many of the `blocks` blocks `train.gradient_checkpointing` checkpoints: 0..blocks, or None
    for "auto" (the plan chooses per bucket at run time)."""
    value = train.gradient_checkpointing
    if isinstance(value, str):
        return None
    if isinstance(value, bool):
        return blocks if value else 0
    return value


# `model.model_kwargs` keys (ai-toolkit hands model_kwargs to the arch untouched; ours reads these,
# video_dit/integrations/ai_toolkit/model.py `ModelKwargs`); each is also accepted as `model.<key>`.
MODEL_KWARGS = ("preset", "i2v_mode", "attention_backend", "mask_first_frame_loss", "image_encoder_path",
                "quantize_image_encoder", "train_high_noise", "train_low_noise", "boundary_ratio", "audio_timesteps")


@dataclass
class ModelConfig:
    """`model`. `name_or_path`: `preset:NAME` (seeded random init) or a weights file/folder (then
    `preset` names the VAE / text encoder / schedule family). Ours: `vae_path`, `text_encoder_path`
    (default: the preset's random init for `tiny`, else the `vae/` / `text_encoder/` folders next to
    `name_or_path`), `tokenizer_path`, `seed` (of random inits). `mask_first_frame_loss` (ours; put it in
    `model_kwargs` in a job shared with ai-toolkit, whose arch reads it there): None = latent frame 0 is
    out of the loss in i2v replace mode and in it in concat mode (diffusion/conditioning.py says why);
    true masks it in either mode; false is concat only. `image_encoder_path` (ours, also in
    `model_kwargs`): the CLIP image encoder of a Wan 2.1 I2V / FLF2V preset (a folder with
    image_encoder/ + image_processor/, ComfyUI's clip_vision_h.safetensors or Wan's
    models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth; default: `image_encoder/` next to
    `name_or_path`, or the tiny presets' random one); `quantize_image_encoder` (qfloat8 weights).
    `vae_dtype` (ai-toolkit's key): the dtype the VAE encodes and decodes in; ours defaults to float32
    whatever `train.dtype` (Wan runs its VAE in float32; bf16 Conv3d has no fast kernel), ai-toolkit's
    to its training dtype. Two-expert presets (Wan 2.2 A14B, train/experts.py): `train_high_noise` /
    `train_low_noise` (ai-toolkit's model_kwargs; None = true), `boundary_ratio` (ours; None = the
    folder's model_index.json, else the preset's)."""

    arch: str = "video_dit"  # or the UI's `video_dit:<preset>` (ai-toolkit strips the tag; the preset here)
    name_or_path: str = "preset:tiny"
    preset: str | None = None
    quantize: bool = False
    qtype: Literal["qfloat8", "qint8", "float8"] = "qfloat8"
    quantize_te: bool = False
    qtype_te: Literal["qfloat8", "qint8", "float8"] = "qfloat8"
    i2v_mode: Literal["replace", "concat"] | None = None
    mask_first_frame_loss: bool | None = None
    train_high_noise: bool | None = None
    train_low_noise: bool | None = None
    boundary_ratio: float | None = None
    attention_backend: Literal["native", "flash", "flash3", "sage"] = "native"
    vae_path: str | None = None
    text_encoder_path: str | None = None
    te_name_or_path: str | None = None  # ai-toolkit's name for text_encoder_path (one file, both tools)
    tokenizer_path: str | None = None
    image_encoder_path: str | None = None
    quantize_image_encoder: bool | None = None  # None: false
    audio_path: str | None = None  # the audio codec of a model with sound (`Family.audio`; spec.py resolves it)
    audio_timesteps: str | None = None  # where the arch reads train.audio_timesteps (model_kwargs); merged into it
    vae_dtype: Literal["float32", "fp32", "bf16", "bfloat16", "float16", "fp16"] = "float32"
    seed: int = 0
    low_vram: bool = False         # ai-toolkit key; ignored (ZeRO offload is the lever here)
    model_kwargs: dict | None = None  # ai-toolkit key; the MODEL_KWARGS keys may sit here (the arch reads them)
    compile: bool | None = None    # ai-toolkit key: torch.compile of the blocks, honoured as train.compile
    block_compile: bool | None = None  # ai-toolkit key; ignored (IGNORED["model"])

    def validate(self, path: str) -> None:
        kwargs = dict(self.model_kwargs or {})
        for key in MODEL_KWARGS:
            if key in kwargs:
                value = kwargs.pop(key)
                if getattr(self, key) not in (None, value, "native"):
                    raise ConfigError(f"{path}.model_kwargs.{key}", f"conflicts with {path}.{key}")
                setattr(self, key, value)
        if kwargs:
            key = next(iter(kwargs))
            raise ConfigError(f"{path}.model_kwargs.{key}", f"unknown key{did_you_mean(key, MODEL_KWARGS)}; "
                                                            f"accepted in model_kwargs: {', '.join(MODEL_KWARGS)}")
        self._arch_tag(path)
        for key in ("train_high_noise", "train_low_noise"):
            if getattr(self, key) not in (None, True, False):
                raise ConfigError(f"{path}.model_kwargs.{key}", f"{getattr(self, key)!r}; accepted: true, false")
        if self.mask_first_frame_loss not in (None, True, False):
            raise ConfigError(f"{path}.mask_first_frame_loss", f"{self.mask_first_frame_loss!r}; accepted: true, false")
        if self.te_name_or_path is not None:
            if self.text_encoder_path not in (None, self.te_name_or_path):
                raise ConfigError(f"{path}.te_name_or_path", f"conflicts with {path}.text_encoder_path; set one")
            self.text_encoder_path = self.te_name_or_path
        if self.i2v_mode not in (None, "replace", "concat"):
            raise ConfigError(f"{path}.i2v_mode", f"{self.i2v_mode!r}; accepted: replace, concat")
        if self.attention_backend == "sage":
            raise ConfigError(f"{path}.attention_backend", "'sage' (SageAttention) has no backward, so it cannot "
                              "train; accepted: native, flash, flash3 (sage renders: `video-dit sample "
                              "--attention-backend sage`)")
        name = preset_name(self.name_or_path)
        if name is not None:
            if name not in PRESETS:
                raise ConfigError(f"{path}.name_or_path", f"unknown preset {name!r}; accepted: "
                                  + ", ".join(f"preset:{p}" for p in PRESETS) + " or a weights path")
            if self.preset not in (None, name):
                raise ConfigError(f"{path}.preset", f"{self.preset!r} differs from name_or_path's preset {name!r}")
            self.preset = name
        elif self.preset is None:
            raise ConfigError(f"{path}.preset", "required when name_or_path is a path (it names the VAE, text "
                                                f"encoder and schedule family); accepted: {', '.join(PRESETS)}")
        if self.preset not in PRESETS:
            raise ConfigError(f"{path}.preset", f"unknown preset {self.preset!r}; accepted: {', '.join(PRESETS)}")

    def _arch_tag(self, path: str) -> None:
        """`arch`: video_dit, or ai-toolkit's UI tag `video_dit:<preset>` naming the preset."""
        base, colon, tag = self.arch.partition(":")
        if base != "video_dit" or (colon and tag not in PRESETS):
            raise ConfigError(f"{path}.arch", f"{self.arch!r}; accepted: video_dit, or video_dit:<preset> (the web "
                                              f"UI's entries) with a preset among {', '.join(PRESETS)}"
                                              f"{did_you_mean(tag, PRESETS) if base == 'video_dit' else ''}")
        if colon and self.preset not in (None, tag):
            raise ConfigError(f"{path}.arch", f"{self.arch!r} names preset {tag!r}, but the job's preset (model.preset "
                                              f"or model_kwargs.preset) is {self.preset!r}; give one")
        if colon:
            self.preset = tag

    @property
    def vae_torch_dtype(self):
        return torch_dtype(self.vae_dtype)

    @property
    def qtype_name(self) -> str:
        return "qfloat8" if self.qtype == "float8" else self.qtype


def _no_negative(value, path: str):
    """ai-toolkit's `neg` defaults to the boolean False (no negative prompt): False means ""."""
    if value is True:
        raise ConfigError(path, "expected a negative prompt (a string), or false / empty for none; got true")
    return "" if value is False else value


@dataclass
class SampleItem:
    """One preview. ai-toolkit's per-sample keys are accepted at the values our previews honour:
    `ctrl_img_1` is `ctrl_img` (the first frame), `ctrl_img_2` (ai-toolkit's second control image) the
    last frame of a first-last-frame model (Wan 2.1 FLF2V; refused for others at validation),
    `ctrl_img_3` none, `ctrl_idx` 0, `network_multiplier` 1 (the LoRA as trained), `do_cfg_norm` false;
    `neg: false` is no negative."""

    prompt: str
    ctrl_img: str | None = None
    neg: str | bool | None = None
    seed: int | None = None
    guidance_scale: float | None = None
    guidance_scale_2: float | None = None  # ours: a two-expert model's low-noise expert's scale
    sample_steps: int | None = None
    num_frames: int | None = None
    width: int | None = None
    height: int | None = None
    fps: int | None = None
    ctrl_idx: int = 0
    network_multiplier: float = 1.0
    ctrl_img_1: str | None = None
    ctrl_img_2: str | None = None
    ctrl_img_3: str | None = None
    do_cfg_norm: bool = False

    def validate(self, path: str) -> None:
        self.neg = _no_negative(self.neg, f"{path}.neg")
        if self.ctrl_img_1 is not None:
            if self.ctrl_img not in (None, self.ctrl_img_1):
                raise ConfigError(f"{path}.ctrl_img_1", "differs from ctrl_img; give the first frame once")
            self.ctrl_img = self.ctrl_img_1
        for key, default, why in (("ctrl_img_3", None, "previews take a first frame (ctrl_img) and, for a "
                                                       "first-last-frame model, a last frame (ctrl_img_2)"),
                                  ("ctrl_idx", 0, "previews take one first frame (ctrl_img)"),
                                  ("network_multiplier", 1.0, "previews apply the LoRA as trained"),
                                  ("do_cfg_norm", False, "previews use plain classifier-free guidance")):
            if getattr(self, key) != default:
                raise ConfigError(f"{path}.{key}", f"{getattr(self, key)!r} is not supported by video_dit's "
                                                   f"trainer ({why}); accepted: {default!r}")


@dataclass
class SampleConfig:
    """`sample`: previews every `sample_every` steps from step `sample_start_step` on (and before step 1
    unless `train.skip_first_sample`). `neg: false` (ai-toolkit's default) is no negative prompt."""

    sample_every: int = 250
    sample_start_step: int = 0
    width: int = 832
    height: int = 480
    num_frames: int = 17
    fps: int = 16
    samples: list[SampleItem] = field(default_factory=list)
    prompts: list[str] | None = None  # ai-toolkit's older form: plain prompt strings
    # Sampling settings: None (absent) = the model folder's scheduler config (sampler, shift), else the
    # preset's `sample_*` defaults (diffusion/sampling_settings.py); the trainer logs which were used.
    neg: str | bool | None = None   # false (ai-toolkit's default when written out) = no negative prompt
    seed: int = 42
    walk_seed: bool = True
    guidance_scale: float | None = None
    guidance_scale_2: float | None = None  # ours: two experts (A14B): the low-noise expert's; guidance_scale the high
    sample_steps: int | None = None
    shift: float | None = None      # ours
    # ai-toolkit's key: "unipc" (Wan's solver) or "euler" ("flowmatch" is ai-toolkit's name for its
    # flow-matching Euler); any other ai-toolkit sampler name (its default "ddpm", ...) names no flow
    # solver of ours: the default above applies (and the logged line says where it came from)
    sampler: str | None = None
    format: str | None = None       # ai-toolkit key; previews are always MP4 here (+ a PNG contact sheet)

    def validate(self, path: str) -> None:
        self.neg = _no_negative(self.neg, f"{path}.neg")
        if self.prompts:
            if self.samples:
                raise ConfigError(f"{path}.prompts", "give either samples or prompts, not both")
            self.samples = [SampleItem(prompt=p) for p in self.prompts]
        if self.sample_every < 1:
            raise ConfigError(f"{path}.sample_every", f"must be >= 1, got {self.sample_every}")
        if self.sample_start_step < 0:
            raise ConfigError(f"{path}.sample_start_step", f"must be >= 0, got {self.sample_start_step}")
        for key in ("width", "height", "num_frames", "sample_steps", "fps"):
            if getattr(self, key) is not None and getattr(self, key) < 1:
                raise ConfigError(f"{path}.{key}", f"must be >= 1, got {getattr(self, key)}")
        for key in ("guidance_scale", "guidance_scale_2", "shift"):
            v = getattr(self, key)
            if v is not None and (v < 0 or (key == "shift" and v == 0)):
                raise ConfigError(f"{path}.{key}", f"must be {'> 0' if key == 'shift' else '>= 0'}, got {v}")
        for i, s in enumerate(self.samples):
            for key in ("width", "height", "num_frames", "sample_steps", "fps"):
                v = getattr(s, key)
                if v is not None and v < 1:
                    raise ConfigError(f"{path}.samples[{i}].{key}", f"must be >= 1, got {v}")


@dataclass
class DeepSpeedConfig:
    """`deepspeed` (ours): ZeRO stage 0-3, optimizer/parameter offload to CPU, sequence-parallel
    degree, the collective timeout, `config`: a DeepSpeed JSON (dict or path) merged last, and
    `memory_check`: what `launch/train.sh` does when the memory plan (`video-dit plan`) predicts a
    bucket will not fit, before any weights are loaded: refuse (exit 2), warn, or off."""

    zero_stage: int = 2
    offload_optimizer: bool = False
    offload_param: bool = False
    config: dict | str | None = None
    sequence_parallel_size: int = 1
    timeout_s: int = 1800
    memory_check: Literal["refuse", "warn", "off"] = "refuse"

    def validate(self, path: str) -> None:
        if self.zero_stage not in (0, 1, 2, 3):
            raise ConfigError(f"{path}.zero_stage", f"{self.zero_stage}; accepted: 0, 1, 2, 3")
        if self.offload_param and not partitioned(self.zero_stage):
            raise ConfigError(f"{path}.offload_param", "parameter offload needs zero_stage: 3")
        if self.offload_optimizer and not shards_optimizer(self.zero_stage):
            raise ConfigError(f"{path}.offload_optimizer", "optimizer offload needs zero_stage 1, 2 or 3")
        if self.sequence_parallel_size < 1:
            raise ConfigError(f"{path}.sequence_parallel_size", f"must be >= 1, got {self.sequence_parallel_size}")
        if self.timeout_s < 10:
            raise ConfigError(f"{path}.timeout_s", f"must be >= 10 seconds, got {self.timeout_s}")

    def extra(self) -> dict:
        """The `config` JSON as a dict (a path is read)."""
        if self.config is None:
            return {}
        if isinstance(self.config, dict):
            return dict(self.config)
        p = Path(self.config)
        try:
            return json.loads(p.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError("deepspeed.config", f"{p}: not a readable DeepSpeed JSON ({exc})") from exc


@dataclass
class DemoDataStage:
    """`prepare.demo_data`: run `make_demo_data(dir, ...)` when `dir` holds no clip yet; with `audio_rate`
    (samples per second), `demo_av.make_demo_av_data`: every clip with its caption's sound."""

    dir: str
    count: int = 64
    frames: int = 17
    size: int = 64
    seed: int = 0
    holdout: int = 4
    fps: float = 16
    audio_rate: int | None = None


@dataclass
class TinyVAEStage:
    """`prepare.tiny_vae`: run `train_tiny_vae(data, model.vae_path, ...)` when the file is missing."""

    data: str
    steps: int = 150  # the recipe of the family's VAE stage (Wan's: families/wan/vae_stage.py)
    seed: int = 0
    batch_size: int = 2
    frames: int = 5
    lr: float = 2e-3
    sample_posterior: bool = True  # False: decode the posterior mean in training (a plain autoencoder)
    latent_init_scale: float | None = None  # scale of the initial posterior mean (see train_tiny_vae)
    cell_weight: float = 0.0  # weight of the latent cells' mean-colour error (see train_tiny_vae)
    bright_weight: float = 0.0  # weight of each pixel's brightest-channel error (see train_tiny_vae)
    colour_path: bool = False  # start z[:, :3] as the cells' mean RGB (Wan's vae_stage.init_colour_path)
    fg_weight: float = 4.0  # extra weight of the shapes' pixels in the loss (1 + fg_weight on a shape)
    fg_ring: int = 0  # fg_weight also on the pixels within this many px of a shape (both sides of an edge)
    images: int = 0  # single frames (first-frame path) added to each step's windows (see train_tiny_vae)
    image_steps: int = 0  # the first steps train on single frames alone (see train_tiny_vae)
    bf16: bool = False  # train under bfloat16 autocast on a CPU with native bf16 (float32 weights)
    preset: str = "tiny"  # the VAE preset trained: one of a family's `vae_presets` (`families.vae_family`)
    ranks: int = 1  # data-parallel processes on this machine (each a share of the step's windows)
    ema: float = 0.0  # decay of the weights' moving average that is saved (0: the last step's weights)


@dataclass
class TinyAudioStage:
    """`prepare.tiny_audio`: a model with sound's audio codec (audio VAE, then vocoder) trained on the tracks of
    the clips in `data` and written to `model.audio_path` when it is missing (`AudioPath.codec_stage` of the
    model's family, for its preset; LTX-2's: families/ltx2/vae_stage.py `train_tiny_codec`)."""

    data: str
    steps: int = 300  # the audio VAE's optimizer steps
    vocoder_steps: int = 400
    batch_size: int = 8  # clips per step
    lr: float = 2e-3
    vocoder_lr: float = 3e-4
    segment_frames: int | None = None  # the vocoder trains on windows of this many mel frames (None: whole clips)
    seed: int = 0


@dataclass
class PrepareConfig:
    """`prepare` (ours): set-up stages run once before the ranks start (`video_dit.train.validate
    --prepare`, called by `launch/train.sh`); each is skipped when its output exists."""

    demo_data: DemoDataStage | None = None
    tiny_vae: TinyVAEStage | None = None
    tiny_audio: TinyAudioStage | None = None


@dataclass
class LoggingConfig:
    """`logging` (ai-toolkit's keys, its defaults: toolkit/config_modules.py LoggingConfig at 27a03a91).
    metrics.jsonl (and TensorBoard, when installed) get every step; with `use_wandb`, Weights & Biases
    gets what ai-toolkit sends it (toolkit/logging_aitk.py WandbLogger): `learning_rate` and `loss/loss`
    every `log_every` steps (plus our step's other figures), in project `project_name`, run `run_name`, the
    job file as the run's config (`metrics.WandbLog`). wandb is not a dependency: `pip install wandb`."""

    log_every: int = 100
    verbose: bool = False
    use_wandb: bool = False
    use_ui_logger: bool = False
    project_name: str = "ai-toolkit"
    run_name: str | None = None

    def validate(self, path: str) -> None:
        if self.log_every < 1:
            raise ConfigError(f"{path}.log_every", f"must be >= 1, got {self.log_every}")
        if self.use_wandb and importlib.util.find_spec("wandb") is None:
            raise ConfigError(f"{path}.use_wandb", "true needs Weights & Biases, which is not installed here: "
                                                   "pip install wandb (or set use_wandb: false)")


@dataclass
class ProcessConfig:
    type: Literal["sd_trainer", "diffusion_trainer"] = "sd_trainer"  # diffusion_trainer: the web UI's (the same)
    training_folder: str = "output"
    device: str | None = None
    trigger_word: str | None = None
    network: NetworkConfig | None = None  # absent: full fine-tune
    save: SaveConfig = field(default_factory=SaveConfig)
    datasets: list[DatasetConfig] = field(default_factory=list)
    train: TrainConfig = field(default_factory=TrainConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    sample: SampleConfig | None = None
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    prepare: PrepareConfig | None = None
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    sqlite_db_path: str | None = None  # the web UI's keys; ignored (IGNORED["process"])
    performance_log_every: int | None = None

    def validate(self, path: str) -> None:
        if self.model.compile is not None:  # ai-toolkit's model.compile is our train.compile
            if self.train.compile not in ("auto", self.model.compile):
                raise ConfigError(f"{path}.model.compile", f"{self.model.compile} conflicts with train.compile "
                                                           f"{self.train.compile}; give one")
            self.train.compile = self.model.compile
        if not self.datasets:
            raise ConfigError(f"{path}.datasets", "at least one dataset is required")
        self._apply_trigger_word()
        preset = get_preset(self.model.preset)
        for i, d in enumerate(self.datasets):  # clip lengths the model's VAE encodes
            check_inert(d, f"{path}.datasets[{i}]", DATASET_INERT)
            d.fit_frames(preset.vae.snap_frames, f"{path}.datasets[{i}]")
        self._check_audio(path, preset)
        self._check_quantize(path)
        self._check_experts(path, preset)
        check_checkpointing(self.train.gradient_checkpointing, f"{path}.train.gradient_checkpointing",
                            preset.dit.num_layers)
        self._check_sequence_parallel(path, preset)
        self._check_i2v(path, preset)
        self._check_image_branch(path, preset)
        self._check_validation_and_training(path)

    def _apply_trigger_word(self) -> None:
        """ai-toolkit's `trigger_word` (BaseSDTrainProcess at 27a03a91): a dataset without its own takes the
        process's (its captions get it: `dataset.inject_trigger`), and the previews' prompts have `[trigger]` /
        `[name]` replaced by it (not prepended)."""
        for d in self.datasets:
            if d.trigger_word is None:
                d.trigger_word = self.trigger_word
        if self.trigger_word is not None and self.sample is not None:
            for item in self.sample.samples:
                item.prompt = inject_trigger(item.prompt, self.trigger_word, add_if_not_present=False)

    def _check_audio(self, path: str, preset) -> None:
        """The sound keys: for a model with sound only; its clips' tracks cut by the span of consecutive
        frames (`shrink_video_to_frames: false`), so every clip of a bucket has one audio length."""
        sound = family_of(preset).audio
        given = self.model.audio_timesteps  # the arch's spelling of train.audio_timesteps (model_kwargs)
        if given is not None:
            key = f"{path}.model.model_kwargs.audio_timesteps"
            if sound is None:
                raise ConfigError(key, f"preset {preset.name!r} generates no sound; remove it")
            if given not in ("tied", "independent"):
                raise ConfigError(key, f"{given!r} is not accepted; accepted: 'tied' | 'independent'")
            if self.train.audio_timesteps not in (None, given):
                raise ConfigError(key, f"{given!r} conflicts with train.audio_timesteps "
                                       f"{self.train.audio_timesteps!r}; give one")
            self.train.audio_timesteps = given
        if sound is None:
            for key in ("audio_timesteps", "audio_loss_weight"):
                if getattr(self.train, key) is not None:
                    raise ConfigError(f"{path}.train.{key}", f"preset {preset.name!r} generates no sound; remove it")
            return
        for i, d in enumerate(self.datasets):
            if d.is_video and d.audio != "off" and d.shrink_video_to_frames:
                raise ConfigError(f"{path}.datasets[{i}].shrink_video_to_frames",
                                  f"true spreads the frames over the whole clip, so its sound would span each clip's "
                                  f"own length; preset {preset.name!r} trains sound with the picture: accepted: false "
                                  f"(consecutive frames at the dataset's fps, as the reference trainer cuts them), or "
                                  f"audio: off on this dataset")

    def _check_quantize(self, path: str) -> None:
        """optimum-quanto's frozen weights: LoRA only, never under ZeRO-3."""
        if self.model.quantize and partitioned(self.deepspeed.zero_stage):
            raise ConfigError(f"{path}.model.quantize",
                              "quantize: true cannot be combined with deepspeed.zero_stage: 3 (optimum-quanto "
                              "replaces the frozen weights by packed tensors, which ZeRO-3 cannot partition "
                              "and gather); accepted: quantize with zero_stage 0, 1 or 2, or zero_stage 3 "
                              "without quantize")
        if self.model.quantize and self.network is None:
            raise ConfigError(f"{path}.model.quantize", "a quantized base is frozen: quantize needs a "
                                                        "`network` (LoRA) block; remove quantize for a full fine-tune")

    def _check_experts(self, path: str, preset) -> None:
        """A two-expert preset's experts and their timestep ranges; the keys refused on one model."""
        trained = requested(self.model, preset)  # two-expert presets: which experts (the folder: validate.py)
        if preset.two_experts:
            check_ranges(self.train, trained, boundary_of(self.model, preset))
        elif self.model.boundary_ratio is not None:
            boundary_of(self.model, preset)  # refused on a one-model preset
        if self.sample is not None and not preset.two_experts:
            for key, cfg in [("sample", self.sample)] + [(f"sample.samples[{i}]", s)
                                                        for i, s in enumerate(self.sample.samples)]:
                if cfg.guidance_scale_2 is not None:
                    raise ConfigError(f"{path}.{key}.guidance_scale_2",
                                      f"the low-noise expert's guidance scale, but preset {preset.name!r} is one "
                                      "model, not two experts; give guidance_scale alone")

    def _check_sequence_parallel(self, path: str, preset) -> None:
        """Ulysses: whole heads per rank; what the plan does not model is refused."""
        heads = preset.dit.num_heads
        sp = self.deepspeed.sequence_parallel_size
        blocks = checkpointed_blocks_of(self.train, preset.dit.num_layers)
        if not self.train.recompute_saved and sp > 1 and blocks != preset.dit.num_layers:
            raise ConfigError(f"{path}.train.recompute_saved", f"false is not planned with sequence parallelism "
                              f"(deepspeed.sequence_parallel_size {sp}); accepted: true, or sequence_parallel_size 1")
        if heads % sp:
            valid = [n for n in range(1, heads + 1) if heads % n == 0]
            raise ConfigError(f"{path}.deepspeed.sequence_parallel_size",
                              f"{sp} does not divide the model's {heads} attention heads; accepted: "
                              f"{', '.join(map(str, valid))}")

    def _check_i2v(self, path: str, preset) -> None:
        """The first-frame conditioning: the mode the DiT takes, its datasets, first-last frame."""
        i2v = i2v_mode_of(preset, self.model.i2v_mode, f"{path}.model.i2v_mode")
        # replace mode alone: a model that takes no first frame in its input (t2v, or MiniMax H3's keyframe rows,
        # whose every target frame is in the reference's loss) has nothing overwritten, so false is its default
        if i2v == "replace" and self.model.mask_first_frame_loss is False:
            raise ConfigError(f"{path}.model.mask_first_frame_loss",
                              "false needs i2v_mode 'concat': in replace mode latent frame 0 is overwritten by the "
                              "clean first frame, so its prediction has no target to learn; accepted here: true "
                              "(or leave it unset)")
        for i, d in enumerate(self.datasets):
            check_dataset_i2v(preset, d.do_i2v, f"{path}.datasets[{i}].do_i2v")  # the arch's words too
            if d.do_flf2v and not d.do_i2v:
                raise ConfigError(f"{path}.datasets[{i}].do_flf2v", "first-last-frame conditioning is image-to-video "
                                                                    "too: it needs do_i2v: true")
        flf2v = [d.do_flf2v for d in self.datasets if d.do_i2v]
        if any(flf2v) and not all(flf2v):
            i = next(i for i, d in enumerate(self.datasets) if d.do_i2v and not d.do_flf2v)
            raise ConfigError(f"{path}.datasets[{i}].do_flf2v", "the do_i2v datasets of one job must agree on "
                                                                "do_flf2v (the conditioning is one per job); accepted: true")
        last = family_of(preset).last_frame(preset.dit, i2v)
        if any(flf2v) and last == "no":
            i = flf2v.index(True)
            raise ConfigError(f"{path}.datasets[{i}].do_flf2v",
                              f"preset {preset.name!r} cannot take a last frame (first-last-frame conditioning); "
                              f"accepted: do_flf2v false, or a preset that takes one: "
                              f"{', '.join(last_frame_presets())} (or a concat model without an image branch)")
        if last == "required" and not any(flf2v):
            raise ConfigError(f"{path}.datasets[0].do_flf2v", f"preset {preset.name!r} is first-last-frame (its "
                                                              "DiT reads the first and the last frame): "
                                                              "its datasets need do_flf2v: true")
        # the conditioning the trainer will build (`job_conditioning`), asked of the family now: a family that
        # cannot condition its model as the datasets ask (a text-to-video-only one given a do_i2v dataset) says
        # so in its ValueError, named here before any rank starts
        training = family_of(preset).training
        first = next((i for i, d in enumerate(self.datasets) if d.do_i2v), None)
        if first is not None or training.conditions_t2v:
            try:
                training.conditioning(i2v, preset.dit.patch_size, self.model.mask_first_frame_loss, any(flf2v))
            except ValueError as exc:
                key = f"datasets[{first}].do_i2v" if first is not None else "model.i2v_mode"
                raise ConfigError(f"{path}.{key}", f"preset {preset.name!r}: {exc}") from exc

    def _check_image_branch(self, path: str, preset) -> None:
        """Keys of an image branch on a preset without one."""
        if self.network is not None and self.network.include_img_emb and not family_of(preset).image_branch_lora(
                preset.dit):
            raise ConfigError(f"{path}.network.include_img_emb", f"preset {preset.name!r} has no image branch "
                                                                 "to put LoRA on (img_emb); accepted: false")
        net = self.network
        if net is not None:  # the streams' targets (`make_trainable`), asked of the family before any rank
            try:
                family_of(preset).stream_lora_targets(net.include_img_emb, net.lora_streams)
            except ValueError as exc:
                raise ConfigError(f"{path}.network.{net.streams_key}", f"preset {preset.name!r}: {exc}") from exc
        if self.model.quantize_image_encoder and preset.image_encoder is None:
            raise ConfigError(f"{path}.model.quantize_image_encoder", f"preset {preset.name!r} has no image "
                                                                      "encoder; accepted: false (or leave it unset)")

    def _check_validation_and_training(self, path: str) -> None:
        """Held-out items need a validation; something must be trained on; LoRA needs trained weights."""
        split = [i for i, d in enumerate(self.datasets) if d.validation_split > 0]
        if split and self.train.validation_config is None:
            raise ConfigError(f"{path}.datasets[{split[0]}].validation_split", "holds items out for "
                              "train.validation_config, which is not set; add it (validation_sigmas, "
                              "validate_every_n_steps) or remove validation_split")
        if all(d.validation_split >= 1.0 for d in self.datasets):
            raise ConfigError(f"{path}.datasets", "every dataset has validation_split: 1 (validation only); "
                                                  "at least one must be trained on")
        if self.prepare and self.prepare.tiny_vae and not self.model.vae_path:
            raise ConfigError(f"{path}.model.vae_path", "prepare.tiny_vae writes the VAE to model.vae_path; "
                                                        "set it")
        check_lora(self.model.name_or_path, self.network is not None, job_keys(path))

    @property
    def i2v_mode(self) -> str:
        """The job's first-frame conditioning: the one its DiT's input width takes (`spec.i2v_mode_of`)."""
        return i2v_mode_of(get_preset(self.model.preset), self.model.i2v_mode, "config.process[0].model.i2v_mode")

    @property
    def flf2v(self) -> bool:
        """First-last-frame conditioning (its do_i2v datasets say `do_flf2v: true`; they agree)."""
        return any(d.do_i2v and d.do_flf2v for d in self.datasets)


@dataclass
class JobConfig:
    name: str
    process: list[ProcessConfig]

    def validate(self, path: str) -> None:
        if len(self.process) != 1:
            raise ConfigError(f"{path}.process", f"exactly one process is supported, got {len(self.process)}")
        if not self.name or "/" in self.name or self.name.startswith("."):
            raise ConfigError(f"{path}.name", f"{self.name!r}: expected a folder name (no '/')")


@dataclass
class TrainJob:
    """The parsed job: `process` is `config.process[0]`; `raw` the YAML mapping (for the hash)."""

    name: str
    process: ProcessConfig
    meta: dict
    source: str
    raw: dict

    @property
    def out_dir(self) -> Path:
        return Path(self.process.training_folder) / self.name

    def for_ranks(self, world: int) -> TrainJob:
        """This job on `world` ranks: `train.global_batch_size` resolved over its data-parallel ranks
        (`TrainConfig.for_ranks`); the job itself when it has none."""
        p = self.process
        train = p.train.for_ranks(world // p.deepspeed.sequence_parallel_size, "config.process[0].train")
        return self if train is p.train else replace(self, process=replace(p, train=train))

    def config_hash(self) -> str:
        """Hash of what decides the training trajectory (model, network, data, train, deepspeed), not
        of paths of outputs or preview settings, nor of `train.steps` (a resume may change it: the LR
        schedule then follows `engine.LRSchedule.extended`, logged); stored in checkpoints, compared on
        resume."""
        p = self.raw["config"]["process"][0]
        keep = {k: p.get(k) for k in ("model", "network", "datasets", "train", "deepspeed")}
        if isinstance(keep["train"], dict):
            keep["train"] = {k: v for k, v in keep["train"].items() if k != "steps"}
        return hashlib.sha256(json.dumps(keep, sort_keys=True, default=str).encode()).hexdigest()[:16]


def parse_job(data: Any, source: str = "<dict>") -> TrainJob:
    """A `TrainJob` from a YAML mapping; `ConfigError` naming the key path otherwise."""
    if not isinstance(data, dict):
        raise ConfigError("<root>", f"{source}: expected a job mapping (job:, config:), got {type(data).__name__}")
    top = ("job", "config", "meta")
    for key in data:
        if key not in top:
            raise ConfigError(str(key), f"unknown key{did_you_mean(str(key), top)}; valid keys: {', '.join(top)}")
    if data.get("job", "extension") != "extension":
        raise ConfigError("job", f"{data['job']!r}; accepted: 'extension'")
    if "config" not in data:
        raise ConfigError("config", "required key is missing")
    config = parse(JobConfig, data["config"], "config")
    meta = data.get("meta") or {}
    if not isinstance(meta, dict):
        raise ConfigError("meta", f"expected a mapping, got {meta!r}")
    return TrainJob(name=config.name, process=config.process[0], meta=meta, source=source, raw=data)


def raw_process(data: dict) -> dict:
    """`config.process[0]` of a raw job mapping ({} when absent), for stages that run before parsing."""
    try:
        p = data["config"]["process"][0]
    except (KeyError, IndexError, TypeError):
        return {}
    return p if isinstance(p, dict) else {}


def read_yaml(path: str | Path) -> dict:
    """The YAML mapping of a job file (safe_load only)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(str(path), f"cannot read the config file ({exc.strerror or exc})") from exc
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(str(path), f"not valid YAML ({exc})") from exc


def load_job(path: str | Path) -> TrainJob:
    """Read and parse a job YAML."""
    return parse_job(read_yaml(path), str(path))


def to_dict(job: TrainJob) -> dict:
    return asdict(job.process)
