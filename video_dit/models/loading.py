"""Weights in: `load_dit`, `load_vae`, `load_text_encoder` from presets, diffusers folders,
original Wan files or single safetensors files. Kept apart from the network math.

Only safetensors and `torch.load(weights_only=True)` pickles are ever read: a `.pth` holding
anything but tensors is refused, never unpickled.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn


class WeightsError(ValueError):
    """A weights file or folder that does not fit the model; the message names the file and keys."""


# Written beside full fine-tune weights (our trainer's exports, the ai-toolkit arch's save_model):
# {"preset", "vae", "text_encoder"[, "i2v_mode", "sampling"]}, so that the folder loads and samples alone.
SOURCES_FILE = "video_dit_sources.json"


def read_sources(folder: str | os.PathLike) -> dict:
    """What `SOURCES_FILE` in `folder` records, or {} (no such file, or `folder` is not a folder)."""
    path = Path(folder) / SOURCES_FILE
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise WeightsError(f"{path}: not a readable sources file ({exc})") from exc
    if not isinstance(data, dict):
        raise WeightsError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def write_sources(folder: str | os.PathLike, sources: dict) -> Path:
    path = Path(folder) / SOURCES_FILE
    path.write_text(json.dumps(sources, indent=2) + "\n", encoding="utf-8")
    return path


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


def _safetensors_error(path: Path, exc: Exception) -> WeightsError:
    return WeightsError(f"{path}: not a readable safetensors file ({exc})")


def _read_safetensors(path: Path, keys: dict[str, str]) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return {name: f.get_tensor(key) for name, key in keys.items()}
    except (SafetensorError, OSError) as exc:
        raise _safetensors_error(path, exc) from exc


def _load_pth(path: Path) -> tuple[dict[str, torch.Tensor], bool]:
    """(the tensors of a tensors-only `.pth`, whether they are mapped from the file rather than read)."""
    import pickle

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
    from safetensors import SafetensorError, safe_open

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


def module_groups(names) -> list[list[str]]:
    """Tensor names grouped by top-level module (`blocks.N` counts as one), in first-seen order:
    the unit in which weights are read, so at most one group's tensors are held beyond the model."""
    groups: dict[str, list[str]] = {}
    for name in names:
        parts = name.split(".")
        key = ".".join(parts[:2]) if parts[0] == "blocks" and len(parts) > 2 else parts[0]
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


def materialize(cls, config, sd, source: str, dtype=None, device=None, storage=None) -> nn.Module:
    """`cls(config)` built on the meta device and given `sd`'s tensors (checked first, assigned, not
    copied twice) at `dtype`; `dtype=None` keeps the file's dtype and refuses a file of mixed dtypes,
    except one stored as `storage` would store it (a bf16 / fp16 DiT with its float32 islands, as
    our full export writes it).
    `sd` is a dict of tensors or a `LazyWeights`, read one module group at a time.
    `storage(model, dtype) -> {name: dtype}`: per-parameter dtypes instead (the DiT's `param_dtypes`,
    which keeps its float32 islands float32: each tensor goes from the file to its dtype directly)."""
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
    groups = module_groups(shapes) if lazy is not None else [list(sd)]
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


# ---------------------------------------------------------------- DiT (issue 2)

WAN_HEAD_DIM = 128  # every released Wan 2.x DiT uses 128-channel heads
CLIP_TOKENS = 257  # Wan 2.1 I2V / FLF2V: ViT-H/14 tokens per image (not stored in the weights)


def image_branch_of(shapes: dict[str, tuple]) -> dict:
    """The `DiTConfig` image-branch fields from native DiT parameter names -> shapes. The keys decide,
    not a config's model_type (Wan 2.1 and Wan 2.2 I2V both say "i2v"; only Wan 2.1 has `img_emb`):
    `img_emb.proj.0.weight` (image_dim,) gives the CLIP width; `img_emb.emb_pos` (1, 2 x tokens,
    image_dim) marks FLF2V. An I2V file does not store its token count: Wan's 257 is assumed."""
    if "img_emb.proj.0.weight" not in shapes:
        return dict(image_dim=None, image_tokens=CLIP_TOKENS, num_images=1)
    image_dim = int(shapes["img_emb.proj.0.weight"][0])
    pos = shapes.get("img_emb.emb_pos")
    if pos is None:
        return dict(image_dim=image_dim, image_tokens=CLIP_TOKENS, num_images=1)
    if len(pos) != 3 or pos[1] % 2 or pos[2] != image_dim:
        raise WeightsError(f"img_emb.emb_pos has shape {tuple(pos)}; expected (1, 2 x image tokens, {image_dim})")
    return dict(image_dim=image_dim, image_tokens=int(pos[1]) // 2, num_images=2)


def infer_dit_config(sd: dict[str, torch.Tensor]):
    """A `DiTConfig` from native-keyed DiT weights' shapes. Shapes do not carry num_heads, text_len
    and an I2V model's image token count: they come from the preset of the same widths when one
    matches, else Wan's convention (head dim 128, text_len 512, 257 image tokens)."""
    from video_dit.models.dit import DiTConfig
    from video_dit.models.presets import PRESETS

    import math
    import re

    try:
        patch = sd["patch_embedding.weight"]
        dim, in_dim, patch_size = patch.shape[0], patch.shape[1], tuple(patch.shape[2:])
        shape = dict(dim=dim, in_dim=in_dim, patch_size=patch_size,
                     ffn_dim=sd["blocks.0.ffn.0.weight"].shape[0],
                     freq_dim=sd["time_embedding.0.weight"].shape[1],
                     text_dim=sd["text_embedding.0.weight"].shape[1],
                     out_dim=sd["head.head.weight"].shape[0] // math.prod(patch_size))
    except KeyError as exc:
        raise WeightsError(f"cannot infer the DiT config: key {exc} missing (first keys: "
                           f"{', '.join(list(sd)[:5])})") from exc
    shape["num_layers"] = 1 + max(int(m.group(1)) for k in sd if (m := re.match(r"blocks\.(\d+)\.", k)))
    shape["qk_norm"] = "blocks.0.self_attn.norm_q.weight" in sd
    shape["cross_attn_norm"] = "blocks.0.norm3.weight" in sd
    image = image_branch_of({k: tuple(v.shape) for k, v in sd.items() if k.startswith("img_emb.")})
    widths = (dim, shape["ffn_dim"], shape["freq_dim"], shape["text_dim"])
    matching = [p.dit for p in PRESETS.values() if (p.dit.dim, p.dit.ffn_dim, p.dit.freq_dim, p.dit.text_dim) == widths]
    if matching:
        same = [c for c in matching if (c.image_dim, c.num_images) == (image["image_dim"], image["num_images"])]
        p = (same or matching)[0]
        if same and image["image_dim"] is not None and image["num_images"] == 1:
            image["image_tokens"] = p.image_tokens  # an I2V file does not store its token count
        return DiTConfig(**shape, **image, num_heads=p.num_heads, text_len=p.text_len)
    if dim % WAN_HEAD_DIM:
        raise WeightsError(f"cannot infer num_heads for dim={dim} (no preset has these widths and dim is not a "
                           f"multiple of Wan's head dim {WAN_HEAD_DIM}); pass config=DiTConfig(...)")
    return DiTConfig(**shape, **image, num_heads=dim // WAN_HEAD_DIM, text_len=512)


def _dit_config_from_json(path: Path, shapes: dict[str, tuple]):
    """DiTConfig from a diffusers config.json, our native one (`DiTConfig` fields), or an original Wan
    one (WanModel names), whose image-branch fields come from the weights' `shapes` (`image_branch_of`)."""
    from dataclasses import replace

    from video_dit.models.dit import DiTConfig

    d = json.loads(path.read_text())
    if d.get("_class_name") == "WanTransformer3DModel" or "num_attention_heads" in d:
        inner = d["num_attention_heads"] * d["attention_head_dim"]
        image_dim, added_kv, pos_len = d.get("image_dim"), d.get("added_kv_proj_dim"), d.get("pos_embed_seq_len")
        # Wan 2.1 I2V: image_dim 1280 and added_kv_proj_dim = the inner width; FLF2V adds pos_embed_seq_len 514
        if (image_dim is None) != (added_kv is None) or (added_kv is not None and added_kv != inner) \
                or (pos_len is not None and (image_dim is None or pos_len % 2)):
            raise WeightsError(f"{path}: image_dim={image_dim}, added_kv_proj_dim={added_kv}, pos_embed_seq_len="
                               f"{pos_len}: not a Wan layout; accepted: all None (t2v, Wan 2.2), or image_dim set "
                               f"with added_kv_proj_dim={inner} (Wan 2.1 I2V) and pos_embed_seq_len even (FLF2V)")
        tokens = pos_len // 2 if pos_len else CLIP_TOKENS
        clip_json = path.parent.parent / "image_encoder" / "config.json"  # a pipeline folder's CLIP, beside transformer/
        if image_dim is not None and not pos_len and clip_json.is_file():
            clip = json.loads(clip_json.read_text())
            tokens = (clip.get("image_size", 224) // clip.get("patch_size", 14)) ** 2 + 1
        image = dict(image_dim=image_dim, num_images=2 if pos_len else 1, image_tokens=tokens)
        return DiTConfig(patch_size=tuple(d["patch_size"]), in_dim=d["in_channels"],
                         out_dim=d["out_channels"] or d["in_channels"],
                         dim=inner, ffn_dim=d["ffn_dim"],
                         freq_dim=d["freq_dim"], text_dim=d["text_dim"], num_heads=d["num_attention_heads"],
                         num_layers=d["num_layers"], qk_norm=d.get("qk_norm") is not None,
                         cross_attn_norm=d["cross_attn_norm"], eps=d["eps"], text_len=512, **image)
    try:
        config = DiTConfig.from_dict(d)
    except ValueError as exc:
        raise WeightsError(f"{path}: {exc}") from exc
    if "image_dim" not in d:  # an original Wan config: model_type cannot tell Wan 2.1 I2V from Wan 2.2 I2V
        config = replace(config, **image_branch_of(shapes))
    return config


# Where a two-expert model folder (Wan 2.2 A14B) keeps each expert's weights: diffusers' layout
# (Wan-AI/Wan2.2-*-A14B-Diffusers: `transformer` runs t >= boundary, `transformer_2` the rest) and Wan's own
# (wan/configs/wan_*_A14B.py `high_noise_checkpoint` / `low_noise_checkpoint`).
EXPERT_FOLDERS: dict[str, dict[str, str]] = {
    "diffusers": {"high_noise": "transformer", "low_noise": "transformer_2"},
    "wan": {"high_noise": "high_noise_model", "low_noise": "low_noise_model"},
}


def expert_sources(source: str | os.PathLike) -> dict[str, str] | None:
    """{"high_noise": folder, "low_noise": folder} of a two-expert model folder (either layout of
    `EXPERT_FOLDERS`), None for anything else (a one-DiT folder or file, `preset:NAME`). A folder with
    one expert's subfolder of a pair but not the other (`transformer_2/` alone, `high_noise_model/`
    alone) is a `WeightsError` naming the missing one; `transformer/` alone is a one-DiT folder."""
    path = Path(source)
    if str(source).startswith("preset:") or not path.is_dir():
        return None
    for layout, names in EXPERT_FOLDERS.items():
        present = {e: (path / sub).is_dir() for e, sub in names.items()}
        if all(present.values()):
            return {e: str(path / sub) for e, sub in names.items()}
        if any(present.values()) and not (layout == "diffusers" and present == {"high_noise": True, "low_noise": False}):
            missing = next(sub for e, sub in names.items() if not present[e])
            have = next(sub for e, sub in names.items() if present[e])
            raise WeightsError(f"{path}: has {have}/ but no {missing}/; a two-expert folder holds both "
                               f"({' + '.join(names.values())}/), a one-DiT folder transformer/ alone")
    return None


def expert_seed(seed: int, expert: str) -> int:
    """The random-init seed of one expert of a two-expert `preset:NAME` (so the two differ): `seed` for
    the high-noise expert, `seed + 1` for the low-noise one."""
    return seed + ("high_noise", "low_noise").index(expert)


def folder_boundary(source: str | os.PathLike) -> float | None:
    """The `boundary_ratio` a diffusers two-expert folder's model_index.json records (as diffusers'
    `WanPipeline` reads it), else None."""
    index = Path(source) / "model_index.json"
    if str(source).startswith("preset:") or not index.is_file():
        return None
    try:
        value = json.loads(index.read_text()).get("boundary_ratio")
    except (OSError, json.JSONDecodeError) as exc:
        raise WeightsError(f"{index}: not a readable JSON file ({exc})") from exc
    return None if value is None else float(value)


def open_dit(source: str | os.PathLike, config=None):
    """(weights, config, description) of a DiT checkpoint without reading a tensor: `weights` is a
    `LazyWeights` under native (original Wan) names, the key layout (original, diffusers, ComfyUI
    prefixes) converted on the names alone; `config` from `config`, else the config.json next to the
    weights, else the weights' shapes; `description` = "PATH (LAYOUT layout)" for messages."""
    from video_dit.models.convert import dit_from_diffusers, dit_key_layout, strip_dit_prefix

    path = Path(source)
    if path.is_dir() and (path / "transformer").is_dir():
        path = path / "transformer"
    weights = open_weights(path)
    names = strip_dit_prefix({k: k for k in weights.keys()})  # name -> the name stored in the file
    try:
        layout = dit_key_layout(names)
    except ValueError as exc:
        raise WeightsError(f"{path}: {exc}") from exc
    if layout == "diffusers":
        names = dit_from_diffusers(names)
    weights = weights.renamed(names)
    if config is None and path.is_dir() and (path / "config.json").is_file():
        config = _dit_config_from_json(path / "config.json", {k: e.shape for k, e in weights.entries.items()})
    if config is None:
        config = infer_dit_config(weights.meta())
    return weights, config, f"{path} ({layout} layout)"


def load_dit(source: str | os.PathLike, dtype: torch.dtype | None = None, device=None, config=None, seed: int = 0):
    """A `VideoDiT` from
      `preset:NAME`                 seeded random init (`seed`) of the preset's DiT config;
      a diffusers folder            `transformer/` (or the folder itself): sharded safetensors + index + config.json;
      an original Wan folder        safetensors (sharded or not) with Wan key names (+ its config.json);
      a single weights file         original, diffusers or ComfyUI (`model.diffusion_model.` / `diffusion_model.`)
                                    keys, the layout detected from the names.
    The config comes from `config`, else a config.json next to the weights, else the weights' shapes
    (`infer_dit_config`). dtype None keeps the stored dtype (which must then be uniform); a dtype
    casts as `cast_dit` does: bf16 keeps the float32 islands (time MLPs, modulation tables, norms,
    head) float32 and computes in bf16.
    A mismatch raises `WeightsError` listing the first missing / unexpected / wrong-shape keys.
    Tensors are read one module at a time (`open_dit`, `materialize`). Under ZeRO-3 use
    `video_dit.train.build.build_dit`, which never holds the whole model on a rank.
    """
    from video_dit.models.dit import VideoDiT, cast_dit, param_dtypes
    from video_dit.models.presets import get_preset

    src = str(source)
    if src.startswith("preset:"):
        config = config or get_preset(src[len("preset:"):]).dit
        with torch.random.fork_rng(devices=[]):
            with torch.device(device or "cpu"):
                model = VideoDiT(config, init_seed=seed)
        return cast_dit(model, dtype) if dtype is not None else model

    weights, config, description = open_dit(src, config)
    model = materialize(VideoDiT, config, weights, description, dtype, device, storage=param_dtypes)
    return cast_dit(model, dtype) if dtype is not None else model

# ---------------------------------------------------------------- VAE (issue 3)

def load_vae(source: str | os.PathLike, dtype: torch.dtype | None = None, device=None, config=None, seed: int = 0):
    """A `CausalVideoVAE` from
      `preset:NAME`                 seeded random init (`seed`) of `VAE_PRESETS[NAME]` (tiny, wan2.1, wan2.2);
      a diffusers folder            `vae/` (or a pipeline folder holding one): config.json + safetensors;
      an original Wan file          `Wan2.1_VAE.pth` / `Wan2.2_VAE.pth` (read with weights_only=True);
      a `.safetensors` file         original or diffusers key names, the layout detected from the names.
    The config comes from `config`, else the config.json of the folder or beside the file (diffusers'
    or our native `VAEConfig` fields), else the VAE preset whose
    parameter shapes equal the file's (latent mean / std come from that preset). dtype None keeps
    the stored dtype (which must then be uniform). A mismatch raises `WeightsError` listing the
    first missing / unexpected / wrong-shape keys.
    """
    from video_dit.models.convert import vae_config_from_diffusers, vae_from_diffusers, vae_key_layout
    from video_dit.models.presets import VAE_PRESETS
    from video_dit.models.vae import CausalVideoVAE, VAEConfig

    src = str(source)
    if src.startswith("preset:"):
        name = src[len("preset:"):]
        if config is None and name not in VAE_PRESETS:
            raise WeightsError(f"{src}: unknown VAE preset {name!r}; valid: {', '.join(VAE_PRESETS)}")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            with torch.device(device or "cpu"):
                model = CausalVideoVAE(config or VAE_PRESETS[name])
        return model.to(dtype=dtype) if dtype is not None else model

    path = Path(src)
    if path.is_dir() and (path / "vae").is_dir():
        path = path / "vae"
    sd = read_state_dict(path)
    try:
        layout = vae_key_layout(sd)
    except ValueError as exc:
        raise WeightsError(f"{path}: {exc}") from exc
    if layout == "diffusers":
        sd = vae_from_diffusers(sd)
    config_json = (path if path.is_dir() else path.parent) / "config.json"
    if config is None and config_json.is_file():
        # diffusers' AutoencoderKLWan config (a `vae/` folder), or our native VAEConfig fields
        # (written beside a single file by the tiny VAE stage, with its measured latent mean / std)
        try:
            raw = json.loads(config_json.read_text())
            native = not ("_class_name" in raw or "base_dim" in raw)
            config = VAEConfig.from_dict(raw) if native else vae_config_from_diffusers(raw)
        except (ValueError, TypeError, KeyError) as exc:
            raise WeightsError(f"{config_json}: not a VAE config ({exc})") from exc
    if config is None:
        shapes = {k: tuple(v.shape) for k, v in sd.items()}
        for candidate in VAE_PRESETS.values():
            with torch.device("meta"):
                expected = {k: tuple(v.shape) for k, v in CausalVideoVAE(candidate).state_dict().items()}
            if expected == shapes:
                config = candidate
                break
        else:
            raise WeightsError(f"{path}: the weights' shapes match no VAE preset ({', '.join(VAE_PRESETS)}); "
                               "pass config=VAEConfig(...)")

    model = materialize(CausalVideoVAE, config, sd, f"{path} ({layout} layout)", dtype, device)
    model.reset_latent_stats(device)  # non-persistent buffers, still on meta after assign
    return model


# ---------------------------------------------------------------- text encoder (issue 4)

TEXT_ENCODER_DOWNLOAD = (
    "download the umT5 text encoder and its tokenizer (no network is used here), e.g.\n"
    "  huggingface-cli download Wan-AI/Wan2.1-T2V-1.3B-Diffusers --include 'text_encoder/*' 'tokenizer/*' "
    "--local-dir MODELS/wan2.1\n"
    "and pass MODELS/wan2.1 (the folder holding text_encoder/ and tokenizer/)")
TEXT_ENCODER_QUANTIZE = ("qfloat8", "qint8")  # optimum-quanto weight types of a frozen encoder (text, image)


def _check_quantize(quantize: str | None) -> None:
    if quantize is not None and quantize not in TEXT_ENCODER_QUANTIZE:
        raise ValueError(f"quantize={quantize!r}; accepted: None, {', '.join(TEXT_ENCODER_QUANTIZE)}")


def _quantize_frozen(model: nn.Module, quantize: str | None) -> None:
    """Quantize a frozen encoder's weights in place (optimum-quanto, `quantize` from
    TEXT_ENCODER_QUANTIZE) and freeze them; None leaves it as it is."""
    if quantize is None:
        return
    from optimum import quanto

    quanto.quantize(model, weights=getattr(quanto, quantize))
    quanto.freeze(model)


def component_dir(path: Path, name: str, download: str, holds: str = "") -> Path:
    """The folder of one component in a diffusers model folder (`path/name`, e.g. text_encoder/), or
    `path` itself when it is that component's folder; it must hold config.json, else a `WeightsError`
    naming `path`, what it should hold (`name`/config.json and `holds`) and how to get it (`download`)."""
    folder = path / name if (path / name).is_dir() else path
    if not (folder / "config.json").is_file():
        raise WeightsError(f"{path}: expected a folder holding {name}/config.json{holds}; {download}")
    return folder


def te_quantization(model_config) -> str | None:
    """`load_text_encoder`'s `quantize` for a job's `model` block (ours or ai-toolkit's ModelConfig:
    `quantize_te`, `qtype_te`; ai-toolkit's "float8" is its name for qfloat8). None: not quantized."""
    if not model_config.quantize_te:
        return None
    return "qfloat8" if model_config.qtype_te == "float8" else model_config.qtype_te


def load_text_encoder(source: str | os.PathLike, dtype: torch.dtype | None = None, device=None,
                      quantize: str | None = None, tokenizer: str | os.PathLike | None = None):
    """A `TextEncoder` (umT5 encoder + tokenizer), from local files only; nothing is fetched.

    source: `preset:NAME` (only presets whose tokenizer needs no files, i.e. `tiny`: ByT5 bytes and a
    seeded random umT5); a diffusers-style folder with `text_encoder/` (config.json + safetensors,
    sharded or not) and `tokenizer/`; or one `.safetensors` file with transformers (HF) umT5 encoder
    keys (`shared.weight`, `encoder.block.N...`; `decoder.*` keys of a full umT5 are dropped), whose
    config is inferred from the shapes, plus `tokenizer=` a tokenizer folder.
    dtype / device: where the weights go (None: the stored dtype, CPU); quantize: None, "qfloat8" or
    "qint8" (optimum-quanto weights, frozen). text_len is 512 (Wan) for files and the preset's for presets.
    """
    from transformers import AutoTokenizer, UMT5EncoderModel

    from video_dit.models.text_encoder import TextEncoder, build_umt5, byte_tokenizer

    _check_quantize(quantize)
    text_len = 512
    src = str(source)
    if src.startswith("preset:"):
        from video_dit.models.presets import get_preset

        config = get_preset(src[len("preset:"):]).text_encoder
        if tokenizer is not None:
            raise ValueError(f"{src}: a preset brings its own tokenizer; tokenizer={tokenizer} applies to files only")
        if config.tokenizer != "byt5":
            raise WeightsError(f"{src}: this preset's text encoder is umT5-XXL, which is never random-initialised "
                               f"or downloaded here; {TEXT_ENCODER_DOWNLOAD}")
        model, tok, text_len = build_umt5(config, seed=0), byte_tokenizer(), config.text_len
    else:
        path = Path(src)
        if not path.exists():
            raise WeightsError(f"{path}: no such file or folder; {TEXT_ENCODER_DOWNLOAD}")
        if path.is_dir():
            te_dir = component_dir(path, "text_encoder", TEXT_ENCODER_DOWNLOAD, " (and its safetensors) and tokenizer/")
            tok_dir = Path(tokenizer) if tokenizer is not None else path / "tokenizer"
            model = UMT5EncoderModel.from_pretrained(str(te_dir), local_files_only=True,
                                                     dtype=dtype if dtype is not None else "auto")
        else:
            if tokenizer is None:
                raise WeightsError(f"{path}: a single weights file needs tokenizer=FOLDER (the umT5 "
                                   f"tokenizer/ folder); {TEXT_ENCODER_DOWNLOAD}")
            tok_dir = Path(tokenizer)
            model = _umt5_from_file(path)
        if not tok_dir.is_dir():
            raise WeightsError(f"{tok_dir}: no tokenizer folder; {TEXT_ENCODER_DOWNLOAD}")
        tok = AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)
    if dtype is not None or device is not None:
        model = model.to(device=device, dtype=dtype)
    _quantize_frozen(model, quantize)
    return TextEncoder(model, tok, text_len)


def _umt5_from_file(path: Path):
    """A `UMT5EncoderModel` from one HF-named safetensors file, its config inferred from the shapes."""
    import re

    from video_dit.models.text_encoder import TextEncoderConfig, build_umt5

    sd = {k: v for k, v in read_state_dict(path).items() if not k.startswith(("decoder.", "lm_head."))}
    if "shared.weight" not in sd and "encoder.embed_tokens.weight" in sd:
        sd["shared.weight"] = sd["encoder.embed_tokens.weight"]
    if "shared.weight" not in sd:
        raise WeightsError(f"{path}: no 'shared.weight' / 'encoder.embed_tokens.weight': not a transformers "
                           f"umT5 encoder file (first keys: {', '.join(list(sd)[:5])})")
    sd.setdefault("encoder.embed_tokens.weight", sd["shared.weight"])  # tied input embedding
    layers = {int(m.group(1)) for k in sd if (m := re.match(r"encoder\.block\.(\d+)\.", k))}
    attn = "encoder.block.0.layer.0.SelfAttention."
    bias = sd.get(attn + "relative_attention_bias.weight")
    if not layers or bias is None or (len(layers) > 1 and
                                      "encoder.block.1.layer.0.SelfAttention.relative_attention_bias.weight" not in sd):
        raise WeightsError(f"{path}: not a umT5 encoder (needs encoder.block.N with a relative attention bias "
                           f"in every layer)")
    gated = "encoder.block.0.layer.1.DenseReluDense.wi_0.weight" in sd
    ff = sd["encoder.block.0.layer.1.DenseReluDense." + ("wi_0" if gated else "wi") + ".weight"]
    vocab, d_model = sd["shared.weight"].shape
    config = TextEncoderConfig(vocab_size=vocab, d_model=d_model, d_ff=ff.shape[0], num_layers=max(layers) + 1,
                               num_heads=bias.shape[1], d_kv=sd[attn + "q.weight"].shape[0] // bias.shape[1],
                               relative_attention_num_buckets=bias.shape[0],
                               feed_forward_proj="gated-gelu" if gated else "relu")
    model = build_umt5(config, device="meta")
    check_state_dict(model, sd, str(path))
    model.load_state_dict(sd, assign=True)
    return model.eval()


# ---------------------------------------------------------------- CLIP image encoder (issue 14)

IMAGE_ENCODER_DOWNLOAD = (
    "download Wan 2.1's CLIP ViT-H/14 (no network is used here), one of:\n"
    "  the diffusers folders: huggingface-cli download Wan-AI/Wan2.1-I2V-14B-480P-Diffusers --include "
    "'image_encoder/*' 'image_processor/*' --local-dir MODELS/wan2.1-i2v (pass MODELS/wan2.1-i2v)\n"
    "  ComfyUI's clip_vision_h.safetensors (Comfy-Org/Wan_2.1_ComfyUI_repackaged, split_files/clip_vision/)\n"
    "  Wan's models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth (in Wan-AI/Wan2.1-I2V-14B-480P)")


def _clip_config_from_shapes(sd: dict[str, torch.Tensor], source: str):
    """An `ImageEncoderConfig` from flat transformers CLIP vision weights. The head count is not in
    the shapes: it comes from the image-encoder preset of the same widths (ViT-H/14: 16 heads)."""
    import math
    import re

    from video_dit.models.image_encoder import ImageEncoderConfig
    from video_dit.models.presets import PRESETS

    try:
        hidden, _, patch, _ = sd["embeddings.patch_embedding.weight"].shape
        positions = sd["embeddings.position_embedding.weight"].shape[0]
        inter = sd["encoder.layers.0.mlp.fc1.weight"].shape[0]
    except KeyError as exc:
        raise WeightsError(f"{source}: cannot read the CLIP vision config: key {exc} missing") from exc
    side = math.isqrt(positions - 1)
    if side * side != positions - 1:
        raise WeightsError(f"{source}: {positions} position embeddings are not a square grid + class token")
    layers = 1 + max(int(m.group(1)) for k in sd if (m := re.match(r"encoder\.layers\.(\d+)\.", k)))
    known = {(p.image_encoder.hidden_size, p.image_encoder.intermediate_size): p.image_encoder.num_heads
             for p in PRESETS.values() if p.image_encoder is not None}
    if (hidden, inter) not in known:
        raise WeightsError(f"{source}: a CLIP vision model of width {hidden} / MLP {inter} matches no preset's "
                           f"image encoder ({', '.join(f'{h}/{i}' for h, i in known)}), so its head count is "
                           "unknown; accepted: Wan's ViT-H/14 (width 1280)")
    return ImageEncoderConfig(hidden_size=hidden, intermediate_size=inter, num_layers=layers,
                              num_heads=known[(hidden, inter)], image_size=side * patch, patch_size=patch)


def load_image_encoder(source: str | os.PathLike, dtype: torch.dtype | None = None, device=None,
                       quantize: str | None = None):
    """A frozen `ImageEncoder` (transformers `CLIPVisionModel`, penultimate-block features), from
      `preset:NAME`       seeded random init of the preset's image encoder (tiny presets only: a random
                          ViT-H/14 is never made);
      a folder            diffusers' `image_encoder/` (config.json + safetensors; CLIPVisionModel or
                          ...WithProjection) with `image_processor/` beside it (its image_mean / image_std
                          are used), or such an image_encoder folder itself;
      a `.safetensors`    transformers keys, flat or under `vision_model.` (ComfyUI's clip_vision_h.safetensors;
                          `visual_projection` is dropped);
      a `.pth`            Wan's models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth (read with
                          weights_only=True; the vision tower `visual.*` converted, the text tower dropped).
    A single file's config comes from its shapes. dtype None keeps the stored dtype; quantize None,
    "qfloat8" or "qint8" (optimum-quanto weights). A mismatch raises `WeightsError` naming the file.
    """
    from video_dit.models.convert import clip_vision_from_transformers, clip_vision_from_wan, clip_vision_key_layout
    from video_dit.models.image_encoder import CLIP_MEAN, CLIP_STD, ImageEncoder, build_clip_vision, clip_vision_config

    _check_quantize(quantize)
    src = str(source)
    mean, std = CLIP_MEAN, CLIP_STD
    if src.startswith("preset:"):
        from video_dit.models.presets import VIT_H_14, get_preset

        config = get_preset(src[len("preset:"):]).image_encoder
        if config is None:
            raise WeightsError(f"{src}: this preset has no CLIP image encoder (its DiT has no image branch)")
        if config == VIT_H_14:
            raise WeightsError(f"{src}: Wan's CLIP ViT-H/14 is never random-initialised or downloaded here; "
                               f"{IMAGE_ENCODER_DOWNLOAD}")
        model = build_clip_vision(config, seed=0)
    else:
        path = Path(src)
        if not path.exists():
            raise WeightsError(f"{path}: no such file or folder; {IMAGE_ENCODER_DOWNLOAD}")
        if path.is_dir():
            from transformers import CLIPVisionModel

            enc_dir = component_dir(path, "image_encoder", IMAGE_ENCODER_DOWNLOAD,
                                    " (and its safetensors) and image_processor/")
            model = CLIPVisionModel.from_pretrained(str(enc_dir), local_files_only=True,
                                                    dtype=dtype if dtype is not None else "auto")
            processor = enc_dir.parent / "image_processor" / "preprocessor_config.json"
            if processor.is_file():
                proc = json.loads(processor.read_text())
                mean, std = tuple(proc.get("image_mean", mean)), tuple(proc.get("image_std", std))
        else:
            weights = open_weights(path)  # headers first: Wan's .pth also holds the text tower, never read
            try:
                layout = clip_vision_key_layout(weights.meta())
            except ValueError as exc:
                raise WeightsError(f"{path}: {exc}") from exc
            vision = [k for k in weights.keys() if k.startswith("visual.")] if layout == "wan" else list(weights.keys())
            sd = weights.read(vision)
            sd = clip_vision_from_wan(sd) if layout == "wan" else clip_vision_from_transformers(sd)
            config = _clip_config_from_shapes(sd, f"{path} ({layout} layout)")
            check_state_dict(build_clip_vision(config, device="meta"), sd, f"{path} ({layout} layout)")
            from transformers import CLIPVisionModel

            # transformers builds it from the checked tensors (and its non-persistent position_ids buffer)
            model = CLIPVisionModel.from_pretrained(None, config=clip_vision_config(config), state_dict=sd,
                                                    dtype=dtype if dtype is not None else "auto").eval()
    if dtype is not None or device is not None:
        model = model.to(device=device, dtype=dtype)
    encoder = ImageEncoder(model, mean=mean, std=std).to(device)
    _quantize_frozen(encoder.model, quantize)
    return encoder


def image_encoder_shape(source: str | os.PathLike) -> tuple[int, int]:
    """(feature width, tokens per image) of an image-encoder source, read from its config.json or the
    tensor headers only (no weights are loaded): for checks before any rank starts."""
    import math

    from video_dit.models.convert import clip_vision_from_transformers, clip_vision_from_wan, clip_vision_key_layout

    src = str(source)
    if src.startswith("preset:"):
        from video_dit.models.presets import get_preset

        config = get_preset(src[len("preset:"):]).image_encoder
        if config is None:
            raise WeightsError(f"{src}: this preset has no CLIP image encoder")
        return config.hidden_size, config.tokens
    path = Path(src)
    if not path.exists():
        raise WeightsError(f"{path}: no such file or folder; {IMAGE_ENCODER_DOWNLOAD}")
    if path.is_dir():
        cfg_json = component_dir(path, "image_encoder", IMAGE_ENCODER_DOWNLOAD) / "config.json"
        c = json.loads(cfg_json.read_text())
        c = c.get("vision_config", c)  # a full CLIPConfig nests the vision part
        return int(c["hidden_size"]), (int(c["image_size"]) // int(c["patch_size"])) ** 2 + 1
    meta = open_weights(path).meta()  # headers only (a zip .pth is memory-mapped)
    try:
        layout = clip_vision_key_layout(meta)
    except ValueError as exc:
        raise WeightsError(f"{path}: {exc}") from exc
    sd = clip_vision_from_wan(meta) if layout == "wan" else clip_vision_from_transformers(meta)
    try:
        width = sd["embeddings.patch_embedding.weight"].shape[0]
        positions = sd["embeddings.position_embedding.weight"].shape[0]
    except KeyError as exc:
        raise WeightsError(f"{path}: not a CLIP vision model: key {exc} missing") from exc
    side = math.isqrt(positions - 1)
    return int(width), side * side + 1
