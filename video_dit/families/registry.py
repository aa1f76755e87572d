"""The model families' registry: which families there are, which presets each has, and which family a
checkpoint is. It knows no family's internals: each family's folder builds its `Family` record
(`contract.py`), and `video_dit.families` registers the built-in ones (Wan, HunyuanVideo 1.5) and any
listed in `VIDEO_DIT_FAMILIES`.

    VIDEO_DIT_FAMILIES="my_pkg.my_family,other.module:THEIRS"   modules imported at start-up; each one's
        `FAMILY` (or the named attribute) is registered: a family added without touching this package
        (the same in every rank a launch starts, since they inherit the environment)

    register(family)            adds a family and its presets (names unique across families)
    get_family(name), family_of(preset), get_preset(name), PRESETS, FAMILIES, vae_family(vae preset)
    identify(source)            (family, evidence) of a DiT checkpoint from its files, no tensor read;
                                `UnknownFamily` naming the source and what it says when no family claims it
"""

from __future__ import annotations

import importlib
import json
import os
from pathlib import Path

from video_dit.families.contract import Family, Preset, lookup_preset
from video_dit.models.layouts import dit_path, preset_name
from video_dit.models.weights import WeightsError, open_weights

FAMILIES: dict[str, Family] = {}
PRESETS: dict[str, Preset] = {}
PLUGINS_ENV = "VIDEO_DIT_FAMILIES"


class UnknownFamily(WeightsError):
    """A checkpoint no registered family claims; the message names the source and what it says."""


def register(family: Family) -> Family:
    """Add `family` and its presets. A name already taken (family or preset) is a ValueError, as is a
    preset whose `family` is not this one's name."""
    if not isinstance(family, Family):
        raise TypeError(f"register() takes a families.contract.Family, got {type(family).__name__}")
    if family.name in FAMILIES and FAMILIES[family.name] is not family:
        raise ValueError(f"model family {family.name!r} is registered already")
    for name, preset in family.presets.items():
        if name != preset.name or preset.family != family.name:
            raise ValueError(f"family {family.name!r}: preset {name!r} (name {preset.name!r}, family "
                             f"{preset.family!r}) must be listed under its own name and family")
        owner = PRESETS.get(name)
        if owner is not None and owner.family != family.name:
            raise ValueError(f"preset {name!r} of family {family.name!r} is already family {owner.family!r}'s")
    FAMILIES[family.name] = family
    PRESETS.update(family.presets)
    return family


def load_plugins(spec: str | None = None) -> list[Family]:
    """Register the families the `VIDEO_DIT_FAMILIES` modules define (`spec`: that variable's value)."""
    spec = os.environ.get(PLUGINS_ENV, "") if spec is None else spec
    added = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        module, _, attr = item.partition(":")
        try:
            family = getattr(importlib.import_module(module), attr or "FAMILY")
        except (ImportError, AttributeError) as exc:
            raise ImportError(f"{PLUGINS_ENV}={spec!r}: {item!r}: {exc}; accepted: comma-separated module[:attribute] "
                              "names whose attribute (default FAMILY) is a families.contract.Family") from exc
        added.append(register(family))
    return added


def get_family(name: str) -> Family:
    if name not in FAMILIES:
        raise KeyError(f"unknown model family {name!r}; accepted: {', '.join(FAMILIES)}")
    return FAMILIES[name]


def family_of(preset: Preset) -> Family:
    """The family whose code reads `preset`."""
    return get_family(preset.family)


def get_preset(name: str) -> Preset:
    """The preset called `name`; an unknown name is a KeyError naming the nearest and listing the valid ones."""
    return lookup_preset(PRESETS, name, "every family")


def scheduler_classes() -> dict:
    """The diffusers scheduler classes the registered families sample on their own grids, merged
    (`Family.scheduler_classes`; what `sampling_settings.read_scheduler_config` accepts beyond diffusers' own)."""
    return {name: spec for family in FAMILIES.values() for name, spec in family.scheduler_classes.items()}


def vae_family(vae_preset: str) -> Family:
    """The family whose VAE stage trains the VAE preset `vae_preset` (`Family.vae_stage`); a KeyError
    naming the VAE presets that can be trained otherwise."""
    for family in FAMILIES.values():
        if family.vae_stage is not None and vae_preset in family.vae_presets:
            return family
    known = [n for f in FAMILIES.values() if f.vae_stage is not None for n in f.vae_presets]
    raise KeyError(f"unknown VAE preset {vae_preset!r}; accepted: {', '.join(known)}")


def identify(source) -> tuple[Family, str] | None:
    """(family, the evidence) of a DiT source from its files, reading no tensor: a diffusers folder's
    model_index.json or a config.json's `_class_name` (the DiT folder's, or beside the file), else what a
    family recognises in that config.json (`Family.claims_config`: Tencent's HunyuanVideo config has no
    class name), else the tensor names in its headers (`Family.claims`, the strictest first:
    `claim_order`). None for `preset:NAME` or a path that does not exist; `UnknownFamily` when the files
    are readable and no family claims them."""
    if preset_name(source) is not None:
        return None
    path = Path(source)
    if not path.exists():
        return None
    folder = path if path.is_dir() else path.parent
    dit = dit_path(path)
    config = (dit if dit.is_dir() else dit.parent) / "config.json"
    said = []
    for meta in (folder / "model_index.json", config):
        name = _class_name(meta)
        if name is not None:
            said.append(f"{meta}: _class_name {name!r}")
        for family in FAMILIES.values():
            if name in family.classes:
                return family, f"{meta}: _class_name {name!r}"
    if config.is_file():
        for family in FAMILIES.values():
            if family.claims_config(_read(config)):
                return family, f"{config}: a {family.title} DiT config"
    try:
        meta = open_weights(dit).meta()
    except (WeightsError, OSError, ValueError):
        if said:
            raise UnknownFamily(_unknown(source, said)) from None
        return None  # unreadable: the loader says why, later
    for family in sorted(FAMILIES.values(), key=lambda f: f.claim_order):
        if family.claims(meta):
            shown = ", ".join(sorted(meta)[:3])
            return family, f"{dit}: its tensor names ({shown}, ...)"
    raise UnknownFamily(_unknown(source, said + [f"{dit}: tensor names {', '.join(sorted(meta)[:3])}, ..."]))


def _unknown(source, said: list[str]) -> str:
    known = "; ".join(f.describe() for f in FAMILIES.values())
    return (f"{source}: no model family here reads this checkpoint ({'; '.join(said)}); accepted: a checkpoint of "
            f"one of these families: {known}")


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _class_name(path: Path) -> str | None:
    return _read(path).get("_class_name") if path.is_file() else None
