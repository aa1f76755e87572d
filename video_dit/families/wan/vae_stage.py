"""The tiny VAE of the embedded default job, trained once on the demo clips.

A randomly initialised VAE cannot reconstruct anything, so the demo's DiT would learn to move noise.
This stage trains a tiny preset VAE (`tiny`, `tiny-p2`) for the recipe's steps on random windows of
the demo clips (L1 + L2 reconstruction and a small KL term), then measures the per-channel mean and std of
the latents over whole clips (the first `STATS_CLIPS`) so that the DiT sees normalized latents. It trains on the clips
of the data folder, read as a dataset is (recursively: `dataset.list_media`); the demo's held-out clips,
beside it (`demo.holdout_dir`: `data/demo_holdout/` for `data/demo/`), are never trained on, and
their reconstruction figures (PSNR, each shape's mean-colour error; `reconstruction_figures`) are
logged and kept in the weights' metadata. It saves:

    out_path                    the weights (safetensors, native Wan VAE names)
    out_path.parent/config.json the VAEConfig fields, mean/std included

Any folder of clips works (`video-dit train-vae --data FOLDER`): it is read as a dataset is,
every header is checked before anything is decoded, and clips of any sizes are scaled and
centre-cropped to one square training size (`_clips`).
Idempotent (an existing `out_path` is kept) and deterministic for a given seed and thread count.
Both files are written through a temporary name and renamed, config first, so an interrupted run
leaves either nothing or a complete pair.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from video_dit import media
from video_dit.data.dataset import DataWarning, list_media
from video_dit.data.demo import holdout_dir, move_old_holdout
from video_dit.data.frames import crop_plan, fit_frames, snap_num_frames
from video_dit.devices import resolve_device
from video_dit.families.wan.presets import VAE_PRESETS
from video_dit.families.wan.vae import CausalVideoVAE
from video_dit.families.wan.vae_layers import Resample, ResidualBlock
from video_dit.media import VIDEO_EXTS, MediaError, probe_video
from video_dit.models.causal_conv import CausalConv3d
from video_dit.parallel.process import run_local_ranks

CONFIG_NAME = "config.json"


@dataclasses.dataclass
class VAETrainResult:
    path: Path
    losses: list[float]          # reconstruction loss per step (weighted L1 + L2, before the KL term)
    mean: tuple[float, ...]
    std: tuple[float, ...]
    seconds: float
    vae: torch.nn.Module          # the trained model (eval mode), equal to what `path` holds
    heldout: dict | None = None   # `reconstruction_figures` of the held-out clips (`holdout_dir(data_dir)`), if any


MAX_SIDE = 256     # clips are resized to at most this square side (the stage trains on small crops)
MAX_FRAMES = 33    # frames decoded per clip: windows and latent statistics need no more
# Clips the latent statistics are measured on: the first 64 of the folder (the demo data's first 60
# hold each shape, colour and direction once). All 256 demo clips took 3.8x the time (6.5 s where
# 1.7 s, one thread) for means within 1% and stds within 3% of a standard deviation of these.
STATS_CLIPS = 64


def _clips(data_dir: Path, frames: int = 1, cell: int = 8, verbose: bool = True,
           side: int | None = None) -> list[torch.Tensor]:
    """The videos in `data_dir` (read as a dataset folder is, sub-folders too: `dataset.list_media`),
    each as (3, F, S, S) in [-1, 1]: its first `MAX_FRAMES` frames, scaled to cover an S x S square and
    centre-cropped, S the smallest clip's shorter side (at most `MAX_SIDE`, a multiple of the VAE's
    `cell`), so clips of any sizes train together. Every header is read before anything is decoded:
    a clip that cannot be read or has fewer than `frames` frames is skipped with a warning naming it;
    no clip left is a `ValueError`. `side`: that square side instead (the held-out clips, measured at
    the training size)."""
    if not Path(data_dir).is_dir():
        raise FileNotFoundError(f"{data_dir}: not a folder, so no videos to train the VAE on")
    paths, _ = list_media(data_dir)
    files = [p for p in paths if p.suffix.lower() in VIDEO_EXTS]
    if not files:
        raise FileNotFoundError(f"{data_dir}: no videos ({', '.join(VIDEO_EXTS)}) to train the VAE on, in it "
                                "or its sub-folders (read as a dataset is)")
    skipped, usable = [], []
    for path in files:  # 1. headers only
        try:
            info = probe_video(path)
        except MediaError as exc:
            skipped.append((path, exc.reason))
            continue
        if info.num_frames < frames:
            skipped.append((path, f"{info.num_frames} frames, fewer than the {frames}-frame training windows"))
        else:
            usable.append((path, info))
    if side is None:
        side = min([MAX_SIDE] + [min(i.width, i.height) for _, i in usable]) // cell * cell
    if usable and side < cell:
        raise ValueError(f"{data_dir}: the smallest clip ({min(min(i.width, i.height) for _, i in usable)} px) is "
                         f"smaller than the VAE's {cell}-px cell")
    clips = []
    for path, info in usable:  # 2. decode what passed, at the training size
        try:
            array = media.read_video_frames(path, list(range(min(info.num_frames, MAX_FRAMES))))  # (F, H, W, 3) uint8
        except MediaError as exc:
            skipped.append((path, exc.reason))
            continue
        resize, crop = crop_plan(info.width, info.height, side, side)
        clips.append(fit_frames(array, resize, crop, (side, side)).permute(1, 0, 2, 3).contiguous())  # (3, F, S, S)
    if verbose:
        for path, why in skipped:
            warnings.warn(f"{path}: skipped by the VAE stage: {why}", DataWarning, stacklevel=2)
    if not clips:
        raise ValueError(f"{data_dir}: no clip the VAE stage can use ({len(skipped)} skipped: "
                         + "; ".join(f"{p.name}: {why}" for p, why in skipped[:3]) + ")")
    return clips


def _foreground(x: torch.Tensor) -> torch.Tensor:
    """(B, 3, F, H, W) in [-1, 1] -> (B, F, H, W) float: 1 where any channel is brighter than ~10%."""
    return (x.amax(dim=1) > -0.8).float()


def _crop_origin(fg: torch.Tensor, ch: int, cw: int, gen: torch.Generator) -> tuple[int, int]:
    """Top-left corner of a ch x cw crop of frames `fg` (F, H, W) that holds a random foreground
    pixel (a uniformly random crop when there is none)."""
    H, W = fg.shape[1:]
    ys, xs = fg.any(0).nonzero(as_tuple=True)
    if len(ys) == 0:
        return (int(torch.randint(H - ch + 1, (1,), generator=gen)), int(torch.randint(W - cw + 1, (1,), generator=gen)))
    k = int(torch.randint(len(ys), (1,), generator=gen))
    dy, dx = (int(torch.randint(n, (1,), generator=gen)) for n in (ch, cw))
    return (min(max(int(ys[k]) - dy, 0), H - ch), min(max(int(xs[k]) - dx, 0), W - cw))


@torch.no_grad()
def reconstruction_figures(vae, clips: list[torch.Tensor], batch: int = 8) -> dict:
    """How well `vae` reproduces `clips` ((3, F, H, W) in [-1, 1] each; the demo's held-out clips).

    Per clip, through `encode(...).mode()` and `decode` (the paths caching and previews take):
      psnr        10 log10(1 / MSE) in dB, pixels in [0, 1], over every pixel of every frame
      colour_err  max over R, G, B of |mean reconstruction - mean truth| (in /255) over the truth's
                  shape pixels (brightest channel above ~10%, `_foreground`), all frames together
    Returns {"psnr": [...], "colour_err": [...]} in clip order.
    """
    psnr, colour = [], []
    for i in range(0, len(clips), batch):
        x = torch.stack(clips[i:i + batch])                               # (B, 3, F, H, W)
        x = x.to(getattr(vae, "device", x.device))                        # the VAE's device (a stand-in: as is)
        r = vae.decode(vae.encode(x).mode())                              # (B, 3, F', H, W), clamped
        x, r = (x[:, :, :r.shape[2]] + 1) / 2, (r + 1) / 2                # [0, 1]
        mse = (r - x).pow(2).mean(dim=(1, 2, 3, 4)).clamp_min(1e-10)
        psnr += (10 * torch.log10(1 / mse)).tolist()
        fg = _foreground(2 * x - 1).bool()                                # (B, F, H, W)
        for b in range(len(x)):
            if not fg[b].any():
                colour.append(0.0)
                continue
            truth, seen = x[b][:, fg[b]].mean(1), r[b][:, fg[b]].mean(1)  # (3,) each
            colour.append(float((seen - truth).abs().max()) * 255)
    return {"psnr": [round(v, 2) for v in psnr], "colour_err": [round(v, 1) for v in colour]}


def _heldout_figures(vae, data_dir: Path, size: tuple[int, int]) -> dict | None:
    """`reconstruction_figures` of the clips in `holdout_dir(data_dir)` (never trained on; the demo's), or
    None when there are none of the training frame size."""
    folder = holdout_dir(data_dir)
    if not folder.is_dir():
        return None
    if not any(p.suffix.lower() in VIDEO_EXTS for p in folder.iterdir()):
        return None
    try:
        clips = [c for c in _clips(folder, verbose=False, side=size[0]) if tuple(c.shape[2:]) == size]
    except ValueError:  # no held-out clip is readable: nothing to measure
        return None
    return reconstruction_figures(vae, clips) if clips else None


def format_figures(fig: dict) -> str:
    return (f"PSNR min {min(fig['psnr']):.1f} dB (mean {sum(fig['psnr']) / len(fig['psnr']):.1f}), shape colour "
            f"error max {max(fig['colour_err']):.1f}/255 per channel, per clip: "
            + ", ".join(f"{p:.1f} dB {c:.0f}/255" for p, c in zip(fig["psnr"], fig["colour_err"])))


def clamped_error(recon: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """`recon - x`, but 0 where `decode`'s clamp to [-1, 1] makes the pixel right anyway: past -1 on a
    black truth pixel (or past 1 on a white one). The decoder may then overshoot on the background,
    which sharpens the shapes' edges; everywhere else the error is the plain difference."""
    err = recon - x
    free = ((recon < -1) & (x <= -1 + 1e-2)) | ((recon > 1) & (x >= 1 - 1e-2))
    return err.masked_fill(free, 0.0)


@torch.no_grad()
def latent_stats(vae, clips: list[torch.Tensor], frames: int, batch: int = 8):
    """Per-channel (mean, std) of the posterior means of the first `frames` frames of each clip.

    Clips go through in batches: besides being faster, PyTorch runs a batch-1 Conv3d on CPU
    through its slow native kernel instead of oneDNN (several times slower).
    """
    total = total_sq = 0.0
    count = 0
    for i in range(0, len(clips), batch):
        x = torch.stack([c[:, :frames] for c in clips[i:i + batch]]).to(vae.device)  # (B, 3, F, H, W)
        z = vae.encode(x).mode().double()                                # (B, C, F', h, w)
        total = total + z.sum(dim=(0, 2, 3, 4))
        total_sq = total_sq + z.pow(2).sum(dim=(0, 2, 3, 4))
        count += z.numel() // z.shape[1]
    mean = total / count
    std = (total_sq / count - mean.pow(2)).clamp_min(1e-12).sqrt()
    return tuple(round(float(v), 6) for v in mean), tuple(round(float(v), 6) for v in std)


def _atomic_write(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


RANK_TIMEOUT = datetime.timedelta(minutes=2)  # data-parallel ranks: the longest wait for another rank

RGB = 3  # the colour path's latent channels: z[:, :3] starts as each cell's mean R, G, B


@torch.no_grad()
def init_colour_path(vae) -> None:
    """Start a Wan 2.1-layout VAE (any patchify) as a mean-colour codec: z[:, :3] = each latent cell's
    mean RGB, decoded back as a flat cell of that colour; every other channel keeps its random init.

    Why: the Wan 2.1 encoder's linear path (conv1, then 3x3 stride-2 and temporal convs between the
    residual blocks) starts as a chain of random filters whose latent is a random projection of a
    wide window, and under the residual blocks' channel norms the cell's colour is squeezed out as
    training grows the brightness features: with a linear probe trained on the latent to predict
    the cells' mean colours (direct supervision, 200 steps), luminance reached R^2 0.95 and chroma
    0.0-0.3, where a plain 4-conv encoder reached 0.98. With this init, chroma R^2 0.95 in the same
    steps, and the whole VAE learns hue (docs/demo_recipe.md, "What moved the VAE").

    Encoder: conv1 copies R, G, B into channels 0-2 (with a p x p patchify, `VAEConfig.patch_size`,
    each is the mean of its colour's p^2 pixel channels); each stride-2 conv averages the 2x2 block
    and each temporal one the frame pair, channel for channel (Resample.forward's padding and taps);
    1x1 shortcuts are identities; the residual branches, the head conv and quant_conv leave channels
    0-2 as they are (zero rows, one identity tap). Decoder, the mirror: post_quant_conv and conv1
    pass z[:, :3] on, each 2x upsampling conv keeps its nearest copy, the temporal one copies each
    frame into both halves, and the head maps channels 0-2 to R, G, B (patchified: to each of
    the colour's p^2 pixel channels, a flat p x p block). Residual branches keep
    their random init for channels 3+, so they learn shape and edges around the colour path.
    Attention blocks are left as Wan's init makes them (output projection zero: identity + bias).
    Call it on a freshly built VAE.
    """
    cfg = vae.config
    if cfg.is_residual:
        raise ValueError("init_colour_path: only the Wan 2.1 block layout (is_residual=False); Wan 2.2's "
                         "residual blocks already carry parameter-free average shortcuts")
    pp = cfg.patch_size ** 2  # a p x p patchify (`_patchify`): colour c is input channels c pp .. c pp + pp - 1

    def diagonal(weight, tap, value=1.0, rows=None):  # weight (out, in, *k): out c reads in c at `tap`
        for c in range(min(weight.shape[:2])) if rows is None else rows:
            weight[(c, c) + tap] = value

    def identity(weight, tap):  # the whole conv: each channel copies itself (the first min(out, in))
        weight.zero_()
        diagonal(weight, tap)

    def colour_rows(conv, tap):  # channels 0-2 of conv's output: its input's channels 0-2 at `tap`
        conv.weight[:RGB] = 0
        conv.bias[:RGB] = 0
        diagonal(conv.weight, tap, rows=range(RGB))

    conv1 = vae.encoder.conv1                              # (B, dim, F, H/p, W/p): channels 0-2 = RGB,
    conv1.weight[:RGB] = 0                                 # each the mean of its colour's p x p pixels
    conv1.bias[:RGB] = 0
    for c in range(RGB):
        conv1.weight[c, c * pp:(c + 1) * pp, -1, 1, 1] = 1.0 / pp
    for coder in (vae.encoder, vae.decoder):
        for m in coder.modules():
            if isinstance(m, ResidualBlock):
                m.residual[6].weight[:RGB] = 0             # the branch adds nothing to channels 0-2
                m.residual[6].bias[:RGB] = 0
                if isinstance(m.shortcut, CausalConv3d):   # 1x1 C -> C': the first min(C, C') copied
                    identity(m.shortcut.weight, (0, 0, 0))
                    m.shortcut.bias.zero_()
            elif isinstance(m, Resample):
                conv, t = m.resample[1], getattr(m, "time_conv", None)
                for c in (conv, t) if t is not None else (conv,):
                    c.weight.zero_()
                    c.bias.zero_()
                if m.mode.startswith("down"):              # right/bottom zero pad, stride 2: taps 0-1
                    diagonal(conv.weight, (slice(0, 2), slice(0, 2)), 0.25)   # 2x2 block mean
                else:                                      # nearest 2x, then this 3x3: centre tap
                    diagonal(conv.weight, (1, 1))
                if m.mode == "downsample3d":               # frames [past, a, b]: taps 1-2 average a, b
                    diagonal(t.weight, (slice(1, None), 0, 0), 0.5)
                elif m.mode == "upsample3d":               # (C -> 2C): both halves copy the frame
                    C = t.weight.shape[1]
                    diagonal(t.weight[:C], (-1, 0, 0))
                    diagonal(t.weight[C:], (-1, 0, 0))
    colour_rows(vae.encoder.head[2], (-1, 1, 1))           # after norm + SiLU: channels 0-2 kept
    colour_rows(vae.conv1, (0, 0, 0))                      # quant_conv: mean[:, :3] = channels 0-2
    colour_rows(vae.conv2, (0, 0, 0))                      # post_quant_conv
    colour_rows(vae.decoder.conv1, (-1, 1, 1))
    head = vae.decoder.head[2]                             # (B, 3 pp, F, H/p, W/p) from channels 0-2 only:
    head.weight.zero_()                                    # each of a colour's p x p pixels copies it
    head.bias.zero_()
    for c in range(RGB):
        head.weight[c * pp:(c + 1) * pp, c, -1, 1, 1] = 1.0


def train_tiny_vae(data_dir: str | os.PathLike, out_path: str | os.PathLike, *, force: bool = False,
                   verbose: bool = True, **recipe) -> Path:
    """Train the `preset` VAE on the videos under `data_dir` and save it to `out_path` (+ config.json).

    Returns `out_path`. Skips everything when `out_path` exists (unless `force`). `recipe`: the keyword
    arguments of `train_tiny_vae_result` (steps, seed, batch_size, frames, crop, lr, kl_weight,
    fg_weight, fg_ring, init_logvar, sample_posterior, latent_init_scale, cell_weight, bright_weight,
    colour_path, images, image_steps, bf16, preset, ranks, ema, threads, log_every), with its defaults. `frames` (4k+1) is the
    length of the random training windows; the latent statistics use whole clips (up to the longest
    4k+1 prefix; the first `STATS_CLIPS` clips). `threads` sets torch's intra-op threads for the stage (None: unchanged).
    `sample_posterior=False` decodes the posterior mean (a plain autoencoder); `init_logvar` starts the
    posterior nearly deterministic; `latent_init_scale` multiplies the initial posterior mean (the
    decoder otherwise ignores the small initial latents through a long plateau at ~12 dB);
    `cell_weight` adds the error of each latent cell's mean colour to the loss; `bright_weight` adds the
    weighted error of each pixel's brightest channel (a shape's outline, whatever its colour); `fg_weight`
    weighs the shapes' pixels (1 + fg_weight), and with `fg_ring` every pixel within that many px of a shape
    (an edge's blur then costs on both its sides); `colour_path` starts the VAE as a mean-colour codec
    (`init_colour_path`); `images` adds that many single frames of random clips to each step, through
    the first-frame path (the frame an i2v job conditions on); the first `image_steps` steps train
    on single frames alone (as many as a step's windows and frames hold); `ranks` trains
    data-parallel in that many processes (`train_tiny_vae_result`); `bf16` runs the VAE under bfloat16
    autocast where the CPU has native bf16 (float32 weights; elsewhere float32, said in the log); `ema`
    (a decay in (0, 1); 0: none) keeps an exponential moving average of the weights
    (`torch.optim.swa_utils.AveragedModel`), which is measured, saved and returned in their place. The
    error is `clamped_error` (no cost for overshoot that decode's clamp corrects).
    How the demo's recipe came to be, measured on the held-out clips: docs/demo_recipe.md.
    """
    out_path = Path(out_path)
    if out_path.exists() and not force:
        if verbose:
            print(f"[train-vae] {out_path} exists, skipping")
        return out_path
    return train_tiny_vae_result(data_dir, out_path, verbose=verbose, **recipe).path


def train_tiny_vae_result(data_dir, out_path, *, steps: int = 150, seed: int = 0, batch_size: int = 2,
                          frames: int = 5, crop: int | None = 32, lr: float = 2e-3, kl_weight: float = 1e-4,
                          fg_weight: float = 4.0, fg_ring: int = 0, init_logvar: float | None = None,
                          sample_posterior: bool = True, latent_init_scale: float | None = None,
                          cell_weight: float = 0.0, bright_weight: float = 0.0, colour_path: bool = False,
                          images: int = 0,
                          image_steps: int = 0, bf16: bool = False, preset: str = "tiny", ranks: int = 1,
                          ema: float = 0.0, threads: int | None = None, log_every: int = 50,
                          verbose: bool = True, device: str | None = None) -> VAETrainResult:
    """`train_tiny_vae` without the skip: always trains; returns the losses and statistics too.

    `ranks` > 1 trains data-parallel in that many processes on this machine (gloo): every rank draws
    the same step and takes its share of the windows and frames, and the gradients are summed, so the
    step is the one-process step (up to float summation order); each rank runs `threads` torch
    threads (default: the cores shared out). Rank 0 measures, saves and returns."""
    if preset not in VAE_PRESETS:
        raise KeyError(f"unknown VAE preset {preset!r}; valid: {', '.join(VAE_PRESETS)}")
    t = VAE_PRESETS[preset].temporal_compression
    if frames < 1 or snap_num_frames(frames, t) != frames:
        raise ValueError(f"frames must be {t}k + 1 (1, {t + 1}, {2 * t + 1}, ...), got {frames}")
    if latent_init_scale is not None and not latent_init_scale > 0:
        raise ValueError(f"latent_init_scale must be > 0 (or None: the default init), got {latent_init_scale}")
    if not cell_weight >= 0 or not fg_weight >= 0 or not bright_weight >= 0:
        raise ValueError(f"cell_weight, bright_weight and fg_weight must be >= 0, got {cell_weight}, {bright_weight}, "
                         f"{fg_weight}")
    if images < 0 or fg_ring < 0 or not 0 <= image_steps <= steps:
        raise ValueError(f"need images >= 0, fg_ring >= 0 and 0 <= image_steps <= steps; got images={images}, "
                         f"fg_ring={fg_ring}, image_steps={image_steps}, steps={steps}")
    if not 0.0 <= ema < 1.0:
        raise ValueError(f"ema (the average's decay) must be in [0, 1) (0: none), got {ema}")
    if steps < 1 or batch_size < 1 or not 1 <= ranks <= batch_size:
        raise ValueError(f"need steps >= 1 and 1 <= ranks <= batch_size (each rank takes a share of the windows); "
                         f"got steps={steps}, batch_size={batch_size}, ranks={ranks}")
    dev = resolve_device(device)  # None: the GPU when torch sees one
    if dev.type == "cuda" and ranks > 1:  # one GPU trains the tiny VAE in seconds: the CPU ranks' split is moot
        if verbose:
            print(f"[train-vae] on {dev}: 1 process (ranks: {ranks} is for CPU ranks)", flush=True)
        ranks = 1
    if bf16 and dev.type == "cpu" and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        if verbose:
            print("[train-vae] bf16: this CPU has no native bfloat16 (oneDNN), so training in float32", flush=True)
        bf16 = False
    recipe = dict(steps=steps, seed=seed, batch_size=batch_size, frames=frames, crop=crop, lr=lr,
                  kl_weight=kl_weight, fg_weight=fg_weight, fg_ring=fg_ring, init_logvar=init_logvar,
                  sample_posterior=sample_posterior, latent_init_scale=latent_init_scale, cell_weight=cell_weight,
                  bright_weight=bright_weight, colour_path=colour_path, images=images, image_steps=image_steps,
                  bf16=bf16, preset=preset, ema=ema, device=str(dev),
                  threads=threads if threads is not None or ranks == 1 else max(1, (os.cpu_count() or 1) // ranks),
                  log_every=log_every, verbose=verbose)
    moved = move_old_holdout(data_dir)  # an earlier demo layout: its held-out clips would be trained on
    if moved and verbose:
        print(f"[train-vae] {moved}", flush=True)
    return run_local_ranks(_train_rank, ranks, (Path(data_dir), Path(out_path)), recipe, "the VAE stage")


def _train_rank(rank: int, world: int, init: str | None, data_dir: Path, out_path: Path,
                recipe: dict) -> VAETrainResult | None:
    """One rank of `train_tiny_vae_result` (the whole stage when `world` is 1): trains; rank 0 then
    measures and saves. `init`: the process group's rendezvous (None: one rank)."""
    r = SimpleNamespace(**recipe)
    if r.threads is not None:
        previous_threads = torch.get_num_threads()
        torch.set_num_threads(r.threads)
    if init is not None:
        # a rank that dies (or never starts) fails the others within the timeout instead of hanging them
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world, timeout=RANK_TIMEOUT)
    start = time.perf_counter()
    try:
        device = torch.device(r.device)
        clips = [c.to(device) for c in _clips(data_dir, r.frames, VAE_PRESETS[r.preset].spatial_compression,
                                              verbose=r.verbose)]
        torch.manual_seed(r.seed)                    # the model's init (the same on every rank)
        gen = torch.Generator().manual_seed(r.seed)  # windows, order and posterior samples (likewise; on the CPU)
        vae = _initial_vae(r).to(device)
        averaged, losses = _train_steps(vae, clips, r, rank, world, gen, start)
        if rank != 0:
            return None
        return _measure_and_save(vae, averaged, clips, losses, r, data_dir, out_path, start)
    finally:
        if init is not None:
            dist.destroy_process_group()
        if r.threads is not None:
            torch.set_num_threads(previous_threads)


def _initial_vae(r) -> CausalVideoVAE:
    """The recipe's VAE at its first step (torch's default init from the seeded global RNG, then the
    recipe's changes of it)."""
    config = dataclasses.replace(VAE_PRESETS[r.preset])
    vae = CausalVideoVAE(config).train()
    if r.colour_path:
        init_colour_path(vae)  # z[:, :3] starts as the cells' mean RGB (see init_colour_path)
    if r.init_logvar is not None:
        # Start the posterior nearly deterministic (std e^(init_logvar / 2)): with the default
        # init, logvar ~ 0 and unit noise drowns the latents, and a short run spends most of its
        # steps learning to shrink it. conv1's output channels are [mean | logvar].
        with torch.no_grad():
            vae.conv1.weight[config.z_dim:].zero_()
            vae.conv1.bias[config.z_dim:].fill_(r.init_logvar)
    if r.latent_init_scale is not None:
        # Start with latents that outweigh the decoder's biases: at the default init the posterior
        # mean has a std of ~0.2, the decoder first learns to ignore it (outputs the average clip,
        # ~12 dB) and only starts to use it after a long plateau (~125 steps overfitting one
        # batch; ~40 with the mean half of quant_conv scaled by 30). conv1 = quant_conv.
        with torch.no_grad():
            vae.conv1.weight[:config.z_dim].mul_(r.latent_init_scale)
            vae.conv1.bias[:config.z_dim].mul_(r.latent_init_scale)
    return vae


def _batch_loss_fn(vae, r, rank: int, world: int, gen: torch.Generator, cell: int):
    """The recipe's loss of one step's batch, as this rank's share: (B, 3, T, ch, cw) -> (reconstruction,
    KL) terms. Every term is this rank's share of a sum, divided by the whole batch's count (or
    weight), so the ranks' terms add up to the one-process loss. The rank takes items rank::world."""
    def weight_of(x):  # (B, 3, T, h, w) -> (B, 1, T, h, w): shapes cover a few % of the demo frames:
        # weigh their pixels (and those within fg_ring px of them) up, or black wins
        mask = _foreground(x)
        if r.fg_ring:
            k = 2 * r.fg_ring + 1
            mask = torch.nn.functional.max_pool3d(mask[:, None], (1, k, k), 1, (0, r.fg_ring, r.fg_ring))[:, 0]
        return 1.0 + r.fg_weight * mask.unsqueeze(1)

    def weighted(e, w):  # the weighted L1 + L2 sum of the errors e
        return (w * (e.abs() + e.pow(2))).sum()

    def batch_loss(x):
        weight = weight_of(x)
        denom = weight.sum() * x.shape[1]                       # the weights' sum over (B, 3, T, h, w)
        part, weight = x[rank::world], weight[rank::world]
        if len(part) == 0:
            return x.new_zeros(()), x.new_zeros(())
        # Whole windows at once (chunked=False: same result as the causal chunks, fewer calls);
        # no clamp, so pixels pushed past [-1, 1] still get a gradient.
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=r.bf16):
            posterior = vae.encode(part, chunked=False)
            if r.sample_posterior:  # the whole batch's noise, so every rank draws the same
                noise = torch.randn((len(x),) + posterior.mean.shape[1:], generator=gen)[rank::world]
                z = posterior.mean + posterior.std * noise.to(posterior.mean.device, posterior.mean.dtype)
            else:
                z = posterior.mode()
            recon = vae.decode(z, chunked=False, clamp=False).float()
        err = clamped_error(recon, part)
        rec = weighted(err, weight) / denom
        if r.bright_weight:
            # the error of each pixel's brightest channel: a shape's outline on black, whatever its
            # colour. The per-channel terms weigh an edge by its colour's channels, so a red or
            # blue edge (one bright channel) cost half a yellow one (two) and a third of a white one
            bright = clamped_error(recon.amax(1, keepdim=True), part.amax(1, keepdim=True))  # (b, 1, T, h, w)
            rec = rec + r.bright_weight * weighted(bright, weight) * x.shape[1] / denom
        if r.cell_weight:
            # the error of each latent cell's mean colour (one cell x cell block per frame): a
            # cell's colour gets a gradient that the per-pixel terms spread over its edges
            pooled = torch.nn.functional.avg_pool3d(err, (1, cell, cell)).abs()
            rec = rec + r.cell_weight * pooled.sum() / (pooled.numel() * len(x) / len(part))
        mean, logvar = posterior.mean.float(), posterior.logvar.float()
        kl_sum = 0.5 * (mean.pow(2) + logvar.exp() - 1.0 - logvar).sum()               # KL to N(0, 1)
        kl = kl_sum / (mean.numel() * len(x) / len(part))
        return rec, kl

    return batch_loss


def _window_fn(clips: list, r, gen: torch.Generator):
    """draw(n, length): n random windows of `length` frames, each cropped (the recipe's `crop`) around
    a random shape pixel: (n, 3, length, ch, cw)."""
    H, W = clips[0].shape[2:]
    fg = [_foreground(c[None])[0] for c in clips]                             # (F, H, W) bool each
    cell = VAE_PRESETS[r.preset].spatial_compression
    ch, cw = (H, W) if r.crop is None else (min(r.crop, H), min(r.crop, W))
    if ch % cell or cw % cell:
        raise ValueError(f"crop {ch}x{cw} (frames {H}x{W}) must be a multiple of the VAE's {cell}x cell")

    def draw(n, length):
        out = []
        for i in torch.randint(len(clips), (n,), generator=gen).tolist():
            o = int(torch.randint(clips[i].shape[1] - length + 1, (1,), generator=gen))
            y0, x0 = _crop_origin(fg[i][o:o + length], ch, cw, gen)
            out.append(clips[i][:, o:o + length, y0:y0 + ch, x0:x0 + cw])
        return torch.stack(out)                                                  # (n, 3, length, ch, cw)

    return draw


def _train_steps(vae, clips: list, r, rank: int, world: int, gen: torch.Generator, start: float):
    """The recipe's optimizer steps on this rank (gradients summed over the ranks); returns (the
    weights' moving average on rank 0 or None, the reconstruction loss of every step)."""
    draw = _window_fn(clips, r, gen)
    batch_loss = _batch_loss_fn(vae, r, rank, world, gen, VAE_PRESETS[r.preset].spatial_compression)
    params = list(vae.parameters())
    # fused: one kernel over all parameters instead of a loop of small ops per parameter
    opt = torch.optim.AdamW(params, lr=r.lr, betas=(0.9, 0.99), weight_decay=0.0, fused=True)
    steps, warmup = r.steps, max(1, r.steps // 20)
    # Linear warmup, then cosine to 10% of lr: the last steps polish instead of bouncing.
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / warmup) * (
        0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, i / steps)))))
    losses: list[float] = []
    # An exponential moving average of the weights (decay r.ema, from the first step's), which rank 0
    # saves: the steps' noise averages out of the edges (docs/demo_recipe.md: +0.4-1.5 dB held out)
    swa = torch.optim.swa_utils
    averaged = (swa.AveragedModel(vae, multi_avg_fn=swa.get_ema_multi_avg_fn(r.ema))
                if r.ema and rank == 0 else None)
    batch_size, images, frames = r.batch_size, r.images, r.frames
    for step in range(steps):
        if step < r.image_steps:
            # single frames alone (as many frames as a whole step holds): the first-frame path
            # learns the shapes' edges and colours before the windows add motion
            rec, kl = batch_loss(draw(images + batch_size * frames, 1))
        else:
            rec, kl = batch_loss(draw(batch_size, frames))
            if images:
                # single frames of other clips, through the first-frame path alone (the frame an i2v
                # job conditions on): more independent crops per step than the windows give
                rec_i, kl_i = batch_loss(draw(images, 1))
                rec, kl = rec + rec_i, (kl + kl_i) / 2
        loss = rec + r.kl_weight * kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        terms = torch.stack([rec.detach(), kl.detach()])
        if world > 1:  # the gradients of the ranks' shares add up to the whole step's gradient
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
            flat = torch.cat([g.reshape(-1) for g in grads] + [terms])
            dist.all_reduce(flat)
            for p, g in zip(params, torch.split(flat[:-2], [q.numel() for q in params])):
                p.grad = g.view_as(p)
            terms = flat[-2:]
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        opt.step()
        sched.step()
        if averaged is not None:
            averaged.update_parameters(vae)
        losses.append(float(terms[0]))
        if r.verbose and (step + 1) % r.log_every == 0 or (r.verbose and step + 1 == steps):
            recent = losses[-r.log_every:]
            print(f"[train-vae] step {step + 1}/{steps} recon {sum(recent) / len(recent):.4f} "
                  f"({time.perf_counter() - start:.0f}s)", flush=True)
    return averaged, losses


def _measure_and_save(vae, averaged, clips: list, losses: list[float], r, data_dir: Path, out_path: Path,
                      start: float) -> VAETrainResult:
    """Rank 0 after the steps: the average in place of the weights, measured on the held-out clips,
    the latent statistics, saved with its config; the stage's result."""
    H, W = clips[0].shape[2:]
    vae.eval()
    if averaged is not None:
        if r.verbose and (raw := _heldout_figures(vae, data_dir, (H, W))) is not None:
            print(f"[train-vae] held-out clips, the last step's weights: {format_figures(raw)}", flush=True)
        with torch.no_grad():  # the average is what is measured, saved and returned
            for p, a in zip(vae.parameters(), averaged.module.parameters()):
                p.copy_(a)
    heldout = _heldout_figures(vae, data_dir, (H, W))
    if r.verbose and heldout is not None:
        what = f" (EMA {r.ema} of the weights: saved)" if averaged is not None else ""
        print(f"[train-vae] held-out clips ({holdout_dir(data_dir)}){what}: {format_figures(heldout)}", flush=True)
    stats_frames = snap_num_frames(min(c.shape[1] for c in clips), VAE_PRESETS[r.preset].temporal_compression)
    mean, std = latent_stats(vae, clips[:STATS_CLIPS], stats_frames)
    config = dataclasses.replace(vae.config, mean=mean, std=std)
    vae.config = config  # the returned model normalizes as a loaded one does
    vae.latent_mean.copy_(torch.tensor(mean).view_as(vae.latent_mean))
    vae.latent_std.copy_(torch.tensor(std).view_as(vae.latent_std))
    out_path.parent.mkdir(parents=True, exist_ok=True)
    # Only VAEConfig fields: `VAEConfig.from_dict(json.load(...))` rebuilds the config exactly.
    config_json = json.dumps(dataclasses.asdict(config), indent=2)
    _atomic_write(out_path.parent / CONFIG_NAME, lambda p: p.write_text(config_json + "\n"))
    vae.to("cpu")  # saved and returned as a CPU model, whichever device trained it
    state = {k: v.detach().contiguous() for k, v in vae.state_dict().items()}
    meta = {"format": "pt", "preset": r.preset, "steps": str(r.steps), "seed": str(r.seed),
            "final_recon_loss": f"{losses[-1]:.6f}", "vae_config": config_json}
    if heldout is not None:
        meta["heldout_figures"] = json.dumps(heldout)
    _atomic_write(out_path, lambda p: save_file(state, str(p), metadata=meta))
    seconds = time.perf_counter() - start
    if r.verbose:
        print(f"[train-vae] saved {out_path} ({seconds:.0f}s)", flush=True)
    return VAETrainResult(out_path, losses, mean, std, seconds, vae, heldout)
