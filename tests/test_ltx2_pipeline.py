"""LTX-2 sampling with sound against diffusers' pipelines, through the family record and `video-dit sample`.

Tiny random components of ours (the 2.3-like DiT, the video VAE, the audio VAE and HiFi-GAN vocoder, the v2
connectors over a tiny Gemma 3; every weight and latent statistic moved off its init) are converted to
diffusers' names and assembled into diffusers' `LTX2Pipeline` / `LTX2ImageToVideoPipeline` with the scheduler
diffusers' converter writes (dynamic shifting, terminal 0.1). Both sample the same prompts with the same seed
and settings: the reference's guidance (video CFG 3, audio CFG 7, STG 1 at block 1 of a perturbable
transformer, modality 3, rescale 0.7). Compared: the latents, the frames and the waveform. Image-to-video
runs where diffusers and Lightricks agree (see pipeline.py): the audio->video scale / shift's timestep MLP made
constant, the rescale 0. The diffusers folder, saved, is sampled by `video-dit sample`.
Tolerances are ~15x the errors measured here (float32, CPU, one thread), written beside them.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import av
import helpers
import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

from video_dit.cli import main as cli
from video_dit.diffusion.flow import DYNAMIC_GRID
from video_dit.families import FAMILIES, get_preset, identify
from video_dit.families.ltx2 import FAMILY as LTX2
from video_dit.families.ltx2 import audio_convert as AC
from video_dit.families.ltx2 import text_encoder as TE
from video_dit.families.ltx2.audio_vae import LTX2AudioVAE, audio_latents, audio_tokens
from video_dit.families.ltx2.codec import LTX2AudioCodec
from video_dit.families.ltx2.connectors import LTX2TextConnectors
from video_dit.families.ltx2.convert import ltx2_config_to_diffusers, ltx2_from_diffusers
from video_dit.families.ltx2.dit import LTX2DiT
from video_dit.families.ltx2.pipeline import LTX2Pipeline, ltx2_schedule
from video_dit.families.ltx2.presets import (LTX2_SHIFT, TINY_LTX2_AUDIO, TINY_LTX2_CONNECTORS, TINY_LTX2_DIT,
                                             LTX2Guidance)
from video_dit.families.ltx2.vae import LTX2VideoVAE
from video_dit.families.ltx2.vae_config import LTX2_VAE_TINY
from video_dit.families.ltx2.vae_convert import ltx2_vae_config_to_diffusers, ltx2_vae_to_diffusers
from video_dit.families.ltx2.vocoder import LTX2Vocoder
from video_dit.media import write_video
from video_dit.models.weights import WeightsError
from video_dit.spec import CLI_KEYS, Request, resolve

diffusers = pytest.importorskip("diffusers")
from diffusers.pipelines.ltx2.connectors import LTX2TextConnectors as DiffusersConnectors  # noqa: E402
from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder as DiffusersVocoder  # noqa: E402

FRAMES, HEIGHT, WIDTH, STEPS, SEED, FPS = 9, 64, 96, 3, 7, 24.0  # 2 x 2 x 3 video tokens, 9 audio latents
PROMPT, NEGATIVE = "a red ball bounces on a drum", "blurry"
GUIDANCE = dict(guidance_scale=3.0, stg_scale=1.0, modality_scale=3.0, guidance_rescale=0.7, audio_guidance_scale=7.0,
                audio_stg_scale=1.0, audio_modality_scale=3.0, audio_guidance_rescale=0.7,
                spatio_temporal_guidance_blocks=[1])
OURS = LTX2Guidance(stg_blocks=(1,), audio_stg_blocks=(1,))  # the same, STG at the tiny DiT's block 1
# measured (float32, one thread): t2v latents video 1.6e-6 / audio 1.4e-6 relative, i2v 7.0e-7 / 1.1e-6;
# frames 1.8e-6 absolute (of [0, 1]); waveform 3.0e-7 (t2v), 3.6e-7 (i2v), 6.6e-7 (video-dit sample) relative.
# ~12-15x the largest:
LATENT_RTOL, FRAME_ATOL, WAVE_RTOL = 2e-5, 3e-5, 1e-5


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def _perturbed(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Every parameter moved off its seeded init, the latent statistics not identity."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
        for name, b in module.named_buffers():
            if name.endswith("mean-of-means"):
                b.copy_(0.3 * torch.randn(b.shape, generator=g))
            elif name.endswith("std-of-means"):
                b.copy_(0.5 + torch.rand(b.shape, generator=g))
    return module.eval()


def _dit_from(transformer) -> LTX2DiT:
    with torch.device("meta"):
        dit = LTX2DiT(TINY_LTX2_DIT)
    dit.load_state_dict(ltx2_from_diffusers(transformer.state_dict()), assign=True)
    return dit.eval()


@pytest.fixture(scope="module")
def parts():
    """Ours and diffusers' LTX2Pipeline over the same weights."""
    transformer = diffusers.LTX2VideoTransformer3DModel(**ltx2_config_to_diffusers(TINY_LTX2_DIT),
                                                        perturbed_attn=True).eval()
    helpers.randomize_all(transformer, seed=3, norm_std=0.2, vector_std=0.1)
    vae = _perturbed(LTX2VideoVAE(LTX2_VAE_TINY, seed=1), 1)
    ref_vae = diffusers.AutoencoderKLLTX2Video(**ltx2_vae_config_to_diffusers(LTX2_VAE_TINY)).eval()
    ref_vae.load_state_dict(ltx2_vae_to_diffusers(vae.state_dict()))
    audio_vae = _perturbed(LTX2AudioVAE(TINY_LTX2_AUDIO.vae, seed=2), 2)
    ref_audio_vae = diffusers.AutoencoderKLLTX2Audio(**AC.audio_vae_config_to_diffusers(audio_vae.config)).eval()
    ref_audio_vae.load_state_dict(AC.audio_vae_to_diffusers(audio_vae.state_dict()))
    vocoder = _perturbed(LTX2Vocoder(TINY_LTX2_AUDIO.vocoder, seed=4), 4)
    ref_vocoder = DiffusersVocoder(**AC.vocoder_config_to_diffusers(vocoder.config)).eval()
    ref_vocoder.load_state_dict(AC.vocoder_to_diffusers(vocoder.state_dict()))
    connectors = _perturbed(LTX2TextConnectors(TINY_LTX2_CONNECTORS, seed=5), 5)
    ref_connectors = DiffusersConnectors(**AC.connectors_config_to_diffusers(connectors.config)).eval()
    ref_connectors.load_state_dict(AC.connectors_to_diffusers(connectors.state_dict()))
    gemma = TE.tiny_gemma3(seed=0)
    # diffusers' converter's scheduler (scripts/convert_ltx2_to_diffusers.py, non-distilled)
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_shift=0.95, max_shift=2.05,
                                                          base_image_seq_len=1024, max_image_seq_len=4096,
                                                          shift_terminal=0.1)
    pipe = diffusers.LTX2Pipeline(scheduler=scheduler, vae=ref_vae, audio_vae=ref_audio_vae, text_encoder=gemma,
                                  tokenizer=TE.tiny_gemma3_tokenizer(), connectors=ref_connectors,
                                  transformer=transformer, vocoder=ref_vocoder)
    pipe.set_progress_bar_config(disable=True)
    encoder = TE.LTX2PromptEncoder(TE.LTX2TextEncoder(gemma.model.language_model, TE.tiny_gemma3_tokenizer(), 32),
                                   connectors)
    ours = LTX2Pipeline(_dit_from(transformer), vae, LTX2AudioCodec(audio_vae, vocoder), guidance=OURS)
    return pipe, ours, encoder.encode([PROMPT, NEGATIVE])


def _reference(pipe, output_type: str, **kw):
    args = dict(prompt=PROMPT, negative_prompt=NEGATIVE, height=HEIGHT, width=WIDTH, num_frames=FRAMES, frame_rate=FPS,
                num_inference_steps=STEPS, return_dict=False, output_type=output_type,
                generator=torch.Generator().manual_seed(SEED), **{**GUIDANCE, "max_sequence_length": 32, **kw})
    with torch.no_grad():
        return pipe(**args)


def _ours(ours, embeds, **kw):
    return ours.generate_latents(embeds[0], embeds[1], FRAMES, HEIGHT, WIDTH, STEPS, 3.0, grid=DYNAMIC_GRID, fps=FPS,
                                 generator=torch.Generator().manual_seed(SEED), **kw)


def _unnormalized(ours, video, audio):
    """Our normalized latents as diffusers' `output_type="latent"` returns them (VAE units)."""
    codec = ours.audio_codec
    tokens = codec.vae.per_channel_statistics.denormalize(audio_tokens(audio))
    return ours.vae.denormalize(video), audio_latents(tokens, codec.vae.config.z_channels)


def _frames(ours, video) -> np.ndarray:
    with torch.no_grad():
        pixels = ours.vae.decode(ours.vae.denormalize(video))
    return (pixels / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 4, 1).numpy()  # diffusers' "np" output


def test_t2v_latents_frames_and_waveform_equal_diffusers(parts):
    pipe, ours, embeds = parts
    video, audio = _ours(ours, embeds)
    ref_video, ref_audio = _reference(pipe, "latent")
    got = _unnormalized(ours, video, audio)
    errors = {"video": _rel(got[0], ref_video), "audio": _rel(got[1], ref_audio)}
    frames, ref_frames_wave = _frames(ours, video), _reference(pipe, "np")
    ref_frames, ref_wave = ref_frames_wave
    wave = ours.decode_audio(audio)[0]
    errors.update(frames=float(np.abs(frames - ref_frames).max()), wave=_rel(wave, ref_wave[0]))
    print(f"\nt2v vs diffusers: {errors}")
    assert max(errors["video"], errors["audio"]) < LATENT_RTOL, errors
    assert errors["frames"] < FRAME_ATOL and errors["wave"] < WAVE_RTOL, errors
    assert frames.shape == (1, FRAMES, HEIGHT, WIDTH, 3) and float(np.std(ref_frames)) > 0.05
    # 9 frames at 24 fps: 0.375 s -> round(9.375) = 9 audio latents -> 4 x 9 - 3 = 33 mel frames x hop 80 samples
    assert tuple(wave.shape) == (2, 33 * 80) and float(wave.abs().max()) > 1e-3


def test_i2v_latents_and_waveform_equal_diffusers(parts):
    """Image-to-video where the two references agree: the audio->video scale / shift made independent of the
    timestep (diffusers' pipelines take it from the audio's sigma, ltx-core from each video token's own, 0 on
    the first frame's) and no rescale (diffusers' x0 of a first-frame token uses the step's sigma, Lightricks'
    its own 0: only the rescale's statistics read it). The first frame goes through the H.264 CRF 33 both apply."""
    pipe, ours, embeds = parts
    image = Image.fromarray(np.random.default_rng(3).integers(0, 256, (HEIGHT, WIDTH, 3), dtype=np.uint8))
    transformer = pipe.transformer
    saved = transformer.av_cross_attn_video_scale_shift.emb.timestep_embedder.linear_2.weight.clone()
    with torch.no_grad():
        transformer.av_cross_attn_video_scale_shift.emb.timestep_embedder.linear_2.weight.zero_()
    dit, guidance = ours.dit, ours.guidance
    try:
        ours.dit, ours.guidance = _dit_from(transformer), replace(OURS, rescale=0.0, audio_rescale=0.0)
        video, audio = _ours(ours, embeds, first_frame=image)
        i2v = diffusers.LTX2ImageToVideoPipeline(**pipe.components)
        i2v.set_progress_bar_config(disable=True)
        ref_video, ref_audio = _reference(i2v, "latent", image=image, guidance_rescale=0.0, audio_guidance_rescale=0.0)
        _, ref_wave = _reference(i2v, "np", image=image, guidance_rescale=0.0, audio_guidance_rescale=0.0)
    finally:
        with torch.no_grad():
            transformer.av_cross_attn_video_scale_shift.emb.timestep_embedder.linear_2.weight.copy_(saved)
        ours.dit, ours.guidance = dit, guidance
    got = _unnormalized(ours, video, audio)
    errors = {"video": _rel(got[0], ref_video), "audio": _rel(got[1], ref_audio),
              "wave": _rel(ours.decode_audio(audio)[0], ref_wave[0])}
    print(f"\ni2v vs diffusers: {errors}")
    assert max(errors["video"], errors["audio"]) < LATENT_RTOL and errors["wave"] < WAVE_RTOL, errors
    t2v = _unnormalized(ours, *_ours(ours, embeds))[0]
    assert _rel(t2v[:, :, :1], ref_video[:, :, :1]) > 0.05  # the first frame conditions the video


def test_parity_could_fail(parts):
    """Siblings that must fail the t2v measure: Lightricks' schedule instead of the folder's dynamic one, another
    frame rate (the positions and the sound's length), STG or the modality pass left out, another seed's noise."""
    pipe, ours, embeds = parts
    ref_video, ref_audio = _reference(pipe, "latent")
    guidance = ours.guidance
    failing = {}
    for name, kw, change in (("reference grid", dict(grid="reference"), None), ("fps 25", dict(fps=25.0), None),
                             ("no STG", {}, dict(stg=0.0)), ("no modality", {}, dict(modality=1.0, audio_modality=1.0)),
                             ("seed", dict(generator=torch.Generator().manual_seed(SEED + 1)), None)):
        ours.guidance = replace(OURS, **change) if change else OURS
        args = {**dict(grid=DYNAMIC_GRID, fps=FPS, generator=torch.Generator().manual_seed(SEED)), **kw}
        video, audio = ours.generate_latents(embeds[0], embeds[1], FRAMES, HEIGHT, WIDTH, STEPS, 3.0, **args)
        got = _unnormalized(ours, video, audio)
        failing[name] = max(_rel(got[0], ref_video), _rel(got[1], ref_audio))
    ours.guidance = guidance
    print(f"\nfailing siblings: {failing}")
    assert min(failing.values()) > 100 * LATENT_RTOL, failing


def test_schedule_grids():
    """grid "diffusers-dynamic" is diffusers' scheduler bit for bit at every token count; Lightricks' grid
    ("reference") is the same line evaluated at 4096 tokens (within float32 rounding); both start at 1 and end
    their non-zero sigmas at the terminal 0.1."""
    from diffusers.pipelines.ltx2.pipeline_ltx2 import calculate_shift

    for tokens in (12, 1024, 4096, 6144):
        ref = diffusers.FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_shift=0.95, max_shift=2.05,
                                                        base_image_seq_len=1024, max_image_seq_len=4096,
                                                        shift_terminal=0.1)
        ref.set_timesteps(sigmas=np.linspace(1.0, 1 / 30, 30), mu=calculate_shift(tokens, 1024, 4096, 0.95, 2.05))
        ours = ltx2_schedule(30, LTX2_SHIFT, grid=DYNAMIC_GRID, tokens=tokens)
        assert torch.equal(ours.sigmas, ref.sigmas) and torch.equal(ours.timesteps, ref.timesteps), tokens
    reference = ltx2_schedule(30, LTX2_SHIFT)
    at_4096 = ltx2_schedule(30, LTX2_SHIFT, grid=DYNAMIC_GRID, tokens=4096)
    torch.testing.assert_close(reference.sigmas, at_4096.sigmas, rtol=0, atol=2e-7)
    assert (reference.sigmas - ltx2_schedule(30, LTX2_SHIFT, grid=DYNAMIC_GRID, tokens=1024).sigmas).abs().max() > 0.01
    # (ltx-core's torch float32 arithmetic gives 1 - 2^-24 for the first: e / tensor(e) as a reciprocal times e)
    assert abs(float(reference.sigmas[0]) - 1) < 1e-7 and abs(float(reference.sigmas[-2]) - 0.1) < 1e-6
    assert reference.sigmas[-1] == 0 and reference.timesteps.shape == (30,)
    with pytest.raises(ValueError, match="shifts by the video token count"):
        ltx2_schedule(30, LTX2_SHIFT, grid=DYNAMIC_GRID)
    with pytest.raises(ValueError, match="accepted: euler"):
        ltx2_schedule(30, LTX2_SHIFT, solver="unipc")


@pytest.fixture(scope="module")
def folder(parts, tmp_path_factory):
    pipe, _, _ = parts
    out = tmp_path_factory.mktemp("ltx2_diffusers")
    pipe.save_pretrained(out)
    return out


def test_sample_command_gives_diffusers_frames_and_waveform(parts, folder, tmp_path, capsys):
    """`video-dit sample --model FOLDER` reads the folder's dynamic-shifting scheduler, loads every part from the
    folder (Gemma 3 + connectors, DiT, VAE, audio VAE + vocoder), samples with the variant's guidance and writes
    the MP4 with its AAC track: the bytes of our API's frames and waveform written alike, which equal
    diffusers' (with the reference's defaults: STG at block 28, none in a 2-block DiT). --no-audio: no track."""
    pipe, _, _ = parts
    args = ["sample", "--model", str(folder), "--prompt", PROMPT, "--negative", NEGATIVE, "--frames", str(FRAMES),
            "--height", str(HEIGHT), "--width", str(WIDTH), "--steps", str(STEPS), "--cfg", "3", "--seed", str(SEED)]
    assert cli(args + ["--out", str(tmp_path / "cli.mp4")]) == 0
    out = capsys.readouterr().out
    assert f"shift {LTX2_SHIFT:g}" in out and f"solver, shift: {folder / 'scheduler' / 'scheduler_config.json'}" in out
    assert "sound 2 x 2640 at 8000 Hz" in out
    spec = resolve(Request(str(folder), preset_required=False), CLI_KEYS)
    assert spec.family is LTX2 and spec.audio == str(folder) and spec.dit_config == TINY_LTX2_DIT
    ours = LTX2.pipeline(LTX2.load_dit(str(folder)).eval(), LTX2.load_vae(str(folder)).eval(),
                         audio_codec=LTX2.audio.load_codec(str(folder)).eval())
    embeds = LTX2.load_text_encoder(str(folder)).encode([PROMPT, NEGATIVE])
    frames, wave = ours.generate_with_audio(embeds[0], embeds[1], FRAMES, HEIGHT, WIDTH, STEPS, 3.0, grid=DYNAMIC_GRID,
                                            generator=torch.Generator().manual_seed(SEED))
    write_video(frames, tmp_path / "api.mp4", fps=24, audio=wave, audio_rate=8000)
    assert (tmp_path / "cli.mp4").read_bytes() == (tmp_path / "api.mp4").read_bytes()
    with av.open(str(tmp_path / "cli.mp4")) as container:
        assert [(s.type, getattr(s, "rate", None)) for s in container.streams] == [("video", None), ("audio", 8000)]

    ref_frames, ref_wave = _reference(pipe, "np", max_sequence_length=1024, spatio_temporal_guidance_blocks=[28])
    got = np.stack([np.asarray(f, dtype=np.float32) / 255 for f in frames])[None]
    errors = {"frames (uint8)": float(np.abs(got - ref_frames).max()), "wave": _rel(wave, ref_wave[0])}
    with capsys.disabled():
        print(f"\nvideo-dit sample vs diffusers: {errors}")
    assert errors["frames (uint8)"] <= 1 / 255 + FRAME_ATOL and errors["wave"] < WAVE_RTOL, errors  # PIL rounds
    assert cli(args + ["--no-audio", "--out", str(tmp_path / "silent.mp4")]) == 0
    with av.open(str(tmp_path / "silent.mp4")) as container:
        assert [s.type for s in container.streams] == ["video"]
    capsys.readouterr()


def _single_file(path, parts, config: dict | None):
    """A Lightricks-style single file of the tiny model: every part under its prefix, the config in the metadata."""
    _, ours, _ = parts
    sd = {"model.diffusion_model." + k: v for k, v in ours.dit.state_dict().items()}
    sd.update({"vae." + k: v for k, v in ours.vae.state_dict().items()})
    sd.update(AC.audio_vae_to_original(ours.audio_codec.vae.state_dict()))
    sd.update({"vocoder." + k: v for k, v in ours.audio_codec.vocoder.state_dict().items()})
    save_file({k: v.contiguous() for k, v in sd.items()}, path,
              metadata={"config": json.dumps(config)} if config is not None else None)
    return path


def test_single_file_layout_loads_each_part_and_names_wrong_keys(parts, tmp_path):
    """Lightricks' single file: identified as LTX-2 by its DiT's tensor names, its DiT config from the metadata,
    each part read alone; a DiT file with a foreign key is refused naming the file and the key."""
    _, ours, _ = parts
    cfg = {k: list(v) if isinstance(v, tuple) else v for k, v in TINY_LTX2_DIT.__dict__.items()}
    a, v = TINY_LTX2_AUDIO.vae, TINY_LTX2_AUDIO.vocoder
    audio_vae = {"model": {"params": {"sampling_rate": a.sample_rate, "ddconfig": {
        "ch": a.ch, "ch_mult": list(a.ch_mult), "num_res_blocks": a.num_res_blocks, "attn_resolutions": [],
        "z_channels": a.z_channels, "mel_bins": a.mel_bins, "resolution": a.resolution,
        "mid_block_add_attention": False}}}, "preprocessing": {"stft": {"hop_length": a.mel_hop_length}}}
    vocoder = {"upsample_initial_channel": v.upsample_initial_channel, "upsample_rates": list(v.upsample_rates),
               "upsample_kernel_sizes": list(v.upsample_kernel_sizes),
               "resblock_kernel_sizes": list(v.resblock_kernel_sizes),
               "resblock_dilation_sizes": [list(d) for d in v.resblock_dilation_sizes],
               "output_sampling_rate": v.output_sampling_rate}
    path = _single_file(tmp_path / "ltx-tiny.safetensors", parts,
                        {"transformer": cfg, "audio_vae": audio_vae, "vocoder": vocoder})
    assert identify(path)[0] is LTX2
    assert LTX2.dit_config(str(path)) == TINY_LTX2_DIT
    dit = LTX2.load_dit(str(path))
    assert all(torch.equal(a, b) for a, b in zip(dit.state_dict().values(), ours.dit.state_dict().values()))
    vae = LTX2.load_vae(LTX2.folder_source(path, "vae"), config=LTX2_VAE_TINY)
    assert all(torch.equal(vae.state_dict()[k], v) for k, v in ours.vae.state_dict().items())
    codec = LTX2.audio.load_codec(LTX2.folder_source(path, "audio"))
    assert all(torch.equal(codec.state_dict()[k], v) for k, v in ours.audio_codec.state_dict().items())
    assert LTX2.folder_source(path, "text_encoder") is None  # the Gemma is never in it: GEMMA::FILE
    bad = dict(ours.dit.state_dict())
    bad["transformer_blocks.0.attn1.to_qq.weight"] = bad.pop("transformer_blocks.0.attn1.to_q.weight")
    save_file({k: v.contiguous() for k, v in bad.items()}, tmp_path / "bad.safetensors")
    with pytest.raises(WeightsError, match=r"bad\.safetensors.*transformer_blocks\.0\.attn1\.to_qq\.weight"):
        LTX2.load_dit(str(tmp_path / "bad.safetensors"), config=TINY_LTX2_DIT)


def test_codec_shapes_and_training_record(parts):
    """The codec's latent length is the references' round(frames / fps x 25); its encode reads a waveform of
    any rate and channel count; the training record's conditioning is replace mode with per-token timesteps in the DiT's
    token order, its text inputs the DiT's keywords."""
    _, ours, embeds = parts
    codec = ours.audio_codec
    assert codec.latent_shape(121, 24.0) == (2, round(121 / 24 * 16000 / 160 / 4), 4) == (2, 126, 4)
    wave = torch.sin(torch.linspace(0, 300, 12000)).expand(1, 2, -1) * 0.5  # 0.75 s at 16 kHz
    assert codec.encode(wave).shape == (1, 2, 19, 4)  # 12000 // 160 + 1 = 76 mel frames -> (76 - 1) // 4 + 1
    assert codec.encode(wave[:, :1, ::2], rate=8000).shape == (1, 2, 19, 4)  # mono at 8 kHz: stereo, resampled
    cond = LTX2.training.conditioning("replace", TINY_LTX2_DIT.patch_size, None, False)
    x = torch.randn(2, 8, 2, 2, 3)
    _, t, loss_mask = cond.apply(x, torch.tensor([500.0, 200.0]), {"first_frame_latents": torch.zeros(2, 8, 1, 2, 3)})
    assert t.shape == (2, 12) and t[:, :6].eq(0).all() and t[0, 6:].eq(500).all() and loss_mask[:, :, 0].eq(0).all()
    entries = [LTX2.training.text_entry(e) for e in embeds]
    context, kwargs = LTX2.training.text_inputs({k: [e[k] for e in entries] for k in entries[0]}, "cpu", TINY_LTX2_DIT)
    with torch.no_grad():
        v, a = ours.dit(x, t, context, audio=torch.randn(2, 2, 9, 4), audio_timestep=torch.tensor([500.0, 200.0]),
                        **kwargs)
    assert v.shape == x.shape and a.shape == (2, 2, 9, 4) and kwargs["video_context_mask"] is None
    assert LTX2.audio.timesteps == "tied" and LTX2.audio.loss_weight == 1.0 and set(FAMILIES) >= {"ltx2"}
    assert get_preset("tiny-ltx2-t2v").vae.snap_frames(12) == 9


def test_bad_input_is_named(parts, tmp_path):
    _, ours, embeds = parts
    with pytest.raises(ValueError, match="needs negative embeds"):
        ours.generate(embeds[0], None, FRAMES, HEIGHT, WIDTH, STEPS, 3.0)
    with pytest.raises(ValueError, match="pass audio_codec="):
        LTX2Pipeline(ours.dit, ours.vae, None)
    with pytest.raises(WeightsError, match="never random-initialised"):
        LTX2.audio.load_codec("preset:ltx2.3-22b-dev")
    rc = cli(["sample", "--model", "preset:tiny-ltx2-t2v", "--prompt", "x", "--out", str(tmp_path / "x.gif")])
    assert rc == 2
    shutil.rmtree(tmp_path, ignore_errors=True)


def test_dynamic_scheduler_config_is_read_and_refused_where_it_cannot_be_sampled(folder, tmp_path):
    """A diffusers LTX-2 folder's dynamic-shifting scheduler: Euler, the shift at 4096 tokens exp(max_shift), grid
    `DYNAMIC_GRID`; an anchor the grid does not implement is refused naming the file and key; a family without
    the grid refuses the folder's shift rather than sampling it statically."""
    from video_dit.diffusion.sampling_settings import read_scheduler_config, resolve_sampling

    config = read_scheduler_config(folder)
    assert (config.solver, config.grid) == ("euler", DYNAMIC_GRID) and abs(config.shift - LTX2_SHIFT) < 1e-12
    settings = resolve_sampling(None, config, family=LTX2)
    assert settings.grid == DYNAMIC_GRID and "shifted by the token count" in settings.describe()
    with pytest.raises(ValueError, match="use_dynamic_shifting = True .* is not one Wan 2.1 / 2.2 samples"):
        resolve_sampling(None, config, family=FAMILIES["wan"])
    assert resolve_sampling(None, config, {"shift": (5.0, "--shift")}, family=FAMILIES["wan"]).grid == "reference"
    data = json.loads((folder / "scheduler" / "scheduler_config.json").read_text())
    (tmp_path / "scheduler").mkdir()
    (tmp_path / "scheduler" / "scheduler_config.json").write_text(json.dumps({**data, "base_shift": 0.5}))
    with pytest.raises(ValueError, match=r"scheduler_config.json: base_shift = 0.5 is not supported"):
        read_scheduler_config(tmp_path)


def test_comfyui_dit_file_and_lora_keys(parts, tmp_path):
    """ComfyUI's DiT file (Lightricks' names under `diffusion_model.`) is identified and loaded as the same
    weights; a LoRA in ComfyUI's LTX-2 keys (`diffusion_model.<Lightricks module>.lora_A.weight`, `.alpha`) reads
    back to the adapters written, a diffusers-named one (`transformer.proj_in`) to the native module, and one on a
    module the DiT lacks is named."""
    from video_dit.lora import from_comfy

    _, ours, _ = parts
    save_file({"diffusion_model." + k: v.contiguous() for k, v in ours.dit.state_dict().items()},
              tmp_path / "comfy.safetensors")
    assert identify(tmp_path / "comfy.safetensors")[0] is LTX2
    loaded = LTX2.load_dit(str(tmp_path / "comfy.safetensors"), config=TINY_LTX2_DIT)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in ours.dit.state_dict().items())
    g = torch.Generator().manual_seed(0)
    native = {"transformer_blocks.1.audio_to_video_attn.to_q.lora_A.weight": torch.randn(4, 32, generator=g),
              "transformer_blocks.1.audio_to_video_attn.to_q.lora_B.weight": torch.randn(16, 4, generator=g)}
    file = LTX2.lora_to_comfy(native, 2.0)
    assert set(file) == {"diffusion_model.transformer_blocks.1.audio_to_video_attn.to_q." + leaf
                         for leaf in ("lora_A.weight", "lora_B.weight", "alpha")}
    back, alpha, rank = from_comfy(file, "x", from_file=LTX2.lora_from_file)
    assert alpha == 2.0 and rank == 4 and back.keys() == native.keys()
    diffusers_named = {"transformer.proj_in.lora_A.weight": torch.zeros(4, 8), "transformer.proj_in.lora_B.weight":
                       torch.zeros(32, 4)}
    assert set(from_comfy(diffusers_named, "y", from_file=LTX2.lora_from_file)[0]) == {
        "patchify_proj.lora_A.weight", "patchify_proj.lora_B.weight"}
    with pytest.raises(WeightsError, match="z.safetensors: LoRA on 1 modules an LTX-2 DiT does not have, first: "
                                           "transformer_blocks.0.attn3.to_q"):
        from_comfy({"diffusion_model.transformer_blocks.0.attn3.to_q.lora_A.weight": torch.zeros(4, 32)},
                   "z.safetensors", from_file=LTX2.lora_from_file)
