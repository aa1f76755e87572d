"""ai-toolkit's web UI: `video-dit aitk-install` writes its entries (generated from the family registry) and
the trainable bases of the smoke-test presets; the job files the UI writes from them (tests/aitk_ui_job.py,
written from ai-toolkit 27a03a91's ui/ source) are read by our trainer, `inspect-data` and `plan`; previews
the DiT cannot render are refused before step 1, in the arch (stand-in) and in our trainer, in the same words."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import math
import shutil
from pathlib import Path

import aitk_standin
import aitk_ui_job as ui
import pytest
import torch

from video_dit.cli import main as cli
from video_dit.commands.aitk_install import (
    IMPORT_LINE,
    LOKR_HIDDEN,
    LOKR_OPTION,
    MODEL_LIST,
    SPREAD_LINE,
    InstallError,
    install_ui,
)
from video_dit.families import PRESETS, family_of
from video_dit.integrations import aitk_ui
from video_dit.spec import check_preview_frames, i2v_mode_of, untrainable
from video_dit.train.config import IGNORED, parse_job
from video_dit.typed_config import ConfigError

OPTIONS = ui.FIXTURES / "aitk_ui_27a03a91_options.tsx"
SIMPLE_JOB = ui.FIXTURES / "aitk_ui_27a03a91_SimpleJob.tsx"
PROCESS = "config.process[0]"


def checkout(root: Path) -> Path:
    """A stand-in ai-toolkit checkout: run.py, toolkit/, and the UI's options.tsx and SimpleJob.tsx (the fixtures'
    lines of them)."""
    (root / "toolkit").mkdir(parents=True)
    (root / "run.py").write_text("# ai-toolkit entry point\n")
    (root / "ui/src/app/jobs/new").mkdir(parents=True)
    shutil.copy(OPTIONS, root / "ui/src/app/jobs/new/options.tsx")
    shutil.copy(SIMPLE_JOB, root / "ui/src/app/jobs/new/SimpleJob.tsx")
    return root


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """One install (the command line), shared: (checkout, the entries read back from video_dit.tsx, its output)."""
    root = checkout(tmp_path_factory.mktemp("aitk") / "ai-toolkit")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli(["aitk-install", str(root)]) == 0
    tsx = (root / "ui/src/app/jobs/new/video_dit.tsx").read_text()
    return root, {e["name"]: e for e in aitk_ui.parse_tsx(tsx)}, out.getvalue()


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Demo clips (17 frames, 64 px) and held-out first frames beside them."""
    from video_dit.data.demo import make_demo_data

    folder = tmp_path_factory.mktemp("ui_data") / "data"
    make_demo_data(folder, count=2, frames=17, size=64, holdout=1)
    return folder


def selected(entry: dict) -> dict:
    """An entry's selected defaults, keys without the `config.process[0].` prefix."""
    return {k[len(aitk_ui.P):]: v[0] for k, v in entry["defaults"].items()}


def test_install_writes_the_entries_is_idempotent_and_uninstalls(installed, capsys):
    root, entries, out = installed
    options = root / "ui/src/app/jobs/new/options.tsx"
    lines = options.read_text().splitlines()
    assert lines.index(IMPORT_LINE) == 3 and lines[4] == "import React from 'react';"  # before ai-toolkit's imports
    assert lines[lines.index(MODEL_LIST) + 1] == SPREAD_LINE  # first in ai-toolkit's model list
    simple = (root / "ui/src/app/jobs/new/SimpleJob.tsx").read_text().splitlines()
    assert simple.count("                " + LOKR_HIDDEN) == 1 and not any(l.strip() == LOKR_OPTION for l in simple)
    assert f"cd {root / 'ui'} && npm run build_and_start" in out  # the UI's rebuild command
    assert cli(["aitk-install", str(root)]) == 0  # again: nothing changes, no rebuild asked for
    again = capsys.readouterr().out
    assert again.count("unchanged: ") == again.count("\n") - 1 and "npm run" not in again
    # a file of that name the command did not write is never overwritten
    copy = checkout(root.parent / "other")
    (copy / "ui/src/app/jobs/new/video_dit.tsx").write_text("export const mine = 1;\n")
    with pytest.raises(InstallError, match="not written by video-dit aitk-install"):
        install_ui(copy, {})
    assert (copy / "ui/src/app/jobs/new/video_dit.tsx").read_text() == "export const mine = 1;\n"
    # --uninstall: ai-toolkit's files as they were
    assert cli(["aitk-install", "--uninstall", str(copy)]) == 1 and "left in place" in capsys.readouterr().err
    before = {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}
    assert cli(["aitk-install", "--uninstall", str(root)]) == 0
    assert options.read_bytes() == OPTIONS.read_bytes()
    assert (root / "ui/src/app/jobs/new/SimpleJob.tsx").read_bytes() == SIMPLE_JOB.read_bytes()
    assert not (root / "ui/src/app/jobs/new/video_dit.tsx").exists() and not (root / "extensions/video_dit").exists()
    assert "npm run build_and_start" in capsys.readouterr().out
    for path, content in before.items():  # put back for the other tests of this module
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)


def test_generated_entries_equal_the_registry(installed):
    """Every number of every entry, derived here from the preset, its family and its VAE."""
    root, entries, _ = installed
    trained = [p for p in PRESETS.values() if untrainable(p, "ai-toolkit") is None]
    # 21 + LTX-2's five (the AV demo's preset too) + MiniMax H3's three
    assert sorted(entries) == sorted(f"video_dit:{p.name}" for p in trained) and len(trained) == 29
    counted = {}
    for preset in trained:
        e = entries[f"video_dit:{preset.name}"]
        d, family = selected(e), family_of(preset)
        frames, height, width = preset.sample_size
        assert preset.vae.snap_frames(frames) == frames  # a clip length the VAE encodes (4k + 1 here)
        assert (d["sample.num_frames"], d["datasets[x].num_frames"], d["sample.height"], d["sample.width"]) == (
            frames, frames, height, width)
        assert d["sample.fps"] == d["datasets[x].fps"] == preset.fps
        assert (d["sample.guidance_scale"], d["sample.sample_steps"], d["sample.neg"]) == (
            preset.sample_guidance, preset.sample_steps, preset.sample_negative)
        (r,) = d["datasets[x].resolution"]  # the largest UI choice within the reference frame's area
        side = math.sqrt(height * width)
        assert (r in aitk_ui.UI_RESOLUTIONS and r <= side < min(x for x in (*aitk_ui.UI_RESOLUTIONS, 1e9) if x > r)
                or r == math.ceil(side) < 256), (preset.name, r)
        assert r % preset.divisibility == 0
        if repr(preset.dit) not in counted:  # (presets share DiT configs: each counted once)
            with torch.device("meta"):
                counted[repr(preset.dit)] = sum(p.numel() for p in family.arch.cls(preset.dit).parameters())
        params = counted[repr(preset.dit)]
        # the tiny presets' text encoders are tiny random ones, every released one is 5.7-12B parameters
        assert d["model.quantize"] is (params > 2e9) and d["model.quantize_te"] is not preset.name.startswith("tiny")
        assert d["model.model_kwargs"]["preset"] == preset.name and d["train.optimizer"] == "adamw"
        assert d.get("datasets[x].do_i2v") is (True if preset.i2v_mode else None)
        sections = e["additionalSections"]
        flf2v = family.last_frame(preset.dit, preset.i2v_mode) == "required"
        takes_first = i2v_mode_of(preset, None, "") is not None
        assert ("datasets.multi_control_paths" in sections) is flf2v
        assert d.get("datasets[x].do_flf2v") is (flf2v or None)
        assert ("sample.ctrl_img" in sections) is (takes_first and not flf2v)
        assert ("model.multistage" in sections) is preset.two_experts
        assert (d["model.model_kwargs"].get("train_high_noise"), d["model.model_kwargs"].get("train_low_noise")) == (
            (True, True) if preset.two_experts else (None, None))
        if family.i2v_only(preset.dit):
            assert "every sample needs" in e["modelNotes"].lower()
    # ai-toolkit's own choices agree where it has the model: quantize the 5B, not the 1.3B (options.tsx)
    assert selected(entries["video_dit:wan2.2-ti2v-5b"])["model.quantize"] is True
    assert selected(entries["video_dit:wan2.1-t2v-1.3b"])["model.quantize"] is False


def test_switching_away_restores_the_uis_own_defaults(installed):
    """Picking an entry and then the UI's starting model again gives back the UI's starting job exactly: every
    unselected value is the UI's own (27a03a91)."""
    _, entries, _ = installed
    for e in entries.values():
        assert ui.pick(ui.pick(ui.UI["job"], ui.UI["flex1"], e), e, ui.UI["flex1"]) == ui.UI["job"], e["name"]


def test_the_file_follows_the_registry(installed, monkeypatch):
    """A preset's number changed in the registry: the next install rewrites the file with it."""
    root, entries, _ = installed
    bases = {n: Path(selected(e)["model.name_or_path"]) for n, e in entries.items() if aitk_ui.smoke_test(
        PRESETS[n.split(":", 1)[1]])}
    bases = {n.split(":", 1)[1]: p for n, p in bases.items()}
    assert [s for _, s in install_ui(root, bases)] == ["unchanged", "unchanged", "unchanged"]
    monkeypatch.setitem(PRESETS, "tiny", dataclasses.replace(PRESETS["tiny"], fps=8))
    assert [s for _, s in install_ui(root, bases)] == ["updated", "unchanged", "unchanged"]
    tsx = (root / "ui/src/app/jobs/new/video_dit.tsx").read_text()
    assert selected({e["name"]: e for e in aitk_ui.parse_tsx(tsx)}["video_dit:tiny"])["sample.fps"] == 8


def test_smoke_test_entries_point_at_a_base_a_lora_trains_on(installed):
    """A smoke-test entry's name_or_path is a base the arch and our trainer take LoRA on (not `preset:`), whose
    LoRA gets a gradient (on the preset's own init it gets none: its output layer is zero)."""
    from video_dit.lora import add_lora
    from video_dit.spec import Request, check_lora, resolve

    _, entries, _ = installed
    smoke = {n.split(":", 1)[1]: selected(e)["model.name_or_path"] for n, e in entries.items()
             if aitk_ui.smoke_test(PRESETS[n.split(":", 1)[1]])}
    assert sorted(smoke) == ["tiny", "tiny-a14b", "tiny-clip-flf2v", "tiny-clip-i2v", "tiny-h3", "tiny-hy15-i2v",
                            "tiny-hy15-t2v", "tiny-ltx2-t2v"]
    for name, base in smoke.items():
        check_lora(base, True)  # no refusal
        spec = resolve(Request(base, preset=name))
        assert spec.preset.name == name and (spec.experts is not None) is PRESETS[name].two_experts
    family = family_of(PRESETS["tiny"])
    grads = {}
    for source in (smoke["tiny"], "preset:tiny"):
        dit = add_lora(family.load_dit(source), rank=2, targets=family.lora_targets(False))
        g = torch.Generator().manual_seed(0)
        x, t = torch.randn(1, 16, 2, 4, 4, generator=g), torch.tensor([500.0])
        dit(x, t, [torch.randn(3, 64, generator=g)]).square().mean().backward()
        grads[source] = max(p.grad.abs().max().item() for n, p in dit.named_parameters() if "lora_B" in n)
    assert grads[smoke["tiny"]] > 0 and grads["preset:tiny"] == 0


def test_every_key_the_ui_writes_is_read_or_ignored_with_a_reason(installed, data):
    """Each entry's job, as the UI writes it, parses in our trainer: its preset from the arch tag and
    model_kwargs; every ignored key the UI writes has its reason in IGNORED."""
    _, entries, _ = installed
    for name, e in entries.items():
        job = ui.ui_job(e, str(data))
        p = parse_job(json.loads(json.dumps(job)), "ui").process
        assert p.model.preset == name.split(":", 1)[1] and p.type == "diffusion_trainer"
        assert p.model.arch == name and p.train.compile is False  # the UI's "Compile Model" unticked
    raw = ui.ui_job(entries["video_dit:tiny"], str(data))["config"]["process"][0]
    written = {("process", k) for k in raw if not isinstance(raw[k], dict) or k == "logging"}
    written |= {(block, k) for block in ("network", "save", "train", "model") for k in raw[block]}
    written |= {("datasets", k) for k in raw["datasets"][0]}
    ignored = {(b, k) for b, keys in IGNORED.items() for k in keys}
    acted_on = written - ignored
    assert {("process", "sqlite_db_path"), ("network", "conv"), ("save", "save_format"), ("datasets", "flip_x"),
            ("train", "bypass_guidance_embedding"), ("train", "loss_type")} <= written & ignored
    assert all(isinstance(reason, str) and reason for keys in IGNORED.values() for reason in keys.values())
    assert ("model", "compile") in acted_on and ("process", "type") in acted_on and ("model", "arch") in acted_on


@pytest.mark.parametrize("key, value, where, accepted", [
    ("datasets[0].flip_x", True, "datasets[0].flip_x", "latents are cached once per item); accepted: false"),
    ("datasets[0].mask_path", "/masks", "datasets[0].mask_path", "accepted: null"),
    ("train.content_or_style", "content", "train.content_or_style", "accepted: \"balanced\""),
    ("train.loss_type", "mae", "train.loss_type", "accepted: \"mse\""),
    ("network.network_kwargs", {"ignore_if_contains": ["ffn"]}, "network.network_kwargs", "ignore_if_contains: []"),
    ("model.arch", "video_dit:tiny-a14", "model.arch", "did you mean 'tiny-a14b'?"),
    ("model.model_kwargs", {"preset": "tiny-a14b"}, "model.arch", "names preset 'tiny'"),
    ("type", "concept_slider", "type", "accepted: 'sd_trainer' | 'diffusion_trainer'"),
    ("train.compile", True, "model.compile", "conflicts with train.compile"),
])
def test_a_ui_key_that_would_change_training_is_refused_by_name(installed, data, key, value, where, accepted):
    job = ui.ui_job(installed[1]["video_dit:tiny"], str(data), **{key: value})
    with pytest.raises(ConfigError) as err:
        parse_job(json.loads(json.dumps(job)), "ui")
    assert err.value.path == f"{PROCESS}.{where}" and accepted in str(err.value), str(err.value)


def test_inspect_data_and_plan_read_the_ui_job_file(installed, data, tmp_path, capsys):
    """`.job_config.json` as the UI's worker writes it (JSON) through `video-dit inspect-data` and `plan`."""
    path = tmp_path / ".job_config.json"
    path.write_text(json.dumps(ui.ui_job(installed[1]["video_dit:tiny-a14b"], str(data)), indent=2))
    assert cli(["inspect-data", str(path)]) == 0
    out = capsys.readouterr().out
    assert "model preset tiny-a14b" in out and "2 items" in out and "17 x   64 x   64:" in out, out
    assert cli(["plan", str(path), "--cpu-ranks", "1", "--host-mem", "64"]) == 0
    out = capsys.readouterr().out
    assert "17x64x64" in out.replace(" ", "") or "17 x 64 x 64" in out, out


def _refusal(err: str) -> str:
    """The message of a ConfigError line without its key path."""
    return err.split(".ctrl_img", 1)[1].split(": ", 1)[1].strip()


def test_our_trainer_refuses_previews_without_their_frames_naming_every_sample(installed, data, tmp_path, capsys):
    import helpers

    entries = installed[1]
    job = ui.ui_job(entries["video_dit:tiny-clip-i2v"], str(data))
    rc, err = helpers.validate(tmp_path, job, capsys)
    line = err.strip().splitlines()[-1]
    assert rc == 2 and f"{PROCESS}.sample.samples[0].ctrl_img: " in line, err
    assert "samples 0, 1, 2, 3, 4, 5, 6, 7, 8, 9 of 10 have none" in line and "train.disable_sampling" in line
    frame = str(data.parent / "data_holdout" / "000.png")
    for i in range(10):
        ui.set_key(job, f"{PROCESS}.sample.samples[{i}].ctrl_img", frame)
    assert helpers.validate(tmp_path, job, capsys)[0] == 0  # every sample has its first frame
    # the FLF2V entry: the UI's three control images; Control Image 2 (the last frame) missing on two samples
    job = ui.ui_job(entries["video_dit:tiny-clip-flf2v"], str(data))
    job["config"]["process"][0]["sample"]["samples"] = [
        {"prompt": "a", "ctrl_img_1": frame, "ctrl_img_2": frame}, {"prompt": "b", "ctrl_img_1": frame},
        {"prompt": "c", "ctrl_img_1": frame}]
    rc, err = helpers.validate(tmp_path, job, capsys)
    assert rc == 2 and f"{PROCESS}.sample.samples[1].ctrl_img_2: " in err and "samples 1, 2 of 3 have none" in err


@pytest.fixture(scope="module")
def aitk():
    yield aitk_standin.activate()
    aitk_standin.deactivate()


class Trainer:
    """ai-toolkit's trainer as the arch sees it when the trainer registers its preview hook (BaseSDTrainProcess
    L1806): a bound `sample_step_hook` of an object holding the job's configs (the stand-in's classes)."""

    def __init__(self, job: dict):
        from toolkit.config_modules import DatasetConfig, SampleConfig, TrainConfig

        p = job["config"]["process"][0]
        self.sample_config = self.first_sample_config = SampleConfig(**p["sample"])
        self.has_first_sample_requested = False
        self.train_config = TrainConfig(**p["train"])
        self.dataset_configs = [DatasetConfig(**d) for d in p["datasets"]]

    def sample_step_hook(self, img_num, total_imgs):
        pass


def arch_model(aitk, entry: dict):
    from toolkit.config_modules import ModelConfig

    d = selected(entry)
    config = ModelConfig(name_or_path=d["model.name_or_path"], arch=entry["name"], model_kwargs=d["model.model_kwargs"],
                         dtype="fp32")
    return aitk.VideoDiTModel(device="cpu", model_config=config, dtype="fp32")


def test_the_arch_refuses_the_same_previews_before_step_1(aitk, installed, data, tmp_path, capsys):
    """At the preview hook (right after load_model, before the network, the data or a preview), in our
    trainer's words; a job with sampling off, or with every frame, passes."""
    import helpers

    entry = installed[1]["video_dit:tiny-clip-i2v"]
    model, job = arch_model(aitk, entry), ui.ui_job(entry, str(data))
    with pytest.raises(ConfigError) as err:
        model.add_after_sample_image_hook(Trainer(job).sample_step_hook)
    assert err.value.path == "sample.samples[0].ctrl_img"
    ours = helpers.validate(tmp_path, job, capsys)[1].strip().splitlines()[-1]
    assert str(err.value).split(": ", 1)[1] == _refusal(ours)
    model.add_after_sample_image_hook(Trainer(ui.ui_job(entry, str(data), **{"train.disable_sampling": True}))
                                      .sample_step_hook)
    model.add_after_sample_image_hook(lambda img_num, total: None)  # a hook of no trainer: nothing to check
    # HunyuanVideo 1.5's i2v DiT has an unconditioned input: its samples need no control image
    check_preview_frames(PRESETS["tiny-hy15-i2v"], "concat", [(False, False)] * 3, "sample.samples")
    # generate_images (any preview round, e.g. the UI's "Sample now"): refused before anything renders
    from toolkit.config_modules import GenerateImageConfig

    gens = [GenerateImageConfig(prompt="a", output_folder=str(tmp_path)),
            GenerateImageConfig(prompt="b", output_folder=str(tmp_path), ctrl_img="x.png")]
    with pytest.raises(ConfigError, match=r"sample 0 of 2 has none"):
        model.generate_images(gens)
    assert model.generated == []
    model.generate_images(gens[1:])
    assert model.generated == [gens[1:]]


def test_the_arch_refuses_an_added_dataset_it_cannot_train_before_step_1(aitk, installed, data):
    """The UI's "Add Dataset" writes num_frames 1 and no do_i2v: an i2v-only model refuses it at load; with
    do_i2v ticked, its single frames (which a concat model skips) are refused too."""
    entry = installed[1]["video_dit:tiny-clip-i2v"]
    model = arch_model(aitk, entry)
    job = ui.add_dataset(ui.ui_job(entry, str(data), **{"train.disable_sampling": True}), entry, str(data))
    with pytest.raises(ConfigError, match=r"every dataset needs do_i2v: true") as err:
        model.add_after_sample_image_hook(Trainer(job).sample_step_hook)
    assert err.value.path == "datasets[1].do_i2v"
    ui.set_key(job, f"{PROCESS}.datasets[1].do_i2v", True)
    with pytest.raises(ConfigError, match=r"nothing would train; accepted: a clip length its VAE encodes, e.g. 17"):
        model.add_after_sample_image_hook(Trainer(job).sample_step_hook)
    ui.set_key(job, f"{PROCESS}.datasets[1].num_frames", 17)
    model.add_after_sample_image_hook(Trainer(job).sample_step_hook)


def test_an_flf2v_preview_from_the_uis_control_images_renders(aitk, installed, data, tmp_path):
    """Control Image 1 / 2 (`ctrl_img_1`, `ctrl_img_2`; no `ctrl_img`) render what ctrl_img / ctrl_img_2 render."""
    from toolkit.config_modules import GenerateImageConfig

    from PIL import Image

    model = arch_model(aitk, installed[1]["video_dit:tiny-clip-flf2v"])
    model.load_model()
    first, last = str(data.parent / "data_holdout" / "000.png"), str(tmp_path / "last.png")
    Image.new("RGB", (64, 64), (20, 200, 90)).save(last)
    embeds = model.get_prompt_embeds(["a shape"])
    frames = []
    for keys in ({"ctrl_img_1": first, "ctrl_img_2": last}, {"ctrl_img": first, "ctrl_img_2": last}):
        gen = GenerateImageConfig(prompt="a shape", width=32, height=32, num_inference_steps=2, guidance_scale=1.0,
                                  num_frames=5, output_folder=str(tmp_path), **keys)
        out = model.generate_single_image(model.get_generation_pipeline(), gen, embeds, None,
                                          torch.Generator().manual_seed(0), {})
        frames.append(torch.stack([torch.as_tensor(list(f.getdata()), dtype=torch.float32) for f in out]))
    assert len(frames[0]) == 5 and torch.equal(frames[0], frames[1])
    gen = GenerateImageConfig(prompt="a shape", width=32, height=32, num_inference_steps=2, num_frames=5,
                              output_folder=str(tmp_path), ctrl_img_2=last)
    with pytest.raises(ValueError, match="first_frame"):  # without Control Image 1 the DiT has no input
        model.generate_single_image(model.get_generation_pipeline(), gen, embeds, None, torch.Generator(), {})


def test_ignored_table_has_every_new_field():
    """IGNORED names fields the config classes have (a reason for a key nobody reads would be a lie)."""
    from video_dit.data import DatasetConfig
    from video_dit.train import config as c

    classes = {"process": c.ProcessConfig, "network": c.NetworkConfig, "save": c.SaveConfig, "train": c.TrainConfig,
               "model": c.ModelConfig, "sample": c.SampleConfig, "datasets": DatasetConfig}
    for block, keys in IGNORED.items():
        if block in classes:
            names = {f.name for f in dataclasses.fields(classes[block])}
            assert set(keys) <= names, (block, set(keys) - names)



def test_an_entry_of_a_family_with_sound_trains_its_track_in_our_trainer(data):
    """A family with sound (LTX-2; not yet an ai-toolkit family here, so generated directly): Do Audio on and
    consecutive frames, which our trainer reads as `audio: auto` and requires; Do Audio off is `audio: off`."""
    preset = PRESETS["tiny-ltx2-t2v"]
    assert family_of(preset).audio is not None
    e = aitk_ui.entry(preset, "/a/trainable/base")
    assert "datasets.do_audio" in e["additionalSections"] and selected(e)["datasets[x].do_audio"] is True
    d = parse_job(json.loads(json.dumps(ui.ui_job(e, str(data)))), "ui").process.datasets[0]
    assert d.audio == "auto" and d.shrink_video_to_frames is False and d.num_frames == preset.sample_size[0]
    off = ui.ui_job(e, str(data), **{"datasets[0].do_audio": False})
    assert parse_job(json.loads(json.dumps(off)), "ui").process.datasets[0].audio == "off"
    both = ui.ui_job(e, str(data), **{"datasets[0].do_audio": False, "datasets[0].audio": "required"})
    with pytest.raises(ConfigError, match=r"datasets\[0\]\.do_audio: False conflicts with audio: required"):
        parse_job(json.loads(json.dumps(both)), "ui")
