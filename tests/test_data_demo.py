"""make-demo-data: decodes with PyAV, byte-identical by seed, captions match the motion; inspect-data."""

from __future__ import annotations

import re

import av
import numpy as np
import torch

from video_dit.cli import main as cli_main
from video_dit.data.cache import build_cache
from video_dit.data.dataset import DatasetConfig, scan_dataset
from video_dit.data.demo import COLORS
from video_dit.typed_config import parse


def _files(d):
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def _centroid(frame):
    ys, xs = np.nonzero(frame.max(-1) > 100)
    return xs.mean(), ys.mean()


def test_make_demo_data_decodes_is_deterministic_and_captions_the_motion(tmp_path, capsys):
    args = ["--count", "6", "--frames", "9", "--size", "48", "--holdout", "2"]
    assert cli_main(["make-demo-data", str(tmp_path / "a"), "--seed", "7", *args]) == 0
    assert cli_main(["make-demo-data", str(tmp_path / "b"), "--seed", "7", *args]) == 0
    assert cli_main(["make-demo-data", str(tmp_path / "c"), "--seed", "8", *args]) == 0
    a, b, c = ({**_files(tmp_path / x), **{f"held/{k}": v for k, v in _files(tmp_path / f"{x}_holdout").items()}}
               for x in "abc")
    # the held-out clips beside the dataset folder (a_holdout/), never inside it: trainers read it recursively
    assert sorted(a) == [f"{i:04d}.{e}" for i in range(6) for e in ("mp4", "txt")] + \
        [f"held/{j:03d}.{e}" for j in range(2) for e in ("mp4", "png", "txt")]
    assert a == b  # byte-identical for the same seed
    assert a != c
    pattern = re.compile(r"^a (\w+) (square|circle|triangle) moving (left|right|up|down) on a black background$")
    for i in range(6):
        m = pattern.match((tmp_path / "a" / f"{i:04d}.txt").read_text().strip())
        assert m, i
        with av.open(str(tmp_path / "a" / f"{i:04d}.mp4")) as container:
            frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
        assert len(frames) == 9 and frames[0].shape == (48, 48, 3)
        (x0, y0), (x1, y1) = _centroid(frames[0]), _centroid(frames[-1])
        dx, dy = x1 - x0, y1 - y0
        expected = {"right": dx > 15, "left": dx < -15, "down": dy > 15, "up": dy < -15}[m.group(3)]
        assert expected, (m.group(3), dx, dy)
        colour = np.array(COLORS[m.group(1)], float)
        ys, xs = np.nonzero(frames[4].max(-1) > 100)
        mean = frames[4][ys, xs].astype(float).mean(0)
        assert np.abs(mean - colour).max() < 40, (m.group(1), mean)


def test_inspect_data_reports_buckets_skips_and_cache(tmp_path, capsys):
    data = tmp_path / "data"
    assert cli_main(["make-demo-data", str(data), "--count", "3", "--frames", "9", "--size", "32",
                     "--holdout", "0"]) == 0
    (data / "broken.mp4").write_bytes(b"")
    job = tmp_path / "job.yaml"
    job.write_text(f"""job: extension
config:
  name: t
  process:
    - type: sd_trainer
      model: {{name_or_path: "preset:tiny"}}
      datasets:
        - folder_path: {data}
          num_frames: 9
          resolution: [32]
          num_repeats: 2
""")
    capsys.readouterr()
    assert cli_main(["inspect-data", str(job)]) == 0
    out = capsys.readouterr().out
    assert "frame sides must be multiples of 16" in out
    assert re.search(r"9 x\s+32 x\s+32:\s+6 #", out)
    assert "broken.mp4: empty file" in out and "3 items, 1 files skipped" in out
    assert "latents: 0 of 3 items cached, 3 not cached\n" in out
    assert "space" not in out  # no internal cache-space strings, only cached / not cached
    # two of the three items cached with another VAE: still not cached for this job
    cfg = parse(DatasetConfig, {"folder_path": str(data), "num_frames": 9, "resolution": [32]}, "ds")
    scan = scan_dataset(cfg, 16, verbose=False)
    scan.items = scan.items[:2]
    encode = lambda v: {"latents": v[:, :, ::4, ::8, ::8]}  # noqa: E731
    text = lambda caps: [torch.zeros(2, 4) for _ in caps]  # noqa: E731
    build_cache(scan, encode, text, space_version="another-vae", verbose=False)
    assert cli_main(["inspect-data", str(job)]) == 0
    out = capsys.readouterr().out
    assert "latents: 0 of 3 items cached, 3 not cached\n" in out
    # ... and with the job's own versions (what the trainer computes): 2 cached, 1 not
    from video_dit.families import get_preset
    from video_dit.spec import model_sources
    from video_dit.train.caches import cache_spaces
    from video_dit.train.config import load_job

    p = load_job(job).process  # what the trainer keys its caches by on a CPU machine: float32 encoders
    space, text_space = cache_spaces(p, get_preset("tiny"), *model_sources(p), torch.float32, torch.float32)
    build_cache(scan, encode, text, space_version=space, text_space_version=text_space, verbose=False)
    assert cli_main(["inspect-data", str(job)]) == 0
    out = capsys.readouterr().out
    assert "latents: 2 of 3 items cached, 1 not cached\n" in out
    assert "text embeds: 2 of 3 distinct captions cached, 1 not cached\n" in out
    job.write_text(job.read_text().replace("num_frames: 9", "num_frame: 9"))
    assert cli_main(["inspect-data", str(job)]) == 1
    assert "did you mean 'num_frames'" in capsys.readouterr().out


def test_holdout_covers_the_data_and_the_checker_reads_clips(tmp_path):
    """Five held-out clips hold every colour, direction and shape; the checker passes each of them
    (and every training clip of the run), and fails a clip that stands still, one whose shape fades,
    and one of another colour or shape, naming the criterion."""
    from video_dit.data.demo import DIRECTIONS, SHAPES, check_clip, format_check, parse_caption
    from video_dit.media import read_video_frames

    make = ["make-demo-data", str(tmp_path / "d"), "--count", "4", "--frames", "17", "--size", "64", "--holdout", "5"]
    assert cli_main(make) == 0
    held = tmp_path / "d_holdout"
    captions = [(held / f"{j:03d}.txt").read_text().strip() for j in range(5)]
    combos = [parse_caption(c) for c in captions]
    assert {c[0] for c in combos} == set(SHAPES) and {c[1] for c in combos} == set(COLORS)
    assert {c[2] for c in combos} == set(DIRECTIONS)
    for j, caption in enumerate(captions):
        frames = read_video_frames(held / f"{j:03d}.mp4")
        first = np.asarray(__import__("PIL.Image", fromlist=["Image"]).open(held / f"{j:03d}.png"))
        assert np.abs(frames[0].astype(int) - first.astype(int)).mean() < 4  # the PNG is the clip's frame 0
        result = check_clip(frames, caption)
        assert result["ok"], format_check(result)
        assert result["moved_px"] >= 40  # the shape crosses most of the 64-px frame
    frames = read_video_frames(held / "000.mp4")
    shape, colour, direction = combos[0]
    still = np.repeat(frames[:1], len(frames), axis=0)
    assert check_clip(still, captions[0])["failed"] == ["motion"]
    fading = (frames.astype(float) * np.linspace(1, 0, len(frames))[:, None, None, None]).astype(np.uint8)
    assert "present" in check_clip(fading, captions[0])["failed"]
    # a shape that moves while the frame floods with a grey-green wash (what a drifting VAE decodes):
    # the flood's centroid moves too, but it is no shape track
    washed = frames.copy()
    later = washed[len(frames) // 2:]
    later[later.max(-1) < 96] = (110, 135, 108)
    assert {"present", "motion"} <= set(check_clip(washed, captions[0])["failed"])
    other = next(c for c in COLORS if c != colour)
    assert check_clip(frames, captions[0].replace(colour, other))["failed"] == ["colour"]
    other = next(s for s in SHAPES if s != shape)
    assert check_clip(frames, captions[0].replace(shape, other))["failed"] == ["shape"]
    opposite = {"right": "left", "left": "right", "up": "down", "down": "up"}[direction]
    assert check_clip(frames, captions[0].replace(direction, opposite))["failed"] == ["motion"]


def test_check_demo_command_reads_a_jobs_previews(tmp_path, capsys):
    """`video-dit check-demo CONFIG`: exit 0 when the last step's previews pass, 1 when one fails."""
    import shutil

    import yaml

    data = tmp_path / "data"
    assert cli_main(["make-demo-data", str(data), "--count", "2", "--frames", "17", "--size", "64",
                     "--holdout", "2"]) == 0
    held = tmp_path / "data_holdout"
    captions = [(held / f"{j:03d}.txt").read_text().strip() for j in range(2)]
    job = {"job": "extension", "config": {"name": "d", "process": [{
        "training_folder": str(tmp_path / "out"), "model": {"name_or_path": "preset:tiny"},
        "datasets": [{"folder_path": str(data), "num_frames": 17, "resolution": [64]}],
        "sample": {"samples": [{"prompt": c, "ctrl_img": str(held / f"{j:03d}.png")}
                               for j, c in enumerate(captions)]}}]}}
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump(job))
    samples = tmp_path / "out" / "d" / "samples"
    samples.mkdir(parents=True)
    from video_dit.media import read_video_frames, write_video

    for j in range(2):  # step 0 stands still, step 40 is the held-out clip itself
        frames = read_video_frames(held / f"{j:03d}.mp4")
        write_video(np.repeat(frames[:1], len(frames), axis=0), samples / f"{0:09d}_{j}.mp4")
        shutil.copy(held / f"{j:03d}.mp4", samples / f"{40:09d}_{j}.mp4")
    capsys.readouterr()
    assert cli_main(["check-demo", str(config)]) == 0
    out = capsys.readouterr().out
    assert "step 0: 0/2 previews pass" in out and "step 40: 2/2 previews pass" in out
    assert out.count("[failed: motion]") == 2
    assert cli_main(["check-demo", str(config), "--steps", "40,0"]) == 1  # the last step asked fails
    capsys.readouterr()
    assert cli_main(["check-demo", str(config), "--seeds", "1"]) == 2  # no export to render more seeds from
    assert f"{tmp_path / 'out' / 'd' / 'd'}: not found" in capsys.readouterr().out


def test_shapes_are_drawn_anti_aliased_at_sub_pixel_positions():
    """`coverage` against areas and edge fractions worked out by hand, and `render_clip`'s motion: a
    steady `span / (frames - 1)` px per frame, not integer steps."""
    from video_dit.data.demo import SUPERSAMPLE, coverage, render_clip

    square = coverage("square", 16, top=10.3, left=20.6, size=64)
    assert square.sum() == 256                                  # 16 x 16 px, wherever it lies
    assert square[18, 21:36].min() == 1 and square[18, 37:].max() == 0 and square[18, :20].max() == 0
    # the left edge at x = 20.6 covers 0.4 of pixel 20 and the right edge at 36.6 covers 0.6 of pixel 36,
    # to within one sample column
    assert abs(square[18, 20] - 0.4) <= 1 / SUPERSAMPLE and abs(square[18, 36] - 0.6) <= 1 / SUPERSAMPLE
    assert 0 < square[10, 25] < 1 and 0 < square[26, 25] < 1   # the top (10.3) and bottom (26.3) rows too
    circle = coverage("circle", 16, top=5.5, left=5.25, size=64)
    assert abs(circle.sum() - np.pi * 8 ** 2) < 0.02 * np.pi * 8 ** 2
    triangle = coverage("triangle", 16, top=0, left=0, size=64)
    assert abs(triangle.sum() - 128) < 0.02 * 128               # half its bounding square
    assert triangle[0, 7:9].max() < triangle[15, 7:9].min() == 1   # apex up: thin at the top, full at the base
    assert coverage("square", 16, top=-4, left=56, size=64).sum() == 12 * 8  # clipped by the frame

    frames, size = 17, 64
    for direction, axis, sign in [("right", 1, 1), ("left", 1, -1), ("down", 0, 1), ("up", 0, -1)]:
        clip = render_clip("square", "white", direction, frames, size, np.random.default_rng(3)).astype(float)
        weight = clip[..., 0]                                               # (F, H, W)
        grid = np.arange(size, dtype=float)
        centre = [(w.sum(1 - axis) * grid).sum() / w.sum() for w in weight]  # along the motion axis
        speed = (size - size // 4 - 2 * (size // 32)) / (frames - 1)        # 44 px of travel / 16 frames
        assert np.allclose(np.diff(centre) * sign, speed, atol=0.05), (direction, np.diff(centre))


def test_the_checker_tells_the_shapes_apart_sharp_or_blurred():
    """Each demo shape, drawn and then blurred by a Gaussian of sigma 0-2 px (written here), is seen as
    itself in every frame; an upside-down triangle is no demo triangle. By fill alone a triangle
    blurred by sigma 1 px reads 0.66, inside the circle's band: the centroid's height tells it."""
    from video_dit.data.demo import FILL_BOUNDS, check_clip, coverage

    def blur(img, sigma):
        if sigma == 0:
            return img
        r = int(3 * sigma) + 1
        k = np.exp(-np.arange(-r, r + 1) ** 2 / (2 * sigma ** 2))
        k /= k.sum()
        img = np.apply_along_axis(lambda v: np.convolve(v, k, mode="same"), 0, img)
        return np.apply_along_axis(lambda v: np.convolve(v, k, mode="same"), 1, img)

    def clip(shape, sigma, flip=False, side=16):
        frames = []
        for t in range(9):  # moving right 3 px a frame
            cov = blur(coverage(shape, side, top=20.0, left=4.0 + 3 * t, size=64), sigma)
            frames.append(np.rint((cov[::-1] if flip else cov)[..., None] * np.array(COLORS["blue"])))
        return np.clip(np.stack(frames), 0, 255).astype(np.uint8)

    for shape in ("square", "circle", "triangle"):
        for sigma in (0, 0.75, 1.0, 1.5, 2.0):
            result = check_clip(clip(shape, sigma), f"a blue {shape} moving right on a black background")
            assert result["shape_share"] == 1.0, (shape, sigma, result)
    fg = clip("triangle", 1.0)[0].max(-1) > 96
    ys, xs = np.nonzero(fg)
    fill = len(ys) / ((np.ptp(ys) + 1) * (np.ptp(xs) + 1))
    assert FILL_BOUNDS[0] <= fill < FILL_BOUNDS[1]  # what fill alone would call a circle
    flipped = check_clip(clip("triangle", 0, flip=True), "a blue triangle moving right on a black background")
    assert flipped["failed"] == ["shape"] and flipped["seen_shape"] == "other"
