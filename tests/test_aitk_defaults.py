"""ai-toolkit's own default values are valid input to our arch: `SampleConfig` / `SampleItem`,
`GenerateImageConfig`, `TrainConfig` and `DatasetConfig` built from their defaults (the stand-in
carries ai-toolkit 27a03a91's real defaults, tests/aitk_standin/toolkit/config_modules.py) and handed
to the arch the way ai-toolkit's trainer hands them (its call sequences written out below); and our
own trainer's config accepts ai-toolkit's default value of every key the two share."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import aitk_standin


@pytest.fixture(scope="module")
def aitk():
    yield aitk_standin.activate()
    aitk_standin.deactivate()


@pytest.fixture(scope="module")
def sd(aitk):
    """The tiny model as BaseSDTrainProcess.run builds it from TrainConfig's defaults (dtype 'fp32',
    gradient_checkpointing true). ModelConfig gets dtype fp32: its default float16 VAE works on CPU too
    but is slow there."""
    from toolkit.config_modules import ModelConfig, TrainConfig

    train = TrainConfig()
    model = aitk.VideoDiTModel(device="cpu", model_config=ModelConfig(name_or_path="preset:tiny", arch="video_dit",
                                                                      dtype="fp32"),
                               dtype=train.dtype, noise_scheduler=aitk.VideoDiTModel.get_train_scheduler())
    model.load_model()
    if train.gradient_checkpointing:  # BaseSDTrainProcess.run
        model.unet.enable_gradient_checkpointing()
    with torch.no_grad():
        model.model.head.head.weight.normal_(std=0.05, generator=torch.Generator().manual_seed(0))
    return model


def test_the_stand_in_carries_ai_toolkits_defaults(aitk):
    """A few of the defaults this file relies on, as read in ai-toolkit's config_modules.py (27a03a91)."""
    from toolkit.config_modules import DatasetConfig, GenerateImageConfig, SampleConfig, TrainConfig

    s = SampleConfig(samples=[{"prompt": "x"}])
    assert (s.neg, s.samples[0].neg, s.sampler, s.width, s.height, s.num_frames, s.guidance_scale,
            s.sample_steps, s.seed, s.ext, s.samples[0].network_multiplier) == (
        False, False, "ddpm", 512, 512, 1, 7, 20, 0, "jpg", 1)
    t = TrainConfig()
    assert (t.noise_scheduler, t.timestep_type, t.dtype, t.content_or_style, t.min_denoising_steps,
            t.max_denoising_steps, t.gradient_checkpointing, t.lr) == ("ddpm", "sigmoid", "fp32", "balanced", 0,
                                                                      999, True, 1e-6)
    d = DatasetConfig(folder_path="x")
    assert (d.num_frames, d.resolution, d.do_i2v, d.cache_latents_to_disk, d.cache_text_embeddings,
            d.caption_ext, d.buckets) == (1, 512, False, False, False, ".txt", True)
    g = GenerateImageConfig(output_folder="out")
    assert (g.width, g.height, g.num_inference_steps, g.guidance_scale, g.negative_prompt, g.num_frames,
            g.fps, g.ctrl_img, g.guidance_rescale) == (512, 512, 50, 7.5, "", 1, 15, None, 0.0)
    assert 0 <= g.seed < 2 ** 32  # seed -1: drawn at random


def sample_job_configs(sample_config, sample_folder):
    """BaseSDTrainProcess.sample: one GenerateImageConfig per sample item, with its keyword list."""
    from toolkit.config_modules import GenerateImageConfig

    out, seed = [], sample_config.seed
    for i, item in enumerate(sample_config.samples):
        if sample_config.walk_seed:
            seed = sample_config.seed + i
        if item.seed is not None:
            seed = item.seed
        out.append(GenerateImageConfig(
            prompt=item.prompt, width=item.width, height=item.height, negative_prompt=item.neg, seed=seed,
            guidance_scale=item.guidance_scale, guidance_rescale=sample_config.guidance_rescale,
            num_inference_steps=item.sample_steps, network_multiplier=item.network_multiplier,
            output_path=str(sample_folder / f"[time]__[count].{sample_config.ext}"), output_ext=sample_config.ext,
            adapter_conditioning_scale=sample_config.adapter_conditioning_scale,
            refiner_start_at=sample_config.refiner_start_at, extra_values=sample_config.extra_values,
            logger=None, num_frames=item.num_frames, fps=item.fps, ctrl_img=item.ctrl_img, ctrl_idx=item.ctrl_idx,
            ctrl_img_1=item.ctrl_img_1, ctrl_img_2=item.ctrl_img_2, ctrl_img_3=item.ctrl_img_3,
            do_cfg_norm=sample_config.do_cfg_norm))
    return out


def generate_images(sd, configs):
    """BaseModel.generate_images for a model without adapters: per config, seed, encode_prompt of the
    prompt and of the negative prompt, `.to(device, dtype=unet.dtype)`, generate_single_image,
    save_image_atomic, log_image."""
    pipeline = sd.get_generation_pipeline()
    for i, gen in enumerate(configs):
        generator = torch.manual_seed(gen.seed)
        cond = sd.encode_prompt(gen.prompt, prompt2=gen.prompt_2, force_all=True)
        uncond = sd.encode_prompt(gen.negative_prompt, prompt2=gen.negative_prompt_2, force_all=True)
        cond, uncond = cond.to(sd.device_torch, dtype=sd.unet.dtype), uncond.to(sd.device_torch, dtype=sd.unet.dtype)
        img = sd.generate_single_image(pipeline, gen, cond, uncond, generator, {})
        gen.save_image_atomic(img, i)
        gen.log_image(img, i)


# CI runs the sample and dataset defaults at a 64 px side and 2 steps (any multiple of the model's 16
# and any step count are valid; the exact 512 px / 20 steps / 512 px run is the slow case)
FULL = pytest.param({}, marks=pytest.mark.slow, id="exact-defaults")
SMALL = pytest.param({"width": 64, "height": 64, "sample_steps": 2}, id="64px-2steps")


@pytest.mark.parametrize("overrides", [SMALL, FULL])
def test_a_preview_from_sample_defaults(sd, tmp_path, overrides):
    """SampleConfig defaults: one frame, guidance 7, seed 0, jpg, and the negative prompt False (which
    the arch once rejected with a TypeError at the first preview); 512 x 512 and 20 steps (slow case)."""
    from PIL import Image
    from toolkit.config_modules import SampleConfig

    sample = SampleConfig(samples=[{"prompt": "a red square"}], **overrides)
    configs = sample_job_configs(sample, tmp_path / "samples")
    assert configs[0].negative_prompt is False and configs[0].num_frames == 1 and configs[0].guidance_scale == 7
    generate_images(sd, configs)
    (jpg,) = (tmp_path / "samples").glob("*.jpg")
    assert Image.open(jpg).size == (sample.width, sample.height)
    # False is the empty negative prompt
    assert torch.equal(sd.get_prompt_embeds([False]).text_embeds[0], sd.get_prompt_embeds([""]).text_embeds[0])
    assert torch.equal(sd.get_prompt_embeds(None).text_embeds[0], sd.get_prompt_embeds("").text_embeds[0])
    with pytest.raises(TypeError, match="a prompt must be a string"):
        sd.get_prompt_embeds([3])


def test_a_preview_from_generate_image_config_defaults(sd, tmp_path):
    """GenerateImageConfig's own defaults (guidance 7.5, seed -1 drawn at random, fps 15, empty negative
    prompt): an image; 64 px and 2 steps through the prompt's own flags, to keep it short."""
    from PIL import Image
    from toolkit.config_modules import GenerateImageConfig

    gen = GenerateImageConfig(prompt="a blue circle --steps 2 --w 64 --h 64", output_folder=str(tmp_path),
                              output_ext="png")
    generate_images(sd, [gen])
    (png,) = tmp_path.glob("*.png")
    assert Image.open(png).size == (64, 64) and gen.num_inference_steps == 2 and gen.fps == 15
    # a value our previews do not act on is said, not dropped silently
    gen = GenerateImageConfig(prompt="x --steps 1 --w 64 --h 64 --gr 0.7", output_folder=str(tmp_path / "gr"))
    with pytest.warns(UserWarning, match="ignore guidance_rescale=0.7"):
        generate_images(sd, [gen])


@pytest.mark.parametrize("side", [pytest.param(64, id="64px"), pytest.param(None, marks=pytest.mark.slow,
                                                                        id="exact-defaults")])
def test_a_training_step_from_train_and_dataset_defaults(sd, side):
    """TrainConfig defaults (noise_scheduler 'ddpm': set_timesteps on the arch's flow-matching scheduler,
    content_or_style 'balanced': a uniform index in [min_denoising_steps, max_denoising_steps)) and
    DatasetConfig defaults (one 512 px image per item, no i2v, latents encoded each step from pixels):
    BaseSDTrainProcess / SDTrainer's calls on the arch give our trainer's loss for the same t and noise."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from toolkit.config_modules import DatasetConfig, TrainConfig
    from toolkit.data_transfer_object.data_loader import DataLoaderBatchDTO

    from video_dit.diffusion.objective import flow_matching_loss

    train = TrainConfig()
    data = DatasetConfig(folder_path="data", **({"resolution": side} if side else {}))
    assert train.noise_scheduler != "flowmatch"
    # the real scheduler is diffusers' FlowMatchEulerDiscreteScheduler underneath; set_timesteps(1000) as
    # BaseSDTrainProcess calls it for a noise_scheduler other than flowmatch
    grid = FlowMatchEulerDiscreteScheduler(**{**sd.noise_scheduler.config})
    grid.set_timesteps(train.num_train_timesteps, device="cpu")
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(train.min_denoising_steps, train.max_denoising_steps, (2,), generator=g)
    t = grid.timesteps[idx]
    pixels = torch.rand(2, 3, data.resolution, data.resolution, generator=g) * 2 - 1  # (B, 3, H, W) images
    batch = DataLoaderBatchDTO(tensor=pixels, do_i2v=data.do_i2v, num_frames=data.num_frames)
    batch.latents = sd.encode_images(batch.tensor)  # not cached: encoded from pixels each step
    assert batch.latents.shape == (2, 16, 1, data.resolution // 8, data.resolution // 8)
    embeds = sd.get_prompt_embeds(["a red square", ""])
    noise = torch.randn(batch.latents.shape, generator=g)
    noisy = sd.add_noise(batch.latents, noise, t)  # BaseSDTrainProcess: per sample (BaseModel.add_noise)
    pred = sd.predict_noise(noisy, text_embeddings=embeds, timestep=t, batch=batch)
    target = sd.get_loss_target(noise=noise, batch=batch, timesteps=t)
    loss = sd.scale_loss(F.mse_loss(pred.float(), target.float(), reduction="none")).mean([1, 2, 3, 4]).mean()
    loss.backward()
    assert torch.isfinite(loss) and sd.model.head.head.weight.grad is not None
    with torch.no_grad():
        ours = flow_matching_loss(sd.model, batch.latents, embeds.text_embeds, t, noise)
    assert torch.allclose(loss.detach(), ours, rtol=1e-5)
    sd.model.zero_grad(set_to_none=True)


def test_our_trainer_accepts_ai_toolkits_defaults_of_shared_keys(tmp_path):
    """Our job file shares blocks with ai-toolkit's: a key both read must accept ai-toolkit's default."""
    from PIL import Image
    from toolkit.config_modules import DatasetConfig, SampleConfig, SaveConfig, TrainConfig

    from video_dit.data import DatasetConfig as OurDataset
    from video_dit.train.config import SampleConfig as OurSample
    from video_dit.train.config import SampleItem as OurItem
    from video_dit.train.config import SaveConfig as OurSave
    from video_dit.train.config import TrainConfig as OurTrain
    from video_dit.train.config import parse_job

    Image.new("RGB", (32, 32)).save(tmp_path / "a.png")
    ai = {"train": TrainConfig(), "sample": SampleConfig(samples=[{"prompt": "x"}]),
          "dataset": DatasetConfig(folder_path=str(tmp_path)), "save": SaveConfig()}
    item = ai["sample"].samples[0]

    def shared(ours, theirs, skip=()):
        import dataclasses

        keys = {f.name for f in dataclasses.fields(ours)} - set(skip)
        return {k: getattr(theirs, k) for k in keys if hasattr(theirs, k)}

    sample = shared(OurSample, ai["sample"], skip=("samples", "prompts", "format"))
    sample.update(format=ai["sample"].ext, samples=[shared(OurItem, item)])
    block = {"train": shared(OurTrain, ai["train"], skip=("ema_config",)),
             "sample": sample, "save": shared(OurSave, ai["save"]),
             "datasets": [shared(OurDataset, ai["dataset"])]}
    assert {"noise_scheduler", "timestep_type", "dtype", "lr"} <= set(block["train"])
    assert {"neg", "sampler", "sample_start_step"} <= set(block["sample"]) and "neg" in block["sample"]["samples"][0]
    assert {"cache_latents_to_disk", "cache_text_embeddings"} <= set(block["datasets"][0])
    job = parse_job({"job": "extension", "config": {"name": "j", "process": [{
        "training_folder": str(tmp_path / "out"),     # a full fine-tune: LoRA on a preset is refused
        "model": {"name_or_path": "preset:tiny"}, **block}]}})
    p = job.process
    assert p.sample.neg == "" and p.sample.samples[0].neg == ""  # False: no negative prompt
    assert p.train.timestep_type == "sigmoid" and p.datasets[0].cache_latents_to_disk is False
