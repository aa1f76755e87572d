"""LTX-2 video VAE weights in and out: key names between ours and diffusers', configs from diffusers'
config.json or Lightricks' checkpoint metadata, and `load_ltx2_vae`.

Key layouts (the tensors are the same in all; only names change):

    original     Lightricks' VAE names (ltx-core `VideoEncoder` / `ConvVideoDecoder` / `PerChannelStatistics`),
                 as a standalone VAE file holds them, ComfyUI's split VAE files included:
                 `encoder.down_blocks.0.res_blocks.0.conv1.conv.weight`, `decoder.up_blocks.1.conv.conv.weight`,
                 `per_channel_statistics.mean-of-means`. These are our module names. Lightricks' files
                 also hold `per_channel_statistics.channel` and `.mean-of-stds`, which no network reads
                 (ltx-core's `PerChannelStatistics` has no such buffers; diffusers' converter drops
                 them): dropped here too.
    single_file  the same under `vae.`, as Lightricks' combined checkpoints (ltx-2-19b-dev.safetensors, ...)
                 hold the VAE beside `model.diffusion_model.`, `audio_vae.`, `vocoder.`, ...; ComfyUI reads
                 those files as they are. Only the `vae.` part is read.
    diffusers    `AutoencoderKLLTX2Video`: Lightricks' flat block lists regrouped (diffusers'
                 scripts/convert_ltx2_to_diffusers.py `LTX_2_0_VIDEO_VAE_RENAME_DICT`): encoder
                 `down_blocks.{2i}` (res stage) -> `down_blocks.{i}.resnets`, `down_blocks.{2i+1}`
                 (downsample) -> `down_blocks.{i}.downsamplers.0`, the last stage -> `mid_block`; decoder
                 `up_blocks.0` -> `mid_block`, `up_blocks.{2i+1}` -> `up_blocks.{i}.upsamplers.0`,
                 `up_blocks.{2i+2}` -> `up_blocks.{i}`; `res_blocks` -> `resnets`; `last_time_embedder`,
                 `last_scale_shift_table` -> `time_embedder`, `scale_shift_table`; the statistics ->
                 `latents_mean`, `latents_std`.

A key no rule knows is an error naming it (`ValueError`), in every direction; a file that does not fit
the model is a `WeightsError` naming the file and its first missing / unexpected / wrong-shape keys.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch
from safetensors import safe_open

from video_dit.families.ltx2.vae import LTX2VideoVAE
from video_dit.families.ltx2.vae_config import PRESETS, LTX2VAEConfig
from video_dit.models.layouts import preset_name
from video_dit.models.weights import WeightsError, materialize, read_state_dict

SINGLE_FILE_PREFIX = "vae."
LAYOUTS = ("original", "single_file", "diffusers")
UNUSED_ORIGINAL = ("per_channel_statistics.channel", "per_channel_statistics.mean-of-stds")

# ---------------------------------------------------------------- key names

_RES = r"\.\d+\.(?:conv[12]\.conv\.(?:weight|bias)|scale_shift_table)"  # after `res_blocks` / `resnets`
_EMB_LEAF = r"timestep_embedder\.linear_[12]\.(?:weight|bias)"
_EMB = rf"time_embedder\.{_EMB_LEAF}"
# ours: encoder.down_blocks.K / decoder.up_blocks.K, K even a res stage, K odd a resample
_SIDE = r"(?P<side>encoder(?=\.down_)|decoder(?=\.up_))\.(?:down|up)_blocks"
_OURS_STAGE = re.compile(rf"{_SIDE}\.(?P<k>\d*[02468])\.(?P<leaf>res_blocks{_RES}|{_EMB})")
_OURS_RESAMPLE = re.compile(rf"{_SIDE}\.(?P<k>\d*[13579])\.conv\.conv\.(?P<p>weight|bias)")
# diffusers: down_blocks.i / up_blocks.i = a stage and its resample (the encoder's stage first, the decoder's last)
_DIFF_STAGE = re.compile(rf"(?:{_SIDE}\.(?P<i>\d+)|(?P<mid>encoder|decoder)\.mid_block)"
                         rf"\.(?P<leaf>resnets{_RES}|{_EMB})")
_DIFF_RESAMPLE = re.compile(r"(?:(?P<side>encoder)\.down_blocks\.(?P<i>\d+)\.downsamplers"
                            r"|(?P<side2>decoder)\.up_blocks\.(?P<j>\d+)\.upsamplers)"
                            r"\.0\.conv\.conv\.(?P<p>weight|bias)")
_SAME = re.compile(r"(encoder|decoder)\.(conv_in|conv_out)\.conv\.(weight|bias)|decoder\.timestep_scale_multiplier")
_RENAMED = {"per_channel_statistics.mean-of-means": "latents_mean",
            "per_channel_statistics.std-of-means": "latents_std",
            "decoder.last_scale_shift_table": "decoder.scale_shift_table"}
_HEAD = re.compile(rf"decoder\.(?P<name>last_time_embedder|time_embedder)\.(?P<leaf>{_EMB_LEAF})")
_BLOCKS = {"encoder": "down_blocks", "decoder": "up_blocks"}
_SAMPLERS = {"encoder": "downsamplers", "decoder": "upsamplers"}


def _unknown(keys: list[str], what: str) -> None:
    if keys:
        raise ValueError(f"{len(keys)} key(s) not in the {what} layout of the LTX-2 video VAE: "
                         f"{', '.join(keys[:8])}{' ...' if len(keys) > 8 else ''}")


def ltx2_vae_to_diffusers(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Ours (Lightricks') keys -> diffusers `AutoencoderKLLTX2Video` keys; tensors unchanged."""
    downs = {int(m.group("k")) for k in sd if (m := _OURS_RESAMPLE.fullmatch(k)) and m.group("side") == "encoder"}
    mid = 2 * len(downs)  # the encoder's last stage
    out, unknown = {}, []
    for key, value in sd.items():
        if _SAME.fullmatch(key):
            out[key] = value
        elif key in _RENAMED:
            out[_RENAMED[key]] = value
        elif (m := _HEAD.fullmatch(key)) and m.group("name") == "last_time_embedder":
            out[f"decoder.time_embedder.{m.group('leaf')}"] = value
        elif m := _OURS_RESAMPLE.fullmatch(key):
            side = m.group("side")  # resample 2i + 1 -> level i's
            out[f"{side}.{_BLOCKS[side]}.{int(m.group('k')) // 2}.{_SAMPLERS[side]}.0.conv.conv.{m.group('p')}"] = value
        elif m := _OURS_STAGE.fullmatch(key):
            side, k, leaf = m.group("side"), int(m.group("k")), m.group("leaf").replace("res_blocks.", "resnets.", 1)
            if side == "encoder":  # stage 2i -> level i, the last -> mid_block
                block = "mid_block" if k == mid else f"down_blocks.{k // 2}"
            else:  # stage 0 -> mid_block, stage 2i + 2 -> level i
                block = "mid_block" if k == 0 else f"up_blocks.{k // 2 - 1}"
            out[f"{side}.{block}.{leaf}"] = value
        else:
            unknown.append(key)
    _unknown(unknown, "original (ours)")
    return out


def ltx2_vae_from_diffusers(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """diffusers `AutoencoderKLLTX2Video` keys -> ours (Lightricks'); tensors unchanged."""
    downs = {m.group("i") for k in sd if (m := _DIFF_RESAMPLE.fullmatch(k)) and m.group("side")}
    back = {v: k for k, v in _RENAMED.items()}
    out, unknown = {}, []
    for key, value in sd.items():
        if _SAME.fullmatch(key):
            out[key] = value
        elif key in back:
            out[back[key]] = value
        elif (m := _HEAD.fullmatch(key)) and m.group("name") == "time_embedder":
            out[f"decoder.last_time_embedder.{m.group('leaf')}"] = value
        elif m := _DIFF_RESAMPLE.fullmatch(key):
            side, i = m.group("side") or m.group("side2"), m.group("i") or m.group("j")
            out[f"{side}.{_BLOCKS[side]}.{2 * int(i) + 1}.conv.conv.{m.group('p')}"] = value
        elif m := _DIFF_STAGE.fullmatch(key):
            side, i = m.group("side") or m.group("mid"), m.group("i")
            leaf = m.group("leaf").replace("resnets.", "res_blocks.", 1)
            if side == "encoder":
                k = 2 * len(downs) if i is None else 2 * int(i)
            else:
                k = 0 if i is None else 2 * int(i) + 2
            out[f"{side}.{_BLOCKS[side]}.{k}.{leaf}"] = value
        else:
            unknown.append(key)
    _unknown(unknown, "diffusers")
    return out


def ltx2_vae_from_original(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Lightricks' standalone VAE keys are ours: checked (an unknown key is an error), the two unused
    statistics buffers dropped, nothing renamed."""
    sd = {k: v for k, v in sd.items() if k not in UNUSED_ORIGINAL}
    ltx2_vae_to_diffusers(sd)  # checks every key
    return sd


def ltx2_vae_from_single_file(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The `vae.` part of a Lightricks / ComfyUI combined checkpoint -> ours."""
    part = {k[len(SINGLE_FILE_PREFIX):]: v for k, v in sd.items() if k.startswith(SINGLE_FILE_PREFIX)}
    if not part:
        raise ValueError(f"no `{SINGLE_FILE_PREFIX}` keys: not a combined LTX-2 checkpoint")
    return ltx2_vae_from_original(part)


def ltx2_vae_to_single_file(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Ours -> the `vae.` keys of a combined checkpoint (checked first)."""
    return {SINGLE_FILE_PREFIX + k: v for k, v in ltx2_vae_from_original(sd).items()}


def ltx2_vae_key_layout(sd) -> str:
    """"single_file" (any `vae.` key), "diffusers" (`mid_block` / `resnets` / `latents_mean`) or
    "original" (`res_blocks` / `per_channel_statistics` / Lightricks' flat blocks), from the key names;
    an error naming the accepted layouts otherwise."""
    keys = list(sd)
    if any(k.startswith(SINGLE_FILE_PREFIX) for k in keys):
        return "single_file"
    if any(".mid_block." in k or ".resnets." in k or k in ("latents_mean", "latents_std") for k in keys):
        return "diffusers"
    if any(".res_blocks." in k or k.startswith("per_channel_statistics.")
           or re.match(r"(en|de)coder\.(down|up)_blocks\.", k) for k in keys):
        return "original"
    raise ValueError("not an LTX-2 video VAE state dict; accepted: Lightricks' keys (`encoder.down_blocks.0.res_blocks"
                     ".0.conv1.conv.weight`), a combined checkpoint's (the same under `vae.`) or diffusers' "
                     f"(`encoder.down_blocks.0.resnets.0...`); first keys: {', '.join(sorted(keys)[:5])}")


def ltx2_vae_to_native(sd: dict[str, torch.Tensor], layout: str | None = None) -> tuple[dict, str]:
    """(our keys, the layout read): any of `LAYOUTS`, detected from the names when `layout` is None."""
    layout = layout or ltx2_vae_key_layout(sd)
    convert = {"original": ltx2_vae_from_original, "single_file": ltx2_vae_from_single_file,
               "diffusers": ltx2_vae_from_diffusers}
    if layout not in convert:
        raise ValueError(f"layout={layout!r}; accepted: {', '.join(LAYOUTS)}")
    return convert[layout](sd), layout


# ---------------------------------------------------------------- configs

_KIND_TO_DIFFUSERS = {"space": "spatial", "time": "temporal", "all": "spatiotemporal"}
_KIND_FROM_DIFFUSERS = {v: k for k, v in _KIND_TO_DIFFUSERS.items()}


def ltx2_vae_config_to_diffusers(config: LTX2VAEConfig) -> dict:
    """`LTX2VAEConfig` -> `AutoencoderKLLTX2Video(**kwargs)` arguments (diffusers lists the decoder from
    the output end and names each width before its upsample, times the upsample's channel reduction)."""
    n_down, n_up = len(config.encoder_downsamples), len(config.decoder_upsamples)
    dw = config.decoder_widths
    return dict(
        in_channels=config.in_channels, out_channels=config.in_channels, latent_channels=config.latent_channels,
        block_out_channels=list(config.encoder_widths[1:]), down_block_types=["LTX2VideoDownBlock3D"] * n_down,
        layers_per_block=list(config.encoder_layers), spatio_temporal_scaling=[True] * n_down,
        downsample_type=[_KIND_TO_DIFFUSERS[k] for k in config.encoder_downsamples],
        decoder_block_out_channels=list(dw[:-1][::-1]), decoder_layers_per_block=list(config.decoder_layers[::-1]),
        decoder_spatio_temporal_scaling=[True] * n_up, decoder_inject_noise=[False] * (n_up + 1),
        upsample_type=[_KIND_TO_DIFFUSERS[k] for k in config.decoder_upsamples],  # diffusers reads it in run order
        upsample_residual=list(config.decoder_residual[::-1]),
        upsample_factor=[dw[i] // dw[i + 1] for i in range(n_up)][::-1],
        timestep_conditioning=config.timestep_conditioning, patch_size=config.patch_size, patch_size_t=1,
        encoder_causal=True, decoder_causal=config.decoder_causal,
        encoder_spatial_padding_mode=config.encoder_padding, decoder_spatial_padding_mode=config.decoder_padding,
        spatial_compression_ratio=config.spatial_compression, temporal_compression_ratio=config.temporal_compression)


# diffusers' constructor arguments whose only accepted value is the one our network has
_DIFFUSERS_FIXED = {"patch_size_t": 1, "encoder_causal": True, "scaling_factor": 1.0, "resnet_norm_eps": 1e-6}


def ltx2_vae_config_from_diffusers(d: dict) -> LTX2VAEConfig:
    """A diffusers `AutoencoderKLLTX2Video` config.json dict -> `LTX2VAEConfig`. Every key must be given
    (diffusers' saved configs hold all); what our network cannot be (noise injection, levels without a
    resample, a res block changing width, channels in != out) is an error naming the key."""
    d = {k: v for k, v in d.items() if not k.startswith("_")}
    need = set(ltx2_vae_config_to_diffusers(LTX2VAEConfig())) | set(_DIFFUSERS_FIXED) | {"decoder_upsample_type"}
    unknown, missing = sorted(set(d) - need), sorted(need - set(d) - {"decoder_upsample_type", "scaling_factor",
                                                                      "resnet_norm_eps"})
    if unknown or missing:
        raise ValueError(f"AutoencoderKLLTX2Video config: unknown keys {unknown}, missing keys {missing}")

    def bad(key: str, why: str):
        raise ValueError(f"AutoencoderKLLTX2Video config: {key}={d[key]!r}: {why}")

    for key, value in _DIFFUSERS_FIXED.items():
        if key in d and d[key] != value:
            bad(key, f"accepted: {value!r}")
    if d.get("decoder_upsample_type") is not None:
        bad("decoder_upsample_type", "accepted: null (upsample_type is the one diffusers reads)")
    def flags(key: str) -> list[bool]:  # diffusers takes one bool or one per level
        return list(d[key]) if isinstance(d[key], (list, tuple)) else [d[key]]

    for key in ("spatio_temporal_scaling", "decoder_spatio_temporal_scaling"):
        if not all(flags(key)):
            bad(key, "every level resamples in LTX-2; accepted: all true")
    if any(flags("decoder_inject_noise")):
        bad("decoder_inject_noise", "no LTX-2 VAE injects noise; accepted: all false")
    if any(t != "LTX2VideoDownBlock3D" for t in d["down_block_types"]):
        bad("down_block_types", "accepted: LTX2VideoDownBlock3D")
    if d["out_channels"] != d["in_channels"]:
        bad("out_channels", f"must equal in_channels={d['in_channels']}")
    n_up = len(d["decoder_block_out_channels"])
    residual = flags("upsample_residual") * (n_up if isinstance(d["upsample_residual"], bool) else 1)
    factors = list(d["upsample_factor"])[::-1]
    rev = list(d["decoder_block_out_channels"])[::-1]  # the width before each upsample, from the latent end
    widths = [rev[0]] + [rev[i] // factors[i] for i in range(n_up)]
    for i in range(1, n_up):
        if rev[i] != widths[i]:
            bad("decoder_block_out_channels", f"level {i} starts at {widths[i]} channels but is {rev[i]} wide: "
                                              "a res block would change the width (not in LTX-2)")
    try:
        config = LTX2VAEConfig(
            in_channels=d["in_channels"], latent_channels=d["latent_channels"], patch_size=d["patch_size"],
            encoder_widths=(d["latent_channels"], *d["block_out_channels"]),
            encoder_layers=tuple(d["layers_per_block"]),
            encoder_downsamples=tuple(_KIND_FROM_DIFFUSERS.get(k, k) for k in d["downsample_type"]),
            decoder_widths=tuple(widths), decoder_layers=tuple(d["decoder_layers_per_block"][::-1]),
            decoder_upsamples=tuple(_KIND_FROM_DIFFUSERS.get(k, k) for k in d["upsample_type"]),  # in run order
            decoder_residual=tuple(residual[::-1]), encoder_padding=d["encoder_spatial_padding_mode"],
            decoder_padding=d["decoder_spatial_padding_mode"], decoder_causal=d["decoder_causal"],
            timestep_conditioning=d["timestep_conditioning"])
    except ValueError as exc:
        raise ValueError(f"AutoencoderKLLTX2Video config: {exc}") from exc
    for key, ours in (("spatial_compression_ratio", config.spatial_compression),
                      ("temporal_compression_ratio", config.temporal_compression)):
        if d[key] is not None and d[key] != ours:
            bad(key, f"the blocks compress by {ours}")
    return config


# ltx-core `SpatioTemporalScaleFactors.from_blocks` / `_make_encoder_block` names -> our resample kinds
_LTX_DOWN = {"compress_space_res": "space", "compress_time_res": "time", "compress_all_res": "all"}
_LTX_UP = {"compress_space": "space", "compress_time": "time", "compress_all": "all"}


def ltx2_vae_config_from_ltx(vae: dict) -> LTX2VAEConfig:
    """The `config["vae"]` dict of a Lightricks checkpoint's metadata (class `CausalVideoAutoencoder`)
    -> `LTX2VAEConfig`, read as ltx-core's `model_configurator.py` reads it (the keys it reads, its
    defaults for absent ones, other keys ignored as there). Blocks our network has no form for (conv
    resamples, attention, group norm, a width-changing res block, noise injection) are errors."""
    name = vae.get("_class_name", "CausalVideoAutoencoder")
    if name != "CausalVideoAutoencoder":
        raise ValueError(f"VAE class {name!r}: only the conv VAE (CausalVideoAutoencoder) is built here; LTX-2.5's "
                         "diffusion decoder (CausalDiffusionVAE) is another network")
    for key, accepted in (("dims", 3), ("norm_layer", "pixel_norm"), ("latent_log_var", "uniform")):
        if vae.get(key, accepted) != accepted:
            raise ValueError(f"LTX-2 VAE metadata: {key}={vae[key]!r}; accepted: {accepted!r}")

    def stages(blocks, kinds: dict, side: str):
        layers, resamples, multipliers = [], [], []
        expect_stage = True
        for block in blocks:
            block_name, params = block
            params = {"num_layers": params} if isinstance(params, int) else dict(params)
            if block_name == "res_x":
                if params.get("inject_noise", False):
                    raise ValueError(f"LTX-2 VAE metadata: {side}_blocks res_x inject_noise=true is not supported")
                if not expect_stage:  # two stages in a row: one stage of their sum
                    layers[-1] += params["num_layers"]
                else:
                    layers.append(params["num_layers"])
                expect_stage = False
            elif block_name in kinds:
                if expect_stage:
                    layers.append(0)
                resamples.append(kinds[block_name])
                # ltx-core `_make_decoder_block` passes `residual` to "compress_all" only; the others never add theirs
                residual = params.get("residual", False) and block_name == "compress_all"
                multipliers.append((params.get("multiplier", 2 if side == "encoder" else 1), residual))
                expect_stage = True
            else:
                raise ValueError(f"LTX-2 VAE metadata: {side}_blocks has {block_name!r}; accepted: res_x, "
                                 f"{', '.join(kinds)}")
        if expect_stage:
            layers.append(0)
        return layers, resamples, multipliers

    L = vae.get("latent_channels", 128)
    e_layers, e_kinds, e_mult = stages(vae.get("encoder_blocks", []), _LTX_DOWN, "encoder")
    d_layers, d_kinds, d_mult = stages(vae.get("decoder_blocks", []), _LTX_UP, "decoder")  # encoder order
    e_widths = [L]
    for m, _ in e_mult:
        e_widths.append(e_widths[-1] * m)
    d_widths = [vae.get("decoder_base_channels", 128)]  # the lists start at the output end
    for m, _ in d_mult:
        d_widths.append(d_widths[-1] * m)
    return LTX2VAEConfig(
        in_channels=vae.get("in_channels", 3), latent_channels=L, patch_size=vae.get("patch_size", 4),
        encoder_widths=tuple(e_widths), encoder_layers=tuple(e_layers), encoder_downsamples=tuple(e_kinds),
        decoder_widths=tuple(d_widths[::-1]), decoder_layers=tuple(d_layers[::-1]),
        decoder_upsamples=tuple(d_kinds[::-1]), decoder_residual=tuple(r for _, r in d_mult[::-1]),
        # ltx-core reads `spatial_padding_mode` for both (since 2026-03; `encoder_spatial_padding_mode` before)
        encoder_padding=vae.get("spatial_padding_mode", vae.get("encoder_spatial_padding_mode", "zeros")),
        decoder_padding=vae.get("spatial_padding_mode", "reflect"), decoder_causal=vae.get("causal_decoder", False),
        timestep_conditioning=vae.get("timestep_conditioning", True))


def ltx2_vae_release_from_shapes(sd: dict) -> LTX2VAEConfig:
    """The released config whose weights have exactly these names and shapes (residual upsamples and
    paddings leave no trace in the weights, so they are the release's)."""
    shapes = {k: tuple(v.shape) for k, v in sd.items()}
    for config in (PRESETS["ltx2.0"], PRESETS["ltx2.3"]):
        with torch.device("meta"):
            expected = {k: tuple(v.shape) for k, v in LTX2VideoVAE(config).state_dict().items()}
        if expected == shapes:
            return config
    raise ValueError("the weights match no released LTX-2 VAE (2.0, 2.3) and come without a config: pass config=, "
                     "or keep the checkpoint's metadata / config.json beside it")


# ---------------------------------------------------------------- loading


def _safetensors_config(path: Path) -> dict | None:
    """`config["vae"]` of a Lightricks safetensors file's metadata, or None."""
    if path.suffix != ".safetensors":
        return None
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    if "config" not in meta:
        return None
    return json.loads(meta["config"]).get("vae")


def load_ltx2_vae(source: str | os.PathLike, dtype: torch.dtype | None = None, device=None,
                  config: LTX2VAEConfig | None = None, seed: int = 0) -> LTX2VideoVAE:
    """An `LTX2VideoVAE` from
      `preset:NAME`   seeded random init (`seed`) of `PRESETS[NAME]` (ltx2.0, ltx2.3, ltx2.5, ltx2-tiny);
      a folder        a diffusers `vae/` folder (or a pipeline folder holding one): config.json + weights;
      a file          `.safetensors` / `.pth` in any of `LAYOUTS` (detected from the key names): a standalone
                      VAE or a combined checkpoint (its `vae.` part).
    The config: `config`, else the file's metadata (Lightricks'), else a config.json in the folder or
    beside the file (diffusers'), else the release whose weight shapes these are. dtype None keeps
    the stored dtype."""
    src = str(source)
    name = preset_name(src)
    if name is not None:
        if config is None and name not in PRESETS:
            raise WeightsError(f"{src}: unknown LTX-2 VAE preset {name!r}; valid: {', '.join(PRESETS)}")
        model = LTX2VideoVAE(config or PRESETS[name], seed=seed).to(device)
        return model.to(dtype=dtype) if dtype is not None else model
    path = Path(src)
    if path.is_dir() and (path / "vae").is_dir():
        path = path / "vae"
    try:
        sd, layout = ltx2_vae_to_native(read_state_dict(path))
        if config is None and path.is_file() and (meta := _safetensors_config(path)) is not None:
            config = ltx2_vae_config_from_ltx(meta)
        config_json = (path if path.is_dir() else path.parent) / "config.json"
        if config is None and config_json.is_file():
            config = ltx2_vae_config_from_diffusers(json.loads(config_json.read_text()))
        if config is None:
            config = ltx2_vae_release_from_shapes(sd)
    except (ValueError, TypeError, KeyError) as exc:
        raise WeightsError(f"{path}: {exc}") from exc
    return materialize(LTX2VideoVAE, config, sd, f"{path} ({layout} layout)", dtype, device)

