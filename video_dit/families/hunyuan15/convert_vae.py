"""HunyuanVideo 1.5 VAE weights in and out: key names between ours and diffusers' / ComfyUI's, configs
from diffusers' or Tencent's config.json or from the weights' shapes, and `load_hy15_vae`.

Key layouts (the tensors are the same in all three; only names change):

    original   Tencent's checkpoint (tencent/HunyuanVideo-1.5 vae/diffusion_pytorch_model.safetensors),
               `encoder.down.0.block.1.conv1.conv.weight`, `encoder.mid.attn_1.q.weight`, ... These
               are our module names, so this layout loads as it is (every key still checked).
    diffusers  `AutoencoderKLHunyuanVideo15`: `down_blocks.i.resnets.j`, `downsamplers.0`, `mid_block.
               resnets.0 / attentions.0`, `to_q`, `conv_shortcut` (the names of diffusers'
               scripts/convert_hunyuan_video1_5_to_diffusers.py).
    comfyui    ComfyUI's modules for this architecture (comfy/ldm/hunyuan_video/vae_refiner.py) carry
               Tencent's names, except a channel-changing res block's 1x1 shortcut, a `VideoConv3d`
               there (`nin_shortcut.conv.weight`); a ComfyUI checkpoint holds the VAE under
               `first_stage_model.`. The released widths never change channels inside a res block,
               so ComfyUI's file of the released VAE reads exactly like Tencent's.

A key no rule knows is an error naming it (`ValueError`), in every direction.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch

from video_dit.families.hunyuan15.vae import HY15_VAE_CONFIG, HY15_VAE_TINY, HunyuanVideo15VAE, HY15VAEConfig
from video_dit.models.layouts import preset_name
from video_dit.models.weights import WeightsError, materialize, read_state_dict

# ---------------------------------------------------------------- key names

# (ours = Tencent's, diffusers') name templates. {s}: encoder / decoder, {i}, {j}: indices, {p}: weight /
# bias, {a}: q / k / v, {r}: a res block's inner name (`_RES` maps it between the two layouts).
_PAIRS = (
    ("encoder.down.{i}.block.{j}.{r}", "encoder.down_blocks.{i}.resnets.{j}.{r}"),
    ("decoder.up.{i}.block.{j}.{r}", "decoder.up_blocks.{i}.resnets.{j}.{r}"),
    ("encoder.down.{i}.downsample.conv.conv.{p}", "encoder.down_blocks.{i}.downsamplers.0.conv.conv.{p}"),
    ("decoder.up.{i}.upsample.conv.conv.{p}", "decoder.up_blocks.{i}.upsamplers.0.conv.conv.{p}"),
    ("{s}.mid.block_1.{r}", "{s}.mid_block.resnets.0.{r}"),
    ("{s}.mid.block_2.{r}", "{s}.mid_block.resnets.1.{r}"),
    ("{s}.mid.attn_1.norm.gamma", "{s}.mid_block.attentions.0.norm.gamma"),
    ("{s}.mid.attn_1.{a}.{p}", "{s}.mid_block.attentions.0.to_{a}.{p}"),
    ("{s}.mid.attn_1.proj_out.{p}", "{s}.mid_block.attentions.0.proj_out.{p}"),
    ("{s}.conv_in.conv.{p}", "{s}.conv_in.conv.{p}"),
    ("{s}.norm_out.gamma", "{s}.norm_out.gamma"),
    ("{s}.conv_out.conv.{p}", "{s}.conv_out.conv.{p}"),
)
# A res block's parameters, (ours, diffusers).
_RES = (("norm1.gamma", "norm1.gamma"), ("norm2.gamma", "norm2.gamma"),
        *[(f"{c}.conv.{p}", f"{c}.conv.{p}") for c in ("conv1", "conv2") for p in ("weight", "bias")],
        *[(f"nin_shortcut.{p}", f"conv_shortcut.{p}") for p in ("weight", "bias")])
_FIELDS = {"s": "encoder|decoder", "i": r"\d+", "j": r"\d+", "p": "weight|bias", "a": "q|k|v"}
COMFYUI_PREFIX = "first_stage_model."


def _compile(template: str, res_names) -> re.Pattern:
    pattern = re.escape(template)
    for name, alternatives in {**_FIELDS, "r": "|".join(re.escape(r) for r in res_names)}.items():
        pattern = pattern.replace(re.escape("{" + name + "}"), f"(?P<{name}>{alternatives})")
    return re.compile(pattern)


_OURS = [_compile(a, [r for r, _ in _RES]) for a, _ in _PAIRS]
_DIFFUSERS = [_compile(b, [d for _, d in _RES]) for _, b in _PAIRS]
_RES_TO_DIFFUSERS = dict(_RES)
_RES_FROM_DIFFUSERS = {d: r for r, d in _RES}


def _rename(sd: dict, patterns, targets, res_map, what: str) -> dict:
    out, unknown = {}, []
    for key, value in sd.items():
        for k, pattern in enumerate(patterns):
            m = pattern.fullmatch(key)
            if m:
                groups = m.groupdict()
                if "r" in groups:
                    groups["r"] = res_map[groups["r"]]
                out[targets[k].format(**groups)] = value
                break
        else:
            unknown.append(key)
    if unknown:
        raise ValueError(f"{len(unknown)} key(s) not in the {what} layout of the HunyuanVideo 1.5 VAE: "
                         f"{', '.join(unknown[:8])}{' ...' if len(unknown) > 8 else ''}")
    return out


def hy15_vae_from_diffusers(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """diffusers `AutoencoderKLHunyuanVideo15` keys -> ours (Tencent's); tensors unchanged."""
    return _rename(sd, _DIFFUSERS, [a for a, _ in _PAIRS], _RES_FROM_DIFFUSERS, "diffusers")


def hy15_vae_to_diffusers(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Ours (Tencent's) keys -> diffusers `AutoencoderKLHunyuanVideo15` keys; tensors unchanged."""
    return _rename(sd, _OURS, [b for _, b in _PAIRS], _RES_TO_DIFFUSERS, "original (ours)")


def hy15_vae_from_original(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Tencent's keys are ours: checked (an unknown key is an error), not renamed."""
    return _rename(sd, _OURS, [a for a, _ in _PAIRS], {r: r for r, _ in _RES}, "original (Tencent)")


def hy15_vae_from_comfyui(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """ComfyUI keys (optionally under `first_stage_model.`) -> ours; tensors unchanged."""
    if sd and all(k.startswith(COMFYUI_PREFIX) for k in sd):
        sd = {k[len(COMFYUI_PREFIX):]: v for k, v in sd.items()}
    return hy15_vae_from_original({k.replace(".nin_shortcut.conv.", ".nin_shortcut."): v for k, v in sd.items()})


def hy15_vae_to_comfyui(sd: dict[str, torch.Tensor], prefix: str = "") -> dict[str, torch.Tensor]:
    """Ours -> ComfyUI's VAE file keys (`prefix=COMFYUI_PREFIX` for a checkpoint's VAE part)."""
    sd = hy15_vae_from_original(sd)  # checks every key
    return {prefix + k.replace(".nin_shortcut.", ".nin_shortcut.conv."): v for k, v in sd.items()}


LAYOUTS = ("original", "diffusers", "comfyui")


def hy15_vae_key_layout(sd: dict[str, torch.Tensor]) -> str:
    """"diffusers", "comfyui" (the `first_stage_model.` prefix or a `nin_shortcut.conv.` key) or
    "original" from the key names; an error naming the accepted layouts otherwise. A ComfyUI VAE file
    of the released widths has Tencent's names and reads as "original" (the same keys)."""
    keys = list(sd)
    if any(".down_blocks." in k or ".up_blocks." in k or ".mid_block." in k for k in keys):
        return "diffusers"
    if any(k.startswith(COMFYUI_PREFIX) or ".nin_shortcut.conv." in k for k in keys):
        return "comfyui"
    if any(k.startswith(("encoder.down.", "decoder.up.", "encoder.mid.", "decoder.mid.")) for k in keys):
        return "original"
    raise ValueError("not a HunyuanVideo 1.5 VAE state dict; accepted: Tencent's keys (`encoder.down.0.block.0"
                     ".conv1.conv.weight`), diffusers' (`encoder.down_blocks.0.resnets.0...`) or ComfyUI's "
                     f"(Tencent's, maybe under `{COMFYUI_PREFIX}`); first keys: {', '.join(sorted(keys)[:5])}")


def hy15_vae_to_native(sd: dict[str, torch.Tensor], layout: str | None = None) -> tuple[dict, str]:
    """(our keys, the layout read): any of `LAYOUTS`, detected from the names when `layout` is None."""
    layout = layout or hy15_vae_key_layout(sd)
    convert = {"original": hy15_vae_from_original, "diffusers": hy15_vae_from_diffusers,
               "comfyui": hy15_vae_from_comfyui}
    if layout not in convert:
        raise ValueError(f"layout={layout!r}; accepted: {', '.join(LAYOUTS)}")
    return convert[layout](sd), layout


# ---------------------------------------------------------------- configs

_DIFFUSERS_KEYS = {"in_channels", "out_channels", "latent_channels", "block_out_channels", "layers_per_block",
                   "spatial_compression_ratio", "temporal_compression_ratio", "downsample_match_channel",
                   "upsample_match_channel", "scaling_factor"}
# Tencent's AutoencoderKLConv3D names -> ours; `sample_size` / `sample_tsize` are its tile sizes
# (`enable_tiling(tile_size=...)` here), not architecture, and are read but not kept.
_ORIGINAL_KEYS = {"in_channels": "in_channels", "out_channels": "out_channels", "latent_channels": "latent_channels",
                  "block_out_channels": "block_out_channels", "layers_per_block": "layers_per_block",
                  "ffactor_spatial": "spatial_compression_ratio", "ffactor_temporal": "temporal_compression_ratio",
                  "downsample_match_channel": "downsample_match_channel",
                  "upsample_match_channel": "upsample_match_channel", "scaling_factor": "scaling_factor",
                  "shift_factor": "shift_factor", "sample_size": None, "sample_tsize": None}


def _public(cfg: dict) -> dict:
    return {k: v for k, v in cfg.items() if not k.startswith("_")}  # _class_name, _diffusers_version, ...


def hy15_vae_config_from_diffusers(d: dict) -> HY15VAEConfig:
    """A diffusers `AutoencoderKLHunyuanVideo15` config.json dict -> `HY15VAEConfig` (absent keys take
    diffusers' defaults, the released numbers); an unknown key is a `ValueError` naming it."""
    d = _public(d)
    unknown = sorted(set(d) - _DIFFUSERS_KEYS)
    if unknown:
        raise ValueError(f"AutoencoderKLHunyuanVideo15 config: unknown keys {unknown}; "
                         f"known: {sorted(_DIFFUSERS_KEYS)}")
    return HY15VAEConfig(**d)


def hy15_vae_config_to_diffusers(config: HY15VAEConfig) -> dict:
    """`HY15VAEConfig` -> `AutoencoderKLHunyuanVideo15(**kwargs)` arguments; diffusers has no shift."""
    if config.shift_factor:
        raise ValueError(f"shift_factor={config.shift_factor}: diffusers' AutoencoderKLHunyuanVideo15 and its "
                         "pipelines have no shift; accepted here: None or 0")
    d = {k: getattr(config, k) for k in sorted(_DIFFUSERS_KEYS)}
    d["block_out_channels"] = list(d["block_out_channels"])
    return d


def hy15_vae_config_from_original(d: dict) -> HY15VAEConfig:
    """Tencent's `AutoencoderKLConv3D` config.json dict -> `HY15VAEConfig`; unknown keys are errors."""
    d = _public(d)
    unknown = sorted(set(d) - set(_ORIGINAL_KEYS))
    if unknown:
        raise ValueError(f"AutoencoderKLConv3D config: unknown keys {unknown}; known: {sorted(_ORIGINAL_KEYS)}")
    return HY15VAEConfig(**{_ORIGINAL_KEYS[k]: v for k, v in d.items() if _ORIGINAL_KEYS[k] is not None})


def hy15_vae_config_from_json(d: dict) -> HY15VAEConfig:
    """A config.json of either kind (Tencent's has `ffactor_spatial`; diffusers' `_class_name` and other
    `_` keys), or our own field names (diffusers' plus `shift_factor`)."""
    if "ffactor_spatial" in d or d.get("_class_name") == "AutoencoderKLConv3D":
        return hy15_vae_config_from_original(d)
    if any(k.startswith("_") for k in d):
        return hy15_vae_config_from_diffusers(d)
    return HY15VAEConfig.from_dict(d)


def hy15_vae_config_from_shapes(sd: dict[str, torch.Tensor]) -> HY15VAEConfig:
    """The architecture from our-layout weight shapes: widths, res blocks per level, latent channels, the
    spatial / temporal ratios (a downsample conv's output is C_out / 8 with time, / 4 without) and
    whether resamples change width. `scaling_factor` / `shift_factor` are not in the weights: the
    released VAE's (`HY15_VAE_CONFIG`)."""
    def shape(key):
        if key not in sd:
            raise ValueError(f"hy15_vae_config_from_shapes: no {key!r} in the weights (our key names expected)")
        return tuple(sd[key].shape)

    levels = 1 + max(int(m.group(1)) for k in sd if (m := re.match(r"encoder\.down\.(\d+)\.", k)))
    layers = 1 + max(int(m.group(1)) for k in sd if (m := re.match(r"encoder\.down\.0\.block\.(\d+)\.", k)))
    widths = tuple(shape(f"encoder.down.{i}.block.0.conv1.conv.weight")[0] for i in range(levels))
    downs = [i for i in range(levels) if f"encoder.down.{i}.downsample.conv.conv.weight" in sd]
    temporal, match = 0, True  # a resample between equal widths says nothing about matching
    for i in downs:
        after = shape(f"encoder.down.{i + 1}.block.0.conv1.conv.weight")[1]  # channels out of the downsample
        match = after == widths[i + 1] if widths[i] != widths[i + 1] else match
        temporal += after // shape(f"encoder.down.{i}.downsample.conv.conv.weight")[0] == 8
    up_match, rev = True, widths[::-1]
    for i in range(levels - 1):
        if f"decoder.up.{i}.upsample.conv.conv.weight" in sd:
            after = shape(f"decoder.up.{i + 1}.block.0.conv1.conv.weight")[1]
            up_match = after == rev[i + 1] if rev[i] != rev[i + 1] else up_match
    return HY15VAEConfig(in_channels=shape("encoder.conv_in.conv.weight")[1],
                         out_channels=shape("decoder.conv_out.conv.weight")[0],
                         latent_channels=shape("decoder.conv_in.conv.weight")[1], block_out_channels=widths,
                         layers_per_block=layers, spatial_compression_ratio=2 ** len(downs),
                         temporal_compression_ratio=2 ** temporal, downsample_match_channel=match,
                         upsample_match_channel=up_match, scaling_factor=HY15_VAE_CONFIG.scaling_factor,
                         shift_factor=HY15_VAE_CONFIG.shift_factor)


# ---------------------------------------------------------------- loading

PRESETS = {"hy15": HY15_VAE_CONFIG, "hy15-tiny": HY15_VAE_TINY}


def load_hy15_vae(source: str | os.PathLike, dtype: torch.dtype | None = None, device=None,
                  config: HY15VAEConfig | None = None, seed: int = 0) -> HunyuanVideo15VAE:
    """A `HunyuanVideo15VAE` from
      `preset:NAME`          seeded random init (`seed`) of `PRESETS[NAME]` (hy15, hy15-tiny);
      a folder               a `vae/` folder (or a pipeline folder holding one): config.json + weights,
                             Tencent's or diffusers';
      a file                 `.safetensors` / `.pth` in any of `LAYOUTS`, detected from the key names.
    The config: `config`, else the config.json of the folder or beside the file (diffusers', Tencent's
    or our field names), else inferred from the weight shapes. dtype None keeps the stored dtype."""
    src = str(source)
    name = preset_name(src)
    if name is not None:
        if config is None and name not in PRESETS:
            raise WeightsError(f"{src}: unknown HunyuanVideo 1.5 VAE preset {name!r}; valid: {', '.join(PRESETS)}")
        model = HunyuanVideo15VAE(config or PRESETS[name], seed=seed).to(device)
        return model.to(dtype=dtype) if dtype is not None else model
    path = Path(src)
    if path.is_dir() and (path / "vae").is_dir():
        path = path / "vae"
    try:
        sd, layout = hy15_vae_to_native(read_state_dict(path))
    except ValueError as exc:
        raise WeightsError(f"{path}: {exc}") from exc
    config_json = (path if path.is_dir() else path.parent) / "config.json"
    if config is None and config_json.is_file():
        try:
            config = hy15_vae_config_from_json(json.loads(config_json.read_text()))
        except (ValueError, TypeError) as exc:
            raise WeightsError(f"{config_json}: not a HunyuanVideo 1.5 VAE config ({exc})") from exc
    if config is None:
        config = hy15_vae_config_from_shapes(sd)
    return materialize(HunyuanVideo15VAE, config, sd, f"{path} ({layout} layout)", dtype, device)
