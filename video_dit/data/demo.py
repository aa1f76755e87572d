"""The procedural demo dataset: coloured shapes moving in a straight line on black.

`make_demo_data(DIR)` writes `DIR/0000.mp4 + 0000.txt, ...` ("a red square moving right on a black
background") and, beside it, `DIR_holdout/000.mp4 + 000.png + 000.txt, ...` (`holdout_dir`): clips
NOT in the training set, their first frames and captions, outside `DIR` because a dataset folder is
read recursively (ai-toolkit's rule, `dataset.list_media`): inside it, both trainers would train on
them. The default job renders its i2v previews from the first frames (`sample.samples[].ctrl_img`)
and computes its validation loss on the clips (`train.validation_config`); `holdout_combo` makes them
cover every colour, every direction and every shape. A folder written by an earlier version, with
`DIR/holdout/`, is moved to the new place by `move_old_holdout` (which the demo's `prepare` stage,
`make-demo-data` and `train-vae` call). With sound (`video_dit.data.demo_av.make_demo_av_data`,
`video-dit make-demo-data --audio`) every clip's MP4 also carries an AAC track whose pitch follows its
caption (the colour's steady note; see demo_av.py).
The motion is large and simple (a ~size/4 shape crossing most of the frame, 2-3 px per frame at
64x64x17) so a tiny model trained for minutes visibly learns colour, shape and direction.
Shapes are drawn as a camera would see them: at sub-pixel positions (a steady 2.75 px per frame,
not 2 and 3 px steps) and anti-aliased (an edge pixel takes the covered fraction of the colour,
`SUPERSAMPLE`^2 samples per pixel). With hard-edged, integer-placed shapes the same tiny-VAE recipe
reached 22.4-29.6 dB on the held-out clips; with these, 24.1-31.5 dB (docs/demo_recipe.md).
Output depends only on the arguments: same seed -> byte-identical files (PNG through PIL; MP4
through `media.write_video`, whose libx264 settings are single-threaded and fixed).
"""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import numpy as np
from PIL import Image

from video_dit import media
from video_dit.media import MediaError, read_video_frames

SHAPES = ("square", "circle", "triangle")
COLORS = {"red": (230, 40, 40), "green": (40, 210, 60), "blue": (50, 100, 255), "yellow": (240, 220, 40),
          "white": (240, 240, 240)}
DIRECTIONS = {"right": (1, 0), "left": (-1, 0), "up": (0, -1), "down": (0, 1)}  # (dx, dy), y grows down
MAX_SPEED = 3.0  # px per frame
SUPERSAMPLE = 4  # samples per pixel side when drawing a shape (anti-aliasing)


def inside(shape: str, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Bool array: are the points (x, y) inside the shape? Shape-local coordinates: the shape's
    bounding square is [-1, 1] x [-1, 1], y grows down."""
    if shape == "square":
        return (np.abs(x) <= 1.0) & (np.abs(y) <= 1.0)
    if shape == "circle":
        return x * x + y * y <= 1.0
    if shape == "triangle":  # apex up, base along the bottom edge
        return (np.abs(y) <= 1.0) & (np.abs(x) <= (y + 1) / 2)
    raise ValueError(f"unknown shape {shape!r}; accepted: {', '.join(SHAPES)}")


def coverage(shape: str, side: int, top: float, left: float, size: int) -> np.ndarray:
    """`(size, size)` float in [0, 1]: the fraction of each pixel the shape covers when its bounding
    square (`side` px) has its top-left corner at (`top`, `left`) px, fractions allowed;
    `SUPERSAMPLE`^2 samples per pixel, computed over the pixels the shape can touch."""
    out = np.zeros((size, size))
    y0, x0 = max(0, int(np.floor(top))), max(0, int(np.floor(left)))
    y1, x1 = min(size, int(np.ceil(top + side))), min(size, int(np.ceil(left + side)))
    sub = (np.arange(SUPERSAMPLE) + 0.5) / SUPERSAMPLE
    ys = ((np.arange(y0, y1)[:, None] + sub).ravel() - top) / side * 2 - 1  # shape-local, [-1, 1] inside
    xs = ((np.arange(x0, x1)[:, None] + sub).ravel() - left) / side * 2 - 1
    y, x = np.meshgrid(ys, xs, indexing="ij")                              # (rows * S, cols * S)
    hits = inside(shape, x, y).reshape(y1 - y0, SUPERSAMPLE, x1 - x0, SUPERSAMPLE)
    out[y0:y1, x0:x1] = hits.mean((1, 3))
    return out


def caption_for(shape: str, color: str, direction: str) -> str:
    return f"a {color} {shape} moving {direction} on a black background"


def render_clip(shape: str, color: str, direction: str, frames: int, size: int,
                rng: np.random.Generator) -> np.ndarray:
    """`(frames, size, size, 3)` uint8: the shape entering near one edge and moving to the other."""
    side = max(4, size // 4)
    margin = max(1, size // 32)
    span = size - side - 2 * margin                            # free travel along the motion axis
    speed = min(MAX_SPEED, span / max(1, frames - 1))
    slack = span - speed * (frames - 1)
    dx, dy = DIRECTIONS[direction]
    along0 = margin + float(rng.uniform(0, slack)) if slack > 0 else float(margin)
    across = int(rng.integers(margin, size - side - margin + 1))
    rgb = np.asarray(COLORS[color], float)
    out = np.zeros((frames, size, size, 3), np.uint8)
    for t in range(frames):
        a = along0 + speed * t
        a = a if (dx + dy) > 0 else size - side - a            # left/up: mirror the start edge
        top, left = (across, a) if dx else (a, across)
        out[t] = np.rint(coverage(shape, side, top, left, size)[..., None] * rgb).astype(np.uint8)
    return out


def holdout_combo(j: int) -> tuple[str, str, str]:
    """(shape, colour, direction) of held-out clip j: colour, direction and shape each cycle, so any 5
    consecutive clips hold every colour, every direction and every shape."""
    return SHAPES[j % len(SHAPES)], list(COLORS)[j % len(COLORS)], list(DIRECTIONS)[j % len(DIRECTIONS)]


OLD_HOLDOUT = "holdout"  # where versions before the held-out clips moved out put them: inside the dataset


def holdout_dir(data_dir) -> Path:
    """Where the held-out clips of the demo dataset `data_dir` live: beside it, `<data_dir>_holdout`
    (`data/demo` -> `data/demo_holdout`), where no trainer that reads `data_dir` recursively looks."""
    d = Path(data_dir)
    d = d if d.name else d.resolve()  # "." or "data/": a folder with a name
    return d.with_name(d.name + "_holdout")


def move_old_holdout(data_dir) -> str | None:
    """Move the held-out clips an earlier version wrote inside `data_dir` (`holdout/`, where a recursive
    scan trains on them) to `holdout_dir(data_dir)`; returns what was done, None when there was nothing
    to move (a `holdout/` holding anything but the demo's `NNN.mp4 / .png / .txt` is a user's folder,
    left alone). Both places holding files: `ValueError` naming them (neither is removed)."""
    old, new = Path(data_dir) / OLD_HOLDOUT, holdout_dir(data_dir)
    if not old.is_dir() or not all(re.fullmatch(r"\d{3}\.(mp4|png|txt)", f.name) for f in old.iterdir()):
        return None
    if new.exists() and any(new.iterdir()):
        raise ValueError(f"{old}: held-out clips of an earlier demo layout, inside the dataset folder (read "
                         f"recursively, as ai-toolkit reads it, so they would be trained on), and {new} holds the "
                         f"current ones too: remove {old}")
    if new.exists():
        new.rmdir()
    old.rename(new)
    return (f"moved the held-out clips {old} -> {new} (a dataset folder is read recursively, as ai-toolkit reads "
            "it: inside it they would be trained on)")


def make_demo_data(out_dir, count: int = 64, frames: int = 17, size: int = 64, seed: int = 0,
                   holdout: int = 4, fps: float = 16, sound=None, audio_rate: int | None = None) -> list[Path]:
    """Write the dataset to `out_dir` and its held-out clips to `holdout_dir(out_dir)` (see module
    docstring; an earlier layout's `out_dir/holdout/` is moved there first); returns the clip paths.
    `sound(colour, direction, frames, fps, rng) -> (C, S)` at `audio_rate`: each clip's audio track
    (AAC; the audio-video demo's, `demo_av.make_demo_av_data`), drawn from its own generator so a seed's
    pictures are the same with or without sound."""
    if sound is not None and not audio_rate:
        raise ValueError("make_demo_data: sound needs audio_rate (samples per second)")
    if count < 1 or frames < 2 or size < 16 or holdout < 0:
        raise ValueError(f"need count >= 1, frames >= 2, size >= 16, holdout >= 0; got count={count}, "
                         f"frames={frames}, size={size}, holdout={holdout}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    move_old_holdout(out)
    rng = np.random.default_rng(seed)
    sound_rng = np.random.default_rng([seed, 1])  # the sound's own stream: the pictures do not depend on it

    def track(colour: str, direction: str) -> dict:
        """`media.write_video`'s audio arguments for one clip (none without `sound`)."""
        if sound is None:
            return {}
        return {"audio": sound(colour, direction, frames, fps, sound_rng), "audio_rate": audio_rate}

    combos = list(itertools.product(SHAPES, COLORS, DIRECTIONS))
    order = [combos[i] for i in rng.permutation(len(combos))]  # balanced: every combo before repeats
    paths = []
    for i in range(count):
        shape, color, direction = order[i % len(order)]
        clip = render_clip(shape, color, direction, frames, size, rng)
        paths.append(media.write_video(clip, out / f"{i:04d}.mp4", fps=fps, **track(color, direction)))
        (out / f"{i:04d}.txt").write_text(caption_for(shape, color, direction) + "\n", encoding="utf-8")
    hold = holdout_dir(out)
    if holdout:
        hold.mkdir(exist_ok=True)
    for j in range(holdout):  # new positions (drawn after the training clips'), every colour/direction/shape
        shape, color, direction = holdout_combo(j)
        clip = render_clip(shape, color, direction, frames, size, rng)
        media.write_video(clip, hold / f"{j:03d}.mp4", fps=fps, **track(color, direction))
        Image.fromarray(clip[0]).save(hold / f"{j:03d}.png", optimize=False)
        (hold / f"{j:03d}.txt").write_text(caption_for(shape, color, direction) + "\n", encoding="utf-8")
    return paths


# ---------------------------------------------------------------- checking a rendered clip

FOREGROUND = 96      # a pixel is the shape when its brightest channel exceeds this (shapes >= 230, black ~0)
FILL_BOUNDS = (0.64, 0.89)  # area / bounding-box area: triangle 0.5 < circle 0.79 < square 1.0
# Where the foreground's centroid sits in its bounding box, 0 = top row, 1 = bottom row: 1/2 for the
# circle and the square, 2/3 for the apex-up triangle. Blur moves a triangle's fill towards the
# circle's (a 16-px triangle under a Gaussian blur of sigma 1 px reads 0.66: a "circle" by fill),
# while its centroid stays low (0.63 at sigma 1, 0.56 at sigma 3): the triangle is told by this.
TRIANGLE_LOW = 0.56


def parse_caption(caption: str) -> tuple[str, str, str]:
    """(shape, colour, direction) of a demo caption ("a red square moving right on ..."); ValueError
    naming the caption when it is not one."""
    words = caption.lower().replace(",", " ").split()
    found = []
    for table in (SHAPES, COLORS, DIRECTIONS):
        hits = [w for w in words if w in table]
        if len(set(hits)) != 1:
            raise ValueError(f"{caption!r} is not a demo caption: expected one of each of shapes {SHAPES}, "
                             f"colours {tuple(COLORS)} and directions {tuple(DIRECTIONS)}")
        found.append(hits[0])
    return found[0], found[1], found[2]


def classify_shape(fill: float, low: float) -> str:
    """The demo shape a foreground looks like, from its fill of its bounding box (`fill`: square 1.0,
    circle ~0.79, triangle ~0.5) and its centroid's height in that box (`low`: 0 top .. 1 bottom;
    the apex-up triangle 2/3, the others 1/2): "triangle" when the mass sits low (`TRIANGLE_LOW`)
    and the box is not full, else "square" or "circle" by fill, and "other" for a foreground too
    sparse for a circle that does not sit low either (an upside-down triangle, scattered specks)."""
    if low >= TRIANGLE_LOW and fill < FILL_BOUNDS[1]:
        return "triangle"
    return "square" if fill >= FILL_BOUNDS[1] else "circle" if fill >= FILL_BOUNDS[0] else "other"


def nearest_colour(rgb) -> str:
    rgb = np.asarray(rgb, float)
    return min(COLORS, key=lambda c: float(np.sum((np.asarray(COLORS[c], float) - rgb) ** 2)))


def check_clip(frames: np.ndarray, caption: str) -> dict:
    """Does the clip `frames` (F, H, W, 3) uint8 show the caption's shape, in its colour, moving in its
    direction by at least a quarter of the frame width?

    Measured per frame on the foreground (brightest channel > FOREGROUND): its area, its centroid, and
    its shape (`classify_shape`: its fill of its bounding box and where in the box its centroid
    sits, which tell the three shapes apart, blurred or sharp); the colour is the mean RGB of the
    foreground over all frames, named by the nearest demo colour. Passes when every frame holds a
    foreground of at least half the first frame's area, at least 3/4 of the frames classify as the
    caption's shape, the colour is the caption's, and the centroid moved from the first frame to the
    last by >= W/4 along the caption's direction and more along it than across it. A foreground that
    grows past twice the first frame's area is not the shape (a decoder drifting to a bright wash of
    the whole frame): it fails `present`, and then `motion` too, since the centroid of a flood tracks
    nothing.
    Returns the figures and `ok` (bool) with `failed` (the criteria that failed).
    """
    shape, colour, direction = parse_caption(caption)
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
        raise ValueError(f"expected (F, H, W, 3) uint8 frames, got {frames.dtype} {frames.shape}")
    F, H, W, _ = frames.shape
    fg = frames.max(-1) > FOREGROUND                                   # (F, H, W)
    areas = fg.sum((1, 2))
    centroids, shapes = [], []
    for f in range(F):
        ys, xs = np.nonzero(fg[f])
        if len(ys) == 0:
            centroids.append((float("nan"), float("nan")))
            shapes.append("none")
            continue
        centroids.append((float(xs.mean()), float(ys.mean())))
        box = (ys.max() - ys.min() + 1) * (xs.max() - xs.min() + 1)
        low = (ys.mean() - ys.min()) / max(1, ys.max() - ys.min())
        shapes.append(classify_shape(len(ys) / box, float(low)))
    pixels = frames[fg]
    mean_rgb = pixels.astype(float).mean(0) if len(pixels) else np.zeros(3)
    dx, dy = DIRECTIONS[direction]
    (x0, y0), (x1, y1) = centroids[0], centroids[-1]
    along = (x1 - x0) * dx + (y1 - y0) * dy
    across = abs((x1 - x0) * dy) + abs((y1 - y0) * dx)
    present = bool(areas[0] > 0 and (areas >= 0.5 * areas[0]).all() and (areas <= 2 * areas[0]).all())
    shape_share = sum(s == shape for s in shapes) / F
    result = {
        "caption": caption, "shape": shape, "colour": colour, "direction": direction,
        "area_first": int(areas[0]), "area_min": int(areas.min()), "area_max": int(areas.max()), "shape_share": round(shape_share, 3),
        "seen_shape": max(sorted(set(shapes)), key=shapes.count), "mean_rgb": [round(float(v), 1) for v in mean_rgb],
        "seen_colour": nearest_colour(mean_rgb) if len(pixels) else "none",
        "moved_px": round(float(along), 1) if np.isfinite(along) else None,
        "across_px": round(float(across), 1) if np.isfinite(across) else None,
        "needed_px": W / 4,
    }
    checks = {
        "present": present,
        "shape": shape_share >= 0.75,
        "colour": result["seen_colour"] == colour,
        "motion": bool(present and np.isfinite(along) and along >= W / 4 and along > across),
    }
    result["failed"] = [k for k, ok in checks.items() if not ok]
    result["ok"] = not result["failed"]
    return result


def format_check(result: dict) -> str:
    """One line per clip: what was asked, what was seen, and PASS / FAIL (criteria)."""
    moved = "no shape" if result["moved_px"] is None else f"moved {result['moved_px']:+.1f} px {result['direction']}"
    return (f"{'PASS' if result['ok'] else 'FAIL'}  {result['shape']} {result['colour']} {result['direction']}: "
            f"seen {result['seen_shape']} ({result['shape_share']:.0%} of frames), {result['seen_colour']} "
            f"rgb {tuple(round(v) for v in result['mean_rgb'])}, {moved} (need >= {result['needed_px']:g}), "
            f"area {result['area_min']}-{result['area_max']} px (first frame {result['area_first']})"
            + (f"  [failed: {', '.join(result['failed'])}]" if result["failed"] else ""))


# ---------------------------------------------------------------- the previews of a demo run


def preview_steps(samples: Path) -> list[int]:
    """Steps that have a rendered preview 0 under `samples/`."""
    return sorted(int(m.group(1)) for p in samples.glob("*_0.mp4") if (m := re.fullmatch(r"(\d{9})_0\.mp4", p.name)))


def check_step(samples: Path, prompts: list[str], step: int) -> list[dict]:
    """`check_clip` of every preview of `step` (a missing or unreadable MP4 fails as `unreadable`)."""
    results = []
    for i, prompt in enumerate(prompts):
        path = samples / f"{step:09d}_{i}.mp4"
        try:
            frames = read_video_frames(path)
        except MediaError as exc:
            results.append({"caption": prompt, "ok": False, "failed": ["unreadable"], "error": str(exc)})
            continue
        results.append(check_clip(frames, prompt))
    return results


def report(samples: Path, prompts: list[str], steps: list[int]) -> tuple[str, dict[int, list[dict]]]:
    """(printable report, {step: results})."""
    lines = [f"demo check ({samples}): shape, colour and >= 1/4 frame width of motion in the caption's "
             "direction, from the decoded MP4s (video_dit/data/demo.py check_clip)"]
    out = {}
    for step in steps:
        results = check_step(samples, prompts, step)
        out[step] = results
        lines.append(f"step {step}: {sum(r['ok'] for r in results)}/{len(results)} previews pass")
        lines += [f"  {format_check(r)}" if "error" not in r else f"  FAIL {r['error']}" for r in results]
    return "\n".join(lines), out
