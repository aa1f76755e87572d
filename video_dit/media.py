"""Video and image files in and out, through PyAV (H.264 MP4) and PIL.

Pixel conventions: tensors are `(F, 3, H, W)` float32 in [-1, 1]; arrays are `(F, H, W, 3)` uint8.
Every failure to read a file raises `MediaError`, whose message names the file and the reason.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Literal, Sequence

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

# ai-toolkit's lists (27a03a91, toolkit/data_loader.py L39-40): both trainers read the same files of a folder
VIDEO_EXTS = (".mp4", ".mov", ".webm", ".mkv", ".avi", ".m4v", ".wmv", ".flv")
IMAGE_EXTS = (".png", ".jpg", ".jpeg", ".webp")


class MediaError(ValueError):
    """An unreadable, corrupt or unsupported media file; the message starts with its path."""

    def __init__(self, path, reason: str):
        self.path = str(path)
        self.reason = reason
        super().__init__(f"{path}: {reason}")


@dataclass(frozen=True)
class VideoInfo:
    num_frames: int
    fps: float
    width: int
    height: int


def _open(path):
    import av

    path = Path(path)
    if not path.is_file():
        raise MediaError(path, "no such file")
    if path.stat().st_size == 0:
        raise MediaError(path, "empty file (0 bytes)")
    try:
        container = av.open(str(path))
    except av.error.InvalidDataError as exc:  # a cut-off MP4 (no index yet) lands here too
        raise MediaError(path, f"not a readable video: truncated or corrupt (FFmpeg: {exc.strerror})") from exc
    except av.error.FFmpegError as exc:  # its str() starts with an errno no user can read
        raise MediaError(path, f"not a readable video (FFmpeg: {exc.strerror or exc})") from exc
    except (UnicodeDecodeError, OSError) as exc:
        raise MediaError(path, f"not a readable video ({exc})") from exc
    if not container.streams.video:
        container.close()
        raise MediaError(path, "no video stream")
    return container


def probe_video(path) -> VideoInfo:
    """Frame count, fps and size from the container header (no full decode).

    Where the header has no frame count (some .webm/.mkv), it is estimated from duration x fps.
    """
    container = _open(path)
    try:
        stream = container.streams.video[0]
        fps = float(stream.average_rate or stream.guessed_rate or 0) or 0.0
        n = stream.frames
        if not n and stream.duration is not None and stream.time_base is not None and fps:
            n = int(round(float(stream.duration * stream.time_base) * fps))
        if not n and container.duration and fps:
            n = int(round(container.duration / 1_000_000 * fps))
        width, height = stream.codec_context.width, stream.codec_context.height
    finally:
        container.close()
    if not width or not height:
        raise MediaError(path, "video stream has no frame size")
    return VideoInfo(num_frames=int(n or 0), fps=fps, width=width, height=height)


def select_frames(total: int, num_frames: int | None, sample: str = "even", stride: int = 1,
                  start: int = 0) -> list[int]:
    """Indices of the frames to keep. `even`: spread over the whole clip (ai-toolkit's
    `shrink_video_to_frames`, `round(i * (total - 1) / (n - 1))`); `stride`: every `stride`-th frame
    from `start`. Indices may repeat only for `even` when the clip is shorter than `num_frames`."""
    if num_frames is None:
        return list(range(start, total, stride))
    if num_frames < 1:
        raise ValueError(f"num_frames must be >= 1, got {num_frames}")
    if sample == "even":
        if num_frames == 1:
            return [0]
        return [round(i * (total - 1) / (num_frames - 1)) for i in range(num_frames)]
    if sample == "stride":
        return [start + i * stride for i in range(num_frames)]
    raise ValueError(f"sample must be 'even' or 'stride', got {sample!r}")


def read_video_frames(path, indices: Sequence[int] | None = None) -> np.ndarray:
    """Decode the frames at `indices` (all when None) as `(F, H, W, 3)` uint8, in one pass."""
    import av

    wanted = None if indices is None else sorted(set(indices))
    frames: dict[int, np.ndarray] = {}
    container = _open(path)
    try:
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        last = None if wanted is None else wanted[-1]
        keep = None if wanted is None else set(wanted)
        for i, frame in enumerate(container.decode(stream)):
            if keep is None or i in keep:
                frames[i] = frame.to_ndarray(format="rgb24")
            if last is not None and i >= last:
                break
    except av.error.FFmpegError as exc:
        raise MediaError(path, f"decoding failed: truncated or corrupt (FFmpeg: {exc.strerror or exc})") from exc
    except ValueError as exc:
        raise MediaError(path, f"decoding failed ({exc})") from exc
    finally:
        container.close()
    if not frames:
        raise MediaError(path, "no decodable frames")
    if indices is None:
        return np.stack([frames[i] for i in sorted(frames)])
    missing = [i for i in indices if i not in frames]
    if missing:
        raise MediaError(path, f"frame {missing[0]} requested but the clip decodes only {len(frames)} "
                               f"of the wanted frames (truncated or shorter than its header says)")
    return np.stack([frames[i] for i in indices])


def read_video(path, num_frames: int | None = None, *, sample: Literal["even", "stride"] = "even",
               stride: int = 1, start: int = 0) -> torch.Tensor:
    """`(F, 3, H, W)` float32 in [-1, 1]; frames chosen by `select_frames` (all when num_frames is None)."""
    if num_frames is None:
        array = read_video_frames(path)
        array = array[start::stride]
    else:
        total = probe_video(path).num_frames
        if total <= 0:  # header without a count: decode everything once
            array = read_video_frames(path)
            idx = select_frames(len(array), num_frames, sample, stride, start)
            if max(idx) >= len(array):
                raise MediaError(path, f"needs frame {max(idx)} but the clip has {len(array)} frames")
            array = array[idx]
        else:
            idx = select_frames(total, num_frames, sample, stride, start)
            if max(idx) >= total:
                raise MediaError(path, f"needs frame {max(idx)} but the clip has {total} frames")
            array = read_video_frames(path, idx)
    return array_to_tensor(array)


def array_to_tensor(array: np.ndarray) -> torch.Tensor:
    """`(F, H, W, 3)` uint8 -> `(F, 3, H, W)` float32 in [-1, 1]."""
    return torch.from_numpy(np.array(array, copy=not array.flags.writeable, order="C")).permute(0, 3, 1, 2).float().div_(127.5).sub_(1.0)


def tensor_to_array(frames: torch.Tensor) -> np.ndarray:
    """`(F, 3, H, W)` in [-1, 1] -> `(F, H, W, 3)` uint8 (rounded, clamped)."""
    x = frames.detach().float().cpu().clamp(-1, 1).add(1).mul(127.5).round().to(torch.uint8)
    return x.permute(0, 2, 3, 1).contiguous().numpy()


def tensor_to_pil(frames: torch.Tensor) -> list[Image.Image]:
    """`(F, 3, H, W)` (or one `(3, H, W)`) in [-1, 1] -> PIL RGB images."""
    if frames.ndim == 3:
        frames = frames[None]
    return [Image.fromarray(a) for a in tensor_to_array(frames)]


def pil_to_tensor(img: Image.Image) -> torch.Tensor:
    """PIL image -> `(3, H, W)` float32 in [-1, 1]."""
    return array_to_tensor(np.asarray(img.convert("RGB"))[None])[0]


def load_image(path) -> Image.Image:
    """An image file as PIL RGB; `MediaError` naming the file when it cannot be read."""
    path = Path(path)
    if not path.is_file():
        raise MediaError(path, "no such file")
    try:
        with Image.open(path) as img:
            img.load()
            return img.convert("RGB")
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
        raise MediaError(path, f"not a readable image ({exc})") from exc


def _to_array(frames) -> np.ndarray:
    if isinstance(frames, torch.Tensor):
        return tensor_to_array(frames)
    if isinstance(frames, np.ndarray):
        if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != 3:
            raise ValueError(f"expected a (F, H, W, 3) uint8 array, got {frames.dtype} {frames.shape}")
        return frames
    return np.stack([np.asarray(f.convert("RGB")) for f in frames])


AAC_RATES = (8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, 48000, 64000, 88200, 96000)  # AAC's sample rates


def write_video(frames, path, fps: float = 16, audio=None, audio_rate: int | None = None) -> Path:
    """Write frames (PIL list, `(F, H, W, 3)` uint8 array or `(F, 3, H, W)` tensor in [-1, 1]).

    `.mp4`/`.mov`/`.mkv`: H.264 (`libx264`, `yuv420p`, odd sizes padded to even by edge replication),
    single-threaded, without x264's macroblock tree, so equal frames give byte-identical files (tested
    at several sizes: with mbtree on, small frames such as 64x96 encode differently from run to run).
    `audio` (`(C, S)` float array or tensor, C 1 or 2, clipped to [-1, 1]) at `audio_rate` samples per
    second (one of `AAC_RATES`): an AAC track beside the video, both from time 0.
    `.webp`/`.gif`: animated image through PIL (no audio track: a `ValueError` when `audio` is given).
    Written to a temp file, then renamed into place.
    """
    path = Path(path)
    array = _to_array(frames)
    if len(array) == 0:
        raise ValueError(f"{path}: no frames to write")
    ext = path.suffix.lower()
    wave = None if audio is None else _audio_array(audio, audio_rate, path)
    if wave is not None and ext in (".webp", ".gif"):
        raise ValueError(f"{path}: a {ext} has no audio track; write .mp4 / .mov / .mkv for video with sound")
    if wave is not None and audio_rate not in AAC_RATES:
        raise ValueError(f"{path}: audio_rate {audio_rate} is not an AAC sample rate; accepted: "
                         f"{', '.join(map(str, AAC_RATES))}")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}{path.suffix}")
    try:
        if ext in (".webp", ".gif"):
            images = [Image.fromarray(a) for a in array]
            kw = {"quality": 90} if ext == ".webp" else {}
            images[0].save(tmp, save_all=True, append_images=images[1:],
                           duration=max(1, round(1000 / fps)), loop=0, **kw)
        elif ext in (".mp4", ".mov", ".mkv"):
            _write_h264(array, tmp, fps, wave, audio_rate)
        else:
            raise ValueError(f"{path}: unsupported video extension {ext!r}; accepted: .mp4 .mov .mkv .webp .gif")
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


def _audio_array(audio, rate, path) -> np.ndarray:
    """`audio` as a (C, S) float32 contiguous array clipped to [-1, 1]; a ValueError naming the file otherwise."""
    if rate is None or int(rate) != rate or rate < 1:
        raise ValueError(f"{path}: audio needs audio_rate, a positive whole number of samples per second, got {rate!r}")
    if isinstance(audio, torch.Tensor):
        audio = audio.detach().float().cpu().numpy()
    wave = np.asarray(audio, np.float32)
    if wave.ndim != 2 or wave.shape[0] not in (1, 2) or wave.shape[1] < 1:
        raise ValueError(f"{path}: audio must be (channels, samples) with 1 or 2 channels, got shape {wave.shape}")
    if not np.isfinite(wave).all():
        raise ValueError(f"{path}: audio holds NaN or infinite samples")
    return np.ascontiguousarray(np.clip(wave, -1.0, 1.0))


def _write_h264(array: np.ndarray, path: Path, fps: float, wave: np.ndarray | None = None,
                audio_rate: int | None = None) -> None:
    import av

    h, w = array.shape[1:3]
    ph, pw = h % 2, w % 2
    if ph or pw:  # yuv420p needs even sides
        array = np.pad(array, ((0, 0), (0, ph), (0, pw), (0, 0)), mode="edge")
    rate = Fraction(fps).limit_denominator(1001)
    with av.open(str(path), mode="w", format="mp4" if path.suffix.lower() != ".mkv" else None) as container:
        stream = container.add_stream("libx264", rate=rate)
        stream.width, stream.height = array.shape[2], array.shape[1]
        stream.pix_fmt = "yuv420p"
        # threads=1: one slice/frame order. mbtree=0: x264's macroblock-tree rate control (its lookahead
        # propagation) reads memory it has not written for small frames (64x96, 96x64, 80x144, ... at
        # 5-17 frames), so the same frames gave different bytes from one call to the next; without it
        # (and with asm or B-frames off, both slower or larger) the output is a function of the frames.
        stream.options = {"crf": "18", "preset": "medium", "threads": "1", "x264-params": "mbtree=0"}
        stream.codec_context.thread_count = 1
        sound = None
        if wave is not None:  # every stream is added before the first packet is muxed
            sound = container.add_stream("aac", rate=int(audio_rate))  # FFmpeg's native AAC encoder
            sound.layout = "mono" if wave.shape[0] == 1 else "stereo"
            sound.codec_context.thread_count = 1
        for a in array:
            for packet in stream.encode(av.VideoFrame.from_ndarray(a, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
        if sound is not None:  # one planar frame from time 0; the encoder cuts it into its 1024-sample frames
            frame = av.AudioFrame.from_ndarray(wave, format="fltp", layout=sound.layout.name)
            frame.sample_rate, frame.pts, frame.time_base = int(audio_rate), 0, Fraction(1, int(audio_rate))
            for packet in [*sound.encode(frame), *sound.encode()]:
                container.mux(packet)


def contact_sheet(frames, cols: int | None = None, pad: int = 2) -> Image.Image:
    """Frames (PIL list, array or tensor as for `write_video`) in a grid, for a quick look."""
    array = _to_array(frames)
    n, h, w = array.shape[:3]
    cols = cols or min(n, max(1, math.ceil(math.sqrt(n * h / w))))
    rows = math.ceil(n / cols)
    sheet = Image.new("RGB", (cols * (w + pad) + pad, rows * (h + pad) + pad), (32, 32, 32))
    for i, a in enumerate(array):
        r, c = divmod(i, cols)
        sheet.paste(Image.fromarray(a), (pad + c * (w + pad), pad + r * (h + pad)))
    return sheet
