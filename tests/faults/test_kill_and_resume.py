"""Faults 1-3 through the product's command, `./launch/train.sh CONFIG` (DeepSpeed launcher, 2 CPU ranks).

One job, relaunched the way a user would after each fault (the launches are the cost, so the three
faults follow each other; each test asserts one fault's outcome):
  K1  rank 0 is SIGKILLed between two files of the step-4 checkpoint   -> test_kill_between_checkpoint_files
  K2  relaunch: the half-written folder is removed with a warning, the run resumes from step 2;
      rank 1 is SIGKILLed in the middle of step 5                         -> test_sigkill_mid_step
  K3  relaunch: resumes from step 4; the disk is 'full' at the step-6 save -> test_disk_full_during_save
The per-step losses after each resume equal the uninterrupted reference run's exactly (fp32, same seed).
`timeout_s` is 600: the bounded exits below come from the launcher and the dropped connections, not
from a collective timing out (that bound is tested in test_collective_timeout.py).
"""

from __future__ import annotations

import hashlib
import re

import pytest

import fault_harness as h
from video_dit.train.trainer import EXIT_SAVE_FAILED

pytestmark = pytest.mark.multirank
BOUND_S = 60  # from the injected kill to the launcher's exit (the machine may be busy)


def _tree_hashes(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


def _killed_at(output: str) -> float:
    m = re.search(r"FAULT INJECTED .* at t=([\d.]+)", output)
    assert m, output[-3000:]
    return float(m.group(1))


@pytest.fixture(scope="module")
def chain(world, reference):
    cfg = h.job_yaml(world, "k", timeout_s=600)
    out = world / "out" / "k"
    ck = out / "checkpoints"
    runs = {"k1": h.train_sh(world, cfg, fault="kill_during_save:after_file:3")}  # file 3: step 4's first
    tmp = ck / "step_000000004.tmp"
    runs["after_k1"] = {"latest": (ck / "latest").read_text().strip(), "names": sorted(p.name for p in ck.iterdir()),
                        "tmp_files": sorted(p.name for p in tmp.iterdir()) if tmp.is_dir() else []}
    runs["k2"] = h.train_sh(world, cfg, fault="kill_rank1_at_step:5")
    runs["latest_after_k2"] = (ck / "latest").read_text().strip()
    runs["step4_before_k3"] = _tree_hashes(ck / "step_000000004")
    runs["k3"] = h.train_sh(world, cfg, fault="enospc_on_save")
    return out, runs


def _same_losses(out, reference, steps):
    """Exactly equal: same world size, fp32, the same (seed, rank, step, position) noise, and the
    checkpoint restores parameters, Adam moments, LR position, data position and RNG states."""
    got, want = h.losses(out), h.losses(reference)
    for s in steps:
        assert got[s] == want[s], (s, got[s], want[s])


def test_kill_between_checkpoint_files(chain, reference):
    out, runs = chain
    k1 = runs["k1"]
    assert k1["rc"] not in (0, "timeout"), k1["output"][-3000:]
    assert "after checkpoint file 3" in k1["output"]
    assert k1["end"] - _killed_at(k1["output"]) < BOUND_S and not k1["leftover"]
    after = runs["after_k1"]
    # the half-written step-4 folder holds some of DeepSpeed's files but never became "latest"
    assert after["latest"] == "step_000000002"
    assert "step_000000004" not in after["names"] and "step_000000004.tmp" in after["names"]
    assert "mp_rank_00_model_states.pt" in after["tmp_files"] and "meta.json" not in after["tmp_files"]
    # the next start removes it with a warning and loads the previous checkpoint
    k2 = runs["k2"]["output"]
    assert re.search(r"removing incomplete checkpoint \S*step_000000004\.tmp", k2), k2[-3000:]
    assert re.search(r"resumed from \S*step_000000002 at step 2", k2), k2[-3000:]
    _same_losses(out, reference, [1, 2, 3, 4])


def test_sigkill_mid_step(chain, reference):
    out, runs = chain
    k2 = runs["k2"]
    assert k2["rc"] not in (0, "timeout"), k2["output"][-3000:]
    assert "SIGKILL rank 1 in the middle of step 5" in k2["output"]
    # rank 0 was blocked in a collective: the launcher saw rank 1 die and ended the job, every rank gone
    assert k2["end"] - _killed_at(k2["output"]) < BOUND_S and not k2["leftover"]
    assert runs["latest_after_k2"] == "step_000000004"
    # relaunching the same command resumes from the last complete checkpoint with the same losses
    k3 = runs["k3"]["output"]
    assert re.search(r"resumed from \S*step_000000004 at step 4", k3), k3[-3000:]
    _same_losses(out, reference, [5, 6])


def test_disk_full_during_save(chain):
    out, runs = chain
    k3 = runs["k3"]
    # exit 4 (EXIT_SAVE_FAILED) from rank 0, passed on by DeepSpeed's launcher (the first non-zero rank's code)
    assert k3["rc"] == EXIT_SAVE_FAILED and not k3["leftover"], (k3["rc"], k3["output"][-3000:])
    msg = re.search(r"error: rank 0: could not write checkpoint step_000000006 .*", k3["output"])
    assert msg, k3["output"][-3000:]
    assert "No space left on device" in msg.group(0) and "step_000000004 is intact" in msg.group(0)
    ck = out / "checkpoints"
    assert (ck / "latest").read_text().strip() == "step_000000004"
    assert not (ck / "step_000000006").exists()  # a half-written step_000000006.tmp is removed at the next start
    assert _tree_hashes(ck / "step_000000004") == runs["step4_before_k3"]  # untouched
