"""The DeepSpeed trainer on 2 CPU ranks over gloo (tiny preset, small datasets).

Two launches of tests/ranks.py's job worker, each running several jobs in one process group (the
launch costs more than the steps), and one test per claim:
  A+B  ZeRO-2 LoRA, 30 steps, checkpoints every 10, previews at 0 and 30: the loss falls, metrics.jsonl
       has its keys, previews are decodable MP4s (+ PNG sheets) rendered from the control image; then
       a job resuming A's step-20 checkpoint: steps 21..30 give A's losses exactly.
  C    ZeRO-0 / ZeRO-3 LoRA (equal exports that reload; ZeRO-0 asks bf16: CPU ranks train fp32 and
       say so once), ZeRO-3 / ZeRO-2 full fine-tunes (exports load; `video-dit sample --model EXPORT`
       alone reproduces its preview MP4),
       a quantized base (its LoRA exports and reloads; non-finite losses skipped, then stop the job),
       gradient accumulation against one bigger batch and CPU offload against none (ZeRO-2 each; ZeRO-3
       both in one job; on a world of identical clips, see `same_world`), both offloaded
       runs resumed, and channel-concat i2v (an in_dim-36 tiny preset) whose second, cached run makes no
       VAE call; and a job file as ai-toolkit's web UI writes it from the `tiny` entry (tests/aitk_ui_job.py).
"""

from __future__ import annotations

from pathlib import Path

import helpers
import pytest
import ranks
import torch
from helpers import probe_inputs

from video_dit.families.wan import FAMILY as WAN

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
    # B, in the same process group after A: resume A's step-20 checkpoint into another output folder
    b = job_yaml(world, "b", zero=2, steps=30, save_every=10, keep=3, lr=3e-2)
    launch(world, [{"config": str(a), "resume": "none"},
                   {"config": str(b), "resume": str(world / "out/a/checkpoints/step_000000020")}])
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
    from video_dit.families.wan.loading import load_vae

    vae = load_vae("preset:tiny")
    ctrl = pil_to_tensor(load_image(world / "data_holdout/000.png"))  # (3, H, W)
    with torch.no_grad():
        expected = vae.decode(vae.encode(ctrl[None, :, None]).mode())[0, :, 0].clamp(-1, 1)
    frames = read_video(out / "samples/000000030_0.mp4")  # (F, 3, H, W)
    err = (frames[0] - expected).abs().mean().item()
    assert err < 0.06, f"preview frame 0 differs from the control image's VAE round trip by {err:.3f}"
    assert (frames[-1] - expected).abs().mean().item() > err  # later frames are generated, not copies

    # B: the same losses for 21..30
    lb = losses(world, "b")
    assert sorted(lb) == list(range(21, 31))
    for s in range(21, 31):  # exactly: the checkpoint holds everything the next steps depend on
        assert lb[s] == la[s], (s, la[s], lb[s])


CONCAT = {"name": "tiny-concat", "base": "tiny", "i2v_mode": "concat", "in_dim": 36}  # Wan's 16 + 4 + 16


def same_world(root: Path, copies: int = 4) -> Path:
    """`copies` copies of ONE clip and caption: which items a rank draws then does not matter, so a
    batch of 2 and two micro-batches of 1 train on the same data whatever the sampler's order (which
    depends on the batch size); only the arithmetic and the (seed, rank, step, position) noise remain."""
    import shutil

    from video_dit.data.demo import make_demo_data

    one = root / "one"
    make_demo_data(one, count=1, frames=9, size=32, seed=0, holdout=0)
    (root / "same").mkdir()
    for i in range(copies):
        shutil.copy(one / "0000.mp4", root / "same" / f"{i:04d}.mp4")
        shutil.copy(one / "0000.txt", root / "same" / f"{i:04d}.txt")
    return root / "same"


@pytest.fixture(scope="module")
def launch_c(world):
    """Launch C: every job below, in this order, in one 2-rank process group."""
    # z0 asks for bf16: CPU ranks train it in float32 (its exports equal z3's, fp32), saying so once
    jobs = [job_yaml(world, "z0", zero=0, train={"dtype": "bf16"}), job_yaml(world, "z3", zero=3, sample_every=3),
            job_yaml(world, "f3", zero=3, lora=False, steps=2, save_every=2),
            job_yaml(world, "f2", zero=2, lora=False, steps=2, save_every=2, sample_every=2)]
    specs = [{"config": str(j), "resume": "none", "predict": True} for j in jobs]
    # quantized frozen base (after deepspeed.initialize) + non-finite losses injected on rank 1 only:
    # loss call 2 is skipped on both ranks and training goes on; calls 5 and 6 stop the job (2 in a row)
    q = job_yaml(world, "qn", zero=2, steps=4, save_every=2, model={"quantize": True},
                 train={"max_nonfinite_steps": 2})
    specs.append({"config": str(q), "resume": "none", "nan": {"rank": 1, "calls": [2], "from_call": 5}})
    q = job_yaml(world, "q", zero=2, steps=2, save_every=2, model={"quantize": True})
    specs.append({"config": str(q), "resume": "none", "predict": True})

    # accumulation and offload: 4 steps (warmup 2, cosine), batch 2 per rank, or 1 x accumulation 2.
    # ZeRO-3 tests both at once (one accumulated, offloaded job against the plain one: a ZeRO-3 job
    # costs the most here); each offloaded job is resumed from its step-2 checkpoint
    same = same_world(world)
    both = {"offload_optimizer": True, "offload_param": True}
    for name, zero, train, ds, save_every in (("b2z2", 2, {"batch_size": 2}, {}, 4),
                                              ("accz2", 2, {"batch_size": 1, "gradient_accumulation": 2}, {}, 2),
                                              # 4 over 2 ranks at micro-batches of at most 1: 1 x 2 each
                                              ("gz2", 2, {"batch_size": 1, "global_batch_size": 4}, {}, 2),
                                              ("offz2", 2, {"batch_size": 2}, {"offload_optimizer": True}, 2),
                                              ("b2z3", 3, {"batch_size": 2}, {}, 4),
                                              ("accoffz3", 3, {"batch_size": 1, "gradient_accumulation": 2}, both, 2)):
        specs.append({"config": str(job_yaml(world, name, data=same, zero=zero, steps=4, save_every=save_every,
                                             train=train, deepspeed=ds)), "resume": "none"})
    for name, zero, train, ds in (("offz2", 2, {"batch_size": 2}, {"offload_optimizer": True}),
                                  ("accoffz3", 3, {"batch_size": 1, "gradient_accumulation": 2}, both)):
        specs.append({"config": str(job_yaml(world, f"{name}r", data=same, zero=zero, steps=4, save_every=2,
                                             train=train, deepspeed=ds)),
                      "resume": str(world / f"out/{name}/checkpoints/step_000000002")})

    # channel-concat i2v: c1 builds the caches (conditioning latents included), c2 finds them
    from video_dit.data.demo import make_demo_data

    make_demo_data(world / "cc", count=2, frames=9, size=32, seed=1, holdout=0)
    helpers.write_base(world / "base36.safetensors", in_dim=36)
    for name in ("c1", "c2"):
        specs.append({"config": str(job_yaml(world, name, data="cc", base="base36.safetensors", zero=2, steps=2,
                                             model={"preset": CONCAT["name"], "vae_path": "preset:tiny",
                                                    "text_encoder_path": "preset:tiny"})),
                      "resume": "none"})
    # the web UI's job file (JSON) of the `tiny` entry, the fields a user fills changed (tests/test_aitk_ui.py)
    import json

    import aitk_ui_job

    from video_dit.families import PRESETS
    from video_dit.integrations.aitk_ui import entry

    ui = aitk_ui_job.ui_job(entry(PRESETS["tiny"], str(world / "base.safetensors")), str(world / "data"), **{
        "datasets[0].num_frames": 9, "datasets[0].resolution": [32], "train.steps": 2,
        "train.disable_sampling": True, "training_folder": str(world / "out"), "save.save_every": 2})
    aitk_ui_job.set_key(ui, "config.name", "ui")
    (world / "ui.json").write_text(json.dumps(ui, indent=2))
    specs.append({"config": str(world / "ui.json"), "resume": "none"})
    _, logs, _ = ranks.run_jobs(world, specs, presets=[CONCAT])
    (world / "launch_c.log").write_text(logs)
    return world


def test_a_job_file_of_the_web_ui_trains(launch_c):
    """type diffusion_trainer, model.arch video_dit:tiny, the UI's rank 32 / alpha 32, every key the UI writes."""
    from video_dit.lora import read_lora

    steps = losses(launch_c, "ui")
    assert sorted(steps) == [1, 2] and all(torch.isfinite(torch.tensor(v)) for v in steps.values())
    native, alpha, rank, _ = read_lora(launch_c / "out/ui/ui.safetensors")
    assert rank == alpha == 32 and any(k.endswith(".lora_B.weight") and v.abs().max() > 0 for k, v in native.items())


def test_zero3_exports_equal_zero0_and_full_exports_load(launch_c):
    world = launch_c
    from safetensors import safe_open
    from safetensors.torch import load_file

    from video_dit.families.wan.loading import load_dit
    from video_dit.lora import load_lora

    log = (world / "launch_c.log").read_text()  # z0 asked for bf16 on CPU ranks: said once, on rank 0
    assert log.count("train.dtype is bf16, but these are CPU ranks: training in float32") == 1
    assert "set train.cpu_bf16: true to train in bf16 here" in log
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
    # the export renders what its previews showed with no other flag: video_dit_sources.json
    # holds its preset, VAE, text encoder and the preview's sampling settings; same MP4, byte for byte
    from video_dit.cli import main as cli_main

    sample, out = helpers.holdout_sample(world / "data"), world / "f2_from_export.mp4"
    assert cli_main(["sample", "--model", str(world / "out/f2/f2"), "--prompt", sample["prompt"],
                     "--image", sample["ctrl_img"], "--out", str(out)]) == 0
    assert out.read_bytes() == (world / "out/f2/samples/000000002_0.mp4").read_bytes()
    # `check-demo --seeds` renders through the same command: round 0 at the preview's own seed is that preview
    from types import SimpleNamespace

    from video_dit.commands.check_demo import check_seeds
    from video_dit.models.layouts import read_sources

    seed = read_sources(world / "out/f2/f2")["sampling"]["seed"]
    text, results = check_seeds(world / "out/f2/f2", [SimpleNamespace(**sample)], seed, 1, world / "seeds")
    assert (world / "seeds/000_0.mp4").read_bytes() == out.read_bytes()
    assert results[0][0]["caption"] == sample["prompt"] and f"1 more seed(s) ({seed}..{seed})" in text


def test_quantized_base_skips_nonfinite_losses_and_its_lora_reloads(launch_c):
    from safetensors.torch import load_file

    from video_dit.families.wan.loading import load_dit
    from video_dit.lora import load_lora
    from video_dit.train.precision import quantize_frozen

    world = launch_c
    result = ranks.result(world / "out/qn")
    assert result["quantized"] == "QLinear"
    assert "2 non-finite losses in a row" in result["nonfinite"] and "step_000000002" in result["nonfinite"]
    assert sorted(losses(world, "qn")) == [1, 2, 3]  # the skipped batch took no step; stopped before step 4
    assert [p.name for p in (world / "out/qn/checkpoints").glob("step_*")] == ["step_000000002"]

    # the LoRA trained on the quantized base: our usual keys (no quanto or peft base_layer names), and
    # loaded into a fresh base quantized the same way it reproduces the trained model's prediction
    assert ranks.result(world / "out/q")["quantized"] == "QLinear"
    lora = load_file(str(world / "out/q/q.safetensors"))
    assert set(lora) == set(load_file(str(world / "out/z0/z0.safetensors")))
    fresh = load_lora(world / "out/q/q.safetensors", load_dit(str(world / "base.safetensors")))
    quantize_frozen(fresh, "qfloat8", WAN.arch)
    assert type(fresh.blocks[0].ffn[0].base_layer).__name__ == "QLinear"
    x, t, ctx = probe_inputs()
    with torch.no_grad():
        pred = fresh.eval()(x, t, ctx)
    torch.testing.assert_close(pred, load_file(str(world / "out/q/pred.safetensors"))["pred"], rtol=1e-5, atol=1e-6)


def _rows(world, name):
    return helpers.metrics(world / "out" / name)


def _same_training(world, name, ref, what):
    """`name` trained like `ref`: the same steps, losses, gradient norms and LoRA. Not bit-exact: a batch
    of 2 and two micro-batches of 1 (or an offloaded optimizer's partitions) sum the same fp32 terms in
    another order, so the losses agree to 1e-5, the norms (sums over every gradient entry) to 1e-4 and
    the LoRA to helpers.TRAINED_RTOL."""
    from safetensors.torch import load_file

    rows, ref_rows = _rows(world, name), _rows(world, ref)
    assert [r["step"] for r in rows] == [1, 2, 3, 4] == [r["step"] for r in ref_rows], what
    for a, b in zip(rows, ref_rows):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5), (what, a["step"], a["loss"], b["loss"])
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4), (what, a["step"])
    helpers.assert_trained_close(*(load_file(str(world / f"out/{n}/{n}.safetensors")) for n in (name, ref)))
    return rows, ref_rows


def test_gradient_accumulation_equals_one_batch_k_times_larger(launch_c):
    """batch 1 x gradient_accumulation 2 == batch 2, within fp32 tolerance (ZeRO-2; ZeRO-3 together
    with offload, see launch_c): losses, gradient norms, the trained LoRA; the LR schedule, save_every
    and the step counters count optimizer steps. `train.global_batch_size: 4` at `batch_size: 1` on
    the 2 ranks resolves to that same accumulation, and trains the same."""
    from video_dit.train.engine import lr_lambda

    world = launch_c
    lr = helpers.train_process(world)["train"]["lr"]
    expected_lr = [lr * lr_lambda(2, 4, "cosine")(s) for s in range(4)]  # warmup 2, cosine over 4 steps
    assert expected_lr == [lr / 2, lr, lr, lr / 2]
    for name, ref in (("accz2", "b2z2"), ("gz2", "b2z2"), ("accoffz3", "b2z3")):
        acc, big = _same_training(world, name, ref, "accumulation")
        assert [r["lr"] for r in acc] == pytest.approx(expected_lr, rel=1e-9) == [r["lr"] for r in big]
        assert len({r["loss"] for r in big}) == 4  # the steps differ (noise), not one batch repeated
        for r in range(2):
            ra, rb = ranks.result(world / f"out/{name}", r), ranks.result(world / f"out/{ref}", r)
            assert ra["step"] == ra["scheduler_steps"] == ra["engine_global_steps"] == 4, ra
            assert rb["step"] == rb["scheduler_steps"] == rb["engine_global_steps"] == 4, rb
            assert (ra["engine_micro_steps"], rb["engine_micro_steps"]) == (8, 4)
        saved = sorted(p.name for p in (world / f"out/{name}/checkpoints").glob("step_*"))
        assert saved == ["step_000000002", "step_000000004"]  # save_every: 2 counts optimizer steps


def test_cpu_offload_gives_the_losses_without_and_resumes(launch_c):
    """offload_optimizer (ZeRO-2), offload_optimizer + offload_param (ZeRO-3, with accumulation): the
    losses and LoRA of the same job without offload; each offloaded job resumed from its step-2
    checkpoint (the offloaded Adam state read back) continues with exactly its losses and export."""
    from safetensors.torch import load_file

    world = launch_c
    for name, ref, zero in (("offz2", "b2z2", 2), ("accoffz3", "b2z3", 3)):
        for r in range(2):  # DeepSpeed's ZeRO optimizer really offloads (on CPU ranks: to host buffers)
            got = ranks.result(world / f"out/{name}", r)
            assert (got["offload_optimizer"], got["offload_param"]) == (True, zero == 3), got
            assert not ranks.result(world / f"out/{ref}", r)["offload_optimizer"]
        _same_training(world, name, ref, "offload")
    for name in ("offz2", "accoffz3"):
        resumed, whole = losses(world, f"{name}r"), losses(world, name)
        assert sorted(resumed) == [3, 4] and all(resumed[s] == whole[s] for s in (3, 4)), (name, resumed, whole)
        a, b = (load_file(str(world / f"out/{n}/{n}.safetensors")) for n in (f"{name}r", name))
        assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a), name
        assert ranks.result(world / f"out/{name}r")["offload_optimizer"]


def test_cached_concat_i2v_makes_no_vae_call_and_gives_the_uncached_losses(launch_c):
    """Channel-concat i2v (a tiny preset with in_dim 36, built here): the first run encodes each clip
    and its conditioning latents once, at start; a second run of the same job on the cached data makes
    no VAE call at all and trains to the same losses; and the cached latents are what a VAE encode of
    the decoded file gives, computed here (Wan's recipe: the first frame followed by zero frames)."""
    import av
    import numpy as np
    from safetensors.torch import load_file

    from video_dit.families.wan.loading import load_vae

    world = launch_c
    first = [ranks.result(world / "out/c1", r) for r in range(2)]
    second = [ranks.result(world / "out/c2", r) for r in range(2)]
    assert sum(r["vae_encode_calls_at_start"] for r in first) >= 2  # the two clips (and their conditions)
    assert all(r["vae_encode_calls"] == r["vae_encode_calls_at_start"] for r in first)  # none while training
    assert [r["vae_encode_calls"] for r in second] == [0, 0]
    assert [r["text_encode_calls"] for r in second] == [0, 0]
    l1, l2 = losses(world, "c1"), losses(world, "c2")
    assert sorted(l1) == [1, 2] and l1 == l2

    vae = load_vae("preset:tiny").eval()
    entries = sorted((world / "cc" / "_latent_cache").glob("*.safetensors"))
    assert len(entries) == 2
    for entry in entries:
        clip = world / "cc" / entry.name.split("_")[0]
        with av.open(str(clip)) as container:
            frames = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])  # (F, H, W, 3)
        video = torch.from_numpy(frames).permute(3, 0, 1, 2)[None].float() / 127.5 - 1  # (1, 3, F, H, W)
        assert video.shape == (1, 3, 9, 32, 32)
        cond_clip = torch.cat([video[:, :, :1], torch.zeros_like(video[:, :, 1:])], dim=2)
        with torch.no_grad():
            latents = vae.normalize(vae.encode(video).mode())
            cond = vae.normalize(vae.encode(cond_clip).mode())
        cached = load_file(str(entry))
        torch.testing.assert_close(cached["latents"], latents[0], rtol=1e-4, atol=1e-5)  # stored per item
        torch.testing.assert_close(cached["cond_latents"], cond[0], rtol=1e-4, atol=1e-5)
