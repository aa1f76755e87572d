"""One job file, one meaning in both trainers (issue 48): ai-toolkit's `trigger_word` and `logging.use_wandb`
as ai-toolkit does them, two trainers never mixing their outputs in one job folder, saved sources portable,
and the LoRA target sets either side refuses rather than drops silently. One process, no launch."""

from __future__ import annotations

import importlib.util
import json
import sys
import types
from pathlib import Path

import aitk_standin
import helpers
import pytest
import torch
import yaml

from video_dit.data.dataset import inject_trigger
from video_dit.models.weights import WeightsError
from video_dit.typed_config import ConfigError


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """Two demo clips with captions in `<root>/data`."""
    return helpers.make_world(tmp_path_factory.mktemp("meaning"))


def _job(root: Path, out: Path | None = None, **process) -> dict:
    p = helpers.train_process(root, lora=False)
    p.update(process)
    if out is not None:
        p["training_folder"] = str(out)
    return {"job": "extension", "config": {"name": "meaning", "process": [p]}}


# ---------------------------------------------------------------- trigger_word

@pytest.mark.parametrize("prompt, trigger, add, expected", [
    # toolkit/prompt_utils.py inject_trigger_into_prompt at 27a03a91, worked by hand:
    ("a [trigger] dog", "sks", True, "a sks dog"),            # the token replaced, nothing prepended
    ("a dog", "sks", True, "sks a dog"),                       # a caption without it: prepended with a space
    ("[name] and [trigger]", "sks", True, "sks and sks"),      # both of its tokens
    ("a sks dog", "sks", True, "a sks dog"),                   # present already: unchanged
    ("a dog", "sks", False, "a dog"),                          # a preview prompt: replaced only, never added
    ("a [trigger] dog", None, True, "a  dog"),                 # no trigger word: the tokens removed
    ("a dog", "  ", True, "a dog"),                            # a blank word is never prepended
])
def test_inject_trigger_is_ai_toolkits_rule(prompt, trigger, add, expected):
    assert inject_trigger(prompt, trigger, add) == expected


def test_trigger_word_reaches_captions_and_preview_prompts(tmp_path):
    """The process's trigger_word goes to every dataset without its own (BaseSDTrainProcess), each caption
    gets it (FileItemDTO.get_caption: add_if_not_present), the previews' prompts get `[trigger]` replaced
    (BaseSDTrainProcess.sample: never prepended); a dataset's own trigger_word wins for its captions."""
    from video_dit.data import scan_datasets
    from video_dit.train.config import parse_job

    root = helpers.make_world(tmp_path)
    captions = {p.stem: p.read_text().strip() for p in (root / "data").glob("*.txt")}
    (root / "data" / f"{sorted(captions)[0]}.txt").write_text("a [trigger] moving")
    own = root / "own"
    own.mkdir()
    for p in (root / "data").iterdir():
        if p.suffix in (".mp4", ".txt"):
            (own / p.name).write_bytes(p.read_bytes())
    datasets = [helpers.train_process(root)["datasets"][0],
                {**helpers.train_process(root)["datasets"][0], "folder_path": str(own), "trigger_word": "zzz"}]
    sample = {"samples": [{"prompt": "photo of [trigger]"}, {"prompt": "a cat"}], "num_frames": 5}
    job = parse_job(_job(root, trigger_word="sks", datasets=datasets, sample=sample))
    p = job.process
    assert [d.trigger_word for d in p.datasets] == ["sks", "zzz"]
    assert [s.prompt for s in p.sample.samples] == ["photo of sks", "a cat"]
    scan = scan_datasets(p.datasets, 16, verbose=False)
    got = {(Path(it.path).parent.name, Path(it.path).stem): it.caption for it in scan.items}
    first = sorted(captions)[0]
    for stem, text in captions.items():
        assert got[("data", stem)] == ("a sks moving" if stem == first else f"sks {text}")
        assert got[("own", stem)] == ("a zzz moving" if stem == first else f"zzz {text}")
    plain = parse_job(_job(root, datasets=datasets[:1])).process  # no trigger word: the token removed
    assert {it.caption for it in scan_datasets(plain.datasets, 16, verbose=False).items
            if Path(it.path).stem == first} == {"a  moving"}


# ---------------------------------------------------------------- logging.use_wandb

class _FakeRun:
    def __init__(self, calls):
        self.calls = calls

    def log(self, data, step=None):
        self.calls.append(("log", dict(data), step))

    def finish(self):
        self.calls.append(("finish",))


def test_use_wandb_sends_what_ai_toolkit_sends(data, tmp_path, monkeypatch):
    """wandb.init(project, name, config = the job file); every log_every steps learning_rate and loss/loss
    (ai-toolkit's keys) with the step's other figures, at that step; finish at close. TensorBoard and
    metrics.jsonl as before."""
    from video_dit.train.config import parse_job
    from video_dit.train.metrics import MetricsLog, WandbLog

    calls = []
    fake = types.ModuleType("wandb")
    fake.init = lambda **kw: calls.append(("init", kw)) or _FakeRun(calls)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "wandb" else None)
    raw = _job(data, logging={"use_wandb": True, "log_every": 2, "project_name": "p", "run_name": "r"})
    lg = parse_job(raw).process.logging
    assert (lg.use_wandb, lg.log_every, lg.project_name, lg.run_name) == (True, 2, "p", "r")
    log = MetricsLog(tmp_path / "out", enabled=True, wandb=WandbLog(lg.project_name, lg.run_name, raw, lg.log_every,
                                                                     tmp_path / "out"))
    for step in (1, 2, 3, 4):
        log.write({"step": step, "loss": 0.5 / step, "lr": 1e-3 * step, "grad_norm": float(step), "expert": "x"})
    log.close()
    assert calls[0] == ("init", {"project": "p", "name": "r", "config": raw, "dir": str(tmp_path / "out")})
    assert calls[1:] == [("log", {"learning_rate": 2e-3, "loss/loss": 0.25, "grad_norm": 2.0}, 2),
                         ("log", {"learning_rate": 4e-3, "loss/loss": 0.125, "grad_norm": 4.0}, 4), ("finish",)]
    assert len((tmp_path / "out" / "metrics.jsonl").read_text().splitlines()) == 4  # every step, as before


def test_use_wandb_without_wandb_names_the_key_and_the_install(data, tmp_path, monkeypatch):
    from video_dit.train.config import parse_job
    from video_dit.train.metrics import WandbLog

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match=r"config\.process\[0\]\.logging\.use_wandb: true needs Weights & "
                                          r"Biases.*pip install wandb"):
        parse_job(_job(data, logging={"use_wandb": True}))
    parse_job(_job(data, logging={"use_wandb": False}))  # off: nothing asked of wandb
    monkeypatch.setitem(sys.modules, "wandb", None)  # importing it fails
    with pytest.raises(ImportError, match=r"logging\.use_wandb: true needs .*pip install wandb"):
        WandbLog("p", None, {}, 1, tmp_path).start()


def test_use_wandb_in_offline_mode(tmp_path, monkeypatch):
    """The real wandb, offline (WANDB_MODE=offline): the run starts with the job file as its config, takes
    our rows and is written under the job's folder (its `.wandb` record file). wandb is not a dependency:
    skipped where it is not installed (the fake-module test above checks what is sent)."""
    pytest.importorskip("wandb", reason="wandb is optional (pip install wandb); the fake-module test above runs")
    from video_dit.train.metrics import MetricsLog, WandbLog

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    wb = WandbLog("video_dit-tests", "offline-run", {"config": {"name": "x"}}, 1, tmp_path / "out")
    log = MetricsLog(tmp_path / "out", enabled=True, wandb=wb)
    run = wb.run
    assert run.name == "offline-run" and dict(run.config) == {"config": {"name": "x"}}
    log.write({"step": 1, "loss": 0.75, "lr": 1e-3})
    log.write({"step": 2, "loss": 0.5, "lr": 1e-3})
    log.close()
    records = list((tmp_path / "out" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(records) == 1 and records[0].stat().st_size > 0


# ---------------------------------------------------------------- two trainers, one job folder

@pytest.fixture(scope="module")
def aitk():
    yield aitk_standin.activate()
    aitk_standin.deactivate()


def test_two_trainers_on_one_job_folder_refuse_to_mix(aitk, data, tmp_path, capsys):
    """ai-toolkit's save_root is our `<training_folder>/<name>/`: our trainer refuses a folder holding
    ai-toolkit's files (before any rank starts), the arch refuses to resume from our trainer's files in its
    own job folder (the LoRA file ai-toolkit found there, or name_or_path of a full fine-tune's resume); a
    LoRA of our trainer's folder given to another job (ai-toolkit's save_root elsewhere) loads."""
    from toolkit.config_modules import ModelConfig

    from video_dit.lora import add_lora, save_lora
    from video_dit.families.wan import FAMILY as WAN
    from video_dit.families.wan.loading import load_dit

    job = _job(data, out=tmp_path / "out")
    out = tmp_path / "out" / "meaning"
    out.mkdir(parents=True)
    (out / "config.yaml").write_text(yaml.safe_dump(job))  # ai-toolkit ran this job here
    rc, err = helpers.validate(tmp_path, job, capsys)
    assert rc == 2 and "config.name" in err and "config.yaml" in err and "ai-toolkit (arch: video_dit)'s" in err
    (out / "config.yaml").unlink()
    assert helpers.validate(tmp_path, job, capsys)[0] == 0
    # our trainer's outputs, then ai-toolkit started on the same job (its config.yaml written first)
    (out / "metrics.jsonl").write_text("")
    (out / "checkpoints").mkdir()
    dit = helpers.randomize_head(load_dit("preset:tiny"))
    base = tmp_path / "base.safetensors"
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in dit.state_dict().items()}, str(base))
    lora = save_lora(out / "meaning.safetensors", add_lora(dit, 4, targets=WAN.lora_targets(False)), 4.0)
    cfg = ModelConfig(name_or_path=str(base), arch="video_dit", dtype="fp32", model_kwargs={"preset": "tiny"})
    sd = aitk.VideoDiTModel(device="cpu", model_config=cfg, dtype="fp32")
    sd.load_model()
    sd.load_lora(str(lora))  # ai-toolkit's save_root is elsewhere: a starting network from our folder loads
    (out / "config.yaml").write_text(yaml.safe_dump(job))
    with pytest.raises(WeightsError, match=r"meaning\.safetensors: .*holds video_dit's DeepSpeed trainer's outputs "
                                           r"\(metrics\.jsonl, checkpoints\).*another config\.name"):
        sd.load_lora(str(lora))
    (out / "meaning").mkdir()
    with pytest.raises(ConfigError, match=r"^model\.name_or_path: .*meaning: .*video_dit's DeepSpeed trainer's"):
        aitk.VideoDiTModel(device="cpu", model_config=ModelConfig(name_or_path=str(out / "meaning"), arch="video_dit",
                                                                  model_kwargs={"preset": "tiny"}))


# ---------------------------------------------------------------- LoRA target sets either side refuses

def test_the_arch_refuses_what_its_lora_files_cannot_hold_or_its_network_would_drop(aitk, tmp_path):
    """A network whose modules the family's file keys cannot write (HunyuanVideo 1.5's fused q / k / v with
    q alone: ComfyUI's `<stream>_attn_qkv` needs all three) is refused when ai-toolkit attaches it; a LoRA
    file with modules ai-toolkit's network does not adapt (our trainer's `head.head`, outside the blocks) is
    refused where ai-toolkit would set them aside and train without them."""
    from safetensors.torch import save_file
    from toolkit.config_modules import ModelConfig
    from toolkit.lora_special import LoRASpecialNetwork

    from video_dit.families.wan.loading import load_dit
    from video_dit.lora import add_lora, save_lora

    hy = aitk.VideoDiTModel(device="cpu", dtype="fp32", model_config=ModelConfig(
        name_or_path=str(helpers.write_hy15_base(tmp_path / "hy.safetensors", "tiny-hy15-t2v")), arch="video_dit",
        dtype="fp32", model_kwargs={"preset": "tiny-hy15-t2v"}))
    hy.load_model()
    q_only = LoRASpecialNetwork(hy.model, lora_dim=2, base_model=hy, target_lin_modules=hy.target_lora_modules,
                                only_if_contains=["img_attn_q"])
    with pytest.raises(ConfigError, match=r"^network: .*double_blocks\.0\.img.*needs adapters on all three"):
        hy.network = q_only
    hy.network = LoRASpecialNetwork(hy.model, lora_dim=2, base_model=hy, target_lin_modules=hy.target_lora_modules,
                                    only_if_contains=["img_attn_q", "img_attn_k", "img_attn_v"])  # whole: attached

    dit = helpers.randomize_head(load_dit("preset:tiny"))
    base = tmp_path / "base.safetensors"
    save_file({k: v.contiguous() for k, v in dit.state_dict().items()}, str(base))
    wide = save_lora(tmp_path / "wide.safetensors", add_lora(dit, 2, targets=r"head\.head|blocks\.0\.ffn\.0"), 2.0)
    sd = aitk.VideoDiTModel(device="cpu", dtype="fp32", model_config=ModelConfig(
        name_or_path=str(base), arch="video_dit", dtype="fp32", model_kwargs={"preset": "tiny"}))
    sd.load_model()
    net = LoRASpecialNetwork(sd.model, lora_dim=2, base_model=sd, target_lin_modules=sd.target_lora_modules)
    sd.network = net
    with pytest.raises(WeightsError, match=r"1 modules ai-toolkit's network does not adapt \(head\.head\).*"
                                           r"transformer_only: false"):
        net.load_weights(str(wide))
    everything = LoRASpecialNetwork(sd.model, lora_dim=2, base_model=sd, target_lin_modules=sd.target_lora_modules,
                                    transformer_only=False)
    sd.network = everything
    everything.apply_to()  # (ai-toolkit loads a network's weights once it is applied)
    assert everything.load_weights(str(wide)) is None  # transformer_only: false adapts head.head: loaded


# ---------------------------------------------------------------- saved sources

def test_saved_sources_are_absolute_and_a_relative_one_is_read_from_the_folder(tmp_path, monkeypatch):
    """Both trainers record absolute paths (`ModelSpec.sources`); a relative path in a sources file (written
    by hand, or a folder moved with its parts) is relative to the saved folder, whatever the working
    directory."""
    from video_dit.families.wan.loading import load_dit
    from video_dit.models.saved import write_model
    from video_dit.families.wan import FAMILY as WAN
    from video_dit.spec import CLI_KEYS, JOB_KEYS, Request, resolve

    monkeypatch.chdir(tmp_path)
    vae = Path("vae_here.safetensors")
    from video_dit.families.wan.loading import load_vae
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in load_vae("preset:tiny").state_dict().items()}, str(vae))
    spec = resolve(Request("preset:tiny", vae=str(vae)), JOB_KEYS)
    assert spec.sources()["vae"] == str(tmp_path / vae)  # given relative, recorded absolute
    folder = tmp_path / "saved"
    write_model(folder, {None: load_dit("preset:tiny")}, torch.float32, WAN, {},
                {"preset": "tiny", "vae": "../vae_here.safetensors", "text_encoder": "preset:tiny"})
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    again = resolve(Request(str(folder), preset_required=False), CLI_KEYS)
    assert Path(again.vae).resolve() == (tmp_path / vae).resolve()
    (folder / "video_dit_sources.json").write_text(json.dumps({"preset": "tiny", "vae": "gone.safetensors",
                                                              "text_encoder": "preset:tiny"}))
    with pytest.raises(ConfigError, match=r"names the vae .*saved/gone\.safetensors, which does not exist here"):
        resolve(Request(str(folder), preset_required=False), CLI_KEYS).vae
