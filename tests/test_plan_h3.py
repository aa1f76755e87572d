"""The memory plan of the MiniMax H3 DiT (`video_dit.families.minimax_h3.memory`), against what the DiT really
keeps: every tensor storage its forward and backward create, followed by `CPUAllocationTracker` on a tiny DiT in
this process. After the forward the live bytes equal the derivation exactly; the step's peak is within 10%.
Full fine-tuning and LoRA, fp32 and the bf16 a GPU job stores (float32 trainable masters under bf16 autocast, the
float32 islands), no / the first / every block checkpointed, padded and unpadded text, batches of 1 and 2."""

from __future__ import annotations

from dataclasses import replace

import helpers
import pytest
import torch

from video_dit.families.minimax_h3 import packing
from video_dit.families.minimax_h3.dit import LORA_TARGETS, H3DiT, cast_h3_dit
from video_dit.families.minimax_h3.memory import h3_activation_bytes
from video_dit.families.minimax_h3.presets import TINY_DIT
from video_dit.lora import add_lora
from video_dit.models.activation_terms import Setting
from video_dit.parallel.memory import CPUAllocationTracker
from video_dit.parallel.sequence import attach

# 3 x 2 x 2 video rows, 2 x 5 audio rows, 6 text rows (2 padding in sample 0 when padded): 28 packed rows
GRID, AUDIO, TEXT = (3, 4, 4), 5, 6
CFG = replace(TINY_DIT, num_layers=3)


def _measure(lora, dtype, checkpointing, batch, masked, cfg=CFG, grid=GRID, sp_info=None, text_len=TEXT,
             keyframe=False):
    """(bytes kept after the forward, the step's peak) of a tiny DiT trained as the trainer stores it; `sp_info`:
    this rank's `parallel.sequence.SPInfo` (test_plan_h3_sp.py's ranks), None: one process."""
    model = helpers.randomize_all(H3DiT(cfg, init_seed=0), seed=1).train()
    if lora:
        add_lora(model, lora, targets=LORA_TARGETS)
    else:
        model.requires_grad_(True)
    cast_h3_dit(model, dtype, masters=True)  # trainable float32, the frozen bulk in dtype, the islands float32
    model.set_checkpointed_blocks(checkpointing)
    if sp_info is not None:
        attach(model, sp_info)
    g = torch.Generator().manual_seed(0)
    B = batch
    video = torch.randn(B, cfg.in_channels, *grid, generator=g)
    audio = torch.randn(B, cfg.audio_channels, cfg.audio_in_channels, AUDIO, generator=g)
    text = torch.randn(B, text_len, cfg.text_dim, generator=g)
    kw = dict(audio=audio, audio_timestep=torch.tensor([300.0, 700.0][:B]))
    if masked:
        kw["text_mask"] = torch.arange(text_len)[None] < torch.tensor([text_len - 2, text_len][:B])[:, None]
    if keyframe:  # a first-frame job's step (conditioning.py): the first keyframe's rows, the caption presenting it
        kw["keyframes"] = torch.randn(B, cfg.in_channels, 1, *grid[1:], generator=g)
        kw["keyframe_anchors"], kw["keyframe_timestep"] = ("first",), torch.ones(B)
        tags = torch.full((text_len,), packing.TEXT_TAG)
        tags[1:4] = packing.VIDEO_TAG  # a vision block's rows
        kw["text_tags"] = tags
    targets = (torch.randn(video.shape, generator=g), torch.randn(audio.shape, generator=g))

    def loss():
        outputs = model(video, torch.tensor([500.0, 300.0][:B]), text, **kw)
        return sum((o.float() - target).square().mean() for o, target in zip(outputs, targets))

    loss().backward()  # gradients exist before the measured step
    with CPUAllocationTracker() as tracker:
        step = loss()
        # 4: the loss itself (settled: a gloo collective's thread lets its tensors go just after it returns)
        saved = (tracker.live if sp_info is None else tracker.settled_live()) - 4
        step.backward()
    return saved, tracker.peak


def _plan(lora, dtype, checkpointing, batch, masked, cfg=CFG, grid=GRID, sp=1, text_len=TEXT, rank=None,
          keyframe=False):
    setting = Setting(0, sp=sp, checkpointing=checkpointing > 0, checkpoint_blocks=checkpointing, micro_batch=batch)
    return h3_activation_bytes(cfg, grid, setting, lora_rank=lora, s=dtype.itemsize, text_len=text_len,
                               audio_frames=AUDIO, text_masked=masked, rank=rank, keyframes=int(keyframe),
                               presented=keyframe)


# (checkpointed blocks of 3, LoRA rank, dtype, batch, text padded)
F32, BF16 = torch.float32, torch.bfloat16
CASES = [(0, None, F32, 1, False), (1, None, BF16, 1, False), (3, None, F32, 1, True), (0, None, BF16, 2, True),
         (3, None, BF16, 1, False), (0, 4, F32, 1, False), (1, 4, F32, 2, True), (3, 4, BF16, 1, True),
         (0, 4, BF16, 1, True), (1, 4, BF16, 2, False)]


@pytest.mark.parametrize("checkpointing,lora,dtype,batch,masked", CASES)
def test_activation_model_equals_what_autograd_keeps(checkpointing, lora, dtype, batch, masked):
    saved, peak = _measure(lora, dtype, checkpointing, batch, masked)
    predicted = _plan(lora, dtype, checkpointing, batch, masked)
    print(f"\nsaved {saved} (planned {predicted.saved}), peak {peak} (planned {predicted.peak / peak:.3f} x)")
    assert predicted.saved == saved, predicted.parts
    assert predicted.peak == pytest.approx(peak, rel=0.1), (predicted.parts, peak)


@pytest.mark.parametrize("checkpointing,lora,dtype,batch,masked", [(0, None, F32, 1, False), (1, 4, BF16, 2, True)])
def test_a_first_frame_step_equals_what_autograd_keeps(checkpointing, lora, dtype, batch, masked):
    """A `do_i2v` job's step: the keyframe's rows (one latent frame, its own timestep group) and a caption with a
    vision block (text rows tagged as video), what the forward keeps to the byte, the peak within 10%."""
    saved, peak = _measure(lora, dtype, checkpointing, batch, masked, keyframe=True)
    predicted = _plan(lora, dtype, checkpointing, batch, masked, keyframe=True)
    print(f"\nsaved {saved} (planned {predicted.saved}), peak {peak} (planned {predicted.peak / peak:.3f} x)")
    assert predicted.saved == saved, predicted.parts
    assert predicted.peak == pytest.approx(peak, rel=0.1), (predicted.parts, peak)
    assert _plan(lora, dtype, checkpointing, batch, masked).saved != saved  # the keyframe's rows count


def test_the_released_proportions():
    """At the released widths / 32 (D 168, attention 2 x 112, SwiGLU 448: 5376, 7168, 14336 / 32) and more rows than
    D (336 here, 15,356 at 124 x 480 x 832 against 5376), where a block's re-run and its backward set the peak of a
    checkpointed LoRA step as in a released job: exact, the peak within 10% (planned / measured 1.024)."""
    cfg = replace(TINY_DIT, num_attention_heads=2, attention_head_dim=112, hidden_size=168, ffn_dim=448,
                  time_embed_dim=84, time_embed_hidden_dim=168, rope_freq_dim=14, num_layers=3)
    grid = (5, 16, 16)
    saved, peak = _measure(32, BF16, 3, 1, False, cfg=cfg, grid=grid)
    predicted = _plan(32, BF16, 3, 1, False, cfg=cfg, grid=grid)
    print(f"\nsaved {saved} (planned {predicted.saved}), peak {peak} (planned {predicted.peak / peak:.3f} x)")
    assert predicted.saved == saved, predicted.parts
    assert predicted.peak == pytest.approx(peak, rel=0.1), (predicted.parts, peak)


def test_a_wrong_term_fails_the_equality():
    """The equality can fail: the step measured, planned with one more checkpointed block, as unpadded text, with
    another LoRA rank or one more block, differs."""
    saved, _ = _measure(4, BF16, 1, 1, True)
    assert _plan(4, BF16, 1, 1, True).saved == saved
    for other in (_plan(4, BF16, 2, 1, True), _plan(4, BF16, 1, 1, False), _plan(8, BF16, 1, 1, True),
                  _plan(4, BF16, 1, 1, True, cfg=replace(CFG, num_layers=4))):
        assert other.saved != saved


def test_the_example_job_plans_without_its_files(capsys):
    """Without the Qwen3-VL's files, the plan counts the released conditioner from its config on the meta device
    (`qwen3vl_parameters`): one decoder layer of it is the count derived here from the config's numbers; the
    example job (configs/minimax_h3_lora_124x704x1280_8gpu.yaml) then plans with no file of it here, and prints the
    row the README quotes."""
    from pathlib import Path

    from video_dit import cli
    from video_dit.families.minimax_h3 import QWEN3VL_TEXT, qwen3vl_parameters

    c = QWEN3VL_TEXT
    D, Dh, q, kv, inner = (c["hidden_size"], c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"],
                           c["intermediate_size"])
    # q, k, v, o (no biases), the q / k norms, gate / up / down, two RMSNorms
    layer = D * q * Dh + 2 * D * kv * Dh + q * Dh * D + 2 * Dh + 3 * D * inner + 2 * D
    assert qwen3vl_parameters(2) - qwen3vl_parameters(1) == layer
    root = Path(__file__).resolve().parents[1]
    assert cli.main(["plan", str(root / "configs" / "minimax_h3_lora_124x704x1280_8gpu.yaml"), "--gpus", "8",
                     "--gpu-mem", "80", "--host-mem", "1024", "--bucket", "124x704x1280"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.strip().startswith("124x704x1280"))
    assert row in (root / "README.md").read_text()



# (text rows, keyframes, audio latents a channel, latent grid (F', h, w), SP degree)
LAYOUTS = [(6, 0, 5, (3, 4, 4), 1), (7, 0, 5, (3, 2, 6), 2), (7, 1, 5, (3, 2, 6), 2), (5, 0, 3, (7, 2, 2), 4),
           (512, 2, 155, (31, 8, 10), 4)]


@pytest.mark.parametrize("text,keyframes,audio,grid,sp", LAYOUTS)
def test_rows_and_runs_per_rank_are_the_rank_orders(text, keyframes, audio, grid, sp):
    """The SP layout the plan counts, against the DiT's own: each rank's rows (padding included) and runs of AdaLN
    entries are those of its share of `packing.rank_order` over `Layout.entries()` (`row_runs`), the plan's
    default the most; not ceil(N / sp) rows where chunks pad (7 text, 10 audio, 9 video rows at SP 2: 14 a rank,
    not 13). test_plan_h3_sp.py measures what such a rank keeps (`-m slow`: a launch of 2 ranks)."""
    pt, ph, pw = CFG.patch_size
    layout = packing.Layout(text_len=text, text_tags=(packing.TEXT_TAG,) * text, anchors=("first",) * keyframes,
                            grid=(grid[0] // pt, grid[1] // ph, grid[2] // pw), latent_hw=grid[1:],
                            audio_channels=CFG.audio_channels, audio_frames=audio)
    shares = packing.rank_order(layout.segments, sp).reorder(layout.entries(), 0).chunk(sp)
    runs = [len(packing.row_runs(share)) for share in shares]
    setting = Setting(0, sp=sp)

    def plan(rank):
        parts = h3_activation_bytes(CFG, grid, setting, lora_rank=None, s=2, text_len=text, audio_frames=audio,
                                    keyframes=keyframes, rank=rank).parts
        return parts["rows_per_rank"], parts["runs"]

    for rank in range(sp):
        assert plan(rank) == (shares[rank].numel(), runs[rank]), (rank, plan(rank), runs)
    assert plan(None) == (shares[0].numel(), max(runs))
    if (text, keyframes, sp) == (7, 0, 2):
        assert shares[0].numel() == 14 != -(-layout.length // sp)


def test_a_first_frame_job_plans_the_keyframe_and_its_vision_block():
    """A `do_i2v` job's plan adds one latent frame of keyframe rows and the vision block the caption presents:
    `vision_block_rows` against the block the tiny conditioner's own image processor (transformers') makes for
    images it keeps, rounds and scales down, and the released processor's for a 704 x 1280 frame (no resize: 22 x
    40 image tokens and the two markers)."""
    from PIL import Image

    from video_dit.families import get_preset
    from video_dit.families.minimax_h3 import FAMILY
    from video_dit.families.minimax_h3.encoders import H3_QWEN3VL, TINY_QWEN3VL, tiny_h3_text_encoder, vision_block_rows
    from video_dit.families.minimax_h3.presets import AUDIO as AUDIO_VAES

    encoder = tiny_h3_text_encoder(0)
    for height, width in ((32, 32), (24, 40), (64, 96), (128, 64)):
        shown = encoder.encode(["a"], images=[[Image.new("RGB", (width, height))]])[0]
        assert vision_block_rows(TINY_QWEN3VL, height, width) == int((shown.tags == packing.VIDEO_TAG).sum())
    assert vision_block_rows(H3_QWEN3VL, 704, 1280) == 22 * 40 + 2
    preset = get_preset("tiny-h3")
    inputs = {"text_len": TEXT, "vae": preset.vae, "fps": 24.0, "audio": AUDIO_VAES["tiny-h3"], "keyframes": 1,
              "text_encoder": TINY_QWEN3VL}
    grid, cell = (7, 4, 4), preset.vae.spatial_compression
    plan = FAMILY.memory.activations(CFG, grid, Setting(0), lora_rank=None, s=4, fused=False, inputs=inputs)
    rows = plan.parts["rows"]
    assert rows["keyframe"] == rows["video"] // grid[0]  # one latent frame
    assert rows["text"] == TEXT + vision_block_rows(TINY_QWEN3VL, grid[1] * cell, grid[2] * cell)
