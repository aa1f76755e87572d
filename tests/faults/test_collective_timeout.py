"""Collectives have timeouts: with a peer that is alive but stuck (no dropped connection for anyone to
notice), a rank waiting in an all-reduce fails after the job's `deepspeed.timeout_s` instead of hanging."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

import fault_harness as h

pytestmark = pytest.mark.multirank

SCRIPT = """
import sys, time, torch, torch.distributed as dist
from video_dit.train.engine import init_distributed
rank, world = init_distributed(timeout_s=10)
if rank == 1:
    time.sleep(120)  # stuck: never joins the collective
t0 = time.monotonic()
try:
    dist.all_reduce(torch.ones(1))
except RuntimeError as exc:
    print(f"TIMED OUT after {time.monotonic() - t0:.1f}s: {type(exc).__name__}", flush=True)
    sys.exit(5)
sys.exit(0)
"""


def test_a_stuck_peer_times_out_the_collective(tmp_path):
    port = h.free_port()
    procs = [subprocess.Popen([sys.executable, "-c", SCRIPT], cwd=tmp_path, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True,
                              env=h.rank_env(RANK=r, LOCAL_RANK=r, WORLD_SIZE=2, MASTER_ADDR="127.0.0.1",
                                             MASTER_PORT=port)) for r in range(2)]
    try:
        out, _ = procs[0].communicate(timeout=100)
    finally:
        procs[1].kill()
        procs[1].wait()
    assert procs[0].returncode == 5, out[-3000:]
    waited = float(out.split("TIMED OUT after ")[1].split("s:")[0])
    assert 8 <= waited < 40, out
