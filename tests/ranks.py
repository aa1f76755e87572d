"""Start a test script as N gloo ranks (subprocesses with torch.distributed's env) and wait for them.

Multi-rank tests run their own file as the worker (`python tests/test_x.py --worker ...`); each
rank's output goes to `<log_prefix>_rank<r>.log`, and a failed launch raises with those logs.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def start(argv: list[str], cwd: Path, log_prefix: Path, world: int = 2) -> list:
    """Start `python *argv` on `world` ranks (1 thread each, CPU only); returns [(process, log)]."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
        log = open(f"{log_prefix}_rank{rank}.log", "w")
        procs.append((subprocess.Popen([sys.executable, *argv], env=env, cwd=cwd, stdout=log,
                                       stderr=subprocess.STDOUT), log))
    return procs


def wait(procs: list, log_prefix: Path, timeout: int = 300) -> None:
    """Wait for every rank; raise AssertionError with the failed ranks' log tails."""
    failed = []
    for rank, (proc, log) in enumerate(procs):
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = "timeout"
        log.close()
        if rc != 0:
            failed.append((rank, rc))
    if failed:
        logs = "\n".join(f"--- rank {r} (rc {rc}):\n" + Path(f"{log_prefix}_rank{r}.log").read_text()[-4000:]
                         for r, rc in failed)
        raise AssertionError(f"launch {Path(log_prefix).name} failed: {failed}\n{logs}")
