"""A new user's real footage, checked before any rank starts: sources smaller than their
resolution are not upscaled by default (the factor is reported), `num_frames` longer than every clip
is refused naming the longest one, stills in a do_i2v dataset train unconditioned (and are skipped
with one warning in a concat i2v job), a folder is read recursively as ai-toolkit reads it, partial
cache files of a killed run are removed, data warnings are one line."""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image

from video_dit import media
from video_dit.data.buckets import bucket_size
from video_dit.data.dataset import DataError, DatasetConfig, DataWarning, scan_dataset, scan_datasets
from video_dit.typed_config import parse


def _clip(path: Path, frames: int, w: int, h: int, fps: float = 16) -> Path:
    rng = np.random.default_rng(frames * 1000 + w)
    return media.write_video(rng.integers(0, 255, (frames, h, w, 3), dtype=np.uint8), path, fps=fps)


def _cfg(folder: Path, **kw) -> DatasetConfig:
    return parse(DatasetConfig, {"folder_path": str(folder), "num_frames": 9, "resolution": [64], **kw},
                 "config.process[0].datasets[0]")


def test_small_sources_train_at_their_own_size_unless_upscaling_is_allowed(tmp_path):
    _clip(tmp_path / "small.mp4", 9, 176, 144)   # far below the resolution
    _clip(tmp_path / "big.mp4", 9, 384, 224)     # above it: downscaled as before
    Image.new("RGB", (8, 8)).save(tmp_path / "tiny.png")  # below one 16-px cell: cannot avoid upscaling
    scan = scan_dataset(_cfg(tmp_path, resolution=[256]), 16, verbose=False)
    items = {Path(it.path).name: it for it in scan.items}
    assert set(items) == {"small.mp4", "big.mp4"}
    small = items["small.mp4"]
    _, H, W = small.bucket
    assert W <= 176 and H <= 144 and W % 16 == 0 and H % 16 == 0 and small.upscale <= 1.0
    assert (H, W) == (144, 176)  # 11 x 9 cells: the source's own size is on the grid
    assert items["big.mp4"].bucket[1:] == bucket_size(384, 224, 256, 16) and items["big.mp4"].upscale < 1.0
    assert "cell" in dict((Path(p).name, r) for p, r in scan.skipped)["tiny.png"]
    # the factor avoided, against the bucket the resolution asks for
    H0, W0 = bucket_size(176, 144, 256, 16)
    factor = max(W0 / 176, H0 / 144)
    assert factor > 1.2
    assert any(f"up to {factor:.1f}x: small.mp4 at resolution 256" in n for n in scan.notes())
    assert f"up to {factor:.1f}x" in scan.summary()
    # allow_upscale: the resolution's bucket, with a warning naming the factor
    up = scan_dataset(_cfg(tmp_path, resolution=[256], allow_upscale=True), 16, verbose=False)
    upsmall = next(it for it in up.items if it.path.endswith("small.mp4"))
    assert upsmall.bucket[1:] == (H0, W0) and upsmall.upscale == pytest.approx(factor)
    th, tw = bucket_size(8, 8, 256, 16)  # the worst: the 8x8 still
    assert f"warning: 2 item(s) are upscaled (allow_upscale: true), up to {tw / 8:.1f}x (tiny.png: 8x8 -> " \
           f"{tw}x{th})" in up.notes()


def test_inspect_data_warns_with_the_upscale_factor(tmp_path, capsys):
    from video_dit.cli import main as cli_main

    data = tmp_path / "data"
    data.mkdir()
    _clip(data / "small.mp4", 9, 176, 144)
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({"job": "extension", "config": {"name": "j", "process": [{
        "type": "sd_trainer", "model": {"name_or_path": "preset:tiny"},
        "datasets": [{"folder_path": str(data), "num_frames": 9, "resolution": [2048]}]}]}}))
    assert cli_main(["inspect-data", str(job)]) == 0
    H0, W0 = bucket_size(176, 144, 2048, 16)
    assert f"up to {max(W0 / 176, H0 / 144):.1f}x: small.mp4" in capsys.readouterr().out


def test_num_frames_longer_than_every_clip_is_refused_naming_the_longest(tmp_path):
    _clip(tmp_path / "a.mp4", 9, 32, 32, fps=8)
    _clip(tmp_path / "b.mp4", 13, 32, 32, fps=8)
    Image.new("RGB", (32, 32)).save(tmp_path / "still.png")  # stills remain, but the job asked for video
    with pytest.raises(DataError, match=r"datasets\[0\]\.num_frames: 17 is longer than every clip.*the longest, "
                                        r"b\.mp4, has 13 frames at 8 fps.*num_frames <= 13"):
        scan_dataset(_cfg(tmp_path, num_frames=17, resolution=[32]), 16, verbose=False)
    # consecutive frames at the dataset fps (16 from an 8 fps clip: every frame taken twice): at most
    # round((n - 1) * 8 / 16) <= 12, so n - 1 <= 24 -> 25 frames
    with pytest.raises(DataError, match=r"num_frames: 33 is longer.*at most 25 frames.*num_frames <= 25"):
        scan_dataset(_cfg(tmp_path, num_frames=33, resolution=[32], shrink_video_to_frames=False, fps=16), 16,
                     verbose=False)
    # one clip long enough: the short one is skipped with a warning, as before
    scan = scan_dataset(_cfg(tmp_path, num_frames=13, resolution=[32]), 16, verbose=False)
    assert sorted(Path(it.path).name for it in scan.items) == ["b.mp4", "still.png"]


def test_validation_refuses_it_before_any_rank(tmp_path, capsys):
    from video_dit.train.validate import main

    data = tmp_path / "data"
    data.mkdir()
    _clip(data / "a.mp4", 9, 32, 32)
    job = {"job": "extension", "config": {"name": "j", "process": [{
        "type": "sd_trainer", "training_folder": str(tmp_path / "out"),
        "model": {"name_or_path": "preset:tiny"}, "train": {"steps": 2},
        "datasets": [{"folder_path": str(data), "num_frames": 81, "resolution": [32]}]}]}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    assert main([str(tmp_path / "job.yaml")]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "config.process[0].datasets[0].num_frames: 81 is longer than every clip" in err and "a.mp4" in err


def test_stills_in_an_i2v_dataset_are_unconditioned_and_said_so(tmp_path):
    _clip(tmp_path / "clip.mp4", 9, 32, 32)
    Image.new("RGB", (32, 32)).save(tmp_path / "still.png")
    scan = scan_datasets([_cfg(tmp_path, resolution=[32], do_i2v=True)], 16, verbose=False, i2v_mode="replace")
    cond = {Path(it.path).name: it.conditioned for it in scan.items}
    assert cond == {"clip.mp4": True, "still.png": False}
    assert any("1 still image(s) in do_i2v datasets train unconditioned" in n and "still.png" in n
               for n in scan.notes())
    t2v = scan_dataset(_cfg(tmp_path, resolution=[32]), 16, verbose=False)
    assert not any(it.conditioned for it in t2v.items) and not t2v.notes()
    # a concat i2v model (in_dim 36) has no unconditioned input: its stills are skipped, with ONE warning
    # for the dataset naming how many and why (diffusion.conditioning.skipped_stills: the ai-toolkit arch's words too)
    Image.new("RGB", (32, 32)).save(tmp_path / "still2.jpg")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scan = scan_datasets([_cfg(tmp_path, resolution=[32], do_i2v=True)], 16, verbose=True, i2v_mode="concat")
    assert [Path(it.path).name for it in scan.items] == ["clip.mp4"]
    assert sorted(Path(p).name for p, _ in scan.skipped) == ["still.png", "still2.jpg"]
    stills = [str(w.message) for w in caught if "still image(s)" in str(w.message)]
    assert len(stills) == 1, stills
    assert stills[0].startswith(f"{tmp_path}: 2 still image(s) of this do_i2v dataset are skipped (still.png, "
                                "still2.jpg): an image-to-video DiT with i2v_mode concat is conditioned on a first "
                                "frame in every step"), stills[0]
    assert "every item" not in stills[0]
    assert "(2 stills of a concat i2v job), 1 without caption" in scan.summary()
    # replace mode (and t2v) keep them; a dataset of stills only is left with nothing: refused, naming why
    assert len(scan_datasets([_cfg(tmp_path, resolution=[32], do_i2v=True)], 16, verbose=False,
                             i2v_mode="replace").items) == 3
    (tmp_path / "clip.mp4").unlink()
    with pytest.warns(DataWarning, match=r"2 still image\(s\) of this do_i2v dataset are skipped \(every item of "
                                         r"it: it trains nothing\)"):
        with pytest.raises(DataError, match=r"no usable item .*still\.png: still of a do_i2v dataset, skipped by "
                                            r"a concat image-to-video model"):
            scan_datasets([_cfg(tmp_path, resolution=[32], do_i2v=True)], 16, verbose=True, i2v_mode="concat")


def test_partial_cache_files_of_a_killed_run_are_removed_at_validation(tmp_path, capsys):
    from video_dit.train.config import parse_job
    from video_dit.train.validate import check_data

    data = tmp_path / "data"
    data.mkdir()
    _clip(data / "a.mp4", 9, 32, 32)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # its pid names no live process now
    latent, text = data / "_latent_cache", data / "_text_cache"
    latent.mkdir()
    text.mkdir()
    orphan = latent / f".a.mp4_0123_abcd.safetensors.tmp{dead.pid}"
    orphan.write_bytes(b"\0" * 3000)
    (text / f".0123_abcd.safetensors.tmp{dead.pid}").write_bytes(b"\0" * 100)
    live = latent / f".b.mp4_0123_abcd.safetensors.tmp{subprocess.os.getpid()}"  # a writer still running
    live.write_bytes(b"\0")
    kept = latent / "a.mp4_0123_abcd.safetensors"  # a finished entry
    kept.write_bytes(b"\0")
    job = parse_job({"job": "extension", "config": {"name": "j", "process": [{
        "type": "sd_trainer", "training_folder": str(tmp_path / "out"), "model": {"name_or_path": "preset:tiny"},
        "datasets": [{"folder_path": str(data), "num_frames": 9, "resolution": [32]}]}]}})
    lines = []
    check_data(job, log=lines.append)
    assert not orphan.exists() and not list(text.iterdir()) and live.exists() and kept.exists()
    assert lines == ["[video_dit] removed 2 partial cache file(s) (0.0 MiB) left by an interrupted run"]


def test_data_warnings_print_as_one_line():
    text = warnings.formatwarning("/data/x.mp4: skipped: truncated or corrupt", DataWarning, __file__, 10)
    assert text == "[video_dit] warning: /data/x.mp4: skipped: truncated or corrupt\n"
    other = warnings.formatwarning("else", UserWarning, __file__, 10)  # other warnings keep Python's format
    assert other.startswith(f"{__file__}:10: UserWarning: else")
