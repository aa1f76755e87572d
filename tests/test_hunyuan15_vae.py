"""HunyuanVideo 1.5 VAE: parity with diffusers' AutoencoderKLHunyuanVideo15 on random weights in each key
layout (diffusers, Tencent's original, ComfyUI's), conversion round trips, configs, chunked == whole clip,
causality, tiling, seeded init, latent normalisation, loading, API contracts."""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from video_dit.families.hunyuan15.convert_vae import (
    COMFYUI_PREFIX,
    hy15_vae_config_from_diffusers,
    hy15_vae_config_from_json,
    hy15_vae_config_from_original,
    hy15_vae_config_from_shapes,
    hy15_vae_config_to_diffusers,
    hy15_vae_from_comfyui,
    hy15_vae_from_diffusers,
    hy15_vae_from_original,
    hy15_vae_key_layout,
    hy15_vae_to_comfyui,
    hy15_vae_to_diffusers,
    hy15_vae_to_native,
    load_hy15_vae,
)
from video_dit.families.hunyuan15.vae import HY15_VAE_CONFIG, HY15_VAE_TINY, HunyuanVideo15VAE, HY15VAEConfig

diffusers = pytest.importorskip("diffusers")

# The released layout at tiny widths, and one whose resamples keep the width (res blocks then change it:
# 1x1 shortcuts, the keys that differ between Tencent's and ComfyUI's layouts).
TINY = HY15_VAE_TINY
UNMATCHED = HY15VAEConfig(latent_channels=4, block_out_channels=(8, 16, 16, 16, 16), layers_per_block=1,
                          downsample_match_channel=False, upsample_match_channel=False)
H, W = 32, 48  # pixels: a 2 x 3 latent grid
# Parity tolerance, relative to the output's scale (`_rel`): measured 6e-7 .. 2.6e-6 (both configs, 1 / 5 / 17
# frames, both chunkings, mean / logvar / decoded; tiled 1.5e-6; the autograd path 2.5e-6; 2-core x86 CPU, torch
# 2.13, diffusers 0.42.1), tolerance
# 3e-5 (12x); one entry of the encoder's / decoder's output norm gamma left at 1 fails it (checked below).
PARITY_RTOL = 3e-5


def _reference(cfg: HY15VAEConfig, seed: int = 0):
    torch.manual_seed(seed)
    ref = diffusers.AutoencoderKLHunyuanVideo15(**hy15_vae_config_to_diffusers(cfg)).eval()
    with torch.no_grad():  # move every parameter off its init (the gammas of one)
        for p in ref.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return ref


def _video(frames: int, h: int = H, w: int = W, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(1, 3, frames, h, w, generator=g) * 2 - 1


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| over max |b|: the error relative to the output's scale."""
    return ((a - b).abs().max() / b.abs().max()).item()


# ---------------------------------------------------------------- the layouts, written here independently


def _tencent_from_diffusers(sd: dict) -> dict:
    """diffusers names -> Tencent's checkpoint names, as diffusers' scripts/convert_hunyuan_video1_5_to_diffusers.py
    maps them (the inverse direction), written out here rather than taken from our converter."""
    out = {}
    for key, value in sd.items():
        k = re.sub(r"(down|up)_blocks\.(\d+)\.resnets\.(\d+)\.", r"\1.\2.block.\3.", key)
        k = re.sub(r"down_blocks\.(\d+)\.downsamplers\.0\.", r"down.\1.downsample.", k)
        k = re.sub(r"up_blocks\.(\d+)\.upsamplers\.0\.", r"up.\1.upsample.", k)
        k = k.replace("mid_block.resnets.0.", "mid.block_1.").replace("mid_block.resnets.1.", "mid.block_2.")
        k = k.replace("mid_block.attentions.0.", "mid.attn_1.")
        k = re.sub(r"attn_1\.to_([qkv])\.", r"attn_1.\1.", k)
        out[k.replace(".conv_shortcut.", ".nin_shortcut.")] = value
    return out


def _comfyui_from_tencent(sd: dict) -> dict:
    """ComfyUI's checkpoint form: Tencent's names under `first_stage_model.`, a res block's 1x1 shortcut a
    VideoConv3d (`nin_shortcut.conv.weight`; comfy/ldm/hunyuan_video/vae_refiner.py)."""
    return {COMFYUI_PREFIX + k.replace(".nin_shortcut.", ".nin_shortcut.conv."): v for k, v in sd.items()}


LAYOUTS = {"diffusers": lambda sd: sd, "original": _tencent_from_diffusers,
           "comfyui": lambda sd: _comfyui_from_tencent(_tencent_from_diffusers(sd))}


@pytest.fixture(scope="module", params=[("tiny", TINY), ("unmatched", UNMATCHED)], ids=lambda p: p[0])
def setup(request):
    """(config, diffusers model, its outputs per clip length: video, mean, logvar, z, decoded)."""
    cfg = request.param[1]
    ref = _reference(cfg)
    outputs = {}
    with torch.no_grad():
        for frames in (1, 5, 17):
            video = _video(frames)
            post = ref.encode(video).latent_dist
            z = post.mean + 0.5 * torch.randn(post.mean.shape, generator=torch.Generator().manual_seed(frames))
            outputs[frames] = (video, post.mean, post.logvar, z, ref.decode(z).sample)
    return cfg, ref, outputs


@pytest.mark.parametrize("layout", list(LAYOUTS))
@torch.no_grad()
def test_parity_with_diffusers_in_each_layout(setup, layout):
    """Weights read from each layout (detected from the names) encode and decode as diffusers does:
    posterior mean / logvar and the decoded clip within PARITY_RTOL of the reference's scale, for 1, 5 and 17
    frames, in the default chunking and in chunks of one latent frame (one frame per call above)."""
    cfg, ref, outputs = setup
    sd, found = hy15_vae_to_native(LAYOUTS[layout](ref.state_dict()))
    assert found == layout
    vae = HunyuanVideo15VAE(cfg).eval()
    vae.load_state_dict(sd)
    for chunk_cells in (vae.chunk_cells, 1):
        vae.chunk_cells = chunk_cells
        for frames, (video, mean, logvar, z, decoded) in outputs.items():
            post = vae.encode(video)
            assert post.mean.shape == (1, cfg.latent_channels, (frames - 1) // 4 + 1, H // 16, W // 16)
            assert _rel(post.mean, mean) <= PARITY_RTOL, (layout, chunk_cells, frames)
            assert _rel(post.logvar, logvar) <= PARITY_RTOL, (layout, chunk_cells, frames)
            out = vae.decode(z, clamp=False)
            assert out.shape == video.shape
            assert _rel(out, decoded) <= PARITY_RTOL, (layout, chunk_cells, frames)
            assert torch.equal(vae.decode(z), out.clamp(-1, 1))  # decode clamps by default
    if layout == "diffusers":  # the comparisons can fail: one entry of an output norm's gamma left at 1
        video, mean, _, z, decoded = outputs[5]
        vae.encoder.norm_out.gamma.view(-1)[0] = 1.0
        vae.decoder.norm_out.gamma.view(-1)[0] = 1.0
        assert _rel(vae.encode(video).mean, mean) > PARITY_RTOL
        assert _rel(vae.decode(z, clamp=False), decoded) > PARITY_RTOL


@pytest.mark.parametrize("threshold,min_positions", [(1, 0), (16, 0), (16, 10 ** 9)],
                         ids=["all-winograd", "mixed-winograd", "mixed-im2col"])
@torch.no_grad()
def test_wide_layers_in_winograd_tap_layout_on_the_cpu(setup, monkeypatch, threshold, min_positions):
    """The convs that keep Winograd's tap layout on the CPU (`WINOGRAD_CHANNELS`, 256 input channels as
    shipped; here every layer, or those of 16+ channels so the formats mix) give diffusers' outputs,
    through Winograd F(4x4, 3x3) (frames whose sides are no multiple of 4 included: 2 x 3 latents) and
    through the tap layout's im2col product (`MIN_POSITIONS`), in both chunkings; the weights' formats
    follow the rule after a load and after a move (`_apply`), and a move to float64 and back keeps them."""
    from video_dit.families.hunyuan15 import vae as hunyuan15_vae
    from video_dit.kernels import winograd

    monkeypatch.setattr(hunyuan15_vae, "WINOGRAD_CHANNELS", threshold)
    monkeypatch.setattr(winograd, "MIN_POSITIONS", min_positions)
    cfg, ref, outputs = setup
    vae = HunyuanVideo15VAE(cfg).eval()
    vae.load_state_dict(hy15_vae_from_diffusers(ref.state_dict()))
    vae = vae.to(torch.float64).to(torch.float32)
    convs = [m.conv.weight for m in vae.modules() if isinstance(m, hunyuan15_vae.HY15CausalConv3d)]
    wide = [w.shape[1] >= threshold for w in convs]
    assert [winograd.in_tap_layout(w) for w in convs] == wide
    assert [w.is_contiguous(memory_format=torch.channels_last_3d) for w in convs] == [not b for b in wide]
    assert any(wide) and (threshold == 1 or not all(wide))
    for chunk_cells in (vae.chunk_cells, 1):
        vae.chunk_cells = chunk_cells
        for frames, (video, mean, logvar, z, decoded) in outputs.items():
            post = vae.encode(video)
            assert _rel(post.mean, mean) <= PARITY_RTOL, (chunk_cells, frames)
            assert _rel(vae.decode(z, clamp=False), decoded) <= PARITY_RTOL, (chunk_cells, frames)


@torch.no_grad()
def test_chunked_equals_whole_clip(setup):
    """Chunks of one latent frame (the cache carrying every conv's past and the attention's keys and
    values), chunks of two, and the default, against the whole clip in one pass (`chunked=False`)."""
    cfg, ref, _ = setup
    vae = HunyuanVideo15VAE(cfg).eval()
    vae.load_state_dict(hy15_vae_from_diffusers(ref.state_dict()))
    video = _video(13, seed=2)
    whole = vae.encode(video, chunked=False)
    z = whole.mean
    whole_out = vae.decode(z, chunked=False, clamp=False)
    for chunk_cells in (1, 12, vae.chunk_cells):  # 6 latent cells per frame: 1, 2, all 4 latent frames
        vae.chunk_cells = chunk_cells
        post = vae.encode(video)
        assert (post.mean - whole.mean).abs().max() <= 1e-5, chunk_cells
        assert (post.logvar - whole.logvar).abs().max() <= 1e-5, chunk_cells
        assert (vae.decode(z, clamp=False) - whole_out).abs().max() <= 1e-5, chunk_cells


@torch.no_grad()
def test_causality():
    """A changed pixel frame k changes no latent frame before the one holding it, and does change that one;
    a changed latent frame j changes no pixel frame before 1 + 4 (j - 1)."""
    vae = HunyuanVideo15VAE(TINY, seed=3).eval()
    vae.chunk_cells = 1
    video = _video(13, seed=3)
    ks = (0, 4, 5, 12)
    batch = video.repeat(1 + len(ks), 1, 1, 1, 1)
    for i, k in enumerate(ks, 1):
        batch[i, :, k] = -batch[i, :, k]
    lat = vae.encode(batch).mean
    for i, k in enumerate(ks, 1):
        first = (k - 1) // 4 + 1 if k else 0
        assert torch.equal(lat[i, :, :first], lat[0, :, :first]), f"frame {k} leaked into earlier latents"
        assert not torch.allclose(lat[i, :, first], lat[0, :, first]), f"frame {k} changed nothing"
    js = (1, 3)
    z = lat[:1].repeat(1 + len(js), 1, 1, 1, 1)
    for i, j in enumerate(js, 1):
        z[i, :, j] += 1.0
    out = vae.decode(z, clamp=False)
    for i, j in enumerate(js, 1):
        start = 1 + 4 * (j - 1)
        assert torch.equal(out[i, :, :start], out[0, :, :start])
        assert not torch.allclose(out[i, :, start], out[0, :, start])


@torch.no_grad()
def test_tiled_parity_with_diffusers():
    """With tiling on (the same tile size and overlap in both), the tiles, their blending and cropping
    are the reference's: encode and decode equal diffusers' tiled_encode / tiled_decode."""
    ref = _reference(TINY, seed=4)
    vae = HunyuanVideo15VAE(TINY).eval()
    vae.load_state_dict(hy15_vae_from_diffusers(ref.state_dict()))
    ref.enable_tiling(tile_sample_min_height=64, tile_sample_min_width=64, tile_latent_min_height=4,
                      tile_latent_min_width=4, tile_overlap_factor=0.25)
    vae.enable_tiling(tile_size=64, overlap_factor=0.25)
    video = _video(5, 144, 176, seed=4)  # a 9 x 11 latent grid: 3 x 4 tiles, partial ones at the edges
    post, post_ref = vae.encode(video), ref.encode(video).latent_dist
    assert _rel(post.mean, post_ref.mean) <= PARITY_RTOL
    z = post_ref.mean
    assert _rel(vae.decode(z, clamp=False), ref.decode(z).sample) <= PARITY_RTOL
    vae.disable_tiling()
    assert _rel(vae.decode(z, clamp=False), ref.decode(z).sample) > 1e-3  # the tiles do differ from one pass
    with pytest.raises(ValueError, match="whole number of latent cells"):
        vae.enable_tiling(tile_size=32, overlap_factor=0.25)


@pytest.mark.parametrize("frames,chunked", [(1, True), (5, True), (5, False)])
def test_autograd_path_parity_with_diffusers(frames, chunked):
    """With autograd on (VAE training: concatenation instead of the reused windows), the same numbers,
    and gradients reach the first and last layers."""
    ref = _reference(TINY, seed=5)
    vae = HunyuanVideo15VAE(TINY)
    vae.load_state_dict(hy15_vae_from_diffusers(ref.state_dict()))
    vae.chunk_cells = 1
    video = _video(frames, seed=5)
    with torch.no_grad():
        post_ref = ref.encode(video).latent_dist
        out_ref = ref.decode(post_ref.mean).sample
    post = vae.encode(video.requires_grad_(), chunked=chunked)
    out = vae.decode(post.mean, chunked=chunked, clamp=False)
    assert _rel(post.mean, post_ref.mean) <= PARITY_RTOL and _rel(out, out_ref) <= PARITY_RTOL
    (out.square().mean() + post.kl().mean()).backward()
    assert vae.encoder.conv_in.conv.weight.grad.abs().sum() > 0
    assert vae.decoder.conv_out.conv.weight.grad.abs().sum() > 0
    assert video.grad.abs().sum() > 0


@torch.no_grad()
def test_bfloat16_error_no_larger_than_the_references():
    """In bfloat16 (the GPU benchmark's dtype) our clip's distance from the float32 reference is at most
    the bfloat16 reference's own (x 1.1): norms in float32, no extra rounding of folded weights."""
    ref32 = _reference(TINY, seed=6)
    video = _video(9, seed=6)
    target = ref32.decode(ref32.encode(video).latent_dist.mode()).sample
    ref = _reference(TINY, seed=6).to(torch.bfloat16)
    vae = HunyuanVideo15VAE(TINY).eval()
    vae.load_state_dict(hy15_vae_from_diffusers(ref32.state_dict()))
    vae = vae.to(torch.bfloat16)
    v = video.to(torch.bfloat16)
    ours = vae.decode(vae.encode(v).mode(), clamp=False).float()
    theirs = ref.decode(ref.encode(v).latent_dist.mode()).sample.float()
    assert ours.dtype == torch.float32 and _rel(ours, target) <= 1.1 * _rel(theirs, target), (
        _rel(ours, target), _rel(theirs, target))


# ---------------------------------------------------------------- conversion


def test_conversion_round_trips_are_exact():
    """diffusers <-> ours and ComfyUI <-> ours give back the same keys and the same tensors; Tencent's
    names are ours."""
    for cfg in (TINY, UNMATCHED):
        ref = _reference(cfg).state_dict()
        ours = hy15_vae_from_diffusers(ref)
        back = hy15_vae_to_diffusers(ours)
        assert set(back) == set(ref) and all(back[k] is ref[k] for k in ref)
        assert hy15_vae_from_original(_tencent_from_diffusers(ref)).keys() == ours.keys()
        assert all(ours[k] is v for k, v in _tencent_from_diffusers(ref).items())
        for prefix in ("", COMFYUI_PREFIX):
            comfy = hy15_vae_to_comfyui(ours, prefix=prefix)
            assert set(hy15_vae_from_comfyui(comfy)) == set(ours)
            assert all(hy15_vae_from_comfyui(comfy)[k] is ours[k] for k in ours)
        assert hy15_vae_to_comfyui(ours, prefix=COMFYUI_PREFIX) == _comfyui_from_tencent(_tencent_from_diffusers(ref))
        assert any(".nin_shortcut.conv." in k for k in hy15_vae_to_comfyui(ours)) == (cfg is UNMATCHED)


def test_released_key_names_and_shapes():
    """At the released size (meta device): our names map onto diffusers' AutoencoderKLHunyuanVideo15 one to
    one with equal shapes, our model reads its own names, and the shapes give back the released config."""
    with torch.device("meta"):
        ours = HunyuanVideo15VAE(HY15_VAE_CONFIG).state_dict()
        ref = diffusers.AutoencoderKLHunyuanVideo15().state_dict()
    converted = hy15_vae_to_diffusers(ours)
    assert set(converted) == set(ref) and all(converted[k].shape == ref[k].shape for k in ref)
    assert set(hy15_vae_from_diffusers(ref)) == set(ours)
    assert set(_tencent_from_diffusers(ref)) == set(ours)
    assert hy15_vae_config_from_shapes(ours) == HY15_VAE_CONFIG
    assert len(ours) == len(ref) == 94 + 124  # encoder, decoder (no shortcut convs at the released widths)


def test_unknown_keys_and_layouts_are_errors():
    ours = HunyuanVideo15VAE(TINY).state_dict()
    bad = {**ours, "encoder.down.0.block.0.conv3.conv.weight": torch.zeros(1)}
    with pytest.raises(ValueError, match=r"1 key\(s\) not in the original \(Tencent\) layout.*conv3"):
        hy15_vae_from_original(bad)
    with pytest.raises(ValueError, match=r"not in the original \(ours\) layout.*conv3"):
        hy15_vae_to_diffusers(bad)
    with pytest.raises(ValueError, match=r"not in the diffusers layout.*post_quant_conv"):
        hy15_vae_from_diffusers({**hy15_vae_to_diffusers(ours), "post_quant_conv.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match=r"not in the original.*first_stage_model\.decoder\.extra"):
        hy15_vae_from_comfyui({**hy15_vae_to_comfyui(ours), "first_stage_model.decoder.extra": torch.zeros(1)})
    with pytest.raises(ValueError, match="not a HunyuanVideo 1.5 VAE state dict"):
        hy15_vae_key_layout({"encoder.conv1.weight": torch.zeros(1)})  # Wan's VAE
    with pytest.raises(ValueError, match="accepted: original, diffusers, comfyui"):
        hy15_vae_to_native(ours, layout="wan")


def test_key_layout_detection():
    ours = HunyuanVideo15VAE(UNMATCHED).state_dict()
    assert hy15_vae_key_layout(ours) == "original"
    assert hy15_vae_key_layout(hy15_vae_to_diffusers(ours)) == "diffusers"
    assert hy15_vae_key_layout(hy15_vae_to_comfyui(ours)) == "comfyui"  # a nin_shortcut.conv key
    assert hy15_vae_key_layout(hy15_vae_to_comfyui(HunyuanVideo15VAE(TINY).state_dict(), COMFYUI_PREFIX)) == "comfyui"


# ---------------------------------------------------------------- configs


def test_released_config_is_diffusers_default_and_tencents():
    """HY15_VAE_CONFIG is diffusers' default constructor (its numbers are the release's) and reads back
    from Tencent's vae/config.json as published (tencent/HunyuanVideo-1.5)."""
    with torch.device("meta"):
        ref = diffusers.AutoencoderKLHunyuanVideo15()
    assert hy15_vae_config_from_diffusers(dict(ref.config)) == HY15_VAE_CONFIG
    assert HY15_VAE_CONFIG.scaling_factor == ref.config.scaling_factor == 1.03682
    tencent = {"_class_name": "AutoencoderKLConv3D", "block_out_channels": [128, 256, 512, 1024, 1024],
               "downsample_match_channel": True, "ffactor_spatial": 16, "ffactor_temporal": 4, "in_channels": 3,
               "latent_channels": 32, "layers_per_block": 2, "out_channels": 3, "sample_size": 256,
               "sample_tsize": 64, "scaling_factor": 1.03682, "upsample_match_channel": True}
    assert hy15_vae_config_from_original(tencent) == HY15_VAE_CONFIG
    assert hy15_vae_config_from_json(tencent) == hy15_vae_config_from_json(dict(ref.config)) == HY15_VAE_CONFIG
    assert hy15_vae_config_to_diffusers(UNMATCHED)["downsample_match_channel"] is False


def test_config_from_weight_shapes():
    for cfg in (TINY, UNMATCHED, HY15VAEConfig(latent_channels=4, block_out_channels=(8, 8, 16, 32),
                                               temporal_compression_ratio=2, spatial_compression_ratio=8)):
        with torch.device("meta"):
            sd = HunyuanVideo15VAE(cfg).state_dict()
        assert hy15_vae_config_from_shapes(sd) == cfg


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="did you mean 'latent_channels'"):
        HY15VAEConfig.from_dict({"latent_channel": 4})
    with pytest.raises(ValueError, match=r"unknown keys \['z_dim'\]"):
        hy15_vae_config_from_diffusers({"z_dim": 16})
    with pytest.raises(ValueError, match=r"unknown keys \['ffactor'\]"):
        hy15_vae_config_from_original({"ffactor": 16})
    with pytest.raises(ValueError, match="block_out_channels has 4 entries.*at least 5"):
        HY15VAEConfig(block_out_channels=(8, 8, 16, 16))
    with pytest.raises(ValueError, match="multiple of 2 \\* latent_channels = 64"):
        HY15VAEConfig(latent_channels=32, block_out_channels=(8, 8, 16, 16, 16))
    with pytest.raises(ValueError, match="spatial_compression_ratio=12; accepted: a power of two"):
        HY15VAEConfig(spatial_compression_ratio=12)
    with pytest.raises(ValueError, match="downsample from 8 to 12"):
        HY15VAEConfig(latent_channels=2, block_out_channels=(8, 12, 12, 12, 12))
    with pytest.raises(ValueError, match="shift_factor=0.5: diffusers"):
        hy15_vae_config_to_diffusers(HY15VAEConfig(shift_factor=0.5))


# ---------------------------------------------------------------- init, normalisation, API


def test_seeded_init_is_the_same_vae_wherever_built():
    """The seed alone fixes the weights: the global RNG, and building on the meta device then
    materialising, change nothing; another seed differs; gammas start at one."""
    torch.manual_seed(0)
    a = HunyuanVideo15VAE(TINY, seed=7).state_dict()
    torch.manual_seed(123)
    b = HunyuanVideo15VAE(TINY, seed=7).state_dict()
    with torch.device("meta"):
        late = HunyuanVideo15VAE(TINY)
    late.to_empty(device="cpu").initialize_weights(seed=7)
    c = late.state_dict()
    d = HunyuanVideo15VAE(TINY, seed=8).state_dict()
    assert all(torch.equal(a[k], b[k]) and torch.equal(a[k], c[k]) for k in a)
    assert all(not torch.equal(a[k], d[k]) for k in a if not k.endswith("gamma"))
    assert all(torch.equal(v, torch.ones_like(v)) for k, v in a.items() if k.endswith("gamma"))
    bound = a["encoder.conv_in.conv.weight"][0].numel() ** -0.5  # PyTorch's conv init, U(+-1/sqrt(fan_in))
    assert 0.9 * bound < a["encoder.conv_in.conv.weight"].abs().max() <= bound


@torch.no_grad()
def test_latent_normalization_as_the_pipelines():
    """normalize: the pipelines' encode side, `latents * scaling_factor` (diffusers' i2v, Tencent's
    `cond_latents.mul_(scaling_factor)`); denormalize: their decode side, `latents / scaling_factor`
    (+ `shift_factor` in Tencent's when set). The numbers come from the config."""
    z = torch.randn(1, 4, 2, 2, 3, generator=torch.Generator().manual_seed(0))
    ref = _reference(TINY)
    vae = HunyuanVideo15VAE(TINY)
    assert torch.equal(vae.normalize(z), z * ref.config.scaling_factor)
    assert torch.equal(vae.denormalize(z), z / ref.config.scaling_factor)
    shifted = HunyuanVideo15VAE(HY15VAEConfig(**{**TINY.__dict__, "shift_factor": 0.25, "scaling_factor": 2.0}))
    assert torch.allclose(shifted.denormalize(z), z / 2.0 + 0.25)
    assert torch.allclose(shifted.normalize(shifted.denormalize(z)), z, atol=1e-6)


@torch.no_grad()
def test_posterior_sampling_and_api():
    vae = HunyuanVideo15VAE(TINY, seed=0).eval()
    video = _video(5)
    post = vae.encode(video)
    a = post.sample(torch.Generator().manual_seed(7))
    noise = torch.randn(post.mean.shape, generator=torch.Generator().manual_seed(7))
    assert torch.equal(a, post.sample(torch.Generator().manual_seed(7))) and not torch.equal(a, post.mode())
    assert torch.allclose(a, post.mean + post.std * noise)
    assert vae.latent_shape(video.shape) == tuple(post.mean.shape) == (1, 4, 2, 2, 3)
    recon, posterior = vae(video)
    assert recon.shape == video.shape and recon.abs().max() <= 1.0 and torch.equal(posterior.mean, post.mean)
    clone = copy.deepcopy(vae)  # the layer lists (and the decoder's bound output step) follow the copy
    clone.decoder.conv_out.conv.bias.data += 1.0
    assert torch.allclose(clone.decode(post.mode(), clamp=False), vae.decode(post.mode(), clamp=False) + 1.0, atol=1e-5)
    assert vae.device == torch.device("cpu") and vae.dtype == torch.float32
    assert vae.to(torch.float64).dtype == torch.float64
    assert all(v.is_contiguous() for v in vae.state_dict().values())  # channels-last inside, contiguous out
    assert vae.encoder.conv_in.conv.weight.is_contiguous(memory_format=torch.channels_last_3d)
    with pytest.raises(ValueError, match=r"F=6 frames; F must be 4k \+ 1.*5 or 9"):
        vae.encode(torch.zeros(1, 3, 6, 32, 32))
    with pytest.raises(ValueError, match="multiples of 16"):
        vae.encode(torch.zeros(1, 3, 5, 24, 32))
    with pytest.raises(ValueError, match=r"expects latents \(B, 4, F', h, w\)"):
        vae.decode(torch.zeros(1, 5, 2, 2, 2))


def test_load_from_files(tmp_path):
    """`load_hy15_vae`: a diffusers vae/ folder (config.json + safetensors), a ComfyUI checkpoint's VAE
    (prefixed, no config: the architecture from the shapes) and a preset; all equal the source."""
    from safetensors.torch import save_file

    ref = _reference(UNMATCHED, seed=6)
    folder = tmp_path / "pipeline" / "vae"
    folder.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()},
              str(folder / "diffusion_pytorch_model.safetensors"))
    (folder / "config.json").write_text(json.dumps({"_class_name": "AutoencoderKLHunyuanVideo15", **ref.config}))
    ours = HunyuanVideo15VAE(UNMATCHED)
    ours.load_state_dict(hy15_vae_from_diffusers(ref.state_dict()))
    comfy = tmp_path / "hunyuanvideo15_vae_comfy.safetensors"
    save_file(hy15_vae_to_comfyui(ours.state_dict(), COMFYUI_PREFIX), str(comfy))
    expected = ours.state_dict()
    for source in (tmp_path / "pipeline", comfy):
        vae = load_hy15_vae(source)
        assert vae.config == UNMATCHED
        got = vae.state_dict()
        assert set(got) == set(expected) and all(torch.equal(got[k], expected[k]) for k in got)
        assert vae.encoder.down[1].block[0].conv1.conv.weight.is_contiguous(memory_format=torch.channels_last_3d)
    preset = load_hy15_vae("preset:hy15-tiny", seed=3)
    assert all(torch.equal(v, HunyuanVideo15VAE(TINY, seed=3).state_dict()[k]) for k, v in preset.state_dict().items())
    with pytest.raises(ValueError, match="unknown HunyuanVideo 1.5 VAE preset 'hy16'"):
        load_hy15_vae("preset:hy16")


def _peak(frames: int) -> list[int]:
    from video_dit.bench.vae import MALLOC_ENV

    code = (
        "import json, torch\n"
        "from video_dit.bench.vae import peak_rss_delta\n"
        "from video_dit.families.hunyuan15.vae import HunyuanVideo15VAE, HY15VAEConfig\n"
        "torch.set_num_threads(1)\n"
        "vae = HunyuanVideo15VAE(HY15VAEConfig(latent_channels=4, block_out_channels=(16, 16, 32, 32, 32), "
        "layers_per_block=1), seed=0).eval()\n"
        "vae.chunk_cells = 16  # one latent frame (4 x 4 cells) per chunk\n"
        f"video = torch.rand(1, 3, {frames}, 64, 64) * 2 - 1\n"
        "with torch.no_grad():\n"
        "    z = vae.encode(video[:, :, :5]).mode(); vae.decode(z)  # warm-up\n"
        "    z, enc = peak_rss_delta(lambda: vae.encode(video).mode())\n"
        "    _, dec = peak_rss_delta(lambda: vae.decode(z))\n"
        "print(json.dumps([enc, dec]))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, **MALLOC_ENV, "OMP_NUM_THREADS": "1"}, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_peak_memory_is_set_by_the_chunk_not_the_clip():
    """Peak resident memory of encode and of decode (each in a fresh process, after a warm-up, kernel
    high-water mark reset before the call) for 33 frames stays within 1.5x of 9 frames at the same size.
    The 33-frame clip alone is 3.7x the 9-frame one, so a whole-clip pass could not pass."""
    enc9, dec9 = _peak(9)
    enc33, dec33 = _peak(33)
    assert enc33 <= 1.5 * enc9, (enc9, enc33)
    assert dec33 <= 1.5 * dec9, (dec9, dec33)
