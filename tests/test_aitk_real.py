"""Opt-in: the adapter inside a real ai-toolkit checkout, through ai-toolkit's own code.

    AITK_PATH=/path/to/ai-toolkit [AITK_PYTHON=/path/to/its/venv/bin/python] ./launch/test.sh tests/test_aitk_real.py

AITK_PATH is a checkout with its requirements installed in AITK_PYTHON's environment (default: this
interpreter), where `video_dit` must import too (this repository is put on PYTHONPATH). The test
registers the extension (`video-dit aitk-install`, which writes AITK_PATH/extensions/video_dit),
resolves `arch: video_dit` through ai-toolkit's `get_model_class`, and runs `run.py` on a job that
loads `preset:tiny` and trains one LoRA step on CPU (aitk-contract.md section 7), rendering one MP4
preview; then the LoRA file it saved must be our trainer's format. Skipped (with this reason) otherwise.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml

AITK_PATH = os.environ.get("AITK_PATH")
pytestmark = pytest.mark.skipif(
    not AITK_PATH, reason="opt-in: set AITK_PATH to an ai-toolkit checkout with its requirements installed "
                          "(and AITK_PYTHON to that environment's python) to run the adapter in ai-toolkit's trainer")

REPO = Path(__file__).resolve().parents[1]


def run_aitk(args, cwd, timeout):
    python = os.environ.get("AITK_PYTHON", sys.executable)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2"), "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run([python, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"{' '.join(map(str, args))} failed:\n{out.stdout[-6000:]}\n{out.stderr[-6000:]}"
    return out.stdout + out.stderr  # tqdm writes the progress (and the loss) to stderr


def test_one_lora_step_and_a_preview_through_ai_toolkit():
    # a private folder: this runs for minutes, and pytest prunes old basetemp folders of other sessions
    with tempfile.TemporaryDirectory(prefix="aitk_real_") as tmp:
        one_lora_step_and_a_preview(Path(tmp))


def one_lora_step_and_a_preview(tmp_path: Path):
    from video_dit.commands.aitk_install import install
    from video_dit.data.demo import make_demo_data
    from video_dit.lora import add_lora, load_lora, save_lora
    from video_dit.models.loading import load_dit, read_state_dict

    aitk = Path(AITK_PATH).resolve()
    install(aitk)
    resolved = run_aitk(["-c", "from toolkit.config_modules import ModelConfig\n"
                               "from toolkit.util.get_model import get_model_class\n"
                               "c = get_model_class(ModelConfig(arch='video_dit', name_or_path='preset:tiny'))\n"
                               "print('RESOLVED', c.__module__, c.__name__)"], cwd=aitk, timeout=900)
    assert "RESOLVED video_dit.integrations.ai_toolkit.model VideoDiTModel" in resolved

    data = tmp_path / "data"
    make_demo_data(data, count=2, frames=9, size=32, holdout=1)
    ctrl = next((data / "holdout").glob("*.png"))
    job = {"job": "extension", "meta": {"name": "aitk_step", "version": "1.0"}, "config": {
        "name": "aitk_step",
        "process": [{
            "type": "sd_trainer", "training_folder": str(tmp_path / "out"), "device": "cpu",
            "network": {"type": "lora", "linear": 4, "linear_alpha": 4},
            "save": {"dtype": "float32", "save_every": 1, "max_step_saves_to_keep": 1},
            "datasets": [{"folder_path": str(data), "caption_ext": "txt", "num_frames": 9,
                          "shrink_video_to_frames": True, "fps": 16, "do_i2v": True, "resolution": [32],
                          "cache_latents_to_disk": True, "num_workers": 0}],
            "train": {"batch_size": 1, "steps": 1, "lr": 1e-3, "optimizer": "adamw", "dtype": "fp32",
                      "noise_scheduler": "flowmatch", "timestep_type": "shift", "gradient_checkpointing": False,
                      "skip_first_sample": True},
            "model": {"arch": "video_dit", "name_or_path": "preset:tiny", "quantize": False, "quantize_te": False},
            "sample": {"sample_every": 1, "width": 64, "height": 64, "num_frames": 7, "fps": 8, "sample_steps": 2,
                       "guidance_scale": 1.0, "seed": 1, "neg": "",
                       "samples": [{"prompt": "a shape moving", "ctrl_img": str(ctrl)}]},
        }]}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    log = run_aitk(["run.py", str(tmp_path / "job.yaml")], cwd=aitk, timeout=3600)
    losses = [float(v) for v in re.findall(r"loss: ([-+0-9.e]+)", log)]  # ai-toolkit's progress bar
    assert losses and all(math.isfinite(v) for v in losses), log[-3000:]

    out = tmp_path / "out" / "aitk_step"
    lora_file = out / "aitk_step.safetensors"
    assert lora_file.is_file(), sorted(p.name for p in out.iterdir())
    saved = read_state_dict(lora_file)
    reference = save_lora(tmp_path / "ours.safetensors", add_lora(load_dit("preset:tiny"), rank=4), alpha=4)
    assert set(saved) == set(read_state_dict(reference))  # the DeepSpeed trainer's export format
    load_lora(lora_file, load_dit("preset:tiny"))
    previews = list((out / "samples").glob("*.mp4"))
    assert previews, sorted(p.name for p in (out / "samples").iterdir())
    from video_dit.media import probe_video

    assert probe_video(previews[0]).num_frames == 5  # 7 snapped to 4k + 1
