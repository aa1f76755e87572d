"""The job files ai-toolkit's web UI writes, for tests: its starting job (fixtures/aitk_ui_27a03a91.json,
transcribed from ai-toolkit 27a03a91's ui/) with a model picked the way the UI picks one.

`pick` is written from ui/src/app/jobs/new/utils.ts `handleModelArchChange` (27a03a91), step by step;
`set_key` from ui/src/utils/hooks.tsx `setNestedValue` (a path `a.b[0].c`; `undefined` deletes the key:
None here). `add_dataset` is SimpleJob.tsx's "Add Dataset" button (defaultDatasetConfig plus the entry's
`controls`, none of its defaults).
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

FIXTURES = Path(__file__).resolve().parent / "fixtures"
UI = json.loads((FIXTURES / "aitk_ui_27a03a91.json").read_text())


def set_key(obj: dict, path: str, value) -> None:
    """setNestedValue: create missing containers on the way; None (undefined) deletes the last key."""
    parts = [int(i) if i else k for k, i in re.findall(r"([^[.\]]+)|\[(\d+)\]", path)]
    for key, nxt in zip(parts, parts[1:]):
        if isinstance(key, int):
            obj = obj[key]
            continue
        if obj.get(key) is None:
            obj[key] = [] if isinstance(nxt, int) else {}
        obj = obj[key]
    if value is None:
        if isinstance(obj, dict):
            obj.pop(parts[-1], None)
    else:
        obj[parts[-1]] = copy.deepcopy(value)


def _expand(defaults: dict, n: int) -> dict:
    """expandDatasetDefaults: `datasets[x].` -> `datasets[0].` ... `datasets[n-1].`."""
    out = {}
    for key, value in defaults.items():
        if "datasets[x]." in key:
            for i in range(n):
                out[key.replace("datasets[x].", f"datasets[{i}].")] = copy.deepcopy(value)
        else:
            out[key] = value
    return out


def pick(job: dict, current: dict, new: dict) -> dict:
    """The job after picking model entry `new` while `current` is picked (handleModelArchChange)."""
    job = copy.deepcopy(job)
    p = job["config"]["process"][0]
    sections = new.get("additionalSections") or []
    if "model.low_vram" not in sections:
        p["model"]["low_vram"] = False
    if "model.layer_offloading" not in sections:
        for key in ("", "_text_encoder_percent", "_transformer_percent"):
            p["model"].pop("layer_offloading" + key, None)
    elif "layer_offloading" not in p["model"]:
        p["model"].update(layer_offloading=False, layer_offloading_text_encoder_percent=1.0,
                          layer_offloading_transformer_percent=1.0)
    n = len(p["datasets"])
    old_defaults, new_defaults = _expand(current.get("defaults") or {}, n), _expand(new.get("defaults") or {}, n)
    p["model"]["arch"] = new["name"]
    multi, single = "datasets.multi_control_paths" in sections, "datasets.control_path" in sections
    for d in p["datasets"]:
        d["controls"] = list(new.get("controls") or [])
        if multi:
            for i in (1, 2, 3):
                d[f"control_path_{i}"] = d.get(f"control_path_{i}") or None
            if d.get("control_path") and not d["control_path_1"]:
                d["control_path_1"] = d["control_path"]
            d.pop("control_path", None)
        elif single:
            d["control_path"] = d.get("control_path") or None
            if d.get("control_path_1"):
                d["control_path"] = d["control_path_1"]
            for i in (1, 2, 3):
                d.pop(f"control_path_{i}", None)
        else:
            for key in ("control_path", "control_path_1", "control_path_2", "control_path_3"):
                d.pop(key, None)
        if "datasets.num_frames" not in sections:
            d["num_frames"] = 1
        if "datasets.auto_frame_count" not in sections:
            d.pop("auto_frame_count", None)
    if "sample.ctrl_img" not in sections:
        for s in p["sample"]["samples"]:
            s.pop("ctrl_img", None)
    for key, (_, unselected) in old_defaults.items():
        set_key(job, key, unselected)
    for key, (selected, _) in new_defaults.items():
        set_key(job, key, selected)
    return job


def ui_job(entry: dict, folder: str, **process) -> dict:
    """The UI's starting job with `entry` picked, its dataset's folder `folder`, and `process` keys changed
    (a dotted path -> value, as the user would type them in the form)."""
    job = pick(UI["job"], UI["flex1"], entry)
    set_key(job, "config.process[0].datasets[0].folder_path", folder)
    for key, value in process.items():
        set_key(job, f"config.process[0].{key}", value)
    return job


def add_dataset(job: dict, entry: dict, folder: str) -> dict:
    """SimpleJob.tsx "Add Dataset": defaultDatasetConfig with the entry's `controls`, at `folder`."""
    job = copy.deepcopy(job)
    dataset = {**copy.deepcopy(UI["default_dataset"]), "controls": list(entry.get("controls") or []),
               "folder_path": folder}
    job["config"]["process"][0]["datasets"].append(dataset)
    return job
