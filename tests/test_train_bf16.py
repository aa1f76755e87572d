"""bf16 training end to end through the trainer on 2 CPU ranks over gloo: `train.dtype: bf16` with
`train.cpu_bf16: true` (without it CPU ranks train in float32, see `train.engine.train_dtype`), the
tiny preset, float32 master weights (`train.engine.cast_for_training`).

CI (one launch of tests/ranks.py's job worker): the ZeRO-2 LoRA and the ZeRO-3 full fine-tune, each
  8 steps with a checkpoint every 4 and the fixed-noise loss on the training clips
  (`train.validation_config`) at steps 0 and 8, then resumed from its step-4 checkpoint; and the
  ZeRO-2 LoRA again in float32 for 2 steps (the independent computation bf16 must track, not equal).
Slow (`-m slow`, two more launches): the ZeRO-0 LoRA, the ZeRO-3 LoRA, the ZeRO-2 full fine-tune and
  a ZeRO-2 LoRA on a quantized (qfloat8) base likewise; the ZeRO-3 full fine-tune with rank 1
  SIGKILLed in the middle of step 6 (`VIDEO_DIT_FAULT` for that job only), then relaunched as a
  user would (`save.resume: auto`): it resumes from step 4.
Checks: the block Linears output bf16 while training, the trainable parameters are float32 masters
and a LoRA's frozen base is bf16; the first losses are within bf16 rounding of the float32 run's
and not equal to them; the fixed-noise loss falls; steps 5..8 after a resume or a kill + relaunch
give the uninterrupted run's losses exactly; the bf16 exports load (a LoRA onto the bf16 base, a
full fine-tune's folder with `load_dit`), reproduce the trained module's prediction and render a
clip that differs from the base model's.
"""

from __future__ import annotations

from pathlib import Path

import helpers
import pytest
import ranks
import torch

from video_dit.families.wan import FAMILY as WAN

pytestmark = pytest.mark.multirank

# name: (ZeRO stage, LoRA?); q_z2's frozen base is quantized (qfloat8, after deepspeed.initialize)
CI = {"lora_z2": (2, True), "full_z3": (3, False)}
SLOW = {"lora_z0": (0, True), "lora_z3": (3, True), "full_z2": (2, False), "q_z2": (2, True)}


def _job(root: Path, name: str, zero: int, lora: bool, *, dtype: str = "bf16", resume: str = "none") -> Path:
    """8 steps, a checkpoint every 4; the fixed-noise loss on both training clips at steps 0 and 8."""
    items = [{"image_path": str(root / "data" / f"{k:04d}.mp4"),
              "prompt": (root / "data" / f"{k:04d}.txt").read_text().strip()} for k in range(2)]
    return helpers.write_job(
        root, name, zero=zero, lora=lora, steps=8, save_every=4, keep=2, lr=5e-2 if lora else 3e-3, timeout_s=30,
        model={"quantize": name.startswith("q_")},
        train={"dtype": dtype, "cpu_bf16": True,
               "validation_config": {"validate_every_n_steps": 8, "validation_sigmas": [0.9, 0.5], "seed": 5,
                                     "validation_items": items}},
        save={"dtype": "bf16" if dtype == "bf16" else "float32", "resume": resume})


def _jobs(root: Path, configs: dict) -> list[dict]:
    """Each configuration uninterrupted (its prediction saved), then resumed from its step-4 checkpoint."""
    jobs = [{"config": str(_job(root, c, zero, lora)), "predict": True} for c, (zero, lora) in configs.items()]
    return jobs + [{"config": str(_job(root, f"{c}_resumed", zero, lora)),
                    "resume": str(root / "out" / c / "checkpoints" / "step_000000004")}
                   for c, (zero, lora) in configs.items()]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return helpers.make_world(tmp_path_factory.mktemp("bf16"))


@pytest.fixture(scope="module")
def ci_runs(world):
    fp32 = {"config": str(_job(world, "lora_z2_fp32", 2, True, dtype="fp32")), "stop_at": 2}
    ranks.run_jobs(world, _jobs(world, CI) + [fp32])
    return world


@pytest.fixture(scope="module")
def slow_runs(ci_runs):
    world = ci_runs
    killed = _job(world, "full_z3_killed", 3, False, resume="auto")
    codes, logs, _ = ranks.run_jobs(world, _jobs(world, SLOW) + [{"config": str(killed),
                                                                  "fault": "kill_rank1_at_step:6"}], check=False)
    assert codes != [0, 0] and "SIGKILL rank 1 in the middle of step 6" in logs, logs[-4000:]
    _, relaunch, _ = ranks.run_jobs(world, [{"config": str(killed), "resume": "auto"}])
    assert "resumed from" in relaunch and "step_000000004 at step 4" in relaunch, relaunch[-4000:]
    return world


# ---------------------------------------------------------------- checks, shared by CI and slow

def _computes_in_bf16_and_the_loss_falls(root: Path, configs: dict, world: int = 2) -> None:
    for c, (zero, lora) in configs.items():
        for r in range(world):
            res = ranks.result(root / "out" / c, r)
            assert res["dtype"] == "torch.bfloat16", (c, res)
            # the matmuls ran in bf16: every Linear of block 0 (base layers and adapters; a quantized
            # base's QLinears aside) output bf16
            assert res["linear_output_dtypes"] == ["torch.bfloat16"], (c, res)
            assert res["quantized"] == ("QLinear" if c.startswith("q_") else "Linear" if lora else None), (c, res)
            # float32 masters for what trains; a LoRA's frozen base in bf16 (its float32 islands aside)
            assert ("torch.bfloat16" in res["param_dtypes"]) == lora and "torch.float32" in res["param_dtypes"], (c, res)
        assert sorted(helpers.losses(root / "out" / c)) == list(range(1, 9)), c
        rows = {r["step"]: r for r in helpers.metrics(root / "out" / c)}
        before, after = rows[0]["val_loss"], rows[8]["val_loss"]  # the same clips, sigmas and noise
        assert after < 0.95 * before, (c, before, after)


def _resumes_exactly(root: Path, configs: dict, other: str = "resumed") -> None:
    for c in configs:
        want, got = helpers.losses(root / "out" / c), helpers.losses(root / "out" / f"{c}_{other}")
        # exactly: the checkpoint holds the float32 masters, Adam moments, LR, data position and RNG
        assert all(got[s] == want[s] for s in range(5, 9)), (c, got, want)


def _exports_load_and_render(root: Path, configs: dict) -> None:
    from safetensors.torch import load_file

    from video_dit.families.wan.loading import load_dit, load_text_encoder, load_vae
    from video_dit.families.wan.pipeline import VideoPipeline
    from video_dit.lora import load_lora
    from video_dit.media import load_image
    from video_dit.train.precision import quantize_frozen

    x, t, ctx = helpers.probe_inputs()
    vae = load_vae("preset:tiny").eval()
    caption = (root / "data_holdout/000.txt").read_text().strip()
    embeds = load_text_encoder("preset:tiny").encode([caption])[0]
    first = load_image(root / "data_holdout/000.png")

    def bf16_base():
        return load_dit(str(root / "base.safetensors"), dtype=torch.bfloat16).eval()

    def predict_and_render(dit):
        with torch.no_grad():
            pred = dit(x.to(torch.bfloat16), t, [e.to(torch.bfloat16) for e in ctx]).float()
            frames = VideoPipeline(dit, vae).generate(embeds, first_frame=first, num_frames=5, height=32, width=32,
                                                      steps=2, guidance_scale=1.0,
                                                      generator=torch.Generator().manual_seed(0))
        return pred, torch.stack([torch.tensor(list(f.getdata()), dtype=torch.float32) for f in frames])

    base_pred, base_clip = predict_and_render(bf16_base())
    for c, (zero, lora) in configs.items():
        out = root / "out" / c
        if lora:
            state = load_file(str(out / f"{c}.safetensors"))
            assert {v.dtype for k, v in state.items() if ".lora_" in k} == {torch.bfloat16}, c  # save.dtype
            model = load_lora(out / f"{c}.safetensors", bf16_base())
            if c.startswith("q_"):  # onto a base quantized as the trainer quantized it
                quantize_frozen(model, "qfloat8", WAN.arch)
        else:
            model = load_dit(str(out / c), dtype=torch.bfloat16)
        pred, clip = predict_and_render(model.eval())
        trained = load_file(str(out / "pred.safetensors"))["pred"]
        # the export rounds float32 masters to bf16 once: far closer to the trained module than the
        # training moved it from the base
        moved = (trained - base_pred).abs().max().item()
        err = (pred - trained).abs().max().item()
        assert err < 0.1 * moved, (c, err, moved)
        assert clip.shape == base_clip.shape == (5, 32 * 32, 3), c
        assert (clip - base_clip).abs().max() > 0, c  # the trained weights render another clip


# ---------------------------------------------------------------- CI

def test_bf16_computes_in_bf16_tracks_fp32_and_the_loss_falls(ci_runs):
    _computes_in_bf16_and_the_loss_falls(ci_runs, CI)
    fp32 = ranks.result(ci_runs / "out/lora_z2_fp32")
    assert fp32["linear_output_dtypes"] == ["torch.float32"]
    bf16, ref = helpers.losses(ci_runs / "out/lora_z2"), helpers.losses(ci_runs / "out/lora_z2_fp32")
    assert sorted(ref) == [1, 2]
    # the same data and noise: bf16 rounding apart (measured 5.7e-5 relative), not the same arithmetic
    for s in (1, 2):
        assert bf16[s] != ref[s] and bf16[s] == pytest.approx(ref[s], rel=1e-3), (s, bf16[s], ref[s])


def test_bf16_resume_gives_the_same_losses_exactly(ci_runs):
    _resumes_exactly(ci_runs, CI)


def test_bf16_exports_load_reproduce_the_prediction_and_render(ci_runs):
    _exports_load_and_render(ci_runs, CI)


# ---------------------------------------------------------------- slow: the other two configurations, kill + relaunch

@pytest.mark.slow
def test_bf16_zero0_zero3_lora_zero2_full_and_a_quantized_base(slow_runs):
    _computes_in_bf16_and_the_loss_falls(slow_runs, SLOW)
    _resumes_exactly(slow_runs, SLOW)
    _exports_load_and_render(slow_runs, SLOW)


@pytest.mark.slow
def test_bf16_kill_and_relaunch_gives_the_same_losses_exactly(slow_runs):
    _resumes_exactly(slow_runs, {"full_z3": CI["full_z3"]}, other="killed")
    rows = helpers.metrics(slow_runs / "out/full_z3_killed")
    trained = [r["step"] for r in rows if r.get("loss") is not None]
    assert trained == [1, 2, 3, 4, 5, 5, 6, 7, 8], trained  # step 5 before the kill and again after the relaunch
