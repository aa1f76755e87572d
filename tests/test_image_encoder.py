"""The CLIP image encoder (Wan 2.1 I2V / FLF2V): features equal to transformers' own CLIPVisionModel
`hidden_states[-2]`, from a preset, a diffusers folder, ComfyUI's single file and Wan's original
open-clip `.pth` (written by the test through its own inverse key mapping), and Wan's preprocessing."""

import copy
import math
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from safetensors.torch import save_file

from video_dit.families.wan.image_encoder import CLIP_MEAN, CLIP_STD, build_clip_vision
from video_dit.families.wan.loading import load_image_encoder
from video_dit.families.wan.presets import TINY_CLIP
from video_dit.models.weights import WeightsError

transformers = pytest.importorskip("transformers")


def reference_model(seed=0):
    """transformers' CLIPVisionModel of the tiny preset's shape, every weight non-trivial."""
    model = build_clip_vision(TINY_CLIP, seed=seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def reference_features(model, images, mean=CLIP_MEAN, std=CLIP_STD):
    """Wan's `CLIPModel.visual` preprocessing written out here, then transformers' penultimate hidden state."""
    size = TINY_CLIP.image_size
    x = F.interpolate(images, size=(size, size), mode="bicubic", align_corners=False) * 0.5 + 0.5
    x = (x - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(std).view(1, 3, 1, 1)
    with torch.no_grad():
        return model(pixel_values=x, output_hidden_states=True).hidden_states[-2]


def flat(model) -> dict[str, torch.Tensor]:
    return {k: v.contiguous() for k, v in model.state_dict().items() if not k.endswith("position_ids")}


def to_wan_open_clip(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers keys -> Wan's XLMRobertaCLIP checkpoint (wan/modules/clip.py: `visual.` ViT with
    fused to_qkv, cls/pos embeddings with batch dims, a projection `head`), plus text-tower keys."""
    out = {"visual.patch_embedding.weight": sd["embeddings.patch_embedding.weight"],
           "visual.cls_embedding": sd["embeddings.class_embedding"].view(1, 1, -1),
           "visual.pos_embedding": sd["embeddings.position_embedding.weight"][None],
           "visual.head": torch.randn(TINY_CLIP.hidden_size, 16),
           "textual.token_embedding.weight": torch.randn(10, 8), "log_scale": torch.tensor(2.6)}
    for ours, theirs in (("pre_norm", "pre_layrnorm"), ("post_norm", "post_layernorm")):
        for kind in ("weight", "bias"):
            out[f"visual.{ours}.{kind}"] = sd[f"{theirs}.{kind}"]
    for i in range(TINY_CLIP.num_layers):
        hf, wan = f"encoder.layers.{i}.", f"visual.transformer.{i}."
        for kind in ("weight", "bias"):
            out[f"{wan}attn.to_qkv.{kind}"] = torch.cat([sd[f"{hf}self_attn.{p}_proj.{kind}"] for p in "qkv"])
            for a, b in (("attn.proj", "self_attn.out_proj"), ("norm1", "layer_norm1"), ("norm2", "layer_norm2"),
                         ("mlp.0", "mlp.fc1"), ("mlp.2", "mlp.fc2")):
                out[f"{wan}{a}.{kind}"] = sd[f"{hf}{b}.{kind}"]
    return out


@pytest.fixture(scope="module")
def images():
    g = torch.Generator().manual_seed(0)
    return torch.rand(3, 3, 40, 56, generator=g) * 2 - 1  # not the CLIP size: resized as Wan does


def test_preset_features_equal_transformers_penultimate_hidden_state(images):
    enc = load_image_encoder("preset:tiny-clip-i2v")
    ref = build_clip_vision(TINY_CLIP, seed=0)  # the same seeded init, full depth
    got = enc.encode(images)
    assert got.shape == (3, TINY_CLIP.tokens, TINY_CLIP.hidden_size) == (3, 17, 32) and got.dtype == torch.float32
    torch.testing.assert_close(got, reference_features(ref, images), rtol=0, atol=1e-5)
    assert len(enc.model.encoder.layers) == TINY_CLIP.num_layers - 1  # the last block never runs
    assert not any(p.requires_grad for p in enc.parameters())
    with pytest.raises(WeightsError, match="never random-initialised"):
        load_image_encoder("preset:wan2.1-i2v-14b-480p")
    with pytest.raises(WeightsError, match="no CLIP image encoder"):
        load_image_encoder("preset:tiny")


def test_an_unresized_image_matches_transformers_own_processor():
    """At the CLIP size Wan's resize is the identity, so transformers' CLIPImageProcessor (no resize, no
    crop) computes the same pixel values from the 8-bit image: an independent check of the normalisation."""
    from transformers import CLIPImageProcessor

    from video_dit.media import pil_to_tensor

    g = torch.Generator().manual_seed(1)
    image = Image.fromarray(torch.randint(0, 256, (32, 32, 3), generator=g, dtype=torch.uint8).numpy())
    ref = reference_model()
    pixels = CLIPImageProcessor(do_resize=False, do_center_crop=False)(images=image, return_tensors="pt")
    with torch.no_grad():
        expected = ref(**pixels, output_hidden_states=True).hidden_states[-2]
    from video_dit.families.wan.image_encoder import ImageEncoder

    # measured max |diff| 4.8e-7 at values up to 3.2, tolerance 5e-6 (10x); the normalisation's mean off by
    # 0.1% of one channel fails it
    off = ImageEncoder(copy.deepcopy(ref), mean=(CLIP_MEAN[0] * 1.001, *CLIP_MEAN[1:]))
    got = ImageEncoder(ref).encode(pil_to_tensor(image)[None])  # (drops ref's last block, after use)
    torch.testing.assert_close(got, expected, rtol=0, atol=5e-6)
    assert (off.encode(pil_to_tensor(image)[None]) - expected).abs().max() > 5e-6


@pytest.mark.parametrize("layout", ["diffusers", "comfyui", "wan_pth"])
def test_every_file_layout_gives_the_reference_features(tmp_path, images, layout):
    ref = reference_model(seed=3)
    mean, std = CLIP_MEAN, CLIP_STD
    if layout == "diffusers":  # image_encoder/ + image_processor/ (whose mean/std are used)
        from transformers import CLIPImageProcessor, CLIPVisionModelWithProjection

        with_proj = CLIPVisionModelWithProjection(ref.config)
        with_proj.vision_model.load_state_dict(ref.state_dict())
        with_proj.save_pretrained(tmp_path / "image_encoder")
        mean, std = (0.5, 0.4, 0.3), (0.2, 0.3, 0.25)
        CLIPImageProcessor(image_mean=list(mean), image_std=list(std)).save_pretrained(tmp_path / "image_processor")
        source = tmp_path
    elif layout == "comfyui":  # clip_vision_h.safetensors: transformers keys under vision_model. + projection
        sd = {f"vision_model.{k}": v for k, v in flat(ref).items()}
        sd["visual_projection.weight"] = torch.randn(16, TINY_CLIP.hidden_size)
        save_file(sd, tmp_path / "clip_vision_h.safetensors")
        source = tmp_path / "clip_vision_h.safetensors"
    else:  # Wan's models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth
        torch.save(to_wan_open_clip(flat(ref)), tmp_path / "models_clip.pth")
        source = tmp_path / "models_clip.pth"
    enc = load_image_encoder(source)
    torch.testing.assert_close(enc.encode(images), reference_features(ref, images, mean, std), rtol=0, atol=1e-5)


def test_a_folder_without_image_encoder_config_is_named(tmp_path):
    """A model folder with no image_encoder/config.json: loading and the shape check before any rank
    both name the folder and what it should hold."""
    from video_dit.families.wan.loading import image_encoder_shape

    (tmp_path / "model" / "image_encoder").mkdir(parents=True)
    with pytest.raises(WeightsError, match=r"model: expected a folder holding image_encoder/config.json \(and "
                                           r"its safetensors\) and image_processor/; download"):
        load_image_encoder(tmp_path / "model")
    with pytest.raises(WeightsError, match=r"model: expected a folder holding image_encoder/config.json; download"):
        image_encoder_shape(tmp_path / "model")


def test_bad_files_name_the_file_and_what_is_accepted(tmp_path):
    sd = flat(reference_model())
    save_file({f"visual.transformer.resblocks.{k}": v for k, v in sd.items()}, tmp_path / "open_clip.safetensors")
    with pytest.raises(WeightsError, match=r"open_clip.safetensors.*resblocks.*accepted"):
        load_image_encoder(tmp_path / "open_clip.safetensors")
    wide = {k: v for k, v in sd.items()}
    wide["encoder.layers.0.mlp.fc1.weight"] = torch.zeros(80, 32)
    save_file(wide, tmp_path / "odd.safetensors")
    with pytest.raises(WeightsError, match=r"odd.safetensors.*matches no preset"):
        load_image_encoder(tmp_path / "odd.safetensors")
    sd.pop("encoder.layers.1.mlp.fc2.bias")
    save_file(sd, tmp_path / "cut.safetensors")
    with pytest.raises(WeightsError, match=r"(?s)cut.safetensors.*1 missing: encoder.layers.1.mlp.fc2.bias"):
        load_image_encoder(tmp_path / "cut.safetensors")
    with pytest.raises(WeightsError, match="no such file"):
        load_image_encoder(tmp_path / "absent.pth")


def test_qfloat8_image_encoder_is_close_not_equal(images):
    pytest.importorskip("optimum.quanto")
    full = load_image_encoder("preset:tiny-clip-i2v").encode(images)
    q = load_image_encoder("preset:tiny-clip-i2v", quantize="qfloat8")
    assert type(q.model.encoder.layers[0].mlp.fc1).__name__ == "QLinear"
    rel = ((q.encode(images) - full).norm() / full.norm()).item()
    assert 0 < rel < 0.1


WAN21 = Path(os.environ.get("WAN21_PATH", "/work/ref/Wan2.1"))


@pytest.mark.skipif(not (WAN21 / "wan/modules/clip.py").is_file(), reason="set WAN21_PATH to a Wan2.1 checkout")
def test_equal_to_wans_own_vision_transformer(tmp_path, images):
    """Wan's VisionTransformer classes (wan/modules/clip.py, flash attention swapped for SDPA) on random
    weights, saved as Wan saves them, read by load_image_encoder: the same features as `use_31_block`."""
    src = (WAN21 / "wan/modules/clip.py").read_text()
    code = src[src.index("def pos_interpolate"):src.index("class XLMRobertaWithHead")]

    def flash_attention(q, k, v, dropout_p=0.0, causal=False, version=None):
        return F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=causal).transpose(1, 2)

    ns = dict(torch=torch, nn=torch.nn, F=F, math=math, flash_attention=flash_attention)
    exec(compile(code, str(WAN21 / "wan/modules/clip.py"), "exec"), ns)
    torch.manual_seed(0)
    c = TINY_CLIP
    wan = ns["VisionTransformer"](image_size=c.image_size, patch_size=c.patch_size, dim=c.hidden_size,
                                  mlp_ratio=c.intermediate_size / c.hidden_size, out_dim=16, num_heads=c.num_heads,
                                  num_layers=c.num_layers, activation="gelu").eval()
    with torch.no_grad():
        for p in wan.parameters():
            p.add_(0.1 * torch.randn_like(p))
    torch.save({"visual." + k: v for k, v in wan.state_dict().items()}, tmp_path / "wan_clip.pth")
    mean, std = torch.tensor(CLIP_MEAN).view(1, 3, 1, 1), torch.tensor(CLIP_STD).view(1, 3, 1, 1)
    pixels = (F.interpolate(images, size=(c.image_size,) * 2, mode="bicubic", align_corners=False) * 0.5 + 0.5
              - mean) / std
    with torch.no_grad():
        expected = wan(pixels, use_31_block=True)
    torch.testing.assert_close(load_image_encoder(tmp_path / "wan_clip.pth").encode(images), expected,
                               rtol=0, atol=1e-5)
