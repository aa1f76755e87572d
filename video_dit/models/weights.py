"""Weights files in: reading safetensors and tensors-only `.pth` pickles lazily (`LazyWeights`:
names, shapes and dtypes from the headers, tensors read one group at a time), checking a state
dict against a model, and materialising a model built on the meta device from them.

Only safetensors and `torch.load(weights_only=True)` pickles are ever read: a `.pth` holding
anything but tensors is refused, never unpickled.
"""

from __future__ import annotations

import json
import math
import os
import pickle
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn


class WeightsError(ValueError):
    """A weights file or folder that does not fit the model; the message names the file and keys."""




# safetensors header dtype names -> torch dtypes
_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                       "U8": torch.uint8, "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn,
                       "F8_E5M2": torch.float8_e5m2}
_PTH_SUFFIXES = (".pth", ".pt", ".bin", ".ckpt")
_PTH_WRAPPERS = ("state_dict", "model", "module")  # common wrappers around a .pth's tensors


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor of a weights source lives, and what it is, known without reading it."""

    file: Path
    key: str  # the name stored in the file
    shape: tuple[int, ...]
    dtype: torch.dtype


class LazyWeights:
    """The tensors of a weights file or folder by name, read only when asked for.

    Names, shapes and dtypes come from the safetensors headers, or for a `.pth` from its pickle
    through `torch.load(weights_only=True, mmap=True)` (zip-format files, the default of
    `torch.save` since torch 1.6: the tensors stay in the file until touched). So names can be
    converted (`renamed`) and checked (`meta`) before any tensor is read. `read(names)` opens each
    file involved once, copies the named tensors out and closes the file again: what this process
    holds afterwards is the tensors it asked for (file pages the OS mapped are released on close).
    A legacy (non-zip) `.pth` cannot be mapped: it is read whole, once, and held by this object
    until it is dropped (`held_bytes` says how much).
    """

    def __init__(self, entries: dict[str, TensorEntry], source: str):
        self.entries = entries
        self.source = source
        self._held: dict[Path, dict[str, torch.Tensor]] = {}  # legacy .pth files, read whole

    def keys(self):
        return self.entries.keys()

    def __contains__(self, name) -> bool:
        return name in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def meta(self) -> dict[str, torch.Tensor]:
        """Each tensor as a meta tensor (shape and dtype, no data), for checks and config inference."""
        return {k: torch.empty(e.shape, dtype=e.dtype, device="meta") for k, e in self.entries.items()}

    def nbytes(self, names=None) -> int:
        names = self.entries if names is None else names
        return sum(math.prod(self.entries[k].shape) * self.entries[k].dtype.itemsize for k in names)

    @property
    def held_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for d in self._held.values() for t in d.values())

    def renamed(self, names: dict[str, str]) -> "LazyWeights":
        """The same tensors under new names: `names` maps each new name to an existing one."""
        out = LazyWeights({new: self.entries[old] for new, old in names.items()}, self.source)
        out._held = self._held
        return out

    def read(self, names) -> dict[str, torch.Tensor]:
        """The named tensors, each a tensor of its own (nothing left mapped to a file)."""
        by_file: dict[Path, list[str]] = {}
        for name in names:
            by_file.setdefault(self.entries[name].file, []).append(name)
        out = {}
        for file, group in by_file.items():
            if file.suffix.lower() == ".safetensors":
                out.update(_read_safetensors(file, {n: self.entries[n].key for n in group}))
            else:
                tensors = self._held.get(file)
                if tensors is None:
                    tensors, mapped = _load_pth(file)
                    if not mapped:
                        self._held[file] = tensors
                for n in group:
                    t = tensors[self.entries[n].key]
                    out[n] = t.clone() if file not in self._held else t
                del tensors  # drops the mapping of a zip-format file
        return out

    def read_all(self) -> dict[str, torch.Tensor]:
        return self.read(list(self.entries))


class ConvertedWeights:
    """A layout whose tensors are fused, split or reordered on the way to the native names, read one native
    tensor at a time behind `LazyWeights`' reading interface (`keys`, `meta`, `read`, `read_all`): each native
    tensor's source tensors are read from the file, converted and let go, so a module group read holds that
    group plus one tensor's sources, never the model (a ZeRO-3 build calls the family's `arch.open` on every
    rank, `parallel/partition.py`).

    `sources`: {native name: its source names in `lazy`}; `convert(native name, {source name: tensor})`: the
    native tensor; `meta`: the native names' meta tensors (the whole file converted on the meta device).
    Natives sharing their sources (q / k / v split from one fused qkv) are converted from one read; a native
    that is a view into a larger source (a chunk of it) is copied, so the source is let go."""

    def __init__(self, lazy: LazyWeights, sources: dict, convert, meta: dict, source: str):
        missing = sorted({s for names in sources.values() for s in names} - set(lazy.keys()))
        if missing:
            raise WeightsError(f"{source}: the conversion reads tensors the file does not hold: {len(missing)}, "
                               f"first: {', '.join(missing[:5])}")
        unsourced = sorted(set(meta) - set(sources))
        if unsourced:
            raise WeightsError(f"{source}: no source tensors for {len(unsourced)} converted names, first: "
                               f"{', '.join(unsourced[:5])}")
        self.lazy, self.sources, self.convert, self._meta, self.source = lazy, sources, convert, meta, source

    def keys(self):
        return self._meta.keys()

    def __contains__(self, name) -> bool:
        return name in self._meta

    def __len__(self) -> int:
        return len(self._meta)

    def meta(self) -> dict[str, torch.Tensor]:
        return dict(self._meta)

    def read(self, names) -> dict[str, torch.Tensor]:
        by_sources: dict[tuple, list[str]] = {}
        for name in names:
            by_sources.setdefault(tuple(self.sources[name]), []).append(name)
        out = {}
        for sources, group in by_sources.items():
            tensors = self.lazy.read(list(sources))
            for name in group:
                t = self.convert(name, tensors)
                out[name] = t.clone() if t.untyped_storage().nbytes() > t.nbytes else t  # a chunk: its own copy
            del tensors
        return out

    def read_all(self) -> dict[str, torch.Tensor]:
        return self.read(list(self._meta))


def _safetensors_error(path: Path, exc: Exception) -> WeightsError:
    return WeightsError(f"{path}: not a readable safetensors file ({exc})")


def _read_safetensors(path: Path, keys: dict[str, str]) -> dict[str, torch.Tensor]:
    try:
        with safe_open(str(path), framework="pt") as f:
            return {name: f.get_tensor(key) for name, key in keys.items()}
    except (SafetensorError, OSError) as exc:
        raise _safetensors_error(path, exc) from exc


def _load_pth(path: Path) -> tuple[dict[str, torch.Tensor], bool]:
    """(the tensors of a tensors-only `.pth`, whether they are mapped from the file rather than read)."""
    def load(mmap: bool):
        return torch.load(str(path), map_location="cpu", weights_only=True, mmap=mmap)

    mapped = True
    try:
        try:
            obj = load(mmap=True)
        except RuntimeError as exc:
            if "mmap can only be used" not in str(exc):
                raise
            obj, mapped = load(mmap=False), False  # a legacy (non-zip) file: read whole
    except (pickle.UnpicklingError, RuntimeError, EOFError) as exc:
        raise WeightsError(
            f"{path}: refused: not a tensors-only checkpoint (loaded with weights_only=True; "
            f"pickled objects other than tensors are never unpickled): {exc}"
        ) from exc
    for key in _PTH_WRAPPERS:
        if isinstance(obj, dict) and isinstance(obj.get(key), dict):
            obj = obj[key]
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise WeightsError(f"{path}: expected a dict of tensors, got {type(obj).__name__}")
    return obj, mapped


def _weight_files(path: Path) -> list[Path]:
    index = sorted(path.glob("*.safetensors.index.json"))
    if index:
        weight_map = json.loads(index[0].read_text())["weight_map"]
        files = sorted({path / f for f in weight_map.values()})
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise WeightsError(f"{path}: no .safetensors files in this folder")
    return files


def open_weights(path: str | os.PathLike) -> LazyWeights:
    """The tensors of one `.safetensors` / `.pth` / `.pt` / `.bin` / `.ckpt` file, or of a folder of
    sharded safetensors with or without a `*.safetensors.index.json`, as a `LazyWeights` (headers
    read, tensors not)."""
    path = Path(path)
    if path.is_dir():
        files = _weight_files(path)
    elif not path.exists():
        raise WeightsError(f"{path}: no such file")
    elif path.suffix.lower() in _PTH_SUFFIXES:
        tensors, mapped = _load_pth(path)
        out = LazyWeights({k: TensorEntry(path, k, tuple(v.shape), v.dtype) for k, v in tensors.items()}, str(path))
        if not mapped:
            out._held[path] = tensors
        return out
    elif path.suffix.lower() == ".safetensors":
        files = [path]
    else:
        raise WeightsError(f"{path}: unsupported weights file type {path.suffix.lower()!r}; "
                           "accepted: .safetensors, .pth, .pt, .bin, .ckpt or a folder of safetensors")
    entries: dict[str, TensorEntry] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():
                    sl = f.get_slice(key)
                    entries[key] = TensorEntry(file, key, tuple(sl.get_shape()), _SAFETENSORS_DTYPES[sl.get_dtype()])
        except (SafetensorError, OSError) as exc:
            raise _safetensors_error(file, exc) from exc
    return LazyWeights(entries, str(path))


def read_state_dict(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Tensors of one `.safetensors` / `.pth` / `.pt` / `.bin` file, or of a folder of sharded
    safetensors with or without a `*.safetensors.index.json` (all read; see `open_weights`)."""
    return open_weights(path).read_all()


def check_state_dict(model: nn.Module, sd: dict[str, torch.Tensor], source: str, limit: int = 8) -> None:
    """Raise `WeightsError` naming `source` and the first missing / unexpected / wrong-shape keys."""
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    missing = [k for k in expected if k not in sd]
    unexpected = [k for k in sd if k not in expected]
    wrong = [f"{k}: file {tuple(sd[k].shape)} vs model {expected[k]}"
             for k in expected if k in sd and tuple(sd[k].shape) != expected[k]]
    if missing or unexpected or wrong:
        parts = [f"{source}: weights do not fit {type(model).__name__}"]
        for name, keys in (("missing", missing), ("unexpected", unexpected), ("wrong shape", wrong)):
            if keys:
                more = f" (+{len(keys) - limit} more)" if len(keys) > limit else ""
                parts.append(f"  {len(keys)} {name}: " + ", ".join(keys[:limit]) + more)
        raise WeightsError("\n".join(parts))


def module_groups(names, block_list: str = "blocks") -> list[list[str]]:
    """Tensor names grouped by top-level module (each block of the DiT's `block_list`, the family's
    `DiTArch.block_list`, counts as one: `blocks.N` for Wan), in first-seen order: the unit in which
    weights are read, so at most one group's tensors are held beyond the model."""
    groups: dict[str, list[str]] = {}
    for name in names:
        parts = name.split(".")
        key = ".".join(parts[:2]) if parts[0] == block_list and len(parts) > 2 else parts[0]
        groups.setdefault(key, []).append(name)
    return list(groups.values())


def stored_dtype(shapes: dict, source: str, float32_kept: bool = False) -> torch.dtype:
    """The one dtype of a weights file's tensors (`shapes`: name -> tensor or header); a file of
    mixed dtypes is refused, naming them (the caller then needs an explicit dtype). `float32_kept`:
    float32 beside one lower dtype is that dtype (a bf16 / fp16 DiT with its float32 islands, as our
    full export writes it; the caller checks each tensor against its `param_dtypes`)."""
    dtypes = {v.dtype for v in shapes.values()}
    low = dtypes - {torch.float32}
    if len(dtypes) > 1 and not (float32_kept and len(low) == 1):
        raise WeightsError(f"{source}: tensors of several dtypes {sorted(map(str, dtypes))}; pass dtype=")
    return low.pop() if len(dtypes) > 1 else dtypes.pop()


def materialize(cls, config, sd, source: str, dtype=None, device=None, storage=None,
                block_list: str = "blocks") -> nn.Module:
    """`cls(config)` built on the meta device and given `sd`'s tensors (checked first, assigned, not
    copied twice) at `dtype`; `dtype=None` keeps the file's dtype and refuses a file of mixed dtypes,
    except one stored as `storage` would store it (a bf16 / fp16 DiT with its float32 islands, as
    our full export writes it).
    `sd` is a dict of tensors or a `LazyWeights`, read one module group at a time.
    `storage(model, dtype) -> {name: dtype}`: per-parameter dtypes instead (the DiT's `param_dtypes`,
    which keeps its float32 islands float32: each tensor goes from the file to its dtype directly).
    `block_list`: the model's list of blocks, each read as one group (`module_groups`)."""
    lazy = sd if isinstance(sd, LazyWeights) else None
    shapes = lazy.meta() if lazy is not None else sd
    mixed = False
    if dtype is None:
        mixed = len({v.dtype for v in shapes.values()}) > 1
        dtype = stored_dtype(shapes, source, float32_kept=storage is not None)
        storage = storage if mixed else None
    with torch.device("meta"):
        model = cls(config)
    check_state_dict(model, shapes, source)
    per_name = storage(model, dtype) if storage is not None else {}
    if mixed and any(v.dtype != per_name.get(k, dtype) for k, v in shapes.items()):
        found = sorted({str(v.dtype) for v in shapes.values()})
        raise WeightsError(f"{source}: tensors of several dtypes {found}; pass dtype= (a {dtype} file may keep "
                           "only a DiT's float32 islands in float32)")
    groups = module_groups(shapes, block_list) if lazy is not None else [list(sd)]
    for group in groups:
        tensors = lazy.read(group) if lazy is not None else {k: sd[k] for k in group}
        model.load_state_dict({k: v.to(device=device, dtype=per_name.get(k, dtype)) for k, v in tensors.items()},
                              strict=False, assign=True)
    return model


def strip_prefix(sd: dict[str, torch.Tensor], prefixes=("model.diffusion_model.", "diffusion_model.")):
    """Drop a ComfyUI-style prefix when every key carries it."""
    for prefix in prefixes:
        if sd and all(k.startswith(prefix) for k in sd):
            return {k[len(prefix):]: v for k, v in sd.items()}
    return sd


_DIT_PREFIXES = ("model.diffusion_model.", "diffusion_model.", "transformer.")


def strip_dit_prefix(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop a `model.diffusion_model.` / `diffusion_model.` (ComfyUI) or `transformer.` prefix
    carried by every key."""
    for prefix in _DIT_PREFIXES:
        if sd and all(k.startswith(prefix) for k in sd):
            return {k[len(prefix):]: v for k, v in sd.items()}
    return sd


def check_matches_preset(dit, preset, source: str, cls) -> None:
    """`WeightsError` naming `source` and the first mismatching keys when `dit` (a model or a
    {name: tensor} mapping, meta tensors and ZeRO-3 parameters included) is not shaped like
    `preset`'s DiT (weights of another preset would otherwise meet the wrong VAE / text encoder).
    `cls`: the preset family's DiT class (`families.DiTArch.cls`)."""
    shapes = dit if isinstance(dit, dict) else {n: _FullShape(p) for n, p in dit.state_dict(keep_vars=True).items()}
    with torch.device("meta"):
        expected = cls(preset.dit)
    check_state_dict(expected, shapes, f"{source} (model.preset: {preset.name})")


class _FullShape:
    """A parameter's whole shape, also of a ZeRO-3 parameter (whose `.shape` is empty; `ds_shape` holds it)."""

    def __init__(self, p: torch.Tensor):
        self.shape = tuple(p.ds_shape) if hasattr(p, "ds_shape") else tuple(p.shape)
