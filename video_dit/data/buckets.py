"""Aspect buckets: the frame size `(H, W)` an item is resized and center-cropped to.

For a target `resolution` R and the model's `divisibility` d (16 for the 8x VAEs with a 2x2 patch,
32 for the 16x VAE), the candidate buckets are every `(H, W)` with both sides multiples of d, area at
most R^2 and as large as the grid allows, aspect ratio between 1:4 and 4:1. An item takes the
candidate whose aspect ratio is nearest its own (in log space), so a 1920x1080 clip at R=512, d=16
lands in 672x384. The bucket key of an item is `(F, H, W)` in pixels: images (F=1) and clips of
different lengths never share a batch.

`fitted_bucket` adds the no-upscale rule: a source smaller than its resolution's bucket takes the
largest bucket that fits inside it (the resolution lowered one cell at a time), unless upscaling is
allowed.
"""

from __future__ import annotations

import math
from functools import lru_cache

MAX_ASPECT = 4.0


@lru_cache(maxsize=64)
def candidate_buckets(resolution: int, divisibility: int) -> tuple[tuple[int, int], ...]:
    """All `(H, W)` buckets of area <= resolution^2 for this grid, sorted by aspect W/H."""
    d, area = divisibility, resolution * resolution
    if resolution < d:
        raise ValueError(f"resolution {resolution} is below the divisibility {d}: no bucket fits")
    out = set()
    for side in range(d, int(area / d) + 1, d):
        other = area // side // d * d
        if other < d:
            break
        for h, w in ((side, other), (other, side)):
            if 1 / MAX_ASPECT <= w / h <= MAX_ASPECT:
                out.add((h, w))
    return tuple(sorted(out, key=lambda hw: (hw[1] / hw[0], hw[0])))


def bucket_size(width: int, height: int, resolution: int, divisibility: int,
                square: bool = False) -> tuple[int, int]:
    """`(H, W)` bucket for a `width x height` source. `square=True` (`buckets: false`) always gives
    the largest square on the grid, `(R // d * d)` on each side."""
    if width < 1 or height < 1:
        raise ValueError(f"source size must be positive, got {width}x{height}")
    if square:
        side = resolution // divisibility * divisibility
        if side < divisibility:
            raise ValueError(f"resolution {resolution} is below the divisibility {divisibility}")
        return side, side
    target = math.log(width / height)
    return min(candidate_buckets(resolution, divisibility),
               key=lambda hw: (abs(math.log(hw[1] / hw[0]) - target), -hw[0] * hw[1], hw[1]))


def fitted_bucket(width: int, height: int, resolution: int, divisibility: int, square: bool = False,
                  allow_upscale: bool = False) -> tuple[tuple[int, int] | None, float]:
    """(`(H, W)` bucket, upscale factor the source needs for the bucket of `resolution`). With
    `allow_upscale` (or a factor <= 1) that bucket is returned; otherwise the bucket of the largest
    resolution (lowered by `divisibility` at a time) whose sides fit inside the source, so nothing
    is upscaled, or None when none fits (a side shorter than one cell)."""
    H, W = bucket_size(width, height, resolution, divisibility, square)
    factor = max(W / width, H / height)
    if allow_upscale or factor <= 1.0:
        return (H, W), factor
    r = min(resolution, min(width, height) if square else math.isqrt(width * height) + 1)
    while r >= divisibility:
        H, W = bucket_size(width, height, r, divisibility, square)
        if W <= width and H <= height:
            return (H, W), factor
        r -= divisibility
    return None, factor
