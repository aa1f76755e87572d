"""Faults 5 and 6 in one 2-rank run of the product's path (`video_dit.train.trainer.run`):

- NaN batches: the 3rd batch is NaN on rank 1 only (ranks must agree to skip it, or their collectives
  would desynchronise); batches 6.. are NaN everywhere, and `max_nonfinite_steps: 3` stops the job
  (exit 3) with the step-4 checkpoint as the last good one.
- previews: sample 0's control image is corrupt (it exists, so validation passes; it fails when
  rendered): each render of it is logged and training goes on; sample 1 renders every time.
"""

from __future__ import annotations

import math
import re

import pytest
from safetensors.torch import load_file

import fault_harness as h

pytestmark = pytest.mark.multirank


@pytest.fixture(scope="module")
def nan_run(world):
    bad = world / "corrupt_ctrl.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 64)
    caption = (world / "data_holdout/000.txt").read_text().strip()
    samples = [{"prompt": caption, "ctrl_img": str(bad)},
               {"prompt": caption, "ctrl_img": str(world / "data_holdout/000.png")}]
    cfg = h.job_yaml(world, "nan", samples=samples, sample_every=2, max_nonfinite=3)
    codes, logs, _ = h.launch_ranks(world, 2, [{"config": str(cfg), "resume": "none", "run": True}],
                                    fault="nan_batch:3:rank:1,nan_batch:6-99", check=False)
    return world / "out" / "nan", codes, logs


def test_nan_batches_are_skipped_then_stop_the_job(nan_run):
    out, codes, logs = nan_run
    from video_dit.train.trainer import EXIT_NONFINITE

    assert codes == [EXIT_NONFINITE, EXIT_NONFINITE], logs[-4000:]
    assert "non-finite loss at step 3 on 1 rank(s); batch skipped (1/3 in a row)" in logs
    assert re.search(r"3 non-finite losses in a row; stopping\. The last good checkpoint is \S*step_000000004",
                     logs), logs[-4000:]
    losses = h.losses(out)
    assert sorted(losses) == [1, 2, 3, 4] and all(math.isfinite(v) for v in losses.values())
    ck = out / "checkpoints"
    assert (ck / "latest").read_text().strip() == "step_000000004"
    assert sorted(p.name for p in ck.iterdir() if p.name.startswith("step_")) == ["step_000000002", "step_000000004"]
    lora = load_file(str(out / "nan_000000004.safetensors"))
    assert all(bool(v.isfinite().all()) for v in lora.values())


def test_failing_preview_is_logged_and_training_continues(nan_run):
    out, _, logs = nan_run
    for step in (0, 2, 4):
        assert re.search(rf"preview 0 at step {step} failed: MediaError: \S*corrupt_ctrl\.png", logs), logs[-4000:]
        assert (out / "samples" / f"{step:09d}_1.mp4").is_file()
        assert not (out / "samples" / f"{step:09d}_0.mp4").exists()
