"""The DeepSpeed trainer on 2 CPU ranks over gloo (tiny preset, 2-clip dataset).

Three launches, each checking several things (the launch costs more than the steps):
  A. ZeRO-2 LoRA, 30 steps, checkpoints every 10, previews at 0 and 30: the loss falls, metrics.jsonl
     has its keys, previews are decodable MP4s (+ PNG sheets) rendered from the control image.
  B. a relaunch resuming A's step-20 checkpoint: steps 21..30 give A's losses (fp32, tight tolerance).
  C. one process group, five jobs: ZeRO-0 LoRA and ZeRO-3 LoRA (same seed and steps: equal LoRA
     exports, the file loaded into a fresh model reproduces the trained model's prediction; ZeRO-3
     previews), ZeRO-3 full and ZeRO-2 full (the sharded export loads with `load_dit` and reproduces
     predictions), and a quantized-base LoRA job with non-finite losses injected on one rank
     (skipped on both ranks; N in a row stop the job with the last good checkpoint kept).
The ranks run tests/ranks.py's job worker.
"""

from __future__ import annotations

from pathlib import Path

import helpers
import pytest
import ranks
import torch
from helpers import probe_inputs

pytestmark = pytest.mark.multirank


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The shared 2-clip dataset (9 frames, 32x32, one held-out first frame) and the base weights."""
    return helpers.make_world(tmp_path_factory.mktemp("train"))


def job_yaml(root: Path, name: str, *, sample_every: int | None = None, **kw) -> Path:
    """A job of this file (helpers.train_process); `sample_every` turns on one i2v preview."""
    samples = None if sample_every is None else [helpers.holdout_sample(root / "data")]
    return helpers.write_job(root, name, samples=samples, sample_every=sample_every or 1000, **kw)


def launch(root: Path, jobs: list[dict], timeout: int = 900) -> None:
    """Run `jobs` ({config, resume, predict, nan}) in order on 2 gloo ranks; raise with the log on failure."""
    ranks.run_jobs(root, jobs, timeout=timeout)


def losses(root: Path, name: str) -> dict[int, float]:
    return helpers.losses(root / "out" / name)


# ---------------------------------------------------------------- tests

def test_zero2_lora_trains_previews_and_resumes_exactly(world):
    a = job_yaml(world, "a", zero=2, steps=30, save_every=10, sample_every=30, keep=2, lr=3e-2)
    launch(world, [{"config": str(a), "resume": "none"}])
    la = losses(world, "a")
    assert sorted(la) == list(range(1, 31))
    first, last = sum(la[s] for s in range(1, 6)) / 5, sum(la[s] for s in range(26, 31)) / 5
    assert last < 0.8 * first, f"loss did not fall: first 5 mean {first:.4f}, last 5 mean {last:.4f}"

    from video_dit.train.metrics import read_metrics

    row = read_metrics(world / "out/a/metrics.jsonl")[-1]
    for key in ("step", "loss", "lr", "grad_norm", "samples_per_s", "tokens_per_s", "tflops", "mfu", "peak_mem_gb"):
        assert row[key] is not None, key
    assert row["grad_norm"] > 0 and 0 < row["mfu"] < 1 and row["peak_mem_gb"] > 0
    assert row["samples_per_s"] > 0 and row["tokens_per_s"] == pytest.approx(row["samples_per_s"] * 3 * 2 * 2)  # 9 frames, 32 px: 3x2x2 tokens

    out = world / "out/a"
    # keep the last K = 2 checkpoints and step exports
    assert sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.startswith("step_")) == \
        ["step_000000020", "step_000000030"]
    assert sorted(p.name for p in out.glob("a_*.safetensors")) == ["a_000000020.safetensors", "a_000000030.safetensors"]
    assert (out / "a.safetensors").read_bytes() == (out / "a_000000030.safetensors").read_bytes()

    # previews: decodable MP4s at steps 0 and 30, i2v from the control image, contact sheets beside them
    from video_dit.media import load_image, pil_to_tensor, probe_video, read_video

    for step in (0, 30):
        mp4 = out / "samples" / f"{step:09d}_0.mp4"
        info = probe_video(mp4)
        assert (info.num_frames, info.width, info.height) == (5, 32, 32)
        assert mp4.with_suffix(".png").is_file()
    # i2v: frame 0 of the preview is the VAE round trip of the control image (the causal decoder's
    # frame 0 depends only on the clean first-frame latent the conditioning restores)
    from video_dit.models.loading import load_vae

    vae = load_vae("preset:tiny")
    ctrl = pil_to_tensor(load_image(world / "data/holdout/000.png"))  # (3, H, W)
    with torch.no_grad():
        expected = vae.decode(vae.encode(ctrl[None, :, None]).mode())[0, :, 0].clamp(-1, 1)
    frames = read_video(out / "samples/000000030_0.mp4")  # (F, 3, H, W)
    err = (frames[0] - expected).abs().mean().item()
    assert err < 0.06, f"preview frame 0 differs from the control image's VAE round trip by {err:.3f}"
    assert (frames[-1] - expected).abs().mean().item() > err  # later frames are generated, not copies

    # B: relaunch from the step-20 checkpoint into another output folder: the same losses for 21..30
    b = job_yaml(world, "b", zero=2, steps=30, save_every=10, keep=3, lr=3e-2)
    launch(world, [{"config": str(b), "resume": str(out / "checkpoints/step_000000020")}])
    lb = losses(world, "b")
    assert sorted(lb) == list(range(21, 31))
    for s in range(21, 31):
        assert lb[s] == pytest.approx(la[s], rel=1e-5, abs=1e-7), (s, la[s], lb[s])


def test_zero3_exports_equal_zero0_and_full_exports_load(world):
    jobs = [job_yaml(world, "z0", zero=0), job_yaml(world, "z3", zero=3, sample_every=3),
            job_yaml(world, "f3", zero=3, lora=False, steps=2, save_every=2),
            job_yaml(world, "f2", zero=2, lora=False, steps=2, save_every=2)]
    specs = [{"config": str(j), "resume": "none", "predict": True} for j in jobs]
    # quantized frozen base (after deepspeed.initialize) + non-finite losses injected on rank 1 only:
    # loss call 2 is skipped on both ranks and training goes on; calls 5 and 6 stop the job (2 in a row)
    q = job_yaml(world, "qn", zero=2, steps=4, save_every=2, model={"quantize": True},
                 train={"max_nonfinite_steps": 2})
    specs.append({"config": str(q), "resume": "none", "nan": {"rank": 1, "calls": [2], "from_call": 5}})
    launch(world, specs)

    from safetensors import safe_open
    from safetensors.torch import load_file

    from video_dit.lora import load_lora
    from video_dit.models.loading import load_dit

    z0, z3 = (load_file(str(world / f"out/{n}/{n}.safetensors")) for n in ("z0", "z3"))
    assert set(z0) == set(z3) and any(k.startswith("diffusion_model.blocks.0.self_attn.q.lora_B") for k in z0)
    assert max((z0[k] - z3[k]).abs().max().item() for k in z0) < 1e-6
    assert any(z0[k].abs().max() > 0 for k in z0 if "lora_B" in k)  # trained, not the zero init
    with safe_open(str(world / "out/z3/z3.safetensors"), "pt") as f:
        meta = f.metadata()
    assert meta["base_preset"] == "tiny" and meta["rank"] == "4" and meta["step"] == "3"
    # ZeRO-3 previews: every rank samples with parameters gathered block by block, rank 0 writes
    from video_dit.media import probe_video

    for step in (0, 3):
        assert probe_video(world / f"out/z3/samples/{step:09d}_0.mp4").num_frames == 5

    x, t, ctx = probe_inputs()
    for name in ("z0", "z3"):
        fresh = load_dit(str(world / "base.safetensors"))
        load_lora(world / f"out/{name}/{name}.safetensors", fresh)
        with torch.no_grad():
            pred = fresh.eval()(x, t, ctx)
        trained = load_file(str(world / f"out/{name}/pred.safetensors"))["pred"]
        torch.testing.assert_close(pred, trained, rtol=1e-5, atol=1e-6)
        base = load_dit(str(world / "base.safetensors")).eval()
        with torch.no_grad():
            assert (base(x, t, ctx) - trained).abs().max() > 1e-4  # the LoRA changed the prediction

    result = ranks.result(world / "out/qn")
    assert result["quantized"] == "QLinear"
    assert "2 non-finite losses in a row" in result["nonfinite"] and "step_000000002" in result["nonfinite"]
    assert sorted(losses(world, "qn")) == [1, 2, 3]  # the skipped batch took no step; stopped before step 4
    assert [p.name for p in (world / "out/qn/checkpoints").glob("step_*")] == ["step_000000002"]

    for name in ("f3", "f2"):
        folder = world / f"out/{name}/{name}"
        assert folder.is_symlink() and (folder / "config.json").is_file()
        model = load_dit(str(folder)).eval()
        with torch.no_grad():
            pred = model(x, t, ctx)
        torch.testing.assert_close(pred, load_file(str(world / f"out/{name}/pred.safetensors"))["pred"],
                                   rtol=1e-5, atol=1e-6)
    # ZeRO-3 and ZeRO-2 full fine-tunes of the same job agree too
    a, b = (load_dit(str(world / f"out/{n}/{n}")).state_dict() for n in ("f3", "f2"))
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5

