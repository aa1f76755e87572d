"""The procedural demo dataset: coloured shapes moving in a straight line on black.

`make_demo_data(DIR)` writes `DIR/0000.mp4 + 0000.txt, ...` ("a red square moving right on a black
background") and `DIR/holdout/000.png + 000.txt`: first frames of clips NOT in the training set, with
their captions, for i2v previews (the default job points `sample.samples[].ctrl_img` at them).
The motion is large and simple (a ~size/4 shape crossing most of the frame, 2-3 px per frame at
64x64x17) so a tiny model trained for minutes visibly learns colour, shape and direction.
Output depends only on the arguments: same seed -> byte-identical files (PNG through PIL; MP4
through `media.write_video`, whose libx264 settings are single-threaded and fixed).
"""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
from PIL import Image

from video_dit import media

SHAPES = ("square", "circle", "triangle")
COLORS = {"red": (230, 40, 40), "green": (40, 210, 60), "blue": (50, 100, 255), "yellow": (240, 220, 40),
          "white": (240, 240, 240)}
DIRECTIONS = {"right": (1, 0), "left": (-1, 0), "up": (0, -1), "down": (0, 1)}  # (dx, dy), y grows down
MAX_SPEED = 3.0  # px per frame


def shape_mask(shape: str, side: int) -> np.ndarray:
    """`(side, side)` bool mask of the shape, pixel centres sampled."""
    c = (np.arange(side) + 0.5) / side * 2 - 1  # [-1, 1]
    y, x = np.meshgrid(c, c, indexing="ij")
    if shape == "square":
        return np.ones((side, side), bool)
    if shape == "circle":
        return x * x + y * y <= 1.0
    if shape == "triangle":  # apex up
        return (y <= 1.0) & (np.abs(x) <= (y + 1) / 2)
    raise ValueError(f"unknown shape {shape!r}; accepted: {', '.join(SHAPES)}")


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
    mask = shape_mask(shape, side)
    out = np.zeros((frames, size, size, 3), np.uint8)
    for t in range(frames):
        a = along0 + speed * t
        a = a if (dx + dy) > 0 else size - side - a            # left/up: mirror the start edge
        a = int(np.floor(a + 0.5))
        top, left = (across, a) if dx else (a, across)
        out[t, top:top + side, left:left + side][mask] = COLORS[color]
    return out


def make_demo_data(out_dir, count: int = 64, frames: int = 17, size: int = 64, seed: int = 0,
                   holdout: int = 4, fps: float = 16) -> list[Path]:
    """Write the dataset (see module docstring); returns the clip paths."""
    if count < 1 or frames < 2 or size < 16 or holdout < 0:
        raise ValueError(f"need count >= 1, frames >= 2, size >= 16, holdout >= 0; got count={count}, "
                         f"frames={frames}, size={size}, holdout={holdout}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    combos = list(itertools.product(SHAPES, COLORS, DIRECTIONS))
    order = [combos[i] for i in rng.permutation(len(combos))]  # balanced: every combo before repeats
    paths = []
    for i in range(count):
        shape, color, direction = order[i % len(order)]
        clip = render_clip(shape, color, direction, frames, size, rng)
        paths.append(media.write_video(clip, out / f"{i:04d}.mp4", fps=fps))
        (out / f"{i:04d}.txt").write_text(caption_for(shape, color, direction) + "\n", encoding="utf-8")
    hold = out / "holdout"
    if holdout:
        hold.mkdir(exist_ok=True)
    dirs = list(DIRECTIONS)
    for j in range(holdout):  # one direction after another, so previews show every direction
        shape, color = SHAPES[int(rng.integers(len(SHAPES)))], list(COLORS)[int(rng.integers(len(COLORS)))]
        direction = dirs[j % len(dirs)]
        first = render_clip(shape, color, direction, frames, size, rng)[0]
        Image.fromarray(first).save(hold / f"{j:03d}.png", optimize=False)
        (hold / f"{j:03d}.txt").write_text(caption_for(shape, color, direction) + "\n", encoding="utf-8")
    return paths
