"""The first stage of the embedded audio-video demo (configs/demo_av_tiny.yaml): the tiny LTX-2 video VAE, audio
VAE and vocoder trained on the demo clips, as the video demo trains its VAE (random codecs reconstruct
nothing, so the DiT would learn to move noise). Two stages, each skipped when its output exists:

    train_tiny_vae(DIR, FILE, preset=...)          the video VAE (`Family.vae_stage`, `prepare.tiny_vae`)
      clips (3, 17, 64, 64) in [-1, 1] --random whole clips and single frames, cropped--> encode -> mean
        -> decode (the layers' differentiable `plain` path); loss: L1 + L2 per pixel, a shape's pixels (and
        those within `fg_ring` px) x (1 + fg_weight), plus each pixel's brightest channel (x bright_weight)
        and each latent cell's mean colour (x cell_weight), plus 1e-4 KL; overshoot that decode's clamp
        corrects is free (`clamped_error`); data-parallel over `ranks` processes (gloo)
      -> the weights' moving average (`ema`), per-channel latent statistics (the DiT's normalisation),
         the held-out clips' PSNR and shape-colour error -> FILE (Lightricks' names) + config.json beside
         it (diffusers' `AutoencoderKLLTX2Video` names), which `load_vae(FILE)` reads
    train_tiny_codec(DIR, FOLDER, preset=...)      the audio codec (`AudioPath.codec_stage`, `prepare.tiny_audio`)
      each clip's track (`read_sounds`: the sound alone, no picture decoded) --the codec's mel front end
      (`mel.py`)--> log-mel (B, 2, T, M)
        1. the audio VAE: encode -> mean -> decode, L1 on the log-mel (+ 1e-4 KL); its per-channel token
           statistics over the clips
        2. the vocoder on the clips' log-mels (not the audio VAE's reconstructions: `train_tiny_codec_result`
           says why), on windows of `segment_frames` mel frames (`vocode_frames`: with the context its receptive field
           needs, so a window's output is the whole clip's there): multi-resolution STFT magnitude loss,
           normalised per window, against the clip's waveform at the vocoder's rate over the window
      -> the held-out clips' pitch through the round trip against their own (`demo_av.estimate_pitch`)
      -> FOLDER/audio_vae/ + FOLDER/vocoder/ (diffusers' layout), which `load_codec(FOLDER)` reads

Clips are read as a dataset folder is (`dataset.list_media`, recursively); the demo's held-out clips sit
beside the folder (`demo.holdout_dir`), are never trained on and give the figures, also kept in the
weights' metadata. Deterministic for a seed and thread count. Both stages write through temporary names.
The recipe and how it was found: docs/demo_recipe.md, "The audio-video demo".
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors.torch import save_file

from video_dit import media
from video_dit.data import audio as audio_mod
from video_dit.data.dataset import list_media
from video_dit.data.demo import holdout_dir
from video_dit.data.demo_av import check_sound, estimate_pitch
from video_dit.families.ltx2.audio_convert import (audio_vae_config_to_diffusers, audio_vae_to_diffusers,
                                                   vocoder_config_to_diffusers, vocoder_to_diffusers)
from video_dit.families.ltx2.audio_vae import LTX2AudioVAE, audio_tokens
from video_dit.families.ltx2.mel import MelConfig, resample, waveform_to_mel
from video_dit.families.ltx2.presets import AUDIO
from video_dit.families.ltx2.vae import LTX2VideoVAE
from video_dit.families.ltx2.vae_config import PRESETS as VAE_PRESETS
from video_dit.families.ltx2.vae_convert import ltx2_vae_config_to_diffusers
from video_dit.families.ltx2.vocoder import LTX2Vocoder
from video_dit.media import VIDEO_EXTS, MediaError
from video_dit.parallel.process import run_local_ranks

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"  # a diffusers component folder's weights
STATS_CLIPS = 64  # clips the latent statistics are measured on (the demo data's first 60 hold every combination)
RANK_TIMEOUT = datetime.timedelta(minutes=2)  # data-parallel ranks: the longest wait for another rank
KL_WEIGHT = 1e-4


@dataclasses.dataclass
class StageResult:
    path: Path
    losses: list[float]          # the reconstruction loss of every step (the vocoder's after the audio VAE's)
    seconds: float
    model: torch.nn.Module       # the trained model (eval mode, CPU): the video VAE, or the `LTX2AudioCodec`
    heldout: dict | None = None  # the held-out clips' figures (`reconstruction_figures` / `codec_figures`)


# ---------------------------------------------------------------- the clips


def read_clips(data_dir) -> tuple[list[torch.Tensor], list[str]]:
    """(frames (3, F, H, W) float in [-1, 1], captions) of every video under `data_dir` (read as a dataset folder
    is; the sound: `read_sounds`). A clip that cannot be read is a `ValueError` naming it (the demo's data is
    generated, so a broken clip is a broken folder, not one to skip)."""
    frames, captions = [], []
    for path in _videos(data_dir):
        try:
            array = media.read_video_frames(path)                                   # (F, H, W, 3) uint8
        except MediaError as exc:
            raise ValueError(f"{path}: cannot be read ({exc.reason})") from exc
        frames.append(torch.from_numpy(array).permute(3, 0, 1, 2).float().div(127.5).sub(1.0))  # (3, F, H, W)
        captions.append(_caption(path))
    shapes = {tuple(f.shape) for f in frames}
    if len(shapes) != 1:
        raise ValueError(f"{data_dir}: the clips differ in size or length ({sorted(shapes)[:3]}); the demo stage "
                         "trains on clips of one shape")
    return frames, captions


def _videos(data_dir) -> list[Path]:
    """The videos under `data_dir`, listed as a dataset folder is; none, or no folder, is a FileNotFoundError."""
    if not Path(data_dir).is_dir():
        raise FileNotFoundError(f"{data_dir}: not a folder, so no clips to train on")
    paths = [p for p in list_media(data_dir)[0] if p.suffix.lower() in VIDEO_EXTS]
    if not paths:
        raise FileNotFoundError(f"{data_dir}: no videos ({', '.join(VIDEO_EXTS)}) in it or its sub-folders")
    return paths


def _caption(path: Path) -> str:
    caption = path.with_suffix(".txt")
    return caption.read_text(encoding="utf-8").strip() if caption.is_file() else ""


def _heldout_folder(data_dir) -> Path | None:
    """The demo's held-out clips' folder (`holdout_dir(data_dir)`), or None when it holds no video."""
    folder = holdout_dir(data_dir)
    return folder if folder.is_dir() and any(p.suffix.lower() in VIDEO_EXTS for p in folder.iterdir()) else None


def _heldout(data_dir):
    """`read_clips` of the demo's held-out clips (`_heldout_folder`), or None when there are none."""
    folder = _heldout_folder(data_dir)
    return None if folder is None else read_clips(folder)


def _atomic_write(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def _ema(model: torch.nn.Module, decay: float):
    """The weights' exponential moving average (torch's `AveragedModel`), or None for decay 0."""
    swa = torch.optim.swa_utils
    return swa.AveragedModel(model, multi_avg_fn=swa.get_ema_multi_avg_fn(decay)) if decay else None


def _schedule(opt: torch.optim.Optimizer, steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup over 5% of the steps, then cosine to 10% of the rate: the last steps polish."""
    warmup = max(1, steps // 20)
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / warmup) * (
        0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, i / steps)))))


# ---------------------------------------------------------------- the video VAE: figures and loss


def foreground(x: torch.Tensor) -> torch.Tensor:
    """(B, 3, F, H, W) in [-1, 1] -> (B, F, H, W) float: 1 where any channel is brighter than ~10%."""
    return (x.amax(dim=1) > -0.8).float()


@torch.no_grad()
def reconstruction_figures(vae: LTX2VideoVAE, clips: list[torch.Tensor]) -> dict:
    """Per clip ((3, F, H, W) in [-1, 1]) through `encode(...).mode()` and `decode` (the inference paths):
    `psnr` (dB, pixels in [0, 1]) and `colour_err` (the largest |mean reconstruction - mean truth| over R, G, B
    of the truth's shape pixels, in /255)."""
    psnr, colour = [], []
    for clip in clips:
        x = clip[None]                                                            # (1, 3, F, H, W)
        r = (vae.decode(vae.encode(x).mode()) + 1) / 2
        x = (x + 1) / 2
        psnr.append(float(10 * torch.log10(1 / (r - x).pow(2).mean().clamp_min(1e-10))))
        fg = foreground(2 * x - 1)[0].bool()                                      # (F, H, W)
        colour.append(float((r[0][:, fg].mean(1) - x[0][:, fg].mean(1)).abs().max()) * 255 if fg.any() else 0.0)
    return {"psnr": [round(v, 2) for v in psnr], "colour_err": [round(v, 1) for v in colour]}


def format_figures(fig: dict) -> str:
    return (f"PSNR min {min(fig['psnr']):.1f} dB (mean {sum(fig['psnr']) / len(fig['psnr']):.1f}), shape colour "
            f"error max {max(fig['colour_err']):.1f}/255, per clip: "
            + ", ".join(f"{p:.1f} dB {c:.0f}/255" for p, c in zip(fig["psnr"], fig["colour_err"])))


def clamped_error(recon: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """`recon - x`, but 0 where decode's clamp to [-1, 1] makes the pixel right anyway (past -1 on a black
    truth pixel, past 1 on a white one): overshoot on the background is free and sharpens the edges."""
    free = ((recon < -1) & (x <= -1 + 1e-2)) | ((recon > 1) & (x >= 1 - 1e-2))
    return (recon - x).masked_fill(free, 0.0)


def _video_loss_fn(vae: LTX2VideoVAE, r, rank: int, world: int):
    """batch (n, 3, T, h, w) -> (reconstruction, KL) terms of this rank's share (items rank::world), each
    divided by the whole batch's count or weight, so the ranks' terms add up to the one-process loss."""
    cell = vae.config.spatial_compression

    def weight_of(x):  # the shapes cover a few % of the frames: their pixels (and a ring around them) weigh more
        mask = foreground(x)
        if r.fg_ring:
            k = 2 * r.fg_ring + 1
            mask = F.max_pool3d(mask[:, None], (1, k, k), 1, (0, r.fg_ring, r.fg_ring))[:, 0]
        return 1.0 + r.fg_weight * mask.unsqueeze(1)                              # (n, 1, T, h, w)

    def weighted(e, w):
        return (w * (e.abs() + e.pow(2))).sum()

    def loss(x):
        weight = weight_of(x)
        denom = weight.sum() * x.shape[1]
        part, weight = x[rank::world], weight[rank::world]
        if len(part) == 0:
            return x.new_zeros(()), x.new_zeros(())
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=r.bf16):
            posterior = vae.encode(part)
            recon = vae.decode(posterior.mode(), clamp=False).float()
        err = clamped_error(recon, part)
        rec = weighted(err, weight) / denom
        if r.bright_weight:  # each pixel's brightest channel: an outline on black, whatever its colour
            bright = clamped_error(recon.amax(1, keepdim=True), part.amax(1, keepdim=True))
            rec = rec + r.bright_weight * weighted(bright, weight) * x.shape[1] / denom
        if r.cell_weight:  # each latent cell's mean colour, whose gradient the per-pixel terms spread over edges
            pooled = F.avg_pool3d(err, (1, cell, cell)).abs()
            rec = rec + r.cell_weight * pooled.sum() / (pooled.numel() * len(x) / len(part))
        mean, logvar = posterior.mean.float(), posterior.logvar.float()
        kl = 0.5 * (mean.pow(2) + logvar.exp() - 1.0 - logvar).sum() / (mean.numel() * len(x) / len(part))
        return rec, kl

    return loss


def _windows(clips: list[torch.Tensor], crop: int | None, gen: torch.Generator):
    """draw(n, length): n random windows of `length` frames of random clips, each a crop x crop square
    around a random shape pixel (the whole frame when `crop` is None): (n, 3, length, c, c)."""
    H, W = clips[0].shape[2:]
    ch, cw = (H, W) if crop is None else (min(crop, H), min(crop, W))
    fg = [foreground(c[None])[0] for c in clips]                                  # (F, H, W) each

    def draw(n: int, length: int) -> torch.Tensor:
        out = []
        for i in torch.randint(len(clips), (n,), generator=gen).tolist():
            o = int(torch.randint(clips[i].shape[1] - length + 1, (1,), generator=gen))
            ys, xs = fg[i][o:o + length].any(0).nonzero(as_tuple=True)
            if len(ys):
                k = int(torch.randint(len(ys), (1,), generator=gen))
                dy, dx = (int(torch.randint(m, (1,), generator=gen)) for m in (ch, cw))
                y0, x0 = min(max(int(ys[k]) - dy, 0), H - ch), min(max(int(xs[k]) - dx, 0), W - cw)
            else:
                y0, x0 = (int(torch.randint(m + 1, (1,), generator=gen)) for m in (H - ch, W - cw))
            out.append(clips[i][:, o:o + length, y0:y0 + ch, x0:x0 + cw])
        return torch.stack(out)                                                   # (n, 3, length, ch, cw)

    return draw


RGB = 3  # the colour path's channels


@torch.no_grad()
def init_colour_path(vae: LTX2VideoVAE) -> None:
    """Start the VAE as a mean-colour codec: latent channels 0-2 = each latent cell's mean R, G, B, decoded back
    as a flat cell of that colour; every other weight keeps its random init, and the residual branches learn
    shape and edges around the path (Wan's demo VAE needed the same start: without it, hue never came,
    docs/demo_recipe.md "What moved the VAE"; measured here: 400 steps without it, 20-22 dB and 65-136/255).

    Encoder: conv_in writes channel c (of R, G, B) as the mean of colour c's p x p patch channels (the current
    frame's tap); a downsample's parameter-free skip already averages channel c into channels c r .. c r + r - 1
    (r = its width ratio; each the mean over a share of the folded positions), so its conv's output rows that
    fold into those channels are zeroed, and so is every res block's last conv's row of a colour channel (its
    branch adds nothing there); conv_out's latent rows 0-2 average each colour's channels. Decoder, the mirror:
    conv_in copies latent 0-2 into channels 0-2, each upsample's conv copies channel c into every position of
    its output channel c (a nearest upsample), the res blocks' branches add nothing to them, and conv_out maps
    channel c to each of colour c's p x p pixel channels (and nothing else, at first). Upsamples that add
    their input (`decoder_residual`) would mix the colours across positions: refused. The heads before
    conv_in's of both halves' conv_out (pixel norm, SiLU) still bend the values: the start is a close
    colour codec, not an exact one. Call it on a freshly built VAE."""
    cfg = vae.config
    if any(cfg.decoder_residual):
        raise ValueError("init_colour_path: upsamples that add their input (decoder_residual) mix the colour "
                         "channels across positions; accepted: decoder_residual all false")
    pp = cfg.patch_size ** 2
    enc, dec = vae.encoder, vae.decoder
    now_enc, now_dec = 2, 2 if cfg.decoder_causal else 1  # the time tap of the current frame (causal: last)

    def clear_rows(conv, rows) -> None:
        conv.weight[list(rows)] = 0
        conv.bias[list(rows)] = 0

    def colour_branches(stage, channels) -> None:  # res blocks add nothing to the colour channels
        for block in stage.res_blocks:
            clear_rows(block.conv2.conv, channels)

    clear_rows(enc.conv_in.conv, range(RGB))
    for c in range(RGB):  # (mean + 1) / 2: black 0, so the heads' pixel norm and SiLU leave a black cell black
        enc.conv_in.conv.weight[c, c * pp:(c + 1) * pp, now_enc, 1, 1] = 0.5 / pp
        enc.conv_in.conv.bias[c] = 0.5
    groups = [[c] for c in range(RGB)]  # the encoder channels holding each colour, stage by stage
    for block in enc.down_blocks:
        if not hasattr(block, "stride"):  # a res stage
            colour_branches(block, [ch for g in groups for ch in g])
            continue
        ratio, folded = block.out_channels // block.conv.conv.in_channels, math.prod(block.stride)
        groups = [[ch * ratio + k for ch in g for k in range(ratio)] for g in groups]
        clear_rows(block.conv.conv, sorted({ch // folded for g in groups for ch in g}))
    out = enc.conv_out.conv
    clear_rows(out, range(RGB))
    for c, g in enumerate(groups):
        out.weight[c, g, now_enc, 1, 1] = 1.0 / len(g)

    clear_rows(dec.conv_in.conv, range(RGB))
    for c in range(RGB):
        dec.conv_in.conv.weight[c, c, now_dec, 1, 1] = 1.0
    for block in dec.up_blocks:
        if not hasattr(block, "stride"):
            colour_branches(block, range(RGB))
            continue
        folded = math.prod(block.stride)
        conv = block.conv.conv  # output channel k at position s: conv row k * folded + s
        clear_rows(conv, range(RGB * folded))
        for c in range(RGB):
            conv.weight[c * folded:(c + 1) * folded, c, now_dec, 1, 1] = 1.0
    head = dec.conv_out.conv  # back to [-1, 1]: 2 x - 1
    head.weight.zero_()
    head.bias.fill_(-1.0)
    for c in range(RGB):
        head.weight[c * pp:(c + 1) * pp, c, now_dec, 1, 1] = 2.0


# ---------------------------------------------------------------- the video VAE: the stage


def train_tiny_vae(data_dir, out_path, *, force: bool = False, verbose: bool = True, **recipe) -> Path:
    """Train the LTX-2 VAE preset `recipe["preset"]` on the clips under `data_dir` and save it to `out_path`
    (+ config.json beside it) unless `out_path` exists (or `force`); returns `out_path`. The recipe:
    `train_tiny_vae_result`'s keywords."""
    out_path = Path(out_path)
    if out_path.exists() and not force:
        if verbose:
            print(f"[train-vae] {out_path} exists, skipping")
        return out_path
    return train_tiny_vae_result(data_dir, out_path, verbose=verbose, **recipe).path


def train_tiny_vae_result(data_dir, out_path, *, preset: str, steps: int = 1200, seed: int = 0, batch_size: int = 2,
                   frames: int = 17, lr: float = 3e-3, sample_posterior: bool = False,
                          latent_init_scale: float | None = None, cell_weight: float = 4.0,
                          bright_weight: float = 5.0, colour_path: bool = True, fg_weight: float = 8.0,
                          fg_ring: int = 2, images: int = 18,
                          image_steps: int = 0, bf16: bool = True, ranks: int = 1, ema: float = 0.99,
                          crop: int | None = 32, threads: int | None = None, verbose: bool = True,
                          log_every: int = 100) -> StageResult:
    """`train_tiny_vae` without the skip: trains the LTX-2 VAE preset `preset` (`vae_config.PRESETS`), saves it,
    returns the losses, the model and the held-out figures too. The keywords are `prepare.tiny_vae`'s (`TinyVAEStage`), as Wan's stage takes them: `steps` optimizer steps
    of `batch_size` random windows of `frames` frames (whole clips: 8k + 1 for the release's VAEs, 4k + 1 for
    the demo's) cropped to `crop` px around a shape, plus `images` single frames of other clips (the first-frame
    path an i2v job conditions on); the first `image_steps` steps on single frames alone; AdamW at `lr`, warmup
    and cosine (`_schedule`); the loss of `_video_loss_fn` (`fg_weight`, `fg_ring`, `bright_weight`,
    `cell_weight`); bfloat16 autocast (`bf16`) where the CPU has native bf16; `ranks` data-parallel processes
    (`threads` torch threads each; default: the cores shared out); the saved weights are the `ema` moving
    average (0: the last step's); `colour_path` starts the VAE as a mean-colour codec (`init_colour_path`).
    Wan's `latent_init_scale` and `sample_posterior` are refused unless off (the demo trains a plain
    autoencoder of the posterior mean)."""
    out_path = Path(out_path)
    for key, value, off in (("latent_init_scale", latent_init_scale, None), ("sample_posterior", sample_posterior, False)):
        if value != off:
            raise ValueError(f"{key}={value!r}: not in LTX-2's VAE stage (the demo trains a plain autoencoder of the "
                             f"posterior mean, started by `colour_path`); accepted: {off!r}")
    if preset not in VAE_PRESETS:
        raise KeyError(f"unknown LTX-2 VAE preset {preset!r}; valid: {', '.join(VAE_PRESETS)}")
    config = VAE_PRESETS[preset]
    t = config.temporal_compression
    if frames < 1 or (frames - 1) % t:
        raise ValueError(f"frames={frames}: windows of {t}k + 1 frames for VAE preset {preset!r}")
    if crop is not None and crop % config.spatial_compression:
        raise ValueError(f"crop={crop}: a multiple of the VAE's {config.spatial_compression}-px cell")
    if steps < 1 or not 0 <= image_steps <= steps or images < 0 or not 1 <= ranks <= batch_size \
            or min(cell_weight, bright_weight, fg_weight, fg_ring) < 0 or not 0 <= ema < 1:
        raise ValueError(f"need steps >= 1, 0 <= image_steps <= steps, images >= 0, 1 <= ranks <= batch_size, "
                         f"weights >= 0, 0 <= ema < 1; got steps={steps}, image_steps={image_steps}, images={images}, "
                         f"ranks={ranks}, batch_size={batch_size}, ema={ema}")
    if bf16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        if verbose:
            print("[train-vae] bf16: this CPU has no native bfloat16 (oneDNN), so training in float32", flush=True)
        bf16 = False
    recipe = dict(preset=preset, colour_path=colour_path, steps=steps, seed=seed, batch_size=batch_size, frames=frames, lr=lr, crop=crop,
                  cell_weight=cell_weight, bright_weight=bright_weight, fg_weight=fg_weight, fg_ring=fg_ring,
                  images=images, image_steps=image_steps, bf16=bf16, ema=ema, log_every=log_every, verbose=verbose,
                  threads=threads if threads is not None or ranks == 1 else max(1, (os.cpu_count() or 1) // ranks))
    return run_local_ranks(_video_rank, ranks, (Path(data_dir), out_path), recipe, "the VAE stage")


def _video_rank(rank: int, world: int, init: str | None, data_dir: Path, out_path: Path,
                recipe: dict) -> StageResult | None:
    """One rank of `train_tiny_vae` (the whole stage when `world` is 1): every rank draws the same step and
    takes its share of the windows; the gradients are summed; rank 0 measures and saves."""
    r = SimpleNamespace(**recipe)
    previous_threads = torch.get_num_threads()
    if r.threads is not None:
        torch.set_num_threads(r.threads)
    if init is not None:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world, timeout=RANK_TIMEOUT)
    start = time.perf_counter()
    try:
        clips = read_clips(data_dir)[0]
        gen = torch.Generator().manual_seed(r.seed)  # windows and order (the same on every rank)
        vae = LTX2VideoVAE(VAE_PRESETS[r.preset], seed=r.seed).train()
        if r.colour_path:
            init_colour_path(vae)
        draw = _windows(clips, r.crop, gen)
        loss_fn = _video_loss_fn(vae, r, rank, world)
        params = list(vae.parameters())
        opt = torch.optim.AdamW(params, lr=r.lr, betas=(0.9, 0.99), weight_decay=0.0)
        sched = _schedule(opt, r.steps)
        averaged = _ema(vae, r.ema) if rank == 0 else None
        losses: list[float] = []
        for step in range(r.steps):
            if step < r.image_steps:  # single frames alone first: edges and colours before motion
                rec, kl = loss_fn(draw(r.images + r.batch_size * r.frames, 1))
            else:
                rec, kl = loss_fn(draw(r.batch_size, r.frames))
                if r.images:  # single frames of other clips through the first-frame path
                    rec_i, kl_i = loss_fn(draw(r.images, 1))
                    rec, kl = rec + rec_i, (kl + kl_i) / 2
            opt.zero_grad(set_to_none=True)
            (rec + KL_WEIGHT * kl).backward()
            term = rec.detach().reshape(1)
            if world > 1:  # the ranks' shares add up to the whole step's gradient
                flat = torch.cat([p.grad.reshape(-1) for p in params] + [term])
                dist.all_reduce(flat)
                for p, g in zip(params, torch.split(flat[:-1], [q.numel() for q in params])):
                    p.grad = g.view_as(p)
                term = flat[-1:]
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            if averaged is not None:
                averaged.update_parameters(vae)
            losses.append(float(term))
            if r.verbose and ((step + 1) % r.log_every == 0 or step + 1 == r.steps):
                recent = losses[-r.log_every:]
                print(f"[train-vae] step {step + 1}/{r.steps} recon {sum(recent) / len(recent):.4f} "
                      f"({time.perf_counter() - start:.0f}s)", flush=True)
        if rank != 0:
            return None
        return _save_video(vae, averaged, clips, losses, r, data_dir, out_path, start)
    finally:
        if init is not None:
            dist.destroy_process_group()
        torch.set_num_threads(previous_threads)


@torch.no_grad()
def latent_stats(vae: LTX2VideoVAE, clips: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each latent channel's (mean, std) over the posterior means of `clips` (float64 sums)."""
    z = torch.cat([vae.encode(torch.stack(clips[i:i + 8])).mode().double() for i in range(0, len(clips), 8)])
    z = z.transpose(0, 1).flatten(1)                                              # (C, all positions)
    return z.mean(1).float(), z.std(1).clamp_min(1e-6).float()


def _save_video(vae, averaged, clips, losses, r, data_dir: Path, out_path: Path, start: float) -> StageResult:
    """Rank 0 after the steps: the average in place of the weights, measured on the held-out clips, the latent
    statistics in its `per_channel_statistics`; saved with config.json beside it."""
    vae.eval()
    if averaged is not None:
        with torch.no_grad():
            for p, a in zip(vae.parameters(), averaged.module.parameters()):
                p.copy_(a)
    mean, std = latent_stats(vae, clips[:STATS_CLIPS])
    stats = vae.per_channel_statistics
    stats.get_buffer("mean-of-means").copy_(mean)
    stats.get_buffer("std-of-means").copy_(std)
    held = _heldout(data_dir)
    figures = reconstruction_figures(vae, held[0]) if held is not None else None
    if r.verbose and figures is not None:
        what = f" (EMA {r.ema} of the weights: saved)" if r.ema else ""
        print(f"[train-vae] held-out clips ({holdout_dir(data_dir)}){what}: {format_figures(figures)}", flush=True)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    config_json = json.dumps(ltx2_vae_config_to_diffusers(vae.config), indent=2)
    _atomic_write(out_path.parent / CONFIG_NAME, lambda p: p.write_text(config_json + "\n"))
    state = {k: v.detach().contiguous() for k, v in vae.state_dict().items()}
    meta = {"format": "pt", "preset": r.preset, "steps": str(r.steps), "seed": str(r.seed),
            "final_recon_loss": f"{losses[-1]:.6f}"}
    if figures is not None:
        meta["heldout_figures"] = json.dumps(figures)
    _atomic_write(out_path, lambda p: save_file(state, str(p), metadata=meta))
    seconds = time.perf_counter() - start
    if r.verbose:
        print(f"[train-vae] saved {out_path} ({seconds:.0f}s)", flush=True)
    return StageResult(out_path, losses, seconds, vae, figures)


# ---------------------------------------------------------------- the audio codec: figures and loss


def stft_loss(y: torch.Tensor, x: torch.Tensor, sizes: tuple[int, ...]) -> torch.Tensor:
    """The vocoder's loss: per STFT size n (Hann window n, hop n / 4) and per row, the spectral convergence
    ||Y| - |X||_F / ||X||_F plus the mean |Y - X| of the magnitudes over the mean |X|; averaged over the rows,
    summed over the sizes; y, x (B, S). Each row normalised by its own target, so a quiet window counts as much
    as a loud one and its level is learnt too. Linear magnitudes on
    purpose: a log-magnitude term with the usual 1e-5 floor (Parallel WaveGAN's) spends the steps silencing the
    bins a pure tone leaves empty and the vocoder never learnt a pitch (measured: one frequency for every note
    after 400 steps, where this loss put all five held-out notes within 0.4 semitone in 100)."""
    loss = y.new_zeros(())
    for n in sizes:
        window = torch.hann_window(n, device=y.device)
        Y = torch.stft(y, n, n // 4, window=window, return_complex=True).abs().flatten(1)  # (B, bins x frames)
        X = torch.stft(x, n, n // 4, window=window, return_complex=True).abs().flatten(1)
        converge = (Y - X).norm(dim=1) / X.norm(dim=1).clamp_min(1e-6)
        magnitude = (Y - X).abs().mean(1) / X.mean(1).clamp_min(1e-6)
        loss = loss + (converge + magnitude).mean()
    return loss


def codec_figures(codec, mels: torch.Tensor, sounds: list, captions: list[str]) -> dict:
    """Per held-out clip, the dominant pitch (`demo_av.estimate_pitch`) of its own track and of the round trip
    through the codec (its log-mel `mels` (N, 2, T, M) encoded, decoded, vocoded), in Hz, the difference in
    semitones, and whether the round trip sounds as the clip's caption says (`demo_av.check_sound`: audible, the
    colour's note within a semitone; None for a caption that is not a demo caption)."""
    with torch.no_grad():
        waves = codec.decode(codec.vae.encode(mels)).numpy()                         # (N, 2, S) at out_rate
    out = {"clip_hz": [], "codec_hz": [], "error_st": [], "ok": []}
    for (wave, rate), wave_out, caption in zip(sounds, waves, captions):
        a, b = estimate_pitch(wave, rate), estimate_pitch(wave_out, codec.out_rate)
        out["clip_hz"].append(round(a["pitch_hz"], 1))
        out["codec_hz"].append(round(b["pitch_hz"], 1))
        out["error_st"].append(round(b["pitch_midi"] - a["pitch_midi"], 2))
        try:
            out["ok"].append(check_sound(wave_out, codec.out_rate, caption)["ok"])
        except ValueError:
            out["ok"].append(None)
    return out


def format_codec_figures(fig: dict) -> str:
    worst = max(abs(e) for e in fig["error_st"])
    return (f"pitch through the codec within {worst:.2f} semitone of the clip's; {sum(bool(k) for k in fig['ok'])}/"
            f"{len(fig['ok'])} sound as their captions say; per clip (Hz): "
            + ", ".join(f"{a:g} -> {b:g} ({e:+.2f} st)" for a, b, e in zip(
                fig["clip_hz"], fig["codec_hz"], fig["error_st"])))


# ---------------------------------------------------------------- the audio codec: the stage


def train_tiny_codec(data_dir, out_dir, *, force: bool = False, verbose: bool = True, **recipe) -> Path:
    """Train the audio codec of the LTX-2 preset `recipe["preset"]` on the clips under `data_dir` and save it to
    the folder `out_dir` unless `out_dir/vocoder` exists (or `force`); returns `out_dir`. The recipe:
    `train_tiny_codec_result`'s keywords."""
    out_dir = Path(out_dir)
    if (out_dir / "vocoder").is_dir() and not force:
        if verbose:
            print(f"[train-audio] {out_dir} exists, skipping")
        return out_dir
    return train_tiny_codec_result(data_dir, out_dir, verbose=verbose, **recipe).path


def train_tiny_codec_result(data_dir, out_dir, *, preset: str, steps: int = 300, vocoder_steps: int = 400,
                            batch_size: int = 8, lr: float = 2e-3, vocoder_lr: float = 3e-4,
                            segment_frames: int | None = None, seed: int = 0, threads: int | None = None,
                            verbose: bool = True, log_every: int = 100) -> StageResult:
    """`train_tiny_codec` without the skip: trains the audio codec of the LTX-2 preset `preset` (`presets.AUDIO`: audio VAE + vocoder) on the tracks
    of the clips under `data_dir` and save it to the folder `out_dir` (audio_vae/ + vocoder/, diffusers'
    layout, which `load_codec(out_dir)` reads) and returns the losses, the codec and the held-out figures.
    `prepare.tiny_audio`'s keywords (`TinyAudioStage`): `steps` of the audio VAE (AdamW at
    `lr`, L1 on the log-mel of `batch_size` random clips, + 1e-4 KL), then `vocoder_steps` of the vocoder (AdamW at `vocoder_lr`, betas (0.8, 0.99) as HiFi-GAN's, on the
    clips' own log-mels of `batch_size` random clips, over one random window of `segment_frames` mel frames a
    step (None: the whole clips), `stft_loss` against their waveforms resampled to the vocoder's rate over that
    window), both with `_schedule`; `threads` torch threads (None: torch's). The vocoder trains on the clips'
    log-mels, not the audio VAE's reconstructions (what the pipeline vocodes): the reconstructions' frame
    levels are a noisy copy of the clips' (a few dB a frame after this short fit), and a vocoder fit on them
    learnt to ignore the level (measured on an earlier demo sound whose loudness followed the motion: the held-out
    clips' loudness trends through the codec +1.9 and +0.3 dB for +7.6 and -7.6; on the clips' own log-mels +3.9
    and -0.9, the pitch as close: docs/demo_recipe.md)."""
    out_dir = Path(out_dir)
    if preset not in AUDIO:
        raise KeyError(f"unknown LTX-2 preset {preset!r}; valid: {', '.join(AUDIO)}")
    config = AUDIO[preset]
    if not config.tiny:
        raise ValueError(f"preset {preset!r}: a released model's codec is not trained here (its weights are "
                         "Lightricks'); the stage trains a tiny preset's")
    if segment_frames is not None and segment_frames < 2:
        raise ValueError(f"segment_frames={segment_frames}: the vocoder's training window needs at least 2 mel "
                         "frames (None: whole clips)")
    if min(steps, vocoder_steps, batch_size) < 1 or not (lr > 0 and vocoder_lr > 0):
        raise ValueError(f"need steps, vocoder_steps, batch_size >= 1 and rates > 0; got steps={steps}, "
                         f"vocoder_steps={vocoder_steps}, batch_size={batch_size}, lr={lr}, vocoder_lr={vocoder_lr}")
    previous_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _train_codec(Path(data_dir), out_dir, config, SimpleNamespace(
            preset=preset, steps=steps, vocoder_steps=vocoder_steps, batch_size=batch_size, lr=lr,
            vocoder_lr=vocoder_lr, segment_frames=segment_frames, seed=seed, verbose=verbose, log_every=log_every))
    finally:
        torch.set_num_threads(previous_threads)


def read_sounds(data_dir) -> tuple[list[tuple[np.ndarray, int]], list[str]]:
    """((audio (C, S) float32, its rate), caption) of every video under `data_dir` (read as a dataset folder is):
    the sound of `read_clips`' clips without decoding the pictures (the codec stage's input; the pictures'
    decoding was most of its reading time). A clip without sound or one that cannot be read is a `ValueError` naming it."""
    sounds, captions = [], []
    for path in _videos(data_dir):
        try:
            got = audio_mod.clip_audio(path)
        except MediaError as exc:
            raise ValueError(f"{path}: cannot be read ({exc.reason})") from exc
        if got is None:
            raise ValueError(f"{path}: no audio stream; the audio codec trains on clips with sound")
        sounds.append(got)
        captions.append(_caption(path))
    return sounds, captions


def _log_mels(sounds: list, mel: MelConfig) -> torch.Tensor:
    """(N, 2, T, M): each track's log-mel as the codec reads it (`mel.waveform_to_mel`: stereo, its rate)."""
    return torch.cat([waveform_to_mel(torch.from_numpy(w)[None].float(), rate, mel) for w, rate in sounds])


VOCODER_CONTEXT = 4  # mel frames either side that a demo vocoder's output over a frame depends on (`vocode_frames`)


def vocode_frames(vocoder: LTX2Vocoder, mel: torch.Tensor, start: int, length: int) -> torch.Tensor:
    """The vocoder's waveform over mel frames [start, start + length) of `mel` (B, C, T, M), as vocoding the
    whole of `mel` gives it: the frames with up to `VOCODER_CONTEXT` frames of context either side (its
    receptive field: conv_pre's 7 frames, the transposed conv's 2 frames a sample, the res blocks' few samples;
    the clip's own edge where it is nearer) -> (B, out_channels, length * hop). How the stage trains the vocoder
    on short segments (HiFi-GAN trains on segments too), each step a fraction of a whole clip's cost."""
    lo, hi = max(0, start - VOCODER_CONTEXT), min(mel.shape[2], start + length + VOCODER_CONTEXT)
    hop = vocoder.config.hop
    return vocoder(mel[:, :, lo:hi])[:, :, (start - lo) * hop:(start - lo + length) * hop]


def _train_codec(data_dir: Path, out_dir: Path, config, r) -> StageResult:
    from video_dit.families.ltx2.codec import LTX2AudioCodec

    start = time.perf_counter()
    sounds, _ = read_sounds(data_dir)
    vae = LTX2AudioVAE(config.vae, seed=r.seed).train()
    mel_config = MelConfig.from_audio_vae(config.vae)
    mels = _log_mels(sounds, mel_config)                                          # (N, 2, T, M)
    gen = torch.Generator().manual_seed(r.seed)
    losses = _fit(vae.parameters(), r.steps, r.lr, (0.9, 0.99), r, "audio VAE", start,
                  lambda: _audio_vae_loss(vae, mels[torch.randint(len(mels), (r.batch_size,), generator=gen)]))
    vae.eval()
    with torch.no_grad():  # the per-channel statistics of the mean latents' tokens: the DiT's normalisation
        tokens = torch.cat([audio_tokens(vae.moments(mels[i:i + 32])[0]) for i in range(0, STATS_CLIPS, 32)])
        stats = vae.per_channel_statistics
        stats.get_buffer("mean-of-means").copy_(tokens.mean((0, 1)))
        stats.get_buffer("std-of-means").copy_(tokens.std((0, 1)).clamp_min(1e-6))
    vocoder = LTX2Vocoder(config.vocoder, seed=r.seed + 1).train()
    rate, hop = config.vocoder.output_sampling_rate, config.vocoder.hop
    waves = torch.stack([resample(torch.from_numpy(w).float().mean(0), sr, rate) for w, sr in sounds])  # (N, S)
    frames = min(mels.shape[2], waves.shape[1] // hop)                # mel frames with a whole target span
    length = min(r.segment_frames or frames, frames)
    sizes = tuple(n for n in (128, 256, 512) if n <= length * hop)

    def vocoder_loss():  # `length` frames of `batch_size` random clips, one random start for the batch
        idx = torch.randint(len(mels), (r.batch_size,), generator=gen)
        a = int(torch.randint(frames - length + 1, (), generator=gen))
        y = vocode_frames(vocoder, mels[idx], a, length)                          # (B, C, length * hop)
        x = waves[idx, None, a * hop:(a + length) * hop].expand(-1, y.shape[1], -1)  # every channel: the mix
        return stft_loss(y.flatten(0, 1), x.flatten(0, 1), sizes)

    losses += _fit(vocoder.parameters(), r.vocoder_steps, r.vocoder_lr, (0.8, 0.99), r, "vocoder", start,
                   vocoder_loss)
    codec = LTX2AudioCodec(vae, vocoder.eval())
    held = _heldout_folder(data_dir)
    held = None if held is None else read_sounds(held)
    figures = codec_figures(codec, _log_mels(held[0], mel_config), *held) if held is not None else None
    if r.verbose and figures is not None:
        print(f"[train-audio] held-out clips ({holdout_dir(data_dir)}): {format_codec_figures(figures)}", flush=True)
    meta = {"format": "pt", "preset": r.preset, "steps": str(r.steps), "vocoder_steps": str(r.vocoder_steps),
            "seed": str(r.seed)}
    if figures is not None:
        meta["heldout_figures"] = json.dumps(figures)
    for part, state, config_json in (
            ("audio_vae", audio_vae_to_diffusers(vae.state_dict()), audio_vae_config_to_diffusers(vae.config)),
            ("vocoder", vocoder_to_diffusers(vocoder.state_dict()), vocoder_config_to_diffusers(vocoder.config))):
        folder = out_dir / part
        folder.mkdir(parents=True, exist_ok=True)
        text = json.dumps(config_json, indent=2) + "\n"
        _atomic_write(folder / CONFIG_NAME, lambda p, text=text: p.write_text(text))
        tensors = {k: v.detach().contiguous() for k, v in state.items()}
        _atomic_write(folder / WEIGHTS_NAME, lambda p, tensors=tensors: save_file(tensors, str(p), metadata=meta))
    seconds = time.perf_counter() - start
    if r.verbose:
        print(f"[train-audio] saved {out_dir} ({seconds:.0f}s)", flush=True)
    return StageResult(out_dir, losses, seconds, codec, figures)


def _audio_vae_loss(vae: LTX2AudioVAE, mel: torch.Tensor) -> torch.Tensor:
    """L1 between the log-mel (B, 2, T, M) and its reconstruction from the posterior mean, + KL_WEIGHT x KL."""
    mean, logvar = vae.moments(mel)
    recon = vae.decoder(mean)                                                     # (B, 2, ~T, ~M)
    frames, bins = min(recon.shape[2], mel.shape[2]), mel.shape[3]
    kl = 0.5 * (mean.pow(2) + logvar.exp() - 1.0 - logvar).mean()
    return (recon[:, :, :frames, :bins] - mel[:, :, :frames]).abs().mean() + KL_WEIGHT * kl


def _fit(params, steps: int, lr: float, betas, r, what: str, start: float, loss_fn) -> list[float]:
    """`steps` AdamW steps of `loss_fn()` (gradients clipped to norm 1, `_schedule`); the losses."""
    params = list(params)
    opt = torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=0.0)
    sched = _schedule(opt, steps)
    losses = []
    for step in range(steps):
        loss = loss_fn()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
        if r.verbose and ((step + 1) % r.log_every == 0 or step + 1 == steps):
            recent = losses[-r.log_every:]
            print(f"[train-audio] {what} step {step + 1}/{steps} loss {sum(recent) / len(recent):.4f} "
                  f"({time.perf_counter() - start:.0f}s)", flush=True)
    return losses
