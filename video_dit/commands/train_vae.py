"""`video-dit train-vae --data DIR --out FILE`: train the tiny VAE of the embedded default job.

Writes FILE (safetensors) and config.json beside it (VAEConfig with the measured latent mean/std),
which `load_vae(FILE)` reads. An existing FILE is kept unless --force. DIR is read flat, as a dataset
folder is; clips of any sizes are scaled and centre-cropped to one training size, and every header is
checked before anything is decoded (unusable clips are skipped with a warning naming them).
"""

from __future__ import annotations

import argparse

from video_dit.families import vae_family
from video_dit.media import MediaError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data", required=True, metavar="DIR", help="folder of training videos, read flat as a dataset (any sizes)")
    parser.add_argument("--out", required=True, metavar="FILE", help="weights file to write (.safetensors)")
    # defaults: the embedded default job's recipe (configs/demo_i2v_tiny.yaml, prepare.tiny_vae), in one
    # process unless --ranks
    parser.add_argument("--steps", type=int, default=1800, help="optimizer steps (default 1800)")
    parser.add_argument("--seed", type=int, default=0, help="seed of init, windows and sampling (default 0)")
    parser.add_argument("--batch-size", type=int, default=2, help="windows per step (default 2)")
    parser.add_argument("--frames", type=int, default=17, help="frames per training window, 4k+1 (default 17)")
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default 3e-3)")
    parser.add_argument("--sample-posterior", action="store_true",
                        help="decode a posterior sample in training (default: its mean, a plain autoencoder)")
    parser.add_argument("--latent-init-scale", type=float, default=None,
                        help="scale of the initial posterior mean (default: none; see train_tiny_vae)")
    parser.add_argument("--colour-path", action=argparse.BooleanOptionalAction, default=True,
                        help="start z[:, :3] as each cell's mean RGB (default on; see init_colour_path)")
    parser.add_argument("--cell-weight", type=float, default=4.0,
                        help="weight of each latent cell's mean-colour error in the loss (default 4)")
    parser.add_argument("--bright-weight", type=float, default=5.0,
                        help="weight of each pixel's brightest-channel error in the loss (default 5)")
    parser.add_argument("--fg-weight", type=float, default=8.0,
                        help="extra weight of the shapes' pixels in the loss (default 8)")
    parser.add_argument("--fg-ring", type=int, default=2,
                        help="the shapes' weight also on pixels within this many px of them (default 2)")
    parser.add_argument("--images", type=int, default=18,
                        help="single frames added to each step, through the first-frame path (default 18)")
    parser.add_argument("--image-steps", type=int, default=None,
                        help="the first steps train on single frames alone (default: a third of --steps, 600 of 1800)")
    parser.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=True,
                        help="bfloat16 autocast where the CPU has native bf16 (default on; float32 weights)")
    parser.add_argument("--preset", default="tiny-p2",
                        help="VAE preset to train, of any family with a VAE stage (default tiny-p2, Wan's)")
    parser.add_argument("--ranks", type=int, default=1,
                        help="data-parallel processes on this machine (default 1; the demo runs 2)")
    parser.add_argument("--ema", type=float, default=0.99,
                        help="decay of the weights' moving average, which is saved (default 0.99; 0: the last weights)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--force", action="store_true", help="retrain even if FILE exists")


def main(args: argparse.Namespace) -> int:
    if not str(args.out).endswith(".safetensors"):
        print(f"video-dit train-vae: --out {args.out!r} must end in .safetensors")
        return 2
    image_steps = args.steps // 3 if args.image_steps is None else args.image_steps
    try:
        vae_family(args.preset).vae_stage(args.data, args.out, steps=args.steps, seed=args.seed, batch_size=args.batch_size,
                       frames=args.frames, lr=args.lr, sample_posterior=args.sample_posterior,
                       latent_init_scale=args.latent_init_scale, cell_weight=args.cell_weight,
                       bright_weight=args.bright_weight,
                       colour_path=args.colour_path, fg_weight=args.fg_weight, fg_ring=args.fg_ring,
                       images=args.images, image_steps=image_steps, bf16=args.bf16, preset=args.preset,
                       ranks=args.ranks, ema=args.ema, threads=args.threads, force=args.force)
    except (FileNotFoundError, ValueError, KeyError, MediaError) as exc:
        print(f"video-dit train-vae: {exc}")
        return 2
    return 0
