"""Bad input gets one clear error (or a skip), never a traceback from deep inside torch or a silent default.

- config: `python -m video_dit.train.validate` (what `launch/train.sh` runs before any rank) exits 2 with
  one line naming the key path and what is accepted;
- weights: another model's checkpoint, a truncated safetensors file, a `.pth` holding pickled objects
  (refused, never unpickled), a LoRA for another model: `WeightsError` naming the file and keys;
- media: corrupt, truncated, zero-length, wrong-extension, too-short, huge-resolution videos and images:
  skipped with one warning naming the file, counted in the summary; captions in another encoding are
  read (UTF-16, cp1252) with one warning naming the file.
Plus the security checks that can fail meaningfully: configs are parsed with `yaml.safe_load` (no
Python objects from tags), and no code path builds a shell command.
"""

from __future__ import annotations

import copy
import io
import re
import struct
import warnings
import zlib
from pathlib import Path

import helpers
import numpy as np
import pytest
import torch
import yaml
from PIL import Image

from video_dit.families.wan.dit import LORA_TARGETS as WAN_LORA_TARGETS
from video_dit.families.wan.dit import VideoDiT

ROOT = Path(__file__).resolve().parents[1]
PROCESS = "config.process[0]"


# ---------------------------------------------------------------- config

@pytest.fixture()
def good_job(tmp_path) -> dict:
    data = tmp_path / "data"
    data.mkdir()
    Image.new("RGB", (32, 32), (200, 10, 10)).save(data / "a.png")
    (data / "a.txt").write_text("a red square")
    (tmp_path / "base.safetensors").write_bytes(b"")  # trained weights as far as validation looks (never loaded)
    return {"job": "extension", "config": {"name": "j", "process": [{
        "type": "sd_trainer", "training_folder": str(tmp_path / "out"),
        "network": {"type": "lora", "linear": 4},
        "datasets": [{"folder_path": str(data), "resolution": [32]}],
        "train": {"steps": 3},
        "model": {"arch": "video_dit", "name_or_path": str(tmp_path / "base.safetensors"), "preset": "tiny"},
        "sample": {"width": 32, "height": 32, "samples": [{"prompt": "x", "ctrl_img": str(data / "a.png")}]},
    }]}}


def _set(job: dict, path: str, value) -> dict:
    job = copy.deepcopy(job)
    node = job["config"]["process"][0]
    *parents, last = re.split(r"\.(?![^\[]*\])", path)
    for p in parents:
        m = re.fullmatch(r"(\w+)\[(\d+)\]", p)
        node = node[m.group(1)][int(m.group(2))] if m else node.setdefault(p, {})
    node[last] = value
    return job


def _blocker(tmp_path) -> str:
    (tmp_path / "a_file").write_text("not a folder")
    return str(tmp_path / "a_file" / "out")


@pytest.mark.parametrize("key, value, accepted", [
    ("train.stepz", 3, "did you mean 'steps'"),                                   # unknown key
    ("train.steps", "many", "expected an integer, got 'many'"),                    # wrong type
    ("deepspeed.zero_stage", 4, "accepted: 0, 1, 2, 3"),
    ("datasets[0].num_frames", 0, "must be >= 1 (a t k + 1 count"),
    ("datasets[0].resolution", [8], "below the model's divisibility 16; use a multiple of 16"),
    ("network.linear", 0, "LoRA rank must be a positive integer"),
    ("deepspeed.sequence_parallel_size", 3, "does not divide the model's 4 attention heads; accepted: 1, 2, 4"),
    ("datasets[0].folder_path", "/nonexistent/clips", "is not a directory"),
    ("datasets[0].folder_path", "EMPTY", "holds no video or image"),
    ("training_folder", "BLOCKED", "is not writable"),
    ("sample.samples[0].ctrl_img", "/nonexistent/first_frame.png", "no such image file"),
    ("train.validation_config.validation_sigmas", [0.5, 1.5], "must be in (0, 1]"),
    ("train.validation_config.validation_sigmas", [0.0], "must be in (0, 1]"),
    ("train.validation_config.validation_items", [{"image_path": "/nonexistent/clip.mp4", "prompt": "x"}],
     "no item's image_path is a file"),
    ("train.ema_config.ema_decay", 1.0, "must be in [0, 1)"),
    ("train.ema_config.ema_decay", -0.1, "must be in [0, 1)"),
    ("train.compile", "maybe", "accepted: auto, true, false"),
    ("model.attention_backend", "sage", "has no backward, so it cannot train"),
    ("model.attention_backend", "flash3", "needs the flash_attn_interface package, which is not installed"),
])
def test_bad_config_exits_2_naming_the_key_before_any_rank(good_job, tmp_path, capsys, key, value, accepted):
    assert helpers.validate(tmp_path, good_job, capsys)[0] == 0
    if value == "EMPTY":
        value = str(tmp_path / "empty")
        Path(value).mkdir()
        (Path(value) / "notes.txt").write_text("captions without media")
    if value == "BLOCKED":
        value = _blocker(tmp_path)
    rc, err = helpers.validate(tmp_path, _set(good_job, key, value), capsys)
    assert rc == 2, err
    line = err.strip().splitlines()[-1]
    assert f"{PROCESS}.{key}" in line and accepted in line, line
    assert "Traceback" not in err


def test_configs_load_with_safe_load_only(tmp_path, capsys):
    from video_dit.train.config import read_yaml
    from video_dit.typed_config import ConfigError

    marker = tmp_path / "pwned"
    path = tmp_path / "evil.yaml"
    path.write_text(f"job: !!python/object/apply:pathlib.Path.touch [!!python/object/apply:pathlib.Path "
                    f"['{marker}']]\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        read_yaml(path)
    assert not marker.exists()


def test_no_shell_and_no_eval_in_the_package():
    """No `shell=True`, `os.system`, `os.popen`, `eval(` or `exec(` anywhere in video_dit/ or launch/."""
    bad = re.compile(r"shell\s*=\s*True|os\.system\(|os\.popen\(|(?<![\w.])eval\(|(?<![\w.])exec\(")
    hits = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}"
            for p in sorted([*ROOT.glob("video_dit/**/*.py"), *ROOT.glob("launch/*.py")])
            for i, line in enumerate(p.read_text().splitlines(), 1) if bad.search(line)]
    assert not hits, hits
    # every torch.load in the package reads tensors only (weights_only=True)
    loads = [f"{p.relative_to(ROOT)}:{i}" for p in sorted(ROOT.glob("video_dit/**/*.py"))
             for i, line in enumerate(p.read_text().splitlines(), 1)
             if "torch.load(" in line and "weights_only=True" not in line]
    assert not loads, loads


def test_train_sh_never_interpolates_the_config_path_into_a_shell(good_job, tmp_path):
    """A config path holding shell syntax is passed as one argument: refused as a bad config, not run."""
    import os
    import subprocess

    path = tmp_path / "job $(touch PWNED) `touch PWNED2`; touch PWNED3.yaml"
    path.write_text(yaml.safe_dump(_set(good_job, "deepspeed.zero_stage", 4)))
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    proc = subprocess.run(["bash", str(ROOT / "launch/train.sh"), str(path)], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"{PROCESS}.deepspeed.zero_stage" in proc.stderr and str(path) in proc.stderr
    assert not list(tmp_path.glob("PWNED*")) and not (tmp_path / "out").exists()


# ---------------------------------------------------------------- weights

def _tiny_dit(**changes):
    return helpers.preset_dit("tiny", **changes)


def test_weights_of_another_model_name_the_file_and_keys(tmp_path):
    from safetensors.torch import save_file

    from video_dit.families import get_preset
    from video_dit.families.wan.loading import load_dit
    from video_dit.models.weights import WeightsError, check_matches_preset

    other = tmp_path / "other_model.safetensors"
    save_file({k: v.contiguous() for k, v in _tiny_dit(num_layers=5, ffn_dim=256).state_dict().items()}, str(other))
    dit = load_dit(str(other))  # a consistent checkpoint on its own ...
    with pytest.raises(WeightsError) as err:  # ... but not the preset the job names
        check_matches_preset(dit, get_preset("tiny"), str(other), VideoDiT)
    msg = str(err.value)
    assert "other_model.safetensors (model.preset: tiny)" in msg
    assert "unexpected: blocks.4." in msg and re.search(r"wrong shape: blocks\.0\.ffn\.0\.weight: file \(256, 128\) "
                                                        r"vs model \(384, 128\)", msg), msg
    check_matches_preset(load_dit("preset:tiny"), get_preset("tiny"), "preset:tiny", VideoDiT)  # the right one passes


def test_truncated_safetensors_names_the_file(tmp_path):
    from safetensors.torch import save_file

    from video_dit.families.wan.loading import load_dit, load_vae
    from video_dit.models.weights import WeightsError

    good = tmp_path / "good.safetensors"
    save_file({k: v.contiguous() for k, v in _tiny_dit().state_dict().items()}, str(good))
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    for load in (load_dit, load_vae):
        with pytest.raises(WeightsError, match=r"cut\.safetensors: not a readable safetensors file"):
            load(str(cut))


class _Payload:
    """Unpickling this creates a file: the proof that a loader ran code from a checkpoint."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def test_pth_with_pickled_objects_is_refused_unexecuted(tmp_path):
    from video_dit.families.wan.loading import load_dit, load_vae
    from video_dit.models.weights import WeightsError, read_state_dict

    marker = tmp_path / "code_ran"
    evil = tmp_path / "evil.pth"
    torch.save({"patch_embedding.weight": torch.zeros(1), "x": _Payload(marker)}, evil)
    for load in (read_state_dict, load_dit, load_vae):
        with pytest.raises(WeightsError, match=r"evil\.pth: refused: not a tensors-only checkpoint"):
            load(str(evil))
    assert not marker.exists()


def test_lora_for_another_model_names_the_file_and_keys(tmp_path):
    from video_dit.lora import add_lora, load_lora, save_lora
    from video_dit.models.weights import WeightsError

    path = save_lora(tmp_path / "other_lora.safetensors", add_lora(_tiny_dit(ffn_dim=256), 4, 4, targets=WAN_LORA_TARGETS), 4)
    with pytest.raises(WeightsError) as err:
        load_lora(path, add_lora(_tiny_dit(), 4, 4, targets=WAN_LORA_TARGETS))
    msg = str(err.value)
    assert "other_lora.safetensors" in msg and "blocks.0.ffn.0.lora_B" in msg, msg


# ---------------------------------------------------------------- media

def _png_with_size(path: Path, width: int, height: int) -> None:
    """A tiny PNG whose header claims `width x height` (CRC fixed): cheap to write, huge to decode."""
    buf = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buf, "PNG")
    b = bytearray(buf.getvalue())
    b[16:24] = struct.pack(">II", width, height)
    b[29:33] = struct.pack(">I", zlib.crc32(bytes(b[12:29])) & 0xFFFFFFFF)
    path.write_bytes(bytes(b))


def test_bad_media_are_skipped_named_and_counted(tmp_path, monkeypatch, capsys):
    from video_dit import media
    from video_dit.data import dataset as ds
    from video_dit.data.dataset import DatasetConfig, DataWarning, scan_dataset
    from video_dit.typed_config import parse

    d = tmp_path / "clips"
    d.mkdir()
    rng = np.random.default_rng(0)

    def clip(name, frames=9, size=32):
        return media.write_video(rng.integers(0, 255, (frames, size, size, 3), dtype=np.uint8), d / name, fps=8)

    good = clip("good.mp4").read_bytes()
    clip("good2.mp4")
    Image.new("RGB", (32, 32), (0, 90, 0)).save(d / "good.png")
    png = (d / "good.png").read_bytes()
    bad = {
        "corrupt.mp4": "not a readable video", "truncated.mp4": "truncated or corrupt", "zero.mp4": "empty file",
        "png_named.mp4": "no frame count", "video_named.png": "not a readable image",
        "short.mp4": "3 frames < num_frames 9", "corrupt.png": "not a readable image",
        "truncated.png": "not a readable image", "zero.png": "empty file", "bomb.png": "huge resolution",
        "wide.mp4": "huge resolution 64x64",
    }
    (d / "corrupt.mp4").write_bytes(rng.integers(0, 255, 4000, dtype=np.uint8).tobytes())
    (d / "truncated.mp4").write_bytes(good[: len(good) // 2])
    (d / "zero.mp4").write_bytes(b"")
    (d / "png_named.mp4").write_bytes(png)
    (d / "video_named.png").write_bytes(good)
    clip("short.mp4", frames=3)
    (d / "corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(200))
    (d / "truncated.png").write_bytes(png[: len(png) // 2])
    (d / "zero.png").write_bytes(b"")
    _png_with_size(d / "bomb.png", 40000, 40000)  # beyond PIL's own decompression-bomb limit
    clip("wide.mp4", size=64)  # over MAX_PIXELS as lowered below (a real 10k-pixel video is too big to write)
    monkeypatch.setattr(ds, "MAX_PIXELS", 48 * 48)
    clip("utf16.mp4")
    (d / "utf16.txt").write_bytes("un clip étrange".encode("utf-16"))
    clip("latin1.mp4")
    (d / "latin1.txt").write_bytes("café au lait".encode("latin-1"))
    (d / "good.txt").write_text("a good clip", encoding="utf-8")

    cfg = parse(DatasetConfig, {"folder_path": str(d), "num_frames": 9, "resolution": [32]}, "datasets[0]")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scan = scan_dataset(cfg, 16)
    skipped = {Path(p).name: reason for p, reason in scan.skipped}
    assert set(skipped) == set(bad), skipped
    for name, why in bad.items():
        assert why in skipped[name], (name, skipped[name])
    messages = [str(w.message) for w in caught if w.category is DataWarning]
    for name in bad:  # one warning per file, naming it
        assert sum(f"{name}: skipped" in m for m in messages) == 1, name
    assert all("Errno" not in r for r in skipped.values())  # FFmpeg's errno numbers mean nothing to a user
    # captions in other encodings are read (UTF-16 by its byte-order mark, else cp1252), one warning each
    items = {Path(it.path).name: it.caption for it in scan.items}
    assert items == {"good.mp4": "a good clip", "good.png": "a good clip", "good2.mp4": "", "utf16.mp4": "un clip étrange",
                     "latin1.mp4": "café au lait"}
    for name, enc in (("utf16", "utf-16"), ("latin1", "cp1252")):
        assert sum(f"caption {name}.txt is not UTF-8" in m and f"read as {enc}" in m for m in messages) == 1
    summary = capsys.readouterr().out
    assert f"5 items in 2 buckets, {len(bad)} files skipped" in summary and "huge resolution" in summary


# ---------------------------------------------------------------- Wan 2.1 I2V / FLF2V (CLIP image branch)

@pytest.fixture()
def clip_job(good_job, tmp_path) -> dict:
    """A valid job on the tiny Wan 2.1 I2V-style preset (concat + CLIP): a full fine-tune (LoRA on a random
    preset is refused) on one clip (a concat i2v model skips stills)."""
    from video_dit import media

    clips = tmp_path / "clips"
    clips.mkdir()
    media.write_video(np.zeros((5, 32, 32, 3), np.uint8), clips / "c.mp4", fps=8)
    job = _set(good_job, "model.name_or_path", "preset:tiny-clip-i2v")
    process = job["config"]["process"][0]
    del process["network"], process["model"]["preset"]  # name_or_path names the preset
    process["datasets"][0].update(folder_path=str(clips), num_frames=5, do_i2v=True)
    return job


def test_a_concat_i2v_job_skips_its_stills_and_refuses_a_lora_on_its_preset(clip_job, tmp_path, capsys):
    """The decisions the ai-toolkit arch makes too (tests/test_aitk_adapter.py), here before any rank
    starts: stills beside the clips pass (the trainer skips them with one warning at start-up); a folder
    of stills only leaves nothing to train (exit 2, naming why); a LoRA on the random preset exits 2
    naming network and model.name_or_path."""
    clips = Path(clip_job["config"]["process"][0]["datasets"][0]["folder_path"])
    Image.new("RGB", (32, 32), (10, 200, 10)).save(clips / "still.png")
    assert helpers.validate(tmp_path, clip_job, capsys)[0] == 0
    (clips / "c.mp4").unlink()
    rc, err = helpers.validate(tmp_path, clip_job, capsys)
    assert rc == 2 and "no usable item" in err and "still.png: still of a do_i2v dataset, skipped by a concat " \
                                                    "image-to-video model" in err, err
    rc, err = helpers.validate(tmp_path, _set(clip_job, "network", {"type": "lora", "linear": 4}), capsys)
    line = err.strip().splitlines()[-1]
    assert rc == 2 and f"{PROCESS}.network: LoRA on 'preset:tiny-clip-i2v' trains nothing" in line, line
    assert f"{PROCESS}.model.name_or_path" in line, line


def _corrupt_png(tmp_path) -> str:
    path = tmp_path / "corrupt_first.png"
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(64))
    return str(path)


def _wrong_width_clip(tmp_path) -> str:
    from safetensors.torch import save_file

    from video_dit.families.wan.image_encoder import ImageEncoderConfig, build_clip_vision

    model = build_clip_vision(ImageEncoderConfig(hidden_size=48, intermediate_size=96, num_layers=2, num_heads=2,
                                                 image_size=32, patch_size=8))
    path = tmp_path / "clip_vision_l.safetensors"
    save_file({f"vision_model.{k}": v.contiguous() for k, v in model.state_dict().items()
               if not k.endswith("position_ids")}, str(path))
    return str(path)


@pytest.mark.parametrize("changes, key, accepted", [
    ({"sample.samples[0].ctrl_img": "CORRUPT"}, "sample.samples[0].ctrl_img", "cannot be read as an image"),
    ({"model.image_encoder_path": "WRONG_WIDTH"}, "model.image_encoder_path",
     "of width 48 with 17 tokens per image; the DiT's image branch reads width 32 x 17 tokens"),
    ({"datasets[0].do_flf2v": True}, "datasets[0].do_flf2v", "cannot take a last frame"),
    ({"datasets[0].do_i2v": False}, "datasets[0].do_i2v", "image-to-video model with an image branch: every "
                                                          "dataset needs do_i2v: true"),
    ({"model.name_or_path": "preset:tiny-clip-flf2v"}, "datasets[0].do_flf2v", "its datasets need do_flf2v: true"),
    ({"model.name_or_path": "preset:tiny-clip-flf2v", "datasets[0].do_flf2v": True}, "sample.samples[0].ctrl_img_2",
     "every preview needs the last frame as ctrl_img_2"),
    ({"sample.samples[0].ctrl_img_2": "GOOD"}, "sample.samples[0].ctrl_img_2", "takes one image"),
])
def test_wan21_image_to_video_bad_input_exits_2(clip_job, tmp_path, capsys, changes, key, accepted):
    assert helpers.validate(tmp_path, clip_job, capsys)[0] == 0
    job = clip_job
    for k, v in changes.items():
        v = {"CORRUPT": _corrupt_png(tmp_path), "WRONG_WIDTH": _wrong_width_clip(tmp_path),
             "GOOD": str(tmp_path / "data/a.png")}.get(v, v) if isinstance(v, str) else v
        job = _set(job, k, v)
    rc, err = helpers.validate(tmp_path, job, capsys)
    assert rc == 2, err
    line = err.strip().splitlines()[-1]
    assert f"{PROCESS}.{key}" in line and accepted in line, line
