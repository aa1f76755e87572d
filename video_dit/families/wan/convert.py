"""State-dict key conversion between the native (original Wan checkpoint) names and diffusers'
names, both ways, for the DiT and the VAE. Pure functions over dicts of tensors."""

from __future__ import annotations

import re

import torch

from video_dit.families.wan.vae import VAEConfig
from video_dit.models.weights import strip_dit_prefix

# ---------------------------------------------------------------- DiT

# (native, diffusers) module or parameter names; `#` is a block index. Native names are the
# original Wan checkpoint names; a key's tail (`.weight`, `.bias`) is carried over unchanged.
_DIT_NAMES = [
    ("patch_embedding", "patch_embedding"),
    ("text_embedding.0", "condition_embedder.text_embedder.linear_1"),
    ("text_embedding.2", "condition_embedder.text_embedder.linear_2"),
    ("time_embedding.0", "condition_embedder.time_embedder.linear_1"),
    ("time_embedding.2", "condition_embedder.time_embedder.linear_2"),
    ("time_projection.1", "condition_embedder.time_proj"),
    # the CLIP image branch of Wan 2.1 I2V / FLF2V (Wan's MLPProj = diffusers' WanImageEmbedding)
    ("img_emb.proj.0", "condition_embedder.image_embedder.norm1"),
    ("img_emb.proj.1", "condition_embedder.image_embedder.ff.net.0.proj"),
    ("img_emb.proj.3", "condition_embedder.image_embedder.ff.net.2"),
    ("img_emb.proj.4", "condition_embedder.image_embedder.norm2"),
    ("img_emb.emb_pos", "condition_embedder.image_embedder.pos_embed"),
    ("blocks.#.cross_attn.k_img", "blocks.#.attn2.add_k_proj"),
    ("blocks.#.cross_attn.v_img", "blocks.#.attn2.add_v_proj"),
    ("blocks.#.cross_attn.norm_k_img", "blocks.#.attn2.norm_added_k"),
    *[(f"blocks.#.{ours}.{a}", f"blocks.#.{theirs}.{b}")
      for ours, theirs in (("self_attn", "attn1"), ("cross_attn", "attn2"))
      for a, b in (("q", "to_q"), ("k", "to_k"), ("v", "to_v"), ("o", "to_out.0"),
                   ("norm_q", "norm_q"), ("norm_k", "norm_k"))],
    ("blocks.#.norm3", "blocks.#.norm2"),  # the affine LayerNorm before cross-attention
    ("blocks.#.ffn.0", "blocks.#.ffn.net.0.proj"),
    ("blocks.#.ffn.2", "blocks.#.ffn.net.2"),
    ("blocks.#.modulation", "blocks.#.scale_shift_table"),
    ("head.head", "proj_out"),
    ("head.modulation", "scale_shift_table"),
]
_TO_DIFFUSERS = _DIT_NAMES
_FROM_DIFFUSERS = [(d, n) for n, d in _DIT_NAMES]
_BLOCK = re.compile(r"blocks\.(\d+)\.")

def _rename_key(key: str, pairs) -> str:
    m = _BLOCK.match(key)
    generic = "blocks.#." + key[m.end():] if m else key
    for src, dst in pairs:
        if generic == src or generic.startswith(src + "."):
            renamed = dst + generic[len(src):]
            return renamed.replace("#", m.group(1), 1) if m else renamed
    return key  # a key no rule knows passes through unchanged; loading reports it as unexpected


def _rename(sd: dict[str, torch.Tensor], pairs) -> dict[str, torch.Tensor]:
    return {_rename_key(k, pairs): v for k, v in strip_dit_prefix(sd).items()}


def dit_to_diffusers(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Native (original Wan) DiT keys -> diffusers `WanTransformer3DModel` keys; tensors unchanged."""
    return _rename(sd, _TO_DIFFUSERS)


def dit_from_diffusers(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Diffusers `WanTransformer3DModel` keys -> native (original Wan) keys; tensors unchanged.
    `attn2.norm_added_q` (an unused norm some diffusers I2V files carry; diffusers itself ignores it
    on load, `_keys_to_ignore_on_load_unexpected`) is dropped: Wan has no image-query norm."""
    return _rename({k: v for k, v in sd.items() if ".norm_added_q." not in k}, _FROM_DIFFUSERS)


def dit_key_layout(sd: dict[str, torch.Tensor]) -> str:
    """"native" or "diffusers" from the key names (after prefix stripping); error when neither."""
    keys = strip_dit_prefix(sd).keys()
    if any(k.startswith(("condition_embedder.", "proj_out.")) or ".attn1." in k for k in keys):
        return "diffusers"
    if any(k.startswith(("text_embedding.", "time_embedding.", "head.head.")) or ".self_attn." in k for k in keys):
        return "native"
    sample = ", ".join(sorted(keys)[:5])
    raise ValueError(f"not a Wan DiT state dict (neither original Wan nor diffusers key names); first keys: {sample}")


# ---------------------------------------------------------------- VAE

# Names inside one residual block, (native, diffusers).
_VAE_RES = (("residual.0.", "norm1."), ("residual.2.", "conv1."), ("residual.3.", "norm2."),
            ("residual.6.", "conv2."), ("shortcut.", "conv_shortcut."))
# Fixed module names, (native, diffusers), matched as key prefixes.
_VAE_FIXED = (("conv1.", "quant_conv."), ("conv2.", "post_quant_conv."),
              *[(f"{p}.{a}", f"{p}.{b}") for p in ("encoder", "decoder")
                for a, b in (("conv1.", "conv_in."), ("head.0.", "norm_out."), ("head.2.", "conv_out."),
                             ("middle.0.", "mid_block.resnets.0."), ("middle.1.", "mid_block.attentions.0."),
                             ("middle.2.", "mid_block.resnets.1."))])
_VAE_RESAMPLE = ("resample.", "time_conv.")
_VAE_LEVEL = re.compile(r"(encoder\.downsamples|decoder\.upsamples)\.(\d+)\.(?:(?:downsamples|upsamples)\.(\d+)\.)?(.*)")
_VAE_DIFF_LEVEL = re.compile(
    r"(encoder\.down_blocks|decoder\.up_blocks)\.(\d+)\.(?:(resnets)\.(\d+)\.|(downsampler|upsampler|upsamplers\.0)\.)?(.*)")


def _vae_rename_tail(tail: str, pairs) -> str:
    for a, b in pairs:
        if tail.startswith(a):
            return b + tail[len(a):]
    return tail


def vae_key_layout(sd: dict[str, torch.Tensor]) -> str:
    """"native" (original Wan VAE) or "diffusers" (`AutoencoderKLWan`) from the key names."""
    if any(k.startswith(("quant_conv.", "encoder.conv_in.", "decoder.mid_block.")) for k in sd):
        return "diffusers"
    if any(k.startswith(("encoder.conv1.", "decoder.middle.", "conv1.")) for k in sd):
        return "native"
    raise ValueError("not a Wan VAE state dict (neither original Wan nor diffusers AutoencoderKLWan "
                     f"key names); first keys: {', '.join(sorted(sd)[:5])}")


def _flat_decoder_kinds(indices_to_tails: dict[int, list[str]]) -> dict[int, str]:
    return {i: ("resample" if any(t.startswith(_VAE_RESAMPLE) for t in tails)
                else "attention" if any(t.startswith("to_qkv.") for t in tails) else "res")
            for i, tails in indices_to_tails.items()}


def vae_to_diffusers(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Native (original Wan 2.1 / 2.2 VAE) keys -> diffusers `AutoencoderKLWan` keys; tensors unchanged.

    Wan 2.1 keeps flat `decoder.upsamples.N` lists that diffusers groups into `up_blocks.i.resnets.j`
    and `up_blocks.i.upsamplers.0` (a group ends at each resample); Wan 2.2 nests
    `upsamples.i.upsamples.j`, which maps to `resnets.j` or the block's `upsampler`.
    """
    flat: dict[int, list[str]] = {}
    for k in sd:
        m = _VAE_LEVEL.fullmatch(k)
        if m and m.group(1) == "decoder.upsamples" and m.group(3) is None:
            flat.setdefault(int(m.group(2)), []).append(m.group(4))
    groups: dict[int, str] = {}  # flat decoder index -> diffusers prefix
    block, j = 0, 0
    for i, kind in sorted(_flat_decoder_kinds(flat).items()):
        if kind == "attention":
            raise ValueError(f"decoder.upsamples.{i} is an attention block; diffusers' AutoencoderKLWan "
                             "has no attention in its up blocks, so this VAE has no diffusers layout")
        if kind == "resample":
            groups[i], block, j = f"decoder.up_blocks.{block}.upsamplers.0.", block + 1, 0
        else:
            groups[i], j = f"decoder.up_blocks.{block}.resnets.{j}.", j + 1
    out = {}
    for k, v in sd.items():
        m = _VAE_LEVEL.fullmatch(k)
        if m is None:
            new = k
            for a, b in _VAE_FIXED:
                if k.startswith(a):
                    new = b + _vae_rename_tail(k[len(a):], _VAE_RES)
                    break
        else:
            where, i, j, tail = m.group(1), int(m.group(2)), m.group(3), m.group(4)
            is_resample = tail.startswith(_VAE_RESAMPLE)
            tail = tail if is_resample else _vae_rename_tail(tail, _VAE_RES)
            if j is not None:  # Wan 2.2 nested level
                name = "down_blocks" if where.startswith("encoder") else "up_blocks"
                sub = ("downsampler." if name == "down_blocks" else "upsampler.") if is_resample else f"resnets.{j}."
                new = f"{where.split('.')[0]}.{name}.{i}.{sub}{tail}"
            elif where == "encoder.downsamples":  # Wan 2.1 encoder: flat in both layouts
                new = f"encoder.down_blocks.{i}.{tail}"
            else:
                new = groups[i] + tail
        out[new] = v
    return out


def vae_from_diffusers(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Diffusers `AutoencoderKLWan` keys -> native (original Wan 2.1 / 2.2 VAE) keys; tensors unchanged."""
    residual = any(".down_blocks.0.resnets." in k for k in sd)  # Wan 2.2 layout
    n_res: dict[tuple[str, int], int] = {}  # (where, block) -> number of resnets
    for k in sd:
        m = _VAE_DIFF_LEVEL.fullmatch(k)
        if m and m.group(3):
            key = (m.group(1), int(m.group(2)))
            n_res[key] = max(n_res.get(key, 0), int(m.group(4)) + 1)
    offsets, total = {}, 0  # Wan 2.1 decoder: flat index of each block's first resnet
    for (where, b) in sorted(k for k in n_res if k[0] == "decoder.up_blocks"):
        has_up = any(k.startswith(f"decoder.up_blocks.{b}.upsamplers.0.") for k in sd)
        offsets[b], total = total, total + n_res[(where, b)] + int(has_up)
    fixed_back = [(b, a) for a, b in _VAE_FIXED]
    res_back = [(b, a) for a, b in _VAE_RES]
    out = {}
    for k, v in sd.items():
        m = _VAE_DIFF_LEVEL.fullmatch(k)
        if m is None:
            new = k
            for a, b in fixed_back:
                if k.startswith(a):
                    new = b + _vae_rename_tail(k[len(a):], res_back)
                    break
        else:
            where, i, resnet, j, sampler, tail = m.groups()
            i = int(i)
            native = "encoder.downsamples" if where.startswith("encoder") else "decoder.upsamples"
            inner = native.split(".")[1]
            if resnet is None and sampler is None:  # Wan 2.1 encoder: flat in both layouts
                new = f"{native}.{i}.{_vae_rename_tail(tail, res_back)}"
            elif residual:
                j = int(j) if resnet else n_res.get((where, i), 0)
                new = f"{native}.{i}.{inner}.{j}.{tail if sampler else _vae_rename_tail(tail, res_back)}"
            else:  # Wan 2.1 decoder: back to the flat list
                flat = offsets.get(i, 0) + (int(j) if resnet else n_res.get((where, i), 0))
                new = f"{native}.{flat}.{tail if sampler else _vae_rename_tail(tail, res_back)}"
        out[new] = v
    return out


def vae_config_from_diffusers(cfg: dict):
    """A diffusers `AutoencoderKLWan` config.json dict -> `VAEConfig`; unknown keys are errors."""
    known = {"base_dim", "decoder_base_dim", "z_dim", "dim_mult", "num_res_blocks", "attn_scales",
             "temperal_downsample", "dropout", "latents_mean", "latents_std", "is_residual", "in_channels",
             "out_channels", "patch_size", "scale_factor_temporal", "scale_factor_spatial"}
    cfg = {k: v for k, v in cfg.items() if not k.startswith("_")}  # _class_name, _diffusers_version
    unknown = sorted(set(cfg) - known)
    if unknown:
        raise ValueError(f"AutoencoderKLWan config: unknown keys {unknown}; known: {sorted(known)}")
    p = cfg.get("patch_size") or 1
    if cfg.get("in_channels", 3 * p * p) != 3 * p * p:
        raise ValueError(f"AutoencoderKLWan config: in_channels={cfg['in_channels']} with patch_size={p}; "
                         f"expected {3 * p * p} (RGB, patchified)")
    return VAEConfig(dim=cfg.get("base_dim", 96), dec_dim=cfg.get("decoder_base_dim"), z_dim=cfg.get("z_dim", 16),
                     dim_mult=tuple(cfg.get("dim_mult", (1, 2, 4, 4))),
                     num_res_blocks=cfg.get("num_res_blocks", 2), attn_scales=tuple(cfg.get("attn_scales", ())),
                     temperal_downsample=tuple(cfg.get("temperal_downsample", (False, True, True))),
                     dropout=cfg.get("dropout", 0.0), is_residual=cfg.get("is_residual", False), patch_size=p,
                     mean=tuple(cfg.get("latents_mean") or ()), std=tuple(cfg.get("latents_std") or ()))


def vae_config_to_diffusers(config) -> dict:
    """`VAEConfig` -> `AutoencoderKLWan(**kwargs)` constructor arguments."""
    p = config.patch_size
    return dict(base_dim=config.dim, decoder_base_dim=config.dec_dim, z_dim=config.z_dim,
                dim_mult=list(config.dim_mult), num_res_blocks=config.num_res_blocks,
                attn_scales=list(config.attn_scales), temperal_downsample=list(config.temperal_downsample),
                dropout=config.dropout, is_residual=config.is_residual,
                in_channels=3 * p * p, out_channels=3 * p * p, patch_size=p if p > 1 else None,
                latents_mean=list(config.mean) or [0.0] * config.z_dim,
                latents_std=list(config.std) or [1.0] * config.z_dim,
                scale_factor_temporal=config.temporal_compression, scale_factor_spatial=config.spatial_compression)


# ---------------------------------------------------------------- CLIP image encoder

# Wan's ViT (wan/modules/clip.py `VisionTransformer`, keys under `visual.` in
# models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth) -> transformers' flat `CLIPVisionModel`.
_CLIP_WAN_FIXED = {"patch_embedding.weight": "embeddings.patch_embedding.weight",
                   "pre_norm.weight": "pre_layrnorm.weight", "pre_norm.bias": "pre_layrnorm.bias",
                   "post_norm.weight": "post_layernorm.weight", "post_norm.bias": "post_layernorm.bias"}
_CLIP_WAN_BLOCK = {"norm1": "layer_norm1", "norm2": "layer_norm2", "attn.proj": "self_attn.out_proj",
                   "mlp.0": "mlp.fc1", "mlp.2": "mlp.fc2"}
_CLIP_WAN_KEY = re.compile(r"transformer\.(\d+)\.(.+)\.(weight|bias)")
# Not part of the image features: the text tower, the projection heads, position-id buffers.
_CLIP_UNUSED = ("textual.", "text_model.", "log_scale", "logit_scale", "text_projection", "visual_projection",
                "visual.head")


def clip_vision_key_layout(sd: dict[str, torch.Tensor]) -> str:
    """"wan" (Wan's open-clip ViT, `visual.transformer.N.attn.to_qkv`) or "transformers" (HF
    `CLIPVisionModel`, flat or under `vision_model.`: diffusers' image_encoder/, ComfyUI's
    clip_vision_h.safetensors); an error naming the accepted layouts otherwise."""
    if any(k.startswith("visual.transformer.") and ".attn.to_qkv." in k for k in sd):
        return "wan"
    if any(k.startswith(("vision_model.encoder.layers.", "encoder.layers.")) for k in sd):
        return "transformers"
    hint = " (open_clip's own `resblocks` layout is not read; convert it to transformers' first)" \
        if any(".resblocks." in k for k in sd) else ""
    raise ValueError(f"not a CLIP vision state dict{hint}; accepted: transformers CLIPVisionModel keys "
                     "(`vision_model.encoder.layers.N...` or `encoder.layers.N...`) or Wan's "
                     f"`visual.transformer.N...`; first keys: {', '.join(sorted(sd)[:5])}")


def clip_vision_from_wan(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Wan's CLIP checkpoint (`visual.*`, plus the unused `textual.*` / `log_scale`) -> transformers'
    flat `CLIPVisionModel` keys. The fused `attn.to_qkv` (3C, C) splits into q/k/v (Wan's `.view(b, s,
    3, n, d)` order); `cls_embedding` (1, 1, C) -> `class_embedding` (C,); `pos_embedding` (1, T, C) ->
    `position_embedding.weight` (T, C). The projection head `visual.head` and the text tower are dropped."""
    out: dict[str, torch.Tensor] = {}
    for key, value in sd.items():
        if key.startswith(_CLIP_UNUSED) or not key.startswith("visual."):
            continue
        k = key[len("visual."):]
        if k in _CLIP_WAN_FIXED:
            out[_CLIP_WAN_FIXED[k]] = value
        elif k == "cls_embedding":
            out["embeddings.class_embedding"] = value.reshape(-1)
        elif k == "pos_embedding":
            out["embeddings.position_embedding.weight"] = value.reshape(value.shape[-2], value.shape[-1])
        elif (m := _CLIP_WAN_KEY.fullmatch(k)) is not None:
            i, name, kind = m.groups()
            prefix = f"encoder.layers.{i}."
            if name == "attn.to_qkv":
                for part, chunk in zip(("q_proj", "k_proj", "v_proj"), value.chunk(3, dim=0)):
                    out[f"{prefix}self_attn.{part}.{kind}"] = chunk
            else:
                out[prefix + _CLIP_WAN_BLOCK.get(name, name) + "." + kind] = value
        else:
            out[k] = value  # unknown: reported as unexpected by the loader
    return out


def clip_vision_from_transformers(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers CLIP vision keys (flat, or under `vision_model.` as in ComfyUI's
    clip_vision_h.safetensors and older transformers) -> flat `CLIPVisionModel` keys; the projection
    heads, a text tower and `position_ids` buffers are dropped."""
    out = {}
    for key, value in sd.items():
        k = key[len("vision_model."):] if key.startswith("vision_model.") else key
        if k.startswith(_CLIP_UNUSED) or k.endswith("position_ids"):
            continue
        out[k] = value
    return out
