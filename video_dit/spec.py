"""Which files make up a model, resolved once: a `ModelSpec`, asked by every front end (our trainer,
`video-dit sample`, `plan`, `validate`, `inspect-data`, the ai-toolkit arch, benchmarks).

    a job's model block / a command line / an ai-toolkit config
        -> Request (what was given: name_or_path, preset, VAE, text encoder, tokenizer, image encoder,
           i2v mode, seed, boundary, the experts asked for, the audio codec) + Keys (what that front end calls each)
        -> resolve() -> ModelSpec: the preset; the DiT source and seed (or every loadable expert's,
           and the boundary); the VAE; the text encoder and tokenizer; the image encoder; the audio codec of
           a family with sound (`Family.audio`); the i2v mode; what an export recorded
           (`video_dit_sources.json`: sources, sampling settings)

The model family (`video_dit.families`: Wan, HunyuanVideo 1.5, one folder each) is the preset's; without a preset, the
weights' own (their metadata or key names, `families.identify`); weights of another family than the
preset's are refused naming the file, the key and the presets that fit. A HunyuanVideo 1.5 checkpoint's
task (t2v or i2v: one architecture) comes from its metadata or its preset, and is `ModelSpec.task`.
Each part's source, in order: given explicitly; recorded by an export in its folder; the folder's
own convention (the family's: diffusers' `vae/`, `text_encoder/` + `tokenizer/`, `image_encoder/`;
a `*vae*` weights file beside the DiT; Tencent's ckpts/vae); the preset's seeded random init where one
exists for it (the tiny presets: a random VAE, text encoder(s) and image encoder); else an error naming
the key to set, what it takes and how to get the files. The checks that need only this (a LoRA on a random preset, the i2v
mode the DiT's input width allows, what a `do_i2v` dataset's stills do) live here too, so every front
end refuses, skips and warns about the same jobs with the same words: our launcher before any rank
starts, the ai-toolkit arch at load (or, for what ai-toolkit shows a model only later, as early as it
is shown).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from dataclasses import dataclass, field
from pathlib import Path

from video_dit.diffusion.experts import EXPERTS, check_boundary
from video_dit.families import PRESETS, Family, Preset, UnknownFamily, family_of, get_family, get_preset, identify
from video_dit.models.layouts import (
    expert_seed,
    expert_sources,
    folder_boundary,
    portable,
    preset_name,
    read_sources,
    recorded_path,
)
from video_dit.models.weights import WeightsError
from video_dit.typed_config import ConfigError

WEIGHT_EXTS = (".safetensors", ".pth", ".pt", ".bin", ".ckpt")
EXPERT_KEYS = {"high_noise": "train_high_noise", "low_noise": "train_low_noise"}


@dataclass(frozen=True)
class Keys:
    """What a front end calls each setting the spec resolves (its error messages name these)."""

    model: str
    preset: str
    vae: str
    text_encoder: str
    tokenizer: str
    image_encoder: str
    i2v_mode: str
    boundary: str
    experts: str  # where train_high_noise / train_low_noise sit
    network: str = "network"
    flags: bool = False  # a command line: errors read "--model PATH: ...", and say "pass" rather than "set"
    trainer: str = "video_dit"  # the trainer whose settings these are (`Family.trains`): "video_dit", "ai-toolkit"
    audio: str = "audio_path"  # the audio codec of a family with sound (`Family.audio`)

    def error(self, key: str, value, message: str) -> ConfigError:
        """The error about `key` (given `value`): "KEY: VALUE: message", or "--flag VALUE: message"."""
        return ConfigError(f"{key} {value}", message) if self.flags else ConfigError(key, f"{value}: {message}")

    @property
    def give(self) -> str:
        return "pass" if self.flags else "set"


def job_keys(process_path: str = "config.process[0]") -> Keys:
    m = f"{process_path}.model"
    return Keys(f"{m}.name_or_path", f"{m}.preset", f"{m}.vae_path", f"{m}.text_encoder_path", f"{m}.tokenizer_path",
                f"{m}.image_encoder_path", f"{m}.i2v_mode", f"{m}.boundary_ratio", f"{m}.model_kwargs",
                f"{process_path}.network", audio=f"{m}.audio_path")


JOB_KEYS = job_keys()
CLI_KEYS = Keys("--model", "--preset", "--vae", "--text-encoder", "--tokenizer", "--image-encoder", "--i2v-mode",
                "--boundary-ratio", "--model", flags=True, audio="--audio-codec")
AITK_KEYS = Keys("model.name_or_path", "model.model_kwargs.preset", "model.vae_path", "model.te_name_or_path",
                 "model.tokenizer_path", "model.model_kwargs.image_encoder_path", "model.model_kwargs.i2v_mode",
                 "model.model_kwargs.boundary_ratio", "model.model_kwargs", "network", trainer="ai-toolkit",
                 audio="model.model_kwargs.audio_path")


@dataclass(frozen=True)
class Request:
    """What a front end was given (None: not given)."""

    name_or_path: str
    preset: str | None = None
    vae: str | None = None
    text_encoder: str | None = None
    tokenizer: str | None = None
    image_encoder: str | None = None
    i2v_mode: str | None = None
    seed: int = 0
    boundary: float | None = None
    train_high_noise: bool | None = None
    train_low_noise: bool | None = None
    preset_required: bool = True  # a trainer needs the preset; `video-dit sample` reads the DiT config from the weights
    audio: str | None = None  # the audio codec of a family with sound (audio VAE + vocoder)


@dataclass(frozen=True)
class ExpertSources:
    """A two-expert model (Wan 2.2 A14B): the boundary, the experts asked to train (high first), and
    (source, seed) of every loadable expert (both for a two-expert folder or preset; the one asked for
    when the weights are one expert's own)."""

    boundary: float
    trained: tuple[str, ...]
    sources: dict[str, tuple[str, int]]


@dataclass(frozen=True)
class ModelSpec:
    """A resolved model. The DiT, preset, i2v mode and experts are resolved at once; the frozen
    encoders' sources (`vae`, `text_encoder`, `image_encoder`) when first asked (a front end that
    checks before any rank starts asks for all of them; the ai-toolkit arch when it loads them)."""

    request: Request
    preset: Preset | None            # None only for a command line's weights path with no preset known
    dit: str                         # preset:NAME, a weights file or a folder (a two-expert folder: the folder)
    i2v_mode: str | None             # first-frame conditioning: "replace" or "concat" (None: the DiT takes neither)
    experts: ExpertSources | None    # a two-expert model's experts, else None
    keys: Keys
    recorded: dict = field(default_factory=dict)  # an export's video_dit_sources.json
    family_name: str = ""            # families.FAMILIES key: the preset's, else the weights' own
    task: tuple[str, str] | None = None  # ("t2v" | "i2v", where it is said): a HunyuanVideo 1.5 checkpoint's

    @property
    def family(self) -> Family:
        return get_family(self.family_name)

    @property
    def seed(self) -> int:
        """The seed of a preset's random init."""
        return self.request.seed

    @property
    def tokenizer(self) -> str | None:
        return self.request.tokenizer

    @functools.cached_property
    def vae(self) -> str:
        return _vae(self.request, self.preset, self.recorded, self.keys, self.family)

    @functools.cached_property
    def text_encoder(self) -> str:
        return _text_encoder(self.request, self.preset, self.recorded, self.keys, self.family)

    @functools.cached_property
    def image_encoder(self) -> str | None:
        """The image encoder the DiT reads (Wan 2.1 I2V / FLF2V: CLIP; HunyuanVideo 1.5 i2v: SigLIP), else None."""
        return _image_encoder(self.request, self, self.recorded, self.keys)

    @functools.cached_property
    def audio(self) -> str | None:
        """The audio codec's source of a family with sound (`Family.audio`: its audio VAE and vocoder), else None."""
        return _audio(self.request, self.preset, self.recorded, self.keys, self.family)

    @functools.cached_property
    def dit_config(self):
        """The DiT's config: the preset's for `preset:NAME`, else the weights' own (config.json or shapes)."""
        name = preset_name(self.dit)
        if name is not None:
            return get_preset(name).dit
        try:  # a two-expert folder: its experts share one architecture; the first one's files say it
            return self.family.dit_config(_one_dit(self.dit, self.keys))
        except WeightsError as exc:
            raise self.keys.error(self.keys.model, self.dit, str(exc)) from exc

    @property
    def dit_shape(self):
        """The DiT config the checks use: a trainer's preset's (its weights are checked against it when
        they load), else the weights' own (a command line's model, whose preset only brings defaults)."""
        if self.request.preset_required and self.preset is not None:
            return self.preset.dit
        return self.dit_config

    @property
    def random(self) -> bool:
        """The DiT is a preset's seeded random init (no weights file)."""
        return preset_name(self.dit) is not None

    @property
    def last_frame(self) -> bool:
        """A first-last-frame model: one that needs the last frame too (`Family.last_frame`)."""
        return self.family.last_frame(self.dit_shape, self.i2v_mode) == "required"

    def sources(self) -> dict:
        """What a full fine-tune records beside its weights (`video_dit_sources.json`), whichever trainer wrote
        it: every path resolved absolute (`layouts.portable`), so the folder samples from any directory."""
        def where(src):
            return src if preset_name(src) is not None else portable(src)
        out = {"preset": self.preset.name if self.preset else None, "vae": where(self.vae), "text_encoder": where(self.text_encoder)}
        if self.image_encoder is not None:
            out["image_encoder"] = where(self.image_encoder)
        if self.audio is not None:
            out["audio"] = where(self.audio)
        return out


def check_lora(name_or_path: str, lora: bool, keys: Keys = JOB_KEYS) -> None:
    """A LoRA on a preset's random init trains nothing: refused, in the same words by every trainer."""
    if lora and preset_name(name_or_path) is not None:
        raise ConfigError(keys.network, f"LoRA on {name_or_path!r} trains nothing: a preset's weights are a random "
                          "init whose output layer is zero (as in Wan and DiT), so every LoRA gradient is 0 and the "
                          "adapters stay 0. Accepted: a full fine-tune (remove the network block), or LoRA on "
                          f"trained weights ({keys.model}: a weights file or folder, with {keys.preset})")


def check_dataset_i2v(preset: Preset, do_i2v: bool, key: str) -> None:
    """An image-to-video-only DiT (`Family.i2v_only`) trains on `do_i2v` datasets only: `ConfigError` naming
    `key` (the dataset's `do_i2v`) otherwise."""
    family = family_of(preset)
    if family.i2v_only(preset.dit) and not do_i2v:
        kind = " with an image branch" if family.image_branch_lora(preset.dit) else ""
        raise ConfigError(key, f"preset {preset.name!r} is an image-to-video model{kind}: every dataset needs "
                               "do_i2v: true")


def check_preview_frames(preset: Preset, i2v_mode: str | None, frames: list[tuple[bool, bool]], key: str) -> None:
    """Previews a DiT can render, checked before step 1 by every trainer in the same words: an image-to-video-only
    DiT (`Family.i2v_only`: no unconditioned input) needs each sample's first frame, a first-last-frame one
    (`Family.last_frame`: "required") its last frame too. `frames`: per sample, (has a first frame, has a last
    frame); `key`: the samples' list (`...sample.samples`). One `ConfigError` naming every sample without one
    and the key to set; a sample is never left to fail mid-run."""
    family = family_of(preset)
    need_first = family.i2v_only(preset.dit)
    need_last = family.last_frame(preset.dit, i2v_mode) == "required"
    for needed, index, name, what in (
            (need_first, 0, "ctrl_img", f"preset {preset.name!r} is image-to-video only (its DiT has no "
                                        "unconditioned input): every preview starts from a first frame"),
            (need_last, 1, "ctrl_img_2", f"preset {preset.name!r} is first-last-frame: every preview needs the "
                                         "last frame as ctrl_img_2 beside the first (ctrl_img or ctrl_img_1)")):
        missing = [i for i, have in enumerate(frames) if needed and not have[index]]
        if missing:
            ui = "its control image" if name == "ctrl_img" else "Control Image 2 (Control Image 1: the first)"
            raise ConfigError(f"{key}[{missing[0]}].{name}",
                              f"{what}, and sample{'s' if len(missing) > 1 else ''} "
                              f"{', '.join(map(str, missing))} of {len(frames)} ha{'ve' if len(missing) > 1 else 's'} "
                              f"none. Set {name} on each (ai-toolkit's UI: {ui}), or turn previews off "
                              "(train.disable_sampling: true)")


def last_frame_presets() -> list[str]:
    """The presets that take a last frame with the first (`Family.last_frame`: "required"), for messages."""
    return [n for n, p in PRESETS.items() if family_of(p).last_frame(p.dit, p.i2v_mode) == "required"]


def resolve(req: Request, keys: Keys = JOB_KEYS) -> ModelSpec:
    """The `ModelSpec` of `req` (module docstring); `ConfigError` naming the key (`keys`) otherwise."""
    if not req.name_or_path:
        raise ConfigError(keys.model, "required: preset:NAME or a path to DiT weights")
    name = preset_name(req.name_or_path)
    recorded = _recorded(req.name_or_path, keys)
    preset = _preset(req, name, recorded, keys)
    if name is None and not Path(req.name_or_path).exists():
        raise keys.error(keys.model, req.name_or_path, "no such file or folder; accepted: preset:NAME or a weights "
                                                       "file/folder")
    dit = req.name_or_path if name is not None else _dit_source(Path(req.name_or_path), keys)
    family = _family(req, preset, dit, keys)
    if req.preset_required and preset is not None:
        check_trains(preset, keys.preset if name is None else keys.model, keys.trainer)
    task = _task(req, preset, dit, family, keys)
    i2v = i2v_mode_of(preset, req.i2v_mode, keys.i2v_mode) if preset is not None else None
    spec = ModelSpec(req, preset, dit, i2v, experts_of(req, preset, keys), keys, recorded, family.name, task)
    if preset is None:  # a command line's weights path: the mode its DiT's input width (or its task) takes
        spec = dataclasses.replace(spec, i2v_mode=family.natural_i2v(spec.dit_config, task))
    return spec


def untrainable(preset: Preset, trainer: str = "video_dit") -> str | None:
    """Why `trainer` ("video_dit", "ai-toolkit": `Family.trains`) cannot train `preset`, or None."""
    family = family_of(preset)
    if trainer not in family.trains:
        other = "our trainer (./launch/train.sh)" if "video_dit" in family.trains else "video-dit sample --model PATH"
        return (f"{preset.name!r} is a {family.title} preset: {family.title} trains or samples with {other} but does "
                f"not train in {trainer} yet")
    if getattr(preset.dit, "use_meanflow", False):
        return (f"{preset.name!r} is step-distilled (its DiT reads the next timestep too, `use_meanflow`): it samples "
                "(video-dit sample) but is not trained with the flow-matching objective; train the model it was "
                "distilled from")
    return None


def check_trains(preset: Preset, key: str, trainer: str = "video_dit") -> None:
    """A preset `trainer` cannot train (`untrainable`) is a `ConfigError` naming `key` and the presets it
    can; every trainer front end asks this of its preset."""
    why = untrainable(preset, trainer)
    if why is not None:
        trainable = [n for n, p in PRESETS.items() if untrainable(p, trainer) is None]
        raise ConfigError(key, f"{why}; accepted: {', '.join(trainable)}")


def _family(req: Request, preset: Preset | None, dit: str, keys: Keys) -> Family:
    """The preset's family, else the weights' (`identify`); weights no family claims, or of another family
    than the preset's, are a `ConfigError` naming the key, the file and what is accepted."""
    try:
        found = identify(_one_dit(dit, keys))
    except UnknownFamily as exc:
        raise keys.error(keys.model, req.name_or_path, str(exc)) from exc
    if preset is None:
        if found is None:
            raise keys.error(keys.model, req.name_or_path, f"cannot tell which model family these weights are (no "
                             f"model_index.json or config.json class name, no known tensor names); {keys.give} "
                             f"{keys.preset} (one of: {', '.join(PRESETS)})")
        return found[0]
    family = family_of(preset)
    if found is not None and found[0] is not family:
        other, evidence = found
        fits = ", ".join(other.presets) + (", or no --preset" if keys.flags else "")
        raise keys.error(keys.preset, preset.name, f"is a {family.title} preset, but {keys.model} {req.name_or_path} "
                                                   f"holds {other.title} weights ({evidence}); accepted: {fits}")
    return family


def _task(req: Request, preset: Preset | None, dit: str, family: Family, keys: Keys) -> tuple[str, str] | None:
    """The task a checkpoint is meant for, where its family's t2v and i2v models share one architecture
    (HunyuanVideo 1.5): its metadata (`Family.task_of`), else its preset's; a preset of the other task
    than the metadata's is a `ConfigError`. None for a family whose DiT shape says it (Wan)."""
    if family.task_of is None:
        return None
    said = family.task_of(dit) if preset_name(dit) is None else None
    if preset is None:
        return said
    own = ("i2v" if preset.i2v_mode is not None else "t2v", f"preset {preset.name}")
    if said is not None and said[0] != own[0]:
        fits = [n for n, p in family.presets.items() if (p.i2v_mode is not None) == (said[0] == "i2v")]
        kind = {"t2v": "a text-to-video", "i2v": "an image-to-video"}
        raise keys.error(keys.preset, preset.name, f"is {kind[own[0]]} preset, but {keys.model} {req.name_or_path} is "
                                                   f"{kind[said[0]]} checkpoint ({said[1]}); accepted: {', '.join(fits)}")
    return said or own


def check_sources(spec: ModelSpec) -> ModelSpec:
    """Every part's source resolved now (each refused naming its key), for the checks that run before
    any rank starts."""
    spec.vae, spec.text_encoder, spec.image_encoder, spec.audio  # noqa: B018 (resolved and cached)
    check_image_encoder(spec)
    return spec


def i2v_mode_of(preset: Preset, requested: str | None, key: str) -> str | None:
    """The first-frame conditioning the preset's DiT takes (`Family.natural_i2v`: Wan's by its input width,
    "replace" or "concat"; a family whose t2v and i2v models share one architecture, by the preset's task);
    None: it takes no first frame. A requested mode the DiT cannot take is a `ConfigError` naming `key`."""
    family = family_of(preset)
    task = ("i2v" if preset.i2v_mode is not None else "t2v", f"preset {preset.name}")
    natural = family.natural_i2v(preset.dit, task, preset.vae.z_dim)
    if requested is not None and requested != natural:
        raise ConfigError(key, f"{requested!r} does not fit preset {preset.name!r} (a {family.title} model whose DiT "
                               f"takes {'i2v mode ' + repr(natural) if natural else 'no first frame'}); accepted: "
                               + (repr(natural) if natural else "none (leave it unset)"))
    return natural


def _recorded(name_or_path: str, keys: Keys) -> dict:
    if preset_name(name_or_path) is not None or not Path(name_or_path).is_dir():
        return {}
    try:
        return read_sources(name_or_path)
    except WeightsError as exc:
        raise keys.error(keys.model, name_or_path, str(exc)) from exc


def _preset(req: Request, name: str | None, recorded: dict, keys: Keys) -> Preset | None:
    """`preset:NAME`, else the preset given, else the one an export recorded."""
    if name is not None and req.preset not in (None, name):
        raise ConfigError(keys.preset, f"{req.preset!r} contradicts {keys.model} {req.name_or_path!r}")
    chosen = name or req.preset or recorded.get("preset")
    if chosen is None and not req.preset_required:
        return None
    if chosen is None:
        raise ConfigError(keys.preset, f"required when {keys.model} is a weights path (it names the VAE, text "
                                       f"encoder and schedule family); accepted: {', '.join(PRESETS)}")
    try:
        return get_preset(chosen)
    except KeyError as exc:
        raise ConfigError(keys.preset if name is None else keys.model, exc.args[0]) from exc


def _weight_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in WEIGHT_EXTS)


def _is_vae_file(path: Path) -> bool:
    return re.search(r"vae", path.name, re.IGNORECASE) is not None


def _dit_source(path: Path, keys: Keys) -> str:
    """The DiT of a path: a file as is; a folder with `transformer/` (diffusers) or two experts as is;
    else its one DiT weights file (beside a VAE file), or the folder of sharded weights."""
    if path.is_file() or (path / "transformer").is_dir() or _experts_of(path, keys) is not None:
        return str(path)
    files = [f for f in _weight_files(path) if not _is_vae_file(f)]
    if not files:
        raise keys.error(keys.model, path, f"no transformer/ folder and no DiT weight files ({', '.join(WEIGHT_EXTS)}) "
                                           "in it")
    return str(files[0]) if len(files) == 1 else str(path)  # several files: sharded weights, read as a folder


def _one_dit(dit: str, keys: Keys) -> str:
    """The files of one DiT of `dit`: a two-expert folder's first expert's (`EXPERT_FOLDERS`: both trainers save
    a two-expert full fine-tune as high_noise_model/ + low_noise_model/), else `dit` itself."""
    found = _experts_of(dit, keys) if preset_name(dit) is None else None
    return found[EXPERTS[0]] if found is not None else dit


def _experts_of(path, keys: Keys):
    try:
        return expert_sources(path)
    except WeightsError as exc:
        raise keys.error(keys.model, path, str(exc)) from exc


def _recorded_path(req: Request, recorded: dict, part: str, key: str, keys: Keys) -> str | None:
    """An export's recorded source of `part` (a relative path is relative to the saved folder:
    `layouts.recorded_path`), which must exist here."""
    src = recorded.get(part)
    if src is not None and preset_name(src) is None:
        src = recorded_path(req.name_or_path, src)
    if src is not None and preset_name(src) is None and not Path(src).exists():
        raise keys.error(keys.model, req.name_or_path, f"its video_dit_sources.json names the {part.replace('_', ' ')} "
                                                       f"{src}, which does not exist here; {keys.give} {key}")
    return src


def _vae(req: Request, preset: Preset | None, recorded: dict, keys: Keys, family: Family) -> str:
    given = req.vae or _recorded_path(req, recorded, "vae", keys.vae, keys)
    if given:
        return given
    name = preset_name(req.name_or_path)
    base = Path(req.name_or_path)
    found = family.folder_source(base, "vae") if name is None else None
    if found is not None:
        return found  # the folder: `load_vae` reads its vae/ (and the cache names the folder, as ever)
    candidates = [f for f in _weight_files(base) if _is_vae_file(f)] if name is None and base.is_dir() else []
    if len(candidates) == 1:
        return str(candidates[0])
    random = family.random_source(preset, "vae") if preset is not None and not candidates else None
    if random is not None:  # the tiny presets' random tiny VAE
        return random
    if name is None:
        raise keys.error(keys.model, req.name_or_path, f"cannot tell which VAE to use (found "
                         f"{[c.name for c in candidates] or 'no vae/ folder and no *vae* file'}); {keys.give} {keys.vae} "
                         f"({family.accepts['vae']})")
    raise keys.error(keys.vae, "(not set)", f"preset {preset.name!r} needs its trained VAE (never random here); "
                                            f"{keys.give} {keys.vae} ({family.accepts['vae']})")


def _text_encoder(req: Request, preset: Preset | None, recorded: dict, keys: Keys, family: Family) -> str:
    given = req.text_encoder or _recorded_path(req, recorded, "text_encoder", keys.text_encoder, keys)
    if given:
        return given
    found = family.folder_source(Path(req.name_or_path), "text_encoder") \
        if preset_name(req.name_or_path) is None else None
    if found is not None:
        return found
    random = family.random_source(preset, "text_encoder") if preset is not None else None
    if random is not None:  # the tiny presets' random text encoder(s)
        return random
    what = f"preset {preset.name!r} needs {family.needs['text_encoder']}" if preset else family.needs["text_folder"]
    raise keys.error(keys.text_encoder if preset else keys.model, req.name_or_path if not preset else "(not set)",
                     f"{what}: {keys.give} {keys.text_encoder} ({family.accepts['text_encoder']})")


def _audio(req: Request, preset: Preset | None, recorded: dict, keys: Keys, family: Family) -> str | None:
    """The audio codec of a family with sound, resolved as the VAE is: given, recorded by an export, the
    model's own layout (`Family.folder_source(base, "audio")`), a tiny preset's random one; else an error."""
    if family.audio is None:
        if req.audio is not None:
            raise keys.error(keys.audio, req.audio, f"{family.title} makes no sound (no audio codec); remove it")
        return None
    given = req.audio or _recorded_path(req, recorded, "audio", keys.audio, keys)
    if given:
        return given
    name = preset_name(req.name_or_path)
    found = family.folder_source(Path(req.name_or_path), "audio") if name is None else None
    if found is not None:
        return found
    random = family.random_source(preset, "audio") if preset is not None else None
    if random is not None:  # a tiny preset's random audio codec
        return random
    where = (keys.audio, "(not set)") if name is not None else (keys.model, req.name_or_path)
    raise keys.error(*where, f"{family.title} needs {family.needs['audio']}: {keys.give} {keys.audio} "
                             f"({family.accepts['audio']})")


def _image_encoder(req: Request, spec: ModelSpec, recorded: dict, keys: Keys) -> str | None:
    preset, family = spec.preset, spec.family
    if not family.reads_images(spec):
        if req.image_encoder is not None:
            raise keys.error(keys.image_encoder, req.image_encoder, f"{req.name_or_path} {family.needs['no_images']}; "
                                                                    "remove it")
        return None
    given = req.image_encoder or _recorded_path(req, recorded, "image_encoder", keys.image_encoder, keys)
    if given:
        return given
    found = family.folder_source(Path(req.name_or_path), "image_encoder") \
        if preset_name(req.name_or_path) is None else None
    if found is not None:
        return found
    random = family.random_source(preset, "image_encoder") if preset is not None else None
    if random is not None:  # the tiny presets' seeded random image encoder
        return random
    raise keys.error(keys.model, req.name_or_path,
                     f"has {family.needs['image_encoder']}: {keys.give} {keys.image_encoder} "
                     f"({family.accepts['image_encoder']}), or put image_encoder/ next to the model")


def check_image_encoder(spec: ModelSpec) -> None:
    """An image encoder whose features are not what the DiT reads (`Family.image_encoder_fits`: its width,
    and for Wan's CLIP its tokens per image) is a `ConfigError` naming the key, the file and what is
    accepted, from its config.json or tensor headers alone."""
    if spec.image_encoder is None:
        return
    try:
        why = spec.family.image_encoder_fits(spec.image_encoder, spec.dit_shape)
    except WeightsError as exc:
        raise spec.keys.error(spec.keys.image_encoder, spec.image_encoder, str(exc)) from exc
    if why is not None:
        raise spec.keys.error(spec.keys.image_encoder, spec.image_encoder, why)


def requested(model, preset: Preset, keys: Keys = JOB_KEYS) -> tuple[str, ...]:
    """The experts `model` (anything with `train_high_noise` / `train_low_noise`: a `Request`, a job's
    model block, the ai-toolkit arch's model_kwargs) asks to train, checked (None = true, as in
    ai-toolkit); () for a one-model preset, which refuses the keys. A trainer's model (anything but a
    command line's `Request`, which samples) that its trainer cannot train (`untrainable`) is refused here
    too: this is the first question every trainer asks of its preset (train/config.py, the ai-toolkit arch)."""
    if getattr(model, "preset_required", True):
        check_trains(preset, keys.preset, keys.trainer)
    asked = {"high_noise": model.train_high_noise, "low_noise": model.train_low_noise}
    if not preset.two_experts:
        for e, value in asked.items():
            if value is not None:
                raise ConfigError(f"{keys.experts}.{EXPERT_KEYS[e]}",
                                  f"preset {preset.name!r} is one model, not two experts; this key is for the "
                                  "Wan 2.2 A14B presets (wan2.2-t2v-a14b, wan2.2-i2v-a14b)")
        return ()
    for e, value in asked.items():
        if value not in (None, True, False):
            raise ConfigError(f"{keys.experts}.{EXPERT_KEYS[e]}", f"{value!r}; accepted: true, false")
    trained = tuple(e for e in EXPERTS if asked[e] is not False)
    if not trained:
        raise ConfigError(f"{keys.experts}.train_low_noise",
                          "train_high_noise and train_low_noise are both false: no expert to train; accepted: "
                          "at least one of them true (both: the experts alternate)")
    return trained


def boundary_of(model, preset: Preset, folder: float | None = None, keys: Keys = JOB_KEYS) -> float:
    """`model`'s boundary (a `Request`'s `boundary`, a model block's `boundary_ratio`), else the
    folder's model_index.json value, else the preset's; checked."""
    given = getattr(model, "boundary", getattr(model, "boundary_ratio", None))
    if given is not None:
        if not preset.two_experts:
            raise ConfigError(keys.boundary, f"preset {preset.name!r} is one model, not two experts; "
                                             "boundary_ratio is for the A14B presets")
        try:
            return check_boundary(given, "boundary_ratio")
        except ValueError as exc:
            raise ConfigError(keys.boundary, str(exc)) from exc
    if folder is not None:
        return check_boundary(folder, "model_index.json boundary_ratio")
    return preset.boundary_ratio


def experts_of(req: Request, preset: Preset | None, keys: Keys = JOB_KEYS) -> ExpertSources | None:
    """The `ExpertSources` of a two-expert model (reads the model folder: which experts it holds, its
    boundary): a two-expert preset's model, or a two-expert folder whatever the preset (a command
    line samples it with both); None for one model. `ConfigError` naming the key otherwise."""
    src = req.name_or_path
    found = _experts_of(src, keys) if preset_name(src) is None else None
    trained = requested(req, preset, keys) if preset is not None else EXPERTS
    if preset is None or not preset.two_experts:
        if preset is not None and req.boundary is not None and found is None:
            boundary_of(req, preset, None, keys)  # refused on a one-model preset
        if found is None:
            return None
        boundary = req.boundary if req.boundary is not None else _folder_boundary(src, keys)
        if boundary is None:
            raise keys.error(keys.model, src, "holds two experts but no boundary is known (no model_index.json "
                                              f"boundary_ratio, no two-expert preset): {keys.give} {keys.boundary} "
                                              f"or {keys.preset}")
        try:
            boundary = check_boundary(boundary, keys.boundary)
        except ValueError as exc:
            raise ConfigError(keys.boundary, str(exc)) from exc
        return ExpertSources(boundary, tuple(EXPERTS), {e: (found[e], req.seed) for e in EXPERTS})
    boundary = boundary_of(req, preset, _folder_boundary(src, keys) if found else None, keys)
    if preset_name(src) is not None:
        sources = {e: (src, expert_seed(req.seed, e)) for e in EXPERTS}
    elif found is not None:
        sources = {e: (found[e], req.seed) for e in EXPERTS}
    else:  # one expert's weights: they are the one expert asked for
        if len(trained) != 1:
            raise ConfigError(keys.model,
                              f"{src!r} holds one DiT, but both experts are asked for (train_high_noise and "
                              "train_low_noise are true, the default for an A14B preset). Accepted: a two-expert "
                              "folder (transformer/ + transformer_2/, or high_noise_model/ + low_noise_model/), or "
                              f"set {keys.experts}.train_high_noise or train_low_noise to false so these weights "
                              "are the other expert")
        sources = {trained[0]: (src, req.seed)}
    return ExpertSources(boundary, trained, sources)


def _folder_boundary(src: str, keys: Keys) -> float | None:
    try:
        return folder_boundary(src)
    except WeightsError as exc:
        raise keys.error(keys.model, src, str(exc)) from exc


def request_of_job(model) -> Request:
    """The `Request` of a parsed job's `model` block (`train.config.ModelConfig`)."""
    return Request(model.name_or_path, model.preset, model.vae_path, model.text_encoder_path, model.tokenizer_path,
                   model.image_encoder_path, model.i2v_mode, model.seed, model.boundary_ratio,
                   model.train_high_noise, model.train_low_noise, audio=model.audio_path)


def spec_of_job(process) -> ModelSpec:
    """The `ModelSpec` of a parsed job (`config.process[0]`)."""
    return resolve(request_of_job(process.model), JOB_KEYS)



def model_sources(process) -> tuple[str, str]:
    """(VAE source, text encoder source) of a parsed job (`spec_of_job`)."""
    spec = spec_of_job(process)
    return spec.vae, spec.text_encoder
