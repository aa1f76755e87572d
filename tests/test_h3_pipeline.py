"""MiniMax H3 sampling with sound against diffusers' modular pipeline, through the family record and `video-dit sample`.

Tiny random components (the tiny DiT, video VAE and audio VAE with every weight moved off its init and latent
statistics that are not identity; the tiny seeded Qwen3-VL) are given to diffusers' `MiniMaxH3Blocks` pipeline and,
converted, to ours. Both sample the same prompt with the same seed: t2va, and fl2va with a first keyframe, a last
one, or both (the keyframes of another aspect ratio than the canvas, so the stretch and the cover-crop act).
Compared: the latents of both streams, the frames and the waveform. 124 frames (5.2 s) is the shortest request
diffusers takes; a 32 x 32 canvas is 8 x 8 latent cells (the tiny VAE is 4x). The diffusers folder, saved, is
sampled by `video-dit sample`. Tolerances are ~15x the errors measured here (float32, CPU, one thread).
"""

from __future__ import annotations

import json
from dataclasses import replace

import av
import helpers
import numpy as np
import pytest
import torch
from PIL import Image

from video_dit.cli import main as cli
from video_dit.families import FAMILIES, get_preset, identify
from video_dit.families.minimax_h3 import FAMILY as H3
from video_dit.families.minimax_h3.audio_config import H3_AUDIO_VAE_TINY
from video_dit.families.minimax_h3.audio_vae import H3AudioVAE, h3_audio_config_to_diffusers
from video_dit.families.minimax_h3.codec import H3AudioCodec
from video_dit.families.minimax_h3.convert import h3_config_to_diffusers, h3_from_diffusers
from video_dit.families.minimax_h3.dit import H3DiT
from video_dit.families.minimax_h3.encoders import (tiny_h3_text_encoder, tiny_qwen3vl, tiny_qwen3vl_image_processor,
                                                    tiny_qwen3vl_tokenizer)
from video_dit.families.minimax_h3.pipeline import H3Pipeline, fit_keyframes, h3_schedule
from video_dit.families.minimax_h3.presets import AUDIO_SHIFT, TINY_DIT, VIDEO_SHIFT, audio_timesteps
from video_dit.families.minimax_h3.vae import H3VideoVAE
from video_dit.families.minimax_h3.vae_config import H3_VAE_TINY
from video_dit.families.minimax_h3.vae_convert import h3_vae_config_to_diffusers, h3_vae_to_native
from video_dit.media import write_video
from video_dit.spec import CLI_KEYS, Request, resolve

diffusers = pytest.importorskip("diffusers")
from transformers import Qwen3VLProcessor  # noqa: E402

from diffusers.modular_pipelines import MiniMaxH3Blocks  # noqa: E402

FRAMES, HEIGHT, WIDTH, STEPS, SEED = 124, 32, 32, 3, 7  # diffusers' num_inference_steps: STEPS + 1 grid points
PROMPT = "a red ball bounces on a drum"
VAE = replace(H3_VAE_TINY, latents_mean=(0.3, -0.2, 0.1, 0.5), latents_std=(1.5, 0.7, 1.1, 2.0))
AUDIO = replace(H3_AUDIO_VAE_TINY, latents_mean=(0.2, -0.1, 0.0, 0.3, -0.4, 0.1, 0.05, -0.2),
                latents_std=(1.2, 0.8, 1.5, 0.6, 1.0, 2.0, 0.9, 1.1))
TASKS = {"t2va": (), "first": ("first",), "last": ("last",), "first_and_last": ("first", "last")}
# measured (float32, one thread): latents video <= 1.7e-7 / audio <= 1.8e-7 relative over the four tasks; frames
# <= 2.7e-7 absolute (of [0, 1]); waveform <= 4.7e-7 relative; ~15x the largest:
LATENT_RTOL, FRAME_ATOL, WAVE_RTOL = 3e-6, 4e-6, 7e-6


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def _moved(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Every parameter moved off its init (the zero-initialised scales and heads would hide the networks)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return module.eval()


def _processor():
    """transformers' `Qwen3VLProcessor` without its video processor (which needs torchvision, not installed here):
    the blocks use its image processor and `create_mm_token_type_ids` only (as tests/test_h3_text.py)."""
    processor = Qwen3VLProcessor.__new__(Qwen3VLProcessor)
    tokenizer = tiny_qwen3vl_tokenizer()
    processor.tokenizer, processor.image_processor = tokenizer, tiny_qwen3vl_image_processor()
    processor.image_token_id = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    processor.video_token_id = tokenizer.convert_tokens_to_ids("<|video_pad|>")
    return processor


def _keyframes() -> dict:
    """A first keyframe wider than the canvas (stretched) and a last one taller (cover-cropped when it follows)."""
    rng = np.random.default_rng(0)
    return {"first": Image.fromarray((rng.random((24, 40, 3)) * 255).astype("uint8")),
            "last": Image.fromarray((rng.random((44, 28, 3)) * 255).astype("uint8"))}


@pytest.fixture(scope="module")
def parts():
    """diffusers' pipeline and ours over the same weights, and our conditioner."""
    transformer = diffusers.MiniMaxH3Transformer3DModel(**h3_config_to_diffusers(TINY_DIT)).eval()
    helpers.randomize_all(transformer, seed=3, norm_std=0.2, vector_std=0.1)
    torch.manual_seed(0)
    ref_vae = _moved(diffusers.AutoencoderKLMiniMaxH3(**h3_vae_config_to_diffusers(VAE)), 1)
    vae = H3VideoVAE(VAE)
    vae.load_state_dict(h3_vae_to_native(ref_vae.state_dict(), VAE)[0])
    ref_audio = _moved(diffusers.AutoencoderKLMiniMaxH3Audio(**h3_audio_config_to_diffusers(AUDIO)), 2)
    audio_vae = H3AudioVAE(AUDIO)
    audio_vae.load_state_dict(ref_audio.state_dict())
    with torch.device("meta"):
        dit = H3DiT(TINY_DIT)
    dit.load_state_dict(h3_from_diffusers(transformer.state_dict()), assign=True)
    pipe = MiniMaxH3Blocks().init_pipeline()
    pipe.update_components(text_encoder=tiny_qwen3vl(0), tokenizer=tiny_qwen3vl_tokenizer(), processor=_processor(),
                           vae=ref_vae, audio_vae=ref_audio, transformer=transformer,
                           scheduler=diffusers.MiniMaxH3Scheduler(shift=VIDEO_SHIFT),
                           audio_scheduler=diffusers.MiniMaxH3Scheduler(shift=AUDIO_SHIFT))
    pipe.set_progress_bar_config(disable=True)
    ours = H3Pipeline(dit.eval(), vae.eval(), H3AudioCodec(audio_vae.eval()))
    return pipe, ours, tiny_h3_text_encoder(0)


def _reference(pipe, anchors=(), **kw):
    frames = _keyframes()
    keys = {"first": "image", "last": "last_image"}
    args = {**dict(prompt=PROMPT, generator=torch.Generator().manual_seed(SEED), num_inference_steps=STEPS + 1,
                   height=HEIGHT, width=WIDTH, num_frames=FRAMES, output_type="pt",
                   output=["latents", "audio_latents", "videos", "audio"]), **{keys[a]: frames[a] for a in anchors},
            **kw}
    with torch.no_grad():
        return pipe(**args)


def _ours(ours, encoder, anchors=(), images=None, **kw):
    """Our latents of the request; `images`: {anchor: image} instead of `_keyframes()`'s for `anchors`."""
    frames = _keyframes()
    given = {f"{a}_frame": img for a, img in (images or {a: frames[a] for a in anchors}).items()}
    shown, _ = fit_keyframes(given.get("first_frame"), given.get("last_frame"), HEIGHT, WIDTH)
    (embeds,) = encoder.encode([PROMPT], images=[shown] if shown else None)
    args = {**dict(num_frames=FRAMES, height=HEIGHT, width=WIDTH, steps=STEPS,
                   generator=torch.Generator().manual_seed(SEED)), **given, **kw}
    return ours.generate_latents(embeds, **args)


def _pixels(ours, video) -> torch.Tensor:
    """Our latents decoded as diffusers' "pt" output: (B, F, 3, H, W) in [0, 1]."""
    with torch.no_grad():
        return ((ours.vae.decode(ours.vae.denormalize(video)) + 1) / 2).clamp(0, 1).transpose(1, 2)


@pytest.mark.parametrize("task", list(TASKS))
def test_latents_frames_and_waveform_equal_diffusers(parts, task):
    pipe, ours, encoder = parts
    anchors = TASKS[task]
    video, audio = _ours(ours, encoder, anchors)
    ref = _reference(pipe, anchors)
    errors = {"video": _rel(video, ref["latents"]), "audio": _rel(audio[0], ref["audio_latents"]),
              "frames": float((_pixels(ours, video) - ref["videos"]).abs().max()),
              "wave": _rel(ours.decode_audio(audio)[0], ref["audio"][0])}
    print(f"\n{task} vs diffusers: {errors}")
    assert max(errors["video"], errors["audio"]) < LATENT_RTOL, errors
    assert errors["frames"] < FRAME_ATOL and errors["wave"] < WAVE_RTOL, errors
    # 124 frames at 24 fps: round(124 / 24 x 40) = 207 audio latents of 4 samples per channel (the tiny VAE's hop)
    assert ref["videos"].shape == (1, FRAMES, 3, HEIGHT, WIDTH) and ref["audio"].shape == (1, 2, 207 * 4)
    assert float(ref["videos"].std()) > 0.05 and float(ref["audio"].abs().max()) > 1e-3


def test_parity_could_fail(parts):
    """Siblings that must fail the fl2va (first and last) measure: another seed; the audio stepped on the video's
    shift; the keyframes given the other way round (first as last); diffusers' step count taken as ours (one
    evaluation more). Measured: 1.7, 0.33, 2.5e-3, 0.17 (>= 800x LATENT_RTOL). (Holding the keyframes clean, at
    t = 1 instead of 0.999, moves the tiny model's latents by 4.6e-6 only: not a sibling that shows.) A prompt
    presented without its keyframes is refused: the reference always presents them."""
    pipe, ours, encoder = parts
    anchors = TASKS["first_and_last"]
    ref = _reference(pipe, anchors)
    frames = _keyframes()

    def error(**kw):
        video, audio = _ours(ours, encoder, anchors, **kw)
        return max(_rel(video, ref["latents"]), _rel(audio[0], ref["audio_latents"]))

    failing = {"seed": error(generator=torch.Generator().manual_seed(SEED + 1)),
               "steps + 1": error(steps=STEPS + 1),
               "swapped": error(images={"first": frames["last"], "last": frames["first"]})}
    ours.audio_shift = VIDEO_SHIFT
    failing["audio shift 12"] = error()
    ours.audio_shift = AUDIO_SHIFT
    print(f"\nfailing siblings: {failing}")
    assert min(failing.values()) > 100 * LATENT_RTOL, failing
    (alone,) = encoder.encode([PROMPT])
    with pytest.raises(ValueError, match=r"presents 0 image\(s\) .* for 2 keyframe\(s\)"):
        ours.generate_latents(alone, num_frames=FRAMES, height=HEIGHT, width=WIDTH, steps=STEPS, **{
            "first_frame": frames["first"], "last_frame": frames["last"]})


def test_schedules_and_the_audio_coupling():
    """Our grid is diffusers' `MiniMaxH3Scheduler` at steps + 1 points, bit for bit (sigmas, and its timesteps as
    1 - sigma); the training coupling of the audio's noise level to the video's (`audio_timesteps`) is the pairing
    of the two sampling grids' steps (within float32 rounding)."""
    for steps, shift in ((3, VIDEO_SHIFT), (49, VIDEO_SHIFT), (49, AUDIO_SHIFT), (10, 1.0)):
        ref = diffusers.MiniMaxH3Scheduler(shift=shift)
        ref.set_timesteps(steps + 1)
        ours = h3_schedule(steps, shift)
        assert torch.equal(ours.sigmas, ref.sigmas) and torch.equal(1 - ours.sigmas[:-1], ref.timesteps)
        assert ours.steps == steps
    video, audio = h3_schedule(49, VIDEO_SHIFT), h3_schedule(49, AUDIO_SHIFT)
    paired = audio_timesteps(video.timesteps.double())
    # of 0..1000: the float32 video grid near 1 (flat under shift 12) inverted; measured 2.7e-4
    assert (paired - audio.timesteps.double()).abs().max() < 3e-3
    assert (video.timesteps - audio.timesteps).abs().max() > 100  # not the video's own
    with pytest.raises(ValueError, match="accepted: euler"):
        h3_schedule(10, VIDEO_SHIFT, solver="unipc")


@pytest.fixture(scope="module")
def folder(parts, tmp_path_factory):
    """The tiny model as a diffusers folder: model_index.json, transformer/, vae/, audio_vae/, text_encoder/ +
    tokenizer/ + processor/ (the image processor), scheduler/ + audio_scheduler/."""
    pipe, _, _ = parts
    out = tmp_path_factory.mktemp("h3_diffusers")
    (out / "model_index.json").write_text(json.dumps({"_class_name": "MiniMaxH3ModularPipeline"}))
    for name in ("transformer", "vae", "audio_vae", "text_encoder", "tokenizer", "scheduler", "audio_scheduler"):
        getattr(pipe, name).save_pretrained(out / name)
    pipe.processor.image_processor.save_pretrained(out / "processor")
    return out


def test_sample_command_gives_diffusers_frames_and_waveform(parts, folder, tmp_path, capsys):
    """`video-dit sample --model FOLDER --image FIRST` (fl2va) reads the folder's MiniMaxH3Scheduler (shift 12),
    loads every part from the folder, presents the keyframe to the conditioner and writes the MP4 with its AAC
    track: the bytes of our API's frames and waveform written alike, which equal diffusers'."""
    pipe, _, _ = parts
    first = tmp_path / "first.png"
    _keyframes()["first"].save(first)
    args = ["sample", "--model", str(folder), "--prompt", PROMPT, "--frames", str(FRAMES), "--height", str(HEIGHT),
            "--width", str(WIDTH), "--steps", str(STEPS), "--seed", str(SEED), "--image", str(first)]
    assert cli(args + ["--out", str(tmp_path / "cli.mp4")]) == 0
    out = capsys.readouterr().out
    assert f"shift {VIDEO_SHIFT:g}" in out and f"{folder / 'scheduler' / 'scheduler_config.json'}" in out, out
    assert "i2v, 124 frames, 32x32, 24 fps, sound 2 x 828 at 32000 Hz" in out, out
    spec = resolve(Request(str(folder), preset_required=False), CLI_KEYS)
    assert spec.family is H3 and spec.audio == str(folder) and spec.dit_config == TINY_DIT
    ours = H3.pipeline(H3.load_dit(str(folder)).eval(), H3.load_vae(str(folder)).eval(),
                       audio_codec=H3.audio.load_codec(str(folder)).eval())
    image = Image.open(first).convert("RGB")
    shown = H3.prompt_images(image, None, HEIGHT, WIDTH)
    (embeds,) = H3.load_text_encoder(str(folder)).encode([PROMPT], images=[shown])
    frames, wave = ours.generate_with_audio(embeds, num_frames=FRAMES, height=HEIGHT, width=WIDTH, steps=STEPS,
                                            generator=torch.Generator().manual_seed(SEED), first_frame=image)
    write_video(frames, tmp_path / "api.mp4", fps=24, audio=wave, audio_rate=32000)
    assert (tmp_path / "cli.mp4").read_bytes() == (tmp_path / "api.mp4").read_bytes()
    with av.open(str(tmp_path / "cli.mp4")) as container:
        assert [(s.type, getattr(s, "rate", None)) for s in container.streams] == [("video", None), ("audio", 32000)]

    ref = _reference(pipe, ("first",), output_type="np")
    got = np.stack([np.asarray(f, dtype=np.float32) / 255 for f in frames])[None]
    errors = {"frames (uint8)": float(np.abs(got - ref["videos"]).max()), "wave": _rel(wave, ref["audio"][0])}
    with capsys.disabled():
        print(f"\nvideo-dit sample vs diffusers: {errors}")
    assert errors["frames (uint8)"] <= 1 / 255 + FRAME_ATOL and errors["wave"] < WAVE_RTOL, errors  # PIL rounds


def test_registry_codec_and_training_record(parts):
    """The folder's files say MiniMax H3 (its DiT config alone too); the codec's latent length is diffusers'
    round(frames / 24 x 40) and its encode keeps that many (the VAE pads to whole latents); the training record
    caches a caption's rows and gives the DiT a right-padded batch with its mask."""
    _, ours, encoder = parts
    assert set(FAMILIES) >= {"minimax_h3"} and get_preset("tiny-h3").family == "minimax_h3"
    assert H3.claims_config(h3_config_to_diffusers(TINY_DIT)) and not FAMILIES["ltx2"].claims_config(
        h3_config_to_diffusers(TINY_DIT))
    codec = ours.audio_codec
    assert codec.latent_shape(124, 24.0) == (2, 8, 207) and codec.latent_shape(22, 24) == (2, 8, 37)
    wave = torch.sin(torch.linspace(0, 300, 2600)).expand(1, 2, -1) * 0.5  # 81.25 ms at 32 kHz: 3.25 latents
    latents = codec.encode(wave)
    assert latents.shape == (1, 2, 8, 3)  # round(3.25); the tiny VAE (hop 4) made 650
    mean = torch.tensor(AUDIO.latents_mean).view(1, 1, -1, 1)
    std = torch.tensor(AUDIO.latents_std).view(1, 1, -1, 1)
    assert _rel(latents * std + mean, codec.vae.encode(wave).mode()[..., :3]) < 1e-6  # normalized per channel
    assert get_preset("tiny-h3").vae.snap_frames(40) == 39 and get_preset("tiny-h3").vae.latent_frames(39) == 12
    entries = [H3.training.text_entry(e) for e in encoder.encode([PROMPT, "a drum"])]
    context, kwargs = H3.training.text_inputs({"text_embeds": [e["text_embeds"] for e in entries]}, "cpu", TINY_DIT)
    assert context.shape == (2, len(PROMPT), 32) and kwargs["text_mask"].sum(1).tolist() == [len(PROMPT), 6]
    x = torch.randn(2, 4, 7, 4, 4)
    with torch.no_grad():
        v, a = ours.dit(x, torch.tensor([500.0, 200.0]), context, audio=torch.randn(2, 2, 8, 37),
                        audio_timestep=torch.tensor([100.0, 900.0]), fps=24.0, **kwargs)
    assert v.shape == x.shape and a.shape == (2, 2, 8, 37)
    with pytest.raises(ValueError, match="24 fps clips only"):
        ours.dit(x, torch.tensor([500.0, 200.0]), context, audio=torch.randn(2, 2, 8, 37),
                 audio_timestep=torch.tensor([100.0, 900.0]), fps=16.0, **kwargs)
    # first-frame conditioning trains (tests/test_h3_keyframe_train.py); a last keyframe is sampled, not trained
    with pytest.raises(ValueError, match="first keyframe only"):
        H3.training.conditioning(None, TINY_DIT.patch_size, None, True)
    assert H3.audio.tied_map is audio_timesteps and H3.audio.loss_weight == 1.0
    # a LoRA file in the keys ComfyUI and diffusers' MiniMaxH3LoraLoaderMixin read reads back to the adapters
    from video_dit.lora import from_comfy

    g = torch.Generator().manual_seed(0)
    adapters = {"blocks.1.attn.qkv_proj.lora_A.weight": torch.randn(4, 24, generator=g),
                "blocks.1.attn.qkv_proj.lora_B.weight": torch.randn(96, 4, generator=g)}
    file = H3.lora_to_comfy(adapters, 2.0)
    assert set(file) == {"diffusion_model.blocks.1.attn.qkv_proj." + leaf
                         for leaf in ("lora_A.weight", "lora_B.weight", "alpha")}
    back, alpha, rank = from_comfy(file, "x", from_file=H3.lora_from_file)
    assert alpha == 2.0 and rank == 4 and all(torch.equal(back[k], adapters[k]) for k in adapters)


def test_dit_layouts_load_the_same_weights_and_bad_files_are_named(parts, tmp_path):
    """ComfyUI's DiT file (native names under `model.diffusion_model.`, qkv stacked) and MiniMax's own transformer
    folder (its config.json `MiniMaxH3DiTModel` with the original names, qkv interleaved per head, `rope.inv_freq`
    stored) are identified as MiniMax H3 and load as the same weights, lazily (ComfyUI: read group by group;
    MiniMax's: each qkv de-interleaved as it is read, `models.weights.ConvertedWeights`); read as stacked,
    MiniMax's shards would be other weights. A file with a foreign key is refused naming the file and the key;
    the released presets' parts are never random."""
    from safetensors.torch import save_file

    from video_dit.families.minimax_h3.convert import interleave_qkv
    from video_dit.families.minimax_h3.dit_config import H3DiTConfig
    from video_dit.models.weights import LazyWeights, WeightsError

    _, ours, _ = parts
    native = {k: v.contiguous() for k, v in ours.dit.state_dict().items()}
    save_file({"model.diffusion_model." + k: v for k, v in native.items()}, tmp_path / "comfy.safetensors")
    original = tmp_path / "FL2VA" / "transformer"
    original.mkdir(parents=True)
    sd = {k: interleave_qkv(v, TINY_DIT.head_dim) if k.endswith("qkv_proj.weight") else v for k, v in native.items()}
    sd["rope.inv_freq"] = ours.dit.rope_inv_freq("cpu")
    save_file(sd, original / "diffusion_pytorch_model.safetensors")
    names = {ours_name: theirs for theirs, ours_name in H3DiTConfig._ORIGINAL.items()}
    config = {names.get(k, k): list(v) if isinstance(v, tuple) else v for k, v in TINY_DIT.__dict__.items()}
    config.update(_class_name="MiniMaxH3DiTModel", adaln_out_features=18 * TINY_DIT.hidden_size,
                  final_adaln_out_features=2 * TINY_DIT.hidden_size)
    (original / "config.json").write_text(json.dumps(config))
    (tmp_path / "FL2VA" / "model_index.json").write_text(json.dumps({"_class_name": "MiniMaxH3Pipeline"}))
    for source, lazy in ((tmp_path / "comfy.safetensors", True), (tmp_path / "FL2VA", False)):
        assert identify(source)[0] is H3, source
        weights, config_read, _ = H3.arch.open(str(source), TINY_DIT)
        assert isinstance(weights, LazyWeights) is lazy and config_read == TINY_DIT
        loaded = H3.load_dit(str(source), config=TINY_DIT).state_dict()
        assert loaded.keys() == native.keys() and all(torch.equal(loaded[k], native[k]) for k in native), source
    assert H3.dit_config(str(tmp_path / "FL2VA")) == TINY_DIT  # MiniMax's config names
    (original / "config.json").unlink()  # without it the shards read as stacked: other weights
    stacked = H3.load_dit(str(original), config=TINY_DIT).state_dict()
    assert not torch.equal(stacked["blocks.0.attn.qkv_proj.weight"], native["blocks.0.attn.qkv_proj.weight"])
    bad = dict(native)
    bad["blocks.0.attn.qkv.weight"] = bad.pop("blocks.0.attn.qkv_proj.weight")
    save_file(bad, tmp_path / "bad.safetensors")
    with pytest.raises(WeightsError, match=r"bad\.safetensors.*blocks\.0\.attn\.qkv\.weight"):
        H3.load_dit(str(tmp_path / "bad.safetensors"), config=TINY_DIT)
    for load, what in ((H3.audio.load_codec, "audio VAE"), (H3.load_text_encoder, "Qwen3-VL")):
        with pytest.raises(WeightsError, match=f"this preset's {what} is never random-initialised"):
            load("preset:minimax-h3-fl2va")
    with pytest.raises(ValueError, match="guidance-distilled"):
        ours.generate_latents(parts[2].encode([PROMPT])[0], guidance_scale=3.0, num_frames=FRAMES, height=HEIGHT,
                              width=WIDTH, steps=STEPS)
    with pytest.raises(ValueError, match="multiples of 8"):
        ours.generate_latents(parts[2].encode([PROMPT])[0], num_frames=FRAMES, height=36, width=WIDTH, steps=STEPS)
