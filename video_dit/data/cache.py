"""On-disk caches of latents and text embeds, built once (split across ranks), read every step.

Layout (next to the data, or under `cache_dir`), following ai-toolkit's `_latent_cache/` convention:
  <root>/_latent_cache/<file name>_<item key>_<space key>.safetensors   whatever `encode_fn` returned
                                                                        (e.g. `latents`, `first_frame_latents`)
  <root>/_latent_cache/<file name>_<item key>.skip.json                 a file that failed to decode
  <root>/_text_cache/<caption key>_<space key>.safetensors              `text_embeds` (Lt, D)
                                          (a conditioner that presents a clip's first frame with its caption: the
                                          caption key hashes the caption and the clip's item key, `item_text_path`)
The item key hashes the file identity (absolute path, size, mtime), the frame selection, the
bucket/resize/crop and `do_i2v`, and in a job with sound whether the item trains sound and its
audio span (the rate, channels, audio codec and the datasets' fps are the space's); the space key
hashes `space_version` (`latent_space`: the preset, the
VAE weights' identity, its dtype and what is stored; the text key uses `text_space_version`, default
the same string; `text_space`: the preset, the text encoder's weights, tokenizer, dtype, quantization).
Touching or replacing a file changes its key, so exactly that entry is recomputed; old entries are
left in place (another job with other settings may still use them). Every write is atomic: a temp
file in the same folder (`.<name>.tmp<pid>`), then `os.replace`; the temp files of a run that was
killed mid-write are removed before the next start (`remove_partial_files`, run by the validation
that precedes the ranks).

The empty prompt is cached in every root: caption dropout happens per step in `CachedDataset`
(the item's caption is swapped for "" by a generator seeded with (seed, epoch, index)), so it is
random across epochs yet exact on resume.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import random
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from video_dit import media
from video_dit.data.dataset import DataError, DataItem, DataWarning, ScanResult
from video_dit.data.frames import load_item_pixels
from video_dit.models.layouts import preset_name

LATENT_DIR = "_latent_cache"
TEXT_DIR = "_text_cache"


# A caption's text cache entry: whatever its family's `Training.text_entry` names, each (Lt, D) (Wan's
# `text_embeds`; HunyuanVideo 1.5's and its ByT5 `glyph_embeds` (Lg, Dg), Lg = 0 without quoted text; LTX-2's
# video context as `text_embeds` and its `audio_context`). A sample carries their names under TEXT_NAMES: the
# batch keeps them as lists (captions of several lengths).
TEXT_NAMES = "text_keys"


def _sha(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode("utf-8")).hexdigest()


def item_key(item: DataItem) -> str:
    """16 hex digits over everything that decides the pixels fed to the VAE (and, for an item of a job
    with sound, the track fed to the audio encoder: whether it has one, its span)."""
    parts = [item.path, item.size, item.mtime_ns, item.kind, list(item.frames), list(item.bucket),
             list(item.resize), list(item.crop), item.do_i2v]
    if item.audio_span is not None or item.has_audio:  # (keys of jobs without sound are as they were)
        span = item.audio_span
        parts += [item.has_audio, None if span is None else [span.start, span.duration]]
    return _sha(parts)[:16]


def source_identity(source: str | os.PathLike, subfolder: str | None = None) -> str:
    """A string naming a weights source and changing whenever a file its loader reads changes (for
    the space strings of the caches): `preset:NAME` as is; a file: its resolved path, size and mtime,
    and those of a `config.json` beside it (the tiny VAE keeps its latent mean / std there); a folder
    (its `subfolder` when it has one, e.g. `vae/` of a diffusers model folder): a hash over every
    file under it (relative path, size, mtime). A path that does not exist is named as given."""
    src = str(source)
    path = Path(src)
    if preset_name(src) is not None or not path.exists():
        return src
    if path.is_dir():
        if subfolder is not None and (path / subfolder).is_dir():
            path = path / subfolder
        files = sorted(f for f in path.rglob("*") if f.is_file())
        stats = [[str(f.relative_to(path)), f.stat().st_size, f.stat().st_mtime_ns] for f in files]
        return f"{path.resolve()}/:{_sha(stats)[:16]}"
    files = [path] + [c for c in (path.parent / "config.json",) if c.is_file() and c != path]
    return ";".join(f"{f.resolve()}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files)


def latent_space(preset: str, vae_source: str, vae_dtype, stores: str = "latents") -> str:
    """The latent cache's space string: the preset, the VAE weights (`source_identity`), the dtype
    the VAE encoded in, and what is stored besides the latents (`stores`, e.g. the i2v mode)."""
    return f"preset={preset};vae={source_identity(vae_source, 'vae')};vae_dtype={vae_dtype};stores={stores}"


# What a text entry holds, by version; part of the text space, so an entry of another layout is never read.
# v2: LTX-2's video context is stored as `text_embeds` (6457217; v1 entries of an LTX-2 job hold it as
# `video_context`, which today's reader does not know).
TEXT_FORMAT = "video_dit.text.v2"


def text_space(preset: str, te_source: str, tokenizer: str | None, te_dtype, quantization: str | None) -> str:
    """The text cache's space string: the entry layout (`TEXT_FORMAT`), the preset, the text encoder weights,
    its tokenizer (a folder, or None: the one beside a model folder's `text_encoder/`, or the preset's), the
    dtype it ran in and its quantization (None, "qfloat8", "qint8")."""
    if tokenizer is None:
        tokenizer = str(Path(te_source) / "tokenizer") if Path(te_source).is_dir() else "none"
    return (f"format={TEXT_FORMAT};preset={preset};te={source_identity(te_source, 'text_encoder')};"
            f"tokenizer={source_identity(tokenizer)};te_dtype={te_dtype};quant={quantization}")


def space_key(space_version: str) -> str:
    return _sha(["space", space_version])[:8]


def cache_root_of(item: DataItem, cache_dir=None) -> Path:
    """Where `_latent_cache/` and `_text_cache/` of `item` live (`cache_dir` overrides its dataset's)."""
    return Path(cache_dir) if cache_dir is not None else Path(item.cache_root)


def latent_path(item: DataItem, space_version: str, cache_dir=None) -> Path:
    name = f"{Path(item.path).name}_{item_key(item)}_{space_key(space_version)}.safetensors"
    return cache_root_of(item, cache_dir) / LATENT_DIR / name


def skip_path(item: DataItem, cache_dir=None) -> Path:
    return cache_root_of(item, cache_dir) / LATENT_DIR / f"{Path(item.path).name}_{item_key(item)}.skip.json"


def caption_key(caption: str, keyframe: str | None = None) -> str:
    """16 hex digits of a caption, and of the clip whose first frame a conditioner presents with it (`keyframe`: its
    `item_key`, which hashes what decides that frame's pixels); None: the caption alone."""
    return _sha(["caption", caption] if keyframe is None else ["caption", caption, "keyframe", keyframe])[:16]


def text_path(root, caption: str, text_space_version: str, keyframe: str | None = None) -> Path:
    return Path(root) / TEXT_DIR / f"{caption_key(caption, keyframe)}_{space_key(text_space_version)}.safetensors"


def item_text_path(item: DataItem, caption: str, text_space_version: str, cache_dir=None,
                   keyframe_text: bool = False) -> Path:
    """The text entry `item` trains with for `caption` (its own or the dropout's ""): keyed on the item's first frame
    as well when the conditioner presents it (`keyframe_text`, a job whose family's conditioner reads the keyframe:
    `Family.prompt_images`) and the item is trained on it (`DataItem.conditioned`), else the caption's alone."""
    keyframe = item_key(item) if keyframe_text and item.conditioned else None
    return text_path(cache_root_of(item, cache_dir), caption, text_space_version, keyframe)


def text_cached_any(root, caption: str) -> bool:
    """Whether `caption` has cached embeds under `root` for any text space version (inspect-data)."""
    folder = Path(root) / TEXT_DIR
    return folder.is_dir() and any(folder.glob(f"{caption_key(caption)}_*.safetensors"))


def _valid_entry(path: Path) -> bool:
    """The file exists and its safetensors header parses (cheap: the tensors are not read)."""
    if not path.is_file():
        return False
    try:
        with safe_open(str(path), framework="pt") as f:
            return len(list(f.keys())) > 0
    except (SafetensorError, OSError, ValueError):
        return False


def _atomic_save(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(tmp), metadata=metadata)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def _atomic_write_text(text: str, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


_TMP_RE = re.compile(r"^\..+\.tmp(\d+)$")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def remove_partial_files(scan: ScanResult, cache_dir=None) -> tuple[int, int]:
    """Remove the temp files (`.<name>.tmp<pid>`) that cache writes of a killed run left in the
    `_latent_cache/` and `_text_cache/` folders of `scan`, when their writer (the pid in the name)
    is no longer a live process on this machine; returns (files, bytes) removed. Call it before
    any rank starts (a live writer's file is never touched, but on another node a pid means nothing)."""
    removed, size = 0, 0
    roots = {cache_root_of(it, cache_dir) for it in scan.items}
    for folder in sorted(r / sub for r in roots for sub in (LATENT_DIR, TEXT_DIR)):
        if not folder.is_dir():
            continue
        for f in folder.iterdir():
            m = _TMP_RE.match(f.name)
            if m and f.is_file() and not _pid_alive(int(m.group(1))):
                try:
                    n = f.stat().st_size
                    f.unlink()
                except FileNotFoundError:  # removed meanwhile
                    continue
                removed, size = removed + 1, size + n
    return removed, size


@dataclass
class CacheReport:
    """What one rank did: `hits`/`misses` count latent entries (a miss is one `encode_fn` call),
    `text_hits`/`text_misses` count captions (misses were sent to `text_fn`), `skipped` lists the
    files that failed to decode on this rank, `(path, reason)`."""

    hits: int = 0
    misses: int = 0
    skipped: list[tuple[str, str]] = field(default_factory=list)
    text_hits: int = 0
    text_misses: int = 0
    rank: int = 0
    world_size: int = 1

    @property
    def hit_ratio(self) -> float:
        total = self.hits + self.misses + len(self.skipped)
        return self.hits / total if total else 1.0


def _unique_latent_jobs(scan: ScanResult, space_version: str, cache_dir) -> list[tuple[Path, DataItem]]:
    jobs = {}
    for item in scan.items:
        jobs.setdefault(latent_path(item, space_version, cache_dir), item)
    return sorted(jobs.items(), key=lambda kv: str(kv[0]))


def _text_jobs(scan: ScanResult, text_space_version: str, cache_dir) -> list[tuple[Path, str]]:
    jobs = {}
    for item in scan.items:
        root = cache_root_of(item, cache_dir)
        for caption in (item.caption, ""):
            jobs.setdefault(text_path(root, caption, text_space_version), caption)
    return sorted(jobs.items(), key=lambda kv: str(kv[0]))


def _keyframe_text_jobs(scan: ScanResult, text_space_version: str, cache_dir) -> list[tuple[DataItem, list]]:
    """Per conditioned item (`DataItem.conditioned`), its (path, caption) entries presented with its first frame."""
    jobs = {}
    for item in scan.items:
        if item.conditioned:
            entries = [(item_text_path(item, c, text_space_version, cache_dir, True), c) for c in (item.caption, "")]
            jobs.setdefault(str(entries[0][0]), (item, entries))
    return [jobs[k] for k in sorted(jobs)]


def build_cache(scan: ScanResult, encode_fn: Callable[[torch.Tensor], dict[str, torch.Tensor]],
                text_fn: Callable[[list[str]], list[torch.Tensor]], rank: int = 0, world_size: int = 1,
                cache_dir=None, *, space_version: str, text_space_version: str | None = None,
                barrier: Callable[[], None] | None = None, text_batch_size: int = 16,
                verbose: bool = True, audio_fn: Callable[[DataItem], dict[str, torch.Tensor]] | None = None,
                keyframe_text_fn: Callable[[list[str], torch.Tensor], list] | None = None) -> CacheReport:
    """Compute the missing latent and text entries of `scan`; this rank does entries `rank::world_size`.

    `encode_fn(video)`: `video` is `(1, 3, F, H, W)` float32 in [-1, 1] on CPU; returns a dict of
    tensors with a leading batch dim of 1 (e.g. `latents` `(1, C, F', h, w)`, and with `do_i2v`
    `first_frame_latents`); every key is stored, without the batch dim. `text_fn(captions)` returns
    per caption one `(Lt, D)` tensor (stored as `text_embeds`) or a dict of such tensors (the family's
    names; HunyuanVideo 1.5: `text_embeds` and `glyph_embeds`, which may have 0 rows). `audio_fn(item)`
    (a job with sound): the item's audio entries, with the same leading batch dim (`audio_latents`, and
    `has_audio`), stored in the same entry. `keyframe_text_fn(captions, first frame (3, H, W) in [-1, 1])` (a
    conditioner that presents a clip's first frame with its caption: MiniMax H3): per conditioned item, its
    caption and the dropout's "" encoded with its first frame, each entry as `text_fn`'s, keyed on the item too
    (`item_text_path`; read back by `CachedDataset(keyframe_text=True)`). `cache_dir` overrides every dataset's own
    cache root. A file whose pixels or track fail to decode (`MediaError`) is recorded as skipped (a `.skip.json`
    every rank reads); other errors propagate. `barrier` (e.g. `torch.distributed.barrier`) is called at the end so
    that every rank sees every entry before building its `CachedDataset`.
    """
    text_space_version = space_version if text_space_version is None else text_space_version
    report = CacheReport(rank=rank, world_size=world_size)
    jobs = _unique_latent_jobs(scan, space_version, cache_dir)[rank::world_size]
    for n, (path, item) in enumerate(jobs):
        if _valid_entry(path):
            report.hits += 1
            continue
        marker = skip_path(item, cache_dir)
        if marker.is_file():
            report.skipped.append((item.path, json.loads(marker.read_text(encoding="utf-8"))["reason"]))
            continue
        try:
            pixels = load_item_pixels(item)  # (F, 3, H, W)
            with torch.no_grad():
                sound = audio_fn(item) if audio_fn is not None else {}
        except media.MediaError as exc:
            report.skipped.append((item.path, exc.reason))
            _atomic_write_text(json.dumps({"path": item.path, "reason": exc.reason}), marker)
            if verbose:
                warnings.warn(f"{item.path}: skipped at caching: {exc.reason}", DataWarning, stacklevel=2)
            continue
        with torch.no_grad():
            out = encode_fn(pixels.permute(1, 0, 2, 3).unsqueeze(0))  # (1, 3, F, H, W)
        if not isinstance(out, dict) or not out:
            raise TypeError(f"encode_fn must return a non-empty dict of tensors, got {type(out).__name__}")
        out = {**out, **sound}
        for key, t in out.items():
            if not isinstance(t, torch.Tensor) or t.ndim < 1 or t.shape[0] != 1:
                raise ValueError(f"encode_fn returned {key!r} with shape {getattr(t, 'shape', None)}; "
                                 f"expected a tensor with a leading batch dim of 1")
        meta = {"path": item.path, "bucket": json.dumps(item.bucket), "frames": json.dumps(item.frames),
                "space_version": space_version, "format": "video_dit.latents.v1"}
        _atomic_save({k: t[0] for k, t in out.items()}, path, meta)
        report.misses += 1
        if verbose and (n + 1) % 50 == 0:
            print(f"cache: rank {rank}: {n + 1}/{len(jobs)} latent entries checked", flush=True)

    text_jobs = [(p, c) for p, c in _text_jobs(scan, text_space_version, cache_dir)[rank::world_size]]
    todo = []
    for path, caption in text_jobs:
        if _valid_entry(path):
            report.text_hits += 1
        else:
            todo.append((path, caption))
    for i in range(0, len(todo), text_batch_size):
        chunk = todo[i:i + text_batch_size]
        with torch.no_grad():
            embeds = text_fn([c for _, c in chunk])
        if len(embeds) != len(chunk):
            raise ValueError(f"text_fn returned {len(embeds)} embeddings for {len(chunk)} captions")
        for (path, caption), e in zip(chunk, embeds):
            _save_text(path, e, caption, text_space_version)
        report.text_misses += len(chunk)
    if keyframe_text_fn is not None:
        for item, entries in _keyframe_text_jobs(scan, text_space_version, cache_dir)[rank::world_size]:
            todo = [(path, caption) for path, caption in entries if not _valid_entry(path)]
            report.text_hits += len(entries) - len(todo)
            if not todo or skip_path(item, cache_dir).is_file():  # a clip that failed to decode trains nothing
                continue
            try:
                first = load_item_pixels(item)[0]  # (3, H, W): the frame its latents' first frame is encoded from
            except media.MediaError:  # recorded by the rank that caches its latents (a `.skip.json`); dropped
                continue
            with torch.no_grad():
                embeds = keyframe_text_fn([c for _, c in todo], first)
            for (path, caption), e in zip(todo, embeds, strict=True):
                _save_text(path, e, caption, text_space_version)
            report.text_misses += len(todo)
    if verbose:
        print(f"cache: rank {rank}/{world_size}: latents {report.hits} hit, {report.misses} computed, "
              f"{len(report.skipped)} skipped; text {report.text_hits} hit, {report.text_misses} computed",
              flush=True)
    if barrier is not None:
        barrier()
    return report


def _save_text(path: Path, e, caption: str, text_space_version: str) -> None:
    """One caption's text entry: an (Lt, D) tensor (stored as `text_embeds`) or a non-empty dict of 2-D tensors."""
    entry = {"text_embeds": e} if isinstance(e, torch.Tensor) else e
    bad = [k for k, t in entry.items() if not isinstance(t, torch.Tensor) or t.ndim != 2] \
        if isinstance(entry, dict) and entry else ["?"]
    if bad:
        raise ValueError(f"text_fn must return per caption an (Lt, D) tensor or a non-empty dict of them, got "
                         f"{type(e).__name__} ({bad})")
    _atomic_save({k: t.contiguous() for k, t in entry.items()}, path,
                 {"caption": caption, "space_version": text_space_version, "format": TEXT_FORMAT})


class CachedDataset(torch.utils.data.Dataset):
    """Cached tensors of a scan, read per step. Build it on every rank AFTER `build_cache` (and its
    barrier), with the same `cache_dir` and space versions.

    `ds[i]` -> `{"latents": (C, F', h, w), "text_embeds": (Lt, D), <other cached keys>,
    "caption": str (as used: "" when dropped), "caption_dropped": bool, "index": i}`.
    Indices run over items x `num_repeats`; `buckets` maps `(F, H, W)` to indices (feed it to
    `BucketBatchSampler`). Items whose decode failed at caching are dropped and listed in `skipped`.
    Call `set_epoch(e)` before each epoch's DataLoader iterator is created (caption dropout depends
    on it; with `num_workers > 0` do not use `persistent_workers`, which would keep an old epoch).
    """

    def __init__(self, scan: ScanResult, cache_dir=None, *, space_version: str,
                 text_space_version: str | None = None, seed: int = 0, keyframe_text: bool = False):
        self.cache_dir, self.keyframe_text = cache_dir, keyframe_text  # (`item_text_path`)
        self.space_version = space_version
        self.text_space_version = space_version if text_space_version is None else text_space_version
        self.seed, self.epoch = seed, 0
        self.items: list[DataItem] = []
        self.skipped = list(scan.skipped)
        for item in scan.items:
            if not latent_path(item, space_version, cache_dir).is_file():
                marker = skip_path(item, cache_dir)
                if marker.is_file():
                    self.skipped.append((item.path, json.loads(marker.read_text(encoding="utf-8"))["reason"]))
                    continue
                raise DataError(f"{item.path}: no latent cache entry {latent_path(item, space_version, cache_dir)}; "
                                f"run build_cache on every rank (same cache_dir and space_version) first")
            for caption in (item.caption, ""):
                tp = item_text_path(item, caption, self.text_space_version, cache_dir, keyframe_text)
                if not tp.is_file():
                    raise DataError(f"{item.path}: no text cache entry {tp} for caption {caption!r}; "
                                    f"run build_cache first")
            self.items.append(item)
        if not self.items:
            raise DataError("no usable item left after caching: "
                            + "; ".join(f"{Path(p).name}: {r}" for p, r in self.skipped[:5]))
        self.index_map = [k for k, it in enumerate(self.items) for _ in range(it.num_repeats)]
        self.buckets: dict[tuple[int, int, int], list[int]] = {}
        for i, k in enumerate(self.index_map):
            self.buckets.setdefault(self.items[k].bucket, []).append(i)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.index_map)

    def item(self, index: int) -> DataItem:
        return self.items[self.index_map[index]]

    def caption_dropped(self, index: int, epoch: int | None = None) -> bool:
        """Whether sample `index` trains with the empty prompt in `epoch` (pure function of seed, epoch, index)."""
        rate = self.item(index).caption_dropout_rate
        epoch = self.epoch if epoch is None else epoch
        return rate > 0 and random.Random(f"caption-dropout:{self.seed}:{epoch}:{index}").random() < rate

    def __getitem__(self, index: int) -> dict:
        item = self.item(index)
        out: dict = dict(load_file(str(latent_path(item, self.space_version, self.cache_dir))))
        dropped = self.caption_dropped(index)
        caption = "" if dropped else item.caption
        tp = item_text_path(item, caption, self.text_space_version, self.cache_dir, self.keyframe_text)
        text = load_file(str(tp))  # the family's text entry (Wan: text_embeds)
        out.update(text)
        out[TEXT_NAMES] = tuple(sorted(text))
        out.update(caption=caption, caption_dropped=dropped, index=index)
        return out


def collate(samples: list[dict]) -> dict:
    """Stack a batch from one bucket: cached tensors -> `(B, ...)`; the text keys (a sample's TEXT_NAMES) stay lists
    of `(Lt, D)` (lengths may differ); `caption` a list; `index` and `caption_dropped` 1D tensors."""
    keys = list(samples[0])
    for s in samples[1:]:
        if list(s) != keys:
            raise ValueError(f"samples {samples[0]['index']} and {s['index']} have different cached keys "
                             f"({sorted(keys)} vs {sorted(s)}); a batch must come from one bucket and one "
                             f"dataset configuration (do_i2v)")
    batch: dict = {}
    for key in keys:
        values = [s[key] for s in samples]
        if key == TEXT_NAMES:
            batch[key] = samples[0][key]
        elif key in samples[0].get(TEXT_NAMES, ()) or key == "caption":
            batch[key] = values
        elif key == "index":
            batch[key] = torch.tensor(values, dtype=torch.long)
        elif key == "caption_dropped":
            batch[key] = torch.tensor(values, dtype=torch.bool)
        else:
            shapes = {tuple(v.shape) for v in values}
            if len(shapes) != 1:
                raise ValueError(f"cannot stack {key!r}: shapes {sorted(shapes)} differ within the batch "
                                 f"(indices {[s['index'] for s in samples]})")
            batch[key] = torch.stack(values)
    return batch


@dataclass
class CacheStatus:
    """What `inspect-data` reports of one scan's caches. `exact`: the counts are for the job's own
    space versions (cached = what the trainer will read); otherwise for any version found on disk."""

    items: int
    cached: int        # items with a latent entry
    failed: int        # items whose decode failed at a previous caching (skip marker)
    captions: int      # distinct captions (per cache root)
    captions_cached: int
    exact: bool


def cache_status(scan: ScanResult, space_version: str | None = None, text_space_version: str | None = None,
                 cache_dir=None) -> CacheStatus:
    """Cached / not cached per item for the job's space versions (the trainer's `job_cache_spaces`);
    without them, an entry for any version counts."""
    exact = space_version is not None and text_space_version is not None
    cached = failed = 0
    for item in scan.items:
        folder = cache_root_of(item, cache_dir) / LATENT_DIR
        prefix = f"{Path(item.path).name}_{item_key(item)}_"
        if exact:
            found = _valid_entry(latent_path(item, space_version, cache_dir))
        else:
            found = folder.is_dir() and any(folder.glob(glob.escape(prefix) + "*.safetensors"))
        cached += found
        if not found and skip_path(item, cache_dir).is_file():
            failed += 1
    captions = {(cache_root_of(it, cache_dir), it.caption) for it in scan.items}
    have = sum(_valid_entry(text_path(root, c, text_space_version)) if exact else text_cached_any(root, c)
               for root, c in captions)
    return CacheStatus(len(scan.items), cached, failed, len(captions), have, exact)
