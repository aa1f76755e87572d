"""`video-dit sample`: render a text-to-video or image-to-video clip to MP4 (or .webp / .gif).

    video-dit sample --model preset:tiny --prompt "a red ball bouncing" --frames 17 --height 64 --width 64 \\
        --steps 20 --cfg 5 --seed 0 --out out.mp4
    video-dit sample --model MODELS/Wan2.1-T2V-1.3B-Diffusers --prompt "..." --image first.png --out i2v.mp4
    video-dit sample --model MODELS/Wan2.1-FLF2V-14B-720P-Diffusers --prompt "..." --image first.png \\
        --last-image last.png --out flf2v.mp4

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
leaves out: it renders what the previews showed. Order of work: the prompts are encoded and the text encoder freed before the DiT is loaded, so the two never
share memory; so are the images' CLIP features for a Wan 2.1 I2V / FLF2V model (`image_encoder/` in
PATH, or --image-encoder). Sampling settings left out come from PATH/scheduler/scheduler_config.json
(solver, shift), then the preset's defaults (diffusion/sampling_settings.py); one printed line says
which were used. Errors are one line (`video-dit`'s top level), never a traceback.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

OUT_EXTS = (".mp4", ".mov", ".mkv", ".webp", ".gif")
DTYPES = ("float32", "bfloat16", "float16")
WEIGHT_EXTS = (".safetensors", ".pth", ".pt", ".bin", ".ckpt")


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
    parser.add_argument("--model", required=True, help="preset:NAME (random weights; tiny needs no files) or a model folder/file")
    parser.add_argument("--vae", default=None, help="VAE weights (default: the preset's, or PATH/vae/ or a *vae* file in PATH)")
    parser.add_argument("--text-encoder", default=None,
                        help="text encoder: preset:NAME, a folder with text_encoder/ + tokenizer/, or an HF-named "
                             ".safetensors file with --tokenizer (default: the model's)")
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
    parser.add_argument("--image", default=None, help="first frame (image-to-video); resized to cover and centre-cropped")
    parser.add_argument("--last-image", default=None,
                        help="last frame, for a first-last-frame model (Wan 2.1 FLF2V; with --image)")
    parser.add_argument("--image-encoder", default=None,
                        help="CLIP image encoder of a Wan 2.1 I2V / FLF2V model: a folder with image_encoder/ + "
                             "image_processor/, clip_vision_h.safetensors or Wan's models_clip_*.pth (default: "
                             "the model folder's image_encoder/, or a tiny preset's own)")
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
    parser.add_argument("--fps", type=_float_in(0.0, strict=True), default=None, help="output fps (default: the preset's, else 16)")
    parser.add_argument("--dtype", choices=DTYPES, default=None,
                        help="DiT and text-encoder dtype (default: an export's previews', else float32; bfloat16 "
                             "keeps the DiT's float32 islands)")
    parser.add_argument("--vae-dtype", choices=DTYPES, default=None,
                        help="VAE dtype (default: an export's previews', else float32, as Wan decodes)")
    parser.add_argument("--device", default=None, help="torch device (default: cuda when available, else cpu)")
    parser.add_argument("--out", type=_out_path, required=True, help=f"output file ({' '.join(OUT_EXTS)})")


def _weight_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in WEIGHT_EXTS)


def _is_vae_file(path: Path) -> bool:
    return re.search(r"vae", path.name, re.IGNORECASE) is not None


def resolve_sources(model: str, vae: str | None, text_encoder: str | None) -> tuple[str, str, str]:
    """(dit source, vae source, text encoder source) for `load_dit` / `load_vae` / `load_text_encoder`
    (a two-expert folder's dit source is the folder: `load_experts` reads its experts); a folder's
    `video_dit_sources.json` names the VAE and text encoder an export was trained with."""
    from video_dit.models.loading import SOURCES_FILE, expert_sources, read_sources
    from video_dit.models.presets import get_preset

    if model.startswith("preset:"):
        preset = get_preset(model[len("preset:"):])
        return model, vae or f"preset:{preset.vae_name}", text_encoder or model
    path = Path(model)
    if not path.exists():
        raise FileNotFoundError(f"--model {model}: no such file or folder (or use preset:NAME)")
    if path.is_file():
        if vae is None or text_encoder is None:
            raise ValueError(f"--model {model} is a single DiT file: pass --vae and --text-encoder too")
        return str(path), vae, text_encoder
    dit = str(path)
    if not (path / "transformer").is_dir() and expert_sources(path) is None:
        files = [f for f in _weight_files(path) if not _is_vae_file(f)]
        if len(files) == 1:
            dit = str(files[0])
        elif not files:
            raise ValueError(f"--model {model}: no transformer/ folder and no DiT weight files "
                             f"({', '.join(WEIGHT_EXTS)}) in it")
        # several files: sharded DiT weights, read as a folder by load_dit
    saved = read_sources(path)
    for key, given in (("vae", vae), ("text_encoder", text_encoder)):
        recorded = saved.get(key)
        if given is None and recorded is not None and not recorded.startswith("preset:") \
                and not Path(recorded).exists():
            raise FileNotFoundError(f"--model {model}: its {SOURCES_FILE} names the {key.replace('_', ' ')} "
                                    f"{recorded}, which does not exist here; pass --{key.replace('_', '-')}")
    vae = vae or saved.get("vae")
    text_encoder = text_encoder or saved.get("text_encoder")
    if vae is None:
        candidates = [path / "vae"] if (path / "vae").is_dir() else [f for f in _weight_files(path) if _is_vae_file(f)]
        if len(candidates) != 1:
            raise ValueError(f"--model {model}: cannot tell which VAE to use (found "
                             f"{[c.name for c in candidates] or 'no vae/ folder and no *vae* file'}); pass --vae")
        vae = str(candidates[0])
    if text_encoder is None:
        if not (path / "text_encoder").is_dir():
            raise ValueError(f"--model {model}: no text_encoder/ folder in it; pass --text-encoder")
        text_encoder = str(path)
    return dit, vae, text_encoder


def image_encoder_for(model: str, dit_config, given: str | None) -> str | None:
    """The CLIP image encoder source of a DiT with the image branch (None without one): --image-encoder,
    else the model folder's image_encoder/, else a preset's own (the tiny presets' random one)."""
    if dit_config.image_dim is None:
        if given is not None:
            raise ValueError(f"--image-encoder {given}: --model {model} has no CLIP image branch")
        return None
    if given is not None:
        return given
    if model.startswith("preset:"):
        return model
    if Path(model).is_dir() and (Path(model) / "image_encoder").is_dir():
        return model
    raise ValueError(f"--model {model} has the CLIP image branch (Wan 2.1 I2V / FLF2V) and no image_encoder/ "
                     "folder: pass --image-encoder (clip_vision_h.safetensors, Wan's models_clip_*.pth, or a "
                     "folder with image_encoder/ + image_processor/)")



def check_lora_slot(path: str, expert: str, flag: str) -> None:
    """A LoRA given for `expert` that says (metadata `expert`, else the `_high_noise` / `_low_noise` name
    ai-toolkit and our trainer write) it belongs to the other expert: ValueError naming the file."""
    from video_dit.diffusion.experts import EXPERTS
    from video_dit.lora import read_lora

    _, _, _, meta = read_lora(path)
    said = meta.get("expert") or next((e for e in EXPERTS if Path(path).name.endswith(f"_{e}.safetensors")), None)
    if said is not None and said != expert:
        other = "--lora-2" if flag == "--lora" else "--lora"
        raise ValueError(f"{flag} {path}: this LoRA was trained for the {said.replace('_', '-')} expert "
                         f"({'its metadata says expert: ' + said if meta.get('expert') else 'its file name says so'}), "
                         f"but {flag} is the {expert.replace('_', '-')} expert's; pass it as {other} (are the two "
                         "files swapped?)")


def load_experts(model: str, preset, boundary: float | None, dtype, device, offload: bool):
    """`TwoExperts` of a two-expert model (a folder holding both, or `preset:NAME` of a two-expert preset),
    or None for one model. Offloaded experts are loaded onto the CPU (moved in for their steps)."""
    from video_dit.diffusion.experts import EXPERTS, TwoExperts, check_boundary
    from video_dit.models.loading import expert_seed, expert_sources, folder_boundary, load_dit

    if model.startswith("preset:"):
        if preset is None or not preset.two_experts:
            return None
        sources = {e: (model, expert_seed(0, e)) for e in EXPERTS}
    else:
        found = expert_sources(model)
        if found is None:
            return None
        sources = {e: (found[e], 0) for e in EXPERTS}
    if boundary is None:
        boundary = folder_boundary(model) or (preset.boundary_ratio if preset is not None and preset.two_experts
                                               else None)
    if boundary is None:
        raise ValueError(f"--model {model} holds two experts but no boundary is known (no model_index.json "
                         "boundary_ratio, no two-expert --preset): pass --boundary-ratio or --preset")
    check_boundary(boundary, "--boundary-ratio")
    where = "cpu" if offload else device
    experts = [load_dit(src, dtype=dtype, device=where, seed=seed).eval() for src, seed in sources.values()]
    return TwoExperts(*experts, boundary, offload=EXPERTS if offload else (), device=device if offload else None)


def main(args: argparse.Namespace) -> int:
    import torch

    from video_dit.diffusion.experts import HIGH, LOW
    from video_dit.diffusion.sampling_settings import SchedulerConfig, read_scheduler_config, resolve_sampling
    from video_dit.lora import load_lora
    from video_dit.media import load_image, write_video
    from video_dit.models.dit import cast_dit
    from video_dit.models.loading import load_dit, load_image_encoder, load_text_encoder, load_vae, open_dit
    from video_dit.models.presets import get_preset
    from video_dit.pipeline import VideoPipeline, image_features

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    from video_dit.models.loading import SOURCES_FILE, read_sources

    saved = {} if args.model.startswith("preset:") else read_sources(args.model) if Path(args.model).is_dir() else {}
    preset_name = args.preset or (args.model[len("preset:"):] if args.model.startswith("preset:")
                                  else saved.get("preset"))
    preset = get_preset(preset_name) if preset_name else None
    dit_src, vae_src, te_src = resolve_sources(args.model, args.vae, args.text_encoder)
    # a full fine-tune export: what its first preview used, for every flag the command leaves out
    shown = saved.get("sampling") or {}
    size = {k: getattr(args, k) if getattr(args, k) is not None else shown.get(k, default)
            for k, default in (("frames", 17), ("height", 480), ("width", 832), ("seed", 0))}
    fps = args.fps if args.fps is not None else shown.get("fps", preset.fps if preset else 16)
    dtype = getattr(torch, args.dtype or shown.get("dtype", "float32"))          # the previews' DiT / text encoder
    vae_dtype = getattr(torch, args.vae_dtype or shown.get("vae_dtype", "float32"))
    image = load_image(args.image) if args.image else None  # fail on a bad image before any model loads
    from video_dit.models.loading import expert_sources

    two = (preset is not None and preset.two_experts and args.model.startswith("preset:")) or \
        expert_sources(args.model) is not None
    if not two:
        for flag, value in (("--lora-2", args.lora_2), ("--cfg-2", args.cfg_2), ("--boundary-ratio", args.boundary_ratio)):
            if value is not None:
                raise ValueError(f"{flag} is for a two-expert model (Wan 2.2 A14B: a folder with transformer/ + "
                                 f"transformer_2/ or high_noise_model/ + low_noise_model/); --model {args.model} is one")
    for path, expert, flag in ((args.lora, HIGH, "--lora"), (args.lora_2, LOW, "--lora-2")):
        if path is not None and two:
            check_lora_slot(path, expert, flag)  # before any model loads
    # the command's values, else the folder's scheduler config (solver, shift), else the preset's
    given = {name: (value, flag) for name, value, flag in [
        ("solver", args.solver, "--solver"), ("steps", args.steps, "--steps"), ("shift", args.shift, "--shift"),
        ("guidance", args.cfg, "--cfg"), ("guidance_2", args.cfg_2, "--cfg-2"),
        ("negative", args.negative, "--negative")] if value is not None}
    if shown:  # ranks after the command, before the folder's scheduler config and the preset
        where = f"{SOURCES_FILE} (the previews')"
        given = {**{k: (shown[k], where) for k in ("steps", "guidance", "guidance_2", "negative")
                    if shown.get(k) is not None}, **given}
        scheduler = SchedulerConfig(shown["solver"], shown["shift"], shown.get("grid", "wan"), Path(where))
    else:
        scheduler = None if {"solver", "shift"} <= set(given) else read_scheduler_config(args.model)
    settings = resolve_sampling(preset, scheduler, given, two_experts=two)
    print(settings.describe(), flush=True)
    last = load_image(args.last_image) if args.last_image else None
    if last is not None and image is None:
        raise ValueError("--last-image needs --image (the first frame)")
    dit_config = get_preset(dit_src[len("preset:"):]).dit if dit_src.startswith("preset:") else open_dit(dit_src)[1]
    # checked before any model loads; an export names the CLIP image encoder it was trained with
    clip_src = image_encoder_for(args.model, dit_config, args.image_encoder or saved.get("image_encoder"))
    if dit_config.image_dim is not None and dit_config.num_images == 2 and last is None:
        raise ValueError(f"--model {args.model} is first-last-frame (Wan 2.1 FLF2V): pass --last-image LAST_FRAME")

    # 1. prompts -> embeds, then the text encoder is freed
    te = load_text_encoder(te_src, dtype=dtype, device=device, quantize=args.quantize_text_encoder,
                           tokenizer=args.tokenizer)
    guided = settings.guided
    embeds = te.encode([args.prompt, settings.negative] if guided else [args.prompt])
    del te
    # 1b. the image(s) -> CLIP features (Wan 2.1 I2V / FLF2V), once; then the image encoder is freed
    image_embeds = None
    if clip_src is not None and image is not None:
        clip = load_image_encoder(clip_src, dtype=dtype, device=device, quantize=args.quantize_image_encoder)
        image_embeds = image_features(clip, image, last)
        del clip
    # 2. the DiT (+ LoRA) or both experts (+ each one's LoRA), and the VAE
    dit = load_experts(args.model, preset, args.boundary_ratio, dtype, device, args.offload_inactive_expert)
    if dit is None:
        dit = load_dit(dit_src, dtype=dtype, device=device).eval()
        if args.lora:
            load_lora(args.lora, dit)
            cast_dit(dit.to(device), dtype)  # the adapters too; the float32 islands stay float32
    else:
        for path, expert in ((args.lora, dit.high), (args.lora_2, dit.low)):
            if path:
                load_lora(path, expert)
                cast_dit(expert, dtype)  # on its device (the CPU when offloaded); islands stay float32
    vae = load_vae(vae_src, dtype=vae_dtype, device=device).eval()
    pipe = VideoPipeline(dit, vae)  # replace-mode i2v with per-token timesteps (see conditioning.py)
    if pipe.i2v_mode == "concat" and image is None:
        raise ValueError(f"--model {args.model} is an image-to-video model (in_dim {pipe.dit_config.in_dim}): "
                         "pass --image FIRST_FRAME")
    # 3. sample, decode, write
    generator = torch.Generator("cpu").manual_seed(size["seed"])
    frames = pipe.generate(embeds[0], embeds[1] if guided else None, num_frames=size["frames"],
                           height=size["height"], width=size["width"], steps=settings.steps,
                           guidance_scale=settings.guidance,
                           guidance_scale_2=settings.guidance_2 if two else None,
                           shift=settings.shift, solver=settings.solver, grid=settings.grid, generator=generator,
                           first_frame=image, progress=True, last_frame=last, image_embeds=image_embeds)
    write_video(frames, args.out, fps=fps)
    kind = "flf2v" if last is not None else "i2v" if image is not None else "t2v"
    print(f"wrote {args.out} ({kind}, {len(frames)} frames, {frames[0].width}x{frames[0].height}, {fps:g} fps)")
    return 0
