"""Wan 2.1 I2V / FLF2V training (channel concat + the CLIP image branch) on 2 CPU ranks over gloo, one
launch (the launch costs more than the steps), on the tiny CLIP presets:

  a   ZeRO-2 LoRA on tiny-clip-i2v, 16 steps, a preview at the end: the loss falls; the cache holds
      each clip's CLIP features (equal to the image encoder's features of its first frame); CLIP ran
      only while caching and once per preview image, never in a step; the LoRA holds k_img / v_img
      and renders through `video-dit sample`.
  b   a relaunch of a from its step-8 checkpoint: steps 9..16 give a's losses exactly; the cached
      epoch makes no VAE and no CLIP call.
  z3  ZeRO-3 full fine-tune: the sharded export loads with `load_dit` and reproduces the trained
      module's prediction (with CLIP features).
  f   ZeRO-2 LoRA on tiny-clip-flf2v (first + last frame): trains and renders a preview from
      ctrl_img + ctrl_img_2.
"""

from __future__ import annotations

from pathlib import Path

import helpers
import pytest
import ranks
import torch

pytestmark = pytest.mark.multirank


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("clip")
    from PIL import Image

    from video_dit.data.demo import make_demo_data

    make_demo_data(root / "data", count=2, frames=9, size=32, seed=0, holdout=1)
    Image.new("RGB", (32, 32), (20, 200, 60)).save(root / "last.png")
    helpers.write_base(root / "i2v.safetensors", preset="tiny-clip-i2v")
    helpers.write_base(root / "flf2v.safetensors", preset="tiny-clip-flf2v")
    return root


def _job(root: Path, name: str, preset: str, base: str, *, flf2v: bool = False, sample_every: int | None = None,
         **kw) -> Path:
    samples = None
    if sample_every is not None:
        samples = [helpers.holdout_sample(root / "data")]
        if flf2v:
            samples[0]["ctrl_img_2"] = str(root / "last.png")
    process = helpers.train_process(root, base=base, samples=samples, sample_every=sample_every or 1000,
                                    model={"preset": preset}, **kw)
    process["datasets"][0]["do_flf2v"] = flf2v
    return helpers.write_job(root, name, process)


@pytest.mark.slow(reason="15 s of the CI budget: the CLIP branch's encoder, conditioning and the arch's steps on "
                         "tiny-clip-i2v / flf2v stay in CI (test_image_encoder, test_conditioning, test_aitk_adapter)")
def test_clip_i2v_trains_caches_resumes_and_exports(world):
    jobs = [
        {"config": str(_job(world, "a", "tiny-clip-i2v", "i2v.safetensors", steps=16, save_every=8,
                            sample_every=16, lr=3e-2, train={"skip_first_sample": True})), "resume": "none"},
        {"config": str(_job(world, "b", "tiny-clip-i2v", "i2v.safetensors", steps=16, save_every=8, lr=3e-2)),
         "resume": str(world / "out/a/checkpoints/step_000000008")},
        {"config": str(_job(world, "z3", "tiny-clip-i2v", "i2v.safetensors", zero=3, lora=False, steps=2,
                            save_every=2)), "resume": "none", "predict": True},
        {"config": str(_job(world, "f", "tiny-clip-flf2v", "flf2v.safetensors", flf2v=True, steps=2,
                            save_every=2, sample_every=2, train={"skip_first_sample": True})), "resume": "none"},
    ]
    ranks.run_jobs(world, jobs)

    # a: the loss falls
    la = helpers.losses(world / "out/a")
    assert sorted(la) == list(range(1, 17))
    first, last = sum(la[s] for s in range(1, 5)) / 4, sum(la[s] for s in range(13, 17)) / 4
    assert last < 0.9 * first, f"loss did not fall: first 4 mean {first:.4f}, last 4 mean {last:.4f}"

    # a: CLIP features cached next to each clip's latents, equal to the encoder's features of frame 0
    from safetensors.torch import load_file

    from video_dit.families.wan.loading import load_image_encoder
    from video_dit.media import read_video

    clip = load_image_encoder("preset:tiny-clip-i2v")
    entries = sorted((world / "data/_latent_cache").glob("*.safetensors"))
    i2v_entries = [load_file(str(e)) for e in entries if "clip_features" in load_file(str(e))]
    assert len(i2v_entries) == 4  # 2 clips x (I2V job, FLF2V job: another space key)
    by_tokens = {}
    for entry in i2v_entries:
        by_tokens.setdefault(entry["clip_features"].shape[0], []).append(entry)
        assert set(entry) == {"latents", "cond_latents", "clip_features"}
    assert sorted(len(v) for v in by_tokens.values()) == [2, 2] and sorted(by_tokens) == [17, 34]
    videos = [read_video(p) for p in sorted((world / "data").glob("*.mp4"))]  # (F, 3, H, W) in [-1, 1]
    firsts = torch.cat([clip.encode(v[:1]) for v in videos])  # (2, 17, 32)
    for entry in by_tokens[17]:
        err = (firsts - entry["clip_features"][None]).abs().amax(dim=(1, 2)).min().item()
        assert err < 1e-4, err  # the cached features are frame 0's (of one of the two clips)
    for entry in by_tokens[34]:  # FLF2V: [first | last]
        lasts = torch.cat([clip.encode(v[-1:]) for v in videos])
        pair = torch.cat([firsts, lasts], dim=1)
        assert (pair - entry["clip_features"][None]).abs().amax(dim=(1, 2)).min().item() < 1e-4

    # CLIP ran while caching (one clip per rank) and once for the preview image, never in a step
    for rank in (0, 1):
        ra = ranks.result(world / "out/a", rank)
        assert ra["image_encode_calls_at_start"] == 2 and ra["image_encode_calls"] == 2, ra

    # b: resumed at step 8, the same losses; the cached epoch did no VAE and no CLIP work
    lb = helpers.losses(world / "out/b")
    assert sorted(lb) == list(range(9, 17))
    for s in range(9, 17):  # exactly: the checkpoint holds everything the next steps depend on
        assert lb[s] == la[s], (s, la[s], lb[s])
    for rank in (0, 1):
        rb = ranks.result(world / "out/b", rank)
        assert rb["vae_encode_calls"] == 0 and rb["image_encode_calls"] == 0, rb

    # a: the LoRA file adapts the image branch too, and renders through `video-dit sample`
    keys = set(load_file(str(world / "out/a/a.safetensors")))
    assert {"diffusion_model.blocks.0.cross_attn.k_img.lora_A.weight",
            "diffusion_model.blocks.3.cross_attn.v_img.lora_B.weight"} <= keys
    from video_dit.cli import main as cli

    out = world / "a_sample.mp4"
    assert cli(["sample", "--model", str(world / "i2v.safetensors"), "--vae", "preset:tiny", "--text-encoder",
                "preset:tiny-clip-i2v", "--image-encoder", "preset:tiny-clip-i2v", "--preset", "tiny-clip-i2v",
                "--lora", str(world / "out/a/a.safetensors"), "--prompt", "a square", "--image",
                str(world / "data_holdout/000.png"), "--frames", "5", "--height", "32", "--width", "32",
                "--steps", "2", "--cfg", "1", "--out", str(out)]) == 0
    assert read_video(out).shape == (5, 3, 32, 32)
    assert read_video(world / "out/a/samples/000000016_0.mp4").shape == (5, 3, 32, 32)

    # z3: the ZeRO-3 full fine-tune's export reproduces the trained module's prediction
    from helpers import probe_inputs, probe_kwargs

    from video_dit.families.wan.loading import load_dit

    model = load_dit(str(world / "out/z3/z3")).eval()
    assert model.config.image_dim == 32
    x, t, ctx = probe_inputs(model.config.in_dim, model.config.text_dim)
    with torch.no_grad():
        pred = model(x, t, ctx, **probe_kwargs(model.config))
    torch.testing.assert_close(pred, load_file(str(world / "out/z3/pred.safetensors"))["pred"], rtol=1e-5, atol=1e-6)

    # f: first-last-frame trains and previews from ctrl_img + ctrl_img_2
    assert sorted(helpers.losses(world / "out/f")) == [1, 2]
    assert read_video(world / "out/f/samples/000000002_0.mp4").shape == (5, 3, 32, 32)
    assert "diffusion_model.blocks.0.cross_attn.k_img.lora_A.weight" in load_file(str(world / "out/f/f.safetensors"))
