"""State-dict conversion for the LTX-2 DiT, pure functions over dicts of tensors.

Layouts:
  native / Lightricks  ltx-core `LTXModel`'s names, which `LTX2DiT` uses: the single-file checkpoints
                       (ltx-2-19b-dev.safetensors, ltx-2.3-22b-dev.safetensors, ...) hold them under
                       `model.diffusion_model.` (ltx-core `LTXV_MODEL_COMFY_RENAMING_MAP` strips it), beside
                       the text connectors (`model.diffusion_model.video_embeddings_connector.` ..., and a
                       top-level `text_embedding_projection.`) and the other components (`vae.`, `audio_vae.`,
                       `vocoder.`): only the DiT's keys are read, the others are named and dropped.
  ComfyUI              the same: ComfyUI loads Lightricks' single files as they are (its LTXAV model has
                       Lightricks' names under `diffusion_model.`), so a `diffusion_model.` prefix is read too.
  diffusers            `LTX2VideoTransformer3DModel`: the renames of diffusers' scripts/convert_ltx2_to_diffusers.py
                       (LTX_2_0/2_3_TRANSFORMER_KEYS_RENAME_DICT, `convert_ltx2_transformer_adaln_single`):
                       patchify_proj -> proj_in, adaln_single -> time_embed, av_ca_* -> av_cross_attn_*,
                       scale_shift_table_a2v_ca_video -> video_a2v_cross_attn_scale_shift_table, q_norm -> norm_q,
                       ...; tensors unchanged.

LoRA files (ComfyUI's convention, the house format of `video_dit.lora`): `diffusion_model.<native module>.
lora_A.weight` (rank, in), `.lora_B.weight` (out, rank) and optionally `.alpha` (scale alpha / rank; absent:
1). Read in ComfyUI comfy/lora.py `model_lora_keys_unet` (commit 41444b5236c6): every `diffusion_model.<key>`
of the model is a LoRA key ("generic lora format"); ltx-trainer writes exactly these keys without alpha
(trainer.py: `diffusion_model.` + peft's names, Lightricks mirror commit 400fd31). diffusers-format LoRAs
(`transformer.<diffusers module>`) name the attention / FFN Linears as we do; their top-level modules are renamed.
"""

from __future__ import annotations

import re

import torch

from video_dit.families.ltx2.dit_config import LTX2DiTConfig
from video_dit.lora import from_comfy, to_comfy
from video_dit.models.weights import WeightsError, check_state_dict

# top-level modules, (native, diffusers); blocks: the a2v / v2a tables; attentions: the q / k norms
_TOP = (("patchify_proj", "proj_in"), ("audio_patchify_proj", "audio_proj_in"), ("adaln_single", "time_embed"),
        ("audio_adaln_single", "audio_time_embed"), ("prompt_adaln_single", "prompt_adaln"),
        ("audio_prompt_adaln_single", "audio_prompt_adaln"),
        ("av_ca_video_scale_shift_adaln_single", "av_cross_attn_video_scale_shift"),
        ("av_ca_a2v_gate_adaln_single", "av_cross_attn_video_a2v_gate"),
        ("av_ca_audio_scale_shift_adaln_single", "av_cross_attn_audio_scale_shift"),
        ("av_ca_v2a_gate_adaln_single", "av_cross_attn_audio_v2a_gate"))
_BLOCK = (("scale_shift_table_a2v_ca_video", "video_a2v_cross_attn_scale_shift_table"),
          ("scale_shift_table_a2v_ca_audio", "audio_a2v_cross_attn_scale_shift_table"))
_NORMS = (("q_norm", "norm_q"), ("k_norm", "norm_k"))

_ATTN = r"(attn1|attn2|audio_attn1|audio_attn2|audio_to_video_attn|video_to_audio_attn)"
_ADALN = (r"(adaln_single|audio_adaln_single|prompt_adaln_single|audio_prompt_adaln_single"
          r"|av_ca_(video|audio)_scale_shift_adaln_single|av_ca_(a2v|v2a)_gate_adaln_single)"
          r"\.(linear|emb\.timestep_embedder\.linear_[12])")
# Every native (Lightricks) parameter name an LTX2DiT can have.
_NATIVE_KEY = re.compile(
    r"((audio_)?patchify_proj|(audio_)?caption_projection\.linear_[12]|(audio_)?proj_out|" + _ADALN +
    r"|transformer_blocks\.\d+\.(" + _ATTN + r"\.(to_q|to_k|to_v|to_out\.0|to_gate_logits)"
    r"|(ff|audio_ff)\.net\.(0\.proj|2)))\.(weight|bias)"
    r"|transformer_blocks\.\d+\.(" + _ATTN + r"\.(q_norm|k_norm)\.weight"
    r"|(audio_)?(prompt_)?scale_shift_table|scale_shift_table_a2v_ca_(audio|video))"
    r"|(audio_)?scale_shift_table|keyframes_abs_pos_embedding")

SINGLE_FILE_PREFIX = "model.diffusion_model."
# Keys of a Lightricks single file that are not this network: the text connectors (the prefixes of diffusers'
# `split_transformer_and_connector_state_dict`, after the `model.diffusion_model.` prefix) ...
CONNECTOR_PREFIXES = ("video_embeddings_connector.", "audio_embeddings_connector.", "transformer_1d_blocks.",
                      "text_embedding_projection.", "connectors.", "video_connector.", "audio_connector.",
                      "text_proj_in.")


def _rename(key: str, diffusers: bool) -> str:
    """One key native -> diffusers (`diffusers`) or back; names no rename touches pass unchanged."""
    src, dst = (0, 1) if diffusers else (1, 0)
    parts = key.split(".")
    top = {p[src]: p[dst] for p in _TOP}
    if parts[0] in top:
        parts[0] = top[parts[0]]
    elif parts[0] == "transformer_blocks" and len(parts) > 2:
        parts[2] = {p[src]: p[dst] for p in _BLOCK}.get(parts[2], parts[2])
        norms = {p[src]: p[dst] for p in _NORMS}
        parts = parts[:3] + [norms.get(p, p) for p in parts[3:]]
    return ".".join(parts)


def _unexpected(keys, what: str) -> ValueError:
    keys = sorted(keys)
    return ValueError(f"not a {what} state dict: {len(keys)} unexpected keys, first: {', '.join(keys[:5])}")


def _check_native(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    unknown = [k for k in sd if not _NATIVE_KEY.fullmatch(k)]
    if unknown:
        raise _unexpected(unknown, "native (Lightricks) LTX-2 DiT")
    return sd


def ltx2_to_diffusers(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Native (Lightricks) keys -> diffusers `LTX2VideoTransformer3DModel` keys; tensors shared."""
    return {_rename(k, diffusers=True): v for k, v in _check_native(sd).items()}


def ltx2_from_diffusers(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Diffusers `LTX2VideoTransformer3DModel` keys -> native (Lightricks) keys; tensors shared."""
    out = {_rename(k, diffusers=False): v for k, v in sd.items()}
    unknown = [k for k, n in zip(sd, out) if not _NATIVE_KEY.fullmatch(n)]
    if unknown:
        raise _unexpected(unknown, "diffusers LTX-2 DiT")
    return out


def ltx2_dit_keys(sd: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The DiT's tensors of a state dict, prefixes stripped: a Lightricks single file (`model.diffusion_model.`
    keys present) keeps only those, a `diffusion_model.` (ComfyUI) or `transformer.` (diffusers pipeline)
    prefix carried by every key is dropped; the text connectors' keys are dropped. Returns (the DiT's
    keys, the names of the dropped ones' groups)."""
    dropped: set[str] = set()
    if any(k.startswith(SINGLE_FILE_PREFIX) for k in sd):
        dropped.update(k.split(".", 1)[0] + "." for k in sd if not k.startswith(SINGLE_FILE_PREFIX))
        sd = {k[len(SINGLE_FILE_PREFIX):]: v for k, v in sd.items() if k.startswith(SINGLE_FILE_PREFIX)}
    else:
        for prefix in ("diffusion_model.", "transformer."):
            if sd and all(k.startswith(prefix) for k in sd):
                sd = {k[len(prefix):]: v for k, v in sd.items()}
                break
    dropped.update(p for p in CONNECTOR_PREFIXES if any(k.startswith(p) for k in sd))
    return {k: v for k, v in sd.items() if not k.startswith(CONNECTOR_PREFIXES)}, sorted(dropped)


def ltx2_key_layout(sd: dict[str, torch.Tensor]) -> str:
    """"native" or "diffusers" from the key names (prefix-free, connector-free: see `ltx2_dit_keys`)."""
    diffusers = ("proj_in.", "time_embed.", "audio_proj_in.", "audio_time_embed.", "av_cross_attn_")
    if any(k.startswith(diffusers) or ".norm_q." in k or "_a2v_cross_attn_scale_shift_table" in k for k in sd):
        return "diffusers"
    native = ("patchify_proj.", "adaln_single.", "audio_patchify_proj.", "audio_adaln_single.", "av_ca_")
    if any(k.startswith(native) or ".q_norm." in k or "scale_shift_table_a2v_ca_" in k for k in sd):
        return "native"
    raise _unexpected(sd, "LTX-2 DiT (neither Lightricks / ComfyUI nor diffusers names)")


def ltx2_to_native(sd: dict[str, torch.Tensor], source: str = "state dict") -> dict[str, torch.Tensor]:
    """Any supported layout (see the module docstring) -> native (Lightricks) keys, tensors shared. Keys that
    are no LTX-2 DiT parameter raise a ValueError naming `source` and the first such keys."""
    sd, _ = ltx2_dit_keys(sd)
    try:
        layout = ltx2_key_layout(sd)
        return ltx2_from_diffusers(sd) if layout == "diffusers" else _check_native(sd)
    except ValueError as exc:
        raise ValueError(f"{source}: {exc}") from exc


def ltx2_native_for(model: torch.nn.Module, sd: dict[str, torch.Tensor], source: str) -> dict[str, torch.Tensor]:
    """`ltx2_to_native(sd)` checked against `model`'s parameters: a `WeightsError` names `source` and the first
    missing / unexpected / wrong-shape keys. The result loads with `model.load_state_dict(..., assign=True)`."""
    try:
        native = ltx2_to_native(sd, source)
    except ValueError as exc:
        raise WeightsError(str(exc)) from exc
    check_state_dict(model, native, source)
    return native


# ---------------------------------------------------------------- LoRA files

_LORA_MODULE = re.compile(r"(?P<module>.+)\.(lora_A|lora_B)\.weight")


def _check_lora_modules(native: dict[str, torch.Tensor], source: str) -> None:
    bad = sorted({m["module"] for k in native if (m := _LORA_MODULE.fullmatch(k))
                  and not _NATIVE_KEY.fullmatch(m["module"] + ".weight")})
    if bad:
        raise WeightsError(f"{source}: LoRA on {len(bad)} modules an LTX-2 DiT does not have, first: "
                           f"{', '.join(bad[:5])}")


def ltx2_lora_to_comfy(native: dict[str, torch.Tensor], alpha: float) -> dict[str, torch.Tensor]:
    """Native adapter keys (`<module>.lora_A.weight` / `.lora_B.weight`) -> ComfyUI's LTX-2 keys
    (`diffusion_model.<module>.lora_A.weight`, ..., `diffusion_model.<module>.alpha`)."""
    _check_lora_modules(native, "LoRA")
    return to_comfy(native, alpha)


def ltx2_lora_keys(sd: dict[str, torch.Tensor], source: str = "LoRA") -> dict[str, torch.Tensor]:
    """A LoRA file's keys with their prefixes stripped (`lora.from_comfy`'s input: `<module>.lora_A.weight`,
    `<module>.lora_B.weight`, `<module>.alpha`) -> the same under native module names (diffusers' renamed);
    modules an LTX-2 DiT lacks are named (`WeightsError`)."""
    native = {_rename(k, diffusers=False): v for k, v in sd.items()}
    _check_lora_modules(native, source)
    return native


def ltx2_lora_from_file(sd: dict[str, torch.Tensor],
                        source: str = "LoRA") -> tuple[dict[str, torch.Tensor], float, int]:
    """A LoRA file's tensors (ComfyUI / ltx-trainer `diffusion_model.`, diffusers / peft `transformer.` with
    diffusers' module names) -> (native adapter keys, alpha, rank); modules an LTX-2 DiT lacks are named."""
    native, alpha, rank = from_comfy(sd, source)
    native = {_rename(k, diffusers=False): v for k, v in native.items()}
    _check_lora_modules(native, source)
    return native, alpha, rank


# ---------------------------------------------------------------- configuration

_DIFFUSERS_FIXED = {"activation_fn": "gelu-approximate", "qk_norm": "rms_norm_across_heads",
                    "norm_elementwise_affine": False, "attention_bias": True, "attention_out_bias": True,
                    "audio_patch_size": 1, "audio_patch_size_t": 1}
_DIFFUSERS_IGNORED = ("perturbed_attn",)  # STG (spatio-temporal guidance) at sampling time: no weights, no math


def ltx2_config_to_diffusers(config: LTX2DiTConfig) -> dict:
    """`LTX2DiTConfig` -> `LTX2VideoTransformer3DModel(**kwargs)`; diffusers' in / out channels count a
    whole patch (its pipelines pack the patch into the channels, as ltx-core's patchifier)."""
    pt, ph, pw = config.patch_size
    if ph != pw:
        raise ValueError(f"no diffusers LTX2VideoTransformer3DModel for patch_size={config.patch_size}: "
                         "diffusers has one spatial patch size")
    return dict(
        in_channels=config.patch_in_channels, out_channels=config.out_channels * pt * ph * pw, patch_size=ph,
        patch_size_t=pt, num_attention_heads=config.num_attention_heads, attention_head_dim=config.attention_head_dim,
        cross_attention_dim=config.cross_attention_dim, vae_scale_factors=config.vae_scale_factors,
        pos_embed_max_pos=config.positional_embedding_max_pos[0], base_height=config.positional_embedding_max_pos[1],
        base_width=config.positional_embedding_max_pos[2], gated_attn=config.apply_gated_attention,
        cross_attn_mod=config.cross_attention_adaln, audio_in_channels=config.audio_in_channels,
        audio_out_channels=config.audio_out_channels, audio_num_attention_heads=config.audio_num_attention_heads,
        audio_attention_head_dim=config.audio_attention_head_dim,
        audio_cross_attention_dim=config.audio_cross_attention_dim, audio_scale_factor=config.audio_scale_factor,
        audio_pos_embed_max_pos=config.audio_positional_embedding_max_pos[0],
        audio_sampling_rate=config.audio_sampling_rate, audio_hop_length=config.audio_hop_length,
        audio_gated_attn=config.apply_gated_attention, audio_cross_attn_mod=config.cross_attention_adaln,
        num_layers=config.num_layers, norm_eps=config.norm_eps, caption_channels=config.caption_channels,
        rope_theta=config.positional_embedding_theta,
        rope_double_precision=config.frequencies_precision == "float64", causal_offset=config.causal_offset,
        timestep_scale_multiplier=config.timestep_scale_multiplier,
        cross_attn_timestep_scale_multiplier=config.av_ca_timestep_scale_multiplier, rope_type=config.rope_type,
        use_prompt_embeddings=not config.caption_proj_before_connector, ff_bias=config.ff_bias,
        audio_ff_bias=config.audio_ff_bias, use_prompt_adaln_single=config.use_prompt_adaln_single,
        use_keyframes_abs_pos_embedding=config.use_keyframes_abs_pos_embedding, **_DIFFUSERS_FIXED)


def ltx2_config_from_diffusers(d: dict) -> LTX2DiTConfig:
    """A diffusers `LTX2VideoTransformer3DModel` config (its config.json dict, all keys present) -> `LTX2DiTConfig`.
    Unknown keys, other values of the fixed ones and per-stream flags that differ (ltx-core has one flag
    for both streams) are errors naming the key."""
    d = {k: v for k, v in d.items() if not k.startswith("_")}  # _class_name, _diffusers_version, ...
    known = set(ltx2_config_to_diffusers(LTX2DiTConfig())) | set(_DIFFUSERS_IGNORED)
    unknown = sorted(set(d) - known)
    if unknown:
        raise ValueError(f"LTX2VideoTransformer3DModel config: unknown keys {unknown}; known: {sorted(known)}")
    for key, value in _DIFFUSERS_FIXED.items():
        if d.get(key, value) != value:
            raise ValueError(f"LTX2VideoTransformer3DModel config: {key}={d[key]!r}; only {value!r} is supported")
    for video, audio in (("gated_attn", "audio_gated_attn"), ("cross_attn_mod", "audio_cross_attn_mod")):
        if d[video] != d[audio]:
            raise ValueError(f"LTX2VideoTransformer3DModel config: {video}={d[video]} but {audio}={d[audio]}; "
                             "Lightricks' model has one flag for both streams")
    p, pt = d["patch_size"], d["patch_size_t"]
    return LTX2DiTConfig(
        in_channels=d["in_channels"] // (pt * p * p),
        out_channels=(d["out_channels"] or d["in_channels"]) // (pt * p * p),
        patch_size=(pt, p, p), num_attention_heads=d["num_attention_heads"], attention_head_dim=d["attention_head_dim"],
        cross_attention_dim=d["cross_attention_dim"], audio_in_channels=d["audio_in_channels"],
        audio_out_channels=d["audio_out_channels"] or d["audio_in_channels"],
        audio_num_attention_heads=d["audio_num_attention_heads"],
        audio_attention_head_dim=d["audio_attention_head_dim"],
        audio_cross_attention_dim=d["audio_cross_attention_dim"], num_layers=d["num_layers"], norm_eps=d["norm_eps"],
        caption_proj_before_connector=not d["use_prompt_embeddings"],
        caption_channels=d["caption_channels"], apply_gated_attention=d["gated_attn"],
        cross_attention_adaln=d["cross_attn_mod"], use_prompt_adaln_single=d["use_prompt_adaln_single"],
        ff_bias=d["ff_bias"], audio_ff_bias=d["audio_ff_bias"],
        use_keyframes_abs_pos_embedding=d["use_keyframes_abs_pos_embedding"],
        positional_embedding_theta=d["rope_theta"],
        positional_embedding_max_pos=(d["pos_embed_max_pos"], d["base_height"], d["base_width"]),
        audio_positional_embedding_max_pos=(d["audio_pos_embed_max_pos"],), rope_type=d["rope_type"],
        frequencies_precision="float64" if d["rope_double_precision"] else "float32",
        timestep_scale_multiplier=d["timestep_scale_multiplier"],
        av_ca_timestep_scale_multiplier=d["cross_attn_timestep_scale_multiplier"],
        vae_scale_factors=tuple(d["vae_scale_factors"]), causal_offset=d["causal_offset"],
        audio_sampling_rate=d["audio_sampling_rate"], audio_hop_length=d["audio_hop_length"],
        audio_scale_factor=d["audio_scale_factor"])
