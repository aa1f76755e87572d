"""HunyuanVideo 1.5 as the ai-toolkit arch (`arch: video_dit`, `model_kwargs.preset: hunyuan15-*`), against the
stand-in of the ai-toolkit types it touches (tests/aitk_standin): the same loss as our DeepSpeed trainer for
an i2v clip and a t2v one (text, glyphs, first frame, SigLIP), ai-toolkit's LoRA saved as our file (ComfyUI's
fused q/k/v keys) and loaded back unchanged, a preview from a control image, and a full fine-tune's save
that loads alone."""

from __future__ import annotations

import copy
import types

import aitk_standin
import helpers
import pytest
import torch
import torch.nn.functional as F
from test_aitk_adapter import aitk_lora_state_dict, merged

from video_dit.diffusion.flow import add_noise
from video_dit.families.hunyuan15 import FAMILY as HUNYUAN15
from video_dit.families.hunyuan15.conditioning import HY15Conditioning
from video_dit.families.hunyuan15.loading import load_hy15_dit
from video_dit.lora import load_lora
from video_dit.models.weights import read_state_dict

B, T, H, W = 1, 5, 32, 32  # pixels (1, 5, 3, 32, 32) -> latents (1, 4, 2, 2, 2) with the tiny HunyuanVideo VAE


@pytest.fixture(scope="module")
def sd(tmp_path_factory):
    aitk = aitk_standin.activate()
    from toolkit.config_modules import ModelConfig

    base = helpers.write_hy15_base(tmp_path_factory.mktemp("hy15_aitk") / "base.safetensors", "tiny-hy15-i2v")
    cfg = ModelConfig(name_or_path=str(base), arch="video_dit", dtype="fp32",
                      model_kwargs={"preset": "tiny-hy15-i2v"})
    model = aitk.VideoDiTModel(device="cpu", model_config=cfg, dtype="fp32",
                               noise_scheduler=aitk.VideoDiTModel.get_train_scheduler())
    model.load_model()
    yield model
    aitk_standin.deactivate()


def clip(seed: int = 0) -> torch.Tensor:
    """(1, T, 3, H, W) smooth frames in [-1, 1], as ai-toolkit's loader delivers them."""
    g = torch.Generator().manual_seed(seed)
    small = torch.rand(T, 3, H // 8, W // 8, generator=g) * 2 - 1
    return F.interpolate(small, size=(H, W), mode="bilinear")[None]


def test_the_arch_names_hunyuan15s_modules(sd):
    assert sd.target_lora_modules == ["HunyuanVideo15DiT"] and sd.get_transformer_block_names() == ["double_blocks"]
    assert {"img_in*", "txt_in*", "final_layer*", "time_in*"} <= set(sd.get_quantization_exclude_modules())
    assert sd.get_bucket_divisibility() == 16 and isinstance(sd.conditioning, HY15Conditioning)
    embeds = sd.get_prompt_embeds(['a sign that says "HI"', "a cat"])
    assert embeds.keys() == ["text_embeds", "glyph_embeds"]
    assert embeds.glyph_embeds[0].shape[0] > 0 and embeds.glyph_embeds[1].shape[0] == 0  # quoted text only


@pytest.mark.parametrize("do_i2v", [True, False], ids=["i2v", "t2v"])
def test_the_same_loss_as_our_trainer(sd, do_i2v):
    """One item through our trainer's `loss_at` (the tensors our caches hold: latents, text and glyph states,
    first-frame latent and SigLIP embeds) and through the arch (ai-toolkit's batch: pixels, latents,
    prompt embeds; the conditioning computed from the pixels), same DiT, t and noise: equal losses."""
    from toolkit.data_transfer_object.data_loader import DataLoaderBatchDTO

    from video_dit.train.trainer import Trainer, job_conditioning

    pixels = clip()
    video = pixels.permute(0, 2, 1, 3, 4)  # (1, 3, T, H, W), as build_cache encodes it
    embeds = sd.get_prompt_embeds(['a sign that says "OPEN"'])
    training = HUNYUAN15.training
    trainer = Trainer.__new__(Trainer)  # only what loss_at reads
    trainer.device, trainer.engine, trainer.family, trainer.dit_config = torch.device("cpu"), sd.model, HUNYUAN15, \
        sd.model.config
    process = types.SimpleNamespace(datasets=[types.SimpleNamespace(do_i2v=do_i2v)], i2v_mode="concat", flf2v=False,
                                    model=types.SimpleNamespace(mask_first_frame_loss=None))
    trainer.conditioning = job_conditioning(process, sd.model.config, training)
    trainer.timesteps = types.SimpleNamespace(loss_weight=torch.ones_like)
    trainer.dataset = types.SimpleNamespace(item=lambda i: types.SimpleNamespace(conditioned=do_i2v))
    t = torch.tensor([640.0])
    with torch.no_grad():
        latents = sd.vae.normalize(sd.vae.encode(video).mode())
        cached = {"latents": latents, "text_embeds": embeds.text_embeds, "glyph_embeds": embeds.glyph_embeds,
                  "index": torch.tensor([0])}
        if do_i2v:
            cached.update(training.cache_item(sd.vae, video, "concat", False, sd.image_encoder))
        noise = torch.randn(latents.shape, generator=torch.Generator().manual_seed(5))
        ours = trainer.loss_at(cached, t, noise)
        batch = DataLoaderBatchDTO(tensor=pixels, latents=latents, do_i2v=do_i2v, num_frames=T)
        pred = sd.get_noise_prediction(add_noise(latents, noise, t), t, embeds, batch=batch)
        theirs = sd.scale_loss(F.mse_loss(pred, sd.get_loss_target(noise=noise, batch=batch), reduction="none")).mean()
        unconditioned = sd.get_noise_prediction(add_noise(latents, noise, t), t, embeds, batch=None)
    assert torch.isfinite(ours) and torch.allclose(ours, theirs, rtol=1e-5), (ours, theirs)
    assert torch.equal(pred, unconditioned) != do_i2v  # the first frame and SigLIP change the prediction


def test_lora_saved_as_our_file_and_loaded_back(sd, tmp_path):
    """ai-toolkit's peft LoRA (every Linear of the double blocks) -> our file: q / k / v fused as ComfyUI's
    HunyuanVideo keys, which our loader reads into the same model; and back to ai-toolkit's keys unchanged."""
    from safetensors.torch import save_file

    dit = copy.deepcopy(sd.model)
    ai_sd = aitk_lora_state_dict(sd, dit, rank=4, gen=torch.Generator().manual_seed(0))
    saved = sd.convert_lora_weights_before_save(ai_sd)
    assert any(k.endswith("double_blocks.0.img_attn_qkv.lora_A.weight") for k in saved)
    assert not any("_attn_q.lora" in k for k in saved)
    path = tmp_path / "aitk.safetensors"
    save_file(saved, str(path))
    # adapters on the file's own modules (ai-toolkit's every Linear, the modulation included), fused q / k / v split
    ours = load_lora(path, copy.deepcopy(dit), from_file=HUNYUAN15.lora_from_file)
    x, t = torch.randn(1, 2 * 4 + 1, 2, 2, 2), torch.tensor([400.0])
    context = torch.randn(1, 6, sd.model.config.text_states_dim)
    with torch.no_grad():
        assert torch.allclose(ours(x, t, context), merged(dit, ai_sd)(x, t, context), atol=1e-5)
    back = sd.convert_lora_weights_before_load(read_state_dict(path))
    assert back.keys() == ai_sd.keys() and all(torch.allclose(back[k], ai_sd[k]) for k in ai_sd)


def test_preview_from_a_control_image_and_full_save(sd, tmp_path):
    from PIL import Image
    from toolkit.config_modules import GenerateImageConfig

    ctrl = tmp_path / "first.png"
    Image.new("RGB", (40, 40), (200, 30, 30)).save(ctrl)
    gen_config = GenerateImageConfig(prompt='a sign that says "HI"', width=40, height=40, num_inference_steps=2,
                                     guidance_scale=2.0, seed=3, ctrl_img=str(ctrl), num_frames=7, fps=24,
                                     output_folder=str(tmp_path / "samples"), output_ext="webp")
    cond, uncond = sd.get_prompt_embeds([gen_config.prompt]), sd.get_prompt_embeds([""])
    frames = sd.generate_single_image(sd.get_generation_pipeline(), gen_config, cond, uncond, torch.manual_seed(3), {})
    # (the config rounds sizes to multiples of 8, at least 64, as ai-toolkit's; the frames snap to 4k + 1)
    assert gen_config.num_frames == 5 and (gen_config.width, gen_config.height) == (64, 64)
    assert len(frames) == 5 and frames[0].size == (64, 64)
    folder = tmp_path / "full"
    sd.save_model(str(folder), {"step": 1}, torch.float32)
    reloaded = load_hy15_dit(folder)
    assert all(torch.equal(v, sd.model.state_dict()[k]) for k, v in reloaded.state_dict().items())
