"""Frame selection, 4k+1 snapping, short clips, buckets and the resize/crop of `video_dit.data`."""

from __future__ import annotations

import math
import warnings

import helpers
import numpy as np
import pytest
import torch
from PIL import Image

from video_dit.data.buckets import bucket_size, candidate_buckets
from video_dit.data.dataset import DatasetConfig, DataWarning, scan_dataset
from video_dit.data.frames import ClipTooShort, crop_plan, fit_frames, select_frames, snap_num_frames
from video_dit.families import get_preset
from video_dit.typed_config import ConfigError, parse


@pytest.mark.parametrize("total,n", [(17, 17), (100, 17), (240, 81), (33, 5), (5, 1)])
def test_even_selection_count_and_span(total, n):
    idx = select_frames(total, n, shrink=True)
    assert len(idx) == n
    assert idx[0] == 0 and idx[-1] == (total - 1 if n > 1 else 0)
    assert idx == sorted(idx) and len(set(idx)) == n  # no repeats when the clip is long enough


def test_stride_selection_follows_fps():
    # 48 fps source at dataset fps 24: every second frame from the start
    assert select_frames(100, 5, shrink=False, src_fps=48, fps=24) == [0, 2, 4, 6, 8]
    # 30 -> 24 fps: stride 1.25, rounded
    assert select_frames(100, 5, shrink=False, src_fps=30, fps=24) == [0, 1, 3, 4, 5]
    # 12 fps source at 24: each frame twice
    assert select_frames(100, 5, shrink=False, src_fps=12, fps=24) == [0, 1, 1, 2, 2]


def test_short_clip_skip_and_stretch():
    with pytest.raises(ClipTooShort, match="3 frames < num_frames 17"):
        select_frames(3, 17, shrink=True, short_clip="skip")
    idx = select_frames(3, 17, shrink=True, short_clip="stretch")
    assert len(idx) == 17 and set(idx) == {0, 1, 2} and idx == sorted(idx)
    # stride mode: 10 frames at 48 fps cannot give 9 frames at 24 fps (needs 17)
    with pytest.raises(ClipTooShort, match="needs 17 frames"):
        select_frames(10, 9, shrink=False, src_fps=48, fps=24, short_clip="skip")
    assert select_frames(10, 9, shrink=False, src_fps=48, fps=24, short_clip="stretch")[-1] == 9


def test_snap_num_frames():
    assert [snap_num_frames(n, 4) for n in (1, 2, 4, 5, 16, 17, 18, 80, 81)] == [1, 1, 1, 5, 13, 17, 17, 77, 81]
    assert [snap_num_frames(n, temporal=8) for n in (1, 8, 9, 16, 17, 25)] == [1, 1, 9, 9, 17, 25]
    with pytest.raises(ValueError):
        snap_num_frames(0, 4)


def test_the_pipeline_snaps_frames_with_the_same_rule():
    from video_dit.families import get_preset
    from video_dit.families.wan.pipeline import VideoPipeline
    from video_dit.families.wan.vae import CausalVideoVAE

    preset = get_preset("tiny")
    pipe = VideoPipeline(helpers.preset_dit("tiny"), CausalVideoVAE(preset.vae))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert [pipe.snap(n, 64, 64)[0] for n in range(1, 30)] == [snap_num_frames(n, 4) for n in range(1, 30)]
    with pytest.raises(ValueError, match="must be >= 1"):
        pipe.snap(0, 64, 64)


def test_config_snaps_with_one_warning_and_rejects_bad_values(tmp_path):
    (tmp_path / "a.png").write_bytes(b"x")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = parse(DatasetConfig, {"folder_path": str(tmp_path), "num_frames": 18}, "ds")
        assert cfg.num_frames == 18  # no model known yet: the job snaps it with its preset's VAE
        cfg.fit_frames(get_preset("tiny").vae.snap_frames)
    assert cfg.num_frames == 17
    assert [str(w.message) for w in caught if w.category is DataWarning] == \
        ["ds.num_frames: 18 is not a frame count the model's VAE encodes; using 17"]
    assert parse(DatasetConfig, {"folder_path": str(tmp_path), "resolution": 256}, "ds").resolution == [256]
    # ai-toolkit's defaults (false): accepted, the tensors are cached either way
    assert parse(DatasetConfig, {"folder_path": str(tmp_path), "cache_latents_to_disk": False,
                                 "cache_text_embeddings": False}, "ds").cache_latents_to_disk is False
    bad = [({"num_frames": 0}, "ds.num_frames"), ({"num_frame": 17}, "did you mean 'num_frames'"),
           ({"caption_dropout_rate": 1.5}, "ds.caption_dropout_rate"),
           ({"short_clip": "pad"}, "ds.short_clip"), ({"shuffle_tokens": True}, "ds.shuffle_tokens"),
           ({"folder_path": str(tmp_path / "nope")}, "ds.folder_path")]
    for extra, match in bad:
        with pytest.raises(ConfigError, match=match):
            parse(DatasetConfig, {"folder_path": str(tmp_path), **extra}, "ds")
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.txt").write_text("x")
    with pytest.raises(ConfigError, match="ds.folder_path.*holds no video or image"):
        parse(DatasetConfig, {"folder_path": str(empty)}, "ds")
    cfg = parse(DatasetConfig, {"folder_path": str(tmp_path), "resolution": [24]}, "ds")
    with pytest.raises(ConfigError, match="ds.resolution: 24 is below the model's divisibility 32"):
        cfg.check_divisibility(32)


def test_accepted_aitk_keys_have_their_documented_meaning(tmp_path):
    Image.new("RGB", (96, 48)).save(tmp_path / "wide.png")
    base = {"folder_path": str(tmp_path), "resolution": [32], "cache_latents": True, "shuffle_tokens": False}
    aspect = scan_dataset(parse(DatasetConfig, base, "ds"), 16, verbose=False)
    square = scan_dataset(parse(DatasetConfig, {**base, "buckets": False}, "ds"), 16, verbose=False)
    assert aspect.items[0].bucket == (1, 16, 48) and square.items[0].bucket == (1, 32, 32)
    assert square.items[0].resize == (32, 64) and square.items[0].crop == (0, 16)


@pytest.mark.parametrize("res,d", [(512, 16), (480, 16), (64, 16), (512, 32), (720, 32)])
def test_buckets_on_grid_and_area_bounded(res, d):
    cands = candidate_buckets(res, d)
    assert cands
    for h, w in cands:
        assert h % d == 0 and w % d == 0 and h * w <= res * res
        assert 0.25 <= w / h <= 4
    for (w, h) in [(1920, 1080), (1080, 1920), (640, 480), (500, 500), (3000, 700)]:
        H, W = bucket_size(w, h, res, d)
        # nearest aspect among the candidates
        err = abs(math.log(W / H) - math.log(w / h))
        assert all(err <= abs(math.log(cw / ch) - math.log(w / h)) + 1e-12 for ch, cw in cands)
    assert bucket_size(1920, 1080, 512, 16) == (384, 672)
    assert bucket_size(1920, 1080, 512, 16, square=True) == (512, 512)


def test_fit_frames_keeps_aspect_and_centers():
    # a 40x80 (H x W) frame with a bright column at x = 40 (the centre); bucket 32x32
    a = np.zeros((2, 40, 80, 3), np.uint8)
    a[:, :, 38:42] = 255
    resize, crop = crop_plan(80, 40, 32, 32)
    assert resize == (32, 64) and crop == (0, 16)
    x = fit_frames(a, resize, crop, (32, 32))
    assert x.shape == (2, 3, 32, 32) and x.dtype == torch.float32
    assert x.min() >= -1 and x.max() <= 1
    col = x[0, 0].mean(0)  # brightness per column
    assert col.argmax().item() in (15, 16)  # the centre column stays in the centre
    assert col[0] < -0.9 and col[-1] < -0.9
