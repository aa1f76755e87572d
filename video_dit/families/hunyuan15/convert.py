"""State-dict conversion for the HunyuanVideo 1.5 DiT, pure functions over dicts of tensors.

Layouts:
  native / Tencent  the original checkpoint names (tencent/HunyuanVideo-1.5 transformer/<variant>/*.safetensors),
                    which `HunyuanVideo15DiT` uses: double_blocks.N.img_attn_q, img_mlp.fc1, final_layer.linear, ...
  diffusers         `HunyuanVideo15Transformer3DModel`: transformer_blocks.N.attn.to_q, ... The refiner's fused
                    `self_attn_qkv` is split into to_q / to_k / to_v, and the final adaLN Linear's halves are
                    [scale | shift] there, [shift | scale] in Tencent's (diffusers' conversion script swaps them).
  ComfyUI           Comfy-Org's repackaged files: Tencent's names with each double block's q/k/v fused
                    (`img_attn_qkv`, `txt_attn_qkv`, [q | k | v] along dim 0); a checkpoint ComfyUI saves
                    instead holds the names its HunyuanVideo model uses inside (`img_attn.qkv`, `img_mod.lin`,
                    `img_attn.norm.query_norm.scale`, `img_mlp.0`, `time_in.in_layer`, ...). Either may carry a
                    `model.diffusion_model.` / `diffusion_model.` prefix; both are read, the repackaged one written.

`hy15_to_native` reads any of them; a key no rule knows is a ValueError naming the first such keys.
"""

from __future__ import annotations

import math
import re

import torch

from video_dit.families.hunyuan15.config import HY15DiTConfig, default_rope_dims
from video_dit.models.weights import strip_dit_prefix

_BLOCK = re.compile(r"(double_blocks|transformer_blocks|txt_in\.individual_token_refiner\.blocks"
                    r"|context_embedder\.token_refiner\.refiner_blocks)\.(\d+)\.")
_REFINER_N = "txt_in.individual_token_refiner.blocks.#"
_REFINER_D = "context_embedder.token_refiner.refiner_blocks.#"

# (native, diffusers) module names; `#` is a block index; a key's tail (.weight / .bias) carries over.
_PAIRS = [
    ("img_in.proj", "x_embedder.proj"),
    ("time_in.mlp.0", "time_embed.timestep_embedder.linear_1"),
    ("time_in.mlp.2", "time_embed.timestep_embedder.linear_2"),
    ("time_r_in.mlp.0", "time_embed.timestep_embedder_r.linear_1"),
    ("time_r_in.mlp.2", "time_embed.timestep_embedder_r.linear_2"),
    ("txt_in.input_embedder", "context_embedder.proj_in"),
    ("txt_in.t_embedder.mlp.0", "context_embedder.time_text_embed.timestep_embedder.linear_1"),
    ("txt_in.t_embedder.mlp.2", "context_embedder.time_text_embed.timestep_embedder.linear_2"),
    ("txt_in.c_embedder.linear_1", "context_embedder.time_text_embed.text_embedder.linear_1"),
    ("txt_in.c_embedder.linear_2", "context_embedder.time_text_embed.text_embedder.linear_2"),
    *[(f"{_REFINER_N}.{a}", f"{_REFINER_D}.{b}") for a, b in (
        ("norm1", "norm1"), ("self_attn_proj", "attn.to_out.0"), ("norm2", "norm2"), ("mlp.fc1", "ff.net.0.proj"),
        ("mlp.fc2", "ff.net.2"), ("adaLN_modulation.1", "norm_out.linear"))],
    ("byt5_in.layernorm", "context_embedder_2.norm"),
    *[(f"byt5_in.fc{i}", f"context_embedder_2.linear_{i}") for i in (1, 2, 3)],
    ("vision_in.proj.0", "image_embedder.norm_in"),
    ("vision_in.proj.1", "image_embedder.linear_1"),
    ("vision_in.proj.3", "image_embedder.linear_2"),
    ("vision_in.proj.4", "image_embedder.norm_out"),
    ("cond_type_embedding", "cond_type_embed"),
    *[(f"double_blocks.#.{a}", f"transformer_blocks.#.{b}") for a, b in (
        ("img_mod.linear", "norm1.linear"), ("txt_mod.linear", "norm1_context.linear"),
        ("img_attn_q", "attn.to_q"), ("img_attn_k", "attn.to_k"), ("img_attn_v", "attn.to_v"),
        ("img_attn_q_norm", "attn.norm_q"), ("img_attn_k_norm", "attn.norm_k"), ("img_attn_proj", "attn.to_out.0"),
        ("txt_attn_q", "attn.add_q_proj"), ("txt_attn_k", "attn.add_k_proj"), ("txt_attn_v", "attn.add_v_proj"),
        ("txt_attn_q_norm", "attn.norm_added_q"), ("txt_attn_k_norm", "attn.norm_added_k"),
        ("txt_attn_proj", "attn.to_add_out"), ("img_mlp.fc1", "ff.net.0.proj"), ("img_mlp.fc2", "ff.net.2"),
        ("txt_mlp.fc1", "ff_context.net.0.proj"), ("txt_mlp.fc2", "ff_context.net.2"))],
    ("final_layer.linear", "proj_out"),
    ("final_layer.adaLN_modulation.1", "norm_out.linear"),  # halves swapped, see _swap_halves
]
_TO_DIFFUSERS = dict(_PAIRS)
_FROM_DIFFUSERS = {d: n for n, d in _PAIRS}
_FINAL_ADALN = "final_layer.adaLN_modulation.1"
_REFINER_QKV = ("to_q", "to_k", "to_v")

# ComfyUI's inside names -> Tencent's (the inverse of ComfyUI's HunyuanVideo `process_unet_state_dict`).
_COMFY_INSIDE = [(re.compile(a), b) for a, b in (
    (r"^(time_in|time_r_in|txt_in\.t_embedder)\.in_layer\.", r"\1.mlp.0."),
    (r"^(time_in|time_r_in|txt_in\.t_embedder)\.out_layer\.", r"\1.mlp.2."),
    (r"^txt_in\.c_embedder\.in_layer\.", "txt_in.c_embedder.linear_1."),
    (r"^txt_in\.c_embedder\.out_layer\.", "txt_in.c_embedder.linear_2."),
    (r"_mod\.lin\.", "_mod.linear."),
    (r"_attn\.qkv\.", "_attn_qkv."),
    (r"_attn\.norm\.query_norm\.scale$", "_attn_q_norm.weight"),
    (r"_attn\.norm\.key_norm\.scale$", "_attn_k_norm.weight"),
    (r"_attn\.proj\.", "_attn_proj."),
    (r"_mlp\.0\.", "_mlp.fc1."),
    (r"_mlp\.2\.", "_mlp.fc2."),
    (r"^(txt_in\.individual_token_refiner\.blocks\.\d+)\.mlp\.0\.", r"\1.mlp.fc1."),
    (r"^(txt_in\.individual_token_refiner\.blocks\.\d+)\.mlp\.2\.", r"\1.mlp.fc2."),
)]
_FUSED_QKV = re.compile(r"(double_blocks\.\d+\.(?:img|txt))_attn_qkv\.(weight|bias)")
_SPLIT_QKV = re.compile(r"(double_blocks\.\d+\.(?:img|txt))_attn_([qkv])\.(weight|bias)")

# Every native (Tencent) parameter name the model can have.
_NATIVE_KEY = re.compile(
    r"(img_in\.proj|(time_in|time_r_in|txt_in\.t_embedder)\.mlp\.[02]|txt_in\.input_embedder"
    r"|txt_in\.c_embedder\.linear_[12]"
    r"|txt_in\.individual_token_refiner\.blocks\.\d+\.(norm[12]|self_attn_qkv|self_attn_proj|mlp\.fc[12]"
    r"|adaLN_modulation\.1)"
    r"|byt5_in\.(layernorm|fc[123])|vision_in\.proj\.[0134]"
    r"|double_blocks\.\d+\.(img|txt)_(mod\.linear|attn_[qkv]|attn_[qk]_norm|attn_proj|mlp\.fc[12])"
    r"|final_layer\.(linear|adaLN_modulation\.1))\.(weight|bias)|cond_type_embedding\.weight")


def _generic(key: str) -> tuple[str, str | None]:
    """key -> (key with its block index replaced by `#`, the index)."""
    m = _BLOCK.match(key)
    return (f"{m.group(1)}.#.{key[m.end():]}", m.group(2)) if m else (key, None)


def _split_tail(key: str) -> tuple[str, str]:
    module, _, tail = key.rpartition(".")
    return module, tail


def _swap_halves(t: torch.Tensor) -> torch.Tensor:
    a, b = t.chunk(2, dim=0)
    return torch.cat([b, a], dim=0)


def _unexpected(keys, what: str) -> ValueError:
    keys = sorted(keys)
    return ValueError(f"not a {what} state dict: {len(keys)} unexpected keys, first: {', '.join(keys[:5])}")


def hy15_to_diffusers(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Native (Tencent) keys -> diffusers `HunyuanVideo15Transformer3DModel` keys."""
    out, unknown = {}, []
    for key, value in strip_dit_prefix(sd).items():
        generic, index = _generic(key)
        module, tail = _split_tail(generic)
        if module == f"{_REFINER_N}.self_attn_qkv":  # fused [q | k | v] -> three Linears
            for name, part in zip(_REFINER_QKV, value.chunk(3, dim=0)):
                out[f"{_REFINER_D}.attn.{name}.{tail}".replace("#", index)] = part
        elif module in _TO_DIFFUSERS:
            new = f"{_TO_DIFFUSERS[module]}.{tail}"
            out[new.replace("#", index) if index else new] = _swap_halves(value) if module == _FINAL_ADALN else value
        else:
            unknown.append(key)
    if unknown:
        raise _unexpected(unknown, "native (Tencent) HunyuanVideo 1.5")
    return out


def hy15_from_diffusers(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Diffusers `HunyuanVideo15Transformer3DModel` keys -> native (Tencent) keys."""
    out, unknown, qkv = {}, [], {}
    for key, value in strip_dit_prefix(sd).items():
        generic, index = _generic(key)
        module, tail = _split_tail(generic)
        if module.startswith(f"{_REFINER_D}.attn.") and module.rsplit(".", 1)[1] in _REFINER_QKV:
            qkv.setdefault((index, tail), {})[module.rsplit(".", 1)[1]] = value
        elif module in _FROM_DIFFUSERS:
            native = _FROM_DIFFUSERS[module]
            new = f"{native}.{tail}"
            out[new.replace("#", index) if index else new] = _swap_halves(value) if native == _FINAL_ADALN else value
        else:
            unknown.append(key)
    for (index, tail), parts in qkv.items():
        if set(parts) != set(_REFINER_QKV):
            raise ValueError(f"diffusers HunyuanVideo 1.5 state dict: refiner block {index} has "
                             f"attn.{sorted(parts)} ({tail}); expected to_q, to_k and to_v")
        out[f"{_REFINER_N}.self_attn_qkv.{tail}".replace("#", index)] = torch.cat([parts[n] for n in _REFINER_QKV])
    if unknown:
        raise _unexpected(unknown, "diffusers HunyuanVideo 1.5")
    return out


def hy15_to_comfy(sd: dict[str, torch.Tensor], prefix: str = "") -> dict[str, torch.Tensor]:
    """Native (Tencent) keys -> ComfyUI's repackaged layout (each double block's q/k/v fused), keys
    prefixed with `prefix` ("", "diffusion_model." or "model.diffusion_model.")."""
    out, parts = {}, {}
    for key, value in strip_dit_prefix(sd).items():
        m = _SPLIT_QKV.fullmatch(key)
        if m:
            parts.setdefault((m.group(1), m.group(3)), {})[m.group(2)] = value
        else:
            out[prefix + key] = value
    for (stream, tail), qkv in parts.items():
        if set(qkv) != set("qkv"):
            raise ValueError(f"{stream}: has attn_{sorted(qkv)} ({tail}); expected q, k and v to fuse")
        out[f"{prefix}{stream}_attn_qkv.{tail}"] = torch.cat([qkv["q"], qkv["k"], qkv["v"]])
    return out


def hy15_from_comfy(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """ComfyUI keys (repackaged files or ComfyUI's inside names, with or without prefix) -> native keys."""
    out = {}
    for key, value in strip_dit_prefix(sd).items():
        for pattern, repl in _COMFY_INSIDE:
            key = pattern.sub(repl, key)
        m = _FUSED_QKV.fullmatch(key)
        if m:
            for name, part in zip("qkv", value.chunk(3, dim=0)):
                out[f"{m.group(1)}_attn_{name}.{m.group(2)}"] = part
        else:
            out[key] = value
    return out


def hy15_key_layout(sd: dict[str, torch.Tensor]) -> str:
    """"native", "diffusers" or "comfy" from the key names (after prefix stripping); error when none."""
    keys = list(strip_dit_prefix(sd))
    if any(k.startswith(("x_embedder.", "transformer_blocks.", "context_embedder.", "time_embed.")) for k in keys):
        return "diffusers"
    comfy = ("_attn_qkv.", "_attn.qkv.", "_mod.lin.", ".in_layer.", "query_norm.scale", "_attn.proj.")
    if any(k.startswith("double_blocks.") and any(c in k for c in comfy) for k in keys) or \
            any(".in_layer." in k or "self_attn.qkv." in k for k in keys):
        return "comfy"
    if any(k.startswith(("img_in.", "double_blocks.", "txt_in.", "final_layer.")) for k in keys):
        return "native"
    raise _unexpected(keys, "HunyuanVideo 1.5 DiT (neither Tencent, diffusers nor ComfyUI names)")


def hy15_to_native(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Any supported layout (see the module docstring) -> native (Tencent) keys; tensors shared where
    nothing is split or fused. Keys that are no HunyuanVideo 1.5 parameter raise a ValueError."""
    layout = hy15_key_layout(sd)
    out = {"diffusers": hy15_from_diffusers, "comfy": hy15_from_comfy}.get(layout, strip_dit_prefix)(sd)
    unknown = [k for k in out if not _NATIVE_KEY.fullmatch(k)]
    if unknown:
        raise _unexpected(unknown, f"HunyuanVideo 1.5 ({layout} layout)")
    return out


# ---------------------------------------------------------------- configuration


def _count(keys, prefix: str) -> int:
    found = {int(m.group(1)) for k in keys if (m := re.match(re.escape(prefix) + r"(\d+)\.", k))}
    return max(found) + 1 if found else 0


def infer_hy15_config(shapes: dict) -> HY15DiTConfig:
    """`HY15DiTConfig` from a state dict's shapes ({name: tensor or shape}, any layout). RoPE bands and theta
    are not in the weights: `default_rope_dims(head_dim)` ([16, 56, 56] at 128, the public models) and 256."""
    meta = {k: torch.empty(tuple(v.shape) if hasattr(v, "shape") else tuple(v), device="meta")
            for k, v in shapes.items()}
    s = {k: tuple(v.shape) for k, v in hy15_to_native(meta).items()}
    keys = list(s)

    def need(key):
        if key not in s:
            raise ValueError(f"infer_hy15_config: the state dict has no {key!r} "
                             f"(first keys: {', '.join(sorted(s)[:5])})")
        return s[key]

    D, conv_in, *patch = need("img_in.proj.weight")
    out_channels = need("final_layer.linear.weight")[0] // math.prod(patch)
    concat = conv_in == 2 * out_channels + 1  # [latents | condition latents | mask] (every public model)
    head_dim = need("double_blocks.0.img_attn_q_norm.weight")[0]
    byt5 = "byt5_in.fc1.weight" in s
    vision = "vision_in.proj.1.weight" in s
    return HY15DiTConfig(
        patch_size=tuple(patch), in_channels=out_channels if concat else conv_in, concat_condition=concat,
        out_channels=out_channels, hidden_size=D, heads_num=D // head_dim,
        mlp_width_ratio=need("double_blocks.0.img_mlp.fc1.weight")[0] / D,
        mm_double_blocks_depth=_count(keys, "double_blocks."), rope_dim_list=default_rope_dims(head_dim),
        qkv_bias="double_blocks.0.img_attn_q.bias" in s, text_states_dim=need("txt_in.input_embedder.weight")[1],
        refiner_depth=_count(keys, "txt_in.individual_token_refiner.blocks."), glyph_byT5_v2=byt5,
        # without the ByT5 / SigLIP branch its widths are not in the weights: the defaults stay
        **(dict(byt5_states_dim=s["byt5_in.fc1.weight"][1], byt5_hidden_dim=s["byt5_in.fc1.weight"][0]) if byt5
           else {}),
        vision_projection="linear" if vision else "none",
        **({"vision_states_dim": s["vision_in.proj.1.weight"][1]} if vision else {}),
        use_cond_type_embedding="cond_type_embedding.weight" in s, use_meanflow="time_r_in.mlp.0.weight" in s)


_DIFFUSERS_IGNORED = ("target_size", "task_type")  # pipeline settings, not the network
_DIFFUSERS_KNOWN = ("in_channels", "out_channels", "num_attention_heads", "attention_head_dim", "num_layers",
                    "num_refiner_layers", "mlp_ratio", "patch_size", "patch_size_t", "qk_norm", "text_embed_dim",
                    "text_embed_2_dim", "image_embed_dim", "rope_theta", "rope_axes_dim", "use_meanflow")
_DIFFUSERS_BYT5_HIDDEN = 2048  # HunyuanVideo15ByT5TextProjection's width, hard-coded in diffusers


def hy15_config_from_diffusers(cfg: dict) -> HY15DiTConfig:
    """A diffusers `HunyuanVideo15Transformer3DModel` config.json dict -> `HY15DiTConfig`; unknown keys are errors.
    (diffusers' in_channels is the patch embedding's, 2 * latent channels + 1 for every public model.)"""
    cfg = {k: v for k, v in cfg.items() if not k.startswith("_")}  # _class_name, _diffusers_version, ...
    unknown = sorted(set(cfg) - set(_DIFFUSERS_KNOWN) - set(_DIFFUSERS_IGNORED))
    if unknown:
        raise ValueError(f"HunyuanVideo15Transformer3DModel config: unknown keys {unknown}; "
                         f"known: {list(_DIFFUSERS_KNOWN)}")
    if cfg.get("qk_norm", "rms_norm") != "rms_norm":
        raise ValueError(f"HunyuanVideo15Transformer3DModel config: qk_norm={cfg['qk_norm']!r}; "
                         "only 'rms_norm' is supported")
    c_in, c_out = cfg.get("in_channels", 65), cfg.get("out_channels", 32)
    concat = c_in == 2 * c_out + 1
    heads, head_dim = cfg.get("num_attention_heads", 16), cfg.get("attention_head_dim", 128)
    p, pt = cfg.get("patch_size", 1), cfg.get("patch_size_t", 1)
    return HY15DiTConfig(
        patch_size=(pt, p, p), in_channels=c_out if concat else c_in, concat_condition=concat, out_channels=c_out,
        hidden_size=heads * head_dim, heads_num=heads, mlp_width_ratio=float(cfg.get("mlp_ratio", 4.0)),
        mm_double_blocks_depth=cfg.get("num_layers", 54), rope_dim_list=tuple(cfg.get("rope_axes_dim", (16, 56, 56))),
        rope_theta=float(cfg.get("rope_theta", 256.0)), text_states_dim=cfg.get("text_embed_dim", 3584),
        refiner_depth=cfg.get("num_refiner_layers", 2), byt5_states_dim=cfg.get("text_embed_2_dim", 1472),
        byt5_hidden_dim=_DIFFUSERS_BYT5_HIDDEN, vision_states_dim=cfg.get("image_embed_dim", 1152),
        use_meanflow=bool(cfg.get("use_meanflow", False)))


def hy15_config_to_diffusers(config: HY15DiTConfig) -> dict:
    """`HY15DiTConfig` -> `HunyuanVideo15Transformer3DModel(**kwargs)`; a ValueError for what diffusers cannot build."""
    pt, ph, pw = config.patch_size
    problems = [what for bad, what in (
        (ph != pw, f"patch_size={config.patch_size} (diffusers: one spatial patch size)"),
        (not config.glyph_byT5_v2 or config.vision_projection != "linear" or not config.use_cond_type_embedding,
         "a model without the ByT5 / SigLIP branches or cond_type_embedding (diffusers always has them)"),
        (config.byt5_hidden_dim != _DIFFUSERS_BYT5_HIDDEN,
         f"byt5_hidden_dim={config.byt5_hidden_dim} (diffusers: 2048)"),
        (not config.qkv_bias, "qkv_bias=False"),
    ) if bad]
    if problems:
        raise ValueError(f"no diffusers HunyuanVideo15Transformer3DModel for this config: {'; '.join(problems)}")
    return dict(in_channels=config.patch_in_channels, out_channels=config.out_channels,
                num_attention_heads=config.heads_num, attention_head_dim=config.head_dim,
                num_layers=config.mm_double_blocks_depth, num_refiner_layers=config.refiner_depth,
                mlp_ratio=config.mlp_width_ratio, patch_size=ph, patch_size_t=pt, qk_norm="rms_norm",
                text_embed_dim=config.text_states_dim, text_embed_2_dim=config.byt5_states_dim,
                image_embed_dim=config.vision_states_dim, rope_theta=config.rope_theta,
                rope_axes_dim=tuple(config.rope_dim_list), use_meanflow=config.use_meanflow)


# ---------------------------------------------------------------- LoRA files

# A LoRA on the split q / k / v Linears of a double block (our native modules) as the fused `<stream>_attn_qkv`
# Linear of Tencent's original and ComfyUI's repackaged checkpoints, the names ComfyUI maps for its
# HunyuanVideo models (comfy/lora.py `model_lora_keys_unet`: `diffusion_model.double_blocks.N.img_attn_qkv`,
# "diffusion-pipe lora format"). W_qkv = [W_q; W_k; W_v], so the fused update [B_q A_q; B_k A_k; B_v A_v] is
# exactly blockdiag(B_q, B_k, B_v) @ [A_q; A_k; A_v]: rank 3r, and alpha 3a keeps the scale a / r.
_LORA_SPLIT = re.compile(r"(?P<stream>double_blocks\.\d+\.(?:img|txt))_attn_(?P<part>[qkv])\.(?P<kind>lora_[AB])\.weight")
_LORA_FUSED = re.compile(r"(?P<stream>double_blocks\.\d+\.(?:img|txt))_attn_qkv\.(?P<kind>lora_[AB])\.weight")
# (the token refiner's `self_attn_qkv` is one Linear in our DiT too: its adapter and alpha stay as they are)
_LORA_FUSED_ALPHA = re.compile(r"double_blocks\.\d+\.(?:img|txt)_attn_qkv\.alpha")


def hy15_lora_to_comfy(native: dict[str, torch.Tensor], alpha: float) -> dict[str, torch.Tensor]:
    """Native adapter keys (`<module>.lora_A.weight` / `.lora_B.weight`, one rank r, alpha a) -> ComfyUI's
    HunyuanVideo keys with one `.alpha` per module: q / k / v fused into `<stream>_attn_qkv` (A (3r, D),
    B (3D, 3r) block-diagonal, alpha 3a), every other module as it is."""
    out, fused = {}, {}
    for key, value in native.items():
        m = _LORA_SPLIT.fullmatch(key)
        if m:
            fused.setdefault(m["stream"], {})[(m["part"], m["kind"])] = value
            continue
        module = key.rsplit(".", 2)[0]
        out[f"diffusion_model.{key}"] = value
        out[f"diffusion_model.{module}.alpha"] = torch.tensor(float(alpha))
    for stream, parts in fused.items():
        if len(parts) != 6:
            raise ValueError(f"{stream}: a LoRA on {sorted(p for p, _ in parts)} of q / k / v; the fused qkv "
                             "needs adapters on all three")
        a = torch.cat([parts[(p, "lora_A")] for p in "qkv"])  # (3r, D)
        b = torch.block_diag(*(parts[(p, "lora_B")] for p in "qkv"))  # (3 D_out, 3r)
        out[f"diffusion_model.{stream}_attn_qkv.lora_A.weight"] = a
        out[f"diffusion_model.{stream}_attn_qkv.lora_B.weight"] = b
        out[f"diffusion_model.{stream}_attn_qkv.alpha"] = torch.tensor(3.0 * float(alpha))
    return out


def hy15_lora_split(sd: dict[str, torch.Tensor], source: str) -> dict[str, torch.Tensor]:
    """The inverse of `hy15_lora_to_comfy` on prefix-stripped keys: each fused `<stream>_attn_qkv` adapter
    back to q / k / v ones of rank r (its alpha / 3). Only a block-diagonal B splits exactly at rank r; a
    fused LoRA trained elsewhere (B mixing q, k and v) is a ValueError naming `source` and the module."""
    out = {k: v for k, v in sd.items() if not (_LORA_FUSED.fullmatch(k) or _LORA_FUSED_ALPHA.fullmatch(k))}
    for key, a in sd.items():
        m = _LORA_FUSED.fullmatch(key)
        if not m or m["kind"] != "lora_A":
            continue
        stream = m["stream"]
        b = sd[f"{stream}_attn_qkv.lora_B.weight"]
        r, d_out = a.shape[0] // 3, b.shape[0] // 3
        blocks = [b[i * d_out:(i + 1) * d_out, j * r:(j + 1) * r] for i in range(3) for j in range(3)]
        if a.shape[0] % 3 or b.shape[0] % 3 or any(blocks[i * 3 + j].abs().max() > 0
                                                   for i in range(3) for j in range(3) if i != j):
            raise ValueError(f"{source}: {stream}_attn_qkv: a fused q/k/v LoRA whose B mixes q, k and v (not this "
                             "trainer's block-diagonal export); only a block-diagonal one maps onto the split "
                             "q / k / v Linears at its rank")
        for i, part in enumerate("qkv"):
            out[f"{stream}_attn_{part}.lora_A.weight"] = a[i * r:(i + 1) * r]
            out[f"{stream}_attn_{part}.lora_B.weight"] = blocks[i * 3 + i]
        alpha = sd.get(f"{stream}_attn_qkv.alpha")
        if alpha is not None:
            for part in "qkv":
                out[f"{stream}_attn_{part}.alpha"] = alpha / 3.0
    return out
