"""`video-dit make-demo-data DIR`: the procedural demo dataset (shapes moving on black, MP4 + captions)
plus held-out clips, their first frames and captions beside it, in DIR_holdout/ (validation loss, i2v
previews; outside DIR, which trainers read recursively). Same arguments -> the same frames."""

from __future__ import annotations

import argparse

from video_dit.data.demo import holdout_dir, make_demo_data, move_old_holdout


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", metavar="DIR", help="output folder (created if missing)")
    parser.add_argument("--count", type=int, default=256, help="training clips (default 256, the embedded default's)")
    parser.add_argument("--frames", type=int, default=17, help="frames per clip, 4k+1 (default 17)")
    parser.add_argument("--size", type=int, default=64, help="frame side in pixels (default 64)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("--holdout", type=int, default=5, help="held-out clips (+ first frame, caption) for validation and i2v previews; "
                        "5 cover every colour, direction and shape (default 5, as the embedded default)")
    parser.add_argument("--fps", type=float, default=16, help="frame rate written to the MP4s (default 16)")


def main(args: argparse.Namespace) -> int:
    try:
        moved = move_old_holdout(args.dir)
    except ValueError as exc:
        print(f"video-dit make-demo-data: {exc}")
        return 2
    if moved:
        print(moved)
    paths = make_demo_data(args.dir, count=args.count, frames=args.frames, size=args.size, seed=args.seed,
                           holdout=args.holdout, fps=args.fps)
    print(f"wrote {len(paths)} clips ({args.frames} frames, {args.size}x{args.size}) to {args.dir}"
          + (f" and {args.holdout} held-out clips to {holdout_dir(args.dir)}" if args.holdout else ""))
    return 0
