"""Held-out validation loss (`train.validation_config`, ai-toolkit's keys, extended to video).

    items:   validation_items (an image or clip + prompt each; read like the first dataset's items)
             + each dataset's `validation_split` share of its files (seeded by train.seed)
    cache:   the same latent / first-frame / text caches as training (built with them, once)
    loss:    for item k and sigma s: t = 1000 s, noise_k ~ N(0, 1) from seed + k (the same at every
             validation, on every rank, after every resume), then the training loss at (t, noise_k):
             conditioning, i2v loss mask and weighting as in `Trainer.loss_at`
    report:  val_loss@<s> = mean over items, val_loss = mean over sigmas (metrics.jsonl); for a model with
             sound also each stream's, val_loss_video and val_loss_audio (the audio noise fixed as the video's,
             from its own seed; the audio stream at the same sigma)

Data parallel: item k belongs to data-parallel rank k % dp_size; a sequence-parallel group computes
its items together (the DiT's forward is a collective there), and under ZeRO-3 every rank runs the
same number of forwards (parameter gathers are collectives too), so a rank short of items repeats
its last one with weight 0. The sums are all-reduced once; only the first rank of each sequence
group contributes. The figures depend on the weights only: a resumed run reports exactly what the
uninterrupted run reports at the same step.
"""

from __future__ import annotations

import dataclasses
import random
import zlib
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from video_dit import media
from video_dit.data import DataError, DataWarning, ScanResult, collate, scan_dataset


def validation_datasets(datasets) -> list[int]:
    return [i for i, d in enumerate(datasets) if d.validation_split > 0]


def split_scan(scan: ScanResult, datasets, seed: int) -> tuple[ScanResult, list]:
    """(training scan, held-out items): each dataset's `validation_split` share of its files (at
    least one file when the share is > 0), chosen by `seed`, leaves the training scan."""
    held: set[str] = set()
    for i in validation_datasets(datasets):
        files = sorted({it.path for it in scan.items if it.dataset == i})
        k = len(files) if datasets[i].validation_split >= 1.0 else max(1, round(datasets[i].validation_split * len(files)))
        held.update(random.Random(f"validation-split:{seed}:{i}").sample(files, min(k, len(files))))
    train = [it for it in scan.items if it.path not in held]
    val = [dataclasses.replace(it, caption_dropout_rate=0.0, num_repeats=1) for it in scan.items if it.path in held]
    if not train:
        raise DataError("every item is held out for validation (validation_split); no training item left")
    return dataclasses.replace(scan, items=train), val


def item_scan(cfg, datasets, divisibility: int, i2v_mode: str | None, verbose: bool, audio: bool = False) -> list:
    """DataItems of `validation_config.validation_items`: each file read with the first training
    dataset's settings (at `resolution` / `num_frames` when given) and captioned with its prompt; in a job
    whose model generates sound (`audio`), a clip's track too, as that dataset reads it (so the item's
    audio loss is validated). A missing or unreadable file is skipped with a warning naming it."""
    base = next((d for d in datasets if d.validation_split < 1.0), datasets[0])
    items = []
    for i, entry in enumerate(cfg.validation_items):
        where = f"train.validation_config.validation_items[{i}]"
        path = Path(entry.image_path) if entry.image_path else None
        if path is None or not path.is_file():
            if verbose:
                warnings.warn(f"{where}: skipped: {entry.image_path or '(no image_path)'}: no such file",
                              DataWarning, stacklevel=2)
            continue
        is_video = path.suffix.lower() in media.VIDEO_EXTS
        if not is_video and path.suffix.lower() not in media.IMAGE_EXTS:
            if verbose:
                warnings.warn(f"{where}: skipped: {path}: not an image or video "
                              f"({' '.join(media.VIDEO_EXTS + media.IMAGE_EXTS)})", DataWarning, stacklevel=2)
            continue
        if not is_video and i2v_mode is not None and base.do_i2v:
            if verbose:
                warnings.warn(f"{where}: skipped: {path}: an image has no frame after the first to validate "
                              "an image-to-video job on; give a clip", DataWarning, stacklevel=2)
            continue
        ds = dataclasses.replace(base, folder_path=str(path.parent), caption_dropout_rate=0.0, num_repeats=1,
                                 resolution=[cfg.resolution or base.resolution[0]],
                                 num_frames=(cfg.num_frames or base.num_frames) if is_video else 1)
        ds.config_path, ds.validated = where, True
        try:
            found = scan_dataset(ds, divisibility, dataset_index=base_index(datasets, base), verbose=False,
                                 files=[path.absolute()], audio=audio)
        except DataError:
            found = None
        if found is None or not found.items:
            if verbose:
                reason = "; ".join(r for _, r in found.skipped) if found is not None else "unreadable"
                warnings.warn(f"{where}: skipped: {path}: {reason or 'unreadable'}", DataWarning, stacklevel=2)
            continue
        items.extend(dataclasses.replace(it, caption=entry.prompt) for it in found.items)
    return items


def base_index(datasets, base) -> int:
    return next(i for i, d in enumerate(datasets) if d is base)


def collect(process, scan: ScanResult, divisibility: int, verbose: bool,
            audio: bool = False) -> tuple[ScanResult, ScanResult | None]:
    """(training scan, validation scan or None) of a job; DataError when validation is configured
    but no item is usable. `audio`: the job's model generates sound (`item_scan`)."""
    cfg = process.train.validation_config
    train, held = split_scan(scan, process.datasets, process.train.seed)
    if cfg is None:
        return train, None
    any_i2v = any(d.do_i2v for d in process.datasets)
    items = item_scan(cfg, process.datasets, divisibility, process.i2v_mode if any_i2v else None, verbose,
                      audio) + held
    if not items:
        raise DataError("train.validation_config: no usable validation item (every validation_items file is "
                        "missing or unreadable and no dataset has validation_split > 0); fix the paths or "
                        "remove validation_config")
    return train, ScanResult(items=items, skipped=[], folders=["validation"])


class Validator:
    """The validation set of a run (cached) and its losses; see the module docstring."""

    def __init__(self, cfg, dataset, *, dp_rank: int, dp_size: int, sp_rank: int, collective: bool, device):
        self.cfg, self.dataset, self.device = cfg, dataset, device
        self.sigmas = [float(s) for s in cfg.validation_sigmas]
        self.dp_rank, self.dp_size, self.sp_rank, self.collective = dp_rank, dp_size, sp_rank, collective
        self.mine = list(range(dp_rank, len(dataset), dp_size))  # this data-parallel rank's items
        self.slots = -(-len(dataset) // dp_size) if collective else len(self.mine)

    def __len__(self) -> int:
        return len(self.dataset)

    def due(self, step: int, total: int) -> bool:
        return step == 0 or step == total or step % self.cfg.validate_every_n_steps == 0

    def noise(self, k: int, shape, stream: str = "video") -> torch.Tensor:
        """Item k's fixed noise (1, C, F', h, w) of `stream`: the video's from seed + k, the audio's from a
        seed of its own, whatever the rank or step."""
        seed = self.cfg.seed + k if stream == "video" else zlib.crc32(f"{self.cfg.seed}:{k}:{stream}".encode())
        return torch.randn((1, *shape), generator=torch.Generator("cpu").manual_seed(seed))

    @torch.no_grad()
    def run(self, module, loss_at, suffix: str = "") -> dict[str, float]:
        """{"val_loss<suffix>": mean, "val_loss<suffix>@<sigma>": ...}; every rank must call.
        `loss_at(batch, t, noise, audio_noise=, parts=)` is the trainer's loss at given t (B,) and noise."""
        streams = ("video", "audio")
        # per sigma: loss sum, item count, each stream's loss sum
        sums = torch.zeros(len(self.sigmas), 2 + len(streams), dtype=torch.float64)
        was_training = module.training
        module.eval()
        try:
            for slot in range(self.slots):
                real = slot < len(self.mine)
                k = self.mine[slot] if real else (self.mine[-1] if self.mine else 0)
                sample = self.dataset[k]
                batch = collate([sample])
                batch["do_i2v"] = torch.tensor([self.dataset.item(k).conditioned])  # stills: as t2v
                noise = self.noise(k, sample["latents"].shape)
                extra = {"audio_noise": self.noise(k, sample["audio_latents"].shape, "audio")} \
                    if "audio_latents" in sample else {}
                if "first_frame_latents" in sample:  # a conditioning's own noise (MiniMax H3's keyframe rows)
                    extra["cond_noise"] = self.noise(k, sample["first_frame_latents"].shape, "keyframe")
                for j, s in enumerate(self.sigmas):
                    parts: dict = {}
                    loss = loss_at(batch, torch.tensor([1000.0 * s]), noise, parts=parts, **extra)
                    if real and self.sp_rank == 0:
                        sums[j, 0] += float(loss)
                        sums[j, 1] += 1.0
                        for i, name in enumerate(streams):
                            sums[j, 2 + i] += parts.get(name, 0.0)
        finally:
            module.train(was_training)
        reduced = sums.to(self.device)
        dist.all_reduce(reduced)
        reduced = reduced.cpu()
        per = {s: float(reduced[j, 0] / reduced[j, 1]) for j, s in enumerate(self.sigmas)}
        out = {f"val_loss{suffix}": sum(per.values()) / len(per)}
        out.update({f"val_loss{suffix}@{s:g}": v for s, v in per.items()})
        if "audio_latents" in self.dataset[0]:  # a model with sound: each stream's mean over the sigmas
            for i, name in enumerate(streams):
                out[f"val_loss_{name}{suffix}"] = float((reduced[:, 2 + i] / reduced[:, 1]).mean())
        return out


__all__ = ["Validator", "collect", "split_scan"]
