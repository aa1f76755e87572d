"""Two-expert jobs (Wan 2.2 A14B) without ranks: the keys, the bad input they refuse before any rank
starts (exit 2 naming the key or file), which expert trains which step, and the distribution of each
expert's training timesteps (the shifted distribution conditioned on its side of the boundary)."""

from __future__ import annotations

import math

import helpers
import numpy as np
import pytest
import torch

from video_dit.diffusion.experts import HIGH, LOW, expert_at, expert_range
from video_dit.families import get_preset
from video_dit.families.wan import FAMILY as WAN
from video_dit.families.wan.dit import LORA_TARGETS as WAN_LORA_TARGETS

PROCESS = "config.process[0]"


def _job(tmp_path, model: dict, train: dict | None = None, preset: str = "tiny-a14b") -> dict:
    # a job on a preset's random weights is a full fine-tune (LoRA on one is refused: it trains nothing)
    random = str(model.get("name_or_path", "")).startswith("preset:")
    process = helpers.train_process(tmp_path, model={"preset": preset, **model}, train=train or {}, lora=not random)
    return {"job": "extension", "config": {"name": "j", "process": [process]}}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Demo data, one expert's weights (base.safetensors) and a two-expert folder in Wan's layout."""
    root = helpers.make_world(tmp_path_factory.mktemp("experts"), count=1)
    for sub, seed in (("high_noise_model", 0), ("low_noise_model", 1)):
        (root / "a14b" / sub).mkdir(parents=True)
        helpers.write_base(root / "a14b" / sub / "diffusion_pytorch_model.safetensors", seed=seed)
    return root


def test_a14b_presets_carry_the_release_numbers():
    """wan/configs/wan_t2v_A14B.py and wan_i2v_A14B.py lines 34-37: boundary 0.875 / 0.900, sample shift
    12 / 5, 40 steps, `sample_guide_scale` (low, high) = (3.0, 4.0) / (3.5, 3.5); and what a render of them
    uses when the command gives no scale, or one (diffusers: guidance_scale_2 = guidance_scale)."""
    from video_dit.diffusion.sampling_settings import resolve_sampling

    t2v, i2v = get_preset("wan2.2-t2v-a14b"), get_preset("wan2.2-i2v-a14b")
    assert (t2v.boundary_ratio, t2v.sample_shift, t2v.sample_steps, t2v.dit.in_dim, t2v.i2v_mode) == \
        (0.875, 12.0, 40, 16, None)
    assert (i2v.boundary_ratio, i2v.sample_shift, i2v.sample_steps, i2v.dit.in_dim, i2v.i2v_mode) == \
        (0.9, 5.0, 40, 36, "concat")
    low, high = 3.0, 4.0  # wan_t2v_A14B.py: sample_guide_scale = (3.0, 4.0)  # low noise, high noise
    s = resolve_sampling(t2v, family=WAN)
    assert (s.guidance, s.guidance_2) == (high, low)
    assert "guidance 4 (high-noise expert) / 3 (low-noise expert)" in s.describe()
    s = resolve_sampling(t2v, given={"guidance": (6.0, "--cfg")}, family=WAN)
    assert (s.guidance, s.guidance_2) == (6.0, 6.0)
    s = resolve_sampling(i2v, given={"guidance_2": (2.0, "--cfg-2")}, family=WAN)
    assert (s.guidance, s.guidance_2) == (3.5, 2.0)
    assert resolve_sampling(get_preset("wan2.1-t2v-14b"), family=WAN).guidance_2 is None
    with pytest.raises(ValueError, match="--cfg-2: the low-noise expert's guidance scale is for a two-expert"):
        resolve_sampling(get_preset("wan2.1-t2v-14b"), given={"guidance_2": (2.0, "--cfg-2")}, family=WAN)
    for p in (t2v, i2v):
        assert (p.dit.dim, p.dit.num_layers, p.dit.num_heads, p.vae_name) == (5120, 40, 40, "wan2.1")
    assert not get_preset("wan2.1-t2v-14b").two_experts and get_preset("tiny-a14b").two_experts


def test_two_expert_folders_in_both_layouts(world):
    from video_dit.models.layouts import expert_sources
    from video_dit.models.weights import WeightsError

    assert expert_sources(world / "a14b") == {HIGH: str(world / "a14b/high_noise_model"),
                                              LOW: str(world / "a14b/low_noise_model")}
    assert expert_sources(world / "base.safetensors") is None and expert_sources("preset:tiny-a14b") is None
    (world / "d/transformer").mkdir(parents=True)
    assert expert_sources(world / "d") is None  # transformer/ alone: one DiT (Wan 2.1, TI2V-5B)
    (world / "d/transformer_2").mkdir()
    assert expert_sources(world / "d") == {HIGH: str(world / "d/transformer"), LOW: str(world / "d/transformer_2")}
    (world / "h/high_noise_model").mkdir(parents=True)
    with pytest.raises(WeightsError, match="has high_noise_model/ but no low_noise_model/"):
        expert_sources(world / "h")


@pytest.mark.parametrize("model, train, key, message", [
    # neither expert asked
    ({"model_kwargs": {"train_high_noise": False, "train_low_noise": False}}, {},
     "model.model_kwargs.train_low_noise", "both false: no expert to train"),
    # both experts asked (the default) of one expert's weights
    ({"name_or_path": "{base}"}, {}, "model.name_or_path", "holds one DiT, but both experts are asked for"),
    # a boundary outside (0, 1)
    ({"model_kwargs": {"boundary_ratio": 1.0}}, {}, "model.boundary_ratio", "strictly between 0 and 1"),
    ({"model_kwargs": {"boundary_ratio": 0.0}}, {}, "model.boundary_ratio", "strictly between 0 and 1"),
    ({"boundary_ratio": -0.5}, {}, "model.boundary_ratio", "strictly between 0 and 1"),
    # the job's range leaves the low-noise expert nothing
    ({}, {"min_t": 900, "max_t": 1000}, "train.min_t", "leaves no timestep for the low-noise expert"),
    # expert keys on a one-model preset
    ({"preset": "tiny", "model_kwargs": {"train_high_noise": True}}, {}, "model.model_kwargs.train_high_noise",
     "is one model, not two experts"),
    ({"name_or_path": "{base}", "preset": "tiny", "boundary_ratio": 0.5}, {}, "model.boundary_ratio",
     "is one model, not two experts"),
    # half a two-expert folder
    ({"name_or_path": "{half}"}, {}, "model.name_or_path", "has high_noise_model/ but no low_noise_model/"),
])
def test_bad_expert_input_exits_2_naming_the_key(world, capsys, model, train, key, message):
    (world / "half/high_noise_model").mkdir(parents=True, exist_ok=True)
    model = {k: v.format(base=world / "base.safetensors", half=world / "half") if isinstance(v, str) else v
             for k, v in model.items()}
    job = _job(world, {"name_or_path": str(world / "a14b"), **model}, train)
    rc, err = helpers.validate(world, job, capsys)
    assert rc == 2, err
    assert f"{PROCESS}.{key}:" in err and message in err, err


def test_good_expert_jobs_validate(world, capsys):
    """Both experts of a two-expert folder (the default), one expert of it, one expert's own weights
    naming which expert they are, and ai-toolkit's keys in model_kwargs / train."""
    for model in ({}, {"model_kwargs": {"train_low_noise": False}},
                  {"name_or_path": str(world / "base.safetensors"), "model_kwargs": {"train_high_noise": False}}):
        job = _job(world, {"name_or_path": str(world / "a14b"), **model}, {"switch_boundary_every": 10})
        rc, err = helpers.validate(world, job, capsys)
        assert rc == 0, err


def _plan(world, model: dict | None = None, train: dict | None = None):
    from video_dit.train.config import parse_job
    from video_dit.train.experts import plan_experts

    job = parse_job(_job(world, {"name_or_path": str(world / "a14b"), **(model or {})}, train))
    return job.process, plan_experts(job.process, get_preset("tiny-a14b"))


def test_alternation_is_ai_toolkits_rule(world):
    """ai-toolkit's SDTrainer.hook_train_loop, written out: start at boundary index 0 (high noise);
    before a step, switch when `steps_this_boundary >= switch_boundary_every` or the index is not trained."""
    from video_dit.train.experts import ExpertSchedule

    def aitk(trainable: list[int], every: int, n: int) -> list[str]:
        index, count, out = 0, 0, []
        for _ in range(n):
            if count >= every or index not in trainable:
                while True:
                    count, index = 0, (index + 1) % 2
                    if index in trainable:
                        break
            out.append([HIGH, LOW][index])
            count += 1
        return out

    for every in (1, 3):
        for model, trainable in (({}, [0, 1]), ({"model_kwargs": {"train_high_noise": False}}, [1]),
                                 ({"model_kwargs": {"train_low_noise": False}}, [0])):
            process, plan = _plan(world, model, {"switch_boundary_every": every})
            schedule = ExpertSchedule(plan, seed=7)
            assert [schedule.expert_of(s) for s in range(12)] == aitk(trainable, every, 12), (every, trainable)
    process, plan = _plan(world, {}, {"switch_boundary_every": 2})
    assert ExpertSchedule(plan, 7).steps_of(LOW, 9) == [2, 3, 6, 7]


def _shifted(n, shift, rng):
    u = rng.random(n)
    return 1000.0 * shift * u / (1.0 + (shift - 1.0) * u)


def _ks(a, b) -> float:
    a, b = np.sort(a), np.sort(b)
    grid = np.concatenate([a, b])
    return float(np.abs(np.searchsorted(a, grid, side="right") / len(a)
                        - np.searchsorted(b, grid, side="right") / len(b)).max())


def _critical(n, m, alpha=1e-3) -> float:
    return math.sqrt(-math.log(alpha / 2) / 2) * math.sqrt((n + m) / (n * m))


def test_expert_timesteps_are_the_shifted_distribution_conditioned_on_its_side(world):
    """The trainer's timestep sampler of each expert (`timestep_sampler` on `expert_range`, as the Trainer
    builds it) against rejection sampling of the untruncated shifted formula (independent of flow.py):
    a two-sample KS test, for the A14B I2V preset (shift 5, boundary 0.9) and the tiny one (shift 3,
    0.875). And "timestep" expert choice: the step's expert drawn by (seed, step), then each rank's t from
    that expert's side, together is the untruncated distribution."""
    from video_dit.train.config import parse_job
    from video_dit.train.experts import ExpertSchedule, plan_experts
    from video_dit.train.trainer import _seed_of, timestep_sampler

    n = 20000
    rng = np.random.default_rng(11)
    for preset_name in ("wan2.2-i2v-a14b", "tiny-a14b"):
        job = parse_job(_job(world, {"name_or_path": f"preset:{preset_name}"}, preset=preset_name))
        preset = get_preset(preset_name)
        plan = plan_experts(job.process, preset)
        cut, shift = 1000 * preset.boundary_ratio, preset.train_shift
        full = _shifted(4 * n, shift, rng)
        for expert in (HIGH, LOW):
            sampler = timestep_sampler(job.process, preset, expert_range(expert, plan.boundary))
            t = sampler.sample(n, torch.Generator().manual_seed(5)).double().numpy()
            ref = full[full >= cut] if expert == HIGH else full[full < cut]
            assert (t >= cut).all() if expert == HIGH else (t <= cut).all()
            assert _ks(t, ref) < _critical(n, len(ref)), (preset_name, expert)
            if expert == HIGH:  # the test can tell: the whole distribution rescaled into the range is far off
                rescaled = cut + (1000 - cut) * full[:n] / 1000
                assert _ks(rescaled, ref) > 3 * _critical(n, len(ref))

    job = parse_job(_job(world, {"name_or_path": "preset:tiny-a14b"}, {"expert_choice": "timestep"}))
    preset = get_preset("tiny-a14b")
    plan = plan_experts(job.process, preset)
    schedule = ExpertSchedule(plan, 7, timestep_sampler(job.process, preset), _seed_of)
    samplers = {e: timestep_sampler(job.process, preset, expert_range(e, plan.boundary)) for e in (HIGH, LOW)}
    steps = 6000
    experts = [schedule.expert_of(s) for s in range(steps)]
    t = np.array([float(samplers[e].sample(1, torch.Generator().manual_seed(s))[0]) for s, e in enumerate(experts)])
    assert all(expert_at(x, plan.boundary) == e for x, e in zip(t, experts))
    full = _shifted(4 * steps, preset.train_shift, rng)
    assert _ks(t, full) < _critical(steps, len(full))
    assert experts == [schedule.expert_of(s) for s in range(steps)]  # a pure function of (seed, step)


@pytest.mark.parametrize("zero", [2, 3])
def test_plan_holds_an_engine_per_trained_expert_and_one_experts_activations(world, zero):
    """`video-dit plan` of a two-expert job: each trained expert's parameters, optimizer state and ZeRO
    buffers on every rank, the activations of one (one expert trains per step); the frozen expert a
    one-expert job previews with costs its base partitions (ZeRO-3) or host memory (ZeRO-2). The
    parameter and optimizer bytes are counted here from the tiny-a14b DiT built with its LoRA."""
    from video_dit.families.wan.dit import VideoDiT
    from video_dit.lora import add_lora
    from video_dit.parallel.zero import ds_config
    from video_dit.train.config import parse_job
    from video_dit.train.plan import job_experts, job_inputs, predict, setting_of

    def plan(kwargs: dict, samples: bool = False):
        process = helpers.train_process(world, base="a14b", zero=zero, model={"preset": "tiny-a14b",
                                                                              "model_kwargs": kwargs},
                                        samples=[helpers.holdout_sample(world / "data")] if samples else None)
        job = parse_job({"job": "extension", "config": {"name": "j", "process": [process]}}, "t")
        experts = job_experts(job)
        return experts, predict(get_preset("tiny-a14b").dit, (3, 4, 4), setting_of(job), world=2, lora_rank=4,
                                dtype=torch.float32, ds=ds_config(job, 2, cuda=False), cuda=False,
                                family=WAN, inputs=job_inputs(job, get_preset("tiny-a14b")), experts=experts)

    dit = VideoDiT(get_preset("tiny-a14b").dit)
    base = [p.numel() for p in dit.parameters()]
    add_lora(dit, 4, 4.0, targets=WAN_LORA_TARGETS)
    lora = sum(p.numel() for n, p in dit.named_parameters() if ".lora_" in n)
    both, p2 = plan({})
    one, p1 = plan({"train_low_noise": False})
    previewed, p1f = plan({"train_low_noise": False}, samples=True)
    assert both.trained == (HIGH, LOW) and one.trained == (HIGH,) and not one.frozen
    assert previewed.frozen == 1 and "the other frozen for previews" in previewed.describe()
    n = 2  # ranks; fp32 on CPU ranks
    # Adam's two moments of the LoRA partition, + its fp32 master under ZeRO-2 (ZeRO-3's float32
    # partition is its own master: engine.alias_fp32_partitions)
    master = (3 if zero == 2 else 2) * 4 * -(-lora // n)
    if zero == 2:
        params = 4 * (sum(base) + lora)  # every rank holds the whole expert
        frozen_device, frozen_host = 0, 4 * sum(base)  # the frozen expert waits on the host
    else:  # partitions, and the tensors under the job's stage3_param_persistence_threshold (1e4) whole
        def z3(numels):
            return 4 * sum(-(-k // n) + (k if k < 10_000 else 0) for k in numels)

        params = z3(base + [p.numel() for nm, p in dit.named_parameters() if ".lora_" in nm])
        frozen_device, frozen_host = z3(base), 0
    assert p1.resident.parameters == params and p2.resident.parameters == 2 * params
    assert p1.resident.optimizer == master and p2.resident.optimizer == 2 * master
    assert p2.activations.peak == p1.activations.peak  # one expert's step
    assert p1f.resident.parameters - p1.resident.parameters == frozen_device
    assert p1f.resident.host - p1.resident.host == frozen_host

