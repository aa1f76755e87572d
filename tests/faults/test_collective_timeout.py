"""Collectives have timeouts: with a peer that is alive but stuck (no dropped connection for anyone to
notice), the rank waiting in a collective fails after the job file's `deepspeed.timeout_s` instead of
hanging. Through the trainer: 2 ranks of `trainer.run` on a job with `timeout_s: 10`; rank 1 stalls
(sleeps, alive) in the middle of step 2 (`VIDEO_DIT_FAULT=stall_rank1_at_step:2`)."""

from __future__ import annotations

import re
import time

import pytest
import ranks

import fault_harness as h

pytestmark = pytest.mark.multirank
TIMEOUT_S = 10  # long enough for the ranks' start-up skew on a busy machine (every collective is bounded)


@pytest.mark.slow  # ~29 s, two launches and a 10 s collective timeout (docs/tests.md, "Kept out of CI")
def test_deepspeed_timeout_s_of_the_job_bounds_a_stuck_peer(world, reference):
    cfg = h.job_yaml(world, "stuck", steps=3, timeout_s=TIMEOUT_S)
    procs, prefix = ranks.start_jobs(world, [{"config": str(cfg), "resume": "none", "run": True}], 2,
                                     fault="stall_rank1_at_step:2")
    (rank0, log0), (rank1, log1) = procs
    try:
        rc0 = rank0.wait(timeout=180)
        exited = time.time()
    finally:
        rank1.kill()
        rank1.wait()
        log0.close()
        log1.close()
    out0, out1 = (prefix.parent / f"{prefix.name}_rank{r}.log" for r in (0, 1))
    out0, out1 = out0.read_text(), out1.read_text()
    stalled = re.search(r"FAULT INJECTED .* rank 1 stalls in the middle of step 2 at t=([\d.]+)", out1)
    assert stalled, out1[-3000:]
    assert rc0 not in (0, None), out0[-3000:]
    assert re.search(r"[Tt]imed out|[Tt]imeout", out0), out0[-3000:]
    waited = exited - float(stalled.group(1))
    # the job's 10 s, not the 30 min default: rank 0 reached the collective of step 2 right away
    assert TIMEOUT_S - 1 <= waited < TIMEOUT_S + 30, (waited, out0[-3000:])
    assert sorted(h.losses(world / "out" / "stuck")) == [1]  # step 1 trained; step 2 never completed
