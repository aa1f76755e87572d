"""A step that runs out of device memory (CUDA's `torch.OutOfMemoryError`, injected on a CPU rank by
`VIDEO_DIT_FAULT=oom_rank1_at_step:3`) through `./launch/train.sh` on 2 ranks: the job ends at once
with exit 5 and one line from the rank that ran out (the step, the bucket, the planned and the
measured peak, what would lower it, the last complete checkpoint), every rank is stopped, and the
last checkpoint stays intact and resumable."""

from __future__ import annotations

import re

import pytest

import fault_harness as h

pytestmark = pytest.mark.multirank


@pytest.mark.slow  # ~36 s, a 2-rank launch run until its allocation fails (docs/tests.md, "Kept out of CI")
def test_out_of_memory_ends_the_job_with_one_line_and_keeps_the_checkpoint(world):
    from video_dit.train.trainer import EXIT_OUT_OF_MEMORY

    cfg = h.job_yaml(world, "oom", steps=6, save_every=2, timeout_s=600)
    run = h.train_sh(world, cfg, fault="oom_rank1_at_step:3")
    out = run["output"]
    assert run["rc"] == EXIT_OUT_OF_MEMORY and not run["leftover"], (run["rc"], out[-3000:])
    lines = [line for line in out.splitlines() if "out of memory: step" in line]
    assert len(lines) == 1, out[-3000:]  # one line, from the rank that ran out
    line = lines[0]
    assert re.search(r"rank 1: out of memory: step 3, bucket 9x32x32 \(3x4x4 latents, \d+ tokens\), .*measured peak "
                     r"[\d.]+ GiB, planned [\d.]+ GiB of [\d.]+ GiB per rank; what would lower it \(planned peak\): "
                     r"train\.gradient_checkpointing: true -> [\d.]+ GiB", line), line
    assert re.search(r"last complete checkpoint is \S*step_000000002", line), line
    ck = world / "out" / "oom" / "checkpoints"
    assert (ck / "latest").read_text().strip() == "step_000000002"
    assert not list(ck.glob("*.tmp"))
    # the checkpoint resumes: the relaunch (no fault) trains on from step 2 to the end
    again = h.train_sh(world, cfg)
    assert again["rc"] == 0 and re.search(r"resumed from \S*step_000000002 at step 2", again["output"]), \
        again["output"][-3000:]
