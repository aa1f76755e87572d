"""MiniMax H3 video VAE weights in and out: key names between ours and diffusers', configs from diffusers' or
MiniMax's config.json, and `load_h3_vae`.

Key layouts:

    original   MiniMax's checkpoint (MiniMaxAI/MiniMax-H3 `FL2VA/video_vae/source/model.safetensors`, loaded
               strictly by its `AutoencoderKLLegacy`): `encoder.down.0.block.1.conv1.weight`,
               `encoder.down.1.downsample.conv.weight`, `decoder.x_embedder.weight`,
               `decoder.transformer_blocks.0.attn.to_qkv.weight` (rows per head [q | k | v]),
               `decoder.transformer_blocks.0.ff.w1.weight` (rows [gate | value]). These are our names. It also
               holds `decoder.mask_token`, a zero buffer of the masked-autoencoding objective that the decoder never
               reads: dropped on the way in, written as zeros on the way out.
    diffusers  `AutoencoderKLMiniMaxH3` (MiniMaxAI/MiniMax-H3 `vae/`; diffusers
               scripts/convert_minimax_h3_to_diffusers.py `convert_video_vae_key`):
               `encoder.down_blocks.{i}.resnets.{j}` (`conv_shortcut`), `encoder.down_blocks.{i}.downsamplers.0.conv`,
               `decoder.proj_in`; the fused per-head `to_qkv` split into `to_q` / `to_k` / `to_v`; `attn.to_out.0`;
               `ff.net.0.proj` with its halves swapped ([value | gate]), `ff.net.2`. Splitting `to_qkv` needs the head
               count: diffusers' conversions take the config.

A key no rule knows is an error naming it (`ValueError`); a file that does not fit the model is a `WeightsError`
naming the file and its first missing / unexpected / wrong-shape keys.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch

from video_dit.families.minimax_h3.vae import H3VideoVAE
from video_dit.families.minimax_h3.vae_config import H3_VAE, PRESETS, H3Tiling, H3VAEConfig
from video_dit.models.layouts import preset_name
from video_dit.models.weights import WeightsError, materialize, open_weights, read_state_dict

LAYOUTS = ("original", "diffusers")
UNUSED_ORIGINAL = ("decoder.mask_token",)

# ---------------------------------------------------------------- key names

_P = r"(?P<p>weight|bias)"
_BLOCK = r"decoder\.transformer_blocks\.(?P<i>\d+)\."
_GROUPS = {"i": r"\d+", "j": r"\d+", "m": "norm1|conv1|norm2|conv2", "p": "weight|bias"}
# (ours, diffusers) name templates of the keys that are only renamed
_RENAMES = (
    ("encoder.down.{i}.block.{j}.{m}.{p}", "encoder.down_blocks.{i}.resnets.{j}.{m}.{p}"),
    ("encoder.down.{i}.block.{j}.nin_shortcut.{p}", "encoder.down_blocks.{i}.resnets.{j}.conv_shortcut.{p}"),
    ("encoder.down.{i}.downsample.conv.{p}", "encoder.down_blocks.{i}.downsamplers.0.conv.{p}"),
    ("decoder.x_embedder.{p}", "decoder.proj_in.{p}"),
    ("decoder.transformer_blocks.{i}.attn.to_out.{p}", "decoder.transformer_blocks.{i}.attn.to_out.0.{p}"),
    ("decoder.transformer_blocks.{i}.ff.w2.{p}", "decoder.transformer_blocks.{i}.ff.net.2.{p}"),
)
_SAME = re.compile(rf"(?:encoder\.(?:conv_in|norm_out|conv_out)|quant_conv|post_quant_conv|decoder\.(?:norm_out|"
                   rf"proj_out))\.{_P}|decoder\.register_tokens|{_BLOCK}(?:norm[12]\.weight|scale[12])")
_QKV = re.compile(rf"{_BLOCK}attn\.to_qkv\.{_P}")
_W1 = re.compile(rf"{_BLOCK}ff\.w1\.{_P}")
_DIFF_QKV = re.compile(rf"{_BLOCK}attn\.to_(?P<a>[qkv])\.{_P}")
_DIFF_W1 = re.compile(rf"{_BLOCK}ff\.net\.0\.proj\.{_P}")


def _compile(template: str) -> re.Pattern:
    pattern = re.escape(template)
    for name, alternatives in _GROUPS.items():
        pattern = pattern.replace(re.escape("{" + name + "}"), f"(?P<{name}>{alternatives})")
    return re.compile(pattern)


_OURS_RENAMED = [(_compile(a), b) for a, b in _RENAMES]
_DIFF_RENAMED = [(_compile(b), a) for a, b in _RENAMES]


def _unknown(keys: list[str], what: str) -> None:
    if keys:
        raise ValueError(f"{len(keys)} key(s) not in the {what} layout of the MiniMax H3 video VAE: "
                         f"{', '.join(keys[:8])}{' ...' if len(keys) > 8 else ''}")


def _halves_swapped(t: torch.Tensor) -> torch.Tensor:
    a, b = t.chunk(2, dim=0)
    return torch.cat([b, a], 0)


def h3_vae_to_diffusers(sd: dict[str, torch.Tensor], config: H3VAEConfig) -> dict[str, torch.Tensor]:
    """Ours (MiniMax's) -> diffusers `AutoencoderKLMiniMaxH3` keys: renamed, `to_qkv` split per head into
    `to_q` / `to_k` / `to_v`, `ff.w1`'s halves swapped."""
    H, d = config.decoder_num_attention_heads, config.decoder_attention_head_dim
    out, unknown = {}, []
    for key, value in sd.items():
        if _SAME.fullmatch(key):
            out[key] = value
        elif m := _QKV.fullmatch(key):
            q, k, v = value.reshape(H, 3, d, *value.shape[1:]).unbind(1)  # rows per head [q | k | v]
            for name, t in zip("qkv", (q, k, v)):
                out[f"decoder.transformer_blocks.{m['i']}.attn.to_{name}.{m['p']}"] = t.reshape(H * d, *value.shape[1:])
        elif m := _W1.fullmatch(key):
            out[f"decoder.transformer_blocks.{m['i']}.ff.net.0.proj.{m['p']}"] = _halves_swapped(value)
        else:
            for pattern, target in _OURS_RENAMED:
                if m := pattern.fullmatch(key):
                    out[target.format(**m.groupdict())] = value
                    break
            else:
                unknown.append(key)
    _unknown(unknown, "original (ours)")
    return out


def h3_vae_from_diffusers(sd: dict[str, torch.Tensor], config: H3VAEConfig) -> dict[str, torch.Tensor]:
    """diffusers `AutoencoderKLMiniMaxH3` keys -> ours: renamed, `to_q` / `to_k` / `to_v` interleaved per head into
    `to_qkv` (all three must be there), `ff.net.0.proj`'s halves swapped back."""
    H, d = config.decoder_num_attention_heads, config.decoder_attention_head_dim
    out, unknown, qkv = {}, [], {}
    for key, value in sd.items():
        if _SAME.fullmatch(key):
            out[key] = value
        elif m := _DIFF_QKV.fullmatch(key):
            qkv.setdefault((m["i"], m["p"]), {})[m["a"]] = value
        elif m := _DIFF_W1.fullmatch(key):
            out[f"decoder.transformer_blocks.{m['i']}.ff.w1.{m['p']}"] = _halves_swapped(value)
        else:
            for pattern, target in _DIFF_RENAMED:
                if m := pattern.fullmatch(key):
                    out[target.format(**m.groupdict())] = value
                    break
            else:
                unknown.append(key)
    _unknown(unknown, "diffusers")
    for (i, p), parts in qkv.items():
        missing = [f"decoder.transformer_blocks.{i}.attn.to_{a}.{p}" for a in "qkv" if a not in parts]
        if missing:
            raise ValueError(f"diffusers MiniMax H3 VAE weights: {', '.join(missing)} missing (to_q, to_k and to_v "
                             "are fused into one to_qkv)")
        rest = parts["q"].shape[1:]
        stacked = torch.stack([parts[a].reshape(H, d, *rest) for a in "qkv"], 1)  # (H, 3, d, ...)
        out[f"decoder.transformer_blocks.{i}.attn.to_qkv.{p}"] = stacked.reshape(3 * H * d, *rest)
    return out


def h3_vae_from_original(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """MiniMax's keys are ours: checked (an unknown key is an error), `decoder.mask_token` dropped."""
    out = {k: v for k, v in sd.items() if k not in UNUSED_ORIGINAL}
    _unknown([k for k in out if not (_SAME.fullmatch(k) or _QKV.fullmatch(k) or _W1.fullmatch(k)
                                     or any(p.fullmatch(k) for p, _ in _OURS_RENAMED))], "original (MiniMax)")
    return out


def h3_vae_to_original(sd: dict[str, torch.Tensor], config: H3VAEConfig) -> dict[str, torch.Tensor]:
    """Ours -> a file MiniMax's `AutoencoderKLLegacy` loads strictly: our keys and the zero `decoder.mask_token`."""
    dim = config.decoder_num_attention_heads * config.decoder_attention_head_dim
    some = next(iter(sd.values()))
    return {**h3_vae_from_original(sd), "decoder.mask_token": torch.zeros(1, 1, dim, dtype=some.dtype)}


def h3_vae_key_layout(sd) -> str:
    """"diffusers" or "original" from the key names; an error naming what is accepted otherwise."""
    keys = list(sd)
    if any(k.startswith(("encoder.down_blocks.", "decoder.proj_in.")) or ".attn.to_q." in k for k in keys):
        return "diffusers"
    if any(k.startswith(("encoder.down.", "decoder.x_embedder.")) or ".attn.to_qkv." in k for k in keys):
        return "original"
    raise ValueError("not a MiniMax H3 video VAE state dict; accepted: MiniMax's keys (`encoder.down.0.block.0.conv1"
                     ".weight`, `decoder.x_embedder.weight`) or diffusers' (`encoder.down_blocks.0.resnets.0...`, "
                     f"`decoder.proj_in.weight`); first keys: {', '.join(sorted(keys)[:5])}")


def h3_vae_to_native(sd: dict[str, torch.Tensor], config: H3VAEConfig, layout: str | None = None) -> tuple[dict, str]:
    """(our keys, the layout read): one of `LAYOUTS`, detected from the names when `layout` is None."""
    layout = layout or h3_vae_key_layout(sd)
    if layout == "original":
        return h3_vae_from_original(sd), layout
    if layout == "diffusers":
        return h3_vae_from_diffusers(sd, config), layout
    raise ValueError(f"layout={layout!r}; accepted: {', '.join(LAYOUTS)}")


# ---------------------------------------------------------------- configs

_FIELDS = set(H3VAEConfig.__dataclass_fields__)


def _public(d: dict) -> dict:
    return {k: v for k, v in d.items() if not k.startswith("_")}  # _class_name, _diffusers_version


def h3_vae_config_from_diffusers(d: dict) -> H3VAEConfig:
    """A diffusers `AutoencoderKLMiniMaxH3` config.json dict -> `H3VAEConfig` (its names are ours; absent keys take
    diffusers' defaults, which are the release's, except the latent statistics: diffusers defaults them to 0 / 1,
    so they are required here); an unknown key is an error naming it."""
    d = _public(d)
    unknown = sorted(set(d) - _FIELDS)
    if unknown:
        raise ValueError(f"AutoencoderKLMiniMaxH3 config: unknown keys {unknown}; known: {sorted(_FIELDS)}")
    missing = [k for k in ("latents_mean", "latents_std") if k not in d]
    if missing:
        raise ValueError(f"AutoencoderKLMiniMaxH3 config: no {' / '.join(missing)} (the pipeline normalises latents "
                         "with them; diffusers' default is 0 / 1, not the release's)")
    return H3VAEConfig.from_dict(d)


def h3_vae_config_to_diffusers(config: H3VAEConfig) -> dict:
    """`H3VAEConfig` -> `AutoencoderKLMiniMaxH3(**kwargs)` arguments (tuples as lists)."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in
            ((name, getattr(config, name)) for name in H3VAEConfig.__dataclass_fields__)}


# MiniMax's `AutoencoderKLLegacy` keys that take only one value in this architecture (klvae.py refuses the rest
# or the release fixes them); `vit_decoder_kwargs` entries likewise
_ORIGINAL_FIXED = {"use_3d_conv": True, "use_vit_decoder": True, "causal_encoder": True, "causal_decoder": False,
                   "use_t_isolated_gn": True, "zq_ch_encoder": None, "zq_ch_decoder": None, "padding_mode_t": None,
                   "pixel_norm_type": "imagenet"}
_VIT_FIXED = {"norm_type": "rms_norm", "norm_affine": True, "qk_norm_type": "rms_norm", "qk_norm_affine": False,
              "ffn_activation_fn": "silu", "ffn_use_gated": True}
# read and not kept: derived (vae_ratio*), the CNN decoder's (space_up, time_up, num_res_blocks_decoder), or the
# latent scale, which the pipeline replaces by the per-channel statistics
_ORIGINAL_IGNORED = {"vae_ratio", "vae_ratio_t", "space_up", "time_up", "num_res_blocks_decoder", "scaling_factor",
                     "shift_factor"}
_WRAPPER_KEYS = {"mode", "auto_map", "source_path", "source_class_name", "source_safetensors_path", "vae_clip_length",
                 "vae_token_drop", "vae_encoder_tiling", "vae_decoder_tiling", "vae_parallel_tiling", "vae_tile_size",
                 "vae_tile_overlap_min", "vae_encoder_parallel", "vae_decoder_parallel", "vae_chunk_dim",
                 "latent_channels", "latents_mean", "latents_std"}


def h3_vae_config_from_original(source: dict, wrapper: dict) -> tuple[H3VAEConfig, H3Tiling | None]:
    """MiniMax's two config files -> (`H3VAEConfig`, the tiling they ask for): `source` is
    `video_vae/source/config.json` (`AutoencoderKLLegacy`), `wrapper` is `video_vae/config.json` (clip length,
    token drop, tiling, latent statistics). An unknown key, or a fixed one with another value, is an error."""
    s, w = _public(source), _public(wrapper)
    vit = dict(s.get("vit_decoder_kwargs") or {})
    known = set(_ORIGINAL_FIXED) | _ORIGINAL_IGNORED | {"in_channels", "out_ch", "ch", "ch_mult", "embed_dim",
                                                       "z_channels", "num_res_blocks", "space_down", "time_down",
                                                       "padding_mode", "vit_decoder_kwargs"}
    vit_known = set(_VIT_FIXED) | {"dim_head", "heads", "num_layers", "rope_theta", "rope_dim_ratio", "eps",
                                   "num_register_tokens", "bias"}
    for what, keys, valid in (("video_vae/source/config.json", s, known), ("vit_decoder_kwargs", vit, vit_known),
                              ("video_vae/config.json", w, _WRAPPER_KEYS)):
        unknown = sorted(set(keys) - valid)
        if unknown:
            raise ValueError(f"MiniMax H3 VAE {what}: unknown keys {unknown}; known: {sorted(valid)}")
    for what, keys, fixed in (("video_vae/source/config.json", s, _ORIGINAL_FIXED),
                              ("vit_decoder_kwargs", vit, _VIT_FIXED)):
        for k, v in fixed.items():
            if k in keys and keys[k] != v:
                raise ValueError(f"MiniMax H3 VAE {what}: {k}={keys[k]!r}; this architecture has {k}={v!r}")
    if s.get("embed_dim", s["z_channels"]) != s["z_channels"]:
        raise ValueError(f"MiniMax H3 VAE video_vae/source/config.json: embed_dim={s['embed_dim']} differs from "
                         f"z_channels={s['z_channels']}; the released decoder reads z_channels latents")
    if vit.get("bias", True) is not True:
        raise ValueError("MiniMax H3 VAE vit_decoder_kwargs: bias=False; the release's linears have biases")
    fields = dict(in_channels=s.get("in_channels", 3), out_channels=s.get("out_ch", 3), latent_channels=s["z_channels"],
                  block_out_channels=tuple(s["ch"] * m for m in s["ch_mult"]), layers_per_block=s["num_res_blocks"],
                  spatial_downsample_factors=tuple(s["space_down"]), temporal_downsample_factors=tuple(s["time_down"]),
                  spatial_padding_mode=s.get("padding_mode", "zeros"), decoder_num_layers=vit["num_layers"],
                  # hard-coded in MiniMax's code: GroupNorm(32, eps 1e-6) (norm.py), FeedForward(mult=4)
                  # (base_module.py)
                  norm_num_groups=32, norm_eps=1e-6, decoder_ffn_mult=4,
                  decoder_num_attention_heads=vit["heads"], decoder_attention_head_dim=vit["dim_head"],
                  decoder_rope_theta=vit.get("rope_theta", 100.0),
                  decoder_rope_dim_ratio=vit.get("rope_dim_ratio", 1.0),
                  decoder_num_register_tokens=vit.get("num_register_tokens", 4), decoder_norm_eps=vit.get("eps", 1e-5),
                  clip_length=w.get("vae_clip_length", 17), token_drop=w.get("vae_token_drop", 0))
    for k in ("latents_mean", "latents_std"):
        if k not in w:
            raise ValueError(f"MiniMax H3 VAE video_vae/config.json: no {k}")
        fields[k] = tuple(w[k])
    tiling = None
    if w.get("vae_decoder_tiling", 0) or w.get("vae_encoder_tiling", 0):
        tiling = H3Tiling(w.get("vae_tile_size", 256), w.get("vae_tile_overlap_min", 64))
    return H3VAEConfig(**fields), tiling


# ---------------------------------------------------------------- loading


def _folder(path: Path) -> Path:
    """A VAE folder from a pipeline folder: diffusers' `vae/`, MiniMax's `video_vae/` (or `FL2VA/video_vae/`)."""
    for sub in ("vae", "video_vae", "FL2VA/video_vae", "Ref2VA/video_vae"):
        if (path / sub / "config.json").is_file():
            return path / sub
    return path


def load_h3_vae(source: str | os.PathLike, dtype: torch.dtype | None = None, device=None,
                config: H3VAEConfig | None = None, seed: int = 0) -> H3VideoVAE:
    """An `H3VideoVAE` from
      `preset:NAME`   seeded random init (`seed`) of `PRESETS[NAME]` (minimax-h3, minimax-h3-tiny);
      a folder        diffusers' `vae/` (config.json + diffusion_pytorch_model*.safetensors), MiniMax's
                      `video_vae/` (config.json + source/config.json + source/model.safetensors), or a pipeline
                      folder holding one;
      a file          `.safetensors` in either layout, its config from `config`, a config.json beside it, or, for
                      the released shapes, the release's.
    dtype None keeps the stored dtype (the release: float32). MiniMax's folder sets the tiling it asks for."""
    src = str(source)
    name = preset_name(src)
    if name is not None:
        if config is None and name not in PRESETS:
            raise WeightsError(f"{src}: unknown MiniMax H3 VAE preset {name!r}; valid: {', '.join(PRESETS)}")
        model = H3VideoVAE(config or PRESETS[name], seed=seed).to(device)
        return model.to(dtype=dtype) if dtype is not None else model
    path = Path(src)
    if not path.exists():
        raise WeightsError(f"{path}: no such file or folder; expected a MiniMax H3 video VAE: diffusers' vae/ folder, "
                           "MiniMax's video_vae/ folder or a .safetensors file (huggingface-cli download "
                           "MiniMaxAI/MiniMax-H3 --include 'vae/*' --local-dir MODELS/minimax-h3)")
    tiling = H3Tiling()
    if path.is_dir():
        path = _folder(path)
        cfg_json = path / "config.json"
        if not cfg_json.is_file():
            raise WeightsError(f"{path}: no config.json; expected diffusers' vae/ or MiniMax's video_vae/ folder")
        wrapper = json.loads(cfg_json.read_text())
        try:
            if "source_path" in wrapper:  # MiniMax's video_vae/
                src_dir = path / wrapper["source_path"]
                found, tiling = h3_vae_config_from_original(json.loads((src_dir / "config.json").read_text()), wrapper)
                weights = src_dir / wrapper.get("source_safetensors_path", "model.safetensors")
            else:
                found, weights = h3_vae_config_from_diffusers(wrapper), path
        except (ValueError, TypeError, KeyError) as exc:
            raise WeightsError(f"{cfg_json}: not a MiniMax H3 video VAE config ({exc})") from exc
        config = config or found
    else:
        weights = path
    if config is None and not path.is_dir():
        beside = path.parent / "config.json"
        if beside.is_file():
            try:
                config = h3_vae_config_from_diffusers(json.loads(beside.read_text()))
            except (ValueError, TypeError) as exc:
                raise WeightsError(f"{beside}: not a MiniMax H3 video VAE config ({exc})") from exc
    meta = open_weights(weights).meta()
    if config is None:  # a bare file: the release's config if its shapes are the release's
        with torch.device("meta"):
            released = H3VideoVAE(H3_VAE).state_dict()
        try:
            native = h3_vae_to_native(meta, H3_VAE)[0]
        except ValueError as exc:
            raise WeightsError(f"{weights}: {exc}") from exc
        if native.keys() != released.keys() or any(native[k].shape != released[k].shape for k in released):
            raise WeightsError(f"{weights}: not the released MiniMax H3 VAE's shapes and no config.json beside it; "
                               "pass config= (an H3VAEConfig) or put the VAE's config.json next to the file")
        config = H3_VAE
    try:
        sd, layout = h3_vae_to_native(read_state_dict(weights), config)
    except ValueError as exc:
        raise WeightsError(f"{weights}: {exc}") from exc
    model = materialize(H3VideoVAE, config, sd, f"{weights} ({layout} layout)", dtype, device)
    model.tiling = tiling
    return model
