"""The packed sequence MiniMax H3 denoises: its row order, modality tags, timestep groups and rotary
coordinates, and the (un)patchifying of video and audio latents into rows.

Row order of one sample (diffusers 0.42.1 modular_pipelines/minimax_h3/before_denoise.py
`MiniMaxH3PrepareLayoutStep.build_packed_sequence`, the t2va / fl2va layout):

    [ text: Lt rows | keyframes: K x h' w' rows | audio: S x T rows | video: F' x h' x w' rows ]

  text      the conditioner's rows (Qwen3-VL hidden_states[50] of the prompt presentation); tag 1, except the
            rows of a keyframe's vision block, which the presentation tags 0 (video). Padded rows (a shorter
            prompt in a batch) sit at the end of this block and are masked as keys.
  keyframes one latent frame per keyframe anchor ("first" / "last", in packed order); tag 0
  audio     the S stereo channels' latent frames, channel-major (channel 0's T rows, then channel 1's); tag 2
  video     the target latents, frame-major then row-major, c pt ph pw inside a row; tag 0

Timestep groups (`build_row_timesteps` there): the video and text rows take the video timestep, the keyframe
rows their own (the pipeline: max(t, 0.999), just short of clean), the audio rows the audio timestep. The
AdaLN table has one row per (timestep, modality tag); a sample's rows use at most four of them, the
`ENTRIES` below, so the modulation is applied per run of rows sharing one entry (`row_runs`).

Rotary coordinates (t, h, w), float64 as the reference builds them (cast to float32 for the angles):
  text row i: (i, 0, 0); the media clock starts at n, the number of real text rows.
  video frame f: t = n + (5/3) x cumsum of (1, 4, 4, 4, 4, 1, 4, ...)[:f] (one latent frame per 1 then 4 pixel
      frames at 24 fps, the VAE's 17 -> 5 grouping); (h, w): each axis centred on the unit interval, scaled by
      the square root of the latent area, x 32 (`frame_grid`).
  keyframe "first": t = n; "last": t = n + sum of all F' spans - 5/3 (numpy's pairwise sum, as the reference);
      (h, w) as a video frame.
  audio latent j of a channel: t = n + j (40 latents / s = 24 fps x 5/3), h = 0, w = the width axis' first
      value for channel 0, its last for the others.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

VIDEO_TAG, TEXT_TAG, AUDIO_TAG = 0, 1, 2  # the AdaLN modality tags: a checkpoint contract
VIDEO, AUDIO, KEYFRAME = 0, 1, 2          # timestep groups
# The AdaLN entries a sample's rows use, (timestep group, modality tag): video rows and vision-block text rows,
# text rows, audio rows, keyframe rows.
ENTRIES = ((VIDEO, VIDEO_TAG), (VIDEO, TEXT_TAG), (AUDIO, AUDIO_TAG), (KEYFRAME, VIDEO_TAG))
E_VIDEO, E_TEXT, E_AUDIO, E_KEYFRAME = range(4)
ANCHORS = ("first", "last")

FRAME_RESCALE = 5.0 / 3.0               # rotary units per pixel frame: a 40 Hz clock at 24 fps
FRAMES_PER_LATENT = (1, 4, 4, 4, 4)     # `_ROPE_FRAMES_PER_LATENT`
SPATIAL_SCALE = 32                      # `_ROPE_SPATIAL_SCALE`


@dataclass(frozen=True)
class Layout:
    """One batch's packed layout (shared by its samples, but for the per-sample real text lengths)."""

    text_len: int                       # Lt: text rows (padded width)
    text_tags: tuple[int, ...]          # (Lt,) modality tag of each text row, VIDEO_TAG or TEXT_TAG
    anchors: tuple[str, ...]            # keyframe anchors in packed order
    grid: tuple[int, int, int]          # (F', h', w') video rows; a keyframe has h' w' rows
    latent_hw: tuple[int, int]          # (h, w) latent cells (the spatial axes' scale)
    audio_channels: int                 # S
    audio_frames: int                   # T

    @property
    def frame_rows(self) -> int:
        return self.grid[1] * self.grid[2]

    @property
    def keyframe_start(self) -> int:
        return self.text_len

    @property
    def audio_start(self) -> int:
        return self.text_len + len(self.anchors) * self.frame_rows

    @property
    def video_start(self) -> int:
        return self.audio_start + self.audio_channels * self.audio_frames

    @property
    def length(self) -> int:
        return self.video_start + self.grid[0] * self.frame_rows

    @property
    def segments(self) -> tuple[int, int, int, int]:
        """Row counts of the text, keyframe, audio and video blocks, in packed order."""
        return (self.text_len, self.audio_start - self.keyframe_start, self.video_start - self.audio_start,
                self.length - self.video_start)

    def entries(self) -> torch.Tensor:
        """(length,) int64: each row's AdaLN entry (an index of `ENTRIES`)."""
        tags = torch.tensor(self.text_tags, dtype=torch.long)
        text = torch.where(tags == TEXT_TAG, E_TEXT, E_VIDEO)
        return torch.cat([text, torch.full((self.audio_start - self.keyframe_start,), E_KEYFRAME),
                          torch.full((self.video_start - self.audio_start,), E_AUDIO),
                          torch.full((self.length - self.video_start,), E_VIDEO)])

    def positions(self, n: int) -> torch.Tensor:
        """(length, 3) float64 rotary coordinates with the media clock starting at `n` real text rows."""
        return _positions(self, n).clone()


def frame_grid(h: int, w: int, ph: int, pw: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(h' w', 2) float64 (h, w) coordinates of one latent frame's rows, and the width axis (w',). Each axis:
    dim // patch points from (1 - r) / 2 over r = dim / sqrt(h w), right end excluded, x 32 (numpy's linspace,
    whose float64 values the reference reproduces; torch.linspace computes them otherwise)."""
    sqrt_area = np.sqrt(h * w)

    def axis(dim: int, patch: int) -> torch.Tensor:
        ratio = dim / sqrt_area
        left = (1.0 - ratio) / 2.0
        return torch.from_numpy(np.linspace(left, left + ratio, dim // patch, endpoint=False) * SPATIAL_SCALE)

    hh, ww = torch.meshgrid(axis(h, ph), axis(w, pw), indexing="ij")
    return torch.stack([hh.reshape(-1), ww.reshape(-1)], dim=-1), axis(w, pw)


def frame_times(frames: int, origin: float) -> torch.Tensor:
    """(frames,) float64 rotary time of each latent frame: origin + 5/3 x exclusive cumsum of (1, 4, 4, 4, 4, ...)."""
    spans = torch.tensor([FRAME_RESCALE * FRAMES_PER_LATENT[i % len(FRAMES_PER_LATENT)] for i in range(frames)],
                         dtype=torch.float64)
    return origin + torch.cat([torch.zeros(1, dtype=torch.float64), spans[:-1].cumsum(0)])


def last_anchor_time(frames: int, origin: float) -> float:
    """The "last" keyframe's rotary time: origin + the sum of all F' frames' spans - 5/3, summed by numpy's
    pairwise summation as the reference does (sequential sums differ in the last ulp from 16 frames on)."""
    spans = np.ones(frames, dtype=np.float64) * FRAME_RESCALE
    for offset, count in enumerate(FRAMES_PER_LATENT):
        spans[offset::len(FRAMES_PER_LATENT)] *= count
    return float(origin) + float(spans.sum()) - FRAME_RESCALE


@lru_cache(maxsize=64)
def _positions(layout: Layout, n: int) -> torch.Tensor:
    frames = layout.grid[0]
    pos = torch.zeros(layout.length, 3, dtype=torch.float64)
    pos[:layout.text_len, 0] = torch.arange(layout.text_len, dtype=torch.float64)
    ph = layout.latent_hw[0] // layout.grid[1]
    pw = layout.latent_hw[1] // layout.grid[2]
    frame, width = frame_grid(*layout.latent_hw, ph, pw)  # (h' w', 2), (w',)
    for k, anchor in enumerate(layout.anchors):
        rows = slice(layout.keyframe_start + k * layout.frame_rows, layout.keyframe_start + (k + 1) * layout.frame_rows)
        pos[rows, 0] = float(n) if anchor == "first" else last_anchor_time(frames, n)
        pos[rows, 1:] = frame
    T, S = layout.audio_frames, layout.audio_channels
    audio = slice(layout.audio_start, layout.video_start)
    pos[audio, 0] = (float(n) + torch.arange(T, dtype=torch.float64)).repeat(S)
    pos[audio, 2] = torch.cat([torch.full((T,), float(width[0]), dtype=torch.float64),
                               torch.full(((S - 1) * T,), float(width[-1]), dtype=torch.float64)])
    video = torch.empty(frames, layout.frame_rows, 3, dtype=torch.float64)
    video[:, :, 0] = frame_times(frames, float(n))[:, None]
    video[:, :, 1:] = frame[None]
    pos[layout.video_start:] = video.reshape(-1, 3)
    return pos


@dataclass(frozen=True)
class RankOrder:
    """A packed sequence reordered for `ranks` sequence-parallel ranks, so that each rank's contiguous share holds
    an equal slice of every segment (text, keyframes, audio, video): segment s of n_s rows is cut into `ranks`
    chunks of ceil(n_s / ranks) rows (the last ones zero-padded), and the reordered sequence is
    [rank 0: text_0 | keyframes_0 | audio_0 | video_0 | rank 1: text_1 | ... ], Np rows, Np / ranks each.
    Attention is over a set of keys (each row carries its own rotary coordinates), so the order changes no
    output; the padded rows are masked as keys and dropped at the end."""

    index: torch.Tensor   # (Np,) int64: the row of [sequence | one zero row] each reordered row takes (L: padding)
    real: torch.Tensor    # (Np,) bool: False for the padding
    where: torch.Tensor   # (L,) int64: where each row of the sequence sits in the reordered one

    def reorder(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """t with L rows along `dim` -> Np rows, reordered (the padding zero)."""
        zero = t.new_zeros(*t.shape[:dim], 1, *t.shape[dim + 1:])
        return torch.cat([t, zero], dim=dim).index_select(dim, self.index.to(t.device))  # (..., Np, ...)

    def restore(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """`reorder`'s inverse on the real rows: Np rows along `dim` -> the sequence's L, in packed order."""
        return t.index_select(dim, self.where.to(t.device))  # (..., L, ...)


@lru_cache(maxsize=64)
def rank_order(segments: tuple[int, ...], ranks: int) -> RankOrder:
    """`RankOrder` of a packed sequence made of `segments` (row counts, in packed order; 0: absent) over
    `ranks` ranks."""
    starts = np.cumsum((0,) + segments)
    L = int(starts[-1])
    index, real = [], []
    for r in range(ranks):
        for start, n in zip(starts[:-1].tolist(), segments):
            per = -(-n // ranks)
            rows = list(range(start + min(n, r * per), start + min(n, (r + 1) * per)))
            index += rows + [L] * (per - len(rows))
            real += [True] * len(rows) + [False] * (per - len(rows))
    index_t, real_t = torch.tensor(index, dtype=torch.long), torch.tensor(real)
    where = torch.empty(L, dtype=torch.long)
    where[index_t[real_t]] = torch.arange(len(index))[real_t]
    return RankOrder(index_t, real_t, where)


def rope_tables(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """positions (..., 3) float64, inv_freq (F,) float32 -> cos, sin (..., 6F) float32: angles [t | h | w]
    (F each) twice over, for the rotate-half pairing of the first 6F channels (diffusers
    `MiniMaxH3RotaryPosEmbed`, SGLang `MiniMaxH3Rope`: the coordinates cast to float32 first)."""
    freqs = positions.to(torch.float32).unsqueeze(-1) * inv_freq  # (..., 3, F)
    freqs = freqs.flatten(-2)  # (..., 3F): [t | h | w]
    freqs = torch.cat([freqs, freqs], dim=-1)  # (..., 6F)
    return freqs.cos(), freqs.sin()


def row_runs(entries: torch.Tensor) -> list[tuple[int, int, int]]:
    """(L,) entries -> [(start, stop, entry)]: the maximal runs of rows sharing one AdaLN entry (a few: the
    text / vision-block rows, the keyframes, the audio, the video; a sequence-parallel rank's slice of them)."""
    values = entries.tolist()
    runs, start = [], 0
    for i in range(1, len(values) + 1):
        if i == len(values) or values[i] != values[start]:
            runs.append((start, i, values[start]))
            start = i
    return runs


def entry_table(per_group: torch.Tensor) -> torch.Tensor:
    """(B, G, 3, X) per (timestep group, tag) -> (B, len(ENTRIES), X); a group absent from the call
    (no keyframes: G = 2) gives zeros to its entries (no row uses them)."""
    B, G, _, X = per_group.shape
    rows = [per_group[:, g, tag] if g < G else per_group.new_zeros(B, X) for g, tag in ENTRIES]
    return torch.stack(rows, dim=1)


def patchify(video: torch.Tensor, patch: tuple[int, int, int]) -> torch.Tensor:
    """(B, C, F', h, w) -> (B, F'/pt h/ph w/pw, C pt ph pw): rows frame-major then row-major."""
    B, C, Fr, H, W = video.shape
    pt, ph, pw = patch
    x = video.reshape(B, C, Fr // pt, pt, H // ph, ph, W // pw, pw).permute(0, 2, 4, 6, 1, 3, 5, 7)
    return x.reshape(B, -1, C * pt * ph * pw)


def unpatchify(rows: torch.Tensor, grid: tuple[int, int, int], channels: int,
               patch: tuple[int, int, int]) -> torch.Tensor:
    """`patchify`'s inverse: (B, L, C pt ph pw) -> (B, C, F', h, w)."""
    pt, ph, pw = patch
    x = rows.reshape(rows.shape[0], *grid, channels, pt, ph, pw).permute(0, 4, 1, 5, 2, 6, 3, 7)
    return x.reshape(rows.shape[0], channels, grid[0] * pt, grid[1] * ph, grid[2] * pw)


def pack_audio(audio: torch.Tensor) -> torch.Tensor:
    """(B, S, C_a, T) audio-VAE latents per stereo channel -> (B, S T, C_a) rows, channel-major."""
    return audio.transpose(2, 3).flatten(1, 2)


def unpack_audio(rows: torch.Tensor, channels: int) -> torch.Tensor:
    """`pack_audio`'s inverse: (B, S T, C_a) -> (B, S, C_a, T)."""
    return rows.unflatten(1, (channels, -1)).transpose(2, 3)

