"""MiniMax H3 audio VAE: parity with diffusers' AutoencoderKLMiniMaxH3Audio on random weights (encode: mean and std;
decode), the pipeline's audio chains on diffusers' own blocks (a reference soundtrack's rows; the rows back to a
stereo waveform), the anti-aliased resampling against numpy and a derivation (the VAE has no spectrogram front
end: the waveform goes in as it is, right-padded to whole latents), configs (MiniMax's metadata, diffusers'),
loaders and bad keys.

Errors are relative: max |ours - reference| / max |reference|. Each tolerance is recorded beside the error measured
when it was set (float32, one CPU thread)."""

from __future__ import annotations

import dataclasses
import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from video_dit.families.minimax_h3.audio_config import H3_AUDIO_VAE, H3_AUDIO_VAE_TINY, H3AudioVAEConfig
from video_dit.families.minimax_h3.audio_vae import (Activation1d, DownSample1d, H3AudioVAE, UpSample1d, as_stereo,
                                                     h3_audio_config_from_original, h3_audio_config_to_diffusers,
                                                     h3_audio_vae_to_native, kaiser_sinc_filter, load_h3_audio_vae)
from video_dit.models.weights import WeightsError
from video_dit.typed_config import ConfigError

diffusers = pytest.importorskip("diffusers")
from diffusers.modular_pipelines import PipelineState  # noqa: E402
from diffusers.modular_pipelines.minimax_h3 import MiniMaxH3AudioReference  # noqa: E402
from diffusers.modular_pipelines.minimax_h3 import decoders as h3_decoders  # noqa: E402
from diffusers.modular_pipelines.minimax_h3 import encoders as h3_encoders  # noqa: E402
from diffusers.modular_pipelines.minimax_h3 import modular_pipeline as h3_pipeline  # noqa: E402

TINY = dataclasses.replace(H3_AUDIO_VAE_TINY, latents_mean=(0.2, -0.1, 0.0, 0.3, -0.4, 0.1, 0.05, -0.2),
                           latents_std=(1.2, 0.8, 1.5, 0.6, 1.0, 2.0, 0.9, 1.1))
SAMPLES = 70  # 17.5 latents of 4 samples: right-padded to 18

# measured: encode mean 2.2e-7, std 2.2e-7, decode 3.5e-7: ~15-20x
PARITY_TOL = 5e-6


def _reference(seed: int = 0):
    """diffusers' audio VAE with every parameter (Snake alphas, norms, biases, weight norms) moved off its init."""
    torch.manual_seed(seed)
    ref = diffusers.AutoencoderKLMiniMaxH3Audio(**h3_audio_config_to_diffusers(TINY)).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return ref


def _audio(channels: int = 2, samples: int = SAMPLES, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(1, channels, samples, generator=g) * 2 - 1) * 0.5


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.fixture(scope="module")
def tiny():
    ref = _reference()
    vae = H3AudioVAE(TINY)
    vae.load_state_dict(h3_audio_vae_to_native(ref.state_dict()), strict=True)
    return ref, vae.eval()


# ---------------------------------------------------------------- parity with diffusers


def test_encode_decode_parity_with_diffusers(tiny):
    """Each stereo channel is one mono batch item of diffusers' VAE: our posterior's mean and std are its `mean` and
    `exp(logs)`, our decode is its decode; the decoded waveform is mostly inside the clamp, so the comparison sees
    the network, not the bound."""
    ref, vae = tiny
    audio = _audio()
    with torch.no_grad():
        dist = ref.encode(audio[0][:, None]).latent_dist  # (2, 8, 18)
        want = ref.decode(dist.mode()).sample  # (2, 1, 72)
    posterior = vae.encode(audio)
    assert posterior.mean.shape == (1, 2, 8, 18)
    assert _rel(posterior.mean[0], dist.mean) < PARITY_TOL and _rel(posterior.std[0], dist.std) < PARITY_TOL
    got = vae.decode(posterior.mode())
    assert got.shape == (1, 2, 72)
    assert _rel(got[0], want[:, 0]) < PARITY_TOL
    assert (want.abs() < 1).float().mean() > 0.5


def test_parity_could_fail(tiny):
    """A Snake alpha of the encoder's last block moved by 1e-3 (alphas ~1), or one bias of the decoder's first conv
    by 1e-3, breaks the tolerance (measured 5.8e-5 and 2.5e-4 relative)."""
    ref, vae = tiny
    audio = _audio()
    with torch.no_grad():
        dist = ref.encode(audio[0][:, None]).latent_dist
        want = ref.decode(dist.mode()).sample[:, 0]
    for p, read, target in ((vae.encoder.block[2].block[3].alpha, lambda: vae.encode(audio).mean[0], dist.mean),
                            (vae.decoder.conv_pre.bias, lambda: vae.decode(dist.mode()[None])[0], want)):
        with torch.no_grad():
            p.view(-1)[0] += 1e-3
        try:
            got = read()
        finally:
            with torch.no_grad():
                p.view(-1)[0] -= 1e-3
        assert _rel(got, target) > 5 * PARITY_TOL


def test_pipeline_chains(tiny):
    """A reference soundtrack through `MiniMaxH3Ref2VAReferenceEncoderStep` (mono VAE per channel, posterior mean,
    normalised, channel-major rows) is `normalize(encode(audio).mode())`; rows through `MiniMaxH3AfterDenoiseStep` and
    `MiniMaxH3AudioDecodeStep` (rows to (2, 8, T), denormalised, decoded, (1, 2, S)) are
    `decode(denormalize(rows))`. Measured 2.6e-7 and 3.5e-7."""
    ref, vae = tiny
    audio = _audio()
    components = SimpleNamespace(vae=None, audio_vae=ref, _execution_device=torch.device("cpu"),
                                 audio_latent_channels=TINY.latent_channels, audio_channels=2,
                                 audio_sampling_rate=TINY.sampling_rate, patch_size=(1, 1, 1), vae_latent_channels=4)
    state = PipelineState()
    state.set("normalized_references", [MiniMaxH3AudioReference(audio=audio[0], sample_rate=TINY.sampling_rate)])
    h3_encoders.MiniMaxH3Ref2VAReferenceEncoderStep()(components, state)
    (want,) = state.get("audio_condition_latents")  # (2 T, 8)
    rows = vae.normalize(vae.encode(audio).mode())
    assert rows.shape == (1, 36, 8) and _rel(rows[0], want) < PARITY_TOL

    rows = torch.randn(1, 36, 8, generator=torch.Generator().manual_seed(2))
    state = PipelineState()
    for key, value in dict(latents=torch.zeros(1, 4), audio_latents=rows[0], num_latent_frames=1, latent_height=1,
                           latent_width=1, num_audio_latents=18).items():
        state.set(key, value)
    h3_decoders.MiniMaxH3AfterDenoiseStep()(components, state)
    h3_decoders.MiniMaxH3AudioDecodeStep()(components, state)
    want = state.get("audio")  # (1, 2, 72)
    got = vae.decode(vae.denormalize(rows))
    assert got.shape == want.shape == (1, 2, 72) and _rel(got, want) < PARITY_TOL
    assert state.get("sampling_rate") == TINY.sampling_rate


def test_mono_is_made_stereo_explicitly(tiny):
    """The DiT's rows hold two channels: a mono track is refused by `normalize` and repeated on both by `as_stereo`
    (the pipeline's upmix), which encodes to two identical channels."""
    _, vae = tiny
    mono = _audio(channels=1)
    with pytest.raises(ValueError, match="as_stereo"):
        vae.normalize(vae.encode(mono).mode())
    rows = vae.normalize(vae.encode(as_stereo(mono)).mode())  # (1, 2 T, 8)
    assert torch.equal(rows[:, :18], rows[:, 18:])


# ---------------------------------------------------------------- the anti-aliased resampling (the only DSP)


def test_kaiser_filter_matches_numpy():
    """The Kaiser-windowed sinc built with numpy's `kaiser` and `sinc` (beta from Kaiser's attenuation formula for a
    12-tap filter of transition width 4 x 0.3): the same taps (measured 2.6e-8). Its response is flat in the pass
    band (0.1 cycles / sample: within 0.5%, measured 1.0025) and below 2e-3 at 0.4 (measured 1.0e-3)."""
    taps, cutoff, half_width = 12, 0.25, 0.3
    attenuation = 2.285 * (taps // 2 - 1) * math.pi * 4 * half_width + 7.95  # > 50 dB: beta = 0.1102 (A - 8.7)
    beta = 0.1102 * (attenuation - 8.7)
    t = np.arange(-taps // 2, taps // 2) + 0.5
    h = 2 * cutoff * np.kaiser(taps, beta) * np.sinc(2 * cutoff * t)
    h /= h.sum()
    ours = kaiser_sinc_filter(cutoff, half_width, taps)[0, 0].double().numpy()
    assert np.abs(ours - h).max() < 1e-6

    def response(f: float) -> float:
        return abs(np.sum(ours * np.exp(-2j * np.pi * f * np.arange(taps))))

    assert abs(response(0.1) - 1) < 5e-3 and response(0.4) < 2e-3


def test_alias_free_resampling_derivation():
    """The 12-tap filter is centred between its 6th and 7th taps, so the 2x upsampler's output m sits at input
    position (m - 1/2) / 2 and the downsampler's output k at input position 2k + 1/2: a slow sine (0.02 cycles per
    sample) upsampled is the sine at those positions, downsampled likewise, and the pair (an activation with the
    identity inside) gives the sine back. Interior samples (replicate padding bends the ends). Measured 6.2e-4,
    8.6e-5, 1.7e-4."""
    f = 0.02
    n = torch.arange(200, dtype=torch.float64)
    x = torch.sin(2 * math.pi * f * n).float().view(1, 1, -1)
    up = UpSample1d()(x)[0, 0].double()
    m = torch.arange(up.shape[0], dtype=torch.float64)
    assert up.shape[0] == 400 and (up - torch.sin(2 * math.pi * f * (m - 0.5) / 2))[20:-20].abs().max() < 5e-3
    fast = torch.sin(math.pi * f * torch.arange(400, dtype=torch.float64)).float().view(1, 1, -1)  # f / 2 per sample
    down = DownSample1d()(fast)[0, 0].double()
    k = torch.arange(down.shape[0], dtype=torch.float64)
    assert down.shape[0] == 200 and (down - torch.sin(math.pi * f * (2 * k + 0.5)))[20:-20].abs().max() < 1e-3
    both = Activation1d(torch.nn.Identity())(x)[0, 0].double()
    assert (both - x[0, 0].double())[20:-20].abs().max() < 2e-3
    assert (up - torch.sin(2 * math.pi * f * m / 2))[20:-20].abs().max() > 2e-2  # a sample off: the positions matter


# ---------------------------------------------------------------- configs and loading


def test_released_config_and_rates():
    """The release: 800 samples a latent at 32 kHz (40 a second), 405 latents beside 243 frames at 24 fps
    (diffusers' `audio_latent_num_frames`); MiniMax's metadata.json and config.json give it, and its names match
    diffusers' model one to one."""
    cfg = H3_AUDIO_VAE
    assert (cfg.hop_length, cfg.latent_rate) == (800, 40.0)
    for frames in (22, 124, 243, 362):
        assert cfg.latent_frames(frames) == h3_pipeline.audio_latent_num_frames(frames)
    metadata = {"metadata": {"kwargs": {"attn_proj": True, "decoder_dim": 1024, "decoder_rates": [5, 5, 2, 2, 2, 2, 2],
                                        "decoder_type": "bigvgan", "encoder_dim": 64, "encoder_rates": [2, 4, 4, 5, 5],
                                        "latent_dim": 2048, "sample_rate": 32000, "vae_latent_channels": 32}}}
    wrapper = {"sample_rate": 32000, "latent_channels": 32, "latents_mean": list(cfg.latents_mean),
               "latents_std": list(cfg.latents_std)}
    assert h3_audio_config_from_original(metadata, wrapper) == cfg
    with torch.device("meta"):
        ours = H3AudioVAE(cfg).state_dict()
        ref = diffusers.AutoencoderKLMiniMaxH3Audio(**h3_audio_config_to_diffusers(cfg)).state_dict()
    assert ours.keys() == ref.keys() and all(ours[k].shape == ref[k].shape for k in ours)
    with pytest.raises(ConfigError, match="H3AudioVAEConfig.decoder_rates"):
        dataclasses.replace(TINY, decoder_rates=(2, 3))
    with pytest.raises(ConfigError, match="did you mean 'latent_dim'"):
        H3AudioVAEConfig.from_dict({"latent_dims": 32})


def test_load_from_folders_and_bad_keys(tiny, tmp_path):
    """diffusers' `audio_vae/` (save_pretrained) and MiniMax's `audio_vae/` (config.json, metadata.json, weights saved
    under torch's parametrized weight-norm names) load the same VAE; an unknown key is named with its file."""
    ref, vae = tiny
    ref.save_pretrained(tmp_path / "pipe" / "audio_vae")
    loaded = load_h3_audio_vae(tmp_path / "pipe")
    assert loaded.config == dataclasses.replace(TINY, channels=2)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in vae.state_dict().items())

    cfg = dataclasses.replace(TINY, num_attention_heads=8, latent_dim=64, decoder_kernel_sizes=(4, 4),
                              resblock_kernel_sizes=(3, 7, 11), resblock_dilation_sizes=((1, 3, 5),) * 3)
    minimax = H3AudioVAE(cfg, seed=3)
    folder = tmp_path / "FL2VA" / "audio_vae"
    folder.mkdir(parents=True)
    sd = {}
    for k, v in minimax.state_dict().items():
        name, _, leaf = k.rpartition(".")
        sd[f"{name}.parametrizations.weight.original{'gv'.index(leaf[-1])}" if leaf in ("weight_g", "weight_v")
           else k] = v
    save_file(sd, str(folder / "model.safetensors"))
    (folder / "metadata.json").write_text(json.dumps({"metadata": {"kwargs": {
        "attn_proj": True, "decoder_dim": 16, "decoder_rates": [2, 2], "decoder_type": "bigvgan", "encoder_dim": 4,
        "encoder_rates": [2, 2], "latent_dim": 64, "sample_rate": 32000, "vae_latent_channels": 8}}}))
    (folder / "config.json").write_text(json.dumps({
        "_class_name": "MiniMaxH3AudioVAE", "sample_rate": 32000, "source_config_path": "config.yaml",
        "source_safetensors_path": "model.safetensors", "source_metadata_path": "metadata.json",
        "latent_channels": 8, "latents_mean": list(TINY.latents_mean), "latents_std": list(TINY.latents_std)}))
    loaded = load_h3_audio_vae(tmp_path / "FL2VA")
    assert loaded.config == cfg
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in minimax.state_dict().items())

    bad = dict(vae.state_dict())
    bad["decoder.conv_post.bias"] = torch.zeros(1)
    path = tmp_path / "bad.safetensors"
    save_file(bad, str(path))
    with pytest.raises(WeightsError) as err:
        load_h3_audio_vae(path, config=TINY)
    assert str(path) in str(err.value) and "unexpected: decoder.conv_post.bias" in str(err.value)


def test_seeded_init_by_name():
    """The same seed gives the same weights; weight_g starts as the norm of weight_v (so the kernel is weight_v)."""
    a, b = H3AudioVAE(TINY, seed=2), H3AudioVAE(TINY, seed=2)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    conv = a.decoder.conv_pre
    assert torch.allclose(conv.weight_g.flatten(), conv.weight_v.flatten(1).norm(dim=1))
