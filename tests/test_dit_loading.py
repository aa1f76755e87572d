"""load_dit from every layout, each written by the test into a temp folder; config inference and
mismatch errors."""

import json

import helpers
import pytest
import torch
from safetensors.torch import save_file

from video_dit.families import get_preset
from video_dit.families.wan.config import DiTConfig
from video_dit.families.wan.convert import dit_from_diffusers, dit_to_diffusers
from video_dit.families.wan.loading import infer_dit_config, load_dit
from video_dit.models.weights import WeightsError

diffusers = pytest.importorskip("diffusers")


def run(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    c = model.config
    x = torch.randn(1, c.in_dim, 2, 4, 4, generator=g)
    context = torch.randn(1, 7, c.text_dim, generator=g)
    with torch.no_grad():
        return model(x.to(model.dtype), torch.tensor([500.0]), context.to(model.dtype)).float()


@pytest.fixture(scope="module")
def tiny():
    return helpers.randomize_head(load_dit("preset:tiny"))  # a zero head: the output would ignore the blocks


def native_sd(model):
    return {k: v.contiguous() for k, v in model.state_dict().items()}


def test_preset_is_seeded_random_init(tiny):
    a, b, c = load_dit("preset:tiny"), load_dit("preset:tiny"), load_dit("preset:tiny", seed=1)
    assert a.config == get_preset("tiny").dit
    assert all(torch.equal(a.state_dict()[k], b.state_dict()[k]) for k in a.state_dict())
    assert not torch.equal(a.blocks[0].self_attn.q.weight, c.blocks[0].self_attn.q.weight)
    assert load_dit("preset:tiny", dtype=torch.bfloat16).dtype == torch.bfloat16


@pytest.mark.parametrize("layout", ["native", "diffusers", "comfyui"])
def test_single_safetensors_file_layout_detected_and_config_inferred(tmp_path, tiny, layout):
    sd = native_sd(tiny)
    if layout == "diffusers":
        sd = dit_to_diffusers(sd)
    elif layout == "comfyui":
        sd = {"model.diffusion_model." + k: v for k, v in sd.items()}
    save_file(sd, tmp_path / "dit.safetensors")
    loaded = load_dit(tmp_path / "dit.safetensors")
    assert loaded.config == tiny.config  # widths from shapes, heads / text_len from the matching preset
    torch.testing.assert_close(run(loaded), run(tiny), rtol=0, atol=1e-6)


def test_diffusers_folder_with_sharded_transformer(tmp_path):
    torch.manual_seed(0)
    ref = diffusers.WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4,
        text_dim=24, freq_dim=16, ffn_dim=64, num_layers=2).eval()
    with torch.no_grad():  # the norms' weights off 1, so an unloaded one shows
        for name, p in ref.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
    ref.save_pretrained(tmp_path / "transformer", max_shard_size="20KB", safe_serialization=True)
    assert len(list((tmp_path / "transformer").glob("*.safetensors"))) > 1
    assert list((tmp_path / "transformer").glob("*.index.json"))
    model = load_dit(tmp_path)
    assert (model.config.num_heads, model.config.dim, model.config.in_dim) == (2, 32, 4)
    g = torch.Generator().manual_seed(0)
    x, context, t = torch.randn(1, 4, 2, 4, 4, generator=g), torch.randn(1, 7, 24, generator=g), torch.tensor([500.0])
    with torch.no_grad():
        expected = ref(x, t, context, return_dict=False)[0]
        # measured max |diff| 8.9e-7 at outputs ~1.5, tolerance 1e-5 (11x); the entry below moves it 5.6e-3
        assert (model(x, t, context) - expected).abs().max() <= 1e-5
        model.blocks[1].self_attn.norm_q.weight[0] = 1.0  # the comparison can fail: a norm entry left at 1
        assert (model(x, t, context) - expected).abs().max() > 1e-5


def test_original_wan_folder_with_config_json(tmp_path, tiny):
    sd = native_sd(tiny)
    keys = sorted(sd)
    shards = {"diffusion_pytorch_model-00001-of-00002.safetensors": keys[: len(keys) // 2],
              "diffusion_pytorch_model-00002-of-00002.safetensors": keys[len(keys) // 2:]}
    weight_map = {}
    for name, names in shards.items():
        save_file({k: sd[k] for k in names}, tmp_path / name)
        weight_map.update({k: name for k in names})
    (tmp_path / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    c = tiny.config
    wan_config = {"_class_name": "WanModel", "_diffusers_version": "0.30.0", "model_type": "t2v",
                  "patch_size": list(c.patch_size), "dim": c.dim, "eps": c.eps, "ffn_dim": c.ffn_dim,
                  "freq_dim": c.freq_dim, "in_dim": c.in_dim, "num_heads": c.num_heads, "num_layers": c.num_layers,
                  "out_dim": c.out_dim, "text_len": c.text_len, "text_dim": c.text_dim}
    (tmp_path / "config.json").write_text(json.dumps(wan_config))
    loaded = load_dit(tmp_path, dtype=torch.float32)
    assert loaded.config == c
    torch.testing.assert_close(run(loaded), run(tiny), rtol=0, atol=1e-6)
    (tmp_path / "config.json").write_text(json.dumps({**wan_config, "num_head": 4}))
    with pytest.raises(WeightsError, match="did you mean 'num_heads'"):
        load_dit(tmp_path)


def test_infer_config_without_a_matching_preset():
    cfg = DiTConfig(dim=256, ffn_dim=512, freq_dim=32, text_dim=48, num_heads=2, num_layers=3, in_dim=36)
    with torch.device("meta"):
        from video_dit.families.wan.dit import VideoDiT

        sd = VideoDiT(cfg).state_dict()
    inferred = infer_dit_config(sd)
    assert inferred == DiTConfig(**{**cfg.__dict__, "text_len": 512})  # Wan convention: head dim 128


def test_mismatch_lists_missing_unexpected_and_wrong_shape_keys(tmp_path, tiny):
    sd = native_sd(tiny)
    sd.pop("blocks.1.self_attn.o.weight")
    sd["blocks.0.self_attn.k_img.weight"] = torch.zeros(3)
    sd["blocks.2.ffn.0.weight"] = torch.zeros(7, 128)
    save_file(sd, tmp_path / "bad.safetensors")
    with pytest.raises(WeightsError) as err:
        load_dit(tmp_path / "bad.safetensors", config=tiny.config)
    msg = str(err.value)
    assert "bad.safetensors" in msg
    assert "1 missing: blocks.1.self_attn.o.weight" in msg
    assert "1 unexpected: blocks.0.self_attn.k_img.weight" in msg
    assert "blocks.2.ffn.0.weight: file (7, 128) vs model (384, 128)" in msg
    save_file({"encoder.weight": torch.zeros(2)}, tmp_path / "other.safetensors")
    with pytest.raises(WeightsError, match="not a Wan DiT"):
        load_dit(tmp_path / "other.safetensors")


def test_mixed_dtype_file_needs_an_explicit_dtype(tmp_path, tiny):
    """dtype=None keeps a file's one stored dtype; a file of two dtypes is refused, naming the file and
    both dtypes, and loads once a dtype is given."""
    sd = native_sd(tiny)
    sd["head.head.weight"] = sd["head.head.weight"].to(torch.bfloat16)
    save_file(sd, tmp_path / "mixed.safetensors")
    with pytest.raises(WeightsError, match=r"mixed.safetensors \(native layout\): tensors of several dtypes "
                                           r"\['torch.bfloat16', 'torch.float32'\]; pass dtype="):
        load_dit(tmp_path / "mixed.safetensors", config=tiny.config)
    assert load_dit(tmp_path / "mixed.safetensors", config=tiny.config, dtype=torch.float32).dtype == torch.float32
    save_file({k: v.to(torch.bfloat16) for k, v in sd.items()}, tmp_path / "bf16.safetensors")
    assert load_dit(tmp_path / "bf16.safetensors", config=tiny.config).dtype == torch.bfloat16


def wan21_image_reference(image: str):
    """A small random diffusers Wan 2.1 I2V / FLF2V transformer at Wan's CLIP sizes (1280 wide, 257 tokens
    per image), head dim 128 so that a single file's config can be inferred (Wan's convention)."""
    return helpers.diffusers_wan(36, 16, head_dim=128, image=image, image_dim=1280, image_tokens=257)


def save_in_layout(ref, layout: str, path) -> None:
    """A diffusers transformer's weights as one safetensors file in `layout`: "diffusers" as they are,
    "native" (Wan's names) or "comfyui" (Wan's names under `model.diffusion_model.`)."""
    sd = {k: v.contiguous() for k, v in ref.state_dict().items()}
    if layout != "diffusers":
        sd = dit_from_diffusers(sd)
    if layout == "comfyui":
        sd = {"model.diffusion_model." + k: v for k, v in sd.items()}
    save_file(sd, path)


# Measured: 5.8e-7 (I2V) / 7.1e-7 (FLF2V) relative; tolerance 1e-5 (14x). One entry of the image keys' norm
# weight left at 1 moves it 2e-3 or more (checked in `test_wan21_image_models_in_every_layout`).
IMAGE_PARITY_RTOL = 1e-5


def image_parity(model, ref, images: int):
    """Max |ours - diffusers| relative to the output scale, on Wan's 512-token text context."""
    g = torch.Generator().manual_seed(1)
    x, context = torch.randn(2, 36, 2, 4, 4, generator=g), torch.randn(2, 512, 24, generator=g)
    clip = torch.randn(2, 257 * images, 1280, generator=g)
    t = torch.tensor([900.0, 100.0])
    with torch.no_grad():
        expected = ref(x, t, context, encoder_hidden_states_image=clip.reshape(-1, 257, 1280), return_dict=False)[0]
        got = model(x, t, context, clip_fea=clip)
    return ((got - expected).abs().max() / expected.abs().max()).item()


@pytest.mark.parametrize("image", ["i2v", "flf2v"])
@pytest.mark.parametrize("layout", ["native", "diffusers", "comfyui"])
def test_wan21_image_models_in_every_layout(tmp_path, image, layout):
    """Wan 2.1 I2V / FLF2V weights as one safetensors file in each key layout: the image branch is found
    from the keys (img_emb, emb_pos), and the model equals diffusers' WanTransformer3DModel."""
    ref = wan21_image_reference(image)
    save_in_layout(ref, layout, tmp_path / "dit.safetensors")
    model = load_dit(tmp_path / "dit.safetensors")
    c = model.config
    assert (c.image_dim, c.image_tokens, c.num_images, c.in_dim) == (1280, 257, 2 if image == "flf2v" else 1, 36)
    assert image_parity(model, ref, c.num_images) <= IMAGE_PARITY_RTOL
    with torch.no_grad():  # the comparison can fail: one entry of a norm weight left at 1
        model.blocks[1].cross_attn.norm_k_img.weight[0] = 1.0
    assert image_parity(model, ref, c.num_images) > IMAGE_PARITY_RTOL


def test_image_branch_from_diffusers_and_original_configs(tmp_path):
    """A diffusers folder's config says image_dim / pos_embed_seq_len; an original Wan config.json says
    model_type "i2v" both for Wan 2.1 I2V (img_emb) and Wan 2.2 I2V A14B (none): the keys decide."""
    ref = wan21_image_reference("flf2v")
    ref.save_pretrained(tmp_path / "diffusers" / "transformer", safe_serialization=True)
    model = load_dit(tmp_path / "diffusers")
    assert (model.config.image_dim, model.config.num_images) == (1280, 2)
    assert image_parity(model, ref, 2) <= IMAGE_PARITY_RTOL

    native = dit_from_diffusers(dict(wan21_image_reference("i2v").state_dict()))
    wan_config = {"_class_name": "WanModel", "model_type": "i2v", "patch_size": [1, 2, 2], "dim": 256,
                  "ffn_dim": 64, "freq_dim": 16, "in_dim": 36, "num_heads": 2, "num_layers": 2, "out_dim": 16,
                  "text_len": 512, "text_dim": 24, "eps": 1e-6}
    for name, sd in (("wan21", native), ("wan22", {k: v for k, v in native.items()
                                                   if "img" not in k})):
        (tmp_path / name).mkdir()
        save_file({k: v.contiguous() for k, v in sd.items()}, tmp_path / name / "diffusion_pytorch_model.safetensors")
        (tmp_path / name / "config.json").write_text(json.dumps(wan_config))
    assert load_dit(tmp_path / "wan21").config.image_dim == 1280
    wan22 = load_dit(tmp_path / "wan22")
    assert wan22.config.image_dim is None and wan22.img_emb is None
    assert not any("img" in k for k in wan22.state_dict())
    bad = json.loads((tmp_path / "diffusers" / "transformer" / "config.json").read_text())
    (tmp_path / "diffusers" / "transformer" / "config.json").write_text(json.dumps({**bad, "added_kv_proj_dim": None}))
    with pytest.raises(WeightsError, match="added_kv_proj_dim"):
        load_dit(tmp_path / "diffusers")


def test_infer_config_of_the_tiny_clip_presets():
    """The tiny presets share their widths; the image keys pick the right one (its 17 image tokens)."""
    for name in ("tiny-clip-i2v", "tiny-clip-flf2v", "tiny"):
        sd = load_dit(f"preset:{name}").state_dict()
        assert infer_dit_config(sd) == get_preset(name).dit, name
