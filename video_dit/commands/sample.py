"""`video-dit sample`: render a text-to-video or image-to-video clip to MP4 (or .webp / .gif).

    video-dit sample --model preset:tiny --prompt "a red ball bouncing" --frames 17 --height 64 --width 64 \\
        --steps 20 --cfg 5 --seed 0 --out out.mp4
    video-dit sample --model MODELS/Wan2.1-T2V-1.3B-Diffusers --prompt "..." --image first.png --out i2v.mp4
    video-dit sample --model MODELS/Wan2.1-FLF2V-14B-720P-Diffusers --prompt "..." --image first.png \\
        --last-image last.png --out flf2v.mp4
    video-dit sample --model MODELS/HunyuanVideo-1.5-Diffusers-480p_t2v --prompt "..." --out hy15.mp4
    video-dit sample --model MODELS/HunyuanVideo-1.5-Diffusers-480p_i2v --prompt "..." --image first.png \\
        --out hy15_i2v.mp4

--model: `preset:NAME` (seeded random weights; the tiny preset needs no files) or PATH, a folder holding
the DiT weights (diffusers `transformer/`, or weight files) and the VAE (`vae/` or a `*vae*` file; or
pass --vae), plus `text_encoder/` + `tokenizer/` (or pass --text-encoder). A two-expert folder (Wan 2.2
A14B: `transformer/` + `transformer_2/`, or Wan's `high_noise_model/` + `low_noise_model/`) samples with
both experts, each step with the one whose side of the boundary holds its timestep:
    video-dit sample --model models/Wan2.2-T2V-A14B-Diffusers --lora NAME_high_noise.safetensors \\
        --lora-2 NAME_low_noise.safetensors --prompt "..." --out a14b.mp4 [--offload-inactive-expert]
(a LoRA handed to the other expert's option is refused, naming the file). A full fine-tune export
(ours or the ai-toolkit arch's) records its preset and where its VAE and text encoder came from in
`video_dit_sources.json`, which is read when --vae / --text-encoder / --preset are not given, and
the settings its first preview rendered with (solver, steps, shift, guidance, negative prompt,
frames, size, fps, seed, the DiT / text encoder and VAE dtypes), used for every flag the command
leaves out: it renders what the previews showed. The model family (Wan, HunyuanVideo 1.5) is the
preset's, else the weights' own (`families.identify`); it brings the loaders and the pipeline. A HunyuanVideo
1.5 folder (diffusers' layout, or one of Tencent's transformer/<variant>/ folders with --text-encoder)
samples t2v or i2v as its checkpoint was released for (--image only on an i2v checkpoint).
Order of work: the prompts are encoded and the text encoder freed before the DiT is loaded, so the two
never share memory; so are the images' CLIP features for a Wan 2.1 I2V / FLF2V model (`image_encoder/` in
PATH, or --image-encoder; SigLIP for HunyuanVideo 1.5 i2v). Sampling settings left out come from
PATH/scheduler/scheduler_config.json (solver, shift) and PATH/guider/guider_config.json (guidance), then
the preset's defaults (diffusion/sampling_settings.py); one printed line says
which were used. A model with sound (LTX-2, `Family.audio`) writes its waveform as the MP4's AAC track
(--no-audio: the picture alone), its audio codec from the model (or --audio-codec), and samples at --fps:
    video-dit sample --model MODELS/LTX-2 --prompt "..." --frames 121 --height 512 --width 768 --out ltx2.mp4
Errors are one line (`video-dit`'s top level), never a traceback.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from video_dit.devices import resolve_device
from video_dit.diffusion.experts import EXPERTS, HIGH, LOW, TwoExperts
from video_dit.diffusion.flow import LEGACY_GRIDS
from video_dit.diffusion.sampling_settings import (
    SchedulerConfig,
    read_guider_config,
    read_scheduler_config,
    resolve_sampling,
)
from video_dit.families import scheduler_classes
from video_dit.lora import load_lora, read_lora
from video_dit.media import load_image, write_video
from video_dit.models.attention import BACKENDS, available, missing_backend
from video_dit.models.layouts import SOURCES_FILE
from video_dit.spec import CLI_KEYS, ModelSpec, Request, check_sources, resolve

OUT_EXTS = (".mp4", ".mov", ".mkv", ".webp", ".gif")
DTYPES = ("float32", "bfloat16", "float16")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _float_in(lo: float, strict: bool):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if value < lo or (strict and value == lo):
            raise argparse.ArgumentTypeError(f"expected a number {'>' if strict else '>='} {lo}, got {value}")
        return value
    return parse


def _out_path(text: str) -> Path:
    path = Path(text)
    if path.suffix.lower() not in OUT_EXTS:
        raise argparse.ArgumentTypeError(f"{text}: unsupported extension; accepted: {' '.join(OUT_EXTS)}")
    return path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True,
                        help="preset:NAME (random weights; the tiny presets need no files) or a model folder/file "
                             "(Wan or HunyuanVideo 1.5: its family is read from its files)")
    parser.add_argument("--vae", default=None, help="VAE weights (default: the preset's, or PATH/vae/ or a *vae* file in PATH)")
    parser.add_argument("--text-encoder", default=None,
                        help="text encoder: preset:NAME, a folder with text_encoder/ + tokenizer/ (HunyuanVideo 1.5: "
                             "also text_encoder_2/ + tokenizer_2/), or an HF-named umT5 .safetensors file with "
                             "--tokenizer (default: the model's)")
    parser.add_argument("--tokenizer", default=None, help="tokenizer folder for a single-file --text-encoder")
    parser.add_argument("--quantize-text-encoder", choices=("qfloat8", "qint8"), default=None,
                        help="quantize the text encoder's weights with optimum-quanto")
    parser.add_argument("--preset", default=None,
                        help="preset whose defaults (solver, steps, shift, guidance, negative prompt, fps) apply to a "
                             "PATH model (default: the model's preset)")
    parser.add_argument("--lora", "--lora-high", dest="lora", default=None,
                        help="a LoRA file (video_dit / ComfyUI format) applied to the DiT; for a two-expert model "
                             "(Wan 2.2 A14B) the high-noise expert's (e.g. NAME_high_noise.safetensors)")
    parser.add_argument("--lora-2", "--lora-low", dest="lora_2", default=None,
                        help="two-expert model: the low-noise expert's LoRA (e.g. NAME_low_noise.safetensors)")
    parser.add_argument("--prompt", required=True, help="the text prompt")
    parser.add_argument("--negative", default=None,
                        help="negative prompt of classifier-free guidance (default: the preset's, e.g. Wan's; '' for none)")
    parser.add_argument("--image", default=None,
                        help="first frame (image-to-video); resized to cover and centre-cropped (HunyuanVideo 1.5: "
                             "an i2v checkpoint only)")
    parser.add_argument("--last-image", default=None,
                        help="last frame, for a first-last-frame model (Wan 2.1 FLF2V; with --image)")
    parser.add_argument("--image-encoder", default=None,
                        help="CLIP image encoder of a Wan 2.1 I2V / FLF2V model: a folder with image_encoder/ + "
                             "image_processor/, clip_vision_h.safetensors or Wan's models_clip_*.pth; SigLIP of a "
                             "HunyuanVideo 1.5 i2v model: a folder with image_encoder/ + feature_extractor/ "
                             "(default: the model folder's image_encoder/, or a tiny preset's own)")
    parser.add_argument("--quantize-image-encoder", choices=("qfloat8", "qint8"), default=None,
                        help="quantize the CLIP image encoder's weights with optimum-quanto")
    parser.add_argument("--frames", type=_positive_int, default=None,
                        help="frames, snapped to 4k + 1 (default: an export's previews', else 17)")
    parser.add_argument("--height", type=_positive_int, default=None,
                        help="pixels, snapped to the model's multiple (default: an export's previews', else 480)")
    parser.add_argument("--width", type=_positive_int, default=None,
                        help="pixels, snapped to the model's multiple (default: an export's previews', else 832)")
    parser.add_argument("--steps", type=_positive_int, default=None, help="solver steps (default: the preset's)")
    parser.add_argument("--solver", choices=("unipc", "euler"), default=None,
                        help="flow ODE solver: unipc (Wan's) or euler (default: the model folder's scheduler "
                             "config, else the preset's)")
    parser.add_argument("--cfg", type=_float_in(0.0, strict=False), default=None,
                        help="classifier-free guidance scale; 1 disables guidance (default: the preset's); a "
                             "two-expert model: the high-noise expert's (both experts' without --cfg-2)")
    parser.add_argument("--cfg-2", "--cfg-low", dest="cfg_2", type=_float_in(0.0, strict=False), default=None,
                        help="two-expert model: the low-noise expert's guidance scale (default: --cfg, else the "
                             "preset's pair, e.g. 3.0 for T2V-A14B whose high-noise scale is 4.0)")
    parser.add_argument("--boundary-ratio", type=_float_in(0.0, strict=True), default=None,
                        help="two-expert model: the high-noise expert denoises t >= this x 1000 (default: the "
                             "folder's model_index.json, else the preset's: 0.875 T2V-A14B, 0.9 I2V-A14B)")
    parser.add_argument("--offload-inactive-expert", action="store_true",
                        help="two-expert model: keep the expert not sampling the current step on the CPU (one "
                             "expert on the device at a time)")
    parser.add_argument("--shift", type=_float_in(0.0, strict=True), default=None,
                        help="flow-matching shift of the schedule (default: the model folder's scheduler config, "
                             "else the preset's)")
    parser.add_argument("--seed", type=int, default=None, help="noise seed (default: an export's first preview's, else 0)")
    parser.add_argument("--fps", type=_float_in(0.0, strict=True), default=None,
                        help="output fps (default: the preset's, else the family's: 16 Wan, 24 HunyuanVideo 1.5 and "
                             "LTX-2); a model with sound (LTX-2) also samples at it: its positions and the sound's "
                             "length follow the frame rate")
    parser.add_argument("--audio-codec", default=None,
                        help="a model with sound (LTX-2): its audio VAE and vocoder, a diffusers folder with "
                             "audio_vae/ + vocoder/ or Lightricks' single file (default: the model's own, or a tiny "
                             "preset's)")
    parser.add_argument("--no-audio", action="store_true",
                        help="a model with sound: write the picture alone (the sound is still sampled with it: the "
                             "model generates both)")
    parser.add_argument("--dtype", choices=DTYPES, default=None,
                        help="DiT and text-encoder dtype (default: an export's previews', else float32; bfloat16 "
                             "keeps the DiT's float32 islands)")
    parser.add_argument("--vae-dtype", choices=DTYPES, default=None,
                        help="VAE dtype (default: an export's previews', else float32, as Wan decodes)")
    parser.add_argument("--device", default=None, help="torch device (default: cuda when available, else cpu)")
    parser.add_argument("--attention-backend", choices=BACKENDS, default="native",
                        help="attention kernel: native (torch SDPA, its own kernel choice), flash, flash3 or sage "
                             "(each needs its package)")
    parser.add_argument("--out", type=_out_path, required=True, help=f"output file ({' '.join(OUT_EXTS)})")


def check_lora_slot(path: str, expert: str, flag: str) -> None:
    """A LoRA given for `expert` that says (metadata `expert`, else the `_high_noise` / `_low_noise` name
    ai-toolkit and our trainer write) it belongs to the other expert: ValueError naming the file."""
    _, _, _, meta = read_lora(path)  # (the metadata only: any family's keys)
    said = meta.get("expert") or next((e for e in EXPERTS if Path(path).name.endswith(f"_{e}.safetensors")), None)
    if said is not None and said != expert:
        other = "--lora-2" if flag == "--lora" else "--lora"
        raise ValueError(f"{flag} {path}: this LoRA was trained for the {said.replace('_', '-')} expert "
                         f"({'its metadata says expert: ' + said if meta.get('expert') else 'its file name says so'}), "
                         f"but {flag} is the {expert.replace('_', '-')} expert's; pass it as {other} (are the two "
                         "files swapped?)")


def spec_of_args(args: argparse.Namespace) -> ModelSpec:
    """The model the command line names (`video_dit.spec`): the preset is optional here (the DiT's
    config comes from its weights; the preset only brings sampling defaults)."""
    return check_sources(resolve(Request(args.model, preset=args.preset, vae=args.vae, text_encoder=args.text_encoder,
                                         tokenizer=args.tokenizer, image_encoder=args.image_encoder,
                                         boundary=args.boundary_ratio, preset_required=False,
                                         audio=args.audio_codec), CLI_KEYS))


def load_models(spec: ModelSpec, args, dtype, device):
    """The DiT (+ LoRA), or both experts (`TwoExperts`, + each one's LoRA; offloaded experts on the
    CPU, moved in for their steps)."""
    if spec.experts is None:
        dit = spec.family.load_dit(spec.dit, dtype=dtype, device=device).eval()
        if args.lora:
            load_lora(args.lora, dit, from_file=spec.family.lora_from_file)  # adapters on the file's modules
            spec.family.arch.cast(dit.to(device), dtype)  # the adapters too; the float32 islands stay float32
        return dit
    where = "cpu" if args.offload_inactive_expert else device
    high, low = (spec.family.load_dit(src, dtype=dtype, device=where, seed=seed).eval()
                 for src, seed in (spec.experts.sources[e] for e in EXPERTS))
    for path, expert in ((args.lora, high), (args.lora_2, low)):
        if path:
            load_lora(path, expert, from_file=spec.family.lora_from_file)
            spec.family.arch.cast(expert, dtype)  # on its device (the CPU when offloaded); islands stay float32
    offload = args.offload_inactive_expert
    return TwoExperts(high, low, spec.experts.boundary, offload=EXPERTS if offload else (),
                      device=device if offload else None)


def sampling_of(spec: ModelSpec, args, two: bool):
    """The settings of this render: the command's values, else what an export's previews used (its
    `video_dit_sources.json`), else the model folder's scheduler config (solver, shift), else the
    preset's defaults."""
    given = {name: (value, flag) for name, value, flag in [
        ("solver", args.solver, "--solver"), ("steps", args.steps, "--steps"), ("shift", args.shift, "--shift"),
        ("guidance", args.cfg, "--cfg"), ("guidance_2", args.cfg_2, "--cfg-2"),
        ("negative", args.negative, "--negative")] if value is not None}
    shown = spec.recorded.get("sampling") or {}
    guider = None
    if shown:  # ranks after the command, before the folder's scheduler config and the preset
        where = f"{SOURCES_FILE} (the previews')"
        given = {**{k: (shown[k], where) for k in ("steps", "guidance", "guidance_2", "negative")
                    if shown.get(k) is not None}, **given}
        scheduler = SchedulerConfig(shown["solver"], shown["shift"], LEGACY_GRIDS.get(shown.get("grid"), shown.get("grid", "reference")),
                                    Path(where))
    else:
        scheduler = None if {"solver", "shift"} <= set(given) else read_scheduler_config(args.model, scheduler_classes())
        guider = None if "guidance" in given else read_guider_config(args.model)
    return resolve_sampling(spec.preset, scheduler, given, two_experts=two, guider=guider, family=spec.family)


def check_args(spec: ModelSpec, args, image, last) -> None:
    """What the command asks that this model cannot do, before any model loads."""
    family = spec.family
    for flag, value in (("--lora", args.lora), ("--last-image", args.last_image), ("--tokenizer", args.tokenizer)):
        if value is not None and flag in family.refused_flags:
            raise ValueError(f"{flag} {value}: {family.refused_flags[flag]}; remove it")
    two = spec.experts is not None
    if not two:
        for flag, value in (("--lora-2", args.lora_2), ("--cfg-2", args.cfg_2), ("--boundary-ratio", args.boundary_ratio)):
            if value is not None:
                raise ValueError(f"{flag} is for a two-expert model (Wan 2.2 A14B: a folder with transformer/ + "
                                 f"transformer_2/ or high_noise_model/ + low_noise_model/); --model {args.model} is one")
    for path, expert, flag in ((args.lora, HIGH, "--lora"), (args.lora_2, LOW, "--lora-2")):
        if path is not None and two:
            check_lora_slot(path, expert, flag)
    if family.audio is None and args.no_audio:
        raise ValueError(f"--no-audio: {family.title} makes no sound; remove it")
    if family.audio is not None and not args.no_audio and args.out.suffix.lower() in (".webp", ".gif"):
        raise ValueError(f"--out {args.out}: a {args.out.suffix} has no audio track and {family.title} makes sound; "
                         "write .mp4 / .mov / .mkv, or pass --no-audio")
    if last is not None and image is None:
        raise ValueError("--last-image needs --image (the first frame)")
    if spec.last_frame and last is None:
        raise ValueError(f"--model {args.model} is first-last-frame (its DiT reads the last frame too): pass "
                         "--last-image LAST_FRAME")
    if spec.i2v_mode == "concat" and image is None:
        why = spec.task[1] if spec.task is not None else f"its DiT takes i2v mode {spec.i2v_mode!r}"
        raise ValueError(f"--model {args.model} is an image-to-video model ({why}): pass --image FIRST_FRAME")
    if image is not None and family.task_of is not None and spec.i2v_mode is None:
        i2v = [n for n, p in family.presets.items() if p.i2v_mode is not None]
        said = (f"a text-to-video checkpoint ({spec.task[1]}), which {family.title}'s reference pipeline does not "
                "condition on a first frame" if spec.task is not None else
                "a checkpoint whose task (t2v or i2v) nothing in its files says")
        raise ValueError(f"--image {args.image}: --model {args.model} is {said}; accepted: an image-to-video "
                         f"checkpoint (or --preset {' / '.join(i2v)} for a bare i2v weights file), or no --image")


def main(args: argparse.Namespace) -> int:
    device = resolve_device(args.device)
    if not available(args.attention_backend):
        raise ValueError(f"--attention-backend: {missing_backend(args.attention_backend)}")
    spec = spec_of_args(args)
    # an export's previews: what they used, for every flag the command leaves out
    shown = spec.recorded.get("sampling") or {}
    size = {k: getattr(args, k) if getattr(args, k) is not None else shown.get(k, default)
            for k, default in (("frames", 17), ("height", 480), ("width", 832), ("seed", 0))}
    fps = args.fps if args.fps is not None else shown.get("fps", spec.preset.fps if spec.preset else spec.family.fps)
    dtype = getattr(torch, args.dtype or shown.get("dtype", "float32"))          # the previews' DiT / text encoder
    vae_dtype = getattr(torch, args.vae_dtype or shown.get("vae_dtype", "float32"))
    image = load_image(args.image) if args.image else None  # fail on a bad image before any model loads
    last = load_image(args.last_image) if args.last_image else None
    check_args(spec, args, image, last)
    two = spec.experts is not None
    settings = sampling_of(spec, args, two)
    print(settings.describe(), flush=True)

    # 1. prompts -> embeds, then the text encoder is freed
    family = spec.family  # its loaders and pipeline (`families.contract.Family`)
    te = family.load_text_encoder(spec.text_encoder, dtype=dtype, device=device, quantize=args.quantize_text_encoder,
                                  tokenizer=spec.tokenizer)
    guided = settings.guided
    prompts = [args.prompt, settings.negative] if guided else [args.prompt]
    # a conditioner that presents the keyframes with the prompt (`Family.prompt_images`) encodes them here too
    shown = family.prompt_images(image, last, size["height"], size["width"]) \
        if family.prompt_images is not None and (image is not None or last is not None) else None
    embeds = te.encode(prompts) if shown is None else te.encode(prompts, images=[shown] * len(prompts))
    del te
    # 1b. the image(s) -> CLIP features (Wan 2.1 I2V / FLF2V), once; then the image encoder is freed
    image_embeds = None
    if spec.image_encoder is not None and image is not None:
        encoder = family.load_image_encoder(spec.image_encoder, dtype=dtype, device=device,
                                            quantize=args.quantize_image_encoder)
        image_embeds = family.image_embeds(encoder, image, last, size["height"], size["width"])
        del encoder
    # 2. the DiT (+ LoRA) or both experts (+ each one's LoRA), and the VAE
    dit = load_models(spec, args, dtype, device)
    for expert in (dit.high, dit.low) if isinstance(dit, TwoExperts) else (dit,):
        expert.set_attention_backend(args.attention_backend)
    vae = family.load_vae(spec.vae, dtype=vae_dtype, device=device).eval()
    extra = {}  # what only some models take: a two-expert model's low-noise scale, FLF2V's last frame, the fps
    codec = None
    if family.audio is not None:  # a model with sound: its codec, and the frame rate it samples at
        codec = family.audio.load_codec(spec.audio, dtype=vae_dtype, device=device, seed=spec.seed).eval()
        pipe = family.pipeline(dit, vae, audio_codec=codec)
        extra["fps"] = fps
    else:
        pipe = family.pipeline(dit, vae)
    # 3. sample, decode, write
    generator = torch.Generator("cpu").manual_seed(size["seed"])
    if two:
        extra["guidance_scale_2"] = settings.guidance_2
    if last is not None:
        extra["last_frame"] = last
    sound = codec is not None and not args.no_audio
    out = (pipe.generate_with_audio if sound else pipe.generate)(
        embeds[0], embeds[1] if guided else None, num_frames=size["frames"], height=size["height"],
        width=size["width"], steps=settings.steps, guidance_scale=settings.guidance, shift=settings.shift,
        solver=settings.solver, grid=settings.grid, generator=generator, first_frame=image, progress=True,
        image_embeds=image_embeds, **extra)
    frames, wave = out if sound else (out, None)
    write_video(frames, args.out, fps=fps, audio=wave, audio_rate=codec.out_rate if sound else None)
    kind = "flf2v" if last is not None else "i2v" if image is not None else "t2v"
    with_sound = f", sound {wave.shape[0]} x {wave.shape[1]} at {codec.out_rate} Hz" if sound else ""
    print(f"wrote {args.out} ({kind}, {len(frames)} frames, {frames[0].width}x{frames[0].height}, {fps:g} fps"
          f"{with_sound})")
    return 0
