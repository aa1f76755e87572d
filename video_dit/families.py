"""Model families: what differs between Wan 2.1 / 2.2 and HunyuanVideo 1.5, in one registry.

    preset.family ("wan" | "hunyuan15") or a checkpoint's metadata / key names (`identify`)
      -> Family: its loaders (DiT, VAE, text encoder(s), image encoder), the pipeline that samples it,
         how its parts are found and described, its sampling conventions (solvers, schedule grid,
         defaults when no preset is known), and for training (`Training`, `DiTArch`): what it caches, its
         conditioning and text arguments, its module-by-module build, LoRA targets and keys, FLOP count

Front ends (`spec.resolve`, `video-dit sample`, `loading.load_*`) ask the family; none tests a model's
class or name. A new family is one `Family(...)` here and its presets in presets.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from video_dit.devices import to_device
from video_dit.diffusion import hunyuan15_conditioning as hy15_cond
from video_dit.diffusion.conditioning import MASK_CHANNELS, FirstFrameConditioning, encode_conditioning
from video_dit.lora import lora_targets as wan_lora_targets
from video_dit.lora import to_comfy
from video_dit.models import dit as wan_dit
from video_dit.models import hunyuan15_dit as hy15_dit
from video_dit.models import hunyuan15_encoders as hy15_enc
from video_dit.models import hunyuan15_loading as hy15_load
from video_dit.models import loading as wan_load
from video_dit.models.convert import dit_key_layout
from video_dit.models.dit import VideoDiT, dit_flops
from video_dit.models.hunyuan15_convert import hy15_lora_to_comfy
from video_dit.models.hunyuan15_convert_vae import load_hy15_vae
from video_dit.models.hunyuan15_dit import LORA_TARGETS as HY15_LORA_TARGETS
from video_dit.models.hunyuan15_dit import HunyuanVideo15DiT, hy15_dit_flops
from video_dit.models.layouts import preset_name
from video_dit.models.presets import PRESETS, Preset, get_preset
from video_dit.models.weights import WeightsError, open_weights


@dataclass(frozen=True)
class DiTArch:
    """A family's DiT class and what a build that makes it one module group at a time needs (the
    ZeRO-3 build, `parallel/partition.py`; the preset check of `train/build.py`)."""

    cls: type                   # (config) -> the DiT (built on the meta device there)
    init_parameter: Callable    # (config, name, tensor, generator) -> a preset's initial values of one parameter
    param_dtypes: Callable      # (model, dtype) -> {name: storage dtype} (the float32 islands kept)
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
          (`apply`, `dit_kwargs`); a ValueError names a setting it cannot take
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
class Family:
    """The per-family pieces. Loaders take (source, dtype=None, device=None, ...) like `loading.load_*`;
    `source` is a path or `preset:NAME`."""

    name: str
    title: str
    trains: tuple[str, ...]  # the trainers that take it: "video_dit" (ours), "ai-toolkit" (the arch)
    load_dit: Callable          # (source, dtype, device, config, seed) -> DiT module
    load_vae: Callable          # (source, dtype, device, config, seed) -> VAE module
    load_text_encoder: Callable  # (source, dtype, device, quantize, tokenizer) -> object with encode(prompts)
    load_image_encoder: Callable  # (source, dtype, device, quantize) -> image encoder module
    dit_config: Callable        # (source) -> the DiT config, from config.json or tensor headers (no tensor read)
    claims: Callable            # ({name: meta tensor or shape}) -> whether a DiT's key names are this family's
    classes: tuple[str, ...]    # diffusers / original `_class_name`s of its pipelines and DiTs (metadata)
    pipeline: Callable          # (dit, vae, *, image_encoder=None) -> pipeline with generate(...) / decode(...)
    image_embeds: Callable      # (image_encoder, image, last_image, height, width) -> the DiT's image embeds
    random_source: Callable     # (preset, part) -> "preset:NAME" when the preset builds `part` at random, else None
    folder_source: Callable     # (model folder Path, part) -> the part's source in that folder's layout, or None
    accepts: dict[str, str]     # part -> what a user may give for it (error messages)
    needs: dict[str, str]       # part -> what the model needs, e.g. "the umT5 text encoder"; text_folder, no_images
    natural_i2v: Callable       # (dit_config, task) -> a DiT's i2v mode known by its weights: replace, concat, None
    reads_images: Callable      # (ModelSpec) -> whether the DiT reads an image encoder's embeds
    last_frame: Callable        # (dit_config) -> a first-last-frame DiT
    lora_targets: Callable      # (network.include_img_emb) -> peft target_modules regex of its DiT
    lora_to_comfy: Callable     # (native adapter keys, alpha) -> the LoRA file's ComfyUI keys
    arch: DiTArch               # its DiT class and module-by-module build
    flops: Callable             # (dit_config, num_tokens, text_len, batch) -> forward FLOPs
    training: Training          # what the trainer asks of it (caches, conditioning, text arguments)
    # (source) -> (task, where it is said) of a checkpoint whose t2v and i2v models share one architecture;
    # None: the DiT's shape says (Wan: its input width)
    task_of: Callable | None = None
    image_encoder_width: Callable | None = None  # (source) -> (width, where said), from config.json alone
    dit_image_width: Callable | None = None      # (dit_config) -> the image embeds' width the DiT reads
    solvers: tuple[str, ...] = ("unipc", "euler")
    grid: str | None = None     # the schedule grid it always samples on (None: the solver's and folder's)
    sampling_defaults: dict = field(default_factory=dict)  # when no preset is known: resolve_sampling's defaults
    sampling_origin: str = ""
    fps: int = 16               # output fps when no preset is known (Wan's 16; Tencent writes 24)
    refused_flags: dict[str, str] = field(default_factory=dict)  # `video-dit sample` flag -> why not for this family

    def presets(self) -> list[str]:
        return [n for n, p in PRESETS.items() if p.family == self.name]

    def describe(self) -> str:
        return f"{self.title} (presets: {', '.join(self.presets())})"


# ---------------------------------------------------------------- Wan 2.1 / 2.2

def wan_natural_i2v(cfg, z_dim: int | None = None) -> str | None:
    """"replace" when a Wan DiT's input is its output, "concat" when its input holds the output's channels,
    the 4 mask channels and the conditioning latents (`z_dim`: the VAE's; unknown: as many as out_dim)."""
    z = cfg.out_dim if z_dim is None else z_dim
    return {cfg.out_dim: "replace", cfg.out_dim + MASK_CHANNELS + z: "concat"}.get(cfg.in_dim)


def _wan_claims(meta: dict) -> bool:
    try:
        dit_key_layout(meta)
    except ValueError:
        return False
    return True


def _wan_random(preset: Preset, part: str) -> str | None:
    """The tiny presets' random parts: the tiny VAE, the ByT5-tokenised umT5, a small CLIP (never ViT-H/14)."""
    if part == "vae":
        return f"preset:{preset.vae_name}" if preset.vae_name == "tiny" else None
    if part == "text_encoder":
        return f"preset:{preset.name}" if preset.text_encoder.tokenizer == "byt5" else None
    own = preset.image_encoder
    return f"preset:{preset.name}" if own is not None and own.hidden_size != 1280 else None


def _diffusers_folder(base: Path, part: str) -> str | None:
    """diffusers' layout: `vae/`, `text_encoder/`, `image_encoder/` beside the DiT: the folder itself."""
    return str(base) if (base / part).is_dir() else None


def _wan_image_embeds(encoder, image, last, height, width):
    from video_dit.pipeline import image_features  # (the pipelines import this package's models)

    return image_features(encoder, image, last)  # CLIP sees the image as given, as in Wan


def _wan_pipeline(dit, vae, *, image_encoder=None, i2v_mode=None):
    from video_dit.pipeline import VideoPipeline

    return VideoPipeline(dit, vae, image_encoder=image_encoder, i2v_mode=i2v_mode)


WAN_TRAINING = Training(
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


WAN = Family(
    name="wan", title="Wan 2.1 / 2.2", trains=("video_dit", "ai-toolkit"),
    load_dit=wan_load.load_dit, load_vae=wan_load.load_vae, load_text_encoder=wan_load.load_text_encoder,
    load_image_encoder=wan_load.load_image_encoder, dit_config=lambda source: wan_load.open_dit(source)[1],
    claims=_wan_claims,
    classes=("WanPipeline", "WanImageToVideoPipeline", "WanVideoToVideoPipeline", "WanVACEPipeline",
             "WanTransformer3DModel", "WanModel"),
    pipeline=_wan_pipeline, image_embeds=_wan_image_embeds, random_source=_wan_random,
    folder_source=_diffusers_folder,
    accepts={"vae": "a Wan VAE .pth/.safetensors or a vae/ folder",
             "text_encoder": "a folder holding text_encoder/ and tokenizer/, or put them next to the model",
             "image_encoder": "clip_vision_h.safetensors from ComfyUI, Wan's models_clip_open-clip-xlm-roberta-"
                              "large-vit-huge-14.pth, or a folder with image_encoder/ + image_processor/ from "
                              "diffusers"},
    needs={"text_encoder": "the umT5 text encoder", "image_encoder": "the CLIP image branch (Wan 2.1 I2V / FLF2V), "
                                                                      "whose ViT-H/14 is never random here",
           "text_folder": "no text_encoder/ folder in it", "no_images": "has no CLIP image branch"},
    natural_i2v=lambda cfg, task: wan_natural_i2v(cfg), reads_images=lambda spec: spec.dit_shape.image_dim is not None,
    last_frame=lambda cfg: cfg.image_dim is not None and cfg.num_images == 2,
    lora_targets=wan_lora_targets, lora_to_comfy=to_comfy,  # (targets True: + the image branch's img_emb)
    arch=DiTArch(VideoDiT, wan_dit.init_parameter, wan_dit.param_dtypes, wan_dit.cast_dit, wan_load.open_dit,
                 wan_dit.FLOAT32_MODULES, embedders=("patch_embedding", "text_embedding"), block_list="blocks"),
    flops=dit_flops, training=WAN_TRAINING,
)


# ---------------------------------------------------------------- HunyuanVideo 1.5

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
    found = _diffusers_folder(base, part)
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
    from video_dit.pipeline_hunyuan15 import fit_image

    d = 16  # the VAE's 16 x the DiT's spatial patch of 1: every released model
    return encoder.encode(fit_image(image, max(d, height // d * d), max(d, width // d * d))).float()


def _hy15_pipeline(dit, vae, *, image_encoder=None, i2v_mode=None):
    from video_dit.pipeline_hunyuan15 import HunyuanVideo15Pipeline

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
HY15_TRAINING = Training(
    conditioning=lambda i2v_mode, patch_size, mask_first_frame_loss, last_frame: hy15_cond.HY15Conditioning(),
    conditions_t2v=True,
    cache_item=lambda vae, video, i2v_mode, last_frame, image_encoder: hy15_cond.encode_hy15_conditioning(
        vae, video[:, :, 0], image_encoder),  # SigLIP reads the first frame as uint8, as Tencent's train.py
    cond_keys=("first_frame_latents", "image_embeds"),
    text_entry=lambda e: {"text_embeds": e.text.float(), "glyph_embeds": e.glyph.float()},
    text_inputs=_hy15_text_inputs,
    prompt=lambda entry: hy15_enc.HY15PromptEmbeds(entry["text_embeds"], entry["glyph_embeds"]),
)


HUNYUAN15 = Family(
    name="hunyuan15", title="HunyuanVideo 1.5", trains=("video_dit", "ai-toolkit"),
    load_dit=hy15_load.load_hy15_dit, load_vae=load_hy15_vae, load_text_encoder=_hy15_text_encoder,
    load_image_encoder=_hy15_image_encoder, dit_config=hy15_load.dit_config, claims=hy15_load.claims,
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
    natural_i2v=lambda cfg, task: "concat" if task is not None and task[0] == "i2v" else None,
    reads_images=lambda spec: spec.i2v_mode is not None, last_frame=lambda cfg: False,
    task_of=hy15_load.task_of, image_encoder_width=hy15_image_encoder_width,
    dit_image_width=lambda cfg: cfg.vision_states_dim,
    lora_targets=lambda include_img_emb: HY15_LORA_TARGETS,  # (its SigLIP projection trains in full jobs only)
    lora_to_comfy=hy15_lora_to_comfy,  # q / k / v fused as ComfyUI's HunyuanVideo LoRA keys name them
    arch=DiTArch(HunyuanVideo15DiT, hy15_dit.init_parameter, hy15_dit.param_dtypes, hy15_dit.cast_hy15_dit,
                 hy15_load.open_hy15_dit, hy15_dit.FLOAT32_MODULES,
                 embedders=("img_in", "txt_in", "byt5_in", "vision_in"), block_list="double_blocks"),
    flops=hy15_dit_flops, training=HY15_TRAINING,
    solvers=("euler",), grid="hunyuan",
    # hyvideo/pipelines/hunyuan_video_pipeline.py lines 99-101 (flow_shift 7, guidance 6, 50 steps are the
    # class defaults; a diffusers folder's scheduler and guider configs then give its shift and guidance)
    sampling_defaults=dict(solver="euler", steps=50, shift=7.0, guidance=6.0, negative=""),
    sampling_origin="Tencent's HunyuanVideo 1.5 pipeline defaults (no preset known)", fps=24,  # generate.py line 48
    refused_flags={"--last-image": "HunyuanVideo 1.5 takes a first frame only",
                   "--tokenizer": "HunyuanVideo 1.5's text encoders load from a diffusers folder"},
)

FAMILIES: dict[str, Family] = {f.name: f for f in (WAN, HUNYUAN15)}


def get_family(name: str) -> Family:
    if name not in FAMILIES:
        raise KeyError(f"unknown model family {name!r}; accepted: {', '.join(FAMILIES)}")
    return FAMILIES[name]


def family_of(preset: Preset | None, default: str = "wan") -> Family:
    return get_family(preset.family if preset is not None else default)


def identify(source) -> tuple[Family, str] | None:
    """(family, the evidence) of a DiT source from its files, reading no tensor: a diffusers folder's
    model_index.json or a config.json's `_class_name` (the DiT folder's, or beside the file), else the
    tensor names in its headers (`Family.claims`, HunyuanVideo 1.5's strict test first: Wan's layout
    test would accept diffusers' `proj_out`). None: `preset:NAME`, or nothing readable says."""
    if preset_name(source) is not None:
        return None
    path = Path(source)
    if not path.exists():
        return None
    folder = path if path.is_dir() else path.parent
    dit = hy15_load.dit_path(path)
    for meta in (folder / "model_index.json", (dit if dit.is_dir() else dit.parent) / "config.json"):
        name = _class_name(meta)
        for family in FAMILIES.values():
            if name in family.classes:
                return family, f"{meta}: _class_name {name!r}"
    if (dit if dit.is_dir() else dit.parent).joinpath("config.json").is_file():
        cfg = (dit if dit.is_dir() else dit.parent) / "config.json"
        if "mm_double_blocks_depth" in _read(cfg):  # Tencent's DiT config has no _class_name
            return HUNYUAN15, f"{cfg}: mm_double_blocks_depth (Tencent's HunyuanVideo 1.5 DiT config)"
    try:
        meta = open_weights(dit).meta()
    except (WeightsError, OSError, ValueError):
        return None  # unreadable: the loader says why, later
    for family in (HUNYUAN15, WAN):
        if family.claims(meta):
            shown = ", ".join(sorted(meta)[:3])
            return family, f"{dit}: its tensor names ({shown}, ...)"
    return None


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _class_name(path: Path) -> str | None:
    return _read(path).get("_class_name") if path.is_file() else None
