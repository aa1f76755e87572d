"""Opt-in: the adapter inside a real ai-toolkit checkout, through ai-toolkit's own code.

    AITK_PATH=/path/to/ai-toolkit [AITK_PYTHON=/path/to/its/venv/bin/python] ./launch/test.sh tests/test_aitk_real.py

AITK_PATH is a checkout with its requirements installed in AITK_PYTHON's environment (default: this
interpreter), where `video_dit` must import too (this repository is put on PYTHONPATH). Skipped (with
this reason) otherwise. Written from ai-toolkit 27a03a91's code (the line numbers below are there).

One ai-toolkit process (`run.py` with three job files, run in order; a driver records every
`scale_loss` call of the arch) on CPU, then checks:
  - registration: `video-dit aitk-install`, and `arch: video_dit` resolves through `get_model_class`;
  - LoRA job (i2v, `linear: 4`, `linear_alpha: 8`, 4 steps): the i2v loss mask was applied to every
    video item (latent frame 0 out of the loss, the loss a masked mean); the saved file is our trainer's
    format with alpha = rank, the scale ai-toolkit trained with (for a peft-format transformer LoRA it
    forces alpha = rank: toolkit/lora_special.py L428-433), and `video-dit sample --lora` renders what
    the base with B @ A merged at that scale renders (and not what scale alpha/rank = 2 would);
  - the same job's previews: one sample with `neg`, guidance, steps, size, seed and frame count left at
    ai-toolkit's defaults (toolkit/config_modules.py SampleConfig: neg False, guidance 7, 20 steps,
    512 x 512, 1 frame) renders an image; one video sample renders an MP4 of 4k + 1 frames;
  - full fine-tune job (2 steps, then the same job at 3 steps): the saves load alone with `load_dit`,
    and the second run resumes from the step-2 save (BaseSDTrainProcess L1757-1765 point
    `name_or_path` at it and read its step from `aitk_meta.yaml`, L870-889) and trains on to step 3;
  - the web UI's entries (`video-dit aitk-install`, with its UI files; uninstalled at the end unless the checkout
    had them before): a job made from the `tiny` entry's defaults, as the UI writes it (tests/aitk_ui_job.py:
    ai-toolkit 27a03a91's starting job and model pick; the dataset folder and 2 steps filled in, `device: cpu`)
    trains two steps and renders its 10 default previews as MP4s; a job from the `tiny-clip-i2v` entry's defaults
    is refused at load, naming every sample without a control image and the key, before the data is read;
    with `AITK_PATH/ui/node_modules` installed (`npm install` in ui/), the UI type-checks (`tsc --noEmit`) with
    the entries and patches in;
  - the decisions both trainers share (`video_dit.spec`): a folder written by `make-demo-data` is its
    training clips to ai-toolkit (its recursive scan, toolkit/data_loader.py L437-450: "Found 2
    videos", no held-out clip or first frame); a `do_i2v` folder of clips and stills on
    `preset:tiny-clip-i2v` (concat) trains to the end, its stills skipped with one warning in our
    trainer's words and a loss of exactly 0; and, in a process of its own, a LoRA on `preset:tiny` is
    refused when ai-toolkit attaches the network, naming model.name_or_path and network, before
    ai-toolkit reads the dataset (no `.aitk_size.json`, no `_latent_cache/` in it).
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml

from video_dit.families.wan.dit import LORA_TARGETS as WAN_LORA_TARGETS

AITK_PATH = os.environ.get("AITK_PATH")
pytestmark = pytest.mark.skipif(
    not AITK_PATH, reason="opt-in: set AITK_PATH to an ai-toolkit checkout with its requirements installed "
                          "(and AITK_PYTHON to that environment's python) to run the adapter in ai-toolkit's trainer")

REPO = Path(__file__).resolve().parents[1]
RANK, ALPHA = 4, 8

# Records each VideoDiTModel.scale_loss call (SDTrainer.calculate_loss L921 passes the element-wise
# loss), then runs ai-toolkit's run.py on the job files given.
DRIVER = """
import json, runpy, sys
record, jobs = sys.argv[1], sys.argv[2:]
sys.path.insert(0, ".")
import video_dit.integrations.ai_toolkit.model as m
calls, scale_loss = [], m.VideoDiTModel.scale_loss
def recording(self, loss):
    mask, skipped = self._i2v_loss_mask, self._skip_loss
    out = scale_loss(self, loss)
    row = {"shape": list(loss.shape), "mask": None, "model": self.spec.request.name_or_path, "skipped": skipped,
           "scaled_max": float(out.detach().abs().max())}
    if mask is not None:
        m5 = mask.float().expand_as(loss)
        row.update(mask=mask.float().mean(dim=(0, 1, 3, 4)).tolist(), scaled_mean=float(out.float().mean()),
                   masked_mean=float((loss.float() * m5).sum() / m5.sum()))
    calls.append(row)
    with open(record, "w") as f:
        json.dump(calls, f)
    return out
m.VideoDiTModel.scale_loss = recording
sys.argv = ["run.py", *jobs]
runpy.run_path("run.py", run_name="__main__")
"""


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2"), "CUDA_VISIBLE_DEVICES": ""}


def run_aitk(args, cwd, timeout, fails: bool = False):
    python = os.environ.get("AITK_PYTHON", sys.executable)
    out = subprocess.run([python, *args], cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout)
    assert (out.returncode != 0) == fails, (f"{' '.join(map(str, args))} {'passed' if fails else 'failed'}:\n"
                                            f"{out.stdout[-6000:]}\n{out.stderr[-6000:]}")
    return out.stdout + out.stderr  # tqdm writes the progress (and the loss) to stderr


def video_dit_cli(*args) -> None:
    out = subprocess.run([sys.executable, "-m", "video_dit.cli", *map(str, args)], env=_env(),
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]


def _job(tmp: Path, name: str, process: dict) -> Path:
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"job": "extension", "meta": {"name": name, "version": "1.0"},
                                    "config": {"name": name, "process": [process]}}))
    return path


def _process(tmp: Path, **changes) -> dict:
    process = {
        "type": "sd_trainer", "training_folder": str(tmp / "out"), "device": "cpu",
        "save": {"dtype": "float32", "save_every": 1, "max_step_saves_to_keep": 3},
        "datasets": [{"folder_path": str(tmp / "data"), "caption_ext": "txt", "num_frames": 9,
                      "shrink_video_to_frames": True, "fps": 16, "do_i2v": True, "resolution": [32],
                      "cache_latents_to_disk": True, "num_workers": 0}],
        "train": {"batch_size": 1, "steps": 4, "lr": 1e-2, "optimizer": "adamw", "dtype": "fp32",
                  "noise_scheduler": "flowmatch", "timestep_type": "shift", "gradient_checkpointing": False,
                  "skip_first_sample": True, "disable_sampling": True},
        # the helpers' base: preset:tiny's init with a non-zero head (a zero head passes no gradient to
        # a LoRA on the blocks: the LoRA would stay zero and its scale would decide nothing)
        "model": {"arch": "video_dit", "name_or_path": str(tmp / "base.safetensors"), "vae_path": "preset:tiny",
                  "te_name_or_path": "preset:tiny", "model_kwargs": {"preset": "tiny"}, "quantize": False,
                  "quantize_te": False},
    }
    for key, value in changes.items():
        process[key] = {**process.get(key, {}), **value} if isinstance(value, dict) else value
    return process


@pytest.fixture(scope="module")
def aitk_run():
    """The one ai-toolkit process; yields (tmp folder, its log, the scale_loss records)."""
    sys.path.insert(0, str(Path(__file__).parent))
    import helpers

    from video_dit.commands.aitk_install import uninstall
    from video_dit.data.demo import make_demo_data

    # a private folder: this runs for minutes, and pytest prunes old basetemp folders of other sessions
    with tempfile.TemporaryDirectory(prefix="aitk_real_") as name:
        tmp = Path(name)
        aitk = Path(AITK_PATH).resolve()
        had = (aitk / "extensions" / "video_dit").exists()
        video_dit_cli("aitk-install", aitk)  # the extension, the smoke-test bases, the UI's entries
        resolved = run_aitk(["-c", "from toolkit.config_modules import ModelConfig\n"
                                   "from toolkit.util.get_model import get_model_class\n"
                                   "c = get_model_class(ModelConfig(arch='video_dit', name_or_path='preset:tiny'))\n"
                                   "print('RESOLVED', c.__module__, c.__name__)"], cwd=aitk, timeout=900)
        assert "RESOLVED video_dit.integrations.ai_toolkit.model VideoDiTModel" in resolved

        make_demo_data(tmp / "data", count=2, frames=9, size=32, holdout=1)
        make_demo_data(tmp / "mixed", count=2, frames=9, size=32, holdout=0, seed=1)
        from PIL import Image

        for name, colour in (("s1.png", (200, 30, 30)), ("sub/s2.jpg", (30, 200, 30))):  # stills, one nested
            (tmp / "mixed" / name).parent.mkdir(exist_ok=True)
            Image.new("RGB", (32, 32), colour).save(tmp / "mixed" / name)
        helpers.write_base(tmp / "base.safetensors")
        ctrl = str(tmp / "data_holdout" / "000.png")
        lora = _job(tmp, "aitk_lora", _process(
            tmp, network={"type": "lora", "linear": RANK, "linear_alpha": ALPHA},
            train={"disable_sampling": False},
            # sample 0: every sample key at ai-toolkit's default but the prompt and control image;
            # sample 1: a short video
            sample={"sample_every": 4, "samples": [
                {"prompt": "a shape moving", "ctrl_img": ctrl},
                {"prompt": "a shape moving", "ctrl_img": ctrl, "width": 64, "height": 64, "num_frames": 7,
                 "fps": 8, "sample_steps": 2, "guidance_scale": 1.0, "seed": 1, "neg": ""}]}))
        full2 = _job(tmp, "aitk_full", _process(tmp, train={"steps": 2, "lr": 1e-4}))
        full3_dir = tmp / "again"
        full3_dir.mkdir()
        full3 = _job(full3_dir, "aitk_full", _process(tmp, train={"steps": 3, "lr": 1e-4}))
        # 8 steps of batch 1 over 2 clips and 2 stills: two epochs, every still seen; a CLIP model reads
        # pixels, so no latent cache
        stills = _job(tmp, "aitk_stills", _process(
            tmp, train={"steps": 8, "lr": 1e-4},
            datasets=[{"folder_path": str(tmp / "mixed"), "caption_ext": "txt", "num_frames": 9, "fps": 16,
                       "shrink_video_to_frames": True, "do_i2v": True, "resolution": [32],
                       "cache_latents_to_disk": False, "num_workers": 0}],
            model={"name_or_path": "preset:tiny-clip-i2v", "vae_path": None, "te_name_or_path": None,
                   "model_kwargs": {}}))
        ui_job = _ui_job(tmp, aitk, "video_dit:tiny")
        record = tmp / "scale_loss.json"
        try:
            log = run_aitk(["-c", DRIVER, str(record), str(lora), str(full2), str(full3), str(stills), str(ui_job)],
                           cwd=aitk, timeout=3600)
            yield tmp, log, json.loads(record.read_text())
        finally:
            if not had:
                uninstall(aitk)


def _ui_job(tmp: Path, aitk: Path, name: str, steps: int = 2) -> Path:
    """The job the web UI writes when `name` is picked (its installed entry, read back from video_dit.tsx),
    with the fields a user fills: a dataset folder of the entry's clip size, the steps, a job name;
    `device: cpu` (a CPU machine; the UI writes its GPU's)."""
    import aitk_ui_job

    from video_dit.data.demo import make_demo_data
    from video_dit.integrations.aitk_ui import parse_tsx

    entries = {e["name"]: e for e in parse_tsx((aitk / "ui/src/app/jobs/new/video_dit.tsx").read_text())}
    defaults = {k.split("config.process[0].", 1)[1]: v[0] for k, v in entries[name]["defaults"].items()}
    folder = tmp / f"ui_data_{defaults['datasets[x].num_frames']}_{defaults['datasets[x].resolution'][0]}"
    if not folder.exists():
        make_demo_data(folder, count=2, frames=defaults["datasets[x].num_frames"],
                       size=defaults["datasets[x].resolution"][0], holdout=0)
    job = aitk_ui_job.ui_job(entries[name], str(folder), **{
        "train.steps": steps, "device": "cpu", "training_folder": str(tmp / "out")})
    aitk_ui_job.set_key(job, "config.name", "ui_" + name.split(":", 1)[1].replace("-", "_"))
    path = tmp / f"{job['config']['name']}.json"
    path.write_text(json.dumps(job, indent=2))  # as the UI's worker writes it: JSON
    return path


def test_lora_steps_apply_the_i2v_loss_mask_on_video_items(aitk_run):
    tmp, log, calls = aitk_run
    losses = [float(v) for v in re.findall(r"loss: ([-+0-9.e]+)", log)]  # ai-toolkit's progress bar
    assert losses and all(math.isfinite(v) for v in losses), log[-3000:]
    assert len(calls) >= 4 + 2 + 1, calls  # the LoRA job's 4 steps, then the full fine-tune's 2 + 1
    base = str(tmp / "base.safetensors")
    calls = [row for row in calls if row["model"] == base]  # the LoRA and full fine-tune jobs
    for row in calls:
        assert row["shape"][2] == 3, row  # 9 frames -> 3 latent frames: every item is a video item
        assert row["mask"] == [0.0, 1.0, 1.0], row  # the conditioned first latent frame is out of the loss
        assert row["scaled_mean"] == pytest.approx(row["masked_mean"], rel=1e-5)  # SDTrainer's mean = masked mean


def test_lora_at_linear_alpha_not_linear_samples_at_ai_toolkits_scale(aitk_run):
    import torch
    from safetensors.torch import load_file, save_file

    from video_dit.families.wan.loading import load_dit
    from video_dit.lora import add_lora, save_lora
    from video_dit.media import read_video
    from video_dit.models.weights import read_state_dict

    tmp, _, _ = aitk_run
    out = tmp / "out" / "aitk_lora"
    lora_file = out / "aitk_lora.safetensors"
    assert lora_file.is_file(), sorted(p.name for p in out.iterdir())
    state = load_file(str(lora_file))
    base = load_dit(str(tmp / "base.safetensors"))
    reference = save_lora(tmp / "ours.safetensors", add_lora(load_dit(str(tmp / "base.safetensors")), rank=RANK, targets=WAN_LORA_TARGETS),
                          alpha=RANK)
    assert set(state) == set(read_state_dict(reference))  # the DeepSpeed trainer's export format
    alphas = [float(v) for k, v in state.items() if k.endswith(".alpha")]
    assert alphas and set(alphas) == {float(RANK)}, set(alphas)  # not linear_alpha (8): ai-toolkit trained at scale 1
    assert any(v.abs().max() > 0 for k, v in state.items() if k.endswith(".lora_B.weight"))  # trained

    # the base with B @ A merged at scale 1, computed here, as a single-file DiT
    merged = {k: v.clone() for k, v in base.state_dict().items()}
    for key, b in state.items():
        if key.endswith(".lora_B.weight"):
            module = key[len("diffusion_model."):-len(".lora_B.weight")]
            merged[module + ".weight"] += b.float() @ state[key.replace("lora_B", "lora_A")].float()
    save_file({k: v.contiguous() for k, v in merged.items()}, str(tmp / "merged.safetensors"))
    # and the file at the wrong scale (alpha/rank = 2, as if linear_alpha had been applied)
    save_file({k: (v * 2 if k.endswith(".alpha") else v) for k, v in state.items()}, str(tmp / "double.safetensors"))

    common = ["--vae", "preset:tiny", "--text-encoder", "preset:tiny", "--preset", "tiny", "--prompt",
              "a shape moving", "--image", str(tmp / "data_holdout/000.png"), "--frames", 5, "--height", 32,
              "--width", 32, "--steps", 4, "--cfg", 1, "--seed", 3]
    videos = {}
    for name, model, lora in (("lora", "base.safetensors", lora_file), ("merged", "merged.safetensors", None),
                              ("double", "base.safetensors", tmp / "double.safetensors"),
                              ("base", "base.safetensors", None)):
        video_dit_cli("sample", "--model", tmp / model, *common, *(["--lora", lora] if lora else []),
                      "--out", tmp / f"{name}.mp4")
        videos[name] = read_video(tmp / f"{name}.mp4")
    diff = {k: (videos["lora"] - v).abs().max().item() for k, v in videos.items()}
    assert diff["merged"] < 2 / 255, diff  # the same model, through H.264
    assert diff["base"] > 3 * max(diff["merged"], 1 / 255) and diff["double"] > 3 * max(diff["merged"], 1 / 255), diff
    assert torch.isfinite(videos["lora"]).all()


def test_previews_with_ai_toolkits_default_sample_keys(aitk_run):
    from PIL import Image

    from video_dit.media import probe_video

    tmp, _, _ = aitk_run
    samples = tmp / "out" / "aitk_lora" / "samples"
    files = sorted(samples.iterdir())
    images = [p for p in files if p.suffix.lower() in (".jpg", ".jpeg", ".png", ".webp")]
    videos = [p for p in files if p.suffix.lower() == ".mp4"]
    assert images and videos, [p.name for p in files]
    with Image.open(images[0]) as img:  # sample 0: ai-toolkit's 512 x 512 default, one frame
        assert img.size == (512, 512)
        extrema = img.convert("L").getextrema()
        assert extrema[0] < extrema[1]  # not a blank frame
    assert probe_video(videos[0]).num_frames == 5  # sample 1: 7 frames snapped to 4k + 1


def test_full_fine_tune_saves_and_resumes(aitk_run):
    import torch

    from video_dit.families.wan.loading import load_dit

    tmp, log, _ = aitk_run
    out = tmp / "out" / "aitk_full"
    saves = sorted(p for p in out.iterdir() if re.fullmatch(r"aitk_full_\d{9}(\.safetensors)?", p.name))
    steps = [int(re.search(r"_(\d{9})", p.name).group(1)) for p in saves]
    assert steps == [1, 2, 3], [p.name for p in saves]
    # the newest save of the first run: its step-2 save, or the final one ai-toolkit writes without a step
    assert re.search(r"IMPORTANT RESUMING FROM \S*aitk_full(_000000002)?(\.safetensors)?\s", log), log[-4000:]
    assert "Found step 2 in metadata" in log, log[-4000:]
    with open(saves[1] / "aitk_meta.yaml") as f:  # what ai-toolkit's resume reads (L876-885)
        assert yaml.safe_load(f)["training_info"]["step"] == 2
    two, three = (load_dit(str(p)).state_dict() for p in saves[1:])
    base = load_dit(str(tmp / "base.safetensors")).state_dict()
    assert max((two[k] - base[k]).abs().max().item() for k in base) > 0  # trained
    assert max((three[k] - two[k]).abs().max().item() for k in base) > 0  # trained on after the resume
    assert all(torch.isfinite(v).all() for v in three.values())


def _found(log: str) -> dict[str, list[str]]:
    """What ai-toolkit says it found in each dataset folder ("Dataset: PATH" then "  -  Found ...",
    toolkit/data_loader.py L470 and L562-568), per folder, in order."""
    found, folder = {}, None
    for line in log.splitlines():
        if line.startswith("Dataset: "):
            folder = line[len("Dataset: "):].strip()
        elif folder is not None and "-  Found " in line and "after adding flips" not in line:
            found.setdefault(folder, []).append(line.split("-  Found ", 1)[1].strip())
    return found


def test_a_demo_folder_is_its_training_clips_to_ai_toolkit(aitk_run):
    tmp, log, _ = aitk_run
    found = _found(log)
    assert found.get(str(tmp / "data")) and set(found[str(tmp / "data")]) == {"2 videos"}, found  # no held-out
    assert not (tmp / "data" / "holdout").exists() and (tmp / "data_holdout" / "000.png").is_file()


def test_a_concat_i2v_job_skips_its_stills_with_one_warning_and_trains_to_the_end(aitk_run):
    from video_dit.diffusion.conditioning import skipped_stills

    tmp, log, calls = aitk_run
    assert set(_found(log)[str(tmp / "mixed")]) == {"2 videos and 2 images"}
    rows = [row for row in calls if row["model"] == "preset:tiny-clip-i2v"]
    assert len(rows) == 8, rows  # to the end: 8 steps
    stills = [row for row in rows if row["shape"][2] == 1]
    assert stills and all(row["skipped"] and row["scaled_max"] == 0.0 for row in stills), rows
    assert all(not row["skipped"] and row["scaled_max"] > 0 for row in rows if row["shape"][2] > 1), rows
    warning = f"[video_dit] warning: {skipped_stills(tmp / 'mixed', ['s1.png', 'sub/s2.jpg'])}"
    assert log.count(warning) == 1, log[-4000:]
    assert (tmp / "out" / "aitk_stills" / "aitk_stills.safetensors").exists() or any(
        (tmp / "out" / "aitk_stills").glob("aitk_stills*")), sorted((tmp / "out" / "aitk_stills").iterdir())


def test_lora_on_a_random_preset_is_refused_before_ai_toolkit_reads_the_data(aitk_run, tmp_path):
    from video_dit.data.demo import make_demo_data

    tmp, _, _ = aitk_run
    make_demo_data(tmp_path / "data", count=1, frames=9, size=32, holdout=0)
    process = _process(tmp_path, network={"type": "lora", "linear": RANK, "linear_alpha": ALPHA},
                       model={"name_or_path": "preset:tiny", "vae_path": None, "te_name_or_path": None,
                              "model_kwargs": {}})
    log = run_aitk(["run.py", str(_job(tmp_path, "aitk_preset_lora", process))], cwd=Path(AITK_PATH).resolve(),
                   timeout=900, fails=True)
    assert "network: LoRA on 'preset:tiny' trains nothing" in log and "model.name_or_path" in log, log[-4000:]
    data = tmp_path / "data"
    assert not (data / ".aitk_size.json").exists() and not (data / "_latent_cache").exists(), sorted(data.iterdir())


def test_a_job_from_the_tiny_entrys_ui_defaults_trains_two_steps_and_previews(aitk_run):
    tmp, log, calls = aitk_run
    out = tmp / "out" / "ui_tiny"
    rows = [row for row in calls if "bases" in row["model"] and row["model"].endswith("/tiny")]
    assert len(rows) == 2 and all(row["scaled_max"] > 0 for row in rows), rows  # two steps of the UI's job
    assert (out / "ui_tiny.safetensors").is_file(), sorted(p.name for p in out.iterdir())
    from video_dit.media import probe_video

    videos = sorted((out / "samples").glob("*.mp4"))
    assert len(videos) >= 10, [p.name for p in (out / "samples").iterdir()]  # the UI's 10 default prompts
    assert probe_video(videos[0]).num_frames == 17  # the entry's frame count


def test_a_job_from_an_i2v_entrys_ui_defaults_is_refused_before_the_data_is_read(aitk_run, tmp_path):
    aitk = Path(AITK_PATH).resolve()  # installed by the module's fixture until the module ends
    path = _ui_job(tmp_path, aitk, "video_dit:tiny-clip-i2v")
    log = run_aitk(["run.py", str(path)], cwd=aitk, timeout=900, fails=True)
    assert "sample.samples[0].ctrl_img: preset 'tiny-clip-i2v' is image-to-video only" in log, log[-4000:]
    assert "samples 0, 1, 2, 3, 4, 5, 6, 7, 8, 9 of 10 have none" in log, log[-4000:]
    data = next(tmp_path.glob("ui_data_*"))
    assert not (data / "_latent_cache").exists() and not (data / ".aitk_size.json").exists()


def test_the_web_ui_type_checks_with_the_entries_installed(aitk_run):
    """tsc over ai-toolkit's UI project with video_dit.tsx and the two patched files (needs ui/node_modules)."""
    aitk = Path(AITK_PATH).resolve()
    tsc = aitk / "ui/node_modules/.bin/tsc"
    if not tsc.exists():
        pytest.skip(f"{tsc}: missing (run `npm install` in {aitk / 'ui'} to type-check the UI)")
    out = subprocess.run([str(tsc), "--noEmit", "-p", "tsconfig.json"], cwd=aitk / "ui", capture_output=True,
                         text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
