"""The memory plan of the LTX-2 DiT (`video_dit.families.ltx2.memory`), against what the DiT really keeps: every
tensor storage its forward and backward create, followed by `CPUAllocationTracker` on a tiny three-block DiT
of both streams in this process. After the forward the live bytes equal the derivation exactly; the step's peak
is within 10%. Full fine-tuning and LoRA, fp32 and the bf16 a GPU job stores (float32 trainable masters under
bf16 autocast, the float32 islands), no / the first / every block checkpointed, one timestep per sample (t2v)
and per-token video timesteps (i2v), padded and unpadded text, batches of 1 and 2, the 2.0 / 2.3 / 2.5 flags.
(SP 2: tests/test_ltx2_sequence_parallel.py.) Then the plan of a whole job: `video-dit plan` on an LTX-2 job,
`gradient_checkpointing: auto` chosen from it."""

from __future__ import annotations

from dataclasses import replace

import helpers
import pytest
import torch

from video_dit.families.ltx2 import FAMILY as LTX2
from video_dit.families.ltx2.dit import LORA_TARGETS, LTX2DiT, cast_ltx2_dit
from video_dit.families.ltx2.dit_config import LTX2_DIT_CONFIGS
from video_dit.families.ltx2.memory import audio_tokens_of, ltx2_activation_bytes
from video_dit.lora import add_lora
from video_dit.models.activation_terms import Setting
from video_dit.parallel.memory import CPUAllocationTracker
from video_dit.train import plan

GRID, AUDIO, TEXT = (3, 4, 8), 20, 16  # 96 video tokens, 20 audio tokens, 16 text tokens (3 padding in sample 0)
GiB = 2 ** 30


def _measure(cfg, lora, dtype, checkpointing, per_token, batch, masked, recompute=True, streams="both"):
    """(bytes kept after the forward, the step's peak) of a tiny DiT of `cfg` trained as the trainer stores it
    (`recompute`: `train.recompute_saved`; `streams`: `network.streams`)."""
    model = helpers.randomize_all(LTX2DiT(cfg, init_seed=0), seed=1).train()
    model.set_recompute_saved(recompute)
    if lora:
        add_lora(model, lora, targets=LTX2.stream_lora_targets(False, streams))
    else:
        model.requires_grad_(True)
    cast_ltx2_dit(model, dtype, masters=True)  # trainable float32, the frozen bulk in dtype, the islands float32
    model.set_checkpointed_blocks(checkpointing)
    g = torch.Generator().manual_seed(0)
    width = (cfg.caption_channels,) * 2 if not cfg.caption_proj_before_connector \
        else (cfg.hidden_size, cfg.audio_hidden_size)
    B, L, first = batch, GRID[0] * GRID[1] * GRID[2], GRID[1] * GRID[2]
    video, audio = torch.randn(B, cfg.in_channels, *GRID, generator=g), torch.randn(B, 2, AUDIO, 4, generator=g)
    t = torch.tensor([500.0, 300.0][:B])
    kw = dict(audio=audio, audio_timestep=torch.tensor([700.0, 200.0][:B]), fps=24.0,
              audio_context=torch.randn(B, TEXT, width[1], generator=g))
    if per_token:  # the first latent frame's tokens at 0 (and marked as keyframes: 2.5), as the i2v conditioning
        t = t[:, None].repeat(1, L)
        t[:, :first] = 0.0
        if cfg.use_keyframes_abs_pos_embedding:
            kw["keyframes_mask"] = (torch.arange(L) < first).float().expand(B, L)
    if masked:  # bool masks, as the trainer's batches carry them
        mask = torch.arange(TEXT)[None] < torch.tensor([TEXT - 3, TEXT][:B])[:, None]
        kw.update(video_context_mask=mask, audio_context_mask=mask)
    args = (video, t, torch.randn(B, TEXT, width[0], generator=g))
    targets = (torch.randn(B, cfg.out_channels, *GRID, generator=g), torch.randn(audio.shape, generator=g))
    sum(o.float().sum() for o in model(*args, **kw)).backward()  # gradients and RoPE tables exist before the step
    with CPUAllocationTracker() as tracker:
        loss = sum((o.float() - target).square().mean() for o, target in zip(model(*args, **kw), targets))
        saved = tracker.live - 4  # 4: the loss itself
        loss.backward()
    return saved, tracker.peak


# (variant, checkpointed blocks of 3, LoRA rank, dtype, per-token timesteps, batch, text padded)
F32, BF16 = torch.float32, torch.bfloat16
CASES = [("2.3", ckpt, lora, dtype, per_token, 1, True) for ckpt, lora, dtype, per_token in [
    (0, None, F32, False), (1, None, F32, True), (3, None, F32, False), (0, None, BF16, True), (3, None, BF16, True),
    (1, None, BF16, False), (0, 4, F32, True), (3, 4, F32, False), (0, 4, BF16, False), (1, 4, BF16, True),
    (3, 4, BF16, True), (1, 4, F32, False)]]
CASES += [("2.0", 1, None, BF16, True, 1, True), ("2.0", 0, 4, F32, False, 1, True),  # 2.0: ungated, caption proj.
          ("2.5", 0, None, F32, True, 1, True), ("2.5", 3, 4, BF16, True, 1, True),  # 2.5: the keyframe embedding
          ("2.3", 1, None, BF16, True, 2, True), ("2.3", 0, 4, F32, False, 2, False)]  # batch 2; unpadded text


@pytest.mark.parametrize("variant,checkpointing,lora,dtype,per_token,batch,masked", CASES)
def test_activation_model_equals_what_autograd_keeps(variant, checkpointing, lora, dtype, per_token, batch, masked):
    cfg = replace(LTX2_DIT_CONFIGS[f"tiny_{variant}"], num_layers=3)
    saved, peak = _measure(cfg, lora, dtype, checkpointing, per_token, batch, masked)
    setting = Setting(0, checkpointing=checkpointing > 0, checkpoint_blocks=checkpointing, micro_batch=batch)
    predicted = ltx2_activation_bytes(cfg, GRID, setting, lora_rank=lora, s=dtype.itemsize, text_len=TEXT,
                                      audio_tokens=AUDIO, per_token=per_token, text_masked=masked)
    print(f"\nsaved {saved} (planned {predicted.saved}), peak {peak} (planned {predicted.peak / peak:.3f} x)")
    assert predicted.saved == saved, predicted.parts
    assert predicted.peak == pytest.approx(peak, rel=0.1), (predicted.parts, peak)


@pytest.mark.parametrize("checkpointing,lora,dtype,per_token", [(0, None, F32, False), (1, 4, BF16, True)])
def test_activation_model_without_recompute_saved(checkpointing, lora, dtype, per_token):
    """`train.recompute_saved: false`: the plain blocks and the output layers keep what autograd keeps."""
    cfg = replace(LTX2_DIT_CONFIGS["tiny_2.3"], num_layers=3)
    saved, peak = _measure(cfg, lora, dtype, checkpointing, per_token, 1, True, recompute=False)
    setting = Setting(0, checkpointing=checkpointing > 0, checkpoint_blocks=checkpointing, recompute=False)
    predicted = ltx2_activation_bytes(cfg, GRID, setting, lora_rank=lora, s=dtype.itemsize, text_len=TEXT,
                                      audio_tokens=AUDIO, per_token=per_token, text_masked=True)
    print(f"\nsaved {saved} (planned {predicted.saved}), peak {peak} (planned {predicted.peak / peak:.3f} x)")
    assert predicted.saved == saved, predicted.parts
    assert predicted.peak == pytest.approx(peak, rel=0.1), (predicted.parts, peak)
    with_recipes = ltx2_activation_bytes(cfg, GRID, replace(setting, recompute=True), lora_rank=lora, s=dtype.itemsize,
                                         text_len=TEXT, audio_tokens=AUDIO, per_token=per_token, text_masked=True)
    assert with_recipes.saved < saved  # the recipes' saving is planned only where the blocks keep them


@pytest.mark.parametrize("streams,dtype,per_token", [("audio", F32, False), ("video", BF16, True)])
def test_a_one_stream_loras_activations(streams, dtype, per_token):
    """`network.streams`: with the first block checkpointed, what the forward leaves equals the plan of that stream's
    adapters (the other stream's lora_A outputs, adapter copies and its text keys' rstd gone), the peak within 10%;
    the both-streams plan differs. Without checkpointing the plan counts the first block as both streams' (over,
    never under)."""
    cfg = replace(LTX2_DIT_CONFIGS["tiny_2.3"], num_layers=3)

    def planned(ckpt, lora_streams):
        return ltx2_activation_bytes(cfg, GRID, Setting(0, checkpointing=ckpt > 0, checkpoint_blocks=ckpt), lora_rank=4,
                                     s=dtype.itemsize, text_len=TEXT, audio_tokens=AUDIO, per_token=per_token,
                                     text_masked=True, lora_streams=lora_streams)

    saved, peak = _measure(cfg, 4, dtype, 1, per_token, 1, True, streams=streams)
    one = planned(1, streams)
    assert one.saved == saved and planned(1, "both").saved != saved, one.parts
    assert one.peak == pytest.approx(peak, rel=0.1)
    saved, _ = _measure(cfg, 4, dtype, 0, per_token, 1, True, streams=streams)
    assert saved < planned(0, streams).saved < planned(0, "both").saved


def test_a_wrong_term_fails_the_equality():
    """The equality can fail: the same step with one more checkpointed block, or planned as per-token, differs."""
    cfg = replace(LTX2_DIT_CONFIGS["tiny_2.3"], num_layers=3)
    saved, _ = _measure(cfg, None, F32, 1, False, 1, True)
    for setting, per_token in ((Setting(0, checkpointing=True, checkpoint_blocks=2), False),
                               (Setting(0, checkpointing=True, checkpoint_blocks=1), True)):
        other = ltx2_activation_bytes(cfg, GRID, setting, lora_rank=None, s=4, text_len=TEXT, audio_tokens=AUDIO,
                                      per_token=per_token, text_masked=True)
        assert other.saved != saved


def _job(tmp_path, **train):
    from video_dit.data.demo_av import make_demo_av_data
    from video_dit.train.config import parse_job

    make_demo_av_data(tmp_path / "data", count=1, frames=17, size=64, holdout=0, fps=16)
    dataset = {"folder_path": str(tmp_path / "data"), "num_frames": 17, "fps": 16, "resolution": [64],
               "shrink_video_to_frames": False, "do_i2v": True, "caption_ext": "txt"}
    base = helpers.write_ltx2_base(tmp_path / "base.safetensors")
    process = helpers.train_process(tmp_path, network={"type": "lora", "linear": 4, "linear_alpha": 4},
                                    datasets=[dataset], model={"name_or_path": str(base), "preset": "tiny-ltx2-t2v"},
                                    train=train)
    return parse_job({"job": "extension", "config": {"name": "j", "process": [process]}})


def test_an_ltx2_job_is_planned_and_auto_checkpoints_from_the_plan(tmp_path):
    """The job's plan is the family's DiT (its parameters with its LoRA targets; its activations with both
    streams: the audio tokens of the datasets' frame rate, the connectors' text length, per-token timesteps of
    an i2v dataset) plus the family-blind state; `auto` takes the fewest blocks that fit."""
    from video_dit.devices import Machine

    job = _job(tmp_path, gradient_checkpointing="auto", dtype="bf16")
    preset = plan.get_preset("tiny-ltx2-t2v")
    inputs = plan.job_inputs(job, preset)
    assert inputs == {"text_len": 32, "fps": 16, "temporal": preset.vae.temporal_compression, "per_token": True,
                      "streams": "both"}
    sizes = plan.model_sizes(preset.dit, 4, torch.bfloat16, plan.family_of(preset))
    with torch.device("meta"):
        model = LTX2DiT(preset.dit)
        add_lora(model, 4, targets=LORA_TARGETS)
    adapters = [p.numel() for n, p in model.named_parameters() if ".lora_" in n]
    assert sizes.trainable == sum(adapters) and sizes.lora == sum(adapters)
    grid = plan.latent_grid(preset, (17, 64, 64))
    frames = preset.vae.pixel_frames(grid[0])
    assert audio_tokens_of(grid, 16, preset.vae.temporal_compression) == round(frames / 16 * 25)  # 25 latents / s
    machine = Machine(ranks=1, nodes=1, device="cuda", gpu_mem=64 * GiB)
    row = plan.plan_job(job, machine, buckets=[(17, 64, 64)]).buckets[0]
    assert row.auto.blocks == 0 and row.auto.fits  # a tiny model fits without checkpointing
    expected = ltx2_activation_bytes(preset.dit, grid, Setting(2, checkpointing=False, checkpoint_blocks=0),
                                     lora_rank=4, s=2, text_len=32, audio_tokens=round(frames / 16 * 25),
                                     per_token=True)
    assert row.as_configured.activations.peak == expected.peak
    # a capacity that no checkpointing misses and one checkpointed block meets: auto checkpoints one
    auto = plan.AutoCheckpointing(job, machine)
    none, one = (auto.predict(grid, Setting(2, checkpointing=n > 0, checkpoint_blocks=n)).device_bytes for n in (0, 1))
    assert one < none
    gpu = plan.CUDA_CONTEXT_BYTES + int((one + none) / 2 / (1 - plan.AUTO_MARGIN))
    assert plan.AutoCheckpointing(job, Machine(ranks=1, nodes=1, device="cuda", gpu_mem=gpu)).choose(grid).blocks == 1


@pytest.mark.parametrize("streams", ["audio", "video"])
def test_a_one_stream_lora_is_planned_with_its_adapters_only(tmp_path, streams):
    """`network.streams: audio` / `video` (issue 47): the plan's trainable parameters (the optimizer's states, the
    gradients) are the adapters the trainer's build puts on that stream, fewer than both streams'."""
    from video_dit.devices import Machine
    from video_dit.families.ltx2 import FAMILY as LTX2
    from video_dit.train.build import make_trainable
    from video_dit.train.config import parse_job

    job = _job(tmp_path)
    process = helpers.train_process(tmp_path, network={"type": "lora", "linear": 4, "linear_alpha": 4,
                                                       "streams": streams},
                                    datasets=[{"folder_path": str(tmp_path / "data"), "num_frames": 17, "fps": 16,
                                               "resolution": [64], "shrink_video_to_frames": False,
                                               "caption_ext": "txt"}],
                                    model={"name_or_path": str(tmp_path / "base.safetensors"),
                                           "preset": "tiny-ltx2-t2v"})
    one = parse_job({"job": "extension", "config": {"name": "j", "process": [process]}})
    preset = plan.get_preset("tiny-ltx2-t2v")
    with torch.device("meta"):
        built = make_trainable(LTX2DiT(preset.dit), one.process, torch.float32, family=LTX2)
    trainable = sum(p.numel() for p in built.parameters() if p.requires_grad)
    machine = Machine(ranks=1, nodes=1, device="cuda", gpu_mem=64 * GiB)
    sizes = plan.AutoCheckpointing(one, machine).sizes
    both = plan.AutoCheckpointing(job, machine).sizes
    assert sizes.trainable == sizes.lora == trainable < both.trainable
