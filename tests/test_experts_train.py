"""Both experts of a two-expert model (tiny-a14b, Wan 2.2 A14B's shape in miniature) trained in one
DeepSpeed run on 2 CPU ranks, one engine per expert. One launch, five jobs:
  A   ZeRO-2, LoRA on both experts, alternating every step, a checkpoint and export every step, a
      preview at the end (both experts sample it), validation at sigmas 1 and 0.5, an EMA (decay 0.5);
  Z   ZeRO-3, otherwise A (both experts' bases and LoRAs partitioned, previews gathered block by block);
  C   ZeRO-3, resuming Z's step-2 checkpoint (both experts' engines) from another output folder;
  O   ZeRO-2, the high-noise expert alone; its preview with the frozen low-noise expert (on the CPU,
      moved in for its steps);
  H3  O under ZeRO-3, as configs/wan22_i2v_a14b_high_noise_lora.yaml ships it (the frozen low-noise expert
      partitioned behind an optimizer-less engine for the preview).
Checked: every step's expert is the rule's on every rank and its timesteps lie on its side of the
boundary; a step changes only its expert's LoRA (the exports before and after it); Z's exports equal
A's; C's losses equal Z's; the two LoRA files load into the base experts and render A's preview again,
byte for byte (and O's, with the low-noise base); O and H3 export the high-noise expert only and H3
trains what O does (its LoRA, losses and validation; its preview nearly O's); A's and O's
step-0 validation loss at sigma 1 is the high-noise base expert's and at 0.5 the low-noise one's (O's
frozen), computed in the test. A second (1-rank) launch (slow-marked) resumes A's 2-rank checkpoint (both experts' parameters, Adam moments and LR positions
equal what A saved) and runs a ZeRO-3 low-noise-only job whose frozen high-noise expert is partitioned
behind an optimizer-less engine."""

from __future__ import annotations

from pathlib import Path

import helpers
import pytest
import ranks
import torch
from safetensors.torch import load_file

from video_dit.diffusion.experts import HIGH, LOW

pytestmark = pytest.mark.multirank
BOUNDARY = 875.0  # tiny-a14b: T2V-A14B's 0.875


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = helpers.make_world(tmp_path_factory.mktemp("experts_train"))
    for sub, seed in (("high_noise_model", 0), ("low_noise_model", 1)):  # Wan's two-expert layout
        (root / "a14b" / sub).mkdir(parents=True)
        helpers.write_base(root / "a14b" / sub / "diffusion_pytorch_model.safetensors", seed=seed)
    return root


def _job(root: Path, name: str, zero: int, preview: bool = True, steps: int = 4, **kw) -> Path:
    """A job of this file: the two-expert folder, LoRA, `steps` steps, a preview at the last one."""
    samples = [helpers.holdout_sample(root / "data")] if preview else None
    model = {"preset": "tiny-a14b", **kw.pop("model", {})}
    train = {"skip_first_sample": True, **kw.pop("train", {})}
    return helpers.write_job(root, name, base="a14b", zero=zero, steps=steps, keep=4, lr=3e-2, samples=samples,
                             sample_every=steps, model=model, train=train, **kw)


EMA_DECAY = 0.5
SIGMAS = [1.0, 0.5]  # t = 1000 (the high-noise expert's) and 500 (the low-noise one's)


def _validation(root: Path) -> dict:
    """Validation on the held-out clip at SIGMAS, its noise from seed 5, at step 0 and the last step."""
    holdout = root / "data_holdout"
    return {"validate_every_n_steps": 100, "validation_sigmas": SIGMAS, "seed": 5,
            "validation_items": [{"image_path": str(holdout / "000.mp4"),
                                  "prompt": (holdout / "000.txt").read_text().strip()}]}


@pytest.fixture(scope="module")
def runs(world):
    a = _job(world, "a", zero=2, save_every=1, train={"validation_config": _validation(world),
                                                      "ema_config": {"use_ema": True, "ema_decay": EMA_DECAY}})
    z = _job(world, "z", zero=3, save_every=2)
    c = _job(world, "c", zero=3, save_every=2, preview=False)
    o = _job(world, "o", zero=2, save_every=2, model={"model_kwargs": {"train_low_noise": False}}, steps=2,
             train={"validation_config": _validation(world)})
    h3 = _job(world, "h3", zero=3, save_every=2, model={"model_kwargs": {"train_low_noise": False}}, steps=2,
              train={"validation_config": _validation(world)})
    ranks.run_jobs(world, [{"config": str(a), "resume": "none", "dump": True},
                           {"config": str(z), "resume": "none"},
                           {"config": str(c), "resume": str(world / "out/z/checkpoints/step_000000002")},
                           {"config": str(o), "resume": "none"},
                           {"config": str(h3), "resume": "none"}])
    return world / "out"


def _train_rows(out: Path) -> list[dict]:
    """metrics.jsonl's training rows (a validated job also has a step-0 row of validation figures)."""
    return [r for r in helpers.metrics(out) if r["step"] > 0]


def test_each_step_trains_the_rules_expert_on_its_side_on_every_rank(runs):
    for name in ("a", "z"):
        rows = _train_rows(runs / name)
        assert [r["step"] for r in rows] == [1, 2, 3, 4]
        assert [r["expert"] for r in rows] == [HIGH, LOW, HIGH, LOW]  # switch_boundary_every 1, high first
        for r in rows:
            assert len(r["timesteps"]) == 2  # both ranks, each its own draw from the expert's side
            for ts in r["timesteps"]:
                assert all(t >= BOUNDARY for t in ts) if r["expert"] == HIGH else all(t < BOUNDARY for t in ts)
            assert r["timesteps"][0] != r["timesteps"][1]
    rows = _train_rows(runs / "o")
    assert [r["expert"] for r in rows] == [HIGH, HIGH] and all(t >= BOUNDARY for r in rows
                                                                 for ts in r["timesteps"] for t in ts)


def test_a_step_changes_only_its_experts_lora(runs):
    out = runs / "a"
    exports = {(s, e): load_file(str(out / f"a_{s:09d}_{e}.safetensors")) for s in range(1, 5) for e in (HIGH, LOW)}
    for s in range(2, 5):
        trained = HIGH if s % 2 == 1 else LOW
        other = LOW if trained == HIGH else HIGH
        assert helpers.max_abs_diff(exports[(s, trained)], exports[(s - 1, trained)]) > 1e-4, s
        assert helpers.max_abs_diff(exports[(s, other)], exports[(s - 1, other)]) == 0.0, s
    # step 1 trained the high-noise expert: the low-noise LoRA is still the init (B = 0)
    assert all(v.abs().max() == 0 for k, v in exports[(1, LOW)].items() if "lora_B" in k)
    assert (out / "a_high_noise.safetensors").read_bytes() == (out / "a_000000004_high_noise.safetensors").read_bytes()


def test_zero3_equals_zero2_and_resume_continues(runs):
    for e in (HIGH, LOW):
        helpers.assert_trained_close(load_file(str(runs / f"z/z_{e}.safetensors")),
                                     load_file(str(runs / f"a/a_{e}.safetensors")))
    lz, lc = helpers.losses(runs / "z"), helpers.losses(runs / "c")
    assert sorted(lc) == [3, 4]
    for s in (3, 4):
        assert lc[s] == pytest.approx(lz[s], rel=1e-5, abs=1e-7), (s, lz[s], lc[s])
    assert helpers.metrics(runs / "c")[0]["expert"] == HIGH  # step 3 is the high-noise expert's again


def _render(world, loras: dict, path: Path) -> Path:
    """A's preview settings (tiny-a14b's Euler at the job's 2 steps, guidance 1, seed 42) rendered by the
    pipeline from the base experts with `loras` ({expert: file}) loaded."""
    from video_dit.diffusion.experts import TwoExperts
    from video_dit.families.wan.loading import load_dit, load_text_encoder, load_vae
    from video_dit.families.wan.pipeline import VideoPipeline
    from video_dit.lora import load_lora
    from video_dit.media import load_image, write_video

    experts = {}
    for e, sub in ((HIGH, "high_noise_model"), (LOW, "low_noise_model")):
        experts[e] = load_dit(str(world / "a14b" / sub))
        if e in loras:
            load_lora(loras[e], experts[e])
    sample = helpers.holdout_sample(world / "data")
    embeds = load_text_encoder("preset:tiny-a14b").encode([sample["prompt"]])[0]
    with torch.no_grad():
        pipe = VideoPipeline(TwoExperts(experts[HIGH].eval(), experts[LOW].eval(), 0.875), load_vae("preset:tiny").eval())
        frames = pipe.generate(embeds, num_frames=5, height=32, width=32, steps=2, guidance_scale=1.0, shift=3.0,
                               solver="euler", generator=torch.Generator().manual_seed(42),
                               first_frame=load_image(sample["ctrl_img"]))
    write_video(frames, path, fps=8)
    return path


def test_lora_files_load_and_render_the_preview(runs, world):
    """The exported pair, loaded into the base experts, samples A's step-4 preview again (the same MP4
    bytes: equal frames); the ZeRO-3 run's preview (weights equal to ~1e-6) decodes to nearly the same;
    O's preview is its high-noise LoRA with the untouched low-noise base."""
    from video_dit.lora import read_lora
    from video_dit.media import read_video

    out = runs / "a"
    for e in (HIGH, LOW):
        _, _, _, meta = read_lora(out / f"a_{e}.safetensors")
        assert meta["expert"] == e and float(meta["boundary_ratio"]) == 0.875 and meta["base_preset"] == "tiny-a14b"
    again = _render(world, {e: out / f"a_{e}.safetensors" for e in (HIGH, LOW)}, world / "again.mp4")
    preview = out / "samples/000000004_0.mp4"
    assert again.read_bytes() == preview.read_bytes()
    z = read_video(runs / "z/samples/000000004_0.mp4")
    assert (z - read_video(preview)).abs().mean() < 0.02
    o = _render(world, {HIGH: runs / "o/o_high_noise.safetensors"}, world / "o_again.mp4")
    assert o.read_bytes() == (runs / "o/samples/000000002_0.mp4").read_bytes()


def test_one_expert_job_trains_and_exports_only_it(runs):
    for name in ("o", "h3"):
        out = runs / name
        assert sorted(p.name for p in out.glob(f"{name}_*.safetensors")) == [f"{name}_000000002_high_noise.safetensors",
                                                                            f"{name}_high_noise.safetensors"]
        assert sorted(p.name for p in (out / "checkpoints/step_000000002").iterdir() if p.is_dir()) == [HIGH]


def test_one_expert_under_zero3_trains_what_zero2_does(runs):
    """H3, the shipped high-noise-only LoRA job under ZeRO-3 (configs/wan22_i2v_a14b_high_noise_lora.yaml),
    against O (ZeRO-2): the same steps on the high-noise side, losses and step-0 validation (float32
    summation order), the same LoRA (helpers.TRAINED_RTOL), and a preview sampled with both experts (the
    frozen low-noise one partitioned) that decodes to nearly O's. (Measured: the losses and validation equal
    exactly, 2 ranks summing 2 terms in either order; tolerance 1e-6 relative. The LoRA: 1.4e-5.)"""
    from video_dit.media import read_video

    rows = {n: _train_rows(runs / n) for n in ("o", "h3")}
    assert [r["expert"] for r in rows["h3"]] == [HIGH, HIGH]
    for a, b in zip(rows["h3"], rows["o"]):
        assert a["timesteps"] == b["timesteps"] and a["loss"] == pytest.approx(b["loss"], rel=1e-6), (a, b)
    val = {n: next(r for r in helpers.metrics(runs / n) if r["step"] == 0) for n in ("o", "h3")}
    for s in SIGMAS:
        assert val["h3"][f"val_loss@{s:g}"] == pytest.approx(val["o"][f"val_loss@{s:g}"], rel=1e-6)
    helpers.assert_trained_close(load_file(str(runs / "h3/h3_high_noise.safetensors")),
                                 load_file(str(runs / "o/o_high_noise.safetensors")))
    h3, o = (read_video(runs / f"{n}/samples/000000002_0.mp4") for n in ("h3", "o"))
    assert h3.shape == o.shape and (h3 - o).abs().mean() < 0.02


@pytest.mark.slow  # a second launch (~10-20 s before any step): outside the CI budget; ./launch/test.sh -m slow
def test_one_rank_resume_restores_both_experts_and_a_zero3_one_expert_job(runs, world):
    w1 = _job(world, "w1", zero=2, save_every=2, preview=False)
    o3 = _job(world, "o3", zero=3, save_every=2, model={"model_kwargs": {"train_high_noise": False}}, steps=2)
    _, log, _ = ranks.run_jobs(world, [{"config": str(w1), "resume": str(runs / "a/checkpoints/step_000000002"),
                                        "dump": True, "stop_at": 2}, {"config": str(o3), "resume": "none"}], world=1)
    assert "converting it to DeepSpeed's universal format" in log
    assert [r["expert"] for r in helpers.metrics(runs / "o3")] == [LOW, LOW]
    assert _render(world, {LOW: runs / "o3/o3_low_noise.safetensors"}, world / "o3_again.mp4").read_bytes() == \
        (runs / "o3/samples/000000002_0.mp4").read_bytes()
    saved, loaded = load_file(str(runs / "a/state_saved_2.safetensors")), load_file(str(runs / "w1/state_start_2.safetensors"))
    assert set(saved) == set(loaded)
    assert {k.split("/")[0] for k in saved} == {HIGH, LOW, "step"} and any("exp_avg_sq" in k for k in saved)
    for k in saved:
        assert torch.equal(saved[k], loaded[k]), k


def _expected_val_loss(world: Path, sub: str, sigma: float) -> float:
    """The step-0 validation loss at `sigma` computed here from the base expert in `sub`: the held-out
    clip's latents, its noise from seed 5, replace-mode i2v (clean frame 0 at t = 0, masked out)."""
    from video_dit.diffusion.conditioning import FirstFrameConditioning, encode_conditioning, masked_mse
    from video_dit.diffusion.flow import add_noise
    from video_dit.families.wan.loading import load_dit, load_text_encoder, load_vae
    from video_dit.media import read_video

    dit, vae = load_dit(str(world / "a14b" / sub)).eval(), load_vae("preset:tiny").eval()
    holdout = world / "data_holdout"
    with torch.no_grad():
        clip = read_video(holdout / "000.mp4").permute(1, 0, 2, 3)[None]  # (1, 3, 9, 32, 32)
        x0 = vae.normalize(vae.encode(clip).mode())
        first = encode_conditioning(vae, clip, "replace", 9)
        text = load_text_encoder("preset:tiny-a14b").encode([(holdout / "000.txt").read_text().strip()])
        noise = torch.randn((1, *x0.shape[1:]), generator=torch.Generator().manual_seed(5))
        t = torch.tensor([1000.0 * sigma])
        model_in, timestep, mask = FirstFrameConditioning("replace").apply(add_noise(x0, noise, t), t, first)
        return float(masked_mse(dit(model_in, timestep, [text[0]]), noise - x0, mask))


def test_validation_runs_each_sigma_on_its_expert(runs, world):
    """Both experts trained (A), or the high-noise one with the low-noise one frozen (O): the step-0
    validation loss at sigma 1 is the high-noise base expert's, at 0.5 the low-noise one's (each
    computed here), and the other expert would give another figure."""
    expected = {(s, sub): _expected_val_loss(world, sub, s) for s in SIGMAS
                for sub in ("high_noise_model", "low_noise_model")}
    for name in ("a", "o"):
        row = next(r for r in helpers.metrics(runs / name) if r["step"] == 0)
        for s, sub in ((1.0, "high_noise_model"), (0.5, "low_noise_model")):
            other = "low_noise_model" if sub == "high_noise_model" else "high_noise_model"
            assert row[f"val_loss@{s:g}"] == pytest.approx(expected[(s, sub)], rel=1e-4), (name, s)
            assert abs(expected[(s, other)] - expected[(s, sub)]) > 1e-3 * expected[(s, sub)]


def test_ema_averages_both_experts_every_step(runs):
    """A's EMA (decay 0.5) over both experts, updated after every optimizer step: each expert's EMA
    export at step k is decay x its step k-1 EMA + (1 - decay) x its raw export at k, also on the
    steps that trained the other expert (its weights then held still)."""
    out = runs / "a"
    for e in (HIGH, LOW):
        ema = {s: load_file(str(out / f"a_ema_{s:09d}_{e}.safetensors")) for s in range(1, 5)}
        raw = {s: load_file(str(out / f"a_{s:09d}_{e}.safetensors")) for s in range(1, 5)}
        for s in range(2, 5):
            expected = {k: EMA_DECAY * ema[s - 1][k] + (1 - EMA_DECAY) * raw[s][k] for k in raw[s]}
            assert helpers.max_abs_diff(ema[s], expected) < 1e-6, (e, s)
    assert (out / "a_ema_high_noise.safetensors").is_file() and (out / "a_ema_low_noise.safetensors").is_file()
