"""LTX-2 in the DeepSpeed trainer, trained like Wan and HunyuanVideo 1.5: both streams (the clips' sound cached by
the family's codec) on 2 CPU ranks over gloo, the tiny seeded preset on generated clips with sound (17 frames of
64 x 64 at 16 fps: 3 x 2 x 2 = 12 video tokens and 27 audio tokens, odd: under SP 2 rank 1 holds a padded audio
token). Two launches started together, each with its own copy of the data (their caches are built at once):
  2 ranks  z2  t2v LoRA, ZeRO-2, SP 2 (one data-parallel rank), no block checkpointing, 4 steps
           r   z2's job stopped after step 2, then resumed from its step-2 checkpoint
           z3  z2 under ZeRO-3 with the first block checkpointed
           b   z2 in bf16 (`train.cpu_bf16`) with every block checkpointed, 2 steps
           f   i2v (a `do_i2v` dataset: the first latent frame replaced by the clean one, its tokens at timestep 0
               and out of the loss, as ltx-trainer conditions it), full fine-tune, ZeRO-2 data parallel (SP 1),
               `gradient_checkpointing: auto`, a preview from a held-out first frame at step 2, exported
               (ltx-trainer conditions a sample with probability `first_frame_conditioning_p`, 0.1 by default;
               a `do_i2v` dataset here conditions every clip, as for Wan and HunyuanVideo)
  1 rank   one z2 on one rank, SP 1, every block checkpointed
Then z2's LoRA file (ComfyUI's LTX-2 keys) is read back to the trained adapters and `video-dit sample --lora`
renders it with its sound.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import av
import helpers
import pytest
import ranks
import torch
from safetensors.torch import load_file

from video_dit.data.demo_av import make_demo_av_data

pytestmark = pytest.mark.multirank

PRESET = "tiny-ltx2-t2v"


def ltx2_job(root: Path, name: str, data: str, *, do_i2v: bool = False, sp: int = 1, **kw) -> Path:
    dataset = {"folder_path": str(root / data), "num_frames": 17, "fps": 16, "resolution": [64], "do_i2v": do_i2v,
               "shrink_video_to_frames": False, "caption_ext": "txt"}
    train = {"seed": 3, "warmup_steps": 1, "lr_scheduler": "constant", **kw.pop("train", {})}
    return helpers.write_job(root, name, datasets=[dataset], size=64, keep=2, lr=kw.pop("lr", 1e-2), train=train,
                             model={"preset": PRESET, "name_or_path": str(root / "base.safetensors")},
                             deepspeed={"sequence_parallel_size": sp, **kw.pop("deepspeed", {})}, **kw)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ltx2_train")
    for data in ("data2", "data1"):
        make_demo_av_data(root / data, count=3, frames=17, size=64, holdout=1, fps=16)
    helpers.write_ltx2_base(root / "base.safetensors")
    common = dict(steps=4, save_every=2)
    r = ltx2_job(root, "r", "data2", sp=2, **common)
    two = [{"config": str(ltx2_job(root, "z2", "data2", sp=2, **common))},
           {"config": str(r), "stop_at": 2},
           {"config": str(r), "resume": str(root / "out/r/checkpoints/step_000000002")},
           {"config": str(ltx2_job(root, "z3", "data2", sp=2, zero=3, steps=4, save_every=4,
                                   train={"gradient_checkpointing": 1}))},
           {"config": str(ltx2_job(root, "b", "data2", sp=2, steps=2, save_every=2,
                                   train={"dtype": "bf16", "cpu_bf16": True, "gradient_checkpointing": True}))},
           {"config": str(ltx2_job(root, "f", "data2", do_i2v=True, lora=False, steps=2, save_every=2,
                                   samples=[helpers.holdout_sample(root / "data2")], sample_every=2,
                                   sample={"num_frames": 9, "fps": 16}, train={"gradient_checkpointing": "auto"}))}]
    one = [{"config": str(ltx2_job(root, "one", "data1", steps=4, save_every=4,
                                   train={"gradient_checkpointing": True}))}]
    started = [ranks.start_jobs(root, two, 2), ranks.start_jobs(root, one, 1)]
    for procs, prefix in started:
        ranks.wait(procs, prefix, timeout=900)
    return root


# Not bit-exact: the sequence-parallel exchange and ZeRO-3's partitions sum fp32 terms in another order.
# Measured (z2 vs one, z3 vs z2; both streams' losses): losses 0 / 1.1e-7 relative, gradient norms 9.6e-8 /
# 5.3e-8, the trained LoRA (`helpers.assert_trained_close`) 2.2e-6 / 9.7e-7; the tolerances are ~20x the largest.
LOSS_RTOL, GRAD_RTOL, LORA_RTOL = 2e-6, 2e-6, 5e-5
rows, _worst = helpers.step_rows, helpers.worst_relative


def _assert_same_training(a: list[dict], b: list[dict], what: str) -> None:
    helpers.assert_same_training(a, b, what, steps=[1, 2, 3, 4], loss_rtol=LOSS_RTOL, grad_rtol=GRAD_RTOL)


def test_sp2_trains_as_sp1(runs):
    """2 ranks x SP 2 against 1 rank x SP 1 (each one data-parallel rank: the same batches and noise): the same
    losses of both streams, gradient norms and trained adapters."""
    z2, one = rows(runs, "z2"), rows(runs, "one")
    _assert_same_training(z2, one, "SP 2 vs SP 1")
    assert len({r["loss"] for r in one}) == 4 and all(r["loss_audio"] > 0 for r in one)  # four batches, with sound
    assert [r["sp_degree"] for r in z2] == [2] * 4 and one[0]["sp_degree"] == 1
    a, b = (load_file(str(runs / "out" / n / f"{n}.safetensors")) for n in ("z2", "one"))
    print(f"\nSP 2 vs SP 1: losses {_worst(z2, one, 'loss'):.1e}, grad norms {_worst(z2, one, 'grad_norm'):.1e}, "
          f"LoRA {helpers.assert_trained_close(a, b, rtol=LORA_RTOL):.1e}")


def test_zero3_trains_as_zero2(runs):
    z3, z2 = rows(runs, "z3"), rows(runs, "z2")
    _assert_same_training(z3, z2, "ZeRO-3 vs ZeRO-2")
    a, b = (load_file(str(runs / "out" / n / f"{n}.safetensors")) for n in ("z3", "z2"))
    print(f"\nZeRO-3 vs ZeRO-2: losses {_worst(z3, z2, 'loss'):.1e}, grad norms {_worst(z3, z2, 'grad_norm'):.1e}, "
          f"LoRA {helpers.assert_trained_close(a, b, rtol=LORA_RTOL):.1e}")


def test_resume_gives_the_uninterrupted_losses(runs):
    z2, r = {x["step"]: x for x in rows(runs, "z2")}, {x["step"]: x for x in rows(runs, "r")}
    assert sorted(r) == [1, 2, 3, 4]
    for step in (3, 4):  # exactly: the checkpoint holds everything the next steps depend on
        assert (r[step]["loss"], r[step]["loss_audio"]) == (z2[step]["loss"], z2[step]["loss_audio"]), step


def test_bf16_lora_keeps_the_float32_islands(runs):
    """`train.cpu_bf16`: the matmuls in bf16, the frozen bulk stored in bf16, the adapters float32 masters and the
    family's float32 islands (adaLN-singles, output Linears, tables, q / k norms) float32; its first loss, the
    same batch and noise as z2's, within bf16's rounding of it."""
    res = ranks.result(runs / "out" / "b")
    assert res["dtype"] == "torch.bfloat16" and res["linear_output_dtypes"] == ["torch.bfloat16"]
    assert res["param_dtypes"] == ["torch.bfloat16", "torch.float32"]
    b, z2 = rows(runs, "b"), rows(runs, "z2")
    print(f"\nbf16 vs fp32 first loss: {abs(b[0]['loss'] - z2[0]['loss']) / z2[0]['loss']:.1e} (relative)")
    assert b[0]["loss"] == pytest.approx(z2[0]["loss"], rel=4e-3)  # measured 2.7e-4: ~15x


def test_i2v_full_fine_tune_auto_checkpointing_previews_and_exports(runs):
    """The i2v job: first-frame latents cached beside the sound's; `auto` chose from the plan; the preview from
    the held-out first frame is an MP4 of 9 frames with its sound; the export loads as the LTX-2 DiT it trained."""
    from video_dit.families.ltx2.dit import LTX2DiT
    from video_dit.families.ltx2.loading import load_ltx2_dit

    f = rows(runs, "f")
    assert [r["step"] for r in f] == [1, 2] and all(r["loss"] == r["loss"] for r in f)
    log = "".join(p.read_text() for p in runs.glob("spec_*_rank0.log"))
    assert "gradient_checkpointing auto: latents 3x2x2 (12 tokens): 0 of 2 blocks checkpointed" in log  # the plan's
    cached = [load_file(str(p)) for p in (runs / "data2").rglob("*.safetensors")]
    assert any("first_frame_latents" in t and "audio_latents" in t for t in cached)
    mp4 = runs / "out/f/samples/000000002_0.mp4"
    with av.open(str(mp4)) as c:
        assert c.streams.video[0].frames == 9 and c.streams.audio[0].rate == 8000
    dit = load_ltx2_dit(runs / "out/f/f")
    assert isinstance(dit, LTX2DiT)
    base = load_file(str(runs / "base.safetensors"))
    assert any(not torch.equal(dit.state_dict()[k], base[k]) for k in base)


def test_lora_file_is_comfyuis_and_samples_with_sound(runs, tmp_path):
    """z2's LoRA file: ComfyUI's LTX-2 keys (Lightricks' module names under `diffusion_model.`), read back to the
    trained adapters; `video-dit sample --lora` renders it with its audio track."""
    from video_dit.cli import main as cli
    from video_dit.families.ltx2.dit import LORA_TARGETS, LTX2DiT

    path = runs / "out/z2/z2.safetensors"
    helpers.assert_trained_comfy_lora(path, LTX2DiT, PRESET, LORA_TARGETS, "diffusion_model.transformer_blocks.",
                                      "diffusion_model.transformer_blocks.0.audio_to_video_attn.to_q.lora_A.weight")
    # `load_lora` puts adapters on exactly the file's modules and refuses a key the DiT lacks
    out = tmp_path / "lora.mp4"
    code = cli(["sample", "--model", str(runs / "base.safetensors"), "--preset", PRESET, "--lora", str(path),
                "--prompt", "a red square moving up", "--frames", "9", "--height", "64", "--width", "64", "--steps",
                "2", "--fps", "16", "--out", str(out)])
    assert code == 0
    with av.open(str(out)) as c:
        assert c.streams.video[0].frames == 9 and c.streams.audio[0].rate == 8000  # the tiny vocoder's rate
    shutil.rmtree(tmp_path, ignore_errors=True)


def test_bf16_lora_storage_keeps_the_ltx2_float32_islands(tmp_path):
    """The trainer's build for a bf16 LoRA job (`make_trainable`, the family's cast), by name: the frozen bulk in
    bf16, the adapters float32 masters, and LTX-2's own islands float32 (every adaLN-single, the output Linears,
    the modulation tables, the q / k norm scales, both streams'); a bf16 step then trains the adapters of both."""
    from video_dit.families import get_preset
    from video_dit.families.ltx2 import FAMILY as LTX2
    from video_dit.train.build import build_dit, make_trainable
    from video_dit.train.config import parse_job

    make_demo_av_data(tmp_path / "data", count=1, frames=17, size=64, holdout=0, fps=16)
    base = str(helpers.write_ltx2_base(tmp_path / "base.safetensors"))
    dataset = {"folder_path": str(tmp_path / "data"), "num_frames": 17, "fps": 16, "resolution": [64],
               "shrink_video_to_frames": False}
    process = helpers.train_process(tmp_path, model={"name_or_path": base, "preset": PRESET}, datasets=[dataset],
                                    train={"dtype": "bf16", "cpu_bf16": True})
    process = parse_job({"job": "extension", "config": {"name": "j", "process": [process]}}).process
    preset = get_preset(PRESET)
    dit = build_dit(base, preset, dtype=torch.bfloat16)
    make_trainable(dit, process, torch.bfloat16, family=LTX2)
    dtypes = {n: p.dtype for n, p in dit.named_parameters()}
    block = "transformer_blocks.0."
    for bulk in ("attn1.to_q.base_layer.weight", "audio_ff.net.0.proj.base_layer.weight",
                 "video_to_audio_attn.to_k.base_layer.weight", "attn2.to_gate_logits.weight"):
        assert dtypes[block + bulk] == torch.bfloat16, bulk
    assert dtypes[block + "audio_to_video_attn.to_v.lora_A.default.weight"] == torch.float32
    for island in ("adaln_single.linear.weight", "audio_adaln_single.emb.timestep_embedder.linear_1.weight",
                   "av_ca_a2v_gate_adaln_single.linear.weight", "prompt_adaln_single.linear.weight", "proj_out.weight",
                   "audio_proj_out.weight", "scale_shift_table", "audio_scale_shift_table",
                   block + "scale_shift_table_a2v_ca_audio", block + "audio_prompt_scale_shift_table",
                   block + "attn1.q_norm.weight", block + "audio_attn2.k_norm.weight"):
        assert dtypes[island] == torch.float32, island
    cfg = preset.dit
    x, t = torch.randn(1, cfg.in_channels, 2, 2, 2), torch.tensor([500.0])
    v, a = dit(x, t, torch.randn(1, 5, cfg.hidden_size), audio=torch.randn(1, 2, 7, 4), audio_timestep=t,
               audio_context=torch.randn(1, 5, cfg.audio_hidden_size))
    assert v.dtype == a.dtype == torch.float32  # the output Linears' float32
    (v.square().mean() + a.square().mean()).backward()
    grads = {n: p.grad for n, p in dit.named_parameters() if ".lora_B" in n}
    assert all(g is not None and g.dtype == torch.float32 for g in grads.values())
    assert any(g.abs().max() > 0 for n, g in grads.items() if ".audio_" in n)
    assert any(g.abs().max() > 0 for n, g in grads.items() if ".attn1." in n)
