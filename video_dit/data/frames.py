"""Frame selection, cheap integrity probes, and reading one item's pixels at its bucket size.

Frame rules (documented once, here):
- `num_frames` must be a count the model's VAE encodes (`VAEShape.snap_frames`: t k + 1 for a causal VAE
  that compresses time t times and keeps the first frame, 4k + 1 for Wan and HunyuanVideo 1.5, 8k + 1 for
  LTX-2); another value is snapped DOWN to the nearest such count, with one warning when the job is
  checked against its preset (`DatasetConfig.fit_frames`).
- `shrink_video_to_frames: true`: `num_frames` indices spread evenly over the whole clip,
  `round(i * (total - 1) / (num_frames - 1))` (ai-toolkit's rule).
- `shrink_video_to_frames: false`: consecutive frames resampled to the dataset `fps` from the
  clip's start: index `round(i * src_fps / fps)` (stride < 1 repeats frames of a slow clip).
- A clip too short for that (fewer than `num_frames` frames, or too short a span at the stride)
  follows `short_clip`: `skip` (the item is dropped with a warning) or `stretch` (indices spread
  over the whole clip, repeating frames where the clip has fewer than `num_frames`).
- The selection's stride (`frame_selection`: the source frames one selected frame stands for) times
  `num_frames` is the span of source time the selection covers: its sound is cut to exactly that span
  (`video_dit.data.audio.frames_span`, `load_item_audio`), so the frame rules above apply to both.
- Images are one-frame items (their own `(1, H, W)` buckets). In an image dataset (`num_frames: 1`)
  videos are not items (ai-toolkit's rule); they are reported as skipped, with that reason.
"""

from __future__ import annotations

import math
import os
import warnings

import numpy as np
import torch
import torch.nn.functional as F_nn

from video_dit import media
from video_dit.data import audio as audio_mod
from video_dit.models.causal_conv import first_frame_kept


class ClipTooShort(ValueError):
    """The clip cannot give `num_frames` frames under `short_clip: skip`; the message says why."""


def snap_num_frames(n: int, temporal: int) -> int:
    """The largest `temporal * k + 1` not above `n` (`n >= 1`): the frame rule of a causal VAE that keeps
    the first frame (`models.causal_conv.FirstFrameKept`, whose `snap_frames` a VAE config calls)."""
    return first_frame_kept(temporal).snap_frames(n)


def snap_size(num_frames: int, height: int, width: int, temporal: int, divisibility: int,
              stacklevel: int = 1) -> tuple[int, int, int]:
    """(frames, height, width) down to `temporal`k + 1 frames and sides that are multiples of
    `divisibility` (the VAE's spatial factor x the DiT's patch), with a warning when anything changed
    (`stacklevel` as the caller would give `warnings.warn`); never below one latent frame or one patch. The pipelines' `snap`."""
    t, d = temporal, divisibility
    if min(num_frames, height, width) < 1:
        raise ValueError(f"num_frames, height and width must be >= 1, got {num_frames}, {height}, {width}")
    snapped = (snap_num_frames(num_frames, t), max(d, height // d * d), max(d, width // d * d))
    if snapped != (num_frames, height, width):
        warnings.warn(f"snapped (frames, height, width) {(num_frames, height, width)} -> {snapped}: "
                      f"frames must be {t}k + 1 and sides multiples of {d}", stacklevel=stacklevel + 1)
    return snapped


def select_frames(total: int, num_frames: int, *, shrink: bool = True, src_fps: float = 0.0,
                  fps: float = 24.0, short_clip: str = "skip") -> list[int]:
    """Source frame indices (length `num_frames`) of a clip with `total` frames; see module docstring.

    Raises `ClipTooShort` when `short_clip == "skip"` and the clip is too short.
    """
    return frame_selection(total, num_frames, shrink=shrink, src_fps=src_fps, fps=fps, short_clip=short_clip)[0]


def frame_selection(total: int, num_frames: int, *, shrink: bool = True, src_fps: float = 0.0,
                    fps: float = 24.0, short_clip: str = "skip") -> tuple[list[int], float]:
    """(`select_frames`' indices, their stride): the source frames one selected frame stands for, the
    step of the rule that chose them: `src_fps / fps` for consecutive frames at `fps` (1 when the
    source rate is unknown), `(total - 1) / (num_frames - 1)` for frames spread over the clip
    (`shrink_video_to_frames`, or `short_clip: stretch`; 1 for a one-frame clip), 1 for one frame. The
    selection's sound spans `num_frames * stride` source frames (`video_dit.data.audio.frames_span`)."""
    if total < 1:
        raise ClipTooShort("the clip has no frames")
    if num_frames == 1:
        return [0], 1.0
    spread = (total - 1) / (num_frames - 1) if total > 1 else 1.0
    if shrink:
        if total < num_frames:
            if short_clip == "skip":
                raise ClipTooShort(f"{total} frames < num_frames {num_frames} (short_clip: skip)")
        return media.select_frames(total, num_frames, "even"), spread
    stride = src_fps / fps if src_fps > 0 else 1.0  # unknown source fps: take consecutive frames
    idx = [int(math.floor(i * stride + 0.5)) for i in range(num_frames)]
    if idx[-1] < total:
        return idx, stride
    if short_clip == "skip":
        raise ClipTooShort(f"{total} frames at {src_fps:g} fps span less than num_frames {num_frames} "
                           f"at fps {fps:g} (needs {idx[-1] + 1} frames; short_clip: skip)")
    return media.select_frames(total, num_frames, "even"), spread


def check_frames_present(path, last_index: int) -> None:
    """Cheap truncation check: seek to the packet of frame `last_index` and check its bytes exist.

    The container index (read by `probe_video`) can promise frames that a truncated file no longer
    holds (an MP4 written with its index first, cut short). This demuxes at most one GOP near
    `last_index` and decodes nothing. Raises `MediaError` naming the file.
    """
    import av

    size = os.path.getsize(path)
    try:
        with av.open(str(path)) as container:
            stream = container.streams.video[0]
            tb = stream.time_base
            rate = stream.average_rate or stream.guessed_rate
            start = stream.start_time or 0
            target = None
            if tb and rate:
                target = start + int(last_index / float(rate) / float(tb))
                try:
                    container.seek(target, stream=stream, backward=True, any_frame=False)
                except av.error.FFmpegError:  # not seekable (no index): demux from the start instead
                    pass
            # Demux (no decode) until decode order passes the target: every packet a frame <= target
            # depends on has then been seen (dts <= pts). A packet cut short by the end of the file is
            # flagged corrupt by the demuxer, or ends past the file size.
            seen, max_pts = 0, -1
            for packet in container.demux(stream):
                if packet.size == 0 and packet.pts is None:  # end-of-stream flush packet
                    break
                seen += 1
                if packet.is_corrupt or (packet.pos is not None and packet.pos >= 0
                                         and packet.pos + packet.size > size):
                    raise media.MediaError(path, f"truncated or corrupt: the packet at byte {packet.pos} "
                                                 f"is incomplete ({size}-byte file)")
                if packet.pts is not None:
                    max_pts = max(max_pts, packet.pts)
                if target is not None and packet.dts is not None and packet.dts > target:
                    return
            if (target is not None and max_pts < target) or (target is None and seen <= last_index):
                raise media.MediaError(path, f"truncated: the stream ends before frame {last_index}")
    except av.error.FFmpegError as exc:
        raise media.MediaError(path, f"truncated or corrupt near frame {last_index} "
                                     f"(FFmpeg: {getattr(exc, 'strerror', None) or exc})") from exc


def crop_plan(src_w: int, src_h: int, width: int, height: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """`((resize_h, resize_w), (top, left))`: scale keeping aspect so the frame covers the bucket,
    then center-crop to `(height, width)`."""
    scale = max(width / src_w, height / src_h)
    rh, rw = max(height, round(src_h * scale)), max(width, round(src_w * scale))
    return (rh, rw), ((rh - height) // 2, (rw - width) // 2)


def fit_frames(array: np.ndarray, resize: tuple[int, int], crop: tuple[int, int],
               size: tuple[int, int], chunk: int = 16) -> torch.Tensor:
    """`(F, H0, W0, 3)` uint8 -> `(F, 3, H, W)` float32 in [-1, 1]: bicubic (antialiased) resize to
    `resize`, then crop at `crop` to `size`; frames converted `chunk` at a time to bound memory."""
    (rh, rw), (top, left), (h, w) = resize, crop, size
    out = []
    for i in range(0, len(array), chunk):
        x = media.array_to_tensor(array[i:i + chunk])  # (f, 3, H0, W0)
        if x.shape[-2:] != (rh, rw):
            x = F_nn.interpolate(x, size=(rh, rw), mode="bicubic", antialias=True,
                                 align_corners=False).clamp_(-1.0, 1.0)
        out.append(x[:, :, top:top + h, left:left + w])  # (f, 3, H, W)
    return torch.cat(out).contiguous()


def load_item_pixels(item) -> torch.Tensor:
    """The pixels of a scanned `DataItem`, `(F, 3, H, W)` float32 in [-1, 1] at its bucket size.

    Raises `MediaError` naming the file when it cannot be decoded."""
    if item.kind == "image":
        array = np.asarray(media.load_image(item.path))[None]
    else:
        array = media.read_video_frames(item.path, list(item.frames))
    _, H, W = item.bucket
    return fit_frames(array, item.resize, item.crop, (H, W))


def load_item_audio(item, rate: int, channels: int) -> torch.Tensor | None:
    """The sound of a scanned `DataItem`: `(channels, round(item.audio_span.duration * rate))` float32,
    its frames' span (`audio.frames_span`) resampled to `rate`; None when the item has none
    (`item.has_audio` False: a clip without an audio stream, an image, or `audio: off`), whose audio
    loss the trainer masks. Raises `MediaError` naming the file when its stream cannot be decoded."""
    if not item.has_audio:
        return None
    wave = audio_mod.read_audio(item.path, item.audio_span, rate=rate, channels=channels)
    if wave is None:  # the file lost its audio stream after the scan
        raise media.MediaError(item.path, "no audio stream (it had one when the dataset was scanned)")
    return torch.from_numpy(wave)
