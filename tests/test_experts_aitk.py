"""The ai-toolkit arch on a two-expert preset (tiny-a14b), against the ai-toolkit stand-in: the model is
ai-toolkit's multistage model as its wan22_14b is (is_multistage, multistage_boundaries, the trainable
stages from train_high_noise / train_low_noise), ai-toolkit's own stage windows (BaseSDTrainProcess,
written out here) route each training forward to that stage's expert and its gradients to that expert
alone, the LoRA is saved as one ComfyUI-keyed file per expert (our trainer's key set) and loads back as
a pair (swapped files refused), and previews sample with both experts."""

from __future__ import annotations

import copy

import aitk_standin
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from video_dit.diffusion.experts import HIGH, LOW
from video_dit.families.wan.dit import LORA_TARGETS as WAN_LORA_TARGETS
from video_dit.lora import add_lora, save_lora
from video_dit.models.weights import WeightsError, read_state_dict
from video_dit.typed_config import ConfigError


@pytest.fixture(scope="module")
def aitk():
    yield aitk_standin.activate()
    aitk_standin.deactivate()


def build(aitk, **kwargs):
    from toolkit.config_modules import ModelConfig

    cfg = ModelConfig(name_or_path="preset:tiny-a14b", arch="video_dit", dtype="fp32", model_kwargs=kwargs)
    return aitk.VideoDiTModel(device="cpu", model_config=cfg, dtype="fp32",
                              noise_scheduler=aitk.VideoDiTModel.get_train_scheduler())


@pytest.fixture(scope="module")
def sd(aitk):
    model = build(aitk)
    model.load_model()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # the zero heads of a fresh DiT predict 0 and pass no gradient to the LoRA
        for e in (model.model.high, model.model.low):
            e.head.head.weight.normal_(std=0.05, generator=g)
    return model


def test_multistage_attributes_are_ai_toolkits(aitk):
    from video_dit.diffusion.experts import TwoExperts

    both = build(aitk)
    assert both.is_multistage and both.multistage_boundaries == [0.875, 0.0]
    assert both.trainable_multistage_boundaries == [0, 1] and both.max_step_saves_to_keep_multiplier == 2
    low = build(aitk, train_high_noise=False)
    assert low.trainable_multistage_boundaries == [1] and low.max_step_saves_to_keep_multiplier == 1
    low.load_model()
    assert isinstance(low.model, TwoExperts) and low.get_model_to_train() is low.model.low
    assert build(aitk, boundary_ratio=0.5).multistage_boundaries == [0.5, 0.0]
    for kwargs, key in (({"train_high_noise": False, "train_low_noise": False}, "model.model_kwargs.train_low_noise"),
                        ({"boundary_ratio": 1.5}, "model.model_kwargs.boundary_ratio")):
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            build(aitk, **kwargs)
    from toolkit.config_modules import ModelConfig

    cfg = ModelConfig(name_or_path="preset:tiny", arch="video_dit", model_kwargs={"train_high_noise": True})
    with pytest.raises(ConfigError, match="model.model_kwargs.train_high_noise.*one model, not two experts"):
        aitk.VideoDiTModel(device="cpu", model_config=cfg, dtype="fp32")
    assert not build_one(aitk).is_multistage


def build_one(aitk):
    from toolkit.config_modules import ModelConfig

    return aitk.VideoDiTModel(device="cpu", model_config=ModelConfig(name_or_path="preset:tiny", arch="video_dit"),
                              dtype="fp32")


def stage_window(sd, stage: int) -> torch.Tensor:
    """ai-toolkit's multistage timestep window (jobs/process/BaseSDTrainProcess.py, 27a03a91, the
    `adjust_multistage_timesteps` block), on the scheduler's training grid: the timesteps a step of
    boundary index `stage` may draw."""
    timesteps = sd.noise_scheduler.timesteps
    boundaries = [1] + sd.multistage_boundaries
    boundary_max, boundary_min = boundaries[stage], boundaries[stage + 1]
    asc = torch.flip(timesteps, dims=[0])
    lo = len(asc) - torch.searchsorted(asc, torch.tensor(boundary_max * 1000), right=False)
    hi = len(asc) - torch.searchsorted(asc, torch.tensor(boundary_min * 1000), right=True)
    first, last = ((lo - 1).item(), (hi - 1).item()) if hi > lo else (0, 999)
    return timesteps[max(first, 0):min(last, len(timesteps) - 1) + 1]


def test_ai_toolkits_stage_windows_train_that_stages_expert_only(sd):
    model = copy.deepcopy(sd.model)
    for e in (model.high, model.low):
        add_lora(e, rank=2, targets=WAN_LORA_TARGETS)
    saved, sd.model = sd.model, model
    calls = []
    model.high.register_forward_pre_hook(lambda m, a: calls.append(HIGH))
    model.low.register_forward_pre_hook(lambda m, a: calls.append(LOW))
    try:
        embeds = sd.get_prompt_embeds(["a red square"])
        x = torch.randn(1, 16, 2, 2, 2, generator=torch.Generator().manual_seed(1))
        for stage, expert in ((0, HIGH), (1, LOW)):
            window = stage_window(sd, stage)
            # the window covers its side of the boundary (ai-toolkit's low window starts at the grid point
            # at or above 875, which our routing, like Wan's t >= boundary, sends to the high-noise expert)
            assert (window[1:] < 875).all() if stage else (window >= 875).all()
            for t in (window[0], window[len(window) // 2], window[-1]):
                if stage and t >= 875:
                    continue
                calls.clear()
                model.zero_grad(set_to_none=True)
                pred = sd.predict_noise(x, text_embeddings=embeds, timestep=t.reshape(1))
                pred.square().mean().backward()
                assert calls == [expert], (stage, float(t), calls)
                grads = {e: [p.grad for n, p in getattr(model, e.split("_")[0]).named_parameters() if ".lora_" in n]
                         for e in (HIGH, LOW)}
                assert any(g is not None and g.abs().sum() > 0 for g in grads[expert])  # lora_B's (A's are 0: B = 0)
                assert all(g is None for g in grads[LOW if expert == HIGH else HIGH])
    finally:
        sd.model = saved


def _aitk_lora(module, rank, gen):
    """What ai-toolkit's network saves for `get_model_to_train()` (peft keys under `transformer.`; the
    blocks' Linears of every VideoDiT inside it), as tests/test_aitk_adapter.py's `aitk_lora_state_dict`."""
    out = {}
    for name, m in module.named_modules():
        if type(m).__name__ != "VideoDiT":
            continue
        for child_name, child in m.named_modules():
            clean = ".".join(x for x in ("transformer", name, child_name) if x)
            if type(child).__name__ == "Linear" and "blocks" in clean:
                out[f"{clean}.lora_A.weight"] = torch.randn(rank, child.in_features, generator=gen) * 0.1
                out[f"{clean}.lora_B.weight"] = torch.randn(child.out_features, rank, generator=gen) * 0.1
    return out


def test_lora_saves_one_file_per_expert_and_loads_the_pair(sd, tmp_path):
    ai_sd = _aitk_lora(sd.get_model_to_train(), 4, torch.Generator().manual_seed(2))
    assert any(k.startswith("transformer.high.") for k in ai_sd) and any(k.startswith("transformer.low.") for k in ai_sd)
    out = tmp_path / "job_000000010.safetensors"
    sd.save_lora(sd.convert_lora_weights_before_save(ai_sd), str(out), {"name": "job"})
    files = {e: tmp_path / f"job_000000010_{e}.safetensors" for e in (HIGH, LOW)}
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f.name for f in files.values())
    trainer_keys = set(read_state_dict(save_lora(tmp_path / "t.safetensors", add_lora(copy.deepcopy(sd.model.high),
                                                                                       4, 4, targets=WAN_LORA_TARGETS), 4)))
    for e, f in files.items():
        assert set(read_state_dict(f)) == trainer_keys  # the keys our DeepSpeed trainer exports per expert
        with safe_open(str(f), "pt") as h:
            assert h.metadata()["expert"] == e and h.metadata()["boundary_ratio"] == "0.875"
    (tmp_path / "t.safetensors").unlink()
    # ai-toolkit resumes from either file of the pair: both load, each under its expert
    for f in files.values():
        loaded = sd.convert_lora_weights_before_load(sd.load_lora(str(f)))
        assert set(loaded) == set(ai_sd) and all(torch.allclose(loaded[k], ai_sd[k]) for k in ai_sd)
    # swapped: the high-noise name holding the low-noise expert's file
    swapped = tmp_path / "swap"
    swapped.mkdir()
    for e, other in ((HIGH, LOW), (LOW, HIGH)):
        with safe_open(str(files[other]), "pt") as h:
            meta = h.metadata()
        save_file(read_state_dict(files[other]), str(swapped / f"job_{e}.safetensors"), metadata=meta)
    with pytest.raises(WeightsError, match=r"job_high_noise\.safetensors: its metadata says it is the low_noise"):
        sd.load_lora(str(swapped / "job_high_noise.safetensors"))


def test_preview_samples_with_both_experts(sd, tmp_path):
    from toolkit.config_modules import GenerateImageConfig

    calls = []
    hooks = [sd.model.high.register_forward_pre_hook(lambda m, a: calls.append((HIGH, float(a[1].flatten()[-1])))),
             sd.model.low.register_forward_pre_hook(lambda m, a: calls.append((LOW, float(a[1].flatten()[-1]))))]
    try:
        gen_config = GenerateImageConfig(prompt="a red square", width=64, height=64, num_inference_steps=4,
                                         guidance_scale=1.0, seed=3, num_frames=5, fps=8,
                                         output_folder=str(tmp_path), output_ext="webp")
        frames = sd.generate_single_image(sd.get_generation_pipeline(), gen_config,
                                          sd.get_prompt_embeds([gen_config.prompt]), None, torch.manual_seed(3), {})
    finally:
        for h in hooks:
            h.remove()
    assert len(frames) == 5
    assert [e for e, _ in calls] == [HIGH if t >= 875 else LOW for _, t in calls] and {e for e, _ in calls} == {HIGH, LOW}
