"""CPU ranks leave no shared memory behind: DeepSpeed's CPU accelerator creates one /dev/shm
segment per rank for its shm allreduce (when LOCAL_SIZE says every rank is on this node, as its
launcher sets) and never unlinks it; `engine.init_distributed` unlinks each rank's own once all
have mapped them, and collectives still work."""

from __future__ import annotations

import json
import os

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
open(sys.argv[1] + f"_{rank}.json", "w").write(json.dumps(out))
dist.barrier()
dist.destroy_process_group()
"""


def test_cpu_ranks_unlink_their_shm_allreduce_segments(tmp_path):
    procs = ranks.start(["-c", WORKER, str(tmp_path / "out")], tmp_path, tmp_path / "shm", env={"LOCAL_SIZE": 2})
    ranks.wait(procs, tmp_path / "shm", timeout=120)
    for rank in range(2):
        out = json.loads((tmp_path / f"out_{rank}.json").read_text())
        assert len(out["before"]) == 2, out        # DeepSpeed made one segment per rank ...
        assert out["after"] == [], out             # ... and none is left once all mapped them
        assert out["sum"] == 1000 * 3.0            # the allreduce still adds both ranks
    assert not [n for n in os.listdir("/dev/shm") if n in out["before"]]
