"""Resuming with a changed job, and what a run leaves behind: the LR schedule when
train.steps changes (the rule of `engine.LRSchedule.extended`, checked against the formula written
out here), schedule changes that are refused before any rank starts, metrics.jsonl kept as the
run's history, log lines never glued to the progress bar, plots written when a job finishes.
The same rule through real DeepSpeed ranks is checked by tests/faults/test_launcher_signals.py."""

from __future__ import annotations

import io
import json
import math
import types
from pathlib import Path

import pytest
import torch
import yaml

from video_dit.train import engine as eng


def _cosine(s, start, total, scale=1.0):
    return scale * 0.5 * (1 + math.cos(math.pi * min(1.0, (s - start) / (total - start))))


def _train_cfg(steps, warmup=2, kind="cosine", lr=1e-2):
    from video_dit.train.config import TrainConfig

    return TrainConfig(steps=steps, warmup_steps=warmup, lr_scheduler=kind, lr=lr)


def _run(optimizer, scheduler, steps) -> list[float]:
    """The LR each optimizer step trains at (as the trainer logs it: get_last_lr() before the step),
    checked against the LR the optimizer really uses."""
    out = []
    for _ in range(steps):
        lr = scheduler.get_last_lr()[0]
        assert optimizer.param_groups[0]["lr"] == lr
        out.append(lr)
        optimizer.step()
        scheduler.step()
    return out


def _resumed(cfg, params, state, schedule):
    """An optimizer + scheduler rebuilt for `cfg` and loaded from `state` the way DeepSpeed's
    load_checkpoint does (optimizer state dict, then the scheduler's), then `sync_lr`."""
    optimizer, scheduler = eng.build_optimizer(params, cfg, schedule)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    eng.sync_lr(scheduler)
    return optimizer, scheduler


@pytest.mark.parametrize("stop", [6, 4], ids=["finished", "interrupted"])
def test_raising_steps_on_resume_follows_the_documented_rule(stop):
    """6-step cosine run (warmup 2, lr 1e-2) checkpointed at `stop`, resumed with train.steps 10."""
    lr, w = 1e-2, 2
    params = [torch.nn.Parameter(torch.zeros(3))]
    optimizer, scheduler = eng.build_optimizer(params, _train_cfg(6))
    first = _run(optimizer, scheduler, stop)
    assert first == pytest.approx([lr * (s + 1) / w if s < w else lr * _cosine(s, w, 6) for s in range(stop)],
                                  rel=1e-12)
    state = {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}
    old = eng.LRSchedule("cosine", w, 6)
    new = old.extended(stop, 10)
    after = _run(*_resumed(_train_cfg(10), params, state, new), 10 - stop)
    # the rule: from the resumed step s0, c * (1 + cos(pi (s - s0) / (10 - s0))) / 2, with c the old
    # schedule's multiplier at s0 (no jump), or 1 when it had reached 0 (finished: a warm restart)
    c = _cosine(stop, w, 6) if stop < 6 else 1.0
    assert c == (1.0 if stop == 6 else pytest.approx(0.5))
    assert after == pytest.approx([lr * _cosine(s, stop, 10, c) for s in range(stop, 10)], rel=1e-12)
    if stop == 4:  # continuous: the first resumed step trains at what the old schedule gave it
        assert after[0] == pytest.approx(lr * _cosine(4, w, 6), rel=1e-12)
    assert min(after) > 0  # never a step at lr 0 (what DeepSpeed's restored LR gave before sync_lr)
    # a second resume of the extended run, same train.steps: the stored schedule continues
    stored = eng.LRSchedule(**json.loads(json.dumps(new.to_dict())))
    assert stored == new and stored.extended(8, 10) == new
    assert "no jump" in new.describe(stop, old) if stop == 4 else "warm restart" in new.describe(stop, old)


def test_stale_optimizer_lr_is_what_the_first_resumed_step_used_before():
    """Without `sync_lr` the first resumed step trains at the LR DeepSpeed restored: 0.0 after a
    finished cosine (the issue's "lr is 0.0 at step 151")."""
    params = [torch.nn.Parameter(torch.zeros(3))]
    optimizer, scheduler = eng.build_optimizer(params, _train_cfg(6))
    _run(optimizer, scheduler, 6)
    state = {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}
    o2, s2 = eng.build_optimizer(params, _train_cfg(10), eng.LRSchedule("cosine", 2, 6).extended(6, 10))
    o2.load_state_dict(state["optimizer"])
    s2.load_state_dict(state["scheduler"])
    assert o2.param_groups[0]["lr"] == 0.0 and s2.get_last_lr() == [0.0]
    eng.sync_lr(s2)
    assert o2.param_groups[0]["lr"] == s2.get_last_lr()[0] == pytest.approx(1e-2)


def test_rule_inside_the_warmup_and_for_a_constant_schedule():
    old = eng.LRSchedule("cosine", 4, 8)
    inside = old.extended(2, 20)  # resumed during the warmup: the warmup, then the cosine over 20 steps
    assert [inside(s) for s in range(20)] == pytest.approx(
        [(s + 1) / 4 if s < 4 else _cosine(s, 4, 20) for s in range(20)], rel=1e-12)
    const = eng.LRSchedule("constant", 2, 8).extended(5, 20)
    assert [const(s) for s in range(20)] == [0.5, 1.0] + [1.0] * 18


@pytest.mark.parametrize("key, value", [("lr", 5e-3), ("warmup_steps", 3), ("lr_scheduler", "constant")])
def test_other_schedule_changes_on_resume_are_refused_before_any_rank(tmp_path, capsys, key, value):
    from video_dit.train.validate import main

    data = tmp_path / "data"
    data.mkdir()
    from PIL import Image

    Image.new("RGB", (32, 32)).save(data / "a.png")
    train = {"steps": 10, "lr": 1e-2, "warmup_steps": 2, "lr_scheduler": "cosine"}
    job = {"job": "extension", "config": {"name": "j", "process": [{
        "type": "sd_trainer", "training_folder": str(tmp_path / "out"), "model": {"name_or_path": "preset:tiny"},
        "train": train, "datasets": [{"folder_path": str(data), "resolution": [32]}]}]}}
    ck = tmp_path / "out" / "j" / "checkpoints" / "step_000000006"
    ck.mkdir(parents=True)
    (ck / "meta.json").write_text(json.dumps({"step": 6, "world_size": 2, "zero_stage": 2, "lr": 1e-2,
                                              "lr_schedule": eng.LRSchedule("cosine", 2, 6).to_dict()}))
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    assert main([str(path)]) == 0  # train.steps 6 -> 10 alone is accepted (the rule above)
    train[key] = value
    path.write_text(yaml.safe_dump(job))
    assert main([str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"config.process[0].train.{key}: {value!r}, but checkpoint step 6 was trained with" in err
    assert "save.resume: none" in err and "step_000000006" in err


def test_metrics_file_is_the_runs_history(tmp_path):
    from video_dit.train.metrics import MetricsLog, read_metrics

    log = MetricsLog(tmp_path, enabled=True)
    for step in range(1, 7):
        log.write({"step": step, "loss": float(step)})
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 7, "lo')  # killed mid-line
    # resumed from the step-4 checkpoint: steps 5 and 6 are done again, so their old rows go
    log = MetricsLog(tmp_path, enabled=True, resume_step=4)
    for step in (5, 6):
        log.write({"step": step, "loss": 10.0 * step})
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [(r["step"], r["loss"]) for r in rows] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0), (5, 50.0), (6, 60.0)]
    MetricsLog(tmp_path, enabled=False, resume_step=0)  # other ranks never touch it
    assert len(read_metrics(tmp_path / "metrics.jsonl")) == 6
    MetricsLog(tmp_path, enabled=True, resume_step=0)  # a fresh start (resume: none) begins a new history
    assert read_metrics(tmp_path / "metrics.jsonl") == []


def _stub_trainer(out_dir: Path):
    from video_dit.train.trainer import Trainer

    trainer = Trainer.__new__(Trainer)
    trainer.rank0, trainer._log, trainer.step = True, print, 3
    trainer.job = types.SimpleNamespace(name="job")
    trainer.out_dir = out_dir
    return trainer


def test_log_lines_are_not_glued_to_the_progress_bar(tmp_path):
    trainer = _stub_trainer(tmp_path)
    stream = io.StringIO()
    bar = trainer._open_progress(10, file=stream)
    bar.update(1)
    trainer.log("step 4: saved checkpoint and LoRA")
    trainer._close_progress(bar)
    text = stream.getvalue()
    before = text[:text.index("[video_dit] step 4")]
    # the bar's line was cleared back to column 0 before the message (tqdm.write), not appended to
    assert before.endswith("\r") or before.endswith("\n"), repr(text[-300:])
    assert "[video_dit] step 4: saved checkpoint and LoRA\n" in text
    assert trainer._log is print


def test_a_finished_job_writes_its_plots_beside_the_metrics(tmp_path):
    """launch/train.py (rank 0, exit 0) calls write_plots on the job's output folder."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    from video_dit.commands.plot import write_plots
    from video_dit.train.metrics import MetricsLog

    root = Path(__file__).resolve().parents[1]
    deps = tomllib.loads((root / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(d.startswith("matplotlib") for d in deps)  # installed with the package, not an extra
    assert "write_plots(job.out_dir" in (root / "launch/train.py").read_text()
    log = MetricsLog(tmp_path, enabled=True)
    for step in range(1, 5):
        log.write({"step": step, "loss": 1.0 / step, "samples_per_s": 2.0, "tokens_per_s": 20.0, "peak_mem_gb": 1.0})
    lines = []
    drawn = write_plots(tmp_path, log=lines.append)
    assert sorted(p.name for p in tmp_path.glob("*.png")) == ["loss.png", "memory.png", "throughput.png"]
    assert sorted(p.name for p in drawn) == ["loss.png", "memory.png", "throughput.png"]
    assert lines and lines[0].startswith("[video_dit] plots: ")
    lines.clear()
    assert write_plots(tmp_path / "empty", log=lines.append) == [] and "no plots written" in lines[0]


def test_resume_hint_names_the_last_complete_checkpoint(tmp_path):
    from video_dit.train import checkpoint as ckpt

    d = tmp_path / "checkpoints"
    assert "no checkpoint yet" in ckpt.resume_hint(d)
    for step, done in ((2, True), (4, True), (6, False)):
        folder = d / (ckpt.tag_for(step) + ("" if done else ".tmp"))
        folder.mkdir(parents=True)
        if done:
            (folder / ckpt.META).write_text("{}")
    assert ckpt.resume_hint(d) == (f"last checkpoint {d / 'step_000000004'} (step 4); relaunch the same command "
                                   "to resume from it")
