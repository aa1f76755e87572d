"""`video-dit sample --model <full fine-tune export>`: the export records its preset and where
its VAE and text encoder came from, so no other flag is needed; errors are one line, no traceback."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import randomize_head

from video_dit.cli import main as cli_main
from video_dit.families.wan import FAMILY as WAN

COMMON = ["--prompt", "a red square moving right", "--frames", "1", "--height", "16", "--width", "16",
          "--steps", "2", "--cfg", "1"]


@pytest.fixture()
def export_folder(tmp_path, monkeypatch):
    from video_dit.families.wan.loading import load_dit
    from video_dit.train import export

    monkeypatch.setattr(export.dist, "get_rank", lambda: 0)  # one process; nothing is gathered at ZeRO-0
    dit = randomize_head(load_dit("preset:tiny", seed=3))
    sources = {"preset": "tiny", "vae": "preset:tiny", "text_encoder": "preset:tiny", "i2v_mode": "replace"}
    folder = export.export_full(dit, 0, tmp_path / "job_000000010", torch.float32, {"step": "10"}, sources=sources,
                                storage=WAN.arch.param_dtypes)
    assert json.loads((folder / "video_dit_sources.json").read_text()) == sources
    return folder


def test_an_export_samples_with_no_other_flag(export_folder, tmp_path, capsys):
    out = {k: tmp_path / f"{k}.mp4" for k in ("bare", "explicit", "shift5")}
    assert cli_main(["sample", "--model", str(export_folder), *COMMON, "--out", str(out["bare"])]) == 0
    explicit = ["--preset", "tiny", "--vae", "preset:tiny", "--text-encoder", "preset:tiny"]
    assert cli_main(["sample", "--model", str(export_folder), *explicit, *COMMON, "--out", str(out["explicit"])]) == 0
    assert out["bare"].read_bytes() == out["explicit"].read_bytes()  # media files are byte-identical for equal frames
    # the recorded preset matters: its sampling shift (tiny: 3), not the 5 of a model without a preset
    assert cli_main(["sample", "--model", str(export_folder), *explicit, *COMMON, "--shift", "5",
                     "--out", str(out["shift5"])]) == 0
    assert out["shift5"].read_bytes() != out["bare"].read_bytes()


def test_an_export_renders_with_the_settings_its_previews_used(export_folder, tmp_path):
    """What the trainer records (`preview_sampling`) becomes the default of every flag left out."""
    sources = json.loads((export_folder / "video_dit_sources.json").read_text())
    shown = {"solver": "euler", "steps": 2, "shift": 7.0, "guidance": 1.0, "negative": "", "grid": "wan",
             "frames": 1, "height": 16, "width": 16, "fps": 8, "seed": 4, "dtype": "bfloat16", "vae_dtype": "float32"}
    (export_folder / "video_dit_sources.json").write_text(json.dumps({**sources, "sampling": shown}))
    bare, explicit = tmp_path / "bare.mp4", tmp_path / "explicit.mp4"
    assert cli_main(["sample", "--model", str(export_folder), "--prompt", "a red square", "--out", str(bare)]) == 0
    flags = ["--solver", "euler", "--steps", "2", "--shift", "7", "--cfg", "1", "--frames", "1", "--height", "16",
             "--width", "16", "--fps", "8", "--seed", "4", "--dtype", "bfloat16", "--vae-dtype", "float32",
             "--preset", "tiny", "--vae", "preset:tiny", "--text-encoder", "preset:tiny"]
    (export_folder / "video_dit_sources.json").write_text(json.dumps(sources))  # nothing recorded: flags only
    assert cli_main(["sample", "--model", str(export_folder), "--prompt", "a red square", *flags,
                     "--out", str(explicit)]) == 0
    assert bare.read_bytes() == explicit.read_bytes()
    # the recorded dtype matters (a bf16 job's previews ran the DiT in bf16): float32 renders other frames
    fp32 = tmp_path / "fp32.mp4"
    assert cli_main(["sample", "--model", str(export_folder), "--prompt", "a red square",
                     *[f if f != "bfloat16" else "float32" for f in flags], "--out", str(fp32)]) == 0
    assert fp32.read_bytes() != bare.read_bytes()


def test_sample_errors_are_one_line(export_folder, tmp_path, capsys):
    sources = export_folder / "video_dit_sources.json"
    sources.write_text(json.dumps({"preset": "tiny", "vae": str(tmp_path / "gone_vae.safetensors"),
                                   "text_encoder": "preset:tiny"}))
    capsys.readouterr()
    assert cli_main(["sample", "--model", str(export_folder), *COMMON, "--out", str(tmp_path / "x.mp4")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"video-dit sample: error: --model {export_folder}: its video_dit_sources.json names the "
                          f"vae {tmp_path / 'gone_vae.safetensors'}, which does not exist here; pass --vae")
    sources.unlink()  # an export without it (older): says what to pass
    assert cli_main(["sample", "--model", str(export_folder), *COMMON, "--out", str(tmp_path / "x.mp4")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot tell which VAE to use" in err and "pass --vae" in err
    assert cli_main(["sample", "--model", str(tmp_path / "nope"), *COMMON, "--out", str(tmp_path / "x.mp4")]) == 2
    assert "no such file or folder" in capsys.readouterr().err
