"""`video-dit plot`: curves from a synthetic metrics.jsonl, bad lines skipped, smoothing."""

from __future__ import annotations

import json
import math

import pytest

pytest.importorskip("matplotlib")

from PIL import Image  # noqa: E402

from video_dit.cli import main as cli_main  # noqa: E402
from video_dit.commands.plot import ema, plot_metrics, read_metrics  # noqa: E402


def _write_metrics(path, n=20):
    lines = []
    for step in range(1, n + 1):
        lines.append(json.dumps({"step": step, "loss": 1.0 / step, "lr": 1e-4, "grad_norm": 0.5,
                                 "samples_per_s": 2.0 + step, "tokens_per_s": 100.0 * step,
                                 "tflops": 0.1, "mfu": 0.01, "peak_mem_gb": 0.1 * step}))
    lines.insert(5, "{not json")                       # corrupt line
    lines.insert(9, json.dumps({"loss": 3.0}))          # no step
    lines.insert(12, json.dumps([1, 2, 3]))             # not an object
    lines.append("")                                    # blank line: ignored silently
    lines.append('{"step": 21, "loss": 0.0')            # half-written last line of a running job
    path.write_text("\n".join(lines))


def test_plot_draws_expected_curves_and_skips_bad_lines(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    _write_metrics(run / "metrics.jsonl")
    with pytest.warns(UserWarning) as record:
        drawn = plot_metrics(run, smooth=0.8)
    skipped = [str(w.message) for w in record if "skipped" in str(w.message)]
    assert len(skipped) == 4 and all("metrics.jsonl:" in m for m in skipped)

    names = {p.name: p for p in drawn}
    assert set(names) == {"loss.png", "throughput.png", "memory.png"}
    for p in drawn:
        with Image.open(p) as im:
            assert im.size[0] > 300 and im.size[1] > 200
    steps = list(range(1, 21))
    loss = drawn[names["loss.png"]]
    assert loss["loss"] == (steps, [1.0 / s for s in steps])
    smoothed = loss["loss (EMA 0.8)"][1]
    assert smoothed == pytest.approx(ema([1.0 / s for s in steps], 0.8))
    assert smoothed[0] == pytest.approx(1.0)            # bias-corrected start
    assert all(s > r for s, r in zip(smoothed[1:], loss["loss"][1][1:]))  # lags a falling curve
    thr = drawn[names["throughput.png"]]
    assert thr["samples_per_s"][1] == [2.0 + s for s in steps]
    assert thr["tokens_per_s"][1] == [100.0 * s for s in steps]
    assert drawn[names["memory.png"]]["peak_mem_gb"][1] == pytest.approx([0.1 * s for s in steps])


def test_resume_duplicates_keep_last_and_per_rank_memory(tmp_path):
    f = tmp_path / "metrics.jsonl"
    rows = [{"step": 1, "loss": 2.0, "peak_mem_gb": [1.0, 1.5]}, {"step": 2, "loss": 9.0, "peak_mem_gb": [1.1, 1.6]},
            {"step": 2, "loss": 1.5, "peak_mem_gb": [1.2, 1.7]}, {"step": 3, "loss": 1.0, "peak_mem_gb": [1.3, 1.8]}]
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert [r["loss"] for r in read_metrics(f)] == [2.0, 1.5, 1.0]
    with pytest.warns(UserWarning, match="throughput.png not written"):
        drawn = plot_metrics(f, tmp_path / "png", smooth=0.0)
    names = {p.name: v for p, v in drawn.items()}
    assert "throughput.png" not in names and (tmp_path / "png" / "memory.png").is_file()
    assert names["loss.png"]["loss (EMA 0)"][1] == [2.0, 1.5, 1.0]  # weight 0 = no smoothing
    assert names["memory.png"]["rank 0"][1] == [1.0, 1.2, 1.3]
    assert names["memory.png"]["rank 1"][1] == [1.5, 1.7, 1.8]


def test_ema_skips_nonfinite_and_rejects_bad_weight():
    out = ema([1.0, float("nan"), 3.0], 0.5)
    assert out[0] == 1.0 and math.isnan(out[1])
    assert out[2] == pytest.approx((0.5 * 0.5 * 1.0 + 0.5 * 3.0) / 0.75)
    with pytest.raises(ValueError, match="outside"):
        ema([1.0], 1.0)


def test_cli_errors_and_success(tmp_path, capsys):
    assert cli_main(["plot", str(tmp_path)]) == 2
    assert "metrics.jsonl: no such file" in capsys.readouterr().out
    (tmp_path / "metrics.jsonl").write_text("garbage\n")
    with pytest.warns(UserWarning):
        assert cli_main(["plot", str(tmp_path)]) == 2
    assert "no usable records" in capsys.readouterr().out
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 1.0, "samples_per_s": 1.0,
                                                        "tokens_per_s": 2.0, "peak_mem_gb": 0.5}) + "\n")
    assert cli_main(["plot", str(tmp_path)]) == 0
    assert (tmp_path / "loss.png").is_file() and str(tmp_path / "memory.png") in capsys.readouterr().out


def test_missing_matplotlib_is_a_clear_error(tmp_path, monkeypatch):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 1.0}) + "\n")
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)  # import matplotlib -> ImportError
    with pytest.raises(RuntimeError, match="pip install matplotlib"):
        plot_metrics(tmp_path)


def test_validation_loss_is_drawn_beside_the_training_loss(tmp_path):
    rows = [{"step": 0, "val_loss": 2.0, "val_loss@1": 2.5}]
    rows += [{"step": s, "loss": 1.0 / s, "samples_per_s": 1.0, "peak_mem_gb": 0.1,
              **({"val_loss": 2.0 / s, "val_loss_ema": 1.5 / s} if s % 5 == 0 else {})} for s in range(1, 21)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    drawn = {p.name: d for p, d in plot_metrics(tmp_path).items()}
    loss = drawn["loss.png"]
    assert loss["loss"][0] == list(range(1, 21))  # the step-0 line holds no training loss
    assert loss["val_loss (held out)"] == ([0, 5, 10, 15, 20], [2.0, 0.4, 0.2, 2.0 / 15, 0.1])
    assert loss["val_loss_ema (held out)"] == ([5, 10, 15, 20], [0.3, 0.15, 0.1, 0.075])


def test_each_streams_validation_loss_is_drawn_in_a_second_panel(tmp_path):
    """A model with sound logs val_loss_video / val_loss_audio (and their _ema twins, train/validation.py):
    loss.png gets a second panel holding exactly those series, at their steps; a run without them keeps one."""
    rows = [{"step": s, "loss": 1.0 / s,
             **({"val_loss": 3.0 / s, "val_loss_video": 2.0 / s, "val_loss_audio": 1.0 / s,
                 "val_loss_video_ema": 1.8 / s, "val_loss_audio_ema": 0.9 / s} if s % 4 == 0 else {})}
            for s in range(1, 13)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    import matplotlib.pyplot as plt

    made = []
    subplots = plt.subplots

    def spy(*args, **kwargs):
        fig, axes = subplots(*args, **kwargs)
        made.append(fig)
        return fig, axes

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(plt, "subplots", spy)
        loss = plot_metrics(tmp_path)[tmp_path / "loss.png"]
    steps = [4, 8, 12]
    for key, scale in (("val_loss_video", 2.0), ("val_loss_audio", 1.0), ("val_loss_video_ema", 1.8),
                       ("val_loss_audio_ema", 0.9)):
        assert loss[f"{key} (held out)"] == (steps, [scale / s for s in steps])
    panels = [[line.get_label() for line in ax.get_lines()] for ax in made[0].axes]
    assert len(panels) == 2 and "val_loss (held out)" in panels[0]
    assert sorted(panels[1]) == sorted(f"{k} (held out)" for k in ("val_loss_video", "val_loss_audio",
                                                                    "val_loss_video_ema", "val_loss_audio_ema"))

    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps({"step": r["step"], "loss": r["loss"]})
                                                      for r in rows))
    made.clear()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(plt, "subplots", spy)
        plot_metrics(tmp_path)
    assert len(made[0].axes) == 1  # no stream losses: one panel
