"""CPU ranks leave no shared memory behind: DeepSpeed's CPU accelerator creates one /dev/shm
segment per rank for its shm allreduce (when LOCAL_SIZE says every rank is on this node, as its
launcher sets) and never unlinks it; `engine.init_distributed` unlinks each rank's own once all
have mapped them, and collectives still work.

In the same launch, `CPUAllocationTracker` around gloo collectives (the ones sequence parallelism
runs): an in-place all_reduce adds nothing, all_to_all_single and all_gather add exactly the receive
buffers the caller allocates, and once those are dropped `settled_live` is back at 0 (gloo's worker
threads hold a finished collective's tensors a moment after wait() returns)."""

from __future__ import annotations

import json
import os

import pytest
import ranks

WORKER = r"""
import json, os, sys
import torch, torch.distributed as dist
from video_dit.parallel import process as engine

port = os.environ["MASTER_PORT"]
ours = lambda: sorted(n for n in os.listdir("/dev/shm") if f"_{port}_" in n)
seen = {}
unlink = engine.unlink_cpu_allreduce_buffer
def recording():
    seen["before"] = ours()
    unlink()
engine.unlink_cpu_allreduce_buffer = recording
rank, world = engine.init_distributed(60)
x = torch.full((1000,), float(rank + 1))
dist.all_reduce(x)
dist.barrier()
out = {"before": seen["before"], "after": ours(), "sum": float(x.sum())}

from video_dit.parallel.memory import CPUAllocationTracker
send = torch.arange(2000, dtype=torch.float32) + 10000 * rank  # 8,000 bytes, made before the tracker
live = {}
with CPUAllocationTracker() as tracker:
    dist.all_reduce(send)
    live["all_reduce"] = tracker.settled_live()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send)
    live["all_to_all"] = tracker.settled_live()
    parts = [torch.empty_like(send) for _ in range(2)]
    dist.all_gather(parts, send)
    live["all_gather"] = tracker.settled_live()
    ok = bool(torch.equal(parts[0], send) and torch.equal(parts[1], send)
              and torch.equal(recv[1000 * rank:1000 * (rank + 1)], send[1000 * rank:1000 * (rank + 1)]))
    del recv, parts
    live["dropped"] = tracker.settled_live()
out["tracker"] = {**live, "peak": tracker.peak, "received": ok, "sum": float(send.sum())}
open(sys.argv[1] + f"_{rank}.json", "w").write(json.dumps(out))
dist.barrier()
dist.destroy_process_group()
"""


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("cpu_comm")
    procs = ranks.start(["-c", WORKER, str(tmp_path / "out")], tmp_path, tmp_path / "shm", env={"LOCAL_SIZE": 2})
    ranks.wait(procs, tmp_path / "shm", timeout=120)
    return [json.loads((tmp_path / f"out_{rank}.json").read_text()) for rank in range(2)]


def test_cpu_ranks_unlink_their_shm_allreduce_segments(results):
    for out in results:
        assert len(out["before"]) == 2, out        # DeepSpeed made one segment per rank ...
        assert out["after"] == [], out             # ... and none is left once all mapped them
        assert out["sum"] == 1000 * 3.0            # the allreduce still adds both ranks
    assert not [n for n in os.listdir("/dev/shm") if n in out["before"]]


def test_allocation_tracker_counts_a_collectives_receive_buffers(results):
    n = 2000 * 4  # bytes of the sent tensor
    sent = 2 * sum(range(2000)) + 10000 * 2000  # the all_reduce of arange + 0 and arange + 10000
    for out in results:
        t = out["tracker"]
        assert t["received"] and t["sum"] == sent, t
        live = (t["all_reduce"], t["all_to_all"], t["all_gather"], t["dropped"], t["peak"])
        assert live == (0, n, 3 * n, 0, 3 * n), t  # in place: 0; the receive buffers; dropped: 0 again
