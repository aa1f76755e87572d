"""`video-dit inspect-data CONFIG`: what a job's datasets will train on, before renting GPUs.

Reads `config.process[0].datasets` of an ai-toolkit-format job YAML (each entry parsed as a
`DatasetConfig`) and the model preset (`config.process[0].model.preset`, or `name_or_path:
preset:NAME`) for the bucket divisibility. Prints per dataset the counts, the bucket histogram,
every skipped file with its reason (the stills a concat i2v model skips among them), what the
start-up summary notes (media read from sub-folders, stills trained unconditioned, sources smaller
than their resolution with the upscale factor), and how many items are cached / not cached for
this job's VAE, i2v mode and text encoder (the trainer's `job_cache_spaces`, for the encoder dtype
the trainer uses on this machine; when the whole job does not parse, an entry made with any settings
counts). For a model that generates sound (`Family.audio`), per dataset it counts the clips with sound,
silent ones among them (peak below -60 dBFS) and those without an audio stream, reading each clip's track
over its frames' span as the trainer reads it (the dataset's `audio` key applied: a clip with a corrupt
audio stream is listed as skipped). Exit status 1 when a dataset is unusable.
"""

from __future__ import annotations

import argparse
import warnings

import yaml

from video_dit.data.audio import SILENT_DBFS
from video_dit.data.cache import cache_status
from video_dit.data.dataset import DataError, DatasetConfig, scan_dataset
from video_dit.diffusion.conditioning import stills_skipped
from video_dit.families import family_of, get_preset
from video_dit.models.layouts import preset_name as layout_preset_name
from video_dit.spec import i2v_mode_of
from video_dit.train.caches import job_cache_spaces
from video_dit.train.config import parse_job
from video_dit.typed_config import ConfigError, parse

PROCESS = "config.process[0]"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", metavar="CONFIG", help="job YAML (ai-toolkit format: config.process[0].datasets)")
    parser.add_argument("--preset", default=None, help="model preset for the divisibility (default: from the job's model)")


def _process(doc, path: str) -> dict:
    try:
        process = doc["config"]["process"][0]
    except (KeyError, IndexError, TypeError) as exc:
        raise ConfigError(PROCESS, f"{path} has no config.process[0] mapping ({exc!r})") from exc
    if not isinstance(process, dict):
        raise ConfigError(PROCESS, f"expected a mapping, got {type(process).__name__}")
    return process


def preset_name(process: dict) -> str:
    """The preset a job's model names: `model.preset`, `model.model_kwargs.preset`, the web UI's arch tag
    (`model.arch: video_dit:NAME`), or `model.name_or_path: preset:NAME`."""
    model = process.get("model") or {}
    if not isinstance(model, dict):
        raise ConfigError(f"{PROCESS}.model", "expected a mapping")
    kwargs = model.get("model_kwargs") or {}
    tag = str(model.get("arch") or "").partition(":")[2]
    for name in (model.get("preset"), kwargs.get("preset") if isinstance(kwargs, dict) else None, tag):
        if name:
            return str(name)
    nop = str(model.get("name_or_path") or "")
    if layout_preset_name(nop) is not None:
        return layout_preset_name(nop)
    raise ConfigError(f"{PROCESS}.model", "names no preset: set model.preset, model.model_kwargs.preset or "
                                          "name_or_path: 'preset:NAME' (or pass --preset)")


def _bar(n: int, top: int, width: int = 30) -> str:
    return "#" * max(1, round(width * n / top)) if n else ""


def inspect(config_path: str, preset: str | None = None) -> int:
    with open(config_path, encoding="utf-8") as f:
        doc = yaml.safe_load(f)
    process = _process(doc, config_path)
    name = preset or preset_name(process)
    divisibility = get_preset(name).divisibility
    skip_stills = stills_skipped(i2v_mode_of(get_preset(name), None, f"{PROCESS}.model.i2v_mode"))  # as the trainer
    with_sound = family_of(get_preset(name)).audio is not None
    entries = process.get("datasets")
    if not isinstance(entries, list) or not entries:
        raise ConfigError(f"{PROCESS}.datasets", "expected a non-empty list of datasets")
    print(f"model preset {name}: frame sides must be multiples of {divisibility}")
    space = text_space = None
    try:  # the job's own cache versions, when the whole job parses (the datasets alone may)
        space, text_space = job_cache_spaces(parse_job(doc, config_path).process)
    except ConfigError as exc:
        print(f"note: the job does not parse ({exc}); cache counts are for any VAE / text encoder")
    status = 0
    for i, entry in enumerate(entries):
        key = f"{PROCESS}.datasets[{i}]"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                cfg = parse(DatasetConfig, entry, key)
                cfg.fit_frames(get_preset(name).vae.snap_frames, key)  # the clip lengths the model's VAE encodes
                scan = scan_dataset(cfg, divisibility, dataset_index=i, verbose=False, skip_stills=skip_stills,
                                    audio=with_sound)  # a model with sound: the clips' tracks read and counted
            except (ConfigError, DataError) as exc:
                print(f"\ndataset {i}: UNUSABLE: {exc}")
                status = 1
                continue
        for w in caught:
            if "skipped" not in str(w.message):
                print(f"warning: {w.message}")
        print(f"\ndataset {i}: {cfg.folder_path}  (num_frames {cfg.num_frames}, resolution {cfg.resolution}, "
              f"repeats {cfg.num_repeats})")
        print(f"  {len(scan.items)} items, {len(scan.skipped)} files skipped, "
              f"{scan.missing_captions} without caption, {scan.ignored} other files ignored")
        a = scan.audio_counts()
        if with_sound and cfg.is_video and cfg.audio != "off":
            print(f"  sound: {a['sound']} clips with sound ({a['silent']} silent: peak below {SILENT_DBFS:g} dBFS), "
                  f"{a['none']} without an audio stream, {a['corrupt']} with a corrupt audio stream (skipped)")
        counts = scan.bucket_counts()
        top = max(counts.values())
        print("  buckets (F x H x W: items per epoch)")
        for b, n in sorted(counts.items()):
            print(f"    {b[0]:>4} x {b[1]:>4} x {b[2]:>4}: {n:>6} {_bar(n, top)}")
        for p, reason in scan.skipped:
            print(f"  skipped {p}: {reason}")
        for note in scan.notes():
            print(f"  {note}")
        c = cache_status(scan, space, text_space)
        which = "" if c.exact else " (for any settings)"
        print(f"  latents: {c.cached} of {c.items} items cached, {c.items - c.cached} not cached{which}"
              + (f"; {c.failed} failed to decode at a previous caching" if c.failed else ""))
        print(f"  text embeds: {c.captions_cached} of {c.captions} distinct captions cached, "
              f"{c.captions - c.captions_cached} not cached{which}")
    return status


def main(args: argparse.Namespace) -> int:
    try:
        return inspect(args.config, args.preset)
    except (ConfigError, KeyError, OSError, yaml.YAMLError) as exc:
        print(f"error: {exc}")
        return 1
