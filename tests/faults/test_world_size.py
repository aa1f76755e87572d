"""Fault 4: resume with another number of ranks, 2 -> 1 and 1 -> 2 (ZeRO-2 LoRA).

The trainer converts the ZeRO checkpoint to DeepSpeed's universal format by itself (once, beside the
checkpoint) and loads it with `load_universal`. Checked against the uninterrupted 2-rank reference:
  - the full trainable state right after loading (fp32 params, Adam moments, step, LR position)
    equals the state the saving run had when it wrote the checkpoint, exactly;
  - the data order continues the epoch where it stopped: the batches trained by 2 ranks (steps 1-2),
    then 1 rank (steps 3-5), then 2 ranks again (step 6), in global order, are the reference run's
    order, so no item of an epoch is repeated or skipped.
"""

from __future__ import annotations

import pytest
from safetensors.torch import load_file

import fault_harness as h

pytestmark = pytest.mark.multirank


def _flat(rows):
    """Global batch order of (step, rank, indices) rows: step-major, rank-minor."""
    return [i for _, _, idx in sorted(rows) for i in idx]


def _assert_same_state(saved, loaded):
    a, b = load_file(str(saved)), load_file(str(loaded))
    assert set(a) == set(b) and any(k.startswith("exp_avg_sq/") for k in a)
    for k in a:
        assert (a[k] == b[k]).all(), k


def test_resume_2_to_1_to_2_ranks(world, reference):
    w1 = h.job_yaml(world, "w1")
    _, log1, _ = h.launch_ranks(world, 1, [{"config": str(w1), "resume": str(reference / "checkpoints/step_000000002"),
                                            "dump": True, "stop_at": 5}])
    assert "converting it to DeepSpeed's universal format" in log1
    out1 = world / "out" / "w1"
    _assert_same_state(reference / "state_saved_2.safetensors", out1 / "state_start_2.safetensors")

    w2 = h.job_yaml(world, "w2")
    _, log2, _ = h.launch_ranks(world, 2, [{"config": str(w2), "resume": str(out1 / "checkpoints/step_000000005"),
                                            "dump": True}])
    assert "converting it to DeepSpeed's universal format" in log2
    out2 = world / "out" / "w2"
    _assert_same_state(out1 / "state_saved_5.safetensors", out2 / "state_start_5.safetensors")
    assert sorted(h.losses(out1)) == [3, 4, 5] and sorted(h.losses(out2)) == [6]

    ref_rows = h.trained_items(reference)
    resumed = [r for r in ref_rows if r[0] <= 2] + h.trained_items(out1) + h.trained_items(out2)
    order, ref_order = _flat(resumed), _flat(ref_rows)
    assert [r[1] for r in h.trained_items(out1)] == [0, 0, 0] and len(h.trained_items(out2)) == 2
    assert order == ref_order[:len(order)] and len(order) == h.CLIPS + 3
    assert sorted(order[:h.CLIPS]) == list(range(h.CLIPS))  # epoch 0: every item exactly once
