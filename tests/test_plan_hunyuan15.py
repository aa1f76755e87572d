"""The memory plan of the HunyuanVideo 1.5 DiT (`video_dit.families.hunyuan15.memory`), against what the DiT
really keeps: every tensor storage its forward and backward create, followed by `CPUAllocationTracker` on
a tiny three-block DiT in this process. After the forward the live bytes equal the derivation exactly;
the step's peak is within 10%. Full fine-tuning and LoRA, fp32 and the bf16 a GPU job stores (float32
trainable masters under bf16 autocast, the float32 residual streams), no / every / the first 1 or 2 blocks
checkpointed, with image, glyph and padded text tokens in the text stream. Then the plan of a whole job:
`video-dit plan` on a HunyuanVideo 1.5 job, `gradient_checkpointing: auto` chosen from it, and the
out-of-memory line quoting it."""

from __future__ import annotations

from dataclasses import replace

import helpers
import pytest
import torch

from video_dit.families.hunyuan15.config import HY15_DIT_CONFIGS
from video_dit.families.hunyuan15.dit import LORA_TARGETS, HunyuanVideo15DiT, cast_hy15_dit
from video_dit.families.hunyuan15.memory import hy15_activation_bytes
from video_dit.lora import add_lora
from video_dit.models.activation_terms import Setting
from video_dit.parallel.memory import CPUAllocationTracker
from video_dit.train import plan

GRID = (2, 8, 8)  # 128 video tokens
TEXT, GLYPH, IMAGE = 16, 8, 4  # the text stream: 28 tokens, 4 text and 3 glyph ones padding
GiB = 2 ** 30


def _measure(cfg, lora, checkpointing, dtype):
    torch.manual_seed(0)
    model = helpers.randomize_all(HunyuanVideo15DiT(cfg, init_seed=0))
    if lora:
        add_lora(model, lora, targets=LORA_TARGETS)
    cast_hy15_dit(model, dtype, masters=True)  # the trainer's storage: trainable float32, the frozen bulk in dtype
    if checkpointing:
        model.set_checkpointed_blocks(cfg.mm_double_blocks_depth if checkpointing is True else checkpointing)
    g = torch.Generator().manual_seed(1)
    x, t = torch.randn(1, cfg.patch_in_channels, *GRID, generator=g), torch.tensor([300.0])
    text = dict(context=torch.randn(1, TEXT, cfg.text_states_dim, generator=g),
                context_mask=torch.arange(TEXT)[None] < 12,
                glyph=torch.randn(1, GLYPH, cfg.byt5_states_dim, generator=g), glyph_mask=torch.arange(GLYPH)[None] < 5,
                image_embeds=torch.randn(1, IMAGE, cfg.vision_states_dim, generator=g))
    target = torch.randn(1, cfg.out_channels, *GRID, generator=g)
    model(x, t, **text).float().sum().backward()  # gradients and the RoPE tables exist before the measured step
    with CPUAllocationTracker() as tracker:
        loss = (model(x, t, **text).float() - target).square().mean()
        saved = tracker.live - 4  # 4: the loss itself
        loss.backward()
    return saved, tracker.peak


# (checkpointing: False, True (every block) or the first n of 3; LoRA rank; dtype; ByT5 hidden width: at 64 the
#  blocks' backward is the peak, at the released 2048 the ByT5 mapper's 2048 x 2048 weight gradient is)
CASES = [(ckpt, lora, dtype, 64) for ckpt in (False, True, 1, 2) for lora in (None, 4)
         for dtype in (torch.float32, torch.bfloat16)]
CASES += [(ckpt, None, dtype, 2048) for ckpt in (False, True) for dtype in (torch.float32, torch.bfloat16)]


@pytest.mark.parametrize("checkpointing,lora,dtype,byt5_hidden", CASES)
def test_activation_model_equals_what_autograd_keeps(checkpointing, lora, dtype, byt5_hidden):
    cfg = replace(HY15_DIT_CONFIGS["tiny_i2v"], mm_double_blocks_depth=3, byt5_hidden_dim=byt5_hidden)
    saved, peak = _measure(cfg, lora, checkpointing, dtype)
    setting = Setting(0, checkpointing=bool(checkpointing),
                      checkpoint_blocks=None if isinstance(checkpointing, bool) else checkpointing)
    predicted = hy15_activation_bytes(cfg, GRID, setting, lora_rank=lora, s=dtype.itemsize, text_len=TEXT,
                                      glyph_len=GLYPH, image_len=IMAGE)
    assert predicted.saved == saved, predicted.parts
    assert predicted.peak == pytest.approx(peak, rel=0.1), (predicted.parts, peak)


def _job(tmp_path, **train):
    from PIL import Image

    from video_dit.train.config import parse_job

    (tmp_path / "data").mkdir(exist_ok=True)
    Image.new("RGB", (64, 64)).save(tmp_path / "data" / "a.png")
    base = helpers.write_hy15_base(tmp_path / "base.safetensors")
    process = helpers.train_process(tmp_path, network={"type": "lora", "linear": 4, "linear_alpha": 4},
                                    model={"name_or_path": str(base), "preset": "tiny-hy15-t2v"}, train=train)
    return parse_job({"job": "extension", "config": {"name": "j", "process": [process]}})


def test_a_hunyuan15_job_is_planned_and_auto_checkpoints_from_the_plan(tmp_path):
    """The job's plan is the family's DiT (its parameters with its LoRA targets, its activations with the
    text stream at the preset's lengths and a t2v batch's one masked image token) plus the family-blind
    state; `auto` takes the fewest blocks that fit."""
    from video_dit.devices import Machine

    job = _job(tmp_path, gradient_checkpointing="auto", dtype="bf16")
    preset = plan.get_preset("tiny-hy15-t2v")
    text = (preset.text_encoder.text_len, 256, 1)
    assert plan.job_inputs(job, preset) == {"text_tokens": text}
    sizes = plan.model_sizes(preset.dit, 4, torch.bfloat16, plan.family_of(preset))
    adapters = [p.numel() for n, p in _lora_model(preset.dit).named_parameters() if ".lora_" in n]
    assert sizes.trainable == sum(adapters) and sizes.lora == sum(adapters)
    grid = plan.latent_grid(preset, (17, 512, 512))
    machine = Machine(ranks=1, nodes=1, device="cuda", gpu_mem=64 * GiB)
    row = plan.plan_job(job, machine, buckets=[(17, 512, 512)]).buckets[0]
    assert row.auto.blocks == 0 and row.auto.fits  # a tiny model fits without checkpointing
    expected = hy15_activation_bytes(preset.dit, grid, Setting(2, checkpointing=False, checkpoint_blocks=0),
                                     lora_rank=4, s=2, text_len=text[0], glyph_len=text[1], image_len=text[2])
    assert row.as_configured.activations.peak == expected.peak
    # a capacity that no checkpointing misses and one checkpointed block meets: auto checkpoints one
    model = plan.AutoCheckpointing(job, machine)
    none, one = (model.predict(grid, Setting(2, checkpointing=n > 0, checkpoint_blocks=n)).device_bytes for n in (0, 1))
    assert one < none
    gpu = plan.CUDA_CONTEXT_BYTES + int((one + none) / 2 / (1 - plan.AUTO_MARGIN))
    assert plan.AutoCheckpointing(job, Machine(ranks=1, nodes=1, device="cuda", gpu_mem=gpu)).choose(grid).blocks == 1


def _lora_model(cfg):
    with torch.device("meta"):
        model = HunyuanVideo15DiT(cfg)
        add_lora(model, 4, targets=LORA_TARGETS)
    return model


def test_out_of_memory_line_quotes_the_plan(tmp_path):
    from video_dit.devices import Machine

    job = _job(tmp_path)
    machine = Machine(ranks=1, nodes=1, device="cuda", gpu_mem=2 ** 30)
    line = plan.oom_message(job, (3, 4, 4), 5 * GiB, machine, step=7)
    planned = plan.AutoCheckpointing(job, machine).predict((3, 4, 4), plan.setting_of(job))
    assert line.startswith("out of memory: step 7, bucket 9x64x64 (3x4x4 latents, 48 tokens)"), line
    assert "measured peak 5.00 GiB" in line and f"planned {planned.device_bytes / GiB:.2f} GiB" in line
    assert "\n" not in line
