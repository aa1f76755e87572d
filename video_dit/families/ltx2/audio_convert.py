"""LTX-2's audio VAE, vocoder and text connectors in and out: key names between ours (Lightricks' single-file
names) and diffusers', configs from diffusers' config.json or Lightricks' safetensors metadata, and loaders.

Key layouts (the tensors are the same; only names change):

    original   Lightricks' single files (ltx-2-19b-dev.safetensors and the like): the audio VAE under
               `audio_vae.` (`audio_vae.encoder.down.0.block.0.conv1.conv.weight`, `audio_vae.
               per_channel_statistics.mean-of-means`), the vocoder under `vocoder.` (LTX-2.3's as
               `vocoder.vocoder.`, `vocoder.bwe_generator.`, `vocoder.mel_stft.`), the connectors as
               `model.diffusion_model.{video,audio}_embeddings_connector.` and `text_embedding_projection.`
               (top level or under `model.diffusion_model.`), beside the DiT and the video VAE. Ours are
               these names without the component's prefix (ltx-core strips it the same way:
               AUDIO_VAE_*_COMFY_KEYS_FILTER, VOCODER_COMFY_KEYS_FILTER, EMBEDDINGS_PROCESSOR_KEY_OPS).
    diffusers  `AutoencoderKLLTX2Audio` (the statistics as `latents_mean` / `latents_std`), `LTX2Vocoder`
               (`conv_in`, `upsamplers`, `resnets`, `act_out`, `conv_out`, `downsample.filter`),
               `LTX2VocoderWithBWE` (those under `vocoder.` / `bwe_generator.`), `LTX2TextConnectors`
               (`text_proj_in`, `{video,audio}_text_proj_in`, `{video,audio}_connector.transformer_blocks`,
               `norm_q`, `norm_k`): the names of diffusers' scripts/convert_ltx2_to_diffusers.py.
    native     ours, as `state_dict()` writes them.

A key no rule knows is an error naming it (`ValueError`, and `WeightsError` naming the file when loading).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch
from safetensors import safe_open

from video_dit.families.ltx2.audio_config import (
    AUDIO_VAE_CONFIGS, LTX2_AUDIO_VAE, LTX2_VOCODER, LTX23_VOCODER, VOCODER_CONFIGS, AudioVAEConfig,
    VocoderBWEConfig, VocoderConfig)
from video_dit.families.ltx2.audio_vae import LTX2AudioVAE
from video_dit.families.ltx2.connectors import (
    CONNECTOR_CONFIGS, LTX2_CONNECTORS, LTX23_CONNECTORS, ConnectorConfig, LTX2TextConnectors, StreamConfig)
from video_dit.families.ltx2.vocoder import LTX2Vocoder, LTX2VocoderWithBWE
from video_dit.models.layouts import preset_name
from video_dit.models.weights import WeightsError, materialize, open_weights

LAYOUTS = ("original", "diffusers", "native")
DIT_PREFIX = "model.diffusion_model."

# ---------------------------------------------------------------- the names each of our modules has

_P = r"\.(weight|bias)"
_RES = r"(norm[12]|(conv[12]|nin_shortcut)\.conv)" + _P
_ATTN = r"(q|k|v|proj_out|norm)" + _P
_AUDIO_VAE_KEY = re.compile(
    r"(encoder|decoder)\.((conv_in|conv_out)\.conv" + _P + r"|norm_out" + _P + r"|mid\.block_[12]\." + _RES
    + r"|mid\.attn_1\." + _ATTN + r"|(down|up)\.\d+\.block\.\d+\." + _RES + r"|(down|up)\.\d+\.attn\.\d+\." + _ATTN
    + r"|down\.\d+\.downsample\.conv" + _P + r"|up\.\d+\.upsample\.conv\.conv" + _P + r")"
    + r"|per_channel_statistics\.(mean|std)-of-means")
_ACT = r"(act\.(alpha|beta)|upsample\.filter|downsample\.lowpass\.filter)"
_GENERATOR = (r"((conv_pre|conv_post)" + _P + r"|ups\.\d+" + _P + r"|resblocks\.\d+\.convs[12]\.\d+" + _P
              + r"|resblocks\.\d+\.acts[12]\.\d+\." + _ACT + r"|act_post\." + _ACT + r")")
_VOCODER_KEY = re.compile(_GENERATOR)
_BWE_KEY = re.compile(r"(vocoder|bwe_generator)\." + _GENERATOR
                      + r"|mel_stft\.(mel_basis|stft_fn\.(forward|inverse)_basis)")
_CONNECTOR_KEY = re.compile(
    r"text_embedding_projection\.(aggregate_embed|video_aggregate_embed|audio_aggregate_embed)" + _P
    + r"|(video|audio)_embeddings_connector\.(learnable_registers|transformer_1d_blocks\.\d+\.(attn1\.(to_q|to_k|"
    r"to_v|to_out\.0|to_gate_logits|q_norm|k_norm)|ff\.net\.(0\.proj|2))" + _P + r")")

# (pattern, replacement) pairs applied in order to every key, one tuple per direction (anchored where a name
# is the suffix of another)
_AUDIO_VAE_TO_DIFFUSERS = ((r"^per_channel_statistics\.mean-of-means$", "latents_mean"),
                           (r"^per_channel_statistics\.std-of-means$", "latents_std"))
_AUDIO_VAE_FROM_DIFFUSERS = ((r"^latents_mean$", "per_channel_statistics.mean-of-means"),
                             (r"^latents_std$", "per_channel_statistics.std-of-means"))
_GENERATOR_TO_DIFFUSERS = ((r"(^|\.)conv_pre\.", r"\1conv_in."), (r"(^|\.)conv_post\.", r"\1conv_out."),
                           (r"(^|\.)act_post\.", r"\1act_out."), (r"(^|\.)ups\.", r"\1upsamplers."),
                           (r"(^|\.)resblocks\.", r"\1resnets."),
                           (r"\.downsample\.lowpass\.filter$", ".downsample.filter"))
_GENERATOR_FROM_DIFFUSERS = ((r"(^|\.)conv_in\.", r"\1conv_pre."), (r"(^|\.)conv_out\.", r"\1conv_post."),
                             (r"(^|\.)act_out\.", r"\1act_post."), (r"(^|\.)upsamplers\.", r"\1ups."),
                             (r"(^|\.)resnets\.", r"\1resblocks."),
                             (r"\.downsample\.filter$", ".downsample.lowpass.filter"))
_CONNECTOR_TO_DIFFUSERS = ((r"^text_embedding_projection\.aggregate_embed\.", "text_proj_in."),
                           (r"^text_embedding_projection\.video_aggregate_embed\.", "video_text_proj_in."),
                           (r"^text_embedding_projection\.audio_aggregate_embed\.", "audio_text_proj_in."),
                           (r"^video_embeddings_connector\.", "video_connector."),
                           (r"^audio_embeddings_connector\.", "audio_connector."),
                           (r"\.transformer_1d_blocks\.", ".transformer_blocks."),
                           (r"\.attn1\.q_norm\.", ".attn1.norm_q."), (r"\.attn1\.k_norm\.", ".attn1.norm_k."))
_CONNECTOR_FROM_DIFFUSERS = ((r"^text_proj_in\.", "text_embedding_projection.aggregate_embed."),
                             (r"^video_text_proj_in\.", "text_embedding_projection.video_aggregate_embed."),
                             (r"^audio_text_proj_in\.", "text_embedding_projection.audio_aggregate_embed."),
                             (r"^video_connector\.", "video_embeddings_connector."),
                             (r"^audio_connector\.", "audio_embeddings_connector."),
                             (r"\.transformer_blocks\.", ".transformer_1d_blocks."),
                             (r"\.attn1\.norm_q\.", ".attn1.q_norm."), (r"\.attn1\.norm_k\.", ".attn1.k_norm."))


def _apply(key: str, pairs) -> str:
    for pattern, repl in pairs:
        key = re.sub(pattern, repl, key)
    return key


def _names(keys, pairs, valid: re.Pattern, what: str, to_ours: bool) -> dict[str, str]:
    """{new name: old name} for every key; the native side of each name must match `valid`, else a
    `ValueError` naming the first unknown keys."""
    out, unknown = {}, []
    for key in keys:
        new = _apply(key, pairs)
        if not valid.fullmatch(new if to_ours else key):
            unknown.append(key)
        out[new] = key
    if unknown:
        raise ValueError(f"{len(unknown)} key(s) not in the {what}: {', '.join(sorted(unknown)[:8])}"
                         f"{' ...' if len(unknown) > 8 else ''}")
    return out


def _renamed(sd: dict, names: dict[str, str]) -> dict:
    return {new: sd[old] for new, old in names.items()}


def _select(keys, prefixes: tuple[str, ...], strip: str = "") -> dict[str, str]:
    """{stripped name: key} of the keys under `prefixes`, `strip` removed once from their front."""
    return {k[len(strip):] if strip and k.startswith(strip) else k: k for k in keys if k.startswith(prefixes)}


# ---------------------------------------------------------------- audio VAE


def audio_vae_key_layout(keys) -> str:
    """"original" (`audio_vae.` keys, maybe among other components'), "diffusers" (`latents_mean`) or
    "native" (`per_channel_statistics.mean-of-means`); an error naming the accepted layouts otherwise."""
    keys = list(keys)
    if any(k.startswith("audio_vae.") for k in keys):
        return "original"
    if "latents_mean" in keys:
        return "diffusers"
    if "per_channel_statistics.mean-of-means" in keys:
        return "native"
    raise ValueError("not an LTX-2 audio VAE state dict: no `audio_vae.*` keys (Lightricks' file), no `latents_mean` "
                     "(diffusers' AutoencoderKLLTX2Audio), no `per_channel_statistics.mean-of-means` (ours); "
                     f"first keys: {', '.join(sorted(keys)[:5])}")


def audio_vae_names(keys, layout: str | None = None) -> tuple[dict[str, str], str]:
    """({our name: the source's name}, the layout read) for an audio VAE's keys in any of `LAYOUTS`."""
    keys = list(keys)
    layout = layout or audio_vae_key_layout(keys)
    what = f"{layout} layout of the LTX-2 audio VAE"
    if layout == "original":
        selected = _select(keys, ("audio_vae.",), "audio_vae.")
        names = _names(selected, (), _AUDIO_VAE_KEY, what, to_ours=True)
        return {k: selected[k] for k in names}, layout
    if layout == "diffusers":
        return _names(keys, _AUDIO_VAE_FROM_DIFFUSERS, _AUDIO_VAE_KEY, what, to_ours=True), layout
    if layout == "native":
        return _names(keys, (), _AUDIO_VAE_KEY, what, to_ours=True), layout
    raise ValueError(f"layout={layout!r}; accepted: {', '.join(LAYOUTS)}")


def audio_vae_to_native(sd: dict, layout: str | None = None) -> tuple[dict, str]:
    names, layout = audio_vae_names(sd, layout)
    return _renamed(sd, names), layout


def audio_vae_to_diffusers(sd: dict) -> dict:
    """Ours -> diffusers' `AutoencoderKLLTX2Audio` keys; tensors unchanged."""
    return _renamed(sd, _names(sd, _AUDIO_VAE_TO_DIFFUSERS, _AUDIO_VAE_KEY, "native layout of the LTX-2 audio VAE",
                               to_ours=False))


def audio_vae_to_original(sd: dict) -> dict:
    """Ours -> Lightricks' single-file keys (`audio_vae.` prefix)."""
    _names(sd, (), _AUDIO_VAE_KEY, "native layout of the LTX-2 audio VAE", to_ours=True)
    return {"audio_vae." + k: v for k, v in sd.items()}


# ---------------------------------------------------------------- vocoder


def vocoder_key_layout(keys) -> tuple[str, bool]:
    """(layout, has bandwidth extension) from the first convolution's name: diffusers' `conv_in` (under
    `vocoder.` with BWE), Lightricks' file's `vocoder.conv_pre` (LTX-2.3's `vocoder.vocoder.conv_pre`), ours
    `conv_pre` (`vocoder.conv_pre` beside `bwe_generator.conv_pre` with BWE)."""
    keys = set(keys)
    if "vocoder.conv_in.weight" in keys or "conv_in.weight" in keys:
        return "diffusers", "vocoder.conv_in.weight" in keys
    if "vocoder.vocoder.conv_pre.weight" in keys:
        return "original", True
    if "vocoder.conv_pre.weight" in keys:
        bwe = "bwe_generator.conv_pre.weight" in keys
        return ("native" if bwe else "original"), bwe
    if "conv_pre.weight" in keys:
        return "native", False
    raise ValueError("not an LTX-2 vocoder state dict: no `conv_pre.weight` (ours), `vocoder.conv_pre.weight` "
                     "(Lightricks' file) or `conv_in.weight` (diffusers') key; first keys: "
                     f"{', '.join(sorted(keys)[:5])}")


def vocoder_names(keys, layout: str | None = None) -> tuple[dict[str, str], str, bool]:
    """({our name: the source's name}, layout, bandwidth extension) for a vocoder's keys."""
    keys = list(keys)
    found, bwe = vocoder_key_layout(keys)
    layout = layout or found
    valid = _BWE_KEY if bwe else _VOCODER_KEY
    what = f"{layout} layout of the LTX-2{'.3' if bwe else ''} vocoder"
    if layout == "original":  # ltx-core strips "vocoder." exactly once (_strip_vocoder_prefix)
        selected = _select(keys, ("vocoder.",), "vocoder.")
        names = _names(selected, (), valid, what, to_ours=True)
        return {k: selected[k] for k in names}, layout, bwe
    if layout == "diffusers":
        return _names(keys, _GENERATOR_FROM_DIFFUSERS, valid, what, to_ours=True), layout, bwe
    if layout == "native":
        return _names(keys, (), valid, what, to_ours=True), layout, bwe
    raise ValueError(f"layout={layout!r}; accepted: {', '.join(LAYOUTS)}")


def vocoder_to_native(sd: dict, layout: str | None = None) -> tuple[dict, str]:
    names, layout, _ = vocoder_names(sd, layout)
    return _renamed(sd, names), layout


def vocoder_to_diffusers(sd: dict) -> dict:
    """Ours -> diffusers' `LTX2Vocoder` / `LTX2VocoderWithBWE` keys; tensors unchanged."""
    bwe = any(k.startswith("bwe_generator.") for k in sd)
    return _renamed(sd, _names(sd, _GENERATOR_TO_DIFFUSERS, _BWE_KEY if bwe else _VOCODER_KEY,
                               "native layout of the LTX-2 vocoder", to_ours=False))


def vocoder_to_original(sd: dict) -> dict:
    """Ours -> Lightricks' single-file keys (`vocoder.` prefix)."""
    vocoder_names(sd, "native")
    return {"vocoder." + k: v for k, v in sd.items()}


# ---------------------------------------------------------------- text connectors

_CONNECTOR_PREFIXES = ("text_embedding_projection.", DIT_PREFIX + "text_embedding_projection.",
                       DIT_PREFIX + "video_embeddings_connector.", DIT_PREFIX + "audio_embeddings_connector.")


def connectors_key_layout(keys) -> str:
    keys = list(keys)
    if any(k.startswith(_CONNECTOR_PREFIXES[1:]) for k in keys):
        return "original"
    if any(k.startswith(("video_connector.", "audio_connector.")) for k in keys):
        return "diffusers"
    if any(k.startswith(("video_embeddings_connector.", "audio_embeddings_connector.")) for k in keys):
        return "native"
    raise ValueError("not LTX-2 text connectors: no `model.diffusion_model.video_embeddings_connector.*` (Lightricks' "
                     "file), `video_connector.*` (diffusers' LTX2TextConnectors) or `video_embeddings_connector.*` "
                     f"(ours) keys; first keys: {', '.join(sorted(keys)[:5])}")


def connectors_names(keys, layout: str | None = None) -> tuple[dict[str, str], str]:
    """({our name: the source's name}, layout) for the connectors' keys (from a whole DiT file: only theirs)."""
    keys = list(keys)
    layout = layout or connectors_key_layout(keys)
    what = f"{layout} layout of the LTX-2 text connectors"
    if layout == "original":
        selected = _select(keys, _CONNECTOR_PREFIXES, DIT_PREFIX)
        names = _names(selected, (), _CONNECTOR_KEY, what, to_ours=True)
        return {k: selected[k] for k in names}, layout
    if layout == "diffusers":
        return _names(keys, _CONNECTOR_FROM_DIFFUSERS, _CONNECTOR_KEY, what, to_ours=True), layout
    if layout == "native":
        return _names(keys, (), _CONNECTOR_KEY, what, to_ours=True), layout
    raise ValueError(f"layout={layout!r}; accepted: {', '.join(LAYOUTS)}")


def connectors_to_native(sd: dict, layout: str | None = None) -> tuple[dict, str]:
    names, layout = connectors_names(sd, layout)
    return _renamed(sd, names), layout


def connectors_to_diffusers(sd: dict) -> dict:
    """Ours -> diffusers' `LTX2TextConnectors` keys; tensors unchanged."""
    return _renamed(sd, _names(sd, _CONNECTOR_TO_DIFFUSERS, _CONNECTOR_KEY,
                               "native layout of the LTX-2 text connectors", to_ours=False))


def connectors_to_original(sd: dict) -> dict:
    """Ours -> Lightricks' DiT-file keys (the connectors under `model.diffusion_model.`, the projection at the top
    level, where diffusers' converter also looks for it)."""
    connectors_names(sd, "native")
    return {(k if k.startswith("text_embedding_projection.") else DIT_PREFIX + k): v for k, v in sd.items()}


# ---------------------------------------------------------------- configs


def _public(d: dict) -> dict:
    return {k: v for k, v in d.items() if not k.startswith("_")}  # _class_name, _diffusers_version, ...


def _unknown(d: dict, known, what: str) -> None:
    unknown = sorted(set(d) - set(known))
    if unknown:
        raise ValueError(f"{what} config: unknown keys {unknown}; known: {sorted(known)}")


# diffusers AutoencoderKLLTX2Audio name -> ours (dropout: only 0 is built, inference and the release)
_VAE_FROM_DIFFUSERS = {"base_channels": "ch", "output_channels": "out_ch", "ch_mult": "ch_mult",
                       "num_res_blocks": "num_res_blocks", "attn_resolutions": "attn_resolutions",
                       "in_channels": "in_channels", "resolution": "resolution", "latent_channels": "z_channels",
                       "norm_type": "norm_type", "causality_axis": "causality_axis", "dropout": None,
                       "mid_block_add_attention": "mid_block_add_attention", "sample_rate": "sample_rate",
                       "mel_hop_length": "mel_hop_length", "is_causal": "is_causal", "mel_bins": "mel_bins",
                       "double_z": "double_z"}


def audio_vae_config_from_diffusers(d: dict) -> AudioVAEConfig:
    """A diffusers `AutoencoderKLLTX2Audio` config.json dict -> `AudioVAEConfig` (n_fft, which diffusers does
    not record, keeps the release's 1024); unknown keys are errors."""
    d = _public(d)
    _unknown(d, _VAE_FROM_DIFFUSERS, "AutoencoderKLLTX2Audio")
    if d.get("dropout", 0.0):
        raise ValueError(f"AutoencoderKLLTX2Audio config: dropout={d['dropout']}; only 0 is built")
    ours = {_VAE_FROM_DIFFUSERS[k]: v for k, v in d.items() if _VAE_FROM_DIFFUSERS[k] is not None}
    ours["attn_resolutions"] = tuple(ours.get("attn_resolutions") or ())
    return AudioVAEConfig.from_dict(ours)


def audio_vae_config_to_diffusers(config: AudioVAEConfig) -> dict:
    """`AudioVAEConfig` -> `AutoencoderKLLTX2Audio(**kwargs)` arguments."""
    out = {theirs: getattr(config, ours) for theirs, ours in _VAE_FROM_DIFFUSERS.items() if ours is not None}
    out.update(ch_mult=tuple(config.ch_mult), attn_resolutions=tuple(config.attn_resolutions) or None, dropout=0.0)
    return out


def audio_vae_config_from_metadata(meta: dict) -> AudioVAEConfig:
    """Lightricks' checkpoint metadata (`config` -> `audio_vae`) -> `AudioVAEConfig`, read as ltx-core's
    `AudioEncoderConfigurator` reads it (its defaults where a key is absent)."""
    cfg = meta.get("audio_vae", {})
    params = cfg.get("model", {}).get("params", {})
    dd = params.get("ddconfig", {})
    pre = cfg.get("preprocessing", {})
    stft, mel = pre.get("stft", {}), pre.get("mel", {})
    mel_bins = dd.get("mel_bins") or mel.get("n_mel_channels") or cfg.get("variables", {}).get("mel_bins") or 64
    return AudioVAEConfig(
        ch=dd.get("ch", 128), out_ch=dd.get("out_ch", 2), in_channels=dd.get("in_channels", 2),
        ch_mult=tuple(dd.get("ch_mult", (1, 2, 4))), num_res_blocks=dd.get("num_res_blocks", 2),
        attn_resolutions=tuple(dd.get("attn_resolutions", (8, 16, 32)) or ()), resolution=dd.get("resolution", 256),
        z_channels=dd.get("z_channels", 8), double_z=dd.get("double_z", True), norm_type=dd.get("norm_type", "pixel"),
        causality_axis=dd.get("causality_axis", "height") or "none",
        mid_block_add_attention=dd.get("mid_block_add_attention", True),
        sample_rate=params.get("sampling_rate", 16000), mel_hop_length=stft.get("hop_length", 160),
        n_fft=stft.get("filter_length", 1024), mel_bins=mel_bins, is_causal=stft.get("causal", True))


def _generator_from_diffusers(d: dict, p: str = "") -> VocoderConfig:
    act = d.get(p + "act_fn", "leaky_relu")
    if (act == "leaky_relu") == bool(d.get(p + "antialias", False)):
        raise ValueError(f"LTX2Vocoder config: {p}act_fn={act!r} with {p}antialias={d.get(p + 'antialias')}; built: "
                         "leaky_relu without antialias (HiFi-GAN) or snake / snakebeta with it (BigVGAN v2)")
    if d.get(p + "leaky_relu_negative_slope", 0.1) != 0.1 or d.get(p + "antialias_ratio", 2) != 2 \
            or d.get(p + "antialias_kernel_size", 12) != 12:
        raise ValueError(f"LTX2Vocoder config: {p}leaky_relu_negative_slope, {p}antialias_ratio, "
                         f"{p}antialias_kernel_size: only 0.1, 2, 12 are built (ltx-core hard-codes them)")
    return VocoderConfig(
        in_channels=d.get(p + "in_channels", 128), out_channels=d.get(p + "out_channels", 2),
        upsample_initial_channel=d.get(p + "hidden_channels", 1024),
        upsample_rates=tuple(d.get(p + "upsample_factors", (6, 5, 2, 2, 2))),
        upsample_kernel_sizes=tuple(d.get(p + "upsample_kernel_sizes", (16, 15, 8, 4, 4))),
        resblock_kernel_sizes=tuple(d.get(p + "resnet_kernel_sizes", (3, 7, 11))),
        resblock_dilation_sizes=tuple(tuple(x) for x in d.get(p + "resnet_dilations", ((1, 3, 5),) * 3)),
        resblock="1" if act == "leaky_relu" else "AMP1", activation="snake" if act == "leaky_relu" else act,
        final_activation=d.get(p + "final_act_fn", "tanh") or "none", use_bias_at_final=d.get(p + "final_bias", True),
        output_sampling_rate=d.get("output_sampling_rate", 24000))


_GEN_KEYS = ("in_channels", "hidden_channels", "out_channels", "upsample_kernel_sizes", "upsample_factors",
             "resnet_kernel_sizes", "resnet_dilations", "act_fn", "leaky_relu_negative_slope", "antialias",
             "antialias_ratio", "antialias_kernel_size", "final_act_fn", "final_bias")
_BWE_KEYS = ("filter_length", "hop_length", "window_length", "num_mel_channels", "input_sampling_rate",
             "output_sampling_rate")


def vocoder_config_from_diffusers(d: dict) -> VocoderConfig | VocoderBWEConfig:
    """A diffusers `LTX2Vocoder` or `LTX2VocoderWithBWE` (has `bwe_*` keys) config.json dict -> ours. Note:
    diffusers' LTX-2.3 conversion writes final_act_fn None for the first stage where ltx-core clamps; a
    config read here gets what it says ("none"), `LTX23_VOCODER` has the clamp."""
    d = _public(d)
    if not any(k.startswith("bwe_") for k in d):
        _unknown(d, (*_GEN_KEYS, "output_sampling_rate"), "LTX2Vocoder")
        return _generator_from_diffusers(d)
    _unknown(d, (*_GEN_KEYS, *("bwe_" + k for k in _GEN_KEYS), *_BWE_KEYS), "LTX2VocoderWithBWE")
    if d.get("window_length", d.get("filter_length", 512)) != d.get("filter_length", 512):
        raise ValueError("LTX2VocoderWithBWE config: window_length must equal filter_length (ltx-core builds the STFT "
                         "with win_length = n_fft)")
    rate_in, rate_out = d.get("input_sampling_rate", 16000), d.get("output_sampling_rate", 48000)
    first = _generator_from_diffusers({**d, "output_sampling_rate": rate_in})
    bwe = _generator_from_diffusers({**d, "output_sampling_rate": rate_out}, "bwe_")
    return VocoderBWEConfig(vocoder=first, bwe=bwe, n_fft=d.get("filter_length", 512),
                            hop_length=d.get("hop_length", 80), num_mels=d.get("num_mel_channels", 64),
                            input_sampling_rate=rate_in, output_sampling_rate=rate_out)


def _generator_to_diffusers(c: VocoderConfig, p: str = "") -> dict:
    amp = c.resblock == "AMP1"
    return {p + "in_channels": c.in_channels, p + "hidden_channels": c.upsample_initial_channel,
            p + "out_channels": c.out_channels, p + "upsample_kernel_sizes": list(c.upsample_kernel_sizes),
            p + "upsample_factors": list(c.upsample_rates), p + "resnet_kernel_sizes": list(c.resblock_kernel_sizes),
            p + "resnet_dilations": [list(x) for x in c.resblock_dilation_sizes],
            p + "act_fn": c.activation if amp else "leaky_relu", p + "antialias": amp,
            p + "final_act_fn": None if c.final_activation == "none" else c.final_activation,
            p + "final_bias": c.use_bias_at_final}


def vocoder_config_to_diffusers(config: VocoderConfig | VocoderBWEConfig) -> dict:
    """Ours -> `LTX2Vocoder(**kwargs)` / `LTX2VocoderWithBWE(**kwargs)` arguments."""
    if isinstance(config, VocoderConfig):
        return {**_generator_to_diffusers(config), "output_sampling_rate": config.output_sampling_rate}
    return {**_generator_to_diffusers(config.vocoder), **_generator_to_diffusers(config.bwe, "bwe_"),
            "filter_length": config.n_fft, "hop_length": config.hop_length, "window_length": config.n_fft,
            "num_mel_channels": config.num_mels, "input_sampling_rate": config.input_sampling_rate,
            "output_sampling_rate": config.output_sampling_rate}


def _generator_from_metadata(cfg: dict, rate: int, final: bool) -> VocoderConfig:
    """One ltx-core `_vocoder_from_config` (its defaults); `final`: apply_final_activation."""
    return VocoderConfig(
        upsample_initial_channel=cfg.get("upsample_initial_channel", 1024),
        upsample_rates=tuple(cfg.get("upsample_rates", (6, 5, 2, 2, 2))),
        upsample_kernel_sizes=tuple(cfg.get("upsample_kernel_sizes", (16, 15, 8, 4, 4))),
        resblock_kernel_sizes=tuple(cfg.get("resblock_kernel_sizes", (3, 7, 11))),
        resblock_dilation_sizes=tuple(tuple(x) for x in cfg.get("resblock_dilation_sizes", ((1, 3, 5),) * 3)),
        resblock=cfg.get("resblock", "1"), activation=cfg.get("activation", "snake"),
        final_activation=("tanh" if cfg.get("use_tanh_at_final", True) else "clamp") if final else "none",
        use_bias_at_final=cfg.get("use_bias_at_final", True), output_sampling_rate=rate)


def vocoder_config_from_metadata(meta: dict) -> VocoderConfig | VocoderBWEConfig:
    """Lightricks' checkpoint metadata (`config` -> `vocoder`) -> ours, as ltx-core's `VocoderConfigurator`
    reads it: a nested `vocoder` + `bwe` config is LTX-2.3's, a flat one LTX-2's."""
    cfg = meta.get("vocoder", {})
    if "bwe" not in cfg:
        return _generator_from_metadata(cfg, cfg.get("output_sampling_rate", 24000), final=True)
    bwe = cfg["bwe"]
    return VocoderBWEConfig(vocoder=_generator_from_metadata(cfg.get("vocoder", {}), bwe["input_sampling_rate"], True),
                            bwe=_generator_from_metadata(bwe, bwe["output_sampling_rate"], False),
                            n_fft=bwe["n_fft"], hop_length=bwe["hop_length"], num_mels=bwe["num_mels"],
                            input_sampling_rate=bwe["input_sampling_rate"],
                            output_sampling_rate=bwe["output_sampling_rate"])


_CONNECTOR_DIFFUSERS = ("caption_channels", "text_proj_in_factor", "connector_rope_base_seq_len", "rope_theta",
                        "rope_double_precision", "causal_temporal_positioning", "rope_type", "per_modality_projections",
                        "video_hidden_dim", "audio_hidden_dim", "proj_bias",
                        *(f"{s}_{k}" for s in ("video", "audio") for k in (
                            "connector_num_attention_heads", "connector_attention_head_dim", "connector_num_layers",
                            "connector_num_learnable_registers", "gated_attn")))


def connectors_config_from_diffusers(d: dict) -> ConnectorConfig:
    """A diffusers `LTX2TextConnectors` config.json dict -> `ConnectorConfig`; unknown keys are errors, and
    only split RoPE without causal positions is built (every release)."""
    d = _public(d)
    _unknown(d, _CONNECTOR_DIFFUSERS, "LTX2TextConnectors")
    if d.get("rope_type", "interleaved") != "split" or d.get("causal_temporal_positioning", False):
        raise ValueError(f"LTX2TextConnectors config: rope_type={d.get('rope_type', 'interleaved')!r}, "
                         f"causal_temporal_positioning={d.get('causal_temporal_positioning', False)}; only 'split' and "
                         "false are built (every LTX-2 release)")

    def stream(s: str) -> StreamConfig:
        return StreamConfig(heads=d.get(f"{s}_connector_num_attention_heads", 30),
                            head_dim=d.get(f"{s}_connector_attention_head_dim", 128),
                            layers=d.get(f"{s}_connector_num_layers", 2),
                            registers=d.get(f"{s}_connector_num_learnable_registers", 128),
                            gated_attention=d.get(f"{s}_gated_attn", False))

    return ConnectorConfig(caption_channels=d.get("caption_channels", 3840),
                           text_states=d.get("text_proj_in_factor", 49), video=stream("video"), audio=stream("audio"),
                           feature_extractor="v2" if d.get("per_modality_projections", False) else "v1",
                           proj_bias=d.get("proj_bias", False), rope_max_pos=d.get("connector_rope_base_seq_len", 4096),
                           rope_theta=d.get("rope_theta", 10000.0),
                           rope_double_precision=d.get("rope_double_precision", True))


def connectors_config_to_diffusers(config: ConnectorConfig) -> dict:
    """`ConnectorConfig` -> `LTX2TextConnectors(**kwargs)` arguments (diffusers' FeedForward has a bias)."""
    if not config.ff_bias:
        raise ValueError("ConnectorConfig.ff_bias=False has no diffusers equivalent (its FeedForward has biases)")
    out = {"caption_channels": config.caption_channels, "text_proj_in_factor": config.text_states,
           "connector_rope_base_seq_len": config.rope_max_pos, "rope_theta": config.rope_theta,
           "rope_double_precision": config.rope_double_precision, "causal_temporal_positioning": False,
           "rope_type": "split", "per_modality_projections": config.feature_extractor == "v2",
           "video_hidden_dim": config.video.dim, "audio_hidden_dim": config.audio.dim, "proj_bias": config.proj_bias}
    for s, st in (("video", config.video), ("audio", config.audio)):
        out.update({f"{s}_connector_num_attention_heads": st.heads, f"{s}_connector_attention_head_dim": st.head_dim,
                    f"{s}_connector_num_layers": st.layers, f"{s}_connector_num_learnable_registers": st.registers,
                    f"{s}_gated_attn": st.gated_attention})
    return out


# ---------------------------------------------------------------- loading


def read_metadata_config(path: Path) -> dict | None:
    """The `config` JSON of a Lightricks safetensors file's metadata, or None (no such entry, or a folder)."""
    if not (path.is_file() and path.suffix.lower() == ".safetensors"):
        return None
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    raw = meta.get("config")
    if raw is None:
        return None
    try:
        return json.loads(raw)
    except json.JSONDecodeError as exc:
        raise WeightsError(f"{path}: its metadata's `config` is not JSON ({exc})") from exc


def _component(src: str, folder: str) -> Path:
    """A file, a component folder, or a diffusers pipeline folder holding `folder/`."""
    path = Path(src)
    return path / folder if path.is_dir() and (path / folder).is_dir() else path


def _config_json(path: Path, reader, what: str):
    config_json = (path if path.is_dir() else path.parent) / "config.json"
    if not config_json.is_file():
        return None
    try:
        return reader(json.loads(config_json.read_text()))
    except (ValueError, TypeError) as exc:
        raise WeightsError(f"{config_json}: not {what} config ({exc})") from exc


def _load(path: Path, names_fn, what: str):
    """(the file's tensors under our names, layout) — names converted before any tensor is read."""
    lazy = open_weights(path)
    try:
        names, layout = names_fn(list(lazy.keys()))
    except ValueError as exc:
        raise WeightsError(f"{path}: {exc}") from exc
    if not names:
        raise WeightsError(f"{path}: no {what} tensors in it")
    return lazy.renamed(names), layout


def load_ltx2_audio_vae(source: str | os.PathLike, dtype: torch.dtype | None = torch.float32, device=None,
                        config: AudioVAEConfig | None = None, seed: int = 0) -> LTX2AudioVAE:
    """An `LTX2AudioVAE` from `preset:NAME` (seeded random init of `AUDIO_VAE_CONFIGS[NAME]`), a diffusers
    `audio_vae/` folder (or a pipeline folder holding one), or a file in any of `LAYOUTS` (a whole Lightricks
    checkpoint too: only its `audio_vae.` tensors are read). The config: `config`, else the folder's
    config.json, else the file's Lightricks metadata, else the release's. dtype float32 by default (ltx-core
    runs the audio VAE in float32); None keeps the file's."""
    name = preset_name(source)
    if name is not None:
        if config is None and name not in AUDIO_VAE_CONFIGS:
            raise WeightsError(f"{source}: unknown LTX-2 audio VAE preset {name!r}; "
                               f"valid: {', '.join(AUDIO_VAE_CONFIGS)}")
        model = LTX2AudioVAE(config or AUDIO_VAE_CONFIGS[name], seed=seed).to(device)
        return model.to(dtype) if dtype is not None else model
    path = _component(str(source), "audio_vae")
    sd, layout = _load(path, lambda keys: audio_vae_names(keys), "audio VAE")
    if config is None:
        config = _config_json(path, audio_vae_config_from_diffusers, "an AutoencoderKLLTX2Audio")
    if config is None:
        meta = read_metadata_config(path)
        config = audio_vae_config_from_metadata(meta) if meta and "audio_vae" in meta else LTX2_AUDIO_VAE
    return materialize(LTX2AudioVAE, config, sd, f"{path} ({layout} layout)", dtype, device)


def load_ltx2_vocoder(source: str | os.PathLike, dtype: torch.dtype | None = torch.float32, device=None,
                      config: VocoderConfig | VocoderBWEConfig | None = None,
                      seed: int = 0) -> LTX2Vocoder | LTX2VocoderWithBWE:
    """`LTX2Vocoder` (LTX-2) or `LTX2VocoderWithBWE` (LTX-2.3, found by its `bwe_generator` tensors) from
    `preset:NAME` (`VOCODER_CONFIGS`), a diffusers `vocoder/` folder (or a pipeline folder), or a file in
    any of `LAYOUTS` (a whole Lightricks checkpoint: only its `vocoder.` tensors). The config: `config`,
    else config.json, else the Lightricks metadata, else the release's (LTX-2's or LTX-2.3's by the keys)."""
    name = preset_name(source)
    if name is not None:
        if config is None and name not in VOCODER_CONFIGS:
            raise WeightsError(f"{source}: unknown LTX-2 vocoder preset {name!r}; valid: {', '.join(VOCODER_CONFIGS)}")
        config = config or VOCODER_CONFIGS[name]
        cls = LTX2VocoderWithBWE if isinstance(config, VocoderBWEConfig) else LTX2Vocoder
        model = cls(config, seed=seed).to(device)
        return model.to(dtype) if dtype is not None else model
    path = _component(str(source), "vocoder")
    found: dict = {}

    def names(keys):
        n, layout, found["bwe"] = vocoder_names(keys)
        return n, layout

    sd, layout = _load(path, names, "vocoder")
    if config is None:
        config = _config_json(path, vocoder_config_from_diffusers, "an LTX2Vocoder")
    if config is None:
        meta = read_metadata_config(path)
        config = vocoder_config_from_metadata(meta) if meta and "vocoder" in meta else (
            LTX23_VOCODER if found["bwe"] else LTX2_VOCODER)
    if isinstance(config, VocoderBWEConfig) != found["bwe"]:
        raise WeightsError(f"{path}: {'a' if found['bwe'] else 'no'} bandwidth-extension vocoder in the file, but the "
                           f"config is {type(config).__name__}")
    cls = LTX2VocoderWithBWE if found["bwe"] else LTX2Vocoder
    return materialize(cls, config, sd, f"{path} ({layout} layout)", dtype, device)


def load_ltx2_connectors(source: str | os.PathLike, dtype: torch.dtype | None = None, device=None,
                         config: ConnectorConfig | None = None, seed: int = 0) -> LTX2TextConnectors:
    """`LTX2TextConnectors` from `preset:NAME` (`CONNECTOR_CONFIGS`), a diffusers `connectors/` folder (or a
    pipeline folder), or a file in any of `LAYOUTS` (Lightricks' DiT checkpoint: only the connectors' and
    the projection's tensors are read). The config: `config`, else config.json, else the release's of the
    projection found (v1 `aggregate_embed`: LTX-2; v2 `video_aggregate_embed`: LTX-2.3); the shapes are
    checked either way. dtype None keeps the file's."""
    name = preset_name(source)
    if name is not None:
        if config is None and name not in CONNECTOR_CONFIGS:
            raise WeightsError(f"{source}: unknown LTX-2 connectors preset {name!r}; "
                               f"valid: {', '.join(CONNECTOR_CONFIGS)}")
        model = LTX2TextConnectors(config or CONNECTOR_CONFIGS[name], seed=seed).to(device)
        return model.to(dtype) if dtype is not None else model
    path = _component(str(source), "connectors")
    sd, layout = _load(path, lambda keys: connectors_names(keys), "text connector")
    if config is None:
        config = _config_json(path, connectors_config_from_diffusers, "an LTX2TextConnectors")
    if config is None:
        v2 = "text_embedding_projection.video_aggregate_embed.weight" in sd
        config = LTX23_CONNECTORS if v2 else LTX2_CONNECTORS
    return materialize(LTX2TextConnectors, config, sd, f"{path} ({layout} layout)", dtype, device)
