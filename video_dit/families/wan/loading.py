"""The Wan family's components in, one loader each: `load_dit`, `load_vae`, `load_text_encoder`,
`load_image_encoder`, from a preset's seeded random init, diffusers folders, original Wan files or
single safetensors files (ComfyUI's among them). HunyuanVideo 1.5's are in its own folder,
`video_dit/families/hunyuan15/`; the registry (`video_dit.families.identify`) says which family
loads what. Kept apart from the network math; the tensor files are read through `weights.py`, the
folder conventions are `layouts.py`'s.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import replace
from pathlib import Path

import torch

from video_dit.families.wan.config import DiTConfig
from video_dit.families.wan.convert import (
    clip_vision_from_transformers,
    clip_vision_from_wan,
    clip_vision_key_layout,
    dit_from_diffusers,
    dit_key_layout,
    vae_config_from_diffusers,
    vae_from_diffusers,
    vae_key_layout,
)
from video_dit.families.wan.dit import VideoDiT, cast_dit, param_dtypes
from video_dit.families.wan.image_encoder import (
    CLIP_MEAN,
    CLIP_STD,
    ImageEncoder,
    ImageEncoderConfig,
    build_clip_vision,
    clip_vision_config,
)
from video_dit.families.wan.presets import VAE_PRESETS, VIT_H_14, get_preset
from video_dit.families.wan.presets import WAN_PRESETS as PRESETS
from video_dit.families.wan.text_encoder import TextEncoder, TextEncoderConfig, build_umt5, byte_tokenizer
from video_dit.families.wan.vae import CausalVideoVAE, VAEConfig
from video_dit.models.common import check_quantize, quantize_encoder, seeded_cpu_rng
from video_dit.models.layouts import component_dir, preset_name
from video_dit.models.weights import (
    WeightsError,
    check_state_dict,
    materialize,
    open_weights,
    read_state_dict,
    strip_dit_prefix,
)

# ---------------------------------------------------------------- DiT

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
    matching = [p.dit for p in PRESETS.values()
                if p.family == "wan" and (p.dit.dim, p.dit.ffn_dim, p.dit.freq_dim, p.dit.text_dim) == widths]
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


def open_dit(source: str | os.PathLike, config=None):
    """(weights, config, description) of a DiT checkpoint without reading a tensor: `weights` is a
    `LazyWeights` under native (original Wan) names, the key layout (original, diffusers, ComfyUI
    prefixes) converted on the names alone; `config` from `config`, else the config.json next to the
    weights, else the weights' shapes; `description` = "PATH (LAYOUT layout)" for messages."""

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


def load_dit(source: str | os.PathLike, dtype: torch.dtype | None = None, device=None, config=None,
                 seed: int = 0):
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

    src = str(source)
    name = preset_name(src)
    if name is not None:  # built on `device`; every parameter is drawn on the CPU (`init_parameter`)
        config = config or get_preset(name).dit
        with torch.random.fork_rng(devices=[]):
            with torch.device(device or "cpu"):
                model = VideoDiT(config, init_seed=seed)
        return cast_dit(model, dtype) if dtype is not None else model

    weights, config, description = open_dit(src, config)
    model = materialize(VideoDiT, config, weights, description, dtype, device, storage=param_dtypes)
    return cast_dit(model, dtype) if dtype is not None else model


# ---------------------------------------------------------------- VAE

def load_vae(source: str | os.PathLike, dtype: torch.dtype | None = None, device=None, config=None,
                 seed: int = 0):
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

    src = str(source)
    name = preset_name(src)
    if name is not None:
        if config is None and name not in VAE_PRESETS:
            raise WeightsError(f"{src}: unknown VAE preset {name!r}; valid: {', '.join(VAE_PRESETS)}")
        with seeded_cpu_rng(seed):  # torch's default init, drawn on the CPU: the same VAE on every device
            model = CausalVideoVAE(config or VAE_PRESETS[name])
        return model.to(device=device, dtype=dtype)

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


# ---------------------------------------------------------------- text encoder

TEXT_ENCODER_DOWNLOAD = (
    "download the umT5 text encoder and its tokenizer (no network is used here), e.g.\n"
    "  huggingface-cli download Wan-AI/Wan2.1-T2V-1.3B-Diffusers --include 'text_encoder/*' 'tokenizer/*' "
    "--local-dir MODELS/wan2.1\n"
    "and pass MODELS/wan2.1 (the folder holding text_encoder/ and tokenizer/)")

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

    check_quantize(quantize)
    text_len = 512
    src = str(source)
    name = preset_name(src)
    if name is not None:
        config = get_preset(name).text_encoder
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
    quantize_encoder(model, quantize)
    return TextEncoder(model, tok, text_len)


def _umt5_from_file(path: Path):
    """A `UMT5EncoderModel` from one HF-named safetensors file, its config inferred from the shapes."""

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


# ---------------------------------------------------------------- CLIP image encoder

IMAGE_ENCODER_DOWNLOAD = (
    "download Wan 2.1's CLIP ViT-H/14 (no network is used here), one of:\n"
    "  the diffusers folders: huggingface-cli download Wan-AI/Wan2.1-I2V-14B-480P-Diffusers --include "
    "'image_encoder/*' 'image_processor/*' --local-dir MODELS/wan2.1-i2v (pass MODELS/wan2.1-i2v)\n"
    "  ComfyUI's clip_vision_h.safetensors (Comfy-Org/Wan_2.1_ComfyUI_repackaged, split_files/clip_vision/)\n"
    "  Wan's models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth (in Wan-AI/Wan2.1-I2V-14B-480P)")


def _clip_config_from_shapes(sd: dict[str, torch.Tensor], source: str):
    """An `ImageEncoderConfig` from flat transformers CLIP vision weights. The head count is not in
    the shapes: it comes from the image-encoder preset of the same widths (ViT-H/14: 16 heads)."""

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

    check_quantize(quantize)
    src = str(source)
    mean, std = CLIP_MEAN, CLIP_STD
    name = preset_name(src)
    if name is not None:
        config = get_preset(name).image_encoder
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
    quantize_encoder(encoder.model, quantize)
    return encoder


def image_encoder_shape(source: str | os.PathLike) -> tuple[int, int]:
    """(feature width, tokens per image) of an image-encoder source, read from its config.json or the
    tensor headers only (no weights are loaded): for checks before any rank starts."""

    src = str(source)
    name = preset_name(src)
    if name is not None:
        config = get_preset(name).image_encoder
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



