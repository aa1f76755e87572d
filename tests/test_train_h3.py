"""MiniMax H3 in the DeepSpeed trainer, trained like the other families: text-to-video+audio (the clips' sound
cached by the family's codec, its timesteps tied to the video's), 2 CPU ranks over gloo, the tiny seeded preset
on generated clips with sound (22 frames of 32 x 32 at 24 fps, the shortest clip H3 takes: 7 x 4 x 4 = 112 video
rows, 2 x 37 = 74 audio rows beside a caption's text rows, one packed sequence). Two launches started together,
each with its own copy of the data (their caches are built at once):
  2 ranks  z   LoRA, ZeRO-2, SP 2 (one data-parallel rank: every rank an equal slice of the text, audio and video
               rows, `packing.rank_order`), no block checkpointing, 4 steps
           r   z resumed from z's step-2 checkpoint: steps 3 and 4
           z0  z under ZeRO-0 (whose engine reports no gradient norm)
           z3  z under ZeRO-3 with the first block checkpointed, parameters and optimizer offloaded
           b   z in bf16 (`train.cpu_bf16`) with every block checkpointed, 1 step
           f   first-frame (fl2va) training from a `do_i2v` dataset (the clip's first frame a keyframe row, its
               caption cached presented with it: conditioning.py), full fine-tune, ZeRO-2 data parallel (SP 1),
               `gradient_checkpointing: auto`, 2 steps, exported
  1 rank   one z on one rank, SP 1, every block checkpointed
Then z's LoRA file (ComfyUI's keys) is read back to the trained adapters and `video-dit sample --lora` renders
it with its sound.
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
from video_dit.families.minimax_h3 import packing

pytestmark = pytest.mark.multirank

PRESET = "tiny-h3"
FRAMES, SIZE, FPS = 22, 32, 24


def h3_job(root: Path, name: str, data: str, *, sp: int = 1, do_i2v: bool = False, **kw) -> Path:
    dataset = {"folder_path": str(root / data), "num_frames": FRAMES, "fps": FPS, "resolution": [SIZE],
               "do_i2v": do_i2v, "shrink_video_to_frames": False, "caption_ext": "txt"}
    train = {"seed": 3, "warmup_steps": 1, "lr_scheduler": "constant", **kw.pop("train", {})}
    return helpers.write_job(root, name, datasets=[dataset], size=SIZE, keep=2, lr=kw.pop("lr", 1e-2), train=train,
                             model={"preset": PRESET, "name_or_path": str(root / "base.safetensors")},
                             deepspeed={"sequence_parallel_size": sp, **kw.pop("deepspeed", {})}, **kw)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("h3_train")
    for data in ("data2", "data1"):
        make_demo_av_data(root / data, count=3, frames=FRAMES, size=SIZE, holdout=0, fps=FPS)
    helpers.write_h3_base(root / "base.safetensors")
    common = dict(steps=4, save_every=2)
    two = [{"config": str(h3_job(root, "z", "data2", sp=2, **common))},
           {"config": str(h3_job(root, "r", "data2", sp=2, **common)),
            "resume": str(root / "out/z/checkpoints/step_000000002")},
           {"config": str(h3_job(root, "z0", "data2", sp=2, zero=0, steps=4, save_every=4))},
           {"config": str(h3_job(root, "z3", "data2", sp=2, zero=3, steps=4, save_every=4,
                                 train={"gradient_checkpointing": 1},
                                 deepspeed={"offload_optimizer": True, "offload_param": True}))},
           {"config": str(h3_job(root, "b", "data2", sp=2, steps=1, save_every=1,
                                 train={"dtype": "bf16", "cpu_bf16": True, "gradient_checkpointing": True}))},
           {"config": str(h3_job(root, "f", "data2", do_i2v=True, lora=False, steps=2, save_every=2,
                                 train={"gradient_checkpointing": "auto"}))}]
    one = [{"config": str(h3_job(root, "one", "data1", steps=4, save_every=4,
                                 train={"gradient_checkpointing": True}))}]
    started = [ranks.start_jobs(root, two, 2), ranks.start_jobs(root, one, 1)]
    for procs, prefix in started:
        ranks.wait(procs, prefix, timeout=600)
    return root


# Not bit-exact: the sequence-parallel exchange and ZeRO-3's partitions sum fp32 terms in another order.
# Measured (z vs one; z3 vs z0 and z; both streams' losses): losses 2.1e-7; 0 and 0, gradient norms 9.4e-8; 0 (vs
# z: 4.3e-8 before z3 offloaded), the trained LoRA (`helpers.assert_trained_close`) 2.9e-7; 0 and 0; the
# tolerances are ~20x the largest.
LOSS_RTOL, GRAD_RTOL, LORA_RTOL = 4e-6, 2e-6, 6e-6
rows, _worst = helpers.step_rows, helpers.worst_relative


def _assert_same_training(a: list[dict], b: list[dict], what: str, grad_norms: bool = True) -> None:
    helpers.assert_same_training(a, b, what, steps=[1, 2, 3, 4], loss_rtol=LOSS_RTOL,
                                 grad_rtol=GRAD_RTOL if grad_norms else None)


def test_sp2_trains_as_sp1_with_every_modality_on_each_rank(runs):
    """2 ranks x SP 2 against 1 rank x SP 1 (each one data-parallel rank: the same batches and noise): the same
    losses of both streams, gradient norms and trained adapters; each rank of the SP 2 job held rows of the
    text, the audio and the video (the AdaLN entries of the rows its seam kept)."""
    z, one = rows(runs, "z"), rows(runs, "one")
    _assert_same_training(z, one, "SP 2 vs SP 1")
    assert len({r["loss"] for r in one}) == 4 and all(r["loss_audio"] > 0 for r in one)  # four batches, with sound
    assert [r["sp_degree"] for r in z] == [2] * 4 and one[0]["sp_degree"] == 1
    for rank in (0, 1):
        held = set(ranks.result(runs / "out" / "z", rank)["sp_split_integer_values"])
        assert held == {packing.E_TEXT, packing.E_AUDIO, packing.E_VIDEO}, (rank, held)
    assert ranks.result(runs / "out" / "one")["sp_split_integer_values"] == []  # no seam at SP 1
    cached = [load_file(str(p)) for p in (runs / "data2").rglob("*.safetensors")]
    # a caption of an odd row count (the tiny tokenizer's: 47 and 49 of the three): rank 1's text slice is padded,
    # a key the gathered key mask hides (unmasked, the losses above would differ)
    assert any(t["text_embeds"].shape[0] % 2 for t in cached if "text_embeds" in t)
    a, b = (load_file(str(runs / "out" / n / f"{n}.safetensors")) for n in ("z", "one"))
    print(f"\nSP 2 vs SP 1: losses {_worst(z, one, 'loss'):.1e} (audio {_worst(z, one, 'loss_audio'):.1e}), "
          f"grad norms {_worst(z, one, 'grad_norm'):.1e}, "
          f"LoRA {helpers.assert_trained_close(a, b, rtol=LORA_RTOL):.1e}")


def test_zero3_trains_as_zero0_and_zero2(runs):
    """The SP 2 job under ZeRO-3 (partitioned parameters offloaded with the optimizer, the first block checkpointed)
    against ZeRO-0 (losses of both streams, trained adapters: its engine reports no gradient norm) and ZeRO-2
    (gradient norms too)."""
    z3, z0, z = rows(runs, "z3"), rows(runs, "z0"), rows(runs, "z")
    assert all(r["grad_norm"] is None for r in z0)
    for rank in (0, 1):  # DeepSpeed's ZeRO-3 optimizer really offloads (on CPU ranks: to host buffers)
        got = ranks.result(runs / "out" / "z3", rank)
        assert (got["offload_optimizer"], got["offload_param"]) == (True, True), got
        assert not ranks.result(runs / "out" / "z", rank)["offload_optimizer"]
    _assert_same_training(z3, z0, "ZeRO-3 vs ZeRO-0", grad_norms=False)
    _assert_same_training(z3, z, "ZeRO-3 vs ZeRO-2")
    a, b, c = (load_file(str(runs / "out" / n / f"{n}.safetensors")) for n in ("z3", "z0", "z"))
    print(f"\nZeRO-3 vs ZeRO-0: losses {_worst(z3, z0, 'loss'):.1e} (audio {_worst(z3, z0, 'loss_audio'):.1e}), "
          f"LoRA {helpers.assert_trained_close(a, b, rtol=LORA_RTOL):.1e}; "
          f"vs ZeRO-2: losses {_worst(z3, z, 'loss'):.1e}, "
          f"grad norms {_worst(z3, z, 'grad_norm'):.1e}, LoRA {helpers.assert_trained_close(a, c, rtol=LORA_RTOL):.1e}")


def test_resume_gives_the_uninterrupted_losses(runs):
    z, r = {x["step"]: x for x in rows(runs, "z")}, {x["step"]: x for x in rows(runs, "r")}
    assert sorted(r) == [3, 4]
    for step in (3, 4):  # exactly: the checkpoint holds everything the next steps depend on
        assert (r[step]["loss"], r[step]["loss_video"], r[step]["loss_audio"]) == \
            (z[step]["loss"], z[step]["loss_video"], z[step]["loss_audio"]), step


def test_bf16_lora_keeps_the_float32_islands(runs):
    """`train.cpu_bf16`: the matmuls in bf16, the frozen bulk stored in bf16, the adapters float32 masters and
    H3's float32 islands (`FLOAT32_MODULES`: the patch projections, the timestep MLP, the final layer; every
    RMSNorm scale) float32; its first loss, the same batch and noise as z's, within bf16's rounding of it."""
    from video_dit.families import get_preset
    from video_dit.families.minimax_h3.dit import FLOAT32_MODULES, H3DiT

    res = ranks.result(runs / "out" / "b")
    assert res["dtype"] == "torch.bfloat16" and res["linear_output_dtypes"] == ["torch.bfloat16"]
    assert res["param_dtypes"] == ["torch.bfloat16", "torch.float32"]
    with torch.device("meta"):
        names = [n for n, _ in H3DiT(get_preset(PRESET).dit).named_parameters()]
    islands = {n for n in names if n.split(".")[0] in FLOAT32_MODULES or n.endswith(("_norm.weight", "norm1.weight",
                                                                                     "norm2.weight"))}
    assert islands >= {"video_patch_proj.weight", "audio_patch_proj.weight", "time_embedder.proj_in.weight",
                       "final_layer.video_out.weight", "final_layer.audio_out.weight", "blocks.1.attn.k_norm.weight"}
    float32 = set(res["float32_params"])
    adapters = {n for n in float32 if ".lora_" in n}
    assert adapters and all(n.startswith("blocks.") for n in adapters)  # the float32 masters of the adapters
    assert float32 - adapters <= islands  # nothing else float32: the bulk is bf16
    assert {n for n in islands if n.split(".")[0] in FLOAT32_MODULES} | {"blocks.1.attn.k_norm.weight"} <= float32
    assert not {"blocks.0.attn.qkv_proj.base_layer.weight", "blocks.0.adaln_proj.linear.weight"} & float32
    b, z = rows(runs, "b"), rows(runs, "z")
    print(f"\nbf16 vs fp32 first loss: {abs(b[0]['loss'] - z[0]['loss']) / z[0]['loss']:.1e} (relative)")
    assert b[0]["loss"] == pytest.approx(z[0]["loss"], rel=7e-5)  # measured 3.6e-6: ~20x


def test_first_frame_full_fine_tune_auto_checkpointing_exports(runs):
    """The first-frame full fine-tune on 2 data-parallel ranks: the keyframe latents and the presented captions
    cached beside the plain ones; `auto` chose from the plan; the export loads as the H3 DiT it trained."""
    from video_dit.families.minimax_h3.dit import H3DiT
    from video_dit.families.minimax_h3.loading import load_h3_dit

    f = rows(runs, "f")
    assert [r["step"] for r in f] == [1, 2] and all(r["loss"] == r["loss"] for r in f)
    log = "".join(p.read_text() for p in runs.glob("spec_*_rank0.log"))
    assert "gradient_checkpointing auto: latents 7x8x8 (112 tokens): 0 of 2 blocks checkpointed" in log  # the plan's
    cached = [load_file(str(p)) for p in (runs / "data2").rglob("*.safetensors")]
    assert any("audio_latents" in t and "first_frame_latents" in t for t in cached)
    tags = [t["text_tags"] for t in cached if "text_tags" in t]  # a presented caption: a vision block in its rows
    assert tags and all(bool((g != packing.TEXT_TAG).any()) for g in tags)
    dit = load_h3_dit(runs / "out/f/f")
    assert isinstance(dit, H3DiT)
    base = load_file(str(runs / "base.safetensors"))
    assert any(not torch.equal(dit.state_dict()[k], base[k]) for k in base)


def test_lora_file_is_comfyuis_and_samples_with_sound(runs, tmp_path):
    """z's LoRA file: ComfyUI's keys (MiniMax's module names under `diffusion_model.`), read back to the trained
    adapters; `video-dit sample --lora` renders it with its audio track."""
    from video_dit.cli import main as cli
    from video_dit.families.minimax_h3.dit import LORA_TARGETS, H3DiT

    path = runs / "out/z/z.safetensors"
    helpers.assert_trained_comfy_lora(path, H3DiT, PRESET, LORA_TARGETS, "diffusion_model.blocks.",
                                      "diffusion_model.blocks.0.attn.qkv_proj.lora_A.weight")
    out = tmp_path / "lora.mp4"
    code = cli(["sample", "--model", str(runs / "base.safetensors"), "--preset", PRESET, "--lora", str(path),
                "--prompt", "a red square moving up", "--frames", str(FRAMES), "--height", str(SIZE), "--width",
                str(SIZE), "--steps", "2", "--fps", str(FPS), "--out", str(out)])
    assert code == 0
    with av.open(str(out)) as c:
        assert c.streams.video[0].frames == FRAMES and c.streams.audio[0].rate == 32000
    shutil.rmtree(tmp_path, ignore_errors=True)
