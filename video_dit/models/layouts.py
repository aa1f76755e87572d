"""Where the parts of a model live: the conventions of model folders and sources, read from the
file system (no tensor is read here).

    preset_name(source)        "NAME" of a `preset:NAME` source (a seeded random init), else None
    read_sources / write_sources   `video_dit_sources.json`: what a full fine-tune export was trained
                               with (preset, VAE, text and image encoders, sampling settings)
    expert_sources(folder)     the two experts' folders of a Wan 2.2 A14B model folder (either layout)
    folder_boundary(folder)    the boundary a diffusers two-expert folder's model_index.json records
    component_dir(folder, ...) one component's folder in a diffusers pipeline folder
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from video_dit.models.weights import WeightsError

PRESET_PREFIX = "preset:"


def preset_name(source: str | os.PathLike | None) -> str | None:
    """The NAME of a `preset:NAME` source (a preset's seeded random init), None for a path."""
    text = str(source) if source is not None else ""
    return text[len(PRESET_PREFIX):] if text.startswith(PRESET_PREFIX) else None


# Written beside full fine-tune weights (our trainer's exports, the ai-toolkit arch's save_model):
# {"preset", "vae", "text_encoder"[, "image_encoder", "audio", "i2v_mode", "sampling", "trainer"]}, so that the
# folder loads and samples alone, from any working directory: both trainers record every path absolute
# (`portable`); a relative path (written by hand, or a folder moved with its parts) is read relative to the
# saved folder (`recorded_path`).
SOURCES_FILE = "video_dit_sources.json"


def portable(path: str | os.PathLike) -> str:
    """`path` as a source file records it: absolute (resolved against the working directory it was given in)."""
    return str(Path(path).absolute())


def recorded_path(folder: str | os.PathLike, path: str) -> str:
    """A path a sources file in `folder` records: as it is when absolute, else relative to `folder`."""
    return path if Path(path).is_absolute() else str(Path(folder) / path)


def read_sources(folder: str | os.PathLike) -> dict:
    """What `SOURCES_FILE` in `folder` records, or {} (no such file, or `folder` is not a folder)."""
    path = Path(folder) / SOURCES_FILE
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise WeightsError(f"{path}: not a readable sources file ({exc})") from exc
    if not isinstance(data, dict):
        raise WeightsError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def write_sources(folder: str | os.PathLike, sources: dict) -> Path:
    path = Path(folder) / SOURCES_FILE
    path.write_text(json.dumps(sources, indent=2) + "\n", encoding="utf-8")
    return path



# What each trainer leaves in a job's folder `<training_folder>/<name>/`, which is ai-toolkit's `save_root` and
# our trainer's output folder alike: ours, its checkpoints and metrics; ai-toolkit, the copy of the job file it
# writes at every start (jobs/process/BaseTrainProcess.py `save_training_config`) and its optimizer state.
# ai-toolkit resumes from any `<name>*` file or folder there (BaseSDTrainProcess.get_latest_save_path), so two
# trainers on one job file would mix their outputs and resume from each other's: each refuses such a folder.
TRAINER_FILES = {"video_dit": ("metrics.jsonl", "checkpoints"), "ai-toolkit": ("config.yaml", "optimizer.pt")}
TRAINER_NAMES = {"video_dit": "video_dit's DeepSpeed trainer", "ai-toolkit": "ai-toolkit (arch: video_dit)"}


def trainer_files(folder: str | os.PathLike, trainer: str) -> list[Path]:
    """The files and folders `trainer` ("video_dit", "ai-toolkit") leaves in a job folder found in `folder`."""
    return [Path(folder) / n for n in TRAINER_FILES[trainer] if (Path(folder) / n).exists()]


def mixed_outputs(folder: str | os.PathLike, trainer: str, also_own: bool = False) -> str | None:
    """Why `trainer` must not write (or resume) in the job folder `folder`: it holds the other trainer's files
    (`also_own`: only when it holds `trainer`'s own too, i.e. both have written there). None when it is its own."""
    other = next(t for t in TRAINER_FILES if t != trainer)
    theirs = trainer_files(folder, other)
    if not theirs or (also_own and not trainer_files(folder, trainer)):
        return None
    return (f"{folder} holds {TRAINER_NAMES[other]}'s outputs ({', '.join(p.name for p in theirs)}): both trainers "
            f"write a job's outputs to <training_folder>/<config.name>/, and {TRAINER_NAMES[trainer]} would mix its "
            "own with them (ai-toolkit resumes from any <name>* file or folder there); give one of the two jobs "
            "another config.name or training_folder")


# Where a two-expert model folder (Wan 2.2 A14B) keeps each expert's weights: diffusers' layout
# (Wan-AI/Wan2.2-*-A14B-Diffusers: `transformer` runs t >= boundary, `transformer_2` the rest) and Wan's own
# (wan/configs/wan_*_A14B.py `high_noise_checkpoint` / `low_noise_checkpoint`).
EXPERT_FOLDERS: dict[str, dict[str, str]] = {
    "diffusers": {"high_noise": "transformer", "low_noise": "transformer_2"},
    "original": {"high_noise": "high_noise_model", "low_noise": "low_noise_model"},
}


def expert_sources(source: str | os.PathLike) -> dict[str, str] | None:
    """{"high_noise": folder, "low_noise": folder} of a two-expert model folder (either layout of
    `EXPERT_FOLDERS`), None for anything else (a one-DiT folder or file, `preset:NAME`). A folder with
    one expert's subfolder of a pair but not the other (`transformer_2/` alone, `high_noise_model/`
    alone) is a `WeightsError` naming the missing one; `transformer/` alone is a one-DiT folder."""
    path = Path(source)
    if preset_name(source) is not None or not path.is_dir():
        return None
    for layout, names in EXPERT_FOLDERS.items():
        present = {e: (path / sub).is_dir() for e, sub in names.items()}
        if all(present.values()):
            return {e: str(path / sub) for e, sub in names.items()}
        if any(present.values()) and not (layout == "diffusers" and present == {"high_noise": True, "low_noise": False}):
            missing = next(sub for e, sub in names.items() if not present[e])
            have = next(sub for e, sub in names.items() if present[e])
            raise WeightsError(f"{path}: has {have}/ but no {missing}/; a two-expert folder holds both "
                               f"({' + '.join(names.values())}/), a one-DiT folder transformer/ alone")
    return None


def expert_seed(seed: int, expert: str) -> int:
    """The random-init seed of one expert of a two-expert `preset:NAME` (so the two differ): `seed` for
    the high-noise expert, `seed + 1` for the low-noise one."""
    return seed + ("high_noise", "low_noise").index(expert)


def folder_boundary(source: str | os.PathLike) -> float | None:
    """The `boundary_ratio` a diffusers two-expert folder's model_index.json records (as diffusers'
    `WanPipeline` reads it), else None."""
    index = Path(source) / "model_index.json"
    if preset_name(source) is not None or not index.is_file():
        return None
    try:
        value = json.loads(index.read_text()).get("boundary_ratio")
    except (OSError, json.JSONDecodeError) as exc:
        raise WeightsError(f"{index}: not a readable JSON file ({exc})") from exc
    return None if value is None else float(value)



def component_dir(path: Path, name: str, download: str, holds: str = "") -> Path:
    """The folder of one component in a diffusers model folder (`path/name`, e.g. text_encoder/), or
    `path` itself when it is that component's folder; it must hold config.json, else a `WeightsError`
    naming `path`, what it should hold (`name`/config.json and `holds`) and how to get it (`download`)."""
    folder = path / name if (path / name).is_dir() else path
    if not (folder / "config.json").is_file():
        raise WeightsError(f"{path}: expected a folder holding {name}/config.json{holds}; {download}")
    return folder



def dit_path(source: str | os.PathLike) -> Path:
    """Where the DiT weights of `source` are: a folder's `transformer/`, else `source` itself."""
    path = Path(source)
    return path / "transformer" if path.is_dir() and (path / "transformer").is_dir() else path


def diffusers_folder(base: Path, part: str) -> str | None:
    """diffusers' layout: `vae/`, `text_encoder/`, `image_encoder/` beside the DiT: the folder itself."""
    return str(base) if (base / part).is_dir() else None
