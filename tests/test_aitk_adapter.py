"""The ai-toolkit adapter against a stand-in of the ai-toolkit types it touches (tests/aitk_standin,
written from aitk-contract.md): one training step in the contract's call order, the i2v paths and
their guards, a preview written as MP4, and LoRA files shared with our DeepSpeed trainer."""

from __future__ import annotations

import copy
import os
import types
import warnings
from pathlib import Path

import aitk_standin
import helpers
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from video_dit.diffusion.conditioning import masked_mse
from video_dit.diffusion.flow import add_noise
from video_dit.families.wan import FAMILY as WAN
from video_dit.families.wan.dit import LORA_TARGETS as WAN_LORA_TARGETS
from video_dit.lora import add_lora, lora_state_dict, save_lora
from video_dit.models.weights import WeightsError, read_state_dict
from video_dit.typed_config import ConfigError

B, T, H, W = 2, 5, 16, 16  # pixels (B, T, 3, H, W) -> latents (B, 16, 2, 2, 2) with the tiny preset


@pytest.fixture(scope="module")
def aitk():
    yield aitk_standin.activate()
    aitk_standin.deactivate()


def build(aitk, train_dtype="fp32", **model):
    from toolkit.config_modules import ModelConfig

    cfg = ModelConfig(**{"name_or_path": "preset:tiny", "arch": "video_dit", "dtype": "fp32", **model})
    # as BaseSDTrainProcess.run: the scheduler comes from the class, before the model exists, and
    # the model gets train.dtype
    return aitk.VideoDiTModel(device="cpu", model_config=cfg, dtype=train_dtype,
                              noise_scheduler=aitk.VideoDiTModel.get_train_scheduler())


@pytest.fixture(scope="module")
def sd(aitk):
    """The loaded tiny model, its head randomised (the zero-initialised head of a fresh DiT predicts
    0 and passes no gradient back to the blocks' LoRA)."""
    model = build(aitk)
    model.load_model()
    helpers.randomize_head(model.model)
    return model


def video_batch(seed=0, **kw):
    from toolkit.data_transfer_object.data_loader import DataLoaderBatchDTO

    g = torch.Generator().manual_seed(seed)
    # smooth-ish frames in [-1, 1], as ai-toolkit's loader delivers them: (B, T, 3, H, W) float32 CPU
    base = torch.rand(B, 1, 3, H // 4, W // 4, generator=g)
    drift = torch.linspace(0, 1, T).view(1, T, 1, 1, 1) * torch.rand(B, 1, 3, 1, 1, generator=g)
    small = (base + drift).clamp(0, 1) * 2 - 1
    tensor = F.interpolate(small.flatten(0, 1), size=(H, W), mode="bilinear").view(B, T, 3, H, W)
    return DataLoaderBatchDTO(tensor=tensor, num_frames=T, **kw)


def per_token(t, frames, tokens_per_frame, first=0.0):
    """(B,) -> (B, L): the clip's t on every token, `first` on latent frame 0's tokens."""
    tt = t.view(-1, 1).repeat(1, frames * tokens_per_frame).clone()
    tt[:, :tokens_per_frame] = first
    return tt


def test_flags_are_instance_attributes_set_after_base_init(aitk):
    model = build(aitk)
    # BaseModel.__init__ assigns these; a class attribute would have been shadowed
    assert model.is_flow_matching and model.is_transformer and model.use_old_lokr_format is False
    assert model.target_lora_modules == ["VideoDiT"] and model.arch == "video_dit"
    assert model.get_transformer_block_names() == ["blocks"]
    assert model.get_bucket_divisibility() == 16 and model.get_frame_count_snapper()(20) == 17
    assert build(aitk, arch="video_dit:tiny").arch == "video_dit"  # the UI's arch:tag form


def test_frame_count_snapper_is_ai_toolkits_own_rule_for_a_4x_vae(aitk):
    """ai-toolkit 27a03a91, toolkit/dataloader_mixins.py get_auto_frame_count: without a model snapper,
    `max(0, n - 1) // 4 * 4 + 1` (trim_auto_frame_count_tail: never above the clip). The arch's snapper
    replaces that rule, so it must give the same counts, 0 included (a clip under one frame at the fps)."""
    import pickle

    snap = build(aitk).get_frame_count_snapper()
    assert [snap(n) for n in range(0, 100)] == [max(0, n - 1) // 4 * 4 + 1 for n in range(0, 100)]
    assert pickle.loads(pickle.dumps(snap))(18) == 17  # ai-toolkit's dataloader workers pickle it


def test_components_have_the_surface_ai_toolkit_touches(sd):
    """load_model's outputs as BaseSDTrainProcess / SDTrainer use them (device and dtype reads,
    moves, freezing), and the model aliases."""
    assert sd.unet is sd.model and sd.transformer is sd.model and sd.pipeline is not None
    for module in (sd.model, sd.vae, sd.text_encoder):
        assert module.device == torch.device("cpu") and module.dtype == torch.float32
    sd.vae.to("cpu", dtype=torch.float32)
    assert not sd.text_encoder.training and not any(p.requires_grad for p in sd.vae.parameters())
    assert hasattr(sd.model, "enable_gradient_checkpointing") and sd.tokenizer is sd.text_encoder.tokenizer
    assert sd.latent_space_version.startswith("video_dit.vae") and sd.text_embedding_space_version != sd.arch


def test_model_kwargs_are_checked(aitk):
    with pytest.raises(ConfigError, match=r"model\.model_kwargs\.i2v_mod.*did you mean 'i2v_mode'"):
        build(aitk, model_kwargs={"i2v_mod": "replace"})
    with pytest.raises(ConfigError, match=r"model\.model_kwargs\.i2v_mode.*'concat' does not fit preset 'tiny'"):
        build(aitk, model_kwargs={"i2v_mode": "concat"})
    with pytest.raises(ConfigError, match=r"model\.model_kwargs\.preset.*required when model\.name_or_path is a weights path"):
        build(aitk, name_or_path="/weights/dit.safetensors")
    with pytest.raises(ConfigError, match=r"contradicts"):
        build(aitk, model_kwargs={"preset": "wan2.1-t2v-1.3b"})
    assert build(aitk, name_or_path="preset:wan2.2-i2v-a14b").i2v_mode == "concat"


def test_training_step_in_contract_order(sd):
    """encode_images -> get_prompt_embeds -> add noise -> predict_noise(batch=...) -> get_loss_target
    -> scale_loss -> backward, with a peft LoRA on the DiT standing in for ai-toolkit's network."""
    dit = sd.model
    base = copy.deepcopy(dit.state_dict())
    add_lora(dit, rank=4, targets=WAN_LORA_TARGETS)
    try:
        batch = video_batch(do_i2v=True)
        # 1. latents from pixels (the uncached path: BaseSDTrainProcess calls encode_images(batch.tensor))
        batch.latents = sd.encode_images(batch.tensor)
        assert batch.latents.shape == (B, 16, 2, 2, 2)
        # 2. per-prompt 2D embeds, each at its own length
        embeds = sd.get_prompt_embeds(["a red square moving right", ""])
        assert [e.ndim for e in embeds.text_embeds] == [2, 2]
        assert embeds.text_embeds[0].shape[0] > embeds.text_embeds[1].shape[0]
        # 3. ai-toolkit's flowmatch timesteps (the shared job's `timestep_type: shift`, 0..1000 floats)
        # and noise, added by BaseModel.add_noise one sample at a time: the same x_t as our flow module
        timesteps = sd.noise_scheduler.set_train_timesteps(1000, "cpu", timestep_type="shift",
                                                           latents=batch.latents)[torch.tensor([150, 700])]
        noise = torch.randn_like(batch.latents)
        noisy = sd.add_noise(batch.latents, noise, timesteps)
        assert torch.allclose(noisy, add_noise(batch.latents, noise, timesteps), atol=1e-6)
        # 4. the prediction, through BaseModel.predict_noise (which passes batch= only if it is declared)
        pred = sd.predict_noise(noisy, text_embeddings=embeds, timestep=timesteps, batch=batch)
        assert pred.shape == batch.latents.shape
        mask = sd._i2v_loss_mask
        assert mask.shape == (B, 1, 2, 2, 2) and mask[:, :, 0].abs().sum() == 0 and mask[:, :, 1:].min() == 1
        # the conditioning, re-derived by hand: clean latent frame 0 (the causal VAE encodes frame 0
        # alone), t = 0 on its tokens
        first = sd.encode_images(batch.tensor[:, :1])
        assert torch.allclose(first, batch.latents[:, :, :1], atol=1e-5)
        with torch.no_grad():
            by_hand = dit(torch.cat([first, noisy[:, :, 1:]], dim=2), per_token(timesteps, 2, 1), embeds.text_embeds)
        assert torch.allclose(pred, by_hand, atol=1e-5)
        # 5.-6. the loss as SDTrainer.calculate_loss computes it equals our trainer's masked MSE
        target = sd.get_loss_target(noise=noise, batch=batch, timesteps=timesteps)
        assert torch.equal(target, noise - batch.latents)
        loss = F.mse_loss(pred.float(), target.float(), reduction="none")
        loss = sd.scale_loss(loss).mean([1, 2, 3, 4]).mean()
        assert sd._i2v_loss_mask is None  # consumed
        assert torch.allclose(loss, masked_mse(pred, target, mask), rtol=1e-5)
        # 7. backward reaches the LoRA only
        loss.backward()
        grads = {n: p.grad for n, p in dit.named_parameters() if p.grad is not None}
        assert grads and all(".lora_" in n for n in grads)
        assert any(g.abs().sum() > 0 for n, g in grads.items() if "lora_B" in n)
        assert sd.get_model_has_grad() is False and sd.get_te_has_grad() is False
    finally:
        sd.model = type(dit)(dit.config)
        sd.model.load_state_dict(base)
        sd.pipeline = sd.get_generation_pipeline()


def test_standin_scheduler_and_add_noise_are_ai_toolkits(sd):
    """The stand-in behaves as ai-toolkit 27a03a91 where the arch depends on it (see its README).

    - `shift` (the shared job's timestep type): custom_flowmatch_sampler.set_train_timesteps takes
      linspace(sigma_max, sigma_min) of the diffusers scheduler built with the arch's shift 3, and
      shifts it again: t_i = 1000 * shift(s_i), s_i = linspace(1, shift(1/1000), 1000), derived here.
    - `add_noise`: the scheduler's own does not reshape t, so a (B,) timestep for B > 1 broadcasts
      against the last latent dim (wrong); BaseModel.add_noise, which the trainer calls, goes one
      sample at a time and is right. A test calling the scheduler directly would decide nothing."""
    import math

    def shifted(s, k=3.0):
        return k * s / (1 + (k - 1) * s)

    grid = sd.noise_scheduler.set_train_timesteps(1000, "cpu", timestep_type="shift")
    s = torch.linspace(1.0, shifted(1 / 1000), 1000, dtype=torch.float64)
    torch.testing.assert_close(grid.double(), 1000 * shifted(s), rtol=0, atol=1e-3)
    assert grid[0] == 1000 and math.isclose(grid[-1].item(), 1000 * shifted(shifted(1 / 1000)), rel_tol=1e-4)
    assert sd.noise_scheduler.sigmas[-1] == 0 and len(sd.noise_scheduler.sigmas) == 1001
    assert torch.equal(sd.noise_scheduler.set_train_timesteps(7, "cpu", timestep_type="linear"),
                       torch.linspace(1000, 1, 7))
    with pytest.raises(NotImplementedError, match="lognorm_blend"):
        sd.noise_scheduler.set_train_timesteps(1000, "cpu", timestep_type="lognorm_blend")

    g = torch.Generator().manual_seed(0)
    x0, noise = torch.randn(3, 16, 2, 2, 3, generator=g), torch.randn(3, 16, 2, 2, 3, generator=g)
    t = torch.tensor([100.0, 500.0, 900.0])  # W = 3 = B: the direct call broadcasts without an error
    assert torch.allclose(sd.add_noise(x0, noise, t), add_noise(x0, noise, t), atol=1e-6)
    assert not torch.allclose(sd.noise_scheduler.add_noise(x0, noise, t), add_noise(x0, noise, t), atol=1e-3)
    assert torch.allclose(sd.add_noise(x0, noise, t[:1]), add_noise(x0, noise, t[:1].expand(3)), atol=1e-6)
    assert torch.equal(sd.noise_scheduler.scale_model_input(x0, t), x0)


def test_predict_noise_keeps_the_model_dtypes_ai_toolkit_would_cast(aitk):
    """ai-toolkit's predict_noise casts the whole model to `torch_dtype` whenever `unet.dtype`
    differs (base_model.py L950-951): the arch must report the dtype it was loaded in, or every step
    would re-cast it (and any float32 parameters kept on purpose would become bf16)."""
    model = build(aitk, train_dtype="bf16")
    model.load_model()
    before = {n: p.dtype for n, p in model.model.named_parameters()}
    assert before["time_projection.1.weight"] == torch.float32 and before["blocks.0.ffn.0.weight"] == torch.bfloat16
    # ai-toolkit's trainer then casts the model whole (BaseSDTrainProcess after load_model, base_model
    # after each preview): the float32 islands survive it
    model.unet.to(model.device_torch, dtype=model.torch_dtype)
    assert {n: p.dtype for n, p in model.model.named_parameters()} == before
    embeds = model.get_prompt_embeds(["a red square"])
    x = torch.randn(1, 16, 2, 2, 2, dtype=torch.bfloat16)
    with torch.no_grad():
        pred = model.predict_noise(x, text_embeddings=embeds, timestep=torch.tensor([500.0]), batch=None)
    assert {n: p.dtype for n, p in model.model.named_parameters()} == before
    assert pred.shape == x.shape and bool(pred.float().isfinite().all())


def test_cached_first_frame_latents_condition_like_pixels(sd):
    """Cached latents + do_i2v give batch.first_frame_latents (no pixels): same prediction."""
    from toolkit.data_transfer_object.data_loader import DataLoaderBatchDTO

    pixels = video_batch(seed=1, do_i2v=True)
    latents = sd.encode_images(pixels.tensor)
    cached = DataLoaderBatchDTO(latents=latents, first_frame_latents=sd.encode_images(pixels.tensor[:, 0]),
                                do_i2v=True, num_frames=T)
    assert cached.first_frame_latents.shape == (B, 16, 1, 2, 2)
    embeds = sd.get_prompt_embeds(["a", "b"])
    t = torch.tensor([300.0, 900.0])
    noisy = add_noise(latents, torch.randn_like(latents), t)
    with torch.no_grad():
        a = sd.predict_noise(noisy, text_embeddings=embeds, timestep=t, batch=pixels)
        b = sd.predict_noise(noisy, text_embeddings=embeds, timestep=t, batch=cached)
        plain = sd.predict_noise(noisy, text_embeddings=embeds, timestep=t, batch=None)
    assert torch.allclose(a, b, atol=1e-5)
    assert not torch.allclose(a, plain, atol=1e-3)  # the conditioning changed the prediction


def test_guards_no_batch_images_t2v_cfg(sd):
    from toolkit.data_transfer_object.data_loader import DataLoaderBatchDTO

    embeds = sd.get_prompt_embeds(["a", "b"])
    t = torch.tensor([500.0, 500.0])
    video = sd.encode_images(video_batch(seed=2).tensor)
    with torch.no_grad():
        # batch=None (validate() calls predict_noise without one): plain t2v, no loss mask
        plain = sd.get_noise_prediction(video, t, embeds, batch=None)
        assert sd._i2v_loss_mask is None
        assert torch.allclose(plain, sd.model(video, t, embeds.text_embeds), atol=1e-6)
        # a t2v dataset (do_i2v false): the same
        assert torch.allclose(sd.get_noise_prediction(video, t, embeds, batch=DataLoaderBatchDTO(do_i2v=False)), plain)
        # image items in a do_i2v dataset with cached latents: no first_frame_latents, no pixels,
        # one latent frame -> trained unconditioned instead of raising on frames.shape
        image_latents = torch.randn(B, 16, 1, 2, 2)
        images = DataLoaderBatchDTO(latents=image_latents, do_i2v=True)
        out = sd.get_noise_prediction(image_latents, t, embeds, batch=images)
        assert out.shape == image_latents.shape and sd._i2v_loss_mask is None
        assert sd.scale_loss(torch.ones(B, 16, 1, 2, 2)).eq(1).all()
        # image items with pixels (B, 3, H, W): encode_images makes one latent frame; same guard
        pix = DataLoaderBatchDTO(tensor=torch.rand(B, 3, H, W) * 2 - 1, do_i2v=True)
        lat = sd.encode_images(pix.tensor)
        assert lat.shape == (B, 16, 1, 2, 2)
        sd.get_noise_prediction(lat, t, embeds, batch=pix)
        assert sd._i2v_loss_mask is None
        # CFG: predict_noise doubles the latents; the first frames are doubled to match
        cfg_embeds = sd.get_prompt_embeds(["", "", "a", "b"])
        i2v = video_batch(seed=2, do_i2v=True)
        guided = sd.predict_noise(video, text_embeddings=cfg_embeds, timestep=t, batch=i2v, guidance_scale=3.0)
        assert guided.shape == video.shape and sd._i2v_loss_mask.shape[0] == 2 * B
    # a video item with neither cached first frame nor pixels cannot be conditioned: say how to fix it
    with pytest.raises(ValueError, match="cache_tensors_to_disk"):
        sd.get_noise_prediction(video, t, embeds, batch=DataLoaderBatchDTO(latents=video, do_i2v=True))
    with pytest.raises(TypeError, match="down_block_additional_residuals"):
        sd.get_noise_prediction(video, t, embeds, batch=None, down_block_additional_residuals=[])
    with pytest.raises(ValueError, match="a clip of 8 frames cannot be encoded by this VAE; set datasets\\[\\].num_frames to 5"):
        sd.encode_images(torch.zeros(1, 8, 3, H, W))


def test_preview_is_an_mp4_of_snapped_frames_from_the_control_image(sd, tmp_path):
    """generate_images' calls: get_generation_pipeline -> embeds -> generate_single_image ->
    gen_config.save_image_atomic (which our replaced save_image serves, as LTX2's does)."""
    from PIL import Image
    from toolkit.config_modules import GenerateImageConfig

    from video_dit.media import probe_video, read_video

    ctrl = tmp_path / "first.png"
    yy, xx = torch.meshgrid(torch.linspace(0, 1, 48), torch.linspace(0, 1, 48), indexing="ij")
    rgb = torch.stack([xx, yy, 1 - xx]).mul(255).byte().permute(1, 2, 0).numpy()
    Image.fromarray(rgb).save(ctrl)

    def preview(ctrl_img, num_frames=7):
        # the real config rounds sizes down to multiples of 8, at least 64: 72 x 64 -> (snapped) 64 x 64
        gen_config = GenerateImageConfig(prompt="a red square moving right", width=72, height=64,
                                         num_inference_steps=2, guidance_scale=2.0, seed=3, ctrl_img=ctrl_img,
                                         num_frames=num_frames, fps=8, output_folder=str(tmp_path / "samples"),
                                         output_ext="webp")
        pipeline = sd.get_generation_pipeline()
        cond, uncond = sd.get_prompt_embeds([gen_config.prompt]), sd.get_prompt_embeds([""])
        img = sd.generate_single_image(pipeline, gen_config, cond, uncond, torch.manual_seed(3), {})
        return gen_config, img

    gen_config, frames = preview(str(ctrl))
    assert gen_config.num_frames == 5 and (gen_config.width, gen_config.height) == (64, 64)
    assert isinstance(frames, list) and len(frames) == 5 and frames[0].size == (64, 64)
    gen_config.save_image_atomic(frames, 0)
    (mp4,) = (tmp_path / "samples").glob("*.mp4")
    assert not list((tmp_path / "samples").glob("*.webp"))
    info = probe_video(mp4)
    assert (info.num_frames, info.width, info.height) == (5, 64, 64)
    # i2v: frame 0 is the VAE round trip of the control image (resized to 64x64)
    from video_dit.diffusion.pipeline_parts import fit_frame
    from video_dit.media import load_image, pil_to_tensor

    pixels = fit_frame(pil_to_tensor(load_image(ctrl))[None], 64, 64)  # (1, 3, 64, 64)
    round_trip = sd.decode_latents(sd.encode_images(pixels))[0, :, 0]  # (3, 64, 64)
    frame0 = pil_to_tensor(frames[0])
    assert (frame0 - round_trip).abs().mean() < 0.02
    assert (read_video(mp4)[0] - round_trip).abs().mean() < 0.1  # through H.264
    # one frame: one PIL image, ai-toolkit's own writer untouched
    single_config, single = preview(str(ctrl), num_frames=1)
    assert isinstance(single, Image.Image) and single_config.output_ext == "webp"


def aitk_lora_state_dict(sd, dit, rank, gen):
    """What ai-toolkit's LoRASpecialNetwork saves for this model, before the model's conversion:
    every Linear inside a module whose class is in `target_lora_modules` whose dotted name contains
    one of `get_transformer_block_names()` (transformer_only), peft format, no alpha
    (toolkit/lora_special.py, toolkit/network_mixins.py at the contract's commit)."""
    out = {}
    for name, module in dit.named_modules():
        if type(module).__name__ not in sd.target_lora_modules:
            continue
        for child_name, child in module.named_modules():
            clean = ".".join(x for x in ("transformer", name, child_name) if x)
            if type(child).__name__ != "Linear" or not any(b in clean for b in sd.get_transformer_block_names()):
                continue
            out[f"{clean}.lora_A.weight"] = torch.randn(rank, child.in_features, generator=gen) * 0.1
            out[f"{clean}.lora_B.weight"] = torch.randn(child.out_features, rank, generator=gen) * 0.1
    return out


def merged(dit, peft_sd):
    """A copy of `dit` with ai-toolkit's update W + B @ A (scale 1) merged in."""
    out = copy.deepcopy(dit)
    params = dict(out.named_parameters())
    with torch.no_grad():
        for key, a in peft_sd.items():
            if key.endswith(".lora_A.weight"):
                module = key[len("transformer."):-len(".lora_A.weight")]
                params[module + ".weight"] += peft_sd[key.replace("lora_A", "lora_B")] @ a
    return out


def test_lora_files_are_shared_with_the_deepspeed_trainer(sd, tmp_path):
    from video_dit.lora import load_lora

    dit = type(sd.model)(sd.model.config)
    dit.load_state_dict(sd.model.state_dict())
    x, t = torch.randn(1, 16, 2, 2, 2), torch.tensor([400.0])
    ctx = sd.get_prompt_embeds(["a"]).text_embeds
    gen = torch.Generator().manual_seed(0)

    # ai-toolkit -> file: the keys are exactly those our trainer exports for the same rank
    ai_sd = aitk_lora_state_dict(sd, dit, rank=4, gen=gen)
    saved = sd.convert_lora_weights_before_save(ai_sd)
    trainer = add_lora(copy.deepcopy(dit), rank=4, alpha=4, targets=WAN_LORA_TARGETS)
    trainer_file = save_lora(tmp_path / "trainer.safetensors", trainer, alpha=4)
    assert set(saved) == set(read_state_dict(trainer_file))
    # ... and our loader reproduces ai-toolkit's model from it
    from safetensors.torch import save_file

    save_file(saved, str(tmp_path / "aitk.safetensors"))
    ours = load_lora(tmp_path / "aitk.safetensors", copy.deepcopy(dit))
    with torch.no_grad():
        assert torch.allclose(ours(x, t, ctx), merged(dit, ai_sd)(x, t, ctx), atol=1e-5)

    # file (trained with alpha != rank) -> ai-toolkit: the same key set ai-toolkit builds, and with
    # ai-toolkit's scale of 1 the same model as our trainer's
    trained = add_lora(copy.deepcopy(dit), rank=4, alpha=8, targets=WAN_LORA_TARGETS)
    with torch.no_grad():
        for n, p in trained.named_parameters():
            if "lora_" in n:
                p.normal_(std=0.1, generator=gen)
    path = save_lora(tmp_path / "alpha8.safetensors", trained, alpha=8)
    loaded = sd.convert_lora_weights_before_load(read_state_dict(path))
    assert set(loaded) == set(ai_sd)
    with torch.no_grad():
        assert torch.allclose(merged(dit, loaded)(x, t, ctx), trained(x, t, ctx), atol=1e-5)
    # round trip: what ai-toolkit saves after loading is the file's update again (alpha = rank now)
    again = sd.convert_lora_weights_before_load(sd.convert_lora_weights_before_save(loaded))
    assert all(torch.allclose(again[k], loaded[k]) for k in loaded)
    assert lora_state_dict(trained).keys() == {k[len("transformer."):] for k in loaded}

    with pytest.raises(WeightsError, match="lokr_w1"):
        sd.convert_lora_weights_before_save({"transformer.blocks.0.self_attn.q.lokr_w1": torch.zeros(2, 2)})


def test_full_fine_tune_save_reloads_alone(aitk, sd, tmp_path):
    import json
    from collections import OrderedDict

    import yaml

    # ai-toolkit's default save_format (safetensors) passes the meta as get_meta_for_safetensors made it:
    # an OrderedDict, non-string values as JSON strings (toolkit/metadata.py); the save folder is
    # named like the file would be
    meta = OrderedDict(name="test", training_info=json.dumps({"step": 10, "epoch": 0}), format="pt",
                       software=json.dumps({"name": "ai-toolkit"}))
    out = tmp_path / "aitk_tiny_000000010.safetensors"
    sd.save_model(str(out), meta, torch.float32)
    # ai-toolkit's resume (BaseSDTrainProcess.load_training_state_from_metadata) reads the step here
    with open(out / "aitk_meta.yaml") as f:
        saved = yaml.load(f, Loader=yaml.FullLoader)
    assert saved["training_info"]["step"] == 10 and saved["name"] == "test"
    again = build(aitk, name_or_path=str(out))  # ai-toolkit's resume points name_or_path at the save
    again.load_model()
    x, t = torch.randn(1, 16, 2, 2, 2), torch.tensor([250.0])
    ctx = sd.get_prompt_embeds(["a"]).text_embeds
    reloaded, trained = again.model.state_dict(), sd.model.state_dict()
    assert reloaded.keys() == trained.keys() and all(torch.equal(reloaded[k], trained[k]) for k in trained)
    with torch.no_grad():
        assert torch.allclose(again.model(x, t, ctx), sd.model(x, t, ctx), atol=1e-6)
    assert again.sources == sd.sources


def test_wan21_flf2v_clip_model_through_ai_toolkit(aitk, tmp_path):
    """A Wan 2.1 FLF2V-layout preset (concat + CLIP image branch, first and last frame): the training
    prediction is the DiT on [noisy | mask(first, last) | VAE(first, zeros, last)] with the CLIP
    features of batch.tensor's first and last frames, built here from the parts by hand; a preview
    takes ctrl_img and ctrl_img_2 (the last frame; that it conditions the video is checked against
    diffusers in tests/test_sampling_reference.py)."""
    from PIL import Image
    from toolkit.config_modules import GenerateImageConfig

    from video_dit.diffusion.conditioning import pack_frame_mask

    model = build(aitk, name_or_path="preset:tiny-clip-flf2v")
    model.load_model()
    helpers.randomize_head(model.model)
    assert model.image_encoder is not None and model.conditioning.last_frame
    batch = video_batch(do_i2v=True)
    batch.latents = model.encode_images(batch.tensor)
    embeds = model.get_prompt_embeds(["a red square moving right", "a blue circle"])
    t = torch.tensor([300.0, 800.0])
    noisy = add_noise(batch.latents, torch.randn_like(batch.latents), t)
    pred = model.predict_noise(noisy, text_embeddings=embeds, timestep=t, batch=batch)
    frames = batch.tensor.permute(0, 2, 1, 3, 4)  # (B, 3, T, H, W)
    with torch.no_grad():
        video = torch.cat([frames[:, :, :1], torch.zeros_like(frames[:, :, 1:-1]), frames[:, :, -1:]], dim=2)
        cond_latents = model.vae.normalize(model.vae.encode(video).mode())
        frame_mask = torch.zeros(B, T, H // 8, W // 8)
        frame_mask[:, 0] = frame_mask[:, -1] = 1
        clip = torch.cat([model.image_encoder.encode(frames[:, :, 0]), model.image_encoder.encode(frames[:, :, -1])], 1)
        by_hand = model.model(torch.cat([noisy, pack_frame_mask(frame_mask), cond_latents], dim=1), t,
                              embeds.text_embeds, clip_fea=clip)
    assert clip.shape == (B, 34, 32)
    torch.testing.assert_close(pred, by_hand, rtol=1e-5, atol=1e-5)

    first, last = tmp_path / "first.png", tmp_path / "last.png"
    Image.new("RGB", (64, 64), (200, 30, 30)).save(first)
    Image.new("RGB", (64, 64), (30, 30, 200)).save(last)
    gen_config = GenerateImageConfig(prompt="a square", width=64, height=64, num_inference_steps=2,
                                     guidance_scale=2.0, seed=3, ctrl_img=str(first), ctrl_img_2=str(last),
                                     num_frames=5, fps=8, output_folder=str(tmp_path / "samples"))
    cond, uncond = model.get_prompt_embeds([gen_config.prompt]), model.get_prompt_embeds([""])
    frames = model.generate_single_image(model.get_generation_pipeline(), gen_config, cond, uncond,
                                         torch.manual_seed(3), {})
    assert len(frames) == 5 and frames[0].size == (64, 64)
    gen_config.ctrl_img_2 = None
    with pytest.raises(ValueError, match="first-last-frame"):  # an FLF2V preview needs its last frame
        model.generate_single_image(model.get_generation_pipeline(), gen_config, cond, uncond,
                                    torch.manual_seed(3), {})


def test_a_mixed_i2v_folder_trains_stills_unconditioned_in_both_trainers(sd, tmp_path):
    """A do_i2v folder of a clip and a still, each item through our trainer's `loss_at` and
    through the ai-toolkit arch, from the latents and first-frame latents `build_cache` stores (ai-toolkit's
    cached-latent batches carry the same: `first_frame_latents` for clips only), same DiT, t and noise:
    equal losses. The still is plain t2v (no mask, no first frame) in both; the clip is conditioned."""
    from toolkit.data_transfer_object.data_loader import DataLoaderBatchDTO

    from video_dit.data.dataset import DatasetConfig, scan_datasets
    from video_dit.data.demo import make_demo_data
    from video_dit.data.frames import load_item_pixels
    from video_dit.diffusion.conditioning import encode_conditioning
    from video_dit.media import tensor_to_pil
    from video_dit.train.trainer import Trainer
    from video_dit.typed_config import parse

    folder = tmp_path / "mixed"
    make_demo_data(folder, count=1, frames=T, size=H, holdout=0)
    tensor_to_pil(torch.rand(3, H, W, generator=torch.Generator().manual_seed(0)) * 2 - 1)[0].save(folder / "s.png")
    cfg = parse(DatasetConfig, {"folder_path": str(folder), "num_frames": T, "resolution": [H], "do_i2v": True},
                "config.process[0].datasets[0]")
    scan = scan_datasets([cfg], 16, verbose=False, i2v_mode="replace")
    assert sorted((it.kind, it.conditioned) for it in scan.items) == [("image", False), ("video", True)]

    ctx = sd.get_prompt_embeds(["a shape"])
    trainer = Trainer.__new__(Trainer)  # only what loss_at reads
    trainer.device, trainer.engine, trainer.conditioning = torch.device("cpu"), sd.model, sd.conditioning
    trainer.family, trainer.dit_config = WAN, sd.model.config
    trainer.timesteps = types.SimpleNamespace(loss_weight=torch.ones_like)  # plain "shift": weight 1
    t = torch.tensor([640.0])
    for item in scan.items:
        trainer.dataset = types.SimpleNamespace(item=lambda i, item=item: item)
        video = load_item_pixels(item).permute(1, 0, 2, 3)[None]  # (1, 3, F, H, W), as build_cache encodes it
        with torch.no_grad():
            latents = sd.vae.normalize(sd.vae.encode(video).mode())
            first = encode_conditioning(sd.vae, video, "replace", video.shape[2])  # stored for stills too
            cached = {"latents": latents, "text_embeds": ctx.text_embeds, "index": torch.tensor([0]), **first}
            noise = torch.randn(latents.shape, generator=torch.Generator().manual_seed(5))
            ours = trainer.loss_at(cached, t, noise)  # what loss_of computes after drawing t and noise
            batch = DataLoaderBatchDTO(latents=latents, do_i2v=True, num_frames=video.shape[2],
                                       first_frame_latents=first["first_frame_latents"] if item.kind == "video"
                                       else None)
            pred = sd.get_noise_prediction(add_noise(latents, noise, t), t, ctx, batch=batch)
            target = sd.get_loss_target(noise=noise, batch=batch, timesteps=t)
            theirs = sd.scale_loss(F.mse_loss(pred, target, reduction="none")).mean()
            plain = F.mse_loss(sd.model(add_noise(latents, noise, t), t, ctx.text_embeds), noise - latents)
        assert torch.isfinite(ours) and torch.allclose(ours, theirs, rtol=1e-5), (item.path, ours, theirs)
        if item.kind == "image":  # unconditioned: exactly the t2v loss
            assert torch.allclose(ours, plain, rtol=1e-5)
        else:  # conditioned on the first frame: not the t2v loss
            assert not torch.allclose(ours, plain, rtol=1e-3)


# ---------------------------------------------------------------- the decisions both trainers share


def test_lora_on_a_random_preset_is_refused_when_ai_toolkit_attaches_its_network(aitk, tmp_path):
    """ai-toolkit builds the model from its `model` block alone (BaseSDTrainProcess.run L1794-1806) and
    gives it the network right after load_model (L1985 `self.sd.network = self.network`, before
    `apply_to`, the datasets, caching and step 1): that assignment refuses a LoRA on `preset:NAME`
    (every LoRA gradient is 0, tests/test_train_config.py), naming model.name_or_path and network, in
    the words our trainer refuses the same job with before any rank starts; and a network type our
    LoRA files cannot hold. A LoRA on trained weights is attached."""
    from PIL import Image

    from video_dit.spec import AITK_KEYS, JOB_KEYS
    from video_dit.train.config import parse_job

    model = build(aitk)  # preset:tiny
    model.load_model()
    lora = types.SimpleNamespace(network_type="lora")
    with pytest.raises(ConfigError) as refused:
        model.network = lora
    theirs = str(refused.value)
    assert theirs.startswith("network: LoRA on 'preset:tiny' trains nothing") and "model.name_or_path" in theirs
    assert model.network is None
    data = tmp_path / "data"
    data.mkdir()
    Image.new("RGB", (32, 32)).save(data / "a.png")
    with pytest.raises(ConfigError) as ours:
        parse_job({"job": "extension", "config": {"name": "j", "process": [{
            "network": {"type": "lora", "linear": 4}, "datasets": [{"folder_path": str(data), "resolution": [32]}],
            "model": {"name_or_path": "preset:tiny"}}]}})
    ours_in_their_keys = str(ours.value)
    for key in ("network", "model", "preset"):
        ours_in_their_keys = ours_in_their_keys.replace(getattr(JOB_KEYS, key), getattr(AITK_KEYS, key))
    assert ours_in_their_keys == theirs
    with pytest.raises(ConfigError, match=r"^network\.type: 'lokr': .*accepted: lora"):  # accelerate wraps it
        model.network = types.SimpleNamespace(module=types.SimpleNamespace(network_type="lokr"))
    from toolkit.lora_special import LoRASpecialNetwork

    trained = build(aitk, name_or_path=str(helpers.write_base(tmp_path / "base.safetensors")),
                    model_kwargs={"preset": "tiny"})
    trained.load_model()
    net = LoRASpecialNetwork(trained.model, lora_dim=4, base_model=trained,
                             target_lin_modules=trained.target_lora_modules)
    trained.network = net
    assert trained.network is net


def _their_files(folder, **dataset) -> list[str]:
    """The files ai-toolkit makes items of `folder` (the stand-in's copy of its listing)."""
    import os

    from toolkit.config_modules import DatasetConfig
    from toolkit.data_loader import AiToolkitDataset

    cfg = DatasetConfig(**{"folder_path": str(folder), "num_frames": 5, "caption_ext": "txt", **dataset})
    return sorted(os.path.abspath(it.path) for it in AiToolkitDataset(cfg).file_list)


def test_a_dataset_folder_holds_the_same_files_for_both_trainers(aitk, tmp_path):
    """What ai-toolkit lists (recursively, toolkit/data_loader.py L427-454) and what our scanner lists
    (`list_media`) and trains on agree: on a folder written by make-demo-data (its training clips,
    exactly: the held-out clips live beside it), on a folder of sub-folders, dot-folders, `_controls/`,
    caches and odd extensions, and on an old demo layout once the demo's prepare stage has moved its
    `holdout/` out (before, ai-toolkit would train on the held-out clips and their first frames)."""
    import shutil

    from PIL import Image

    from video_dit import media
    from video_dit.data.dataset import DatasetConfig, list_media, scan_datasets
    from video_dit.data.demo import holdout_dir, make_demo_data
    from video_dit.train.validate import prepare
    from video_dit.typed_config import parse

    def ours(folder):
        return [str(p) for p in list_media(folder)[0]]

    def trained(folder, num_frames=5):
        cfg = parse(DatasetConfig, {"folder_path": str(folder), "num_frames": num_frames, "resolution": [32]},
                    "config.process[0].datasets[0]")
        return sorted({it.path for it in scan_datasets([cfg], 16, verbose=False).items})

    demo = tmp_path / "demo"
    clips = sorted(str(p.absolute()) for p in make_demo_data(demo, count=3, frames=5, size=32, holdout=2))
    assert _their_files(demo) == ours(demo) == trained(demo) == clips
    assert sorted(p.name for p in holdout_dir(demo).iterdir()) == [f"{j:03d}.{e}" for j in range(2)
                                                                   for e in ("mp4", "png", "txt")]

    messy = tmp_path / "messy"
    rng = np.random.default_rng(0)
    for name in ("a.mp4", "sub/c.MP4", ".hidden/e.mp4", "_controls/deeper/f.mp4", "_latent_cache/g.mp4"):
        media.write_video(rng.integers(0, 255, (5, 32, 32, 3), dtype=np.uint8), messy / name, fps=8)
    for name in ("B.PNG", "sub/deeper/d.jpg", ".dot.png", "_controls/h.png", ".hidden/i.png"):
        (messy / name).parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (32, 32), (200, 40, 40)).save(messy / name, format="PNG" if name.lower().endswith("png")
                                                       else "JPEG")
    (messy / "w.wmv").write_bytes(b"\0" * 64)  # listed by both (and skipped as unreadable by both)
    for name in ("a.txt", "notes.md", "_latent_cache/x.safetensors", "_text_cache/y.safetensors"):
        (messy / name).parent.mkdir(parents=True, exist_ok=True)
        (messy / name).write_text("x")
    expected = sorted(str((messy / n).absolute()) for n in ("a.mp4", "sub/c.MP4", "_controls/deeper/f.mp4",
                                                             "_latent_cache/g.mp4", "B.PNG", "sub/deeper/d.jpg",
                                                             "w.wmv"))
    assert _their_files(messy) == ours(messy) == expected
    assert list_media(messy)[1] == 1  # notes.md; the captions and the caches' tensors are not counted
    # an image dataset: ai-toolkit lists its images only; ours lists the videos too, and skips them
    assert _their_files(messy, num_frames=1) == trained(messy, num_frames=1) == [
        p for p in expected if not p.lower().endswith((".mp4", ".wmv"))]

    # an earlier version's layout: holdout/ inside the dataset folder
    old = tmp_path / "old"
    old_clips = sorted(str(p.absolute()) for p in make_demo_data(old, count=2, frames=5, size=32, holdout=2))
    shutil.move(str(holdout_dir(old)), str(old / "holdout"))
    assert len(_their_files(old)) == 2 + 2 + 2  # the trap: held-out clips and first frames trained on
    logs = []
    prepare({"config": {"process": [{"prepare": {"demo_data": {"dir": str(old), "count": 2, "frames": 5,
                                                               "size": 32, "holdout": 2}}}]}}, log=logs.append)
    assert any(f"moved the held-out clips {old / 'holdout'} -> {holdout_dir(old)}" in m for m in logs), logs
    assert any("exists" in m for m in logs), logs  # moved, not rewritten
    assert _their_files(old) == ours(old) == trained(old) == old_clips
    assert len(list(holdout_dir(old).iterdir())) == 6


def test_a_concat_i2v_dataset_of_clips_and_stills_trains_to_the_end_skipping_its_stills(aitk, tmp_path, capsys):
    """preset:tiny-clip-i2v (Wan 2.1 I2V's shape: concat + CLIP) on a do_i2v folder of clips and stills,
    two epochs in SDTrainer's order (encode, embed, noise, predict_noise(batch=...), target, mse,
    scale_loss, per-sample mean x loss_multiplier, backward, AdamW step): no exception; ONE warning
    for the folder, naming its 2 stills and why, word for word the line our trainer's scan prints
    (printed: ai-toolkit silences UserWarnings, toolkit/control_generator.py L15); each
    still step skipped: no DiT forward, a loss of exactly 0, no weight with a gradient, so AdamW (whose
    momentum from the clip steps would move a weight given a zero gradient) leaves every weight as it
    was; the clip steps train."""
    from PIL import Image
    from toolkit.config_modules import DatasetConfig
    from toolkit.data_loader import AiToolkitDataset
    from toolkit.data_transfer_object.data_loader import DataLoaderBatchDTO

    from video_dit.data.dataset import DatasetConfig as OurDatasetConfig
    from video_dit.data.dataset import scan_datasets
    from video_dit.data.demo import make_demo_data
    from video_dit.media import load_image, pil_to_tensor, read_video
    from video_dit.typed_config import parse

    folder = tmp_path / "mixed"
    make_demo_data(folder, count=2, frames=5, size=32, holdout=1)
    for name, colour in (("s1.png", (200, 30, 30)), ("sub/s2.jpg", (30, 200, 30))):
        (folder / name).parent.mkdir(exist_ok=True)
        Image.new("RGB", (32, 32), colour).save(folder / name)
    model = build(aitk, name_or_path="preset:tiny-clip-i2v")
    model.load_model()
    cfg = DatasetConfig(folder_path=str(folder), num_frames=5, do_i2v=True, caption_ext="txt", resolution=[32])
    items = AiToolkitDataset(cfg, sd=model).file_list
    assert sorted((os.path.basename(it.path), it.is_video) for it in items) == [
        ("0000.mp4", True), ("0001.mp4", True), ("s1.png", False), ("s2.jpg", False)]
    forwards = []
    model.model.register_forward_hook(lambda *a: forwards.append(1))
    params = [p for p in model.model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    g = torch.Generator().manual_seed(0)
    steps = []
    capsys.readouterr()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=UserWarning)  # as ai-toolkit's data loader sets it
        for _ in range(2):
            for item in sorted(items, key=lambda it: it.path)[::-1]:  # the stills first once, then after clips
                pixels = read_video(item.path) if item.is_video else pil_to_tensor(load_image(item.path))
                batch = DataLoaderBatchDTO(tensor=pixels[None], file_items=[item], num_frames=item.num_frames)
                batch.latents = model.encode_images(batch.tensor)  # (1, 16, F', 4, 4)
                caption = Path(item.path).with_suffix(".txt")
                embeds = model.get_prompt_embeds([caption.read_text() if caption.exists() else ""])
                t = torch.tensor([600.0])
                noise = torch.randn(batch.latents.shape, generator=g)
                before, calls = [p.detach().clone() for p in params], len(forwards)
                pred = model.predict_noise(model.add_noise(batch.latents, noise, t), text_embeddings=embeds,
                                           timestep=t, batch=batch)
                target = model.get_loss_target(noise=noise, batch=batch, timesteps=t)
                loss = model.scale_loss(F.mse_loss(pred.float(), target.float(), reduction="none"))
                loss = (loss.mean([1, 2, 3, 4]) * torch.tensor(batch.loss_multiplier_list)).mean()
                loss.backward()
                no_grads = all(p.grad is None for p in params)
                opt.step()
                opt.zero_grad(set_to_none=True)
                moved = any(not torch.equal(a, p) for a, p in zip(before, params))
                steps.append((item.is_video, float(loss), no_grads, moved, len(forwards) - calls))
    assert [s[0] for s in steps] == [False, False, True, True] * 2
    for is_video, loss, no_grads, moved, ran in steps:
        if is_video:
            assert loss > 0 and not no_grads and moved and ran == 1
        else:
            assert loss == 0.0 and no_grads and not moved and ran == 0
    assert model.skipped_stills == 4
    theirs = [line for line in capsys.readouterr().err.splitlines() if "still image(s)" in line]
    assert len(theirs) == 1, theirs
    assert theirs[0].startswith(f"[video_dit] warning: {folder}: 2 still image(s) of this do_i2v dataset are skipped "
                                "(s1.png, sub/s2.jpg): an image-to-video DiT with i2v_mode concat"), theirs[0]
    # our trainer's scan of the same folder: the clips only, with the same warning, word for word
    ours_cfg = parse(OurDatasetConfig, {"folder_path": str(folder), "num_frames": 5, "resolution": [32],
                                        "do_i2v": True}, "config.process[0].datasets[0]")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scan = scan_datasets([ours_cfg], 16, verbose=True, i2v_mode="concat")
    assert sorted(os.path.basename(it.path) for it in scan.items) == ["0000.mp4", "0001.mp4"]
    ours = [warnings.formatwarning(w.message, w.category, w.filename, w.lineno).strip() for w in caught
            if "still image(s)" in str(w.message)]  # a DataWarning prints as one "[video_dit] warning:" line
    assert ours == theirs
