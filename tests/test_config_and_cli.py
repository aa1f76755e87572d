"""typed_config, presets and the CLI dispatcher: errors name the key and what is accepted."""

import subprocess
import sys
from dataclasses import dataclass, field
from typing import Literal

import pytest

from video_dit.cli import COMMANDS
from video_dit.families import PRESETS, get_preset
from video_dit.typed_config import ConfigError, parse


@dataclass
class _Inner:
    rank: int = 4


@dataclass
class _Job:
    lr: float = 1e-4
    mode: Literal["replace", "concat"] = "replace"
    resolution: list[int] = field(default_factory=lambda: [512])
    net: _Inner | None = None


def test_parse_converts_and_nests():
    job = parse(_Job, {"lr": "2e-4", "resolution": [256, 384], "net": {"rank": 8}}, "train")
    assert job == _Job(lr=2e-4, mode="replace", resolution=[256, 384], net=_Inner(8))


@pytest.mark.parametrize("data,path,fragment", [
    ({"lrr": 1}, "train.lrr", "did you mean 'lr'"),
    ({"mode": "replac"}, "train.mode", "'replace' | 'concat'"),
    ({"resolution": [256, "x"]}, "train.resolution[1]", "expected an integer"),
    ({"net": {"rnk": 2}}, "train.net.rnk", "did you mean 'rank'"),
    ({"lr": True}, "train.lr", "expected a number"),
])
def test_parse_errors_name_the_key_path(data, path, fragment):
    with pytest.raises(ConfigError) as err:
        parse(_Job, data, "train")
    assert err.value.path == path and fragment in str(err.value)


def test_presets_divisibility_and_unknown_name():
    assert get_preset("tiny").divisibility == 16
    assert get_preset("wan2.1-t2v-1.3b").divisibility == 16
    assert get_preset("wan2.2-ti2v-5b").divisibility == 32
    assert get_preset("tiny").dit.num_heads % 2 == 0
    for p in PRESETS.values():
        if p.family == "wan":  # (HunyuanVideo 1.5's configs check themselves: tests/test_hunyuan15_*.py)
            assert p.dit.dim % p.dit.num_heads == 0 and len(p.vae.mean) == len(p.vae.std) == p.vae.z_dim
    with pytest.raises(KeyError, match="did you mean 'tiny'"):
        get_preset("tinny")


def test_cli_lists_every_command_and_rejects_unknown():
    out = subprocess.run([sys.executable, "-m", "video_dit.cli", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and all(name in out.stdout for name in COMMANDS)
    bad = subprocess.run([sys.executable, "-m", "video_dit.cli", "smaple"], capture_output=True, text=True)
    assert bad.returncode == 2 and "invalid choice" in bad.stderr


def test_model_block_accepts_ai_toolkits_text_encoder_key():
    from video_dit.train.config import ModelConfig

    m = parse(ModelConfig, {"name_or_path": "preset:tiny", "te_name_or_path": "models/te"}, "model")
    assert m.text_encoder_path == "models/te"
    with pytest.raises(ConfigError) as err:
        parse(ModelConfig, {"name_or_path": "preset:tiny", "te_name_or_path": "a", "text_encoder_path": "b"}, "model")
    assert err.value.path == "model.te_name_or_path"
