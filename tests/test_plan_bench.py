"""The memory plan's validation suites (`video_dit.bench.plan`) compute what they claim.

The GPU suite's configurations cover what its issue asks (ZeRO 0, 2 and 3; LoRA and full; checkpointing
off, on and of some blocks; two token counts; the 1.3B's width; bf16; `auto` timed against every block and
under a cap), and its code runs as is: one configuration end to end at tiny sizes on a CPU rank (its
planned and measured peak, their ratio), and the summary's `auto` checks on given rows. The fake-tensor
check's tracker sees what the real run's does (same peak as `CPUAllocationTracker` on real tensors), and
the plan matches it on a small DiT through both kernel paths.
"""

from __future__ import annotations

import json

import pytest
import torch

from video_dit.bench import plan as bench
from video_dit.families.wan.config import DiTConfig

GiB = 2 ** 30


def test_gpu_configurations_cover_the_issue(tmp_path):
    from PIL import Image

    Image.new("RGB", (64, 64)).save(tmp_path / "still.png")  # a job names a dataset
    configs = bench.GPU_CONFIGS
    assert len([c for c in configs if not c.get("layers")]) >= 8
    assert {c["zero"] for c in configs} == {0, 2, 3}
    assert {bool(c["lora"]) for c in configs} == {True, False}
    kinds = {"off" if c["ckpt"] is False else "on" if c["ckpt"] is True else "auto" if c["ckpt"] == "auto" else
             "partial" for c in configs}
    assert kinds == {"off", "on", "partial", "auto"}
    assert {c["bucket"] for c in configs} == set(bench.GPU_BUCKETS) and len(bench.GPU_BUCKETS) == 2
    assert bench.gpu_dit_config(configs[0], small=False).dim == 1536
    job = bench.gpu_job(configs[3], False, str(tmp_path), str(tmp_path / "out"))
    assert job.process.train.dtype == "bf16" and job.process.train.gradient_checkpointing == 4
    timed = [c for c in configs if c.get("timed")]
    assert {c["ckpt"] for c in timed} == {"auto", True} and all(c["layers"] == 30 for c in timed)
    assert any(c.get("cap_gib") and c["ckpt"] == "auto" for c in configs)


@pytest.mark.slow  # ~8 s, the GPU suite's harness at tiny sizes (docs/tests.md, "Kept out of CI")
def test_gpu_suite_runs_a_configuration_at_tiny_sizes_on_cpu(tmp_path):
    res = bench.run_gpu(small=True, only=[3])  # ZeRO-2, LoRA, the first of 4 blocks checkpointed (tiny preset)
    (row,) = res["rows"]
    assert "error" not in row, row.get("error")
    assert row["blocks"] == 2 and row["layers"] == 4 and row["planned_gib"] > 0 and row["measured_gib"] > 0
    assert row["ratio"] == pytest.approx(row["planned_gib"] / row["measured_gib"])
    assert abs(row["ratio"] - 1) <= bench.GPU_TOLERANCE  # the plan holds at this size too
    assert res["within_tolerance"] == 1 and res["measured"] == 1
    out = tmp_path / "plan.json"
    bench.write_json(res, str(out))
    assert json.loads(out.read_text())["rows"][0]["name"] == row["name"]


def test_zero2_gradient_partition_comes_after_the_activations_on_one_rank():
    """ZeRO-2 makes its gradient partition at the reduce bucket's first reduction, in the backward epilogue when
    every trainable gradient fits the bucket: the plan counts it there, not beside the activations' peak. One CPU
    rank through the trainer's set-up (`--small`'s one-rank ZeRO-2 row: a full fine-tune, every block
    checkpointed, bf16, a bucket just over the 208,896 trainable parameters): the planned peak within 5% of the
    measured one (0.961 measured: the batch's 0.25 MiB of inputs is what the plan leaves out), where counting
    the partition beside the activations, as the plan did, is 9% over (the issue's row, width 384 at 9x256x384,
    went from 1.084 to 0.998)."""
    from video_dit.families.wan import FAMILY as WAN
    from video_dit.train.plan import model_sizes

    i = next(i for i, c in enumerate(bench.SMALL) if c.get("ranks") == 1 and c["zero"] == 2)
    c = bench.SMALL[i]
    (row,) = bench.run_cpu(small=True, only=[i])["rows"]
    partition = model_sizes(bench.dit_config(c), None, torch.bfloat16, WAN).trainable * 4  # float32, one rank
    assert partition <= c["reduce_bucket"] * 4  # the case: every gradient fits the bucket
    assert abs(row["ratio"] - 1) <= 0.05, row
    assert row["phase"] == "backward" and row["predicted_split_gib"]["gradients"] == 0
    assert row["predicted_gib"] * GiB + partition > 1.08 * row["measured_gib"] * GiB  # the old count fails


def test_gpu_summary_checks_auto_against_every_block_and_the_cap():
    def row(c, **kw):
        return {"name": bench.gpu_name(c), "config": c, "blocks": 0, "layers": 30, "planned_gib": 1.0,
                "measured_gib": 1.0, "ratio": 1.0, **kw}

    auto, every, capped = bench.GPU_CONFIGS[-3:]
    res = bench.gpu_summary([row(auto, step_s=2.0, ratio=1.02), row(every, blocks=30, step_s=2.67),
                             row(capped, blocks=15, measured_gib=35.2, ratio=0.97),
                             {"name": "x", "config": bench.GPU_CONFIGS[0], "skipped": "budget"}])
    assert res["auto"]["speedup"] == pytest.approx(2.67 / 2.0) and res["auto"]["blocks"] == 0
    assert res["auto_capped"]["blocks"] == 15 and res["auto_capped"]["cap_gib"] == bench.AUTO_CAP_GIB
    assert res["measured"] == 3 and res["configs"] == 4 and res["max_rel_error"] == pytest.approx(0.03)


CFG = DiTConfig(in_dim=16, out_dim=16, dim=128, ffn_dim=512, freq_dim=32, text_dim=32, num_heads=2, num_layers=4,
                text_len=8)


def test_fake_tracker_sees_the_real_peak():
    """`FakeAllocationTracker` on real CPU tensors gives `CPUAllocationTracker`'s peak (the same rule)."""
    from video_dit.families.wan.dit import VideoDiT
    from video_dit.parallel.memory import CPUAllocationTracker

    torch.manual_seed(0)
    model = VideoDiT(CFG)
    model.enable_gradient_checkpointing()
    x, t, ctx = torch.randn(1, 16, 4, 16, 16), torch.tensor([500.0]), [torch.randn(8, 32)]
    model(x, t, ctx).square().mean().backward()  # the gradients exist before the measured steps
    peaks = []
    for tracker in (CPUAllocationTracker, bench.FakeAllocationTracker):
        with tracker() as tr:
            model(x, t, ctx).square().mean().backward()
        peaks.append(tr.peak)
    assert peaks[0] == peaks[1] > 0


@pytest.mark.parametrize("kernels", [pytest.param("triton", marks=pytest.mark.slow), "torch"])  # triton: ~5 s more
def test_fake_check_matches_the_plan_on_a_small_dit(kernels):
    if kernels == "triton":
        pytest.importorskip("triton")
    configs = [dict(lora=8, ckpt=False, bucket="b"), dict(lora=None, ckpt=True, bucket="b"),
               dict(lora=8, ckpt=2, bucket="b")]
    res = bench.fake_check(configs, kernels=kernels, cfg=CFG, buckets={"b": (4, 16, 16)})
    assert [r["tokens"] for r in res["rows"]] == [256] * 3
    assert res["max_rel_error"] <= 0.1, res["rows"]
