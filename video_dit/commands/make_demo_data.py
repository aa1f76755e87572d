"""`video-dit make-demo-data DIR`: the procedural demo dataset (shapes moving on black, MP4 + captions)
plus held-out clips, their first frames and captions beside it, in DIR_holdout/ (validation loss, i2v
previews; outside DIR, which trainers read recursively). Same arguments -> the same frames (and bytes).
`--audio`: every clip (held-out ones too) also carries a mono AAC track at `--audio-rate` whose pitch
follows its caption (the audio-video demo's data: `video_dit.data.demo_av`)."""

from __future__ import annotations

import argparse

from video_dit.data.demo import holdout_dir, make_demo_data, move_old_holdout
from video_dit.data.demo_av import AUDIO_RATE, MIN_RATE, make_demo_av_data
from video_dit.media import AAC_RATES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", metavar="DIR", help="output folder (created if missing)")
    parser.add_argument("--count", type=int, default=256, help="training clips (default 256, the embedded default's)")
    parser.add_argument("--frames", type=int, default=17, help="frames per clip, 4k+1 (default 17)")
    parser.add_argument("--size", type=int, default=64, help="frame side in pixels (default 64)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("--holdout", type=int, default=5, help="held-out clips (+ first frame, caption) for validation and i2v previews; "
                        "5 cover every colour, direction and shape (default 5, as the embedded default)")
    parser.add_argument("--fps", type=float, default=16, help="frame rate written to the MP4s (default 16)")
    parser.add_argument("--audio", action="store_true",
                        help="clips with sound: each colour its own steady note (AAC, mono)")
    parser.add_argument("--audio-rate", type=int, default=AUDIO_RATE,
                        help=f"sample rate of the sound with --audio (default {AUDIO_RATE})")


def main(args: argparse.Namespace) -> int:
    if args.audio and (args.audio_rate not in AAC_RATES or args.audio_rate < MIN_RATE):
        print(f"video-dit make-demo-data: --audio-rate {args.audio_rate}: accepted: one of AAC's rates from "
              f"{MIN_RATE} Hz ({', '.join(str(r) for r in AAC_RATES if r >= MIN_RATE)})")
        return 2
    try:
        moved = move_old_holdout(args.dir)
    except ValueError as exc:
        print(f"video-dit make-demo-data: {exc}")
        return 2
    if moved:
        print(moved)
    kw = dict(count=args.count, frames=args.frames, size=args.size, seed=args.seed, holdout=args.holdout, fps=args.fps)
    if args.audio:
        paths = make_demo_av_data(args.dir, audio_rate=args.audio_rate, **kw)
    else:
        paths = make_demo_data(args.dir, **kw)
    sound = f", with {args.audio_rate} Hz mono AAC sound" if args.audio else ""
    print(f"wrote {len(paths)} clips ({args.frames} frames, {args.size}x{args.size}{sound}) to {args.dir}"
          + (f" and {args.holdout} held-out clips to {holdout_dir(args.dir)}" if args.holdout else ""))
    return 0
