"""HunyuanVideo15DiT: parity with diffusers' HunyuanVideo15Transformer3DModel in every key layout, the
conversions, config inference, seeded init, gradient checkpointing, bf16, LoRA and the sequence-parallel seam; the
converted layouts opened without a tensor read and read one native tensor's sources at a time."""

import copy
import threading

import helpers
import pytest
import torch
import torch.nn.functional as F

from video_dit.families.hunyuan15.config import HY15_DIT_CONFIGS, HY15DiTConfig
from video_dit.families.hunyuan15.convert import (
    hy15_config_from_diffusers,
    hy15_config_to_diffusers,
    hy15_from_comfy,
    hy15_from_diffusers,
    hy15_key_layout,
    hy15_to_comfy,
    hy15_to_diffusers,
    hy15_to_native,
    infer_hy15_config,
)
from video_dit.families.hunyuan15.dit import LORA_TARGETS, HunyuanVideo15DiT, cast_hy15_dit, hy15_dit_flops
from video_dit.families.hunyuan15.loading import open_hy15_dit
from video_dit.models import weights as weights_io
from video_dit.models.attention import attention

diffusers = pytest.importorskip("diffusers")

TINY = HY15_DIT_CONFIGS["tiny_i2v"]
# max abs difference / max abs output: measured 2.0e-7 .. 3.0e-7 (every case and layout; 2-core x86 CPU, torch
# 2.13, diffusers 0.42.1), tolerance 3e-6 (10x); one entry of a norm weight left at 1 fails it (checked below)
PARITY_RTOL = 3e-6


def reference(cfg: HY15DiTConfig, seed: int = 0):
    """A diffusers HunyuanVideo15Transformer3DModel of `cfg` with every weight random: Linear / conv / table
    weights N(0, 1/fan_in), biases N(0, 0.1), norm scales 1 + N(0, 0.2) (the zero-initialised adaLN and
    output layers and unit norms would hide their weights)."""
    torch.manual_seed(seed)
    ref = diffusers.HunyuanVideo15Transformer3DModel(**hy15_config_to_diffusers(cfg)).eval()
    return helpers.randomize_all(ref, seed=seed, norm_std=0.2, vector_std=0.1)


def ours_from(sd: dict, cfg: HY15DiTConfig) -> HunyuanVideo15DiT:
    with torch.device("meta"):
        model = HunyuanVideo15DiT(cfg)
    model.load_state_dict(hy15_to_native(sd), assign=True)
    return model.eval()


def inputs(cfg: HY15DiTConfig, mode: str, seed: int = 1, frames: int = 2, h: int = 4, w: int = 6):
    """x (2, 2*C+1, frames, h, w), timesteps, and the text / glyph / image inputs with partial masks
    (sample 1 has no glyph tokens at all). i2v: first-frame condition latents and mask, SigLIP tokens."""
    g = torch.Generator().manual_seed(seed)
    C = cfg.in_channels
    x = torch.zeros(2, 2 * C + 1, frames, h, w)
    x[:, :C] = torch.randn(2, C, frames, h, w, generator=g)
    if mode == "i2v":
        x[:, C:2 * C, 0] = torch.randn(2, C, h, w, generator=g)
        x[:, 2 * C, 0] = 1.0
    kw = dict(context=torch.randn(2, 6, cfg.text_states_dim, generator=g),
              context_mask=torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]]),
              glyph=torch.randn(2, 5, cfg.byt5_states_dim, generator=g),
              glyph_mask=torch.tensor([[1, 1, 1, 0, 0], [0, 0, 0, 0, 0]]),
              image_embeds=torch.randn(2, 7, cfg.vision_states_dim, generator=g) if mode == "i2v" else None)
    if cfg.use_meanflow:
        kw["timestep_r"] = torch.tensor([750.0, 0.0])
    return x, torch.tensor([992.0, 256.0]), kw


def run_reference(ref, x, t, kw, dtype=None):
    """diffusers' call, as its pipelines make it: t2v passes all-zero SigLIP tokens (729 in the pipelines)."""
    cast = (lambda a: a.to(dtype)) if dtype is not None else (lambda a: a)
    image = kw["image_embeds"]
    if image is None:
        image = torch.zeros(x.shape[0], 7, ref.config.image_embed_dim)
    with torch.no_grad():
        return ref(cast(x), cast(t), cast(kw["context"]), kw["context_mask"], timestep_r=kw.get("timestep_r"),
                   encoder_hidden_states_2=cast(kw["glyph"]), encoder_attention_mask_2=kw["glyph_mask"],
                   image_embeds=cast(image), return_dict=False)[0]


def rel_err(got, expected) -> float:
    return ((got.double() - expected.double()).abs().max() / expected.double().abs().max()).item()


# ComfyUI's HunyuanVideo `process_unet_state_dict` renames, in its order: the names inside ComfyUI.
COMFY_RENAMES = (("txt_in.t_embedder.mlp.0.", "txt_in.t_embedder.in_layer."),
                 ("txt_in.t_embedder.mlp.2.", "txt_in.t_embedder.out_layer."),
                 ("txt_in.c_embedder.linear_1.", "txt_in.c_embedder.in_layer."),
                 ("txt_in.c_embedder.linear_2.", "txt_in.c_embedder.out_layer."),
                 ("_mod.linear.", "_mod.lin."), ("_attn_qkv.", "_attn.qkv."), ("mlp.fc1.", "mlp.0."),
                 ("mlp.fc2.", "mlp.2."), ("_attn_q_norm.weight", "_attn.norm.query_norm.scale"),
                 ("_attn_k_norm.weight", "_attn.norm.key_norm.scale"), ("_attn_proj.", "_attn.proj."),
                 ("_in.mlp.2.", "_in.out_layer."), ("_in.mlp.0.", "_in.in_layer."))


def comfy_inside(sd: dict) -> dict:
    """Native keys -> a checkpoint as ComfyUI saves it: repackaged layout, renamed, `model.diffusion_model.`."""
    out = {}
    for k, v in hy15_to_comfy(sd).items():
        for a, b in COMFY_RENAMES:
            k = k.replace(a, b)
        out["model.diffusion_model." + k] = v
    return out


PARITY_CASES = {
    "t2v": (TINY, "t2v"),
    "i2v": (TINY, "i2v"),
    "i2v_step_distilled": (HY15_DIT_CONFIGS["tiny_i2v_step_distilled"], "i2v"),
    "t2v_patch_1x2x2": (HY15DiTConfig(**{**TINY.__dict__, "patch_size": (1, 2, 2)}), "t2v"),
}


@pytest.mark.parametrize("case", list(PARITY_CASES))
def test_parity_with_diffusers_in_every_layout(case):
    cfg, mode = PARITY_CASES[case]
    ref = reference(cfg)
    x, t, kw = inputs(cfg, mode)
    expected = run_reference(ref, x, t, kw)
    assert expected.shape == (2, cfg.out_channels, 2, 4, 6)
    diffusers_sd = ref.state_dict()
    tencent_sd = hy15_from_diffusers(diffusers_sd)
    layouts = {"diffusers": diffusers_sd, "tencent": tencent_sd,
               "comfy_repackaged": hy15_to_comfy(tencent_sd, prefix="diffusion_model."),
               "comfy_inside": comfy_inside(tencent_sd)}
    errors = {}
    for layout, sd in layouts.items():
        assert hy15_key_layout(sd) == {"tencent": "native"}.get(layout, layout.split("_")[0])
        model = ours_from(sd, cfg)
        with torch.no_grad():
            got = model(x, t, **kw)
        assert got.shape == expected.shape
        errors[layout] = rel_err(got, expected)
    print(f"\nparity {case}: " + ", ".join(f"{k} {v:.1e}" for k, v in errors.items()))
    assert max(errors.values()) <= PARITY_RTOL, errors
    # every input matters: another image / glyph / text changes the output
    model = ours_from(tencent_sd, cfg)
    with torch.no_grad():
        base = model(x, t, **kw)
        held = model.double_blocks[1].img_attn_q_norm.weight[0].item()
        model.double_blocks[1].img_attn_q_norm.weight[0] = 1.0  # the comparison can fail: a norm entry left at 1
        assert rel_err(model(x, t, **kw), expected) > PARITY_RTOL
        model.double_blocks[1].img_attn_q_norm.weight[0] = held
        for key in ("context", "glyph") + (("image_embeds",) if mode == "i2v" else ()):
            assert rel_err(model(x, t, **{**kw, key: kw[key].flip(0)}), base) > 1e-3, key


def test_padding_is_ignored_and_t2v_equals_masked_image_tokens():
    ref = reference(TINY)
    model = ours_from(ref.state_dict(), TINY)
    x, t, kw = inputs(TINY, "i2v")
    with torch.no_grad():
        base = model(x, t, **kw)
        # padded text / glyph tokens may hold anything
        noisy = {**kw, "context": kw["context"].clone(), "glyph": kw["glyph"].clone()}
        noisy["context"][0, 4:] = 1e3
        noisy["glyph"][1] = -7.0
        assert rel_err(model(x, t, **noisy), base) < 1e-5
        # image tokens masked out == no image tokens (the t2v path)
        t2v = model(x, t, **{**kw, "image_embeds": None})
        masked = model(x, t, **{**kw, "image_mask": torch.zeros(2, 7, dtype=torch.bool)})
        assert rel_err(masked, t2v) < 1e-5 and rel_err(t2v, base) > 1e-3
        # no glyph == an all-False glyph mask
        no_glyph = model(x, t, **{**kw, "glyph": None, "glyph_mask": None})
        all_false = model(x, t, **{**kw, "glyph_mask": torch.zeros(2, 5)})
        assert rel_err(no_glyph, all_false) < 1e-5
    with pytest.raises(ValueError, match="timestep_r"):
        model(x, t, **kw, timestep_r=torch.zeros(2))
    with pytest.raises(ValueError, match=r"expected \(B, 9, F', h, w\)"):
        model(x[:, :4], t, **kw)


def test_conversions_round_trip_exactly_and_match_the_public_mapping():
    cfg = HY15_DIT_CONFIGS["tiny_i2v_step_distilled"]
    diffusers_sd = reference(cfg).state_dict()
    native = hy15_from_diffusers(diffusers_sd)
    assert set(native) == set(HunyuanVideo15DiT(cfg).state_dict())
    back = hy15_to_diffusers(native)
    assert list(back) == list(diffusers_sd) or set(back) == set(diffusers_sd)
    assert all(torch.equal(back[k], diffusers_sd[k]) for k in diffusers_sd)
    again = hy15_from_diffusers(back)
    assert set(again) == set(native) and all(torch.equal(again[k], native[k]) for k in native)
    # spot checks against diffusers' scripts/convert_hunyuan_video1_5_to_diffusers.py
    d = diffusers_sd
    assert native["double_blocks.1.txt_attn_q_norm.weight"] is d["transformer_blocks.1.attn.norm_added_q.weight"]
    assert native["double_blocks.0.txt_attn_proj.bias"] is d["transformer_blocks.0.attn.to_add_out.bias"]
    assert native["time_r_in.mlp.2.weight"] is d["time_embed.timestep_embedder_r.linear_2.weight"]
    assert native["vision_in.proj.4.weight"] is d["image_embedder.norm_out.weight"]
    qkv = native["txt_in.individual_token_refiner.blocks.1.self_attn_qkv.weight"]
    assert torch.equal(qkv, torch.cat([d[f"context_embedder.token_refiner.refiner_blocks.1.attn.{n}.weight"]
                                       for n in ("to_q", "to_k", "to_v")]))
    shift_scale = native["final_layer.adaLN_modulation.1.weight"]  # Tencent [shift | scale], diffusers [scale | shift]
    assert torch.equal(shift_scale, torch.cat(d["norm_out.linear.weight"].chunk(2)[::-1]))
    # ComfyUI: fused double-block q/k/v, prefixes, inside names; all back to the same tensors
    comfy = hy15_to_comfy(native, prefix="model.diffusion_model.")
    assert "model.diffusion_model.double_blocks.0.img_attn_qkv.weight" in comfy
    assert not any("img_attn_q." in k for k in comfy)
    inside = comfy_inside(native)
    assert {"model.diffusion_model.time_r_in.in_layer.weight", "model.diffusion_model.double_blocks.1.img_mod.lin.bias",
            "model.diffusion_model.double_blocks.0.txt_attn.norm.key_norm.scale",
            "model.diffusion_model.txt_in.individual_token_refiner.blocks.0.self_attn.qkv.weight"} <= set(inside)
    for sd in (comfy, inside):
        restored = hy15_from_comfy(sd)
        assert set(restored) == set(native) and all(torch.equal(restored[k], native[k]) for k in native)


def test_unknown_layouts_and_keys_are_named():
    native = HunyuanVideo15DiT(TINY).state_dict()
    with pytest.raises(ValueError, match="first: blocks.0.self_attn.q.weight"):
        hy15_to_native({"blocks.0.self_attn.q.weight": torch.zeros(1), "patch_embedding.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match=r"1 unexpected keys, first: double_blocks.0.img_attn_x.weight"):
        hy15_to_native({**native, "double_blocks.0.img_attn_x.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match="transformer_blocks.0.attn.to_qkv.weight"):
        hy15_to_native({**hy15_to_diffusers(native), "transformer_blocks.0.attn.to_qkv.weight": torch.zeros(1)})
    assert hy15_to_native(native).keys() == native.keys()


def test_converted_layouts_are_read_one_native_tensor_at_a_time(tmp_path, monkeypatch):
    """diffusers' and ComfyUI's files are opened (names converted and checked, config inferred) without a tensor
    read, and a native tensor read is its own sources only: the refiner's fused self_attn_qkv its to_q / to_k /
    to_v, the final adaLN its swapped norm_out.linear, a double block's q / k / v one read of their fused qkv (each
    its own copy, not a view holding the fused tensor); converted to the model's tensors, which the stored ones
    are not (a read without the conversion would be other weights)."""
    from safetensors.torch import save_file

    model = helpers.randomize_zeros(HunyuanVideo15DiT(TINY, init_seed=0))  # the final adaLN's halves differ
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(hy15_to_diffusers(sd), str(tmp_path / "diffusers.safetensors"))
    save_file(hy15_to_comfy(sd, "model.diffusion_model."), str(tmp_path / "comfy.safetensors"))
    reads = []
    real = weights_io._read_safetensors
    monkeypatch.setattr(weights_io, "_read_safetensors",
                        lambda path, keys: reads.append(sorted(keys.values())) or real(path, keys))
    refiner = "txt_in.individual_token_refiner.blocks.1.self_attn_qkv.weight"
    final = "final_layer.adaLN_modulation.1.weight"
    qkv = [f"double_blocks.1.img_attn_{x}.weight" for x in "qkv"]
    for kind, names, expected_reads in (
            ("diffusers", [refiner, final], [[f"context_embedder.token_refiner.refiner_blocks.1.attn.to_{x}.weight"
                                              for x in "kqv"], ["norm_out.linear.weight"]]),
            ("comfy", qkv, [["model.diffusion_model.double_blocks.1.img_attn_qkv.weight"]])):
        reads.clear()
        weights, config, description = open_hy15_dit(tmp_path / f"{kind}.safetensors")
        assert reads == [] and set(weights.keys()) == set(sd) and config == TINY, description
        got = weights.read(names)
        assert reads == expected_reads, (kind, reads)
        for name in names:
            assert torch.equal(got[name], sd[name]), (kind, name)
            assert got[name].untyped_storage().nbytes() == got[name].nbytes, (kind, name)  # not a view of its source
    stored = real(tmp_path / "diffusers.safetensors", {final: "norm_out.linear.weight"})[final]
    assert not torch.equal(stored, sd[final])  # halves swapped as stored: the conversion was needed


def test_config_inference_and_config_files():
    for name in ("tiny_t2v", "tiny_i2v_step_distilled"):
        cfg = HY15_DIT_CONFIGS[name]
        ref = reference(cfg)
        for sd in (ref.state_dict(), hy15_from_diffusers(ref.state_dict()),
                   hy15_to_comfy(hy15_from_diffusers(ref.state_dict()), "diffusion_model.")):
            assert infer_hy15_config({k: v.shape for k, v in sd.items()}) == cfg
        assert hy15_config_from_diffusers(dict(ref.config)) == cfg
    # without the ByT5 / SigLIP branches their widths are not in the weights: the defaults come back
    no_branches = HY15DiTConfig(**{**TINY.__dict__, "glyph_byT5_v2": False, "vision_projection": "none",
                                   "use_cond_type_embedding": False, "concat_condition": False, "qkv_bias": False,
                                   "byt5_states_dim": 1472, "byt5_hidden_dim": 2048, "vision_states_dim": 1152})
    assert infer_hy15_config(HunyuanVideo15DiT(no_branches).state_dict()) == no_branches
    for name in ("480p_t2v", "480p_i2v_step_distilled"):  # the public sizes, from shapes on the meta device
        with torch.device("meta"):
            sd = HunyuanVideo15DiT(HY15_DIT_CONFIGS[name]).state_dict()
        assert infer_hy15_config(sd) == HY15_DIT_CONFIGS[name]
        assert infer_hy15_config(hy15_to_diffusers(sd)) == HY15_DIT_CONFIGS[name]
    # Tencent's transformer/480p_t2v_distilled/config.json (as published)
    tencent = {"_class_name": "HunyuanVideo_1_5_DiffusionTransformer", "attn_mode": "flash", "attn_param": None,
               "concat_condition": True, "glyph_byT5_v2": True, "guidance_embed": False, "heads_num": 16,
               "hidden_size": 2048, "ideal_resolution": "480p", "ideal_task": "t2v", "in_channels": 32,
               "is_reshape_temporal_channels": False, "mlp_act_type": "gelu_tanh", "mlp_width_ratio": 4,
               "mm_double_blocks_depth": 54, "mm_single_blocks_depth": 0, "out_channels": 32, "patch_size": [1, 1, 1],
               "qk_norm": True, "qk_norm_type": "rms", "qkv_bias": True, "rope_dim_list": [16, 56, 56],
               "rope_theta": 256, "text_pool_type": None, "text_projection": "single_refiner",
               "text_states_dim": 3584, "text_states_dim_2": None, "use_attention_mask": True,
               "use_cond_type_embedding": True, "use_meanflow": False, "vision_projection": "linear",
               "vision_states_dim": 1152}
    assert HY15DiTConfig.from_dict(tencent) == HY15_DIT_CONFIGS["480p_t2v_distilled"]
    with pytest.raises(ValueError, match="did you mean 'hidden_size'"):
        HY15DiTConfig.from_dict({"hidden_sise": 64})
    with pytest.raises(ValueError, match="guidance_embed=True is not supported"):
        HY15DiTConfig.from_dict({**tencent, "guidance_embed": True})
    with pytest.raises(ValueError, match="rope_dim_list"):
        HY15DiTConfig(rope_dim_list=(16, 56, 50))


def test_seeded_init_is_reproducible_device_independent_and_tencents():
    a, b = HunyuanVideo15DiT(TINY, init_seed=3).state_dict(), HunyuanVideo15DiT(TINY, init_seed=3).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    c = HunyuanVideo15DiT(TINY, init_seed=4).state_dict()
    assert not torch.equal(a["double_blocks.0.img_attn_q.weight"], c["double_blocks.0.img_attn_q.weight"])
    assert not torch.equal(a["time_in.mlp.0.weight"], c["time_in.mlp.0.weight"])
    with torch.device("meta"):
        meta = HunyuanVideo15DiT(TINY, init_seed=3)
    assert meta.device.type == "meta"
    meta.to_empty(device="cpu")
    meta.initialize_weights(3)
    m = meta.state_dict()
    assert all(torch.equal(a[k], m[k]) for k in a)
    # Tencent's zero inits: adaLN / output / condition-type tables, the condition channels of img_in
    for k in ("double_blocks.1.txt_mod.linear.weight", "final_layer.linear.weight", "cond_type_embedding.weight",
              "txt_in.individual_token_refiner.blocks.0.adaLN_modulation.1.weight"):
        assert not a[k].any(), k
    w = a["img_in.proj.weight"]
    assert w[:, :TINY.in_channels].abs().min() >= 0 and w[:, :TINY.in_channels].std() > 0
    assert not w[:, TINY.in_channels:].any()
    assert a["time_in.mlp.0.weight"].std().item() == pytest.approx(0.02, rel=0.1)


def test_gradient_checkpointing_same_gradients():
    cfg = HY15_DIT_CONFIGS["tiny_i2v"]
    model = ours_from(reference(cfg).state_dict(), cfg).train()
    x, t, kw = inputs(cfg, "i2v")
    grads = []
    for on in (False, True):
        model.enable_gradient_checkpointing() if on else model.disable_gradient_checkpointing()
        model.zero_grad(set_to_none=True)
        model(x, t, **kw).square().mean().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0]["double_blocks.0.txt_attn_q.weight"].abs().sum() > 0
    assert grads[0]["txt_in.individual_token_refiner.blocks.0.self_attn_qkv.weight"].abs().sum() > 0
    # the last block's text update is never read (as in Tencent's and diffusers' models): no gradient
    last = cfg.mm_double_blocks_depth - 1
    unused = {n for n, _ in model.named_parameters()} - set(grads[0])
    assert unused == {f"double_blocks.{last}.{m}.{p}" for m in ("txt_attn_proj", "txt_mlp.fc1", "txt_mlp.fc2")
                      for p in ("weight", "bias")}
    assert grads[1].keys() == grads[0].keys()
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], rtol=1e-5, atol=1e-7, msg=n)
    model.set_attention_backend("native")
    assert model.double_blocks[1].attention_backend == "native"
    with pytest.raises(ValueError, match="accepted"):
        model.set_attention_backend("xformers")


def test_bf16_error_no_larger_than_diffusers_bf16():
    cfg = HY15_DIT_CONFIGS["tiny_i2v"]
    ref = reference(cfg)
    model = ours_from(ref.state_dict(), cfg)
    x, t, kw = inputs(cfg, "i2v")
    with torch.no_grad():
        truth = copy.deepcopy(model).double()(x.double(), t.double(),
                                              **{k: v.double() if v is not None and v.is_floating_point() else v
                                                 for k, v in kw.items()})
        low = copy.deepcopy(model).to(torch.bfloat16)  # cast_hy15_dit: the float32 islands stay float32
        assert low.double_blocks[0].img_attn_q.weight.dtype == torch.bfloat16
        assert low.final_layer.linear.weight.dtype == torch.float32 and low.time_in.mlp[0].weight.dtype == torch.float32
        ours = low(x, t, **kw)
        theirs = run_reference(copy.deepcopy(ref).to(torch.bfloat16), x, t, kw, dtype=torch.bfloat16)
    err_ours, err_theirs = rel_err(ours, truth), rel_err(theirs, truth)
    print(f"\nbf16 vs float64: ours {err_ours:.2e}, diffusers {err_theirs:.2e}")
    assert 0 < err_ours <= err_theirs
    assert cast_hy15_dit(copy.deepcopy(model), torch.float32).compute_dtype is None


def test_lora_on_targets_changes_the_output_after_a_step():
    from video_dit.lora import add_lora

    cfg = HY15_DIT_CONFIGS["tiny_t2v"]
    model = ours_from(reference(cfg).state_dict(), cfg)
    x, t, kw = inputs(cfg, "t2v")
    with torch.no_grad():
        before = model(x, t, **kw)
    add_lora(model, rank=4, targets=LORA_TARGETS)
    adapted = sorted({n.rsplit(".lora_A", 1)[0] for n, _ in model.named_parameters() if ".lora_A." in n})
    assert len(adapted) == cfg.mm_double_blocks_depth * 2 * 6  # (q, k, v, proj, fc1, fc2) x (img, txt)
    assert "double_blocks.1.txt_mlp.fc2" in adapted and not any("_mod" in n for n in adapted)
    with torch.no_grad():
        assert torch.equal(model(x, t, **kw), before)  # lora_B starts at zero
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=0.1)
    model(x, t, **kw).square().mean().backward()
    opt.step()
    with torch.no_grad():
        assert rel_err(model(x, t, **kw), before) > 1e-4


class ThreadSeqParallel:
    """Two ranks as two threads: split takes this rank's half of the video tokens; joint_attention
    all-gathers the video k/v and attends over [all video | replicated text]; gather concatenates."""

    def __init__(self, rank, shared):
        self.rank, self.shared, self.seen = rank, shared, []

    def split(self, t, dim):
        return t.chunk(2, dim=dim)[self.rank]

    def _all_gather(self, t, dim):
        s = self.shared
        s["slots"][self.rank] = t
        s["barrier"].wait()
        out = torch.cat(s["slots"], dim=dim)
        s["barrier"].wait()
        return out

    def joint_attention(self, q, k, v, txt_q, txt_k, txt_v, txt_key_mask):
        self.seen.append((q.shape[1], txt_q.shape[1]))
        k, v = self._all_gather(k, 1), self._all_gather(v, 1)
        mask = None if txt_key_mask is None else F.pad(txt_key_mask, (k.shape[1], 0), value=True)
        out = attention(torch.cat([q, txt_q], 1), torch.cat([k, txt_k], 1), torch.cat([v, txt_v], 1), attn_mask=mask)
        return out[:, :q.shape[1]], out[:, q.shape[1]:]

    def gather(self, t, dim):
        return self._all_gather(t, dim)


def test_sequence_parallel_seam_keeps_the_text_replicated():
    cfg = HY15_DIT_CONFIGS["tiny_i2v"]
    sd = reference(cfg).state_dict()
    models = [ours_from(sd, cfg), ours_from(sd, cfg)]  # one replica per "rank"
    x, t, kw = inputs(cfg, "i2v")  # 2 x 4 x 6 = 48 video tokens
    with torch.no_grad():
        expected = models[0](x, t, **kw)
    shared = {"slots": [None, None], "barrier": threading.Barrier(2)}
    results, errors = [None, None], []

    def rank(r):
        try:
            models[r].seq_parallel = ThreadSeqParallel(r, shared)
            with torch.no_grad():
                results[r] = models[r](x, t, **kw)
        except Exception as exc:  # surfaced below, with the rank
            errors.append((r, exc))
            shared["barrier"].abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
    assert not errors, errors
    for r in range(2):
        assert models[r].seq_parallel.seen == [(24, 7 + 5 + 6)] * cfg.mm_double_blocks_depth  # half the video, all text
        assert rel_err(results[r], expected) < 1e-5


def test_flops():
    cfg = HY15_DIT_CONFIGS["tiny_t2v"]
    assert hy15_dit_flops(cfg, 2048, 16) > 2 * hy15_dit_flops(cfg, 1024, 16)  # attention is quadratic
    assert hy15_dit_flops(cfg, 1024, 16, batch=3) == 3 * hy15_dit_flops(cfg, 1024, 16)
    assert hy15_dit_flops(cfg, 1024, 16, glyph_len=8, image_len=729) > hy15_dit_flops(cfg, 1024, 16)
    D, L, M = 64, 1024, 256
    lower = cfg.mm_double_blocks_depth * (2 * L * D * 4 * D + 2 * L * D * M * 2 + 4 * L * L * D)  # video Linears + attn
    assert lower < hy15_dit_flops(cfg, L, 16) < 1.3 * lower
    public = hy15_dit_flops(HY15_DIT_CONFIGS["480p_t2v"], 30 * 40 * 21, 256)
    assert 4e14 < public < 1e16  # ~8.3B parameters over ~25k tokens, attention-heavy
