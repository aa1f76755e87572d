"""The family contract is closed: a family defined outside the package (tests/standin_family: its own DiT,
VAE, text encoder, presets, pipeline, memory model and LoRA targets) runs through every front end, asked
only through its `Family` record, registered at run time (in this process by `register`, in every rank
of a launch by `VIDEO_DIT_FAMILIES=standin_family`), and no file of the package names it.

  the memory model      its activation model against what the stand-in's forward and backward really keep
                        (`CPUAllocationTracker`); `video-dit plan` on a stand-in job gives that model's figures
                        and the family's parameter counts; the ZeRO-3 set-up reads one of its blocks at a time
  the checks before     `video_dit.train.validate --plan` (train.sh's first step) passes a stand-in job and
  any rank              refuses a do_i2v dataset, which the family's own conditioning cannot take
  the registry          stand-in weights identified by their config.json or their tensor names; a folder of
                        the family's layout samples with no preset (its parts by `folder_source`)
  the trainer           one launch of 2 ranks and one of 1 rank, side by side (LoRA on trained weights, 9 x 48 x 48
                        clips, 27 tokens): 1 rank and 2 sequence-parallel ranks (the one layout where a second
                        rank draws the first one's data and noise: with data parallelism each rank draws its
                        own) give the same losses, gradient norms and LoRA; ZeRO-3 the same as ZeRO-2; a job
                        stopped after 2 of 4 steps and resumed gives the uninterrupted job's losses exactly
  `video-dit sample`    the full fine-tune's export renders its preview's MP4, byte for byte, and what the
                        stand-in's pipeline renders from the exported weights called directly
  the ai-toolkit arch   (tests/aitk_standin) a training step on the stand-in preset: the loss our trainer
                        computes, gradients on the LoRA only; its full save loads back alone
"""

from __future__ import annotations

import copy
import json
import re
import types
from dataclasses import asdict, replace
from pathlib import Path

import aitk_standin
import helpers
import pytest
import ranks
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from standin_family import FAMILY as STANDIN
from standin_family.dit import LORA_TARGETS, StandinDiT, cast_standin
from standin_family.memory import activation_bytes

from video_dit.families import FAMILIES, PRESETS, identify, load_plugins
from video_dit.lora import add_lora
from video_dit.models.activation_terms import Setting
from video_dit.parallel.memory import CPUAllocationTracker
from video_dit.typed_config import ConfigError

ROOT = Path(__file__).resolve().parents[1]
PRESET = "standin-tiny"
GiB = 2 ** 30


@pytest.fixture(scope="module", autouse=True)
def registered():
    """The stand-in registered in this process as a launch's ranks register it (`load_plugins`), and taken
    out of the registry after this module (other tests list the families and presets)."""
    assert STANDIN.name not in FAMILIES
    assert load_plugins("standin_family") == [STANDIN]
    yield
    FAMILIES.pop(STANDIN.name)
    for name in STANDIN.presets:
        PRESETS.pop(name)


def test_no_file_of_the_package_names_the_stand_in():
    named = [str(p.relative_to(ROOT)) for p in (ROOT / "video_dit").rglob("*.py")
             if "standin" in p.read_text(encoding="utf-8").lower()]
    assert not named, named


def write_base(folder: Path) -> Path:
    """'Trained' stand-in weights: the preset's seeded init with every zero (adaLN, head, biases) drawn
    N(0, 0.05), as a folder of model.safetensors + config.json (a LoRA on a zero head trains nothing)."""
    dit = helpers.randomize_zeros(STANDIN.load_dit(f"preset:{PRESET}"), seed=1)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in dit.state_dict().items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(asdict(dit.config)))
    return folder


# ---------------------------------------------------------------- the memory model

GRID = (3, 6, 6)  # 27 tokens


def _measure(cfg, lora: int | None, checkpointing, dtype) -> tuple[int, int]:
    """(bytes the forward leaves for backward, the step's peak) of the stand-in DiT, as the trainer stores it."""
    model = helpers.randomize_all(StandinDiT(cfg, init_seed=0))
    if lora:
        add_lora(model, lora, targets=LORA_TARGETS)
    cast_standin(model, dtype, masters=True)  # trainable float32, the frozen bulk in dtype, islands float32
    if checkpointing:
        model.set_checkpointed_blocks(cfg.depth if checkpointing is True else checkpointing)
    g = torch.Generator().manual_seed(1)
    x, t = torch.randn(1, cfg.in_channels, *GRID, generator=g), torch.tensor([300.0])
    context, target = [torch.randn(5, cfg.text_dim, generator=g)], torch.randn(1, cfg.in_channels, *GRID, generator=g)
    model(x, t, context).sum().backward()  # the gradients exist before the measured step, as in training
    with CPUAllocationTracker() as tracker:
        loss = (model(x, t, context) - target).square().mean()
        saved = tracker.live - 4  # 4: the loss itself
        loss.backward()
    return saved, tracker.peak


# (checkpointed blocks: none, every one, the first 1 of 3; LoRA rank; dtype)
MEMORY_CASES = [(ckpt, lora, dtype) for ckpt in (False, True, 1) for lora in (None, 4)
                for dtype in (torch.float32, torch.bfloat16)]


@pytest.mark.parametrize("checkpointing,lora,dtype", MEMORY_CASES)
def test_activation_model_equals_what_autograd_keeps(checkpointing, lora, dtype):
    """Saved bytes to the byte; the peak within 15% (measured 0.95-1.13 of the tracker's: the re-run of a
    checkpointed block is the coarsest term)."""
    cfg = replace(STANDIN.presets[PRESET].dit, depth=3)
    saved, peak = _measure(cfg, lora, checkpointing, dtype)
    setting = Setting(0, checkpointing=bool(checkpointing),
                      checkpoint_blocks=None if isinstance(checkpointing, bool) else checkpointing)
    predicted = STANDIN.memory.activations(cfg, GRID, setting, lora_rank=lora, s=dtype.itemsize, fused=False,
                                           inputs={})
    assert predicted.saved == saved, predicted.parts
    assert predicted.peak == pytest.approx(peak, rel=0.15), (predicted.parts, peak)
    if lora and checkpointing is not True:  # exact enough to tell the adapters' rank: one more is another figure
        other = activation_bytes(cfg, GRID, setting, lora_rank=lora + 1, s=dtype.itemsize)
        assert other.saved != saved


def _plan_job(root: Path, zero: int = 3) -> Path:
    from PIL import Image

    (root / "data").mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (48, 48)).save(root / "data" / "a.png")
    (root / "data" / "a.txt").write_text("a still")
    base = write_base(root / "base")
    return helpers.write_job(root, "plan", data="data", zero=zero, size=48,
                             datasets=[{"folder_path": str(root / "data"), "num_frames": 9, "resolution": [48],
                                        "do_i2v": False, "caption_ext": "txt"}],
                             model={"name_or_path": str(base), "preset": PRESET})


def test_video_dit_plan_gives_the_stand_ins_figures(tmp_path):
    """`video-dit plan` on a stand-in job: the activations are the stand-in's model (its own function, on
    the job's bucket), the parameters its DiT's and its LoRA adapters' (counted here on a model built
    with the family's targets); and the ZeRO-3 set-up on the host holds one block of the stand-in
    (its `layers.N`) at a time, not the whole block list."""
    from video_dit.cli import main as cli_main
    from video_dit.devices import Machine
    from video_dit.models.weights import module_groups
    from video_dit.train import plan

    job = _plan_job(tmp_path)
    out = tmp_path / "plan.json"
    assert cli_main(["plan", str(job), "--cpu-ranks", "2", "--host-mem", "8", "--bucket", "9x48x48",
                     "--json", str(out)]) == 0
    figures = json.loads(out.read_text())
    cfg = STANDIN.presets[PRESET].dit
    row = figures["buckets"][0]
    assert row["bucket"] == [9, 48, 48] and row["tokens"] == 27 and figures["preset"] == PRESET
    expected = activation_bytes(cfg, (3, 6, 6), Setting(3, micro_batch=1), lora_rank=4, s=4)
    assert row["as_configured"]["activations"] == pytest.approx(expected.peak / GiB, rel=1e-12)
    with torch.device("meta"):
        model = StandinDiT(cfg)
        base = sum(p.numel() for p in model.parameters())
        add_lora(model, 4, targets=LORA_TARGETS)
    adapters = sum(p.numel() for n, p in model.named_parameters() if ".lora_" in n)
    assert (figures["parameters"], figures["trainable"]) == (base, adapters) and adapters > 0

    parsed, _ = plan.load_job_for_plan(str(job))
    host = plan.plan_job(parsed, Machine(ranks=2, nodes=1, device="cpu", host_mem=8 * GiB)).host
    sizes = {n: p.numel() for n, p in StandinDiT(cfg).named_parameters()}
    layer = sum(n for k, n in sizes.items() if k.startswith("layers.0."))
    assert host.parts["dit_setup_per_rank"] == layer * 4  # float32; the largest module group is one block
    assert max(len(g) for g in module_groups(sizes, STANDIN.arch.block_list)) == \
        sum(1 for k in sizes if k.startswith("layers.0."))


def test_the_checks_before_the_ranks_take_a_stand_in_job_and_refuse_a_do_i2v_dataset(tmp_path, capsys):
    """`python -m video_dit.train.validate JOB --plan` (what train.sh runs first) passes a stand-in job and
    prints its plan; a do_i2v dataset is refused there (exit 2, the key named), as the family's own
    conditioning says: the stand-in takes no first frame."""
    from video_dit.train.validate import main as validate

    job = _plan_job(tmp_path, zero=2)
    assert validate([str(job), "--plan"]) == 0, capsys.readouterr().err  # the ranks train.sh starts here
    assert f"memory plan: plan ({PRESET}, LoRA rank 4" in capsys.readouterr().err
    job.write_text(job.read_text().replace("do_i2v: false", "do_i2v: true"))
    assert validate([str(job)]) == 2
    assert re.search(r"datasets\[0\]\.do_i2v.*takes no first frame", capsys.readouterr().err)


def test_the_registry_identifies_stand_in_weights(tmp_path):
    base = write_base(tmp_path / "base")
    family, evidence = identify(str(base / "model.safetensors"))
    assert family is STANDIN and "config.json" in evidence
    (base / "config.json").unlink()  # no config: its tensor names say it
    family, evidence = identify(str(base / "model.safetensors"))
    assert family is STANDIN and "tensor names" in evidence
    from video_dit.families.wan.loading import load_dit as load_wan

    wan = tmp_path / "wan.safetensors"
    save_file(load_wan("preset:tiny").state_dict(), str(wan))
    assert identify(str(wan))[0].name == "wan"


def test_a_stand_in_model_folder_samples_without_a_preset(tmp_path, capsys):
    """A folder of the stand-in's own layout (DiT weights + config.json, vae/ and text_encoder/ beside them):
    `video-dit sample` tells its family from its files, finds its parts by the family's `folder_source`,
    and samples at the family's defaults (no preset known)."""
    from video_dit.cli import main as cli_main
    from video_dit.media import probe_video

    base = write_base(tmp_path / "model")
    for part, module in (("vae", STANDIN.load_vae(f"preset:{PRESET}", seed=5)),
                         ("text_encoder", STANDIN.load_text_encoder(f"preset:{PRESET}"))):
        (base / part).mkdir()
        save_file(module.state_dict(), str(base / part / "model.safetensors"))
        (base / part / "config.json").write_text(json.dumps(asdict(module.config)))
    out = tmp_path / "t2v.mp4"
    assert cli_main(["sample", "--model", str(base), "--prompt", "a red square", "--frames", "5", "--height", "32",
                     "--width", "32", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "sampling: euler, 6 steps, shift 3, guidance 2" in printed and "the stand-in family's defaults" in printed
    info = probe_video(out)
    assert (info.num_frames, info.width, info.height) == (5, 32, 32)
    vae = STANDIN.load_vae(str(base / "vae"))
    assert all(torch.equal(v, STANDIN.load_vae(f"preset:{PRESET}", seed=5).state_dict()[k])
               for k, v in vae.state_dict().items())
    assert not torch.equal(vae.encode_first.weight, STANDIN.load_vae(f"preset:{PRESET}").encode_first.weight)


# ---------------------------------------------------------------- the trainer: 1 and 2 ranks, ZeRO-2 / 3, resume


def _job(root: Path, name: str, data: str, *, zero: int = 2, sp: int = 1, lora: bool = True, steps: int = 4,
         save_every: int = 2, preview: bool = False) -> Path:
    return helpers.write_job(
        root, name, data=data, zero=zero, lora=lora, steps=steps, save_every=save_every, keep=2, lr=1e-2, size=48,
        samples=[{"prompt": "a red square drifting right"}] if preview else None, sample_every=steps, sample_steps=3,
        datasets=[{"folder_path": str(root / data), "num_frames": 9, "resolution": [48], "do_i2v": False,
                   "caption_ext": "txt"}],
        model={"name_or_path": str(root / "base"), "preset": PRESET},
        sample={"guidance_scale": 2.0}, train={"seed": 3, "warmup_steps": 1},
        deepspeed={"sequence_parallel_size": sp})


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The 2-rank launch (z2: LoRA ZeRO-2 SP 2; r: the same job stopped after step 2, then resumed; z3: LoRA
    ZeRO-3 SP 2; f: a full fine-tune, ZeRO-2 data parallel, previewed at step 2) and the 1-rank one
    (one: z2's job on one rank), started together; each its own copy of the data (their caches are built
    at once). The ranks know the stand-in only from VIDEO_DIT_FAMILIES."""
    from video_dit.data.demo import make_demo_data

    root = tmp_path_factory.mktemp("standin_runs")
    for data in ("data2", "data1"):
        make_demo_data(root / data, count=2, frames=9, size=48, seed=0, holdout=0)
    write_base(root / "base")
    r = _job(root, "r", "data2", sp=2)
    two = [{"config": str(_job(root, "z2", "data2", sp=2))},
           {"config": str(r), "stop_at": 2},
           {"config": str(r), "resume": str(root / "out/r/checkpoints/step_000000002")},
           {"config": str(_job(root, "z3", "data2", zero=3, sp=2, save_every=4))},
           {"config": str(_job(root, "f", "data2", lora=False, steps=2, preview=True))}]
    one = [{"config": str(_job(root, "one", "data1", save_every=4))}]
    env = {"VIDEO_DIT_FAMILIES": "standin_family"}
    started = [ranks.start_jobs(root, two, 2, env=env), ranks.start_jobs(root, one, 1, env=env)]
    for procs, prefix in started:
        ranks.wait(procs, prefix, timeout=600)
    return root


# Not bit-exact: the sequence-parallel exchange and ZeRO-3's partitions sum fp32 terms in another order.
# Measured (z2 vs one, z3 vs z2): losses <= 7e-8 relative, gradient norms <= 1e-7, the trained LoRA
# (`helpers.assert_trained_close`: what training changed) <= 6e-7; the tolerances are ~15x that.
LOSS_RTOL, GRAD_NORM_RTOL, LORA_RTOL = 1e-6, 2e-6, 1e-5


def _same_training(root: Path, name: str, ref: str) -> None:
    """`name` trained like `ref`: the same 4 steps, losses, gradient norms and LoRA; and the LoRA
    comparison tells two optimizer steps apart (z2's step-2 export against `ref`'s step-4 one)."""
    rows, ref_rows = helpers.metrics(root / "out" / name), helpers.metrics(root / "out" / ref)
    assert [r["step"] for r in rows] == [1, 2, 3, 4] == [r["step"] for r in ref_rows]
    for a, b in zip(rows, ref_rows):
        assert a["loss"] == pytest.approx(b["loss"], rel=LOSS_RTOL), (name, a["step"], a["loss"], b["loss"])
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=GRAD_NORM_RTOL), (name, a["step"])
    assert len({r["loss"] for r in ref_rows}) == 4  # four batches and noises, not one repeated
    a, b = (load_file(str(root / "out" / n / f"{n}.safetensors")) for n in (name, ref))
    helpers.assert_trained_close(a, b, rtol=LORA_RTOL)
    assert all(a[k].abs().max() > 0 for k in a if "lora_B" in k)  # trained, not the zero init
    with pytest.raises(AssertionError, match="trained change differs"):
        helpers.assert_trained_close(load_file(str(root / "out/z2/z2_000000002.safetensors")), b, rtol=LORA_RTOL)


@pytest.mark.multirank
def test_one_rank_and_two_sequence_parallel_ranks_train_alike(runs):
    _same_training(runs, "z2", "one")
    assert [r["sp_degree"] for r in helpers.metrics(runs / "out/z2")] == [2] * 4


@pytest.mark.multirank
def test_zero3_trains_as_zero2(runs):
    _same_training(runs, "z3", "z2")


@pytest.mark.multirank
def test_a_job_stopped_and_resumed_gives_the_uninterrupted_losses(runs):
    """Exactly: fp32, the same ranks, and the checkpoint restores weights, Adam, LR, data position and RNG."""
    resumed, whole = helpers.losses(runs / "out/r"), helpers.losses(runs / "out/z2")
    assert sorted(resumed) == [1, 2, 3, 4]
    assert all(resumed[s] == whole[s] for s in resumed), (resumed, whole)
    a, b = (load_file(str(runs / "out" / n / f"{n}.safetensors")) for n in ("r", "z2"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.multirank
def test_video_dit_sample_renders_the_export_as_the_pipeline_does(runs, tmp_path):
    """`video-dit sample --model <the full fine-tune's export>` alone (its video_dit_sources.json holds the
    preset, the encoders and the preview's settings) writes the preview's MP4, and the stand-in's pipeline
    called here on the exported weights renders the same frames (the same bytes once written)."""
    from video_dit.cli import main as cli_main
    from video_dit.media import write_video
    from video_dit.models.layouts import read_sources

    export = runs / "out/f/f"
    prompt = "a red square drifting right"
    out = tmp_path / "cli.mp4"
    assert cli_main(["sample", "--model", str(export), "--prompt", prompt, "--out", str(out)]) == 0
    assert out.read_bytes() == (runs / "out/f/samples/000000002_0.mp4").read_bytes()

    shown = read_sources(export)["sampling"]
    dit = STANDIN.load_dit(str(export)).eval()
    vae, encoder = STANDIN.load_vae(f"preset:{PRESET}"), STANDIN.load_text_encoder(f"preset:{PRESET}")
    embeds = encoder.encode([prompt, shown["negative"]])
    frames = STANDIN.pipeline(dit, vae).generate(
        embeds[0], embeds[1], num_frames=shown["frames"], height=shown["height"], width=shown["width"],
        steps=shown["steps"], guidance_scale=shown["guidance"], shift=shown["shift"],
        generator=torch.Generator().manual_seed(shown["seed"]))
    direct = write_video(frames, tmp_path / "direct.mp4", fps=shown["fps"])
    assert direct.read_bytes() == out.read_bytes()
    # the export is the trained model, not the base it started from
    base = STANDIN.load_dit(str(runs / "base")).eval()
    before = STANDIN.pipeline(base, vae).generate(
        embeds[0], embeds[1], num_frames=shown["frames"], height=shown["height"], width=shown["width"],
        steps=shown["steps"], guidance_scale=shown["guidance"], shift=shown["shift"],
        generator=torch.Generator().manual_seed(shown["seed"]))
    assert write_video(before, tmp_path / "base.mp4", fps=shown["fps"]).read_bytes() != direct.read_bytes()


# ---------------------------------------------------------------- the ai-toolkit arch


@pytest.fixture
def aitk():
    yield aitk_standin.activate()
    aitk_standin.deactivate()


def test_the_ai_toolkit_arch_trains_a_step_on_the_stand_in(aitk, tmp_path):
    """The arch (`arch: video_dit`, `model_kwargs.preset: standin-tiny`): its names come from the record; one
    training step in ai-toolkit's order (encode_images, get_prompt_embeds, add_noise, predict_noise,
    get_loss_target, scale_loss, backward) gives the loss our trainer's `loss_at` computes for the same
    item, t and noise, and gradients on the LoRA alone; a preview renders; the full save loads back alone."""
    from toolkit.config_modules import GenerateImageConfig, ModelConfig
    from toolkit.data_transfer_object.data_loader import DataLoaderBatchDTO

    from video_dit.diffusion.flow import add_noise
    from video_dit.train.trainer import Trainer

    base = write_base(tmp_path / "base")
    cfg = ModelConfig(name_or_path=str(base), arch="video_dit", dtype="fp32", model_kwargs={"preset": PRESET})
    sd = aitk.VideoDiTModel(device="cpu", model_config=cfg, dtype="fp32",
                            noise_scheduler=aitk.VideoDiTModel.get_train_scheduler())
    sd.load_model()
    assert sd.target_lora_modules == ["StandinDiT"] and sd.get_transformer_block_names() == ["layers"]
    assert {"patch_embed*", "text_embed*", "time_embed*", "head*"} == set(sd.get_quantization_exclude_modules())
    assert sd.get_bucket_divisibility() == 16 and sd.get_frame_count_snapper()(12) == 9

    g = torch.Generator().manual_seed(0)
    pixels = F.interpolate(torch.rand(9, 3, 6, 6, generator=g) * 2 - 1, size=(48, 48), mode="bilinear")[None]
    batch = DataLoaderBatchDTO(tensor=pixels, do_i2v=False, num_frames=9)  # (1, 9, 3, 48, 48)
    batch.latents = sd.encode_images(batch.tensor)
    assert batch.latents.shape == (1, 4, 3, 6, 6)
    embeds = sd.get_prompt_embeds(["a red square drifting right"])
    dit = add_lora(sd.model, 4, targets=LORA_TARGETS)  # peft, as ai-toolkit's network would be
    with torch.no_grad():
        for n, p in dit.named_parameters():
            if "lora_B" in n:
                p.normal_(std=0.05, generator=g)
    t = torch.tensor([640.0])
    noise = torch.randn(batch.latents.shape, generator=g)
    pred = sd.predict_noise(sd.add_noise(batch.latents, noise, t), text_embeddings=embeds, timestep=t, batch=batch)
    target = sd.get_loss_target(noise=noise, batch=batch, timesteps=t)
    loss = sd.scale_loss(F.mse_loss(pred.float(), target.float(), reduction="none")).mean([1, 2, 3, 4]).mean()

    trainer = Trainer.__new__(Trainer)  # only what loss_at reads
    trainer.device, trainer.engine, trainer.family, trainer.dit_config = torch.device("cpu"), dit, STANDIN, dit.config
    trainer.conditioning, trainer.timesteps = None, types.SimpleNamespace(loss_weight=torch.ones_like)
    with torch.no_grad():
        ours = trainer.loss_at({"latents": batch.latents, "text_embeds": embeds.text_embeds}, t, noise)
        assert torch.allclose(sd.add_noise(batch.latents, noise, t), add_noise(batch.latents, noise, t), atol=1e-6)
    assert torch.allclose(loss, ours, rtol=1e-6), (loss, ours)
    loss.backward()
    grads = {n: p.grad for n, p in dit.named_parameters() if p.grad is not None}
    assert grads and all(".lora_" in n for n in grads) and any(g.abs().sum() > 0 for g in grads.values())
    i2v = DataLoaderBatchDTO(tensor=pixels, latents=batch.latents, do_i2v=True, num_frames=9)
    with pytest.raises(ConfigError, match=r"do_i2v.*takes no first frame"):  # as our trainer refuses the job
        sd.predict_noise(batch.latents, text_embeddings=embeds, timestep=t, batch=i2v)

    gen_config = GenerateImageConfig(prompt="a red square", width=64, height=64, num_inference_steps=2,
                                     guidance_scale=2.0, seed=3, num_frames=7, fps=8,
                                     output_folder=str(tmp_path / "samples"), output_ext="webp")
    frames = sd.generate_single_image(sd.get_generation_pipeline(), gen_config, sd.get_prompt_embeds(["a red square"]),
                                      sd.get_prompt_embeds([""]), torch.manual_seed(3), {})
    assert gen_config.num_frames == 5 and len(frames) == 5 and frames[0].size == (64, 64)

    sd.model = copy.deepcopy(STANDIN.load_dit(str(base)))  # a full fine-tune's model: no adapters
    sd.save_model(str(tmp_path / "full"), {"step": 1}, torch.float32)
    reloaded = STANDIN.load_dit(str(tmp_path / "full"))
    assert all(torch.equal(v, sd.model.state_dict()[k]) for k, v in reloaded.state_dict().items())
    assert identify(str(tmp_path / "full"))[0] is STANDIN
