"""A clip's audio track in: decoded with PyAV, mixed to the channels asked, resampled with libswresample
(PyAV's `av.AudioResampler`), and cut to exactly the span of the clip's selected frames by timestamps.

    file --PyAV demux + decode (first audio stream)--> frames at the source rate and layout
         --av.AudioResampler (fltp, rate, layout)--> one continuous stream, placed on the container timeline
         --cut [span.start, span.start + span.duration)--> (C, round(duration * rate)) float32

The span of a selection (`frames_span`): `num_frames` frames chosen from source frame `first` on, one
every `stride` source frames (`frames.frame_selection` gives the stride: `src_fps / fps` for consecutive
frames at the dataset `fps`, `(total - 1) / (num_frames - 1)` for frames spread over the clip), stand for
`[t(first), t(first) + num_frames * stride / src_fps)` seconds of the source, `t(i)` being the
presentation time of frame i (the video stream's start time + i / src_fps: the frame grid the frame
reader indexes by). This is Lightricks' ltx-trainer's rule (packages/ltx-trainer/scripts/process_videos.py
`_preprocess_video` / `_extract_audio`: consecutive frames from the clip's start, the audio trimmed to
`num_frames / fps` seconds and zero-padded where shorter) generalised to a stride and to a selection
that does not start at the container's first sample; the duration is the selection's length at its
own frame rate (`src_fps / stride`), so the sound stays at real speed (ai-toolkit instead stretches the
source span to `num_frames / fps`, which shifts its pitch; we never resample time).

Timestamps: both streams are placed on the container's timeline by their own start times, so an A/V
offset in the container (an audio stream that starts after, or before, the video) is honoured.
Samples the stream does not hold (before its first sample, after its last) are zeros: the only
padding, and the only place it happens. A stream's frames are laid end to end from the first one's
timestamp; a timestamp that disagrees with that by more than `DRIFT_S` (FFmpeg's `aresample`
`min_hard_comp` default) is a real gap or overlap and re-places the stream there (container timestamps
in milliseconds, Matroska's, would otherwise misplace every frame by up to half a millisecond).

Channels: `channels=None` keeps the source's; 1 mixes down with libswresample's standard matrix
normalised to unit gain (`rematrix_maxval=1`: stereo -> (L + R) / 2); 2 from mono duplicates the
channel, and from more than 2 uses the same normalised downmix (5.1 -> L = 0.414 L + 0.293 C + 0.293
Ls: ltx-trainer's `_encode_audio` weights). Errors: a file that cannot be opened, or an audio stream
that cannot be decoded, raises `MediaError` naming the file and the reason; a file without an audio
stream is "no audio" (`None`), and a silent track is a track (silence is sound: `SILENT_PEAK` only
names it in the counts).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from video_dit import media
from video_dit.media import MediaError

SILENT_DBFS = -60.0                     # a track whose peak over the clip's span is below this is "silent"
SILENT_PEAK = 10 ** (SILENT_DBFS / 20)  # 0.001 of full scale
DRIFT_S = 0.1                           # FFmpeg aresample's min_hard_comp default: a timestamp jump beyond it is a gap
MARGIN_S = 0.25                         # decoded around the span: the resampler's and AAC's overlap settle in it
SEEK_AFTER_S = 1.0                      # a span starting later than this into the stream is reached by a seek


@dataclass(frozen=True)
class AudioInfo:
    """The first audio stream of a file, from its header."""

    rate: int        # samples per second
    channels: int
    codec: str
    start: float     # seconds: its first sample on the container's timeline


@dataclass(frozen=True)
class AudioSpan:
    """A stretch of a file's timeline: `start` seconds on the container's timeline, `duration` seconds."""

    start: float
    duration: float

    def samples(self, rate: int) -> int:
        """The sample count of the span at `rate`: `round(duration * rate)`."""
        return int(round(self.duration * rate))


def frames_span(video_start: float, first: int, num_frames: int, stride: float, src_fps: float) -> AudioSpan:
    """The span of `num_frames` selected frames from source frame `first` on, one per `stride` source
    frames, of a video stream starting at `video_start` s with `src_fps` frames per second (see the
    module docstring): `[video_start + first / src_fps, + num_frames * stride / src_fps)`."""
    if not src_fps > 0:
        raise ValueError(f"the clip has no frame rate ({src_fps}): its frames cannot be placed in time")
    if num_frames < 1 or stride < 0:
        raise ValueError(f"need num_frames >= 1 and stride >= 0, got {num_frames}, {stride}")
    return AudioSpan(video_start + first / src_fps, num_frames * stride / src_fps)


def audio_info(path) -> AudioInfo | None:
    """The header of `path`'s first audio stream; None when it has none. `MediaError` when the file
    cannot be opened."""
    container = media.open_container(path, need_video=False)
    try:
        if not container.streams.audio:
            return None
        return _info(container.streams.audio[0])
    finally:
        container.close()


def _info(stream) -> AudioInfo:
    cc = stream.codec_context
    start = float(stream.start_time * stream.time_base) if stream.start_time is not None and stream.time_base else 0.0
    return AudioInfo(rate=int(cc.sample_rate or stream.rate or 0), channels=int(cc.channels or 0),
                     codec=stream.codec_context.name, start=start)


def resampler_for(source_channels: int, rate: int, channels: int | None):
    """(PyAV resampler, channels it writes, duplicate): fltp at `rate`, mixed to `channels` (None: the source's;
    more than 2 kept) at unit gain (`rematrix_maxval` 1: stereo -> (L + R) / 2, not +3 dB); a mono source asked for
    stereo is resampled as mono and `duplicate` says to write its one channel twice (ltx-trainer's rule)."""
    import av

    duplicate = channels == 2 and source_channels == 1
    mixed = source_channels if channels is None or duplicate else channels
    layout = {1: "mono", 2: "stereo"}.get(mixed)  # None: keep the source's layout
    return av.AudioResampler(format="fltp", layout=layout, rate=rate, options={"rematrix_maxval": "1.0"}), mixed, \
        duplicate


def read_audio(path, span: AudioSpan, rate: int | None = None, channels: int | None = None) -> np.ndarray | None:
    """The audio of `span` in `path`'s first audio stream: `(C, span.samples(rate))` float32 in the
    codec's range (about [-1, 1]), at `rate` (default: the stream's), with `channels` channels (1 or 2;
    default: the stream's). None when the file has no audio stream. Zeros where the stream holds no
    samples (before its start, after its end). `MediaError` naming the file when the stream cannot be
    decoded (corrupt, or no decoder for its codec)."""
    import av

    if channels not in (None, 1, 2):
        raise ValueError(f"channels must be 1, 2 or None (the stream's), got {channels!r}")
    if rate is not None and rate < 1:
        raise ValueError(f"rate must be a positive sample rate, got {rate!r}")
    container = media.open_container(path, need_video=False)
    try:
        if not container.streams.audio:
            return None
        stream = container.streams.audio[0]
        info = _info(stream)
        if info.rate < 1 or info.channels < 1:
            raise MediaError(path, f"corrupt audio stream: its header gives {info.rate} Hz, {info.channels} channels")
        out_rate = rate or info.rate
        resampler, mixed, duplicate = resampler_for(info.channels, out_rate, channels)
        cut = _Cut(span, out_rate, mixed)
        end = span.start + span.duration + MARGIN_S
        try:
            if span.start - MARGIN_S > info.start + SEEK_AFTER_S:  # a long clip: start near the span
                container.seek(int((span.start - MARGIN_S) / stream.time_base), stream=stream, backward=True)
            for frame in _frames_until(container, stream, end):
                for out in resampler.resample(frame):
                    cut.place(out)
            for out in resampler.resample(None):  # flush: the resampler's last buffered samples
                cut.place(out)
        except av.error.FFmpegError as exc:
            raise MediaError(path, f"corrupt audio stream ({info.codec}): cannot be decoded "
                                   f"(FFmpeg: {getattr(exc, 'strerror', None) or exc})") from exc
        except ValueError as exc:  # PyAV's "Frame does not match AudioResampler setup": the layout changed mid-stream
            raise MediaError(path, f"corrupt audio stream ({info.codec}): {exc}") from exc
    finally:
        container.close()
    return np.repeat(cut.buffer, 2, axis=0) if duplicate else cut.buffer


def _frames_until(container, stream, end: float):
    """The decoded frames of `stream`, in order, until one starts after `end` seconds."""
    for packet in container.demux(stream):
        for frame in packet.decode():
            if frame.time is not None and frame.time > end:
                return
            yield frame


class _Cut:
    """The output buffer of one span: resampled frames laid end to end from the first one's time (see
    the module docstring on `DRIFT_S`), the samples inside the span kept."""

    def __init__(self, span: AudioSpan, rate: int, channels: int):
        self.span, self.rate = span, rate
        self.buffer = np.zeros((channels, span.samples(rate)), np.float32)  # (C, S)
        self.pos: int | None = None  # where the next frame's first sample goes, in samples from span.start

    def place(self, frame) -> None:
        x = frame.to_ndarray()  # (C, n) float32, planar
        if frame.pts is not None and frame.time_base is not None:
            at = int(round((float(frame.pts * frame.time_base) - self.span.start) * self.rate))
            if self.pos is None or abs(at - self.pos) > DRIFT_S * self.rate:
                self.pos = at
        elif self.pos is None:
            self.pos = int(round(-self.span.start * self.rate))  # no timestamps at all: the timeline's zero
        n, size = x.shape[1], self.buffer.shape[1]
        lo, hi = max(self.pos, 0), min(self.pos + n, size)
        if hi > lo:
            self.buffer[:, lo:hi] = x[:, lo - self.pos:hi - self.pos]
        self.pos += n


def clip_audio(path, rate: int | None = None, channels: int | None = None) -> tuple[np.ndarray, int] | None:
    """(the audio of every frame of the video `path`, its rate): the span of all its frames
    (`frames_span` of frame 0, its frame count, stride 1), as `read_audio` cuts it; None when it has
    no audio stream. How a preview MP4's sound is read back (the demo's checker)."""
    video = media.probe_video(path)
    info = audio_info(path)
    if info is None:
        return None
    span = frames_span(video.start, 0, video.num_frames, 1.0, video.fps)
    return read_audio(path, span, rate, channels), rate or info.rate


def peak(wave: np.ndarray) -> float:
    """The largest absolute sample (0.0 for an empty wave)."""
    return float(np.abs(wave).max()) if wave.size else 0.0


def is_silent(wave: np.ndarray) -> bool:
    """Whether a track is "silent": its peak is below `SILENT_PEAK` (-60 dBFS). Still sound, not missing."""
    return peak(wave) < SILENT_PEAK


def dbfs(value: float) -> float:
    """`value` (a peak or RMS, full scale 1.0) in dB relative to full scale; -inf for 0."""
    return 20 * math.log10(value) if value > 0 else -math.inf
