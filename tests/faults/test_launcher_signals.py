"""Signals to `./launch/train.sh`'s process, with real DeepSpeed ranks on a mixed i2v folder.

Two launches of one job, as a user (or `timeout`, a scheduler, a closed terminal) would:
  A  train.steps 200; once a checkpoint at step >= 4 exists, SIGKILL to the launcher's PID (not its
     process group): no handler runs there, the watchdog kills the ranks.
  B  the same command with train.steps raised to 400: resumes from A's last checkpoint, the cosine
     re-stretched from there (engine.LRSchedule.extended); after one more checkpoint, SIGTERM to
     the launcher's PID: the ranks are killed, one line names the step and the last checkpoint.
Asserted: no process of the job survives either signal by more than a few seconds, B resumes from
the checkpoint A left, metrics.jsonl is the run's history (each step once), the LR of every step
follows the documented rule (computed here), and the stills of the do_i2v folder trained
unconditioned (announced at start-up; every epoch holds them, and no step crashed).
"""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import time

import pytest
import yaml
from PIL import Image

import fault_harness as h

# two real launches (20-40 s of start-up on an idle 2-core machine before any step) are past the CI
# budget: `-m slow`. In CI, tests/test_launcher.py checks the same Supervisor with stand-in ranks.
pytestmark = [pytest.mark.multirank, pytest.mark.slow]
GONE_S = 5  # from the signal to the last process of the job


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    root = h.helpers.make_world(tmp_path_factory.mktemp("signals"), count=4)
    for i in range(2):  # two stills next to the clips of a do_i2v dataset
        Image.new("RGB", (32, 32), (200, 40 + 80 * i, 40)).save(root / "data" / f"still{i}.png")
        (root / "data" / f"still{i}.txt").write_text(f"a still picture number {i}")
    return root


def _set_steps(cfg, steps):
    job = yaml.safe_load(cfg.read_text())
    job["config"]["process"][0]["train"]["steps"] = steps
    cfg.write_text(yaml.safe_dump(job))


def _start(root, cfg, log):
    return subprocess.Popen(["bash", str(h.ROOT / "launch/train.sh"), str(cfg), "--master_port", str(h.free_port())],
                            env=h.rank_env(), cwd=root, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def _latest_step(ck) -> int:
    try:
        return int((ck / "latest").read_text().strip().split("_")[1])
    except (OSError, IndexError, ValueError):
        return 0


def _wait(proc, log, condition, timeout=240):
    end = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, f"the job ended early (rc {proc.returncode}):\n{log.read_text()[-3000:]}"
        assert time.monotonic() < end, log.read_text()[-3000:]
        time.sleep(0.1)


def _signal_and_reap(proc, sig):
    sent = time.monotonic()
    os.kill(proc.pid, sig)  # the launcher's PID only
    proc.wait(timeout=GONE_S + 10)
    left = h.session_left(proc.pid, GONE_S)
    h.kill_session(proc.pid)
    return left, time.monotonic() - sent


@pytest.fixture(scope="module")
def runs(mixed):
    cfg = h.job_yaml(mixed, "sig", steps=200, save_every=2, keep=3, timeout_s=120)
    out = mixed / "out" / "sig"
    ck = out / "checkpoints"
    a_log, b_log = mixed / "a.log", mixed / "b.log"
    a = _start(mixed, cfg, a_log)
    try:
        _wait(a, a_log, lambda: _latest_step(ck) >= 4)
        a_left, a_s = _signal_and_reap(a, signal.SIGKILL)
    finally:
        h.kill_session(a.pid)
    resumed_at = _latest_step(ck)
    _set_steps(cfg, 400)
    b = _start(mixed, cfg, b_log)
    try:
        _wait(b, b_log, lambda: _latest_step(ck) >= resumed_at + 2)
        b_left, b_s = _signal_and_reap(b, signal.SIGTERM)
    finally:
        h.kill_session(b.pid)
    return {"out": out, "a": a_log.read_text(), "b": b_log.read_text(), "a_rc": a.returncode, "b_rc": b.returncode,
            "a_left": a_left, "b_left": b_left, "a_s": a_s, "b_s": b_s, "resumed_at": resumed_at,
            "b_latest": _latest_step(ck)}


def test_sigkill_to_the_launcher_ends_every_rank(runs):
    assert runs["a_rc"] == -signal.SIGKILL and runs["a_left"] == [], runs["a"][-3000:]
    assert runs["a_s"] < GONE_S + 10
    # the stills trained unconditioned, as the start-up summary says
    assert "2 still image(s) in do_i2v datasets train unconditioned" in runs["a"]


def test_relaunch_resumes_and_sigterm_ends_it_with_one_line(runs):
    b, at = runs["b"], runs["resumed_at"]
    assert re.search(rf"resumed from \S*step_{at:09d} at step {at}\b", b), b[-3000:]
    assert runs["b_rc"] == 128 + signal.SIGTERM and runs["b_left"] == [], b[-3000:]
    last = runs["b_latest"]
    line = re.search(r"\[video_dit\] interrupted \(SIGTERM\) after step (\d+) of 400; last checkpoint "
                     rf"\S*step_{last:09d} \(step {last}\); relaunch the same command to resume from it", b)
    assert line, b[-3000:]
    assert "Traceback" not in b and "KeyboardInterrupt" not in b
    assert b.rstrip().endswith(line.group(0))  # nothing after it
    steps = [r["step"] for r in h.helpers.metrics(runs["out"])]
    assert steps == list(range(1, len(steps) + 1)) and steps[-1] >= int(line.group(1)) >= last


def test_the_lr_of_every_step_follows_the_documented_rule(runs):
    """Steps 1..s0 of A: warmup 2, cosine to 0 at 200. From B's resume at s0 with train.steps 400:
    c (1 + cos(pi (s - s0) / (400 - s0))) / 2 with c = A's multiplier at s0 (step s + 1 trains at
    lr x multiplier(s), s 0-based)."""
    lr, w, s0 = 1e-2, 2, runs["resumed_at"]

    def cosine(s, start, total):
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (s - start) / (total - start))))

    def old(s):
        return (s + 1) / w if s < w else cosine(s, w, 200)

    assert "train.steps 200 -> 400: the cosine is re-stretched from the LR it had at the resumed step" in runs["b"]
    rows = h.helpers.metrics(runs["out"])
    for r in rows:
        s = r["step"] - 1
        want = lr * (old(s) if r["step"] <= s0 else old(s0) * cosine(s, s0, 400))
        assert r["lr"] == pytest.approx(want, rel=1e-9), (r["step"], r["lr"], want)
    after = [r for r in rows if r["step"] > s0]
    assert after and after[0]["lr"] == pytest.approx(lr * old(s0), rel=1e-9)  # no jump at the resume
    assert after[0]["lr"] != pytest.approx(lr * cosine(s0, w, 400), rel=1e-6)  # not the 400-step cosine's value
