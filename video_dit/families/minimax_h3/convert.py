"""State-dict conversion for the MiniMax H3 DiT, pure functions over dicts of tensors.

Layouts:
  native     `H3DiT`'s names = MiniMax's original checkpoint names (SGLang `MiniMaxH3DiTModel`: blocks.N.attn.qkv_proj,
             blocks.N.mlp.fc1, blocks.N.adaln_proj.linear, token_refiner.blocks.N..., final_layer.video_out, ...),
             with the fused q / k / v rows stacked [q_all | k_all | v_all] (SGLang's and ComfyUI's in-memory order,
             and the order of Comfy-Org/MiniMax-H3's single files) and fc1's rows [gate | value].
  original   MiniMaxAI/MiniMax-H3's own shards (FL2VA/transformer/, Ref2VA/transformer/, config `_class_name`
             "MiniMaxH3DiTModel"): the native names plus `rope.inv_freq` (computed here, dropped), and each
             qkv_proj's rows interleaved per head [h0: q k v | h1: q k v | ...] (SGLang `_reorder_grouped_qkv_to_qkv`
             reorders at load). Keys and shapes do not tell the two row orders apart: the caller says which
             (`qkv_layout`; `qkv_layout_of_config` reads it from the folder's config.json).
  ComfyUI    native names under `model.diffusion_model.` / `diffusion_model.` (ComfyUI comfy/ldm/minimax/model.py
             keeps the original names, qkv stacked).
  diffusers  `MiniMaxH3Transformer3DModel` (diffusers 0.42.1; its scripts/convert_minimax_h3_to_diffusers.py and
             single_file_utils.py `convert_minimax_h3_transformer_checkpoint_to_diffusers` are the rename map):
             transformer_blocks.N.attn.to_q / to_k / to_v (qkv split), attn.norm_q / norm_k, attn.to_out.0,
             ff.net.0.proj (fc1 with its halves swapped: diffusers' SwiGLU reads [value | gate]), ff.net.2,
             token_refiner.refiner_blocks.N, proj_in / audio_proj_in / context_embedder, time_embedder.linear_1 / 2,
             norm_out.norm / norm_out.linear, proj_out / audio_proj_out.

LoRA files. Every known producer trains against the original module names (diffusers lora_conversion_utils.py
`_convert_non_diffusers_minimax_h3_lora_to_diffusers`): ai-toolkit under `diffusion_model.`, ComfyUI checkpoints
and SGLang bare, musubi-tuner flattened (`lora_unet_blocks_0_attn_qkv_proj`, kohya lora_down / lora_up), and
DiffSynth-Studio bare with peft's `.default.` infix over a per-head-interleaved qkv. ComfyUI (comfy/lora.py
`model_lora_keys_unet`, its `MiniMaxH3` branch) reads `diffusion_model.<module>` (the generic format),
`<module>` and `lora_unet_<flattened module>`, each `lora_A` / `lora_B` (or `lora_down` / `lora_up`) with an
optional `.alpha`; diffusers' `MiniMaxH3LoraLoaderMixin` reads the same names (prefixed or not, `.alpha`
folded) and its own `transformer.<diffusers module>` files. The house writes `diffusion_model.<native module>`
with one `.alpha` per module (`h3_lora_to_comfy`): both read it, qkv adapters included (stacked order).
"""

from __future__ import annotations

import re

import torch

from video_dit.families.minimax_h3.dit_config import H3DiTConfig
from video_dit.lora import to_comfy
from video_dit.models.weights import WeightsError, check_state_dict, strip_dit_prefix

QKV_LAYOUTS = ("stacked", "interleaved")

# (native, diffusers) module renames; `#` is a block index; a key's tail (.weight / .bias) carries over.
_BLOCK_PARTS = (("norm1", "norm1"), ("norm2", "norm2"), ("attn.q_norm", "attn.norm_q"), ("attn.k_norm", "attn.norm_k"),
                ("attn.out_proj", "attn.to_out.0"), ("mlp.fc2", "ff.net.2"))
_PAIRS = (
    ("video_patch_proj", "proj_in"), ("audio_patch_proj", "audio_proj_in"), ("condition_proj", "context_embedder"),
    ("time_embedder.proj_in", "time_embedder.linear_1"), ("time_embedder.proj_out", "time_embedder.linear_2"),
    ("token_refiner.final_norm", "token_refiner.final_norm"),
    *((f"token_refiner.blocks.#.{a}", f"token_refiner.refiner_blocks.#.{b}") for a, b in _BLOCK_PARTS),
    *((f"blocks.#.{a}", f"transformer_blocks.#.{b}") for a, b in _BLOCK_PARTS),
    ("blocks.#.adaln_proj.linear", "transformer_blocks.#.adaln_proj.linear"),
    ("final_layer.norm", "norm_out.norm"), ("final_layer.adaln_proj.linear", "norm_out.linear"),
    ("final_layer.video_out", "proj_out"), ("final_layer.audio_out", "audio_proj_out"),
)
_TO_DIFFUSERS = dict(_PAIRS)
_FROM_DIFFUSERS = {d: n for n, d in _PAIRS}
_FUSED = {"attn.qkv_proj": ("attn.to_q", "attn.to_k", "attn.to_v"), "mlp.fc1": ("ff.net.0.proj",)}
_INDEXED = re.compile(r"(token_refiner\.blocks|token_refiner\.refiner_blocks|blocks|transformer_blocks)\.(\d+)\.")

_BLOCK_KEYS = r"(norm[12]\.weight|attn\.(qkv_proj|out_proj|q_norm|k_norm)\.weight|mlp\.fc[12]\.weight"
# Every native parameter name an H3DiT has.
_NATIVE_KEY = re.compile(
    r"(video_patch_proj|audio_patch_proj|condition_proj|time_embedder\.proj_(in|out)|final_layer\.(video_out|audio_out)"
    r"|final_layer\.adaln_proj\.linear|blocks\.\d+\.adaln_proj\.linear)\.(weight|bias)"
    r"|final_layer\.norm\.weight|token_refiner\.final_norm\.weight"
    r"|(token_refiner\.)?blocks\.\d+\." + _BLOCK_KEYS + ")")
ROPE_BUFFER = "rope.inv_freq"  # the original checkpoint's computed buffer (H3DiT.rope_inv_freq), not a parameter


def _generic(key: str) -> tuple[str, str | None]:
    """key -> (key with its block index replaced by `#`, the index)."""
    m = _INDEXED.match(key)
    return (f"{m.group(1)}.#.{key[m.end():]}", m.group(2)) if m else (key, None)


def _unexpected(keys, what: str) -> ValueError:
    keys = sorted(keys)
    return ValueError(f"not a {what} state dict: {len(keys)} unexpected keys, first: {', '.join(keys[:5])}")


def _swap_halves(t: torch.Tensor) -> torch.Tensor:
    """[a | b] -> [b | a] along dim 0: fc1's [gate | value] (native) <-> [value | gate] (diffusers' SwiGLU)."""
    a, b = t.chunk(2, dim=0)
    return torch.cat([b, a], dim=0)


def h3_to_diffusers(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Native keys -> diffusers `MiniMaxH3Transformer3DModel` keys (qkv split in thirds, fc1's halves swapped)."""
    out, unknown = {}, []
    for key, value in sd.items():
        generic, index = _generic(key)
        module, _, tail = generic.rpartition(".")
        stem, _, part = module.partition(".#.")
        if part in _FUSED and stem in ("blocks", "token_refiner.blocks"):
            target = _TO_DIFFUSERS[f"{stem}.#.norm1"].rsplit(".", 1)[0].replace("#", index)  # the diffusers block
            if part == "mlp.fc1":
                out[f"{target}.ff.net.0.proj.{tail}"] = _swap_halves(value)
            else:
                for name, third in zip(_FUSED[part], value.chunk(3, dim=0)):
                    out[f"{target}.{name}.{tail}"] = third
        elif module in _TO_DIFFUSERS:
            out[f"{_TO_DIFFUSERS[module].replace('#', index or '')}.{tail}"] = value
        else:
            unknown.append(key)
    if unknown:
        raise _unexpected(unknown, "native MiniMax H3 DiT")
    return out


def h3_from_diffusers(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Diffusers `MiniMaxH3Transformer3DModel` keys -> native keys (to_q / to_k / to_v stacked into qkv_proj)."""
    out, unknown, qkv = {}, [], {}
    for key, value in sd.items():
        generic, index = _generic(key)
        module, _, tail = generic.rpartition(".")
        stem, _, part = module.partition(".#.")
        native_stem = {"transformer_blocks": "blocks", "token_refiner.refiner_blocks": "token_refiner.blocks"}.get(stem)
        if native_stem and part in ("attn.to_q", "attn.to_k", "attn.to_v"):
            qkv.setdefault((native_stem, index, tail), {})[part] = value
        elif native_stem and part == "ff.net.0.proj":
            out[f"{native_stem}.{index}.mlp.fc1.{tail}"] = _swap_halves(value)
        elif module in _FROM_DIFFUSERS:
            out[f"{_FROM_DIFFUSERS[module].replace('#', index or '')}.{tail}"] = value
        else:
            unknown.append(key)
    for (stem, index, tail), parts in qkv.items():
        if len(parts) != 3:
            raise ValueError(f"diffusers MiniMax H3 state dict: {stem}.{index} has {sorted(parts)} ({tail}); "
                             "expected attn.to_q, attn.to_k and attn.to_v")
        out[f"{stem}.{index}.attn.qkv_proj.{tail}"] = torch.cat([parts[p] for p in _FUSED["attn.qkv_proj"]])
    if unknown:
        raise _unexpected(unknown, "diffusers MiniMax H3 DiT")
    return out


def deinterleave_qkv(weight: torch.Tensor, head_dim: int) -> torch.Tensor:
    """An original shard's qkv_proj rows [h0: q k v | h1: q k v | ...] (head_dim rows each) -> [q_all | k_all | v_all]
    (SGLang `_reorder_grouped_qkv_to_qkv` with one head per group; no transpose)."""
    if weight.shape[0] % (3 * head_dim):
        raise ValueError(f"qkv_proj has {weight.shape[0]} rows, not a multiple of 3 x head_dim={head_dim}")
    heads = weight.shape[0] // (3 * head_dim)
    return weight.reshape(heads, 3, head_dim, *weight.shape[1:]).transpose(0, 1).reshape(weight.shape)


def interleave_qkv(weight: torch.Tensor, head_dim: int) -> torch.Tensor:
    """`deinterleave_qkv`'s inverse: [q_all | k_all | v_all] -> per-head [q k v] rows (MiniMax's shards' order)."""
    heads = weight.shape[0] // (3 * head_dim)
    return weight.reshape(3, heads, head_dim, *weight.shape[1:]).transpose(0, 1).reshape(weight.shape)


def qkv_layout_of_config(config: dict) -> str:
    """The qkv row order of the weights beside a transformer config.json: "interleaved" for MiniMax's own
    shards (`_class_name` "MiniMaxH3DiTModel", the original names), "stacked" for every other file."""
    return "interleaved" if config.get("_class_name") == "MiniMaxH3DiTModel" else "stacked"


def h3_key_layout(sd: dict[str, torch.Tensor]) -> str:
    """"native" or "diffusers" from the key names (prefixes stripped); an error naming the first keys if neither."""
    if any(k.startswith(("transformer_blocks.", "proj_in.", "context_embedder.", "norm_out.", "token_refiner.refiner_"))
           for k in sd):
        return "diffusers"
    if any(k.startswith(("blocks.", "video_patch_proj.", "condition_proj.", "final_layer.", "token_refiner.blocks."))
           for k in sd):
        return "native"
    raise _unexpected(sd, "MiniMax H3 DiT (neither original / ComfyUI nor diffusers names)")


def h3_to_native(sd: dict[str, torch.Tensor], source: str = "state dict", qkv_layout: str = "stacked",
                 ) -> dict[str, torch.Tensor]:
    """Any supported layout (see the module docstring) -> native keys, tensors shared where nothing is reordered.
    `qkv_layout` ("stacked" / "interleaved") says the row order of an original-names file's qkv_proj (diffusers'
    files need none). Keys that are no H3 DiT parameter raise a ValueError naming `source` and the first ones."""
    if qkv_layout not in QKV_LAYOUTS:
        raise ValueError(f"qkv_layout={qkv_layout!r}; accepted: {', '.join(QKV_LAYOUTS)}")
    sd = {k: v for k, v in strip_dit_prefix(sd).items() if k != ROPE_BUFFER}
    try:
        layout = h3_key_layout(sd)
        if layout == "diffusers":
            if qkv_layout != "stacked":
                raise ValueError(f"qkv_layout={qkv_layout!r} given for diffusers' names (their q / k / v are split); "
                                 "it is for an original-names file's fused qkv_proj")
            out = h3_from_diffusers(sd)
        else:
            out = dict(sd)
            if qkv_layout == "interleaved":
                for key in [k for k in out if k.endswith(".attn.qkv_proj.weight")]:
                    head_dim = out[key.replace("qkv_proj", "q_norm")].shape[0]
                    out[key] = deinterleave_qkv(out[key], head_dim)
        unknown = [k for k in out if not _NATIVE_KEY.fullmatch(k)]
        if unknown:
            raise _unexpected(unknown, f"MiniMax H3 DiT ({layout} layout)")
    except (ValueError, KeyError) as exc:
        raise ValueError(f"{source}: {exc}") from exc
    return out


def h3_native_for(model: torch.nn.Module, sd: dict[str, torch.Tensor], source: str,
                  qkv_layout: str = "stacked") -> dict[str, torch.Tensor]:
    """`h3_to_native(sd)` checked against `model`'s parameters: a `WeightsError` names `source` and the first
    missing / unexpected / wrong-shape keys. The result loads with `model.load_state_dict(..., assign=True)`."""
    try:
        native = h3_to_native(sd, source, qkv_layout)
    except ValueError as exc:
        raise WeightsError(str(exc)) from exc
    check_state_dict(model, native, source)
    return native


# ---------------------------------------------------------------- configuration


def h3_config_to_diffusers(config: H3DiTConfig) -> dict:
    """`H3DiTConfig` -> `MiniMaxH3Transformer3DModel(**kwargs)`: the same names, less `audio_channels` (a pipeline
    constant there)."""
    d = {k: v for k, v in config.__dict__.items() if k != "audio_channels"}
    return {**d, "patch_size": list(config.patch_size)}


def infer_h3_config(shapes: dict, **unseen) -> H3DiTConfig:
    """`H3DiTConfig` from a state dict's shapes ({name: tensor or shape}, any layout). What the weights do not
    hold takes the released value unless given in `unseen`: rope_freq_dim (an original file's `rope.inv_freq`
    has its length), rope_theta, the norms' eps, audio_channels, and the patch (1, 2, 2)."""
    if ROPE_BUFFER in shapes:
        unseen.setdefault("rope_freq_dim", tuple(shapes[ROPE_BUFFER].shape if hasattr(shapes[ROPE_BUFFER], "shape")
                                                 else shapes[ROPE_BUFFER])[0])
    patch = tuple(unseen.pop("patch_size", (1, 2, 2)))
    meta = {k: torch.empty(tuple(v.shape) if hasattr(v, "shape") else tuple(v), device="meta")
            for k, v in shapes.items()}
    s = {k: tuple(v.shape) for k, v in h3_to_native(meta, "shapes").items()}

    def need(key):
        if key not in s:
            raise ValueError(f"infer_h3_config: the state dict has no {key!r} (first keys: {', '.join(sorted(s)[:5])})")
        return s[key]

    def count(prefix: str) -> int:
        found = {int(m.group(1)) for k in s if (m := re.match(re.escape(prefix) + r"(\d+)\.", k))}
        return max(found) + 1 if found else 0

    D, patch_dim = need("video_patch_proj.weight")
    head_dim = need("blocks.0.attn.q_norm.weight")[0]
    time_embed_hidden, freq = need("time_embedder.proj_in.weight")
    cells = patch[0] * patch[1] * patch[2]
    in_channels = need("final_layer.video_out.weight")[0] // cells
    if patch_dim != cells * in_channels:
        raise ValueError(f"infer_h3_config: video_patch_proj reads {patch_dim} channels, not {cells} x {in_channels}")
    return H3DiTConfig(
        num_attention_heads=need("blocks.0.attn.qkv_proj.weight")[0] // (3 * head_dim), attention_head_dim=head_dim,
        hidden_size=D, num_layers=count("blocks."), num_refiner_layers=count("token_refiner.blocks."),
        ffn_dim=need("blocks.0.mlp.fc2.weight")[1], in_channels=in_channels,
        audio_in_channels=need("audio_patch_proj.weight")[1], patch_size=patch,
        text_dim=need("condition_proj.weight")[1], freq_dim=freq, time_embed_hidden_dim=time_embed_hidden,
        time_embed_dim=need("time_embedder.proj_out.weight")[0], **unseen)


# ---------------------------------------------------------------- LoRA files

_LORA = re.compile(r"(?P<module>.+)\.(?P<kind>lora_A|lora_B|lora_down|lora_up)(\.default)?\.weight")
# musubi-tuner's flattened module names (the dots of the original names collapsed to `_`) -> the dotted ones
_FLATTENED = ((r"(token_refiner_)?blocks_(\d+)_attn_(qkv|out)_proj",
               lambda m: f"{_tr(m)}blocks.{m[2]}.attn.{m[3]}_proj"),
              (r"(token_refiner_)?blocks_(\d+)_mlp_fc([12])", lambda m: f"{_tr(m)}blocks.{m[2]}.mlp.fc{m[3]}"),
              (r"blocks_(\d+)_adaln_proj_linear", lambda m: f"blocks.{m[1]}.adaln_proj.linear"),
              (r"(video|audio)_patch_proj", lambda m: f"{m[1]}_patch_proj"), (r"condition_proj", lambda m: m[0]),
              (r"time_embedder_proj_(in|out)", lambda m: f"time_embedder.proj_{m[1]}"),
              (r"final_layer_adaln_proj_linear", lambda m: "final_layer.adaln_proj.linear"),
              (r"final_layer_(video|audio)_out", lambda m: f"final_layer.{m[1]}_out"))


def _tr(m) -> str:
    return "token_refiner." if m[1] else ""


def h3_lora_to_comfy(native: dict[str, torch.Tensor], alpha: float) -> dict[str, torch.Tensor]:
    """Native adapter keys (`<module>.lora_A.weight` / `.lora_B.weight`) -> `diffusion_model.<module>.lora_A.weight`,
    ..., `diffusion_model.<module>.alpha`: what ComfyUI and diffusers read (see the module docstring)."""
    _check_lora_modules(native, "LoRA")
    return to_comfy(native, alpha)


def h3_lora_from_file(sd: dict[str, torch.Tensor], source: str = "LoRA") -> dict[str, torch.Tensor]:
    """A LoRA file's keys without their `diffusion_model.` / `transformer.` prefix (`video_dit.lora.from_comfy`
    strips it) -> native adapter keys `<module>.lora_A.weight` / `.lora_B.weight` (+ `<module>.alpha`):
    musubi-tuner's flattened `lora_unet_` names and kohya's lora_down / lora_up are renamed; a DiffSynth-Studio
    file (peft's `.default.` infix) has its qkv B rows reordered from the per-head interleave it trained against.
    Modules an H3 DiT lacks are a ValueError naming `source` and the first of them."""
    diffsynth = any(".default.weight" in k for k in sd)
    out = {}
    for key, value in sd.items():
        module, _, tail = key.partition(".")
        if key.startswith("lora_unet_"):
            flat = module.removeprefix("lora_unet_")
            for pattern, build in _FLATTENED:
                m = re.fullmatch(pattern, flat)
                if m:
                    key = f"{build(m)}.{tail}"
                    break
            else:
                raise ValueError(f"{source}: {key!r} names no MiniMax H3 module in musubi-tuner's lora_unet_ layout")
        if key.endswith(".alpha"):
            out[key] = value
            continue
        m = _LORA.fullmatch(key)
        if m is None:
            raise ValueError(f"{source}: unexpected key {key!r} (expected <module>.lora_A / lora_B / lora_down / "
                             "lora_up .weight or <module>.alpha)")
        kind = {"lora_down": "lora_A", "lora_up": "lora_B"}.get(m["kind"], m["kind"])
        if diffsynth and kind == "lora_B" and m["module"].endswith(".attn.qkv_proj"):
            value = deinterleave_qkv(value, value.shape[0] // 3 // _heads_of(value, source, m["module"]))
        out[f"{m['module']}.{kind}.weight"] = value
    _check_lora_modules(out, source)
    return out


def _heads_of(b: torch.Tensor, source: str, module: str) -> int:
    """Heads of a DiffSynth qkv adapter's B (3 heads x 128 rows: every released H3 head is 128 wide, diffusers'
    converter relies on the same)."""
    if b.shape[0] % (3 * 128):
        raise ValueError(f"{source}: {module} B has {b.shape[0]} rows, not 3 x heads x 128 (per-head interleaved)")
    return b.shape[0] // (3 * 128)


def _check_lora_modules(native: dict[str, torch.Tensor], source: str) -> None:
    bad = sorted({m["module"] for k in native if (m := _LORA.fullmatch(k))
                  and not _NATIVE_KEY.fullmatch(m["module"] + ".weight")})
    if bad:
        raise ValueError(f"{source}: LoRA on {len(bad)} modules a MiniMax H3 DiT does not have, first: "
                         f"{', '.join(bad[:5])}")
