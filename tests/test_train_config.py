"""The job config of the DeepSpeed trainer: ai-toolkit's YAML, typed; bad values exit 2 before any rank.

Single-process and quick: parsing, validation, the DeepSpeed JSON, the LR schedule, checkpoint
bookkeeping, and `launch/train.sh` refusing a bad config before it spawns ranks.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
import yaml

from video_dit.families.wan.dit import LORA_TARGETS as WAN_LORA_TARGETS
from video_dit.train.config import IGNORED, parse_job
from video_dit.typed_config import ConfigError

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture()
def folder(tmp_path):
    """A dataset folder that passes the existence checks (one image), and a control image."""
    from PIL import Image

    d = tmp_path / "data"
    d.mkdir()
    Image.new("RGB", (32, 32)).save(d / "a.png")
    (d / "a.txt").write_text("a black square")
    (d / "base.safetensors").write_bytes(b"")  # trained weights as far as the config checks look (never loaded)
    return d


def base_job(folder: Path, tmp_path: Path) -> dict:
    return {"job": "extension", "config": {"name": "j", "process": [{
        "type": "sd_trainer", "training_folder": str(tmp_path / "out"),
        "network": {"type": "lora", "linear": 4, "linear_alpha": 4},
        "datasets": [{"folder_path": str(folder), "resolution": [32]}],
        "train": {"steps": 3, "lr": "1e-4"},
        "model": {"arch": "video_dit", "name_or_path": str(folder / "base.safetensors"), "preset": "tiny"},
        "sample": {"width": 32, "height": 32, "samples": [{"prompt": "x", "ctrl_img": str(folder / "a.png")}]},
    }]}}


def with_key(job: dict, path: str, value) -> dict:
    job = copy.deepcopy(job)
    node = job["config"]["process"][0]
    *parents, last = path.split(".")
    for p in parents:
        node = node.setdefault(p, {})
    node[last] = value
    return job


def error_of(job: dict) -> str:
    with pytest.raises(ConfigError) as exc:
        parse_job(job)
    return str(exc.value)


def test_parses_ai_toolkit_keys_and_ours(folder, tmp_path):
    job = base_job(folder, tmp_path)
    job = with_key(job, "device", "cuda:0")
    job = with_key(job, "train.noise_scheduler", "flowmatch")
    job = with_key(job, "train.train_unet", True)
    job = with_key(job, "train.train_text_encoder", False)
    job = with_key(job, "train.cache_text_embeddings", True)
    job = with_key(job, "train.gradient_accumulation_steps", 2)
    job = with_key(job, "deepspeed", {"zero_stage": 3, "offload_param": True, "sequence_parallel_size": 2,
                                      "config": {"zero_optimization": {"reduce_bucket_size": 123}}})
    job["meta"] = {"name": "[name]", "version": "1.0"}
    parsed = parse_job(job)
    p = parsed.process
    assert p.train.lr == 1e-4 and p.train.gradient_accumulation == 2 and p.model.preset == "tiny"
    assert p.deepspeed.zero_stage == 3 and p.network.alpha == 4.0 and parsed.meta["version"] == "1.0"
    assert "device" in IGNORED["process"] and "noise_scheduler" in IGNORED["train"]

    from video_dit.parallel.zero import ds_config

    cfg = ds_config(parsed, world_size=4)
    assert cfg["train_batch_size"] == 1 * 2 * 2  # micro batch x accumulation x data-parallel ranks (4 / SP 2)
    assert cfg["zero_optimization"]["stage"] == 3 and cfg["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert cfg["zero_optimization"]["reduce_bucket_size"] == 123  # the user's JSON is merged last
    assert "optimizer" not in cfg and cfg["bf16"]["enabled"] is False


@pytest.mark.parametrize("path, value, key, accepted", [
    ("train.gradient_checkpoint", True, "train.gradient_checkpoint", "did you mean 'gradient_checkpointing'"),
    ("deepspeed.zero_stage", 4, "deepspeed.zero_stage", "0, 1, 2, 3"),
    ("network.linear", 0, "network.linear", "positive"),
    ("deepspeed.sequence_parallel_size", 3, "deepspeed.sequence_parallel_size", "1, 2, 4"),
    ("model.quantize", True, "model.quantize", "zero_stage 0, 1 or 2"),
    ("train.timestep_type", "sigmod", "train.timestep_type", "did you mean 'sigmoid'"),
    ("model.name_or_path", "preset:tiny2", "model.name_or_path", "preset:tiny"),
    ("model.name_or_path", "preset:tiny", "network", "full fine-tune (remove the network block), or LoRA on trained"),
    ("train.learning_rate", 1e-4, "train.learning_rate", "did you mean 'lr'"),
    ("network.rank", 8, "network.rank", "did you mean 'linear'"),
    ("train.optimizer", "adamw8bit", "train.optimizer", "'adamw'"),
    ("train.recompute_saved", False, "train.recompute_saved", "sequence_parallel_size 1"),
])
def test_bad_values_name_the_key_and_what_is_accepted(folder, tmp_path, path, value, key, accepted):
    job = with_key(base_job(folder, tmp_path), path, value)
    if path == "model.quantize":  # quantize + ZeRO-3 is impossible (quanto tensors cannot be partitioned)
        job = with_key(job, "deepspeed.zero_stage", 3)
    if path == "train.recompute_saved":  # not modelled by the memory plan under sequence parallelism
        job = with_key(job, "deepspeed.sequence_parallel_size", 2)
    msg = error_of(job)
    assert msg.startswith(f"config.process[0].{key}"), msg
    assert accepted in msg, msg


def test_the_reason_lora_on_a_preset_is_refused():
    """What the refusal above says, computed: a preset's random init has a zero output layer, so every
    LoRA gradient of a step is exactly 0 (the adapters would never move); the same DiT with a non-zero
    head (as trained weights have) gives the adapters gradients."""
    from helpers import randomize_head

    from video_dit import lora
    from video_dit.families.wan.loading import load_dit

    def lora_grads(dit):
        lora.add_lora(dit, 4, targets=WAN_LORA_TARGETS)
        gen = torch.Generator().manual_seed(0)
        c = dit.config
        out = dit(torch.randn(1, c.in_dim, 2, 8, 8, generator=gen), torch.tensor([500.0]),
                  [torch.randn(5, c.text_dim, generator=gen)])
        (out - torch.randn(out.shape, generator=gen)).pow(2).mean().backward()
        return [p.grad for p in dit.parameters() if p.requires_grad]

    grads = lora_grads(load_dit("preset:tiny"))
    assert grads and all(torch.count_nonzero(g) == 0 for g in grads)
    assert any(torch.count_nonzero(g) > 0 for g in lora_grads(randomize_head(load_dit("preset:tiny"))))


def test_file_checks_name_the_key(folder, tmp_path):
    from video_dit.train.validate import check_paths

    job = with_key(base_job(folder, tmp_path), "sample.samples", [{"prompt": "x", "ctrl_img": "missing.png"}])
    with pytest.raises(ConfigError, match=r"sample\.samples\[0\]\.ctrl_img"):
        check_paths(parse_job(job))
    job = with_key(base_job(folder, tmp_path), "model.vae_path", str(tmp_path / "nope.safetensors"))
    with pytest.raises(ConfigError, match=r"model\.vae_path"):
        check_paths(parse_job(job))
    empty = tmp_path / "empty"
    empty.mkdir()
    msg = error_of(with_key(base_job(folder, tmp_path), "datasets", [{"folder_path": str(empty)}]))
    assert "datasets[0].folder_path" in msg


def test_train_sh_refuses_a_bad_config_before_any_rank(folder, tmp_path):
    bad = with_key(base_job(folder, tmp_path), "deepspeed.zero_stage", 4)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(bad))
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([str(ROOT / "launch/train.sh"), str(path)], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "config.process[0].deepspeed.zero_stage" in proc.stderr and "0, 1, 2, 3" in proc.stderr
    assert "launch.py" not in proc.stderr and not (tmp_path / "out").exists()  # no launcher, no rank


@pytest.mark.parametrize("dp, batch, accumulation", [(1, 8, 2), (2, 8, 1), (4, 4, 1), (8, 2, 1), (16, 1, 1)])
def test_global_batch_size_splits_over_the_ranks(folder, tmp_path, dp, batch, accumulation):
    """16 at `batch_size: 8`: micro-batch x accumulation x data-parallel ranks is 16 on every rank count,
    the micro-batch the largest <= 8; DeepSpeed's train_batch_size says the same (SP 2: twice the ranks)."""
    from video_dit.parallel.zero import ds_config

    job = with_key(base_job(folder, tmp_path), "train.batch_size", 8)
    job = parse_job(with_key(job, "train.global_batch_size", 16))
    t = job.for_ranks(dp).process.train
    assert (t.batch_size, t.gradient_accumulation) == (batch, accumulation)
    assert t.batch_size * t.gradient_accumulation * dp == 16
    assert job.process.train.batch_size == 8  # the parsed job is left as written
    sp = parse_job(with_key(with_key(job.raw, "deepspeed", {"sequence_parallel_size": 2}),
                            "train.global_batch_size", 16))
    cfg = ds_config(sp.for_ranks(2 * dp), world_size=2 * dp)
    assert (cfg["train_batch_size"], cfg["gradient_accumulation_steps"]) == (16, accumulation)
    plain = parse_job(base_job(folder, tmp_path))
    assert plain.for_ranks(3) is plain  # without it, nothing changes


def test_global_batch_size_refusals_name_the_key(folder, tmp_path, monkeypatch, capsys):
    job = with_key(base_job(folder, tmp_path), "train.global_batch_size", 16)
    msg = error_of(with_key(job, "train.gradient_accumulation", 2))
    assert "train.global_batch_size" in msg and "give only one of them" in msg
    assert "must be >= 1" in error_of(with_key(job, "train.global_batch_size", 0))
    with pytest.raises(ConfigError) as exc:
        parse_job(job).for_ranks(3)
    msg = str(exc.value)
    assert "config.process[0].train.global_batch_size" in msg
    assert "16 does not split evenly over 3 data-parallel ranks" in msg and "1, 2, 4, 8, 16" in msg
    # train.sh: 2 CPU ranks and a global batch of 3 exit 2 before any rank starts
    from video_dit.train import launcher

    path = tmp_path / "odd.yaml"
    path.write_text(yaml.safe_dump(with_key(job, "train.global_batch_size", 3)))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert launcher.main([str(path)]) == 2
    err = capsys.readouterr().err
    assert "train.global_batch_size: 3 does not split evenly over 2 data-parallel ranks" in err
    assert not (tmp_path / "out").exists()


def readme_example_table() -> dict[str, dict[str, str]]:
    """The README's table of example configs: {file name: {column: cell}}."""
    lines = (ROOT / "README.md").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| config | preset |"))
    header = [c.strip() for c in lines[start].strip("|").split("|")]
    rows = {}
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0].strip("`")] = dict(zip(header, cells))
    return rows


def test_example_configs_match_the_readme(folder, tmp_path):
    """Every example config parses, and sets what the README's table says: preset, LoRA rank or full
    fine-tune, i2v mode, ZeRO stage, SP degree, dtype, the timestep range and the experts trained (A14B)."""
    from video_dit.families import get_preset
    from video_dit.train.experts import requested

    table = readme_example_table()
    assert sorted(table) == sorted(p.name for p in (ROOT / "configs").glob("*.yaml"))  # every file, no stale row
    for name, row in table.items():
        data = yaml.safe_load((ROOT / "configs" / name).read_text())
        process = data["config"]["process"][0]
        for d in process["datasets"]:
            d["folder_path"] = str(folder)  # the examples point at the user's data
        p = parse_job(data, name).process
        got = {"preset": f"`{p.model.preset}`",
               "training": "full" if p.network is None else f"LoRA {p.network.linear}",
               "i2v": p.i2v_mode if any(d.do_i2v for d in p.datasets) else "-",
               "ZeRO": str(p.deepspeed.zero_stage), "SP": str(p.deepspeed.sequence_parallel_size),
               "dtype": p.train.dtype, "timesteps": f"{p.train.min_t:g}-{p.train.max_t:g}",
               "experts": {(): "-", ("high_noise",): "high-noise", ("low_noise",): "low-noise",
                           ("high_noise", "low_noise"): "both"}[requested(p.model, get_preset(p.model.preset))]}
        want = dict(row, timesteps=row["timesteps"].split(" ")[0])  # "900-1000 (high-noise expert)"
        assert got == {k: want[k] for k in got}, (name, got, want)


def test_lr_schedule():
    from video_dit.train.engine import lr_lambda

    f = lr_lambda(warmup_steps=4, total_steps=14, kind="cosine")
    assert [f(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert f(9) == pytest.approx(0.5) and f(14) == pytest.approx(0.0)
    assert lr_lambda(2, 10, "constant")(9) == 1.0


def test_latest_ignores_half_written_checkpoints(tmp_path):
    from video_dit.train import checkpoint as ckpt

    d = tmp_path / "checkpoints"
    for step, complete in ((10, True), (20, True), (30, False)):
        folder = d / (ckpt.tag_for(step) + ("" if complete else ".tmp"))
        folder.mkdir(parents=True)
        if complete:
            (folder / ckpt.META).write_text(json.dumps({"step": step, "world_size": 2, "zero_stage": 2}))
    (d / "step_000000040").mkdir()  # renamed by hand but without meta.json: not complete
    (d / ckpt.LATEST).write_text("step_000000030")  # a stale pointer
    with pytest.warns(UserWarning, match="not a complete checkpoint"):
        assert ckpt.find_latest(d).name == "step_000000020"
    with pytest.warns(UserWarning, match="incomplete checkpoint"):
        assert [p.name for p in ckpt.clean_incomplete(d)] == ["step_000000030.tmp"]
    # another world size at ZeRO-2: a clear error with the conversion command
    with pytest.warns(UserWarning):
        with pytest.raises(ckpt.ResumeError, match="ds_to_universal --input_folder"):
            ckpt.plan_resume("auto", d, world_size=1, zero_stage=2)


def test_rng_state_round_trips():
    import random

    import numpy as np

    from video_dit.train import checkpoint as ckpt

    state = json.loads(json.dumps(ckpt.rng_state()))
    a = (random.random(), np.random.rand(), torch.rand(1).item())
    ckpt.set_rng_state(state)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == a
