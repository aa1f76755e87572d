"""LTX-2 video VAE: parity with diffusers' AutoencoderKLLTX2Video on random weights loaded through the key
conversion (encode and decode at 1, 9 and 17 frames; a timestep-conditioned causal decoder), the layouts
(diffusers, Lightricks' original and combined files) and their round trips, configs (the released numbers,
Lightricks' block lists, errors), tiling (exact for a local decoder; within a derived bound for the
network), the decode peak model against a measured peak, causality, seeded init, latent normalisation.

The training path (autograd, the demo VAE stage's) against diffusers' forward and backward.
Errors are relative: max |ours - reference| / max |reference|. Each tolerance is recorded beside the error
measured when it was set (float32, one CPU thread)."""

from __future__ import annotations

import copy
import dataclasses
import json
import math

import pytest
import torch
from safetensors.torch import save_file

from video_dit.families.ltx2.vae import LTX2Tiling, LTX2VideoVAE, decode_peak_bytes, tile_plan
from video_dit.families.ltx2.vae_config import LTX2_VAE_20, LTX2_VAE_23, LTX2_VAE_TINY, STRIDES, LTX2VAEConfig
from video_dit.families.ltx2.vae_convert import (
    UNUSED_ORIGINAL, load_ltx2_vae, ltx2_vae_config_from_diffusers, ltx2_vae_config_from_ltx,
    ltx2_vae_config_to_diffusers, ltx2_vae_from_diffusers, ltx2_vae_key_layout, ltx2_vae_to_diffusers,
    ltx2_vae_release_from_shapes, ltx2_vae_to_native, ltx2_vae_to_single_file)
from video_dit.models.weights import WeightsError
from video_dit.parallel.memory import CPUAllocationTracker
from video_dit.typed_config import ConfigError

diffusers = pytest.importorskip("diffusers")

TINY = LTX2_VAE_TINY
# The other decoder flavour: timestep-conditioned (noise and adaLN at decode), causal, zero padding.
TIMED = dataclasses.replace(TINY, timestep_conditioning=True, decoder_causal=True, decoder_padding="zeros")
H, W = 64, 96  # pixels: a 2 x 3 latent grid

# measured: encode <= 6e-7, log-variance <= 1.2e-6, decode <= 1.1e-6 (1 / 9 / 17 frames, both decoders)
PARITY_TOL = 2e-5


def _reference(cfg: LTX2VAEConfig, seed: int = 0):
    """diffusers' VAE with every parameter moved off its init, and latent statistics that are not identity."""
    torch.manual_seed(seed)
    ref = diffusers.AutoencoderKLLTX2Video(**ltx2_vae_config_to_diffusers(cfg)).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn_like(p) * 0.05)
        ref.latents_mean.copy_(torch.randn(cfg.latent_channels) * 0.3)
        ref.latents_std.copy_(torch.rand(cfg.latent_channels) + 0.5)
    return ref


def _ours_from(ref) -> LTX2VideoVAE:
    sd, layout = ltx2_vae_to_native(ref.state_dict())
    assert layout == "diffusers"
    vae = LTX2VideoVAE(_config_of(ref))
    vae.load_state_dict(sd, strict=True)
    return vae.eval()


def _config_of(ref) -> LTX2VAEConfig:
    return ltx2_vae_config_from_diffusers(dict(ref.config))


def _video(frames: int, h: int = H, w: int = W, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(1, 3, frames, h, w, generator=g) * 2 - 1


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def _stats(ref):
    return ref.latents_mean.view(1, -1, 1, 1, 1), ref.latents_std.view(1, -1, 1, 1, 1)


@pytest.fixture(scope="module")
def tiny():
    ref = _reference(TINY)
    return ref, _ours_from(ref)


# ---------------------------------------------------------------- parity with diffusers


@pytest.mark.parametrize("frames", [1, 9, 17])
def test_parity_with_diffusers(tiny, frames):
    """normalize(encode(v).mode()) is diffusers' pipelines' (mode - latents_mean) / latents_std, the posterior's
    log-variance is diffusers', and decode(z) is diffusers' decode(z), through the key conversion."""
    ref, vae = tiny
    video = _video(frames)
    with torch.no_grad():
        dist = ref.encode(video).latent_dist
        mean, std = _stats(ref)
        want = (dist.mode() - mean) / std
        posterior = vae.encode(video)
        got = vae.normalize(posterior.mode())
        assert got.shape == (1, TINY.latent_channels, (frames - 1) // 8 + 1, H // 32, W // 32)
        assert _rel(got, want) < PARITY_TOL
        assert _rel(posterior.logvar, dist.logvar) < PARITY_TOL
        z = dist.mode()
        want = ref.decode(z).sample
        got = vae.decode(z, clamp=False)
    assert got.shape == (1, 3, frames, H, W)
    assert _rel(got, want) < PARITY_TOL  # measured 7.8e-7 .. 9.8e-7


# measured: the training path's outputs equal diffusers' exactly (0.0: both run each conv over the whole clip),
# its parameter gradients within 4.0e-7 relative; 20x that
GRAD_TOL = 8e-6


def _training_errors(ref, vae, move_bias: float = 0.0) -> tuple[float, float]:
    """(output error, worst parameter-gradient error) of our VAE against diffusers', both trainable, through
    encode -> mode -> decode of a 17-frame clip and a loss of the reconstruction and the log-variance;
    `move_bias`: first added to one upsample conv bias of ours."""
    vae = copy.deepcopy(vae).requires_grad_(True)
    ref = copy.deepcopy(ref).requires_grad_(True)
    with torch.no_grad():
        vae.decoder.up_blocks[5].conv.conv.bias[0] += move_bias
    video = _video(17)
    posterior = vae.encode(video)
    recon = vae.decode(posterior.mode(), clamp=False)
    dist = ref.encode(video).latent_dist
    want = ref.decode(dist.mode()).sample
    assert recon.requires_grad
    (recon.square().mean() + posterior.logvar.mean()).backward()
    (want.square().mean() + dist.logvar.mean()).backward()
    theirs = dict(ref.named_parameters())
    mapped = ltx2_vae_to_diffusers({n: p.grad for n, p in vae.named_parameters()})
    assert set(mapped) <= set(theirs) and len(mapped) == len(list(vae.parameters()))
    grads = max(_rel(g, theirs[n].grad) for n, g in mapped.items() if theirs[n].grad.abs().max() > 0)
    return max(_rel(posterior.mode(), dist.mode()), _rel(recon.detach(), want.detach())), grads


def test_training_path_equals_diffusers_forward_and_backward(tiny):
    """With a weight that asks for a gradient (a VAE being trained: the demo's stage, `vae_stage.py`), encode and
    decode take the layers' differentiable `plain` path: its outputs are diffusers' and the gradient of a loss
    through encode -> decode is diffusers' autograd gradient, parameter by parameter; frozen weights still take
    the inference path (no graph) under autograd."""
    ref, vae = tiny
    outputs, grads = _training_errors(ref, vae)
    assert outputs < PARITY_TOL and grads < GRAD_TOL, (outputs, grads)
    frozen = copy.deepcopy(vae).requires_grad_(False)
    assert not frozen.encode(_video(9)).mode().requires_grad


def test_training_path_parity_could_fail(tiny):
    """The same upsample bias moved by 0.01 (as `test_parity_could_fail`): measured 3.7e-4 on the outputs and
    8.9e-4 on the gradients, past both tolerances."""
    ref, vae = tiny
    outputs, grads = _training_errors(ref, vae, move_bias=1e-2)
    assert outputs > 5 * PARITY_TOL and grads > 5 * GRAD_TOL, (outputs, grads)


def test_timestep_conditioned_causal_decoder_parity():
    """With timestep conditioning our decode mixes noise into the normalized latents, (1 - 0.025) z + 0.025 n
    (ltx-core's defaults), and conditions on t = 0.05: the same as diffusers' pipeline does around its VAE."""
    ref = _reference(TIMED, seed=2)
    vae = _ours_from(ref)
    z = torch.randn(1, TIMED.latent_channels, 2, 2, 3)
    with torch.no_grad():
        noise = torch.randn(z.shape, generator=torch.Generator().manual_seed(5))
        mean, std = _stats(ref)
        mixed = ((1 - 0.025) * (z - mean) / std + 0.025 * noise) * std + mean
        want = ref.decode(mixed, temb=torch.tensor([0.05])).sample
        got = vae.decode(z, generator=torch.Generator().manual_seed(5), clamp=False)
        other_t = vae.decode(z, timestep=0.5, generator=torch.Generator().manual_seed(5), clamp=False)
    assert _rel(got, want) < PARITY_TOL  # measured 7e-7
    assert _rel(other_t, want) > 100 * PARITY_TOL  # the timestep reaches the network


def test_parity_could_fail(tiny):
    """One upsample conv bias moved by 0.01 (biases are ~0.1) breaks the decode tolerance (measured 4e-4)."""
    ref, vae = tiny
    z = torch.randn(1, TINY.latent_channels, 2, 2, 3)
    with torch.no_grad():
        want = ref.decode(z).sample
        bias = vae.decoder.up_blocks[5].conv.conv.bias
        bias[0] += 1e-2
        try:
            got = vae.decode(z, clamp=False)
        finally:
            bias[0] -= 1e-2
    assert _rel(got, want) > 5 * PARITY_TOL


def test_bfloat16_error_near_diffusers(tiny):
    """In bf16, our encode and decode are as far from the float32 result as diffusers' are from theirs (within 2x:
    measured ours / diffusers' = 1.3 for encode (1.2e-2 / 9.3e-3), 0.9 for decode (1.06e-2 / 1.18e-2))."""
    ref, vae = tiny
    video = _video(17)
    with torch.no_grad():
        z = ref.encode(video).latent_dist.mode()
        want = ref.decode(z).sample
        ref = copy.deepcopy(ref).to(torch.bfloat16)
        ours = copy.deepcopy(vae).to(torch.bfloat16)
        ref_enc = _rel(ref.encode(video.bfloat16()).latent_dist.mode().float(), z)
        ref_dec = _rel(ref.decode(z.bfloat16()).sample.float(), want)
        enc, dec = _rel(ours.encode(video).mode().float(), z), _rel(ours.decode(z, clamp=False).float(), want)
    assert enc < 2 * ref_enc and dec < 2 * ref_dec


def test_encoder_is_causal(tiny):
    """A latent frame depends only on its own and earlier pixel frames: changing frames 9..16 leaves the
    latent frames of frames 0..8 as they were and changes the last."""
    _, vae = tiny
    video = _video(17)
    later = video.clone()
    later[:, :, 9:] = _video(8, seed=7)
    a, b = vae.encode(video).mode(), vae.encode(later).mode()
    assert torch.equal(a[:, :, :2], b[:, :, :2])
    assert (a[:, :, 2] - b[:, :, 2]).abs().max() > 1e-3


def test_chunk_size_does_not_change_results(tiny):
    """Convs run chunk_frames output frames at a time; one frame per call and the whole clip per call agree."""
    _, vae = tiny
    video = _video(17)
    out = []
    for chunk in (1, 100):
        vae.chunk_frames = chunk
        z = vae.encode(video).mode()
        out.append((z, vae.decode(z, clamp=False)))
    vae.chunk_frames = 4
    assert _rel(out[0][0], out[1][0]) < 1e-5 and _rel(out[0][1], out[1][1]) < 1e-5  # measured 6.5e-7, 1.5e-6


# ---------------------------------------------------------------- layouts


def test_layouts_round_trip_and_detection(tiny):
    """diffusers -> ours -> diffusers is the identity on names and tensors; a combined checkpoint's `vae.` part
    (beside other networks' keys) and a standalone original file (with Lightricks' two unused statistics)
    read as ours; each layout is told from its names."""
    ref, vae = tiny
    ref_sd, ours = ref.state_dict(), vae.state_dict()
    back = ltx2_vae_to_diffusers(ltx2_vae_from_diffusers(ref_sd))
    assert back.keys() == ref_sd.keys() and all(back[k] is ref_sd[k] for k in ref_sd)
    single = {**ltx2_vae_to_single_file(ours), "model.diffusion_model.proj_out.weight": torch.zeros(1),
              "audio_vae.per_channel_statistics.mean-of-means": torch.zeros(1),
              **{f"vae.{k}": torch.zeros(TINY.latent_channels) for k in UNUSED_ORIGINAL}}
    original = {**ours, **{k: torch.zeros(TINY.latent_channels) for k in UNUSED_ORIGINAL}}
    for sd, layout in ((single, "single_file"), (original, "original"), (ref_sd, "diffusers")):
        assert ltx2_vae_key_layout(sd) == layout
        native, _ = ltx2_vae_to_native(sd)
        assert native.keys() == ours.keys() and all(torch.equal(native[k], ours[k]) for k in ours)


def test_released_key_names_and_shapes():
    """The released diffusers models' names (from diffusers' own classes at the converter's configs) map
    one to one onto ours with the same shapes: LTX-2.0 and LTX-2.3."""
    for cfg in (LTX2_VAE_20, LTX2_VAE_23):
        with torch.device("meta"):
            ref = diffusers.AutoencoderKLLTX2Video(**ltx2_vae_config_to_diffusers(cfg))
            ours = LTX2VideoVAE(cfg).state_dict()
        converted = ltx2_vae_from_diffusers(ref.state_dict())
        assert converted.keys() == ours.keys()
        assert all(converted[k].shape == ours[k].shape for k in ours)


def test_unknown_keys_and_bad_files_are_named(tiny, tmp_path):
    """A key no layout knows is an error naming it; a file whose tensors do not fit names the file and the
    missing / wrong-shape keys."""
    _, vae = tiny
    sd = vae.state_dict()
    with pytest.raises(ValueError, match=r"decoder\.up_blocks\.0\.res_blocks\.0\.conv9\.conv\.weight"):
        ltx2_vae_to_diffusers({**sd, "decoder.up_blocks.0.res_blocks.0.conv9.conv.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match=r"encoder\.mid_block\.resnets\.0\.norm3\.weight"):
        ltx2_vae_from_diffusers({"encoder.mid_block.resnets.0.norm3.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match="not an LTX-2 video VAE"):
        ltx2_vae_key_layout({"blocks.0.attn.weight": torch.zeros(1)})
    bad = dict(sd)
    bad["decoder.conv_out.conv.bias"] = torch.zeros(5)
    del bad["encoder.conv_in.conv.weight"]
    path = tmp_path / "vae.safetensors"
    save_file(bad, str(path))
    with pytest.raises(WeightsError) as err:
        load_ltx2_vae(path, config=TINY)
    msg = str(err.value)
    assert str(path) in msg and "missing: encoder.conv_in.conv.weight" in msg
    assert "decoder.conv_out.conv.bias: file (5,) vs model (48,)" in msg


def test_load_from_files(tiny, tmp_path):
    """A diffusers folder (config.json + weights), a Lightricks combined file whose metadata carries its block
    lists, and a bare original file of released shapes (the config found from the shapes) all load."""
    ref, vae = tiny
    ref.save_pretrained(tmp_path / "pipe" / "vae")
    loaded = load_ltx2_vae(tmp_path / "pipe")
    assert loaded.config == TINY
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in vae.state_dict().items())
    # Lightricks' metadata (ltx-core's model_configurator keys), TINY written as its block lists by hand
    meta = {"vae": {"_class_name": "CausalVideoAutoencoder", "latent_channels": 8, "patch_size": 4,
                    "encoder_blocks": [["res_x", {"num_layers": 1}], ["compress_space_res", {"multiplier": 2}],
                                       ["res_x", 1], ["compress_time_res", {"multiplier": 1}], ["res_x", 1],
                                       ["compress_all_res", {"multiplier": 2}], ["res_x", 1],
                                       ["compress_all_res", {"multiplier": 1}], ["res_x", 1]],
                    "decoder_blocks": [["res_x", {"num_layers": 1, "inject_noise": False}],
                                       ["compress_all", {"multiplier": 1}], ["res_x", 1],
                                       ["compress_all", {"residual": True, "multiplier": 2}], ["res_x", 1],
                                       ["compress_time", {"multiplier": 1}], ["res_x", 1],
                                       ["compress_space", {"multiplier": 2}], ["res_x", 1]],
                    "decoder_base_channels": 8, "timestep_conditioning": False, "norm_layer": "pixel_norm",
                    "latent_log_var": "uniform", "causal_decoder": False}}
    assert ltx2_vae_config_from_ltx(meta["vae"]) == TINY
    path = tmp_path / "ltx-2-tiny.safetensors"
    save_file(ltx2_vae_to_single_file(vae.state_dict()), str(path), metadata={"config": json.dumps(meta)})
    assert load_ltx2_vae(path).config == TINY
    with torch.device("meta"):
        released = LTX2VideoVAE(LTX2_VAE_23).state_dict()
    assert ltx2_vae_release_from_shapes(released) == LTX2_VAE_23


# ---------------------------------------------------------------- configs


def test_released_configs_are_the_converters():
    """Our presets, written as diffusers' arguments, are the numbers of diffusers' scripts/convert_ltx2_to_diffusers.py
    (`get_ltx2_video_vae_config`, copied here), and read back to the presets."""
    common = dict(in_channels=3, out_channels=3, latent_channels=128, patch_size=4, patch_size_t=1,
                  down_block_types=["LTX2VideoDownBlock3D"] * 4, spatio_temporal_scaling=[True] * 4,
                  downsample_type=["spatial", "temporal", "spatiotemporal", "spatiotemporal"],
                  timestep_conditioning=False, encoder_causal=True, decoder_causal=False,
                  encoder_spatial_padding_mode="zeros", spatial_compression_ratio=32, temporal_compression_ratio=8)
    v20 = dict(common, block_out_channels=[256, 512, 1024, 2048], decoder_block_out_channels=[256, 512, 1024],
               layers_per_block=[4, 6, 6, 2, 2], decoder_layers_per_block=[5, 5, 5, 5],
               decoder_spatio_temporal_scaling=[True] * 3, decoder_inject_noise=[False] * 4,
               upsample_type=["spatiotemporal"] * 3, upsample_residual=[True] * 3, upsample_factor=[2, 2, 2],
               decoder_spatial_padding_mode="reflect")
    v23 = dict(common, block_out_channels=[256, 512, 1024, 1024], decoder_block_out_channels=[256, 512, 512, 1024],
               layers_per_block=[4, 6, 4, 2, 2], decoder_layers_per_block=[4, 6, 4, 2, 2],
               decoder_spatio_temporal_scaling=[True] * 4, decoder_inject_noise=[False] * 5,
               upsample_type=["spatiotemporal", "spatiotemporal", "temporal", "spatial"],
               upsample_residual=[False] * 4, upsample_factor=[2, 2, 1, 2], decoder_spatial_padding_mode="zeros")
    for cfg, want in ((LTX2_VAE_20, v20), (LTX2_VAE_23, v23)):
        assert ltx2_vae_config_to_diffusers(cfg) == want
        assert ltx2_vae_config_from_diffusers(dict(want, resnet_norm_eps=1e-6, scaling_factor=1.0)) == cfg
        assert (cfg.z_dim, cfg.spatial_compression, cfg.temporal_compression) == (128, 32, 8)


def test_config_errors_name_the_field():
    with pytest.raises(ConfigError, match=r"LTX2VAEConfig\.encoder_widths"):
        LTX2VAEConfig(encoder_widths=(64, 256, 512, 1024, 2048))
    with pytest.raises(ConfigError, match=r"LTX2VAEConfig\.decoder_layers"):
        dataclasses.replace(TINY, decoder_layers=(1, 1))
    with pytest.raises(ConfigError, match=r"LTX2VAEConfig\.decoder_upsamples.*'diag'"):
        dataclasses.replace(TINY, decoder_upsamples=("space", "time", "all", "diag"))
    with pytest.raises(ConfigError, match=r"LTX2VAEConfig\.decoder_residual"):
        dataclasses.replace(TINY, decoder_widths=(32, 16, 4, 4, 4), decoder_residual=(False, True, False, False))
    with pytest.raises(ConfigError, match=r"LTX2VAEConfig\.latent_chanels.*did you mean 'latent_channels'"):
        LTX2VAEConfig.from_dict({"latent_chanels": 8})
    with pytest.raises(ValueError, match="decoder_inject_noise"):
        ltx2_vae_config_from_diffusers(dict(ltx2_vae_config_to_diffusers(TINY), decoder_inject_noise=[True] * 5))
    with pytest.raises(ValueError, match="CausalDiffusionVAE"):
        ltx2_vae_config_from_ltx({"_class_name": "CausalDiffusionVAE"})


# ---------------------------------------------------------------- tiling


class _LocalDecoder(torch.nn.Module):
    """A stand-in decoder whose every output pixel depends on one latent cell only: channel sums of z, each latent
    frame repeated over its 8 frames (the first over 1), each cell over its 32 x 32 pixels."""

    def forward(self, z, t, chunk):
        v = torch.stack([z[:, 0::3].sum(1), z[:, 1::3].sum(1), z[:, 2::3].sum(1)], 1)  # (B, 3, F', h, w)
        v = torch.cat([v[:, :, :1], v[:, :, 1:].repeat_interleave(8, 2)], 2)
        return v.repeat_interleave(32, 3).repeat_interleave(32, 4)


def test_tiled_decode_is_exact_for_a_local_decoder(tiny):
    """With a decoder that looks at one latent cell per pixel, the blended tiles are the untiled decode: every
    tile sits where it belongs (in time with the causal first-frame shift) and the masks sum to one."""
    vae = LTX2VideoVAE(TINY, seed=0)
    vae.decoder = _LocalDecoder()
    z = torch.randn(1, TINY.latent_channels, 7, 5, 3)
    with torch.no_grad():  # inference: with a gradient the VAE takes its untiled differentiable path
        whole = vae.decode(z, clamp=False)
        vae.enable_tiling(LTX2Tiling(spatial=64, spatial_overlap=32, frames=24, frames_overlap=8))
        assert [len(axis) for axis in tile_plan(TINY, vae.tiling, 7, 5, 3)] == [3, 4, 2]
        tiled = vae.decode(z, clamp=False)
    assert _rel(tiled, whole) < 1e-6  # measured 1.2e-7 (float32 mask sums)


def _receptive_radius(cfg: LTX2VAEConfig) -> float:
    """How far (in latent cells) a decoder output reaches in H / W: each 3x3x3 conv reaches one position of its
    grid, conv_in, res convs and the upsample's conv at the stage's, conv_out at the output patch grid."""
    radius, cell = 1.0, 1.0  # conv_in
    for i, layers in enumerate(cfg.decoder_layers):
        if i:
            radius += cell  # the upsample's conv runs before the unfold
            cell /= STRIDES[cfg.decoder_upsamples[i - 1]][1]
        radius += 2 * layers * cell
    return radius + cell  # conv_out


def test_tiled_decode_of_the_network_is_within_its_derived_bound(tiny):
    """The network with spatial tiles against the untiled decode: (a) exact where one tile has all the weight and
    the pixel is further than the decoder's reach from that tile's cut edges; (b) everywhere within 2 B, B the
    bound of |conv_out(x) - bias| for any input: SiLU(pixel_norm(x)) has at most sqrt(C) L2 norm per position,
    so an output channel moves by at most sqrt(C) times the sum over its 27 taps of the taps' weight norms."""
    _, vae = tiny
    z = torch.randn(1, TINY.latent_channels, 1, 2, 40)
    vae.enable_tiling(LTX2Tiling(spatial=640, spatial_overlap=64, frames=0, frames_overlap=0))
    try:
        with torch.no_grad():  # inference: with a gradient the VAE takes its untiled differentiable path
            tiled = vae.decode(z, clamp=False)
            vae.disable_tiling()
            whole = vae.decode(z, clamp=False)
    finally:
        vae.disable_tiling()
    reach = _receptive_radius(TINY)  # 8.125 cells for TINY
    exact = torch.zeros(40 * 32, dtype=torch.bool)
    spans = tile_plan(TINY, LTX2Tiling(640, 64, 0, 0), 1, 2, 40)[2]
    for k, (cells, _, _) in enumerate(spans):
        lo = cells.start + (reach + 1 if cells.start else 0)  # in cells: clear of the cut edges
        hi = cells.stop - (reach + 1 if cells.stop < 40 else 0)
        lo = max(lo, spans[k - 1][0].stop if k else 0)  # and alone: past the neighbours' overlaps
        hi = min(hi, spans[k + 1][0].start if k + 1 < len(spans) else 40)
        if hi > lo:
            exact[math.ceil(lo * 32):math.floor(hi * 32)] = True
    assert exact.sum() > 300  # two regions, tiles 0 and 1
    err = (tiled - whole).abs()
    assert err[..., exact].max() < 1e-5 * whole.abs().max()  # measured 0: the same arithmetic (404 of 1280 columns)
    w = vae.decoder.conv_out.conv.weight  # (3 p^2, C, 3, 3, 3)
    bound = 2 * math.sqrt(w.shape[1]) * w.flatten(2).norm(dim=1).sum(1).max()
    assert err.max() < bound  # measured 1.35 (0.52 of the output's scale: random weights) against a bound of 30.4
    assert err[..., ~exact].max() > 1e-4  # the seams do differ: (a) is not vacuous


def test_tiling_settings_are_checked():
    vae = LTX2VideoVAE(TINY, seed=0)
    with pytest.raises(ValueError, match="spatial=100"):
        vae.enable_tiling(LTX2Tiling(spatial=100, spatial_overlap=32))
    with pytest.raises(ValueError, match="frames=16, frames_overlap=16"):
        LTX2Tiling(frames=16, frames_overlap=16)


# ---------------------------------------------------------------- memory


@pytest.mark.parametrize("tiling", [None, LTX2Tiling(spatial=96, spatial_overlap=32, frames=24, frames_overlap=8)],
                         ids=["untiled", "tiled"])
def test_decode_peak_prediction_matches_measurement(tiny, tiling):
    """`decode_peak_bytes` (from the layer shapes) against the CPU allocation tracker's peak of the decode."""
    _, vae = tiny
    z = torch.randn(1, TINY.latent_channels, 5, 4, 6)
    vae.tiling = tiling
    try:
        with torch.no_grad(), CPUAllocationTracker() as tracker:  # inference (no_grad), what the plan predicts
            video = vae.decode(z)
    finally:
        vae.tiling = None
    predicted = decode_peak_bytes(TINY, *video.shape[2:], tiling=tiling, dtype=torch.float32)
    assert abs(predicted / tracker.peak - 1) < 0.01  # measured: untiled exact, tiled 2e-4 low (the masks)


def test_released_decode_peaks():
    """The predicted bf16 peaks of a 121 x 704 x 1280 decode (720 is not a multiple of 32), untiled and with
    ltx-core's default tiles: the model's own arithmetic, pinned so a change to it is seen."""
    gib = 2 ** 30
    assert decode_peak_bytes(LTX2_VAE_20, 121, 704, 1280) / gib == pytest.approx(3.48, abs=0.01)
    assert decode_peak_bytes(LTX2_VAE_20, 121, 704, 1280, LTX2Tiling()) / gib == pytest.approx(1.92, abs=0.01)
    assert decode_peak_bytes(LTX2_VAE_23, 121, 704, 1280) / gib == pytest.approx(3.38, abs=0.01)
    with pytest.raises(ValueError, match="multiples of 32"):
        decode_peak_bytes(LTX2_VAE_20, 121, 720, 1280)


# ---------------------------------------------------------------- init, statistics, API


def test_seeded_init_by_name():
    a, b, c = LTX2VideoVAE(TIMED, seed=3), LTX2VideoVAE(TIMED, seed=3), LTX2VideoVAE(TIMED, seed=4)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["decoder.conv_out.conv.weight"], sc["decoder.conv_out.conv.weight"])
    assert sa["decoder.up_blocks.0.res_blocks.0.scale_shift_table"].abs().max() == 0
    assert sa["decoder.timestep_scale_multiplier"].item() == 1000.0
    w = sa["encoder.conv_in.conv.weight"]  # U(+-1/sqrt(fan_in)), fan_in = 48 * 27
    assert w.abs().max() <= (48 * 27) ** -0.5 and w.std() > 0.5 * (48 * 27) ** -0.5 / math.sqrt(3)


def test_latent_normalization_is_the_pipelines(tiny):
    """normalize / denormalize are diffusers' LTX-2 pipeline's `_normalize_latents` / `_denormalize_latents`."""
    from diffusers.pipelines.ltx2.pipeline_ltx2 import LTX2Pipeline

    ref, vae = tiny
    z = torch.randn(2, TINY.latent_channels, 3, 2, 3)
    want = LTX2Pipeline._normalize_latents(z, ref.latents_mean, ref.latents_std, 1.0)
    assert torch.allclose(vae.normalize(z), want, atol=1e-6)
    assert torch.allclose(vae.denormalize(vae.normalize(z)), z, atol=1e-5)
    assert torch.allclose(LTX2Pipeline._denormalize_latents(want, ref.latents_mean, ref.latents_std, 1.0),
                          vae.denormalize(want), atol=1e-6)


def test_api_contracts(tiny):
    _, vae = tiny
    with pytest.raises(ValueError, match="8k \\+ 1 .*nearest: 9 or 17"):
        vae.encode(_video(12))
    with pytest.raises(ValueError, match="multiples of 32"):
        vae.encode(_video(9, h=48))
    with pytest.raises(ValueError, match="latents \\(B, 8, F', h, w\\)"):
        vae.decode(torch.zeros(1, 4, 1, 2, 2))
    posterior = vae.encode(_video(9))
    a = posterior.sample(torch.Generator().manual_seed(0))
    assert a.shape == posterior.mode().shape and not torch.equal(a, posterior.mode())
    assert vae.latent_shape((1, 3, 9, H, W)) == (1, TINY.latent_channels, 2, 2, 3)
    video = vae.decode(posterior.mode())
    assert video.abs().max() <= 1.0 and video.dtype == torch.float32
