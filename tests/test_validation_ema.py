"""Held-out validation loss and the EMA of the trainable weights.

Single process: the seeded validation split, skipped validation items, the EMA update and swap.
One 2-rank launch of tests/ranks.py's job worker, four jobs on the tiny preset:
  z0  ZeRO-0 LoRA, EMA (decay 0.5) + validation every step, exports every step;
  z3  the same job under ZeRO-3 (EMA partitioned per rank): the same validation losses and EMA export;
  r3  z3 relaunched from its step-2 checkpoint: the validation losses and EMA export of z3 (exact);
  sp  ZeRO-3 + sequence parallel 2, full fine-tune, EMA: the step-0 validation loss of z0 (items spread
      over 2 data-parallel ranks there, one sequence group here) and an EMA export equal to the EMA
      the test computes from the raw exports of every step.
The step-0 validation loss is also computed here from scratch (base DiT, conditioning, i2v mask).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import helpers
import pytest
import ranks
import torch

from video_dit.families.wan.dit import LORA_TARGETS as WAN_LORA_TARGETS

DECAY = 0.5
SIGMAS = [1.0, 0.6, 0.2]


# ---------------------------------------------------------------- single process

@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    from video_dit.data.demo import make_demo_data

    root = tmp_path_factory.mktemp("val")
    make_demo_data(root / "data", count=6, frames=9, size=32, seed=0, holdout=3)
    return root


def _dataset(folder, **kw):
    from video_dit.data import DatasetConfig
    from video_dit.typed_config import parse

    return parse(DatasetConfig, {"folder_path": str(folder), "num_frames": 9, "resolution": [32], **kw}, "datasets[0]")


def test_validation_split_is_seeded_and_never_trained_on(clips):
    from video_dit.data import scan_datasets
    from video_dit.train.validation import split_scan

    ds = [_dataset(clips / "data", validation_split=0.34)]
    scan = scan_datasets(ds, 16, verbose=False)
    train, held = split_scan(scan, ds, seed=3)
    assert len(held) == 2 and len(train.items) == 4  # round(0.34 * 6)
    assert not {it.path for it in held} & {it.path for it in train.items}
    again = split_scan(scan_datasets(ds, 16, verbose=False), ds, seed=3)[1]
    assert [it.path for it in again] == [it.path for it in held]
    others = {tuple(sorted(it.path for it in split_scan(scan, ds, seed=s)[1])) for s in range(8)}
    assert len(others) > 1  # the seed chooses
    whole = [_dataset(clips / "data", validation_split=1.0)]
    with pytest.raises(Exception, match="no training item left"):
        split_scan(scan_datasets(whole, 16, verbose=False), whole, seed=0)


def test_missing_and_unreadable_items_are_skipped_with_a_warning(clips, tmp_path):
    from video_dit.data import DataError
    from video_dit.train.config import ValidationConfig
    from video_dit.train.validation import item_scan
    from video_dit.typed_config import parse

    bad = tmp_path / "corrupt.mp4"
    bad.write_bytes(b"\x00\x00\x00 ftypisom" + b"\x13" * 200)
    cfg = parse(ValidationConfig, {"validation_items": [
        {"image_path": str(clips / "data_holdout/000.mp4"), "prompt": "a red square moving right"},
        {"image_path": str(tmp_path / "gone.mp4"), "prompt": "x"},
        {"image_path": str(bad), "prompt": "y"}]}, "v")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        items = item_scan(cfg, [_dataset(clips / "data", do_i2v=True)], 16, "replace", verbose=True)
    text = "\n".join(str(w.message) for w in caught)
    assert "validation_items[1]: skipped" in text and "gone.mp4: no such file" in text
    assert "validation_items[2]: skipped" in text and "corrupt.mp4" in text
    assert [(Path(it.path).name, it.caption, it.bucket, it.do_i2v) for it in items] == \
        [("000.mp4", "a red square moving right", (9, 32, 32), True)]

    from video_dit.train.config import ProcessConfig
    from video_dit.train.validation import collect

    process = parse(ProcessConfig, {"model": {"name_or_path": "preset:tiny"},
                                    "datasets": [{"folder_path": str(clips / "data"), "num_frames": 9,
                                                  "resolution": [32]}],
                                    "train": {"validation_config": {"validation_items": [
                                        {"image_path": str(tmp_path / "gone.mp4")}]}}}, "p")
    from video_dit.data import scan_datasets

    with pytest.raises(DataError, match="no usable validation item"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        collect(process, scan_datasets(process.datasets, 16, verbose=False), 16, verbose=False)


def test_ema_update_and_swap_restore_exactly():
    from video_dit.train.ema import EMA

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    net[1].weight.requires_grad_(False)  # frozen: not averaged
    ema = EMA(net, 0.9, zero_stage=0)
    assert ema.names == ["0.weight", "0.bias", "1.bias"]
    expected = {n: p.detach().clone() for n, p in net.named_parameters() if p.requires_grad}
    for _ in range(3):
        with torch.no_grad():
            for p in net.parameters():
                p.add_(torch.randn_like(p))
        ema.update()
        for n, p in net.named_parameters():
            if n in expected:
                expected[n] = 0.9 * expected[n] + 0.1 * p.detach()
    raw = {n: p.detach().clone() for n, p in net.named_parameters()}
    with ema.swapped_in():
        for n, p in net.named_parameters():
            want = expected.get(n, raw[n])
            torch.testing.assert_close(p.detach(), want, rtol=1e-6, atol=1e-7)
        assert not torch.equal(net[0].weight, raw["0.weight"])
    assert all(torch.equal(p, raw[n]) for n, p in net.named_parameters())  # bit-exact restore


# ---------------------------------------------------------------- the 2-rank launch

def job_yaml(root: Path, name: str, *, zero: int, lora: bool = True, steps: int = 4, sp: int = 1) -> Path:
    """A tiny-preset job (helpers.train_process) with EMA (decay `DECAY`) and validation on the 3
    held-out clips every step, an export every step, constant LR."""
    holdout = root / "data_holdout"
    items = [{"image_path": str(holdout / f"{j:03d}.mp4"), "prompt": (holdout / f"{j:03d}.txt").read_text().strip()}
             for j in range(3)]
    return helpers.write_job(
        root, name, zero=zero, lora=lora, steps=steps, save_every=1, keep=10, lr=2e-2,
        train={"warmup_steps": 0, "lr_scheduler": "constant",
               "ema_config": {"use_ema": True, "ema_decay": DECAY, "validate_with_ema": True},
               "validation_config": {"validate_every_n_steps": 1, "validation_sigmas": SIGMAS, "seed": 5,
                                     "validation_items": items}},
        deepspeed={"sequence_parallel_size": sp})


def _metrics(root: Path, name: str) -> dict[int, dict]:
    from video_dit.train.metrics import read_metrics

    return {r["step"]: r for r in read_metrics(root / "out" / name / "metrics.jsonl")}


def _lora_native(path: Path) -> dict[str, torch.Tensor]:
    """A LoRA export in the module's own parameter names (`blocks.0.self_attn.q.lora_A.default.weight`)."""
    from video_dit.families.wan.loading import load_dit
    from video_dit.lora import add_lora, load_lora

    model = add_lora(load_dit("preset:tiny"), 4, 4, targets=WAN_LORA_TARGETS)
    load_lora(path, model)
    return {n: p.detach() for n, p in model.named_parameters() if ".lora_" in n}


def _expected_val_loss(root: Path) -> dict[float, float]:
    """Step-0 validation loss from scratch: base DiT (LoRA B = 0), item k's noise from seed 5 + k, replace
    i2v (clean frame 0, t = 0 on its tokens, masked out of the MSE), mean over items per sigma."""
    from video_dit.diffusion.conditioning import FirstFrameConditioning, encode_conditioning, masked_mse
    from video_dit.diffusion.flow import add_noise
    from video_dit.families.wan.loading import load_dit, load_text_encoder, load_vae
    from video_dit.media import read_video

    dit, vae, te = load_dit(str(root / "base.safetensors")).eval(), load_vae("preset:tiny").eval(), \
        load_text_encoder("preset:tiny")
    cond = FirstFrameConditioning("replace")
    out = {s: 0.0 for s in SIGMAS}
    with torch.no_grad():
        for k in range(3):
            clip = read_video(root / f"data_holdout/{k:03d}.mp4").permute(1, 0, 2, 3)[None]  # (1, 3, 9, 32, 32)
            x0 = vae.normalize(vae.encode(clip).mode())
            first = encode_conditioning(vae, clip, "replace", 9)
            text = te.encode([(root / f"data_holdout/{k:03d}.txt").read_text().strip()])
            noise = torch.randn((1, *x0.shape[1:]), generator=torch.Generator().manual_seed(5 + k))
            for s in SIGMAS:
                t = torch.tensor([1000.0 * s])
                model_in, timestep, mask = cond.apply(add_noise(x0, noise, t), t, first)
                pred = dit(model_in, timestep, [text[0]])
                assert mask[:, :, 0].sum() == 0 and mask[:, :, 1:].min() == 1
                out[s] += float(masked_mse(pred, noise - x0, mask)) / 3
    return out


# ~34 s, one 2-rank launch of several jobs; validation and EMA of two experts stay in CI (test_experts_train.py)
# (docs/tests.md, "Kept out of CI")
@pytest.mark.slow
@pytest.mark.multirank
def test_validation_and_ema_across_zero_stages_resume_and_sequence_parallel(tmp_path):
    helpers.make_world(tmp_path, count=2, holdout=3)
    jobs = [{"config": str(job_yaml(tmp_path, "z0", zero=0)), "resume": "none", "init": True},
            {"config": str(job_yaml(tmp_path, "z3", zero=3)), "resume": "none"},
            {"config": str(job_yaml(tmp_path, "r3", zero=3)),
             "resume": str(tmp_path / "out/z3/checkpoints/step_000000002")},
            {"config": str(job_yaml(tmp_path, "sp", zero=3, lora=False, steps=2, sp=2)), "resume": "none"}]
    ranks.run_jobs(tmp_path, jobs, timeout=600)
    check_launch(tmp_path)


def check_launch(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    z0, z3, r3, sp = (_metrics(tmp_path, n) for n in ("z0", "z3", "r3", "sp"))
    keys = ["val_loss"] + [f"val_loss@{s:g}" for s in SIGMAS]
    ema_keys = [k.replace("val_loss", "val_loss_ema") for k in keys]
    # validated at step 0 and every step; the held-out loss is that of the base model at step 0
    assert sorted(s for s in z0 if "val_loss" in z0[s]) == [0, 1, 2, 3, 4]
    expected = _expected_val_loss(tmp_path)
    for s in SIGMAS:
        assert z0[0][f"val_loss@{s:g}"] == pytest.approx(expected[s], rel=1e-5)
    assert z0[0]["val_loss"] == pytest.approx(sum(expected.values()) / 3, rel=1e-5)
    assert z0[4]["val_loss"] != pytest.approx(z0[0]["val_loss"], rel=1e-3)  # training moved it
    assert z0[4]["val_loss_ema"] != pytest.approx(z0[4]["val_loss"], rel=1e-4)  # the EMA is another model
    # ZeRO-3 reports what ZeRO-0 reports
    for step in range(5):
        for k in keys + ema_keys:
            assert z3[step][k] == pytest.approx(z0[step][k], rel=1e-5, abs=1e-7), (step, k)
    # the relaunch from step 2 reports exactly the uninterrupted run's figures at steps 3 and 4
    assert sorted(s for s in r3 if "val_loss" in r3[s]) == [3, 4]
    for step in (3, 4):
        for k in keys + ema_keys:
            assert r3[step][k] == z3[step][k], (step, k)
    # one sequence group holding every item: the same step-0 figures as two data-parallel ranks
    for k in keys:
        assert sp[0][k] == pytest.approx(z0[0][k], rel=1e-5)

    # EMA exports: ZeRO-0 = ZeRO-3 = resumed, and = the EMA of the raw exports' trajectory
    out = tmp_path / "out"
    e0, e3, er = (_lora_native(out / f"{n}/{n}_ema_000000004.safetensors") for n in ("z0", "z3", "r3"))
    # the raw weights of ZeRO-0 and ZeRO-3 drift apart by float rounding (~1e-5 after 4 steps at this
    # lr); an average of them can differ by no more than the largest raw difference
    drift = max(max((a[n] - b[n]).abs().max().item() for n in a) for a, b in (
        (_lora_native(out / f"z0/z0_{s:09d}.safetensors"), _lora_native(out / f"z3/z3_{s:09d}.safetensors"))
        for s in range(1, 5)))
    assert drift < 1e-4
    assert max((e0[n] - e3[n]).abs().max().item() for n in e0) <= drift + 1e-7
    assert all(torch.equal(e3[n], er[n]) for n in e3)
    init = load_file(str(out / "z0/init.safetensors"))
    ema = {n: init[n] for n in e0}
    for step in range(1, 5):
        raw = _lora_native(out / f"z0/z0_{step:09d}.safetensors")
        ema = {n: DECAY * ema[n] + (1 - DECAY) * raw[n] for n in ema}
    assert all((ema[n] - e0[n]).abs().max() < 1e-6 for n in ema)
    assert any((raw[n] - e0[n]).abs().max() > 1e-4 for n in ema)  # not the raw weights
    assert (out / "z0/z0_ema.safetensors").read_bytes() == (out / "z0/z0_ema_000000004.safetensors").read_bytes()

    # full fine-tune under ZeRO-3 + SP: the EMA folder equals the EMA of base -> step 1 -> step 2
    from video_dit.families.wan.loading import load_dit

    full = {n: t for n, t in load_file(str(tmp_path / "base.safetensors")).items()}
    for step in (1, 2):
        raw = load_dit(str(out / f"sp/sp_{step:09d}")).state_dict()
        full = {n: DECAY * full[n] + (1 - DECAY) * raw[n] for n in full}
    got = load_dit(str(out / "sp/sp_ema")).state_dict()
    assert max((got[n] - full[n]).abs().max().item() for n in full) < 1e-6
    assert max((got[n] - raw[n]).abs().max().item() for n in full) > 1e-4



def test_validation_items_carry_their_sound_in_a_job_with_sound(tmp_path):
    """A validation item with an audio track, in a job whose model generates sound, is read with it (its audio
    loss validated: `val_loss_audio`); in a job without sound it is the picture alone."""
    from video_dit.data.demo_av import make_demo_av_data
    from video_dit.train.config import ValidationConfig
    from video_dit.train.validation import item_scan
    from video_dit.typed_config import parse

    make_demo_av_data(tmp_path / "data", count=2, frames=9, size=32, seed=0, holdout=1, audio_rate=8000)
    cfg = parse(ValidationConfig, {"validation_items": [
        {"image_path": str(tmp_path / "data_holdout/000.mp4"), "prompt": "a red square moving right"}]}, "v")
    ds = [_dataset(tmp_path / "data", do_i2v=True)]
    with_sound = item_scan(cfg, ds, 16, "replace", verbose=False, audio=True)
    assert [(it.has_audio, it.audio_span is not None) for it in with_sound] == [(True, True)]
    silent_job = item_scan(cfg, ds, 16, "replace", verbose=False)
    assert [(it.has_audio, it.audio_span) for it in silent_job] == [(False, None)]
