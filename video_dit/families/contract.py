"""The family contract: what shared code (the trainer, the memory plan, `video-dit sample`, validation,
sequence parallelism, the ai-toolkit arch) may ask of a model family, in neutral words. A family is one
folder `video_dit/families/<name>/` whose `__init__.py` builds a `Family` record; the registry
(`video_dit/families/__init__.py`) lists the records and knows nothing else of them.

    Preset        one released (or tiny test) model: its configs and the reference's sampling defaults
    DiTShape      what shared code reads of a family's DiT config (a Protocol: the family's config class
                  implements it with whatever other fields it has)
    VAEShape      what shared code reads of a family's VAE config
    DiTArch       its DiT class and what a module-by-module (ZeRO-3) build needs
    Training      what the trainer caches and feeds the DiT per batch
    MemoryModel   what the memory plan asks: the activations of a step, the encoders' sizes
    AudioPath     what a family whose DiT generates sound adds: its codec, rates, timestep draw, LoRA streams
    Family        the record: the above, its loaders, pipeline, checkpoint detection and conventions

Every callable's signature is stated beside its field; `docs/models.md` ("Adding a family") is the
checklist, and `tests/test_family_contract.py` runs a family defined inside the test through every front
end without a shared file knowing it.
"""

from __future__ import annotations

import difflib
from dataclasses import asdict, dataclass, field, replace
from typing import Callable, Protocol, runtime_checkable


@runtime_checkable
class DiTShape(Protocol):
    """What shared code reads of a DiT config (each family's config class has these, as fields or properties)."""

    @property
    def num_heads(self) -> int: ...          # attention heads (sequence parallelism splits them)

    @property
    def num_layers(self) -> int: ...         # the blocks checkpointing, compilation and the plan count

    @property
    def patch_size(self) -> tuple[int, int, int]: ...  # (pt, ph, pw): latent cells per token

    @property
    def out_channels(self) -> int: ...       # latent channels the DiT predicts (the VAE's z_dim)


@runtime_checkable
class VAEShape(Protocol):
    """What shared code reads of a VAE config. The frame rule is the VAE's own: a causal VAE that keeps the
    first frame takes t k + 1 frames (`models.causal_conv.FirstFrameKept`), others their own counts."""

    @property
    def z_dim(self) -> int: ...                 # latent channels

    @property
    def spatial_compression(self) -> int: ...   # pixels per latent cell along each side

    def snap_frames(self, n: int) -> int: ...   # the longest clip it encodes of at most n >= 1 frames

    def latent_frames(self, n: int) -> int: ...  # latent frames of a clip of n (valid) frames

    def pixel_frames(self, n: int) -> int: ...  # pixel frames of n latent frames


@dataclass(frozen=True)
class Preset:
    """One model: its configs, and the reference's sampling defaults (`sample_*`), which `video-dit sample`
    and the training previews use for whatever the command or job leaves out. Each family's presets module
    states every number with the file and line of the reference it comes from."""

    name: str
    family: str                    # the family whose code reads it: a key of the registry
    dit: DiTShape
    vae: VAEShape
    vae_name: str                  # the VAE's name in the family (a random tiny one, a released one)
    text_encoder: object           # the family's text encoder config
    sample_solver: str             # "unipc" or "euler" (flow.SOLVERS), one of the family's `solvers`
    sample_steps: int
    sample_shift: float            # flow-matching shift of the sampling schedule
    sample_guidance: float         # classifier-free guidance scale (1 = none); two experts: the high-noise one's
    sample_negative: str           # negative prompt of the guidance's unconditional pass
    train_shift: float             # the training timesteps' shift (`train.timestep_type: shift`)
    fps: int                       # output frame rate
    sample_guidance_2: float | None = None  # two experts: the low-noise expert's (None: sample_guidance)
    i2v_mode: str | None = None    # "replace" or "concat" when the preset is an image-to-video model
    image_encoder: object = None   # the image encoder config of a DiT that reads image embeds, else None
    # Two experts of this DiT shape: the high-noise expert denoises t >= boundary_ratio x 1000, the
    # low-noise one the rest (diffusion/experts.py). None: one model.
    boundary_ratio: float | None = None
    # (frames, height, width) the reference renders by default, its frame count one the VAE encodes; what the
    # ai-toolkit UI entries default to (`integrations/aitk_ui.py`). None: not stated (no UI entry is made of it)
    sample_size: tuple[int, int, int] | None = None

    @property
    def two_experts(self) -> bool:
        return self.boundary_ratio is not None

    @property
    def vae_spatial(self) -> int:
        """Pixels per latent cell along each side."""
        return self.vae.spatial_compression

    @property
    def divisibility(self) -> int:
        """Pixel multiple every frame side must have: VAE factor x DiT spatial patch."""
        return self.vae_spatial * self.dit.patch_size[1]


def lookup_preset(presets: dict, name: str, whose: str = "this family") -> Preset:
    """`presets[name]`; an unknown name is a KeyError naming the nearest one and listing `presets`."""
    if name not in presets:
        close = difflib.get_close_matches(name, presets, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise KeyError(f"unknown preset {name!r}{hint}; valid presets of {whose}: {', '.join(presets)}")
    return presets[name]


def with_dit(preset: Preset, **changes) -> Preset:
    """A copy of `preset` with DiT config fields changed (tests, shallow benchmark configs)."""
    return replace(preset, dit=replace(preset.dit, **changes))


@dataclass(frozen=True)
class DiTArch:
    """A family's DiT class and what a build that makes it one module group at a time needs (the
    ZeRO-3 build, `parallel/partition.py`; the preset check of `train/build.py`)."""

    cls: type                   # (config) -> the DiT (built on the meta device there)
    init_parameter: Callable    # (config, name, tensor, generator) -> a preset's initial values of one parameter
    param_dtypes: Callable      # (model, dtype, masters=False) -> {name: storage dtype} (the float32 islands kept)
    cast: Callable              # (model, dtype, masters=False) -> the model computing in dtype (masters: trainables float32)
    open: Callable              # (source, config) -> (weights under native names, config, description)
    float32_modules: tuple[str, ...]  # its float32 islands' module names (never quantized)
    embedders: tuple[str, ...]  # its input embedders (kept in the training dtype when the blocks are quantized)
    block_list: str             # the attribute (and state-dict prefix) of its blocks' ModuleList


@dataclass(frozen=True)
class Training:
    """What the trainer asks of a family, beside its loaders: how a clip and a caption are cached, what
    conditions the DiT, and how a batch's cached text becomes the DiT's arguments.

      conditioning(i2v_mode, patch_size, mask_first_frame_loss, last_frame) -> the conditioning object
          (`apply(x_t, t, cond, active)`, `dit_kwargs(cond, active, t=, noise=)`: t the step's timesteps, noise
          its own draw (B, C, 1, h, w), `objective.flow_matching_loss`'s cond_noise); a ValueError names a setting
          it cannot take
      conditions_t2v: whether text-to-video jobs run through it too (the DiT always reads its channels)
      cache_item(vae, video (B, 3, F, H, W) in [-1, 1], i2v_mode, last_frame, image_encoder) -> {key: (B, ...)}:
          what an i2v clip conditions on beside its latents (the first frame's latents, the image embeds)
      cond_keys: the cached keys the conditioning object reads
      text_entry(one prompt's `encode` result) -> {key: (L, D) float32}: what a caption caches
      prompt({key: (L, D)}) -> one prompt's embeds as the family's pipeline takes them
      text_inputs(batch, device, dit_config) -> (context, {DiT keyword: tensor}): a batch's cached text as the
          DiT takes it (with what keeps every rank's forward running the same modules, for ZeRO-3)
    """

    conditioning: Callable
    conditions_t2v: bool
    cache_item: Callable
    cond_keys: tuple[str, ...]
    text_entry: Callable
    text_inputs: Callable
    prompt: Callable


@dataclass(frozen=True)
class MemoryModel:
    """What the memory plan (`train/plan.py`) asks of a family; the parameter and DeepSpeed terms are the
    plan's own (counted on the family's DiT built on the meta device).

      activations(cfg, grid (F', h, w), setting, *, lora_rank, s, fused, inputs) -> Activations
          (`video_dit.models.activation_terms`): what one step's forward keeps and its backward peaks at,
          per rank; `inputs` is `job_inputs`' dict
      job_inputs(job, preset) -> dict: what of a job beyond the DiT config its activations read (text
          lengths, per-token timesteps, LoRA on an image branch)
      encoder_parameters(preset, sources) -> {"text_encoder": n, "vae": n, "image_encoder": n}: parameters of
          the frozen parts a job loads; `sources` {part: source or None} (a part's files, when they are on
          this machine, are counted from their headers by the plan first: only the missing ones are asked)
      encoder_files: {part: (subfolder, key prefixes not loaded)} to count a part from its files' headers
    """

    activations: Callable
    job_inputs: Callable
    encoder_parameters: Callable
    encoder_files: dict = field(default_factory=dict)


@dataclass(frozen=True)
class AudioPath:
    """What a family whose DiT generates sound with the picture adds (`Family.audio`; None: picture only).
    The data path reads each clip's track at `rate` / `channels` over its frames' span
    (`video_dit.data.audio`), the codec turns it into the latents its DiT takes and back into a waveform, and
    the trainer and the sampler carry them beside the video's.

      rate, channels: what its audio encoder reads (a clip's track is resampled and mixed to them)
      out_rate: the waveform rate its decoder (vocoder) writes
      load_codec(source, dtype, device, seed) -> an object with
          encode(wave (B, channels, S) float32 at `rate`) -> normalized latents (B, ...): the DiT's audio input
          decode(latents (B, ...)) -> wave (B, C, S') float32 in [-1, 1] at `out_rate`
          latent_shape(num_frames, fps) -> the latents' shape (no batch) of a clip of that many frames
          rate, channels, out_rate: the loaded model's own (where a family's models differ, e.g. LTX-2.0's
          vocoder writes 24 kHz and LTX-2.3's 48 kHz, these are what a waveform is read and written at)
      timesteps: the reference trainer's draw of the audio stream's timesteps, "tied" (the video's, per
          sample) or "independent" (its own draw from the same distribution); `train.audio_timesteps` overrides
      loss_weight: the reference trainer's weight of the audio loss beside the video's 1
      tied_map: None (a tied draw gives the audio the video's timesteps), or (t (B,) on 0..1000) -> the audio's:
          the reference's coupling of the two streams' noise levels (a DiT whose streams sample on two schedules)
      lora_streams: {"video": regex, "audio": regex}, full-match regexes of the DiT's module names that belong
          to each stream (the modules whose output is added to that stream's tokens), disjoint, together
          covering every module of `Family.lora_targets`; what `network.streams` keeps
          (`Family.stream_lora_targets`). Empty: the streams share their modules (one packed sequence through
          the same weights), and a LoRA on one stream alone is refused
      codec_stage: (data_dir, out_path, *, preset=a preset name, the `prepare.tiny_audio` recipe's keywords) ->
          out_path: trains a tiny preset's audio codec on a folder of clips with sound and saves it where
          `load_codec(out_path)` reads it (the embedded audio-video demo's first stage); None: it has none
    Its DiT takes `audio=` (B, ...) latents and `audio_timestep=` (B,) on 0..1000 beside the video's and
    returns (video velocity, audio velocity); its pipeline (`Family.pipeline(dit, vae, audio_codec=codec)`)
    takes `fps=` in `generate` (the sound's length follows the clip's duration), and its
    `generate_with_audio(...)` (the arguments of `generate`) returns (frames, wave (C, S) at the codec's
    `out_rate`).
    """

    rate: int
    channels: int
    out_rate: int
    load_codec: Callable
    timesteps: str = "tied"
    loss_weight: float = 1.0
    tied_map: Callable | None = None
    lora_streams: dict[str, str] = field(default_factory=dict)
    codec_stage: Callable | None = None


# `network.streams` (ours; neither ltx-trainer, whose LoRA takes a `target_modules` list, nor ai-toolkit's ltx2
# model, whose network takes only_if_contains / ignore_if_contains substrings, names a stream): the streams a
# LoRA adapts, of a family with sound; the first is the default (every target of `Family.lora_targets`)
LORA_STREAMS = ("both", "video", "audio")


@dataclass(frozen=True)
class Family:
    """The per-family pieces. Loaders take (source, dtype=None, device=None, ...); `source` is a path or
    `preset:NAME`."""

    name: str
    title: str
    presets: dict                # {name: Preset} of this family
    trains: tuple[str, ...]      # the trainers that take it: "video_dit" (ours), "ai-toolkit" (the arch)
    load_dit: Callable           # (source, dtype, device, config, seed) -> DiT module
    load_vae: Callable           # (source, dtype, device, config, seed) -> VAE module
    load_text_encoder: Callable  # (source, dtype, device, quantize, tokenizer) -> object with encode(prompts)
    load_image_encoder: Callable  # (source, dtype, device, quantize) -> image encoder module
    dit_config: Callable         # (source) -> the DiT config, from config.json or tensor headers (no tensor read)
    claims: Callable             # ({name: meta tensor or shape}) -> whether a DiT's key names are this family's
    claims_config: Callable      # (a DiT folder's config.json dict) -> whether it is this family's DiT config
    claim_order: int             # `identify` asks the strictest `claims` first (lower first)
    classes: tuple[str, ...]     # diffusers / original `_class_name`s of its pipelines and DiTs (metadata)
    pipeline: Callable           # (dit, vae, *, image_encoder=None, i2v_mode=None) -> pipeline with generate / decode;
                                 # a family with `audio` also takes audio_codec= (its `AudioPath.load_codec`'s)
    image_embeds: Callable       # (image_encoder, image, last_image, height, width) -> the DiT's image embeds
    random_source: Callable      # (preset, part) -> "preset:NAME" when the preset builds `part` at random, else None
    folder_source: Callable      # (model folder Path, part) -> the part's source in that folder's layout, or None
    accepts: dict[str, str]      # part -> what a user may give for it (error messages)
    needs: dict[str, str]        # part -> what the model needs, e.g. "the umT5 text encoder"; text_folder, no_images
    natural_i2v: Callable        # (dit_config, task, z_dim=None) -> the i2v mode its weights take: replace, concat, None
    i2v_only: Callable           # (dit_config) -> the DiT trains and samples image-to-video only
    reads_images: Callable       # (ModelSpec) -> whether the DiT reads an image encoder's embeds
    last_frame: Callable         # (dit_config, i2v_mode) -> "required" | "optional" | "no": a last frame (FLF2V)
    image_encoder_fits: Callable  # (image encoder source, dit_config) -> None, or why not (from config/headers)
    lora_targets: Callable       # (include_image_branch) -> peft target_modules regex of its DiT
    image_branch_lora: Callable  # (dit_config) -> whether `network.include_img_emb` has modules to target
    lora_to_comfy: Callable      # (native adapter keys, alpha) -> the LoRA file's ComfyUI keys
    lora_from_file: Callable     # ({key: tensor} without prefixes, source) -> native adapter keys (fused keys split)
    arch: DiTArch                # its DiT class and module-by-module build
    flops: Callable              # (dit_config, num_tokens, text_len, batch) -> forward FLOPs
    training: Training           # what the trainer asks of it (caches, conditioning, text arguments)
    memory: MemoryModel          # what the memory plan asks of it
    sampling_schedule: Callable  # (steps, shift, solver, grid) -> flow.SamplingSchedule on the family's grid
    sampling_grids: tuple[str, ...]  # the grids `video-dit sample --grid` may pick ("" : only the family's own)
    negative_prompts: dict[str, str] = field(default_factory=dict)  # a reference default prompt -> its name (logs)
    # (source) -> (task, where it is said) of a checkpoint whose t2v and i2v models share one architecture;
    # None: the DiT's shape says
    task_of: Callable | None = None
    solvers: tuple[str, ...] = ("unipc", "euler")
    sampling_defaults: dict = field(default_factory=dict)  # when no preset is known: resolve_sampling's defaults
    sampling_origin: str = ""
    fps: int = 16                # output fps when no preset is known
    refused_flags: dict[str, str] = field(default_factory=dict)  # `video-dit sample` flag -> why not for this family
    vae_presets: dict = field(default_factory=dict)  # {name: VAE config} its loaders build from `preset:NAME`
    # (data_dir, out_path, *, preset=a vae_presets name, the `prepare.tiny_vae` recipe's keywords) -> result:
    # trains one of its VAE presets on a folder of clips (the embedded demo's first stage); None: it has none
    vae_stage: Callable | None = None
    audio: AudioPath | None = None  # a DiT that generates sound with the picture (its audio path); None: picture only
    # (DiT config) -> the dict a saved model folder's config.json holds (`video_dit.models.saved`), which its
    # `dit_config` reads back: the config dataclass's fields by default, a family whose folders follow another
    # layout (LTX-2: diffusers' `LTX2VideoTransformer3DModel` config) its own
    config_json: Callable = asdict
    # (first image or None, last image or None, height, width) -> the images its text encoder presents with each
    # prompt (`encode(prompts, images=[...])`: a conditioner that reads the keyframes beside the caption); None:
    # the prompt alone
    prompt_images: Callable | None = None
    # diffusers scheduler classes of its model folders it samples on its own grid: {`_class_name`: (solver, the key
    # holding the shift, {key: (accepted values, default when absent)})} (`sampling_settings.read_scheduler_config`)
    scheduler_classes: dict = field(default_factory=dict)

    def stream_modules(self, streams: str) -> str | None:
        """The full-match regex of the DiT's modules that belong to `streams` (`LORA_STREAMS`;
        `AudioPath.lora_streams`), None for "both" (every module). A ValueError says why this family cannot
        take `streams` and what it accepts."""
        if streams not in LORA_STREAMS:
            raise ValueError(f"{streams!r} is not a stream; accepted: {', '.join(LORA_STREAMS)}")
        if streams == "both":
            return None
        if self.audio is None:
            raise ValueError(f"{self.title} generates no sound: its DiT has one stream; accepted: both "
                             "(or leave it unset)")
        only = self.audio.lora_streams.get(streams)
        if not only:
            raise ValueError(f"{self.title}'s DiT runs its video and audio through the same modules: no LoRA "
                             "target is one stream's alone; accepted: both (or leave it unset)")
        return only

    def stream_lora_targets(self, include_img_emb: bool, streams: str = "both") -> str:
        """The peft `target_modules` regex of our trainer's LoRA on `streams`: `lora_targets` itself for
        "both"; for one stream, those of its targets that also fully match the stream's regex (`stream_modules`,
        whose ValueError it raises)."""
        targets, only = self.lora_targets(include_img_emb), self.stream_modules(streams)
        if only is None:
            return targets
        # peft full-matches `target_modules`: the lookahead requires the whole name to match the stream's
        # regex, then the whole name must match the family's targets
        return rf"(?=(?:{only})\Z)(?:{targets})"

    def describe(self) -> str:
        return f"{self.title} (presets: {', '.join(self.presets)})"
