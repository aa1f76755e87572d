"""LTX-2's audio path: the audio VAE and the vocoders equal to diffusers' modules on random weights (every
parameter and buffer moved off its init), the whole mel -> latents -> mel -> waveform chain equal to
diffusers' chain, causality, the mel front end against transformers' numpy implementation, resampling and
channel rules, key layouts (round trips, a bad key named, Lightricks' and diffusers' files loaded), configs.

Each parity test records the error measured on this machine (float32, CPU) and a tolerance about 10-20x
above it; a "could fail" sibling shows the same measure fails on a deliberate small change."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from video_dit.families.ltx2 import audio_convert as AC
from video_dit.families.ltx2.audio_config import (
    LTX2_AUDIO_VAE, LTX23_VOCODER, TINY_AUDIO_VAE, TINY_VOCODER, TINY_VOCODER_BWE, AudioVAEConfig, VocoderConfig)
from video_dit.families.ltx2.audio_vae import LTX2AudioVAE, audio_latents, audio_tokens
from video_dit.families.ltx2.mel import (
    LTX2_MEL, MelConfig, log_mel_spectrogram, mel_filter_bank, resample, to_stereo, waveform_to_mel)
from video_dit.families.ltx2.vocoder import LTX2Vocoder, LTX2VocoderWithBWE
from video_dit.models.weights import WeightsError
from video_dit.typed_config import ConfigError

diffusers = pytest.importorskip("diffusers")
from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder as DiffusersVocoder  # noqa: E402
from diffusers.pipelines.ltx2.vocoder import LTX2VocoderWithBWE as DiffusersVocoderBWE  # noqa: E402
from diffusers.pipelines.ltx2.vocoder import UpSample1d as DiffusersUpSample1d  # noqa: E402

# group norm (widths of 32), no causality, attention in the deepest level and the mid block; causal on width
GROUP_ATTN = AudioVAEConfig(ch=32, ch_mult=(1, 1, 1), num_res_blocks=1, z_channels=2, mel_bins=64, resolution=64,
                            attn_resolutions=(16,), mid_block_add_attention=True, norm_type="group",
                            causality_axis="none")
WIDTH = replace(TINY_AUDIO_VAE, causality_axis="width")
AMP_SNAKE = replace(TINY_VOCODER, resblock="AMP1", activation="snake", final_activation="clamp")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| over max |b|: the error relative to the reference's scale."""
    assert a.shape == b.shape, (a.shape, b.shape)
    return ((a - b).abs().max() / b.abs().max()).item()


def _perturb(model: torch.nn.Module, seed: int = 0, std: float = 0.2) -> torch.nn.Module:
    """Every 1-D parameter (biases, GroupNorm scales, Snake log-scales: all at 0 or 1 after init) and the
    latent statistics moved off their init, so a parity test sees them."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(std * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("mean-of-means"):
                b.copy_(0.3 * torch.randn(b.shape, generator=g))
            elif name.endswith("std-of-means"):
                b.copy_(0.5 + torch.rand(b.shape, generator=g))
    return model


def _mel(config: AudioVAEConfig, frames: int, batch: int = 2, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, config.in_channels, frames, config.mel_bins, generator=g)


# ---------------------------------------------------------------- audio VAE


def _diffusers_vae(ours: LTX2AudioVAE):
    ref = diffusers.AutoencoderKLLTX2Audio(**AC.audio_vae_config_to_diffusers(ours.config)).eval()
    ref.load_state_dict(AC.audio_vae_to_diffusers(ours.state_dict()))
    return ref


def _diffusers_encode(ref, mel: torch.Tensor, z: int) -> torch.Tensor:
    """diffusers' pipeline's latents: posterior mode, packed, (x - latents_mean) / latents_std, unpacked."""
    tokens = audio_tokens(ref.encode(mel).latent_dist.mode())
    return audio_latents((tokens - ref.latents_mean) / ref.latents_std, z)


def _diffusers_decode(ref, latents: torch.Tensor, z: int) -> torch.Tensor:
    tokens = audio_tokens(latents) * ref.latents_std + ref.latents_mean
    return ref.decode(audio_latents(tokens, z)).sample


VAE_TOL = 2e-5  # measured: encode <= 3.4e-7, decode <= 1.6e-6 relative (three configs, 17 and 18 frames): ~12x


@pytest.mark.parametrize("config", [TINY_AUDIO_VAE, GROUP_ATTN, WIDTH], ids=["tiny", "group-attn", "width"])
@torch.no_grad()
def test_audio_vae_matches_diffusers(config):
    """encode (normalised mean latents) and decode (log-mel) equal diffusers' AutoencoderKLLTX2Audio and its
    pipeline's normalisation, for 4k + 1 frames and not; shapes as the config says. Without causality
    diffusers still crops the decoded frames to 4T' - 3 (it tests `causality_axis is not None`, and "none"
    is a string); ltx-core (`!= CausalityAxis.NONE`) keeps all 4T': we follow ltx-core and compare the
    frames diffusers keeps."""
    ours = _perturb(LTX2AudioVAE(config, seed=0).eval())
    ref = _diffusers_vae(ours)
    for frames in (17, 18):
        mel = _mel(config, frames)
        z = ours.encode(mel)
        assert z.shape == (2, config.z_channels, config.latent_frames(frames), config.latent_mel_bins)
        assert _rel(z, _diffusers_encode(ref, mel, config.z_channels)) < VAE_TOL
        out = ours.decode(z)
        assert out.shape == (2, config.out_ch, config.mel_frames(z.shape[2]), config.mel_bins)
        ref_out = _diffusers_decode(ref, z, config.z_channels)
        assert _rel(out[:, :, :ref_out.shape[2]], ref_out) < VAE_TOL


@torch.no_grad()
def test_audio_vae_parity_could_fail():
    """The same measure on deliberate small changes: the statistics swapped (mean for std), and one
    decoder conv weight (of magnitude ~0.1) moved by 1e-2: each error is 10x VAE_TOL or more."""
    ours = _perturb(LTX2AudioVAE(TINY_AUDIO_VAE, seed=0).eval())
    ref = _diffusers_vae(ours)
    mel = _mel(TINY_AUDIO_VAE, 17)
    stats = ours.per_channel_statistics
    mean, std = stats.get_buffer("mean-of-means").clone(), stats.get_buffer("std-of-means").clone()
    stats.get_buffer("mean-of-means").copy_(std)
    stats.get_buffer("std-of-means").copy_(mean.abs() + 0.5)
    assert _rel(ours.encode(mel), _diffusers_encode(ref, mel, 2)) > 100 * VAE_TOL
    stats.get_buffer("mean-of-means").copy_(mean)
    stats.get_buffer("std-of-means").copy_(std)
    z = ours.encode(mel)
    ours.decoder.up[1].block[0].conv1.conv.weight[0, 0, 0, 0] += 1e-2
    assert _rel(ours.decode(z), _diffusers_decode(ref, z, 2)) > 10 * VAE_TOL


@torch.no_grad()
def test_audio_vae_is_causal_in_time():
    """Latent frame j reads spectrogram frames 0..4j only (causal convs, stride-2 downsamples padded in
    front): changing frames 4k + 1.. leaves latents 0..k as they are and changes latent k + 1; and a
    prefix of the latents decodes to the prefix of the spectrogram (4k - 3 frames of k latents)."""
    vae = _perturb(LTX2AudioVAE(TINY_AUDIO_VAE, seed=0).eval())
    mel = _mel(TINY_AUDIO_VAE, 21, batch=1)
    changed = mel.clone()
    changed[:, :, 9:] += 1.0  # frames 4 * 2 + 1 ..
    a, b = vae.encode(mel), vae.encode(changed)
    assert torch.equal(a[:, :, :3], b[:, :, :3]) and not torch.allclose(a[:, :, 3], b[:, :, 3])
    whole, prefix = vae.decode(a), vae.decode(a[:, :, :4])
    assert prefix.shape[2] == 13 and torch.allclose(prefix, whole[:, :, :13], atol=1e-6)


def test_audio_vae_seeded_init_by_name():
    """The same seed gives the same weights, also built on the meta device then materialised by name;
    another seed other weights; conv weights within torch's default conv bound, biases 0."""
    a, b, c = (LTX2AudioVAE(TINY_AUDIO_VAE, seed=s).state_dict() for s in (3, 3, 4))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a if k.endswith("weight"))
    w = a["encoder.down.1.block.0.conv1.conv.weight"]
    assert w.abs().max() <= 1 / math.sqrt(w[0].numel()) and w.std() > 0
    assert not a["encoder.down.1.block.0.conv1.conv.bias"].any()


def test_audio_vae_config_errors():
    with pytest.raises(ConfigError, match="ch_mul: unknown key \\(did you mean 'ch_mult'\\?\\)"):
        AudioVAEConfig.from_dict({"ch_mul": [1, 2]})
    with pytest.raises(ValueError, match="norm_type='group' needs causality_axis='none'"):
        AudioVAEConfig(norm_type="group", ch=32)
    with pytest.raises(ValueError, match="mel_bins=66 must be divisible by 2\\^\\(levels - 1\\) = 4"):
        AudioVAEConfig(mel_bins=66)
    vae = LTX2AudioVAE(TINY_AUDIO_VAE, seed=0)
    with pytest.raises(ValueError, match="encode|moments: expected \\(B, 2, T, 16\\)"):
        vae.encode(torch.zeros(1, 2, 9, 8))


# ---------------------------------------------------------------- vocoders


def _diffusers_vocoder(ours):
    cls = DiffusersVocoderBWE if isinstance(ours, LTX2VocoderWithBWE) else DiffusersVocoder
    ref = cls(**AC.vocoder_config_to_diffusers(ours.config)).eval()
    ref.load_state_dict(AC.vocoder_to_diffusers(ours.state_dict()))
    return ref


VOCODER_TOL = 1e-5  # measured: 0 (HiFi-GAN), 5.0e-7 (AMP1 Snake), 6.6e-7 (BWE) relative: ~15x


@pytest.mark.parametrize("config", [TINY_VOCODER, AMP_SNAKE, TINY_VOCODER_BWE], ids=["hifigan", "amp-snake", "bwe"])
@torch.no_grad()
def test_vocoder_matches_diffusers(config):
    """LTX2Vocoder (HiFi-GAN; BigVGAN v2 with Snake) and LTX2VocoderWithBWE equal diffusers' on random
    weights; the waveform is T * hop samples (x rate ratio with BWE) in [-1, 1]."""
    cls = LTX2VocoderWithBWE if config is TINY_VOCODER_BWE else LTX2Vocoder
    ours = _perturb(cls(config, seed=0).eval())
    ref = _diffusers_vocoder(ours)
    mel = torch.randn(2, 2, 6, 16, generator=torch.Generator().manual_seed(2))
    out = ours(mel)
    hop = config.vocoder.hop * 3 if config is TINY_VOCODER_BWE else config.hop
    assert out.shape == (2, 2, 6 * hop) and out.abs().max() <= 1
    assert _rel(out, ref(mel)) < VOCODER_TOL


@torch.no_grad()
def test_vocoder_parity_could_fail():
    """A SnakeBeta log-scale moved by 1e-2 in the BWE generator, or the skip resampler's filter scaled by
    1.001, fails the same measure by 10x or more."""
    ours = _perturb(LTX2VocoderWithBWE(TINY_VOCODER_BWE, seed=0).eval())
    ref = _diffusers_vocoder(ours)
    mel = torch.randn(2, 2, 6, 16, generator=torch.Generator().manual_seed(2))
    expected = ref(mel)
    ours.bwe_generator.resblocks[0].acts1[0].act.beta[0] += 1e-2
    assert _rel(ours(mel), expected) > 10 * VOCODER_TOL
    ours.bwe_generator.resblocks[0].acts1[0].act.beta[0] -= 1e-2
    ours.resampler.filter.mul_(1.001)
    assert _rel(ours(mel), expected) > 10 * VOCODER_TOL


@torch.no_grad()
def test_bwe_vocoder_computes_in_float32():
    """A bf16 BWE vocoder runs in float32 (ltx-core's float32 autocast): its output equals a float32 copy
    holding the same bf16-rounded weights and buffers, up to the final cast to the input's dtype; its
    weights stay bf16 after the call."""
    ours = _perturb(LTX2VocoderWithBWE(TINY_VOCODER_BWE, seed=0).eval()).to(torch.bfloat16)
    f32 = LTX2VocoderWithBWE(TINY_VOCODER_BWE, seed=0).eval()
    f32.load_state_dict({k: v.float() for k, v in ours.state_dict().items()})
    f32.resampler.filter.copy_(ours.resampler.filter.float())  # not in the state dict; bf16-rounded by .to()
    mel = torch.randn(1, 2, 5, 16, generator=torch.Generator().manual_seed(3))
    assert torch.equal(ours(mel), f32(mel))
    half = mel.bfloat16()
    assert ours(half).dtype == torch.bfloat16 and torch.equal(ours(half), f32(half.float()).bfloat16())
    assert all(p.dtype == torch.bfloat16 for p in ours.parameters())


def test_vocoder_config_errors():
    with pytest.raises(ValueError, match="three dilations per res block"):
        VocoderConfig(resblock_dilation_sizes=((1, 3), (1, 3), (1, 3)))
    with pytest.raises(ValueError, match="bwe generator's prod\\(upsample_rates\\)=240 must be hop_length"):
        replace(LTX23_VOCODER, hop_length=160)
    with pytest.raises(ValueError, match="expected \\(B, C, T, M\\) with C \\* M = 32"):
        LTX2Vocoder(TINY_VOCODER, seed=0)(torch.zeros(1, 2, 4, 8))


# ---------------------------------------------------------------- the whole chain


CHAIN_TOL = 5e-5  # measured: 2.4e-6 relative on the waveform


@torch.no_grad()
def test_audio_round_trip_matches_diffusers_chain():
    """Waveform -> mel (ours) -> encode -> decode -> vocoder (ours) equals the same mel through diffusers'
    AutoencoderKLLTX2Audio (posterior mode, the pipeline's normalise / denormalise) and LTX2Vocoder; the
    waveform is (mel frames) x hop samples long."""
    vae = _perturb(LTX2AudioVAE(TINY_AUDIO_VAE, seed=0).eval())
    voc = _perturb(LTX2Vocoder(TINY_VOCODER, seed=1).eval(), seed=1)
    ref_vae, ref_voc = _diffusers_vae(vae), _diffusers_vocoder(voc)
    cfg = MelConfig.from_audio_vae(TINY_AUDIO_VAE)
    wave = 0.3 * torch.randn(1, 1, 16 * 16, generator=torch.Generator().manual_seed(4))  # mono: duplicated
    mel = waveform_to_mel(wave, cfg.sample_rate, cfg)                                  # (1, 2, 17, 16)
    assert mel.shape == (1, 2, 17, 16)
    out = voc(vae.decode(vae.encode(mel)))
    ref = ref_voc(ref_vae.decode(audio_latents(
        audio_tokens(_diffusers_encode(ref_vae, mel, 2)) * ref_vae.latents_std + ref_vae.latents_mean, 2)).sample)
    assert out.shape == (1, 2, 17 * TINY_VOCODER.hop)
    assert _rel(out, ref) < CHAIN_TOL


# ---------------------------------------------------------------- the mel front end

MEL_TOL = 2e-5  # measured: 4e-7 absolute on log-mel values of magnitude ~10 (float32 STFT vs numpy float64)


def _numpy_log_mel(wave: np.ndarray, config: MelConfig, **changes) -> np.ndarray:
    """transformers' numpy spectrogram configured as ltx-core's torchaudio MelSpectrogram + log(clamp(1e-5)):
    periodic Hann window of n_fft, centred frames with reflect padding, magnitude, Slaney mel filters."""
    from transformers.audio_utils import mel_filter_bank as np_bank
    from transformers.audio_utils import spectrogram, window_function

    opts = {"periodic": True, "mel_scale": "slaney", **changes}
    filters = np_bank(config.n_freqs, config.n_mels, config.f_min, config.f_max, config.sample_rate, norm="slaney",
                      mel_scale=opts["mel_scale"])
    return spectrogram(wave, window_function(config.n_fft, "hann", periodic=opts["periodic"]), config.n_fft,
                       config.hop_length, fft_length=config.n_fft, power=1.0, center=True, pad_mode="reflect",
                       mel_filters=filters, mel_floor=config.log_floor, log_mel="log", dtype=np.float64).T


def test_log_mel_matches_transformers_numpy():
    """The released front end (16 kHz, n_fft 1024, hop 160, 64 Slaney bins to 8 kHz) equals transformers'
    independent numpy spectrogram on 0.25 s of stereo noise: (B, 2, T, 64), T = S // 160 + 1; the filter
    bank equals transformers' `mel_filter_bank` to float32 rounding."""
    wave = 0.3 * torch.randn(1, 2, 4000, generator=torch.Generator().manual_seed(5))
    ours = log_mel_spectrogram(wave, LTX2_MEL)
    assert ours.shape == (1, 2, 4000 // 160 + 1, 64) and ours.dtype == torch.float32
    for ch in range(2):
        ref = _numpy_log_mel(wave[0, ch].double().numpy(), LTX2_MEL)
        assert np.abs(ours[0, ch].numpy() - ref).max() < MEL_TOL
    from transformers.audio_utils import mel_filter_bank as np_bank
    bank = np_bank(513, 64, 0.0, 8000.0, 16000, norm="slaney", mel_scale="slaney")
    assert np.abs(mel_filter_bank(513, 64, 0.0, 8000.0, 16000).numpy() - bank).max() < 1e-8


@pytest.mark.parametrize("change", [{"periodic": False}, {"mel_scale": "htk"}])
def test_log_mel_parity_could_fail(change):
    """A symmetric window or the HTK mel scale in the reference moves it far past MEL_TOL."""
    wave = 0.3 * torch.randn(1, 1, 4000, generator=torch.Generator().manual_seed(5))
    ours = log_mel_spectrogram(wave, LTX2_MEL)[0, 0].numpy()
    assert np.abs(ours - _numpy_log_mel(wave[0, 0].double().numpy(), LTX2_MEL, **change)).max() > 100 * MEL_TOL


def test_mel_config_matches_the_audio_vae_and_refuses_short_input():
    assert MelConfig.from_audio_vae(LTX2_AUDIO_VAE) == LTX2_MEL
    with pytest.raises(ValueError, match="512 samples; the centred STFT's reflect padding needs more than"):
        log_mel_spectrogram(torch.zeros(1, 2, 512))
    with pytest.raises(ValueError, match="f_max <= sample_rate / 2 = 8000.0"):
        MelConfig(f_max=9000.0)


def test_resample_matches_torchaudio_semantics():
    """16 -> 48 kHz equals diffusers' Hann UpSample1d (the same windowed sinc, "equivalent to torchaudio's
    resample") away from the ends, where it pads by replication and torchaudio by zeros; 44.1 -> 16 kHz
    keeps a 440 Hz tone (error < 1e-3 inside) and gives ceil(S * 16000 / 44100) samples."""
    x = torch.randn(1, 1, 400, generator=torch.Generator().manual_seed(6))
    up = resample(x, 16000, 48000)
    ref = DiffusersUpSample1d(ratio=3, window_type="hann", persistent=False)(x)
    assert up.shape == (1, 1, 1200)
    assert (up - ref)[..., 60:-60].abs().max() < 1e-5 and (up - ref).abs().max() > 1e-2
    t = torch.arange(4410, dtype=torch.float64)
    tone = torch.sin(2 * math.pi * 440 * t / 44100).float()[None]
    down = resample(tone, 44100, 16000)
    assert down.shape == (1, math.ceil(4410 * 16000 / 44100))
    expected = torch.sin(2 * math.pi * 440 * torch.arange(down.shape[-1], dtype=torch.float64) / 16000).float()
    assert (down[0, 100:-100] - expected[100:-100]).abs().max() < 1e-3
    assert torch.equal(resample(x, 16000, 16000), x)


def test_to_stereo_follows_the_trainer_rules():
    """Mono duplicated; 5.1 left = (L + 0.707 C + 0.707 Ls) / 2.414, right likewise with R, Rs; 7.1 adds the
    backs over 3.121; other counts averaged."""
    x = torch.arange(1.0, 9.0)[None, :, None].repeat(1, 1, 3)                      # channel i holds i + 1
    assert torch.equal(to_stereo(x[:, :1]), x[:, [0, 0]])
    five = to_stereo(x[:, :6])[0, :, 0]
    assert torch.allclose(five, torch.tensor([(1 + 0.707 * (3 + 5)) / 2.414, (2 + 0.707 * (3 + 6)) / 2.414]))
    seven = to_stereo(x)[0, :, 0]
    assert torch.allclose(seven, torch.tensor([(1 + 0.707 * (3 + 5 + 7)) / 3.121, (2 + 0.707 * (3 + 6 + 8)) / 3.121]))
    assert torch.equal(to_stereo(x[:, :3])[0, :, 0], torch.tensor([2.0, 2.0]))


# ---------------------------------------------------------------- layouts, configs, loading


@pytest.mark.parametrize("kind", ["audio_vae", "vocoder", "vocoder_bwe"])
def test_layouts_round_trip(kind):
    """ours -> diffusers -> ours and ours -> Lightricks' file (among other components' keys) -> ours give the
    same tensors under the same names, each layout detected from the names."""
    model, to_diffusers, to_original, to_native = {
        "audio_vae": (LTX2AudioVAE(TINY_AUDIO_VAE, seed=0), AC.audio_vae_to_diffusers, AC.audio_vae_to_original,
                      AC.audio_vae_to_native),
        "vocoder": (LTX2Vocoder(TINY_VOCODER, seed=0), AC.vocoder_to_diffusers, AC.vocoder_to_original,
                    AC.vocoder_to_native),
        "vocoder_bwe": (LTX2VocoderWithBWE(TINY_VOCODER_BWE, seed=0), AC.vocoder_to_diffusers, AC.vocoder_to_original,
                        AC.vocoder_to_native)}[kind]
    sd = model.state_dict()
    others = {"model.diffusion_model.proj_in.weight": torch.zeros(1), "vae.encoder.conv_in.conv.weight": torch.zeros(1),
              ("vocoder.conv_pre.weight" if kind == "audio_vae" else "audio_vae.encoder.conv_in.conv.weight"):
              torch.zeros(1)}
    for layout, converted in (("diffusers", to_diffusers(sd)), ("original", {**to_original(sd), **others}),
                              ("native", sd)):
        back, found = to_native(converted)
        assert found == layout and back.keys() == sd.keys() and all(back[k] is sd[k] for k in sd)
    assert "latents_mean" in AC.audio_vae_to_diffusers(LTX2AudioVAE(TINY_AUDIO_VAE, seed=0).state_dict())
    assert "vocoder.vocoder.conv_pre.weight" in AC.vocoder_to_original(LTX2VocoderWithBWE(TINY_VOCODER_BWE,
                                                                                          0).state_dict())


def test_bad_keys_are_named():
    sd = AC.audio_vae_to_diffusers(LTX2AudioVAE(TINY_AUDIO_VAE, seed=0).state_dict())
    sd["encoder.down.0.block.0.conv3.conv.weight"] = torch.zeros(1)
    with pytest.raises(ValueError, match="1 key\\(s\\) not in the diffusers layout of the LTX-2 audio VAE: "
                                         "encoder.down.0.block.0.conv3.conv.weight"):
        AC.audio_vae_to_native(sd)
    voc = AC.vocoder_to_original(LTX2Vocoder(TINY_VOCODER, seed=0).state_dict())
    voc["vocoder.resblocks.0.convs3.0.weight"] = torch.zeros(1)
    with pytest.raises(ValueError, match="not in the original layout of the LTX-2 vocoder: "
                                         "resblocks.0.convs3.0.weight"):
        AC.vocoder_to_native(voc)
    with pytest.raises(ValueError, match="not an LTX-2 audio VAE state dict"):
        AC.audio_vae_to_native({"foo.weight": torch.zeros(1)})


def test_configs_round_trip_through_diffusers():
    """Our configs -> diffusers' constructor -> its config.json -> ours (n_fft, which diffusers does not record,
    comes back as the release's 1024); unknown keys are errors."""
    vae = diffusers.AutoencoderKLLTX2Audio(**AC.audio_vae_config_to_diffusers(TINY_AUDIO_VAE))
    assert AC.audio_vae_config_from_diffusers(dict(vae.config)) == replace(TINY_AUDIO_VAE, n_fft=1024)
    assert AC.audio_vae_config_from_diffusers(dict(diffusers.AutoencoderKLLTX2Audio().config)) == LTX2_AUDIO_VAE
    for cfg, cls in ((TINY_VOCODER, DiffusersVocoder), (AMP_SNAKE, DiffusersVocoder),
                     (TINY_VOCODER_BWE, DiffusersVocoderBWE)):
        assert AC.vocoder_config_from_diffusers(dict(cls(**AC.vocoder_config_to_diffusers(cfg)).config)) == cfg
    with pytest.raises(ValueError, match="AutoencoderKLLTX2Audio config: unknown keys \\['base_chanels'\\]"):
        AC.audio_vae_config_from_diffusers({"base_chanels": 4})


def test_load_from_diffusers_folder_and_lightricks_file(tmp_path):
    """A diffusers pipeline folder (audio_vae/, vocoder/ with config.json) and a Lightricks single file
    (every component's tensors, the configs in its metadata, bf16) both load to the models they hold;
    a file whose tensors do not fit names itself and the keys."""
    vae = _perturb(LTX2AudioVAE(TINY_AUDIO_VAE, seed=0).eval())
    voc = _perturb(LTX2VocoderWithBWE(TINY_VOCODER_BWE, seed=0).eval())
    _diffusers_vae(vae).save_pretrained(tmp_path / "pipe" / "audio_vae")
    _diffusers_vocoder(voc).save_pretrained(tmp_path / "pipe" / "vocoder")
    vae2 = AC.load_ltx2_audio_vae(tmp_path / "pipe")
    voc2 = AC.load_ltx2_vocoder(tmp_path / "pipe")
    assert vae2.config == replace(TINY_AUDIO_VAE, n_fft=1024) and isinstance(voc2, LTX2VocoderWithBWE)
    assert all(torch.equal(v, vae.state_dict()[k]) for k, v in vae2.state_dict().items())
    assert all(torch.equal(v, voc.state_dict()[k]) for k, v in voc2.state_dict().items())

    metadata = {"config": json.dumps({
        "audio_vae": {"model": {"params": {"sampling_rate": 1024, "ddconfig": {
            "ch": 8, "out_ch": 2, "ch_mult": [1, 2, 4], "num_res_blocks": 1, "attn_resolutions": [], "resolution": 16,
            "z_channels": 2, "mid_block_add_attention": False, "norm_type": "pixel", "causality_axis": "height",
            "mel_bins": 16}}}, "preprocessing": {"stft": {"hop_length": 16, "filter_length": 64}}},
        "vocoder": {"upsample_initial_channel": 16, "upsample_rates": [4, 2], "upsample_kernel_sizes": [8, 4],
                    "resblock_kernel_sizes": [3, 5], "resblock_dilation_sizes": [[1, 3, 5], [1, 3, 5]],
                    "resblock": "1", "output_sampling_rate": 512}})}
    hifi = _perturb(LTX2Vocoder(replace(TINY_VOCODER, in_channels=128), seed=0).eval())
    tensors = {**AC.audio_vae_to_original(vae.state_dict()), **AC.vocoder_to_original(hifi.state_dict()),
               "model.diffusion_model.proj_in.weight": torch.zeros(2)}
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in tensors.items()}, tmp_path / "ltx.safetensors",
              metadata)
    vae3 = AC.load_ltx2_audio_vae(tmp_path / "ltx.safetensors")
    voc3 = AC.load_ltx2_vocoder(tmp_path / "ltx.safetensors", dtype=None)
    assert vae3.config == TINY_AUDIO_VAE and vae3.dtype == torch.float32
    assert voc3.config == replace(TINY_VOCODER, in_channels=128) and voc3.conv_pre.weight.dtype == torch.bfloat16
    assert torch.equal(vae3.state_dict()["encoder.conv_in.conv.weight"],
                       vae.state_dict()["encoder.conv_in.conv.weight"].bfloat16().float())
    with pytest.raises(WeightsError, match="ltx.safetensors \\(original layout\\): weights do not fit LTX2AudioVAE"
                                           "(.|\n)*wrong shape: encoder.conv_in.conv.weight"):
        AC.load_ltx2_audio_vae(tmp_path / "ltx.safetensors", config=replace(TINY_AUDIO_VAE, ch=16, z_channels=4))
    with pytest.raises(WeightsError, match="unknown LTX-2 vocoder preset 'ltx3'; valid: ltx2, ltx2.3, tiny, tiny-bwe"):
        AC.load_ltx2_vocoder("preset:ltx3")
