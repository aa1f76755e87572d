"""LTX-2 as the ai-toolkit arch (`arch: video_dit`, `model_kwargs.preset: tiny-ltx2-t2v`), against the stand-in of
the ai-toolkit types it touches (tests/aitk_standin), its audio stream through ai-toolkit's own channel (a
`do_audio` dataset's `audio_data` / cached `audio_latents`, the model's `audio_pred` / `audio_target`, which
SDTrainer adds to its loss): the same loss as our DeepSpeed trainer for a clip with sound, a cached i2v clip, a
batch where one clip has no track and a dataset without `do_audio`; a preview MP4 with its AAC track; ai-toolkit's
LoRA saved as our file (ComfyUI's LTX-2 keys) and loaded back unchanged."""

from __future__ import annotations

import copy
import math
import types

import aitk_standin
import av
import helpers
import pytest
import torch
import torch.nn.functional as F
from test_aitk_adapter import aitk_lora_state_dict, merged

from video_dit.diffusion.flow import add_noise
from video_dit.families.ltx2 import FAMILY as LTX2
from video_dit.lora import load_lora
from video_dit.models.weights import read_state_dict

T, H, W, FPS, RATE = 9, 64, 64, 24, 16000  # pixels (1, 9, 3, 64, 64) -> latents (1, 8, 2, 2, 2), tiny LTX-2 VAE


@pytest.fixture(scope="module")
def sd():
    aitk = aitk_standin.activate()
    from toolkit.config_modules import ModelConfig

    cfg = ModelConfig(name_or_path="preset:tiny-ltx2-t2v", arch="video_dit", dtype="fp32")
    model = aitk.VideoDiTModel(device="cpu", model_config=cfg, dtype="fp32",
                               noise_scheduler=aitk.VideoDiTModel.get_train_scheduler())
    model.load_model()
    # every weight non-trivial: the seeded init zeroes the gates and tables through which audio reaches the video
    helpers.randomize_all(model.model, seed=0)
    yield model
    aitk_standin.deactivate()


def clip(seed: int = 0) -> torch.Tensor:
    """(1, T, 3, H, W) smooth frames in [-1, 1], as ai-toolkit's loader delivers them."""
    g = torch.Generator().manual_seed(seed)
    return F.interpolate(torch.rand(T, 3, H // 16, W // 16, generator=g) * 2 - 1, size=(H, W), mode="bilinear")[None]


def track(hz: float) -> dict:
    """ai-toolkit's `audio_data` of a clip: its stereo track over the clip's T / FPS seconds."""
    s = torch.arange(round(T / FPS * RATE)) / RATE
    wave = torch.stack([0.5 * torch.sin(2 * math.pi * hz * s), 0.3 * torch.sin(2 * math.pi * 2 * hz * s)])
    return {"waveform": wave, "sample_rate": RATE}


def test_the_arch_names_ltx2s_modules_and_its_sound(sd):
    assert sd.target_lora_modules == ["LTX2DiT"] and sd.get_transformer_block_names() == ["transformer_blocks"]
    assert {"patchify_proj*", "audio_patchify_proj*", "adaln_single*", "proj_out*"} <= set(
        sd.get_quantization_exclude_modules())
    assert sd.get_bucket_divisibility() == 32 and sd.audio_codec is not None
    assert ";audio=" in sd.latent_space_version  # the audio latents ai-toolkit caches beside the video's
    embeds = sd.get_prompt_embeds(["a drum solo", ""])
    assert embeds.keys() == ["text_embeds", "audio_context"]  # `text_embeds`: ai-toolkit reads the batch size there
    z, frames, bins = sd.audio_codec.latent_shape(T, FPS)  # round(T / FPS x 25 latents a second) = 9
    latents = sd.encode_audio([track(440.0)])  # what the codec makes of T / FPS seconds: one latent frame more
    assert latents.shape == (1, z, frames + 1, bins)


CASES = {  # name: (do_i2v, do_audio, per clip: a track's frequency or None, the audio cached as ai-toolkit caches it)
    "sound": (False, True, [440.0], False),
    "cached_i2v": (True, True, [330.0], True),
    "one_clip_without_a_track": (False, True, [440.0, None], False),
    "dataset_without_do_audio": (False, False, [440.0], False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_same_loss_as_our_trainer(sd, case):
    """One batch through our trainer's `loss_at` (the tensors its caches hold: latents, both contexts, the audio
    latents and whether each clip has sound) and through the arch (ai-toolkit's batch: pixels, latents, prompt
    embeds, `audio_data` or the cached `audio_latents`), same DiT, t and noise (the audio's too, as ai-toolkit's
    `batch.audio_noise`): ai-toolkit's loss (SDTrainer: the element-wise video MSE through `scale_loss`, its mean,
    plus mse(audio_pred, audio_target) x audio_loss_multiplier 1) equals ours."""
    from toolkit.data_transfer_object.data_loader import DataLoaderBatchDTO

    from video_dit.train.trainer import Trainer, job_conditioning

    do_i2v, do_audio, tones, cached = CASES[case]
    B = len(tones)
    pixels = torch.cat([clip(i) for i in range(B)])
    video = pixels.permute(0, 2, 1, 3, 4)  # (B, 3, T, H, W), as build_cache encodes it
    embeds = sd.get_prompt_embeds([f"a tone {i}" for i in range(B)])
    trainer = Trainer.__new__(Trainer)  # only what loss_at reads
    trainer.device, trainer.engine, trainer.family, trainer.dit_config = torch.device("cpu"), sd.model, LTX2, \
        sd.model.config
    process = types.SimpleNamespace(datasets=[types.SimpleNamespace(do_i2v=do_i2v)], i2v_mode="replace", flf2v=False,
                                    model=types.SimpleNamespace(mask_first_frame_loss=None))
    trainer.conditioning = job_conditioning(process, sd.model.config, LTX2.training)
    trainer.timesteps = types.SimpleNamespace(loss_weight=torch.ones_like)
    trainer.dataset = types.SimpleNamespace(item=lambda i: types.SimpleNamespace(conditioned=do_i2v))
    trainer.audio_loss_weight = 1.0
    t = torch.tensor([640.0, 310.0][:B])
    with torch.no_grad():
        latents = sd.vae.normalize(sd.vae.encode(video).mode())
        data = [None if hz is None else track(hz) for hz in tones]
        has = torch.tensor([d is not None and do_audio for d in data])
        if do_audio:  # a clip without a track: zeros like the others' (ai-toolkit's fill)
            encoded = [None if d is None else sd.encode_audio([d])[0] for d in data]
            like = next(e for e in encoded if e is not None)
            audio = torch.stack([torch.zeros_like(like) if e is None else e for e in encoded])
        else:  # no sound read: zeros of the clip's audio length, as our trainer's `audio: off`
            audio = torch.zeros(B, *sd.audio_codec.latent_shape(T, FPS))
        gen = torch.Generator().manual_seed(5)
        noise, a_noise = torch.randn(latents.shape, generator=gen), torch.randn(audio.shape, generator=gen)
        ours_batch = {"latents": latents, "text_embeds": embeds.text_embeds, "audio_context": embeds.audio_context,
                      "index": torch.arange(B), "audio_latents": audio * has.view(-1, 1, 1, 1), "has_audio": has,
                      "fps": torch.full((B,), float(FPS))}
        if do_i2v:
            ours_batch.update(LTX2.training.cache_item(sd.vae, video, "replace", False, None))
        parts = {}
        ours = trainer.loss_at(ours_batch, t, noise, audio_t=t, audio_noise=a_noise, parts=parts)
    batch = DataLoaderBatchDTO(tensor=pixels, latents=latents, do_i2v=do_i2v, num_frames=T, fps=FPS,
                               do_audio=do_audio, audio_latents=audio if cached else None,
                               audio_data=None if cached else data)
    batch.audio_noise = a_noise  # what ai-toolkit's first pass of the step drew
    pred = sd.get_noise_prediction(add_noise(latents, noise, t), t, embeds, batch=batch)
    video_loss = sd.scale_loss(F.mse_loss(pred, sd.get_loss_target(noise=noise, batch=batch), reduction="none"))
    theirs = video_loss.mean()
    if batch.audio_pred is not None:  # SDTrainer's audio term (L1016-1021)
        theirs = theirs + F.mse_loss(batch.audio_pred.float(), batch.audio_target.float())
    print(f"\n{case}: ours {ours.item():.6f} (video {parts['video']:.6f}, audio {parts['audio']:.6f}), "
          f"theirs {theirs.item():.6f}")
    assert torch.allclose(ours, theirs.detach(), rtol=1e-5), (ours, theirs)
    assert (batch.audio_pred is not None) == bool(has.any()) and (parts["audio"] > 0) == bool(has.any())


def test_a_clip_without_a_track_gets_no_audio_gradient(sd):
    """ai-toolkit's audio loss over a batch where clip 1 has no track: its audio prediction has no gradient from
    it (its target is its own prediction), as our trainer masks it, while clip 0's has."""
    from toolkit.data_transfer_object.data_loader import DataLoaderBatchDTO

    pixels = torch.cat([clip(0), clip(1)])
    with torch.no_grad():
        latents = sd.vae.normalize(sd.vae.encode(pixels.permute(0, 2, 1, 3, 4)).mode())
    batch = DataLoaderBatchDTO(tensor=pixels, latents=latents, num_frames=T, fps=FPS, do_audio=True,
                               audio_data=[track(440.0), None])
    t = torch.tensor([500.0, 500.0])
    sd.get_noise_prediction(add_noise(latents, torch.randn_like(latents), t), t,
                            sd.get_prompt_embeds(["a", "b"]), batch=batch)
    pred = batch.audio_pred
    pred.retain_grad()
    F.mse_loss(pred.float(), batch.audio_target.float()).backward()
    assert pred.grad[1].abs().max() == 0 and pred.grad[0].abs().max() > 0


def test_preview_is_an_mp4_with_the_models_sound(sd, tmp_path):
    from toolkit.config_modules import GenerateImageConfig

    gen_config = GenerateImageConfig(prompt="a bell rings", width=64, height=64, num_inference_steps=2,
                                     guidance_scale=1.0, seed=3, num_frames=12, fps=FPS,
                                     output_folder=str(tmp_path / "samples"), output_ext="webp")
    cond = sd.get_prompt_embeds([gen_config.prompt])
    frames = sd.generate_single_image(sd.get_generation_pipeline(), gen_config, cond, None, torch.manual_seed(3), {})
    assert gen_config.num_frames == 9 and len(frames) == 9 and gen_config.output_ext == "mp4"  # 8k + 1 frames
    gen_config.save_image(frames, 0, 1)
    path = gen_config.get_image_path(0, 1)
    with av.open(path) as container:
        assert len(container.streams.video) == 1 and len(container.streams.audio) == 1
        assert container.streams.audio[0].rate == sd.audio_codec.out_rate


def test_lora_saved_as_our_file_and_loaded_back(sd, tmp_path):
    """ai-toolkit's peft LoRA (every Linear of the blocks) -> our file in ComfyUI's LTX-2 keys, which our loader
    reads into the same model; and back to ai-toolkit's keys unchanged."""
    from safetensors.torch import save_file

    dit = copy.deepcopy(sd.model)
    ai_sd = aitk_lora_state_dict(sd, dit, rank=4, gen=torch.Generator().manual_seed(0))
    saved = sd.convert_lora_weights_before_save(ai_sd)
    assert "diffusion_model.transformer_blocks.0.audio_to_video_attn.to_q.lora_A.weight" in saved
    path = tmp_path / "aitk.safetensors"
    save_file(saved, str(path))
    ours = load_lora(path, copy.deepcopy(dit), from_file=LTX2.lora_from_file)
    cfg = dit.config
    g = torch.Generator().manual_seed(1)
    kw = dict(video=torch.randn(1, cfg.in_channels, 2, 2, 2, generator=g), video_timestep=torch.tensor([400.0]),
              video_context=torch.randn(1, 5, cfg.hidden_size, generator=g), audio=torch.randn(1, 2, 6, 4, generator=g),
              audio_timestep=torch.tensor([400.0]), audio_context=torch.randn(1, 5, cfg.audio_hidden_size, generator=g))
    with torch.no_grad():
        got, want = ours(**kw), merged(dit, ai_sd)(**kw)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(got, want))
    back = sd.convert_lora_weights_before_load(read_state_dict(path))
    assert back.keys() == ai_sd.keys() and all(torch.allclose(back[k], ai_sd[k]) for k in ai_sd)
