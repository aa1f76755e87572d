"""The memory planner (`video_dit.train.plan`, `video-dit plan`, train.sh's pre-launch check).

The activation model is checked against what the DiT really keeps: every tensor storage the forward
and backward create, followed by `CPUAllocationTracker`, on a tiny DiT in this process (saved after
the forward exactly, the step's peak within 10%), for full and LoRA training, with and without block
checkpointing, without RecomputeSaved (`train.recompute_saved: false`), with the CLIP image branch (I2V,
FLF2V; LoRA on img_emb). Bad input (capacities that are not numbers, zero GPUs, SP degrees that do not divide
the heads) and a bucket that cannot fit anywhere are named; train.sh's check refuses, warns or stays
off by `deepspeed.memory_check`. (Predictions against 2 DeepSpeed ranks: `video-dit bench --suite plan`.)
"""

from __future__ import annotations

import helpers
import pytest
import torch

from video_dit.commands import plan as plan_cmd
from video_dit.families.wan import FAMILY as WAN
from video_dit.families.wan.config import DiTConfig
from video_dit.families.wan.dit import VideoDiT
from video_dit.families.wan.memory import activation_bytes
from video_dit.parallel.memory import CPUAllocationTracker
from video_dit.train.plan import Setting

CFG = DiTConfig(in_dim=16, out_dim=16, dim=64, ffn_dim=256, freq_dim=32, text_dim=32, num_heads=2, num_layers=2,
                text_len=16)
GRID = (4, 12, 12)  # 4 x 6 x 6 = 144 tokens


# (LoRA rank, block checkpointing (True: every block, an int: the first n of 3), CLIP images (0: no image
#  branch, 1: I2V, 2: FLF2V), LoRA on img_emb, RecomputeSaved without checkpointing (`train.recompute_saved`))
CASES = [(None, False, 0, False, True), (None, True, 0, False, True), (4, False, 0, False, True),
         (4, True, 0, False, True), (None, False, 2, False, True), (4, True, 1, True, True),
         (None, False, 0, False, False), (4, False, 0, False, False),
         (None, 1, 0, False, True), (4, 2, 0, False, True), (None, 2, 0, False, False)]
# (compute dtype, kernels): float32; bf16 as a GPU job stores it (float32 trainable masters under bf16 autocast,
# the float32 residual stream) through the torch path and through the fused ops (`kernels: triton`: on CPU their
# torch implementations, which save what the Triton kernels save)
PRECISIONS = [(torch.float32, "torch"), (torch.bfloat16, "torch"), (torch.bfloat16, "triton")]


@pytest.mark.parametrize("dtype,kernels", PRECISIONS, ids=["fp32", "bf16", "bf16-fused"])
@pytest.mark.parametrize("lora,checkpointing,images,img_emb,recompute", CASES)
def test_activation_model_equals_what_autograd_keeps(lora, checkpointing, images, img_emb, recompute, dtype, kernels):
    from dataclasses import replace

    from video_dit.families.wan.dit import cast_dit

    if kernels == "triton":
        pytest.importorskip("triton")
    cfg = replace(CFG, image_dim=32, image_tokens=17, num_images=images) if images else CFG
    partial = checkpointing is not True and checkpointing is not False
    if partial:
        cfg = replace(cfg, num_layers=3)
    torch.manual_seed(0)
    model = VideoDiT(cfg)
    helpers.randomize_head(model)
    if lora:
        from video_dit.lora import add_lora

        add_lora(model, lora, targets=WAN.lora_targets(img_emb))  # the trainer's targets (`Family.lora_targets`)
    cast_dit(model, dtype, masters=True)  # the trainer's storage: trainable float32, the frozen bulk in dtype
    model.set_kernels(kernels)
    if checkpointing is True:
        model.enable_gradient_checkpointing()
    elif partial:
        model.set_checkpointed_blocks(checkpointing)
    model.set_recompute_saved(recompute)
    g = torch.Generator().manual_seed(1)
    x, t = torch.randn(1, 16, *GRID, generator=g), torch.tensor([300.0])
    context = [torch.randn(CFG.text_len, CFG.text_dim, generator=g)]
    clip = torch.randn(1, cfg.image_context_len, 32, generator=g) if images else None
    target = torch.randn(1, 16, *GRID, generator=g)
    model(x, t, context, clip_fea=clip).float().sum().backward()  # gradients allocated before the measured step
    with CPUAllocationTracker() as tracker:
        loss = (model(x, t, context, clip_fea=clip).float() - target).square().mean()
        saved = tracker.live
        loss.backward()
    setting = Setting(0, checkpointing=bool(checkpointing), recompute=recompute,
                      checkpoint_blocks=checkpointing if partial else None)
    predicted = activation_bytes(cfg, GRID, setting, lora_rank=lora, s=dtype.itemsize, lora_img_emb=img_emb,
                                 fused=kernels == "triton")
    # the forward keeps what the derivation lists (the loss keeps (pred - target) where the model output was)
    if lora:  # LoRA: the tracker does not find the frozen head's saved statistics live (2 Ll 4 + T D 4 bytes)
        assert 0 <= predicted.saved - (saved - 4) <= 2 * 144 * 4 + 64 * 4
    else:
        assert saved - 4 == predicted.saved  # 4: the loss itself
    assert predicted.peak == pytest.approx(tracker.peak, rel=0.1), (predicted.parts, tracker.peak)


def test_recompute_saved_off_is_the_same_math_kept_instead_of_recomputed():
    """`train.recompute_saved: false` through the trainer's `make_trainable`: no block stores recipes,
    and the loss and every gradient equal those of the default (RecomputeSaved on), the same ops run."""
    from types import SimpleNamespace

    from video_dit.train.build import make_trainable

    results = []
    for on in (True, False):
        torch.manual_seed(0)
        model = VideoDiT(CFG)
        helpers.randomize_head(model)
        process = SimpleNamespace(model=SimpleNamespace(attention_backend="native"), network=None,
                                  train=SimpleNamespace(gradient_checkpointing=False, recompute_saved=on,
                                                      compile=False))
        make_trainable(model, process, torch.float32, family=WAN)
        assert all(block.recompute is on for block in model.blocks)
        g = torch.Generator().manual_seed(1)
        x, t = torch.randn(2, 16, *GRID, generator=g), torch.tensor([300.0, 700.0])
        context = [torch.randn(CFG.text_len, CFG.text_dim, generator=g) for _ in range(2)]
        loss = (model(x, t, context) - torch.randn(2, 16, *GRID, generator=g)).square().mean()
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (loss_on, grads_on), (loss_off, grads_off) = results
    torch.testing.assert_close(loss_off, loss_on, rtol=0, atol=0)
    for name, grad in grads_on.items():
        torch.testing.assert_close(grads_off[name], grad, rtol=1e-6, atol=1e-9, msg=name)


def test_adamw_step_holds_the_temporaries_the_plan_counts():
    """The optimizer step's transient on CPU ranks (`plan.adam_temporaries`): torch's AdamW as the trainer builds
    it (`engine.build_optimizer`), stepping a float32 tensor whose moments exist, allocates exactly that much at
    its highest point, two tensors of its size; the plan counted one, and under ZeRO-3 came out 10% low
    (`video-dit bench --suite plan`, the one-rank rows)."""
    from types import SimpleNamespace

    from video_dit.train.engine import build_optimizer
    from video_dit.train.plan import adam_temporaries

    n = 3 * 2 ** 16
    param = torch.nn.Parameter(torch.randn(n))
    train = SimpleNamespace(lr=1e-4, optimizer="adamw", steps=10, lr_scheduler="constant", warmup_steps=0,
                            optimizer_params=SimpleNamespace(betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01))
    optimizer, _ = build_optimizer([param], train)
    param.grad = torch.randn(n)
    optimizer.step()  # the first step makes the moments
    with CPUAllocationTracker() as tracker:
        optimizer.step()
    assert tracker.peak == adam_temporaries(n, cuda=False) == 2 * n * 4
    assert tracker.live == 0


def run_plan(capsys, *argv):
    code = plan_cmd.main(_args(*argv))
    out = capsys.readouterr()
    return code, out.out + out.err


def _args(*argv):
    import argparse

    p = argparse.ArgumentParser()
    plan_cmd.add_arguments(p)
    return p.parse_args(list(argv))


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    root = tmp_path_factory.mktemp("plan")
    helpers.make_world(root, count=1, holdout=0)
    return helpers.write_job(root, "plan_job")


def test_plan_table_names_buckets_and_a_bucket_that_fits_nowhere(job, capsys):
    code, out = run_plan(capsys, str(job), "--gpus", "2", "--gpu-mem", "24", "--bucket", "9x32x32")
    assert code == 0 and "9x32x32" in out and "yes" in out
    code, out = run_plan(capsys, str(job), "--gpus", "2", "--gpu-mem", "2", "--bucket", "81x4096x4096")
    assert code == 1
    assert "bucket 81x4096x4096" in out and "does not fit anywhere" in out and "largest sequence-parallel degree" in out


def test_plan_bad_input_names_the_option(job, capsys, tmp_path):
    for argv, option in ((["--gpu-mem", "lots"], "--gpu-mem"), (["--host-mem", "-1"], "--host-mem"),
                         (["--gpu-mem", "inf"], "--gpu-mem")):
        with pytest.raises(SystemExit):
            _args(str(job), *argv)
        assert option in capsys.readouterr().err
    code, out = run_plan(capsys, str(job), "--gpus", "0", "--gpu-mem", "80")
    assert code == 2 and "--gpus must be >= 1" in out
    code, out = run_plan(capsys, str(job), "--gpus", "3", "--gpu-mem", "80", "--nodes", "2")
    assert code == 2 and "--nodes 2" in out
    code, out = run_plan(capsys, str(job), "--gpus", "1", "--gpu-mem", "80", "--bucket", "8x32x32")
    assert code == 2 and "--bucket 8x32x32" in out and "frame counts its VAE encodes" in out and "e.g. 5x32x32" in out
    bad_sp = helpers.write_job(tmp_path, "bad_sp", helpers.train_process(job.parent, deepspeed={"sequence_parallel_size": 3}))
    code, out = run_plan(capsys, str(bad_sp), "--gpus", "6", "--gpu-mem", "80")
    assert code == 2 and "sequence_parallel_size" in out and "heads" in out


def test_plan_splits_a_global_batch_over_the_ranks_it_plans(job, capsys, tmp_path):
    """`train.global_batch_size: 16` at `batch_size: 8`: on 8 GPUs each rank holds micro-batches of 2, so its
    plan is the plan of `batch_size: 2` (and not of 8); 3 GPUs cannot split it (exit 2, naming the key)."""
    def plan_of(name, train, gpus):
        path = helpers.write_job(tmp_path, name, helpers.train_process(job.parent, train=train))
        code, out = run_plan(capsys, str(path), "--gpus", str(gpus), "--gpu-mem", "80", "--bucket", "9x32x32")
        return code, out[out.find("memory plan:"):] if code == 0 else out  # the table (not an import's warning)

    code, global16 = plan_of("g16", {"batch_size": 8, "global_batch_size": 16}, 8)
    assert code == 0
    assert global16.replace("g16", "?") == plan_of("b2", {"batch_size": 2}, 8)[1].replace("b2", "?")
    assert global16.replace("g16", "?") != plan_of("b8", {"batch_size": 8}, 8)[1].replace("b8", "?")
    code, out = plan_of("g16", {"batch_size": 8, "global_batch_size": 16}, 3)
    assert code == 2 and "train.global_batch_size" in out and "over 3 data-parallel ranks" in out


def test_train_sh_check_refuses_warns_or_stays_off(job, tmp_path, capsys):
    from video_dit.train import validate

    # 64 CPU ranks on this host leave each rank less than nothing: predicted not to fit
    assert validate.main(["--plan", "--", str(job), "--num_gpus", "64"]) == 2
    err = capsys.readouterr().err
    assert "deepspeed.memory_check" in err and "predicted not to fit" in err and "memory plan:" in err
    # what train.sh runs (video_dit.train.launcher): the same refusal, before any rank starts
    from video_dit.train import launcher

    assert launcher.main([str(job), "--num_gpus", "64"]) == 2
    err = capsys.readouterr().err
    assert "deepspeed.memory_check" in err and "predicted not to fit" in err and "OK (" not in err
    for mode, expected in (("warn", "warning: predicted not to fit"), ("off", None)):
        path = helpers.write_job(tmp_path, f"check_{mode}",
                                 helpers.train_process(job.parent, deepspeed={"memory_check": mode}))
        assert validate.main(["--plan", "--", str(path), "--num_gpus", "64"]) == 0
        err = capsys.readouterr().err
        assert (expected in err) if expected else "memory plan:" not in err
    for bad in ("0", "two"):  # train.sh's launcher arguments are checked as the plan reads them
        assert validate.main(["--plan", "--", str(job), "--num_gpus", bad]) == 2
        err = capsys.readouterr().err
        assert "deepspeed.memory_check" in err and f"--num_gpus takes a whole number >= 1, got '{bad}'" in err
    assert validate.main([str(job), "--plan"]) == 0  # what train.sh starts here (2 CPU ranks or the GPUs) fits
    assert "memory plan:" in capsys.readouterr().err
