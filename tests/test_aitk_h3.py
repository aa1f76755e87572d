"""MiniMax H3 as the ai-toolkit arch (`arch: video_dit`, `model_kwargs.preset: tiny-h3`, text-to-video+audio), against
the stand-in of the ai-toolkit types it touches (tests/aitk_standin), its sound through ai-toolkit's own channel as
LTX-2's (tests/test_aitk_ltx2.py): the same loss as our DeepSpeed trainer for a clip with sound (the audio at the
video's t moved onto the audio's schedule, `presets.audio_timesteps`, as ai-toolkit's minimax_h3 `remap_sigma`), a
cached batch where one clip has no track, and `model_kwargs.audio_timesteps: independent` (the audio's own draw, the
one our trainer's sampler makes for the same keys and seed); a `do_i2v` dataset refused naming the trainer that
takes it; a preview MP4 with its AAC track; ai-toolkit's LoRA saved in ComfyUI's keys (which diffusers' H3 LoRA
reader takes) and loaded back unchanged; the UI's H3 entries."""

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
from PIL import Image
from test_aitk_adapter import aitk_lora_state_dict, merged

from video_dit.diffusion.flow import add_noise
from video_dit.families import PRESETS
from video_dit.families.minimax_h3 import FAMILY as H3
from video_dit.lora import load_lora
from video_dit.models.weights import read_state_dict
from video_dit.train.config import parse_job
from video_dit.typed_config import ConfigError

T, H, W, FPS, RATE = 22, 32, 32, 24, 16000  # pixels (1, 22, 3, 32, 32) -> latents (1, 4, 7, 8, 8), tiny H3 VAE
# Measured |ours - theirs| / ours of the loss below (fp32, CPU): 0 (tied cases), 1.0e-7 (independent); the
# tolerance is 10x the larger. The audio at the video's t unmapped moves the loss by 2-4e-2 (asserted > 1e-2).
RTOL = 1e-6


@pytest.fixture(scope="module")
def aitk():
    module = aitk_standin.activate()
    yield module
    aitk_standin.deactivate()


def arch(aitk, **kwargs):
    """The arch on tiny-h3 before load_model (its settings resolved, nothing built)."""
    from toolkit.config_modules import ModelConfig

    cfg = ModelConfig(name_or_path="preset:tiny-h3", arch="video_dit", dtype="fp32", model_kwargs=kwargs)
    return aitk.VideoDiTModel(device="cpu", model_config=cfg, dtype="fp32",
                              noise_scheduler=aitk.VideoDiTModel.get_train_scheduler())


@pytest.fixture(scope="module")
def sd(aitk):
    model = arch(aitk)
    model.load_model()
    # every weight non-trivial: the seeded init zeroes the gates and the output layer
    helpers.randomize_all(model.model, seed=0)
    return model


def clip(seed: int = 0) -> torch.Tensor:
    """(1, T, 3, H, W) smooth frames in [-1, 1], as ai-toolkit's loader delivers them."""
    g = torch.Generator().manual_seed(seed)
    return F.interpolate(torch.rand(T, 3, H // 8, W // 8, generator=g) * 2 - 1, size=(H, W), mode="bilinear")[None]


def track(hz: float) -> dict:
    """ai-toolkit's `audio_data` of a clip: its stereo track over the clip's T / FPS seconds (at 16 kHz: the arch
    resamples it to the codec's 32 kHz)."""
    s = torch.arange(round(T / FPS * RATE)) / RATE
    wave = torch.stack([0.5 * torch.sin(2 * math.pi * hz * s), 0.3 * torch.sin(2 * math.pi * 2 * hz * s)])
    return {"waveform": wave, "sample_rate": RATE}


class Job:
    """ai-toolkit's trainer as the arch sees it: its preview hook is a bound method holding its train config."""

    def __init__(self, train_config):
        self.train_config = train_config

    def hook(self, *args):
        pass


def test_the_arch_names_h3s_modules_and_its_sound(sd):
    assert sd.target_lora_modules == ["H3DiT"] and sd.get_transformer_block_names() == ["blocks"]
    assert {"video_patch_proj*", "audio_patch_proj*", "condition_proj*"} <= set(sd.get_quantization_exclude_modules())
    assert sd.get_bucket_divisibility() == 8 and sd.conditioning is None and sd.audio_timesteps == "tied"
    assert ";audio=" in sd.latent_space_version
    assert sd.get_frame_count_snapper()(24) == 22  # 17 n + 5
    z = sd.encode_audio([track(440.0)])  # 16 kHz in, the codec's 32 kHz: round(T / FPS x 40) latents
    assert z.shape == (1, *sd.audio_codec.latent_shape(T, FPS)) == (1, 2, 8, 37)


def test_tracks_reach_the_codec_at_its_rate():
    """ai-toolkit's 16 kHz track resampled to the codec's 32 kHz is the same tones sampled at 32 kHz, in time (no
    resampler delay; measured 1.7e-4 inside, the last 200 samples are the resampler's flushed tail); a mono track
    goes to both stereo channels."""
    from video_dit.integrations.ai_toolkit.model import codec_wave

    item = track(440.0)
    out = codec_wave(item["waveform"], RATE, 32000, 2)
    s = torch.arange(out.shape[1]) / 32000
    want = torch.stack([0.5 * torch.sin(2 * math.pi * 440 * s), 0.3 * torch.sin(2 * math.pi * 880 * s)])
    assert out.shape == (2, 2 * item["waveform"].shape[1]) and (out - want)[:, 200:-200].abs().max() < 2e-3
    mono = codec_wave(item["waveform"][:1], RATE, 32000, 2)
    assert torch.equal(mono[0], mono[1]) and torch.allclose(mono[0], out[0])


CASES = {  # name: (audio_timesteps, per clip: a track's frequency or None, the audio cached as ai-toolkit caches it)
    "sound": ("tied", [440.0], False),
    "cached_one_clip_without_a_track": ("tied", [330.0, None], True),
    "independent": ("independent", [440.0, 550.0], False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_same_loss_as_our_trainer(sd, case, monkeypatch):
    """One batch through our trainer's `loss_at` (the tensors its caches hold) and through the arch (ai-toolkit's
    batch: pixels, latents, prompt embeds, `audio_data` or the cached `audio_latents`), same DiT, t and noise (the
    audio's too, as ai-toolkit's `batch.audio_noise`): ai-toolkit's loss (SDTrainer: the element-wise video MSE
    through `scale_loss`, its mean, plus mse(audio_pred, audio_target) x audio_loss_multiplier 1) equals ours.
    Tied: our trainer's audio t is the family's map of the video's (`AudioPath.tied_map`). Independent: the arch
    draws the audio's t from the job's distribution (shift 12 here) with torch's generator: the draw is derived
    here, equals our trainer's sampler for the same keys and seed, and is the t our trainer is given."""
    from toolkit.config_modules import TrainConfig
    from toolkit.data_transfer_object.data_loader import DataLoaderBatchDTO

    from video_dit.integrations.ai_toolkit.model import AUDIO_T_ATTR
    from video_dit.train.trainer import Trainer, job_conditioning, timestep_sampler

    mode, tones, cached = CASES[case]
    if mode == "independent":  # what model_kwargs.audio_timesteps: independent sets (test_audio_timesteps_key)
        monkeypatch.setattr(sd, "audio_timesteps", "independent")
        sd.add_after_sample_image_hook(Job(TrainConfig(timestep_type="shift")).hook)
    B = len(tones)
    pixels = torch.cat([clip(i) for i in range(B)])
    embeds = sd.get_prompt_embeds([f"a tone {i}" for i in range(B)])
    trainer = Trainer.__new__(Trainer)  # only what loss_at reads
    trainer.device, trainer.engine, trainer.family, trainer.dit_config = torch.device("cpu"), sd.model, H3, \
        sd.model.config
    process = types.SimpleNamespace(datasets=[types.SimpleNamespace(do_i2v=False)], i2v_mode=None, flf2v=False,
                                    model=types.SimpleNamespace(mask_first_frame_loss=None))
    trainer.conditioning = job_conditioning(process, sd.model.config, H3.training)
    trainer.timesteps = types.SimpleNamespace(loss_weight=torch.ones_like)
    trainer.audio_loss_weight = 1.0
    t = torch.tensor([640.0, 310.0][:B])
    with torch.no_grad():
        latents = sd.encode_images(pixels)
        data = [None if hz is None else track(hz) for hz in tones]
        has = torch.tensor([d is not None for d in data])
        encoded = [None if d is None else sd.encode_audio([d])[0] for d in data]
        like = next(e for e in encoded if e is not None)
        audio = torch.stack([torch.zeros_like(like) if e is None else e for e in encoded])  # ai-toolkit's fill
        gen = torch.Generator().manual_seed(5)
        noise, a_noise = torch.randn(latents.shape, generator=gen), torch.randn(audio.shape, generator=gen)
    batch = DataLoaderBatchDTO(tensor=pixels, latents=latents, num_frames=T, fps=FPS, do_audio=True,
                               audio_latents=audio if cached else None, audio_data=None if cached else data)
    batch.audio_noise = a_noise  # what ai-toolkit's first pass of the step drew
    torch.manual_seed(11)  # ai-toolkit seeds torch's generator; the arch's independent draw uses it
    pred = sd.get_noise_prediction(add_noise(latents, noise, t), t, embeds, batch=batch)
    video_loss = sd.scale_loss(F.mse_loss(pred, sd.get_loss_target(noise=noise, batch=batch), reduction="none"))
    theirs = video_loss.mean() + F.mse_loss(batch.audio_pred.float(), batch.audio_target.float())  # SDTrainer's
    audio_t = None  # tied: our trainer maps the video's t itself
    if mode == "independent":
        audio_t = getattr(batch, AUDIO_T_ATTR)
        u = torch.rand(B, generator=torch.Generator().manual_seed(11), dtype=torch.float64)
        shifted = 12.0 * u / (1.0 + 11.0 * u)  # the shift-12 schedule (presets.VIDEO_SHIFT, ai-toolkit's scheduler)
        assert torch.allclose(audio_t, (1000.0 * shifted).float(), rtol=1e-6)
        ours_sampler = timestep_sampler(types.SimpleNamespace(train=types.SimpleNamespace(
            timestep_type="shift", timestep_shift=None, min_t=0.0, max_t=1000.0)), sd.preset)
        assert torch.equal(audio_t, ours_sampler.sample(B, torch.Generator().manual_seed(11)))
    ours_batch = {"latents": latents, "text_embeds": list(embeds.text_embeds), "index": torch.arange(B),
                  "audio_latents": audio * has.view(-1, 1, 1, 1), "has_audio": has, "fps": torch.full((B,), float(FPS))}
    parts = {}
    with torch.no_grad():
        ours = trainer.loss_at(ours_batch, t, noise, audio_t=audio_t, audio_noise=a_noise, parts=parts)
        unmapped = trainer.loss_at(ours_batch, t, noise, audio_t=t, audio_noise=a_noise)  # the audio at the video's t
    err = abs(ours.item() - theirs.item()) / ours.item()
    print(f"\n{case}: ours {ours.item():.6f} (video {parts['video']:.6f}, audio {parts['audio']:.6f}), theirs "
          f"{theirs.item():.6f}, rel {err:.1e}; audio at the video's t unmapped {unmapped.item():.6f}")
    assert err < RTOL, (ours, theirs)
    assert abs(unmapped.item() - theirs.item()) / ours.item() > 1e-2  # the audio's t is what the case says
    if B == 2 and not bool(has[1]):  # no audio gradient from a clip without a track: its target is its prediction
        assert torch.equal(batch.audio_target[1], batch.audio_pred[1].detach().float())


def test_audio_timesteps_key(aitk, tmp_path):
    """`model_kwargs.audio_timesteps`: the family's (tied) by default, independent when asked; an unknown value and
    a model without sound are refused naming the key; a job whose timesteps the arch cannot draw alike for the audio
    is refused naming its key before step 1 (at the preview hook)."""
    from toolkit.config_modules import TrainConfig

    assert arch(aitk).audio_timesteps == H3.audio.timesteps == "tied"
    assert arch(aitk, audio_timesteps="independent").audio_timesteps == "independent"
    with pytest.raises(ConfigError, match=r"model\.model_kwargs\.audio_timesteps: 'both' is not accepted; accepted: "
                                          r"'tied' \| 'independent'"):
        arch(aitk, audio_timesteps="both")
    from toolkit.config_modules import ModelConfig

    silent = ModelConfig(name_or_path="preset:tiny", arch="video_dit", dtype="fp32",
                         model_kwargs={"audio_timesteps": "tied"})
    with pytest.raises(ConfigError, match=r"model\.model_kwargs\.audio_timesteps: preset 'tiny' generates no sound"):
        aitk.VideoDiTModel(device="cpu", model_config=silent, dtype="fp32")
    independent = arch(aitk, audio_timesteps="independent")
    # our trainer reads the same key there, as its train.audio_timesteps
    Image.new("RGB", (W, H)).save(tmp_path / "a.png")  # (a dataset folder holds media)
    process = {"model": {"arch": "video_dit", "name_or_path": "preset:tiny-h3", "model_kwargs": {
        "audio_timesteps": "independent"}}, "datasets": [{"folder_path": str(tmp_path), "num_frames": T,
                                                          "shrink_video_to_frames": False}]}

    def job(**extra):
        return {"job": "extension", "config": {"name": "h3", "process": [{**process, **extra}]}}

    assert parse_job(job()).process.train.audio_timesteps == "independent"
    with pytest.raises(ConfigError, match=r"model\.model_kwargs\.audio_timesteps: 'independent' conflicts with "
                                          r"train\.audio_timesteps 'tied'"):
        parse_job(job(train={"audio_timesteps": "tied"}))
    with pytest.raises(ConfigError, match=r"train\.content_or_style: 'style' with model_kwargs\.audio_timesteps "
                                          r"independent .* accepted: balanced"):
        independent.add_after_sample_image_hook(Job(TrainConfig(timestep_type="shift", content_or_style="style")).hook)
    with pytest.raises(ConfigError, match=r"train\.timestep_type: 'lognorm_blend' .* accepted: shift, linear"):
        independent.add_after_sample_image_hook(Job(TrainConfig(timestep_type="lognorm_blend")).hook)
    with pytest.raises(ConfigError, match=r"train\.min_denoising_steps: 100 .* accepted: 0 \(the whole schedule\)"):
        independent.add_after_sample_image_hook(Job(TrainConfig(timestep_type="shift", min_denoising_steps=100)).hook)
    arch(aitk).add_after_sample_image_hook(Job(TrainConfig(timestep_type="lognorm_blend")).hook)  # tied: no draw


def test_do_i2v_is_refused_naming_the_trainer_that_takes_it(sd):
    """H3's first-frame training presents the frame with the caption (`Family.prompt_images`), which ai-toolkit
    encodes and caches alone: a `do_i2v` batch is a ConfigError naming the dataset key and our trainer (which trains
    it: tests/test_h3_keyframe_train.py), at the batch and before step 1 at the preview hook; a last frame in the
    family's words."""
    from toolkit.data_transfer_object.data_loader import DataLoaderBatchDTO

    batch = DataLoaderBatchDTO(tensor=clip(0), latents=torch.zeros(1, 4, 7, 8, 8), do_i2v=True, num_frames=T, fps=FPS)
    with pytest.raises(ConfigError, match=r"datasets\[\]\.do_i2v \(None\): .*presents the frame with the caption.*"
                                          r"video-dit train.*accepted here: false"):
        sd.get_noise_prediction(batch.latents, torch.tensor([500.0]), sd.get_prompt_embeds(["a"]), batch=batch)
    job = Job(None)  # before step 1: ai-toolkit's trainer registering its preview hook hands the arch its datasets
    job.sample_config, job.dataset_configs = types.SimpleNamespace(samples=[]), [
        types.SimpleNamespace(do_i2v=False, num_frames=T, folder_path="a"),
        types.SimpleNamespace(do_i2v=True, num_frames=T, folder_path="b")]
    with pytest.raises(ConfigError, match=r"datasets\[1\]\.do_i2v: preset 'tiny-h3' conditions on a first frame"):
        sd.add_after_sample_image_hook(job.hook)
    sd.last_frame = True
    with pytest.raises(ConfigError, match="first keyframe only"):
        sd.refuse_first_frame("datasets[0].do_i2v")
    sd.last_frame = False


def test_preview_is_an_mp4_with_the_models_sound(sd, tmp_path):
    """ai-toolkit hands the previews a negative prompt's embeds too; at guidance 1 (the guidance-distilled model's
    only scale) the arch drops it, and the MP4 carries the model's sound at the codec's rate."""
    from toolkit.config_modules import GenerateImageConfig

    gen_config = GenerateImageConfig(prompt="a bell rings", width=32, height=32, num_inference_steps=2,
                                     guidance_scale=1.0, seed=3, num_frames=24, fps=FPS,
                                     output_folder=str(tmp_path / "samples"), output_ext="webp")
    cond, uncond = sd.get_prompt_embeds([gen_config.prompt]), sd.get_prompt_embeds([""])
    frames = sd.generate_single_image(sd.get_generation_pipeline(), gen_config, cond, uncond, torch.manual_seed(3), {})
    assert gen_config.num_frames == 22 and len(frames) == 22 and gen_config.output_ext == "mp4"  # 17 n + 5 frames
    gen_config.save_image(frames, 0, 1)
    with av.open(gen_config.get_image_path(0, 1)) as container:
        assert len(container.streams.video) == 1 and len(container.streams.audio) == 1
        assert container.streams.audio[0].rate == sd.audio_codec.out_rate == 32000


def test_lora_saved_in_comfyui_keys_and_loaded_back(sd, tmp_path):
    """ai-toolkit's peft LoRA (every Linear of the blocks) -> our file in ComfyUI's H3 keys (`diffusion_model.
    <module>`, which diffusers' H3 LoRA reader converts whole), which our loader reads into the same model; and back
    to ai-toolkit's keys unchanged."""
    from diffusers.loaders.lora_conversion_utils import _convert_non_diffusers_minimax_h3_lora_to_diffusers
    from safetensors.torch import save_file

    dit = copy.deepcopy(sd.model)
    ai_sd = aitk_lora_state_dict(sd, dit, rank=4, gen=torch.Generator().manual_seed(0))
    saved = sd.convert_lora_weights_before_save(ai_sd)
    assert "diffusion_model.blocks.0.attn.qkv_proj.lora_A.weight" in saved
    assert {k.removeprefix("transformer.") for k in ai_sd} == {k.removeprefix("diffusion_model.") for k in saved
                                                               if not k.endswith(".alpha")}
    converted = _convert_non_diffusers_minimax_h3_lora_to_diffusers({k: v.clone() for k, v in saved.items()})
    n_a, n_qkv = (len([k for k in saved if k.endswith(end)]) for end in ("lora_A.weight", "qkv_proj.lora_A.weight"))
    assert len([k for k in converted if "lora_A" in k]) == n_a + 2 * n_qkv > 0  # diffusers splits qkv in three
    path = tmp_path / "aitk.safetensors"
    save_file(saved, str(path))
    ours = load_lora(path, copy.deepcopy(dit), from_file=H3.lora_from_file)
    cfg = dit.config
    g = torch.Generator().manual_seed(1)
    kw = dict(video=torch.randn(1, cfg.in_channels, 2, 4, 4, generator=g), timestep=torch.tensor([400.0]),
              text=torch.randn(1, 5, cfg.text_dim, generator=g),
              audio=torch.randn(1, 2, cfg.audio_in_channels, 7, generator=g), audio_timestep=torch.tensor([300.0]))
    with torch.no_grad():
        got, want = ours(**kw), merged(dit, ai_sd)(**kw)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(got, want))
    back = sd.convert_lora_weights_before_load(read_state_dict(path))
    assert back.keys() == ai_sd.keys() and all(torch.allclose(back[k], ai_sd[k]) for k in ai_sd)


def test_the_ui_offers_h3s_presets():
    """The UI's entries (generated from the registry) hold H3's presets: the tiny one a CPU smoke test with sound
    (Do Audio, consecutive frames), its clip a count the VAE encodes at 24 fps, guidance 1 (guidance-distilled)."""
    from video_dit.integrations import aitk_ui

    names = [p.name for p in aitk_ui.entry_presets()]
    assert {"tiny-h3", "minimax-h3-fl2va", "minimax-h3-ref2va"} <= set(names)
    e = aitk_ui.entry(PRESETS["tiny-h3"], "/a/trainable/base")
    d = {k[len(aitk_ui.P):]: v[0] for k, v in e["defaults"].items()}
    assert e["name"] == "video_dit:tiny-h3" and "with sound" in e["label"] and "datasets.do_audio" in e[
        "additionalSections"]
    assert d["datasets[x].do_audio"] is True and d["datasets[x].shrink_video_to_frames"] is False
    assert (d["sample.num_frames"], d["sample.fps"], d["sample.guidance_scale"], d["sample.sample_steps"]) == (
        22, 24, 1.0, 8)
    assert "datasets.do_i2v" not in e["additionalSections"] and "datasets[x].do_i2v" not in d  # t2va only
    released = {k[len(aitk_ui.P):]: v[0] for k, v in aitk_ui.entry(PRESETS["minimax-h3-fl2va"])["defaults"].items()}
    assert released["model.quantize"] is True and released["model.quantize_te"] is True  # 16B DiT, Qwen3-VL
    assert (released["sample.num_frames"], released["sample.height"], released["sample.width"]) == (124, 768, 1344)
