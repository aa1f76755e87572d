"""Fixtures of the fault suite: one tiny world and one uninterrupted reference run, shared by all files."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import fault_harness as h  # noqa: E402


@pytest.fixture(scope="session")
def world(tmp_path_factory) -> Path:
    return h.make_world(tmp_path_factory.mktemp("faults"))


@pytest.fixture(scope="session")
def reference(world) -> Path:
    """The uninterrupted run every fault is compared with: 2 ranks, ZeRO-2 LoRA, 6 steps, checkpoints at
    2, 4, 6; records the batches of each step and dumps the full trainable state at each save."""
    cfg = h.job_yaml(world, "ref")
    h.launch_ranks(world, 2, [{"config": str(cfg), "resume": "none", "dump": True}])
    out = world / "out" / "ref"
    assert sorted(h.losses(out)) == [1, 2, 3, 4, 5, 6]
    return out
