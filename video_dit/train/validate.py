"""`python -m video_dit.train.validate CONFIG [--prepare]`: check a job file before any rank starts.

Exit 0 when the job can start, 2 with one line naming the key path and what is accepted otherwise.
`--prepare` first runs the job's set-up stages (`prepare:` block: the demo dataset, the tiny VAE),
each skipped when its output exists; `launch/train.sh` always passes it.
Beyond the typed parse (`video_dit.train.config`), this checks what needs the file system: dataset
folders (exist, hold media), control images of previews, weights paths, the resume path, and that
the output folder is writable; then it scans the data as the trainer will (container headers only,
seconds for hundreds of clips): no usable item and `num_frames` longer than every clip (naming the
longest) exit 2 here rather than after the ranks start (stills in a concat i2v job are skipped,
with the one warning the trainer prints at start-up: `diffusion.conditioning.stills_skipped`). The temp
files of cache writes that a killed run left behind are removed here (no rank runs yet). `--plan`
(train.sh applies it with its launcher arguments) then prints the memory plan of the
ranks about to start and applies `deepspeed.memory_check` (`memory_check`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import warnings
from pathlib import Path

from video_dit.data import DataError, scan_datasets
from video_dit.data.cache import remove_partial_files
from video_dit.data.demo import holdout_dir, make_demo_data, move_old_holdout
from video_dit.data.demo_av import MIN_RATE, make_demo_av_data
from video_dit.diffusion.experts import expert_at
from video_dit.families import family_of, get_preset, vae_family
from video_dit.media import MediaError, load_image
from video_dit.models.attention import available, missing_backend
from video_dit.models.layouts import mixed_outputs, preset_name
from video_dit.spec import check_image_encoder, check_preview_frames, check_sources, last_frame_presets, spec_of_job
from video_dit.train import checkpoint as ckpt
from video_dit.train.config import ModelConfig, PrepareConfig, parse_job, raw_process, read_yaml
from video_dit.train.engine import schedule_change
from video_dit.train.experts import plan_experts
from video_dit.train.plan import PlanError, preflight
from video_dit.train.preview import job_scheduler
from video_dit.typed_config import ConfigError, parse

PROCESS = "config.process[0]"


def prepare(raw: dict, log=print) -> None:
    """Run the `prepare:` stages of a raw job mapping (before the full parse: they create the data
    the dataset checks look for)."""
    proc = raw_process(raw)
    if not proc.get("prepare"):
        return
    stages = parse(PrepareConfig, proc["prepare"], f"{PROCESS}.prepare")
    if stages.demo_data is not None:
        d = stages.demo_data
        folder = Path(d.dir)
        try:  # an earlier version's holdout/ inside the folder: moved out before anything reads the folder
            moved = move_old_holdout(folder)
        except ValueError as exc:
            raise ConfigError(f"{PROCESS}.prepare.demo_data.dir", str(exc)) from exc
        if moved:
            log(f"[video_dit] demo data: {moved}")
        held = [holdout_dir(folder) / f"{j:03d}{e}" for j in range(d.holdout) for e in (".mp4", ".png", ".txt")]
        if folder.is_dir() and any(folder.glob("*.mp4")) and all(f.is_file() for f in held):
            log(f"[video_dit] demo data: {folder} exists")
        else:
            kw = dict(count=d.count, frames=d.frames, size=d.size, seed=d.seed, holdout=d.holdout, fps=d.fps)
            if d.audio_rate is None:
                log(f"[video_dit] demo data: writing {d.count} clips to {folder}")
                make_demo_data(folder, **kw)
            else:  # the audio-video demo's: every clip with its caption's sound
                if not MIN_RATE <= d.audio_rate:
                    raise ConfigError(f"{PROCESS}.prepare.demo_data.audio_rate",
                                      f"{d.audio_rate}; accepted: >= {MIN_RATE} samples per second")
                log(f"[video_dit] demo data: writing {d.count} clips with {d.audio_rate} Hz sound to {folder}")
                make_demo_av_data(folder, audio_rate=d.audio_rate, **kw)
    if stages.tiny_vae is not None:
        v = stages.tiny_vae
        if v.latent_init_scale is not None and not v.latent_init_scale > 0:
            raise ConfigError(f"{PROCESS}.prepare.tiny_vae.latent_init_scale",
                              f"must be > 0 (or left out: the default init), got {v.latent_init_scale}")
        for key in ("cell_weight", "bright_weight", "fg_weight", "fg_ring", "images", "image_steps"):
            if not getattr(v, key) >= 0:
                raise ConfigError(f"{PROCESS}.prepare.tiny_vae.{key}", f"must be >= 0, got {getattr(v, key)}")
        if v.image_steps > v.steps:
            raise ConfigError(f"{PROCESS}.prepare.tiny_vae.image_steps",
                              f"must be <= steps ({v.steps}), got {v.image_steps}")
        if not 0.0 <= v.ema < 1.0:
            raise ConfigError(f"{PROCESS}.prepare.tiny_vae.ema",
                              f"must be in [0, 1) (a decay such as 0.99; 0: no average), got {v.ema}")
        if not 1 <= v.ranks <= v.batch_size:
            raise ConfigError(f"{PROCESS}.prepare.tiny_vae.ranks", f"must be 1 .. batch_size ({v.batch_size}: each "
                              f"rank takes a share of the windows), got {v.ranks}")

        try:
            family = vae_family(v.preset)
        except KeyError as exc:
            raise ConfigError(f"{PROCESS}.prepare.tiny_vae.preset", exc.args[0]) from exc
        model = parse(ModelConfig, proc.get("model"), f"{PROCESS}.model")
        if not model.vae_path:
            raise ConfigError(f"{PROCESS}.model.vae_path", "prepare.tiny_vae writes the VAE to model.vae_path; set it")
        out = Path(model.vae_path)
        if out.is_file():
            log(f"[video_dit] tiny VAE: {out} exists")
        else:
            log(f"[video_dit] tiny VAE: training on {v.data} -> {out} ({v.steps} steps)")
            recipe = dataclasses.asdict(v)  # every other field is a train_tiny_vae keyword of that name
            family.vae_stage(recipe.pop("data"), out, **recipe)
    if stages.tiny_audio is not None:
        _prepare_audio(stages.tiny_audio, parse(ModelConfig, proc.get("model"), f"{PROCESS}.model"), log)


def _prepare_audio(stage, model, log) -> None:
    """`prepare.tiny_audio`: the model's audio codec trained into `model.audio_path` (`AudioPath.codec_stage`
    of its family, for its preset) unless that exists."""
    sound = family_of(get_preset(model.preset)).audio
    if sound is None or sound.codec_stage is None:
        raise ConfigError(f"{PROCESS}.prepare.tiny_audio", f"preset {model.preset!r} has no audio codec to train "
                                                           "(no sound, or its family has no codec stage); remove it")
    if not model.audio_path:
        raise ConfigError(f"{PROCESS}.model.audio_path", "prepare.tiny_audio writes the audio codec to "
                                                         "model.audio_path; set it")
    for key in ("steps", "vocoder_steps", "batch_size"):
        if not getattr(stage, key) >= 1:
            raise ConfigError(f"{PROCESS}.prepare.tiny_audio.{key}", f"must be >= 1, got {getattr(stage, key)}")
    for key in ("lr", "vocoder_lr"):
        if not getattr(stage, key) > 0:
            raise ConfigError(f"{PROCESS}.prepare.tiny_audio.{key}", f"must be > 0, got {getattr(stage, key)}")
    if stage.segment_frames is not None and not stage.segment_frames >= 2:
        raise ConfigError(f"{PROCESS}.prepare.tiny_audio.segment_frames",
                          f"must be >= 2 (mel frames) or absent (whole clips), got {stage.segment_frames}")
    out = Path(model.audio_path)
    if out.exists():
        log(f"[video_dit] audio codec: {out} exists")
        return
    log(f"[video_dit] audio codec: training on {stage.data} -> {out} ({stage.steps} + {stage.vocoder_steps} steps)")
    recipe = dataclasses.asdict(stage)  # every other field is a codec_stage keyword of that name
    sound.codec_stage(recipe.pop("data"), out, preset=model.preset, **recipe)


def check_paths(job) -> None:
    """File-system checks of a parsed job; `ConfigError` naming the key."""
    p = job.process
    preset = get_preset(p.model.preset)
    for i, d in enumerate(p.datasets):
        d.check_divisibility(preset.divisibility)
    m = p.model
    for key in ("vae_path", "text_encoder_path", "tokenizer_path"):
        value = getattr(m, key)
        if value is not None and preset_name(value) is None and not Path(value).exists():
            raise ConfigError(f"{PROCESS}.model.{key}", f"{value!r} does not exist")
    if not available(m.attention_backend):  # an optional kernel asked for and not installed
        raise ConfigError(f"{PROCESS}.model.attention_backend", missing_backend(m.attention_backend))
    spec = check_sources(spec_of_job(p))  # every part found, or refused naming its key (video_dit/spec.py)
    plan = plan_experts(p, preset)  # two-expert presets: the folder holds the experts asked for (train/experts.py)
    if plan is not None and p.train.validation_config is not None:
        for s in p.train.validation_config.validation_sigmas:
            if expert_at(1000.0 * s, plan.boundary) not in plan.sources:
                raise ConfigError(f"{PROCESS}.train.validation_config.validation_sigmas",
                                  f"sigma {s:g} is the {expert_at(1000.0 * s, plan.boundary)} expert's, but "
                                  f"{m.name_or_path!r} holds one expert; accepted: sigmas on its side of "
                                  f"{plan.boundary:g}, or a two-expert folder")
    check_image_encoder(spec)
    if p.sample is not None and not p.train.disable_sampling:
        try:
            job_scheduler(p)  # a diffusers folder's scheduler config the previews would follow
        except ValueError as exc:
            raise ConfigError(f"{PROCESS}.model.name_or_path", str(exc)) from exc
        family = spec.family
        last = family.last_frame(preset.dit, p.i2v_mode)
        # every sample without the frames the DiT needs, named at once (the ai-toolkit arch's words too)
        check_preview_frames(preset, p.i2v_mode, [(s.ctrl_img is not None, s.ctrl_img_2 is not None)
                                                   for s in p.sample.samples], f"{PROCESS}.sample.samples")
        for i, s in enumerate(p.sample.samples):
            for key in ("ctrl_img", "ctrl_img_2"):
                _check_image(getattr(s, key), f"{PROCESS}.sample.samples[{i}].{key}")
            if s.ctrl_img_2 is not None and (last == "no" or s.ctrl_img is None):
                raise ConfigError(f"{PROCESS}.sample.samples[{i}].ctrl_img_2",
                                  f"a last frame (ctrl_img_2) needs ctrl_img and a first-last-frame model; preset "
                                  f"{preset.name!r} takes {'one image' if p.i2v_mode == 'concat' else 'no last frame'}"
                                  f"; accepted: no ctrl_img_2, or a preset among {', '.join(last_frame_presets())}")
    v = p.train.validation_config
    if v is not None and v.validation_items and not any(d.validation_split > 0 for d in p.datasets):
        found = [it for it in v.validation_items if it.image_path and Path(it.image_path).is_file()]
        for i, it in enumerate(v.validation_items):
            if it not in found:
                print(f"[video_dit] warning: {PROCESS}.train.validation_config.validation_items[{i}]: "
                      f"{it.image_path or '(no image_path)'}: no such file; skipped", file=sys.stderr)
        if not found:
            raise ConfigError(f"{PROCESS}.train.validation_config.validation_items",
                              "no item's image_path is a file; fix the paths, add a dataset's validation_split, "
                              "or remove validation_config")
    elif v is not None and not v.validation_items and not any(d.validation_split > 0 for d in p.datasets):
        raise ConfigError(f"{PROCESS}.train.validation_config", "no validation data: give validation_items "
                                                                "or a dataset's validation_split")
    if p.save.resume not in ("auto", "none") and not Path(p.save.resume).is_dir():
        raise ConfigError(f"{PROCESS}.save.resume", f"{p.save.resume!r} is not a checkpoint folder; accepted: "
                                                    "auto, none or a checkpoint folder")
    mixed = mixed_outputs(job.out_dir, "video_dit")  # ai-toolkit's outputs of a job of this name: not mixed
    if mixed is not None:
        raise ConfigError("config.name", mixed)
    out = Path(p.training_folder)
    probe = out
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir() or not os.access(probe, os.W_OK | os.X_OK):
        raise ConfigError(f"{PROCESS}.training_folder", f"{p.training_folder!r} is not writable (checked {probe})")
    if p.deepspeed.config is not None:
        p.deepspeed.extra()


def _check_image(path: str | None, key: str) -> None:
    """A preview's control image must exist and decode (`ConfigError` naming the key and the file)."""
    if path is None:
        return

    if not Path(path).is_file():
        raise ConfigError(key, f"{path!r}: no such image file")
    try:
        load_image(path)
    except MediaError as exc:
        raise ConfigError(key, f"{path!r}: cannot be read as an image ({exc.reason}); accepted: a PNG, JPEG or "
                               "WebP file") from exc


def check_resume(job) -> None:
    """The checkpoint a relaunch would resume (`save.resume`): `ConfigError` when the job changes what a
    resumed run cannot change about its LR schedule (`engine.schedule_change`; train.steps may change)."""
    resume = job.process.save.resume
    if resume == "none":
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the trainer warns about a stale `latest` itself
        path = ckpt.find_latest(job.out_dir / "checkpoints") if resume == "auto" else Path(resume)
    meta = path / ckpt.META if path is not None else None
    if meta is None or not meta.is_file():
        return
    change = schedule_change(json.loads(meta.read_text()), job.process.train)
    if change is not None:
        raise ConfigError(f"{PROCESS}.train.{change[0]}", f"{change[1]} (checkpoint {path})")


def check_data(job, log=print):
    """Scan the job's datasets as the trainer will (`scan_datasets`; `DataError` when unusable) and
    remove the partial cache files of an interrupted run. Returns the scan."""
    p = job.process
    any_i2v = any(d.do_i2v for d in p.datasets)
    # quiet: the trainer prints the summary and one warning per skipped file at start-up
    scan = scan_datasets(p.datasets, get_preset(p.model.preset).divisibility, verbose=False,
                         i2v_mode=p.i2v_mode if any_i2v else None)
    files, size = remove_partial_files(scan)
    if files:
        log(f"[video_dit] removed {files} partial cache file(s) ({size / 2 ** 20:.1f} MiB) left by an "
            "interrupted run")
    return scan


def validate_file(path: str, do_prepare: bool = False, log=print):
    """The parsed `TrainJob` of `path`, after the optional set-up stages and all checks."""
    raw = read_yaml(path)
    if do_prepare:
        prepare(raw if isinstance(raw, dict) else {}, log=log)
    job = parse_job(raw, str(path))
    check_paths(job)
    check_resume(job)
    check_data(job, log=log)
    return job


def memory_check(job, launcher_args: list[str], log=print) -> None:
    """Print the job's memory plan for the ranks `launch/train.sh` will start (`launcher_args`: its
    extra DeepSpeed launcher arguments) and apply `deepspeed.memory_check`: a bucket predicted not to
    fit is a `ConfigError` naming that key (refuse), a warning (warn), or not planned at all (off)."""
    mode = job.process.deepspeed.memory_check
    if mode == "off":
        return

    key = f"{PROCESS}.deepspeed.memory_check"
    try:
        table, failures = preflight(job, launcher_args)
    except PlanError as exc:
        raise ConfigError(key, f"the memory plan could not be made: {exc}") from exc
    log(table)
    if not failures:
        return
    what = "\n  ".join(failures)
    if mode == "refuse":
        raise ConfigError(key, f"predicted not to fit, before any weights were loaded:\n  {what}\n"
                               f"set {key}: warn (or off) to start anyway")
    log(f"[video_dit] warning: predicted not to fit ({key}: warn):\n  {what}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m video_dit.train.validate", description=__doc__.splitlines()[0])
    parser.add_argument("config", help="job YAML")
    parser.add_argument("--prepare", action="store_true", help="run the job's prepare: stages first")
    parser.add_argument("--plan", action="store_true", help="print the memory plan for the ranks train.sh starts "
                                                            "and apply deepspeed.memory_check")
    parser.add_argument("launcher", nargs="*", help="train.sh's extra DeepSpeed launcher arguments (--plan)")
    args = parser.parse_args(argv)

    log = lambda m: print(m, file=sys.stderr)  # noqa: E731
    try:
        job = validate_file(args.config, args.prepare, log=log)
        if args.plan:
            memory_check(job, args.launcher, log=log)
    except (ConfigError, DataError) as exc:
        print(f"config error in {args.config}: {exc}", file=sys.stderr)
        return 2
    print(summary_line(args.config, job), file=sys.stderr)
    return 0


def summary_line(config: str, job) -> str:
    """The one line a job that passed validation gets."""
    p = job.process
    kind = f"LoRA rank {p.network.linear}" if p.network else "full fine-tune"
    return (f"[video_dit] {config}: OK ({job.name}: {p.model.name_or_path}, {kind}, ZeRO-{p.deepspeed.zero_stage}, "
            f"{p.train.steps} steps -> {job.out_dir})")


if __name__ == "__main__":
    sys.exit(main())
