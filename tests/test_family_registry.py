"""The family registry (video_dit/families/registry.py): a checkpoint no family claims is named, not read
as another family's; `register` keeps preset and family names unique; `VIDEO_DIT_FAMILIES` errors name the
variable. (The contract itself, a family defined inside a test through every front end:
tests/test_family_contract.py.)"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import save_file

from video_dit.cli import main as cli_main
from video_dit.families import FAMILIES, PRESETS, UnknownFamily, get_preset, identify, load_plugins, register
from video_dit.families.registry import PLUGINS_ENV
from video_dit.spec import CLI_KEYS, Request, resolve
from video_dit.typed_config import ConfigError


def _foreign_folder(root):
    """A diffusers-style folder of a family no one here knows: class names and tensor names of its own."""
    (root / "transformer").mkdir(parents=True)
    (root / "model_index.json").write_text(json.dumps({"_class_name": "FooVideoPipeline"}))
    (root / "transformer" / "config.json").write_text(json.dumps({"_class_name": "FooTransformer3DModel",
                                                                 "num_layers": [2, 2]}))
    save_file({"stem.proj.weight": torch.zeros(4, 4), "towers.0.mix.weight": torch.zeros(4)},
              str(root / "transformer" / "diffusion_pytorch_model.safetensors"))
    return root


def test_an_unknown_family_is_named_not_read_as_another(tmp_path, capsys):
    folder = _foreign_folder(tmp_path / "foo")
    with pytest.raises(UnknownFamily) as exc:
        identify(folder)
    message = str(exc.value)
    assert "FooVideoPipeline" in message and "FooTransformer3DModel" in message and str(folder) in message
    assert all(f.title in message for f in FAMILIES.values())  # what is accepted
    with pytest.raises(ConfigError, match="--model .*no model family here reads this checkpoint"):
        resolve(Request(str(folder), preset_required=False), CLI_KEYS)
    # the command: one line, exit 2, no traceback (it used to end in a TypeError reading Wan's config)
    code = cli_main(["sample", "--model", str(folder), "--prompt", "x", "--out", str(tmp_path / "x.mp4")])
    err = capsys.readouterr().err
    assert code == 2 and "no model family here reads this checkpoint" in err and "Traceback" not in err
    # a known family's preset on it: the same refusal (weights of no family are not that preset's)
    with pytest.raises(ConfigError, match="no model family here reads this checkpoint"):
        resolve(Request(str(folder), preset="tiny"), CLI_KEYS)


def test_register_keeps_names_unique():
    tiny = get_preset("tiny")
    wan = FAMILIES["wan"]
    with pytest.raises(ValueError, match="registered already"):
        register(dataclasses.replace(wan))  # another record under a taken name
    impostor = dataclasses.replace(wan, name="impostor", presets={"tiny": tiny})
    with pytest.raises(ValueError, match="must be listed under its own name and family"):
        register(impostor)  # a preset of another family
    mine = dataclasses.replace(tiny, family="impostor")
    with pytest.raises(ValueError, match="already family 'wan'"):
        register(dataclasses.replace(wan, name="impostor", presets={"tiny": mine}))
    assert "impostor" not in FAMILIES and PRESETS["tiny"] is tiny
    with pytest.raises(TypeError, match="families.contract.Family"):
        register(object())


def test_plugin_errors_name_the_variable():
    with pytest.raises(ImportError, match=rf"{PLUGINS_ENV}=.*no_such_module_here.*accepted: comma-separated"):
        load_plugins("no_such_module_here")
    with pytest.raises(ImportError, match=rf"{PLUGINS_ENV}=.*'json:NOPE'"):
        load_plugins("json:NOPE")  # a module without that attribute
    assert load_plugins("") == []
