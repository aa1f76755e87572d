"""Dataset config (ai-toolkit's keys) and the folder scan: files -> items with caption, bucket and frames.

A dataset folder holds videos (`.mp4 .mov .webm .mkv .avi .m4v .wmv .flv`) and images (`.png .jpg
.jpeg .webp`), each with an optional same-name caption (`<stem>.<caption_ext>` beside it); a missing
caption is the empty prompt (one warning for the whole folder). The folder is read as ai-toolkit
reads it (`list_media`): recursively, dot-files and dot-folders ignored, and files in `_controls/`
folders too, so both trainers train on the same files (the demo data keeps its held-out clips
beside the folder, never inside it; the caches hold no media).

`scan_dataset` probes every file cheaply (container header plus one seek near the last needed
frame; nothing is decoded) and turns each good file into one `DataItem` per `resolution`. A file
that cannot be used (zero bytes, not a video, corrupt, truncated, too short, huge resolution (frames
above `MAX_PIXELS`, PIL's decompression-bomb limit), unreadable caption) is skipped with ONE warning
naming it and the reason, and counted in the summary printed at the start. A caption that is not
UTF-8 is read as UTF-16 (with its byte-order mark) or cp1252 / latin-1, with one warning naming it.
No usable item left -> `DataError` before any training starts; so is a video dataset whose every
clip is shorter than `num_frames` (the message names the longest clip).

Sizes: an item is never upscaled by default. A source smaller than the bucket of its `resolution`
takes the largest bucket that fits inside it (the resolution lowered a cell at a time), so it
trains at about its own size; the summary says how many and the largest factor avoided.
`allow_upscale: true` scales them up to the resolution instead (the summary warns with the factor).

Stills in a `do_i2v` dataset train unconditioned (as t2v, as ai-toolkit does): a one-frame item has
no frame after the first to generate. `DataItem.conditioned` is the one definition of "this item
is trained on its first frame". A concat i2v model (in_dim 36) has no unconditioned input, so
`scan_datasets(..., i2v_mode="concat")` skips the stills of `do_i2v` datasets with one warning per
dataset naming how many and why (`video_dit.diffusion.conditioning.stills_skipped`, the rule the ai-toolkit arch
follows too, in the same words).

Sound (`scan_dataset(..., audio=True)`: the job's model generates sound). Each clip's audio track is
read over the span of its selected frames (`video_dit.data.audio`: the same selection, stride and
timestamps as the picture) and the clip is counted as with sound, silent (peak below
`audio.SILENT_PEAK`, -60 dBFS: still sound, trained as such) or without an audio stream. The dataset
key `audio` says what happens: `auto` (default) keeps a clip without an audio stream, to train the
picture alone (`DataItem.has_audio` False: its audio loss masked; the start-up summary counts them in
one line); `required` skips every item without sound (clips without an audio stream and images), one
warning each; `off` reads no track (every item trains the picture alone). A clip whose audio stream
cannot be decoded is skipped with one warning naming it, and counted ("corrupt audio"); nothing else
is lost. In a job without sound (`audio=False`, the default) no track is read and the key is ignored.
"""

from __future__ import annotations

import math
import os
import warnings
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Literal

from PIL import Image, UnidentifiedImageError

from video_dit import media
from video_dit.data import audio as audio_mod
from video_dit.data import frames as frames_mod
from video_dit.data.buckets import fitted_bucket
from video_dit.diffusion.conditioning import skipped_stills, stills_skipped
from video_dit.typed_config import ConfigError

VIDEO_EXTS = media.VIDEO_EXTS
IMAGE_EXTS = media.IMAGE_EXTS
CONTROLS = "_controls"  # ai-toolkit's control images beside a dataset's items: never items themselves
STILL_SKIPPED = "still of a do_i2v dataset, skipped by a concat image-to-video model"  # a skipped file's reason
NO_SOUND = "no audio stream (audio: required)"  # a skipped file's reason: a clip or image without sound
AUDIO_MODES = ("auto", "required", "off")
MAX_PIXELS = Image.MAX_IMAGE_PIXELS or 89_478_485  # larger frames are skipped (decoding them risks OOM)


class DataError(ValueError):
    """No usable data (or a dataset that cannot be used as configured); the message says which folder."""


class DataWarning(UserWarning):
    """One per skipped file (naming it and why), and one per folder for missing captions."""


_format_warning = warnings.formatwarning


def _format_data_warning(message, category, filename, lineno, line=None):
    """A `DataWarning` prints as one line, `[video_dit] warning: <message>`: the default format adds
    the emitting source line (`return ScanResult.merge(...`), which tells a user nothing."""
    if isinstance(category, type) and issubclass(category, DataWarning):
        return f"[video_dit] warning: {message}\n"
    return _format_warning(message, category, filename, lineno, line)


warnings.formatwarning = _format_data_warning


@dataclass
class DatasetConfig:
    """One entry of `config.process[0].datasets` (ai-toolkit's dataset keys plus a few of ours).

    ai-toolkit keys: `folder_path` (required), `caption_ext`, `caption_dropout_rate` (per step, see
    `CachedDataset`), `num_frames` (4k+1; snapped down with a warning), `shrink_video_to_frames`
    (spread frames over the whole clip; false: consecutive frames at `fps`), `fps`, `do_i2v` (cache
    the first frame's latents too), `resolution` (one or several target sides; an item is used once
    per resolution), `cache_latents_to_disk` and `cache_text_embeddings` (either value: training here
    always reads cached tensors, which equal what encoding every step would give, since the VAE's
    posterior mode and the text encoder are deterministic; false is ai-toolkit's default),
    `num_repeats` (each item appears this many times per epoch),
    `default_caption` (prompt of files without a caption file, instead of the empty prompt), `trigger_word`
    (default: the process's; `inject_trigger`: every caption's `[trigger]` / `[name]` become it, and a caption
    without it gets it prepended, as ai-toolkit's captions; without a trigger word those tokens are removed).
    Accepted for ai-toolkit files, with this meaning here: `cache_latents` (ai-toolkit's in-memory
    latent cache; latents here are always cached on disk and read per step, either value is
    accepted), `buckets` (true: aspect buckets; false: every item center-cropped to one square
    bucket of side `resolution`), `shuffle_tokens` (false only: text embeds are cached per caption,
    so comma-separated tags cannot be reshuffled per step).
    Ours: `do_flf2v` (with `do_i2v`: condition on the last frame of the selected clip too, Wan 2.1
    FLF2V's first-last-frame; its mask + VAE latents and, for a CLIP model, both frames' features are
    cached), `short_clip` (`skip` or `stretch` a clip shorter than `num_frames`), `cache_dir` (where
    `_latent_cache/` and `_text_cache/` go; default: inside `folder_path`), `num_workers`
    (DataLoader worker processes the trainer uses to read cached tensors), `validation_split` (a
    share of the folder's files, chosen by `train.seed`, held out for `train.validation_config` and
    never trained on; 1 = the whole folder is a validation set), `allow_upscale` (false: a source
    smaller than `resolution` trains at its own size; true: it is upscaled to it), `audio` (in a job
    whose model generates sound: `auto` reads each clip's audio track, a clip without one trains the
    picture alone with its audio loss masked; `required` skips items without sound; `off` reads no
    track; see the module docstring); `do_audio` (ai-toolkit's: false is `audio: off`).
    ai-toolkit keys its web UI writes that this trainer does not act on (`mask_path`, `is_reg`, `network_weight`,
    `controls`, `control_path*`, `flip_x` / `flip_y`, `auto_frame_count`, `batch_size`, ...): accepted at
    their no-op values only, with the reason (train/config.py `IGNORED["datasets"]`).
    """

    folder_path: str
    caption_ext: str = "txt"
    caption_dropout_rate: float = 0.0
    num_frames: int = 1
    shrink_video_to_frames: bool = True
    fps: int = 24
    do_i2v: bool = False
    do_flf2v: bool = False
    resolution: list[int] | int = field(default_factory=lambda: [512])
    cache_latents_to_disk: bool = True
    cache_text_embeddings: bool = True
    num_repeats: int = 1
    default_caption: str | None = None
    trigger_word: str | None = None  # (None: the process's `trigger_word`, as ai-toolkit)
    cache_latents: bool | None = None
    buckets: bool = True
    shuffle_tokens: bool = False
    short_clip: Literal["skip", "stretch"] = "skip"
    cache_dir: str | None = None
    num_workers: int = 0
    validation_split: float = 0.0
    allow_upscale: bool = False
    audio: Literal["auto", "required", "off"] = "auto"
    do_audio: bool | None = None  # ai-toolkit's key: false is `audio: off`, true the sound read (`audio` auto)
    # ai-toolkit keys (its web UI writes them) accepted at their no-op values only: train/config.py IGNORED
    mask_path: str | None = None
    mask_min_value: float | None = None
    is_reg: bool = False
    network_weight: float = 1.0
    controls: list[str] = field(default_factory=list)
    control_path: str | None = None
    control_path_1: str | None = None
    control_path_2: str | None = None
    control_path_3: str | None = None
    flip_x: bool = False
    flip_y: bool = False
    auto_frame_count: bool = False
    batch_size: int | None = None
    config_path: str = field(default="datasets[0]", init=False, repr=False, compare=False)
    validated: bool = field(default=False, init=False, repr=False, compare=False)
    # the model's VAE's frame rule (`fit_frames`: n -> the longest clip it encodes of at most n frames);
    # None: no model known (frame counts are not snapped)
    snap_frames: Callable[[int], int] | None = field(default=None, init=False, repr=False, compare=False)

    def fit_frames(self, snap_frames: Callable[[int], int], path: str | None = None) -> None:
        """Snap `num_frames` down to a count the model's VAE encodes (`snap_frames`, the preset VAE's
        `VAEShape.snap_frames`), with one warning naming the key when it changes; a job calls it with its
        preset's VAE (train/config.py)."""
        snapped = snap_frames(self.num_frames)
        if snapped != self.num_frames:
            warnings.warn(f"{path or self.config_path}.num_frames: {self.num_frames} is not a frame count the "
                          f"model's VAE encodes; using {snapped}", DataWarning, stacklevel=2)
            self.num_frames = snapped
        self.snap_frames = snap_frames

    def validate(self, path: str) -> None:
        self.config_path = path
        if isinstance(self.resolution, int):
            self.resolution = [self.resolution]
        if not self.resolution or any(r < 1 for r in self.resolution):
            raise ConfigError(f"{path}.resolution", f"expected one or more positive sides, got {self.resolution}")
        if self.num_frames < 1:
            raise ConfigError(f"{path}.num_frames", f"must be >= 1 (a t k + 1 count such as 1, 17, 81 for a VAE that "
                                                    f"compresses time t = 4x), got {self.num_frames}")
        if not 0.0 <= self.caption_dropout_rate <= 1.0:
            raise ConfigError(f"{path}.caption_dropout_rate", f"must be in [0, 1], got {self.caption_dropout_rate}")
        if self.fps <= 0:
            raise ConfigError(f"{path}.fps", f"must be > 0, got {self.fps}")
        if self.num_repeats < 1:
            raise ConfigError(f"{path}.num_repeats", f"must be >= 1, got {self.num_repeats}")
        if not 0.0 <= self.validation_split <= 1.0:
            raise ConfigError(f"{path}.validation_split", f"must be in [0, 1], got {self.validation_split}")
        if self.num_workers < 0:
            raise ConfigError(f"{path}.num_workers", f"must be >= 0, got {self.num_workers}")
        if not self.caption_ext or "/" in self.caption_ext:
            raise ConfigError(f"{path}.caption_ext", f"expected an extension such as 'txt', got {self.caption_ext!r}")
        if self.do_audio is not None:
            if self.audio == ("off" if self.do_audio else "required"):
                raise ConfigError(f"{path}.do_audio", f"{self.do_audio} conflicts with audio: {self.audio}; give one")
            if not self.do_audio:
                self.audio = "off"
        if self.audio not in AUDIO_MODES:  # typed_config checks a parsed file; this, a config built in code
            raise ConfigError(f"{path}.audio", f"{self.audio!r} is not accepted; accepted: "
                                               f"{' | '.join(AUDIO_MODES)}")
        if self.shuffle_tokens:
            raise ConfigError(f"{path}.shuffle_tokens", "only false is supported: text embeds are cached per "
                                                      "caption, so tags cannot be reshuffled each step")
        folder = Path(self.folder_path)
        if not folder.is_dir():
            raise ConfigError(f"{path}.folder_path", f"{self.folder_path!r} is not a directory")
        if not list_media(folder, self.caption_ext)[0]:
            raise ConfigError(f"{path}.folder_path", f"{self.folder_path!r} holds no video or image "
                                                     f"({' '.join(VIDEO_EXTS + IMAGE_EXTS)}), in it or in its "
                                                     "sub-folders")
        self.validated = True

    @property
    def is_video(self) -> bool:
        return self.num_frames > 1

    @property
    def cache_root(self) -> str:
        return os.path.abspath(self.cache_dir or self.folder_path)

    def check_divisibility(self, divisibility: int) -> None:
        """Every `resolution` must hold at least one `divisibility`-sided cell (ConfigError otherwise)."""
        for r in self.resolution:
            if r < divisibility:
                raise ConfigError(f"{self.config_path}.resolution",
                                  f"{r} is below the model's divisibility {divisibility}; "
                                  f"use a multiple of {divisibility} (e.g. {max(divisibility, 512)})")


@dataclass(frozen=True)
class DataItem:
    """One training item: a file at one resolution, with its caption, bucket and frame selection."""

    path: str                       # absolute path of the video or image
    kind: Literal["video", "image"]
    caption: str
    bucket: tuple[int, int, int]    # (F, H, W) in pixels
    frames: tuple[int, ...]         # source frame indices, len F (images: (0,))
    resize: tuple[int, int]         # (h, w) the source is scaled to (aspect kept) ...
    crop: tuple[int, int]           # ... then cropped at (top, left) to (H, W)
    source: tuple[int, int, int, float]  # (num_frames, width, height, fps) of the file
    size: int                       # file identity for the cache key: bytes ...
    mtime_ns: int                   # ... and modification time
    dataset: int = 0                # index in the job's datasets list
    do_i2v: bool = False
    caption_dropout_rate: float = 0.0
    num_repeats: int = 1
    cache_root: str = ""            # `_latent_cache/` and `_text_cache/` live here
    has_audio: bool = False         # it trains sound (a clip's audio stream, silent or not); False: the
    #                                 picture alone, audio loss masked (no stream, an image, `audio: off`,
    #                                 or a job without sound)
    audio_span: audio_mod.AudioSpan | None = None  # its frames' span on the file's timeline (a job with
    #                                 sound, a clip with a frame rate): what `frames.load_item_audio` cuts

    @property
    def conditioned(self) -> bool:
        """Whether this item trains on its first frame (i2v): a clip of a `do_i2v` dataset. A still
        (one frame) has no later frame to generate and trains unconditioned, as t2v. The one home of
        this rule: the trainer's per-sample choice and the start-up summary read it."""
        return self.do_i2v and self.bucket[0] > 1

    @property
    def upscale(self) -> float:
        """Linear factor the source is scaled by to cover its bucket (> 1: upscaled)."""
        _, H, W = self.bucket
        return max(W / self.source[1], H / self.source[2])


@dataclass
class ScanResult:
    items: list[DataItem]
    skipped: list[tuple[str, str]]  # (path, reason)
    missing_captions: int = 0
    ignored: int = 0                # other files (captions excluded)
    folders: list[str] = field(default_factory=list)
    clips: list[tuple[str, int, float]] = field(default_factory=list)  # (path, frames, fps) of every video
    #                                      whose header was read, items or not (for "longest clip")
    not_upscaled: list[tuple[str, int, float]] = field(default_factory=list)  # (path, resolution, factor
    #                                      avoided): kept at their own size instead of being upscaled
    subfolders: list[str] = field(default_factory=list)  # sub-folders media were read from (`list_media`)
    audio: dict[str, str] = field(default_factory=dict)  # path -> "sound" | "silent" | "none" (no audio
    #                                      stream) of every clip whose track was read (a job with sound)

    def audio_counts(self) -> Counter:
        """Files per sound state: "sound" (a track, silent or not), "silent" (of those, peak below
        -60 dBFS), "none" (no audio stream), "corrupt" (skipped: the stream cannot be decoded)."""
        c: Counter = Counter(self.audio.values())
        c["sound"] += c["silent"]
        c["corrupt"] = sum(_reason_kind(r) == "corrupt audio" for _, r in self.skipped)
        return c

    def bucket_counts(self) -> Counter:
        """`(F, H, W) -> items per epoch` (repeats counted)."""
        c: Counter = Counter()
        for it in self.items:
            c[it.bucket] += it.num_repeats
        return c

    def summary(self) -> str:
        reasons = Counter(_reason_kind(r) for _, r in self.skipped)
        lines = [f"data: {', '.join(self.folders)}: {len(self.items)} items in {len(self.bucket_counts())} "
                 f"buckets, {len(self.skipped)} files skipped"
                 + (f" ({', '.join(f'{n} {k}' for k, n in reasons.most_common())})" if reasons else "")
                 + (f", {self.missing_captions} without caption (empty prompt)" if self.missing_captions else "")]
        for b, n in sorted(self.bucket_counts().items()):
            lines.append(f"  bucket F={b[0]} H={b[1]} W={b[2]}: {n} per epoch")
        lines += [f"  {note}" for note in self.notes()]
        a = self.audio_counts()
        if self.audio or a["corrupt"]:  # a job with sound: the one start-up line on its clips' tracks
            lines.append(f"  audio: {a['sound']} clip(s) with sound ({a['silent']} of them silent: peak below "
                         f"{audio_mod.SILENT_DBFS:g} dBFS, trained as sound), {a['none']} without an audio stream "
                         "train the picture alone (audio loss masked)"
                         + (f", {a['corrupt']} skipped for a corrupt audio stream" if a["corrupt"] else ""))
        return "\n".join(lines)  # the skipped files themselves were named in one warning each

    def notes(self) -> list[str]:
        """What the summary (and `inspect-data`) must tell beyond counts: media read from sub-folders,
        stills trained unconditioned in i2v datasets, sources kept at their own size, upscaled items
        with their factor."""
        out = []
        if self.subfolders:
            out.append(f"media read from {len(self.subfolders)} sub-folder(s) ({_first(self.subfolders)}): a "
                       "dataset folder is read recursively, as ai-toolkit reads it")
        stills = sorted({Path(it.path).name for it in self.items if it.do_i2v and not it.conditioned})
        if stills:
            out.append(f"{len(stills)} still image(s) in do_i2v datasets train unconditioned (as t2v: a "
                       f"still has no frame after the first to generate): {_first(stills)}")
        if self.not_upscaled:
            path, res, factor = max(self.not_upscaled, key=lambda x: x[2])
            out.append(f"{len(self.not_upscaled)} item(s) smaller than their resolution train at their own size "
                       f"instead of being upscaled (up to {factor:.1f}x: {Path(path).name} at resolution {res}); "
                       "allow_upscale: true would upscale them")
        up = [it for it in self.items if it.upscale > 1.0 + 1e-9]
        if up:
            worst = max(up, key=lambda it: it.upscale)
            out.append(f"warning: {len(up)} item(s) are upscaled (allow_upscale: true), up to {worst.upscale:.1f}x "
                       f"({Path(worst.path).name}: {worst.source[1]}x{worst.source[2]} -> "
                       f"{worst.bucket[2]}x{worst.bucket[1]})")
        return out

    @staticmethod
    def merge(scans: list["ScanResult"]) -> "ScanResult":
        """One scan of several datasets (a job's `datasets` list), items in list order."""
        return ScanResult(items=[it for s in scans for it in s.items],
                          skipped=[x for s in scans for x in s.skipped],
                          missing_captions=sum(s.missing_captions for s in scans),
                          ignored=sum(s.ignored for s in scans),
                          folders=[f for s in scans for f in s.folders],
                          clips=[c for s in scans for c in s.clips],
                          not_upscaled=[x for s in scans for x in s.not_upscaled],
                          subfolders=[x for s in scans for x in s.subfolders],
                          audio={k: v for s in scans for k, v in s.audio.items()})


def _first(names: list[str], n: int = 3) -> str:
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")


def _reason_kind(reason: str) -> str:
    for key in ("corrupt audio", NO_SOUND, "empty", "truncated", "too short", "frames <", "span less",
                "not a readable", "caption", "image dataset", "decod", "huge resolution", "px cell", STILL_SKIPPED):
        if key in reason:  # the audio keys first: an audio stream's reason also says "decoded"
            return {NO_SOUND: "without sound (audio: required)", "frames <": "too short", "span less": "too short",
                    "not a readable": "not readable", "truncated": "truncated or corrupt",
                    STILL_SKIPPED: "stills of a concat i2v job", "decod": "undecodable",
                    "image dataset": "video in an image dataset", "px cell": "too small"}.get(key, key)
    return "unreadable"


def _read_caption(path: Path) -> tuple[str, str | None]:
    """(caption, note): UTF-8 (a byte-order mark is dropped); else UTF-16 when it starts with its
    byte-order mark and a third of its bytes are zeros (text that is mostly Latin letters); else
    cp1252 (Windows' Western encoding, a superset of latin-1's printable characters), else latin-1,
    which decodes any bytes. `note` says which fallback was used, for one warning naming the file:
    no clip is lost for its caption's encoding."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise DataError(f"unreadable caption {path.name} ({exc.strerror or exc})") from exc
    try:
        return raw.decode("utf-8-sig").strip(), None
    except UnicodeDecodeError as exc:
        why = f"not UTF-8: {exc.reason} at byte {exc.start}"
    utf16 = raw[:2] in (b"\xff\xfe", b"\xfe\xff") and raw.count(0) * 3 >= len(raw)
    candidates = (("utf-16",) if utf16 else ()) + ("cp1252", "latin-1")
    for encoding in candidates:
        try:
            text = raw.decode(encoding).strip()
        except UnicodeDecodeError:
            continue
        return text, f"caption {path.name} is {why}; read as {encoding}: {text[:60]!r}"
    raise AssertionError("latin-1 decodes any bytes")  # pragma: no cover


def _probe_image(path: Path) -> tuple[int, int]:
    if path.stat().st_size == 0:
        raise media.MediaError(path, "empty file (0 bytes)")
    try:
        with Image.open(path) as img:
            img.verify()  # header and structure; no full decode
            size = img.size
    except Image.DecompressionBombError as exc:  # PIL refuses to open it at all (> 2x its limit)
        raise media.MediaError(path, f"huge resolution ({exc})") from exc
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
        raise media.MediaError(path, f"not a readable image ({exc})") from exc
    _check_pixels(path, *size)
    return size


def _check_pixels(path: Path, width: int, height: int) -> None:
    if width * height > MAX_PIXELS:
        raise media.MediaError(path, f"huge resolution {width}x{height} ({width * height} pixels > "
                                     f"{MAX_PIXELS}); downscale it first")


def _probe(path: Path, cfg: DatasetConfig, caption_suffix: str, clip_info: list, audio: bool = False):
    """`(kind, (w, h), frame indices, source, stat, caption or None, caption note or None, (sound
    state, audio span))` of one file, or the reason it is unusable (raised as MediaError / ClipTooShort
    / DataError). A video whose header was read is appended to `clip_info` as (frames, fps), usable or
    not. `audio`: the job trains sound (`_probe_sound`). Runs in a worker thread."""
    ext = path.suffix.lower()
    if ext in VIDEO_EXTS and not cfg.is_video:
        raise DataError("video in an image dataset (num_frames: 1); set num_frames > 1 to use videos")
    stat = path.stat()
    if stat.st_size == 0:
        raise media.MediaError(path, "empty file (0 bytes)")
    if ext in VIDEO_EXTS:
        info = media.probe_video(path)
        if info.num_frames < 1:
            raise media.MediaError(path, "the header gives no frame count")
        _check_pixels(path, info.width, info.height)
        clip_info.append((info.num_frames, info.fps))
        idx, stride = frames_mod.frame_selection(info.num_frames, cfg.num_frames, shrink=cfg.shrink_video_to_frames,
                                                 src_fps=info.fps, fps=cfg.fps, short_clip=cfg.short_clip)
        frames_mod.check_frames_present(path, max(idx))
        kind, size, source = "video", (info.width, info.height), (info.num_frames, info.width, info.height, info.fps)
        sound = _probe_sound(path, cfg, info, idx, stride) if audio else (None, None)
    else:
        size = _probe_image(path)
        kind, idx, source = "image", [0], (1, size[0], size[1], 0.0)
        if audio and cfg.audio == "required":
            raise DataError(NO_SOUND)
        sound = (None, None)
    cap_path = path.with_suffix(caption_suffix)
    caption, note = _read_caption(cap_path) if cap_path.exists() else (None, None)
    return kind, size, idx, source, stat, caption, note, sound


def _probe_sound(path: Path, cfg: DatasetConfig, info: media.VideoInfo, idx: list[int],
                 stride: float) -> tuple[str | None, audio_mod.AudioSpan | None]:
    """(sound state, span) of a clip in a job with sound: the span of its selected frames
    (`audio.frames_span`) and, unless `audio: off` (state None), its track read over that span at
    the stream's own rate: "sound", "silent" (`audio.is_silent`) or "none" (no audio stream; DataError
    under `audio: required`). A stream that cannot be decoded raises MediaError (the clip is skipped)."""
    if info.fps <= 0:  # no frame rate: its frames cannot be placed in time
        if cfg.audio == "off" or audio_mod.audio_info(path) is None:
            if cfg.audio == "required":
                raise DataError(NO_SOUND)
            return (None if cfg.audio == "off" else "none"), None
        raise media.MediaError(path, "corrupt audio timing: the header gives no frame rate, so the sound "
                                     "cannot be cut to the clip's frames")
    span = audio_mod.frames_span(info.start, idx[0], len(idx), stride, info.fps)
    if cfg.audio == "off":
        return None, span
    wave = audio_mod.read_audio(path, span)
    if wave is None:
        if cfg.audio == "required":
            raise DataError(NO_SOUND)
        return "none", span
    return ("silent" if audio_mod.is_silent(wave) else "sound"), span


def inject_trigger(prompt: str, trigger: str | None, add_if_not_present: bool) -> str:
    """ai-toolkit's trigger word (toolkit/prompt_utils.py `inject_trigger_into_prompt`, at 27a03a91): `[name]`
    and `[trigger]` become `trigger` (removed when it is None); when `add_if_not_present` and the prompt does
    not then hold the word, it is prepended with a space. Captions add it (`FileItemDTO.get_caption`), preview
    prompts only replace the tokens (BaseSDTrainProcess.sample)."""
    word = trigger or ""
    for token in ("[name]", "[trigger]"):
        prompt = prompt.replace(token, word)
    if word.strip() and add_if_not_present and word not in prompt:
        prompt = f"{word} {prompt}"
    return prompt


def list_media(folder: str | os.PathLike, caption_ext: str = "txt", files=None) -> tuple[list[Path], int]:
    """(absolute paths of the videos and images in `folder`, sorted; how many other files there are,
    captions and cache files excluded). The one listing rule of dataset folders, ai-toolkit's
    (27a03a91, toolkit/data_loader.py L437-450, `AiToolkitDataset.__init__`): `os.walk` down every
    sub-folder but those whose name starts with "." (symlinked folders not followed), files whose name
    starts with "." left out, and files directly in a folder named `_controls` too (a broken link,
    which ai-toolkit lists and then fails to read, is left out here). Both trainers therefore train
    on the same files of a folder (tests/test_aitk_adapter.py compares them).
    `video-dit train-vae` reads its folder with it too. `files`: these files instead of the folder's
    (validation items)."""
    caption_suffix = "." + caption_ext.lstrip(".")
    if files is not None:
        listed = [Path(p) for p in files if Path(p).is_file() and not Path(p).name.startswith(".")]
    else:
        listed = []
        for root, dirs, names in os.walk(folder):
            dirs[:] = [d for d in dirs if not d.startswith(".")]  # pruned: never walked into
            if Path(root).name == CONTROLS:
                continue
            cache = Path(root).name.startswith("_") and Path(root).name.endswith("_cache")  # ours, ai-toolkit's
            listed += [Path(root, n) for n in names if not n.startswith(".") and Path(root, n).is_file()
                       and (not cache or Path(n).suffix.lower() in VIDEO_EXTS + IMAGE_EXTS)]
    paths, ignored = [], 0
    for path in sorted(listed):
        ext = path.suffix.lower()
        if ext in VIDEO_EXTS + IMAGE_EXTS:
            paths.append(path.absolute())
        elif ext != caption_suffix.lower():
            ignored += 1
    return paths, ignored


def scan_dataset(cfg: DatasetConfig, divisibility: int, *, dataset_index: int = 0,
                 verbose: bool = True, probe_threads: int | None = None,
                 files: list[Path] | None = None, skip_stills: bool = False, audio: bool = False) -> ScanResult:
    """Items of one dataset folder (see module docstring). `verbose`: warn per skipped file and
    print the summary (pass `rank == 0` in multi-rank jobs). Files are probed by `probe_threads`
    threads (default min(8, cpus); PyAV releases the GIL while it reads). `files`: read these files
    with `cfg`'s settings instead of listing the folder (validation items). `skip_stills`
    (`diffusion.conditioning.stills_skipped` of the job's i2v mode): the stills of a `do_i2v` dataset are skipped,
    with ONE warning (`diffusion.conditioning.skipped_stills`) rather than one per file. `audio`: the job's
    model generates sound: each clip's track is read over its frames' span as `cfg.audio` says (module
    docstring; a clip's whole span is decoded once here, at its own rate, to find a corrupt stream
    before training). Raises `DataError` if no item is usable, or if it is a video dataset whose every
    clip is too short for `num_frames`."""
    if not cfg.validated or isinstance(cfg.resolution, int):
        cfg.validate(cfg.config_path)  # a DatasetConfig built in code rather than by typed_config.parse
    cfg.check_divisibility(divisibility)
    folder = Path(cfg.folder_path)
    caption_suffix = "." + cfg.caption_ext.lstrip(".")
    paths, ignored = list_media(folder, cfg.caption_ext, files)

    def probe(path):
        info: list = []
        try:
            return _probe(path, cfg, caption_suffix, info, audio), info
        except media.MediaError as exc:
            return exc.reason, info
        except (frames_mod.ClipTooShort, DataError) as exc:
            return str(exc), info

    threads = probe_threads or min(8, os.cpu_count() or 1)
    if audio and cfg.audio != "off" and cfg.shrink_video_to_frames and cfg.is_video and verbose:
        warnings.warn(f"{cfg.config_path}.audio: with shrink_video_to_frames: true a clip's sound spans all of it "
                      "(real time, its length following the clip's); shrink_video_to_frames: false gives every "
                      f"clip of a bucket the same num_frames / fps = {cfg.num_frames / cfg.fps:g} s of sound",
                      DataWarning, stacklevel=2)
    with ThreadPoolExecutor(max_workers=threads) as pool:
        results = list(pool.map(probe, paths))  # in file order: the scan is deterministic
    items: list[DataItem] = []
    skipped: list[tuple[str, str]] = []
    missing: list[str] = []
    clips: list[tuple[str, int, float]] = []
    not_upscaled: list[tuple[str, int, float]] = []
    sounds: dict[str, str] = {}
    for path, (result, info) in zip(paths, results):
        clips += [(str(path), n, fps) for n, fps in info]
        if isinstance(result, str):
            skipped.append((str(path), result))
            if verbose:
                warnings.warn(f"{path}: skipped: {result}", DataWarning, stacklevel=2)
            continue
        kind, (w, h), idx, source, stat, caption, note, (sound, span) = result
        fitted = [(res, *fitted_bucket(w, h, res, divisibility, square=not cfg.buckets,
                                       allow_upscale=cfg.allow_upscale)) for res in cfg.resolution]
        if all(hw is None for _, hw, _ in fitted):
            reason = (f"smaller ({w}x{h}) than one {divisibility}-px cell of the model: it cannot train without "
                      "upscaling; allow_upscale: true upscales it")
            skipped.append((str(path), reason))
            if verbose:
                warnings.warn(f"{path}: skipped: {reason}", DataWarning, stacklevel=2)
            continue
        if note is not None and verbose:
            warnings.warn(f"{path}: {note}", DataWarning, stacklevel=2)
        if sound is not None:
            sounds[str(path)] = sound
        if caption is None:
            caption = cfg.default_caption if cfg.default_caption is not None else ""
            missing.append(str(path))
        caption = inject_trigger(caption, cfg.trigger_word, add_if_not_present=cfg.trigger_word is not None)
        for res, hw, factor in fitted:
            if hw is None:
                continue
            H, W = hw
            if factor > 1.0 and not cfg.allow_upscale:
                not_upscaled.append((str(path), res, factor))
            resize, crop = frames_mod.crop_plan(w, h, W, H)
            items.append(DataItem(path=str(path), kind=kind, caption=caption, bucket=(len(idx), H, W),
                                  frames=tuple(idx), resize=resize, crop=crop, source=source,
                                  size=stat.st_size, mtime_ns=stat.st_mtime_ns, dataset=dataset_index,
                                  do_i2v=cfg.do_i2v, caption_dropout_rate=cfg.caption_dropout_rate,
                                  num_repeats=cfg.num_repeats, cache_root=cfg.cache_root,
                                  has_audio=sound in ("sound", "silent"), audio_span=span))
    if skip_stills and cfg.do_i2v:
        items = _skip_stills(items, skipped, folder, verbose)
        kept = {it.path for it in items}
        missing = [m for m in missing if m in kept]  # a skipped still needs no caption
    if missing and verbose:
        warnings.warn(f"{folder}: {len(missing)} files have no .{cfg.caption_ext.lstrip('.')} caption and train "
                      f"with {'default_caption' if cfg.default_caption is not None else 'the empty prompt'} "
                      f"(first: {Path(missing[0]).name})", DataWarning, stacklevel=2)
    nested = sorted({str(p.parent.relative_to(folder.absolute())) for p in paths if files is None
                     and p.parent != folder.absolute()})
    result = ScanResult(items, skipped, len(missing), ignored, [str(folder)], clips, not_upscaled, nested, sounds)
    if verbose:
        print(result.summary(), flush=True)
    _check_clip_lengths(cfg, result)
    if not items:
        raise DataError(f"{cfg.config_path}.folder_path {str(folder)!r}: no usable item "
                        f"({len(skipped)} files skipped: "
                        + "; ".join(f"{Path(p).name}: {r}" for p, r in skipped[:5])
                        + (" ..." if len(skipped) > 5 else "") + ")")
    return result


def _skip_stills(items: list[DataItem], skipped: list, folder: Path, verbose: bool) -> list[DataItem]:
    """`items` without the stills (`diffusion.conditioning.stills_skipped`), each added to `skipped` (path, reason),
    with one warning for all of them naming how many and why."""
    stills = sorted({it.path for it in items if not it.conditioned})
    if not stills:
        return items
    kept = [it for it in items if it.conditioned]
    skipped += [(p, STILL_SKIPPED) for p in stills]
    if verbose:
        names = [str(Path(p).relative_to(folder.absolute())) for p in stills]
        warnings.warn(skipped_stills(folder, names, every=not kept), DataWarning, stacklevel=3)
    return kept


def _check_clip_lengths(cfg: DatasetConfig, scan: ScanResult) -> None:
    """`DataError` when a video dataset has clips but none became an item for being too short for
    `num_frames` (stills may remain: the job asked for video), naming the longest clip and the
    largest `num_frames` it gives."""
    if not cfg.is_video or not scan.clips or any(it.kind == "video" for it in scan.items):
        return
    short = {p for p, r in scan.skipped if _reason_kind(r) == "too short"}
    if not short:
        return  # the clips failed for other reasons, each named in its own warning
    path, total, fps = max((c for c in scan.clips if c[0] in short), key=lambda c: c[1])
    fits = _longest_selection(total, fps, cfg)
    rule = ("spread over the whole clip (shrink_video_to_frames: true)" if cfg.shrink_video_to_frames
            else f"consecutive frames at fps {cfg.fps:g} (shrink_video_to_frames: false)")
    raise DataError(f"{cfg.config_path}.num_frames: {cfg.num_frames} is longer than every clip of "
                    f"{cfg.folder_path!r}: the longest, {Path(path).name}, has {total} frames at {fps:g} fps, "
                    f"which gives at most {fits} frames taken as {rule}; accepted: num_frames <= {fits} "
                    "(a count the model's VAE encodes), or short_clip: stretch to repeat frames")


def _longest_selection(total: int, fps: float, cfg: DatasetConfig) -> int:
    """The largest valid frame count (the model's t k+1, any count with no model known) `select_frames`
    takes from a clip of `total` frames at `fps`."""
    snap = cfg.snap_frames or (lambda k: k)
    n = snap(max(1, total if cfg.shrink_video_to_frames
                 else math.ceil(total * cfg.fps / fps) + 1 if fps > 0 else total))
    while n > 1:
        try:
            frames_mod.select_frames(total, n, shrink=cfg.shrink_video_to_frames, src_fps=fps, fps=cfg.fps)
            return n
        except frames_mod.ClipTooShort:
            n = snap(n - 1)
    return 1


def scan_datasets(cfgs: list[DatasetConfig], divisibility: int, *, verbose: bool = True,
                  i2v_mode: str | None = None, audio: bool = False) -> ScanResult:
    """`scan_dataset` over a job's datasets list, merged (each item remembers its dataset index).
    `i2v_mode`: the job's first-frame conditioning; "concat" (an in_dim 36 model, which conditions
    every item) skips the stills of `do_i2v` datasets, one warning per dataset (`diffusion.conditioning.stills_skipped`:
    the ai-toolkit arch skips them too, in the same words). `audio`: the job's model generates sound
    (each dataset's clips read as its `audio` key says; see the module docstring)."""
    skip = stills_skipped(i2v_mode)
    return ScanResult.merge([scan_dataset(c, divisibility, dataset_index=i, verbose=verbose, skip_stills=skip,
                                          audio=audio)
                             for i, c in enumerate(cfgs)])
